"""`plan`: lower and compile the run's programs on a mesh from abstract weights and inputs."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp

from glm52_jax import choices
from glm52_jax.model.kv_cache import slot_capacity
from glm52_jax.model.loop_scopes import PASS_LOOP
from glm52_jax.model.options import ModelOptions
from glm52_jax.parallel.rules import axis_rules
from glm52_jax.plan import kernel_cost, loop_trips, targets
from glm52_jax.plan.abstract import abstract_model, tree_bytes, ways
from glm52_jax.plan.devices import check_device_count
from glm52_jax.plan.efficiency import load_table
from glm52_jax.plan.measure import measure
from glm52_jax.plan.programs import BUILDERS, PlanSetup
from glm52_jax.plan.report import PROGRAMS, assess, notes_for
from glm52_jax.plan.static import program_indexer_flops, static_report
from glm52_jax.rl.update import AdamWConfig


def _check_arguments(programs: tuple[str, ...], gradient_mode: str, prefill_mode: str, lora, **sizes: int) -> None:
    unknown = [p for p in programs if p not in PROGRAMS]
    if unknown or not programs:
        raise ValueError(f"plan: unknown program(s) {unknown}; choose from {PROGRAMS}")
    if gradient_mode not in choices.GRADIENT_MODES:
        raise ValueError(f"plan: gradient_mode must be one of {choices.GRADIENT_MODES}, got {gradient_mode!r}")
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"plan: {name} must be a positive integer, got {value!r}")
    if prefill_mode not in choices.PREFILL_MODES:
        raise ValueError(f"plan: prefill_mode must be 'chunked' or 'whole', got {prefill_mode!r}")
    if "train" in programs and lora is None:
        raise ValueError("plan: the train program trains LoRA adapters; pass lora=LoRAConfig(...)")


def plan(model_cfg, mesh_spec, *, prompt_tokens: int, max_new_tokens: int, num_samples: int,
         gradient_mode: str, lora, dtype, chunk_size: int, hbm_bytes: float = 96e9,
         programs: Iterable[str] = ("prefill", "decode", "train"), options=None, logprob_chunk: int = 1024,
         capacity_multiple: int = 256, donate_cache: bool = False, adamw=None, fast_compile: bool = True,
         prefill_mode: str = "chunked", samples_per_request: int = 0, probe_tokens: int = 0,
         target: str = "cpu", topology: str | None = None, xla_options: dict | None = None,
         base_fp8=None, efficiency_table: str | None = None,
         log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Lowers and compiles the run's programs on `mesh_spec` with abstract weights and inputs.

    model_cfg: `ModelConfig` (apply rope scaling beforehand, e.g. `with_env_rope_scaling()`).
    mesh_spec: `parallel.mesh.MeshSpec`; the process needs >= `mesh_spec.size` devices (the first
      ones are used; see `ensure_virtual_devices`).
    prompt_tokens P, max_new_tokens R, num_samples G, chunk_size (the sampler's prefill chunk),
      prefill_mode (the sampler's: "chunked" or "whole", which program "prefill" compiles),
      samples_per_request S (rows the decode program samples; 0 = G, `sampling.samples_per_request`),
      probe_tokens (`search.probe_tokens`: the engine probe's prompt, planned as probe_prefill / probe_decode;
      0 = no probe, and those programs are skipped),
      gradient_mode (`rl.gradients.MODES`), lora (`LoRAConfig`; required for "train"), dtype
      (parameter/activation dtype).
    options: `ModelOptions` overrides (block sizes, remat); its param_dtype / lora are replaced by
      `dtype` / `lora`. donate_cache: donate the cache to the chunked prefill (the sampler does not: its prefix
      cache keeps the old one); decode always takes a donated cache, as the sampler gives it.
    fast_compile: on CPU, skip LLVM optimisation (`FAST_CPU_COMPILE`; the plan never runs code).
    adamw: `rl.update.AdamWConfig` of the train program (default: its defaults). log: progress lines.
    target: "cpu" (the process's devices, normally virtual CPU ones; fits against `hbm_bytes`) or a GPU
      target of `plan.targets.GPU_TARGETS`: every program compiled deviceless for CUDA on `topology`
      ("HOSTSx1xGPUS"; default `targets.topology_for(mesh size)`), fits against the target's memory x
      `targets.LAUNCHER_MEM_FRACTION`, and each program gets the per-kernel time estimate (`kernel_cost`, with
      the efficiency table `efficiency_table` names, default the packaged one: `efficiency.load_table`) in three
      scenarios, and the report the first candidate's (`first_candidate`).
    xla_options: XLA options the run sets (`parallel.xla_options`), given to every GPU compile; recorded in
      the report's target.
    base_fp8: the base weights' FP8 format on device (`checkpoint.hf_fp8.Fp8Config`: block and modules left
      out, `rl.inputs.base_fp8`), or None for weights of `dtype`; recorded as the report's model.base_weights.
    Returns a JSON-serialisable dict (see `format_plan`); per-device numbers throughout.
    """
    programs = tuple(programs)
    _check_arguments(programs, gradient_mode, prefill_mode, lora, prompt_tokens=prompt_tokens,
                     max_new_tokens=max_new_tokens, num_samples=num_samples, chunk_size=chunk_size)
    say = log or (lambda msg: None)
    if target not in targets.TARGETS:
        raise ValueError(f"plan: target must be one of {targets.TARGETS}, got {target!r}")
    gpu = target in targets.GPU_TARGETS
    mesh, topology = plan_mesh(mesh_spec, target, topology)
    dtype = jnp.dtype(dtype)
    opts = dataclasses.replace(options or ModelOptions(), param_dtype=dtype, lora=lora)
    table = load_table(efficiency_table) if gpu else None
    # The DSA implementation the programs trace with ("auto" picks Pallas for a GPU target), for the loops' blocks.
    resolved_kernels = "pallas" if gpu and opts.kernels in ("auto", "pallas") else "reference"
    adamw = adamw or AdamWConfig()

    with axis_rules(mesh_spec.rules()):
        setup = plan_setup(model_cfg, opts, mesh, prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens,
                           num_samples=num_samples, chunk_size=chunk_size, prefill_mode=prefill_mode,
                           gradient_mode=gradient_mode, logprob_chunk=logprob_chunk, donate_cache=donate_cache,
                           samples_per_request=samples_per_request, probe_tokens=probe_tokens,
                           capacity_multiple=capacity_multiple, base_fp8=base_fp8)
        report = static_report(setup, mesh_spec, lora, dtype, base_fp8)
        report["issues"] = []
        report["notes"] = notes_for(target)
        report["target"] = _target_record(target, topology if gpu else None, hbm_bytes, table)
        report["target"]["xla_options"] = dict(xla_options or {}) if gpu else {}
        if gpu:
            report["mesh"]["platform"] = f"cuda (deviceless {target}, topology {topology})"
        report["programs"] = {}
        for name in programs:
            program = BUILDERS[name](setup, adamw)
            if program is None:
                say(f"plan: {name}: not run by this configuration (probe_tokens = 0, or prefill_tail in chunked "
                    "mode, which is `prefill`), skipped")
                continue
            say(f"plan: lowering and compiling {name} ...")
            entry = {"what": program.what, "calls_per_transaction": program.calls,
                     "input_bytes_per_device": tree_bytes(program.args, per_device=True)}
            estimate = None
            if gpu:  # the per-kernel estimate, with this program's data-dependent loops at their real trip counts
                trips = loop_trips.for_program(setup, name, resolved_kernels)
                estimate = functools.partial(_estimate, table=table, target=target, trips=trips)
            try:
                entry.update(measure(program, mesh, fast_compile, target, xla_options, estimate))
            except Exception as err:  # XLA's JaxRuntimeError; a kernel too large for the target is the user's to fix
                from glm52_jax.kernels import aot

                if gpu and any(m in str(err) for m in aot.SHARED_MEMORY_MESSAGES):
                    first = str(err).strip().splitlines()[0]
                    raise aot.SharedMemoryError(
                        f"plan: program {name} does not compile for {target}: a Pallas kernel needs more shared "
                        f"memory than the GPU has ({first}); plan the jnp path with "
                        "--config.model.kernels=reference") from None
                raise
            fl = entry["flops"]
            # A grouped GEMM does 1/E of the dense lowering's work (see NOTES); balanced routing assumed.
            fl["flops_executed_grouped_gemm_estimate"] = (
                fl["flops_executed"] - fl["ragged_dot_flops_executed"] * (1 - 1 / model_cfg.n_routed_experts))
            fl["indexer_flops_analytic"] = program_indexer_flops(setup, name)
            for problem in (entry.get("time") or {}).get("loop_check", []):
                report["issues"].append(f"{name}: data-dependent loop trip counts may be off: {problem}")
            # Left out for the CPU target: XLA:CPU's kernels and buffers are not a GPU's.
            entry.setdefault("time", None)
            mem = entry["memory"]
            say(f"plan: {name}: total {mem['total_bytes'] / 1e9:.2f} GB/device, "
                f"compile {entry['seconds']['compile']} s"
                + (f", modeled {entry['time']['central_s']:.4g} s per call (central; "
                   f"{entry['time']['optimistic_s']:.4g}-{entry['time']['pessimistic_s']:.4g})" if gpu else ""))
            report["programs"][name] = entry
    if not report["programs"]:
        raise ValueError(f"plan: none of the programs {programs} runs in this configuration (the probe's need "
                         "search.probe_tokens > 0)")
    if gpu:
        report["first_candidate_s"] = first_candidate(report["programs"])
        report["model_version"] = table.version
    assess(report, report["target"]["budget_bytes"])
    return report


def plan_mesh(mesh_spec, target: str, topology: str | None = None):
    """(mesh, topology) the programs are planned on: the deviceless GPUs of `topology` (default
    `targets.topology_for(mesh size)`) for a GPU target, else the process's first devices (topology None)."""
    if target not in targets.GPU_TARGETS:
        check_device_count(mesh_spec)
        return mesh_spec.make(jax.devices()[: mesh_spec.size]), None
    from glm52_jax.kernels import aot

    topology = topology or targets.topology_for(mesh_spec.size)
    devices = aot.topology(target, topology).devices
    if len(devices) != mesh_spec.size:
        raise ValueError(f"plan: topology {topology} has {len(devices)} GPUs, mesh {mesh_spec.describe()} "
                         f"needs {mesh_spec.size}")
    return mesh_spec.make(devices), topology


def plan_setup(model_cfg, opts, mesh, *, prompt_tokens: int, max_new_tokens: int, num_samples: int,
               chunk_size: int, prefill_mode: str, gradient_mode: str, logprob_chunk: int = 1024,
               donate_cache: bool = False, samples_per_request: int = 0, probe_tokens: int = 0,
               capacity_multiple: int = 256, base_fp8=None) -> PlanSetup:
    """The abstract model and sizes every program builder (`programs.BUILDERS`) takes; call within the mesh
    spec's `axis_rules`. `opts`: the ModelOptions with param_dtype / lora set (see `plan`)."""
    if prompt_tokens + max_new_tokens > model_cfg.max_position_embeddings:
        raise ValueError(f"plan: prompt_tokens + max_new_tokens = {prompt_tokens + max_new_tokens} exceeds "
                         f"max_position_embeddings {model_cfg.max_position_embeddings} (apply rope scaling first)")
    # The sampler's own rule (Sampler.capacity_for): padded so the slot shards divide it.
    capacity = slot_capacity(prompt_tokens + max_new_tokens, capacity_multiple, ways(mesh, "seq"))
    probe_capacity = (slot_capacity(probe_tokens + max_new_tokens, capacity_multiple, ways(mesh, "seq"))
                      if probe_tokens else 0)
    graphdef, state = abstract_model(model_cfg, opts, mesh, base_fp8)
    return PlanSetup(model_cfg, opts, mesh, graphdef, state, prompt_tokens, max_new_tokens, num_samples,
                     chunk_size, prefill_mode, capacity, gradient_mode, logprob_chunk, donate_cache,
                     samples_per_request, probe_tokens, probe_capacity)


def _estimate(text: str, hosts, *, table, target: str, trips: dict[str, Any]) -> dict[str, Any]:
    """`kernel_cost.estimate_program` of one compiled program, with its loop trip counts' detail and a check that
    the compiled loops match the replayed ones (`loop_check`)."""
    program = kernel_cost.Program(text, hosts)
    out = kernel_cost.estimate_program(program, table, target, trips["trips"], PASS_LOOP)
    return {**out, "loop_trips": trips["detail"], "loop_check": loop_check(out["loops"], trips["detail"])}


def loop_check(loops: list[dict[str, Any]], detail: dict[str, Any]) -> list[str]:
    """Mismatches between the compiled program's data-dependent loops and `loop_trips`' replay of them: a scope
    the replay gave trips but the program lacks, or executions that are not a whole multiple of the replay's
    (a layer stack runs each loop once per layer, and rematerialisation may run it again). Empty when they agree."""
    compiled: dict[str, float] = {}
    for loop in loops:
        if loop["scope"] is not None:
            compiled[loop["scope"]] = compiled.get(loop["scope"], 0.0) + loop["executions"]
    problems = []
    for scope, d in detail.items():
        runs = compiled.get(scope)
        ratio = runs / d["executions"] if runs and d["executions"] else None
        if ratio is None or abs(ratio - round(ratio)) > 1e-6 * max(ratio, 1.0) or round(ratio) < 1:
            problems.append(f"{scope}: the program runs it {runs or 0:g} times, the replay {d['executions']:g}")
    return problems


def first_candidate(programs: dict[str, Any]) -> dict[str, float] | None:
    """{optimistic, central, pessimistic} seconds of the first candidate as the seed timed it: the prefill of the
    whole prompt (every call of the prefill program) and one decode call. None without both programs."""
    prefill, decode = programs.get("prefill"), programs.get("decode")
    if not (prefill and decode and prefill.get("time") and decode.get("time")):
        return None
    return {s: prefill["time"][f"{s}_s"] * prefill["calls_per_transaction"] + decode["time"][f"{s}_s"]
            for s in ("optimistic", "central", "pessimistic")}


def _target_record(target: str, topology: str | None, hbm_bytes: float, table) -> dict[str, Any]:
    """What the plan was compiled for and judged against (the report's "target"): a GPU's memory as the
    efficiency table gives it (measured where it was), and the table's entries for the target."""
    if target not in targets.GPU_TARGETS:
        return {"name": target, "topology": None, "device_memory_bytes": float(hbm_bytes), "memory_fraction": 1.0,
                "budget_bytes": targets.budget_bytes(target, hbm_bytes, None), "efficiency": None}
    device_memory = table.device_memory_bytes(target)
    return {"name": target, "topology": topology, "device_memory_bytes": device_memory,
            "memory_fraction": targets.LAUNCHER_MEM_FRACTION,
            "budget_bytes": targets.budget_bytes(target, hbm_bytes, device_memory),
            "efficiency": table.record(target)}
