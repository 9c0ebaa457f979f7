"""GLM-MoE-DSA model in Flax NNX."""
