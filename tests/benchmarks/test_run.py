"""`python -m benchmarks.run --quick`: every section runs for real and its JSON holds consistent numbers.

No timing assertions (the quick lengths are tiny and the machine is shared); what is checked is
that the comparison is of the same model, the measurements happened, and the numbers obey what
the code claims about them.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quick_run_sections(tmp_path):
    out = tmp_path / "run_quick.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert set(res["sections"]) == {"a", "b", "c", "d", "e"}
    assert res["machine"]["cpu_count"] >= 1 and res["machine"]["jax"] and res["machine"]["torch"]
    assert "### a." in proc.stdout and "### e." in proc.stdout

    # a: both sides ran at every quick length on the same weights.
    a = res["sections"]["a"]
    for side in ("ours", "hf"):
        rows = a["sides"][side]["rows"]
        assert [r["status"] for r in rows] == ["ok"] * len(rows) and len(rows) == 2
        assert all(r["seconds"] > 0 and r["peak_rss_mib"] > 0 for r in rows)
    parity = {p["seq_len"]: p for p in a["parity"]}
    topk = res["config"]["index_topk"]
    dense_equivalent = [n for n in parity if n <= topk]  # every causal key selected: no top-k ties
    assert dense_equivalent
    for n in dense_equivalent:
        assert parity[n]["max_abs_diff"] < 1e-4, parity[n]
        assert parity[n]["logit_std"] > 0.1  # random weights wide enough that agreement means something
    assert all(r["hf_over_ours_seconds"] > 0 for r in a["ratios"])

    # b: every mode at both prompt lengths; with fresh LoRA (B = 0) all modes score the same policy.
    b = res["sections"]["b"]
    assert len(b["rows"]) == 8 and all(r["status"] == "ok" and r["step_seconds"] > 0 for r in b["rows"])
    for r in b["ratios"]:
        assert r["max_logprob_diff_across_modes"] < 1e-5
        assert r["max_loss_diff_across_modes"] < 1e-5
        assert r["conventional_over_response_only"] > 0 and r["shared_prefix_over_conventional"] > 0

    # c: the second candidate reused the first's prefix.
    c = res["sections"]["c"]["row"]
    assert c["status"] == "ok" and c["first"]["seconds"] > 0 and c["second"]["seconds"] > 0
    assert c["first"]["prefix_hit_tokens"] == 0 and c["second"]["prefix_hit_tokens"] > 0

    # d: finite exponents; response_only's planned temporaries grow more slowly with P than conventional's
    # (its differentiated sequence is the R response tokens, the prompt only a constant cache).
    fits = res["sections"]["d"]["fits"]
    for name in ("forward_ours", "conventional", "response_only", "response_only_sampler_cache", "shared_prefix"):
        for key in ("exponent_xla_temp_mib", "exponent_rss_growth_mib"):
            assert fits[name][key] is not None and math.isfinite(fits[name][key]), (name, key)
    assert fits["response_only"]["exponent_xla_temp_mib"] < fits["conventional"]["exponent_xla_temp_mib"]

    # e: with one block per loop, XLA's count matches the analytic GEMM count of what is compiled
    # (full [L, L] indexer square, all K attention slots, ragged_dot dense over the experts) to within
    # the non-GEMM elementwise work (norms, softmax, ReLU, routing: a few %); with the default blocks
    # XLA counts each loop body once, so it reports less.
    e = res["sections"]["e"]["row"]
    assert e["status"] == "ok"
    for kind in ("dense", "sparse"):
        layer = e["layers"][kind]
        assert 0.95 <= layer["xla_over_as_compiled"] <= 1.15, (kind, layer["xla_over_as_compiled"])
        assert layer["xla_flops_default_blocks"] < layer["xla_flops_one_block"]
    assert e["layers"]["sparse"]["xla_over_ideal"] > 3  # ragged_dot on XLA:CPU: E x the routed FLOPs

    for t in res["targets"].values():
        assert t["verdict"] in ("met", "missed", "n/a")
