"""SGLang's request contract against a radixrt server: every field of SGLang 0.5.23's request types at its
default is accepted, one that asks for a behaviour radixrt lacks is a 400 naming it; the worker routes
sglang-router reads answer in SGLang's shape; and the real ``python -m sglang.bench_serving`` runs a
benchmark against the server without a failed request.

The field lists come from the installed ``sglang`` package's source (``ast``, not an import: importing
``sglang.srt`` needs torchvision, see ``BENCH_RUNNER``).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import ServerProcess, wait_idle

from radixrt.server.http.openai_protocol import ChatCompletionRequest, CompletionRequest
from radixrt.server.http.sglang_compat import CHAT_FIELDS, COMPLETION_FIELDS, GENERATE_FIELDS
from radixrt.server.io_struct import GenerateReqInput

pytest_plugins = ["server_fixtures"]

SGLANG = importlib.util.find_spec("sglang")
needs_sglang = pytest.mark.skipif(SGLANG is None, reason="sglang (the client package) is not installed")

# The stand-in: sglang.benchmark.serving imports sglang.srt.configs, which imports torchvision at module
# level for InternVL image preprocessing. PyPI's torchvision for this torch (2.13 CPU) fails to import
# ("operator torchvision::nms does not exist") and a working one needs the multi-GB CUDA torch 2.14, so
# the benchmark runs with an importable placeholder that raises if anything calls into it (text datasets
# never do). transformers' availability check is cached first, so it still sees no torchvision.
BENCH_RUNNER = """
import importlib.abc, importlib.machinery, runpy, sys, types
from transformers.utils import import_utils
import_utils.is_torchvision_available()

class _Unavailable:
    def __init__(self, name): self._name = name
    def __getattr__(self, attr): return _Unavailable(f"{self._name}.{attr}")
    def __call__(self, *a, **k): raise RuntimeError(f"{self._name}: torchvision is not installed")

class _Module(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"): raise AttributeError(attr)
        return _Unavailable(f"{self.__name__}.{attr}")

class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
    def create_module(self, spec): return _Module(spec.name)
    def exec_module(self, module): module.__path__ = []

sys.meta_path.insert(0, _Finder())
sys.argv[0] = "sglang.bench_serving"
runpy.run_module("sglang.bench_serving", run_name="__main__", alter_sys=True)
"""


def sglang_defaults(path: str, classes: set[str]) -> dict[str, Any]:
    """Field -> default of SGLang classes, read from the installed package's source (a default that is
    not a literal, and a required field, map to ``...``)."""
    assert SGLANG is not None and SGLANG.origin is not None
    tree = ast.parse((Path(SGLANG.origin).parent / path).read_text())
    out: dict[str, Any] = {}
    for node in tree.body:
        if not (isinstance(node, ast.ClassDef) and node.name in classes):
            continue
        for st in node.body:
            if not (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)):
                continue
            if st.target.id.startswith("_"):
                continue
            value = st.value
            if isinstance(value, ast.Call) and getattr(value.func, "id", "") in ("field", "Field"):
                value = {k.arg: k.value for k in value.keywords}.get("default")
            try:
                out[st.target.id] = ... if value is None else ast.literal_eval(value)
            except ValueError:
                out[st.target.id] = ...
    return out


def generate_defaults() -> dict[str, Any]:
    return sglang_defaults("srt/managers/io_struct.py", {"GenerateReqInput"})


def openai_defaults(cls: str) -> dict[str, Any]:
    return sglang_defaults("srt/entrypoints/openai/protocol.py", {cls, "PDRoutingFields"})


@needs_sglang
def test_every_sglang_field_is_implemented_or_listed() -> None:
    """Each field SGLang defines is either one radixrt implements or one with a neutral-value rule."""
    ours = set(GenerateReqInput.__struct_fields__)
    assert set(generate_defaults()) - ours - set(GENERATE_FIELDS) == set()
    for cls, struct, table in (
        ("CompletionRequest", CompletionRequest, COMPLETION_FIELDS),
        ("ChatCompletionRequest", ChatCompletionRequest, CHAT_FIELDS),
    ):
        assert set(openai_defaults(cls)) - set(struct.__struct_fields__) - set(table) == set(), cls


def _post(c: httpx.Client, route: str, body: dict[str, Any]) -> httpx.Response:
    return c.post(route, json=body)


@needs_sglang
def test_sglang_defaults_are_accepted(server: ServerProcess) -> None:
    """Bodies carrying every SGLang field at its default answer as the bare request does (greedy)."""
    gen = {k: v for k, v in generate_defaults().items() if v is not ...}
    comp = {k: v for k, v in openai_defaults("CompletionRequest").items() if v is not ...}
    chat = {k: v for k, v in openai_defaults("ChatCompletionRequest").items() if v is not ...}
    params = {
        "max_new_tokens": 6,
        "temperature": 0,
        "stop_regex": [],
        "custom_params": None,
        "beam_width": None,
    }
    bare_gen = {"text": "The radix tree", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    messages = [{"role": "user", "content": "What is a radix tree?"}]
    with server.client() as c:
        full = _post(c, "/generate", {**gen, "model": "tiny", **bare_gen, "sampling_params": params})
        assert full.status_code == 200, full.text
        assert full.json()["output_ids"] == _post(c, "/generate", bare_gen).json()["output_ids"]
        bare_comp = {"model": "tiny", "prompt": "The radix tree", "max_tokens": 6, "temperature": 0}
        r = _post(c, "/v1/completions", {**comp, **bare_comp})
        assert r.status_code == 200, r.text
        assert (
            r.json()["choices"][0]["text"]
            == _post(c, "/v1/completions", bare_comp).json()["choices"][0]["text"]
        )
        bare_chat = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0}
        r = _post(c, "/v1/chat/completions", {**chat, **bare_chat})
        assert r.status_code == 200, r.text
        bare = _post(c, "/v1/chat/completions", bare_chat).json()
        assert r.json()["choices"][0]["message"] == bare["choices"][0]["message"]
        # what sglang.bench_serving sends, streamed
        bench = {"text": "The radix tree", "sampling_params": {"temperature": 0.0, "max_new_tokens": 4,
                 "ignore_eos": True}, "stream": True, "lora_path": None, "return_logprob": False,
                 "return_routed_experts": False, "logprob_start_len": -1}  # fmt: skip
        with c.stream("POST", "/generate", json=bench) as s:
            assert s.status_code == 200
            events = [line for line in s.iter_lines() if line.startswith("data:")]
        assert (
            events[-1] == "data: [DONE]" and json.loads(events[-2][5:])["meta_info"]["completion_tokens"] == 4
        )
        wait_idle(c)


GEN = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMP = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
# (route, body, the field named in the 400)
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("/generate", {**GEN, "return_hidden_states": True}, "return_hidden_states"),
    ("/generate", {**GEN, "lora_path": "adapter-a"}, "lora_path"),
    ("/generate", {**GEN, "image_data": "http://127.0.0.1/cat.png"}, "image_data"),
    ("/generate", {**GEN, "return_routed_experts": True}, "return_routed_experts"),
    ("/generate", {**GEN, "data_parallel_rank": 1}, "data_parallel_rank"),
    ("/generate", {**GEN, "token_ids_logprob": [1, 2]}, "token_ids_logprob"),
    ("/generate", {**GEN, "sampling_params": {"stop_regex": ["\\d"]}}, "stop_regex"),
    ("/generate", {**GEN, "sampling_params": {"beam_width": 4}}, "beam_width"),
    ("/generate", {**GEN, "model": 7}, "model"),
    ("/v1/completions", {**COMP, "return_hidden_states": True}, "return_hidden_states"),
    ("/v1/completions", {**COMP, "lora_path": "adapter-a"}, "lora_path"),
    ("/v1/chat/completions", {**CHAT, "continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {**CHAT, "reasoning_effort": "high"}, "reasoning_effort"),
    ("/v1/chat/completions", {**CHAT, "return_hidden_states": "last"}, "return_hidden_states"),
]


@pytest.mark.parametrize("route, body, field", REFUSED, ids=[f"{r}:{f}" for r, _, f in REFUSED])
def test_sglang_feature_radixrt_lacks_is_refused(
    server: ServerProcess, route: str, body: dict[str, Any], field: str
) -> None:
    with server.client() as c:
        r = _post(c, route, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}: not supported"), error


def test_fields_sglang_does_not_define_stay_unrecognized(server: ServerProcess) -> None:
    with server.client() as c:
        for route, body in (("/generate", GEN), ("/v1/completions", COMP), ("/v1/chat/completions", CHAT)):
            r = _post(c, route, {**body, "return_everything": False})
            assert r.status_code == 400 and r.json()["error"]["param"] == "return_everything", r.text
            assert "unrecognized" in r.json()["error"]["message"]


def test_worker_routes_in_sglang_shape(server: ServerProcess) -> None:
    """What sglang-router reads from a worker (/server_info, /model_info, /get_load) and bench_serving
    (/v1/models, /model_info's tokenizer_path, /server_info's internal_states)."""
    with server.client() as c:
        wait_idle(c)
        info = c.get("/server_info").json()
        assert info["served_model_name"] == server.info["model_info"]["served_model_name"]
        assert isinstance(info["model_path"], str) and info["version"] and info["dp_size"] == 1
        assert isinstance(info["max_running_requests"], int) and info["max_total_tokens"] == 16384
        assert info["max_total_num_tokens"] == 16384
        assert info["internal_states"][0]["avg_spec_accept_length"] is None  # no speculative decoding
        model = c.get("/model_info").json()
        assert model == c.get("/get_model_info").json()
        assert model["model_type"] == "llama" and model["architectures"] == ["LlamaForCausalLM"]
        assert Path(model["tokenizer_path"], "tokenizer.json").exists() and model["is_generation"] is True
        load = c.get("/get_load").json()
        assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
        assert c.get("/v1/models").json()["data"][0]["id"] == info["served_model_name"]


@needs_sglang
def test_sglang_bench_serving(server: ServerProcess, tmp_path: Path) -> None:
    """The real benchmark client, generated-shared-prefix dataset, streamed /generate: no failed request."""
    runner = tmp_path / "run_bench.py"
    runner.write_text(BENCH_RUNNER)
    out = tmp_path / "bench.jsonl"
    groups, per_group, output_len = 2, 3, 8
    cmd = [sys.executable, "-W", "ignore", str(runner), "--backend", "sglang", "--base-url", server.url,
           "--model", server.info["model_path"],
           "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(groups),
           "--gsp-prompts-per-group", str(per_group), "--gsp-system-prompt-len", "64",
           "--gsp-question-len", "16", "--gsp-output-len", str(output_len), "--num-prompts",
           str(groups * per_group), "--disable-tqdm", "--output-file", str(out)]  # fmt: skip
    # the dataset cache goes under ~/.cache; offline: the tokenizer is the model's directory
    env = {**os.environ, "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text().splitlines()[-1])
    assert result["completed"] == groups * per_group, proc.stdout[-3000:]
    assert result["total_output_tokens"] == groups * per_group * output_len  # ignore_eos: every token
    with server.client() as c:
        wait_idle(c)
