"""Deferred parameters: build a model without allocating it, then materialize only what a rank holds.

``with nn.deferred(): model = GPT(cfg)`` builds the module tree with every Parameter's ``data`` a
``DeferredArray``: shape, dtype, initializer, seed and name, no elements. Anything that reads the values of such
a parameter (a forward, an optimizer, ``state_dict``) raises ``DeferredParameterError`` naming it.
``materialize(module)`` then allocates each parameter's local array and fills each box its placement holds
(``mpidist.nn.placement.boxes``: the whole tensor, a tensor-parallel slice) with the keyed draw of ``init``:
element values depend on (seed, name) only, so any layout holds bitwise the values of the whole model.
The parallel wrappers accept deferred modules and materialize the rank's part themselves (FSDP: its shard of
each unit; DDP and pipeline stages: their modules; tensor parallelism: its slices), with no broadcast. DDP and
tied pipeline copies first check that every rank deferred them under the same seed (``deferred_key``): a seed
per rank (``manual_seed(base + rank)``) would start the replicas different, so it raises on every rank.

Names: a deferred parameter's name is its ``named_parameters()`` name in the outermost module it has been
registered under (``blocks.0.attn.qkv.weight`` in a GPT). A tied parameter keeps the name it got first,
as ``named_parameters()`` lists it; a copy made for another rank (a pipeline stage's own head weight, a
tensor-parallel slice) keeps the name of what it copies, so it draws the same values.

The seed is ``deferred(seed=...)``'s, or the ``mpidist.manual_seed`` in force when the block was entered.
"""
from __future__ import annotations

import contextlib
import threading
import weakref

import numpy as np

from mpidist.nn.init import FromSource, draw_box_into
from mpidist.nn.placement import FlatShard, boxes, global_shape
from mpidist.nn.random import default_generator, initial_seed
from mpidist.xp import is_device_array

__all__ = ["deferred", "DeferredArray", "DeferredParameterError", "is_deferred", "deferred_key", "materialize",
           "new_parameter", "set_initializer", "deferred_like", "fill_boxes", "deferred_bytes", "load_deferred"]

_local = threading.local()


class DeferredParameterError(RuntimeError):
    """A deferred parameter's values were used before it was materialized."""


class _DeferredAttributeError(DeferredParameterError, AttributeError):
    """An array attribute asked of a deferred parameter's data (an AttributeError too, for ``getattr`` defaults)."""


@contextlib.contextmanager
def deferred(seed=None):
    """Build modules inside this block with deferred parameters (no arrays); ``seed`` keys their initial values.

    ``seed`` None: the seed of the last ``mpidist.manual_seed`` (0 if none). Nestable; per thread (each
    simulated rank builds its own model).
    """
    prev = getattr(_local, "seed", None)
    _local.seed = initial_seed() if seed is None else int(seed)
    try:
        yield
    finally:
        _local.seed = prev


def _deferring():
    return getattr(_local, "seed", None) is not None


class DeferredArray:
    """The ``data`` of a deferred parameter: its local shape and dtype, how and under which name it is drawn.

    It holds no elements (``nbytes`` 0); using it as an array raises ``DeferredParameterError``.
    """


    def __init__(self, shape, dtype, init, seed, name="?", top=None):
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self.init, self.seed, self.name = init, seed, name
        self._top = top  # weakref to the module ``name`` is relative to (None: not registered yet)

    ndim = property(lambda self: len(self.shape))
    size = property(lambda self: int(np.prod(self.shape, dtype=np.int64)))
    nbytes = 0
    full_nbytes = property(lambda self: self.size * self.dtype.itemsize, doc="Bytes it takes once materialized.")

    def _message(self):
        return (f"parameter {self.name!r} (shape {self.shape}, {self.dtype}) is deferred: it has no values until "
                f"materialized (mpidist.nn.materialize(model), or wrap the model in a parallel wrapper, which "
                f"materializes its part)")

    def _refuse(self, *args, **kwargs):
        raise DeferredParameterError(self._message())

    # numpy asks these before treating it as an object scalar: every use of its values raises, naming it.
    __array_ufunc__ = __array_function__ = __array__ = __getitem__ = __setitem__ = __iter__ = __len__ = __float__ = __index__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _refuse
    __matmul__ = __rmatmul__ = __neg__ = __pow__ = __iadd__ = __isub__ = __imul__ = _refuse
    reshape = astype = copy = sum = transpose = view = ravel = fill = _refuse
    T = property(_refuse)

    def __getattr__(self, attr):
        # Only for attributes it lacks (an array's flags, strides, ...): name the parameter. Protocol probes
        # (``hasattr(x, "__cuda_array_interface__")``) get a plain AttributeError.
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise _DeferredAttributeError(self._message() + f" (asked for its {attr!r})")

    def __repr__(self):
        return f"DeferredArray({self.name!r}, shape={self.shape}, dtype={self.dtype}, init={self.init})"


def deferred_key(name, param):
    """Return what fixes ``param``'s initial values: (draw name, seed) if deferred, else (``name``, "materialized").

    Ranks whose keys agree draw bitwise equal values without sending any; the parallel wrappers compare them
    across ranks before skipping a broadcast.
    """
    data = param.data
    return (data.name, data.seed) if isinstance(data, DeferredArray) else (name, "materialized")


def is_deferred(x):
    """Return True if ``x`` (a Parameter or its data) is deferred: it has no values yet."""
    # Not getattr(x, "data") of an ndarray: its memoryview raises for ml_dtypes' bfloat16 ("cannot include dtype 'E'").
    return isinstance(x, DeferredArray) or (not isinstance(x, np.ndarray)
                                            and isinstance(getattr(x, "data", None), DeferredArray))


def new_parameter(shape, init, dtype, rng=None):
    """Return a Parameter of ``shape`` initialized by ``init``: drawn now from ``rng`` (or the thread's default
    generator), or, inside ``deferred()``, deferred with ``init`` recorded."""
    from mpidist.nn.module import Parameter  # module.py imports this module (its names for deferred parameters)
    if _deferring():
        return Parameter(DeferredArray(shape, dtype, init, _local.seed))
    return Parameter(init.eager(default_generator() if rng is None else rng, shape, dtype))


def set_initializer(param, init, rng=None):
    """Re-initialize ``param`` by ``init``: draw into it now from ``rng`` (eager), or record ``init`` (deferred)."""
    data = param.data
    if isinstance(data, DeferredArray):
        data.init = init
        return
    param.make_writable()[...] = init.eager(default_generator() if rng is None else rng, data.shape, data.dtype)


def deferred_like(data, shape):
    """Return a DeferredArray of local ``shape`` drawing the same parameter as ``data`` (a slice, a copy of it)."""
    return DeferredArray(shape, data.dtype, data.init, data.seed, data.name, data._top)


def _on_register(owner, name, param):
    """Name a deferred ``param`` registered as ``owner.name``, unless an earlier module registered it (tied)."""
    data = param.data
    if isinstance(data, DeferredArray) and data._top is None:
        data.name, data._top = name, weakref.ref(owner)
        object.__setattr__(owner, "_holds_deferred", True)


def _on_child(owner, name, child):
    """Prefix with ``name`` the names of ``child``'s deferred parameters that are relative to ``child``."""
    if not child.__dict__.get("_holds_deferred"):
        return
    object.__setattr__(owner, "_holds_deferred", True)
    for p in child.parameters():
        data = p.data
        if isinstance(data, DeferredArray) and data._top is not None and data._top() is child:
            data.name, data._top = f"{name}.{data.name}", weakref.ref(owner)


def fill_boxes(data, placement, local):
    """Write into ``local`` every box of ``data``'s parameter that ``placement`` says it holds (keyed draws)."""
    gshape = _global_shape(data, placement)
    for box in boxes(placement, local.shape, data.name):
        draw_box_into(data.init, data.seed, data.name, box.view(local), box.offsets, gshape)


def _global_shape(data, placement):
    if isinstance(placement, FlatShard):
        return global_shape(placement, (0,))
    return global_shape(placement, data.shape)


def materialize(module):
    """Allocate and initialize every deferred parameter of ``module`` (its placement's boxes); return ``module``.

    A tensor-parallel slice gets its rows of the whole parameter, padding stays zero. Parameters that hold values
    already are left alone. Collective-free: every rank draws its own part.

    Arrays are allocated on the host: modules have no device of their own, so a module that already holds GPU
    arrays is refused (materialize first, then move the model) rather than left half on the host.
    """
    pending = [p for _, p in module.named_parameters() if isinstance(p.data, DeferredArray)]
    if not pending:  # nothing to draw (also: wrappers such as FSDP pass through here, holding no buffers API)
        return module
    on_device = [name for name, a in [*((n, p.data) for n, p in module.named_parameters()), *module.named_buffers()]
                 if is_device_array(a)]
    if pending and on_device:
        raise ValueError(f"materialize: {type(module).__name__} holds GPU arrays ({', '.join(on_device)}) and "
                         f"{len(pending)} deferred parameters, which are drawn on the host; materialize before "
                         f"moving the model to the GPU")
    for _, p in module.named_parameters():
        data = p.data
        if isinstance(data, DeferredArray):
            local = np.zeros(data.shape, dtype=data.dtype)
            fill_boxes(data, p.placement, local)
            p.data = local
    return module


def load_deferred(module, source, prefix=""):
    """Make ``module``'s deferred parameters take their values from ``source`` (key ``prefix + name``); return it.

    Nothing is read here: whoever materializes a parameter (``materialize``, a parallel wrapper) reads only the
    boxes it holds. Raises ValueError naming every parameter the source lacks or holds with another shape or
    dtype. ``source``: ``mpidist.sources.CheckpointSource``, ``SafetensorsSource``, or any object with
    ``shape(key)``, ``dtype(key)`` (None for a key it lacks) and ``read(key, offsets, sizes, out)``.
    """
    problems, targets = [], []
    for _, p in module.named_parameters():
        data = p.data
        if not isinstance(data, DeferredArray):
            continue
        key, shape = prefix + data.name, _global_shape(data, p.placement)
        stored = source.shape(key)
        if stored is None:
            problems.append(f"{key!r} is not in the source")
        elif tuple(stored) != tuple(shape) or np.dtype(source.dtype(key)) != data.dtype:
            problems.append(f"{key!r} is {tuple(stored)} {np.dtype(source.dtype(key))} in the source, {tuple(shape)} "
                            f"{data.dtype} in the model")
        targets.append((data, key))
    if problems:
        raise ValueError(f"load_deferred: {type(source).__name__} does not match the model: " + "; ".join(problems))
    for data, key in targets:
        data.init = FromSource(source, key)
    return module


def deferred_bytes(module):
    """Return the bytes ``module``'s deferred parameters take once materialized whole (each parameter once)."""
    return sum(p.data.full_nbytes for p in module.parameters() if isinstance(p.data, DeferredArray))
