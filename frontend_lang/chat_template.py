"""Chat templates: the text a role block (system / user / assistant) adds around its content.

``TokenizerChatTemplate`` derives it from the model's own Jinja template (``apply_chat_template``) so
that a program's text equals what the tokenizer renders for the same messages. ``NamedChatTemplate`` is
a fixed table (chatml, llama-3, qwen, mistral, default) for models without a template.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

ROLES = ("system", "user", "assistant")
_SENTINEL = "\x1eRADIXRT_CONTENT\x1e"


class ChatTemplate(Protocol):
    """Role prefix/suffix given the messages so far; ``stop_str`` ends an assistant turn as text."""

    @property
    def name(self) -> str: ...

    @property
    def stop_str(self) -> tuple[str, ...]: ...

    def role_prefix_suffix(self, role: str, history: list[dict[str, str]]) -> tuple[str, str]: ...


@dataclass(frozen=True, slots=True)
class NamedChatTemplate:
    """A fixed table of ``role -> (prefix, suffix)``; ``first_prefix`` opens the conversation."""

    name: str
    roles: dict[str, tuple[str, str]]
    stop_str: tuple[str, ...] = ()
    first_prefix: str = ""
    default_system: str | None = None

    def role_prefix_suffix(self, role: str, history: list[dict[str, str]]) -> tuple[str, str]:
        check_role(role)
        prefix, suffix = self.roles[role]
        head = ""
        if not history:
            head = self.first_prefix
            if self.default_system is not None and role != "system":
                sp, ss = self.roles["system"]
                head += sp + self.default_system + ss
        return head + prefix, suffix


_CHATML = {r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ROLES}
_LLAMA3 = {r: (f"<|start_header_id|>{r}<|end_header_id|>\n\n", "<|eot_id|>") for r in ROLES}

NAMED_TEMPLATES: dict[str, NamedChatTemplate] = {
    "default": NamedChatTemplate(
        "default",
        {"system": ("SYSTEM: ", "\n"), "user": ("USER: ", "\n"), "assistant": ("ASSISTANT: ", "\n")},
        stop_str=("\nUSER:",),
    ),
    "chatml": NamedChatTemplate("chatml", _CHATML, stop_str=("<|im_end|>",)),
    "qwen": NamedChatTemplate(
        "qwen", _CHATML, stop_str=("<|im_end|>",), default_system="You are a helpful assistant."
    ),
    "llama-3": NamedChatTemplate(
        "llama-3", _LLAMA3, stop_str=("<|eot_id|>",), first_prefix="<|begin_of_text|>"
    ),
    "mistral": NamedChatTemplate(
        "mistral",
        {"system": ("[SYSTEM_PROMPT] ", "[/SYSTEM_PROMPT]"), "user": ("[INST] ", " [/INST]"),
         "assistant": ("", "</s>")},
        stop_str=("</s>",),
        first_prefix="<s>",
    ),
}  # fmt: skip


def check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"role: expected one of {ROLES}, got {role!r}")


def get_chat_template(name: str) -> NamedChatTemplate:
    """A named template; ValueError listing the known names otherwise."""
    try:
        return NAMED_TEMPLATES[name]
    except KeyError:
        raise ValueError(
            f"chat_template: unknown template {name!r} (known: {sorted(NAMED_TEMPLATES)})"
        ) from None


def guess_named_template(text: str) -> NamedChatTemplate:
    """The named template whose markers appear in ``text`` (a model path or a Jinja template)."""
    low = text.lower()
    if "<|im_start|>" in text:
        return NAMED_TEMPLATES["chatml"]
    if "<|start_header_id|>" in text or "llama-3" in low or "llama3" in low:
        return NAMED_TEMPLATES["llama-3"]
    if "qwen" in low:
        return NAMED_TEMPLATES["qwen"]
    if "[inst]" in low or "mistral" in low:
        return NAMED_TEMPLATES["mistral"]
    return NAMED_TEMPLATES["default"]


@dataclass(slots=True)
class TokenizerChatTemplate:
    """Role text derived from a tokenizer's Jinja chat template.

    The prefix/suffix of a new message are the difference between the rendering of the history and of
    the history plus that message (whose content is a sentinel), so default system prompts, BOS tokens
    and separators come out exactly as ``apply_chat_template`` writes them. If the template refuses a
    conversation (e.g. it enforces user/assistant alternation), ``fallback`` is used.

    NOTE: a program's text only grows (the text the model saw stays in the prompt, so the radix cache
    keeps hitting). Templates that rewrite earlier turns when a new one is added (Qwen3 drops the
    ``<think>`` block of past assistant turns) therefore render the last turn exactly as
    ``apply_chat_template`` does, but keep the earlier turns as they were generated.
    """

    tokenizer: Any
    fallback: NamedChatTemplate
    name: str = "tokenizer"
    stop_str: tuple[str, ...] = ()
    _cache: dict[tuple[Any, ...], tuple[str, str]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _render(self, messages: list[dict[str, str]]) -> str:
        if not messages:
            return ""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        return str(text)

    def role_prefix_suffix(self, role: str, history: list[dict[str, str]]) -> tuple[str, str]:
        check_role(role)
        key = (role, *((m["role"], m["content"]) for m in history))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        try:
            with self._lock:
                before = self._render(history)
                full = self._render([*history, {"role": role, "content": _SENTINEL}])
        except Exception:  # noqa: BLE001 - a template that raises for this conversation
            return self.fallback.role_prefix_suffix(role, history)
        at = full.find(_SENTINEL)
        if at < 0 or not full.startswith(before) or at < len(before):
            return self.fallback.role_prefix_suffix(role, history)
        out = (full[len(before) : at], full[at + len(_SENTINEL) :])
        if len(self._cache) > 256:
            self._cache.clear()
        self._cache[key] = out
        return out


def template_for_tokenizer(tokenizer: Any, model_path: str = "", name: str | None = None) -> ChatTemplate:
    """The template a backend uses: ``name`` if given, else the tokenizer's own, else a guess from
    the model path (falling back to "default")."""
    if name is not None:
        return get_chat_template(name)
    jinja = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if isinstance(jinja, str) and jinja:
        return TokenizerChatTemplate(tokenizer, guess_named_template(jinja))
    return guess_named_template(model_path)
