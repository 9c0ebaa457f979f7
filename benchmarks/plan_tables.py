"""Markdown tables of saved plan reports' time estimates (for benchmarks/RESULTS.md).

    python -m benchmarks.plan_tables benchmarks/results/plan_2m_h20.json [more reports ...]

Per report: each program's per-device memory and its modeled time per call (central, with the optimistic -
pessimistic band), and the central estimate of the first candidate split into the parts the next work acts on:
indexer scoring, the top-k merge, the key loops' other kernels and syncs, sparse MLA, routed experts, GEMMs, other
memory-bound kernels, and each collective kind. Pure Python (reads JSON only).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from glm52_jax.model.loop_scopes import CACHED_KEY_LOOP, CAUSAL_KEY_LOOP, SUFFIX_KEY_LOOP

KEY_LOOPS = (CAUSAL_KEY_LOOP, CACHED_KEY_LOOP, SUFFIX_KEY_LOOP)
PARTS = {  # part -> the kernel classes it sums (key-loop overhead and other memory are split below)
    "indexer scoring": ("dsa_index_scores", "dsa_index_scores_fp8"),
    "top-k merge": ("dsa_topk_select", "sort"),
    "sparse MLA": ("sparse_mla_forward", "sparse_mla_backward", "sparse_mla_segment_sum"),
    "routed experts (grouped matmul)": ("grouped_matmul", "grouped_matmul_fp8"),
    "GEMMs": ("gemm", "gemm_fp8"),
}


def parts(time: dict[str, Any]) -> dict[str, float]:
    """One program call's central estimate split into `PARTS`, the key loops' overhead (memory-class kernels inside
    the DSA key loops + the loops' syncs), other memory-bound kernels and each collective kind."""
    b = time["breakdown"]
    classes = {k: v["seconds"] for k, v in b["classes"].items()}
    parted = {c for members in PARTS.values() for c in members} | {"memory", "pallas_other"}
    if unknown := sorted(set(classes) - parted):  # a class no part sums would vanish from the table
        raise ValueError(f"plan_tables: kernel classes {unknown} belong to no part of PARTS")
    out = {name: sum(classes.get(c, 0.0) for c in members) for name, members in PARTS.items()}
    in_loops = b.get("in_loops", {})
    loop_memory = sum(in_loops.get(scope, {}).get(c, 0.0) for scope in KEY_LOOPS for c in ("memory", "pallas_other"))
    out["key-loop overhead (small kernels + syncs)"] = loop_memory + b["sync_s"]
    out["other memory-bound kernels"] = classes.get("memory", 0.0) + classes.get("pallas_other", 0.0) - loop_memory
    for kind, row in b["collectives"].items():
        out[f"{kind} (collective)"] = row["seconds"]
    return out


def report_tables(report: dict[str, Any], name: str) -> str:
    target, made = report["target"], report.get("made_at") or {}
    lines = [f"### {name}: {report['mesh']['describe']} on {target['name']} ({target['topology']}), "
             f"table {report.get('model_version')}, commit {str(made.get('commit'))[:10]}"
             + (" (+ uncommitted changes)" if made.get("uncommitted_changes") else ""), "",
             "| program | calls | total GB/device | fits | modeled s per call: central (optimistic - pessimistic) "
             "| kernel launches |", "|---|---|---|---|---|---|"]
    for prog, p in report["programs"].items():
        t = p.get("time") or {}
        band = (f"{t['central_s']:.4g} ({t['optimistic_s']:.4g} - {t['pessimistic_s']:.4g})" if t else "-")
        lines.append(f"| {prog} | {p['calls_per_transaction']} | {p['memory']['total_bytes'] / 1e9:.1f} | "
                     f"{'yes' if p['fits'] else 'NO'} | {band} | {t.get('launches', 0):,.0f} |")
    first = report.get("first_candidate_s")
    if first:
        lines += ["", "Modeled first candidate (every prefill call + one decode call): "
                      f"**central {first['central']:.0f} s** (optimistic {first['optimistic']:.0f} s, "
                      f"pessimistic {first['pessimistic']:.0f} s)."]
        prefill, decode = report["programs"]["prefill"], report["programs"]["decode"]
        split = {k: v * prefill["calls_per_transaction"] for k, v in parts(prefill["time"]).items()}
        for k, v in parts(decode["time"]).items():
            split[k] = split.get(k, 0.0) + v
        total = sum(split.values())
        lines += ["", "| where the central first candidate goes | s | share |", "|---|---|---|"]
        for k, v in sorted(split.items(), key=lambda kv: -kv[1]):
            if v > 0.0005 * total:
                lines.append(f"| {k} | {v:.1f} | {100 * v / total:.1f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plan_tables", description=__doc__.split("\n")[0])
    parser.add_argument("reports", nargs="+")
    args = parser.parse_args(argv)
    for path in args.reports:
        print(report_tables(json.loads(Path(path).read_text()), Path(path).stem))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
