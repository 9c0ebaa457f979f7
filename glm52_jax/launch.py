"""Entry point. Until the online-GRPO launcher lands this runs a forward of a model:
the embedded tiny default (seeded random weights), or an HF checkpoint with --checkpoint.

    python -m glm52_jax.launch                      # tiny model, laptop CPU
    python -m glm52_jax.launch --checkpoint=/ckpt/GLM-5.2 --seq_len=4096
"""

from __future__ import annotations

import json
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "HF checkpoint directory; default: seeded random tiny model")
flags.DEFINE_integer("seq_len", 256, "tokens per sequence", lower_bound=2)
flags.DEFINE_integer("batch", 1, "sequences", lower_bound=1)
flags.DEFINE_integer("seed", 0, "seed for weights (tiny) and input tokens")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "parameter / activation dtype")


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import glm52_jax

    dtype = jnp.dtype(FLAGS.dtype)
    if FLAGS.checkpoint:
        model = glm52_jax.load_pretrained(FLAGS.checkpoint, dtype=dtype)
    else:
        cfg = glm52_jax.tiny().with_env_rope_scaling()
        model = glm52_jax.GlmMoeDsa(cfg, glm52_jax.ModelOptions(param_dtype=dtype), rngs=nnx.Rngs(FLAGS.seed))
    cfg = model.cfg
    ids = np.random.default_rng(FLAGS.seed).integers(0, cfg.vocab_size, (FLAGS.batch, FLAGS.seq_len))
    graphdef, state = nnx.split(model)

    @jax.jit
    def logprobs(state, ids):
        return glm52_jax.token_logprobs(nnx.merge(graphdef, state), ids)

    start = time.perf_counter()
    out = np.asarray(logprobs(state, jnp.asarray(ids, jnp.int32)))
    seconds = time.perf_counter() - start
    if not np.isfinite(out).all():
        raise SystemExit("non-finite log-probs")
    print(json.dumps({
        "model": FLAGS.checkpoint or "tiny (random)", "layers": cfg.num_hidden_layers,
        "full_indexer_layers": cfg.indexer_types.count("full"), "batch": FLAGS.batch, "seq_len": FLAGS.seq_len,
        "dtype": FLAGS.dtype, "mean_token_logprob": float(out.mean()), "seconds_incl_compile": round(seconds, 2),
    }))


if __name__ == "__main__":
    app.run(main)
