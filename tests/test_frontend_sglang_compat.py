"""SGLang's benchmark programs on frontend_lang with only the import changed (issue 12): programs that
call programs (traced, never run, while tracing), ``run`` returning at once, ``with s.var_scope(...)``,
``REGEX_*``, ``forks += lambda i: ...`` and the benchmark helpers of ``frontend_lang.test_utils`` /
``frontend_lang.utils``. The programs have the shapes of SGLang's tip_suggestion, json_decode_regex
and line_retrieval benchmarks."""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import regex as regex_module  # transformers' dependency: partial matches
from frontend_util import FakeBackend
from server_harness import ServerProcess

import frontend_lang as sgl
from frontend_lang import ir
from frontend_lang.test_utils import add_common_sglang_args_and_parse, select_sglang_backend
from frontend_lang.utils import dump_state_text, read_jsonl

pytest_plugins = ["frontend_fixtures", "server_fixtures"]

# SGLang's values (sglang.lang.ir), written out: the oracle when sglang is not installed.
SGLANG_REGEX = {
    "REGEX_INT": r"[-+]?[0-9]+[ \n]*",
    "REGEX_FLOAT": r"[-+]?[0-9]*\.?[0-9]+[ \n]*",
    "REGEX_BOOL": r"(True|False)",
    "REGEX_STR": r"\"[\w\d\s]*\"",
}

SHOT = (
    "Expand a tip into one paragraph.\n\nTopic: tea\nTip: use fresh water\n"
    "Paragraph: Water that has boiled twice tastes flat, so start from cold fresh water.\n\n"
)


# -- tip_suggestion's shape: the outer program calls an inner program per generated tip ---------------
@sgl.function
def expand_tip(s: Any, topic: str, tip: str) -> None:
    s += SHOT + "Topic: " + topic + "\nTip: " + tip + "\nParagraph:"
    s += sgl.gen("paragraph", max_tokens=6, stop=["\n\n"], temperature=0)


@sgl.function
def suggest_tips(s: Any, topic: str) -> None:
    s += "You give useful tips.\nUSER: Give some tips for " + topic + ".\nASSISTANT: Here are 2 tips:\n"
    paragraphs = []
    for i in (1, 2):
        s += f"{i}." + sgl.gen(f"tip_{i}", max_tokens=5, stop=[".", "\n"]) + ".\n"
        paragraphs.append(expand_tip(topic=topic, tip=s[f"tip_{i}"]))
    for i in (1, 2):
        s += f"Tip {i}:" + paragraphs[i - 1]["paragraph"] + "\n"


def _recording(backend: Any, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every native request the backend sends from now on (the test's end undoes the wrapper)."""
    calls: list[dict[str, Any]] = []
    real = backend._call
    monkeypatch.setattr(backend, "_call", lambda payload: calls.append(payload) or real(payload))
    return calls


def test_tracing_traces_a_called_program_and_sends_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = FakeBackend()
    monkeypatch.setattr(sgl.global_config, "default_backend", backend)  # as the benchmark sets one
    g = suggest_tips.trace()
    assert backend.prompts == [] and backend.cached == []  # nothing ran, nothing was sent
    assert g.complete and g.prefix == "You give useful tips.\nUSER: Give some tips for "
    calls = [n for n in g.nodes if n.kind == "call"]
    assert [(n.name, n.stream) for n in calls] == [("expand_tip", 0)] * 2
    for i, call in enumerate(calls, start=1):
        (head,) = g.successors(call.id, "call")
        stream = g.nodes[head].stream
        assert stream == call.detail["stream"] and g.kinds(stream) == ["program", "text", "gen"]
        text, gen = (n for n in g.nodes if n.stream == stream and n.kind in ("text", "gen"))
        # the callee's prompt uses the caller's argument and the tip the caller generated
        data = [e.src for e in g.edges if e.dst == text.id and e.kind == "data"]
        assert {(g.nodes[n].kind, g.nodes[n].name) for n in data} == {
            ("argument", "topic"),
            ("gen", f"tip_{i}"),
        }
        # and the caller's "Tip i:" line uses that call's paragraph (not the other call's)
        (uses,) = g.successors(gen.id, "data")
        assert g.nodes[uses].stream == 0 and (g.nodes[uses].text or "").startswith(f"Tip {i}:")


def test_run_batch_of_a_program_that_calls_programs(
    fl_backend: sgl.EngineBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tip_suggestion as its benchmark runs it: default backend, run_batch, inner calls by ``()``.
    Oracle: every request is real text (no placeholder marker) and each paragraph equals the inner
    program run alone on the tip the outer generated."""
    monkeypatch.setattr(sgl.global_config, "default_backend", fl_backend)
    calls = _recording(fl_backend, monkeypatch)
    topics = ["staying healthy", "baking bread", "learning chess"]
    states = suggest_tips.run_batch([{"topic": t} for t in topics], temperature=0, progress_bar=False)
    assert all(s.error() is None for s in states), [s.error() for s in states]
    texts = [str(c.get("text")) for c in calls]
    assert not [t for t in texts if "\x00" in t]  # tracing sent nothing (it used to run expand_tip)
    assert len(calls) == 1 + 4 * len(topics)  # the precached prefix, then 2 tips + 2 paragraphs each
    assert texts[0] == suggest_tips.trace().prefix
    for s, topic in zip(states, topics, strict=True):
        for i in (1, 2):
            alone = expand_tip.run(topic=topic, tip=s[f"tip_{i}"], backend=fl_backend)
            assert f"Tip {i}:{alone['paragraph']}\n" in s.text()


# -- run() returns at once; reading waits ---------------------------------------------------------
@sgl.function
def two_gens(s: Any, fail: bool = False) -> None:
    s += "a" + sgl.gen("x") + "b" + sgl.gen("y")
    if fail:
        raise ZeroDivisionError("after queuing")


def test_run_returns_at_once_and_reading_waits() -> None:
    # NOTE: margins of a second: a loaded 2-core CI machine must not make these flaky.
    backend = FakeBackend(delay=1.0)
    t0 = time.perf_counter()
    s = two_gens.run(backend=backend)
    assert time.perf_counter() - t0 < 0.8  # the two gens (2 s) have not run yet
    assert s["x"] == "ok"
    assert s.sync() is None and time.perf_counter() - t0 >= 2.0
    assert (s.text(), s["y"], s.error()) == ("aokbok", "ok", None)
    # an error raised by the function after queuing is not lost: it is the state's once read
    t0 = time.perf_counter()
    s = two_gens.run(fail=True, backend=backend)
    assert time.perf_counter() - t0 < 0.8
    assert isinstance(s.error(), ZeroDivisionError) and s.text() == "aokbok"  # the queued gens ran


def test_called_programs_run_concurrently(monkeypatch: pytest.MonkeyPatch) -> None:
    @sgl.function
    def part(s: Any, i: int) -> None:
        s += f"part {i}:" + sgl.gen("p")

    @sgl.function
    def whole(s: Any) -> list[str]:
        parts = [part(i=i) for i in range(4)]  # each returns at once, so all four run together
        for p in parts:
            s += p["p"] + ";"
        return [p.text() for p in parts]

    backend = FakeBackend(delay=1.0)
    monkeypatch.setattr(sgl.global_config, "default_backend", backend)
    t0 = time.perf_counter()
    s = whole.run()
    assert s.ret_value == [f"part {i}:ok" for i in range(4)] and s.text() == "ok;" * 4
    assert backend.max_active == 4 and time.perf_counter() - t0 < 3.0  # one after another: >= 4 s


def test_called_program_runs_on_the_callers_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    @sgl.function
    def inner(s: Any) -> None:
        s += "in " + sgl.gen("g")

    @sgl.function
    def outer(s: Any) -> str:
        return str(inner()["g"])

    monkeypatch.setattr(sgl.global_config, "default_backend", FakeBackend(reply="default"))
    assert outer.run(backend=FakeBackend(reply="mine")).ret_value == "mine"
    assert outer.run().ret_value == "default"


def test_stream_run_waits_for_values_the_function_has_not_queued_yet() -> None:
    @sgl.function
    def with_tool(s: Any) -> str:
        s += "q" + sgl.gen("a")
        first = s["a"]
        time.sleep(0.3)  # a tool call in Python: the executor is idle, "b" is not queued yet
        s += " then " + sgl.gen("b")
        return str(first)

    t0 = time.perf_counter()
    s = with_tool.run(stream=True, backend=FakeBackend(delay=1.0))
    assert time.perf_counter() - t0 < 0.6
    assert s["b"] == "ok" and s.ret_value == "ok" and s.text() == "qok then ok"
    assert "".join(with_tool.run(stream=True, backend=FakeBackend()).text_iter()) == "qok then ok"

    @sgl.function
    def broken(s: Any) -> None:
        s += "x" + sgl.gen("a")
        time.sleep(0.1)
        raise ZeroDivisionError("in a thread")

    s = broken.run(stream=True, backend=FakeBackend())
    assert isinstance(s.error(), ZeroDivisionError) and s["a"] == "ok"
    with pytest.raises(sgl.ProgramError) as info:
        broken.run(stream=True, backend=FakeBackend())["never"]
    assert isinstance(info.value.__cause__, ZeroDivisionError)


# -- with s.var_scope(...) and REGEX_* (json_decode_regex's shape) ---------------------------------
REGEX_LIST = r"\[(" + sgl.REGEX_STR + ", )*" + sgl.REGEX_STR + r"\]"
FIELDS = [("name", sgl.REGEX_STR + ","), ("latitude", sgl.REGEX_FLOAT + ","),
          ("population", sgl.REGEX_INT + ","), ("capital", sgl.REGEX_BOOL + ","),
          ("landmarks", REGEX_LIST)]  # fmt: skip


@sgl.function
def city_json(s: Any, document: str) -> str:
    s += "Extract the city of this page.\nPage begin.\n" + document + "\nPage end.\nJSON:\n"
    with s.var_scope("json_output"):
        s += "{\n"
        for name, regex in FIELDS:
            s += f'  "{name}": ' + sgl.gen(name, max_tokens=12, regex=regex) + "\n"
        s += "}\n"
    return str(s["json_output"])  # read inside the program, as the benchmark's warm-up does


class ConstrainedFake(FakeBackend):
    def supports_constraints(self) -> bool:
        return True


def test_var_scope_captures_the_text_of_its_block() -> None:
    s = city_json.run(document="Paris.", backend=ConstrainedFake(reply="V"))
    body = "{\n" + "".join(f'  "{name}": V\n' for name, _ in FIELDS) + "}\n"
    assert s.error() is None and s["json_output"] == body == s.ret_value
    assert s.text().endswith("JSON:\n" + body)
    kinds = city_json.trace().kinds()
    assert kinds[kinds.index("var_scope_begin") + 1 : kinds.index("var_scope_end")].count("gen") == 5


def test_regex_constants_are_sglangs() -> None:
    for name, value in SGLANG_REGEX.items():
        assert getattr(sgl, name) == getattr(ir, name) == value, name
        re.compile(value)
    try:
        source = metadata.distribution("sglang").locate_file("sglang/lang/ir.py")
    except metadata.PackageNotFoundError:
        return
    tree = ast.parse(Path(str(source)).read_text())  # read, not imported: importing sglang is heavy
    theirs = {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
              for t in node.targets if isinstance(t, ast.Name) and t.id.startswith("REGEX_")
              and isinstance(node.value, ast.Constant)}  # fmt: skip
    assert theirs == SGLANG_REGEX


def _check_city_json(states: list[sgl.ProgramState]) -> None:
    """Oracle: the scoped variable is exactly the block's text rebuilt from the generated values, and
    every value matches its regex (the random model often runs into max_tokens: then a prefix of a
    match)."""
    for s in states:
        assert s.error() is None, s.error()
        body = "{\n" + "".join(f'  "{name}": {s[name]}\n' for name, _ in FIELDS) + "}\n"
        assert s["json_output"] == body and s.text().endswith("JSON:\n" + body)
        for name, regex in FIELDS:
            cut = s.get_meta_info(name)["finish_reason"]["type"] == "length"
            assert regex_module.fullmatch(regex, s[name], partial=cut), (name, s[name])


def test_json_decode_regex_on_the_engine(fl_backend: sgl.EngineBackend) -> None:
    docs = [{"document": "Paris is the capital of France."}, {"document": "Lyon lies on the Rhone."}]
    states = city_json.run_batch(docs, temperature=0, backend=fl_backend, progress_bar=False)
    _check_city_json(states)


# -- forks += lambda i: ... / a list (line_retrieval's shape) ---------------------------------------
@sgl.function
def line_retrieval(s: Any, prefix: str, suffix: str, body_0: str, body_1: str, body_2: str, how: str) -> None:
    s += prefix + "\n"
    contexts = [body_0, body_1, body_2]
    forks = s.fork(len(contexts), [i * 1000 for i in range(len(contexts))])
    if how == "lambda":
        forks += lambda i: contexts[i] + "\n"
    elif how == "list":
        forks += [c + "\n" for c in contexts]
    else:
        forks += contexts[:2]  # one item short
    forks.join(mode="concate_and_append")
    s += "\n" + suffix + sgl.gen("answer", max_tokens=4)


def test_fork_group_takes_a_callable_or_one_item_per_branch() -> None:
    args = {"prefix": "P", "suffix": "Q?", "body_0": "l0", "body_1": "l1", "body_2": "l2"}
    for how in ("lambda", "list"):
        backend = FakeBackend(reply="A")
        s = line_retrieval.run(how=how, backend=backend, **args)
        assert s.error() is None and s.text() == "P\nl0\nl1\nl2\n\nQ?A", (how, s.error())
        assert backend.prompts == ["P\nl0\nl1\nl2\n\nQ?"] and backend.cached == ["P\n"]
    err = line_retrieval.run(how="short", backend=FakeBackend(), **args).error()
    assert isinstance(err, ValueError) and "2 items for 3 branches" in str(err)
    g = line_retrieval.trace(how="lambda")
    assert g.complete and g.kinds().count("branch") == 3
    branch_texts = [n.text for n in g.nodes if n.kind == "text" and n.stream > 0]
    assert branch_texts == [f"\x00arg:body_{i}\x00\n" for i in range(3)]


# -- the benchmark helpers ------------------------------------------------------------------------
def test_read_jsonl_and_dump_state_text(tmp_path: Path) -> None:
    data = tmp_path / "questions.jsonl"
    data.write_text('# a comment\n{"a": 1}\n\n{"a": [2, "x"]}\n')
    assert read_jsonl(data) == [{"a": 1}, {"a": [2, "x"]}]
    s = two_gens.run(backend=FakeBackend(reply="R"))
    out = tmp_path / "out.txt"
    dump_state_text(str(out), [s, "plain", 7])
    rule = "=" * 40
    want = "".join(f"{rule} {i} {rule}\n{t}\n{'=' * 80}\n\n" for i, t in enumerate(["aRbR", "plain", "7"]))
    assert out.read_text() == want
    dump_state_text(out, ["more"], mode="a")
    assert out.read_text() == want + f"{rule} 0 {rule}\nmore\n{'=' * 80}\n\n"


def _parse(monkeypatch: pytest.MonkeyPatch, *argv: str) -> argparse.Namespace:
    monkeypatch.setattr(sys, "argv", ["bench_sglang.py", *argv])
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-path", type=str, default="questions.jsonl")
    parser.add_argument("--num-questions", type=int, default=20)
    return add_common_sglang_args_and_parse(parser)


def test_benchmark_args_and_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    args = _parse(monkeypatch)
    assert (args.parallel, args.host, args.port, args.backend, args.device) == (
        64, "127.0.0.1", 30000, "srt", "auto"
    )  # fmt: skip
    assert (args.result_file, args.raw_result_file, args.num_questions) == ("result.jsonl", None, 20)
    seen: list[str] = []
    monkeypatch.setattr("frontend_lang.backends.RuntimeEndpoint", lambda url: seen.append(url) or url)
    for host, port, url in [("127.0.0.1", 30000, "http://127.0.0.1:30000"),
                            ("http://10.0.0.2", 8000, "http://10.0.0.2:8000"),  # older SGLang's --host
                            ("::1", 30001, "http://[::1]:30001")]:  # fmt: skip
        args = _parse(monkeypatch, "--host", host, "--port", str(port))
        assert select_sglang_backend(args) == url
    assert seen == ["http://127.0.0.1:30000", "http://10.0.0.2:8000", "http://[::1]:30001"]
    with pytest.raises(ValueError, match="Invalid backend"):
        select_sglang_backend(_parse(monkeypatch, "--backend", "vllm"))
    # a script that defines --model-path itself still parses
    monkeypatch.setattr(sys, "argv", ["bench.py", "--model-path", "m"])
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", type=str)
    assert add_common_sglang_args_and_parse(parser).model_path == "m"


def test_benchmark_script_runs_against_a_server(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """json_decode_regex's main, as ported: --port picks the server, read_jsonl the data, run_batch the
    work, dump_state_text the output."""
    data = tmp_path / "questions.jsonl"
    docs = ["Paris is the capital of France.", "Lyon lies on the Rhone.", "Nice is by the sea."]
    data.write_text("".join(json.dumps({"document": d}) + "\n" for d in docs))
    args = _parse(monkeypatch, "--port", str(server.port), "--data-path", str(data), "--num-questions", "2",
                  "--parallel", "2")  # fmt: skip
    backend = select_sglang_backend(args)
    assert isinstance(backend, sgl.RuntimeEndpoint) and backend.base_url == server.url
    try:
        lines = read_jsonl(args.data_path)[: args.num_questions]
        states = city_json.run_batch([{"document": line["document"]} for line in lines], temperature=0,
                                     backend=backend, num_threads=args.parallel, progress_bar=False)  # fmt: skip
        _check_city_json(states)
        out = tmp_path / "tmp_output_srt.txt"
        dump_state_text(out, states)
        assert out.read_text().count("=" * 80 + "\n\n") == 2 and states[1].text() in out.read_text()
    finally:
        backend.shutdown()
