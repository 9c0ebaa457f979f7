"""FP8 indexer scoring (`model.indexer_dtype=fp8`) against bf16 scoring (measurement, not a test).

Variants: "bf16" (the default), "fp8" (e4m3 q and k after the Hadamard rotation, FP8's own top-k) and "fp8+M" (FP8
keeps M candidates per query, rescored unquantized: `model.indexer_candidates`; q and k not rotated).

  policy   the shipped tiny policy (8 indexer heads of 32, top-32), DAPO prompts of 256 tokens, the float32 model as
           the exact reference: per full indexer layer, the fraction of a variant's top-k shared with bf16's and
           with float32's (queries that see more keys than K; the same weights and prompt, each run's own
           activations), and 16 greedy decode steps per prompt (prefilled in two chunks, then the shared-prompt
           decode): tokens equal to bf16's and to float32's.
  wide     one random-weight indexer of GLM-5.2's width (hidden 6144, q_lora 2048, 32 heads of 128, top-2048; the
           model's own projections, LayerNorm and RoPE) on random normal hidden states: the last `--queries`
           positions' top-2048 over 4K-64K causal keys, each variant's overlap with bf16's (bf16's with the float32
           projections' as the yardstick), and how far down FP8's ranking bf16's top-2048 reach (the deepest rank:
           M above it loses nothing).
  depth    `wide`'s layer scored densely per chunk of keys (no streaming top-k, so 2M keys fit a CPU): how far down
           FP8's ranking bf16's top-2048 reach, and their share within FP8's top 2,048 / 3,072 / 4,096.
  parity   GRPO LoRA gradients of shared_prefix against conventional (the parity receipt's pair) on the tiny 4-layer
           float32 model of tests/rl/test_gradients.py (40-token prompt > top-32), within each indexer dtype
           (rel-L2, cosine), and FP8's gradients against bf16's (conventional).
  ptx      the scoring kernel compiled deviceless for the H20 (sm_90a, 512 queries x 8192 keys): the MMA
           instruction of each variant (bf16, FP8 with stored key scales, FP8 quantizing bf16 keys as loaded),
           with and without kernels/fp8_dot.py (needs the gpu-aot extra).

    .venv/bin/python benchmarks/indexer_fp8.py [--keys 4096 16384 65536] [--rows 0 5] [--queries 32]
        [--candidates 4096] [--sections policy wide depth parity ptx] [--no-fp8-dot] [--json]
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


def _variant(model, indexer_dtype: str, candidates: int = 0):
    from glm52_jax.model.transformer import GlmMoeDsa

    opts = dataclasses.replace(model.opts, indexer_dtype=indexer_dtype, indexer_candidates=candidates)
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

    path = str(resources.files("glm52_jax").joinpath("assets", "tiny_policy"))
    base = {dtype: load_pretrained(path, dtype=dtype, options=ModelOptions(param_dtype=dtype, kernels="reference"))
            for dtype in (jnp.float32, jnp.bfloat16)}
    k = base[jnp.float32].cfg.index_topk
    models = {"float32": base[jnp.float32], "bf16": base[jnp.bfloat16],
              "fp8": _variant(base[jnp.bfloat16], "fp8"), f"fp8+{2 * k}": _variant(base[jnp.bfloat16], "fp8", 2 * k)}
    tok = Tokenizer.default()
    overlaps, equal, total = {}, {}, 0
    for row in load_rows(select=rows):
        ids = jnp.asarray(build_exact_prompt(tok, row, prompt_tokens), jnp.int32)[None]
        topk = {name: _topk_jit(*nnx.split(m), ids) for name, m in models.items()}
        tokens = {name: _greedy(m, ids, steps, chunk, 512) for name, m in models.items()}
        total += steps
        for name in models:
            for ref in ("bf16", "float32"):
                if name == ref or (name, ref) == ("float32", "bf16"):  # one direction of the yardstick pair
                    continue
                for layer in topk[ref]:  # rows that see more than K keys
                    a, b = (np.asarray(topk[v][layer])[0, k:] for v in (ref, name))
                    overlaps.setdefault((name, ref), []).append(_overlap(a, b))
                equal[name, ref] = equal.get((name, ref), 0) + int((tokens[name] == tokens[ref]).sum())
    out = {"rows": rows, "prompt_tokens": prompt_tokens, "topk": k, "greedy_steps": total}
    for (name, ref), values in overlaps.items():
        every = np.concatenate(values)
        out[f"{name} vs {ref}"] = {"overlap_mean": round(float(every.mean()), 4),
                                   "overlap_min": round(float(every.min()), 4),
                                   "greedy_tokens_equal": f"{equal[name, ref]} / {total}"}
    return out


def wide(num_keys: int, queries: int = 64, seed: int = 0, candidates: int = 4096) -> dict:
    from glm52_jax import config
    from glm52_jax import positions as rope_lib
    from glm52_jax.kernels.indexer import quantize_e4m3
    from glm52_jax.model.indexer import Indexer, block_scores, quantize_queries, streaming_topk

    cfg = config.glm52()
    layer = Indexer(cfg, jnp.bfloat16, rngs=nnx.Rngs(seed))
    exact = nnx.merge(nnx.graphdef(layer), jax.tree.map(lambda a: a.astype(jnp.float32), nnx.state(layer)))
    table = rope_lib.rotary_table(cfg.rope, cfg.qk_rope_head_dim)
    scale = cfg.index_head_dim ** -0.5

    def variants(x, q_resid, pos):  # {variant: (q, k, w)}: float32 weights, bf16, bf16 rotated (FP8's own)
        cos, sin = (t[None] for t in rope_lib.rope_cos_sin(pos, table))
        return {"float32": exact.project(x.astype(jnp.float32), q_resid.astype(jnp.float32), cos, sin),
                "bf16": layer.project(x, q_resid, cos, sin), "fp8": layer.project(x, q_resid, cos, sin, rotate=True)}

    # Keys of every chunk (the query side is dead code there, removed by XLA); queries of the last chunk only.
    keys_of = jax.jit(lambda x, q_resid, pos: {n: v[1] for n, v in variants(x, q_resid, pos).items()})
    rng = jax.random.key(seed + 1)
    chunk = min(4096, num_keys)
    keys = {}
    for start in range(0, num_keys, chunk):  # the queries are the last chunk's last `queries` positions
        x = jax.random.normal(jax.random.fold_in(rng, start), (1, chunk, cfg.hidden_size), jnp.bfloat16)
        q_resid = jax.random.normal(jax.random.fold_in(rng, 2**30 + start), (1, chunk, cfg.q_lora_rank), jnp.bfloat16)
        pos = start + jnp.arange(chunk, dtype=jnp.int32)
        for name, k in keys_of(x, q_resid, pos).items():
            keys.setdefault(name, []).append(k)
    last = jax.jit(variants)(x[:, -queries:], q_resid[:, -queries:], pos[-queries:])
    inputs = {name: (q, w, jnp.concatenate(keys[name], axis=1)) for name, (q, _, w) in last.items()}
    del keys
    k_pos = jnp.arange(num_keys, dtype=jnp.int32)
    q_pos = k_pos[-queries:]

    def select(name, dtype, m=0):
        run = jax.jit(lambda q, w, k: streaming_topk(q, w, k, q_pos, k_pos, cfg.index_topk, scale=scale,
                                                     query_block=16, key_block=2048, indexer_dtype=dtype,
                                                     candidates=m))
        return np.asarray(run(*inputs[name]))[0]

    chosen = {"float32": select("float32", "bf16"), "bf16": select("bf16", "bf16"), "fp8": select("fp8", "fp8"),
              "fp8 unrotated": select("bf16", "fp8"), f"fp8+{candidates}": select("bf16", "fp8", candidates)}
    out = {"keys": num_keys, "queries": queries, "topk": cfg.index_topk}
    for name, idx in chosen.items():
        if name != "bf16":
            overlap = _overlap(chosen["bf16"], idx)
            out[f"{name} vs bf16"] = {"overlap_mean": round(float(overlap.mean()), 4),
                                      "overlap_min": round(float(overlap.min()), 4)}
    # How deep in FP8's ranking (unrotated, as fp8+M ranks) bf16's top-2048 sit: FP8 scores of every visible key.
    q, w, k = inputs["bf16"]
    q8, w8 = quantize_queries(q, w)
    k8, k_scale = quantize_e4m3(k)
    fp8_scores = np.asarray(jax.jit(block_scores, static_argnums=3)(q8, w8, k8.astype(jnp.float32), scale, k_scale))[0]
    fp8_scores = np.where(np.asarray(k_pos)[None, :] <= np.asarray(q_pos)[:, None], fp8_scores, -np.inf)
    rank = np.argsort(np.argsort(-fp8_scores, axis=-1, kind="stable"), axis=-1)
    bf16_top = chosen["bf16"]
    out["deepest FP8 rank of a bf16 top-k key"] = int(max(rank[i, bf16_top[i][bf16_top[i] >= 0]].max()
                                                          for i in range(queries)) + 1)
    return out


def depth(num_keys: int, queries: int = 32, seed: int = 0, chunk: int = 8192) -> dict:
    """`wide`'s layer at lengths its streaming top-k cannot reach on a CPU (2M keys): the last `queries` queries'
    bf16 and FP8 scores of every causal key, one chunk of keys at a time, then how far down FP8's ranking bf16's
    top-2048 reach, and the share of it within FP8's top M. Keys come from the layer's projections in float32
    rounded to bf16 (as the bf16 model's are, up to the rounding of its float32 accumulation); queries from its bf16
    projections (`Indexer.project`, unrotated: what `indexer_candidates` quantizes)."""
    from glm52_jax import config
    from glm52_jax import positions as rope_lib
    from glm52_jax.kernels.indexer import quantize_e4m3
    from glm52_jax.model.indexer import Indexer, block_scores, quantize_queries

    cfg = config.glm52()
    layer = Indexer(cfg, jnp.bfloat16, rngs=nnx.Rngs(seed))
    exact = nnx.merge(nnx.graphdef(layer), jax.tree.map(lambda a: a.astype(jnp.float32), nnx.state(layer)))
    table = rope_lib.rotary_table(cfg.rope, cfg.qk_rope_head_dim)
    scale, top = cfg.index_head_dim ** -0.5, cfg.index_topk
    rng = np.random.default_rng(seed + 1)

    def inputs(n):
        return (jnp.asarray(rng.standard_normal((1, n, cfg.hidden_size), np.float32)),
                jnp.asarray(rng.standard_normal((1, n, cfg.q_lora_rank), np.float32)))

    def rope(pos):
        return tuple(t[None] for t in rope_lib.rope_cos_sin(pos, table))

    q_pos = num_keys - queries + jnp.arange(queries, dtype=jnp.int32)
    x, q_resid = inputs(queries)
    q, _, w = jax.jit(layer.project)(x.astype(jnp.bfloat16), q_resid.astype(jnp.bfloat16), *rope(q_pos))
    q8, w8 = quantize_queries(q, w)

    @jax.jit
    def scores(x, q_resid, pos):  # one chunk of keys -> (bf16 scores, FP8 scores) [queries, chunk], -inf if unseen
        k = exact.project(x, q_resid, *rope(pos))[1].astype(jnp.bfloat16).astype(jnp.float32)
        k8, k_scale = quantize_e4m3(k)
        seen = pos[None, :] <= q_pos[:, None]
        return tuple(jnp.where(seen, s[0], -jnp.inf) for s in (block_scores(q, w, k, scale),
                                                                 block_scores(q8, w8, k8.astype(jnp.float32), scale,
                                                                              k_scale)))

    bf16, fp8 = [], []
    for start in range(0, num_keys, chunk):
        b, f = scores(*inputs(chunk), start + jnp.arange(chunk, dtype=jnp.int32))
        bf16.append(np.asarray(b))
        fp8.append(np.asarray(f))
    bf16, fp8 = np.concatenate(bf16, axis=1)[:, :num_keys], np.concatenate(fp8, axis=1)[:, :num_keys]
    best = np.argpartition(-bf16, top, axis=-1)[:, :top]  # bf16's top-2048 (as a set)
    order = np.sort(-fp8, axis=-1)
    rank = np.stack([np.searchsorted(order[i], -fp8[i, best[i]], side="left") + 1 for i in range(queries)])
    out = {"keys": num_keys, "queries": queries, "topk": top,
           "deepest FP8 rank of a bf16 top-k key": int(rank.max())}
    for m in (2048, 3072, 4096):
        out[f"bf16 top-k within FP8 top {m}"] = round(float((rank <= m).mean()), 5)
    return out


def parity() -> dict:
    from benchmarks.fp8_cache import option_parity

    return option_parity("indexer_dtype")


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
    parser.add_argument("--candidates", type=int, default=4096, help="wide: the fp8+M variant's M")
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
        out["wide"] = [wide(n, args.queries, candidates=args.candidates) for n in args.keys]
        print(json.dumps({"wide": out["wide"]}), flush=True)
    if "depth" in args.sections:
        out["depth"] = [depth(n, args.queries) for n in args.keys]
        print(json.dumps({"depth": out["depth"]}), flush=True)
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
