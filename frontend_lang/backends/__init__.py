"""Backends: where a program's requests go (in-process Engine, a server over HTTP, OpenAI-compatible)."""

from __future__ import annotations

from frontend_lang.backends.base import BackendError, BaseBackend, ConstraintsNotSupportedError
from frontend_lang.backends.engine import EngineBackend
from frontend_lang.backends.openai import OpenAI
from frontend_lang.backends.runtime import Runtime
from frontend_lang.backends.runtime_endpoint import RuntimeEndpoint

__all__ = [
    "BackendError",
    "BaseBackend",
    "ConstraintsNotSupportedError",
    "EngineBackend",
    "OpenAI",
    "Runtime",
    "RuntimeEndpoint",
]
