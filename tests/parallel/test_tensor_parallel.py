"""Few-token calls with the FSDP-sharded frozen weights left in place (`parallel/tensor_parallel.py`).

The helpers against plain jnp on 8 virtual devices, then the model on folded=8 with FSDP weights: a greedy
decode and the response_only LoRA gradients with `gather_weights_min_tokens` forcing the tensor-parallel path
equal the gathered path, and the compiled decode all-gathers activations, not weights.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from lora_utils import fast_rngs, with_random_b

import glm52_jax
from glm52_jax import config
from glm52_jax.model.layers import weight_axes
from glm52_jax.model.lora import LoRA, LoRAConfig
from glm52_jax.model.transformer import GlmMoeDsa
from glm52_jax.parallel import tensor_parallel
from glm52_jax.parallel.mesh import parse_mesh
from glm52_jax.parallel.placement import place_model
from glm52_jax.parallel.rules import STACK_AXIS, axis_rules, fsdp_split
from glm52_jax.plan.hlo import dims, parse_hlo, shape_bytes
from glm52_jax.rl.gradients import cached_logprobs
from glm52_jax.rollout.sampler import decode_steps

OPTS = glm52_jax.ModelOptions(param_dtype=jnp.float32, indexer_query_block=16, indexer_key_block=16,
                              attention_query_block=8,
                              # The adapters of the projections the switch changes (routed experts never move).
                              lora=LoRAConfig(rank=4, alpha=8.0, families=("attention", "shared_expert", "unembed")))
# Two MoE layers of one kind: one layer scan of two trips (the tensor-parallel projections inside a loop).
CFG = config.tiny(num_hidden_layers=2, indexer_types=("full", "full"), first_k_dense_replace=0)
P_LEN, G, R, CAPACITY = 21, 2, 6, 32
LIMIT = 16  # > G x R: the decode steps and the response forward keep the weights in place; 0 gathers them


def _mesh(shape=(2, 4), names=("a", "b")):
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def _rel(want, got):
    return float(np.linalg.norm(np.asarray(got) - np.asarray(want)) / np.linalg.norm(np.asarray(want)))


@pytest.mark.parametrize("spec, x_shape, w_shape, dim", [
    ("...d,di->...i", (2, 3, 16), (16, 24), 0),  # contracted: partial sums, psum
    ("...d,di->...i", (2, 3, 16), (16, 24), 1),  # output: all-gathered
    ("bshn,chn->bshc", (1, 3, 8, 4), (16, 8, 4), 1),  # in x and the output (per-head batch): sliced, all-gathered
])
def test_einsum_on_a_sharded_kernel_matches_jnp(spec, x_shape, w_shape, dim):
    rng = np.random.default_rng(dim)
    x, w = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in (x_shape, w_shape))
    mesh = _mesh()
    parts = [None] * len(w_shape)
    parts[dim] = ("a", "b")
    with jax.set_mesh(mesh):
        fn = jax.jit(lambda x, w: tensor_parallel.einsum(spec, x, w, (dim, ("a", "b"))))
        w_sharded = jax.device_put(w, NamedSharding(mesh, P(*parts)))
        got = fn(x, w_sharded)
        collectives = str(jax.make_jaxpr(fn)(x, w_sharded))
    np.testing.assert_allclose(np.asarray(got), np.asarray(jnp.einsum(spec, x, w)), rtol=1e-6, atol=1e-6)
    assert got.sharding.is_fully_replicated
    letter = spec.split(",")[1].split("->")[0][dim]
    assert ("psum" in collectives) == (letter not in spec.split("->")[1]), collectives
    assert ("all_gather" in collectives) == (letter in spec.split("->")[1]), collectives


@pytest.mark.parametrize("dim", [0, 1])
def test_take_rows_of_a_sharded_table_matches_jnp(dim):
    table = jnp.asarray(np.random.default_rng(0).normal(size=(64, 16)), jnp.float32)
    ids = jnp.asarray([[0, 7, 8, 63], [31, 32, 33, 9]], jnp.int32)  # first / last rows of shards, repeats
    mesh = _mesh()
    with jax.set_mesh(mesh):
        parts = [None, None]
        parts[dim] = ("a", "b")
        got = jax.jit(lambda t, i: tensor_parallel.take_rows(t, i, (dim, ("a", "b"))))(
            jax.device_put(table, NamedSharding(mesh, P(*parts))), ids)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.take(table, ids, axis=0)))


def test_fsdp_split_names_the_dimension_and_axes_weight_spec_shards():
    mesh = parse_mesh("folded=8")
    with axis_rules(mesh.rules()), jax.set_mesh(mesh.make()):
        assert fsdp_split(("embed", "q_lora"), (64, 48)) == (0, ("cp_ep",))  # the largest free dimension
        assert fsdp_split(("q_lora", "heads", "qk_dim"), (48, 4, 40)) == (0, ("cp_ep",))
        assert fsdp_split(("vocab", "embed"), (512, 64)) == (1, ("cp_ep",))  # 'vocab' is the tensor axis's
        assert fsdp_split(("embed",), (12,)) is None  # no dimension divides by 8
        assert fsdp_split(("experts", "embed", "expert_mlp"), (8, 64, 32)) is None  # cp_ep already shards it
    assert fsdp_split(("embed", "q_lora"), (64, 48)) is None  # no mesh


@pytest.fixture(scope="module")
def setup():
    """folded=8 with FSDP weights: the model placed at threshold 0 (gathers) and LIMIT (keeps), a prompt cache."""
    model = with_random_b(GlmMoeDsa(CFG, OPTS, rngs=fast_rngs()), seed=3)
    spec = parse_mesh("folded=8")
    mesh = spec.make()
    prompt = np.random.default_rng(1).integers(0, CFG.vocab_size, P_LEN).astype(np.int32)
    with axis_rules(spec.rules()), jax.set_mesh(mesh):
        placed = place_model(model, mesh)
        graphdef, state = nnx.split(placed)
        h, cache = jax.jit(lambda st, ids: nnx.merge(graphdef, st).prefill(ids, CAPACITY))(state, prompt[None])
    models = {}
    for limit in (0, LIMIT):
        m = nnx.merge(graphdef, state)
        m.opts = dataclasses.replace(OPTS, gather_weights_min_tokens=limit)
        models[limit] = m
    return dict(spec=spec, mesh=mesh, models=models, prompt=prompt, cache=cache, h_last=h[:, -1])


@functools.partial(jax.jit, static_argnums=0)
def _greedy(graphdef, state, prompt_cache, h_last):
    model = nnx.merge(graphdef, state)
    h_rows = jnp.broadcast_to(h_last, (G, h_last.shape[-1]))
    return decode_steps(model, prompt_cache, model.init_suffix(G, R), h_rows, jax.random.split(jax.random.key(0), G),
                        None, steps=R, temperature=0.0, top_k=0, top_p=1.0, stop_ids=())


@pytest.fixture(scope="module")
def decoded(setup):
    """{limit: (tokens [G,R], log-probs [G,R], compiled HLO text)} of a greedy decode."""
    out = {}
    with axis_rules(setup["spec"].rules()), jax.set_mesh(setup["mesh"]):
        for limit, model in setup["models"].items():
            graphdef, state = nnx.split(model)
            compiled = _greedy.lower(graphdef, state, setup["cache"], setup["h_last"]).compile()
            tokens, logps, _ = compiled(state, setup["cache"], setup["h_last"])
            out[limit] = np.asarray(tokens), np.asarray(logps), compiled.as_text()
    return out


def test_decode_keeping_weights_in_place_equals_the_gathered_decode(decoded):
    (tokens, logps, _), (tp_tokens, tp_logps, _) = decoded[0], decoded[LIMIT]
    assert len(set(tokens.ravel().tolist())) > 2  # a real sequence, not one repeated token
    np.testing.assert_array_equal(tp_tokens, tokens)
    assert _rel(logps, tp_logps) <= 1e-6


def _all_gathers(hlo: str) -> list[str]:
    comps, _ = parse_hlo(hlo)
    return [ins.shape for instrs in comps.values() for ins in instrs if ins.opcode.startswith("all-gather")]


def _gathered_shapes(hlo: str) -> set[tuple[int, ...]]:
    """Result shapes of the all-gathers, leading 1s dropped (the layer scan gathers a [1,...] slice of a stack)."""
    out = set()
    for shape in _all_gathers(hlo):
        d = dims(shape)
        while len(d) > 1 and d[0] == 1:
            d = d[1:]
        out.add(tuple(d))
    return out


def test_decode_moves_activations_not_weights(setup, decoded):
    """The tensor-parallel decode all-gathers nothing larger than one step's logits [G,V] and no weight of the
    model (the MoE router included); the gathered decode gathers them."""
    model = setup["models"][0]
    weight_shapes = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shape = var.get_value().shape
        shape = shape[1:] if weight_axes(var)[0] == STACK_AXIS else shape  # one layer's slice of a stacked weight
        if len(shape) >= 2:
            weight_shapes[shape] = path
    gathered = _gathered_shapes(decoded[0][2]) & set(weight_shapes)
    kept = _gathered_shapes(decoded[LIMIT][2]) & set(weight_shapes)
    assert len(gathered) >= 8, gathered  # every projection, the embedding and lm_head
    assert not kept, [weight_shapes[s] for s in kept]
    largest = max(shape_bytes(s) for s in _all_gathers(decoded[LIMIT][2]))
    assert largest <= G * CFG.vocab_size * 4 < max(shape_bytes(s) for s in _all_gathers(decoded[0][2]))


@functools.partial(jax.jit, static_argnums=0)
def _response_grads(graphdef, lora, frozen, prompt_cache, last_prompt_token, responses, weights):
    """response_only's core: the G responses' log-probs after the prompt cache ([G,R]) and the LoRA gradient
    of a weighted sum of them (a policy-gradient-like loss; the prompt cache is a constant)."""
    def loss(lora):
        logps = cached_logprobs(nnx.merge(graphdef, lora, frozen), prompt_cache, last_prompt_token, responses, 4)
        return -(logps * weights).sum(), logps

    return jax.grad(loss, has_aux=True)(lora)


@pytest.mark.slow  # two gradient programs: ~25 s of CPU time
def test_response_only_lora_gradients_keeping_weights_in_place(setup):
    """The response forward (G x R = 12 tokens < LIMIT) and its logits tensor-parallel: the same new log-probs and
    LoRA gradients (1e-5 per array) as with the weights gathered."""
    rng = np.random.default_rng(5)
    responses = jnp.asarray(rng.integers(0, CFG.vocab_size, (G, R)), jnp.int32)
    weights = jnp.asarray(rng.normal(size=(G, R)), jnp.float32)
    out = {}
    with axis_rules(setup["spec"].rules()), jax.set_mesh(setup["mesh"]):
        for limit, model in setup["models"].items():
            graphdef, lora, frozen = nnx.split(model, LoRA, ...)
            grads, logps = _response_grads(graphdef, lora, frozen, setup["cache"], setup["prompt"][-1], responses,
                                           weights)
            out[limit] = np.asarray(logps), dict(nnx.to_flat_state(grads))
    assert _rel(out[0][0], out[LIMIT][0]) <= 1e-6
    assert len(out[0][1]) > 10
    for path, var in out[0][1].items():
        want = np.asarray(var.get_value())
        assert np.linalg.norm(want) > 0, f"{path}: zero gradient (the comparison would be vacuous)"
        assert _rel(want, out[LIMIT][1][path].get_value()) <= 1e-5, path
