"""The online GRPO transaction end to end: real model, sampler, reward, update, receipt, verify."""

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from glm52_jax.evidence import deterministic_view, verify
from glm52_jax.rl.transaction import EMBEDDED_POLICY, ConfigError, check_config, run_online

ROOT = Path(__file__).resolve().parents[2]


def _config(**overrides):
    sys.path.insert(0, str(ROOT / "configs"))
    try:
        import tiny
    finally:
        sys.path.pop(0)
    c = tiny.get_config()
    for key, value in {**OVERRIDES, **overrides}.items():
        node = c
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


OVERRIDES = {"sampling.max_new_tokens": 24, "sampling.chunk_size": 256}


def _cli(workdir, *overrides):
    return [sys.executable, "-m", "glm52_jax.launch", f"--config={ROOT / 'configs' / 'tiny.py'}",
            f"--workdir={workdir}"] + [f"--config.{k}={v}" for k, v in {**OVERRIDES, **dict(overrides)}.items()]


def _kill_when(proc, metrics: Path, event: dict, timeout: float = 900):
    """SIGKILLs `proc` as soon as `metrics` (JSONL) holds a record containing `event`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) before {event}: {proc.stderr.read()[-3000:]}")
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                record = json.loads(line)
                if all(record.get(k) == v for k, v in event.items()):
                    proc.kill()
                    proc.wait()
                    return
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no {event} within {timeout} s")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two transactions of the embedded policy, twice: in this process without interruption, and via
    the CLI killed during step 2's update and then resumed by rerunning the same command."""
    first = tmp_path_factory.mktemp("run_inproc")
    summary = run_online(_config(**{"train.steps": 2}), first, log=lambda msg: None)
    second = tmp_path_factory.mktemp("run_cli") / "w"
    proc = subprocess.Popen(_cli(second, ("train.steps", 2)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    _kill_when(proc, second / "metrics.jsonl", {"event": "update_start", "step": 2})
    killed = {"checkpoints": sorted(p.name for p in (second / "checkpoints").iterdir()),
              "evidence": sorted(p.name for p in (second / "evidence").iterdir()),
              "step2_receipt": (second / "evidence" / "step_000002" / "receipt.json").exists()}
    cli = subprocess.run(_cli(second, ("train.steps", 2)), capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert cli.returncode == 0, cli.stderr[-3000:]
    cli_summary = json.loads(cli.stdout.strip().splitlines()[-1])
    return {"inproc": (first, summary), "cli": (second, cli_summary), "killed": killed, "cli_stderr": cli.stderr}


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
        training = receipt["training"]
        assert training["optimizer_steps"] == 1 and training["optimizer_steps_total"] == step
        assert training["lora_sha256_before"] != training["lora_sha256_after"]  # the step changed the adapters
        lora_hashes.append((training["lora_sha256_before"], training["lora_sha256_after"]))
        accepted = receipt["candidate_search"]["accepted"]
        assert len(set(receipt["rewards"][accepted])) > 1  # a mixed-reward group, as the search requires
        assert all(len(set(r)) == 1 for r in receipt["rewards"][:accepted])  # earlier ones were all-equal
        assert np.isfinite(training["loss"]) and receipt["numerics"]["finite"]
        assert len(training["grads_sha256"]) == 64
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
    assert verify(_receipt(runs["cli"][0], 1)) == []


def test_resumed_run_continues_identically(runs):
    """Step 1 from the killed process and step 2 from the resumed one equal an uninterrupted run:
    tokens, rewards, loss, gradient and LoRA hashes (the deterministic view)."""
    (a, _), (b, cli_summary) = runs["inproc"], runs["cli"]
    assert cli_summary["steps_run"] == 1 and cli_summary["last_step"] == 2, cli_summary
    assert "resumed from checkpoint step 1" in runs["cli_stderr"]
    for step in (1, 2):
        assert verify(_receipt(b, step)) == []
        assert deterministic_view(_receipt(a, step)) == deterministic_view(_receipt(b, step)), step
    # The killed step's partial evidence was set aside, not deleted or overwritten.
    aside = b / "evidence" / "step_000002.uncommitted-1"
    assert aside.is_dir() and not (aside / "receipt.json").exists()


def test_any_changed_byte_fails_verify_naming_the_artifact(runs, tmp_path):
    import shutil

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
    summary = run_online(_config(**{"train.steps": 2}), workdir, log=lambda msg: None)
    assert summary["status"] == "complete" and summary["steps_run"] == 0
    assert {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()} == before


def test_resume_refuses_another_runs_checkpoints(runs):
    """A different config (here the learning rate) must not continue from these checkpoints."""
    from glm52_jax.checkpoint.train_state import CheckpointMismatchError

    workdir, _ = runs["inproc"]
    with pytest.raises(CheckpointMismatchError, match="another run"):
        run_online(_config(**{"train.steps": 3, "train.learning_rate": 0.5}), workdir, log=lambda msg: None)
    assert not _receipt(workdir, 3).parent.exists()


@pytest.mark.parametrize("key,value,match", [
    ("train.gradient_mode", "fast", "gradient_mode"),
    ("sampling.num_samples", 1, "num_samples"),
    ("search.max_candidates", 0, "max_candidates"),
    ("model.lora_families", ("attention", "lm_head"), "lora_families"),
    ("model.checkpoint", "/nonexistent/ckpt", "no config.json"),
    ("data.prompt_tokens", 65536, "position capacity"),
    ("data.prompt_tokens", 20, "prompt_tokens"),
    ("train.steps", 0, "train.steps"),
])
def test_bad_config_fails_before_any_model_work(key, value, match):
    with pytest.raises(ConfigError, match=match):
        check_config(_config(**{key: value}))


def test_embedded_policy_ships_with_the_package():
    assert (EMBEDDED_POLICY / "config.json").is_file() and (EMBEDDED_POLICY / "model.safetensors").is_file()


def test_cli_reports_config_errors_before_writing(tmp_path):
    bad = subprocess.run([sys.executable, "-m", "glm52_jax.launch", f"--config={ROOT / 'configs' / 'tiny.py'}",
                          "--config.train.gradient_mode=fast", f"--workdir={tmp_path / 'bad'}"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode != 0 and "gradient_mode" in bad.stderr
    assert not (tmp_path / "bad").exists()  # nothing written


def test_cli_receipt_verifies_with_the_evidence_cli(runs):
    receipt = runs["cli"][1]["receipts"][-1]
    check = subprocess.run([sys.executable, "-m", "glm52_jax.evidence", "verify", receipt],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0 and check.stdout.startswith("OK"), check.stdout + check.stderr


def test_export_of_the_latest_checkpoint(runs, tmp_path):
    """PEFT adapter and merged model from checkpoint 2: the merged HF checkpoint reproduces the
    LoRA policy's log-probs, and the adapter holds the checkpoint's LoRA arrays."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from safetensors.numpy import load_file

    from glm52_jax.checkpoint.hf import load_pretrained
    from glm52_jax.checkpoint.train_state import RunCheckpoints
    from glm52_jax.model.transformer import token_logprobs
    from glm52_jax.rl.export import export_run
    from glm52_jax.rl.transaction import build_policy

    workdir, _ = runs["inproc"]
    c = _config(**{"train.steps": 2})
    record = export_run(c, workdir, export_dir=tmp_path / "exp")
    assert record["step"] == 2
    out = tmp_path / "exp"
    manifest = json.loads((out / "export.json").read_text())
    assert {f["path"] for f in manifest["files"]} >= {"peft/adapter_model.safetensors", "peft/adapter_config.json",
                                                       "merged/config.json"}
    adapter_cfg = json.loads((out / "peft" / "adapter_config.json").read_text())
    assert adapter_cfg["r"] == c.model.lora_rank and adapter_cfg["lora_alpha"] == c.model.lora_alpha
    lora_tensors = load_file(out / "peft" / "adapter_model.safetensors")
    assert lora_tensors and any(np.abs(v).max() > 0 for k, v in lora_tensors.items() if "lora_B" in k)

    policy, optimizer = build_policy(c, check_config(c))
    ckpts = RunCheckpoints(workdir / "checkpoints")
    ckpts.restore(2, policy, optimizer)
    ckpts.close()
    merged = load_pretrained(out / "merged", dtype=jnp.float32)
    ids = jnp.asarray(np.random.default_rng(0).integers(7, policy.cfg.vocab_size, (1, 48)), jnp.int32)
    want = np.asarray(jax.jit(lambda st: token_logprobs(nnx.merge(nnx.graphdef(policy), st), ids))(nnx.state(policy)))
    got = np.asarray(jax.jit(lambda st: token_logprobs(nnx.merge(nnx.graphdef(merged), st), ids))(nnx.state(merged)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)


def test_export_refuses_a_directory_without_a_run(tmp_path):
    from glm52_jax.rl.export import export_run

    with pytest.raises(ConfigError, match="no checkpoints"):
        export_run(_config(), tmp_path)


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
        check_config(_config(**long))
    plan = check_config(_config(**long, **{"model.rope_scaling_json": _payload(tmp_path, "yarn.json")}))
    assert plan.model_cfg.max_position_embeddings == 131072 and plan.model_cfg.rope.rope_type == "yarn"
    assert len(plan.prompts[0]) == 65536
    # The environment variable is the seed's switch and works the same way.
    monkeypatch.setenv("GLM52_ROPE_SCALING_JSON", _payload(tmp_path, "env.json"))
    assert check_config(_config(**long)).model_cfg.max_position_embeddings == 131072
    with pytest.raises(ConfigError, match="different"):
        check_config(_config(**{"model.rope_scaling_json": _payload(tmp_path, "other.json", factor=4.0)}))


@pytest.mark.parametrize("payload,match", [
    (dict(theta=8e6), "rope_theta"),
    (None, "does not exist"),
])
def test_bad_rope_scaling_payload(tmp_path, monkeypatch, payload, match):
    monkeypatch.delenv("GLM52_ROPE_SCALING_JSON", raising=False)
    path = str(tmp_path / "missing.json") if payload is None else _payload(tmp_path, "bad.json", **payload)
    with pytest.raises(ConfigError, match=match):
        check_config(_config(**{"model.rope_scaling_json": path}))


def _load_config(name):
    import importlib.util

    from ml_collections import config_flags  # noqa: F401  (the configs are plain modules)

    spec = importlib.util.spec_from_file_location(f"cfg_{name}", ROOT / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def test_2m_config_is_the_seeds_run(monkeypatch):
    """configs/2m.py: GLM-5.2 architecture, exact 2,097,152-token prompts with the YaRN payload,
    16 new tokens, G = 2, rank-8 LoRA, <= 8 candidates, the TP1/CP32/EP32/PP1 mesh."""
    from glm52_jax.rl.transaction import mesh_spec

    monkeypatch.delenv("GLM52_ROPE_SCALING_JSON", raising=False)
    c = _load_config("2m")
    with pytest.raises(ConfigError, match="no config.json"):  # the checkpoint must be given per machine
        check_config(c)
    c.model.checkpoint = "random"  # the preset architecture stands in for the release
    plan = check_config(c)
    assert plan.model_cfg.num_hidden_layers == 78 and plan.model_cfg.max_position_embeddings == 2_097_168
    assert plan.model_cfg.rope.rope_type == "yarn" and plan.model_cfg.indexer_types.count("full") == 21
    assert [len(p) for p in plan.prompts] == [2_097_152] * 8
    assert (c.sampling.max_new_tokens, c.sampling.num_samples, c.model.lora_rank) == (16, 2, 8)
    assert mesh_spec(c).describe() == "DP1/TP1/CP32/EP32/PP1"
    c.data.prompt_tokens = 2_097_153  # one more token than the payload's capacity allows
    with pytest.raises(ConfigError, match="position capacity"):
        check_config(c)


def test_train_mode_refuses_a_mesh_larger_than_the_devices(tmp_path):
    with pytest.raises(ConfigError, match="needs 16 devices.*xla_force_host_platform_device_count=16"):
        run_online(_config(**{"mesh": "context=16"}), tmp_path / "w", log=lambda msg: None)
    assert not (tmp_path / "w").exists()


def test_sharded_transaction_matches_one_device(runs, tmp_path):
    """Step 1 on context 4 x expert 2 (8 devices) vs the single-device run: same candidates, tokens
    and rewards, log-probs / loss / gradient norm within float32 tolerance, adapters sharded."""
    lines = []
    summary = run_online(_config(**{"mesh": "context=4,expert=2"}), tmp_path / "w", log=lines.append)
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


def test_prefill_progress_reaches_the_console_for_long_prompts():
    from glm52_jax.rl.transaction import _prefill_progress

    events, lines = [], []
    progress = _prefill_progress(lambda kind, **kw: events.append((kind, kw)), lines.append, chunk_size=100)
    for done in range(100, 2001, 100):  # 20 chunks
        progress(done, 2000, 1000.0, (2000 - done) / 1000)
    assert len(events) == 20 and events[-1] == ("prefill", {"done": 2000, "total": 2000, "tokens_per_s": 1000.0})
    assert len(lines) == 11 and lines[-1].startswith("prefill 2,000/2,000 tokens (100%)")
    short = []
    quiet = _prefill_progress(lambda kind, **kw: None, short.append, chunk_size=100)
    for done in (100, 200, 256):  # 3 chunks: no console lines
        quiet(done, 256, 1000.0, 0.0)
    assert short == []


def test_broken_data_rows_fail_before_any_model_work(tmp_path):
    good = json.loads((ROOT / "glm52_jax" / "assets" / "math_problems.jsonl").read_text().splitlines()[0])
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(good) + "\n" + '{"data_source": "x", "prompt": [}\n')
    with pytest.raises(ConfigError, match="line 2"):
        check_config(_config(**{"data.path": str(path)}))
    with pytest.raises(ConfigError, match="no DAPO data file"):
        check_config(_config(**{"data.path": str(tmp_path / "missing.jsonl")}))
