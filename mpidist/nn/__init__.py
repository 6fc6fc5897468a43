"""Tensors with reverse-mode autograd over numpy or CuPy arrays, PyTorch-shaped modules, layers and losses."""

from mpidist.nn import functional
from mpidist.nn.deferred import DeferredParameterError, deferred, is_deferred, load_deferred, materialize
from mpidist.nn.autograd import (DeferredWeightGrads, Tensor, backward, backward_input, enable_grad, grad,
                                 is_grad_enabled, no_grad, queue_callback, queue_weight_callback, set_grad_enabled,
                                 weights_deferred)
from mpidist.nn.layers import (GELU, MLP, AvgPool2d, BatchNorm2d, Conv2d, Dropout, Embedding, Flatten, Identity,
                               LayerNorm, Linear, MaxPool2d, MultiheadAttention, ReLU, RMSNorm, Sigmoid,
                               SyncBatchNorm, Tanh, TransformerBlock)
from mpidist.nn.losses import CrossEntropyLoss, Loss, MSELoss
from mpidist.nn.module import Module, ModuleDict, ModuleList, Parameter, Sequential
from mpidist.nn.random import default_generator, get_rng_state, manual_seed, set_rng_state
from mpidist.nn.recompute import recompute
from mpidist.nn.utils import clip_grad_norm_, grad_norm

__all__ = [
    "Tensor", "Parameter", "Module", "Sequential", "ModuleList", "ModuleDict", "functional",
    "no_grad", "enable_grad", "set_grad_enabled", "is_grad_enabled", "backward", "grad", "backward_input",
    "DeferredWeightGrads", "queue_callback", "queue_weight_callback", "weights_deferred", "recompute",
    "Linear", "ReLU", "GELU", "Tanh", "Sigmoid", "Dropout", "LayerNorm", "RMSNorm", "Embedding", "Flatten",
    "Identity", "MultiheadAttention", "MLP", "TransformerBlock", "Conv2d", "MaxPool2d", "AvgPool2d",
    "BatchNorm2d", "SyncBatchNorm",
    "Loss", "CrossEntropyLoss", "MSELoss", "clip_grad_norm_", "grad_norm",
    "manual_seed", "default_generator", "get_rng_state", "set_rng_state",
    "deferred", "materialize", "is_deferred", "load_deferred", "DeferredParameterError",
]
