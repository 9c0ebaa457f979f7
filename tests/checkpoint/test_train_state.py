"""Run checkpoints: retention (`checkpoint.keep`) with real Orbax saves of a small adapter and its AdamW state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm52_jax.checkpoint.train_state import RunCheckpoints, RunState, place_as_restored
from glm52_jax.model.lora import LoRA
from glm52_jax.rl.update import LoRAOptimizer


class _Adapted(nnx.Module):
    """The smallest module with an adapter: what a checkpoint saves of a policy is its LoRA state."""

    def __init__(self):
        self.a = LoRA(jnp.zeros((2, 3), jnp.float32))


def _save_steps(directory, steps, keep):
    model = _Adapted()
    optimizer = LoRAOptimizer(model)
    ckpts = RunCheckpoints(directory, max_to_keep=keep)
    for step in steps:
        model.a.set_value(jnp.full((2, 3), float(step), jnp.float32))
        ckpts.save(model, optimizer, RunState(step=step, rng=jax.random.key(step), cursor=step, optimizer_steps=0,
                                              meta={"config_sha256": "c"}))
    return ckpts, model, optimizer


def test_keep_deletes_all_but_the_newest_steps(tmp_path):
    ckpts, model, optimizer = _save_steps(tmp_path / "ckpt", (1, 2, 3, 4), keep=2)
    assert ckpts.all_steps() == [3, 4] and ckpts.latest_step() == 4
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["3", "4"]
    state = ckpts.restore(3, model, optimizer)  # a kept older step is whole
    assert state.step == 3 and state.cursor == 3
    np.testing.assert_array_equal(np.asarray(model.a.get_value()), np.full((2, 3), 3.0, np.float32))
    ckpts.close()
    # A rerun with a smaller keep (checkpoint.keep may change on a rerun) trims at its next save.
    again, _, _ = _save_steps(tmp_path / "ckpt", (5,), keep=1)
    assert again.all_steps() == [5]
    again.close()


def test_a_step_saved_on_one_device_restores_onto_a_mesh(tmp_path):
    """Another topology: the adapters come back with the target mesh's sharding, the optimizer's step count and
    the RNG key replicated over that mesh (not committed to the device that saved them, which no program on
    the mesh could take), and without Orbax's "unsafe when restoring on a different topology" warning."""
    import warnings

    ckpts, _, _ = _save_steps(tmp_path / "ckpt", (1,), keep=1)
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None))
    model = _Adapted()
    model.a.set_value(jax.device_put(jnp.zeros((2, 3), jnp.float32), sharded))
    optimizer = LoRAOptimizer(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = ckpts.restore(1, model, optimizer)
    assert not [w for w in caught if "different topology" in str(w.message)], [str(w.message) for w in caught]
    assert model.a.get_value().sharding == sharded
    assert state.rng.sharding.mesh == mesh and state.rng.sharding.is_fully_replicated
    np.testing.assert_array_equal(jax.random.key_data(state.rng), jax.random.key_data(jax.random.key(1)))
    counts = [x for x in jax.tree.leaves(optimizer.opt_state) if x.ndim == 0]
    assert counts and all(set(c.sharding.device_set) == set(mesh.devices.flat) for c in counts)
    ckpts.close()


def test_a_step_saved_on_a_mesh_restores_onto_one_device(tmp_path):
    """The other direction (8 GPUs -> 1 to inspect a run): state saved with the adapters sharded over a 4-device
    mesh and the key replicated there comes back whole on device 0, values equal."""
    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
    on_mesh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", None))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    model = _Adapted()
    model.a.set_value(jax.device_put(jnp.arange(12, dtype=jnp.float32).reshape(4, 3), on_mesh))
    optimizer = LoRAOptimizer(model)
    ckpts = RunCheckpoints(tmp_path / "ckpt", max_to_keep=1)
    ckpts.save(model, optimizer, RunState(step=7, rng=jax.device_put(jax.random.key(7), replicated), cursor=7,
                                          optimizer_steps=0, meta={"config_sha256": "c"}))
    ckpts.close()
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = _Adapted()
    target.a.set_value(jax.device_put(jnp.zeros((4, 3), jnp.float32), one))
    target_optimizer = LoRAOptimizer(target)
    again = RunCheckpoints(tmp_path / "ckpt", max_to_keep=1)
    state = again.restore(7, target, target_optimizer)
    assert state.step == 7 and state.cursor == 7
    assert target.a.get_value().sharding.device_set == {jax.devices()[0]}
    np.testing.assert_array_equal(np.asarray(target.a.get_value()), np.arange(12, dtype=np.float32).reshape(4, 3))
    assert state.rng.sharding.device_set == {jax.devices()[0]}
    np.testing.assert_array_equal(jax.random.key_data(state.rng), jax.random.key_data(jax.random.key(7)))
    again.close()


def _program_text(model, optimizer, rng) -> str:
    """What jit lowers for one update-like program over the run state (its arguments' placement included)."""
    def step(lora, opt_state, key):
        return jax.tree.map(lambda x: x * 2, lora), opt_state, jax.random.split(key)[0]

    return jax.jit(step).lower(nnx.to_pure_dict(nnx.state(model, LoRA)), optimizer.opt_state, rng).as_text()


def _placement(model, optimizer, rng) -> list:
    leaves = [*jax.tree.leaves(nnx.state(model, LoRA)), *jax.tree.leaves(optimizer.opt_state), rng]
    return [(x.sharding, x.committed) for x in leaves]


@pytest.mark.parametrize("devices", [1, 4])
def test_a_fresh_run_state_is_placed_as_a_restore_places_it(tmp_path, devices):
    """A resumed run must run the programs the uninterrupted run compiled (the persistent compilation cache
    is keyed by the lowered program): after `place_as_restored`, a fresh state's arrays have the restored
    state's shardings and commitment, and one program over them lowers to the same text. Without it a fresh
    one-device state is uncommitted and the texts differ (checked first)."""
    def fresh():
        model = _Adapted()
        if devices > 1:
            mesh = jax.make_mesh((devices,), ("x",), devices=jax.devices()[:devices])
            model.a.set_value(jax.device_put(jnp.zeros((2, 3), jnp.float32),
                                             jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())))
        return model, LoRAOptimizer(model)

    model, optimizer = fresh()
    raw_rng = jax.random.key(3)
    ckpts = RunCheckpoints(tmp_path / "ckpt", max_to_keep=1)
    ckpts.save(model, optimizer, RunState(step=1, rng=raw_rng, cursor=1, optimizer_steps=0, meta={}))
    resumed, resumed_optimizer = fresh()
    state = ckpts.restore(1, resumed, resumed_optimizer)
    restored_text = _program_text(resumed, resumed_optimizer, state.rng)
    assert _program_text(model, optimizer, raw_rng) != restored_text  # what place_as_restored is for

    rng = place_as_restored(model, optimizer, raw_rng)
    assert _placement(model, optimizer, rng) == _placement(resumed, resumed_optimizer, state.rng)
    assert _program_text(model, optimizer, rng) == restored_text
    np.testing.assert_array_equal(jax.random.key_data(rng), jax.random.key_data(state.rng))
    ckpts.close()
