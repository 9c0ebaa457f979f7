"""Entry point: online GRPO transactions from an ml_collections config (absl flags).

    python -m glm52_jax.launch                                   # configs/tiny.py, laptop CPU
    python -m glm52_jax.launch --config=configs/tiny.py --workdir=/tmp/run \\
        --config.sampling.num_samples=4 --config.train.gradient_mode=shared_prefix
    python -m glm52_jax.launch --mode=export --workdir=/tmp/run     # PEFT adapter + merged HF model
    python -m glm52_jax.launch --mode=forward --config.model.checkpoint=/ckpt/GLM-5.2   # smoke forward

`--mode=train` runs `train.steps` transactions (rl/transaction.py); step k writes
`WORKDIR/evidence/step_00000k/receipt.json` (check it with `python -m glm52_jax.evidence verify ...`),
then an Orbax checkpoint `WORKDIR/checkpoints/k` (LoRA, AdamW state, RNG, data cursor); events go
to `WORKDIR/metrics.jsonl`. Rerunning the command on the same workdir resumes after the last
checkpoint (a larger `--config.train.steps` extends a finished run). `--mode=export` writes the
run's latest checkpoint as a PEFT adapter and a merged HF checkpoint (rl/export.py; give the run's
config flags). `--mode=forward` runs one forward of the configured model and prints its mean token
log-prob.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from absl import app, flags, logging
from ml_collections import config_flags

ROOT = Path(__file__).resolve().parents[1]
FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", str(ROOT / "configs" / "tiny.py"), "ml_collections config file")
flags.DEFINE_string("workdir", None, "run directory (default: runs/<config.name>_<UTC time>)")
flags.DEFINE_enum("mode", "train", ["train", "plan", "export", "parity", "forward"],
                  "train: run/resume train.steps GRPO transactions; plan: AOT-compile prefill, decode and the "
                  "training step for the configured mesh from abstract inputs (memory, FLOPs, collectives); "
                  "export: PEFT adapter + merged model from the run's latest checkpoint; parity: gradient modes "
                  "compared on one rollout; forward: smoke forward")
flags.DEFINE_string("export_dir", None, "export mode: output directory (default WORKDIR/export/step_<k>)")
flags.DEFINE_integer("export_step", None, "export mode: checkpoint step (default: the latest)")
flags.DEFINE_integer("seq_len", 256, "forward mode: tokens per sequence", lower_bound=2)


def _forward(c) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from glm52_jax.checkpoint.hf import load_pretrained
    from glm52_jax.model.options import ModelOptions
    from glm52_jax.model.transformer import GlmMoeDsa, token_logprobs
    from glm52_jax.rl.transaction import check_config, rope_scaling

    plan = check_config(c)
    dtype = jnp.dtype(c.model.dtype)
    if plan.checkpoint is None:
        model = GlmMoeDsa(plan.model_cfg, ModelOptions(param_dtype=dtype), rngs=nnx.Rngs(c.seed))
    else:
        model = load_pretrained(plan.checkpoint, dtype=dtype, rope_scaling=rope_scaling(c)[0])
    ids = np.random.default_rng(c.seed).integers(0, model.cfg.vocab_size, (1, FLAGS.seq_len))
    graphdef, state = nnx.split(model)
    start = time.perf_counter()
    logprobs = jax.jit(lambda s, x: token_logprobs(nnx.merge(graphdef, s), x))
    out = np.asarray(logprobs(state, jnp.asarray(ids, jnp.int32)))
    if not np.isfinite(out).all():
        raise SystemExit("non-finite log-probs")
    return {"model": str(plan.checkpoint or f"random:{c.model.preset}"), "seq_len": FLAGS.seq_len,
            "mean_token_logprob": float(out.mean()), "seconds_incl_compile": round(time.perf_counter() - start, 2)}


def _plan(c) -> dict:
    """Plan mode: no weights, no data; the checkpoint's config.json if present, else `model.preset`."""
    import jax.numpy as jnp

    from glm52_jax import config as config_lib
    from glm52_jax.model.lora import LoRAConfig
    from glm52_jax.plan import format_plan, plan
    from glm52_jax.rl.transaction import EMBEDDED_POLICY, ConfigError, mesh_spec, rope_scaling

    m, s = c.model, c.sampling
    checkpoint = EMBEDDED_POLICY if m.checkpoint == "embedded" else Path(m.checkpoint)
    if m.checkpoint != "random" and (checkpoint / "config.json").is_file():
        cfg, source = config_lib.ModelConfig.from_json_file(checkpoint / "config.json"), str(checkpoint)
    else:
        presets = {"tiny": config_lib.tiny, "glm52": config_lib.glm52}
        if m.preset not in presets:
            raise ConfigError(f"model.preset must be one of {sorted(presets)}, got {m.preset!r}")
        cfg, source = presets[m.preset](), f"preset:{m.preset}"
    scaling, _ = rope_scaling(c)
    if scaling is not None:
        cfg = cfg.with_rope_scaling(scaling)
    need = c.data.prompt_tokens + s.max_new_tokens
    if need > cfg.max_position_embeddings:
        raise ConfigError(f"data.prompt_tokens + sampling.max_new_tokens = {need} exceeds the position capacity "
                          f"{cfg.max_position_embeddings}")
    lora = LoRAConfig(rank=m.lora_rank, alpha=float(m.lora_alpha), families=frozenset(m.lora_families))
    report = plan(cfg, mesh_spec(c), prompt_tokens=c.data.prompt_tokens, max_new_tokens=s.max_new_tokens,
                  num_samples=s.num_samples, gradient_mode=c.train.gradient_mode, lora=lora,
                  dtype=jnp.dtype(m.dtype), chunk_size=s.chunk_size,
                  prefill_mode=s.get("prefill_mode", "chunked"), hbm_bytes=float(c.plan.hbm_gib) * 2**30,
                  programs=tuple(c.plan.get("programs", ("prefill", "decode", "train"))),
                  log=lambda msg: print(msg, file=sys.stderr, flush=True))
    report["model_source"] = source
    print(format_plan(report), file=sys.stderr)
    return report


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from glm52_jax.checkpoint.train_state import CheckpointMismatchError
    from glm52_jax.parallel import distributed
    from glm52_jax.rl.transaction import ConfigError, run_online

    c = FLAGS.config
    if FLAGS.verbosity <= 0:  # Orbax logs every file rename at INFO; keep the console to our progress lines
        logging.set_verbosity(logging.WARNING)
    try:
        if FLAGS.mode == "plan":
            from glm52_jax.plan import ensure_virtual_devices
            from glm52_jax.rl.transaction import mesh_spec

            ensure_virtual_devices(mesh_spec(c).size)  # before JAX starts: virtual CPU devices for the mesh
            report = _plan(c)
            if FLAGS.workdir:
                from glm52_jax.evidence.atomic import atomic_write_json

                Path(FLAGS.workdir).mkdir(parents=True, exist_ok=True)
                atomic_write_json(Path(FLAGS.workdir) / "plan.json", report, indent=1)
            print(json.dumps({"fits": report["fits"], "largest_program": report["largest_program"],
                              "largest_total_bytes": report["largest_total_bytes"], "hbm_bytes": report["hbm_bytes"],
                              "mesh": report["mesh"]["describe"]}))
            return
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None
    distributed.initialize()  # multi-host when GLM52_* or SLURM variables say so; else a no-op
    try:
        if FLAGS.mode == "forward":
            print(json.dumps(_forward(c)))
            return
        if FLAGS.mode == "export":
            from glm52_jax.rl.export import export_run

            if not FLAGS.workdir:
                raise ConfigError("--mode=export needs --workdir (the run to export)")
            record = export_run(c, FLAGS.workdir, export_dir=FLAGS.export_dir, step=FLAGS.export_step)
            print(json.dumps({k: record[k] for k in ("export_dir", "step", "base")}))
            return
        if FLAGS.mode == "parity":
            from glm52_jax.rl.parity import run_parity

            workdir = FLAGS.workdir or str(Path("runs") / f"{c.name}_{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
            out = run_parity(c, workdir, log=lambda msg: print(msg, file=sys.stderr, flush=True))
            print(json.dumps(out))
            return
        workdir = FLAGS.workdir or str(Path("runs") / f"{c.name}_{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
        summary = run_online(c, workdir, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None
    except CheckpointMismatchError as e:
        raise SystemExit(f"resume error: {e}") from None
    print(json.dumps({"workdir": summary["workdir"], "status": summary["status"], "last_step": summary["last_step"],
                      "steps_run": summary["steps_run"], "receipts": [s["receipt"] for s in summary["steps"]],
                      "accepted": [s["accepted"] for s in summary["steps"]]}))


if __name__ == "__main__":
    app.run(main)
