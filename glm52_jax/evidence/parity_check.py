"""A parity receipt's decisions, recomputed from its own metrics and bounds.

    python -m glm52_jax.evidence verify RECEIPT     # for a receipt with a "parity" section, also this check

The hashes bind a receipt's contents, but not that its verdicts follow from them: a receipt re-sealed after a
`"failed"` was edited into `"passed"` verifies. This check does not trust the stored decisions: every pair of
every case (the modes against the reference mode, under `parity.acceptance[mode]`, and each independent
reference's pairs, `parity.cases.<case>.<name>` under `parity.<name>_acceptance`: `torch`, `megatron`) is decided
again from its stored metrics with `glm52_jax.parity_decision.decide` (the code the run decided with), and the
run's verdict must be "passed" exactly when every pair passed. Standard library only (with the same module's
bound parser), so the evidence package still starts without JAX or numpy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_CASE_KEYS = ("clipping", "modes")  # a case's entries that are not pair groups


def _bounds_of(parity: Mapping[str, Any], group: str, mode: str) -> list[str] | None:
    if group == "pairs":
        acceptance = parity.get("acceptance")
        return acceptance.get(mode) if isinstance(acceptance, dict) else None
    return parity.get(f"{group}_acceptance")


def parity_decision_failures(receipt: Mapping[str, Any]) -> tuple[list[str], int]:
    """(failures, pairs checked) for `receipt`'s parity section; ([], 0) when it has no `parity.cases`."""
    parity = receipt.get("parity")
    cases = parity.get("cases") if isinstance(parity, dict) else None
    if not isinstance(cases, dict):  # no parity pairs to decide (not a parity run's receipt)
        return [], 0
    from glm52_jax.parity_decision import decide, parse_bound

    failures, decisions = [], []
    for case, result in cases.items():
        groups = {k: v for k, v in result.items() if k not in _CASE_KEYS} if isinstance(result, dict) else {}
        for group, pairs in groups.items():
            for mode, pair in (pairs.items() if isinstance(pairs, dict) else ()):
                where = f"parity.cases.{case}.{group}.{mode}"
                bounds = _bounds_of(parity, group, mode)
                try:
                    parsed = [parse_bound(b) for b in bounds]
                    if any(isinstance(b, str) for b in parsed):
                        raise ValueError(next(b for b in parsed if isinstance(b, str)))
                    want = decide(pair, parsed)
                except (TypeError, KeyError, ValueError, AttributeError) as e:
                    failures.append(f"{where}: cannot be decided again from its metrics and bounds ({e!r})")
                    continue
                decisions.append(want["decision"])
                if want != {"decision": pair.get("decision"), "checks": pair.get("checks")}:
                    failures.append(f"{where}: the stored decision {pair.get('decision')!r} does not follow from "
                                    f"its metrics and bounds (recomputed: {want['decision']!r})")
    verdict = "passed" if decisions and all(d == "passed" for d in decisions) else "failed"
    if parity.get("decision") != verdict:
        failures.append(f"parity.decision is {parity.get('decision')!r} but its pairs give {verdict!r}")
    return failures, len(decisions)
