"""On-device array digests: equal to an independent numpy computation, identical for every sharding on
8 devices, and changed by a one-bit flip or a swap of two elements."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from glm52_jax.checkpoint.digest import LANES, array_digest, digest_table, hex_digest, position_keys

SEEDS = np.array([0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F], np.uint32)
OUTER_SEEDS = np.array([0x165667B1, 0xD3A2646C, 0xFD7046C5, 0xB55A4F09], np.uint32)
SHAPE = (8, 12)  # rows split 2 ways, columns 4 ways on the 2 x 4 mesh
DTYPES = (jnp.float32, jnp.bfloat16, jnp.int32)
LAYOUTS = {"rows": P("a"), "columns": P(None, "b"), "2-D": P("a", "b"), "replicated": P()}


def _fmix32(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def reference_digest(x: np.ndarray, inner_from: int = 0) -> np.ndarray:
    """[LANES] uint32 in numpy: words from the array's bytes, positions from `np.indices`; axes before
    `inner_from` form the outer index (the > 2^32-element path), the rest the inner one."""
    x = np.asarray(x)
    words = x.astype(np.uint32) if x.dtype == np.bool_ else x.view(f"u{x.dtype.itemsize}").astype(np.uint32)
    index = np.indices(x.shape, dtype=np.uint32)
    inner = np.ravel_multi_index(tuple(index[inner_from:]), x.shape[inner_from:]).astype(np.uint32)
    outer = np.ravel_multi_index(tuple(index[:inner_from]), x.shape[:inner_from]).astype(np.uint32)
    out = []
    with np.errstate(over="ignore"):
        for lane in range(LANES):
            mixed = _fmix32(inner + SEEDS[lane])
            if inner_from:
                mixed = _fmix32(mixed ^ _fmix32(outer + OUTER_SEEDS[lane]))
            out.append(_fmix32(words ^ mixed).sum(dtype=np.uint32))
    return np.array(out, np.uint32)


def _base(dtype) -> np.ndarray:
    values = np.random.default_rng(0).standard_normal(SHAPE) * 100
    return np.asarray(jnp.asarray(values, dtype))


def _flip_bit(x: np.ndarray, index, bit: int) -> np.ndarray:
    words = x.copy().view(f"u{x.dtype.itemsize}")
    words[index] ^= words.dtype.type(1 << bit)
    return words.view(x.dtype)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("a", "b"))


@pytest.fixture(scope="module")
def cases(mesh):
    """{(case, layout): (host array, digest row)}: every array of the file in ONE digest_table call."""
    arrays = {}
    for dtype in DTYPES:
        name = jnp.dtype(dtype).name
        base = _base(dtype)
        arrays[(name, "one device")] = base
        for layout in LAYOUTS:
            arrays[(name, layout)] = base
        arrays[(f"{name} flipped", "one device")] = _flip_bit(base, (5, 7), 0)  # lowest bit: widening kept it
        swapped = base.copy()
        swapped[2, 3], swapped[6, 1] = base[6, 1], base[2, 3]
        arrays[(f"{name} swapped", "2-D")] = swapped
    arrays[("0-d", "one device")] = np.float32(1.5)
    arrays[("0-d", "replicated")] = np.float32(1.5)
    arrays[("bool", "rows")] = _base(jnp.float32) > 0
    placed = [jax.device_put(host, NamedSharding(mesh, LAYOUTS[layout]) if layout in LAYOUTS else jax.devices()[0])
              for (_, layout), host in arrays.items()]
    table = digest_table(placed)
    assert table.shape == (len(arrays), LANES) and table.dtype == np.uint32
    return {key: (host, row) for (key, host), row in zip(arrays.items(), table, strict=True)}


def test_digest_equals_numpy_reference(cases):
    for (case, layout), (host, row) in cases.items():
        np.testing.assert_array_equal(row, reference_digest(host), err_msg=f"{case} / {layout}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32", "0-d"])
def test_digest_does_not_depend_on_sharding(cases, dtype):
    rows = {layout: row for (case, layout), (_, row) in cases.items() if case == dtype}
    assert len(rows) == (2 if dtype == "0-d" else 1 + len(LAYOUTS))
    for layout, row in rows.items():
        np.testing.assert_array_equal(row, rows["one device"], err_msg=layout)
    assert len({hex_digest(row) for row in rows.values()}) == 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
def test_one_bit_flip_and_a_swap_change_the_digest(cases, dtype):
    base = cases[(dtype, "one device")][1]
    flipped, swapped = cases[(f"{dtype} flipped", "one device")][1], cases[(f"{dtype} swapped", "2-D")][1]
    assert np.all(flipped != base)  # one changed word changes every lane (both mixes are bijections)
    assert hex_digest(swapped) != hex_digest(base)


def test_large_array_path_folds_in_the_outer_index(mesh):
    """With the index limit lowered to 64, a [3, 8, 4] array takes the path of arrays with >= 2^32
    elements: (outer = first axis, inner = the last two); the digest still ignores the sharding."""
    shape = (3, 8, 4)
    inner, outer = position_keys(shape, limit=64)
    idx = np.indices(shape)
    np.testing.assert_array_equal(np.asarray(outer), idx[0])
    np.testing.assert_array_equal(np.asarray(inner), idx[1] * 4 + idx[2])
    assert position_keys(shape)[1] is None
    np.testing.assert_array_equal(np.asarray(position_keys(shape)[0]), np.arange(96).reshape(shape))
    with pytest.raises(ValueError, match="too long"):
        position_keys((64, 128), limit=64)

    host = np.asarray(np.random.default_rng(1).standard_normal(shape), np.float32)
    layouts = [NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "b")), NamedSharding(mesh, P(None, "a", "b"))]
    small_limit = jax.jit(lambda xs: [array_digest(x, limit=64) for x in xs])
    rows = [np.asarray(r) for r in small_limit([jax.device_put(host, s) for s in layouts])]
    for row in rows:
        np.testing.assert_array_equal(row, reference_digest(host, inner_from=1))
    assert hex_digest(rows[0]) != hex_digest(reference_digest(host))  # the outer index was mixed in


def test_hex_digest_is_lane_order_big_endian():
    assert hex_digest(np.array([1, 0xDEADBEEF, 0, 0xFFFFFFFF], np.uint32)) == "00000001deadbeef00000000ffffffff"
