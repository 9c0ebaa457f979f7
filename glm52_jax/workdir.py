"""A run directory's bookkeeping: one process at a time (a lock file), the saved settings, what is kept.

`claim(spec, workdir, command)` is what train and parity do before writing anything: take the
lock (refusing a workdir another live process holds), compare the settings with the ones saved by an
earlier run there (`run_config.check_rerun`), and save the current ones. Imports no JAX.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from glm52_jax.run_config import ConfigError, RunSpec, check_rerun, load_saved_spec, save_spec

LOCK_FILE = ".lock"
_held: set[Path] = set()  # locks this process holds (released by `release_held` on a hard exit)
# Taking a lock (create the file, record it in `_held`) and `release_held` exclude each other: the run takes its lock
# in a worker thread while a signal stops it from the main thread, and a SIGTERM that arrived between the two
# steps left the lock file behind (seen once in 15 tries on a loaded machine).
_taking = threading.Lock()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _take(path: Path, record: dict) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    return True


def acquire(workdir: Path, command: Sequence[str]) -> Path:
    """Creates WORKDIR/.lock (pid, host, start time, command) or raises `ConfigError` naming its holder.

    A lock left by a process that no longer runs on this host is taken over; a lock from another host
    cannot be checked and is refused."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / LOCK_FILE
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "started_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "command": list(command)}
    for _ in range(2):
        with _taking:
            if _take(path, record):
                _held.add(path)
                return path
        try:
            other = json.loads(path.read_text())
            pid, host = int(other["pid"]), str(other["host"])
        except (OSError, ValueError, KeyError, TypeError):
            raise ConfigError(f"{path} exists but is unreadable; if no run uses {workdir}, remove it") from None
        if host == record["host"] and not _alive(pid):
            path.unlink(missing_ok=True)  # its process is gone: a stale lock
            continue
        raise ConfigError(f"{workdir} is in use by pid {pid} on {host} (since {other.get('started_utc', '?')}); "
                          f"wait for it, or remove {path} if that process is gone")
    raise ConfigError(f"could not lock {workdir}: another process took {path} first")


def release(path: Path) -> None:
    """Removes the lock if this process holds it."""
    if path in _held:
        _held.discard(path)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def release_held() -> None:
    """Releases every lock of this process (before `os._exit`, which skips `finally` blocks), including one the
    run's thread is creating at this moment."""
    with _taking:
        for path in list(_held):
            release(path)


@contextlib.contextmanager
def claim(spec: RunSpec, workdir: str | os.PathLike, command: Sequence[str]) -> Iterator[Path]:
    """Locks `workdir`, checks the settings against the saved ones, saves the current settings."""
    workdir = Path(workdir)
    saved = saved_settings(workdir)
    if saved is not None:
        check_rerun(saved, spec, workdir)  # before the lock: a refused rerun writes nothing
    lock = acquire(workdir, command)
    try:
        if saved != spec:  # the record names the command that last set the settings
            save_spec(spec, workdir, command)
        yield workdir
    finally:
        release(lock)


def has_committed_work(workdir: str | os.PathLike) -> bool:
    """Whether a run on `workdir` committed anything: a checkpoint, a step receipt or a parity receipt."""
    evidence = Path(workdir) / "evidence"
    return bool(committed_steps(workdir)) or (evidence.is_dir() and (
        any(evidence.glob("step_*/receipt.json")) or any(evidence.glob("gradient_parity_*.json"))))


def saved_settings(workdir: str | os.PathLike) -> RunSpec | None:
    """The settings a rerun on `workdir` must keep: the saved ones once something was committed with
    them; None before that (a run that failed on its inputs leaves config.json behind, and the corrected
    rerun may change anything, even when that file is broken)."""
    if not has_committed_work(workdir):
        return None
    return load_saved_spec(workdir)


def committed_steps(workdir: str | os.PathLike) -> list[int]:
    """Steps with a complete checkpoint (Orbax renames a finished step to its number), from the
    directory listing alone: cheap enough for an interrupt message."""
    root = Path(workdir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit())


def kept_summary(workdir: str | os.PathLike) -> str:
    """One line on what an interrupted run leaves behind."""
    steps = committed_steps(workdir)
    if not steps:
        return f"{workdir} has no committed step; the next launch starts from step 1"
    return (f"{workdir} keeps committed steps up to {steps[-1]} (receipts and checkpoint {steps[-1]}); the step in "
            "progress was not committed and reruns identically on the next launch")
