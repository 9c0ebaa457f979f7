"""Export a run's trained policy from its Orbax checkpoint: a PEFT adapter and the merged model.

    python -m glm52_jax.launch --mode=export --workdir=RUN [--config ... as the run] [--export_dir=DIR]

writes DIR (default RUN/export/step_<k>) with
    peft/     adapter_model.safetensors + adapter_config.json (loads with peft onto HF GLM-MoE-DSA)
    merged/   config.json + safetensors of the base with the adapters merged (HF transformers loads it)
    export.json  step, base model, config hash, files with sha256

The config must be the run's (checked against the checkpoint's config hash), because the base
model and adapter shapes come from it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from glm52_jax.rl.transaction import ConfigError, base_name, build_policy, check_config, resume_config_hash


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def export_run(c, workdir: str | os.PathLike, *, export_dir: str | os.PathLike | None = None,
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
    plan = check_config(c)
    ckpts = RunCheckpoints(workdir / "checkpoints")
    steps = ckpts.all_steps()
    if not steps:
        raise ConfigError(f"export: {workdir / 'checkpoints'} holds no committed step")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ConfigError(f"export: step {step} is not among the committed steps {steps}")
    ckpts.check_meta(step, {"config_sha256": resume_config_hash(c), "base": base_name(plan, c)})
    model, optimizer = build_policy(c, plan)
    ckpts.restore(step, model, optimizer)
    ckpts.close()

    out = Path(export_dir) if export_dir is not None else workdir / "export" / f"step_{step}"
    out.mkdir(parents=True, exist_ok=True)
    save_peft_adapter(model, out / "peft", base_model_name_or_path=base_name(plan, c))
    if merged:
        save_pretrained(merge_lora(model), out / "merged")
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "export.json")
    record = {"step": step, "base": base_name(plan, c), "config_sha256": resume_config_hash(c),
              "files": [{"path": p.relative_to(out).as_posix(), "bytes": p.stat().st_size, "sha256": _digest(p)}
                        for p in files]}
    atomic_write_json(out / "export.json", record)
    return {"export_dir": str(out), **record}
