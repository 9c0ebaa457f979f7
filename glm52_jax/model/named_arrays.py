"""A model state as named arrays: the one naming that the parameter inventory and the evidence hashes share.

`{"path/to/leaf": array}` for every array leaf of an `nnx.State` (leaves without a shape skipped), on device;
an FP8 weight (`model.fp8.Fp8Weight`) is its two arrays, "path/values" (e4m3) and "path/scales" (float32). It
lives in `model` so that `checkpoint` (the inventory) and `evidence` (the hashes) both read it without
importing each other.
"""

from __future__ import annotations

from flax import nnx

from glm52_jax.model.fp8 import Fp8Weight


def state_leaves(state: nnx.State) -> dict[str, object]:
    """`{"path/to/leaf": array}` of a state's array leaves, an FP8 weight as "path/values" and "path/scales"."""
    out = {}
    for path, var in nnx.to_flat_state(state):
        value = var.get_value() if hasattr(var, "get_value") else var
        name = "/".join(map(str, path))
        if isinstance(value, Fp8Weight):
            out[f"{name}/values"], out[f"{name}/scales"] = value.values, value.scales
        elif hasattr(value, "shape"):
            out[name] = value
    return out
