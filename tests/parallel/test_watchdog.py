"""The hang watchdog: deadlines per phase, the hang line, the stacks, the processes not finished, plan deadlines.

Unit-sized: a fake clock and phase files written as other processes write them. The launcher runs (a real run
stalled inside a phase, one and two processes) are in tests/rl/test_hang.py."""

import json

import pytest

from glm52_jax.parallel import watchdog
from glm52_jax.parallel.watchdog import Deadlines, Watchdog


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock():
    return Clock()


def test_a_phase_past_its_deadline_is_named_with_its_stacks(tmp_path, clock):
    dog = Watchdog(tmp_path, 0, 1, Deadlines(5.0, {"prefill": 50.0}), clock=clock)
    watchdog.install(dog)
    try:
        watchdog.set_step(2)
        with watchdog.phase("prefill", program="prefill_chunked"):
            clock.now += 49
            assert dog.poll() is None  # within its plan deadline
            with watchdog.phase("barrier", program="sync_global_devices('x')", step=7):
                clock.now += 5.5  # the barrier's 5 s have passed, the prefill's 50 not yet
                found = dog.poll()
                assert (found.name, found.step, found.deadline_s) == ("barrier", 7, 5.0)
                clock.now += 1
                assert dog.poll().name == "barrier"  # the innermost first
                line = dog.report(found)
        assert dog.poll() is None  # both left
    finally:
        watchdog.install(None)
    stacks = tmp_path / "watchdog" / "stacks_0.txt"
    assert line == (f"hang: phase barrier (step 7, program sync_global_devices('x')) passed its deadline of 5 s; "
                    f"processes not finished: 0 (in barrier, step 7); stacks in {stacks}")
    text = stacks.read_text()
    assert text.startswith("process 0 of 1, ")
    assert ("phases (outermost first): phase prefill (step 2, program prefill_chunked), 55.5 s of 50 s; "
            "phase barrier (step 7, program sync_global_devices('x')), 6.5 s of 5 s") in text
    assert "test_watchdog.py" in text and "in test_a_phase_past_its_deadline_is_named_with_its_stacks" in text
    assert not (tmp_path / "watchdog" / "phase_0.json").exists()  # one process: nobody reads phase files


def _other(tmp_path, process: int, last: int, open_seqs: list[int], name: str = "update", step: int = 1):
    (tmp_path / "watchdog").mkdir(exist_ok=True)
    phases = [{"name": name, "program": None, "step": step, "deadline_s": 5.0, "entered": 0.0, "seq": s}
              for s in open_seqs]
    (tmp_path / "watchdog" / f"phase_{process}.json").write_text(
        json.dumps({"process": process, "last": last, "open": open_seqs, "in": phases, "time": 0.0}))


def test_the_processes_not_finished_are_named(tmp_path, clock):
    """Process 1 is still in the phase, 2 has not reached it, 3 finished it and went on, 4 wrote nothing."""
    dog = Watchdog(tmp_path, 0, 5, Deadlines(5.0), clock=clock)
    dog.set_step(1)
    dog.enter("load", None, None)
    dog.leave(dog.enter("allgather", "process_allgather", None))
    found = dog.enter("update", "grpo_step", None)
    assert found.seq == 3
    assert json.loads((tmp_path / "watchdog" / "phase_0.json").read_text())["open"] == [1, 3]
    _other(tmp_path, 1, last=4, open_seqs=[1, 3])
    _other(tmp_path, 2, last=2, open_seqs=[1], name="load")
    _other(tmp_path, 3, last=4, open_seqs=[1, 4], name="checkpoint save")
    clock.now += 6
    assert dog.poll() == found
    assert dog.unfinished(found) == ["0 (in update, step 1)", "1 (in update, step 1)", "2 (in load, step 1)",
                                     "4 (no phase record: not started?)"]
    assert dog.wait_for_stacks(0.0) is False


def test_every_process_reports_the_first_hang(tmp_path, clock):
    """The process that fired leaves hang.json; another process's poll returns it, and its report gives that line
    plus where it was (its own stacks written too). A hang.json of an earlier run is not taken for this one's."""
    first = Watchdog(tmp_path, 1, 2, Deadlines(5.0), clock=clock)
    other = Watchdog(tmp_path, 0, 2, Deadlines(50.0), clock=clock)  # waits in a barrier, within its deadline
    other.enter("barrier", "sync_global_devices('a')", 1)
    assert other.poll() is None
    expired = first.enter("prefill", "prefill_chunked", 1)
    clock.now += 6
    other.started = first.started = 0.0  # stacks written now are "fresh"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(watchdog, "REPORT_WAIT_S", 0.0)
        line = first.report(first.poll())
    assert line.startswith("hang: phase prefill (step 1, program prefill_chunked) passed its deadline of 5 s on "
                           "process 1; processes not finished: 0 (in barrier, step 1), 1 (in prefill, step 1); "
                           "stacks in ")
    assert line.endswith("watchdog/stacks_*.txt")
    marker = other.poll()
    assert marker["process"] == 1 and marker["phase"]["seq"] == expired.seq
    with pytest.MonkeyPatch.context() as m:
        m.setattr(watchdog.time, "sleep", lambda s: None)
        theirs = other.report(marker)
    assert theirs == line
    assert "phases (outermost first): phase barrier (step 1, program sync_global_devices('a'))" in (
        tmp_path / "watchdog" / "stacks_0.txt").read_text()
    assert (tmp_path / "watchdog" / "stacks_0.txt").is_file() and first.wait_for_stacks(0.5)
    later = Watchdog(tmp_path, 0, 2, Deadlines(5.0), clock=clock)
    assert later.poll() is None  # the marker predates it


def test_plan_deadlines_come_from_the_pessimistic_time_and_compile(tmp_path):
    def program(pessimistic, calls, lower=1.0, compile_s=9.0):
        return {"time": {"pessimistic_s": pessimistic, "central_s": 0.0}, "calls_per_transaction": calls,
                "seconds": {"lower": lower, "compile": compile_s}}

    plan = {"mesh": {"describe": "DP1/TP1/CP8/EP8/PP1"},
            "programs": {"prefill": program(20.0, 128), "decode": program(4.0, 1), "train": program(2.0, 1),
                         "new_logprobs": program(0.5, 1), "inventory": program(1.0, 2)}}
    assert watchdog.plan_deadlines(plan, "DP1/TP1/CP8/EP8/PP1", 3.0) == {
        "prefill": 3 * (20 * 128 + 10) + 60, "decode": 3 * 14 + 60, "update": 3 * (12 + 10.5) + 60}
    assert watchdog.plan_deadlines(plan, "DP1/TP1/CP32/EP32/PP1", 3.0) is None  # another mesh
    assert watchdog.plan_deadlines(plan, "DP1/TP1/CP8/EP8/PP1", 0.0) is None  # plan_factor 0
    plan["shapes"] = {"prompt_tokens": 2097152, "prefill_mode": "whole"}
    assert watchdog.plan_deadlines(plan, "DP1/TP1/CP8/EP8/PP1", 3.0, {"prompt_tokens": 2097152})["decode"] == 102
    assert watchdog.plan_deadlines(plan, "DP1/TP1/CP8/EP8/PP1", 3.0, {"prompt_tokens": 4096}) is None  # other shapes
    cpu = {"mesh": plan["mesh"], "programs": {k: {**v, "time": None} for k, v in plan["programs"].items()}}
    assert watchdog.plan_deadlines(cpu, "DP1/TP1/CP8/EP8/PP1", 3.0) is None  # a CPU plan has no times

    assert watchdog.deadlines_for(0.0, 3.0, tmp_path, "x") is None  # 0 = no watchdog
    assert watchdog.deadlines_for(600.0, 3.0, tmp_path, "x") == Deadlines(600.0)  # no plan.json
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    found = watchdog.deadlines_for(600.0, 2.0, tmp_path, "DP1/TP1/CP8/EP8/PP1")
    assert found.seconds("decode") == 2 * 14 + 60 and found.seconds("checkpoint save") == 600.0
    assert watchdog.describe(found).startswith("watchdog: phase deadlines decode 88 s, prefill 5,200 s, update 105 s")
    other = watchdog.deadlines_for(600.0, 2.0, tmp_path, "DP1/TP1/CP8/EP8/PP1", {"prompt_tokens": 4096})
    assert other.per_phase == {} and watchdog.describe(other) == (
        f"watchdog: every phase 600 s (--config.watchdog.phase_timeout_s; {tmp_path / 'plan.json'} is not used: no "
        "GPU time estimates, or planned for another mesh or other settings than DP1/TP1/CP8/EP8/PP1, "
        "{'prompt_tokens': 4096})")
    (tmp_path / "plan.json").write_text("{not json")
    assert watchdog.deadlines_for(600.0, 2.0, tmp_path, "DP1/TP1/CP8/EP8/PP1").seconds("prefill") == 600.0


def test_the_stall_hook(monkeypatch):
    monkeypatch.setenv(watchdog.STALL_ENV, "checkpoint save:2.5")
    assert watchdog._stall("checkpoint save", 3) == 2.5 and watchdog._stall("prefill", 0) == 0.0
    monkeypatch.setenv(watchdog.STALL_ENV, "load:7:1")
    assert watchdog._stall("load", 1) == 7.0 and watchdog._stall("load", 0) == 0.0
    monkeypatch.setenv(watchdog.STALL_ENV, "load")
    with pytest.raises(ValueError, match="expected PHASE:SECONDS"):
        watchdog._stall("load", 0)
    monkeypatch.delenv(watchdog.STALL_ENV)
    with watchdog.phase("load"):  # no watchdog installed: nothing armed, nothing written
        assert watchdog.active() is None
