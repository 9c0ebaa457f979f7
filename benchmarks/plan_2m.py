"""AOT plan of the exact-2M GRPO run: GLM-5.2 on the seed's 32-device folded mesh, no weights.

    .venv/bin/python benchmarks/plan_2m.py                        # -> benchmarks/results/plan_2m.json
    .venv/bin/python benchmarks/plan_2m.py --programs prefill     # one program
    .venv/bin/python benchmarks/plan_2m.py --donate_cache --out /tmp/donated.json

The seed's run (DESIGN / seed report): prompt 2,097,152 tokens, 16 new tokens, G=2, rank-8 LoRA
(alpha 16, every family), bf16, TP1/CP32/EP32/PP1 (`MeshSpec.seed_training(32)`), response_only
gradients, and the YaRN factor-2 payload `configs/glm52_2m_yarn.json` (max positions 2,097,168),
applied through `$GLM52_ROPE_SCALING_JSON` exactly as `load_pretrained` does. The prefill chunk is
the sampler's default, 2048 tokens: 64 per device under 32-way CP, 1,024 chunks for 2M (each an
identical program; a larger chunk trades fewer calls for larger per-chunk activations).

Each program is planned in its own subprocess on 32 virtual CPU devices, so one that crashes the
compiler (or runs out of memory) is reported as such instead of taking the others down, and each
has its own peak RSS. See `glm52_jax.plan` (and `plan.report.NOTES`) for what every number means and the
XLA:CPU caveats.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEVICES = 32
YARN = ROOT / "configs" / "glm52_2m_yarn.json"


def plan_one(args, program: str) -> dict:
    """Runs in the child: plans one program and returns the report."""
    from glm52_jax.plan.devices import ensure_virtual_devices

    ensure_virtual_devices(DEVICES)
    import jax.numpy as jnp

    from glm52_jax.config import glm52
    from glm52_jax.model.lora import LoRAConfig
    from glm52_jax.parallel.mesh import MeshSpec
    from glm52_jax.plan.planner import plan

    cfg = glm52().with_env_rope_scaling()
    report = plan(cfg, MeshSpec.seed_training(DEVICES), prompt_tokens=args.prompt_tokens,
                  max_new_tokens=args.max_new_tokens, num_samples=args.num_samples,
                  gradient_mode=args.gradient_mode, lora=LoRAConfig(rank=8, alpha=16.0), dtype=jnp.bfloat16,
                  chunk_size=args.chunk_size, hbm_bytes=args.hbm_gb * 1e9, programs=(program,),
                  donate_cache=args.donate_cache, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    report["programs"][program]["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    report["max_position_embeddings"] = cfg.max_position_embeddings
    return report


def run_child(args, program: str, tmp: Path) -> tuple[dict | None, str | None, float]:
    """Plans `program` in a fresh interpreter: (report, None) or (None, why it died)."""
    start = time.perf_counter()
    cmd = [sys.executable, __file__, "--one", program, "--out", str(tmp), "--hbm_gb", str(args.hbm_gb),
           "--gradient_mode", args.gradient_mode]
    for name in ("prompt_tokens", "max_new_tokens", "num_samples", "chunk_size"):
        cmd += [f"--{name}", str(getattr(args, name))]
    cmd += ["--donate_cache"] if args.donate_cache else []
    proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    sys.stderr.write(proc.stderr)
    if proc.returncode == 0 and tmp.exists():
        return json.loads(tmp.read_text()), None, seconds
    if proc.returncode < 0:
        why = f"killed by {signal.Signals(-proc.returncode).name}"
    else:
        why = f"exit status {proc.returncode}"
    tail = proc.stderr.strip().splitlines()[-3:]
    return None, f"{program}: the planning process died ({why}) after {seconds:.0f} s: {' | '.join(tail)}", seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", default="prefill,decode,train",
                        help="comma-separated, from prefill,forward,decode,train")
    parser.add_argument("--prompt_tokens", type=int, default=2_097_152)
    parser.add_argument("--max_new_tokens", type=int, default=16)
    parser.add_argument("--num_samples", type=int, default=2)
    parser.add_argument("--chunk_size", type=int, default=2048)
    parser.add_argument("--gradient_mode", default="response_only")
    parser.add_argument("--donate_cache", action="store_true", help="donate the cache to prefill/decode")
    parser.add_argument("--hbm_gb", type=float, default=96.0, help="per-device HBM (H20: 96 GB)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "plan_2m.json"))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("GLM52_ROPE_SCALING_JSON", str(YARN))

    if args.one:  # child
        Path(args.out).write_text(json.dumps(plan_one(args, args.one)))
        return

    from glm52_jax.plan.report import assess, format_plan

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report, failures, started = None, [], time.perf_counter()
    for program in args.programs.split(","):
        part, failure, seconds = run_child(args, program, out.with_suffix(f".{program}.tmp"))
        out.with_suffix(f".{program}.tmp").unlink(missing_ok=True)
        if failure:
            failures.append(failure)
            continue
        part["programs"][program]["process_seconds"] = round(seconds, 1)
        if report is None:
            report = part
        else:
            report["programs"].update(part["programs"])
    if report is None:
        raise SystemExit("no program could be planned:\n" + "\n".join(failures))
    assess(report, args.hbm_gb * 1e9)
    report["failed_programs"] = failures
    report["run"] = {"seconds": round(time.perf_counter() - started, 1), "rope_scaling_json": os.environ[
        "GLM52_ROPE_SCALING_JSON"], "command": " ".join(["python", "benchmarks/plan_2m.py", *sys.argv[1:]])}
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(format_plan(report))
    for failure in failures:
        print(f"FAILED {failure}")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
