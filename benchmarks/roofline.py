"""Analytic roofline of GLM-5.2 at an exact 2M-token context on 32 GPUs (on paper).

Pure arithmetic: imports only `glm52_jax.config` (which loads jax transitively through
`glm52_jax.positions`; that import is ~all of the run time); nothing runs on a device.

For four workloads it counts FLOPs and HBM bytes per component and per layer kind, and turns them
into a lower-bound time on 32x H20 and 32x H200:

  prefill              one forward over S tokens; logits for the last token only (sampling).
  train_conventional   forward + backward over all S tokens; logits for all S tokens (the
                       trainer computes log-probs over the whole differentiated sequence).
  train_response_only  forward + backward over the R response tokens against the cached prefix
                       (latent KV + indexer keys of the S - R prompt tokens are constants);
                       logits for the R tokens.
  decode_cached        the seed's second candidate: G samples x R decode steps on a cached prefix.

    .venv/bin/python benchmarks/roofline.py [--json] [--seq_len 2097152] [--devices 32]
                                            [--fp8_indexer both|on|off]

Counting rules (1 multiply-add = 2 FLOPs; only tensor-core GEMM work is counted as FLOPs):
- MLA runs in absorbed form: q = q_b(q_a(x)); [c_kv | k_rope] = kv_a(x); W_UK is applied to the
  query (nope -> latent) and W_UV to the attention output (latent -> v). kv_proj = kv_a + W_UK +
  W_UV, which costs the same FLOPs as running kv_b over the keys.
- Sparse attention: each query attends to min(t, index_topk) keys, QK over kv_lora + rope = 576
  and PV over the 512-wide latent: 2 * heads * (576 + 512) FLOPs per (query, key). (The brief's
  shorthand 2 * 2 * heads * 576 counts PV over 576 too; it is 5.9% more on a ~8% share of the
  IndexShare prefill, so the total moves by < 0.5%.)
- Indexer scoring runs on 'full' indexer layers only (IndexShare 'shared' layers reuse the previous
  full layer's top-k and have no indexer weights); causal, keys including the query itself:
  2 * index_n_heads * index_head_dim * sum_t t = 2 * H_I * d_I * S (S + 1) / 2 for a prefill.
  ReLU, head weighting, head sum and the top-k selection run on vector units and are not counted
  (about +1% of the indexer FLOPs in the research notes).
- Norms, RoPE, softmax, SwiGLU activation, embedding gather, the MTP layer: not counted.
- Training: backward = 2x forward FLOPs (and 2x forward HBM bytes) for every differentiated
  component. The indexer (projections and scoring) is forward-only: its output is a discrete
  top-k and the model stops its gradient (glm52_jax/model/indexer.py). With LoRA the frozen base
  weights need no dW, so the true backward is closer to 1x forward on those GEMMs: the training
  bounds here are conservative (up to ~1.5x high on the linear part).

HBM byte model (bf16 = 2 B for weights and activations unless noted):
- GEMM: every weight read once per pass, every input activation read once, every output written
  once (the KV-cache write is the kv_a / wk output).
- Routed experts: weights of the experts actually touched, E * (1 - (1 - k/E)^T) for T tokens
  (all 256 at 2M tokens, ~57 for an 8-token decode step); dispatched activations k copies.
- Indexer scoring: queries and head weights once, keys streamed once per query tile of
  `indexer_query_tile` tokens (never an [S, S] score matrix), top-k indices written (int32).
  Intensity is about H_I * tile FLOP/B, far above both ridges, so the tile does not move the
  bound. FP8 indexer: q and k in fp8, keys carry one fp32 scale per token (128 + 4 B).
- Sparse attention: each query gathers its own min(t, K) latent rows of (512 + 64) * 2 B (all 64
  heads share them, no reuse across queries assumed): 121 FLOP/B, compute-bound on H20 (ridge 37)
  but memory-bound on H200 (ridge 206).

Bound: per component, max(FLOPs / (devices * peak[precision]), bytes / (devices * HBM BW)),
summed over components. It assumes perfect sharding, perfect load balance and perfect overlap
of everything inside a component, and no communication; it is a floor, not a forecast.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from glm52_jax.config import ModelConfig, glm52

BF16 = 2  # bytes
FP32 = 4
INT32 = 4

# ---- hardware (dense, no 2:4 sparsity), from shared/research/performance_rooflines.md §1 --------
# H20 (SXM, 96 GB HBM3): 148 TFLOP/s dense BF16, 296 TFLOP/s dense FP8 (= the INT8 figure; a
#   measured BF16 GEMM reaches 142 TFLOP/s = 96%), 4.0 TB/s HBM (LLM-Prof lists 4,022 GB/s).
# H200 (SXM, 141 GB HBM3e): 989.5 TFLOP/s dense BF16 (1,979 is the sparsity figure),
#   1,979 TFLOP/s dense FP8, 4.8 TB/s HBM.


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    bf16_flops: float  # dense tensor-core FLOP/s per GPU
    fp8_flops: float
    hbm_bandwidth: float  # bytes/s per GPU
    hbm_capacity: float  # bytes per GPU

    def peak(self, precision: str) -> float:
        return {"bf16": self.bf16_flops, "fp8": self.fp8_flops}[precision]


HARDWARE = {
    "H20": Hardware("H20", 148e12, 296e12, 4.0e12, 96e9),
    "H200": Hardware("H200", 989.5e12, 1979e12, 4.8e12, 141e9),
}

# ---- the seed run (shared/seed/glm52_exact_2m_validation_update.txt) ------------------------------
SEED_HARDWARE = "H20"
SEED_DEVICES = 32
SEED_FIRST_CANDIDATE_S = 1867.58  # first exact-2M candidate: prefill + up to 16 tokens x 8 samples
SEED_CACHED_CANDIDATE_S = 30.798  # second candidate on the cached prefix
SEED_SAMPLES = 8  # samples per exact-2M request
SEED_MAX_NEW_TOKENS = 16  # configured response limit (6 of 16 outputs reached it)
# DESIGN.md §8: ideal bf16 IndexShare prefill bound on 32x H20, "~126 s". It is the research
# notes' all-FLOPs total (§2.3) with the indexer scoring scaled by 21/78: (1.7126e17 + 4.6632e16 +
# 1.4051e18 * 21/78) / (32 * 148e12) = 125.9 s. We get 124.6 s (-1.1%): 6.2e15 fewer FLOPs because
# (a) the prefill needs logits for the last token only, not all 2M (-3.99e15, -0.84 s), and (b)
# IndexShare 'shared' layers have no indexer projections, which the notes count on all 78 layers
# (-2.24e15, -0.47 s). No H20 prefill component is memory-bound enough to add time back.
DESIGN_PREFILL_BOUND_S = 126.0

WORKLOADS = ("prefill", "train_conventional", "train_response_only", "decode_cached")
COMPONENTS = ("q_proj", "kv_proj", "indexer_proj", "indexer_score", "sparse_attn", "o_proj",
              "dense_mlp", "moe_routed", "moe_shared", "router", "unembed")
# Which layers a component runs on ('head' = once per pass, after the last layer).
LAYER_KIND = {"q_proj": "all", "kv_proj": "all", "indexer_proj": "full_indexer", "indexer_score": "full_indexer",
              "sparse_attn": "all", "o_proj": "all", "dense_mlp": "dense_mlp", "moe_routed": "moe",
              "moe_shared": "moe", "router": "moe", "unembed": "head"}
FORWARD_ONLY = ("indexer_proj", "indexer_score")  # top-k is discrete; the model stops its gradient


def all_full_indexers(cfg: ModelConfig) -> ModelConfig:
    """The same model without IndexShare: every layer runs its own indexer."""
    return cfg.replace(indexer_types=("full",) * cfg.num_hidden_layers)


def layer_counts(cfg: ModelConfig) -> dict[str, int]:
    return {"all": cfg.num_hidden_layers, "full_indexer": cfg.indexer_types.count("full"),
            "dense_mlp": cfg.mlp_layer_types.count("dense"), "moe": cfg.mlp_layer_types.count("sparse"), "head": 1}


# ---- sums over causal query positions (1-based; a query sees keys 1..t, itself included) -------
def sum_positions(first: int, last: int) -> int:
    """sum_{t=first}^{last} t."""
    return 0 if last < first else (first + last) * (last - first + 1) // 2


def sum_min_topk(first: int, last: int, k: int) -> int:
    """sum_{t=first}^{last} min(t, k)."""
    if last < first:
        return 0
    below = sum_positions(first, min(last, k))
    return below + k * max(0, last - max(first, k + 1) + 1)


def streamed_keys(prefix: int, n_queries: int, tile: int) -> int:
    """Keys read by a tiled causal scan: query tile j (queries prefix+jB+1 .. ) reads every key up
    to its last query; queries are consecutive positions after `prefix` cached tokens."""
    n_full = n_queries // tile
    keys = n_full * prefix + tile * n_full * (n_full + 1) // 2
    if n_queries % tile:
        keys += prefix + n_queries
    return keys


@dataclasses.dataclass(frozen=True)
class _Pass:
    """One forward pass: n_q query tokens, their causal key counts, logits rows, routing batch."""

    n_q: int  # query tokens forwarded
    sum_ctx: int  # sum over queries of visible keys (indexer work)
    sum_topk: int  # sum over queries of min(visible keys, index_topk) (sparse attention work)
    key_reads: int  # indexer keys streamed from HBM
    n_logits: int  # rows of the unembedding
    routing_tokens: int  # tokens routed together (sets how many experts are touched)


def _pass_costs(cfg: ModelConfig, p: _Pass, fp8_indexer: bool) -> dict[str, tuple[int, float]]:
    """(FLOPs, HBM bytes) per layer of each component for one forward pass."""
    d, h, c, r = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    n, v, q_rank, vocab = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.q_lora_rank, cfg.vocab_size
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    e, top, fe, ns, f = (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                         cfg.n_shared_experts, cfg.intermediate_size)
    t = p.n_q

    def mm(macs_per_tok: int, in_per_tok: int, out_per_tok: int, weight_bytes: float, tokens: int = t,
           in_bytes: int = BF16, out_bytes: int = BF16) -> tuple[int, float]:
        return 2 * tokens * macs_per_tok, weight_bytes + tokens * (in_per_tok * in_bytes + out_per_tok * out_bytes)

    def add(*parts):
        return sum(x[0] for x in parts), sum(x[1] for x in parts)

    idx_elem = 1 if fp8_indexer else BF16
    idx_key_bytes = di + FP32 if fp8_indexer else di * BF16  # fp8 key + one fp32 scale per token
    touched = e * (1.0 - (1.0 - top / e) ** p.routing_tokens)
    swiglu = 3 * d  # gate + up + down MACs per unit of intermediate width

    costs = {
        "q_proj": add(mm(d * q_rank, d, q_rank, BF16 * d * q_rank),
                      mm(q_rank * h * (n + r), q_rank, h * (n + r), BF16 * q_rank * h * (n + r))),
        "kv_proj": add(mm(d * (c + r), d, c + r, BF16 * d * (c + r)),  # kv_a: writes the latent KV cache
                       mm(h * n * c, h * n, h * c, BF16 * c * h * n),  # W_UK absorbed into the query
                       mm(h * c * v, h * c, h * v, BF16 * c * h * v)),  # W_UV on the attention output
        "indexer_proj": add(mm(q_rank * hi * di, q_rank, hi * di, BF16 * q_rank * hi * di, out_bytes=idx_elem),
                            mm(d * di, d, di, BF16 * d * di, out_bytes=idx_elem),  # writes the indexer key
                            mm(d * hi, d, hi, FP32 * d * hi, out_bytes=FP32)),  # weights_proj, fp32
        "indexer_score": (2 * hi * di * p.sum_ctx,
                          t * (hi * di * idx_elem + hi * FP32) + p.key_reads * idx_key_bytes + p.sum_topk * INT32),
        "sparse_attn": (2 * h * ((c + r) + c) * p.sum_topk,
                        p.sum_topk * ((c + r) * BF16 + INT32) + t * h * ((c + r) + c) * BF16),
        "o_proj": mm(h * v * d, h * v, d, BF16 * h * v * d),
        "dense_mlp": (2 * t * swiglu * f, BF16 * swiglu * f + BF16 * t * (2 * d + 2 * f)),
        "moe_routed": (2 * t * top * swiglu * fe, BF16 * touched * swiglu * fe + BF16 * t * top * (2 * d + 2 * fe)),
        "moe_shared": (2 * t * swiglu * fe * ns, BF16 * swiglu * fe * ns + BF16 * t * (2 * d + 2 * fe * ns)),
        "router": mm(d * e, d, e, BF16 * d * e, out_bytes=FP32),
        "unembed": mm(d * vocab, d, vocab, BF16 * d * vocab, tokens=p.n_logits, out_bytes=FP32),
    }
    if ns == 0:
        costs["moe_shared"] = (0, 0.0)
    return costs


def _passes(cfg: ModelConfig, workload: str, seq_len: int, response_len: int, samples: int,
            tile: int) -> list[_Pass]:
    s, k = seq_len, cfg.index_topk
    if workload in ("prefill", "train_conventional"):
        logits = 1 if workload == "prefill" else s
        return [_Pass(s, sum_positions(1, s), sum_min_topk(1, s, k), streamed_keys(0, s, tile), logits, s)]
    if workload == "train_response_only":
        prefix = s - response_len
        if prefix < 0:
            raise ValueError(f"response_len={response_len} exceeds seq_len={s}")
        return [_Pass(response_len, sum_positions(prefix + 1, s), sum_min_topk(prefix + 1, s, k),
                      streamed_keys(prefix, response_len, tile), response_len, response_len)]
    if workload == "decode_cached":
        # Step i forwards one token per sample at position s + i + 1; the samples share the cached
        # prefix, so one scan of the keys serves all of them (their own <= R tokens are ignored).
        steps = []
        for i in range(response_len):
            ctx = s + i + 1
            steps.append(_Pass(samples, samples * ctx, samples * min(ctx, k), ctx, samples, samples))
        return steps
    raise ValueError(f"unknown workload {workload!r}; expected one of {WORKLOADS}")


def component_costs(cfg: ModelConfig, seq_len: int, *, workload: str = "prefill", response_len: int = 16,
                    decode_samples: int = SEED_SAMPLES, fp8_indexer: bool = False,
                    indexer_query_tile: int = 64) -> dict:
    """FLOPs and HBM bytes per component (per layer and total) for one workload; pure arithmetic.

    seq_len is the whole context (prompt + response for training). Training multiplies every
    differentiated component by 3 (forward + a 2x backward); the indexer stays forward-only.
    """
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; expected one of {WORKLOADS}")
    passes = _passes(cfg, workload, seq_len, response_len, decode_samples, indexer_query_tile)
    training = workload.startswith("train_")
    counts = layer_counts(cfg)
    per_layer = {name: [0, 0.0] for name in COMPONENTS}
    for p in passes:
        for name, (flops, nbytes) in _pass_costs(cfg, p, fp8_indexer).items():
            mult = 3 if training and name not in FORWARD_ONLY else 1
            per_layer[name][0] += mult * flops
            per_layer[name][1] += mult * nbytes
    components = {}
    for name in COMPONENTS:
        layers = counts[LAYER_KIND[name]]
        flops, nbytes = per_layer[name]
        components[name] = {
            "layer_kind": LAYER_KIND[name], "layers": layers,
            "precision": "fp8" if (name == "indexer_score" and fp8_indexer) else "bf16",
            "flops_per_layer": flops, "bytes_per_layer": nbytes,
            "flops": layers * flops, "bytes": layers * nbytes,
        }
    return {
        "workload": workload, "seq_len": seq_len, "response_len": response_len if workload != "prefill" else 0,
        "decode_samples": decode_samples if workload == "decode_cached" else 0,
        "full_indexer_layers": counts["full_indexer"], "layers": counts["all"], "fp8_indexer": fp8_indexer,
        "backward_multiplier": 2 if training else 0,
        "components": components,
        "totals": {"flops": sum(x["flops"] for x in components.values()),
                   "bytes": sum(x["bytes"] for x in components.values())},
    }


def lower_bound_seconds(costs: dict, hw: Hardware, devices: int) -> dict:
    """Per-component max(compute, memory) time at 100% of peak on `devices` GPUs, summed."""
    comps = {}
    for name, cc in costs["components"].items():
        compute = cc["flops"] / (devices * hw.peak(cc["precision"]))
        memory = cc["bytes"] / (devices * hw.hbm_bandwidth)
        comps[name] = {"compute_s": compute, "memory_s": memory, "bound_s": max(compute, memory),
                       "limited_by": "compute" if compute >= memory else "memory"}
    return {
        "hardware": hw.name, "devices": devices, "components": comps,
        "total_s": sum(x["bound_s"] for x in comps.values()),
        "compute_only_s": sum(x["compute_s"] for x in comps.values()),
        "memory_only_s": sum(x["memory_s"] for x in comps.values()),
    }


def kv_cache_bytes(cfg: ModelConfig, seq_len: int, devices: int, fp8_indexer: bool = False) -> dict:
    """Latent (kv_lora + rope) bf16 on every layer + indexer key on full layers, sharded `devices` ways."""
    counts = layer_counts(cfg)
    latent = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * BF16
    key = cfg.index_head_dim + FP32 if fp8_indexer else cfg.index_head_dim * BF16
    per_token = counts["all"] * latent + counts["full_indexer"] * key
    total = per_token * seq_len
    return {"latent_bytes_per_token_layer": latent, "indexer_key_bytes_per_token_layer": key,
            "full_indexer_layers": counts["full_indexer"], "bytes_per_token": per_token,
            "total_bytes": total, "per_device_bytes": total / devices, "per_device_gib": total / devices / 2**30,
            "total_gib": total / 2**30}


# ---- report -----------------------------------------------------------------------------------
def _variants(fp8_choice: str) -> list[tuple[str, bool]]:
    out = []
    for index_share in ("indexshare", "all_full"):
        for fp8 in {"both": (False, True), "on": (True,), "off": (False,)}[fp8_choice]:
            out.append((index_share, fp8))
    return out


def _variant_name(index_share: str, fp8: bool) -> str:
    return f"{index_share}/{'fp8' if fp8 else 'bf16'}_indexer"


def build_report(seq_len: int = 2_097_152, devices: int = 32, fp8_choice: str = "both", response_len: int = 16,
                 decode_samples: int = SEED_SAMPLES, cfg: ModelConfig | None = None) -> dict:
    base = cfg or glm52()
    models = {"indexshare": base, "all_full": all_full_indexers(base)}
    variants = _variants(fp8_choice)
    workloads = {}
    for workload in WORKLOADS:
        rows = {}
        for index_share, fp8 in variants:
            costs = component_costs(models[index_share], seq_len, workload=workload, response_len=response_len,
                                    decode_samples=decode_samples, fp8_indexer=fp8)
            bounds = {hw.name: lower_bound_seconds(costs, hw, devices) for hw in HARDWARE.values()}
            rows[_variant_name(index_share, fp8)] = {"costs": costs, "bounds": bounds}
        workloads[workload] = rows

    seed = {"hardware": SEED_HARDWARE, "devices": SEED_DEVICES, "first_candidate_s": SEED_FIRST_CANDIDATE_S,
            "cached_candidate_s": SEED_CACHED_CANDIDATE_S,
            "measured_ratio": SEED_FIRST_CANDIDATE_S / SEED_CACHED_CANDIDATE_S,
            "by_variant": {}}
    for name in workloads["prefill"]:
        pre = workloads["prefill"][name]["bounds"][SEED_HARDWARE]["total_s"]
        dec = workloads["decode_cached"][name]["bounds"][SEED_HARDWARE]["total_s"]
        seed["by_variant"][name] = {
            "prefill_bound_s": pre, "first_candidate_over_bound": SEED_FIRST_CANDIDATE_S / pre,
            "prefill_bound_fraction_of_measured": pre / SEED_FIRST_CANDIDATE_S,
            "decode_bound_s": dec, "cached_candidate_over_bound": SEED_CACHED_CANDIDATE_S / dec,
            "decode_bound_fraction_of_measured": dec / SEED_CACHED_CANDIDATE_S,
            "bound_ratio_first_over_cached": (pre + dec) / dec,
        }

    kv = {}
    for index_share, model in models.items():
        for fp8 in (False, True):
            kv[_variant_name(index_share, fp8)] = kv_cache_bytes(model, seq_len, devices, fp8)

    check = None
    ref = "indexshare/bf16_indexer"
    if ref in workloads["prefill"] and seq_len == 2_097_152 and devices == 32:
        ours = workloads["prefill"][ref]["bounds"]["H20"]["total_s"]
        check = {"design_bound_s": DESIGN_PREFILL_BOUND_S, "ours_s": ours,
                 "relative_difference": ours / DESIGN_PREFILL_BOUND_S - 1.0}

    return {
        "seq_len": seq_len, "devices": devices, "response_len": response_len, "decode_samples": decode_samples,
        "model": {"layers": base.num_hidden_layers, "full_indexer_layers_indexshare": base.indexer_types.count("full"),
                  "dense_mlp_layers": base.mlp_layer_types.count("dense"),
                  "moe_layers": base.mlp_layer_types.count("sparse")},
        "hardware": {name: dataclasses.asdict(hw) for name, hw in HARDWARE.items()},
        "assumptions": [
            "1 MAC = 2 FLOPs; tensor-core GEMM work only (norms, softmax, top-k, RoPE, MTP not counted)",
            "bound = sum over components of max(FLOPs/(devices*peak), bytes/(devices*HBM BW)): perfect "
            "sharding, balance and overlap, no communication",
            "MLA absorbed form; sparse attention 2*H*((kv_lora+rope)+kv_lora) FLOPs per (query, selected key)",
            "indexer scoring causal, full layers only: 2*H_I*d_I*sum_t t",
            "prefill: logits for the last token only; training: logits for every differentiated token",
            "training: backward = 2x forward FLOPs and bytes; indexer forward-only (discrete top-k)",
            f"train_response_only: R={response_len} response tokens on a cached prefix of seq_len-R tokens",
            f"decode_cached: {decode_samples} samples x {response_len} steps on the cached prefix "
            "(seed's 2nd candidate)",
            "fp8 indexer: indexer score GEMM at fp8 peak, fp8 q/k (+fp32 scale per key); everything else bf16",
        ],
        "workloads": workloads, "kv_cache": kv, "seed": seed, "design_check": check,
    }


def _si(x: float, unit: str = "") -> str:
    for scale, prefix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _secs(x: float) -> str:
    return f"{x:.4g} s" if x >= 1 else f"{x * 1e3:.3g} ms"


def format_report(rep: dict) -> str:
    lines = []
    out = lines.append
    out(f"GLM-5.2 roofline: seq_len={rep['seq_len']:,}, {rep['devices']} GPUs "
        f"({rep['model']['full_indexer_layers_indexshare']} of {rep['model']['layers']} layers run a full indexer "
        f"with IndexShare; {rep['model']['dense_mlp_layers']} dense MLP + {rep['model']['moe_layers']} MoE layers).")
    hw = rep["hardware"]
    out("Peaks per GPU (dense): " + "; ".join(
        f"{n} bf16 {h['bf16_flops'] / 1e12:g} / fp8 {h['fp8_flops'] / 1e12:g} TFLOP/s, "
        f"HBM {h['hbm_bandwidth'] / 1e12:g} TB/s"
        for n, h in hw.items()) + ".")
    out("Bound = sum over components of max(compute, memory) at 100% of peak: "
        "a floor assuming perfect balance/overlap.")
    out("")
    ref = "indexshare/bf16_indexer" if "indexshare/bf16_indexer" in rep["workloads"]["prefill"] else \
        next(iter(rep["workloads"]["prefill"]))
    for workload, rows in rep["workloads"].items():
        row = rows[ref]
        costs, bounds = row["costs"], row["bounds"]
        out(f"### {workload} ({ref})")
        out("")
        out("| component | layers | FLOPs/layer | FLOPs | HBM bytes | H20 bound | H200 bound |")
        out("|---|---|---|---|---|---|---|")
        for name, cc in costs["components"].items():
            if cc["layers"] == 0 or (cc["flops"] == 0 and cc["bytes"] == 0):
                continue
            b20, b200 = bounds["H20"]["components"][name], bounds["H200"]["components"][name]
            out(f"| {name} ({cc['layer_kind']}, {cc['precision']}) | {cc['layers']} | {cc['flops_per_layer']:.3e} | "
                f"{cc['flops']:.3e} | {_si(cc['bytes'], 'B')} | {_secs(b20['bound_s'])} ({b20['limited_by'][:3]}) | "
                f"{_secs(b200['bound_s'])} ({b200['limited_by'][:3]}) |")
        out(f"| **total** | | | {costs['totals']['flops']:.3e} | {_si(costs['totals']['bytes'], 'B')} | "
            f"**{_secs(bounds['H20']['total_s'])}** | **{_secs(bounds['H200']['total_s'])}** |")
        out("")
    out("### Bounds by variant (32 GPUs)")
    out("")
    out("| workload | variant | FLOPs | HBM bytes | H20 bound | H200 bound |")
    out("|---|---|---|---|---|---|")
    for workload, rows in rep["workloads"].items():
        for name, row in rows.items():
            costs, bounds = row["costs"], row["bounds"]
            out(f"| {workload} | {name} | {costs['totals']['flops']:.3e} | {_si(costs['totals']['bytes'], 'B')} | "
                f"{_secs(bounds['H20']['total_s'])} | {_secs(bounds['H200']['total_s'])} |")
    out("")
    out(f"### KV cache for {rep['seq_len']:,} tokens, sharded {rep['devices']} ways (latent bf16 on all layers)")
    out("")
    out("| variant | indexer key B/token/layer | B/token (all layers) | total | per device |")
    out("|---|---|---|---|---|")
    for name, kv in rep["kv_cache"].items():
        out(f"| {name} | {kv['indexer_key_bytes_per_token_layer']} x {kv['full_indexer_layers']} layers | "
            f"{kv['bytes_per_token']:,} | {kv['total_gib']:.1f} GiB | {kv['per_device_gib']:.2f} GiB |")
    out("")
    seed = rep["seed"]
    out(f"### Seed run ({seed['devices']}x {seed['hardware']}) vs the {seed['hardware']} bounds "
        f"on {rep['devices']} GPUs "
        f"(measured first/cached = {seed['measured_ratio']:.1f}x)")
    out("")
    out(f"| variant | prefill bound | {seed['first_candidate_s']} s / bound | bound / measured | "
        f"decode bound ({rep['decode_samples']}x{rep['response_len']}) | {seed['cached_candidate_s']} s / bound | "
        "bound ratio first/cached |")
    out("|---|---|---|---|---|---|---|")
    for name, s in seed["by_variant"].items():
        out(f"| {name} | {_secs(s['prefill_bound_s'])} | {s['first_candidate_over_bound']:.1f}x | "
            f"{s['prefill_bound_fraction_of_measured']:.1%} | {_secs(s['decode_bound_s'])} | "
            f"{s['cached_candidate_over_bound']:.0f}x | {s['bound_ratio_first_over_cached']:.0f}x |")
    if rep["design_check"]:
        dc = rep["design_check"]
        out("")
        out(f"DESIGN.md check: IndexShare bf16 prefill bound on 32x H20 = {dc['ours_s']:.1f} s vs "
            f"~{dc['design_bound_s']:.0f} s ({dc['relative_difference']:+.1%}).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--seq_len", type=int, default=2_097_152)
    parser.add_argument("--devices", type=int, default=32)
    parser.add_argument("--fp8_indexer", choices=("both", "on", "off"), default="both")
    parser.add_argument("--response_len", type=int, default=SEED_MAX_NEW_TOKENS,
                        help="response tokens (response-only training; decode steps)")
    parser.add_argument("--decode_samples", type=int, default=SEED_SAMPLES)
    args = parser.parse_args(argv)
    if args.seq_len <= 0 or args.devices <= 0 or args.response_len <= 0 or args.decode_samples <= 0:
        parser.error("--seq_len, --devices, --response_len and --decode_samples must be positive")
    if args.response_len > args.seq_len:
        parser.error(f"--response_len {args.response_len} exceeds --seq_len {args.seq_len}")
    rep = build_report(args.seq_len, args.devices, args.fp8_indexer, args.response_len, args.decode_samples)
    if args.json:
        json.dump(rep, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(format_report(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
