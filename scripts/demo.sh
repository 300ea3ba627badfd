#!/usr/bin/env bash
# The demo command (README): install, then run two examples on the embedded default model
# (SmolLM2-135M-Instruct): the ReAct agent, then structured answers (select + regex).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install.sh
python examples/react_agent.py "$@"
python examples/classify.py "$@"
