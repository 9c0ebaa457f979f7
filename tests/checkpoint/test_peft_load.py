"""Reading a PEFT adapter back (`checkpoint/peft_load.py`): the exact inverse of `save_peft_adapter`.

The model is tiny and float32, its base and every LoRA A and B random (numpy values merged into an abstract
model, no XLA compile of an init); 5 layers give a dense layer and a two-layer [full, shared] stack, so the
unstacked (lm_head), one-layer and stacked layouts, kv_b's split and the routed experts' fused gate_up are
all read back. Mismatches are checked on abstract models (nothing loaded or compiled).
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm52_jax import config
from glm52_jax.checkpoint.peft import save_peft_adapter
from glm52_jax.checkpoint.peft_load import AdapterMismatchError, check_peft_adapter, load_peft_adapter
from glm52_jax.checkpoint.safetensors_io import SafetensorsFile, write_safetensors
from glm52_jax.model.lora import LoRA, LoRAConfig
from glm52_jax.model.options import ModelOptions
from glm52_jax.model.transformer import GlmMoeDsa

CFG = config.tiny(num_hidden_layers=5, indexer_types=config.derive_indexer_types(5, freq=2, offset=2))
LORA = LoRAConfig(rank=3, alpha=6.0)
PREFIX = "base_model.model."


def _abstract(lora: LoRAConfig = LORA) -> GlmMoeDsa:
    return nnx.eval_shape(lambda: GlmMoeDsa(CFG, ModelOptions(param_dtype=jnp.float32, lora=lora),
                                            rngs=nnx.Rngs(0)))


def _random(seed: int) -> GlmMoeDsa:
    """Every array of the model (base and adapters) standard-normal * 0.1 from numpy's `seed`."""
    graphdef, state = nnx.split(_abstract())
    rng = np.random.default_rng(seed)
    flat = [(p, v.replace(jnp.asarray(0.1 * rng.standard_normal(v.get_value().shape), v.get_value().dtype)))
            for p, v in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _lora(model) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, LoRA))}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(the model whose adapters were saved, the adapter directory)."""
    model = _random(0)
    path = tmp_path_factory.mktemp("peft") / "adapter"
    save_peft_adapter(model, path)
    return model, path


def test_save_then_load_is_bit_identical(saved, tmp_path):
    model, path = saved
    other = _random(1)  # another base and other adapters: only the adapters are replaced
    loaded = load_peft_adapter(other, path)
    want, got = _lora(model), _lora(loaded)
    assert got.keys() == want.keys() and len(want) > 20
    for key in want:
        assert got[key].dtype == want[key].dtype and np.array_equal(got[key], want[key]), key
    for (p, base), (_, kept) in zip(nnx.to_flat_state(nnx.state(other, nnx.Param)),
                                    nnx.to_flat_state(nnx.state(loaded, nnx.Param))):
        assert kept.get_value() is base.get_value(), p  # the base arrays are shared, not copied
    # Saving the loaded adapters writes the same bytes again.
    save_peft_adapter(loaded, tmp_path / "again")
    assert (tmp_path / "again" / "adapter_model.safetensors").read_bytes() == \
        (path / "adapter_model.safetensors").read_bytes()


def _rewrite(src, dst, edit):
    """A copy of adapter `src` in `dst` with its tensors passed through `edit({name: array})`."""
    shutil.copytree(src, dst)
    f = SafetensorsFile(src / "adapter_model.safetensors")
    tensors = edit({n: np.array(f.get(n)) for n in f.keys()})
    write_safetensors(dst / "adapter_model.safetensors", sorted(tensors.items()))
    return dst


def _one_line(info) -> str:
    message = str(info.value)
    assert "\n" not in message
    return message


def test_config_mismatches_name_the_file_and_the_difference(saved):
    _, path = saved
    with pytest.raises(AdapterMismatchError) as info:
        check_peft_adapter(_abstract(dataclasses.replace(LORA, rank=2, alpha=4.0)), path)
    assert _one_line(info) == f"{path / 'adapter_config.json'}: r is 3, the run's LoRA needs 2"
    with pytest.raises(AdapterMismatchError) as info:
        check_peft_adapter(_abstract(dataclasses.replace(LORA, alpha=12.0)), path)
    assert _one_line(info) == f"{path / 'adapter_config.json'}: lora_alpha is 6, the run's LoRA needs 12"
    families = frozenset(LORA.families - {"unembed"})
    with pytest.raises(AdapterMismatchError) as info:
        check_peft_adapter(_abstract(dataclasses.replace(LORA, families=families)), path)
    assert _one_line(info) == (f"{path / 'adapter_config.json'}: target_modules has ['lm_head'] the run does not "
                               "adapt (model.lora_families differ)")
    with pytest.raises(AdapterMismatchError) as info:
        check_peft_adapter(_abstract(), path / "missing")
    assert _one_line(info).startswith(f"{path / 'missing' / 'adapter_config.json'}: no such file")


def test_tensor_mismatches_name_the_tensor(saved, tmp_path):
    _, path = saved
    weights = "adapter_model.safetensors"
    name = PREFIX + "model.layers.3.self_attn.kv_b_proj.lora_B.weight"
    gone = _rewrite(path, tmp_path / "gone", lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(AdapterMismatchError) as info:
        check_peft_adapter(_abstract(), gone)
    assert _one_line(info) == f"{gone / weights}: lacks tensor {name}"
    cut = _rewrite(path, tmp_path / "cut", lambda t: {**t, name: t[name][:-1]})
    with pytest.raises(AdapterMismatchError) as info:
        check_peft_adapter(_abstract(), cut)
    want = list(SafetensorsFile(path / weights).tensors[name].shape)
    assert _one_line(info) == (f"{cut / weights}: tensor {name} has shape {[want[0] - 1, want[1]]}, the model's "
                               f"adapter needs {want}")
    extra = _rewrite(path, tmp_path / "extra", lambda t: {**t, PREFIX + "model.norm.lora_A.weight": t[name]})
    with pytest.raises(AdapterMismatchError) as info:
        check_peft_adapter(_abstract(), extra)
    assert _one_line(info) == f"{extra / weights}: has tensor {PREFIX}model.norm.lora_A.weight the model has no " \
                              "adapter for"


def test_coupled_gate_up_block_is_refused(saved, tmp_path):
    """An expert's fused gate_up B with a nonzero off-diagonal block has no gate/up adapter pair."""
    model, path = saved
    name = PREFIX + "model.layers.1.mlp.experts.base_layer.lora_B.weight"  # [2I, 2r*E]

    def couple(t):
        b = t[name].copy()
        b[0, -1] = 1.0  # gate row 0, last column: rank index 2r-1 (the up half) of the last expert
        return {**t, name: b}

    coupled = _rewrite(path, tmp_path / "coupled", couple)
    with pytest.raises(AdapterMismatchError) as info:
        load_peft_adapter(model, coupled)
    assert _one_line(info) == (f"{coupled / 'adapter_model.safetensors'}: model.layers.1.mlp.experts.base_layer"
                               ".lora_B.weight couples the gate and up projections (nonzero off-diagonal blocks); "
                               "separate gate/up adapters cannot represent it")
    assert json.loads((coupled / "adapter_config.json").read_text())["rank_pattern"]  # routed experts present
