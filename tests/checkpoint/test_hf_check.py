"""A checkpoint's weight files checked before loading (`checkpoint/hf_check.py`): one line naming the file."""

import json
import shutil
import subprocess
import sys

import pytest

from glm52_jax.checkpoint.hf_check import CheckpointFilesError, check_weight_files
from glm52_jax.rl.inputs import check_weights
from glm52_jax.run_config import EMBEDDED_POLICY, ConfigError
from glm52_jax.workdir import saved_settings
from tests.run_helpers import ROOT, config_spec


@pytest.fixture
def policy(tmp_path):
    """A copy of the shipped tiny policy (config.json + model.safetensors)."""
    return shutil.copytree(EMBEDDED_POLICY, tmp_path / "ckpt")


def test_the_shipped_policy_passes(policy):
    assert check_weight_files(policy) > 0


def test_a_truncated_file_is_named(policy):
    weights = policy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointFilesError, match=rf"^{weights}: truncated file: tensor '.*' needs bytes up to \d+ "
                                                   rf"but the file has {len(data) // 2}$"):
        check_weight_files(policy)
    weights.write_bytes(data[:5])
    with pytest.raises(CheckpointFilesError, match=rf"^{weights}: truncated safetensors file \(no header\)$"):
        check_weight_files(policy)


def test_a_corrupt_header_is_named(policy):
    weights = policy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:12] = b"\xff\xfe{{"  # inside the JSON header
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointFilesError, match=rf"^{weights}: corrupt safetensors header: "):
        check_weight_files(policy)


def test_a_directory_without_weights_or_with_a_missing_shard(policy):
    (policy / "model.safetensors").unlink()
    with pytest.raises(CheckpointFilesError, match=r"has config.json but no \*.safetensors weights"):
        check_weight_files(policy)
    (policy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001.safetensors"}}))
    with pytest.raises(CheckpointFilesError, match=r"names 1 missing shard\(s\): model-00001.safetensors$"):
        check_weight_files(policy)
    spec = config_spec("tiny", **{"model.checkpoint": str(policy)})
    with pytest.raises(ConfigError, match=rf"^--config.model.checkpoint={policy}: .*missing shard"):
        check_weights(spec.model)


def test_the_launcher_says_it_in_one_line_and_keeps_no_settings(policy, tmp_path):
    """A directory with config.json but no weights: one config-error line; the corrected rerun on the same
    workdir is not refused (nothing was committed)."""
    (policy / "model.safetensors").unlink()
    workdir = tmp_path / "w"
    done = subprocess.run([sys.executable, "-m", "glm52_jax.launch", f"--config.model.checkpoint={policy}",
                           f"--workdir={workdir}"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    lines = [line for line in done.stderr.strip().splitlines() if "RuntimeWarning" not in line and
             "warnings.warn" not in line]
    assert done.returncode == 1 and lines == [
        f"config error: --config.model.checkpoint={policy}: {policy} has config.json but no *.safetensors weights "
        "(nor model.safetensors.index.json)"], done.stderr
    assert saved_settings(workdir) is None  # the rerun with a fixed checkpoint may change any setting
