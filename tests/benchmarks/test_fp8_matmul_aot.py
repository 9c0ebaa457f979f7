"""benchmarks/fp8_matmul_aot.py compares like with like: on small CPU shapes (interpret mode for the kernel)
every dense candidate computes the dequantized weight's product within its own rounding, and the experts'
FP8 kernel equals dequantize-then-kernel exactly. The deviceless compiles themselves: run the script."""

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.fp8_matmul_aot import dense_variants, expert_variants
from glm52_jax.model import fp8


def _fp8(rng, shape):
    values = jnp.asarray(rng.standard_normal(shape).astype(fp8.E4M3))
    scales = jnp.asarray(rng.uniform(0.01, 0.05, fp8.scale_shape(shape, (128, 128))).astype(np.float32))
    return fp8.Fp8Weight(values, scales, (128, 128), jnp.dtype(jnp.bfloat16))


def test_dense_candidates_compute_the_same_product():
    rng = np.random.default_rng(0)
    w = _fp8(rng, (256, 256))
    x = jnp.asarray(rng.standard_normal((8, 256)), jnp.bfloat16)
    exact = np.asarray(x, np.float32) @ (np.asarray(w.values, np.float32) * np.repeat(np.repeat(
        np.asarray(w.scales), 128, 0), 128, 1))
    scale = np.abs(exact).max()
    # XLA:CPU has no batched bf16 x bf16 -> float32 dot: kblocks_bf16 gets x's bf16 values in float32 (the same
    # products).
    got = {name: np.asarray(jax.jit(fn)(x.astype(jnp.float32) if name == "kblocks_bf16" else x,
                                        fp8.dense(w) if name == "bf16_weight" else w), np.float32)
           for name, fn in dense_variants(256, 256).items()}
    # bf16 rounding of the weight (a, c, bf16_weight) or of the output only (kblocks_bf16): <= 2^-8 relative
    # per term, ~2^-8 x sqrt(256) / 16 of the largest output after cancellation: 1e-2 of it is generous and far
    # below the FP8 variants' activation rounding (e4m3: 2^-4 per element).
    for name in ("a_dequant", "kblocks_bf16", "c_kernel", "bf16_weight"):
        np.testing.assert_allclose(got[name], exact, rtol=0, atol=1e-2 * scale, err_msg=name)
    for name in ("b_fp8_kblocks", "b_fp8_kloop"):  # activations in e4m3: within 2^-4 of each term
        np.testing.assert_allclose(got[name], exact, rtol=0, atol=0.1 * scale, err_msg=name)
        assert np.abs(got[name] - exact).max() > np.abs(got["a_dequant"] - exact).max(), name
    np.testing.assert_array_equal(got["b_fp8_kblocks"], got["b_fp8_kloop"])
    assert np.abs(got["b_fp8_unscaled"] - exact).max() > scale  # not the weight's numbers: a cost floor only


def test_expert_candidates_agree():
    rng = np.random.default_rng(1)
    w = _fp8(rng, (4, 256, 128))
    x = jnp.asarray(rng.standard_normal((40, 256)), jnp.bfloat16)
    gs = jnp.array([10, 0, 20, 6], jnp.int32)
    got = {name: jax.jit(fn)(x, fp8.dense(w) if name == "bf16_weight" else w, gs)
           for name, fn in expert_variants().items()}
    np.testing.assert_array_equal(np.asarray(got["c_kernel"]), np.asarray(got["a_dequant"]))
    np.testing.assert_array_equal(np.asarray(got["bf16_weight"]), np.asarray(got["a_dequant"]))
