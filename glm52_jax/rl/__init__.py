"""RL algorithms for GLM-5.2 training: GRPO/DAPO losses and advantages."""
