"""Parameter inventory of a real tiny model: the same on one device and sharded on 8, unchanged by a
no-op, changed in exactly the parameter that changed, and computed without fetching the model."""

import dataclasses
import re

import jax
import numpy as np
import pytest
from flax import nnx
from lora_utils import fast_rngs

import glm52_jax
from glm52_jax import config
from glm52_jax.checkpoint.digest import LANES
from glm52_jax.checkpoint.inventory import changed_entries, inventory_digest, param_inventory
from glm52_jax.evidence.hashing import state_arrays
from glm52_jax.model.lora import LoRA, LoRAConfig
from glm52_jax.model.named_arrays import state_leaves
from glm52_jax.model.transformer import GlmMoeDsa
from glm52_jax.parallel.mesh import parse_mesh
from glm52_jax.parallel.placement import place_model
from glm52_jax.parallel.rules import axis_rules

CFG = config.tiny(num_hidden_layers=2, indexer_types=("full", "shared"))
OPTS = glm52_jax.ModelOptions(lora=LoRAConfig(rank=4, alpha=8.0))
# What jaxlib's transfer guard logs (C++, to stderr) for each device-to-host copy under "log_explicit".
TRANSFER = re.compile(r"device-to-host transfer: shape=\(([^)]*)\), dtype=(\w+)")


@pytest.fixture(scope="module")
def model():
    return GlmMoeDsa(CFG, OPTS, rngs=fast_rngs())


@pytest.fixture(scope="module")
def inventory(model):
    return param_inventory(model)


def _placed(model):
    """`model` on 8 devices (experts 2 ways, heads/vocab 4 ways): a fresh copy (no host cache)."""
    spec = parse_mesh("expert=2,tensor=4")
    with axis_rules(spec.rules()):
        return place_model(model, spec.make())


def _sharded_names(model) -> list[str]:
    return [name for name, x in state_leaves(nnx.state(model)).items() if not x.sharding.is_fully_replicated]


def _with_one_change(model, name):
    graphdef, state = nnx.split(model)
    flat = [(path, var.replace(var.get_value().at[(0,) * var.get_value().ndim].add(1)))
            if "/".join(map(str, path)) == name else (path, var) for path, var in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def test_entries(model, inventory):
    leaves = state_leaves(nnx.state(model))
    assert list(inventory) == list(leaves) and len(inventory) > 20
    for name, entry in inventory.items():
        assert entry["shape"] == list(leaves[name].shape) and entry["dtype"] == str(leaves[name].dtype)
        assert re.fullmatch(f"[0-9a-f]{{{8 * LANES}}}", entry["digest"]), name
    assert {"bfloat16", "float32"} <= {e["dtype"] for e in inventory.values()}


@pytest.fixture(scope="module")
def placed(model):
    return _placed(model)


def test_no_op_and_sharding_keep_the_inventory(model, inventory, placed):
    graphdef, state = nnx.split(model)
    assert param_inventory(nnx.merge(graphdef, state)) == inventory  # a new model object, same values
    assert len(_sharded_names(placed)) > 20  # the experts, embeddings, projections, ... really are split
    assert param_inventory(placed) == inventory
    assert changed_entries(inventory, param_inventory(placed)) == []


def test_one_changed_parameter_is_the_only_change(model, inventory):
    name = "stacks/0/layers/0/mlp/down_proj"
    changed = param_inventory(_with_one_change(model, name))
    assert changed_entries(inventory, changed) == [name]
    assert changed[name]["shape"] == inventory[name]["shape"]
    dropped = dict(inventory)
    del dropped[name]
    assert changed_entries(inventory, dropped) == [name]


def test_inventory_moves_only_the_digest_table(model, capfd):
    """Under the transfer guard's log mode every device-to-host copy is logged with its shape: the
    sharded model's inventory copies at most its [n_arrays, 4] uint32 table, while a host-side hash
    (the former implementation, `state_arrays`) copies every sharded parameter."""
    def transfers(fn, placed):
        capfd.readouterr()
        with jax.transfer_guard_device_to_host("log_explicit"):
            result = fn(placed)
        return result, TRANSFER.findall(capfd.readouterr().err)

    placed = _placed(model)  # each its own placement: a fetched array is cached and not fetched again
    inventory, inventory_transfers = transfers(param_inventory, placed)
    assert set(inventory_transfers) <= {(f"{len(inventory)},{LANES}", "U32")}, inventory_transfers
    sharded = _sharded_names(placed)
    _, whole_model_transfers = transfers(lambda m: state_arrays(nnx.state(m)), _placed(model))
    assert len(whole_model_transfers) >= len(sharded) > 20  # the log does see a whole-model fetch


def test_fp8_weights_are_listed_as_values_and_scales(tmp_path):
    """An FP8 base (`model.fp8.Fp8Weight`): one entry per array, its e4m3 values and float32 scales, each with
    its own digest (equal to the array's own); the same when the model is sharded on 8 devices; changing one
    scale changes that entry only."""
    import fp8_checkpoint as fc
    import jax.numpy as jnp

    from glm52_jax.checkpoint.digest import digest_table, hex_digest
    from glm52_jax.model import fp8

    cfg = config.tiny(num_hidden_layers=2, indexer_types=("full", "full"), first_k_dense_replace=0, vocab_size=128)
    path = fc.write(tmp_path / "fp8", cfg, fc.fp8_tensors(fc.random_tensors(cfg), (16, 12)), fc.quant_config((16, 12)))
    model = glm52_jax.load_pretrained(path, dtype=jnp.float32)
    weights = {"/".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(nnx.state(model))
               if isinstance(v.get_value(), fp8.Fp8Weight)}
    inventory = param_inventory(model)
    assert len(weights) > 10 and not set(weights) & set(inventory)
    for name, w in weights.items():
        for part, array, dtype in (("values", w.values, "float8_e4m3fn"), ("scales", w.scales, "float32")):
            entry = inventory[f"{name}/{part}"]
            assert entry["shape"] == list(array.shape) and entry["dtype"] == dtype, name
            assert entry["digest"] == hex_digest(digest_table([array])[0]), name
    spec = parse_mesh("folded=8")
    with axis_rules(spec.rules()):
        placed = glm52_jax.load_pretrained(path, dtype=jnp.float32, shardings=spec.make())
    assert any(not leaf.sharding.is_fully_replicated for leaf in state_leaves(nnx.state(placed)).values())
    assert param_inventory(placed) == inventory
    name = "stacks/0/layers/0/self_attn/q_a_proj"
    graphdef, state = nnx.split(model)
    flat = [(path, var.replace(dataclasses.replace(var.get_value(), scales=var.get_value().scales.at[0, 0, 0].mul(2))))
            if "/".join(map(str, path)) == name else (path, var) for path, var in nnx.to_flat_state(state)]
    changed = param_inventory(nnx.merge(graphdef, nnx.from_flat_state(flat)))
    assert changed_entries(inventory, changed) == [f"{name}/scales"]



def test_lora_digest_and_file_agree_on_one_and_eight_devices(model, inventory, placed, tmp_path):
    """The LoRA's digest (what a receipt quotes as `training.lora_digest_*`: `inventory_digest` of its entries) is
    the same on one device and sharded on 8, where its compiled digest program reduces a [n_arrays, 4] table with
    all-reduces and no all-gather (the former hash gathered every tensor whole onto every device). Its safetensors
    file, written one tensor at a time from the sharded copy, holds the same values, and its digest from the file
    (`checkpoint.file_digest`, what verify recomputes) is the same."""
    from safetensors.numpy import load_file

    from glm52_jax.checkpoint.digest import _digest_table, hex_digest
    from glm52_jax.checkpoint.file_digest import file_digest
    from glm52_jax.checkpoint.state_file import write_state_file
    from glm52_jax.host_digest import combined_digest
    from glm52_jax.parallel.placement import to_host

    lora = state_leaves(nnx.state(placed, LoRA))
    # The split adapters (the experts'): their own program, as one compile of every adapter costs seconds in CI; the
    # whole inventory's equality on 1 and 8 devices is test_no_op_and_sharding_keep_the_inventory's.
    split = {name: x for name, x in lora.items() if not x.sharding.is_fully_replicated}
    assert len(split) >= 4, split
    compiled = _digest_table.lower(tuple(split.values())).compile()
    hlo = compiled.as_text()
    assert "all-reduce" in hlo and "all-gather" not in hlo
    table = to_host(compiled(tuple(split.values())))
    assert combined_digest((name, x.shape, str(x.dtype), hex_digest(row))
                           for (name, x), row in zip(split.items(), table, strict=True)) == \
        inventory_digest({name: inventory[name] for name in split})
    one = inventory_digest({name: inventory[name] for name in lora})
    assert len(one) == 64 and inventory_digest(inventory) != one  # the LoRA's own, not the whole model's
    write_state_file(nnx.state(placed, LoRA), tmp_path / "lora.safetensors")
    assert file_digest(tmp_path / "lora.safetensors") == one
    stored = load_file(tmp_path / "lora.safetensors")
    assert sorted(stored) == sorted(lora)
    for name, value in lora.items():
        np.testing.assert_array_equal(stored[name], np.asarray(value), err_msg=name)
