"""Test set-up: 8 virtual CPU devices, float32 matmuls at full precision, a shared persistent compile
cache, and a bound on the compiled programs one test process keeps alive."""

import gc
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# One persistent compilation cache for the session, shared by this process and the subprocess tests
# (CLI runs): a program compiled once (e.g. the embedded policy's sampler chunk, used by several
# test modules, or a resumed run's programs) is loaded from disk instead of recompiled.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache_dir = tempfile.mkdtemp(prefix="glm52_jax_test_xla_cache_")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    jax.config.update("jax_compilation_cache_dir", _cache_dir)
# Subprocesses compile with this process's matmul precision, so their programs are the very ones
# compiled here (cache hits) and their numbers are comparable bit for bit.
os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"

# Every kernel of a live XLA:CPU executable holds ~3 entries of the process's memory-map table (its
# JIT-linked code, read-only data and data; ~450 for one tiny-model forward), and JAX's caches keep
# executables alive. A whole-suite process reached the kernel's limit (vm.max_map_count, 65,530)
# at ~75% of the suite; LLVM then failed to map a kernel and the error's C++ exception segfaulted
# in the unwinder (`scripts/repro_map_exhaustion.py`, BUILD_NOTES). After any test that leaves the
# table over a third full, all compiled programs are dropped: later tests recompile what they need
# (or load it from the persistent cache), and no single test comes near the remaining two thirds.
_MAPS = "/proc/self/maps"
_MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"
_RELEASE_FRACTION = 1 / 3


def map_count() -> int:
    """Entries in this process's memory-map table (Linux); 0 where /proc is absent."""
    try:
        with open(_MAPS, "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


def _release_threshold() -> int:
    try:
        with open(_MAX_MAP_COUNT) as f:
            return int(int(f.read()) * _RELEASE_FRACTION)
    except (OSError, ValueError):
        return 0


_THRESHOLD = _release_threshold()


@pytest.fixture(autouse=True)
def _bounded_compiled_programs():
    yield
    if _THRESHOLD and map_count() > _THRESHOLD:
        jax.clear_caches()
        gc.collect()  # executables owned by objects in reference cycles


# The longest files first (whole files go to one xdist worker each, in collection order: scripts/test.sh passes
# --no-loadscope-reorder, without which xdist sends files with the most tests first and this order is lost): started
# last, a several-minute file would run alone at the end while the other worker idles. By their CI seconds (the
# 2-process rehearsal ~250 s; the others 35-170 s), so that the last files to start are the short ones.
LONGEST_FIRST = ("tests/rl/test_rehearsal.py", "tests/rl/test_transaction.py", "tests/parallel/test_sharded_rl.py",
                 "tests/rl/test_parity.py", "tests/plan/test_plan.py", "tests/rollout/test_sampler.py",
                 "tests/rl/test_gradients.py", "tests/kernels/test_indexer_kernel.py",
                 "tests/model/test_expert_parallel.py", "tests/model/test_cache_fp8.py", "tests/test_parity_hf.py",
                 "tests/kernels/test_sparse_mla_kernel.py", "tests/model/test_context_parallel.py",
                 "tests/model/test_lora.py", "tests/checkpoint/test_hf.py", "tests/plan/test_gpu_plan.py",
                 "tests/kernels/test_aot.py")
# test_gpu_plan before test_aot: in a process that has run test_aot's deviceless Triton compiles, the GPU plan
# fixture's XLA:GPU compile took 176 s instead of 9 s (CI 193 s when xdist gave both files to one worker in that
# order; cause not found).


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: file order kept
