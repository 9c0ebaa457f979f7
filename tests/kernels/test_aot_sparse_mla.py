"""Deviceless sm_90a compiles of the sparse MLA kernels (H200 and H20 target configs) on this CPU machine.

Triton and ptxas run for real (glm52_jax.kernels.aot): the kernels must lower for the GPU and fit the
target's shared memory per block at GLM-5.2's shapes (64 heads, C 512, R 64, k 2048), in bf16 and in
float32 (the parity runs' tiles); a tiny model's LoRA train step with kernels="pallas" compiles too. Registers and
spills are reported by the compile (see benchmarks/RESULTS.md), not asserted.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import glm52_jax
from glm52_jax import config
from glm52_jax.kernels import aot
from glm52_jax.kernels import sparse_mla_kernels as kern
from glm52_jax.kernels.sparse_mla import (
    DEFAULT_CONFIG,
    backward_shared_memory,
    encode_rows,
    forward_shared_memory,
    sparse_mla_tables,
)
from glm52_jax.model.lora import LoRA, LoRAConfig
from glm52_jax.model.sparse_attention import cached_rows, sparse_mla_rows
from glm52_jax.model.transformer import GlmMoeDsa, token_logprobs

pytestmark = pytest.mark.skipif(aot.missing() is not None, reason=f"deviceless GPU compiles: {aot.missing()}")

SD = jax.ShapeDtypeStruct
H, C, R, K = 64, 512, 64, 2048
KERNELS = ("sparse_mla_forward", "sparse_mla_backward", "sparse_mla_segment_sum")


def _smem_limit(target: str) -> int:
    return int(re.search(r"shared_memory_per_block_optin: (\d+)", aot.target_config(target)).group(1))


def _train_attention(queries, keys, dtype, config=DEFAULT_CONFIG):
    """Forward + gradient of the kernel over one sequence's rows: the training program's attention."""

    def program(q_lat, q_rope, c_kv, k_rope, topk, proj):
        def loss(q_lat, q_rope, c_kv, k_rope):
            codes = encode_rows(jnp.maximum(topk, 0), topk >= 0)
            out, lse = sparse_mla_tables(q_lat, q_rope, (c_kv,), (k_rope,), codes, scale=0.04, config=config)
            return jnp.sum(out.astype(jnp.float32) * proj) + jnp.sum(lse)
        return jax.grad(loss, argnums=(0, 1, 2, 3))(q_lat, q_rope, c_kv, k_rope)

    return program, (SD((1, queries, H, C), dtype), SD((1, queries, H, R), dtype), SD((keys, C), dtype),
                     SD((keys, R), dtype), SD((1, queries, K), jnp.int32), SD((1, queries, H, C), jnp.float32))


# ~60 s of deviceless compile each: `slow` for CI's budget (tests/kernels/test_aot.py compiles the indexer kernel
# for the H200 in CI; scripts/gpu_check.sh runs these kernels on a device).
@pytest.mark.parametrize(("target", "dtype"), [pytest.param("h200", jnp.bfloat16, marks=pytest.mark.slow),
                                               pytest.param("h20", jnp.float32, marks=pytest.mark.slow)])
def test_forward_backward_compile(target, dtype):
    queries = 512  # >= KernelConfig.min_programs: one program per query, no slot splits
    program, args = _train_attention(queries, 8192, dtype)
    compiled = aot.compile_for_gpu(program, *args, target=target)
    for name in KERNELS:
        resources = compiled.kernels[name]
        assert resources.shared_memory <= _smem_limit(target), (name, resources)
    tiles = DEFAULT_CONFIG.for_dtype(dtype).fitted(dtype, 1, H, C, R, K)
    forward, backward = compiled.kernels["sparse_mla_forward"], compiled.kernels["sparse_mla_backward"]
    assert forward.shared_memory > 0 and backward.shared_memory > 0  # Triton stages the gathered rows there
    assert forward.grid[:2] == (queries, 1) and forward.threads[0] == 32 * tiles.num_warps
    chunks = -(-queries * K // tiles.chunk_entries)  # the backward runs chunks of queries (bounded row buffer)
    assert backward.grid[:2] == (queries // chunks, H // tiles.bwd_block_h)
    assert backward.threads[0] == 32 * tiles.bwd_num_warps


@pytest.mark.slow  # ~30 s of deviceless compile; the forward/backward compile for the H200 stays in CI
def test_decode_over_cache_compiles_for_h20():
    """8 rows decoding over a stacked 32K-slot bf16 cache read in place (two row tables, slot splits)."""

    def decode(q_lat, q_rope, cache_c, cache_r, new_c, new_r, topk):
        rows = cached_rows(cache_c, cache_r, (2,), jnp.int32(30000), new_c, new_r)
        return sparse_mla_rows(q_lat, q_rope, rows, topk, scale=0.04, query_block=64, kernels="pallas")

    g = 8
    args = (SD((g, 1, H, C), jnp.bfloat16), SD((g, 1, H, R), jnp.bfloat16), SD((4, g, 32768, C), jnp.bfloat16),
            SD((4, g, 32768, R), jnp.bfloat16), SD((g, 1, C), jnp.bfloat16), SD((g, 1, R), jnp.bfloat16),
            SD((g, 1, K), jnp.int32))
    compiled = aot.compile_for_gpu(decode, *args, target="h20")
    forward = compiled.kernels["sparse_mla_forward"]
    assert 0 < forward.shared_memory <= _smem_limit("h20")
    assert forward.grid[0] * forward.grid[1] >= DEFAULT_CONFIG.min_programs // 2  # slots split over programs
    # The cache is read in place: no copy of the 4-layer stack (bytes of one layer's c_kv alone: 256 MiB).
    assert compiled.memory["temp"] < 64 * 2**20


@pytest.mark.slow  # ~2 s (Triton refuses it before ptxas); test_aot.py checks the same refusal in CI for the indexer
def test_oversized_block_is_rejected():
    """128-slot steps with 4 pipeline stages hold ~600 KiB of row tiles: more than sm_90's 227 KiB per block.
    Called below `sparse_mla_tables`, which fits any configured tiles to the limit (`KernelConfig.fitted`)."""
    def forward(codes, q_lat, q_rope, kv, kr):
        return kern.forward(codes, q_lat, q_rope, (kv,), (kr,), scale=0.04, block_k=128, splits=1, num_warps=8,
                            num_stages=4, interpret=False, out_dtype=jnp.bfloat16)

    args = (SD((64, K), jnp.int32), SD((64, H, C), jnp.bfloat16), SD((64, H, R), jnp.bfloat16),
            SD((4096, C), jnp.bfloat16), SD((4096, R), jnp.bfloat16))
    with pytest.raises(aot.SharedMemoryError, match=r"Shared memory size limit exceeded: requested \d+, available: "
                                                    + str(_smem_limit("h200"))):
        aot.compile_for_gpu(forward, *args, target="h200")


@pytest.mark.slow  # ~300 s here: XLA's deviceless GPU compile of even a one-layer model is slow (reference too)
def test_tiny_model_train_step_compiles():
    """A one-layer tiny bf16 GLM-5.2 (full indexer) with kernels="pallas": its LoRA train step (forward,
    log-probs, gradient) from abstract weights, in one program."""
    cfg = config.tiny(num_hidden_layers=1, indexer_types=("full",))
    opts = glm52_jax.ModelOptions(kernels="pallas", lora=LoRAConfig(rank=4, alpha=8.0))
    abstract = nnx.eval_shape(lambda: GlmMoeDsa(cfg, opts, rngs=nnx.Rngs(0)))
    graphdef, lora, rest = nnx.split(abstract, LoRA, ...)

    def train_step(lora, rest, ids):
        def loss(lora):
            logprobs = token_logprobs(nnx.merge(graphdef, lora, rest), ids)
            return -jnp.mean(logprobs), logprobs
        return jax.grad(loss, has_aux=True)(lora)

    compiled = aot.compile_for_gpu(train_step, lora, rest, SD((1, 96), jnp.int32), target="h200")
    assert set(KERNELS) <= set(compiled.kernels), sorted(compiled.kernels)


@pytest.mark.slow  # 19.9 s of deviceless compile: CI checks the tiles' bound instead (test_sparse_mla_tiles.py)
def test_two_table_forward_fits_h20():
    """A cached chunk's forward reads two tables (the cache and its own rows): at 64-slot steps it asked 295,680 B
    of shared memory (the 32K parity chunks, before cached chunks on a mesh took the context-parallel jnp path);
    `KernelConfig.fitted` halves the step for two tables (184,704 B)."""
    def program(q_lat, q_rope, c_kv, k_rope, c_new, r_new, topk):
        codes = encode_rows(jnp.maximum(topk, 0), topk >= 0)
        return sparse_mla_tables(q_lat, q_rope, (c_kv, c_new), (k_rope, r_new), codes, scale=0.04)

    queries = 512
    args = (SD((1, queries, H, C), jnp.bfloat16), SD((1, queries, H, R), jnp.bfloat16), SD((8192, C), jnp.bfloat16),
            SD((8192, R), jnp.bfloat16), SD((queries, C), jnp.bfloat16), SD((queries, R), jnp.bfloat16),
            SD((1, queries, K), jnp.int32))
    resources = aot.compile_for_gpu(program, *args, target="h20").kernels["sparse_mla_forward"]
    assert resources.shared_memory <= _smem_limit("h20")


def _fp8_cache_attention(queries, dtype, grad):
    """A chunk's attention over an FP8 cache table (e4m3 rows [65536, C] read in place with their float32 scales)
    and its own rows of `dtype`: the forward, or (`grad`) the gradient of q and the chunk's rows too."""

    def attend(q_lat, q_rope, c_kv, scales, k_rope, c_new, r_new, topk):
        codes = encode_rows(jnp.maximum(topk, 0), topk >= 0)
        return sparse_mla_tables(q_lat, q_rope, (c_kv, c_new), (k_rope, r_new), codes, scale=0.04,
                                 kv_scales=(scales, None))

    def program(q_lat, q_rope, c_kv, scales, k_rope, c_new, r_new, topk, proj):
        if not grad:
            return attend(q_lat, q_rope, c_kv, scales, k_rope, c_new, r_new, topk)

        def loss(q_lat, q_rope, c_new, r_new):
            out, lse = attend(q_lat, q_rope, c_kv, scales, k_rope, c_new, r_new, topk)
            return jnp.sum(out.astype(jnp.float32) * proj) + jnp.sum(lse)
        return jax.grad(loss, argnums=(0, 1, 2, 3))(q_lat, q_rope, c_new, r_new)

    rows = 65536
    return program, (SD((1, queries, H, C), dtype), SD((1, queries, H, R), dtype), SD((rows, C), jnp.float8_e4m3fn),
                     SD((rows,), jnp.float32), SD((rows, R), dtype), SD((queries, C), dtype), SD((queries, R), dtype),
                     SD((1, queries, K), jnp.int32), SD((1, queries, H, C), jnp.float32))


def _fp8_bounds(dtype):
    tiles = DEFAULT_CONFIG.for_dtype(dtype).fitted(dtype, 2, H, C, R, K, scaled=1)
    itemsize = jnp.dtype(dtype).itemsize
    return (tiles, forward_shared_memory(H, C, R, itemsize, 2, tiles.block_k, tiles.num_stages, 1),
            backward_shared_memory(C, R, itemsize, 2, tiles.bwd_block_k, tiles.bwd_num_stages, 1))


@pytest.mark.slow  # ~10 s of CI: test_fp8_table_bounds_cover_compiles keeps the FP8 table's sizing in CI
def test_fp8_cache_forward_compiles_for_h200():
    """~10 s: the e4m3 table lowers through Triton for sm_90a (e4m3 -> float32 loads, per-row scale gathers), within
    its shared-memory bound at the derived tiles, and is read in place: no dequantized copy of the 32 MiB table."""
    program, args = _fp8_cache_attention(512, jnp.bfloat16, grad=False)
    compiled = aot.compile_for_gpu(program, *args, target="h200")
    forward = compiled.kernels["sparse_mla_forward"]
    tiles, fwd_bound, _ = _fp8_bounds(jnp.bfloat16)
    assert 0 < forward.shared_memory <= fwd_bound <= _smem_limit("h200")
    assert forward.grid[:2] == (512, 1) and forward.threads[0] == 32 * tiles.num_warps
    assert compiled.memory["temp"] < 8 * 2**20, compiled.memory  # bf16 table copy: 64 MiB


@pytest.mark.slow  # 50-220 s of deviceless compile each here (2 busy cores); the forward's compile (~10 s) stays in CI
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fp8_cache_forward_backward_compile(dtype):
    """The gradient of q and the chunk's rows over an FP8 cache table: both kernels within their bounds."""
    program, args = _fp8_cache_attention(512, dtype, grad=True)
    compiled = aot.compile_for_gpu(program, *args, target="h200")
    _, fwd_bound, bwd_bound = _fp8_bounds(dtype)
    assert 0 < compiled.kernels["sparse_mla_forward"].shared_memory <= fwd_bound
    assert 0 < compiled.kernels["sparse_mla_backward"].shared_memory <= bwd_bound <= _smem_limit("h200")
