"""Captures megatron-core's GPTModel state-dict keys and shapes for the tiny GLM-5 config of
tests/checkpoint/test_megatron.py into tests/checkpoint/megatron_keys.json (the test's fixture).

megatron-core 0.19.2 comes with the `test` and `parity` extras (a cp312 wheel needing only numpy, packaging and
torch):

    .venv/bin/python scripts/capture_megatron_keys.py

It builds the real model on CPU (gloo, world size 1), with megatron-core's own modules throughout: the layers
come from `get_transformer_layer_with_experimental_attention_variant_spec` (the GLM-5 spec Megatron-Bridge's
GLM5Bridge selects, experimental_attention_variant="dsa"). Four things differ from a GPU run, none of which
changes a state-dict name or shape:
  - backend: the block-level spec helper insists on TransformerEngine, which does not install without CUDA, so
    the layer helper gets `LocalSpecProvider` (plus `linear()` = megatron-core's local `Linear`, the stand-in
    for TELinear it lacks) and the MLA down-projections use ColumnParallelLinear (the non-TE class
    AbsorbedMLASelfAttention accepts). Local experts are SequentialMLP and the dense pre-MLP norm is unfused;
    the TE names (TEGroupedMLP `linear_fc1.weight<x>`, fused `mlp.linear_fc1.layer_norm_weight`) are recorded
    as renames with the source lines that define them (`te_renames`);
  - `torch.cuda.current_device` returns "cpu": DSAIndexer's RotaryEmbedding asks for a CUDA device for its
    inv_freq buffer (not in the state dict);
  - the MoE token dispatcher is "allgather" (the alltoall one creates a CUDA stream); dispatchers hold no weights;
  - no CUDA RNG tracker seeding (`model_parallel_cuda_manual_seed` needs a GPU); values are irrelevant here.
Megatron-Bridge's LoRA cannot be attached here (its peft package imports transformer_engine), so its adapter
names are recorded as rules with their sources (`lora_rules`), which the test applies to the captured modules.
`--print` writes the JSON to stdout instead (the live test uses it).
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "checkpoint", "megatron_keys.json")


def build(cfg, index_topk_freq: int, index_skip_topk_offset: int):
    import megatron.core
    from megatron.core import parallel_state
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_layer_with_experimental_attention_variant_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    # DSAIndexer builds its RotaryEmbedding without `use_cpu_initialization` (dsa.py `DSAIndexer.__init__`), which
    # then asks torch.cuda for a device; on a CPU-only machine the inv_freq buffer (not in the state dict) goes to
    # the CPU instead. Nothing else is patched.
    torch.cuda.current_device = lambda: "cpu"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    n_layers = cfg.num_hidden_layers
    mc = MLATransformerConfig(
        num_layers=n_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        ffn_hidden_size=cfg.intermediate_size, normalization="RMSNorm", gated_linear_unit=True,
        add_bias_linear=False, qk_layernorm=True, multi_latent_attention=True,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_head_dim=cfg.qk_nope_head_dim,
        qk_pos_emb_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, rope_type="rope",
        num_moe_experts=cfg.n_routed_experts, moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_shared_expert_intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts,
        moe_layer_freq=[0 if t == "dense" else 1 for t in cfg.mlp_layer_types], moe_router_topk=cfg.num_experts_per_tok,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_pre_softmax=True,
        moe_grouped_gemm=False, moe_token_dispatcher_type="allgather",
        experimental_attention_variant="dsa", dsa_indexer_n_heads=cfg.index_n_heads,
        dsa_indexer_head_dim=cfg.index_head_dim, dsa_indexer_topk=cfg.index_topk,
        dsa_indexer_topk_freq=index_topk_freq, dsa_indexer_skip_topk_offset=index_skip_topk_offset,
        dsa_indexer_rope_interleaved=True, dsa_indexer_k_norm_epsilon=1e-6,
        transformer_impl="local", use_cpu_initialization=True, params_dtype=torch.float32, bf16=False,
    )
    class Backend(LocalSpecProvider):
        # The DSA spec asks `backend.linear()` for the MLA down-projections and the indexer's projections;
        # LocalSpecProvider has none, TE's is TELinear. megatron-core's own local stand-in for it is
        # post_training/modelopt/layers.py `Linear` (a torch.nn.Linear taking parallel_mode="duplicated"):
        # the same `weight` [out, in] entry.
        def linear(self):
            return Linear

    layers = get_transformer_layer_with_experimental_attention_variant_spec(mc, backend=Backend())
    # Without TE, AbsorbedMLASelfAttention accepts only ColumnParallelLinear for its down-projections
    # (absorbed_mla.py: `Unsupported linear_q_down_proj`); at tensor-parallel size 1 it is a plain
    # [out, in] `weight` too.
    for layer in layers:
        attn = layer.submodules.self_attention.submodules
        attn.linear_q_down_proj = attn.linear_kv_down_proj = ColumnParallelLinear
    spec = TransformerBlockSubmodules(layer_specs=layers, layer_norm=LocalSpecProvider().layer_norm(rms_norm=True))
    model = GPTModel(mc, spec, vocab_size=cfg.vocab_size, max_sequence_length=128, position_embedding_type="none",
                     share_embeddings_and_output_weights=False)
    return model, megatron.core.__version__


# TE-only names (the GLM-5 spec with TransformerEngine), as regex renames of the local build's keys.
TE_RENAMES = [
    {"from": r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$", "to": r".mlp.experts.\2.weight\1",
     "applies_to_dense_layers": None,
     "source": "megatron-core 0.19.2 extensions/transformer_engine_spec_provider.py:75-85 (grouped_mlp_modules -> "
               "TEGroupedMLP with TEColumnParallelGroupedLinear/TERowParallelGroupedLinear when moe_grouped_gemm); "
               "extensions/transformer_engine.py:2106 (TEGroupedLinear), :2565 (key f'{prefix}weight{gemm_idx}'); "
               "megatron-bridge 0.6.2 models/glm_moe_dsa/glm5_bridge.py:186,226 ('mlp.experts.linear_fc1.weight*')"},
    {"from": r"\.pre_mlp_layernorm\.weight$", "to": ".mlp.linear_fc1.layer_norm_weight",
     "applies_to_dense_layers": True,
     "source": "megatron-core 0.19.2 models/gpt/experimental_attention_variant_module_specs.py:497-517 (dense MLP "
               "fuses the pre-MLP norm when backend.fuse_layernorm_and_linear(), True for TE: "
               "extensions/transformer_engine_spec_provider.py:51-53; linear_fc1 = TELayerNormColumnParallelLinear, "
               "extensions/transformer_engine.py:1122, parameter layer_norm_weight); "
               "megatron-bridge 0.6.2 glm5_bridge.py:157-159"},
]


# Megatron-Bridge's LoRA names and shapes (its peft package imports transformer_engine unconditionally,
# peft/lora_layers.py:20, so adapters cannot be attached on a CPU-only machine): the rule the test applies to the
# real base modules above.
LORA_RULES = {
    "names": "<module>.adapter.linear_in.weight [r, in], <module>.adapter.linear_out.weight [out, r], (out, in) = "
             "<module>.weight's shape; CanonicalLoRA on linear_fc1: <module>.adapter.adapter_gate.* and "
             "<module>.adapter.adapter_up.* with out/2 (gate rows first); grouped experts with "
             "share_expert_adapters=False: one [E, ...] tensor per name",
    "source": "megatron-bridge 0.6.2 peft/adapter_wrapper.py:164-190 (AdapterWrapper.state_dict: wrapped module's "
              "keys unchanged, adapter under 'adapter.'); peft/utils.py:1007-1051 (ParallelLinearAdapter linear_in "
              "= (Column|Row)ParallelLinear(in, dim), linear_out = ColumnParallelLinear(dim, out)), :1834-1851 "
              "(GroupedExpertLinearAdapter shapes [E, dim, in] / [E, out, dim]); peft/canonical_lora.py:396-401 "
              "(ModuleDict adapter_up / adapter_gate, out_features // 2; forward cat([gate, up]) at :173-175); "
              "models/conversion/peft_bridge.py:92-95 (linear_in <-> lora_A, linear_out <-> lora_B)",
}


def main():
    from tests.checkpoint.test_megatron import CFG, INDEX_FREQ, INDEX_OFFSET
    model, version = build(CFG, INDEX_FREQ, INDEX_OFFSET)
    sd = model.state_dict()
    keys = {k: list(v.shape) for k, v in sd.items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    out = {
        "megatron_core_version": version,
        "built_by": "scripts/capture_megatron_keys.py: GPTModel from megatron-core's "
                    "models/gpt/experimental_attention_variant_module_specs.py:156 "
                    "(get_transformer_layer_with_experimental_attention_variant_spec, experimental_attention_variant="
                    "'dsa') with the local backend, SequentialMLP experts, CPU, gloo world size 1",
        "config": "tests/checkpoint/test_megatron.py CFG (5 layers: dense + 4 MoE, IndexShare freq 2 offset 2)",
        "te_renames": TE_RENAMES,
        "lora_rules": LORA_RULES,
        "keys": dict(sorted(keys.items())),
    }
    if "--print" in sys.argv:
        print(json.dumps(out))
        return
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"{len(keys)} keys -> {OUT}")


if __name__ == "__main__":
    main()
