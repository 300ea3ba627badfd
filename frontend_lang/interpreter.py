"""StreamExecutor: runs the expressions a program appends, on its own thread, against a backend.

``s += expr`` only queues ``expr``; the executor's thread runs the queue in order, so the program keeps
going until it reads a value (``s["name"]`` waits for that variable). Forked states have their own
executors, which is what makes the branches of a ``fork`` run concurrently.

The program function itself runs on its *driver* thread (the caller of ``run``, or a thread of its
own with ``stream=True``) and may return long before its expressions have run. A reader on another
thread first waits for the function to return (``ProgramRun``), so a value that the function has not
queued yet is waited for, not reported missing.
"""

from __future__ import annotations

import queue
import threading
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from frontend_lang.backends.base import PromptContext
from frontend_lang.chat_template import ChatTemplate
from frontend_lang.choices import resolve_method
from frontend_lang.errors import NestedRoleError, ProgramError
from frontend_lang.ir import (
    Constant,
    Expr,
    ExprList,
    Gen,
    GenParams,
    RoleBegin,
    RoleEnd,
    Select,
    VarScopeBegin,
    VarScopeEnd,
)
from frontend_lang.retention import branch_priority
from frontend_lang.tool_exec import (
    NativeTurn,
    calls_of,
    calls_text,
    constrained,
    known_call,
    parser_of,
    prompt_text,
    response_turn,
)
from frontend_lang.tools import ToolResult, ToolsPrompt

if TYPE_CHECKING:
    from frontend_lang.backends.base import BaseBackend


class _Join(Expr):
    """Internal: merge forked executors back into their parent (see ``ProgramStateGroup.join``)."""

    def __init__(self, children: list[StreamExecutor], mode: str) -> None:
        self.children, self.mode = children, mode


class _Fail(Expr):
    """Internal: the program function raised ``error`` after queuing what precedes this."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class ProgramRun:
    """The run of one program function, shared by its state and the states forked off it: which
    thread drives it, whether it has returned, and the retention priority its requests carry."""

    def __init__(self, priority: int | None = None) -> None:
        self.driver: threading.Thread | None = None
        self.returned = threading.Event()
        self.priority = priority

    def settled(self) -> bool:
        """True when nothing more can be queued behind this thread's back: the function returned, or
        this thread is the one running it."""
        return self.returned.is_set() or threading.current_thread() is self.driver

    def wait(self) -> None:
        """Wait until the function has returned, unless this thread is the one running it."""
        if threading.current_thread() is not self.driver:
            self.returned.wait()


class StreamExecutor:
    """Executes one program state's expressions in order on a background thread."""

    def __init__(
        self,
        backend: BaseBackend,
        arguments: dict[str, Any],
        default_params: GenParams,
        chat_template: ChatTemplate,
        stream: bool = False,
    ) -> None:
        self.backend = backend
        self.arguments = arguments
        self.default_params = default_params
        self.chat_template = chat_template
        self.stream = stream
        self.text_ = ""
        self.messages_: list[dict[str, Any]] = []
        self.variables: dict[str, Any] = {}
        self.assigned: set[str] = set()  # variables set by this executor (a fork's own results)
        self.fork_pos = 0  # len(text_) when this executor was forked off its parent
        self.fork_depth = 0  # forks between the program's own state and this one
        self.meta_info: dict[str, Any] = {}
        self.error_: BaseException | None = None
        self.ret_value: Any = None
        self.cur_role: str | None = None
        self._role_start = 0
        self._role_suffix = ""
        self._turn = NativeTurn()  # the open assistant turn's tool calls, with a native-tools backend
        self._scopes: dict[str, int] = {}
        self._events: defaultdict[str, threading.Event] = defaultdict(threading.Event)
        # Stream log: (variable being produced or None, appended text); readers wait on ``cond``.
        self.cond = threading.Condition()
        self.log: list[tuple[str | None, str]] = []
        self.finished = False
        self._children: list[StreamExecutor] = []  # forks, ended with this executor if never joined
        self._pins: list[tuple[list[StreamExecutor], str]] = []  # (fork branches, pin of their prefix)
        self.program = ProgramRun()
        self._closed = False  # end() was called: no more expressions
        self._queue: queue.Queue[Expr | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="frontend-executor", daemon=True)
        self._thread.start()

    # -- program side ---------------------------------------------------------------------------
    def submit(self, expr: Expr) -> None:
        if self._closed:
            raise RuntimeError("the program state has ended; it accepts no more expressions")
        for name in _produced(expr):
            self._events[name].clear()
        self._queue.put(expr)

    def sync(self) -> None:
        """Wait until the program function has returned (unless called from it) and every queued
        expression has run."""
        self.program.wait()
        self._queue.join()

    def wait_program(self) -> None:
        """Wait until the program function has returned (unless called from it)."""
        self.program.wait()

    def program_failed(self, error: BaseException) -> None:
        """The program function raised: record ``error`` once what it queued before has run."""
        self._queue.put(_Fail(error))

    def end(self, wait: bool = False) -> None:
        """Accept no more expressions; the thread stops after running what is queued (``wait``: wait
        for that). States forked off this one and never joined end too."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
        for child in self._children:
            child.end()
        if wait:
            self._thread.join()

    def get_var(self, name: str) -> Any:
        """The variable's value, waiting for the queued expression that produces it (and, from
        another thread, for the program function to queue it).

        Raises ProgramError (chaining the cause) if the program failed first, KeyError if nothing
        queued produces it.
        """
        event = self._events[name]
        while not event.wait(0.05):
            if self.program.settled() and self._queue.unfinished_tasks == 0 and not event.is_set():
                break  # idle, and nothing queued (or to be queued) will set it
        if name in self.variables:
            return self.variables[name]
        if self.error_ is not None:
            raise ProgramError(f"variable {name!r} was not produced: the program failed") from self.error_
        raise KeyError(f"variable {name!r} is not set")

    def set_var(self, name: str, value: Any) -> None:
        with self.cond:
            self.variables[name] = value
            self.assigned.add(name)
            self._events[name].set()
            self.cond.notify_all()

    def is_done(self, var_name: str | None = None) -> bool:
        """True once the program ended (or failed), or, with ``var_name``, once that variable is set."""
        if self.finished or self.error_ is not None:
            return True
        return var_name is not None and var_name in self.variables and self._events[var_name].is_set()

    def fail(self, error: BaseException) -> None:
        """Record the first error; wake everyone waiting for a variable."""
        with self.cond:
            if self.error_ is None:
                self.error_ = error
            for event in list(self._events.values()):
                event.set()
            self.cond.notify_all()

    def context(self) -> PromptContext:
        role_text = self.text_[self._role_start :] if self.cur_role else ""
        prio = self.program.priority
        if prio is not None:
            prio = branch_priority(prio, self.fork_depth)
        return PromptContext(self.text_, list(self.messages_), self.cur_role, role_text, prio)

    def fork(self, size: int) -> list[StreamExecutor]:
        """Run what is queued, commit the shared text to the backend's cache (one prefill-only
        request; with retention hints a pin, which caches it and is released at the join or once
        the branches have finished) and return ``size`` executors that continue from here, each on
        its own thread."""
        self.sync()
        pin_id = None
        if self.error_ is None and size > 1 and self.text_:
            try:
                pin_id = self.backend.pin_prefix(self.text_)
                if pin_id is None:
                    self.backend.cache_prefix(self.text_)
            except Exception as exc:  # noqa: BLE001 - surfaced through state.error()
                self.fail(exc)
        children = [self.fork_child() for _ in range(size)]
        self._children.extend(children)
        if pin_id is not None:
            self._pins.append((children, pin_id))
        return children

    def _release_pins(self, children: list[StreamExecutor] | None = None) -> None:
        """Release the pins of the forks whose branches are ``children`` (None: of every fork, once
        its branches have finished)."""
        keep = []
        for branches, pin_id in self._pins:
            if children is not None and branches != children:
                keep.append((branches, pin_id))
                continue
            for branch in branches:
                branch._thread.join()
            try:
                self.backend.release_pin(pin_id)
            except Exception as exc:  # noqa: BLE001 - surfaced through state.error()
                self.fail(exc)
        self._pins = keep

    def join(self, children: list[StreamExecutor], mode: str) -> None:
        """Queue the merge of ``children`` (see ``ProgramStateGroup.join``)."""
        self.submit(_Join(children, mode))

    def fork_child(self) -> StreamExecutor:
        """A new executor that starts from this one's current (synced) state."""
        child = StreamExecutor(
            self.backend, self.arguments, self.default_params, self.chat_template, self.stream
        )
        child.text_, child.messages_ = self.text_, list(self.messages_)
        child.variables, child.meta_info = dict(self.variables), dict(self.meta_info)
        child.cur_role, child._role_start, child._role_suffix = (
            self.cur_role,
            self._role_start,
            self._role_suffix,
        )
        child._turn = self._turn.copy()
        child.fork_pos = len(self.text_)
        child.fork_depth = self.fork_depth + 1
        child.program = self.program  # the branches are driven by this program's function
        for name in child.variables:
            child._events[name].set()
        return child

    # -- executor thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            expr = self._queue.get()
            if expr is None:
                self._release_pins()
                with self.cond:
                    self.finished = True
                    for event in list(self._events.values()):
                        event.set()
                    self.cond.notify_all()
                self._queue.task_done()
                return
            try:
                if isinstance(expr, _Fail):
                    self.fail(expr.error)
                elif self.error_ is None:
                    self._execute(expr)
                else:  # skipped after a failure: nobody may wait for its variables
                    for name in _produced(expr):
                        self._events[name].set()
            except Exception as exc:  # noqa: BLE001 - surfaced through state.error()
                self.fail(exc)
            finally:
                self._queue.task_done()

    def _append(self, text: str, var: str | None = None) -> None:
        if not text:
            return
        with self.cond:
            self.text_ += text
            self.log.append((var, text))
            self.cond.notify_all()

    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, ExprList):
            for item in expr.items:
                self._execute(item)
        elif isinstance(expr, Constant):
            self._append(expr.value)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, VarScopeBegin):
            self._scopes[expr.name] = len(self.text_)
        elif isinstance(expr, VarScopeEnd):
            self.set_var(expr.name, self.text_[self._scopes.pop(expr.name) :])
        elif isinstance(expr, _Join):
            self._join(expr)
        elif isinstance(expr, ToolsPrompt):
            if not self.backend.native_tools():  # else the API carries the tools
                self._append(prompt_text(parser_of(self.backend), expr.tools))
        elif isinstance(expr, ToolResult):
            self._tool_result(expr)
        else:
            raise TypeError(f"unsupported expression {type(expr).__name__}")

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise NestedRoleError(
                f"cannot open role {role!r} inside role {self.cur_role!r}: roles do not nest"
            )
        prefix, self._role_suffix = self.chat_template.role_prefix_suffix(role, self.messages_)
        self._append(prefix)
        self.cur_role, self._role_start = role, len(self.text_)
        self._turn = NativeTurn()

    def _role_end(self, role: str, message: dict[str, Any] | None = None) -> None:
        """Close ``role``; its chat message is ``message`` when given (a tool result), else its text (with
        the native tool calls it made, when it made any)."""
        if self.cur_role != role:
            raise NestedRoleError(f"{role}_end() without a matching {role}_begin() (open: {self.cur_role})")
        content = self.text_[self._role_start :]
        self._append(self._role_suffix)
        if message is None:
            message = self._turn.message(role, self.text_, self._role_start, content)
        self.messages_.append(message)
        self.cur_role = None

    def _gen(self, expr: Gen) -> None:
        params = expr.params.merged(self.default_params)
        if self.cur_role == "assistant" and self.chat_template.stop_str:
            params.stop = params.stop_list() + [
                s for s in self.chat_template.stop_str if s not in params.stop_list()
            ]
        if expr.tools is not None and self.backend.native_tools():
            self._gen_native_tools(expr, params)
            return
        parser = None
        if expr.tools is not None:
            parser = parser_of(self.backend)
            params = constrained(params, expr.tools, parser)
        if params.constraint is not None:
            self.backend.check_constraints(params)
        ctx = self.context()
        if self.stream and (params.n or 1) == 1 and parser is None:
            pieces: list[str] = []
            meta: dict[str, Any] = {}
            for delta, snapshot in self.backend.generate_stream(ctx, params):
                meta = snapshot
                pieces.append(delta)
                self._append(delta, expr.name)
            value: Any = "".join(pieces)
        else:
            value, meta = self.backend.generate(ctx, params)
            if isinstance(value, str):
                self._append(value, expr.name)
        if parser is not None:
            meta = {**meta, "tool_calls": calls_of(parser, value, expr.tools)}
        if expr.name is not None:
            self.meta_info[expr.name] = meta
            self.set_var(expr.name, value)

    def _gen_native_tools(self, expr: Gen, params: GenParams) -> None:
        """``gen(..., tools=...)`` sent as the API's tools: the text is the reply's content followed by
        its calls written out (`calls_text`); the turn's chat message carries the calls themselves."""
        assert expr.tools is not None
        if params.constraint is not None:
            raise ValueError(f"tools: cannot be combined with {params.constraint}= in one gen")
        content, calls, meta = self.backend.generate_with_tools(self.context(), params, expr.tools)
        self._append(content, expr.name)
        start = len(self.text_)
        self._append(calls_text(calls), expr.name)
        self._turn.add(calls, start, len(self.text_))
        if expr.name is not None:
            self.meta_info[expr.name] = {**meta, "tool_calls": calls}
            self.set_var(expr.name, self.text_[start - len(content) :])

    def _tool_result(self, expr: ToolResult) -> None:
        """A tool's result as a user turn (the generic tool prompt's ``<tool_response>``); with a
        native-tools backend its chat message is ``role: "tool"`` with the call's id."""
        if not known_call(self.meta_info, expr.call_id):
            raise ValueError(f"call_id: {expr.call_id!r} is not a tool call of this program state")
        self._role_begin("user")
        self._append(response_turn(expr.content))
        message = None
        if self.backend.native_tools():
            message = {"role": "tool", "tool_call_id": expr.call_id, "content": expr.content}
        self._role_end("user", message)

    def _select(self, expr: Select) -> None:
        method = resolve_method(expr.choices_method)
        decision = self.backend.select(self.context(), expr.choices, expr.temperature, method)
        self._append(decision.choice, expr.name)
        if expr.name is not None:
            self.meta_info[expr.name] = decision.meta_info
            self.set_var(expr.name, decision.choice)

    def _join(self, expr: _Join) -> None:
        for child in expr.children:
            child.end(wait=True)
        self._release_pins(expr.children)
        failed = next((c.error_ for c in expr.children if c.error_ is not None), None)
        if failed is not None:
            raise failed
        if expr.mode == "concate_and_append":
            self._append("".join(c.text_[c.fork_pos :] for c in expr.children))
            return
        names = dict.fromkeys(n for c in expr.children for n in sorted(c.assigned))
        for name in names:
            self.meta_info[name] = [c.meta_info.get(name) for c in expr.children]
            self.set_var(name, [c.variables.get(name) for c in expr.children])


def _produced(expr: Expr) -> list[str]:
    """Variables an expression will (re)assign: their events are reset when it is queued."""
    if isinstance(expr, ExprList):
        return [n for item in expr.items for n in _produced(item)]
    if isinstance(expr, Gen | Select) and expr.name is not None:
        return [expr.name]
    if isinstance(expr, VarScopeEnd):
        return [expr.name]
    return []
