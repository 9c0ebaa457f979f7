"""Pictures of a `python -m benchmarks.run` results JSON: time and peak memory against length.

    python -m benchmarks.figures benchmarks/results/run.json [OUT.png]   # default OUT: the JSON's path, .png

One row of two panels (seconds, memory; log-log) per section the results hold:
  a  forward: ours (JAX, jitted) vs HF transformers eager, against the sequence length L
  b  GRPO train step, one line per gradient mode, against the prompt length P
Memory panels: peak RSS of the row's process (solid) and the RSS the measured call added (dashed; `run.py`
resets the peak after compiling). A row stopped by the memory cap or the time limit is an x on that limit's
line. Legend labels carry section d's growth exponents (slope of log memory vs log L) when the results have it.
`python -m benchmarks.run` draws its results this way at the end when matplotlib (the `plots` extra) is there.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any, NamedTuple

from glm52_jax.plan.figure import PLOTS_HINT, matplotlib_missing


class Curve(NamedTuple):
    """One benchmarked computation's finished rows (sorted by length) and the lengths where it was stopped."""

    name: str  # section d's name for it: forward_ours / forward_hf / a gradient mode
    label: str
    lengths: list[int]
    seconds: list[float]
    peak_rss_mib: list[float]
    rss_growth_mib: list[float]
    stopped: list[tuple[int, str]]  # (length, status) of rows that did not finish: "over cap" / "over time" / ...


class BenchFigure(NamedTuple):
    figure: Any  # matplotlib.figure.Figure
    axes: dict  # (section, "seconds" | "memory") -> Axes
    lines: dict  # (section, curve name, "seconds" | "peak_rss_mib" | "rss_growth_mib") -> Line2D


def _curve(name: str, label: str, rows: list[dict], length_key: str, seconds_key: str) -> Curve:
    done = sorted((r for r in rows if r["status"] == "ok"), key=lambda r: r["task"][length_key])
    return Curve(name, label, [r["task"][length_key] for r in done], [r[seconds_key] for r in done],
                 [r["peak_rss_mib"] for r in done], [r["rss_growth_mib"] for r in done],
                 sorted((r["task"][length_key], r["status"]) for r in rows if r["status"] != "ok"))


def curves(results: dict[str, Any]) -> dict[str, list[Curve]]:
    """section ("a", "b") -> its curves, for the sections `results` holds."""
    sections, out = results["sections"], {}
    if "a" in sections:
        sides = sections["a"]["sides"]
        out["a"] = [_curve("forward_ours", "ours (JAX, jitted)", sides["ours"]["rows"], "seq_len", "seconds"),
                    _curve("forward_hf", "HF transformers (torch eager)", sides["hf"]["rows"], "seq_len", "seconds")]
    if "b" in sections:
        rows = sections["b"]["rows"]
        modes = list(dict.fromkeys(r["task"]["mode"] for r in rows))
        out["b"] = [_curve(m, m, [r for r in rows if r["task"]["mode"] == m], "prompt_len", "step_seconds")
                    for m in modes]
    return out


def _label(curve: Curve, fits: dict[str, Any]) -> str:
    fit = fits.get(curve.name, {})
    slopes = [f"{what} {fit[key]:.2f}" for what, key in (("peak", "exponent_peak_rss_mib"),
                                                          ("added", "exponent_rss_growth_mib"))
              if fit.get(key) is not None]
    return curve.label + (f" (exponent: {', '.join(slopes)})" if slopes else "")


TITLES = {"a": ("a. forward, batch 1, f32", "sequence length L (tokens)"),
          "b": ("b. GRPO train step by gradient mode", "prompt length P (tokens)")}


def draw(results: dict[str, Any]) -> BenchFigure:
    """The figure of `results` (nothing written)."""
    from matplotlib.figure import Figure

    by_section = curves(results)
    if not by_section:
        raise ValueError("benchmarks.figures: the results hold neither section a nor b (nothing to draw)")
    settings = results.get("settings", {})
    cap_mib = settings["mem_cap_gib"] * 1024 if settings.get("mem_cap_gib") else None
    limit_s = settings.get("max_row_seconds")
    fits = results["sections"].get("d", {}).get("fits", {})
    fig = Figure(figsize=(12, 4.2 * len(by_section) + 0.8), dpi=80, layout="constrained")
    grid = fig.subplots(len(by_section), 2, squeeze=False)
    axes, lines = {}, {}
    for (section, section_curves), (ax_time, ax_mem) in zip(by_section.items(), grid):
        title, xlabel = TITLES[section]
        if section == "b":
            title += f" (R={settings.get('response_len')}, G={settings.get('group')})"
        axes[(section, "seconds")], axes[(section, "memory")] = ax_time, ax_mem
        for i, c in enumerate(section_curves):
            colour = f"C{i}"
            lines[(section, c.name, "seconds")], = ax_time.plot(c.lengths, c.seconds, "o-", color=colour,
                                                                label=c.label)
            lines[(section, c.name, "peak_rss_mib")], = ax_mem.plot(c.lengths, c.peak_rss_mib, "o-", color=colour,
                                                                    label=_label(c, fits))
            lines[(section, c.name, "rss_growth_mib")], = ax_mem.plot(c.lengths, c.rss_growth_mib, "s--",
                                                                      color=colour, alpha=0.6, markersize=4)
            for length, status in c.stopped:  # a stopped row: an x on the limit that stopped it
                on_time = status == "over time"
                ax, y = (ax_time, limit_s) if on_time else (ax_mem, cap_mib)
                if y:
                    ax.plot([length], [y], "x", color=colour, markersize=10, markeredgewidth=2)
                    ax.annotate(f"{c.name}: {status} at {length:,}", (length, y), textcoords="offset points",
                                xytext=(-10, -14), ha="right", fontsize=8, color=colour)
        if cap_mib:
            ax_mem.axhline(cap_mib, color="grey", linestyle=":", label=f"memory cap {settings['mem_cap_gib']:g} GiB")
        for ax, ylabel, what in ((ax_time, "seconds per call", "time"),
                                 (ax_mem, "MiB: peak RSS (solid), added by the call (dashed)", "memory")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.set_title(f"{title}: {what}", fontsize=10)
            ax.grid(True, which="major", alpha=0.3)
            ax.legend(fontsize=7, loc="best")
    machine = results.get("machine", {})
    fig.suptitle(f"`{machine.get('command', 'python -m benchmarks.run')}` on {machine.get('cpu_count', '?')} CPUs, "
                 f"{machine.get('date', '')}\n" + "\n".join(textwrap.wrap(
                     f"bench model: {results.get('config_summary', '')}", 150)), fontsize=9)
    return BenchFigure(fig, axes, lines)


def write(results: dict[str, Any], path: str | Path) -> BenchFigure:
    """Draws `results` and saves it as a PNG at `path`."""
    drawn = draw(results)
    drawn.figure.savefig(path, format="png", pil_kwargs={"optimize": True})
    return drawn


def write_or_explain(results: dict[str, Any], path: str | Path) -> str:
    """Writes the PNG when matplotlib is there and the results have a section to draw; returns what happened."""
    if matplotlib_missing():
        return f"No picture: matplotlib is not installed ({PLOTS_HINT})."
    if not curves(results):
        return "No picture: no section a or b in these results."
    write(results, path)
    return f"Drew {path}."


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: python -m benchmarks.figures RESULTS.json [OUT.png]", file=sys.stderr)
        return 2
    if matplotlib_missing():
        print(f"error: matplotlib is not installed ({PLOTS_HINT})", file=sys.stderr)
        return 1
    source = Path(argv[0])
    out = Path(argv[1]) if len(argv) == 2 else source.with_suffix(".png")
    write(json.loads(source.read_text()), out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
