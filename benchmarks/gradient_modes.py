"""Step time and memory of the three GRPO gradient modes vs prompt length (benchmark, not a test).

Tiny model (float32) with rank-8 LoRA on every family; one prompt of P tokens, G responses of R
tokens. `response_only_sampler_cache` is response_only given the sampler's prefix cache (computed
before the timer, as sampling already did it); plain `response_only` includes its own prefill.
Each (mode, P) runs in its own subprocess: the jitted gradient computation is compiled
ahead of time (compile time reported separately), then run once and timed.
  xla_temp_mib  XLA's planned temporaries for the compiled step
  peak_rss_mib  the subprocess's peak resident set

    .venv/bin/python benchmarks/gradient_modes.py --prompt_lengths 2048,8192,32768
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

MODES = ("conventional", "response_only", "shared_prefix")
# response_only as the online transaction runs it: the prefix KV is the sampler's cache (already
# computed while sampling), so the step does no prefill of its own.
CACHED = "response_only_sampler_cache"


def measure(mode: str, prompt_len: int, response_len: int, group: int, cfg=None, on_compiled=None,
            build=None) -> dict:
    """One (mode, P) row. cfg: the model (default `glm52_jax.tiny()`); on_compiled: called with no
    arguments after compiling and before the timed run, its dict merged into the row; build:
    `(cfg, options) -> model` (default: `GlmMoeDsa(cfg, options, rngs=nnx.Rngs(0))`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import glm52_jax
    from glm52_jax.model.lora import LoRAConfig
    from glm52_jax.rl import gradients

    opts = glm52_jax.ModelOptions(param_dtype=jnp.float32, lora=LoRAConfig(rank=8, alpha=16.0))
    cfg = cfg or glm52_jax.tiny()
    model = build(cfg, opts) if build else glm52_jax.GlmMoeDsa(cfg, opts, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    vocab = min(cfg.vocab_size, 512)  # the same ids whatever the vocabulary (>= 512)
    prompt = jnp.asarray(rng.integers(0, vocab, prompt_len), jnp.int32)
    responses = jnp.asarray(rng.integers(0, vocab, (group, response_len)), jnp.int32)
    mask = jnp.ones((group, response_len), jnp.float32)
    old = jnp.full((group, response_len), -6.0, jnp.float32)
    adv = jnp.asarray(np.linspace(-1, 1, group), jnp.float32)
    graphdef, lora, frozen = gradients.split_lora(model)
    prefix = None
    if mode == CACHED:
        graph_all, state_all = nnx.split(model)
        prefix = jax.jit(lambda st, p: gradients.prefill(nnx.merge(graph_all, st), p, prompt_len - 1 + response_len))(
            state_all, prompt)
        prefix = jax.block_until_ready(prefix)
    args = (graphdef, lora, frozen, prompt, responses, mask, old, adv, prefix)
    kwargs = dict(mode="response_only" if mode == CACHED else mode, settings=gradients.LossSettings(), chunk=1024)
    start = time.perf_counter()
    compiled = gradients.compute_gradients_jit.lower(*args, **kwargs).compile()
    compile_s = time.perf_counter() - start
    dyn = (lora, frozen, prompt, responses, mask, old, adv, prefix)
    extra = on_compiled() if on_compiled else {}
    start = time.perf_counter()
    _, losses, logps, _ = jax.block_until_ready(compiled(*dyn))
    step_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    return {"mode": mode, "prompt_len": prompt_len, "response_len": response_len, "group": group,
            "step_seconds": round(step_s, 3), "compile_seconds": round(compile_s, 1),
            "xla_temp_mib": round(mem.temp_size_in_bytes / 2**20, 1),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "loss": float(np.sum(losses)), "logprobs": np.asarray(logps).tolist(), **extra}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt_lengths", default="2048,8192,32768")
    parser.add_argument("--response_len", type=int, default=16)
    parser.add_argument("--group", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES + (CACHED,)))
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.response_len, args.group)))
        return
    rows = {}
    for p in [int(x) for x in args.prompt_lengths.split(",")]:
        for mode in args.modes.split(","):
            res = subprocess.run([sys.executable, __file__, "--one", mode, str(p), "--response_len",
                                  str(args.response_len), "--group", str(args.group)],
                                 capture_output=True, text=True, check=True)
            rows[(mode, p)] = json.loads(res.stdout.strip().splitlines()[-1])
            print(json.dumps(rows[(mode, p)]), flush=True)
        conv = rows.get(("conventional", p), {}).get("step_seconds")
        if conv:
            ratios = {"prompt_len": p}
            for m in (CACHED, "response_only"):
                if (m, p) in rows:
                    ratios[f"conventional_over_{m}"] = conv / rows[(m, p)]["step_seconds"]
            if ("shared_prefix", p) in rows:
                ratios["shared_prefix_over_conventional"] = rows[("shared_prefix", p)]["step_seconds"] / conv
            print(json.dumps(ratios), flush=True)


if __name__ == "__main__":
    main()
