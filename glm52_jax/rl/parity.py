"""Gradient parity of the three gradient modes on one real rollout (the seed's 32K parity check).

    python -m glm52_jax.launch --mode=parity --config=configs/32k_parity.py --workdir=RUN

Samples like a transaction (same candidate search, same seeds) until a mixed-reward group, then
computes the GRPO loss, new log-probs and LoRA gradients of that group in every mode of
`parity.modes`, without any optimizer step, and compares each with `parity.reference`
(conventional): log-prob max |diff|, loss |diff|, and per target family and overall the cosine and
relative L2 of the gradients. Writes `RUN/evidence/parity/receipt.json` (+ the rollout fixture as
artifacts) and returns the comparison. Runs on the run's mesh (`mesh`) in one process or several, as
train mode does: process 0 claims the workdir and writes the receipt, every process computes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from glm52_jax.evidence.hashing import state_sha256
from glm52_jax.rl import processes, settings
from glm52_jax.rl.inputs import resolve
from glm52_jax.rl.policy import build_policy, train_mesh
from glm52_jax.rl.search import candidate_seeds, response_batch, search_group
from glm52_jax.run_config import ConfigError, RunSpec


def family_vectors(grads, model) -> dict[str, np.ndarray]:
    """Gradient leaves flattened (float64) per LoRA family, plus "all" over every family present."""
    from flax import nnx

    from glm52_jax.model.lora import FAMILIES, LoRA
    from glm52_jax.parallel.placement import to_host

    families = {p: v.get_metadata()["family"] for p, v in nnx.to_flat_state(nnx.state(model, LoRA))}
    flat = nnx.to_flat_state(grads)
    host = to_host([g.get_value() for _, g in flat])  # one gather when the gradients span several processes
    parts: dict[str, list[np.ndarray]] = {}
    for (path, _), g in zip(flat, host):
        parts.setdefault(families[path], []).append(np.asarray(g, np.float64).ravel())
    vecs = {f: np.concatenate(parts[f]) for f in FAMILIES if f in parts}
    vecs["all"] = np.concatenate(list(vecs.values()))
    return vecs


def compare(a: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
    """Per family: cosine and relative L2 (|a - ref| / |ref|) of `a` against `ref`."""
    out = {}
    for f, r in ref.items():
        na, nr = np.linalg.norm(a[f]), np.linalg.norm(r)
        # None where a norm is zero (undefined; receipts hold no NaN).
        out[f] = {"cosine": float(a[f] @ r / (na * nr)) if na > 0 and nr > 0 else None,
                  "rel_l2": float(np.linalg.norm(a[f] - r) / nr) if nr > 0 else None}
    return out


def run_parity(spec: RunSpec, workdir: str | Path, *, log: Callable[[str], None] = print,
               command: Sequence[str] = ()) -> dict[str, Any]:
    """Runs the parity check for `spec` (on its mesh, in one process or several); writes
    `workdir/evidence/parity/receipt.json` (process 0)."""
    import jax

    from glm52_jax.parallel.rules import axis_rules

    processes.check_same_settings(spec)
    inputs = resolve(spec)
    mesh_spec, mesh = train_mesh(spec)
    with processes.claim_run(spec, workdir, command) as workdir, contextlib.ExitStack() as stack:
        from glm52_jax.evidence import EvidenceError, EvidenceWriter

        writer, refused = None, None
        if processes.is_writer():
            try:
                writer = EvidenceWriter(workdir / "evidence" / "parity")  # refuses an existing receipt first
            except EvidenceError as e:
                refused = e
        if not processes.all_ok(refused is None):  # every process stops with process 0, before model work
            raise refused or EvidenceError(f"process 0 refused {workdir / 'evidence' / 'parity'} (its error says why)")
        if mesh is not None:
            stack.enter_context(axis_rules(mesh_spec.rules()))
        model, _ = build_policy(spec, inputs, mesh)  # before the mesh is set, as train mode does
        if mesh is not None:
            stack.enter_context(jax.set_mesh(mesh))
            log(f"mesh {mesh_spec.describe()} over {mesh_spec.size} {jax.devices()[0].platform} devices")
        return _parity(inputs, model, writer, mesh_spec, log)


def _parity(inputs, model, writer, mesh_spec, log) -> dict[str, Any]:
    import jax

    from glm52_jax.parallel.placement import to_host
    from glm52_jax.rl.gradients import lora_gradients

    spec = inputs.spec
    modes, reference = spec.parity.modes, spec.parity.reference
    sampler = settings.sampler(spec.sampling, model)
    seeds = candidate_seeds(jax.random.split(jax.random.key(spec.seed))[1], spec.search.max_candidates)
    candidates, accepted = search_group(inputs, spec.data.first_row, seeds, sampler, step=1,
                                        event=lambda *a, **k: None, log=log)
    if accepted is None:
        raise ConfigError(f"parity: no mixed-reward group within --config.search.max_candidates="
                          f"{spec.search.max_candidates}")
    res, prompt, n = accepted.result, accepted.prompt, spec.sampling.max_new_tokens
    responses, mask, advantages = response_batch(accepted, model.cfg.pad_token_id or 0, n)
    results, vectors = {}, {}
    for mode in modes:
        prefix = None
        if mode == "response_only":  # the sampler's prompt KV, as the transaction uses it
            prefix, _, _ = sampler.prefill(prompt, sampler.capacity_for(len(prompt), n))
        out = lora_gradients(model, np.asarray(prompt, np.int32), responses, mask, res.logprobs, advantages,
                             mode=mode, loss=settings.loss_settings(spec.train), prefix_cache=prefix)
        # Host copies (gathered when the arrays span several processes).
        results[mode] = (out, float(to_host(out.loss)), np.asarray(to_host(out.logprobs)))
        vectors[mode] = family_vectors(out.grads, model)
        log(f"parity: {mode} loss {results[mode][1]:.6g}")
    _, ref_loss, ref_logprobs = results[reference]
    comparison = {}
    for mode in modes:
        out, loss, logprobs = results[mode]
        logp_diff = np.abs(logprobs - ref_logprobs) * mask
        comparison[mode] = {
            "loss": loss, "loss_abs_diff": abs(loss - ref_loss),
            "logprob_max_abs_diff": float(logp_diff.max()),
            "grads_sha256": state_sha256(out.grads),
            "families": compare(vectors[mode], vectors[reference]),
        }
    if writer is None:  # processes other than 0: computed alongside, nothing to write
        processes.barrier("parity: receipt written")
        return {"receipt": None, "comparison": comparison}
    for name, array in {"prompt_token_ids.npy": np.asarray(prompt, np.int32), "responses.npy": responses,
                        "response_mask.npy": mask, "old_logprobs.npy": res.logprobs}.items():
        writer.add_array(name, array, kind="fixture")
    writer.add_json("candidates.json", candidates, kind="rewards")
    receipt = writer.commit({
        "parity": {"reference": reference, "modes": list(modes), "optimizer_steps": 0, "comparison": comparison},
        "fixture": {"row": accepted.row.index, "candidate": accepted.index, "rewards": accepted.rewards,
                    "prompt_tokens": len(prompt), "response_tokens": int(mask.sum()),
                    "num_samples": spec.sampling.num_samples, "group_samples": accepted.samples},
        "config": {"name": spec.name, "sha256": spec.config_sha256()},
        "model": {"checkpoint": spec.model.base_name, "dtype": spec.model.dtype},
        "topology": {"mesh": mesh_spec.describe(), "mesh_devices": mesh_spec.size, "processes": processes.count()},
    })
    processes.barrier("parity: receipt written")
    log(f"parity receipt: {receipt}")
    return {"receipt": str(receipt), "comparison": comparison}
