"""One MoE layer's expert-parallel exchange at the 2M prefill's shapes, compiled deviceless for 32 x H20 (4x1x8), and
what the plan's per-kernel estimate charges for it with 1 or 2 pipelined windows per pass (`experts_ep`'s
`exchange_blocks`; issue 33, item 3).

    python -m benchmarks.ep_overlap                   # exchange_blocks 1, 2 and 4
    python -m benchmarks.ep_overlap --blocks 2 --layers 75 --out benchmarks/results/ep_overlap_2m_h20.json

The layer as configs/2m.py runs it in the whole-prompt prefill: 65,536 tokens per device (2,097,152 over 32), the
dense transport, 256-token rounds, receive capacity 2 (128 rows per destination), GLM-5.2's experts (256 x
6144 -> 2048, top-8, 8 per device) on the grouped-matmul kernel, bf16 activations; no LoRA (the routed adapters
add rank-8 matmuls on the same rows). The pass loop runs the central scenario's passes. The prefill's EP part is
this x the MoE layers (75); prints seconds per layer and for the prefill, the exchange charged and hidden.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from glm52_jax.kernels import aot
from glm52_jax.model.expert_parallel import experts_ep
from glm52_jax.model.loop_scopes import PASS_LOOP
from glm52_jax.parallel import rules
from glm52_jax.parallel.mesh import MeshSpec
from glm52_jax.plan import kernel_cost
from glm52_jax.plan.efficiency import load_table

TOKENS, HIDDEN, INTER, EXPERTS, TOP_K = 2_097_152, 6144, 2048, 256, 8


def layer(blocks: int, topology: str = "4x1x8", target: str = "h20") -> dict:
    mesh = aot.gpu_mesh(target, topology, ("cp_ep",))
    hosts = [d.process_index for d in mesh.devices.flat]
    sharded = NamedSharding(mesh, P("cp_ep"))
    args = [jax.ShapeDtypeStruct((TOKENS, HIDDEN), jnp.bfloat16, sharding=sharded),
            jax.ShapeDtypeStruct((TOKENS, TOP_K), jnp.float32, sharding=sharded),
            jax.ShapeDtypeStruct((TOKENS, TOP_K), jnp.int32, sharding=sharded)]
    args += [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharded)
             for s in ((EXPERTS, HIDDEN, INTER), (EXPERTS, HIDDEN, INTER), (EXPERTS, INTER, HIDDEN))]

    def fn(x, weights, experts, *w):
        return experts_ep(x, weights, experts, *w, impl="dense", kernels="pallas", token_block=256,
                          receive_capacity=2.0, exchange_blocks=blocks)

    with rules.axis_rules(MeshSpec(context=32, folded=True).rules()):
        text = aot.compile_for_gpu(fn, *args, target=target, mesh=mesh).compiled.as_text()
    out = kernel_cost.estimate_program(kernel_cost.Program(text, hosts), load_table(), target, {}, PASS_LOOP)
    b = out["breakdown"]
    a2a = b["collectives"].get("all-to-all", {})
    return {"blocks": blocks, "central_s": out["central_s"], "optimistic_s": out["optimistic_s"],
            "pessimistic_s": out["pessimistic_s"], "all_to_all_s": a2a.get("seconds", 0.0),
            "all_to_all_hidden_s": a2a.get("hidden_s", 0.0), "all_to_all_count": a2a.get("count", 0.0),
            "grouped_matmul_s": b["classes"].get("grouped_matmul", {}).get("seconds", 0.0),
            "launches": out["launches"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ep_overlap", description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--out", default="", help="write the rows as JSON here")
    parser.add_argument("--layers", type=int, default=75, help="MoE layers in the prefill (GLM-5.2: 78 - 3 dense)")
    args = parser.parse_args(argv)
    rows = []
    for blocks in args.blocks:
        row = layer(blocks)
        rows.append({"per_layer": row, "layers": args.layers,
                     "prefill": {k: v * args.layers for k, v in row.items() if k.endswith("_s")}})
        print(json.dumps(rows[-1]))
    if args.out:
        made = {"command": "python -m benchmarks.ep_overlap " + " ".join(argv if argv is not None else sys.argv[1:]),
                "jax": jax.__version__, "efficiency_table": load_table().version}
        Path(args.out).write_text(json.dumps({"made": made, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
