"""The fixed bench model of `python -m benchmarks.run` (issue 7) and its fast random init; other benchmarks
(`topk_ties`, `kernels_gpu`) measure the same model."""

from __future__ import annotations


def bench_config():
    """The fixed bench model of issue 7 (keep it fixed so numbers stay comparable across runs).

    Given by the issue: vocab 4096, hidden 256, intermediate 512, moe_intermediate 128, 4 layers
    (1 dense + 3 MoE), 8 heads, q_lora 128, kv_lora 64, qk_rope 32, qk_nope 32, v_head 32, 16
    routed experts top-2 + 1 shared, indexer 4 heads x 64, index_topk 256. Our choices for the rest:
    plain top-2 routing (n_group 1, as GLM-5.2), IndexShare layers full/full/shared/full (tiny()'s
    freq-2 schedule), 256K positions so the forward can keep doubling; other fields from `tiny()`.
    """
    from glm52_jax.config import derive_indexer_types, tiny

    return tiny(vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=8,
                q_lora_rank=128, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
                n_routed_experts=16, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                index_n_heads=4, index_head_dim=64, index_topk=256,
                indexer_types=derive_indexer_types(4, freq=2, offset=2), max_position_embeddings=262144)



def _ids(seq_len: int, vocab: int):
    import numpy as np
    return np.random.default_rng(0).integers(0, vocab, (1, seq_len)).astype(np.int32)


def fast_model(cfg, opts, seed: int = 0, weight_std: float = 0.02, norm_std: float = 0.0, bias_std: float = 0.0):
    """A `GlmMoeDsa` with numpy-random weights: normal(0, weight_std) matrices, norms 1 + norm_std * normal,
    biases bias_std * normal, LoRA A normal(0, 1/sqrt(fan_in)) and B zero (fresh adapters).

    Building the model eagerly runs ~15 s of tiny per-op compiles for the bench model; this takes
    the shapes from `nnx.eval_shape` and fills them on the host in well under a second.
    """
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import glm52_jax
    from glm52_jax.model.lora import LoRA

    abstract = nnx.eval_shape(lambda: glm52_jax.GlmMoeDsa(cfg, opts, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    rng = np.random.default_rng(seed)
    flat = []
    for path, var in nnx.to_flat_state(state):
        shape, dtype = tuple(var.get_value().shape), var.get_value().dtype
        names = [str(p) for p in path]
        noise = rng.standard_normal(shape, dtype=np.float32)
        if isinstance(var, LoRA):
            value = np.zeros(shape, np.float32) if names[-1].startswith("b") else noise / np.sqrt(shape[-2])
        elif names[-1] == "weight" and any("norm" in n for n in names):
            value = 1.0 + norm_std * noise
        elif names[-1] in ("bias", "e_score_correction_bias"):
            value = bias_std * noise
        else:
            value = weight_std * noise
        flat.append((path, var.replace(jnp.asarray(value, dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _build(cfg, opts):
    return fast_model(cfg, opts)
