"""Rollout: tokenizer, chat formatting, sampling and the prefix cache."""
