#!/usr/bin/env bash
# The demo command (README): install, then run the ReAct agent example on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install.sh
python examples/react_agent.py "$@"
