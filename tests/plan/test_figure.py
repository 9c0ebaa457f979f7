"""Plan mode's picture (plan/figure.py): bars that hold the report's bytes, a real PNG, and without matplotlib a
line saying how to get it while plan.json is still written (launch.save_plan)."""

import json
import sys
from pathlib import Path

import pytest

from glm52_jax.launch import save_plan
from glm52_jax.plan import figure

ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def h20_report():
    """The committed 2M plan on 32 H20s (a real report: every key plan mode writes)."""
    return json.loads((ROOT / "benchmarks" / "results" / "plan_2m_h20.json").read_text())


def small_report(total_over_budget: bool = False) -> dict:
    """A report as an older plan wrote it: no model section to split the arguments by, no target record."""
    memory = {"argument_bytes": 6_000_000, "output_bytes": 500_000, "temp_bytes": 2_500_000, "alias_bytes": 400_000}
    memory["total_bytes"] = (memory["argument_bytes"] + memory["output_bytes"] + memory["temp_bytes"]
                             - memory["alias_bytes"])
    return {"mesh": {"describe": "DP1/TP1/CP2/EP2/PP1", "devices": 4}, "hbm_bytes": 5e6 if total_over_budget else 16e6,
            "fits": not total_over_budget, "programs": {"decode": {"memory": memory}}}


def test_h20_plan_bars_hold_the_reports_bytes(h20_report, tmp_path):
    out = tmp_path / "plan.png"
    drawn = figure.write(h20_report, out)
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000
    names = list(h20_report["programs"])
    assert [t.get_text() for t in drawn.axes.get_yticklabels()] == names
    assert list(drawn.bars) == ["weights", "cache_inputs", "temporaries", "outputs"]
    model = h20_report["model"]
    weights = model["param_bytes_per_device"] + model["lora_bytes_per_device"]
    for row, name in enumerate(names):
        mem = h20_report["programs"][name]["memory"]
        expected = {"weights": weights, "cache_inputs": mem["argument_bytes"] - weights,
                    "temporaries": mem["temp_bytes"], "outputs": mem["output_bytes"] - mem["alias_bytes"]}
        assert {c: bars.patches[row].get_width() for c, bars in drawn.bars.items()} == expected, name
        lefts = [bars.patches[row].get_x() for bars in drawn.bars.values()]
        assert lefts == [0, weights, mem["argument_bytes"], mem["argument_bytes"] + mem["temp_bytes"]], name
        last = drawn.bars["outputs"].patches[row]
        assert last.get_x() + last.get_width() == mem["total_bytes"], name  # the stack ends at the total
    # The inventory's only argument is the model state: the weights segment is all of it.
    assert drawn.bars["cache_inputs"].patches[names.index("inventory")].get_width() == 0
    # The response_only train step holds the batch-1 prompt cache and the AdamW moments (2 per LoRA value) besides.
    train_extra = drawn.bars["cache_inputs"].patches[names.index("train")].get_width()
    assert train_extra >= h20_report["cache"]["batch1_bytes_per_device"] + 2 * model["lora_bytes_per_device"]
    target = h20_report["target"]
    assert list(drawn.lines["budget"].get_xdata()) == [target["budget_bytes"]] * 2
    assert list(drawn.lines["device"].get_xdata()) == [target["device_memory_bytes"]] * 2
    title = drawn.axes.get_title()
    assert "target h20, topology 4x1x8" in title and "DP1/TP1/CP32/EP32/PP1" in title and "(fits)" in title


def test_report_without_model_section_draws_one_arguments_segment():
    report = small_report(total_over_budget=True)
    drawn = figure.draw(report)
    mem = report["programs"]["decode"]["memory"]
    assert {c: b.patches[0].get_width() for c, b in drawn.bars.items()} == {
        "arguments": mem["argument_bytes"], "temporaries": mem["temp_bytes"],
        "outputs": mem["output_bytes"] - mem["alias_bytes"]}
    assert set(drawn.lines) == {"budget"} and list(drawn.lines["budget"].get_xdata()) == [5e6] * 2
    assert [t.get_text() for t in drawn.axes.texts] == ["  8.6 MB; OVER budget by 3.6 MB"]
    assert "DOES NOT FIT" in drawn.axes.get_title()


def test_a_budget_far_beyond_the_bars_is_named_but_left_off_the_axis():
    """A small plan against a large device (the tiny model's CPU plan against 96 GiB): the bars keep the axis."""
    report = small_report()
    report["hbm_bytes"] = 1e9
    drawn = figure.draw(report)
    total = report["programs"]["decode"]["memory"]["total_bytes"]
    assert drawn.axes.get_xlim()[1] == 1.25 * total < 1e9
    assert drawn.lines["budget"].get_label() == "budget 1.0 GB (beyond the axis)"
    assert [t.get_text() for t in drawn.axes.texts] == ["  8.6 MB; 991.4 MB to budget"]


def test_cli_draws_a_saved_plan_json(tmp_path):
    source = tmp_path / "plan.json"
    source.write_text(json.dumps(small_report()))
    assert figure.main([str(source)]) == 0
    assert (tmp_path / "plan_memory.png").read_bytes().startswith(PNG_SIGNATURE)
    assert figure.main([]) == 2


@pytest.mark.parametrize("have_matplotlib", [True, False])
def test_save_plan_draws_or_logs_how_to_get_matplotlib(tmp_path, monkeypatch, have_matplotlib):
    if not have_matplotlib:
        monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ModuleNotFoundError
    report, workdir, logged = small_report(), tmp_path / "plan", []
    save_plan(report, workdir, logged.append)
    assert json.loads((workdir / "plan.json").read_text()) == report
    picture = workdir / "plan_memory.png"
    if have_matplotlib:
        assert logged == [f"plan: memory per program drawn in {picture}"]
        assert picture.read_bytes().startswith(PNG_SIGNATURE)
    else:
        assert logged == ["plan: no plan_memory.png: matplotlib is not installed (pip install -e '.[plots]')"]
        assert not picture.exists()
