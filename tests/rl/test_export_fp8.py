"""`--mode=export` of a run on an FP8 base (`rl/export.py`): merged/ dequantized in model.dtype by default, and
re-quantized with the base's quantization_config under `export.merged_fp8`; the PEFT adapter the same either way.

The base is the embedded tiny policy quantized by the tests' block rule (`tests/fp8_checkpoint.py`, blocks
32 x 16: partial blocks on q_a's 48 rows); a committed step holds random adapters (every B nonzero). What is
written is checked number by number in tests/checkpoint/test_hf_fp8_save.py (fast); here the run's wiring.
"""

from __future__ import annotations

import json

import fp8_checkpoint as fc
import jax
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from glm52_jax.checkpoint.safetensors_io import SafetensorsFile
from glm52_jax.checkpoint.train_state import RunCheckpoints, RunState
from glm52_jax.config import ModelConfig
from glm52_jax.model.lora import LoRA
from glm52_jax.rl.export import export_run, fp8_export_config
from glm52_jax.rl.inputs import resolve
from glm52_jax.rl.policy import build_policy
from glm52_jax.run_config import EMBEDDED_POLICY, ConfigError
from tests.run_helpers import config_spec

BLOCK = (32, 16)


def _fp8_base(root) -> str:
    cfg = ModelConfig.from_json_file(EMBEDDED_POLICY / "config.json")
    tensors = safetensors.numpy.load_file(EMBEDDED_POLICY / "model.safetensors")
    return fc.write(root / "base", cfg, fc.fp8_tensors(tensors, BLOCK), fc.quant_config(BLOCK))


@pytest.mark.slow  # 27 s on 2 cores (three policy builds); the saves themselves: test_hf_fp8_save.py
def test_export_of_an_fp8_run_plain_and_fp8(tmp_path):
    spec = config_spec("tiny", **{"model.checkpoint": _fp8_base(tmp_path)})
    assert fp8_export_config(spec.replace(**{"export.merged_fp8": True})) == fc.quant_config(BLOCK)
    model, optimizer = build_policy(spec, resolve(spec, data=False))
    rng = np.random.default_rng(0)
    nnx.update(model, jax.tree.map(lambda x: (rng.standard_normal(x.shape) * 0.05).astype(x.dtype),
                                   nnx.state(model, LoRA)))
    ckpts = RunCheckpoints(tmp_path / "run" / "checkpoints")
    ckpts.save(model, optimizer, RunState(step=1, rng=jax.random.key(0), cursor=0, optimizer_steps=1,
                                          meta={"config_sha256": spec.resume_sha256(), "base": spec.model.base_name}))
    ckpts.close()
    plain = export_run(spec, tmp_path / "run", export_dir=tmp_path / "plain")
    quantized = export_run(spec.replace(**{"export.merged_fp8": True}), tmp_path / "run",
                           export_dir=tmp_path / "fp8")
    assert "merged_quantization" not in plain and quantized["merged_quantization"] == fc.quant_config(BLOCK)
    plain_dir, fp8_dir = tmp_path / "plain" / "merged", tmp_path / "fp8" / "merged"
    assert "quantization_config" not in json.loads((plain_dir / "config.json").read_text())
    assert json.loads((fp8_dir / "config.json").read_text())["quantization_config"] == fc.quant_config(BLOCK)
    want = safetensors.numpy.load_file(plain_dir / "model.safetensors")
    got = SafetensorsFile(fp8_dir / "model.safetensors")
    assert {a.dtype for a in want.values()} == {np.dtype(np.float32)}  # model.dtype of the tiny config
    scaled = sorted(n[:-len("_scale_inv")] for n in got.keys() if n.endswith("_scale_inv"))
    assert scaled and scaled == sorted(n for n in want if fc.is_quantized(n) and "weights_proj" not in n)
    for name in scaled:  # the run's float32 merge, quantized by the tests' rule
        values, scales = fc.quantize(want[name], BLOCK)
        np.testing.assert_array_equal(got.get(name).view(np.uint8), values.view(np.uint8), err_msg=name)
        np.testing.assert_array_equal(got.get(name + "_scale_inv"), scales, err_msg=name)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (tmp_path / "plain" / "peft" / name).read_bytes() == (tmp_path / "fp8" / "peft" / name).read_bytes()


def test_merged_fp8_needs_an_fp8_base(tmp_path):
    with pytest.raises(ConfigError, match=r"export.merged_fp8=True: the base model \(.*tiny_policy\) is not an FP8 "
                                          r"checkpoint \(its config.json has no quantization_config\)") as err:
        fp8_export_config(config_spec("tiny", **{"export.merged_fp8": True}))
    assert "\n" not in str(err.value)
    assert fp8_export_config(config_spec("tiny")) is None
    fp8_spec = config_spec("tiny", **{"model.checkpoint": _fp8_base(tmp_path), "export.merged_fp8": True})
    assert fp8_export_config(fp8_spec) == fc.quant_config(BLOCK)
