"""`python -m glm52_jax.generate` as a real subprocess on a saved random tiny model."""

import json
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import glm52_jax
from glm52_jax.rollout.tokenizer import Tokenizer, default_tokenizer_path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen") / "tiny"
    cfg = glm52_jax.tiny(num_hidden_layers=2, indexer_types=("full", "shared"))
    # rbg keys: their random draws compile fast on XLA:CPU (eager init compiles every op once).
    rngs = nnx.Rngs(jax.random.key(0, impl="rbg"))
    glm52_jax.save_pretrained(glm52_jax.GlmMoeDsa(cfg, glm52_jax.ModelOptions(param_dtype=jnp.float32), rngs=rngs),
                              path)
    shutil.copy(default_tokenizer_path(), path / "tokenizer.json")
    return path


def _run(*args):
    return subprocess.run([sys.executable, "-m", "glm52_jax.generate", *args], capture_output=True, text=True,
                          timeout=300)


def test_text_prompt_two_samples(ckpt, tmp_path):
    """--chat renders with the template the tokenizer's directory ships (not the hand-written layout)."""
    shutil.copy(default_tokenizer_path(), tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text(
        "[gMASK]<sop>{% for m in messages %}<|{{ m.role }}|>QUESTION: {{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    res = _run(f"--checkpoint={ckpt}", f"--tokenizer={tmp_path / 'tokenizer.json'}", "--prompt=What is 2 + 2?",
               "--chat", "--max_new_tokens=5", "--num_samples=2", "--seed=3", "--stop_ids=")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    text = "[gMASK]<sop><|user|>QUESTION: What is 2 + 2?<|assistant|>"
    rendered = Tokenizer(tmp_path / "tokenizer.json").encode(text)
    assert out["prompt_tokens"] == len(rendered)
    assert len(out["samples"]) == 2
    for s in out["samples"]:
        assert len(s["tokens"]) == 5 == len(s["logprobs"]) and s["finish_reason"] == "length"
        assert isinstance(s["text"], str) and all(lp < 0 for lp in s["logprobs"])


def test_prompt_ids_greedy_is_deterministic(ckpt):
    args = (f"--checkpoint={ckpt}", "--prompt_ids=7,8,9,10", "--max_new_tokens=4", "--temperature=0")
    a, b = _run(*args), _run(*args)
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout.splitlines()[-1])["samples"] == json.loads(b.stdout.splitlines()[-1])["samples"]


def test_bad_input_exits_with_message(ckpt):
    res = _run(f"--checkpoint={ckpt}", "--prompt_ids=1,2", "--top_p=1.5")
    assert res.returncode == 2 and "top_p must be in (0, 1]" in res.stderr
    res = _run(f"--checkpoint={ckpt}", "--prompt_ids=1,x")
    assert res.returncode != 0 and "comma-separated integers" in res.stderr


def test_the_shipped_policy_needs_no_tokenizer_flag(ckpt):
    """`--checkpoint glm52_jax/assets/tiny_policy` (which ships no tokenizer.json): the package's tokenizer,
    as a run with it uses; another checkpoint's own tokenizer.json stays the default."""
    from glm52_jax.generate import _default_tokenizer
    from glm52_jax.run_config import EMBEDDED_POLICY

    assert not (EMBEDDED_POLICY / "tokenizer.json").exists()
    assert _default_tokenizer("glm52_jax/assets/tiny_policy") == str(default_tokenizer_path())
    assert _default_tokenizer(str(ckpt)) == str(ckpt / "tokenizer.json")


@pytest.mark.slow  # ~12 s on a quiet machine: a subprocess loads and compiles the sampler
def test_non_finite_weights_are_an_error_not_invalid_json(ckpt, tmp_path):
    """A NaN in one weight: one error line naming the checkpoint, exit 1, no JSON with a bare NaN."""
    from safetensors.numpy import load_file, save_file

    broken = tmp_path / "nan"
    shutil.copytree(ckpt, broken)
    [shard] = broken.glob("*.safetensors")
    tensors = load_file(shard)
    name = next(k for k in tensors if k.endswith("q_b_proj.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    res = _run(f"--checkpoint={broken}", "--prompt_ids=7,8", "--max_new_tokens=1")
    assert res.returncode == 1 and res.stdout == "", res.stdout
    assert res.stderr.strip().splitlines()[-1] == (f"error: sample 0 has non-finite log-probs (the checkpoint {broken} "
                                                   "holds non-finite weights, or the dtype overflows)")
