"""The calibration probes: small programs a GPU times and the time estimate models, one per thing the efficiency
table assumes (`python -m glm52_jax.plan.calibrate`, run by scripts/gpu_check.sh).

Each `Probe` builds its function and its inputs from a key (random data made on the device: no host copy), so
the same program is timed on a lent GPU and compiled deviceless for the estimate. Probes:

  gemm_{n}                  bf16 [n,n] x [n,n] on random normal inputs: the `gemm` class
  dsa_index_scores          the fused indexer scoring kernel, one 512-query group x 32,768 keys x 32 x 128
  dsa_topk_select           one radix-select merge of a 512 x 8,192 score block into a running top-2048
  sparse_mla_forward        2,048 queries x top-2048 of 32,768 keys, 64 heads, C 512 + R 64
  sparse_mla_forward_backward  the same, forward + the gradients of q and the rows (the backward classes)
  grouped_matmul[_fp8|_w8a8] 16,384 rows over 32 experts of [2,048, 6,144] (GLM-5.2's expert shapes), bf16 / FP8
                            kernel dequantized / FP8 rows x FP8 kernel (class grouped_matmul_fp8)
  launch_loop               a data-dependent loop of 4,096 tiny iterations: the launch floor + a sync each
  forward_{kernels}_{L}     the bench model's token_logprobs (the h200 measurement's config) at L tokens

Axis letters: as in the modules each probe calls.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

# The bench model of ../shared/research/h200_measurements.md (4 layers, every one with a full indexer).
BENCH_CONFIG = {
    "model_type": "glm_moe_dsa", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 8, "q_lora_rank": 128, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32, "qk_head_dim": 64, "head_dim": 32, "v_head_dim": 32, "index_n_heads": 4,
    "index_head_dim": 64, "index_topk": 256, "indexer_types": ["full"] * 4,
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "first_k_dense_replace": 1,
    "intermediate_size": 512, "moe_intermediate_size": 128, "n_routed_experts": 16, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "vocab_size": 4096, "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


@dataclasses.dataclass(frozen=True)
class Probe:
    """A program to time and estimate: `make()` -> (fn, inputs(key) -> the concrete arguments)."""

    name: str
    measures: str  # the table entry it calibrates: a class, "launch", or "forward" (a whole-model check)
    make: Callable[[], tuple[Callable, Callable]]
    flops: float = 0.0  # the useful FLOPs (what a fraction of peak is taken of); 0 for memory-bound probes
    bytes: float = 0.0  # the bytes a memory-bound probe must move
    trips: dict[str, float] = dataclasses.field(default_factory=dict)  # its data-dependent loops' trips
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def abstract(self):
        """(fn, the arguments as ShapeDtypeStructs)."""
        import jax

        fn, inputs = self.make()
        return fn, jax.eval_shape(inputs, jax.random.key(0))


def _normal(key, shape, dtype, scale=1.0):
    import jax

    return (jax.random.normal(key, shape, "float32") * scale).astype(dtype)


def gemm(n: int = 8192) -> Probe:
    def make():
        import jax
        import jax.numpy as jnp

        def inputs(key):
            a, b = jax.random.split(key)
            return _normal(a, (n, n), jnp.bfloat16), _normal(b, (n, n), jnp.bfloat16)

        return (lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.bfloat16)), inputs

    return Probe(f"gemm_{n}", "gemm", make, flops=2.0 * n ** 3, meta={"n": n})


def index_scores(queries: int = 512, keys: int = 32768, heads: int = 32, dim: int = 128) -> Probe:
    def make():
        import jax
        import jax.numpy as jnp

        from glm52_jax.kernels import indexer as kernel

        def inputs(key):
            a, b, c = jax.random.split(key, 3)
            return (_normal(a, (1, queries, heads, dim), jnp.bfloat16),
                    _normal(b, (1, queries, heads), jnp.float32, heads ** -0.5),
                    _normal(c, (1, keys, dim), jnp.bfloat16))

        def fn(q, w, k):  # every key visible to every query (the queries sit after the keys)
            return kernel.index_scores(q, w, jnp.full((queries,), keys, jnp.int32), k,
                                       jnp.arange(keys, dtype=jnp.int32), 0, keys, scale=dim ** -0.5)

        return fn, inputs

    return Probe("dsa_index_scores", "dsa_index_scores", make, flops=2.0 * queries * keys * heads * dim,
                 meta={"queries": queries, "keys": keys, "heads": heads, "dim": dim})


def topk_select(rows: int = 512, block: int = 8192, topk: int = 2048) -> Probe:
    def make():
        import jax
        import jax.numpy as jnp

        from glm52_jax.kernels import indexer_select as select

        keep = select.next_pow2(topk)

        def inputs(key):
            a, b = jax.random.split(key)
            values = jnp.sort(_normal(a, (1, rows, keep + 1), jnp.float32), axis=-1)
            return (values, jnp.broadcast_to(jnp.arange(keep + 1, dtype=jnp.int32), values.shape),
                    _normal(b, (1, rows, block), jnp.float32))

        def fn(values, indices, scores):
            return select.merge_select((values, indices), scores, jnp.int32(keep + 1))

        return fn, inputs

    keep = 1 << max(0, (topk - 1).bit_length())
    moved = rows * ((keep + 1) * 8 * 2 + block * 4)  # running values + indices read and written, the block read
    return Probe("dsa_topk_select", "dsa_topk_select", make, bytes=float(moved),
                 meta={"rows": rows, "block": block, "topk": topk, "keep": keep})


def _mla(queries: int, keys: int, heads: int, latent: int, rope: int, topk: int, backward: bool) -> Callable:
    def make():
        import jax
        import jax.numpy as jnp

        from glm52_jax.kernels import interpret
        from glm52_jax.kernels.sparse_mla import encode_rows, sparse_mla_tables

        def inputs(key):
            ks = jax.random.split(key, 6)
            offset = jax.random.randint(ks[4], (1, queries, 1), 0, keys)
            stride = 2 * jax.random.randint(ks[5], (1, queries, 1), 0, keys // 2) + 1  # odd: distinct rows
            rows = ((offset + stride * jnp.arange(topk)) % keys).astype(jnp.int32)
            return (_normal(ks[0], (1, queries, heads, latent), jnp.bfloat16),
                    _normal(ks[1], (1, queries, heads, rope), jnp.bfloat16),
                    _normal(ks[2], (keys, latent), jnp.bfloat16), _normal(ks[3], (keys, rope), jnp.bfloat16), rows)

        def forward(q_lat, q_rope, kv, kr, rows):
            codes = encode_rows(rows, rows >= 0)
            return sparse_mla_tables(q_lat, q_rope, (kv,), (kr,), codes, scale=0.04, interpret=interpret())[0]

        if not backward:
            return forward, inputs

        def grads(q_lat, q_rope, kv, kr, rows):
            def loss(*args):
                return jnp.sum(forward(*args, rows).astype(jnp.float32))
            return jax.grad(loss, argnums=(0, 1, 2, 3))(q_lat, q_rope, kv, kr)

        return grads, inputs

    return make


def sparse_mla(queries: int = 2048, keys: int = 32768, heads: int = 64, latent: int = 512, rope: int = 64,
               topk: int = 2048, backward: bool = False) -> Probe:
    n = queries * heads * topk
    forward_flops = 2.0 * n * (2 * latent + rope)
    backward_flops = 2.0 * n * (3 * (latent + rope) + 2 * latent)  # recompute + dq + per-slot row gradients
    meta = {"queries": queries, "keys": keys, "heads": heads, "latent": latent, "rope": rope, "topk": topk}
    if backward:
        return Probe("sparse_mla_forward_backward", "sparse_mla_backward",
                     _mla(queries, keys, heads, latent, rope, topk, True), flops=forward_flops + backward_flops,
                     meta=meta)
    return Probe("sparse_mla_forward", "sparse_mla_forward", _mla(queries, keys, heads, latent, rope, topk, False),
                 flops=forward_flops, meta=meta)


def grouped_matmul(rows: int = 16384, experts: int = 32, k: int = 6144, n: int = 2048, fp8: bool = False,
                   w8a8: bool = False) -> Probe:
    """The routed experts' kernel: bf16, an FP8 kernel dequantized as loaded (`fp8`), or FP8 rows times FP8 kernels
    on FP8 MMA (`w8a8`: class grouped_matmul_fp8, model.expert_dtype=fp8)."""
    fp8 = fp8 or w8a8

    def make():
        import jax
        import jax.numpy as jnp

        from glm52_jax.kernels import grouped_matmul as gm

        sizes = jnp.full((experts,), rows // experts, jnp.int32)  # balanced routing

        def inputs(key):
            a, b, c = jax.random.split(key, 3)
            x = _normal(a, (rows, k), jnp.bfloat16)
            if not fp8:
                return x, _normal(b, (experts, k, n), jnp.bfloat16, 0.02)
            scales = jnp.abs(_normal(c, (experts, -(-k // 128), -(-n // 128)), jnp.float32)) * 1e-3 + 1e-3
            return x, _normal(b, (experts, k, n), jnp.float8_e4m3fn), scales

        if w8a8:
            return (lambda x, v, s: gm.grouped_matmul_w8a8(x, v, s, (128, 128), sizes)), inputs
        if fp8:
            return (lambda x, v, s: gm.grouped_matmul_fp8(x, v, s, (128, 128), sizes)), inputs
        return (lambda x, w: gm.grouped_matmul(x, w, sizes)), inputs

    name = "grouped_matmul" + ("_w8a8" if w8a8 else "_fp8" if fp8 else "")
    return Probe(name, "grouped_matmul_fp8" if w8a8 else "grouped_matmul", make, flops=2.0 * rows * k * n,
                 meta={"rows": rows, "experts": experts, "k": k, "n": n, "fp8": fp8, "w8a8": w8a8})


def launch_loop(iterations: int = 4096) -> Probe:
    """A `fori_loop` of data-dependent count (the key loops' shape) over a tiny body: per iteration a few kernels,
    each far below the launch floor, and one host sync."""
    from glm52_jax.model.loop_scopes import CAUSAL_KEY_LOOP

    def make():
        import jax
        import jax.numpy as jnp

        def inputs(key):
            return _normal(key, (256,), jnp.float32), jnp.int32(iterations)

        def fn(x, count):
            with jax.named_scope(CAUSAL_KEY_LOOP):
                return jax.lax.fori_loop(0, count, lambda i, v: jnp.sin(v) * 0.5 + jnp.cos(v[::-1]), x)

        return fn, inputs

    return Probe("launch_loop", "launch", make, trips={CAUSAL_KEY_LOOP: float(iterations)},
                 meta={"iterations": iterations})


def forward(tokens: int, kernels: str = "reference", config: dict | None = None) -> Probe:
    """The bench model's `token_logprobs` on [1, tokens] random ids (weights normal(0, 0.02), norms 1)."""
    from glm52_jax.config import ModelConfig
    from glm52_jax.model.loop_scopes import CAUSAL_KEY_LOOP
    from glm52_jax.model.options import ModelOptions
    from glm52_jax.plan import loop_trips

    hf = dict(config or BENCH_CONFIG)
    cfg = ModelConfig.from_hf_dict(hf)
    opts = ModelOptions(kernels=kernels)
    counter = loop_trips.Counter(loop_trips.Shapes(opts.indexer_query_block, opts.indexer_key_block, kernels, 1,
                                                   opts.context_parallel, gpu=True))
    counter.whole_sequence(tokens)
    trips = counter.result()["trips"]

    def make():
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from glm52_jax.model import transformer

        graphdef, shapes = nnx.split(nnx.eval_shape(lambda: transformer.GlmMoeDsa(cfg, opts, rngs=nnx.Rngs(0))))

        def inputs(key):
            keys = iter(jax.random.split(key, len(jax.tree.leaves(shapes)) + 1))

            def fill(x):
                if not jnp.issubdtype(x.dtype, jnp.floating):
                    return jnp.zeros(x.shape, x.dtype)
                if len(x.shape) == 1 or (len(x.shape) == 2 and x.shape[0] < 8):  # norms (and stacked norms): 1
                    return jnp.ones(x.shape, x.dtype)
                return _normal(next(keys), x.shape, x.dtype, 0.02)

            ids = jax.random.randint(next(keys), (1, tokens), 0, cfg.vocab_size, jnp.int32)
            return jax.tree.map(fill, shapes), ids

        def fn(state, ids):
            return transformer.token_logprobs(nnx.merge(graphdef, state), ids)

        return fn, inputs

    return Probe(f"forward_{kernels}_{tokens}", "forward", make, trips={CAUSAL_KEY_LOOP: trips[CAUSAL_KEY_LOOP]},
                 meta={"tokens": tokens, "kernels": kernels, "hf_config": hf})


def calibration_probes(smoke: bool = False) -> list[Probe]:
    """Every probe of a calibration run, cheapest first; `smoke`: tiny shapes (CPU, interpret mode)."""
    if smoke:
        return [gemm(256), index_scores(64, 512, 2, 16), topk_select(16, 256, 32),
                sparse_mla(16, 256, 4, 32, 16, 32), sparse_mla(16, 256, 4, 32, 16, 32, backward=True),
                grouped_matmul(256, 4, 128, 128), grouped_matmul(256, 4, 128, 128, w8a8=True), launch_loop(16),
                forward(256, "reference")]
    return [gemm(), index_scores(), topk_select(), sparse_mla(), sparse_mla(backward=True), grouped_matmul(),
            grouped_matmul(fp8=True), grouped_matmul(w8a8=True), launch_loop(),
            *[forward(n, k) for k in ("reference", "pallas") for n in (4096, 16384, 65536)],
            forward(131072, "pallas")]


def useful_rate(probe: Probe, seconds: float) -> float:
    """FLOP/s (a FLOP probe) or B/s (a memory probe) the measured `seconds` amount to."""
    work = probe.flops or probe.bytes
    return work / seconds if seconds > 0 and work else math.nan
