"""FP8 dots on Hopper's FP8 tensor cores from Pallas' Triton backend.

Pallas lowers a `dot_general` of two float8_e4m3fn operands to `tt.dot` without `maxNumImpreciseAcc`, and Triton
then lowers it to f16 `mma.sync` (MMAv2: the e4m3 values converted to f16 first; slower than bf16's wgmma): seen
in the PTX of a deviceless sm_90a compile (benchmarks/indexer_fp8.py --ptx). Triton's own `tl.dot` sets the
attribute for FP8 on sm_90 and then emits `wgmma.mma_async ... .e4m3.e4m3` (FP8 MMA, twice bf16's rate).

`install()` replaces Pallas-Triton's `dot_general` lowering rule (a private table, guarded: without it nothing
changes and the dot stays correct, only slower) with one that, for two e4m3 operands, emits the `tt.dot` with
`maxNumImpreciseAcc` = the contraction length: the tensor core's reduced-precision FP8 accumulation runs over at
most one K = 128 row (the indexer's head dim) before the sum is added into the float32 accumulator, as DeepSeek's
FP8 GEMMs promote every 128 elements. Every other dot goes to the original rule.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

_INSTALLED = False


def install() -> bool:
    """Registers the FP8 rule once; returns whether it is in place."""
    global _INSTALLED
    if _INSTALLED:
        return True
    try:  # private: guarded, the module may move
        from jax._src.lib.mlir import ir
        from jax._src.pallas.triton import lowering as tl
        original = tl.triton_lowering_rules[lax.dot_general_p]
        zeros, to_ir = tl._zeros, tl._dtype_to_ir_type
        tt = tl.tt_dialect
    except (ImportError, AttributeError, KeyError):
        return False

    def rule(ctx, a, b, *, dimension_numbers, precision=None, preferred_element_type=None, **kw):
        a_aval, b_aval = ctx.avals_in
        [out_aval] = ctx.avals_out
        fp8 = jnp.dtype(jnp.float8_e4m3fn)
        ((a_dim,), (b_dim,)), batch = dimension_numbers
        if not (a_aval.dtype == fp8 and b_aval.dtype == fp8 and out_aval.dtype == jnp.float32
                and batch == ((), ()) and a_aval.ndim == 2 and b_aval.ndim == 2):
            return original(ctx, a, b, dimension_numbers=dimension_numbers, precision=precision,
                            preferred_element_type=preferred_element_type, **kw)
        if a_dim == 0:
            a = tt.trans(a, (1, 0))
        if b_dim == 1:
            b = tt.trans(b, (1, 0))
        m, k = ir.RankedTensorType(a.type).shape
        n = ir.RankedTensorType(b.type).shape[1]
        acc = zeros(ir.RankedTensorType.get([m, n], to_ir(jnp.float32)))
        return tt.dot(a, b, acc, max_num_imprecise_acc=k)

    tl.triton_lowering_rules[lax.dot_general_p] = rule
    _INSTALLED = True
    return True
