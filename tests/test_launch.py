"""Launcher command lines that cannot run: one line naming the flag, in seconds, nothing written."""

import json
import os
import subprocess
import sys
import time

import pytest

from glm52_jax.launch import start_banner, unfit_message
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
                                                 "/nonexistent: no such file or directory (expected a PEFT adapter "
                                                 "directory, as --mode=export writes under peft/, or a Megatron LoRA "
                                                 "state dict file)"),
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
    (workdir / "checkpoints" / "1").mkdir(parents=True)  # a committed step binds the settings
    before = sorted(p.name for p in workdir.iterdir())
    done, seconds = _launch(f"--workdir={workdir}", "--config.train.learning_rate=0.5", "--config.train.steps=3")
    assert done.returncode == 1 and seconds < 30, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"config error: {workdir} was run with other settings (train.learning_rate: saved 0.0001, now 0.5). Only "
        "train.steps, checkpoint.keep, plan.*, parity.*, export.*, watchdog.*, mesh may change on a rerun; drop those "
        "flags to reuse the saved config, or use a fresh --workdir"]
    done, _ = _launch(f"--workdir={workdir}", "--config=configs/2m.py")  # another config file, given explicitly
    assert done.returncode == 1 and "model.checkpoint: saved embedded, now /ckpt/GLM-5.2" in done.stderr
    assert sorted(p.name for p in workdir.iterdir()) == before


def test_export_needs_a_workdir():
    done, _ = _launch("--mode=export")
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        "config error: --mode=export needs --workdir (the run to export)"]


@pytest.mark.parametrize("allow", [False, True])
def test_plan_that_does_not_fit_exits_1_unless_allowed(tmp_path, allow):
    """`--mode=plan` judged against a device smaller than the program: the JSON summary, then one line naming the
    largest program and the flag (exit 1); `--allow_unfit` exits 0 with the same summary."""
    done, _ = _launch("--mode=plan", f"--workdir={tmp_path}", "--config.plan.programs=('prefill',)",
                      "--config.plan.hbm_gib=1e-6", "--config.data.prompt_tokens=96", "--config.sampling.chunk_size=32",
                      "--config.sampling.max_new_tokens=8", *(["--allow_unfit"] if allow else []), timeout=300)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["fits"] is False and summary["largest_program"] == "prefill", done.stdout
    assert json.loads((tmp_path / "plan.json").read_text())["fits"] is False
    last = done.stderr.strip().splitlines()[-1]
    if allow:
        assert done.returncode == 0 and "plan error" not in done.stderr, done.stderr[-2000:]
    else:
        assert done.returncode == 1 and last == unfit_message(summary), done.stderr[-2000:]
        assert last.startswith("plan error: the largest program, prefill, needs ") and last.endswith(
            " MB per device of the 1.1 KB it may use on cpu (DP1/TP1/CP1/EP1/PP1); change the mesh or settings, or "
            "pass --allow_unfit to accept the plan")


def test_unfit_message_sizes():
    assert unfit_message({"fits": True}) is None
    assert unfit_message({"fits": False, "largest_program": "train", "largest_total_bytes": 101.5e9,
                          "hbm_bytes": 0.9 * 96 * 2**30, "target": "h20", "mesh": "DP1/TP1/CP32/EP32/PP1"}) == (
        "plan error: the largest program, train, needs 101.5 GB per device of the 92.8 GB it may use on h20 "
        "(DP1/TP1/CP32/EP32/PP1); change the mesh or settings, or pass --allow_unfit to accept the plan")


def test_helpconfig_lists_every_key_with_its_value_and_meaning():
    """Every key of run_defaults.get_config() with its value and its comment from run_defaults.py, and, for a
    config that overrides it, the default beside the config's value; exit 0 without starting anything."""
    from glm52_jax import config_help, run_defaults
    from glm52_jax.run_config import flatten

    defaults = flatten(run_defaults.get_config().to_dict())
    comments = config_help.key_comments()
    done, seconds = _launch("--helpconfig")
    assert done.returncode == 0 and seconds < 30, done.stderr
    lines = done.stdout.splitlines()
    for key, value in defaults.items():
        at = lines.index(f"{key} = {value!r}") + 1
        end = next(i for i in range(at, len(lines) + 1) if i == len(lines) or not lines[i].startswith("    "))
        assert " ".join(line.strip() for line in lines[at:end]) == comments[key], key
    done, _ = _launch("--helpconfig", "--config=configs/2m.py", "--config.checkpoint.keep=5")
    assert done.returncode == 0, done.stderr
    assert "checkpoint.keep = 5  (default 3)" in done.stdout.splitlines()
    assert "model.dtype = 'bfloat16'  (default 'float32')" in done.stdout.splitlines()


def test_forward_mode_says_what_it_compiles():
    """Compile lines outside train mode too (issue 21): forward mode's one program, named by its function."""
    done = subprocess.run([sys.executable, "-m", "glm52_jax.launch", "--mode=forward", "--seq_len=64"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "GLM52_COMPILE_LINES_AFTER_S": "0"})
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert "compiling jit(_token_logprobs)..." in lines
    assert any(line.startswith("compiled jit(_token_logprobs) in ") for line in lines)
    assert json.loads(done.stdout.strip().splitlines()[-1])["seq_len"] == 64


@pytest.mark.parametrize("text,cause", [
    ("def get_config():\n    return foo\n", "the config file cannot be loaded (NameError: name 'foo' is not defined, "
                                           "line 2)"),
    ("x = 1\n", "the config file defines no get_config() (it must return the run's ConfigDict)"),
    ("def get_config(:\n", "the config file cannot be loaded (SyntaxError: invalid syntax, line 1)"),
    ("def get_config():\n    return None\n", "get_config() returned NoneType, not a ConfigDict"),
])
def test_a_broken_config_file_is_named(tmp_path, text, cause):
    """A config file that fails inside: one line naming the file (not absl's internal module name)."""
    path = tmp_path / "my_config.py"
    path.write_text(text)
    done, _ = _launch(f"--config={path}", f"--workdir={tmp_path / 'w'}")
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == f"error: --config={path}: {cause}"
    assert not (tmp_path / "w").exists()


def test_export_and_parity_start_with_a_banner():
    spec = config_spec("tiny")
    mesh = spec.mesh_spec().describe()
    assert start_banner(spec, "/r", "export", step=None) == (
        f"export of run 'online_grpo_tiny' in /r: checkpoint step (latest) -> /r/export/step_<k>; model "
        f"{spec.model.base_name} ({spec.model.dtype}), mesh {mesh}")
    assert start_banner(spec, "/r", "export", step=2, export_dir="/out").startswith(
        "export of run 'online_grpo_tiny' in /r: checkpoint step 2 -> /out; ")
    assert start_banner(spec, "/r", "parity").startswith(
        "parity of 'online_grpo_tiny' in /r: gradient modes compared on one rollout; model ")
