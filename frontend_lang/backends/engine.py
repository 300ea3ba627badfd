"""EngineBackend: programs run against an in-process ``radixrt.Engine`` (no HTTP, no subprocess)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

from frontend_lang.backends.native import NativeBackend
from frontend_lang.chat_template import template_for_tokenizer


class EngineBackend(NativeBackend):
    """Wrap an existing ``Engine`` or build one: ``EngineBackend(model_path=..., max_total_tokens=...)``
    (``Engine``'s keyword arguments; no model_path means the embedded demo model). ``chat_template``
    names a template to use instead of the tokenizer's own.

    ``retention``: send the programs' request priorities (``frontend_lang.retention``); None (the
    default) turns it on when ``Engine.generate`` takes a ``priority``. Shared prefixes are not pinned
    (the Engine has no pin API): they are cached with a prefill-only request as without retention.
    """

    def __init__(
        self,
        engine: Any = None,
        *,
        chat_template: str | None = None,
        retention: bool | None = None,
        **engine_kwargs: Any,
    ) -> None:
        from radixrt.engine import Engine
        from radixrt.models.tokenizer import load_tokenizer

        if engine is not None and engine_kwargs:
            raise ValueError("EngineBackend: give an engine or Engine keyword arguments, not both")
        self._owns_engine = engine is None
        self.engine = engine if engine is not None else Engine(**engine_kwargs)
        args = self.engine.server_args
        # NOTE: a private tokenizer copy: the engine's is in use on the engine's own thread.
        self.tokenizer = load_tokenizer(args.tokenizer_path or self.engine.model_path)
        self.chat_template = template_for_tokenizer(self.tokenizer, self.engine.model_path, chat_template)
        takes_priority = "priority" in inspect.signature(self.engine.generate).parameters
        if retention and not takes_priority:
            raise ValueError("retention: this Engine's generate() takes no priority; pass retention=False")
        self.retention = takes_priority if retention is None else retention

    def pin_prefix(self, text: str) -> str | None:
        return None  # no pin API in-process: run_batch and fork cache the prefix without a pin

    @staticmethod
    def _kwargs(payload: dict[str, Any]) -> dict[str, Any]:
        kwargs = dict(payload)
        kwargs["prompt"] = kwargs.pop("text", None)
        return kwargs

    def _call(self, payload: dict[str, Any]) -> Any:
        return self.engine.generate(**self._kwargs(payload))

    def _call_stream(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        yield from self.engine.generate(**self._kwargs(payload))

    def flush_cache(self) -> bool:
        return bool(self.engine.flush_cache())

    def get_server_info(self) -> dict[str, Any]:
        return dict(self.engine.get_server_info())

    def shutdown(self) -> None:
        if self._owns_engine:
            self.engine.shutdown()
