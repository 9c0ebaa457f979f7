"""PeerWatch's rules on a key-value store held in this process and a clock the test moves (the behaviour
with real processes, a real coordination service and a real kill: tests/rl/test_rehearsal.py)."""

import pytest

from glm52_jax.parallel.peer_watch import DEFAULT_TIMEOUT_S, PeerWatch, timeout_from_env


class Store:
    """The two calls of JAX's coordination-service client that PeerWatch uses, with its NOT_FOUND error."""

    def __init__(self):
        self.values, self.down = {}, False

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.down:
            raise RuntimeError("UNAVAILABLE: Failed to send RPC to coordination service")
        assert allow_overwrite or key not in self.values
        self.values[key] = value

    def key_value_try_get(self, key):
        if self.down:
            raise RuntimeError("UNAVAILABLE: Failed to send RPC to coordination service")
        if key not in self.values:
            raise RuntimeError(f"NOT_FOUND: Config key {key} not found.")
        return self.values[key]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _three(timeout_s=10.0):
    store, clock = Store(), Clock()
    watches = [PeerWatch(store, r, 3, timeout_s=timeout_s, interval_s=1.0, clock=clock) for r in range(3)]
    return store, clock, watches


def _run(clock, watches, seconds, alive=(0, 1, 2)):
    """Every live process polls once per simulated second; returns the first report of each."""
    reports = {}
    for _ in range(int(seconds)):
        clock.t += 1.0
        for r in alive:
            report = watches[r].poll()
            if report is not None:
                reports.setdefault(r, report)
    return reports


def test_live_peers_are_never_reported():
    _, clock, watches = _three()
    assert _run(clock, watches, 60) == {}


def test_a_silent_peer_is_named_after_the_timeout_and_not_before():
    _, clock, watches = _three(timeout_s=10.0)
    assert _run(clock, watches, 5) == {}
    assert _run(clock, watches, 9, alive=(0, 2)) == {}  # 9 s of silence: not yet
    reports = _run(clock, watches, 3, alive=(0, 2))
    assert sorted(reports) == [0, 2]
    for report in reports.values():
        assert report.startswith("process 1 stopped responding (no heartbeat for 1"), report


def test_a_peer_that_never_beat_counts_from_the_start():
    _, clock, watches = _three(timeout_s=10.0)
    reports = _run(clock, watches, 12, alive=(0, 1))
    assert reports[0].startswith("process 2 stopped responding") and reports[1].startswith("process 2 ")


def test_done_is_never_stale_and_failed_is_reported_after_the_grace():
    _, clock, watches = _three(timeout_s=10.0)  # grace 5 s: this process's own error would come first
    _run(clock, watches, 2)
    watches[2].finish(ok=True)
    assert _run(clock, watches, 60, alive=(0, 1)) == {}
    watches[1].finish(ok=False)
    assert _run(clock, watches, 5, alive=(0,)) == {}
    assert _run(clock, watches, 1, alive=(0,)) == {0: "process 1 stopped with an error (its log says which)"}


def test_a_store_that_is_gone_names_the_coordinator():
    store, clock, watches = _three()
    _run(clock, watches, 2)
    store.down = True
    report = _run(clock, watches, 1, alive=(1,))[1]
    assert report.startswith("process 0 (the coordinator) no longer answers (RuntimeError: UNAVAILABLE")
    watches[1].finish(ok=True)  # a dead store does not raise here


@pytest.mark.parametrize("value, want", [("", DEFAULT_TIMEOUT_S), ("7.5", 7.5)])
def test_timeout_from_env(value, want):
    assert timeout_from_env({"GLM52_PEER_TIMEOUT_S": value}) == want


@pytest.mark.parametrize("value", ["0", "-3", "soon"])
def test_bad_timeout_is_one_clear_error(value):
    with pytest.raises(ValueError, match=f"GLM52_PEER_TIMEOUT_S must be a number of seconds > 0, got '{value}'"):
        timeout_from_env({"GLM52_PEER_TIMEOUT_S": value})


def test_settle_names_a_dead_peer_or_lets_our_error_through():
    store, clock, watches = _three(timeout_s=10.0)
    _run(clock, watches, 2)
    watches[0].finish(ok=False)  # process 0 failed (e.g. a collective whose peer died)

    def tick(seconds):  # process 2 keeps beating, process 1 is dead
        clock.t += seconds
        watches[2].poll()

    report = watches[0].settle(clock_sleep=tick)
    assert report is not None and report.startswith("process 1 stopped responding"), report
    _, clock, watches = _three(timeout_s=10.0)
    _run(clock, watches, 2)
    for w in watches[1:]:
        w.finish(ok=False)  # both peers met the same error: ours is reported, without waiting
    start = clock.t
    assert watches[0].settle(clock_sleep=lambda s: setattr(clock, "t", clock.t + s)) is None
    assert clock.t - start <= 1.0
