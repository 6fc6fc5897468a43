"""SGD, Adam and AdamW with PyTorch's update rules, updating ``param.data`` in place, and learning-rate schedules.

In place matters: FSDP hands the optimizer its shard parameters and keeps
references to their arrays, so a step must never rebind ``p.data``.

Copy-on-write (SGD, Adam, AdamW: ``copy_on_write = True``): a parameter or state array someone made read-only
(``hold``: an elastic commit keeps the step's values that way instead of copying them) is never written; the step
writes its new values into another flat buffer and moves ``p.data`` and the state views there. The update reads
and writes as many bytes either way, so keeping a step's state costs no copy. Buffers of snapshots given back
(``Optimizer.recycle``) are reused, so steady state allocates nothing.

Flat packs: a step updates the parameters of a group that share dtypes, device and step phase as one
flat array (state in flat buffers, per-parameter state entries are views of them), so the arithmetic
is a few array operations per pack rather than a dozen per parameter. Parameters whose gradient is
None (``zero_grad(set_to_none=True)``, the default) are skipped and keep their state.
"""

import gc
import math
import weakref

from mpidist.nn.precision import is_low_precision
from mpidist.xp import asarray_like, get_array_module

__all__ = ["Optimizer", "state_like", "SGD", "Adam", "AdamW", "LRScheduler", "LambdaLR", "StepLR", "LinearLR",
           "CosineAnnealingLR", "SequentialLR", "register_optimizer_step_pre_hook",
           "register_optimizer_step_post_hook"]

# Hooks every optimizer's step calls (PyTorch's global optimizer hooks): id -> hook(optimizer, args, kwargs).
# Tracing (mpidist.trace) times steps here; none registered costs one dict check per step.
_step_pre_hooks = {}
_step_post_hooks = {}


class _HookHandle:
    def __init__(self, registry, hook):
        self.registry = registry
        registry[id(self)] = hook

    def remove(self):
        """Unregister the hook (idempotent)."""
        self.registry.pop(id(self), None)


def register_optimizer_step_pre_hook(hook):
    """Call ``hook(optimizer, args, kwargs)`` before every optimizer's step; return a handle with ``remove()``."""
    return _HookHandle(_step_pre_hooks, hook)


def register_optimizer_step_post_hook(hook):
    """Call ``hook(optimizer, args, kwargs)`` after every optimizer's step; return a handle with ``remove()``."""
    return _HookHandle(_step_post_hooks, hook)


# Updating a 16-bit parameter in place loses the update: float16 has 11 bits of mantissa, so lr * step
# below about 1e-3 of the weight rounds away, and Adam's squared-gradient average underflows to 0
# (float16's smallest normal is 6e-5), turning the first step into 0/0 = NaN. So a float16 or bfloat16
# parameter gets a float32 master weight (``state[i]["master_param"]``): the update and the optimizer state
# are float32, and each step writes the master back to the parameter rounded to its dtype (mixed precision).


def _is_low(array):
    return is_low_precision(array.dtype)


def state_like(data, copy=True):
    """Return an array shaped like parameter values ``data`` in the dtype an optimizer keeps its state in: float32
    for a 16-bit parameter (its master weight and moments), else ``data``'s (a copy, or ``data`` itself without
    ``copy``). What a checkpoint loads optimizer state into."""
    if _is_low(data):
        return data.astype(get_array_module(data).float32)
    return data.copy() if copy else data


class _MasterParam:
    """What a pack updates for a 16-bit parameter: its float32 master weight and its gradient in float32."""

    __slots__ = ("data", "grad", "version")

    def __init__(self):
        self.data = self.grad = None
        self.version = 0


def _address(a):
    """Return the address of ``a``'s first element (numpy or CuPy)."""
    iface = getattr(a, "__array_interface__", None) or a.__cuda_array_interface__
    return iface["data"][0]


def _flat_view(arrays):
    """Return one 1-D view over ``arrays`` if they lie back to back in one buffer (in this order), else None."""
    first = arrays[0]
    base = first.base if first.base is not None else first
    if base.ndim != 1 or not base.flags.c_contiguous or any(not a.flags.c_contiguous for a in arrays):
        return None
    start = _address(first) - _address(base)
    if start % base.itemsize:
        return None
    at = _address(first)
    for a in arrays:
        if a.dtype != base.dtype or (a.base is not base and a is not base) or _address(a) != at:
            return None
        at += a.nbytes
    offset = start // base.itemsize
    return base[offset: offset + sum(a.size for a in arrays)]


def is_held(array):
    """Whether ``array`` is read-only (``hold``: a copy-on-write snapshot keeps it), so it must not be written.

    CuPy arrays have no such flag: never held."""
    return not getattr(getattr(array, "flags", None), "writeable", True)


def _owner(array):
    return array.base if getattr(array, "base", None) is not None else array


def hold(array):
    """Make a numpy ``array`` (and the buffer it views) read-only and return it; other arrays unchanged.

    A held parameter or optimizer state array keeps its values: a ``copy_on_write`` optimizer writes the next
    update elsewhere, and anything else that writes into it fails loudly ("assignment destination is read-only").
    """
    if can_hold(array):
        array.flags.writeable = False
        owner = _owner(array)
        if owner is not array and can_hold(owner):
            owner.flags.writeable = False
    return array


def can_hold(array):
    """Whether ``hold`` protects ``array`` (numpy arrays; CuPy arrays cannot be made read-only)."""
    return hasattr(getattr(array, "flags", None), "writeable")


class _Spares:
    """Flat buffers of released snapshots (``Optimizer.recycle``) for copy-on-write updates to reuse.

    Only buffers allocated here come back (``take`` remembers them): a parameter's own array may share its
    memory with something else of the user's. ``keep`` bounds the pool to the sizes of the packs in use, so
    buffers of packs that changed (parameters without a gradient some steps) are freed, not hoarded.
    """

    def __init__(self):
        self._free = {}
        self._mine = weakref.WeakValueDictionary()  # id -> buffer allocated by take

    def take(self, size, dtype, xp):
        free = self._free.get((size, str(dtype)))
        if free:
            return free.pop()
        buffer = xp.empty(size, dtype=dtype)
        self._mine[id(buffer)] = buffer
        return buffer

    def give(self, buffer):
        """Take ``buffer`` back if it was allocated here (else leave it to its owner); return whether it was."""
        if self._mine.get(id(buffer)) is not buffer:
            return False
        buffer.flags.writeable = True
        self._free.setdefault((buffer.size, str(buffer.dtype)), []).append(buffer)
        return True

    def keep(self, sizes):
        """Free the spare buffers whose size no pack has now (``sizes``: {(size, dtype name)})."""
        for key in [k for k in self._free if k not in sizes]:
            del self._free[key]


# Elements per block of a pack's update: 64K (256 KB of float32) keeps a block's operands in the L2
# cache between the passes of an update, which numpy runs one operation at a time. Measured on this
# machine (one thread, float32, 1M elements): p -= lr * g 0.58 ms in two whole-array passes, 0.33 ms
# in 64K blocks (16K: 0.40, 256K: 0.40); Adam's dozen passes gain more.
_BLOCK = 1 << 16


def _blocks(size):
    for start in range(0, size, _BLOCK):
        yield start, min(start + _BLOCK, size)


class _Pack:
    """Parameters of one group updated together as flat arrays (same dtypes, device and step phase).

    The optimizer state of the pack lives in flat arrays, and each parameter's ``state[i][name]`` is a
    view into them, so the update is a few array operations for the whole pack whatever the number of
    parameters; only reading the gradients in (one copy, skipped when they already lie back to back) and
    writing each parameter's update (in place: ``p.data`` is never rebound, unless it is held: see the
    module's copy-on-write) visit parameters one by one.
    """

    def __init__(self, indices, params, xp, spares):
        self.indices, self.params, self.xp, self.spares = indices, params, xp, spares
        self.spans, at = [], 0
        for p in params:
            self.spans.append((at, at + p.data.size))
            at += p.data.size
        self.size = at
        self._scratch = {}

    def scratch(self, name, dtype, size=None):
        """Return a persistent work array (allocating per step costs page faults on large models)."""
        key = (name, dtype)
        buf = self._scratch.get(key)
        if buf is None:
            buf = self._scratch[key] = self.xp.empty(self.size if size is None else size, dtype=dtype)
        return buf

    def grads(self):
        """Return every gradient as one flat array (read it only)."""
        grads = [p.grad for p in self.params]
        if len(grads) == 1 and grads[0].flags.c_contiguous:
            return grads[0].reshape(-1)
        flat = _flat_view(grads)
        if flat is not None:
            return flat
        buf = self.scratch("grad", grads[0].dtype)
        for g, (a, b) in zip(grads, self.spans):
            buf[a:b] = g.reshape(-1)
        return buf

    def data(self):
        """Return every parameter's values as one flat array (a copy unless they lie back to back)."""
        arrays = [p.data for p in self.params]
        flat = _flat_view(arrays) if len(arrays) > 1 else (arrays[0].reshape(-1) if arrays[0].flags.c_contiguous
                                                              else None)
        if flat is not None:
            return flat
        buf = self.scratch("data", arrays[0].dtype)
        for d, (a, b) in zip(arrays, self.spans):
            buf[a:b] = d.reshape(-1)
        return buf

    def state(self, opt, name, init=None):
        """Return the flat state array ``name``; each parameter's ``opt.state[i][name]`` becomes a view of it.

        Values a parameter already has (an earlier pack, ``load_state_dict``) are copied in; the others
        start as ``init`` (a flat array) or zeros.
        """
        flat = getattr(self, "_state_" + name, None)
        if flat is not None:
            return flat
        dtype = self.params[0].data.dtype
        flat = self.spares.take(self.size, dtype, self.xp)
        flat[...] = 0 if init is None else init
        for i, p, (a, b) in zip(self.indices, self.params, self.spans):
            view = flat[a:b].reshape(p.data.shape)
            old = opt.state[i].get(name)
            if old is not None:
                view[...] = old
            opt.state[i][name] = view
        setattr(self, "_state_" + name, flat)
        return flat

    def state_io(self, opt, name, init=None):
        """Return the flat state ``name`` to read and the one to write: the same array, unless it is held
        (read-only): then a spare one that every parameter's state view moves to (copy-on-write)."""
        flat = self.state(opt, name, init)
        if not is_held(flat):
            return flat, flat
        new = self.spares.take(self.size, flat.dtype, self.xp)
        for i, p, (a, b) in zip(self.indices, self.params, self.spans):
            opt.state[i][name] = new[a:b].reshape(p.data.shape)
        setattr(self, "_state_" + name, new)
        return flat, new

    def blocks(self):
        """Yield ``(a, b, grad, src, dst)`` over the pack's flat range in blocks of at most ``_BLOCK`` elements: the
        gradient there, the parameters' values to read, and where the update writes them (``dst`` may be ``src``).

        Gradients are read where they lie, so the scratch is a few blocks whatever the model's size: a block is a
        slice of one parameter (or of the whole pack when parameters and gradients lie back to back), or several
        small parameters copied into block-sized scratch (one block instead of many tiny ones) and copied back
        once the consumer has written ``dst``. If a parameter is held, the update writes into a spare flat
        buffer that the parameters move to once every block is done (see the module's copy-on-write).
        """
        arrays, grads = [p.data for p in self.params], [p.grad for p in self.params]
        new = None if not any(is_held(d) for d in arrays) else self.spares.take(self.size, arrays[0].dtype, self.xp)
        whole = _flat_view(arrays) if len(arrays) > 1 else None
        flat_grads = _flat_view(grads) if len(grads) > 1 else None
        if whole is not None and flat_grads is not None:
            for a, b in _blocks(self.size):
                src = whole[a:b]
                yield a, b, flat_grads[a:b], src, (src if new is None else new[a:b])
        else:
            run = []  # (index, span) of small contiguous parameters gathered into one block
            for i, (a, b) in enumerate(self.spans):
                if b - a < _BLOCK and arrays[i].flags.c_contiguous and grads[i].flags.c_contiguous:
                    if run and b - run[0][1][0] > _BLOCK:
                        yield from self._gathered(run, arrays, grads, new)
                        run = []
                    run.append((i, (a, b)))
                    continue
                if run:
                    yield from self._gathered(run, arrays, grads, new)
                    run = []
                yield from self._one(arrays[i], grads[i], a, new)
            if run:
                yield from self._gathered(run, arrays, grads, new)
        if new is not None:
            for p, d, (a, b) in zip(self.params, arrays, self.spans):
                p.data = new[a:b].reshape(d.shape)

    def _one(self, d, g, start, new):
        """Blocks of one parameter ``d`` (gradient ``g``) at pack offset ``start``; a non-contiguous one goes
        through a contiguous copy written back at the end."""
        xp, copied = self.xp, not d.flags.c_contiguous
        flat = (xp.ascontiguousarray(d) if copied else d).reshape(-1)
        grad = (g if g.flags.c_contiguous else xp.ascontiguousarray(g)).reshape(-1)
        for a, b in _blocks(flat.size):
            src = flat[a:b]
            yield start + a, start + b, grad[a:b], src, (src if new is None or copied else new[start + a:start + b])
        if copied:
            if new is None:
                d[...] = flat.reshape(d.shape)
            else:
                new[start:start + flat.size] = flat

    def _gathered(self, run, arrays, grads, new):
        """One block over the small parameters of ``run`` (``[(index, (a, b))]``, consecutive in the pack)."""
        if len(run) == 1:
            i, (a, b) = run[0]
            yield from self._one(arrays[i], grads[i], a, new)
            return
        start, n = run[0][1][0], min(_BLOCK, self.size)
        g = self.scratch("gathered grad", grads[run[0][0]].dtype, n)
        d = self.scratch("gathered data", arrays[run[0][0]].dtype, n)
        for i, (a, b) in run:
            g[a - start:b - start] = grads[i].reshape(-1)
            d[a - start:b - start] = arrays[i].reshape(-1)
        stop = run[-1][1][1]
        yield start, stop, g[:stop - start], d[:stop - start], d[:stop - start]
        for i, (a, b) in run:
            if new is None:
                arrays[i].reshape(-1)[...] = d[a - start:b - start]
            else:
                new[a:b] = d[a - start:b - start]

    def subtract(self, step):
        """``p.data -= step`` for every parameter (see ``_apply``)."""
        self._apply(self.xp.subtract, step)

    def scale(self, factor):
        """``p.data *= factor`` for every parameter (see ``_apply``)."""
        self._apply(self.xp.multiply, factor)

    def _apply(self, ufunc, operand):
        """``p.data = ufunc(p.data, operand)`` for every parameter (``operand``: a flat array or a scalar).

        In place; if any parameter is held (read-only), into a spare flat buffer that the parameters move to.
        """
        arrays = [p.data for p in self.params]
        flat = hasattr(operand, "shape") and operand.ndim == 1
        if not any(is_held(d) for d in arrays):
            whole = _flat_view(arrays) if len(arrays) > 1 else None
            if whole is not None:
                ufunc(whole, operand, out=whole)
                return
            for d, (a, b) in zip(arrays, self.spans):
                ufunc(d, operand[a:b].reshape(d.shape) if flat else operand, out=d)
            return
        new = self.spares.take(self.size, arrays[0].dtype, self.xp)
        for p, d, (a, b) in zip(self.params, arrays, self.spans):
            view = new[a:b].reshape(d.shape)
            ufunc(d, operand[a:b].reshape(d.shape) if flat else operand, out=view)
            p.data = view


class Optimizer:
    """Base class: holds parameters in groups with hyperparameters, and per-parameter state.

    ``step()`` updates the parameters that have a gradient in packs (per group, dtype, device and step
    phase) with one vectorized update each instead of a Python loop over parameters; see ``_Pack``.
    """

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
        self._packs = {}  # tuple of indices -> _Pack
        self._spares = _Spares()  # buffers for copy-on-write updates (see the module's docstring)
        self._packed_state = self.state  # the state dict the packs' flat arrays were made from
        self._masters = {}  # index of a 16-bit parameter -> its _MasterParam (what its packs update)
        self._written = {}  # index -> the array the last step wrote into the parameter (see _master)

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

    # Whether _update writes parameters and state only through _Pack's subtract/scale/state_io, which respect
    # held arrays (see the module's copy-on-write). A subclass that writes in place elsewhere leaves it False,
    # and an elastic commit then copies instead of holding.
    copy_on_write = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "_update" in cls.__dict__ and "copy_on_write" not in cls.__dict__:
            cls.copy_on_write = False  # its own update may write in place: it must say it does not

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_packs"] = {}  # scratch and views: rebuilt at the next step
        state["_spares"] = None  # weak references do not pickle; a fresh pool below
        state["_masters"], state["_written"] = {}, {}  # views of the state, remade at the next step
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._spares = _Spares()

    def recycle(self, released, held):
        """Reuse the flat buffers under ``released`` arrays (a dropped snapshot) for later copy-on-write updates.

        A buffer is taken only if no array of ``held`` (the snapshots still kept), no parameter and no state
        array of this optimizer lies in it: a parameter not updated since it was held still lives there.
        """
        busy = {id(_owner(a)) for a in held}
        busy.update(id(_owner(p.data)) for p in self.params)
        busy.update(id(_owner(v)) for s in self.state.values() for v in s.values() if hasattr(v, "shape"))
        given = set()
        for a in released:
            owner = _owner(a)
            if id(owner) not in busy and id(owner) not in given and can_hold(owner):
                given.add(id(owner))
                self._spares.give(owner)
        self._spares.keep({(pack.size, str(pack.params[0].data.dtype)) for pack in self._packs.values()})

    def step(self):
        """Update every parameter that has a gradient, in place."""
        if _step_pre_hooks or _step_post_hooks:
            for hook in list(_step_pre_hooks.values()):
                hook(self, (), {})
            self._step()
            for hook in list(_step_post_hooks.values()):
                hook(self, (), {})
        else:
            self._step()

    def _step(self):
        if self.state is not self._packed_state:
            # ``state`` was replaced (checkpoint.load, user code): the packs' flat state is stale
            self._packs, self._packed_state = {}, self.state
        i = 0
        for group in self.param_groups:
            packs = {}
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state.get(i)
                    if state is None:
                        state = self.state[i] = {}
                    if _is_low(p.data):
                        # Its own pack, its gradient cast to float32 just before its update (and dropped after):
                        # one parameter's float32 gradient at a time, not the whole model's.
                        self._master(i, p, state)
                        key = (i,)
                    else:
                        key = (p.data.dtype, p.grad.dtype, type(p.data), self._phase(state))
                    packs.setdefault(key, []).append(i)
                i += 1
            for indices in packs.values():
                pack = self._pack(tuple(indices))
                for index, p in zip(pack.indices, pack.params):
                    if isinstance(p, _MasterParam):
                        g = self.params[index].grad
                        p.grad = g if g.dtype == get_array_module(g).float32 else g.astype(get_array_module(g).float32)
                self._update(pack, group)
                for index, p in zip(pack.indices, pack.params):
                    if isinstance(p, _MasterParam):
                        p = self._write_back(index, p)
                    p.version += 1

    def _master(self, i, p, state):
        """Return the _MasterParam of 16-bit parameter ``i`` ready for this step: its float32 master weight
        (made from the parameter's values the first time, and again if something else put other values in
        ``p.data``: a model's ``load_state_dict`` without the optimizer's); ``_step`` gives it its gradient in float32
        just before its update (a float32 gradient is used as it is)."""
        xp = get_array_module(p.data)
        master = state.get("master_param")
        if master is None or (self._written.get(i) is not p.data and not bool(
                (master.astype(p.data.dtype) == p.data).all())):
            master = state["master_param"] = p.data.astype(xp.float32)
        proxy = self._masters.get(i)
        if proxy is None:
            proxy = self._masters[i] = _MasterParam()
        proxy.data = master
        return proxy

    def _write_back(self, i, proxy):
        """Keep the master the update wrote (maybe moved by copy-on-write), round it into parameter ``i``, and
        return that parameter."""
        p = self.params[i]
        self.state[i]["master_param"] = proxy.data
        proxy.grad = None
        if is_held(p.data):
            p.data = proxy.data.astype(p.data.dtype)
        else:
            p.data[...] = proxy.data  # rounds to nearest even; in place: FSDP keeps references to its arrays
        self._written[i] = p.data
        return p

    def _pack(self, indices):
        pack = self._packs.get(indices)
        if pack is None:
            # A different set of parameters has gradients this step: packs sharing one of them give
            # their state views up (the new pack copies the values in).
            members = set(indices)
            for key in [k for k in self._packs if members.intersection(k)]:
                del self._packs[key]
            params = [self._masters[i] if _is_low(self.params[i].data) else self.params[i] for i in indices]
            pack = self._packs[indices] = _Pack(indices, params, get_array_module(params[0].data), self._spares)
        return pack

    def _phase(self, state):
        """Return what must be equal for parameters to be updated as one pack (e.g. Adam's step count)."""
        return None

    def _update(self, pack, group):
        raise NotImplementedError(f"{type(self).__name__}: _update() is not implemented")

    def zero_grad(self, set_to_none=True):
        """Set every parameter's grad to None (the default, as in PyTorch), or zero it in place."""
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
        self._packs = {}  # the next step packs the loaded values into fresh flat state


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum, dampening, Nesterov and L2 weight decay."""

    copy_on_write = True

    def __init__(self, params, lr, momentum=0.0, weight_decay=0.0, nesterov=False, dampening=0.0):
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"SGD: hyperparameters must be >= 0 (lr: {lr}, momentum: {momentum}, "
                             f"weight_decay: {weight_decay})")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(f"SGD: nesterov needs momentum > 0 and dampening == 0 "
                             f"(momentum: {momentum}, dampening: {dampening})")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      nesterov=nesterov, dampening=dampening))

    def _phase(self, state):
        return "momentum_buffer" in state  # PyTorch's first momentum step differs from the later ones

    def _update(self, pack, group):
        xp, lr, momentum, wd = pack.xp, group["lr"], group["momentum"], group["weight_decay"]
        for i in pack.indices:
            state = self.state[i]
            state["step"] = state.get("step", 0) + 1
        if not momentum and not wd and not any(is_held(p.data) for p in pack.params):
            # Plain SGD keeps no state, so no flat gradient either: p -= lr * g block by block in place.
            dtype = xp.result_type(pack.params[0].grad.dtype, lr)
            work = pack.scratch("work", dtype, min(_BLOCK, pack.size))
            for p in pack.params:
                g, d = p.grad, p.data
                if not (g.flags.c_contiguous and d.flags.c_contiguous):
                    d -= lr * g
                    continue
                g, d = g.reshape(-1), d.reshape(-1)
                for a, b in _blocks(d.size):
                    w = work[:b - a]
                    xp.multiply(g[a:b], lr, out=w)
                    d[a:b] -= w
            return
        dtype = pack.params[0].data.dtype
        # Blocks keep operands in the CPU's cache (numpy only; on a GPU they would be many small kernels). Their
        # scratch has the parameters' dtype: bitwise the plain expressions only when the hyperparameters are
        # Python numbers (a numpy float64 lr would promote the plain expressions to float64).
        plain = all(type(group[k]) in (float, int) for k in ("lr", "momentum", "weight_decay", "dampening"))
        if (momentum and plain and pack.xp.__name__ == "numpy" and "momentum_buffer" in self.state[pack.indices[0]]
                and all(p.data.flags.c_contiguous and p.grad.flags.c_contiguous and p.grad.dtype == dtype
                        for p in pack.params)):
            self._momentum_blocks(pack, group)
            return
        d_p = pack.grads()
        if wd:
            d_p = d_p + wd * pack.data()
        if momentum:
            first = "momentum_buffer" not in self.state[pack.indices[0]]
            # PyTorch's first step copies the gradient without dampening.
            if first:
                buf = pack.state(self, "momentum_buffer", init=d_p)
            else:
                old, buf = pack.state_io(self, "momentum_buffer")  # the same array unless held
                xp.multiply(old, momentum, out=buf)                 # buf *= momentum
                buf += (1 - group["dampening"]) * d_p
            d_p = d_p + momentum * buf if group["nesterov"] else buf
        step = pack.scratch("step", xp.result_type(d_p, lr))
        xp.multiply(d_p, lr, out=step)
        pack.subtract(step)

    def _momentum_blocks(self, pack, group):
        """The update after the first, block by block (see _BLOCK), reading gradients where they lie: the
        operations and their order are the plain expressions' (parameters, gradients and state of one dtype),
        so the result is bit for bit the same; with copy-on-write the writes go to spare buffers."""
        xp, lr, momentum, wd = pack.xp, group["lr"], group["momentum"], group["weight_decay"]
        damp, nesterov = 1 - group["dampening"], group["nesterov"]
        old, buf = pack.state_io(self, "momentum_buffer")
        n = min(_BLOCK, pack.size)
        decayed = pack.scratch("decayed", buf.dtype, n)  # d_p = g + wd * p
        scaled = pack.scratch("scaled", buf.dtype, n)    # (1 - dampening) * d_p, then the step
        for a, b, g, src, dst in pack.blocks():
            bb, w, d_p = buf[a:b], scaled[:b - a], g
            if wd:
                d_p = decayed[:b - a]
                xp.multiply(src, wd, out=d_p)
                xp.add(g, d_p, out=d_p)
            xp.multiply(old[a:b], momentum, out=bb)      # buf *= momentum
            xp.multiply(d_p, damp, out=w)
            bb += w                                      # buf += (1 - dampening) * d_p
            if nesterov:
                xp.multiply(bb, momentum, out=w)
                xp.add(d_p, w, out=w)                    # d_p + momentum * buf
                xp.multiply(w, lr, out=w)
            else:
                xp.multiply(bb, lr, out=w)               # step = buf * lr
            xp.subtract(src, w, out=dst)                 # p -= step


class Adam(Optimizer):
    """Adam with L2 weight decay added to the gradient (PyTorch ``torch.optim.Adam``)."""

    _decoupled = False
    copy_on_write = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        b1, b2 = betas
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError(f"{type(self).__name__}: invalid hyperparameters (lr: {lr}, betas: {betas}, "
                             f"eps: {eps}, weight_decay: {weight_decay})")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def _phase(self, state):
        return state.get("step", 0)  # the bias corrections depend on it

    def _update(self, pack, group):
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        xp = pack.xp
        m_in, m = pack.state_io(self, "exp_avg")  # to read, to write: the same arrays unless held
        v_in, v = pack.state_io(self, "exp_avg_sq")
        for i in pack.indices:
            self.state[i]["step"] = self.state[i].get("step", 0) + 1
        t = self.state[pack.indices[0]]["step"]
        # Block by block (see _Pack.blocks): gradients are read where they lie and each block's step is
        # subtracted at once, so the scratch is a few blocks whatever the model's size. The operations, their
        # order and each intermediate's dtype are those of the plain expressions (g = g + wd * p, or
        # p *= 1 - lr * wd; m = b1 * m + (1 - b1) * g; ...; p -= step), so results are bit-for-bit the same,
        # also when grads and params differ in dtype. Dtypes come from arrays of the operands' dtypes, as numpy
        # promotes an array with a Python number.
        n = min(_BLOCK, pack.size)
        p0, g0 = pack.params[0].data, pack.params[0].grad
        l2 = bool(wd) and not self._decoupled
        if l2:
            decay_dtype = xp.result_type(p0, wd)                          # wd * p
            g_dtype = xp.result_type(g0, xp.empty(0, dtype=decay_dtype))  # g + wd * p
            decayed = pack.scratch("decayed", decay_dtype, n)
            summed = decayed if g_dtype == decay_dtype else pack.scratch("summed", g_dtype, n)
        else:
            g_dtype = g0.dtype
        work = pack.scratch("work", xp.result_type(xp.empty(0, dtype=g_dtype), 1 - b1), n)
        denom = pack.scratch("denom", v.dtype, n)
        step = pack.scratch("step", m.dtype, n)
        shrink = 1 - lr * wd if wd and self._decoupled else None
        c1, c2 = lr / (1 - b1 ** t), math.sqrt(1 - b2 ** t)
        for a, b, gb, src, dst in pack.blocks():
            k = b - a
            if l2:
                xp.multiply(src, wd, out=decayed[:k])
                gb = xp.add(gb, decayed[:k], out=summed[:k])
            mb, vb, sb = m[a:b], v[a:b], step[:k]
            w, den = work[:k], denom[:k]
            xp.multiply(gb, 1 - b1, out=w)       # (1 - b1) * g
            xp.multiply(m_in[a:b], b1, out=mb)   # m *= b1
            mb += w
            xp.multiply(gb, 1 - b2, out=w)       # (1 - b2) * g * g
            w *= gb
            xp.multiply(v_in[a:b], b2, out=vb)   # v *= b2
            vb += w
            xp.sqrt(vb, out=den)                 # v ** 0.5 / sqrt(1 - b2 ** t) + eps
            den /= c2
            den += eps
            xp.multiply(mb, c1, out=sb)          # (lr / (1 - b1 ** t)) * m / denom
            sb /= den
            if shrink is not None:
                xp.multiply(src, shrink, out=dst)  # p *= 1 - lr * wd (decoupled), before the step
                src = dst
            xp.subtract(src, sb, out=dst)        # p -= step


class AdamW(Adam):
    """Adam with decoupled weight decay ``p *= 1 - lr * wd`` (PyTorch ``torch.optim.AdamW``)."""

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


# -- learning-rate schedules ---------------------------------------------------------------------------
# optimizer -> weak references to the schedules built on it, in order; weakly keyed and outside the
# optimizer, which stays picklable and copyable, and a schedule the user dropped stops counting.
_schedules = weakref.WeakKeyDictionary()


class LRScheduler:
    """Set every parameter group's ``lr`` from a closed-form function of the step count.

    As in PyTorch: construction sets the rate for step 0, each ``step()`` advances one step (call it
    after ``optimizer.step()``), and a group's starting rate is kept as ``group["initial_lr"]``, so
    schedules built one after another on the same optimizer (``SequentialLR``) share it.
    ``state_dict()`` holds only counters: save it (``mpidist.checkpoint`` does) to resume the schedule.

    Unlike PyTorch's chainable schedules, every rate is computed from ``initial_lr`` in closed form:
    a rate set by hand is replaced at the next ``step()`` (change ``group["initial_lr"]`` instead),
    and two schedules stepping one optimizer would overwrite each other, so that raises: combine
    schedules with ``SequentialLR`` or one ``LambdaLR``.
    """

    def __init__(self, optimizer):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{type(self).__name__}: optimizer must be an mpidist.optim.Optimizer "
                            f"(got {type(optimizer).__name__})")
        self.optimizer = optimizer
        self.base_lrs = [float(group.setdefault("initial_lr", float(group["lr"]))) for group in optimizer.param_groups]
        self.last_epoch = 0
        self._owner = None  # the SequentialLR that runs this one, if any
        built = _schedules.setdefault(optimizer, [])
        built[:] = [ref for ref in built if ref() is not None] + [weakref.ref(self)]
        self._apply()

    def lr_at(self, base_lr, step):
        """Return the learning rate at ``step`` for a group that started at ``base_lr``."""
        raise NotImplementedError(f"{type(self).__name__}: lr_at() is not implemented")

    def _apply(self):
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = self.lr_at(base, self.last_epoch)

    def step(self):
        """Advance one step and set the new rates."""
        if self._owner is not None:
            raise RuntimeError(f"{type(self).__name__}.step: this schedule is run by a SequentialLR; step that instead")
        if len(self._drivers()) > 1:
            gc.collect()  # a dropped schedule caught in a reference cycle is not a driver
        drivers = self._drivers()
        if len(drivers) > 1:
            raise RuntimeError(f"{type(self).__name__}.step: {len(drivers)} schedules drive this optimizer "
                               f"({', '.join(type(s).__name__ for s in drivers)}) and would overwrite each other's "
                               f"rates; combine them with SequentialLR or one LambdaLR")
        self.last_epoch += 1
        self._apply()

    def _drivers(self):
        return [s for s in (ref() for ref in _schedules.get(self.optimizer, ())) if s is not None and s._owner is None]

    def get_last_lr(self):
        """Return the current rate of every group."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self):
        return {"last_epoch": self.last_epoch, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state_dict):
        """Continue from a saved position (the rates are set for it at once)."""
        base_lrs = list(state_dict["base_lrs"])
        if len(base_lrs) != len(self.optimizer.param_groups):
            raise ValueError(f"{type(self).__name__}.load_state_dict: {len(base_lrs)} saved groups, "
                             f"the optimizer has {len(self.optimizer.param_groups)}")
        self.last_epoch, self.base_lrs = int(state_dict["last_epoch"]), base_lrs
        self._apply()


def _check(name, value, ok, want):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise ValueError(f"{name} must be {want} (got {value!r})")
    return value


class LambdaLR(LRScheduler):
    """``lr = initial_lr * lr_lambda(step)``."""

    def __init__(self, optimizer, lr_lambda):
        if not callable(lr_lambda):
            raise TypeError(f"LambdaLR: lr_lambda must be callable (got {type(lr_lambda).__name__})")
        self.lr_lambda = lr_lambda
        super().__init__(optimizer)

    def lr_at(self, base_lr, step):
        return base_lr * self.lr_lambda(step)


class StepLR(LRScheduler):
    """``lr = initial_lr * gamma ** (step // step_size)``."""

    def __init__(self, optimizer, step_size, gamma=0.1):
        self.step_size = _check("StepLR: step_size", step_size, lambda v: isinstance(v, int) and v >= 1, "an int >= 1")
        self.gamma = _check("StepLR: gamma", gamma, lambda v: v > 0, "> 0")
        super().__init__(optimizer)

    def lr_at(self, base_lr, step):
        return base_lr * self.gamma ** (step // self.step_size)


class LinearLR(LRScheduler):
    """Scale by a factor going linearly from ``start_factor`` to ``end_factor`` over ``total_iters`` steps
    (then constant): the usual warm-up."""

    def __init__(self, optimizer, start_factor=1.0 / 3, end_factor=1.0, total_iters=5):
        self.start_factor = _check("LinearLR: start_factor", start_factor, lambda v: 0 < v <= 1, "in (0, 1]")
        self.end_factor = _check("LinearLR: end_factor", end_factor, lambda v: 0 <= v <= 1, "in [0, 1]")
        self.total_iters = _check("LinearLR: total_iters", total_iters, lambda v: isinstance(v, int) and v >= 1,
                                  "an int >= 1")
        super().__init__(optimizer)

    def lr_at(self, base_lr, step):
        done = min(step, self.total_iters) / self.total_iters
        return base_lr * (self.start_factor + (self.end_factor - self.start_factor) * done)


class CosineAnnealingLR(LRScheduler):
    """``lr = eta_min + (initial_lr - eta_min) * (1 + cos(pi * step / T_max)) / 2`` up to ``T_max``, then ``eta_min``."""

    def __init__(self, optimizer, T_max, eta_min=0.0):
        self.T_max = _check("CosineAnnealingLR: T_max", T_max, lambda v: isinstance(v, int) and v >= 1, "an int >= 1")
        self.eta_min = _check("CosineAnnealingLR: eta_min", eta_min, lambda v: v >= 0, ">= 0")
        super().__init__(optimizer)

    def lr_at(self, base_lr, step):
        step = min(step, self.T_max)
        return self.eta_min + (base_lr - self.eta_min) * (1 + math.cos(math.pi * step / self.T_max)) / 2


class SequentialLR(LRScheduler):
    """Run ``schedulers[0]`` until ``milestones[0]``, then ``schedulers[1]`` from its own step 0, and so on
    (e.g. ``LinearLR`` warm-up, then ``CosineAnnealingLR``)."""

    def __init__(self, optimizer, schedulers, milestones):
        schedulers, milestones = list(schedulers), list(milestones)
        if not schedulers or any(s.optimizer is not optimizer for s in schedulers):
            raise ValueError("SequentialLR: schedulers must be a non-empty list built on this optimizer")
        if len(milestones) != len(schedulers) - 1 or milestones != sorted(milestones) or \
                any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in milestones):
            raise ValueError(f"SequentialLR: milestones must be {len(schedulers) - 1} increasing ints >= 1 "
                             f"(got {milestones!r})")
        self.schedulers, self.milestones = schedulers, milestones
        for s in schedulers:
            s._owner = self
        super().__init__(optimizer)

    def lr_at(self, base_lr, step):
        i = sum(step >= m for m in self.milestones)
        return self.schedulers[i].lr_at(base_lr, step - (self.milestones[i - 1] if i else 0))
