"""A deadline for every phase of a run: a hang where every process is alive is caught, named and its stacks kept.

The peer watch (peer_watch.py) notices a process that died. A run can also hang with every process alive: two
processes that issue collectives in a different order wait for each other forever (NCCL on GPUs, gloo on CPUs),
after a prefill of several minutes, and nothing is said. Here each phase (load, prefill, decode, update, checkpoint
save and restore, export, each parity mode, a barrier or allgather) is entered through `phase(...)`, which arms a
deadline and records (phase, program, step). The launcher's main thread, which stays in Python while the work
thread computes, calls `Watchdog.poll()` twice a second; a phase past its deadline ends the run:

- every process writes its Python stacks (`faulthandler`, all threads) and where it was to
  `WORKDIR/watchdog/stacks_<i>.txt`;
- the process prints one line, `hang: phase barrier (step 1, program sync_global_devices(...)) passed its deadline
  of 70 s on process 0; processes not finished: 0 (in barrier, step 1), 1 (in load); stacks in
  WORKDIR/watchdog/stacks_*.txt`, and exits with `HANG_EXIT`.

Several processes: each process's own watchdog fires on its own, and the first to fire writes
`WORKDIR/watchdog/hang.json`, which the others read at their next poll: they write their stacks too and stop with
the same line (one process that sleeps leaves the others waiting in a collective: all of them report). To name the
processes that had not finished a phase, each process keeps `WORKDIR/watchdog/phase_<i>.json` up to date: the
phases it is in (by sequence number: every process enters the same phases in the same order, SPMD) and the last it
entered. The workdir is one shared directory for every process (docs/cluster.md), so the files are seen by all.

Deadlines (`deadlines_for`): `--config.watchdog.phase_timeout_s` (0 = no watchdog), or, for the phases that run a
planned program, from WORKDIR/plan.json when `--mode=plan --workdir=WORKDIR` wrote one for a GPU target on this mesh:
`plan_factor` x (the programs' calibrated pessimistic time x calls per transaction + their lower and compile
seconds) + `SLACK_S`.

Test hook: `GLM52_TEST_STALL=PHASE:SECONDS[:PROCESS]` makes `phase(PHASE)` sleep SECONDS after arming its deadline
(on process PROCESS only, when given). Read here and nowhere else; tests use it to make one process hang.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import faulthandler
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

STALL_ENV = "GLM52_TEST_STALL"
HANG_EXIT = 3  # distinct from errors (1), bad flags (2), Ctrl-C (130) and SIGTERM (143)
DIR = "watchdog"
MARKER = "hang.json"
SLACK_S = 60.0  # a plan-derived deadline's allowance for the host work around the programs (copies, hashing)
# The plan's programs each phase runs (phases not listed get the config value).
PLAN_PROGRAMS = {"prefill": ("prefill",), "decode": ("decode",), "update": ("train", "new_logprobs")}
REPORT_WAIT_S = 10.0  # how long the process that fired waits for the others' stacks files


@dataclasses.dataclass(frozen=True)
class Phase:
    """One armed phase: its name, the compiled program it runs (or None), the step, its deadline and sequence
    number (the n-th phase this process entered; the same on every process)."""

    name: str
    program: str | None
    step: int | None
    deadline_s: float
    entered: float  # the watchdog's clock
    seq: int

    def describe(self) -> str:
        where = ", ".join(x for x in (f"step {self.step}" if self.step is not None else "",
                                      f"program {self.program}" if self.program else "") if x)
        return f"phase {self.name}" + (f" ({where})" if where else "")


@dataclasses.dataclass(frozen=True)
class Deadlines:
    """Seconds a phase may last: `per_phase` (from a plan) where given, else `default_s`."""

    default_s: float
    per_phase: Mapping[str, float] = dataclasses.field(default_factory=dict)
    source: str = "--config.watchdog.phase_timeout_s"

    def seconds(self, phase: str) -> float:
        return self.per_phase.get(phase, self.default_s)


def plan_deadlines(plan: Mapping[str, Any], mesh: str, factor: float,
                   shapes: Mapping[str, Any] | None = None) -> dict[str, float] | None:
    """{phase: seconds} from a plan report (`planner.plan`'s, WORKDIR/plan.json) made for the mesh `mesh`
    (`MeshSpec.describe()`) and the run's `shapes` (plan report "shapes" keys: prompt_tokens, ...), or None when it
    has no time estimates (a CPU target), another mesh or other shapes."""
    if factor <= 0 or plan.get("mesh", {}).get("describe") != mesh:
        return None
    planned_shapes = plan.get("shapes") or {}
    if any(planned_shapes.get(k) != v for k, v in (shapes or {}).items()):
        return None
    programs = plan.get("programs") or {}
    out = {}
    for phase, names in PLAN_PROGRAMS.items():
        entries = [programs.get(n) for n in names]
        if not all(e and e.get("time") for e in entries):
            continue
        seconds = sum(e["time"]["pessimistic_s"] * e["calls_per_transaction"]
                      + e["seconds"]["lower"] + e["seconds"]["compile"] for e in entries)
        out[phase] = round(factor * seconds + SLACK_S, 1)
    return out or None


def deadlines_for(timeout_s: float, plan_factor: float, workdir: str | os.PathLike | None, mesh: str,
                  shapes: Mapping[str, Any] | None = None) -> Deadlines | None:
    """The run's deadlines (None: no watchdog, `timeout_s` = 0): the config value, and for the planned phases
    WORKDIR/plan.json's when it fits this mesh and `shapes`. A plan.json that does not is named in `source`."""
    if timeout_s <= 0:
        return None
    path = Path(workdir) / "plan.json" if workdir else None
    if path is None or not path.is_file() or plan_factor <= 0:
        return Deadlines(timeout_s)
    try:
        planned = plan_deadlines(json.loads(path.read_text()), mesh, plan_factor, shapes)
    except (OSError, ValueError, KeyError, TypeError):  # an unreadable or older plan: the config value
        planned = None
    if not planned:
        return Deadlines(timeout_s, source=f"--config.watchdog.phase_timeout_s; {path} is not used: no GPU time "
                         f"estimates, or planned for another mesh or other settings than {mesh}, {dict(shapes or {})}")
    return Deadlines(timeout_s, planned, f"{path} x {plan_factor:g}")


def _stall(name: str, process: int) -> float:
    """Seconds `GLM52_TEST_STALL` asks phase `name` to sleep on `process` (0: none)."""
    value = os.environ.get(STALL_ENV, "")
    if not value:
        return 0.0
    parts = value.rsplit(":", 2) if value.count(":") >= 2 else value.rsplit(":", 1)
    try:
        phase, seconds = parts[0], float(parts[1])
        only = int(parts[2]) if len(parts) == 3 else None
    except (IndexError, ValueError):
        raise ValueError(f"{STALL_ENV}={value!r}: expected PHASE:SECONDS[:PROCESS] (a test hook)") from None
    return seconds if phase == name and only in (None, process) else 0.0


def _write_json(path: Path, record: dict) -> None:
    """Whole or absent: a reader on another host never sees half a record."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class Watchdog:
    """This process's phases and their deadlines; `poll()` from a thread that is not the one doing the work."""

    def __init__(self, workdir: str | os.PathLike, process: int, count: int, deadlines: Deadlines, *,
                 clock: Callable[[], float] = time.monotonic):
        self.dir = Path(workdir) / DIR
        self.process, self.count, self.deadlines, self.clock = process, count, deadlines, clock
        self.started = time.time()  # a hang.json older than this is another run's
        self._lock = threading.Lock()  # the work thread enters phases, the main thread polls
        self._stack: list[Phase] = []
        self._seq = 0
        self._step: int | None = None

    # -- the work thread ------------------------------------------------------------------------
    def set_step(self, step: int | None) -> None:
        self._step = step

    def enter(self, name: str, program: str | None, step: int | None) -> Phase:
        with self._lock:
            self._seq += 1
            entered = Phase(name, program, self._step if step is None else step, self.deadlines.seconds(name),
                            self.clock(), self._seq)
            self._stack.append(entered)
            self._publish()
        return entered

    def leave(self, entered: Phase) -> None:
        with self._lock:
            if entered in self._stack:
                self._stack.remove(entered)
            self._publish()

    def _publish(self) -> None:
        """phase_<i>.json: the phases this process is in and the last it entered (only read by other processes)."""
        if self.count == 1:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        _write_json(self.dir / f"phase_{self.process}.json",
                    {"process": self.process, "last": self._seq, "open": [p.seq for p in self._stack],
                     "in": [dataclasses.asdict(p) for p in self._stack], "time": time.time()})

    # -- the main thread ------------------------------------------------------------------------
    def poll(self) -> Phase | dict | None:
        """The innermost phase past its deadline, else another process's hang record (hang.json), else None."""
        now = self.clock()
        with self._lock:
            for p in reversed(self._stack):
                if now - p.entered > p.deadline_s:
                    return p
        if self.count > 1:
            marker = _read_json(self.dir / MARKER)
            if marker is not None and marker.get("time", 0) >= self.started and marker.get("process") != self.process:
                return marker
        return None

    def unfinished(self, expired: Phase) -> list[str]:
        """The processes that had not finished `expired` (this one included), each with where it is."""
        out = []
        for q in range(self.count):
            if q == self.process:
                with self._lock:
                    rec = {"last": self._seq, "open": [p.seq for p in self._stack],
                           "in": [dataclasses.asdict(p) for p in self._stack]}
            else:
                rec = _read_json(self.dir / f"phase_{q}.json")
            if rec is None:
                out.append(f"{q} (no phase record: not started?)")
            elif expired.seq in rec["open"] or rec["last"] < expired.seq:
                inner = rec["in"][-1] if rec["in"] else None
                where = (f"in {inner['name']}" + (f", step {inner['step']}" if inner["step"] is not None else "")
                         if inner else "between phases")
                out.append(f"{q} ({where})")
        return out

    def report(self, found: Phase | dict) -> str:
        """Writes this process's stacks (and, when its own phase expired, hang.json for the others); returns the
        one line to print. The process that fired waits (bounded) for every process's stacks."""
        self.dir.mkdir(parents=True, exist_ok=True)
        stacks = self.dir / f"stacks_{self.process}.txt"
        with self._lock:
            here = list(self._stack)
        with open(stacks, "w") as f:
            f.write(f"process {self.process} of {self.count}, {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")
            f.write("phases (outermost first): "
                    + ("; ".join(f"{p.describe()}, {self.clock() - p.entered:.1f} s of {p.deadline_s:g} s"
                                 for p in here) or "none") + "\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        where = str(self.dir / ("stacks_*.txt" if self.count > 1 else stacks.name))
        if isinstance(found, dict):  # another process fired: the same line (it names where this one was)
            line = found["line"]
        else:
            on = f" on process {self.process}" if self.count > 1 else ""
            line = (f"hang: {found.describe()} passed its deadline of {found.deadline_s:g} s{on}; processes not "
                    f"finished: {', '.join(self.unfinished(found))}; stacks in {where}")
            if self.count > 1:
                _write_json(self.dir / MARKER, {"time": time.time(), "process": self.process, "line": line,
                                                "phase": dataclasses.asdict(found)})
        if self.count > 1 and (not isinstance(found, dict) or self.process == 0):
            self.wait_for_stacks(REPORT_WAIT_S)
        if self.count > 1 and self.process == 0:
            # Process 0 hosts the coordination service: when it exits, JAX aborts the others at once. A moment for
            # them to print their own line first.
            time.sleep(1.0)
        return line

    def wait_for_stacks(self, seconds: float) -> bool:
        """Waits until every process wrote its stacks for this hang (at most `seconds`)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if all(_fresh(self.dir / f"stacks_{q}.txt", self.started) for q in range(self.count)):
                return True
            time.sleep(0.2)
        return False


def _fresh(path: Path, since: float) -> bool:
    try:
        return path.stat().st_mtime >= since - 1.0
    except OSError:
        return False


_active: list[Watchdog] = []  # the installed watchdog (one per process), if any
# Phases this process entered and left normally, by name (with or without a watchdog): the run's closure record.
PHASES_ENTERED: collections.Counter[str] = collections.Counter()
PHASES_COMPLETED: collections.Counter[str] = collections.Counter()


def install(watchdog: Watchdog | None) -> None:
    _active[:] = [watchdog] if watchdog is not None else []


def active() -> Watchdog | None:
    return _active[0] if _active else None


def set_step(step: int | None) -> None:
    """The step the phases entered from now on belong to (the transaction sets it)."""
    if _active:
        _active[0].set_step(step)


def _process() -> int:
    watchdog = active()
    return watchdog.process if watchdog is not None else 0


@contextlib.contextmanager
def phase(name: str, *, program: str | None = None, step: int | None = None) -> Iterator[None]:
    """Runs the block as phase `name` under a deadline (no-op without an installed watchdog, except the test
    hook's sleep). `program`: the compiled program it runs, for the hang line; `step` defaults to `set_step`'s."""
    watchdog = active()
    entered = watchdog.enter(name, program, step) if watchdog is not None else None
    PHASES_ENTERED[name] += 1
    try:
        stall = _stall(name, _process())
        if stall:
            time.sleep(stall)
        yield
        PHASES_COMPLETED[name] += 1  # not reached when the block raised
    finally:
        if entered is not None:
            watchdog.leave(entered)


def describe(deadlines: Deadlines) -> str:
    """One line: the deadlines in force (printed when the workdir holds a plan)."""
    planned = ", ".join(f"{k} {v:,.0f} s" for k, v in sorted(deadlines.per_phase.items()))
    if not planned:
        return f"watchdog: every phase {deadlines.default_s:g} s ({deadlines.source})"
    return (f"watchdog: phase deadlines {planned} from {deadlines.source}; other phases {deadlines.default_s:g} s "
            "(--config.watchdog.phase_timeout_s)")

