"""The replicated-array audit on the 8 virtual CPU devices (the launcher's --audit_replicated_mib)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from glm52_jax.parallel.placement import replicated_live_arrays


def _mine(found: list[str], shapes: tuple[str, ...]) -> list[str]:
    """The audit's lines about this test's arrays (other tests' arrays may still be alive)."""
    return sorted(f for f in found if f.startswith(shapes))


def test_the_audit_lists_whole_copies_on_several_devices_only():
    mesh = jax.make_mesh((8,), ("x",))
    shapes = ("(384, 1024) ", "(1024, 768) ", "(16, 24) ", "(640, 1024) ")
    whole = jax.device_put(jnp.zeros((384, 1024), jnp.float32), NamedSharding(mesh, PartitionSpec()))  # 1.5 MiB
    split = jax.device_put(jnp.ones((1024, 768), jnp.float32), NamedSharding(mesh, PartitionSpec("x")))  # 3 MiB
    small = jax.device_put(jnp.ones((16, 24), jnp.float32), NamedSharding(mesh, PartitionSpec()))
    one_device = jnp.ones((640, 1024), jnp.float32)  # 2.5 MiB on one device: not a copy per device
    found = _mine(replicated_live_arrays(2**20), shapes)
    assert len(found) == 1 and found[0].startswith("(384, 1024) float32 NamedSharding(mesh=Mesh('x': 8"), found
    assert _mine(replicated_live_arrays(2 * 2**20), shapes) == []  # 1.5 MiB is under a 2 MiB limit
    assert _mine(replicated_live_arrays(1), shapes)[0].startswith("(16, 24) float32")
    del whole, split, small, one_device


def _device_bytes(arrays, device) -> int:
    """Bytes of `arrays` that live on `device` (their addressable shards there)."""
    return sum(s.data.nbytes for a in arrays for s in a.addressable_shards if s.device == device)


def test_fsdp_places_each_non_expert_weight_one_nth_per_device():
    """weight_sharding="fsdp" (the default) on folded=8: every device holds 1/8 of each non-expert base weight
    (the tiny model's dimensions all divide by 8), the routed experts stay split by expert, LoRA as before."""
    from flax import nnx

    from glm52_jax import config
    from glm52_jax.model.lora import LoRA, LoRAConfig
    from glm52_jax.model.options import ModelOptions
    from glm52_jax.model.transformer import GlmMoeDsa
    from glm52_jax.parallel.mesh import parse_mesh
    from glm52_jax.parallel.placement import place_model
    from glm52_jax.parallel.rules import axis_rules

    opts = ModelOptions(param_dtype=jnp.float32, lora=LoRAConfig(rank=4, alpha=8.0))
    graphdef, shapes = nnx.split(nnx.eval_shape(lambda: GlmMoeDsa(
        config.tiny(num_hidden_layers=2, indexer_types=("full", "shared")), opts, rngs=nnx.Rngs(0))))
    model = nnx.merge(graphdef, jax.tree.map(lambda a: np.ones(a.shape, a.dtype), shapes))  # no init compiles
    placed = {}
    for sharding in ("fsdp", "replicated"):
        spec = parse_mesh("folded=8", sharding)
        with axis_rules(spec.rules()):
            placed[sharding] = nnx.split(place_model(model, spec.make()), nnx.Param, LoRA)
    experts = ("w_gate", "w_up", "w_down")
    for sharding, (_, params, _) in placed.items():
        base = [v.get_value() for k, v in nnx.to_flat_state(params) if k[-1] not in experts]
        total = sum(a.nbytes for a in base)
        for device in jax.devices():
            assert _device_bytes(base, device) == (total // 8 if sharding == "fsdp" else total), (sharding, device)
    for part in (1, 2):  # LoRA and all of the base weights' layouts other than the non-expert ones: unchanged
        same = [(k, v.get_value().sharding.spec) for k, v in nnx.to_flat_state(placed["fsdp"][part])
                if part == 2 or k[-1] in experts]
        assert same == [(k, v.get_value().sharding.spec) for k, v in nnx.to_flat_state(placed["replicated"][part])
                        if part == 2 or k[-1] in experts]
