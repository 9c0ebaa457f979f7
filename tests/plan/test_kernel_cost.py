"""The per-kernel time estimate (`glm52_jax.plan.kernel_cost`) on a small handwritten module and made-up rates.

Every expected number is derived by hand next to it (f32: 4 bytes, bf16: 2). The rates are round numbers so
the arithmetic is checkable: 1e12 FLOP/s bf16 peak, 1e12 B/s HBM, launch floor 1 us.
"""

import dataclasses

import pytest

from glm52_jax.model.loop_scopes import CAUSAL_KEY_LOOP, PASS_LOOP
from glm52_jax.plan import kernel_cost
from glm52_jax.plan.efficiency import CLASSES, Rates, load_table

RATES = Rates(target="test", scenario="central", bf16_flops_per_s=1e12, fp8_flops_per_s=2e12, hbm_bytes_per_s=1e12,
              nvlink_bytes_per_s=1e11, network_bytes_per_s=1e10, fractions={c: 0.5 for c in CLASSES},
              launch_floor_s=1e-6, sync_s=2e-6, nvlink_fraction=1.0, network_fraction=0.5, nvlink_latency_s=1e-5,
              network_latency_s=3e-5, ep_passes=1)

# ENTRY: a GEMM fusion (dot [512,256] x [256,1024] bf16: 2*512*1024*256 = 268,435,456 FLOPs; reads 262,144 +
# 524,288 B, writes 1,048,576 B), then a data-dependent while (no known trip count; its op name carries the
# causal key loop's scope) whose body is one elementwise fusion on [1024] f32 (reads 4,096, writes 4,096 B) and
# whose condition is one small fusion, then an all-gather of bf16[4096,256] (2,097,152 B) over 8 GPUs on 2 hosts.
MODULE = """HloModule cost

%fused_dot (a: bf16[512,256], b: bf16[256,1024]) -> bf16[512,1024] {
  %a = bf16[512,256]{1,0} parameter(0)
  %b = bf16[256,1024]{1,0} parameter(1)
  ROOT %d = bf16[512,1024]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_add (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  ROOT %y = f32[1024]{0} add(%x, %x)
}

%fused_lt (i: s32[], n: s32[]) -> pred[] {
  %i = s32[] parameter(0)
  %n = s32[] parameter(1)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%cond (c: (s32[], s32[], f32[1024])) -> pred[] {
  %c = (s32[], s32[], f32[1024]{0}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %cn = s32[] get-tuple-element(%c), index=1
  ROOT %k = pred[] fusion(%ci, %cn), kind=kLoop, calls=%fused_lt
}

%body (p: (s32[], s32[], f32[1024])) -> (s32[], s32[], f32[1024]) {
  %p = (s32[], s32[], f32[1024]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] get-tuple-element(%p), index=1
  %v = f32[1024]{0} get-tuple-element(%p), index=2
  %v2 = f32[1024]{0} fusion(%v), kind=kLoop, calls=%fused_add
  ROOT %t = (s32[], s32[], f32[1024]{0}) tuple(%i, %n, %v2)
}

ENTRY %main (a: bf16[512,256], b: bf16[256,1024], n: s32[], v: f32[1024], g: bf16[512,256]) -> bf16[512,1024] {
  %a = bf16[512,256]{1,0} parameter(0)
  %b = bf16[256,1024]{1,0} parameter(1)
  %n = s32[] parameter(2)
  %v = f32[1024]{0} parameter(3)
  %g = bf16[512,256]{1,0} parameter(4)
  %zero = s32[] constant(0)
  %init = (s32[], s32[], f32[1024]{0}) tuple(%zero, %n, %v)
  %loop = (s32[], s32[], f32[1024]{0}) while(%init), condition=%cond, body=%body, metadata={op_name="jit(f)/checkpoint/dsa_causal_key_loop/while"}
  %gathered = bf16[4096,256]{1,0} all-gather(%g), replica_groups=[1,8]<=[8], dimensions={0}
  ROOT %r = bf16[512,1024]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot
}
"""
HOSTS = [0, 0, 0, 0, 1, 1, 1, 1]


def test_kernels_classes_and_executions_with_a_given_trip_count():
    work = kernel_cost.Program(MODULE, HOSTS).work({CAUSAL_KEY_LOOP: 10})
    by_name = {k.name: k for k in work.kernels}
    dot, add, cond = by_name["r"], by_name["v2"], by_name["k"]
    assert (dot.kind, dot.flops, dot.bytes, dot.executions) == ("gemm", 2 * 512 * 1024 * 256,
                                                                 262_144 + 524_288 + 1_048_576, 1)
    assert (add.kind, add.flops, add.bytes, add.executions) == ("memory", 1024, 8192, 10)
    # A data-dependent loop's condition runs once per trip plus the exit test (XLA:GPU reads it on the host).
    assert (cond.kind, cond.executions) == ("memory", 11)
    assert work.loops == (kernel_cost.Loop(CAUSAL_KEY_LOOP, 1, 10),)
    (gather,) = work.collectives
    assert (gather.kind, gather.bytes, gather.gpus, gather.hosts) == ("all-gather", 2_097_152, 8, 2)


def test_an_unknown_loop_counts_once_and_is_reported():
    work = kernel_cost.Program(MODULE, HOSTS).work({PASS_LOOP: 2})  # no trips for the causal loop
    assert {k.name: k.executions for k in work.kernels}["v2"] == 1
    assert work.loops == (kernel_cost.Loop(CAUSAL_KEY_LOOP, 1, None),)


def test_estimate_sums_kernels_syncs_and_collectives():
    work = kernel_cost.Program(MODULE, HOSTS).work({CAUSAL_KEY_LOOP: 10})
    out = kernel_cost.estimate(work, RATES)
    # GEMM: compute 268,435,456 / (1e12 * 0.5) = 536.87 us > memory 1,835,008 / 5e11 = 3.67 us > floor.
    gemm = 268_435_456 / 5e11
    # The elementwise body: 8,192 B / 5e11 = 16 ns, below the 1 us floor: 10 launches at 1 us; the condition 11.
    memory = (10 + 11) * 1e-6
    # All-gather of R = 2,097,152 B over n = 8 GPUs on h = 2 hosts (g = 4 per host): network R(h-1)/n = 262,144 B
    # at 1e10 * 0.5; NVLink R(g-1)/g = 1,572,864 B at 1e11; + 30 us across hosts.
    gather = 262_144 / 5e9 + 1_572_864 / 1e11 + 3e-5
    syncs = 11  # 10 trips + the exit test
    assert out["classes"]["gemm"]["seconds"] == pytest.approx(gemm)
    assert out["classes"]["gemm"]["compute_bound_s"] == pytest.approx(gemm)
    assert out["classes"]["memory"]["seconds"] == pytest.approx(memory)
    assert out["classes"]["memory"]["launch_bound_s"] == pytest.approx(memory)
    assert out["collectives"]["all-gather"]["seconds"] == pytest.approx(gather)
    assert out["collectives"]["all-gather"]["network_bytes"] == 262_144
    assert out["syncs"] == syncs and out["launches"] == 1 + 10 + 11
    assert out["seconds"] == pytest.approx(gemm + memory + gather + syncs * 2e-6)


@pytest.mark.parametrize("kind, result, gpus, hosts, network, nvlink", [
    ("all-reduce", 800, 8, 2, 2 * 800 * 1 / 8, 2 * 800 * 3 / 4),  # 2R(h-1)/n, 2R(g-1)/g
    ("reduce-scatter", 100, 8, 2, 800 * 1 / 8, 800 * 3 / 4),  # the gathered size n x R
    ("all-to-all", 800, 8, 2, 800 * 4 / 8, 800 * 3 / 8),  # R(n-g)/n across, R(g-1)/n within
    ("all-to-all", 800, 8, 1, 0, 800 * 7 / 8),
    ("collective-permute", 800, 2, 2, 800, 0),
    ("all-gather", 800, 8, 1, 0, 800 * 7 / 8),
])
def test_collective_bytes_by_kind_and_link(kind, result, gpus, hosts, network, nvlink):
    c = kernel_cost.Collective(kind, result, 1, gpus, hosts)
    seconds, net, nvl = kernel_cost.collective_seconds(c, RATES)
    assert (net, nvl) == pytest.approx((network, nvlink))
    latency = 3e-5 if hosts > 1 else 1e-5
    assert seconds == pytest.approx(net / 5e9 + nvl / 1e11 + latency)


def test_three_scenarios_from_the_packaged_table():
    table = load_table()
    out = kernel_cost.estimate_program(kernel_cost.Program(MODULE, HOSTS), table, "h200", {CAUSAL_KEY_LOOP: 10},
                                       PASS_LOOP)
    assert out["optimistic_s"] < out["central_s"] < out["pessimistic_s"]
    assert out["model_version"] == table.version and out["unresolved_loops"] == 0
    central = kernel_cost.estimate(kernel_cost.Program(MODULE, HOSTS).work({CAUSAL_KEY_LOOP: 10}),
                                   table.rates("h200", "central"))
    assert out["central_s"] == pytest.approx(central["seconds"])


def test_the_pass_loop_takes_each_scenarios_passes():
    """The EP exchange runs its first pass in line and the rest in the pass loop: the loop's trips are each
    scenario's passes less one (central 1 pass: no trip; pessimistic 2: one)."""
    text = MODULE.replace("dsa_causal_key_loop", "moe_ep_pass_loop")
    table = load_table()
    rates = {s: table.rates("h200", s) for s in ("optimistic", "pessimistic")}
    assert (rates["optimistic"].ep_passes, rates["pessimistic"].ep_passes) == (1, 2)
    program = kernel_cost.Program(text, HOSTS)
    out = kernel_cost.estimate_program(program, table, "h200", {}, PASS_LOOP)
    assert out["loops"] == [{"scope": PASS_LOOP, "executions": 1, "trips": 0}]  # central: 1 pass, in line
    pessimistic = kernel_cost.estimate(program.work({PASS_LOOP: 1}), rates["pessimistic"])
    assert out["pessimistic_s"] == pytest.approx(pessimistic["seconds"])


def test_pallas_kernels_are_their_own_class():
    """A Pallas kernel's class is its name; NAME_fp8 is its own class where one exists (FP8 MMA: the FP8 indexer
    scores, the grouped matmul of FP8 rows), else NAME's (sparse_mla_forward_fp8 is a sparse-MLA forward); a grouped
    matmul of dequantized FP8 blocks is a grouped matmul."""
    names = {"s": "sparse_mla_forward", "i": "dsa_index_scores_fp8", "g": "grouped_matmul_rows64_fp8",
             "d": "grouped_matmul_dequant_rows64", "m": "sparse_mla_forward_fp8"}
    calls = "".join(f'  %{v} = f32[8]{{0}} custom-call(%x, %x), custom_call_target="__gpu$xla.gpu.triton", '
                    f'metadata={{op_name="jit(f)/{name}_flops1000_bytes64/pallas_call"}}\n' for v, name in names.items())
    text = MODULE.replace('  ROOT %r = bf16[512,1024]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot',
                          "  %x = f32[8]{0} constant({1,2,3,4,5,6,7,8})\n" + calls +
                          "  ROOT %r = bf16[512,1024]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot")
    kernels = {k.name: k for k in kernel_cost.Program(text, HOSTS).work({}).kernels}
    assert (kernels["s"].kind, kernels["s"].flops, kernels["s"].bytes) == ("sparse_mla_forward", 1000, 64)
    assert [kernels[k].kind for k in "igdm"] == ["dsa_index_scores_fp8", "grouped_matmul_fp8", "grouped_matmul",
                                                 "sparse_mla_forward"]
    fast = dataclasses.replace(RATES, launch_floor_s=0.0)
    assert kernel_cost.kernel_seconds(kernels["s"], fast) == (pytest.approx(1000 / 5e11), "compute")


def test_kernels_know_the_data_dependent_loop_they_run_in():
    work = kernel_cost.Program(MODULE, HOSTS).work({CAUSAL_KEY_LOOP: 10})
    loops = {k.name: k.loop for k in work.kernels}
    assert loops == {"v2": CAUSAL_KEY_LOOP, "k": CAUSAL_KEY_LOOP, "r": None}
    out = kernel_cost.estimate(work, RATES)
    assert out["in_loops"] == {CAUSAL_KEY_LOOP: {"memory": pytest.approx(21e-6)}}


# Async all-to-alls of bf16[8,1024,256] (R = 4,194,304 B) over 8 GPUs on 2 hosts around the GEMM of MODULE
# (536.87 us) and an elementwise fusion (1 us floor); `{order}` is the ENTRY's schedule.
ASYNC_MODULE = MODULE.split("ENTRY")[0] + """ENTRY %main (a: bf16[512,256], b: bf16[256,1024], v: f32[1024], x: bf16[8,1024,256]) -> bf16[512,1024] {
  %a = bf16[512,256]{1,0} parameter(0)
  %b = bf16[256,1024]{1,0} parameter(1)
  %v = f32[1024]{0} parameter(2)
  %x = bf16[8,1024,256]{2,1,0} parameter(3)
{order}
}
"""
_START = "  %{n} = ((bf16[8,1024,256]{{2,1,0}}), bf16[8,1024,256]{{2,1,0}}) all-to-all-start(%x), replica_groups=[1,8]<=[8], dimensions={{0}}\n"
_DONE = "  %{n} = bf16[8,1024,256]{{2,1,0}} all-to-all-done(%{s})\n"
_GEMM = "  %r = bf16[512,1024]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot\n"
_ADD = "  %v2 = f32[1024]{0} fusion(%v), kind=kLoop, calls=%fused_add\n"
# One all-to-all: network R(h-1)... R(n-g)/n = 2,097,152 B at 5e9, NVLink R(g-1)/n = 1,572,864 B at 1e11, + 30 us.
EXCHANGE = 2_097_152 / 5e9 + 1_572_864 / 1e11 + 3e-5  # 465.2 us
GEMM = 268_435_456 / 5e11  # 536.9 us


def _async(*parts):
    order = "".join(_START.format(n=p) if p.startswith("s") else _DONE.format(n=p, s="s" + p[1:])
                    if p.startswith("d") else {"gemm": _GEMM, "add": _ADD}[p] for p in parts)
    return ASYNC_MODULE.replace("{order}", order.rstrip("\n"))


def test_an_async_exchange_around_kernels_costs_the_max():
    """Kernels scheduled between an all-to-all's start and done hide it (max(exchange, kernels), not the sum);
    each kernel's time hides one exchange at most; an exchange with nothing between adds in full; the
    pessimistic scenario (overlap=False) keeps the sums."""
    # Pair 1 around the GEMM (hides it all: 465 < 537 us); pair 2 around the 1 us elementwise kernel; pair 3 empty.
    work = kernel_cost.Program(_async("s1", "gemm", "d1", "s2", "add", "d2", "s3", "d3"), HOSTS).work({})
    assert [(o.collective, [work.kernels[k].name for k in o.kernels]) for o in work.overlaps] == [
        (0, ["r"]), (1, ["v2"])]
    out = kernel_cost.estimate(work, RATES)
    a2a = out["collectives"]["all-to-all"]
    assert a2a["count"] == 3
    assert a2a["hidden_s"] == pytest.approx(EXCHANGE + 1e-6)
    assert a2a["seconds"] == pytest.approx(3 * EXCHANGE - EXCHANGE - 1e-6)
    assert out["seconds"] == pytest.approx(max(GEMM, EXCHANGE) + max(1e-6, EXCHANGE) + EXCHANGE)
    summed = kernel_cost.estimate(work, RATES, overlap=False)
    assert summed["collectives"]["all-to-all"]["hidden_s"] == 0
    assert summed["seconds"] == pytest.approx(GEMM + 1e-6 + 3 * EXCHANGE)
    # Two exchanges in flight around one GEMM: the first takes 465 us of it, the second the 72 us left.
    nested = kernel_cost.estimate(kernel_cost.Program(_async("s1", "s2", "gemm", "d1", "d2"), HOSTS).work({}), RATES)
    assert nested["collectives"]["all-to-all"]["hidden_s"] == pytest.approx(GEMM)
    assert nested["seconds"] == pytest.approx(2 * EXCHANGE)
    # The central and optimistic scenarios credit the overlap, the pessimistic one does not.
    table = load_table()
    program = kernel_cost.Program(_async("s1", "gemm", "d1"), HOSTS)
    out = kernel_cost.estimate_program(program, table, "h200", {}, PASS_LOOP)
    for scenario in ("central", "pessimistic"):
        expect = kernel_cost.estimate(program.work({}), table.rates("h200", scenario), overlap=scenario == "central")
        assert out[f"{scenario}_s"] == pytest.approx(expect["seconds"])
    assert out["breakdown"]["collectives"]["all-to-all"]["hidden_s"] > 0
