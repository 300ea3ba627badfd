"""The ``radixrt`` console script: ``radixrt serve ...`` (the server) and ``radixrt demo ...``."""

from __future__ import annotations

import importlib
import importlib.util
import sys

USAGE = """usage: radixrt <command> [args]

commands:
  serve   start the HTTP server (flags: radixrt serve --help; --dp-size N: N servers behind sglang-router)
          (--tp-size N --nnodes M --node-rank R > 0: only this node's tensor-parallel ranks, no HTTP)
  demo    run the demo (radixrt demo --help)
"""


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``radixrt <command> ...``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from radixrt.entrypoints.launch_server import main as serve_main

        return serve_main(rest, prog="radixrt serve")
    if command == "demo":
        if importlib.util.find_spec("radixrt.entrypoints.demo") is None:
            print(
                "radixrt demo: not available in this build (radixrt.entrypoints.demo is missing)",
                file=sys.stderr,
            )
            return 2
        demo_main = importlib.import_module("radixrt.entrypoints.demo").main
        result = demo_main(rest)
        return int(result or 0)
    print(f"radixrt: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
