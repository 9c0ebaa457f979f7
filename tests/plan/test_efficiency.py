"""The efficiency table (`glm52_jax.plan.efficiency`): the packaged one is whole and says where every number
comes from; a malformed one is refused naming the entry."""

import copy
import json

import pytest

from glm52_jax.plan import efficiency
from glm52_jax.plan.targets import GPU_TARGETS


@pytest.fixture(scope="module")
def raw():
    return json.loads(efficiency.DEFAULT_PATH.read_text())


def test_packaged_table_covers_every_gpu_target_and_class():
    table = efficiency.load_table()
    assert set(GPU_TARGETS) <= set(table.targets)
    for target in GPU_TARGETS:
        for scenario in efficiency.SCENARIOS:
            rates = table.rates(target, scenario)
            assert set(rates.fractions) == set(efficiency.CLASSES)
            assert all(f > 0 for f in rates.fractions.values())
            assert rates.ep_passes >= 1 and rates.launch_floor_s > 0


def test_measured_figures_are_the_h200_measurements(raw):
    """The committed H200 measurements (../shared/research/h200_measurements.md) are the table's measured
    entries: GEMM 618-634 TFLOP/s of 989.5, the indexer kernel 435, 143,771 MiB of memory."""
    h200 = raw["targets"]["h200"]
    peak = h200["peaks"]["bf16_flops_per_s"]["value"]
    assert h200["classes"]["gemm"]["central"] * peak == pytest.approx(618e12, rel=1e-3)
    assert h200["classes"]["gemm"]["optimistic"] * peak == pytest.approx(634e12, rel=1e-3)
    assert h200["classes"]["dsa_index_scores"]["central"] * peak == pytest.approx(435e12, rel=1e-3)
    assert h200["peaks"]["device_memory_bytes"]["value"] == 143_771 * 2**20
    measured = [(section, key) for section in ("peaks", "classes", "launch")
                for key, entry in h200[section].items() if entry["source"] == "measured"]
    assert ("classes", "gemm") in measured and ("launch", "floor_s") in measured
    for section, key in measured:
        assert h200[section][key]["provenance"]["device"].startswith("NVIDIA H200"), key


def test_the_environment_names_another_table(tmp_path, monkeypatch, raw):
    other = copy.deepcopy(raw)
    other["version"] = "calibrated-test"
    path = tmp_path / "table.json"
    path.write_text(json.dumps(other))
    monkeypatch.setenv(efficiency.PATH_ENV, str(path))
    assert efficiency.load_table().version == "calibrated-test"
    assert efficiency.load_table(efficiency.DEFAULT_PATH).version == raw["version"]


@pytest.mark.parametrize("edit, message", [
    (lambda t: t["targets"]["h200"]["classes"].pop("gemm"), r"targets\.h200\.classes\.gemm: missing"),
    (lambda t: t["targets"]["h20"]["classes"]["sort"].update(central=-1),
     r"targets\.h20\.classes\.sort\.central: expected a number >= 0"),
    (lambda t: t["targets"]["h200"]["classes"]["gemm"].pop("provenance"),
     r"classes\.gemm: a measured entry needs provenance"),
    (lambda t: t["targets"]["h200"]["classes"]["memory"].update(source="guessed"), r"'source' must be one of"),
    (lambda t: t["targets"]["h200"]["classes"]["memory"].update(central=0.99), r"central must lie between"),
    (lambda t: t["targets"]["h200"]["ep_passes"].update(central=1.5), r"ep_passes: pass counts must be whole"),
    (lambda t: t.update(format=2), r'expected an object with "format": 1'),
])
def test_malformed_tables_are_refused_naming_the_entry(raw, tmp_path, edit, message):
    bad = copy.deepcopy(raw)
    edit(bad)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(efficiency.TableError, match=message):
        efficiency.load_table(path)


def test_unreadable_tables_are_one_line(tmp_path):
    with pytest.raises(efficiency.TableError, match="no such file"):
        efficiency.load_table(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(efficiency.TableError, match="not valid JSON"):
        efficiency.load_table(tmp_path / "broken.json")
    with pytest.raises(ValueError, match="no target 'h100'"):
        efficiency.load_table().rates("h100")
