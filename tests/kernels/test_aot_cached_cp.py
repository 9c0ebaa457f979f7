"""The cached context-parallel attention compiled for 8 x H200 without a GPU (glm52_jax.kernels.aot): with
kernels="auto" each device's attention is the sparse MLA Triton kernel (forward, backward and its segment sum),
every all-reduce of the forward + backward carries per-query data (the LSE combine's [B,S,H] and [B,S,H,C] and
the replicated inputs' cotangents), none grows with heads x selected keys, and the backward holds no float32
copy of the local cache (the kernel's row-table gradient for the cache, unused, is dropped).
"""

import math
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding

from glm52_jax.kernels import aot
from glm52_jax.model import context_parallel
from glm52_jax.model.kv_cache import CACHE_AXES, LayerCacheView
from glm52_jax.parallel import rules
from glm52_jax.parallel.mesh import MeshSpec
from glm52_jax.plan.hlo import COLLECTIVE_OPCODES, parse_hlo

pytestmark = pytest.mark.skipif(aot.missing() is not None, reason=f"deviceless GPU compiles: {aot.missing()}")

SD = jax.ShapeDtypeStruct
# 16 queries x 16 heads, latent 64, rope 16, 512 selected keys (two key blocks) over 8 x 32,768 cache slots.
B, S, H, C, R, K, CAP, WAYS = 1, 16, 16, 64, 16, 512, 262_144, 8


def _array_elements(shape: str) -> list[int]:
    """Element counts of every array in an HLO type (a tuple of a combined all-reduce has several)."""
    return [math.prod(int(d) for d in dims.split(",") if d) for dims in re.findall(r"[a-z]+\d*\[([\d,]*)\]", shape)]


@pytest.mark.slow  # ~40 s of deviceless compile (forward alone ~22 s); the CPU meshes check the same program's
# all-reduces and results in CI (tests/model/test_context_parallel.py, tests/parallel/test_cached_kernel.py)
def test_cached_cp_attention_compiles_to_the_kernel_for_h200():
    mesh = aot.gpu_mesh("h200", "1x1x8", ("cp_ep",))
    with rules.axis_rules(MeshSpec(context=8, folded=True).rules()):
        slots = NamedSharding(mesh, rules.logical_to_spec(CACHE_AXES, mesh_axes=mesh.axis_names))

        def program(q_lat, q_rope, c_new, r_new, cache_c, cache_r, topk, length):
            def loss(q_lat, q_rope, c_new, r_new):
                view = LayerCacheView(cache_c, cache_r, None, (0, 0), None, length, stride=WAYS)
                out, _ = context_parallel.cp_cached_attention(
                    context_parallel.cached_layout(WAYS), q_lat, q_rope, c_new, r_new,
                    length + jnp.arange(S, dtype=jnp.int32), view, None, topk, index_topk=K, index_scale=1.0,
                    softmax_scale=0.04, indexer_blocks={}, kernels="auto")
                return jnp.sum(out.astype(jnp.float32) ** 2)
            return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q_lat, q_rope, c_new, r_new)

        args = (SD((B, S, H, C), jnp.bfloat16), SD((B, S, H, R), jnp.bfloat16), SD((B, S, C), jnp.bfloat16),
                SD((B, S, R), jnp.bfloat16), SD((1, 1, B, CAP, C), jnp.bfloat16, sharding=slots),
                SD((1, 1, B, CAP, R), jnp.bfloat16, sharding=slots), SD((B, S, K), jnp.int32), SD((), jnp.int32))
        compiled = aot.compile_for_gpu(program, *args, target="h200", mesh=mesh)
    assert {"sparse_mla_forward", "sparse_mla_backward", "sparse_mla_segment_sum"} <= set(compiled.kernels)
    comps, _ = parse_hlo(compiled.compiled.as_text())
    reduced = [_array_elements(ins.shape) for body in comps.values() for ins in body
               if COLLECTIVE_OPCODES.get(ins.opcode) == "all-reduce"]
    assert reduced, "the LSE combine all-reduces its partial sums"
    # Per query: the combine's H x (C + 1) and the cotangents of q_lat, q_rope, c_new, r_new (XLA may combine
    # them into one flat all-reduce): far below one query's heads x selected keys (H x K = 8,192).
    per_query = H * (C + R + 1) + C + R
    assert per_query < H * K
    assert all(sum(sizes) <= B * S * per_query for sizes in reduced), reduced
    # The local cache is 32,768 rows x (C + R) bf16 (5.2 MB); a float32 gradient of it would be 10.5 MB of temp.
    assert compiled.memory["temp"] < 4 * 2**20, compiled.memory
