"""Workdir bookkeeping: one process per run directory, stale locks, what an interrupted run kept."""

import subprocess
import sys
import threading

import pytest

from glm52_jax import workdir as workdir_lib
from glm52_jax.run_config import ConfigError
from tests.run_helpers import config_spec


def test_lock_refuses_a_live_holder_and_takes_over_a_dead_ones(tmp_path):
    lock = workdir_lib.acquire(tmp_path, ["first"])
    with pytest.raises(ConfigError, match=r"is in use by pid \d+ on .* \(since .*\); wait for it, or remove .*\.lock"):
        workdir_lib.acquire(tmp_path, ["second"])  # this process is alive
    workdir_lib.release(lock)
    assert not lock.exists()
    # A lock left by a process that has exited (a real one, killed): taken over.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    lock.write_text(f'{{"pid": {gone.pid}, "host": "{workdir_lib.socket.gethostname()}", "started_utc": "x"}}')
    assert workdir_lib.acquire(tmp_path, ["third"]) == lock
    workdir_lib.release_held()
    # Another host's lock cannot be checked: refused.
    lock.write_text('{"pid": 1, "host": "elsewhere", "started_utc": "x"}')
    with pytest.raises(ConfigError, match="in use by pid 1 on elsewhere"):
        workdir_lib.acquire(tmp_path, ["fourth"])


def test_claim_saves_the_settings_and_refuses_other_ones(tmp_path):
    spec = config_spec("tiny")
    with workdir_lib.claim(spec, tmp_path / "w", ["cmd", "one"]) as w:
        assert (w / ".lock").exists() and (w / "config.json").exists()
        (w / "checkpoints" / "1").mkdir(parents=True)  # as a committed step leaves it
    assert not (tmp_path / "w" / ".lock").exists()
    with workdir_lib.claim(spec.replace(**{"train.steps": 4}), tmp_path / "w", ["cmd", "two"]):
        pass
    saved = workdir_lib.load_saved_spec(tmp_path / "w")
    assert saved.train.steps == 4
    with pytest.raises(ConfigError, match="train.learning_rate: saved 0.0001, now 0.001"):
        with workdir_lib.claim(spec.replace(**{"train.learning_rate": 1e-3}), tmp_path / "w", ["cmd"]):
            pass


def test_kept_summary_reads_the_committed_steps(tmp_path):
    assert workdir_lib.kept_summary(tmp_path).endswith("has no committed step; the next launch starts from step 1")
    for name in ("1", "2", "3.orbax-checkpoint-tmp-9"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    assert workdir_lib.committed_steps(tmp_path) == [1, 2]
    assert "keeps committed steps up to 2 (receipts and checkpoint 2)" in workdir_lib.kept_summary(tmp_path)


def test_settings_bind_only_once_something_was_committed(tmp_path):
    """A run that failed on its inputs leaves config.json but committed nothing: the corrected rerun may
    change any setting, even when that file is broken; after a commit the saved settings bind."""
    w = tmp_path / "w"
    spec = config_spec("tiny")
    workdir_lib.save_spec(spec, w, ["cmd"])
    changed = spec.replace(**{"train.learning_rate": 1e-3})
    with workdir_lib.claim(changed, w, ["cmd", "fixed"]):
        pass
    assert workdir_lib.load_saved_spec(w) == changed
    (w / "config.json").write_text('{"config": {"na')  # truncated, nothing committed: overwritten
    with workdir_lib.claim(spec, w, ["cmd"]):
        pass
    assert workdir_lib.load_saved_spec(w) == spec
    (w / "evidence" / "step_000001").mkdir(parents=True)
    (w / "evidence" / "step_000001" / "receipt.json").write_text("{}")
    assert workdir_lib.has_committed_work(w) and workdir_lib.saved_settings(w) == spec
    with pytest.raises(ConfigError, match="train.learning_rate: saved 0.0001, now 0.001"):
        with workdir_lib.claim(changed, w, ["cmd"]):
            pass
    (w / "config.json").write_text('{"config": {"na')
    with pytest.raises(ConfigError, match=r"is not a saved run config \(JSONDecodeError: .*\) and no copy of it is "
                                          "kept; use a fresh --workdir$"):
        workdir_lib.saved_settings(w)


def test_a_lock_being_taken_when_the_run_stops_is_released(tmp_path, monkeypatch):
    """The run takes its lock in a worker thread; SIGTERM or Ctrl-C releases it from the main thread
    (`release_held`, then os._exit). A stop that lands after the lock file exists but before the lock is recorded
    as held used to leave the file behind (seen in CI): `release_held` waits for the taking to finish."""
    created, go_on = threading.Event(), threading.Event()
    take = workdir_lib._take

    def take_then_pause(path, record):  # the real take, then held up where the stop landed
        taken = take(path, record)
        created.set()
        go_on.wait(10)
        return taken

    monkeypatch.setattr(workdir_lib, "_take", take_then_pause)
    taker = threading.Thread(target=workdir_lib.acquire, args=(tmp_path / "w", ["launch"]))
    taker.start()
    assert created.wait(10) and (tmp_path / "w" / ".lock").exists()
    releaser = threading.Thread(target=workdir_lib.release_held)
    releaser.start()
    releaser.join(0.5)
    assert releaser.is_alive()  # waits for the lock to be recorded instead of releasing nothing
    go_on.set()
    releaser.join(10)
    taker.join(10)
    assert not releaser.is_alive() and not (tmp_path / "w" / ".lock").exists()
