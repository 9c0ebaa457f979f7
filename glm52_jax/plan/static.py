"""The analytic part of a plan report: mesh, shapes, parameter / LoRA / cache bytes (global and per
device), and the DSA indexer FLOPs that the HLO count cannot see."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from flax import nnx

from glm52_jax.model.fp8 import Fp8Weight
from glm52_jax.model.lora import LoRA
from glm52_jax.plan.abstract import cache_bytes, tree_bytes, ways
from glm52_jax.plan.programs import PlanSetup


def _flops_per_pair(cfg) -> int:
    """The indexer's score FLOPs per (query, visible key) pair: 2 * heads * head dim per 'full' layer."""
    return 2 * cfg.index_n_heads * cfg.index_head_dim * sum(t == "full" for t in cfg.indexer_types)


def indexer_analytic(s: PlanSetup) -> dict[str, Any]:
    """Model FLOPs of the DSA indexer's q.k scores, which sit inside data-dependent key loops that
    the HLO count sees once: 2 * index_n_heads * index_head_dim per (query, visible key) pair per
    'full' layer (weighting / ReLU / top-k not counted). Global numbers; an ideal context-parallel
    split divides them by the sequence shards."""
    per_pair = _flops_per_pair(s.cfg)
    p, c, rows, r = s.prompt_tokens, s.chunk_size, s.decode_rows, s.max_new_tokens
    return {
        "flops_per_query_key_pair": per_pair,
        "prefill_total_flops": per_pair * p * (p + 1) / 2,
        "prefill_last_chunk_flops": per_pair * min(c, p) * p,
        "decode_step_flops": per_pair * rows * (p + r),
        "train_flops_per_sample": per_pair * r * (p + r),
        "seq_shards": ways(s.mesh, "seq"),
    }


def _cached_rows_pairs(rows: int, new: int, prefix: int) -> float:
    """(query, visible key) pairs of `rows` sequences that each add `new` tokens after `prefix` cached ones."""
    return rows * (new * prefix + new * (new + 1) / 2)


def program_indexer_flops(s: PlanSetup, name: str) -> float:
    """The DSA indexer's score FLOPs one call of program `name` does per device: the analytic count of
    `indexer_analytic` for that program's (query, visible key) pairs, split evenly over the sequence shards.
    The HLO count misses them (data-dependent key loops, counted once; the Pallas kernel, a custom call), so
    plan mode adds them to the program's compute. 0 for a program without attention (inventory)."""
    per_pair = _flops_per_pair(s.cfg)
    if name.startswith("probe_"):
        probe = dataclasses.replace(s, prompt_tokens=s.probe_tokens, probe_tokens=0)
        return program_indexer_flops(probe, name[len("probe_"):]) if s.probe_tokens else 0.0
    p, g, r, chunk = s.prompt_tokens, s.num_samples, s.max_new_tokens, min(s.chunk_size, s.prompt_tokens)
    whole = p * (p + 1) / 2
    if name == "prefill":
        pairs = whole if s.prefill_mode == "whole" else whole / -(-p // chunk)  # chunked: the average call
    elif name == "prefill_tail":
        pairs = _cached_rows_pairs(1, chunk, p - chunk)
    elif name == "forward":
        pairs = whole
    elif name == "decode":
        pairs = _cached_rows_pairs(s.decode_rows, r, p)
    elif name == "new_logprobs":
        pairs = _cached_rows_pairs(g, r, p)
    elif name == "train":
        pairs = {"conventional": g * (p + r) * (p + r + 1) / 2,
                 "shared_prefix": whole + _cached_rows_pairs(g, r, p)}.get(s.gradient_mode,
                                                                           _cached_rows_pairs(g, r, p))
    else:
        pairs = 0.0
    return per_pair * pairs / ways(s.mesh, "seq")


def base_weights_record(base: nnx.State, dtype, fp8) -> dict[str, Any]:
    """The report's model.base_weights: the format of the frozen base on device. FP8 (`fp8`, an
    `hf_fp8.Fp8Config`): its block and the modules left out, and how many parameters (arrays of ours) and
    elements are e4m3, with their bytes per device (values and scales); else every weight in `dtype`."""
    if fp8 is None:
        return {"format": str(dtype)}
    held = [v.get_value() for _, v in nnx.to_flat_state(base) if isinstance(v.get_value(), Fp8Weight)]
    return {"format": "float8_e4m3fn", "block": list(fp8.block), "not_convert": list(fp8.not_convert),
            "only": list(fp8.only),
            "other_dtype": str(dtype), "fp8_params": len(held), "fp8_elements": sum(math.prod(w.shape) for w in held),
            "fp8_bytes_per_device": tree_bytes(held, True)}


def static_report(s: PlanSetup, mesh_spec, lora, dtype, base_fp8=None) -> dict[str, Any]:
    """{"mesh", "shapes", "model", "indexer_analytic", "cache"} of a plan report."""
    _, lora_state, base = nnx.split(nnx.merge(s.graphdef, s.state), LoRA, ...)
    cache1, suffix = s.cache(1), s.suffix(s.decode_rows)
    # An FP8 weight is one parameter of its values' shape (its scales are not parameters, but bytes).
    shapes = [v.get_value().shape for _, v in nnx.to_flat_state(base)]
    return {
        "mesh": {"describe": mesh_spec.describe(), "axes": dict(zip(mesh_spec.axis_names, mesh_spec.shape)),
                 "devices": mesh_spec.size, "platform": jax.default_backend(),
                 "rules": [list(r) for r in mesh_spec.rules()],
                 "seq_shards": ways(s.mesh, "seq"), "expert_shards": ways(s.mesh, "experts")},
        "shapes": {"prompt_tokens": s.prompt_tokens, "max_new_tokens": s.max_new_tokens,
                   "num_samples": s.num_samples, "samples_per_request": s.decode_rows,
                   "chunk_size": s.chunk_size, "prefill_mode": s.prefill_mode,
                   "planned_capacity": s.capacity, "gradient_mode": s.gradient_mode, "dtype": str(dtype),
                   "logprob_chunk": s.logprob_chunk, "donate_cache": s.donate_cache,
                   "lora": None if lora is None else {"rank": lora.rank, "alpha": lora.alpha,
                                                      "families": sorted(lora.families),
                                                      "param_dtype": str(lora.param_dtype)},
                   "options": {k: getattr(s.opts, k) for k in ("indexer_query_block", "indexer_key_block",
                                                                "attention_query_block", "remat", "cache_dtype",
                                                                "indexer_dtype", "indexer_candidates",
                                                                "expert_dtype")}},
        "model": {"layers": s.cfg.num_hidden_layers,
                  "param_count": sum(math.prod(shape) for shape in shapes),
                  "param_bytes": tree_bytes(base, False), "param_bytes_per_device": tree_bytes(base, True),
                  "base_weights": base_weights_record(base, dtype, base_fp8),
                  "lora_count": sum(math.prod(x.shape) for x in jax.tree.leaves(lora_state)),
                  "lora_bytes": tree_bytes(lora_state, False), "lora_bytes_per_device": tree_bytes(lora_state, True)},
        "indexer_analytic": indexer_analytic(s),
        "cache": {"batch1_bytes": cache_bytes(cache1, False), "batch1_bytes_per_device": cache_bytes(cache1, True),
                  # Decode holds the one batch-1 prompt cache plus the S rows' suffixes (model/shared_cache.py).
                  "suffix_bytes": cache_bytes(suffix, False), "suffix_bytes_per_device": cache_bytes(suffix, True),
                  "decode_bytes": cache_bytes(cache1, False) + cache_bytes(suffix, False),
                  "decode_bytes_per_device": cache_bytes(cache1, True) + cache_bytes(suffix, True)},
    }
