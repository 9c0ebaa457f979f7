"""Per-kernel time estimate of one model forward on one GPU, compiled deviceless (the model's calibration check).

    python -m glm52_jax.plan.estimate --hf_config=config.json --tokens=16384 --target=h200 --kernels=reference

compiles `token_logprobs` of a random-weight model of that HF config (batch 1, `--tokens` ids, bf16; the
weights are never materialised) for one GPU of the target with XLA's GPU compiler (the gpu-aot extra), and
prints the estimate's breakdown, then, as its last line, one JSON object: `optimistic_s`, `central_s`,
`pessimistic_s`, `launches`, `syncs`, `model_version` (the efficiency table used) and the inputs. This is the
program `../shared/research/h200_measurements.md` timed (and `scripts/gpu_check.sh` times again), so the
estimate can be held against a real GPU's time (tests/plan/test_estimate.py).

`estimate_forward` is the same as a function; `kernel_cost` and `loop_trips` do the counting.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from glm52_jax.plan.efficiency import Table, TableError, load_table
from glm52_jax.plan.targets import GPU_TARGETS

KERNELS = ("reference", "pallas")


def estimate_jitted(fn, *abstract_args, target: str = "h200", trips: dict[str, float] | None = None,
                    table: Table | None = None) -> dict[str, Any]:
    """The three-scenario estimate of `jax.jit(fn)(*abstract_args)` (ShapeDtypeStructs, pytrees allowed)
    compiled for one GPU of `target` (`compile_program`). `trips`: trips per execution of its data-dependent
    loops by name scope (`loop_trips`; none known: each counted once)."""
    from glm52_jax.model.loop_scopes import PASS_LOOP
    from glm52_jax.plan import kernel_cost

    program = compile_program(fn, *abstract_args, target=target)
    return kernel_cost.estimate_program(program, table or load_table(), target, trips or {}, PASS_LOOP)


def compile_program(fn, *abstract_args, target: str = "h200"):
    """`jax.jit(fn)` on `abstract_args` compiled for one GPU, parsed (`kernel_cost.Program`): deviceless for
    `target` (`aot`: traced as a GPU program, so kernels="auto" and the Pallas kernels compile for the GPU), or
    for this process's own GPU when it has one (a calibration run on a lent GPU, whose kind the table names
    `target`)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from glm52_jax.kernels import aot
    from glm52_jax.plan import kernel_cost
    from glm52_jax.plan.measure import _compile

    local = jax.default_backend() == "gpu"
    devices = jax.devices()[:1] if local else aot.topology(target, "1x1x1").devices
    mesh = jax.sharding.Mesh(devices, ("x",))
    replicated = NamedSharding(mesh, P())
    args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), abstract_args)
    lowering = contextlib.nullcontext() if local else aot.deviceless_lowering(target)
    with lowering, jax.set_mesh(mesh):
        lowered = jax.jit(fn).lower(*args)
    with contextlib.nullcontext() if local else aot.deviceless_lowering(target):
        compiled = _compile(lowered, None if local else aot.compiler_options())
    return kernel_cost.Program(compiled.as_text(), [0])


def estimate_forward(cfg, tokens: int, target: str = "h200", kernels: str = "reference", table: Table | None = None,
                     dtype: str = "bfloat16") -> dict[str, Any]:
    """The three-scenario estimate (`kernel_cost.estimate_program`) of `token_logprobs` on ids [1, tokens] of a
    model of `cfg` (a `ModelConfig`) in `dtype`, compiled deviceless for one GPU of `target`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from glm52_jax.model import transformer
    from glm52_jax.model.options import ModelOptions
    from glm52_jax.plan import loop_trips

    opts = ModelOptions(param_dtype=jnp.dtype(dtype), kernels=kernels)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: transformer.GlmMoeDsa(cfg, opts, rngs=nnx.Rngs(0))))
    ids = jax.ShapeDtypeStruct((1, tokens), jnp.int32)

    def forward(state, ids):
        return transformer.token_logprobs(nnx.merge(graphdef, state), ids)

    counter = loop_trips.Counter(loop_trips.Shapes(opts.indexer_query_block, opts.indexer_key_block, kernels, 1,
                                                   opts.context_parallel))
    counter.whole_sequence(tokens)
    trips = counter.result()
    out = estimate_jitted(forward, state, ids, target=target, trips=trips["trips"], table=table)
    out["loop_trips"] = trips["detail"]
    return out


def _fail(message: str) -> int:
    print(f"estimate error: {message}", file=sys.stderr)
    return 2


def _lines(result: dict[str, Any]) -> list[str]:
    """The central estimate's breakdown, largest first."""
    b = result["breakdown"]
    lines = [f"estimate ({result['model_version']}, {result['target']}): optimistic {result['optimistic_s']:.4g} s, "
             f"central {result['central_s']:.4g} s, pessimistic {result['pessimistic_s']:.4g} s; "
             f"{result['launches']:,.0f} kernel launches, {result['syncs']:,.0f} loop syncs",
             f"{'central, by class':<24} {'seconds':>10} {'launches':>12} {'TFLOP':>10} {'GB':>10}"]
    for name, row in sorted(b["classes"].items(), key=lambda kv: -kv[1]["seconds"]):
        lines.append(f"{name:<24} {row['seconds']:10.4g} {row['launches']:12,.0f} {row['flops'] / 1e12:10.4g} "
                     f"{row['bytes'] / 1e9:10.4g}")
    for name, row in sorted(b["collectives"].items(), key=lambda kv: -kv[1]["seconds"]):
        hidden = f" (+{row['hidden_s']:.4g} s hidden behind kernels)" if row.get("hidden_s") else ""
        lines.append(f"{name:<24} {row['seconds']:10.4g} {row['count']:12,.0f}{hidden}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m glm52_jax.plan.estimate", description=__doc__.split("\n")[0])
    parser.add_argument("--hf_config", required=True, help="an HF config.json (model_type glm_moe_dsa)")
    parser.add_argument("--tokens", type=int, required=True, help="ids per forward (batch 1)")
    parser.add_argument("--target", default="h200", help=f"one of {', '.join(GPU_TARGETS)}")
    parser.add_argument("--kernels", default="reference", help=f"one of {', '.join(KERNELS)}")
    parser.add_argument("--table", default=None, help="an efficiency table file (default: the packaged one)")
    parser.add_argument("--debug", action="store_true", help="tracebacks instead of one-line errors")
    args = parser.parse_args(argv)
    if args.target not in GPU_TARGETS:
        return _fail(f"--target={args.target}: must be one of {', '.join(GPU_TARGETS)}")
    if args.kernels not in KERNELS:
        return _fail(f"--kernels={args.kernels}: must be one of {', '.join(KERNELS)}")
    if args.tokens < 2:
        return _fail(f"--tokens={args.tokens}: must be at least 2 (log-probs of the next token)")
    try:
        table = load_table(args.table)
        table.rates(args.target)
    except (TableError, ValueError) as err:
        return _fail(str(err))
    from glm52_jax.config import ModelConfig
    from glm52_jax.kernels import aot

    if not Path(args.hf_config).is_file():
        return _fail(f"--hf_config={args.hf_config}: no such file")
    try:
        cfg = ModelConfig.from_json_file(args.hf_config)
    except Exception as err:  # the config's own message names the field
        if args.debug:
            raise
        return _fail(f"--hf_config={args.hf_config}: {err}")
    if args.tokens > cfg.max_position_embeddings:
        return _fail(f"--tokens={args.tokens}: exceeds the config's max_position_embeddings "
                     f"{cfg.max_position_embeddings}")
    if reason := aot.missing():
        return _fail(f"compiling for the GPU deviceless needs the CUDA plugin: {reason}")
    result = estimate_forward(cfg, args.tokens, args.target, args.kernels, table)
    for line in _lines(result):
        print(line)
    summary = {k: result[k] for k in ("optimistic_s", "central_s", "pessimistic_s", "launches", "syncs",
                                      "model_version", "target")}
    print(json.dumps({**summary, "tokens": args.tokens, "kernels": args.kernels, "hf_config": args.hf_config}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
