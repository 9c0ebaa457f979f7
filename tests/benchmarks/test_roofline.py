"""benchmarks/roofline.py: the analytic FLOP/byte model obeys the relations it claims."""

import importlib.util
import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from glm52_jax.config import glm52, tiny

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "roofline.py"


def _load():
    spec = importlib.util.spec_from_file_location("roofline_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


rl = _load()
S2M = 2_097_152


def _flops(cfg, seq_len, component, **kw):
    return rl.component_costs(cfg, seq_len, **kw)["components"][component]["flops"]


def test_indexer_flops_scale_exactly_with_full_layers():
    shared, full = glm52(), rl.all_full_indexers(glm52())
    assert shared.indexer_types.count("full") == 21 and full.indexer_types.count("full") == 78
    for workload in rl.WORKLOADS:
        a = rl.component_costs(shared, S2M, workload=workload)["components"]
        b = rl.component_costs(full, S2M, workload=workload)["components"]
        for name in ("indexer_score", "indexer_proj"):
            assert Fraction(a[name]["flops"], b[name]["flops"]) == Fraction(21, 78), (workload, name)
        for name in ("sparse_attn", "q_proj", "moe_routed", "unembed"):  # IndexShare changes nothing else
            assert a[name]["flops"] == b[name]["flops"], (workload, name)


def test_indexer_quadratic_sparse_attention_linear():
    cfg, s = glm52(), 1 << 20
    idx_s, idx_2s = _flops(cfg, s, "indexer_score"), _flops(cfg, 2 * s, "indexer_score")
    # causal half: sum_t t = S(S+1)/2, so the ratio is exactly 2(2S+1)/(S+1), i.e. 4 up to O(1/S)
    assert Fraction(idx_2s, idx_s) == Fraction(2 * (2 * s + 1), s + 1)
    assert idx_2s / idx_s == pytest.approx(4.0, rel=1e-5)
    att_s, att_2s = _flops(cfg, s, "sparse_attn"), _flops(cfg, 2 * s, "sparse_attn")
    per_key = 2 * cfg.num_attention_heads * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    # past index_topk keys each extra query costs exactly top-k keys: linear in S
    assert att_2s - att_s == cfg.num_hidden_layers * per_key * cfg.index_topk * s
    assert att_2s / att_s == pytest.approx(2.0, rel=1e-3)


def test_tiny_config_hand_counts():
    cfg, s = tiny(), 100
    assert cfg.indexer_types.count("full") == 4 and cfg.num_hidden_layers == 6
    costs = rl.component_costs(cfg, s)["components"]
    # o_proj: 6 layers x 2 * S * heads(4) * v_head(32) * hidden(64)
    assert costs["o_proj"]["flops"] == 6 * 2 * 100 * 4 * 32 * 64 == 9_830_400
    # indexer: 4 full layers x 2 * heads(8) * dim(32) * (1 + 2 + ... + 100)
    assert costs["indexer_score"]["flops"] == 4 * 2 * 8 * 32 * 5050 == 10_342_400
    # sparse MLA: 6 layers x 2 * 4 heads * (32 + 16 + 32) * sum_t min(t, 32) = (528 + 68 * 32)
    assert costs["sparse_attn"]["flops"] == 6 * 2 * 4 * 80 * (528 + 68 * 32) == 10_383_360
    # prefill unembeds one token; conventional training: all tokens, x3 (backward = 2x forward)
    train = rl.component_costs(cfg, s, workload="train_conventional")["components"]
    assert costs["unembed"]["flops"] == 2 * 64 * 512
    assert train["unembed"]["flops"] == 3 * 2 * 100 * 64 * 512
    assert train["o_proj"]["flops"] == 3 * costs["o_proj"]["flops"]
    assert train["indexer_score"]["flops"] == costs["indexer_score"]["flops"]  # forward-only


def test_causal_sums_match_brute_force():
    for first, last, k in ((1, 100, 32), (40, 77, 32), (5, 20, 32), (90, 120, 7)):
        assert rl.sum_min_topk(first, last, k) == sum(min(t, k) for t in range(first, last + 1))
        assert rl.sum_positions(first, last) == sum(range(first, last + 1))
    for prefix, n, tile in ((0, 100, 16), (50, 33, 8), (7, 5, 64)):
        tiles = [range(j, min(j + tile, n)) for j in range(0, n, tile)]
        assert rl.streamed_keys(prefix, n, tile) == sum(prefix + t[-1] + 1 for t in tiles)


def test_bound_agrees_with_design_and_fp8_helps():
    costs = rl.component_costs(glm52(), S2M)
    bound = rl.lower_bound_seconds(costs, rl.HARDWARE["H20"], 32)
    assert bound["total_s"] == pytest.approx(126.0, rel=0.10)
    assert bound["total_s"] >= max(bound["compute_only_s"], bound["memory_only_s"])
    fp8 = rl.lower_bound_seconds(rl.component_costs(glm52(), S2M, fp8_indexer=True), rl.HARDWARE["H20"], 32)
    # the indexer score GEMM, compute-bound, runs at twice the rate
    idx_bf16 = bound["components"]["indexer_score"]["compute_s"]
    assert fp8["components"]["indexer_score"]["compute_s"] == pytest.approx(idx_bf16 / 2)
    assert fp8["total_s"] < bound["total_s"]
    # more devices, proportionally less time
    assert rl.lower_bound_seconds(costs, rl.HARDWARE["H20"], 64)["total_s"] == pytest.approx(bound["total_s"] / 2)


def test_kv_cache_per_device():
    kv = rl.kv_cache_bytes(glm52(), S2M, 32)
    assert kv["bytes_per_token"] == 78 * (512 + 64) * 2 + 21 * 128 * 2
    full = rl.kv_cache_bytes(rl.all_full_indexers(glm52()), S2M, 32)
    assert full["per_device_gib"] == pytest.approx(6.70, abs=0.005)  # research notes §2.5


def test_script_json_subprocess():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--json"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    for key in ("workloads", "kv_cache", "seed", "design_check", "hardware", "assumptions"):
        assert key in rep
    assert set(rep["workloads"]) == set(rl.WORKLOADS)
    variants = {"indexshare/bf16_indexer", "indexshare/fp8_indexer", "all_full/bf16_indexer", "all_full/fp8_indexer"}
    for rows in rep["workloads"].values():
        assert set(rows) == variants
        for row in rows.values():
            assert set(row["costs"]["components"]) == set(rl.COMPONENTS)
            assert set(row["bounds"]) == {"H20", "H200"}
    seed = rep["seed"]["by_variant"]["indexshare/bf16_indexer"]
    assert seed["first_candidate_over_bound"] == pytest.approx(1867.58 / seed["prefill_bound_s"])
    assert abs(rep["design_check"]["relative_difference"]) < 0.10
    # The figures benchmarks/RESULTS.md quotes from this command (to their printed digits).
    prefill = {v: row["bounds"]["H20"]["total_s"] for v, row in rep["workloads"]["prefill"].items()}
    assert round(prefill["indexshare/bf16_indexer"], 1) == 124.6
    assert round(prefill["indexshare/fp8_indexer"], 1) == 84.6
    assert round(prefill["all_full/bf16_indexer"], 1) == 341.9
    parts = rep["workloads"]["prefill"]["indexshare/bf16_indexer"]["costs"]["components"]
    indexer = sum(parts[c]["flops"] for c in ("indexer_score", "indexer_proj"))
    assert round(100 * indexer / sum(c["flops"] for c in parts.values())) == 64
    assert round(seed["first_candidate_over_bound"]) == 15 and round(seed["cached_candidate_over_bound"]) == 555
    assert round(1000 * seed["decode_bound_s"]) == 55
    assert round(rep["kv_cache"]["indexshare/bf16_indexer"]["per_device_gib"], 2) == 5.81
    assert round(rep["kv_cache"]["all_full/bf16_indexer"]["per_device_gib"], 2) == 6.70
