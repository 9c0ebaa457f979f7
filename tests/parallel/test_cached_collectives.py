"""The cached context-parallel attention's collectives (model/context_parallel.lse_attention): each device
attends only to the selected keys it holds, so what crosses devices is per query and head (the LSE combine's
max, sum and output), never per selected key, on the jnp path and on the sparse MLA kernel (interpret mode here;
tests/kernels/test_aot_cached_cp.py checks the GPU program). Compiled on an 8-device CPU mesh, forward and
backward."""

import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from glm52_jax.model import context_parallel
from glm52_jax.model.kv_cache import SlotLayout
from glm52_jax.plan.hlo import COLLECTIVE_OPCODES, dims, parse_hlo

WAYS, CAP, LENGTH, B, S, H, C, R = 8, 256, 200, 2, 4, 4, 16, 16  # widths the kernel takes


def _all_reduce_sizes(k: int, kernels: str = "reference") -> list[int]:
    """Element counts of every all-reduce in the compiled forward + backward of a chunk's cached attention
    with `k` selected keys per query."""
    mesh = jax.make_mesh((WAYS,), ("x",), devices=jax.devices()[:WAYS])
    slots, rep = P(None, "x"), P()
    topk = (jnp.arange(B * S * k, dtype=jnp.int32).reshape(B, S, k) * 7) % (LENGTH + S)

    def attention(q_lat, q_rope, cache_c, cache_r, c_new, r_new):
        def per_device(q_lat, q_rope, cache_c, cache_r, c_new, r_new):
            return context_parallel._partial_attention(
                q_lat, q_rope, topk, cache_c, cache_r, (), c_new, r_new, jnp.int32(LENGTH),
                jax.lax.axis_index("x"), SlotLayout(WAYS), 0.1, ("x",), kernels=kernels)

        fn = jax.shard_map(per_device, mesh=mesh, in_specs=(rep, rep, slots, slots, rep, rep), out_specs=rep,
                           check_vma=False)
        return fn(q_lat, q_rope, cache_c, cache_r, c_new, r_new)

    def step(*args):
        return jax.value_and_grad(lambda *a: jnp.sum(attention(*a) ** 2), argnums=(0, 1, 2, 3))(*args)

    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, spec)) for s, spec in (
        ((B, S, H, C), rep), ((B, S, H, R), rep), ((B, CAP, C), slots), ((B, CAP, R), slots), ((B, S, C), rep),
        ((B, S, R), rep))]
    comps, _ = parse_hlo(jax.jit(step).lower(*args).compile().as_text())
    return sorted(math.prod(dims(ins.shape)) for body in comps.values() for ins in body
                  if COLLECTIVE_OPCODES.get(ins.opcode) == "all-reduce")


@pytest.mark.parametrize("kernels", ["reference", "pallas"])
def test_no_all_reduce_grows_with_the_selected_keys(kernels):
    """Quadrupling the selected keys (16 -> 64) leaves every all-reduce as it was; the largest is the combine's
    [B,S,H,C] output (and its cotangent's sum)."""
    few, many = _all_reduce_sizes(16, kernels), _all_reduce_sizes(64, kernels)
    assert few, "the LSE combine all-reduces its partial sums"
    assert few == many
    assert max(many) <= B * S * H * C
