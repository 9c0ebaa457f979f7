"""Which sparse-MLA kernel shapes each config's run compiles, and their sm_90a compile statistics per GPU target.

    python -m benchmarks.sparse_mla_compile_stats            # every config in configs/, targets h20 and h200
    python -m benchmarks.sparse_mla_compile_stats --configs configs/32k_parity.py --targets h20

1. Discovery (no compile): every plan program of a config (`plan.programs.BUILDERS`; a parity config's train
   program in all three gradient modes) is traced for the GPU target exactly as plan mode lowers it
   (`aot.deviceless_lowering`: kernels="auto" picks Pallas), with the three sparse-MLA kernels
   (`kernels/sparse_mla_kernels.py`: forward, backward, segment_sum) recording each call: operand shapes and
   dtypes, row tables, and the tiles `sparse_mla.KernelConfig` derived for it. A program that records no call
   runs the jnp path there (the cached context-parallel attention, an FP8 cache's rows).
2. Compile: each distinct call is compiled alone, deviceless, for each target (Triton + ptxas for sm_90a,
   `kernels.aot.compile_for_gpu`), with its recorded shapes: shared memory per block, registers, spills, launch
   shape; a kernel over the target's shared memory is recorded as such (XLA's message), not raised.

Writes benchmarks/results/sparse_mla_compile_stats.json (rows: kernel, target, configs and programs using it, block
sizes, stages, warps, shared memory B, registers, spills) and prints the table benchmarks/RESULTS.md carries.
The tiny config plans on the CPU (no kernel there); it is traced here for the GPU targets as a GPU run would use it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("configs/tiny.py", "configs/2m.py", "configs/2m_one_node.py", "configs/32k_parity.py",
           "configs/32k_parity_one_node.py")
OUT = ROOT / "benchmarks" / "results" / "sparse_mla_compile_stats.json"


def _abstract(x):
    import jax

    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _describe(x) -> str:
    import jax.numpy as jnp

    return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"


@contextlib.contextmanager
def recording(calls: list):
    """Within: each call of a sparse-MLA kernel appends {kernel, args (abstract), kwargs (static)} to `calls`
    (and still runs, so the trace continues)."""
    from glm52_jax.kernels import sparse_mla_kernels as kern

    originals = {name: getattr(kern, name) for name in ("forward", "backward", "segment_sum")}

    def wrap(name, fn):
        def recorded(*args, **kwargs):
            import jax

            flat = jax.tree.map(_abstract, args)
            calls.append({"kernel": name, "args": flat, "kwargs": dict(kwargs)})
            return fn(*args, **kwargs)
        return recorded

    for name, fn in originals.items():
        setattr(kern, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(kern, name, fn)


def _signature(call) -> tuple:
    """What makes two calls the same kernel code (dtypes, widths, slots, number of tables, tiles): the number of
    queries / entries (the grid) and the tables' row counts (pointers, never staged) are left out."""
    import jax

    leaves = [(tuple(x.shape[1:]), str(x.dtype)) for x in jax.tree.leaves(call["args"])]
    kwargs = tuple(sorted((k, v) for k, v in call["kwargs"].items() if k != "interpret"))
    return call["kernel"], tuple(leaves), kwargs


def _spec(config_path: str):
    from glm52_jax import run_defaults
    from glm52_jax.run_config import RunSpec

    return RunSpec.from_dict(run_defaults.from_file(ROOT / config_path).to_dict())


def discover(config_path: str, target: str, log) -> list[dict]:
    """The kernel calls of every plan program of the config, traced for `target`: [{program, kernel, args, kwargs}]."""
    import dataclasses

    import jax

    from glm52_jax import choices
    from glm52_jax.kernels import aot
    from glm52_jax.parallel.rules import axis_rules
    from glm52_jax.plan import planner
    from glm52_jax.plan.programs import BUILDERS
    from glm52_jax.rl.inputs import base_fp8, model_config
    from glm52_jax.rl.settings import lora_config, model_options
    from glm52_jax.rl.update import AdamWConfig

    spec = _spec(config_path)
    cfg, _, _, _ = model_config(spec.model, preset_without_checkpoint=True)
    mesh_spec = spec.mesh_spec()
    mesh, _ = planner.plan_mesh(mesh_spec, target)
    opts = dataclasses.replace(model_options(spec.model), param_dtype=spec.model.jnp_dtype(),
                               lora=lora_config(spec.model))
    parity = "parity" in spec.name
    modes = choices.GRADIENT_MODES if parity else (spec.train.gradient_mode,)
    s = spec.sampling
    found = []
    with axis_rules(mesh_spec.rules()):
        setup = planner.plan_setup(cfg, opts, mesh, prompt_tokens=spec.data.prompt_tokens,
                                   max_new_tokens=s.max_new_tokens, num_samples=s.num_samples,
                                   chunk_size=s.chunk_size, prefill_mode=s.prefill_mode,
                                   gradient_mode=modes[0], samples_per_request=s.per_request,
                                   probe_tokens=spec.search.probe_tokens, base_fp8=base_fp8(spec.model))
        runs = [(name, setup) for name in BUILDERS if name not in ("train", "inventory", "forward")]
        runs += [(f"train[{mode}]", dataclasses.replace(setup, gradient_mode=mode)) for mode in modes]
        for name, run_setup in runs:
            program = BUILDERS[name.split("[")[0]](run_setup, AdamWConfig())
            if program is None:
                continue
            calls: list = []
            t0 = time.perf_counter()
            with recording(calls), aot.deviceless_lowering(target), jax.set_mesh(mesh):
                jax.jit(program.fn, **program.jit_kwargs).trace(*program.args)
            log(f"{config_path} {name}: traced in {time.perf_counter() - t0:.0f} s, "
                f"{len(calls)} sparse-MLA kernel call(s)")
            found.append({"program": name, "calls": [{**c, "index_topk": cfg.index_topk} for c in calls]})
    return found


def _limit(target: str) -> int:
    from glm52_jax.kernels import aot

    return int(re.search(r"shared_memory_per_block_optin: (\d+)", aot.target_config(target)).group(1))


def compile_call(call, target: str) -> dict:
    """One recorded kernel call compiled alone for `target`: its KernelResources, or the shared-memory error."""
    from glm52_jax.kernels import aot
    from glm52_jax.kernels import sparse_mla_kernels as kern

    fn = getattr(kern, call["kernel"])
    kwargs = {**call["kwargs"], "interpret": False}
    t0 = time.perf_counter()
    try:
        compiled = aot.compile_for_gpu(lambda *a: fn(*a, **kwargs), *call["args"], target=target)
    except aot.SharedMemoryError as err:
        requested = re.search(r"requested (\d+)", str(err))
        return {"fits": False, "shared_memory": int(requested.group(1)) if requested else None,
                "error": str(err).splitlines()[0][:300], "compile_s": round(time.perf_counter() - t0, 1)}
    res = compiled.kernels[f"sparse_mla_{call['kernel']}"]
    return {"fits": res.shared_memory <= _limit(target), "shared_memory": res.shared_memory,
            "registers": res.registers, "spill_bytes": res.spill_bytes, "grid": list(res.grid),
            "threads": res.threads[0], "mma": list(res.mma), "compile_s": round(time.perf_counter() - t0, 1)}


def _tiles(call) -> dict:
    kw = call["kwargs"]
    keep = ("block_k", "block_h", "splits", "num_warps", "num_stages", "block_e")
    out = {k: kw[k] for k in keep if k in kw}
    if call["kernel"] == "segment_sum":  # its warps / stages are fixed in the kernel (see segment_sum)
        width = call["args"][3].shape[-1]
        out.update(num_warps=1 if width <= 128 else 4, num_stages=2)
    return out


def _shape(call) -> dict:
    args = call["args"]
    if call["kernel"] == "segment_sum":
        keys, _, _, src, acc = args
        return {"entries": keys.shape[0], "partials": src.shape[0], "width": src.shape[-1], "rows": acc.shape[0]}
    codes, q_lat, q_rope = args[:3]
    tables = args[-2] if call["kernel"] == "backward" else args[3]
    # slots: as the kernel sees them (padded to whole steps of every split); index_topk: the model's selection.
    return {"queries": codes.shape[0], "slots": codes.shape[1], "index_topk": call["index_topk"],
            "heads": q_lat.shape[1], "latent": q_lat.shape[2],
            "rope": q_rope.shape[2], "dtype": str(q_lat.dtype), "tables": len(tables),
            "table_rows": [t.shape[0] for t in tables]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    parser.add_argument("--targets", nargs="*", default=["h20", "h200"])
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)

    from glm52_jax.kernels import aot

    if (reason := aot.missing()) is not None:
        raise SystemExit(f"sparse_mla_compile_stats: deviceless GPU compiles unavailable: {reason}")

    def log(msg):
        print(msg, flush=True)

    rows, programs, started = {}, {}, time.perf_counter()
    for config in args.configs:
        # The calls do not depend on the target (both sm_90a; the tiles are derived from shapes and dtypes): traced
        # once, on the config's own plan target (the tiny config's is the CPU: h20 then), compiled for each.
        planned = _spec(config).plan.target
        for found in discover(config, planned if planned in aot.TARGETS else "h20", log):
            programs.setdefault(config, {}).setdefault(found["program"], set())
            for call in found["calls"]:
                programs[config][found["program"]].add(call["kernel"])
                for target in args.targets:
                    row = rows.setdefault((target, _signature(call)), {"call": call, "target": target, "users": set()})
                    row["users"].add(f"{Path(config).stem}:{found['program']}")
    table = []
    for (target, _), row in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1][0], str(kv[0][1]))):
        call = row["call"]
        stats = compile_call(call, target)
        entry = {"kernel": f"sparse_mla_{call['kernel']}", "target": target, "used_by": sorted(row["users"]),
                 **_shape(call), **_tiles(call), "limit": _limit(target), **stats}
        log(json.dumps(entry))
        table.append(entry)
    report = {"what": "sparse-MLA kernel calls of every plan program per config, compiled alone deviceless for sm_90a",
              "command": " ".join(["python -m benchmarks.sparse_mla_compile_stats", *(argv or [])]),
              "programs_without_kernel": {c: sorted(p for p, k in progs.items() if not k)
                                          for c, progs in programs.items()},
              "rows": table, "seconds": round(time.perf_counter() - started)}
    from glm52_jax.launch import checkout_record

    report["made_at"] = checkout_record()
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(markdown(report))
    return report


def markdown(report: dict) -> str:
    """The RESULTS.md table of a report."""
    lines = ["| kernel | target | configs: programs | shape | block_k / block_h / splits | stages | warps | "
             "smem B (limit) | regs | spills B |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        if r["kernel"] == "sparse_mla_segment_sum":
            shape = f"width {r['width']}, {r['partials']} partial(s)"
            tiles = f"block_e {r['block_e']}"
        else:
            shape = f"{r['dtype']}, {r['queries']} q x {r['heads']} h, C {r['latent']}, R {r['rope']}, " \
                    f"K {r['slots']}, {r['tables']} table(s)"
            tiles = f"{r['block_k']} / {r.get('block_h', '-')} / {r['splits']}"
        users = ", ".join(r["used_by"])
        smem = f"{r['shared_memory']:,} ({r['limit']:,})" + ("" if r["fits"] else " DOES NOT FIT")
        lines.append(f"| {r['kernel'].removeprefix('sparse_mla_')} | {r['target']} | {users} | {shape} | {tiles} | "
                     f"{r['num_stages']} | {r['num_warps']} | {smem} | {r.get('registers')} | "
                     f"{r.get('spill_bytes')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
