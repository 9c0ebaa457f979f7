"""Second candidate on a cached prefix vs the first candidate (benchmark, not a test).

Two exact-N-token prompts that share the filler and differ in the DAPO question at the end (as in
the seed's bounded candidate search). The first runs cold; the second reuses the prefix cache.

    .venv/bin/python benchmarks/prefix_cache.py --prompt_tokens 16384
"""

from __future__ import annotations

import argparse
import json
import time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt_tokens", type=int, default=16384)
    parser.add_argument("--chunk_size", type=int, default=2048)
    parser.add_argument("--max_new_tokens", type=int, default=8)
    args = parser.parse_args()

    import jax.numpy as jnp
    from flax import nnx

    import glm52_jax
    from glm52_jax.rl.data import load_rows
    from glm52_jax.rl.prompts import build_exact_prompt
    from glm52_jax.rollout.sampler import Sampler, SamplingParams
    from glm52_jax.rollout.tokenizer import Tokenizer

    tok = Tokenizer.default()
    rows = load_rows()
    prompts = [build_exact_prompt(tok, row, args.prompt_tokens) for row in rows[:3]]
    model = glm52_jax.GlmMoeDsa(glm52_jax.tiny(), glm52_jax.ModelOptions(param_dtype=jnp.float32),
                                rngs=nnx.Rngs(0))
    sampler = Sampler(model, chunk_size=args.chunk_size, progress=lambda *a: None)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, num_samples=2, seed=0)
    sampler.sample(prompts[0], params)  # compile everything once so neither timed run pays for it
    sampler.prefix_cache.clear()
    timings = []
    for p in prompts[1:]:
        start = time.perf_counter()
        res = sampler.sample(p, params)
        timings.append({"seconds": time.perf_counter() - start, "prefix_hit_tokens": res.prefix_hit_tokens,
                        "prefill_seconds": res.prefill_seconds})
    first, second = timings
    print(json.dumps({"prompt_tokens": args.prompt_tokens, "first": first, "second": second,
                      "speedup": first["seconds"] / second["seconds"]}))


if __name__ == "__main__":
    main()
