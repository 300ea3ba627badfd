#!/usr/bin/env bash
# Install radixrt and what it needs on a fresh machine (idempotent; fast when already installed).
set -euo pipefail
cd "$(dirname "$0")/.."

# The CPU wheel first (it is on local disk): an unpinned torch would resolve to a multi-GB CUDA build.
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[dev]"
