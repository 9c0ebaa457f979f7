"""Expert-parallel routed experts: `jax.shard_map` + all-to-all dispatch/combine, dropless.

Same math as `grouped_mlp.experts_ragged` (one device): every token-expert pair goes to the device
that owns its expert, runs there through the same `grouped_mlp.grouped_swiglu` (`lax.ragged_dot`
+ the routed-expert LoRA deltas on the same rows), comes back, and is combined with the routing
weight. Nothing is dropped, whatever the routing; results equal `experts_ragged` up to float
reassociation of the final scatter-add.

Layout (N = size of the expert mesh axis, the axis the `experts` logical axis maps to):
- expert kernels `[E,D,I] / [E,I,D]` and LoRA `A [E,in,r]`, `B [E,r,out]` are sharded on E over
  the expert axis: each device holds E/N consecutive experts (device n owns experts
  `[n*E/N, (n+1)*E/N)`);
- tokens `[T,D]` (and weights/experts `[T,K]`) are sharded on T over `token_axes`, which always
  includes the expert axis. Folded layout (`cp_ep` shards both `seq` and `experts`): T is sharded
  over `cp_ep` exactly as attention left it, so entering the shard_map moves nothing. Orthogonal
  layout (context C x expert N): T, sharded over `context` outside the MoE, is split further over
  `expert` inside it (token_axes `("context", "expert")`, context-major), so each of the N devices
  of an expert group routes a distinct 1/N of its context shard instead of all N repeating the same
  work. Entering is a local slice (no communication); XLA all-gathers the output over `expert` if
  the consumer wants it back on `context` only. The all-to-alls run over the expert axis only, i.e.
  within each context group.

Two transports (`impl`):
- "dense" (default, runs on XLA:CPU, which lacks `ragged_all_to_all`): a fixed-capacity
  `lax.all_to_all`. Each device sends every destination a buffer of C = T_local*K rows, the worst
  case (all of its pairs to one device), so it is dropless by construction. With a
  `receive_capacity`, chunks of receive_capacity x T_local*K/N rows instead, in passes as for the
  ragged transport below (`_dense_body`). Results travel back in the activations' dtype. Memory per device and
  per MoE layer: send and receive buffers of N*C*D activations each (N times the
  T_local*K*D of the ragged path), plus the expert intermediates over the N*C received rows
  (`[N*C, I]` for gate and up). Padding rows carry the sentinel local id E/N, sort after the real
  rows, are excluded from `group_sizes` and so come out of `ragged_dot` (and its gradients) as
  zeros; compute on GPU-style grouped matmuls skips them, XLA:CPU's ragged_dot may not.
- "ragged" (for GPU): `lax.ragged_all_to_all` sends exactly the rows each destination needs
  (send buffer T_local*K rows). Offsets come from an all-gather of the [N] per-destination counts.
  The results travel back in the activations' dtype (bf16 on the real run: half the bytes of
  float32). Checked on CPU through an emulated transport in the tests (XLA:CPU cannot compile it)
  and compiled deviceless for CUDA by plan mode. "auto" picks ragged when the program is lowered
  for a GPU.
  Receive buffer: `receive_capacity` x T_local*K rows (static shapes need a bound; balanced routing
  brings each device T_local*K rows on average). 0 sizes it for the worst case, N*T_local*K rows
  (every device's pairs to this one): one pass always, but every op on the received rows (sort,
  expert matmuls, casts, the return) then runs over N times the live rows (at 2M on 32 devices:
  65,536 rows of which ~2,048 are live, per round). With a capacity C, a round runs in passes:
  each destination takes the rows of its receive stream (sources in order) in windows of C, pass p
  the window [p*C, (p+1)*C); the pass count is the same on every device (from the all-gathered
  counts), 1 when no device receives more than C, so nothing is dropped whatever the routing.
  The passes are a `lax.while_loop` (data-dependent trip count) with a custom VJP that loops the
  per-pass VJPs the same way (`_sum_of_passes`).

Software pipelining (`exchange_blocks`, default 2): each pass's exchange goes in windows (the pass's rows per
destination split into consecutive slices), and window b+1's rows are sent before window b's experts run, and
window b's results go back before window b+1's experts run (`_pipelined_pass`). XLA:GPU compiles every
all-to-all as an async start/done pair and keeps one in flight at a time; its scheduler places the other
window's expert matmuls between them, so the exchange of one window overlaps the experts of another (checked
on the deviceless H20 compile by tests/plan/test_ep_overlap.py). The local expert ids ride along as one more
column of the rows (exact small numbers in the activation dtype) rather than in a second collective, which would
queue between a window's rows and the next window's. Windows never go under MIN_CHUNK_ROWS rows per
destination. Results do not depend on the window count (each pair lies in exactly one window).

Two stages (`node_devices` > 0, dense transport; `_node_body`): where consecutive devices of the expert axis share
a node, a device's tokens go once to the device of the same local rank on every node, which forwards each pair
whose expert its node owns over NVLink (the dense exchange above, within the node) and returns one weighted sum per
token: the network carries a token (nodes - 1) times each way, not once per expert.

Any token count runs expert-parallel (`pad_tokens`): a decode step's few tokens are padded with
zero-weight tokens to one per token shard, so a device's tokens travel to the experts' owners and
back and no device ever gathers the expert weights (GSPMD placing `experts_ragged` on sharded
experts all-gathered a layer's whole expert stack, 6.4 GB at GLM-5.2 sizes, per layer and step).

Axis letters: T tokens (L: this device's tokens), D model, I expert intermediate, E experts
(El = E/N local experts), K experts per token, N expert-axis size, C = L*K rows per destination,
r LoRA rank.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from glm52_jax.choices import MOE_TRANSPORTS
from glm52_jax.kernels import targets_gpu
from glm52_jax.model import fp8
from glm52_jax.model.grouped_mlp import ExpertAdapters, Fp8Rows, experts_ragged, fp8_rows, grouped_swiglu, lora_arrays
from glm52_jax.model.loop_scopes import PASS_LOOP  # the pass loop's scope, for plan mode's estimate
from glm52_jax.parallel.rules import logical_to_spec

# A bounded exchange keeps at least this many rows per destination (a few tokens' rounds, e.g. a decode step's
# 8 pairs per device, stay one pass: below this the exchange is all latency, and a second pass doubles it).
MIN_CHUNK_ROWS = 16
# The two-stage exchange's windows keep at least this many of a device's tokens (a decode step's one token per
# device stays one window).
MIN_WINDOW_TOKENS = 4


def _mesh_axes(spec_entry) -> tuple[str, ...]:
    if spec_entry is None:
        return ()
    return (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry)


def default_axes(mesh) -> tuple[str | None, tuple[str, ...]]:
    """(expert axis, token axes) from the current logical rules on `mesh`.

    The expert axis is where the `experts` logical axis goes. The MoE flattens `[B,S,D]` to
    `[T,D]` (batch-major), so the tokens arrive sharded over the `batch` then the `seq` mesh axes;
    the expert axis is appended when it does not shard them already (orthogonal layout).
    """
    names = mesh.axis_names
    expert = _mesh_axes(logical_to_spec(("experts",), mesh_axes=names)[0])
    if len(expert) > 1:
        raise NotImplementedError(f"experts sharded over several mesh axes {expert}; expected one")
    expert_axis = expert[0] if expert else None
    spec = logical_to_spec(("batch", "seq"), mesh_axes=names)
    tokens = tuple(a for entry in spec for a in _mesh_axes(entry) if mesh.shape[a] > 1 or a == expert_axis)
    if expert_axis is not None and expert_axis not in tokens:
        tokens = tokens + (expert_axis,)
    return expert_axis, tokens


def _local_experts(rows: jax.Array, local_ids: jax.Array, n_local: int, w_gate, w_up, w_down, lora, kernels,
                   rows_hint):
    """SwiGLU of this device's experts on received rows, in any order.

    `rows: [R,D]`, `local_ids: [R]` in [0, El] (El = padding), `lora`: `grouped_mlp.ExpertLoRA` on the
    local expert shards or None -> `[R,D]` in the rows' dtype, same row order; padding rows give zeros. Sorting
    by local expert makes each expert's rows contiguous for `grouped_swiglu`; padding (id El) sorts
    last and lies outside every group. kernels / rows_hint: as in `grouped_swiglu` (rows_hint: the rows
    expected to arrive with balanced routing, for plan mode's FLOP count of the grouped-matmul kernel).
    """
    order = jnp.argsort(local_ids, stable=True)
    group_sizes = jnp.bincount(local_ids, length=n_local).astype(jnp.int32)  # id El falls outside `length`
    sorted_rows = rows[order]
    out_dtype = rows.dtype
    if rows.dtype == jnp.uint8:  # FP8 rows as sent (`Fp8Rows.to_bytes`); results in the weights' dtype
        sorted_rows, out_dtype = Fp8Rows.from_bytes(sorted_rows, w_gate.shape[1]), w_gate.dtype
    y = grouped_swiglu(sorted_rows, group_sizes, w_gate, w_up, w_down, lora, kernels, rows_hint)
    # Undo the sort: row order[j] of the input is row j of y. Scattered in the rows' dtype (the results travel back
    # in it): float32 zeros, their copy and a float32 scatter before the cast cost 3x the bytes. (A gather by the
    # inverse permutation, fused with the cast, costs less still, but XLA:GPU then scheduled no expert matmul
    # between a window's all-to-all start and done: tests/plan/test_ep_overlap.py.)
    return jnp.zeros(y.shape, out_dtype).at[order].set(y.astype(out_dtype))


def _dispatch_plan(experts: jax.Array, n_local: int, n_dev: int):
    """Sort this device's pairs by expert; per pair its destination device and slot there.

    `experts: [L,K]` -> order [L*K] (pair index, expert-sorted), dest [L*K], slot [L*K] (row within
    the destination's chunk), counts [N] (pairs per destination), starts [N] (first sorted row of
    each destination), local id [L*K] (expert within the destination); per-pair arrays in sorted
    order. Experts are owned in consecutive blocks of El, so
    sorting by expert also groups the pairs by destination.
    """
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sorted_e = flat[order]
    dest = sorted_e // n_local
    counts = jnp.bincount(dest, length=n_dev).astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts  # exclusive cumsum: first sorted row of each destination
    slot = jnp.arange(flat.shape[0], dtype=jnp.int32) - starts[dest]
    return order, dest, slot, counts, starts, (sorted_e % n_local).astype(jnp.int32)


def _with_scales(lora_ab, scales):
    """The (A, B, scale) triples `_local_experts` takes, from the adapter arrays and their static scales."""
    return tuple(None if ab is None else (*ab, sc) for ab, sc in zip(lora_ab, scales, strict=True))


def _exchange(one_pass, passes, single: bool, diff, ints):
    """`one_pass(0, ...)` when a single pass holds every row (`single`, static), else the sum over `passes`: pass 0
    in line (every round runs it) and passes 1.. in a loop (none with balanced routing). In line, the first pass's
    exchanges sit in the same straight-line program as the work around them, so XLA's scheduler can overlap them
    with it (it does not move an async collective across a while loop)."""
    first = one_pass(0, diff, ints)
    if single:
        return first
    return jax.tree.map(jnp.add, first, _sum_of_passes(one_pass, passes, diff, ints, start=1))


def _combine(back, weights, order, token_of, tokens: int):
    """Per-pair results `back: [L*K,D]` (expert-sorted) weighted by their routing weights and summed per
    token -> `[L,D]` float32."""
    y_pairs = back.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    return jnp.zeros((tokens, back.shape[-1]), jnp.float32).at[token_of].add(y_pairs)


def _sum_of_passes(term, count, diff, ints, start: int = 0):
    """`sum(term(p, diff, ints) for p in range(start, count))` with a data-dependent `count` (int32 scalar, the
    same on every device), differentiable in `diff`: a `lax.while_loop` forward, and a backward that
    loops the same way over each pass's VJP (recomputing the pass; only the inputs are saved)."""

    @jax.custom_vjp
    def run(count, diff, ints):
        def body(carry):
            p, acc = carry
            return p + 1, jax.tree.map(jnp.add, acc, term(p, diff, ints))

        zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(term, jnp.int32(0), diff, ints))
        with jax.named_scope(PASS_LOOP):
            return jax.lax.while_loop(lambda c: c[0] < count, body, (jnp.int32(start), zeros))[1]

    def fwd(count, diff, ints):
        return run(count, diff, ints), (count, diff, ints)

    def bwd(res, cot):
        count, diff, ints = res

        def body(carry):
            p, acc = carry
            _, vjp = jax.vjp(lambda d: term(p, d, ints), diff)
            return p + 1, jax.tree.map(jnp.add, acc, vjp(cot)[0])

        with jax.named_scope(PASS_LOOP):
            grads = jax.lax.while_loop(lambda c: c[0] < count, body,
                                       (jnp.int32(start), jax.tree.map(jnp.zeros_like, diff)))
        return None, grads[1], None

    run.defvjp(fwd, bwd)
    return run(count, diff, ints)


def _dense_body(x, weights, experts, w_gate, w_up, w_down, lora_ab, *, lora_scales, axis, n_dev, kernels,
                receive_capacity=0.0, exchange_blocks=2, groups=None, live_rows=None):
    """Per-device body of the fixed-size `all_to_all` transport (see the module docstring): chunks of c rows
    per destination, c = L*K (the worst case, one pass) or `ceil(receive_capacity * L*K / N)` (balanced routing
    sends each destination L*K/N rows on average); pass p carries rows [p*c, (p+1)*c) of every (source,
    destination) chunk, as many passes as the fullest chunk on any device needs (`_sum_of_passes`). A pass
    exchanges its chunk in `exchange_blocks` windows of h = c/blocks rows (`_blocks`), software-pipelined; window b
    takes every blocks-th slot from b, so a chunk that fills only part of the pass splits evenly over the windows.

    groups: the exchange runs within these groups of N devices each (`axis_index_groups`; None: the whole axis, N
    its size). A pair whose expert id is N*El or more goes nowhere and adds nothing (the node exchange's pairs of
    other nodes). live_rows: the pairs that go somewhere on average (default L*K), what `receive_capacity` scales."""
    tokens, k = experts.shape
    n_local = w_gate.shape[0]
    rows = tokens * k
    live = rows if live_rows is None else live_rows
    cap = rows if receive_capacity == 0 else min(rows, max(MIN_CHUNK_ROWS, math.ceil(receive_capacity * live / n_dev)))
    blocks = _blocks(cap, exchange_blocks, MIN_CHUNK_ROWS)
    h = -(-cap // blocks)  # rows per destination of one window
    span = blocks * h  # slots of each chunk one pass carries (>= cap)
    order, dest, slot, counts, _, local = _dispatch_plan(experts, n_local, n_dev)
    token_of = order // k

    def exchange(a):
        return jax.lax.all_to_all(a, axis, 0, 0, tiled=True, axis_index_groups=groups)

    def dispatch(p, b, payload, ints):
        """Window b of pass p out to the experts' owners -> (received: rows [N*h,D] and their local ids [N*h], packed
        or apart; (the sorted pair in each sent slot [N,h] (R = none), its token [N,h] (L = none)))."""
        x_tokens = payload[0]
        dest, slot, local, token_of = ints
        # Row j of window b's chunk for d is slot p*span + j*blocks + b; pairs outside the window go to the
        # out-of-range row `h` (dropped). The rows are gathered slot by slot from the tokens: only the window's
        # N*h rows are read and written, never a row per pair. Unused slots send a zero row with the padding id El.
        # all_to_all: chunk n of the sender's axis 0 goes to device n; the receiver stacks the chunks by source, so
        # recv[s] is what device s sent here.
        at = slot - p * span
        window = jnp.where((at >= 0) & (at < span) & (at % blocks == b) & (dest < n_dev), at // blocks, h)
        pair_at = jnp.full((n_dev, h), rows, jnp.int32).at[dest, window].set(jnp.arange(rows, dtype=jnp.int32),
                                                                           mode="drop")
        token_at = jnp.append(token_of, tokens)[pair_at]  # token `tokens`: the zero row appended below
        send = jnp.pad(x_tokens, ((0, 1), (0, 0)))[token_at]
        send_ids = jnp.append(local, n_local)[pair_at]
        if _ids_ride_along(send.dtype, n_local):
            received = exchange(_pack(send, send_ids)).reshape(n_dev * h, -1)
        else:
            received = (exchange(send).reshape(n_dev * h, -1), exchange(send_ids).reshape(-1))
        return received, (pair_at, token_at)

    def combine(y, state, payload, ints):
        """Window results `y: [N*h,D]` back, weighted by their pairs' routing weights and summed per token -> [L,D]
        float32 (zeros from unused slots)."""
        pair_at, token_at = state
        pair_weights = payload[1]
        back = exchange(y.reshape(n_dev, h, -1))  # back[d, c] answers send[d, c]
        w_at = jnp.append(pair_weights, 0.0)[pair_at]
        summed = jnp.zeros((tokens + 1, back.shape[-1]), jnp.float32).at[token_at].add(
            back.astype(jnp.float32) * w_at[..., None])
        return summed[:tokens]

    one_pass = _pipelined_pass(dispatch, combine, blocks, n_local, lora_scales, kernels, -(-live // blocks))
    passes = jnp.maximum(1, (jax.lax.pmax(jnp.max(counts), axis) + span - 1) // span).astype(jnp.int32)
    pair_weights = weights.reshape(-1)[order].astype(jnp.float32)
    return _exchange(one_pass, passes, span >= rows, ((x, pair_weights), w_gate, w_up, w_down, lora_ab),
                     (dest, slot, local, token_of))


def node_groups(n_dev: int, node_devices: int) -> tuple[list[list[int]], list[list[int]]]:
    """(across: the devices of one local rank on every node, within: each node's devices) as axis-index groups of
    an expert axis of `n_dev` devices whose consecutive `node_devices` share a node."""
    nodes = n_dev // node_devices
    across = [[node * node_devices + rank for node in range(nodes)] for rank in range(node_devices)]
    within = [[node * node_devices + rank for rank in range(node_devices)] for node in range(nodes)]
    return across, within


def _node_body(x, weights, experts, w_gate, w_up, w_down, lora_ab, **static):
    """`_node_exchange` (the two-stage exchange); FP8 experts (`fp8.Fp8MmaWeight`) take their rows as they travel:
    quantized once per token at its device (`Fp8Rows`, 6,336 bytes a GLM-5.2 row against bf16's 12,288), the same
    numbers the experts would quantize on arrival. Its backward is the VJP of the exchange of the float rows (the
    same forward values, straight through the quantization, as `grouped_mlp` differentiates FP8 experts)."""
    args = (x, weights, experts, w_gate, w_up, w_down, lora_ab)
    if not isinstance(w_gate, fp8.Fp8MmaWeight):
        return _node_exchange(*args, **static)

    @jax.custom_vjp
    def run(*args):
        return _node_exchange(*args, **static, fp8_transit=True)

    def bwd(saved, ct):
        _, vjp = jax.vjp(lambda *a: _node_exchange(*a, **static), *saved)
        return vjp(ct)

    run.defvjp(lambda *args: (run(*args), args), bwd)
    return run(*args)


def _node_exchange(x, weights, experts, w_gate, w_up, w_down, lora_ab, *, lora_scales, axis, n_dev, kernels,
                   receive_capacity=0.0, exchange_blocks=2, node_devices, fp8_transit=False):
    """Per-device body of the two-stage exchange (`node_devices` consecutive devices of the expert axis share a
    node: NVLink within, the network across).

    Across nodes each token travels once per node, not once per expert: a window of this device's tokens (rows and
    routing) goes to the device of the same local rank on every node (an all_to_all of the same rows to each, within
    the `across` group), which then sends each pair whose expert its node owns to that expert's device over NVLink
    (`_dense_body` within the node, fixed capacity, passes), weights the results and sums them per token; the
    per-node partial sums come back across in one all_to_all and add up at the token's device. On 4 nodes with top-8
    routing a device's rows cross the network 3 times each way per token, against 2 x K x (N - g) / N = 12 rows per
    token for the one-stage dense exchange at capacity 2 (`receive_capacity`). Windows (`exchange_blocks`) split
    the tokens, software-pipelined: window b+1's rows leave before window b's experts run. fp8_transit: the rows
    travel as FP8 rows' bytes (`Fp8Rows.to_bytes`) through both stages (FP8 experts only: `_node_body`)."""
    tokens, k = experts.shape
    out_dtype = x.dtype
    if fp8_transit:
        x = fp8_rows(x).to_bytes()  # [L, D + 4 * ceil(D / 128)] uint8
    n_local = w_gate.shape[0]
    nodes = n_dev // node_devices
    across, within = node_groups(n_dev, node_devices)
    node = jax.lax.axis_index(axis) // node_devices
    blocks = max(1, min(exchange_blocks, tokens // MIN_WINDOW_TOKENS))
    span = -(-tokens // blocks)  # tokens of one window
    pad = blocks * span - tokens
    if pad:  # pad tokens route nowhere (expert id past every node's) and weigh 0
        x = jnp.pad(x, ((0, pad), (0, 0)))
        weights = jnp.pad(weights, ((0, pad), (0, 0)))
        experts = jnp.pad(experts, ((0, pad), (0, 0)), constant_values=n_dev * n_local)
    # The routing rides in float32 next to the rows: the weights are differentiated, expert ids < 2**24 are exact.
    routing = jnp.concatenate([weights, experts.astype(jnp.float32)], axis=-1)  # [L,2K]

    def across_nodes(a):
        """`a: [nodes, ...]`: part j to the device of this local rank on node j -> [nodes, ...] by source node."""
        return jax.lax.all_to_all(a, axis, 0, 0, tiled=True, axis_index_groups=across)

    def dispatch(b):
        """Window b's rows and routing to every node -> ([nodes*span, D], [nodes*span, 2K]), source-node major."""
        rows, route = x[b * span:(b + 1) * span], routing[b * span:(b + 1) * span]
        sent = [across_nodes(jnp.broadcast_to(a[None], (nodes, *a.shape))) for a in (rows, route)]
        return tuple(a.reshape(nodes * span, -1) for a in sent)

    def experts_of_node(rows, route):
        """Received tokens' pairs on this node's experts -> [nodes*span, D] float32 weighted sums per token."""
        pair_w, pair_e = route[:, :k], route[:, k:].astype(jnp.int32)
        first = node * node_devices * n_local  # this node's experts are [first, first + node_devices * El)
        here = (pair_e >= first) & (pair_e < first + node_devices * n_local)
        node_e = jnp.where(here, pair_e - first, node_devices * n_local)  # elsewhere: goes nowhere
        return _dense_body(rows, jnp.where(here, pair_w, 0), node_e, w_gate, w_up, w_down, lora_ab,
                           lora_scales=lora_scales, axis=axis, n_dev=node_devices, kernels=kernels,
                           receive_capacity=receive_capacity, exchange_blocks=1, groups=within,
                           live_rows=span * k)

    inflight = dispatch(0)
    outs = []
    for b in range(blocks):
        rows, route = inflight
        if b + 1 < blocks:  # the next window's rows leave before this window's experts start
            inflight = dispatch(b + 1)
        partial = experts_of_node(rows, route).astype(out_dtype)  # sums travel back in the activations' dtype
        back = across_nodes(partial.reshape(nodes, span, -1))  # [nodes, span, D]: each node's part of my tokens
        outs.append(back.astype(jnp.float32).sum(0))
    return jnp.concatenate(outs)[:tokens]


def _blocks(capacity: int, wanted: int, floor: int) -> int:
    """Windows a pass's exchange is split into: `wanted`, fewer where a window would fall under `floor` rows per
    destination (below it an exchange is all latency: a decode step's few rows stay one exchange)."""
    return max(1, min(wanted, capacity // floor))


def _ids_ride_along(dtype, n_local: int) -> bool:
    """Whether local expert ids 0..El travel as more columns of the rows (exact in `dtype`; FP8 rows' bytes take
    the id's 4): one collective per window instead of two (XLA:GPU keeps one all-to-all in flight at a time, so a
    separate ids exchange would queue between a window's rows and the next window's)."""
    if dtype == jnp.uint8:
        return True
    return jnp.issubdtype(dtype, jnp.floating) and n_local <= 2 ** (jnp.finfo(dtype).nmant + 1)


def _pack(rows: jax.Array, ids: jax.Array) -> jax.Array:
    """`rows: [...,D]`, `ids: [...]` int -> `[...,D+1]` in the rows' dtype (the ids as exact small numbers), or
    `[...,D+4]` for byte rows (the int32 id's bytes)."""
    if rows.dtype == jnp.uint8:
        return jnp.concatenate([rows, jax.lax.bitcast_convert_type(ids.astype(jnp.int32), jnp.uint8)], axis=-1)
    return jnp.concatenate([rows, ids[..., None].astype(rows.dtype)], axis=-1)


def _unpack(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inverse of `_pack`: -> (rows `[...,D]`, ids `[...]` int32)."""
    if packed.dtype == jnp.uint8:
        return packed[..., :-4], jax.lax.bitcast_convert_type(packed[..., -4:], jnp.int32)
    return packed[..., :-1], packed[..., -1].astype(jnp.int32)


def _pipelined_pass(dispatch, combine, blocks: int, n_local: int, lora_scales, kernels, rows_hint):
    """One pass as `blocks` windows q = p*blocks + b, software-pipelined: window b+1's dispatch is issued before
    window b's experts run, so the exchange of one window is in flight while the experts of the other compute
    (XLA:GPU runs all-to-all asynchronously, start/done, and its scheduler places independent expert work between
    them). Each pair lies in exactly one window, so the windows' results add up to the pass's without rounding.

    `diff` = (payload, *expert weights): dispatch(p, b, payload, ints) -> (received, state), received = (rows, local
    ids) or the rows with their ids packed as one more column (`_pack`);
    combine(y, state, payload, ints) -> window b of pass p's part of the result (the transport's form: the sum over
    windows and passes is the result). rows_hint: the live rows one window expects."""

    def one_pass(p, diff, ints):
        payload, weights = diff[0], diff[1:]

        def experts(received):
            # The barrier ties this window's weights to its received rows: otherwise XLA's dot merger fuses the
            # windows' matmuls (they share the weights) into one that waits for every window's exchange. Packed rows
            # are unpacked after it, so the slice fuses into the experts' sorting gather instead of being copied.
            received, (w_gate, w_up, w_down, lora_ab) = jax.lax.optimization_barrier((received, weights))
            recv, recv_ids = received if isinstance(received, tuple) else _unpack(received)
            # Results go back in the activations' dtype (bf16 payload on the real run).
            return _local_experts(recv, recv_ids, n_local, w_gate, w_up, w_down, _with_scales(lora_ab, lora_scales),
                                  kernels, rows_hint)

        inflight = dispatch(p, 0, payload, ints)
        total = None
        for b in range(blocks):
            received, state = inflight
            if b + 1 < blocks:  # the next window's rows leave before this window's experts start
                inflight = dispatch(p, b + 1, payload, ints)
            out = combine(experts(received), state, payload, ints)
            total = out if total is None else total + out
        return total

    return one_pass


def _pass_windows(counts_all: jax.Array, p, capacity: int):
    """Pass `p` of a capacity-bounded exchange. `counts_all[s, d]`: rows device s sends device d in the round.

    Each destination d receives its stream (sources in order, `first[s, d]` rows before source s's chunk)
    in windows of `capacity` rows; pass p carries the window [p*capacity, (p+1)*capacity). Returns [N,N]
    arrays: rows s sends d in this pass, how many of that chunk's rows went in earlier passes (skip), and
    where they land in d's pass buffer; offsets of empty transfers are 0.
    """
    first = jnp.cumsum(counts_all, axis=0) - counts_all
    lo = jnp.clip(first, p * capacity, (p + 1) * capacity)
    size = jnp.clip(first + counts_all, p * capacity, (p + 1) * capacity) - lo
    skip = jnp.where(size > 0, lo - first, 0)
    landing = jnp.where(size > 0, lo - p * capacity, 0)
    return size, skip, landing


def _window_part(size: jax.Array, skip: jax.Array, b: int, blocks: int):
    """Part b of `blocks` of each transfer of a pass. `size[s, d]`: rows s sends d in the pass, `skip[s, d]`: rows
    of that chunk sent in earlier passes. Returns [N,N] arrays: the part's rows, rows of the chunk before it, and
    where it lands in d's window buffer (sources in order); offsets of empty transfers are 0."""
    lo = size * b // blocks
    part = size * (b + 1) // blocks - lo
    landing = jnp.cumsum(part, axis=0) - part
    return part, jnp.where(part > 0, skip + lo, 0), jnp.where(part > 0, landing, 0)


def _ragged_body(x, weights, experts, w_gate, w_up, w_down, lora_ab, *, lora_scales, axis, n_dev, kernels,
                 receive_capacity=0.0, exchange_blocks=2):
    """Per-device body of the `ragged_all_to_all` path (GPU; XLA:CPU cannot compile it). A pass goes in
    `exchange_blocks` windows, software-pipelined (`_pipelined_pass`): window b carries part b of each (source,
    destination) transfer of the pass (near-equal parts), so every window receives at most capacity/blocks + N rows."""
    tokens, k = experts.shape
    n_local = w_gate.shape[0]
    rows = tokens * k
    order, _, _, counts, _, local = _dispatch_plan(experts, n_local, n_dev)
    token_of = order // k
    # counts_all[s, d]: pairs device s sends to device d.
    counts_all = jax.lax.all_gather(counts, axis)  # [N,N]
    worst = n_dev * rows  # every device's pairs come here
    capacity = worst if receive_capacity == 0 else min(worst, max(n_dev * MIN_CHUNK_ROWS,
                                                                  math.ceil(receive_capacity * rows)))
    blocks = _blocks(capacity, exchange_blocks, n_dev * MIN_CHUNK_ROWS)
    # Rows one window receives: part b of a transfer of n rows is at most ceil(n / blocks), so the N sources' parts
    # add up to at most capacity / blocks + N.
    h = capacity if blocks == 1 else -(-capacity // blocks) + n_dev

    def dispatch(p, b, xs, ints):
        local, counts_all = ints
        me = jax.lax.axis_index(axis)
        # starts_all[s, d]: the first row of s's chunk for d in s's expert-sorted rows.
        starts_all = jnp.cumsum(counts_all, axis=1) - counts_all
        size, skip, _ = _pass_windows(counts_all, p, capacity)
        size, skip, landing = _window_part(size, skip, b, blocks)
        send_sizes, send_from, send_to = size[me], starts_all[me] + skip[me], landing[me]  # [N] by destination
        recv_sizes, recv_at = size[:, me], landing[:, me]  # [N] by source
        out, out_ids = jnp.zeros((h, xs.shape[-1]), xs.dtype), jnp.full((h,), n_local, jnp.int32)
        if _ids_ride_along(xs.dtype, n_local):
            received = jax.lax.ragged_all_to_all(_pack(xs, local), _pack(out, out_ids), send_from, send_sizes, send_to,
                                                 recv_sizes, axis_name=axis)
        else:
            recv = jax.lax.ragged_all_to_all(xs, out, send_from, send_sizes, send_to, recv_sizes, axis_name=axis)
            recv_ids = jax.lax.ragged_all_to_all(local, out_ids, send_from, send_sizes, send_to, recv_sizes,
                                                 axis_name=axis)
            received = (recv, recv_ids)
        # Reverse: the rows received from s go back to s, where they were taken from there.
        return received, (recv_at, recv_sizes, starts_all[:, me] + skip[:, me], send_sizes)

    def combine(y, state, _payload, _ints):
        recv_at, recv_sizes, back_to, send_sizes = state
        return jax.lax.ragged_all_to_all(y, jnp.zeros((rows, y.shape[-1]), y.dtype), recv_at, recv_sizes, back_to,
                                         send_sizes, axis_name=axis)

    one_pass = _pipelined_pass(dispatch, combine, blocks, n_local, lora_scales, kernels, -(-rows // blocks))
    most = jnp.max(jnp.sum(counts_all, axis=0))  # the busiest destination's rows
    passes = jnp.maximum(1, (most + capacity - 1) // capacity).astype(jnp.int32)
    back = _exchange(one_pass, passes, capacity == worst, (x[token_of], w_gate, w_up, w_down, lora_ab),
                     (local, counts_all))
    return _combine(back, weights, order, token_of, tokens)


def experts_ep(x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate: jax.Array, w_up: jax.Array,
               w_down: jax.Array, lora: ExpertAdapters | None = None, *,
               mesh=None, expert_axis: str | None = None, token_axes: Sequence[str] | None = None,
               impl: str = "dense", token_block: int | None = None, kernels: str = "reference",
               receive_capacity: float = 0.0, exchange_blocks: int = 2, node_devices: int = 0) -> jax.Array:
    """Expert-parallel `experts_ragged`: `x: [T,D], weights/experts: [T,K]`, `w_*: [E,D,I] / [E,I,D]` -> [T,D] f32.

    `lora`: None or the (gate, up, down) routed-expert `Adapter`s (A [E,in,r], B [E,r,out]).
    `mesh`: default the current (abstract) mesh (`jax.set_mesh`). `expert_axis` / `token_axes`:
    default from the logical rules (`default_axes`). Falls back to `experts_ragged` when there is
    no mesh or the expert axis has size 1. T must divide by the product of the token axes' sizes
    and E by the expert axis size (`pad_tokens` makes any count divide). `impl`: "dense" (CPU-runnable),
    "ragged" (GPU) or "auto" (ragged when lowering for a GPU). `kernels`: as in `grouped_swiglu`.
    `token_block`: route at most this many of a device's tokens per exchange (`lax.map` over
    blocks; None: all at once). The exchange buffers scale with it, not with the device's tokens.
    `receive_capacity`: the ragged transport's receive buffer in multiples of the rows a device sends
    per round (0: the worst case, N times; see the module docstring); dropless either way.
    `exchange_blocks`: windows each pass's exchange is split into, so one window's all-to-all is in flight while
    another's experts compute (1: one synchronous exchange per pass; fewer where a window would fall under
    MIN_CHUNK_ROWS rows per destination). Results do not depend on it.
    `node_devices`: with the dense transport, g > 0 consecutive devices of the expert axis that share a node (fewer
    than the axis, dividing it): the exchange goes in two stages, once per node across and per expert within
    (`_node_body`); 0 (default) or the whole axis: one stage.
    """
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return experts_ragged(x, weights, experts, w_gate, w_up, w_down, lora, kernels)
    auto_expert, auto_tokens = default_axes(mesh)
    expert_axis = auto_expert if expert_axis is None else expert_axis
    if expert_axis is None or mesh.shape[expert_axis] == 1:
        return experts_ragged(x, weights, experts, w_gate, w_up, w_down, lora, kernels)
    token_axes = tuple(auto_tokens if token_axes is None else token_axes)
    if expert_axis not in token_axes:
        raise ValueError(f"token_axes {token_axes} must include the expert axis {expert_axis!r}")
    n_dev = mesh.shape[expert_axis]
    n_tok = 1
    for a in token_axes:
        n_tok *= mesh.shape[a]
    num_experts = w_gate.shape[0]
    if num_experts % n_dev:
        raise ValueError(f"{num_experts} experts do not divide over {expert_axis}={n_dev}")
    if x.shape[0] % n_tok:
        raise ValueError(f"{x.shape[0]} tokens do not divide over {token_axes} ({n_tok} shards)")
    if impl not in MOE_TRANSPORTS:
        raise ValueError(f"impl: expected one of {MOE_TRANSPORTS}, got {impl!r}")
    if impl == "auto":
        impl = "ragged" if targets_gpu() else "dense"
    if exchange_blocks < 1:
        raise ValueError(f"exchange_blocks: expected >= 1 (1 = no overlap), got {exchange_blocks!r}")
    if receive_capacity != 0 and receive_capacity < 1:
        raise ValueError(f"receive_capacity: expected 0 (worst case) or >= 1, got {receive_capacity!r}")
    if node_devices < 0 or (0 < node_devices < n_dev and n_dev % node_devices):
        raise ValueError(f"node_devices: expected 0, a divisor of {expert_axis}={n_dev} or at least it, "
                         f"got {node_devices!r}")
    two_stage = impl == "dense" and 0 < node_devices < n_dev

    # Only the adapter arrays cross the shard_map boundary (sharded on E); the scales stay static floats.
    lora_global = lora_arrays(lora) or (None, None, None)
    lora_ab = tuple(None if t is None else t[:2] for t in lora_global)
    lora_scales = tuple(None if t is None else t[2] for t in lora_global)
    tok, exp = P(token_axes, None), P(expert_axis, None, None)
    lora_specs = tuple(None if ab is None else (exp, exp) for ab in lora_ab)
    if two_stage:
        body = functools.partial(_node_body, node_devices=node_devices)
    else:
        body = _dense_body if impl == "dense" else _ragged_body

    def per_device(x, weights, experts, w_gate, w_up, w_down, lora_ab):
        def run(x, weights, experts):
            return body(x, weights, experts, w_gate, w_up, w_down, lora_ab, lora_scales=lora_scales, axis=expert_axis,
                        n_dev=n_dev, kernels=kernels, receive_capacity=receive_capacity,
                        exchange_blocks=exchange_blocks)

        local = x.shape[0]
        if token_block is None or local <= token_block:
            return run(x, weights, experts)
        # Every device runs the same number of rounds (equal local token counts), so each round's
        # all-to-alls pair up across devices. Pad tokens carry weight 0: routed, but they add nothing.
        blocks = -(-local // token_block)
        pad = blocks * token_block - local

        def split(a):
            a = jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1))
            return a.reshape(blocks, token_block, *a.shape[1:])

        # Each round rematerialised in the backward: otherwise the map saves every round's worst-case-sized
        # receive buffer and expert activations at once (32K conventional plan: 5 rounds x 4 GB of rows, 2.7 GB
        # of gate/up each, per layer in the backward).
        round_fn = jax.checkpoint(lambda args: run(*args), prevent_cse=False)
        y = jax.lax.map(round_fn, (split(x), split(weights), split(experts)))
        return y.reshape(blocks * token_block, -1)[:local]

    # check_vma=False: the grouped-matmul Pallas kernel declares no per-axis variance of its outputs (every
    # input and output here is sharded, so nothing relies on the replication checks).
    fn = jax.shard_map(per_device, mesh=mesh, in_specs=(tok, tok, tok, exp, exp, exp, lora_specs), out_specs=tok,
                       check_vma=False)
    return fn(x, weights, experts, w_gate, w_up, w_down, lora_ab)


def token_shards(num_experts: int, mesh=None) -> int:
    """How many shards `experts_ep` splits the tokens into under `mesh` (default: the current one), or 0
    when it does not apply (no mesh, an expert axis of size 1, or experts that do not divide over it)."""
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return 0
    expert_axis, token_axes = default_axes(mesh)
    if expert_axis is None or mesh.shape[expert_axis] == 1 or num_experts % mesh.shape[expert_axis]:
        return 0
    n_tok = 1
    for a in token_axes:
        n_tok *= mesh.shape[a]
    return n_tok


def pad_tokens(x: jax.Array, weights: jax.Array, experts: jax.Array, shards: int, num_experts: int):
    """Pads `x: [T,D]`, `weights / experts: [T,K]` to a multiple of `shards` tokens.

    Pad tokens have zero rows and zero routing weights (they add nothing to any output or gradient)
    and are routed round-robin over the experts, so no device's experts get them all.
    """
    pad = -x.shape[0] % shards
    if not pad:
        return x, weights, experts
    k = experts.shape[1]
    spread = (jnp.arange(pad * k, dtype=experts.dtype) % num_experts).reshape(pad, k)
    return (jnp.pad(x, ((0, pad), (0, 0))), jnp.pad(weights, ((0, pad), (0, 0))),
            jnp.concatenate([experts, spread]))
