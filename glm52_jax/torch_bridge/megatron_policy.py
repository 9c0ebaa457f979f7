"""Our policy as a megatron-core GPTModel in torch (float32, CPU), with Megatron-Bridge's LoRA adapters.

    sd = load_megatron_state(path)                    # a GPTModel state dict: base + LoRA (checkpoint/megatron.py)
    gpt = build_policy(cfg, lora, sd)                 # megatron-core's own modules, weights loaded, LoRA trainable

The model is the GLM-5 GPTModel Megatron-Bridge's GLM5Bridge builds (MLA + DSA via
`experimental_attention_variant="dsa"`, MoE with a shared expert and a sigmoid router with expert bias), with
megatron-core's local modules (`megatron_cpu.py` holds every CPU workaround). Its settings come from our
`ModelConfig` as GLM5Bridge derives them from the HF config (`megatron_config`); the weights arrive as a
Megatron state dict written by `checkpoint.megatron.to_megatron` in the local layout
(`LOCAL_LAYOUT`: SequentialMLP experts, unfused dense pre-MLP norm), so the name map is exercised end to end.

LoRA (`attach_adapters`): Megatron-Bridge's CanonicalLoRA at tensor-parallel size 1, one rank-r adapter per
targeted linear, `<module>.adapter.linear_in.weight [r, in]` and `.linear_out.weight [out, r]`, linear_fc1's gate
and up halves as `adapter.adapter_gate` / `adapter.adapter_up`; the output gains `alpha/r * out(in(x))`
(peft/lora_layers.py `LoRALinear`, canonical_lora.py `LoRALinearSplitFC1UpGate`: cat([gate, up])). Which modules
get one is read off the map (`megatron_shapes(..., base=False)`), so the names are the map's by construction. One
module differs: megatron's AbsorbedMLASelfAttention never calls `linear_kv_up_proj`, it reads its `.weight` and
absorbs the key half into the query and the value half into the output (absorbed_mla.py `_get_kv_up_weights`);
an output-side adapter there would be silently skipped (Megatron-Bridge's wrapper, which has no `.weight`, would
fail). Its adapter therefore acts through the weight: `weight` reads `W + alpha/r * linear_out @ linear_in`, the
same linear map, so the absorbed path uses exactly the adapted kv_b (as our absorbed MLA does).

Axis letters: r LoRA rank, V vocab.
"""

from __future__ import annotations

import numpy as np

from glm52_jax.checkpoint.megatron import MegatronLayout

# The layout the local (CPU) build has: SequentialMLP experts (`local_experts.<x>`), the dense layers' pre-MLP
# norm as `pre_mlp_layernorm` (TE would fuse it into linear_fc1).
LOCAL_LAYOUT = MegatronLayout(experts="sequential", fused_dense_norm=False)
_EXTRA_STATE = "._extra_state"  # megatron's per-module (TE FP8) metadata: None in the local modules


def index_schedule(indexer_types) -> tuple[int, int]:
    """(dsa_indexer_topk_freq, dsa_indexer_skip_topk_offset) giving our per-layer indexer_types under megatron's
    rule (dsa.py `is_dsa_skip_topk_layer`); raises if no (freq, offset) gives it (Megatron has no per-layer list)."""
    from megatron.core.transformer.experimental_attention_variant.dsa import is_dsa_skip_topk_layer

    n = len(indexer_types)
    want = [t == "shared" for t in indexer_types]
    for freq in range(1, n + 1):
        for offset in range(n + 1):
            if [is_dsa_skip_topk_layer(i + 1, offset, freq) for i in range(n)] == want:
                return freq, offset
    raise ValueError(f"indexer_types {list(indexer_types)} is no (dsa_indexer_topk_freq, dsa_indexer_skip_topk_offset) "
                     "schedule of megatron-core's; the Megatron reference cannot build it")


def megatron_config(cfg):
    """The MLATransformerConfig of our `ModelConfig`, as GLM5Bridge's provider sets it (float32, CPU settings).

    Megatron has one `layernorm_epsilon` for every RMSNorm (GLM5Bridge: HF rms_norm_eps), including the q / kv
    latent norms that HF's GlmMoeDsaAttention builds with its RMSNorm default 1e-6; `build_model` sets those two
    (docs/DESIGN.md, parity)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from glm52_jax.torch_bridge.megatron_cpu import CPU_CONFIG

    problems = []
    if cfg.rope.rope_type != "default":
        problems.append(f"rope_type {cfg.rope.rope_type!r} (only the default RoPE is mapped to megatron's 'rope')")
    if cfg.tie_word_embeddings:
        problems.append("tie_word_embeddings=True (GLM-5's output layer is untied)")
    if not cfg.norm_topk_prob and cfg.num_experts_per_tok > 1:
        problems.append("norm_topk_prob=False (megatron always normalises sigmoid top-k weights when k > 1)")
    if cfg.n_group > 1 and cfg.num_experts_per_tok // cfg.topk_group != 2:
        problems.append(f"group routing with num_experts_per_tok // topk_group = "
                        f"{cfg.num_experts_per_tok // cfg.topk_group} (megatron scores a group by its top "
                        "num_experts_per_tok // topk_group experts, HF by its top 2)")
    if problems:
        raise ValueError(f"the Megatron reference cannot build this model: {'; '.join(problems)}")
    freq, offset = index_schedule(cfg.indexer_types)
    config = MLATransformerConfig(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        ffn_hidden_size=cfg.intermediate_size, normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False,
        # MLA: megatron's qk_head_dim is HF's qk_nope_head_dim; RoPE interleaved (absorbed_mla.py passes
        # mla_rotary_interleaved=True), softmax scale 1/sqrt(nope + rope) as HF's.
        multi_latent_attention=True, qk_layernorm=True, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_head_dim=cfg.qk_nope_head_dim, qk_pos_emb_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        rope_type="rope", rotary_base=cfg.rope.rope_theta,
        # MoE: sigmoid scores + expert bias for the choice, weights normalised and scaled (HF GlmMoeDsaTopkRouter).
        num_moe_experts=cfg.n_routed_experts, moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_shared_expert_intermediate_size=(cfg.moe_intermediate_size * cfg.n_shared_experts
                                             if cfg.n_shared_experts else None),
        moe_layer_freq=[int(t == "sparse") for t in cfg.mlp_layer_types], moe_router_topk=cfg.num_experts_per_tok,
        moe_router_num_groups=cfg.n_group if cfg.n_group > 1 else None,
        moe_router_group_topk=cfg.topk_group if cfg.n_group > 1 else None,
        moe_router_topk_scaling_factor=cfg.routed_scaling_factor, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0, moe_router_dtype="fp32",
        moe_router_pre_softmax=True, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False,
        # DSA (GLM5Bridge's settings): interleaved indexer RoPE as HF's GlmMoeDsaIndexer, LayerNorm eps 1e-6,
        # ReLU on the per-head scores (megatron's default, HF's F.relu), no indexer loss.
        experimental_attention_variant="dsa", dsa_indexer_n_heads=cfg.index_n_heads,
        dsa_indexer_head_dim=cfg.index_head_dim, dsa_indexer_topk=cfg.index_topk,
        dsa_indexer_topk_freq=freq, dsa_indexer_skip_topk_offset=offset, dsa_indexer_rope_interleaved=True,
        dsa_indexer_k_norm_epsilon=1e-6, dsa_indexer_scoring_relu=True, dsa_indexer_loss_coeff=0.0,
        params_dtype=torch.float32, bf16=False, fp16=False, perform_initialization=False,
        hidden_dropout=0.0, attention_dropout=0.0, **CPU_CONFIG)
    return config


# ------------------------------------------------------------------------------------------------
# Megatron-Bridge's LoRA adapters.


def _adapter_classes():
    import torch

    class LoRAAdapter(torch.nn.Module):
        """ParallelLinearAdapter at tensor-parallel size 1: `scale * linear_out(linear_in(x))`."""

        def __init__(self, n_in: int, n_out: int, rank: int, scale: float):
            super().__init__()
            self.linear_in = torch.nn.Linear(n_in, rank, bias=False)  # weight [r, in] = PEFT lora_A
            self.linear_out = torch.nn.Linear(rank, n_out, bias=False)  # weight [out, r] = PEFT lora_B
            self.scale = scale

        def forward(self, x):
            return self.linear_out(self.linear_in(x)) * self.scale

        def delta_weight(self):
            """The same map as a weight `[out, in]`."""
            return (self.linear_out.weight @ self.linear_in.weight) * self.scale

    return LoRAAdapter


def _add_to_output(module, adapters: dict) -> None:
    """Megatron-Bridge's LoRALinear / LoRALinearSplitFC1UpGate: the module's output gains the adapters' outputs
    (one, or gate and up concatenated in fc1's [gate; up] row order). A forward hook keeps the module itself (and
    its state-dict names) as megatron built it; `module.adapter` gives the adapters Bridge's names."""
    import torch

    if list(adapters) == [None]:
        module.adapter = adapters[None]
        parts = [module.adapter]
    else:
        module.adapter = torch.nn.ModuleDict({f"adapter_{p}": a for p, a in adapters.items()})
        parts = [module.adapter["adapter_gate"], module.adapter["adapter_up"]]

    def hook(mod, args, kwargs, output):
        x = args[0] if args else kwargs["input_"]
        out, bias = output
        delta = parts[0](x) if len(parts) == 1 else torch.cat([p(x) for p in parts], dim=-1)
        return out + delta, bias

    module.register_forward_hook(hook, with_kwargs=True)


def _add_to_weight(module, adapter) -> None:
    """The adapter folded into the weight megatron reads: `module.weight` becomes `W + delta` (W stays the module's
    `weight` parameter, so the state dict keeps its name; autograd flows into the adapter). The module's class is
    swapped for a subclass with that property, as torch.nn.utils.parametrize does, without renaming the entry."""
    base = type(module)

    class AdaptedWeight(base):
        @property
        def weight(self):
            return self._parameters["weight"] + self.adapter.delta_weight()

    AdaptedWeight.__name__ = f"{base.__name__}WithLoRAWeight"
    module.adapter = adapter
    module.__class__ = AdaptedWeight


def attach_adapters(gpt, shapes: dict[str, tuple[int, ...]], scale: float) -> list[str]:
    """Adds a LoRA adapter on every module `shapes` (Megatron LoRA names -> shapes, as `megatron_shapes(...,
    base=False)` lists them) names; returns the modules adapted. The adapters' values are zeros until loaded."""
    LoRAAdapter = _adapter_classes()
    modules: dict[str, dict] = {}
    for name, shape in shapes.items():
        module, _, rest = name.partition(".adapter.")
        part = rest.split(".")[0].removeprefix("adapter_") if rest.startswith("adapter_") else None
        which = "in" if name.endswith(".linear_in.weight") else "out"
        modules.setdefault(module, {}).setdefault(part, {})[which] = tuple(shape)
    for module, parts in modules.items():
        target = gpt.get_submodule(module)
        adapters = {p: LoRAAdapter(s["in"][1], s["out"][0], s["in"][0], scale).to(next(target.parameters()).dtype)
                    for p, s in parts.items()}
        if module.endswith(".self_attention.linear_kv_up_proj"):
            _add_to_weight(target, adapters[None])
        else:
            _add_to_output(target, adapters)
    return sorted(modules)


# ------------------------------------------------------------------------------------------------
# The model.


def build_model(cfg, *, latent_norm_eps: float):
    """An empty GPTModel for `cfg` (call inside `megatron_cpu.cpu_runtime()`), q / kv latent norms at
    `latent_norm_eps`, in eval mode (no dropout, no auxiliary losses; gradients still flow)."""
    from megatron.core.models.gpt import GPTModel

    from glm52_jax.torch_bridge.megatron_cpu import local_dsa_block_spec

    config = megatron_config(cfg)
    gpt = GPTModel(config, local_dsa_block_spec(config), vocab_size=cfg.vocab_size,
                   max_sequence_length=cfg.max_position_embeddings, position_embedding_type="none",
                   share_embeddings_and_output_weights=False)
    for name, module in gpt.named_modules():
        if name.endswith((".self_attention.q_layernorm", ".self_attention.kv_layernorm")):
            module.eps = latent_norm_eps
    return gpt.eval()


def load_weights(gpt, sd: dict[str, np.ndarray]) -> None:
    """Loads the Megatron state dict `sd` (numpy) into `gpt`: exactly its tensors (`_extra_state` aside), float32;
    everything but the adapters frozen. Raises naming the first tensors that are missing or left over."""
    import torch

    names = {k for k in gpt.state_dict() if not k.endswith(_EXTRA_STATE)}
    missing, extra = sorted(names - set(sd)), sorted(set(sd) - names)
    if missing or extra:
        raise ValueError(f"the Megatron state dict does not fit the built GPTModel: missing {missing[:3]}, "
                         f"unexpected {extra[:3]}")
    tensors = {k: torch.from_numpy(np.ascontiguousarray(np.asarray(v, np.float32))) for k, v in sd.items()}
    result = gpt.load_state_dict(tensors, strict=False)
    left = [k for k in result.missing_keys if not k.endswith(_EXTRA_STATE)] + list(result.unexpected_keys)
    if left:
        raise AssertionError(f"GPTModel.load_state_dict left {left[:3]}")  # the name check above says otherwise
    for name, param in gpt.named_parameters():
        param.requires_grad_(".adapter." in name)


def build_policy(cfg, sd: dict[str, np.ndarray], lora_shapes: dict[str, tuple[int, ...]], *, scale: float,
                 latent_norm_eps: float):
    """The GPTModel with Bridge LoRA adapters (`lora_shapes`, scale alpha/r) and every tensor of `sd` loaded."""
    gpt = build_model(cfg, latent_norm_eps=latent_norm_eps)
    attach_adapters(gpt, lora_shapes, scale)
    load_weights(gpt, sd)
    return gpt


def adapter_gradients(gpt) -> dict[str, np.ndarray]:
    """d(loss)/d(adapter) of every LoRA tensor after `backward`, under its Megatron name (float32; zeros where
    no gradient reached it)."""
    out = {}
    for name, param in gpt.named_parameters():
        if ".adapter." in name:
            grad = param.grad
            out[name] = (np.zeros(tuple(param.shape), np.float32) if grad is None
                         else grad.detach().numpy().astype(np.float32))
    return out
