"""Trip counts of the model's data-dependent loops in each planned program, on its busiest device.

XLA cannot prove the trip count of the DSA indexer's key loops (they stop at the last key block a query block
can see, or at the cache's filled length) nor of the EP exchange's pass loop (it depends on the routing), and
an HLO count sees each body once. The model names these loops (`model.loop_scopes`) and its block rules
(`indexer.causal_blocks`, `indexer.cached_blocks`) decide how many blocks each loop visits; this module
replays those rules on the program's positions and cache lengths, per device, and returns, for each loop
scope, its mean trips per execution of the loop on the device that does the most: the figure
`kernel_cost.Program.work` multiplies the loop's body by.

  causal  `streaming_topk`: a query block visits the key blocks whose first position is <= its last query's
          (whole-sequence forwards under the context-parallel layout: each device's query blocks against the
          whole gathered sequence; a cached chunk's queries against its own keys)
  cached  `cached_topk`: ceil(filled slots / key block) per query block; under context parallelism a device
          scores only its own slots, dealt round-robin (`kv_cache.SlotLayout`): every device within one slot
          of the mean
  suffix  a sample's own suffix slots (decode, response log-probs): causal over the suffix
The EP pass loop is not counted here: its passes are a stated parameter of the efficiency table's scenarios.
A program's loops and the shapes behind them are documented with each builder in `plan/programs.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import numpy as np

from glm52_jax import kernels
from glm52_jax.model import context_parallel as cp
from glm52_jax.model.indexer import cached_blocks, causal_blocks
from glm52_jax.model.kv_cache import SlotLayout
from glm52_jax.model.loop_scopes import CACHED_KEY_LOOP, CAUSAL_KEY_LOOP, SUFFIX_KEY_LOOP


@dataclasses.dataclass
class Trips:
    """Trips of one loop scope: `total` over the program's executions of the loop on each device."""

    executions: int = 0  # executions of the loop (query blocks x calls) per device
    per_device: np.ndarray | None = None  # [devices] total trips

    def add(self, trips_by_device: np.ndarray, executions: int) -> None:
        trips_by_device = np.asarray(trips_by_device, np.float64)
        self.per_device = trips_by_device if self.per_device is None else self.per_device + trips_by_device
        self.executions += executions

    def record(self) -> dict[str, float]:
        busiest, mean = float(self.per_device.max()), float(self.per_device.mean())
        return {"executions": self.executions, "busiest_total": busiest, "mean_device_total": mean,
                "imbalance": busiest / mean if mean else 1.0,
                "trips_per_execution": busiest / self.executions if self.executions else 0.0}


def causal_trips(q_positions: np.ndarray, k_positions: np.ndarray, query_block: int, key_block: int) -> np.ndarray:
    """`streaming_topk`'s key-loop trips per query block: the key blocks (of `key_block` sorted keys) whose first
    position is at most the block's last query position (queries padded to whole blocks with position -1,
    as the loop pads them)."""
    q = np.asarray(q_positions, np.int64)
    q = np.concatenate([q, np.full((-len(q)) % query_block, -1)]).reshape(-1, query_block)
    first = np.asarray(k_positions, np.int64)[::key_block]
    return (first[None, :] <= q.max(axis=1)[:, None]).sum(axis=1)


def cached_trips(length: int, key_block: int) -> int:
    """`cached_topk`'s key-loop trips: the key blocks holding the `length` filled slots."""
    return -(-int(length) // key_block)


def _local_lengths(length: int, ways: int) -> np.ndarray:
    """Filled slots of each device's share of a cache holding `length` ([ways]), in the model's strided slot layout
    (`kv_cache.SlotLayout`: every device within one slot of length / ways)."""
    return SlotLayout(ways).filled(int(length), np.arange(ways))


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What the trip counts depend on: the model's block options, kernels and the mesh's sequence split."""

    query_block: int
    key_block: int
    kernels: str  # "reference" or "pallas" (resolved for the target)
    seq_ways: int  # devices the cache's slots / a whole sequence's queries are split over
    context_parallel: str  # ModelOptions.context_parallel (the whole-sequence layout)
    gpu: bool = True  # the program is traced for a GPU: the Pallas path's blocks are its GPU tiling's

    def causal_blocks(self, seq: int, num_keys: int) -> tuple[int, int]:
        with self._traced():
            return causal_blocks(seq, num_keys, self.query_block, self.key_block, self.kernels)

    def cached_blocks(self, queries: int, capacity: int) -> tuple[int, int]:
        with self._traced():
            return cached_blocks(queries, capacity, self.query_block, self.key_block, self.kernels)

    def _traced(self):
        """The block rules as the program was traced: for a GPU, the kernels' GPU tiling (not the interpreter's)."""
        return kernels.lowering_for_gpu() if self.gpu else contextlib.nullcontext()


class Counter:
    """Accumulates the loops of one program call, per scope."""

    def __init__(self, shapes: Shapes):
        self.shapes = shapes
        self.scopes: dict[str, Trips] = {}

    def _add(self, scope: str, trips_by_device: np.ndarray, executions: int) -> None:
        self.scopes.setdefault(scope, Trips()).add(trips_by_device, executions)

    def whole_sequence(self, seq: int, times: int = 1) -> None:
        """A whole-sequence forward of `seq` tokens (`times` of them): each device's query blocks against every
        key, under the context-parallel layout (`cp.plan_layout`'s rules)."""
        sh = self.shapes
        n = sh.seq_ways if sh.context_parallel != "off" else 1
        if n <= 1:
            local = [np.arange(seq)]
            keys = np.arange(seq)
        else:  # the model's own layout: padded to whole chunks, then permuted device-major (`cp.to_layout`)
            lay = cp.Layout(("seq",), n, sh.context_parallel, seq, 0)
            lay = dataclasses.replace(lay, padded=-(-seq // lay.chunks) * lay.chunks)
            keys = np.arange(lay.padded)
            local = list(np.asarray(cp.to_layout(keys[None], lay)).reshape(n, -1))
        qb, kb = sh.causal_blocks(len(local[0]), len(keys))
        per_device = np.array([causal_trips(q, keys, qb, kb).sum() for q in local])
        self._add(CAUSAL_KEY_LOOP, per_device * times, -(-len(local[0]) // qb) * times)

    def cached(self, queries: int, length: int, capacity: int, times: int = 1, sharded: bool = True) -> None:
        """`cached_topk` of `queries` queries (one call) over a cache of `capacity` slots holding `length`;
        `sharded`: its slots are split over the sequence devices (each scores its own)."""
        sh = self.shapes
        ways = sh.seq_ways if sharded and capacity % max(sh.seq_ways, 1) == 0 else 1
        qb, kb = sh.cached_blocks(queries, capacity // ways)
        blocks = -(-queries // qb)
        per_device = np.array([cached_trips(n, kb) for n in _local_lengths(length, ways)]) * blocks
        per_device = np.broadcast_to(per_device, (max(sh.seq_ways, 1),)) if ways == 1 else per_device
        self._add(CACHED_KEY_LOOP, per_device * times, blocks * times)

    def own_keys(self, q_positions: np.ndarray, k_positions: np.ndarray, scope: str = CAUSAL_KEY_LOOP,
                 times: int = 1) -> None:
        """`streaming_topk` of queries at `q_positions` over keys at `k_positions`, on every device alike."""
        sh = self.shapes
        qb, kb = sh.causal_blocks(len(q_positions), len(k_positions))
        total = causal_trips(q_positions, k_positions, qb, kb).sum()
        self._add(scope, np.full(max(sh.seq_ways, 1), float(total)) * times, -(-len(q_positions) // qb) * times)

    def chunk(self, start: int, size: int, capacity: int, times: int = 1) -> None:
        """A cached chunk of `size` tokens after `start` cached ones (`forward_cached`): the cache's slots, then
        the chunk's own keys. Under context parallelism a chunk of more than `cp.MAX_CACHED_QUERIES` queries
        runs in blocks of that many, each against all the chunk's keys."""
        positions = np.arange(start, start + size)
        if self.shapes.seq_ways > 1 and capacity % self.shapes.seq_ways == 0:
            block = min(size, cp.MAX_CACHED_QUERIES)
            blocks = -(-size // block)
            padded = np.concatenate([positions, np.full(blocks * block - size, positions[-1])])
            for j in range(blocks):
                self.cached(block, start, capacity, times)
                self.own_keys(padded[j * block:(j + 1) * block], positions, times=times)
        else:
            self.cached(size, start, capacity, times, sharded=False)
            self.own_keys(positions, positions, times=times)

    def shared(self, rows: int, seq: int, prompt: int, capacity: int, suffix_before: int, times: int = 1) -> None:
        """`forward_shared`: `rows` x `seq` new tokens after a shared prompt cache holding `prompt` slots and
        `suffix_before` tokens of each row's own suffix: the prompt's slots scored once for all rows, then each
        row's suffix + chunk."""
        self.cached(rows * seq, prompt, capacity, times)
        positions = prompt + suffix_before + np.arange(seq)
        keys = prompt + np.arange(suffix_before + seq)
        self.own_keys(np.tile(positions, rows) if rows > 1 else positions, keys, SUFFIX_KEY_LOOP, times)

    def result(self) -> dict[str, Any]:
        """{"trips": {scope: trips per execution on the busiest device}, "detail": {scope: Trips.record()}}."""
        detail = {scope: t.record() for scope, t in self.scopes.items()}
        return {"trips": {scope: d["trips_per_execution"] for scope, d in detail.items()}, "detail": detail}


def for_program(setup, name: str, resolved_kernels: str, gpu: bool = True) -> dict[str, Any]:
    """The data-dependent loops of plan program `name` (`plan.programs.BUILDERS`) of `setup` (a `PlanSetup`),
    with the DSA kernels resolved ("reference" / "pallas") for the target, traced for a GPU (`gpu`) or not."""
    s, opts = setup, setup.opts
    from glm52_jax.plan.abstract import ways

    c = Counter(Shapes(opts.indexer_query_block, opts.indexer_key_block, resolved_kernels, ways(s.mesh, "seq"),
                       opts.context_parallel, gpu))
    p, r, cap = s.prompt_tokens, s.max_new_tokens, s.capacity
    if name.startswith("probe_"):
        if not s.probe_tokens:
            return c.result()
        p, cap, name = s.probe_tokens, s.probe_capacity, name[len("probe_"):]
    if name == "forward" or (name == "prefill" and s.prefill_mode == "whole"):
        c.whole_sequence(p)
    elif name == "prefill":  # the mean over the prompt's chunk calls, each against the cache written so far
        n = -(-p // s.chunk_size)
        for k in range(n):
            c.chunk(k * s.chunk_size, s.chunk_size, cap)
        _per_call(c, n)
    elif name == "prefill_tail":
        c.chunk(max(p - s.chunk_size, 0) // s.chunk_size * s.chunk_size, s.chunk_size, cap)
    elif name == "decode":  # R steps of one token for each of the S rows
        for step in range(r):
            c.shared(s.decode_rows, 1, p, cap, step)
    elif name == "new_logprobs":
        _response_groups(c, s.num_samples, r, p - 1, cap)
    elif name == "train":
        if s.gradient_mode == "conventional":
            c.whole_sequence(p + r, times=s.num_samples)
        else:
            if s.gradient_mode == "shared_prefix":
                c.whole_sequence(p - 1)
            for _ in range(s.num_samples):
                c.shared(1, r, p - 1, cap, 0)
    return c.result()


def _response_groups(c: Counter, rows: int, length: int, prompt: int, capacity: int) -> None:
    """`gradients.cached_response_logprobs`: the rows in groups of at most MAX_CACHED_QUERIES tokens."""
    group = max([d for d in range(1, rows + 1) if rows % d == 0 and d * length <= cp.MAX_CACHED_QUERIES] or [1])
    for _ in range(rows // group):
        c.shared(group, length, prompt, capacity, 0)


def _per_call(c: Counter, calls: int) -> None:
    """Turn totals over `calls` calls of one program into per-call totals (the executions divide alike, so the
    trips per execution stay the mean over the calls)."""
    for t in c.scopes.values():
        t.per_device = t.per_device / calls
        t.executions = t.executions / calls
