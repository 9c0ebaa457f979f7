"""Sharding, the bottom layer: logical axis rules, meshes, placement, multi-host set-up.

Imports nothing else from glm52_jax (tests/test_imports.py checks it). The explicit
context-parallel attention and expert-parallel MoE sit beside the model code that dispatches to
them: model/context_parallel.py, model/expert_parallel.py.
"""
