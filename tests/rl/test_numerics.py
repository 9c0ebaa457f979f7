"""Non-finite numbers stop a step before anything is committed (`rl/numerics.py`), as one launcher line."""

import numpy as np
import pytest

from glm52_jax.launch import _one_line
from glm52_jax.rl.numerics import NonFiniteError, all_finite, check_sampled


def test_a_nan_sampled_log_prob_stops_the_step_naming_where():
    logprobs = np.array([[-1.0, -2.0, 0.0], [-0.5, np.nan, np.nan]], np.float32)  # [G=2, R=3]
    check_sampled("step 1 candidate 0", logprobs, np.array([2, 1]))  # the NaNs lie past sample 1's end
    with pytest.raises(NonFiniteError, match=r"^step 1 candidate 0: non-finite sampling log-prob \(nan\) at sample 1 "
                                             r"token 1 \(2 such tokens\): .* stopped before anything was committed$"):
        check_sampled("step 1 candidate 0", logprobs, np.array([2, 3]))


def test_the_receipts_finite_covers_every_array():
    good = {"loss": 0.5, "old_logprobs": np.zeros((2, 3)), "rewards": [1.0, -1.0]}
    assert all_finite(good)
    assert not all_finite({**good, "old_logprobs": np.array([[0.0, np.nan]])})
    assert not all_finite({**good, "rewards": [1.0, float("inf")]})


def test_the_launcher_says_numerics_error():
    assert _one_line(NonFiniteError("step 1 candidate 0: x")) == "numerics error: step 1 candidate 0: x"


@pytest.mark.slow  # ~60 s loaded: a launcher loads the policy and samples one candidate
def test_a_nan_weight_stops_the_run_before_any_commit(tmp_path):
    """The new user's case: NaN in layer 1's q_b_proj. The run stops at the first candidate with one
    `numerics error:` line naming it; no checkpoint and no receipt are committed, so the rerun with a fixed
    checkpoint may change the settings."""
    import shutil
    import subprocess
    import sys

    from safetensors.numpy import load_file, save_file

    from glm52_jax.run_config import EMBEDDED_POLICY
    from glm52_jax.workdir import has_committed_work
    from tests.run_helpers import ROOT

    ckpt = shutil.copytree(EMBEDDED_POLICY, tmp_path / "nan_policy")
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.1.self_attn.q_b_proj.weight"][0, 0] = np.nan
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    workdir = tmp_path / "w"
    done = subprocess.run([sys.executable, "-m", "glm52_jax.launch", f"--config.model.checkpoint={ckpt}",
                           f"--workdir={workdir}", "--config.train.steps=1"], capture_output=True, text=True,
                          timeout=900, cwd=ROOT)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and last.startswith("numerics error: step 1 candidate 0: non-finite sampling "
                                                    "log-prob (nan) at sample 0 token 0"), done.stderr[-3000:]
    assert not has_committed_work(workdir) and not (workdir / "checkpoints" / "1").exists()
