"""Config help: comments read from a config function's source, and the listing built from them."""

from glm52_jax import config_help, run_defaults
from glm52_jax.run_config import flatten

SOURCE = '''
def get_config():
    c = ml_collections.ConfigDict()
    c.seed = 0  # the seed
    c.train = ml_collections.ConfigDict()  # training settings
    # How many steps: first line,
    # second line.
    c.train.steps = 1
    # Above and inline are joined:
    c.train.lr = (  # a number
        1e-4)  # a later line of the statement is not read
    c.train.bare = "x"

    c.train.after_blank = 2
    x = 3  # not a key


def other():
    c.train.ignored = 1  # another function
'''


def test_key_comments_from_source():
    assert config_help.key_comments(SOURCE) == {
        "seed": "the seed", "train": "training settings", "train.steps": "How many steps: first line, second line.",
        "train.lr": "Above and inline are joined: a number", "train.bare": "", "train.after_blank": ""}


def test_format_help_marks_changed_values_and_missing_comments():
    defaults = {"seed": 0, "train": {"steps": 1, "lr": 1e-4, "bare": "x", "after_blank": 2}}
    config = {"seed": 0, "train": {"steps": 5, "lr": 1e-4, "bare": "x", "after_blank": 2}}
    lines = config_help.format_help(config, defaults, config_help.key_comments(SOURCE)).splitlines()
    assert lines[2:] == ["", "seed = 0", "    the seed", "", "[train]  training settings",
                         "train.steps = 5  (default 1)", "    How many steps: first line, second line.",
                         "train.lr = 0.0001", "    Above and inline are joined: a number", "train.bare = 'x'",
                         "    (no comment in run_defaults.py)", "train.after_blank = 2",
                         "    (no comment in run_defaults.py)"]


def test_every_run_default_has_a_comment():
    comments = config_help.key_comments()
    missing = [k for k in flatten(run_defaults.get_config().to_dict()) if not comments.get(k)]
    assert not missing, f"keys of run_defaults.get_config() without a comment: {missing}"
    assert comments["train.steps"].startswith("transactions; each commits a receipt")
    assert comments["reward.boxed_fallback"].startswith("True: verl >= 0.9.1's rule")
