"""A run that hangs with every process alive stops with one line, its stacks and its lock released (issue 36).

Real launcher processes; the hang is the watchdog's test hook (`GLM52_TEST_STALL=PHASE:SECONDS[:PROCESS]`), a sleep
inside a phase. The unit tests of the watchdog itself: tests/parallel/test_watchdog.py."""

import json
import os
import subprocess
import sys
import time

import pytest

from glm52_jax.parallel.watchdog import HANG_EXIT
from tests.process_helpers import finish, start_launchers
from tests.run_helpers import ROOT


def test_a_phase_past_its_deadline_stops_the_run(tmp_path):
    """One process, the tiny default, stalled in its first phase (loading the policy) past a 2 s deadline: exit
    HANG_EXIT, one line naming the phase and where the stacks are, the stacks naming the phase and showing the
    stalled frame, the workdir lock released. Seconds: the hang comes before any compile. A GPU plan of the run's
    mesh in the workdir sets the planned phases' deadlines (said in a line); the others keep the config's."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    timed = {"time": {"pessimistic_s": 2.0}, "calls_per_transaction": 4, "seconds": {"lower": 1.0, "compile": 9.0}}
    shapes = {"prompt_tokens": 256, "max_new_tokens": 32, "samples_per_request": 2, "chunk_size": 128,
              "prefill_mode": "chunked", "gradient_mode": "response_only", "dtype": "float32"}  # the tiny run's
    (workdir / "plan.json").write_text(json.dumps({"mesh": {"describe": "DP1/TP1/CP1/EP1/PP1"}, "shapes": shapes,
                                                   "programs": {name: timed for name in ("prefill", "decode", "train",
                                                                                         "new_logprobs")}}))
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "glm52_jax.launch", f"--workdir={workdir}",
                           "--config.watchdog.phase_timeout_s=2"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=dict(os.environ, GLM52_TEST_STALL="load:300"))
    seconds = time.monotonic() - start
    stacks = workdir / "watchdog" / "stacks_0.txt"
    assert done.returncode == HANG_EXIT, done.stderr[-3000:]
    assert (f"watchdog: phase deadlines decode 114 s, prefill 114 s, update 168 s from {workdir / 'plan.json'} x 3; "
            "other phases 2 s (--config.watchdog.phase_timeout_s)") in done.stderr.splitlines()
    assert done.stderr.splitlines()[-1] == (
        f"hang: phase load passed its deadline of 2 s; processes not finished: 0 (in load); stacks in {stacks}; "
        f"{workdir} has no committed step; the next launch starts from step 1")
    text = stacks.read_text()
    assert "phases (outermost first): phase load, " in text
    assert "watchdog.py" in text and " in phase" in text and "run.py" in text  # the work thread, asleep in it
    assert not (workdir / ".lock").exists() and seconds < 60


def test_two_processes_stop_together_with_their_stacks(tmp_path):
    """Two processes (4 CPU devices each): process 1 sleeps inside the run's first barrier, process 0 waits in it, in
    gloo, until its own 3 s deadline (process 1's is 600 s). Both stop with process 0's line, each with its stacks:
    process 0's inside the collective, process 1's in the sleep. Before any compile: seconds."""
    workdir = tmp_path / "run"
    common = [f"--workdir={workdir}", "--config.mesh=folded=8"]
    procs = start_launchers([common + ["--config.watchdog.phase_timeout_s=3"],
                             common + ["--config.watchdog.phase_timeout_s=600"]], tmp_path / "logs",
                            env={"GLM52_TEST_STALL": "barrier:300:1"})
    done = finish(procs, tmp_path / "logs", timeout=120)
    line = ("hang: phase barrier (program sync_global_devices('run: uncommitted evidence set aside')) passed its "
            "deadline of 3 s on process 0; processes not finished: 0 (in barrier), 1 (in barrier); stacks in "
            f"{workdir / 'watchdog' / 'stacks_*.txt'}; {workdir} has no committed step; the next launch starts from "
            "step 1")
    for rank, (code, _, err) in enumerate(done):
        assert code == HANG_EXIT, err[-3000:]
        assert err.splitlines()[-1] == f"[{rank}/2] {line}"
    waiting, stalled = ((workdir / "watchdog" / f"stacks_{p}.txt").read_text() for p in (0, 1))
    assert "in sync_global_devices" in waiting and "in sync_global_devices" not in stalled
    assert "phases (outermost first): phase barrier (program sync_global_devices(" in stalled
    assert not (workdir / ".lock").exists()


@pytest.mark.slow
def test_a_process_waiting_for_a_stalled_one_names_it(tmp_path):
    """Two processes (4 CPU devices each, one mesh): process 1 sleeps while loading the policy, process 0 goes on
    and waits in the step's first barrier until its own 70 s deadline (process 1's is 600 s). Process 0 names the
    barrier and process 1 still loading; process 1 reads its report, writes its stacks too and stops with the same
    line. ~2 minutes on 2 busy CPU cores (70 s of it the deadline, above process 0's ~40 s load)."""
    workdir = tmp_path / "run"
    common = [f"--workdir={workdir}", "--config.mesh=folded=8"]
    start = time.monotonic()
    procs = start_launchers([common + ["--config.watchdog.phase_timeout_s=70"],
                             common + ["--config.watchdog.phase_timeout_s=600"]], tmp_path / "logs",
                            env={"GLM52_TEST_STALL": "load:300:1"})
    done = finish(procs, tmp_path / "logs", timeout=400)
    seconds = time.monotonic() - start
    line = ("hang: phase barrier (step 1, program sync_global_devices('step 1: evidence directory ready')) passed its "
            "deadline of 70 s on process 0; processes not finished: 0 (in barrier, step 1), 1 (in load); stacks in "
            f"{workdir / 'watchdog' / 'stacks_*.txt'}; {workdir} has no committed step; the next launch starts from "
            "step 1")
    for rank, (code, _, err) in enumerate(done):
        assert code == HANG_EXIT, err[-3000:]
        assert err.splitlines()[-1] == f"[{rank}/2] {line}"
    waiting = (workdir / "watchdog" / "stacks_0.txt").read_text()
    assert "phase barrier (step 1" in waiting and "sync_global_devices" in waiting
    assert "phases (outermost first): phase load, " in (workdir / "watchdog" / "stacks_1.txt").read_text()
    assert not (workdir / ".lock").exists()
    print(f"two-process hang: {seconds:.1f} s")
