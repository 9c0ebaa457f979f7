"""HLO module text -> the bytes a program moves: HBM traffic and collective bytes by link (pure Python).

What a GPU plan's time estimate reads (`plan.kernel_cost`; each kernel's bytes come from `kernel_bytes`):

  memory       every kernel-level instruction (a fusion, custom call, copy, sort, ...; not the
               bookkeeping ops: parameter, tuple, get-tuple-element, bitcast, control flow) reads
               its operands and writes its result once per execution, times the known trip counts
               of the loops around it (`hlo.loop_multipliers`). Fusion parameters read only through
               slices (dynamic-slice, slice, gather, possibly behind bitcasts) count the slices; a
               dynamic-update-slice into a parameter (XLA updates the buffer in place) reads nothing
               of it and writes only the update. An async fusion (`fusion-start` / `fusion-done`,
               XLA:GPU's dynamic-slice fusions inside loops) counts once, at its start, as the fusion
               it runs: its operands through its body and its result (element 1 of the start's tuple,
               not the tuple, which repeats the operands). Collectives are communication, not counted here.
  links        each collective's groups (replica_groups in any of XLA's printed forms, or
               source_target_pairs) against the host of every partition: a collective whose groups
               all stay within one host travels over NVLink, any other over the inter-host network.
               Bytes are `hlo.py`'s: the result shape, async pairs at `*-done`.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from typing import Any

from glm52_jax.plan.hlo import (
    COLLECTIVE_OPCODES,
    KERNEL_BYTES,
    Instr,
    collective_bytes,
    loop_multipliers,
    operands,
    parse_hlo,
    shape_bytes,
)

NOT_KERNELS = frozenset({"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "conditional",
                         "call", "after-all", "partition-id", "replica-id", "async-start", "async-update",
                         "async-done", "opt-barrier", "add-dependency", "domain", "copy-start", "copy-done", "send",
                         "send-done", "recv", "recv-done", "fusion-done"})
_SLICING = frozenset({"dynamic-slice", "slice", "gather"})
_FUSIONS = frozenset({"fusion", "fusion-start"})
COLLECTIVE_STARTS = frozenset(f"{k}-start" for k in ("all-gather", "all-reduce", "collective-permute",
                                                       "reduce-scatter", "all-to-all", "ragged-all-to-all"))
_GROUPS_EXPLICIT = re.compile(r"\b(?:replica_groups|source_target_pairs)=\{((?:\{[0-9,]*\},?)*)\}")
_GROUPS_IOTA = re.compile(r"\breplica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_GROUPS_MESH = re.compile(r"\breplica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


def operand_name(operand_text: str) -> str:
    """The instruction name of an operand printed as `%name` or `f32[...]{...} %name`."""
    return operand_text.strip().split()[-1].lstrip("%") if operand_text.strip() else ""


def _iota_groups(n_groups: int, size: int, reshape: list[int], perm: list[int] | None) -> list[list[int]]:
    """XLA's iota replica groups `[n_groups,size]<=[reshape]T(perm)`: iota(prod(reshape)) reshaped,
    transposed by `perm`, and cut into n_groups rows of `size`."""
    perm = perm or list(range(len(reshape)))
    strides = [math.prod(reshape[i + 1:]) for i in range(len(reshape))]
    flat = [sum(idx[k] * strides[perm[k]] for k in range(len(perm)))
            for idx in itertools.product(*(range(reshape[p]) for p in perm))]
    return [flat[g * size:(g + 1) * size] for g in range(n_groups)]


def _mesh_groups(axes_text: str, selected_text: str) -> list[list[int]] | None:
    """`mesh['a'=2,'b'=4] {'b'}`: devices numbered row-major over the mesh, one group per index of the
    axes not selected. None for forms this does not know (sub-axes)."""
    axes = re.findall(r"'([^']+)'=(\d+)", axes_text)
    selected = re.findall(r"'([^']+)'", selected_text)
    if not axes or ":" in axes_text or any(s not in dict(axes) for s in selected):
        return None
    names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
    groups: dict[tuple, list[int]] = {}
    for flat, idx in enumerate(itertools.product(*(range(s) for s in sizes))):
        key = tuple(i for i, a in zip(idx, names) if a not in selected)
        groups.setdefault(key, []).append(flat)
    return list(groups.values())


def collective_groups(attrs: str, partitions: int) -> list[list[int]] | None:
    """The device groups of a collective's attributes (partition ids); `{}` = all partitions.
    None when no form this reads is present."""
    if m := _GROUPS_IOTA.search(attrs):
        perm = [int(v) for v in m.group(4).split(",")] if m.group(4) else None
        return _iota_groups(int(m.group(1)), int(m.group(2)), [int(v) for v in m.group(3).split(",")], perm)
    if m := _GROUPS_MESH.search(attrs):
        return _mesh_groups(m.group(1), m.group(2))
    if m := _GROUPS_EXPLICIT.search(attrs):
        groups = [[int(v) for v in g.split(",") if v] for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]
        return groups or [list(range(partitions))]
    return None


def crosses_hosts(groups: list[list[int]] | None, hosts: Sequence[int]) -> bool:
    """Whether some group spans more than one host (unknown groups or ids: assumed so)."""
    if groups is None:
        return True
    return any(any(p >= len(hosts) for p in g) or len({hosts[p] for p in g}) > 1 for g in groups)


def _fusion_access(instrs: list[Instr]) -> tuple[dict[int, float], float]:
    """({parameter index: bytes read, for parameters read only through slices or updated in place},
    bytes the fusion's in-place dynamic-update-slices do not write) of one fusion computation."""
    users: dict[str, list[Instr]] = {}
    for ins in instrs:
        for op in operands(ins):
            users.setdefault(operand_name(op), []).append(ins)
    by_name = {ins.name: ins for ins in instrs}

    def reads(name: str) -> tuple[float, float] | None:
        """(bytes read, bytes of writes avoided) of value `name` when only sliced or updated in place."""
        read, avoided = 0.0, 0.0
        for user in users.get(name, []):
            first = operand_name(operands(user)[0]) == name
            if user.opcode == "bitcast":
                inner = reads(user.name)
                if inner is None:
                    return None
                read, avoided = read + inner[0], avoided + inner[1]
            elif user.opcode in _SLICING and first:
                read += shape_bytes(user.shape)
            elif user.opcode == "dynamic-update-slice" and first:
                update = by_name.get(operand_name(operands(user)[1]))
                avoided += shape_bytes(user.shape) - (shape_bytes(update.shape) if update else 0.0)
            else:
                return None
        return read, avoided

    params, avoided = {}, 0.0
    for ins in instrs:
        if ins.opcode == "parameter":
            access = reads(ins.name)
            if access is not None:
                params[int(ins.operands)] = access[0]
                avoided += access[1]
    return params, avoided


def fusion_bodies(comps: dict[str, list[Instr]]) -> tuple[set[str], dict[str, tuple[dict[int, float], float]]]:
    """(the computations that run inside a kernel: fusion bodies, reducers and what they call; {fusion body:
    `_fusion_access` of it}) of a parsed module."""
    inside: set[str] = set()
    pending = [callee for instrs in comps.values() for ins in instrs
               for role, callee in re.findall(r"\b(calls|to_apply)=%?([^\s,}]+)", ins.attrs)
               if (ins.opcode in _FUSIONS and role == "calls") or (role == "to_apply" and ins.opcode != "call")]
    while pending:
        name = pending.pop()
        if name in comps and name not in inside:
            inside.add(name)
            pending += [c for ins in comps[name] for c in re.findall(r"\b(?:calls|to_apply)=%?([^\s,}]+)", ins.attrs)]
    return inside, {name: _fusion_access(comps[name]) for name in inside}


def _tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape `(a, (b, c), d)` -> ['a', '(b, c)', 'd']."""
    inner, out, depth, cur = shape.strip()[1:-1], [], 0, ""
    for ch in inner:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + ([cur.strip()] if cur.strip() else [])


def kernel_bytes(ins: Instr, shapes: dict[str, str], fusions: dict[str, tuple[dict[int, float], float]]) -> float:
    """Bytes one execution of a kernel-level instruction reads and writes (a Pallas kernel's own count when its
    name carries one)."""
    if ins.opcode == "custom-call" and (declared := KERNEL_BYTES.search(ins.attrs)):
        return float(declared.group(1))
    ops = operands(ins)
    sizes = [shape_bytes(o) if "[" in o.split("%")[0] else shape_bytes(shapes.get(operand_name(o), "")) for o in ops]
    written = shape_bytes(ins.shape)
    if ins.opcode in _SLICING:
        return 2 * written + sum(sizes[1:])
    if ins.opcode == "dynamic-update-slice":
        return 2 * sizes[1] + sum(sizes[2:])
    if ins.opcode == "fusion-start":  # ((operands), result, context): the result is what the fusion writes
        written = shape_bytes(_tuple_elements(ins.shape)[1])
    if ins.opcode in _FUSIONS:
        callee = re.search(r"\bcalls=%?([^\s,}]+)", ins.attrs)
        params, avoided = fusions.get(callee.group(1) if callee else "", ({}, 0.0))
        sizes = [params.get(i, s) for i, s in enumerate(sizes)]
        written = max(written - avoided, 0.0)
    return sum(sizes) + written


def traffic(text: str, hosts: Sequence[int]) -> dict[str, Any]:
    """{memory_bytes_executed, collective_bytes_executed_within_host, collective_bytes_executed_across_hosts,
    collectives_executed_within_host / _across_hosts (how many run), collectives_with_unknown_groups} of one
    compiled module's text; `hosts[p]` is partition p's host."""
    comps, entry = parse_hlo(text)
    if entry is None:
        raise ValueError("traffic: no ENTRY computation in the HLO text")
    mult, _ = loop_multipliers(comps, entry)
    inside, fusions = fusion_bodies(comps)
    out = {"memory_bytes_executed": 0.0, "collective_bytes_executed_within_host": 0.0,
           "collective_bytes_executed_across_hosts": 0.0, "collectives_executed_within_host": 0,
           "collectives_executed_across_hosts": 0, "collectives_with_unknown_groups": 0}
    for name, instrs in comps.items():
        times = mult.get(name, 0)
        if name in inside or times == 0:
            continue
        shapes = {ins.name: ins.shape for ins in instrs}
        by_name = {ins.name: ins for ins in instrs}
        for ins in instrs:
            if ins.opcode in COLLECTIVE_OPCODES:
                # an async *-done carries no groups: its *-start (its operand) does
                source = by_name.get(operand_name(operands(ins)[0])) if ins.opcode.endswith("-done") else ins
                groups = collective_groups(source.attrs if source else "", len(hosts))
                out["collectives_with_unknown_groups"] += groups is None
                link = "across_hosts" if crosses_hosts(groups, hosts) else "within_host"
                out[f"collective_bytes_executed_{link}"] += collective_bytes(ins, shapes) * times
                out[f"collectives_executed_{link}"] += times  # an async pair once, at its -done
            elif ins.opcode not in NOT_KERNELS and ins.opcode not in COLLECTIVE_STARTS:
                out["memory_bytes_executed"] += kernel_bytes(ins, shapes, fusions) * times
    return out
