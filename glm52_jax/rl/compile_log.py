"""`compiling <program>...` lines while XLA compiles (the first minute of a run is compiles, silent otherwise).

JAX reports the start (a scalar: the start time) and the duration of each program's lowering and backend
compile through `jax.monitoring`, keyed by the program's name (`jit_decode`, ...). A program still
compiling `announce_after_s` after its lowering started gets a `compiling <name>...` line, and its end a
`compiled <name> in T s` line; the many small programs that compile in milliseconds stay silent. Names
like `jit(<lambda>)` say little, so the line adds the run's phase when the caller gives one.
Compiles run one at a time in the thread that traced them, so one timer at a time suffices.
`$GLM52_COMPILE_LINES_AFTER_S` changes the 1 s threshold (0: a line for every compile).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator

ENV_AFTER_S = "GLM52_COMPILE_LINES_AFTER_S"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_COMPILE = "/jax/core/compile/backend_compile_duration"


class CompileReporter:
    """Listener state: the program now compiling, since when, and whether its line was printed."""

    def __init__(self, log: Callable[[str], None], announce_after_s: float = 1.0,
                 phase: Callable[[], str] | None = None):
        self._log = log
        self._phase = phase
        self._after = announce_after_s
        self._lock = threading.Lock()
        self._name: str | None = None
        self._start = 0.0
        self._announced = False
        self._timer: threading.Timer | None = None
        self.announced: list[str] = []  # programs that got a line (for tests and summaries)

    def on_scalar(self, event: str, value: float, **kwargs) -> None:
        """`jax.monitoring` scalar listener: lowering or compile of `fun_name` starts."""
        if event not in (_LOWER, _COMPILE):
            return
        name = str(kwargs.get("fun_name", "?"))
        with self._lock:
            if name == self._name:  # the compile that follows this program's lowering: the same phase
                return
            self._cancel()
            self._name, self._start, self._announced = name, time.monotonic(), False
            self._timer = threading.Timer(self._after, self._announce, args=(name,))
            self._timer.daemon = True
            self._timer.start()

    def on_duration(self, event: str, duration_s: float, **kwargs) -> None:
        """`jax.monitoring` duration listener: the backend compile of `fun_name` ended."""
        if event != _COMPILE:
            return
        name = str(kwargs.get("fun_name", "?"))
        with self._lock:
            if name != self._name:
                return
            announced, elapsed = self._announced, time.monotonic() - self._start
            self._cancel()
        if announced:
            self._log(f"compiled {name} in {elapsed:.1f} s")

    def _announce(self, name: str) -> None:
        with self._lock:
            if name != self._name:
                return
            self._announced = True
            self.announced.append(name)
        where = self._phase() if self._phase is not None else ""
        self._log(f"compiling {name}" + (f" ({where})" if where else "") + "...")

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._name, self._timer, self._announced = None, None, False


@contextlib.contextmanager
def compile_lines(log: Callable[[str], None], announce_after_s: float | None = None,
                  phase: Callable[[], str] | None = None) -> Iterator[CompileReporter]:
    """Prints `compiling <program> (<phase()>)...` lines through `log` while the block runs, for compiles
    longer than `announce_after_s` (default `$GLM52_COMPILE_LINES_AFTER_S`, else 1 s)."""
    import jax.monitoring as monitoring

    if announce_after_s is None:
        announce_after_s = float(os.environ.get(ENV_AFTER_S) or 1.0)
    reporter = CompileReporter(log, announce_after_s, phase)
    monitoring.register_scalar_listener(reporter.on_scalar)
    monitoring.register_event_duration_secs_listener(reporter.on_duration)
    try:
        yield reporter
    finally:
        monitoring.unregister_scalar_listener(reporter.on_scalar)
        monitoring.unregister_event_duration_listener(reporter.on_duration)
        with reporter._lock:
            reporter._cancel()
