"""Prefix cache: keeps batch-1 DSA caches of earlier prompts so a new prompt that shares a prefix
recomputes only its tail (the seed's second exact-2M candidate: 30.8 s against 1,867.58 s).

Entries are immutable `KVCache` snapshots (JAX arrays are never written in place), keyed by the
token ids they hold. A lookup returns the entry with the longest common prefix, usable up to that
length: positions past the reused length are overwritten before any query can see them. Memory
is bounded by `max_bytes` per device (an entry sharded over 32 devices costs each of them 1/32 of
it; the 2M prompt's ~211 GB cache is ~6.6 GB per H20); the least recently used entries are evicted
first.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from glm52_jax.model.kv_cache import KVCache  # re-exported: the cache layout lives with the model

__all__ = ["KVCache", "PrefixCache", "fit_capacity"]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def fit_capacity(cache: KVCache, capacity: int) -> KVCache:
    """The same cache with its slot axis cut or padded to `capacity` (length must fit): new slots hold zeros
    (an FP8 cache's scales: ones, as an empty cache's). A strided cache (`KVCache.stride`) is cut or padded per
    device, rows past each device's last (its slots stay where the slot layout of `capacity` puts them)."""
    current = cache.capacity
    if capacity == current:
        return cache
    ways = cache.stride
    if capacity % ways:
        raise ValueError(f"a cache laid out over {ways} slot shards cannot hold {capacity} slots: use a multiple "
                         f"of {ways} (`kv_cache.slot_capacity`)")

    def fit(a, fill=0):
        # [.., Cap, *] -> [.., ways, Cap / ways, *]: each device's rows, in the slot layout's device-major order.
        a = a.reshape(*a.shape[:3], ways, current // ways, *a.shape[4:])
        local = capacity // ways
        if local < current // ways:
            a = a[:, :, :, :, :local]
        else:
            a = jnp.pad(a, [(0, 0)] * 4 + [(0, local - current // ways)] + [(0, 0)] * (a.ndim - 5),
                        constant_values=fill)
        return a.reshape(*a.shape[:3], capacity, *a.shape[5:])

    def fit_all(stacks, fill=0):
        return tuple(fit(a, fill) for a in stacks)

    return KVCache(fit_all(cache.c_kv), fit_all(cache.k_rope), fit_all(cache.index_k), cache.length,
                   fit_all(cache.c_scale, 1), fit_all(cache.i_scale, 1), stride=ways)


class PrefixCache:
    """LRU store of prompt-prefix caches, bounded by the bytes they hold on any one device."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[tuple[int, ...], KVCache] = collections.OrderedDict()
        self._last_hidden: dict[tuple[int, ...], jax.Array] = {}  # [1,D] of the entries that hold a whole prompt
        self.evictions = 0

    @property
    def nbytes(self) -> int:
        """Bytes the entries hold per device (what `max_bytes` bounds)."""
        return sum(c.device_nbytes() for c in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: Sequence[int], *, limit: int, multiple: int = 1) -> tuple[int, KVCache | None]:
        """(reusable length, cache) for the entry sharing the longest prefix with `prompt`.

        The length is capped at `limit` and rounded down to a multiple of `multiple`; (0, None)
        when nothing reusable is stored.
        """
        best_len, best_key = 0, None
        for key in self._entries:
            n = min(_common_prefix(key, prompt), limit)
            n -= n % multiple
            if n > best_len:
                best_len, best_key = n, key
        if best_key is None:
            return 0, None
        self._entries.move_to_end(best_key)
        cache = self._entries[best_key]
        return best_len, dataclasses.replace(cache, length=jnp.asarray(best_len, jnp.int32))

    def whole(self, prompt: Sequence[int]) -> tuple[KVCache, jax.Array] | None:
        """(cache, last hidden state [1,D]) of an entry holding exactly `prompt` and stored with its
        hidden state: the same prompt again (another request, the update's prompt KV) needs no prefill."""
        key = tuple(int(t) for t in prompt)
        if key not in self._entries or key not in self._last_hidden:
            return None
        self._entries.move_to_end(key)
        return self._entries[key], self._last_hidden[key]

    def insert(self, tokens: Sequence[int], cache: KVCache, h_last: jax.Array | None = None) -> None:
        """Stores `cache` (holding exactly `tokens`; `h_last` [1,D]: the last token's hidden state, if known),
        evicting LRU entries to stay within bounds."""
        key = tuple(int(t) for t in tokens)
        if int(cache.length) != len(key):
            raise ValueError(f"cache holds {int(cache.length)} tokens but {len(key)} were given")
        if cache.batch != 1:
            raise ValueError(f"prefix cache entries must be batch-1, got batch {cache.batch}")
        size = cache.device_nbytes()
        if size > self.max_bytes:
            return
        # An entry that is a prefix of the new one is now redundant.
        for old in [k for k in self._entries if len(k) <= len(key) and key[:len(k)] == k]:
            del self._entries[old]
            self._last_hidden.pop(old, None)
        self._entries[key] = cache
        if h_last is not None:
            self._last_hidden[key] = h_last
        while self.nbytes > self.max_bytes:
            evicted, _ = self._entries.popitem(last=False)
            self._last_hidden.pop(evicted, None)
            self.evictions += 1

    def clear(self) -> None:
        self._entries.clear()
        self._last_hidden.clear()
