"""Peak memory of a tiny-model forward vs sequence length (benchmark, not a test).

Each length runs in its own subprocess so peak RSS is per length. Two numbers per length:
  xla_temp_mib  XLA's planned temporary buffers for the jitted forward (compile-time, exact)
  peak_rss_mib  the subprocess's peak resident set (includes the JAX runtime's fixed cost)
A quadratic ([S, T]) path would give a 32K/8K ratio of ~16; linear gives ~4.

    .venv/bin/python benchmarks/dsa_memory.py --lengths 8192,16384,32768
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def measure(seq_len: int, index_topk: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import glm52_jax

    cfg = glm52_jax.tiny(index_topk=index_topk)
    model = glm52_jax.GlmMoeDsa(cfg, glm52_jax.ModelOptions(param_dtype=jnp.float32), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def forward(state, ids):  # hidden states: the logits head is not part of the attention question
        return nnx.merge(graphdef, state).hidden_states(ids)

    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, seq_len)), jnp.int32)
    compiled = jax.jit(forward).lower(state, ids).compile()
    mem = compiled.memory_analysis()
    start = time.perf_counter()
    out = compiled(state, ids)
    out.block_until_ready()
    seconds = time.perf_counter() - start
    return {
        "seq_len": seq_len, "index_topk": index_topk,
        "xla_temp_mib": mem.temp_size_in_bytes / 2**20,
        "xla_output_mib": mem.output_size_in_bytes / 2**20,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "forward_seconds": round(seconds, 2),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="8192,16384,32768")
    parser.add_argument("--index_topk", type=int, default=32)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.index_topk)))
        return
    rows = []
    for n in [int(x) for x in args.lengths.split(",")]:
        res = subprocess.run([sys.executable, __file__, "--one", str(n), "--index_topk", str(args.index_topk)],
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    first, last = rows[0], rows[-1]
    print(json.dumps({
        "ratio_len": last["seq_len"] / first["seq_len"],
        "ratio_xla_temp": last["xla_temp_mib"] / first["xla_temp_mib"],
        "ratio_peak_rss": last["peak_rss_mib"] / first["peak_rss_mib"],
    }))


if __name__ == "__main__":
    main()
