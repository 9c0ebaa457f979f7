"""Provenance: canonical hashes, source digest, git state, package versions."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess

import numpy as np
import pytest

from glm52_jax.evidence.provenance import (
    canonical_json,
    canonical_sha256,
    check_json,
    collect_provenance,
    config_hash,
    git_info,
    package_root,
    package_versions,
    source_digest,
    source_files,
)


def test_canonical_json_is_order_independent_and_exact():
    a = {"b": [1, 2.5, None], "a": {"y": True, "x": "é"}}
    b = {"a": {"x": "é", "y": True}, "b": [1, 2.5, None]}
    assert canonical_json(a) == canonical_json(b) == b'{"a":{"x":"\\u00e9","y":true},"b":[1,2.5,null]}'
    assert config_hash(a) == config_hash(b) == canonical_sha256(a) == hashlib.sha256(canonical_json(a)).hexdigest()
    assert config_hash({"a": 1}) != config_hash({"a": 2})
    assert canonical_json({"t": (1, 2)}) == canonical_json({"t": [1, 2]})


def test_config_hash_of_dataclass():
    @dataclasses.dataclass(frozen=True)
    class Cfg:
        layers: int
        dims: tuple[int, ...]

    assert config_hash(Cfg(2, (3, 4))) == config_hash({"dims": [3, 4], "layers": 2})


@pytest.mark.parametrize("bad, where", [
    ({"a": {"b": [1.0, float("nan")]}}, r"\$\.a\.b\[1\]: non-finite"),
    ({"x": float("-inf")}, r"\$\.x: non-finite"),
])
def test_non_finite_rejected_with_key_path(bad, where):
    with pytest.raises(ValueError, match=where):
        check_json(bad)
    with pytest.raises(ValueError, match=where):
        config_hash(bad)


def test_non_json_types_rejected_with_key_path():
    with pytest.raises(TypeError, match=r"\$\.n: float32 is not JSON data"):
        canonical_json({"n": np.float32(1.0)})
    with pytest.raises(TypeError, match=r"dict key 1 is int"):
        canonical_json({"m": {1: "x"}})


def _tree(root):
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("x = 1\n")
    (root / "pkg" / "sub" / "mod.py").write_text("def f():\n    return 2\n")
    (root / "pkg" / "sub" / "data.jsonl").write_text('{"a": 1}\n')
    (root / "pkg" / "cfg.json").write_text("{}")
    (root / "pkg" / "notes.txt").write_text("not source")
    return root / "pkg"


def test_source_digest_tracks_paths_and_contents_only(tmp_path):
    pkg = _tree(tmp_path / "one")
    assert source_files(pkg) == ["__init__.py", "cfg.json", "sub/data.jsonl", "sub/mod.py"]
    digest = source_digest(pkg)

    copy = tmp_path / "elsewhere" / "pkg"
    shutil.copytree(pkg, copy)
    os.utime(copy / "sub" / "mod.py", (1, 1))
    assert source_digest(copy) == digest  # location and mtimes do not matter

    (copy / "notes.txt").write_text("edited")
    (copy / "__pycache__").mkdir()
    (copy / "__pycache__" / "junk.py").write_text("cached")
    assert source_digest(copy) == digest  # non-source files and caches do not count

    (copy / "sub" / "mod.py").write_text("def f():\n    return 3\n")
    assert source_digest(copy) != digest
    (copy / "sub" / "mod.py").write_text("def f():\n    return 2\n")
    assert source_digest(copy) == digest
    (copy / "sub" / "mod.py").rename(copy / "sub" / "mod2.py")
    assert source_digest(copy) != digest


def test_source_digest_of_installed_package():
    files = source_files(package_root())
    assert "evidence/provenance.py" in files and "__init__.py" in files
    assert source_digest() == source_digest(package_root())
    with pytest.raises(NotADirectoryError):
        source_digest(package_root() / "no-such-dir")


def _git(repo, *args):
    subprocess.run(["git", "-c", "user.name=test", "-c", "user.email=test@example.com", "-c", "commit.gpgsign=false",
                    *args], cwd=repo, check=True, capture_output=True)


def test_git_info_on_temp_repo(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("a = 1\n")
    assert git_info(repo) == {"commit": None, "dirty": True}  # no commit yet, untracked file
    _git(repo, "add", "a.py")
    _git(repo, "commit", "-q", "-m", "first")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    assert git_info(repo) == {"commit": head, "dirty": False}
    (repo / "sub").mkdir()
    assert git_info(repo / "sub") == {"commit": head, "dirty": False}  # empty dirs are not changes
    (repo / "a.py").write_text("a = 2\n")
    assert git_info(repo / "sub") == {"commit": head, "dirty": True}


def test_git_info_outside_repo_and_without_git(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    plain = tmp_path / "plain"
    plain.mkdir()
    assert git_info(plain) == {"commit": None, "dirty": None}
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    monkeypatch.setenv("PATH", str(empty_bin))  # no git executable anywhere
    assert git_info(package_root()) == {"commit": None, "dirty": None}


def test_package_versions_and_collect():
    versions = package_versions()
    assert set(versions) >= {"jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "ml_dtypes",
                             "tokenizers", "python", "platform"}
    assert versions["numpy"] == np.__version__
    prov = collect_provenance()
    check_json(prov)
    assert prov["source_sha256"] == source_digest() and prov["source_files"] == len(source_files(package_root()))
    assert set(prov["git"]) == {"commit", "dirty"}
