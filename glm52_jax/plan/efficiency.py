"""The efficiency table: what the per-kernel time estimate assumes of a GPU (pure Python, no JAX).

The table (`efficiency_table.json` beside this module, or a file `scripts/gpu_check.sh` wrote from a lent
GPU's measurements, `python -m glm52_jax.plan.calibrate`) gives, per target, the datasheet or measured peaks
and, for each kernel class, the fraction of peak reached in three scenarios (optimistic / central /
pessimistic), each entry with where it comes from. `load_table` checks it whole and `Table.rates(target,
scenario)` turns one scenario into the plain numbers `kernel_cost.estimate` divides by.

Classes: FLOP classes run at a fraction of the bf16 dense peak (`FLOP_CLASSES`); the others are
memory-bound and run at a fraction of the HBM bandwidth (`MEMORY_CLASSES`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SCENARIOS = ("optimistic", "central", "pessimistic")
FLOP_CLASSES = ("gemm", "gemm_fp8", "dsa_index_scores", "dsa_index_scores_fp8", "sparse_mla_forward",
                "sparse_mla_backward", "grouped_matmul", "grouped_matmul_fp8")
MEMORY_CLASSES = ("sparse_mla_segment_sum", "dsa_topk_select", "sort", "pallas_other", "memory")
CLASSES = FLOP_CLASSES + MEMORY_CLASSES
PEAKS = ("bf16_flops_per_s", "fp8_flops_per_s", "hbm_bytes_per_s", "nvlink_bytes_per_s", "network_bytes_per_s",
         "device_memory_bytes")
LAUNCH = ("floor_s", "sync_s")
COLLECTIVES = ("nvlink_fraction", "network_fraction", "nvlink_latency_s", "network_latency_s")
SOURCES = ("measured", "derived", "assumed")
DEFAULT_PATH = Path(__file__).with_name("efficiency_table.json")
# A file named here replaces the packaged table (what a calibration run wrote), e.g. for plan mode.
PATH_ENV = "GLM52_EFFICIENCY_TABLE"


class TableError(ValueError):
    """The efficiency table is malformed: the message names the file and the entry."""


@dataclasses.dataclass(frozen=True)
class Rates:
    """One scenario of one target, as plain numbers."""

    target: str
    scenario: str
    bf16_flops_per_s: float
    fp8_flops_per_s: float
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    network_bytes_per_s: float
    fractions: Mapping[str, float]  # class -> fraction of the bf16 peak (FLOP classes) or of HBM (memory classes)
    launch_floor_s: float
    sync_s: float
    nvlink_fraction: float
    network_fraction: float
    nvlink_latency_s: float
    network_latency_s: float
    ep_passes: int


@dataclasses.dataclass(frozen=True)
class Table:
    """A checked efficiency table: `raw` is the file's JSON, `path` where it came from."""

    raw: Mapping[str, Any]
    path: str

    @property
    def version(self) -> str:
        return self.raw["version"]

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(self.raw["targets"])

    def device_memory_bytes(self, target: str) -> int:
        return int(self._target(target)["peaks"]["device_memory_bytes"]["value"])

    def rates(self, target: str, scenario: str = "central") -> Rates:
        if scenario not in SCENARIOS:
            raise ValueError(f"efficiency: scenario must be one of {SCENARIOS}, got {scenario!r}")
        t = self._target(target)
        peaks = {k: float(t["peaks"][k]["value"]) for k in PEAKS if k != "device_memory_bytes"}
        return Rates(target=target, scenario=scenario, **peaks,
                     fractions={c: float(t["classes"][c][scenario]) for c in CLASSES},
                     launch_floor_s=float(t["launch"]["floor_s"][scenario]),
                     sync_s=float(t["launch"]["sync_s"][scenario]),
                     **{k: float(t["collectives"][k][scenario]) for k in COLLECTIVES},
                     ep_passes=int(t["ep_passes"][scenario]))

    def record(self, target: str) -> dict[str, Any]:
        """What a report keeps of the table: its version and path, and the target's entries."""
        return {"version": self.version, "path": self.path, "target": target, "entries": self._target(target)}

    def _target(self, target: str) -> Mapping[str, Any]:
        if target not in self.raw["targets"]:
            raise ValueError(f"efficiency table {self.path}: no target {target!r} (has {', '.join(self.targets)})")
        return self.raw["targets"][target]


def _check_entry(where: str, entry: Any, scenario_values: bool) -> None:
    if not isinstance(entry, Mapping):
        raise TableError(f"{where}: expected an object, got {type(entry).__name__}")
    if entry.get("source") not in SOURCES:
        raise TableError(f"{where}: 'source' must be one of {SOURCES}, got {entry.get('source')!r}")
    if not isinstance(entry.get("how"), str) or not entry["how"].strip():
        raise TableError(f"{where}: 'how' must say where the value comes from")
    if entry["source"] == "measured":
        prov = entry.get("provenance")
        missing = [k for k in ("device", "jax", "date", "command", "input") if not (prov or {}).get(k)]
        if missing:
            raise TableError(f"{where}: a measured entry needs provenance with {', '.join(missing)}")
    keys = SCENARIOS if scenario_values else ("value",)
    for key in keys:
        value = entry.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise TableError(f"{where}.{key}: expected a number >= 0, got {value!r}")
    if scenario_values and not entry["optimistic"] >= entry["central"] >= entry["pessimistic"] and \
            not entry["optimistic"] <= entry["central"] <= entry["pessimistic"]:
        raise TableError(f"{where}: central must lie between optimistic and pessimistic")


def check_table(raw: Any, path: str) -> Table:
    """`raw` (a parsed table file) checked whole; raises TableError naming the first bad entry."""
    if not isinstance(raw, Mapping) or raw.get("format") != 1:
        raise TableError(f"efficiency table {path}: expected an object with \"format\": 1")
    if not isinstance(raw.get("version"), str) or not raw["version"]:
        raise TableError(f"efficiency table {path}: 'version' must be a non-empty string")
    targets = raw.get("targets")
    if not isinstance(targets, Mapping) or not targets:
        raise TableError(f"efficiency table {path}: 'targets' must name at least one GPU")
    for name, t in targets.items():
        where = f"efficiency table {path}: targets.{name}"
        if not isinstance(t, Mapping):
            raise TableError(f"{where}: expected an object")
        sections = (("peaks", PEAKS, False), ("classes", CLASSES, True), ("launch", LAUNCH, True),
                    ("collectives", COLLECTIVES, True))
        for section, keys, scenario_values in sections:
            for key in keys:
                entry = (t.get(section) or {}).get(key)
                if entry is None:
                    raise TableError(f"{where}.{section}.{key}: missing")
                _check_entry(f"{where}.{section}.{key}", entry, scenario_values)
        _check_entry(f"{where}.ep_passes", t.get("ep_passes"), True)
        if any(int(t["ep_passes"][s]) != t["ep_passes"][s] or t["ep_passes"][s] < 1 for s in SCENARIOS):
            raise TableError(f"{where}.ep_passes: pass counts must be whole numbers >= 1")
    return Table(raw, path)


def load_table(path: str | os.PathLike | None = None) -> Table:
    """The efficiency table at `path`, else at $GLM52_EFFICIENCY_TABLE, else the packaged one; checked."""
    chosen = Path(path or os.environ.get(PATH_ENV) or DEFAULT_PATH)
    try:
        raw = json.loads(chosen.read_text())
    except FileNotFoundError:
        raise TableError(f"efficiency table {chosen}: no such file") from None
    except json.JSONDecodeError as err:
        raise TableError(f"efficiency table {chosen}: not valid JSON ({err})") from None
    return check_table(raw, str(chosen))
