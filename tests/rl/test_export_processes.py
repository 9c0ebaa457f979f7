"""`--mode=export` on a mesh and on several processes (rl/export.py): the same files, byte for byte, as the
export on one device, which itself equals the whole-model `merge_lora` + `save_pretrained`; host memory is
bounded by the largest tensor, not the model.

One set of random adapters (every B nonzero) is saved as step 1 of four workdirs that differ only in
`mesh` ("", and the meshes below), so each export restores the same values onto its own mesh."""

import json
import shutil
import time
import tracemalloc
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from glm52_jax.checkpoint.hf import _hf_tensors, host_transfers, save_pretrained
from glm52_jax.checkpoint.peft import save_peft_adapter
from glm52_jax.checkpoint.train_state import RunCheckpoints, RunState
from glm52_jax.model.lora import LoRA, merge_lora
from glm52_jax.rl.export import export_run, tokenizer_files
from glm52_jax.rl.inputs import resolve
from glm52_jax.rl.policy import build_policy
from glm52_jax.run_config import ConfigError, save_spec
from tests.process_helpers import finish, start_launchers
from tests.run_helpers import config_spec

MESHES = ("context=4,expert=2", "folded=8")
TWO_PROCESS_MESH = "folded=8"  # experts 0-3 on process 0's devices, 4-7 on process 1's: a real exchange


def _spec(mesh: str):
    return config_spec("tiny", mesh=mesh)


def _name(mesh: str) -> str:
    return mesh.replace("=", "").replace(",", "_") or "one"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """root/<mesh name>: a workdir whose step 1 holds the random adapters; root/reference: those adapters
    and the whole-model merge as `save_peft_adapter` / `save_pretrained(merge_lora(model))` write them, with the
    run's tokenizer files (`export.tokenizer_files`)."""
    root = tmp_path_factory.mktemp("export_runs")
    spec = _spec("")
    model, optimizer = build_policy(spec, resolve(spec, data=False))
    rng = np.random.default_rng(0)
    nnx.update(model, jax.tree.map(lambda x: (rng.standard_normal(x.shape) * 0.05).astype(x.dtype),
                                   nnx.state(model, LoRA)))
    for mesh in ("",) + MESHES:
        s = _spec(mesh)
        save_spec(s, root / _name(mesh), ["test"])
        ckpts = RunCheckpoints(root / _name(mesh) / "checkpoints")
        ckpts.save(model, optimizer, RunState(step=1, rng=jax.random.key(0), cursor=0, optimizer_steps=1,
                                              meta={"config_sha256": s.resume_sha256(), "base": s.model.base_name}))
        ckpts.close()
    save_peft_adapter(model, root / "reference" / "peft", base_model_name_or_path=spec.model.base_name)
    save_pretrained(merge_lora(model), root / "reference" / "merged")
    for name, source in tokenizer_files(spec.model).items():  # an export ships the run's tokenizer beside the model
        shutil.copyfile(source, root / "reference" / "merged" / name)
    return root


@pytest.fixture(scope="module")
def one_device(runs):
    """The export of the one-device run: its record."""
    return export_run(_spec(""), runs / "one", export_dir=runs / "one_export")


def _hashes(record: dict) -> dict[str, tuple[int, str]]:
    return {f["path"]: (f["bytes"], f["sha256"]) for f in record["files"]}


def test_one_device_export_is_the_whole_model_merge(runs, one_device):
    """Merged one tensor at a time, the files are those of merge_lora's whole merged model, byte for byte."""
    out = Path(one_device["export_dir"])
    written = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert written == sorted([*_hashes(one_device), "export.json"])
    for path in _hashes(one_device):
        assert (out / path).read_bytes() == (runs / "reference" / path).read_bytes(), path
    base = _spec("").model.checkpoint_path
    assert (out / "merged" / "model.safetensors").read_bytes() != (Path(base) / "model.safetensors").read_bytes()
    assert json.loads((out / "export.json").read_text())["files"] == one_device["files"]
    assert not [p for p in runs.iterdir() if ".staging-" in p.name]


@pytest.mark.parametrize("mesh", MESHES)
def test_mesh_export_writes_the_one_device_files(runs, one_device, mesh):
    """Restored on the mesh, sliced and merged per tensor there: the same bytes. The export goes to a
    directory holding a previous export (and a stray file in it): replaced whole. No host transfer is
    larger than the largest tensor."""
    out = runs / f"{_name(mesh)}_export"
    shutil.copytree(one_device["export_dir"], out)
    (out / "merged" / "stale.safetensors").write_bytes(b"old")
    host_transfers.reset()
    record = export_run(_spec(mesh), runs / _name(mesh), export_dir=out)
    assert _hashes(record) == _hashes(one_device)
    assert not (out / "merged" / "stale.safetensors").exists()
    largest = max(f["bytes"] for f in record["files"] if f["path"].startswith("merged/model"))
    assert host_transfers.largest_bytes <= _largest_tensor_bytes(runs) < largest
    assert host_transfers.total_bytes >= largest  # every tensor went through the counted path


def _largest_tensor_bytes(runs) -> int:
    from glm52_jax.checkpoint.safetensors_io import SafetensorsFile

    f = SafetensorsFile(runs / "reference" / "merged" / "model.safetensors")
    return max(info.end - info.begin for info in f.tensors.values())


def test_export_refuses_a_directory_that_is_not_an_export(runs, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"--export_dir=.* exists and is not an export"):
        export_run(_spec(""), runs / "one", export_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_merged_save_holds_one_tensor_at_a_time_on_the_host(runs):
    """tracemalloc over the merged save on the folded mesh: the peak beyond the tensor list's own bookkeeping
    is a few tensors' worth (the host copy, its transposed copy, the bytes written), far below the model."""
    from contextlib import ExitStack

    from glm52_jax.parallel.rules import axis_rules
    from glm52_jax.rl.policy import train_mesh

    spec = _spec(TWO_PROCESS_MESH)
    mesh_spec, mesh = train_mesh(spec)
    with ExitStack() as stack:
        stack.enter_context(axis_rules(mesh_spec.rules()))
        model, optimizer = build_policy(spec, resolve(spec, data=False), mesh, init_adapter=False)
    ckpts = RunCheckpoints(runs / _name(TWO_PROCESS_MESH) / "checkpoints")
    ckpts.restore(1, model, optimizer)
    ckpts.close()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        tensors = _hf_tensors(model, merge_adapters=True)  # the list alone: names, shapes, closures
        bookkeeping = tracemalloc.get_traced_memory()[1] - start
        del tensors
        tracemalloc.reset_peak()
        start = tracemalloc.get_traced_memory()[0]
        save_pretrained(model, runs / "traced_merged", merge_adapters=True)
        peak = tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()
    largest = _largest_tensor_bytes(runs)
    model_bytes = (runs / "reference" / "merged" / "model.safetensors").stat().st_size
    assert peak <= bookkeeping + 4 * largest < model_bytes / 2, (peak, bookkeeping, largest, model_bytes)
    ref = runs / "reference" / "merged" / "model.safetensors"
    assert (runs / "traced_merged" / "model.safetensors").read_bytes() == ref.read_bytes()


@pytest.mark.slow  # 31 s on a quiet 2-core machine, 81 s on a loaded one
def test_two_launcher_processes_export_the_one_device_files(runs, one_device):
    """`--mode=export` by two launcher processes x 4 CPU devices (gloo) on the folded mesh: process 0 writes
    the one-device files, byte for byte; both report the export."""
    out = runs / "two_process_export"
    start = time.monotonic()
    args = [f"--workdir={runs / _name(TWO_PROCESS_MESH)}", "--mode=export", f"--export_dir={out}"]
    logs = runs / "two_process_export_logs"
    done = finish(start_launchers([args, args], logs), logs, timeout=600)
    seconds = time.monotonic() - start
    for code, stdout, err in done:
        assert code == 0, err[-3000:]
        assert json.loads(stdout.strip().splitlines()[-1]) == {"export_dir": str(out), "step": 1,
                                                              "base": one_device["base"]}
    record = json.loads((out / "export.json").read_text())
    assert _hashes(record) == _hashes(one_device)
    assert not [p for p in runs.iterdir() if ".staging-" in p.name]
    print(f"two-process export: {seconds:.1f} s")
