"""Which GPU matmul for FP8 base weights: deviceless sm_90a compiles of the candidates (benchmark, no GPU).

    python -m benchmarks.fp8_matmul_aot [--target h200] [--out benchmarks/results/fp8_matmul_aot_h200.json]

FP8 weights are e4m3 values with one float32 scale per 128 x 128 block (`model.fp8.Fp8Weight`). Compiled with
XLA's GPU compiler for the target (`kernels.aot`; no autotuning: XLA's default GEMM choices) at GLM-5.2's
shapes: a dense projection x [T, 6144] bf16 @ W [6144, 2048] (q_a-like) at T = 16,384 (a device's prefill /
training tokens) and T = 8 (a decode step), and the routed experts' grouped matmul, rows [M, 6144] against 32
local experts [32, 6144, 2048] (EP 8) at M = 16,384 and 64. Candidates:

  dense      a_dequant         today: `fp8.dense` (value x scale -> bf16 weight), then the bf16 dot
             b_fp8_kblocks     XLA FP8 dot: activations quantized per (row, 128 columns) to e4m3, one e4m3 x e4m3
                               dot batched over the 48 K blocks (float32 partials [48, T, N]), scaled and summed
             b_fp8_kloop       the same products in a loop over K blocks into a float32 [T, N] accumulator
             b_fp8_unscaled    one e4m3 x e4m3 dot over the whole K, no block scales: NOT the checkpoint's
                               numbers, only the floor of what an XLA FP8 GEMM costs
             kblocks_bf16      weight-only: bf16 x (e4m3 -> bf16) partial products per K block, scaled, summed
             c_kernel          the grouped-matmul Pallas kernel with one group, FP8 dequantized in the kernel
             bf16_weight       a bf16 weight (the reference a dequantized copy stands in for)
  experts    a_dequant         `fp8.dense` on the 32 experts, then the grouped-matmul kernel (bf16)
             c_kernel          `grouped_matmul_fp8`: e4m3 blocks dequantized in the kernel
             bf16_weight       bf16 experts on the grouped-matmul kernel
The b_* variants are compiled twice: as XLA chooses (Triton GEMM fusions) and with xla_gpu_enable_triton_gemm
off (cuBLASLt; `__cublas$lt$matmul$f8` for the FP8 dots).

Per variant: the kernels XLA emits (fusion kinds, custom-call targets), temporaries, HBM bytes and FLOPs as plan
mode models them (`plan.hlo_traffic`, `plan.hlo`), the roofline max(FLOPs / bf16 peak, bytes / HBM bandwidth)
at the efficiency table's datasheet peaks (`plan.efficiency`; an FP8 tensor-core peak is 2x the bf16 one on
Hopper, noted beside, not used), and the per-kernel estimate (`plan.kernel_cost`, central scenario). Results: the
JSON (--out) and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

D, N, EXPERTS, BLOCK = 6144, 2048, 32, 128
DENSE_TOKENS = (16384, 8)
EXPERT_ROWS = (16384, 64)
CUBLAS = {"xla_gpu_enable_triton_gemm": False}


def dense_variants(d: int = D, n: int = N) -> dict:
    """{name: fn(x [T, d] bf16, W [d, n]) -> [T, n] bf16}: the dense candidates (W an `Fp8Weight` with 128 x 128
    blocks, a bf16 array for "bf16_weight")."""
    import jax
    import jax.numpy as jnp

    from glm52_jax.kernels.grouped_matmul import grouped_matmul_fp8
    from glm52_jax.model import fp8

    kb = d // BLOCK

    def quantize_rows(x):  # [T, D] -> e4m3 [T, KB, 128], float32 scales [T, KB] (1 x 128 tiles)
        blocks = x.reshape(x.shape[0], kb, BLOCK).astype(jnp.float32)
        amax = jnp.max(jnp.abs(blocks), axis=-1)
        scale = jnp.where(amax > 0, amax / fp8.E4M3_MAX, 1.0)
        return (blocks / scale[..., None]).astype(fp8.E4M3), scale

    def column_scales(w):  # [KB, NB] -> [KB, N]
        return jnp.repeat(w.scales, BLOCK, axis=1)

    def a_dequant(x, w):
        wd = fp8.dense(w)
        return jnp.einsum("td,dn->tn", x, wd, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    def b_fp8_kblocks(x, w):
        xq, xs = quantize_rows(x)
        p = jnp.einsum("tkc,kcn->tkn", xq, w.values.reshape(kb, BLOCK, n), preferred_element_type=jnp.float32)
        return jnp.einsum("tkn,tk,kn->tn", p, xs, column_scales(w)).astype(jnp.bfloat16)

    def b_fp8_kloop(x, w):
        xq, xs = quantize_rows(x)
        wv, ws = w.values.reshape(kb, BLOCK, n), column_scales(w)

        def step(k, acc):
            p = jnp.dot(xq[:, k], wv[k], preferred_element_type=jnp.float32)
            return acc + p * xs[:, k, None] * ws[k][None, :]
        return jax.lax.fori_loop(0, kb, step, jnp.zeros((x.shape[0], n), jnp.float32)).astype(jnp.bfloat16)

    def b_fp8_unscaled(x, w):
        xq, _ = quantize_rows(x)
        return jnp.dot(xq.reshape(x.shape[0], d), w.values, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    def kblocks_bf16(x, w):
        p = jnp.einsum("tkc,kcn->tkn", x.reshape(x.shape[0], kb, BLOCK),
                       w.values.reshape(kb, BLOCK, n).astype(jnp.bfloat16), preferred_element_type=jnp.float32)
        return jnp.einsum("tkn,kn->tn", p, column_scales(w)).astype(jnp.bfloat16)

    def c_kernel(x, w):
        one = jnp.array([x.shape[0]], jnp.int32)
        return grouped_matmul_fp8(x, w.values[None], w.scales[None], w.block, one).astype(jnp.bfloat16)

    def bf16_weight(x, w):
        return jnp.einsum("td,dn->tn", x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    return {"a_dequant": a_dequant, "b_fp8_kblocks": b_fp8_kblocks, "b_fp8_kloop": b_fp8_kloop,
            "b_fp8_unscaled": b_fp8_unscaled, "kblocks_bf16": kblocks_bf16, "c_kernel": c_kernel,
            "bf16_weight": bf16_weight}


def expert_variants() -> dict:
    """{name: fn(rows [M, D] bf16, experts [E, D, N], group_sizes [E]) -> [M, N] float32}."""
    from glm52_jax.kernels.grouped_matmul import grouped_matmul, grouped_matmul_fp8
    from glm52_jax.model import fp8

    def a_dequant(x, w, gs):
        return grouped_matmul(x, fp8.dense(w), gs)

    def c_kernel(x, w, gs):
        return grouped_matmul_fp8(x, w.values, w.scales, w.block, gs)

    def bf16_weight(x, w, gs):
        return grouped_matmul(x, w, gs)

    return {"a_dequant": a_dequant, "c_kernel": c_kernel, "bf16_weight": bf16_weight}


def _weight(shape, bf16: bool):
    import jax
    import jax.numpy as jnp

    from glm52_jax.model import fp8

    if bf16:
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    return fp8.Fp8Weight(jax.ShapeDtypeStruct(shape, fp8.E4M3),
                         jax.ShapeDtypeStruct(fp8.scale_shape(shape, (BLOCK, BLOCK)), jnp.float32),
                         (BLOCK, BLOCK), jnp.dtype(jnp.bfloat16))


def _kernels_of(text: str) -> list[str]:
    """The kernel-level instructions of the entry computation and loop bodies: fusion kinds (Triton GEMM
    fusions by their backend kind) and custom-call targets, with their result shapes."""
    out = []
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%\S+ = (\S+) (fusion|custom-call)\(", line)
        if not m:
            continue
        kind = re.search(r'"kind":"(\w+)"', line) or re.search(r'custom_call_target="([^"]+)"', line) \
            or re.search(r"kind=(\w+)", line)
        out.append(f"{kind.group(1)} {m.group(1)}")
    return out


def measure(name: str, fn, args, target: str, options: dict | None) -> dict:
    from glm52_jax.kernels import aot
    from glm52_jax.plan import hlo, hlo_traffic, kernel_cost
    from glm52_jax.plan.efficiency import load_table

    start = time.perf_counter()
    compiled = aot.compile_for_gpu(fn, *args, target=target, options=options)
    seconds = time.perf_counter() - start
    text = compiled.compiled.as_text()
    moved = hlo_traffic.traffic(text, [0])["memory_bytes_executed"]
    flops = hlo.analyze_hlo(text)["flops"]
    table = load_table()
    rates = table.rates(target)
    compute_s, memory_s = flops["flops_executed"] / rates.bf16_flops_per_s, moved / rates.hbm_bytes_per_s
    estimate = kernel_cost.estimate_program(kernel_cost.Program(text, [0]), table, target, {})
    custom = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
    return {"variant": name, "xla_options": options or {}, "compile_s": round(seconds, 1),
            "temp_bytes": compiled.memory["temp"], "argument_bytes": compiled.memory["argument"],
            "hbm_bytes": moved, "flops": flops["flops_executed"], "dot_flops": flops["dot_flops_executed"],
            "modeled_s": max(compute_s, memory_s), "bound": "compute" if compute_s >= memory_s else "memory",
            "estimate_central_s": estimate["central_s"],
            "custom_calls": custom, "kernels": _kernels_of(text),
            "pallas": {k: {"shared_memory": v.shared_memory, "registers": v.registers, "spill_bytes": v.spill_bytes}
                       for k, v in compiled.kernels.items() if k.startswith("grouped_matmul")}}


def run(target: str) -> list[dict]:
    import jax
    import jax.numpy as jnp

    rows = []
    for tokens in DENSE_TOKENS:
        x = jax.ShapeDtypeStruct((tokens, D), jnp.bfloat16)
        for name, fn in dense_variants().items():
            for options in ([None, CUBLAS] if name.startswith("b_") else [None]):
                row = measure(name, fn, (x, _weight((D, N), name == "bf16_weight")), target, options)
                rows.append({"case": "dense", "rows": tokens, **row})
                print(_line(rows[-1]), flush=True)
    for m in EXPERT_ROWS:
        x, gs = jax.ShapeDtypeStruct((m, D), jnp.bfloat16), jax.ShapeDtypeStruct((EXPERTS,), jnp.int32)
        for name, fn in expert_variants().items():
            row = measure(name, fn, (x, _weight((EXPERTS, D, N), name == "bf16_weight"), gs), target, None)
            rows.append({"case": "experts", "rows": m, **row})
            print(_line(rows[-1]), flush=True)
    return rows


def _line(r: dict) -> str:
    cublas = " (cuBLAS)" if r["xla_options"] else ""
    return (f"| {r['case']} | {r['rows']} | {r['variant']}{cublas} | {r['temp_bytes'] / 2**20:,.1f} MiB | "
            f"{r['hbm_bytes'] / 1e6:,.1f} MB | {r['flops'] / 1e9:,.2f} G | {r['modeled_s'] * 1e3:.3f} ms "
            f"({r['bound']}) | {', '.join(r['custom_calls']) or '-'} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="h200", choices=("h200", "h20"))
    parser.add_argument("--out", default=None, help="JSON (default: benchmarks/results/fp8_matmul_aot_<target>.json)")
    args = parser.parse_args()
    out = Path(args.out or Path(__file__).parent / "results" / f"fp8_matmul_aot_{args.target}.json")
    print("| case | rows | variant | temp | HBM bytes | FLOPs | modeled | custom calls |")
    print("|---|---|---|---|---|---|---|---|")
    rows = run(args.target)
    import jax

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"target": args.target, "jax": jax.__version__, "shapes": {
        "dense": f"x [T, {D}] bf16 @ W [{D}, {N}] e4m3, {BLOCK} x {BLOCK} blocks",
        "experts": f"rows [M, {D}] bf16 x {EXPERTS} experts [{D}, {N}] e4m3, {BLOCK} x {BLOCK} blocks"},
        "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
