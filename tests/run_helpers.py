"""Run specs and README commands for the launcher tests."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from glm52_jax import run_defaults
from glm52_jax.run_config import RunSpec

ROOT = Path(__file__).resolve().parents[1]


def load_config(name: str):
    """The ConfigDict of configs/<name>.py, as `--config=configs/<name>.py` loads it."""
    return run_defaults.from_file(ROOT / "configs" / f"{name}.py")


def config_spec(config: str = "tiny", /, **dotted) -> RunSpec:
    """The validated spec of configs/<name>.py with `{"train.steps": 2, ...}` changed."""
    return RunSpec.from_dict(load_config(config).to_dict()).replace(**dotted)


def readme_commands(heading: str) -> list[list[str]]:
    """The `python -m glm52_jax...` commands of the first code block under README heading `heading`
    (backslash continuations joined, trailing `# comments` dropped), as argv lists."""
    text = (ROOT / "README.md").read_text()
    section = text.split(f"\n{heading}\n", 1)[1]
    block = section.split("```", 2)[1]
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line.startswith("python -m glm52_jax"):
            commands.append(shlex.split(line))
    return commands
