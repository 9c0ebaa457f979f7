"""Deviceless sm_90a compiles of the indexer kernel (H200 and H20 target configs), on this CPU machine.

Triton and ptxas run for real (glm52_jax.kernels.aot), so these catch what interpret mode cannot:
lowering failures, shared memory over the target's per-block limit, register spills. Kernels: the
scoring kernel (`dsa_index_scores`) and the top-k merge by radix select (`dsa_topk_select`).
"""

import re

import jax
import jax.numpy as jnp
import pytest

from glm52_jax.kernels import aot
from glm52_jax.kernels import indexer as kernel
from glm52_jax.model.indexer import cached_topk, streaming_topk

pytestmark = pytest.mark.skipif(aot.missing() is not None, reason=f"deviceless GPU compiles: {aot.missing()}")

SD = jax.ShapeDtypeStruct
HEADS, DIM, TOPK = 32, 128, 2048  # GLM-5.2's indexer


def _smem_limit(target: str) -> int:
    return int(re.search(r"shared_memory_per_block_optin: (\d+)", aot.target_config(target)).group(1))


def _assert_fits(resources, target):
    assert 0 < resources.shared_memory <= _smem_limit(target)
    assert resources.registers is not None and resources.registers <= 255
    assert resources.spill_bytes == 0


def test_indexer_topk_compiles_for_h200():
    """A model-shaped program: a 1024-token causal top-2048 over its own keys plus a decode step
    (2 rows) over a stacked float32 cache read in place, both scoring in bf16 on the kernel."""

    def program(q, w, k, q1, w1, cache):
        pos = jnp.arange(q.shape[1], dtype=jnp.int32)
        prefill = streaming_topk(q, w, k, pos, pos, TOPK, scale=DIM ** -0.5, query_block=128, key_block=512,
                                 kernels="auto", score_dtype=jnp.bfloat16)
        length = jnp.asarray(cache.shape[-2] - 7, jnp.int32)
        decode = cached_topk(q1, w1, cache, (1, 0), length[None], length, TOPK, scale=DIM ** -0.5,
                             query_block=128, key_block=512, kernels="auto", score_dtype=jnp.bfloat16)
        return prefill, decode

    args = (SD((1, 1024, HEADS, DIM), jnp.float32), SD((1, 1024, HEADS), jnp.float32), SD((1, 1024, DIM), jnp.float32),
            SD((2, 1, HEADS, DIM), jnp.float32), SD((2, 1, HEADS), jnp.float32),
            SD((2, 1, 2, 8192, DIM), jnp.float32))
    compiled = aot.compile_for_gpu(program, *args, target="h200")
    # "auto" chose the kernels (lowered for the GPU: no interpreter); prefill and decode share their names.
    _assert_fits(compiled.kernels["dsa_index_scores"], "h200")
    _assert_fits(compiled.kernels["dsa_topk_select"], "h200")
    assert compiled.memory["temp"] < 256 * 2**20  # O(query block x (top-k + key chunk)), no [S, T] array


def test_indexer_kernel_compiles_for_h20():
    """The scoring kernel at GLM-5.2's shapes (a 512-query group x 8192-key chunk) for the H20 target (78 SMs;
    the sm_90 shared-memory limit), in bf16 and in FP8 (e4m3 q and k with per-key scales, model.indexer_dtype=fp8):
    each dot a Hopper wgmma on its operand type (FP8: e4m3 x e4m3, twice bf16's rate; without kernels/fp8_dot.py
    Pallas-Triton emitted f16 mma.sync for it)."""

    def scores(q, w, q_pos, k, k_pos, q8, k8, k_scale):
        bf16 = kernel.index_scores(q, w, q_pos, k, k_pos, jnp.int32(0), 8192, scale=DIM ** -0.5)
        fp8 = kernel.index_scores(q8, w, q_pos, k8, k_pos, jnp.int32(0), 8192, scale=DIM ** -0.5, k_scale=k_scale)
        return bf16, fp8

    args = (SD((1, 512, HEADS, DIM), jnp.bfloat16), SD((1, 512, HEADS), jnp.float32), SD((512,), jnp.int32),
            SD((1, 8192, DIM), jnp.bfloat16), SD((8192,), jnp.int32), SD((1, 512, HEADS, DIM), kernel.FP8),
            SD((1, 8192, DIM), kernel.FP8), SD((1, 8192), jnp.float32))
    compiled = aot.compile_for_gpu(scores, *args, target="h20")
    tiles = kernel.GPU_TILING
    for name, operands in (("dsa_index_scores", "bf16.bf16"), ("dsa_index_scores_fp8", "e4m3.e4m3")):
        resources = compiled.kernels[name]
        _assert_fits(resources, "h20")
        assert resources.grid == (512 // tiles.tile_q, 8192 // tiles.tile_k, 1)
        assert resources.threads == (32 * tiles.num_warps, 1, 1)
        assert len(resources.mma) == 1 and resources.mma[0].startswith("wgmma.mma_async")
        assert resources.mma[0].endswith(f".f32.{operands}")


def test_oversized_block_is_rejected():
    """256 x 256 tiles with 4 pipeline stages need ~321 KiB of shared memory per block: ptxas/XLA
    refuse it for the H20 (227 KiB per block on sm_90)."""
    big = kernel.Tiling(tile_q=256, tile_k=256, num_warps=8, num_stages=4)

    def scores(q, w, q_pos, k, k_pos):
        return kernel.index_scores(q, w, q_pos, k, k_pos, jnp.int32(0), 1024, scale=DIM ** -0.5, tiles=big)

    args = (SD((1, 256, HEADS, DIM), jnp.bfloat16), SD((1, 256, HEADS), jnp.float32), SD((256,), jnp.int32),
            SD((1, 1024, DIM), jnp.bfloat16), SD((1024,), jnp.int32))
    with pytest.raises(aot.SharedMemoryError, match=r"Shared memory size limit exceeded: requested \d+, available: "
                                                    + str(_smem_limit("h20"))):
        aot.compile_for_gpu(scores, *args, target="h20")
