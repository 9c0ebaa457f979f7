"""What a run reads before it builds a model: architecture, positions, tokenizer, rows, exact-N prompts.

`resolve(spec)` does every check that needs files but no model (the checkpoint's config.json, the
YaRN payload, the position capacity, the data rows, each first-transaction candidate's exact-N
prompt, `model.init_adapter`'s config and tensor shapes), so a run that cannot work fails in seconds
with a `ConfigError` naming the setting.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from glm52_jax.run_config import ConfigError, ModelSpec, RunSpec


def rope_scaling(model: ModelSpec):
    """The position-extension payload to apply: (RopeScaling | None, where it came from).

    `model.rope_scaling_json` (a file) or `$GLM52_ROPE_SCALING_JSON`; native positions when neither
    is set. Both set to different files is ambiguous and refused.
    """
    from glm52_jax import positions

    env = os.environ.get(positions.ROPE_SCALING_ENV, "")
    path = model.rope_scaling_json
    if path and env and Path(path).resolve() != Path(env).resolve():
        raise ConfigError(f"--config.model.rope_scaling_json={path} and ${positions.ROPE_SCALING_ENV}={env} name "
                          "different payloads; set one")
    if not (path or env):
        return None, ""
    source = f"--config.model.rope_scaling_json={path}" if path else f"${positions.ROPE_SCALING_ENV}={env}"
    try:
        return positions.load_rope_scaling(path or env), source
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None


def _checkpoint_config(model: ModelSpec):
    """(ModelConfig without its quantization_config, that FP8 setting or None) of the local checkpoint's
    config.json; None when the checkpoint is not on this machine (or is `random`)."""
    from glm52_jax import config as config_lib
    from glm52_jax.checkpoint.hf_fp8 import split_quantization

    path = model.checkpoint_path
    if path is None or not (path / "config.json").is_file():
        return None
    try:
        quant, cfg = split_quantization(config_lib.ModelConfig.from_json_file(path / "config.json"))
    except ValueError as e:
        raise ConfigError(f"--config.model.checkpoint={model.checkpoint}: {e}") from None
    return cfg, quant


def base_fp8(model: ModelSpec):
    """The FP8 format of the run's base weights on device (`checkpoint.hf_fp8.Fp8Config`), or None (every weight
    in `model.dtype`): a local FP8 checkpoint's own quantization_config (it loads as stored); else, for
    `model.base_weights="fp8"`, the release's (`hf_fp8.RELEASE`: 128 x 128 blocks, weights_proj left out); else,
    for `model.expert_dtype="fp8"`, the routed experts alone in the release's blocks (`hf_fp8.EXPERTS`: the numbers
    FP8 experts multiply, quantized once as read; in half the bytes of bf16)."""
    from glm52_jax.checkpoint.hf_fp8 import EXPERTS, RELEASE

    stored = _checkpoint_config(model)
    if stored is not None and stored[1] is not None:
        return stored[1]
    if model.base_weights == "fp8":
        return RELEASE
    return EXPERTS if model.expert_dtype == "fp8" else None


def native_model_config(model: ModelSpec, *, preset_without_checkpoint: bool = False):
    """(ModelConfig with the checkpoint's native positions, where it came from).

    The checkpoint's config.json, without an FP8 checkpoint's quantization_config (how the weights are stored,
    not part of the model: `load_pretrained` returns the same config; `base_fp8` reads it); the preset for
    `checkpoint="random"`, or (plan mode, `preset_without_checkpoint`) when the checkpoint is not on this machine.
    """
    from glm52_jax import config as config_lib

    path = model.checkpoint_path
    stored = _checkpoint_config(model)
    if stored is not None:
        return stored[0], str(path)
    if path is None or preset_without_checkpoint:
        return config_lib.PRESETS[model.preset](), f"preset:{model.preset}"
    raise ConfigError(f"--config.model.checkpoint={model.checkpoint}: no config.json in {str(path)!r} "
                      "(expected an HF checkpoint directory)")


def model_config(model: ModelSpec, *, preset_without_checkpoint: bool = False):
    """(ModelConfig with the rope scaling applied, RopeScaling | None, scaling source, where the config came from)."""
    cfg, source = native_model_config(model, preset_without_checkpoint=preset_without_checkpoint)
    scaling, scaling_source = rope_scaling(model)
    if scaling is not None:
        try:
            cfg = cfg.with_rope_scaling(scaling)
        except ValueError as e:
            raise ConfigError(f"{scaling_source}: {e}") from None
    return cfg, scaling, scaling_source, source


def check_indexer(model_cfg, model: ModelSpec) -> None:
    """FP8 scoring's settings against the architecture: what `GlmMoeDsa` would refuse once built, before that."""
    from glm52_jax.model.indexer import fp8_settings_problem

    problem = fp8_settings_problem(model_cfg.index_head_dim, model_cfg.index_topk, model.indexer_dtype,
                                   model.indexer_candidates)
    if problem:
        raise ConfigError(f"--config.model.{problem}")


def check_capacity(model_cfg, spec: RunSpec, scaling_source: str) -> None:
    """Prompt + new tokens must fit the positions the model (with its rope scaling) has."""
    limit = model_cfg.max_position_embeddings
    need = spec.data.prompt_tokens + spec.sampling.max_new_tokens
    if need > limit:
        how = (f" (with the rope scaling of {scaling_source})" if scaling_source
               else " (no rope scaling: set --config.model.rope_scaling_json or GLM52_ROPE_SCALING_JSON)")
        raise ConfigError(f"--config.data.prompt_tokens={spec.data.prompt_tokens} + --config.sampling.max_new_tokens="
                          f"{spec.sampling.max_new_tokens} = {need} exceeds the position capacity "
                          f"max_position_embeddings={limit}{how}")


def chat_template_for(model: ModelSpec):
    """The chat template the run's prompts use: the one `model.tokenizer`'s directory ships, else the
    checkpoint directory's (`rollout.chat_template.find_chat_template`); None = the hand-written fallback."""
    from glm52_jax.rollout.chat_template import find_chat_template

    places = []
    if model.tokenizer:
        path = Path(model.tokenizer)
        places.append(("tokenizer", model.tokenizer, path if path.is_dir() else path.parent))
    if model.checkpoint_path is not None and model.checkpoint_path.is_dir():
        places.append(("checkpoint", model.checkpoint, model.checkpoint_path))
    for flag, value, directory in places:
        try:
            template = find_chat_template(directory)
        except ValueError as e:
            raise ConfigError(f"--config.model.{flag}={value}: {e}") from None
        if template is not None:
            return template
    return None


def tokenizer_for(model: ModelSpec):
    """`model.tokenizer` (a tokenizer.json or its directory); "" = the checkpoint's tokenizer.json when
    it ships one (a real release), else the project's tiny tokenizer (embedded policy, random init).
    Its chat template is `chat_template_for(model)` (None: the fallback layout)."""
    from glm52_jax.rollout.tokenizer import Tokenizer

    template = chat_template_for(model)
    source, path = model.tokenizer, model.checkpoint_path
    if not source and path is not None and (path / "tokenizer.json").is_file():
        source = str(path)
    if not source:
        return Tokenizer.default(chat_template=template)
    try:
        return Tokenizer(source, chat_template=template)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"--config.model.tokenizer={model.tokenizer}: {e}") from None


def source_record(path: str | os.PathLike | None, *, dedupe: bool) -> dict[str, Any]:
    """What a receipt binds of the data file a run reads (its "prompt.data" section, less the rows): the path as
    given (`dapo_data.EMBEDDED_PROBLEMS` for the shipped set), whether it is the shipped set, the sha256 of its
    bytes, and `dedupe` (with the data cursor it says which row each candidate reads). `verify --data FILE`
    re-reads it (evidence/data_check.py)."""
    from glm52_jax.dapo_data import EMBEDDED_PROBLEMS, default_problems_path
    from glm52_jax.evidence.hashing import sha256_file

    embedded = not path
    return {"path": EMBEDDED_PROBLEMS if embedded else os.fspath(path), "embedded": embedded,
            "sha256": sha256_file(default_problems_path() if embedded else path), "dedupe": dedupe}


def exact_prompt(tokenizer, row, n_tokens: int, *, flag: str | None = None) -> list[int]:
    """`build_exact_prompt` with its errors as ConfigErrors: a template's names its file, a row's the N
    (`flag`, default `--config.data.prompt_tokens=N`)."""
    from glm52_jax.rl.prompts import build_exact_prompt
    from glm52_jax.rollout.chat_template import ChatTemplateError

    try:
        return build_exact_prompt(tokenizer, row, n_tokens)
    except ChatTemplateError as e:
        raise ConfigError(str(e)) from None
    except ValueError as e:
        raise ConfigError(f"{flag or f'--config.data.prompt_tokens={n_tokens}'}: row {row.index}: {e}") from None


def init_adapter_record(spec: RunSpec, model_cfg) -> dict[str, str] | None:
    """`model.init_adapter` checked against the run's LoRA on the abstract model (a PEFT directory: rank, alpha,
    families, every tensor name and shape; a Megatron LoRA file: names, rank, shapes; `checkpoint/init_adapter.py`):
    {"path", "sha256" of the weights (adapter_model.safetensors, or the Megatron file)}, None when unset."""
    if not spec.model.init_adapter:
        return None
    from flax import nnx

    from glm52_jax.checkpoint.init_adapter import check_init_adapter
    from glm52_jax.checkpoint.peft_load import AdapterMismatchError
    from glm52_jax.evidence.hashing import sha256_file
    from glm52_jax.model.transformer import GlmMoeDsa
    from glm52_jax.rl import settings

    opts = dataclasses.replace(settings.model_options(spec.model), lora=settings.lora_config(spec.model))
    abstract = nnx.eval_shape(lambda: GlmMoeDsa(model_cfg, opts, rngs=nnx.Rngs(0)))
    try:
        weights = check_init_adapter(abstract, spec.model.init_adapter)
    except AdapterMismatchError as e:
        raise ConfigError(f"--config.model.init_adapter={spec.model.init_adapter}: {e}") from None
    return {"path": str(Path(spec.model.init_adapter).resolve()), "sha256": sha256_file(weights.resolve())}


@dataclasses.dataclass
class RunInputs:
    """What `resolve` found: the model's architecture and the candidate prompts."""

    spec: RunSpec
    model_cfg: Any  # ModelConfig, rope scaling applied
    rope_scaling: Any  # positions.RopeScaling | None
    tokenizer: Any  # rollout.tokenizer.Tokenizer
    rows: list  # every DapoRow; transaction k reads on from its data cursor
    first_prompts: list[list[int]]  # exact-N ids of the first transaction's candidates (checked)
    init_adapter: dict[str, str] | None = None  # `model.init_adapter`'s path and weights sha256 (checked)
    data: dict[str, Any] | None = None  # the data file the rows came from (`source_record`)

    @property
    def chat_template(self) -> dict[str, str] | None:
        """Which chat template renders the prompts and its sha256 (the receipt's "prompt" section)."""
        return None if self.tokenizer is None else self.tokenizer.chat_template.describe()

    @property
    def tokenizer_record(self) -> dict[str, str] | None:
        """The tokenizer.json the completions were decoded with, and its sha256 (the receipt's "prompt" section:
        `verify` detokenises the sampled tokens with it when it is on the verifying machine)."""
        from glm52_jax.evidence.hashing import sha256_file

        path = getattr(self.tokenizer, "path", None)
        return None if path is None else {"path": str(path), "sha256": sha256_file(path)}

    def data_record(self, candidates: list[dict]) -> dict[str, Any]:
        """The receipt's "prompt.data": the data file (`data`) and, per candidate tried, the row it scored: its
        0-based record position in the file ("row", as everywhere in the receipt) and its own `extra_info.index`."""
        uid = {row.index: row.uid for row in self.rows}
        return {**(self.data or {}), "rows": [{"candidate": cd["candidate"], "row": cd["row"],
                                              "extra_info_index": uid.get(cd["row"])} for cd in candidates]}

    def candidate(self, cursor: int, i: int) -> tuple[Any, list[int]]:
        """Row and exact-N prompt of candidate `i` at data position `cursor` (wrapping around the rows)."""
        if cursor == self.spec.data.first_row and i < len(self.first_prompts):
            return self.rows[(cursor + i) % len(self.rows)], self.first_prompts[i]
        row = self.rows[(cursor + i) % len(self.rows)]
        return row, exact_prompt(self.tokenizer, row, self.spec.data.prompt_tokens)


def check_weights(model: ModelSpec) -> None:
    """The checkpoint's weight files, header by header, before anything loads them (a config error naming
    the file, not a loader traceback); nothing to check for the embedded policy's or a random base."""
    from glm52_jax.checkpoint.hf_check import CheckpointFilesError, check_weight_files

    path = model.checkpoint_path
    if path is None or not Path(path).is_dir():
        return
    try:
        check_weight_files(path)
    except CheckpointFilesError as e:
        raise ConfigError(f"--config.model.checkpoint={model.checkpoint}: {e}") from None


def resolve(spec: RunSpec, *, data: bool = True) -> RunInputs:
    """Checks the files a run needs and resolves them (no model is built). `data=False`: model only."""
    from glm52_jax.dapo_data import load_rows

    model_cfg, scaling, scaling_source, _ = model_config(spec.model)
    check_capacity(model_cfg, spec, scaling_source)
    check_indexer(model_cfg, spec.model)
    check_weights(spec.model)
    if not data:
        return RunInputs(spec, model_cfg, scaling, None, [], [])
    try:
        rows = load_rows(spec.data.path or None, dedupe=spec.data.dedupe)
    except (ValueError, FileNotFoundError, ImportError) as e:  # broken rows name their file and line
        raise ConfigError(f"--config.data.path={spec.data.path}: {e}") from None
    if not rows:
        raise ConfigError(f"--config.data.path={spec.data.path}: no rows")
    data_source = source_record(spec.data.path, dedupe=spec.data.dedupe)
    tok = tokenizer_for(spec.model)
    prompts = [exact_prompt(tok, rows[(spec.data.first_row + i) % len(rows)], spec.data.prompt_tokens)
               for i in range(spec.search.max_candidates)]
    if spec.search.probe_tokens:  # the first transaction's probe: the first row's exact-N prompt
        exact_prompt(tok, rows[spec.data.first_row % len(rows)], spec.search.probe_tokens,
                     flag=f"--config.search.probe_tokens={spec.search.probe_tokens}")
    if max(max(p) for p in prompts) >= model_cfg.vocab_size:
        raise ConfigError(f"the tokenizer's ids exceed the model's vocab_size {model_cfg.vocab_size} "
                          f"(--config.model.tokenizer={spec.model.tokenizer})")
    return RunInputs(spec, model_cfg, scaling, tok, rows, prompts, init_adapter_record(spec, model_cfg), data_source)
