"""Cache capacity the programs are planned with (pure Python)."""

from __future__ import annotations

import math


def sampler_capacity(prompt_tokens: int, max_new_tokens: int, max_positions: int, multiple: int = 256) -> int:
    """`Sampler.capacity_for`: prompt + new tokens rounded up to `multiple`, capped at max positions."""
    need = prompt_tokens + max_new_tokens
    return min(-(-need // multiple) * multiple, max_positions)


def plan_capacity(prompt_tokens: int, max_new_tokens: int, max_positions: int, multiple: int,
                  seq_ways: int) -> tuple[int, int, str | None]:
    """(sampler capacity, capacity planned with, issue or None).

    The cache's slot axis is sharded `seq_ways` ways and jit rejects an input whose sharded axis
    does not divide evenly. When the sampler's capacity (capped at max_position_embeddings) does
    not, the plan uses the next multiple of lcm(multiple, seq_ways) and says so: slots past the
    last position are never written, so the cap is not needed for correctness.
    """
    capacity = sampler_capacity(prompt_tokens, max_new_tokens, max_positions, multiple)
    if capacity % seq_ways == 0:
        return capacity, capacity, None
    step = math.lcm(multiple, seq_ways)
    planned = -(-capacity // step) * step
    return capacity, planned, (
        f"cache capacity {capacity} (Sampler.capacity_for: {prompt_tokens}+{max_new_tokens} rounded up to "
        f"{multiple}, capped at max_position_embeddings={max_positions}) is not divisible by the {seq_ways}-way "
        f"sequence sharding, which jit rejects for an input; planned with {planned} slots instead (the cap "
        "dropped; slots past the last position are never written)")
