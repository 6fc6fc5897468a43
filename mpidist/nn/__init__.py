"""Modules with explicit forward/backward over numpy or CuPy arrays (no autograd tape)."""

from mpidist.nn.layers import GELU, Dropout, Embedding, Flatten, LayerNorm, Linear, ReLU, Tanh
from mpidist.nn.losses import CrossEntropyLoss, Loss, MSELoss
from mpidist.nn.module import Module, Parameter, Sequential, is_grad_enabled, no_grad
from mpidist.nn.utils import clip_grad_norm_, grad_norm

__all__ = [
    "Parameter", "Module", "Sequential", "no_grad", "is_grad_enabled",
    "Linear", "ReLU", "GELU", "Tanh", "Dropout", "LayerNorm", "Embedding", "Flatten",
    "Loss", "CrossEntropyLoss", "MSELoss", "clip_grad_norm_", "grad_norm",
]
