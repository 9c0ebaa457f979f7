"""Checkpoint chat templates: rendered (text and ids) as transformers' `apply_chat_template` renders them,
loaded as HF loads them, exact-N prompts built on top of them, one-line errors naming the file."""

import hashlib
import json
import shutil

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from glm52_jax.dapo_data import load_rows
from glm52_jax.rl.prompts import QUESTION_SEPARATOR, filler_block, filler_lines, layout_exact_prompt, min_prompt_tokens
from glm52_jax.rollout.chat_template import ChatTemplateError, JinjaChatTemplate, find_chat_template
from glm52_jax.rollout.tokenizer import ChatTemplate, Tokenizer, default_tokenizer_path

GMASK, EOS, SOP, SYSTEM, USER, ASSISTANT = 0, 1, 2, 3, 4, 5
SPECIAL = {"bos_token": "[gMASK]", "eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}

# ChatML-like: whole-line block tags, so trim_blocks / lstrip_blocks decide every newline.
SIMPLE = """{{ bos_token }}
{% for message in messages %}
    <|{{ message['role'] }}|>
  {% if message['content'] %}
{{ message['content'] }}
  {% endif %}
{% endfor %}
    {% if add_generation_prompt %}
<|assistant|>
    {% endif %}
"""

# GLM-style: [gMASK]<sop>, role tokens, reasoning in <think> tags, thinking switch, raise_exception.
GLM = """{{ bos_token }}<sop>
{%- for m in messages %}
    {%- if m.role == 'system' %}
<|system|>
{{ m.content }}
    {%- elif m.role == 'user' %}
<|user|>
{{ m.content }}
        {%- if enable_thinking is defined and not enable_thinking %}/nothink{% endif %}
    {%- elif m.role == 'assistant' %}
<|assistant|>
{% if m.reasoning_content %}<think>{{ m.reasoning_content.strip() }}</think>{% else %}<think></think>{% endif %}

{{ m.content.strip() }}
    {%- else %}
{{ raise_exception('unknown role ' + m.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|assistant|>{{ '<think></think>' if enable_thinking is defined and not enable_thinking else '<think>' }}
{%- endif %}"""

# HF's template helpers: tojson (no HTML escaping, non-ASCII kept), namespace, dict(), loop controls,
# {% generation %}; `name` is None in one message, which HF drops (so it is not "defined").
HELPERS = """{% set ns = namespace(n_user=0) %}
{% set meta = dict(first=messages[0].role) %}
{{ meta | tojson }}
{% for m in messages %}
{% if m.role == 'user' %}{% set ns.n_user = ns.n_user + 1 %}{% endif %}
{% if loop.index > 3 %}{% break %}{% endif %}
{% if m.role == 'system' %}{% continue %}{% endif %}
[{{ m.role }}{% if m.name is defined %} name={{ m.name }}{% endif %}] {{ m.content | tojson }}
{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}{% endif %}
{% endfor %}
users={{ ns.n_user }} tools={{ tools is none }} docs={{ documents is none }}
{% if add_generation_prompt %}<|assistant|>{% endif %}"""

CONVERSATIONS = {
    "user": [{"role": "user", "content": "What is 7 + 5?"}],
    "system_user": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 7 + 5?"}],
    "multi_turn": [{"role": "system", "content": "Solve <carefully> & \"exactly\": é"},
                   {"role": "user", "content": "What is 2+2? <é & \"x\">", "name": None},
                   {"role": "assistant", "content": " 4 ", "reasoning": " 2 plus 2 "},  # HF: = reasoning_content
                   {"role": "user", "content": "And 3+3?"}],
}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.default()


@pytest.fixture(scope="module")
def rows():
    return load_rows()


def _hf(template):
    return PreTrainedTokenizerFast(tokenizer_file=str(default_tokenizer_path()), chat_template=template, **SPECIAL)


def _hf_chat(hf, messages, **kwargs):
    """(text, ids) of transformers' apply_chat_template."""
    text = hf.apply_chat_template(messages, tokenize=False, **kwargs)
    return text, hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)


@pytest.mark.parametrize("template", [SIMPLE, GLM, HELPERS], ids=["simple", "glm", "helpers"])
def test_renders_text_and_ids_like_transformers(tok, template):
    ours, hf = JinjaChatTemplate(template, "test.jinja", SPECIAL), _hf(template)
    renders = set()
    for name, messages in CONVERSATIONS.items():
        for add_generation_prompt in (True, False):
            for extra in ({}, {"enable_thinking": False}):
                text, ids = _hf_chat(hf, messages, add_generation_prompt=add_generation_prompt, **extra)
                assert ours.render(messages, add_generation_prompt=add_generation_prompt, **extra) == text, name
                assert tok.encode(text) == ids
                renders.add(text)
    assert len(renders) >= 6  # conversations and generation prompts do change the text


def test_glm_template_layout(tok):
    """The GLM-style template's text, so the comparison above compares something with thinking tags in it."""
    ours = JinjaChatTemplate(GLM, "glm.jinja", SPECIAL)
    text = ours.render(CONVERSATIONS["multi_turn"])
    assert text == ("[gMASK]<sop><|system|>\nSolve <carefully> & \"exactly\": é<|user|>\nWhat is 2+2? <é & \"x\">"
                    "<|assistant|>\n<think>2 plus 2</think>\n4<|user|>\nAnd 3+3?<|assistant|><think>")
    no_thinking = ours.render(CONVERSATIONS["user"], enable_thinking=False)
    assert no_thinking.endswith("7 + 5?/nothink<|assistant|><think></think>")
    ids = tok.encode(text)
    assert [i for i in ids if i < 7] == [GMASK, SOP, SYSTEM, USER, ASSISTANT, USER, ASSISTANT]


@pytest.mark.parametrize("template,system", [(GLM, False), (GLM, True), (SIMPLE, True)], ids=["glm", "glm_system",
                                                                                              "simple_system"])
def test_exact_n_prompt_on_a_jinja_template(tok, rows, template, system):
    """With one whole filler block the exact-N prompt is HF's rendering of one user turn holding
    filler + separator + question (text and ids); for any N it has N ids, the template's head and tail."""
    chat_tok = Tokenizer.default(chat_template=JinjaChatTemplate(template, "test.jinja", SPECIAL))
    hf, row = _hf(template), rows[5]
    earlier = [{"role": "system", "content": "You are a careful solver."}] if system else []
    messages = earlier + row.messages
    content = "".join(filler_lines(0)) + QUESTION_SEPARATOR + row.content
    hf_text, hf_ids = _hf_chat(hf, earlier + [{"role": "user", "content": content}], add_generation_prompt=True)
    n = min_prompt_tokens(chat_tok, messages) + len(filler_block(chat_tok, 0))
    p = layout_exact_prompt(chat_tok, messages, n)
    assert len(p.ids) == n and p.ids == hf_ids and tok.decode(p.ids) == hf_text
    head_text, tail_text = hf_text.split(content)
    assert p.ids[:p.n_head] == tok.encode(head_text)
    assert p.ids[p.question_start:] == tok.encode(QUESTION_SEPARATOR + row.content + tail_text)
    roles = [i for i in p.ids if i < 7]  # one user turn: the filler and question hold no role token
    assert roles == [GMASK] + ([SOP] if template == GLM else []) + ([SYSTEM] if system else []) + [USER, ASSISTANT]
    for n_other in (p.n_head + p.n_question, n - 1, 3 * n + 7):  # F = 0, mid-block, several blocks
        q = layout_exact_prompt(chat_tok, messages, n_other)
        assert len(q.ids) == n_other and q.ids[:q.n_head] == p.ids[:p.n_head]
        assert q.ids[q.question_start:] == p.ids[p.question_start:]
    if template == GLM:
        assert hf_text.endswith(row.content + "<|assistant|><think>")
        assert head_text.endswith("<|user|>\n")


def test_fallback_layout_is_unchanged_behind_the_same_interface(tok, rows):
    """The hand-written layout's prompt_parts give the old head/question split; describe() hashes its fields."""
    fallback = ChatTemplate()
    head, tail = fallback.prompt_parts(row_msgs := rows[0].messages)
    assert (head, tail) == ("[gMASK]<sop><|user|>\n", "<|assistant|>")
    assert fallback.render(row_msgs) == head + rows[0].content + tail
    assert fallback.describe()["template"] == "builtin:ChatTemplate"
    assert fallback.describe() == ChatTemplate().describe() != ChatTemplate.glm5().describe()
    assert Tokenizer.default().chat_template.describe() == fallback.describe()


def _tokenizer_dir(tmp_path, config=None, jinja=None):
    shutil.copy(default_tokenizer_path(), tmp_path / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **(config or {})}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return tmp_path


@pytest.mark.parametrize("where", ["jinja_file", "config_string", "config_named_list"])
def test_loads_the_template_hf_loads(tmp_path, where):
    tokens = {"bos_token": {"content": "[gMASK]", "__type": "AddedToken", "special": True},
              "eos_token": "<|endoftext|>"}
    decoy = "{{ raise_exception('not this one') }}"
    config, jinja = dict(tokens), None
    if where == "jinja_file":  # the .jinja file wins over tokenizer_config.json's template
        config["chat_template"], jinja = decoy, GLM
    elif where == "config_string":
        config["chat_template"] = GLM
    else:
        config["chat_template"] = [{"name": "tool_use", "template": decoy}, {"name": "default", "template": GLM}]
    directory = _tokenizer_dir(tmp_path, config, jinja)
    ours = find_chat_template(directory)
    hf = AutoTokenizer.from_pretrained(directory)
    assert ours.special_tokens == {"bos_token": "[gMASK]", "eos_token": "<|endoftext|>"}
    for messages in CONVERSATIONS.values():
        assert ours.render(messages) == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.sha256 == hashlib.sha256(GLM.encode()).hexdigest()
    assert ours.describe() == {"template": ours.origin, "sha256": ours.sha256}
    assert ours.origin.startswith(str(directory / ("chat_template.jinja" if jinja else "tokenizer_config.json")))


def test_no_template_is_none(tmp_path):
    assert find_chat_template(tmp_path) is None  # empty directory
    assert find_chat_template(_tokenizer_dir(tmp_path, {"bos_token": "[gMASK]"})) is None


def _one_line_error(fn, *match):
    with pytest.raises(ChatTemplateError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message and all(m in message for m in match), message
    return message


def test_broken_templates_give_one_line_errors_naming_the_file(tmp_path):
    jinja = tmp_path / "chat_template.jinja"
    jinja.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    _one_line_error(lambda: find_chat_template(tmp_path), str(jinja), "syntax error at line 2")
    jinja.write_text(GLM)
    bad_role = [{"role": "tool", "content": "x"}]
    _one_line_error(lambda: find_chat_template(tmp_path).render(bad_role), str(jinja), "unknown role tool")
    jinja.unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "a", "template": "x"}]}))
    _one_line_error(lambda: find_chat_template(tmp_path), "tokenizer_config.json", "without a 'default'", "['a']")
    # a template that drops or rewrites the user content cannot carry an exact-N filler
    drops = JinjaChatTemplate("{% for m in messages %}<|{{ m.role }}|>{% endfor %}", "drops.jinja")
    _one_line_error(lambda: drops.prompt_parts(CONVERSATIONS["user"]), "drops.jinja", "0 times")
    rewrites = JinjaChatTemplate("{% for m in messages %}{{ m.content | replace('7', 'seven') }}{% endfor %}",
                                 "rewrites.jinja")
    _one_line_error(lambda: rewrites.prompt_parts(CONVERSATIONS["user"]), "rewrites.jinja", "verbatim")
    sandbox = JinjaChatTemplate("{% set ns = namespace(_x=1) %}", "sandbox.jinja")
    _one_line_error(lambda: sandbox.render(CONVERSATIONS["user"]), "sandbox.jinja", "underscore")
