# Sourced by scripts/install.sh: pick the Python environment radixrt installs into.
# An active virtual environment is used as it is; otherwise the repository's own `.venv` is created
# (first run) and activated, so the test and demo commands never install into the system Python.
if [[ -z "${VIRTUAL_ENV:-}" ]]; then
  if [[ ! -x .venv/bin/python ]]; then
    echo "[radixrt] creating a virtual environment in .venv"
    python3 -m venv .venv
  fi
  # shellcheck disable=SC1091
  source .venv/bin/activate
fi
