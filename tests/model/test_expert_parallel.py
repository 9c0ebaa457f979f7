"""Expert-parallel routed experts (`model.expert_parallel.experts_ep`) against the one-device `experts_ragged`.

Runs on 8 virtual CPU devices: an 8-way folded `cp_ep` axis and an orthogonal context 4 x expert 2
mesh; random and fully skewed routing (dropless); outputs and gradients (x, expert kernels, routed
LoRA A/B); shardings (each device holds E/N experts).
"""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from glm52_jax.model import expert_parallel, fp8
from glm52_jax.model.expert_parallel import default_axes, experts_ep
from glm52_jax.model.grouped_mlp import experts_ragged
from glm52_jax.model.lora import LoRAConfig, adapter
from glm52_jax.parallel import rules
from glm52_jax.parallel.mesh import MeshSpec

E, D, I, T, R = 16, 32, 16, 64, 4

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")


class ExpertLoRA(nnx.Module):
    """The routed-expert adapters as `MoE` builds them, with a random (non-zero) B."""

    def __init__(self, rngs):
        cfg = LoRAConfig(rank=R, alpha=8.0, families=frozenset({"routed_experts"}))
        lead = dict(lead_shape=(E,), lead_axes=("experts",))
        self.gate = adapter(cfg, "routed_experts", "w_gate", (D,), ("embed",), (I,), ("expert_mlp",), rngs, **lead)
        self.up = adapter(cfg, "routed_experts", "w_up", (D,), ("embed",), (I,), ("expert_mlp",), rngs, **lead)
        self.down = adapter(cfg, "routed_experts", "w_down", (I,), ("expert_mlp",), (D,), ("embed",), rngs, **lead)
        rng = np.random.default_rng(100)
        for ad in (self.gate, self.up, self.down):
            ad.b[...] = jnp.asarray(0.3 * rng.standard_normal(ad.b[...].shape), ad.b[...].dtype)

    def trio(self):
        return self.gate, self.up, self.down


@functools.cache
def _lora():
    """(graphdef, state) of the adapters, built once: eager nnx construction costs seconds on CPU."""
    return nnx.split(ExpertLoRA(nnx.Rngs(0, lora=1)))


def _problem(k, skewed, seed=0):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    x = normal(T, D)
    w_gate, w_up, w_down = normal(E, D, I) / np.sqrt(D), normal(E, D, I) / np.sqrt(D), normal(E, I, D) / np.sqrt(I)
    logits = rng.standard_normal((T, E))
    if skewed:  # every token picks experts 4..4+k-1: all T*K pairs land on one device
        logits[:, 4:4 + k] += 100.0
    experts = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    scores = 1 / (1 + np.exp(-np.take_along_axis(logits, experts, -1)))
    weights = jnp.asarray(scores / scores.sum(-1, keepdims=True) * 2.5, jnp.float32)
    graphdef, lora_state = _lora()
    return dict(x=x, weights=weights, experts=jnp.asarray(experts, jnp.int32), w=(w_gate, w_up, w_down),
                cot=normal(T, D), graphdef=graphdef, lora_state=lora_state)


def _loss_fn(prob, fn):
    """value_and_grad of <fn(...), cot> w.r.t. x, the expert kernels and the LoRA state; aux = output."""
    graphdef, weights, experts, cot = prob["graphdef"], prob["weights"], prob["experts"], prob["cot"]

    def loss(x, w, lora_state):
        out = fn(x, weights, experts, *w, nnx.merge(graphdef, lora_state).trio())
        return jnp.sum(out * cot), out

    return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)


MESHES = {
    "folded8": (MeshSpec(context=8, folded=True), "cp_ep", ("cp_ep",)),
    "context4_expert2": (MeshSpec(context=4, expert=2), "expert", ("context", "expert")),
}


def _run_ep(prob, name, ep=experts_ep):
    spec, axis, token_axes = MESHES[name]
    mesh = spec.make()
    with rules.axis_rules(spec.rules()):
        assert default_axes(mesh) == (axis, token_axes)
        seq_axis = rules.logical_to_spec(("seq",), mesh_axes=mesh.axis_names)[0]
        put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
        x = put(prob["x"], P(seq_axis))  # tokens as attention leaves them
        w = tuple(put(a, P(axis)) for a in prob["w"])
        lora_state = jax.tree.map(lambda a: put(a, P(axis)), prob["lora_state"])
        for a in w + tuple(jax.tree.leaves(lora_state)):  # each device holds E/N experts
            assert {s.data.shape[0] for s in a.addressable_shards} == {E // mesh.shape[axis]}
        with jax.set_mesh(mesh):
            (_, out), grads = jax.jit(_loss_fn(prob, ep))(x, w, lora_state)
    return out, grads, mesh, axis


def _check(prob, name, ep=experts_ep):
    (_, ref), ref_grads = jax.jit(_loss_fn(prob, experts_ragged))(prob["x"], prob["w"], prob["lora_state"])
    out, grads, mesh, axis = _run_ep(prob, name, ep)
    errs = {"out": float(jnp.max(jnp.abs(out - ref)))}
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    flat_ref, flat = jax.tree.leaves(ref_grads), jax.tree.leaves(grads)
    assert len(flat) == len(flat_ref) == 1 + 3 + 6  # x, 3 kernels, 3 x (A, B)
    # Gradients against each tensor's own scale: an element is a sum over many routed rows whose terms reach
    # max|r| (10-90 here) and can cancel, so float32 rounding leaves ~1e-5 absolute noise on it in any summation
    # order (the float32 reference itself is up to 1.5e-5 from a float64-accumulated one, measured on
    # test_bounded_receive_buffer_passes' folded8 case, where the EP passes change the order). 1e-6 of the scale
    # is ~8 float32 ulps of it; a dropped or doubled row moves an element by a whole term.
    for g, r in zip(flat, flat_ref):
        scale = float(jnp.max(jnp.abs(r)))
        assert scale > 0
        err = float(jnp.max(jnp.abs(g - r)))
        assert err <= 1e-6 * scale, (err, scale)
    errs["grad"] = max(float(jnp.max(jnp.abs(g - r))) for g, r in zip(flat, flat_ref))
    # Expert gradients stay expert-sharded.
    assert grads[1][0].sharding.spec[0] == axis
    print(name, errs)
    return errs


@pytest.mark.parametrize("name", sorted(MESHES))
@pytest.mark.parametrize("k,skewed", [(2, False), (4, True)])
def test_matches_experts_ragged(name, k, skewed):
    prob = _problem(k, skewed, seed=k)
    if skewed:  # all pairs go to the owner of experts 4..7: the worst case the buffers are sized for
        assert set(np.unique(np.asarray(prob["experts"]))) == set(range(4, 4 + k))
    _check(prob, name)


@pytest.mark.parametrize("name", sorted(MESHES))
def test_token_blocks_match_experts_ragged(name):
    """Routing a device's 8 tokens in rounds of 3 (the last padded with a weight-0 token): same
    outputs and gradients, and the exchange buffers are sized for 3 tokens, not 8."""
    prob = _problem(2, False, seed=11)
    ep = functools.partial(experts_ep, token_block=3)
    _check(prob, name, ep)
    spec, _, _ = MESHES[name]
    with rules.axis_rules(spec.rules()), jax.set_mesh(spec.make()):
        jaxpr = str(jax.make_jaxpr(lambda *a: ep(*a))(prob["x"], prob["weights"], prob["experts"], *prob["w"]))
    n_dev = 8 if name == "folded8" else 2
    assert f"f32[{n_dev},{3 * 2},{D}]" in jaxpr and f"f32[{n_dev},{8 * 2},{D}]" not in jaxpr


def test_without_lora():
    prob = _problem(4, False, seed=7)
    spec, axis, _ = MESHES["folded8"]
    mesh = spec.make()
    ref = experts_ragged(prob["x"], prob["weights"], prob["experts"], *prob["w"])
    with rules.axis_rules(spec.rules()), jax.set_mesh(mesh):
        out = jax.jit(experts_ep)(prob["x"], prob["weights"], prob["experts"], *prob["w"])
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_uses_all_to_all_and_keeps_expert_shards():
    """The compiled program exchanges tokens (all-to-all) and never gathers the expert kernels."""
    prob = _problem(2, False)
    spec, axis, _ = MESHES["folded8"]
    mesh = spec.make()
    w = tuple(jax.device_put(a, NamedSharding(mesh, P(axis))) for a in prob["w"])
    x = jax.device_put(prob["x"], NamedSharding(mesh, P(axis)))
    with rules.axis_rules(spec.rules()), jax.set_mesh(mesh):
        compiled = jax.jit(experts_ep).lower(x, prob["weights"], prob["experts"], *w).compile()
    hlo = compiled.as_text()
    assert "all-to-all" in hlo
    assert "all-gather" not in hlo
    assert compiled.input_shardings[0][3].spec == P(axis)


def test_no_mesh_falls_back_to_experts_ragged():
    prob = _problem(2, False)
    out = experts_ep(prob["x"], prob["weights"], prob["experts"], *prob["w"])
    ref = experts_ragged(prob["x"], prob["weights"], prob["experts"], *prob["w"])
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def _ragged_all_to_all_by_gather(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                 axis_name, axis_index_groups=None):
    """`lax.ragged_all_to_all`'s semantics from all-gathers and scatters (XLA:CPU lacks the op).

    Device s sends rows `[input_offsets[d], +send_sizes[d])` of its operand to device d, which
    writes them at `output_offsets[d]` (an offset in d's output, as the sender states it).
    """
    assert axis_index_groups is None
    me = jax.lax.axis_index(axis_name)
    ops, ins, sizes, outs = (jax.lax.all_gather(a, axis_name) for a in (operand, input_offsets, send_sizes,
                                                                          output_offsets))
    rows = jnp.arange(operand.shape[0])
    for s in range(ops.shape[0]):
        start, size, dst = ins[s, me], sizes[s, me], outs[s, me]
        target = jnp.where((rows >= start) & (rows < start + size), dst + rows - start, output.shape[0])
        output = output.at[target].set(ops[s], mode="drop")
    return output


@pytest.mark.parametrize("name,k,skewed", [("folded8", 4, True), ("context4_expert2", 2, False)])
def test_ragged_path_offsets_with_emulated_transport(monkeypatch, name, k, skewed):
    """The GPU path's offsets/sizes bookkeeping, run on CPU through an emulated ragged_all_to_all."""
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", _ragged_all_to_all_by_gather)
    prob = _problem(k, skewed, seed=11)
    ref = experts_ragged(prob["x"], prob["weights"], prob["experts"], *prob["w"],
                         nnx.merge(prob["graphdef"], prob["lora_state"]).trio())
    spec, axis, _ = MESHES[name]
    mesh = spec.make()
    with rules.axis_rules(spec.rules()), jax.set_mesh(mesh):
        out = jax.jit(lambda *a: experts_ep(*a, nnx.merge(prob["graphdef"], prob["lora_state"]).trio(),
                                            impl="ragged"))(prob["x"], prob["weights"], prob["experts"], *prob["w"])
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_ragged_path_lowers_for_cuda():
    """The real `ragged_all_to_all` path (and its gradient) lowers for CUDA on an abstract 8-GPU mesh."""
    amesh = jax.sharding.AbstractMesh((8,), ("cp_ep",), axis_types=(AxisType.Auto,),
                                      abstract_device=jax.sharding.AbstractDevice(
                                          device_kind="NVIDIA H200", num_cores=132, platform="cuda"))
    tok, exp = NamedSharding(amesh, P("cp_ep")), NamedSharding(amesh, P("cp_ep"))
    args = [jax.ShapeDtypeStruct((T, D), jnp.float32, sharding=tok),
            jax.ShapeDtypeStruct((T, 2), jnp.float32, sharding=tok),
            jax.ShapeDtypeStruct((T, 2), jnp.int32, sharding=tok)]
    args += [jax.ShapeDtypeStruct(s, jnp.float32, sharding=exp) for s in ((E, D, I), (E, D, I), (E, I, D))]

    def loss(x, weights, experts, *w):
        return experts_ep(x, weights, experts, *w, mesh=amesh, impl="ragged").sum()

    checks = [jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")]
    with rules.axis_rules(MESHES["folded8"][0].rules()), jax.sharding.use_abstract_mesh(amesh):
        exported = jax.export.export(jax.jit(jax.value_and_grad(loss, argnums=(0, 3))), platforms=["cuda"],
                                     disabled_checks=checks)(*args)
    # 2 forward (rows with their local expert ids as one more column, results back) + their transposes.
    assert exported.mlir_module().count("custom_call @ragged_all_to_all") == 4


def test_grouped_matmul_kernel_inside_the_shard_map():
    """kernels="pallas": each device's local experts run on the grouped-matmul kernel (interpret mode here),
    LoRA block-diagonal; outputs and gradients (x, kernels, LoRA) as the one-device ragged_dot path."""
    _check(_problem(2, False, seed=5), "folded8", functools.partial(experts_ep, kernels="pallas"))


@pytest.mark.parametrize("impl", ["ragged", "dense"])
@pytest.mark.parametrize("name,k,skewed,capacity", [("folded8", 4, True, 1.25), ("context4_expert2", 2, True, 1.0)])
def test_bounded_receive_buffer_passes(monkeypatch, impl, name, k, skewed, capacity):
    """A receive buffer of `capacity` x the rows a device sends (ragged; dense: capacity x rows / N per
    destination chunk): the rows beyond it go in further passes (skewed: every pair to one device; 1.25x windows
    split the sources' chunks across passes), outputs and gradients as `experts_ragged`, and the jaxpr's buffers
    have the bounded shape (halved: two pipelined windows per pass), not the worst case's. (The floor of
    MIN_CHUNK_ROWS rows per destination, which keeps a few tokens' rounds in one pass, is lifted: these rounds
    are that small.)"""
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", _ragged_all_to_all_by_gather)
    monkeypatch.setattr(expert_parallel, "MIN_CHUNK_ROWS", 1)
    prob = _problem(k, skewed, seed=13)
    ep = functools.partial(experts_ep, impl=impl, receive_capacity=capacity)
    _check(prob, name, ep)
    spec, axis, token_axes = MESHES[name]
    mesh = spec.make()
    rows = T // int(np.prod([mesh.shape[a] for a in token_axes])) * k  # pairs a device sends per round
    with rules.axis_rules(spec.rules()), jax.set_mesh(mesh):
        jaxpr = str(jax.make_jaxpr(ep)(prob["x"], prob["weights"], prob["experts"], *prob["w"]))
    n_dev = mesh.shape[axis]
    # Each pass goes in two pipelined windows of half its buffer (ragged: + N rows, each transfer split in near-equal
    # parts); a window's rows carry their local expert ids as one more column (D + 1).
    if impl == "ragged":
        window = math.ceil(capacity * rows / 2) + n_dev
        assert f"f32[{window},{D + 1}]" in jaxpr and f"f32[{n_dev * rows},{D}]" not in jaxpr
    else:
        chunk = math.ceil(capacity * rows / n_dev)
        window = math.ceil(chunk / 2)
        assert f"f32[{n_dev},{window},{D + 1}]" in jaxpr and f"f32[{n_dev},{rows},{D}]" not in jaxpr
    assert "while" in jaxpr


def _exchange_order(jaxpr: str) -> str:
    """The all_to_alls (A) and grouped matmuls (M, runs merged) of a jaxpr's text, in program order."""
    ops = "".join("A" if op == "all_to_all" else "M" for op in re.findall(r"\b(all_to_all|ragged_dot_general)\[",
                                                                          jaxpr))
    return re.sub("M+", "M", ops)


@pytest.mark.parametrize("blocks,order", [(2, "AAMAMA"), (3, "AAMAAMAMA"), (1, "AMA")])
def test_next_window_leaves_before_the_experts_run(blocks, order):
    """The pipelined pass's program order: window b+1's rows are sent (all_to_all) before window b's experts run,
    and window b's results go back before window b+1's experts run; rows (with their ids as one more column) and
    results travel in the activations' dtype, bf16 here. XLA:GPU keeps that order as async start/done pairs
    around the expert matmuls (tests/plan/test_ep_overlap.py compiles it deviceless)."""
    prob = _problem(6, False)
    spec, _, _ = MESHES["folded8"]
    x = prob["x"].astype(jnp.bfloat16)
    w = tuple(a.astype(jnp.bfloat16) for a in prob["w"])
    with rules.axis_rules(spec.rules()), jax.set_mesh(spec.make()):
        jaxpr = str(jax.make_jaxpr(functools.partial(experts_ep, exchange_blocks=blocks, receive_capacity=0))(
            x, prob["weights"], prob["experts"], *w))
    assert _exchange_order(jaxpr) == order
    payloads = re.findall(r"(\w+)\[[\d,]+\] = all_to_all\[", jaxpr)
    assert payloads == ["bf16"] * order.count("A")
    # 8 tokens x 6 = 48 pairs per device, no capacity bound: a window holds 48 / blocks rows per destination.
    assert f"bf16[8,{48 // blocks},{D + 1}] = all_to_all[" in jaxpr


def test_exchange_blocks_fall_back_below_the_chunk_floor():
    """Windows never go under MIN_CHUNK_ROWS rows per destination (a decode step's few rows stay one exchange);
    a bad count is one line naming the argument."""
    assert expert_parallel._blocks(128, 2, 16) == 2
    assert expert_parallel._blocks(16, 2, 16) == 1
    assert expert_parallel._blocks(40, 4, 16) == 2
    prob = _problem(2, False)
    with pytest.raises(ValueError, match="exchange_blocks: expected >= 1"):
        with jax.set_mesh(MESHES["folded8"][0].make()), rules.axis_rules(MESHES["folded8"][0].rules()):
            experts_ep(prob["x"], prob["weights"], prob["experts"], *prob["w"], exchange_blocks=0)


def test_ragged_windows_split_each_transfer_in_near_equal_parts():
    """A ragged pass's window b carries part b of every (source, destination) transfer: the parts add up to the
    transfer, start where the previous part ended, and land one source after another in the window's buffer."""
    size, skip = jnp.array([[5, 0], [3, 2]]), jnp.array([[1, 0], [0, 4]])
    first = [np.asarray(a).tolist() for a in expert_parallel._window_part(size, skip, 0, 2)]
    second = [np.asarray(a).tolist() for a in expert_parallel._window_part(size, skip, 1, 2)]
    assert first == [[[2, 0], [1, 1]], [[1, 0], [0, 4]], [[0, 0], [2, 0]]]
    assert second == [[[3, 0], [2, 1]], [[3, 0], [1, 5]], [[0, 0], [3, 0]]]


@pytest.mark.parametrize("nodes,k,skewed,capacity,blocks", [
    (4, 2, False, 0.0, 2),  # 2 nodes of 4; worst-case chunks within a node (one pass)
    (2, 4, True, 1.0, 3),  # 4 nodes of 2; every pair to one device: passes within its node; 3 windows pad a token
])
def test_node_exchange_matches_experts_ragged(monkeypatch, nodes, k, skewed, capacity, blocks):
    """The two-stage exchange (`node_devices`): tokens to every node once, to their experts within it, partial sums
    back: outputs and gradients (x, expert kernels, routed LoRA) as the one-device `experts_ragged`, with capacity
    passes within a node and windows that do not divide a device's tokens."""
    monkeypatch.setattr(expert_parallel, "MIN_CHUNK_ROWS", 1)
    ep = functools.partial(experts_ep, impl="dense", node_devices=nodes, receive_capacity=capacity,
                           exchange_blocks=blocks)
    _check(_problem(k, skewed, seed=21), "folded8", ep)


def test_fp8_rows_in_transit_match_experts_ragged(monkeypatch):
    """FP8 experts (`fp8.Fp8MmaWeight`) on the two-stage exchange, rows sent as FP8 bytes (uint8 all-to-alls), every
    pair to one device (passes within its node) in 3 windows: the output and the x / LoRA gradients as the one-device
    `experts_ragged` on the same FP8 experts (float32; straight through the rows' quantization in both)."""
    monkeypatch.setattr(expert_parallel, "MIN_CHUNK_ROWS", 1)
    prob = _problem(4, True, seed=22)
    w8 = tuple(fp8.for_fp8_mma(w) for w in prob["w"])

    def loss_fn(fn):
        def loss(x, lora_state):
            out = fn(x, prob["weights"], prob["experts"], *w8, nnx.merge(prob["graphdef"], lora_state).trio())
            return jnp.sum(out * prob["cot"]), out

        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)

    (_, ref), ref_grads = jax.jit(loss_fn(experts_ragged))(prob["x"], prob["lora_state"])
    ep = functools.partial(experts_ep, impl="dense", node_devices=2, receive_capacity=1.0, exchange_blocks=3)
    spec, axis, _ = MESHES["folded8"]
    mesh = spec.make()
    with rules.axis_rules(spec.rules()):
        put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
        x = put(prob["x"], P(rules.logical_to_spec(("seq",), mesh_axes=mesh.axis_names)[0]))
        lora_state = jax.tree.map(lambda a: put(a, P(axis)), prob["lora_state"])
        with jax.set_mesh(mesh):
            (_, out), grads = jax.jit(loss_fn(ep))(x, lora_state)
            jaxpr = str(jax.make_jaxpr(loss_fn(ep))(x, lora_state))
    assert re.search(r"u8\[[\d,]+\] = all_to_all", jaxpr)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        scale = float(jnp.max(jnp.abs(r)))
        assert scale > 0 and float(jnp.max(jnp.abs(g - r))) <= 1e-6 * scale


def test_node_exchange_crosses_nodes_once_per_token():
    """Compiled on 8 devices as 2 nodes of 4: the rows cross between nodes only in all-to-alls of the devices of one
    local rank ({0,4}, {1,5}, ...), each carrying a device's window of tokens once per node (not once per pair),
    and reach their experts in all-to-alls within a node ({0..3}, {4..7}); none spans all 8 devices."""
    prob = _problem(4, False)
    spec, _, _ = MESHES["folded8"]
    ep = functools.partial(experts_ep, impl="dense", node_devices=4, receive_capacity=2.0, exchange_blocks=2)
    with rules.axis_rules(spec.rules()), jax.set_mesh(spec.make()):
        jaxpr = str(jax.make_jaxpr(ep)(prob["x"], prob["weights"], prob["experts"], *prob["w"]))
    assert expert_parallel.node_groups(8, 4) == ([[0, 4], [1, 5], [2, 6], [3, 7]], [[0, 1, 2, 3], [4, 5, 6, 7]])
    groups = re.findall(r"all_to_all\[[^\]]*axis_index_groups=(\(\([^=]*?\)\))", jaxpr.replace("\n", " "))
    across, within = "((0, 4), (1, 5), (2, 6), (3, 7))", "((0, 1, 2, 3), (4, 5, 6, 7))"
    assert groups and set(groups) == {across, within}, groups
    # 8 tokens per device in 2 windows of 4: a window's rows go to both nodes ([2, 4, D] sent, the same rows to
    # each) with their routing ([2, 4, 2K] float32), and its per-node sums come back as [2, 4, D].
    sends = re.findall(r"f32\[(\d+),(\d+),(\d+)\] = all_to_all\[[^\]]*axis_index_groups=\(\(0, 4\)", jaxpr)
    assert sends.count(("2", "4", str(D))) == 4 and sends.count(("2", "4", str(2 * 4))) == 2, sends


def test_node_devices_checked():
    """A node size that does not divide the expert axis is one line naming the argument."""
    prob = _problem(2, False)
    spec = MESHES["folded8"][0]
    with pytest.raises(ValueError, match="node_devices: expected 0, a divisor of cp_ep=8 or at least it, got 3"):
        with jax.set_mesh(spec.make()), rules.axis_rules(spec.rules()):
            experts_ep(prob["x"], prob["weights"], prob["experts"], *prob["w"], impl="dense", node_devices=3)
