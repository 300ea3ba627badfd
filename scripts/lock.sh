#!/usr/bin/env bash
# Regenerate requirements/lock.txt (the exact versions every install uses) from pyproject.toml's
# dependencies + dev extra and the pins in requirements/pins.in. Run it after changing a dependency;
# commit the result. Uses pip-tools in a throwaway environment so that it resolves as pip does here
# (pip sees the local CPU torch wheel; uv does not).
set -euo pipefail
cd "$(dirname "$0")/.."

tools="$(mktemp -d)"
trap 'rm -rf "$tools"' EXIT
python3 -m venv "$tools"
"$tools/bin/pip" install -q "pip-tools==7.6.2"
"$tools/bin/pip-compile" -q --extra dev --extra pd --strip-extras --no-emit-index-url --no-emit-find-links \
  -o requirements/lock.txt pyproject.toml requirements/pins.in
echo "wrote requirements/lock.txt"
