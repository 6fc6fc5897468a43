"""Loss modules: ``loss = criterion(pred, target)`` returns a scalar Tensor; ``loss.backward()`` does the rest."""

from mpidist.nn import functional as F
from mpidist.nn.module import Module

__all__ = ["Loss", "CrossEntropyLoss", "MSELoss"]

_REDUCTIONS = ("mean", "sum")


class Loss(Module):
    """Base class: a module whose forward takes ``(pred, target)``."""

    def __init__(self, reduction="mean"):
        super().__init__()
        if reduction not in _REDUCTIONS:
            raise ValueError(f"{type(self).__name__}: unknown reduction '{reduction}' (expected one of {_REDUCTIONS})")
        self.reduction = reduction

    def extra_repr(self):
        return f"reduction='{self.reduction}'"


class CrossEntropyLoss(Loss):
    """Softmax cross-entropy of logits ``pred`` (..., C) against integer labels ``target`` (...)."""

    def __init__(self, reduction="mean", ignore_index=-100, label_smoothing=0.0):
        super().__init__(reduction)
        self.ignore_index, self.label_smoothing = ignore_index, label_smoothing

    def forward(self, pred, target):
        """Return the cross-entropy, computed with a stable log-sum-exp."""
        return F.cross_entropy(pred, target, self.ignore_index, self.label_smoothing, self.reduction)


class MSELoss(Loss):
    """Mean (or summed) squared error between ``pred`` and ``target`` of the same shape."""

    def forward(self, pred, target):
        """Return the reduced squared error."""
        return F.mse_loss(pred, target, self.reduction)
