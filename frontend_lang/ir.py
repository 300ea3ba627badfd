"""The program IR: expressions a program appends to its state (``s += expr``) and gen parameters.

Expressions are plain data; the interpreter (``interpreter.py``) executes them against a backend and
the tracer (``tracer.py``) records them into a graph. ``a + b`` concatenates expressions, so
``s += "Q: " + gen("a")`` appends two expressions in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

# SGLang's named regexes (``sglang.lang.ir``), for ``gen(regex=REGEX_INT + ",")`` and the like; these
# exact strings, so that programs written against them behave the same. (``dtype=`` uses DTYPE_REGEX.)
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

# dtype -> regex of its textual form (the constraint is enforced by the runtime's grammar backend).
DTYPE_REGEX: dict[str, str] = {
    "int": r"[-+]?(0|[1-9][0-9]*)",
    "float": r"[-+]?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?",
    "bool": r"(True|False)",
    "str": r'"[^"\\\n]*"',
}

# GenParams field -> name in SGLang's native ``sampling_params`` (None: a request-level field).
_NATIVE_NAMES: dict[str, str | None] = {
    "max_new_tokens": "max_new_tokens",
    "min_new_tokens": "min_new_tokens",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "ignore_eos": "ignore_eos",
    "n": "n",
    "regex": "regex",
    "json_schema": "json_schema",
    "ebnf": "ebnf",
    "return_logprob": None,
    "logprob_start_len": None,
    "top_logprobs_num": None,
    "dtype": None,
}


@dataclass(slots=True)
class GenParams:
    """Sampling settings of one ``gen``; ``None`` means "inherit the run's default"."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    n: int | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    dtype: str | None = None
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    ebnf: str | None = None  # set by a gen with tools (the call grammar)

    def merged(self, defaults: GenParams) -> GenParams:
        """These params with every unset field taken from ``defaults``."""
        out = replace(defaults)
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                setattr(out, f.name, value)
        return out

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def constraint(self) -> str | None:
        """Which constraint this gen carries ("regex", "json_schema", "ebnf" or None); dtype is a regex."""
        if self.ebnf is not None:
            return "ebnf"
        if self.json_schema is not None:
            return "json_schema"
        if self.regex is not None or self.dtype is not None:
            return "regex"
        return None

    def to_native(self) -> dict[str, Any]:
        """SGLang native ``sampling_params`` (only the set fields; dtype becomes a regex)."""
        out: dict[str, Any] = {}
        for name, native in _NATIVE_NAMES.items():
            value = getattr(self, name)
            if native is not None and value is not None:
                out[native] = list(value) if isinstance(value, tuple) else value
        if "stop" in out:
            out["stop"] = self.stop_list()
        if self.dtype is not None and self.regex is None:
            out["regex"] = DTYPE_REGEX[self.dtype]
        return out


def dtype_name(dtype: Any) -> str | None:
    """Normalize ``int`` / ``"int"`` (and float, bool, str) to its name; ValueError for others."""
    if dtype is None:
        return None
    name = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", None)
    if name not in DTYPE_REGEX:
        raise ValueError(f"dtype: expected one of int, float, bool, str, got {dtype!r}")
    return str(name)


class TextLike:
    """A value that stands for text without being a ``str`` (the tracer's ``Placeholder``): ``to_expr``
    asks it for its expression, so this module need not know the tracer."""

    __slots__ = ()

    def as_expr(self) -> Expr:
        """The expression this value appends to a program state."""
        raise NotImplementedError


class Expr:
    """Base of every expression; ``+`` builds an ``ExprList``."""

    def __add__(self, other: object) -> ExprList:
        return ExprList([self, to_expr(other)])

    def __radd__(self, other: object) -> ExprList:
        return ExprList([to_expr(other), self])


@dataclass(eq=False)
class ExprList(Expr):
    """Expressions appended one after the other."""

    items: list[Expr] = field(default_factory=list)

    def __post_init__(self) -> None:
        flat: list[Expr] = []
        for item in self.items:
            flat.extend(item.items if isinstance(item, ExprList) else [item])
        self.items = flat


@dataclass(eq=False)
class Constant(Expr):
    """Literal text."""

    value: str


@dataclass(eq=False)
class Gen(Expr):
    """Generate text into variable ``name`` (the text is also appended to the state)."""

    name: str | None
    params: GenParams
    tools: Any = None  # a frontend_lang.tools.ToolSpec: offer tools, parse the calls


@dataclass(eq=False)
class Select(Expr):
    """Pick one of ``choices`` by likelihood; stored in variable ``name`` and appended."""

    name: str | None
    choices: list[str]
    temperature: float = 0.0
    choices_method: Any = None  # a ChoicesMethod; None = the default (token_length_normalized)


@dataclass(eq=False)
class RoleBegin(Expr):
    """Open a chat role (system / user / assistant): appends the template's role prefix."""

    role: str


@dataclass(eq=False)
class RoleEnd(Expr):
    """Close the open role: appends the template's suffix and records the message."""

    role: str


@dataclass(eq=False)
class VarScopeBegin(Expr):
    """Start capturing appended text into a variable (``s += var_scope(...)``)."""

    name: str


@dataclass(eq=False)
class VarScopeEnd(Expr):
    """Store the text appended since the matching ``VarScopeBegin`` in the variable."""

    name: str


def to_expr(value: object) -> Expr:
    """Strings (and anything formatted as text) become ``Constant``; expressions pass through."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Constant(value)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return Constant(str(value))
    if isinstance(value, TextLike):  # a traced argument or variable
        return value.as_expr()
    raise TypeError(
        f"cannot append {type(value).__name__} to a program state (expected str or an expression)"
    )
