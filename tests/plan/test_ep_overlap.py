"""The EP exchange overlapped with expert work in the program XLA's GPU compiler makes (deviceless, 8 x H20 on one
host): `experts_ep`'s pipelined windows come out as async all-to-all start/done pairs with the other window's expert
matmuls scheduled between them, every payload in the activations' dtype (bf16), and the plan's cost model charges
those exchanges max(exchange, expert work) instead of the sum. Skips without the CUDA plugin. The program order
that XLA keeps is checked without a GPU compiler by tests/model/test_expert_parallel.py
(test_next_window_leaves_before_the_experts_run).
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from glm52_jax.kernels import aot
from glm52_jax.model.expert_parallel import experts_ep
from glm52_jax.model.loop_scopes import PASS_LOOP
from glm52_jax.parallel import rules
from glm52_jax.parallel.mesh import MeshSpec
from glm52_jax.plan import kernel_cost
from glm52_jax.plan.efficiency import load_table
from glm52_jax.plan.hlo import parse_hlo

pytestmark = pytest.mark.skipif(aot.missing() is not None, reason=f"deviceless GPU compiles: {aot.missing()}")

E, D, I, T, K = 16, 256, 128, 256, 4  # 32 tokens x 4 = 128 pairs per device: two windows of 8 x 64 rows


def _compile(blocks: int) -> str:
    mesh = aot.gpu_mesh("h20", "1x1x8", ("cp_ep",))
    sharded = NamedSharding(mesh, P("cp_ep"))
    args = [jax.ShapeDtypeStruct((T, D), jnp.bfloat16, sharding=sharded),
            jax.ShapeDtypeStruct((T, K), jnp.float32, sharding=sharded),
            jax.ShapeDtypeStruct((T, K), jnp.int32, sharding=sharded)]
    args += [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharded) for s in ((E, D, I), (E, D, I), (E, I, D))]

    def fn(x, weights, experts, *w):
        return experts_ep(x, weights, experts, *w, impl="dense", kernels="reference", exchange_blocks=blocks)

    with rules.axis_rules(MeshSpec(context=8, folded=True).rules()):
        return aot.compile_for_gpu(fn, *args, target="h20", mesh=mesh).compiled.as_text()


def _overlap(text: str) -> tuple[list[set[str]], dict]:
    """(the kernel classes between each all-to-all's start and done, the plan's estimate) of a GPU program."""
    program = kernel_cost.Program(text, [0] * 8)
    work = program.work({PASS_LOOP: 1})
    hiding = [{work.kernels[k].kind for k in ov.kernels} for ov in work.overlaps
              if work.collectives[ov.collective].kind == "all-to-all"]
    return hiding, kernel_cost.estimate_program(program, load_table(), "h20", {}, PASS_LOOP)


@pytest.mark.slow
def test_exchange_overlaps_expert_matmuls_in_the_gpu_program():
    text = _compile(2)
    comps, _ = parse_hlo(text)
    a2a = [ins for instrs in comps.values() for ins in instrs if ins.opcode.startswith("all-to-all")]
    # Every payload bf16: the rows out (with their expert ids as column D + 1) and the results back.
    assert a2a and all(ins.shape.lstrip("(").startswith("bf16") for ins in a2a), [ins.shape for ins in a2a]
    assert {ins.opcode for ins in a2a} >= {"all-to-all-start", "all-to-all-done"}
    hiding, out = _overlap(text)
    assert any("gemm" in kinds for kinds in hiding), hiding  # expert matmuls between a start and its done
    hidden = out["breakdown"]["collectives"]["all-to-all"]["hidden_s"]
    assert hidden > 0 and out["central_s"] < out["pessimistic_s"]
    # The control: one window per pass leaves no expert work to overlap (the experts wait for the rows, the
    # results for the experts); at most a small independent kernel lands between a start and its done.
    hiding, out = _overlap(_compile(1))
    assert not any("gemm" in kinds for kinds in hiding), hiding
    assert out["breakdown"]["collectives"]["all-to-all"]["hidden_s"] < hidden / 4
