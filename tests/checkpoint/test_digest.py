"""On-device array digests: equal to an independent numpy computation, identical for every sharding on
8 devices, and changed by a one-bit flip or a swap of two elements."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from glm52_jax import host_digest
from glm52_jax.checkpoint.digest import (
    CHUNK_BYTES,
    INDEX_LIMIT,
    LANES,
    AxisCut,
    array_digest,
    chunk_plan,
    digest_table,
    hex_digest,
    position_keys,
)

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
    if x.dtype.itemsize == 8:  # two words per element, low word first: [*S, 2]
        words = np.ascontiguousarray(x).view(np.uint32).reshape(x.shape + (2,))
    index = np.indices(words.shape, dtype=np.uint32)
    inner = np.ravel_multi_index(tuple(index[inner_from:]), words.shape[inner_from:]).astype(np.uint32)
    outer = np.ravel_multi_index(tuple(index[:inner_from]), words.shape[:inner_from]).astype(np.uint32)
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


# Chunked path: {case: (host array, layout, limit, chunk_bytes)}; chunk_bytes far below the arrays' words so
# the loop runs, with blocks that do not divide their axes (a last block overlapping the one before it).
CHUNKED = {
    "leading axis sharded 8 ways": (np.arange(720, dtype=np.float32).reshape(24, 10, 3) * 1.5, P(("a", "b")), 64, 300),
    "bfloat16, 2-D sharding": (_base(jnp.bfloat16).repeat(2, 0).repeat(3, 1)[..., None].repeat(6, 2), P("a", "b"),
                               None, 1000),
    "bool, rows": (np.random.default_rng(3).standard_normal((40, 9)) > 0, P("a"), None, 300),
    "uint8, prime length": (np.random.default_rng(4).integers(0, 256, 1009, dtype=np.uint8), P(), None, 400),
    "outer index, columns": (np.random.default_rng(5).standard_normal((6, 12, 5)).astype(np.float32), P(None, "a"),
                             64, 40),
}


@pytest.fixture(scope="module")
def chunked(mesh):
    """{case: (digest row, numpy reference row)} from ONE jitted program over every chunked case."""
    keys = jax.random.split(jax.random.key(3), (20, 3))  # PRNG keys: digested as their uint32 key data
    hosts = [host for host, *_ in CHUNKED.values()] + [np.asarray(jax.random.key_data(keys))]
    placed = [jax.device_put(host, NamedSharding(mesh, layout)) for host, layout, *_ in CHUNKED.values()]
    placed.append(jax.device_put(keys, NamedSharding(mesh, P())))
    options = [(limit or INDEX_LIMIT, chunk_bytes) for *_, limit, chunk_bytes in CHUNKED.values()] + [(INDEX_LIMIT, 96)]
    rows = jax.jit(lambda xs: [array_digest(x, limit, chunk) for x, (limit, chunk) in zip(xs, options)])(placed)
    refs = [reference_digest(host, inner_from=1 if limit < INDEX_LIMIT else 0)
            for host, (limit, _) in zip(hosts, options, strict=True)]
    return {name: (np.asarray(row), ref) for name, row, ref in zip([*CHUNKED, "PRNG keys"], rows, refs, strict=True)}


def test_chunked_digest_equals_numpy_reference(chunked):
    for name, (row, ref) in chunked.items():
        np.testing.assert_array_equal(row, ref, err_msg=name)


def test_eight_byte_types_whole_and_chunked(mesh):
    """float64 / int64 (with x64 enabled; two words per element, the word axis never cut): the digest
    of the whole array and of 300-byte chunks both equal the numpy reference, sharded by columns."""
    rng = np.random.default_rng(2)
    hosts = [rng.standard_normal((12, 20)), rng.integers(-2**62, 2**62, (7, 12, 3))]
    with jax.enable_x64(True):
        placed = [jax.device_put(host, NamedSharding(mesh, P(None, "b"))) for host in hosts]
        assert [x.dtype for x in placed] == [np.float64, np.int64]
        rows = jax.jit(lambda xs: [array_digest(x, chunk_bytes=chunk) for x in xs for chunk in (CHUNK_BYTES, 300)])(
            placed)
    assert all(math.prod(cut.blocks for cut in chunk_plan(host.shape, 8, 300, 8)) > 1 for host in hosts)
    for i, row in enumerate(rows):
        np.testing.assert_array_equal(np.asarray(row), reference_digest(hosts[i // 2]), err_msg=f"{i}")


def test_chunk_plans_of_the_cases_loop_and_overlap():
    """The cases above take the loop (several steps), a sharded leading axis is walked in blocks, and
    blocks that do not divide their axis occur (else the tail mask would be untested)."""
    plans = {name: chunk_plan(host.shape, 4, chunk, 8)
             for name, (host, _, _, chunk) in CHUNKED.items()}
    assert all(math.prod(cut.blocks for cut in plan) > 1 for plan in plans.values())
    leading = plans["leading axis sharded 8 ways"][0]
    assert (leading.groups, leading.blocks) == (8, 3)  # 8-way shards kept, 3 blocks inside each
    assert sum(cut.block * cut.blocks > cut.length for plan in plans.values() for cut in plan) >= 3


def test_chunk_plan_keeps_shards_and_bounds_a_step():
    """At the 2M configuration's largest expert kernel ([layers, experts, D, F] bf16 on 32 devices): each
    axis keeps a multiple of 32 groups where it can (any 32-way sharding stays local) and a step reads at
    most 64 MiB of words."""
    shape = (18, 256, 2048, 6144)
    plan = chunk_plan(shape, 4, CHUNK_BYTES, 32)
    assert [cut.groups for cut in plan] == [2, 32, 32, 32]
    assert all(cut.groups * cut.length == size and cut.block * cut.blocks >= cut.length > cut.block * (cut.blocks - 1)
               for cut, size in zip(plan, shape, strict=True))
    assert math.prod(cut.groups * cut.block for cut in plan) * 4 <= CHUNK_BYTES
    assert chunk_plan((3, 5), 4, CHUNK_BYTES, 32) == (AxisCut(1, 3, 3, 1), AxisCut(1, 5, 5, 1))  # small: one step


@pytest.mark.parametrize("layout", ["replicated", "2-D"])
def test_digest_temporaries_are_bounded_by_a_chunk(mesh, layout):
    """Compiled for a 64 MiB bf16 array with 8 MiB chunks: temporaries stay within the lane values of one
    step (4 uint32 per word; per device 1/8 of it when sharded 8 ways) instead of ~8x the array, and a
    sharded array is never gathered."""
    chunk_bytes, array_bytes = 8 << 20, 64 << 20
    x = jax.ShapeDtypeStruct((256, 128, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, LAYOUTS[layout]))
    compiled = jax.jit(lambda x: array_digest(x, chunk_bytes=chunk_bytes)).lower(x).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    per_device = 8 if layout == "2-D" else 1
    assert temp <= (4 * chunk_bytes + (1 << 20)) // per_device, temp
    assert temp < array_bytes  # the whole-array program of before needed 8x the array (512 MiB here)
    assert "all-gather" not in compiled.as_text()


def test_host_digest_equals_the_device_digest(cases, chunked, monkeypatch):
    """`host_digest.array_digest` (numpy: what verify recomputes from a receipt's files) equals the device digest
    on every dtype and layout, on the chunked cases in host steps of 7 words, and on the outer-index path."""
    for (case, layout), (host, row) in cases.items():
        np.testing.assert_array_equal(host_digest.array_digest(host), row, err_msg=f"{case} / {layout}")
    monkeypatch.setattr(host_digest, "CHUNK_ELEMENTS", 7)
    for name, (host, _, limit, _) in CHUNKED.items():
        monkeypatch.setattr(host_digest, "INDEX_LIMIT", limit or INDEX_LIMIT)
        np.testing.assert_array_equal(host_digest.array_digest(host), chunked[name][0], err_msg=name)
