"""The user-facing language: ``function``, ``gen``, ``select``, roles and the default backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from frontend_lang.choices import ChoicesMethod, resolve_method
from frontend_lang.ir import (
    Expr,
    ExprList,
    Gen,
    GenParams,
    RoleBegin,
    RoleEnd,
    Select,
    VarScopeBegin,
    VarScopeEnd,
    dtype_name,
    to_expr,
)
from frontend_lang.program import Program, global_config
from frontend_lang.tools import tool_spec


def function(func: Callable[..., Any] | None = None, *, num_api_spec_tokens: int | None = None) -> Any:
    """Decorator turning ``def prog(s, ...)`` into a ``Program``: ``@function`` or ``@function(...)``.

    ``num_api_spec_tokens`` (SGLang's speculative execution for API models) is accepted and ignored.
    """
    if func is None:
        return lambda f: Program(f, num_api_spec_tokens=num_api_spec_tokens)
    return Program(func, num_api_spec_tokens=num_api_spec_tokens)


def set_default_backend(backend: Any) -> None:
    """The backend ``run`` / ``run_batch`` use when none is passed (a ``Runtime`` means its endpoint)."""
    global_config.default_backend = backend


def flush_cache(backend: Any = None) -> bool:
    """Empty the (default) backend's prefix cache."""
    from frontend_lang.program import resolve_backend

    return resolve_backend(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict[str, Any]:
    """The (default) backend's settings and counters."""
    from frontend_lang.program import resolve_backend

    return resolve_backend(backend).get_server_info()


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    n: int | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    dtype: Any = None,
    regex: str | None = None,
    json_schema: str | dict[str, Any] | None = None,
    choices: list[str] | None = None,
    choices_method: ChoicesMethod | str | None = None,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: str | dict[str, Any] = "auto",
    parallel_tool_calls: bool = False,
) -> Expr:
    """Generate text into variable ``name`` (unset parameters take the run's defaults).

    With ``choices`` it is ``select``. ``dtype`` (int, float, bool, str) and ``regex`` / ``json_schema``
    constrain the output; they need a runtime with constrained decoding. ``n > 1`` stores a list of
    n texts in the variable and appends none of them.

    ``tools`` (OpenAI function tools) lets the model call functions: ``tool_choice`` ``"auto"``,
    ``"required"`` or a function's name (those two constrain decoding so the calls always parse and
    validate), ``parallel_tool_calls`` allows several calls; ``ProgramState.tool_calls(name)`` returns the
    parsed calls (`frontend_lang.tools`).
    """
    if choices is not None:
        return select(name, choices, temperature or 0.0, choices_method)
    if regex is not None and json_schema is not None:
        raise ValueError("gen: give at most one of regex and json_schema")
    params = GenParams(
        max_new_tokens=max_tokens,
        min_new_tokens=min_tokens,
        stop=stop,
        stop_token_ids=stop_token_ids,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        ignore_eos=ignore_eos,
        n=n,
        return_logprob=return_logprob,
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num,
        dtype=dtype_name(dtype),
        regex=regex,
        json_schema=json_schema,
    )
    spec = None if tools is None else tool_spec(tools, tool_choice, parallel_tool_calls)
    return Gen(name, params, spec)


def gen_int(name: str | None = None, **kwargs: Any) -> Expr:
    """``gen(name, dtype=int, ...)``."""
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Expr:
    """``gen(name, dtype=str, ...)`` (a double-quoted string)."""
    return gen(name, dtype=str, **kwargs)


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesMethod | str | None = None,
) -> Expr:
    """Append the most likely of ``choices`` (scored in one batched request) and store it in ``name``.

    ``choices_method``: ``token_length_normalized`` (default), ``greedy_token_selection`` or
    ``unconditional_likelihood_normalized`` (objects from ``frontend_lang`` or their names).
    ``temperature`` > 0 samples from softmax(score / temperature) instead of taking the best.
    """
    if not choices:
        raise ValueError("select: choices must be a non-empty list of strings")
    return Select(name, list(choices), temperature, resolve_method(choices_method))


def _role(role: str, expr: object) -> Expr:
    if expr is None:
        return ExprList([RoleBegin(role), RoleEnd(role)])
    return ExprList([RoleBegin(role), to_expr(expr), RoleEnd(role)])


def system(expr: object = None) -> Expr:
    """A system message block (rendered with the backend's chat template)."""
    return _role("system", expr)


def user(expr: object = None) -> Expr:
    """A user message block."""
    return _role("user", expr)


def assistant(expr: object = None) -> Expr:
    """An assistant message block (put ``gen`` inside to generate the reply)."""
    return _role("assistant", expr)


def system_begin() -> Expr:
    return RoleBegin("system")


def system_end() -> Expr:
    return RoleEnd("system")


def user_begin() -> Expr:
    return RoleBegin("user")


def user_end() -> Expr:
    return RoleEnd("user")


def assistant_begin() -> Expr:
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    return RoleEnd("assistant")


def var_scope(name: str, expr: object) -> Expr:
    """Append ``expr`` and also store the text it produced in variable ``name``."""
    return ExprList([VarScopeBegin(name), to_expr(expr), VarScopeEnd(name)])


def image(path: Any) -> Expr:
    """Multimodal input: not supported by radixrt (text-only models)."""
    raise NotImplementedError("image(): multimodal input is not supported by radixrt (text-only models)")


def video(path: Any, num_frames: int = 0) -> Expr:
    """Multimodal input: not supported by radixrt (text-only models)."""
    raise NotImplementedError("video(): multimodal input is not supported by radixrt (text-only models)")
