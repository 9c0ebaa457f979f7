"""Tensor-parallel use of FSDP-sharded frozen weights, for calls that route few tokens.

FSDP (`rules.weight_spec`) stores each frozen base weight 1/N per device and the layer scan all-gathers a
layer's weights before use. For a decode step (a few rows of one token) or a short train step that moves
every weight of every layer to every device per call, while the activations are kilobytes. Here the
weight stays where it is and the activations move instead: inside a `jax.shard_map` over the weight's FSDP
axes, each device multiplies the replicated activations by its own shard, then
- a sharded dimension the einsum contracts (it appears in x, not in the output): x's matching slice times
  the shard is a partial sum -> `psum` (float32);
- a sharded dimension of the output (also when it appears in x, e.g. a per-head batch dimension): x's
  slice (if any) times the shard is a slice of the output -> `all_gather(tiled=True)` on that dimension.
Both are exact up to float32 summation order, and differentiable (the transposes are a slice and a
reduce-scatter of activation-sized cotangents).

Whether a traced call runs this way is a trace-time switch (`active`), decided by the model from the
call's static token count (`ModelOptions.gather_weights_min_tokens`); `rules.fsdp_split` says which dimension of
a weight FSDP shards and over which mesh axes.

Axis letters: T tokens (any leading axes), V vocab, D model.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from glm52_jax.parallel.rules import Split

_active: list[bool] = [False]


@contextlib.contextmanager
def active(on: bool):
    """Makes model code traced inside keep its large FSDP-sharded weights in place (`on`) or gather them."""
    _active.append(bool(on))
    try:
        yield on
    finally:
        _active.pop()


def enabled() -> bool:
    return _active[-1]


def _dim_of(term: str, letter: str, ndim: int) -> int | None:
    """Position of einsum `letter` in an operand written `term` (may hold '...') of rank `ndim`; None if absent."""
    head, _, tail = term.partition("...")
    if letter in head:
        return head.index(letter)
    if letter in tail:
        return ndim - len(tail) + tail.index(letter)
    return None


def _spec(ndim: int, dim: int | None, axes: tuple[str, ...]) -> P:
    return P(*[(axes if len(axes) > 1 else axes[0]) if i == dim else None for i in range(ndim)])


def _gather(x: jax.Array, axes: tuple[str, ...], dim: int) -> jax.Array:
    """The devices' slices of `x` concatenated on `dim`; the result is the same on every device (invariant),
    so its cotangent goes back by a local slice, without communication."""
    return jax.lax.all_gather(x, axes, axis=dim, tiled=True, to="invarying")


def einsum(spec: str, x: jax.Array, w: jax.Array, split: Split) -> jax.Array:
    """`einsum(spec, x, w)` with float32 accumulation (float32 result, replicated), `w` left sharded on
    `split` (`fsdp_split`): only x (made replicated: few tokens) and the output move. `spec` has two
    operands, x's may use '...'; w's letters are explicit."""
    inputs, out_term = spec.replace(" ", "").split("->")
    x_term, w_term = inputs.split(",")
    dim, axes = split
    letter = w_term[dim]
    x_dim = _dim_of(x_term, letter, x.ndim)
    x = jax.lax.with_sharding_constraint(x, P())

    def local(x_part, w_shard):
        y = jnp.einsum(spec, x_part, w_shard, preferred_element_type=jnp.float32)
        out_dim = _dim_of(out_term, letter, y.ndim)
        if out_dim is None:
            return jax.lax.psum(y, axes)
        return _gather(y, axes, out_dim)

    return jax.shard_map(local, in_specs=(_spec(x.ndim, x_dim, axes), _spec(w.ndim, dim, axes)), out_specs=P(),
                         axis_names=frozenset(axes))(x, w)


def take_rows(table: jax.Array, ids: jax.Array, split: Split) -> jax.Array:
    """`jnp.take(table, ids, axis=0)` of a `[V,D]` table left sharded on `split`: `ids: [...]` int ->
    `[..., D]` in the table's dtype, replicated. Sharded rows: each device looks up the ids it holds (zeros
    for the others) and the shards are summed (exact: one nonzero term); sharded columns: each device's
    columns of every row, all-gathered."""
    dim, axes = split
    ids = jax.lax.with_sharding_constraint(ids, P())

    def local(ids, shard):
        if dim == 1:
            return _gather(jnp.take(shard, ids, axis=0), axes, ids.ndim)
        rows = shard.shape[0]
        local_ids = ids - jax.lax.axis_index(axes) * rows
        held = (local_ids >= 0) & (local_ids < rows)
        found = jnp.take(shard, jnp.where(held, local_ids, 0), axis=0)
        return jax.lax.psum(jnp.where(held[..., None], found, jnp.zeros((), shard.dtype)), axes)

    return jax.shard_map(local, in_specs=(P(), _spec(table.ndim, dim, axes)), out_specs=P(),
                         axis_names=frozenset(axes))(ids, table)
