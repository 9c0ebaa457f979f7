"""HBM traffic and collective links (`glm52_jax.plan.hlo_traffic`) on small handwritten modules.

Every expected number is derived by hand in the comments next to it (f32: 4 bytes, bf16: 2).
"""

import pytest

from glm52_jax.plan import hlo_traffic
from glm52_jax.plan.hlo import Instr, analyze_hlo, instr_flops

# A loop of 5 trips over a [64, 16] f32 cache: each trip slices one row out of it in a fusion
# (reads 64 B of the 4096 B parameter), adds it to a [16] accumulator, and writes one row back in
# place (dynamic-update-slice fusion: 64 B written, the cache itself neither read nor rewritten).
# ENTRY then all-gathers the accumulator over hosts (groups {0,1},{2,3} with hosts [0,0,1,1]: within)
# and all-reduces it over {0,2},{1,3} (across), async.
MODULE = """HloModule traffic, entry_computation_layout={(f32[64,16]{1,0}, f32[16]{0})->f32[32]{0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_row (c0: f32[64,16], i0: s32[], acc0: f32[16]) -> f32[16] {
  %c0 = f32[64,16]{1,0} parameter(0)
  %i0 = s32[] parameter(1)
  %acc0 = f32[16]{0} parameter(2)
  %z0 = s32[] constant(0)
  %row = f32[1,16]{1,0} dynamic-slice(%c0, %i0, %z0), dynamic_slice_sizes={1,16}
  %flat = f32[16]{0} bitcast(%row)
  ROOT %sum = f32[16]{0} add(%flat, %acc0)
}

%fused_write (c1: f32[64,16], v1: f32[16], i1: s32[]) -> f32[64,16] {
  %c1 = f32[64,16]{1,0} parameter(0)
  %v1 = f32[16]{0} parameter(1)
  %i1 = s32[] parameter(2)
  %z1 = s32[] constant(0)
  %upd = f32[1,16]{1,0} bitcast(%v1)
  ROOT %dus = f32[64,16]{1,0} dynamic-update-slice(%c1, %upd, %i1, %z1)
}

%cond (c: (s32[], f32[64,16], f32[16])) -> pred[] {
  %c = (s32[], f32[64,16]{1,0}, f32[16]{0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

%body (p: (s32[], f32[64,16], f32[16])) -> (s32[], f32[64,16], f32[16]) {
  %p = (s32[], f32[64,16]{1,0}, f32[16]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %cache = f32[64,16]{1,0} get-tuple-element(%p), index=1
  %acc = f32[16]{0} get-tuple-element(%p), index=2
  %acc2 = f32[16]{0} fusion(%cache, %i, %acc), kind=kLoop, calls=%fused_row
  %cache2 = f32[64,16]{1,0} fusion(%cache, %acc2, %i), kind=kLoop, calls=%fused_write
  ROOT %t = (s32[], f32[64,16]{1,0}, f32[16]{0}) tuple(%i, %cache2, %acc2)
}

ENTRY %main (x: f32[64,16], y: f32[16]) -> f32[32] {
  %x = f32[64,16]{1,0} parameter(0)
  %y = f32[16]{0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[64,16]{1,0}, f32[16]{0}) tuple(%zero, %x, %y)
  %loop = (s32[], f32[64,16]{1,0}, f32[16]{0}) while(%init), condition=%cond, body=%body, """ \
    """backend_config={"known_trip_count":{"n":"5"}}
  %r = f32[16]{0} get-tuple-element(%loop), index=2
  %ags = ((f32[16]{0}), f32[32]{0}) all-gather-start(%r), channel_id=1, replica_groups={{0,1},{2,3}}, dimensions={0}
  %ag = f32[32]{0} all-gather-done(%ags)
  %ar = f32[32]{0} all-reduce(%ag), channel_id=2, replica_groups=[2,2]<=[2,2]T(1,0), to_apply=%add
  ROOT %out = f32[32]{0} copy(%ar)
}
"""


def test_memory_traffic_counts_slices_and_in_place_updates():
    r = hlo_traffic.traffic(MODULE, hosts=[0, 0, 1, 1])
    # per trip: fused_row reads 64 (row) + 4 (index) + 64 (acc), writes 64 -> 196;
    # fused_write reads 0 (cache, updated in place) + 64 (value) + 4 (index), writes 64 (the row) -> 132;
    # x 5 trips = 1640; ENTRY's copy reads and writes f32[32]: 256. Collectives are not memory traffic.
    assert r["memory_bytes_executed"] == 5 * (196 + 132) + 256
    # all-gather {0,1},{2,3} stays on hosts 0 and 1: 128 B over NVLink; the all-reduce's iota groups
    # [2,2]<=[2,2]T(1,0) are {0,2},{1,3}: 128 B across hosts.
    assert r["collective_bytes_executed_within_host"] == 128
    assert r["collective_bytes_executed_across_hosts"] == 128
    assert r["collectives_with_unknown_groups"] == 0
    assert (r["collectives_executed_within_host"], r["collectives_executed_across_hosts"]) == (1, 1)
    # The same bytes as hlo.py's collective count (result shapes, async pair once).
    coll = analyze_hlo(MODULE)["collectives"]
    assert sum(c["bytes_executed"] for c in coll.values()) == 256
    # On one host every group is within it.
    one_host = hlo_traffic.traffic(MODULE, hosts=[0, 0, 0, 0])
    assert (one_host["collective_bytes_executed_within_host"], one_host["collective_bytes_executed_across_hosts"]) \
        == (256, 0)


def test_async_fusion_counts_once_as_the_fusion_it_runs():
    """XLA:GPU runs some dynamic-slice fusions in loops async: `fusion-start` (a tuple of the operands, the
    result and a context) + `fusion-done`. Same traffic as the plain fusion: in place, 64 B per trip."""
    sync = "  %cache2 = f32[64,16]{1,0} fusion(%cache, %acc2, %i), kind=kLoop, calls=%fused_write\n"
    assert sync in MODULE
    async_module = MODULE.replace(sync, (
        "  %ws = ((f32[64,16]{1,0}, f32[16]{0}, s32[]), f32[64,16]{1,0}, u32[]) fusion-start(%cache, %acc2, %i), "
        "kind=kLoop, calls=%fused_write\n"
        "  %cache2 = f32[64,16]{1,0} fusion-done(%ws)\n"))
    r = hlo_traffic.traffic(async_module, hosts=[0, 0, 1, 1])
    assert r["memory_bytes_executed"] == 5 * (196 + 132) + 256


@pytest.mark.parametrize("attrs, expected", [
    ("replica_groups={{0,1},{2,3}}", [[0, 1], [2, 3]]),
    ("replica_groups={}", [[0, 1, 2, 3]]),
    ("replica_groups=[2,2]<=[4]", [[0, 1], [2, 3]]),
    ("replica_groups=[2,2]<=[2,2]T(1,0)", [[0, 2], [1, 3]]),
    ("replica_groups=[1,4]<=[4]", [[0, 1, 2, 3]]),
    ("source_target_pairs={{0,1},{1,2},{2,3},{3,0}}", [[0, 1], [1, 2], [2, 3], [3, 0]]),
    ("replica_groups=mesh['x'=4] {'x'}", [[0, 1, 2, 3]]),
    ("replica_groups=mesh['a'=2,'b'=2] {'b'}", [[0, 1], [2, 3]]),
    ("replica_groups=mesh['a'=2,'b'=2] {'a'}", [[0, 2], [1, 3]]),
    ("replica_groups=mesh['a'=2,'b':(1)2] {'a'}", None),  # a sub-axis form: unknown, taken as crossing hosts
    ("channel_id=3", None),
])
def test_collective_groups_in_every_printed_form(attrs, expected):
    assert hlo_traffic.collective_groups(attrs, partitions=4) == expected


def test_crosses_hosts():
    hosts = [0, 0, 1, 1]
    assert not hlo_traffic.crosses_hosts([[0, 1], [2, 3]], hosts)
    assert hlo_traffic.crosses_hosts([[0, 1], [1, 2]], hosts)
    assert hlo_traffic.crosses_hosts(None, hosts)
    assert hlo_traffic.crosses_hosts([[3, 4]], hosts)  # an id past the known partitions


def test_cublas_gemm_custom_call_flops():
    """XLA:GPU's library GEMM: (out, workspace) result, contracting dims in its backend config."""
    gemm = Instr("g", "(bf16[128,256]{1,0}, s8[4194304]{0})", "custom-call", "%a, %b",
                 ', custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":'
                 '{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}')
    flops, transcendentals, is_dot = instr_flops(gemm, {"a": "bf16[128,64]{1,0}", "b": "bf16[64,256]{1,0}"})
    assert (flops, transcendentals, is_dot) == (2.0 * 128 * 256 * 64, 0.0, True)


KERNELS = """HloModule kernels

ENTRY %main (table: bf16[1000000,576], q: bf16[64,576]) -> f32[64,576] {
  %table = bf16[1000000,576]{1,0} parameter(0)
  %q = bf16[64,576]{1,0} parameter(1)
  %declared = f32[64,576]{1,0} custom-call(%q, %table), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/sparse_mla_forward_bytes5000/pallas_call"}
  ROOT %plain = f32[64,576]{1,0} custom-call(%q, %table), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/other_kernel/pallas_call"}
}
"""


def test_a_pallas_kernel_declares_its_bytes():
    """A kernel reading rows of a whole table in place names the bytes it moves (`kernels.traffic_name`); one
    that does not is counted by its operands and result (here the whole 1.15 GB table)."""
    plain = 64 * 576 * 2 + 1_000_000 * 576 * 2 + 64 * 576 * 4
    assert hlo_traffic.traffic(KERNELS, hosts=[0])["memory_bytes_executed"] == 5000 + plain


def test_a_pallas_kernel_declares_its_flops():
    """XLA counts no FLOPs in a custom call; a kernel that names them (`kernels.traffic_name(..., flops=)`) is
    counted by them, one that does not stays at 0. The name still carries its bytes."""
    from glm52_jax.kernels import traffic_name

    name = traffic_name("sparse_mla_forward", 5000, flops=2 * 64 * 2048 * 1088)
    assert name == f"sparse_mla_forward_flops{2 * 64 * 2048 * 1088}_bytes5000"
    module = KERNELS.replace("sparse_mla_forward_bytes5000", name)
    shapes = {"q": "bf16[64,576]{1,0}", "table": "bf16[1000000,576]{1,0}"}
    declared, plain = (ins for ins in _entry_instructions(module) if ins.opcode == "custom-call")
    assert instr_flops(declared, shapes) == (2.0 * 64 * 2048 * 1088, 0.0, True)
    assert instr_flops(plain, shapes)[0] == 0.0
    plain_bytes = 64 * 576 * 2 + 1_000_000 * 576 * 2 + 64 * 576 * 4
    assert hlo_traffic.traffic(module, hosts=[0])["memory_bytes_executed"] == 5000 + plain_bytes


def _entry_instructions(module: str) -> list[Instr]:
    from glm52_jax.plan.hlo import parse_hlo

    comps, entry = parse_hlo(module)
    return comps[entry]
