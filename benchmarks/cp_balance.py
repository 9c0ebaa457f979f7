"""Causal load balance of context-parallel sequence layouts (analytic report, not a test).

Per device, the work of its queries under causal DSA at sequence length S on N devices:
  indexer   causal query-key pairs scored: sum over its queries t of (t + 1)   (O(S^2) total)
  attention keys attended: sum over its queries of min(t + 1, index_topk)       (O(S K) total)
Layouts: `contiguous` (device i holds tokens [iS/N, (i+1)S/N)) and `zigzag` (the sequence cut in
2N chunks; device i holds chunks i and 2N-1-i, so early and late queries pair up). Imbalance =
max over devices / mean: the step waits for the slowest device.

    .venv/bin/python benchmarks/cp_balance.py [--seq_len 2097152 --devices 32 --index_topk 2048] [--json]
"""

from __future__ import annotations

import argparse
import json


def _pairs(lo: int, hi: int) -> int:
    """sum_{t=lo}^{hi-1} (t + 1): causal pairs of queries [lo, hi)."""
    return (hi * (hi + 1) - lo * (lo + 1)) // 2


def _attended(lo: int, hi: int, k: int) -> int:
    """sum_{t=lo}^{hi-1} min(t + 1, k)."""
    ramp_end = min(max(lo, k), hi)  # queries t < k see t + 1 keys
    return _pairs(lo, ramp_end) + (hi - ramp_end) * k


def ranges(layout: str, seq_len: int, devices: int) -> list[list[tuple[int, int]]]:
    """Token ranges each device holds."""
    if layout == "contiguous":
        if seq_len % devices:
            raise ValueError(f"seq_len {seq_len} is not divisible by {devices} devices")
        c = seq_len // devices
        return [[(i * c, (i + 1) * c)] for i in range(devices)]
    if layout == "zigzag":
        if seq_len % (2 * devices):
            raise ValueError(f"seq_len {seq_len} is not divisible by 2 x {devices} chunks")
        c = seq_len // (2 * devices)
        return [[(i * c, (i + 1) * c), ((2 * devices - 1 - i) * c, (2 * devices - i) * c)] for i in range(devices)]
    raise ValueError(f"unknown layout {layout!r}")


def balance(seq_len: int, devices: int, index_topk: int) -> dict:
    out = {"seq_len": seq_len, "devices": devices, "index_topk": index_topk, "layouts": {}}
    for layout in ("contiguous", "zigzag"):
        parts = ranges(layout, seq_len, devices)
        work = {"indexer_pairs": [sum(_pairs(lo, hi) for lo, hi in p) for p in parts],
                "attention_keys": [sum(_attended(lo, hi, index_topk) for lo, hi in p) for p in parts]}
        out["layouts"][layout] = {
            name: {"max": max(v), "min": min(v), "mean": sum(v) / len(v), "imbalance": max(v) / (sum(v) / len(v))}
            for name, v in work.items()}
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq_len", type=int, default=2_097_152)
    parser.add_argument("--devices", type=int, default=32)
    parser.add_argument("--index_topk", type=int, default=2048)
    parser.add_argument("--json", action="store_true")
    a = parser.parse_args()
    report = balance(a.seq_len, a.devices, a.index_topk)
    if a.json:
        print(json.dumps(report, indent=1))
        return
    print(f"Causal load balance, S={a.seq_len:,}, {a.devices} devices, index_topk={a.index_topk}\n")
    print("| layout | work | max / mean | min / mean |\n|---|---|---|---|")
    for layout, works in report["layouts"].items():
        for name, w in works.items():
            print(f"| {layout} | {name} | {w['imbalance']:.4f} | {w['min'] / w['mean']:.4f} |")


if __name__ == "__main__":
    main()
