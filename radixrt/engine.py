"""Engine: the offline, in-process entry point (SGLang's ``Engine`` API), no HTTP.

Same request path as the server: TokenizerManager -> Scheduler; here the scheduler runs on a
thread of this process instead of a worker process.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from typing import Any

from radixrt.config.server_args import ServerArgs
from radixrt.models.config import ModelConfig
from radixrt.models.resolve import resolve_model
from radixrt.models.tokenizer import eos_token_ids, load_tokenizer
from radixrt.server.io_struct import GenerateReqInput
from radixrt.server.tokenizer_manager import TokenizerManager
from radixrt.transport.client import WorkerDeadError
from radixrt.transport.inprocess import InProcessWorker
from radixrt.transport.protocol import FlushCacheReq, GetStatsReq
from radixrt.worker.threads import hold_short_switch_interval, release_short_switch_interval


class Engine:
    """In-process runtime. ``Engine(model_path=..., max_total_tokens=..., ...)`` takes ServerArgs fields."""

    def __init__(self, **kwargs: Any) -> None:
        self.server_args = ServerArgs.from_kwargs(**kwargs)
        args = self.server_args
        resolved = resolve_model(args.model_path, revision=args.revision)
        model_path = resolved.path
        self.model_path = model_path
        self.tokenizer = load_tokenizer(args.tokenizer_path or model_path)
        eos = eos_token_ids(self.tokenizer, model_path)
        self.worker = InProcessWorker(args, model_path, eos)
        cfg: ModelConfig = self.worker.scheduler.runner.config
        name = args.served_model_name or resolved.name
        self.tokenizer_manager = TokenizerManager(
            self.tokenizer,
            self.worker,
            self.worker.scheduler.runner.context_len,
            cfg.vocab_size,
            name,
            args.random_seed,
        )
        self.worker.on_death = lambda exc: self.tokenizer_manager.fail_all(
            WorkerDeadError(f"the scheduler thread died: {exc}")
        )
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(
            target=self._loop.run_forever, name="radixrt-engine-loop", daemon=True
        )
        self._loop_thread.start()
        self._closed = False
        hold_short_switch_interval()  # the scheduler thread shares the GIL with the caller's threads

    # -- generation -----------------------------------------------------------------------------
    @staticmethod
    def _request(
        prompt: str | list[str] | None,
        sampling_params: Any,
        input_ids: Any,
        return_logprob: Any,
        logprob_start_len: Any,
        top_logprobs_num: Any,
        return_text_in_logprobs: bool,
        stream: bool,
        rid: Any,
        cache_salt: Any,
        priority: Any = None,
        cache_control: Any = None,
    ) -> GenerateReqInput:
        return GenerateReqInput(
            text=prompt,
            input_ids=input_ids,
            sampling_params=sampling_params,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs,
            stream=stream,
            rid=rid,
            cache_salt=cache_salt,
            priority=priority,
            cache_control=cache_control,
        )

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: Any = None,
        input_ids: Any = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: Any = None,
        cache_salt: Any = None,
        priority: int | list[int] | None = None,
        cache_control: dict[str, Any] | list[dict[str, Any]] | None = None,
    ) -> Any:
        """Generate for one prompt (a dict), a batch (a list of dicts) or, with ``stream``, an iterator.
        ``priority`` and ``cache_control`` (a TTL pin) are the server's retention fields."""
        obj = self._request(
            prompt,
            sampling_params,
            input_ids,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            return_text_in_logprobs,
            stream,
            rid,
            cache_salt,
            priority,
            cache_control,
        )
        if stream:
            return self._sync_stream(obj)
        fut = asyncio.run_coroutine_threadsafe(self._collect(obj), self._loop)
        return fut.result()

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: Any = None,
        input_ids: Any = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: Any = None,
        cache_salt: Any = None,
        priority: int | list[int] | None = None,
        cache_control: dict[str, Any] | list[dict[str, Any]] | None = None,
    ) -> Any:
        """Awaitable twin of ``generate``; with ``stream`` it returns an async iterator."""
        obj = self._request(
            prompt,
            sampling_params,
            input_ids,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            return_text_in_logprobs,
            stream,
            rid,
            cache_salt,
            priority,
            cache_control,
        )
        if stream:
            return self.tokenizer_manager.generate(obj)
        return await self._collect(obj)

    async def _collect(self, obj: GenerateReqInput) -> Any:
        result: Any = None
        async for out in self.tokenizer_manager.generate(obj):
            result = out
        return result

    def _sync_stream(self, obj: GenerateReqInput) -> Iterator[dict[str, Any]]:
        agen: AsyncGenerator[dict[str, Any], None] = self.tokenizer_manager.generate(obj)
        try:
            while True:
                try:
                    yield asyncio.run_coroutine_threadsafe(_anext(agen), self._loop).result()
                except StopAsyncIteration:
                    return
        finally:
            asyncio.run_coroutine_threadsafe(agen.aclose(), self._loop).result()

    # -- admin ----------------------------------------------------------------------------------
    def flush_cache(self) -> bool:
        """Empty the RadixCache; False (nothing done) while requests run."""
        fut = asyncio.run_coroutine_threadsafe(
            self.tokenizer_manager.control_request(FlushCacheReq()), self._loop
        )
        return fut.result().ok

    def get_server_info(self) -> dict[str, Any]:
        fut = asyncio.run_coroutine_threadsafe(
            self.tokenizer_manager.control_request(GetStatsReq()), self._loop
        )
        return {**self.server_args.to_dict(), "model_path": self.model_path, **fut.result().stats}

    def check_invariant(self, idle: bool = True, timeout: float = 10.0) -> None:
        """Assert the KV accounting invariant on the scheduler thread.

        With ``idle`` it first waits (up to ``timeout`` s) for in-flight aborts to drain, then also
        asserts that nothing is in use or locked.
        """
        deadline = time.monotonic() + timeout
        while idle and not self.worker.call(lambda s: s.is_idle()):
            if time.monotonic() > deadline:
                raise AssertionError("scheduler not idle")
            time.sleep(0.01)
        self.worker.call(lambda s: s.kv.check_invariant(s.live_reqs(), idle=idle))

    def shutdown(self) -> None:
        """Stop the scheduler thread and the event loop."""
        if self._closed:
            return
        self._closed = True
        try:
            self.worker.shutdown()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(timeout=10)
        finally:
            release_short_switch_interval()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


async def _anext(agen: AsyncGenerator[dict[str, Any], None]) -> dict[str, Any]:
    return await agen.__anext__()
