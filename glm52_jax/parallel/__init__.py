"""Sharding: logical axis rules, meshes, and (later) context- and expert-parallel execution."""
