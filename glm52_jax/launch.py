"""Entry point: online GRPO runs from a config file and `--config.a.b=v` flags (absl + ml_collections).

    python -m glm52_jax.launch                                   # configs/tiny.py, laptop CPU
    python -m glm52_jax.launch --config=configs/tiny.py --workdir=/tmp/run \\
        --config.sampling.num_samples=4 --config.train.gradient_mode=shared_prefix
    python -m glm52_jax.launch --workdir=/tmp/run --config.train.steps=3   # resume / extend, saved settings
    python -m glm52_jax.launch --mode=export --workdir=/tmp/run     # PEFT adapter + merged HF model
    python -m glm52_jax.launch --mode=forward --config.model.checkpoint=/ckpt/GLM-5.2   # smoke forward

The config (every key: glm52_jax/run_defaults.py) becomes a validated `RunSpec` before anything is
loaded. `--mode=train` runs `train.steps` transactions (rl/run.py); step k writes
`WORKDIR/evidence/step_00000k/receipt.json`, then an Orbax checkpoint `WORKDIR/checkpoints/k`. The
settings are saved in WORKDIR/config.json when a run starts: a rerun on the workdir resumes after
the last checkpoint with them (flags given then must not change the run; `train.steps` may grow),
and export reads them. Errors are one line (`--debug` shows the traceback); Ctrl-C stops at once
and says what was kept, and so
does SIGTERM (exit 143).
"""

from __future__ import annotations

import difflib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from absl import app, flags, logging
from ml_collections import config_flags

from glm52_jax.plan.targets import LAUNCHER_MEM_FRACTION  # imports no JAX

ROOT = Path(__file__).resolve().parents[1]
MODES = ("train", "plan", "export", "parity", "forward")
FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "run directory (default: runs/<config.name>_<UTC time>); an existing run's "
                    "directory resumes it with its saved settings")
flags.DEFINE_enum("mode", "train", MODES,
                  "train: run/resume train.steps GRPO transactions; plan: AOT-compile the run's programs for the "
                  "configured mesh from abstract inputs (memory, FLOPs, collectives); export: PEFT adapter + merged "
                  "model from the run's latest checkpoint; parity: gradient modes compared on one rollout; "
                  "forward: smoke forward")
flags.DEFINE_string("export_dir", None, "export mode: output directory (default WORKDIR/export/step_<k>)")
flags.DEFINE_integer("export_step", None, "export mode: checkpoint step (default: the latest)")
flags.DEFINE_integer("seq_len", 256, "forward mode: tokens per sequence", lower_bound=2)
flags.DEFINE_bool("debug", False, "show tracebacks instead of one-line errors")
flags.DEFINE_bool("allow_unfit", False, "plan mode: exit 0 even when a program does not fit the device memory "
                  "(by default such a plan exits 1)")
flags.DEFINE_bool("helpconfig", False, "print every config key with its value and meaning (from "
                  "glm52_jax/run_defaults.py), then exit")
flags.DEFINE_float("audit_replicated_mib", 0.0, "debugging: at every progress line, stop with an error listing any "
                   "live array of at least this many MiB that lives whole on every device of a multi-device mesh "
                   "(a cache or activation replicated by accident); 0 = off. Weights replicated on purpose "
                   "count too: set it above the largest one", lower_bound=0.0)


_RANK_PREFIX = [""]  # "[p/P] " once a run spans several processes: whose progress line is whose


def _log(msg: str) -> None:
    print(f"{_RANK_PREFIX[0]}{msg}", file=sys.stderr, flush=True)
    if FLAGS.audit_replicated_mib > 0:
        from glm52_jax.parallel.placement import ReplicatedArrayError, replicated_live_arrays

        found = replicated_live_arrays(int(FLAGS.audit_replicated_mib * 2**20))
        if found:
            raise ReplicatedArrayError(f"{len(found)} live array(s) of >= {FLAGS.audit_replicated_mib} MiB live whole "
                                       f"on every device (after: {msg!r}): {'; '.join(found[:4])}")


def _flag_error(error: Exception, argv: list[str]) -> str:
    """One line for a flag or config-file failure: the absl message, or the unknown key's did-you-mean."""
    from glm52_jax import run_defaults
    from glm52_jax.run_config import flatten

    known = list(flatten(run_defaults.get_config().to_dict()))
    for arg in argv[1:]:
        if arg.startswith("--config."):
            key = arg[len("--config."):].partition("=")[0]
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                return f"unknown config key {key}" + (f" (did you mean {close[0]}?)" if close else "")
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    where = next((a.partition("=")[2] for a in argv if a.startswith("--config=")), str(ROOT / "configs" / "tiny.py"))
    if "Failed loading config file" in str(error) or "Error whilst parsing config file" in str(error):
        return f"--config={where}: the config file cannot be loaded ({lines[-1]})"  # the last line: the cause
    if "get_config() returned" in str(error):
        return f"--config={where}: {error}"
    if (cause := _config_file_cause(error, where)) is not None:
        return f"--config={where}: {cause}"
    return lines[0] if lines else type(error).__name__


def _config_file_cause(error: BaseException, where: str) -> str | None:
    """What went wrong inside the config file (a NameError in it, no `get_config`, a syntax error), or
    None when `error` did not come from loading it: absl shows these without naming the file."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    path = os.path.realpath(where.partition(":")[0])
    # ml_collections' ConfigFileFlagParser.parse imports the file, then calls its get_config().
    loader = [f for f in frames if f.filename.endswith("config_flags.py") and f.name == "parse"]
    if isinstance(error, AttributeError) and any("get_config" in (f.line or "") for f in loader[-1:]):
        return "the config file defines no get_config() (it must return the run's ConfigDict)"
    in_file = [f.lineno for f in frames if os.path.realpath(f.filename) == path]
    if isinstance(error, SyntaxError) and error.filename and os.path.realpath(error.filename) == path:
        in_file = [error.lineno]
    if not loader or not in_file:
        return None
    line = in_file[-1]
    text = error.msg if isinstance(error, SyntaxError) else str(error)
    return (f"the config file cannot be loaded ({type(error).__name__}: {text}"
            + (f", line {line})" if line is not None else ")"))


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's parsing, with config-file and unknown-key failures as one line (exit 2) unless --debug."""
    try:
        # Defined here, not at import: config_flags applies the command line's overrides as soon as the
        # flag is defined, and an unknown key would fail outside any handler.
        config_flags.DEFINE_config_file("config", str(ROOT / "configs" / "tiny.py"),
                                        "config file (every key: glm52_jax/run_defaults.py)", lock_config=True)
        rest = FLAGS(argv)
        if not hasattr(FLAGS.config, "to_dict"):
            raise TypeError(f"get_config() returned {type(FLAGS.config).__name__}, not a ConfigDict")
        FLAGS.config.to_dict()  # config_flags loads the file on first use: fail here, not later
        return rest
    except Exception as e:
        if "--debug" in argv:
            raise
        print(f"error: {_flag_error(e, argv)}", file=sys.stderr)
        sys.exit(2)


def _explicit_overrides() -> dict:
    """The `--config.a.b=v` flags given on this command line."""
    return {name[len("config."):]: FLAGS[name].value for name in FLAGS
            if name.startswith("config.") and FLAGS[name].present}


def _spec():
    """The run's settings: the config file + flags, or on a workdir with saved settings those + the
    flags given now (`--config=FILE` given again is compared whole)."""
    from glm52_jax.run_config import RunSpec, check_rerun
    from glm52_jax.workdir import saved_settings

    given = RunSpec.from_dict(FLAGS.config.to_dict())
    saved = saved_settings(FLAGS.workdir) if FLAGS.workdir and FLAGS.mode in ("train", "parity", "export") else None
    if saved is None:
        return given
    spec = given if FLAGS["config"].present else saved.replace(**_explicit_overrides())
    check_rerun(saved, spec, FLAGS.workdir)
    return spec


def _forward(spec) -> dict:
    import jax.numpy as jnp
    import numpy as np

    from glm52_jax.compiled import token_logprobs
    from glm52_jax.rl.inputs import RunInputs, model_config
    from glm52_jax.rl.policy import build_base

    cfg, scaling, _, _ = model_config(spec.model)
    model = build_base(spec, RunInputs(spec, cfg, scaling, tokenizer=None, rows=[], first_prompts=[]))
    ids = np.random.default_rng(spec.seed).integers(0, model.cfg.vocab_size, (1, FLAGS.seq_len))
    start = time.perf_counter()
    out = np.asarray(token_logprobs(model, jnp.asarray(ids, jnp.int32)))  # one compiled program
    if not np.isfinite(out).all():
        raise SystemExit("non-finite log-probs")
    return {"model": spec.model.base_name, "seq_len": FLAGS.seq_len, "mean_token_logprob": float(out.mean()),
            "seconds_incl_compile": round(time.perf_counter() - start, 2)}


def _plan(spec) -> dict:
    """Plan mode: no weights, no data; the checkpoint's config.json if present, else `model.preset`."""
    from glm52_jax.parallel.xla_options import cross_host_options
    from glm52_jax.plan.planner import plan
    from glm52_jax.plan.report import format_plan
    from glm52_jax.rl.inputs import base_fp8, check_capacity, model_config
    from glm52_jax.rl.settings import lora_config, model_options

    made_at = checkout_record()  # the code being planned: read before the (minutes of) compiles
    cfg, _, scaling_source, source = model_config(spec.model, preset_without_checkpoint=True)
    check_capacity(cfg, spec, scaling_source)
    s = spec.sampling
    report = plan(cfg, spec.mesh_spec(), prompt_tokens=spec.data.prompt_tokens, max_new_tokens=s.max_new_tokens,
                  num_samples=s.num_samples, samples_per_request=s.per_request, probe_tokens=spec.search.probe_tokens,
                  gradient_mode=spec.train.gradient_mode, lora=lora_config(spec.model),
                  dtype=spec.model.jnp_dtype(), chunk_size=s.chunk_size, prefill_mode=s.prefill_mode,
                  hbm_bytes=spec.plan.hbm_gib * 2**30, programs=spec.plan.programs, target=spec.plan.target,
                  options=model_options(spec.model), xla_options=cross_host_options(spec.model.moe_cross_host),
                  base_fp8=base_fp8(spec.model), efficiency_table=spec.plan.efficiency_table or None, log=_log)
    report["model_source"] = source
    report["made_at"] = made_at
    _log(format_plan(report))
    if FLAGS.workdir:
        save_plan(report, Path(FLAGS.workdir), _log)
    timing = {k: report[k] for k in ("first_candidate_s", "model_version") if k in report}
    return {k: report[k] for k in ("fits", "largest_program", "largest_total_bytes", "hbm_bytes")} | \
        {"mesh": report["mesh"]["describe"], "target": spec.plan.target} | timing


def checkout_record() -> dict:
    """The project commit a report was made at (and whether the checkout had uncommitted changes), and the date."""
    import subprocess

    def git(*args: str) -> str | None:
        run = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False)
        return run.stdout.strip() if run.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "uncommitted_changes": bool(dirty) if dirty is not None else None,
            "date": time.strftime("%Y-%m-%d", time.gmtime())}


def save_plan(report: dict, workdir: Path, log) -> None:
    """WORKDIR/plan.json, then its picture plan_memory.png beside it (or a line saying how to get matplotlib)."""
    from glm52_jax.evidence.atomic import atomic_write_json
    from glm52_jax.plan import figure

    workdir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(workdir / "plan.json", report, indent=1)
    log(figure.write_or_explain(report, workdir))


def unfit_message(result: dict) -> str | None:
    """Plan mode's one line when the largest program does not fit the device (None when it fits)."""
    if result["fits"]:
        return None

    def size(n: float) -> str:
        unit, scale = next(((u, s) for u, s in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)) if n >= s), ("bytes", 1))
        return f"{n / scale:.1f} {unit}" if scale > 1 else f"{n:.0f} bytes"

    largest, need, limit = result["largest_program"], size(result["largest_total_bytes"]), size(result["hbm_bytes"])
    return (f"plan error: the largest program, {largest}, needs {need} per device of the {limit} it may use on "
            f"{result['target']} ({result['mesh']}); change the mesh or settings, or pass --allow_unfit to accept "
            "the plan")


def start_banner(spec, workdir: str, mode: str, *, step: int | None = None, export_dir: str | None = None) -> str:
    """The first line of an export or parity run (train mode has its own): what it reads and writes, on which mesh."""
    m = spec.model
    what = (f"export of run {spec.name!r} in {workdir}: checkpoint step {step if step is not None else '(latest)'} -> "
            f"{export_dir or f'{workdir}/export/step_<k>'}" if mode == "export" else
            f"parity of {spec.name!r} in {workdir}: gradient modes compared on one rollout")
    return f"{what}; model {m.base_name} ({m.dtype}), mesh {spec.mesh_spec().describe()}"


def _run_mode(spec, workdir: str | None) -> dict:
    if FLAGS.mode in ("plan", "train"):  # plan names each program it compiles; train installs its own, with phases
        return _dispatch(spec, workdir)
    from glm52_jax.rl.compile_log import compile_lines

    with compile_lines(_log):  # `compiling <program>...` while a forward, parity or export program compiles
        return _dispatch(spec, workdir)


def _dispatch(spec, workdir: str | None) -> dict:
    command = [sys.executable, "-m", "glm52_jax.launch", *sys.argv[1:]]
    if FLAGS.mode == "forward":
        return _forward(spec)
    if FLAGS.mode == "plan":
        return _plan(spec)
    if FLAGS.mode == "export":
        from glm52_jax.rl.export import export_run
        from glm52_jax.run_config import ConfigError

        if not workdir:
            raise ConfigError("--mode=export needs --workdir (the run to export)")
        _log(start_banner(spec, workdir, "export", step=FLAGS.export_step, export_dir=FLAGS.export_dir))
        record = export_run(spec, workdir, export_dir=FLAGS.export_dir, step=FLAGS.export_step)
        return {k: record[k] for k in ("export_dir", "step", "base")}
    if FLAGS.mode == "parity":
        from glm52_jax.rl.parity import run_parity

        _log(start_banner(spec, workdir, "parity"))
        return run_parity(spec, workdir, log=_log, command=command)
    from glm52_jax.rl.run import run_online

    summary = run_online(spec, workdir, log=_log, command=command)
    return {"workdir": summary["workdir"], "status": summary["status"], "last_step": summary["last_step"],
            "steps_run": summary["steps_run"], "receipts": [s["receipt"] for s in summary["steps"]],
            "accepted": [s["accepted"] for s in summary["steps"]]}


def _one_line(error: BaseException) -> str | None:
    """The message of an expected failure (bad settings, another run's or a broken checkpoint)."""
    from glm52_jax.checkpoint.train_state import CheckpointCorruptError, CheckpointMismatchError
    from glm52_jax.evidence.receipt import EvidenceError
    from glm52_jax.kernels.aot import SharedMemoryError
    from glm52_jax.parallel.distributed import CoordinatorError
    from glm52_jax.parallel.placement import ReplicatedArrayError
    from glm52_jax.rl.numerics import NonFiniteError
    from glm52_jax.rl.processes import ProcessDivergenceError
    from glm52_jax.run_config import ConfigError

    kinds = {ConfigError: "config error", CheckpointMismatchError: "resume error",
             CheckpointCorruptError: "checkpoint error", EvidenceError: "evidence error",
             ProcessDivergenceError: "process error", ReplicatedArrayError: "audit error",
             SharedMemoryError: "plan error", NonFiniteError: "numerics error",
             CoordinatorError: "process error"}
    for kind, label in kinds.items():
        if isinstance(error, kind):
            return f"{label}: {error}"
    return None


def _watchdog(spec, workdir: str | None, group):
    """The run's hang watchdog (parallel/watchdog.py), installed for the phases to find; None without a workdir or
    with --config.watchdog.phase_timeout_s=0 (and in plan and forward modes, which have no phases)."""
    from glm52_jax.parallel import watchdog

    if FLAGS.mode not in ("train", "parity", "export") or not workdir:
        return None
    s = spec.sampling
    shapes = {"prompt_tokens": spec.data.prompt_tokens, "max_new_tokens": s.max_new_tokens,
              "samples_per_request": s.per_request, "chunk_size": s.chunk_size, "prefill_mode": s.prefill_mode,
              "gradient_mode": spec.train.gradient_mode}  # a plan of other shapes times other programs
    deadlines = watchdog.deadlines_for(spec.watchdog.phase_timeout_s, spec.watchdog.plan_factor, workdir,
                                       spec.mesh_spec().describe(), shapes)
    if deadlines is None:
        return None
    if (Path(workdir) / "plan.json").is_file() and spec.watchdog.plan_factor > 0:
        _log(watchdog.describe(deadlines))
    process, count = (group.process_id, group.num_processes) if group is not None else (0, 1)
    dog = watchdog.Watchdog(workdir, process, count, deadlines)
    watchdog.install(dog)
    return dog


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt."""


def _raise_terminated(signum, frame):
    raise Terminated()


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.helpconfig:
        from glm52_jax import config_help, run_defaults

        print(config_help.format_help(FLAGS.config.to_dict(), run_defaults.get_config().to_dict(),
                                      config_help.key_comments()))
        return
    if FLAGS.verbosity <= 0:  # Orbax logs every file rename at INFO; keep the console to our progress lines
        logging.set_verbosity(logging.WARNING)
    from glm52_jax import workdir as workdir_lib
    from glm52_jax.parallel import distributed, peer_watch, watchdog
    from glm52_jax.run_config import ConfigError

    distributed.default_to_cpu_without_a_gpu()
    # The share of each GPU's memory JAX preallocates (its default is 75%): the budget plan mode judges every
    # program against, set here so that a direct `python -m glm52_jax.launch` runs with what was planned.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(LAUNCHER_MEM_FRACTION))
    outcome: dict = {}
    try:
        spec = _spec()  # every value checked, before JAX starts
        try:
            peer_timeout_s = peer_watch.timeout_from_env()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if FLAGS.mode == "plan":
            from glm52_jax.plan.devices import ensure_virtual_devices
            from glm52_jax.plan.targets import check_efficiency_table, check_target

            check_target(spec.plan.target)  # a GPU target without the CUDA plugin: a config error, before compiling
            check_efficiency_table(spec.plan.efficiency_table, spec.plan.target)
            ensure_virtual_devices(spec.mesh_spec().size)  # before JAX starts: virtual CPU devices for the mesh
        else:  # the run's XLA options, before JAX starts its backend (plan mode gives them to each compile)
            from glm52_jax.parallel.xla_options import cross_host_options, export_to_environ

            export_to_environ(cross_host_options(spec.model.moe_cross_host))
        workdir = FLAGS.workdir
        if workdir is None and FLAGS.mode in ("train", "parity"):
            workdir = str(Path("runs") / f"{spec.name}_{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
    except ConfigError as e:
        if FLAGS.debug:
            raise
        sys.exit(f"config error: {e}")

    def work():
        try:
            if FLAGS.mode == "train":  # the collectives this process issues, for the closure record
                from glm52_jax.closure import ledger

                outcome["ledger"] = ledger.install()
            if FLAGS.mode != "plan":
                # A wait on the coordinator (a peer not started yet, an address held by something else) is never
                # silent: a line naming the address once it has lasted 10 s.
                joining = distributed.from_env()
                slow = threading.Timer(10.0, lambda: _log(
                    f"process {joining.process_id} of {joining.num_processes}: still waiting for the coordinator at "
                    f"{joining.coordinator} ({joining.source})"))
                if joining is not None and joining.num_processes > 1:
                    slow.daemon = True
                    slow.start()
                try:
                    group = distributed.initialize()
                finally:
                    slow.cancel()  # multi-host when GLM52_* or SLURM variables say so; else a no-op
                outcome["group"] = group
                if group is not None and group.num_processes > 1:
                    _RANK_PREFIX[0] = f"[{group.process_id}/{group.num_processes}] "
                    outcome["watch"] = peer_watch.for_this_process(peer_timeout_s)
                outcome["watchdog"] = _watchdog(spec, workdir, group)
            outcome["result"] = _run_mode(spec, workdir)
        except BaseException as e:  # handed to the main thread, which reports it
            outcome["error"] = e

    # The work runs in a thread so that the main thread stays in Python and takes Ctrl-C at once, even
    # while XLA compiles (a signal handler only runs between bytecodes of the main thread).
    # It also watches the other processes of a multi-process run (parallel/peer_watch.py): one that dies
    # stops this one within seconds, with a line naming it, instead of a hang in a collective.
    worker = threading.Thread(target=work, name="glm52-run", daemon=True)

    def kept() -> str:
        return (workdir_lib.kept_summary(workdir) if workdir and FLAGS.mode == "train" else
                f"--mode={FLAGS.mode} did not finish; its receipt / export.json (written last) was not committed")

    def stop_for_dead_peer(lost: str) -> None:
        print(f"process error: {lost}; this process stops too: {kept()}", file=sys.stderr, flush=True)
        workdir_lib.release_held()
        os._exit(1)  # the work thread may sit in a collective that never returns; JAX's exit barrier would wait

    def stop_for_hang(found) -> None:
        line = outcome["watchdog"].report(found)  # every process's stacks into WORKDIR/watchdog/
        print(f"{_RANK_PREFIX[0]}{line}; {kept()}", file=sys.stderr, flush=True)
        workdir_lib.release_held()
        os._exit(watchdog.HANG_EXIT)  # as for a dead peer: the work thread is the one that hangs

    # SIGTERM (what SLURM and Kubernetes send before a kill, e.g. on preemption) stops the run as Ctrl-C does. The
    # worker starts inside the `try`: it may take the workdir's lock before `start()` returns here, and a signal
    # in that window must stop the run the same way.
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        worker.start()
        while worker.is_alive():
            worker.join(0.5)
            lost = outcome["watch"].poll() if outcome.get("watch") is not None else None
            if lost is not None:
                stop_for_dead_peer(lost)
            hung = outcome["watchdog"].poll() if outcome.get("watchdog") is not None else None
            if hung is not None:
                stop_for_hang(hung)
    except KeyboardInterrupt as e:
        terminated = isinstance(e, Terminated)
        print(f"\n{'terminated (SIGTERM)' if terminated else 'interrupted'}: {kept()}", file=sys.stderr, flush=True)
        workdir_lib.release_held()
        # Evidence and checkpoints are written atomically: stopping mid-step loses nothing committed.
        os._exit(143 if terminated else 130)
    if outcome.get("watch") is not None:
        watch = outcome["watch"]
        watch.finish(ok="error" not in outcome)
        lost = watch.settle() if "error" in outcome else None
        if lost is not None:  # our error came from a collective with a dead peer: report the death
            stop_for_dead_peer(lost)
    error = outcome.get("error")
    if error is not None:
        message = None if FLAGS.debug else _one_line(error)
        if message is None:
            raise error
        sys.exit(message)
    if FLAGS.mode == "train" and outcome["result"]["receipts"]:
        _close_run(workdir, outcome)
    print(json.dumps(outcome["result"]))
    if FLAGS.mode == "plan" and not FLAGS.allow_unfit and (message := unfit_message(outcome["result"])):
        sys.exit(message)


def _close_run(workdir: str, outcome: dict) -> None:
    """The finished train run's closure (closure/record.py): every process stops what it started and records it;
    process 0 commits WORKDIR/evidence/closure_step_<k>.json. A failure is one line (exit 1): every step stays
    committed."""
    from glm52_jax.closure import record as closure
    from glm52_jax.parallel import watchdog

    group = outcome.get("group")
    process, count = (group.process_id, group.num_processes) if group is not None else (0, 1)
    last = outcome["result"]["last_step"]
    receipts = closure.step_receipts(outcome["result"]["receipts"])
    try:
        record = closure.process_record(Path(workdir), receipts, process=process, count=count, group=group,
                                        watch=outcome.get("watch"), ledger=outcome.get("ledger"),
                                        watchdog_module=watchdog)
        closure.write_own(Path(workdir), last, record)
        if process == 0:
            path = closure.commit(Path(workdir), receipts, closure.gather(Path(workdir), last, count))
            _log(f"closure: {path} (every process finished and stopped; verify checks it)")
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM while closing: stop as during the run
        terminated = isinstance(e, Terminated)
        print(f"\n{'terminated (SIGTERM)' if terminated else 'interrupted'} during the closure: every step up to "
              f"{last} stays committed in {workdir}; no closure receipt", file=sys.stderr, flush=True)
        os._exit(143 if terminated else 130)
    except Exception as e:
        if FLAGS.debug:
            raise
        sys.exit(f"closure error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; every step up to "
                 f"{last} stays committed in {workdir}")


def run():
    app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    run()
