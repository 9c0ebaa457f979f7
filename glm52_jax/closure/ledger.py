"""The collectives one process issued: per compiled program, the collective ops of its HLO times its executions.

Counted per program, not observed on the wire: when an executable first runs, its compiled (SPMD-partitioned) HLO
is read once (`plan/hlo.py`'s parser: all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute,
async pairs once), each op weighted by the known trip counts of the loops around it (a loop whose trip count XLA
cannot prove, e.g. the DSA indexer's causal key loop, counts once and is flagged in `ops_in_unknown_loops`), and
that static count is multiplied by how many times the program ran. Bytes are each op's RESULT bytes on one device
(the gathered array of an all-gather), as in plan mode. A program without collectives is not counted (it adds
nothing).

Counting executions needs each call to pass through Python: JAX's C++ dispatch path (`pjit`'s fast path) runs a
cached executable without it. While the ledger is installed, programs WITH collectives are kept off the fast path
(each of their calls costs ~1-2 ms of Python dispatch more; on a GPU run these are the large programs: prefill
chunks, decode loops, updates), every other program keeps it. Both hooks are JAX internals
(`pxla.ExecuteReplicated.__call__`, `pjit._get_fastpath_data`); a JAX without them leaves the ledger
`available: False` with the reason, and nothing else changes.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

from glm52_jax.plan.hlo import COLLECTIVE_KINDS, COLLECTIVE_OPCODES, collective_bytes, loop_multipliers, parse_hlo

METHOD = ("per compiled program: collective ops in its HLO (x the known trip counts of the loops around each; "
          "unknown trip counts once) x its executions; bytes: each op's result bytes on one device")


def hlo_collectives(text: str) -> dict[str, dict[str, int]]:
    """{kind: {ops, bytes, ops_in_unknown_loops}} of one execution of a compiled module (`text`: its HLO text)."""
    comps, entry = parse_hlo(text)
    out = {k: {"ops": 0, "bytes": 0, "ops_in_unknown_loops": 0} for k in COLLECTIVE_KINDS}
    if entry is None:
        return out
    mult, unknown = loop_multipliers(comps, entry)
    for name, instrs in comps.items():
        times = mult.get(name, 0)
        shapes = {ins.name: ins.shape for ins in instrs}
        for ins in instrs:
            kind = COLLECTIVE_OPCODES.get(ins.opcode)
            if kind is None or not times:
                continue
            out[kind]["ops"] += int(times)
            out[kind]["bytes"] += int(collective_bytes(ins, shapes) * times)
            out[kind]["ops_in_unknown_loops"] += int(unknown.get(name, False))
    return out


class Ledger:
    """Executions of each program with collectives, and its static count (`record(name, executable)` per call)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._static: dict[int, tuple[str, dict] | None] = {}  # id(executable) -> (name, counts) / None: none
        self._keep: dict[int, Any] = {}  # the executables counted (their ids stay theirs while the ledger holds them)
        self._calls: collections.Counter[int] = collections.Counter()
        self.available, self.why = True, ""

    def _counts(self, name: str, executable: Any) -> tuple[str, dict] | None:
        key = id(executable)
        with self._lock:
            if key in self._static:
                return self._static[key]
        if _one_device(executable):  # nothing to communicate with: no HLO to read
            with self._lock:
                self._static[key] = None
            return None
        try:
            counts = hlo_collectives("\n".join(m.to_string() for m in executable.hlo_modules()))
        except Exception as e:  # an executable without HLO text (never seen): named, not guessed
            counts = None
            self.why = f"{name}: HLO not readable ({type(e).__name__})"
        entry = (name, counts) if counts and any(c["ops"] for c in counts.values()) else None
        with self._lock:
            self._static[key] = entry
            if entry is not None:
                self._keep[key] = executable
        return entry

    def has_collectives(self, name: str, executable: Any) -> bool:
        return self._counts(name, executable) is not None

    def record(self, name: str, executable: Any) -> None:
        if self._counts(name, executable) is not None:
            with self._lock:
                self._calls[id(executable)] += 1

    def summary(self) -> dict[str, Any]:
        """{available, method, programs, executions, by_kind: {kind: {ops, bytes, ops_in_unknown_loops}}, by_program:
        [{program, executions, ops}]} over every execution recorded."""
        by_kind = {k: {"ops": 0, "bytes": 0, "ops_in_unknown_loops": 0} for k in COLLECTIVE_KINDS}
        programs = []
        with self._lock:
            for key, calls in sorted(self._calls.items(), key=lambda kv: self._static[kv[0]][0]):
                name, counts = self._static[key]
                for kind, c in counts.items():
                    for field in by_kind[kind]:
                        by_kind[kind][field] += c[field] * calls
                programs.append({"program": name, "executions": calls,
                                 "ops_per_execution": {k: c["ops"] for k, c in counts.items() if c["ops"]}})
        out = {"available": self.available, "method": METHOD, "programs": len(programs),
               "executions": sum(p["executions"] for p in programs), "by_kind": by_kind, "by_program": programs}
        if self.why:
            out["note"] = self.why
        return out

    def release(self) -> None:
        """Drops the executables it held (their memory is the run's to release)."""
        with self._lock:
            self._keep.clear()


def _one_device(executable: Any) -> bool:
    """A program of one device in a one-process run (read at its first execution, once JAX has its backend)."""
    import jax

    try:
        return jax.process_count() == 1 and len(executable.local_devices()) == 1
    except Exception:  # an executable that cannot say: its HLO decides
        return False


_installed: list[tuple[Ledger, Any, Any]] = []  # (ledger, the original __call__, the original _get_fastpath_data)


def install() -> Ledger:
    """A ledger counting every program with collectives this process runs from now on (until `uninstall`)."""
    ledger = Ledger()
    try:
        from jax._src import pjit
        from jax._src.interpreters import pxla

        original_call, original_fastpath = pxla.ExecuteReplicated.__call__, pjit._get_fastpath_data
    except (ImportError, AttributeError) as e:
        ledger.available, ledger.why = False, f"this JAX has no execution hook ({type(e).__name__}: {e})"
        return ledger

    def call(self, *args):
        ledger.record(self.name, self.xla_executable)
        return original_call(self, *args)

    def fastpath(executable, *args, **kwargs):
        unsafe = getattr(executable, "unsafe_call", None)
        if isinstance(unsafe, pxla.ExecuteReplicated) and ledger.has_collectives(unsafe.name, unsafe.xla_executable):
            return None  # every call of this program through `call` above
        return original_fastpath(executable, *args, **kwargs)

    uninstall()
    pxla.ExecuteReplicated.__call__, pjit._get_fastpath_data = call, fastpath
    _installed.append((ledger, original_call, original_fastpath))
    return ledger


def uninstall() -> None:
    """Restores JAX's dispatch (programs already kept off the fast path stay off it: they run correctly)."""
    if not _installed:
        return
    from jax._src import pjit
    from jax._src.interpreters import pxla

    _, original_call, original_fastpath = _installed.pop()
    pxla.ExecuteReplicated.__call__, pjit._get_fastpath_data = original_call, original_fastpath
