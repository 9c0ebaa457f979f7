"""The guides' commands run as written: every ```bash block of docs/*.md and README.md.

A block runs with `bash -e` from the repository root (a command shown failing, `cmd || echo "refused (exit $?)"`,
must exit 1), with `python` this interpreter and every `/tmp/` path moved to
a fresh temporary directory (blocks of one guide share it, in order). A block that cannot run here is tagged
```bash skip=REASON, REASON one of `SKIP_REASONS`; each guide keeps at least one block that runs, and skipped blocks
stay the minority. The README's quick start (a plain ``` block) runs in tests/rl/test_transaction.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.run_helpers import ROOT

SKIP_REASONS = {
    "gpu": "needs the GPUs it runs on",
    "cluster": "needs several hosts (SLURM, ssh, Kubernetes) or the 2M receipts they make",
    "minutes": "a 2M-scale plan: minutes and tens of GiB of host memory (its reports are committed)",
    "run": "a training run of minutes on CPU; the same commands run in the test the guide names",
}
GUIDES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
REPO_PATH = r"`((?:configs|launch|scripts|benchmarks|evidence|glm52_jax|tests|docs)/[\w./-]+)`"
BLOCK = re.compile(r"^```bash(?P<tag>[^\n]*)\n(?P<body>.*?)^```$", re.M | re.S)


def blocks(path: Path) -> list[tuple[str | None, str]]:
    """(skip reason or None, body) of every ```bash block of `path`."""
    out = []
    for m in BLOCK.finditer(path.read_text()):
        tag = m["tag"].strip()
        reason = tag.removeprefix("skip=") if tag else None
        assert tag == "" or tag.startswith("skip="), f"{path.name}: unknown block tag {tag!r}"
        out.append((reason, m["body"]))
    return out


def test_skip_tags_are_rare_and_justified():
    total = skipped = 0
    for path in GUIDES:
        found = blocks(path)
        total += len(found)
        skipped += sum(reason is not None for reason, _ in found)
        assert {r for r, _ in found if r is not None} <= set(SKIP_REASONS), path.name
        if path.parent.name == "docs" and path.name != "DESIGN.md":
            assert any(r is None for r, _ in found), f"{path.name}: no command that a test runs"
    assert 0 < skipped < total / 2, (skipped, total)


@pytest.fixture(scope="module")
def shell(tmp_path_factory):
    """The environment the blocks run in: `python` = this interpreter, on CPU."""
    bin_dir = tmp_path_factory.mktemp("bin")
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    env.pop("XLA_FLAGS", None)  # as a user's shell: the guides set it where they need it
    return env


@pytest.mark.parametrize("path", [p for p in GUIDES if any(r is None for r, _ in blocks(p))], ids=lambda p: p.name)
def test_guide_commands_run_as_written(path, shell, tmp_path):
    for _, body in (b for b in blocks(path) if b[0] is None):
        script = body.replace("/tmp/", f"{tmp_path}/")
        proc = subprocess.run(["bash", "-e", "-c", script], cwd=ROOT, env=shell, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, f"{path.name}:\n{body}\n--- stdout\n{proc.stdout[-2000:]}\n--- stderr\n" \
                                     f"{proc.stderr[-3000:]}"
        assert proc.stdout.strip(), f"{path.name}: a block printed nothing:\n{body}"
        # A command shown failing (`cmd || echo "refused (exit $?)"`) must fail, with exit 1.
        for word in re.findall(r'\|\| echo "(\w+) \(exit \$\?\)"', body):
            assert f"{word} (exit 1)" in proc.stdout, f"{path.name}: expected `{word} (exit 1)`:\n{proc.stdout}"


def test_the_kubernetes_manifest_gives_every_pod_its_process_group():
    """launch/k8s_jobset.yaml (docs/cluster.md): the GLM52_* variables each pod gets are what
    `parallel.distributed.from_env` reads; pod i of 4 joins pod 0's coordinator as process i."""
    import yaml

    from glm52_jax.parallel import distributed

    jobset = yaml.safe_load((ROOT / "launch" / "k8s_jobset.yaml").read_text())
    [replicated] = jobset["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    [container] = job["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") or e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env["GLM52_PROCESS_ID"] == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"] == 4
    assert int(env["GLM52_NUM_PROCESSES"]) == 4 and container["resources"]["limits"]["nvidia.com/gpu"] == 8
    # pod 0 of job 0 of the replicated job, in the JobSet's headless service (named as the JobSet)
    name = jobset["metadata"]["name"]
    assert env["GLM52_COORDINATOR"] == f"{name}-{replicated['name']}-0-0.{name}:12355"
    assert container["command"] == ["bash", "launch/run_node.sh"]
    assert "--config=configs/2m.py" in container["args"]
    for index in range(4):
        pod = dict(env, GLM52_PROCESS_ID=str(index))
        assert distributed.from_env(pod) == distributed.ProcessGroup(env["GLM52_COORDINATOR"], 4, index, "GLM52_*")


def test_every_relative_link_and_named_file_exists():
    """The guides' links (`[text](path)`) and the paths they name in backticks (from the repository root, or the
    package's as DESIGN.md writes them) exist."""
    missing = []
    for path in GUIDES:
        text = path.read_text()
        for target in re.findall(r"\]\(([^)#]+)\)", text):
            if not re.match(r"[a-z]+://", target) and not (path.parent / target).exists():
                missing.append(f"{path.name}: link {target}")
        for name in re.findall(REPO_PATH, text):
            if not any((base / name.split("::")[0]).exists() for base in (ROOT, ROOT / "glm52_jax")):
                missing.append(f"{path.name}: {name}")
    assert not missing, missing
