"""Command-line flags from a settings dataclass: one ``--flag-name`` per field, its help and choices read
from the field's metadata (`arg`), so ``--help``, the defaults and docs/flags.md have one source.

Generic over the dataclass (nothing here imports ``ServerArgs``): `radixrt.config.server_args` declares its
fields with `arg` and builds its parser with `add_flags`; `radixrt.config.flags_doc` renders the same
`FlagSpec` list as markdown.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

_KINDS: dict[str, type] = {"int": int, "float": float, "str": str}


def arg(default: Any, help: str, choices: Sequence[str] | None = None) -> Any:
    """A settings field: its default, its help text and (for a fixed set of values) its choices."""
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = tuple(choices)
    return field(default=default, metadata=meta)


@dataclass(frozen=True, slots=True)
class FlagSpec:
    """One flag as ``--help`` and docs/flags.md show it."""

    name: str  # the field's name, also argparse's dest
    kind: str  # "int", "float", "str" or "flag" (a bool that the flag turns on)
    default: Any
    help: str
    choices: tuple[str, ...] | None
    section: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def default_text(self) -> str:
        """The default as a user reads it: ``unset`` for None, ``off`` for a flag."""
        if self.default is None:
            return "unset"
        if isinstance(self.default, bool):
            return "on" if self.default else "off"
        return str(self.default)


def flag_specs(cls: type, sections: Mapping[str, str]) -> list[FlagSpec]:
    """The flags of dataclass ``cls`` in field order. ``sections`` maps the first field of each section
    to its title (the fields of a section are consecutive). ValueError for a field without help text,
    a field without a default, or a ``sections`` key that is not a field."""
    fields = dataclasses.fields(cls)
    unknown = sorted(set(sections) - {f.name for f in fields})
    if unknown:
        raise ValueError(f"sections: {', '.join(unknown)} not field(s) of {cls.__name__}")
    if fields and fields[0].name not in sections:
        raise ValueError(f"sections: the first field, {fields[0].name}, starts no section")
    specs, section = [], ""
    for f in fields:
        section = sections.get(f.name, section)
        help_text = str(f.metadata.get("help", "")).strip()
        if not help_text:
            raise ValueError(f"{cls.__name__}.{f.name}: no help text (declare it with arg(default, help))")
        if f.default is dataclasses.MISSING:
            raise ValueError(f"{cls.__name__}.{f.name}: no default")
        type_name = str(f.type).removesuffix(" | None")
        kind = "flag" if type_name == "bool" else type_name
        if kind != "flag" and kind not in _KINDS:
            raise ValueError(f"{cls.__name__}.{f.name}: unsupported type {f.type!s}")
        specs.append(FlagSpec(f.name, kind, f.default, help_text, f.metadata.get("choices"), section))
    return specs


def add_flags(parser: argparse.ArgumentParser, specs: Sequence[FlagSpec]) -> None:
    """Add one ``--flag-name`` per spec, grouped by section, each help ending with its default."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for spec in specs:
        group = groups.get(spec.section)
        if group is None:
            group = groups[spec.section] = parser.add_argument_group(spec.section)
        # NOTE: argparse %-formats help strings.
        text = f"{spec.help} (default: {spec.default_text})".replace("%", "%%")
        if spec.kind == "flag":
            group.add_argument(
                spec.flag, dest=spec.name, action="store_true", default=spec.default, help=text
            )
        else:
            group.add_argument(
                spec.flag,
                dest=spec.name,
                type=_KINDS[spec.kind],
                default=spec.default,
                choices=spec.choices,
                help=text,
            )
