"""Export a run's trained policy from its Orbax checkpoint: a PEFT adapter and the merged model.

    python -m glm52_jax.launch --mode=export --workdir=RUN [--export_dir=DIR] [--export_step=K]

writes DIR (default RUN/export/step_<k>) with
    peft/     adapter_model.safetensors + adapter_config.json (loads with peft onto HF GLM-MoE-DSA)
    merged/   config.json + safetensors of the base with the adapters merged (HF transformers loads it);
              config.json has the base checkpoint's native positions unless `export.keep_rope_scaling`
              (a run's YaRN payload is a run-time override, as in the seed, not part of the model)
    export.json  step, base model, config hash, files with sha256

The run's settings come from RUN/config.json (saved when the run started), because the base model
and adapter shapes come from them; the checkpoint's config hash is checked against them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from glm52_jax.evidence.hashing import sha256_file
from glm52_jax.rl.inputs import native_model_config, resolve
from glm52_jax.rl.policy import build_policy
from glm52_jax.run_config import ConfigError, RunSpec


def export_run(spec: RunSpec, workdir: str | os.PathLike, *, export_dir: str | os.PathLike | None = None,
               step: int | None = None, merged: bool = True) -> dict[str, Any]:
    """Restores checkpoint `step` (default: the latest) of the run in `workdir` and exports it."""
    from glm52_jax.checkpoint.hf import save_pretrained
    from glm52_jax.checkpoint.peft import save_peft_adapter
    from glm52_jax.checkpoint.train_state import RunCheckpoints
    from glm52_jax.evidence.atomic import atomic_write_json
    from glm52_jax.model.lora import merge_lora

    workdir = Path(workdir)
    if not (workdir / "checkpoints").is_dir():
        raise ConfigError(f"export: {workdir} has no checkpoints/ (not a run directory, or no step committed)")
    inputs = resolve(spec, data=False)
    ckpts = RunCheckpoints(workdir / "checkpoints")
    steps = ckpts.all_steps()
    if not steps:
        raise ConfigError(f"export: {workdir / 'checkpoints'} holds no committed step")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ConfigError(f"export: --export_step={step} is not among the committed steps {steps}")
    ckpts.check_meta(step, {"config_sha256": spec.resume_sha256(), "base": spec.model.base_name})
    model, optimizer = build_policy(spec, inputs, init_adapter=False)  # the checkpoint's adapters replace them
    ckpts.restore(step, model, optimizer)
    ckpts.close()

    out = Path(export_dir) if export_dir is not None else workdir / "export" / f"step_{step}"
    out.mkdir(parents=True, exist_ok=True)
    save_peft_adapter(model, out / "peft", base_model_name_or_path=spec.model.base_name)
    positions = "run" if spec.export.keep_rope_scaling or inputs.rope_scaling is None else "native"
    if merged:
        written_cfg = model.cfg if positions == "run" else native_model_config(spec.model)[0]
        save_pretrained(merge_lora(model), out / "merged", config=written_cfg)
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "export.json")
    record = {"step": step, "base": spec.model.base_name, "config_sha256": spec.resume_sha256(),
              "merged_positions": positions,
              "files": [{"path": p.relative_to(out).as_posix(), "bytes": p.stat().st_size, "sha256": sha256_file(p)}
                        for p in files]}
    atomic_write_json(out / "export.json", record)
    return {"export_dir": str(out), **record}
