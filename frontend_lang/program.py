"""Program: a decorated function; ``run``, ``run_batch`` and ``trace``."""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from frontend_lang.chat_template import get_chat_template
from frontend_lang.interpreter import StreamExecutor
from frontend_lang.ir import GenParams
from frontend_lang.retention import next_program_priority
from frontend_lang.state import ProgramState
from frontend_lang.tracer import (
    Placeholder,
    ProgramGraph,
    TracerExecutor,
    TracingStop,
    current_tracer,
    tracing,
)

if TYPE_CHECKING:
    from frontend_lang.backends.base import BaseBackend


@dataclass
class GlobalConfig:
    """Process-wide settings (the default backend)."""

    default_backend: Any = None


global_config = GlobalConfig()

# The backend of the program whose function runs in this context: a program called from inside
# another one (without backend=) runs on the caller's backend.
_RUNNING_BACKEND: ContextVar[Any] = ContextVar("frontend_lang_running_backend", default=None)


def resolve_backend(backend: Any) -> BaseBackend:
    """``backend``, else the default one; a ``Runtime`` stands for its ``endpoint``."""
    backend = backend if backend is not None else global_config.default_backend
    if backend is None:
        raise RuntimeError("no backend: pass backend=... or call set_default_backend(...) first")
    return getattr(backend, "endpoint", backend)  # type: ignore[no-any-return]


def default_params(
    max_new_tokens: int = 128,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    min_p: float = 0.0,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    ignore_eos: bool = False,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
) -> GenParams:
    """The run-level defaults every ``gen`` inherits (SGLang's ``run`` keywords)."""
    return GenParams(
        max_new_tokens=max_new_tokens,
        stop=stop,
        stop_token_ids=stop_token_ids,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        ignore_eos=ignore_eos,
        return_logprob=return_logprob,
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num,
    )


_RUN_KEYS = set(inspect.signature(default_params).parameters)


class Program:
    """A frontend program: ``prog.run(**arguments)``, ``prog.run_batch([...])``, ``prog.trace()``."""

    def __init__(
        self,
        func: Callable[..., Any],
        num_api_spec_tokens: int | None = None,
        bind_arguments: dict[str, Any] | None = None,
    ) -> None:
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        params = list(inspect.signature(func).parameters.values())
        if not params:
            raise TypeError(f"{func.__name__}: a program takes the state as its first parameter")
        self.arg_names = [p.name for p in params[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> Program:
        """A copy with some arguments fixed."""
        return Program(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    @staticmethod
    def _split(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        run = {k: kwargs.pop(k) for k in list(kwargs) if k in _RUN_KEYS}
        return run, kwargs

    def run(self, *args: Any, stream: bool = False, backend: Any = None, **kwargs: Any) -> ProgramState:
        """Start one run and return its state without waiting for the generations (SGLang's way).

        Keywords named like ``gen``'s sampling settings (``max_new_tokens``, ``temperature``, ``stop``,
        ...) are defaults for every ``gen``; the rest are the program's arguments. The function runs
        here until it returns (``s += ...`` only queues; reading a value inside it waits for that
        value); with ``stream`` it runs on a thread of its own and ``run`` returns at once (read
        ``state.text_iter()``). Reading the state (``state["var"]``, ``text()``, ``sync()``,
        ``error()``, ``ret_value``) waits for what it reads. An exception raised by the program or a
        backend is in ``state.error()``; reading a variable it kept from being set raises ProgramError.

        Called from a running program without ``backend``, it runs on that program's backend; called
        from a program being traced, it is traced (no request is sent).
        """
        tracer = current_tracer()
        if tracer is not None:
            return self._trace_call(tracer, args, kwargs)
        run_kw, arguments = self._split(dict(kwargs))
        if backend is None:
            backend = _RUNNING_BACKEND.get()
        return self._launch(resolve_backend(backend), args, arguments, default_params(**run_kw), stream)

    def _launch(
        self,
        backend: BaseBackend,
        args: tuple[Any, ...],
        arguments: dict[str, Any],
        params: GenParams,
        stream: bool,
    ) -> ProgramState:
        arguments = {**self.bind_arguments, **arguments}
        executor = StreamExecutor(backend, arguments, params, backend.get_chat_template(), stream)
        executor.program.priority = next_program_priority()
        state = ProgramState(executor)

        def body() -> None:
            executor.program.driver = threading.current_thread()
            token = _RUNNING_BACKEND.set(backend)
            try:
                executor.ret_value = self.func(state, *args, **arguments)
            except Exception as exc:  # noqa: BLE001 - surfaced through state.error()
                executor.program_failed(exc)  # what the program queued before it failed still runs
            finally:
                _RUNNING_BACKEND.reset(token)
                executor.end()
                executor.program.returned.set()

        if stream:
            threading.Thread(target=body, name=f"program-{self.__name__}", daemon=True).start()
        else:
            body()
        return state

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]],
        *,
        num_threads: int | str = "auto",
        progress_bar: bool = True,
        backend: Any = None,
        **run_kwargs: Any,
    ) -> list[ProgramState]:
        """Run once per argument dict, concurrently; the states come back in input order.

        The program is traced first: the text every run starts with is cached once (one prefill-only
        request) before the runs start, and pinned until they have all finished (a retention hint;
        see ``frontend_lang.retention``). ``num_threads="auto"`` runs up to 64 programs at a time.
        Unlike ``run``, it returns when every run has finished.
        """
        if current_tracer() is not None:
            raise TracingStop(f"{self.__name__}.run_batch is not traced")
        backend_ = resolve_backend(backend)
        unknown = set(run_kwargs) - _RUN_KEYS
        if unknown:
            raise TypeError(f"run_batch: unknown keyword(s) {sorted(unknown)}")
        params = default_params(**run_kwargs)
        if not batch_kwargs:
            return []
        pin_id = None
        if len(batch_kwargs) > 1:
            prefix = self.trace(backend=backend_).prefix
            if prefix:
                pin_id = backend_.pin_prefix(prefix)
                if pin_id is None:
                    backend_.cache_prefix(prefix)
        try:
            return self._run_all(backend_, batch_kwargs, params, num_threads, progress_bar)
        finally:
            if pin_id is not None:
                backend_.release_pin(pin_id)

    def _run_all(
        self,
        backend_: BaseBackend,
        batch_kwargs: list[dict[str, Any]],
        params: GenParams,
        num_threads: int | str,
        progress_bar: bool,
    ) -> list[ProgramState]:
        if num_threads == "auto":
            workers = min(len(batch_kwargs), 64, max(8, 4 * (os.cpu_count() or 1)))
        elif isinstance(num_threads, int) and num_threads >= 1:
            workers = num_threads
        else:
            raise ValueError(f"num_threads: expected 'auto' or an int >= 1, got {num_threads!r}")
        states: list[ProgramState | None] = [None] * len(batch_kwargs)
        bar = None
        if progress_bar:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(batch_kwargs), desc=self.__name__)

        def run_one(kw: dict[str, Any]) -> ProgramState:
            state = self._launch(backend_, (), dict(kw), params, False)
            state.sync()
            return state

        with ThreadPoolExecutor(workers, thread_name_prefix="run-batch") as pool:
            futures = {pool.submit(run_one, kw): i for i, kw in enumerate(batch_kwargs)}
            for fut in as_completed(futures):
                states[futures[fut]] = fut.result()
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [s for s in states if s is not None]

    def trace(self, *, backend: Any = None, **kwargs: Any) -> ProgramGraph:
        """The program's IR graph, from running it on placeholders (no requests are sent). Given
        keyword arguments are used as values; the others are placeholders."""
        try:
            template = resolve_backend(backend).get_chat_template()
        except RuntimeError:
            template = get_chat_template("default")
        arguments = {**self.bind_arguments, **kwargs}
        graph = ProgramGraph(arguments=list(self.arg_names))
        for name in self.arg_names:
            if name not in arguments:
                arguments[name] = Placeholder("arg", name)
                graph.producers[f"arg:{name}"] = graph.add_node("argument", 0, None, name=name).id
        executor = TracerExecutor(graph, template)
        try:
            with tracing(executor):
                executor.ret_value = self.func(ProgramState(executor), **arguments)  # type: ignore[arg-type]
            graph.complete = True
        except TracingStop as exc:
            graph.stopped_by = str(exc)
        except Exception as exc:  # noqa: BLE001 - a program may fail on placeholders in many ways
            graph.stopped_by = f"{type(exc).__name__}: {exc}"
        graph.prefix_open = False
        return graph

    def _trace_call(
        self, caller: TracerExecutor, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> ProgramState:
        """This program called (``run`` or ``()``) from one being traced: trace it into the caller's
        graph and return its traced state (its variables are placeholders)."""
        _, arguments = self._split(dict(kwargs))
        executor = caller.call(self.__name__)
        with tracing(executor):
            executor.ret_value = self.func(
                ProgramState(executor),  # type: ignore[arg-type]
                *args,
                **{**self.bind_arguments, **arguments},
            )
        return ProgramState(executor)  # type: ignore[arg-type]
