"""frontend_lang semantics without a model: state, fork/join, concurrency, roles, chat templates,
errors, tracing (a FakeBackend answers; the chat template oracle is the tokenizer's own Jinja)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from frontend_util import FakeBackend

import frontend_lang as sgl
from frontend_lang.chat_template import NAMED_TEMPLATES, template_for_tokenizer
from radixrt.models.tokenizer import load_tokenizer
from radixrt.testing.random_checkpoint import CHATML_TEMPLATE, qwen_tokenizer_dir

pytest_plugins = ["frontend_fixtures"]


@sgl.function
def chat(s: Any, first: str, second: str, system: bool = True) -> None:
    if system:
        s += sgl.system("You are terse.")
    s += sgl.user(first)
    s += sgl.assistant(sgl.gen("a1", max_tokens=8))
    s += sgl.user(second)
    s += sgl.assistant(sgl.gen("a2", max_tokens=8))


@sgl.function
def one_turn(s: Any, system: bool) -> None:
    if system:
        s += sgl.system("You are terse.")
    s += sgl.user("Hi!")
    s += sgl.assistant(sgl.gen("a1", max_tokens=8))


@pytest.mark.parametrize("system", [True, False])
def test_chat_template_matches_apply_chat_template_qwen(system: bool) -> None:
    """Oracle: the text of a one-turn program is exactly the tokenizer's rendering of its messages
    (the real Qwen3 template: the last assistant turn carries an empty <think> block)."""
    tok = load_tokenizer(qwen_tokenizer_dir())
    backend = FakeBackend(template_for_tokenizer(tok), reply="Sure thing.")
    s = one_turn.run(system=system, backend=backend)
    assert s.error() is None
    msgs = s.messages()
    assert [m["role"] for m in msgs] == ["system"] * system + ["user", "assistant"]
    assert msgs[-1]["content"] == "Sure thing." == s["a1"]
    assert s.text() == tok.apply_chat_template(msgs, tokenize=False)
    # a template that rewrites earlier turns (Qwen3 drops their <think>) still gives append-only text
    backend = FakeBackend(template_for_tokenizer(tok), reply="Sure thing.")
    s = chat.run(first="Hi!", second="And then?", backend=backend)
    assert s.error() is None and len(backend.prompts) == 2
    assert all(s.text().startswith(p) for p in backend.prompts)


def test_chat_template_multi_turn_matches_apply_chat_template(fl_model: Any) -> None:
    """Oracle (ChatML template of the test checkpoint): the whole conversation's text, and the prompt
    each gen saw, are what apply_chat_template writes."""
    tok = load_tokenizer(fl_model)
    backend = FakeBackend(template_for_tokenizer(tok), reply="Sure thing.")
    s = chat.run(first="Hi!", second="And then?", backend=backend)
    msgs = s.messages()
    assert s.error() is None and len(msgs) == 5
    assert s.text() == tok.apply_chat_template(msgs, tokenize=False)
    assert backend.prompts == [
        tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True),
        tok.apply_chat_template(msgs[:4], tokenize=False, add_generation_prompt=True),
    ]


def test_named_templates() -> None:
    """The named chatml table renders like the ChatML Jinja template; the others have their markers."""
    from jinja2 import Template

    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
    ]
    text, history = "", []
    for m in msgs:
        prefix, suffix = NAMED_TEMPLATES["chatml"].role_prefix_suffix(m["role"], history)
        text += prefix + m["content"] + suffix
        history.append(m)
    assert text == Template(CHATML_TEMPLATE).render(messages=msgs, add_generation_prompt=False)
    assert NAMED_TEMPLATES["llama-3"].role_prefix_suffix("user", [])[0].startswith("<|begin_of_text|>")
    assert "You are a helpful assistant." in NAMED_TEMPLATES["qwen"].role_prefix_suffix("user", [])[0]
    assert NAMED_TEMPLATES["mistral"].role_prefix_suffix("user", [])[0] == "<s>[INST] "
    assert NAMED_TEMPLATES["default"].role_prefix_suffix("assistant", []) == ("ASSISTANT: ", "\n")
    with pytest.raises(ValueError, match="unknown template"):
        sgl.get_chat_template("nope")


def test_nested_roles_rejected() -> None:
    @sgl.function
    def nested(s: Any) -> None:
        s += sgl.user("hi " + sgl.assistant("nested"))

    @sgl.function
    def unclosed(s: Any) -> None:
        s += sgl.user_begin() + "hi"
        s += sgl.assistant_begin()
        s += "never"

    for prog in (nested, unclosed):
        s = prog.run(backend=FakeBackend())
        assert isinstance(s.error(), sgl.NestedRoleError), s.error()
        assert "never" not in s.text()


def test_state_variables_meta_and_ret_value() -> None:
    @sgl.function
    def prog(s: Any, x: str) -> str:
        s += "x=" + x + " " + sgl.gen("g", max_tokens=3, stop="\n")
        s["manual"] = 7
        s += sgl.var_scope("scoped", " scoped text")
        s += " pick " + sgl.select("c", choices=["long choice", "short"])
        return s["g"] + "!"

    backend = FakeBackend(reply="GEN")
    s = prog.run(x="1", temperature=0.5, backend=backend)
    assert s.error() is None
    assert s.text() == "x=1 GEN scoped text pick short"
    assert (s["g"], s["manual"], s["scoped"], s["c"], s.ret_value) == (
        "GEN",
        7,
        " scoped text",
        "short",
        "GEN!",
    )
    params = s.get_meta_info("g")["params"]
    assert (params.max_new_tokens, params.temperature, params.stop) == (3, 0.5, "\n")  # gen overrides run
    assert s.get_meta_info("c")["choices_method"] == "token_length_normalized"
    with pytest.raises(KeyError):
        s["never_set"]


def test_exception_inside_program_is_in_error() -> None:
    @sgl.function
    def boom(s: Any) -> None:
        s += "before " + sgl.gen("a", max_tokens=2)
        raise ZeroDivisionError("user bug")

    s = boom.run(backend=FakeBackend())
    assert isinstance(s.error(), ZeroDivisionError) and s["a"] == "ok"
    assert s.ret_value is None


def test_backend_failure_stops_the_program() -> None:
    class Failing(FakeBackend):
        def generate(self, ctx: Any, params: Any) -> Any:
            raise sgl.BackendError("server said no")

    @sgl.function
    def prog(s: Any) -> str:
        s += sgl.gen("a")
        s += "after"
        return str(s["a"])

    s = prog.run(backend=Failing())
    assert isinstance(s.error(), sgl.BackendError)  # the first error; reading s["a"] then failed too
    assert "after" not in s.text()
    with pytest.raises(sgl.ProgramError) as info:
        s["a"]
    assert isinstance(info.value.__cause__, sgl.BackendError)


def test_fork_join_semantics() -> None:
    @sgl.function
    def prog(s: Any, mode: str) -> None:
        s += "root "
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"[b{i}]" + sgl.gen("v", max_tokens=2)
            f["i"] = i
        assert "v" not in s  # branch variables stay in the branches until join
        forks.join(mode)
        s += " end"

    backend = FakeBackend(reply="x")
    s = prog.run(mode="gather_variable", backend=backend)
    assert s.error() is None
    assert (s["v"], s["i"], s.text()) == (["x", "x", "x"], [0, 1, 2], "root  end")
    assert backend.cached == ["root "]  # the shared prefix was committed once, before the branches
    assert sorted(backend.prompts) == ["root [b0]", "root [b1]", "root [b2]"]
    s = prog.run(mode="concate_and_append", backend=FakeBackend(reply="x"))
    assert s.text() == "root [b0]x[b1]x[b2]x end"


def test_fork_branches_run_concurrently() -> None:
    @sgl.function
    def prog(s: Any) -> None:
        s += "q"
        forks = s.fork(4)
        forks += sgl.gen("g", max_tokens=2)  # appends to every branch
        forks.join()

    backend = FakeBackend(delay=0.3)
    t0 = time.perf_counter()
    s = prog.run(backend=backend)
    took = time.perf_counter() - t0
    assert s.error() is None and s["g"] == ["ok"] * 4
    assert backend.max_active == 4 and took < 0.9, (backend.max_active, took)


def test_failed_branch_fails_the_join() -> None:
    class FailSecond(FakeBackend):
        def generate(self, ctx: Any, params: Any) -> Any:
            if ctx.text.endswith("1"):
                raise sgl.BackendError("branch 1 failed")
            return super().generate(ctx, params)

    @sgl.function
    def prog(s: Any) -> None:
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += str(i) + sgl.gen("g")
        forks.join()

    s = prog.run(backend=FailSecond())
    assert isinstance(s.error(), sgl.BackendError) and "branch 1" in str(s.error())


def test_streaming_text_iter_and_async() -> None:
    @sgl.function
    def prog(s: Any) -> None:
        s += "a"
        s += sgl.gen("x")
        s += "b"

    s = prog.run(stream=True, backend=FakeBackend(delay=0.05, reply="XY"))
    assert "".join(s.text_iter()) == "aXYb"
    s = prog.run(stream=True, backend=FakeBackend(reply="XY"))
    assert list(s.text_iter("x")) == ["XY"]

    async def collect() -> str:
        s = prog.run(stream=True, backend=FakeBackend(reply="XY"))
        return "".join([c async for c in s.text_async_iter()])

    assert asyncio.run(collect()) == "aXYb"


def test_trace_graph_shape() -> None:
    @sgl.function
    def prog(s: Any, question: str) -> None:
        s += sgl.system("Be brief.")
        s += sgl.user("Q: " + question)
        s += sgl.assistant(sgl.gen("draft", max_tokens=4))
        forks = s.fork(2)
        for f in forks:
            f += "Critique: " + sgl.gen("critique", max_tokens=4)
        forks.join()
        s += "Final after " + s["draft"] + sgl.select("ok", choices=["yes", "no"])

    g = prog.trace(backend=FakeBackend())
    assert g.complete and g.arguments == ["question"]
    assert g.kinds(0) == [
        "argument", "role_begin", "text", "role_end", "role_begin", "text", "role_end",
        "role_begin", "gen", "role_end", "fork", "join", "text", "select",
    ]  # fmt: skip
    fork = next(n for n in g.nodes if n.kind == "fork")
    join = next(n for n in g.nodes if n.kind == "join")
    branches = g.successors(fork.id, "fork")
    assert len(branches) == 2 and {g.nodes[b].stream for b in branches} == {1, 2}
    for b in branches:
        assert [g.nodes[n].kind for n in _chain(g, b)] == ["branch", "text", "gen"]
    assert len([e for e in g.edges if e.kind == "join" and e.dst == join.id]) == 2
    arg = next(n for n in g.nodes if n.kind == "argument")
    draft = next(n for n in g.nodes if n.kind == "gen" and n.name == "draft")
    (user_text,) = g.successors(arg.id, "data")
    assert g.nodes[user_text].text is not None and g.nodes[user_text].text.startswith("Q: ")
    (final_text,) = g.successors(draft.id, "data")
    assert g.nodes[final_text].text is not None and g.nodes[final_text].text.startswith("Final after ")
    assert g.prefix == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ: "
    assert "digraph" in g.to_dot() and g.to_dict()["complete"] is True


def _chain(g: Any, start: int) -> list[int]:
    out = [start]
    while nxt := g.successors(out[-1], "seq"):
        out.append(nxt[0])
    return out


def test_trace_stops_where_the_program_branches_on_a_value() -> None:
    @sgl.function
    def prog(s: Any, x: str) -> None:
        s += "Fixed. " + sgl.gen("a")
        if s["a"] == "yes":
            s += x

    g = prog.trace(backend=FakeBackend())
    assert not g.complete and "unknown while tracing" in (g.stopped_by or "")
    assert g.prefix == "Fixed. " and g.kinds() == ["argument", "text", "gen"]


def test_run_batch_order_progress_and_precache(capsys: pytest.CaptureFixture[str]) -> None:
    @sgl.function
    def prog(s: Any, i: int) -> int:
        s += "Shared instructions. Item " + str(i) + sgl.gen("g")
        return i

    backend = FakeBackend(delay=0.02)
    states = prog.run_batch([{"i": i} for i in range(12)], backend=backend, num_threads=4)
    assert [s.ret_value for s in states] == list(range(12))
    assert [s.text() for s in states] == [f"Shared instructions. Item {i}ok" for i in range(12)]
    assert backend.cached == ["Shared instructions. Item "] and backend.max_active == 4
    assert "12/12" in capsys.readouterr().err  # tqdm's bar
    prog.run_batch([{"i": 0}, {"i": 1}], backend=backend, progress_bar=False)
    assert "it/s" not in capsys.readouterr().err


def test_multimodal_and_bad_input_are_clear_errors() -> None:
    with pytest.raises(NotImplementedError, match="not supported"):
        sgl.image("cat.png")
    with pytest.raises(NotImplementedError, match="not supported"):
        sgl.video("cat.mp4")
    with pytest.raises(ValueError, match="dtype"):
        sgl.gen("x", dtype=list)
    with pytest.raises(ValueError, match="choices"):
        sgl.select("x", choices=[])
    with pytest.raises(ValueError, match="choices_method"):
        sgl.select("x", choices=["a"], choices_method="best")
    with pytest.raises(RuntimeError, match="no backend"):
        sgl.function(lambda s: None).run()
    assert sgl.gen_int("n").params.to_native()["regex"].startswith("[-+]?")  # type: ignore[attr-defined]
