"""parallel/communicators.py on one process (two processes: tests/parallel/test_distributed.py)."""

import jax

from glm52_jax.parallel import communicators
from glm52_jax.parallel.mesh import parse_mesh


def test_axis_groups_are_every_combination_of_the_axes_larger_than_one():
    assert communicators.axis_groups(parse_mesh("context=4,expert=2").make()) == [
        ("context",), ("expert",), ("context", "expert")]
    assert communicators.axis_groups(parse_mesh("folded=8").make()) == [("cp_ep",)]
    assert communicators.axis_groups(parse_mesh("context=1").make(jax.devices()[:1])) == []


def test_one_process_opens_nothing():
    mesh = parse_mesh("context=4,expert=2").make()
    assert not communicators.needed(mesh) and not communicators.needed(None)
    assert communicators.open_all(mesh) == 0
