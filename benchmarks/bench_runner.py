"""The parent side of `python -m benchmarks.run`: each task in a fresh interpreter, its RSS polled and capped,
its wall time limited; and the growth-exponent fit of section d."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

from benchmarks.bench_tasks import RESULT_TAG, _status_kib


class Runner:
    def __init__(self, mem_cap_gib: float, max_row_seconds: float, workdir: str, log=print, xla_flags: str = "",
                 jobs: int = 1, compile_cache: str | None = None):
        import threading

        self.xla_flags = xla_flags
        self.slots = threading.Semaphore(jobs)  # children running at once
        self.compile_cache = compile_cache
        self.cap_kib = mem_cap_gib * 2**20
        self.max_row_seconds = max_row_seconds
        self.workdir = workdir
        self.log = log
        self.count = 0
        self.lock = __import__("threading").Lock()

    def __call__(self, task: dict) -> dict:
        """Runs one task in a fresh interpreter; returns its result plus status, wall time, peak RSS."""
        with self.slots:
            return self._run(task)

    def _run(self, task: dict) -> dict:
        with self.lock:
            self.count += 1
            n = self.count
        out_path = os.path.join(self.workdir, f"row{n:03d}.out")
        err_path = os.path.join(self.workdir, f"row{n:03d}.err")
        cmd = [sys.executable, "-m", "benchmarks.run", "--worker", json.dumps(task)]
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        if self.compile_cache and "JAX_COMPILATION_CACHE_DIR" not in env:
            env["JAX_COMPILATION_CACHE_DIR"] = self.compile_cache
        # A task that checks numerics against HF (`user_numerics`) compiles as users do.
        added_flags = "" if task.get("user_numerics") else self.xla_flags
        if added_flags:
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + added_flags).strip()
        env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        start = time.perf_counter()
        polled = 0
        status = None
        with open(out_path, "w") as out, open(err_path, "w") as err:
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=repo, env=env, start_new_session=True)
            while proc.poll() is None:
                rss = _status_kib("VmRSS", proc.pid) or 0
                hwm = _status_kib("VmHWM", proc.pid) or 0
                polled = max(polled, rss, hwm)
                if rss > self.cap_kib:
                    status = "over cap"
                elif time.perf_counter() - start > self.max_row_seconds:
                    status = "over time"
                if status:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    break
                time.sleep(0.05)
        wall = time.perf_counter() - start
        row = {"task": {k: v for k, v in task.items() if k not in ("ckpt", "save_logits", "compare_logits")},
               "wall_seconds": wall, "polled_peak_rss_mib": polled / 1024, "added_xla_flags": added_flags}
        if status is None:
            text = open(out_path).read()
            lines = [ln for ln in text.splitlines() if ln.startswith(RESULT_TAG)]
            if proc.returncode == 0 and lines:
                status = "ok"
                row.update(json.loads(lines[-1][len(RESULT_TAG):]))
            else:
                status = "error"
                row["stderr_tail"] = open(err_path).read()[-2000:]
        row["status"] = status
        peaks = [row["polled_peak_rss_mib"], row.get("setup_peak_rss_mib", 0), row.get("run_peak_rss_mib", 0)]
        row["peak_rss_mib"] = max(peaks)
        brief = {k: row.get(k) for k in ("seconds", "step_seconds", "compile_seconds", "xla_temp_mib") if k in row}
        self.log(f"[{task['kind']} {json.dumps(row['task'])}] {status} wall {wall:.1f}s "
                 f"peak {row['peak_rss_mib']:.0f} MiB "
                 f"{json.dumps({k: round(v, 3) for k, v in brief.items()})}")
        if status == "error":
            self.log(row["stderr_tail"][-1500:])
        return row


def fit_exponent(lengths, values) -> float | None:
    """Least-squares slope of log(value) against log(length) over the positive values."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(lengths, values) if x and y and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx else None
