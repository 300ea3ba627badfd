#!/usr/bin/env bash
# The demo command (README): install (runtime mode), then run two examples on the embedded default model
# (SmolLM2-135M-Instruct) in one process: the ReAct agent, then structured answers (select + regex).
# Arguments go to examples/demo.py (--model-path, --url).
set -euo pipefail
cd "$(dirname "$0")/.."

args=("$@")
set --  # install.sh reads its own arguments: none is runtime mode
source scripts/install.sh
python examples/demo.py "${args[@]}"
