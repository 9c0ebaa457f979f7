"""DSA kernels on a GPU: correctness against the jnp references, timings, the bench-model forward (benchmark).

    python -m benchmarks.kernels_gpu [--out DIR] [--budget SECONDS] [--tune] [--smoke]

Run by `scripts/gpu_check.sh` on an H200 / H20 (jax >= 0.11.2, no installs). Sections, each in its
own child process with its own time box, so one that fails or hangs loses only its own rows:
  env      versions, device, the bf16 matmul peak (8192^3, the roofline every fraction is taken of)
  check    sparse MLA kernel vs reference on the GPU: output, log-sum-exp, all gradients; float32
           (matmul precision highest) and bf16; prefill with ragged tails / masked slots / a fully
           masked query, decode (slot splits), a cache + chunk (two tables)
  time     sparse MLA forward and forward+backward, kernel vs reference: 64 heads, C 512, R 64, k 2048,
           2048 queries over 8K-128K keys; decode G = 2 and 8 over 8K-128K keys
  tune     (--tune) forward / backward tile configurations at one prefill shape
  indexer  the indexer section (`benchmarks.kernels_indexer.bench`)
  model    the bench model (benchmarks.run.bench_config) forward + log-probs, bf16, best of 3: ours with
           kernels=pallas at 4K-128K, HF transformers eager (torch, same weights) at 4K-32K
Results: DIR/kernels_gpu.json (rewritten after every section) and DIR/kernels_gpu.md (tables).
--smoke: CPU, interpret mode, tiny shapes (tests the script, not the kernels' speed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

RESULT_TAG = "@@ROW "
SECTIONS = ("env", "check", "time", "tune", "indexer", "model_ours", "model_hf")
# Relative time boxes: a section gets the time left times its box over the boxes of the sections still to run,
# so time one section leaves unused goes to the later ones.
BOX = {"env": 30, "check": 60, "time": 90, "tune": 55, "indexer": 70, "model_ours": 85, "model_hf": 60}
FULL = dict(heads=64, latent=512, rope=64, topk=2048, queries=2048, keys=(8192, 32768, 131072), decode=(2, 8),
            model_ours=(4096, 8192, 16384, 32768, 65536, 131072), model_hf=(4096, 8192, 16384, 32768),
            peak_n=8192)
SMOKE = dict(heads=16, latent=32, rope=16, topk=32, queries=8, keys=(64,), decode=(2,), model_ours=(64,),
             model_hf=(64,), peak_n=256)


def emit(row: dict) -> None:
    print(RESULT_TAG + json.dumps(row, default=float), flush=True)


# ------------------------------------------------------------------------------------------------
# Child side

def _timed(fn, *args, reps: int = 5) -> dict:
    """Compile + one warm-up call, then `reps` timed calls: {"median_s", "min_s", "compile_s"}."""
    import jax

    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    times.sort()
    return {"median_s": times[len(times) // 2], "min_s": times[0], "first_call_s": first}


def _mla_inputs(batch, queries, keys, shape, dtype, seed=0, masked=False):
    """Random q / rows and a random selection of distinct keys per query (causal: queries are the last
    `queries` positions). With `masked`, early queries hold -1 slots and query 1 is fully masked."""
    import jax
    import jax.numpy as jnp

    ks = jax.random.split(jax.random.key(seed), 5)
    h, c, r, k = shape["heads"], shape["latent"], shape["rope"], shape["topk"]
    q_lat = jax.random.normal(ks[0], (batch, queries, h, c), jnp.float32).astype(dtype)
    q_rope = jax.random.normal(ks[1], (batch, queries, h, r), jnp.float32).astype(dtype)
    c_kv = jax.random.normal(ks[2], (batch, keys, c), jnp.float32).astype(dtype)
    k_rope = jax.random.normal(ks[3], (batch, keys, r), jnp.float32).astype(dtype)
    # Distinct keys without a [S, T] sort: an odd stride through the keys from a random offset.
    offset = jax.random.randint(ks[4], (batch, queries, 1), 0, keys)
    stride = 2 * jax.random.randint(jax.random.fold_in(ks[4], 1), (batch, queries, 1), 0, keys // 2) + 1
    pos = keys - queries + jnp.arange(queries)[None, :, None]  # query positions
    k = min(k, keys)
    if masked:  # causal, possibly repeated keys, -1 past the visible ones, query 1 fully masked
        topk = (offset + stride * jnp.arange(k)) % (pos + 1)
        topk = jnp.where(jnp.arange(k) > pos, -1, topk).at[:, 1].set(-1)
    else:  # distinct keys (keys a power of two, stride odd)
        topk = (offset + stride * jnp.arange(k)) % keys
    return q_lat, q_rope, c_kv, k_rope, topk.astype(jnp.int32)


def _errors(ours, ref) -> dict:
    import numpy as np

    a, b = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    scale = max(float(np.max(np.abs(b))), 1e-30)
    return {"max_abs": float(np.max(np.abs(a - b))), "max_rel": float(np.max(np.abs(a - b)) / scale),
            "rel_l2": float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))}


def section_env(opts, shape) -> None:
    import jax
    import jax.numpy as jnp

    row = {"section": "env", "jax": jax.__version__, "backend": jax.default_backend(),
           "device": str(jax.devices()[0].device_kind), "python": sys.version.split()[0]}
    for name in ("jaxlib", "triton", "torch", "transformers", "flax"):
        try:
            row[name] = __import__(name).__version__
        except Exception as err:  # noqa: BLE001 - a missing package is a finding, not a failure
            row[name] = f"missing ({type(err).__name__})"
    emit(row)
    n = shape["peak_n"]
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    t = _timed(jax.jit(lambda x, y: x @ y), a, b, reps=10)
    emit({"section": "peak", "n": n, **t, "tflops": 2 * n ** 3 / t["median_s"] / 1e12,
          "tflops_best": 2 * n ** 3 / t["min_s"] / 1e12})


def _mla_fns(scale, kernels, config=None):
    """(forward, loss-gradient) of the sparse MLA over array rows, jitted."""
    import jax
    import jax.numpy as jnp

    from glm52_jax.kernels.sparse_mla import DEFAULT_CONFIG, encode_rows, sparse_mla_tables
    from glm52_jax.model.sparse_attention import array_rows, sparse_mla

    def fwd(q_lat, q_rope, c_kv, k_rope, topk):
        if kernels == "reference":
            return sparse_mla(q_lat, q_rope, c_kv, k_rope, topk, scale=scale, query_block=64)
        rows = array_rows(c_kv, k_rope)
        valid = topk >= 0
        codes = encode_rows(rows.row_ids(jnp.where(valid, topk, 0)), valid)
        kv, kr = rows.tables()
        from glm52_jax import kernels as seam
        return sparse_mla_tables(q_lat, q_rope, kv, kr, codes, scale=scale, interpret=seam.interpret(),
                                 config=config or DEFAULT_CONFIG)[0]

    def grads(q_lat, q_rope, c_kv, k_rope, topk, proj):
        def loss(*args):
            return jnp.sum(fwd(*args, topk).astype(jnp.float32) * proj)
        return jax.grad(loss, argnums=(0, 1, 2, 3))(q_lat, q_rope, c_kv, k_rope)

    return jax.jit(fwd), jax.jit(grads)


def section_check(opts, shape) -> None:
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_default_matmul_precision", "highest")  # float32 references at full precision
    small = dict(shape, topk=min(shape["topk"], 128))
    cases = [("prefill", 2, 37 if opts.smoke else 200, 64 if opts.smoke else 300),
             ("decode", 3, 1, 64 if opts.smoke else 4096)]
    for dtype, tol in ((jnp.float32, 1e-4), (jnp.bfloat16, 5e-2)):
        for name, batch, queries, keys in cases:
            args = _mla_inputs(batch, queries, keys, small, dtype, seed=3, masked=name == "prefill")
            proj = jax.random.normal(jax.random.key(7), args[0].shape, jnp.float32)
            ref_f, ref_g = _mla_fns(0.05, "reference")
            ker_f, ker_g = _mla_fns(0.05, "pallas")
            row = {"section": "check", "case": name, "dtype": jnp.dtype(dtype).name, "batch": batch,
                   "queries": queries, "keys": keys, **{k: small[k] for k in ("heads", "latent", "rope", "topk")}}
            row["out"] = _errors(ker_f(*args), ref_f(*args))
            for gname, g, gr in zip(("d_q_lat", "d_q_rope", "d_c_kv", "d_k_rope"), ker_g(*args, proj),
                                    ref_g(*args, proj), strict=True):
                row[gname] = _errors(g, gr)
            row["tolerance_rel_l2"] = tol
            row["ok"] = all(row[k]["rel_l2"] <= tol for k in ("out", "d_q_lat", "d_q_rope", "d_c_kv", "d_k_rope"))
            emit(row)


def _mla_flops(n, shape) -> tuple[float, float]:
    """Matmul FLOPs of the forward and of the kernels' backward (recompute + dq + per-slot row gradients)."""
    h, c, r, k = shape["heads"], shape["latent"], shape["rope"], shape["topk"]
    return 2.0 * n * h * k * (2 * c + r), 2.0 * n * h * k * (3 * (c + r) + 2 * c)


def _time_mla(shape, batch, queries, keys, peak, configs, kinds, tag, deadline):
    import jax
    import jax.numpy as jnp

    args = _mla_inputs(batch, queries, keys, shape, jnp.bfloat16)
    proj = jax.random.normal(jax.random.key(7), args[0].shape, jnp.float32)
    fwd_flops, bwd_flops = _mla_flops(batch * queries, shape)
    for kernels, config in configs:
        if time.time() > deadline:
            emit({"section": tag, "skipped": f"{kernels} {config}: time box"})
            continue
        fwd, grads = _mla_fns(shape.get("scale", 0.04), kernels, config)
        # The tiles that run: sparse_mla_tables fits the given ones to the GPU's shared memory (KernelConfig.fitted).
        ran = None if config is None else config.for_dtype(jnp.bfloat16).fitted(
            jnp.bfloat16, 1, max(16, shape["heads"]), shape["latent"], shape["rope"], shape["topk"])
        row = {"section": tag, "kernels": kernels, "config": None if config is None else str(ran),
               "batch": batch, "queries": queries, "keys": keys, "topk": shape["topk"], "heads": shape["heads"]}
        try:
            t = _timed(fwd, *args)
            row.update(fwd_s=t["median_s"], fwd_tflops=fwd_flops / t["median_s"] / 1e12)
            if "bwd" in kinds:
                g = _timed(grads, *args, proj, reps=3)
                row.update(fwd_bwd_s=g["median_s"], fwd_bwd_tflops=(fwd_flops + bwd_flops) / g["median_s"] / 1e12,
                           bwd_s=g["median_s"] - t["median_s"])
            if peak:
                row["fwd_fraction_of_peak"] = row["fwd_tflops"] / peak
                if "fwd_bwd_tflops" in row:
                    row["fwd_bwd_fraction_of_peak"] = row["fwd_bwd_tflops"] / peak
            if queries == 1:  # decode: bytes of the gathered rows
                gathered = batch * shape["topk"] * (shape["latent"] + shape["rope"]) * 2
                row["gathered_gb_per_s"] = gathered / t["median_s"] / 1e9
        except Exception as err:  # noqa: BLE001 - recorded, the next configuration still runs
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        emit(row)


def section_time(opts, shape) -> None:
    configs = [("pallas", None), ("reference", None)]
    for keys in shape["keys"]:
        _time_mla(shape, 1, shape["queries"], keys, opts.peak, configs, ("fwd", "bwd"), "time_prefill", opts.deadline)
    for g in shape["decode"]:
        for keys in shape["keys"]:
            _time_mla(shape, g, 1, keys, opts.peak, configs, ("fwd",), "time_decode", opts.deadline)


def _backward_parts(shape, queries, keys) -> dict:
    """Times the backward's pieces on one chunk of queries: the per-query kernel, then the sort and the
    deterministic scatter-add of its per-slot rows."""
    import jax
    import jax.numpy as jnp

    from glm52_jax import kernels as seam
    from glm52_jax.kernels import sparse_mla as sm
    from glm52_jax.kernels import sparse_mla_kernels as kern

    cfg, interpret = sm.DEFAULT_CONFIG, seam.interpret()
    q_lat, q_rope, c_kv, k_rope, topk = _mla_inputs(1, queries, keys, shape, jnp.bfloat16)
    codes = sm.encode_rows(topk, topk >= 0)
    tables = ((c_kv.reshape(keys, -1),), (k_rope.reshape(keys, -1),))
    (_, _), (ql, qr, flat, o, m, l) = sm._forward(q_lat, q_rope, *tables, None, codes, 0.04, interpret, cfg)
    delta = jnp.zeros(m.shape, jnp.float32)
    block_h = min(cfg.bwd_block_h, ql.shape[1])  # the smoke shape's 16 padded heads: one head block
    bwd = jax.jit(lambda: kern.backward(flat, ql, qr, o, m, l, delta, *tables, scale=0.04, block_k=cfg.bwd_block_k,
                                        block_h=block_h, splits=1, num_warps=cfg.bwd_num_warps,
                                        num_stages=cfg.bwd_num_stages, interpret=interpret))
    t_kernel = _timed(bwd, reps=3)["median_s"]
    _, _, dkv, dkr = bwd()

    def scatter(dkv, dkr):
        keys_ = jnp.where(flat >= 0, flat, keys).reshape(-1)
        order = jnp.argsort(keys_, stable=True).astype(jnp.int32)
        ks = keys_[order]
        ends = jnp.searchsorted(ks, ks, side="right").astype(jnp.int32)
        acc = (jnp.zeros((keys, dkv.shape[-1]), jnp.float32),)
        out = sm._scatter_rows(acc, (keys,), sm._partials(dkv), ks, ends, order, cfg, interpret)
        return out + sm._scatter_rows((jnp.zeros((keys, dkr.shape[-1]), jnp.float32),), (keys,), sm._partials(dkr),
                                      ks, ends, order, cfg, interpret)

    t_scatter = _timed(jax.jit(scatter), dkv, dkr, reps=3)["median_s"]
    return {"queries": queries, "entries": queries * shape["topk"], "bwd_kernel_s": t_kernel,
            "sort_and_scatter_s": t_scatter}


def section_tune(opts, shape) -> None:
    from glm52_jax.kernels.sparse_mla import KernelConfig

    fwd = [KernelConfig(block_k=bk, num_warps=nw, num_stages=ns)
           for bk, nw, ns in ((64, 8, 2), (128, 8, 1), (64, 8, 3), (32, 8, 4))]
    bwd = [KernelConfig(bwd_block_k=bk, bwd_block_h=bh, bwd_num_warps=nw, bwd_num_stages=ns)
           for bk, bh, nw, ns in ((32, 32, 8, 1), (16, 16, 8, 2))]
    keys = shape["keys"][min(1, len(shape["keys"]) - 1)]
    try:
        emit({"section": "tune_bwd_parts", "keys": keys, **_backward_parts(shape, min(256, shape["queries"]), keys)})
    except Exception as err:  # noqa: BLE001 - recorded; the configurations still run
        emit({"section": "tune_bwd_parts", "error": f"{type(err).__name__}: {str(err)[:300]}"})
    _time_mla(shape, 1, shape["queries"], keys, opts.peak, [("pallas", c) for c in fwd], ("fwd",), "tune_fwd",
              opts.deadline)
    _time_mla(shape, 1, shape["queries"], keys, opts.peak, [("pallas", c) for c in bwd], ("fwd", "bwd"),
              "tune_bwd", opts.deadline)


def section_indexer(opts, shape) -> None:
    from benchmarks.kernels_indexer import bench

    for row in bench(smoke=opts.smoke, peak_tflops=opts.peak, deadline=opts.deadline):
        emit({"section": "indexer", **row})


def section_model_ours(opts, shape) -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import glm52_jax
    from benchmarks.bench_model import _ids, bench_config, fast_model

    model = fast_model(bench_config(), glm52_jax.ModelOptions(param_dtype=jnp.bfloat16, kernels=opts.kernels),
                       seed=1, weight_std=0.08, norm_std=0.1, bias_std=0.1)
    glm52_jax.save_pretrained(model, opts.ckpt)  # the HF section loads these very weights
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda st, x: glm52_jax.token_logprobs(nnx.merge(graphdef, st), x))
    for seq_len in shape["model_ours"]:
        if time.time() > opts.deadline - 10:
            emit({"section": "model", "side": "ours", "seq_len": seq_len, "skipped": "time box"})
            break
        ids = jnp.asarray(_ids(seq_len, model.cfg.vocab_size))
        t = _timed(run, state, ids, reps=3 if seq_len <= 32768 else 1)
        stats = jax.devices()[0].memory_stats() or {}
        emit({"section": "model", "side": "ours", "kernels": opts.kernels, "seq_len": seq_len, "best_s": t["min_s"],
              "median_s": t["median_s"], "first_call_s": t["first_call_s"],
              "peak_gb": stats.get("peak_bytes_in_use", 0) / 1e9})


def section_model_hf(opts, shape) -> None:
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.GlmMoeDsaForCausalLM.from_pretrained(opts.ckpt, dtype=torch.bfloat16,
                                                              attn_implementation="eager").to(device).eval()
    from benchmarks.bench_model import _ids

    for seq_len in shape["model_hf"]:
        if time.time() > opts.deadline - 10:
            emit({"section": "model", "side": "hf", "seq_len": seq_len, "skipped": "time box"})
            break
        ids = torch.as_tensor(_ids(seq_len, model.config.vocab_size), dtype=torch.long, device=device)
        times = []
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            with torch.no_grad():
                for _ in range(4):  # 1 warm-up + best of 3
                    start = time.perf_counter()
                    logits = model(ids, use_cache=False).logits
                    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])
                    if device == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
                    del logits, logp
        except torch.OutOfMemoryError:
            emit({"section": "model", "side": "hf", "seq_len": seq_len, "error": "out of memory"})
            break
        peak = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None
        emit({"section": "model", "side": "hf", "seq_len": seq_len, "best_s": min(times[1:]), "peak_gb": peak})


def child(section: str, opts) -> None:
    shape = SMOKE if opts.smoke else FULL
    {"env": section_env, "check": section_check, "time": section_time, "tune": section_tune,
     "indexer": section_indexer, "model_ours": section_model_ours, "model_hf": section_model_hf}[section](opts, shape)


# ------------------------------------------------------------------------------------------------
# Parent side

def run_section(section: str, opts, deadline: float) -> list[dict]:
    """Runs one section in a child until `deadline`; returns its rows (plus an error row if it failed)."""
    cmd = [sys.executable, "-m", "benchmarks.kernels_gpu", "--child", section, "--deadline", str(deadline),
           "--ckpt", opts.ckpt, "--kernels", opts.kernels]
    if opts.smoke:
        cmd.append("--smoke")
    if opts.peak:
        cmd += ["--peak", str(opts.peak)]
    start = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(5.0, deadline - start))
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err, rc = "killed at its time box", "timeout"
    rows = [json.loads(line[len(RESULT_TAG):]) for line in out.splitlines() if line.startswith(RESULT_TAG)]
    if rc != 0:
        tail = "\n".join((err or "").strip().splitlines()[-12:])
        rows.append({"section": section, "error": f"exit {rc}", "stderr_tail": tail})
    for row in rows:
        row.setdefault("section", section)
    print(f"[{section}] {len(rows)} rows in {time.time() - start:.0f} s (exit {rc})", flush=True)
    return rows


def _fmt(x, digits=3) -> str:
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return "-" if x is None else str(x)


def report(rows: list[dict]) -> str:
    """Markdown tables of the rows."""
    lines = ["# DSA kernels on the GPU (benchmarks/kernels_gpu.py)", ""]
    env = [r for r in rows if r.get("section") in ("env", "peak")]
    for r in env:
        lines.append("- " + ", ".join(f"{k}={_fmt(v)}" for k, v in r.items() if k != "section"))
    groups = {}
    for r in rows:
        if r.get("section") not in ("env", "peak"):
            groups.setdefault(r["section"], []).append(r)
    for section, group in groups.items():
        keys = []
        for r in group:
            for k in r:
                if k != "section" and k not in keys:
                    keys.append(k)
        lines += ["", f"## {section}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        for r in group:
            cells = []
            for k in keys:
                v = r.get(k)
                cells.append(", ".join(f"{a} {_fmt(b)}" for a, b in v.items()) if isinstance(v, dict) else _fmt(v))
            lines.append("| " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def summary(rows: list[dict]) -> list[str]:
    """The headline numbers: peak, kernel fractions of it, check verdicts, model speed-ups."""
    out = []
    peak = next((r.get("tflops") for r in rows if r.get("section") == "peak"), None)
    if peak:
        out.append(f"bf16 matmul peak: {peak:.0f} TFLOP/s")
    checks = [r for r in rows if r.get("section") == "check" and "ok" in r]
    if checks:
        bad = [f"{r['case']}/{r['dtype']}" for r in checks if not r["ok"]]
        out.append(f"sparse MLA checks: {len(checks) - len(bad)}/{len(checks)} ok"
                   + (f" (failed: {bad})" if bad else ""))
    for r in rows:
        if r.get("section") == "time_prefill" and r.get("kernels") == "pallas" and "fwd_tflops" in r:
            out.append(f"sparse MLA {r['keys']} keys: fwd {r['fwd_tflops']:.0f} TFLOP/s"
                       + (f" ({r['fwd_fraction_of_peak']:.0%} of peak)" if "fwd_fraction_of_peak" in r else "")
                       + (f", fwd+bwd {r['fwd_bwd_tflops']:.0f} TFLOP/s" if "fwd_bwd_tflops" in r else ""))
    hf = {r["seq_len"]: r["best_s"] for r in rows if r.get("side") == "hf" and "best_s" in r}
    for r in rows:
        if r.get("side") == "ours" and "best_s" in r:
            ratio = f", {hf[r['seq_len']] / r['best_s']:.2f}x HF eager" if r["seq_len"] in hf else ""
            out.append(f"bench model {r['seq_len']}: {r['best_s'] * 1e3:.1f} ms{ratio}")
    for r in rows:
        if r.get("section") == "indexer" and r.get("tflops"):
            frac = f" ({r['fraction_of_peak']:.0%} of peak)" if r.get("fraction_of_peak") else ""
            out.append(f"indexer {r.get('name')}: {r['tflops']:.0f} TFLOP/s{frac}")
    errors = [f"{r['section']}: {r['error']}" for r in rows if "error" in r]
    return out + [f"ERROR {e}" for e in errors]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run")
    p.add_argument("--smoke", action="store_true", help="CPU interpret mode, tiny shapes")
    p.add_argument("--tune", action="store_true", help="also time several kernel tile configurations")
    p.add_argument("--sections", default=",".join(s for s in SECTIONS if s != "tune"))
    p.add_argument("--kernels", default="pallas", help="ModelOptions.kernels of the bench model")
    p.add_argument("--child")
    p.add_argument("--deadline", type=float)
    p.add_argument("--ckpt")
    p.add_argument("--peak", type=float)
    opts = p.parse_args(argv)
    if opts.child:
        child(opts.child, opts)
        return 0
    start = time.time()
    end = start + opts.budget
    sections = [s for s in opts.sections.split(",") if s]
    if opts.tune and "tune" not in sections:
        sections.insert(sections.index("time") + 1 if "time" in sections else 0, "tune")
    os.makedirs(opts.out, exist_ok=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="glm52_kernels_gpu_") as tmp:
        opts.ckpt = os.path.join(tmp, "bench_model")
        for n, section in enumerate(sections):
            left = end - time.time()
            if left < 15:
                rows.append({"section": section, "skipped": "budget spent"})
                continue
            share = BOX[section] / sum(BOX[s] for s in sections[n:])
            rows += run_section(section, opts, time.time() + left * share)
            if section == "env":
                opts.peak = next((r["tflops"] for r in rows if r.get("section") == "peak"), None)
            with open(os.path.join(opts.out, "kernels_gpu.json"), "w") as f:
                json.dump({"rows": rows, "seconds": time.time() - start, "smoke": opts.smoke}, f, indent=1,
                          default=float)
            with open(os.path.join(opts.out, "kernels_gpu.md"), "w") as f:
                f.write(report(rows))
    print("\n".join(summary(rows)))
    print(f"total {time.time() - start:.0f} s; results in {opts.out}/kernels_gpu.json and kernels_gpu.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
