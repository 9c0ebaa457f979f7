"""Export a run's trained policy from its Orbax checkpoint: a PEFT adapter and the merged model.

    python -m glm52_jax.launch --mode=export --workdir=RUN [--export_dir=DIR] [--export_step=K]

writes DIR (default RUN/export/step_<k>) with
    peft/     adapter_model.safetensors + adapter_config.json (loads with peft onto HF GLM-MoE-DSA)
    merged/   config.json + safetensors of the base with the adapters merged (HF transformers loads it);
              config.json has the base checkpoint's native positions unless `export.keep_rope_scaling`
              (a run's YaRN payload is a run-time override, as in the seed, not part of the model);
              the run's tokenizer.json and, where the run found its chat template, that directory's
              chat_template.jinja / tokenizer_config.json, so `python -m glm52_jax.generate --checkpoint
              DIR/merged --prompt ...` runs on it. An FP8 base is merged dequantized, in model.dtype; with
              `export.merged_fp8` re-quantized as the base was (e4m3 + block scales, its quantization_config)
    export.json  step, base model, config hash, files with sha256

The run's settings come from RUN/config.json (saved when the run started), because the base model
and adapter shapes come from them; the checkpoint's config hash is checked against them.

The policy is restored on the run's mesh (`spec.mesh`), by every process of a multi-process run together,
as training holds it. The merged model is never built whole: each HF tensor in turn is sliced out (one
layer, one expert), merged with its LoRA delta on device, gathered to the hosts and written, so host
memory is bounded by the largest tensor, not the model. Process 0 alone writes: into a staging directory
beside DIR that replaces DIR only when every file and export.json are complete and every process has
finished, so a failure anywhere leaves no half-written export (and a previous export in DIR intact).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from glm52_jax.evidence.hashing import sha256_file
from glm52_jax.parallel import watchdog
from glm52_jax.rl import processes
from glm52_jax.rl.inputs import native_model_config, resolve
from glm52_jax.rl.policy import build_policy, train_mesh
from glm52_jax.run_config import ConfigError, RunSpec, checkpoint_expect

RECORD = "export.json"


def export_run(spec: RunSpec, workdir: str | os.PathLike, *, export_dir: str | os.PathLike | None = None,
               step: int | None = None, merged: bool = True) -> dict[str, Any]:
    """Restores checkpoint `step` (default: the latest) of the run in `workdir` and exports it. Several
    processes: each calls this with the same settings; process 0's result lists the files written."""
    from glm52_jax.checkpoint.train_state import RunCheckpoints

    processes.check_same_settings(spec)
    workdir = Path(workdir)
    if not (workdir / "checkpoints").is_dir():
        raise ConfigError(f"export: {workdir} has no checkpoints/ (not a run directory, or no step committed)")
    inputs = resolve(spec, data=False)
    quantization = fp8_export_config(spec) if merged else None
    ckpts = RunCheckpoints(workdir / "checkpoints", max_to_keep=spec.checkpoint.keep)
    steps = ckpts.all_steps()
    if not steps:
        raise ConfigError(f"export: {workdir / 'checkpoints'} holds no committed step")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ConfigError(f"export: --export_step={step} is not among the committed steps {steps}")
    ckpts.check_meta(step, checkpoint_expect(spec, ckpts.read_meta(step)))  # saved on any mesh
    out = Path(export_dir) if export_dir is not None else workdir / "export" / f"step_{step}"
    holder, refusal = _staging_holder(out) if processes.is_writer() else (None, None)
    try:
        _agree(refusal)  # before any gather: a process that cannot go on stops them all
        with watchdog.phase("export", step=step):
            return _export(spec, inputs, ckpts, step, out, holder, merged, quantization)
    finally:
        if holder is not None:
            shutil.rmtree(holder, ignore_errors=True)


def export_topology(spec: RunSpec) -> RunSpec:
    """The settings export builds the policy with: the run's, except that in one process whose devices cannot
    hold the run's mesh (a run saved on 8 GPUs exported on a laptop) the adapters are restored onto one device:
    the export is the same files on any mesh, so export works anywhere (memory permitting)."""
    import jax

    if jax.process_count() == 1 and jax.device_count() < spec.mesh_spec().size:
        return spec.replace(mesh="")
    return spec


def _export(spec: RunSpec, inputs, ckpts, step: int, out: Path, holder: Path | None, merged: bool,
            quantization: dict | None) -> dict:
    """Restores the adapters on the run's mesh and writes the export (process 0, `holder` set: into
    `holder`/export, then moved to `out`; the others only take part in the gathers)."""
    positions = "run" if spec.export.keep_rope_scaling or inputs.rope_scaling is None else "native"
    record = {"step": step, "base": spec.model.base_name, "config_sha256": spec.resume_sha256(),
              "merged_positions": positions}
    if quantization is not None:
        record["merged_quantization"] = quantization
    mesh_spec, mesh = train_mesh(export_topology(spec))
    with contextlib.ExitStack() as stack:
        if mesh is not None:
            from glm52_jax.parallel.rules import axis_rules

            stack.enter_context(axis_rules(mesh_spec.rules()))
        model, _ = build_policy(spec, inputs, mesh, init_adapter=False)  # the checkpoint's adapters replace them
    _restore_adapters(ckpts.directory, step, model)
    ckpts.close()
    if holder is None:
        _write(model, None, spec, inputs, positions, merged, quantization)
        _agree(None)  # every gather done: process 0 may publish
        return {"export_dir": str(out), **record}
    staging = holder / "export"
    staging.mkdir()  # default permissions (mkdtemp's own directory is private)
    record["files"] = _write(model, staging, spec, inputs, positions, merged, quantization)
    from glm52_jax.evidence.atomic import atomic_write_json

    atomic_write_json(staging / RECORD, record)  # last: an export.json lists complete files
    _agree(None)
    _publish(staging, out, holder)
    return {"export_dir": str(out), **record}


def _write(model, staging: Path | None, spec: RunSpec, inputs, positions: str, merged: bool,
           quantization: dict | None) -> list[dict]:
    """peft/ and merged/ into `staging` (None: a process that only takes part in the gathers; merged/ in FP8
    when `quantization` is given); the files written, with sizes and sha256."""
    from glm52_jax.checkpoint.hf import save_pretrained
    from glm52_jax.checkpoint.peft import save_peft_adapter

    write = staging is not None
    target = staging if write else Path(os.devnull)
    save_peft_adapter(model, target / "peft", base_model_name_or_path=spec.model.base_name, write=write)
    if merged:
        written_cfg = model.cfg if positions == "run" else native_model_config(spec.model)[0]
        save_pretrained(model, target / "merged", config=written_cfg, merge_adapters=True, write=write,
                        quantization=quantization)
        if write:
            for name, source in tokenizer_files(spec.model).items():
                shutil.copyfile(source, target / "merged" / name)
    if not write:
        return []
    files = sorted(p for p in staging.rglob("*") if p.is_file())
    return [{"path": p.relative_to(staging).as_posix(), "bytes": p.stat().st_size, "sha256": sha256_file(p)}
            for p in files]


def fp8_export_config(spec: RunSpec) -> dict | None:
    """The `quantization_config` merged/ is written with: None unless `export.merged_fp8`, then the base
    checkpoint's own, read from its config.json (it must be an FP8 checkpoint: a ConfigError otherwise, before
    anything is loaded)."""
    if not spec.export.merged_fp8:
        return None
    from glm52_jax.checkpoint import hf_fp8
    from glm52_jax.config import ModelConfig

    path = spec.model.checkpoint_path
    where = f"--config.export.merged_fp8=True: the base model ({path or spec.model.checkpoint})"
    cfg = path / "config.json" if path is not None else None
    raw = dict(ModelConfig.from_json_file(cfg).extra).get(hf_fp8.QUANT_KEY) if cfg and cfg.is_file() else None
    if raw is None:
        raise ConfigError(f"{where} is not an FP8 checkpoint (its config.json has no {hf_fp8.QUANT_KEY}); export "
                          "without it (--config.export.merged_fp8=False) or train on the FP8 release")
    try:
        hf_fp8.split_quantization(ModelConfig.from_json_file(cfg))
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    return raw


def tokenizer_files(model_spec) -> dict[str, Path]:
    """{file name in merged/: source} of the run's tokenizer and chat template (`rl.inputs.tokenizer_for`,
    `chat_template_for`): its tokenizer file as tokenizer.json, and the template files of the first directory
    that ships a template (the tokenizer's, then the checkpoint's). The embedded policy's: the project's tiny
    tokenizer.json, no template (generate then uses the hand-written GLM layout, as the run did)."""
    from glm52_jax.rl.inputs import tokenizer_for
    from glm52_jax.rollout.chat_template import TEMPLATE_FILE, TOKENIZER_CONFIG, find_chat_template

    files = {"tokenizer.json": Path(tokenizer_for(model_spec).path)}
    places = [Path(model_spec.tokenizer)] if model_spec.tokenizer else []
    places = [p if p.is_dir() else p.parent for p in places]
    if model_spec.checkpoint_path is not None and model_spec.checkpoint_path.is_dir():
        places.append(model_spec.checkpoint_path)
    for directory in places:
        if find_chat_template(directory) is not None:
            files.update({name: directory / name for name in (TEMPLATE_FILE, TOKENIZER_CONFIG)
                          if (directory / name).is_file()})
            break
    return files


def _restore_adapters(directory: Path, step: int, model) -> None:
    """Step `step`'s adapters (`<step>/lora`, see checkpoint/train_state.py) into `model`, each array read
    straight onto its sharding by every process together. Only the adapters: an export needs neither the
    optimizer moments nor the RNG key, and the key's saved placement names the training run's devices, so
    restoring it fails on another topology (a one-process run exported by several processes)."""
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx

    from glm52_jax.checkpoint.train_state import CheckpointCorruptError
    from glm52_jax.model.lora import LoRA

    state = nnx.state(model, LoRA)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            nnx.to_pure_dict(state))
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(directory / str(step) / "lora", abstract)
    except Exception as e:  # Orbax raises ValueError, FileNotFoundError, TensorStore errors, ...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise CheckpointCorruptError(f"checkpoint step {step} in {directory}: its adapters cannot be read "
                                     f"({type(e).__name__}: {first})") from e
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(model, state)


def _staging_holder(out: Path) -> tuple[Path | None, str | None]:
    """(a new private directory beside `out` to stage the export in, None), or (None, why the export may
    not go to `out`): `out` may be new, empty, or a previous export, which it replaces whole; anything else
    (a file, a directory of other files) is not ours to replace."""
    if os.path.lexists(out) and not (out.is_dir() and (not any(out.iterdir()) or (out / RECORD).is_file())):
        return None, (f"export: --export_dir={out} exists and is not an export (no {RECORD}); "
                      "choose a new or empty directory")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{out.name}.staging-", dir=out.parent)), None
    except OSError as e:
        return None, f"export: cannot write beside --export_dir={out} ({e})"


def _agree(refusal: str | None) -> None:
    """Every process goes on, or all stop: with `refusal` (a reason to stop) on any process, each one
    raises (the refusing one its reason), so none is left waiting in a gather. One process: raises `refusal`."""
    others = processes.differing("ff" * 32 if refusal is not None else "00" * 32)  # [] in one process
    if refusal is not None:
        raise ConfigError(refusal)
    if others:
        raise ConfigError("export: another process of the run stopped (its error says why)")


def _publish(staging: Path, out: Path, holder: Path) -> None:
    """Moves the complete export `staging` to `out`; a previous export there is moved into `holder`
    (removed with it) first, and put back if the move fails."""
    old = holder / "previous"
    if os.path.lexists(out):
        os.rename(out, old)
    try:
        os.rename(staging, out)
    except OSError:
        if os.path.lexists(old):
            os.rename(old, out)
        raise
