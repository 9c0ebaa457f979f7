"""`resolve` picks the chat template a checkpoint (or its tokenizer directory) ships, else the fallback layout."""

import hashlib
import json
import shutil

import pytest

from glm52_jax.rl.inputs import resolve
from glm52_jax.rl.prompts import build_exact_prompt
from glm52_jax.rl.transaction import receipt_fields
from glm52_jax.rollout.chat_template import JinjaChatTemplate
from glm52_jax.rollout.tokenizer import ChatTemplate, Tokenizer, default_tokenizer_path
from glm52_jax.run_config import EMBEDDED_POLICY, ConfigError
from tests.run_helpers import config_spec

THINKING = ("{{ bos_token }}<sop>{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|><think>{% endif %}")


def _checkpoint(tmp_path, template=None):
    """A checkpoint directory as far as `resolve` reads one: config.json (+ a chat template), and the weights
    file whose header `resolve` checks (a link to the shipped policy's)."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    shutil.copy(EMBEDDED_POLICY / "config.json", directory / "config.json")
    (directory / "model.safetensors").symlink_to(EMBEDDED_POLICY / "model.safetensors")
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "[gMASK]"}))
    if template is not None:
        (directory / "chat_template.jinja").write_text(template)
    return directory


def _spec(**overrides):
    return config_spec(**{"search.max_candidates": 2, **overrides})


def test_a_checkpoint_template_renders_the_prompts_and_is_named_in_the_receipt_fields(tmp_path):
    ckpt = _checkpoint(tmp_path, THINKING)
    inputs = resolve(_spec(**{"model.checkpoint": str(ckpt)}))
    template_file = ckpt / "chat_template.jinja"
    expected = JinjaChatTemplate(THINKING, str(template_file), {"bos_token": "[gMASK]"})
    assert inputs.tokenizer.chat_template == expected
    assert inputs.chat_template == {"template": str(template_file),
                                    "sha256": hashlib.sha256(template_file.read_bytes()).hexdigest()}
    n, first = inputs.spec.data.prompt_tokens, inputs.spec.data.first_row
    tok = Tokenizer.default(chat_template=expected)
    for i, prompt in enumerate(inputs.first_prompts + [inputs.candidate(first, 5)[1]]):
        row = inputs.rows[first + (i if i < 2 else 5)]
        assert prompt == build_exact_prompt(tok, row, n) and len(prompt) == n
        assert tok.decode(prompt).endswith(row.content + "<|assistant|><think>")

    receipt = receipt_fields(inputs, inputs.model_cfg, step=1, cursor=first, candidates=[], samples=[], probe=None,
                             accepted=None, training={}, numerics={}, cleanup={}, traces=[],
                             rank_paths=[])
    assert receipt["prompt"]["chat_template"] == inputs.chat_template

    fallback = resolve(_spec())  # the embedded tiny policy ships no template
    assert fallback.chat_template == ChatTemplate().describe()
    assert fallback.chat_template["template"] == "builtin:ChatTemplate"
    assert isinstance(fallback.tokenizer.chat_template, ChatTemplate)
    assert fallback.first_prompts[0] != inputs.first_prompts[0]
    fallback_text = Tokenizer.default().decode(fallback.first_prompts[0])
    assert fallback_text.endswith(fallback.rows[first].content + "<|assistant|>")


def test_the_tokenizer_directory_template_comes_first(tmp_path):
    ckpt = _checkpoint(tmp_path, THINKING)
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    shutil.copy(default_tokenizer_path(), tok_dir / "tokenizer.json")
    own = THINKING.replace("<think>", "<think>\n")
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "[gMASK]", "chat_template": own}))
    for tokenizer in (str(tok_dir), str(tok_dir / "tokenizer.json")):
        inputs = resolve(_spec(**{"model.checkpoint": str(ckpt), "model.tokenizer": tokenizer}))
        assert inputs.tokenizer.chat_template.source == own
        assert inputs.chat_template["template"] == f"{tok_dir / 'tokenizer_config.json'} (chat_template)"


@pytest.mark.parametrize("template,match", [
    ("{% if %}", r"^--config.model.checkpoint=\S+: \S+chat_template.jinja: chat template syntax error at line 1"),
    ("{{ raise_exception('no system prompt given') }}", r"^\S+chat_template.jinja: chat template error: no system"),
])
def test_a_broken_checkpoint_template_is_a_one_line_config_error(tmp_path, template, match):
    with pytest.raises(ConfigError, match=match) as info:
        resolve(_spec(**{"model.checkpoint": str(_checkpoint(tmp_path, template))}))
    assert "\n" not in str(info.value)


def test_base_weights_format(tmp_path):
    """`base_fp8`: None for weights as stored in a float checkpoint; the release's 128 x 128 format for
    base_weights="fp8" (also on a random init); the routed experts alone for expert_dtype="fp8"; a local FP8
    checkpoint's own format whatever the key says. Its
    quantization_config is the weights' format, not the model's (the run's model config has none); a malformed
    one is a one-line config error naming the flag."""
    from glm52_jax.checkpoint.hf_fp8 import EXPERTS, RELEASE, Fp8Config
    from glm52_jax.rl.inputs import base_fp8, native_model_config

    assert base_fp8(_spec().model) is None
    assert base_fp8(_spec(**{"model.base_weights": "fp8"}).model) == RELEASE
    # FP8 experts on a float base: the routed experts alone, quantized as read (the whole release wins where asked).
    assert base_fp8(_spec(**{"model.expert_dtype": "fp8"}).model) == EXPERTS
    assert base_fp8(_spec(**{"model.expert_dtype": "fp8", "model.base_weights": "fp8"}).model) == RELEASE
    assert base_fp8(_spec(**{"model.checkpoint": "random", "model.base_weights": "fp8"}).model) == RELEASE
    ckpt = _checkpoint(tmp_path)
    raw = json.loads((ckpt / "config.json").read_text())
    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [64, 32], "modules_to_not_convert": ["o_proj"]}
    (ckpt / "config.json").write_text(json.dumps({**raw, "quantization_config": quant}))
    for key in ("stored", "fp8"):
        model = _spec(**{"model.checkpoint": str(ckpt), "model.base_weights": key}).model
        assert base_fp8(model) == Fp8Config((64, 32), ("o_proj",))
        cfg, _ = native_model_config(model)
        assert "quantization_config" not in dict(cfg.extra) and cfg == native_model_config(_spec().model)[0]
    (ckpt / "config.json").write_text(json.dumps({**raw, "quantization_config": {**quant, "fmt": "e5m2"}}))
    with pytest.raises(ConfigError) as info:
        resolve(_spec(**{"model.checkpoint": str(ckpt)}), data=False)
    assert str(info.value) == (f"--config.model.checkpoint={ckpt}: config.json quantization_config.fmt: only 'e4m3' "
                               "is supported, got 'e5m2'")
