"""configs/rehearsal.py (the 2M run's structure at tiny size) as the real run executes it: 2 launcher
processes x 4 CPU devices (gloo) forming one 8-device mesh, for both meshes, against the same run in
this process on 8 devices. One run is killed mid-step 2 and resumed. While the in-process runs work,
every progress line walks `jax.live_arrays()` for arrays that live whole on every device.

The launcher processes share a persistent compilation cache (a directory of this module), so the
rerun after the kill compiles nothing anew."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from glm52_jax.evidence import deterministic_view, verify
from glm52_jax.parallel.placement import replicated_live_arrays
from glm52_jax.rl.run import run_online
from tests.run_helpers import ROOT, config_spec

REHEARSAL = str(ROOT / "configs" / "rehearsal.py")
RANK_FILES = ["artifacts/traces/rank{}.jsonl", "artifacts/completion/rank{}.json"]
KILL_BOUND_S = 30  # the bound: the survivor stops within 30 s of its peer's death
# Above the tiny policy's largest weight (weights are replicated on purpose at TP1), below its prompt cache.
REPLICATED_LIMIT = 256 * 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def jit_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("jit_cache")


def _start(workdir: Path, flags: list[str], logs: Path, cache: Path) -> list[subprocess.Popen]:
    """The launcher as processes 0 and 1 of one group; stdout/stderr of process p in logs/p.out, logs/p.err."""
    port = _free_port()
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(2):
        env = dict(os.environ, GLM52_COORDINATOR=f"127.0.0.1:{port}", GLM52_NUM_PROCESSES="2",
                   GLM52_PROCESS_ID=str(rank), JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache),
                   XLA_FLAGS="--xla_force_host_platform_device_count=4")
        with open(logs / f"{rank}.out", "w") as out, open(logs / f"{rank}.err", "w") as err:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "glm52_jax.launch", f"--config={REHEARSAL}", f"--workdir={workdir}", *flags],
                env=env, stdout=out, stderr=err, cwd=ROOT))
    return procs


def _finish(procs, logs: Path, timeout: float = 900) -> list[tuple[int, str, str]]:
    for p in procs:
        p.wait(timeout=timeout)
    return [(p.returncode, (logs / f"{r}.out").read_text(), (logs / f"{r}.err").read_text())
            for r, p in enumerate(procs)]


def _two_processes(workdir: Path, flags: list[str], logs: Path, cache: Path) -> list[dict]:
    done = _finish(_start(workdir, flags, logs, cache), logs)
    summaries = []
    for code, out, err in done:
        assert code == 0, err[-3000:]
        summaries.append(json.loads(out.strip().splitlines()[-1]))
    assert summaries[0] == summaries[1]
    return summaries


def _one_process(workdir: Path, **dotted) -> tuple[dict, list[str]]:
    """The rehearsal in this process on 8 devices, auditing replicated live arrays at every progress line."""
    replicated: list[str] = []

    def audit(msg: str) -> None:
        replicated.extend(a for a in replicated_live_arrays(REPLICATED_LIMIT) if a not in replicated)

    summary = run_online(config_spec("rehearsal", **dotted), workdir, log=audit)
    return summary, replicated


def _assert_same_receipt(one: Path, two: Path) -> None:
    """The 2-process receipt verifies and equals the 1-process one: tokens, rewards and every other
    deterministic section; the update's floats within 1e-5; each rank's trace and completion record listed."""
    assert verify(two) == []
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert b["topology"] == {**a["topology"], "processes": 2} and a["topology"]["processes"] == 1
    rank_paths = [f.format(r) for r in range(2) for f in RANK_FILES]
    assert b["nondeterministic"] == [*a["nondeterministic"], *rank_paths] and b["traces"]["ranks"] == 2
    assert set(rank_paths) <= {e["path"] for e in b["manifest"]}
    for rank in range(2):
        record = json.loads((two.parent / RANK_FILES[1].format(rank)).read_text())
        assert record["process"] == rank and record["processes"] == 2 and len(record["devices"]) == 4
        assert record["events"]["update_end"] == 1
        trace = [json.loads(line) for line in (two.parent / RANK_FILES[0].format(rank)).read_text().splitlines()]
        assert [e["event"] for e in trace][-1] == "step_done"
    view_a, view_b = deterministic_view(a), deterministic_view(b)
    for view in (view_a, view_b):
        del view["topology"], view["nondeterministic"]
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(view_b["training"].pop(key), view_a["training"].pop(key), rtol=1e-5,
                                   atol=1e-7, err_msg=key)
    for name in ("old_logprobs.npy", "new_logprobs.npy"):
        np.testing.assert_allclose(np.load(two.parent / "artifacts" / name), np.load(one.parent / "artifacts" / name),
                                   rtol=1e-5, atol=1e-5, err_msg=name)
    assert view_b == view_a


def _receipt(workdir: Path, step: int) -> Path:
    return workdir / "evidence" / f"step_{step:06d}" / "receipt.json"


def test_the_rehearsal_has_the_2m_runs_shape():
    spec, two_m = config_spec("rehearsal"), config_spec("2m")
    for name in ("sampling.prefill_mode", "train.gradient_mode", "sampling.samples_per_request",
                 "sampling.num_samples", "sampling.max_new_tokens"):
        section, key = name.split(".")
        assert getattr(getattr(spec, section), key) == getattr(getattr(two_m, section), key), name
    assert spec.mesh == "folded=8" and spec.model.rope_scaling_json.endswith("rehearsal_yarn.json")
    limit = json.loads(Path(spec.model.rope_scaling_json).read_text())["max_position_embeddings"]
    assert spec.data.prompt_tokens + spec.sampling.max_new_tokens == limit  # at the position limit
    assert limit % 8 and limit % 4  # the capacity divides neither mesh's slot shards
    assert 0 < spec.search.probe_tokens < spec.data.prompt_tokens
    largest = 0
    with safe_open(str(ROOT / "glm52_jax" / "assets" / "tiny_policy" / "model.safetensors"), "np") as f:
        for name in f.keys():
            largest = max(largest, f.get_slice(name).get_shape() and np.prod(f.get_slice(name).get_shape()) * 4)
    assert largest < REPLICATED_LIMIT  # the audit's limit sits above every (float32) weight


def test_folded_two_processes_reproduce_one_process(tmp_path, jit_cache):
    one, replicated = _one_process(tmp_path / "one", **{"mesh": "folded=8", "train.steps": 1})
    assert one["status"] == "updated", one
    assert not replicated, replicated
    two = _two_processes(tmp_path / "two", [], tmp_path / "logs", jit_cache)
    assert two[0]["status"] == "updated"
    _assert_same_receipt(_receipt(tmp_path / "one", 1), _receipt(tmp_path / "two", 1))
    err = (tmp_path / "logs" / "1.err").read_text()
    assert "[1/2] step 1 update (response_only): updated" in err  # progress lines carry the rank


def test_killed_process_stops_the_other_and_the_rerun_reproduces_the_steps(tmp_path, jit_cache):
    """context 4 x expert 2, two steps: process 1 is killed during step 2; process 0 stops within 30 s
    naming it, step 2 leaves no receipt and no checkpoint; the rerun resumes at step 2, and both steps'
    receipts equal the 1-process run's."""
    mesh = "context=4,expert=2"
    one, replicated = _one_process(tmp_path / "one", **{"mesh": mesh, "train.steps": 2})
    assert one["status"] == "updated" and one["steps_run"] == 2, one
    assert not replicated, replicated

    workdir, flags = tmp_path / "two", [f"--config.mesh={mesh}", "--config.train.steps=2"]
    logs = tmp_path / "logs_killed"
    procs = _start(workdir, flags, logs, jit_cache)
    marker, deadline = "[1/2] step 2 probe", time.time() + 900
    while marker not in (logs / "1.err").read_text():
        assert time.time() < deadline and procs[1].poll() is None, (logs / "1.err").read_text()[-3000:]
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGKILL)
    killed_at = time.time()
    procs[0].wait(timeout=KILL_BOUND_S + 60)
    stopped_after = time.time() - killed_at
    err0 = (logs / "0.err").read_text().strip().splitlines()
    print(f"process 0 stopped {stopped_after:.1f} s after process 1 was killed: {err0[-1]}")
    assert procs[0].returncode == 1 and stopped_after <= KILL_BOUND_S, err0[-5:]
    assert err0[-1].startswith("process error: process 1 stopped responding (no heartbeat for "), err0[-5:]
    assert f"{workdir} keeps committed steps up to 1" in err0[-1]
    assert _receipt(workdir, 1).is_file() and not _receipt(workdir, 2).exists()
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["1"]

    rerun = _two_processes(workdir, flags, tmp_path / "logs_rerun", jit_cache)
    assert rerun[0]["status"] == "updated" and rerun[0]["steps_run"] == 1 and rerun[0]["last_step"] == 2
    for step in (1, 2):
        _assert_same_receipt(_receipt(tmp_path / "one", step), _receipt(workdir, step))
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["1", "2"]
