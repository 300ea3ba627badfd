"""Errors a program can meet in the interpreter (backend errors are in ``backends.base``)."""

from __future__ import annotations


class ProgramError(RuntimeError):
    """A variable was read after the program failed (the cause is chained)."""


class NestedRoleError(ValueError):
    """A role block was opened inside another one (e.g. ``user(assistant(...))``)."""
