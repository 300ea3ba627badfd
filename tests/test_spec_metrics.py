"""Speculation's numbers: ``spec_verify_ct`` / ``spec_accept_length`` in meta_info (summing to the worker's
counters) and the ``radixrt:spec_*`` series of /metrics labelled with the algorithm."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from radixrt.server.http.metrics import ServerMetrics
from tests.engine_fixtures import prompts_of

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 20}


def _samples(body: bytes) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def test_metrics_carry_the_algorithm() -> None:
    stats = {"spec_verify_steps": 7.0, "spec_accepted_tokens": 12.0, "spec_accept_length": 2.5,
             "spec_skipped_batch_steps": 3.0, "spec_index_nodes": 99.0}  # fmt: skip
    body = _samples(ServerMetrics("m", spec_algorithm="SUFFIX").render(stats))
    assert body["radixrt:spec_accept_length"] == [({"model_name": "m", "algorithm": "SUFFIX"}, 2.5)]
    assert body["radixrt:spec_verify_steps_total"] == [({"model_name": "m", "algorithm": "SUFFIX"}, 7.0)]
    assert body["radixrt:spec_skipped_batch_steps_total"][0][1] == 3.0
    assert body["radixrt:spec_index_nodes"][0][1] == 99.0
    assert not any(k.startswith("radixrt:spec_") for k in _samples(ServerMetrics("m").render(stats)))


def test_meta_info_accept_length_sums_to_the_worker_counters(tiny_llama: Path, engine_factory) -> None:
    prompts = prompts_of([25, 14, 31], seed=71)
    eng = engine_factory(
        tiny_llama, speculative_algorithm="SUFFIX", speculative_verify_cost=1.0, speculative_max_batch_size=64
    )
    eng.generate(input_ids=prompts, sampling_params=GREEDY)  # cold: fills the global index
    before = eng.get_server_info()
    warm = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    after = eng.get_server_info()
    metas = [o["meta_info"] for o in warm]
    assert sum(m["spec_verify_ct"] for m in metas) == after["spec_verify_reqs"] - before["spec_verify_reqs"]
    accepted = [round((m["spec_accept_length"] - 1) * m["spec_verify_ct"]) for m in metas]
    assert sum(accepted) == after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    # warm: the whole greedy continuation is drafted and accepted, 4 drafts + 1 per verify
    assert all(m["spec_accept_length"] >= 4.0 for m in metas), metas
    assert after["spec_index_tokens"] > 0 and after["spec_index_nodes"] > after["spec_index_tokens"]
    plain = engine_factory(tiny_llama).generate(input_ids=prompts[0], sampling_params=GREEDY)
    assert "spec_accept_length" not in plain["meta_info"] and "spec_verify_ct" not in plain["meta_info"]
