"""Plan targets (`glm52_jax.plan.targets`): topology, budget, modeled time and the config error (pure Python)."""

import re
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
    """The budget's fraction is the one launch/run_node.sh exports by default."""
    script = (ROOT / "launch" / "run_node.sh").read_text()
    default = re.search(r'XLA_PYTHON_CLIENT_MEM_FRACTION="\$\{XLA_PYTHON_CLIENT_MEM_FRACTION:-([0-9.]+)\}"', script)
    assert default and float(default.group(1)) == targets.LAUNCHER_MEM_FRACTION


def test_budget():
    assert targets.budget_bytes("h20", 96e9, 1000) == 1000 * targets.LAUNCHER_MEM_FRACTION
    assert targets.budget_bytes("cpu", 96e9, None) == 96e9


def test_modeled_time_is_max_of_compute_and_memory_plus_communication():
    speeds = targets.SPEEDS["h20"]
    entry = {"flops": {"flops_executed": 296e12},  # 2 s at 148 TFLOP/s
             "traffic": {"memory_bytes_executed": 12e12,  # 3 s at 4 TB/s
                         "collective_bytes_executed_within_host": 45e9,  # 0.1 s at 450 GB/s
                         "collective_bytes_executed_across_hosts": 50e9}}  # 2 s at 25 GB/s per GPU
    t = targets.modeled_time(entry, speeds)
    assert t == pytest.approx({"compute_s": 2.0, "memory_s": 3.0, "communication_s": 2.1, "modeled_s": 5.1})
    entry["flops"]["flops_executed"] = 1480e12  # 10 s: compute-bound now
    assert targets.modeled_time(entry, speeds)["modeled_s"] == pytest.approx(12.1)
    # Each collective executed also pays a fixed latency by link (10 / 30 us assumed).
    entry["traffic"].update(collectives_executed_within_host=1000, collectives_executed_across_hosts=1000)
    assert targets.modeled_time(entry, speeds)["communication_s"] == pytest.approx(2.1 + 0.01 + 0.03)
    # The DSA indexer's analytic FLOPs (data-dependent loops the HLO counts once) are compute too.
    entry["flops"]["indexer_flops_analytic"] = 296e12  # +2 s
    assert targets.modeled_time(entry, speeds)["compute_s"] == pytest.approx(12.0)


def test_targets_are_the_configs_choices():
    assert targets.TARGETS == choices.PLAN_TARGETS == ("cpu", "h20", "h200")
    assert set(targets.SPEEDS) == set(targets.GPU_TARGETS) == {"h20", "h200"}


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
