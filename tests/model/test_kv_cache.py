"""model/kv_cache.py: chunk writes into a slot-sharded cache, the strided slot layout's balance, and that a
sharded decode updates it in place.

The written values are the inputs of `write_chunk`, so a sharded write must equal the one-device
`dynamic_update_slice` bit for bit, whichever shards a chunk touches (the model-level decode on
meshes: tests/parallel/test_sharded_rl.py). An FP8 cache writes e4m3 rows and their scale stacks the same way.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jaxpr_utils import all_eqns

import glm52_jax
from glm52_jax import config
from glm52_jax.model import cache_fp8
from glm52_jax.model.kv_cache import CACHE_AXES, KVCache, SlotLayout, scale_axes, slot_stride, write_chunk
from glm52_jax.model.transformer import GlmMoeDsa
from glm52_jax.parallel.mesh import parse_mesh
from glm52_jax.parallel.placement import place_model
from glm52_jax.parallel.rules import axis_rules, logical_to_spec
from glm52_jax.rollout import sampler
from glm52_jax.rollout.cache import fit_capacity

CAPACITY = 64  # 16 slots per shard on context=4, 8 on folded=8
# (length before, chunk tokens): a chunk inside one shard, one straddling a boundary (13..18 on 16 and
# 8), one wider than a shard (19..38), decode tokens at the last slot of a shard and the first of the next.
WRITES = ((0, 13), (13, 6), (19, 20), (39, 1), (40, 1), (41, 6), (47, 1), (48, 1))
_write = jax.jit(write_chunk, static_argnums=4)


def _empty_cache(fp8: bool = False) -> KVCache:
    """Two segments' worth of the shapes `init_cache` makes ([reps, U|F, B, Cap, *]); bf16 latents, f32 keys, or
    with `fp8` e4m3 latents and keys plus their scale stacks [reps, U|F, B, Cap] (ones, as `init_cache`'s)."""
    def z(reps, unit, width, dtype):
        return jnp.zeros((reps, unit, 2, CAPACITY, width), dtype)

    bf16, f32 = jnp.bfloat16, jnp.float32
    latent, keys = (cache_fp8.E4M3, cache_fp8.E4M3) if fp8 else (bf16, f32)
    cache = KVCache((z(2, 2, 8, latent), z(1, 1, 8, latent)), (z(2, 2, 4, bf16), z(1, 1, 4, bf16)),
                    (z(2, 1, 4, keys), z(1, 0, 4, keys)), jnp.zeros((), jnp.int32))
    if not fp8:
        return cache
    ones = [tuple(jnp.ones(a.shape[:-1], f32) for a in stacks) for stacks in (cache.c_kv, cache.index_k)]
    return KVCache(cache.c_kv, cache.k_rope, cache.index_k, cache.length, *ones)


def _chunks():
    rng = np.random.default_rng(0)
    cache = _empty_cache()

    def like(stacks, seq):  # float32 entries, as the layers emit them (rounded to bf16 by the write)
        return [jnp.asarray(rng.normal(size=(*a.shape[:3], seq, a.shape[4])), jnp.float32) for a in stacks]

    return [(like(cache.c_kv, s), like(cache.k_rope, s), like(cache.index_k, s), s) for _, s in WRITES]


def _write_all(chunks, mesh=None, fp8=False) -> KVCache:
    """All WRITES in turn; with `mesh`, from a cache placed as `init_cache` places it (slots strided over the
    mesh's slot shards, `slot_stride`)."""
    cache = _empty_cache(fp8)
    if mesh is not None:
        cache = cache.relayout(slot_stride(CAPACITY, mesh))

        def place(a):
            axes = {5: CACHE_AXES, 4: scale_axes(CACHE_AXES), 0: ()}[a.ndim]
            return jax.device_put(a, NamedSharding(mesh, logical_to_spec(axes, mesh_axes=mesh.axis_names)))

        cache = jax.tree.map(place, cache)
    for (length, _), chunk in zip(WRITES, chunks):
        assert int(cache.length) == length
        cache = _write(cache, *chunk)
    return cache


@pytest.fixture(scope="module")
def written():
    chunks = _chunks()
    return chunks, _write_all(chunks)


@pytest.fixture(scope="module")
def written_fp8():
    chunks = _chunks()
    return chunks, _write_all(chunks, fp8=True)


def test_fp8_writes_store_each_chunk_quantized(written_fp8):
    """An FP8 cache's slots [l, l + S) hold `quantize_rows` of the chunk written there (values and scales); the
    rope keys are stored as they come."""
    chunks, cache = written_fp8
    host = jax.tree.map(np.asarray, cache)  # numpy slices below (no per-slice XLA program)
    quantize = jax.jit(lambda chunks: jax.tree.map(cache_fp8.quantize_rows, chunks))
    for (length, seq), (new_c, new_r, new_i, _) in zip(WRITES, chunks):
        at = (slice(None),) * 3 + (slice(length, length + seq),)
        for values, scales, new in ((host.c_kv, host.c_scale, new_c), (host.index_k, host.i_scale, new_i)):
            for v, sc, (want_v, want_s) in zip(values, scales, quantize(new), strict=True):
                np.testing.assert_array_equal(v[at].view(np.uint8), np.asarray(want_v).view(np.uint8))
                np.testing.assert_array_equal(sc[at], np.asarray(want_s))
        for r, chunk in zip(host.k_rope, new_r, strict=True):
            np.testing.assert_array_equal(r[at], np.asarray(chunk).astype(jnp.bfloat16))


@pytest.mark.parametrize("spec,fp8", [("context=4,expert=2", False), ("context=4,expert=2", True),
                                      pytest.param("folded=8", False, marks=pytest.mark.slow)])
def test_sharded_writes_equal_one_device_bitwise(written, written_fp8, spec, fp8):
    chunks, want = written_fp8 if fp8 else written
    mesh_spec = parse_mesh(spec)
    mesh = mesh_spec.make()
    with axis_rules(mesh_spec.rules()), jax.set_mesh(mesh):
        got = _write_all(chunks, mesh, fp8)
        jaxpr = jax.make_jaxpr(write_chunk, static_argnums=4)(got, *chunks[1])
    ways = CAPACITY // 4 if spec.startswith("context") else CAPACITY // 8
    assert len(jax.tree.leaves(got)) == (11 if fp8 else 7)  # 2 segments x 3 stacks (+ 2 x 2 scale stacks), length
    assert got.stride == CAPACITY // ways
    for g, w in zip(jax.tree.leaves(got.relayout(1)), jax.tree.leaves(want)):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8) if g.dtype == cache_fp8.E4M3 else np.asarray(g),
                                      np.asarray(w).view(np.uint8) if w.dtype == cache_fp8.E4M3 else np.asarray(w))
    for g in jax.tree.leaves(got):
        if g.size > 1:  # the slot axis stays sharded: each device holds its rows (not the empty index_k)
            assert {s.data.shape[3] for s in g.addressable_shards} == {ways}, g.sharding
    assert int(got.length) == sum(s for _, s in WRITES)
    # Written per device (a shard_map), never a select over a whole stack.
    assert any(e.primitive.name == "shard_map" for e in jaxpr.jaxpr.eqns)
    stack_shapes = {a.shape for a in jax.tree.leaves(want) if a.ndim}
    assert not [e for e in all_eqns(jaxpr.jaxpr) if e.primitive.name == "select_n"
                and e.outvars[0].aval.shape in stack_shapes]


def _slots_held(stride: int, capacity: int, chunk: int, mesh) -> list[np.ndarray]:
    """A chunked prefill's writes (`write_chunk`, `chunk` slots at a time) into a one-stack cache of `capacity` slots
    laid out `stride` ways under `mesh` (1: slot order, the contiguous shards GSPMD makes), each row holding its
    slot + 1. Returns, per device, the slots its shard holds by local row (read back from the shards: where the
    writes put them)."""
    cache = KVCache((jnp.zeros((1, 1, 1, capacity, 1)),), (jnp.zeros((1, 1, 1, capacity, 1)),),
                    (jnp.zeros((1, 0, 1, capacity, 1)),), jnp.zeros((), jnp.int32), stride=stride)
    cache = jax.device_put(cache, jax.tree.map(lambda a: NamedSharding(mesh, logical_to_spec(
        CACHE_AXES[:a.ndim], mesh_axes=mesh.axis_names)), cache))
    for start in range(0, capacity, chunk):
        rows = jnp.arange(start + 1, start + chunk + 1, dtype=jnp.float32).reshape(1, 1, 1, chunk, 1)
        cache = _write(cache, (rows,), (rows,), (jnp.zeros((1, 0, 1, chunk, 1)),), chunk)
    shards = sorted(cache.c_kv[0].addressable_shards, key=lambda sh: sh.index[3].start or 0)
    return [np.asarray(sh.data).reshape(-1).astype(np.int64) - 1 for sh in shards]


def test_strided_slots_balance_every_chunk():
    """A chunked prefill of 1024 tokens in chunks of 128 on 8 slot shards (folded=8). Every query attends to keys
    at or before its position, so a device's work on a chunk is the causal (query, key) pairs its slots give: the
    cache's (all of its filled rows, what `cached_topk` scores) and the chunk's own. With the strided layout the
    busiest device does at most 1.1x the mean on every chunk; with contiguous shards (read back from a slot-order
    cache written the same way) the busiest does far more, and over the whole prefill the imbalance the issue
    measured (1.87x over these 8 chunks; strided: 1.054x on the first chunk, 1.007x summed). The indexer's rule
    for a device's filled rows (`SlotLayout.filled`) is the writes' placement."""
    capacity, chunk, ways = 1024, 128, 8
    mesh_spec = parse_mesh("folded=8")
    mesh = mesh_spec.make()
    with axis_rules(mesh_spec.rules()), jax.set_mesh(mesh):
        assert slot_stride(capacity) == ways
        strided, contiguous = (_slots_held(stride, capacity, chunk, mesh) for stride in (ways, 1))
    layout = SlotLayout(ways)
    for d, held in enumerate(strided):
        assert (layout.device(held) == d).all() and (held == layout.slot(d, np.arange(len(held)))).all()
        for length in range(0, capacity, chunk):  # rows holding slots < length are the first `filled` ones
            assert (np.flatnonzero(held < length) == np.arange(layout.filled(length, d))).all()

    def pairs(held, start):  # causal (query, key) pairs of the chunk at `start` over the keys a device holds
        queries = np.arange(start, start + chunk)
        return int((held[None, :] <= queries[:, None]).sum())

    ratios, totals = {}, {}
    for name, placement in (("strided", strided), ("contiguous", contiguous)):
        work = np.array([[pairs(held, start) for held in placement] for start in range(0, capacity, chunk)])
        assert work.sum() == sum(range(1, capacity + 1))  # every causal pair counted once, on one device
        ratios[name] = work.max(axis=1) / work.mean(axis=1)  # per chunk
        totals[name] = work.sum(axis=0).max() / work.sum(axis=0).mean()  # summed over the prefill
    assert ratios["strided"].max() <= 1.1, ratios["strided"]
    # Contiguous: 8x on the first chunk (all its keys on device 0), over 1.1x on all but the last (every shard full).
    assert ratios["contiguous"][0] == ways and (ratios["contiguous"][:-1] > 1.1).all(), ratios["contiguous"]
    assert totals["strided"] < 1.01 and totals["contiguous"] > 1.7, totals


def test_fit_capacity_keeps_each_slot_in_the_strided_layout():
    """A prefix-cache entry refitted to another capacity (`rollout.cache.fit_capacity`, what a longer request does
    with a stored prefix): a strided cache (4 shards, 16 slots, 10 filled) grown to 32 and cut to 12 holds, in slot
    order, what the slot-order cache grown or cut the same way holds; a capacity the shards do not divide is one
    clear error."""
    slots = jnp.arange(16, dtype=jnp.float32).reshape(1, 1, 1, 16, 1) + 1
    slots = jnp.where(slots <= 10, slots, 0.0)  # 10 written slots, zeros after (as an empty cache's)
    flat = KVCache((slots,), (2 * slots,), (jnp.zeros((1, 0, 1, 16, 3)),), jnp.asarray(10, jnp.int32))
    strided = flat.relayout(4)
    assert strided.stride == 4 and np.asarray(strided.c_kv[0]).ravel()[:4].tolist() == [1, 5, 9, 0]  # device 0
    for capacity in (32, 12):
        got, want = fit_capacity(strided, capacity), fit_capacity(flat, capacity)
        assert got.stride == 4 and got.capacity == capacity
        for g, w in zip(jax.tree.leaves(got.relayout(1)), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    with pytest.raises(ValueError, match="cannot hold 30 slots: use a multiple of 4"):
        fit_capacity(strided, 30)


def test_a_strided_cache_refuses_another_mesh(written):
    """A cache laid out over 4 slot shards written under folded=8 (8 shards) or outside a mesh would put rows in the
    wrong slots: one error naming both and the fix (traced only)."""
    chunks, _ = written
    cache = _empty_cache().relayout(4)
    mesh_spec = parse_mesh("folded=8")
    with axis_rules(mesh_spec.rules()), jax.set_mesh(mesh_spec.make()):
        with pytest.raises(ValueError, match=r"over 4 slot shards .* splits slots 8 ways; .* cache.relayout\(8\)"):
            jax.eval_shape(write_chunk, cache, *chunks[0][:3], chunks[0][3])
    with pytest.raises(ValueError, match=r"splits slots 1 ways; .* cache.relayout\(1\)"):
        jax.eval_shape(write_chunk, cache, *chunks[0][:3], chunks[0][3])


def test_one_device_write_is_a_dynamic_update_slice(written):
    chunks, _ = written
    jaxpr = jax.make_jaxpr(write_chunk, static_argnums=4)(_empty_cache(), *chunks[1])
    names = {e.primitive.name for e in all_eqns(jaxpr.jaxpr)}
    assert "dynamic_update_slice" in names and "shard_map" not in names
    assert not [e for e in all_eqns(jaxpr.jaxpr) if e.primitive.name == "select_n" and e.outvars[0].aval.ndim]


def test_sharded_decode_reads_the_prompt_cache_in_place():
    """The sampler's decode loop (folded=8, 4096 prompt slots per device, so the prompt cache dominates the
    program's buffers): the G rows share the batch-1 prompt cache, which is only read (no select or copy over
    a shard of it in the compiled loop, not aliased to any output), the donated suffix is aliased to the
    final one, and XLA's temporaries stay far below one prompt-cache shard (a G-row copy of the cache would
    be G x all of it)."""
    cfg = config.tiny(num_hidden_layers=2, indexer_types=("full", "shared"))
    opts = glm52_jax.ModelOptions(param_dtype=jnp.bfloat16, indexer_query_block=16, indexer_key_block=16,
                                  attention_query_block=8)
    rows, slots, steps = 2, 8 * 4096, 2
    # Replicated weights: FSDP's per-layer weight gathers would be the loop's temporaries (not what this checks).
    mesh_spec = dataclasses.replace(parse_mesh("folded=8"), weight_sharding="replicated")
    mesh = mesh_spec.make()
    with axis_rules(mesh_spec.rules()):
        model = place_model(GlmMoeDsa(cfg, opts, rngs=nnx.Rngs(0)), mesh)
        graphdef, state = nnx.split(model)
        with jax.set_mesh(mesh):
            prompt_cache = jax.jit(lambda: model.init_cache(1, slots))()
            suffix = jax.jit(lambda: model.init_suffix(rows, steps))()

            def decode(state, prompt, suffix, h_last, keys):
                return sampler.decode_steps(nnx.merge(graphdef, state), prompt, suffix, h_last, keys, None,
                                            steps=steps, temperature=1.0, top_k=0, top_p=1.0, stop_ids=(1,))

            args = (state, prompt_cache, suffix, jnp.zeros((rows, cfg.hidden_size), jnp.bfloat16),
                    jax.random.split(jax.random.key(0), rows))
            compiled = jax.jit(decode, donate_argnums=(2,), compiler_options=sampler.CACHE_COMPILER_OPTIONS).lower(
                *args).compile()
    stacks = [a for a in jax.tree.leaves((prompt_cache.c_kv, prompt_cache.k_rope, prompt_cache.index_k)) if a.size]
    shard_bytes = [a.addressable_shards[0].data.nbytes for a in stacks]
    suffix_bytes = sum(a.nbytes for a in jax.tree.leaves((suffix.c_kv, suffix.k_rope, suffix.index_k)))
    mem = compiled.memory_analysis()
    assert suffix_bytes <= mem.alias_size_in_bytes < suffix_bytes + 1024  # the suffix's buffers are the loop's
    assert mem.temp_size_in_bytes < max(shard_bytes) // 2, (mem.temp_size_in_bytes, shard_bytes)
    hlo = compiled.as_text()
    shard_types = {f"{'bf16' if a.dtype == jnp.bfloat16 else 'f32'}[{','.join(map(str, shape))}]"
                   for a, shape in ((a, a.addressable_shards[0].data.shape) for a in stacks)}
    whole = [line.strip()[:160] for line in hlo.splitlines() if any(t in line for t in shard_types)
             and (" select(" in line or " copy(" in line or " dynamic-update-slice(" in line)]
    assert not whole, whole
