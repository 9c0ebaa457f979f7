"""The policy a run trains (`rl/policy.py`): fresh adapters, or those of `model.init_adapter` (a PEFT adapter
directory as --mode=export writes it), checked in `resolve` before any model is built."""

from __future__ import annotations

import dataclasses
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm52_jax.checkpoint.peft import save_peft_adapter
from glm52_jax.model.lora import LoRA
from glm52_jax.model.transformer import GlmMoeDsa
from glm52_jax.rl import settings
from glm52_jax.rl.inputs import resolve
from glm52_jax.rl.policy import build_policy
from glm52_jax.run_config import ConfigError
from tests.run_helpers import config_spec


def _lora(model) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, LoRA))}


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """(adapter directory, its LoRA arrays): random A and B on the abstract embedded policy (save_peft_adapter
    reads only the adapters, so the base stays abstract and nothing is compiled)."""
    spec = config_spec("tiny")
    opts = dataclasses.replace(settings.model_options(spec.model), lora=settings.lora_config(spec.model))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: GlmMoeDsa(resolve(spec, data=False).model_cfg, opts,
                                                                 rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(3)
    flat = [(p, v.replace(jnp.asarray(0.05 * rng.standard_normal(v.get_value().shape), v.get_value().dtype))
             if isinstance(v, LoRA) else v) for p, v in nnx.to_flat_state(state)]
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    path = tmp_path_factory.mktemp("init") / "adapter"
    save_peft_adapter(model, path)
    return path, _lora(model)


def test_init_adapter_seeds_the_policy(adapter):
    from glm52_jax.rl.transaction import receipt_fields

    path, want = adapter
    spec = config_spec("tiny", **{"model.init_adapter": str(path)})
    inputs = resolve(spec)
    digest = hashlib.sha256((path / "adapter_model.safetensors").read_bytes()).hexdigest()
    assert inputs.init_adapter == {"path": str(path.resolve()), "sha256": digest}
    seeded, optimizer = build_policy(spec, inputs)
    got = _lora(seeded)
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    assert optimizer.step == 0
    # The adapters act: the last prompt position's logits differ from the fresh policy's (B = 0: the base).
    graphdef, lora, rest = nnx.split(seeded, LoRA, ...)
    fresh_lora = nnx.from_flat_state([(p, v.replace(jnp.zeros_like(v.get_value())) if p[-1] in ("b", "b_k", "b_v")
                                       else v) for p, v in nnx.to_flat_state(lora)])
    logits = jax.jit(lambda lora, ids: nnx.merge(graphdef, lora, rest)(ids)[0, -1])
    ids = np.asarray(inputs.first_prompts[0][-16:], np.int32)[None]
    diff = np.abs(np.asarray(logits(lora, ids)) - np.asarray(logits(fresh_lora, ids))).max()
    assert diff > 1e-3, diff
    # The receipt's model section names the adapter and its hash.
    fields = receipt_fields(inputs, seeded.cfg, step=1, cursor=0, candidates=[], samples=[], accepted=None,
                            training={}, numerics={}, cleanup={}, traces=[], probe=None, rank_paths=[])
    assert fields["model"]["init_adapter"] == {"path": str(path.resolve()), "sha256": digest}


def test_an_adapter_of_another_lora_config_fails_in_resolve(adapter):
    path, _ = adapter
    with pytest.raises(ConfigError) as info:
        resolve(config_spec("tiny", **{"model.init_adapter": str(path), "model.lora_rank": 4}))
    assert str(info.value) == f"--config.model.init_adapter={path}: {path / 'adapter_config.json'}: r is 8, the " \
                              "run's LoRA needs 4"
    with pytest.raises(ConfigError) as info:
        resolve(config_spec("tiny", **{"model.init_adapter": str(path),
                                       "model.lora_families": ("attention", "routed_experts")}))
    assert str(info.value).startswith(f"--config.model.init_adapter={path}: {path / 'adapter_config.json'}: "
                                      "target_modules has ['lm_head'] the run does not adapt")
