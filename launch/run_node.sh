#!/usr/bin/env bash
# One process per node (8 local GPUs each). Usage on every node:
#   GLM52_COORDINATOR=node0:12355 GLM52_NUM_PROCESSES=4 GLM52_PROCESS_ID=<0..3> \
#     bash launch/run_node.sh --config=configs/2m.py --config.model.checkpoint=/ckpt/GLM-5.2
# Under SLURM the GLM52_* variables are not needed (see slurm_4x8.sbatch).
set -euo pipefail
cd "$(dirname "$0")/.."
# Positions: native unless GLM52_ROPE_SCALING_JSON (passed through as the caller set it, no default) or
# --config.model.rope_scaling_json names a payload; configs/2m.py names configs/glm52_2m_yarn.json itself.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}"
exec .venv/bin/python -u -m glm52_jax.launch "$@"
