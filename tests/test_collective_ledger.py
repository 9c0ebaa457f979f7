"""The collectives a process issued: each program's HLO collectives (x loop trips) x its executions."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from glm52_jax.closure import ledger as collective_ledger


def test_executions_times_the_programs_collectives():
    """A sum over 8 devices (one all-reduce of a float32 scalar) run 3 times, and a loop of 4 trips, each an
    all-reduce of a float32 scalar that depends on the last (not hoistable), run twice: 3 + 2 x 4 all-reduces of 4
    bytes. A program without collectives (one device) is not counted."""
    mesh = jax.make_mesh((8,), ("x",))
    x = jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P("x")))  # [64] in 8 shards of [8]
    total = jax.jit(lambda v: jnp.sum(v) * 2)

    def chained(block):  # block: this device's [8]
        return jax.lax.fori_loop(0, 4, lambda i, acc: acc + jax.lax.psum(acc * block.sum(), "x"), jnp.float32(1))

    looped = jax.jit(jax.shard_map(chained, mesh=mesh, in_specs=P("x"), out_specs=P()))
    local = jax.jit(lambda v: v + 1)
    ledger = collective_ledger.install()
    try:
        for _ in range(3):
            total(x).block_until_ready()
        for _ in range(2):
            looped(x).block_until_ready()
        local(jnp.ones(4)).block_until_ready()
    finally:
        collective_ledger.uninstall()
    assert float(total(x)) == 2 * 63 * 64 / 2
    summary = ledger.summary()
    assert summary["available"] and summary["executions"] == 5 and summary["programs"] == 2, summary
    assert summary["by_kind"]["all-reduce"] == {"ops": 3 + 2 * 4, "bytes": 4 * (3 + 2 * 4),
                                                "ops_in_unknown_loops": 0}, summary["by_kind"]
    assert sum(c["ops"] for c in summary["by_kind"].values()) == 11
    per_program = sorted((p["executions"], p["ops_per_execution"]) for p in summary["by_program"])
    assert per_program == [(2, {"all-reduce": 4}), (3, {"all-reduce": 1})], summary["by_program"]


def test_hlo_text_without_collectives_counts_nothing():
    counts = collective_ledger.hlo_collectives("ENTRY %main (p: f32[2]) -> f32[2] {\n"
                                               "  ROOT %p = f32[2]{0} parameter(0)\n}\n")
    assert all(c == {"ops": 0, "bytes": 0, "ops_in_unknown_loops": 0} for c in counts.values())
