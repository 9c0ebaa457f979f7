"""The sections a-e of `python -m benchmarks.run`: which tasks each runs, and the targets it judges."""

from __future__ import annotations

import math
import os

from benchmarks.bench_runner import fit_exponent
from benchmarks.bench_tasks import MODES


def forward_side(run, side: str, base_lengths: list[int], double: bool, max_len: int, max_row_seconds: float,
                 ckpt: str, workdir: str, parity_max_len: int) -> dict:
    """Rows for one side: the base lengths, then doubling; on a failure, one try at the midpoint."""
    rows: dict[int, dict] = {}
    stop = None

    def go(seq_len):
        task = {"kind": f"forward_{side}", "seq_len": seq_len, "ckpt": ckpt}
        logits = os.path.join(workdir, f"ours_logits_{seq_len}.npy")
        if seq_len <= parity_max_len and (side == "ours" or os.path.exists(logits)):
            task["save_logits" if side == "ours" else "compare_logits"] = logits
            task["user_numerics"] = True  # compared with HF: no --quick compile flags
        rows[seq_len] = run(task)
        return rows[seq_len]["status"] == "ok"

    def ok_lengths():
        return sorted(n for n, r in rows.items() if r["status"] == "ok")

    for seq_len in base_lengths:
        if not go(seq_len):
            stop = f"{rows[seq_len]['status']} at L={seq_len}"
            break
    else:
        seq_len = base_lengths[-1]
        while double:
            nxt = seq_len * 2
            ok = ok_lengths()
            last = rows[ok[-1]]
            if len(ok) >= 2:
                prev = rows[ok[-2]]
                growth = max(2.0, (last["seconds"] / prev["seconds"]) ** (math.log(2) / math.log(ok[-1] / ok[-2])))
            else:
                growth = 4.0
            predicted = last["wall_seconds"] - last["seconds"] + last["seconds"] * growth
            if nxt > max_len:
                stop = f"--forward_max_len {max_len} reached"
                break
            if predicted > max_row_seconds:
                stop = f"L={nxt} predicted {predicted:.0f} s > --max_row_seconds {max_row_seconds:g}"
                break
            if not go(nxt):
                stop = f"{rows[nxt]['status']} at L={nxt}"
                break
            seq_len = nxt
    ok = ok_lengths()
    failed = [n for n, r in rows.items() if r["status"] != "ok"]
    if failed and ok:
        mid = int(2 ** ((math.log2(ok[-1]) + math.log2(min(f for f in failed if f > ok[-1]))) / 2))
        mid = mid // 256 * 256
        if ok[-1] < mid < min(failed) and mid not in rows:
            go(mid)
    ok = ok_lengths()
    return {"rows": [rows[n] for n in sorted(rows)], "longest_ok": ok[-1] if ok else None, "stopped_by": stop}


FLOPS_NOTE = (
    "One decoder layer (full indexer), forward only, jitted alone (no scan over layers). 'One block per loop' "
    "sets the indexer's query/key blocks and the attention's query block to L, so every lax.map / fori_loop "
    "runs one trip and XLA's count (loop bodies counted once) covers all the work; with the default blocks it "
    "undercounts. Analytic 'ideal' = roofline.py's GEMM count (causal indexer pairs, min(t, K) keys per "
    "query, routed experts on the top-k only); 'as compiled' = the same formulas for what the CPU program "
    "executes: the indexer scores the full [L, L] square (2x the causal pairs), attention runs over all K "
    "slots of every query, and lax.ragged_dot lowers densely over all E experts on XLA:CPU (E = 16 x the "
    "routed FLOPs). The remaining ~1-2% is elementwise work XLA counts and the analytic model does not "
    "(norms, RoPE, softmax, ReLU and head weighting, SwiGLU, routing).")
PARITY_MAX_LEN = 1024  # logits compared at every forward length up to this
PARITY_NOTE = (
    "At L <= index_topk (256) every causal key is selected and the logits must agree. Beyond it the "
    "indexer picks 256 keys and a few selections differ from HF's from position 259 on (seen in the "
    "captured top-k sets of layer 0). Probable cause, not yet verified: with only 4 indexer heads a key "
    "whose q.k is negative in all 4 heads scores exactly 0 after the ReLU (~1 key in 16 on random "
    "weights); ours breaks ties by the lowest key index, torch.topk in no specified order.")


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "missed")


def _fmt(x, digits=3):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e5 else f"{x:.3e}"
    return str(x)


def section_a(run, s, ckpt, workdir) -> dict:
    sides = {side: forward_side(run, side, s["forward_lengths"], s["double"], s["forward_max_len"],
                                s["max_row_seconds"], ckpt, workdir, PARITY_MAX_LEN) for side in ("ours", "hf")}
    by_len = {side: {r["seq_len"] if "seq_len" in r else r["task"]["seq_len"]: r for r in v["rows"]}
              for side, v in sides.items()}
    parity = [r["parity"] for r in sides["hf"]["rows"] if r.get("parity")]
    ratios = []
    for n in sorted(set(by_len["ours"]) | set(by_len["hf"])):
        o, h = by_len["ours"].get(n), by_len["hf"].get(n)
        both = o and h and o["status"] == "ok" and h["status"] == "ok"
        ratios.append({"seq_len": n, "hf_over_ours_seconds": h["seconds"] / o["seconds"] if both else None,
                       "hf_over_ours_peak_rss": h["peak_rss_mib"] / o["peak_rss_mib"] if both else None})
    lo, lh = sides["ours"]["longest_ok"], sides["hf"]["longest_ok"]
    at_4k = next((r["hf_over_ours_seconds"] for r in ratios if r["seq_len"] == 4096), None)
    targets = {
        "forward_5x_at_4k": {"target": "HF/ours time >= 5x at L=4096", "value": at_4k,
                             "verdict": _verdict(None if at_4k is None else at_4k >= 5)},
        "longest_8x": {"target": "longest ours / longest HF >= 8x", "value": lo / lh if lo and lh else None,
                       "verdict": _verdict(None if not (lo and lh) else lo / lh >= 8)},
    }
    return {"sides": sides, "parity": parity, "ratios": ratios, "longest_ours": lo, "longest_hf": lh,
            "targets": targets}


def section_b(run, s) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    tasks = [{"kind": "grad", "mode": mode, "prompt_len": p, "response_len": s["response_len"], "group": s["group"]}
             for p in s["prompt_lengths"] for mode in MODES]
    with ThreadPoolExecutor(max_workers=len(tasks)) as pool:  # the runner caps children at s["jobs"]
        rows = list(pool.map(run, tasks))
    ratios = []
    for p in s["prompt_lengths"]:
        r = {m: next((x for x in rows if x["task"]["prompt_len"] == p and x["task"]["mode"] == m
                      and x["status"] == "ok"), None) for m in MODES}
        conv = r["conventional"]
        entry = {"prompt_len": p}
        for m in ("response_only", "response_only_sampler_cache"):
            entry[f"conventional_over_{m}"] = conv["step_seconds"] / r[m]["step_seconds"] if conv and r[m] else None
        entry["shared_prefix_over_conventional"] = (r["shared_prefix"]["step_seconds"] / conv["step_seconds"]
                                                    if conv and r["shared_prefix"] else None)
        logps = [x["logprobs"] for x in r.values() if x]
        entry["max_logprob_diff_across_modes"] = max(
            (abs(a - b) for lp in logps for ra, rb in zip(lp, logps[0]) for a, b in zip(ra, rb)), default=None)
        losses = [x["loss"] for x in r.values() if x]
        entry["max_loss_diff_across_modes"] = max(losses) - min(losses) if losses else None
        ratios.append(entry)
    top = ratios[-1] if ratios else {}
    at = top.get("prompt_len")
    note = "" if at == 32768 else f" (measured at P={at}; the target is at 32K)"
    targets = {}
    for m, label in (("response_only", "own prefill"), ("response_only_sampler_cache", "sampler cache")):
        v = top.get(f"conventional_over_{m}")
        targets[f"conv_over_{m}_10x"] = {"target": f"conventional/response_only ({label}) >= 10x at 32K{note}",
                                         "value": v, "verdict": _verdict(None if v is None else v >= 10)}
    v = top.get("shared_prefix_over_conventional")
    targets["shared_prefix_0.6"] = {"target": f"shared_prefix/conventional <= 0.6 at G={s['group']}{note}",
                                    "value": v, "verdict": _verdict(None if v is None else v <= 0.6)}
    return {"rows": rows, "ratios": ratios, "targets": targets}


def section_c(run, s) -> dict:
    row = run({"kind": "prefix", "prompt_tokens": s["prefix_tokens"], "chunk_size": s["prefix_chunk"],
               "max_new_tokens": 8})
    v = row.get("speedup") if row["status"] == "ok" else None
    note = "" if s["prefix_tokens"] == 16384 else f" (measured at {s['prefix_tokens']} tokens; the target is at 16K)"
    return {"row": row, "targets": {"second_20x": {"target": f"second candidate >= 20x faster at 16K{note}",
                                                   "value": v, "verdict": _verdict(None if v is None else v >= 20)}}}


def section_d(a: dict, b: dict) -> dict:
    fits = {}

    def add(name, rows, length_key, keys=("xla_temp_mib", "rss_growth_mib", "peak_rss_mib")):
        ok = [r for r in rows if r["status"] == "ok"]
        lengths = [r[length_key] for r in ok]
        fits[name] = {"lengths": lengths}
        for k in keys:
            vals = [r.get(k) for r in ok]
            fits[name][k] = vals
            fits[name][f"exponent_{k}"] = fit_exponent(lengths, vals)

    add("forward_ours", a["sides"]["ours"]["rows"], "seq_len")
    add("forward_hf", a["sides"]["hf"]["rows"], "seq_len", keys=("rss_growth_mib", "peak_rss_mib"))
    for m in MODES:
        add(m, [r for r in b["rows"] if r["task"]["mode"] == m], "prompt_len")
    targets = {}
    for name in ("forward_ours", "response_only", "response_only_sampler_cache"):
        for k in ("xla_temp_mib", "rss_growth_mib"):
            v = fits[name][f"exponent_{k}"]
            targets[f"{name}_{k}"] = {"target": f"{name} memory exponent ({k}) <= 1.1", "value": v,
                                      "verdict": _verdict(None if v is None else v <= 1.1)}
    return {"fits": fits, "targets": targets}


def section_e(run, s) -> dict:
    return {"row": run({"kind": "flops", "seq_len": s["flops_len"]})}
