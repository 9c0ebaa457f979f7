"""Logical axis names -> mesh axes.

Every parameter carries logical axis names (its `out_sharding` metadata) and every large activation
is annotated with `constrain`. Sharding a new layout is then a change to a rules table, not to the
model. Names with no rule, and mesh axes the current mesh lacks, are left unsharded.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import jax
from jax.sharding import PartitionSpec as P

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

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
