"""TokenizerManager: validate, tokenize, track request state, detokenize incrementally.

It talks to the worker through a ``WorkerClient`` (a thread in-process, ZeroMQ in the server) and is
the single request path for Engine and HTTP server alike. Outputs arrive on the worker's thread and
are handed to each request's own asyncio loop, so any event loop can await a request.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from radixrt.mem_cache.pins import parse_cache_control
from radixrt.sampling.sampling_params import SamplingParams
from radixrt.server.detokenizer import IncrementalDecoder, find_stop
from radixrt.server.io_struct import GenerateReqInput, SingleReq
from radixrt.server.prompt_bound import min_tokens
from radixrt.transport.client import WorkerClient, WorkerDeadError
from radixrt.transport.protocol import (
    AbortReq,
    ReqOut,
    StatsOut,
    TokenizedGenerateReq,
    WorkerInput,
    WorkerOutput,
)

logger = logging.getLogger(__name__)

MAX_N = 128  # most choices per prompt (``n``), OpenAI's limit


class RequestFailedError(RuntimeError):
    """The worker ended a request with an HTTP status other than 400 in its finish reason: 429 (queue
    full), 503 (overloaded), 504 (``--request-timeout``), ... The HTTP layer answers with that status."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(message)
        self.status_code, self.message = status_code, message


@dataclass
class ReqState:
    """What the TokenizerManager knows of one in-flight request."""

    rid: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[ReqOut | Exception]
    created: float = field(default_factory=time.perf_counter)


class TokenizerManager:
    """Front half of the request path (no tensors here)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        worker: WorkerClient,
        context_len: int,
        vocab_size: int,
        model_name: str,
        random_seed: int = 0,
        max_batch_size: int = 1024,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.worker = worker
        self.context_len = context_len
        self.vocab_size = vocab_size
        self.model_name = model_name
        self.states: dict[str, ReqState] = {}
        self.control: list[asyncio.Future[StatsOut]] = []
        self._seeds = random.Random(random_seed)
        self.listeners: list[Callable[[dict[str, Any]], None]] = []  # finished-request hooks (metrics)
        worker.start(self._on_output)

    # -- worker -> here (worker thread) ---------------------------------------------------------
    def _on_output(self, msg: WorkerOutput) -> None:
        if isinstance(msg, StatsOut):
            if self.control:
                fut = self.control.pop(0)
                fut.get_loop().call_soon_threadsafe(_set_result, fut, msg)
            return
        for out in msg.outs:
            state = self.states.get(out.rid)
            if state is not None:
                state.loop.call_soon_threadsafe(state.queue.put_nowait, out)

    def fail_all(self, error: Exception) -> None:
        """Worker died: every in-flight request ends with ``error``."""
        for state in list(self.states.values()):
            state.loop.call_soon_threadsafe(state.queue.put_nowait, error)
        for fut in self.control:
            fut.get_loop().call_soon_threadsafe(_set_exception, fut, error)
        self.control.clear()

    async def control_request(self, msg: WorkerInput) -> StatsOut:
        """Send a control message (flush, stats) and await the worker's StatsOut."""
        if not self.worker.is_alive():
            raise WorkerDeadError("the worker is not running")
        fut: asyncio.Future[StatsOut] = asyncio.get_running_loop().create_future()
        self.control.append(fut)
        try:
            self.worker.send(msg)
        except BaseException:
            if fut in self.control:
                self.control.remove(fut)
            raise
        return await fut

    # -- validation and tokenization ------------------------------------------------------------
    def tokenize(self, req: SingleReq) -> list[int]:
        if req.input_ids is not None:
            ids = req.input_ids
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise ValueError("input_ids: must be a list of integers")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"input_ids: token id {bad[0]} outside the vocabulary [0, {self.vocab_size})"
                )
        else:
            if not isinstance(req.text, str):
                raise ValueError("text: must be a string")
            if 4 * len(req.text) >= self.context_len:  # NOTE: refuse a provably long text untokenized
                least = min_tokens(self.tokenizer, req.text)
                if least >= self.context_len:
                    raise ValueError(
                        f"text: the prompt has at least {least} tokens; the context length is {self.context_len}"
                    )
            ids = self.tokenizer.encode(req.text, add_special_tokens=True)
        if not ids:
            raise ValueError("text: the prompt is empty")
        return list(ids)

    def prepare(
        self, req: SingleReq, tenant: str | None = None
    ) -> tuple[list[TokenizedGenerateReq], SamplingParams]:
        """Validate and tokenize one prompt; ``n > 1`` becomes n worker requests sharing the prompt.
        ``tenant`` (from the API key, never from the body) selects the cache namespace in the worker."""
        params = SamplingParams.from_dict(req.sampling_params)
        params.validate(self.vocab_size)
        if params.n > MAX_N:
            raise ValueError(f"n: must be <= {MAX_N}, got {params.n}")
        ids = self.tokenize(req)
        if len(ids) >= self.context_len:
            raise ValueError(
                f"text: the prompt has {len(ids)} tokens; the context length is {self.context_len}"
            )
        if len(ids) + params.max_new_tokens > self.context_len:
            raise ValueError(
                f"max_new_tokens: prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                f"exceeds the context length {self.context_len}"
            )
        start = -1 if req.logprob_start_len is None else req.logprob_start_len
        if not isinstance(start, int) or start < -1:
            raise ValueError("logprob_start_len: must be an integer >= -1")
        top = req.top_logprobs_num or 0
        if not isinstance(top, int) or top < 0 or top > 100:
            raise ValueError("top_logprobs_num: must be an integer in [0, 100]")
        if req.cache_salt is not None and not isinstance(req.cache_salt, str):
            raise ValueError("cache_salt: must be a string")
        prio = req.priority
        if prio is not None and (isinstance(prio, bool) or not isinstance(prio, int) or abs(prio) >= 2**31):
            raise ValueError("priority: must be an integer in (-2**31, 2**31)")
        pin_ttl = parse_cache_control(req.cache_control)
        if req.bootstrap_room is not None and params.n != 1:
            raise ValueError("n: must be 1 with bootstrap_room (one prefill/decode pair per request)")
        rid = req.rid or uuid.uuid4().hex
        base_seed = params.seed if params.seed is not None else self._seeds.randrange(2**62)
        out = []
        for i in range(params.n):
            out.append(
                TokenizedGenerateReq(
                    rid=rid if params.n == 1 else f"{rid}-{i}",
                    input_ids=ids,
                    sampling_params=params,
                    seed=base_seed + i,
                    return_logprob=req.return_logprob,
                    logprob_start_len=min(start, len(ids) - 1),
                    top_logprobs_num=top,
                    cache_salt=req.cache_salt,
                    tenant=tenant,
                    priority=req.priority,
                    pin_ttl=pin_ttl,
                    strip_thinking=req.strip_thinking,
                    embed=req.embed,
                    bootstrap_host=req.bootstrap_host,
                    bootstrap_port=req.bootstrap_port,
                    bootstrap_room=req.bootstrap_room,
                )
            )
        return out, params

    # -- generation -----------------------------------------------------------------------------
    async def generate(
        self, obj: GenerateReqInput, tenant: str | None = None
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Yield outputs: for a stream, cumulative snapshots; otherwise one final result.

        A batch (or ``n > 1``) yields a list of results when not streaming, and snapshots carrying
        ``index`` when streaming.
        """
        if obj.batch_size() > self.max_batch_size:
            name = "text" if obj.text is not None else "input_ids"
            raise ValueError(
                f"{name}: the batch has {obj.batch_size()} prompts; at most {self.max_batch_size} are "
                "allowed (--max-batch-size)"
            )
        singles = [obj.item(i) for i in range(obj.batch_size())]
        prepared = [self.prepare(s, tenant) for s in singles]  # validate everything before sending anything
        subs = [(s, t, p) for s, (ts, p) in zip(singles, prepared, strict=True) for t in ts]
        seen: set[str] = set()
        for _, treq, _ in subs:
            if treq.rid in seen or treq.rid in self.states:
                where = "twice in this batch" if treq.rid in seen else "by a running request"
                raise ValueError(f"rid: the id {treq.rid!r} is used {where}")
            seen.add(treq.rid)
        multi = obj.is_batch or len(subs) > 1
        if not multi:
            single, treq, params = subs[0]
            async for out in self._one(single, treq, params, obj.stream):
                yield out
            return
        if not obj.stream:
            finals = [asyncio.create_task(self._final(s, t, p)) for s, t, p in subs]
            try:
                results = await asyncio.gather(*finals)
            finally:
                await _cancel_all(finals)  # one item failed (or the caller left): abort the others
            yield list(results)  # type: ignore[misc]
            return
        queue: asyncio.Queue[tuple[int, dict[str, Any] | None | BaseException]] = asyncio.Queue()

        async def pump(index: int, s: SingleReq, t: TokenizedGenerateReq, p: SamplingParams) -> None:
            try:
                async for out in self._one(s, t, p, True):
                    out["index"] = index
                    await queue.put((index, out))
            except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer below
                await queue.put((index, exc))
                return
            await queue.put((index, None))

        tasks = [asyncio.create_task(pump(i, s, t, p)) for i, (s, t, p) in enumerate(subs)]
        try:
            remaining = len(tasks)
            while remaining:
                _, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            await _cancel_all(tasks)

    async def _final(self, s: SingleReq, t: TokenizedGenerateReq, p: SamplingParams) -> dict[str, Any]:
        result: dict[str, Any] = {}
        async for out in self._one(s, t, p, False):
            result = out
        return result

    async def _one(
        self, s: SingleReq, treq: TokenizedGenerateReq, params: SamplingParams, stream: bool
    ) -> AsyncIterator[dict[str, Any]]:
        if not self.worker.is_alive():
            raise WorkerDeadError("the worker is not running")
        if treq.rid in self.states:
            raise ValueError(f"rid: a request with id {treq.rid!r} is already running")
        loop = asyncio.get_running_loop()
        state = ReqState(treq.rid, loop, asyncio.Queue())
        self.states[treq.rid] = state
        track = _Tracker(self, s, treq, params)
        failed = False  # ended by an error (a dead worker, a failed send), not by its consumer leaving
        try:
            self.worker.send(treq)
            while True:
                item = await state.queue.get()
                if isinstance(item, Exception):
                    raise item
                reason = item.finish_reason
                status = None if reason is None else reason.get("status_code")
                if status is not None and (status != 400 or not (track.output_ids or item.new_ids)):
                    track.push(item)  # the worker already dropped it: the request fails with its status
                    self._report(track, state)
                    message = str(reason.get("message", "the request failed")) if reason else ""
                    if status == 400:
                        raise ValueError(message)
                    raise RequestFailedError(int(status), message)
                finished = track.push(item)
                if finished and track.abort_worker:
                    self.worker.send(AbortReq(treq.rid, "stop"))
                if finished:  # reported before the last yield: a consumer may close the stream at it
                    self._report(track, state)
                if stream or finished:
                    yield track.result(state.created, partial=not finished)
                if finished:
                    return
        except Exception:
            failed = True
            raise
        finally:
            self.states.pop(treq.rid, None)
            if not track.finished and not failed:  # the client left (disconnect, a cancelled batch): abort
                track.finish_reason = {"type": "abort", "message": "client disconnected"}
                self._report(track, state)
            if not track.finished and self.worker.is_alive():
                self.worker.send(AbortReq(treq.rid, "client disconnected"))

    def _report(self, track: _Tracker, state: ReqState) -> None:
        """Hand a request that ended (in the worker, or by its client leaving) to the listeners (metrics,
        --log-requests), once: its result with ``timing`` and ``tenant``."""
        if self.listeners:
            final = track.result(state.created)
            final["timing"] = track.timing(state.created)
            final["tenant"] = track.treq.tenant
            for hook in self.listeners:
                hook(final)

    def abort(self, rid: str) -> None:
        """Abort a request by id (its KV is freed by the worker within a step)."""
        self.worker.send(AbortReq(rid, "abort"))


class _Tracker:
    """Accumulates one request's outputs: ids, text (with stop strings), logprobs, meta."""

    def __init__(
        self, tm: TokenizerManager, s: SingleReq, treq: TokenizedGenerateReq, params: SamplingParams
    ) -> None:
        self.tm, self.s, self.treq, self.params = tm, s, treq, params
        self.decoder = IncrementalDecoder(
            tm.tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens
        )
        self.text = ""
        self.output_ids: list[int] = []
        self.finish_reason: dict[str, Any] | None = None
        self.finished = False
        self.abort_worker = False
        self.prompt_tokens = len(treq.input_ids)
        self.cached_tokens = 0
        self.cached_details: dict[str, int] | None = None  # device / host / disk, with the tiers on
        self.pinned_tokens = 0
        self.pin_id: str | None = None
        self.embedding: list[float] | None = None  # an embedding request's pooled vector, once finished
        self.spec: tuple[int, int] | None = None  # (verify steps, accepted draft tokens) with speculation
        self.in_lp: list[tuple[float | None, int]] = []
        self.in_top: list[list[tuple[float, int]] | None] = []
        self.out_lp: list[tuple[float, int]] = []
        self.out_top: list[list[tuple[float, int]]] = []
        self.max_stop = max((len(x) for x in params.stop), default=0)
        self.first_token_at: float | None = None
        self.last_token_at = 0.0
        self.itl: list[float] = []

    def push(self, out: ReqOut) -> bool:
        self.cached_tokens = out.cached_tokens
        if out.cached_tokens_host is not None and out.cached_tokens_disk is not None:
            host, disk = out.cached_tokens_host, out.cached_tokens_disk
            self.cached_details = {"device": out.cached_tokens - host - disk, "host": host, "disk": disk}
        if out.pinned_tokens is not None:
            self.pinned_tokens, self.pin_id = out.pinned_tokens, out.pin_id
        if out.embedding is not None:
            self.embedding = out.embedding
        if out.spec_verify_ct is not None and out.spec_accepted_tokens is not None:
            self.spec = (out.spec_verify_ct, out.spec_accepted_tokens)
        if out.new_ids:
            now = time.perf_counter()
            if self.first_token_at is None:
                self.first_token_at = now
            else:  # tokens that arrive together share the gap since the previous arrival
                self.itl.extend([(now - self.last_token_at) / len(out.new_ids)] * len(out.new_ids))
            self.last_token_at = now
        if out.input_logprobs:
            self.in_lp.extend(out.input_logprobs)
            self.in_top.extend(out.input_top_logprobs or [None] * len(out.input_logprobs))
        if out.output_logprobs:
            self.out_lp.extend(out.output_logprobs)
            self.out_top.extend(out.output_top_logprobs or [])
        for tok in out.new_ids:
            self.output_ids.append(tok)
            before = len(self.text)
            self.text += self.decoder.push([tok])
            if self.params.stop and len(self.output_ids) >= self.params.min_new_tokens:
                hit = find_stop(self.text, self.params.stop, before - self.max_stop + 1)
                if hit is not None:
                    idx, stop = hit
                    self.text = self.text[: idx + len(stop)] if self.params.no_stop_trim else self.text[:idx]
                    self.finish_reason = {"type": "stop", "matched": stop}
                    self.abort_worker = out.finish_reason is None  # the worker is still generating
                    self.finished = True
                    return True
        if out.finish_reason is not None:
            self.text += self.decoder.flush()
            self.finish_reason = dict(out.finish_reason)
            self.finished = True
        return self.finished

    def _fmt(self, entries: list[tuple[float | None, int]]) -> list[list[Any]]:
        with_text = self.s.return_text_in_logprobs
        dec = self.tm.tokenizer.decode
        return [[lp, tid, dec([tid]) if with_text else None] for lp, tid in entries]

    def _fmt_top(self, entries: list[list[tuple[float, int]] | None]) -> list[Any]:
        return [None if e is None else self._fmt(list(e)) for e in entries]

    def timing(self, created: float) -> dict[str, Any]:
        """Latencies for metrics: time to first token (None without tokens) and inter-token gaps."""
        ttft = None if self.first_token_at is None else self.first_token_at - created
        return {"ttft": ttft, "itl": list(self.itl), "e2e": time.perf_counter() - created}

    def result(self, created: float, partial: bool = False) -> dict[str, Any]:
        """The request's output so far. ``partial`` (a stream snapshot before the end) withholds a
        trailing piece of text that may still turn out to start a stop string, so that streamed text
        only ever grows."""
        text = self.text
        if partial and self.max_stop:
            text = text[: len(text) - _stop_prefix_len(text, self.params.stop)]
        meta: dict[str, Any] = {
            "id": self.treq.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason,
            "e2e_latency": time.perf_counter() - created,
        }
        if self.cached_details is not None:
            meta["cached_tokens_details"] = dict(self.cached_details)
        meta["pinned_tokens"] = self.pinned_tokens
        if self.pin_id is not None:
            meta["pin_id"] = self.pin_id
        if self.spec is not None:  # SGLang's names: tokens per verify step (accepted drafts + 1), 0 if none
            verify_ct, accepted = self.spec
            meta["spec_verify_ct"] = verify_ct
            meta["spec_accept_length"] = (verify_ct + accepted) / verify_ct if verify_ct else 0.0
        if self.treq.return_logprob:
            meta["input_token_logprobs"] = self._fmt(self.in_lp)
            meta["output_token_logprobs"] = self._fmt(list(self.out_lp))
            if self.treq.top_logprobs_num:
                meta["input_top_logprobs"] = self._fmt_top(self.in_top)
                meta["output_top_logprobs"] = self._fmt_top(list(self.out_top))
        result = {"text": text, "output_ids": list(self.output_ids), "meta_info": meta}
        if self.embedding is not None:
            result["embedding"] = self.embedding
        return result


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``stops``."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


async def _cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait until they ended (each request's ``finally`` aborts it in the worker)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _set_result(fut: asyncio.Future[StatsOut], value: StatsOut) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[StatsOut], exc: Exception) -> None:
    if not fut.done():
        fut.set_exception(exc)


__all__ = ["MAX_N", "RequestFailedError", "TokenizerManager", "WorkerClient", "WorkerDeadError"]
