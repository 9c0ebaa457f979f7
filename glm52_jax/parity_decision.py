"""Parity acceptance bounds ("METRIC OP VALUE") and a pair's decision from its metrics
(`rl/parity_metrics.pair_metrics`' dict).

Shared by the run config (`parity.acceptance`, re-exported by `run_config`), the parity run, which decides every
pair with it (`rl/parity.py`, `rl/parity_references.py`), and `python -m glm52_jax.evidence verify`
(`evidence/parity_check.py`), which decides a receipt's pairs again from their stored metrics. A module of its
own, importing only `choices`, so that evidence/ imports neither rl/ nor run_config.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from glm52_jax import choices

# Parity acceptance: per compared mode, "MODE: METRIC OP VALUE, ...". A gradient metric may name a LoRA family
# ("unembed.rel_l2 <= 1e-5"); without one it is the global value over every family ("all").
PARITY_METRICS = {"cosine": ">=", "rel_l2": "<=", "logprob_abs": "<=", "loss_abs": "<="}
_FAMILY_METRICS = ("cosine", "rel_l2")


@dataclasses.dataclass(frozen=True)
class Bound:
    """One acceptance bound: `family`'s `metric` `op` `value` (family "all" = global, or "-" for non-gradient)."""

    family: str
    metric: str
    op: str
    value: float

    def holds(self, measured: float | None) -> bool:
        if measured is None or not math.isfinite(measured):
            return False
        return measured >= self.value if self.op == ">=" else measured <= self.value

    def describe(self) -> str:
        name = self.metric if self.family in ("all", "-") else f"{self.family}.{self.metric}"
        return f"{name} {self.op} {self.value:g}"


def parse_bound(term: str) -> Bound | str:
    """One "METRIC OP VALUE" term -> Bound, or why it is not one."""
    parts = term.split()
    if len(parts) != 3:
        return f"{term!r} is not 'METRIC OP VALUE' (e.g. 'rel_l2 <= 1e-5')"
    name, op, text = parts
    family, _, metric = name.rpartition(".")
    if metric not in PARITY_METRICS:
        return f"{term!r}: unknown metric {metric!r}; choose from {', '.join(PARITY_METRICS)}"
    if family and (metric not in _FAMILY_METRICS or family not in choices.LORA_FAMILIES):
        return f"{term!r}: a family prefix must be one of {', '.join(choices.LORA_FAMILIES)} on cosine or rel_l2"
    if op != PARITY_METRICS[metric]:
        return f"{term!r}: {metric} takes {PARITY_METRICS[metric]}"
    try:
        value = float(text)
    except ValueError:
        return f"{term!r}: {text!r} is not a number"
    if not math.isfinite(value) or value < 0:
        return f"{term!r}: the bound must be a finite number >= 0"
    return Bound(family or ("all" if metric in _FAMILY_METRICS else "-"), metric, op, value)


def measured(metrics: Mapping[str, Any], bound: Bound) -> float | None:
    """The value of `metrics` that `bound` constrains."""
    if bound.metric in ("logprob_abs", "loss_abs"):
        return metrics[bound.metric]
    family = metrics["families"].get(bound.family)
    return None if family is None else family[bound.metric]


def decide(metrics: Mapping[str, Any], bounds: Sequence[Bound]) -> dict[str, Any]:
    """Every bound checked against `metrics`, plus the contract every pair must meet whatever the bounds:
    finite gradients, and where compared the same shard set and the same starting parameters. `passed` only if
    all hold."""
    checks = []
    for bound in bounds:
        value = measured(metrics, bound)
        checks.append({"bound": bound.describe(), "measured": value, "passed": bound.holds(value)})
    structural = {"finite gradients": metrics["nonfinite"] == 0 and metrics["reference_nonfinite"] == 0}
    if "shards" in metrics:
        structural["same shard set"] = metrics["shards"]["set_equal"]
    if "params_equal" in metrics:
        structural["same starting parameters"] = metrics["params_equal"]
    checks += [{"bound": name, "measured": ok, "passed": bool(ok)} for name, ok in structural.items()]
    return {"decision": "passed" if all(c["passed"] for c in checks) else "failed", "checks": checks}
