"""An online GRPO run: `train.steps` transactions, each committed (receipt, then checkpoint), resumable.

Per step k: `evidence/step_00000k/receipt.json` (committed first), then Orbax checkpoint k (LoRA,
AdamW state, RNG, data cursor). A rerun with the same settings resumes after the last checkpoint;
evidence of a step without a checkpoint is set aside and the step reruns, which reproduces it
(same state, same RNG). Events stream to `metrics.jsonl`. Several processes (jax.distributed) run it
together: process 0 writes the shared files, each process its own records (rl/processes.py).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from glm52_jax.rl import processes, settings
from glm52_jax.rl.inputs import RunInputs, resolve
from glm52_jax.run_config import RunSpec

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


def prefill_progress(event, log, chunk_size: int):
    """Sampler progress callback: every chunk to the metrics; to the console about every 10% when
    the prompt spans many chunks (a 2M prefill is 128 chunks of 16K and takes minutes)."""
    shown = [-1]

    def progress(done: int, total: int, rate: float, eta: float) -> None:
        event("prefill", done=done, total=total, tokens_per_s=round(rate, 1))
        if total < 8 * chunk_size:
            return
        tenth = done * 10 // total
        if tenth != shown[0] or done == total:
            shown[0] = tenth
            log(f"prefill {done:,}/{total:,} tokens ({100 * done / total:.0f}%), {rate:,.0f} tokens/s, "
                f"eta {eta:,.0f} s")

    return progress


def metrics_logger(path: Path, *, write: bool = True):
    """`event(kind, traces=None, **fields)`: appends a timed record to `path` (unless not `write`: a
    process other than 0) and to `traces`."""
    start = time.perf_counter()

    def event(kind: str, traces: list | None = None, **fields):
        record = {"event": kind, "t": round(time.perf_counter() - start, 3), **fields}
        if traces is not None:
            traces.append(record)
        if write:
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")

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


def _run(inputs: RunInputs, workdir: Path, mesh_spec, mesh, log) -> dict[str, Any]:
    from glm52_jax.checkpoint.train_state import RunCheckpoints
    from glm52_jax.rl.policy import build_policy

    spec = inputs.spec
    expect = {"config_sha256": spec.resume_sha256(), "base": spec.model.base_name}
    ckpts = RunCheckpoints(workdir / "checkpoints", max_to_keep=spec.checkpoint.keep)
    latest = ckpts.latest_step() or 0
    if latest:
        ckpts.check_meta(latest, expect)  # another run's checkpoints: refuse before building anything
    if latest >= spec.train.steps:
        log(f"run in {workdir} is complete: step {latest} of train.steps={spec.train.steps}; nothing to do")
        return {"workdir": str(workdir), "steps_run": 0, "last_step": latest, "status": "complete", "steps": []}
    if processes.is_writer():
        set_aside_uncommitted(workdir / "evidence", latest, log)
    processes.barrier("run: uncommitted evidence set aside")
    event = metrics_logger(workdir / "metrics.jsonl", write=processes.is_writer())

    import jax

    from glm52_jax.parallel.rules import axis_rules

    with contextlib.ExitStack() as stack:
        if mesh is not None:
            stack.enter_context(axis_rules(mesh_spec.rules()))
        # Built before the mesh is set: nnx would read the params' logical names as mesh axes.
        model, optimizer = build_policy(spec, inputs, mesh, init_adapter=not latest)  # a resume restores
        if mesh is not None:  # every program below is traced and run on the mesh
            stack.enter_context(jax.set_mesh(mesh))
            log(f"mesh {mesh_spec.describe()} over {mesh_spec.size} {jax.devices()[0].platform} devices")
        return _run_steps(inputs, workdir, ckpts, latest, expect, event, log, model, optimizer)


def _run_steps(inputs: RunInputs, workdir: Path, ckpts, latest: int, expect: dict, event, log, model,
               optimizer) -> dict[str, Any]:
    import jax

    from glm52_jax.checkpoint.train_state import RunState
    from glm52_jax.rl.transaction import run_transaction

    spec = inputs.spec
    if latest:
        state = ckpts.restore(latest, model, optimizer)
        event("resumed", step=latest, cursor=state.cursor)
        log(f"resumed from checkpoint step {latest} in {ckpts.directory}")
    else:
        state = RunState(step=0, rng=jax.random.key(spec.seed), cursor=spec.data.first_row, optimizer_steps=0,
                         meta={})
    event("loaded", checkpoint=spec.model.base_name)
    sampler = settings.sampler(spec.sampling, model, prefill_progress(event, log, spec.sampling.chunk_size))
    steps = []
    for step in range(state.step + 1, spec.train.steps + 1):
        rng, step_key = jax.random.split(state.rng)
        result = run_transaction(inputs, step=step, step_key=step_key, cursor=state.cursor, model=model,
                                 optimizer=optimizer, sampler=sampler,
                                 evidence_dir=workdir / "evidence" / STEP_DIR.format(step), event=event, log=log)
        state = RunState(step=step, rng=rng, cursor=state.cursor + result["candidates"],
                         optimizer_steps=optimizer.step, meta={**expect, "receipt": result["receipt"]})
        ckpts.save(model, optimizer, state)
        event("committed", step=step, checkpoint=str(ckpts.directory / str(step)))
        steps.append(result)
    ckpts.close()
    return {"workdir": str(workdir), "steps_run": len(steps), "last_step": state.step,
            "status": steps[-1]["status"], "steps": steps}
