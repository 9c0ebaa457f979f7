"""Orbax checkpoints of an online GRPO run: LoRA adapters, AdamW state, step, RNG and data cursor.

Only what training changes is saved: the base model is read-only (a checkpoint directory or the
embedded policy) and is named in `meta`, not copied. Layout (an Orbax `CheckpointManager`):

    WORKDIR/checkpoints/<step>/lora        LoRA arrays (pure dict of the `LoRA` variables)
                              /optimizer   optax state (same tree as `LoRAOptimizer.opt_state`)
                              /rng         the run's PRNG key (typed key, saved as key data)
                              /meta        JSON: step, data cursor, optimizer steps, config hash, ...

Orbax writes a step into a temporary directory and renames it when complete, so a process killed
mid-save leaves the previous step as the latest one (`latest_step` never returns a partial step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from glm52_jax.model.lora import LoRA
from glm52_jax.parallel.placement import replicated_global


class CheckpointMismatchError(ValueError):
    """A checkpoint that does not belong to this run (other config, other adapter shapes)."""


class CheckpointCorruptError(ValueError):
    """A committed checkpoint step that cannot be read (truncated or edited files)."""


@dataclasses.dataclass
class RunState:
    """What a resumed run needs besides the model: `step` = transactions completed."""

    step: int
    rng: jax.Array  # typed PRNG key
    cursor: int  # next data row (before the modulo over the rows)
    optimizer_steps: int
    meta: dict[str, Any]


def _pure_lora(model: nnx.Module) -> dict:
    return nnx.to_pure_dict(nnx.state(model, LoRA))


def _abstract(tree, home: jax.sharding.Sharding | None = None):
    """The restore target of `tree`: its shapes, dtypes and shardings, where a one-device array (an optimizer
    step count, made outside jit) goes to `home` instead (the mesh's replicated sharding: a committed array on
    device 0 would not mix with the mesh's arrays in one program)."""
    def one(x):
        sharding = getattr(x, "sharding", None)
        if home is not None and isinstance(sharding, jax.sharding.SingleDeviceSharding):
            sharding = home
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(one, tree)


def _key_sharding(lora: dict) -> jax.sharding.Sharding:
    """Where this topology keeps the run's RNG key: replicated over every device of several processes (as
    `replicated_global` saves it); in one process, replicated over the devices the adapters live on (the
    run's mesh, which the key's splits run on), or on the adapters' one device."""
    if jax.process_count() > 1:
        mesh = jax.sharding.Mesh(np.array(jax.devices()), ("all",))
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    sharding = jax.tree.leaves(lora)[0].sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return jax.sharding.SingleDeviceSharding(next(iter(sharding.device_set)))


def place_as_restored(model: nnx.Module, optimizer, rng: jax.Array) -> jax.Array:
    """Puts a fresh run's adapters, optimizer state and RNG key where `RunCheckpoints.restore` puts a resumed
    run's (returns the placed key). Orbax's restored arrays are committed to their devices, a fresh run's
    eager arrays on one device are not, and a jitted program lowered for committed arguments differs from
    the one lowered for uncommitted ones: without this, a run resumed on one device missed every program the
    uninterrupted run had put in the persistent compilation cache (and on a mesh the step count and key,
    replicated by a restore, differed too)."""
    lora = _pure_lora(model)
    home = _key_sharding(lora)

    def put(x, sharding):  # arrays spread over several processes are placed already (and device_put refuses them)
        return jax.device_put(x, sharding) if x.is_fully_addressable else x

    def put_tree(tree, target):
        return jax.tree.map(lambda x, t: put(x, t.sharding), tree, target)

    placed = replicated_global(optimizer.opt_state)
    optimizer.opt_state = put_tree(placed, _abstract(placed, home))
    lora_state = nnx.state(model, LoRA)
    nnx.replace_by_pure_dict(lora_state, put_tree(lora, _abstract(lora)))
    nnx.update(model, lora_state)
    return put(replicated_global(rng), home)


class RunCheckpoints:
    """Save / restore `RunState` + adapters + optimizer under `directory` (one Orbax step per transaction)."""

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3):
        """`max_to_keep`: newest steps kept, older ones deleted as new ones are saved (the run's `checkpoint.keep`);
        None keeps every step."""
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               enable_async_checkpointing=False)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        """The newest complete step, or None when the run has not committed one."""
        self._manager.reload()
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def save(self, model: nnx.Module, optimizer, state: RunState) -> None:
        """Writes step `state.step` (synchronously; complete or absent, never partial)."""
        meta = {**state.meta, "step": state.step, "cursor": state.cursor, "optimizer_steps": state.optimizer_steps}
        # Every process calls this with the same values; Orbax writes each array's shards once.
        args = ocp.args.Composite(
            lora=ocp.args.StandardSave(_pure_lora(model)),
            optimizer=ocp.args.StandardSave(replicated_global(optimizer.opt_state)),
            rng=ocp.args.JaxRandomKeySave(replicated_global(state.rng)),
            meta=ocp.args.JsonSave(meta),
        )
        if not self._manager.save(state.step, args=args, force=True):
            raise RuntimeError(f"orbax did not save step {state.step} under {self.directory}")
        self._manager.wait_until_finished()

    def check_meta(self, step: int, expect: dict[str, Any]) -> dict[str, Any]:
        """Step `step`'s meta, after checking it shares `expect` (config hash, base model, ...).

        A mismatch raises `CheckpointMismatchError`: the directory holds another run's state.
        """
        meta = self.read_meta(step)
        wrong = {k: (meta.get(k), v) for k, v in expect.items() if meta.get(k) != v}
        if wrong:
            details = "; ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in sorted(wrong.items()))
            raise CheckpointMismatchError(f"checkpoint step {step} in {self.directory} belongs to another run "
                                          f"({details}); use a fresh workdir")
        return meta

    def read_meta(self, step: int) -> dict[str, Any]:
        """Step `step`'s meta record (JSON), unchecked."""
        with self._readable(step):
            return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore(self, step: int, model: nnx.Module, optimizer) -> RunState:
        """Loads step `step` into `model`'s adapters and `optimizer`; returns the run state.

        The adapters' and optimizer's current trees give the expected shapes and dtypes, so a
        checkpoint of other adapters fails in Orbax before anything is replaced, and their current
        shardings the placement: a step saved on N devices / P processes restores onto this mesh (M / Q).
        The RNG key, which Orbax would put back on the devices that saved it, is placed here too.
        """
        lora = _pure_lora(model)
        home = _key_sharding(lora)
        with self._readable(step):
            restored = self._manager.restore(step, args=ocp.args.Composite(
                lora=ocp.args.StandardRestore(_abstract(lora)),
                optimizer=ocp.args.StandardRestore(_abstract(replicated_global(optimizer.opt_state), home)),
                rng=ocp.args.JaxRandomKeyRestore(ocp.ArrayRestoreArgs(sharding=home)),
                meta=ocp.args.JsonRestore(),
            ))
        meta = restored["meta"]
        lora_state = nnx.state(model, LoRA)
        nnx.replace_by_pure_dict(lora_state, restored["lora"])
        nnx.update(model, lora_state)
        optimizer.opt_state = restored["optimizer"]
        optimizer.step = int(meta["optimizer_steps"])
        return RunState(step=int(meta["step"]), rng=restored["rng"], cursor=int(meta["cursor"]),
                        optimizer_steps=int(meta["optimizer_steps"]), meta=meta)

    @contextlib.contextmanager
    def _readable(self, step: int):
        """Turns Orbax/TensorStore failures to read `step` into one `CheckpointCorruptError` line
        that names the step and the previous committed one to fall back to."""
        try:
            yield
        except (CheckpointMismatchError, KeyboardInterrupt):
            raise
        except Exception as e:  # Orbax raises ValueError, FileNotFoundError, TensorStore errors, ...
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            earlier = [s for s in self.all_steps() if s < step]
            fallback = (f"move {self.directory / str(step)} aside (e.g. to {step}.corrupt) to resume from step "
                        f"{earlier[-1]}" if earlier else "no earlier step exists; use a fresh workdir")
            raise CheckpointCorruptError(f"checkpoint step {step} in {self.directory} cannot be read "
                                         f"({type(e).__name__}: {first}); {fallback}") from e

    def close(self) -> None:
        self._manager.close()

