"""Program-aware retention hints of frontend_lang: which requests carry which ``priority``, and when the
shared prefixes of ``run_batch`` and ``fork`` are pinned and released (a recording native backend, no
model); the retention benchmark's ``--quick`` smoke run."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from server_harness import ServerProcess

import frontend_lang as sgl
from frontend_lang.backends.native import NativeBackend
from frontend_lang.chat_template import get_chat_template
from frontend_lang.retention import DEFAULT_PRIORITY

pytest_plugins = ["server_fixtures"]


class RecordingNative(NativeBackend):
    """A native backend whose transport writes down every request and pin call, in order."""

    def __init__(self, retention: bool = True) -> None:
        self.chat_template = get_chat_template("default")
        self.retention = retention
        self.events: list[tuple[str, Any]] = []
        self.lock = threading.Lock()
        self.pins = 0

    def _log(self, kind: str, value: Any) -> None:
        with self.lock:
            self.events.append((kind, value))

    def _call(self, payload: dict[str, Any]) -> Any:
        self._log("request", payload)
        texts = payload.get("text", payload.get("input_ids"))
        meta = {"finish_reason": {"type": "length"}, "prompt_tokens": 3, "cached_tokens": 0}
        if isinstance(texts, list) and texts and not isinstance(texts[0], int):
            lp = {"input_token_logprobs": [[-1.0, 7]]}
            return [{"text": "", "meta_info": {**meta, **lp}} for _ in texts]
        return {"text": " x", "meta_info": meta}

    def _pin(self, body: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            self.pins += 1
            pin_id = f"pin-{self.pins}"
        self._log("pin", (pin_id, body))
        return {"pin_id": pin_id, "pinned_tokens": 3}

    def _unpin(self, pin_id: str) -> None:
        self._log("unpin", pin_id)

    def requests(self) -> list[dict[str, Any]]:
        return [v for k, v in self.events if k == "request"]


@sgl.function
def two_steps(s: sgl.ProgramState, q: str) -> None:
    s += "Header shared by every run. Q: " + q
    s += sgl.gen("a", max_tokens=2)
    s += " then" + sgl.gen("b", max_tokens=2)


def test_requests_of_a_program_carry_its_priority_later_programs_rank_higher() -> None:
    be = RecordingNative()
    first = two_steps.run(q="one", backend=be)
    first.sync()
    second = two_steps.run(q="two", backend=be)
    second.sync()
    prios = [r["priority"] for r in be.requests()]
    assert len(prios) == 4
    assert prios[0] == prios[1] > DEFAULT_PRIORITY
    assert prios[2] == prios[3] > prios[0]


def test_retention_off_sends_no_hints() -> None:
    be = RecordingNative(retention=False)
    two_steps.run_batch([{"q": "a"}, {"q": "b"}], backend=be, progress_bar=False)
    assert all(k == "request" for k, _ in be.events)
    assert all("priority" not in r for r in be.requests())
    # the header is still cached for the batch, with a prefill-only request
    assert be.requests()[0] == {
        "text": "Header shared by every run. Q: ",
        "sampling_params": {"max_new_tokens": 0},
    }


def test_run_batch_pins_the_common_header_until_every_run_finished() -> None:
    be = RecordingNative()
    states = two_steps.run_batch([{"q": str(i)} for i in range(5)], backend=be, progress_bar=False)
    assert all(s.error() is None for s in states)
    kinds = [k for k, _ in be.events]
    assert kinds.count("pin") == 1 and kinds.count("unpin") == 1
    pin_at, unpin_at = kinds.index("pin"), kinds.index("unpin")
    # the pin (which caches the header), then all 10 gens, then the release
    assert pin_at == 0
    pin_id, body = be.events[pin_at][1]
    assert body == {"text": "Header shared by every run. Q: ", "ttl": be.pin_ttl}
    assert kinds[pin_at + 1 : unpin_at] == ["request"] * 10
    assert unpin_at == len(kinds) - 1 and be.events[unpin_at][1] == pin_id
    # every run has its own priority, all above the default
    prios = {r["priority"] for r in be.requests()[1:]}
    assert len(prios) == 5 and min(prios) > DEFAULT_PRIORITY


@sgl.function
def forked(s: sgl.ProgramState, join: bool) -> None:
    s += "A shared problem statement."
    branches = s.fork(3)
    branches += lambda i: f" Path {i}:" + sgl.gen("step", max_tokens=2)
    if join:
        branches.join()
        s += " Verdict:" + sgl.select("v", choices=["yes", "no"])


@pytest.mark.parametrize("join", [True, False])
def test_fork_pins_its_shared_prefix_while_the_branches_run(join: bool) -> None:
    be = RecordingNative()
    state = forked.run(join=join, backend=be)
    state.sync()
    assert state.error() is None
    kinds = [k for k, _ in be.events]
    pin_at, unpin_at = kinds.index("pin"), kinds.index("unpin")
    assert kinds.count("pin") == kinds.count("unpin") == 1
    assert be.events[pin_at][1][1]["text"] == "A shared problem statement."
    branch_gens = [i for i, (k, v) in enumerate(be.events) if k == "request" and "Path" in v["text"]]
    assert len(branch_gens) == 3 and pin_at < min(branch_gens) and max(branch_gens) < unpin_at
    if join:  # released at the join, before the parent goes on (its select comes after)
        later = [i for i, (k, v) in enumerate(be.events) if k == "request" and "Verdict" in str(v)]
        assert later and unpin_at < min(later)
    # one program: its branches one level below its own state, above the next program's
    branch_prios = {be.events[i][1]["priority"] for i in branch_gens}
    own = {r["priority"] for r in be.requests() if "Path" not in str(r.get("text"))}
    assert len(branch_prios) == 1 and own <= {min(branch_prios) + 1}
    sent = len(be.requests())
    forked.run(join=False, backend=be).sync()
    assert min(r["priority"] for r in be.requests()[sent:]) > max(own | branch_prios)


def test_fork_of_one_branch_pins_nothing() -> None:
    @sgl.function
    def one(s: sgl.ProgramState) -> None:
        s += "Scratchpad."
        b = s.fork(1)
        b[0] += sgl.gen("x", max_tokens=2)
        b.join()

    be = RecordingNative()
    one.run(backend=be).sync()
    assert [k for k, _ in be.events] == ["request"]


class FullBudget(RecordingNative):
    """The server's pin budget is full: /pin_prefix caches the prompt but pins nothing."""

    def _pin(self, body: dict[str, Any]) -> dict[str, Any]:
        self._log("pin", (None, body))
        return {"pin_id": None, "pinned_tokens": 0}


def test_a_full_pin_budget_caches_the_prefix_and_releases_nothing() -> None:
    be = FullBudget()
    two_steps.run_batch([{"q": "a"}, {"q": "b"}], backend=be, progress_bar=False)
    kinds = [k for k, _ in be.events]
    assert kinds[:2] == ["pin", "request"] and "unpin" not in kinds
    assert be.events[1][1]["sampling_params"] == {"max_new_tokens": 0}


def test_pin_ttl_is_checked() -> None:
    with pytest.raises(ValueError, match="pin_ttl"):
        sgl.RuntimeEndpoint("http://127.0.0.1:9", pin_ttl=0)


class PinWatcher(sgl.RuntimeEndpoint):
    """A real endpoint that reads the server's pins whenever a fork branch sends its request."""

    seen: list[list[dict[str, Any]]]

    def _call(self, payload: dict[str, Any]) -> Any:
        if "Path" in str(payload.get("text")):
            self.seen.append(self._admin("GET", "/pins"))
        return super()._call(payload)


def test_fork_pin_and_priority_on_a_real_server(server: ServerProcess) -> None:
    ep = PinWatcher(server.url, api_key=server.api_key)
    ep.seen = []
    try:
        state = forked.run(join=True, backend=ep)
        state.sync()
        assert state.error() is None  # the server took every priority and the pin calls
        assert len(ep.seen) == 3
        assert all(len(pins) == 1 and pins[0]["tokens"] > 0 for pins in ep.seen)
        assert ep._admin("GET", "/pins") == []  # released at the join
        ep.release_pin("no-such-pin")  # gone already (a lapsed TTL): releasing it is not an error
    finally:
        ep.shutdown()
