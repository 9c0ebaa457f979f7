"""Walks a jaxpr, including scan/map/checkpoint bodies, to inspect intermediate array sizes."""

import numpy as np


def all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for p in (param if isinstance(param, (list, tuple)) else [param]):
                inner = getattr(p, "jaxpr", p)
                if hasattr(inner, "eqns"):
                    yield from all_eqns(inner)


def largest_intermediate(closed_jaxpr) -> int:
    """Element count of the largest array any equation produces."""
    return max(int(np.prod(v.aval.shape)) for eqn in all_eqns(closed_jaxpr.jaxpr) for v in eqn.outvars
               if hasattr(v.aval, "shape"))
