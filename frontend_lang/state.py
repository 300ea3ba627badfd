"""ProgramState (the ``s`` a program receives) and ProgramStateGroup (what ``s.fork(n)`` returns)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from frontend_lang.ir import Expr, RoleBegin, RoleEnd, VarScopeBegin, VarScopeEnd, to_expr


class Executor(Protocol):
    """What a state needs from its executor (the interpreter's StreamExecutor or the tracer's)."""

    text_: str
    messages_: list[dict[str, str]]
    meta_info: dict[str, Any]
    error_: BaseException | None
    ret_value: Any

    def submit(self, expr: Expr) -> None: ...
    def sync(self) -> None: ...
    def wait_program(self) -> None: ...
    def get_var(self, name: str) -> Any: ...
    def set_var(self, name: str, value: Any) -> None: ...
    def fork(self, size: int) -> list[Any]: ...
    def join(self, children: list[Any], mode: str) -> None: ...


class ProgramState:
    """The state of one running program: append with ``+=``, read variables with ``s["name"]``."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor

    # -- building -------------------------------------------------------------------------------
    def __iadd__(self, other: object) -> ProgramState:
        self.executor.submit(to_expr(other))
        return self

    def _role(self, role: str, expr: object = None) -> None:
        if expr is None:
            self.executor.submit(RoleBegin(role) + RoleEnd(role))
        else:
            self.executor.submit(RoleBegin(role) + to_expr(expr) + RoleEnd(role))

    def system(self, expr: object = None) -> None:
        self._role("system", expr)

    def user(self, expr: object = None) -> None:
        self._role("user", expr)

    def assistant(self, expr: object = None) -> None:
        self._role("assistant", expr)

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """``with s.var_scope("name"):`` stores the text appended inside the block in variable ``name``."""
        self.executor.submit(VarScopeBegin(name))
        yield
        self.executor.submit(VarScopeEnd(name))

    # -- reading --------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        return self.executor.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.executor.set_var(name, value)

    def get_var(self, name: str) -> Any:
        return self.executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self.executor.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        self.executor.sync()
        return name in getattr(self.executor, "variables", {})

    def text(self) -> str:
        """All text so far (waits for queued expressions)."""
        self.executor.sync()
        return self.executor.text_

    def messages(self) -> list[dict[str, str]]:
        """The finished role blocks as chat messages ``{"role", "content"}``."""
        self.executor.sync()
        return list(self.executor.messages_)

    def get_meta_info(self, name: str) -> Any:
        """The backend's meta info for variable ``name`` (a gen's ``meta_info``, a select's scores;
        a list of them for variables gathered by ``join``)."""
        self.executor.get_var(name)
        return self.executor.meta_info.get(name)

    def tool_calls(self, name: str) -> list[Any]:
        """The tool calls (`frontend_lang.tools.ToolCall`: ``id``, ``name``, ``arguments``, ``args``) the
        model made in the ``gen(name, tools=...)``; empty when it made none (``auto``)."""
        self.executor.get_var(name)
        meta = self.executor.meta_info.get(name)
        if not isinstance(meta, dict) or "tool_calls" not in meta:
            raise KeyError(f"variable {name!r} was not generated with tools=")
        return list(meta["tool_calls"])

    def error(self) -> BaseException | None:
        """The exception that stopped the program (raised in its body or by a backend), else None."""
        self.executor.sync()
        return self.executor.error_

    @property
    def ret_value(self) -> Any:
        """What the program function returned (waits for it to return)."""
        self.executor.wait_program()
        return self.executor.ret_value

    def sync(self) -> None:
        """Wait until the program has finished (everything it queued has run)."""
        self.executor.sync()

    # -- fork -----------------------------------------------------------------------------------
    def fork(self, size: int = 1, position_ids_offset: Any = None) -> ProgramStateGroup:
        """``size`` copies of this state that continue independently (and concurrently). The shared
        text is committed to the server's cache first, so every branch reuses it (and, with retention
        hints on, pinned until the branches have finished)."""
        if size < 1:
            raise ValueError(f"fork: size must be >= 1, got {size}")
        return ProgramStateGroup([ProgramState(e) for e in self.executor.fork(size)], self)

    # -- streaming ------------------------------------------------------------------------------
    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Yield text as it is produced: all of it, or only what goes into ``var_name``. Ends when the
        program (or that variable) is done. Use with ``run(..., stream=True)``."""
        ex: Any = self.executor
        if not hasattr(ex, "cond"):
            yield self.text() if var_name is None else str(self[var_name])
            return
        pos = 0
        while True:
            with ex.cond:
                while pos >= len(ex.log) and not ex.is_done(var_name):
                    ex.cond.wait(0.5)
                items, pos = ex.log[pos:], len(ex.log)
                done = ex.is_done(var_name) and pos >= len(ex.log)
            for var, chunk in items:
                if var_name is None or var == var_name:
                    yield chunk
            if done:
                return

    async def text_async_iter(self, var_name: str | None = None) -> AsyncIterator[str]:
        """Async twin of ``text_iter`` (the waiting happens on a worker thread)."""
        it = self.text_iter(var_name)
        loop = asyncio.get_running_loop()
        end = object()
        while True:
            chunk = await loop.run_in_executor(None, next, it, end)
            if chunk is end:
                return
            yield chunk  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup(list[ProgramState]):
    """The branches of a fork. ``group += expr`` appends ``expr`` to every branch; ``group += f``
    (a callable) appends ``f(i)`` to branch ``i``; ``group += [e0, e1, ...]`` (a list or tuple with one
    item per branch) appends item ``i`` to branch ``i``."""

    def __init__(self, states: list[ProgramState], parent: ProgramState) -> None:
        super().__init__(states)
        self.parent = parent

    def __iadd__(self, other: object) -> ProgramStateGroup:  # type: ignore[override,misc]
        if isinstance(other, list | tuple):
            if len(other) != len(self):
                raise ValueError(f"fork group += sequence: {len(other)} items for {len(self)} branches")
            items = list(other)
        elif callable(other) and not isinstance(other, Expr):
            items = [other(i) for i in range(len(self))]
        else:
            items = [other] * len(self)
        for state, item in zip(self, items, strict=True):
            state += item
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch and merge it into the parent.

        ``gather_variable`` (default): each variable a branch set becomes, in the parent, the list of
        its values over the branches (meta info likewise). ``concate_and_append``: the text each branch
        added is appended to the parent, in branch order. A failed branch fails the parent.
        """
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(f"join: unknown mode {mode!r}")
        self.parent.executor.join([s.executor for s in self], mode)
        self.parent.executor.sync()
