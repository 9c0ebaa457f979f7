"""model/kv_cache.py: chunk writes into a slot-sharded cache, and that a sharded decode updates it in place.

The written values are the inputs of `write_chunk`, so a sharded write must equal the one-device
`dynamic_update_slice` bit for bit, whichever shards a chunk touches (the model-level decode on
meshes: tests/parallel/test_sharded_rl.py).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxpr_utils import all_eqns

import glm52_jax
from glm52_jax import config
from glm52_jax.model.kv_cache import CACHE_AXES, KVCache, write_chunk
from glm52_jax.model.transformer import GlmMoeDsa
from glm52_jax.parallel.mesh import parse_mesh
from glm52_jax.parallel.placement import place_model
from glm52_jax.parallel.rules import axis_rules, logical_to_spec
from glm52_jax.rollout import sampler

CAPACITY = 64  # 16 slots per shard on context=4, 8 on folded=8
# (length before, chunk tokens): a chunk inside one shard, one straddling a boundary (13..18 on 16 and
# 8), one wider than a shard (19..38), decode tokens at the last slot of a shard and the first of the next.
WRITES = ((0, 13), (13, 6), (19, 20), (39, 1), (40, 1), (41, 6), (47, 1), (48, 1))
_write = jax.jit(write_chunk, static_argnums=4)


def _empty_cache() -> KVCache:
    """Two segments' worth of the shapes `init_cache` makes ([reps, U|F, B, Cap, *]); bf16 latents, f32 keys."""
    def z(reps, unit, width, dtype):
        return jnp.zeros((reps, unit, 2, CAPACITY, width), dtype)

    bf16, f32 = jnp.bfloat16, jnp.float32
    return KVCache((z(2, 2, 8, bf16), z(1, 1, 8, bf16)), (z(2, 2, 4, bf16), z(1, 1, 4, bf16)),
                   (z(2, 1, 4, f32), z(1, 0, 4, f32)), jnp.zeros((), jnp.int32))


def _chunks():
    rng = np.random.default_rng(0)
    cache = _empty_cache()

    def like(stacks, seq):  # float32 entries, as the layers emit them (rounded to bf16 by the write)
        return [jnp.asarray(rng.normal(size=(*a.shape[:3], seq, a.shape[4])), jnp.float32) for a in stacks]

    return [(like(cache.c_kv, s), like(cache.k_rope, s), like(cache.index_k, s), s) for _, s in WRITES]


def _write_all(chunks, mesh=None) -> KVCache:
    """All WRITES in turn; with `mesh`, from a cache placed as `init_cache` places it (slots sharded)."""
    cache = _empty_cache()
    if mesh is not None:
        slots = NamedSharding(mesh, logical_to_spec(CACHE_AXES, mesh_axes=mesh.axis_names))
        cache = jax.tree.map(lambda a: jax.device_put(a, slots if a.ndim else NamedSharding(mesh, P())), cache)
    for (length, _), chunk in zip(WRITES, chunks):
        assert int(cache.length) == length
        cache = _write(cache, *chunk)
    return cache


@pytest.fixture(scope="module")
def written():
    chunks = _chunks()
    return chunks, _write_all(chunks)


@pytest.mark.parametrize("spec", ["context=4,expert=2", pytest.param("folded=8", marks=pytest.mark.slow)])
def test_sharded_writes_equal_one_device_bitwise(written, spec):
    chunks, want = written
    mesh_spec = parse_mesh(spec)
    mesh = mesh_spec.make()
    with axis_rules(mesh_spec.rules()), jax.set_mesh(mesh):
        got = _write_all(chunks, mesh)
        jaxpr = jax.make_jaxpr(write_chunk, static_argnums=4)(got, *chunks[1])
    ways = CAPACITY // 4 if spec.startswith("context") else CAPACITY // 8
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        if g.size > 1:  # the slot axis stays sharded: each device holds its range (not the empty index_k)
            assert {s.data.shape[3] for s in g.addressable_shards} == {ways}, g.sharding
    assert int(got.length) == sum(s for _, s in WRITES)
    # Written per device (a shard_map), never a select over a whole stack.
    assert any(e.primitive.name == "shard_map" for e in jaxpr.jaxpr.eqns)
    stack_shapes = {a.shape for a in jax.tree.leaves(want) if a.ndim}
    assert not [e for e in all_eqns(jaxpr.jaxpr) if e.primitive.name == "select_n"
                and e.outvars[0].aval.shape in stack_shapes]


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
