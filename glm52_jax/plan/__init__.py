"""AOT plan mode: per-device memory, FLOPs and collectives of the run's programs, without weights.

`plan(...)` builds the model abstractly (`nnx.eval_shape`: no parameter is ever materialised),
gives every parameter and input a `jax.ShapeDtypeStruct` carrying the `NamedSharding` its
logical axes get under the mesh's rules (as `load_pretrained(..., shardings=mesh)` places real
weights), and lowers + compiles the programs a GRPO transaction runs, at the configured shapes:

  prefill  with prefill_mode="chunked" (the sampler's default), `rollout.sampler.prefill_chunk`:
           `forward_cached` of one [1, S=chunk_size] chunk against the batch-1 cache of the full
           sampler capacity C (cache in and out, not donated, as the sampler jits it): the sampler
           runs ceil(P / S) calls of this one executable (later chunks only run more trips of the
           indexer's data-dependent key loop, with the same buffers). With prefill_mode="whole",
           `rollout.sampler.prefill_whole`: `model.prefill` of ids [1, P], the explicit
           context-parallel forward that also emits the cache (one call).
  forward  (optional) `model.hidden_states` on ids [1, P]: the uncached whole-prompt forward.
           The sampler never runs it; `conventional` training (per sample) and `token_logprobs`
           do. For comparison, when asked for in `programs`.
  decode   `rollout.sampler.decode_steps` exactly: a scan of R = max_new_tokens steps for the
           S sampled rows against the one batch-1 prompt cache (read only, not donated) and the rows'
           suffix cache of R slots (donated, as the sampler gives it, so the loop updates it in
           place), each step logits + sampling + one `forward_shared` token.
           One step is the loop body: the per-body columns; executed = x R.
  train    one optimizer step: `rl.gradients.compute_gradients` in the configured mode (G
           per-sample backwards, accumulated; response_only takes the sampler's prefix cache as an
           input) then the `rl.update` transform (global-norm clip + AdamW) and `apply_updates`,
           fused in one program whose inputs include the AdamW moments (sharded like the
           adapters), so its arguments are everything resident during the step.

Every program keeps all its inputs (`keep_unused=True`): state a program does not read (the
lm_head in prefill) is still resident on the device. Every number is per device, read from the
compiled SPMD-partitioned executable: memory from `compiled.memory_analysis()`, FLOPs both from
`compiled.cost_analysis()` (loop bodies once) and from the HLO text counted op by op times known
loop trip counts, collectives from the HLO text (`hlo.py`; `NOTES`, copied into each report, says
exactly what each number is).

Compile target (`target`, the config's `plan.target`): "h20" / "h200" compile every program with
XLA's GPU compiler, deviceless (`kernels.aot`, the gpu-aot extra), for a topology of hosts x 8 GPUs
(`targets.topology_for`: 32 -> 4x1x8; up to 8 GPUs, one host), judge `fits` against the target's
memory (the efficiency table's, measured where it was) x the XLA_PYTHON_CLIENT_MEM_FRACTION the launcher
sets (0.90), and estimate each program's time per kernel (`kernel_cost`: every kernel the program launches at
its class's measured or assumed efficiency, with the real trip counts of the model's data-dependent loops from
`loop_trips`, collectives by kind and link) in three scenarios from the efficiency table (`efficiency`), and the
first candidate's. "cpu": the process's devices; plan
mode normally runs on a virtual CPU mesh (`ensure_virtual_devices`, which must run before JAX
starts), with LLVM optimisation off (`FAST_CPU_COMPILE`; the plan never runs code). XLA:CPU differs
from a GPU build in ways the numbers show: `lax.ragged_dot` (the MoE) is lowered densely over the
local experts, and bf16 collectives are converted to f32. Treat its bytes as an estimate of the GPU
plan, exact for arguments; it models no time.

Modules: hlo (HLO text parsing and counting, pure Python), hlo_traffic (HBM bytes and collective
bytes by link, pure Python), kernel_cost (the per-kernel time estimate, pure Python), efficiency (the
efficiency table it reads), loop_trips (data-dependent loop trip counts), estimate (the one-forward estimate
CLI), calibrate (a new efficiency table from a GPU's measurements), targets (plan.target, topology, budget; no JAX),
devices (virtual devices, no JAX at import), capacity, abstract (abstract state / caches / inputs),
programs (the program builders), measure (compile and read the executable), static (the analytic
report part), report (verdict, NOTES, the readable table; pure Python), planner (`plan`). Import
from the modules (`glm52_jax.plan.planner.plan`, `glm52_jax.plan.devices.ensure_virtual_devices`):
this package file imports nothing, so the devices module loads without JAX, before it starts.

Axis letters: P prompt tokens, S chunk tokens, G samples, R response tokens (= max_new_tokens),
C cache capacity (slots), D model dim, E routed experts.
"""
