"""Tensor and sequence parallelism: layers split over a tensor-parallel communicator (see layers.py, ops.py).

A model says how it is cut into them: ``mpidist.models.tensor_parallel(gpt, tp_comm)`` splits a GPT. For a
model's own split layers: ``TensorParallelModule`` (the base: how activations enter and leave the split) and
``sharded_parameter``, ``replicated_parameter``, ``padded_rows`` (a slice of the unsharded weight, placed).
"""

from .layers import (ColumnParallelLinear, ParallelAttention, ParallelLayerNorm, ParallelMLP, RowParallelLinear,
                     TensorParallelModule, VocabParallelEmbedding, padded_rows, padded_split, replicated_parameter,
                     sharded_parameter, vocab_parallel_cross_entropy)
from .ops import copy_to_tp, gather_last, gather_sequence, gather_sequence_linear, reduce_from_tp, scatter_sequence

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ParallelAttention", "ParallelMLP", "ParallelLayerNorm",
           "VocabParallelEmbedding", "vocab_parallel_cross_entropy", "padded_split", "padded_rows",
           "sharded_parameter", "replicated_parameter", "TensorParallelModule",
           "copy_to_tp", "reduce_from_tp", "gather_sequence", "scatter_sequence", "gather_last",
           "gather_sequence_linear"]
