"""PEFT adapter export (`checkpoint/peft.py`): real files, loaded by the installed peft onto HF
`GlmMoeDsaForCausalLM` (no mocks of peft or transformers).

One tiny float32 model with random base weights and random nonzero LoRA A and B in every family is
built without any XLA compile (numpy values merged into an abstract model); its base goes to HF
through our `save_pretrained`, its adapters through `save_peft_adapter`, and HF+PEFT logits must
match ours. Single-family exports then check that PEFT adapts exactly the intended modules and
parameters (no over-matching of gate/up/down_proj between dense, shared and routed experts).

Axis letters: L stacked layers, E experts, r rank, B batch, S sequence, V vocab.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

peft = pytest.importorskip("peft")

from glm52_jax import config  # noqa: E402
from glm52_jax.checkpoint import peft as peft_io  # noqa: E402
from glm52_jax.checkpoint.hf import save_pretrained  # noqa: E402
from glm52_jax.checkpoint.safetensors_io import SafetensorsFile  # noqa: E402
from glm52_jax.model.lora import FAMILIES, LoRA, LoRAConfig  # noqa: E402
from glm52_jax.model.options import ModelOptions  # noqa: E402
from glm52_jax.model.transformer import GlmMoeDsa  # noqa: E402

# 5 layers: a dense layer, then a [full, shared] indexer unit stacked twice, so both a one-layer
# stack and a stack with a real leading layers axis (repeat 1 -> layer 3/4) are exported.
CFG = config.tiny(num_hidden_layers=5, indexer_types=config.derive_indexer_types(5, freq=2, offset=2))
# rank 3 differs from every model dim and from 2; alpha/rank = 2 is not 1, so a lost scale shows.
LORA = LoRAConfig(rank=3, alpha=6.0)
OPTS = ModelOptions(param_dtype=jnp.float32, lora=LORA)
SEQ = 40  # above index_topk (32): the indexer really selects
# |HF+PEFT - ours| logits (max |logit| 2.55): measured 2.0e-6 (2026-12-04, printed with `pytest -s`),
# float32 rounding on both sides as in tests/test_parity_hf.py. Bound: ~5x that.
LOGIT_ATOL = 1e-5

ATTENTION = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
DENSE = [i for i, t in enumerate(CFG.mlp_layer_types) if t == "dense"]
SPARSE = [i for i, t in enumerate(CFG.mlp_layer_types) if t == "sparse"]


def _abstract(opts: ModelOptions) -> GlmMoeDsa:
    return nnx.eval_shape(lambda: GlmMoeDsa(CFG, opts, rngs=nnx.Rngs(0)))


def _random_value(path, shape, rng) -> np.ndarray:
    """Base weights as in `hf_reference.random_hf_model` (wide, so logits and routing separate
    clearly); LoRA A and B both random so every adapter's delta is nonzero."""
    name = path[-1]
    if name == "weight":  # only norms have a `weight` (kernels are named after their projection)
        return 1.0 + 0.1 * rng.standard_normal(shape)
    if name in ("bias", "e_score_correction_bias"):
        return 0.1 * rng.standard_normal(shape)
    if name in ("a", "b", "b_k", "b_v"):
        return 0.1 * rng.standard_normal(shape)
    return 0.08 * rng.standard_normal(shape)


def _filled(abstract: GlmMoeDsa, seed: int) -> GlmMoeDsa:
    graphdef, state = nnx.split(abstract)
    rng = np.random.default_rng(seed)  # numpy: no per-shape XLA compile
    flat = [(p, v.replace(jnp.asarray(_random_value(p, v.get_value().shape, rng), v.get_value().dtype)))
            for p, v in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _with_families(model: GlmMoeDsa, families) -> GlmMoeDsa:
    """`model`'s base and those of its adapters that belong to `families` (same arrays, no copy)."""
    opts = dataclasses.replace(OPTS, lora=dataclasses.replace(LORA, families=frozenset(families)))
    graphdef, _, lora = nnx.split(_abstract(opts), nnx.Param, LoRA)
    ours = dict(nnx.to_flat_state(nnx.state(model, LoRA)))
    picked = [(p, ours[p]) for p, _ in nnx.to_flat_state(lora)]
    return nnx.merge(graphdef, nnx.state(model, nnx.Param), nnx.from_flat_state(picked))


@pytest.fixture(scope="module")
def model():
    return _filled(_abstract(OPTS), seed=0)


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(1).integers(0, CFG.vocab_size, size=(1, SEQ)).astype(np.int32)


@pytest.fixture(scope="module")
def hf_base(model, tmp_path_factory):
    """HF model loaded from our `save_pretrained` of the base weights (adapters are not written)."""
    path = tmp_path_factory.mktemp("base")
    save_pretrained(model, path)
    hf, info = transformers.GlmMoeDsaForCausalLM.from_pretrained(os.fspath(path), dtype=torch.float32,
                                                                 output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return hf.eval()


@pytest.fixture(scope="module")
def export_dir(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("exports") / "adapter"
    peft_io.save_peft_adapter(model, path, base_model_name_or_path="zai-org/GLM-5.2")
    return path


def _load_peft(hf_base, path):
    """A fresh PEFT-wrapped copy of the HF base (PEFT injects its layers in place)."""
    with warnings.catch_warnings():
        # peft checks rank/alpha_pattern keys against module names only; ours name a parameter
        # (mlp.experts.gate_up_proj) and are applied there, which the adapted-set test verifies.
        warnings.filterwarnings("ignore", message=".*_pattern keys did not match any targeted module")
        return peft.PeftModel.from_pretrained(copy.deepcopy(hf_base), os.fspath(path)).eval()


def _hf_logits(m, ids) -> np.ndarray:
    with torch.no_grad():
        return m(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()


def _adapted(peft_model) -> set[str]:
    """What PEFT adapted: module names (lora.Linear) and `module.param` (ParamWrapper)."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    out = set()
    for name, mod in peft_model.base_model.model.named_modules():
        if isinstance(mod, LoraLayer):
            name = name.replace(".base_layer", "")  # nested ParamWrappers on one module
            out.add(f"{name}.{mod.parameter_name}" if isinstance(mod, ParamWrapper) else name)
    return out


def _expected_adapted(family: str) -> set[str]:
    if family == "attention":
        return {f"model.layers.{i}.self_attn.{p}" for i in range(CFG.num_hidden_layers) for p in ATTENTION}
    if family == "dense_mlp":
        return {f"model.layers.{i}.mlp.{p}.weight" for i in DENSE for p in MLP}
    if family == "shared_expert":
        return {f"model.layers.{i}.mlp.shared_experts.{p}.weight" for i in SPARSE for p in MLP}
    if family == "routed_experts":
        return {f"model.layers.{i}.mlp.experts.{p}" for i in SPARSE for p in ("gate_up_proj", "down_proj")}
    assert family == "unembed"
    return {"lm_head"}


# ------------------------------------------------------------------------------------------------
# 1. Logits: HF + PEFT == ours, with every family adapted.


def test_peft_logits_match_ours(model, hf_base, export_dir, ids):
    graphdef, state = nnx.split(model)
    ours = np.asarray(jax.jit(lambda s: nnx.merge(graphdef, s)(jnp.asarray(ids)))(state))
    wrapped = _load_peft(hf_base, export_dir)
    got = _hf_logits(wrapped, ids)
    with wrapped.disable_adapter():
        base = _hf_logits(wrapped, ids)
    diff = float(np.abs(got - ours).max())
    print(f"max |HF+PEFT - ours| logits: {diff:.3g} (max |logit| {np.abs(ours).max():.3g}); adapters move logits "
          f"by {np.abs(got - base).max():.3g}")
    assert np.abs(got - base).max() > 0.1, "the adapters should change the logits clearly"
    assert diff <= LOGIT_ATOL, f"max |logit diff| {diff:.3g}"
    # Everything in the file reached PEFT's layers (none left at PEFT's own init).
    assert _adapted(wrapped) == set().union(*(_expected_adapted(f) for f in FAMILIES))
    _assert_loaded_exactly(wrapped, export_dir)


def _assert_loaded_exactly(wrapped, path):
    st = SafetensorsFile(os.path.join(path, peft_io.ADAPTER_WEIGHTS))
    # PEFT also returns lm_head's base weight (it treats lm_head like an embedding); only LoRA counts.
    loaded = {k: v for k, v in peft.get_peft_model_state_dict(wrapped).items() if ".lora_" in k}
    assert sorted(loaded) == sorted(st.keys())
    for k, v in loaded.items():
        np.testing.assert_array_equal(v.numpy(), st.get(k).astype(np.float32), err_msg=k)


# ------------------------------------------------------------------------------------------------
# 2. Each family alone adapts exactly its own modules / parameters.


@pytest.mark.parametrize("family", FAMILIES)
def test_single_family_adapts_exactly_its_targets(model, hf_base, family, tmp_path):
    # Matters most for gate/up/down_proj, which exist in dense MLPs, shared experts and (fused) routed
    # experts: peft's glm_moe_dsa conversion would turn a module target `...gate_proj` into the routed
    # experts' gate_up_proj, so a dense-only export must not touch shared or routed experts.
    sub = _with_families(model, {family})
    peft_io.save_peft_adapter(sub, tmp_path / "a")
    wrapped = _load_peft(hf_base, tmp_path / "a")
    assert _adapted(wrapped) == _expected_adapted(family)
    _assert_loaded_exactly(wrapped, tmp_path / "a")


def test_bf16_adapters_are_written_as_bf16(model, hf_base, tmp_path):
    # Adapters stored in bfloat16 are exported as BF16 tensors (no silent upcast); PEFT casts them
    # to the base model's dtype on load, so the loaded values are the file's, exactly.
    lora = dataclasses.replace(LORA, param_dtype=jnp.bfloat16)
    graphdef, _, _ = nnx.split(_abstract(dataclasses.replace(OPTS, lora=lora)), nnx.Param, LoRA)
    bf16 = [(p, v.replace(jnp.asarray(np.asarray(v.get_value()).astype(jnp.bfloat16))))  # numpy: no compile
            for p, v in nnx.to_flat_state(nnx.state(model, LoRA))]
    m = nnx.merge(graphdef, nnx.state(model, nnx.Param), nnx.from_flat_state(bf16))
    peft_io.save_peft_adapter(m, tmp_path / "a")
    st = SafetensorsFile(tmp_path / "a" / peft_io.ADAPTER_WEIGHTS)
    assert {st.tensors[k].dtype for k in st.keys()} == {"BF16"}
    _assert_loaded_exactly(_load_peft(hf_base, tmp_path / "a"), tmp_path / "a")


# ------------------------------------------------------------------------------------------------
# 3. adapter_config.json.


def test_adapter_config_contents(export_dir):
    assert sorted(os.listdir(export_dir)) == [peft_io.ADAPTER_CONFIG, peft_io.ADAPTER_WEIGHTS]
    with open(export_dir / peft_io.ADAPTER_CONFIG) as f:
        cfg = json.load(f)
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
    assert cfg["r"] == 3 and cfg["lora_alpha"] == 6
    assert cfg["base_model_name_or_path"] == "zai-org/GLM-5.2"
    assert cfg["target_modules"] == sorted(ATTENTION + ("lm_head",))
    assert cfg["target_parameters"] == sorted(
        ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        + [f"mlp.{p}.weight" for p in MLP] + [f"mlp.shared_experts.{p}.weight" for p in MLP])
    # gate+up fuse into one rank-2r adapter with alpha doubled, keeping the scaling at alpha/r.
    assert cfg["rank_pattern"] == {r"mlp\.experts\.gate_up_proj": 6}
    assert cfg["alpha_pattern"] == {r"mlp\.experts\.gate_up_proj": 12}
    assert (cfg["lora_dropout"], cfg["bias"], cfg["fan_in_fan_out"], cfg["use_rslora"], cfg["use_dora"]) == \
        (0.0, "none", False, False, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. peft's "Unexpected keyword arguments" for unknown keys
        loaded = peft.LoraConfig.from_pretrained(os.fspath(export_dir))
    assert loaded.r == 3 and loaded.lora_alpha == 6 and loaded.peft_type == peft.PeftType.LORA
    # Shapes per PEFT's 3-D ParamWrapper: A [E*r', in], B [out, r'*E] (r' = 2r for gate_up).
    st = SafetensorsFile(export_dir / peft_io.ADAPTER_WEIGHTS)
    e, d, i = CFG.n_routed_experts, CFG.hidden_size, CFG.moe_intermediate_size
    p = "base_model.model.model.layers.3.mlp.experts."
    assert st.tensors[p + "base_layer.lora_A.weight"].shape == (e * 6, d)
    assert st.tensors[p + "base_layer.lora_B.weight"].shape == (2 * i, 6 * e)
    assert st.tensors[p + "lora_A.weight"].shape == (e * 3, i)
    assert st.tensors[p + "lora_B.weight"].shape == (d, 3 * e)
    h = CFG.num_attention_heads
    kv_b = "base_model.model.model.layers.0.self_attn.kv_b_proj.lora_B.weight"
    assert st.tensors[kv_b].shape == (h * (CFG.qk_nope_head_dim + CFG.v_head_dim), 3)


# ------------------------------------------------------------------------------------------------
# 4. Refusals: no adapters, or adapters this export cannot place exactly.


def test_refuses_model_without_lora(tmp_path):
    with pytest.raises(ValueError, match="no LoRA adapters"):
        peft_io.save_peft_adapter(_abstract(ModelOptions(param_dtype=jnp.float32)), tmp_path / "a")
    assert not os.path.exists(tmp_path / "a")


def test_inconsistent_adapter_raises_naming_it(tmp_path):
    # Checked on an abstract model: every check runs before any array is read or file written.
    m = _abstract(OPTS)
    m.stacks[1].layers[0].self_attn.q_a_proj_lora.scale = 0.5  # not alpha/rank
    with pytest.raises(ValueError, match="stacks/1/layers/0/self_attn/q_a_proj_lora has scale"):
        peft_io.save_peft_adapter(m, tmp_path / "a")
    m = _abstract(OPTS)
    m.stacks[1].layers[1].mlp.w_up_lora = None  # gate without up cannot fill HF's fused gate_up_proj
    with pytest.raises(ValueError, match=r"stacks/1/layers/1/mlp/w_gate_lora.*without.*\['up'\]"):
        peft_io.save_peft_adapter(m, tmp_path / "a")
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------------------------
# 5. Atomic writes.


def test_failed_export_keeps_previous_files(model, tmp_path, monkeypatch):
    path = tmp_path / "adapter"
    peft_io.save_peft_adapter(model, path)  # fresh directory: renamed into place whole
    fresh = tmp_path / "mkdir"
    os.mkdir(fresh)  # the export directory gets ordinary permissions, not mkdtemp's private 0700
    assert os.stat(path).st_mode & 0o777 == os.stat(fresh).st_mode & 0o777
    os.rmdir(fresh)
    before = {f: (path / f).read_bytes() for f in os.listdir(path)}

    other = _filled(_abstract(OPTS), seed=5)  # different weights and config
    real = peft_io._write_config

    def crash(*args):  # the weights file is complete in the staging dir; the config write fails
        raise OSError("disk full")

    monkeypatch.setattr(peft_io, "_write_config", crash)
    with pytest.raises(OSError, match="disk full"):
        peft_io.save_peft_adapter(other, path, base_model_name_or_path="other")
    assert {f: (path / f).read_bytes() for f in os.listdir(path)} == before
    assert os.listdir(tmp_path) == ["adapter"]  # no staging directory left behind

    monkeypatch.setattr(peft_io, "_write_config", real)
    peft_io.save_peft_adapter(other, path, base_model_name_or_path="other")  # existing dir: files replaced
    after = {f: (path / f).read_bytes() for f in os.listdir(path)}
    assert sorted(after) == sorted(before) and all(after[f] != before[f] for f in before)
    assert json.loads(after[peft_io.ADAPTER_CONFIG])["base_model_name_or_path"] == "other"
    assert os.listdir(tmp_path) == ["adapter"]
