"""Megatron-core name and layout map (`checkpoint/megatron.py`).

A tiny float32 model with random base weights and random nonzero LoRA A and B in every family is built without
any XLA compile (numpy values merged into an abstract model). Checked: the round trip ours -> Megatron -> ours is
bit-exact for both expert layouts, through real safetensors and torch files; names and shapes equal the keys
megatron-core 0.19.2's GPTModel really has (tests/checkpoint/megatron_keys.json, captured by
scripts/capture_megatron_keys.py; rebuilt live in a subprocess when megatron-core is importable); the relayouts
put known values where Megatron expects them; bad input is one-line errors; a malicious pickle never runs.

Axis letters: L stacked layers, E experts, D model, I intermediate, r rank.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm52_jax import config
from glm52_jax.checkpoint import megatron as meg
from glm52_jax.checkpoint.safetensors_io import write_safetensors
from glm52_jax.model.lora import LoRA, LoRAConfig
from glm52_jax.model.options import ModelOptions
from glm52_jax.model.transformer import GlmMoeDsa

# IndexShare schedule (full, full, shared, full, shared) as Megatron's dsa_indexer_topk_freq / skip_topk_offset.
INDEX_FREQ, INDEX_OFFSET = 2, 2
CFG = config.tiny(num_hidden_layers=5, indexer_types=config.derive_indexer_types(5, freq=INDEX_FREQ,
                                                                                 offset=INDEX_OFFSET))
LORA = LoRAConfig(rank=3, alpha=6.0)  # rank 3 differs from every model dim; alpha/rank = 2
OPTS = ModelOptions(param_dtype=jnp.float32, lora=LORA)
FIXTURE = os.path.join(os.path.dirname(__file__), "megatron_keys.json")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYOUTS = [meg.MegatronLayout("grouped", True), meg.MegatronLayout("sequential", False)]


def _abstract(opts=OPTS) -> GlmMoeDsa:
    return nnx.eval_shape(lambda: GlmMoeDsa(CFG, opts, rngs=nnx.Rngs(0)))


@pytest.fixture(scope="module")
def model() -> GlmMoeDsa:
    graphdef, state = nnx.split(_abstract())
    rng = np.random.default_rng(0)  # numpy: no per-shape XLA compile; every value distinct, B nonzero
    flat = [(p, v.replace(jnp.asarray(rng.standard_normal(v.get_value().shape), v.get_value().dtype)))
            for p, v in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda x: x.experts)
def exported(request, model):
    return request.param, meg.to_megatron(model, request.param)


def _leaves(m) -> dict:
    return {tuple(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(m))}


def _assert_same_tree(got, want):
    got, want = _leaves(got), _leaves(want)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), k


def test_round_trip_bit_exact(exported, model, tmp_path):
    layout, sd = exported
    assert meg.MegatronLayout.detect(sd) == layout
    assert {k: v.shape for k, v in sd.items()} == meg.megatron_shapes(_abstract(), layout)
    path = tmp_path / "m.safetensors"
    write_safetensors(path, list(sd.items()))
    back = meg.from_megatron(meg.load_megatron_state(path), _abstract())  # layout detected from the names
    _assert_same_tree(back, model)


def test_torch_file_round_trip(model, tmp_path):
    torch = pytest.importorskip("torch")
    sd = meg.to_megatron(model, LAYOUTS[1], base=False)  # LoRA only, as a Megatron run's adapter/gradient file
    path = tmp_path / "lora.pt"
    torch.save({"model": {k: torch.from_numpy(np.array(v)) for k, v in sd.items()} | {"x._extra_state": None}}, path)
    state = meg.lora_from_megatron(meg.load_megatron_state(path), _abstract())
    want = dict(nnx.to_flat_state(nnx.state(model, LoRA)))
    for p, v in nnx.to_flat_state(state):
        assert np.array_equal(np.asarray(v.get_value()), np.asarray(want[p].get_value())), p


def _keys_fixture() -> dict:
    with open(FIXTURE, encoding="utf-8") as f:
        return json.load(f)


def test_names_and_shapes_match_megatron_core(model):
    fx = _keys_fixture()
    assert fx["megatron_core_version"] == "0.19.2"
    live = {k: tuple(s) for k, s in fx["keys"].items()}
    # The capture's layout (local backend): SequentialMLP, unfused dense pre-MLP norm; base weights only.
    assert meg.megatron_shapes(_abstract(), LAYOUTS[1], lora=False) == live
    # TE names the CPU build cannot make, as the fixture's cited renames state them.
    dense = {f"decoder.layers.{i}." for i, t in enumerate(CFG.mlp_layer_types) if t == "dense"}
    renamed = {}
    for k, s in live.items():
        for rule in fx["te_renames"]:
            if rule["applies_to_dense_layers"] is None or any(k.startswith(p) for p in dense):
                k = re.sub(rule["from"], rule["to"], k)
        renamed[k] = s
    assert meg.megatron_shapes(_abstract(), LAYOUTS[0], lora=False) == renamed


def test_lora_names_follow_megatron_bridge_on_the_real_modules(model):
    """Megatron-Bridge's adapter names and shapes (the fixture's `lora_rules`) applied to the captured base modules."""
    fx = _keys_fixture()
    targets = {t.removesuffix("_gate").removesuffix("_up") for t in meg.megatron_lora_config(model)["target_modules"]}
    r = LORA.rank
    sequential = {}
    for k, shape in fx["keys"].items():
        module = k.removesuffix(".weight")
        if k == module or module.rsplit(".", 1)[-1] not in targets:
            continue
        out, inn = shape
        fc1 = module.endswith("linear_fc1")
        parts = [(".adapter_gate", out // 2), (".adapter_up", out // 2)] if fc1 else [("", out)]
        for part, n_out in parts:
            sequential[f"{module}.adapter{part}.linear_in.weight"] = (r, inn)
            sequential[f"{module}.adapter{part}.linear_out.weight"] = (n_out, r)
    assert meg.megatron_shapes(_abstract(), LAYOUTS[1], base=False) == sequential
    grouped = {}
    for k, shape in sequential.items():
        k = re.sub(r"\.local_experts\.\d+\.", ".", k)
        grouped[k] = ((CFG.n_routed_experts,) + shape) if ".mlp.experts." in k else shape
    assert meg.megatron_shapes(_abstract(), LAYOUTS[0], base=False) == grouped


# ~10-20 s (a subprocess importing jax, torch and megatron-core): slow since megatron-core is in the test extra; CI
# variant: tests/torch_bridge/test_megatron_reference.py::test_built_model_holds_exactly_the_maps_tensors (the same
# comparison in-process on the reference's GPTModel, adapters included).
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")
def test_names_match_a_live_megatron_core_model():
    """Builds the real GPTModel (scripts/capture_megatron_keys.py) in a subprocess and compares its state dict."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "capture_megatron_keys.py"), "--print"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    live = {k: tuple(s) for k, s in json.loads(out.stdout.strip().splitlines()[-1])["keys"].items()}
    assert meg.megatron_shapes(_abstract(), LAYOUTS[1], lora=False) == live


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")
def test_rope_dims_need_no_permutation():
    """Megatron's MLA / DSA-indexer RoPE (`mla_rotary_interleaved=True`, GLM-5's setting) gives our rotated vectors
    element for element, so the q_up / wq_b / wk rows map without permutation. Measured max |diff| 8.3e-7 on
    |x| <= 3.9 (float32 cos/sin rounding, 2026-12-05); bound ~6x that."""
    torch = pytest.importorskip("torch")
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from glm52_jax import positions
    r, s = CFG.qk_rope_head_dim, 40
    f = RotaryEmbedding(r, rotary_percent=1.0, rotary_base=CFG.rope.rope_theta,
                        use_cpu_initialization=True).get_freqs_non_repeated(s)
    freqs = torch.cat((f, f), dim=-1)[:, None, None, :]  # RotaryEmbedding.get_emb, rotary_interleaved=False
    x = np.random.default_rng(0).standard_normal((s, 1, 2, r)).astype(np.float32)  # [S, B, heads, R]
    theirs = _apply_rotary_pos_emb_bshd(torch.from_numpy(x), freqs, rotary_interleaved=False,
                                        mla_rotary_interleaved=True).numpy()
    cos, sin = positions.rope_cos_sin(jnp.arange(s), positions.rotary_table(CFG.rope, r))
    ours = np.asarray(positions.apply_interleaved_rope(jnp.asarray(x), cos[:, None, None], sin[:, None, None]))
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=5e-6)


def test_relayouts_put_values_where_megatron_expects_them(exported, model):
    """Against our own arrays directly: fc1 rows [gate; up], expert index, LoRA linear_in = A^T, linear_out = B^T."""
    layout, sd = exported
    p = dict(nnx.to_flat_state(nnx.state(model)))
    at = lambda *k: np.asarray(p[k].get_value())  # noqa: E731
    dense = ("stacks", 0, "layers", 0, "mlp")  # layer 0 (dense) is stack 0
    i = CFG.intermediate_size
    fc1 = sd["decoder.layers.0.mlp.linear_fc1.weight"]
    assert np.array_equal(fc1[:i], at(*dense, "gate_proj")[0].T) and np.array_equal(fc1[i:], at(*dense, "up_proj")[0].T)
    a, b = at(*dense, "gate_proj_lora", "a")[0], at(*dense, "gate_proj_lora", "b")[0]  # [D, r], [r, I]
    pre = "decoder.layers.0.mlp.linear_fc1.adapter.adapter_gate"
    assert np.array_equal(sd[pre + ".linear_in.weight"], a.T) and np.array_equal(sd[pre + ".linear_out.weight"], b.T)
    # Routed expert 5 of layer 1 (stack 1, slot 0, repeat 0): gate LoRA and down kernel.
    sparse = ("stacks", 1, "layers", 0, "mlp")
    a, b = at(*sparse, "w_gate_lora", "a")[0, 5], at(*sparse, "w_gate_lora", "b")[0, 5]
    if layout.experts == "grouped":
        pre = "decoder.layers.1.mlp.experts.linear_fc1.adapter.adapter_gate"
        got_a, got_b = sd[pre + ".linear_in.weight"][5], sd[pre + ".linear_out.weight"][5]
        down = sd["decoder.layers.1.mlp.experts.linear_fc2.weight5"]
    else:
        pre = "decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.adapter.adapter_gate"
        got_a, got_b = sd[pre + ".linear_in.weight"], sd[pre + ".linear_out.weight"]
        down = sd["decoder.layers.1.mlp.experts.local_experts.5.linear_fc2.weight"]
    assert np.array_equal(got_a, a.T) and np.array_equal(got_b, b.T)
    assert np.array_equal(down, at(*sparse, "w_down")[0, 5].T)
    # kv_b LoRA: one adapter, B rows per head [k (N), v (V)], as Megatron's linear_kv_up_proj rows.
    kvb = ("stacks", 1, "layers", 0, "self_attn", "kv_b_proj_lora")
    out = sd["decoder.layers.1.self_attention.linear_kv_up_proj.adapter.linear_out.weight"]  # [H*(N+V), r]
    h, n = CFG.num_attention_heads, CFG.qk_nope_head_dim
    per_head = out.reshape(h, -1, LORA.rank)
    assert np.array_equal(per_head[:, :n], at(*kvb, "b_k")[0].transpose(1, 2, 0))
    assert np.array_equal(per_head[:, n:], at(*kvb, "b_v")[0].transpose(1, 2, 0))


def test_lora_config_names_the_modules_written(model):
    cfg = meg.megatron_lora_config(model)
    assert cfg["dim"] == LORA.rank and cfg["alpha"] == LORA.alpha and cfg["share_expert_adapters"] is False
    targets = set()  # CanonicalLoRA target names: the module's leaf name, linear_fc1 split into _gate / _up
    for k in meg.megatron_shapes(_abstract(), base=False):
        m = re.fullmatch(r".*?([a-z_0-9]+)\.adapter(?:\.adapter_(gate|up))?\.linear_(?:in|out)\.weight", k)
        targets.add(m.group(1) + (f"_{m.group(2)}" if m.group(2) else ""))
    assert targets == set(cfg["target_modules"])


def _tampered(sd, **changes):
    out = dict(sd)
    for k, v in changes.items():
        if v is None:
            out.pop(k)
        else:
            out[k] = v
    return out


def _raises_one_line(match, fn):
    with pytest.raises(ValueError, match=match) as e:
        fn()
    assert "\n" not in str(e.value)


def test_errors_are_one_line(exported):
    layout, sd = exported
    name = "decoder.layers.1.self_attention.linear_q_up_proj.weight"
    load = lambda d, lay=layout: meg.from_megatron(d, _abstract(), lay)  # noqa: E731
    _raises_one_line(r"missing tensor\(s\) \['decoder\.layers\.1\.self_attention\.linear_q_up_proj\.weight'\]",
                     lambda: load(_tampered(sd, **{name: None})))
    _raises_one_line(r"unexpected tensor\(s\) \['decoder\.layers\.9\.x'\]",
                     lambda: load(_tampered(sd, **{"decoder.layers.9.x": np.zeros(1)})))
    _raises_one_line(r"'decoder\.layers\.1\.self_attention\.linear_q_up_proj\.weight' has shape \(160, 47\), the model "
                     r"needs \(160, 48\)", lambda: load(_tampered(sd, **{name: np.zeros((160, 47))})))
    fused = "decoder.layers.0.mlp.linear_fc1.adapter.linear_in.weight"
    _raises_one_line("plain-LoRA adapter on the fused linear_fc1",
                     lambda: load(_tampered(sd, **{fused: np.zeros((3, 64))})))
    other = meg.MegatronLayout("sequential" if layout.experts == "grouped" else "grouped", layout.fused_dense_norm)
    _raises_one_line("pass layout=", lambda: load(sd, other))
    _raises_one_line("MegatronLayout.experts='weights12': choose from", lambda: meg.MegatronLayout("weights12"))


class _Evil:
    """Unpickling this runs code: writes the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def test_malicious_pickle_is_refused_and_never_runs(tmp_path):
    torch = pytest.importorskip("torch")
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"decoder.final_layernorm.weight": torch.zeros(2), "x": _Evil(os.fspath(marker))}, path)
    with pytest.raises(ValueError, match=r"evil\.pt: refused to load \(not plain tensors") as e:
        meg.load_megatron_state(path)
    assert "\n" not in str(e.value)
    assert not marker.exists()


def test_jax_not_needed_for_names():
    """The name map works on an abstract model: no device arrays are made."""
    # Held: no array an earlier test left behind is freed during the call (garbage collected there, 176 of them
    # once made the count drop in a full-suite worker).
    before = jax.live_arrays()
    meg.megatron_shapes(_abstract(), LAYOUTS[0])
    assert len(jax.live_arrays()) == len(before)
