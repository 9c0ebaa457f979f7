"""Parity's comparison one parameter at a time (issue 36, item 5): the gradients are read back from the exported
shard files when indexed (`parity_shards.ShardedArrays`), so process 0's host memory is bounded by the largest
parameter, not by every mode's gradients; the metrics equal the whole-array computation's."""

import tracemalloc

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from glm52_jax.rl import parity_metrics, parity_shards

SHAPES = [(64, 128)] * 16 + [(128, 128), (8, 3, 40), (16,)]  # [rows, ...]: rows split over the 8 devices
FAMILIES = ("q", "kv", "experts")


def _gradients(seed: int, base: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for i, shape in enumerate(SHAPES):
        name = f"layers/{i}/{FAMILIES[i % 3]}/b"
        noise = rng.standard_normal(shape).astype(np.float32)
        value = noise if base is None else base[name] + 1e-3 * noise
        if base is None or i % 2:  # exact zeros in the reference, kept by the mode in every other parameter
            value[..., :2] = 0
        out[name] = value
    return out


def _whole_metrics(grads: dict, ref: dict, families: dict) -> dict:
    """The former computation: every family's gradients concatenated in float64, norms of the whole vectors."""
    vecs = {}
    for side, g in (("a", grads), ("r", ref)):
        for fam in sorted(set(families.values())) + ["all"]:
            vecs[side, fam] = np.concatenate([np.asarray(g[n], np.float64).ravel() for n in sorted(g)
                                              if fam == "all" or families[n] == fam])
    out = {}
    for fam in sorted(set(families.values())) + ["all"]:
        a, r = vecs["a", fam], vecs["r", fam]
        out[fam] = {"cosine": float(a @ r / (np.linalg.norm(a) * np.linalg.norm(r))),
                    "rel_l2": float(np.linalg.norm(a - r) / np.linalg.norm(r))}
    return out


def _export(arrays: dict[str, np.ndarray], directory) -> None:
    mesh = jax.make_mesh((8,), ("x",))
    placed = {n: jax.device_put(v, NamedSharding(mesh, P("x"))) for n, v in arrays.items()}
    parity_shards.export_shards(placed, directory, "shards", 0)


def test_streamed_comparison_equals_the_whole_one_and_holds_one_parameter(tmp_path):
    ref = _gradients(0)
    mode = _gradients(1, base=ref)
    families = {n: n.split("/")[2] for n in ref}
    _export(mode, tmp_path / "mode")
    _export(ref, tmp_path / "ref")
    logprobs = np.zeros((2, 4))
    kw = {"logprobs": logprobs, "ref_logprobs": logprobs, "mask": np.ones((2, 4)), "loss": 1.0, "ref_loss": 1.0,
          "outliers": 3}
    streamed_mode, streamed_ref = (parity_shards.ShardedArrays(tmp_path / d, "shards", 1) for d in ("mode", "ref"))
    assert sorted(streamed_mode) == sorted(mode) and len(streamed_ref) == len(ref)

    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        streamed = parity_metrics.pair_metrics(streamed_mode, streamed_ref, families, **kw)
        peak = tracemalloc.get_traced_memory()[1] - start
        tracemalloc.reset_peak()
        start = tracemalloc.get_traced_memory()[0]
        whole_families = _whole_metrics(mode, ref, families)
        whole_peak = tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()

    assert streamed == parity_metrics.pair_metrics(mode, ref, families, **kw)  # the files hold the arrays exactly
    assert streamed["families"].keys() == whole_families.keys()
    for fam, values in whole_families.items():
        for key, value in values.items():
            np.testing.assert_allclose(streamed["families"][fam][key], value, rtol=1e-12, err_msg=f"{fam} {key}")
    assert streamed["elements"] == sum(v.size for v in ref.values())
    assert streamed["mask_differences"] == sum(int(np.count_nonzero((mode[n] == 0) != (ref[n] == 0))) for n in ref)
    assert streamed["mask_differences"] > 0 and streamed["nonfinite"] == streamed["reference_nonfinite"] == 0
    assert len(streamed["outliers"]) == 3

    largest_f64 = max(v.size for v in ref.values()) * 8
    total_f64 = sum(v.size for v in ref.values()) * 8
    # A few float64 copies of the largest parameter (the pair, their difference, its absolute value), far below
    # the gradients, which the former computation held several times over.
    assert peak <= 6 * largest_f64 < total_f64 < whole_peak, (peak, largest_f64, total_f64, whole_peak)
