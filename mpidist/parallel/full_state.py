"""The unsplit model's state under any layout: gathered onto one rank one tensor at a time, and scattered back.

Reads a layout only through the wrapper interface (``as_wrapper(obj).placed_parameters()``,
``named_buffers_global()``, ``mesh.comm``) and ``nn.placement.boxes``, so it works for every wrapper that
implements it: a plain or tensor-parallel module, DDP, FSDP, Pipeline, and their combinations on a mesh.

Glossary:
- catalog: what every rank holds, as metadata only: per tensor its unsplit name, global shape, dtype, pipeline
  stage and the boxes of it this rank holds. One allgather of the catalogs is the only collective of a gather
  or load besides the point-to-point transfers (and, with ``all_ranks``, one broadcast per tensor).
- holder of a box: a rank whose local array holds that box of the global tensor. Replicas (DDP ranks, FSDP's
  replicate groups, copies of a tied weight) hold equal boxes; a gather reads each distinct box from its
  lowest holder, a load writes every holder's copy.
- streaming: the root assembles one tensor, hands it out, and only then asks for the next one. Senders use
  blocking sends in the root's receive order, so a large box waits for the root's receive (MPI's rendezvous)
  and at most the current tensor is in transit; small boxes may sit in MPI's eager buffers.

bfloat16 (``ml_dtypes``) travels as the collectives carry every copy of it, its uint16 bit patterns
(``mpidist.wire``): nothing here reduces, so the bytes are the values. ``dtype=`` casts the floating tensors on
the root after the transfer (a bfloat16 model written as float32 exactly, or a float32 one rounded to bfloat16).

Tensors come in the unsplit model's ``state_dict()`` order: parameters by pipeline stage and then by their
order on the ranks that hold them, then buffers. Non-primary copies of a tied weight are not gathered (the
primary is), but a load writes them too.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Dict, Iterator, Optional, Tuple

import numpy as np

from .. import collectives, wire
from ..comm.agree import describe_ranks, raise_if_any
from ..nn.placement import boxes, check_tiling, global_shape
from ..nn.precision import as_dtype, bfloat16, is_floating
from ..xp import copy_into, get_array_module, to_numpy
from .interface import as_wrapper, placement_comms

__all__ = ["iter_full_state", "full_state_dict", "load_full_state_dict", "full_optimizer_state_dict"]

# Point-to-point tag of full-state transfers; far from the small tags user code tends to pick.
_TAG = 0x5E57


def _check_dtype(fn, dtype):
    """Return ``dtype`` (None, a name such as "bf16", or a dtype) as None or float16, bfloat16 or float32."""
    return None if dtype is None else as_dtype(dtype, f"{fn}: dtype")


def _cast(array, dtype):
    """Return ``array`` with a floating dtype cast to ``dtype`` (None: as it is); integers and bools stay."""
    if array is None or dtype is None or not is_floating(array.dtype):
        return array
    return array.astype(dtype, copy=False)


class _Tensor:
    """One tensor of the unsplit model as every rank holds it: name, shape, dtype, stage, holders of each box."""

    def __init__(self, name, shape, dtype, stage, is_buffer):
        self.name, self.shape, self.dtype, self.stage, self.is_buffer = name, shape, dtype, stage, is_buffer
        self.optimizer = {}  # rank -> its primary copy's optimizer state entry (_optimizer_entry), if asked
        self.sources = {}   # (offsets, sizes) -> ranks holding it as a primary copy (gather reads from these)
        self.holders = {}   # (offsets, sizes) -> ranks holding any copy (a load writes all of these)


def _local_entries(wrapper, writable):
    """Return this rank's ``[(name, array, [Box], stage, primary, is_buffer, global shape, Parameter or None)]``,
    parameters then buffers; with ``writable`` a parameter held read-only (an elastic commit's) is first copied
    (copy-on-write)."""
    out = []
    for p in wrapper.placed_parameters():
        data = p.parameter.make_writable() if writable else p.parameter.data
        out.append((p.name, data, boxes(p.placement, data.shape, p.name), p.stage, p.primary, False,
                    global_shape(p.placement, data.shape), p.parameter))
    for name, buf in wrapper.named_buffers_global():
        out.append((name, buf, boxes(None, buf.shape, name), None, True, True, tuple(buf.shape), None))
    return out


def _optimizer_entry(optimizer, param, index):
    """Return ``{key: ("array", dtype) | ("value", value)}`` of ``optimizer``'s state for ``param``, or None when
    ``param`` is not one of its parameters or has no state yet; arrays are those shaped like the parameter (moments), the rest values."""
    i = index.get(id(param))
    if i is None or not optimizer.state.get(i):  # not its parameter, or no state yet (before the first step)
        return None
    out = {}
    for key, value in optimizer.state[i].items():
        if key.startswith("_"):
            continue
        if hasattr(value, "shape") and tuple(value.shape) == tuple(param.data.shape) and value.ndim:
            out[key] = ("array", np.dtype(value.dtype))
        else:
            out[key] = ("value", value.item() if hasattr(value, "item") else value)
    return out


def _spans_ranks(wrapper):
    """Return whether ``wrapper`` holds only part of the model here: pipeline stages, placements over several
    ranks, or communicators of its own."""
    placed = wrapper.placed_parameters()
    return (any(p.stage is not None for p in placed) or bool(wrapper.communicators())
            or any(c.Get_size() > 1 for c in placement_comms(placed)))


def _merge_order(lists):
    """Return the names of ``lists`` (each in one consistent order) merged, each list's order kept."""
    order, known = [], set()
    for names in lists:
        at = 0  # where this list's next new name goes: after the last name of it already placed
        for name in names:
            if name in known:
                at = order.index(name) + 1
                continue
            order.insert(at, name)
            known.add(name)
            at += 1
    return order


class _Layout:
    """The catalog of every rank (one allgather) and this rank's local arrays, by unsplit name."""

    def __init__(self, obj, comm, fn, writable=False, optimizer=None):
        wrapper = as_wrapper(obj)
        self.comm = wrapper.mesh.comm if comm is None else comm
        if self.comm is None and _spans_ranks(wrapper):
            raise TypeError(f"{fn}: the layout of {type(obj).__name__} spans several ranks but no one communicator of "
                            f"its own holds them all (its mesh.comm is None, e.g. a Pipeline given a dp_comm): pass "
                            f"comm=, the communicator over every rank holding a part of the model")
        self.size = 1 if self.comm is None else self.comm.Get_size()
        self.me = 0 if self.comm is None else self.comm.Get_rank()
        problem, entries = None, []
        try:
            entries = _local_entries(wrapper, writable)
            if optimizer is not None and hasattr(optimizer, "flat_pieces"):
                raise TypeError(f"{type(optimizer).__name__} keeps flat shards of its parameters' state, not state "
                                f"shaped like them; mpidist.checkpoint saves it (and loads it into the plain optimizer "
                                f"at any size)")
        except (TypeError, ValueError) as exc:  # a placement that does not fit: every rank must hear of it
            problem = f"{type(exc).__name__}: {exc}"
        index = {} if optimizer is None else {id(p): i for i, p in enumerate(optimizer.params)}
        groups = [] if optimizer is None else [
            ({k: v for k, v in g.items() if k != "params"}, [name for name, *_, param in entries
                                                              if any(param is q for q in g["params"])])
            for g in optimizer.param_groups]
        catalog = [(name, shape, np.dtype(array.dtype), stage, primary, is_buffer, [(b.offsets, b.sizes) for b in held],
                    None if optimizer is None or param is None else _optimizer_entry(optimizer, param, index))
                   for name, array, held, stage, primary, is_buffer, shape, param in entries]
        mine = (problem, catalog, groups)
        everyone = [mine] if self.comm is None else self.comm.allgather(mine)  # the one collective of the catalog
        problems = [p for p, _, _ in everyone]
        if any(problems):
            raise ValueError(f"{fn}: {describe_ranks(problems)}")
        self.local = {}  # name -> [(array, Box, primary, Parameter or None)] this rank holds (every copy)
        for name, array, held, _, primary, _, _, param in entries:
            self.local.setdefault(name, []).extend((array, box, primary, param) for box in held)
        self.groups = [g for _, _, g in everyone]  # every rank's optimizer groups: (hyperparameters, names)
        self.tensors = self._build(fn, [c for _, c, _ in everyone])

    def _build(self, fn, catalogs):
        tensors, param_lists, buffer_lists = {}, [], []
        for rank, catalog in enumerate(catalogs):
            # Order from primary copies only: a tied weight's further copy sits elsewhere in its stage's list.
            param_lists.append([e[0] for e in catalog if not e[5] and e[4]])
            buffer_lists.append([e[0] for e in catalog if e[5]])
            for name, shape, dtype, stage, primary, is_buffer, held, opt in catalog:
                if dtype not in wire.SUPPORTED_DTYPES:  # found here, on every rank: a send of it fails on one side
                    raise ValueError(f"{fn}: {name!r} has dtype {dtype} on rank {rank}, which mpidist's collectives "
                                     f"do not carry (supported: {', '.join(d.name for d in wire.SUPPORTED_DTYPES)})")
                t = tensors.get(name)
                if t is None:
                    t = tensors[name] = _Tensor(name, tuple(shape), dtype, stage, is_buffer)
                elif (t.shape, t.dtype, t.is_buffer) != (tuple(shape), dtype, is_buffer):
                    raise ValueError(f"{fn}: ranks disagree about {name!r}: shape {t.shape}, dtype {t.dtype} on "
                                     f"the first rank holding it, shape {tuple(shape)}, dtype {dtype} on rank {rank}")
                if primary and stage is not None:
                    t.stage = stage
                if primary and opt is not None:
                    t.optimizer.setdefault(rank, opt)
                for box in held:
                    key = (tuple(box[0]), tuple(box[1]))
                    t.holders.setdefault(key, []).append(rank)
                    if primary:
                        t.sources.setdefault(key, []).append(rank)
        for t in tensors.values():
            by_rank = [[] for _ in catalogs]
            for key, ranks in t.sources.items():
                for r in ranks:
                    by_rank[r].append(key)
            wrong = check_tiling(t.name, t.shape, by_rank)
            if wrong is not None:
                raise ValueError(f"{fn}: {wrong} (the communicator must span every rank that holds a part of the "
                                 f"model: pass comm=, e.g. the mesh's world communicator)")
        params = _merge_order(param_lists)
        # Pipeline stages first (a rank's list already runs in stage order), then the order within a stage.
        params.sort(key=lambda name: -1 if tensors[name].stage is None else tensors[name].stage)
        return [tensors[name] for name in params + _merge_order(buffer_lists)]

    def primary_boxes(self, name, read=None):
        """Return ``{(offsets, sizes): (array, Box)}`` for this rank's primary copy of ``name``; ``read(Parameter)``,
        if given, names the array to read instead of the parameter's own (an optimizer moment shaped like it)."""
        return {(box.offsets, box.sizes): (array if read is None else read(param), box)
                for array, box, primary, param in self.local.get(name, ()) if primary}

    def all_boxes(self, name):
        """Return ``{(offsets, sizes): [(array, Box)]}`` for every copy of ``name`` this rank holds."""
        out = {}
        for array, box, _, _ in self.local.get(name, ()):
            out.setdefault((box.offsets, box.sizes), []).append((array, box))
        return out


def _index(offsets, sizes):
    return tuple(slice(o, o + n) for o, n in zip(offsets, sizes)) or ...


def _gather_one(layout, t, root, read=None, dtype=None):
    """Return tensor ``t`` assembled on ``root`` (None elsewhere): each distinct box from its lowest holder.

    ``read(Parameter)`` and ``dtype``: gather an array shaped like the parameter (an optimizer moment) instead.
    """
    mine = layout.primary_boxes(t.name, read)
    full = np.empty(t.shape, dtype=t.dtype if dtype is None else dtype) if layout.me == root else None
    for key in sorted(t.sources):
        source = min(t.sources[key])
        if layout.me == root:
            if source == root:
                array, box = mine[key]
                piece = box.view(array)
            else:
                piece = collectives.recv(source, layout.comm, tag=_TAG)
            full[_index(*key)] = to_numpy(piece)
        elif layout.me == source:
            array, box = mine[key]
            view = box.view(array)
            collectives.send(get_array_module(view).ascontiguousarray(view), root, layout.comm, tag=_TAG)
    return full


def _check_root(fn, comm, rank):
    size = 1 if comm is None else comm.Get_size()
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < size:
        raise ValueError(f"{fn}: rank must be a rank of the communicator, 0..{size - 1} (got {rank!r})")


def iter_full_state(obj, comm=None, *, rank=0, dtype=None) -> Iterator[Tuple[str, Optional[np.ndarray]]]:
    """Yield (name, full numpy array on ``rank``, None elsewhere) in the unsplit model's order, one tensor at a time.

    ``obj``: a wrapper (DDP, FSDP, Pipeline) or an ``nn.Module`` (plain or tensor-parallel). Collective over
    ``comm`` (default ``as_wrapper(obj).mesh.comm``), which must span every rank holding a part of the model (for
    DDP over a tensor-parallel model, or a Pipeline with data parallelism, pass the mesh's world communicator).
    Every rank must run the iteration to its end. The root holds the tensor being assembled and nothing else.
    ``dtype`` (float32, bfloat16, float16 or a name such as "bf16"): the floating tensors come back cast to it.
    """
    fn = "iter_full_state"
    dtype = _check_dtype(fn, dtype)
    layout = _Layout(obj, comm, fn)
    _check_root(fn, layout.comm, rank)
    for t in layout.tensors:
        yield t.name, _cast(_gather_one(layout, t, rank), dtype)


def full_state_dict(obj, comm=None, *, rank=0, all_ranks=False, dtype=None) -> Dict[str, np.ndarray]:
    """Return the unsplit model's parameters and buffers (numpy) under any layout, in its ``state_dict()`` order.

    On ``rank`` only ({} elsewhere), or on every rank with ``all_ranks`` (one broadcast per tensor). Collective
    over ``comm`` (default ``as_wrapper(obj).mesh.comm``); see ``iter_full_state``. ``dtype`` (float32, bfloat16,
    float16 or a name such as "bf16"): the floating tensors come back cast to it (default: the model's dtypes).
    """
    dtype = _check_dtype("full_state_dict", dtype)
    out = OrderedDict()
    layout = _Layout(obj, comm, "full_state_dict")
    _check_root("full_state_dict", layout.comm, rank)
    for t in layout.tensors:
        full = _gather_one(layout, t, rank)
        if all_ranks and layout.size > 1:
            if full is None:
                full = np.empty(t.shape, dtype=t.dtype)
            collectives.broadcast(full, layout.comm, root=rank)
        if full is not None:
            out[t.name] = _cast(full, dtype)
    return out


def _check_state(fn, state, tensors, strict):
    """Return (what is wrong with ``state`` for the model of ``tensors`` or None, its arrays as numpy by name).

    Everything that could fail on the root (converting a value to numpy, checking its cast) happens here, before
    the ranks agree: a failure after that point would leave the receivers waiting.
    """
    if not isinstance(state, Mapping):
        return f"{fn}: the root must pass a mapping of name -> array (got {type(state).__name__})", {}
    known = {t.name: t for t in tensors}
    missing = [name for name in known if name not in state]
    unexpected = [name for name in state if name not in known]
    if strict and (missing or unexpected):
        return f"{fn}: keys do not match the model (missing: {missing}, unexpected: {unexpected})", {}
    arrays = {}
    for name, value in state.items():
        if name not in known:
            continue
        try:
            array = np.asarray(to_numpy(value))
        except Exception as exc:  # noqa: BLE001 - any value numpy cannot take is the user's error, on every rank
            return f"{fn}: {name!r} is not an array numpy can read ({type(value).__name__}: {exc})", {}
        if array.shape != known[name].shape:
            return f"{fn}: shape mismatch for {name!r} (state_dict: {array.shape}, model: {known[name].shape})", {}
        if (array.dtype.kind not in "biufc" and array.dtype != bfloat16) or not np.can_cast(array.dtype, known[name].dtype, casting="same_kind"):
            return (f"{fn}: {name!r} has dtype {array.dtype} in the state_dict, which does not cast to the model's "
                    f"{known[name].dtype}"), {}
        arrays[name] = array
    return None, arrays


def load_full_state_dict(obj, state, comm=None, *, rank=0, strict=True, context="load_full_state_dict") -> None:
    """Scatter ``rank``'s full state (others pass None) into obj's layout one tensor at a time.

    Every holder of a box gets its copy (data-parallel replicas, copies of a tied weight). Bad keys (with
    ``strict``; without, missing tensors keep their values and unknown ones are ignored) or shapes raise ValueError
    on every rank naming them, before anything is written. ``context`` starts the error messages. Collective over
    ``comm`` (default ``as_wrapper(obj).mesh.comm``); see ``iter_full_state``.
    """
    layout = _Layout(obj, comm, context, writable=True)
    _check_root(context, layout.comm, rank)
    problem, arrays = _check_state(context, state, layout.tensors, strict) if layout.me == rank else (None, {})
    if layout.comm is None:
        if problem:
            raise ValueError(problem)
        present = None
    else:
        raise_if_any(layout.comm, problem, context)
        present = None if strict else layout.comm.bcast(
            [t.name for t in layout.tensors if t.name in state] if layout.me == rank else None, root=rank)
    present = set(t.name for t in layout.tensors) if present is None else set(present)
    for t in layout.tensors:
        if t.name not in present:
            continue
        mine = layout.all_boxes(t.name)
        if layout.me == rank:
            full = arrays[t.name].astype(t.dtype, copy=False)
            pending = []
            for key in sorted(t.holders):
                others = [holder for holder in sorted(set(t.holders[key])) if holder != rank]
                piece = np.ascontiguousarray(full[_index(*key)]) if others else None  # one copy per box, not per holder
                for holder in others:
                    pending.append(collectives.isend(piece, holder, layout.comm, tag=_TAG))
            for key, copies in mine.items():
                for array, box in copies:
                    copy_into(box.view(array), full[_index(*key)])
            for handle in pending:
                handle.wait()  # the next tensor only when this one has left
        else:
            for key in sorted(mine):
                piece = collectives.recv(rank, layout.comm, tag=_TAG)
                for array, box in mine[key]:
                    copy_into(box.view(array), piece)


def full_optimizer_state_dict(obj, optimizer, comm=None, *, rank=0) -> Dict[str, Any]:
    """Return ``optimizer``'s state by unsplit parameter name on ``rank`` ({} elsewhere), one tensor at a time.

    ``{"state": {name: {key: value}}, "param_groups": [{hyperparameters, "params": [names]}]}``: a moment shaped
    like its parameter (AdamW's ``exp_avg``) comes back as the unsplit tensor's, other values (``step``) as the
    lowest holder's; parameters without state yet are left out; groups list the names every rank puts in them,
    with the lowest such rank's hyperparameters. ``optimizer`` steps this rank's ``obj.parameters()``. Collective
    over ``comm`` (default ``as_wrapper(obj).mesh.comm``); see ``iter_full_state``.
    """
    fn = "full_optimizer_state_dict"
    layout = _Layout(obj, comm, fn, optimizer=optimizer)
    _check_root(fn, layout.comm, rank)
    index = {id(p): i for i, p in enumerate(optimizer.params)}
    state = OrderedDict()
    for t in layout.tensors:
        if t.is_buffer or not t.optimizer:
            continue
        entries = [t.optimizer[r] for r in sorted(t.optimizer)]
        holders = sorted({r for ranks in t.sources.values() for r in ranks})
        kinds = {tuple(sorted((k, v[0]) for k, v in e.items())) for e in entries}
        if any(r not in t.optimizer for r in holders) or len(kinds) > 1:
            keys = "; ".join(f"rank {r}: {sorted(t.optimizer.get(r) or {})}" for r in holders)
            raise ValueError(f"{fn}: ranks holding {t.name!r} disagree about its optimizer state keys ({keys}); "
                             f"step the optimizer over obj.parameters() on every rank")
        out = OrderedDict()
        for key, (kind, value) in entries[0].items():
            if kind == "value":
                out[key] = value
                continue
            out[key] = _gather_one(layout, t, rank, lambda param, key=key: optimizer.state[index[id(param)]][key],
                                   value)
        if layout.me == rank:
            state[t.name] = out
    if layout.me != rank:
        return {}
    order = {t.name: i for i, t in enumerate(layout.tensors)}
    groups = []
    for j in range(max((len(g) for g in layout.groups), default=0)):
        held = [g[j] for g in layout.groups if j < len(g)]
        names = sorted({name for _, group_names in held for name in group_names}, key=order.__getitem__)
        groups.append({**held[0][0], "params": names})
    return {"state": state, "param_groups": groups}
