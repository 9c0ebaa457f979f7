"""HLO text parsing and counting (`glm52_jax.plan.hlo`) on small handwritten modules.

Every expected number is derived by hand in the comments next to it. The last test checks the
convolution rule against XLA's own cost analysis on compiled programs.
"""

import jax
import jax.numpy as jnp
import pytest

from glm52_jax.plan import hlo

# The reducer every fixture uses.
ADD = """%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
"""


def frame_tables(*functions: str) -> str:
    """The stack-frame tables XLA prints between the module line and the computations; stack frame
    i (from 1) is a call in `functions[i - 1]`."""
    numbered = list(enumerate(functions, 1))
    return "\n".join([
        "FileNames", '1 "model.py"', "",
        "FunctionNames", *(f'{i} "{name}"' for i, name in numbered), "",
        "FileLocations", *(f"{i} {{file_name_id=1 function_name_id={i} line={i} end_line={i} column=1 end_column=5}}"
                           for i, _ in numbered), "",
        "StackFrames", *(f"{i} {{file_location_id={i} parent_frame_id=1}}" for i, _ in numbered), "", ""])


# Nested loops: ENTRY runs `outer_body` 3 times (known trip count); each runs `inner_body` 4 times
# (known) and `scan_body` an unknown number of times (counted once, flagged). `fused_square` is a
# fusion of inner_body, `rowsum` a `call` from ENTRY, `add` only a reducer.
LOOPS = """HloModule loops, entry_computation_layout={(f32[8,4]{1,0})->f32[8]{0}}

""" + ADD + """
%fused_square (f0: f32[8,4]) -> f32[8,4] {
  %f0 = f32[8,4]{1,0} parameter(0)
  ROOT %f1 = f32[8,4]{1,0} multiply(%f0, %f0)
}

%cond (c: (s32[], f32[8,4])) -> pred[] {
  %c = (s32[], f32[8,4]{1,0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

%inner_body (p: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {
  %p = (s32[], f32[8,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,4]{1,0} get-tuple-element(%p), index=1
  %w = f32[4,4]{1,0} constant({...})
  %d = f32[8,4]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %e = f32[8,4]{1,0} fusion(%d), kind=kLoop, calls=%fused_square
  ROOT %t = (s32[], f32[8,4]{1,0}) tuple(%i, %e)
}

%scan_body (q: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {
  %q = (s32[], f32[8,4]{1,0}) parameter(0)
  %z = s32[] get-tuple-element(%q), index=0
  %y = f32[8,4]{1,0} get-tuple-element(%q), index=1
  %cp = f32[8,4]{1,0} collective-permute(%y), source_target_pairs={{0,1},{1,0}}
  %n = f32[8,4]{1,0} exponential(%cp)
  %m = f32[8,4]{1,0} negate(%n)
  ROOT %u = (s32[], f32[8,4]{1,0}) tuple(%z, %m)
}

%outer_body (o: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {
  %o = (s32[], f32[8,4]{1,0}) parameter(0)
  %inner = (s32[], f32[8,4]{1,0}) while(%o), condition=%cond, body=%inner_body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %scan = (s32[], f32[8,4]{1,0}) while(%inner), condition=%cond, body=%scan_body
}

%rowsum (h: f32[8,4]) -> f32[8] {
  %h = f32[8,4]{1,0} parameter(0)
  %zero = f32[] constant(0)
  ROOT %r = f32[8]{0} reduce(%h, %zero), dimensions={1}, to_apply=%add
}

ENTRY %main (x0: f32[8,4]) -> f32[8] {
  %x0 = f32[8,4]{1,0} parameter(0)
  %c0 = s32[] constant(0)
  %init = (s32[], f32[8,4]{1,0}) tuple(%c0, %x0)
  %outer = (s32[], f32[8,4]{1,0}) while(%init), condition=%cond, body=%outer_body, backend_config={"known_induction_variable":{"tuple_index":"0"},"known_trip_count":{"n":"3"}}
  %res = f32[8,4]{1,0} get-tuple-element(%outer), index=1
  ROOT %sum = f32[8]{0} call(%res), to_apply=%rowsum
}
"""

# One of each collective kind, sync and async, some in a loop of 6 known trips (`body`). The
# stack-frame tables name the Python function of the ops that carry a stack_frame_id.
COLLECTIVES = """HloModule collectives, entry_computation_layout={(bf16[16,8]{1,0}, pred[16]{0})->f32[4,8]{1,0}}

""" + frame_tables("gather_weights", "dispatch_tokens") + ADD + """
%wrapped_reduce_scatter (w: f32[16,8]) -> f32[4,8] {
  %w = f32[16,8]{1,0} parameter(0)
  ROOT %rs = f32[4,8]{1,0} reduce-scatter(%w), replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
}

%cond (c: (s32[], bf16[16,8])) -> pred[] {
  %c = (s32[], bf16[16,8]{1,0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

%body (p: (s32[], bf16[16,8])) -> (s32[], bf16[16,8]) {
  %p = (s32[], bf16[16,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[16,8]{1,0} get-tuple-element(%p), index=1
  %a2a = bf16[16,8]{1,0} all-to-all(%x), dimensions={0}, metadata={op_name="jit(f)/while/body/all_to_all" stack_frame_id=2}
  %cps = (bf16[16,8]{1,0}, bf16[16,8]{1,0}, u32[], u32[]) collective-permute-start(%a2a), source_target_pairs={{0,1},{1,0}}
  %cpd = bf16[16,8]{1,0} collective-permute-done(%cps)
  ROOT %t = (s32[], bf16[16,8]{1,0}) tuple(%i, %cpd)
}

ENTRY %main (x0: bf16[16,8], flags: pred[16]) -> f32[4,8] {
  %x0 = bf16[16,8]{1,0} parameter(0)
  %flags = pred[16]{0} parameter(1)
  %ag = bf16[64,8]{1,0} all-gather(%x0), replica_groups={{0,1,2,3}}, dimensions={0}, metadata={op_name="jit(f)/all_gather" stack_frame_id=1}
  %ags = (bf16[16,8]{1,0}, bf16[64,8]{1,0}) all-gather-start(%x0), dimensions={0}
  %agd = bf16[64,8]{1,0} all-gather-done(%ags)
  %f = f32[16,8]{1,0} convert(%x0)
  %ar = (f32[16,8]{1,0}, pred[16]{0}) all-reduce(%f, %flags), replica_groups={{0,1,2,3}}, to_apply=%add
  %ars = f32[16,8]{1,0} all-reduce-start(%f), to_apply=%add
  %ard = f32[16,8]{1,0} all-reduce-done(%ars)
  %rss = ((f32[16,8]{1,0}), f32[4,8]{1,0}, s32[]) async-start(%ard), calls=%wrapped_reduce_scatter
  %rsd = f32[4,8]{1,0} async-done(((f32[16,8]{1,0}), f32[4,8]{1,0}, s32[]) %rss), calls=%wrapped_reduce_scatter
  %c0 = s32[] constant(0)
  %init = (s32[], bf16[16,8]{1,0}) tuple(%c0, %x0)
  %loop = (s32[], bf16[16,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  ROOT %out = f32[4,8]{1,0} copy(%rsd)
}
"""

# FLOP rules, all in ENTRY (executed once): batched dot with typed operands, a dot whose stack
# frame is a ragged_dot implementation, two convolutions, variadic reduce, reduce-window,
# elementwise, transcendental and free (convert) ops.
FLOPS = """HloModule flops, entry_computation_layout={(f32[2,8,16]{2,1,0}, f32[2,16,4]{2,1,0})->f32[8,4]{1,0}}

""" + frame_tables("dense", "_local_experts.<locals>.ragged") + ADD + """
%argmax (a: f32[], i: s32[], b: f32[], j: s32[]) -> (f32[], s32[]) {
  %a = f32[] parameter(0)
  %i = s32[] parameter(1)
  %b = f32[] parameter(2)
  %j = s32[] parameter(3)
  %gt = pred[] compare(%a, %b), direction=GT
  %v = f32[] select(%gt, %a, %b)
  %k = s32[] select(%gt, %i, %j)
  ROOT %r = (f32[], s32[]) tuple(%v, %k)
}

ENTRY %main (x: f32[2,8,16], w: f32[2,16,4]) -> f32[8,4] {
  %x = f32[2,8,16]{2,1,0} parameter(0)
  %w = f32[2,16,4]{2,1,0} parameter(1)
  %bmm = f32[2,8,4]{2,1,0} dot(f32[2,8,16]{2,1,0} %x, f32[2,16,4]{2,1,0} %w), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}, metadata={op_name="jit(f)/dot_general" stack_frame_id=1}
  %x2 = f32[8,16]{1,0} parameter(2)
  %w2 = f32[16,4]{1,0} parameter(3)
  %rd = f32[8,4]{1,0} dot(%x2, %w2), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/ragged_dot_general" stack_frame_id=2}
  %img = f32[1,5,5,3]{3,2,1,0} parameter(4)
  %k = f32[3,3,3,2]{3,2,1,0} parameter(5)
  %conv = f32[1,5,5,2]{3,2,1,0} convolution(%img, %k), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f
  %seq = f32[2,4,7]{2,1,0} parameter(6)
  %gk = f32[6,2,3]{2,1,0} parameter(7)
  %gconv = f32[2,6,3]{2,1,0} convolution(%seq, %gk), window={size=3 stride=2}, dim_labels=bf0_oi0->bf0, feature_group_count=2
  %v = f32[8,16]{1,0} parameter(8)
  %idx = s32[8,16]{1,0} parameter(9)
  %ninf = f32[] constant(-inf)
  %zero = s32[] constant(0)
  %best = (f32[8]{0}, s32[8]{0}) reduce(%v, %idx, %ninf, %zero), dimensions={1}, to_apply=%argmax
  %pool_in = f32[8,8]{1,0} parameter(10)
  %fzero = f32[] constant(0)
  %pool = f32[4,6]{1,0} reduce-window(%pool_in, %fzero), window={size=2x3 stride=2x1}, to_apply=%add
  %cmp = pred[8,4]{1,0} compare(%rd, %rd), direction=GT
  %sel = f32[8,4]{1,0} select(%cmp, %rd, %rd)
  %t = f32[8,4]{1,0} tanh(%sel)
  %cv = bf16[8,4]{1,0} convert(%t)
  ROOT %out = f32[8,4]{1,0} convert(%cv)
}
"""


@pytest.mark.parametrize("shape, expected", [
    ("f32[8,4]{1,0}", 8 * 4 * 4),
    ("bf16[3,5]", 3 * 5 * 2),
    ("pred[7]{0}", 7),  # one byte per element
    ("s4[10]{0}", 5),  # half a byte
    ("f8e4m3fn[6]{0}", 6),
    ("c64[2]{0}", 2 * 8),
    ("f32[]", 4),  # a scalar
    ("token[]", 0),
    ("(s32[], bf16[4]{0}, pred[2,2]{1,0})", 4 + 4 * 2 + 4),
    ("((f32[2]{0}), u32[])", 2 * 4 + 4),  # nested tuple
    ("(f32[2]{0}, /*index=5*/s8[3]{0})", 2 * 4 + 3),  # XLA's index comments inside long tuples
])
def test_shape_bytes(shape, expected):
    assert hlo.shape_bytes(shape) == expected


def test_parse_splits_computations_and_instructions():
    comps, entry = hlo.parse_hlo(COLLECTIVES)
    assert entry == "main"
    assert list(comps) == ["add", "wrapped_reduce_scatter", "cond", "body", "main"]  # the tables are not computations
    assert [i.name for i in comps["add"]] == ["a", "b", "s"]  # ROOT included
    start = {i.name: i for i in comps["main"]}["rss"]
    assert start == hlo.Instr("rss", "((f32[16,8]{1,0}), f32[4,8]{1,0}, s32[])", "async-start", "%ard",
                              ", calls=%wrapped_reduce_scatter")
    done = {i.name: i for i in comps["main"]}["rsd"]
    assert (done.shape, done.opcode) == ("f32[4,8]{1,0}", "async-done")
    assert done.operands == "((f32[16,8]{1,0}), f32[4,8]{1,0}, s32[]) %rss"  # a typed tuple operand
    assert hlo.operands(done) == ["((f32[16,8]{1,0}), f32[4,8]{1,0}, s32[]) %rss"]
    ar = {i.name: i for i in comps["main"]}["ar"]
    assert ar.shape == "(f32[16,8]{1,0}, pred[16]{0})" and hlo.operands(ar) == ["%f", " %flags"]


def test_parse_without_entry_is_an_error():
    comps, entry = hlo.parse_hlo(LOOPS.replace("ENTRY %main", "%main"))
    assert entry is None and "main" in comps
    with pytest.raises(ValueError, match="no ENTRY computation"):
        hlo.analyze_hlo(LOOPS.replace("ENTRY %main", "%main"))


def test_loop_multipliers_nest_known_trip_counts():
    mult, unknown = hlo.loop_multipliers(*hlo.parse_hlo(LOOPS))
    # outer x3; inner x4 inside it = 12 (its fusion too); scan_body: unknown trips, 1 per outer = 3;
    # cond: once per while execution (outer 1 + inner 3 + scan 3); the called rowsum once; add only
    # as a reducer.
    assert mult == {"main": 1, "outer_body": 3, "inner_body": 12, "fused_square": 12, "scan_body": 3, "cond": 7,
                    "rowsum": 1, "add": 0}
    assert {name for name, flagged in unknown.items() if flagged} == {"scan_body"}


def test_loops_flops_and_collectives():
    r = hlo.analyze_hlo(LOOPS)
    dot, square, negate, rowsum = 2 * 8 * 4 * 4, 8 * 4, 8 * 4, 8 * 4 - 8  # per execution
    fl = r["flops"]
    assert fl["flops_static"] == dot + square + negate + rowsum == 344
    assert fl["flops_executed"] == 12 * (dot + square) + 3 * negate + rowsum == 3576
    assert fl["dot_flops_executed"] == 12 * dot == 3072
    assert fl["ragged_dot_flops_executed"] == 0
    assert fl["transcendentals_executed"] == 3 * 8 * 4  # the exponential, not a flop
    assert fl["flops_executed_in_unknown_loops"] == 3 * negate
    assert (r["while_loops"], r["unknown_trip_count_loops"]) == (3, 1)
    # The permute in the unknown loop: once per outer trip, flagged.
    assert r["collectives"]["collective-permute"] == {"ops": 1, "bytes": 128, "bytes_executed": 3 * 128,
                                                      "ops_in_unknown_loops": 1}
    assert r["largest_collectives"][0]["unknown_loop"] and r["largest_collectives"][0]["times"] == 3


def test_each_collective_kind():
    r = hlo.analyze_hlo(COLLECTIVES)
    coll = r["collectives"]
    # Result shapes: all-gather bf16[64,8] = 1024 B, sync and async (counted at -done, not -start).
    assert coll["all-gather"] == {"ops": 2, "bytes": 2048, "bytes_executed": 2048, "ops_in_unknown_loops": 0}
    # Tuple all-reduce (f32[16,8] 512 B + pred[16] 16 B) and an async one (512 B at -done).
    assert coll["all-reduce"] == {"ops": 2, "bytes": 528 + 512, "bytes_executed": 528 + 512, "ops_in_unknown_loops": 0}
    # Inside an async wrapper named by both async-start and async-done: runs once, f32[4,8] = 128 B.
    assert coll["reduce-scatter"] == {"ops": 1, "bytes": 128, "bytes_executed": 128, "ops_in_unknown_loops": 0}
    # In the 6-trip loop: bf16[16,8] = 256 B, once per body, 6 times executed.
    assert coll["all-to-all"] == {"ops": 1, "bytes": 256, "bytes_executed": 6 * 256, "ops_in_unknown_loops": 0}
    assert coll["collective-permute"] == {"ops": 1, "bytes": 256, "bytes_executed": 6 * 256,
                                          "ops_in_unknown_loops": 0}
    largest = r["largest_collectives"]
    # By bytes, then by times executed.
    assert [(c["kind"], c["bytes"], c["times"]) for c in largest] == [
        ("all-gather", 1024, 1), ("all-gather", 1024, 1), ("all-reduce", 528, 1), ("all-reduce", 512, 1),
        ("all-to-all", 256, 6), ("collective-permute", 256, 6), ("reduce-scatter", 128, 1)]
    assert (largest[0]["op_name"], largest[0]["function"]) == ("jit(f)/all_gather", "gather_weights")
    assert (largest[4]["op_name"], largest[4]["function"]) == ("jit(f)/while/body/all_to_all", "dispatch_tokens")
    assert largest[1]["op_name"] == largest[1]["function"] == ""  # no metadata
    assert [c["kind"] for c in hlo.analyze_hlo(COLLECTIVES, top=2)["largest_collectives"]] == ["all-gather"] * 2


def test_flop_rules():
    comps, _ = hlo.parse_hlo(FLOPS)
    shapes = {i.name: i.shape for i in comps["main"]}
    by_name = {i.name: hlo.instr_flops(i, shapes) for i in comps["main"]}
    assert by_name["bmm"] == (2 * (2 * 8 * 4) * 16, 0, True)  # 2 * |out| * contracted (batch dim not contracted)
    assert by_name["rd"] == (2 * (8 * 4) * 16, 0, True)
    # 3x3 window, pad 1, over a 5x5 image: per axis, kernel offsets 0 / 1 / 2 see 4 / 5 / 4 real
    # inputs across the 5 outputs = 13 valid pairs; 2 * Cin 3 * Cout 2 * batch 1 * 13 * 13.
    assert by_name["conv"] == (2 * 3 * 2 * 1 * 13 * 13, 0, False)
    # Window 3, stride 2, no pad, length 7 -> 3 outputs, all 3 x 3 pairs valid; 2 feature groups
    # of 4 / 2 = 2 input features each; 6 output features, batch 2.
    assert by_name["gconv"] == (2 * 2 * 6 * 2 * 9, 0, False)
    # Variadic reduce: each of the 2 inputs folds 16 -> 1 per row: 2 * (128 - 8).
    assert by_name["best"] == (2 * (8 * 16 - 8), 0, False)
    assert by_name["pool"] == (4 * 6 * (2 * 3 - 1), 0, False)  # (window - 1) per result element
    assert by_name["cmp"] == by_name["sel"] == (32, 0, False)
    assert by_name["t"] == (0, 32, False)  # transcendental
    assert by_name["cv"] == by_name["x"] == (0, 0, False)
    fl = hlo.analyze_hlo(FLOPS)["flops"]
    # bmm + rd + conv + gconv + best + pool + cmp + sel, each executed once.
    assert fl["flops_static"] == fl["flops_executed"] == 2048 + 1024 + 2028 + 432 + 240 + 120 + 32 + 32 == 5956
    assert fl["dot_flops_executed"] == 2048 + 1024 and fl["ragged_dot_flops_executed"] == 1024  # frame "...ragged"
    assert fl["transcendentals_executed"] == 32  # the argmax reducer's compare / selects count 0 times


def test_cublas_gemms_count_as_dots_fp8_included():
    """The library GEMMs XLA:GPU emits (bf16 cuBLASLt and the FP8 one, as in benchmarks/fp8_matmul_aot.py's
    compiles): 2 * |out| * contracted, from the first operand and the backend config's contracting dims."""
    config = ('backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
              '"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}')
    text = f"""HloModule gemms

ENTRY %main (a: f8e4m3fn[16,32], b: f8e4m3fn[32,8], c: bf16[16,32], d: bf16[32,8]) -> f32[16,8] {{
  %a = f8e4m3fn[16,32]{{1,0}} parameter(0)
  %b = f8e4m3fn[32,8]{{1,0}} parameter(1)
  %one = f32[] constant(1)
  %f8 = (f32[16,8]{{1,0}}, s8[1024]{{0}}) custom-call(%a, %b, %one, %one), custom_call_target="__cublas$lt$matmul$f8", {config}
  %c = bf16[16,32]{{1,0}} parameter(2)
  %d = bf16[32,8]{{1,0}} parameter(3)
  %lt = (bf16[16,8]{{1,0}}, s8[1024]{{0}}) custom-call(%c, %d), custom_call_target="__cublas$lt$matmul", {config}
  ROOT %out = f32[16,8]{{1,0}} get-tuple-element(%f8), index=0
}}
"""
    comps, _ = hlo.parse_hlo(text)
    shapes = {i.name: i.shape for i in comps["main"]}
    by_name = {i.name: hlo.instr_flops(i, shapes) for i in comps["main"]}
    assert by_name["f8"] == by_name["lt"] == (2 * 16 * 8 * 32, 0, True)
    assert hlo.analyze_hlo(text)["flops"]["dot_flops_executed"] == 2 * 8192


@pytest.mark.parametrize("conv", [
    dict(lhs=(2, 9, 7, 3), rhs=(3, 2, 3, 5), strides=(1, 1), padding="SAME"),
    dict(lhs=(2, 9, 7, 3), rhs=(3, 2, 3, 5), strides=(2, 3), padding=((1, 2), (0, 1))),
    dict(lhs=(1, 10, 6, 4), rhs=(3, 3, 2, 6), strides=(1, 1), padding=((2, 2), (1, 1)), groups=2),
    dict(lhs=(1, 8, 5, 2), rhs=(3, 2, 2, 3), strides=(1, 1), padding=((1, 1), (0, 0)), lhs_dilation=(2, 1),
         rhs_dilation=(1, 2)),
])
def test_convolution_flops_match_xla(conv):
    """The convolution rule (valid window positions under padding, stride, both dilations and
    feature groups) reproduces XLA's own cost analysis of the compiled convolution."""
    def f(x, k):
        return jax.lax.conv_general_dilated(x, k, conv["strides"], conv["padding"], conv.get("lhs_dilation"),
                                            conv.get("rhs_dilation"), ("NHWC", "HWIO", "NHWC"),
                                            feature_group_count=conv.get("groups", 1))

    compiled = jax.jit(f).lower(jnp.ones(conv["lhs"]), jnp.ones(conv["rhs"])).compile()
    text = compiled.as_text()
    assert any(i.opcode == "convolution" for c in hlo.parse_hlo(text)[0].values() for i in c)
    assert hlo.analyze_hlo(text)["flops"]["flops_static"] == compiled.cost_analysis()["flops"] > 0


RAGGED = """HloModule ragged

ENTRY %main (x: bf16[48,64], y: bf16[4,8]) -> bf16[192,64] {
  %x = bf16[48,64]{1,0} parameter(0)
  %y = bf16[4,8]{1,0} parameter(1)
  %buf = bf16[192,64]{1,0} parameter(2)
  %small = bf16[24,64]{1,0} parameter(3)
  %off = s64[8]{0} parameter(4)
  %a2a-start = ((bf16[4,8]{1,0}), bf16[4,8]{1,0}) all-to-all-start(%y), channel_id=1, replica_groups={{0,4},{1,5}}, dimensions={0}
  %a2a-done = bf16[4,8]{1,0} all-to-all-done(%a2a-start)
  %sync = bf16[192,64]{1,0} ragged-all-to-all(%x, %buf, %off, %off, %off, /*index=5*/%off), channel_id=2, replica_groups={{0,1,2,3}}
  %back-start = ((bf16[192,64]{1,0}, bf16[24,64]{1,0}, s64[8]{0}, s64[8]{0}, s64[8]{0}, /*index=5*/s64[8]{0}), bf16[24,64]{1,0}) ragged-all-to-all-start(%sync, %small, %off, %off, %off, /*index=5*/%off), channel_id=3, replica_groups={{0,1,2,3}}
  %back = bf16[24,64]{1,0} ragged-all-to-all-done(%back-start)
  ROOT %out = bf16[192,64]{1,0} copy(%sync)
}
"""


def test_async_and_ragged_all_to_all():
    """An async all-to-all counts at its -done; a ragged all-to-all moves at most its send buffer (operand 0),
    not its worst-case result buffer: forward 48 rows sent into a 192-row buffer, back 24 rows received."""
    coll = hlo.analyze_hlo(RAGGED)["collectives"]["all-to-all"]
    assert coll["ops"] == 3
    assert coll["bytes"] == 4 * 8 * 2 + 48 * 64 * 2 + 24 * 64 * 2
