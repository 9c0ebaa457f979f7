"""`verify`'s checks of a closure receipt (`closure/record.py`): the end of a finished run, per process.

A closure receipt's `closure` section holds one record per process. For each, verify checks that it is there
(processes 0..P-1, no gap, no extra), that it finished with every phase it entered completed (a train run: one
load, one checkpoint save per step it committed), that what it started was stopped (peer watch, compile cache,
coordinator), that the coordinator's port was closed (refused; free to bind on process 0), and that its devices
held at most `LIVE_BYTES_BOUND` bytes of live arrays after the release (and of `bytes_in_use` where the backend
reports it). Across processes: the same phases and the same collectives (SPMD: every process runs the same
programs the same number of times). Each inline record must equal its artifact `process_<i>.json`, and, where
the run's step receipts and traces are beside the closure receipt (a workdir's evidence/), their sha256 must be
the ones it quotes. Imports no JAX.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from glm52_jax.evidence.hashing import sha256_file

# Bytes a process may still hold on its devices after the release: what JAX keeps for itself (none measured on
# XLA:CPU; a GPU's allocator keeps no arrays once they are freed), with room for a few small constants.
LIVE_BYTES_BOUND = 16 * 2**20
PREFIX = "closure"


def _record_failures(p: int, rec: Mapping[str, Any], processes: int, steps: int) -> list[str]:
    where = f"{PREFIX}: process {p}"
    out = []
    if rec.get("status") != "finished":
        out.append(f"{where} did not finish (status {rec.get('status')!r})")
    phases = rec.get("phases") or {}
    entered, completed = phases.get("entered") or {}, phases.get("completed") or {}
    unfinished = sorted(k for k in set(entered) | set(completed) if entered.get(k) != completed.get(k))
    if unfinished or phases.get("unfinished"):
        out.append(f"{where} left phases unfinished: {', '.join(unfinished or phases['unfinished'])}")
    if completed.get("load") != 1:
        out.append(f"{where} completed {completed.get('load', 0)} load phase(s), not 1")
    if completed.get("checkpoint save") != steps:
        out.append(f"{where} completed {completed.get('checkpoint save', 0)} checkpoint save(s) for {steps} step(s)")
    stopped = rec.get("stopped") or {}
    if not str(stopped.get("peer_watch", "")).startswith("stopped" if processes > 1 else "none"):
        out.append(f"{where}: peer watch not stopped ({stopped.get('peer_watch')!r})")
    if (stopped.get("compile_cache") or {}).get("closed") is not True:
        out.append(f"{where}: compile cache not closed")
    port = rec.get("coordinator_port")
    if processes > 1:
        if stopped.get("coordinator") != "shut down":
            out.append(f"{where}: coordinator not shut down ({stopped.get('coordinator')!r})")
        if not isinstance(port, Mapping) or port.get("closed") is not True or (p == 0 and port.get("bind") != "free"):
            out.append(f"{where}: coordinator port not closed ({port!r})")
    elif port is not None or stopped.get("coordinator") != "none (one process)":
        out.append(f"{where}: a one-process run records a coordinator ({stopped.get('coordinator')!r}, {port!r})")
    release = rec.get("after_release") or {}
    for key in ("live_array_bytes", "device_bytes_in_use"):
        value = release.get(key)
        if key == "live_array_bytes" and not isinstance(value, int):
            out.append(f"{where}: no live array bytes after the release")
        elif isinstance(value, int) and value > LIVE_BYTES_BOUND:
            out.append(f"{where} held {value:,} bytes ({key}) after the release, above the bound of "
                       f"{LIVE_BYTES_BOUND:,}")
    collectives = rec.get("collectives") or {}
    by_kind = collectives.get("by_kind")
    counts = by_kind.values() if isinstance(by_kind, Mapping) else None
    if counts is None or not all(isinstance(v, Mapping) and all(isinstance(n, int) and n >= 0 for n in v.values())
                                 for v in counts):
        out.append(f"{where}: collectives not counted by kind")
    return out


def _cross_process_failures(records: list[Mapping[str, Any]]) -> list[str]:
    out = []
    for key, what in ((("phases", "completed"), "phases"), (("collectives", "by_kind"), "collectives")):
        values = [(r.get(key[0]) or {}).get(key[1]) for r in records]
        for p, v in enumerate(values[1:], 1):
            if v != values[0]:
                out.append(f"{PREFIX}: process {p} records other {what} than process 0 (SPMD processes run the same)")
    return out


def _file_failures(evidence: Path, artifacts: Path, closure: Mapping[str, Any], records: list) -> list[str]:
    out = []
    for rec in records:
        path = artifacts / f"process_{rec.get('process')}.json"
        if path.is_file() and json.loads(path.read_text()) != rec:
            out.append(f"{PREFIX}: the record of process {rec.get('process')} differs from {path.name}")
    for step in closure.get("steps") or []:
        receipt = evidence / str(step.get("receipt", ""))
        if receipt.is_file():
            quoted = json.loads(receipt.read_text()).get("receipt_sha256")
            if quoted != step.get("receipt_sha256"):
                out.append(f"{PREFIX}: step {step.get('step')}'s receipt {step.get('receipt')} has receipt_sha256 "
                           f"{quoted}, not the {step.get('receipt_sha256')} the closure quotes")
    for rec in records:
        for trace in (rec.get("trace_events") or {}).get("traces") or []:
            file = evidence / str(trace.get("path", ""))
            if file.is_file() and sha256_file(file) != trace.get("sha256"):
                out.append(f"{PREFIX}: {trace.get('path')} hashes to {sha256_file(file)}, not the quoted "
                           f"{trace.get('sha256')}")
    return out


def closure_failures(receipt_path: Path, receipt: Mapping[str, Any], artifacts: str) -> list[str]:
    """One line per failed check of a closure receipt (none for a receipt without a `closure` section)."""
    closure = receipt.get("closure")
    if closure is None:
        return []
    if not isinstance(closure, Mapping) or not isinstance(closure.get("records"), list):
        return [f"{PREFIX}: no per-process records"]
    records = [r for r in closure["records"] if isinstance(r, Mapping)]
    processes = closure.get("processes")
    if not isinstance(processes, int) or processes < 1:
        return [f"{PREFIX}: no process count"]
    out = []
    if closure.get("status") != "finished":
        out.append(f"{PREFIX}: the run did not finish (status {closure.get('status')!r})")
    if closure.get("live_bytes_bound") != LIVE_BYTES_BOUND:
        out.append(f"{PREFIX}: states a live bytes bound of {closure.get('live_bytes_bound')!r}; verify's is "
                   f"{LIVE_BYTES_BOUND}")
    indices = [r.get("process") for r in records]
    for p in range(processes):
        if indices.count(p) != 1:
            out.append(f"{PREFIX}: {'no' if p not in indices else 'more than one'} record of process {p} "
                       f"({processes} processes ran)")
    extra = sorted({i for i in indices if not (isinstance(i, int) and 0 <= i < processes)}, key=str)
    if extra:
        out.append(f"{PREFIX}: records of processes {extra}, outside the {processes} that ran")
    steps = len(closure.get("steps") or [])
    for rec in records:
        if rec.get("process") in range(processes) and rec.get("processes") != processes:
            out.append(f"{PREFIX}: process {rec.get('process')} says {rec.get('processes')} processes ran, not "
                       f"{processes}")
        out += _record_failures(rec.get("process"), rec, processes, steps)
    out += _cross_process_failures(sorted(records, key=lambda r: str(r.get("process"))))
    return out + _file_failures(receipt_path.parent, receipt_path.parent / artifacts, closure, records)
