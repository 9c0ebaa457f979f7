"""The policy a run trains: base model (checkpoint or seeded init) + LoRA adapters + AdamW, on its mesh."""

from __future__ import annotations

from glm52_jax.parallel import communicators
from glm52_jax.rl import settings
from glm52_jax.rl.inputs import RunInputs
from glm52_jax.run_config import ConfigError, RunSpec


def build_base(spec: RunSpec, inputs: RunInputs, mesh=None, *, options=None):
    """The frozen base model: the checkpoint read slice by slice (per device under `mesh`), or for
    `checkpoint="random"` a seeded init of the preset. `options` (ModelOptions) default to the spec's.
    Its weights' format is `inputs.base_fp8`'s: with `model.base_weights="fp8"` a float checkpoint is quantized
    as it is read and a random init after it is built (the same FP8 parameters and block grids either way)."""
    from flax import nnx

    from glm52_jax.checkpoint.hf import load_pretrained, quantize_model
    from glm52_jax.model.transformer import GlmMoeDsa
    from glm52_jax.rl.inputs import base_fp8

    options = options or settings.model_options(spec.model)
    path, fp8 = spec.model.checkpoint_path, base_fp8(spec.model)
    if path is None:
        base = GlmMoeDsa(inputs.model_cfg, options, rngs=nnx.Rngs(spec.seed))
        if fp8 is not None:
            base = quantize_model(base, fp8)
    else:
        base = load_pretrained(path, dtype=options.param_dtype, shardings=mesh, rope_scaling=inputs.rope_scaling,
                               options=options, fp8=fp8)
    if base.cfg != inputs.model_cfg:
        raise AssertionError("the loaded model's config differs from the resolved one")  # a bug, not bad input
    return base


def build_policy(spec: RunSpec, inputs: RunInputs, mesh=None, *, init_adapter: bool = True):
    """(model with its LoRA adapters, its LoRAOptimizer). The adapters are fresh (A random, B zero), or read
    from `model.init_adapter` (a PEFT directory or a Megatron LoRA file) when set and `init_adapter` (False: a
    run restoring a checkpoint, which overwrites them anyway). With a `mesh` (and its rules table active) every
    weight, adapter and optimizer moment is sharded by its logical axes."""
    from glm52_jax.model.lora import attach_lora
    from glm52_jax.parallel.placement import place_model
    from glm52_jax.rl.update import LoRAOptimizer

    model = attach_lora(build_base(spec, inputs, mesh), settings.lora_config(spec.model), seed=spec.seed)
    if spec.model.init_adapter and init_adapter:
        from glm52_jax.checkpoint.init_adapter import load_init_adapter
        from glm52_jax.checkpoint.peft_load import AdapterMismatchError

        try:
            model = load_init_adapter(model, spec.model.init_adapter)
        except AdapterMismatchError as e:  # resolve() checked it; the files changed since
            raise ConfigError(f"--config.model.init_adapter={spec.model.init_adapter}: {e}") from None
    if mesh is not None:
        model = place_model(model, mesh)  # the adapters (and a seeded base); placed weights stay put
    return model, LoRAOptimizer(model, settings.adamw(spec.train))


def train_mesh(spec: RunSpec):
    """(MeshSpec, Mesh) for the run, or (spec, None) on one device; a mesh the run's devices (of every
    process under jax.distributed) cannot fill is a config error (before any model work).

    Several processes on CPU: also opens the mesh's gloo communicators while the processes are in step (a
    collective: every process calls this at the same point; parallel/communicators.py says why)."""
    import jax

    mesh_spec = spec.mesh_spec()
    if mesh_spec.size == 1:
        return mesh_spec, None
    if jax.device_count() < mesh_spec.size:
        cpu = jax.devices()[0].platform == "cpu"
        raise ConfigError(f"--config.mesh={spec.mesh} needs {mesh_spec.size} devices, the run has "
                          f"{jax.device_count()} ({jax.devices()[0].platform}); give a --config.mesh of "
                          f"{jax.device_count()} devices (the mesh may change on a rerun)"
                          + (f", or on CPU XLA_FLAGS=--xla_force_host_platform_device_count={mesh_spec.size}"
                             if cpu else ""))
    if jax.process_count() > 1 and jax.device_count() != mesh_spec.size:
        # A part of the devices would leave some processes without a device of the mesh.
        raise ConfigError(f"--config.mesh={spec.mesh} covers {mesh_spec.size} of the {jax.device_count()} devices "
                          f"of the {jax.process_count()} processes; a multi-process run's mesh must cover them all")
    mesh = mesh_spec.make(jax.devices()[:mesh_spec.size])
    communicators.open_all(mesh)
    return mesh_spec, mesh


def mesh_line(mesh_spec) -> str:
    """The progress line naming the mesh, and the devices it leaves idle (a mesh smaller than the machine
    is allowed on one process, but never silent)."""
    import jax

    n, platform = jax.device_count(), jax.devices()[0].platform
    idle = f"; {n - mesh_spec.size} of the {n} devices stay idle" if n > mesh_spec.size else ""
    return f"mesh {mesh_spec.describe()} over {mesh_spec.size} {platform} devices{idle}"
