"""Minimal reproduction of the late XLA:CPU segfault of long test sessions (BUILD_NOTES, "Test process").

Cause: every kernel of an XLA:CPU executable is JIT-linked into its own memory mappings (code,
read-only data, data: ~3 entries of /proc/self/maps per kernel, ~450 for one tiny-model forward),
held for as long as the executable lives. A process that keeps compiling new programs and keeps
them alive (JAX's jit caches) grows its map table until the kernel's limit, `vm.max_map_count`
(65,530 by default). Then LLVM's JIT cannot map a kernel ("LLVM compilation error: Cannot allocate
memory", "releaseMappedMemory failed"), XLA returns an executable it cannot serialize, and the C++
exception that reports the error segfaults while unwinding (`_Unwind_Find_FDE` walks frame-info
records of the half-linked objects). With the persistent compilation cache on this happens in the
cache write (`compilation_cache.put_executable_and_time`), as it did in the test sessions.

    JAX_PLATFORMS=cpu python scripts/repro_map_exhaustion.py           # exits -11 (SIGSEGV)
    JAX_PLATFORMS=cpu python scripts/repro_map_exhaustion.py --release # jax.clear_caches(): exits 0

The script stands in for a session's hundreds of live programs by holding page-sized anonymous
mappings until HEADROOM map entries are left, then compiles one program of ~100 kernels with the
persistent cache on. `--release` instead drops the filler, as `jax.clear_caches()` drops the
compiled programs (what tests/conftest.py does when the table is half full), and compiles fine.
"""

import argparse
import mmap
import sys
import tempfile

HEADROOM = 150  # map entries left free: fewer than the ~350 the program below needs


def map_count() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def fill_map_table(headroom: int) -> list:
    """Holds page-sized anonymous maps (alternating protections, so the kernel cannot merge them)."""
    limit = int(open("/proc/sys/vm/max_map_count").read())
    held = []
    while map_count() < limit - headroom:
        for _ in range(min(1000, limit - headroom - map_count())):
            prot = mmap.PROT_READ if len(held) % 2 else mmap.PROT_READ | mmap.PROT_WRITE
            held.append(mmap.mmap(-1, mmap.PAGESIZE, prot=prot))
    print(f"map table: {map_count()} of {limit} entries in use", flush=True)
    return held


def many_kernels(x, n: int):
    """n reductions over slices of different lengths: n separate kernels (reductions do not fuse)."""
    import jax.numpy as jnp

    return jnp.stack([jnp.sum(jnp.sin(x[: i + 1]) * jnp.cos(x[i:])[: i + 1]) for i in range(n)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", action="store_true", help="free the map entries before compiling")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="repro_xla_cache_"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # write every program
    held = fill_map_table(HEADROOM)
    if args.release:
        held.clear()
        print(f"released: {map_count()} entries in use", flush=True)
    compiled = jax.jit(many_kernels, static_argnums=1)
    out = compiled(jnp.ones(256, jnp.float32), 100)
    print(f"compiled and ran: {float(out.sum()):.4f}; map table now {map_count()} entries", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
