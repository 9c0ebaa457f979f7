"""The sparse-MLA kernels' tiles fit sm_90's shared memory at every config's shapes (no compile: the derivation
`KernelConfig.fitted` and its byte bounds, checked against the sm_90a compiles recorded by
benchmarks/sparse_mla_compile_stats.py)."""

import json
import re
from pathlib import Path

import jax.numpy as jnp
import pytest

from glm52_jax import run_defaults
from glm52_jax.kernels import aot
from glm52_jax.kernels.sparse_mla import (
    DEFAULT_CONFIG,
    SHARED_MEMORY_PER_BLOCK,
    backward_shared_memory,
    forward_shared_memory,
)
from glm52_jax.rl.inputs import model_config
from glm52_jax.run_config import RunSpec

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.py"))
STATS = ROOT / "benchmarks" / "results" / "sparse_mla_compile_stats.json"

# sm_90a compiles (kernels.aot, h20 target, 64 heads, C 512, R 64; 2026-12-07) of tiles the derivation does not all
# choose: (kernel, dtype, tables, block_k, stages, bytes). The 2-table bf16 forward at 64 slots is the tile the
# 32K parity chunks once asked for (over the limit).
MEASURED = [("forward", "bfloat16", 1, 64, 2, 221_440), ("forward", "bfloat16", 2, 64, 2, 295_680),
            ("forward", "bfloat16", 2, 32, 2, 184_704), ("forward", "bfloat16", 2, 32, 1, 110_592),
            ("forward", "bfloat16", 2, 16, 3, 129_280), ("forward", "bfloat16", 1, 32, 3, 147_840),
            ("forward", "float32", 1, 16, 2, 188_736), ("forward", "float32", 1, 16, 1, 184_576),
            ("forward", "float32", 2, 16, 1, 184_576), ("forward", "float32", 2, 32, 1, 221_440),
            ("backward", "bfloat16", 1, 32, 1, 135_168), ("backward", "bfloat16", 1, 32, 2, 139_392),
            ("backward", "bfloat16", 2, 32, 1, 135_168), ("backward", "bfloat16", 1, 64, 1, 274_432),
            ("backward", "float32", 1, 16, 1, 106_496)]


# The same for an FP8 cache's table A (e4m3 rows + float32 scales) beside a chunk's rows of `dtype` (h200 target, 64
# heads, C 512, R 64, k 2048, 512 queries; 2026-12-07): (kernel, dtype, tables, block_k, stages, bytes), one table
# scaled. The backward stages each e4m3 row again (bf16 tables: 135,168 B at these tiles; the forward 184,704).
MEASURED_FP8 = [("forward", "bfloat16", 2, 32, 2, 168_448), ("backward", "bfloat16", 2, 32, 1, 184_320),
                ("forward", "float32", 2, 16, 1, 184_576), ("backward", "float32", 2, 16, 1, 108_544)]


def _bound(kernel, dtype, tables, block_k, stages, heads=64, latent=512, rope=64, scaled=0):
    itemsize = jnp.dtype(dtype).itemsize
    if kernel == "forward":
        return forward_shared_memory(heads, latent, rope, itemsize, tables, block_k, stages, scaled)
    return backward_shared_memory(latent, rope, itemsize, tables, block_k, stages, scaled)


def test_limit_is_the_targets():
    for target in aot.TARGETS:
        optin = re.search(r"shared_memory_per_block_optin: (\d+)", aot.target_config(target)).group(1)
        assert int(optin) == SHARED_MEMORY_PER_BLOCK, target


@pytest.mark.parametrize("measured", MEASURED, ids=lambda m: "-".join(map(str, m[:5])))
def test_bounds_cover_compiles(measured):
    """Each bound is at least what ptxas allotted, and within 30% of it where Triton buffered every stage (the
    forward up to 2 stages, the backward's 1; its 2 stages added 4 KiB, not a row tile)."""
    *tiles, used = measured
    bound = _bound(*tiles)
    assert used <= bound
    if tiles[4] <= (2 if tiles[0] == "forward" else 1):
        assert bound < 1.3 * used


@pytest.mark.parametrize("measured", MEASURED_FP8, ids=lambda m: "-".join(map(str, m[:5])))
def test_fp8_table_bounds_cover_compiles(measured):
    """With one e4m3 table: each bound covers what ptxas allotted, within 30% where every stage was buffered (bf16;
    float32's 1-stage backward within 50%), and the derivation picks these tiles for it."""
    *tiles, used = measured
    bound = _bound(*tiles, scaled=1)
    assert used <= bound < (1.3 if tiles[1] == "bfloat16" else 1.5) * used
    dt = jnp.dtype(tiles[1])
    fitted = DEFAULT_CONFIG.for_dtype(dt).fitted(dt, 2, 64, 512, 64, 2048, scaled=1)
    want = (fitted.block_k, fitted.num_stages) if tiles[0] == "forward" else (fitted.bwd_block_k,
                                                                              fitted.bwd_num_stages)
    assert want == tuple(tiles[3:5])


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", ["config", "float32"])
def test_every_config_shape_fits(config, dtype):
    """The config's attention widths (its preset), in its dtype and in float32 (the parity path), from one row
    table (whole sequences) or two (a cache and a chunk's own rows): tiles within the limit, the forward
    pipelined (>= 2 stages) wherever a 16-slot step allows it."""
    spec = RunSpec.from_dict(run_defaults.from_file(ROOT / "configs" / config).to_dict())
    cfg = model_config(spec.model, preset_without_checkpoint=True)[0]
    dt = spec.model.jnp_dtype() if dtype == "config" else jnp.dtype(dtype)
    heads = max(16, 1 << (cfg.num_attention_heads - 1).bit_length())
    c, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    for tables, scaled in ((1, 0), (2, 0), (2, 1)):  # scaled: an FP8 cache's e4m3 table beside the chunk's rows
        tiles = DEFAULT_CONFIG.for_dtype(dt).fitted(dt, tables, heads, c, r, cfg.index_topk, scaled=scaled)
        fwd = forward_shared_memory(heads, c, r, dt.itemsize, tables, tiles.block_k, tiles.num_stages, scaled)
        bwd = backward_shared_memory(c, r, dt.itemsize, tables, tiles.bwd_block_k, tiles.bwd_num_stages, scaled)
        assert fwd <= SHARED_MEMORY_PER_BLOCK and bwd <= SHARED_MEMORY_PER_BLOCK, (tables, tiles)
        assert tiles.block_k >= 16 and tiles.bwd_block_k >= 16
        two_stages = forward_shared_memory(heads, c, r, dt.itemsize, tables, 16, 2, scaled) <= SHARED_MEMORY_PER_BLOCK
        assert tiles.num_stages >= 2 or not two_stages, (tables, tiles)


def test_two_table_forward_shrinks_its_step():
    """GLM-5.2's bf16 forward over a cache and a chunk's rows: the configured 64-slot step would need more than
    the limit (compiled: 295,680 B), so it takes 32-slot steps and keeps its two stages; one table keeps 64."""
    one = DEFAULT_CONFIG.fitted(jnp.bfloat16, 1, 64, 512, 64, 2048)
    two = DEFAULT_CONFIG.fitted(jnp.bfloat16, 2, 64, 512, 64, 2048)
    assert (one.block_k, one.num_stages) == (DEFAULT_CONFIG.block_k, DEFAULT_CONFIG.num_stages) == (64, 2)
    assert (two.block_k, two.num_stages) == (32, 2)
    assert _bound("forward", "bfloat16", 2, 64, 2) > SHARED_MEMORY_PER_BLOCK
    # Short selections take steps no longer than their slots (a 32-slot top-k: no padding to 64).
    assert DEFAULT_CONFIG.fitted(jnp.bfloat16, 1, 16, 32, 16, 32).block_k == 32
    # A smaller limit keeps the pipeline and shortens the step rather than dropping a stage.
    assert DEFAULT_CONFIG.fitted(jnp.bfloat16, 1, 64, 512, 64, 2048, limit=160_000).num_stages == 2


def test_nothing_fits_is_one_clear_line():
    with pytest.raises(ValueError, match=r"no forward tile fits 232,448 B .* 256 heads x 1088 wide float32 .*"
                                         r"kernels='reference'"):
        DEFAULT_CONFIG.fitted(jnp.float32, 2, 256, 1024, 64, 2048)


@pytest.mark.skipif(not STATS.exists(), reason="run python -m benchmarks.sparse_mla_compile_stats")
def test_recorded_compiles_fit_and_match_the_derivation():
    """Every kernel the configs' programs compile (benchmarks/results/sparse_mla_compile_stats.json): it fit its
    target, within the bound, with the tiles the derivation gives today (else the JSON is stale: rerun it)."""
    rows = json.loads(STATS.read_text())["rows"]
    assert rows and {r["target"] for r in rows} == set(aot.TARGETS)
    for r in rows:
        assert r["fits"] and r["shared_memory"] <= r["limit"] == SHARED_MEMORY_PER_BLOCK, r
        if r["kernel"] == "sparse_mla_segment_sum":
            continue
        dt = jnp.dtype(r["dtype"])
        tiles = DEFAULT_CONFIG.for_dtype(dt).fitted(dt, r["tables"], r["heads"], r["latent"], r["rope"],
                                                    r["index_topk"])
        if r["kernel"] == "sparse_mla_forward":
            assert (r["block_k"], r["num_stages"], r["num_warps"]) == (tiles.block_k, tiles.num_stages,
                                                                       tiles.num_warps), r
            kernel = "forward"
        else:
            assert (r["block_k"], r["block_h"], r["num_stages"], r["num_warps"]) == (
                tiles.bwd_block_k, min(tiles.bwd_block_h, r["heads"]), tiles.bwd_num_stages, tiles.bwd_num_warps), r
            kernel = "backward"
        bound = _bound(kernel, dt, r["tables"], r["block_k"], r["num_stages"], r["heads"], r["latent"], r["rope"])
        assert r["shared_memory"] <= bound, r
