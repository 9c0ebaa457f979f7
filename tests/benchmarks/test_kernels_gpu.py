"""benchmarks/kernels_gpu.py's driver on CPU (--smoke): sections in child processes, one failing section
keeps the others' results, JSON + markdown written."""

import json

import pytest

from benchmarks import kernels_gpu


@pytest.mark.slow  # ~25 s: a failure path of the benchmark driver
def test_failing_section_keeps_the_others(tmp_path, capsys):
    # model_hf needs the checkpoint model_ours writes; run alone it fails, after env has measured.
    kernels_gpu.main(["--smoke", "--sections", "env,model_hf", "--budget", "120", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "kernels_gpu.json").read_text())["rows"]
    peak = [r for r in rows if r["section"] == "peak"]
    assert len(peak) == 1 and peak[0]["tflops"] > 0 and peak[0]["n"] == kernels_gpu.SMOKE["peak_n"]
    failed = [r for r in rows if r["section"] == "model_hf"]
    assert failed and "error" in failed[-1] and failed[-1]["stderr_tail"]
    table = (tmp_path / "kernels_gpu.md").read_text()
    assert "## model_hf" in table and f"n={kernels_gpu.SMOKE['peak_n']}" in table
    printed = capsys.readouterr().out
    assert "bf16 matmul peak:" in printed and "ERROR model_hf: exit 1" in printed
