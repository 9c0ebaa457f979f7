"""Plan mode on XLA's GPU compiler (`plan(..., target="h20")`): a 2-layer tiny model (a dense layer, then
an MoE layer with 8 routed experts) compiled deviceless for CUDA on 2 hosts x 4 H20s (topology 2x1x4,
folded CP8/EP8) and on one H20. Skips without the CUDA plugin (the gpu-aot extra of scripts/setup.sh).

One program (the uncached forward, the cheapest that holds every weight) per mesh keeps the compiles
to ~15 s; the transaction's own programs on the same topology are the slow test at the end.
"""

import jax.numpy as jnp
import pytest

from glm52_jax import config
from glm52_jax.kernels import aot
from glm52_jax.model.lora import LoRAConfig
from glm52_jax.model.options import ModelOptions
from glm52_jax.parallel.mesh import MeshSpec
from glm52_jax.plan import efficiency
from glm52_jax.plan.planner import plan
from glm52_jax.plan.report import format_plan
from glm52_jax.plan.targets import LAUNCHER_MEM_FRACTION

pytestmark = pytest.mark.skipif(aot.missing() is not None, reason=f"deviceless GPU compiles: {aot.missing()}")

CFG = config.tiny(num_hidden_layers=2, indexer_types=("full", "shared"))
# The jnp DSA path: what is measured here (memory, sharded weights, the time model) does not depend on the
# Pallas kernels, whose deviceless Triton compiles took 357 s of a CI run (tests/kernels/test_aot*.py cover them).
OPTS = ModelOptions(indexer_query_block=16, indexer_key_block=16, attention_query_block=8, kernels="reference")
SHAPES = dict(prompt_tokens=96, max_new_tokens=8, num_samples=2, gradient_mode="response_only",
              lora=LoRAConfig(rank=4, alpha=8.0), dtype=jnp.bfloat16, chunk_size=32, options=OPTS, target="h20")
FOLDED = MeshSpec(context=8, expert=8, folded=True)


@pytest.fixture(scope="module")
def eight():
    return plan(CFG, FOLDED, programs=("forward",), topology="2x1x4", **SHAPES)


@pytest.fixture(scope="module")
def one():
    return plan(CFG, MeshSpec(), programs=("forward",), **SHAPES)


def test_per_device_memory_and_the_budget(eight):
    target, forward = eight["target"], eight["programs"]["forward"]
    assert (target["name"], target["topology"]) == ("h20", "2x1x4")
    assert eight["mesh"]["platform"] == "cuda (deviceless h20, topology 2x1x4)"
    # The budget: the efficiency table's memory (the H20's is its target config's) x the launcher's fraction.
    assert target["device_memory_bytes"] == efficiency.load_table().device_memory_bytes("h20") == 102_046_367_744
    assert eight["hbm_bytes"] == target["budget_bytes"] == pytest.approx(102_046_367_744 * LAUNCHER_MEM_FRACTION)
    mem = forward["memory"]
    assert mem["argument_bytes"] > 0 and mem["output_bytes"] > 0 and mem["temp_bytes"] > 0 and mem["alias_bytes"] >= 0
    assert mem["total_bytes"] == mem["argument_bytes"] + mem["output_bytes"] + mem["temp_bytes"] - mem["alias_bytes"]
    # Arguments are exactly the device's shards of the state and the ids (keep_unused).
    assert mem["argument_bytes"] == forward["input_bytes_per_device"]
    assert forward["fits"] and eight["fits"] and eight["largest_program"] == "forward"


def test_time_estimate_in_the_report(eight):
    """The per-kernel estimate of the forward: three scenarios, the indexer's key loop at its real trip count on
    the busiest device, collectives across the two hosts, and the table that made it named in the report."""
    forward, t = eight["programs"]["forward"], eight["programs"]["forward"]["time"]
    tr = forward["traffic"]
    assert 0 < t["optimistic_s"] < t["central_s"] < t["pessimistic_s"] and t["launches"] > 0
    assert t["unresolved_loops"] == 0
    trips = t["loop_trips"]["dsa_causal_key_loop"]
    assert [loop["trips"] for loop in t["loops"] if loop["scope"] == "dsa_causal_key_loop"] == [
        trips["trips_per_execution"]]
    assert trips["busiest_total"] >= trips["mean_device_total"] > 0
    # The one 8-way axis spans both hosts: its collectives cross them, except the host-local stage XLA:GPU
    # splits the MoE's ragged all-to-all into (a ragged exchange within each host, then across hosts).
    assert tr["collectives_with_unknown_groups"] == 0
    assert tr["collective_bytes_executed_across_hosts"] > tr["collective_bytes_executed_within_host"] > 0
    assert tr["collective_bytes_executed_across_hosts"] + tr["collective_bytes_executed_within_host"] == sum(
        c["bytes_executed"] for c in forward["collectives"].values())
    network = sum(c["network_bytes"] for c in t["breakdown"]["collectives"].values())
    assert 0 < network < tr["collective_bytes_executed_across_hosts"]  # hierarchical: less than the results
    parts = sum(c["seconds"] for c in t["breakdown"]["classes"].values()) + sum(
        c["seconds"] for c in t["breakdown"]["collectives"].values()) + t["breakdown"]["sync_s"]
    assert t["central_s"] == pytest.approx(parts)
    assert eight["target"]["efficiency"]["version"] == t["model_version"] == efficiency.load_table().version
    assert any(n.startswith("time (GPU targets): the per-kernel estimate") for n in eight["notes"])
    assert not any(n.startswith("XLA:CPU converts bf16") for n in eight["notes"])
    table = format_plan(eight)
    assert "modeled time per call on h20 (topology 2x1x4; per-kernel estimate" in table and "x 0.90" in table


def test_sharded_weights_fall_by_the_device_count(eight, one):
    """The acceptance check of FSDP-sharded frozen weights (model.weight_sharding = "fsdp", the default): every
    base weight (the tiny model's dimensions all divide by 8) and the routed-expert LoRA are split 8 ways, the
    other adapters replicated; the compiled per-device arguments fall by exactly that from one H20 to eight."""
    m1, m8 = one["model"], eight["model"]
    assert m1["param_bytes"] == m8["param_bytes"] and m1["param_bytes_per_device"] == m1["param_bytes"]
    assert m8["param_bytes_per_device"] * 8 == m8["param_bytes"]
    expert_lora = (m8["lora_bytes"] - m8["lora_bytes_per_device"]) * 8 // 7
    assert expert_lora > 0 and (m8["lora_bytes"] - m8["lora_bytes_per_device"]) * 8 % 7 == 0
    ids_1, ids_8 = 96 * 4, 96 * 4 // 8  # int32 ids [1, 96], split over the sequence axis
    args_1 = one["programs"]["forward"]["memory"]["argument_bytes"]
    args_8 = eight["programs"]["forward"]["memory"]["argument_bytes"]
    assert args_1 == m1["param_bytes"] + m1["lora_bytes"] + ids_1
    assert args_1 - args_8 == (m1["param_bytes"] + expert_lora) * 7 // 8 + ids_1 - ids_8
    assert one["target"]["topology"] == "1x1x1" and not any(
        c["bytes"] for c in one["programs"]["forward"]["collectives"].values())


@pytest.mark.slow
def test_transaction_programs_on_two_hosts():
    """Prefill chunk, decode and the response_only train step on 2x1x4: each fits with a modeled time."""
    report = plan(CFG, FOLDED, programs=("prefill", "decode", "train"), topology="2x1x4", **SHAPES)
    for name, p in report["programs"].items():
        t = p["time"]
        assert p["fits"] and p["memory"]["total_bytes"] > 0, name
        assert 0 < t["optimistic_s"] <= t["central_s"] <= t["pessimistic_s"] and t["unresolved_loops"] == 0, name
    assert report["programs"]["decode"]["flops"]["flops_executed"] > 0
    first = report["first_candidate_s"]
    prefill, decode = report["programs"]["prefill"], report["programs"]["decode"]
    assert first["central"] == pytest.approx(prefill["time"]["central_s"] * prefill["calls_per_transaction"]
                                             + decode["time"]["central_s"])


@pytest.mark.slow  # two deviceless compiles (~26 s); tests/parallel/test_xla_options.py covers the options in CI
def test_cross_host_exchange_options_reach_the_compiler():
    """model.moe_cross_host="nccl": the MoE's ragged all-to-all stays one exchange of the exact rows instead of
    XLA's multi-host decomposition (an all-gather of every device's send rows across the 2 hosts); the options
    are recorded in the report."""
    from glm52_jax.parallel.xla_options import cross_host_options

    gpu = dict(SHAPES, options=ModelOptions(indexer_query_block=16, indexer_key_block=16, attention_query_block=8,
                                            kernels="reference", moe_transport="ragged"))
    exchanged = {}
    for choice in ("xla", "nccl"):
        report = plan(CFG, FOLDED, programs=("forward",), topology="2x1x4", xla_options=cross_host_options(choice),
                      **gpu)
        assert report["target"]["xla_options"] == cross_host_options(choice)
        entry = report["programs"]["forward"]
        coll = entry["collectives"]
        exchanged[choice] = (coll["all-to-all"]["bytes_executed"], coll["all-gather"]["bytes_executed"])
        if choice == "nccl":
            assert "XLA options of the run" in format_plan(report)
    # The MoE's all-to-all bytes (ragged counted with it) fall by more than half, and the decomposer's all-gather
    # of the send rows is gone (the rest of the all-gather bytes are the FSDP weights, the same in both).
    (a2a_xla, gather_xla), (a2a_nccl, gather_nccl) = exchanged["xla"], exchanged["nccl"]
    assert 0 < a2a_nccl < a2a_xla / 2 and gather_nccl < gather_xla, exchanged
