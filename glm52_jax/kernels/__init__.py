"""GPU kernels for DeepSeek Sparse Attention (Pallas, Triton backend) and the seam that picks them.

`ModelOptions.kernels` names the implementation of the indexer top-k and the sparse attention:
"reference" (the jnp code in glm52_jax/model), "pallas" (the kernels here) or "auto" (pallas when
the program is lowered for a GPU, else reference). On a CPU backend the Pallas kernels run in
interpret mode (that is how the CPU tests exercise them); lowered for a GPU (on a GPU, or deviceless
through `kernels.aot`) they compile to Triton kernels.

Modules: indexer (the fused index-scoring kernel, FP8 quantisation), indexer_select (the exact top-k
merge by radix select), sparse_mla (+ _kernels: sparse MLA
forward / backward), aot (deviceless sm_90a compiles) with targets/ (the GPU target configs it uses).
GPU benchmarks: benchmarks/kernels_gpu.py (+ kernels_indexer.py), run by scripts/gpu_check.sh.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

from glm52_jax.choices import KERNELS

# Set while `aot.compile_for_gpu` lowers a program for a GPU from a CPU-backed process.
_lowering_for_gpu = contextvars.ContextVar("glm52_lowering_for_gpu", default=False)


@contextlib.contextmanager
def lowering_for_gpu():
    """Within: programs are being traced for a GPU target although the default backend is the CPU."""
    token = _lowering_for_gpu.set(True)
    try:
        yield
    finally:
        _lowering_for_gpu.reset(token)


def targets_gpu() -> bool:
    """Whether the program being traced will run on a GPU."""
    return _lowering_for_gpu.get() or jax.default_backend() in ("gpu", "cuda", "rocm")


def use_pallas(kernels: str) -> bool:
    """Whether `kernels` (a ModelOptions.kernels value) selects the Pallas kernels here."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels: expected one of {KERNELS}, got {kernels!r}")
    return kernels == "pallas" or (kernels == "auto" and targets_gpu())


def traffic_name(name: str, bytes_moved: float, flops: float | None = None) -> str:
    """A kernel's `pallas_call` name carrying the HBM bytes one call reads and writes (`NAME_bytes{n}`), and
    with `flops` the FLOPs it does (`NAME_flops{f}_bytes{n}`).

    Plan mode (plan/hlo_traffic.py) counts a Triton custom call by its operands and results, which for a
    kernel that reads rows of a whole cache table in place (the table is an operand) counts the table
    every call; the kernel knows what it touches and says so here. XLA counts no FLOPs in a custom call
    (plan/hlo.py reads them from here)."""
    work = "" if flops is None else f"_flops{int(flops)}"
    return f"{name}{work}_bytes{int(bytes_moved)}"


def interpret() -> bool:
    """Whether Pallas kernels must run in interpret mode (no GPU target)."""
    return not targets_gpu()
