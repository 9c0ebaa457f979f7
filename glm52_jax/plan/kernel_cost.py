"""Per-kernel time estimate of one compiled GPU program (pure Python, no JAX).

Reads the SPMD-partitioned HLO text (per device) and sums, over every kernel the program launches:

  kernel       max(FLOPs / (peak x the class's fraction), bytes / (HBM bandwidth x its fraction), launch floor)
               per execution, times its executions. Executions are the known trip counts of the loops
               around it, and for a data-dependent loop (XLA cannot prove its count) the trip count the
               caller gives for that loop's name scope (`loop_trips`: the DSA key loops, the EP pass loop),
               so a loop body that runs 345,408 times is not counted once.
  sync         each evaluation of a data-dependent loop's condition (trips + 1 per execution of the loop:
               XLA:GPU reads the predicate on the host) costs `sync_s`; a loop of known count runs its body
               from the host without testing a condition.
  collectives  by kind and by the links a group spans (h hosts, g GPUs per host, n = g x h GPUs; R = the
               result bytes `hlo.collective_bytes` counts): all-gather R(h-1)/n over the network and R(g-1)/g
               over NVLink (hierarchical: the result enters each host once), reduce-scatter the same for the
               gathered size n x R, all-reduce twice an all-gather's bytes, all-to-all R(n-g)/n over the
               network and R(g-1)/n over NVLink, collective-permute R over the link its pairs span; each at the
               link's achieved fraction of line rate, plus a fixed latency per collective.
  overlap      an all-to-all that the compiled program runs asynchronously, with kernels scheduled between its
               start and its done (the EP exchange's pipelined windows: expert work of one window while another's
               rows travel), is charged max(exchange, those kernels) instead of the sum: its seconds less the
               kernels' (each kernel's time hides one collective at most), never below zero. Optimistic and
               central only; the pessimistic scenario keeps the sum (NCCL's kernels share the SMs with the
               experts, and nothing on a real GPU has checked the overlap yet).
Otherwise nothing overlaps: kernels run one after another on the busiest device (the caller's trip counts are
that device's), and collectives add to them.

Kernel classes (`efficiency.CLASSES`): cuBLAS GEMMs and fusions holding a dot are `gemm` (`gemm_fp8` for
cuBLASLt's FP8 GEMM); a Pallas kernel is its own class by the name it carries (`dsa_index_scores`,
`sparse_mla_forward`, ...); sorts are `sort`; everything else is `memory`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from glm52_jax.model.loop_scopes import SCOPES
from glm52_jax.plan.efficiency import FLOP_CLASSES, SCENARIOS, Rates, Table
from glm52_jax.plan.hlo import (
    COLLECTIVE_OPCODES,
    Instr,
    collective_bytes,
    instr_flops,
    loop_multipliers,
    operands,
    parse_hlo,
)
from glm52_jax.plan.hlo_traffic import COLLECTIVE_STARTS, NOT_KERNELS, collective_groups, fusion_bodies, kernel_bytes

_OP_NAME = re.compile(r'op_name="([^"]*)"')
_PALLAS_NAME = re.compile(r"/([A-Za-z_]+?)(?:_rows\d+)?(_fp8)?(?:_flops\d+)?(?:_bytes\d+)?/pallas_call")
# A kernel named NAME_fp8 is class NAME_fp8 where that class exists (the FP8 indexer scores), else NAME's.
_PALLAS_CLASSES = ("dsa_index_scores_fp8", "dsa_index_scores", "dsa_topk_select", "sparse_mla_forward",
                   "sparse_mla_backward", "sparse_mla_segment_sum", "grouped_matmul_fp8", "grouped_matmul")
_GEMM_OPS = frozenset({"dot", "convolution"})
_CALLS = re.compile(r"\b(?:calls|to_apply)=%?([^\s,}]+)")
_CALLEE_ROLES = re.compile(r"\b(condition|body|calls|to_apply|true_computation|false_computation)=%?([^\s,}]+)")
# Collective kinds whose async start/done pairs may hide the kernels between them (`overlap` above). Only the EP
# exchange's all-to-all is credited: the other kinds' estimates stay the sums their calibration assumed.
OVERLAP_KINDS = frozenset({"all-to-all"})


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel-level instruction: what one execution does, and how often it runs per program call."""

    name: str
    kind: str  # its class (efficiency.CLASSES)
    flops: float
    bytes: float
    executions: float
    loop: str | None = None  # the scope of the innermost data-dependent loop it runs in (None: none)


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # hlo.COLLECTIVE_KINDS
    bytes: float  # result bytes per device (hlo.collective_bytes)
    executions: float
    gpus: int  # n: GPUs in one group
    hosts: int  # h: hosts one group spans


@dataclasses.dataclass(frozen=True)
class Loop:
    """A while loop of data-dependent trip count."""

    scope: str | None  # the loop_trips name scope found in its op name (None: none known)
    executions: float  # times the loop runs per program call
    trips: float | None  # trips per execution used (None: not given, counted once)


@dataclasses.dataclass(frozen=True)
class Overlap:
    """An async collective and the kernels the schedule runs between its start and its done (same computation)."""

    collective: int  # index into Work.collectives
    kernels: tuple[int, ...]  # indices into Work.kernels


@dataclasses.dataclass(frozen=True)
class Work:
    kernels: tuple[Kernel, ...]
    collectives: tuple[Collective, ...]
    loops: tuple[Loop, ...]
    overlaps: tuple[Overlap, ...] = ()


class Program:
    """A parsed program, ready to count at any set of data-dependent trip counts."""

    def __init__(self, text: str, hosts: Sequence[int]):
        self.comps, self.entry = parse_hlo(text)
        if self.entry is None:
            raise ValueError("kernel_cost: no ENTRY computation in the HLO text")
        self.hosts = list(hosts)
        self.inside, self.fusions = fusion_bodies(self.comps)
        self._body_kind: dict[str, str | None] = {}
        self._body_flops: dict[str, float] = {}

    def work(self, trips: Mapping[str, float]) -> Work:
        """Kernels, collectives and data-dependent loops with `trips` ({name scope: trips per execution})."""

        def trip_of(ins: Instr) -> float | None:
            scope = _scope(ins, trips)
            return trips[scope] if scope is not None else None

        mult, _ = loop_multipliers(self.comps, self.entry, trip_of, gpu_conditions=True)
        loop_of = self._loop_scopes()
        kernels, colls, loops, overlaps = [], [], [], []
        for comp, instrs in self.comps.items():
            times = mult.get(comp, 0)
            if comp in self.inside or times == 0:
                continue
            shapes = {ins.name: ins.shape for ins in instrs}
            by_name = {ins.name: ins for ins in instrs}
            # The module is scheduled: text order is execution order, so the kernels between an async start and
            # its done run while the collective is in flight.
            position = {ins.name: i for i, ins in enumerate(instrs)}
            placed: list[tuple[int, int]] = []  # (position, index into kernels) of this computation's kernels
            for i, ins in enumerate(instrs):
                if ins.opcode == "while" and '"known_trip_count"' not in ins.attrs:
                    scope = _scope(ins, trips)
                    loops.append(Loop(scope or _scope(ins, None), times, trips[scope] if scope else None))
                if ins.opcode in COLLECTIVE_OPCODES:
                    start = by_name.get(_operand_name(ins)) if ins.opcode.endswith("-done") else ins
                    n, h = self._group_shape(start.attrs if start else "")
                    kind = COLLECTIVE_OPCODES[ins.opcode]
                    colls.append(Collective(kind, collective_bytes(ins, shapes), times, n, h))
                    if kind in OVERLAP_KINDS and start is not None and start is not ins:
                        first = position[start.name]
                        between = tuple(k for at, k in placed if first < at)
                        if between:
                            overlaps.append(Overlap(len(colls) - 1, between))
                elif ins.opcode not in NOT_KERNELS and ins.opcode not in COLLECTIVE_STARTS:
                    placed.append((i, len(kernels)))
                    kernels.append(Kernel(ins.name, self._kind(ins), self._flops(ins, shapes),
                                          kernel_bytes(ins, shapes, self.fusions), times, loop_of.get(comp)))
        return Work(tuple(kernels), tuple(colls), tuple(loops), tuple(overlaps))

    def _loop_scopes(self) -> dict[str, str]:
        """{computation: the scope of the innermost data-dependent loop whose body or condition reaches it}."""
        found: dict[str, str] = {}

        def mark(comp: str, scope: str, seen: set[str]) -> None:
            if comp in seen or comp in self.inside or comp not in self.comps:
                return
            seen.add(comp)
            found[comp] = scope
            for ins in self.comps[comp]:
                inner = _scope(ins, None) if ins.opcode == "while" and '"known_trip_count"' not in ins.attrs else None
                for role, callee in _CALLEE_ROLES.findall(ins.attrs):
                    mark(callee, (inner or scope) if role in ("body", "condition") else scope, seen)

        for instrs in self.comps.values():
            for ins in instrs:
                if ins.opcode == "while" and '"known_trip_count"' not in ins.attrs and (scope := _scope(ins, None)):
                    for role, callee in _CALLEE_ROLES.findall(ins.attrs):
                        if role in ("body", "condition") and callee not in found:
                            mark(callee, scope, set())
        return found

    def _group_shape(self, attrs: str) -> tuple[int, int]:
        """(GPUs in a group, hosts it spans) of a collective (unknown groups: every partition)."""
        groups = collective_groups(attrs, len(self.hosts)) or [list(range(len(self.hosts)))]
        group = max(groups, key=len) if groups else []
        spanned = {self.hosts[p] if p < len(self.hosts) else p for p in group}
        return max(len(group), 1), max(len(spanned), 1)

    def _kind(self, ins: Instr) -> str:
        if ins.opcode == "custom-call":
            if "__cublas$lt$matmul$f8" in ins.attrs:
                return "gemm_fp8"
            if "__cublas$" in ins.attrs:
                return "gemm"
            name = _OP_NAME.search(ins.attrs)
            pallas = _PALLAS_NAME.search(name.group(1)) if name else None
            if pallas or "xla.gpu.triton" in ins.attrs:
                found = pallas.group(1) if pallas else ""
                if pallas and pallas.group(2) and found + "_fp8" in _PALLAS_CLASSES:
                    return found + "_fp8"
                return next((c for c in _PALLAS_CLASSES if found.startswith(c)), "pallas_other")
            return "sort" if "sort" in ins.attrs.lower() else "memory"
        if ins.opcode == "sort":
            return "sort"
        if ins.opcode in ("fusion", "fusion-start"):
            callee = re.search(r"\bcalls=%?([^\s,}]+)", ins.attrs)
            kind = self._body(callee.group(1)) if callee else None
            if kind is not None:
                return kind
            return "gemm" if "__triton_gemm" in ins.attrs or "__cublas" in ins.attrs else "memory"
        return "gemm" if ins.opcode in _GEMM_OPS else "memory"

    def _body(self, comp: str) -> str | None:
        """'gemm' / 'sort' when a fusion body (or what it calls) holds a dot / a sort, else None."""
        if comp not in self._body_kind:
            self._body_kind[comp] = None  # guards against cycles
            found = None
            for ins in self.comps.get(comp, []):
                if ins.opcode in _GEMM_OPS or "__cublas$" in ins.attrs:
                    found = "gemm"
                elif ins.opcode == "sort" and found is None:
                    found = "sort"
                for callee in _CALLS.findall(ins.attrs):
                    inner = self._body(callee)
                    found = "gemm" if "gemm" in (found, inner) else (found or inner)
            self._body_kind[comp] = found
        return self._body_kind[comp]

    def _flops(self, ins: Instr, shapes: dict[str, str]) -> float:
        if ins.opcode not in ("fusion", "fusion-start"):
            return instr_flops(ins, shapes)[0]
        callee = re.search(r"\bcalls=%?([^\s,}]+)", ins.attrs)
        return self._comp_flops(callee.group(1)) if callee else 0.0

    def _comp_flops(self, comp: str) -> float:
        if comp not in self._body_flops:
            self._body_flops[comp] = 0.0
            instrs = self.comps.get(comp, [])
            shapes = {i.name: i.shape for i in instrs}
            total = 0.0
            for ins in instrs:
                total += instr_flops(ins, shapes)[0]
                if ins.opcode in ("fusion", "call"):
                    total += sum(self._comp_flops(c) for c in re.findall(r"\bcalls=%?([^\s,}]+)", ins.attrs))
            self._body_flops[comp] = total
        return self._body_flops[comp]


def _operand_name(ins: Instr) -> str:
    ops = operands(ins)
    return ops[0].strip().split()[-1].lstrip("%") if ops and ops[0].strip() else ""


def _scope(ins: Instr, trips: Mapping[str, float] | None) -> str | None:
    """The name scope of `trips` (or, with None, of the known loop scopes) in a while's op name."""
    name = _OP_NAME.search(ins.attrs)
    if not name:
        return None
    return next((s for s in (SCOPES if trips is None else trips) if f"/{s}/" in name.group(1) + "/"), None)


def kernel_seconds(k: Kernel, rates: Rates) -> tuple[float, str]:
    """(seconds per execution, what bounds it: compute / memory / launch) of one kernel."""
    frac = rates.fractions
    memory_class = "memory" if k.kind in FLOP_CLASSES else k.kind
    memory = k.bytes / (rates.hbm_bytes_per_s * frac[memory_class])
    compute = k.flops / (rates.bf16_flops_per_s * frac[k.kind]) if k.kind in FLOP_CLASSES else 0.0
    best = max((compute, "compute"), (memory, "memory"), (rates.launch_floor_s, "launch"))
    return best


def collective_seconds(c: Collective, rates: Rates) -> tuple[float, float, float]:
    """(seconds, network bytes, NVLink bytes) of one execution of a collective."""
    n, h = c.gpus, c.hosts
    g = max(n // h, 1)
    if c.kind == "all-gather":
        net, nvl = c.bytes * (h - 1) / n, c.bytes * (g - 1) / g
    elif c.kind == "reduce-scatter":
        full = c.bytes * n
        net, nvl = full * (h - 1) / n, full * (g - 1) / g
    elif c.kind == "all-reduce":
        net, nvl = 2 * c.bytes * (h - 1) / n, 2 * c.bytes * (g - 1) / g
    elif c.kind == "all-to-all":
        net, nvl = c.bytes * (n - g) / n, c.bytes * (g - 1) / n
    else:  # collective-permute: each device sends its buffer to one peer
        net, nvl = (c.bytes, 0.0) if h > 1 else (0.0, c.bytes)
    latency = rates.network_latency_s if h > 1 else rates.nvlink_latency_s
    seconds = (net / (rates.network_bytes_per_s * rates.network_fraction)
               + nvl / (rates.nvlink_bytes_per_s * rates.nvlink_fraction) + latency)
    return seconds, net, nvl


def hidden_seconds(work: Work, kernel_s: Sequence[float], coll_s: Sequence[float]) -> list[float]:
    """Per collective, the seconds of one execution that kernels scheduled between its start and done hide:
    min(its seconds, those kernels' seconds not already hiding an earlier collective)."""
    hidden = [0.0] * len(work.collectives)
    spent = [0.0] * len(work.kernels)
    for ov in work.overlaps:
        need = coll_s[ov.collective]
        for k in ov.kernels:
            take = min(need - hidden[ov.collective], kernel_s[k] - spent[k])
            if take > 0:
                hidden[ov.collective] += take
                spent[k] += take
    return hidden


def estimate(work: Work, rates: Rates, overlap: bool = True) -> dict[str, Any]:
    """Seconds of one program call in one scenario, with where they go (`classes`, `collectives`; a collective's
    `seconds` are what it adds, `hidden_s` what kernels between its async start and done hid: `overlap`)."""
    classes: dict[str, dict[str, float]] = {}
    in_loops: dict[str, dict[str, float]] = {}
    per_kernel = [kernel_seconds(k, rates) for k in work.kernels]
    per_coll = [collective_seconds(c, rates) for c in work.collectives]
    hidden = hidden_seconds(work, [s for s, _ in per_kernel], [s for s, _, _ in per_coll]) if overlap else (
        [0.0] * len(work.collectives))
    for k, (seconds, bound) in zip(work.kernels, per_kernel, strict=True):
        if k.loop is not None:
            by_class = in_loops.setdefault(k.loop, {})
            by_class[k.kind] = by_class.get(k.kind, 0.0) + seconds * k.executions
        row = classes.setdefault(k.kind, {"seconds": 0.0, "launches": 0.0, "flops": 0.0, "bytes": 0.0,
                                          "compute_bound_s": 0.0, "memory_bound_s": 0.0, "launch_bound_s": 0.0})
        row["seconds"] += seconds * k.executions
        row["launches"] += k.executions
        row["flops"] += k.flops * k.executions
        row["bytes"] += k.bytes * k.executions
        row[f"{bound}_bound_s"] += seconds * k.executions
    colls: dict[str, dict[str, float]] = {}
    for c, (seconds, net, nvl), hid in zip(work.collectives, per_coll, hidden, strict=True):
        row = colls.setdefault(c.kind, {"seconds": 0.0, "count": 0.0, "network_bytes": 0.0, "nvlink_bytes": 0.0,
                                        "hidden_s": 0.0})
        row["seconds"] += (seconds - hid) * c.executions
        row["hidden_s"] += hid * c.executions
        row["count"] += c.executions
        row["network_bytes"] += net * c.executions
        row["nvlink_bytes"] += nvl * c.executions
    syncs = sum(loop.executions * ((loop.trips if loop.trips is not None else 1) + 1) for loop in work.loops)
    kernel_s = sum(r["seconds"] for r in classes.values())
    coll_s = sum(r["seconds"] for r in colls.values())
    return {"seconds": kernel_s + coll_s + syncs * rates.sync_s, "kernel_s": kernel_s, "collective_s": coll_s,
            "sync_s": syncs * rates.sync_s, "launches": sum(r["launches"] for r in classes.values()),
            "syncs": syncs, "classes": classes, "collectives": colls, "in_loops": in_loops}


def estimate_program(program: Program, table: Table, target: str, trips: Mapping[str, float],
                     pass_scope: str | None = None) -> dict[str, Any]:
    """The three scenarios of one program: {optimistic_s, central_s, pessimistic_s, launches, syncs,
    breakdown (the central estimate's classes and collectives), loops, unresolved_loops, model_version}.

    trips: {name scope: trips per execution} of the data-dependent loops (busiest device); `pass_scope`: the
    EP pass loop's scope, whose trips are each scenario's `ep_passes` less the first pass (run in line)."""
    out: dict[str, Any] = {"model_version": table.version, "target": target}
    for scenario in SCENARIOS:
        rates = table.rates(target, scenario)
        given = dict(trips)
        if pass_scope is not None:  # the exchange runs its first pass in line, the others in the loop
            given[pass_scope] = rates.ep_passes - 1
        work = program.work(given)
        result = estimate(work, rates, overlap=scenario != "pessimistic")
        out[f"{scenario}_s"] = result["seconds"]
        if scenario == "central":
            out.update(launches=result["launches"], syncs=result["syncs"],
                       breakdown={"kernel_s": result["kernel_s"], "collective_s": result["collective_s"],
                                  "sync_s": result["sync_s"], "classes": result["classes"],
                                  "collectives": result["collectives"], "in_loops": result["in_loops"]},
                       loops=[dataclasses.asdict(loop) for loop in _merge_loops(work.loops)],
                       unresolved_loops=sum(1 for loop in work.loops if loop.trips is None))
    return out


def _merge_loops(loops: Sequence[Loop]) -> list[Loop]:
    """Loops of the same scope and trip count summed (the report's list stays short)."""
    merged: dict[tuple, float] = {}
    for loop in loops:
        key = (loop.scope, loop.trips)
        merged[key] = merged.get(key, 0.0) + loop.executions
    return [Loop(scope, executions, trips) for (scope, trips), executions in merged.items()]
