"""radixrt: a structured-generation runtime with a radix-tree prefix cache."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from radixrt.engine import Engine


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from radixrt.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine"]
