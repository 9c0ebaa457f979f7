"""The run's settings as one frozen, typed spec, validated once (imports no JAX).

launch.py turns the ml_collections ConfigDict (a config file plus `--config.a.b=v` flags) into a
`RunSpec` with `RunSpec.from_dict`; train, parity, export and plan take the spec, never the
ConfigDict. Every field is checked when the spec is built, and a bad value raises `ConfigError`
naming the flag that sets it (`--config.train.learning_rate=-1.0: must be > 0`), before anything
is loaded or compiled. The objects the settings configure (LoRA config, model options, loss
settings, optimizer, sampler) are built from the spec in `rl/settings.py`, and nowhere else; this
module imports no model code, so the packages that take a spec do not form a cycle with it.

The spec is also the run's record: `save_spec` writes WORKDIR/config.json (the resolved values and
the command line) when a run starts; a rerun, resume or export reads it back (`load_saved_spec`),
and `differences` lists what a new invocation would change.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from glm52_jax import choices

# The acceptance bound language lives beside the decision it feeds (evidence/ re-decides receipts with both).
from glm52_jax.parity_decision import PARITY_METRICS, Bound, parse_bound  # noqa: F401  (re-exported)

EMBEDDED_POLICY = Path(__file__).resolve().parent / "assets" / "tiny_policy"
SAVED_CONFIG = "config.json"
# Keys a rerun on an existing workdir may change: how many transactions to run, how many checkpoints to keep,
# settings of other modes (plan, parity) that a training run does not read, and the hang watchdog's deadlines.
# Everything else is the run itself.
MAY_CHANGE = ("train.steps", "checkpoint.keep", "plan.", "parity.", "export.", "watchdog.")
# The topology may change on a rerun too (8 devices -> 32, one node -> one CPU): checkpoints restore onto
# the current mesh. Kept out of MAY_CHANGE because `resume_sha256` (in committed receipts) covers it; a resume
# compares the checkpoint's hash with the current settings on the mesh it was saved with (`on_mesh`).
TOPOLOGY = ("mesh",)


class ConfigError(ValueError):
    """A config value or run directory that cannot run; raised before any expensive work."""


def _show(value: Any) -> str:
    if isinstance(value, str):
        return value if value else "''"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(repr(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return repr(value)


def _fail(key: str, value: Any, why: str):
    raise ConfigError(f"--config.{key}={_show(value)}: {why}")


def _check(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        _fail(key, value, why)


# Rules: a value -> None when it is fine, else why not ("must be ..."). A field lists its rules with
# `_rules(...)`; a section with rules across fields adds them in `validate`.
Rule = Callable[[Any], str | None]


def at_least(low: int, note: str = "") -> Rule:
    why = f"must be >= {low}" + (f" ({note})" if note else "")
    return lambda v: None if v >= low else why


def number(low: float, *, strict_low: bool = True, high: float | None = None, strict_high: bool = False) -> Rule:
    """A finite number above `low` (and below `high`), bounds strict or not."""
    lo = f"> {low:g}" if strict_low else f">= {low:g}"
    hi = "" if high is None else f" and {'<' if strict_high else '<='} {high:g}"

    def rule(v):
        ok = math.isfinite(v) and (v > low if strict_low else v >= low)
        if high is not None:
            ok = ok and (v < high if strict_high else v <= high)
        return None if ok else f"must be {lo}{hi}"

    return rule


def one_of(allowed: Sequence[str]) -> Rule:
    return lambda v: None if v in allowed else "must be one of " + ", ".join(allowed)


def subset_of(allowed: Sequence[str]) -> Rule:
    def rule(v):
        unknown = [x for x in v if x not in allowed]
        if unknown:
            return f"unknown {unknown}; choose from " + ", ".join(allowed)
        if len(set(v)) != len(v):
            return "lists an entry twice"
        return None if v else "must not be empty"

    return rule


def _rules(*rules: Rule):
    return dataclasses.field(metadata={"rules": rules})


def _coerce(key: str, kind: str, value: Any) -> Any:
    """Checks the type a field's annotation names; ints are accepted for floats, lists for tuples."""
    if kind == "bool":
        _check(isinstance(value, bool), key, value, "must be True or False")
    elif kind == "int":
        _check(isinstance(value, int) and not isinstance(value, bool), key, value, "must be an integer")
    elif kind == "float":
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), key, value, "must be a number")
        return float(value)
    elif kind == "str":
        _check(isinstance(value, str), key, value, "must be a string")
    elif kind == "tuple[str, ...]":
        if isinstance(value, str):  # --config.x=attention: one name
            value = (value,)
        _check(isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value), key, value,
               "must be a tuple of strings, e.g. \"('a', 'b')\"")
        return tuple(value)
    else:
        raise AssertionError(f"no coercion for {kind!r}")
    return value


class _Section:
    """A frozen group of settings (`model`, `train`, ...) built from a mapping with exactly its keys."""

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], prefix: str):
        _exact_keys(values, [f.name for f in dataclasses.fields(cls)], prefix)
        checked = {}
        for f in dataclasses.fields(cls):
            key = prefix + f.name
            checked[f.name] = value = _coerce(key, f.type, values[f.name])
            for rule in f.metadata.get("rules", ()):
                why = rule(value)
                if why is not None:
                    _fail(key, value, why)
        section = cls(**checked)
        section.validate(prefix)
        return section

    def validate(self, prefix: str) -> None:
        """Rules across fields (none by default)."""


def _exact_keys(values: Mapping[str, Any], known: Sequence[str], prefix: str) -> None:
    """Unknown keys (with a did-you-mean) and missing keys are errors: every key is explicit."""
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else f"; known: {', '.join(known)}"
            raise ConfigError(f"unknown config key {prefix}{key}{hint}")
    missing = [k for k in known if k not in values]
    if missing:
        raise ConfigError(f"config lacks key(s) {', '.join(prefix + k for k in missing)}; configs start from "
                          "glm52_jax/run_defaults.py, which has every key")


_CHECKPOINT = "must be 'embedded', 'random' or a checkpoint directory"


@dataclasses.dataclass(frozen=True)
class ModelSpec(_Section):
    checkpoint: str = _rules(lambda v: None if v else _CHECKPOINT)
    preset: str = _rules(one_of(choices.PRESETS))
    dtype: str = _rules(one_of(choices.DTYPES))
    base_weights: str = _rules(one_of(choices.BASE_WEIGHTS))
    rope_scaling_json: str = _rules()
    tokenizer: str = _rules()
    kernels: str = _rules(one_of(choices.KERNELS))
    moe_transport: str = _rules(one_of(choices.MOE_TRANSPORTS))
    moe_token_block: int = _rules(at_least(1))
    moe_cross_host: str = _rules(one_of(choices.MOE_CROSS_HOST))
    moe_receive_capacity: float = _rules(lambda v: None if (v == 0 or v >= 1) and math.isfinite(v)
                                         else "must be 0 (the worst case) or >= 1")
    moe_exchange_windows: int = _rules(at_least(1))
    moe_node_devices: int = _rules(at_least(0, "0 = one exchange over the expert axis"))
    lora_rank: int = _rules(at_least(1))
    lora_alpha: float = _rules(number(0.0))
    lora_families: tuple[str, ...] = _rules(subset_of(choices.LORA_FAMILIES))
    init_adapter: str = _rules()
    weight_sharding: str = _rules(one_of(choices.WEIGHT_SHARDINGS))
    gather_weights_min_tokens: int = _rules(at_least(0))
    cache_dtype: str = _rules(one_of(choices.CACHE_DTYPES))
    indexer_dtype: str = _rules(one_of(choices.INDEXER_DTYPES))
    indexer_candidates: int = _rules(at_least(0))
    expert_dtype: str = _rules(one_of(choices.EXPERT_DTYPES))

    @property
    def checkpoint_path(self) -> Path | None:
        """The HF checkpoint directory; None for a seeded random init of `preset`."""
        if self.checkpoint == "random":
            return None
        return EMBEDDED_POLICY if self.checkpoint == "embedded" else Path(self.checkpoint)

    @property
    def base_name(self) -> str:
        """How receipts and checkpoints name the base model."""
        path = self.checkpoint_path
        return f"random:{self.preset}" if path is None else str(path)

    def jnp_dtype(self):
        import jax.numpy as jnp

        return jnp.dtype(self.dtype)


@dataclasses.dataclass(frozen=True)
class DataSpec(_Section):
    path: str = _rules()
    dedupe: bool = _rules()
    first_row: int = _rules(at_least(0))
    prompt_tokens: int = _rules(at_least(2))


@dataclasses.dataclass(frozen=True)
class SamplingSpec(_Section):
    num_samples: int = _rules(at_least(2, "GRPO compares samples"))
    samples_per_request: int = _rules(at_least(0, "0 = num_samples"))
    max_new_tokens: int = _rules(at_least(1))
    temperature: float = _rules(number(0.0))
    top_p: float = _rules(number(0.0, high=1.0))
    top_k: int = _rules(at_least(0, "0 = no top-k truncation"))
    chunk_size: int = _rules(at_least(1))
    prefill_mode: str = _rules(one_of(choices.PREFILL_MODES))
    prefix_cache_mib_per_device: int = _rules(at_least(0))

    def validate(self, prefix: str) -> None:
        n = self.samples_per_request
        _check(n == 0 or n >= self.num_samples, prefix + "samples_per_request", n,
               f"must be 0 (= num_samples) or >= --config.{prefix}num_samples={self.num_samples} (the group is "
               "chosen from the request's samples)")

    @property
    def per_request(self) -> int:
        """Samples each sampler request draws (the group of `num_samples` is chosen from them)."""
        return self.samples_per_request or self.num_samples


@dataclasses.dataclass(frozen=True)
class SearchSpec(_Section):
    max_candidates: int = _rules(at_least(1))
    probe_tokens: int = _rules(at_least(0, "0 = no engine probe"))


_RATIO = number(0.0, high=1.0, strict_high=True)


@dataclasses.dataclass(frozen=True)
class TrainSpec(_Section):
    steps: int = _rules(at_least(1, "transactions in the run"))
    gradient_mode: str = _rules(one_of(choices.GRADIENT_MODES))
    learning_rate: float = _rules(number(0.0))
    weight_decay: float = _rules(number(0.0, strict_low=False))
    max_grad_norm: float = _rules(number(0.0))
    clip_ratio_low: float = _rules(_RATIO)
    clip_ratio_high: float = _rules(_RATIO)
    loss_agg_mode: str = _rules(one_of(choices.LOSS_AGG_MODES))


@dataclasses.dataclass(frozen=True)
class RewardSpec(_Section):
    boxed_fallback: bool = _rules()


@dataclasses.dataclass(frozen=True)
class CheckpointSpec(_Section):
    keep: int = _rules(at_least(1, "the newest step checkpoint is what a rerun resumes from"))


@dataclasses.dataclass(frozen=True)
class ParitySpec(_Section):
    modes: tuple[str, ...] = _rules(subset_of(choices.GRADIENT_MODES))
    reference: str = _rules()
    acceptance: tuple[str, ...] = _rules()
    lora_b_std: float = _rules(number(0.0))
    outliers: int = _rules(at_least(1, "largest per-parameter differences listed"))
    torch_reference: bool = _rules()
    megatron_reference: bool = _rules()

    def validate(self, prefix: str) -> None:
        why = one_of(self.modes)(self.reference)
        if why is not None:
            _fail(prefix + "reference", self.reference, why)
        self.bounds(prefix)

    def bounds(self, prefix: str = "parity.") -> dict[str, tuple[Bound, ...]]:
        """The acceptance bounds per compared mode (every mode but the reference has one entry)."""
        key, out, seen = prefix + "acceptance", {}, set()
        for entry in self.acceptance:
            mode, colon, rest = entry.partition(":")
            mode = mode.strip()
            if not colon or mode not in choices.GRADIENT_MODES:
                _fail(key, self.acceptance, f"entry {entry!r} must start with 'MODE:', MODE one of "
                      + ", ".join(choices.GRADIENT_MODES))
            if mode in out or mode in seen:
                _fail(key, self.acceptance, f"mode {mode!r} has two entries")
            seen.add(mode)
            bounds = []
            for term in filter(None, (t.strip() for t in rest.split(","))):
                bound = parse_bound(term)
                if isinstance(bound, str):
                    _fail(key, self.acceptance, bound)
                if any((b.family, b.metric) == (bound.family, bound.metric) for b in bounds):
                    _fail(key, self.acceptance, f"{mode}: {bound.describe()} is bounded twice")
                bounds.append(bound)
            if not bounds:
                _fail(key, self.acceptance, f"{mode}: no bounds")
            if mode in self.modes and mode != self.reference:  # entries for modes not compared are not used
                out[mode] = tuple(bounds)
        missing = [m for m in self.modes if m != self.reference and m not in out]
        if missing:
            _fail(key, self.acceptance, f"no acceptance bounds for {', '.join(missing)} (add '{missing[0]}: "
                  "cosine >= ..., rel_l2 <= ...')")
        return out


@dataclasses.dataclass(frozen=True)
class PlanSpec(_Section):
    programs: tuple[str, ...] = _rules(subset_of(choices.PLAN_PROGRAMS))
    hbm_gib: float = _rules(number(0.0))
    target: str = _rules(one_of(choices.PLAN_TARGETS))
    efficiency_table: str = _rules()  # checked whole before compiling (plan.targets.check_efficiency_table)


@dataclasses.dataclass(frozen=True)
class ExportSpec(_Section):
    keep_rope_scaling: bool = _rules()
    merged_fp8: bool = _rules()


@dataclasses.dataclass(frozen=True)
class WatchdogSpec(_Section):
    phase_timeout_s: float = _rules(number(0.0, strict_low=False))
    plan_factor: float = _rules(lambda v: None if v == 0 or (v >= 1 and math.isfinite(v))
                                else "must be 0 (no plan) or >= 1 (a multiple of the plan's pessimistic time)")


_SECTIONS = {"model": ModelSpec, "data": DataSpec, "sampling": SamplingSpec, "search": SearchSpec,
             "reward": RewardSpec, "train": TrainSpec, "checkpoint": CheckpointSpec, "parity": ParitySpec,
             "plan": PlanSpec, "export": ExportSpec, "watchdog": WatchdogSpec}
# Sections added after runs were saved without them: a saved config.json that lacks one gets its defaults (they
# are all MAY_CHANGE settings, outside the resume hash, so the run stays the same run).
_ADDED_SECTIONS = ("watchdog",)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """Every setting of a run; `from_dict` validates, `to_dict` is the JSON record."""

    name: str
    seed: int
    mesh: str
    model: ModelSpec
    data: DataSpec
    sampling: SamplingSpec
    search: SearchSpec
    reward: RewardSpec
    train: TrainSpec
    checkpoint: CheckpointSpec
    parity: ParitySpec
    plan: PlanSpec
    export: ExportSpec
    watchdog: WatchdogSpec

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> RunSpec:
        """A validated spec from a nested mapping (a ConfigDict's `to_dict()` or a saved config.json)."""
        _exact_keys(values, ["name", "seed", "mesh", *_SECTIONS], "")
        top = {k: _coerce(k, kind, values[k]) for k, kind in (("name", "str"), ("seed", "int"), ("mesh", "str"))}
        _check(bool(top["name"]) and all(ch.isalnum() or ch in "._-" for ch in top["name"]), "name", top["name"],
               "must be a non-empty name of letters, digits, '.', '_' or '-' (it names run directories)")
        _check(top["seed"] >= 0, "seed", top["seed"], "must be >= 0")
        sections = {}
        for name, kind in _SECTIONS.items():
            if not isinstance(values[name], Mapping):
                raise ConfigError(f"config key {name} must be a group of settings, got {values[name]!r}")
            sections[name] = kind.from_mapping(values[name], name + ".")
        spec = cls(**top, **sections)
        mesh = spec.mesh_spec()  # a malformed mesh fails here
        if nodes := spec.model.moe_node_devices:
            experts = mesh.context if mesh.folded else mesh.expert
            _check(spec.model.moe_transport == "dense", "model.moe_node_devices", nodes,
                   f"needs --config.model.moe_transport=dense, not {spec.model.moe_transport!r} (the exchange within "
                   "a node is the fixed-capacity one); 0 = one exchange over the expert axis")
            _check(nodes >= experts or experts % nodes == 0, "model.moe_node_devices", nodes,
                   f"must divide the expert axis ({experts} devices in --config.mesh={spec.mesh!r}) or be at least "
                   "its size (one node); 0 = one exchange")
        probe, prompt = spec.search.probe_tokens, spec.data.prompt_tokens
        _check(probe < prompt, "search.probe_tokens", probe, f"must be 0 (off) or shorter than "
               f"--config.data.prompt_tokens={prompt} (the probe is a short request before the long ones)")
        return spec

    def to_dict(self) -> dict[str, Any]:
        """Nested plain values (tuples as lists): what config.json holds and the config hash covers."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def replace(self, **dotted: Any) -> RunSpec:
        """A validated copy with `{"train.steps": 3, ...}` changed."""
        values = self.to_dict()
        for key, value in dotted.items():
            *parents, leaf = key.split(".")
            node = values
            for part in parents:
                node = node[part]
            if leaf not in node:
                raise ConfigError(f"unknown config key {key}")
            node[leaf] = value
        return RunSpec.from_dict(values)

    def mesh_spec(self):
        """The configured `MeshSpec` ("" = one device; e.g. "folded=32", "context=4,expert=2")."""
        from glm52_jax.parallel.mesh import MeshSpec, parse_mesh

        if not self.mesh:
            return MeshSpec(weight_sharding=self.model.weight_sharding)
        try:
            return parse_mesh(self.mesh, self.model.weight_sharding)
        except ValueError as e:
            raise ConfigError(f"--config.mesh={self.mesh}: {e}") from None

    def config_sha256(self) -> str:
        from glm52_jax.evidence.provenance import config_hash

        return config_hash(self.to_dict())

    def resume_sha256(self) -> str:
        """Hash of the settings a resumed run must share: all but the `MAY_CHANGE` ones."""
        from glm52_jax.evidence.provenance import config_hash

        return config_hash({k: v for k, v in flatten(self.to_dict()).items() if not may_change(k)})


def checkpoint_expect(spec: RunSpec, saved_meta: Mapping[str, Any]) -> dict[str, Any]:
    """What a checkpoint's meta must hold to belong to the run `spec` describes, on whatever mesh it was
    saved on (`mesh` in its meta; a checkpoint without it was saved on `spec.mesh`, as reruns then required)."""
    saved_mesh = saved_meta.get("mesh", spec.mesh)
    on_saved = spec if saved_mesh == spec.mesh else spec.replace(mesh=saved_mesh)
    return {"config_sha256": on_saved.resume_sha256(), "base": spec.model.base_name}


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"train": {"steps": 1}}` -> `{"train.steps": 1}`."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def may_change(key: str) -> bool:
    return any(key == m or (m.endswith(".") and key.startswith(m)) for m in MAY_CHANGE)


def differences(saved: RunSpec, new: RunSpec) -> list[tuple[str, Any, Any]]:
    """(key, saved value, new value) for every setting that differs."""
    a, b = flatten(saved.to_dict()), flatten(new.to_dict())
    return [(k, a[k], b[k]) for k in a if a[k] != b[k]]


def check_rerun(saved: RunSpec, new: RunSpec, workdir: str | os.PathLike) -> None:
    """Refuses a rerun on `workdir` that changes settings other than the `MAY_CHANGE` ones."""
    fixed = [d for d in differences(saved, new) if not may_change(d[0]) and d[0] not in TOPOLOGY]
    if fixed:
        listed = "; ".join(f"{k}: saved {_show(a)}, now {_show(b)}" for k, a, b in fixed)
        free = ", ".join(m + "*" if m.endswith(".") else m for m in MAY_CHANGE + TOPOLOGY)
        raise ConfigError(f"{workdir} was run with other settings ({listed}). Only {free} may change on a "
                          "rerun; drop those flags to reuse the saved config, or use a fresh --workdir")


def save_spec(spec: RunSpec, workdir: str | os.PathLike, command: Sequence[str]) -> Path:
    """Writes WORKDIR/config.json: the resolved settings and the command line that made them."""
    from glm52_jax.evidence.atomic import atomic_write_json

    path = Path(workdir) / SAVED_CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"config": spec.to_dict(), "config_sha256": spec.config_sha256(), "command": list(command)}
    atomic_write_json(path, record, indent=1)
    return path


def load_saved_spec(workdir: str | os.PathLike) -> RunSpec | None:
    """The spec saved in `workdir` (None when it has none)."""
    path = Path(workdir) / SAVED_CONFIG
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        return RunSpec.from_dict(_with_added_sections(record["config"]))
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        # Nothing keeps a second copy (receipts record only the settings' sha256): no "restore it".
        raise ConfigError(f"{path} is not a saved run config ({type(e).__name__}: {e}) and no copy of it is kept; "
                          "use a fresh --workdir") from None
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def _with_added_sections(values: Any) -> Any:
    """A saved config (a mapping) with the `_ADDED_SECTIONS` it lacks at their defaults."""
    if not isinstance(values, Mapping) or all(k in values for k in _ADDED_SECTIONS):
        return values
    from glm52_jax import run_defaults

    defaults = run_defaults.get_config().to_dict()
    return {**{k: defaults[k] for k in _ADDED_SECTIONS}, **values}
