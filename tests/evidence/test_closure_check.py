"""verify's checks of a closure receipt: a 2-process run's records gathered from the workdir and committed
(`closure/record.py`), then forged and re-sealed (tests/receipt_forgery.py): each forgery fails with one line."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from glm52_jax.closure import record as closure
from glm52_jax.evidence import EvidenceWriter, verify
from glm52_jax.evidence.closure_check import LIVE_BYTES_BOUND
from glm52_jax.plan.hlo import COLLECTIVE_KINDS
from tests.receipt_forgery import resealed

STEPS = (1, 2)
TRACE = b'{"event": "step_done"}\n'


def _record(process: int, processes: int = 2) -> dict:
    """What `closure.process_record` writes for a finished 2-step run (its shape; values of a run on 2 x 4 devices)."""
    by_kind = {k: {"ops": 0, "bytes": 0, "ops_in_unknown_loops": 0} for k in COLLECTIVE_KINDS}
    by_kind["all-reduce"] = {"ops": 96, "bytes": 4096, "ops_in_unknown_loops": 0}
    phases = {"load": 1, "prefill": 4, "decode": 2, "update": 2, "checkpoint save": 2, "barrier": 9}
    port = {"connect": "connection refused", "closed": True} | ({"bind": "free"} if process == 0 else {})
    trace = f"step_000001/artifacts/traces/rank{process}.jsonl"
    return {"process": process, "processes": processes, "status": "finished",
            "phases": {"entered": phases, "completed": dict(phases), "unfinished": []},
            "collectives": {"available": True, "programs": 3, "executions": 40, "by_kind": by_kind, "by_program": []},
            "trace_events": {"events": 5, "by_kind": {"step_done": 1},
                             "traces": [{"path": trace, "sha256": hashlib.sha256(TRACE).hexdigest()}]},
            "stopped": {"peer_watch": "stopped (published done; no longer polled)",
                        "compile_cache": {"directory": None, "closed": True}, "coordinator": "shut down"},
            "coordinator_port": port, "coordinator_address": "localhost:12355",
            "after_release": {"live_arrays": 0, "live_array_bytes": 0, "device_bytes_in_use": None, "devices": []}}


@pytest.fixture(scope="module")
def committed(tmp_path_factory) -> Path:
    """A workdir with two step receipts, each process's record written to the staging directory, and the closure
    receipt process 0 commits from them."""
    workdir = tmp_path_factory.mktemp("closure_run")
    receipts = []
    for step in STEPS:
        writer = EvidenceWriter(workdir / "evidence" / f"step_{step:06d}", provenance={})
        for p in (0, 1):
            writer.add_bytes(f"traces/rank{p}.jsonl", TRACE, kind="trace")
        receipts.append(writer.commit({"transaction": {"step": step}}))
    for p in (1, 0):
        closure.write_own(workdir, STEPS[-1], _record(p))
    path = closure.commit(workdir, receipts, closure.gather(workdir, STEPS[-1], 2, timeout_s=1))
    assert path == workdir / "evidence" / "closure_step_000002.json"
    assert not (workdir / "closure").exists()  # the staging files are gone once committed
    return path


def test_the_committed_closure_verifies_and_binds_the_steps(committed):
    assert verify(committed) == []
    section = json.loads(committed.read_text())["closure"]
    assert [r["process"] for r in section["records"]] == [0, 1] and section["live_bytes_bound"] == LIVE_BYTES_BOUND
    assert [(s["step"], s["receipt"]) for s in section["steps"]] == [(1, "step_000001/receipt.json"),
                                                                    (2, "step_000002/receipt.json")]


def test_a_missing_record_is_named_by_gather(tmp_path):
    closure.write_own(tmp_path, 3, _record(0))
    with pytest.raises(TimeoutError, match=r"no closure record of process\(es\) 1 in .* within 0.2 s"):
        closure.gather(tmp_path, 3, 2, timeout_s=0.2)


def _both(edit):
    """An edit applied to the inline record and to its artifact alike (only the closure checks can then catch it)."""
    def apply(receipt, artifacts):
        for record in receipt["closure"]["records"]:
            edit(record)
            (artifacts / f"process_{record['process']}.json").write_text(json.dumps(record))
    return apply


def _process_1(edit):
    return _both(lambda r: edit(r) if r["process"] == 1 else None)


FORGERIES = {
    "record dropped": (lambda r, a: r["closure"]["records"].pop(1),
                       "closure: no record of process 1 (2 processes ran)"),
    "port open": (_process_1(lambda r: r["coordinator_port"].update(closed=False)),
                  "closure: process 1: coordinator port not closed ({'connect': 'connection refused', "
                  "'closed': False})"),
    "phase unfinished": (_process_1(lambda r: r["phases"]["entered"].update(update=3)),
                         "closure: process 1 left phases unfinished: update"),
    "live bytes": (_process_1(lambda r: r["after_release"].update(live_array_bytes=LIVE_BYTES_BOUND + 1)),
                   f"closure: process 1 held {LIVE_BYTES_BOUND + 1:,} bytes (live_array_bytes) after the release, "
                   f"above the bound of {LIVE_BYTES_BOUND:,}"),
    "collectives differ": (_process_1(lambda r: r["collectives"]["by_kind"]["all-reduce"].update(ops=95)),
                           "closure: process 1 records other collectives than process 0 (SPMD processes run the same)"),
    "coordinator kept": (_process_1(lambda r: r["stopped"].update(coordinator="running")),
                         "closure: process 1: coordinator not shut down ('running')"),
    "inline only": (lambda r, a: r["closure"]["records"][0]["after_release"].update(live_array_bytes=0, live_arrays=1),
                    "closure: the record of process 0 differs from process_0.json"),
}


@pytest.mark.parametrize("name", FORGERIES)
def test_a_resealed_forgery_fails_with_one_line(committed, tmp_path, name):
    edit, line = FORGERIES[name]
    assert verify(resealed(committed, tmp_path, edit)) == [line]


def test_a_step_receipt_other_than_the_quoted_one_is_named(committed, tmp_path):
    """Beside the step receipts (a workdir's evidence/), a replaced step receipt no longer matches the quote."""
    evidence = tmp_path / "evidence"
    shutil.copytree(committed.parent, evidence, ignore=shutil.ignore_patterns("closure_*"))
    forged = resealed(committed, evidence, lambda r, a: r["closure"]["steps"][0].update(receipt_sha256="f" * 64))
    actual = json.loads((evidence / "step_000001" / "receipt.json").read_text())["receipt_sha256"]
    assert verify(forged) == [f"closure: step 1's receipt step_000001/receipt.json has receipt_sha256 {actual}, "
                              f"not the {'f' * 64} the closure quotes"]


def test_the_committed_closure_is_the_online_receipts_run():
    """evidence/online_grpo_tiny_closure.json, published from the run that evidence/online_grpo_tiny.json's step 1
    came from: it verifies and quotes that step's original receipt_sha256 (the one the published copy records)."""
    root = Path(__file__).resolve().parents[2] / "evidence"
    closure_receipt, online = root / "online_grpo_tiny_closure.json", root / "online_grpo_tiny.json"
    assert verify(closure_receipt) == []
    section = json.loads(closure_receipt.read_text())["closure"]
    step_1 = next(s for s in section["steps"] if s["step"] == 1)
    assert step_1["receipt_sha256"] == json.loads(online.read_text())["published"]["receipt_sha256"]
    assert section["processes"] == 1 and section["records"][0]["phases"]["completed"]["checkpoint save"] == 2
