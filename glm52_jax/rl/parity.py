"""Gradient parity of the three gradient modes on one real rollout (the seed's 32K parity check).

    python -m glm52_jax.launch --mode=parity --config=configs/32k_parity.py --workdir=RUN

Samples like a transaction (same candidate search, same seeds) until a mixed-reward group, then
computes the GRPO loss, new log-probs and LoRA gradients of that group in every mode of
`parity.modes`, without any optimizer step, and compares each with `parity.reference`
(conventional): log-prob max |diff|, loss |diff|, and per target family and overall the cosine and
relative L2 of the gradients. Writes `RUN/evidence/parity/receipt.json` (+ the rollout fixture as
artifacts) and returns the comparison.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from glm52_jax.rl.transaction import ConfigError, _state_bytes, build_policy, check_config, mesh_spec, search_group


def family_vectors(grads, model) -> dict[str, np.ndarray]:
    """Gradient leaves flattened (float64) per LoRA family, plus "all" over every family present."""
    from flax import nnx

    from glm52_jax.model.lora import FAMILIES, LoRA

    families = {p: v.get_metadata()["family"] for p, v in nnx.to_flat_state(nnx.state(model, LoRA))}
    parts: dict[str, list[np.ndarray]] = {}
    for path, g in nnx.to_flat_state(grads):
        parts.setdefault(families[path], []).append(np.asarray(g.get_value(), np.float64).ravel())
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


def run_parity(c, workdir: str | Path, *, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Runs the parity check for config `c`; writes `workdir/evidence/parity/receipt.json`."""
    workdir = Path(workdir)
    p = c.parity
    modes = tuple(p.modes)
    bad = sorted(set(modes) - {"conventional", "response_only", "shared_prefix"})
    if bad or p.reference not in modes:
        raise ConfigError(f"parity.modes {modes} must be gradient modes and include parity.reference {p.reference!r}")
    plan = check_config(c)
    if mesh_spec(c).size > 1:
        raise ConfigError(f"mesh={c.mesh!r}: parity runs on one device so far")
    import jax
    import jax.numpy as jnp

    from glm52_jax.evidence import EvidenceWriter, config_hash
    from glm52_jax.rl import grpo
    from glm52_jax.rl.gradients import LossSettings, lora_gradients
    from glm52_jax.rollout.sampler import Sampler

    writer = EvidenceWriter(workdir / "evidence" / "parity")  # refuses an existing receipt first
    model, _ = build_policy(c, plan)
    s, t = c.sampling, c.train
    sampler = Sampler(model, chunk_size=s.chunk_size, prefix_cache_bytes=int(s.prefix_cache_mib) << 20,
                      progress=lambda *a: None, prefill_mode=s.get("prefill_mode", "chunked"))
    seeds = [int(x) for x in np.asarray(jax.random.randint(jax.random.split(jax.random.key(c.seed))[1],
                                                           (c.search.max_candidates,), 0, 2**31 - 1))]
    candidates, accepted = search_group(c, plan, 1, c.data.first_row, seeds, sampler, lambda *a, **k: None, log)
    if accepted is None:
        raise ConfigError(f"parity: no mixed-reward group within search.max_candidates={c.search.max_candidates}")
    i, row, prompt, res, rewards = accepted
    g, n = s.num_samples, s.max_new_tokens
    mask = (np.arange(n)[None, :] < res.lengths[:, None]).astype(np.float32)
    responses = np.where(mask > 0, res.tokens, model.cfg.pad_token_id or 0).astype(np.int32)
    advantages = np.asarray(grpo.group_advantages(jnp.asarray(rewards, jnp.float32), group_size=g))
    settings = LossSettings(clip_ratio_low=float(t.clip_ratio_low), clip_ratio_high=float(t.clip_ratio_high),
                            loss_agg_mode=t.loss_agg_mode)
    results, vectors = {}, {}
    for mode in modes:
        prefix = None
        if mode == "response_only":  # the sampler's prompt KV, as the transaction uses it
            prefix, _, _ = sampler.prefill(prompt, sampler.capacity_for(len(prompt), n))
        out = lora_gradients(model, np.asarray(prompt, np.int32), responses, mask, res.logprobs, advantages,
                             mode=mode, loss=settings, prefix_cache=prefix)
        results[mode] = out
        vectors[mode] = family_vectors(out.grads, model)
        log(f"parity: {mode} loss {float(out.loss):.6g}")
    ref = results[p.reference]
    comparison = {}
    for mode in modes:
        out = results[mode]
        logp_diff = np.abs(np.asarray(out.logprobs) - np.asarray(ref.logprobs)) * mask
        comparison[mode] = {
            "loss": float(out.loss), "loss_abs_diff": abs(float(out.loss) - float(ref.loss)),
            "logprob_max_abs_diff": float(logp_diff.max()),
            "grads_sha256": hashlib.sha256(_state_bytes(out.grads)).hexdigest(),
            "families": compare(vectors[mode], vectors[p.reference]),
        }
    for name, array in {"prompt_token_ids.npy": np.asarray(prompt, np.int32), "responses.npy": responses,
                        "response_mask.npy": mask, "old_logprobs.npy": res.logprobs}.items():
        writer.add_array(name, array, kind="fixture")
    writer.add_json("candidates.json", candidates, kind="rewards")
    receipt = writer.commit({
        "parity": {"reference": p.reference, "modes": list(modes), "optimizer_steps": 0, "comparison": comparison},
        "fixture": {"row": row.index, "candidate": i, "rewards": rewards, "prompt_tokens": len(prompt),
                    "response_tokens": int(mask.sum()), "num_samples": g},
        "config": {"name": c.name, "sha256": config_hash(c.to_dict())},
        "model": {"checkpoint": str(plan.checkpoint or f"random:{c.model.preset}"), "dtype": c.model.dtype},
    })
    log(f"parity receipt: {receipt}")
    return {"receipt": str(receipt), "comparison": comparison}
