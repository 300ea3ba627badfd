"""docs/flags.md, generated from ServerArgs' field metadata: ``python -m radixrt.config.flags_doc --write``.

Without ``--write`` the page goes to stdout. tests/test_cli.py fails when docs/flags.md differs from
`render` (so a new or changed flag regenerates the page in the same change).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from radixrt.config.flags import FlagSpec
from radixrt.config.server_args import ServerArgs

DOC_PATH = Path("docs") / "flags.md"  # relative to the repository root
COMMAND = "python -m radixrt.config.flags_doc --write"

HEADER = f"""# `radixrt serve` flags

Generated from the fields of `ServerArgs` (`radixrt/config/server_args.py`) by `{COMMAND}`;
do not edit by hand. `radixrt serve --help` prints the same text. Where radixrt has a setting that SGLang
has too, the flag has SGLang's name. `Engine(...)` (and the DSL's `Runtime(...)`) take the same settings
as keyword arguments: `--max-total-tokens 8192` is `max_total_tokens=8192`. A `flag` takes no value and
turns its setting on; `unset` is None, whose meaning the flag's text gives."""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(specs: Sequence[FlagSpec] | None = None) -> str:
    """The markdown page: one table per section, one row per flag."""
    specs = ServerArgs.flag_specs() if specs is None else specs
    out = [HEADER]
    section = None
    for spec in specs:
        if spec.section != section:
            section = spec.section
            out.append(f"\n## {section}\n\n| Flag | Type | Default | Description |\n|---|---|---|---|")
        text = spec.help
        if spec.choices:
            text += " Choices: " + ", ".join(f"`{c}`" for c in spec.choices) + "."
        out.append(f"| `{spec.flag}` | {spec.kind} | `{_cell(spec.default_text)}` | {_cell(text)} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Print the page, or with ``--write`` write it to docs/flags.md (under ``--root``)."""
    parser = argparse.ArgumentParser(prog="python -m radixrt.config.flags_doc", description=__doc__)
    parser.add_argument("--write", action="store_true", help=f"write {DOC_PATH} instead of printing it")
    parser.add_argument("--root", type=Path, default=Path("."), help="the repository root (default: .)")
    ns = parser.parse_args(argv)
    page = render()
    if ns.write:
        path = ns.root / DOC_PATH
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(page)
        print(f"wrote {path}")
    else:
        print(page, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
