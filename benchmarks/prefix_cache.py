"""Second candidate on a cached prefix vs the first candidate (benchmark, not a test).

Two exact-N-token prompts that share the filler and differ in the DAPO question at the end (as in
the seed's bounded candidate search). The first runs cold; the second reuses the prefix cache.

    .venv/bin/python benchmarks/prefix_cache.py --prompt_tokens 16384
"""

from __future__ import annotations

import argparse
import json
import time


def measure(prompt_tokens: int, chunk_size: int = 2048, max_new_tokens: int = 8, cfg=None, build=None) -> dict:
    """First (cold) vs second (prefix-cached) candidate; cfg: the model (default `glm52_jax.tiny()`);
    build: `(cfg, options) -> model` (default: `GlmMoeDsa(cfg, options, rngs=nnx.Rngs(0))`)."""
    import jax.numpy as jnp
    from flax import nnx

    import glm52_jax
    from glm52_jax.dapo_data import load_rows
    from glm52_jax.rl.prompts import build_exact_prompt
    from glm52_jax.rollout.sampler import Sampler, SamplingParams
    from glm52_jax.rollout.tokenizer import Tokenizer

    tok = Tokenizer.default()
    rows = load_rows()
    prompts = [build_exact_prompt(tok, row, prompt_tokens) for row in rows[:3]]
    cfg = cfg or glm52_jax.tiny()
    opts = glm52_jax.ModelOptions(param_dtype=jnp.float32)
    model = build(cfg, opts) if build else glm52_jax.GlmMoeDsa(cfg, opts, rngs=nnx.Rngs(0))
    sampler = Sampler(model, chunk_size=chunk_size, progress=lambda *a: None)
    params = SamplingParams(max_new_tokens=max_new_tokens, num_samples=2, seed=0)
    sampler.sample(prompts[0], params)  # compile everything once so neither timed run pays for it
    sampler.prefix_cache.clear()
    timings = []
    for p in prompts[1:]:
        start = time.perf_counter()
        res = sampler.sample(p, params)
        timings.append({"seconds": time.perf_counter() - start, "prefix_hit_tokens": res.prefix_hit_tokens,
                        "prefill_seconds": res.prefill_seconds})
    first, second = timings
    return {"prompt_tokens": prompt_tokens, "chunk_size": chunk_size, "max_new_tokens": max_new_tokens,
            "first": first, "second": second, "speedup": first["seconds"] / second["seconds"]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt_tokens", type=int, default=16384)
    parser.add_argument("--chunk_size", type=int, default=2048)
    parser.add_argument("--max_new_tokens", type=int, default=8)
    args = parser.parse_args()
    print(json.dumps(measure(args.prompt_tokens, args.chunk_size, args.max_new_tokens)))


if __name__ == "__main__":
    main()
