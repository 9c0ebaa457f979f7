"""Test set-up: 8 virtual CPU devices, float32 matmuls at full precision."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

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
