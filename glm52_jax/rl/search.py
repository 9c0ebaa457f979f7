"""Bounded candidate search: S samples per exact-N prompt, DAPO rewards, stop at the first request whose
rewards differ; its group of G samples (`rl.group.choose_group`; S = G by default) is what the update trains on."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from glm52_jax.rl import processes
from glm52_jax.rl.group import choose_group
from glm52_jax.rl.inputs import RunInputs, exact_prompt
from glm52_jax.rl.numerics import check_sampled
from glm52_jax.rl.samples import REQUEST_CANDIDATE, REQUEST_PROBE, jsonl_bytes, request_records
from glm52_jax.rl.settings import sampling_params


@dataclasses.dataclass
class Accepted:
    """The first candidate whose rewards differ, reduced to its group: what the update trains on."""

    index: int  # candidate number within the search
    row: Any  # DapoRow
    prompt: list[int]  # [P] exact-N prompt ids
    result: Any  # rollout.sampler.SampleResult of the group: tokens [G,R], lengths [G], logprobs [G,R], ...
    rewards: list[float]  # [G]
    samples: list[int]  # [G] the group's indices among the request's S samples (`rl.group.choose_group`)


def group_result(result, samples: list[int]):
    """The `SampleResult` of samples `samples` of a request (rows in that order)."""
    rows = np.asarray(samples)
    return dataclasses.replace(result, tokens=result.tokens[rows], logprobs=result.logprobs[rows],
                               lengths=result.lengths[rows],
                               finish_reasons=[result.finish_reasons[j] for j in samples])


def candidate_seeds(step_key, count: int) -> list[int]:
    """Per-candidate sampling seeds drawn from the run's RNG (saved in every checkpoint)."""
    import jax

    return [int(x) for x in np.asarray(jax.random.randint(step_key, (count,), 0, 2**31 - 1))]


def probe_seed(step_key) -> int:
    """The engine probe's sampling seed: from its own stream (the candidates' seeds stay as without a probe)."""
    import jax

    return candidate_seeds(jax.random.fold_in(step_key, 1), 1)[0]


def _texts(inputs: RunInputs, res) -> list[str]:
    # Special tokens (the stop token) are not part of the answer text the reward parses.
    return [inputs.tokenizer.decode(res.completion(j), skip_special_tokens=True) for j in range(len(res.lengths))]


def engine_probe(inputs: RunInputs, cursor: int, seed: int, sampler, n_tokens: int) -> tuple[dict, dict, list[dict]]:
    """One short request before the long ones (`search.probe_tokens`): the exact-`n_tokens` prompt of the
    row at `cursor`, S samples (`sampling.per_request`) with the run's sampling settings.

    Returns (the receipt's "probe" section with its own decode audit, its timing (nondeterministic), its
    sampler records). The probe's prompt KV is dropped from the prefix cache afterwards, so the candidates
    run as they would without it.
    """
    from glm52_jax.rl import decode_audit

    spec = inputs.spec
    row = inputs.rows[cursor % len(inputs.rows)]
    prompt = exact_prompt(inputs.tokenizer, row, n_tokens, flag=f"--config.search.probe_tokens={n_tokens}")
    stop_ids = tuple(int(i) for i in sampler.cfg.eos_token_id)
    res = sampler.sample(prompt, sampling_params(spec.sampling, stop_ids, seed))
    sampler.prefix_cache.clear()
    check_sampled(f"engine probe ({n_tokens}-token prompt)", res.logprobs, res.lengths)
    texts = _texts(inputs, res)
    records = request_records(REQUEST_PROBE, None, row.index, prompt, seed, res, texts)
    section = {"prompt_tokens": len(prompt), "row": row.index, "seed": seed,
               "prompt_sha256": records[0]["prompt_sha256"], "tokens": [r["tokens"] for r in records],
               "texts": texts, "lengths": res.lengths.tolist(), "finish_reasons": res.finish_reasons,
               "decode_audit": decode_audit.audit(records)}
    timing = {"prefill_seconds": round(res.prefill_seconds, 3), "decode_seconds": round(res.decode_seconds, 3)}
    return section, timing, records


def search_group(inputs: RunInputs, cursor: int, seeds: list[int], sampler, *, step: int,
                 event: Callable[..., None], log: Callable[[str], None],
                 samples: list[dict] | None = None) -> tuple[list[dict], Accepted | None]:
    """Samples candidates (rows from data position `cursor`), S samples each, until a request's rewards differ.

    Returns (one record per candidate tried (every sample's reward), the accepted group or None); appends every
    sample's raw record (`rl.samples`) to `samples` when given. Timings go to `event` only: the receipt's
    other sections must reproduce bit for bit.
    """
    from glm52_jax.rl.rewards.dapo import compute_score

    spec = inputs.spec
    g = spec.sampling.num_samples
    stop_ids = tuple(int(i) for i in sampler.cfg.eos_token_id)
    candidates = []
    for i in range(spec.search.max_candidates):
        row, prompt = inputs.candidate(cursor, i)
        res = sampler.sample(prompt, sampling_params(spec.sampling, stop_ids, seeds[i]))
        check_sampled(f"step {step} candidate {i}", res.logprobs, res.lengths)  # before a NaN steers the search
        texts = _texts(inputs, res)
        records = request_records(REQUEST_CANDIDATE, i, row.index, prompt, seeds[i], res, texts)
        if samples is not None:
            samples += records
        start = time.perf_counter()
        scores = [compute_score(text, row.ground_truth, boxed_fallback=spec.reward.boxed_fallback) for text in texts]
        reward_seconds = time.perf_counter() - start
        rewards = [float(sc["score"]) for sc in scores]
        # Several processes: the same tokens and rewards everywhere before the rewards steer the search.
        processes.check_same_samples(f"step {step} candidate {i}", jsonl_bytes(records), rewards)
        candidates.append({"candidate": i, "row": row.index, "ground_truth": row.ground_truth, "rewards": rewards,
                           "preds": [sc["pred"] for sc in scores], "texts": texts, "lengths": res.lengths.tolist(),
                           "finish_reasons": res.finish_reasons, "prefix_hit_tokens": res.prefix_hit_tokens,
                           "seed": seeds[i]})
        event("candidate", step=step, candidate=i, row=row.index, rewards=rewards,
              prefix_hit_tokens=res.prefix_hit_tokens, prefill_seconds=round(res.prefill_seconds, 3),
              decode_seconds=round(res.decode_seconds, 3), reward_seconds=round(reward_seconds, 3))
        log(f"step {step} candidate {i}: row {row.index} rewards {rewards} (prefix hit {res.prefix_hit_tokens} tokens)")
        group = choose_group(rewards, g)
        if group is not None:
            return candidates, Accepted(i, row, prompt, group_result(res, group), [rewards[j] for j in group], group)
    return candidates, None


def response_batch(accepted: Accepted, pad_id: int, max_new_tokens: int):
    """(responses [G,R] int32 with pads after each sample's end, mask [G,R] float32, advantages [G])."""
    import jax.numpy as jnp

    from glm52_jax.rl import grpo

    res = accepted.result
    mask = (np.arange(max_new_tokens)[None, :] < res.lengths[:, None]).astype(np.float32)
    responses = np.where(mask > 0, res.tokens, pad_id).astype(np.int32)
    rewards = jnp.asarray(accepted.rewards, jnp.float32)
    advantages = np.asarray(grpo.group_advantages(rewards, group_size=len(accepted.rewards)))
    return responses, mask, advantages
