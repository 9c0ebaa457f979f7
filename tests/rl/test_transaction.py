"""The online GRPO transaction end to end: real model, sampler, reward, update, receipt, verify.

The CLI half runs the README's quick-start commands as written (paths moved to a temp dir): the
first is killed during step 2's update (after a second process was refused its lock), the second
resumes from the saved settings, then verify and export.
"""

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from glm52_jax.dapo_data import default_problems_path
from glm52_jax.evidence import deterministic_view, verify
from glm52_jax.evidence.hashing import sha256_file
from glm52_jax.evidence.publish import result_differences
from glm52_jax.rl.inputs import resolve
from glm52_jax.rl.progress import Console
from glm52_jax.rl.run import decode_progress, end_summary, prefill_progress, run_online
from glm52_jax.rollout.tokenizer import ChatTemplate, default_tokenizer_path
from glm52_jax.run_config import EMBEDDED_POLICY, ConfigError
from tests.run_helpers import ROOT, config_spec, readme_commands


def _spec(**overrides):
    return config_spec("tiny", **overrides)


def _fresh_policy(spec):
    """The embedded policy as a fresh run samples step 1 with: built, then its adapters, optimizer state and key
    placed as `run_online` places them (`place_as_restored`), so the sampler's programs are the run's (the `inproc`
    fixture's, found in the persistent compilation cache) instead of programs lowered for uncommitted arrays."""
    import jax

    from glm52_jax.checkpoint.train_state import place_as_restored
    from glm52_jax.rl.policy import build_policy

    inputs = resolve(spec)
    model, optimizer = build_policy(spec, inputs)
    place_as_restored(model, optimizer, jax.random.key(spec.seed))
    return inputs, model


def _argv(command: list[str], workdir: Path) -> list[str]:
    """A README command with /tmp/run moved to `workdir`, run by this interpreter."""
    args = [a.replace("/tmp/run", str(workdir)) for a in command]
    return [sys.executable, *args[1:]]


def _wait_for(proc, metrics: Path, event: dict, timeout: float = 900):
    """Returns as soon as `metrics` (JSONL) holds a record containing `event`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) before {event}: {proc.stderr.read()[-3000:]}")
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                record = json.loads(line)
                if all(record.get(k) == v for k, v in event.items()):
                    return
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no {event} within {timeout} s")


@pytest.fixture(scope="module")
def inproc(tmp_path_factory):
    """Two transactions of the embedded policy in this process without interruption: (workdir, summary)."""
    first = tmp_path_factory.mktemp("run_inproc")
    return first, run_online(_spec(**{"train.steps": 2}), first, log=lambda msg: None)


@pytest.fixture(scope="module")
def runs(inproc, tmp_path_factory):
    """`inproc`, and the README's quick-start commands: run (killed during step 2's update), resume to
    step 3, verify, export."""
    commands = readme_commands("## Quick start")
    assert [c[:3] for c in commands] == [["python", "-m", "glm52_jax.launch"]] * 2 + \
        [["python", "-m", "glm52_jax.evidence"], ["python", "-m", "glm52_jax.launch"]], commands
    second = tmp_path_factory.mktemp("run_cli") / "run"
    proc = subprocess.Popen(_argv(commands[0], second), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    _wait_for(proc, second / "metrics.jsonl", {"event": "loaded"})
    start = time.monotonic()
    refused = subprocess.run(_argv(commands[0], second), capture_output=True, text=True, timeout=300, cwd=ROOT)
    refused_seconds = time.monotonic() - start
    _wait_for(proc, second / "metrics.jsonl", {"event": "update_start", "step": 2})
    proc.kill()
    proc.wait()
    killed = {"checkpoints": sorted(p.name for p in (second / "checkpoints").iterdir()),
              "evidence": sorted(p.name for p in (second / "evidence").iterdir()),
              "step2_receipt": (second / "evidence" / "step_000002" / "receipt.json").exists(),
              "lock_left": (second / ".lock").exists(), "pid": proc.pid}
    out = {}
    for name, command in zip(("resume", "verify", "export"), commands[1:]):
        done = subprocess.run(_argv(command, second), capture_output=True, text=True, timeout=900, cwd=ROOT)
        assert done.returncode == 0, (name, done.stderr[-3000:])
        out[name] = done
    return {"inproc": inproc, "cli": second, "killed": killed, "refused": refused,
            "refused_seconds": refused_seconds, **out}


def _receipt(workdir, step):
    return workdir / "evidence" / f"step_{step:06d}" / "receipt.json"


def test_transactions_update_and_receipts_verify(runs):
    workdir, summary = runs["inproc"]
    assert summary["status"] == "updated" and summary["steps_run"] == 2 and summary["last_step"] == 2, summary
    lora_hashes = []
    for step in (1, 2):
        receipt_path = _receipt(workdir, step)
        assert verify(receipt_path) == []
        receipt = json.loads(receipt_path.read_text())
        assert receipt["transaction"]["step"] == step
        assert receipt["prompt"]["chat_template"] == ChatTemplate().describe()  # the embedded policy ships none
        # The rows it scored, bound to the shipped data file's bytes (what `verify --data` re-reads).
        shipped = [json.loads(line) for line in default_problems_path().read_text().splitlines()]
        cursor, tried = receipt["transaction"]["data_cursor"], receipt["candidate_search"]["tried"]
        assert receipt["prompt"]["data"] == {
            "path": "glm52_jax/assets/math_problems.jsonl", "embedded": True, "dedupe": False,
            "sha256": sha256_file(default_problems_path()),
            "rows": [{"candidate": i, "row": cursor + i, "extra_info_index": shipped[cursor + i]["extra_info"]["index"]}
                     for i in range(tried)]}
        assert receipt["prompt"]["tokenizer"] == {"path": str(default_tokenizer_path()),
                                                  "sha256": sha256_file(default_tokenizer_path())}
        training = receipt["training"]
        assert training["optimizer_steps"] == 1 and training["optimizer_steps_total"] == step
        assert training["lora_sha256_before"] != training["lora_sha256_after"]  # the step changed the adapters
        assert training["lora_digest_before"] != training["lora_digest_after"]  # verify recomputed both from the files
        lora_hashes.append((training["lora_digest_before"], training["lora_digest_after"]))
        accepted = receipt["candidate_search"]["accepted"]
        assert len(set(receipt["rewards"][accepted])) > 1  # a mixed-reward group, as the search requires
        assert all(len(set(r)) == 1 for r in receipt["rewards"][:accepted])  # earlier ones were all-equal
        assert np.isfinite(training["loss"]) and receipt["numerics"]["finite"]
        assert len(training["grads_digest"]) == 64 and "grads_sha256" not in training
        # Sampling left every parameter byte as it was.
        art = receipt_path.parent / "artifacts"
        assert json.loads((art / "inventory_before_sampling.json").read_text()) == \
            json.loads((art / "inventory_after_sampling.json").read_text())
        old = np.load(art / "old_logprobs.npy")
        new = np.load(art / "new_logprobs.npy")
        mask = np.load(art / "response_mask.npy")
        assert old.shape == new.shape == mask.shape and mask.sum() > 0
        assert np.all(new[mask == 0] == 0) and np.any(np.abs(new - old)[mask > 0] > 1e-6)  # the policy moved
    assert lora_hashes[1][0] == lora_hashes[0][1]  # step 2 starts from step 1's adapters
    # Step 2 reads on in the data: its first row follows the rows step 1 tried.
    r1, r2 = (json.loads(_receipt(workdir, s).read_text()) for s in (1, 2))
    assert r2["transaction"]["data_cursor"] == r1["transaction"]["data_cursor"] + r1["candidate_search"]["tried"]
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["1", "2"]


def test_kill_during_update_leaves_last_checkpoint_and_no_receipt(runs):
    killed = runs["killed"]
    assert killed["checkpoints"] == ["1"], killed  # step 2 never committed
    assert not killed["step2_receipt"]
    assert killed["lock_left"]  # SIGKILL leaves the lock; the resume takes it over (its pid is gone)


def test_a_second_process_on_a_locked_workdir_is_refused(runs):
    refused = runs["refused"]
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 1 and len(lines) == 1, refused.stderr
    assert lines[0].startswith("config error: ") and f"in use by pid {runs['killed']['pid']}" in lines[0], lines
    assert runs["refused_seconds"] < 30  # refused before any model work


def test_resumed_run_continues_identically(runs):
    """Step 1 from the killed process and step 2 from the resumed one equal an uninterrupted run:
    tokens, rewards, loss, gradient and LoRA hashes (the deterministic view). The resume command
    names no config: the saved settings are used, with the step count it raises."""
    a, b = runs["inproc"][0], runs["cli"]
    summary = json.loads(runs["resume"].stdout.strip().splitlines()[-1])
    assert summary["steps_run"] == 2 and summary["last_step"] == 3, summary
    assert "resumed from checkpoint step 1" in runs["resume"].stderr
    for step in (1, 2):
        assert verify(_receipt(b, step)) == []
        va, vb = deterministic_view(_receipt(a, step)), deterministic_view(_receipt(b, step))
        if step == 2:  # the resumed process ran step 2 under train.steps=3: the same run, a longer plan
            assert (va["config"].pop("sha256"), vb["config"].pop("sha256")) == (
                _spec(**{"train.steps": 2}).config_sha256(), _spec(**{"train.steps": 3}).config_sha256())
        assert va == vb, step
    # The killed step's partial evidence was set aside, not deleted or overwritten.
    aside = b / "evidence" / "step_000002.uncommitted-1"
    assert aside.is_dir() and not (aside / "receipt.json").exists()
    saved = json.loads((b / "config.json").read_text())
    assert saved["config"]["train"]["steps"] == 3 and "--config.train.steps=3" in saved["command"]
    assert not (b / ".lock").exists()


def test_any_changed_byte_fails_verify_naming_the_artifact(runs, tmp_path):
    src = _receipt(runs["inproc"][0], 1).parent
    receipt = json.loads((src / "receipt.json").read_text())
    for entry in receipt["manifest"]:
        run = tmp_path / entry["path"].replace("/", "_")
        shutil.copytree(src, run)
        target = run / entry["path"]
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
        failures = verify(run / "receipt.json")
        assert failures and any(entry["path"] in f for f in failures), (entry["path"], failures)


def test_finished_run_is_left_as_it_is(runs):
    workdir, _ = runs["inproc"]
    before = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()}
    summary = run_online(_spec(**{"train.steps": 2}), workdir, log=lambda msg: None)
    assert summary["status"] == "complete" and summary["steps_run"] == 0
    assert {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()} == before


def test_rerun_with_other_settings_lists_them(runs, tmp_path):
    """A rerun may raise train.steps; any other change is refused, naming each key with its saved and
    new value, before anything is written. Without the saved settings (config.json removed), the
    checkpoint's config hash still refuses it."""
    from glm52_jax.checkpoint.train_state import CheckpointMismatchError

    workdir, _ = runs["inproc"]
    with pytest.raises(ConfigError, match=r"train\.learning_rate: saved 0\.0001, now 0\.5; "
                                          r"train\.max_grad_norm: saved 1\.0, now 2\.0\)\. Only train\.steps"):
        run_online(_spec(**{"train.steps": 3, "train.learning_rate": 0.5, "train.max_grad_norm": 2.0}), workdir,
                   log=lambda msg: None)
    assert not _receipt(workdir, 3).parent.exists() and not (workdir / ".lock").exists()
    copy = tmp_path / "w"
    shutil.copytree(workdir, copy)
    (copy / "config.json").unlink()
    with pytest.raises(CheckpointMismatchError, match="another run"):
        run_online(_spec(**{"train.steps": 3, "train.learning_rate": 0.5}), copy, log=lambda msg: None)


def test_corrupt_latest_checkpoint_is_one_line_naming_the_fallback(runs, tmp_path):
    copy = tmp_path / "w"
    shutil.copytree(runs["inproc"][0], copy)
    for f in (copy / "checkpoints" / "2" / "lora").rglob("*"):
        if f.is_file() and f.stat().st_size > 0:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    done = subprocess.run([sys.executable, "-m", "glm52_jax.launch", f"--workdir={copy}", "--config.train.steps=3"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    lines = [line for line in done.stderr.strip().splitlines() if not line.startswith(("W", "I"))]
    assert done.returncode == 1 and lines[-1].startswith("checkpoint error: checkpoint step 2 in "), done.stderr
    assert "to resume from step 1" in lines[-1] and "Traceback" not in done.stderr, done.stderr
    assert not _receipt(copy, 3).parent.exists()


@pytest.mark.parametrize("key,value,match", [
    ("model.checkpoint", "/nonexistent/ckpt", "no config.json"),
    ("data.prompt_tokens", 65536, "position capacity"),
    ("data.prompt_tokens", 20, "prompt_tokens"),
    ("search.probe_tokens", 20, "search.probe_tokens=20: row 0: n_tokens=20 is too small"),
])
def test_files_that_cannot_run_fail_before_any_model_work(key, value, match):
    with pytest.raises(ConfigError, match=match):
        resolve(_spec(**{key: value}))


def test_embedded_policy_ships_with_the_package():
    assert (EMBEDDED_POLICY / "config.json").is_file() and (EMBEDDED_POLICY / "model.safetensors").is_file()


STEP_FIELDS = {"loss", "reward_mean", "reward_std", "grad_norm", "clipfrac_low", "clipfrac_high", "clipfrac_dual",
               "approx_kl", "kl_after_update", "sampled_entropy", "accepted_candidate", "candidates_tried",
               "prefill_seconds", "decode_seconds", "reward_seconds", "update_seconds", "checkpoint_seconds",
               "step_seconds", "prefill_tokens_per_s", "decode_tokens_per_s"}


def test_metrics_and_tensorboard_follow_the_run_across_the_resume(runs):
    """The CLI run (killed in step 2, resumed to step 3): one `step` record per committed step whose numbers
    are the receipts', a wall clock that goes on across the resume, and the same scalars in TensorBoard's
    event files, read back by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from glm52_jax.rl.tensorboard import TAGS

    workdir = runs["cli"]
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    elapsed = [r["elapsed"] for r in records]
    assert elapsed == sorted(elapsed) and elapsed[-1] > 0  # never restarts...
    resumed = next(i for i, r in enumerate(records) if r["event"] == "resumed")
    # ...while the per-process clock `t` does: the resumed process started it after the killed one's last record.
    assert records[resumed]["elapsed"] - records[resumed]["t"] >= records[resumed - 1]["elapsed"] - 0.002
    steps = {r["step"]: r for r in records if r["event"] == "step"}
    assert sorted(steps) == [1, 2, 3]
    for k, record in steps.items():
        assert STEP_FIELDS <= set(record), STEP_FIELDS - set(record)
        receipt = json.loads(_receipt(workdir, k).read_text())
        training, search = receipt["training"], receipt["candidate_search"]
        rewards = [x for r in receipt["rewards"] for x in r]
        assert (record["loss"], record["grad_norm"]) == (training["loss"], training["grad_norm"])
        assert (record["accepted_candidate"], record["candidates_tried"]) == (search["accepted"], search["tried"])
        assert record["reward_mean"] == pytest.approx(np.mean(rewards)) and record["reward_std"] == pytest.approx(
            np.std(rewards))
        assert record["clipfrac_low"] + record["clipfrac_high"] == pytest.approx(training["metrics"]["clipfrac"],
                                                                                 abs=1e-6)
        assert record["approx_kl"] == training["metrics"]["approx_kl"] and record["kl_after_update"] > 0
        assert min(record[f"{p}_seconds"] for p in ("prefill", "decode", "update", "checkpoint")) > 0
        assert record["decode_tokens_per_s"] > 0 and record["step_seconds"] > record["update_seconds"]
    accumulator = EventAccumulator(str(workdir / "tensorboard"))
    accumulator.Reload()
    computed = {field: tag for field, tag in TAGS.items() if field in steps[1]}  # the tiny config runs no probe
    assert set(accumulator.Tags()["scalars"]) == set(computed.values()) and "probe_seconds" not in computed
    for field, tag in computed.items():
        points = accumulator.Scalars(tag)
        assert [p.step for p in points] == [1, 2, 3], tag
        np.testing.assert_allclose([p.value for p in points], [steps[k][field] for k in (1, 2, 3)], rtol=1e-6)
        assert [p.wall_time for p in points] == pytest.approx([steps[k]["time"] for k in (1, 2, 3)])


def test_console_names_the_run_and_ends_with_how_to_verify_it(runs):
    """The resumed CLI run's stderr: the start banner, the end summary with the last receipt and its verify
    command, and no Orbax "Skipping merge of OCDBT checkpoints" warning at the checkpoint saves."""
    err, workdir = runs["resume"].stderr, runs["cli"]
    lines = err.splitlines()
    banner = next(line for line in lines if line.startswith("run "))
    assert banner.startswith(f"run 'online_grpo_tiny' in {workdir}: ") and "mesh DP1/TP1/CP1/EP1/PP1" in banner
    receipt = _receipt(workdir, 3)
    accepted = json.loads(receipt.read_text())["candidate_search"]["accepted"]
    done = next(i for i, line in enumerate(lines) if line.startswith("done: "))
    assert lines[done].startswith(f"done: step 3 updated; accepted candidate {accepted} of "), lines[done:]
    group = json.loads(receipt.read_text())["rewards"][accepted]  # the update's group, not every candidate tried
    assert f", reward mean {np.mean(group):.3g} (accepted group; " in lines[done], lines[done]
    assert lines[done + 1:done + 3] == [f"receipt: {receipt}", f"verify: python -m glm52_jax.evidence verify {receipt}"]
    assert "Skipping merge of OCDBT" not in err


def test_cli_receipt_verifies_with_the_evidence_cli(runs):
    """The README's `verify WORKDIR`: every committed step's receipt, the killed step's set-aside evidence named."""
    lines = runs["verify"].stdout.splitlines()
    # The resumed run's closure (its own receipt: one line), then per step receipt: its hashes, then its sampled texts
    # against their tokens (the shipped tokenizer, found by sha256).
    assert lines[0].startswith("evidence/closure_step_000003.json: OK 1 artifacts, manifest "), lines
    lines = lines[1:]
    assert [line.partition(": ")[0] for line in lines[:6]] == [f"evidence/step_{k:06d}/receipt.json"
                                                               for k in (1, 2, 3) for _ in range(2)], lines
    assert all(line.partition(": ")[2].startswith("OK ") for line in lines[:6]), lines
    assert lines[1].endswith(f": OK sampled texts equal their tokens detokenised with {default_tokenizer_path()}")
    assert lines[6:] == ["evidence/step_000002.uncommitted-1: not verified (not a committed step)",
                         "OK: 4 of 4 receipts verified"], lines


def test_a_finished_run_records_its_closure(runs):
    """The resumed CLI run (steps 2 and 3, one process) ends with its closure receipt: the phases it completed, the
    collectives it issued (none on one device), its traces' events, what it stopped and its live bytes after the
    release; the killed run, which did not finish, left none."""
    workdir = runs["cli"]
    assert sorted(p.name for p in (workdir / "evidence").glob("closure_*.json")) == ["closure_step_000003.json"]
    path = workdir / "evidence" / "closure_step_000003.json"
    assert f"closure: {path} " in runs["resume"].stderr and verify(path) == []
    section = json.loads(path.read_text())["closure"]
    assert [s["step"] for s in section["steps"]] == [2, 3] and section["processes"] == 1
    (record,) = section["records"]
    completed = record["phases"]["completed"]
    assert record["phases"]["entered"] == completed and record["phases"]["unfinished"] == []
    assert {k: completed[k] for k in ("load", "checkpoint restore", "checkpoint save", "update")} == \
        {"load": 1, "checkpoint restore": 1, "checkpoint save": 2, "update": 2}, completed
    assert completed["prefill"] >= 2 and completed["decode"] >= 2
    assert record["collectives"]["available"] and record["collectives"]["executions"] == 0  # one device
    traces = record["trace_events"]["traces"]
    assert [t["path"] for t in traces] == [f"step_{k:06d}/artifacts/traces/rank0.jsonl" for k in (2, 3)]
    for trace in traces:
        lines = (workdir / "evidence" / trace["path"]).read_text().splitlines()
        assert trace["events"] == len(lines) and trace["sha256"] == sha256_file(workdir / "evidence" / trace["path"])
    assert record["trace_events"]["by_kind"]["step_done"] == 2
    assert record["stopped"] == {"peer_watch": "none (one process)", "coordinator": "none (one process)",
                                 "compile_cache": {"directory": os.environ["JAX_COMPILATION_CACHE_DIR"],
                                                   "closed": True}}
    assert record["after_release"]["live_array_bytes"] == 0 and record["coordinator_port"] is None
    assert not (workdir / "closure").exists()  # the staging directory, once committed


def test_export_from_the_saved_settings(runs):
    """The README's export (no flags but the workdir): PEFT adapter and merged model from checkpoint 3;
    the merged HF checkpoint reproduces the LoRA policy's log-probs."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from safetensors.numpy import load_file

    from glm52_jax.checkpoint.hf import load_pretrained
    from glm52_jax.checkpoint.train_state import RunCheckpoints
    from glm52_jax.model.transformer import token_logprobs
    from glm52_jax.rl.policy import build_policy

    workdir = runs["cli"]
    record = json.loads(runs["export"].stdout.strip().splitlines()[-1])
    out = Path(record["export_dir"])
    assert record["step"] == 3 and out == workdir / "export" / "step_3"
    manifest = json.loads((out / "export.json").read_text())
    assert {f["path"] for f in manifest["files"]} >= {"peft/adapter_model.safetensors", "peft/adapter_config.json",
                                                       "merged/config.json", "merged/tokenizer.json"}
    # The run's tokenizer ships with the merged model (the embedded policy's: the project's tiny one, no template).
    assert (out / "merged" / "tokenizer.json").read_bytes() == default_tokenizer_path().read_bytes()
    assert not (out / "merged" / "chat_template.jinja").exists()
    spec = _spec(**{"train.steps": 3})
    adapter_cfg = json.loads((out / "peft" / "adapter_config.json").read_text())
    assert adapter_cfg["r"] == spec.model.lora_rank and adapter_cfg["lora_alpha"] == spec.model.lora_alpha
    lora_tensors = load_file(out / "peft" / "adapter_model.safetensors")
    assert lora_tensors and any(np.abs(v).max() > 0 for k, v in lora_tensors.items() if "lora_B" in k)

    policy, optimizer = build_policy(spec, resolve(spec, data=False))
    ckpts = RunCheckpoints(workdir / "checkpoints")
    ckpts.restore(3, policy, optimizer)
    ckpts.close()
    merged = load_pretrained(out / "merged", dtype=jnp.float32)
    ids = jnp.asarray(np.random.default_rng(0).integers(7, policy.cfg.vocab_size, (1, 48)), jnp.int32)
    want = np.asarray(jax.jit(lambda st: token_logprobs(nnx.merge(nnx.graphdef(policy), st), ids))(nnx.state(policy)))
    got = np.asarray(jax.jit(lambda st: token_logprobs(nnx.merge(nnx.graphdef(merged), st), ids))(nnx.state(merged)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)


@pytest.mark.slow  # 13 s on top of the export (a process, a compile): the file checks above run in CI
def test_readme_generate_runs_on_the_export(runs):
    """The README's `generate` command on the exported merged model as it stands (its tokenizer ships with it)."""
    out = Path(json.loads(runs["export"].stdout.strip().splitlines()[-1])["export_dir"]) / "merged"
    gen = subprocess.run([sys.executable, "-m", "glm52_jax.generate", f"--checkpoint={out}", "--prompt=What is 2+2?",
                          "--chat", "--max_new_tokens=2", "--seed=0"], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert gen.returncode == 0, gen.stderr[-2000:]
    record = json.loads(gen.stdout.strip().splitlines()[-1])
    assert record["prompt_tokens"] > 0 and len(record["samples"][0]["tokens"]) <= 2


def test_export_writes_native_positions_unless_asked(tmp_path, monkeypatch):
    """A run under a YaRN payload exports its merged checkpoint with the base's native config.json (the seed's
    rule: the payload is a run-time override), or with the payload under `export.keep_rope_scaling=True`."""
    import jax

    from glm52_jax.checkpoint.train_state import RunCheckpoints, RunState
    from glm52_jax.config import ModelConfig
    from glm52_jax.rl.export import export_run
    from glm52_jax.rl.policy import build_policy

    monkeypatch.delenv("GLM52_ROPE_SCALING_JSON", raising=False)
    spec = _spec(**{"model.rope_scaling_json": _payload(tmp_path, "yarn.json")})
    native = ModelConfig.from_json_file(EMBEDDED_POLICY / "config.json")
    # A committed step 1 of such a run (fresh adapters: what is checked here is the config.json written).
    policy, optimizer = build_policy(spec, resolve(spec, data=False))
    ckpts = RunCheckpoints(tmp_path / "run" / "checkpoints")
    ckpts.save(policy, optimizer, RunState(step=1, rng=jax.random.key(0), cursor=0, optimizer_steps=0,
                                           meta={"config_sha256": spec.resume_sha256(), "base": spec.model.base_name}))
    ckpts.close()
    default = export_run(spec, tmp_path / "run", export_dir=tmp_path / "native")
    kept = export_run(spec.replace(**{"export.keep_rope_scaling": True}), tmp_path / "run",
                      export_dir=tmp_path / "kept")
    assert (default["merged_positions"], kept["merged_positions"]) == ("native", "run")
    assert ModelConfig.from_json_file(tmp_path / "native" / "merged" / "config.json") == native
    run_cfg = ModelConfig.from_json_file(tmp_path / "kept" / "merged" / "config.json")
    assert run_cfg.rope.rope_type == "yarn" and run_cfg.max_position_embeddings == 131072
    assert native.max_position_embeddings < 131072 and native.rope.rope_type != "yarn"


def test_export_refuses_a_directory_without_a_run(tmp_path):
    from glm52_jax.rl.export import export_run

    with pytest.raises(ConfigError, match="no checkpoints"):
        export_run(_spec(), tmp_path)


def test_ctrl_c_stops_at_once_and_says_what_was_kept(tmp_path):
    """SIGINT while the first program compiles: the process exits within seconds (not after the
    compile), exit 130, one line saying nothing was committed; the lock is released."""
    workdir = tmp_path / "w"
    # An empty compile cache of its own: the signal lands in a real compile (the case that used to wait for
    # the compile to end): the adapters' init (seconds here), sent once its `compiling` line is printed, which
    # GLM52_COMPILE_LINES_AFTER_S=0 does as each compile starts (however fast the machine).
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla_cache"), GLM52_COMPILE_LINES_AFTER_S="0")
    # Python's KeyboardInterrupt handler in the child even where this test process ignores SIGINT (a
    # pytest-xdist worker does; an ignored SIGINT is inherited and Python then installs no handler), set
    # before the launcher runs as `python -m glm52_jax.launch` would.
    launch = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
              "sys.argv = ['glm52_jax.launch', *sys.argv[1:]]; "
              "runpy.run_module('glm52_jax.launch', run_name='__main__', alter_sys=True)")
    proc = subprocess.Popen([sys.executable, "-c", launch, f"--workdir={workdir}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    before = []
    while not (before and before[-1].startswith("compiling jit(<lambda>) (loading the policy)")):
        line = proc.stderr.readline()
        assert line, "".join(before)[-3000:]  # the process ended first
        before.append(line)
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    err = "".join(before) + err
    assert time.monotonic() - start < 5, err
    lines = [line for line in err.strip().splitlines() if line.startswith("interrupted")]
    assert proc.returncode == 130 and lines == [f"interrupted: {workdir} has no committed step; the next launch "
                                                "starts from step 1"], err
    assert "Traceback" not in err and not (workdir / ".lock").exists()
    assert os.path.exists(workdir / "config.json")


def test_sigterm_stops_like_ctrl_c(tmp_path):
    """SIGTERM (what SLURM and Kubernetes send before a kill, e.g. on preemption) once the run holds its
    workdir: exit 143 within seconds, one line saying what was kept, the lock released (cheap: sent as
    soon as the lock exists, before the model loads)."""
    workdir = tmp_path / "w"
    proc = subprocess.Popen([sys.executable, "-m", "glm52_jax.launch", f"--workdir={workdir}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    deadline = time.monotonic() + 300
    while not (workdir / ".lock").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.02)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - start < 5, err
    lines = [line for line in err.strip().splitlines() if line.startswith("terminated")]
    assert proc.returncode == 143 and lines == [f"terminated (SIGTERM): {workdir} has no committed step; the next "
                                                "launch starts from step 1"], err
    assert "Traceback" not in err and not (workdir / ".lock").exists()


def _payload(tmp_path, name, theta=10000.0, factor=2.0, original=65536, max_pos=131072):
    path = tmp_path / name
    path.write_text(json.dumps({"max_position_embeddings": max_pos, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": theta, "factor": factor, "original_max_position_embeddings": original,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}))
    return str(path)


def test_rope_scaling_payload_extends_the_position_capacity(tmp_path, monkeypatch):
    monkeypatch.delenv("GLM52_ROPE_SCALING_JSON", raising=False)
    long = {"data.prompt_tokens": 65536, "search.max_candidates": 1}
    with pytest.raises(ConfigError, match="no rope scaling"):
        resolve(_spec(**long))
    inputs = resolve(_spec(**long, **{"model.rope_scaling_json": _payload(tmp_path, "yarn.json")}))
    assert inputs.model_cfg.max_position_embeddings == 131072 and inputs.model_cfg.rope.rope_type == "yarn"
    assert len(inputs.first_prompts[0]) == 65536
    # The environment variable is the seed's switch and works the same way.
    monkeypatch.setenv("GLM52_ROPE_SCALING_JSON", _payload(tmp_path, "env.json"))
    assert resolve(_spec(**long)).model_cfg.max_position_embeddings == 131072
    with pytest.raises(ConfigError, match="different"):
        resolve(_spec(**{"model.rope_scaling_json": _payload(tmp_path, "other.json", factor=4.0)}))


@pytest.mark.parametrize("payload,match", [
    (dict(theta=8e6), "rope_theta"),
    (None, "does not exist"),
])
def test_bad_rope_scaling_payload(tmp_path, monkeypatch, payload, match):
    monkeypatch.delenv("GLM52_ROPE_SCALING_JSON", raising=False)
    path = str(tmp_path / "missing.json") if payload is None else _payload(tmp_path, "bad.json", **payload)
    with pytest.raises(ConfigError, match=match):
        resolve(_spec(**{"model.rope_scaling_json": path}))


def test_2m_config_is_the_seeds_run(monkeypatch):
    """configs/2m.py: GLM-5.2 architecture, exact 2,097,152-token prompts with the YaRN payload,
    16 new tokens, G = 2, rank-8 LoRA, <= 8 candidates, the TP1/CP32/EP32/PP1 mesh."""
    monkeypatch.delenv("GLM52_ROPE_SCALING_JSON", raising=False)
    spec = config_spec("2m")
    with pytest.raises(ConfigError, match="no config.json"):  # the checkpoint must be given per machine
        resolve(spec)
    spec = spec.replace(**{"model.checkpoint": "random"})  # the preset architecture stands in for the release
    inputs = resolve(spec)
    cfg = inputs.model_cfg
    assert cfg.num_hidden_layers == 78 and cfg.max_position_embeddings == 2_097_168
    assert cfg.rope.rope_type == "yarn" and cfg.indexer_types.count("full") == 21
    assert [len(p) for p in inputs.first_prompts] == [2_097_152] * 8
    assert (spec.sampling.max_new_tokens, spec.sampling.num_samples, spec.model.lora_rank) == (16, 2, 8)
    assert spec.search.probe_tokens == 65_536  # the seed's 64K engine probe before the exact-2M requests
    assert spec.mesh_spec().describe() == "DP1/TP1/CP32/EP32/PP1"
    with pytest.raises(ConfigError, match="position capacity"):  # one more token than the payload allows
        resolve(spec.replace(**{"data.prompt_tokens": 2_097_153}))
    assert (spec.model.indexer_dtype, spec.model.indexer_candidates) == ("fp8", 4096)
    with pytest.raises(ConfigError, match=r"indexer_candidates=2048 rescores nothing: .* index_topk \(2048\)"):
        resolve(spec.replace(**{"model.indexer_candidates": 2048}), data=False)  # before any model is built


def test_train_mode_refuses_a_mesh_larger_than_the_devices(tmp_path):
    with pytest.raises(ConfigError, match="needs 16 devices.*xla_force_host_platform_device_count=16"):
        run_online(_spec(**{"mesh": "context=16"}), tmp_path / "w", log=lambda msg: None)
    assert not (tmp_path / "w").exists()


# ~95 s; CI compares a folded=4 mesh on two processes with one device instead (tests/rl/test_rehearsal.py).
@pytest.mark.slow
def test_sharded_transaction_matches_one_device(runs, tmp_path):
    """Step 1 on context 4 x expert 2 (8 devices) vs the single-device run: same candidates, tokens
    and rewards, log-probs / loss / gradient norm within float32 tolerance, adapters sharded."""
    lines = []
    summary = run_online(_spec(**{"mesh": "context=4,expert=2"}), tmp_path / "w", log=lines.append)
    assert summary["status"] == "updated", summary
    assert any(line.startswith("mesh DP1/TP1/CP4/EP2/PP1 over 8") for line in lines), lines
    one, sharded = _receipt(runs["inproc"][0], 1), _receipt(tmp_path / "w", 1)
    assert verify(sharded) == []
    a, b = json.loads(one.read_text()), json.loads(sharded.read_text())
    assert b["topology"]["mesh"] == "DP1/TP1/CP4/EP2/PP1" and b["topology"]["mesh_devices"] == 8
    assert a["topology"]["mesh_devices"] == 1
    assert a["candidate_search"] == b["candidate_search"] and a["rewards"] == b["rewards"]
    assert a["completions"] == b["completions"]
    art_a, art_b = one.parent / "artifacts", sharded.parent / "artifacts"
    for name in ("prompt_token_ids.npy", "completion_tokens.npy", "responses.npy", "response_mask.npy"):
        np.testing.assert_array_equal(np.load(art_b / name), np.load(art_a / name), err_msg=name)
    for name in ("old_logprobs.npy", "new_logprobs.npy"):
        np.testing.assert_allclose(np.load(art_b / name), np.load(art_a / name), rtol=1e-5, atol=1e-5, err_msg=name)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(b["training"][key], a["training"][key], rtol=1e-5, err_msg=key)
    assert b["training"]["optimizer_steps"] == 1
    # On-device parameter digests do not depend on the sharding: the same inventory on 1 and 8 devices.
    for name in ("inventory_before_sampling.json", "inventory_after_sampling.json"):
        assert json.loads((art_b / name).read_text()) == json.loads((art_a / name).read_text()), name
    assert b["training"]["lora_digest_before"] == a["training"]["lora_digest_before"]  # the same starting adapters


def test_prefill_progress_reaches_the_console_for_long_prompts():
    events, lines = [], []
    progress = prefill_progress(lambda kind, **kw: events.append((kind, kw)), Console(lines.append, bars=False),
                                chunk_size=100)
    for done in range(100, 2001, 100):  # 20 chunks
        progress(done, 2000, 1000.0, (2000 - done) / 1000)
    assert len(events) == 20 and events[-1] == ("prefill", {"done": 2000, "total": 2000, "tokens_per_s": 1000.0})
    assert len(lines) == 11 and lines[-1] == "prefill 2,000/2,000 tokens (100%), 1,000 tokens/s, eta 0 s"
    short = []
    quiet = prefill_progress(lambda kind, **kw: None, Console(short.append, bars=False), chunk_size=100)
    for done in (100, 200, 256):  # 3 chunks: no console lines
        quiet(done, 256, 1000.0, 0.0)
    assert short == []


def test_decode_progress_on_a_terminal_and_in_logs():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    bar = decode_progress(Console(lambda m: None, tty), steps=16)
    for done in (1, 3, 2, 16):  # unordered callbacks: the late step 2 does not move the bar back
        bar(done, 16)
    drawn = tty.getvalue()
    assert "decode |" in drawn and "3/16 steps" in drawn and "2/16" not in drawn and drawn.endswith("16/16 steps\n")
    assert decode_progress(Console(lambda m: None, bars=False), steps=16) is None  # a log, a short decode: no callback
    lines = []
    plain = decode_progress(Console(lines.append, bars=False), steps=100)
    for done in range(1, 101):
        plain(done, 100)
    assert len(lines) == 11 and lines[-1] == "decode 100/100 steps (100%)"


def test_broken_data_rows_fail_before_any_model_work(tmp_path):
    good = json.loads((ROOT / "glm52_jax" / "assets" / "math_problems.jsonl").read_text().splitlines()[0])
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(good) + "\n" + '{"data_source": "x", "prompt": [}\n')
    with pytest.raises(ConfigError, match="line 2"):
        resolve(_spec(**{"data.path": str(path)}))
    with pytest.raises(ConfigError, match="no DAPO data file"):
        resolve(_spec(**{"data.path": str(tmp_path / "missing.jsonl")}))


SAMPLE_KEYS = {"request", "candidate", "row", "prompt_tokens", "prompt_sha256", "seed", "sample", "length", "tokens",
               "logprobs", "text", "finish_reason"}


def test_samples_jsonl_holds_every_sample_bound_to_the_receipt(inproc):
    """samples.jsonl: in the manifest and the deterministic view, one line per sample of every candidate
    with prompt hash, seed, tokens, log-probs, text, finish reason and length; the accepted candidate's
    lines equal its arrays, every line its rewards.json entry; the decode audit recomputes from it."""
    import hashlib

    from glm52_jax.rl import decode_audit

    workdir, _ = inproc
    spec = _spec(**{"train.steps": 2})
    inputs = resolve(spec)
    g = spec.sampling.per_request  # = num_samples in the tiny config
    for step in (1, 2):
        path = _receipt(workdir, step)
        receipt = json.loads(path.read_text())
        art = path.parent / "artifacts"
        assert {"path": "artifacts/samples.jsonl", "kind": "samples"}.items() <= \
            next(e for e in receipt["manifest"] if e["path"] == "artifacts/samples.jsonl").items()
        assert "artifacts/samples.jsonl" in [e["path"] for e in deterministic_view(path)["manifest"]]
        lines = [json.loads(line) for line in (art / "samples.jsonl").read_text().splitlines()]
        rewards = json.loads((art / "rewards.json").read_text())
        seeds = json.loads((art / "sampling_params.json").read_text())["seeds"]
        assert len(lines) == g * receipt["candidate_search"]["tried"] == g * len(rewards)
        cursor = receipt["transaction"]["data_cursor"]
        for line in lines:
            assert set(line) == SAMPLE_KEYS and line["request"] == "candidate"
            c, j = line["candidate"], line["sample"]
            cd = rewards[c]
            row, prompt = inputs.candidate(cursor, c)
            assert (line["row"], line["seed"], line["prompt_tokens"]) == (cd["row"], seeds[c], 256) == \
                (row.index, seeds[c], len(prompt))
            assert line["prompt_sha256"] == hashlib.sha256(np.asarray(prompt, "<i4").tobytes()).hexdigest()
            assert (line["text"], line["length"], line["finish_reason"]) == \
                (cd["texts"][j], cd["lengths"][j], cd["finish_reasons"][j])
            assert len(line["tokens"]) == len(line["logprobs"]) == line["length"] >= 1
        accepted = receipt["candidate_search"]["accepted"]
        tokens, old = np.load(art / "completion_tokens.npy"), np.load(art / "old_logprobs.npy")
        prompt_ids = np.load(art / "prompt_token_ids.npy")
        mine = [line for line in lines if line["candidate"] == accepted]
        assert [line["sample"] for line in mine] == list(range(g))
        # The group the update trained on: with samples_per_request = 0 (= num_samples), all of the request's.
        group = receipt["candidate_search"]["group_samples"]
        assert group == receipt["training"]["group_samples"] == list(range(spec.sampling.num_samples))
        assert receipt["candidate_search"]["samples_per_request"] == g and receipt["model"]["init_adapter"] is None
        for k, j in enumerate(group):
            line, n = mine[j], mine[j]["length"]
            np.testing.assert_array_equal(np.asarray(line["tokens"]), tokens[k, :n])
            np.testing.assert_array_equal(np.asarray(line["logprobs"], np.float32), old[k, :n])  # exact float32
            assert np.all(tokens[k, n:] == -1) and np.all(old[k, n:] == 0)  # nothing after the record's end
            assert line["prompt_sha256"] == hashlib.sha256(prompt_ids.astype("<i4").tobytes()).hexdigest()
        audit = receipt["decode_audit"]
        assert audit == decode_audit.audit(lines)
        assert audit["samples"] == len(lines) and audit["stopped"] + audit["length_capped"] == len(lines)
        assert audit["stopped"] == sum(cd["finish_reasons"].count("stop") for cd in rewards)
        assert "probe" not in receipt and "probe_timing" not in receipt  # off in the tiny config


def _reseal(run: Path, edit) -> None:
    """Edits rewards.json and the receipt with `edit(rewards, receipt)`, then recomputes the artifact's
    size and sha256 in the manifest, manifest_sha256 and receipt_sha256, as a forger would."""
    import hashlib

    from glm52_jax.evidence import canonical_sha256

    receipt = json.loads((run / "receipt.json").read_text())
    rewards_path = run / "artifacts" / "rewards.json"
    rewards = json.loads(rewards_path.read_text())
    edit(rewards, receipt)
    data = (json.dumps(rewards, sort_keys=True, indent=2, ensure_ascii=True) + "\n").encode()
    rewards_path.write_bytes(data)
    entry = next(e for e in receipt["manifest"] if e["path"] == "artifacts/rewards.json")
    entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    receipt.pop("receipt_sha256")
    receipt["manifest_sha256"] = canonical_sha256(receipt["manifest"])
    receipt["receipt_sha256"] = canonical_sha256(receipt)
    (run / "receipt.json").write_text(json.dumps(receipt, indent=2))


def test_recompute_rewards_passes_on_the_run_and_fails_on_a_resealed_forgery(inproc, tmp_path):
    """`verify --recompute-rewards` (the CLI, a real process): exit 0 on a real receipt; a reward edited in
    rewards.json and in the receipt's rewards section, every hash re-sealed, passes the hash check but
    fails the recomputation with exactly one line naming the sample."""
    src = _receipt(inproc[0], 1).parent
    forged = tmp_path / "forged"
    shutil.copytree(src, forged)
    accepted = json.loads((src / "receipt.json").read_text())["candidate_search"]["accepted"]

    def flip(rewards, receipt):
        rewards[accepted]["rewards"][0] *= -1.0
        receipt["rewards"][accepted][0] *= -1.0

    _reseal(forged, flip)
    assert verify(forged) == []  # the hashes alone no longer catch it
    procs = [subprocess.Popen([sys.executable, "-m", "glm52_jax.evidence", "verify", "--recompute-rewards", str(d)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for d in (src, forged)]
    (good, _), (bad, _) = (p.communicate(timeout=120) for p in procs)
    assert procs[0].returncode == 0, good
    n = sum(len(r) for r in json.loads((src / "receipt.json").read_text())["rewards"])
    assert good.splitlines()[1] == f"OK {n} rewards recomputed with the DAPO rule, all equal to the stored ones"
    stored = json.loads((forged / "artifacts" / "rewards.json").read_text())[accepted]
    lines = bad.splitlines()
    assert procs[1].returncode == 1 and len(lines) == 1, bad
    assert lines[0].startswith(f"artifacts/rewards.json: candidate {accepted} sample 0: stored reward "
                               f"{stored['rewards'][0]!r}, recomputed {-stored['rewards'][0]!r}"), lines


def test_engine_probe_request_on_the_embedded_policy(inproc, tmp_path):
    """The probe path on a fresh embedded policy (the state step 1 sampled with): an exact-N request of the
    cursor's row recorded with tokens, texts, finish reasons and timing, the prefix cache left empty. At
    N = data.prompt_tokens with candidate 0's seed it is candidate 0's request, so it must reproduce step 1's
    candidate 0 samples exactly. Its receipt sections: "probe" deterministic, "probe_timing" not."""
    from glm52_jax.evidence import EvidenceWriter
    from glm52_jax.rl import decode_audit, settings
    from glm52_jax.rl.samples import jsonl_bytes
    from glm52_jax.rl.search import engine_probe
    from glm52_jax.rl.transaction import receipt_fields

    spec = _spec(**{"train.steps": 2})
    inputs, model = _fresh_policy(spec)
    sampler = settings.sampler(spec.sampling, model)
    art = _receipt(inproc[0], 1).parent / "artifacts"
    seed = json.loads((art / "sampling_params.json").read_text())["seeds"][0]
    section, timing, records = engine_probe(inputs, 0, seed, sampler, spec.data.prompt_tokens)
    assert len(sampler.prefix_cache) == 0
    assert timing["prefill_seconds"] >= 0 and timing["decode_seconds"] > 0
    step1 = [json.loads(line) for line in (art / "samples.jsonl").read_text().splitlines()]
    want = [line for line in step1 if line["candidate"] == 0]
    assert [{**r, "request": "candidate", "candidate": 0} for r in records] == want
    assert section == {"prompt_tokens": 256, "row": want[0]["row"], "seed": seed,
                       "prompt_sha256": want[0]["prompt_sha256"], "tokens": [r["tokens"] for r in want],
                       "texts": [r["text"] for r in want], "lengths": [r["length"] for r in want],
                       "finish_reasons": [r["finish_reason"] for r in want], "decode_audit": decode_audit.audit(want)}
    assert all(r["request"] == "probe" and r["candidate"] is None for r in records)

    receipt = json.loads((art.parent / "receipt.json").read_text())
    candidates = json.loads((art / "rewards.json").read_text())
    fields = receipt_fields(inputs, model.cfg, step=1, cursor=0, candidates=candidates, samples=records + step1,
                            accepted=None, training={}, numerics={}, cleanup={}, traces=[], probe=(section, timing),
                            rank_paths=["artifacts/traces/rank0.jsonl"])
    assert fields["probe"] == section and fields["probe_timing"] == timing
    assert fields["decode_audit"] == receipt["decode_audit"]  # the candidates' audit leaves the probe out
    writer = EvidenceWriter(tmp_path / "run")
    writer.add_bytes("samples.jsonl", jsonl_bytes(records + step1), kind="samples")
    writer.add_bytes("traces/rank0.jsonl", b"", kind="trace")
    view = deterministic_view(writer.commit(fields))
    assert "probe" in view and "probe_timing" not in view


def test_samples_per_request_draws_more_and_trains_on_the_chosen_group(inproc):
    """`sampling.samples_per_request=4` with G = 2 (search_group on a fresh embedded policy, step 1's cursor and
    seeds, no update): each request draws 4 samples, all rewarded and recorded; their first 2 are step 1's
    samples of that candidate (more samples leave the first G as they were, up to float32 rounding of the
    log-probs); the search stops at the first
    request whose 4 rewards differ, and the accepted group is `choose_group`'s, with those samples' tokens and
    old log-probs."""
    from glm52_jax.rl import settings
    from glm52_jax.rl.group import choose_group
    from glm52_jax.rl.search import response_batch, search_group

    art = _receipt(inproc[0], 1).parent / "artifacts"
    step1 = [json.loads(line) for line in (art / "samples.jsonl").read_text().splitlines()]
    seeds = json.loads((art / "sampling_params.json").read_text())["seeds"]
    spec = _spec(**{"sampling.samples_per_request": 4, "search.max_candidates": len(seeds)})
    inputs, model = _fresh_policy(spec)
    records: list[dict] = []
    candidates, accepted = search_group(inputs, spec.data.first_row, seeds, settings.sampler(spec.sampling, model),
                                        step=1, event=lambda *a, **k: None, log=lambda msg: None, samples=records)
    assert len(records) == 4 * len(candidates)
    for cd in candidates:
        mine = [r for r in records if r["candidate"] == cd["candidate"]]
        assert [r["sample"] for r in mine] == [0, 1, 2, 3] and len(cd["rewards"]) == len(cd["texts"]) == 4
        assert [r["text"] for r in mine] == cd["texts"]
        before = [r for r in step1 if r["candidate"] == cd["candidate"]]
        assert [{**r, "logprobs": None} for r in mine[:2]] == [{**r, "logprobs": None} for r in before]
        # Old log-probs of a 4-row decode vs a 2-row one: XLA:CPU blocks the batch differently, so float32
        # rounding differs (measured max 2.4e-7 on 2026-12-04; the tokens are identical). Bound ~10x that.
        for a, b in zip(mine[:2], before):
            np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=0, atol=2e-6)
    assert all(len(set(cd["rewards"])) == 1 for cd in candidates[:-1])
    rewards = candidates[-1]["rewards"]
    assert accepted is not None, [cd["rewards"] for cd in candidates]  # the embedded policy's rows do mix
    assert accepted.index == candidates[-1]["candidate"] and accepted.samples == choose_group(rewards, 2)
    assert accepted.rewards == [rewards[j] for j in accepted.samples]
    chosen = [records[-4:][j] for j in accepted.samples]
    for k, r in enumerate(chosen):
        n = r["length"]
        assert accepted.result.lengths[k] == n and accepted.result.finish_reasons[k] == r["finish_reason"]
        np.testing.assert_array_equal(accepted.result.tokens[k, :n], r["tokens"])
        np.testing.assert_array_equal(accepted.result.logprobs[k, :n], np.asarray(r["logprobs"], np.float32))
    responses, mask, advantages = response_batch(accepted, 0, spec.sampling.max_new_tokens)
    assert responses.shape == mask.shape == (2, spec.sampling.max_new_tokens) and advantages.shape == (2,)
    print("samples_per_request=4 rewards:", [cd["rewards"] for cd in candidates], "group:", accepted.samples)


def test_the_committed_online_receipt_is_what_this_code_computes(runs):
    """evidence/online_grpo_tiny.json (published from step 1 of the README's first command, evidence/README.md)
    verifies, and step 1 of the same run here computes the same: prompt, candidates, completions, rewards,
    training numbers, numerics (provenance, timings, absolute paths and hashes of float data aside)."""
    committed = ROOT / "evidence" / "online_grpo_tiny.json"
    assert verify(committed) == []
    workdir, _ = runs["inproc"]
    # This process has 8 virtual CPU devices, the README's command 1; both run on a 1-device mesh.
    assert result_differences(_receipt(workdir, 1), committed, ignore=("topology.devices",)) == []
    assert result_differences(_receipt(workdir, 2), committed, ignore=("topology.devices",))  # can fail


@pytest.mark.slow  # ~80 s (every program compiled for the new mesh); CI keeps the restore onto a mesh in
# tests/checkpoint/test_train_state.py::test_a_step_saved_on_one_device_restores_onto_a_mesh
def test_a_step_saved_on_one_device_resumes_on_a_mesh(inproc, tmp_path):
    """Resume on another topology: step 1 of the uninterrupted 1-device run, resumed on a 2-device mesh
    (the rerun changes only `mesh`), computes step 2 as the uninterrupted run did: every deterministic field
    exact, floats within 1e-5. The checkpoint restores onto the new mesh (Orbax target shardings, the RNG
    key re-placed)."""
    source, _ = inproc
    workdir = tmp_path / "w"
    shutil.copytree(source, workdir, ignore=shutil.ignore_patterns("step_000002", "2", ".lock"))
    lines = []
    # 2 devices, not 8: the same restore path (target shardings, the key re-placed) at a quarter of the CI time.
    summary = run_online(_spec(**{"train.steps": 2, "mesh": "context=2"}), workdir, log=lines.append)
    assert summary["steps_run"] == 1 and summary["last_step"] == 2, summary
    assert any(line.startswith("resumed from checkpoint step 1") for line in lines), lines
    assert verify(_receipt(workdir, 2)) == []
    assert result_differences(_receipt(source, 2), _receipt(workdir, 2),
                              ignore=("topology", "config.sha256", "config.resume_sha256")) == []


def test_the_end_summary_gives_the_accepted_groups_reward_mean(tmp_path):
    """The update trains on the accepted group: its reward mean leads, the mean over every candidate tried follows."""
    result = {"step": 1, "status": "updated", "accepted": 1, "accepted_rewards": [1.0, -1.0, 1.0, 1.0],
              "receipt": "r.json", "scalars": {"candidates_tried": 2, "reward_mean": 0.75, "loss": 0.5, "grad_norm": 2}}
    assert end_summary(result, tmp_path)[0] == ("done: step 1 updated; accepted candidate 1 of 2, reward mean 0.5 "
                                               "(accepted group; 0.75 over all 2 tried), loss 0.5, grad norm 2")
    none = {**result, "status": "skipped", "accepted": None, "accepted_rewards": None}
    assert ", reward mean 0.75 over all 2 tried, loss" in end_summary(none, tmp_path)[0]
