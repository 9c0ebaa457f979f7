"""FP8 routed experts (`model.expert_dtype=fp8`, w8a8) against bf16 experts (measurement, not a test).

  wide     GLM-5.2's expert width (hidden 6144, expert intermediate 2048) on 4 random-weight experts (normal,
           std 0.02) and 512 random normal rows (as after the RMSNorm), each row on one expert: the SwiGLU output's
           relative L2 distance from the float32 experts', for bf16 experts (the yardstick: bf16's own rounding) and
           FP8 experts (rows per 128 and kernels per 128 x 128 in e4m3; the kernel's numbers, `ragged_w8a8`).
  policy   the shipped tiny policy, DAPO prompts of 256 tokens: the teacher-forced log-probability of each prompt
           token, mean |difference| from float32's for bf16 and for bf16 + FP8 experts, and 16 greedy decode steps
           per prompt (prefilled in two chunks, then the shared-prompt decode): tokens equal to bf16's / float32's.
           (Its widths, 64 and 32, are partial 128-blocks: one scale per row and per kernel block.)
  parity   GRPO LoRA gradients of shared_prefix against conventional (the parity receipt's pair) on the tiny 4-layer
           float32 model of tests/rl/test_gradients.py, within each expert dtype (rel-L2, cosine), and FP8's
           gradients against bf16's (conventional).

    .venv/bin/python -m benchmarks.experts_fp8 [--rows 0 5] [--sections wide policy parity] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def wide(rows: int = 512, experts: int = 4, hidden: int = 6144, inter: int = 2048, seed: int = 0) -> dict:
    from glm52_jax.model import fp8
    from glm52_jax.model.grouped_mlp import grouped_swiglu

    rng = np.random.default_rng(seed)
    w32 = [jnp.asarray(0.02 * rng.standard_normal(shape), jnp.float32)
           for shape in ((experts, hidden, inter), (experts, hidden, inter), (experts, inter, hidden))]
    x = jnp.asarray(rng.standard_normal((rows, hidden)), jnp.float32)
    sizes = jnp.full((experts,), rows // experts, jnp.int32)
    run = jax.jit(lambda x, *w: grouped_swiglu(x, sizes, *w, kernels="reference"))
    exact = np.asarray(run(x, *w32), np.float64)
    bf16 = [w.astype(jnp.bfloat16) for w in w32]
    variants = {"bf16": run(x.astype(jnp.bfloat16), *bf16),
                "fp8": run(x.astype(jnp.bfloat16), *(fp8.for_fp8_mma(w) for w in bf16))}
    out = {"rows": rows, "experts": experts, "hidden": hidden, "intermediate": inter}
    for name, y in variants.items():
        y = np.asarray(y, np.float64)
        out[f"{name} vs float32"] = {"rel_l2": round(float(np.linalg.norm(y - exact) / np.linalg.norm(exact)), 5),
                                     "max_abs_over_rms": round(float(np.abs(y - exact).max()
                                                                     / np.sqrt((exact ** 2).mean())), 4)}
    return out


def _variant(model, expert_dtype: str):
    from glm52_jax.model.transformer import GlmMoeDsa

    opts = dataclasses.replace(model.opts, expert_dtype=expert_dtype)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: GlmMoeDsa(model.cfg, opts, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, nnx.state(model))


def _token_logprobs(graphdef, state, ids):
    logits = nnx.merge(graphdef, state)(ids)[0, :-1]
    return jnp.take_along_axis(jax.nn.log_softmax(logits), ids[0, 1:, None], axis=-1)[:, 0]


_token_logprobs_jit = jax.jit(_token_logprobs, static_argnums=0)


def policy(rows: list[int], prompt_tokens: int = 256, steps: int = 16, chunk: int = 128) -> dict:
    from importlib import resources

    from benchmarks.indexer_fp8 import _greedy
    from glm52_jax.checkpoint.hf import load_pretrained
    from glm52_jax.dapo_data import load_rows
    from glm52_jax.model.options import ModelOptions
    from glm52_jax.rl.prompts import build_exact_prompt
    from glm52_jax.rollout.tokenizer import Tokenizer

    path = str(resources.files("glm52_jax").joinpath("assets", "tiny_policy"))
    base = {dtype: load_pretrained(path, dtype=dtype, options=ModelOptions(param_dtype=dtype, kernels="reference"))
            for dtype in (jnp.float32, jnp.bfloat16)}
    models = {"float32": base[jnp.float32], "bf16": base[jnp.bfloat16], "fp8": _variant(base[jnp.bfloat16], "fp8")}
    tok = Tokenizer.default()
    diffs, equal, total = {}, {}, 0
    for row in load_rows(select=rows):
        ids = jnp.asarray(build_exact_prompt(tok, row, prompt_tokens), jnp.int32)[None]
        logprobs = {name: np.asarray(_token_logprobs_jit(*nnx.split(m), ids), np.float64) for name, m in models.items()}
        tokens = {name: _greedy(m, ids, steps, chunk, 512) for name, m in models.items()}
        total += steps
        for name in ("bf16", "fp8"):
            diffs.setdefault(name, []).append(np.abs(logprobs[name] - logprobs["float32"]))
            for ref in ("float32", "bf16"):
                if name != ref:
                    equal[name, ref] = equal.get((name, ref), 0) + int((tokens[name] == tokens[ref]).sum())
    out = {"rows": rows, "prompt_tokens": prompt_tokens, "greedy_steps": total}
    for name, values in diffs.items():
        every = np.concatenate(values)
        out[f"{name} vs float32"] = {"logprob_abs_diff_mean": round(float(every.mean()), 5),
                                     "logprob_abs_diff_max": round(float(every.max()), 4),
                                     "greedy_tokens_equal": f"{equal[name, 'float32']} / {total}"}
    out["fp8 vs bf16"] = {"greedy_tokens_equal": f"{equal['fp8', 'bf16']} / {total}"}
    return out


def parity() -> dict:
    from benchmarks.fp8_cache import option_parity

    return option_parity("expert_dtype")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[0, 5])
    parser.add_argument("--sections", nargs="+", default=["wide", "policy", "parity"],
                        choices=["wide", "policy", "parity"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    jax.config.update("jax_default_matmul_precision", "highest")
    out = {}
    if "wide" in args.sections:
        out["wide"] = wide()
    if "policy" in args.sections:
        out["policy"] = policy(args.rows)
    if "parity" in args.sections:
        out["parity"] = parity()
    print(json.dumps(out, indent=None if args.json else 1))


if __name__ == "__main__":
    main()
