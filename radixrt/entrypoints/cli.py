"""The ``radixrt`` console script: ``radixrt serve ...`` (the server), ``radixrt demo ...``, ``--version``.

Each command parses its own flags (``radixrt serve --help``, ``radixrt demo --help``); this module only
picks the command, so ``radixrt --help`` and ``--version`` import neither the server nor torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from radixrt import __version__

COMMANDS = {
    "serve": "start the HTTP server (its flags: radixrt serve --help, or docs/flags.md)",
    "demo": "run the end-to-end demo in-process (radixrt demo --help)",
}
EXAMPLES = """examples:
  radixrt serve                                   # the embedded SmolLM2-135M-Instruct on port 30000
  radixrt serve --model-path DIR --port 8000      # a Hugging Face checkpoint directory (or a .gguf file)
  radixrt serve --dp-size 2                       # two servers behind sglang-router
  radixrt demo
"""


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: ``--help`` (the commands), ``--version`` and the command's name."""
    parser = argparse.ArgumentParser(
        prog="radixrt",
        description="radixrt: a structured-generation runtime with a radix-tree prefix cache "
        "(an SGLang-compatible server and API).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"radixrt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>", required=True)
    for name, help_text in COMMANDS.items():
        # NOTE: no flags here, not even -h: the command's own parser reads everything after its name.
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _serve(argv: list[str]) -> int:
    from radixrt.entrypoints.launch_server import main as serve_main

    return serve_main(argv, prog="radixrt serve")


def _demo(argv: list[str]) -> int:
    if importlib.util.find_spec("radixrt.entrypoints.demo") is None:
        print(
            "radixrt demo: not available in this build (radixrt.entrypoints.demo is missing)", file=sys.stderr
        )
        return 2
    from radixrt.entrypoints.demo import main as demo_main

    return demo_main(argv)


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``radixrt <command> ...``; returns the exit code. ``--help`` and ``--version`` exit 0, a
    missing or unknown command exits 2 with argparse's error (SystemExit, as argparse does)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        parser.error(f"the command comes first, then its flags: radixrt serve {' '.join(argv)}")
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # --help / --version exit 0; a missing or unknown command exits 2
        parser.error(f"unknown command {argv[0]!r}")  # NOTE: argparse has exited already
    command, rest = argv[0], argv[1:]
    return _serve(rest) if command == "serve" else _demo(rest)


if __name__ == "__main__":
    raise SystemExit(main())
