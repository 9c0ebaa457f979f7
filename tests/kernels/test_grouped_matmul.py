"""The experts' grouped-matmul kernel (`kernels.grouped_matmul`) against `lax.ragged_dot`.

Interpret mode on CPU (float32 exact to rounding, bfloat16 within its rounding), the tile table, the
routed-expert paths that use it (`grouped_swiglu` with kernels="pallas", the block-diagonal LoRA
delta), and one deviceless sm_90a compile: no dense `[M, G, K]` expansion (XLA's ragged_dot lowering
holds 768 MiB of temporaries for these shapes; the kernel ~0). FP8 kernels (`grouped_matmul_fp8`,
dequantized block by block inside the kernel): the same numbers as the kernel on `fp8.dense`'s weights, bit
for bit, and no dequantized copy of the experts in the sm_90a compile. FP8 rows times FP8 kernels
(`grouped_matmul_w8a8`, `model.expert_dtype=fp8`): a numpy oracle of the same quantisation, gradients straight
through it, `grouped_swiglu`'s reference (`ragged_w8a8`), and an e4m3 wgmma in the sm_90a compile.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from glm52_jax.kernels import aot
from glm52_jax.kernels.grouped_matmul import grouped_matmul, grouped_matmul_fp8, grouped_matmul_w8a8, tile_table
from glm52_jax.model import fp8
from glm52_jax.model.grouped_mlp import blockdiag_lora_delta, grouped_swiglu, ragged_lora_delta, row_groups


def _normal(rng, *shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _ragged(x, w, gs):
    return jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32)


def test_tile_table_covers_each_group_in_block_rows():
    table = np.asarray(tile_table(jnp.array([5, 0, 13, 3], jnp.int32), rows=24, block_m=4))
    assert table.shape == (3, 6 + 4 + 1)
    used = table[:, table[2] > table[1]]
    # (group, first, end): group 0 in 2 tiles, group 1 none, group 2 in 4, group 3 in 1; rows 21..23 in no group:
    # one tile of group G = 4, which the kernel stores as zeros.
    assert used.T.tolist() == [[0, 0, 4], [0, 4, 5], [2, 5, 9], [2, 9, 13], [2, 13, 17], [2, 17, 18], [3, 18, 21],
                               [4, 21, 24]]
    assert (table[:, 8:] == 0).all()
    # Rows that take several tail tiles, and none when the groups fill every row.
    tail = np.asarray(tile_table(jnp.array([3, 2], jnp.int32), rows=16, block_m=4))
    assert tail[:, tail[2] > tail[1]].T.tolist() == [[0, 0, 3], [1, 3, 5], [2, 5, 9], [2, 9, 13], [2, 13, 16]]
    full = np.asarray(tile_table(jnp.array([8, 8], jnp.int32), rows=16, block_m=4))
    assert 2 not in full[0, full[2] > full[1]].tolist()
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


# ------------------------------------------------------------------------------------------------
# FP8 kernels.


def _fp8(rng, shape, block, dtype):
    """A random `fp8.Fp8Weight` [G, K, N] with `block` on its last two dims (partial blocks where they do not
    divide), scales spread over two octaves."""
    values = jnp.asarray(rng.standard_normal(shape).astype(fp8.E4M3))
    scales = jnp.asarray(rng.uniform(0.02, 0.08, fp8.scale_shape(shape, block)).astype(np.float32))
    return fp8.Fp8Weight(values, scales, block, jnp.dtype(dtype))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("block", [(12, 16), (64, 32), (1, 128)])
def test_fp8_kernel_is_the_kernel_on_the_dequantized_weights(dtype, block):
    """Each block dequantized in the kernel (`value x scale` in float32, rounded once to the compute dtype) as
    `fp8.dense` does for the whole weight: outputs and row gradients (the transposed kernel) equal bit for bit.
    Blocks: partial ones (12 rows of 64), a block spanning K steps, one scale per row. The FP8 weights get zero
    gradients (frozen)."""
    rng = np.random.default_rng(block[0])
    gs = jnp.array([5, 0, 20, 9], jnp.int32)
    w = _fp8(rng, (4, 64, 32), block, dtype)
    x, cot = _normal(rng, 40, 64, dtype=dtype), _normal(rng, 40, 32)
    got = jax.jit(lambda x: grouped_matmul_fp8(x, w.values, w.scales, w.block, gs))(x)
    want = grouped_matmul(x, fp8.dense(w), gs)
    assert got.dtype == jnp.float32 and float(jnp.abs(want).max()) > 0
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    def loss(x, values, scales):
        return jnp.sum(grouped_matmul_fp8(x, values, scales, w.block, gs) * cot)

    d_x, d_values, d_scales = jax.jit(jax.grad(loss, (0, 1, 2)))(x, w.values, w.scales)
    want_dx = jax.grad(lambda x: jnp.sum(grouped_matmul(x, fp8.dense(w), gs) * cot))(x)
    np.testing.assert_array_equal(np.asarray(d_x, np.float32), np.asarray(want_dx, np.float32))
    assert not np.asarray(d_values, np.float32).any() and not np.asarray(d_scales).any()


def test_fp8_kernel_refuses_mismatched_scales():
    rng = np.random.default_rng(0)
    w = _fp8(rng, (2, 64, 32), (16, 16), jnp.float32)
    with pytest.raises(ValueError, match=r"scales \(2, 4, 2\) in blocks \(32, 16\); expected float8_e4m3fn "
                                         r"values and scales \(2, 2, 2\)"):
        grouped_matmul_fp8(_normal(rng, 8, 64), w.values, w.scales, (32, 16), jnp.array([3, 5], jnp.int32))


def test_swiglu_with_fp8_experts_on_the_kernel_equals_the_reference():
    """`grouped_swiglu` with FP8 expert stacks: kernels="pallas" (dequantized in the kernel) against
    "reference" (dequantized, then lax.ragged_dot), float32: outputs, row and LoRA gradients."""
    rng = np.random.default_rng(4)
    e, d, i, m = 4, 64, 32, 48
    gs = jnp.array([10, 0, 25, 9], jnp.int32)
    w = (_fp8(rng, (e, d, i), (12, 16), jnp.float32), _fp8(rng, (e, d, i), (12, 16), jnp.float32),
         _fp8(rng, (e, i, d), (16, 12), jnp.float32))
    _assert_swiglu_kernel_is_the_reference(rng, gs, w, m, least=1.0, rtol=1e-5, atol=1e-5)


def _assert_swiglu_kernel_is_the_reference(rng, gs, w, m, *, least, rtol, atol, scale_atol=False, rank=4):
    """`grouped_swiglu` on experts `w` (gate, up, down) with random LoRA: kernels="pallas" against "reference",
    float32 rows [m, D]: the loss (above `least`), the rows' and the LoRA gradients (each nonzero) within rtol and
    atol (`scale_atol`: atol times each gradient's largest entry)."""
    e, d, i = w[0].shape
    lora = [(_normal(rng, e, a, rank) / 5, _normal(rng, e, rank, b) / 5) for a, b in ((d, i), (d, i), (i, d))]
    xs, cot = _normal(rng, m, d), _normal(rng, m, d)

    def loss(xs, lora, kernels):
        arrays = tuple((a, b, 2.0) for a, b in lora)
        return jnp.sum(grouped_swiglu(xs, gs, *w, arrays, kernels=kernels) * cot)

    got = jax.jit(jax.value_and_grad(lambda *a: loss(*a, "pallas"), (0, 1)))(xs, lora)
    ref = jax.value_and_grad(lambda *a: loss(*a, "reference"), (0, 1))(xs, lora)
    assert float(jnp.abs(ref[0])) > least
    for g, rr in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        assert float(jnp.abs(rr).max()) > 0
        tol = atol * float(jnp.abs(rr).max()) if scale_atol else atol
        np.testing.assert_allclose(np.asarray(g), np.asarray(rr), rtol=rtol, atol=tol)


# ~47 s of deviceless compiles (two programs): `slow` (CI budget); benchmarks/fp8_matmul_aot.py: figures at scale.
@pytest.mark.slow
@pytest.mark.skipif(aot.missing() is not None, reason=f"deviceless GPU compiles: {aot.missing()}")
def test_fp8_kernel_compiles_for_sm90a_without_a_dequantized_copy():
    """GLM-5.2's 32 local experts per device at EP 8 (6144 x 2048, 128 x 128 blocks), 4,096 rows, H200: the FP8
    kernel needs no temporaries and fits shared memory without spills, where dequantizing first holds the
    experts in bf16 (768 MiB) and moves ~2.5x the bytes."""
    from glm52_jax.plan.hlo_traffic import traffic

    sd = jax.ShapeDtypeStruct
    m, d, i, e = 4096, 6144, 2048, 32
    args = (sd((m, d), jnp.bfloat16), sd((e, d, i), fp8.E4M3), sd((e, d // 128, i // 128), jnp.float32),
            sd((e,), jnp.int32))

    def in_kernel(x, values, scales, gs):
        return grouped_matmul_fp8(x, values, scales, (128, 128), gs)

    def first(x, values, scales, gs):
        return grouped_matmul(x, fp8.dense(fp8.Fp8Weight(values, scales, (128, 128), jnp.dtype(jnp.bfloat16))), gs)

    c, ref = (aot.compile_for_gpu(f, *args, target="h200") for f in (in_kernel, first))
    assert c.memory["temp"] < 1 << 20 <= e * d * i * 2 <= ref.memory["temp"], (c.memory, ref.memory)
    k = c.kernels[f"grouped_matmul_dequant_rows{m}"]
    assert k.shared_memory <= 232_448 and k.spill_bytes in (0, None), k
    moved = [traffic(x.compiled.as_text(), [0])["memory_bytes_executed"] for x in (c, ref)]
    assert 2 * moved[0] < moved[1], moved


def _w8a8_oracle(x, values, scales, sizes):
    """numpy FP8 rows x FP8 kernels: each 128-wide block of a row quantized (scale amax / 448, 1 for a zero block;
    value e4m3(x x float32 1/scale), ml_dtypes), every 128 x 128 block's dot of e4m3 values summed exactly (float64)
    and scaled by the row block's and the kernel block's scales; rows past the groups zero."""
    x = np.asarray(x, np.float32)
    m, k = x.shape
    blocks = x.reshape(m, k // 128, 128)
    amax = np.abs(blocks).max(axis=-1)
    x_scale = np.where(amax > 0, amax * np.float32(1.0 / 448.0), np.float32(1.0)).astype(np.float32)
    x8 = (blocks * (np.float32(1.0) / x_scale)[..., None]).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    w8 = np.asarray(values).astype(np.float64)
    w_scale = np.asarray(scales, np.float64)
    out = np.zeros((m, w8.shape[-1]))
    start = 0
    for g, size in enumerate(sizes):
        rows = slice(start, start + size)
        for kb in range(k // 128):
            dots = x8[rows, kb] @ w8[g, kb * 128:(kb + 1) * 128]  # [rows, N]
            out[rows] += dots * x_scale[rows, kb, None] * np.repeat(w_scale[g, kb], 128)[None, :]
        start += size
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_w8a8_kernel_equals_a_numpy_oracle_of_the_same_quantisation(dtype):
    """FP8 rows x FP8 kernels (interpret mode): a group with no rows, rows past every group (zeros), K = 2 x 128 and
    N = 3 x 128 blocks, a row block of zeros (scale 1): equal to the oracle to float32 rounding of the sums."""
    rng = np.random.default_rng(11)
    sizes = (50, 0, 120)
    x = _normal(rng, 200, 256, dtype=dtype)
    x = x.at[7, :128].set(0.0)
    w = fp8.quantize(_normal(rng, 3, 256, 384) * 0.05, (128, 128))
    got = np.asarray(jax.jit(lambda x: grouped_matmul_w8a8(x, w.values, w.scales, w.block, jnp.array(sizes)))(x))
    want = _w8a8_oracle(x, w.values, w.scales, sizes)
    assert got.dtype == np.float32 and np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    assert not got[sum(sizes):].any()
    # FP8's distance from the unquantized product: e4m3 rounding of both operands (a few %), not a wrong block.
    exact = np.asarray(grouped_matmul(x.astype(jnp.float32), fp8.dense(fp8.Fp8Weight(
        w.values, w.scales, w.block, jnp.dtype(jnp.float32))), jnp.array(sizes)))
    assert 0.005 < np.linalg.norm(got - exact) / np.linalg.norm(exact) < 0.06


def test_w8a8_gradient_passes_straight_through_the_quantisation():
    """The rows' gradient is the dequantized kernel's (as if the rows were not quantized: `grouped_matmul_fp8`'s
    backward, bit for bit); the FP8 kernel gets zeros (frozen)."""
    rng = np.random.default_rng(12)
    gs = jnp.array([30, 0, 70], jnp.int32)
    w = fp8.quantize(_normal(rng, 3, 128, 256) * 0.05, (128, 128), jnp.bfloat16)
    x, cot = _normal(rng, 128, 128, dtype=jnp.bfloat16), _normal(rng, 128, 256)
    d_x, d_values, d_scales = jax.jit(jax.grad(lambda x, v, s: jnp.sum(grouped_matmul_w8a8(x, v, s, w.block, gs) * cot),
                                               (0, 1, 2)))(x, w.values, w.scales)
    want = jax.grad(lambda x: jnp.sum(grouped_matmul_fp8(x, w.values, w.scales, w.block, gs) * cot))(x)
    assert float(jnp.abs(want.astype(jnp.float32)).max()) > 0
    np.testing.assert_array_equal(np.asarray(d_x, np.float32), np.asarray(want, np.float32))
    assert not np.asarray(d_values, np.float32).any() and not np.asarray(d_scales).any()


def test_w8a8_kernel_refuses_other_blocks():
    rng = np.random.default_rng(0)
    w = fp8.quantize(_normal(rng, 2, 128, 128), (64, 128))
    with pytest.raises(ValueError, match=r"blocks \(64, 128\); expected float8_e4m3fn values, 128 x 128 blocks"):
        grouped_matmul_w8a8(_normal(rng, 8, 128), w.values, w.scales, w.block, jnp.array([3, 5], jnp.int32))


def test_swiglu_with_fp8_mma_experts_on_the_kernel_equals_the_reference():
    """`grouped_swiglu` with `fp8.Fp8MmaWeight` experts (model.expert_dtype=fp8), float32 rows: the w8a8 kernel
    (kernels="pallas") against `ragged_w8a8` on lax.ragged_dot ("reference"): outputs, row and LoRA gradients."""
    rng = np.random.default_rng(5)
    e, d, i, m = 3, 256, 128, 64
    gs = jnp.array([20, 0, 33], jnp.int32)
    w = tuple(fp8.for_fp8_mma(_normal(rng, e, a, b) * 0.05) for a, b in ((d, i), (d, i), (i, d)))
    assert all(isinstance(x, fp8.Fp8MmaWeight) and x.block == (128, 128) for x in w)
    _assert_swiglu_kernel_is_the_reference(rng, gs, w, m, least=0.1, rtol=2e-5, atol=2e-5, scale_atol=True)


@pytest.mark.skipif(aot.missing() is not None, reason=f"deviceless GPU compiles: {aot.missing()}")
def test_w8a8_kernel_compiles_to_fp8_wgmma_for_the_h20():
    """GLM-5.2's expert shapes (6144 -> 2048, 8 local experts at EP 32), 1,024 rows, H20: the kernel's dot is Hopper's
    e4m3 x e4m3 wgmma (FP8 MMA, twice bf16's rate; `kernels/fp8_dot.py`), in shared memory, no spills."""
    sd = jax.ShapeDtypeStruct
    m, d, i, e = 1024, 6144, 2048, 8

    def fn(x, values, scales, gs):
        return grouped_matmul_w8a8(x, values, scales, (128, 128), gs)

    c = aot.compile_for_gpu(fn, sd((m, d), jnp.bfloat16), sd((e, d, i), fp8.E4M3),
                            sd((e, d // 128, i // 128), jnp.float32), sd((e,), jnp.int32), target="h20")
    k = c.kernels[f"grouped_matmul_rows{m}_fp8"]
    assert k.shared_memory <= 232_448 and k.spill_bytes in (0, None), k
    assert len(k.mma) == 1 and k.mma[0].startswith("wgmma.mma_async") and k.mma[0].endswith(".f32.e4m3.e4m3"), k
