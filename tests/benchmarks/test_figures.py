"""benchmarks/figures.py on a small results JSON shaped as `benchmarks.run` writes it: every line holds the rows'
numbers, a row stopped by the memory cap is an x on the cap, section d's exponents label the memory curves."""

import json
import sys

import pytest

from benchmarks import figures

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _row(kind: str, length_key: str, length: int, status: str = "ok", mode: str | None = None, **numbers) -> dict:
    return {"task": {"kind": kind, length_key: length, **({"mode": mode} if mode else {})}, "status": status, **numbers}


def results() -> dict:
    """Section a (HF stopped by the cap at the longest L, rows out of order), b (two modes), d (one fit)."""
    ours = [_row("forward_ours", "seq_len", 1024, seconds=0.7, peak_rss_mib=517.0, rss_growth_mib=82.0),
            _row("forward_ours", "seq_len", 256, seconds=0.2, peak_rss_mib=491.0, rss_growth_mib=40.0)]
    hf = [_row("forward_hf", "seq_len", 256, seconds=3.2, peak_rss_mib=952.0, rss_growth_mib=32.0),
          _row("forward_hf", "seq_len", 1024, status="over cap", polled_peak_rss_mib=2100.0)]
    grad = [_row("grad", "prompt_len", p, mode=m, step_seconds=s, peak_rss_mib=r, rss_growth_mib=g)
            for p, m, s, r, g in ((512, "conventional", 1.5, 900.0, 300.0), (512, "response_only", 0.5, 700.0, 80.0),
                                  (2048, "conventional", 6.0, 1600.0, 1000.0),
                                  (2048, "response_only", 1.1, 760.0, 120.0))]
    fits = {"forward_ours": {"exponent_peak_rss_mib": 0.39, "exponent_rss_growth_mib": 0.84}}
    return {"machine": {"cpu_count": 2, "date": "2026-12-05T11:00:00", "command": "python -m benchmarks.run"},
            "settings": {"mem_cap_gib": 2.0, "max_row_seconds": 60.0, "response_len": 16, "group": 2},
            "config_summary": "vocab 4096, hidden 256", "sections": {
                "a": {"sides": {"ours": {"rows": ours}, "hf": {"rows": hf}}}, "b": {"rows": grad}, "d": {"fits": fits}}}


def _xy(line) -> list[tuple[float, float]]:
    return list(zip(line.get_xdata(), line.get_ydata()))


def test_lines_hold_the_rows_numbers(tmp_path):
    source = tmp_path / "run.json"
    source.write_text(json.dumps(results()))
    assert figures.main([str(source)]) == 0
    assert (tmp_path / "run.png").read_bytes().startswith(PNG_SIGNATURE)
    drawn = figures.write(results(), tmp_path / "again.png")
    lines = drawn.lines
    assert _xy(lines[("a", "forward_ours", "seconds")]) == [(256, 0.2), (1024, 0.7)]  # sorted by length
    assert _xy(lines[("a", "forward_ours", "peak_rss_mib")]) == [(256, 491.0), (1024, 517.0)]
    assert _xy(lines[("a", "forward_ours", "rss_growth_mib")]) == [(256, 40.0), (1024, 82.0)]
    assert _xy(lines[("a", "forward_hf", "seconds")]) == [(256, 3.2)]  # the over-cap row has no time
    assert _xy(lines[("b", "conventional", "seconds")]) == [(512, 1.5), (2048, 6.0)]
    assert _xy(lines[("b", "response_only", "peak_rss_mib")]) == [(512, 700.0), (2048, 760.0)]
    assert _xy(lines[("b", "response_only", "rss_growth_mib")]) == [(512, 80.0), (2048, 120.0)]
    memory_a = drawn.axes[("a", "memory")]
    crosses = [_xy(line) for line in memory_a.lines if line.get_marker() == "x"]
    assert crosses == [[(1024, 2.0 * 1024)]]  # HF stopped at L=1024 by the 2 GiB cap
    assert [t.get_text() for t in memory_a.texts] == ["forward_hf: over cap at 1,024"]
    labels = [t.get_text() for t in memory_a.get_legend().get_texts()]
    assert labels == ["ours (JAX, jitted) (exponent: peak 0.39, added 0.84)", "HF transformers (torch eager)",
                      "memory cap 2 GiB"]
    assert drawn.axes[("a", "seconds")].get_xscale() == "log" and drawn.axes[("b", "memory")].get_yscale() == "log"


def test_only_the_sections_present_are_drawn_and_none_is_an_error():
    only_b = results()
    del only_b["sections"]["a"], only_b["sections"]["d"]
    drawn = figures.draw(only_b)
    assert set(drawn.axes) == {("b", "seconds"), ("b", "memory")}
    with pytest.raises(ValueError, match="neither section a nor b"):
        figures.draw({"sections": {"c": {}}})
    assert figures.write_or_explain({"sections": {"c": {}}}, "unused.png") == (
        "No picture: no section a or b in these results.")


def test_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "run.png"
    assert figures.write_or_explain(results(), out) == (
        "No picture: matplotlib is not installed (pip install -e '.[plots]').")
    assert not out.exists()
