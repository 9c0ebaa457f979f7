#!/usr/bin/env bash
# Runs the CPU test suite (8 virtual devices), installing the environment first if needed.
# Each test file runs in its own pytest process: XLA:CPU has segfaulted late in a single-process
# session (in a compile or a persistent-cache write, after hundreds of programs); a fresh process
# per file keeps one file's compiles from affecting another's. Extra arguments go to every pytest
# call; with arguments naming tests, one pytest call runs just those.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --no-run || exit 1
export XLA_FLAGS="--xla_force_host_platform_device_count=8 ${XLA_FLAGS:-}"
export JAX_PLATFORMS=cpu
for arg in "$@"; do
  if [[ "$arg" != -* ]]; then exec .venv/bin/python -m pytest -q "$@"; fi
done
failed=()
for file in $(find tests -name 'test_*.py' | sort); do
  .venv/bin/python -m pytest -q -p no:cacheprovider "$@" "$file"
  rc=$?
  if [[ $rc -ne 0 && $rc -ne 5 ]]; then failed+=("$file (exit $rc)"); fi  # 5: every test deselected
done
if (( ${#failed[@]} )); then
  printf 'FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "all test files passed"
