"""HLO module text -> collective bytes, FLOPs and loop trip counts (pure Python, no JAX).

Reads the text of a compiled, SPMD-partitioned module (`compiled.as_text()`), so every number is
per device. The counting rules (also in `plan.report.NOTES`):

  loops        a while body runs `known_trip_count` times per execution of the while (XLA records
               it in the backend config when it can prove it); a loop without one (data-dependent,
               e.g. the DSA indexer's causal key loop) counts once and everything under it is
               flagged. Fusions, calls, conditional branches and async wrappers (from their
               `async-start`) run once per caller; reducers and comparators (`to_apply` of any op
               but `call`) zero times, their work is counted on the op that applies them.
  flops        as XLA's HloCostAnalysis: dot (and XLA:GPU's cuBLAS GEMM custom calls) 2 * |out| *
               |contracted|, convolution 2 per multiply-add over the valid (non-padding) window
               positions, elementwise 1 per result element, transcendentals separately, reduce 1
               per reduced input element, reduce-window (window - 1) per result element.
  collectives  all-gather, all-reduce, reduce-scatter, all-to-all and collective-permute: the bytes
               of the RESULT shape (the gathered array for all-gather, the shard for reduce-scatter;
               not wire traffic); async pairs counted once, at `*-done`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

COLLECTIVE_KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

_COMP_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_CALLEE = re.compile(r"\b(condition|body|calls|to_apply|true_computation|false_computation)=%?([^\s,}]+)")
_CALLEE_LIST = re.compile(r"\b(branch_computations|called_computations)=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_COLLECTIVE_OPS = {
    "all-gather": "all-gather", "all-gather-done": "all-gather",
    "all-reduce": "all-reduce", "all-reduce-done": "all-reduce",
    "reduce-scatter": "reduce-scatter", "reduce-scatter-done": "reduce-scatter",
    "all-to-all": "all-to-all", "all-to-all-done": "all-to-all",
    "ragged-all-to-all": "all-to-all", "ragged-all-to-all-done": "all-to-all",
    "collective-permute": "collective-permute", "collective-permute-done": "collective-permute",
}
COLLECTIVE_OPCODES = _COLLECTIVE_OPS  # opcode -> the collective kind it is counted as
# XLA:GPU's library GEMMs: a custom call whose backend config carries the dot's dimension numbers.
# XLA:GPU's library GEMMs (an FP8 dot that cuBLASLt runs is the `$f8` one), counted as dots.
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]')
# The later halves of an async op name the same wrapped computation as its `async-start`: the
# computation runs once, so only the start's edge counts.
_ASYNC_FOLLOWERS = frozenset({"async-update", "async-done"})
# Counted like XLA's HloCostAnalysis: elementwise ops 1 flop per result element, transcendentals
# separately.
_TRANSCENDENTAL = frozenset({"exponential", "exponential-minus-one", "log", "log-plus-one", "logistic", "tanh",
                             "rsqrt", "sqrt", "cbrt", "sine", "cosine", "tan", "atan2", "erf", "power"})
_ELEMENTWISE = frozenset({"add", "subtract", "multiply", "divide", "maximum", "minimum", "abs", "negate", "compare",
                          "select", "and", "or", "xor", "not", "remainder", "sign", "floor", "ceil", "clamp",
                          "round-nearest-even", "round-nearest-afz", "shift-left", "shift-right-logical",
                          "shift-right-arithmetic", "is-finite", "popcnt", "clz"})


@dataclasses.dataclass(frozen=True)
class Instr:
    """One HLO instruction, split into the parts the counters read."""

    name: str
    shape: str  # result type text, e.g. "f32[8,16]{1,0}" or "(s32[], bf16[4]{0})"
    opcode: str
    operands: str  # the text inside the opcode's parentheses
    attrs: str  # everything after them


def _closing(text: str, start: int) -> int:
    """Index of the parenthesis that closes the one at `text[start]` (the last index if none does)."""
    depth = 0
    for i in range(start, len(text)):
        depth += text[i] == "("
        depth -= text[i] == ")"
        if depth == 0:
            return i
    return len(text) - 1


def split_instr(rest: str) -> tuple[str, str, str, str] | None:
    """`TYPE opcode(operands), attrs` -> (TYPE, opcode, operands, attrs); TYPE may be a nested tuple.
    None when the text has no `opcode(` after the type."""
    if rest.startswith("("):
        end = _closing(rest, 0)
        shape, rest = rest[: end + 1], rest[end + 1:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    m = re.match(r"([\w\-]+)\(", rest)
    if not m:
        return None
    start = m.end() - 1
    end = _closing(rest, start)
    return shape, m.group(1), rest[start + 1: end], rest[end + 1:]


def parse_hlo(text: str) -> tuple[dict[str, list[Instr]], str | None]:
    """HLO module text -> ({computation name: its instructions in order}, entry computation name)."""
    comps: dict[str, list[Instr]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            m = _COMP_HEADER.match(line)
            if m:
                current = m.group(2)
                comps[current] = []
                entry = current if m.group(1) else entry
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        parts = split_instr(m.group(2)) if m else None
        if parts:
            comps[current].append(Instr(m.group(1), *parts))
    return comps, entry


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO result type (tuple elements summed); the element width comes from the type
    name's digits (bf16: 2, f8e4m3fn: 1, s4: 0.5), pred is 1 byte and token 0."""
    total = 0.0
    for dtype, dim_text in _ARRAY.findall(shape):
        bits = re.search(r"\d+", dtype)
        width = 8 if dtype == "pred" else 0 if dtype == "token" or not bits else int(bits.group())
        total += math.prod(int(d) for d in dim_text.split(",") if d) * width / 8
    return total


def collective_bytes(ins: Instr, shapes: dict[str, str]) -> float:
    """Bytes a collective delivers per device: its result, except for a ragged all-to-all, whose result
    buffer is sized for the worst case (every row to one device) while it moves at most its send
    buffer's rows: the smaller of the two (the send buffer is operand 0; for a `-done`, the first
    array of its `-start`'s result tuple)."""
    out = shape_bytes(ins.shape)
    if ins.opcode not in ("ragged-all-to-all", "ragged-all-to-all-done"):
        return out
    first = _ARRAY.search(shapes.get(operands(ins)[0].strip().split()[-1].lstrip("%"), "") if ins.operands else "")
    return min(out, shape_bytes(first.group(0))) if first else out


def dims(shape: str) -> list[int]:
    """Dimensions of the first array in an HLO type (`[]` for a scalar or a type without one)."""
    m = _ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _call_graph(comps: dict[str, list[Instr]], trip_of: Callable[[Instr], float | None] | None = None,
                gpu_conditions: bool = False) -> dict[str, list[tuple[str, float, bool]]]:
    """callee -> [(caller, times per caller execution, whether that count is known)].

    trip_of(while_instr): the trip count of a while whose count XLA could not prove (a data-dependent loop),
    or None (counted once, unknown). gpu_conditions: a while's condition runs as XLA:GPU runs it, once per
    trip plus the exit test for a loop of unknown count and never for one of a known count (XLA:GPU then
    loops on the host); else once per execution of the while."""
    callers: dict[str, list[tuple[str, float, bool]]] = {name: [] for name in comps}
    for caller, instrs in comps.items():
        for ins in instrs:
            trip = _TRIP.search(ins.attrs)
            given = trip_of(ins) if (trip_of is not None and ins.opcode == "while" and trip is None) else None
            for role, callee in _CALLEE.findall(ins.attrs):
                if callee not in callers:
                    continue
                if ins.opcode == "while" and role == "body":
                    count = int(trip.group(1)) if trip else (1 if given is None else given)
                    callers[callee].append((caller, count, trip is not None or given is not None))
                elif ins.opcode == "while" and role == "condition" and gpu_conditions:
                    count = 0 if trip else (2 if given is None else given + 1)
                    callers[callee].append((caller, count, trip is not None or given is not None))
                else:
                    applied = role == "to_apply" and ins.opcode != "call"  # a `call` runs its to_apply once
                    callers[callee].append((caller, int(not applied and ins.opcode not in _ASYNC_FOLLOWERS), True))
            for _, names in _CALLEE_LIST.findall(ins.attrs):
                for callee in (n.strip().lstrip("%") for n in names.split(",")):
                    if callee in callers:
                        callers[callee].append((caller, 1, True))
    return callers


def loop_multipliers(comps: dict[str, list[Instr]], entry: str, trip_of: Callable[[Instr], float | None] | None = None,
                     gpu_conditions: bool = False) -> tuple[dict[str, float], dict[str, bool]]:
    """({computation: times it runs per program call}, {computation: whether a loop with an unknown
    trip count, counted as 1, sits on some path from the entry to it}); `trip_of` and `gpu_conditions` as
    in `_call_graph` (a loop `trip_of` gives a count for is not unknown)."""
    callers = _call_graph(comps, trip_of, gpu_conditions)
    mult: dict[str, float] = {}
    unknown: dict[str, bool] = {}

    def visit(name: str, stack: tuple[str, ...] = ()) -> None:
        if name in mult:
            return
        if name == entry:
            mult[name], unknown[name] = 1, False
            return
        total, unk = 0, False
        for caller, factor, known in callers.get(name, []):
            if caller in stack:  # not expected in HLO; never loop forever
                continue
            visit(caller, stack + (name,))
            total += mult[caller] * factor
            unk = unk or (factor > 0 and mult[caller] > 0 and (unknown[caller] or not known))
        mult[name], unknown[name] = total, unk

    for name in comps:
        visit(name)
    return mult, unknown


def operands(ins: Instr) -> list[str]:
    """The instruction's operand texts (`%name` or `f32[...]{...} %name`), split at top-level commas."""
    out, depth, cur = [], 0, ""
    for ch in ins.operands:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return out + ([cur] if cur.strip() else [])


def _operand_dims(text: str, shapes: dict[str, str]) -> list[int]:
    """Dims of an operand printed as `%name` (looked up in `shapes`) or `f32[...]{...} %name`."""
    text = text.strip()
    return dims(text) if _ARRAY.search(text) else dims(shapes.get(text.lstrip("%"), ""))


def _window_positions(size: int, kernel: int, out: int, stride: int, pad_low: int, lhs_dilate: int,
                      rhs_dilate: int) -> int:
    """(output, kernel) position pairs of one spatial axis whose input is a real (not padding, not
    base-dilation hole) element: XLA's `valid_position_count`."""
    count = 0
    for k in range(kernel):
        for o in range(out):
            at = o * stride - pad_low + k * rhs_dilate
            count += at % lhs_dilate == 0 and 0 <= at // lhs_dilate < size
    return count


def _window_field(window: str, key: str, n: int, default: int) -> list[int]:
    """One `key=AxBxC` field of a convolution's `window={...}` (per spatial axis)."""
    m = re.search(rf"\b{key}=([0-9x_\-]+)", window)
    return [int(v.split("_")[0]) for v in m.group(1).split("x")] if m else [default] * n


def _conv_flops(ins: Instr, shapes: dict[str, str]) -> float:
    """2 per multiply-add of a convolution, counted over valid window positions as XLA does."""
    lhs, rhs = (_operand_dims(o, shapes) for o in operands(ins)[:2])
    out = dims(ins.shape)
    labels = re.search(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)", ins.attrs)
    if not (labels and lhs and rhs and out):
        return 0.0
    lhs_l, rhs_l, out_l = labels.groups()
    spatial = sorted(c for c in lhs_l if c.isdigit())
    window = re.search(r"window=\{([^}]*)\}", ins.attrs)
    window = window.group(1) if window else ""
    n = len(spatial)
    stride, pad_low = _window_field(window, "stride", n, 1), _window_field(window, "pad", n, 0)
    lhs_dilate, rhs_dilate = _window_field(window, "lhs_dilate", n, 1), _window_field(window, "rhs_dilate", n, 1)
    valid = [_window_positions(lhs[lhs_l.index(c)], rhs[rhs_l.index(c)], out[out_l.index(c)], stride[i], pad_low[i],
                               lhs_dilate[i], rhs_dilate[i]) for i, c in enumerate(spatial)]
    groups = re.search(r"feature_group_count=(\d+)", ins.attrs)
    batch_groups = re.search(r"batch_group_count=(\d+)", ins.attrs)
    features = lhs[lhs_l.index("f")] // (int(groups.group(1)) if groups else 1)
    batch = lhs[lhs_l.index("b")] // (int(batch_groups.group(1)) if batch_groups else 1)
    return 2.0 * features * out[out_l.index("f")] * batch * math.prod(valid)


# The grouped-matmul Pallas kernel's name (in the op_name metadata) carries its live rows.
_GROUPED_KERNEL = re.compile(r'op_name="[^"]*grouped_matmul(?:_dequant)?(?:_t)?_rows(\d+)')
# A Pallas kernel's name may carry the HBM bytes one call moves (kernels.traffic_name).
KERNEL_BYTES = re.compile(r'op_name="[^"]*_bytes(\d+)/')
# ... and the FLOPs one call does (kernels.traffic_name(..., flops=)).
KERNEL_FLOPS = re.compile(r'op_name="[^"]*_flops(\d+)_bytes\d+/')


def instr_flops(ins: Instr, shapes: dict[str, str]) -> tuple[float, float, bool]:
    """(flops, transcendentals, whether it is a dot) of one execution of one instruction.

    shapes: {instruction name: result type} of its computation (operands printed without a type).
    """
    if ins.opcode == "dot":
        lhs = _operand_dims(operands(ins)[0], shapes)
        m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.attrs)
        contracted = [lhs[int(i)] for i in m.group(1).split(",") if i] if (m and lhs) else []
        return 2.0 * math.prod(dims(ins.shape)) * math.prod(contracted), 0.0, True
    if ins.opcode == "custom-call" and any(f'custom_call_target="{t}"' in ins.attrs for t in _GEMM_TARGETS):
        # result (out, workspace): the first array is the product
        lhs = _operand_dims(operands(ins)[0], shapes)
        m = _GEMM_CONTRACTING.search(ins.attrs)
        contracted = [lhs[int(i.strip('" '))] for i in m.group(1).split(",") if i.strip()] if (m and lhs) else []
        return 2.0 * math.prod(dims(ins.shape)) * math.prod(contracted), 0.0, True
    if ins.opcode == "custom-call" and (kernel := _GROUPED_KERNEL.search(ins.attrs)):
        # kernels/grouped_matmul.py: [M, K] rows x [G*K, N] -> [M, N]; only the rows named live are worked on.
        lhs = _operand_dims(operands(ins)[1], shapes)
        k = lhs[-1] if lhs else 0
        return 2.0 * int(kernel.group(1)) * k * dims(ins.shape)[-1], 0.0, True
    if ins.opcode == "custom-call" and (declared := KERNEL_FLOPS.search(ins.attrs)):
        return float(declared.group(1)), 0.0, True
    if ins.opcode == "convolution":
        return _conv_flops(ins, shapes), 0.0, False
    if ins.opcode in _ELEMENTWISE:
        return float(math.prod(dims(ins.shape))), 0.0, False
    if ins.opcode in _TRANSCENDENTAL:
        return 0.0, float(math.prod(dims(ins.shape))), False
    if ins.opcode == "reduce":  # operands: N inputs then N init values; each input element folds in once
        ops = operands(ins)
        inputs = ops[: len(ops) // 2]
        n_in = sum(math.prod(_operand_dims(o, shapes)) for o in inputs)
        return float(max(n_in - math.prod(dims(ins.shape)) * len(inputs), 0)), 0.0, False
    if ins.opcode == "reduce-window":
        size = re.search(r"size=([0-9x]+)", ins.attrs)
        window = math.prod(int(d) for d in size.group(1).split("x")) if size else 1
        return float(math.prod(dims(ins.shape)) * max(window - 1, 0)), 0.0, False
    return 0.0, 0.0, False


def frame_functions(text: str) -> dict[int, str]:
    """stack_frame_id -> the function name of that (innermost) frame, from the module's
    FunctionNames / FileLocations / StackFrames tables."""

    def table(title: str) -> dict[int, str]:
        m = re.search(rf"^{title}\n(.*?)(?:\n\s*\n|\Z)", text, re.S | re.M)
        rows = {}
        for line in (m.group(1).splitlines() if m else []):
            key, _, value = line.strip().partition(" ")
            if key.isdigit():
                rows[int(key)] = value
        return rows

    names = {k: v.strip('"') for k, v in table("FunctionNames").items()}
    locs = {k: re.search(r"function_name_id=(\d+)", v) for k, v in table("FileLocations").items()}
    out = {}
    for k, v in table("StackFrames").items():
        loc = re.search(r"file_location_id=(\d+)", v)
        fn = locs.get(int(loc.group(1))) if loc else None
        if fn:
            out[k] = names.get(int(fn.group(1)), "")
    return out


def _frame_function(ins: Instr, frames: dict[int, str]) -> str:
    frame = _FRAME.search(ins.attrs)
    return frames.get(int(frame.group(1)), "") if frame else ""


def analyze_hlo(text: str, top: int = 8) -> dict[str, Any]:
    """Collective bytes by kind, FLOPs and loop counts of one compiled module's text.

    Returns {"collectives": {kind: {ops, bytes, bytes_executed, ops_in_unknown_loops}},
    "largest_collectives": the `top` collective ops by result size (the buffers they add to a
    device's memory) with shape, times executed per program call, the JAX op name and the Python
    function XLA recorded for each, "flops": {flops_static, flops_executed, dot_flops_executed,
    ragged_dot_flops_executed, transcendentals_executed, flops_executed_in_unknown_loops},
    "while_loops", "unknown_trip_count_loops"}. `bytes` and `flops_static` count each computation
    once; `*_executed` times the known trip counts of the loops around it.
    """
    comps, entry = parse_hlo(text)
    if entry is None:
        raise ValueError("analyze_hlo: no ENTRY computation in the HLO text")
    mult, unknown = loop_multipliers(comps, entry)
    coll = {k: {"ops": 0, "bytes": 0.0, "bytes_executed": 0.0, "ops_in_unknown_loops": 0} for k in COLLECTIVE_KINDS}
    fl = dict.fromkeys(("flops_static", "flops_executed", "dot_flops_executed", "ragged_dot_flops_executed",
                        "transcendentals_executed", "flops_executed_in_unknown_loops"), 0.0)
    frames = frame_functions(text)
    loops = {"while_loops": 0, "unknown_trip_count_loops": 0}
    largest: list[dict[str, Any]] = []
    for name, instrs in comps.items():
        shapes = {ins.name: ins.shape for ins in instrs}
        times, unk = mult.get(name, 0), unknown.get(name, False)
        for ins in instrs:
            if ins.opcode == "while":
                loops["while_loops"] += 1
                loops["unknown_trip_count_loops"] += _TRIP.search(ins.attrs) is None
            kind = _COLLECTIVE_OPS.get(ins.opcode)
            if kind is not None:
                b = collective_bytes(ins, shapes)
                c = coll[kind]
                c["ops"] += 1
                c["bytes"] += b
                c["bytes_executed"] += b * times
                c["ops_in_unknown_loops"] += unk
                op_name = re.search(r'op_name="([^"]*)"', ins.attrs)
                largest.append({"kind": kind, "shape": ins.shape, "bytes": int(b), "times": times,
                                "unknown_loop": unk, "op_name": op_name.group(1)[-200:] if op_name else "",
                                "function": _frame_function(ins, frames)})
                continue
            f, t, is_dot = instr_flops(ins, shapes)
            fl["flops_static"] += f * (times > 0)
            fl["flops_executed"] += f * times
            fl["dot_flops_executed"] += f * times if is_dot else 0.0
            # A dot emitted at a lax.ragged_dot call site (grouped_mlp._ragged, grouped_mlp.ragged_lora_delta).
            if is_dot and "ragged" in _frame_function(ins, frames):
                fl["ragged_dot_flops_executed"] += f * times
            fl["transcendentals_executed"] += t * times
            fl["flops_executed_in_unknown_loops"] += f * times if unk else 0.0
    for c in coll.values():
        c["bytes"], c["bytes_executed"] = int(c["bytes"]), int(c["bytes_executed"])
    largest.sort(key=lambda r: (-r["bytes"], -r["times"]))
    return {"collectives": coll, "largest_collectives": largest[:top], "flops": fl, **loops}
