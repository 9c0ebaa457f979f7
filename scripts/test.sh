#!/usr/bin/env bash
# Runs ruff, then the CPU test suite (8 virtual devices) in two pytest worker processes (pytest-xdist,
# whole files per worker: the machine has 2 cores and most tests are one-threaded compiles or wait on
# subprocesses), installing the environment first if needed. Within a worker the files share JAX's
# in-memory compile caches and one Python/JAX/torch start; tests/conftest.py bounds the compiled
# programs a process keeps alive (a long session used to exhaust its memory-map table and crash
# XLA:CPU: BUILD_NOTES, "Test process"). GLM52_TEST_WORKERS=0 runs everything in this one process.
# Extra arguments go to pytest (e.g. `-m slow`, or test paths to run just those). The slowest tests
# are listed at the end; faulthandler prints the Python stack if a process ever crashes.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --no-run || exit 1
# The linter first: a style or import-order slip fails in a second, before the suite's minutes.
.venv/bin/ruff check . || exit 1
export XLA_FLAGS="--xla_force_host_platform_device_count=8 ${XLA_FLAGS:-}"
# CPU programs compile at LLVM -O0 (JAX's `jax_disable_most_optimizations`: XLA's backend level 0, no expensive LLVM
# passes): compiling is most of the suite's CPU time (CI 1,134 -> 983 s, with a 250 s test added), and every test's
# results stay within its tolerance. Deviceless GPU compiles are not slowed (XLA_FLAGS' level 0 made XLA:GPU take 149 s instead of 12 s for
# the GPU plan test's programs). Runs keep XLA's defaults. BUILD_NOTES.md, "CI budget".
export JAX_DISABLE_MOST_OPTIMIZATIONS="${JAX_DISABLE_MOST_OPTIMIZATIONS:-1}"
export JAX_PLATFORMS=cpu
# One persistent compilation cache for the run's processes (both workers and every launcher subprocess the
# tests start compile many of the same programs); fresh per run, so nothing outlives it.
if [ -z "${JAX_COMPILATION_CACHE_DIR:-}" ]; then
  JAX_COMPILATION_CACHE_DIR="$(mktemp -d "${TMPDIR:-/tmp}/glm52-jit-cache.XXXXXX")"
  export JAX_COMPILATION_CACHE_DIR
  trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR"' EXIT
fi
# --no-loadscope-reorder: files go out in collection order (tests/conftest.py's LONGEST_FIRST), not most tests first.
.venv/bin/python -X faulthandler -m pytest -q -p no:cacheprovider --durations=25 \
  -n "${GLM52_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
