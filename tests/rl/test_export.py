"""What an export ships beside the merged weights so `glm52_jax.generate` runs on it: the run's tokenizer and
chat template files (the export itself is tested end to end in test_transaction.py and test_export_processes.py)."""

import shutil

from glm52_jax.rl.export import tokenizer_files
from glm52_jax.rollout.tokenizer import default_tokenizer_path
from tests.run_helpers import config_spec

TEMPLATE = "{% for m in messages %}<|user|>{{ m.content }}{% endfor %}<|assistant|>"


def test_tokenizer_files_follow_the_run(tmp_path):
    assert tokenizer_files(config_spec("tiny").model) == {"tokenizer.json": default_tokenizer_path()}
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copyfile(default_tokenizer_path(), ckpt / "tokenizer.json")
    (ckpt / "chat_template.jinja").write_text(TEMPLATE)
    (ckpt / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    from_checkpoint = config_spec("tiny", **{"model.checkpoint": str(ckpt)}).model
    assert tokenizer_files(from_checkpoint) == {"tokenizer.json": ckpt / "tokenizer.json",
                                                "chat_template.jinja": ckpt / "chat_template.jinja",
                                                "tokenizer_config.json": ckpt / "tokenizer_config.json"}
    # model.tokenizer (a file of any name) comes first, and its directory's template wins over the checkpoint's.
    own = tmp_path / "tok"
    own.mkdir()
    shutil.copyfile(default_tokenizer_path(), own / "my_tokenizer.json")
    (own / "tokenizer_config.json").write_text('{"chat_template": "' + TEMPLATE + '"}')
    spec = config_spec("tiny", **{"model.checkpoint": str(ckpt), "model.tokenizer": str(own / "my_tokenizer.json")})
    assert tokenizer_files(spec.model) == {"tokenizer.json": own / "my_tokenizer.json",
                                           "tokenizer_config.json": own / "tokenizer_config.json"}


def test_export_runs_where_the_runs_mesh_does_not_fit():
    """A run saved on 16 devices, exported by one process of 8: the adapters go to one device (an export is
    the same files on any mesh); a mesh that fits is kept."""
    from glm52_jax.rl.export import export_topology

    assert export_topology(config_spec("tiny", mesh="context=16")).mesh == ""
    assert export_topology(config_spec("tiny", mesh="context=2")).mesh == "context=2"
