#!/usr/bin/env bash
# GPU check of the DSA kernels (issue 20) on one H200 or H20, in under 8 minutes: the kernels against the jnp
# references on the GPU, kernel and reference timings at GLM-5.2 shapes with the measured bf16 matmul peak, and the
# bench model's forward (ours vs HF eager). Runs against the preinstalled packages (no installs, PYTHONPATH=.);
# writes $OUT/kernels_gpu.json, $OUT/kernels_gpu.md and $OUT/gpu_check.log and prints a summary.
# Usage: OUT=/some/dir bash scripts/gpu_check.sh [--budget SECONDS] [--tune] [--sections env,check,...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/gpu}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# Say exactly what is missing before spending GPU time.
if ! "$PY" - <<'EOF' 2>&1 | tee "$OUT/gpu_check.log"; then
import importlib, sys
missing = []
for name in ("jax", "jaxlib", "flax", "numpy", "torch", "transformers", "safetensors"):
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
    except Exception as err:
        missing.append(f"glm52_jax imports ({type(err).__name__}: {err})")
if missing:
    print("gpu_check: missing: " + "; ".join(missing))
    sys.exit(1)
print("gpu_check: environment ok")
EOF
  exit 1
fi
"$PY" -m benchmarks.kernels_gpu --out "$OUT" "$@" 2>&1 | tee -a "$OUT/gpu_check.log"
