"""Tool calling through the real ``openai`` client: call validity on nested schemas, and the RadixCache on a
multi-turn tool loop (issue 22).

**Validity.** Four tools whose ``parameters`` nest objects in objects and arrays of objects, with enums,
required fields and bounded numbers (``TOOLS``). ``--validity-requests`` requests with ``tool_choice:
"required"``, the same number naming each tool, and the same number with ``"auto"``; each request a fresh
task text. A ``required`` / named reply is valid when it has at least one call, every call names an offered
tool (the named one when named) and its ``arguments`` parse as JSON and validate against that tool's schema
(``jsonschema``). For ``auto``, only replies where the model opened a call count: ``message.tool_calls`` set,
or the Hermes trigger ``<tool_call>`` left in the content (a call that failed to parse).

**Tool loop.** ``--agents`` programs, each a task of 5-10 tool calls (seeded): every turn asks with
``tool_choice: "required"`` (one call per turn), keeps the assistant message with its ``tool_calls`` in the
conversation and appends a ``role: "tool"`` message with the ``tool_call_id`` and a result of
``--result-words`` words; a last turn with ``tool_choice: "auto"`` answers (as agent frameworks send it;
``"none"`` would drop the tools from the prompt, so that turn would miss the cache past the system line).
``--concurrency`` programs run at once. Measured with the radix cache on and with ``--disable-radix-cache``
(the baseline), each on a fresh server: programs/s, and with it on the hit rate
(``usage.prompt_tokens_details.cached_tokens`` / ``prompt_tokens``, summed) against two optima, each prompt's tokens taken from ``/tokenize`` of exactly the
messages and tools that request sent (checked against ``usage.prompt_tokens``), capped at all but the last
token (the last one is always computed):

- ``optimum_prompts`` (exact): each prompt's longest common prefix with any prompt sent before it (any
  program). The tokens a cache of prompts alone could serve.
- ``optimum_outputs`` (upper bound, from the token counts): also counts the previous turn's whole output as
  covered, i.e. the previous prompt's common prefix plus its ``completion_tokens``. A cache that keeps each
  reply's KV reaches it only when the template renders the call the model wrote token for token as the
  model wrote it; the gap between the two optima is that rendering's loss.

The random-weight model writes nonsense, so what validates is the grammar's doing, and ``auto`` rarely opens
a call (the count of opened calls is reported with the share). OpenVINO GenAI and llama.cpp's server are not
measured: neither serves OpenAI tool calls for this model here (see docs/benchmarks.md).

    python -m benchmarks.tool_loop             # writes benchmarks/results/tool_loop.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
from openai.types.chat import ChatCompletionMessage

from benchmarks.common import RESULTS_DIR, bench_checkpoint, format_table, machine_info, write_json
from benchmarks.serving import launch

WORDS = "alpha beta gamma delta kernel cache prefix token radix tree page slot batch graph node".split()
TRIGGER = "<tool_call>"

_NAME = {"type": "string", "maxLength": 12}
SCHEMAS: dict[str, dict[str, Any]] = {
    "search_flights": {
        "type": "object",
        "properties": {
            "origin": {"enum": ["AMS", "CDG", "JFK", "NRT"]},
            "destination": {"enum": ["AMS", "CDG", "JFK", "NRT"]},
            "passengers": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "object", "required": ["name", "age"],
                "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                               "seat": {"enum": ["aisle", "window", "middle"]}}}},
            "budget": {"type": "number", "minimum": 50, "maximum": 5000},
        },
        "required": ["origin", "destination", "passengers"],
    },
    "set_thermostat": {
        "type": "object",
        "properties": {
            "room": {"type": "object", "required": ["floor", "name"],
                     "properties": {"floor": {"type": "integer", "minimum": 0, "maximum": 9}, "name": _NAME}},
            "target": {"type": "number", "minimum": 10, "maximum": 30},
            "mode": {"enum": ["heat", "cool", "auto"]},
            "schedule": {"type": "object", "required": ["start"], "properties": {
                "start": {"type": "object", "required": ["hour", "minute"],
                          "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                         "minute": {"type": "integer", "minimum": 0, "maximum": 59}}},
                "repeat": {"type": "boolean"}}},
        },
        "required": ["room", "target"],
    },
    "query_table": {
        "type": "object",
        "properties": {
            "table": {"type": "string", "pattern": "^[a-z_]{1,12}$"},
            "filters": {"type": "array", "maxItems": 2, "items": {
                "type": "object", "required": ["column", "op", "value"],
                "properties": {"column": _NAME, "op": {"enum": ["=", "<", ">", "!="]},
                               "value": {"type": "string", "maxLength": 8}}}},
            "limit": {"type": "integer", "minimum": 1, "maximum": 100},
            "order": {"type": "object", "required": ["by"],
                      "properties": {"by": _NAME, "desc": {"type": "boolean"}}},
        },
        "required": ["table", "filters"],
    },
    "send_email": {
        "type": "object",
        "properties": {
            "to": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "string", "maxLength": 20}},
            "subject": {"type": "string", "maxLength": 20},
            "priority": {"type": "integer", "enum": [1, 2, 3]},
            "attachments": {"type": "array", "maxItems": 2, "items": {
                "type": "object", "required": ["name", "size_kb"],
                "properties": {"name": _NAME, "size_kb": {"type": "number", "minimum": 0, "maximum": 1000}}}},
        },
        "required": ["to", "subject"],
    },
}  # fmt: skip
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": n, "description": f"The {n.replace('_', ' ')} tool.", "parameters": s},
    }
    for n, s in SCHEMAS.items()
]


# Requests a real model would answer with a call (``--natural``), one per tool, varied by the seed.
NATURAL = (
    "Find flights from {a} to {b} for {name}, age {n}, window seat.",
    "Set the thermostat in the {room} on floor {f} to {t} degrees.",
    "Query the {table} table for rows where {col} is {val}, at most {n} rows.",
    "Send an email to {name}@example.com with the subject '{col} report'.",
)
_CITIES = ("AMS", "CDG", "JFK", "NRT")


def natural_task(rng: random.Random, k: int) -> str:
    """The ``k``-th natural request (cycling over the tools) with random details."""
    name = rng.choice(["ann", "bob", "chen", "dara", "eli"])
    fields = {"a": rng.choice(_CITIES), "b": rng.choice(_CITIES), "name": name, "n": rng.randint(2, 90),
              "room": rng.choice(["kitchen", "office", "hall"]), "f": rng.randint(0, 5), "t": rng.randint(16, 26),
              "table": rng.choice(["orders", "users", "sales"]), "col": rng.choice(["region", "status", "year"]),
              "val": rng.choice(["west", "open", "2024"])}  # fmt: skip
    return NATURAL[k % len(NATURAL)].format(**fields)


def function_calls(msg: ChatCompletionMessage) -> list[tuple[str, str, str]]:
    """``(id, name, arguments)`` of a reply's function calls."""
    return [
        (c.id, c.function.name, c.function.arguments) for c in msg.tool_calls or [] if c.type == "function"
    ]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def lcp(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def optima(prompts: list[list[int]], previous: list[int | None], completions: list[int]) -> tuple[int, int]:
    """``(optimum_prompts, optimum_outputs)`` of requests in the order they were sent.

    ``prompts[i]`` is request i's prompt tokens, ``previous[i]`` the index of the same program's previous
    request (None for a first turn), ``completions[i]`` its ``completion_tokens``. A prompt's optimum is its
    longest common prefix with any earlier prompt; the outputs optimum also counts the previous turn's
    prompt prefix plus its whole output as covered. Both at most all but the prompt's last token.
    """
    exact = upper = 0
    for i, ids in enumerate(prompts):
        cap = len(ids) - 1
        best = max((lcp(ids, p) for p in prompts[:i]), default=0)
        exact += min(best, cap)
        j = previous[i]
        with_output = best if j is None else max(best, lcp(ids, prompts[j]) + completions[j])
        upper += min(with_output, cap)
    return exact, upper


def check_call(name: str, arguments: str, allowed: set[str]) -> str | None:
    """None when the call names an allowed tool and its arguments validate; else what is wrong."""
    if name not in allowed:
        return f"name {name!r} not in {sorted(allowed)}"
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError as exc:
        return f"arguments do not parse ({exc.msg})"
    try:
        jsonschema.validate(args, SCHEMAS[name])
    except jsonschema.ValidationError as exc:
        return f"arguments do not validate: {exc.message}"
    return None


def validity(
    client: openai.OpenAI, n: int, max_tokens: int, seed: int, natural: bool = False
) -> dict[str, Any]:
    """The share of valid calls per tool_choice (required, each tool named, auto among opened calls); the
    user turns are random words, or with ``natural`` requests that call for a tool (`natural_task`)."""
    rng = random.Random(seed)
    choices: list[tuple[str, Any, set[str]]] = [("required", "required", set(SCHEMAS))]
    choices += [(f"named:{t}", {"type": "function", "function": {"name": t}}, {t}) for t in SCHEMAS]
    choices.append(("auto", "auto", set(SCHEMAS)))
    out: dict[str, Any] = {}
    for label, choice, allowed in choices:
        valid = opened = 0
        failures: list[dict[str, Any]] = []
        for k in range(n):
            messages: list[Any] = [
                {"role": "system", "content": f"You are a helpful agent {label} {k}."},
                {"role": "user", "content": natural_task(rng, k) if natural else _text(rng, 20)},
            ]
            resp = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice=choice,
                                                  max_tokens=max_tokens, temperature=0)  # fmt: skip
            msg, finish = resp.choices[0].message, resp.choices[0].finish_reason
            calls = [(name, a) for _, name, a in function_calls(msg)]
            if label == "auto" and not calls and TRIGGER not in (msg.content or ""):
                continue  # free text: no call opened
            opened += 1
            problems = [p for name, a in calls if (p := check_call(name, a, allowed)) is not None]
            if not calls:
                problems.append("no call parsed")
            if problems:
                failures.append({"finish_reason": finish, "problems": problems, "calls": calls,
                                 "content": (msg.content or "")[:400]})  # fmt: skip
            else:
                valid += 1
        out[label] = {"requests": n, "opened": opened, "valid": valid,
                      "valid_share": round(valid / opened, 4) if opened else None, "failures": failures[:3]}  # fmt: skip
        print(label, {k: v for k, v in out[label].items() if k != "failures"}, flush=True)
    return out


def tasks(agents: int, seed: int, calls: tuple[int, int]) -> list[dict[str, Any]]:
    """Each program: a system prompt, a task, its number of tool calls and the tool results it gets."""
    rng = random.Random(seed)
    out = []
    for i in range(agents):
        n = rng.randint(*calls)
        out.append({"system": f"You are agent {i}. " + _text(rng, 40), "task": _text(rng, 30), "calls": n,
                    "results": [rng.randint(0, 10**6) for _ in range(n)]})  # fmt: skip
    return out


class Recorder:
    """Every request of a loop run in the order it was sent: messages, usage, previous turn's index."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []  # loop calls that did not validate

    def send(
        self, client: openai.OpenAI, prev: int | None, messages: list[Any], **kw: Any
    ) -> tuple[Any, int]:
        with self.lock:
            index = len(self.sent)
            self.sent.append(
                {
                    "messages": json.loads(json.dumps(messages)),
                    "previous": prev,
                    "tool_choice": kw["tool_choice"],
                }
            )
        resp = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0, **kw)
        assert resp.usage is not None
        details = resp.usage.prompt_tokens_details
        self.sent[index].update(
            finish_reason=resp.choices[0].finish_reason,prompt_tokens=resp.usage.prompt_tokens, completion_tokens=resp.usage.completion_tokens,
                                cached_tokens=details.cached_tokens if details else 0)  # fmt: skip
        return resp, index


def program(client: openai.OpenAI, rec: Recorder, task: dict[str, Any], words: int, max_tokens: int) -> int:
    """One agent's task: ``task["calls"]`` required single calls, each result appended, then the answer.
    Returns the number of calls that did not validate."""
    rng = random.Random(task["system"])
    messages: list[Any] = [
        {"role": "system", "content": task["system"]},
        {"role": "user", "content": task["task"]},
    ]
    prev: int | None = None
    invalid = 0
    for turn in range(task["calls"]):
        resp, prev = rec.send(client, prev, messages, tool_choice="required", parallel_tool_calls=False,
                              max_tokens=max_tokens)  # fmt: skip
        msg = resp.choices[0].message
        calls = function_calls(msg)
        problems = [
            (name, a, p) for _, name, a in calls if (p := check_call(name, a, set(SCHEMAS))) is not None
        ]
        if problems or not calls:
            with rec.lock:
                rec.failures.append({"finish_reason": resp.choices[0].finish_reason, "problems": problems,
                                     "content": (msg.content or "")[:400]})  # fmt: skip
        invalid += len(problems) + (not calls)
        messages.append(msg.model_dump(exclude_none=True))
        for call_id, _, _ in calls:
            result = {"id": task["results"][turn], "rows": _text(rng, words)}
            messages.append({"role": "tool", "tool_call_id": call_id, "content": json.dumps(result)})
    rec.send(client, prev, messages, tool_choice="auto", max_tokens=16)
    return invalid


def loop_run(
    url: str, chats: list[dict[str, Any]], args: argparse.Namespace, measure: bool
) -> dict[str, Any]:
    """The tool loop once on a fresh server: programs/s; with ``measure``, the hit rate and the optima."""
    rec = Recorder()
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600) as client:
        start = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as pool:
            invalid = sum(
                pool.map(lambda t: program(client, rec, t, args.result_words, args.max_tokens), chats)
            )
        seconds = time.monotonic() - start
    prompt = sum(r["prompt_tokens"] for r in rec.sent)
    cached = sum(r["cached_tokens"] for r in rec.sent)
    res: dict[str, Any] = {"programs": len(chats), "requests": len(rec.sent), "seconds": round(seconds, 2),
                           "programs_per_s": round(len(chats) / seconds, 4), "required_turns": sum(t["calls"] for t in chats),
                           "invalid_calls": invalid,
                           "invalid_examples": rec.failures[:3],
                           "prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": round(cached / prompt, 4)}  # fmt: skip
    keys = ("previous", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason", "tokenized")
    if not measure:
        return res
    prompts, mismatched = [], 0
    with httpx.Client(base_url=url, timeout=600) as c:
        for r in rec.sent:
            # The server renders no tools under tool_choice "none" (unused here; kept exact if a run sends it).
            tools = {} if r["tool_choice"] == "none" else {"tools": TOOLS}
            t = c.post("/tokenize", json={"messages": r["messages"], **tools})
            t.raise_for_status()
            ids = t.json()["tokens"]
            mismatched += len(ids) != r["prompt_tokens"]
            r["tokenized"] = len(ids)
            prompts.append(ids)
    res["per_request"] = [{k: r.get(k) for k in keys} for r in rec.sent]
    exact, upper = optima(
        prompts, [r["previous"] for r in rec.sent], [r["completion_tokens"] for r in rec.sent]
    )
    res.update(tokenize_mismatches=mismatched, optimum_prompts=round(exact / prompt, 4),
               optimum_outputs=round(upper / prompt, 4), hit_over_optimum_prompts=round(cached / exact, 4),
               hit_over_optimum_outputs=round(cached / upper, 4))  # fmt: skip
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--validity-requests", type=int, default=8, help="requests per tool_choice")
    ap.add_argument("--call-max-tokens", type=int, default=384, help="max_tokens of a validity request")
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--calls", type=int, nargs=2, default=[5, 10], metavar=("MIN", "MAX"))
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--result-words", type=int, default=60, help="words in each tool result")
    ap.add_argument("--max-tokens", type=int, default=256, help="max_tokens of a loop turn's call")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", type=Path, default=RESULTS_DIR / "tool_loop.json")
    ap.add_argument("--model", default=None,
                    help="a --model-path for the server (e.g. smollm2, the embedded model); default: the tiny "
                         "random-weight checkpoint")  # fmt: skip
    ap.add_argument("--validity-only", action="store_true", help="measure call validity only (no tool loop)")
    ap.add_argument("--natural", action="store_true",
                    help="validity requests in words that ask for a tool (for a real model) instead of random words")  # fmt: skip
    args = ap.parse_args()
    model: Path | str = args.model or bench_checkpoint("tiny", context=8192)
    chats = tasks(args.agents, args.seed, (args.calls[0], args.calls[1]))
    info = machine_info(args.threads)
    flags = ["--disable-compile", "--max-total-tokens", "65536"]
    loops: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for radix in (True,) if args.validity_only else (True, False):
            proc, url = launch(model, flags + ([] if radix else ["--disable-radix-cache"]),
                               Path(tmp) / "server.log", args.threads)  # fmt: skip
            try:
                if radix:
                    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600) as c:
                        valid = validity(
                            c, args.validity_requests, args.call_max_tokens, args.seed, args.natural
                        )
                    httpx.post(url + "/flush_cache", timeout=60).raise_for_status()
                if args.validity_only:
                    break
                loops["radix_on" if radix else "radix_off"] = loop_run(url, chats, args, measure=radix)
                print(
                    {k: {n: v for n, v in r.items() if n != "per_request"} for k, r in loops.items()},
                    flush=True,
                )
            finally:
                proc.terminate()
                proc.wait(60)
    workload = {k: getattr(args, k) for k in ("validity_requests", "call_max_tokens", "agents", "calls",
                                              "concurrency", "result_words", "max_tokens", "seed")}  # fmt: skip
    workload["model"] = str(args.model or "tiny random-weight Llama")
    workload["natural"] = args.natural
    info["load_avg_at_end"] = list(os.getloadavg())
    rows = [[k, str(v["opened"]), str(v["valid"]), f"{100 * v['valid_share']:.1f}%" if v["opened"] else "-"]
            for k, v in valid.items()]  # fmt: skip
    if args.validity_only:
        write_json(args.output, {"machine": info, "workload": workload, "validity": valid})
        print(format_table(["tool_choice", "opened", "valid", "valid share"], rows))
        return
    on, off = loops["radix_on"], loops["radix_off"]
    write_json(args.output, {"machine": info, "workload": workload, "validity": valid, "loop": loops,
                             "speedup": round(on["programs_per_s"] / off["programs_per_s"], 3)})  # fmt: skip
    print(format_table(["tool_choice", "opened", "valid", "valid share"], rows))
    print(format_table(
        ["radix", "programs/s", "hit rate", "opt (prompts)", "opt (+outputs)", "hit/opt prompts", "hit/opt +outputs"],
        [["on", f"{on['programs_per_s']:.3f}", f"{on['hit_rate']:.3f}", f"{on['optimum_prompts']:.3f}",
          f"{on['optimum_outputs']:.3f}", f"{on['hit_over_optimum_prompts']:.3f}", f"{on['hit_over_optimum_outputs']:.3f}"],
         ["off", f"{off['programs_per_s']:.3f}", f"{off['hit_rate']:.3f}", "", "", "", ""]],
    ))  # fmt: skip


if __name__ == "__main__":
    main()
