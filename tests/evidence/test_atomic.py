"""Atomic writes: complete new content or untouched old content, and never a stray temp file."""

from __future__ import annotations

import json
import stat

import pytest

from glm52_jax.evidence.atomic import atomic_write_bytes, atomic_write_json, atomic_write_text


def _names(directory):
    return sorted(p.name for p in directory.iterdir())


def test_writes_bytes_text_json(tmp_path):
    assert atomic_write_bytes(tmp_path / "a.bin", b"\x00\x01\x02") == 3
    assert atomic_write_text(tmp_path / "b.txt", "héllo") == len("héllo".encode())
    atomic_write_json(tmp_path / "c.json", {"b": 1, "a": [1.5]}, sort_keys=True)
    assert (tmp_path / "a.bin").read_bytes() == b"\x00\x01\x02"
    assert (tmp_path / "b.txt").read_text(encoding="utf-8") == "héllo"
    assert (tmp_path / "c.json").read_text() == '{"a": [1.5], "b": 1}\n'
    assert stat.S_IMODE((tmp_path / "a.bin").stat().st_mode) == 0o644
    assert _names(tmp_path) == ["a.bin", "b.txt", "c.json"]


def test_chunk_iterable_and_overwrite(tmp_path):
    target = tmp_path / "f"
    target.write_bytes(b"old")
    assert atomic_write_bytes(target, (bytes([i]) * 1000 for i in range(5))) == 5000
    assert target.read_bytes() == b"".join(bytes([i]) * 1000 for i in range(5))
    assert _names(tmp_path) == ["f"]


def test_generator_raising_midway_keeps_old_content_and_no_temp(tmp_path):
    target = tmp_path / "f"
    target.write_bytes(b"old content")

    def chunks():
        yield b"new "
        yield b"partial"
        raise RuntimeError("producer died")

    with pytest.raises(RuntimeError, match="producer died"):
        atomic_write_bytes(target, chunks())
    assert target.read_bytes() == b"old content"
    assert _names(tmp_path) == ["f"]


def test_base_exception_also_cleans_up(tmp_path):
    def chunks():
        yield b"x"
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write_bytes(tmp_path / "new", chunks())
    assert _names(tmp_path) == []


def test_non_bytes_chunk_rejected_and_cleaned(tmp_path):
    with pytest.raises(TypeError, match="expected bytes"):
        atomic_write_bytes(tmp_path / "f", [b"ok", "not bytes"])
    assert _names(tmp_path) == []


def test_json_serialisation_failure_leaves_old_content(tmp_path):
    target = tmp_path / "r.json"
    atomic_write_json(target, {"v": 1})

    def explode(obj):
        raise ValueError(f"cannot serialise {type(obj).__name__}")

    with pytest.raises(ValueError, match="cannot serialise object"):
        atomic_write_json(target, {"v": 2, "bad": object()}, default=explode)
    with pytest.raises(ValueError):  # strict JSON: NaN is refused, not written as a bare NaN token
        atomic_write_json(target, {"v": float("nan")})
    assert json.loads(target.read_text()) == {"v": 1}
    assert _names(tmp_path) == ["r.json"]


def test_no_overwrite_mode(tmp_path):
    target = tmp_path / "receipt.json"
    atomic_write_text(target, "first", overwrite=False)
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        atomic_write_text(target, "second", overwrite=False)
    assert target.read_text() == "first"
    assert _names(tmp_path) == ["receipt.json"]
