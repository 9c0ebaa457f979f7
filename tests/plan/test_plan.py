"""AOT plan mode (`glm52_jax.plan`): programs compiled from abstract weights and inputs.

A 3-layer tiny model (a dense full-indexer layer, then a 2-repeat scan of MoE layers with a shared
indexer: every GLM-5.2 feature, at about 2/3 of the 6-layer tiny's compile time) on the 8
virtual CPU devices (folded CP8/EP8) and on one device. The numbers checked are the compiled
executables' own (memory analysis, HLO text) against what the abstract state says they must be.
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from glm52_jax import choices, config
from glm52_jax.model.kv_cache import slot_capacity
from glm52_jax.model.lora import LoRAConfig
from glm52_jax.model.options import ModelOptions
from glm52_jax.model.transformer import GlmMoeDsa
from glm52_jax.parallel.mesh import MeshSpec
from glm52_jax.plan.devices import ensure_virtual_devices
from glm52_jax.plan.planner import plan
from glm52_jax.plan.programs import BUILDERS
from glm52_jax.plan.report import PROGRAMS, TRANSACTION_PROGRAMS, assess, format_plan

OPTS = ModelOptions(indexer_query_block=16, indexer_key_block=16, attention_query_block=8)
LORA = LoRAConfig(rank=4, alpha=8.0)
SHAPES = dict(prompt_tokens=96, max_new_tokens=8, num_samples=2, gradient_mode="response_only", lora=LORA,
              dtype=jnp.float32)
FOLDED = MeshSpec(context=8, expert=8, folded=True)


CFG = config.tiny(num_hidden_layers=3, indexer_types=("full", "shared", "shared"))


def _plan_here(mesh, programs, chunk_size=32, **kw):
    return plan(CFG, mesh, chunk_size=chunk_size, programs=programs, options=OPTS, **SHAPES, **kw)


def _plan(mesh, programs, chunk_size=32, **kw):
    """`_plan_here` in a fresh process, report as JSON. Late in a full test session (hundreds of
    programs compiled in the same process) XLA:CPU segfaulted compiling these plan programs; in a
    fresh process it never has."""
    args = json.dumps({"mesh": dataclasses.asdict(mesh), "programs": list(programs), "chunk_size": chunk_size, **kw})
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import test_plan; "
            "from glm52_jax.parallel.mesh import MeshSpec; from glm52_jax.checkpoint.hf_fp8 import Fp8Config; "
            "a = json.loads(sys.argv[2]); a['mesh'] = MeshSpec(**a['mesh']); "
            "a['base_fp8'] = a.get('base_fp8') and Fp8Config(*map(tuple, a['base_fp8'])); "
            "print('PLAN ' + json.dumps(test_plan._plan_here(**a)))")
    proc = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__), args], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("PLAN "))[5:])


@pytest.fixture(scope="module")
def folded():
    # 4 samples per request (G = 2 of them train): decode runs 4 rows, train and new_logprobs G. An engine
    # probe of 40 prompt tokens: its own prefill and decode.
    return _plan(FOLDED, ("prefill", "decode", "train", "new_logprobs", "inventory", "probe_prefill", "probe_decode"),
                 samples_per_request=4, probe_tokens=40)


@pytest.fixture(scope="module")
def single():
    return _plan(MeshSpec(), ("prefill",), hbm_bytes=1.0)


def test_folded_memory_matches_the_abstract_state(folded):
    model, cache = folded["model"], folded["cache"]
    # Slots shard 8 ways (batch 1, capacity 256): each device holds exactly 1/8 of the cache.
    assert folded["shapes"]["planned_capacity"] == 256 and not folded["issues"]
    assert cache["batch1_bytes_per_device"] * 8 == cache["batch1_bytes"] > 0
    assert (folded["shapes"]["num_samples"], folded["shapes"]["samples_per_request"]) == (2, 4)
    # Decode: one prompt cache for the S = 4 rows plus their suffixes of R = 8 slots (replicated: not split by
    # slot), i.e. 4 x 8 slots against the prompt's 256, never S copies of the prompt cache.
    assert cache["suffix_bytes_per_device"] == cache["suffix_bytes"] == cache["batch1_bytes"] * 4 * 8 // 256 > 0
    assert cache["decode_bytes_per_device"] == cache["batch1_bytes_per_device"] + cache["suffix_bytes_per_device"]
    # Experts shard 8 ways over the expert axis, every other weight 8 ways by FSDP (each of the tiny model's
    # weights has a dimension 8 divides): exactly 1/8 per device.
    assert model["param_bytes"] == 8 * model["param_bytes_per_device"]
    weights = model["param_bytes_per_device"] + model["lora_bytes_per_device"]
    ids = 32 // 8 * 4  # [1, 32] int32 ids, sequence-sharded
    for name, p in folded["programs"].items():
        mem = p["memory"]
        assert all(v >= 0 for v in mem.values()), (name, mem)
        assert mem["argument_bytes"] > 0 and mem["temp_bytes"] > 0, (name, mem)
        assert mem["total_bytes"] == (mem["argument_bytes"] + mem["output_bytes"] + mem["temp_bytes"]
                                      - mem["alias_bytes"])
        # XLA's argument buffers are exactly the per-device shards of the abstract inputs.
        assert mem["argument_bytes"] == p["input_bytes_per_device"], name
        assert mem["argument_bytes"] >= model["param_bytes_per_device"], name
    prefill = folded["programs"]["prefill"]["memory"]
    assert prefill["argument_bytes"] == weights + cache["batch1_bytes_per_device"] + ids + 4  # + length
    assert prefill["output_bytes"] >= cache["batch1_bytes_per_device"]  # the updated cache comes back
    decode = folded["programs"]["decode"]["memory"]
    # Weights, the prompt cache, the suffixes, h_last [S, D] float32, S PRNG keys (8 bytes) and two lengths.
    h_last = 4 * CFG.hidden_size * 4
    assert decode["argument_bytes"] == weights + cache["decode_bytes_per_device"] + h_last + 4 * 8 + 2 * 4
    # The suffix is donated (the loop runs on its buffers); the prompt cache is not (the prefix cache keeps it).
    assert cache["suffix_bytes_per_device"] <= decode["alias_bytes"] < cache["suffix_bytes_per_device"] + 1024
    # Train holds the prefix cache, the adapters and AdamW's two moments of them, sharded like the
    # adapters (the rest: token ids, masks, advantages, the step count: a few hundred bytes).
    train = folded["programs"]["train"]["memory"]
    resident = weights + 2 * model["lora_bytes_per_device"] + cache["batch1_bytes_per_device"]
    assert 0 < train["argument_bytes"] - resident < 1024
    # Its outputs are what the run's update program returns (`rl.update.grpo_step`): the new adapters, both moments
    # and the accumulated gradients (4 LoRA copies), plus the loss, log-probs, metrics and one finiteness flag per
    # adapter array: small next to one LoRA copy, so a LoRA-sized output missing or extra fails here.
    assert 0 < train["output_bytes"] - 4 * model["lora_bytes_per_device"] < model["lora_bytes_per_device"] / 16
    # The inventory reads the weights where they live and returns 4 uint32 lanes per array, nothing else.
    inventory = folded["programs"]["inventory"]
    n_arrays = int(inventory["what"].split(" of ")[1].split()[0])
    assert inventory["memory"]["argument_bytes"] == weights and inventory["memory"]["output_bytes"] == n_arrays * 16
    assert inventory["calls_per_transaction"] == 2
    # The new log-probs read the weights and the batch-1 prompt cache (no G-row cache, no whole-sequence input).
    after = folded["programs"]["new_logprobs"]["memory"]
    assert 0 < after["argument_bytes"] - weights - cache["batch1_bytes_per_device"] < 1024
    # The probe's request: 40 + 8 tokens also pad to 256 slots, so its chunk prefill and its 4-row decode take
    # the same arguments as the exact-N request's (in "whole" mode its prefill reads [1, 40] ids instead).
    for name in ("prefill", "decode"):
        probe = folded["programs"][f"probe_{name}"]
        assert probe["what"].startswith("engine probe (40 prompt tokens): sampler."), probe["what"]
        assert probe["memory"]["argument_bytes"] == folded["programs"][name]["memory"]["argument_bytes"], name


def test_folded_collectives_and_flops(folded):
    for name, p in folded["programs"].items():
        moved = sum(c["bytes"] for c in p["collectives"].values())
        assert moved > 0, f"{name}: no collectives on an 8-device mesh"
        for c in p["collectives"].values():
            assert c["bytes_executed"] >= c["bytes"] >= 0 and (c["ops"] > 0) == (c["bytes"] > 0)
        fl = p["flops"]
        assert fl["xla_flops"] > 0 and fl["flops_static"] > 0
        if name == "inventory":  # elementwise mixing and sums: no loops, no GEMMs (checked below)
            continue
        # The HLO count reproduces XLA's own (loop bodies once) to within a few percent...
        assert 0.8 < fl["flops_static"] / fl["xla_flops"] < 1.2, (name, fl)
        # ...and the layer scan (2 repeats) and the query-block maps run their bodies several times (new_logprobs
        # runs the G responses in one pass against the shared prompt cache: no per-sample loop on top).
        assert fl["flops_executed"] > (1.3 if name == "new_logprobs" else 1.5) * fl["flops_static"], (name, fl)
        assert 0 < fl["ragged_dot_flops_executed"] < fl["dot_flops_executed"] <= fl["flops_executed"]
        # The dense CPU ragged_dot does E=8 groups' work; a grouped GEMM would do one.
        grouped = fl["flops_executed"] - fl["ragged_dot_flops_executed"] * 7 / 8
        assert fl["flops_executed_grouped_gemm_estimate"] == pytest.approx(grouped)
        assert p["seconds"]["compile"] > 0
    gathers = folded["programs"]["prefill"]["collectives"]["all-gather"]
    assert gathers["ops"] > 0 and gathers["bytes"] > 0
    # The sampler's decode scan has 8 steps: the MoE's token exchange (all-to-all) runs in every step. (The FSDP
    # weight gathers of unstacked layers are loop invariants XLA may hoist out of the scan: counted once.)
    exchange = folded["programs"]["decode"]["collectives"]["all-to-all"]
    assert exchange["bytes_executed"] >= 8 * exchange["bytes"] > 0
    assert folded["programs"]["prefill"]["calls_per_transaction"] == 3  # 96 tokens in chunks of 32
    assert folded["fits"] and folded["largest_program"] in folded["programs"]


def test_indexer_flops_per_program(folded):
    """The DSA indexer's score FLOPs the HLO cannot count (data-dependent key loops), per program and device:
    2 * index heads * index head dim per (query, visible key) pair and 'full' layer, / 8 sequence shards."""
    per_pair = 2 * CFG.index_n_heads * CFG.index_head_dim * 1  # one 'full' layer
    p, r, g, rows, probe = 96, 8, 2, 4, 40
    cached = lambda n, prefix: n * (r * prefix + r * (r + 1) / 2)  # noqa: E731  n rows add r tokens after prefix
    expected = {"prefill": p * (p + 1) / 2 / 3,  # chunked: 3 calls of 32, the average call
                "decode": cached(rows, p), "train": cached(g, p), "new_logprobs": cached(g, p), "inventory": 0,
                "probe_prefill": probe * (probe + 1) / 2 / 2, "probe_decode": cached(rows, probe)}
    got = {name: prog["flops"]["indexer_flops_analytic"] for name, prog in folded["programs"].items()}
    assert got == pytest.approx({name: per_pair * pairs / 8 for name, pairs in expected.items()})


def test_report_is_json_and_formats(folded):
    again = json.loads(json.dumps(folded))
    # Chunked prefill mode: a later candidate's tail is the `prefill` program itself.
    assert again["programs"].keys() == set(TRANSACTION_PROGRAMS) - {"prefill_tail"}
    text = format_plan(folded)
    for word in ("prefill", "decode", "train", "all-gather", "CP8/EP8", "fits", "G=2 S=4"):
        assert word in text


def test_one_device_has_no_collectives_and_the_fits_flag_flips(single):
    p = single["programs"]["prefill"]
    assert all(c["ops"] == 0 and c["bytes"] == 0 for c in p["collectives"].values())
    assert single["model"]["param_bytes_per_device"] == single["model"]["param_bytes"]
    assert single["cache"]["batch1_bytes_per_device"] == single["cache"]["batch1_bytes"]
    assert p["memory"]["argument_bytes"] == p["input_bytes_per_device"]
    assert single["fits"] is False and p["fits"] is False  # hbm_bytes=1
    assert assess(single, 1e12)["fits"] is True


def test_flops_scale_with_chunk_length(single):
    half = _plan(MeshSpec(), ("prefill",), chunk_size=16)
    full = single["programs"]["prefill"]["flops"]
    small = half["programs"]["prefill"]["flops"]
    for key in ("xla_flops", "flops_executed", "dot_flops_executed"):
        assert 1.6 < full[key] / small[key] < 2.4, (key, full[key], small[key])


def test_whole_prompt_prefill_program():
    """prefill_mode="whole": one call of the sampler's context-parallel prefill, whose outputs are
    the batch-1 cache (plus h_last) and which gathers the key side instead of reading a cache."""
    whole = _plan(FOLDED, ("prefill", "prefill_tail"), prefill_mode="whole")
    p = whole["programs"]["prefill"]
    assert p["calls_per_transaction"] == 1 and p["what"].startswith("sampler.prefill_whole")
    cache, h_last = whole["cache"]["batch1_bytes_per_device"], CFG.hidden_size * 4  # h_last: [1, D] float32
    # Outputs: the cache and h_last (+ a few bytes: the length scalar, the output tuple's table).
    assert cache + h_last <= p["memory"]["output_bytes"] <= cache + h_last + 128
    model = whole["model"]
    assert p["input_bytes_per_device"] < model["param_bytes_per_device"] + model["lora_bytes_per_device"] + cache
    assert p["collectives"]["all-gather"]["ops"] > 0 and p["collectives"]["all-to-all"]["ops"] > 0
    assert whole["shapes"]["prefill_mode"] == "whole"
    # A later candidate's tail after a prefix-cache hit: one chunk against the full-capacity cache (an input).
    tail = whole["programs"]["prefill_tail"]
    assert tail["calls_per_transaction"] == 1 and "prefill_chunk" in tail["what"]
    assert tail["what"].startswith("later candidates' prompt tail")
    assert tail["input_bytes_per_device"] > model["param_bytes_per_device"] + cache


def test_mesh_needing_more_devices_is_a_clear_error():
    with pytest.raises(ValueError, match=r"needs 16 devices but this process has 8"):
        _plan_here(MeshSpec(context=16, expert=16, folded=True), ("prefill",))
    with pytest.raises(ValueError, match="unknown program"):
        _plan_here(MeshSpec(), ("prefil",))
    with pytest.raises(ValueError, match=r"none of the programs \('probe_decode',\) runs in this configuration"):
        _plan_here(MeshSpec(), ("probe_decode",))


def test_one_builder_per_program():
    assert tuple(BUILDERS) == PROGRAMS == choices.PLAN_PROGRAMS
    assert set(TRANSACTION_PROGRAMS) < set(PROGRAMS)


def test_capacity_is_padded_for_the_slot_shards():
    # 2M + 16 tokens: 2,097,168 = the position limit, which 32 devices do not divide; the sampler and the
    # plan both pad to the next multiple of lcm(256, 32) (pad slots are never attended).
    assert slot_capacity(2_097_152 + 16, 256, 32) == 2_097_408
    assert slot_capacity(96 + 8, 256, 8) == 256 and slot_capacity(1000, 1, 24) == 1008
    with pytest.raises(ValueError, match="positive"):
        slot_capacity(10, 256, 0)


def test_fp8_cache_bytes_and_shardings():
    """`model.cache_dtype=float8_e4m3fn` in the plan's abstract caches (no compile): e4m3 latents and indexer keys
    plus one float32 scale per row, sharded like their rows without the feature axis (slots 8 ways on folded=8;
    the suffix's slots unsharded), so the plan's cache bytes are the FP8 ones: C + 4 and I + 4 bytes per row
    against 2 C and 2 I in bf16, k_rope unchanged."""
    from glm52_jax.model.kv_cache import CACHE_AXES
    from glm52_jax.parallel.rules import axis_rules, logical_to_spec
    from glm52_jax.plan.abstract import abstract_cache, abstract_suffix, cache_bytes, model_segments

    mesh = FOLDED.make(jax.devices()[:8])
    segments = model_segments(CFG)
    with axis_rules(FOLDED.rules()):
        auto = abstract_cache(CFG, segments, 1, 256, jnp.bfloat16, mesh)
        fp8 = abstract_cache(CFG, segments, 1, 256, jnp.bfloat16, mesh, "float8_e4m3fn")
        suffix = abstract_suffix(CFG, segments, 4, 8, jnp.bfloat16, mesh, "float8_e4m3fn")
        row_spec = logical_to_spec(CACHE_AXES, mesh_axes=mesh.axis_names)
    latent_rows = sum(a.shape[0] * a.shape[1] * 256 for a in fp8.c_kv)
    key_rows = sum(a.shape[0] * a.shape[1] * 256 for a in fp8.index_k)
    rope = latent_rows * CFG.qk_rope_head_dim * 2
    assert cache_bytes(auto, False) == latent_rows * CFG.kv_lora_rank * 2 + key_rows * CFG.index_head_dim * 2 + rope
    assert cache_bytes(fp8, False) == latent_rows * (CFG.kv_lora_rank + 4) + key_rows * (CFG.index_head_dim + 4) + rope
    assert cache_bytes(fp8, True) * 8 == cache_bytes(fp8, False)
    for values, scales in ((fp8.c_kv, fp8.c_scale), (fp8.index_k, fp8.i_scale)):
        for v, sc in zip(values, scales, strict=True):
            assert v.dtype == jnp.float8_e4m3fn and sc.dtype == jnp.float32 and sc.shape == v.shape[:-1]
            assert v.sharding.spec == row_spec and tuple(sc.sharding.spec) == tuple(row_spec)[:4]
    assert cache_bytes(suffix, True) == cache_bytes(suffix, False) == cache_bytes(fp8, False) * 4 * 8 // 256


def test_ensure_virtual_devices_after_jax_started():
    assert ensure_virtual_devices(8) == jax.device_count() == 8
    with pytest.raises(RuntimeError, match=r"needs 16 devices but JAX is already initialised with 8"):
        ensure_virtual_devices(16)


def test_ensure_virtual_devices_in_a_fresh_process():
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["XLA_FLAGS"] = "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=2"
    # Importing the package and its JAX-free parts (devices, the report) must not start JAX.
    code = ("import os, sys; from glm52_jax.plan.devices import ensure_virtual_devices as e; "
            "from glm52_jax.plan.report import assess, format_plan; print('jax' in sys.modules); e(4); import jax; "
            "print(jax.device_count(), jax.default_backend(), os.environ['XLA_FLAGS'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "4", "cpu", "--xla_cpu_enable_fast_math=false",
                                  "--xla_force_host_platform_device_count=4"]


def test_launcher_plan_mode_makes_its_own_virtual_devices(tmp_path):
    """`--mode=plan` in a fresh process without device flags: the mesh's 4 virtual CPU devices are
    created before JAX starts, the embedded policy's prefill compiles, and plan.json is written."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    out = subprocess.run(
        [sys.executable, "-m", "glm52_jax.launch", f"--config={root}/configs/tiny.py", "--mode=plan",
         f"--workdir={tmp_path}", "--config.mesh=context=2,expert=2", "--config.plan.programs=('prefill',)",
         "--config.data.prompt_tokens=96", "--config.sampling.chunk_size=32", "--config.sampling.max_new_tokens=8"],
        capture_output=True, text=True, timeout=600, cwd=root, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["fits"] and summary["mesh"] == "DP1/TP1/CP2/EP2/PP1" and summary["largest_program"] == "prefill"
    report = json.loads((tmp_path / "plan.json").read_text())
    assert report["mesh"]["devices"] == 4 and report["model_source"].endswith("tiny_policy")
    assert report["programs"]["prefill"]["memory"]["total_bytes"] == summary["largest_total_bytes"] > 0
    assert "prefill" in out.stderr  # the readable table


def test_fp8_base_weights_plan():
    """FP8 base weights (the release's 128 x 128 blocks) on folded=8: the programs compile with e4m3 values and
    float32 scales as arguments, exactly the abstract state's bytes, fewer than the float32 base's; the inventory
    digests both arrays of every FP8 weight (its output: 16 bytes per array)."""
    fp8_plan = _plan(FOLDED, ("prefill", "inventory"), base_fp8=[[128, 128], ["indexer.weights_proj"]])
    model, base = fp8_plan["model"], fp8_plan["model"]["base_weights"]
    assert (base["format"], base["block"], base["not_convert"]) == ("float8_e4m3fn", [128, 128],
                                                                    ["indexer.weights_proj"])
    # The dense layer: q_a, q_b, kv_a, w_uk, w_uv, o_proj, its indexer's wq_b, wk, 3 MLP matrices; the stack of 2
    # MoE layers (shared indexer: no wq_b / wk): 6 attention, 3 shared-expert and 3 routed-expert matrices.
    assert base["fp8_params"] == 11 + 12 and fp8_plan["fits"] and not fp8_plan["issues"]
    assert base["fp8_elements"] < base["fp8_bytes_per_device"] * 8 < model["param_bytes"]
    weights = model["param_bytes_per_device"] + model["lora_bytes_per_device"]
    inventory = fp8_plan["programs"]["inventory"]["memory"]
    n_vars = len(nnx.to_flat_state(nnx.state(nnx.eval_shape(
        lambda: GlmMoeDsa(CFG, dataclasses.replace(OPTS, lora=LORA), rngs=nnx.Rngs(0))))))
    assert inventory["argument_bytes"] == weights and inventory["output_bytes"] == 16 * (n_vars + base["fp8_params"])
    prefill = fp8_plan["programs"]["prefill"]["memory"]
    assert prefill["argument_bytes"] == fp8_plan["programs"]["prefill"]["input_bytes_per_device"]
    assert prefill["argument_bytes"] == weights + fp8_plan["cache"]["batch1_bytes_per_device"] + 32 // 8 * 4 + 4


@pytest.mark.slow
def test_launcher_plans_fp8_base_weights(tmp_path):
    """`--config.model.base_weights=fp8` on the embedded (float32) policy: plan mode compiles the programs with
    the FP8 abstract model (the weights a run would quantize as it reads them), records the format, and the
    inventory digests both arrays of every FP8 weight."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    out = subprocess.run(
        [sys.executable, "-m", "glm52_jax.launch", f"--config={root}/configs/tiny.py", "--mode=plan",
         f"--workdir={tmp_path}", "--config.mesh=folded=8", "--config.model.base_weights=fp8",
         "--config.plan.programs=('prefill', 'decode', 'inventory')", "--config.data.prompt_tokens=96",
         "--config.sampling.chunk_size=32", "--config.sampling.max_new_tokens=8"],
        capture_output=True, text=True, timeout=600, cwd=root, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "plan.json").read_text())
    base = report["model"]["base_weights"]
    assert (base["format"], base["block"], base["not_convert"]) == ("float8_e4m3fn", [128, 128],
                                                                    ["indexer.weights_proj"])
    assert report["fits"] and set(report["programs"]) == {"prefill", "decode", "inventory"}
    # The FP8 weights' e4m3 values (1 byte each) and float32 scales, out of every base weight's bytes per device.
    assert base["fp8_elements"] / 8 < base["fp8_bytes_per_device"] < report["model"]["param_bytes_per_device"]
    inventory = report["programs"]["inventory"]
    arrays = int(inventory["what"].split(" of ")[1].split()[0])
    assert inventory["memory"]["output_bytes"] == 16 * arrays
    assert "FP8 base (128x128 blocks" in out.stderr  # the readable summary says so
