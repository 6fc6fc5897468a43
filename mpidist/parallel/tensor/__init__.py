"""Tensor and sequence parallelism: layers split over a tensor-parallel communicator (see layers.py, ops.py).

A model says how it is cut into them: ``mpidist.models.tensor_parallel(gpt, tp_comm)`` splits a GPT.
"""

from .layers import (ColumnParallelLinear, ParallelAttention, ParallelLayerNorm, ParallelMLP, RowParallelLinear,
                     VocabParallelEmbedding, padded_split, vocab_parallel_cross_entropy)
from .ops import copy_to_tp, gather_last, gather_sequence, reduce_from_tp, scatter_sequence

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ParallelAttention", "ParallelMLP", "ParallelLayerNorm",
           "VocabParallelEmbedding", "vocab_parallel_cross_entropy", "padded_split",
           "copy_to_tp", "reduce_from_tp", "gather_sequence", "scatter_sequence", "gather_last"]
