"""All benchmarks of issue 7 in one command, on one fixed bench model (benchmark, not a test).

    JAX_PLATFORMS=cpu .venv/bin/python -m benchmarks.run [--quick] [--out DIR]

Sections (each measurement runs in its own subprocess, so peak RSS is per row; a child whose RSS
passes `--mem_cap_gib` is killed and recorded "over cap", one running past `--max_row_seconds`
"over time"):
  a  forward: ours (jitted, float32, logits for every position) vs HF transformers
     `GlmMoeDsaForCausalLM` (torch CPU eager, float32, no_grad, batch 1, use_cache=False) on the
     same random weights (ours written by our `save_pretrained`, read by HF `from_pretrained` and by
     our `load_pretrained`); logits compared at the first length. Lengths double per side until
     the memory cap, the time limit (measured, or predicted from the last doubling) or `--forward_max_len`.
  b  GRPO train step of each gradient mode vs prompt length (`benchmarks/gradient_modes.py`).
  c  first vs prefix-cached candidate sampling (`benchmarks/prefix_cache.py`).
  d  peak-memory growth exponents (least-squares slope of log memory vs log L), from a and b.
  e  XLA `cost_analysis()` FLOPs of one decoder layer vs the analytic count of
     `benchmarks/roofline.py`.

Peak RSS: the parent polls /proc/<pid>/status (VmRSS, VmHWM) of each child. Inside a child the
peak is reset (/proc/self/clear_refs = 5) after compiling, so `run_peak_rss_mib -
baseline_rss_mib` is the memory the measured computation itself added ("RSS growth").

Code, by job: `bench_model` (the model), `bench_tasks` (a child's measurement), `bench_runner` (running one child),
`bench_sections` (what a-e run and judge), `bench_report` (the markdown), this module (the command).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time

from benchmarks.bench_model import bench_config
from benchmarks.bench_report import report
from benchmarks.bench_runner import Runner
from benchmarks.bench_sections import section_a, section_b, section_c, section_d, section_e
from benchmarks.bench_tasks import _worker


def machine_info(argv) -> dict:
    import jax
    import torch
    import transformers

    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "jax_platforms": os.environ.get("JAX_PLATFORMS"),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join(["python", "-m", "benchmarks.run"] + list(argv))}


QUICK_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
QUICK = dict(forward_lengths=[256, 512], double=False, forward_max_len=512, prompt_lengths=[256, 512],
             prefix_tokens=1024, prefix_chunk=256, flops_len=512)
FULL = dict(forward_lengths=[256, 1024, 4096, 16384], double=True, forward_max_len=65536,
            prompt_lengths=[2048, 8192, 16384], prefix_tokens=16384, prefix_chunk=256, flops_len=2048)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny lengths: a smoke test of every section")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/run[_quick].json); "
                                      "a directory gets run[_quick].json")
    parser.add_argument("--mem_cap_gib", type=float, default=14.0)
    parser.add_argument("--max_row_seconds", type=float, default=600.0)
    parser.add_argument("--sections", default="a,b,c,d,e")
    parser.add_argument("--forward_lengths", help="comma-separated base lengths of a")
    parser.add_argument("--forward_max_len", type=int)
    parser.add_argument("--prompt_lengths", help="comma-separated prompt lengths of b")
    parser.add_argument("--response_len", type=int, default=16)
    parser.add_argument("--group", type=int, default=2)
    parser.add_argument("--prefix_tokens", type=int)
    parser.add_argument("--flops_len", type=int)
    parser.add_argument("--jobs", type=int, help="section b rows run this many at a time (quick: 2, else 1)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return 0

    s = dict(QUICK if args.quick else FULL)
    if args.forward_lengths:
        s["forward_lengths"] = [int(x) for x in args.forward_lengths.split(",")]
    if args.prompt_lengths:
        s["prompt_lengths"] = [int(x) for x in args.prompt_lengths.split(",")]
    for key in ("forward_max_len", "prefix_tokens", "flops_len"):
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    s.update(mem_cap_gib=args.mem_cap_gib, max_row_seconds=args.max_row_seconds, response_len=args.response_len,
             group=args.group, quick=args.quick, jobs=args.jobs or (2 if args.quick else 1))
    sections = set(args.sections.split(","))
    if "d" in sections:
        sections |= {"a", "b"}
    name = "run_quick.json" if args.quick else "run.json"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out_path = args.out or os.path.join(repo, "benchmarks", "results", name)
    if os.path.isdir(out_path) or out_path.endswith(os.sep):
        out_path = os.path.join(out_path, name)

    started = time.perf_counter()
    cfg = bench_config()
    res = {"machine": machine_info(argv), "settings": s, "config": cfg.to_hf_dict(),
           "config_summary": (f"vocab {cfg.vocab_size}, hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers "
                              f"({'/'.join(cfg.mlp_layer_types)}; indexers {'/'.join(cfg.indexer_types)}), "
                              f"{cfg.num_attention_heads} heads, q_lora {cfg.q_lora_rank}, kv_lora {cfg.kv_lora_rank}, "
                              f"{cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok} "
                              f"+ {cfg.n_shared_experts} shared, indexer {cfg.index_n_heads}x{cfg.index_head_dim}, "
                              f"index_topk {cfg.index_topk}, float32"),
           "sections": {}}
    workdir = tempfile.mkdtemp(prefix="glm52_bench_")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    # Quick mode is a smoke test: cheaper LLVM compiles (most of its time), timings not meaningful,
    # except for the forward rows whose logits are compared with HF's, which compile as users do.
    # Quick mode also shares one persistent compile cache between its children (response_only with and
    # without the sampler cache compile the same gradient program); the full run compiles every row cold.
    run = Runner(args.mem_cap_gib, args.max_row_seconds, workdir, log, QUICK_XLA_FLAGS if args.quick else "",
                 jobs=s["jobs"], compile_cache=os.path.join(workdir, "xla_cache") if args.quick else None)

    def do_a():
        ckpt = os.path.join(workdir, "ckpt")
        row = run({"kind": "checkpoint", "ckpt": ckpt})
        if row["status"] != "ok":
            raise RuntimeError(f"could not write the bench checkpoint: {row.get('stderr_tail')}")
        return section_a(run, s, ckpt, workdir)

    jobs = {"a": do_a, "b": lambda: section_b(run, s), "c": lambda: section_c(run, s), "e": lambda: section_e(run, s)}
    try:
        from concurrent.futures import ThreadPoolExecutor

        # With jobs > 1 the sections run side by side (the runner still caps the children at `jobs`).
        with ThreadPoolExecutor(max_workers=len(jobs) if s["jobs"] > 1 else 1) as pool:
            futures = {k: pool.submit(fn) for k, fn in jobs.items() if k in sections}
            for k in "abce":
                if k in futures:
                    res["sections"][k] = futures[k].result()
        if "d" in sections:
            res["sections"]["d"] = section_d(res["sections"]["a"], res["sections"]["b"])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    res["wall_seconds"] = time.perf_counter() - started
    res["targets"] = {f"{k}.{name}": t for k, v in res["sections"].items() for name, t in v.get("targets", {}).items()}
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp, out_path)
    print(report(res))
    print(f"\nWrote {out_path} ({res['wall_seconds']:.0f} s).")
    from benchmarks import figures  # time and memory against length, beside the JSON (matplotlib permitting)

    print(figures.write_or_explain(res, os.path.splitext(out_path)[0] + ".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
