"""SGD, Adam and AdamW with PyTorch's update rules, updating ``param.data`` in place.

In place matters: FSDP hands the optimizer its shard parameters and keeps
references to their arrays, so a step must never rebind ``p.data``.
"""

import math

from mpidist.xp import asarray_like, get_array_module

__all__ = ["Optimizer", "SGD", "Adam", "AdamW"]


class Optimizer:
    """Base class: holds parameters in groups with hyperparameters, and per-parameter state."""

    def __init__(self, params, defaults):
        params = list(params)
        if not params:
            raise ValueError(f"{type(self).__name__}: got an empty parameter list")
        # Accept a list of Parameters (one group) or a list of dicts {"params": [...], **overrides}.
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        self.param_groups, self.params = [], []
        for g in groups:
            unknown = set(g) - set(defaults) - {"params"}
            if unknown:
                raise TypeError(f"{type(self).__name__}: unexpected param group option(s) {sorted(unknown)}")
            group = {**defaults, **g, "params": list(g["params"])}
            self.param_groups.append(group)
            self.params.extend(group["params"])
        self.state = {}  # index into self.params -> dict of step and buffers

    @property
    def lr(self):
        """Return the learning rate of the first group."""
        return self.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value):
        for group in self.param_groups:
            group["lr"] = value

    def _indexed(self):
        i = 0
        for group in self.param_groups:
            for p in group["params"]:
                yield i, p, group
                i += 1

    def step(self):
        """Update every parameter that has a gradient, in place."""
        for i, p, group in self._indexed():
            if p.grad is not None:
                self._update(p, self.state.setdefault(i, {}), group)

    def _update(self, p, state, group):
        raise NotImplementedError(f"{type(self).__name__}: _update() is not implemented")

    def zero_grad(self, set_to_none=False):
        """Zero every parameter's grad in place (keeping the array), or set it to None."""
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad[...] = 0

    def state_dict(self):
        """Return ``{"state": {index: {...}}, "param_groups": [{hyperparameters, "params": [indices]}]}`` of copies."""
        state = {i: {k: (v.copy() if hasattr(v, "copy") else v) for k, v in s.items()}
                 for i, s in self.state.items()}
        groups, i = [], 0
        for group in self.param_groups:
            n = len(group["params"])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(i, i + n))})
            i += n
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        """Restore hyperparameters and state saved by ``state_dict()`` so training continues unchanged."""
        name = type(self).__name__
        saved_groups = state_dict["param_groups"]
        sizes = [len(g["params"]) for g in self.param_groups]
        saved_sizes = [len(g["params"]) for g in saved_groups]
        if sizes != saved_sizes:
            raise ValueError(f"{name}.load_state_dict: parameter group sizes differ "
                             f"(optimizer: {sizes}, state_dict: {saved_sizes})")
        state = {}
        for i, s in state_dict["state"].items():
            i = int(i)
            if not 0 <= i < len(self.params):
                raise KeyError(f"{name}.load_state_dict: state index {i} out of range [0, {len(self.params)})")
            p = self.params[i]
            state[i] = {}
            for k, v in s.items():
                if hasattr(v, "shape"):
                    if tuple(v.shape) != tuple(p.data.shape):
                        raise ValueError(f"{name}.load_state_dict: shape mismatch for state[{i}]['{k}'] "
                                         f"(state_dict: {tuple(v.shape)}, parameter: {tuple(p.data.shape)})")
                    v = asarray_like(v, p.data).copy()
                state[i][k] = v
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.state = state


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum, dampening, Nesterov and L2 weight decay."""

    def __init__(self, params, lr, momentum=0.0, weight_decay=0.0, nesterov=False, dampening=0.0):
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"SGD: hyperparameters must be >= 0 (lr: {lr}, momentum: {momentum}, "
                             f"weight_decay: {weight_decay})")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(f"SGD: nesterov needs momentum > 0 and dampening == 0 "
                             f"(momentum: {momentum}, dampening: {dampening})")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      nesterov=nesterov, dampening=dampening))

    def _update(self, p, state, group):
        d_p = p.grad
        if group["weight_decay"]:
            d_p = d_p + group["weight_decay"] * p.data
        momentum = group["momentum"]
        if momentum:
            buf = state.get("momentum_buffer")
            if buf is None:
                # PyTorch's first step copies the gradient without dampening.
                buf = state["momentum_buffer"] = d_p.copy()
            else:
                buf *= momentum
                buf += (1 - group["dampening"]) * d_p
            d_p = d_p + momentum * buf if group["nesterov"] else buf
        state["step"] = state.get("step", 0) + 1
        p.data -= group["lr"] * d_p


class Adam(Optimizer):
    """Adam with L2 weight decay added to the gradient (PyTorch ``torch.optim.Adam``)."""

    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        b1, b2 = betas
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError(f"{type(self).__name__}: invalid hyperparameters (lr: {lr}, betas: {betas}, "
                             f"eps: {eps}, weight_decay: {weight_decay})")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def _update(self, p, state, group):
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        g = p.grad
        if wd:
            if self._decoupled:
                p.data *= 1 - lr * wd
            else:
                g = g + wd * p.data
        if not state:
            xp = get_array_module(p.data)
            state.update(step=0, exp_avg=xp.zeros_like(p.data), exp_avg_sq=xp.zeros_like(p.data))
        state["step"] += 1
        t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
        xp = get_array_module(m)
        # Two scratch arrays instead of a fresh temporary per operation: for large parameters the
        # allocations (and first touch of their pages) cost more than the arithmetic. The operations
        # and their order are those of the plain expressions, so results are bit-for-bit the same.
        work = xp.multiply(g, 1 - b1)
        m *= b1
        m += work
        xp.multiply(g, 1 - b2, out=work)
        work *= g
        v *= b2
        v += work
        denom = xp.sqrt(v)
        denom /= math.sqrt(1 - b2 ** t)
        denom += eps
        xp.multiply(m, lr / (1 - b1 ** t), out=work)
        work /= denom
        p.data -= work


class AdamW(Adam):
    """Adam with decoupled weight decay ``p *= 1 - lr * wd`` (PyTorch ``torch.optim.AdamW``)."""

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
