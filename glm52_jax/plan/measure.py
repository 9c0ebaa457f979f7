"""Lower and compile one program and read the compiled executable's own numbers (per device)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

from glm52_jax.plan.hlo import analyze_hlo
from glm52_jax.plan.hlo_traffic import traffic
from glm52_jax.plan.programs import Program
from glm52_jax.plan.targets import GPU_TARGETS

# Plan executables never run, so XLA:CPU need not optimise the machine code it emits: LLVM at -O0
# without its expensive passes (tiny train program: compile 58 s -> 35 s). The new xtile
# tiled-fusion emitter is off because it crashes (SIGFPE in xla::gpu::experimental::GetSchedule,
# jaxlib 0.12.0.1) emitting a fusion of the 2M whole-prompt forward. All three change code
# generation only: buffer assignment, fusion and SPMD partitioning, which the plan reads, do not
# (checked: identical memory / cost analyses for the tiny train program, and an identical
# optimised HLO module and memory analysis for the 2M prefill chunk with and without the last).
FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                    "xla_cpu_use_new_xtile_lowering": False}


def _compile(lowered, options: dict | None = None):
    """`lowered.compile(options)` kept out of a persistent compilation cache: plan programs are compiled to
    be measured, never run (serializing them is wasted work, and XLA:CPU's executable serializer
    segfaulted on one of them in a test session that had the cache on)."""
    min_secs = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    # $GLM52_PLAN_DUMP=DIR: XLA writes each program's optimised HLO and buffer assignment there (what fills
    # the temporaries).
    dump = os.environ.get("GLM52_PLAN_DUMP")
    options = {**(options or {}), **({"xla_dump_to": dump, "xla_dump_hlo_as_text": True} if dump else {})}
    try:
        return lowered.compile(compiler_options=options or None)
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_secs)


def measure(program: Program, mesh, fast_compile: bool, target: str = "cpu",
            xla_options: dict | None = None,
            estimate: Callable[[str, Sequence[int]], dict[str, Any]] | None = None) -> dict[str, Any]:
    """{"memory", "flops", "collectives", "largest_collectives", "loops", "traffic", "seconds"} of
    `program` compiled on `mesh` (see `report.NOTES` for what each number is), and "time" =
    `estimate(hlo_text, host of each partition)` when given (the per-kernel estimate of a GPU program).

    target: "cpu" compiles for the mesh's (virtual CPU) devices; "h20" / "h200" for the deviceless
    CUDA devices of `mesh` (`kernels.aot.topology`), traced as a GPU program (`aot.deviceless_lowering`:
    kernels="auto" picks the Pallas kernels, as on the device)."""
    from glm52_jax.kernels import aot

    # keep_unused: arguments include state a program does not read (lm_head in prefill): it stays
    # resident on the device all the same, so it belongs in the per-device total.
    jit_kw = dict(program.jit_kwargs, keep_unused=True)
    gpu = target in GPU_TARGETS
    if gpu:  # the run's own XLA options (`parallel.xla_options`: what its XLA_FLAGS carry) + the deviceless ones
        jit_kw["compiler_options"] = {**jit_kw.get("compiler_options", {}), **(xla_options or {}),
                                      **aot.compiler_options()}
    elif fast_compile and jax.default_backend() == "cpu":
        jit_kw["compiler_options"] = {**jit_kw.get("compiler_options", {}), **FAST_CPU_COMPILE}
    t0 = time.perf_counter()
    with aot.deviceless_lowering(target) if gpu else contextlib.nullcontext():
        with jax.set_mesh(mesh):
            lowered = jax.jit(program.fn, **jit_kw).lower(*program.args)
        t1 = time.perf_counter()
        compiled = _compile(lowered)
    t2 = time.perf_counter()
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, (list, tuple)):  # older jax: one dict per computation
        cost = cost[0] if cost else {}
    text = compiled.as_text()
    if os.environ.get("GLM52_PLAN_DUMP"):  # the text the numbers below come from, beside XLA's own dumps
        name = getattr(program.fn, "__name__", "program")
        Path(os.environ["GLM52_PLAN_DUMP"], f"{name}.{len(text)}.measured.hlo.txt").write_text(text)
    hlo = analyze_hlo(text)
    memory = {
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
        "alias_bytes": int(mem.alias_size_in_bytes),
        "generated_code_bytes": int(mem.generated_code_size_in_bytes),
    }
    memory["total_bytes"] = (memory["argument_bytes"] + memory["output_bytes"] + memory["temp_bytes"]
                             - memory["alias_bytes"])
    return {
        "memory": memory,
        "flops": {"xla_flops": float(cost.get("flops", 0.0)),
                  "xla_transcendentals": float(cost.get("transcendentals", 0.0)),
                  "xla_bytes_accessed": float(cost.get("bytes accessed", 0.0)), **hlo["flops"]},
        "collectives": hlo["collectives"],
        "largest_collectives": hlo["largest_collectives"],
        "loops": {"while_loops": hlo["while_loops"], "unknown_trip_count_loops": hlo["unknown_trip_count_loops"]},
        "traffic": traffic(text, _hosts(mesh)),
        "seconds": {"lower": round(t1 - t0, 2), "compile": round(t2 - t1, 2)},
        **({"time": estimate(text, _hosts(mesh))} if estimate is not None else {}),
    }


def _hosts(mesh) -> Sequence[int]:
    """The host (process index) of every partition of programs compiled on `mesh`, in partition order."""
    return [d.process_index for d in mesh.devices.flat]
