"""The markdown report of a `python -m benchmarks.run` results JSON (printed at the end of a run)."""

from __future__ import annotations

from benchmarks.bench_sections import FLOPS_NOTE, PARITY_NOTE, _fmt


def report(res: dict) -> str:
    lines = []
    out = lines.append
    m = res["machine"]
    out(f"Bench model: {res['config_summary']}")
    out(f"Machine: {m['cpu_count']} CPUs, {m['platform']}; jax {m['jax']}, torch {m['torch']}, "
        f"transformers {m['transformers']}; {m['date']}; `{m['command']}`")
    out(f"Memory cap {res['settings']['mem_cap_gib']} GiB per row, "
        f"time limit {res['settings']['max_row_seconds']} s per row.")
    out("")
    sec = res["sections"]
    if "a" in sec:
        a = sec["a"]
        out("### a. Forward: ours (JAX, jitted, f32) vs HF eager (torch CPU, f32, batch 1)")
        out("")
        if a["parity"]:
            out("Same weights (ours -> `save_pretrained` -> HF `from_pretrained`), logits compared:")
            out("")
            out("| L | max abs logit diff | positions within 1e-4 | first position over 1e-4 | logit std "
                "| argmax agreement |")
            out("|---|---|---|---|---|---|")
            for p in a["parity"]:
                out(f"| {p['seq_len']:,} | {p['max_abs_diff']:.2e} | {p['positions_within_1e-4']:.4f} | "
                    f"{_fmt(p['first_position_over_1e-4'])} | {p['logit_std']:.3g} | {p['argmax_agreement']:.4f} |")
            out("")
            out(PARITY_NOTE)
            out("")
        out("| L | ours s | ours tok/s | ours compile s | ours peak RSS MiB | ours XLA temp MiB | HF s | HF tok/s | "
            "HF peak RSS MiB | HF/ours time | HF/ours RSS |")
        out("|---|---|---|---|---|---|---|---|---|---|---|")
        by = {side: {r["task"]["seq_len"]: r for r in a["sides"][side]["rows"]} for side in ("ours", "hf")}
        for r in a["ratios"]:
            n = r["seq_len"]
            o, h = by["ours"].get(n), by["hf"].get(n)

            def cell(row, key, digits=3):
                if row is None:
                    return "-"
                if row["status"] != "ok":
                    return row["status"] if key in ("seconds",) else "-"
                return _fmt(row.get(key), digits)
            out(f"| {n:,} | {cell(o, 'seconds')} | {cell(o, 'tokens_per_second', 4)} | {cell(o, 'compile_seconds')} | "
                f"{cell(o, 'peak_rss_mib', 4)} | {cell(o, 'xla_temp_mib', 4)} | {cell(h, 'seconds')} | "
                f"{cell(h, 'tokens_per_second', 4)} | {cell(h, 'peak_rss_mib', 4)} | "
                f"{_fmt(r['hf_over_ours_seconds'])} | {_fmt(r['hf_over_ours_peak_rss'])} |")
        out("")
        out(f"Longest L completed: ours {a['longest_ours']} "
            f"(stopped: {a['sides']['ours']['stopped_by'] or 'end of list'}), "
            f"HF {a['longest_hf']} (stopped: {a['sides']['hf']['stopped_by'] or 'end of list'}).")
        out("")
        _targets(out, a["targets"])
    if "b" in sec:
        b = sec["b"]
        out("### b. GRPO train step by gradient mode (R={}, G={}, rank-8 LoRA, f32)".format(
            res["settings"]["response_len"], res["settings"]["group"]))
        out("")
        out("| P | mode | step s | compile s | XLA temp MiB | peak RSS MiB | RSS growth MiB |")
        out("|---|---|---|---|---|---|---|")
        for r in b["rows"]:
            ok = r["status"] == "ok"
            step = _fmt(r.get('step_seconds')) if ok else r['status']
            out(f"| {r['task']['prompt_len']:,} | {r['task']['mode']} | {step} | "
                f"{_fmt(r.get('compile_seconds'))} | {_fmt(r.get('xla_temp_mib'), 4)} | "
                f"{_fmt(r.get('peak_rss_mib'), 4)} | "
                f"{_fmt(r.get('rss_growth_mib'), 4)} |")
        out("")
        out("| P | conventional / response_only (own prefill) | conventional / response_only (sampler cache) | "
            "shared_prefix / conventional | max log-prob diff across modes | max loss diff |")
        out("|---|---|---|---|---|---|")
        for r in b["ratios"]:
            out(f"| {r['prompt_len']:,} | {_fmt(r['conventional_over_response_only'])} | "
                f"{_fmt(r['conventional_over_response_only_sampler_cache'])} | "
                f"{_fmt(r['shared_prefix_over_conventional'])} | "
                f"{_fmt(r['max_logprob_diff_across_modes'])} | {_fmt(r['max_loss_diff_across_modes'])} |")
        out("")
        _targets(out, b["targets"])
    if "c" in sec:
        c = sec["c"]["row"]
        out("### c. Prefix-cached vs first candidate (G=2, 8 new tokens)")
        out("")
        if c["status"] == "ok":
            out("| candidate | total s | prefill s | prompt tokens reused |")
            out("|---|---|---|---|")
            out(f"| first (cold), {c['prompt_tokens']:,} tokens | {c['first']['seconds']:.3g} | "
                f"{c['first']['prefill_seconds']:.3g} | {c['first']['prefix_hit_tokens']:,} |")
            out(f"| second (prefix cache) | {c['second']['seconds']:.3g} | {c['second']['prefill_seconds']:.3g} | "
                f"{c['second']['prefix_hit_tokens']:,} |")
            prefill_ratio = c['first']['prefill_seconds'] / c['second']['prefill_seconds']
            out(f"| **ratio** | **{c['speedup']:.3g}x** | {prefill_ratio:.3g}x | |")
        else:
            out(f"status: {c['status']}")
        out("")
        _targets(out, sec["c"]["targets"])
    if "d" in sec:
        d = sec["d"]
        out("### d. Peak-memory growth exponent (slope of log memory vs log L, least squares)")
        out("")
        out("| computation | lengths | XLA temp exponent | RSS growth exponent | peak RSS exponent |")
        out("|---|---|---|---|---|")
        for name, f in d["fits"].items():
            out(f"| {name} | {', '.join(str(x) for x in f['lengths'])} | {_fmt(f.get('exponent_xla_temp_mib'))} | "
                f"{_fmt(f.get('exponent_rss_growth_mib'))} | {_fmt(f.get('exponent_peak_rss_mib'))} |")
        out("")
        out("XLA temp = `compiled.memory_analysis().temp_size_in_bytes`; RSS growth = the row's peak RSS during the "
            "measured call minus its RSS just before it (peak reset after compiling); peak RSS includes the "
            "runtime, weights and compiler, so its exponent is diluted by fixed costs at short L.")
        out("")
        _targets(out, d["targets"])
    if "e" in sec:
        e = sec["e"]["row"]
        out(f"### e. One decoder layer's FLOPs: XLA cost_analysis vs analytic (L={e['task']['seq_len']})")
        out("")
        if e["status"] == "ok":
            out("| layer | XLA (one block per loop) | XLA (default blocks) | analytic ideal | analytic as compiled | "
                "XLA / ideal | XLA / as compiled |")
            out("|---|---|---|---|---|---|---|")
            for kind, r in e["layers"].items():
                out(f"| {kind} MLP, full indexer | {r['xla_flops_one_block']:.4e} | "
                    f"{r['xla_flops_default_blocks']:.4e} | "
                    f"{r['ideal_total']:.4e} | {r['as_compiled_total']:.4e} | {r['xla_over_ideal']:.3f} | "
                    f"{r['xla_over_as_compiled']:.3f} |")
            out("")
            out("| component | " + " | ".join(f"{k} ideal | {k} as compiled" for k in e["layers"]) + " |")
            out("|---|" + "---|---|" * len(e["layers"]))
            names = list(dict.fromkeys(n for r in e["layers"].values() for n in r["ideal"]))
            for n in names:
                cells = []
                for r in e["layers"].values():
                    cells += [_fmt(r["ideal"].get(n), 4), _fmt(r["as_compiled"].get(n), 4)]
                out(f"| {n} | " + " | ".join(cells) + " |")
        else:
            out(f"status: {e['status']}")
        out("")
        out(FLOPS_NOTE)
        out("")
    return "\n".join(lines)


def _targets(out, targets: dict) -> None:
    for t in targets.values():
        out(f"- {t['target']}: {_fmt(t['value'])} -> **{t['verdict']}**")
    out("")
