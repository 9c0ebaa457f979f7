"""Console progress: plain lines per tenth in logs, a bar redrawn in place on a real terminal (a pty)."""

import os

from glm52_jax.rl.progress import BAR_WIDTH, Console, bar_text


def test_plain_lines_once_per_tenth_and_only_for_long_phases():
    lines = []
    console = Console(lines.append, bars=False)
    for done in range(0, 101, 5):
        console.progress("decode", done, 100, unit="steps", plain_min_total=50)
    assert lines == [f"decode {d}/100 steps ({d}%)" for d in range(0, 101, 10)]
    console.progress("short", 1, 2, plain_min_total=50)  # below the bound: nothing in the log
    assert len(lines) == 11


def _read_all(master: int) -> str:
    """Everything the closed pty's slave side wrote: one read returns one chunk (the line discipline may hand the
    output over a line at a time; CI once read only up to the first line end), so read until the end (EIO on Linux
    once the slave is closed and drained)."""
    chunks = []
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    return b"".join(chunks).decode()


def test_bar_on_a_terminal_moves_below_log_lines():
    master, slave = os.openpty()
    with os.fdopen(slave, "w") as terminal:
        lines = []
        console = Console(lines.append, terminal)
        assert console.bars  # a pty is a terminal
        console.progress("candidates", 1, 4, "rewards [1.0, 1.0]")
        console.line("step 1 candidate 0: ...")
        console.progress("candidates", 4, 4)
        console.progress("prefill", 1, 2)
        console.done()  # ended short of its total: cleared, not redrawn by later lines
        console.line("step 1 update")
    out = _read_all(master)
    assert lines == ["step 1 candidate 0: ...", "step 1 update"]  # log lines go to the log, bars to the terminal
    first = bar_text("candidates", 1, 4, "rewards [1.0, 1.0]")
    assert first == f"candidates |{'#' * (BAR_WIDTH // 4)}{'-' * (BAR_WIDTH * 3 // 4)}|  25% 1/4, rewards [1.0, 1.0]"
    # Drawn, erased for the log line and redrawn after it, drawn full with a line end (the pty turns \n into
    # \r\n); the next bar drawn and erased by done().
    erase = "\r\033[K"
    assert out == (f"{erase}{first}{erase}{erase}{first}{erase}{bar_text('candidates', 4, 4)}\r\n"
                   f"{erase}{bar_text('prefill', 1, 2)}{erase}")
