"""Parity mode: the three gradient modes on one real rollout group of the embedded policy."""

import json

import pytest

from glm52_jax.evidence import verify
from glm52_jax.rl.inputs import resolve
from glm52_jax.rl.parity import run_parity
from glm52_jax.run_config import ConfigError
from tests.run_helpers import config_spec


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("parity")
    return workdir, run_parity(config_spec("tiny"), workdir, log=lambda msg: None)


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
    assert json.loads((workdir / "config.json").read_text())["config"]["name"] == "online_grpo_tiny"
    print("\nparity (tiny policy, P=256):", json.dumps({m: cmp[m]["families"]["all"] for m in cmp}))


def test_32k_parity_config():
    spec = config_spec("32k_parity", **{"model.checkpoint": "random"})
    assert spec.data.prompt_tokens == 32_768 and spec.parity.modes == ("conventional", "response_only",
                                                                       "shared_prefix")
    inputs = resolve(spec)
    assert len(inputs.first_prompts[0]) == 32_768 and inputs.model_cfg.num_hidden_layers == 78


def test_parity_refuses_a_mesh_before_writing(tmp_path):
    with pytest.raises(ConfigError, match="parity runs on one device so far"):
        run_parity(config_spec("tiny", mesh="folded=8"), tmp_path / "w", log=lambda msg: None)
    assert not (tmp_path / "w").exists()
