"""A light main install: `pip install -e .` needs none of the test / parity / plot stacks."""

import importlib.metadata
import re
import tomllib
from pathlib import Path

# Only tests, the PyTorch parity bridge and plots use these; they live in extras (`test`, `parity`, `plots`).
HEAVY = {"torch", "transformers", "peft", "megatron-core", "verl", "matplotlib", "tensorflow"}
# What the launcher imports (with its TensorBoard writer).
LAUNCHER = {"jax", "flax", "optax", "orbax-checkpoint", "ml-collections", "absl-py", "numpy", "tokenizers",
            "tensorboardx"}


def _name(requirement: str) -> str:
    return re.split(r"[\s;<>=!~\[(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_installed_metadata_requires_no_heavy_package():
    requires = importlib.metadata.requires("glm52-jax")
    required = {_name(r) for r in requires if "extra ==" not in r}
    assert required and not required & HEAVY, required & HEAVY
    assert {_name(r) for r in requires if 'extra == "test"' in r} >= {"torch", "transformers", "peft"}


def test_pyproject_dependencies_are_the_launchers():
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    required = {_name(r) for r in project["dependencies"]}
    assert LAUNCHER <= required and not required & HEAVY, (LAUNCHER - required, required & HEAVY)


def test_plots_extra_is_matplotlib_and_the_test_extra_has_it():
    """Plan mode's and the benchmarks' pictures: `pip install -e '.[plots]'`; CI (the test extra) draws them too."""
    extras = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert {_name(r) for r in extras["plots"]} == {"matplotlib"}
    assert "matplotlib" in {_name(r) for r in extras["test"]}


def test_gpu_extra_is_jax_cuda_without_jax_triton():
    """The kernels are Pallas (Triton backend bundled in jaxlib); jax-triton is not a dependency (issue 33)."""
    extras = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert {_name(r) for r in extras["gpu"]} == {"jax"}


def test_parity_and_test_extras_pin_both_references():
    """`--config.parity.torch_reference` (HF + PEFT) and `megatron_reference` (megatron-core) run from the `parity`
    extra; CI (the `test` extra) runs both references' tests."""
    extras = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for extra in ("parity", "test"):
        pins = {_name(r): r.strip() for r in extras[extra]}
        assert pins["megatron-core"] == "megatron-core==0.19.2" and pins["torch"] == "torch==2.13.0", extra
        assert {"transformers", "peft"} <= set(pins), extra
