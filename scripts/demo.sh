#!/usr/bin/env bash
# The demo command (README): install on a fresh machine, then run the ReAct agent example on the embedded model.
set -euo pipefail
cd "$(dirname "$0")/.."

# The CPU wheel first (it is on local disk): an unpinned torch would resolve to a multi-GB CUDA build.
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[dev]"

python examples/react_agent.py "$@"
