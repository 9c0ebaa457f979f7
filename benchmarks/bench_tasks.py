"""The child side of `python -m benchmarks.run`: one measurement per process (`--worker TASK_JSON`), its peak RSS
reset after compiling so the row records what the measured computation itself added."""

from __future__ import annotations

import json
import sys
import time

from benchmarks.bench_model import _build, _ids, bench_config, fast_model

MIB = 2**20
RESULT_TAG = "@@RESULT "
MODES = ("conventional", "response_only", "response_only_sampler_cache", "shared_prefix")

def _status_kib(field: str, pid="self") -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _after_compile() -> dict:
    """Records the peak so far, resets the kernel's peak-RSS mark and returns the baseline."""
    peak_before = _status_kib("VmHWM")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    return {"setup_peak_rss_mib": (peak_before or 0) / 1024, "baseline_rss_mib": (_status_kib("VmRSS") or 0) / 1024,
            "peak_reset": reset}


def _run_peak(row: dict) -> dict:
    row["run_peak_rss_mib"] = (_status_kib("VmHWM") or 0) / 1024
    row["rss_growth_mib"] = row["run_peak_rss_mib"] - row["baseline_rss_mib"]
    return row



def task_checkpoint(t: dict) -> dict:
    """Our model with random weights (std 0.08 like the HF parity tests, norms 1 +- 0.1), saved as HF."""
    import jax.numpy as jnp

    import glm52_jax

    model = fast_model(bench_config(), glm52_jax.ModelOptions(param_dtype=jnp.float32), seed=1, weight_std=0.08,
                       norm_std=0.1, bias_std=0.1)
    glm52_jax.save_pretrained(model, t["ckpt"])
    return {"path": t["ckpt"]}


def task_forward_ours(t: dict) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import glm52_jax

    seq_len = t["seq_len"]
    model = glm52_jax.load_pretrained(t["ckpt"], dtype=jnp.float32)
    graphdef, state = nnx.split(model)
    ids = jnp.asarray(_ids(seq_len, model.cfg.vocab_size))
    start = time.perf_counter()
    compiled = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x)).lower(state, ids).compile()
    compile_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    row = {"seq_len": seq_len, "compile_seconds": compile_s, "xla_temp_mib": mem.temp_size_in_bytes / MIB,
           "xla_output_mib": mem.output_size_in_bytes / MIB, **_after_compile()}
    start = time.perf_counter()
    logits = jax.block_until_ready(compiled(state, ids))
    row["seconds"] = time.perf_counter() - start
    _run_peak(row)
    if t.get("save_logits"):
        np.save(t["save_logits"], np.asarray(logits[0]))
    row["tokens_per_second"] = seq_len / row["seconds"]
    return row


def task_forward_hf(t: dict) -> dict:
    import numpy as np
    import torch
    import transformers

    seq_len = t["seq_len"]
    model = transformers.GlmMoeDsaForCausalLM.from_pretrained(t["ckpt"], dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    ids = torch.as_tensor(_ids(seq_len, model.config.vocab_size), dtype=torch.long)
    row = {"seq_len": seq_len, "torch_threads": torch.get_num_threads(), **_after_compile()}
    with torch.no_grad():
        start = time.perf_counter()
        logits = model(ids, use_cache=False).logits
        row["seconds"] = time.perf_counter() - start
    _run_peak(row)
    row["tokens_per_second"] = seq_len / row["seconds"]
    if t.get("compare_logits"):
        ours = np.load(t["compare_logits"])
        theirs = logits[0].numpy()
        per_pos = np.max(np.abs(ours - theirs), axis=-1)
        bad = np.nonzero(per_pos > 1e-4)[0]
        row["parity"] = {"seq_len": seq_len, "max_abs_diff": float(per_pos.max()),
                         "positions_within_1e-4": float(np.mean(per_pos <= 1e-4)),
                         "first_position_over_1e-4": int(bad[0]) if bad.size else None,
                         "logit_std": float(theirs.std()), "logit_max_abs": float(np.max(np.abs(theirs))),
                         "argmax_agreement": float(np.mean(ours.argmax(-1) == theirs.argmax(-1)))}
    return row


def task_grad(t: dict) -> dict:
    from benchmarks import gradient_modes

    row = gradient_modes.measure(t["mode"], t["prompt_len"], t["response_len"], t["group"], cfg=bench_config(),
                                 on_compiled=_after_compile, build=_build)
    return _run_peak(row)


def task_prefix(t: dict) -> dict:
    from benchmarks import prefix_cache

    return prefix_cache.measure(t["prompt_tokens"], t["chunk_size"], t["max_new_tokens"], cfg=bench_config(),
                                build=_build)


FLOPS_COMPONENTS = {
    "dense": ("q_proj", "kv_proj", "indexer_proj", "indexer_score", "sparse_attn", "o_proj", "dense_mlp"),
    "sparse": ("q_proj", "kv_proj", "indexer_proj", "indexer_score", "sparse_attn", "o_proj", "moe_routed",
               "moe_shared", "router"),
}


def analytic_layer_flops(cfg, seq_len: int, mlp_type: str) -> dict:
    """Per-component FLOPs of one full-indexer layer's forward over seq_len tokens (roofline's model).

    `ideal`: causal work only (indexer over t keys, attention over min(t, K) keys, routed experts on
    the top-k). `as_compiled`: what a one-block CPU program executes: the indexer scores the whole
    [L, L] square (one key block holds all keys; the causal mask is applied after the GEMM),
    attention runs over all K slots of every query (slots without a causal key are masked), and
    `ragged_dot` on XLA:CPU multiplies every row by every expert's weights (E x the routed work).
    """
    from benchmarks import roofline

    k = min(cfg.index_topk, seq_len)

    def costs(sum_ctx, sum_topk):
        p = roofline._Pass(n_q=seq_len, sum_ctx=sum_ctx, sum_topk=sum_topk, key_reads=0, n_logits=0,
                           routing_tokens=seq_len)
        return {name: flops for name, (flops, _) in roofline._pass_costs(cfg, p, False).items()}

    ideal = costs(roofline.sum_positions(1, seq_len), roofline.sum_min_topk(1, seq_len, cfg.index_topk))
    compiled = costs(seq_len * seq_len, seq_len * k)
    compiled["moe_routed"] = ideal["moe_routed"] * cfg.n_routed_experts
    names = FLOPS_COMPONENTS[mlp_type]
    return {"ideal": {n: ideal[n] for n in names}, "as_compiled": {n: compiled[n] for n in names},
            "ideal_total": sum(ideal[n] for n in names), "as_compiled_total": sum(compiled[n] for n in names)}


def task_flops(t: dict) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from glm52_jax import positions as rope_lib
    from glm52_jax.model.options import ModelOptions
    from glm52_jax.model.transformer import DecoderLayer

    cfg = bench_config()
    seq_len = t["seq_len"]
    pos = jnp.arange(seq_len, dtype=jnp.int32)
    cos, sin = rope_lib.rope_cos_sin(pos, rope_lib.rotary_table(cfg.rope, cfg.qk_rope_head_dim))
    cos, sin = cos[None], sin[None]
    h = jax.random.normal(jax.random.key(0), (1, seq_len, cfg.hidden_size), jnp.float32)
    prev = jnp.zeros((1, seq_len, min(cfg.index_topk, seq_len)), jnp.int32)
    out = {"seq_len": seq_len, "layers": {}}
    for mlp_type in ("dense", "sparse"):
        row = {}
        blockings = {
            # One block per loop: every lax.map / fori_loop runs one trip, so counting bodies once is exact.
            "one_block": ModelOptions(param_dtype=jnp.float32, remat=False, indexer_query_block=seq_len,
                                      indexer_key_block=seq_len, attention_query_block=seq_len),
            # The model's default blocks: XLA counts each loop body once, so blocked work is undercounted.
            "default_blocks": ModelOptions(param_dtype=jnp.float32, remat=False),
        }
        for name, opts in blockings.items():
            layer = DecoderLayer(cfg, (mlp_type, "full"), opts, nnx.Rngs(0))
            graphdef, state = nnx.split(layer)

            def fn(state, h, cos, sin, graphdef=graphdef):
                return nnx.merge(graphdef, state)(h, cos, sin, pos, prev)[0]

            compiled = jax.jit(fn).lower(state, h, cos, sin).compile()
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, (list, tuple)) else cost
            row[f"xla_flops_{name}"] = float(cost["flops"])
            if name == "one_block":
                start = time.perf_counter()
                jax.block_until_ready(compiled(state, h, cos, sin))
                row["seconds_one_block"] = time.perf_counter() - start
        analytic = analytic_layer_flops(cfg, seq_len, mlp_type)
        row.update(analytic)
        row["xla_over_ideal"] = row["xla_flops_one_block"] / analytic["ideal_total"]
        row["xla_over_as_compiled"] = row["xla_flops_one_block"] / analytic["as_compiled_total"]
        out["layers"][mlp_type] = row
    return out


TASKS = {"checkpoint": task_checkpoint, "forward_ours": task_forward_ours, "forward_hf": task_forward_hf,
         "grad": task_grad, "prefix": task_prefix, "flops": task_flops}


def _worker(spec: str) -> None:
    task = json.loads(spec)
    result = TASKS[task["kind"]](task)
    sys.stdout.flush()
    print(RESULT_TAG + json.dumps(result), flush=True)
