"""Plan reports: the transaction verdict (`assess`), what every number means (`NOTES`) and the
readable table (`format_plan`). Pure Python: usable on a saved plan.json without JAX."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from glm52_jax import choices
from glm52_jax.parallel.xla_options import as_flags
from glm52_jax.plan.hlo import COLLECTIVE_KINDS
from glm52_jax.plan.targets import ESTIMATE_NOTES, GPU_TARGETS

PROGRAMS = choices.PLAN_PROGRAMS  # what `plan` can compile
# What a GRPO transaction runs; "forward" is a reference.
TRANSACTION_PROGRAMS = tuple(p for p in PROGRAMS if p != "forward")

NOTES = (
    "per device throughout; memory from compiled.memory_analysis(); total = argument + output + temp - alias",
    "xla_flops = compiled.cost_analysis()['flops']: XLA counts a while/scan body once, whatever its trip count",
    "flops_static / flops_executed: the HLO's ops counted like XLA's cost analysis (dot 2*|out|*|contracted|, "
    "convolution 2 per multiply-add at valid window positions, elementwise 1 per element, reduce 1 per reduced "
    "element), each computation once / times its loops' known "
    "trip counts; loops with a data-dependent trip count (the DSA indexer's causal key loop) count once "
    "(flops_executed_in_unknown_loops says how much sits under one)",
    "collectives: bytes of each collective op's result shape (all-gather: the gathered array; reduce-scatter: "
    "the shard; all-reduce / all-to-all / collective-permute: the buffer), async pairs at *-done; 'bytes' = each "
    "op once as it appears in the text (a loop body once), 'bytes_executed' = times known trip counts",
    "XLA:CPU lowers lax.ragged_dot densely (jax's _ragged_dot_general_impl: each row expanded over all local "
    "expert groups and masked), so MoE FLOPs are ~E times a grouped GEMM's (ragged_dot_flops_executed; "
    "flops_executed_grouped_gemm_estimate divides that part by E) and temps hold the [rows, E_local * D] "
    "expansion; XLA:CPU cannot compile the ragged-dot HLO op GPU/TPU lowerings emit",
    "indexer_analytic: model FLOPs of the DSA indexer scores, the work inside the data-dependent key loops that "
    "the HLO count sees once (global; /seq_shards for an ideal context-parallel split)",
    "XLA:CPU converts bf16 collectives to f32 (convert before all-gather / all-reduce), doubling those buffers "
    "relative to a GPU build",
)


_CPU_ONLY_NOTE = "XLA:CPU converts bf16 collectives"


def notes_for(target: str) -> list[str]:
    """NOTES as they apply to a plan compiled for `target` (the GPU's add the modeled-time rules)."""
    if target not in GPU_TARGETS:
        return list(NOTES)
    return [n for n in NOTES if not n.startswith(_CPU_ONLY_NOTE)] + [
        "GPU target: compiled deviceless by XLA:GPU (no autotuning: default GEMM tiles); xla_flops is 0 there "
        "(cost_analysis() returns None deviceless: use flops_executed); XLA:GPU also lowers lax.ragged_dot densely "
        "(../shared/research/gpu_aot/README.md section 4), so the ragged_dot note holds",
        *ESTIMATE_NOTES]


def assess(report: dict[str, Any], hbm_bytes: float) -> dict[str, Any]:
    """Sets the verdict fields of `report` for `hbm_bytes` per device (also usable on a saved report).

    Each program gets `fits`; the report's `fits` / `largest_program` cover the transaction's
    programs (all planned programs when none of them was planned).
    """
    totals = {name: p["memory"]["total_bytes"] for name, p in report["programs"].items()}
    judged = {n: t for n, t in totals.items() if n in TRANSACTION_PROGRAMS} or totals
    largest = max(judged, key=judged.get)
    report["hbm_bytes"] = float(hbm_bytes)
    report["largest_program"] = largest
    report["largest_total_bytes"] = totals[largest]
    report["fits"] = bool(totals[largest] <= hbm_bytes)
    for name, p in report["programs"].items():
        p["fits"] = bool(totals[name] <= hbm_bytes)
    return report


def _scale(largest: float, names: Sequence[tuple[str, float]]) -> tuple[str, float]:
    """The largest unit (name, size) in which `largest` is at least 1, else the smallest."""
    for name, size in names:
        if largest >= size:
            return name, size
    return names[-1]


def _base_format(model: dict[str, Any]) -> str:
    """", FP8 base (128x128 blocks)" when the plan's base weights are FP8; "" otherwise (older reports too)."""
    base = model.get("base_weights") or {}
    if base.get("format") != "float8_e4m3fn":
        return ""
    what = "FP8 routed experts" if base.get("only") else "FP8 base"
    return f", {what} ({'x'.join(map(str, base['block']))} blocks, {base['fp8_params']} parameters)"


def format_plan(report: dict[str, Any]) -> str:
    """A readable summary of a `plan` report (all per device; units fit the largest number).

    FLOP columns: xla = cost analysis (loop bodies once); exec = HLO count x known trip counts;
    grouped = exec with the dense CPU ragged_dot part divided by E (see NOTES).
    """
    sh, m, mesh, progs = report["shapes"], report["model"], report["mesh"], report["programs"]
    bu, bs = _scale(max(p["memory"]["total_bytes"] for p in progs.values()),
                    (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)))
    fu, fs = _scale(max(p["flops"]["flops_executed"] for p in progs.values()),
                    (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)))
    cu, cs = _scale(max([c["bytes_executed"] for p in progs.values() for c in p["collectives"].values()] + [0]),
                    (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)))
    lines = [
        f"mesh {mesh['describe']} on {mesh['devices']} {mesh['platform']} devices "
        f"(seq x{mesh['seq_shards']}, experts x{mesh['expert_shards']})",
        f"P={sh['prompt_tokens']} R={sh['max_new_tokens']} G={sh['num_samples']} "
        f"S={sh.get('samples_per_request', sh['num_samples'])} chunk={sh['chunk_size']} "
        f"prefill={sh.get('prefill_mode', 'chunked')} "
        f"capacity={sh['planned_capacity']} mode={sh['gradient_mode']} dtype={sh['dtype']}",
        f"params {m['param_count']:,} ({m['param_bytes'] / bs:.3f} {bu}, {m['param_bytes_per_device'] / bs:.3f} "
        f"{bu}/device{_base_format(m)}); LoRA {m['lora_count']:,} ({m['lora_bytes_per_device'] / bs:.3f} "
        f"{bu}/device); cache "
        f"batch 1 {report['cache']['batch1_bytes_per_device'] / bs:.3f} {bu}/device, decode (shared prompt + S "
        f"suffixes) {report['cache']['decode_bytes_per_device'] / bs:.3f} {bu}/device",
    ]
    ix = report.get("indexer_analytic")
    if ix:
        lines.append(f"DSA indexer scores (analytic, global; inside data-dependent loops): prefill "
                     f"{ix['prefill_total_flops'] / fs:.4g} {fu} in all, last chunk "
                     f"{ix['prefill_last_chunk_flops'] / fs:.4g} {fu}, decode step {ix['decode_step_flops'] / fs:.4g} "
                     f"{fu}; / {ix['seq_shards']} per device if split by CP")
    head = [f"args {bu}", f"out {bu}", f"temp {bu}", f"alias {bu}", f"total {bu}"]
    lines += ["", f"{'program':<8} " + " ".join(f"{h:>10}" for h in head) + f" {'fits':>5} "
              + " ".join(f"{h:>12}" for h in (f"xla {fu}", f"exec {fu}", f"grouped {fu}")) + f" {'lower s':>8} "
              f"{'compile s':>9}"]
    for name, p in progs.items():
        mem, fl = p["memory"], p["flops"]
        cells = [mem[k] / bs for k in ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "total_bytes")]
        flops = [fl[k] / fs for k in ("xla_flops", "flops_executed", "flops_executed_grouped_gemm_estimate")]
        lines.append(f"{name:<8} " + " ".join(f"{c:10.3f}" for c in cells) + f" {'yes' if p['fits'] else 'NO':>5} "
                     + " ".join(f"{f:12.4f}" for f in flops)
                     + f" {p['seconds']['lower']:8.1f} {p['seconds']['compile']:9.1f}")
    lines += ["", f"collectives, {cu} of result shapes: per body (ops) / executed with known trip counts"]
    lines.append(f"{'program':<8} " + " ".join(f"{k:>26}" for k in COLLECTIVE_KINDS))
    for name, p in progs.items():
        cells = []
        for k in COLLECTIVE_KINDS:
            c = p["collectives"][k]
            cells.append(f"{c['bytes'] / cs:.3f} ({c['ops']}) / {c['bytes_executed'] / cs:.3f}".rjust(26))
        lines.append(f"{name:<8} " + " ".join(cells))
    lines += ["", f"largest collective results ({cu} each, x times per call; source function or op name):"]
    for name, p in progs.items():
        for c in p.get("largest_collectives", [])[:3]:
            source = c["function"] or c["op_name"][-60:]
            lines.append(f"  {name:<8} {c['kind']:<18} {c['bytes'] / cs:9.3f} x{c['times']:<5} "
                         f"{c['shape'][:48]:<48} {source}")
    lines += _time_lines(report)
    lines += ["", f"largest transaction program: {report['largest_program']} {report['largest_total_bytes'] / 1e9:.3f} "
                  f"GB vs HBM {report['hbm_bytes'] / 1e9:.1f} GB -> {'fits' if report['fits'] else 'DOES NOT FIT'}"]
    for issue in report.get("issues", []):
        lines.append(f"issue: {issue}")
    return "\n".join(lines)


def _time_lines(report: dict[str, Any]) -> list[str]:
    """The estimated-time table of a GPU plan (none for the CPU target, which models no time): per call, the
    three scenarios and where the central one goes."""
    timed = {n: p for n, p in report["programs"].items() if p.get("time")}
    if not timed:
        return []
    target = report["target"]
    eff = target.get("efficiency") or {}
    lines = ["", f"modeled time per call on {target['name']} (topology {target['topology']}; per-kernel estimate, "
                 f"efficiency table {eff.get('version', report.get('model_version'))}): central (optimistic - "
                 "pessimistic), and the central's largest parts",
             f"{'program':<13} {'central s':>10} {'optim. s':>10} {'pessim. s':>10} {'launches':>11} "
             f"{'calls':>6}  largest parts (central s)"]
    for name, p in timed.items():
        t = p["time"]
        parts = {**{k: v["seconds"] for k, v in t["breakdown"]["classes"].items()},
                 **{k: v["seconds"] for k, v in t["breakdown"]["collectives"].items()}}
        top = ", ".join(f"{k} {v:.3g}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])[:4])
        lines.append(f"{name:<13} {t['central_s']:10.4g} {t['optimistic_s']:10.4g} {t['pessimistic_s']:10.4g} "
                     f"{t['launches']:11,.0f} {p['calls_per_transaction']:6d}  {top}")
    first = report.get("first_candidate_s")
    if first:
        lines.append(f"first candidate (every prefill call + one decode call), modeled: central "
                     f"{first['central']:.4g} s (optimistic {first['optimistic']:.4g} s, "
                     f"pessimistic {first['pessimistic']:.4g} s)")
    lines.append(f"budget per device: {target['device_memory_bytes'] / 1e9:.2f} GB x {target['memory_fraction']:.2f} "
                 f"(XLA_PYTHON_CLIENT_MEM_FRACTION, set by the launcher) = {target['budget_bytes'] / 1e9:.2f} GB")
    if target.get("xla_options"):
        lines.append("XLA options of the run (model.moe_cross_host): " + " ".join(as_flags(target["xla_options"])))
    return lines
