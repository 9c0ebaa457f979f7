"""Calibrate the time estimate on a GPU: time the probes, write a new efficiency table, compare estimate and time.

    python -m glm52_jax.plan.calibrate measure --out DIR [--budget 420] [--smoke]
    python -m glm52_jax.plan.calibrate table --measurements DIR/measurements.json --out DIR/efficiency_table.json \\
        [--compare DIR/comparison.json] [--base TABLE]

`measure` (on the GPU; scripts/gpu_check.sh runs it) times every probe of `probes.calibration_probes` (compile and
one warm-up excluded, best and median of a few runs) and writes DIR/measurements.json: the device, its memory
(nvidia-smi), jax's version, the date, the command and one row per probe. A probe that fails or does not fit the
time budget is recorded as such; the others still run.

`table` turns a measurements file into an efficiency table (the format `efficiency.load_table` reads; start from
`--base`, default the packaged table): for the measured device's target (h200, h20, h100, ...), each probe's class
gets the fraction that makes this estimate reproduce its measured time (`fit_fraction`: the class's share of the
probe's estimate scaled by measured over estimated time; central from the median run, optimistic from the best),
the launch floor comes from the launch probe, the memory from nvidia-smi; every changed entry is "measured" with
its provenance. A measured H200 also re-derives the H20's kernel fractions (`derive_h20`). With `--compare`, every
probe (the whole-model forwards too) is estimated with the new table and set against its measured time.
Estimates compile the probe for this process's GPU, or deviceless for the target without one.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from glm52_jax.plan import efficiency
from glm52_jax.plan.efficiency import SCENARIOS, Table, check_table, load_table

# Datasheet peaks of the GPUs a calibration may run on (a target missing from the base table starts from these).
DATASHEETS = {
    "h100": {"device": "NVIDIA H100 SXM (80 GB HBM3, sm_90a, 132 SMs)", "bf16_flops_per_s": 989.5e12,
             "fp8_flops_per_s": 1979e12, "hbm_bytes_per_s": 3.35e12, "nvlink_bytes_per_s": 450e9,
             "network_bytes_per_s": 50e9, "device_memory_bytes": 85520809984, "sms": 132},
    "h200": {"device": "NVIDIA H200 (141 GB HBM3e, sm_90a, 132 SMs)", "bf16_flops_per_s": 989.5e12,
             "fp8_flops_per_s": 1979e12, "hbm_bytes_per_s": 4.8e12, "nvlink_bytes_per_s": 450e9,
             "network_bytes_per_s": 50e9, "device_memory_bytes": 150754820096, "sms": 132},
    "h20": {"device": "NVIDIA H20 (96 GB HBM3, sm_90a, 78 SMs)", "bf16_flops_per_s": 148e12,
            "fp8_flops_per_s": 296e12, "hbm_bytes_per_s": 4.0e12, "nvlink_bytes_per_s": 450e9,
            "network_bytes_per_s": 25e9, "device_memory_bytes": 102046367744, "sms": 78},
}
# The probes whose class a calibration fits (the others, the whole-model forwards, are only compared).
FITTED = ("gemm", "dsa_index_scores", "dsa_topk_select", "sparse_mla_forward", "sparse_mla_backward",
          "grouped_matmul", "grouped_matmul_fp8")


def target_of(device_kind: str) -> str:
    """The table's target name of a device kind ("NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" -> "h100")."""
    words = device_kind.replace("NVIDIA", "").split()
    return words[0].lower() if words else "gpu"


# ------------------------------------------------------------------------------------------------
# measure (on the GPU)

def _device_memory_bytes() -> int | None:
    """nvidia-smi's memory.total of GPU 0, in bytes (None without nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True, check=False)
    try:
        return int(out.stdout.strip().splitlines()[0]) * 2 ** 20
    except (ValueError, IndexError):
        return None


def time_probe(probe, reps: int = 5) -> dict[str, Any]:
    """{compile_s, best_s, median_s} of one probe on this process's default device."""
    import jax

    fn, inputs = probe.make()
    args = jax.jit(inputs)(jax.random.key(0))
    jitted = jax.jit(fn)
    start = time.perf_counter()
    jax.block_until_ready(jitted(*args))
    first = time.perf_counter() - start
    times = []
    spent = time.perf_counter()
    while len(times) < 3 or (len(times) < reps and time.perf_counter() - spent < 3.0):  # >= 3 runs, <= 3 s more
        start = time.perf_counter()
        jax.block_until_ready(jitted(*args))
        times.append(time.perf_counter() - start)
    times.sort()
    return {"first_call_s": first, "best_s": times[0], "median_s": times[len(times) // 2], "runs": len(times)}


def measure(out: Path, budget_s: float = 420.0, smoke: bool = False, command: str = "") -> dict[str, Any]:
    """Times every calibration probe and writes out/measurements.json (rewritten after each probe)."""
    import jax

    from glm52_jax.plan.probes import calibration_probes, useful_rate

    out.mkdir(parents=True, exist_ok=True)
    device = jax.devices()[0]
    record = {"format": 1, "device": device.device_kind, "platform": device.platform,
              "device_memory_bytes": _device_memory_bytes(), "jax": jax.__version__,
              "date": datetime.date.today().isoformat(), "command": command, "smoke": smoke, "probes": []}
    deadline = time.time() + budget_s
    for probe in calibration_probes(smoke):
        row = {"name": probe.name, "measures": probe.measures, "flops": probe.flops, "bytes": probe.bytes,
               "meta": probe.meta}
        if time.time() > deadline:
            row["skipped"] = "time budget"
        else:
            try:
                row.update(time_probe(probe))
                row["useful_rate_median"] = useful_rate(probe, row["median_s"])
            except Exception as err:  # noqa: BLE001 - recorded; the next probe still runs
                row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        record["probes"].append(row)
        print(f"calibrate: {probe.name}: " + (f"{row['median_s'] * 1e3:.3f} ms (best {row['best_s'] * 1e3:.3f})"
                                              if "median_s" in row else row.get("error") or row.get("skipped")),
              flush=True)
        (out / "measurements.json").write_text(json.dumps(record, indent=1))
    return record


# ------------------------------------------------------------------------------------------------
# table (anywhere)

def _probe_by_name(name: str, meta: dict[str, Any]):
    """The probe a measurement row names, rebuilt at its recorded shapes."""
    from glm52_jax.plan import probes

    builders = {
        "gemm": lambda: probes.gemm(meta["n"]),
        "dsa_index_scores": lambda: probes.index_scores(meta["queries"], meta["keys"], meta["heads"], meta["dim"]),
        "dsa_topk_select": lambda: probes.topk_select(meta["rows"], meta["block"], meta["topk"]),
        "sparse_mla_forward": lambda: probes.sparse_mla(*(meta[k] for k in ("queries", "keys", "heads", "latent",
                                                                             "rope", "topk"))),
        "sparse_mla_forward_backward": lambda: probes.sparse_mla(
            *(meta[k] for k in ("queries", "keys", "heads", "latent", "rope", "topk")), backward=True),
        "grouped_matmul": lambda: probes.grouped_matmul(meta["rows"], meta["experts"], meta["k"], meta["n"],
                                                        meta.get("fp8", False), meta.get("w8a8", False)),
        "launch_loop": lambda: probes.launch_loop(meta["iterations"]),
        "forward": lambda: probes.forward(meta["tokens"], meta["kernels"], meta.get("hf_config")),
    }
    for prefix in sorted(builders, key=len, reverse=True):  # the longest name first: sparse_mla_forward_backward
        if name == prefix or name.startswith(prefix + "_"):
            return builders[prefix]()
    raise ValueError(f"calibrate: unknown probe {name!r}")


_COMPILED: dict[tuple[str, str, str], Any] = {}  # (probe, its shapes, target) -> kernel_cost.Program


def estimate_probe(probe, table: Table, target: str) -> dict[str, Any]:
    """The three-scenario estimate of a probe (`estimate.compile_program` once per probe and target, then
    `kernel_cost.estimate_program` with `table`: fitting and comparing re-estimate without recompiling)."""
    from glm52_jax.model.loop_scopes import PASS_LOOP
    from glm52_jax.plan import kernel_cost
    from glm52_jax.plan.estimate import compile_program

    key = (probe.name, json.dumps(probe.meta, sort_keys=True, default=str), target)
    if key not in _COMPILED:
        fn, args = probe.abstract()
        _COMPILED[key] = compile_program(fn, *args, target=target)
    return kernel_cost.estimate_program(_COMPILED[key], table, target, probe.trips, PASS_LOOP)


def fit_fraction(fraction: float, class_s: float, other_s: float, measured_s: float) -> float | None:
    """The class fraction that makes an estimate of `class_s` (at `fraction`) + `other_s` equal `measured_s`, or
    None when the measurement leaves the class no time (the other kernels already take it)."""
    if measured_s <= other_s or class_s <= 0:
        return None
    return fraction * class_s / (measured_s - other_s)


def _provenance(record: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    return {"device": record["device"], "jax": record["jax"], "date": record["date"],
            "command": record.get("command") or "python -m glm52_jax.plan.calibrate measure",
            "input": f"probe {row['name']} {json.dumps(row['meta'], sort_keys=True)[:200]}, random normal data"}


def _new_target(raw: dict[str, Any], target: str) -> dict[str, Any]:
    """A target section for a GPU the base table lacks: its datasheet peaks, every other entry the H200's, marked
    derived."""
    sheet = DATASHEETS.get(target)
    if sheet is None:
        raise ValueError(f"calibrate: no datasheet for {target!r} (known: {', '.join(DATASHEETS)}); add one")
    section = copy.deepcopy(raw["targets"]["h200"])
    section["device"] = sheet["device"]
    section["derived_from"] = "h200"
    for key in efficiency.PEAKS:
        section["peaks"][key] = {"value": sheet[key], "source": "assumed", "how": f"{target} datasheet"}
    for group in ("classes", "launch", "collectives"):
        for entry in section[group].values():
            entry.update(source="derived", how="the H200's value (not measured on this GPU)")
            entry.pop("provenance", None)
    section["ep_passes"].update(source="derived", how="the H200's value")
    return section


def derive_h20(h200: dict[str, Any], h20: dict[str, Any]) -> None:
    """The H20's FLOP-class fractions from the H200's (in place): a kernel's H200 time splits into tensor-core
    time (its FLOPs at the H200 GEMM's fraction of peak) and the rest; on the H20 the tensor-core part runs at the
    H20's per-SM rate (148 TFLOP/s over 78 SMs: 3.95x slower per SM than 989.5 over 132) and the rest at the same
    per-SM speed, over 78 instead of 132 SMs. A GEMM keeps its fraction; a kernel far from peak (latency-bound)
    reaches a larger fraction of the H20's lower peak."""
    big, small = DATASHEETS["h200"], DATASHEETS["h20"]
    per_sm = (big["bf16_flops_per_s"] / big["sms"]) / (small["bf16_flops_per_s"] / small["sms"])
    sm_ratio = big["sms"] / small["sms"]
    for cls in efficiency.FLOP_CLASSES:
        src, dst = h200["classes"][cls], h20["classes"][cls]
        for scenario in SCENARIOS:
            # FP8 tensor-core classes against the FP8 GEMM (both run at twice bf16's peak)
            gemm = h200["classes"]["gemm_fp8" if cls.endswith("fp8") else "gemm"][scenario]
            share = min(1.0, src[scenario] / gemm)  # of the kernel's time, the tensor cores' at the GEMM's rate
            slowdown = sm_ratio * (share * per_sm + (1.0 - share))
            rate = src[scenario] * big["bf16_flops_per_s"] / slowdown
            dst[scenario] = round(rate / small["bf16_flops_per_s"], 4)
        dst.update(source="derived", how=f"from the H200's {src['central']:.4g} (central): tensor-core share at "
                   f"the H200 GEMM's rate, {per_sm:.2f}x slower per SM on the H20, the rest at the same per-SM "
                   f"speed, {small['sms']} vs {big['sms']} SMs (calibrate.derive_h20)")
        dst.pop("provenance", None)


def build_table(record: dict[str, Any], base: Table) -> tuple[dict[str, Any], list[str]]:
    """(a new table's JSON, what changed) from a measurements record: see the module docstring."""
    raw = copy.deepcopy(dict(base.raw))
    target = target_of(record["device"])
    if target not in raw["targets"]:
        raw["targets"][target] = _new_target(raw, target)
    section = raw["targets"][target]
    rows = {r["name"]: r for r in record["probes"] if "median_s" in r}
    notes = []
    if record.get("device_memory_bytes"):
        section["peaks"]["device_memory_bytes"] = {
            "value": int(record["device_memory_bytes"]), "source": "measured", "how": "nvidia-smi memory.total",
            "provenance": {**_provenance(record, {"name": "nvidia-smi", "meta": {}}), "input": "-"}}
        notes.append(f"device memory {record['device_memory_bytes']:,} B")
    current = check_table(raw, "(calibrating)")
    for name, row in rows.items():
        if row["measures"] not in FITTED:
            continue
        probe = _probe_by_name(name, row["meta"])
        est = estimate_probe(probe, current, target)
        cls = probe.measures
        class_s = est["breakdown"]["classes"].get(cls, {}).get("seconds", 0.0)  # the central estimate's split
        other_s = est["central_s"] - class_s
        fraction = current.rates(target).fractions[cls]
        fitted = {scenario: fit_fraction(fraction, class_s, other_s, measured)
                  for scenario, measured in (("central", row["median_s"]), ("optimistic", row["best_s"]))}
        if fitted["central"] is None:
            notes.append(f"{name}: measured {row['median_s']:.4g} s leaves {cls} no time; entry kept")
            continue
        entry = section["classes"][cls]
        entry["central"] = round(fitted["central"], 4)
        entry["optimistic"] = round(max(fitted["optimistic"] or fitted["central"], fitted["central"]), 4)
        entry["pessimistic"] = round(min(entry["pessimistic"], entry["central"]), 4)
        entry.update(source="measured", how=f"calibration probe {name}: median {row['median_s']:.4g} s, best "
                     f"{row['best_s']:.4g} s; the fraction at which the estimate reproduces each (calibrate.py)",
                     provenance=_provenance(record, row))
        notes.append(f"{cls}: {entry['central']} of peak (probe {name}, {row['median_s'] * 1e3:.3f} ms)")
        current = check_table(raw, "(calibrating)")
    if "launch_loop" in rows:
        row = rows["launch_loop"]
        est = estimate_probe(_probe_by_name("launch_loop", row["meta"]), current, target)
        rates = current.rates(target)
        floor = (row["median_s"] - est["syncs"] * rates.sync_s) / max(est["launches"], 1)
        best = (row["best_s"] - est["syncs"] * rates.sync_s) / max(est["launches"], 1)
        if floor > 0:
            entry = section["launch"]["floor_s"]
            entry.update(central=floor, optimistic=min(best, floor), pessimistic=max(entry["pessimistic"], floor),
                         source="measured", provenance=_provenance(record, row),
                         how=f"calibration probe launch_loop: {row['median_s']:.4g} s over {est['launches']:,.0f} "
                             f"launches and {est['syncs']:,.0f} loop syncs")
            notes.append(f"launch floor {floor * 1e6:.2f} us")
    if target == "h200" and "h20" in raw["targets"]:
        derive_h20(section, raw["targets"]["h20"])
        notes.append("h20 kernel fractions re-derived from the h200's")
    raw["version"] = f"{target}-{record['date']}.calibrated"
    raw["about"] = base.raw["about"]
    check_table(raw, "(calibrated)")
    return raw, notes


def compare(record: dict[str, Any], table: Table) -> list[dict[str, Any]]:
    """Every measured probe's estimate with `table` against its measured (median) time."""
    target = target_of(record["device"])
    out = []
    for row in record["probes"]:
        if "median_s" not in row:
            continue
        est = estimate_probe(_probe_by_name(row["name"], row["meta"]), table, target)
        out.append({"name": row["name"], "measures": row["measures"], "measured_s": row["median_s"],
                    **{f"{s}_s": est[f"{s}_s"] for s in SCENARIOS}, "launches": est["launches"],
                    "central_over_measured": est["central_s"] / row["median_s"],
                    "within_band": est["optimistic_s"] <= row["median_s"] <= est["pessimistic_s"]})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m glm52_jax.plan.calibrate", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="time the probes on this GPU")
    m.add_argument("--out", required=True)
    m.add_argument("--budget", type=float, default=420.0, help="seconds for all probes")
    m.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU check of the script)")
    t = sub.add_parser("table", help="a new efficiency table from a measurements file")
    t.add_argument("--measurements", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--base", default=None, help="the table to start from (default: the packaged one)")
    t.add_argument("--compare", default=None, help="also write estimate vs measured for every probe here")
    args = parser.parse_args(argv)
    if args.command == "measure":
        measure(Path(args.out), args.budget, args.smoke, command=" ".join(["python -m glm52_jax.plan.calibrate",
                                                                            *(argv or sys.argv[1:])]))
        return 0
    try:
        record = json.loads(Path(args.measurements).read_text())
        base = load_table(args.base)
    except (OSError, json.JSONDecodeError, efficiency.TableError) as err:
        print(f"calibrate error: {err}", file=sys.stderr)
        return 2
    if record.get("format") != 1 or not isinstance(record.get("probes"), list):
        print(f"calibrate error: {args.measurements}: not a measurements file (format 1 with probes)", file=sys.stderr)
        return 2
    raw, notes = build_table(record, base)
    Path(args.out).write_text(json.dumps(raw, indent=1) + "\n")
    for note in notes:
        print(f"calibrate: {note}")
    print(f"calibrate: wrote {args.out} (version {raw['version']})")
    if args.compare:
        rows = compare(record, check_table(raw, args.out))
        Path(args.compare).write_text(json.dumps(rows, indent=1) + "\n")
        for r in rows:
            print(f"calibrate: {r['name']:<32} measured {r['measured_s']:.4g} s, estimate {r['central_s']:.4g} s "
                  f"({r['optimistic_s']:.4g}-{r['pessimistic_s']:.4g}), ratio {r['central_over_measured']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
