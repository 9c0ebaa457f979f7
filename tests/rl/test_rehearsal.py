"""configs/rehearsal.py (the 2M run's structure at tiny size) as the real run executes it: 2 launcher
processes x 4 CPU devices (gloo) forming one 8-device mesh, for both meshes, against the same settings
run in this process on one device (so one reference checks both the processes and the sharding). One
run is killed mid-step 2 and resumed. The launcher processes run with `--audit_replicated_mib`: at every
progress line they walk `jax.live_arrays()` and stop on any array that lives whole on every device.

The launcher processes are given a persistent compilation cache (a directory of this module), which multi-process
CPU runs leave unused (parallel/distributed.py says why); the one-device reference uses it."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from glm52_jax.evidence import deterministic_view, verify
from glm52_jax.rl import parity_shards
from tests.process_helpers import finish, start_launchers
from tests.run_helpers import ROOT, config_spec

REHEARSAL = str(ROOT / "configs" / "rehearsal.py")
RANK_FILES = ["artifacts/traces/rank{}.jsonl", "artifacts/completion/rank{}.json"]
KILL_BOUND_S = 30  # the bound: the survivor stops within 30 s of its peer's death
# Above the tiny policy's largest weight (weights are replicated on purpose at TP1), below its prompt cache.
REPLICATED_LIMIT = 256 * 1024
AUDIT = f"--audit_replicated_mib={REPLICATED_LIMIT / 2**20}"


@pytest.fixture(scope="module")
def jit_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("jit_cache")


def _start(workdir: Path, flags: list[str], logs: Path, cache: Path,
           rank_flags: tuple[list[str], list[str]] = ([], []), cwds: tuple[Path, Path] | None = None,
           env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """The rehearsal as processes 0 and 1 of one group, audited (`rank_flags[p]`: process p's own flags)."""
    common = [f"--config={REHEARSAL}", f"--workdir={workdir}", AUDIT, *flags]
    return start_launchers([common + rank_flags[0], common + rank_flags[1]], logs, cwds=cwds,
                           env={"JAX_COMPILATION_CACHE_DIR": str(cache), **(env or {})})


def _two_processes(workdir: Path, flags: list[str], logs: Path, cache: Path) -> list[dict]:
    done = finish(_start(workdir, flags, logs, cache), logs)
    summaries = []
    for code, out, err in done:
        assert code == 0, err[-3000:]
        summaries.append(json.loads(out.strip().splitlines()[-1]))
    assert summaries[0] == summaries[1]
    return summaries


def _one_process(workdir: Path, flags: list[str], env_overrides: dict[str, str] | None = None) -> dict:
    """The rehearsal as one launcher process on one device (this machine's devices, this session's compile cache,
    no process group), audited: its summary and stderr. `env_overrides` replace those variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLM52_")}
    env.update(env_overrides or {})
    done = subprocess.run([sys.executable, "-m", "glm52_jax.launch", f"--config={REHEARSAL}", f"--workdir={workdir}",
                           "--config.mesh=", AUDIT, *flags], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "stderr": done.stderr}


@pytest.fixture(scope="module")
def one_device(tmp_path_factory) -> Path:
    """Two steps of the rehearsal's settings in one process on one device: its workdir."""
    workdir = tmp_path_factory.mktemp("one_device") / "run"
    summary = _one_process(workdir, ["--config.train.steps=2"])
    assert summary["status"] == "updated" and summary["steps_run"] == 2, summary
    return workdir


# What a float reduction order can change (gloo's all-reduce across processes vs XLA:CPU's in one): compared
# within 1e-5 below, or (the LoRA after an update, and so before every later step) by shape and by what it
# computes next. Everything else (tokens, texts, rewards, groups, every base weight's digest) is byte-identical.
FLOAT_ARTIFACTS = ("old_logprobs.npy", "new_logprobs.npy", "samples.jsonl", "lora_before.safetensors",
                   "lora_after.safetensors", "inventory_before_sampling.json", "inventory_after_sampling.json")
FLOAT_TRAINING = ("loss", "grad_norm", "grads_digest", "lora_sha256_before", "lora_sha256_after",
                  "lora_digest_before", "lora_digest_after", "metrics")


def _without_floats(view: dict) -> dict:
    """Also without the config hashes: the 1-device reference differs in `mesh` (and maybe `train.steps`)."""
    del view["topology"], view["nondeterministic"], view["config"]["sha256"], view["config"]["resume_sha256"]
    for key in FLOAT_TRAINING:
        view["training"].pop(key)
    view["manifest"] = [e for e in view["manifest"] if e["path"].rpartition("/")[2] not in FLOAT_ARTIFACTS]
    return view


def _samples(path: Path) -> tuple[list[dict], np.ndarray]:
    """samples.jsonl without its log-probs, and the log-probs of every sample concatenated."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    logprobs = np.concatenate([np.asarray(r.pop("logprobs"), np.float64) for r in rows])
    return rows, logprobs


def _assert_same_receipt(one: Path, two: Path, processes: int = 2, per_process: int = 4) -> None:
    """The receipt of `processes` x `per_process` devices verifies and equals the 1-device one: tokens, rewards
    and every other deterministic section exactly; log-probs, loss, grad norm and KL within 1e-5; each
    rank's trace and completion record listed."""
    assert verify(two) == []
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert (a["topology"]["processes"], a["topology"]["mesh_devices"]) == (1, 1)
    mesh_devices = processes * per_process
    assert (b["topology"]["processes"], b["topology"]["mesh_devices"]) == (processes, mesh_devices)
    if processes > 1:
        assert b["topology"]["devices"] == mesh_devices
    rank_paths = [f.format(r) for r in range(processes) for f in RANK_FILES]
    assert a["nondeterministic"] == ["traces", *rank_paths[:2], "probe_timing"] and a["traces"]["ranks"] == 1
    assert b["nondeterministic"] == ["traces", *rank_paths, "probe_timing"] and b["traces"]["ranks"] == processes
    assert set(rank_paths) <= {e["path"] for e in b["manifest"]}
    for rank in range(processes):
        record = json.loads((two.parent / RANK_FILES[1].format(rank)).read_text())
        assert record["process"] == rank and record["processes"] == processes
        assert processes == 1 or len(record["devices"]) == per_process
        assert record["events"]["update_end"] == 1
        trace = [json.loads(line) for line in (two.parent / RANK_FILES[0].format(rank)).read_text().splitlines()]
        assert [e["event"] for e in trace][-1] == "step_done"
    ta, tb = a["training"], b["training"]
    # The loss is a mean of advantage-weighted ratios whose advantages sum to 0 within a group: about 0 by
    # cancellation of terms ~1 (0.0 on one device, 2.98e-8 on 2 processes at step 2), so its absolute error is
    # float32 rounding of those terms; the grad norm is far from 0.
    for key, atol in (("loss", 1e-6), ("grad_norm", 0.0)):
        np.testing.assert_allclose(tb[key], ta[key], rtol=1e-5, atol=atol, err_msg=key)
    for key in ta["metrics"]:
        np.testing.assert_allclose(tb["metrics"][key], ta["metrics"][key], rtol=1e-5, atol=1e-6, err_msg=key)
    art_a, art_b = one.parent / "artifacts", two.parent / "artifacts"
    for name in ("old_logprobs.npy", "new_logprobs.npy"):
        np.testing.assert_allclose(np.load(art_b / name), np.load(art_a / name), rtol=1e-5, atol=1e-5, err_msg=name)
    (rows_a, lp_a), (rows_b, lp_b) = _samples(art_a / "samples.jsonl"), _samples(art_b / "samples.jsonl")
    assert rows_b == rows_a  # every sample's prompt hash, tokens, text, reward and stop reason
    np.testing.assert_allclose(lp_b, lp_a, rtol=1e-5, atol=1e-5)
    # The updated LoRA is not compared element by element: AdamW's first step sets each element to about
    # -lr * g / (|g| + eps), so an element whose gradient is near eps moves by up to lr on a last-bit gradient
    # difference (measured: 1e-5 at lr 1e-4). The next step's log-probs and loss, compared above, depend on it.
    lora_a, lora_b = load_file(art_a / "lora_after.safetensors"), load_file(art_b / "lora_after.safetensors")
    assert {k: v.shape for k, v in lora_b.items()} == {k: v.shape for k, v in lora_a.items()}
    for when in ("before", "after"):
        inv_a, inv_b = (json.loads((art / f"inventory_{when}_sampling.json").read_text()) for art in (art_a, art_b))
        assert {k: v["shape"] for k, v in inv_b.items()} == {k: v["shape"] for k, v in inv_a.items()}
        base = {k for k in inv_a if "_lora/" not in k}
        assert len(base) > 20 and {k: inv_b[k] for k in base} == {k: inv_a[k] for k in base}
        if a["transaction"]["step"] == 1:  # fresh adapters from the seed: the same bits
            assert inv_b == inv_a
    if a["transaction"]["step"] == 1:  # each process digested its own shards: the 1-device run's digest
        assert tb["lora_digest_before"] == ta["lora_digest_before"]
    assert _without_floats(deterministic_view(b)) == _without_floats(deterministic_view(a))


def _has_event(metrics: Path, event: dict) -> bool:
    """Whether the run's metrics.jsonl (process 0's) holds a record with every field of `event` (a last line still
    being written is skipped)."""
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if all(record.get(k) == v for k, v in event.items()):
            return True
    return False


def _kill_process_1(procs: list[subprocess.Popen], logs: Path, workdir: Path) -> None:
    """SIGKILLs process 1; process 0 must exit 1 within KILL_BOUND_S with one line naming its dead peer and what
    `workdir` keeps (step 1)."""
    procs[1].send_signal(signal.SIGKILL)
    killed_at = time.time()
    procs[0].wait(timeout=KILL_BOUND_S + 60)
    stopped_after = time.time() - killed_at
    err0 = (logs / "0.err").read_text().strip().splitlines()
    print(f"process 0 stopped {stopped_after:.1f} s after process 1 was killed: {err0[-1]}")
    assert procs[0].returncode == 1 and stopped_after <= KILL_BOUND_S, err0[-5:]
    assert err0[-1].startswith("process error: process 1 stopped responding (no heartbeat for "), err0[-5:]
    assert f"{workdir} keeps committed steps up to 1" in err0[-1]


def _receipt(workdir: Path, step: int) -> Path:
    return workdir / "evidence" / f"step_{step:06d}" / "receipt.json"


def test_the_rehearsal_has_the_2m_runs_shape():
    spec, two_m = config_spec("rehearsal"), config_spec("2m")
    for name in ("sampling.prefill_mode", "train.gradient_mode", "sampling.samples_per_request",
                 "sampling.num_samples", "sampling.max_new_tokens"):
        section, key = name.split(".")
        assert getattr(getattr(spec, section), key) == getattr(getattr(two_m, section), key), name
    assert spec.mesh == "folded=8" and spec.model.rope_scaling_json.endswith("rehearsal_yarn.json")
    limit = json.loads(Path(spec.model.rope_scaling_json).read_text())["max_position_embeddings"]
    assert spec.data.prompt_tokens + spec.sampling.max_new_tokens == limit  # at the position limit
    assert limit % 8 and limit % 4  # the capacity divides neither mesh's slot shards
    assert 0 < spec.search.probe_tokens < spec.data.prompt_tokens
    largest = 0
    with safe_open(str(ROOT / "glm52_jax" / "assets" / "tiny_policy" / "model.safetensors"), "np") as f:
        for name in f.keys():
            largest = max(largest, f.get_slice(name).get_shape() and np.prod(f.get_slice(name).get_shape()) * 4)
    assert largest < REPLICATED_LIMIT  # the audit's limit sits above every (float32) weight


def test_processes_with_different_settings_refuse_to_start(tmp_path, jit_cache):
    logs = tmp_path / "logs"
    done = finish(_start(tmp_path / "w", [], logs, jit_cache, rank_flags=([], ["--config.seed=7"])), logs,
                   timeout=300)
    for code, _, err in done:
        lines = err.strip().splitlines()
        assert code == 1 and len(lines) == 1, err[-3000:]
        assert lines[0].startswith("config error: the processes were started with different settings: process 1 ")
    assert not (tmp_path / "w" / "config.json").exists()  # refused before the workdir was claimed


# ~320 s of CI's 2-core budget (the 2M-shaped run on 2 processes x 4 devices against one device): `slow` since the
# CI wall reached 1,217-1,251 s (session 4); it passed in the CI runs of 7391966, 373534a and c7f556c. CI runs the
# rehearsal on 2 processes x 2 devices instead (test_two_processes_killed_then_resumed_on_one_device).
@pytest.mark.slow
def test_folded_two_processes_reproduce_one_device(one_device, tmp_path, jit_cache):
    two = _two_processes(tmp_path / "two", [], tmp_path / "logs", jit_cache)
    assert two[0]["status"] == "updated"
    _assert_same_receipt(_receipt(one_device, 1), _receipt(tmp_path / "two", 1))
    err = (tmp_path / "logs" / "1.err").read_text()
    assert "[1/2] step 1 update (response_only): updated" in err  # progress lines carry the rank
    _assert_closed(tmp_path / "two", steps=1)


def _assert_closed(workdir: Path, steps: int) -> None:
    """The 2-process run's closure receipt verifies: both processes finished every phase, issued the same
    collectives (the CP/EP mesh's all-to-alls and all-reduces among them), stopped the coordinator and closed its
    port, and hold no live array after the release."""
    path = workdir / "evidence" / f"closure_step_{steps:06d}.json"
    assert verify(path) == []
    records = json.loads(path.read_text())["closure"]["records"]
    assert [r["process"] for r in records] == [0, 1]
    for record in records:
        by_kind = record["collectives"]["by_kind"]
        assert by_kind["all-reduce"]["ops"] > 0 and by_kind["all-to-all"]["ops"] > 0, by_kind
        assert record["stopped"]["coordinator"] == "shut down" and record["coordinator_port"]["closed"] is True
        assert record["after_release"]["live_array_bytes"] == 0


@pytest.mark.slow  # ~60-150 s: a third 2-process run
def test_processes_that_score_differently_stop_before_the_search_diverges(tmp_path, jit_cache):
    """Each process reads `rows.jsonl` from its own directory, and process 1's copy gives row 0 another
    answer: the settings agree (same path), the tokens agree, the rewards do not. Both stop at candidate 0,
    before the rewards steer the search (one would accept, the other sample on: different collectives)."""
    rows = (ROOT / "glm52_jax" / "assets" / "math_problems.jsonl").read_text().splitlines()
    first = json.loads(rows[0])
    cwds = (tmp_path / "host0", tmp_path / "host1")
    for cwd, answer in zip(cwds, (first["reward_model"]["ground_truth"], "-1")):
        cwd.mkdir()
        edited = {**first, "reward_model": {**first["reward_model"], "ground_truth": answer}}
        (cwd / "rows.jsonl").write_text("\n".join([json.dumps(edited), *rows[1:]]) + "\n")
    logs = tmp_path / "logs"
    done = finish(_start(tmp_path / "w", ["--config.data.path=rows.jsonl"], logs, jit_cache, cwds=cwds), logs)
    for code, _, err in done:
        last = err.strip().splitlines()[-1]
        assert code == 1 and last.startswith("process error: step 1 candidate 0: process 1 sampled other tokens or "
                                             "rewards than process 0"), err[-3000:]
    assert not (tmp_path / "w" / "checkpoints").exists() or not any((tmp_path / "w" / "checkpoints").iterdir())


# Two launcher processes in CI (issue 36): the rehearsal on 2 processes x 2 CPU devices (folded=4: experts, cache
# slots split over the processes, the 530-slot cache uneven over 4), audited; process 1 killed once step 1 is
# committed; the rerun is ONE process on one device resuming the 2-process checkpoint (2 processes x 2 devices -> 1).
# Sized for CI: 2 devices per process (half the device threads of folded=8 on CI's 2 cores), a 10 s peer timeout, the
# reference run after the rerun (it runs the rerun's compiled programs: place_as_restored), and every run compiled at
# LLVM -O0 (CI_ENV: as scripts/test.sh compiles the suite, also when run without it): each multi-process CPU run
# compiles every program on every process (XLA:CPU executables are specific to their process, BUILD_NOTES) and -O0
# halves that. The test compares its runs with each other, all compiled alike; at the default level it passed too
# (session 11). The full-size versions (folded=8, context=4,expert=2, 2-process reruns) are slow, below.
CI_DEVICES_PER_PROCESS = 2
CI_ENV = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={CI_DEVICES_PER_PROCESS}",
          "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}


def test_two_processes_killed_then_resumed_on_one_device(tmp_path, jit_cache):
    """Step 1 on 2 processes equals the 1-device run; process 1 killed at step 2's start: process 0 stops within
    30 s naming it, nothing of step 2 is committed; a 1-process, 1-device rerun resumes at step 2 and its step
    equals the uninterrupted 1-device run's; both runs' closures verify."""
    workdir, logs = tmp_path / "two", tmp_path / "logs"
    per = CI_DEVICES_PER_PROCESS
    procs = _start(workdir, ["--config.mesh=folded=4", "--config.train.steps=2"], logs, jit_cache,
                   env={**CI_ENV, "GLM52_PEER_TIMEOUT_S": "10"})
    deadline = time.time() + 900
    while not _has_event(workdir / "metrics.jsonl", {"event": "step_start", "step": 2}):
        assert time.time() < deadline and all(p.poll() is None for p in procs), (logs / "0.err").read_text()[-3000:]
        time.sleep(0.2)
    _kill_process_1(procs, logs, workdir)
    assert not _receipt(workdir, 2).exists() and sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["1"]

    # The rerun: one process, `mesh` changed (nothing else).
    summary = _one_process(workdir, ["--config.train.steps=2"], CI_ENV)
    assert summary["status"] == "updated" and summary["steps_run"] == 1 and summary["last_step"] == 2, summary
    assert "resumed from checkpoint step 1" in summary["stderr"]
    # The uninterrupted 1-device run.
    one_device = tmp_path / "one"
    reference = _one_process(one_device, ["--config.train.steps=2"], CI_ENV)
    assert reference["status"] == "updated" and reference["steps_run"] == 2, reference
    _assert_same_receipt(_receipt(one_device, 1), _receipt(workdir, 1), processes=2, per_process=per)
    _assert_same_receipt(_receipt(one_device, 2), _receipt(workdir, 2), processes=1, per_process=1)
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["1", "2"]
    assert verify(workdir / "evidence" / "closure_step_000002.json") == []


# ~460 s in CI (two 2-step runs), slow for CI's budget (the folded 2-process run above is slow too); the peer
# watch's own tests (tests/parallel/test_peer_watch.py) cover the heartbeat logic.
@pytest.mark.slow
def test_killed_process_stops_the_other_and_the_rerun_reproduces_the_steps(one_device, tmp_path, jit_cache):
    """context 4 x expert 2, two steps: process 1 is killed during step 2; process 0 stops within 30 s
    naming it, step 2 leaves no receipt and no checkpoint; the rerun resumes at step 2, and both steps'
    receipts equal the 1-device run's."""
    mesh = "context=4,expert=2"
    workdir, flags = tmp_path / "two", [f"--config.mesh={mesh}", "--config.train.steps=2"]
    logs = tmp_path / "logs_killed"
    procs = _start(workdir, flags, logs, jit_cache)
    marker, deadline = "[1/2] step 2 probe", time.time() + 900
    while marker not in (logs / "1.err").read_text():
        assert time.time() < deadline and procs[1].poll() is None, (logs / "1.err").read_text()[-3000:]
        time.sleep(0.2)
    _kill_process_1(procs, logs, workdir)
    assert _receipt(workdir, 1).is_file() and not _receipt(workdir, 2).exists()
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["1"]

    rerun = _two_processes(workdir, flags, tmp_path / "logs_rerun", jit_cache)
    assert rerun[0]["status"] == "updated" and rerun[0]["steps_run"] == 1 and rerun[0]["last_step"] == 2
    for step in (1, 2):
        _assert_same_receipt(_receipt(one_device, step), _receipt(workdir, step))
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["1", "2"]
    assert not (workdir / "evidence" / "closure_step_000001.json").exists()  # the killed run did not finish
    _assert_closed(workdir, steps=2)  # the rerun's (step 2 only)


def _parity_on_two_processes(workdir: Path, logs: Path, cache: Path, flags: tuple[str, ...] = ()) -> None:
    """`--mode=parity` of the rehearsal on 2 processes x 4 devices (folded=8): process 0 writes one receipt
    that verifies and records both processes; the exact mode agrees with the reference as on one device."""
    # Cold, each parity program compiles for 100-330 s on a loaded 2-core machine (~1,400 s a run).
    done = finish(_start(workdir, ["--mode=parity", *flags], logs, cache), logs, timeout=2400)
    for code, _, err in done:
        assert code == 0, err[-3000:]
    (receipt_path,) = (workdir / "evidence").glob("gradient_parity_*.json")
    assert verify(receipt_path) == []
    receipt = json.loads(receipt_path.read_text())
    assert receipt["topology"] == {"mesh": "DP1/TP1/CP8/EP8/PP1", "mesh_devices": 8, "processes": 2}
    assert json.loads(done[0][1].strip().splitlines()[-1])["receipt"] == str(receipt_path)
    for case, result in receipt["parity"]["cases"].items():
        shared = result["pairs"]["shared_prefix"]
        assert shared["decision"] == "passed" and shared["families"]["all"]["rel_l2"] <= 1e-5, (case, shared["checks"])
        # Each process exported its own 4 devices' shards; together they cover every gradient element.
        shards = receipt_path.parent / receipt_path.stem / case / "conventional"
        records = parity_shards.read_records(shards, "shards", 2)
        devices = {p: {r["device"] for r in records if r["process"] == p} for p in (0, 1)}
        assert len(devices[0]) == len(devices[1]) == 4 and not devices[0] & devices[1], devices
        assert all(np.isfinite(a).all() for a in parity_shards.assemble(shards, "shards", 2).values())


@pytest.mark.slow  # a fourth 2-process run (~2-3 min with a warm cache on an idle machine)
def test_parity_mode_on_two_processes(tmp_path, jit_cache):
    _parity_on_two_processes(tmp_path / "w", tmp_path / "logs", jit_cache)


# Three in a row sharing one compilation cache: the runs after the first are the ones that failed (issue 36 item 2):
# JAX writes the cache from process 0 only and process 1 never hits it on CPU, so process 0 reaches each program
# minutes ahead; before parallel/communicators.py opened the communicators at start-up, XLA's 30 s gloo set-up at a
# device list's first collective failed (or hung) there. The watchdog's deadline turns a hang into exit 3 + stacks.
@pytest.mark.slow  # ~3 x the run above; on a loaded 2-core machine 20-25 min per run (the first compiles ~1,400 s)
def test_parity_on_two_processes_three_times_in_a_row(tmp_path, jit_cache):
    for attempt in range(3):
        _parity_on_two_processes(tmp_path / f"w{attempt}", tmp_path / f"logs{attempt}", jit_cache,
                                 ("--config.watchdog.phase_timeout_s=1800",))
