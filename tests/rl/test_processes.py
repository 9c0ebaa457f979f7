"""Train mode on two real processes x 4 CPU devices (gloo): `python -m glm52_jax.launch` run twice as
SPMD processes on one workdir, against the same transaction run in this process on 8 devices."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from glm52_jax.evidence import deterministic_view, verify
from glm52_jax.rl.run import run_online
from tests.run_helpers import ROOT, config_spec

MESH = "context=4,expert=2"
RANK_FILES = ["artifacts/traces/rank{}.jsonl", "artifacts/completion/rank{}.json"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_two(workdir: Path, flags: list[list[str]], timeout: float = 1200) -> list[tuple[int, str, str]]:
    """Runs the launcher as processes 0 and 1 of one group (`flags[p]`: process p's extra flags);
    returns each one's (exit status, stdout, stderr)."""
    port = _free_port()
    procs = []
    for rank, extra in enumerate(flags):
        env = dict(os.environ, GLM52_COORDINATOR=f"127.0.0.1:{port}", GLM52_NUM_PROCESSES="2",
                   GLM52_PROCESS_ID=str(rank), JAX_PLATFORMS="cpu",
                   XLA_FLAGS="--xla_force_host_platform_device_count=4")
        procs.append(subprocess.Popen([sys.executable, "-m", "glm52_jax.launch", f"--workdir={workdir}", *extra],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT))
    outs = [p.communicate(timeout=timeout) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def test_processes_with_different_settings_refuse_to_start(tmp_path):
    done = _launch_two(tmp_path / "w", [[], ["--config.seed=7"]], timeout=300)
    for code, _, err in done:
        lines = err.strip().splitlines()
        assert code == 1 and len(lines) == 1, err[-3000:]
        assert lines[0].startswith("config error: the processes were started with different settings: process 1 ")
    assert not (tmp_path / "w" / "config.json").exists()  # refused before the workdir was claimed


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Step 1 on the 8-device mesh in this process: its receipt."""
    workdir = tmp_path_factory.mktemp("one_process")
    summary = run_online(config_spec("tiny", **{"mesh": MESH, "train.steps": 1}), workdir, log=lambda msg: None)
    assert summary["status"] == "updated", summary
    return Path(summary["steps"][0]["receipt"])


@pytest.mark.slow
def test_two_launcher_processes_reproduce_the_one_process_receipt(one_process, tmp_path):
    workdir = tmp_path / "w"
    done = _launch_two(workdir, [[f"--config.mesh={MESH}", "--config.train.steps=1"]] * 2)
    for code, out, err in done:
        assert code == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1])["status"] == "updated"
    receipt = workdir / "evidence" / "step_000001" / "receipt.json"
    assert verify(receipt) == []
    a, b = json.loads(one_process.read_text()), json.loads(receipt.read_text())
    assert b["topology"] == {**a["topology"], "processes": 2} and a["topology"]["processes"] == 1
    rank_paths = [f.format(r) for r in range(2) for f in RANK_FILES]
    assert b["nondeterministic"] == ["traces", *rank_paths] and b["traces"]["ranks"] == 2
    assert set(rank_paths) <= {e["path"] for e in b["manifest"]}
    for rank in range(2):
        record = json.loads((receipt.parent / RANK_FILES[1].format(rank)).read_text())
        assert record["process"] == rank and record["processes"] == 2 and len(record["devices"]) == 4
        assert record["events"]["update_end"] == 1
        trace = [json.loads(line) for line in (receipt.parent / RANK_FILES[0].format(rank)).read_text().splitlines()]
        assert [e["event"] for e in trace][-1] == "step_done"
    # Same tokens, rewards and every other deterministic section; floats of the update within 1e-5.
    view_a, view_b = deterministic_view(a), deterministic_view(b)
    for view in (view_a, view_b):
        del view["topology"], view["nondeterministic"]
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(view_b["training"].pop(key), view_a["training"].pop(key), rtol=1e-5, err_msg=key)
    art_a, art_b = one_process.parent / "artifacts", receipt.parent / "artifacts"
    for name in ("old_logprobs.npy", "new_logprobs.npy"):
        np.testing.assert_allclose(np.load(art_b / name), np.load(art_a / name), rtol=1e-5, atol=1e-5, err_msg=name)
    assert view_b == view_a
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["1"]
