"""The end of a finished run, recorded like the seed's closure and cleanup: `WORKDIR/evidence/closure_step_<k>.json`.

After the run's work returned (train mode, at least one step committed), every process, on its own:

1. stops counting collectives (`closure/ledger.py`) and notes what it ran: the phases it entered and completed
   (`watchdog.PHASES_*`), the collectives it issued (count and bytes by kind), the events of its traces (each
   step's `traces/rank<i>.jsonl`, counted and hashed);
2. stops what it started: the peer watch (its "done" is published, the main thread polls no more), the compile
   cache (JAX's persistent-cache handle closed), the coordinator (`jax.distributed.shutdown`: its clients leave,
   process 0's service stops), then releases its arrays (JAX's caches cleared, garbage collected) and measures
   what is still live: `jax.live_arrays()` bytes on its devices, and each device's `bytes_in_use` where the
   backend reports it (GPUs; XLA:CPU reports none);
3. checks the coordinator's port: a connection to it is refused (every process), and process 0 can bind it;
4. writes its record to `WORKDIR/closure/step_<k>/process_<i>.json`.

Process 0 then waits for every process's record file (no collective: the coordinator is gone) and commits the
closure receipt, which also binds the step receipts this run committed (their receipt_sha256). `python -m
glm52_jax.evidence verify` checks it (`evidence/closure_check.py`).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from glm52_jax.evidence.atomic import atomic_write_json
from glm52_jax.evidence.hashing import sha256_file
from glm52_jax.evidence.receipt import ARTIFACTS_DIR, RECEIPT_NAME, load_receipt

STAGING = "closure"
GATHER_TIMEOUT_S = 120.0  # process 0's wait for the others' records (they finish within seconds of it)
PORT_WAIT_S = 30.0  # how long a process retries until the coordinator's port refuses (process 0 stops it last)


def receipt_name(last_step: int) -> str:
    return f"closure_step_{last_step:06d}.json"


def _trace_record(workdir: Path, receipt: Path, process: int) -> dict[str, Any]:
    """This process's trace of one step (its events by kind, the file's sha256, relative to WORKDIR/evidence)."""
    path = receipt.parent / ARTIFACTS_DIR / "traces" / f"rank{process}.jsonl"
    events = collections.Counter(json.loads(line)["event"] for line in path.read_text().splitlines() if line)
    return {"path": path.resolve().relative_to((workdir / "evidence").resolve()).as_posix(),
            "sha256": sha256_file(path), "events": sum(events.values()), "by_kind": dict(sorted(events.items()))}


def _phases(watchdog_module) -> dict[str, Any]:
    entered, completed = dict(watchdog_module.PHASES_ENTERED), dict(watchdog_module.PHASES_COMPLETED)
    return {"entered": dict(sorted(entered.items())), "completed": dict(sorted(completed.items())),
            "unfinished": sorted(k for k in entered if completed.get(k, 0) != entered[k])}


def _release() -> dict[str, Any]:
    """Drops JAX's caches and the garbage, then what this process still holds on its devices."""
    import jax

    jax.clear_caches()
    gc.collect()
    live = jax.live_arrays()
    live_bytes = sum(s.data.nbytes for a in live if not a.is_deleted() for s in a.addressable_shards)
    devices = []
    for d in jax.local_devices():
        stats = d.memory_stats() or {}
        devices.append({"id": d.id, "bytes_in_use": stats.get("bytes_in_use")})
    in_use = [d["bytes_in_use"] for d in devices if d["bytes_in_use"] is not None]
    return {"live_arrays": len(live), "live_array_bytes": int(live_bytes),
            "device_bytes_in_use": max(in_use) if in_use else None, "devices": devices}


def _compile_cache() -> dict[str, Any]:
    """JAX's persistent compilation cache: which directory (None: not used) and closed."""
    import jax

    directory = jax.config.jax_compilation_cache_dir or None
    try:
        from jax._src import compilation_cache

        compilation_cache.reset_cache()  # drops the cache's handle; a later compile would reopen it
        closed = compilation_cache._cache is None  # JAX's handle (no public accessor)
    except (ImportError, AttributeError):
        closed = None
    return {"directory": directory, "closed": closed}


def _port_refused(address: str, wait_s: float) -> tuple[bool, str]:
    """Whether a TCP connection to `address` (host:port) is refused within `wait_s` (retried: process 0's
    coordinator service stops only after every client has left)."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2.0):
                pass
        except ConnectionRefusedError:
            return True, "connection refused"
        except OSError as e:
            return False, f"{type(e).__name__}: {e}"
        if time.monotonic() > deadline:
            return False, f"still accepting connections {wait_s:g} s after the shutdown"
        time.sleep(0.2)


def _port_bindable(address: str) -> bool:
    port = int(address.rpartition(":")[2])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT of the closed service is no holder
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


def _coordinator(group) -> dict[str, Any]:
    """Shuts the process group down (a multi-process run) and checks its port is closed."""
    if group is None or group.num_processes == 1:
        return {"coordinator": None, "state": "none (one process)", "port": None}
    import jax

    jax.distributed.shutdown()
    refused, how = _port_refused(group.coordinator, PORT_WAIT_S)
    record = {"coordinator": group.coordinator, "state": "shut down",
              "port": {"connect": how, "closed": refused}}
    if group.process_id == 0:
        record["port"]["bind"] = "free" if _port_bindable(group.coordinator) else "in use"
        record["port"]["closed"] = refused and record["port"]["bind"] == "free"
    return record


def process_record(workdir: Path, receipts: list[Path], *, process: int, count: int, group, watch, ledger,
                   watchdog_module) -> dict[str, Any]:
    """This process's closure record (steps 1-3 of the module's docstring)."""
    collectives = ledger.summary() if ledger is not None else {"available": False, "note": "not installed"}
    if ledger is not None:
        from glm52_jax.closure.ledger import uninstall

        uninstall()
        ledger.release()
    traces = [_trace_record(workdir, r, process) for r in receipts]
    events = collections.Counter()
    for t in traces:
        events.update(t["by_kind"])
    stopped = {"peer_watch": "stopped (published done; no longer polled)" if watch is not None
               else "none (one process)", "compile_cache": _compile_cache()}
    coordinator = _coordinator(group)  # before the release: jax.distributed holds no arrays
    release = _release()
    return {"process": process, "processes": count, "host": socket.gethostname(), "pid": os.getpid(),
            "status": "finished", "phases": _phases(watchdog_module), "collectives": collectives,
            "trace_events": {"events": sum(events.values()), "by_kind": dict(sorted(events.items())),
                             "traces": traces},
            "stopped": {**stopped, "coordinator": coordinator["state"]},
            "coordinator_port": coordinator["port"], "coordinator_address": coordinator["coordinator"],
            "after_release": release}


def staging_dir(workdir: Path, last_step: int) -> Path:
    return workdir / STAGING / f"step_{last_step:06d}"


def write_own(workdir: Path, last_step: int, record: dict[str, Any]) -> Path:
    path = staging_dir(workdir, last_step) / f"process_{record['process']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, record, indent=1)
    return path


def gather(workdir: Path, last_step: int, count: int, timeout_s: float = GATHER_TIMEOUT_S) -> list[dict[str, Any]]:
    """Every process's record (process 0 reads the files the others wrote; no collective)."""
    staging = staging_dir(workdir, last_step)
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [p for p in range(count) if not (staging / f"process_{p}.json").is_file()]
        if not missing:
            return [json.loads((staging / f"process_{p}.json").read_text()) for p in range(count)]
        if time.monotonic() > deadline:
            raise TimeoutError(f"no closure record of process(es) {', '.join(map(str, missing))} in {staging} "
                               f"within {timeout_s:g} s")
        time.sleep(0.2)


def commit(workdir: Path, receipts: list[Path], records: list[dict[str, Any]]) -> Path:
    """The closure receipt (process 0): every process's record, inline and as an artifact, and the step receipts."""
    import shutil

    from glm52_jax.evidence import EvidenceWriter
    from glm52_jax.evidence.closure_check import LIVE_BYTES_BOUND

    last = load_receipt(receipts[-1])["transaction"]["step"]
    evidence = workdir / "evidence"
    writer = EvidenceWriter(evidence, receipt_name=receipt_name(last))
    for record in records:
        writer.add_json(f"process_{record['process']}.json", record, kind="closure")
    steps = [{"step": load_receipt(r)["transaction"]["step"],
              "receipt": r.resolve().relative_to(evidence.resolve()).as_posix(),
              "receipt_sha256": load_receipt(r)["receipt_sha256"]} for r in receipts]
    path = writer.commit({"closure": {"status": "finished", "processes": len(records), "steps": steps,
                                      "live_bytes_bound": LIVE_BYTES_BOUND, "records": records},
                          "nondeterministic": ["closure"]})
    shutil.rmtree(staging_dir(workdir, last), ignore_errors=True)
    with contextlib.suppress(OSError):  # WORKDIR/closure itself, once no other closure is being gathered there
        staging_dir(workdir, last).parent.rmdir()
    return path


def step_receipts(paths: list[str]) -> list[Path]:
    """The run's committed step receipts (a train run's summary lists them), in step order."""
    return [Path(p) if Path(p).name == RECEIPT_NAME else Path(p) / RECEIPT_NAME for p in paths]
