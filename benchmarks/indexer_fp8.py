"""FP8 indexer scoring (`model.indexer_dtype=fp8`) against bf16 scoring (measurement, not a test).

  policy   the shipped tiny policy in bfloat16 (8 indexer heads of 32, top-32), DAPO prompts of 256 tokens: per full
           indexer layer, the fraction of bf16 scoring's top-k that FP8 scoring also selects (queries that see more
           keys than K; the same weights and prompt, each run's own activations), and 16 greedy decode steps per
           prompt (prefilled in two chunks, then the shared-prompt decode): steps where FP8 picks bf16's token.
  wide     one random-weight indexer of GLM-5.2's width (hidden 6144, q_lora 2048, 32 heads of 128, top-2048; the
           model's own projections, LayerNorm and RoPE in bfloat16) on random normal hidden states: the last
           `--queries` positions' top-2048 over 4K-64K causal keys, FP8 against bf16.
  parity   GRPO LoRA gradients of shared_prefix against conventional (the parity receipt's pair) on the tiny 4-layer
           float32 model of tests/rl/test_gradients.py (40-token prompt > top-32), within each indexer dtype
           (rel-L2, cosine), and FP8's gradients against bf16's (conventional).
  ptx      the scoring kernel compiled deviceless for the H20 (sm_90a, 512 queries x 8192 keys): the MMA
           instruction of each variant (bf16, FP8 with stored key scales, FP8 quantizing bf16 keys as loaded),
           with and without kernels/fp8_dot.py (needs the gpu-aot extra).

    .venv/bin/python benchmarks/indexer_fp8.py [--keys 4096 16384 65536] [--rows 0 5] [--queries 32]
        [--sections policy wide parity ptx] [--no-fp8-dot] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def _overlap(base: np.ndarray, other: np.ndarray) -> np.ndarray:
    """Per row of `[N, K]` index lists: |base & other| / |base| (INVALID slots ignored)."""
    out = []
    for a, b in zip(base, other, strict=True):
        a, b = set(a[a >= 0].tolist()), set(b[b >= 0].tolist())
        out.append(len(a & b) / max(len(a), 1))
    return np.array(out)


def _variant(model, indexer_dtype: str):
    from glm52_jax.model.transformer import GlmMoeDsa

    opts = dataclasses.replace(model.opts, indexer_dtype=indexer_dtype)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: GlmMoeDsa(model.cfg, opts, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, nnx.state(model))


def _greedy(model, ids, steps: int, chunk: int, capacity: int) -> np.ndarray:
    """Greedy tokens [steps]: `ids` prefilled in chunks, then the shared-prompt decode (benchmarks/fp8_cache.py's
    jitted loop; the indexer dtype is part of the model's graph)."""
    from benchmarks.fp8_cache import decode_logits_jit

    graphdef, state = nnx.split(model)
    none = jnp.zeros((steps,), jnp.int32)
    return np.asarray(decode_logits_jit(graphdef, state, ids, none, False, cache_dtype="auto", chunk=chunk,
                                        capacity=capacity)[1])


def _topk_of(graphdef, state, ids):
    return nnx.merge(graphdef, state).hidden_states(ids, return_topk=True)[1]


_topk_jit = jax.jit(_topk_of, static_argnums=0)


def policy(rows: list[int], prompt_tokens: int = 256, steps: int = 16, chunk: int = 128) -> dict:
    from importlib import resources

    from glm52_jax.checkpoint.hf import load_pretrained
    from glm52_jax.dapo_data import load_rows
    from glm52_jax.model.options import ModelOptions
    from glm52_jax.rl.prompts import build_exact_prompt
    from glm52_jax.rollout.tokenizer import Tokenizer

    path = resources.files("glm52_jax").joinpath("assets", "tiny_policy")
    opts = ModelOptions(param_dtype=jnp.bfloat16, kernels="reference")
    base = load_pretrained(str(path), dtype=jnp.bfloat16, options=opts)
    models = {d: _variant(base, d) for d in ("bf16", "fp8")}
    k = base.cfg.index_topk
    tok = Tokenizer.default()
    overlaps, agree, prefix, total = {}, 0, 0, 0
    for row in load_rows(select=rows):
        ids = jnp.asarray(build_exact_prompt(tok, row, prompt_tokens), jnp.int32)[None]
        topk = {d: _topk_jit(*nnx.split(m), ids) for d, m in models.items()}
        for layer in topk["bf16"]:
            a, b = (np.asarray(topk[d][layer])[0, k:] for d in ("bf16", "fp8"))  # rows that see more than K keys
            overlaps.setdefault(layer, []).append(_overlap(a, b))
        tokens = {d: _greedy(m, ids, steps, chunk, 512) for d, m in models.items()}
        same = tokens["bf16"] == tokens["fp8"]
        agree += int(same.sum())
        prefix += int(np.argmin(same)) if not same.all() else steps
        total += steps
    per_layer = {str(layer): round(float(np.concatenate(v).mean()), 4) for layer, v in overlaps.items()}
    every = np.concatenate([np.concatenate(v) for v in overlaps.values()])
    return {"rows": rows, "prompt_tokens": prompt_tokens, "topk": k, "overlap_per_full_layer": per_layer,
            "overlap_mean": round(float(every.mean()), 4), "overlap_min": round(float(every.min()), 4),
            "greedy_tokens_equal": f"{agree} / {total}", "greedy_common_prefix": f"{prefix} / {total}"}


def wide(num_keys: int, queries: int = 64, seed: int = 0) -> dict:
    from glm52_jax import config
    from glm52_jax import positions as rope_lib
    from glm52_jax.model.indexer import Indexer, streaming_topk
    from glm52_jax.model.layers import project

    cfg = config.glm52()
    layer = Indexer(cfg, jnp.bfloat16, rngs=nnx.Rngs(seed))
    table = rope_lib.rotary_table(cfg.rope, cfg.qk_rope_head_dim)
    r = layer.rope_dim

    @jax.jit
    def keys(x, pos):  # the indexer's key path (Indexer.project without the queries): [1,c,D] -> [1,c,I]
        cos, sin = (t[None] for t in rope_lib.rope_cos_sin(pos, table))
        k = layer.k_norm(project(x, layer.wk, "bsd,di->bsi"))
        k_rot = rope_lib.apply_interleaved_rope(k[..., :r], cos, sin)
        return jnp.concatenate([k_rot, k[..., r:]], axis=-1).astype(jnp.float32)

    rng = jax.random.key(seed + 1)
    chunk = 4096
    ks = []
    for start in range(0, num_keys, chunk):
        x = jax.random.normal(jax.random.fold_in(rng, start), (1, chunk, cfg.hidden_size), jnp.bfloat16)
        ks.append(keys(x, start + jnp.arange(chunk, dtype=jnp.int32)))
    k = jnp.concatenate(ks, axis=1)[:, :num_keys]
    q_pos = num_keys - queries + jnp.arange(queries, dtype=jnp.int32)
    x = jax.random.normal(jax.random.fold_in(rng, num_keys), (1, queries, cfg.hidden_size), jnp.bfloat16)
    q_resid = jax.random.normal(jax.random.fold_in(rng, 2**31 - 1), (1, queries, cfg.q_lora_rank), jnp.bfloat16)
    cos, sin = (t[None] for t in rope_lib.rope_cos_sin(q_pos, table))
    q, _, w = layer.project(x, q_resid, cos, sin)
    k_pos = jnp.arange(num_keys, dtype=jnp.int32)
    run = jax.jit(lambda dtype: streaming_topk(q, w, k, q_pos, k_pos, cfg.index_topk, scale=cfg.index_head_dim ** -0.5,
                                               query_block=16, key_block=2048, indexer_dtype=dtype),
                  static_argnums=0)
    base, fp8 = (np.asarray(run(d))[0] for d in ("bf16", "fp8"))
    overlap = _overlap(base, fp8)
    return {"keys": num_keys, "queries": queries, "topk": cfg.index_topk,
            "overlap_mean": round(float(overlap.mean()), 4), "overlap_min": round(float(overlap.min()), 4)}


def parity() -> dict:
    from benchmarks.fp8_cache import flat_grads, variant_gradients
    from glm52_jax.model.lora import LoRAConfig
    from glm52_jax.model.options import ModelOptions

    options = {d: ModelOptions(param_dtype=jnp.float32, indexer_query_block=16, indexer_key_block=16,
                               attention_query_block=8, lora=LoRAConfig(rank=4, alpha=8.0), indexer_dtype=d)
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


def ptx() -> dict:
    """The MMA instructions of the scoring kernel's variants compiled for the H20, with and without fp8_dot."""
    from glm52_jax.kernels import aot, fp8_dot
    from glm52_jax.kernels import indexer as kernel

    if aot.missing() is not None:
        return {"skipped": aot.missing()}
    sd = jax.ShapeDtypeStruct
    heads, dim = 32, 128
    out = {}
    for name, q_dt, k_dt, extra in (("bf16", jnp.bfloat16, jnp.bfloat16, {}),
                                    ("fp8_scaled_keys", kernel.FP8, kernel.FP8, {"k_scale": True}),
                                    ("fp8_quantize_keys", kernel.FP8, jnp.bfloat16, {"quantize_keys": True})):
        def scores(q, w, q_pos, k, k_pos, k_scale, extra=extra):
            kw = {"k_scale": k_scale} if "k_scale" in extra else {}
            if "quantize_keys" in extra:
                kw = {"quantize_keys": True, "compute_dtype": kernel.FP8}
            return kernel.index_scores(q, w, q_pos, k, k_pos, jnp.int32(0), 8192, scale=dim ** -0.5, **kw)

        args = (sd((1, 512, heads, dim), q_dt), sd((1, 512, heads), jnp.float32), sd((512,), jnp.int32),
                sd((1, 8192, dim), k_dt), sd((8192,), jnp.int32), sd((1, 8192), jnp.float32))
        res = next(v for n, v in aot.compile_for_gpu(scores, *args, target="h20").kernels.items() if "index" in n)
        out[name] = {"mma": list(res.mma), "shared_memory": res.shared_memory, "registers": res.registers,
                     "spill_bytes": res.spill_bytes}
    del fp8_dot  # installed by index_scores for e4m3 dots; "without" is measured by the caller's --no-fp8-dot run
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--queries", type=int, default=32)
    parser.add_argument("--rows", type=int, nargs="+", default=[0, 5])
    parser.add_argument("--sections", nargs="+", default=["policy", "wide", "parity", "ptx"])
    parser.add_argument("--no-fp8-dot", action="store_true", help="ptx: without kernels/fp8_dot.py's rule")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.no_fp8_dot:
        from glm52_jax.kernels import fp8_dot

        fp8_dot.install = lambda: False
    out = {}
    if "policy" in args.sections:
        out["policy"] = policy(args.rows)
        print(json.dumps({"policy": out["policy"]}), flush=True)
    if "wide" in args.sections:
        out["wide"] = [wide(n, args.queries) for n in args.keys]
        print(json.dumps({"wide": out["wide"]}), flush=True)
    if "parity" in args.sections:
        out["parity"] = parity()
        print(json.dumps({"parity": out["parity"]}), flush=True)
    if "ptx" in args.sections:
        out["ptx"] = ptx()
        print(json.dumps({"ptx": out["ptx"]}), flush=True)
    if args.json:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
