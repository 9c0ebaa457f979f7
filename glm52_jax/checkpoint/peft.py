"""Export our LoRA adapters as a HF PEFT adapter (`peft.PeftModel.from_pretrained` on transformers'
`GlmMoeDsaForCausalLM`, checked against peft 0.21 / transformers 5.24).

Writes `adapter_model.safetensors` and `adapter_config.json`. Every adapter is exported exactly
(no approximation); anything this module does not recognise raises a ValueError naming the adapter.
Every exported entry carries its exact inverse, with which `checkpoint/peft_load.py` reads an adapter back.

PEFT layouts (HF linear weights are [out, in]; PEFT's delta of a weight is `scaling * B @ A`, with
scaling = lora_alpha / r):

  modules (`target_modules`, `lora.Linear`):  lora_A.weight [r, in], lora_B.weight [out, r]
  2-D parameters (`target_parameters`, `lora.ParamWrapper`): the same shapes and state-dict names
  3-D expert parameters W [E, out, in] (`target_parameters`, `lora.ParamWrapper`):
      lora_A.weight [E*r, in]   row e*r + k   is expert e's A_e[k, :]     (expert-major)
      lora_B.weight [out, r*E]  column k*E + e is expert e's B_e[:, k]    (expert-minor)
      delta W[e] = scaling * B_e @ A_e: an independent rank-r adapter per expert.

Families:

  attention       q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj as `target_modules`.
                  kv_b_proj's B is HF's fused per-head row order [H*(N+V), r] (rows h*(N+V) + j,
                  j < N the key half), the order `hf._kv_b_part` splits the base weight by.
  dense_mlp,      gate/up/down_proj of `mlp` (dense layers) and `mlp.shared_experts` as
  shared_expert   `target_parameters` `mlp.gate_proj.weight`, `mlp.shared_experts.gate_proj.weight`
                  ...: on glm_moe_dsa, peft 0.21 rewrites every `target_modules` entry ending in
                  gate_proj / up_proj / down_proj to the fused routed-expert parameters (its
                  transformers-v4 -> v5 MoE conversion, `transformers_weight_conversion.py`) and drops
                  it from the module targets, so as module targets these adapters would be silently
                  lost. As parameter targets they are untouched, and a suffix like `.mlp.gate_proj.weight`
                  cannot match the shared expert's `.mlp.shared_experts.gate_proj.weight`.
  routed_experts  HF fuses the experts into `mlp.experts.gate_up_proj` [E, 2I, D] (gate rows first)
                  and `mlp.experts.down_proj` [E, D, I]. down_proj is our per-expert rank-r adapter
                  as is. gate_up_proj gets rank 2r (`rank_pattern`, with `alpha_pattern` 2*alpha so
                  the scaling stays alpha/r): A_e = [A_gate_e^T; A_up_e^T] [2r, D] and
                  B_e = blockdiag(B_gate_e^T, B_up_e^T) [2I, 2r], so B_e A_e stacks the gate delta
                  over the up delta exactly (the layout peft itself builds when converting
                  per-expert v4 adapters).
  unembed         lm_head (`target_modules`); also exact with tied embeddings, as PEFT's lm_head
                  adapter (like ours) acts on the logits projection only (peft then warns that
                  `ensure_weight_tying` is off: setting it would also adapt the input embedding).

On load peft warns that the rank/alpha_pattern keys "did not match any targeted module and were
ignored": its check looks at module names only, but the patterns are applied to the targeted
parameter (mlp.experts.gate_up_proj), as the parity test proves.

Axis letters: L stacked layers, E experts, r rank, D model, I expert intermediate, C kv_lora,
H heads, N qk_nope, V v_head.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

from glm52_jax.checkpoint.hf_layout import _layer_map
from glm52_jax.checkpoint.host_slice import host_slice
from glm52_jax.checkpoint.safetensors_io import LazyTensor, write_safetensors
from glm52_jax.model.lora import Adapter, KVBAdapter, LoRA

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PREFIX = "base_model.model."  # PeftModelForCausalLM -> LoraModel -> the HF model

_ATTENTION = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_EXPERTS = {"w_gate_lora": "gate", "w_up_lora": "up", "w_down_lora": "down"}
# rank_pattern / alpha_pattern key (peft matches `(.*\.)?(key)$` against the parameter's full name).
GATE_UP_PATTERN = r"mlp\.experts\.gate_up_proj"


# PEFT's (lora_A, lora_B) of one entry -> [(path of our LoRA variable, layer in its stack (None: not stacked),
# that layer's array)]: the exact inverse of the entry's export, used by `peft_load`.
Unpack = Callable[[np.ndarray, np.ndarray], list[tuple[tuple, "int | None", np.ndarray]]]


@dataclasses.dataclass
class _Entry:
    """One PEFT adapter: HF module name, its lora_A / lora_B tensors (lazily computed) and their inverse."""

    module: str  # e.g. "model.layers.3.self_attn.q_a_proj" or "model.layers.3.mlp.experts"
    lora_a: LazyTensor
    lora_b: LazyTensor
    unpack: Unpack


def _where(path) -> str:
    return "/".join(map(str, path))


def _host(x) -> np.ndarray:
    """The whole of `x` on the host (gathered across processes when it is sharded over them)."""
    return host_slice(x)


def _at(x: jax.Array, rep: int) -> np.ndarray:
    """Layer `rep` of a stacked array, on the host (one layer at a time: memory stays bounded)."""
    return host_slice(x, (rep,))


# ------------------------------------------------------------------------------------------------
# Our adapter arrays (one layer, leading layer axis removed) -> PEFT's lora_A / lora_B.


def _linear_a(a: np.ndarray) -> np.ndarray:  # [*in, r] -> [r, prod(in)]
    return a.reshape(-1, a.shape[-1]).T


def _linear_b(b: np.ndarray) -> np.ndarray:  # [r, *out] -> [prod(out), r]
    return b.reshape(b.shape[0], -1).T


def _kv_b_b(b_k: np.ndarray, b_v: np.ndarray) -> np.ndarray:
    """[r,H,N], [r,H,V] -> [H*(N+V), r]: per head the N key rows, then the V value rows."""
    both = np.concatenate([b_k, b_v], axis=-1)  # [r, H, N+V]
    return both.reshape(both.shape[0], -1).T


def _experts_a(a: np.ndarray) -> np.ndarray:
    """[E, in, r] -> [E*r, in], expert-major rows (row e*r + k = A_e[k])."""
    e, n_in, r = a.shape
    return a.transpose(0, 2, 1).reshape(e * r, n_in)


def _experts_b(b: np.ndarray) -> np.ndarray:
    """[E, r, out] -> [out, r*E], expert-minor columns (column k*E + e = B_e[:, k])."""
    e, r, n_out = b.shape
    return b.transpose(2, 1, 0).reshape(n_out, r * e)


def _gate_up_a(a_gate: np.ndarray, a_up: np.ndarray) -> np.ndarray:
    """[E,D,r] x2 -> [E*2r, D]: per expert the gate's r rows, then the up's."""
    return _experts_a(np.concatenate([a_gate, a_up], axis=-1))


def _gate_up_b(b_gate: np.ndarray, b_up: np.ndarray) -> np.ndarray:
    """[E,r,I] x2 -> [2I, 2r*E]: per expert blockdiag(B_gate^T, B_up^T) (gate rows first, as HF)."""
    e, r, i = b_gate.shape
    both = np.zeros((e, 2 * r, 2 * i), b_gate.dtype)  # [E, 2r, 2I]; zero off-diagonal blocks
    both[:, :r, :i] = b_gate
    both[:, r:, i:] = b_up
    return _experts_b(both)


# ------------------------------------------------------------------------------------------------
# The inverses: PEFT's lora_A / lora_B -> our arrays (one layer). Each undoes its twin above exactly.


def _linear_a_inv(a: np.ndarray, in_shape: tuple[int, ...]) -> np.ndarray:  # [r, prod(in)] -> [*in, r]
    return a.T.reshape(tuple(in_shape) + (a.shape[0],))


def _linear_b_inv(b: np.ndarray, out_shape: tuple[int, ...]) -> np.ndarray:  # [prod(out), r] -> [r, *out]
    return b.T.reshape((b.shape[1],) + tuple(out_shape))


def _kv_b_b_inv(b: np.ndarray, heads: int, nope: int) -> tuple[np.ndarray, np.ndarray]:
    """[H*(N+V), r] -> ([r,H,N], [r,H,V])."""
    both = b.T.reshape(b.shape[1], heads, -1)
    return both[..., :nope], both[..., nope:]


def _experts_a_inv(a: np.ndarray, e: int) -> np.ndarray:
    """[E*r, in] -> [E, in, r]."""
    return a.reshape(e, a.shape[0] // e, a.shape[1]).transpose(0, 2, 1)


def _experts_b_inv(b: np.ndarray, e: int) -> np.ndarray:
    """[out, r*E] -> [E, r, out]."""
    return b.reshape(b.shape[0], b.shape[1] // e, e).transpose(2, 1, 0)


def _gate_up_inv(a: np.ndarray, b: np.ndarray, e: int, module: str) -> tuple[np.ndarray, ...]:
    """[E*2r, D], [2I, 2r*E] -> (A_gate, A_up [E,D,r], B_gate, B_up [E,r,I]). The off-diagonal blocks of
    each expert's B must be zero: our separate gate and up adapters cannot represent anything else."""
    a_both, b_both = _experts_a_inv(a, e), _experts_b_inv(b, e)  # [E, D, 2r], [E, 2r, 2I]
    r, i = a_both.shape[-1] // 2, b_both.shape[-1] // 2
    if np.any(b_both[:, :r, i:]) or np.any(b_both[:, r:, :i]):
        raise ValueError(f"{module}.lora_B.weight couples the gate and up projections (nonzero off-diagonal "
                         "blocks); separate gate/up adapters cannot represent it")
    return a_both[..., :r], a_both[..., r:], b_both[:, :r, :i], b_both[:, r:, i:]


def _linear_unpack(path: tuple, a_shape, b_shape, rep: int | None) -> Unpack:
    """Inverse of `_linear_a` / `_linear_b` for adapter `path` (A [*lead, *in, r], B [*lead, r, *out])."""
    lead = 0 if rep is None else 1
    return lambda a, b: [(path + ("a",), rep, _linear_a_inv(a, a_shape[lead:-1])),
                         (path + ("b",), rep, _linear_b_inv(b, b_shape[lead + 1:]))]


# ------------------------------------------------------------------------------------------------
# Walking the model.


def _adapters(model) -> list[tuple[tuple, Adapter | KVBAdapter]]:
    return [(tuple(p), n) for p, n in nnx.iter_graph(model) if isinstance(n, (Adapter, KVBAdapter))]


def _arrays(node) -> dict[str, object]:
    """The adapter's LoRA variables by attribute name (a, b / a, b_k, b_v)."""
    return {k: v for k, v in vars(node).items() if isinstance(v, LoRA)}


def _check_adapter(path, node, lora, family: str) -> None:
    """Rank, scale and family of one adapter agree with the exported config."""
    where = _where(path)
    arrays = _arrays(node)
    expected = {"a", "b_k", "b_v"} if isinstance(node, KVBAdapter) else {"a", "b"}
    if set(arrays) != expected:
        raise ValueError(f"save_peft_adapter: adapter {where} has arrays {sorted(arrays)}, expected {sorted(expected)}")
    for name, var in arrays.items():
        got = var.get_metadata().get("family")
        if got != family:
            raise ValueError(f"save_peft_adapter: adapter {where}/{name} is tagged family {got!r} but sits where "
                             f"{family!r} adapters go")
    rank = arrays["a"].get_value().shape[-1]
    if rank != lora.rank:
        raise ValueError(f"save_peft_adapter: adapter {where} has rank {rank}, but the model's LoRAConfig says "
                         f"rank={lora.rank} (PEFT needs one r, or a rank_pattern this export does not write)")
    if not np.isclose(float(node.scale), lora.alpha / lora.rank, rtol=1e-12, atol=0):
        raise ValueError(f"save_peft_adapter: adapter {where} has scale {node.scale}, but the model's LoRAConfig "
                         f"implies alpha/rank = {lora.alpha / lora.rank}")


def _check_ndim(path, node, a_ndim: int, b_ndim: int) -> None:
    """A and B have the expected number of axes (stacked layers / experts included)."""
    got = (node.a.get_value().ndim, node.b.get_value().ndim)
    if got != (a_ndim, b_ndim):
        raise ValueError(f"save_peft_adapter: adapter {_where(path)} has A/B with {got} axes, expected "
                         f"{(a_ndim, b_ndim)}")


def _collect(model) -> tuple[list[_Entry], set[str], set[str], bool]:
    """All PEFT entries, plus target module leaf names, target parameter names and whether routed
    experts are present. Raises on any adapter it cannot place."""
    lora = getattr(getattr(model, "opts", None), "lora", None)
    found = _adapters(model)
    n_vars = len(jax.tree.leaves(nnx.state(model, LoRA)))
    if not found and not n_vars:
        raise ValueError("save_peft_adapter: the model has no LoRA adapters to export "
                         "(build it with ModelOptions(lora=LoRAConfig(...)) or use attach_lora)")
    if lora is None:
        example = _where(found[0][0]) if found else "?"
        raise ValueError(f"save_peft_adapter: the model has LoRA adapters (e.g. {example}) but model.opts.lora "
                         "is None, so their rank and alpha are unknown")
    cfg = model.cfg
    layer_of = {v: k for k, v in _layer_map(cfg).items()}
    repeats = {s: seg.repeats for s, seg in enumerate(model.segments_plan)}
    entries: list[_Entry] = []
    modules: set[str] = set()
    params: set[str] = set()
    experts: dict[tuple[int, int], dict[str, tuple]] = {}  # (stack, slot) -> {gate/up/down: (path, node)}
    covered = 0

    def add(module, a_shape, b_shape, dtype, fa, fb, unpack):
        entries.append(_Entry(module, LazyTensor(a_shape, dtype, fa), LazyTensor(b_shape, dtype, fb), unpack))

    for path, node in found:
        where = _where(path)
        covered += len(_arrays(node))
        if path == ("lm_head_lora",):
            if not isinstance(node, Adapter) or node.target != "lm_head":
                raise ValueError(f"save_peft_adapter: adapter {where} is not the unembed adapter this export knows")
            _check_adapter(path, node, lora, "unembed")
            _check_ndim(path, node, 2, 2)  # [D, r], [r, vocab]
            a, b = node.a.get_value(), node.b.get_value()
            add("lm_head", (lora.rank, a.shape[0]), (b.shape[-1], lora.rank), a.dtype,
                lambda a=a: _linear_a(_host(a)), lambda b=b: _linear_b(_host(b)),
                _linear_unpack(path, a.shape, b.shape, None))
            modules.add("lm_head")
            continue
        if len(path) < 6 or path[0] != "stacks" or path[2] != "layers":
            raise ValueError(f"save_peft_adapter: adapter {where} is at a place this export does not know; "
                             "refusing to drop it")
        stack, slot, rel = path[1], path[3], path[4:]
        if (stack, 0, slot) not in layer_of:
            raise ValueError(f"save_peft_adapter: adapter {where} is in an unknown stack/slot")
        mlp_type = cfg.mlp_layer_types[layer_of[(stack, 0, slot)]]
        layers = [(rep, layer_of[(stack, rep, slot)]) for rep in range(repeats[stack])]

        if len(rel) == 2 and rel[0] == "self_attn" and rel[1] in {f"{p}_lora" for p in _ATTENTION}:
            name = rel[1].removesuffix("_lora")
            _check_adapter(path, node, lora, "attention")
            if name == "kv_b_proj":
                if not isinstance(node, KVBAdapter) or node.a.get_value().ndim != 3 \
                        or node.b_k.get_value().ndim != 4 or node.b_v.get_value().ndim != 4:
                    raise ValueError(f"save_peft_adapter: adapter {where} should be a KVBAdapter with A [L,C,r], "
                                     "B_k [L,r,H,N], B_v [L,r,H,V]")
                a, b_k, b_v = node.a.get_value(), node.b_k.get_value(), node.b_v.get_value()
                h, n, v = b_k.shape[-2], b_k.shape[-1], b_v.shape[-1]
                for rep, layer in layers:
                    add(f"model.layers.{layer}.self_attn.kv_b_proj", (lora.rank, a.shape[-2]),
                        (h * (n + v), lora.rank), a.dtype,
                        lambda a=a, rep=rep: _linear_a(_at(a, rep)),
                        lambda b_k=b_k, b_v=b_v, rep=rep: _kv_b_b(_at(b_k, rep), _at(b_v, rep)),
                        lambda pa, pb, rep=rep, path=path, c=a.shape[1:-1], h=h, n=n: [
                            (path + ("a",), rep, _linear_a_inv(pa, c)),
                            *zip((path + ("b_k",), path + ("b_v",)), (rep, rep), _kv_b_b_inv(pb, h, n))])
            else:
                if not isinstance(node, Adapter) or node.target != name:
                    raise ValueError(f"save_peft_adapter: adapter {where} does not look like the {name} adapter")
                _check_ndim(path, node, 2 + node.n_in, 2 + node.n_out)
                a, b = node.a.get_value(), node.b.get_value()
                n_in = int(np.prod(a.shape[1:-1]))
                n_out = int(np.prod(b.shape[2:]))
                for rep, layer in layers:
                    add(f"model.layers.{layer}.self_attn.{name}", (lora.rank, n_in), (n_out, lora.rank), a.dtype,
                        lambda a=a, rep=rep: _linear_a(_at(a, rep)), lambda b=b, rep=rep: _linear_b(_at(b, rep)),
                        _linear_unpack(path, a.shape, b.shape, rep))
            modules.add(name)
            continue

        mlp_rel = None
        if mlp_type == "dense" and len(rel) == 2 and rel[0] == "mlp":
            mlp_rel, family, hf = rel[1], "dense_mlp", "mlp"
        elif mlp_type == "sparse" and len(rel) == 3 and rel[:2] == ("mlp", "shared_experts"):
            mlp_rel, family, hf = rel[2], "shared_expert", "mlp.shared_experts"
        if mlp_rel in {f"{p}_lora" for p in _MLP}:
            name = mlp_rel.removesuffix("_lora")
            if not isinstance(node, Adapter) or node.target != name:
                raise ValueError(f"save_peft_adapter: adapter {where} does not look like the {name} adapter")
            _check_adapter(path, node, lora, family)
            _check_ndim(path, node, 3, 3)  # [L, in, r], [L, r, out]
            a, b = node.a.get_value(), node.b.get_value()
            for rep, layer in layers:
                add(f"model.layers.{layer}.{hf}.{name}", (lora.rank, a.shape[-2]), (b.shape[-1], lora.rank),
                    a.dtype, lambda a=a, rep=rep: _linear_a(_at(a, rep)),
                    lambda b=b, rep=rep: _linear_b(_at(b, rep)), _linear_unpack(path, a.shape, b.shape, rep))
            params.add(f"{hf}.{name}.weight")
            continue

        if mlp_type == "sparse" and len(rel) == 2 and rel[0] == "mlp" and rel[1] in _EXPERTS:
            if not isinstance(node, Adapter) or node.target != rel[1].removesuffix("_lora"):
                raise ValueError(f"save_peft_adapter: adapter {where} does not look like a routed-expert adapter")
            _check_adapter(path, node, lora, "routed_experts")
            _check_ndim(path, node, 4, 4)  # [L, E, in, r], [L, E, r, out]
            experts.setdefault((stack, slot), {})[_EXPERTS[rel[1]]] = (path, node)
            continue

        raise ValueError(f"save_peft_adapter: adapter {where} (in a {mlp_type} layer) is at a place this export "
                         "does not know; refusing to drop it")

    # Routed experts: gate and up fuse into one gate_up_proj adapter, so they must come together.
    for (stack, slot), parts in sorted(experts.items()):
        if set(parts) != {"gate", "up", "down"}:
            names = ", ".join(_where(p) for p, _ in parts.values())
            raise ValueError(f"save_peft_adapter: routed-expert adapters {names} come without their "
                             f"{sorted({'gate', 'up', 'down'} - set(parts))} partner(s); HF fuses gate and up "
                             "into one gate_up_proj, so this export needs all three")
        (g_path, g), (u_path, u), (d_path, d) = parts["gate"], parts["up"], parts["down"]
        a_g, b_g, a_u, b_u = g.a.get_value(), g.b.get_value(), u.a.get_value(), u.b.get_value()
        a_d, b_d = d.a.get_value(), d.b.get_value()
        _, e, dim, r = a_g.shape
        i = b_g.shape[-1]
        gate_up_vars = (g_path + ("a",), u_path + ("a",), g_path + ("b",), u_path + ("b",))
        for rep in range(repeats[stack]):
            layer = layer_of[(stack, rep, slot)]
            # gate_up_proj (the inner ParamWrapper: registered first on GlmMoeDsaExperts, so wrapped first)
            module = f"model.layers.{layer}.mlp.experts.base_layer"
            add(module, (e * 2 * r, dim), (2 * i, 2 * r * e), a_g.dtype,
                lambda a_g=a_g, a_u=a_u, rep=rep: _gate_up_a(_at(a_g, rep), _at(a_u, rep)),
                lambda b_g=b_g, b_u=b_u, rep=rep: _gate_up_b(_at(b_g, rep), _at(b_u, rep)),
                lambda pa, pb, rep=rep, module=module, names=gate_up_vars, e=e: list(zip(
                    names, (rep,) * 4, _gate_up_inv(pa, pb, e, module))))
            # down_proj (the outer ParamWrapper)
            add(f"model.layers.{layer}.mlp.experts", (e * r, a_d.shape[-2]), (b_d.shape[-1], r * e), a_d.dtype,
                lambda a_d=a_d, rep=rep: _experts_a(_at(a_d, rep)),
                lambda b_d=b_d, rep=rep: _experts_b(_at(b_d, rep)),
                lambda pa, pb, rep=rep, d_path=d_path, e=e: [(d_path + ("a",), rep, _experts_a_inv(pa, e)),
                                                             (d_path + ("b",), rep, _experts_b_inv(pb, e))])
        params.update({"mlp.experts.gate_up_proj", "mlp.experts.down_proj"})

    if covered != n_vars:
        raise ValueError(f"save_peft_adapter: the model has {n_vars} LoRA arrays but only {covered} belong to "
                         "adapters this export recognises; refusing to drop the rest")
    return entries, modules, params, bool(experts)


def _number(x: float):
    return int(x) if float(x).is_integer() else float(x)


def _config(lora, modules, params, routed, base_model_name_or_path) -> dict:
    alpha = _number(lora.alpha)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path or None,
        "revision": None,
        "inference_mode": True,
        "r": lora.rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "lora_bias": False,
        "init_lora_weights": True,
        # Leaf names: each attention name occurs once per layer and only there, and lm_head once.
        "target_modules": sorted(modules) or None,
        "target_parameters": sorted(params) or None,
        "exclude_modules": None,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {GATE_UP_PATTERN: 2 * lora.rank} if routed else {},
        "alpha_pattern": {GATE_UP_PATTERN: _number(2 * lora.alpha)} if routed else {},
    }


def save_peft_adapter(model, path: str | os.PathLike, *, base_model_name_or_path: str = "",
                      write: bool = True) -> None:
    """Writes `path/adapter_model.safetensors` and `path/adapter_config.json` for `model`'s LoRA.

    Every adapter is checked and placed before anything is written; unknown adapters raise. Files
    are written into a temporary directory beside `path`; a new `path` is then renamed into place
    whole, an existing one gets each file replaced (os.replace, weights first, config last) only
    after both are complete, so a failed export leaves a previous export untouched. (Replacing in
    an existing directory keeps its other files; only between the two renames could a concurrent
    reader see new weights beside the old config.)

    Adapters sharded over the processes of a run are gathered one layer at a time, so every process
    calls this and only the one with `write` (process 0) writes; the others just take part in the gathers.
    """
    path = os.fspath(path)
    entries, modules, params, routed = _collect(model)
    config = _config(model.opts.lora, modules, params, routed, base_model_name_or_path)
    tensors = []
    for entry in entries:
        tensors.append((f"{_PREFIX}{entry.module}.lora_A.weight", entry.lora_a))
        tensors.append((f"{_PREFIX}{entry.module}.lora_B.weight", entry.lora_b))
    names = [n for n, _ in tensors]
    if len(set(names)) != len(names):
        raise AssertionError("save_peft_adapter: duplicate tensor names")
    if not write:
        for _, t in tensors:  # the writer's order: every gather is a collective
            t.materialize()
        return
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ValueError(f"save_peft_adapter: {path} exists and is not a directory")
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".glm52-peft-", dir=parent)
    try:
        out = os.path.join(staging, "adapter")
        os.mkdir(out)  # default permissions (mkdtemp's own directory is private)
        write_safetensors(os.path.join(out, ADAPTER_WEIGHTS), tensors)
        _write_config(os.path.join(out, ADAPTER_CONFIG), config)
        if not os.path.lexists(path):
            try:
                os.rename(out, path)  # atomic: the directory appears complete
                return
            except OSError:
                if not os.path.isdir(path):  # not a concurrent creation: a real failure
                    raise
        for f in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
            os.replace(os.path.join(out, f), os.path.join(path, f))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_config(file: str, config: dict) -> None:
    with open(file, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
