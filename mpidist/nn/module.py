"""Parameters, modules and the explicit forward/backward protocol.

Glossary:
  mb         micro-batch id; every forward saves what its backward needs under
             ``mb`` so several micro-batches can be in flight at once (1F1B).
  saved      per-module dict ``mb -> activations`` filled by forward, emptied by
             the matching backward.
  grad ready a parameter's gradient for this backward is final; hooks registered
             with ``Parameter.register_grad_ready_hook`` fire at that moment.

Parameter storage may be swapped from outside (FSDP gathers ``param.data``
before a unit runs and frees it after), so layers read ``self.weight.data`` at
the moment of use and never keep arrays or shapes of parameters.
"""

import contextlib
import itertools
import threading
from collections import OrderedDict, namedtuple

from mpidist.xp import copy_into

__all__ = ["Parameter", "Module", "Sequential", "no_grad", "is_grad_enabled"]

# Thread-local because simulated communicators run ranks as threads.
_grad_mode = threading.local()


def is_grad_enabled():
    """Return False inside ``no_grad()``, True otherwise."""
    return getattr(_grad_mode, "enabled", True)


@contextlib.contextmanager
def no_grad():
    """Run forwards that save nothing for backward (inference, evaluation)."""
    prev = is_grad_enabled()
    _grad_mode.enabled = False
    try:
        yield
    finally:
        _grad_mode.enabled = prev


class _HookHandle:
    """Handle returned by hook registration; ``remove()`` unregisters the hook."""

    _ids = itertools.count()

    def __init__(self, hooks):
        self._hooks = hooks
        self.id = next(self._ids)

    def remove(self):
        """Unregister the hook (idempotent)."""
        self._hooks.pop(self.id, None)


class Parameter:
    """A trainable array ``data`` with its accumulated gradient ``grad``."""

    def __init__(self, data):
        self.data = data
        self.grad = None
        # How many times an optimizer updated ``data``: ranks that must agree on the step compare it.
        self.version = 0
        self._grad_ready_hooks = {}

    @property
    def shape(self):
        """Return the shape of the current ``data``."""
        return self.data.shape

    @property
    def dtype(self):
        """Return the dtype of the current ``data``."""
        return self.data.dtype

    def accumulate_grad(self, g):
        """Add ``g`` to ``grad`` in place, then fire the grad-ready hooks."""
        if self.grad is None:
            self.grad = g.copy()
        else:
            if self.grad.shape != g.shape:
                raise ValueError(f"Parameter.accumulate_grad: gradient shape does not match grad "
                                 f"(gradient: {g.shape}, grad: {self.grad.shape})")
            # In place: DDP pre-sets grad to a view into a flat bucket.
            self.grad += g
        for fn in list(self._grad_ready_hooks.values()):
            fn(self)

    def register_grad_ready_hook(self, fn):
        """Call ``fn(param)`` each time a backward finishes accumulating into ``grad``."""
        handle = _HookHandle(self._grad_ready_hooks)
        self._grad_ready_hooks[handle.id] = fn
        return handle

    def __repr__(self):
        return f"Parameter(shape={self.data.shape}, dtype={self.data.dtype})"


_IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])


class Module:
    """Base class: registers parameters, children and buffers; saves activations per micro-batch."""

    def __init__(self):
        object.__setattr__(self, "_params", OrderedDict())
        object.__setattr__(self, "_children", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_saved", {})
        object.__setattr__(self, "training", True)

    def __setattr__(self, name, value):
        if "_params" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__}: cannot assign '{name}' before Module.__init__() is called")
        for registry in (self._params, self._children):
            registry.pop(name, None)
        if isinstance(value, (Parameter, Module)):
            self._buffers.pop(name, None)
            (self._params if isinstance(value, Parameter) else self._children)[name] = value
        elif name in self._buffers:
            self._buffers[name] = value
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        for registry in (self._params, self._children, self._buffers):
            registry.pop(name, None)
        object.__delattr__(self, name)

    # -- forward / backward -------------------------------------------------

    def __call__(self, x, mb=0):
        return self.forward(x, mb=mb)

    def forward(self, x, mb=0):
        """Compute the output for micro-batch ``mb``, saving what backward needs."""
        raise NotImplementedError(f"{type(self).__name__}: forward() is not implemented")

    def backward(self, grad_out, mb=0):
        """Accumulate parameter gradients for micro-batch ``mb`` and return the input gradient."""
        raise NotImplementedError(f"{type(self).__name__}: backward() is not implemented")


    def backward_input(self, grad_out, mb=0):
        """Return the input gradient; a layer may defer its weight gradients to ``backward_weight``.

        Zero-bubble pipelines split backward this way (B, then W later). The default does all the work now.
        """
        return self.backward(grad_out, mb)

    def backward_weight(self, mb=0):
        """Accumulate the weight gradients ``backward_input`` deferred for ``mb`` (default: none were)."""
    def saves_for_backward(self):
        """Return True if a forward now should save activations (training mode, grad enabled)."""
        return self.training and is_grad_enabled()

    def save_for_backward(self, mb, value):
        """Keep ``value`` for ``backward(mb)`` if in training mode with grad enabled."""
        if not self.saves_for_backward():
            return
        if mb in self._saved:
            raise RuntimeError(f"{type(self).__name__}.forward: micro-batch {mb} is already in flight "
                               f"(in flight: {sorted(self._saved)}); run backward(mb={mb}) before forwarding it again")
        self._saved[mb] = value

    def pop_saved(self, mb):
        """Remove and return what forward saved for micro-batch ``mb``."""
        try:
            return self._saved.pop(mb)
        except KeyError:
            raise RuntimeError(f"{type(self).__name__}.backward: no saved activations for micro-batch {mb} "
                               f"(in flight: {sorted(self._saved)}); call forward(x, mb={mb}) in training mode "
                               f"outside no_grad() first") from None

    def num_inflight(self):
        """Return how many micro-batches have saved activations in this module or its descendants."""
        return len(set().union(*(m._saved.keys() for m in self.modules())))

    # -- traversal (deterministic, rank-independent order) --------------------

    def named_children(self):
        """Yield ``(name, child)`` in registration order."""
        yield from self._children.items()

    def children(self):
        """Yield direct children in registration order."""
        yield from self._children.values()

    def named_modules(self, prefix=""):
        """Yield ``(name, module)`` for self and all descendants, pre-order."""
        yield prefix, self
        for name, child in self._children.items():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def modules(self):
        """Yield self and all descendants, pre-order."""
        for _, m in self.named_modules():
            yield m

    def named_parameters(self, prefix=""):
        """Yield ``(name, param)``: own params in registration order, then children's; shared params once."""
        seen = set()
        for mod_name, m in self.named_modules(prefix):
            for name, p in m._params.items():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{mod_name}.{name}" if mod_name else name), p

    def parameters(self):
        """Yield parameters in the order of ``named_parameters()``."""
        for _, p in self.named_parameters():
            yield p

    def register_buffer(self, name, array):
        """Register a non-trainable array saved in ``state_dict()`` (e.g. running statistics)."""
        if name in self._params or name in self._children:
            raise KeyError(f"{type(self).__name__}.register_buffer: '{name}' is already a parameter or child")
        self._buffers[name] = array
        object.__setattr__(self, name, array)

    def named_buffers(self, prefix=""):
        """Yield ``(name, array)`` for all buffers, in module pre-order."""
        for mod_name, m in self.named_modules(prefix):
            for name, b in m._buffers.items():
                yield (f"{mod_name}.{name}" if mod_name else name), b

    def buffers(self):
        """Yield all buffers."""
        for _, b in self.named_buffers():
            yield b

    # -- state ------------------------------------------------------------------

    def _state_arrays(self):
        return OrderedDict([*((n, p.data) for n, p in self.named_parameters()), *self.named_buffers()])

    def state_dict(self):
        """Return an ordered dict ``name -> copy of array``: parameters, then buffers."""
        return OrderedDict((name, a.copy()) for name, a in self._state_arrays().items())

    def load_state_dict(self, state_dict, strict=True):
        """Copy arrays from ``state_dict`` into the existing arrays in place; return missing/unexpected keys."""
        own = self._state_arrays()
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            raise KeyError(f"{type(self).__name__}.load_state_dict: keys do not match "
                           f"(missing: {missing}, unexpected: {unexpected})")
        # Check every shape before copying anything, so a failed load changes nothing.
        for name, dst in own.items():
            if name in state_dict and tuple(state_dict[name].shape) != tuple(dst.shape):
                raise ValueError(f"{type(self).__name__}.load_state_dict: shape mismatch for '{name}' "
                                 f"(checkpoint: {tuple(state_dict[name].shape)}, model: {tuple(dst.shape)})")
        for name, dst in own.items():
            if name in state_dict:
                copy_into(dst, state_dict[name])
        return _IncompatibleKeys(missing, unexpected)

    # -- modes and grads ------------------------------------------------------

    def train(self, mode=True):
        """Set training mode on self and all descendants; return self."""
        for m in self.modules():
            object.__setattr__(m, "training", bool(mode))
        return self

    def eval(self):
        """Set evaluation mode (forward saves nothing, dropout off); return self."""
        return self.train(False)

    def zero_grad(self, set_to_none=False):
        """Zero every parameter's grad in place (keeping the array), or set it to None."""
        for p in self.parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad[...] = 0

    def extra_repr(self):
        """Return the text shown inside this module's parentheses in ``repr``."""
        return ""

    def __repr__(self):
        if not self._children:
            return f"{type(self).__name__}({self.extra_repr()})"
        lines = [f"  ({name}): " + repr(c).replace("\n", "\n  ") for name, c in self._children.items()]
        return f"{type(self).__name__}(\n" + "\n".join(lines) + "\n)"


class Sequential(Module):
    """Run children in order on forward and in reverse order on backward."""

    def __init__(self, *modules):
        super().__init__()
        for i, m in enumerate(modules):
            if not isinstance(m, Module):
                raise TypeError(f"Sequential: argument {i} is not a Module (got {type(m).__name__})")
            setattr(self, str(i), m)

    def __getitem__(self, i):
        return list(self._children.values())[i]

    def __len__(self):
        return len(self._children)

    def __iter__(self):
        return iter(self._children.values())

    def forward(self, x, mb=0):
        """Feed ``x`` through every child in order."""
        for m in self._children.values():
            x = m(x, mb=mb)
        return x

    def backward(self, grad_out, mb=0):
        """Feed ``grad_out`` back through every child in reverse order."""
        for m in reversed(self._children.values()):
            grad_out = m.backward(grad_out, mb=mb)
        return grad_out

    def backward_input(self, grad_out, mb=0):
        """Feed ``grad_out`` back through every child, deferring what weight-gradient work they can."""
        for m in reversed(self._children.values()):
            grad_out = m.backward_input(grad_out, mb=mb)
        return grad_out

    def backward_weight(self, mb=0):
        """Run every child's deferred weight-gradient work for micro-batch ``mb``."""
        for m in reversed(self._children.values()):
            m.backward_weight(mb=mb)
