"""Trip counts of the data-dependent loops (`glm52_jax.plan.loop_trips`) against the model's own loops.

The model's key loops are run op by op (`jax.disable_jit`: each `fori_loop` is a Python loop of exactly its
trip count) with the block scorer wrapped to count its calls: the real number of trips, which the plan's
replay of the block rules must equal."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm52_jax.model import context_parallel as cp
from glm52_jax.model import indexer
from glm52_jax.model.loop_scopes import CACHED_KEY_LOOP, CAUSAL_KEY_LOOP
from glm52_jax.plan import loop_trips


def _counting_scores(monkeypatch) -> list[int]:
    calls = []
    real = indexer.block_scores

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(indexer, "block_scores", counted)
    return calls


def _inputs(seq: int, keys: int):
    kq, kw, kk = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(kq, (1, seq, 2, 8)), jax.random.normal(kw, (1, seq, 2)),
            jax.random.normal(kk, (1, keys, 8)))


@pytest.mark.parametrize("seq, query_block, key_block", [(37, 8, 8), (20, 16, 24)])
def test_causal_trips_are_the_loops(monkeypatch, seq, query_block, key_block):
    q, w, k = _inputs(seq, seq)
    pos = jnp.arange(seq)
    calls = _counting_scores(monkeypatch)
    with jax.disable_jit():
        indexer.streaming_topk(q, w, k, pos, pos, 4, scale=1.0, query_block=query_block, key_block=key_block)
    qb, kb = indexer.causal_blocks(seq, seq, query_block, key_block, "reference")
    assert len(calls) == loop_trips.causal_trips(np.arange(seq), np.arange(seq), qb, kb).sum() > 0


def test_chunk_queries_after_a_prefix(monkeypatch):
    """A cached chunk's own keys: queries and keys at positions 300..339. Key blocks start at 300, 308, 316, 324,
    332; the query blocks end at 315, 331 and 339, so they visit 2, 4 and 5 key blocks."""
    q, w, k = _inputs(40, 40)
    pos = jnp.arange(300, 340)
    calls = _counting_scores(monkeypatch)
    with jax.disable_jit():
        indexer.streaming_topk(q, w, k, pos, pos, 4, scale=1.0, query_block=16, key_block=8)
    assert len(calls) == loop_trips.causal_trips(np.arange(300, 340), np.arange(300, 340), 16, 8).sum() == 2 + 4 + 5


@pytest.mark.parametrize("queries, length", [(5, 70), (1, 33)])
def test_cached_trips_are_the_loops(monkeypatch, queries, length):
    q, w, _ = _inputs(queries, 1)
    cache = jax.random.normal(jax.random.key(1), (1, 1, 1, 96, 8))
    calls = _counting_scores(monkeypatch)
    with jax.disable_jit():
        indexer.cached_topk(q, w, cache, (0, 0), jnp.full((queries,), length), jnp.int32(length), 4, scale=1.0,
                            query_block=8, key_block=16)
    qb, kb = indexer.cached_blocks(queries, 96, 8, 16, "reference")
    blocks = -(-queries // qb)
    assert len(calls) == blocks * loop_trips.cached_trips(length, kb)


def test_zigzag_layout_balances_the_causal_work():
    """Whole sequence on 4 devices: the zigzag layout's device totals are within a few % of each other, the
    contiguous one's last device does ~2x the mean (the model's `cp.to_layout` decides who holds what)."""
    shapes = dict(query_block=16, key_block=32, kernels="reference", seq_ways=4)
    zig = loop_trips.Counter(loop_trips.Shapes(**shapes, context_parallel="zigzag"))
    zig.whole_sequence(1024)
    contiguous = loop_trips.Counter(loop_trips.Shapes(**shapes, context_parallel="contiguous"))
    contiguous.whole_sequence(1024)
    z, c = zig.result()["detail"][CAUSAL_KEY_LOOP], contiguous.result()["detail"][CAUSAL_KEY_LOOP]
    assert z["imbalance"] < 1.05 and c["imbalance"] > 1.5
    assert z["mean_device_total"] == c["mean_device_total"]  # the same pairs, placed differently
    # Device 0 of the zigzag layout holds chunks 0 and 7 of 8 (128 positions each).
    lay = cp.Layout(("seq",), 4, "zigzag", 1024, 1024)
    held = np.asarray(cp.to_layout(jnp.arange(1024)[None], lay)).reshape(4, -1)[0]
    assert list(held[:2]) == [0, 1] and list(held[128:130]) == [896, 897]
    # 8 query blocks of 16 per chunk; a block at positions [16b, 16b+16) sees ceil((16b+16)/32) key blocks.
    first = sum(-(-(16 * b + 16) // 32) for b in range(8)) + sum(-(-(896 + 16 * b + 16) // 32) for b in range(8))
    assert z["busiest_total"] >= first


def test_cached_trips_follow_the_busiest_slot_shard():
    """A cache of 1024 slots on 4 devices holding 301, strided (`kv_cache.SlotLayout`): device 0 scores 76 slots
    (0, 4, .., 300), the others 75; 5 key blocks of 16 each. (Contiguous shards would give device 0 all of its
    256 slots, 16 blocks: 3.4x the mean.)"""
    c = loop_trips.Counter(loop_trips.Shapes(8, 16, "reference", 4, "zigzag"))
    c.cached(8, 301, 1024)
    d = c.result()["detail"][CACHED_KEY_LOOP]
    assert d["busiest_total"] == 5 and d["mean_device_total"] == 5 and d["executions"] == 1


def test_prefill_chunks_are_balanced_on_every_device():
    """The plan's chunked prefill (128 chunks of 16K on 8 slot shards, the 2M one-node shape) replays the model's
    slot layout: every device scores within one key block of the others on each chunk, so the busiest does the
    mean (the contiguous layout's busiest device did ~1.88x the mean)."""
    chunk, chunks, ways = 16_384, 128, 8
    capacity = chunk * chunks
    shapes = loop_trips.Shapes(128, 512, "reference", ways, "zigzag", gpu=False)
    total = loop_trips.Counter(shapes)
    for k in range(1, chunks):
        one = loop_trips.Counter(shapes)
        one.cached(cp.MAX_CACHED_QUERIES, k * chunk, capacity)
        total.cached(cp.MAX_CACHED_QUERIES, k * chunk, capacity)
        trips = one.result()["detail"][CACHED_KEY_LOOP]
        assert trips["imbalance"] <= 1.1, (k, trips)
    assert total.result()["detail"][CACHED_KEY_LOOP]["imbalance"] < 1.01
    # What contiguous shards would hold: device 0 fills first and scores a full shard from chunk 16 on.
    local = capacity // ways
    contiguous = np.array([np.clip(k * chunk - np.arange(ways) * local, 0, local) for k in range(1, chunks)]).sum(0)
    assert contiguous.max() / contiguous.mean() > 1.8
