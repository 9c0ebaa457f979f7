"""Sample continuations from a checkpoint and print them as JSON.

    python -m glm52_jax.generate --checkpoint DIR (--prompt TEXT | --prompt_ids 1,2,3) \
        --max_new_tokens N --temperature T --top_p P --seed S [--num_samples G] [--chat]

`--prompt` needs a `tokenizer.json` in DIR (or `--tokenizer PATH`; the shipped glm52_jax/assets/tiny_policy
uses the package's tokenizer); `--chat` wraps it in the chat
template the tokenizer's directory or DIR ships (`chat_template.jinja` / tokenizer_config.json), else
the hand-written GLM layout. A random tiny model works too: point --checkpoint at a `save_pretrained` directory.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "HF checkpoint directory (config.json + safetensors)")
flags.DEFINE_string("prompt", None, "prompt text (needs a tokenizer)")
flags.DEFINE_string("prompt_ids", None, "comma-separated prompt token ids")
flags.DEFINE_string("tokenizer", None, "tokenizer.json path; default: DIR/tokenizer.json when present")
flags.DEFINE_bool("chat", False, "format --prompt as one user turn of the chat template")
flags.DEFINE_integer("max_new_tokens", 16, "tokens to generate per sample")
flags.DEFINE_float("temperature", 1.0, "0 = greedy")
flags.DEFINE_float("top_p", 1.0, "nucleus mass in (0, 1]")
flags.DEFINE_integer("top_k", 0, "0 = off")
flags.DEFINE_integer("seed", 0, "sampling seed")
flags.DEFINE_integer("num_samples", 1, "samples of the same prompt (G)")
flags.DEFINE_string("stop_ids", None, "comma-separated stop token ids; default: the config's eos ids")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "parameter dtype")


def _ids(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise app.UsageError(f"--{flag} must be comma-separated integers, got {text!r}") from None


def _default_tokenizer(checkpoint: str) -> str:
    """DIR/tokenizer.json; for the policy the package ships (glm52_jax/assets/tiny_policy), which has none of
    its own, the package's tokenizer, as a run with it uses."""
    from glm52_jax.rollout.tokenizer import default_tokenizer_path
    from glm52_jax.run_config import EMBEDDED_POLICY

    own = os.path.join(checkpoint, "tokenizer.json")
    if not os.path.exists(own) and os.path.realpath(checkpoint) == os.path.realpath(EMBEDDED_POLICY):
        return str(default_tokenizer_path())
    return own


def main(argv):
    del argv
    from glm52_jax.parallel.distributed import default_to_cpu_without_a_gpu

    default_to_cpu_without_a_gpu()
    if not FLAGS.checkpoint:
        raise app.UsageError("--checkpoint is required")
    if (FLAGS.prompt is None) == (FLAGS.prompt_ids is None):
        raise app.UsageError("give exactly one of --prompt and --prompt_ids")
    tok_path = FLAGS.tokenizer or _default_tokenizer(FLAGS.checkpoint)
    tokenizer = None
    if os.path.exists(tok_path):
        from glm52_jax.rollout.chat_template import find_chat_template
        from glm52_jax.rollout.tokenizer import Tokenizer

        # The tokenizer's directory's chat template, else the checkpoint's, else the hand-written GLM layout.
        template = None
        if FLAGS.chat:
            for directory in dict.fromkeys((os.path.dirname(os.path.abspath(tok_path)), FLAGS.checkpoint)):
                template = template or find_chat_template(directory)
        tokenizer = Tokenizer(tok_path, chat_template=template)
    elif FLAGS.tokenizer or FLAGS.prompt is not None:
        raise app.UsageError(f"no tokenizer at {tok_path}; use --prompt_ids or --tokenizer")
    if FLAGS.prompt is not None:
        if FLAGS.chat:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": FLAGS.prompt}])
        else:
            prompt = tokenizer.encode(FLAGS.prompt)
    else:
        prompt = _ids(FLAGS.prompt_ids, "prompt_ids")

    import jax.numpy as jnp

    import glm52_jax
    from glm52_jax.rollout.sampler import Sampler, SamplingParams

    model = glm52_jax.load_pretrained(FLAGS.checkpoint, dtype=jnp.dtype(FLAGS.dtype))
    stop = _ids(FLAGS.stop_ids, "stop_ids") if FLAGS.stop_ids is not None else list(model.cfg.eos_token_id)
    params = SamplingParams(max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature, top_p=FLAGS.top_p,
                            top_k=FLAGS.top_k, stop_token_ids=tuple(stop), num_samples=FLAGS.num_samples,
                            seed=FLAGS.seed)
    try:
        res = Sampler(model).sample(prompt, params)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    samples = []
    for i in range(params.num_samples):
        ids = res.completion(i)
        if not np.isfinite(res.logprobs[i, : len(ids)]).all():  # JSON has no NaN: say it, print nothing
            print(f"error: sample {i} has non-finite log-probs (the checkpoint {FLAGS.checkpoint} holds non-finite "
                  "weights, or the dtype overflows)", file=sys.stderr)
            raise SystemExit(1)
        sample = {"tokens": ids, "logprobs": [float(x) for x in res.logprobs[i, : len(ids)]],
                  "finish_reason": res.finish_reasons[i]}
        if tokenizer is not None:
            sample["text"] = tokenizer.decode(ids)
        samples.append(sample)
    print(json.dumps({"prompt_tokens": len(prompt), "samples": samples,
                      "prefill_seconds": round(res.prefill_seconds, 3),
                      "decode_seconds": round(res.decode_seconds, 3)}))


if __name__ == "__main__":
    app.run(main)
