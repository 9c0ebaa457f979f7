#!/usr/bin/env bash
# The time model's calibration run on one lent GPU (H200, H20, H100), in under 8 minutes, against the
# preinstalled packages (no installs, PYTHONPATH=.):
#   1. the DSA kernels against the jnp references on the GPU (benchmarks.kernels_gpu, section check)
#   2. python -m glm52_jax.plan.calibrate measure: times every probe the efficiency table rests on (bf16 GEMM on
#      random data, the indexer scoring kernel, the radix-select merge, sparse MLA forward and backward, the
#      grouped-matmul kernel in bf16, on FP8 kernels and on FP8 rows x FP8 kernels (model.expert_dtype=fp8, class
#      grouped_matmul_fp8), a data-dependent loop for the launch floor, the bench-model forward
#      at 4K-128K with kernels=reference and pallas) -> $OUT/measurements.json
#   3. python -m glm52_jax.plan.calibrate table: a new efficiency table from those times
#      ($OUT/efficiency_table.json) and every probe's estimate against its time ($OUT/comparison.json)
# Use the new table with --config.plan.efficiency_table=$OUT/efficiency_table.json (or commit it as
# glm52_jax/plan/efficiency_table.json with its measurements as glm52_jax/plan/measurements_<gpu>.json).
# Usage: OUT=/some/dir bash scripts/gpu_check.sh [--budget SECONDS]   (the probes' share; default 330)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/gpu}"
PY="${PYTHON:-python3}"
BUDGET=330
if [ "${1:-}" = "--budget" ] && [ -n "${2:-}" ]; then BUDGET="$2"; fi
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# As the launcher: the share of the GPU's memory JAX preallocates (the budget plan mode judges against).
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}"
LOG="$OUT/gpu_check.log"

# Say exactly what is missing before spending GPU time.
if ! "$PY" - <<'EOF' 2>&1 | tee "$LOG"; then
import importlib, sys
missing = []
for name in ("jax", "jaxlib", "flax", "numpy", "safetensors"):
    try:
        importlib.import_module(name)
    except Exception as err:
        missing.append(f"{name} ({type(err).__name__}: {err})")
try:
    from jax.experimental.pallas import triton as _  # noqa: F401  Pallas' Triton backend
except Exception as err:
    missing.append(f"jax.experimental.pallas.triton ({err})")
if not missing:
    import jax
    if jax.default_backend() != "gpu":
        missing.append(f"a GPU jax backend (default backend is {jax.default_backend()!r}; jax {jax.__version__}; "
                       "install the jax CUDA plugin matching this jax)")
    try:
        import glm52_jax.kernels.sparse_mla  # noqa: F401
        import glm52_jax.plan.calibrate  # noqa: F401
    except Exception as err:
        missing.append(f"glm52_jax imports ({type(err).__name__}: {err})")
if missing:
    print("gpu_check: missing: " + "; ".join(missing))
    sys.exit(1)
print(f"gpu_check: environment ok ({jax.devices()[0].device_kind}, jax {jax.__version__})")
EOF
  exit 1
fi
start=$(date +%s)
"$PY" -m benchmarks.kernels_gpu --out "$OUT" --sections env,check --budget 75 2>&1 | tee -a "$LOG"
"$PY" -m glm52_jax.plan.calibrate measure --out "$OUT" --budget "$BUDGET" 2>&1 | tee -a "$LOG"
"$PY" -m glm52_jax.plan.calibrate table --measurements "$OUT/measurements.json" --out "$OUT/efficiency_table.json" \
  --compare "$OUT/comparison.json" 2>&1 | tee -a "$LOG"
echo "gpu_check: done in $(( $(date +%s) - start )) s; results in $OUT" | tee -a "$LOG"
