"""`model.init_adapter` from a Megatron LoRA state dict (`checkpoint/init_adapter.py`): the same adapter given as a
PEFT directory and as Megatron files (safetensors and torch, sequential and grouped experts) loads the same arrays
bit for bit; malformed files are one-line errors naming the problem and the fix, before any model is built.
Through the run's own path (resolve + build_policy): tests/rl/test_policy.py."""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm52_jax.checkpoint.init_adapter import check_init_adapter, load_init_adapter
from glm52_jax.checkpoint.megatron import MegatronLayout, to_megatron
from glm52_jax.checkpoint.peft import save_peft_adapter
from glm52_jax.checkpoint.safetensors_io import write_safetensors
from glm52_jax.model.lora import LoRA
from glm52_jax.model.transformer import GlmMoeDsa
from glm52_jax.rl import settings
from glm52_jax.rl.inputs import init_adapter_record, resolve
from glm52_jax.run_config import ConfigError
from tests.run_helpers import config_spec

SEQUENTIAL, GROUPED = MegatronLayout("sequential", False), MegatronLayout("grouped", True)


def _lora(model) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, LoRA))}


def _abstract(spec):
    opts = dataclasses.replace(settings.model_options(spec.model), lora=settings.lora_config(spec.model))
    return nnx.eval_shape(lambda: GlmMoeDsa(resolve(spec, data=False).model_cfg, opts, rngs=nnx.Rngs(0)))


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """The embedded policy's abstract base with random A and B; the adapter written as PEFT and as Megatron
    files. Returns (paths by name, the LoRA arrays, the Megatron dict in the sequential layout)."""
    graphdef, state = nnx.split(_abstract(config_spec("tiny")))
    rng = np.random.default_rng(7)
    flat = [(p, v.replace(jnp.asarray(0.05 * rng.standard_normal(v.get_value().shape), v.get_value().dtype))
             if isinstance(v, LoRA) else v) for p, v in nnx.to_flat_state(state)]
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    root = tmp_path_factory.mktemp("init_adapter")
    save_peft_adapter(model, root / "peft")
    sequential = to_megatron(model, SEQUENTIAL, base=False)
    write_safetensors(root / "sequential.safetensors", sorted(sequential.items()))
    grouped = to_megatron(model, GROUPED, base=False)
    write_safetensors(root / "grouped.safetensors", sorted(grouped.items()))
    torch = pytest.importorskip("torch")
    torch.save({"model": {k: torch.from_numpy(np.array(v)) for k, v in grouped.items()}}, root / "grouped.pt")
    paths = {name: root / name for name in ("peft", "sequential.safetensors", "grouped.safetensors", "grouped.pt")}
    return paths, _lora(model), sequential


@pytest.fixture(scope="module")
def base():
    """The abstract embedded policy to load every adapter into (loading replaces the adapters, the base stays
    abstract: nothing is compiled)."""
    return _abstract(config_spec("tiny"))


@pytest.mark.parametrize("name", ["sequential.safetensors", "grouped.safetensors", "grouped.pt"])
def test_megatron_lora_loads_as_the_peft_adapter(adapters, base, name):
    paths, want, _ = adapters
    peft = _lora(load_init_adapter(base, paths["peft"]))
    got = _lora(load_init_adapter(base, paths[name]))
    assert got.keys() == want.keys() == peft.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]) and np.array_equal(got[k], peft[k])


def _error(spec_changes: dict, path) -> str:
    spec = config_spec("tiny", **{"model.init_adapter": str(path), **spec_changes})
    with pytest.raises(ConfigError) as info:
        init_adapter_record(spec, resolve(spec, data=False).model_cfg)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"--config.model.init_adapter={path}: {path}: ")
    return message.removeprefix(f"--config.model.init_adapter={path}: {path}: ")


def test_malformed_megatron_loras_are_one_line_errors(adapters, tmp_path):
    paths, _, sd = adapters
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    assert _error({}, garbage).startswith("not a readable Megatron LoRA state dict (")

    with_base = tmp_path / "with_base.safetensors"
    write_safetensors(with_base, sorted({**sd, "decoder.final_layernorm.weight": np.ones(64, np.float32)}.items()))
    assert _error({}, with_base) == ("holds tensors that are no LoRA adapter (decoder.final_layernorm.weight): pass "
                                     "a state dict of the adapters only (Megatron-Bridge names, "
                                     "`<module>.adapter.linear_in.weight`)")

    assert _error({"model.lora_rank": 4}, paths["sequential.safetensors"]) == (
        "the adapters' rank is 8, the run's LoRA needs 4 (set --config.model.lora_rank)")

    message = _error({"model.lora_families": ("attention", "routed_experts")}, paths["sequential.safetensors"])
    assert message.startswith("has adapters the run does not train (decoder.layers.0.mlp.linear_fc1.adapter."
                              "adapter_gate.linear_in.weight and ") and message.endswith(
        "; --config.model.lora_families=attention,routed_experts)")

    dropped = sorted(sd)[0]
    missing = tmp_path / "missing.safetensors"
    write_safetensors(missing, sorted((k, v) for k, v in sd.items() if k != dropped))
    assert _error({}, missing).startswith(f"lacks adapters the run trains ({dropped};")

    name = "decoder.layers.1.self_attention.linear_proj.adapter.linear_out.weight"
    transposed = tmp_path / "transposed.safetensors"
    write_safetensors(transposed, sorted({**sd, name: np.zeros((8, 64), np.float32)}.items()))
    assert _error({}, transposed) == f"tensor {name} has shape [8, 64], the model's adapter needs [64, 8]"

    fused = {k: v for k, v in sd.items() if not k.startswith("decoder.layers.0.mlp.linear_fc1.")}
    fused["decoder.layers.0.mlp.linear_fc1.adapter.linear_in.weight"] = np.zeros((8, 64), np.float32)
    fused["decoder.layers.0.mlp.linear_fc1.adapter.linear_out.weight"] = np.zeros((256, 8), np.float32)
    plain = tmp_path / "plain_lora.safetensors"
    write_safetensors(plain, sorted(fused.items()))
    assert "is a plain-LoRA adapter on the fused linear_fc1" in _error({}, plain)


def test_a_pickle_that_is_no_tensor_dict_is_refused(tmp_path):
    torch = pytest.importorskip("torch")

    class Evil:
        def __reduce__(self):
            return (exec, (f"open({os.fspath(tmp_path / 'pwned')!r}, 'w').write('ran')",))

    path = tmp_path / "evil.pt"
    torch.save({"x.adapter.linear_in.weight": Evil()}, path)
    assert _error({}, path).startswith("not a readable Megatron LoRA state dict (")
    assert not (tmp_path / "pwned").exists()


def test_a_missing_path_names_both_formats(tmp_path):
    with pytest.raises(ValueError, match="no such file or directory .expected a PEFT adapter directory, as "
                                         "--mode=export writes under peft/, or a Megatron LoRA state dict file.$"):
        check_init_adapter(_abstract(config_spec("tiny")), tmp_path / "nowhere")
