"""Low-rank adapters (LoRA) on the frozen base model: `W x` becomes `W x + (alpha / r) * B(A(x))`.

A `LoRAConfig` in `ModelOptions.lora` selects the rank, alpha and target families:

  attention       q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj (every layer)
  routed_experts  gate/up/down of every routed expert: A [E,in,r], B [E,r,out], applied with
                  `lax.ragged_dot` on the expert-sorted rows the base experts use
  shared_expert   gate/up/down of the MoE layers' shared expert
  dense_mlp       gate/up/down of the dense (first_k_dense_replace) layers
  unembed         lm_head (the logits projection, also when tied to the embedding)

kv_b_proj is one target, as in HF/PEFT: one A [C, r] shared by both halves and B split into
B_k [r, H, N] and B_v [r, H, V], i.e. exactly a LoRA on HF's fused `kv_b_proj` (C -> H*(N+V)),
so adapters map one-to-one onto a PEFT `kv_b_proj` adapter. In the absorbed MLA path the key half
acts on the query (`q_nope B_k^T A^T`) and the value half on the attention output (`o_lat A B_v`).

A is random (PEFT's default: uniform in +-1/sqrt(fan_in)), B is zero, so a fresh adapter leaves
the model unchanged. Adapter arrays are `LoRA` variables, not `nnx.Param`: checkpoint I/O and the
optimizer tell them apart by type (`nnx.split(model, nnx.Param, LoRA)`). Each carries its family
(`family` metadata) and logical axis names (`out_sharding`; stacked layers get 'layers' prepended
by `nnx.vmap`). The rank axis is named 'lora_rank' and is never sharded.

Adapters draw A from the `lora` stream of the `nnx.Rngs` (falling back to `default`): build with
`nnx.Rngs(seed, lora=lora_seed)` to keep the base initialisation identical to a LoRA-free model's,
or add adapters to an existing (e.g. loaded) model with `attach_lora`.

Axis letters: E experts, r rank, C kv_lora, H heads, N qk_nope, V v_head, T sorted token rows.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from glm52_jax import choices

FAMILIES = choices.LORA_FAMILIES
RANK_AXIS = "lora_rank"
_RANK_LETTER = "z"  # einsum letter of the rank axis in derived specs


class LoRA(nnx.Variable):
    """A trainable adapter array; deliberately not an `nnx.Param`, so base-only code skips it."""


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Rank, alpha (scale = alpha / rank), target families and storage dtype of the adapters.

    `param_dtype` is the adapters' storage (master) dtype; they are cast to the activation dtype
    for the matmuls, with float32 accumulation.
    """

    rank: int
    alpha: float
    families: frozenset[str] = frozenset(FAMILIES)
    param_dtype: object = jnp.float32

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"LoRAConfig.rank: expected a positive integer, got {self.rank!r}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LoRAConfig.alpha: expected a positive number, got {self.alpha!r}")
        families = frozenset([self.families] if isinstance(self.families, str) else self.families)
        unknown = sorted(families - set(FAMILIES))
        if unknown:
            raise ValueError(f"LoRAConfig.families: unknown {unknown}; choose from {FAMILIES}")
        if not families:
            raise ValueError("LoRAConfig.families is empty; use ModelOptions(lora=None) for no LoRA")
        object.__setattr__(self, "families", families)
        object.__setattr__(self, "param_dtype", jnp.dtype(self.param_dtype))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def targets(lora: LoRAConfig | None, family: str) -> bool:
    """Whether `family` gets adapters under `lora` (None: LoRA off)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown LoRA family {family!r}; choose from {FAMILIES}")
    return lora is not None and family in lora.families


def _lora_var(value: jax.Array, axes: tuple[str | None, ...], family: str) -> LoRA:
    return LoRA(value, out_sharding=axes, eager_sharding=False, family=family)


def _init_a(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int, dtype) -> jax.Array:
    """PEFT's default A init (kaiming-uniform with a=sqrt(5)): uniform in +-1/sqrt(fan_in)."""
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(rngs.lora(), shape, jnp.float32, -bound, bound).astype(dtype)


def _einsum32(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class KernelDelta:
    """How one base kernel's LoRA delta `scale * A B` is computed from its adapter's A and the B named `b`.

    A: [*lead, *in, r] (`n_in` in-axes), B: [*lead, r, *out] -> delta [*lead, *in, *out] float32. Any leading
    axes (stacked layers, experts) may be present or already indexed away, so the same arithmetic serves a
    whole stacked kernel (`merge_lora`) and one layer's or one expert's slice of it (the streaming export).
    Hashable: a static argument of jitted code.
    """

    b: str  # the adapter's attribute holding B ("b", "b_k", "b_v")
    n_in: int
    scale: float

    def __call__(self, a: jax.Array, b: jax.Array) -> jax.Array:
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        lead = a.shape[: a.ndim - self.n_in - 1]
        in_shape, out_shape = a.shape[len(lead):-1], b.shape[len(lead) + 1:]
        a2 = a.reshape(lead + (math.prod(in_shape), a.shape[-1]))
        b2 = b.reshape(lead + (b.shape[len(lead)], math.prod(out_shape)))
        w = jnp.matmul(a2, b2, precision=jax.lax.Precision.HIGHEST)
        return w.reshape(lead + in_shape + out_shape) * self.scale


def merged_kernel(base: jax.Array, delta: jax.Array) -> jax.Array:
    """`base + delta` in float32, stored back in the base's dtype."""
    return (base.astype(jnp.float32) + delta).astype(base.dtype)


class Adapter(nnx.Module):
    """LoRA on one linear map `W: [*lead, *in, *out]`: delta(x) = scale * (x A) B.

    A: [*lead, *in, r] (random), B: [*lead, r, *out] (zero). `lead` is empty, or the experts axis
    for routed experts (then applied by `grouped_mlp.ragged_lora_delta`). `target` names the base kernel in the
    parent module, which `merge_lora` adds `scale * A B` to.
    """

    def __init__(self, lora: LoRAConfig, family: str, target: str, in_shape: tuple[int, ...],
                 in_axes: tuple[str | None, ...], out_shape: tuple[int, ...], out_axes: tuple[str | None, ...],
                 rngs: nnx.Rngs, *, lead_shape: tuple[int, ...] = (), lead_axes: tuple[str | None, ...] = ()):
        r, dt = lora.rank, lora.param_dtype
        self.target = target
        self.scale = lora.scale
        self.n_in, self.n_out = len(in_shape), len(out_shape)
        a_shape = lead_shape + in_shape + (r,)
        self.a = _lora_var(_init_a(rngs, a_shape, math.prod(in_shape), dt), lead_axes + in_axes + (RANK_AXIS,), family)
        self.b = _lora_var(jnp.zeros(lead_shape + (r,) + out_shape, dt), lead_axes + (RANK_AXIS,) + out_axes, family)

    def __call__(self, x: jax.Array, spec: str) -> jax.Array:
        """Delta of `einsum(spec, x, W)` (float32, scaled); W's letters list its in-dims first."""
        inputs, out = spec.split("->")
        x_letters, w_letters = inputs.split(",")
        if _RANK_LETTER in spec:
            raise ValueError(f"LoRA: einsum spec {spec!r} already uses the rank letter {_RANK_LETTER!r}")
        w_in, w_out = w_letters[: self.n_in], w_letters[self.n_in:]
        mid = "".join(c for c in x_letters if c not in w_in) + _RANK_LETTER
        t = _einsum32(f"{x_letters},{w_in}{_RANK_LETTER}->{mid}", x, self.a[...]).astype(x.dtype)
        return _einsum32(f"{mid},{_RANK_LETTER}{w_out}->{out}", t, self.b[...]) * self.scale

    def kernel_deltas(self) -> dict[str, KernelDelta]:
        """`{target: how scale * A B is computed}`; the delta is shaped like the base kernel."""
        return {self.target: KernelDelta("b", self.n_in, self.scale)}


class KVBAdapter(nnx.Module):
    """LoRA on HF's fused kv_b_proj (C -> H*(N+V)): shared A [C,r], B_k [r,H,N], B_v [r,H,V].

    Our base kv_b is split into `w_uk: [C,H,N]` and `w_uv: [C,H,V]`; the deltas are
    `scale * A B_k` and `scale * A B_v` on those, applied in absorbed form by `key` and `value`.
    """

    def __init__(self, lora: LoRAConfig, kv_lora: int, heads: int, nope: int, v_dim: int, rngs: nnx.Rngs):
        r, dt, fam = lora.rank, lora.param_dtype, "attention"
        self.scale = lora.scale
        self.a = _lora_var(_init_a(rngs, (kv_lora, r), kv_lora, dt), ("kv_lora", RANK_AXIS), fam)
        self.b_k = _lora_var(jnp.zeros((r, heads, nope), dt), (RANK_AXIS, "heads", "qk_dim"), fam)
        self.b_v = _lora_var(jnp.zeros((r, heads, v_dim), dt), (RANK_AXIS, "heads", "v_dim"), fam)

    def key(self, q_nope: jax.Array, spec: str | None = None) -> jax.Array:
        """Delta of the absorbed query `q_nope W_UK^T`: `[...,H,N] -> [...,H,C]` float32.

        `spec` (the base projection's) is accepted for `project`'s adapter interface and unused.
        """
        t = _einsum32("...hn,zhn->...hz", q_nope, self.b_k[...]).astype(q_nope.dtype)
        return _einsum32("...hz,cz->...hc", t, self.a[...]) * self.scale

    def value(self, out_lat: jax.Array, spec: str | None = None) -> jax.Array:
        """Delta of the value up-projection `o_lat W_UV`: `[...,H,C] -> [...,H,V]` float32."""
        t = _einsum32("...hc,cz->...hz", out_lat, self.a[...]).astype(out_lat.dtype)
        return _einsum32("...hz,zhv->...hv", t, self.b_v[...]) * self.scale

    def kernel_deltas(self) -> dict[str, KernelDelta]:
        """`{"w_uk": scale * A B_k, "w_uv": scale * A B_v}`, as `KernelDelta`s (A [C,r] is one in-axis)."""
        return {"w_uk": KernelDelta("b_k", 1, self.scale), "w_uv": KernelDelta("b_v", 1, self.scale)}


def adapter(lora: LoRAConfig | None, family: str, target: str, in_shape: tuple[int, ...],
            in_axes: tuple[str | None, ...], out_shape: tuple[int, ...], out_axes: tuple[str | None, ...],
            rngs: nnx.Rngs, **lead) -> Adapter | None:
    """An `Adapter` for `target` if `family` is enabled under `lora`, else None."""
    if not targets(lora, family):
        return None
    return Adapter(lora, family, target, in_shape, in_axes, out_shape, out_axes, rngs, **lead)


# ------------------------------------------------------------------------------------------------
# Whole-model helpers.


def lora_state(model: nnx.Module) -> nnx.State:
    """The model's adapter arrays (`LoRA` variables only)."""
    return nnx.state(model, LoRA)


def attach_lora(model: nnx.Module, lora: LoRAConfig, seed: int | jax.Array = 0) -> nnx.Module:
    """A copy of a LoRA-free `model` (e.g. a loaded checkpoint) with fresh adapters.

    The base parameters are shared with `model` (not copied); A comes from the `lora` stream seeded
    with `seed` (an int or a PRNG key), B is zero: the same adapters as the constructor builds with
    `nnx.Rngs(..., lora=seed)`. Only the adapters are computed: the base init of the throwaway
    constructor is dead code under `jit` and never materialised.
    """
    if nnx.state(model, LoRA):
        raise ValueError("attach_lora: the model already has LoRA adapters")
    opts = dataclasses.replace(model.opts, lora=lora)
    cls, cfg = type(model), model.cfg

    def build(key):
        return cls(cfg, opts, rngs=nnx.Rngs(0, lora=key))

    graphdef, _, _ = nnx.split(nnx.eval_shape(lambda: build(jax.random.key(0))), nnx.Param, LoRA)
    key = jax.random.key(seed) if isinstance(seed, int) else seed
    adapters = jax.jit(lambda key: nnx.state(build(key), LoRA))(key)
    return nnx.merge(graphdef, nnx.state(model, nnx.Param), adapters)


def kernel_adapters(model: nnx.Module) -> dict[tuple, tuple[Adapter | KVBAdapter, KernelDelta]]:
    """Path of every base kernel an adapter targets -> (that adapter, how its delta is computed).

    Raises when an adapter's kernel is not a parameter of `model` (an unembed adapter on tied embeddings:
    merging it would change the input embedding too)."""
    params = {path for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    out = {}
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, (Adapter, KVBAdapter)):
            continue
        for name, kd in node.kernel_deltas().items():
            key = tuple(path[:-1]) + (name,)
            if key not in params:
                raise ValueError(f"merge_lora: adapter {'/'.join(map(str, path))} has no base kernel {name!r} "
                                 "(an unembed adapter on tied embeddings cannot be merged)")
            out[key] = (node, kd)
    return out


def lora_free_graphdef(model: nnx.Module):
    """The graph of `model` without adapters (what a merged model is built on)."""
    opts = dataclasses.replace(model.opts, lora=None)
    cls, cfg = type(model), model.cfg
    return nnx.graphdef(nnx.eval_shape(lambda: cls(cfg, opts, rngs=nnx.Rngs(0))))


def merge_lora(model: nnx.Module) -> nnx.Module:
    """The LoRA-free model whose base kernels absorb the adapters: `W + scale * A B`.

    Used to check adapters against merged weights. It holds a second copy of every adapted kernel, so
    exports merge one tensor at a time instead (`checkpoint.hf.save_pretrained(..., merge_adapters=True)`,
    the same arithmetic).
    """
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for key, (node, kd) in kernel_adapters(model).items():
        var = params[key]
        delta = kd(node.a[...], getattr(node, kd.b)[...])
        params[key] = var.replace(merged_kernel(var.get_value(), delta))
    return nnx.merge(lora_free_graphdef(model), nnx.from_flat_state(list(params.items())))
