"""`compiling <program>...` lines from JAX's own compile events, for a real compile."""

import jax
import jax.numpy as jnp

from glm52_jax.rl.compile_log import compile_lines


def test_a_slow_compile_gets_a_line_and_a_fast_one_does_not():
    def slow_to_compile(x):  # 200 unrolled steps: XLA:CPU takes a good fraction of a second
        # Each step reads the last once: with two reads per step, XLA:CPU's fused loop at LLVM -O0 (scripts/test.sh)
        # evaluates the chain 2^200 times per element (30 steps: 73 s), as no CSE merges the reads.
        for i in range(200):
            x = jnp.cos(jnp.sin(x)[::-1] * 0.5 + i)
        return x

    x = jnp.arange(8.0).block_until_ready()  # made before the block: its own small compile stays out of it
    lines = []
    with compile_lines(lines.append, announce_after_s=0.05, phase=lambda: "step 1 update") as reporter:
        jax.jit(slow_to_compile)(x).block_until_ready()
    name = "jit(slow_to_compile)"
    assert reporter.announced == [name]
    assert lines[0] == f"compiling {name} (step 1 update)..." and lines[1].startswith(f"compiled {name} in ")
    quiet = []
    with compile_lines(quiet.append, announce_after_s=30.0):
        jax.jit(lambda x: x + 1)(jnp.arange(3.0)).block_until_ready()
    assert quiet == []
    jax.jit(slow_to_compile)(jnp.arange(9.0)).block_until_ready()  # after the block: no listener left
    assert len(lines) == 2
