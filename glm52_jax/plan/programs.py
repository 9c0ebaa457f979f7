"""The programs a GRPO transaction runs, as functions to jit plus abstract arguments.

Each builder takes a `PlanSetup` and returns a `Program`: the very functions the sampler and the
trainer jit (`rollout.sampler.prefill_chunk` / `prefill_whole` / `decode_steps`,
`rl.gradients.compute_gradients`) wrapped to take the abstract state, with the sampler's compiler
options. Shapes: P prompt tokens, S chunk tokens, G samples, R response tokens, C cache slots,
D model dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from glm52_jax.checkpoint import digest
from glm52_jax.model.lora import LoRA
from glm52_jax.plan.abstract import abstract_cache, abstract_suffix, model_segments, sds, sds_even
from glm52_jax.rl import gradients, update
from glm52_jax.rollout import sampler


@dataclasses.dataclass(frozen=True)
class PlanSetup:
    """What every program builder reads: the model, its abstract state on the mesh, and the run's shapes."""

    cfg: Any  # ModelConfig
    opts: Any  # ModelOptions (param_dtype and lora already set)
    mesh: Any  # jax.sharding.Mesh
    graphdef: nnx.GraphDef
    state: nnx.State  # every array a sharded ShapeDtypeStruct (`abstract_model`)
    prompt_tokens: int  # P
    max_new_tokens: int  # R
    num_samples: int  # G
    chunk_size: int  # S
    prefill_mode: str  # "chunked" or "whole"
    capacity: int  # C, cache slots the programs are planned with
    gradient_mode: str
    logprob_chunk: int
    donate_cache: bool
    samples_per_request: int = 0  # S rows the sampler decodes per request; 0 = G (`sampling.samples_per_request`)
    probe_tokens: int = 0  # the engine probe's prompt (`search.probe_tokens`); 0 = no probe
    probe_capacity: int = 0  # its cache's slots (the sampler's rule, as for `capacity`)

    @property
    def decode_rows(self) -> int:
        """Rows of the decode program and its cache: every sample of a request (S), not only the group (G)."""
        return self.samples_per_request or self.num_samples

    def cache(self, batch: int):
        """The abstract `batch`-row cache of C slots."""
        return abstract_cache(self.cfg, model_segments(self.cfg), batch, self.capacity, self.opts.param_dtype,
                              self.mesh, self.opts.cache_dtype)

    def suffix(self, rows: int):
        """The abstract per-sample suffix of `rows` x R slots the decode loop carries."""
        return abstract_suffix(self.cfg, model_segments(self.cfg), rows, self.max_new_tokens, self.opts.param_dtype,
                               self.mesh, self.opts.cache_dtype)


class Program(NamedTuple):
    fn: Callable  # the function to jit
    args: tuple  # its abstract arguments
    jit_kwargs: dict  # compiler_options / donate_argnums as the run jits it
    what: str  # one line for the report
    calls: int  # executions per GRPO transaction


def prefill_program(s: PlanSetup) -> Program:
    """prefill_mode="chunked": one `prefill_chunk` call, ids [1,S] against the batch-1 cache of C
    slots (cache in and out, as the sampler jits it; ceil(P/S) calls of this executable per
    transaction). "whole": `prefill_whole` of ids [1,P] (one call). The jitted wrappers carry the sampler
    functions' names, which prefix the HLO op names (`jit(prefill_chunk)/...`)."""
    graphdef = s.graphdef
    if s.prefill_mode == "whole":
        def prefill_whole(state, ids):
            return sampler.prefill_whole(nnx.merge(graphdef, state), ids, s.capacity)

        ids = sds_even((1, s.prompt_tokens), "int32", s.mesh, ("batch", "seq"))
        what = (f"sampler.prefill_whole: model.prefill of ids [1,{s.prompt_tokens}] (context-parallel forward) "
                f"-> h_last and the batch-1 cache (capacity {s.capacity})")
        return Program(prefill_whole, (s.state, ids), {}, what, 1)

    def prefill_chunk(state, ids, cache):
        return sampler.prefill_chunk(nnx.merge(graphdef, state), ids, cache)

    ids = sds_even((1, s.chunk_size), "int32", s.mesh, ("batch", "seq"))
    kw = dict(compiler_options=sampler.CACHE_COMPILER_OPTIONS, donate_argnums=(2,) if s.donate_cache else ())
    what = (f"sampler.prefill_chunk: forward_cached of ids [1,{s.chunk_size}] against the batch-1 cache "
            f"(capacity {s.capacity}); cache in and out{' (donated)' if s.donate_cache else ', not donated'}")
    return Program(prefill_chunk, (s.state, ids, s.cache(1)), kw, what, -(-s.prompt_tokens // s.chunk_size))


def prefill_tail_program(s: PlanSetup) -> Program | None:
    """prefill_mode="whole": a later candidate of the same filler finds the prompt in the prefix cache and
    runs only its tail as `prefill_chunk` calls of `chunk_size` against the full-capacity cache (one call
    planned per candidate: the tail is the question). None in "chunked" mode, where that is "prefill"."""
    if s.prefill_mode != "whole":
        return None
    program = prefill_program(dataclasses.replace(s, prefill_mode="chunked"))
    return program._replace(what=f"later candidates' prompt tail after a prefix-cache hit: {program.what}", calls=1)


def forward_program(s: PlanSetup) -> Program:
    """`model.hidden_states` on ids [1,P]: the uncached whole-prompt forward (a reference; the
    sampler never runs it, `conventional` training and `token_logprobs` do)."""
    graphdef = s.graphdef

    def forward(state, ids):
        return nnx.merge(graphdef, state).hidden_states(ids)

    ids = sds_even((1, s.prompt_tokens), "int32", s.mesh, ("batch", "seq"))
    what = f"model.hidden_states on ids [1,{s.prompt_tokens}]: uncached whole-prompt forward (not run by the sampler)"
    return Program(forward, (s.state, ids), {}, what, 1)


def decode_program(s: PlanSetup) -> Program:
    """`decode_steps` exactly (temperature 1, no top-k / top-p): a scan of R steps for the S rows of a
    request (`decode_rows`; S = G unless `sampling.samples_per_request` says more) against the one
    batch-1 prompt cache (read only) and the S rows' suffix of R slots (the carry). A one-step program
    would not do: its suffix update is dead code (only tokens and log-probs leave the scan) and XLA
    deletes the forward."""
    graphdef, stop_ids, steps = s.graphdef, tuple(int(t) for t in s.cfg.eos_token_id), s.max_new_tokens

    def decode(state, prompt, suffix, h_last, keys):
        return sampler.decode_steps(nnx.merge(graphdef, state), prompt, suffix, h_last, keys, None, steps=steps,
                                    temperature=1.0, top_k=0, top_p=1.0, stop_ids=stop_ids)

    g = s.decode_rows
    h_last = sds_even((g, s.cfg.hidden_size), s.opts.param_dtype, s.mesh, ("batch", "embed"))
    key_shape = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), g))
    keys = sds(key_shape.shape, key_shape.dtype, s.mesh, None)
    # The suffix donated as the sampler donates it (fresh per request): the loop runs on its buffers. The
    # prompt cache is not: the sampler's prefix cache keeps it.
    kw = dict(compiler_options=sampler.CACHE_COMPILER_OPTIONS, donate_argnums=(2,))
    what = (f"sampler.decode_steps: scan of max_new_tokens={steps} steps for S={g} rows against the batch-1 prompt "
            f"cache (capacity {s.capacity}, shared, read only) and the S rows' suffix ({steps} slots, donated); "
            f"one step = the loop body (per-body columns), executed = x {steps}")
    return Program(decode, (s.state, s.cache(1), s.suffix(g), h_last, keys), kw, what, 1)


def train_program(s: PlanSetup, adamw) -> Program:
    """One optimizer step exactly as the run compiles it: `rl.update.grpo_step` (gradients in the configured
    mode, global norm, finiteness flags, the AdamW transform of `adamw` (an `rl.update.AdamWConfig`) and
    `apply_updates`), one program whose inputs include the AdamW moments (sharded like the adapters) and whose
    outputs include the accumulated gradients: everything resident during the step."""
    graphdef, mode, chunk = s.graphdef, s.gradient_mode, s.logprob_chunk
    tx = adamw.transform()
    settings = gradients.LossSettings()
    # The LoRA / frozen split of the abstract state, as `split_lora` does for a real model.
    lora_graphdef, lora, frozen = nnx.split(nnx.merge(graphdef, s.state), LoRA, ...)
    if not jax.tree.leaves(lora):
        raise ValueError("plan: the train program needs LoRA adapters (pass lora=LoRAConfig(...))")
    pure = nnx.as_pure(lora)
    # Optimizer state: shapes from tx.init; AdamW's moments sharded like the adapters they track
    # (as `LoRAOptimizer`'s eager zeros_like leaves them), everything else (step count) replicated.
    replicated = NamedSharding(s.mesh, P())
    opt_state = optax.tree_map_params(
        tx, lambda leaf, param: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=param.sharding),
        jax.eval_shape(tx.init, pure), pure,
        transform_non_params=lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=replicated))

    def train_step(lora, frozen, opt_state, prompt, responses, mask, old, adv, prefix):
        return update.grpo_step(adamw, lora_graphdef, lora, frozen, opt_state, prompt, responses, mask, old, adv,
                                prefix, mode=mode, settings=settings, chunk=chunk)

    g, r, p = s.num_samples, s.max_new_tokens, s.prompt_tokens
    prompt = sds_even((p,), "int32", s.mesh, ("seq",))
    responses = sds((g, r), "int32", s.mesh, None)
    floats = [sds(shape, "float32", s.mesh, None) for shape in ((g, r), (g, r), (g,))]
    # response_only: the sampler's batch-1 prompt cache, as the transaction passes it.
    prefix = s.cache(1) if mode == "response_only" else None
    what = (f"one GRPO step, gradient_mode={mode}: G={g} per-sample backwards over R={r} response tokens "
            f"(prompt P={p}{', prefix cache input' if prefix is not None else ''}) + clip + AdamW on the LoRA")
    return Program(train_step, (lora, frozen, opt_state, prompt, responses, *floats, prefix), {}, what, 1)


def new_logprobs_program(s: PlanSetup) -> Program:
    """The log-probs recorded after the update: `gradients.cached_response_logprobs`, the G responses
    against the sampler's batch-1 prompt cache (R tokens per sample, no whole-sequence forward)."""
    graphdef, chunk = s.graphdef, s.logprob_chunk

    def new_logprobs(state, prefix, prompt, responses):
        return gradients.cached_response_logprobs(graphdef, state, prefix, prompt, responses, chunk=chunk)

    g, r, p = s.num_samples, s.max_new_tokens, s.prompt_tokens
    args = (s.state, s.cache(1), sds_even((p,), "int32", s.mesh, ("seq",)), sds((g, r), "int32", s.mesh, None))
    what = (f"new log-probs after the update: G={g} x R={r} response tokens against the batch-1 prompt cache "
            f"(capacity {s.capacity})")
    return Program(new_logprobs, args, {}, what, 1)


def inventory_program(s: PlanSetup) -> Program:
    """The parameter inventory taken before and after sampling: `checkpoint.digest`'s on-device digest
    of every array of the state, one [n_arrays, 4] uint32 table out (no weight leaves its device)."""

    def inventory(state):
        return jnp.stack([digest.array_digest(x) for x in jax.tree.leaves(state)])

    n = len(jax.tree.leaves(s.state))
    return Program(inventory, (s.state,), {}, f"parameter inventory: on-device digests of {n} arrays", 2)


def probe_setup(s: PlanSetup) -> PlanSetup | None:
    """The engine probe's request (`search.probe_tokens` prompt tokens, the same R, S and prefill mode) as
    a setup of its own: its prefill and decode are programs of their own shapes. None without a probe."""
    if not s.probe_tokens:
        return None
    return dataclasses.replace(s, prompt_tokens=s.probe_tokens, capacity=s.probe_capacity, probe_tokens=0)


def _probe(builder: Callable[[PlanSetup], Program], s: PlanSetup) -> Program | None:
    probe = probe_setup(s)
    if probe is None:
        return None
    program = builder(probe)
    return program._replace(what=f"engine probe ({s.probe_tokens} prompt tokens): {program.what}")


# name -> builder(setup, adamw), one per `choices.PLAN_PROGRAMS`; "forward" is a reference, not part of
# a transaction. A builder returns None for a program the run does not execute (the probe's, without one).
BUILDERS: dict[str, Callable[[PlanSetup, Any], Program | None]] = {
    "prefill": lambda s, adamw: prefill_program(s),
    "prefill_tail": lambda s, adamw: prefill_tail_program(s),
    "forward": lambda s, adamw: forward_program(s),
    "decode": lambda s, adamw: decode_program(s),
    "train": train_program,
    "new_logprobs": lambda s, adamw: new_logprobs_program(s),
    "inventory": lambda s, adamw: inventory_program(s),
    "probe_prefill": lambda s, adamw: _probe(prefill_program, s),
    "probe_decode": lambda s, adamw: _probe(decode_program, s),
}
