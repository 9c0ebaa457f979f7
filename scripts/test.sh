#!/usr/bin/env bash
# Runs the CPU test suite (8 virtual devices), installing the environment first if needed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --no-run
export XLA_FLAGS="--xla_force_host_platform_device_count=8 ${XLA_FLAGS:-}"
export JAX_PLATFORMS=cpu
exec .venv/bin/python -m pytest -q "$@"
