"""On/off switches read from the environment (the knobs that are not `ServerArgs` fields, docs/cpu.md)."""

from __future__ import annotations

import os


def env_switch(name: str, default: bool = True) -> bool:
    """The environment variable ``name`` as a switch: ``1`` on, ``0`` off, unset ``default``; ValueError naming
    the variable for anything else."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    if raw not in ("0", "1"):
        raise ValueError(f"{name}: 0 or 1, got {raw!r}")
    return raw == "1"
