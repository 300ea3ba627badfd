"""OpenAI: any OpenAI-compatible server (``/v1/chat/completions`` or ``/v1/completions``).

Chat models get the program's finished messages and generate the open assistant turn; completion
models continue the program's text. ``select`` needs prompt logprobs, which only ``/v1/completions``
returns (``echo`` + ``logprobs``): completion models score choices that way, chat models refuse.

``gen(..., tools=...)`` on a chat model sends the tools as the API's ``tools`` / ``tool_choice`` /
``parallel_tool_calls`` and reads ``message.tool_calls``; the program's messages carry them back as an
assistant message's ``tool_calls`` and ``tool(call_id, ...)`` results as ``role: "tool"`` messages, so the
server renders the conversation with the model's own tool format (and constrains ``required`` calls itself).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from frontend_lang.backends.base import BackendError, BaseBackend, PromptContext, validate_choices
from frontend_lang.chat_template import get_chat_template
from frontend_lang.choices import ChoiceScores, ChoicesDecision, ChoicesMethod
from frontend_lang.ir import GenParams
from frontend_lang.tools import ToolCall, ToolSpec

# GenParams fields OpenAI's API has no name for: sent in ``extra_body`` (SGLang/vLLM/radixrt read them).
_EXTRA = ("top_k", "min_p", "ignore_eos", "min_new_tokens", "stop_token_ids", "regex", "json_schema")


class OpenAI(BaseBackend):
    """``OpenAI("gpt-4o-mini")`` or ``OpenAI(model, base_url="http://host:port/v1", api_key=...)``.

    ``is_chat_model`` (default True) picks chat completions; ``chat_template`` names how role blocks
    are rendered in ``s.text()`` (the server applies the model's real template to the messages).
    """

    def __init__(
        self,
        model_name: str,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        is_chat_model: bool = True,
        chat_template: str = "default",
        **client_kwargs: Any,
    ) -> None:
        import openai

        key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        self.client: Any = openai.OpenAI(base_url=base_url, api_key=key, **client_kwargs)
        self.model_name = model_name
        self.is_chat_model = is_chat_model
        self.chat_template = get_chat_template(chat_template)

    def _kwargs(self, params: GenParams) -> dict[str, Any]:
        kw: dict[str, Any] = {"model": self.model_name}
        native = params.to_native()
        for ours, theirs in (("max_new_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                             ("frequency_penalty", "frequency_penalty"), ("presence_penalty", "presence_penalty"),
                             ("n", "n")):  # fmt: skip
            if ours in native:
                kw[theirs] = native[ours]
        if params.stop_list():
            kw["stop"] = params.stop_list()[:4]  # OpenAI accepts at most 4
        extra = {k: native[k] for k in _EXTRA if k in native and native[k] not in (-1, 0, 0.0, False, [])}
        if extra:
            kw["extra_body"] = extra
        return kw

    def _messages(self, ctx: PromptContext) -> list[dict[str, Any]]:
        if ctx.role != "assistant":
            raise ValueError(
                "OpenAI chat models: gen() must be inside an assistant role (assistant(gen(...)))"
            )
        if ctx.role_text:
            raise ValueError("OpenAI chat models: gen() must start the assistant turn (no text before it)")
        return ctx.messages

    def supports_constraints(self) -> bool:
        return True  # passed through in extra_body; a server without them answers with an error

    def generate(self, ctx: PromptContext, params: GenParams) -> tuple[Any, dict[str, Any]]:
        kw = self._kwargs(params)
        try:
            if self.is_chat_model:
                resp = self.client.chat.completions.create(messages=self._messages(ctx), **kw)
                texts = [c.message.content or "" for c in resp.choices]
            else:
                resp = self.client.completions.create(prompt=ctx.text, **kw)
                texts = [c.text for c in resp.choices]
        except ValueError:
            raise
        except Exception as exc:  # openai.APIError and transport errors
            raise BackendError(f"OpenAI backend: {exc}") from exc
        usage = resp.usage
        meta = {
            "id": resp.id,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "completion_tokens": usage.completion_tokens if usage else None,
            "finish_reason": [c.finish_reason for c in resp.choices],
        }
        return (texts if len(texts) > 1 else texts[0]), meta

    def native_tools(self) -> bool:
        return self.is_chat_model

    def generate_with_tools(
        self, ctx: PromptContext, params: GenParams, spec: ToolSpec
    ) -> tuple[str, list[ToolCall], dict[str, Any]]:
        if not self.is_chat_model:
            raise ValueError("tools: the OpenAI backend sends tools to chat models only (is_chat_model=True)")
        kw = self._kwargs(params)
        if kw.get("n", 1) != 1:
            raise ValueError("n: a gen with tools generates one answer")
        choice: Any = spec.choice
        if choice not in ("auto", "required"):
            choice = {"type": "function", "function": {"name": choice}}
        try:
            resp = self.client.chat.completions.create(
                messages=self._messages(ctx),
                tools=list(spec.tools),
                tool_choice=choice,
                parallel_tool_calls=spec.parallel,
                **kw,
            )
        except ValueError:
            raise
        except Exception as exc:  # openai.APIError and transport errors
            raise BackendError(f"OpenAI backend: {exc}") from exc
        choice0 = resp.choices[0]
        calls = [
            ToolCall(c.id, c.function.name, c.function.arguments) for c in choice0.message.tool_calls or []
        ]
        usage = resp.usage
        meta = {
            "id": resp.id,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "completion_tokens": usage.completion_tokens if usage else None,
            "finish_reason": choice0.finish_reason,
        }
        return choice0.message.content or "", calls, meta

    def generate_stream(self, ctx: PromptContext, params: GenParams) -> Iterator[tuple[str, dict[str, Any]]]:
        kw = self._kwargs(params)
        try:
            if self.is_chat_model:
                stream = self.client.chat.completions.create(messages=self._messages(ctx), stream=True, **kw)
            else:
                stream = self.client.completions.create(prompt=ctx.text, stream=True, **kw)
            for chunk in stream:
                if not chunk.choices:
                    continue
                c = chunk.choices[0]
                delta = (c.delta.content or "") if self.is_chat_model else c.text
                yield delta, {"id": chunk.id, "finish_reason": c.finish_reason}
        except ValueError:
            raise
        except Exception as exc:
            raise BackendError(f"OpenAI backend: {exc}") from exc

    def select(
        self, ctx: PromptContext, choices: list[str], temperature: float, method: ChoicesMethod
    ) -> ChoicesDecision:
        choices = validate_choices(choices)
        if self.is_chat_model:
            raise NotImplementedError(
                "select() on an OpenAI chat model: chat completions return no prompt logprobs, so choices "
                "cannot be scored; use a completion model (is_chat_model=False) or RuntimeEndpoint"
            )
        prompts = [ctx.text + c for c in choices]
        if method.requires_unconditional:
            prompts += choices
        try:
            resp = self.client.completions.create(
                model=self.model_name, prompt=prompts, max_tokens=0, echo=True, logprobs=0, temperature=0
            )
        except Exception as exc:
            raise BackendError(
                f"OpenAI backend: select needs echo + logprobs on /v1/completions: {exc}"
            ) from exc
        rows = sorted(resp.choices, key=lambda c: c.index)
        if any(c.logprobs is None or c.logprobs.token_logprobs is None for c in rows):
            raise NotImplementedError("select(): this server returns no prompt logprobs (echo + logprobs)")
        cond = [self._choice_logprobs(r.logprobs, len(ctx.text)) for r in rows[: len(choices)]]
        uncond = None
        if method.requires_unconditional:
            uncond = [list(r.logprobs.token_logprobs) for r in rows[len(choices) :]]
            uncond = [
                u[-len(c) :] if len(u) >= len(c) else [None] * (len(c) - len(u)) + u
                for u, c in zip(uncond, cond, strict=True)
            ]
        return method.decide(ChoiceScores(choices, cond, uncond), temperature)

    @staticmethod
    def _choice_logprobs(lp: Any, boundary: int) -> list[float]:
        """Logprobs of the tokens that end after ``boundary`` (the choice, plus a token it merged into)."""
        out = []
        for token, value, offset in zip(lp.tokens, lp.token_logprobs, lp.text_offset, strict=True):
            if offset + len(token) > boundary and value is not None:
                out.append(float(value))
        return out
