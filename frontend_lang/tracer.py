"""Tracing: run a program on placeholders (no backend calls) and record its IR graph.

Arguments and generated variables are ``Placeholder`` objects: formatting one (f-strings, ``+``) gives
a marker, so text that depends on it is recorded with a data edge; anything else a program does with
one (branching on it, calling its methods) stops the trace there. The graph's ``prefix`` is the text
every run of the program starts with (before the first argument or generated value): ``run_batch``
caches it once for the whole batch.

A program called from a program being traced is traced too, into a new stream of the same graph
(a ``call`` edge leads there): tracing never sends a request.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from frontend_lang.chat_template import ChatTemplate
from frontend_lang.errors import NestedRoleError
from frontend_lang.ir import (
    Constant,
    Expr,
    ExprList,
    Gen,
    RoleBegin,
    RoleEnd,
    Select,
    TextLike,
    VarScopeBegin,
    VarScopeEnd,
)

_MARKER = re.compile("\x00(arg|var):([^\x00]*)\x00")


class TracingStop(Exception):
    """The program used a placeholder in a way tracing cannot follow."""


# The executor of the program being traced in this context (a thread starts outside any trace).
_TRACING: ContextVar[TracerExecutor | None] = ContextVar("frontend_lang_tracing", default=None)


def current_tracer() -> TracerExecutor | None:
    """The tracer of the program being traced here, or None when nothing is being traced."""
    return _TRACING.get()


@contextmanager
def tracing(executor: TracerExecutor) -> Iterator[None]:
    """Mark ``executor``'s program as the one being traced while the block runs."""
    token = _TRACING.set(executor)
    try:
        yield
    finally:
        _TRACING.reset(token)


class Placeholder(TextLike):
    """A traced argument or variable: formats as a marker, any other use stops the trace."""

    __slots__ = ("kind", "name", "marker")

    def __init__(self, kind: str, name: str) -> None:
        self.kind, self.name = kind, name
        self.marker = f"\x00{kind}:{name}\x00"

    def as_expr(self) -> Expr:
        return Constant(self.marker)

    def __str__(self) -> str:
        return self.marker

    def __format__(self, spec: str) -> str:
        return self.marker

    def __repr__(self) -> str:
        return f"<{self.kind} {self.name}>"

    def __add__(self, other: object) -> Any:
        if isinstance(other, Expr):
            return Constant(self.marker) + other
        return self.marker + str(other)

    def __radd__(self, other: object) -> Any:
        if isinstance(other, Expr):
            return other + Constant(self.marker)
        return str(other) + self.marker

    def _stop(self, *_: Any) -> Any:
        raise TracingStop(f"the program inspects {self!r}, which is unknown while tracing")

    __bool__ = __len__ = __iter__ = __eq__ = __lt__ = __gt__ = __getitem__ = __int__ = __float__ = _stop
    __hash__ = object.__hash__

    def __getattr__(self, name: str) -> Any:
        raise TracingStop(f"the program uses {self!r}.{name}, which is unknown while tracing")


@dataclass(slots=True)
class Node:
    """One step of a program: ``kind`` is argument, text, gen, select, role_begin, role_end,
    var_scope_begin, var_scope_end, set_var, fork, branch, join, call (another program called from
    this one) or program (the first node of a called program's stream); ``stream`` 0 is the main
    state, forked branches and called programs get new stream ids."""

    id: int
    kind: str
    stream: int
    text: str | None = None
    name: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


class Edge(NamedTuple):
    """``seq``: program order within a stream; ``fork``/``join``: across streams; ``call``: from a
    ``call`` node to the called program's stream; ``data``: the destination's text uses the source's
    argument or variable."""

    src: int
    dst: int
    kind: str


@dataclass
class ProgramGraph:
    """The traced IR graph of a program."""

    arguments: list[str]
    nodes: list[Node] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)
    prefix: str = ""
    prefix_open: bool = True
    complete: bool = False
    stopped_by: str | None = None
    producers: dict[str, int] = field(default_factory=dict)

    def add_node(self, kind: str, stream: int, after: int | None, **kw: Any) -> Node:
        node = Node(len(self.nodes), kind, stream, **kw)
        self.nodes.append(node)
        if after is not None:
            self.edges.append(Edge(after, node.id, "seq"))
        for kind_, name in _MARKER.findall(node.text or ""):
            src = self.producers.get(f"{kind_}:{name}")
            if src is not None:
                self.edges.append(Edge(src, node.id, "data"))
        return node

    def kinds(self, stream: int | None = None) -> list[str]:
        """Node kinds in order (of one stream, or all)."""
        return [n.kind for n in self.nodes if stream is None or n.stream == stream]

    def successors(self, node_id: int, kind: str | None = None) -> list[int]:
        return [e.dst for e in self.edges if e.src == node_id and (kind is None or e.kind == kind)]

    def to_dot(self) -> str:
        """Graphviz source of the graph."""
        lines = ["digraph program {"]
        for n in self.nodes:
            label = f"{n.kind} {n.name or ''} {(n.text or '')[:30]!r}".replace('"', "'")
            lines.append(f'  n{n.id} [label="{label}"];')
        lines += [f'  n{e.src} -> n{e.dst} [label="{e.kind}"];' for e in self.edges]
        return "\n".join([*lines, "}"])

    def to_dict(self) -> dict[str, Any]:
        return {
            "arguments": self.arguments,
            "nodes": [asdict(n) for n in self.nodes],
            "edges": [e._asdict() for e in self.edges],
            "prefix": self.prefix,
            "complete": self.complete,
            "stopped_by": self.stopped_by,
        }


class TracerExecutor:
    """Records expressions into a ``ProgramGraph`` instead of running them."""

    def __init__(
        self, graph: ProgramGraph, chat_template: ChatTemplate, stream: int = 0, namespace: str = ""
    ) -> None:
        self.graph, self.chat_template, self.stream = graph, chat_template, stream
        self.namespace = namespace  # prefixes the variable names of a called program (``name#node.``)
        self.text_ = ""
        self.messages_: list[dict[str, str]] = []
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.error_: BaseException | None = None
        self.ret_value: Any = None
        self.last: int | None = None
        self.cur_role: str | None = None
        self._role_start = 0
        self._role_suffix = ""
        self._scopes: dict[str, int] = {}

    def _node(self, kind: str, **kw: Any) -> Node:
        node = self.graph.add_node(kind, self.stream, self.last, **kw)
        self.last = node.id
        return node

    def _text(self, kind: str, text: str, **kw: Any) -> None:
        self._node(kind, text=text, **kw)
        if self.stream == 0 and self.graph.prefix_open:
            m = _MARKER.search(text)
            self.graph.prefix += text if m is None else text[: m.start()]
            self.graph.prefix_open = m is None
        self.text_ += text

    def _produce(self, kind: str, name: str | None, **detail: Any) -> None:
        self.graph.prefix_open = self.graph.prefix_open and self.stream != 0
        node = self._node(kind, name=name, detail=detail)
        if name is not None:
            self.graph.producers[f"var:{self.namespace}{name}"] = node.id
            self.variables[name] = Placeholder("var", self.namespace + name)
            self.text_ += self.variables[name].marker

    def submit(self, expr: Expr) -> None:
        if isinstance(expr, ExprList):
            for item in expr.items:
                self.submit(item)
        elif isinstance(expr, Constant):
            self._text("text", expr.value)
        elif isinstance(expr, Gen):
            params = {k: v for k, v in asdict(expr.params).items() if v is not None}
            self._produce("gen", expr.name, **params)
        elif isinstance(expr, Select):
            self._produce("select", expr.name, choices=list(expr.choices))
        elif isinstance(expr, RoleBegin):
            if self.cur_role is not None:
                raise NestedRoleError(f"cannot open role {expr.role!r} inside role {self.cur_role!r}")
            prefix, self._role_suffix = self.chat_template.role_prefix_suffix(expr.role, self.messages_)
            self._text("role_begin", prefix, name=expr.role)
            self.cur_role, self._role_start = expr.role, len(self.text_)
        elif isinstance(expr, RoleEnd):
            self.messages_.append({"role": expr.role, "content": self.text_[self._role_start :]})
            self._text("role_end", self._role_suffix, name=expr.role)
            self.cur_role = None
        elif isinstance(expr, VarScopeBegin):
            self._node("var_scope_begin", name=expr.name)
            self._scopes[expr.name] = len(self.text_)
        elif isinstance(expr, VarScopeEnd):
            self._produce("var_scope_end", expr.name)
        else:
            raise TypeError(f"unsupported expression {type(expr).__name__}")

    def sync(self) -> None:
        pass

    def wait_program(self) -> None:
        pass

    def get_var(self, name: str) -> Any:
        return self.variables.get(name, Placeholder("var", self.namespace + name))

    def set_var(self, name: str, value: Any) -> None:
        self.variables[name] = value
        node = self._node("set_var", name=name)
        self.graph.producers[f"var:{self.namespace}{name}"] = node.id

    def _new_stream(self) -> int:
        return 1 + max(n.stream for n in self.graph.nodes)

    def call(self, program_name: str) -> TracerExecutor:
        """Record that this program calls another one; the executor that traces the callee (in a
        new stream, its variables scoped so they do not collide with the caller's)."""
        call = self._node("call", name=program_name)
        callee = TracerExecutor(
            self.graph, self.chat_template, self._new_stream(), namespace=f"{program_name}#{call.id}."
        )
        head = callee._node("program", name=program_name)
        call.detail["stream"] = callee.stream
        self.graph.edges.append(Edge(call.id, head.id, "call"))
        return callee

    def fork(self, size: int) -> list[TracerExecutor]:
        self.graph.prefix_open = self.graph.prefix_open and self.stream != 0
        fork = self._node("fork", detail={"size": size})
        children = []
        for _ in range(size):
            child = TracerExecutor(self.graph, self.chat_template, self._new_stream(), self.namespace)
            child.text_, child.messages_, child.variables = (
                self.text_,
                list(self.messages_),
                dict(self.variables),
            )
            child.cur_role, child._role_start, child._role_suffix = (
                self.cur_role,
                self._role_start,
                self._role_suffix,
            )
            branch = child._node("branch", detail={"of": fork.id})
            self.graph.edges.append(Edge(fork.id, branch.id, "fork"))
            children.append(child)
        return children

    def join(self, children: list[TracerExecutor], mode: str) -> None:
        join = self._node("join", detail={"mode": mode, "branches": len(children)})
        self.graph.edges.extend(Edge(c.last, join.id, "join") for c in children if c.last is not None)
        names = dict.fromkeys(n for c in children for n in c.variables if n not in self.variables)
        for name in names:
            self.variables[name] = [c.variables[name] for c in children]
            self.graph.producers[f"var:{self.namespace}{name}"] = join.id
