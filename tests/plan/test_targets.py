"""Plan targets (`glm52_jax.plan.targets`): topology, budget, modeled time and the config error (pure Python)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from glm52_jax import choices
from glm52_jax.plan import targets
from glm52_jax.run_config import ConfigError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("devices, topology", [(32, "4x1x8"), (16, "2x1x8"), (8, "1x1x8"), (4, "1x1x4"), (1, "1x1x1")])
def test_topology_for(devices, topology):
    assert targets.topology_for(devices) == topology


def test_topology_for_a_partial_host_is_an_error():
    with pytest.raises(ValueError, match=r"12 GPUs .* pass topology='HOSTSx1xGPUS'"):
        targets.topology_for(12)


def test_memory_fraction_is_the_launchers():
    """The budget's fraction is the one the launcher sets (and launch/run_node.sh exports) by default."""
    script = (ROOT / "launch" / "run_node.sh").read_text()
    default = re.search(r'XLA_PYTHON_CLIENT_MEM_FRACTION="\$\{XLA_PYTHON_CLIENT_MEM_FRACTION:-([0-9.]+)\}"', script)
    assert default and float(default.group(1)) == targets.LAUNCHER_MEM_FRACTION


def test_the_launcher_sets_the_memory_fraction_it_plans_with(tmp_path):
    """`python -m glm52_jax.launch` itself (not only run_node.sh) sets XLA_PYTHON_CLIENT_MEM_FRACTION before JAX
    starts (JAX's default preallocation is 75%); a value the user set is kept."""
    code = ("import os, sys; sys.argv = ['launch', '--mode=forward', '--seq_len=2', '--config.model.preset=tiny'];"
            "import glm52_jax.launch as L; from absl import app\n"
            "def fake(spec): print('FRACTION', os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION']); return {}\n"
            "L._forward = fake\napp.run(L.main, flags_parser=L._parse_flags)")
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert f"FRACTION {targets.LAUNCHER_MEM_FRACTION}" in run.stdout, run.stderr[-1500:]
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**env, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"})
    assert "FRACTION 0.5" in run.stdout, run.stderr[-1500:]


def test_a_bad_efficiency_table_is_a_config_error(tmp_path):
    (tmp_path / "t.json").write_text("{}")
    with pytest.raises(ConfigError, match=r'--config.plan.efficiency_table=.*t.json: .*"format": 1'):
        targets.check_efficiency_table(str(tmp_path / "t.json"), "h20")
    targets.check_efficiency_table("", "h20")  # the packaged table
    targets.check_efficiency_table(str(tmp_path / "t.json"), "cpu")  # the CPU plan estimates no time


def test_budget():
    assert targets.budget_bytes("h20", 96e9, 1000) == 1000 * targets.LAUNCHER_MEM_FRACTION
    assert targets.budget_bytes("cpu", 96e9, None) == 96e9


def test_targets_are_the_configs_choices():
    assert targets.TARGETS == choices.PLAN_TARGETS == ("cpu", "h20", "h200")
    assert set(targets.GPU_TARGETS) == {"h20", "h200"}


def test_missing_plugin_message_names_the_fixes():
    message = targets.unavailable_message("h20", "jax-cuda12-plugin is not installed (pip install -e '.[gpu-aot]')")
    assert "\n" not in message and message.startswith("--config.plan.target=h20: ")
    assert "pip install -e '.[gpu-aot]'" in message and "--config.plan.target=cpu" in message
    assert targets.unavailable_message("cpu", "anything") is None  # the CPU plan needs no plugin
    assert targets.unavailable_message("h200", None) is None


def test_check_target():
    targets.check_target("cpu")
    with pytest.raises(ConfigError, match=r"--config.plan.target=tpu: must be one of cpu, h20, h200"):
        targets.check_target("tpu")


def test_a_gpu_target_on_the_light_install_is_the_one_line_hint():
    """On `pip install -e .` neither `jax_plugins` nor `nvidia` exists: finding their submodules raises
    ModuleNotFoundError, which must become the hint, not a traceback. Run where both are hidden."""
    hide = ("import sys, importlib.abc\n"
            "class Hide(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('jax_plugins', 'nvidia'):\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
            "sys.meta_path.insert(0, Hide())\n"
            "from glm52_jax.kernels import aot\n"
            "from glm52_jax.plan import targets\n"
            "from glm52_jax.run_config import ConfigError\n"
            "assert not aot.installed('jax_plugins.xla_cuda12')\n"
            "try:\n"
            "    targets.check_target('h20')\n"
            "except ConfigError as e:\n"
            "    print(e)\n")
    done = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, check=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert done.stdout.strip() == targets.unavailable_message(
        "h20", "jax-cuda12-plugin is not installed (pip install -e '.[gpu-aot]')"), done.stderr
