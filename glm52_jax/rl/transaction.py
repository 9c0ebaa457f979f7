"""One online GRPO transaction (DESIGN §1): search, sample, reward, one update, evidence.

    load policy + LoRA -> bounded candidate search (exact-N prompt, G samples, DAPO reward; accept
    the first group whose rewards differ) -> parameter inventory unchanged by sampling -> G
    backwards in the configured gradient mode, exactly one AdamW step -> receipt + manifest.

Everything that can be checked cheaply (config values, checkpoint directory, data rows, prompt
length against the position capacity, an existing receipt) is checked before the model loads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

MODES = ("conventional", "response_only", "shared_prefix")
EMBEDDED_POLICY = Path(__file__).resolve().parents[1] / "assets" / "tiny_policy"


class ConfigError(ValueError):
    """A config value that cannot run; raised before any expensive work."""


@dataclasses.dataclass
class Plan:
    """What the checks resolved: where the model comes from and the candidate prompts."""

    checkpoint: Path | None  # None: seeded random init of `preset`
    model_cfg: Any  # ModelConfig
    rows: list  # DapoRow per candidate of the first transaction
    prompts: list[list[int]]  # exact-N token ids per candidate of the first transaction
    all_rows: list = dataclasses.field(default_factory=list)  # every row; later transactions read on
    tokenizer: Any = None  # rollout.tokenizer.Tokenizer used for prompts and completions

    def candidate(self, c, cursor: int) -> tuple[Any, list[int]]:
        """Row and exact-N prompt at data position `cursor` (wrapping around the rows)."""
        from glm52_jax.rl.prompts import build_exact_prompt

        row = self.all_rows[cursor % len(self.all_rows)]
        try:
            return row, build_exact_prompt(self.tokenizer, row, c.data.prompt_tokens)
        except ValueError as e:
            raise ConfigError(f"data.prompt_tokens: row {row.index}: {e}") from None


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def rope_scaling(c):
    """The position-extension payload to apply: (RopeScaling | None, where it came from).

    `model.rope_scaling_json` (a file) or `$GLM52_ROPE_SCALING_JSON`; native positions when neither
    is set. Both set to different files is ambiguous and refused.
    """
    from glm52_jax import positions

    env = os.environ.get(positions.ROPE_SCALING_ENV, "")
    path = c.model.get("rope_scaling_json", "") or ""
    if path and env and Path(path).resolve() != Path(env).resolve():
        raise ConfigError(f"model.rope_scaling_json={path!r} and ${positions.ROPE_SCALING_ENV}={env!r} name different "
                          "payloads; set one")
    source = f"model.rope_scaling_json={path!r}" if path else f"${positions.ROPE_SCALING_ENV}={env!r}"
    if not (path or env):
        return None, ""
    try:
        return positions.load_rope_scaling(path or env), source
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None


def tokenizer_for(c, checkpoint: Path | None):
    """`model.tokenizer` (a tokenizer.json or its directory); "" = the checkpoint's tokenizer.json when
    it ships one (a real release), else the project's tiny tokenizer (embedded policy, random init)."""
    from glm52_jax.rollout.tokenizer import Tokenizer

    source = c.model.get("tokenizer", "") or ""
    if not source and checkpoint is not None and (checkpoint / "tokenizer.json").is_file():
        source = str(checkpoint)
    if not source:
        return Tokenizer.default()
    try:
        return Tokenizer(source)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"model.tokenizer: {e}") from None


def mesh_spec(c):
    """The configured `MeshSpec` (`mesh` = "" or e.g. "folded=32", "context=4,expert=2")."""
    from glm52_jax.parallel.mesh import MeshSpec, parse_mesh

    text = c.get("mesh", "") or ""
    if not text:
        return MeshSpec()
    try:
        return parse_mesh(text)
    except ValueError as e:
        raise ConfigError(f"mesh: {e}") from None


def check_config(c) -> Plan:
    """Validates the config and resolves checkpoint, rows and prompts (no model is built)."""
    from glm52_jax import config as config_lib
    from glm52_jax.model.lora import FAMILIES
    from glm52_jax.rl.data import load_rows
    from glm52_jax.rl.prompts import build_exact_prompt

    s, t, m = c.sampling, c.train, c.model
    _require(t.gradient_mode in MODES, f"train.gradient_mode must be one of {MODES}, got {t.gradient_mode!r}")
    _require(isinstance(s.num_samples, int) and s.num_samples >= 2,
             f"sampling.num_samples (G) must be an integer >= 2 for GRPO, got {s.num_samples!r}")
    _require(isinstance(c.search.max_candidates, int) and c.search.max_candidates >= 1,
             f"search.max_candidates must be a positive integer, got {c.search.max_candidates!r}")
    _require(isinstance(m.lora_rank, int) and m.lora_rank >= 1, f"model.lora_rank must be >= 1, got {m.lora_rank!r}")
    bad = sorted(set(m.lora_families) - set(FAMILIES))
    _require(not bad, f"model.lora_families has unknown families {bad}; known: {list(FAMILIES)}")
    _require(m.dtype in ("float32", "bfloat16"), f"model.dtype must be float32 or bfloat16, got {m.dtype!r}")
    _require(t.learning_rate > 0, f"train.learning_rate must be > 0, got {t.learning_rate!r}")
    _require(s.chunk_size >= 1, f"sampling.chunk_size must be >= 1, got {s.chunk_size!r}")
    from glm52_jax.rollout.sampler import PREFILL_MODES
    _require(s.get("prefill_mode", "chunked") in PREFILL_MODES,
             f"sampling.prefill_mode must be one of {PREFILL_MODES}, got {s.get('prefill_mode')!r}")
    _require(isinstance(t.steps, int) and t.steps >= 1,
             f"train.steps (transactions in the run) must be a positive integer, got {t.steps!r}")

    mesh_spec(c)  # a malformed mesh fails here, before any model work
    scaling, scaling_source = rope_scaling(c)
    if m.checkpoint == "random":
        presets = {"tiny": config_lib.tiny, "glm52": config_lib.glm52}
        _require(m.preset in presets, f"model.preset must be one of {sorted(presets)}, got {m.preset!r}")
        checkpoint, model_cfg = None, presets[m.preset]()
    else:
        checkpoint = EMBEDDED_POLICY if m.checkpoint == "embedded" else Path(m.checkpoint)
        _require((checkpoint / "config.json").is_file(),
                 f"model.checkpoint: no config.json in {str(checkpoint)!r} (expected an HF checkpoint directory)")
        model_cfg = config_lib.ModelConfig.from_json_file(checkpoint / "config.json")
    if scaling is not None:
        try:
            model_cfg = model_cfg.with_rope_scaling(scaling)
        except ValueError as e:
            raise ConfigError(f"{scaling_source}: {e}") from None

    limit = model_cfg.max_position_embeddings
    need = c.data.prompt_tokens + s.max_new_tokens
    _require(need <= limit, f"data.prompt_tokens ({c.data.prompt_tokens}) + sampling.max_new_tokens "
             f"({s.max_new_tokens}) = {need} exceeds the position capacity max_position_embeddings={limit}"
             + (f" (with the rope scaling of {scaling_source})" if scaling is not None
                else " (no rope scaling: set model.rope_scaling_json or GLM52_ROPE_SCALING_JSON)"))

    try:
        all_rows = load_rows(c.data.path or None, dedupe=c.data.dedupe)
    except (ValueError, FileNotFoundError, ImportError) as e:  # broken rows name their file and line
        raise ConfigError(f"data.path: {e}") from None
    _require(len(all_rows) > 0, "data: no rows")
    tok = tokenizer_for(c, checkpoint)
    rows, prompts = [], []
    for i in range(c.search.max_candidates):
        row = all_rows[(c.data.first_row + i) % len(all_rows)]
        try:
            prompts.append(build_exact_prompt(tok, row, c.data.prompt_tokens))
        except ValueError as e:
            raise ConfigError(f"data.prompt_tokens: {e}") from None
        rows.append(row)
    _require(max(max(p) for p in prompts) < model_cfg.vocab_size,
             f"the tokenizer's ids exceed the model's vocab_size {model_cfg.vocab_size}")
    return Plan(checkpoint, model_cfg, rows, prompts, all_rows, tok)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _state_bytes(state) -> bytes:
    """An nnx.State of arrays as one safetensors blob (deterministic: names sorted, fixed header)."""
    import jax
    from flax import nnx
    from safetensors.numpy import save

    arrays = {"/".join(map(str, path)): np.ascontiguousarray(jax.device_get(var.get_value()))
              for path, var in nnx.to_flat_state(state)}
    return save(dict(sorted(arrays.items())))


def _lora_bytes(model) -> bytes:
    from flax import nnx

    from glm52_jax.model.lora import LoRA

    return _state_bytes(nnx.state(model, LoRA))


def _npy(array) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.asarray(array), allow_pickle=False)
    return buf.getvalue()


STEP_DIR = "step_{:06d}"
_STEP_RE = re.compile(r"step_(\d{6})")


def resume_config_hash(c) -> str:
    """Hash of the config minus `train.steps`: a finished run may be extended with more steps."""
    from glm52_jax.evidence import config_hash

    d = c.to_dict()
    d["train"] = {k: v for k, v in d["train"].items() if k != "steps"}
    return config_hash(d)


def set_aside_uncommitted(evidence_dir: Path, committed: int, log: Callable[[str], None]) -> list[str]:
    """Moves evidence of steps after the last checkpoint to `step_N.uncommitted-K` (never deletes).

    A step's receipt is committed before its checkpoint; a process killed in between (or during
    the step) leaves evidence for a step the state does not include. The step is rerun.
    """
    moved = []
    if not evidence_dir.is_dir():
        return moved
    for d in sorted(evidence_dir.iterdir()):
        match = _STEP_RE.fullmatch(d.name)
        if match and int(match.group(1)) > committed:
            k = 1
            while (dest := d.with_name(f"{d.name}.uncommitted-{k}")).exists():
                k += 1
            d.rename(dest)
            moved.append(dest.name)
            log(f"evidence of uncommitted step {d.name} moved to {dest.name} (the step reruns)")
    return moved


def build_policy(c, plan: Plan, mesh=None):
    """The base model (checkpoint or seeded init) with fresh LoRA adapters, and its AdamW state.

    With a `mesh` (and its rules table active) every weight, adapter and optimizer moment is
    sharded by its logical axes; checkpoint weights are read slice by slice per device.
    """
    import jax.numpy as jnp
    from flax import nnx

    from glm52_jax.checkpoint.hf import load_pretrained
    from glm52_jax.model.lora import LoRAConfig, attach_lora
    from glm52_jax.model.options import ModelOptions
    from glm52_jax.model.transformer import GlmMoeDsa
    from glm52_jax.parallel.placement import place_model
    from glm52_jax.rl.update import AdamWConfig, LoRAOptimizer

    m, t = c.model, c.train
    dtype = jnp.dtype(m.dtype)
    if plan.checkpoint is None:
        base = GlmMoeDsa(plan.model_cfg, ModelOptions(param_dtype=dtype), rngs=nnx.Rngs(c.seed))
    else:
        base = load_pretrained(plan.checkpoint, dtype=dtype, shardings=mesh, rope_scaling=rope_scaling(c)[0])
    if base.cfg != plan.model_cfg:
        raise ConfigError("the loaded model's config differs from the checked one")  # a bug, not bad input
    lora_cfg = LoRAConfig(rank=m.lora_rank, alpha=float(m.lora_alpha), families=frozenset(m.lora_families))
    model = attach_lora(base, lora_cfg, seed=c.seed)
    if mesh is not None:
        model = place_model(model, mesh)  # the adapters (and a seeded base); placed weights stay put
    optimizer = LoRAOptimizer(model, AdamWConfig(learning_rate=float(t.learning_rate),
                                                 weight_decay=float(t.weight_decay),
                                                 max_grad_norm=t.max_grad_norm))
    return model, optimizer


def train_mesh(c):
    """(MeshSpec, Mesh) for train mode, or (spec, None) on one device; a mesh the process cannot
    build is a config error (before any model work)."""
    import jax

    spec = mesh_spec(c)
    if spec.size == 1:
        return spec, None
    if jax.process_count() > 1:
        raise ConfigError(f"mesh={c.mesh!r}: train mode runs in one process so far (multi-host sampling, evidence "
                          "and checkpoints are not wired yet); --mode=plan compiles the programs for this mesh")
    if jax.device_count() < spec.size:
        raise ConfigError(f"mesh={c.mesh!r} needs {spec.size} devices, this process has {jax.device_count()} "
                          f"({jax.devices()[0].platform}); on CPU set "
                          f"XLA_FLAGS=--xla_force_host_platform_device_count={spec.size}")
    return spec, spec.make(jax.devices()[:spec.size])


def base_name(plan: Plan, c) -> str:
    return str(plan.checkpoint or f"random:{c.model.preset}")


def _prefill_progress(event, log, chunk_size: int):
    """Sampler progress callback: every chunk to the metrics; to the console about every 10% when
    the prompt spans many chunks (a 2M prefill is 128 chunks of 16K and takes minutes)."""
    shown = [-1]

    def progress(done: int, total: int, rate: float, eta: float) -> None:
        event("prefill", done=done, total=total, tokens_per_s=round(rate, 1))
        if total < 8 * chunk_size:
            return
        tenth = done * 10 // total
        if tenth != shown[0] or done == total:
            shown[0] = tenth
            log(f"prefill {done:,}/{total:,} tokens ({100 * done / total:.0f}%), {rate:,.0f} tokens/s, "
                f"eta {eta:,.0f} s")

    return progress


def run_online(c, workdir: str | os.PathLike, *, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Runs (or resumes) `train.steps` transactions in `workdir`; returns a summary of the run.

    Per step k: `evidence/step_00000k/receipt.json` (committed first), then Orbax checkpoint k
    (LoRA, AdamW state, RNG, data cursor). A rerun with the same config resumes after the last
    checkpoint; evidence of a step without a checkpoint is set aside and the step reruns, which
    reproduces it (same state, same RNG).
    """
    workdir = Path(workdir)
    plan = check_config(c)
    spec, mesh = train_mesh(c)
    from glm52_jax.checkpoint.train_state import RunCheckpoints

    expect = {"config_sha256": resume_config_hash(c), "base": base_name(plan, c)}
    ckpts = RunCheckpoints(workdir / "checkpoints")
    latest = ckpts.latest_step() or 0
    if latest:
        ckpts.check_meta(latest, expect)  # another run's checkpoints: refuse before building anything
    if latest >= c.train.steps:
        log(f"run in {workdir} is complete: step {latest} of train.steps={c.train.steps}; nothing to do")
        return {"workdir": str(workdir), "steps_run": 0, "last_step": latest, "status": "complete", "steps": []}
    set_aside_uncommitted(workdir / "evidence", latest, log)
    metrics_path = workdir / "metrics.jsonl"
    t_start = time.perf_counter()

    def event(kind: str, traces: list | None = None, **fields):
        record = {"event": kind, "t": round(time.perf_counter() - t_start, 3), **fields}
        if traces is not None:
            traces.append(record)
        with open(metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    import jax

    from glm52_jax.parallel.rules import axis_rules

    with contextlib.ExitStack() as stack:
        if mesh is not None:
            stack.enter_context(axis_rules(spec.rules()))
        # Built before the mesh is set: nnx would read the params' logical names as mesh axes.
        model, optimizer = build_policy(c, plan, mesh)
        if mesh is not None:  # every program below is traced and run on the mesh
            stack.enter_context(jax.set_mesh(mesh))
            log(f"mesh {spec.describe()} over {spec.size} {jax.devices()[0].platform} devices")
        return _run_steps(c, plan, workdir, ckpts, latest, expect, event, log, model, optimizer)


def _run_steps(c, plan: Plan, workdir: Path, ckpts, latest: int, expect: dict, event, log, model,
               optimizer) -> dict[str, Any]:
    import jax

    from glm52_jax.checkpoint.train_state import RunState
    from glm52_jax.rollout.sampler import Sampler

    s, t = c.sampling, c.train
    if latest:
        state = ckpts.restore(latest, model, optimizer)
        event("resumed", step=latest, cursor=state.cursor)
        log(f"resumed from checkpoint step {latest} in {ckpts.directory}")
    else:
        state = RunState(step=0, rng=jax.random.key(c.seed), cursor=c.data.first_row, optimizer_steps=0, meta={})
    event("loaded", checkpoint=base_name(plan, c))
    sampler = Sampler(model, chunk_size=s.chunk_size, prefix_cache_bytes=int(s.prefix_cache_mib) << 20,
                      progress=_prefill_progress(event, log, s.chunk_size),
                      prefill_mode=s.get("prefill_mode", "chunked"))
    steps = []
    for step in range(state.step + 1, t.steps + 1):
        rng, step_key = jax.random.split(state.rng)
        result = _transaction(c, plan, step, step_key, state.cursor, model, optimizer, sampler,
                              workdir / "evidence" / STEP_DIR.format(step), event, log)
        state = RunState(step=step, rng=rng, cursor=state.cursor + result["candidates"],
                         optimizer_steps=optimizer.step, meta={**expect, "receipt": result["receipt"]})
        ckpts.save(model, optimizer, state)
        event("committed", step=step, checkpoint=str(ckpts.directory / str(step)))
        steps.append(result)
    ckpts.close()
    return {"workdir": str(workdir), "steps_run": len(steps), "last_step": state.step,
            "status": steps[-1]["status"], "steps": steps}


def search_group(c, plan: Plan, step: int, cursor: int, seeds: list[int], sampler, event, log):
    """Bounded candidate search: G samples per candidate prompt, DAPO rewards, stop at the first
    group whose rewards differ. Returns (candidate records, accepted (i, row, prompt, result,
    rewards) or None)."""
    from glm52_jax.rl.rewards.dapo import compute_score
    from glm52_jax.rollout.sampler import SamplingParams

    s, tok = c.sampling, plan.tokenizer
    stop_ids = tuple(int(i) for i in sampler.cfg.eos_token_id)
    candidates, accepted = [], None
    for i in range(c.search.max_candidates):
        # The first transaction's prompts were built (and checked) by check_config.
        row, prompt = (plan.rows[i], plan.prompts[i]) if step == 1 else plan.candidate(c, cursor + i)
        params = SamplingParams(max_new_tokens=s.max_new_tokens, temperature=float(s.temperature),
                                top_p=float(s.top_p), top_k=int(s.top_k), stop_token_ids=stop_ids,
                                num_samples=s.num_samples, seed=seeds[i])
        res = sampler.sample(prompt, params)
        # Special tokens (the stop token) are not part of the answer text the reward parses.
        texts = [tok.decode(res.completion(g), skip_special_tokens=True) for g in range(s.num_samples)]
        scores = [compute_score(text, row.ground_truth) for text in texts]
        rewards = [float(sc["score"]) for sc in scores]
        cand = {"candidate": i, "row": row.index, "ground_truth": row.ground_truth, "rewards": rewards,
                "preds": [sc["pred"] for sc in scores], "texts": texts, "lengths": res.lengths.tolist(),
                "finish_reasons": res.finish_reasons, "prefix_hit_tokens": res.prefix_hit_tokens, "seed": seeds[i]}
        candidates.append(cand)
        # Timings go to the traces only: the receipt's other sections must reproduce bit for bit.
        event("candidate", step=step, candidate=i, row=row.index, rewards=rewards,
              prefix_hit_tokens=res.prefix_hit_tokens, prefill_seconds=round(res.prefill_seconds, 3),
              decode_seconds=round(res.decode_seconds, 3))
        log(f"step {step} candidate {i}: row {row.index} rewards {rewards} (prefix hit {res.prefix_hit_tokens} tokens)")
        if len(set(rewards)) > 1:
            accepted = (i, row, prompt, res, rewards)
            break
    return candidates, accepted


def _transaction(c, plan: Plan, step: int, step_key, cursor: int, model, optimizer, sampler, evidence_dir: Path,
                 event, log) -> dict[str, Any]:
    """One transaction (search, sample, reward, update) with its receipt in `evidence_dir`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from glm52_jax.checkpoint.inventory import param_inventory
    from glm52_jax.evidence import EvidenceWriter, config_hash
    from glm52_jax.model.transformer import token_logprobs
    from glm52_jax.rl import grpo
    from glm52_jax.rl.gradients import LossSettings
    from glm52_jax.rl.update import NonFiniteGradientError, grpo_update

    writer = EvidenceWriter(evidence_dir)  # refuses an existing receipt before any compute
    traces: list[dict[str, Any]] = []
    m, s, t = c.model, c.sampling, c.train
    cfg = model.cfg
    inventory_before = param_inventory(model)
    lora_before = _lora_bytes(model)
    stop_ids = tuple(int(i) for i in cfg.eos_token_id)
    # Per-candidate sampling seeds come from the run's RNG (saved in every checkpoint).
    seeds = [int(x) for x in np.asarray(jax.random.randint(step_key, (c.search.max_candidates,), 0, 2**31 - 1))]
    event("step_start", traces, step=step, cursor=cursor)
    candidates, accepted = search_group(c, plan, step, cursor, seeds, sampler,
                                        lambda kind, **kw: event(kind, traces, **kw), log)

    inventory_after = param_inventory(model)
    sampling_changed = sorted(k for k in inventory_before if inventory_before[k] != inventory_after.get(k))
    if sampling_changed or inventory_before.keys() != inventory_after.keys():
        raise RuntimeError(f"sampling changed parameters: {sampling_changed[:5]}")

    training: dict[str, Any] = {"status": "no_mixed_group", "optimizer_steps": 0}
    numerics: dict[str, Any] = {"finite": True}
    arrays: dict[str, Any] = {}
    if accepted is not None:
        i, row, prompt, res, rewards = accepted
        g, n = s.num_samples, s.max_new_tokens
        mask = (np.arange(n)[None, :] < res.lengths[:, None]).astype(np.float32)
        responses = np.where(mask > 0, res.tokens, cfg.pad_token_id or 0).astype(np.int32)
        advantages = np.asarray(grpo.group_advantages(jnp.asarray(rewards, jnp.float32), group_size=g))
        prefix = None
        if t.gradient_mode == "response_only":  # reuse the sampler's prompt KV: no second prefill
            prefix, _, _ = sampler.prefill(prompt, sampler.capacity_for(len(prompt), n))
        loss_settings = LossSettings(clip_ratio_low=float(t.clip_ratio_low), clip_ratio_high=float(t.clip_ratio_high),
                                     loss_agg_mode=t.loss_agg_mode)
        event("update_start", traces, step=step, mode=t.gradient_mode)
        steps_before = optimizer.step
        try:
            upd = grpo_update(model, optimizer, np.asarray(prompt, np.int32), responses, mask, res.logprobs,
                              advantages, mode=t.gradient_mode, loss=loss_settings, prefix_cache=prefix)
        except NonFiniteGradientError as e:
            numerics = {"finite": False, "error": str(e)}
            training = {"status": "aborted_nonfinite", "optimizer_steps": 0, "mode": t.gradient_mode}
        else:
            sampler.policy_updated()  # cached prompt KV and the sampler's weights are now stale
            graphdef, state = nnx.split(model)
            logp_fn = jax.jit(lambda st, ids: token_logprobs(nnx.merge(graphdef, st), ids))
            ids = np.concatenate([np.repeat(np.asarray(prompt, np.int32)[None], g, 0), responses], axis=1)
            new_logprobs = np.asarray(logp_fn(state, jnp.asarray(ids)))[:, len(prompt) - 1:] * mask
            loss = float(upd.loss)
            training = {"status": "updated", "optimizer_steps": optimizer.step - steps_before,
                        "mode": t.gradient_mode, "loss": loss, "grad_norm": float(upd.grad_norm),
                        "metrics": {k: float(v) for k, v in upd.metrics.items()},
                        "grads_sha256": _sha256(_state_bytes(upd.grads)),
                        "advantages": advantages.tolist()}
            numerics = {"finite": bool(np.isfinite(loss) and np.isfinite(new_logprobs).all())}
            arrays = {"new_logprobs.npy": new_logprobs, "responses.npy": responses, "response_mask.npy": mask}
        arrays.update({"prompt_token_ids.npy": np.asarray(prompt, np.int32), "completion_tokens.npy": res.tokens,
                       "old_logprobs.npy": res.logprobs})
        event("update_end", traces, step=step, **{k: training[k] for k in ("status", "optimizer_steps")})
        log(f"step {step} update ({t.gradient_mode}): {training['status']}"
            + (f", loss {training['loss']:.6g}, grad norm {training['grad_norm']:.4g}" if "loss" in training else ""))
    lora_after = _lora_bytes(model)
    training["optimizer_steps_total"] = optimizer.step
    training["lora_sha256_before"] = _sha256(lora_before)
    training["lora_sha256_after"] = _sha256(lora_after)

    for name, array in sorted(arrays.items()):
        writer.add_array(name, array, kind="array")
    writer.add_json("sampling_params.json", {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                                             "max_new_tokens": s.max_new_tokens, "num_samples": s.num_samples,
                                             "stop_token_ids": list(stop_ids), "seeds": seeds[:len(candidates)]},
                    kind="sampling")
    writer.add_json("rewards.json", candidates, kind="rewards")
    writer.add_json("inventory_before_sampling.json", inventory_before, kind="inventory")
    writer.add_json("inventory_after_sampling.json", inventory_after, kind="inventory")
    writer.add_bytes("lora_before.safetensors", lora_before, kind="lora")
    writer.add_bytes("lora_after.safetensors", lora_after, kind="lora")
    cleanup = {"prefix_cache_entries_dropped": len(sampler.prefix_cache), "prefix_cache_cleared": True}
    sampler.prefix_cache.clear()
    writer.add_json("cleanup.json", cleanup, kind="cleanup")
    event("step_done", traces, step=step, status=training["status"])
    writer.add_bytes("traces/rank0.jsonl", "".join(json.dumps(r) + "\n" for r in traces).encode(), kind="trace")

    devices = jax.devices()
    fields = {
        "transaction": {"step": step, "data_cursor": cursor},
        "prompt": {"tokens": c.data.prompt_tokens, "filler": "deterministic, shared across rows"},
        "model": {"checkpoint": str(plan.checkpoint or f"random:{m.preset}"), "dtype": m.dtype,
                  "layers": cfg.num_hidden_layers, "full_indexer_layers": cfg.indexer_types.count("full"),
                  "lora": {"rank": m.lora_rank, "alpha": m.lora_alpha, "families": sorted(m.lora_families)}},
        "positions": {"rope_type": cfg.rope.rope_type, "max_position_embeddings": cfg.max_position_embeddings},
        "topology": {"platform": devices[0].platform, "devices": len(devices), "processes": jax.process_count(),
                     "mesh": mesh_spec(c).describe(), "mesh_devices": mesh_spec(c).size},
        "config": {"name": c.name, "sha256": config_hash(c.to_dict()), "resume_sha256": resume_config_hash(c)},
        "candidate_search": {"max_candidates": c.search.max_candidates, "tried": len(candidates),
                             "accepted": None if accepted is None else accepted[0]},
        "completions": [{"candidate": cd["candidate"], "texts": cd["texts"], "lengths": cd["lengths"],
                         "finish_reasons": cd["finish_reasons"]} for cd in candidates],
        "rewards": [cd["rewards"] for cd in candidates],
        "training": training,
        "numerics": numerics,
        "traces": {"ranks": 1, "events": len(traces)},
        "cleanup": cleanup,
        "nondeterministic": ["traces", "artifacts/traces/rank0.jsonl"],
    }
    receipt = writer.commit(fields)
    log(f"step {step} receipt: {receipt}")
    return {"step": step, "receipt": str(receipt), "status": training["status"], "candidates": len(candidates),
            "accepted": fields["candidate_search"]["accepted"], "training": training}
