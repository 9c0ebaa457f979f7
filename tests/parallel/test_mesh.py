"""Mesh specs: the seed's folded topology, orthogonal layouts, rules, and errors."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from glm52_jax.parallel import rules
from glm52_jax.parallel.mesh import FOLDED_AXIS, MeshSpec, parse_mesh


def test_seed_topology_is_one_folded_axis():
    spec = MeshSpec.seed_training(32)
    assert spec.describe() == "DP1/TP1/CP32/EP32/PP1"
    assert spec.axis_names == ("data", FOLDED_AXIS, "tensor") and spec.shape == (1, 32, 1) and spec.size == 32
    table = spec.rules()
    # Sequence (attention) and experts (MoE) land on the same 32-way axis.
    assert rules.logical_to_spec(("batch", "seq", "embed"), table) == P("data", FOLDED_AXIS, None)
    assert rules.logical_to_spec(("experts", "embed", "mlp"), table) == P(FOLDED_AXIS, None, "tensor")


def test_orthogonal_layout_on_eight_devices():
    spec = parse_mesh("context=4,expert=2")
    mesh = spec.make()
    assert dict(mesh.shape) == {"data": 1, "context": 4, "expert": 2, "tensor": 1}
    assert spec.describe() == "DP1/TP1/CP4/EP2/PP1"
    x = jax.device_put(jnp.zeros((2, 64, 8)), jax.sharding.NamedSharding(
        mesh, rules.logical_to_spec(("batch", "seq", "embed"), spec.rules(), mesh.axis_names)))
    # Each device holds a quarter of the sequence (replicated over the 2-way expert axis).
    assert {s.data.shape for s in x.addressable_shards} == {(2, 16, 8)}


def test_folded_mesh_on_eight_devices():
    mesh = parse_mesh("folded=8").make()
    assert dict(mesh.shape) == {"data": 1, FOLDED_AXIS: 8, "tensor": 1}
    w = jax.device_put(jnp.zeros((8, 4, 4)), jax.sharding.NamedSharding(
        mesh, rules.logical_to_spec(("experts", "embed", "mlp"), MeshSpec(context=8, folded=True).rules(),
                                    mesh.axis_names)))
    assert {s.data.shape for s in w.addressable_shards} == {(1, 4, 4)}  # one expert per device


@pytest.mark.parametrize("text,match", [
    ("context=3", "needs 3 devices"),
    ("context=0", "positive integer"),
    ("pipeline=2", "unknown axis"),
    ("context", "name=integer"),
])
def test_errors(text, match):
    with pytest.raises(ValueError, match=match):
        parse_mesh(text).make()


def test_folded_rejects_a_different_expert_size():
    with pytest.raises(ValueError, match="folded"):
        MeshSpec(context=4, expert=2, folded=True)
