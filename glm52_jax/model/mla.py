"""Multi-head latent attention with DSA (HF `GlmMoeDsaAttention`), run in absorbed form.

Projections follow HF exactly: q = q_b(rmsnorm(q_a(x))) split per head into [nope | rope];
[c_kv | k_rope] = kv_a(x) with c_kv RMS-normalised; kv_b maps c_kv to per-head [k_nope | v].
kv_b is stored split as W_UK: [C, H, nope] and W_UV: [C, H, v], which is what the absorbed path
uses: q_lat = q_nope W_UK^T (C wide), attend over [c_kv ; k_rope], out = latent W_UV, then o_proj.

Axis letters: B batch, S sequence, D model, Q q_lora, C kv_lora, H heads, N qk_nope, R rope, V v_head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from glm52_jax import positions as rope_lib
from glm52_jax.config import ModelConfig
from glm52_jax.model import context_parallel as context
from glm52_jax.model import shared_cache
from glm52_jax.model.indexer import Indexer, cached_topk, merge_topk, rotates, streaming_topk
from glm52_jax.model.kv_cache import LayerCacheView
from glm52_jax.model.layers import RMSNorm, param, project
from glm52_jax.model.lora import KVBAdapter, adapter, targets
from glm52_jax.model.options import ModelOptions
from glm52_jax.model.shared_cache import SharedLayerView
from glm52_jax.model.sparse_attention import array_rows, cached_rows, sparse_mla_rows
from glm52_jax.parallel.rules import constrain

# The q / kv latent RMSNorms' epsilon: HF glm_moe_dsa builds them with its RMSNorm default (1e-6), not
# config.rms_norm_eps. megatron-core, vLLM and HF's glm5_next use rms_norm_eps there (docs/DESIGN.md, parity);
# `ModelOptions.latent_norm_eps` picks another value.
LATENT_NORM_EPS = 1e-6


def latent_norm_eps(opts: ModelOptions) -> float:
    """The q / kv latent RMSNorms' epsilon under `opts`."""
    return LATENT_NORM_EPS if opts.latent_norm_eps is None else opts.latent_norm_eps


class Attention(nnx.Module):
    """One layer's MLA + (for 'full' layers) its indexer."""

    def __init__(self, cfg: ModelConfig, has_indexer: bool, opts: ModelOptions, rngs: nnx.Rngs):
        dt = opts.param_dtype
        h, n, r, v, c = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                         cfg.kv_lora_rank)
        self.cfg = cfg
        self.opts = opts
        self.q_a_proj = param(rngs, (cfg.hidden_size, cfg.q_lora_rank), ("embed", "q_lora"), dt)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, latent_norm_eps(opts), "q_lora", dt)
        self.q_b_proj = param(rngs, (cfg.q_lora_rank, h, n + r), ("q_lora", "heads", "qk_dim"), dt)
        self.kv_a_proj_with_mqa = param(rngs, (cfg.hidden_size, c + r), ("embed", "kv_lora"), dt)
        self.kv_a_layernorm = RMSNorm(c, latent_norm_eps(opts), "kv_lora", dt)
        self.w_uk = param(rngs, (c, h, n), ("kv_lora", "heads", "qk_dim"), dt)
        self.w_uv = param(rngs, (c, h, v), ("kv_lora", "heads", "v_dim"), dt)
        self.o_proj = param(rngs, (h, v, cfg.hidden_size), ("heads", "v_dim", "embed"), dt)
        self.indexer = Indexer(cfg, dt, rngs) if has_indexer else None
        # LoRA ("attention" family); None when off. The indexer gets none (its top-k is not
        # differentiated, as in HF/slime).
        lora, d, q = opts.lora, cfg.hidden_size, cfg.q_lora_rank
        self.q_a_proj_lora = adapter(lora, "attention", "q_a_proj", (d,), ("embed",), (q,), ("q_lora",), rngs)
        self.q_b_proj_lora = adapter(lora, "attention", "q_b_proj", (q,), ("q_lora",), (h, n + r),
                                     ("heads", "qk_dim"), rngs)
        self.kv_a_proj_with_mqa_lora = adapter(lora, "attention", "kv_a_proj_with_mqa", (d,), ("embed",), (c + r,),
                                               ("kv_lora",), rngs)
        self.kv_b_proj_lora = KVBAdapter(lora, c, h, n, v, rngs) if targets(lora, "attention") else None
        self.o_proj_lora = adapter(lora, "attention", "o_proj", (h, v), ("heads", "v_dim"), (d,), ("embed",), rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, positions: jax.Array,
                 prev_topk: jax.Array | None, cache: LayerCacheView | None = None):
        """One layer's attention over this chunk's tokens and (with a cache) all earlier ones.

        x: [B,S,D] (normed); cos/sin: [.,S,R/2]; positions: [S] int32 of the chunk's tokens.
        cache: None (the chunk is the whole sequence) or a read-only view of this layer's cache
        holding `cache.length` earlier tokens; the chunk sits at slots `length .. length+S-1`; or a
        `SharedLayerView` (one prompt cache shared by the B rows plus their suffixes, shared_cache.py).
        Returns (y [B,S,D], top-k [B,S,K] in key-slot space, this chunk's cache entries
        (c_kv [B,S,C], k_rope [B,S,R], indexer key [B,S,I] or None) for the caller to write).
        """
        cfg = self.cfg
        q_resid = self.q_a_layernorm(project(x, self.q_a_proj, "bsd,dq->bsq", self.q_a_proj_lora))
        kv = project(x, self.kv_a_proj_with_mqa, "bsd,dc->bsc", self.kv_a_proj_with_mqa_lora)
        c_kv = self.kv_a_layernorm(kv[..., : cfg.kv_lora_rank])
        k_rope = rope_lib.apply_interleaved_rope(kv[..., cfg.kv_lora_rank:], cos, sin)
        iq = iw = ik = None
        if self.indexer is not None:
            # FP8's own selection rotates q and k first (Hadamard, as DeepSeek's reference): the cache holds rotated
            # keys. Rescored candidates are not rotated: the rescoring then scores bf16's own values (model.indexer).
            iq, ik, iw = self.indexer.project(x, q_resid, cos, sin,
                                              rotate=rotates(self.opts.indexer_dtype, self.opts.indexer_candidates))
        if self.indexer is None and prev_topk is None:
            raise ValueError("a 'shared' indexer layer needs the previous full layer's top-k")
        blocks = dict(query_block=self.opts.indexer_query_block, key_block=self.opts.indexer_key_block,
                      kernels=self.opts.kernels, score_dtype=self.opts.param_dtype,
                      indexer_dtype=self.opts.indexer_dtype, candidates=self.opts.indexer_candidates)
        iscale = cfg.index_head_dim ** -0.5
        layout = context.current() if cache is None else None
        if layout is not None and context.whole_blocks(x.shape[1], layout.ways) > 1:
            y, topk = self._whole_in_blocks(layout, q_resid, cos, sin, positions, c_kv, k_rope,
                                            None if self.indexer is None else (iq, iw, ik),
                                            prev_topk if self.indexer is None else None, iscale, blocks)
            return y, topk, (c_kv, k_rope, ik)
        q_lat, q_rope = self._query(q_resid, cos, sin)
        shared = isinstance(cache, SharedLayerView)
        # The cache's slot layout, not `opts.context_parallel`, decides: a strided cache has only the CP reader.
        sharded_cache = None if cache is None or shared else context.cached_layout(cache.stride)
        if shared:  # G rows against one batch-1 prompt cache and their own suffixes
            out_lat, topk = shared_cache.attention(
                q_lat, q_rope, c_kv, k_rope, positions, cache, None if self.indexer is None else (iq, iw, ik),
                prev_topk if self.indexer is None else None, index_topk=cfg.index_topk, index_scale=iscale,
                softmax_scale=cfg.softmax_scale, indexer_blocks=blocks,
                attention_query_block=self.opts.attention_query_block, kernels=self.opts.kernels)
        elif sharded_cache is not None:  # each device scores and attends to the cache slots it holds
            out_lat, topk = context.cp_cached_attention(
                sharded_cache, q_lat, q_rope, c_kv, k_rope, positions, cache,
                None if self.indexer is None else (iq, iw, ik), prev_topk if self.indexer is None else None,
                index_topk=cfg.index_topk, index_scale=iscale, softmax_scale=cfg.softmax_scale,
                indexer_blocks=blocks, kernels=self.opts.kernels)
        elif layout is not None:  # explicit context parallelism: sharded queries, gathered key side
            out_lat, topk = context.cp_sparse_attention(
                layout, q_lat, q_rope, c_kv, k_rope, positions, None if self.indexer is None else (iq, iw, ik),
                prev_topk if self.indexer is None else None, index_topk=cfg.index_topk, index_scale=iscale,
                softmax_scale=cfg.softmax_scale, indexer_blocks=blocks,
                attention_query_block=self.opts.attention_query_block, kernels=self.opts.kernels)
        else:
            topk = self._topk(iq, iw, ik, positions, prev_topk, cache, iscale, blocks)
            if cache is None:
                rows = array_rows(c_kv, k_rope)
            else:
                rows = cached_rows(cache.c_kv, cache.k_rope, cache.slot, cache.length, c_kv, k_rope, cache.c_scale)
            out_lat = sparse_mla_rows(q_lat, q_rope, rows, topk, scale=cfg.softmax_scale,
                                      query_block=self.opts.attention_query_block, kernels=self.opts.kernels)
        return self._output(out_lat), topk, (c_kv, k_rope, ik)

    def _query(self, q_resid, cos, sin):
        """q_resid [B,S,Q] -> the absorbed query q_lat [B,S,H,C] and the rotated q_rope [B,S,H,R]."""
        nope, kv_b = self.cfg.qk_nope_head_dim, self.kv_b_proj_lora
        q = project(q_resid, self.q_b_proj, "bsq,qhe->bshe", self.q_b_proj_lora)
        q_nope, q_rope = q[..., :nope], q[..., nope:]
        q_rope = rope_lib.apply_interleaved_rope(q_rope, cos[:, :, None, :], sin[:, :, None, :])
        q_lat = project(q_nope, self.w_uk, "bshn,chn->bshc", None if kv_b is None else kv_b.key)
        return constrain(q_lat, ("batch", "seq", "heads", "kv_lora")), q_rope

    def _output(self, out_lat):
        """The attention's latent output [B,S,H,C] -> y [B,S,D] (W_UV, then o_proj)."""
        kv_b = self.kv_b_proj_lora
        out = project(out_lat, self.w_uv, "bshc,chv->bshv", None if kv_b is None else kv_b.value)
        y = project(out, self.o_proj, "bshv,hvd->bsd", self.o_proj_lora)
        return constrain(y, ("batch", "seq", "embed"))

    def _whole_in_blocks(self, layout, q_resid, cos, sin, positions, c_kv, k_rope, index, prev_topk, iscale, blocks):
        """A long whole-sequence forward's attention, q_b .. o_proj, in blocks of `context.WHOLE_QUERY_BLOCK`
        queries per device (a `lax.map`): each block's queries are its devices' next `WHOLE_QUERY_BLOCK` each, against
        every key, so the absorbed query and the attention's output ([T,H,C] per device, float32 out of the GEMM: 34 GB
        at 262,144 tokens per device) exist for one block at a time. The key side is gathered once, before the blocks
        (`context.gather_key_side`). Same results as the unblocked path."""
        ways = layout.ways
        keys = context.gather_key_side(layout, c_kv, k_rope, positions, None if index is None else index[2])
        nb = context.whole_blocks(q_resid.shape[1], ways)
        split = lambda a, axis: context.split_blocks(a, axis, ways, nb)  # noqa: E731

        cos_b, sin_b = (split(jnp.broadcast_to(a, (q_resid.shape[0], *a.shape[1:])), 1) for a in (cos, sin))
        xs = (split(q_resid, 1), cos_b, sin_b, split(positions, 0),
              # The indexer's queries are parameter-dtype values held in float32 (`indexer.Indexer.project`): the
              # blocked copy keeps them in that dtype (4 -> 2 GiB at 262,144 tokens per device), exactly.
              None if index is None else (split(index[0].astype(self.opts.param_dtype), 1), split(index[1], 1)),
              None if prev_topk is None else split(prev_topk, 1))

        def one(args):
            q_resid, cos, sin, q_positions, qi, prev = args
            qi = None if qi is None else (qi[0].astype(index[0].dtype), qi[1])
            q_lat, q_rope = self._query(q_resid, cos, sin)
            out_lat, topk = context.cp_sparse_attention(
                layout, q_lat, q_rope, c_kv, k_rope, positions, None if qi is None else (*qi, index[2]), prev,
                index_topk=self.cfg.index_topk, index_scale=iscale, softmax_scale=self.cfg.softmax_scale,
                indexer_blocks=blocks, attention_query_block=self.opts.attention_query_block,
                kernels=self.opts.kernels, q_positions=q_positions, keys=keys)
            return self._output(out_lat), topk

        y, topk = jax.lax.map(one, xs)
        join = lambda a: context.join_blocks(a, 1, ways, nb)  # noqa: E731
        return constrain(join(y), ("batch", "seq", "embed")), join(topk)

    def _topk(self, iq, iw, ik, positions, prev_topk, cache, iscale, blocks):
        """Top-k key slots [B,S,K]: a shared layer's inherited one, or this layer's indexer over the
        sequence (no cache) or over the cache plus the chunk."""
        cfg = self.cfg
        if self.indexer is None:
            return prev_topk
        if cache is None:
            return streaming_topk(iq, iw, ik, positions, positions, cfg.index_topk, scale=iscale, **blocks)
        # Cached keys and the chunk's own keys are scored separately and merged, so the cache
        # is only read (in place) here and written once per chunk by the caller.
        past = cached_topk(iq, iw, cache.index_k, cache.index_slot, positions, cache.length, cfg.index_topk,
                           scale=iscale, key_scales=cache.i_scale, **blocks)
        vals, idx = streaming_topk(iq, iw, ik, positions, positions, cfg.index_topk, scale=iscale,
                                   return_scores=True, **blocks)
        own = (vals, jnp.where(idx >= 0, idx + cache.length, idx))
        return merge_topk(past, own, min(cfg.index_topk, cache.capacity))
