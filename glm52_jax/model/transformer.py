"""The GLM-MoE-DSA causal LM (HF `GlmMoeDsaForCausalLM`) with layers scanned in stacks.

Layers differ by MLP kind (dense / MoE) and indexer kind (full / shared), so they cannot all share
one scan. `plan_segments` splits the layer list into segments of a repeating unit (GLM-5.2: 3 dense
full layers, then 18 x [shared, shared, shared, full], then 3 shared) and each segment's unit is
stacked with `nnx.vmap` and run with one `lax.scan`. The previous full layer's top-k travels in the
scan carry, which is exactly IndexShare's data flow.

Axis letters: B batch, S sequence, D model, V vocab, K indexer top-k.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from glm52_jax import positions as rope_lib
from glm52_jax.config import ModelConfig
from glm52_jax.model import cache_fp8
from glm52_jax.model import context_parallel as context
from glm52_jax.model.indexer import fp8_settings_problem
from glm52_jax.model.kv_cache import KVCache, cache_from_entries, init_cache
from glm52_jax.model.layers import RMSNorm, gather_params, gathered, gathered_value, kept_split, param
from glm52_jax.model.lora import adapter
from glm52_jax.model.mla import Attention
from glm52_jax.model.moe import MLP, MoE
from glm52_jax.model.options import ModelOptions
from glm52_jax.model.shared_cache import SharedCache, SuffixCache, init_suffix
from glm52_jax.parallel import tensor_parallel
from glm52_jax.parallel.rules import constrain

LayerKind = tuple[str, str]  # (mlp type, indexer type)


@dataclasses.dataclass(frozen=True)
class Segment:
    """Layers `start .. start + len(unit) * repeats - 1`, made of `unit` repeated."""

    start: int
    unit: tuple[LayerKind, ...]
    repeats: int

    @property
    def layer_ids(self) -> list[int]:
        return list(range(self.start, self.start + len(self.unit) * self.repeats))


def layer_kinds(cfg: ModelConfig) -> list[LayerKind]:
    return list(zip(cfg.mlp_layer_types, cfg.indexer_types))


def plan_segments(kinds: Sequence[LayerKind], max_period: int = 8) -> list[Segment]:
    """Greedy cover by repeated units: at each point take the period covering the most layers."""
    kinds = list(kinds)
    out, i = [], 0
    while i < len(kinds):
        best_period, best_repeats = 1, 1
        for period in range(1, max_period + 1):
            unit = kinds[i:i + period]
            if len(unit) < period:
                break
            repeats = 1
            while kinds[i + repeats * period: i + (repeats + 1) * period] == unit:
                repeats += 1
            if repeats >= 2 and repeats * period > best_period * best_repeats:
                best_period, best_repeats = period, repeats
        out.append(Segment(i, tuple(kinds[i:i + best_period]), best_repeats))
        i += best_period * best_repeats
    return out


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, kind: LayerKind, opts: ModelOptions, rngs: nnx.Rngs):
        mlp_type, indexer_type = kind
        dt = opts.param_dtype
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed", dt)
        self.self_attn = Attention(cfg, indexer_type == "full", opts, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed", dt)
        if mlp_type == "sparse":
            self.mlp = MoE(cfg, opts, rngs)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dt, rngs, opts.lora, "dense_mlp")

    def __call__(self, h, cos, sin, positions, prev_topk, cache=None):
        attn, topk, entries = self.self_attn(self.input_layernorm(h), cos, sin, positions, prev_topk, cache)
        h = h + attn
        h = h + self.mlp(self.post_attention_layernorm(h))
        return constrain(h, ("batch", "seq", "embed")), topk, entries


class Unit(nnx.Module):
    """One period of a segment: consecutive layers of the given kinds."""

    def __init__(self, cfg: ModelConfig, unit: tuple[LayerKind, ...], opts: ModelOptions, rngs: nnx.Rngs):
        self.kinds = unit
        self.layers = nnx.List([DecoderLayer(cfg, kind, opts, rngs) for kind in unit])

    def __call__(self, h, cos, sin, positions, topk, unit_cache=None, emit_entries=False):
        """unit_cache: None, or (segment cache, repeat index): the whole segment's cache (a
        `kv_cache.SegmentCache` or `shared_cache.SharedSegment`), read in place at this unit's repeat.

        Returns (h, topk, top-k of each full layer, the chunk's new entries stacked
        ([U,B,S,C], [U,B,S,R], [F,B,S,I]), or None without a cache unless `emit_entries`). With
        `emit_entries="fp8"` the latents and index keys come as an FP8 cache stores them, (e4m3 values,
        [U|F,B,S] scales) pairs (`cache_fp8.store_rows`): a whole prompt's stacks leave the scan at half the bytes.
        """
        produced, new_c, new_r, new_i = [], [], [], []
        full_slot = 0
        for slot, (kind, layer) in enumerate(zip(self.kinds, self.layers)):
            view = None
            full = kind[1] == "full"
            if unit_cache is not None:
                seg_cache, rep = unit_cache
                view = seg_cache.layer(rep, slot, full_slot if full else None)
            h, topk, (c_kv, k_rope, ik) = layer(h, cos, sin, positions, topk, view)
            new_c.append(c_kv)
            new_r.append(k_rope)
            if full:
                produced.append(topk)
                new_i.append(ik)
                full_slot += 1
        if unit_cache is None and not emit_entries:
            return h, topk, tuple(produced), None
        index_dim = self.layers[0].self_attn.cfg.index_head_dim
        stacked_i = (jnp.stack([i.astype(jnp.float32) for i in new_i]) if new_i
                     else jnp.zeros((0, *h.shape[:2], index_dim), jnp.float32))
        stacked_c = jnp.stack(new_c)
        if emit_entries == "fp8":
            (c_v,), (c_s,) = cache_fp8.store_rows((stacked_c,), True)
            (i_v,), (i_s,) = cache_fp8.store_rows((stacked_i,), True)
            return h, topk, tuple(produced), ((c_v, c_s), jnp.stack(new_r), (i_v, i_s))
        return h, topk, tuple(produced), (stacked_c, jnp.stack(new_r), stacked_i)


def _stacked_unit(cfg: ModelConfig, seg: Segment, opts: ModelOptions, rngs: nnx.Rngs) -> Unit:
    """`seg.repeats` copies of the segment's unit with params stacked on a leading 'layers' axis."""

    @nnx.split_rngs(splits=seg.repeats)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(r):
        return Unit(cfg, seg.unit, opts, r)

    return make(rngs)


class GlmMoeDsa(nnx.Module):
    """GLM-MoE-DSA causal LM. `model(input_ids: [B,S] int32) -> logits [B,S,V] float32`."""

    def __init__(self, cfg: ModelConfig, opts: ModelOptions | None = None, *, rngs: nnx.Rngs):
        opts = opts or ModelOptions()
        dt = opts.param_dtype
        problem = fp8_settings_problem(cfg.index_head_dim, cfg.index_topk, opts.indexer_dtype, opts.indexer_candidates)
        if problem:
            raise ValueError(problem)
        self.cfg = cfg
        self.opts = opts
        self.segments_plan = tuple(plan_segments(layer_kinds(cfg)))
        self.embed_tokens = param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dt,
                                  std=cfg.initializer_range)
        self.stacks = nnx.List([_stacked_unit(cfg, seg, opts, rngs) for seg in self.segments_plan])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed", dt)
        if not cfg.tie_word_embeddings:
            self.lm_head = param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dt,
                                 std=cfg.initializer_range)
        # Unembed LoRA acts on the logits projection, tied or not (merging needs an untied lm_head).
        self.lm_head_lora = adapter(opts.lora, "unembed", "lm_head", (cfg.hidden_size,), ("embed",),
                                    (cfg.vocab_size,), ("vocab",), rngs)

    # -- forward --------------------------------------------------------------------------------
    def hidden_states(self, input_ids: jax.Array, positions: jax.Array | None = None, *,
                      return_topk: bool = False):
        """Final-normed hidden states `[B,S,D]`; with `return_topk`, also `{layer: [B,S,K]}`.

        `positions: [S]` int32 defaults to `arange(S)`; it drives RoPE and causality.
        """
        layout = None
        if positions is None:
            positions = jnp.arange(input_ids.shape[-1], dtype=jnp.int32)
            # Explicit context parallelism needs keys in position order (true for arange).
            layout = context.plan_layout(input_ids.shape[-1], self.opts.context_parallel)
        if layout is None:
            h, produced, _, _ = self._run(input_ids, positions, None)
        else:
            h, produced = self._run_context_parallel(input_ids, positions, layout)
        return (h, produced) if return_topk else h

    def _run_context_parallel(self, input_ids, positions, layout):
        """`_run` on the padded sequence in the layout's order; results back in sequence order."""
        seq = input_ids.shape[-1]
        ids, pos = context.pad_sequence(input_ids, positions, layout)
        ids, pos = context.to_layout(ids, layout), context.to_layout(pos, layout, axis=0)
        with context.active(layout):
            h, produced, _, _ = self._run(ids, pos, None)
        h = context.from_layout(h, layout)[:, :seq]
        # Keys past the real sequence are never visible to a real query: their slots are INVALID.
        k = min(self.cfg.index_topk, seq)
        produced = {layer: context.from_layout(t, layout)[:, :seq, :k] for layer, t in produced.items()}
        return h, produced

    def forward_cached(self, input_ids: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Runs a chunk after the cached tokens: `input_ids: [B,S]` at positions `length .. length+S-1`.

        Writes the chunk into the cache and returns (hidden states [B,S,D], the updated cache).
        The caller keeps `length + S <= capacity` (checked eagerly when `length` is concrete).
        """
        seq = input_ids.shape[-1]
        if not isinstance(cache.length, jax.core.Tracer) and int(cache.length) + seq > cache.capacity:
            raise ValueError(f"cache overflow: {int(cache.length)} cached + {seq} new tokens > capacity "
                             f"{cache.capacity}")
        positions = cache.length + jnp.arange(seq, dtype=jnp.int32)
        h, _, cache, _ = self._run(input_ids, positions, cache)
        return h, cache

    def forward_shared(self, input_ids: jax.Array, prompt: KVCache,
                       suffix: SuffixCache) -> tuple[jax.Array, SuffixCache]:
        """Runs a chunk for G rows after one shared prompt (`model/shared_cache.py`): `input_ids: [G,S]` at
        positions `prompt.length + suffix.length + (0 .. S-1)`, against the batch-1 `prompt` cache (only
        read) and the rows' `suffix` (G rows; capacity 0: nothing kept). Returns (hidden states [G,S,D],
        the suffix with the chunk written)."""
        seq = input_ids.shape[-1]
        if prompt.batch != 1 or suffix.rows != input_ids.shape[0]:
            raise ValueError(f"forward_shared: a batch-1 prompt cache and a suffix of {input_ids.shape[0]} rows, "
                             f"got batch {prompt.batch} and {suffix.rows} rows")
        if (suffix.capacity and not isinstance(suffix.length, jax.core.Tracer)
                and int(suffix.length) + seq > suffix.capacity):
            raise ValueError(f"suffix overflow: {int(suffix.length)} + {seq} tokens > capacity {suffix.capacity}")
        cache = SharedCache(prompt, suffix)
        positions = cache.next_position + jnp.arange(seq, dtype=jnp.int32)
        h, _, cache, _ = self._run(input_ids, positions, cache)
        return h, cache.suffix

    def prefill(self, input_ids: jax.Array, capacity: int, cache_dtype: str | None = None) -> tuple[jax.Array, KVCache]:
        """Whole-prompt prefill: the uncached forward of `input_ids: [B,S]` from position 0 that
        also returns a cache of `capacity` slots holding its S tokens (stored as `cache_dtype`, default
        `opts.cache_dtype`; the forward itself attends to the keys as computed).

        Under a mesh that shards the sequence this is the explicit context-parallel forward
        (sharded queries, all-gathered key side), the same as `hidden_states`; each layer's cache
        entries leave the layer scan sharded by sequence and are put back in slot order once. The
        sampler's chunked prefill computes the same cache chunk by chunk (equal up to float
        rounding: the blocks are reduced in another order). Returns (h [B,S,D], cache).
        """
        batch, seq = input_ids.shape
        if seq > capacity:
            raise ValueError(f"prefill: cache capacity {capacity} must hold the {seq} prompt tokens")
        if seq > self.cfg.max_position_embeddings:
            raise ValueError(f"prefill: {seq} prompt tokens exceed max_position_embeddings "
                             f"{self.cfg.max_position_embeddings}")
        positions = jnp.arange(seq, dtype=jnp.int32)
        layout = context.plan_layout(seq, self.opts.context_parallel)
        cache_dtype = self.opts.cache_dtype if cache_dtype is None else cache_dtype
        # Rows quantize independently, so an FP8 cache's rows are quantized as each layer emits them: the layer
        # scan's stacks and the re-layout below hold e4m3 values and their scales, not bf16 / float32 rows (a 2M
        # prompt on 8 devices: the latents' stack and its all-to-all 19.3 -> 9.7 GB per device each).
        emit = "fp8" if cache_fp8.quantized(cache_dtype) else True
        if layout is None:
            h, _, _, entries = self._run(input_ids, positions, None, emit_entries=emit)
        else:
            ids, pos = context.pad_sequence(input_ids, positions, layout)
            ids, pos = context.to_layout(ids, layout), context.to_layout(pos, layout, axis=0)
            with context.active(layout):
                h, _, _, entries = self._run(ids, pos, None, emit_entries=emit)
            h = context.from_layout(h, layout)[:, :seq]
            # [reps, U|F, B, L, *] (scales [reps, U|F, B, L]) in layout order -> slot order, padding dropped.
            entries = jax.tree.map(lambda a: context.from_layout(a, layout, axis=3)[:, :, :, :seq], entries)
        scales = None
        if emit == "fp8":  # per segment (values, scales) pairs
            (c_kv, c_scale), (index_k, i_scale) = (tuple(zip(*pairs, strict=True)) for pairs in
                                                   (entries[0], entries[2]))
            entries, scales = (c_kv, entries[1], index_k), (c_scale, i_scale)
        return h, cache_from_entries(*entries, seq, capacity, self.opts.param_dtype, cache_dtype, scales=scales)

    def keeps_weights_sharded(self, tokens: int) -> bool:
        """Whether a call routing `tokens` tokens (static) uses its FSDP-sharded weights in place, tensor-parallel
        (`parallel.tensor_parallel`), instead of all-gathering them: fewer than
        `opts.gather_weights_min_tokens` (0: never)."""
        return tokens < self.opts.gather_weights_min_tokens

    def _run(self, input_ids, positions, cache, emit_entries=False):
        """The layer stacks over `input_ids: [B,S]` at `positions: [S]`, against `cache` or alone.

        Returns (final-normed h [B,S,D], {full layer: top-k [B,S,K]}, the cache with this chunk
        written (None without one), and with `emit_entries` the per-segment new cache entries
        ([reps,U,B,S,C], [reps,U,B,S,R], [reps,F,B,S,I]) as three lists, else None).
        """
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {input_ids.shape}")
        with tensor_parallel.active(self.keeps_weights_sharded(input_ids.size)):
            return self._run_layers(input_ids, positions, cache, emit_entries)

    def _embed(self, input_ids: jax.Array) -> jax.Array:
        """`input_ids: [B,S] -> [B,S,D]`: rows of the gathered table, or of the table left in place."""
        split = kept_split(self.embed_tokens)
        if split is None:
            return jnp.take(gathered_value(self.embed_tokens), input_ids, axis=0)
        return tensor_parallel.take_rows(self.embed_tokens[...], input_ids, split)

    def _run_layers(self, input_ids, positions, cache, emit_entries):
        cfg = self.cfg
        batch, seq = input_ids.shape
        table = rope_lib.rotary_table(cfg.rope, cfg.qk_rope_head_dim)
        cos, sin = rope_lib.rope_cos_sin(positions, table)
        cos, sin = cos[None], sin[None]  # [1,S,R/2]
        h = constrain(self._embed(input_ids), ("batch", "seq", "embed"))
        num_keys = seq if cache is None else cache.key_slots
        topk = jnp.zeros((batch, seq, min(cfg.index_topk, num_keys)), jnp.int32)
        produced: dict[int, jax.Array] = {}
        new_c, new_r, new_i = [], [], []
        for s, (seg, stack) in enumerate(zip(self.segments_plan, self.stacks)):
            graphdef, state = nnx.split(stack)
            # The segment's cache is a loop invariant of the scan (read in place by each layer);
            # the scan emits only this chunk's entries, written into the cache once afterwards.
            seg_cache = None if cache is None else cache.segment(s)

            def body(carry, xs, graphdef=graphdef, seg_cache=seg_cache):
                h, topk = carry
                unit_state, rep = xs
                # FSDP: this layer's base weights all-gathered here, inside the loop, one layer at a time (in a
                # few-token call only the vectors: the matrices are used in place, `layers.project`).
                unit = nnx.merge(graphdef, gather_params(unit_state))
                unit_cache = None if seg_cache is None else (seg_cache, rep)
                h, topk, made, entries = unit(h, cos, sin, positions, topk, unit_cache, emit_entries)
                return (h, topk), (made, entries)

            if self.opts.remat:
                body = jax.checkpoint(body, prevent_cse=False)
            reps = jnp.arange(seg.repeats, dtype=jnp.int32)
            if seg.repeats == 1:
                # A one-trip scan would still be a loop; XLA copies the cache around its boundary.
                (h, topk), ys = body((h, topk), jax.tree.map(lambda a: a[0], (state, reps)))
                made, entries = jax.tree.map(lambda a: a[None], ys)
            else:
                (h, topk), (made, entries) = jax.lax.scan(body, (h, topk), (state, reps))
            if entries is not None:
                new_c.append(entries[0])
                new_r.append(entries[1])
                new_i.append(entries[2])
            full_ids = [j for j, kind in enumerate(seg.unit) if kind[1] == "full"]
            for slot, j in enumerate(full_ids):
                for rep in range(seg.repeats):
                    produced[seg.start + rep * len(seg.unit) + j] = made[slot][rep]
        h = gathered(self.norm)(h)
        if cache is not None:
            cache = cache.write(new_c, new_r, new_i, seq)
        return h, produced, cache, ((new_c, new_r, new_i) if emit_entries else None)

    def init_cache(self, batch: int, capacity: int, dtype=None, cache_dtype: str | None = None) -> KVCache:
        """An empty decode cache (dtype defaults to the parameter dtype, cache_dtype to `opts.cache_dtype`).

        `capacity` may exceed max_position_embeddings: the extra slots are padding that lets the
        devices sharding the slot axis divide it (`kv_cache.slot_capacity`); they are never written
        or attended, since whoever decodes keeps prompt + new tokens within the position limit.
        """
        return init_cache(self.cfg, self.segments_plan, batch, capacity, dtype or self.opts.param_dtype,
                          cache_dtype or self.opts.cache_dtype)

    def init_suffix(self, rows: int, capacity: int, dtype=None, cache_dtype: str | None = None) -> SuffixCache:
        """An empty per-sample suffix for `forward_shared` (`capacity` 0: run one chunk, keep nothing); its
        `cache_dtype` defaults to `opts.cache_dtype`."""
        return init_suffix(self.cfg, self.segments_plan, rows, capacity, dtype or self.opts.param_dtype,
                           cache_dtype or self.opts.cache_dtype)

    def unembedding(self) -> jax.Array:
        """The logits projection's weight (lm_head [D,V], or the tied embedding [V,D]), gathered whole."""
        return gathered_value(self.embed_tokens if self.cfg.tie_word_embeddings else self.lm_head)

    def logits(self, h: jax.Array, unembedding: jax.Array | None = None) -> jax.Array:
        """`h: [..., D] -> [..., V]` float32; `unembedding`: `self.unembedding()` when the caller gathered it
        once for several calls (e.g. outside a loop over chunks). Without one, a few-token `h`
        (`keeps_weights_sharded`) meets the weight where it lies: only the logits move (all-reduced partial
        sums when FSDP splits D, as on the folded meshes; all-gathered slices when it splits V)."""
        var = self.embed_tokens if self.cfg.tie_word_embeddings else self.lm_head
        spec = "...d,vd->...v" if self.cfg.tie_word_embeddings else "...d,dv->...v"
        with tensor_parallel.active(unembedding is None and self.keeps_weights_sharded(h.size // h.shape[-1])):
            split = kept_split(var)
        if split is not None:
            h = h.astype(var.get_value().dtype)
            out = tensor_parallel.einsum(spec, h, var[...], split)
        else:
            w = self.unembedding() if unembedding is None else unembedding
            h = h.astype(w.dtype)
            out = jnp.einsum(spec, h, w, preferred_element_type=jnp.float32)
        if self.lm_head_lora is not None:
            out = out + self.lm_head_lora(h, "...d,dv->...v")
        return out

    def __call__(self, input_ids: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """Logits `[B,S,V]` float32 of `input_ids: [B,S]` int32 (positions `[B,S]`, default 0..S-1). Called
        outside any trace (a user's direct call), it runs as one compiled program (`compiled_call`); inside a
        jit / grad / nnx transform it traces inline as any layer does."""
        if not _traced(input_ids, positions, self.embed_tokens.get_value()):
            return compiled_call(self, input_ids, positions)
        return self.traced_call(input_ids, positions)

    def traced_call(self, input_ids: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """`model(input_ids, positions)` as ops of the current trace (op by op under `jax.disable_jit()`)."""
        return self.logits(self.hidden_states(input_ids, positions))


def _traced(*arrays) -> bool:
    """Whether any of `arrays` is a tracer: the call is inside a transform (the weights or the ids are traced;
    an array made inside a jit is a tracer too)."""
    return any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(arrays))


# Traces of the compiled forward in this process: a repeat call with the same shapes must not add one (tested).
COMPILED_TRACES = [0]


@functools.partial(jax.jit, static_argnums=0)
def _compiled_forward(graphdef: nnx.GraphDef, state: nnx.State, input_ids: jax.Array, positions: jax.Array | None):
    COMPILED_TRACES[0] += 1
    return nnx.merge(graphdef, state).traced_call(input_ids, positions)


def compiled_call(model: GlmMoeDsa, input_ids: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    """`model(input_ids, positions)` as one jitted program keyed by the model's structure (the graphdef, a static
    argument) and the shapes, dtypes and shardings of its weights and inputs: a second call with new weights of
    the same structure (an optimizer step) reuses it."""
    graphdef, state = nnx.split(model)
    return _compiled_forward(graphdef, state, input_ids, positions)


def token_logprobs(model: GlmMoeDsa, input_ids: jax.Array, *, chunk: int = 1024) -> jax.Array:
    """Log-prob of each next token: `input_ids: [B,S] -> [B,S-1]` float32."""
    return target_logprobs(model, model.hidden_states(input_ids)[:, :-1], input_ids[:, 1:], chunk)


def target_logprobs(model: GlmMoeDsa, h: jax.Array, targets: jax.Array, chunk: int = 1024) -> jax.Array:
    """Log-prob of `targets: [B,N]` under the logits of `h: [B,N,D]` -> [B,N] float32.

    Logits are formed `chunk` positions at a time, so `[B,N,V]` never exists at once.
    """
    batch, n, d = h.shape
    c = max(1, min(chunk, n))
    pad = (-n) % c
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    nc = h.shape[1] // c
    # Gathered once, not per chunk; a few-token call leaves it in place (each chunk's logits move instead).
    unembedding = None if model.keeps_weights_sharded(batch * n) else model.unembedding()

    def one(args):
        hc, tc = args  # [B,c,D], [B,c]
        logp = jax.nn.log_softmax(model.logits(hc, unembedding), axis=-1)
        return jnp.take_along_axis(logp, tc[..., None], axis=-1)[..., 0]

    out = jax.lax.map(one, (h.reshape(batch, nc, c, d).swapaxes(0, 1), targets.reshape(batch, nc, c).swapaxes(0, 1)))
    return out.swapaxes(0, 1).reshape(batch, nc * c)[:, :n]
