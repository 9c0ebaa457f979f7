"""Noticing a dead peer process in seconds, and saying which one.

Without this, a process whose peer died waits inside a collective until JAX's coordination service
misses the peer's heartbeats (`heartbeat_timeout_seconds`, 100 s by default) and aborts it with a C++
stack trace. Here each process publishes a beat (a counter) in the coordination service's key-value
store, and reads the others' beats, from the launcher's main thread, which stays in Python while the
work thread computes. A peer whose counter has not moved for `timeout_s` is reported by number; a peer
that finished publishes "done" (never stale again) and one that failed publishes "failed" (its own
error is the cause, reported in its log), so neither a clean end nor an error elsewhere looks like a
death. A failed peer is reported after `grace_s`: when every process meets the same error (settings
that differ, a bad file), each one's own message comes first. When process 0 dies the coordination
service dies with it, and JAX aborts the others at once (its message names "the leader task"): that
case needs nothing from here.

The store is the one `jax.distributed.initialize` starts (`global_state.client`, JAX's own handle:
no public accessor exists yet); any object with `key_value_set(key, value, allow_overwrite=...)` and
`key_value_try_get(key)` works, which is how the unit tests drive it without processes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

TIMEOUT_ENV = "GLM52_PEER_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 20.0  # well above a beat's worst delay (a long GIL hold), well below JAX's 100 s abort
DONE, FAILED = "done", "failed"


def timeout_from_env(env=None) -> float:
    """`$GLM52_PEER_TIMEOUT_S` (seconds, > 0) or the default."""
    env = os.environ if env is None else env
    value = env.get(TIMEOUT_ENV, "")
    if not value:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds > 0, got {value!r}")
    return seconds


class PeerWatch:
    """This process's beat and its view of every other process's beat."""

    def __init__(self, store: Any, rank: int, count: int, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 interval_s: float = 1.0, grace_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.store, self.rank, self.count = store, rank, count
        self.timeout_s, self.interval_s, self.grace_s, self.clock = timeout_s, interval_s, grace_s, clock
        now = clock()
        self._beats = 0
        self._last_beat = now - interval_s  # the first poll beats at once
        # peer -> (last value seen, when it last changed); a peer that never beat counts from now.
        self._seen: dict[int, tuple[str | None, float]] = {p: (None, now) for p in range(count) if p != rank}

    @staticmethod
    def key(rank: int) -> str:
        return f"glm52/peer_watch/{rank}"

    def _publish(self, value: str) -> None:
        self.store.key_value_set(self.key(self.rank), value, allow_overwrite=True)

    def _read(self, peer: int) -> str | None:
        try:
            return self.store.key_value_try_get(self.key(peer))
        except Exception as e:  # not yet written (NOT_FOUND) reads as silence; a dead store is reported
            if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
                return None
            raise

    def poll(self, *, report_failed: bool = True) -> str | None:
        """Beats (at most once per `interval_s`) and returns one line naming a peer that stopped, else None
        (`report_failed=False`: a peer that failed with an error of its own is not reported)."""
        now = self.clock()
        try:
            if now - self._last_beat >= self.interval_s:
                self._beats += 1
                self._publish(str(self._beats))
                self._last_beat = now
            for peer, (value, since) in self._seen.items():
                current = self._read(peer)
                if current == FAILED:
                    if value != FAILED:
                        self._seen[peer] = (current, now)
                    elif report_failed and now - since >= self.grace_s:
                        return f"process {peer} stopped with an error (its log says which)"
                    continue
                if current == DONE:
                    self._seen[peer] = (current, now)
                    continue
                if current != value:
                    self._seen[peer] = (current, now)
                elif now - since > self.timeout_s:
                    return (f"process {peer} stopped responding (no heartbeat for {now - since:.0f} s: the process "
                            "or its host died)")
        except Exception as e:  # the store itself is gone: process 0, which hosts it, died
            return f"process 0 (the coordinator) no longer answers ({type(e).__name__}: {str(e).splitlines()[0]})"
        return None

    def peers_finished(self) -> bool:
        """Whether every peer has published "done" or "failed" (as of the last poll)."""
        return all(value in (DONE, FAILED) for value, _ in self._seen.values())

    def settle(self, clock_sleep: Callable[[float], None] = time.sleep) -> str | None:
        """After this process failed: waits until every peer has finished (None: the failure is ours to
        report) or one stops beating (its line: a collective that failed fast because that peer died,
        e.g. gloo's closed connection, is reported as the death). Bounded by `timeout_s` + `grace_s`."""
        deadline = self.clock() + self.timeout_s + self.grace_s
        while self.clock() < deadline:
            lost = self.poll(report_failed=False)
            if lost is not None:
                return lost
            if self.peers_finished():
                return None
            clock_sleep(min(self.interval_s, 0.5))
        return None

    def finish(self, ok: bool) -> None:
        """Tells the peers this process ended (cleanly or with an error); errors of a dead store are ignored."""
        try:
            self._publish(DONE if ok else FAILED)
        except Exception:
            pass


def for_this_process(timeout_s: float | None = None) -> PeerWatch | None:
    """The watch of a multi-process run (after `jax.distributed.initialize`); None for one process."""
    import jax
    from jax._src import distributed

    if jax.process_count() == 1 or distributed.global_state.client is None:
        return None
    return PeerWatch(distributed.global_state.client, jax.process_index(), jax.process_count(),
                     timeout_s=timeout_from_env() if timeout_s is None else timeout_s)
