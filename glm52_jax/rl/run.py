"""An online GRPO run: `train.steps` transactions, each committed (receipt, then checkpoint), resumable.

Per step k: `evidence/step_00000k/receipt.json` (committed first), then Orbax checkpoint k (LoRA,
AdamW state, RNG, data cursor). A rerun with the same settings resumes after the last checkpoint;
evidence of a step without a checkpoint is set aside and the step reruns, which reproduces it
(same state, same RNG). Events stream to `metrics.jsonl` (every record: `time`, Unix seconds, and `elapsed`,
seconds since the run's first record, which a resume continues; `t` restarts with each process); each
committed step adds a `step` record of scalars (`rl/step_metrics.py`: loss, rewards, grad norm, clip
fractions, KL, seconds per phase, tokens/s), also written as TensorBoard scalars to WORKDIR/tensorboard/.
The console gets a start banner, `compiling <program>...` lines, progress (`rl/progress.py`) and an
end-of-run summary. Several processes (jax.distributed) run it together: process 0 writes the shared files,
each process its own records (rl/processes.py).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from glm52_jax.parallel import watchdog
from glm52_jax.rl import processes, settings
from glm52_jax.rl.inputs import RunInputs, resolve
from glm52_jax.rl.progress import Console
from glm52_jax.run_config import RunSpec, checkpoint_expect

STEP_DIR = "step_{:06d}"
_STEP_RE = re.compile(r"step_(\d{6})")


def set_aside_uncommitted(evidence_dir: Path, committed: int, log: Callable[[str], None]) -> list[str]:
    """Moves evidence of steps after the last checkpoint to `step_N.uncommitted-K` (never deletes).

    A step's receipt is committed before its checkpoint; a process killed in between (or during
    the step) leaves evidence for a step the state does not include. The step is rerun.
    """
    moved = []
    if not evidence_dir.is_dir():
        return moved
    for d in sorted(evidence_dir.iterdir()):
        match = _STEP_RE.fullmatch(d.name)
        if match and int(match.group(1)) > committed:
            k = 1
            while (dest := d.with_name(f"{d.name}.uncommitted-{k}")).exists():
                k += 1
            d.rename(dest)
            moved.append(dest.name)
            log(f"evidence of uncommitted step {d.name} moved to {dest.name} (the step reruns)")
    return moved


def prefill_progress(event, console: Console, chunk_size: int):
    """Sampler progress callback: every chunk to the metrics; to the console as a bar on a terminal, else
    about every 10% when the prompt spans many chunks (a 2M prefill is 128 chunks of 16K and takes minutes)."""

    def progress(done: int, total: int, rate: float, eta: float) -> None:
        event("prefill", done=done, total=total, tokens_per_s=round(rate, 1))
        console.progress("prefill", done, total, f"{rate:,.0f} tokens/s, eta {eta:,.0f} s", unit="tokens",
                         plain_min_total=8 * chunk_size)

    return progress


def decode_progress(console: Console, steps: int, plain_min_steps: int = 64):
    """Sampler decode callback (`fn(done, steps)`, from inside the compiled decode loop of `steps` steps): a bar
    on a terminal; in a log, about every 10% of a decode of at least `plain_min_steps` steps. None when neither
    would show anything (a log and a short decode: each request's timing is in metrics.jsonl anyway), so the
    decode program then has no host callback at all."""
    if not console.bars and steps < plain_min_steps:
        return None

    shown = [0]  # the callbacks are unordered: a late earlier step must not move the bar back

    def progress(done: int, total: int) -> None:
        if done <= shown[0] and done < total:
            return
        shown[0] = 0 if done >= total else done
        console.progress("decode", done, total, unit="steps", plain_min_total=plain_min_steps)

    return progress


def search_progress(event, console: Console, max_candidates: int):
    """The transaction's `event`, plus a candidate-search bar on a terminal (plain logs have a line per
    candidate already), ended when the update starts or the step ends."""

    def forward(kind: str, traces: list | None = None, **fields):
        event(kind, traces, **fields)
        if console.bars and kind == "candidate":
            console.progress("candidates", fields["candidate"] + 1, max_candidates, f"rewards {fields['rewards']}")
        elif console.bars and kind in ("update_start", "step_done"):
            console.done()

    return forward


# metrics.jsonl event -> what the run is doing after it (the compile lines name it: `jit(<lambda>)` alone says
# little).
_PHASES = {"resumed": "restoring", "loaded": "sampling", "step_start": "sampling", "update_start": "update",
           "update_end": "evidence and checkpoint"}


def phase_tracker(event):
    """(`event` that also notes the run's phase, `phase()`: e.g. "step 2 update", or "loading the policy")."""
    phase = ["loading the policy"]

    def tracked(kind: str, traces: list | None = None, **fields):
        record = event(kind, traces, **fields)
        if kind in _PHASES:
            phase[0] = (f"step {fields['step']} " if "step" in fields and kind != "resumed" else "") + _PHASES[kind]
        return record

    return tracked, lambda: phase[0]


def quiet_orbax_merge_warning() -> None:
    """Drops Orbax's "Skipping merge of OCDBT checkpoints: No per-process OCDBT checkpoint subdirs" warning.

    Orbax logs it at every save for an item written without per-process OCDBT subdirectories (here the RNG
    key item, a handful of bytes): after a save it merges each process's OCDBT store into one, and that item
    has none to merge. Nothing is skipped that a restore needs (every resume test restores that key)."""
    import logging

    absl_logger = logging.getLogger("absl")
    if _drop_orbax_merge_warning not in absl_logger.filters:
        absl_logger.addFilter(_drop_orbax_merge_warning)


def _drop_orbax_merge_warning(record) -> bool:
    return "Skipping merge of OCDBT checkpoints" not in str(record.msg)


def _run_start(path: Path) -> float | None:
    """When the run's first process started its metrics (Unix seconds), from the first record of an existing
    metrics file: its `time` less its `elapsed`. None without one."""
    try:
        with open(path) as f:
            first = json.loads(f.readline())
        return first["time"] - first["elapsed"]
    except (OSError, ValueError, KeyError, TypeError):  # no file yet, an empty one, or one from before `time`
        return None


def metrics_logger(path: Path, *, write: bool = True):
    """`event(kind, traces=None, **fields)`: appends a timed record to `path` (unless not `write`: a
    process other than 0) and to `traces`. Each record has `t` (seconds since this process's logger
    started), `time` (Unix seconds) and `elapsed` (seconds since the run's first record, across resumes)."""
    start = time.perf_counter()
    run_start = _run_start(path) or time.time()

    def event(kind: str, traces: list | None = None, **fields):
        now = time.time()
        record = {"event": kind, "t": round(time.perf_counter() - start, 3), "time": round(now, 3),
                  "elapsed": round(now - run_start, 3), **fields}
        if traces is not None:
            traces.append(record)
        if write:
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
        return record

    return event


def run_online(spec: RunSpec, workdir: str | Path, *, log: Callable[[str], None] = print,
               command: Sequence[str] = ()) -> dict[str, Any]:
    """Runs (or resumes) `spec.train.steps` transactions in `workdir`; returns a summary of the run.

    Everything is checked (settings, files, mesh) before the workdir is locked and written;
    `command` is recorded with the settings in WORKDIR/config.json. Several processes: every one
    calls this with the same settings (checked) and the same shared `workdir`."""
    from glm52_jax.rl.policy import train_mesh

    processes.check_same_settings(spec)
    inputs = resolve(spec)
    mesh_spec, mesh = train_mesh(spec)
    with processes.claim_run(spec, workdir, command) as workdir:
        return _run(inputs, workdir, mesh_spec, mesh, log)


def banner(spec: RunSpec, workdir: Path, mesh_spec) -> str:
    """The start line: where the run writes, which config, on which mesh, and the settings that shape it."""
    s, m, t = spec.sampling, spec.model, spec.train
    return (f"run {spec.name!r} in {workdir}: model {m.base_name} ({m.dtype}), mesh {mesh_spec.describe()}; "
            f"{spec.data.prompt_tokens:,}-token prompts, {s.num_samples} samples x {s.max_new_tokens} new tokens "
            f"(T={s.temperature}, top_p={s.top_p}), <= {spec.search.max_candidates} candidates; "
            f"{t.gradient_mode}, LoRA rank {m.lora_rank}, lr {t.learning_rate}; {t.steps} step(s)")


def _reward_mean(result: dict[str, Any], scalars: dict[str, Any]) -> str:
    """The accepted group's reward mean (what the update trained on), with the search's over every sample tried."""
    tried = f"{scalars.get('reward_mean', float('nan')):.3g} over all {scalars.get('candidates_tried', '?')} tried"
    group = result.get("accepted_rewards")
    if not group:
        return f", reward mean {tried}"
    return f", reward mean {sum(group) / len(group):.3g} (accepted group; {tried})"


def end_summary(result: dict[str, Any], workdir: Path) -> list[str]:
    """The end-of-run lines: what the last step accepted and trained, where its receipt is, how to verify."""
    scalars = result.get("scalars", {})
    accepted = result["accepted"]
    lines = [f"done: step {result['step']} {result['status']}; "
             + (f"accepted candidate {accepted} of {scalars.get('candidates_tried', '?')}" if accepted is not None
                else f"no mixed-reward group in {scalars.get('candidates_tried', '?')} candidates")
             + _reward_mean(result, scalars)
             + (f", loss {scalars['loss']:.6g}, grad norm {scalars['grad_norm']:.4g}" if "loss" in scalars else ""),
             f"receipt: {result['receipt']}",
             f"verify: python -m glm52_jax.evidence verify {result['receipt']}",
             f"metrics: {workdir / 'metrics.jsonl'}; TensorBoard: tensorboard --logdir {workdir}"]
    return lines


def _run(inputs: RunInputs, workdir: Path, mesh_spec, mesh, log) -> dict[str, Any]:
    from glm52_jax.checkpoint.train_state import RunCheckpoints
    from glm52_jax.rl.policy import build_policy, mesh_line

    spec = inputs.spec
    # The mesh saved with each step lets a rerun on another topology check the rest of the settings.
    expect = {"config_sha256": spec.resume_sha256(), "base": spec.model.base_name, "mesh": spec.mesh}
    ckpts = RunCheckpoints(workdir / "checkpoints", max_to_keep=spec.checkpoint.keep)
    latest = ckpts.latest_step() or 0
    if latest:  # another run's checkpoints: refuse before building anything
        ckpts.check_meta(latest, checkpoint_expect(spec, ckpts.read_meta(latest)))
    if latest >= spec.train.steps:
        log(f"run in {workdir} is complete: step {latest} of train.steps={spec.train.steps}; nothing to do")
        return {"workdir": str(workdir), "steps_run": 0, "last_step": latest, "status": "complete", "steps": []}
    if processes.is_writer():
        set_aside_uncommitted(workdir / "evidence", latest, log)
    processes.barrier("run: uncommitted evidence set aside")
    event, phase = phase_tracker(metrics_logger(workdir / "metrics.jsonl", write=processes.is_writer()))
    console = Console(log, bars=None if processes.count() == 1 else False)
    console.line(banner(spec, workdir, mesh_spec))
    quiet_orbax_merge_warning()

    import jax

    from glm52_jax.parallel.rules import axis_rules
    from glm52_jax.rl.compile_log import compile_lines

    with contextlib.ExitStack() as stack:
        stack.enter_context(compile_lines(console.line, phase=phase))
        if mesh is not None:
            stack.enter_context(axis_rules(mesh_spec.rules()))
        # Built before the mesh is set: nnx would read the params' logical names as mesh axes.
        with watchdog.phase("load"):
            model, optimizer = build_policy(spec, inputs, mesh, init_adapter=not latest)  # a resume restores
        if mesh is not None:  # every program below is traced and run on the mesh
            stack.enter_context(jax.set_mesh(mesh))
            console.line(mesh_line(mesh_spec))
        scalars = None
        if processes.is_writer():
            from glm52_jax.rl.tensorboard import ScalarWriter

            scalars = stack.enter_context(contextlib.closing(ScalarWriter(workdir)))
        return _run_steps(inputs, workdir, ckpts, latest, expect, event, console, scalars, model, optimizer)


def _run_steps(inputs: RunInputs, workdir: Path, ckpts, latest: int, expect: dict, event, console: Console,
               scalars, model, optimizer) -> dict[str, Any]:
    """The steps after `latest`; each committed step's scalars go to metrics.jsonl and to `scalars` (the
    TensorBoard writer, process 0 only)."""
    import jax

    from glm52_jax.checkpoint.train_state import RunState, place_as_restored
    from glm52_jax.rl.transaction import run_transaction

    spec = inputs.spec
    log = console.line
    if latest:
        with watchdog.phase("checkpoint restore", step=latest):
            state = ckpts.restore(latest, model, optimizer)
        event("resumed", step=latest, cursor=state.cursor)
        log(f"resumed from checkpoint step {latest} in {ckpts.directory}")
    else:
        # Placed as a resume would place them, so a resumed run's programs are the ones this run compiles.
        rng = place_as_restored(model, optimizer, jax.random.key(spec.seed))
        state = RunState(step=0, rng=rng, cursor=spec.data.first_row, optimizer_steps=0, meta={})
    event("loaded", checkpoint=spec.model.base_name)
    sampler = settings.sampler(spec.sampling, model, prefill_progress(event, console, spec.sampling.chunk_size),
                               decode_progress(console, spec.sampling.max_new_tokens))
    step_event = search_progress(event, console, spec.search.max_candidates)
    steps = []
    for step in range(state.step + 1, spec.train.steps + 1):
        start = time.perf_counter()
        rng, step_key = jax.random.split(state.rng)
        result = run_transaction(inputs, step=step, step_key=step_key, cursor=state.cursor, model=model,
                                 optimizer=optimizer, sampler=sampler,
                                 evidence_dir=workdir / "evidence" / STEP_DIR.format(step), event=step_event,
                                 log=log)
        state = RunState(step=step, rng=rng, cursor=state.cursor + result["candidates"],
                         optimizer_steps=optimizer.step, meta={**expect, "receipt": result["receipt"]})
        saving = time.perf_counter()
        with watchdog.phase("checkpoint save", step=step):
            ckpts.save(model, optimizer, state)
        event("committed", step=step, checkpoint=str(ckpts.directory / str(step)))
        now = time.perf_counter()
        result["scalars"].update(checkpoint_seconds=round(now - saving, 3), step_seconds=round(now - start, 3))
        record = event("step", step=step, status=result["status"], **result["scalars"])
        if scalars is not None:
            scalars.write(record)
        steps.append(result)
    ckpts.close()
    for line in end_summary(steps[-1], workdir):
        log(line)
    return {"workdir": str(workdir), "steps_run": len(steps), "last_step": state.step,
            "status": steps[-1]["status"], "steps": steps}
