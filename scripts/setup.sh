#!/usr/bin/env bash
# Creates .venv with Python 3.12, installs glm52-jax with its test and deviceless-GPU-compile extras, then runs
# the main job.
# Usage: bash scripts/setup.sh [--no-run]
set -euo pipefail
cd "$(dirname "$0")/.."

find_python312() {
  if command -v pyenv >/dev/null 2>&1; then
    local root; root=$(pyenv root)
    for p in "$root"/versions/3.12*/bin/python3.12; do
      [ -x "$p" ] && { echo "$p"; return; }
    done
  fi
  for p in "$HOME"/.pyenv/versions/3.12*/bin/python3.12 "$(command -v python3.12 || true)"; do
    [ -n "$p" ] && [ -x "$p" ] && { echo "$p"; return; }
  done
  echo "error: Python 3.12 not found (looked in pyenv versions and on PATH); install it, e.g. 'pyenv install 3.12'" >&2
  exit 1
}

if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
  rm -rf .venv
  "$(find_python312)" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[test,gpu-aot]'

if [ "${1:-}" != "--no-run" ]; then
  .venv/bin/python -m glm52_jax.launch
fi
