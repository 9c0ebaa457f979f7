"""Our parameter tree <-> Megatron-core's GPTModel state dict for GLM-5 (MLA + DSA + MoE), base weights and LoRA.

    sd = to_megatron(model)                                  # {megatron name: np.ndarray}
    model = from_megatron(load_megatron_state(path), model)  # base + LoRA back into `model`'s tree
    lora = lora_from_megatron(grads, model)                  # LoRA-only dicts (e.g. gradient shards): an nnx.State

Composed, not a second map: ours <-> HF is `checkpoint/hf.py` (base; `_hf_tensors` / `param_reader`) and
`checkpoint/peft.py` (LoRA <-> PEFT entries with exact inverses); HF <-> Megatron is Megatron-Bridge's table for
GLM-MoE-DSA, taken as facts from megatron-bridge 0.6.2 `megatron/bridge/models/glm_moe_dsa/glm5_bridge.py`
(`GLM5Bridge.mapping_registry`, lines 145-240) and, for LoRA, `models/conversion/peft_bridge.py`
(`MEGATRON_TO_HF_LORA_SUFFIX`: linear_in <-> lora_A, linear_out <-> lora_B) and `peft/canonical_lora.py`
(separate `adapter_gate` / `adapter_up` on linear_fc1). Bridge maps every MLA and indexer tensor with
`AutoMapping` (same [out, in] layout as HF) and fuses gate/up with `GatedMLPMapping` ([gate; up] rows, at
tensor-parallel size 1; Megatron's TP interleaving of the halves is not modelled: these are unsharded dicts).

Base weights (HF shapes [out, in]; ours: hf.py's transforms; `L` = decoder layer, `x` = expert):

  Megatron (`decoder.layers.L.` prefix unless global)       HF (`model.layers.L.` prefix)           relayout
  embedding.word_embeddings.weight            [vocab, D]    model.embed_tokens.weight               -
  decoder.final_layernorm.weight              [D]           model.norm.weight                       -
  output_layer.weight                         [vocab, D]    lm_head.weight                          -
  input_layernorm.weight                      [D]           input_layernorm.weight                  -
  pre_mlp_layernorm.weight (MoE layers; dense layers with `fused_dense_norm=False`)
                                              [D]           post_attention_layernorm.weight         -
  mlp.linear_fc1.layer_norm_weight (dense, TE spec)         post_attention_layernorm.weight         -
  self_attention.linear_q_down_proj.weight    [Q, D]        self_attn.q_a_proj.weight               -
  self_attention.q_layernorm.weight           [Q]           self_attn.q_a_layernorm.weight          -
  self_attention.linear_q_up_proj.weight      [H*(N+R), Q]  self_attn.q_b_proj.weight           - (head: [nope, rope])
  self_attention.linear_kv_down_proj.weight   [C+R, D]      self_attn.kv_a_proj_with_mqa.weight - ([latent, rope])
  self_attention.kv_layernorm.weight          [C]           self_attn.kv_a_layernorm.weight         -
  self_attention.linear_kv_up_proj.weight     [H*(N+V), C]  self_attn.kv_b_proj.weight          - (head: [k, v])
  self_attention.linear_proj.weight           [D, H*V]      self_attn.o_proj.weight                 -
  self_attention.core_attention.indexer.linear_wq_b.weight [IH*ID, Q]   self_attn.indexer.wq_b.weight   -
  ...indexer.linear_wk.weight [ID, D] / k_norm.weight, k_norm.bias [ID] / linear_weights_proj.weight [IH, D]
                                                            self_attn.indexer.{wk,k_norm,weights_proj}  -
  mlp.linear_fc1.weight (dense)               [2I, D]       mlp.gate_proj.weight ; mlp.up_proj.weight  rows [gate; up]
  mlp.linear_fc2.weight (dense)               [D, I]        mlp.down_proj.weight                    -
  mlp.router.weight                           [E, D]        mlp.gate.weight                         -
  mlp.router.expert_bias                      [E]           mlp.gate.e_score_correction_bias        -
  mlp.shared_experts.linear_fc1.weight        [2S, D]       mlp.shared_experts.{gate,up}_proj.weight  rows [gate; up]
  mlp.shared_experts.linear_fc2.weight        [D, S]        mlp.shared_experts.down_proj.weight     -
  experts, layout "grouped" (TEGroupedMLP):   mlp.experts.linear_fc1.weight<x> [2I, D], linear_fc2.weight<x> [D, I]
  experts, layout "sequential" (SequentialMLP): mlp.experts.local_experts.<x>.linear_fc1.weight, .linear_fc2.weight
                                                            mlp.experts.<x>.{gate,up,down}_proj.weight  rows [gate; up]

Our side of the same rows (hf.py `_layer_params`; per-layer arrays under `stacks/<s>/layers/<slot>/` carry a
leading stacked-layers axis; `^T` swaps the last two axes):
  embed_tokens [vocab, D] = embedding.word_embeddings;  norm/weight = decoder.final_layernorm;
  lm_head [D, vocab] = output_layer^T
  self_attn/q_a_proj [D, Q] = linear_q_down_proj^T;  q_a_layernorm/weight = q_layernorm;  kv_a_layernorm = kv_layernorm
  self_attn/q_b_proj [Q, H, N+R] = linear_q_up_proj [H*(N+R), Q] split per head, axes moved
  self_attn/kv_a_proj_with_mqa [D, C+R] = linear_kv_down_proj^T
  self_attn/w_uk [C, H, N], w_uv [C, H, V] = linear_kv_up_proj [H*(N+V), C]: per head rows [k; v], split, axes moved
  self_attn/o_proj [H, V, D] = linear_proj [D, H*V] split per head, axes moved
  self_attn/indexer/wq_b [Q, IH, ID] = linear_wq_b [IH*ID, Q] likewise;  indexer/wk [D, ID] = linear_wk^T;
  indexer/k_norm/{weight,bias} = k_norm;  indexer/weights_proj [D, IH] (float32) = linear_weights_proj^T
  mlp[/shared_experts]/{gate,up}_proj [D, I] = linear_fc1 rows [:I] / [I:], ^T;  down_proj [I, D] = linear_fc2^T
  mlp/router [D, E] = router.weight^T;  mlp/e_score_correction_bias [E] = router.expert_bias
  mlp/w_gate, w_up [E, D, I], w_down [E, I, D]: expert x's linear_fc1 rows [:I] / [I:] ^T, linear_fc2 ^T
  LoRA `<proj>_lora/a` [*in, r] -> linear_in = a flattened to [in, r], ^T;  `b` [r, *out] -> linear_out = b
  flattened, ^T;
  kv_b_proj_lora/{a, b_k, b_v} -> the linear_kv_up_proj adapter (linear_out rows per head [b_k; b_v]);
  mlp/w_{gate,up,down}_lora/{a [E, in, r], b [E, r, out]} -> the experts' adapters, per expert a^T, b^T;
  lm_head_lora -> output_layer.adapter.

IndexShare: Megatron builds no indexer on the layers that reuse a previous top-k (dsa.py `DSAttention.__init__`,
`is_dsa_skip_topk_layer`: the same schedule as our `indexer_types`), exactly as HF has no `self_attn.indexer.*`
there. The legacy `GroupedMLP` (weight1/weight2) no longer exists in megatron-core 0.19.2 (experts.py has
TEGroupedMLP, SequentialMLP, InferenceGroupedMLP only), so it is not offered.

RoPE order (no weight permutation anywhere): the MLA query head is [nope N, rope R] and the indexer head is
[rope R, rest] in ours, HF (`GlmMoeDsaIndexer.forward`: split [rope, head_dim - rope]) and Megatron
(dsa.py `DSAIndexer._apply_rope`: "x_pe is placed at the front"). Within the rope dims all three read interleaved
pairs (2i, 2i+1) rotated by frequency i: ours `positions.apply_interleaved_rope`, HF
`apply_rotary_pos_emb_interleave`, Megatron `apply_rotary_pos_emb(mla_rotary_interleaved=True)` for MLA
(absorbed_mla.py) and `=dsa_indexer_rope_interleaved` for the indexer (Bridge sets it from HF's
`indexer_rope_interleave`, true for GLM-5). HF and Megatron emit the rotated dims de-interleaved, which permutes q
and k alike, so scores and weights agree.

LoRA (Megatron-Bridge `CanonicalLoRA(share_expert_adapters=False)`, the exact counterpart of our adapters: one
rank-r adapter per linear, gate and up separate, one per expert; `megatron_lora_config` gives its settings).
Megatron's delta is `alpha/dim * linear_out @ linear_in`, ours `alpha/r * (A B)^T`:
  `<module>.adapter.linear_in.weight` [r, in] = PEFT lora_A;  `<module>.adapter.linear_out.weight` [out, r] = lora_B
  modules: self_attention.linear_q_down_proj / linear_q_up_proj / linear_kv_down_proj / linear_kv_up_proj
  (one adapter on the fused kv_b, B rows per head [k, v]) / linear_proj, output_layer, mlp[.shared_experts].linear_fc2,
  mlp[.shared_experts].linear_fc1.adapter.adapter_{gate,up}.linear_{in,out}.weight (CanonicalLoRA's split fc1);
  grouped experts: mlp.experts.linear_fc1.adapter.adapter_{gate,up}.linear_in.weight [E, r, D], .linear_out.weight
  [E, I, r]; mlp.experts.linear_fc2.adapter.linear_in.weight [E, r, I], .linear_out.weight [E, D, r]
  (peft/utils.py `GroupedExpertLinearAdapter`); sequential: per expert mlp.experts.local_experts.<x>.linear_fc1...
  with the 2-D shapes. Plain `LoRA` on a fused linear_fc1 shares one A between gate and up, which our separate
  adapters cannot hold bit for bit, and is refused with that reason.

Checked against megatron-core 0.19.2 built on CPU (tests/checkpoint/megatron_keys.json, captured by
scripts/capture_megatron_keys.py): the GLM-5 layer spec needs TransformerEngine, which does not install without
CUDA, so the capture gives the spec the local backend; the TE-only names (grouped experts, the dense layers' fused
norm) are stated above from the TE sources the fixture cites.

Scope: whole (unsharded) state dicts, as a TP=EP=PP=1 run saves them or after gathering; Megatron's torch_dist
checkpoint directories are not read. `to_megatron` holds its result on the host: tiny models, LoRA (`base=False`)
or gradients. `load_megatron_state` reads safetensors, or torch files only through `torch.load(weights_only=True)`.
Axis letters: D model, Q q_lora, C kv_lora, H heads, N qk_nope, R rope, V v_head, IH/ID indexer
heads/dim, E experts, I (expert / dense) intermediate, S shared-expert intermediate, r LoRA rank.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping

import numpy as np
from flax import nnx

from glm52_jax.checkpoint import hf, peft
from glm52_jax.checkpoint.safetensors_io import SafetensorsFile
from glm52_jax.model.lora import LoRA

EXPERT_LAYOUTS = ("grouped", "sequential")
_EXTRA_STATE = "._extra_state"  # TE's per-module FP8 metadata: not a weight, ignored on load


@dataclasses.dataclass(frozen=True)
class MegatronLayout:
    """Which Megatron module variants the state dict comes from.

    experts: "grouped" (TEGroupedMLP, `linear_fc1.weight<x>`, what GLM5Bridge builds: moe_grouped_gemm=True) or
      "sequential" (SequentialMLP, `local_experts.<x>.linear_fc1.weight`).
    fused_dense_norm: the dense layers' pre-MLP norm is TE's fused `mlp.linear_fc1.layer_norm_weight` (the GLM-5
      spec with TransformerEngine) instead of `pre_mlp_layernorm.weight` (local backend).
    """

    experts: str = "grouped"
    fused_dense_norm: bool = True

    def __post_init__(self):
        if self.experts not in EXPERT_LAYOUTS:
            raise ValueError(f"MegatronLayout.experts={self.experts!r}: choose from {EXPERT_LAYOUTS}")

    @classmethod
    def detect(cls, names) -> MegatronLayout:
        """The layout a state dict's names show (defaults where they show nothing, e.g. LoRA-only dicts)."""
        names = list(names)
        sequential = any(".mlp.experts.local_experts." in n for n in names)
        unfused = any(n.endswith(".pre_mlp_layernorm.weight") for n in names) and not any(
            n.endswith(".mlp.linear_fc1.layer_norm_weight") for n in names)
        return cls("sequential" if sequential else "grouped", not unfused)


# ------------------------------------------------------------------------------------------------
# Base weights: HF <-> Megatron (GLM5Bridge.mapping_registry).

_GLOBAL = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
           "decoder.final_layernorm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight"}
_LAYER = {  # HF suffix after `model.layers.L.` -> Megatron suffix after `decoder.layers.L.`
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.q_a_proj.weight": "self_attention.linear_q_down_proj.weight",
    "self_attn.q_a_layernorm.weight": "self_attention.q_layernorm.weight",
    "self_attn.q_b_proj.weight": "self_attention.linear_q_up_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "self_attention.linear_kv_down_proj.weight",
    "self_attn.kv_a_layernorm.weight": "self_attention.kv_layernorm.weight",
    "self_attn.kv_b_proj.weight": "self_attention.linear_kv_up_proj.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.indexer.wq_b.weight": "self_attention.core_attention.indexer.linear_wq_b.weight",
    "self_attn.indexer.wk.weight": "self_attention.core_attention.indexer.linear_wk.weight",
    "self_attn.indexer.k_norm.weight": "self_attention.core_attention.indexer.k_norm.weight",
    "self_attn.indexer.k_norm.bias": "self_attention.core_attention.indexer.k_norm.bias",
    "self_attn.indexer.weights_proj.weight": "self_attention.core_attention.indexer.linear_weights_proj.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    "mlp.gate.weight": "mlp.router.weight",
    "mlp.gate.e_score_correction_bias": "mlp.router.expert_bias",
    "mlp.shared_experts.down_proj.weight": "mlp.shared_experts.linear_fc2.weight",
}
_GATED = {"mlp.": "mlp.", "mlp.shared_experts.": "mlp.shared_experts."}  # HF prefix -> Megatron prefix of fc1


def _expert_module(layout: MegatronLayout, fc: str, x: int) -> tuple[str, str]:
    """(module, weight suffix) of expert `x`'s `fc` ("linear_fc1"/"linear_fc2") under `layout`."""
    if layout.experts == "grouped":
        return f"mlp.experts.{fc}", f"weight{x}"
    return f"mlp.experts.local_experts.{x}.{fc}", "weight"


def _base_plan(cfg, layout: MegatronLayout) -> dict[str, tuple[str, ...]]:
    """Megatron name -> the HF names it holds (two: rows [gate; up] concatenated), in Megatron's order."""
    hf_names = hf.expected_tensors(cfg)
    plan = {m: (h,) for m, h in _GLOBAL.items() if h in hf_names}
    for layer, mlp_type in enumerate(cfg.mlp_layer_types):
        h, m = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        norm = "mlp.linear_fc1.layer_norm_weight" if mlp_type == "dense" and layout.fused_dense_norm \
            else "pre_mlp_layernorm.weight"
        plan[m + norm] = (h + "post_attention_layernorm.weight",)
        for hs, ms in _LAYER.items():
            if h + hs in hf_names:
                plan[m + ms] = (h + hs,)
        for hp, mp in _GATED.items():
            if h + hp + "gate_proj.weight" in hf_names:
                plan[m + mp + "linear_fc1.weight"] = (h + hp + "gate_proj.weight", h + hp + "up_proj.weight")
        if mlp_type == "sparse":
            for x in range(cfg.n_routed_experts):
                e = f"{h}mlp.experts.{x}."
                fc1, fc2 = _expert_module(layout, "linear_fc1", x), _expert_module(layout, "linear_fc2", x)
                plan[f"{m}{fc1[0]}.{fc1[1]}"] = (e + "gate_proj.weight", e + "up_proj.weight")
                plan[f"{m}{fc2[0]}.{fc2[1]}"] = (e + "down_proj.weight",)
    return plan


def _base_shapes(cfg, layout: MegatronLayout) -> dict[str, tuple[int, ...]]:
    hf_shapes = hf.expected_tensors(cfg)
    out = {}
    for m, hs in _base_plan(cfg, layout).items():
        shapes = [hf_shapes[h] for h in hs]
        out[m] = (sum(s[0] for s in shapes),) + shapes[0][1:]
    return out


class _HFView:
    """HF tensors read out of a Megatron state dict (`get(hf_name)`, what `hf.param_reader` needs)."""

    def __init__(self, sd: Mapping[str, np.ndarray], cfg, layout: MegatronLayout):
        self.sd, self.where = sd, {}
        for m, hs in _base_plan(cfg, layout).items():
            for part, h in enumerate(hs):
                self.where[h] = (m, part if len(hs) == 2 else None)

    def get(self, name: str) -> np.ndarray:
        m, part = self.where[name]
        a = np.asarray(self.sd[m])
        if part is None:
            return a
        half = a.shape[0] // 2
        return a[:half] if part == 0 else a[half:]


# ------------------------------------------------------------------------------------------------
# LoRA: PEFT entries (checkpoint/peft.py) <-> Megatron-Bridge CanonicalLoRA adapters.

_ATTN = {"q_a_proj": "linear_q_down_proj", "q_b_proj": "linear_q_up_proj", "kv_a_proj_with_mqa": "linear_kv_down_proj",
         "kv_b_proj": "linear_kv_up_proj", "o_proj": "linear_proj"}
_MLP = {"gate_proj": "linear_fc1.adapter.adapter_gate", "up_proj": "linear_fc1.adapter.adapter_up",
        "down_proj": "linear_fc2.adapter"}
_IN, _OUT = ".linear_in.weight", ".linear_out.weight"


@dataclasses.dataclass
class _LoraItem:
    """One PEFT entry and its Megatron tensors: names -> shapes, and the two exact conversions."""

    entry: peft._Entry
    shapes: dict[str, tuple[int, ...]]
    to_meg: Callable[[np.ndarray, np.ndarray], dict[str, np.ndarray]]  # (lora_A, lora_B) -> Megatron tensors
    from_meg: Callable[[Mapping[str, np.ndarray]], tuple[np.ndarray, np.ndarray]]  # -> (lora_A, lora_B)


def _linear_item(entry, module: str) -> _LoraItem:
    a, b = entry.lora_a.shape, entry.lora_b.shape
    return _LoraItem(entry, {module + _IN: a, module + _OUT: b},
                     lambda pa, pb: {module + _IN: pa, module + _OUT: pb},
                     lambda sd: (np.asarray(sd[module + _IN]), np.asarray(sd[module + _OUT])))


def _expert_items(entry, prefix: str, e: int, r: int, layout: MegatronLayout) -> _LoraItem:
    """The routed experts' gate_up (PEFT `mlp.experts.base_layer`, rank 2r block diagonal) or down entry."""
    gate_up = entry.module.endswith(".base_layer")
    parts = ("adapter_gate", "adapter_up") if gate_up else (None,)
    fc = "linear_fc1" if gate_up else "linear_fc2"
    n_in = entry.lora_a.shape[1]
    n_out = entry.lora_b.shape[0] // 2 if gate_up else entry.lora_b.shape[0]

    def names(x):  # expert x (None: grouped) -> [(linear_in name, linear_out name)] per part
        mod = f"{prefix}mlp.experts.{fc}" if x is None else f"{prefix}mlp.experts.local_experts.{x}.{fc}"
        return [(f"{mod}.adapter{'.' + p if p else ''}{_IN}", f"{mod}.adapter{'.' + p if p else ''}{_OUT}")
                for p in parts]

    grouped = layout.experts == "grouped"
    shapes = {}
    for x in [None] if grouped else range(e):
        lead = (e,) if grouped else ()
        for n_a, n_b in names(x):
            shapes[n_a], shapes[n_b] = lead + (r, n_in), lead + (n_out, r)

    def ours(pa, pb):  # PEFT -> per part (A [E, in, r], B [E, r, out])
        if gate_up:
            a_g, a_u, b_g, b_u = peft._gate_up_inv(pa, pb, e, entry.module)
            return [(a_g, b_g), (a_u, b_u)]
        return [(peft._experts_a_inv(pa, e), peft._experts_b_inv(pb, e))]

    def to_meg(pa, pb):
        out = {}
        for part, (a, b) in enumerate(ours(pa, pb)):
            a_t, b_t = a.transpose(0, 2, 1), b.transpose(0, 2, 1)  # [E, r, in], [E, out, r]
            for x in [None] if grouped else range(e):
                n_a, n_b = names(x)[part]
                out[n_a], out[n_b] = (a_t, b_t) if grouped else (a_t[x], b_t[x])
        return out

    def from_meg(sd):
        pairs = []
        for part in range(len(parts)):
            if grouped:
                n_a, n_b = names(None)[part]
                a_t, b_t = np.asarray(sd[n_a]), np.asarray(sd[n_b])
            else:
                a_t = np.stack([np.asarray(sd[names(x)[part][0]]) for x in range(e)])
                b_t = np.stack([np.asarray(sd[names(x)[part][1]]) for x in range(e)])
            pairs.append((a_t.transpose(0, 2, 1), b_t.transpose(0, 2, 1)))
        if gate_up:
            (a_g, b_g), (a_u, b_u) = pairs
            return peft._gate_up_a(a_g, a_u), peft._gate_up_b(b_g, b_u)
        return peft._experts_a(pairs[0][0]), peft._experts_b(pairs[0][1])

    return _LoraItem(entry, shapes, to_meg, from_meg)


_MODULE_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _lora_plan(model, layout: MegatronLayout) -> list[_LoraItem]:
    """One item per PEFT entry of `model`'s adapters (none when it has no LoRA)."""
    if not nnx.state(model, LoRA):
        return []
    entries = peft._collect(model)[0]
    e, r = model.cfg.n_routed_experts, model.opts.lora.rank
    items = []
    for entry in entries:
        if entry.module == "lm_head":
            items.append(_linear_item(entry, "output_layer.adapter"))
            continue
        m = _MODULE_RE.match(entry.module)
        if m is None:
            raise AssertionError(f"megatron: PEFT entry {entry.module!r} has no Megatron counterpart")
        prefix, rest = f"decoder.layers.{m.group(1)}.", m.group(2)
        if rest.startswith("self_attn."):
            module = _ATTN[rest.removeprefix("self_attn.")]
            items.append(_linear_item(entry, f"{prefix}self_attention.{module}.adapter"))
        elif rest in ("mlp.experts", "mlp.experts.base_layer"):
            items.append(_expert_items(entry, prefix, e, r, layout))
        else:
            owner, proj = rest.rsplit(".", 1)  # "mlp" or "mlp.shared_experts", gate_proj/up_proj/down_proj
            items.append(_linear_item(entry, f"{prefix}{owner}.{_MLP[proj]}"))
    return items


def megatron_lora_config(model) -> dict:
    """The Megatron-Bridge PEFT settings whose adapters `to_megatron` writes (alpha/dim = our alpha/r)."""
    lora = model.opts.lora
    targets = {"attention": list(_ATTN.values()), "unembed": ["output_layer"],
               **{f: ["linear_fc1_gate", "linear_fc1_up", "linear_fc2"]
                  for f in ("dense_mlp", "shared_expert", "routed_experts")}}
    names = sorted({t for f in lora.families for t in targets[f]})
    return {"class": "megatron.bridge.peft.canonical_lora.CanonicalLoRA", "dim": lora.rank, "alpha": lora.alpha,
            "target_modules": names, "share_expert_adapters": False, "normalize_moe_lora": False,
            "lora_A_init_method": "xavier", "lora_B_init_method": "zero"}


# ------------------------------------------------------------------------------------------------
# Public API.


def megatron_shapes(model, layout: MegatronLayout | None = None, *, base: bool = True,
                    lora: bool = True) -> dict[str, tuple[int, ...]]:
    """Every Megatron tensor name `to_megatron` writes for `model` (real or abstract), with its shape."""
    layout = layout or MegatronLayout()
    out = _base_shapes(model.cfg, layout) if base else {}
    if lora:
        for item in _lora_plan(model, layout):
            out.update(item.shapes)
    return out


def to_megatron(model, layout: MegatronLayout | None = None, *, base: bool = True,
                lora: bool = True) -> dict[str, np.ndarray]:
    """`model`'s weights (base and/or LoRA) as a Megatron GPTModel state dict of host arrays, in its dtypes.

    For gradients: put them in a model's LoRA variables (`nnx.update(model, grads)`) and pass `base=False`.
    A model sharded over several processes is gathered one tensor at a time, so every process calls this."""
    layout = layout or MegatronLayout()
    out: dict[str, np.ndarray] = {}
    if base:
        tensors = dict(hf._hf_tensors(model))
        for m, hs in _base_plan(model.cfg, layout).items():
            parts = [tensors[h].materialize() for h in hs]
            out[m] = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
    if lora:
        for item in _lora_plan(model, layout):
            out.update(item.to_meg(item.entry.lora_a.materialize(), item.entry.lora_b.materialize()))
    return out


def _check(sd: Mapping[str, np.ndarray], expected: dict[str, tuple[int, ...]], what: str) -> None:
    names = {k for k in sd if not k.endswith(_EXTRA_STATE)}
    missing, extra = sorted(set(expected) - names), sorted(names - set(expected))
    fused_fc1 = [n for n in extra if re.search(r"linear_fc1\.adapter\.linear_(in|out)\.weight", n)]
    if fused_fc1:
        raise ValueError(f"{what}: {fused_fc1[0]!r} is a plain-LoRA adapter on the fused linear_fc1 (one A shared by "
                         "gate and up), which our separate gate/up adapters cannot hold; train with CanonicalLoRA")
    for label, keys in (("missing", missing), ("unexpected", extra)):
        if keys:
            more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
            raise ValueError(f"{what}: {label} tensor(s) {keys[:3]}{more} (layout {MegatronLayout.detect(names)}; "
                             "pass layout= if the state dict is another one)")
    for k, shape in expected.items():
        got = tuple(np.shape(sd[k]))
        if got != tuple(shape):
            raise ValueError(f"{what}: tensor {k!r} has shape {got}, the model needs {tuple(shape)}")


def _lora_values(sd, model, items) -> dict[tuple, np.ndarray]:
    """Our LoRA variable path -> its value, from the Megatron tensors of `items` (via each PEFT entry's inverse)."""
    per_layer: dict[tuple, dict] = {}
    for item in items:
        for path, rep, arr in item.entry.unpack(*item.from_meg(sd)):
            per_layer.setdefault(path, {})[rep] = arr
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, LoRA)):
        parts = per_layer.pop(tuple(path))
        value = parts[None] if None in parts else np.stack([parts[i] for i in range(len(parts))])
        out[tuple(path)] = value.astype(var.get_value().dtype)
    if per_layer:
        raise AssertionError(f"megatron: LoRA values for unknown paths {sorted(per_layer)[:3]}")
    return out


def lora_from_megatron(sd: Mapping[str, np.ndarray], model, layout: MegatronLayout | None = None) -> nnx.State:
    """A Megatron LoRA-only dict (adapter weights or their gradients) as `model`'s LoRA state (nnx.State)."""
    layout = layout or MegatronLayout.detect(sd)
    items = _lora_plan(model, layout)
    expected = {k: s for item in items for k, s in item.shapes.items()}
    _check(sd, expected, "lora_from_megatron")
    values = _lora_values(sd, model, items)
    flat = [(p, v.replace(values[tuple(p)])) for p, v in nnx.to_flat_state(nnx.state(model, LoRA))]
    return nnx.from_flat_state(flat)


def from_megatron(sd: Mapping[str, np.ndarray], model, layout: MegatronLayout | None = None, *, shardings=None):
    """`model` (real or abstract; its config and adapters say what to expect) with every base and LoRA array
    taken from the Megatron state dict `sd` (`_extra_state` entries are ignored). Exact: only transposes,
    reshapes, concatenation splits. Missing, unexpected or mis-shaped tensors raise one line naming them."""
    layout = layout or MegatronLayout.detect(sd)
    cfg = model.cfg
    items = _lora_plan(model, layout)
    expected = _base_shapes(cfg, layout)
    expected.update({k: s for item in items for k, s in item.shapes.items()})
    _check(sd, expected, "from_megatron")
    view = _HFView(sd, cfg, layout)
    graphdef, state = nnx.split(model)
    lora_values = _lora_values(sd, model, items) if items else {}
    leaves = []
    for key, var in nnx.to_flat_state(state):
        shape, dtype = tuple(var.get_value().shape), var.get_value().dtype
        if isinstance(var, LoRA):
            value = lora_values[tuple(key)]
            read = lambda index, value=value: value[index]  # noqa: E731
        else:
            read = hf.param_reader(cfg, view, False, tuple(key), shape)
        leaves.append((key, var.replace(hf._materialize(read, shape, dtype, var, shardings))))
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def load_megatron_state(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """A Megatron state dict from `.safetensors` or a torch file (`torch.load(weights_only=True)`: plain tensors and
    containers only; a pickle that would build any other object is refused before it runs). A torch checkpoint's
    `{"model": {...}}` wrapper is unwrapped; `_extra_state` entries are dropped. bf16 stays bf16 (ml_dtypes)."""
    path = os.fspath(path)
    if path.endswith(".safetensors"):
        f = SafetensorsFile(path)
        return {k: np.array(f.get(k)) for k in f.keys() if not k.endswith(_EXTRA_STATE)}
    import pickle

    import torch
    try:
        raw = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: refused to load (not plain tensors; weights_only unpickling failed: {first})") \
            from None
    if isinstance(raw, dict) and isinstance(raw.get("model"), dict):
        raw = raw["model"]
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a state dict (name -> tensor), got {type(raw).__name__}")
    out = {}
    for k, v in raw.items():
        if k.endswith(_EXTRA_STATE):
            continue
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"{path}: entry {k!r} is a {type(v).__name__}, not a tensor")
        out[k] = _to_numpy(v.detach().cpu())
    return out


def _to_numpy(t) -> np.ndarray:
    import ml_dtypes
    import torch
    if t.dtype == torch.bfloat16:  # numpy has no bf16: reinterpret the bits
        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.contiguous().numpy()
