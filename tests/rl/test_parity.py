"""Parity mode: the three gradient modes on one real rollout group of the embedded policy."""

import importlib.util
import json
from pathlib import Path

import pytest

from glm52_jax.evidence import verify
from glm52_jax.rl.parity import run_parity
from glm52_jax.rl.transaction import ConfigError, check_config

ROOT = Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(f"cfg_{name}", ROOT / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    c = _load("tiny")
    c.sampling.max_new_tokens = 24  # as tests/rl/test_transaction.py: same programs, compile cache hits
    c.sampling.chunk_size = 256
    workdir = tmp_path_factory.mktemp("parity")
    return workdir, run_parity(c, workdir, log=lambda msg: None)


@pytest.mark.slow  # ~2-4 min (sampling + three gradient programs); the modes themselves are in test_gradients
def test_parity_receipt_and_mode_agreement(parity):
    workdir, out = parity
    receipt = workdir / "evidence" / "parity" / "receipt.json"
    assert verify(receipt) == []
    cmp = json.loads(receipt.read_text())["parity"]["comparison"]
    assert cmp == out["comparison"]
    for mode in ("response_only", "shared_prefix"):
        assert cmp[mode]["logprob_max_abs_diff"] <= 1e-5 and cmp[mode]["loss_abs_diff"] <= 1e-6, (mode, cmp[mode])
    shared = cmp["shared_prefix"]["families"]
    assert all(v["rel_l2"] <= 1e-5 and v["cosine"] >= 0.999999 for v in shared.values()), shared
    ro = cmp["response_only"]["families"]
    assert ro["unembed"]["rel_l2"] <= 1e-6
    assert ro["attention"]["rel_l2"] > 1e-4  # the prompt-side gradient response_only drops
    print("\nparity (tiny policy, P=256):", json.dumps({m: cmp[m]["families"]["all"] for m in cmp}))


def test_32k_parity_config():
    c = _load("32k_parity")
    assert c.data.prompt_tokens == 32_768 and tuple(c.parity.modes) == ("conventional", "response_only",
                                                                         "shared_prefix")
    c.model.checkpoint = "random"
    plan = check_config(c)
    assert len(plan.prompts[0]) == 32_768 and plan.model_cfg.num_hidden_layers == 78


def test_parity_rejects_unknown_modes(tmp_path):
    c = _load("tiny")
    c.parity.modes = ("conventional", "fast")
    with pytest.raises(ConfigError, match="parity.modes"):
        run_parity(c, tmp_path / "w", log=lambda msg: None)
    assert not (tmp_path / "w").exists()
