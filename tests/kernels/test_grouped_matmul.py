"""The experts' grouped-matmul kernel (`kernels.grouped_matmul`) against `lax.ragged_dot`.

Interpret mode on CPU (float32 exact to rounding, bfloat16 within its rounding), the tile table, the
routed-expert paths that use it (`grouped_swiglu` with kernels="pallas", the block-diagonal LoRA
delta), and one deviceless sm_90a compile: no dense `[M, G, K]` expansion (XLA's ragged_dot lowering
holds 768 MiB of temporaries for these shapes; the kernel ~0).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm52_jax.kernels import aot
from glm52_jax.kernels.grouped_matmul import grouped_matmul, tile_table
from glm52_jax.model.grouped_mlp import blockdiag_lora_delta, grouped_swiglu, ragged_lora_delta, row_groups


def _normal(rng, *shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _ragged(x, w, gs):
    return jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32)


def test_tile_table_covers_each_group_in_block_rows():
    table = np.asarray(tile_table(jnp.array([5, 0, 13, 3], jnp.int32), rows=24, block_m=4))
    assert table.shape == (3, 6 + 4)
    used = table[:, table[2] > table[1]]
    # (group, first, end): group 0 in 2 tiles, group 1 none, group 2 in 4, group 3 in 1; rows 21..23 in no group.
    assert used.T.tolist() == [[0, 0, 4], [0, 4, 5], [2, 5, 9], [2, 9, 13], [2, 13, 17], [2, 17, 18], [3, 18, 21]]
    assert (table[:, 7:] == 0).all()
    assert np.asarray(row_groups(jnp.array([2, 0, 1]), 5)).tolist() == [0, 0, 2, 3, 3]


@pytest.mark.parametrize("rows,sizes", [(40, (5, 0, 20, 9)), (200, (70, 1, 0, 129))])
def test_float32_values_and_gradients(rows, sizes):
    """Rows past sum(sizes) are zero, as are their gradients; every group's rows use its own kernel."""
    rng = np.random.default_rng(rows)
    gs = jnp.array(sizes, jnp.int32)
    x, w, cot = _normal(rng, rows, 64), _normal(rng, 4, 64, 32), _normal(rng, rows, 32)
    out = jax.jit(grouped_matmul)(x, w, gs)
    np.testing.assert_allclose(np.asarray(out), np.asarray(_ragged(x, w, gs)), rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(out[sum(sizes):]).max(initial=0.0)) == 0.0
    grads = jax.jit(jax.grad(lambda x, w: jnp.sum(grouped_matmul(x, w, gs) * cot), (0, 1)))(x, w)
    ref = jax.grad(lambda x, w: jnp.sum(_ragged(x, w, gs) * cot), (0, 1))(x, w)
    for g, r in zip(grads, ref, strict=True):
        assert float(jnp.abs(r).max()) > 0
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)


def test_bfloat16_within_its_rounding():
    rng = np.random.default_rng(1)
    gs = jnp.array([30, 50, 48], jnp.int32)
    x, w = _normal(rng, 128, 128), _normal(rng, 3, 128, 64) / 11.0
    exact = _ragged(x, w, gs)
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    got, ref = grouped_matmul(xb, wb, gs), _ragged(xb, wb, gs)
    assert got.dtype == jnp.float32
    # Same bf16 inputs, float32 accumulation in both: equal up to summation order.
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-4)
    assert float(jnp.abs(got - exact).max()) < 2 * float(jnp.abs(ref - exact).max()) + 1e-6


def test_swiglu_on_the_kernel_equals_ragged_dot_with_lora():
    """`grouped_swiglu(kernels="pallas")`: the three matmuls on the kernel, LoRA block-diagonal; values and
    the LoRA / row gradients as on lax.ragged_dot."""
    rng = np.random.default_rng(2)
    e, d, i, r, m = 4, 32, 16, 4, 48
    gs = jnp.array([10, 0, 25, 9], jnp.int32)
    xs = _normal(rng, m, d)
    w = (_normal(rng, e, d, i) / 6, _normal(rng, e, d, i) / 6, _normal(rng, e, i, d) / 4)
    lora = [(_normal(rng, e, a, r) / 5, _normal(rng, e, r, b) / 5) for a, b in ((d, i), (d, i), (i, d))]
    cot = _normal(rng, m, d)

    def loss(xs, lora, kernels):
        arrays = tuple((a, b, 2.0) for a, b in lora)
        return jnp.sum(grouped_swiglu(xs, gs, *w, arrays, kernels=kernels) * cot)

    for a, b in lora:
        rows = xs[:, :a.shape[1]]
        np.testing.assert_allclose(np.asarray(blockdiag_lora_delta(rows, (a, b, 2.0), gs)),
                                   np.asarray(ragged_lora_delta(rows, (a, b, 2.0), gs)), rtol=1e-5, atol=1e-6)
    got = jax.jit(jax.value_and_grad(lambda *a: loss(*a, "pallas"), (0, 1)))(xs, lora)
    ref = jax.value_and_grad(lambda *a: loss(*a, "reference"), (0, 1))(xs, lora)
    for g, rr in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(rr), rtol=1e-5, atol=1e-5)


# ~11 s of deviceless compile: `slow` (CI budget); the 2M GPU plan compiles the kernel at scale.
@pytest.mark.slow
@pytest.mark.skipif(aot.missing() is not None, reason=f"deviceless GPU compiles: {aot.missing()}")
def test_compiles_for_sm90a_without_the_dense_expansion():
    """Forward + row gradient at an EP receive buffer's size (8,192 rows, 8 local experts, GLM-5.2's 6144 x
    2048 kernels), compiled for an H20: two Triton kernels, no spills, (almost) no temporaries."""
    sd = jax.ShapeDtypeStruct
    m, d, i, e = 8192, 6144, 2048, 8

    def fwd_bwd(x, w, gs, dy):
        y, vjp = jax.vjp(lambda x: grouped_matmul(x, w, gs), x)
        return y, vjp(dy)[0]

    c = aot.compile_for_gpu(fwd_bwd, sd((m, d), jnp.bfloat16), sd((e, d, i), jnp.bfloat16), sd((e,), jnp.int32),
                            sd((m, i), jnp.float32), target="h20")
    assert c.memory["temp"] < 1 << 20, c.memory
    names = {name for name in c.kernels if name.startswith("grouped_matmul")}
    assert names == {f"grouped_matmul_rows{m}", f"grouped_matmul_t_rows{m}"}, c.kernels.keys()
    for name in names:
        k = c.kernels[name]
        assert k.shared_memory <= 232_448 and k.spill_bytes in (0, None), (name, k)
