"""Models built on ``mpidist.nn``, shaped so the parallel wrappers can cut them (see each model's docstring)."""

from mpidist.models.gpt import GPT, GPTConfig, GPTEmbedding, GPTHead, GPTStage, lm_loss, split_layers

__all__ = ["GPT", "GPTConfig", "GPTEmbedding", "GPTHead", "GPTStage", "lm_loss", "split_layers"]
