"""Losses with explicit backward: ``loss = crit(pred, target, mb)``, ``dpred = crit.backward(mb, scale)``.

``scale`` lets a pipeline weight micro-batch losses (scale = micro-batch size /
global batch) so that the micro-batch gradients sum to the full-batch gradient.
"""

from mpidist.nn.module import Module
from mpidist.xp import get_array_module

__all__ = ["Loss", "CrossEntropyLoss", "MSELoss"]

_REDUCTIONS = ("mean", "sum")


class Loss(Module):
    """Base class: a module whose forward takes ``(pred, target)`` and whose backward takes no gradient."""

    def __init__(self, reduction="mean"):
        super().__init__()
        if reduction not in _REDUCTIONS:
            raise ValueError(f"{type(self).__name__}: unknown reduction '{reduction}' (expected one of {_REDUCTIONS})")
        self.reduction = reduction

    def __call__(self, pred, target, mb=0):
        return self.forward(pred, target, mb=mb)

    def forward(self, pred, target, mb=0):
        """Return the reduced loss (a 0-d array or numpy scalar) and save what backward needs."""
        raise NotImplementedError(f"{type(self).__name__}: forward() is not implemented")

    def backward(self, mb=0, scale=1.0):
        """Return the gradient of ``scale * loss`` for micro-batch ``mb`` with respect to ``pred``."""
        raise NotImplementedError(f"{type(self).__name__}: backward() is not implemented")

    def _reduce(self, per_item):
        return per_item.mean() if self.reduction == "mean" else per_item.sum()

    def extra_repr(self):
        return f"reduction='{self.reduction}'"


class CrossEntropyLoss(Loss):
    """Softmax cross-entropy of logits ``pred`` (..., C) against integer labels ``target`` (...)."""

    def forward(self, pred, target, mb=0):
        """Return the cross-entropy, computed with a stable log-sum-exp."""
        xp = get_array_module(pred)
        if target.shape != pred.shape[:-1]:
            raise ValueError(f"CrossEntropyLoss: target shape must be pred shape without the class axis "
                             f"(pred: {pred.shape}, target: {target.shape})")
        if target.dtype.kind not in "iu":
            raise TypeError(f"CrossEntropyLoss: labels must be integers (dtype: {target.dtype})")
        num_classes = pred.shape[-1]
        if target.size and (int(target.min()) < 0 or int(target.max()) >= num_classes):
            raise IndexError(f"CrossEntropyLoss: label out of range [0, {num_classes}) "
                             f"(min: {int(target.min())}, max: {int(target.max())})")
        logits = pred.reshape(-1, num_classes)
        labels = target.reshape(-1)
        shifted = logits - logits.max(axis=-1, keepdims=True)
        lse = xp.log(xp.exp(shifted).sum(axis=-1, keepdims=True))
        logp = shifted - lse
        rows = xp.arange(labels.shape[0])
        if self.saves_for_backward():
            self.save_for_backward(mb, (xp.exp(logp), labels, pred.shape))
        return self._reduce(-logp[rows, labels])

    def backward(self, mb=0, scale=1.0):
        """Return ``scale * (softmax(pred) - onehot(target))``, divided by the item count for 'mean'."""
        probs, labels, shape = self.pop_saved(mb)
        xp = get_array_module(probs)
        grad = probs.copy()
        grad[xp.arange(labels.shape[0]), labels] -= 1
        n = labels.shape[0] if self.reduction == "mean" else 1
        grad *= scale / max(n, 1)
        return grad.reshape(shape)


class MSELoss(Loss):
    """Mean (or summed) squared error between ``pred`` and ``target`` of the same shape."""

    def forward(self, pred, target, mb=0):
        """Return the reduced squared error."""
        if pred.shape != target.shape:
            raise ValueError(f"MSELoss: pred and target shapes differ (pred: {pred.shape}, target: {target.shape})")
        diff = pred - target
        self.save_for_backward(mb, diff)
        return self._reduce(diff * diff)

    def backward(self, mb=0, scale=1.0):
        """Return ``scale * 2 (pred - target)``, divided by the element count for 'mean'."""
        diff = self.pop_saved(mb)
        n = diff.size if self.reduction == "mean" else 1
        return diff * (2.0 * scale / max(n, 1))
