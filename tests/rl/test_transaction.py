"""The online GRPO transaction end to end: real model, sampler, reward, update, receipt, verify."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from glm52_jax.evidence import deterministic_view, verify
from glm52_jax.rl.transaction import EMBEDDED_POLICY, ConfigError, check_config, run_transaction

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


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """The embedded policy's transaction twice with one config: in this process, then via the CLI."""
    first = tmp_path_factory.mktemp("run_inproc")
    summary = run_transaction(_config(), first, log=lambda msg: None)
    second = tmp_path_factory.mktemp("run_cli") / "w"
    cli = subprocess.run([sys.executable, "-m", "glm52_jax.launch", f"--config={ROOT / 'configs' / 'tiny.py'}",
                          f"--workdir={second}"] + [f"--config.{k}={v}" for k, v in OVERRIDES.items()],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert cli.returncode == 0, cli.stderr[-3000:]
    cli_summary = json.loads(cli.stdout.strip().splitlines()[-1])
    assert cli_summary["receipt"] == str(second / "evidence" / "receipt.json")
    return [(first, summary), (second, cli_summary)]


def test_transaction_updates_and_receipt_verifies(two_runs):
    workdir, summary = two_runs[0]
    assert summary["status"] == "updated", summary
    receipt_path = workdir / "evidence" / "receipt.json"
    assert verify(receipt_path) == []
    receipt = json.loads(receipt_path.read_text())
    training = receipt["training"]
    assert training["optimizer_steps"] == 1
    assert training["lora_sha256_before"] != training["lora_sha256_after"]  # the step changed the adapters
    accepted = receipt["candidate_search"]["accepted"]
    assert len(set(receipt["rewards"][accepted])) > 1  # a mixed-reward group, as the search requires
    assert all(len(set(r)) == 1 for r in receipt["rewards"][:accepted])  # earlier ones were all-equal
    assert np.isfinite(training["loss"]) and receipt["numerics"]["finite"]
    assert len(training["grads_sha256"]) == 64
    # Sampling left every parameter byte as it was.
    art = workdir / "evidence" / "artifacts"
    assert json.loads((art / "inventory_before_sampling.json").read_text()) == \
        json.loads((art / "inventory_after_sampling.json").read_text())
    old = np.load(art / "old_logprobs.npy")
    new = np.load(art / "new_logprobs.npy")
    mask = np.load(art / "response_mask.npy")
    assert old.shape == new.shape == mask.shape and mask.sum() > 0
    assert np.all(new[mask == 0] == 0) and np.any(np.abs(new - old)[mask > 0] > 1e-6)  # the policy moved


def test_same_config_and_seed_reproduce(two_runs):
    """Tokens, rewards, loss, gradient and LoRA hashes: equal across two processes."""
    (a, _), (b, _) = two_runs
    view_a = deterministic_view(a / "evidence" / "receipt.json")
    view_b = deterministic_view(b / "evidence" / "receipt.json")
    assert view_a == view_b


def test_any_changed_byte_fails_verify_naming_the_artifact(two_runs, tmp_path):
    import shutil

    src = two_runs[0][0] / "evidence"
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


def test_existing_receipt_is_never_overwritten(two_runs):
    workdir, _ = two_runs[0]
    before = (workdir / "evidence" / "receipt.json").read_bytes()
    with pytest.raises(Exception, match="receipt"):
        run_transaction(_config(), workdir, log=lambda msg: None)
    assert (workdir / "evidence" / "receipt.json").read_bytes() == before


@pytest.mark.parametrize("key,value,match", [
    ("train.gradient_mode", "fast", "gradient_mode"),
    ("sampling.num_samples", 1, "num_samples"),
    ("search.max_candidates", 0, "max_candidates"),
    ("model.lora_families", ("attention", "lm_head"), "lora_families"),
    ("model.checkpoint", "/nonexistent/ckpt", "no config.json"),
    ("data.prompt_tokens", 65536, "position capacity"),
    ("data.prompt_tokens", 20, "prompt_tokens"),
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


def test_cli_receipt_verifies_with_the_evidence_cli(two_runs):
    receipt = two_runs[1][1]["receipt"]
    check = subprocess.run([sys.executable, "-m", "glm52_jax.evidence", "verify", receipt],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0 and check.stdout.startswith("OK"), check.stdout + check.stderr
