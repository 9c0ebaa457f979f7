"""Context-parallel DSA for whole-sequence forwards (training, uncached prefill).

Queries stay sharded over the mesh axes the `seq` rule names; inside a `jax.shard_map` each device
all-gathers only the key side of a layer (latent c_kv C + rope key R + indexer key I per token),
scores its own queries against every causal key with the streaming top-k (so the global top-k is
exact, not merged from approximations) and attends to its selected rows. The all-gather's
transpose (a reduce-scatter) carries the key-side gradients back to their owners.

Layout: causal work per query grows with its position, so contiguous shards leave the first
device almost idle and the last one with ~2x the mean (benchmarks/cp_balance.py). The `zigzag`
layout cuts the sequence into 2N chunks and gives device i chunks i and 2N-1-i: the model runs
on the permuted sequence (ids and positions permuted on entry, hidden states back on exit) and
the gathered keys are put back in sequence order, where the streaming top-k's causal block
skipping works. The length is padded to a multiple of 2N with tokens at later positions, which
no real query can see.

Axis letters: B batch, S sequence (local inside shard_map), L padded length, C kv_lora, R rope,
I indexer dim, H heads, K top-k, N devices on the sequence axes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from glm52_jax.model.indexer import streaming_topk
from glm52_jax.model.sparse_attention import array_rows, sparse_mla_rows
from glm52_jax.parallel.rules import logical_to_spec

LAYOUTS = ("zigzag", "contiguous", "off")


@dataclasses.dataclass(frozen=True)
class Layout:
    """A whole-sequence CP plan: `axes` (mesh axes of `seq`, `ways` devices), `layout`, real
    length `seq` and padded length `padded`."""

    axes: tuple[str, ...]
    ways: int
    layout: str
    seq: int
    padded: int

    @property
    def chunks(self) -> int:
        return 2 * self.ways if self.layout == "zigzag" else self.ways


def seq_axes(mesh) -> tuple[str, ...]:
    """Mesh axes (of size > 1) that the active rules give the `seq` logical axis."""
    part = logical_to_spec(("seq",), mesh_axes=mesh.axis_names)[0]
    names = () if part is None else (part,) if isinstance(part, str) else tuple(part)
    return tuple(n for n in names if mesh.shape[n] > 1)


def plan_layout(seq: int, layout: str, mesh=None) -> Layout | None:
    """The CP layout for a whole-sequence forward of `seq` tokens, or None (no mesh, the sequence
    is not sharded, or `layout="off"`: GSPMD places the attention)."""
    if layout not in LAYOUTS:
        raise ValueError(f"context_parallel: expected one of {LAYOUTS}, got {layout!r}")
    if layout == "off":
        return None
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh is None or mesh.empty:
        return None
    axes = seq_axes(mesh)
    if not axes:
        return None
    ways = math.prod(mesh.shape[a] for a in axes)
    chunks = 2 * ways if layout == "zigzag" else ways
    return Layout(axes, ways, layout, seq, -(-seq // chunks) * chunks)


_active: list[Layout | None] = [None]


@contextlib.contextmanager
def active(layout: Layout | None):
    """Makes `layout` the one attention layers traced inside use (trace-time, like axis rules)."""
    _active.append(layout)
    try:
        yield layout
    finally:
        _active.pop()


def current() -> Layout | None:
    return _active[-1]


# -- sequence order <-> device layout (static permutations of whole chunks) -----------------------

def to_layout(x: jax.Array, lay: Layout, axis: int = 1) -> jax.Array:
    """Sequence order (length `padded` on `axis`) -> the layout's order (device-major)."""
    if lay.layout != "zigzag":
        return x
    x = jnp.moveaxis(x, axis, 0)
    n = lay.ways
    chunks = x.reshape(2 * n, -1, *x.shape[1:])
    pairs = jnp.stack([chunks[:n], chunks[n:][::-1]], axis=1)  # device i: chunks i and 2n-1-i
    return jnp.moveaxis(pairs.reshape(x.shape), 0, axis)


def from_layout(x: jax.Array, lay: Layout, axis: int = 1) -> jax.Array:
    """Inverse of `to_layout`."""
    if lay.layout != "zigzag":
        return x
    x = jnp.moveaxis(x, axis, 0)
    n = lay.ways
    pairs = x.reshape(n, 2, -1, *x.shape[1:])
    chunks = jnp.concatenate([pairs[:, 0], pairs[:, 1][::-1]], axis=0)
    return jnp.moveaxis(chunks.reshape(x.shape), 0, axis)


def pad_sequence(ids: jax.Array, positions: jax.Array, lay: Layout) -> tuple[jax.Array, jax.Array]:
    """`ids: [B,S]`, `positions: [S]` padded to `lay.padded`; pads sit after every real token."""
    extra = lay.padded - lay.seq
    if not extra:
        return ids, positions
    ids = jnp.pad(ids, ((0, 0), (0, extra)))
    tail = positions[-1] + 1 + jnp.arange(extra, dtype=positions.dtype)
    return ids, jnp.concatenate([positions, tail])


# -- the attention core --------------------------------------------------------------------------

def cp_sparse_attention(lay: Layout, q_lat, q_rope, c_kv, k_rope, positions, index, prev_topk, *,
                        index_topk: int, index_scale: float, softmax_scale: float, indexer_query_block: int,
                        indexer_key_block: int, attention_query_block: int):
    """Sparse MLA of sharded queries over all-gathered keys, in the layout's order.

    q_lat: [B,L,H,C], q_rope: [B,L,H,R], c_kv: [B,L,C], k_rope: [B,L,R], positions: [L] (all in
    layout order, sharded on `lay.axes`); index: (iq [B,L,Hi,I], iw [B,L,Hi], ik [B,L,I]) for a
    layer with its own indexer, else None and `prev_topk: [B,L,K]`. Returns (out_lat [B,L,H,C],
    top-k [B,L,K] of key indices in sequence order).
    """
    axes = lay.axes
    seq_spec = P(None, axes)
    pos_spec = P(axes)

    def gather_keys(x, axis):  # every device's shard, back in sequence order
        return from_layout(jax.lax.all_gather(x, axes, axis=axis, tiled=True), lay, axis=axis)

    def per_device(q_lat, q_rope, c_kv, k_rope, positions, index, prev_topk):
        key_pos = gather_keys(positions, 0)
        if index is not None:
            iq, iw, ik = index
            topk = streaming_topk(iq, iw, gather_keys(ik, 1), positions, key_pos, index_topk, scale=index_scale,
                                  query_block=indexer_query_block, key_block=indexer_key_block)
        else:
            topk = prev_topk
        rows = array_rows(gather_keys(c_kv, 1), gather_keys(k_rope, 1))
        out = sparse_mla_rows(q_lat, q_rope, rows, topk, scale=softmax_scale, query_block=attention_query_block)
        return out, topk

    index_specs = None if index is None else (seq_spec, seq_spec, seq_spec)
    topk_spec = None if prev_topk is None else seq_spec
    fn = jax.shard_map(per_device, in_specs=(seq_spec, seq_spec, seq_spec, seq_spec, pos_spec, index_specs, topk_spec),
                       out_specs=(seq_spec, seq_spec), axis_names=frozenset(axes),
                       # The indexer's and attention's loops start from constants; every input and
                       # output is sharded on `axes`, so varying-axis typing adds nothing here.
                       check_vma=False)
    return fn(q_lat, q_rope, c_kv, k_rope, positions, index, prev_topk)
