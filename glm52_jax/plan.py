"""AOT plan mode: per-device memory, FLOPs and collectives of the run's programs, without weights.

`plan(...)` builds the model abstractly (`nnx.eval_shape`: no parameter is ever materialised),
gives every parameter and input a `jax.ShapeDtypeStruct` carrying the `NamedSharding` its
logical axes get under the mesh's rules (as `load_pretrained(..., shardings=mesh)` places real
weights), and lowers + compiles the programs a GRPO transaction runs, at the configured shapes:

  prefill  with prefill_mode="chunked" (the sampler's default), `Sampler._prefill_chunk`:
           `forward_cached` of one [1, S=chunk_size] chunk against the batch-1 cache of the full
           sampler capacity C (cache in and out, not donated, as the sampler jits it): the sampler
           runs ceil(P / S) calls of this one executable (later chunks only run more trips of the
           indexer's data-dependent key loop, with the same buffers). With prefill_mode="whole",
           `Sampler._prefill_whole`: `model.prefill` of ids [1, P], the explicit context-parallel
           forward that also emits the cache (one call).
  forward  (optional) `model.hidden_states` on ids [1, P]: the uncached whole-prompt forward.
           The sampler never runs it; `conventional` training (per sample) and `token_logprobs`
           do. For comparison, when asked for in `programs`.
  decode   `Sampler._decode` exactly: a scan of R = max_new_tokens steps for G = num_samples
           rows against the G-row cache, each step logits + sampling + one `forward_cached`
           token. One step is the loop body: the per-body columns below; executed = x R. (A
           one-step program would measure nothing: its cache update is dead code.)
  train    one optimizer step: `rl.gradients._compute` in the configured mode (G per-sample
           backwards, accumulated; response_only takes the sampler's prefix cache as an input)
           then the `rl.update` transform (global-norm clip + AdamW) and `apply_updates`, fused
           in one program whose inputs include the AdamW moments (sharded like the adapters), so
           its arguments are everything resident during the step. The repo runs the same work as
           two jits (`_compute_jit`, then `_apply`) with the optimizer state resident throughout.

Every program keeps all its inputs (`keep_unused=True`): state a program does not read (the
lm_head in prefill) is still resident on the device.

Every number is per device, read from the compiled SPMD-partitioned executable (see `NOTES`,
also copied into each report):
  memory       `compiled.memory_analysis()`: argument, output, temp, alias, generated-code bytes;
               total = argument + output + temp - alias (what one device holds at once).
  flops        `xla_flops` = `compiled.cost_analysis()["flops"]`, which counts a while/scan body
               ONCE whatever its trip count (the 78 layers run in three scans). So the HLO text is
               also counted op by op like XLA's cost analysis (dot 2*|out|*|contracted|,
               elementwise 1 per element, reduce 1 per reduced element): `flops_static` (each
               computation once; matches `xla_flops` to a few percent) and `flops_executed` (times
               the `known_trip_count` of every loop around it). Loops with a data-dependent trip
               count (the DSA indexer's causal key loop) count once; `flops_executed_in_unknown_loops`
               says how much sits under one.
  collectives  from `compiled.as_text()`: for each all-gather, all-reduce, reduce-scatter,
               all-to-all and collective-permute, the bytes of its RESULT shape (the buffer a
               device ends up with: the gathered array for all-gather, the shard for
               reduce-scatter; not wire traffic), async pairs counted at `*-done`. `bytes` counts
               each op once as it appears in the text (a loop body once: per body);
               `bytes_executed` multiplies by known trip counts (unknown loops once, flagged in
               `ops_in_unknown_loops`). `largest_collectives` names the biggest results, with the
               op name or input and the Python function XLA recorded for each.

Compile target: the process's devices; plan mode normally runs on a virtual CPU mesh
(`ensure_virtual_devices`), with LLVM optimisation off (`FAST_CPU_COMPILE`; the plan never runs
code). XLA:CPU differs from a GPU build in ways the numbers show: `lax.ragged_dot` (the MoE) is
lowered densely over the local experts (FLOPs ~E x a grouped GEMM's, reported separately, and
an [rows, E_local * D] temp), and bf16 collectives are converted to f32. Treat bytes as an
estimate of the GPU plan, exact for arguments.

Axis letters: P prompt tokens, S chunk tokens, G samples, R response tokens (= max_new_tokens),
C cache capacity (slots), D model dim, E routed experts.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

PROGRAMS = ("prefill", "forward", "decode", "train")
COLLECTIVE_KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_FORCE_FLAG = "--xla_force_host_platform_device_count"


# ------------------------------------------------------------------------------------------------
# Virtual devices (must run before JAX initialises its backends).


def ensure_virtual_devices(n: int) -> int:
    """Makes this process see at least `n` devices, as virtual CPU devices if it must.

    Before JAX's backends start: sets `XLA_FLAGS=--xla_force_host_platform_device_count=n` (other
    XLA flags kept) and `JAX_PLATFORMS=cpu` (plus the matching `jax.config` values when jax is
    already imported, since jax reads those variables at import) unless they already provide
    `n` CPU devices. After they started: checks the count and raises a RuntimeError saying how to
    fix it if it is short. Returns the number of devices the process has or will have.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"ensure_virtual_devices: expected a positive integer, got {n!r}")
    jax_mod = sys.modules.get("jax")
    if jax_mod is not None and _backends_initialized():
        have = jax_mod.device_count()
        if have < n:
            raise RuntimeError(
                f"plan needs {n} devices but JAX is already initialised with {have} "
                f"({jax_mod.default_backend()}); virtual devices can only be added before JAX starts: call "
                f"glm52_jax.plan.ensure_virtual_devices({n}) before any JAX computation, or run with "
                f"XLA_FLAGS={_FORCE_FLAG}={n} JAX_PLATFORMS=cpu")
        return have
    flags = os.environ.get("XLA_FLAGS", "")
    current = re.search(rf"{_FORCE_FLAG}=(\d+)", flags)
    if current and int(current.group(1)) >= n and os.environ.get("JAX_PLATFORMS", "") == "cpu":
        return int(current.group(1))
    kept = [f for f in flags.split() if not f.startswith(_FORCE_FLAG)]
    os.environ["XLA_FLAGS"] = " ".join(kept + [f"{_FORCE_FLAG}={n}"])
    os.environ["JAX_PLATFORMS"] = "cpu"
    if jax_mod is not None:  # imported but not started: its config already read the environment
        jax_mod.config.update("jax_platforms", "cpu")
        jax_mod.config.update("jax_num_cpu_devices", n)
    return n


def _backends_initialized() -> bool:
    from jax._src import xla_bridge
    return xla_bridge.backends_are_initialized()


# ------------------------------------------------------------------------------------------------
# HLO text analysis (collectives, dot FLOPs, loop trip counts).

_COMP_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_CALLEE = re.compile(r"\b(condition|body|calls|to_apply|true_computation|false_computation)=%?([^\s,}]+)")
_CALLEE_LIST = re.compile(r"\b(branch_computations|called_computations)=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_COLLECTIVE_OPS = {
    "all-gather": "all-gather", "all-gather-done": "all-gather",
    "all-reduce": "all-reduce", "all-reduce-done": "all-reduce",
    "reduce-scatter": "reduce-scatter",
    "all-to-all": "all-to-all", "ragged-all-to-all": "all-to-all",
    "collective-permute": "collective-permute", "collective-permute-done": "collective-permute",
}


@dataclasses.dataclass
class _Instr:
    name: str
    shape: str  # result type text, e.g. "f32[8,16]{1,0}" or "(s32[], bf16[4]{0})"
    opcode: str
    operands: str  # the text inside the opcode's parentheses
    attrs: str  # everything after them


def _split_instr(rest: str) -> tuple[str, str, str, str] | None:
    """`TYPE opcode(operands), attrs` -> its four parts (TYPE may be a nested tuple)."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):  # noqa: B007 (i is the closing position after the loop)
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                break
        shape, rest = rest[: i + 1], rest[i + 1:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    m = re.match(r"([\w\-]+)\(", rest)
    if not m:
        return None
    depth, start = 0, m.end() - 1
    for j in range(start, len(rest)):
        depth += rest[j] == "("
        depth -= rest[j] == ")"
        if depth == 0:
            break
    return shape, m.group(1), rest[start + 1: j], rest[j + 1:]


def parse_hlo(text: str) -> tuple[dict[str, list[_Instr]], str | None]:
    """HLO module text -> ({computation: instructions}, entry computation name)."""
    comps: dict[str, list[_Instr]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            m = _COMP_HEADER.match(line)
            if m:
                current = m.group(2)
                comps[current] = []
                entry = current if m.group(1) else entry
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        parts = _split_instr(m.group(2)) if m else None
        if parts:
            comps[current].append(_Instr(m.group(1), *parts))
    return comps, entry


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO result type (tuples summed); the element width comes from the type name."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        bits = re.search(r"\d+", dtype)
        width = 8 if dtype == "pred" else 0 if dtype == "token" or not bits else int(bits.group())
        total += math.prod(int(d) for d in dims.split(",") if d) * width / 8
    return total


def _dims(shape: str) -> list[int]:
    m = _ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _call_graph(comps: dict[str, list[_Instr]]):
    """callee -> [(caller, factor, factor known)].

    A while body runs `known_trip_count` times per call (unknown: counted once, flagged); fusions,
    calls, conditional branches and async wrappers once; reducers (`to_apply` of reduce, scatter,
    all-reduce, ...) 0 times, because their work is counted on the op that applies them.
    """
    callers: dict[str, list[tuple[str, int, bool]]] = {name: [] for name in comps}
    for caller, instrs in comps.items():
        for ins in instrs:
            trip = _TRIP.search(ins.attrs)
            for role, callee in _CALLEE.findall(ins.attrs):
                if callee not in callers:
                    continue
                if ins.opcode == "while" and role == "body":
                    callers[callee].append((caller, int(trip.group(1)) if trip else 1, trip is not None))
                else:
                    callers[callee].append((caller, 0 if role == "to_apply" else 1, True))
            for _, names in _CALLEE_LIST.findall(ins.attrs):
                for callee in (n.strip().lstrip("%") for n in names.split(",")):
                    if callee in callers:
                        callers[callee].append((caller, 1, True))
    return callers


def loop_multipliers(comps: dict[str, list[_Instr]], entry: str) -> tuple[dict[str, int], dict[str, bool]]:
    """Times each computation runs per program call (known trip counts), and whether some loop
    on a path to it has an unknown (data-dependent) trip count, counted as 1."""
    callers = _call_graph(comps)
    mult: dict[str, int] = {}
    unknown: dict[str, bool] = {}

    def visit(name: str, stack: tuple[str, ...] = ()) -> None:
        if name in mult:
            return
        if name == entry:
            mult[name], unknown[name] = 1, False
            return
        total, unk = 0, False
        for caller, factor, known in callers.get(name, []):
            if caller in stack:  # not expected in HLO; never loop forever
                continue
            visit(caller, stack + (name,))
            total += mult[caller] * factor
            unk = unk or (factor > 0 and mult[caller] > 0 and (unknown[caller] or not known))
        mult[name], unknown[name] = total, unk

    for name in comps:
        visit(name)
    return mult, unknown


# Counted like XLA's HloCostAnalysis: elementwise ops 1 flop per result element, transcendentals
# separately, reduce 1 per reduced input element, dot 2 per multiply-add.
_TRANSCENDENTAL = frozenset({"exponential", "exponential-minus-one", "log", "log-plus-one", "logistic", "tanh",
                             "rsqrt", "sqrt", "cbrt", "sine", "cosine", "tan", "atan2", "erf", "power"})
_ELEMENTWISE = frozenset({"add", "subtract", "multiply", "divide", "maximum", "minimum", "abs", "negate", "compare",
                          "select", "and", "or", "xor", "not", "remainder", "sign", "floor", "ceil", "clamp",
                          "round-nearest-even", "round-nearest-afz", "shift-left", "shift-right-logical",
                          "shift-right-arithmetic", "is-finite", "popcnt", "clz"})


def _operand_dims(text: str, shapes: dict[str, str]) -> list[int]:
    """Dims of an operand printed as `%name` or `f32[...]{...} %name`."""
    text = text.strip()
    return _dims(text) if _ARRAY.search(text) else _dims(shapes.get(text.lstrip("%"), ""))


def _operands(ins: _Instr) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in ins.operands:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return out + ([cur] if cur.strip() else [])


def _instr_flops(ins: _Instr, shapes: dict[str, str]) -> tuple[float, float, bool]:
    """(flops, transcendentals, is a dot) of one instruction, its loop multiplier not applied."""
    if ins.opcode == "dot":
        lhs = _operand_dims(_operands(ins)[0], shapes)
        m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.attrs)
        contracted = [lhs[int(i)] for i in m.group(1).split(",") if i] if (m and lhs) else []
        return 2.0 * math.prod(_dims(ins.shape)) * math.prod(contracted), 0.0, True
    if ins.opcode in _ELEMENTWISE:
        return float(math.prod(_dims(ins.shape))), 0.0, False
    if ins.opcode in _TRANSCENDENTAL:
        return 0.0, float(math.prod(_dims(ins.shape))), False
    if ins.opcode == "reduce":
        ops = _operands(ins)
        inputs = ops[: len(ops) // 2]
        n_in = sum(math.prod(_operand_dims(o, shapes)) for o in inputs)
        return float(max(n_in - math.prod(_dims(ins.shape)) * len(inputs), 0)), 0.0, False
    if ins.opcode == "reduce-window":
        size = re.search(r"size=([0-9x]+)", ins.attrs)
        window = math.prod(int(d) for d in size.group(1).split("x")) if size else 1
        return float(math.prod(_dims(ins.shape)) * max(window - 1, 0)), 0.0, False
    return 0.0, 0.0, False


def _frame_functions(text: str) -> dict[int, str]:
    """stack_frame_id -> the function name of that (innermost) frame, from the module's tables."""

    def table(title: str) -> dict[int, str]:
        m = re.search(rf"^{title}\n(.*?)(?:\n\s*\n|\Z)", text, re.S | re.M)
        rows = {}
        for line in (m.group(1).splitlines() if m else []):
            key, _, value = line.strip().partition(" ")
            if key.isdigit():
                rows[int(key)] = value
        return rows

    names = {k: v.strip('"') for k, v in table("FunctionNames").items()}
    locs = {k: re.search(r"function_name_id=(\d+)", v) for k, v in table("FileLocations").items()}
    out = {}
    for k, v in table("StackFrames").items():
        loc = re.search(r"file_location_id=(\d+)", v)
        fn = locs.get(int(loc.group(1))) if loc else None
        if fn:
            out[k] = names.get(int(fn.group(1)), "")
    return out


def analyze_hlo(text: str, top: int = 8) -> dict[str, Any]:
    """Collective bytes by kind and FLOPs of one compiled module's text (see the module docs).

    `largest_collectives`: the `top` collective ops by result size (the buffers they add to a
    device's memory), with shape, times executed per program call,
    the JAX op name (or the input it gathers) and the Python function XLA recorded for it.
    """
    comps, entry = parse_hlo(text)
    if entry is None:
        raise ValueError("analyze_hlo: no ENTRY computation in the HLO text")
    mult, unknown = loop_multipliers(comps, entry)
    coll = {k: {"ops": 0, "bytes": 0.0, "bytes_executed": 0.0, "ops_in_unknown_loops": 0} for k in COLLECTIVE_KINDS}
    fl = dict.fromkeys(("flops_static", "flops_executed", "dot_flops_executed", "ragged_dot_flops_executed",
                        "transcendentals_executed", "flops_executed_in_unknown_loops"), 0.0)
    frames = _frame_functions(text)
    loops = {"while_loops": 0, "unknown_trip_count_loops": 0}
    largest: list[dict[str, Any]] = []
    for name, instrs in comps.items():
        shapes = {ins.name: ins.shape for ins in instrs}
        times, unk = mult.get(name, 0), unknown.get(name, False)
        for ins in instrs:
            if ins.opcode == "while":
                loops["while_loops"] += 1
                loops["unknown_trip_count_loops"] += _TRIP.search(ins.attrs) is None
            kind = _COLLECTIVE_OPS.get(ins.opcode)
            if kind is not None:
                b = shape_bytes(ins.shape)
                c = coll[kind]
                c["ops"] += 1
                c["bytes"] += b
                c["bytes_executed"] += b * times
                c["ops_in_unknown_loops"] += unk
                op_name = re.search(r'op_name="([^"]*)"', ins.attrs)
                frame = re.search(r"stack_frame_id=(\d+)", ins.attrs)
                largest.append({"kind": kind, "shape": ins.shape, "bytes": int(b), "times": times,
                                "unknown_loop": unk, "op_name": op_name.group(1)[-200:] if op_name else "",
                                "function": frames.get(int(frame.group(1)), "") if frame else ""})
                continue
            f, t, is_dot = _instr_flops(ins, shapes)
            fl["flops_static"] += f * (times > 0)
            fl["flops_executed"] += f * times
            fl["dot_flops_executed"] += f * times if is_dot else 0.0
            if is_dot:  # a dot emitted at a lax.ragged_dot call site (moe._ragged, Adapter.ragged_delta)
                frame = re.search(r"stack_frame_id=(\d+)", ins.attrs)
                if frame and "ragged" in frames.get(int(frame.group(1)), ""):
                    fl["ragged_dot_flops_executed"] += f * times
            fl["transcendentals_executed"] += t * times
            fl["flops_executed_in_unknown_loops"] += f * times if unk else 0.0
    for c in coll.values():
        c["bytes"], c["bytes_executed"] = int(c["bytes"]), int(c["bytes_executed"])
    largest.sort(key=lambda r: (-r["bytes"], -r["times"]))
    return {"collectives": coll, "largest_collectives": largest[:top], "flops": fl, **loops}


# ------------------------------------------------------------------------------------------------
# Abstract model and inputs.


def _sds(shape, dtype, mesh, axes: Sequence[str | None] | None):
    """A ShapeDtypeStruct sharded by logical `axes` (None: replicated) under the active rules."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from glm52_jax.parallel.rules import logical_to_spec

    spec = P() if axes is None else logical_to_spec(axes, mesh_axes=mesh.axis_names)
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=NamedSharding(mesh, spec))


def _sds_even(shape, dtype, mesh, axes: Sequence[str | None]):
    """`_sds`, leaving unsharded any axis its mesh axes do not divide (small inputs like token ids)."""
    from glm52_jax.parallel.rules import logical_to_spec

    spec = logical_to_spec(axes, mesh_axes=mesh.axis_names)
    kept = [a if dim % _mesh_ways(mesh, part) == 0 else None for a, dim, part in zip(axes, shape, spec)]
    return _sds(shape, dtype, mesh, kept)


def _mesh_ways(mesh, part) -> int:
    names = () if part is None else (part,) if isinstance(part, str) else tuple(part)
    return math.prod(mesh.shape[a] for a in names)


def shard_bytes(sds) -> int:
    """Bytes one device holds of a sharded ShapeDtypeStruct (jit inputs shard evenly)."""
    return math.prod(sds.sharding.shard_shape(tuple(sds.shape))) * _itemsize(sds.dtype)


def _itemsize(dtype) -> int:
    import numpy as np

    # PRNG key dtypes (key<fry>) are not numpy dtypes but carry their width.
    return int(getattr(dtype, "itemsize", None) or np.dtype(dtype).itemsize)


def _cache_bytes(cache, per_device: bool) -> int:
    """Bytes of a cache's arrays (not its `length` scalar)."""
    return _tree_bytes((cache.c_kv, cache.k_rope, cache.index_k), per_device)


def _tree_bytes(tree, per_device: bool) -> int:
    import jax

    leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "shape")]
    if per_device:
        return sum(shard_bytes(x) for x in leaves)
    return sum(math.prod(x.shape) * _itemsize(x.dtype) for x in leaves)


def abstract_model(cfg, opts, mesh):
    """(graphdef, state) of the model with every array a sharded ShapeDtypeStruct.

    `nnx.eval_shape` traces the constructor only; each variable's `out_sharding` metadata (its
    logical axes, 'layers' prepended on scanned stacks) picks its NamedSharding, exactly as
    `load_pretrained(..., shardings=mesh)` places real weights.
    """
    from flax import nnx

    from glm52_jax.model.transformer import GlmMoeDsa

    abstract = nnx.eval_shape(lambda: GlmMoeDsa(cfg, opts, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    leaves = []
    for key, var in nnx.to_flat_state(state):
        value = var.get_value()
        axes = var.get_metadata().get("out_sharding") or (None,) * len(value.shape)
        leaves.append((key, var.replace(_sds(value.shape, value.dtype, mesh, axes))))
    return graphdef, nnx.from_flat_state(leaves)


def abstract_cache(cfg, segments, batch: int, capacity: int, dtype, mesh):
    """A KVCache of ShapeDtypeStructs, slots sharded like `write_chunk` keeps them (CACHE_AXES)."""
    import jax
    import jax.numpy as jnp

    from glm52_jax.model.kv_cache import CACHE_AXES, KVCache, init_cache

    shapes = jax.eval_shape(lambda: init_cache(cfg, segments, batch, capacity, dtype))

    def put(a):
        return _sds(a.shape, a.dtype, mesh, CACHE_AXES)

    return KVCache(tuple(map(put, shapes.c_kv)), tuple(map(put, shapes.k_rope)), tuple(map(put, shapes.index_k)),
                   _sds((), jnp.int32, mesh, None))


# ------------------------------------------------------------------------------------------------
# The programs: each returns (function to jit, abstract args, jit keyword args, what it is, calls).


@dataclasses.dataclass(frozen=True)
class _Setup:
    cfg: Any
    opts: Any
    mesh: Any
    graphdef: Any
    state: Any
    prompt_tokens: int
    max_new_tokens: int
    num_samples: int
    chunk_size: int
    prefill_mode: str
    capacity: int
    gradient_mode: str
    logprob_chunk: int
    donate_cache: bool


def _prefill_program(s: _Setup):
    from flax import nnx

    from glm52_jax.rollout.sampler import CACHE_COMPILER_OPTIONS

    graphdef = s.graphdef
    if s.prefill_mode == "whole":
        def prefill_whole(state, ids):  # = Sampler.__init__'s prefill_whole at this capacity
            h, cache = nnx.merge(graphdef, state).prefill(ids, s.capacity)
            return h[:, -1], cache

        ids = _sds_even((1, s.prompt_tokens), "int32", s.mesh, ("batch", "seq"))
        what = (f"Sampler._prefill_whole: model.prefill of ids [1,{s.prompt_tokens}] (context-parallel forward) "
                f"-> h_last and the batch-1 cache (capacity {s.capacity})")
        return prefill_whole, (s.state, ids), {}, what, 1

    def prefill_chunk(state, ids, cache):  # = Sampler.__init__'s prefill_chunk
        return nnx.merge(graphdef, state).forward_cached(ids, cache)

    ids = _sds_even((1, s.chunk_size), "int32", s.mesh, ("batch", "seq"))
    cache = abstract_cache(s.cfg, _segments(s), 1, s.capacity, s.opts.param_dtype, s.mesh)
    kw = dict(compiler_options=CACHE_COMPILER_OPTIONS, donate_argnums=(2,) if s.donate_cache else ())
    what = (f"Sampler._prefill_chunk: forward_cached of ids [1,{s.chunk_size}] against the batch-1 cache "
            f"(capacity {s.capacity}); cache in and out{' (donated)' if s.donate_cache else ', not donated'}")
    return prefill_chunk, (s.state, ids, cache), kw, what, -(-s.prompt_tokens // s.chunk_size)


def _forward_program(s: _Setup):
    from flax import nnx

    graphdef = s.graphdef

    def forward(state, ids):
        return nnx.merge(graphdef, state).hidden_states(ids)

    ids = _sds_even((1, s.prompt_tokens), "int32", s.mesh, ("batch", "seq"))
    what = f"model.hidden_states on ids [1,{s.prompt_tokens}]: uncached whole-prompt forward (not run by the sampler)"
    return forward, (s.state, ids), {}, what, 1


def _decode_program(s: _Setup):
    import jax
    from flax import nnx

    from glm52_jax.rollout.sampler import CACHE_COMPILER_OPTIONS, _decode

    graphdef, stop_ids, steps = s.graphdef, tuple(int(t) for t in s.cfg.eos_token_id), s.max_new_tokens

    # Sampler._decode exactly (temperature 1, no top-k/top-p): a scan of R steps, each logits +
    # sampling + one forward_cached token. A one-step program would not do: its cache update is
    # dead code (only tokens and log-probs leave the scan) and XLA deletes the forward.
    def decode(state, cache, h_last, keys):
        return _decode(nnx.merge(graphdef, state), cache, h_last, keys, None, steps=steps, temperature=1.0, top_k=0,
                       top_p=1.0, stop_ids=stop_ids)

    g = s.num_samples
    cache = abstract_cache(s.cfg, _segments(s), g, s.capacity, s.opts.param_dtype, s.mesh)
    h_last = _sds_even((g, s.cfg.hidden_size), s.opts.param_dtype, s.mesh, ("batch", "embed"))
    key_shape = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), g))
    keys = _sds(key_shape.shape, key_shape.dtype, s.mesh, None)
    kw = dict(compiler_options=CACHE_COMPILER_OPTIONS, donate_argnums=(1,) if s.donate_cache else ())
    what = (f"Sampler._decode: scan of max_new_tokens={steps} steps for G={g} rows against the G-row cache "
            f"(capacity {s.capacity}); one step = the loop body (per-body columns), executed = x {steps}")
    return decode, (s.state, cache, h_last, keys), kw, what, 1


def _train_program(s: _Setup, adamw):
    import jax
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from glm52_jax.model.lora import LoRA
    from glm52_jax.rl import gradients

    graphdef, mode, chunk = s.graphdef, s.gradient_mode, s.logprob_chunk
    tx = adamw.transform()
    settings = gradients.LossSettings()

    # The LoRA / frozen split of the abstract state, as `split_lora` does for a real model.
    model = nnx.merge(graphdef, s.state)
    lora_graphdef, lora, frozen = nnx.split(model, LoRA, ...)
    if not jax.tree.leaves(lora):
        raise ValueError("plan: the train program needs LoRA adapters (pass lora=LoRAConfig(...))")
    pure = nnx.as_pure(lora)
    # Optimizer state: shapes from tx.init; AdamW's moments sharded like the adapters they track
    # (as `LoRAOptimizer`'s eager zeros_like leaves them), everything else (step count) replicated.
    replicated = NamedSharding(s.mesh, P())
    opt_state = optax.tree_map_params(
        tx, lambda leaf, param: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=param.sharding),
        jax.eval_shape(tx.init, pure), pure,
        transform_non_params=lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=replicated))

    def train_step(lora, frozen, opt_state, prompt, responses, mask, old, adv, prefix):
        grads, losses, logps, metrics = gradients._compute(
            lora_graphdef, lora, frozen, prompt, responses, mask, old, adv, prefix, mode=mode, settings=settings,
            chunk=chunk)
        params = nnx.as_pure(lora)
        updates, new_opt = tx.update(nnx.as_pure(grads), opt_state, params)
        return optax.apply_updates(params, updates), new_opt, losses.sum(), logps, metrics

    g, r, p = s.num_samples, s.max_new_tokens, s.prompt_tokens
    prompt = _sds_even((p,), "int32", s.mesh, ("seq",))
    responses = _sds((g, r), "int32", s.mesh, None)
    floats = [_sds(shape, "float32", s.mesh, None) for shape in ((g, r), (g, r), (g,))]
    prefix = None
    if mode == "response_only":  # the sampler's batch-1 prompt cache, as the transaction passes it
        prefix = abstract_cache(s.cfg, _segments(s), 1, s.capacity, s.opts.param_dtype, s.mesh)
    what = (f"one GRPO step, gradient_mode={mode}: G={g} per-sample backwards over R={r} response tokens "
            f"(prompt P={p}{', prefix cache input' if prefix is not None else ''}) + clip + AdamW on the LoRA")
    args = (lora, frozen, opt_state, prompt, responses, *floats, prefix)
    return train_step, args, {}, what, 1


def _segments(s: _Setup):
    from glm52_jax.model.transformer import layer_kinds, plan_segments

    return tuple(plan_segments(layer_kinds(s.cfg)))


# ------------------------------------------------------------------------------------------------
# Compile and measure.


# Plan executables never run, so XLA:CPU need not optimise the machine code it emits: LLVM at -O0
# without its expensive passes (tiny train program: compile 58 s -> 35 s). The new xtile
# tiled-fusion emitter is off because it crashes (SIGFPE in xla::gpu::experimental::GetSchedule,
# jaxlib 0.12.0.1) emitting a fusion of the 2M whole-prompt forward. All three change code
# generation only: buffer assignment, fusion and SPMD partitioning, which the plan reads, do not
# (checked: identical memory / cost analyses for the tiny train program, and an identical
# optimised HLO module and memory analysis for the 2M prefill chunk with and without the last).
FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                    "xla_cpu_use_new_xtile_lowering": False}


def _measure(fn: Callable, args: tuple, jit_kw: dict, mesh, fast_compile: bool) -> dict[str, Any]:
    import jax

    # keep_unused: arguments include state a program does not read (lm_head in prefill): it stays
    # resident on the device all the same, so it belongs in the per-device total.
    jit_kw = dict(jit_kw, keep_unused=True)
    if fast_compile and jax.default_backend() == "cpu":
        jit_kw["compiler_options"] = {**jit_kw.get("compiler_options", {}), **FAST_CPU_COMPILE}
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        lowered = jax.jit(fn, **jit_kw).lower(*args)
    t1 = time.perf_counter()
    # Plan programs are compiled to be measured, never run: keep them out of a persistent
    # compilation cache (serializing them is wasted work, and XLA:CPU's executable serializer
    # segfaulted on one of them in a test session that had the cache on).
    min_secs = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    try:
        compiled = lowered.compile()
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_secs)
    t2 = time.perf_counter()
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, (list, tuple)):  # older jax: one dict per computation
        cost = cost[0] if cost else {}
    hlo = analyze_hlo(compiled.as_text())
    memory = {
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
        "alias_bytes": int(mem.alias_size_in_bytes),
        "generated_code_bytes": int(mem.generated_code_size_in_bytes),
    }
    memory["total_bytes"] = (memory["argument_bytes"] + memory["output_bytes"] + memory["temp_bytes"]
                             - memory["alias_bytes"])
    return {
        "memory": memory,
        "flops": {"xla_flops": float(cost.get("flops", 0.0)),
                  "xla_transcendentals": float(cost.get("transcendentals", 0.0)),
                  "xla_bytes_accessed": float(cost.get("bytes accessed", 0.0)), **hlo["flops"]},
        "collectives": hlo["collectives"],
        "largest_collectives": hlo["largest_collectives"],
        "loops": {"while_loops": hlo["while_loops"], "unknown_trip_count_loops": hlo["unknown_trip_count_loops"]},
        "seconds": {"lower": round(t1 - t0, 2), "compile": round(t2 - t1, 2)},
    }


NOTES = (
    "per device throughout; memory from compiled.memory_analysis(); total = argument + output + temp - alias",
    "xla_flops = compiled.cost_analysis()['flops']: XLA counts a while/scan body once, whatever its trip count",
    "flops_static / flops_executed: the HLO's ops counted like XLA's cost analysis (dot 2*|out|*|contracted|, "
    "elementwise 1 per element, reduce 1 per reduced element), each computation once / times its loops' known "
    "trip counts; loops with a data-dependent trip count (the DSA indexer's causal key loop) count once "
    "(flops_executed_in_unknown_loops says how much sits under one)",
    "collectives: bytes of each collective op's result shape (all-gather: the gathered array; reduce-scatter: "
    "the shard; all-reduce / all-to-all / collective-permute: the buffer), async pairs at *-done; 'bytes' = each "
    "op once as it appears in the text (a loop body once), 'bytes_executed' = times known trip counts",
    "XLA:CPU lowers lax.ragged_dot densely (jax's _ragged_dot_general_impl: each row expanded over all local "
    "expert groups and masked), so MoE FLOPs are ~E times a grouped GEMM's (ragged_dot_flops_executed; "
    "flops_executed_grouped_gemm_estimate divides that part by E) and temps hold the [rows, E_local * D] "
    "expansion; XLA:CPU cannot compile the ragged-dot HLO op GPU/TPU lowerings emit",
    "indexer_analytic: model FLOPs of the DSA indexer scores, the work inside the data-dependent key loops that "
    "the HLO count sees once (global; /seq_shards for an ideal context-parallel split)",
    "XLA:CPU converts bf16 collectives to f32 (convert before all-gather / all-reduce), doubling those buffers "
    "relative to a GPU build",
)


def sampler_capacity(prompt_tokens: int, max_new_tokens: int, max_positions: int, multiple: int = 256) -> int:
    """`Sampler.capacity_for`: prompt + new tokens rounded up to `multiple`, capped at max positions."""
    need = prompt_tokens + max_new_tokens
    return min(-(-need // multiple) * multiple, max_positions)


def plan_capacity(prompt_tokens: int, max_new_tokens: int, max_positions: int, multiple: int,
                  seq_ways: int) -> tuple[int, int, str | None]:
    """(sampler capacity, capacity planned with, issue or None).

    The cache's slot axis is sharded `seq_ways` ways and jit rejects an input whose sharded axis
    does not divide evenly. When the sampler's capacity (capped at max_position_embeddings) does
    not, the plan uses the next multiple of lcm(multiple, seq_ways) and says so: slots past the
    last position are never written, so the cap is not needed for correctness.
    """
    capacity = sampler_capacity(prompt_tokens, max_new_tokens, max_positions, multiple)
    if capacity % seq_ways == 0:
        return capacity, capacity, None
    step = math.lcm(multiple, seq_ways)
    planned = -(-capacity // step) * step
    return capacity, planned, (
        f"cache capacity {capacity} (Sampler.capacity_for: {prompt_tokens}+{max_new_tokens} rounded up to "
        f"{multiple}, capped at max_position_embeddings={max_positions}) is not divisible by the {seq_ways}-way "
        f"sequence sharding, which jit rejects for an input; planned with {planned} slots instead (the cap "
        "dropped; slots past the last position are never written)")


def plan(model_cfg, mesh_spec, *, prompt_tokens: int, max_new_tokens: int, num_samples: int,
         gradient_mode: str, lora, dtype, chunk_size: int, hbm_bytes: float = 96e9,
         programs: Iterable[str] = ("prefill", "decode", "train"), options=None, logprob_chunk: int = 1024,
         capacity_multiple: int = 256, donate_cache: bool = False, adamw=None, fast_compile: bool = True,
         prefill_mode: str = "chunked", log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Lowers and compiles the run's programs on `mesh_spec` with abstract weights and inputs.

    model_cfg: `ModelConfig` (apply rope scaling beforehand, e.g. `with_env_rope_scaling()`).
    mesh_spec: `parallel.mesh.MeshSpec`; the process needs >= `mesh_spec.size` devices (the first
      ones are used; see `ensure_virtual_devices`).
    prompt_tokens P, max_new_tokens R, num_samples G, chunk_size (the sampler's prefill chunk),
      prefill_mode (the sampler's: "chunked" or "whole", which program "prefill" compiles),
      gradient_mode (`rl.gradients.MODES`), lora (`LoRAConfig`; required for "train"), dtype
      (parameter/activation dtype).
    options: `ModelOptions` overrides (block sizes, remat); its param_dtype / lora are replaced by
      `dtype` / `lora`. donate_cache: donate the cache to prefill/decode (the sampler does not).
    fast_compile: on CPU, skip LLVM optimisation (`FAST_CPU_COMPILE`; the plan never runs code).
    adamw: `rl.update.AdamWConfig` of the train program (default: its defaults). log: progress lines.
    Returns a JSON-serialisable dict (see `format_plan`); per-device numbers throughout.
    """
    import jax
    import jax.numpy as jnp

    from glm52_jax.model.options import ModelOptions
    from glm52_jax.parallel.rules import axis_rules
    from glm52_jax.rl.gradients import MODES
    from glm52_jax.rl.update import AdamWConfig

    programs = tuple(programs)
    unknown = [p for p in programs if p not in PROGRAMS]
    if unknown or not programs:
        raise ValueError(f"plan: unknown program(s) {unknown}; choose from {PROGRAMS}")
    if gradient_mode not in MODES:
        raise ValueError(f"plan: gradient_mode must be one of {MODES}, got {gradient_mode!r}")
    for name, value in (("prompt_tokens", prompt_tokens), ("max_new_tokens", max_new_tokens),
                        ("num_samples", num_samples), ("chunk_size", chunk_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"plan: {name} must be a positive integer, got {value!r}")
    if prefill_mode not in ("chunked", "whole"):
        raise ValueError(f"plan: prefill_mode must be 'chunked' or 'whole', got {prefill_mode!r}")
    if "train" in programs and lora is None:
        raise ValueError("plan: the train program trains LoRA adapters; pass lora=LoRAConfig(...)")
    say = log or (lambda msg: None)
    have = jax.device_count()
    if have < mesh_spec.size:
        raise ValueError(f"plan: mesh {mesh_spec.describe()} needs {mesh_spec.size} devices but this process has "
                         f"{have} ({jax.default_backend()}); call glm52_jax.plan.ensure_virtual_devices("
                         f"{mesh_spec.size}) before JAX starts, or set XLA_FLAGS={_FORCE_FLAG}={mesh_spec.size} "
                         "JAX_PLATFORMS=cpu")
    mesh = mesh_spec.make(jax.devices()[: mesh_spec.size])
    dtype = jnp.dtype(dtype)
    opts = dataclasses.replace(options or ModelOptions(), param_dtype=dtype, lora=lora)
    issues: list[str] = []

    with axis_rules(mesh_spec.rules()):
        if prompt_tokens + max_new_tokens > model_cfg.max_position_embeddings:
            raise ValueError(f"plan: prompt_tokens + max_new_tokens = {prompt_tokens + max_new_tokens} exceeds "
                             f"max_position_embeddings {model_cfg.max_position_embeddings} (apply rope scaling first)")
        capacity, planned_capacity, issue = plan_capacity(prompt_tokens, max_new_tokens,
                                                          model_cfg.max_position_embeddings, capacity_multiple,
                                                          _ways(mesh, "seq"))
        issues += [issue] if issue else []
        graphdef, state = abstract_model(model_cfg, opts, mesh)
        setup = _Setup(model_cfg, opts, mesh, graphdef, state, prompt_tokens, max_new_tokens, num_samples, chunk_size,
                       prefill_mode, planned_capacity, gradient_mode, logprob_chunk, donate_cache)
        report = _static_report(setup, mesh_spec, capacity, lora, dtype)
        report["issues"] = issues
        report["notes"] = list(NOTES)
        builders = {"prefill": _prefill_program, "forward": _forward_program, "decode": _decode_program,
                    "train": lambda s: _train_program(s, adamw or AdamWConfig())}
        report["programs"] = {}
        for name in programs:
            fn, args, jit_kw, what, calls = builders[name](setup)
            say(f"plan: lowering and compiling {name} ...")
            entry = {"what": what, "calls_per_transaction": calls,
                     "input_bytes_per_device": _tree_bytes(args, per_device=True)}
            entry.update(_measure(fn, args, jit_kw, mesh, fast_compile))
            fl = entry["flops"]
            # A grouped GEMM does 1/E of the dense lowering's work (see NOTES); balanced routing assumed.
            fl["flops_executed_grouped_gemm_estimate"] = (
                fl["flops_executed"] - fl["ragged_dot_flops_executed"] * (1 - 1 / model_cfg.n_routed_experts))
            mem = entry["memory"]
            say(f"plan: {name}: total {mem['total_bytes'] / 1e9:.2f} GB/device, "
                f"compile {entry['seconds']['compile']} s")
            report["programs"][name] = entry
    assess(report, hbm_bytes)
    return report


TRANSACTION_PROGRAMS = ("prefill", "decode", "train")  # what a GRPO transaction runs; "forward" is a reference


def assess(report: dict[str, Any], hbm_bytes: float) -> dict[str, Any]:
    """Sets the verdict fields of `report` for `hbm_bytes` per device (also usable on a saved report).

    Each program gets `fits`; the report's `fits` / `largest_program` cover the transaction's
    programs (all planned programs when none of them was planned).
    """
    totals = {name: p["memory"]["total_bytes"] for name, p in report["programs"].items()}
    judged = {n: t for n, t in totals.items() if n in TRANSACTION_PROGRAMS} or totals
    largest = max(judged, key=judged.get)
    report["hbm_bytes"] = float(hbm_bytes)
    report["largest_program"] = largest
    report["largest_total_bytes"] = totals[largest]
    report["fits"] = bool(totals[largest] <= hbm_bytes)
    for name, p in report["programs"].items():
        p["fits"] = bool(totals[name] <= hbm_bytes)
    return report


def _ways(mesh, logical: str) -> int:
    """How many ways the active rules shard logical axis `logical` on `mesh`."""
    from glm52_jax.parallel.rules import logical_to_spec

    return _mesh_ways(mesh, logical_to_spec((logical,), mesh_axes=mesh.axis_names)[0])


def _indexer_analytic(s: _Setup) -> dict[str, Any]:
    """Model FLOPs of the DSA indexer's q.k scores, which sit inside data-dependent key loops that
    the HLO count sees once: 2 * index_n_heads * index_head_dim per (query, visible key) pair per
    'full' layer (weighting / ReLU / top-k not counted). Global numbers; an ideal context-parallel
    split divides them by the sequence shards."""
    cfg = s.cfg
    per_pair = 2 * cfg.index_n_heads * cfg.index_head_dim * sum(t == "full" for t in cfg.indexer_types)
    p, c, g, r = s.prompt_tokens, s.chunk_size, s.num_samples, s.max_new_tokens
    return {
        "flops_per_query_key_pair": per_pair,
        "prefill_total_flops": per_pair * p * (p + 1) / 2,
        "prefill_last_chunk_flops": per_pair * min(c, p) * p,
        "decode_step_flops": per_pair * g * (p + r),
        "train_flops_per_sample": per_pair * r * (p + r),
        "seq_shards": _ways(s.mesh, "seq"),
    }


def _static_report(s: _Setup, mesh_spec, sampler_cap: int, lora, dtype) -> dict[str, Any]:
    """The analytic part: parameter and cache bytes (global and per device), shapes, mesh."""
    import jax
    from flax import nnx

    from glm52_jax.model.lora import LoRA

    _, lora_state, base = nnx.split(nnx.merge(s.graphdef, s.state), LoRA, ...)
    cache1 = abstract_cache(s.cfg, _segments(s), 1, s.capacity, s.opts.param_dtype, s.mesh)
    cache_g = abstract_cache(s.cfg, _segments(s), s.num_samples, s.capacity, s.opts.param_dtype, s.mesh)
    return {
        "mesh": {"describe": mesh_spec.describe(), "axes": dict(zip(mesh_spec.axis_names, mesh_spec.shape)),
                 "devices": mesh_spec.size, "platform": jax.default_backend(),
                 "rules": [list(r) for r in mesh_spec.rules()],
                 "seq_shards": _ways(s.mesh, "seq"), "expert_shards": _ways(s.mesh, "experts")},
        "shapes": {"prompt_tokens": s.prompt_tokens, "max_new_tokens": s.max_new_tokens,
                   "num_samples": s.num_samples, "chunk_size": s.chunk_size, "prefill_mode": s.prefill_mode,
                   "sampler_capacity": sampler_cap,
                   "planned_capacity": s.capacity, "gradient_mode": s.gradient_mode, "dtype": str(dtype),
                   "logprob_chunk": s.logprob_chunk, "donate_cache": s.donate_cache,
                   "lora": None if lora is None else {"rank": lora.rank, "alpha": lora.alpha,
                                                      "families": sorted(lora.families),
                                                      "param_dtype": str(lora.param_dtype)},
                   "options": {k: getattr(s.opts, k) for k in ("indexer_query_block", "indexer_key_block",
                                                                "attention_query_block", "remat")}},
        "model": {"layers": s.cfg.num_hidden_layers,
                  "param_count": sum(math.prod(x.shape) for x in jax.tree.leaves(base)),
                  "param_bytes": _tree_bytes(base, False), "param_bytes_per_device": _tree_bytes(base, True),
                  "lora_count": sum(math.prod(x.shape) for x in jax.tree.leaves(lora_state)),
                  "lora_bytes": _tree_bytes(lora_state, False), "lora_bytes_per_device": _tree_bytes(lora_state, True)},
        "indexer_analytic": _indexer_analytic(s),
        "cache": {"batch1_bytes": _cache_bytes(cache1, False), "batch1_bytes_per_device": _cache_bytes(cache1, True),
                  "decode_bytes": _cache_bytes(cache_g, False), "decode_bytes_per_device": _cache_bytes(cache_g, True)},
    }


# ------------------------------------------------------------------------------------------------
# Text rendering.


def _scale(largest: float, names: Sequence[tuple[str, float]]) -> tuple[str, float]:
    """The largest unit (name, size) in which `largest` is at least 1, else the smallest."""
    for name, size in names:
        if largest >= size:
            return name, size
    return names[-1]


def format_plan(report: dict[str, Any]) -> str:
    """A readable summary of a `plan` report (all per device; units fit the largest number).

    FLOP columns: xla = cost analysis (loop bodies once); exec = HLO count x known trip counts;
    grouped = exec with the dense CPU ragged_dot part divided by E (see NOTES).
    """
    sh, m, mesh, progs = report["shapes"], report["model"], report["mesh"], report["programs"]
    bu, bs = _scale(max(p["memory"]["total_bytes"] for p in progs.values()),
                    (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)))
    fu, fs = _scale(max(p["flops"]["flops_executed"] for p in progs.values()),
                    (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)))
    cu, cs = _scale(max([c["bytes_executed"] for p in progs.values() for c in p["collectives"].values()] + [0]),
                    (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)))
    lines = [
        f"mesh {mesh['describe']} on {mesh['devices']} {mesh['platform']} devices "
        f"(seq x{mesh['seq_shards']}, experts x{mesh['expert_shards']})",
        f"P={sh['prompt_tokens']} R={sh['max_new_tokens']} G={sh['num_samples']} chunk={sh['chunk_size']} "
        f"prefill={sh.get('prefill_mode', 'chunked')} "
        f"capacity={sh['planned_capacity']} mode={sh['gradient_mode']} dtype={sh['dtype']}",
        f"params {m['param_count']:,} ({m['param_bytes'] / bs:.3f} {bu}, {m['param_bytes_per_device'] / bs:.3f} "
        f"{bu}/device); LoRA {m['lora_count']:,} ({m['lora_bytes_per_device'] / bs:.3f} {bu}/device); cache "
        f"batch 1 {report['cache']['batch1_bytes_per_device'] / bs:.3f} {bu}/device, G rows "
        f"{report['cache']['decode_bytes_per_device'] / bs:.3f} {bu}/device",
    ]
    ix = report.get("indexer_analytic")
    if ix:
        lines.append(f"DSA indexer scores (analytic, global; inside data-dependent loops): prefill "
                     f"{ix['prefill_total_flops'] / fs:.4g} {fu} in all, last chunk "
                     f"{ix['prefill_last_chunk_flops'] / fs:.4g} {fu}, decode step {ix['decode_step_flops'] / fs:.4g} "
                     f"{fu}; / {ix['seq_shards']} per device if split by CP")
    head = [f"args {bu}", f"out {bu}", f"temp {bu}", f"alias {bu}", f"total {bu}"]
    lines += ["", f"{'program':<8} " + " ".join(f"{h:>10}" for h in head) + f" {'fits':>5} "
              + " ".join(f"{h:>12}" for h in (f"xla {fu}", f"exec {fu}", f"grouped {fu}")) + f" {'lower s':>8} "
              f"{'compile s':>9}"]
    for name, p in progs.items():
        mem, fl = p["memory"], p["flops"]
        cells = [mem[k] / bs for k in ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "total_bytes")]
        flops = [fl[k] / fs for k in ("xla_flops", "flops_executed", "flops_executed_grouped_gemm_estimate")]
        lines.append(f"{name:<8} " + " ".join(f"{c:10.3f}" for c in cells) + f" {'yes' if p['fits'] else 'NO':>5} "
                     + " ".join(f"{f:12.4f}" for f in flops)
                     + f" {p['seconds']['lower']:8.1f} {p['seconds']['compile']:9.1f}")
    lines += ["", f"collectives, {cu} of result shapes: per body (ops) / executed with known trip counts"]
    lines.append(f"{'program':<8} " + " ".join(f"{k:>26}" for k in COLLECTIVE_KINDS))
    for name, p in progs.items():
        cells = []
        for k in COLLECTIVE_KINDS:
            c = p["collectives"][k]
            cells.append(f"{c['bytes'] / cs:.3f} ({c['ops']}) / {c['bytes_executed'] / cs:.3f}".rjust(26))
        lines.append(f"{name:<8} " + " ".join(cells))
    lines += ["", f"largest collective results ({cu} each, x times per call; source function or op name):"]
    for name, p in progs.items():
        for c in p.get("largest_collectives", [])[:3]:
            source = c["function"] or c["op_name"][-60:]
            lines.append(f"  {name:<8} {c['kind']:<18} {c['bytes'] / cs:9.3f} x{c['times']:<5} "
                         f"{c['shape'][:48]:<48} {source}")
    lines += ["", f"largest transaction program: {report['largest_program']} {report['largest_total_bytes'] / 1e9:.3f} "
                  f"GB vs HBM {report['hbm_bytes'] / 1e9:.1f} GB -> {'fits' if report['fits'] else 'DOES NOT FIT'}"]
    for issue in report.get("issues", []):
        lines.append(f"issue: {issue}")
    return "\n".join(lines)
