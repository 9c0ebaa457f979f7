"""The policy a run trains (`rl/policy.py`): fresh adapters, or those of `model.init_adapter` (a PEFT adapter
directory as --mode=export writes it, or the same adapter as a Megatron LoRA state dict), checked in `resolve`
before any model is built."""

from __future__ import annotations

import dataclasses
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm52_jax.checkpoint.megatron import MegatronLayout, to_megatron
from glm52_jax.checkpoint.peft import save_peft_adapter
from glm52_jax.checkpoint.safetensors_io import write_safetensors
from glm52_jax.model.lora import LoRA
from glm52_jax.model.transformer import GlmMoeDsa
from glm52_jax.rl import settings
from glm52_jax.rl.inputs import resolve
from glm52_jax.rl.policy import build_policy
from glm52_jax.run_config import ConfigError
from tests.run_helpers import config_spec


def _lora(model) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, LoRA))}


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """(adapter directory, its LoRA arrays): random A and B on the abstract embedded policy (save_peft_adapter
    reads only the adapters, so the base stays abstract and nothing is compiled). The same adapter as a Megatron
    LoRA state dict lies beside it (`megatron_lora.safetensors`, Megatron-Bridge names, sequential experts)."""
    spec = config_spec("tiny")
    opts = dataclasses.replace(settings.model_options(spec.model), lora=settings.lora_config(spec.model))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: GlmMoeDsa(resolve(spec, data=False).model_cfg, opts,
                                                                 rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(3)
    flat = [(p, v.replace(jnp.asarray(0.05 * rng.standard_normal(v.get_value().shape), v.get_value().dtype))
             if isinstance(v, LoRA) else v) for p, v in nnx.to_flat_state(state)]
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    path = tmp_path_factory.mktemp("init") / "adapter"
    save_peft_adapter(model, path)
    write_safetensors(path.parent / "megatron_lora.safetensors",
                      sorted(to_megatron(model, MegatronLayout("sequential", False), base=False).items()))
    return path, _lora(model)


def test_init_adapter_seeds_the_policy(adapter):
    from glm52_jax.rl.transaction import receipt_fields

    path, want = adapter
    spec = config_spec("tiny", **{"model.init_adapter": str(path)})
    inputs = resolve(spec)
    digest = hashlib.sha256((path / "adapter_model.safetensors").read_bytes()).hexdigest()
    assert inputs.init_adapter == {"path": str(path.resolve()), "sha256": digest}
    seeded, optimizer = build_policy(spec, inputs)
    got = _lora(seeded)
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    assert optimizer.step == 0
    # The adapters act: the last prompt position's logits differ from the fresh policy's (B = 0: the base).
    graphdef, lora, rest = nnx.split(seeded, LoRA, ...)
    fresh_lora = nnx.from_flat_state([(p, v.replace(jnp.zeros_like(v.get_value())) if p[-1] in ("b", "b_k", "b_v")
                                       else v) for p, v in nnx.to_flat_state(lora)])
    logits = jax.jit(lambda lora, ids: nnx.merge(graphdef, lora, rest)(ids)[0, -1])
    ids = np.asarray(inputs.first_prompts[0][-16:], np.int32)[None]
    diff = np.abs(np.asarray(logits(lora, ids)) - np.asarray(logits(fresh_lora, ids))).max()
    assert diff > 1e-3, diff
    # The receipt's model section names the adapter and its hash.
    fields = receipt_fields(inputs, seeded.cfg, step=1, cursor=0, candidates=[], samples=[], accepted=None,
                            training={}, numerics={}, cleanup={}, traces=[], probe=None, rank_paths=[])
    assert fields["model"]["init_adapter"] == {"path": str(path.resolve()), "sha256": digest}


def test_a_megatron_lora_starts_the_run_the_peft_adapter_starts(adapter):
    """The same adapter as a Megatron LoRA file: resolve checks it and records its hash, build_policy seeds the
    policy with the PEFT directory's arrays bit for bit (tests/checkpoint/test_init_adapter.py: every layout and
    file kind, and the errors)."""
    path, want = adapter
    path = path.parent / "megatron_lora.safetensors"
    spec = config_spec("tiny", **{"model.init_adapter": str(path)})
    inputs = resolve(spec)
    assert inputs.init_adapter == {"path": str(path.resolve()), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    seeded, optimizer = build_policy(spec, inputs)
    got = _lora(seeded)
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    assert optimizer.step == 0


def test_an_adapter_of_another_lora_config_fails_in_resolve(adapter):
    path, _ = adapter
    with pytest.raises(ConfigError) as info:
        resolve(config_spec("tiny", **{"model.init_adapter": str(path), "model.lora_rank": 4}))
    assert str(info.value) == f"--config.model.init_adapter={path}: {path / 'adapter_config.json'}: r is 8, the " \
                              "run's LoRA needs 4"
    with pytest.raises(ConfigError) as info:
        resolve(config_spec("tiny", **{"model.init_adapter": str(path),
                                       "model.lora_families": ("attention", "routed_experts")}))
    assert str(info.value).startswith(f"--config.model.init_adapter={path}: {path / 'adapter_config.json'}: "
                                      "target_modules has ['lm_head'] the run does not adapt")


@pytest.mark.slow  # ~70 s (build_policy's eager adapter init, the inventory and the step compile); fast variant:
# tests/rl/test_update.py::test_one_step_on_an_fp8_base_trains_lora_only
def test_fp8_policy_trains_only_its_adapters():
    """`model.base_weights="fp8"` on the embedded (float32) policy: build_policy reads it as its FP8 release (e4m3
    + block scales on every projection), and one GRPO step gives every adapter family a gradient, moves the
    adapters and leaves every base array (e4m3 values and scales included) bit for bit as it was, as the
    transaction's parameter inventory checks it."""
    from glm52_jax.checkpoint.inventory import changed_entries, param_inventory
    from glm52_jax.model import fp8
    from glm52_jax.model.lora import FAMILIES
    from glm52_jax.rl.update import grpo_update

    spec = config_spec("tiny", **{"model.base_weights": "fp8"})
    model, optimizer = build_policy(spec, resolve(spec, data=False))
    base = {k: v.get_value() for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    held = {"/".join(map(str, k)) for k, v in base.items() if isinstance(v, fp8.Fp8Weight)}
    projections = {k for k in base if k[-1] in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "w_uk", "w_uv", "o_proj",
                                                "wq_b", "wk", "gate_proj", "up_proj", "down_proj", "w_gate", "w_up",
                                                "w_down")}
    assert held == {"/".join(map(str, k)) for k in projections}
    before = param_inventory(model)
    assert {name for name in before if name.rsplit("/", 1)[0] in held} == {
        f"{name}/{part}" for name in held for part in ("values", "scales")}
    rng = np.random.default_rng(0)
    p, g, r = 40, 2, 6
    result = grpo_update(model, optimizer, prompt=rng.integers(0, 512, p).astype(np.int32),
                         responses=rng.integers(0, 512, (g, r)).astype(np.int32),
                         response_mask=np.ones((g, r), np.float32),
                         old_logprobs=rng.normal(-6.3, 0.2, (g, r)).astype(np.float32),
                         advantages=np.array([0.7, -0.7], np.float32), mode="shared_prefix")
    assert np.isfinite(float(result.loss)) and float(result.grad_norm) > 0
    # A fresh adapter's B is zero, so its A has no gradient yet: every family's B does.
    families = {path: v.get_metadata()["family"] for path, v in nnx.to_flat_state(nnx.state(model, LoRA))}
    moved = {families[path] for path, v in nnx.to_flat_state(result.grads)
             if path[-1] in ("b", "b_k", "b_v") and np.abs(np.asarray(v.get_value())).max() > 0}
    assert moved == set(FAMILIES)
    changed = changed_entries(before, param_inventory(model))
    assert changed and all("_lora/" in name for name in changed), changed


@pytest.mark.slow  # two one-step runs of the embedded policy (~3 min here); CI variant:
# test_a_megatron_lora_starts_the_run_the_peft_adapter_starts (the same starting arrays, bit for bit)
def test_a_megatron_lora_run_computes_what_the_peft_run_computes(adapter, tmp_path):
    """One transaction from the Megatron LoRA file and one from the PEFT directory: the same receipt (candidates,
    completions, rewards, loss, metrics), the adapter's path and hash aside."""
    from glm52_jax.evidence.publish import result_differences
    from glm52_jax.evidence.receipt import receipt_file
    from glm52_jax.rl.run import run_online

    peft_dir, _ = adapter
    receipts = []
    for name, path in (("peft", peft_dir), ("megatron", peft_dir.parent / "megatron_lora.safetensors")):
        spec = config_spec("tiny", **{"model.init_adapter": str(path), "train.steps": 1})
        run_online(spec, tmp_path / name, log=lambda msg: None)
        receipts.append(receipt_file(tmp_path / name / "evidence" / "step_000001"))
    assert result_differences(*receipts, ignore=("model.init_adapter",)) == []


def test_a_mesh_smaller_than_the_machine_is_named_and_a_larger_one_refused():
    """`--config.mesh=context=3` on 8 devices runs on 3 of them and says that 5 stay idle; a mesh of more
    devices than the run has names a mesh that fits (the mesh may change on a rerun)."""
    from glm52_jax.rl.policy import mesh_line, train_mesh

    mesh_spec, mesh = train_mesh(config_spec("tiny", mesh="context=3"))
    assert mesh.devices.size == 3
    assert mesh_line(mesh_spec) == (f"mesh {mesh_spec.describe()} over 3 cpu devices; 5 of the 8 devices stay idle")
    with pytest.raises(ConfigError, match=r"^--config.mesh=context=16 needs 16 devices, the run has 8 \(cpu\); give a "
                                          r"--config.mesh of 8 devices \(the mesh may change on a rerun\), or on CPU"):
        train_mesh(config_spec("tiny", mesh="context=16"))
