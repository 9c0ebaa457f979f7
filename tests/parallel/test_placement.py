"""The replicated-array audit on the 8 virtual CPU devices (the launcher's --audit_replicated_mib)."""

import jax
import jax.numpy as jnp
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
