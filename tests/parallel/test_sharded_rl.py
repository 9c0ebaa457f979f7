"""The RL path under meshes vs one device: gradient modes, indexer top-k, greedy decode, shardings.

Both layouts of the parallel issue on 8 virtual devices: the seed's folded axis (sequence in
attention and experts in the MoE on one 8-way axis) and context 4 x expert 2. The prompt (45) is
longer than `index_topk` (32) and divides by neither 8 nor 4.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P_
from lora_utils import fast_rngs, with_random_b

import glm52_jax
from glm52_jax import config
from glm52_jax.model import context_parallel
from glm52_jax.model.lora import LoRA, LoRAConfig
from glm52_jax.model.transformer import GlmMoeDsa
from glm52_jax.parallel.mesh import parse_mesh
from glm52_jax.parallel.placement import place_model
from glm52_jax.parallel.rules import axis_rules
from glm52_jax.rl.gradients import MODES, lora_gradients
from glm52_jax.rollout.sampler import Sampler, SamplingParams

OPTS = glm52_jax.ModelOptions(param_dtype=jnp.float32, indexer_query_block=16, indexer_key_block=16,
                              attention_query_block=8, lora=LoRAConfig(rank=4, alpha=8.0))
# Dense + full indexer, then MoE + shared indexer: every layer kind in two layers (short compiles).
CFG = config.tiny(num_hidden_layers=2, indexer_types=("full", "shared"))
P, G, R = 45, 2, 6
CHUNK = 3  # a jit cache key of its own (logits in two chunks)
MESHES = ("folded=8", "context=4,expert=2")
GREEDY = SamplingParams(num_samples=G, max_new_tokens=R, temperature=0.0)
QUIET = dict(chunk_size=16, capacity_multiple=16, progress=lambda *a: None)
CAPACITY = 64


def _hidden(graphdef, state, ids):
    """Hidden states [1,S,D] and the full layers' top-k {layer: [1,S,K]} of ids [1,S]."""
    return nnx.merge(graphdef, state).hidden_states(ids, return_topk=True)


# One jitted function for every forward of the file: equal graph definitions and shardings share a program.
_hidden_jit = jax.jit(_hidden, static_argnums=0)


def _ids(seq):
    return jnp.asarray(np.random.default_rng(seq).integers(0, CFG.vocab_size, (1, seq)), jnp.int32)


@pytest.fixture(scope="module")
def model():
    return with_random_b(GlmMoeDsa(CFG, OPTS, rngs=fast_rngs()), seed=3)


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(5)
    mask = np.ones((G, R), np.float32)
    mask[0, 5:] = 0
    return dict(prompt=rng.integers(0, CFG.vocab_size, P).astype(np.int32),
                responses=rng.integers(0, CFG.vocab_size, (G, R)).astype(np.int32), response_mask=mask,
                advantages=np.array([0.9, -1.1], np.float32),
                # Behaviour log-probs away from the new ones: ratios != 1, some tokens clipped.
                old_logprobs=rng.normal(-6.2, 0.3, (G, R)).astype(np.float32))


@pytest.fixture(scope="module")
def reference(model, batch):
    return {mode: lora_gradients(model, **batch, mode=mode, logprob_chunk=CHUNK) for mode in MODES}


@pytest.fixture(scope="module")
def reference_forward(model):
    """Single-device forward of `_ids(seq)`, computed once per length."""
    graphdef, state = nnx.split(model)
    done = {}

    def forward(seq):
        if seq not in done:
            done[seq] = _hidden_jit(graphdef, state, _ids(seq))
        return done[seq]

    return forward


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(9).integers(0, CFG.vocab_size, P).tolist()


@pytest.fixture(scope="module")
def reference_sampling(model, prompt):
    """Single device, chunked prefill: the prompt's cache and h_last, its greedy continuation, and the
    G rows' suffix cache after it."""
    sampler = Sampler(model, **QUIET)
    cache, h_last, _ = sampler.prefill(prompt, CAPACITY)
    return cache, h_last, sampler.sample(prompt, GREEDY), sampler.decode(cache, h_last, GREEDY)[2]


def _mesh(spec):
    mesh_spec = parse_mesh(spec)
    return mesh_spec, mesh_spec.make()


def _seq_ways(mesh, spec):
    return mesh.shape["cp_ep"] if spec.startswith("folded") else mesh.shape["context"]


def _rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30))


def _assert_same_topk_sets(got, want):
    """Causal top-k as sets per query (the order of equal scores is not part of the contract); -1 pads."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    for q in range(got.shape[1]):
        assert set(got[0, q][got[0, q] >= 0]) == set(want[0, q][want[0, q] >= 0]), q


# ~40 s each, slow for CI's budget: tests/rl/test_parity.py runs every mode on both meshes against one device
# from a nonzero LoRA (stronger: A gets gradients too) and checks the expert gradients stay split by expert.
@pytest.mark.slow
@pytest.mark.parametrize("spec", MESHES)
def test_gradient_modes_match_one_device(model, batch, reference, spec):
    mesh_spec, mesh = _mesh(spec)
    with axis_rules(mesh_spec.rules()):
        placed = place_model(model, mesh)
        with jax.set_mesh(mesh):
            results = {mode: lora_gradients(placed, **batch, mode=mode, logprob_chunk=CHUNK) for mode in MODES}
    for mode in MODES:
        ref, out = reference[mode], results[mode]
        np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(float(out.loss), float(ref.loss), rtol=1e-5, atol=1e-7)
        ref_leaves = nnx.to_flat_state(ref.grads)
        out_leaves = dict(nnx.to_flat_state(out.grads))
        worst = 0.0
        for path, var in ref_leaves:
            expected = np.asarray(var.get_value())
            assert np.linalg.norm(expected) > 0, f"{path}: zero reference gradient (test would be vacuous)"
            worst = max(worst, _rel_l2(expected, out_leaves[path].get_value()))
        print(f"{spec} {mode}: worst per-array gradient rel-L2 {worst:.2e}")
        assert worst <= 1e-5, (spec, mode, worst)
    # The sharded gradients keep the parameters' layout: an expert LoRA gradient stays split by expert.
    grads = dict(nnx.to_flat_state(results["conventional"].grads))
    expert_grads = [v.get_value() for p, v in grads.items() if "mlp" in p and "gate" in "/".join(map(str, p))
                    and v.get_value().ndim == 4]
    assert expert_grads, "no routed-expert LoRA gradient found"
    n_expert_ways = mesh.shape["cp_ep"] if spec.startswith("folded") else mesh.shape["expert"]
    for g in expert_grads:
        shard = g.addressable_shards[0].data
        assert shard.shape[1] == g.shape[1] // n_expert_ways, (g.shape, shard.shape)


@pytest.mark.parametrize("spec", MESHES)
def test_topk_and_activations_are_sharded_and_equal(model, reference_forward, spec):
    h_ref, topk_ref = reference_forward(48)
    mesh_spec, mesh = _mesh(spec)
    with axis_rules(mesh_spec.rules()):
        graphdef, state = nnx.split(place_model(model, mesh))
        with jax.set_mesh(mesh):
            h, topk = _hidden_jit(graphdef, state, _ids(48))
    np.testing.assert_allclose(np.asarray(h), np.asarray(h_ref), rtol=1e-5, atol=1e-5)
    assert set(topk) == set(topk_ref) == {0}  # layer 0 is the only full indexer layer
    _assert_same_topk_sets(topk[0], topk_ref[0])
    # Each device holds 1/N of the sequence of the sequence-sharded hidden states.
    assert {s.data.shape[1] for s in h.addressable_shards} == {48 // _seq_ways(mesh, spec)}


def _assert_cache_slots_sharded(cache, mesh, spec):
    stacks = [a for a in (*cache.c_kv, *cache.k_rope, *cache.index_k) if a.size]  # skip empty index_k
    assert len(stacks) == 5  # two segments' latents and rope keys, one segment's indexer keys
    for stack in stacks:
        assert {s.data.shape[3] for s in stack.addressable_shards} == {CAPACITY // _seq_ways(mesh, spec)}, \
            stack.sharding


@pytest.mark.parametrize("spec", MESHES)
def test_greedy_decode_matches_and_cache_is_sharded(model, prompt, reference_sampling, spec):
    ref = reference_sampling[2]
    mesh_spec, mesh = _mesh(spec)
    with axis_rules(mesh_spec.rules()):
        sampler = Sampler(place_model(model, mesh), **QUIET)
        with jax.set_mesh(mesh):
            cache, h_last, _ = sampler.prefill(prompt, CAPACITY)
            out = sampler.sample(prompt, GREEDY)
            decoded = sampler.decode(cache, h_last, GREEDY)[2]  # the program `sample` ran, its final suffix
            # The decode step runs the explicit path: local indexer scores, merged candidates,
            # attention where the keys live, log-sum-exp combine (a pmax + psums).
            step = jax.make_jaxpr(lambda st, c, ids: nnx.merge(sampler.graphdef, st).forward_shared(
                ids, c, sampler.model.init_suffix(G, R)))(sampler.state, cache, jnp.zeros((G, 1), jnp.int32))
            assert "pmax" in str(step) and "all_gather" in str(step)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, rtol=1e-5, atol=1e-5)
    _assert_cache_slots_sharded(cache, mesh, spec)
    assert int(cache.length) == P  # decode only reads the prompt cache
    # The chunks (16 tokens) straddle folded=8's 8-slot shards, each device writing its own part in place;
    # decode writes each step's token into the (replicated) suffix. The entries come from sharded compute
    # (equal up to rounding; the writes alone are bit-exact: tests/model/test_kv_cache.py).
    assert cache.stride == _seq_ways(mesh, spec)  # strided over the slot shards; compared in slot order
    for got_cache, want_cache in ((cache.relayout(1), reference_sampling[0]), (decoded, reference_sampling[3])):
        assert int(got_cache.length) == int(want_cache.length)
        for got, want in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
            assert got.shape == want.shape and got.dtype == want.dtype
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_long_cached_chunks_run_in_query_blocks(model, prompt, reference_sampling, monkeypatch):
    """A cached chunk longer than `MAX_CACHED_QUERIES` (a 16K prefill tail at 2M) runs in query blocks, each device
    scoring its own slots: here blocks of 6 queries (the last padded) for the 16-token chunks, on folded=8; the
    same cache, h_last and greedy continuation as one device."""
    monkeypatch.setattr(context_parallel, "MAX_CACHED_QUERIES", 6)
    ref_cache, ref_h, ref, _ = reference_sampling
    mesh_spec, mesh = _mesh("folded=8")
    with axis_rules(mesh_spec.rules()):
        sampler = Sampler(place_model(model, mesh), **QUIET)
        with jax.set_mesh(mesh):
            cache, h_last, _ = sampler.prefill(prompt, CAPACITY)
            chunk = jax.make_jaxpr(lambda st, c, ids: nnx.merge(sampler.graphdef, st).forward_cached(ids, c))(
                sampler.state, cache, jnp.zeros((1, 16), jnp.int32))
            assert "shard_map" in str(chunk) and "pmax" in str(chunk)  # the explicit path, in a loop over blocks
            out = sampler.sample(prompt, GREEDY)
    np.testing.assert_allclose(np.asarray(h_last), np.asarray(ref_h), rtol=1e-5, atol=1e-5)
    for got, want in zip(jax.tree.leaves(cache.relayout(1)), jax.tree.leaves(ref_cache)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.tokens, ref.tokens)


def _replicated_new_arrays(before: set[int], min_bytes: int) -> list[str]:
    """Arrays created since `before` (ids of live arrays) that live whole on every device of a multi-device mesh."""
    return [f"{a.shape} {a.dtype} {a.sharding}" for a in jax.live_arrays()
            if id(a) not in before and len(a.sharding.device_set) > 1 and a.sharding.is_fully_replicated
            and a.size * a.dtype.itemsize >= min_bytes]


def test_cache_padded_for_the_slot_shards_at_the_position_limit(model, prompt, reference_sampling):
    """The rehearsal's shape: prompt + new tokens = the position limit (51), which 8 slot shards do not
    divide. The sampler pads the cache to 56 slots (7 per device) without moving the limit (52 tokens are
    still refused), creates it sharded (no new array lives whole on every device) and decodes what one
    device decodes without padding."""
    ref = reference_sampling[2]
    limited = GlmMoeDsa(dataclasses.replace(CFG, max_position_embeddings=P + R), OPTS, rngs=fast_rngs())
    nnx.update(limited, nnx.state(model))  # the same weights, 51 positions
    mesh_spec, mesh = _mesh("folded=8")
    with axis_rules(mesh_spec.rules()):
        sampler = Sampler(place_model(limited, mesh), **dict(QUIET, capacity_multiple=1))
        with jax.set_mesh(mesh):
            before = {id(a) for a in jax.live_arrays()}
            assert sampler.capacity_for(P, R) == 56
            cache, _, _ = sampler.prefill(prompt, sampler.capacity_for(P, R))
            out = sampler.sample(prompt, GREEDY)
            replicated = _replicated_new_arrays(before, min_bytes=1024)
            with pytest.raises(ValueError, match="exceeds the position capacity max_position_embeddings=51"):
                sampler.sample(prompt + [1], GREEDY)
    assert Sampler(limited, **dict(QUIET, capacity_multiple=1)).capacity_for(P, R) == 51  # one device: no padding
    assert not replicated, replicated
    assert cache.capacity == 56 and int(cache.length) == P
    for stack in (*cache.c_kv, *cache.k_rope):
        assert {sh.data.shape[3] for sh in stack.addressable_shards} == {7}, stack.sharding
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout,spec,seq", [("zigzag", "folded=8", 45), ("contiguous", "context=4,expert=2", 45),
                                             ("zigzag", "context=4,expert=2", 20)])
def test_explicit_context_parallel_layouts(model, reference_forward, layout, spec, seq):
    """The shard_map CP attention (all-gathered key side, padded, zigzag or contiguous) equals the
    single-device forward, including lengths below index_topk and not divisible by 2N."""
    h_ref, topk_ref = reference_forward(seq)
    mesh_spec, mesh = _mesh(spec)
    opts = dataclasses.replace(OPTS, context_parallel=layout)
    with axis_rules(mesh_spec.rules()):
        state = nnx.state(place_model(model, mesh))
        # Same parameters, other run-time options: the options live in the graph definition.
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: GlmMoeDsa(CFG, opts, rngs=fast_rngs())))
        with jax.set_mesh(mesh):
            h, topk = _hidden_jit(graphdef, state, _ids(seq))
            jaxpr = str(jax.make_jaxpr(_hidden, static_argnums=0)(graphdef, state, _ids(seq)))
    assert "all_gather" in jaxpr and "shard_map" in jaxpr  # the explicit path ran
    np.testing.assert_allclose(np.asarray(h), np.asarray(h_ref), rtol=1e-5, atol=1e-5)
    assert topk[0].shape == (1, seq, min(CFG.index_topk, seq))
    _assert_same_topk_sets(topk[0], topk_ref[0])


def _gathers_in_maps(jaxpr, length: int, inside: bool = False) -> int:
    """all_gather equations inside a scan of `length` trips (a `lax.map` over that many blocks), nested bodies too."""
    count = 0
    for eqn in jaxpr.eqns:
        count += int(inside and eqn.primitive.name == "all_gather")
        here = inside or (eqn.primitive.name == "scan" and eqn.params.get("length") == length)
        for param in eqn.params.values():
            for p in (param if isinstance(param, (list, tuple)) else [param]):
                inner = getattr(p, "jaxpr", p)
                if hasattr(inner, "eqns"):
                    count += _gathers_in_maps(inner, length, here)
    return count


@pytest.mark.parametrize("spec", MESHES)
def test_whole_prompt_prefill_is_context_parallel_and_matches_chunked(model, prompt, reference_sampling, spec,
                                                                      monkeypatch):
    """The sampler's `whole` prefill on a mesh (one explicit-CP forward that also emits the cache)
    gives the single-device chunked prefill's cache and h_last, with slots sharded 1/N, and the
    same greedy continuation. On folded=8 the attention and the dense MLPs run in token blocks
    (`context_parallel.WHOLE_QUERY_BLOCK`, as the 2M prompt's 262,144 tokens per device do): 2 of each device's 6
    tokens per block, blocks straddling the zigzag layout's two chunks."""
    from glm52_jax.model import context_parallel

    if spec == "folded=8":
        monkeypatch.setattr(context_parallel, "WHOLE_QUERY_BLOCK", 2)
    ref_cache, ref_h, ref, _ = reference_sampling
    mesh_spec, mesh = _mesh(spec)
    with axis_rules(mesh_spec.rules()):
        sampler = Sampler(place_model(model, mesh), prefill_mode="whole", **QUIET)
        with jax.set_mesh(mesh):
            cache, h_last, _ = sampler.prefill(prompt, CAPACITY)
            assert sampler.prefill_calls == 1  # one program for the whole prompt
            closed = jax.make_jaxpr(lambda st, ids: nnx.merge(sampler.graphdef, st).prefill(ids, CAPACITY))(
                sampler.state, jnp.asarray(prompt, jnp.int32)[None])
            jaxpr = str(closed)
            assert "shard_map" in jaxpr and "all_gather" in jaxpr  # the explicit CP forward ran
            assert context_parallel.whole_blocks(48, 8 if spec == "folded=8" else 4) == (3 if spec == "folded=8" else 1)
            if spec == "folded=8":  # the key side is gathered once per layer, before the blocks, not in each block
                assert _gathers_in_maps(closed.jaxpr, length=3) == 0
            sampler.prefix_cache.clear()
            out = sampler.sample(prompt, GREEDY)
    assert int(cache.length) == P
    np.testing.assert_allclose(np.asarray(h_last), np.asarray(ref_h), rtol=1e-5, atol=1e-5)
    assert cache.stride == _seq_ways(mesh, spec)  # the re-layout put the slots where the chunked writes do
    for got, want in zip(jax.tree.leaves(cache.relayout(1)), jax.tree.leaves(ref_cache)):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    _assert_cache_slots_sharded(cache, mesh, spec)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, rtol=1e-5, atol=1e-5)




def test_shared_prefix_gradients_through_query_blocks_match_one_device(model, batch, monkeypatch):
    """shared_prefix differentiates the prompt's whole forward; past `WHOLE_QUERY_BLOCK` tokens per device (the 2M
    prompt) its attention runs in query blocks against the key side gathered once (`context.gather_key_side`, a
    replicated all-gather the blocks share): the LoRA gradients and log-probs equal one device's on folded=8 with 2
    tokens per block."""
    from glm52_jax.model import context_parallel

    ref = lora_gradients(model, **batch, mode="shared_prefix", logprob_chunk=CHUNK)
    monkeypatch.setattr(context_parallel, "WHOLE_QUERY_BLOCK", 2)
    gathers = []
    monkeypatch.setattr(context_parallel, "gather_key_side",
                        lambda *a, _f=context_parallel.gather_key_side: gathers.append(1) or _f(*a))
    mesh_spec, mesh = _mesh("folded=8")
    with axis_rules(mesh_spec.rules()):
        placed = place_model(model, mesh)
        with jax.set_mesh(mesh):
            out = lora_gradients(placed, **batch, mode="shared_prefix", logprob_chunk=CHUNK)
    assert gathers  # the blocked path ran
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs), rtol=1e-5, atol=1e-5)
    got = dict(nnx.to_flat_state(out.grads))
    for path, var in nnx.to_flat_state(ref.grads):
        expected = np.asarray(var.get_value())
        assert np.linalg.norm(expected) > 0, path
        assert _rel_l2(expected, got[path].get_value()) <= 1e-5, path


def test_fp8_indexer_rescoring_every_key_samples_as_bf16(model, prompt, reference_sampling):
    """`indexer_dtype="fp8"` with `indexer_candidates` >= every key: the FP8 loops keep all keys and the rescoring
    selects bf16 scoring's top-k in each path the 2M run takes on a mesh: the whole-prompt context-parallel prefill
    (gathered keys) and the decode's per-device cached top-k merged across the slot shards. So the folded=8 greedy
    run equals the one-device bf16 run (tokens; log-probs 1e-5). The rescoring with fewer candidates than keys:
    tests/kernels/test_indexer_kernel.py (an oracle)."""
    opts = dataclasses.replace(model.opts, indexer_dtype="fp8", indexer_candidates=CAPACITY)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: GlmMoeDsa(CFG, opts, rngs=nnx.Rngs(0))))
    fp8 = nnx.merge(graphdef, nnx.state(model))
    ref = reference_sampling[2]
    mesh_spec, mesh = _mesh("folded=8")
    with axis_rules(mesh_spec.rules()):
        sampler = Sampler(place_model(fp8, mesh), prefill_mode="whole", **QUIET)
        with jax.set_mesh(mesh):
            out = sampler.sample(prompt, GREEDY)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, rtol=1e-5, atol=1e-5)

@functools.partial(jax.jit, static_argnums=0)
def _logits_and_lora_grads(graphdef, params, lora, ids):
    """Logits [1,S,V] of ids [1,S] and the LoRA gradient of a loss on all of them (mean next-token log-prob)."""
    def loss(lora):
        logits = nnx.merge(graphdef, params, lora)(ids)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean(), logits

    return jax.grad(loss, has_aux=True)(lora)[::-1]


def test_fsdp_weights_match_replicated_ones(model):
    """folded=8: the base weights FSDP-sharded 8 ways (gathered one layer at a time inside the layer scan) give
    the replicated weights' logits (1e-6 relative) and LoRA gradients (1e-5 per array)."""
    ids = _ids(48)
    out = {}
    for sharding in ("fsdp", "replicated"):
        mesh_spec = parse_mesh("folded=8", sharding)
        mesh = mesh_spec.make()
        with axis_rules(mesh_spec.rules()):
            graphdef, params, lora = nnx.split(place_model(model, mesh), nnx.Param, LoRA)
            with jax.set_mesh(mesh):
                logits, grads = _logits_and_lora_grads(graphdef, params, lora, ids)
        q_a = params["stacks"][0]["layers"][0]["self_attn"]["q_a_proj"].get_value()
        assert q_a.sharding.spec == P_(None, "cp_ep", None) if sharding == "fsdp" else P_(None, None, None)
        out[sharding] = np.asarray(logits), dict(nnx.to_flat_state(grads))
    assert _rel_l2(out["replicated"][0], out["fsdp"][0]) <= 1e-6
    assert len(out["replicated"][1]) > 10
    for path, var in out["replicated"][1].items():
        expected = np.asarray(var.get_value())
        assert np.linalg.norm(expected) > 0, f"{path}: zero gradient (the comparison would be vacuous)"
        assert _rel_l2(expected, out["fsdp"][1][path].get_value()) <= 1e-5, path
