"""Parameters and modules shaped like PyTorch's: forward code only, hooks as the attach points.

Glossary:
  Parameter    a leaf Tensor that requires grad and belongs to a module; optimizers update ``data`` in
               place and bump ``version`` (ranks that must agree on the step compare it).
  forward hooks ``register_forward_pre_hook`` / ``register_forward_hook``: PyTorch's names and signatures;
               DDP, FSDP and the pipeline attach here and never replace a module's methods.
  global forward hooks ``register_module_forward_pre_hook`` / ``register_module_forward_hook``: the same
               hooks for every module's call (PyTorch's names), run before each module's own; tracing
               (mpidist.trace) times module calls here. None registered costs one dict check per call.
  post-accumulate-grad hook ``Parameter.register_post_accumulate_grad_hook(fn)``: ``fn(param)`` once per
               backward, when the parameter's gradient for that backward is final (a tied parameter fires
               once, after its last use).

Parameter storage may be swapped from outside (FSDP frees ``param.data`` after a unit's forward and
gathers it before the unit runs again), so layers read ``self.weight`` at the moment of use and never
keep arrays or shapes of parameters.
"""

import itertools
from collections import OrderedDict, namedtuple

import numpy as np

from mpidist.nn.autograd import Tensor, _add_hook, is_grad_enabled, no_grad  # noqa: F401 (re-exported)
from mpidist.nn.deferred import DeferredArray, _on_child, _on_register
from mpidist.nn.recompute import recompute
from mpidist.xp import copy_into

__all__ = ["Parameter", "Module", "Sequential", "ModuleList", "ModuleDict", "no_grad", "is_grad_enabled",
           "register_module_forward_pre_hook", "register_module_forward_hook"]


class Parameter(Tensor):
    """A trainable leaf tensor: ``data``, and the ``grad`` that backward accumulates."""

    def __init__(self, data, requires_grad=True):
        if isinstance(data, DeferredArray):  # no values yet (mpidist.nn.deferred): Tensor would ask for them
            super().__init__(np.empty((0,), dtype=data.dtype))
            self.data = data
        else:
            super().__init__(data.data if isinstance(data, Tensor) else data)
        self.version = 0
        self.placement = None  # where its values lie across ranks (mpidist.nn.placement); None: whole, here
        self._post_accumulate_grad_hooks = None
        if requires_grad:
            self.requires_grad_(True)

    def make_writable(self):
        """Return ``data``, first moved to a writable copy if it is read-only (an elastic commit holds it:
        copy-on-write), so that writing into it in place leaves the commit as it is."""
        if not getattr(getattr(self.data, "flags", None), "writeable", True):
            self.data = self.data.copy()
        return self.data

    def register_post_accumulate_grad_hook(self, fn):
        """Call ``fn(param)`` when a backward has finished accumulating into ``grad``; return a handle."""
        return _add_hook(self, "_post_accumulate_grad_hooks", fn)

    def __repr__(self):
        deferred = ", deferred" if isinstance(self.data, DeferredArray) else ""
        return f"Parameter(shape={self.data.shape}, dtype={self.data.dtype}{deferred})"


_IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])


class _Handle:
    _ids = itertools.count()

    def __init__(self, registry):
        self.registry = registry
        self.id = next(self._ids)

    def remove(self):
        self.registry.pop(self.id, None)


def _register(registry, entry, prepend):
    handle = _Handle(registry)
    registry[handle.id] = entry
    if prepend:
        registry.move_to_end(handle.id, last=False)
    return handle


_global_forward_pre_hooks = OrderedDict()
_global_forward_hooks = OrderedDict()


def register_module_forward_pre_hook(hook):
    """Call ``hook(module, args)`` before every module's forward (before its own pre-hooks); return a handle.

    It may return new args, as a module's own pre-hook may.
    """
    return _register(_global_forward_pre_hooks, (hook, False), False)


def register_module_forward_hook(hook):
    """Call ``hook(module, args, output)`` after every module's forward (before its own hooks); return a handle."""
    return _register(_global_forward_hooks, (hook, False), False)


class Module:
    """Base class: registers parameters, children and buffers; ``__call__`` runs hooks around forward."""

    def __init__(self):
        object.__setattr__(self, "_params", OrderedDict())
        object.__setattr__(self, "_children", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_forward_pre_hooks", OrderedDict())
        object.__setattr__(self, "_forward_hooks", OrderedDict())
        object.__setattr__(self, "training", True)
        # Recompute this module's activations in backward instead of keeping them (``checkpoint``).
        object.__setattr__(self, "activation_checkpointing", False)

    def __setattr__(self, name, value):
        if "_params" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__}: cannot assign '{name}' before Module.__init__() is called")
        if isinstance(value, (Parameter, Module)):
            registry, other = (self._params, self._children) if isinstance(value, Parameter) else \
                (self._children, self._params)
            other.pop(name, None)
            self._buffers.pop(name, None)
            # A deferred parameter is named by where it is first registered (its initial values depend on it).
            (_on_register if registry is self._params else _on_child)(self, name, value)
            # Assigning to an existing key keeps its place: replacing Sequential's child "0" must not
            # move it to the end (nor a replaced parameter to the end of state_dict and DDP's buckets).
            registry[name] = value
            object.__setattr__(self, name, value)
            return
        self._params.pop(name, None)
        self._children.pop(name, None)
        if name in self._buffers:
            self._buffers[name] = value
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        for registry in (self._params, self._children, self._buffers):
            registry.pop(name, None)
        object.__delattr__(self, name)

    # -- calling -----------------------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        if not (self._forward_pre_hooks or self._forward_hooks or self.activation_checkpointing
                or _global_forward_pre_hooks or _global_forward_hooks):
            return self.forward(*args, **kwargs)
        pre_hooks = self._forward_pre_hooks.values()
        if _global_forward_pre_hooks:
            pre_hooks = [*_global_forward_pre_hooks.values(), *pre_hooks]
        for hook, with_kwargs in list(pre_hooks):
            if with_kwargs:
                result = hook(self, args, kwargs)
                if result is not None:
                    args, kwargs = result
            else:
                result = hook(self, args)
                if result is not None:
                    args = result if isinstance(result, tuple) else (result,)
        if self.activation_checkpointing and is_grad_enabled():
            # Inside the hooks: FSDP's pre-hook has gathered the parameters the recompute reads.
            out = recompute(self.forward, *args, **kwargs)
        else:
            out = self.forward(*args, **kwargs)
        hooks = self._forward_hooks.values()
        if _global_forward_hooks:
            hooks = [*_global_forward_hooks.values(), *hooks]
        for hook, with_kwargs in list(hooks):
            result = hook(self, args, kwargs, out) if with_kwargs else hook(self, args, out)
            if result is not None:
                out = result
        return out

    def forward(self, *args, **kwargs):
        """Compute the output; autograd records what backward needs."""
        raise NotImplementedError(f"{type(self).__name__}: forward() is not implemented")

    def register_forward_pre_hook(self, hook, *, prepend=False, with_kwargs=False):
        """Call ``hook(module, args)`` (or ``(module, args, kwargs)``) before forward; it may return new args."""
        return _register(self._forward_pre_hooks, (hook, with_kwargs), prepend)

    def register_forward_hook(self, hook, *, prepend=False, with_kwargs=False):
        """Call ``hook(module, args, output)`` (or with kwargs) after forward; it may return a new output."""
        return _register(self._forward_hooks, (hook, with_kwargs), prepend)

    # -- traversal (deterministic, rank-independent order) ----------------------------------------------

    def named_children(self):
        """Yield ``(name, child)`` in registration order."""
        yield from self._children.items()

    def children(self):
        """Yield direct children in registration order."""
        yield from self._children.values()

    def named_modules(self, prefix="", memo=None):
        """Yield ``(name, module)`` for self and all descendants, pre-order; a shared module once."""
        memo = set() if memo is None else memo
        if id(self) in memo:
            return
        memo.add(id(self))
        yield prefix, self
        for name, child in self._children.items():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name, memo)

    def modules(self):
        """Yield self and all descendants, pre-order."""
        for _, m in self.named_modules():
            yield m

    def named_parameters(self, prefix="", remove_duplicate=True):
        """Yield ``(name, param)``: own params in registration order, then children's; shared params once."""
        seen = set()
        for mod_name, m in self.named_modules(prefix):
            for name, p in m._params.items():
                if p is None or (remove_duplicate and id(p) in seen):
                    continue
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
                if b is not None:
                    yield (f"{mod_name}.{name}" if mod_name else name), b

    def buffers(self):
        """Yield all buffers."""
        for _, b in self.named_buffers():
            yield b

    def apply(self, fn):
        """Call ``fn(module)`` on every descendant, then on self (PyTorch's order); return self."""
        for child in self._children.values():
            child.apply(fn)
        fn(self)
        return self

    # -- state ------------------------------------------------------------------------------------------

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
        params = dict(self.named_parameters())
        for name, dst in own.items():
            if name in state_dict:
                p = params.get(name)
                copy_into(dst if p is None else p.make_writable(), state_dict[name])
        return _IncompatibleKeys(missing, unexpected)

    # -- modes and grads --------------------------------------------------------------------------------

    def train(self, mode=True):
        """Set training mode on self and all descendants; return self."""
        for m in self.modules():
            object.__setattr__(m, "training", bool(mode))
        return self

    def eval(self):
        """Set evaluation mode (dropout off, batch norm uses running statistics); return self."""
        return self.train(False)

    def requires_grad_(self, requires_grad=True):
        """Set ``requires_grad`` on every parameter; return self."""
        for p in self.parameters():
            p.requires_grad_(requires_grad)
        return self

    def zero_grad(self, set_to_none=True):
        """Set every parameter's grad to None (the default, as in PyTorch), or zero it in place."""
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
    """Run children in order.

    ``names``: optional, what each child is called in the model this one was cut from (``"embed"``,
    ``"blocks.3"``, ``"head"`` for a stage of a GPT); None when it was cut from nothing. The children keep their
    positional names ("0", "1", ...) as module paths; a pipeline names the stage's parameters by ``names``
    (``mpidist.parallel.Pipeline.placed_parameters``), so checkpoints and full-model gathers key them as the
    unsplit model does.
    """

    names = None  # set per instance by __init__

    def __init__(self, *modules, names=None):
        super().__init__()
        for i, m in enumerate(modules):
            if not isinstance(m, Module):
                raise TypeError(f"Sequential: argument {i} is not a Module (got {type(m).__name__})")
            setattr(self, str(i), m)
        if names is not None:
            names = tuple(names)
            if len(names) != len(modules) or len(set(names)) != len(names) or \
                    not all(isinstance(n, str) and n for n in names):
                raise ValueError(f"Sequential: names must be {len(modules)} distinct non-empty strings, one per "
                                 f"module (got {list(names)!r})")
        object.__setattr__(self, "names", names)

    def __getitem__(self, i):
        items = list(self._children.values())
        if isinstance(i, slice):
            return Sequential(*items[i], names=None if self.names is None else self.names[i])
        return items[i]

    def __len__(self):
        return len(self._children)

    def __iter__(self):
        return iter(self._children.values())

    def forward(self, x):
        """Feed ``x`` through every child in order."""
        for m in self._children.values():
            x = m(x)
        return x


class ModuleList(Module):
    """A list of modules, registered so that their parameters are found."""

    def __init__(self, modules=()):
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, module):
        """Add ``module`` at the end; return self."""
        if not isinstance(module, Module):
            raise TypeError(f"ModuleList.append: not a Module (got {type(module).__name__})")
        setattr(self, str(len(self._children)), module)
        return self

    def __getitem__(self, i):
        items = list(self._children.values())
        return ModuleList(items[i]) if isinstance(i, slice) else items[i]

    def __len__(self):
        return len(self._children)

    def __iter__(self):
        return iter(self._children.values())


class ModuleDict(Module):
    """A dict of modules, registered in insertion order."""

    def __init__(self, modules=None):
        super().__init__()
        for name, m in (modules or {}).items():
            self[name] = m

    def __setitem__(self, name, module):
        if not isinstance(module, Module):
            raise TypeError(f"ModuleDict: '{name}' is not a Module (got {type(module).__name__})")
        setattr(self, name, module)

    def __getitem__(self, name):
        return self._children[name]

    def __contains__(self, name):
        return name in self._children

    def __len__(self):
        return len(self._children)

    def __iter__(self):
        return iter(self._children)

    def keys(self):
        return self._children.keys()

    def values(self):
        return self._children.values()

    def items(self):
        return self._children.items()
