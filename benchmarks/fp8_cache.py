"""FP8 decode cache (`model.cache_dtype=float8_e4m3fn`) against the model-dtype cache (measurement, not a test).

  overlap    the indexer's top-k over a cache's keys on random inputs (GLM-5.2's indexer: 32 heads of 128, top-2048,
             decode queries after every key): the fraction of the bf16 cache's top-k (the real run's) that the FP8
             cache's (e4m3 rows of the same bf16 keys, one scale per row) also selects; also against float32 keys.
  decode     the shipped tiny policy (float32), a 256-token DAPO prompt prefilled in two chunks, 16 greedy steps per
             bundled row: how many greedy tokens the FP8 cache's free-running decode shares with the float32
             cache's, and the largest logit change teacher-forced by the float32 run's tokens (max |dlogit| / max
             |logit|), at the policy's index_topk (32) and with every key selected (index_topk 512).
  bytes      GLM-5.2's batch-1 prompt cache at 2M tokens (+16 new) and the 8 samples' suffixes of 16, per device on
             folded=8 (one 8-GPU node), as plan mode's abstract caches count them: auto (bf16) against FP8.
  gradients  GRPO LoRA gradients on the tiny 4-layer float32 model of tests/rl/test_gradients.py: response_only
             (the FP8 prefix cache is a constant) and shared_prefix (its differentiated prefix keeps the model
             dtype whatever cache_dtype says) with the FP8 option against "auto".

    .venv/bin/python benchmarks/fp8_cache.py [--keys 3072 4096 8192 16384] [--rows 0 5 6 15 17 19] [--json]

tests/model/test_cache_fp8.py uses `decode_logits`, `compare_decodes` and `variant`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

FP8 = "float8_e4m3fn"


def variant(model, index_topk: int, cache_dtype: str = "auto"):
    """The same weights with another `index_topk` and `ModelOptions.cache_dtype` (no parameter depends on them)."""
    from glm52_jax.model.transformer import GlmMoeDsa

    cfg = dataclasses.replace(model.cfg, index_topk=index_topk)
    opts = dataclasses.replace(model.opts, cache_dtype=cache_dtype)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: GlmMoeDsa(cfg, opts, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, nnx.state(model))


def decode_logits(graphdef, state, ids, forced, use_forced, *, cache_dtype: str, chunk: int, capacity: int):
    """`ids: [1,P]` prefilled in chunks of `chunk` (each later chunk reads the earlier ones from the cache), then
    len(forced) steps against the shared prompt and a one-row suffix: each step's logits [V] and its token
    (greedy, or `forced[t]` where `use_forced`)."""
    model = nnx.merge(graphdef, state)
    cache = model.init_cache(1, capacity, cache_dtype=cache_dtype)
    for start in range(0, ids.shape[1], chunk):
        h, cache = model.forward_cached(ids[:, start:start + chunk], cache)

    def step(carry, t):
        suffix, h = carry
        logits = model.logits(h)[0]
        token = jnp.where(use_forced, forced[t], jnp.argmax(logits).astype(jnp.int32))
        h, suffix = model.forward_shared(token[None, None], cache, suffix)
        return (suffix, h[:, 0]), (logits, token)

    suffix = model.init_suffix(1, forced.shape[0], cache_dtype=cache_dtype)
    _, (logits, tokens) = jax.lax.scan(step, (suffix, h[:, -1]), jnp.arange(forced.shape[0]))
    return logits, tokens


decode_logits_jit = jax.jit(decode_logits, static_argnames=("graphdef", "cache_dtype", "chunk", "capacity"))


def compare_decodes(model, ids, steps: int, chunk: int, capacity: int):
    """(per-step max |logit_fp8 - logit_f32| / max |logit_f32| with the FP8 run teacher-forced by the float32
    run's greedy tokens [steps], greedy steps on which the free-running FP8 decode picks the float32 run's token,
    the free-running FP8 decode's tokens [steps])."""
    graphdef, state = nnx.split(model)
    kw = dict(chunk=chunk, capacity=capacity)
    none = jnp.zeros((steps,), jnp.int32)
    want_logits, want_tokens = decode_logits_jit(graphdef, state, ids, none, False, cache_dtype="auto", **kw)
    got_logits, _ = decode_logits_jit(graphdef, state, ids, want_tokens, True, cache_dtype=FP8, **kw)
    _, free_tokens = decode_logits_jit(graphdef, state, ids, none, False, cache_dtype=FP8, **kw)
    want, got = np.asarray(want_logits), np.asarray(got_logits)
    ratio = np.abs(got - want).max(-1) / np.abs(want).max(-1)
    return ratio, int((np.asarray(free_tokens) == np.asarray(want_tokens)).sum()), np.asarray(free_tokens)


def topk_overlap(num_keys: int, topk: int = 2048, queries: int = 16, heads: int = 32, dim: int = 128,
                 seed: int = 0) -> dict:
    """Top-k overlap of FP8 keys against bf16 and float32 keys (`cached_topk`, the jnp reference)."""
    from glm52_jax.model import cache_fp8
    from glm52_jax.model.indexer import cached_topk

    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (1, queries, heads, dim), jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
    w = jax.random.normal(ks[1], (1, queries, heads), jnp.float32) * heads ** -0.5
    keys = jax.random.normal(ks[2], (1, 1, 1, num_keys, dim), jnp.float32)
    bf16 = keys.astype(jnp.bfloat16)
    values, scales = cache_fp8.quantize_rows(bf16)
    q_pos = num_keys + jnp.arange(queries, dtype=jnp.int32)
    run = jax.jit(lambda stack, key_scales: cached_topk(
        q, w, stack, (0, 0), q_pos, jnp.asarray(num_keys, jnp.int32), topk, scale=dim ** -0.5, query_block=queries,
        key_block=512, key_scales=key_scales)[1])
    fp8 = np.asarray(run(values, scales))[0]
    out = {"keys": num_keys, "topk": min(topk, num_keys)}
    for name, stack in (("bf16", bf16), ("float32", keys)):
        base = np.asarray(run(stack, None))[0]
        overlap = np.array([len(set(a) & set(b)) / len(a) for a, b in zip(base, fp8, strict=True)])
        out[f"vs_{name}"] = {"mean": round(float(overlap.mean()), 4), "min": round(float(overlap.min()), 4)}
    return out


def policy_decodes(rows: list[int], steps: int = 16, prompt_tokens: int = 256, chunk: int = 128) -> dict:
    """Greedy-token agreement and logit change of the FP8 cache on the shipped tiny policy, per row."""
    from importlib import resources

    from glm52_jax.checkpoint.hf import load_pretrained
    from glm52_jax.dapo_data import load_rows
    from glm52_jax.model.options import ModelOptions
    from glm52_jax.rl.prompts import build_exact_prompt
    from glm52_jax.rollout.tokenizer import Tokenizer

    path = resources.files("glm52_jax").joinpath("assets", "tiny_policy")
    policy = load_pretrained(str(path), dtype=jnp.float32, options=ModelOptions(param_dtype=jnp.float32))
    tok = Tokenizer.default()
    capacity = 512
    out = {}
    for index_topk in (policy.cfg.index_topk, capacity):
        model = variant(policy, index_topk)
        per_row = []
        for row in load_rows(select=rows):
            ids = jnp.asarray(build_exact_prompt(tok, row, prompt_tokens), jnp.int32)[None]
            ratio, agree, _ = compare_decodes(model, ids, steps, chunk, capacity)
            per_row.append({"agree": agree, "max_logit_ratio": round(float(ratio.max()), 4)})
        out[f"index_topk_{index_topk}"] = {
            "rows": dict(zip(map(str, rows), per_row, strict=True)),
            "agree": f"{sum(r['agree'] for r in per_row)} / {steps * len(rows)}",
            "max_logit_ratio": max(r["max_logit_ratio"] for r in per_row)}
    return out


def cache_bytes_2m(devices: int = 8) -> dict:
    """Per-device bytes of the 2M prompt cache and the decode's suffixes, bf16 against FP8 (no arrays made)."""
    from glm52_jax import config
    from glm52_jax.model.kv_cache import slot_capacity
    from glm52_jax.parallel.mesh import MeshSpec
    from glm52_jax.parallel.rules import axis_rules
    from glm52_jax.plan.abstract import abstract_cache, abstract_suffix, cache_bytes, model_segments

    cfg, spec = config.glm52(), MeshSpec(context=devices, expert=devices, folded=True)
    mesh = spec.make(jax.devices()[:devices])
    capacity = slot_capacity(2_097_152 + 16, 256, devices)
    out = {"slots": capacity, "devices": devices}
    with axis_rules(spec.rules()):
        for cache_dtype in ("auto", FP8):
            prompt = abstract_cache(cfg, model_segments(cfg), 1, capacity, jnp.bfloat16, mesh, cache_dtype)
            suffix = abstract_suffix(cfg, model_segments(cfg), 8, 16, jnp.bfloat16, mesh, cache_dtype)
            out[cache_dtype] = {"prompt_gb_per_device": round(cache_bytes(prompt, True) / 1e9, 3),
                                "suffix_mb_per_device": round(cache_bytes(suffix, True) / 1e6, 2)}
    return out


def gradient_case():
    """The small gradient case the FP8 benchmarks compare on (this one and indexer_fp8.py): a 4-layer tiny model with
    IndexShare, a 40-token prompt and 2 responses of 6 tokens. Returns (cfg, batch for lora_gradients)."""
    from glm52_jax import config

    cfg = config.tiny(num_hidden_layers=4, indexer_types=("full", "full", "shared", "shared"))
    rng = np.random.default_rng(0)
    prompt, responses = rng.integers(0, 512, 40).astype(np.int32), rng.integers(0, 512, (2, 6)).astype(np.int32)
    batch = dict(prompt=prompt, responses=responses, response_mask=np.ones((2, 6), np.float32),
                 old_logprobs=np.zeros((2, 6), np.float32), advantages=np.array([1.0, -0.7], np.float32))
    return cfg, batch


def variant_gradients(options: dict, modes: tuple[str, ...]) -> dict:
    """{(variant, mode): lora_gradients result} on `gradient_case()`, one model per variant of `options`
    ({name: ModelOptions}), every adapter (A and B) the same random values in each, so every adapter has a gradient."""
    from glm52_jax.model.lora import LoRA
    from glm52_jax.model.transformer import GlmMoeDsa
    from glm52_jax.rl.gradients import lora_gradients

    cfg, batch = gradient_case()
    results = {}
    for name, opts in options.items():
        model = GlmMoeDsa(cfg, opts, rngs=nnx.Rngs(0))
        leaves, treedef = jax.tree.flatten(nnx.state(model, LoRA))
        nnx.update(model, jax.tree.unflatten(treedef, [jax.random.normal(jax.random.key(i), x.shape, x.dtype) * 0.05
                                                       for i, x in enumerate(leaves)]))
        for mode in modes:
            results[name, mode] = lora_gradients(model, **batch, mode=mode)
    return results


def flat_grads(result) -> np.ndarray:
    """A lora_gradients result's gradients as one float64 vector."""
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(result.grads)])


def option_parity(field: str) -> dict:
    """GRPO LoRA gradients of shared_prefix against conventional (the parity receipt's pair) on `gradient_case`'s
    float32 model, within each value "bf16" / "fp8" of the `ModelOptions` field (rel-L2, cosine), and the "fp8"
    model's conventional gradients against "bf16"'s (benchmarks/indexer_fp8.py, benchmarks/experts_fp8.py)."""
    from glm52_jax.model.lora import LoRAConfig
    from glm52_jax.model.options import ModelOptions

    options = {d: ModelOptions(param_dtype=jnp.float32, indexer_query_block=16, indexer_key_block=16,
                               attention_query_block=8, lora=LoRAConfig(rank=4, alpha=8.0), **{field: d})
               for d in ("bf16", "fp8")}
    grads = {key: flat_grads(result)
             for key, result in variant_gradients(options, ("conventional", "shared_prefix")).items()}

    def compare(a, b):
        return {"rel_l2": float(np.linalg.norm(a - b) / np.linalg.norm(b)),
                "cosine": round(float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)), 9)}

    out = {f"{d}: shared_prefix vs conventional": compare(grads[d, "shared_prefix"], grads[d, "conventional"])
           for d in ("bf16", "fp8")}
    out["conventional: fp8 vs bf16"] = compare(grads["fp8", "conventional"], grads["bf16", "conventional"])
    return out


def gradient_agreement() -> dict:
    """LoRA gradients (cosine, relative L2) and new log-probs (max |d|) of the FP8 option against "auto"."""
    from glm52_jax.model.lora import LoRAConfig
    from glm52_jax.model.options import ModelOptions

    modes = ("response_only", "shared_prefix")
    results = variant_gradients({d: ModelOptions(param_dtype=jnp.float32, lora=LoRAConfig(rank=4, alpha=8.0),
                                                 cache_dtype=d) for d in ("auto", FP8)}, modes)
    out = {}
    for mode in modes:
        a, b = (flat_grads(results[d, mode]) for d in ("auto", FP8))
        logp = np.abs(np.asarray(results["auto", mode].logprobs) - np.asarray(results[FP8, mode].logprobs)).max()
        out[mode] = {"cosine": round(float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)), 6),
                     "rel_l2": float(np.linalg.norm(a - b) / np.linalg.norm(a)), "logprob_abs": float(logp)}
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", type=int, nargs="+", default=[3072, 4096, 8192, 16384])
    parser.add_argument("--rows", type=int, nargs="+", default=[0, 5, 6, 15, 17, 19])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from glm52_jax.plan.devices import ensure_virtual_devices

    ensure_virtual_devices(8)
    jax.config.update("jax_default_matmul_precision", "highest")
    report = {"bytes": cache_bytes_2m(), "overlap": [topk_overlap(n) for n in args.keys],
              "decode": policy_decodes(args.rows), "gradients": gradient_agreement()}
    print(json.dumps(report, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
