"""Launcher command lines that cannot run: one line naming the flag, in seconds, nothing written."""

import subprocess
import sys
import time

import pytest

from glm52_jax.run_config import save_spec
from tests.run_helpers import ROOT, config_spec


def _launch(*args, timeout=60):
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "glm52_jax.launch", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    return done, time.monotonic() - start


@pytest.mark.parametrize("flag,line", [
    ("--config.trian.steps=2", "error: unknown config key trian.steps (did you mean train.steps?)"),
    ("--config.train.stpes=2", "error: unknown config key train.stpes (did you mean train.steps?)"),
    ("--config.train.steps=abc", "error: flag --config.train.steps=abc: invalid literal for int() with base 10: "
                                 "'abc'"),
    ("--config=configs/nope.py", "error: --config=configs/nope.py: the config file cannot be loaded ([Errno 2] No "
                                 "such file or directory: 'configs/nope.py')"),
    ("--config.train.max_grad_norm=-1", "config error: --config.train.max_grad_norm=-1.0: must be > 0"),
    ("--config.train.max_grad_norm=0", "config error: --config.train.max_grad_norm=0.0: must be > 0"),
    ("--config.sampling.top_p=1.5", "config error: --config.sampling.top_p=1.5: must be > 0 and <= 1"),
    ("--config.sampling.temperature=0", "config error: --config.sampling.temperature=0.0: must be > 0"),
    ("--config.sampling.max_new_tokens=0", "config error: --config.sampling.max_new_tokens=0: must be >= 1"),
    ("--config.train.clip_ratio_low=1.5", "config error: --config.train.clip_ratio_low=1.5: must be > 0 and < 1"),
    ("--config.train.loss_agg_mode=mean", "config error: --config.train.loss_agg_mode=mean: must be one of "
                                          "token-mean, seq-mean-token-sum, seq-mean-token-mean, "
                                          "seq-mean-token-sum-norm"),
    ("--config.model.checkpoint=/nonexistent", "config error: --config.model.checkpoint=/nonexistent: no "
                                               "config.json in '/nonexistent' (expected an HF checkpoint directory)"),
    ("--config.model.init_adapter=/nonexistent", "config error: --config.model.init_adapter=/nonexistent: "
                                                 "/nonexistent/adapter_config.json: no such file (expected a PEFT "
                                                 "adapter directory, as --mode=export writes under peft/)"),
])
def test_bad_flags_fail_in_seconds_as_one_line(tmp_path, flag, line):
    done, seconds = _launch(flag, f"--workdir={tmp_path / 'w'}")
    assert done.returncode != 0 and done.stderr.strip().splitlines() == [line], done.stderr
    assert seconds < 30 and not (tmp_path / "w").exists()


def test_debug_shows_the_traceback(tmp_path):
    done, _ = _launch("--config.train.max_grad_norm=-1", "--debug", f"--workdir={tmp_path / 'w'}")
    assert done.returncode != 0 and "Traceback" in done.stderr and "must be > 0" in done.stderr


def test_rerun_with_changed_settings_lists_the_keys(tmp_path):
    """A workdir with saved settings (as a run leaves it): flags that change them are refused by name."""
    workdir = tmp_path / "run"
    save_spec(config_spec("tiny", **{"train.steps": 2}), workdir, ["python", "-m", "glm52_jax.launch"])
    before = sorted(p.name for p in workdir.iterdir())
    done, seconds = _launch(f"--workdir={workdir}", "--config.train.learning_rate=0.5", "--config.train.steps=3")
    assert done.returncode == 1 and seconds < 30, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"config error: {workdir} was run with other settings (train.learning_rate: saved 0.0001, now 0.5). Only "
        "train.steps, checkpoint.keep, plan.*, parity.*, export.* may change on a rerun; drop those flags to reuse the "
        "saved config, or use a fresh --workdir"]
    done, _ = _launch(f"--workdir={workdir}", "--config=configs/2m.py")  # another config file, given explicitly
    assert done.returncode == 1 and "model.checkpoint: saved embedded, now /ckpt/GLM-5.2" in done.stderr
    assert sorted(p.name for p in workdir.iterdir()) == before


def test_export_needs_a_workdir():
    done, _ = _launch("--mode=export")
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        "config error: --mode=export needs --workdir (the run to export)"]
