"""One online GRPO transaction (DESIGN §1): search, sample, reward, one update, evidence.

    parameter inventory -> optional engine probe (one short exact-N request, `search.probe_tokens`)
    -> bounded candidate search (exact-N prompt, S samples, DAPO reward; accept the first request whose
    rewards differ, its group of G chosen by `rl.group`) -> inventory unchanged by sampling -> G backwards
    in the configured gradient mode, exactly one AdamW step -> artifacts (raw sampler records of every
    sample in `samples.jsonl`) + receipt (with a decode audit of every candidate sample), committed last.

`run_transaction` composes four parts: `update` (the gradient step and new log-probs),
`write_artifacts` (arrays, JSON records), `write_rank_records` (each process's trace and completion
record) and `receipt_fields` (the receipt's sections). In a multi-process run every process computes
the whole transaction; process 0 writes the evidence (rl/processes.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from glm52_jax.evidence.atomic import atomic_write_bytes
from glm52_jax.evidence.receipt import ARTIFACTS_DIR
from glm52_jax.parallel import watchdog
from glm52_jax.rl import decode_audit, processes, step_metrics
from glm52_jax.rl.inputs import RunInputs
from glm52_jax.rl.rewards.dapo import reward_rule
from glm52_jax.rl.samples import REQUEST_CANDIDATE, jsonl_bytes
from glm52_jax.rl.search import Accepted, candidate_seeds, engine_probe, probe_seed, response_batch, search_group
from glm52_jax.rl.settings import loss_settings

LORA_FILES = ("lora_before.safetensors", "lora_after.safetensors")


def lora_state(model):
    from flax import nnx

    from glm52_jax.model.lora import LoRA

    return nnx.state(model, LoRA)


def save_lora(model, writer, evidence_dir: Path, name: str) -> None:
    """Process 0 (`writer`) writes the adapters to artifacts/`name`, one tensor at a time (`checkpoint.state_file`);
    the other processes join the collectives of the tensors spread over several of them."""
    from glm52_jax.checkpoint.state_file import write_state_file

    dest = None
    if writer is not None:
        dest = evidence_dir / ARTIFACTS_DIR / name
        dest.parent.mkdir(parents=True, exist_ok=True)
    write_state_file(lora_state(model), dest)


def lora_digest(model, inventory: dict[str, dict] | None = None) -> str:
    """The adapters' digest (`inventory.state_digest`: per shard on device, the same on every process and mesh),
    taken from `inventory` (the model's, whose LoRA entries are the same digests) when given."""
    from glm52_jax.checkpoint.inventory import inventory_digest, state_digest
    from glm52_jax.model.named_arrays import state_leaves

    if inventory is None:
        return state_digest(lora_state(model))
    return inventory_digest({name: inventory[name] for name in state_leaves(lora_state(model))})


def update(inputs: RunInputs, model, optimizer, sampler, accepted: Accepted) -> tuple[dict, dict, dict, dict]:
    """The GRPO step on the accepted group: (training record, numerics record, arrays to keep, the step's
    update scalars for metrics.jsonl (`step_metrics.update_scalars`; not in the receipt))."""
    import jax.numpy as jnp
    from flax import nnx

    from glm52_jax.checkpoint.inventory import state_digest
    from glm52_jax.parallel.placement import to_host
    from glm52_jax.rl.gradients import cached_response_logprobs_jit, prefix_for_response
    from glm52_jax.rl.numerics import NonFiniteError, all_finite
    from glm52_jax.rl.update import NonFiniteGradientError, grpo_update

    spec = inputs.spec
    mode, n = spec.train.gradient_mode, spec.sampling.max_new_tokens
    res, prompt = accepted.result, accepted.prompt
    responses, mask, advantages = response_batch(accepted, model.cfg.pad_token_id or 0, n)
    # The sampler's cache of this prompt (kept whole by its prefix cache: no prefill runs here). response_only's
    # update reads its prompt KV from it; the new log-probs below too.
    prefix, _, _ = sampler.prefill(prompt, sampler.capacity_for(len(prompt), n))
    prefix = prefix_for_response(prefix, len(prompt), n)
    steps_before = optimizer.step
    try:
        upd = grpo_update(model, optimizer, np.asarray(prompt, np.int32), responses, mask, res.logprobs, advantages,
                          mode=mode, loss=loss_settings(spec.train),
                          prefix_cache=prefix if mode == "response_only" else None)
    except NonFiniteGradientError as e:  # stops the step: nothing of it is committed
        raise NonFiniteError(f"{e}; the step was not committed") from None
    sampler.policy_updated()  # cached prompt KV and the sampler's weights are now stale
    # The updated adapters on the responses, the prompt's KV from the sampling policy (response_only's view of
    # the new policy): one pass over R tokens per sample, not a forward over G x (P + R) tokens.
    graphdef, state = nnx.split(model)
    new_logprobs = to_host(cached_response_logprobs_jit(graphdef, state, prefix, jnp.asarray(prompt, jnp.int32),
                                                        jnp.asarray(responses))) * mask
    loss = float(upd.loss)
    training = {"status": "updated", "optimizer_steps": optimizer.step - steps_before, "mode": mode, "loss": loss,
                "grad_norm": float(upd.grad_norm), "metrics": {k: float(v) for k, v in upd.metrics.items()},
                "grads_digest": state_digest(upd.grads), "advantages": advantages.tolist(),
                "group_samples": accepted.samples,
                "new_logprobs": "updated adapters on the responses, prompt KV of the sampling policy"}
    numerics = {"finite": all_finite({"loss": loss, "grad_norm": training["grad_norm"], "new_logprobs": new_logprobs,
                                      "old_logprobs": res.logprobs, "advantages": advantages,
                                      "rewards": accepted.rewards})}
    arrays = {"new_logprobs.npy": new_logprobs, "responses.npy": responses, "response_mask.npy": mask}
    settings = loss_settings(spec.train)
    scalars = {"loss": loss, "grad_norm": training["grad_norm"],
               **step_metrics.update_scalars(update_logp=to_host(upd.logprobs), old_logp=res.logprobs,
                                             new_logp=new_logprobs, advantages=advantages, mask=mask,
                                             clip_ratio_low=settings.clip_ratio_low,
                                             clip_ratio_high=settings.clip_ratio_high,
                                             policy_metrics=training["metrics"])}
    return training, numerics, arrays, scalars


def write_artifacts(writer, spec, *, arrays: dict, seeds: list[int], stop_ids, candidates: list[dict],
                    samples: list[dict], inventories: tuple[dict, dict], cleanup: dict) -> dict[str, str]:
    """Every artifact of a transaction (each hashed into the manifest; the LoRA files, already written by
    `save_lora`, are listed). Returns {LoRA file name: its sha256}."""
    for name, array in sorted(arrays.items()):
        writer.add_array(name, array, kind="array")
    s = spec.sampling
    writer.add_json("sampling_params.json", {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                                             "max_new_tokens": s.max_new_tokens, "num_samples": s.num_samples,
                                             "samples_per_request": s.per_request,
                                             "stop_token_ids": list(stop_ids), "seeds": seeds[:len(candidates)]},
                    kind="sampling")
    writer.add_json("rewards.json", candidates, kind="rewards")
    writer.add_bytes("samples.jsonl", jsonl_bytes(samples), kind="samples")
    writer.add_json("inventory_before_sampling.json", inventories[0], kind="inventory")
    writer.add_json("inventory_after_sampling.json", inventories[1], kind="inventory")
    writer.add_json("cleanup.json", cleanup, kind="cleanup")
    return {name: writer.add_written(name, kind="lora")["sha256"] for name in LORA_FILES}


def _rank_files(rank: int) -> dict[str, str]:
    """{artifact name: kind} of one process's own records."""
    return {f"traces/rank{rank}.jsonl": "trace", f"completion/rank{rank}.json": "completion"}


def write_rank_records(writer, evidence_dir: Path, step: int, traces: list) -> list[str]:
    """This process's trace (its events) and completion record (devices, events, peak memory) under
    artifacts/; process 0 (`writer`) then lists every process's, after a barrier. Returns the
    artifact paths (all nondeterministic: timings, memory)."""
    rank = processes.index()
    own = {"trace": "".join(json.dumps(r) + "\n" for r in traces).encode(),
           "completion": (json.dumps(processes.completion_record(traces), sort_keys=True, indent=2) + "\n").encode()}
    if writer is None:
        for name, kind in _rank_files(rank).items():
            dest = evidence_dir / ARTIFACTS_DIR / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(dest, own[kind], overwrite=False)
    processes.barrier(f"step {step}: rank records written")
    if writer is None:
        return []
    for name, kind in _rank_files(rank).items():
        writer.add_bytes(name, own[kind], kind=kind)
    for other in range(1, processes.count()):
        for name, kind in _rank_files(other).items():
            writer.add_written(name, kind)
    return [f"{ARTIFACTS_DIR}/{name}" for r in range(processes.count()) for name in _rank_files(r)]


def receipt_fields(inputs: RunInputs, cfg, *, step: int, cursor: int, candidates: list[dict], samples: list[dict],
                   accepted: Accepted | None, training: dict, numerics: dict, cleanup: dict, traces: list,
                   probe: tuple[dict, dict] | None, rank_paths: list[str]) -> dict:
    """The receipt's sections (the manifest and provenance are added by the writer). `probe`: the engine
    probe's (record, timing), its timing a nondeterministic section; `rank_paths`: the processes' traces
    and completion records (process 0's events are counted in "traces")."""
    import jax

    spec = inputs.spec
    m, mesh = spec.model, spec.mesh_spec()
    devices = jax.devices()
    probe_sections = {} if probe is None else {"probe": probe[0], "probe_timing": probe[1]}
    return {
        "transaction": {"step": step, "data_cursor": cursor},
        "prompt": {"tokens": spec.data.prompt_tokens, "filler": "deterministic, shared across rows",
                   "chat_template": inputs.chat_template, "tokenizer": inputs.tokenizer_record,
                   "data": inputs.data_record(candidates)},
        "model": {"checkpoint": m.base_name, "dtype": m.dtype, "layers": cfg.num_hidden_layers,
                  "full_indexer_layers": cfg.indexer_types.count("full"),
                  "lora": {"rank": m.lora_rank, "alpha": m.lora_alpha, "families": sorted(m.lora_families)},
                  "init_adapter": inputs.init_adapter},
        "positions": {"rope_type": cfg.rope.rope_type, "max_position_embeddings": cfg.max_position_embeddings},
        "topology": {"platform": devices[0].platform, "devices": len(devices), "processes": jax.process_count(),
                     "mesh": mesh.describe(), "mesh_devices": mesh.size},
        "config": {"name": spec.name, "sha256": spec.config_sha256(), "resume_sha256": spec.resume_sha256()},
        "candidate_search": {"max_candidates": spec.search.max_candidates, "tried": len(candidates),
                             "samples_per_request": spec.sampling.per_request,
                             "accepted": None if accepted is None else accepted.index,
                             "group_samples": None if accepted is None else accepted.samples},
        "completions": [{"candidate": cd["candidate"], "texts": cd["texts"], "lengths": cd["lengths"],
                         "finish_reasons": cd["finish_reasons"]} for cd in candidates],
        "rewards": [cd["rewards"] for cd in candidates],
        "reward_rule": reward_rule(spec.reward.boxed_fallback),
        "decode_audit": decode_audit.audit(r for r in samples if r["request"] == REQUEST_CANDIDATE),
        **probe_sections,
        "training": training,
        "numerics": numerics,
        "traces": {"ranks": jax.process_count(), "events": len(traces)},
        "cleanup": cleanup,
        "nondeterministic": ["traces", *rank_paths] + (["probe_timing"] if probe else []),
    }


def run_transaction(inputs: RunInputs, *, step: int, step_key, cursor: int, model, optimizer, sampler,
                    evidence_dir: Path, event, log) -> dict[str, Any]:
    """One transaction (search, sample, reward, update) with its receipt in `evidence_dir`."""
    from glm52_jax.checkpoint.inventory import changed_entries, param_inventory
    from glm52_jax.evidence import RECEIPT_NAME, EvidenceWriter

    spec = inputs.spec
    watchdog.set_step(step)  # the phases below (prefill, decode, update, barriers) name it
    # Refuses an existing receipt before any compute; the other processes write into it only after a barrier.
    writer = EvidenceWriter(evidence_dir) if processes.is_writer() else None
    processes.barrier(f"step {step}: evidence directory ready")
    traces: list[dict[str, Any]] = []
    inventory_before = param_inventory(model)
    save_lora(model, writer, evidence_dir, LORA_FILES[0])
    stop_ids = tuple(int(i) for i in model.cfg.eos_token_id)
    seeds = candidate_seeds(step_key, spec.search.max_candidates)
    event("step_start", traces, step=step, cursor=cursor)
    samples: list[dict[str, Any]] = []
    probe = None
    if spec.search.probe_tokens:
        record, timing, samples = engine_probe(inputs, cursor, probe_seed(step_key), sampler,
                                               spec.search.probe_tokens)
        probe = (record, timing)
        event("probe", traces, step=step, **timing)
        log(f"step {step} probe: {record['prompt_tokens']} prompt tokens, finish {record['finish_reasons']}, "
            f"prefill {timing['prefill_seconds']} s, decode {timing['decode_seconds']} s")
    candidates, accepted = search_group(inputs, cursor, seeds, sampler, step=step, samples=samples,
                                        event=lambda kind, **kw: event(kind, traces, **kw), log=log)
    inventory_after = param_inventory(model)
    changed = changed_entries(inventory_before, inventory_after)
    if changed:
        raise RuntimeError(f"sampling changed parameters: {changed[:5]}")

    training: dict[str, Any] = {"status": "no_mixed_group", "optimizer_steps": 0}
    numerics: dict[str, Any] = {"finite": True}
    arrays: dict[str, Any] = {}
    scalars = step_metrics.search_scalars(candidates, traces, prompt_tokens=spec.data.prompt_tokens)
    scalars["accepted_candidate"] = None if accepted is None else accepted.index
    processes.check_same_samples(f"step {step}", jsonl_bytes(samples), [cd["rewards"] for cd in candidates])
    if accepted is not None:
        mode = spec.train.gradient_mode
        event("update_start", traces, step=step, mode=mode)
        start = time.perf_counter()
        with watchdog.phase("update", program="grpo_step"):
            training, numerics, arrays, update_scalars = update(inputs, model, optimizer, sampler, accepted)
        scalars.update(update_scalars, update_seconds=round(time.perf_counter() - start, 3))
        res = accepted.result
        arrays.update({"prompt_token_ids.npy": np.asarray(accepted.prompt, np.int32),
                       "completion_tokens.npy": res.tokens, "old_logprobs.npy": res.logprobs})
        event("update_end", traces, step=step, **{k: training[k] for k in ("status", "optimizer_steps")})
        log(f"step {step} update ({mode}): {training['status']}"
            + (f", loss {training['loss']:.6g}, grad norm {training['grad_norm']:.4g}" if "loss" in training else ""))
    training["optimizer_steps_total"] = optimizer.step
    training["lora_digest_before"] = lora_digest(model, inventory_before)
    training["lora_digest_after"] = lora_digest(model)
    save_lora(model, writer, evidence_dir, LORA_FILES[1])
    cleanup = {"prefix_cache_entries_dropped": len(sampler.prefix_cache), "prefix_cache_cleared": True}
    sampler.prefix_cache.clear()
    event("step_done", traces, step=step, status=training["status"])

    if writer is not None:
        lora_sha256 = write_artifacts(writer, spec, arrays=arrays, seeds=seeds, stop_ids=stop_ids,
                                      candidates=candidates, samples=samples,
                                      inventories=(inventory_before, inventory_after), cleanup=cleanup)
        # The files' sha256 (verify checks them against the manifest, and the digests against the files' values).
        training["lora_sha256_before"], training["lora_sha256_after"] = (lora_sha256[n] for n in LORA_FILES)
    rank_paths = write_rank_records(writer, evidence_dir, step, traces)
    receipt = evidence_dir / RECEIPT_NAME
    if writer is not None:
        fields = receipt_fields(inputs, model.cfg, step=step, cursor=cursor, candidates=candidates, samples=samples,
                                accepted=accepted, training=training, numerics=numerics, cleanup=cleanup,
                                traces=traces, probe=probe, rank_paths=rank_paths)
        receipt = writer.commit(fields)
        log(f"step {step} receipt: {receipt}")
    return {"step": step, "receipt": str(receipt), "status": training["status"], "candidates": len(candidates),
            "accepted": None if accepted is None else accepted.index, "training": training, "scalars": scalars,
            "accepted_rewards": None if accepted is None else [float(r) for r in accepted.rewards]}
