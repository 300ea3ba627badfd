#!/usr/bin/env bash
# The prepared GPU check (one run, under 8 minutes on one H200): install the carried wheels, print the GPU
# and versions, run the GPU test subset, run the GPU benchmark, write JSON + a table into --out DIR.
#
#   bash scripts/gpu_check.sh --out DIR            # on the GPU machine (wheels from scripts/gpu_wheels.sh)
#   bash scripts/gpu_check.sh --dry-run --out DIR  # anywhere: tiny shapes on CPU, CUDA parts skipped
set -euo pipefail
cd "$(dirname "$0")/.."

OUT="" DRY=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    *) echo "gpu_check: unknown argument $1 (usage: gpu_check.sh [--dry-run] --out DIR)" >&2; exit 2 ;;
  esac
done
[[ -n "$OUT" ]] || { echo "gpu_check: --out DIR is required" >&2; exit 2; }
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export RADIXRT_CACHE_DIR="${RADIXRT_CACHE_DIR:-$PWD/.gpu_check_cache}"

step() { echo; echo "=== gpu_check: $* ($(date +%T))"; }

step "1/4 wheels and versions"
if [[ $DRY -eq 0 && -d .gpu_wheels ]]; then
  # --no-index: the GPU machine has no network; --no-deps: its torch/triton/transformers stay as they are.
  python -m pip install -q --no-index --no-deps .gpu_wheels/*.whl
elif [[ $DRY -eq 0 ]]; then
  echo "no .gpu_wheels/ carried (scripts/gpu_wheels.sh builds it): using what is installed"
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "no nvidia-smi here"
python - <<'PY' | tee "$OUT/versions.txt"
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
for name in ("triton", "flashinfer", "transformers", "xgrammar", "msgspec", "zmq", "gguf"):
    try:
        mod = importlib.import_module(name)
        print(name, getattr(mod, "__version__", "?"))
    except Exception as exc:  # a report line per package, whatever went wrong
        print(name, "unavailable:", type(exc).__name__, exc)
PY

step "2/4 GPU test subset"
TESTS=(tests/test_gpu.py tests/test_triton_kernels.py)
# Dry run: tests/test_gpu.py skips its CUDA cases with a message; the Triton kernels' interpreter run is
# CI's own job (tests/test_triton_kernels.py), not repeated here.
[[ $DRY -eq 1 ]] && TESTS=(tests/test_gpu.py)
set +e
python -m pytest -q -rs -p no:cacheprovider "${TESTS[@]}" --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.txt"
TESTS_RC=${PIPESTATUS[0]}
set -e

step "3/4 benchmark"
BENCH_FLAGS=()
[[ $DRY -eq 1 ]] && BENCH_FLAGS+=(--dry-run)
python -m benchmarks.gpu_speed --out "$OUT" "${BENCH_FLAGS[@]}"

step "4/4 summary"
python - "$OUT" "$TESTS_RC" <<'PY' | tee "$OUT/summary.md"
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
out, rc = Path(sys.argv[1]), int(sys.argv[2])
suite = ET.parse(out / "gpu_tests.xml").getroot()
suite = suite if suite.tag == "testsuite" else suite[0]
counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
print(f"GPU tests: {counts['tests']} run, {counts['failures']} failed, {counts['errors']} errors, "
      f"{counts['skipped']} skipped (pytest exit {rc})")
print()
print((out / "gpu_speed.md").read_text())
summary = {"tests": counts, "pytest_exit": rc, "bench": json.loads((out / "gpu_speed.json").read_text())}
(out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
PY
exit "$TESTS_RC"
