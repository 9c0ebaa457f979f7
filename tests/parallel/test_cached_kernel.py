"""One attention layer's chunk over a slot-strided cache with kernels="pallas" (the sparse MLA kernel, interpret mode
on this CPU mesh) equals the jnp path (kernels="reference"): the layer's output and the LoRA gradients, for both
cached readers, `context_parallel.cp_cached_attention` (a chunk against its own batch's cache) and
`shared_cache` (G rows against one batch-1 prompt cache plus their suffixes). A float32 tiny layer whose top-k
comes from an earlier layer (a 'shared' indexer layer: no indexer kernel in the program). `quantized`: an FP8 cache
(e4m3 c_kv rows and their per-row scales, sharded by slot like them): the kernel reads the e4m3 rows in place, the jnp
path gathers and dequantizes them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from lora_utils import fast_rngs, with_random_b

import glm52_jax
from glm52_jax import config
from glm52_jax import positions as rope_lib
from glm52_jax.model import cache_fp8, context_parallel
from glm52_jax.model.kv_cache import CACHE_AXES, LayerCacheView, SlotLayout, slot_ways
from glm52_jax.model.lora import LoRA, LoRAConfig
from glm52_jax.model.mla import Attention
from glm52_jax.model.shared_cache import SUFFIX_AXES, SharedLayerView
from glm52_jax.parallel.mesh import parse_mesh
from glm52_jax.parallel.rules import axis_rules, logical_to_spec

CFG = config.tiny(num_hidden_layers=1, indexer_types=("full",))  # the layer is built without its indexer
OPTS = glm52_jax.ModelOptions(param_dtype=jnp.float32, attention_query_block=8, lora=LoRAConfig(rank=4, alpha=8.0))
B, S, CAP, LENGTH, SUFFIX = 2, 3, 64, 37, 2  # shared: B rows, SUFFIX tokens written after the prompt


def _inputs(shared: bool):
    """x [B,S,D], cache stacks [1,1,B|1,CAP,*] in slot order, suffix stacks [1,1,B,SUFFIX,*] (shared) and the top-k
    [B,S,K] an earlier layer chose: causal slots, one query with no key, one with padding."""
    rng = np.random.default_rng(2)
    c, r, k = CFG.kv_lora_rank, CFG.qk_rope_head_dim, CFG.index_topk
    rows = 1 if shared else B
    written = LENGTH + (SUFFIX if shared else 0)  # slots before the chunk
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    x = normal(B, S, CFG.hidden_size)
    stacks = (normal(1, 1, rows, CAP, c), normal(1, 1, rows, CAP, r))
    suffix = (normal(1, 1, B, SUFFIX, c), normal(1, 1, B, SUFFIX, r)) if shared else None
    topk = np.full((B, S, k), -1, np.int32)
    for b in range(B):
        for s in range(S):
            visible = written + s + 1
            topk[b, s, :min(k, visible)] = rng.permutation(visible)[:k]
    topk[1, 0] = -1  # no key: the layer's output for it is its LoRA-free o_proj of zero
    topk[0, 2, -7:] = -1
    return x, stacks, suffix, jnp.asarray(topk)


def _layer_results(spec: str, shared: bool, quantized: bool = False):
    """{kernels: (y, LoRA gradients)} of one cached chunk under the mesh `spec`."""
    model = with_random_b(Attention(CFG, False, OPTS, rngs=fast_rngs()), seed=4)
    graphdef, lora, rest = nnx.split(model, LoRA, ...)
    x, stacks, suffix, topk = _inputs(shared)
    if quantized:  # (e4m3 c_kv, k_rope, c_kv's scales [1,1,B,CAP])
        stacks = (*cache_fp8.quantize_rows(stacks[0] * (1.0 + jnp.arange(CAP) % 4)[:, None]), stacks[1])
        stacks = (stacks[0], stacks[2], stacks[1])
    mesh_spec = parse_mesh(spec)
    mesh = mesh_spec.make()
    with axis_rules(mesh_spec.rules()), jax.set_mesh(mesh):
        ways = slot_ways()
        layout = SlotLayout(ways)
        spec_of = lambda axes: NamedSharding(mesh, logical_to_spec(axes, mesh_axes=mesh.axis_names))  # noqa: E731
        stacks = tuple(jax.device_put(layout.from_slots(a, 3), spec_of(CACHE_AXES[:a.ndim])) for a in stacks)
        if suffix is not None:
            suffix = tuple(jax.device_put(a, spec_of(SUFFIX_AXES)) for a in suffix)
        start = LENGTH + (SUFFIX if shared else 0)
        positions = start + jnp.arange(S, dtype=jnp.int32)
        cos, sin = rope_lib.rope_cos_sin(positions, rope_lib.rotary_table(CFG.rope, CFG.qk_rope_head_dim))

        def loss(lora, x, stacks, suffix, kernels):
            layer = nnx.merge(graphdef, lora, rest)
            layer.opts = dataclasses.replace(OPTS, kernels=kernels)
            view = LayerCacheView(*stacks[:2], None, (0, 0), None, jnp.int32(LENGTH), *stacks[2:], stride=ways)
            if suffix is not None:
                view = SharedLayerView(view, *suffix, None, jnp.int32(SUFFIX))
            y = layer(x, cos[None], sin[None], positions, topk, view)[0]
            return jnp.sum(jnp.sin(y)), y

        grad = jax.jit(jax.grad(loss, has_aux=True), static_argnums=4)
        results = {}
        for kernels in ("pallas", "reference"):
            traced = grad.trace(lora, x, stacks, suffix, kernels)
            # mla.py hands `kernels` down: the kernel runs (interpret mode: a pallas_call in the traced program).
            assert ("pallas_call" in str(traced.jaxpr)) == (kernels == "pallas")
            results[kernels] = traced.lower().compile()(lora, x, stacks, suffix)
        return results, ways


# ~15-25 s each (interpret mode); the shared reader's and the FP8 cases are `slow` for CI's budget
# (tests/model/test_context_parallel.py runs the batch-1 stack the shared reader reads, and an FP8 stack, on the
# kernel in CI).
@pytest.mark.parametrize(("shared", "quantized"), [(False, False), pytest.param(True, False, marks=pytest.mark.slow),
                                                   pytest.param(False, True, marks=pytest.mark.slow),
                                                   pytest.param(True, True, marks=pytest.mark.slow)])
def test_cached_layer_on_the_kernel_equals_the_jnp_path(shared, quantized):
    old = context_parallel.KEY_BLOCK
    context_parallel.KEY_BLOCK = 8  # several key blocks per device
    try:
        results, ways = _layer_results("folded=8", shared, quantized)
    finally:
        context_parallel.KEY_BLOCK = old
    assert ways == 8
    (got_grads, got), (want_grads, want) = results["pallas"], results["reference"]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    flat_want = nnx.to_flat_state(want_grads)
    flat_got = dict(nnx.to_flat_state(got_grads))
    assert len(flat_want) >= 10
    for path, var in flat_want:
        w = np.asarray(var.get_value())
        assert np.abs(w).max() > 0, path
        np.testing.assert_allclose(np.asarray(flat_got[path].get_value()), w, rtol=1e-5, atol=1e-6, err_msg=str(path))
