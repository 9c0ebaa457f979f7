"""Logical axis names -> mesh axes.

Every parameter carries logical axis names (its `out_sharding` metadata) and every large activation
is annotated with `constrain`. Sharding a new layout is then a change to a rules table, not to the
model. Names with no rule, and mesh axes the current mesh lacks, are left unsharded.

Frozen base weights (FSDP): a table that maps `FSDP` to mesh axes also shards every base weight
(`nnx.Param`, not LoRA) over those of its axes its own logical spec leaves unused, on the largest
dimension they divide (never the stacked 'layers' axis). Such a weight is stored 1/N per device and
gathered back to its logical spec where it is used (`gather_weight`): inside the layer scan's body,
one layer at a time. Weights no dimension of which divides N (small norms) stay replicated.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import jax
from jax.sharding import PartitionSpec as P

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]
Split = tuple[int, tuple[str, ...]]  # a base weight's FSDP-sharded dimension and the mesh axes sharding it

FSDP = "fsdp"  # rules-table name of the mesh axes that shard the frozen base weights; no entry = replicated
STACK_AXIS = "layers"  # the scanned stacks' leading axis (nnx.vmap's PARTITION_NAME): never FSDP-sharded

# The seed's training layout: one device axis shards the sequence in attention and the experts in
# the MoE ("EP folded onto CP"); `data` and `tensor` exist for other layouts.
DEFAULT_RULES: Rules = (
    ("batch", "data"),
    ("seq", "context"),
    ("experts", "expert"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
)

_active_rules: list[Rules] = [DEFAULT_RULES]


class axis_rules:
    """Context manager that installs a rules table for model code traced inside it."""

    def __init__(self, rules: Rules):
        self.rules = tuple(rules)

    def __enter__(self):
        _active_rules.append(self.rules)
        return self.rules

    def __exit__(self, *exc):
        _active_rules.pop()


def current_rules() -> Rules:
    return _active_rules[-1]


def logical_to_spec(axes: Sequence[str | None], rules: Rules | None = None,
                    mesh_axes: Iterable[str] | None = None) -> P:
    """PartitionSpec for logical `axes`; a mesh axis is used at most once (first claim wins)."""
    table = dict(current_rules() if rules is None else rules)
    available = None if mesh_axes is None else set(mesh_axes)
    used: set[str] = set()
    out = []
    for name in axes:
        target = table.get(name) if name is not None else None
        targets = (target,) if isinstance(target, str) else tuple(target or ())
        keep = tuple(t for t in targets if (available is None or t in available) and t not in used)
        used.update(keep)
        out.append(None if not keep else keep[0] if len(keep) == 1 else keep)
    return P(*out)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Sharding constraint from logical names; a no-op outside a mesh context."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    if len(axes) != x.ndim:
        raise ValueError(f"constrain: {len(axes)} axis names {tuple(axes)} for an array of rank {x.ndim}")
    spec = logical_to_spec(axes, mesh_axes=mesh.axis_names)
    return jax.lax.with_sharding_constraint(x, spec)


def weight_spec(axes: Sequence[str | None], shape: Sequence[int], mesh, rules: Rules | None = None) -> P:
    """PartitionSpec of a frozen base weight of logical `axes` and `shape` on `mesh` (a Mesh or
    AbstractMesh): `logical_to_spec`, plus the FSDP axes (see the module doc) on the largest free
    dimension whose size they divide; the first such dimension on a tie, none when none divides."""
    table = dict(current_rules() if rules is None else rules)
    spec = logical_to_spec(axes, tuple(table.items()), mesh.axis_names)
    target = table.get(FSDP)
    targets = (target,) if isinstance(target, str) else tuple(target or ())
    used = {a for part in spec for a in ((part,) if isinstance(part, str) else (part or ()))}
    fsdp = tuple(a for a in targets if a in mesh.axis_names and a not in used and mesh.shape[a] > 1)
    if not fsdp:
        return spec
    ways = math.prod(mesh.shape[a] for a in fsdp)
    free = [i for i, (name, part, size) in enumerate(zip(axes, spec, shape))
            if name != STACK_AXIS and part is None and size % ways == 0]
    if not free:
        return spec
    dim = max(free, key=lambda i: (shape[i], -i))
    parts = list(spec)
    parts[dim] = fsdp[0] if len(fsdp) == 1 else fsdp
    return P(*parts)


def fsdp_split(axes: Sequence[str | None], shape: Sequence[int]) -> Split | None:
    """Which dimension of a base weight of logical `axes` and `shape` FSDP shards under the current mesh and
    rules table (`weight_spec`), and over which mesh axes; None outside a mesh or when FSDP leaves it whole."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or len(axes) != len(shape):
        return None
    full, logical = weight_spec(axes, shape, mesh), logical_to_spec(axes, mesh_axes=mesh.axis_names)
    for dim, (with_fsdp, without) in enumerate(zip(full, logical)):
        if with_fsdp != without:
            return dim, ((with_fsdp,) if isinstance(with_fsdp, str) else tuple(with_fsdp))
    return None


def gather_weight(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """A base weight `x` of logical `axes` constrained to its logical spec without the FSDP axes: the
    all-gather of its FSDP shards, where it is about to be used. A no-op when FSDP leaves `x` alone
    and outside a mesh context.

    Left sharded in a gathered-weights program, GSPMD gathered the weights anyway (measured on the tiny folded=8
    decode plan), in places of its own choosing; a few-token call keeps them in place explicitly instead
    (`parallel.tensor_parallel`)."""
    if len(axes) == x.ndim and fsdp_split(axes, x.shape) is None:
        return x
    return constrain(x, axes)  # to the spec without the FSDP axes (a wrong rank is refused there)
