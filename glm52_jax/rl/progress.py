"""Console progress of a run: a bar redrawn in place on a terminal, plain periodic lines otherwise.

A log or CI file keeps one line per ~10% of a long phase (no carriage returns in it); a person at a
terminal sees the bar move. A log line printed while a bar is shown clears it and the bar is redrawn below
the line (as tqdm does), so the two never mix; `done()` drops a bar that will not reach its total.
Several processes: only plain lines (the processes' bars would overwrite each other).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import TextIO

BAR_WIDTH = 24


def bar_text(label: str, done: int, total: int, detail: str = "", unit: str = "") -> str:
    """`label |############------------|  50% 5/10 unit, detail` (the bar's line, without a line end)."""
    frac = min(1.0, done / total) if total else 1.0
    filled = round(frac * BAR_WIDTH)
    text = f"{label} |{'#' * filled}{'-' * (BAR_WIDTH - filled)}| {100 * frac:3.0f}% {done:,}/{total:,}"
    return text + (f" {unit}" if unit else "") + (f", {detail}" if detail else "")


class Console:
    """Log lines and progress of one process.

    `line(msg)`: a log line (`log`, e.g. the launcher's stderr printer). `progress(label, done, total, detail,
    unit=)`: on a terminal (`stream.isatty()`, `bars`) redraws a bar on `stream`; otherwise logs a plain line when the
    phase starts a new tenth, or ends, if `total >= plain_min_total` (short phases stay quiet in logs).
    """

    def __init__(self, log: Callable[[str], None], stream: TextIO | None = None, *, bars: bool | None = None):
        self._log = log
        self._stream = sys.stderr if stream is None else stream
        self.bars = _isatty(self._stream) if bars is None else bars
        self._bar: str | None = None  # the bar on the terminal's current line
        self._tenths: dict[str, int] = {}
        self._lock = threading.Lock()  # the compile reporter's timer thread logs too

    def line(self, msg: str) -> None:
        with self._lock:
            bar = self._bar
            self._clear()
            self._log(msg)
            if bar is not None:
                self._draw(bar)

    def done(self) -> None:
        """Ends the shown bar (a search accepted before its last candidate) without a redraw."""
        with self._lock:
            self._clear()

    def progress(self, label: str, done: int, total: int, detail: str = "", *, unit: str = "",
                 plain_min_total: int = 0) -> None:
        with self._lock:
            if self.bars:
                self._draw(bar_text(label, done, total, detail, unit))
                if done >= total:
                    self._stream.write("\n")
                    self._stream.flush()
                    self._bar = None
                return
            if total < plain_min_total:
                return
            tenth = done * 10 // max(total, 1)
            if tenth != self._tenths.get(label) or done >= total:
                self._tenths[label] = tenth
                self._log(f"{label} {done:,}/{total:,}" + (f" {unit}" if unit else "")
                          + f" ({100 * done / max(total, 1):.0f}%)" + (f", {detail}" if detail else ""))
            if done >= total:
                self._tenths.pop(label, None)

    def _draw(self, bar: str) -> None:
        self._stream.write("\r\033[K" + bar)
        self._stream.flush()
        self._bar = bar

    def _clear(self) -> None:
        if self._bar is not None:
            self._stream.write("\r\033[K")
            self._stream.flush()
            self._bar = None


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or file-like stream without a terminal
        return False
