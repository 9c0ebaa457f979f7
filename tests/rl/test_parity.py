"""Parity mode: the three gradient modes on one real rollout group of the embedded policy."""

import json
from pathlib import Path

import numpy as np
import pytest

from glm52_jax.evidence import verify
from glm52_jax.rl.inputs import resolve
from glm52_jax.rl.parity import run_parity
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


# ~90 s; the gradient modes on both meshes vs one device run in CI: tests/parallel/test_sharded_rl.py
@pytest.mark.slow
def test_parity_on_a_mesh_matches_one_device(parity, tmp_path):
    """context 4 x expert 2 on the 8 CPU devices: the same rollout fixture (tokens, rewards), and every
    mode's loss and gradient comparison as on one device, to float32 reduction order."""
    workdir, one = parity
    out = run_parity(config_spec("tiny", mesh="context=4,expert=2"), tmp_path / "w", log=lambda msg: None)
    receipt = json.loads(Path(out["receipt"]).read_text())
    assert verify(Path(out["receipt"])) == []
    assert receipt["topology"] == {"mesh": "DP1/TP1/CP4/EP2/PP1", "mesh_devices": 8, "processes": 1}
    one_receipt = json.loads((workdir / "evidence" / "parity" / "receipt.json").read_text())
    assert receipt["fixture"] == one_receipt["fixture"]
    for name in ("responses.npy", "response_mask.npy", "prompt_token_ids.npy"):
        np.testing.assert_array_equal(np.load(Path(out["receipt"]).parent / "artifacts" / name),
                                      np.load(workdir / "evidence" / "parity" / "artifacts" / name), err_msg=name)
    for mode, want in one["comparison"].items():
        got = out["comparison"][mode]
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5, err_msg=mode)
        assert got["logprob_max_abs_diff"] <= 1e-5 and got["loss_abs_diff"] <= 1e-6, (mode, got)
        for family, metrics in want["families"].items():
            if metrics["cosine"] is not None:
                assert abs(got["families"][family]["cosine"] - metrics["cosine"]) <= 1e-5, (mode, family)
