"""Reverse-mode automatic differentiation over numpy and CuPy arrays (define-by-run, as in PyTorch).

Glossary:
  Tensor     an array ``data`` with ``requires_grad``; an op whose inputs require grad gives a tensor with a
             ``grad_fn``, the Node that turns the gradient of its outputs into gradients of its inputs.
  leaf       a tensor that requires grad and has no ``grad_fn`` (a Parameter, or an input marked
             ``requires_grad``): backward adds its gradient into ``.grad``.
  Node       one application of an op: ``edges`` (where each input's gradient goes: a Node with an output
             index, a leaf, or None when that input needs none) and ``backward(grad, needs)`` returning one
             gradient per input, computed only where ``needs[i]`` is true.
  final      a leaf's gradient is final for this backward once every edge into it has delivered: the
             engine counts edges first, so a leaf used twice (tied weights) is accumulated once, after its
             last use, and its post-accumulate-grad hooks fire once.
  deferred   ``backward_input`` computes only what leads to the given inputs and keeps, for each node that
             also feeds parameters, the gradient it received; ``DeferredWeightGrads.run()`` finishes those
             parameter gradients later (zero-bubble pipelines: B now, W in a bubble). Generic over ops: any
             op whose backward honours ``needs`` splits this way.
  hooks      as in PyTorch: a tensor's hooks fire when its gradient is computed, in any pass (``backward``,
             ``grad``, ``backward_input``, a deferred weight pass): a leaf's on the gradient it receives (the
             returned array replaces it, also in what ``grad`` returns), a computed tensor's before its node
             runs (for an output whose whole backward is deferred, when ``DeferredWeightGrads.run()`` runs it).
             A leaf's post-accumulate-grad hooks fire when its ``.grad`` is accumulated, so never in ``grad``.

Ops save the input *tensors* they need and read ``.data`` when backward runs, never a copy of a
parameter's array: FSDP frees a parameter's full array after forward and gathers it again before the
unit's backward, and the op sees the gathered one.
"""

import contextlib
import heapq
import itertools
import sys
import threading

import numpy as np

from mpidist.xp import get_array_module

__all__ = ["Tensor", "Node", "no_grad", "enable_grad", "set_grad_enabled", "is_grad_enabled", "as_tensor",
           "backward", "grad", "backward_input", "DeferredWeightGrads", "queue_callback", "weights_deferred",
           "queue_weight_callback", "make_result", "record_leaves", "unbroadcast"]

# Thread-local because simulated communicators run ranks as threads: one rank's no_grad or backward
# must not leak into another's.
_local = threading.local()


def is_grad_enabled():
    """Return False inside ``no_grad()``, True otherwise."""
    return getattr(_local, "grad_enabled", True)


class set_grad_enabled(contextlib.ContextDecorator):
    """Enable or disable graph building in this thread for the ``with`` block (or decorated function)."""

    def __init__(self, mode):
        self.mode = bool(mode)

    def __enter__(self):
        self.prev = is_grad_enabled()
        _local.grad_enabled = self.mode

    def __exit__(self, *exc):
        _local.grad_enabled = self.prev
        return False


def no_grad():
    """Run ops without building a graph (inference, evaluation, optimizer updates)."""
    return set_grad_enabled(False)


def enable_grad():
    """Build graphs again inside a ``no_grad()`` block (activation checkpointing recomputes this way)."""
    return set_grad_enabled(True)


class _HookHandle:
    """Handle returned by hook registration; ``remove()`` unregisters the hook."""

    _ids = itertools.count()

    def __init__(self, hooks):
        self._hooks = hooks
        self.id = next(self._ids)

    def remove(self):
        """Unregister the hook (idempotent)."""
        self._hooks.pop(self.id, None)


def _add_hook(owner, attr, fn):
    hooks = getattr(owner, attr)
    if hooks is None:
        hooks = {}
        setattr(owner, attr, hooks)
    handle = _HookHandle(hooks)
    hooks[handle.id] = fn
    return handle


# -- recording leaves (activation checkpointing runs forward under no_grad and still needs to know
# which parameters the block read, so that their gradients flow through the checkpoint's node) ---------

@contextlib.contextmanager
def record_leaves():
    """Collect, in first-use order, every leaf requiring grad that an op reads inside the block."""
    prev = getattr(_local, "leaf_recorder", None)
    found = {}
    _local.leaf_recorder = found
    try:
        yield found
    finally:
        _local.leaf_recorder = prev
        if prev is not None:
            prev.update(found)


class Node:
    """One op application in the graph; see the glossary."""

    __slots__ = ("name", "edges", "backward_fn", "seq", "n_out", "pre_hooks", "__weakref__")

    _seq = itertools.count()

    def __init__(self, name, edges, backward_fn, n_out=1):
        self.name = name
        self.edges = edges
        self.backward_fn = backward_fn
        # Creation order: the engine runs ready nodes latest-first, so backward visits ops in reverse
        # forward order (DDP's buckets fill in the order it planned).
        self.seq = next(Node._seq)
        self.n_out = n_out
        self.pre_hooks = None  # output index -> {id: fn(grad) -> grad or None}

    def __repr__(self):
        return f"<{self.name}Backward>"


def _edge_of(t):
    """Return where ``t``'s gradient goes: (node, output index), (leaf, 0), or None."""
    if not isinstance(t, Tensor) or not t.requires_grad:
        return None
    if t.grad_fn is not None:
        return (t.grad_fn, t.output_nr)
    return (t, 0)


def make_result(name, out, inputs, backward_fn):
    """Wrap the array ``out`` of an op on ``inputs`` into a Tensor, recording a Node if grad is needed.

    ``backward_fn(grad, needs)`` returns one gradient (or None) per entry of ``inputs``.
    """
    recorder = getattr(_local, "leaf_recorder", None)
    if recorder is not None:
        for t in inputs:
            if isinstance(t, Tensor) and t.requires_grad and t.grad_fn is None:
                recorder.setdefault(id(t), t)
    if not is_grad_enabled():
        return Tensor(out)
    edges = tuple(_edge_of(t) for t in inputs)
    if not any(edges):
        return Tensor(out)
    result = Tensor(out)
    result.requires_grad = True
    result.grad_fn = Node(name, edges, backward_fn)
    return result


def make_results(name, outs, inputs, backward_fn):
    """Like ``make_result`` for an op with several outputs; ``backward_fn`` gets a tuple of gradients
    (None for an output that received none)."""
    recorder = getattr(_local, "leaf_recorder", None)
    if recorder is not None:
        for t in inputs:
            if isinstance(t, Tensor) and t.requires_grad and t.grad_fn is None:
                recorder.setdefault(id(t), t)
    results = tuple(Tensor(o) for o in outs)
    if not is_grad_enabled():
        return results
    edges = tuple(_edge_of(t) for t in inputs)
    if not any(edges):
        return results
    node = Node(name, edges, backward_fn, n_out=len(outs))
    for i, r in enumerate(results):
        r.requires_grad = True
        r.grad_fn = node
        r.output_nr = i
    return results


def unbroadcast(g, shape):
    """Sum ``g`` over the axes that broadcasting added or stretched to reach ``g.shape`` from ``shape``."""
    if g.shape == tuple(shape):
        return g
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(i + lead for i, n in enumerate(shape) if n == 1 and g.shape[i + lead] != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return g.reshape(shape)


class Tensor:
    """An array with an optional gradient; ops on tensors record what backward needs."""

    __slots__ = ("data", "grad", "requires_grad", "grad_fn", "output_nr", "_hooks", "__weakref__", "__dict__")

    # numpy must not turn ``ndarray + Tensor`` into an object array: returning NotImplemented from its
    # ufuncs makes Python call our reflected operators.
    __array_ufunc__ = None

    def __init__(self, data, requires_grad=False):
        if isinstance(data, Tensor):
            data = data.data
        elif isinstance(data, np.generic) or (not hasattr(data, "__array_interface__")
                                              and not hasattr(data, "__cuda_array_interface__")):
            # numpy scalars (what ``a.mean()`` returns) have __array_interface__ but are not arrays:
            # __array__ must return an ndarray, and in-place updates need one.
            data = np.asarray(data)
        self.data = data
        self.grad = None
        self.grad_fn = None
        self.output_nr = 0
        self._hooks = None
        self.requires_grad = False
        if requires_grad:
            self.requires_grad_(True)

    # -- properties of the array ------------------------------------------------
    shape = property(lambda self: self.data.shape, doc="Shape of ``data``.")
    dtype = property(lambda self: self.data.dtype, doc="Dtype of ``data``.")
    ndim = property(lambda self: self.data.ndim, doc="Number of axes of ``data``.")
    size = property(lambda self: self.data.size, doc="Number of elements of ``data``.")
    is_leaf = property(lambda self: self.grad_fn is None, doc="True unless an op that needs grad made it.")

    def __len__(self):
        return len(self.data)

    def __array__(self, dtype=None, copy=None):
        a = self.data
        if get_array_module(a) is not np:
            a = a.get()
        return a if dtype is None else a.astype(dtype)

    def numpy(self):
        """Return ``data`` as a numpy array (copied from the device for CuPy)."""
        return self.__array__()

    def item(self):
        """Return the single element as a Python number."""
        return self.data.item()

    def __float__(self):
        return float(self.data)

    def __repr__(self):
        grad = f", grad_fn={self.grad_fn!r}" if self.grad_fn is not None else (
            ", requires_grad=True" if self.requires_grad else "")
        return f"tensor({self.data!r}{grad})"

    # -- autograd ---------------------------------------------------------------

    def requires_grad_(self, mode=True):
        """Mark this leaf as needing a gradient (in place); return self."""
        from mpidist.nn.precision import is_floating  # precision imports this module (Tensor, make_result)
        if mode and self.grad_fn is None and self.data.dtype.kind != "c" and not is_floating(self.data.dtype):
            raise TypeError(f"Tensor.requires_grad_: only floating point tensors can require grad "
                            f"(dtype: {self.data.dtype})")
        if not mode and self.grad_fn is not None:
            raise RuntimeError("Tensor.requires_grad_: a tensor computed by an op cannot stop requiring grad; "
                               "use detach()")
        self.requires_grad = bool(mode)
        return self

    def detach(self):
        """Return a tensor sharing ``data`` that is cut from the graph."""
        return Tensor(self.data)

    def backward(self, grad=None, retain_graph=False, inputs=None):
        """Accumulate d(self)/d(leaf) into every leaf's ``.grad`` (``grad`` defaults to 1 for a scalar)."""
        backward(self, grad, retain_graph=retain_graph, inputs=inputs)

    def register_hook(self, fn):
        """Call ``fn(grad)`` when this tensor's gradient is computed; a returned array replaces it."""
        if not self.requires_grad:
            raise RuntimeError("Tensor.register_hook: the tensor does not require grad")
        if self.grad_fn is not None:
            node = self.grad_fn
            if node.pre_hooks is None:
                node.pre_hooks = {}
            hooks = node.pre_hooks.setdefault(self.output_nr, {})
            handle = _HookHandle(hooks)
            hooks[handle.id] = fn
            return handle
        return _add_hook(self, "_hooks", fn)

    # Operators and methods are attached by mpidist.nn.functional, which owns the op definitions.


def as_tensor(x):
    """Return ``x`` if it is a Tensor, else a Tensor (not requiring grad) wrapping the array or number."""
    return x if isinstance(x, Tensor) else Tensor(x)


# -- the engine -------------------------------------------------------------------------------------------

def queue_callback(fn):
    """Run ``fn()`` once when the backward pass now running in this thread ends (e.g. DDP's final sync)."""
    queue = getattr(_local, "callbacks", None)
    if queue is None:
        raise RuntimeError("queue_callback: no backward is running in this thread")
    queue.append(fn)


def weights_deferred():
    """Return whether the backward pass running in this thread defers parameter gradients (``backward_input``)."""
    running = getattr(_local, "running", None)
    return running is not None and running.defer is not None


def queue_weight_callback(fn):
    """In a ``backward_input`` pass: run ``fn()`` when ``run()`` of its deferred weight gradients starts.

    It runs before any parameter gradient is computed, in order of queueing; ``queue_callback`` works inside
    it and during the whole weight pass (its callbacks run when that pass ends). A wrapper that gathers
    parameters for backward (FSDP) gathers them again here.
    """
    running = getattr(_local, "running", None)
    if running is None or running.defer is None:
        raise RuntimeError("queue_weight_callback: no backward_input pass is running in this thread "
                           "(check weights_deferred() first)")
    running.weight_callbacks.append(fn)


def _apply_pre_hooks(node, slot):
    """Run the tensor hooks of ``node``'s outputs on their gradients in ``slot`` (one per output), in place."""
    for index, hooks in node.pre_hooks.items():
        if slot[index] is not None:
            for fn in list(hooks.values()):
                out = fn(slot[index])
                if out is not None:
                    slot[index] = out


def _accumulate(buffers, key, index, n_out, g):
    slot = buffers.get(key)
    if slot is None:
        slot = buffers[key] = [None] * n_out
    prev = slot[index]
    if prev is None:
        slot[index] = g
    elif g is not None:
        # A fresh sum: both addends may be held elsewhere (an add's backward hands one array to both inputs).
        slot[index] = prev + g


def _accumulate_leaf(leaf, g, owned):
    """Add ``g`` into ``leaf.grad`` (keeping ``g`` itself when ``owned``), then fire the leaf's hooks."""
    if leaf._hooks:
        for fn in list(leaf._hooks.values()):
            out = fn(g)
            if out is not None:
                g, owned = out, False
    data = leaf.data
    if g.dtype != data.dtype:
        g, owned = g.astype(data.dtype), True
    if g.shape != data.shape:
        if g.size != data.size:
            raise RuntimeError(f"backward: gradient shape {g.shape} does not match the leaf's shape {data.shape}")
        g, owned = g.reshape(data.shape), False
    if leaf.grad is None:
        # Keeping the array saves a copy of every gradient; a shared one is copied, since a later in-place
        # accumulation must not write into another tensor's gradient.
        leaf.grad = g if owned else g.copy()
    else:
        if leaf.grad.shape != g.shape:
            raise RuntimeError(f"backward: gradient shape {g.shape} does not match .grad's shape "
                               f"{leaf.grad.shape}")
        # In place: DDP lets .grad be a view into its flat bucket.
        leaf.grad += g
    hooks = getattr(leaf, "_post_accumulate_grad_hooks", None)
    if hooks:
        for fn in list(hooks.values()):
            fn(leaf)


# References to a gradient that nobody else holds when _finish_leaf counts them: its local name and
# getrefcount's argument. Anything more (an add's backward handing one array to two inputs, a closure
# keeping it, another slot) means it is shared and must be copied.
_UNSHARED_REFS = 2


class _Pass:
    """One run of the engine over a graph, from seeded gradients to leaves (or captured inputs)."""

    def __init__(self, retain_graph, capture=None, follow=None, defer=None):
        self.retain_graph = retain_graph
        self.capture = capture  # ids of leaves whose gradients are returned instead of accumulated
        self.follow = follow  # None, or the ids of the nodes and leaves this pass differentiates
        self.defer = defer  # None, or a list receiving (node, grads, needs, hooked) for the weight pass
        self.weight_callbacks = []  # queue_weight_callback's functions (a deferring pass only)
        self.captured = {}

    def _followed(self, edge):
        return edge is not None and (self.follow is None or id(edge[0]) in self.follow)

    def run(self, seeds):
        """Differentiate from ``seeds``, a list of (key, output index, gradient); key: a Node or a leaf."""
        deps, stack, seen = {}, [], set()
        for key, _, _ in seeds:
            if isinstance(key, Node) and id(key) not in seen:
                seen.add(id(key))
                stack.append(key)
        # Count the edges into every node and leaf first: a key is ready once all of them delivered.
        while stack:
            node = stack.pop()
            for edge in node.edges:
                if self._followed(edge):
                    key = edge[0]
                    deps[id(key)] = deps.get(id(key), 0) + 1
                    if isinstance(key, Node) and id(key) not in seen:
                        seen.add(id(key))
                        stack.append(key)
        buffers = {}
        for key, index, g in seeds:
            _accumulate(buffers, id(key), index, key.n_out if isinstance(key, Node) else 1, g)
        ready, started = [], set()
        callbacks = []
        prev_callbacks = getattr(_local, "callbacks", None)
        prev_running = getattr(_local, "running", None)
        _local.callbacks = callbacks
        _local.running = self
        try:
            with no_grad():
                for key, _, _ in seeds:
                    if deps.get(id(key), 0) == 0 and id(key) not in started:
                        started.add(id(key))
                        if isinstance(key, Node):
                            heapq.heappush(ready, (-key.seq, id(key), key))
                        else:
                            # The caller may hold a seed's array: never keep it as .grad.
                            self._finish_leaf(key, buffers.pop(id(key)), owned=False)
                while ready:
                    _, _, node = heapq.heappop(ready)
                    self._run_node(node, buffers.pop(id(node), None) or [None] * node.n_out, deps, buffers,
                                   ready)
            # A callback may queue another (DDP finalizing after a late hook).
            i = 0
            while i < len(callbacks):
                callbacks[i]()
                i += 1
        finally:
            _local.callbacks = prev_callbacks
            _local.running = prev_running
        return self.captured

    def _run_node(self, node, slot, deps, buffers, ready):
        if node.pre_hooks:
            _apply_pre_hooks(node, slot)
        if node.backward_fn is None:
            raise RuntimeError(f"backward: the graph through {node!r} was already freed by an earlier "
                               f"backward; pass retain_graph=True to the first one to backward twice")
        grads = slot[0] if node.n_out == 1 else tuple(slot)
        del slot
        edges = node.edges
        followed = tuple(self._followed(e) for e in edges)
        keep = self.retain_graph
        if self.defer is not None:
            weight_edges = tuple(e is not None and not f for e, f in zip(edges, followed))
            if any(weight_edges):
                self.defer.append((node, grads, weight_edges, True))
                keep = True
        if grads is None or (node.n_out > 1 and all(g is None for g in grads)) or not any(followed):
            results = [None] * len(edges)
        else:
            results = list(node.backward_fn(grads, followed))
            if len(results) != len(edges):
                raise RuntimeError(f"backward: {node!r} returned {len(results)} gradients for "
                                   f"{len(edges)} inputs")
        del grads
        if not keep:
            node.backward_fn = None
        for i, edge in enumerate(edges):
            if not followed[i]:
                continue
            key, index = edge
            kid = id(key)
            g = results[i]
            results[i] = None  # the buffer holds it now: leaves count references to decide on a copy
            if g is not None:
                _accumulate(buffers, kid, index, key.n_out if isinstance(key, Node) else 1, g)
            del g
            left = deps[kid] - 1
            deps[kid] = left
            if left == 0:
                if isinstance(key, Node):
                    heapq.heappush(ready, (-key.seq, kid, key))
                else:
                    slot = buffers.pop(kid, None)
                    if slot is not None:
                        self._finish_leaf(key, slot, owned=True)
                    del slot

    def _finish_leaf(self, leaf, slot, owned):
        g = slot[0]
        slot[0] = None
        if g is None:
            return
        if self.capture is not None:
            if id(leaf) in self.capture:
                # Tensor hooks fire on a captured gradient too (PyTorch's rule); their result is what is returned.
                if leaf._hooks:
                    for fn in list(leaf._hooks.values()):
                        out = fn(g)
                        if out is not None:
                            g = out
                prev = self.captured.get(id(leaf))
                self.captured[id(leaf)] = g if prev is None else prev + g
            return
        if owned:
            owned = getattr(g, "base", None) is None and sys.getrefcount(g) <= _UNSHARED_REFS
        _accumulate_leaf(leaf, g, owned)


def _seed_grads(outputs, grads):
    outputs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    if grads is None:
        grads = [None] * len(outputs)
    elif isinstance(grads, (Tensor,)) or hasattr(grads, "__array_interface__") or \
            hasattr(grads, "__cuda_array_interface__") or np.isscalar(grads):
        grads = [grads]
    else:
        grads = list(grads)
    if len(grads) != len(outputs):
        raise ValueError(f"backward: got {len(grads)} gradients for {len(outputs)} outputs")
    seeds = []
    for i, (t, g) in enumerate(zip(outputs, grads)):
        if not isinstance(t, Tensor):
            raise TypeError(f"backward: output {i} is a {type(t).__name__}, not a Tensor")
        if not t.requires_grad:
            raise RuntimeError(f"backward: output {i} does not require grad and has no grad_fn "
                               f"(shape: {t.shape}); was it computed under no_grad() or from inputs that "
                               f"need no gradient?")
        xp = get_array_module(t.data)
        if g is None:
            if t.data.size != 1:
                raise RuntimeError(f"backward: a gradient can be implied only for a scalar output "
                                   f"(output {i} has shape {t.shape}); pass grad")
            g = xp.ones_like(t.data)
        else:
            g = g.data if isinstance(g, Tensor) else xp.asarray(g, dtype=t.data.dtype)
            if g.shape != t.data.shape:
                if g.size != t.data.size:
                    raise ValueError(f"backward: gradient {i} has shape {g.shape}, output has {t.shape}")
                g = g.reshape(t.data.shape)
        key, index = (t.grad_fn, t.output_nr) if t.grad_fn is not None else (t, 0)
        seeds.append((key, index, g))
    return seeds


def _leads_to(outputs_seeds, targets):
    """Return the ids of nodes/leaves from which some target in ``targets`` (leaf ids) is reachable."""
    order, seen, stack = [], set(), []
    for key, _, _ in outputs_seeds:
        if id(key) not in seen:
            seen.add(id(key))
            stack.append(key)
    # Iterative post-order over the graph so deep graphs do not hit the recursion limit.
    while stack:
        key = stack.pop()
        order.append(key)
        if isinstance(key, Node):
            for edge in key.edges:
                if edge is not None and id(edge[0]) not in seen:
                    seen.add(id(edge[0]))
                    stack.append(edge[0])
    leads = set(targets)
    changed = True
    # A DAG: propagate "leads to a target" from children to parents until nothing changes. Visiting in
    # reverse discovery order settles most nodes in the first sweep.
    while changed:
        changed = False
        for key in reversed(order):
            if id(key) in leads or not isinstance(key, Node):
                continue
            if any(e is not None and id(e[0]) in leads for e in key.edges):
                leads.add(id(key))
                changed = True
    return leads


def backward(tensors, grad_tensors=None, retain_graph=False, inputs=None):
    """Accumulate the gradients of ``tensors`` (weighted by ``grad_tensors``) into the leaves' ``.grad``.

    ``inputs``: accumulate only into these leaves (the rest of the graph is not differentiated).
    """
    seeds = _seed_grads(tensors, grad_tensors)
    follow = None
    if inputs is not None:
        inputs = [inputs] if isinstance(inputs, Tensor) else list(inputs)
        follow = _leads_to(seeds, {id(t) for t in inputs})
    _Pass(retain_graph, follow=follow).run(seeds)


def grad(outputs, inputs, grad_outputs=None, retain_graph=False, allow_unused=False):
    """Return the gradients of ``outputs`` with respect to ``inputs`` (leaves), accumulating nothing."""
    single = isinstance(inputs, Tensor)
    inputs = [inputs] if single else list(inputs)
    for i, t in enumerate(inputs):
        if not isinstance(t, Tensor) or not t.requires_grad or t.grad_fn is not None:
            raise RuntimeError(f"grad: input {i} must be a leaf tensor that requires grad")
    seeds = _seed_grads(outputs, grad_outputs)
    follow = _leads_to(seeds, {id(t) for t in inputs})
    captured = _Pass(retain_graph, capture={id(t) for t in inputs}, follow=follow).run(seeds)
    result = []
    for i, t in enumerate(inputs):
        g = captured.get(id(t))
        if g is None and not allow_unused:
            raise RuntimeError(f"grad: input {i} (shape {t.shape}) was not used to compute the outputs; "
                               f"pass allow_unused=True to get None for it")
        result.append(g)
    return result[0] if single else tuple(result)


class DeferredWeightGrads:
    """The parameter-gradient work that ``backward_input`` kept back; ``run()`` does it once."""

    def __init__(self, pending, callbacks=()):
        self._pending = pending
        self._callbacks = list(callbacks)  # queue_weight_callback's functions, run first

    def __len__(self):
        return 0 if self._pending is None else len(self._pending)

    def run(self):
        """Accumulate the deferred gradients into the parameters (firing their hooks); free the graph."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("DeferredWeightGrads.run: already ran")
        callbacks = []
        prev_callbacks = getattr(_local, "callbacks", None)
        _local.callbacks = callbacks  # queue_callback works in the weight pass: its callbacks run at the end
        try:
            for fn in self._callbacks:
                fn()
            seeds = []
            with no_grad():
                for node, grads, needs, hooked in pending:
                    if not isinstance(node, Node):  # an output that is itself a leaf: its hooks fire in the pass
                        seeds.append((node, 0, grads))
                        continue
                    if not hooked and node.pre_hooks:
                        # An output whose whole backward was deferred: its gradient is computed now.
                        slot = [grads] if node.n_out == 1 else list(grads)
                        _apply_pre_hooks(node, slot)
                        grads = slot[0] if node.n_out == 1 else tuple(slot)
                    if node.backward_fn is None:
                        raise RuntimeError(f"DeferredWeightGrads.run: the graph through {node!r} was already freed")
                    results = node.backward_fn(grads, needs)
                    node.backward_fn = None
                    seeds.extend((edge[0], edge[1], g) for edge, need, g in zip(node.edges, needs, results)
                                 if need and g is not None)
            if seeds:
                _Pass(retain_graph=False).run(seeds)
            i = 0
            while i < len(callbacks):
                callbacks[i]()
                i += 1
        finally:
            _local.callbacks = prev_callbacks


def backward_input(outputs, grad_outputs, inputs):
    """Return the gradients with respect to ``inputs`` now, and the parameter-gradient work for later.

    Nodes on a path to ``inputs`` run now, for those edges only; every node that also feeds something
    else requiring grad (parameters) keeps the gradient it received and its saved tensors until the
    returned ``DeferredWeightGrads.run()``. ``inputs`` (leaves) may be empty, as on a first pipeline
    stage: then all of the work is deferred.
    """
    inputs = [inputs] if isinstance(inputs, Tensor) else list(inputs)
    for i, t in enumerate(inputs):
        if not isinstance(t, Tensor) or not t.requires_grad or t.grad_fn is not None:
            raise RuntimeError(f"backward_input: input {i} must be a leaf tensor that requires grad")
    seeds = _seed_grads(outputs, grad_outputs)
    follow = _leads_to(seeds, {id(t) for t in inputs})
    pending, live, weight_only = [], [], {}
    for key, index, g in seeds:
        if id(key) in follow:
            live.append((key, index, g))
        elif isinstance(key, Node):
            # Nothing under this output leads to an input: all of it is weight work. Seeds of one node (a
            # tensor given twice, several outputs of one op) are summed into one entry: it runs once.
            if id(key) not in weight_only:
                pending.append(key)
            _accumulate(weight_only, id(key), index, key.n_out, g)
        else:
            pending.append((key, g, None, False))
    # Whole-deferred outputs: their tensor hooks have not fired (hooked=False); run() fires them.
    pending = [(key, weight_only[id(key)][0] if key.n_out == 1 else tuple(weight_only[id(key)]),
                tuple(e is not None for e in key.edges), False) if isinstance(key, Node) else key for key in pending]
    captured, callbacks = {}, ()
    if live:
        b_pass = _Pass(False, capture={id(t) for t in inputs}, follow=follow, defer=pending)
        captured = b_pass.run(live)
        callbacks = b_pass.weight_callbacks
    return [captured.get(id(t)) for t in inputs], DeferredWeightGrads(pending, callbacks)
