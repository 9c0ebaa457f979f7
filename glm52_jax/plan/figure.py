"""Plan mode's picture: every planned program's per-device memory by category, against the budget and the device.

    python -m glm52_jax.plan.figure WORKDIR/plan.json [OUT.png]     # default OUT: plan_memory.png beside it

Reads only the report dict (`planner.plan`'s, or a saved plan.json), so it runs without JAX. The bars split
`total_bytes` (= argument + output + temp - alias, `measure.py`) into what the report can tell apart:

  weights      the frozen base weights + LoRA adapters per device (the report's static "model" section; every
               program takes the whole model state as an argument)
  cache_inputs the rest of the arguments: the KV / indexer caches, AdamW moments (train), token ids, h_last
  arguments    all arguments, when the report has no "model" section to split them by
  temporaries  XLA's scratch buffers (activations, gathered weight shards, the decode loop's carry)
  outputs      outputs that do not alias a donated input (a new cache, the updated LoRA, logits)

matplotlib is the `plots` extra; nothing here imports it before a picture is drawn.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

PLOTS_HINT = "pip install -e '.[plots]'"
FILE_NAME = "plan_memory.png"  # beside plan.json in the workdir

# category -> (legend text saying what it holds, colour); drawn left to right in this order
CATEGORIES = {
    "weights": ("weights: frozen base + LoRA adapters, as sharded on the mesh", "#4c72b0"),
    "cache_inputs": ("cache + inputs: KV/indexer caches, AdamW moments (train), ids (arguments - weights)", "#55a868"),
    "arguments": ("arguments: weights, caches, inputs (not split: no model section)", "#4c72b0"),
    "temporaries": ("temporaries: XLA scratch (activations, gathered weights, loop carries)", "#dd8452"),
    "outputs": ("outputs not aliased to a donated input (new cache, updated LoRA, log-probs)", "#8172b3"),
}
_UNITS = (("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("bytes", 1.0))
# A limit more than this many times the largest bar is left off the axis (named in the legend): on a scale
# that shows it, a small plan's bars (a CPU plan of the tiny model against the default 96 GiB) would be invisible.
_LIMIT_ON_AXIS = 3.0


class PlanFigure(NamedTuple):
    figure: Any  # matplotlib.figure.Figure
    axes: Any  # its one Axes
    bars: dict  # category -> BarContainer, one bar per program (widths in bytes, programs in report order)
    lines: dict  # "budget" / "device" -> the vertical Line2D (x in bytes)


def memory_segments(report: dict[str, Any]) -> dict[str, dict[str, float]]:
    """program -> {category: bytes per device}, in report order; each program's segments sum to its total_bytes.

    The weights come out of the arguments only when the model section exists and fits inside every program's
    arguments; otherwise the arguments stay one segment.
    """
    model = report.get("model") or {}
    weights = (model["param_bytes_per_device"] + model["lora_bytes_per_device"]
               if "param_bytes_per_device" in model and "lora_bytes_per_device" in model else None)
    memories = {name: p["memory"] for name, p in report["programs"].items()}
    split = weights is not None and all(weights <= m["argument_bytes"] for m in memories.values())
    segments = {}
    for name, m in memories.items():
        args = ({"weights": weights, "cache_inputs": m["argument_bytes"] - weights} if split
                else {"arguments": m["argument_bytes"]})
        segments[name] = {**args, "temporaries": m["temp_bytes"], "outputs": m["output_bytes"] - m["alias_bytes"]}
    return segments


def _limits(report: dict[str, Any]) -> tuple[float, float | None, str]:
    """(budget bytes, device bytes or None, the title's target words)."""
    target = report.get("target")
    if not target:  # an older report: only the verdict's limit
        return report["hbm_bytes"], None, "limit plan.hbm_gib"
    words = f"target {target['name']}" + (f", topology {target['topology']}" if target.get("topology") else "")
    device = target.get("device_memory_bytes")
    return target["budget_bytes"], (device if device and device != target["budget_bytes"] else None), words


def _unit(n: float) -> tuple[str, float]:
    """The largest unit (name, bytes) in which `n` bytes is at least 1."""
    return next((u, s) for u, s in _UNITS if n >= s or s == 1.0)


def _size(n: float) -> str:
    unit, scale = _unit(n)
    return f"{n / scale:.1f} {unit}"


def draw(report: dict[str, Any]) -> PlanFigure:
    """The figure of `report` (nothing written); bars in bytes, ticks labelled in the largest fitting unit."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    segments = memory_segments(report)
    names = list(segments)
    budget, device, target_words = _limits(report)
    totals = [report["programs"][n]["memory"]["total_bytes"] for n in names]
    limits = {"budget": budget, **({"device": device} if device else {})}
    on_axis = {k: v <= _LIMIT_ON_AXIS * max(totals) for k, v in limits.items()}
    largest = max([*totals, *(v for k, v in limits.items() if on_axis[k])])
    unit, scale = _unit(largest)

    fig = Figure(figsize=(11, 2.6 + 0.45 * len(names)), dpi=100, layout="constrained")
    ax = fig.subplots()
    rows = list(range(len(names)))
    left = [0.0] * len(names)
    bars = {}
    for category in dict.fromkeys(c for s in segments.values() for c in s):
        widths = [segments[n][category] for n in names]
        label, colour = CATEGORIES[category]
        bars[category] = ax.barh(rows, widths, left=left, height=0.6, color=colour, label=label)
        left = [a + b for a, b in zip(left, widths)]
    fraction = (report.get("target") or {}).get("memory_fraction")
    words = {"budget": [f"device x {fraction:.2f}"] if device and fraction else [], "device": []}
    styles = {"budget": dict(color="#c44e52", linestyle="--"), "device": dict(color="black", linestyle="-")}
    lines = {}
    for k, v in limits.items():
        notes = words[k] + ([] if on_axis[k] else ["beyond the axis"])
        label = f"{'budget' if k == 'budget' else 'device memory'} {_size(v)}" + (
            f" ({', '.join(notes)})" if notes else "")
        lines[k] = ax.axvline(v, linewidth=1.5, label=label, **styles[k])
    for row, total in zip(rows, totals):
        room = budget - total
        margin = f"{_size(room)} to budget" if room >= 0 else f"OVER budget by {_size(-room)}"
        ax.text(total, row, f"  {_size(total)}; {margin}", va="center", fontsize=8)
    ax.set_xlim(0, largest * 1.25)  # room for the totals' text
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / scale:g}"))
    ax.set_yticks(rows, names)
    ax.invert_yaxis()  # the report's first program on top
    ax.set_xlabel(f"{unit} per device (1 {unit} = 10^{len(str(int(scale))) - 1} bytes)" if scale > 1
                  else "bytes per device")
    mesh, shapes = report["mesh"], report.get("shapes")
    verdict = "fits" if report.get("fits") else "DOES NOT FIT"
    ax.set_title(f"Per-device memory by program: {target_words}, mesh {mesh['describe']} on {mesh['devices']} devices"
                 f" ({verdict})" + (f"\nP={shapes['prompt_tokens']} R={shapes['max_new_tokens']} "
                                    f"G={shapes['num_samples']} mode={shapes['gradient_mode']} dtype={shapes['dtype']}"
                                    if shapes else ""), fontsize=10)
    fig.legend(handles=[*bars.values(), *lines.values()], loc="outside lower center", ncols=2, fontsize=8,
               frameon=False)
    return PlanFigure(fig, ax, bars, lines)


def write(report: dict[str, Any], path: str | Path) -> PlanFigure:
    """Draws `report` and saves it as a PNG at `path`."""
    drawn = draw(report)
    drawn.figure.savefig(path, format="png", pil_kwargs={"optimize": True})
    return drawn


def matplotlib_missing() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return True
    return False


def write_or_explain(report: dict[str, Any], workdir: str | Path) -> str:
    """Writes WORKDIR/plan_memory.png when matplotlib is there; returns the log line saying what happened."""
    if matplotlib_missing():
        return f"plan: no {FILE_NAME}: matplotlib is not installed ({PLOTS_HINT})"
    path = Path(workdir) / FILE_NAME
    write(report, path)
    return f"plan: memory per program drawn in {path}"


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: python -m glm52_jax.plan.figure PLAN.json [OUT.png]", file=sys.stderr)
        return 2
    if matplotlib_missing():
        print(f"error: matplotlib is not installed ({PLOTS_HINT})", file=sys.stderr)
        return 1
    source = Path(argv[0])
    out = Path(argv[1]) if len(argv) == 2 else source.with_name(FILE_NAME)
    write(json.loads(source.read_text()), out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
