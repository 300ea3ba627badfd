"""The backend interface: what the interpreter asks of a model server."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from frontend_lang.chat_template import ChatTemplate, get_chat_template
from frontend_lang.choices import ChoicesDecision, ChoicesMethod
from frontend_lang.ir import GenParams
from frontend_lang.tools import ToolCall, ToolSpec


@dataclass(slots=True)
class PromptContext:
    """What a backend sees of a program state: its text, finished messages, the open role and the
    retention priority of the program it belongs to (see ``frontend_lang.retention``)."""

    text: str
    messages: list[dict[str, Any]]  # OpenAI chat messages (with native tools: tool_calls, role "tool")
    role: str | None
    role_text: str
    priority: int | None = None


class BackendError(RuntimeError):
    """The runtime refused or failed a request; the message is the runtime's."""


class ConstraintsNotSupportedError(NotImplementedError):
    """``regex=`` / ``json_schema=`` / ``dtype=`` on a runtime without constrained decoding."""


class BaseBackend:
    """A model server as the interpreter sees it. Subclasses implement ``generate`` and ``select``;
    ``cache_prefix`` is a hint (a no-op where the server has no prefix cache)."""

    chat_template: ChatTemplate = get_chat_template("default")

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def cache_prefix(self, text: str) -> None:
        """Make the server compute and cache ``text`` now (a prefill-only request)."""

    def pin_prefix(self, text: str) -> str | None:
        """Cache ``text`` and keep it from eviction until ``release_pin`` (or the backend's pin TTL
        lapses): the pin's id. None when nothing was pinned: the backend does not pin (retention off;
        nothing was sent) or the server's pin budget is full (it was cached)."""
        return None

    def release_pin(self, pin_id: str) -> None:
        """Let a prefix pinned by ``pin_prefix`` be evicted again."""

    def generate(self, ctx: PromptContext, params: GenParams) -> tuple[Any, dict[str, Any]]:
        """Continue ``ctx.text``: (text, meta_info), or (list of texts, list of meta) when ``n > 1``."""
        raise NotImplementedError

    def generate_stream(self, ctx: PromptContext, params: GenParams) -> Iterator[tuple[str, dict[str, Any]]]:
        """Like ``generate`` but yields (new text, meta_info so far) as tokens arrive."""
        text, meta = self.generate(ctx, params)
        yield str(text), meta

    def select(
        self, ctx: PromptContext, choices: list[str], temperature: float, method: ChoicesMethod
    ) -> ChoicesDecision:
        """Score every choice as a continuation of ``ctx.text`` and let ``method`` decide."""
        raise NotImplementedError

    def tool_parser_name(self) -> str | None:
        """The tool-call format of ``gen(..., tools=...)`` (a ``radixrt.server.tool_parsers`` name); None
        when this backend cannot offer tools."""
        return None

    def native_tools(self) -> bool:
        """Whether ``gen(..., tools=...)`` goes to the API as ``tools`` (`generate_with_tools`) instead of
        as text in the program's prompt (OpenAI chat models)."""
        return False

    def generate_with_tools(
        self, ctx: PromptContext, params: GenParams, spec: ToolSpec
    ) -> tuple[str, list[ToolCall], dict[str, Any]]:
        """With `native_tools`: the assistant turn's (text, calls, meta_info) for the tools of ``spec``."""
        raise NotImplementedError(f"{type(self).__name__} does not send tools to its API")

    def supports_constraints(self) -> bool:
        """Whether the runtime enforces ``regex`` / ``json_schema`` (constrained decoding)."""
        return False

    def check_constraints(self, params: GenParams) -> None:
        """Raise ConstraintsNotSupportedError unless the runtime can enforce ``params``' constraint."""
        if not self.supports_constraints():
            raise ConstraintsNotSupportedError(
                f"{params.constraint}= (and dtype=) need constrained decoding, which this backend does not "
                "provide (no grammar backend); the request was not sent"
            )

    def flush_cache(self) -> bool:
        """Empty the server's prefix cache; False where it cannot now."""
        return False

    def get_server_info(self) -> dict[str, Any]:
        """Server settings and counters (radixrt: ``cached_tokens``, ``computed_prefill_tokens``, ...)."""
        return {}

    def shutdown(self) -> None:
        """Release what the backend owns (an engine, a connection pool)."""


def validate_choices(choices: list[str]) -> list[str]:
    """Non-empty, distinct strings (select refuses anything else)."""
    if not isinstance(choices, list | tuple) or not choices:
        raise ValueError("choices: select needs a non-empty list of strings")
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"choices: every choice must be a non-empty string, got {choices!r}")
    if len(set(choices)) != len(choices):
        raise ValueError(f"choices: duplicates in {choices!r}")
    return list(choices)
