"""Checkpoint formats: HF safetensors (`hf`), later Orbax."""
