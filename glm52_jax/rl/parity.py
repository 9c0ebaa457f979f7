"""Gradient parity of the gradient modes on one real rollout (the seed's 32K parity check).

    python -m glm52_jax.launch --mode=parity --config=configs/32k_parity.py --workdir=RUN

Samples like a transaction (same candidate search, same seeds) until a mixed-reward group, from a
nonzero LoRA state (parity_cases), then in each case (`ratio1`, `active_clip`) computes the GRPO
loss, new log-probs and LoRA gradients of that group in every mode of `parity.modes` (one backward
per sample, never an optimizer step: the LoRA and AdamW state are hashed before and after and must
not change; their digests are computed per shard on device), exports every gradient shard as it lives on each
device (parity_shards), and compares each mode with `parity.reference` (conventional) by the seed's metrics
(parity_metrics), on process 0, one parameter at a time read back from every process's shard files: no
gradient is gathered, and host memory is bounded by the largest parameter, not the gradients. Each pair
is decided `passed` / `failed` against `parity.acceptance`. With `parity.torch_reference` (HF + PEFT) and
`parity.megatron_reference` (megatron-core) the same fixture also runs in PyTorch and is compared the same way
(parity_references).

Writes `RUN/evidence/gradient_parity_<name>.json` (name: the config's, without a leading
"gradient_parity_") with its artifacts in `RUN/evidence/gradient_parity_<name>/`: the fixture, each
case's old log-probs, each mode's new log-probs and shard files; one manifest covers both cases.
Runs on the run's mesh in one process or several, as train mode does: process 0 claims the workdir
and writes the receipt, every process computes and writes its own devices' shards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from glm52_jax.parallel import watchdog
from glm52_jax.rl import parity_cases, parity_metrics, parity_references, processes, settings
from glm52_jax.rl.inputs import resolve
from glm52_jax.rl.policy import build_policy, mesh_line, train_mesh
from glm52_jax.rl.rewards.dapo import reward_rule
from glm52_jax.rl.search import candidate_seeds, response_batch, search_group
from glm52_jax.run_config import ConfigError, RunSpec


def receipt_name(spec: RunSpec) -> str:
    """`gradient_parity_<name>.json`, as the seed names its receipt (configs/32k_parity.py -> ..._32k.json)."""
    return f"gradient_parity_{spec.name.removeprefix('gradient_parity_')}.json"


def run_parity(spec: RunSpec, workdir: str | Path, *, log: Callable[[str], None] = print,
               command: Sequence[str] = ()) -> dict[str, Any]:
    """Runs the parity check for `spec` (on its mesh, in one process or several); process 0 writes the receipt."""
    import jax

    from glm52_jax.parallel.rules import axis_rules

    spec.parity.bounds()  # validated with the spec; parsed again here so a bad bound stops before any work
    processes.check_same_settings(spec)
    parity_references.check(spec)
    inputs = resolve(spec)
    mesh_spec, mesh = train_mesh(spec)
    with processes.claim_run(spec, workdir, command) as workdir, contextlib.ExitStack() as stack:
        from glm52_jax.evidence import EvidenceError, EvidenceWriter

        writer, refused = None, None
        if processes.is_writer():
            try:  # refuses an existing receipt or leftover artifacts first
                writer = EvidenceWriter(workdir / "evidence", receipt_name=receipt_name(spec))
            except (EvidenceError, FileExistsError) as e:
                refused = EvidenceError(str(e))
        if not processes.all_ok(refused is None):  # every process stops with process 0, before model work
            raise refused or EvidenceError(f"process 0 refused {workdir / 'evidence'} (its error says why)")
        if mesh is not None:
            stack.enter_context(axis_rules(mesh_spec.rules()))
        model, optimizer = build_policy(spec, inputs, mesh)  # before the mesh is set, as train mode does
        if mesh is not None:
            stack.enter_context(jax.set_mesh(mesh))
            log(mesh_line(mesh_spec))
        artifacts = workdir / "evidence" / receipt_name(spec).removesuffix(".json")
        return _parity(inputs, model, optimizer, writer, artifacts, mesh_spec, log)


def _policy_state(spec: RunSpec, model) -> dict[str, Any]:
    """Makes the LoRA nonzero (unless an adapter was loaded) and says how."""
    if spec.model.init_adapter:
        return {"source": "model.init_adapter", "path": spec.model.init_adapter}
    count = parity_cases.seed_lora_b(model, spec.parity.lora_b_std, spec.seed)
    return {"source": "seeded", "b_std": spec.parity.lora_b_std, "seed": spec.seed, "b_arrays": count,
            "a": "fresh adapter init (uniform +-1/sqrt(fan_in), seed)"}


def _lora_digest(model) -> str:
    from flax import nnx

    from glm52_jax.checkpoint.inventory import state_digest
    from glm52_jax.model.lora import LoRA

    return state_digest(nnx.state(model, LoRA))


def _state_hashes(model, optimizer) -> dict[str, Any]:
    """Digests of the LoRA and the AdamW state, computed per shard on device (`inventory.state_digest`): nothing
    is gathered, and every process computes the same."""
    import jax

    from glm52_jax.checkpoint.inventory import inventory_digest, named_inventory

    moments = {jax.tree_util.keystr(path): x for path, x in jax.tree_util.tree_flatten_with_path(optimizer.opt_state)[0]
               if hasattr(x, "shape")}
    return {"lora_digest": _lora_digest(model), "optimizer_digest": inventory_digest(named_inventory(moments)),
            "optimizer_step": optimizer.step}


def _families(model) -> dict[str, str]:
    from flax import nnx

    from glm52_jax.model.lora import LoRA

    return {"/".join(map(str, p)): v.get_metadata()["family"] for p, v in nnx.to_flat_state(nnx.state(model, LoRA))}


def _parity(inputs, model, optimizer, writer, artifacts: Path, mesh_spec, log) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from glm52_jax.checkpoint.inventory import state_digest
    from glm52_jax.checkpoint.train_state import place_as_restored
    from glm52_jax.parallel.placement import to_host
    from glm52_jax.rl.gradients import cached_response_logprobs_jit, lora_gradients, prefix_for_response

    spec = inputs.spec
    modes, bounds = spec.parity.modes, spec.parity.bounds()
    policy = _policy_state(spec, model)
    # Placed as a fresh train run places its policy (the values stay): the sampler and digest programs are then the
    # train run's, found in a persistent compilation cache the two modes share (not lowered anew for uncommitted
    # arrays).
    place_as_restored(model, optimizer, jax.random.key(spec.seed))
    before = _state_hashes(model, optimizer)
    sampler = settings.sampler(spec.sampling, model)
    seeds = candidate_seeds(jax.random.split(jax.random.key(spec.seed))[1], spec.search.max_candidates)
    candidates, accepted = search_group(inputs, spec.data.first_row, seeds, sampler, step=1,
                                        event=lambda *a, **k: None, log=log)
    if accepted is None:
        raise ConfigError(f"parity: no mixed-reward group within --config.search.max_candidates="
                          f"{spec.search.max_candidates}")
    res, prompt, n = accepted.result, np.asarray(accepted.prompt, np.int32), spec.sampling.max_new_tokens
    responses, mask, advantages = response_batch(accepted, model.cfg.pad_token_id or 0, n)
    loss_settings = settings.loss_settings(spec.train)
    # The sampler's prompt KV cut to prompt[:-1]: response_only's prefix (as the transaction uses it) and what the
    # policy's own log-probs (ratio1's old) are computed after.
    prefix, _, _ = sampler.prefill(prompt, sampler.capacity_for(len(prompt), n))
    prefix = prefix_for_response(prefix, len(prompt), n)
    graphdef, state = nnx.split(model)
    policy_logprobs = np.asarray(to_host(cached_response_logprobs_jit(graphdef, state, prefix, jnp.asarray(prompt),
                                                                      jnp.asarray(responses))))
    olds, families = parity_cases.case_olds(policy_logprobs, mask, advantages), _families(model)
    fixture_arrays = {"prompt_token_ids.npy": prompt, "responses.npy": responses, "response_mask.npy": mask,
                      "advantages.npy": advantages, "sampler_logprobs.npy": res.logprobs}
    results, files = {}, []
    for case, old in olds.items():
        fixture_arrays[f"{case}/old_logprobs.npy"] = old
        runs = {}
        for mode in modes:
            params_digest = _lora_digest(model)  # what this path starts from (the optimizer is checked once, after)
            log(f"parity {case}: {mode} gradients")
            with watchdog.phase(f"parity {mode}", program=f"{case} gradients"):
                out = lora_gradients(model, prompt, responses, mask, old, advantages, mode=mode, loss=loss_settings,
                                     prefix_cache=prefix if mode == "response_only" else None)
                arrays = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(out.grads)}
                records = _export(arrays, artifacts / case / mode)
                digest = state_digest(out.grads)  # per shard on device: nothing gathered
            # Process 0 compares after the barrier below, reading the shard files one parameter at a time.
            runs[mode] = {"directory": artifacts / case / mode, "grads_digest": digest,
                          "loss": float(to_host(out.loss)), "records": records,
                          "logprobs": np.asarray(to_host(out.logprobs)), "params_digest": params_digest,
                          "metrics": {k: float(v) for k, v in to_host(dict(out.metrics)).items()}}
            fixture_arrays[f"{case}/{mode}/new_logprobs.npy"] = runs[mode]["logprobs"]
            files += [f"{case}/{mode}/{name}" for k in range(processes.count())
                      for name in _shard_files(k)]
        results[case] = runs
    after = _state_hashes(model, optimizer)
    if after != before:
        raise AssertionError(f"parity changed the policy state: {before} -> {after}")  # a bug, never expected
    reference_runs = parity_references.runs(spec, model, prompt, responses, mask, olds, advantages, loss_settings,
                                            log)
    processes.barrier("parity: shards written")
    if writer is None:  # processes other than 0: computed alongside, nothing to write
        processes.barrier("parity: receipt written")
        return {"receipt": None}
    for runs in results.values():  # every process's shards are written: each mode's gradients, read when compared
        for run in runs.values():
            run["grads"] = _gradients(run["directory"])
    section = _compare(spec, results, reference_runs, families, mask, olds, advantages, loss_settings, bounds, log)
    if reference_runs:
        section["references"] = parity_references.describe(spec, model)
    for name, array in fixture_arrays.items():
        writer.add_array(name, array, kind="fixture")
    writer.add_json("candidates.json", candidates, kind="rewards")
    for name in files:
        writer.add_written(name, kind="gradient_shards")
    receipt = writer.commit({
        "parity": section,
        "policy_state": {**policy, "before": before, "after": after, "unchanged": True},
        "fixture": {"row": accepted.row.index, "candidate": accepted.index, "rewards": accepted.rewards,
                    "prompt_tokens": len(prompt), "response_tokens": int(mask.sum()),
                    "num_samples": spec.sampling.num_samples, "group_samples": accepted.samples,
                    "advantages": np.asarray(advantages).tolist(), "cases": parity_cases.describe_cases(),
                    # The rows the search scored, bound to the data file (`verify --data`); from data.first_row.
                    "data": {**inputs.data_record(candidates), "data_cursor": spec.data.first_row}},
        "reward_rule": reward_rule(spec.reward.boxed_fallback),
        "config": {"name": spec.name, "sha256": spec.config_sha256()},
        "model": {"checkpoint": spec.model.base_name, "dtype": spec.model.dtype},
        "topology": {"mesh": mesh_spec.describe(), "mesh_devices": mesh_spec.size, "processes": processes.count()},
    })
    processes.barrier("parity: receipt written")
    log(f"parity receipt: {receipt} ({section['decision']})")
    return {"receipt": str(receipt), "decision": section["decision"],
            "cases": {case: {m: {"decision": p["decision"], **p["families"]["all"]} for m, p in c["pairs"].items()}
                      for case, c in section["cases"].items()}}


def _shard_files(process: int) -> tuple[str, str]:
    from glm52_jax.rl.parity_shards import file_names

    return file_names("shards", process)


def _gradients(directory: Path):
    """One mode's gradients as `{name: array}`, each read from every process's shard files when indexed."""
    from glm52_jax.rl.parity_shards import ShardedArrays

    return ShardedArrays(directory, "shards", processes.count())


def _nonfinite(grads) -> int:
    return sum(int(np.count_nonzero(~np.isfinite(grads[name]))) for name in grads)


def _export(arrays: dict, directory: Path) -> list[dict]:
    from glm52_jax.rl.parity_shards import export_shards

    return export_shards(arrays, directory, "shards", processes.index())


def _compare(spec, results, reference_runs, families, mask, olds, advantages, loss_settings, bounds, log) -> dict:
    """The receipt's parity section: per case, clipping counts, per mode its numbers, per pair metrics + decision."""
    reference, outliers = spec.parity.reference, spec.parity.outliers
    cases = {}
    for case, runs in results.items():
        ref = runs[reference]
        pairs = {}
        for mode, run in runs.items():
            if mode == reference:
                continue
            metrics = parity_metrics.pair_metrics(
                run["grads"], ref["grads"], families, logprobs=run["logprobs"], ref_logprobs=ref["logprobs"],
                mask=mask, loss=run["loss"], ref_loss=ref["loss"], outliers=outliers, shards=run["records"],
                ref_shards=ref["records"], params_digest=run["params_digest"], ref_params_digest=ref["params_digest"])
            pairs[mode] = {**metrics, **parity_metrics.decide(metrics, bounds[mode])}
            _log_pair(log, case, f"{mode} vs {reference}", pairs[mode])
        reference_pairs = {}
        for source in parity_references.enabled(spec):
            reference_pairs[source.name] = parity_references.pairs(source, reference_runs[source.name][case], runs,
                                                                   families, mask, outliers)
            for mode, pair in reference_pairs[source.name].items():
                _log_pair(log, case, f"{source.name} {mode} vs jax {mode}", pair)
        clips = parity_cases.clip_counts(
            ref["logprobs"], olds[case], mask, advantages, clip_ratio_low=loss_settings.clip_ratio_low,
            clip_ratio_high=loss_settings.clip_ratio_high, clip_ratio_c=loss_settings.clip_ratio_c)
        cases[case] = {
            "clipping": clips,
            "modes": {mode: {"loss": run["loss"], "metrics": run["metrics"], "grads_digest": run["grads_digest"],
                             "shards": len(run["records"]), "nonfinite": _nonfinite(run["grads"])}
                      for mode, run in runs.items()},
            "pairs": pairs, **reference_pairs,
        }
    groups = ("pairs",) + tuple(r.name for r in parity_references.enabled(spec))
    decisions = [p["decision"] for c in cases.values() for group in groups for p in c.get(group, {}).values()]
    return {"reference": reference, "modes": list(spec.parity.modes), "cases": cases, "optimizer_steps": 0,
            "acceptance": {m: [b.describe() for b in bs] for m, bs in bounds.items()},
            **{f"{r.name}_acceptance": list(r.bounds) for r in parity_references.enabled(spec)},
            "decision": "passed" if all(d == "passed" for d in decisions) else "failed"}


def _log_pair(log, case: str, what: str, pair: dict) -> None:
    g = pair["families"]["all"]
    fmt = lambda v: "n/a" if v is None else f"{v:.9g}"  # noqa: E731
    log(f"parity {case} {what}: cosine {fmt(g['cosine'])} rel_l2 {fmt(g['rel_l2'])} logprob_abs "
        f"{pair['logprob_abs']:.3g} loss_abs {pair['loss_abs']:.3g} -> {pair['decision']}")
