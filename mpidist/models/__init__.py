"""Models built on ``mpidist.nn``, shaped so the parallel wrappers can cut them (see each model's docstring)."""

from mpidist.models.gpt import GPT, GPTConfig, GPTEmbedding, GPTHead, GPTStage, lm_loss, split_layers
from mpidist.models.gpt_parallel import ParallelBlock, ParallelGPTEmbedding, ParallelGPTHead, tensor_parallel

__all__ = ["GPT", "GPTConfig", "GPTEmbedding", "GPTHead", "GPTStage", "lm_loss", "split_layers", "tensor_parallel",
           "ParallelBlock", "ParallelGPTEmbedding", "ParallelGPTHead"]
