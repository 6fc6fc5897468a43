"""Sharded, atomic, reshardable checkpoints.

Glossary:
- key: the global name of one tensor, e.g. ``model.0.weight`` or ``optim.model.0.weight.exp_avg``.
  Keys name *parameters*, never ranks or shards, so a checkpoint loads at any layout (world size, tensor
  parallel split, pipeline stages, FSDP units) and into a plain model, DDP or FSDP alike.
- chunk: an N-dimensional box of a key's global tensor, ``offsets`` and ``sizes`` per dimension, stored
  row-major and contiguous in one rank file. The chunks of a key tile its global tensor: every element is
  in exactly one chunk.
- block: what a rank holds of a key locally. A parameter without a placement, or with ``Replicate``, holds
  the whole tensor; one with ``Shard(dim, comm, global_shape, start)`` (``mpidist.nn.placement``) holds rows
  ``start ..`` along ``dim``, of which those past ``global_shape[dim]`` are padding: never saved, zero after a
  load. An optimizer's per-parameter arrays (Adam's ``exp_avg``...) are shaped like the parameter and are
  blocks of their own key in the same place.
- segment: a flat range of a local array that holds part of one key, and the boxes of the global tensor it
  holds (``mpidist.nn.placement.boxes``: padding left out). An FSDP shard holds a segment of each parameter
  it overlaps (a ``FlatShard``, read from FSDP's ``placed_parameters()``); every other array holds one
  segment, its whole block. Each box becomes a chunk.
- slot: a local array and the segments it holds.
- commit point: ``manifest.json``. Every checkpoint file goes through one writer (temporary name, fsync,
  rename, fsync of the directory), and rank 0 writes the manifest last: a checkpoint without a manifest
  does not exist. Rank files are named after their commit (``rank00003.commit7.bin``), so saving a step
  again writes beside the files its manifest lists, and the new manifest replaces the old in one rename.
  A file is removed only once no manifest lists it: a step saved again loses its previous files after its
  new manifest is in place, and a pruned step is renamed out of the ``step_*`` names before it is deleted.
  So whenever the process dies, the newest complete checkpoint stays loadable (``file_operation_hook``
  lets a test stop a save after any file operation). What a failed save leaves is removed: its temporary
  files at once, and (a killed process cannot clean up) temporary files, never-committed step directories,
  pruned steps not yet deleted and files no manifest lists when the next save starts.
- commit number: each manifest records one more than the newest committed before it; "latest" and
  pruning follow it, never file times.

Save: each rank declares its chunks (key, global shape, dtype, offsets, sizes, CRC32 of the values). Ranks
declaring the same chunk (DDP replicas, a replicated norm weight beside tensor-parallel matrices, a pipeline
stage in every data-parallel replica) must hold the same bytes: if they do not, the save fails on every rank
naming the key and which ranks hold which value, instead of keeping one of them. Distinct chunks of a key
must not overlap and must cover it. Rank 0 then gives each distinct chunk to one of its holders, balancing
the bytes each rank writes (ties to the lower rank), so a replicated tensor is written once.

Load: each rank works out the boxes its own blocks need (from its placements, FSDP layout and pipeline
position) and copies in the overlapping parts of the stored chunks, whatever layout wrote them.

Format ``mpidist-checkpoint-2``: ``ROOT/step_00000006/rank00000.commit3.bin`` (raw little-endian bytes of
this rank's chunks, read back lazily with ``numpy.memmap``, so resharding reads only what it needs) and
``manifest.json``::

    {"format": "mpidist-checkpoint-2", "step": 6, "commit": 3, "world_size": 4, "created": <time>,
     "files": {"rank00000.commit3.bin": {"bytes": 4096, "crc32": 123}, ...},
     "tensors": {"model.0.weight": {"shape": [11, 7], "dtype": "<f8",
                 "chunks": [{"file": "rank00001.commit3.bin", "offset": 0, "offsets": [0, 0], "sizes": [11, 4]},
                            ...]}},
     "json": {...}, "json_per_rank": [...]}

(files of earlier saves are named ``rank00000.bin``: a manifest names its files, whatever their names.)
``json`` holds the JSON-able state: sampler, RNG, learning-rate schedules (anything whose ``state_dict()``
is JSON-able), user extras, and per optimizer its ``type``, ``param_groups`` (hyperparameters),
``group_keys`` (the keys of each group's parameters) and ``params`` (per-parameter scalars and the names of
its arrays); older checkpoints lack ``type`` and ``group_keys``. ``json_per_rank``
appears when those differ by rank. Checkpoints of the previous format ``mpidist-checkpoint-1`` (flat
``pieces``: ``start``/``count`` ranges of the flattened tensor) still load: each piece is read as the
boxes of its flat range. The format needs nothing beyond numpy: safetensors would give the same lazy
slice reads, but the global layout has to live in a manifest anyway, and one file per rank keeps the
write path a single sequential stream.
"""

import copy
import json
import math
import numbers
import os
import stat
import time
import warnings
import zlib
from dataclasses import dataclass, replace
from typing import List, NamedTuple, Tuple

import numpy as np

from . import files, guard, standard_json
from .comm import check_comm
from .comm.agree import agreed, describe_ranks, name_ranks
from .nn.placement import Box, FlatShard, boxes, check_tiling, describe_box, first_overlap, global_shape, intersect
from .nn.module import Module
from .optim import is_held, state_like
from .parallel.interface import Wrapper, as_wrapper
from .xp import copy_into, to_numpy

__all__ = ["save", "load", "latest_step", "list_steps", "check_writable", "file_operation_hook", "FILE_OPERATIONS",
           "LoadResult", "CheckpointError", "open_step"]

FORMAT = "mpidist-checkpoint-2"
FLAT_FORMAT = "mpidist-checkpoint-1"  # flat ranges; still loaded
MANIFEST = "manifest.json"
TMP_MARK = files.TMP_MARK  # in the name of every file not yet renamed into place


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file and the problem."""


def _window(offsets, sizes, within):
    """Return the slices selecting box ``(offsets, sizes)`` inside an array that starts at ``within``."""
    return tuple(slice(o - w, o - w + n) for o, n, w in zip(offsets, sizes, within))


# -- segments and slots: where each key's values live in local arrays ---------------------------------
@dataclass(frozen=True)
class _Segment:
    """Elements ``[local_start, local_start + count)`` of a slot's (flattened) array that hold part of tensor ``key``.

    ``boxes`` (``mpidist.nn.placement.Box``, each a view of the slot's array) are its real elements; the rest
    of the range is padding.
    """

    key: str
    shape: Tuple[int, ...]          # the global tensor's
    local_start: int
    count: int
    boxes: Tuple[Box, ...]


def _segment(key, placement, local_shape, local_start=0, count=None):
    """Return the segment of a local array of ``local_shape`` under ``placement`` (the range FSDP's piece holds)."""
    try:
        held = tuple(boxes(placement, local_shape, name=key))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint: {exc}") from None
    count = math.prod(local_shape) if count is None else count
    return _Segment(key, global_shape(placement, local_shape), local_start, count, held)


class _Slot:
    """A local array plus the segments of keys it holds."""

    def __init__(self, array, segments):
        self.array = array
        self.segments = segments


def _full_slot(key, array, placement=None):
    return _Slot(array, [_segment(key, placement, array.shape)])


class _Registry:
    """Maps every Parameter object in the state to the keys it holds and the segments of its local storage.

    An optimizer's per-parameter arrays are shaped like that storage, so the same segments place them.
    """

    def __init__(self):
        self.by_param = {}  # id(Parameter) -> (keys, segments)
        self.placements = {}  # id(Parameter) -> the placement of each of its keys

    def add(self, param, keys, segments, placements=()):
        self.by_param[id(param)] = (keys, segments)
        self.placements[id(param)] = tuple(placements)


def _placed_segments(prefix, placed, local_shape):
    """Return the segments of one local array that the PlacedParameters ``placed`` share.

    One, the whole array, for an ordinary or tensor-parallel parameter; one per piece for an FSDP shard,
    whose ``FlatShard`` placements say which elements are whose (a piece's block may itself be a
    tensor-parallel shard of the global tensor). A parameter of which the shard holds nothing has none.
    """
    segments = []
    for p in placed:
        if not isinstance(p.placement, FlatShard):
            segments.append(_segment(f"{prefix}{p.name}", p.placement, local_shape))
        elif p.placement.count:
            segments.append(_segment(f"{prefix}{p.name}", p.placement, local_shape,
                                     local_start=p.placement.offset, count=p.placement.count))
    return segments


def _model_slots(name, obj, registry):
    """Return the slots of a model-like object (Module, DDP, FSDP, Pipeline) and register its parameters."""
    slots = []
    # DDP, FSDP, Pipeline, a plain or tensor-parallel module: read through the interface. A further copy of a
    # tied weight (a pipeline's last-stage head) has the tied weight's own name: it declares the same chunk.
    wrapper = as_wrapper(obj)
    sharing = {}  # the PlacedParameters of one slot: an FSDP shard holds pieces of several
    for i, placed in enumerate(wrapper.placed_parameters()):
        flat = isinstance(placed.placement, FlatShard)
        sharing.setdefault(("flat", id(placed.parameter)) if flat else i, []).append(placed)
    for placed in sharing.values():
        param = placed[0].parameter
        segments = _placed_segments(f"{name}.", placed, param.data.shape)
        slots.append(_Slot(param.data, segments))
        registry.add(param, [f"{name}.{p.name}" for p in placed], segments, [p.placement for p in placed])
    for bname, buf in wrapper.named_buffers_global():
        slots.append(_full_slot(f"{name}.{bname}", buf))
    return slots


def _is_model(obj):
    return isinstance(obj, (Wrapper, Module))


def _is_optimizer(obj):
    return hasattr(obj, "param_groups") and hasattr(obj, "state") and hasattr(obj, "params")


def _is_array(obj):
    return not _is_model(obj) and not _is_optimizer(obj) and hasattr(obj, "shape") and hasattr(obj, "dtype")


def _registered(name, i, p, registry, opt=None):
    """Return (keys, segments) of parameter ``i`` of optimizer ``name``; raise if no model in the state holds it.

    An optimizer that steps flat shards of the model's parameters (``ZeroRedundancyOptimizer``: its ``params`` are
    its shards, ``flat_pieces(i)`` the parameters' pieces each holds) has its state placed by those pieces, as an
    FSDP shard's is: each piece a ``FlatShard`` of the parameter's block, under the parameter's key."""
    if opt is not None and hasattr(opt, "flat_pieces"):
        keys, segments = [], []
        for piece in opt.flat_pieces(i):
            pkeys, _ = _registered(name, i, piece.param, registry)
            placements = registry.placements.get(id(piece.param), ())
            if len(pkeys) != 1 or any(isinstance(pl, FlatShard) for pl in placements):
                raise CheckpointError(f"checkpoint: optimizer {name!r} shards a parameter that is itself a flat shard "
                                      f"(FSDP's: {pkeys}); shard optimizer state over DDP or Pipeline replicas only")
            flat = FlatShard(placements[0] if placements else None, tuple(piece.param.data.shape), piece.start,
                             piece.count, piece.offset, getattr(opt, "comm", None))
            keys.append(pkeys[0])
            segments.append(_segment(pkeys[0], flat, p.data.shape, local_start=piece.offset, count=piece.count))
        return keys, segments
    if id(p) not in registry.by_param:
        raise CheckpointError(f"checkpoint: optimizer {name!r} holds a parameter (index {i}, shape {tuple(p.data.shape)}) "
                              f"that belongs to no model in the state; put the model in the same save() or load() call")
    return registry.by_param[id(p)]


def _state_slots(name, segments, arrays):
    """Return the slots of one parameter's optimizer arrays (``{array name: array}``), placed like the parameter."""
    return [_Slot(array, [replace(seg, key=f"{name}.{seg.key}.{k}") for seg in segments]) for k, array in arrays.items()]


def _optimizer_plan(name, opt, registry):
    """Return (slots, json) for an optimizer; its per-parameter arrays are keyed by the parameter's key.

    The JSON records the optimizer's type and which parameters each group holds, so that a load into
    another type or another grouping is refused instead of restoring state that does not belong there.
    """
    slots, params_json = [], {}
    for i, p in enumerate(opt.params):
        pkeys, segments = _registered(name, i, p, registry, opt)
        state = opt.state.get(i, {})
        arrays = sorted(k for k, v in state.items() if hasattr(v, "shape"))
        for pkey in pkeys:  # per parameter, so the checkpoint does not depend on how parameters were sharded
            params_json[pkey] = {"scalars": {k: v for k, v in state.items() if not hasattr(v, "shape")}, "arrays": arrays}
        slots.extend(_state_slots(name, segments, {k: state[k] for k in arrays}))
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    group_keys = [sorted({key for p in g["params"] for key in registry.by_param[id(p)][0]}) for g in opt.param_groups]
    return slots, {"type": _optimizer_type(opt), "param_groups": groups, "group_keys": group_keys,
                   "params": params_json}


def _optimizer_type(opt):
    """The type a checkpoint records for ``opt``: its ``state_type`` if it has one (a sharding optimizer names the
    optimizer whose state it keeps, so that state moves between the two), else its class's name."""
    return getattr(opt, "state_type", None) or type(opt).__qualname__


def _json_value(name, obj):
    """Return the JSON form of a non-tensor state entry (sampler, RNG, numbers, plain data)."""
    if isinstance(obj, np.random.Generator):
        return {"__rng__": obj.bit_generator.state}
    if hasattr(obj, "set_epoch") and hasattr(obj, "epoch"):
        return {"__sampler__": {"epoch": obj.epoch, "seed": obj.seed}}
    kind = type(obj).__name__
    if hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):  # a learning-rate schedule, say
        obj = {"__stateful__": obj.state_dict()}
    try:
        json.dumps(obj)
    except TypeError as exc:
        raise CheckpointError(f"checkpoint: state entry {name!r} of type {kind} is neither a model, an "
                              f"optimizer, an array, a sampler, a numpy Generator, an object whose state_dict() is "
                              f"JSON-serializable nor JSON-serializable ({exc})") from None
    return obj


def _plan(state):
    """Split ``state`` into (slots, json entries): models first, so optimizers can find their parameters."""
    if not isinstance(state, dict):
        raise TypeError(f"checkpoint: state must be a dict of name -> object (got {type(state).__name__})")
    registry, slots, entries = _Registry(), [], {}
    for name, obj in state.items():
        if _is_model(obj) and not _is_optimizer(obj):
            slots.extend(_model_slots(name, obj, registry))
    for name, obj in state.items():
        if _is_optimizer(obj):
            opt_slots, entries[name] = _optimizer_plan(name, obj, registry)
            slots.extend(opt_slots)
        elif _is_model(obj):
            continue
        elif _is_array(obj):
            slots.append(_full_slot(name, obj))
        else:
            entries[name] = _json_value(name, obj)
    return slots, entries


# -- agreement: an error on one rank is raised on every rank -------------------------------------
def _agree(comm, what, fn):
    """Return ``fn()``; if it raised on any rank, raise CheckpointError on every rank naming each rank's error."""
    try:
        return agreed(comm, fn, f"checkpoint {what} failed", fallback=CheckpointError)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - the agreed message (an OSError's, say) under this module's type
        raise CheckpointError(str(exc)) from exc


# -- file operations: the one writer and the hook that can stop a save between any two (mpidist.files) -------
FILE_OPERATIONS = files.FILE_OPERATIONS
file_operation_hook = files.file_operation_hook
_did, _fsync_dir, _make_dir = files.notify, files.fsync_dir, files.make_dir
_remove_quietly, _remove_tree = files.remove_quietly, files.remove_tree
_write_atomic = files.write_atomic  # (bytes, crc32) of what it wrote


def _step_dir(root, step):
    return os.path.join(root, f"step_{int(step):08d}")


def _step_dirs(root):
    """Return {step: directory} of every step directory under ``root``, committed or not."""
    if not os.path.isdir(root):
        return {}
    return {int(entry[5:]): os.path.join(root, entry) for entry in os.listdir(root)
            if entry.startswith("step_") and entry[5:].isdigit() and os.path.isdir(os.path.join(root, entry))}


def _commit_number(manifest_path):
    """Return the commit number a manifest records (-1 if it records none or cannot be read: those sort first, by step).

    A commit that is no int >= 0 (a float, a string, 1e999) makes the manifest unreadable, never a bare
    OverflowError in every later save and load of the directory.
    """
    try:
        return _manifest_commit(os.path.dirname(manifest_path))
    except CheckpointError:
        return -1


def _committed(root):
    """Return [(commit number, step)] of the committed checkpoints under ``root``, in commit order."""
    found = []
    for step, directory in _step_dirs(root).items():
        manifest = os.path.join(directory, MANIFEST)
        if os.path.exists(manifest):
            found.append((_commit_number(manifest), step))
    return sorted(found)


def list_steps(root):
    """Return the steps of committed checkpoints (those with a manifest) under ``root``, in step order."""
    return sorted(step for _, step in _committed(root))


def latest_step(root):
    """Return the most recently committed step under ``root``, or None.

    In commit order, not step order: after a run is rolled back to an older checkpoint and goes on, its
    new checkpoints are the ones to resume from, not the abandoned run's higher steps. The order is the
    commit number each manifest records (one more than the newest already there), never file times,
    which copies, clock steps and coarse file systems change.
    """
    found = _committed(root)
    return found[-1][1] if found else None


def _rank_file(rank, commit):
    """Return the name of rank ``rank``'s file in the save that becomes commit ``commit``.

    A new name per commit: saving a step again writes beside the files its manifest lists, never over them.
    """
    return f"rank{rank:05d}.commit{commit}.bin"


def _is_rank_file(name):
    return name.startswith("rank") and name.endswith(".bin")


def _remove_leftovers(root):
    """Remove what failed, killed or superseded saves left under ``root``.

    That is temporary files; step directories never committed (no manifest); pruned steps not yet deleted
    (see ``_prune``); and rank files no manifest lists (a step saved again leaves its previous files until
    its new manifest has replaced the old one). A step whose manifest cannot be read loses only its temporary files.
    """
    if not os.path.isdir(root):
        return
    for entry in sorted(os.listdir(root)):
        if entry.startswith("step_") and TMP_MARK in entry:
            _remove_tree(os.path.join(root, entry))
    for directory in _step_dirs(root).values():
        if not os.path.lexists(os.path.join(directory, MANIFEST)):
            _remove_tree(directory)
            continue
        try:
            listed = set(_manifest_json(directory)[1]["files"])
        except (CheckpointError, KeyError, TypeError):
            listed = None
        try:
            entries = sorted(os.listdir(directory))
        except OSError:
            continue
        for entry in entries:
            if TMP_MARK in entry or (listed is not None and _is_rank_file(entry) and entry not in listed):
                _remove_quietly(os.path.join(directory, entry))


def _prune(root, step):
    """Remove committed step ``step``: renamed out of the ``step_*`` names first, then deleted file by file.

    The rename is one atomic step, so a crash never leaves a listed checkpoint with some of its files gone.
    """
    directory = _step_dir(root, step)
    doomed = f"{directory}{TMP_MARK}{os.getpid()}"
    _remove_tree(doomed)  # left by an earlier prune of this process
    try:
        os.rename(directory, doomed)
    except OSError:
        return  # already gone, or cannot be moved: the checkpoint stays whole
    _did("rename", doomed)
    _fsync_dir(root)
    _remove_tree(doomed)


def check_writable(root, comm):
    """Create ``root`` if needed and check that every rank can write files there (collective).

    Call it before training, so that a read-only or mistyped checkpoint directory fails at once,
    naming the path, rather than at the first save. Raises CheckpointError on every rank.
    """
    check_comm("checkpoint.check_writable", comm)

    def probe():
        try:
            os.makedirs(root, exist_ok=True)
            path = os.path.join(root, f".write-probe.rank{comm.Get_rank():05d}{TMP_MARK}{os.getpid()}")
            with open(path, "wb") as f:
                f.write(b"ok")
            os.remove(path)
        except OSError as exc:
            raise CheckpointError(f"checkpoint directory {os.path.abspath(root)!r} is not writable "
                                  f"({exc.strerror or exc}); pass a directory this job can write to") from None

    _agree(comm, "directory check", probe)


# -- save ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Held:
    """One chunk this rank holds: where it lies in its key's global tensor, and its values (contiguous, host)."""

    key: str
    shape: Tuple[int, ...]
    dtype: str
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    data: np.ndarray

    @property
    def box(self):
        return (self.key, self.offsets, self.sizes)


def _held_chunks(slots):
    """Return the ``_Held`` chunks of every slot's segments (padding cut off)."""
    held = []
    for slot in slots:
        array = to_numpy(slot.array)
        for seg in slot.segments:
            for box in seg.boxes:
                held.append(_Held(seg.key, seg.shape, standard_json.dtype_code(array.dtype), box.offsets, box.sizes,
                                  np.ascontiguousarray(box.view(array))))
    return held


def _check_declarations(declarations):
    """Return ``{key: {box: [(rank, nbytes)]}}`` after checking that the declared chunks make one tensor per key.

    Raises CheckpointError naming the key and the ranks when ranks disagree on a key's shape or dtype,
    hold different values for one chunk, hold overlapping chunks that differ, or leave part of a key uncovered.
    """
    infos, boxes = {}, {}
    for rank, decl in enumerate(declarations):
        for key, shape, dtype, offsets, sizes, nbytes, crc in decl:
            infos.setdefault(key, {}).setdefault((tuple(shape), dtype), []).append(rank)
            boxes.setdefault(key, {}).setdefault((key, tuple(offsets), tuple(sizes)), []).append((rank, nbytes, crc))
    for key, kinds in infos.items():
        if len(kinds) > 1:
            seen = "; ".join(f"{name_ranks(r)}: shape {s}, dtype {standard_json.check_dtype(d)}" for (s, d), r in kinds.items())
            raise CheckpointError(f"checkpoint: ranks disagree on the global shape or dtype of {key!r} ({seen}); "
                                  f"every rank must build the same model")
    for key, by_box in boxes.items():
        (shape, _), = infos[key]
        for (_, offsets, sizes), holders in by_box.items():
            crcs = {}
            for rank, _, crc in holders:
                crcs.setdefault(crc, []).append(rank)
            if len(crcs) > 1:
                groups = "; ".join(f"{name_ranks(r)}: crc32 {c:#010x}" for c, r in crcs.items())
                raise CheckpointError(
                    f"checkpoint: {name_ranks(r for r, _, _ in holders)} hold different values for {key!r} "
                    f"{describe_box(shape, offsets, sizes)} ({groups}); saving would keep one of them. Give each "
                    f"sharded parameter a placement (mpidist.nn.placement.Shard) so its blocks are stored apart, "
                    f"or make the replicas equal before saving")
        by_rank = [[] for _ in declarations]
        for (_, offsets, sizes), holders in by_box.items():
            for rank, _, _ in holders:
                by_rank[rank].append((offsets, sizes))
        problem = check_tiling(key, shape, by_rank)
        if problem:
            raise CheckpointError(f"checkpoint: {problem}")
    return {key: {box: [(r, n) for r, n, _ in hs] for box, hs in by_box.items()} for key, by_box in boxes.items()}


def _assign_writers(checked, size):
    """Give each distinct chunk to one rank holding it, balancing bytes written; return the chunks per rank."""
    load_bytes, mine = [0] * size, [[] for _ in range(size)]
    chunks = [(box, holders) for by_box in checked.values() for box, holders in by_box.items()]
    for box, holders in sorted(chunks, key=lambda item: (-item[1][0][1], item[0])):
        rank = min((r for r, _ in holders), key=lambda q: (load_bytes[q], q))
        mine[rank].append(box)
        load_bytes[rank] += holders[0][1]
    return mine


def _write_rank_file(path, pieces):
    """Write this rank's chunks (``_Held``) to ``path``; return (file record, chunk records)."""
    records, offset, chunks = [], 0, []
    for piece in pieces:
        records.append({"offset": offset, "offsets": list(piece.offsets), "sizes": list(piece.sizes)})
        chunks.append(piece.data.reshape(-1).view(np.uint8))  # bytes: Python's buffers know no bfloat16
        offset += piece.data.nbytes
    nbytes, crc = _write_atomic(path, chunks)
    return {"bytes": nbytes, "crc32": crc}, records


def _check_step(where, step):
    """Raise CheckpointError unless ``step`` is an int >= 0 (a bool or a float would name another step)."""
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)) or step < 0:
        raise CheckpointError(f"{where}: step must be an int >= 0 (got {step!r})")


def _check_keep_last(keep_last):
    if keep_last is not None and (isinstance(keep_last, (bool, np.bool_)) or not isinstance(keep_last, (int, np.integer))
                                  or keep_last < 1):
        raise CheckpointError(f"checkpoint.save: keep_last must be an int >= 1, or None to keep every checkpoint "
                              f"(got {keep_last!r})")


@guard.phase("checkpoint")  # its own time limit: writing a large checkpoint takes long
def save(root, state, comm, step, keep_last=3):
    """Write ``state`` as checkpoint ``step`` under ``root``; every rank writes its own file.

    Traced (``mpidist.trace``) as one "checkpoint save" event per rank, category "io".

    Returns the checkpoint directory. Keeps the newest ``keep_last`` checkpoints (an int >= 1; None keeps
    all). ``step`` is an int >= 0; saving a step that exists replaces it. Whenever the process dies, the
    newest complete checkpoint stays loadable: the new one's files get names of their own, its manifest
    (renamed into place) commits it, and only then are the files it replaces and pruned steps removed.
    Raises CheckpointError on every rank, before anything is written, for a bad ``step`` or ``keep_last``
    or ranks passing different ones, and when ranks hold different values under one key with no
    placement saying they are shards (naming the key and the ranks).
    """
    with _io_span("checkpoint save", step):
        return _save(root, state, comm, step, keep_last)


def _save(root, state, comm, step, keep_last=3):
    check_comm("checkpoint.save", comm)
    rank, size = comm.Get_rank(), comm.Get_size()

    def declare():
        _check_step("checkpoint.save", step)
        _check_keep_last(keep_last)
        slots, entries = _plan(state)
        return _held_chunks(slots), entries

    held, entries = _agree(comm, f"save of step {step} (collecting state)", declare)
    directory = _step_dir(root, step)
    # A CRC32 per chunk lets rank 0 tell replicas that agree from ranks that hold different values under one key.
    declarations = comm.gather(((int(step), keep_last), [(h.key, h.shape, h.dtype, h.offsets, h.sizes, h.data.nbytes,
                                zlib.crc32(h.data.reshape(-1).view(np.uint8))) for h in held]), root=0)

    def assign():
        if rank != 0:
            return None
        arguments = [f"step {s}, keep_last {k}" for (s, k), _ in declarations]
        if len(set(arguments)) > 1:
            raise CheckpointError(f"checkpoint.save: ranks disagree on step and keep_last ({describe_ranks(arguments)}); "
                                  f"every rank must pass the same")
        assignment = _assign_writers(_check_declarations([d for _, d in declarations]), size)
        _remove_leftovers(root)  # of failed, killed or superseded saves; no rank of this job writes until the scatter
        commit = 1 + max((number for number, _ in _committed(root)), default=0)
        return [(boxes, commit) for boxes in assignment]

    assignment = _agree(comm, f"save of step {step} (assigning chunks)", assign)
    mine, commit_number = comm.scatter(assignment, root=0)  # no rank writes before rank 0 got here
    mine = set(mine)

    def write():
        _make_dir(directory)
        pieces = {}
        for h in held:
            if h.box in mine:
                pieces.setdefault(h.box, h)  # once, if this rank holds the same chunk twice
        pieces = list(pieces.values())
        fname = _rank_file(rank, commit_number)
        file_record, records = _write_rank_file(os.path.join(directory, fname), pieces)
        tensors = {}
        for piece, rec in zip(pieces, records):
            tensors.setdefault(piece.key, {"shape": list(piece.shape), "dtype": piece.dtype, "chunks": []})
            tensors[piece.key]["chunks"].append({"file": fname, **rec})
        return fname, file_record, tensors, entries

    written = _agree(comm, f"save of step {step} (writing rank files)", write)
    gathered = comm.gather(written, root=0)

    def commit():
        if rank != 0:
            return None
        tensors, files = {}, {}
        per_rank = [g[3] for g in gathered]
        for fname, file_record, rank_tensors, _ in gathered:
            files[fname] = file_record
            for key, info in rank_tensors.items():
                entry = tensors.setdefault(key, {"shape": info["shape"], "dtype": info["dtype"], "chunks": []})
                entry["chunks"].extend(info["chunks"])
        for entry in tensors.values():
            entry["chunks"].sort(key=lambda c: c["offsets"])
        for name, entry in entries.items():
            if isinstance(entry, dict) and "param_groups" in entry and "params" in entry:
                # Per-parameter optimizer state from every rank: pipeline stages each hold their own.
                for other in per_rank:
                    theirs = other.get(name, {})
                    entry["params"].update(theirs.get("params", {}))
                    for keys, more in zip(entry["group_keys"], theirs.get("group_keys", ())):
                        keys[:] = sorted(set(keys) | set(more))
        manifest = {"format": FORMAT, "step": int(step), "commit": commit_number, "world_size": size,
                    "created": time.time(), "files": files, "tensors": dict(sorted(tensors.items())), "json": entries}
        if any(e != entries for e in per_rank):
            # Per-rank values (e.g. each rank's RNG): restored rank by rank when loaded at the same size.
            manifest["json_per_rank"] = per_rank
        # The commit point: renamed over the manifest of the same step saved before, if there is one.
        _write_atomic(os.path.join(directory, MANIFEST), [standard_json.dumps(manifest, indent=1).encode()])
        _fsync_dir(root)  # the step directory's own entry
        for entry in sorted(os.listdir(directory)):  # the files of the same step saved before
            if _is_rank_file(entry) and entry not in files:
                _remove_quietly(os.path.join(directory, entry))
        if keep_last is not None:
            for _, old in _committed(root)[:-keep_last]:  # the least recently committed go first
                _prune(root, old)
        return directory

    _agree(comm, f"save of step {step} (commit)", commit)
    return directory


# -- load ------------------------------------------------------------------------------------------
# A checkpoint is untrusted input: it travels between users, clusters and object stores. Rank 0 reads the
# manifest and checks all of it before any rank reads an array or changes the state: every field's type and
# range, every chunk inside its tensor and its file, the chunks of each tensor tiling it once, every file a
# plain name whose real path (symlinks followed) is in the step directory, a regular file of the size the
# manifest gives. Each rank checks a file again when it opens it. A problem is a CheckpointError naming the
# manifest or shard file and the field ("tensors['model.0.weight'].chunks[1].offset").
_MAX_INDEX = 1 << 63  # element offsets, sizes and byte counts beyond it are corruption, not a big model


def _show(value):
    """Return a short repr of a manifest value for an error message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _field_error(path, field, problem):
    return CheckpointError(f"checkpoint: {path}: {field} {problem}")


def _int_field(value, path, field, low=0, high=_MAX_INDEX):
    """Return ``value`` if it is an int (not a bool) in ``[low, high)`` (``high`` None: no bound)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value >= high):
        bound = f"an int >= {low}" if high is None else f"an int >= {low} and < {high:,}".replace(",", "_")
        raise _field_error(path, field, f"must be {bound} (got {_show(value)})")
    return value


def _int_list(value, path, field, length):
    if not isinstance(value, list) or len(value) != length:
        raise _field_error(path, field, f"must be a list of {length} ints, one per dimension (got {_show(value)})")
    return tuple(_int_field(v, path, f"{field}[{i}]") for i, v in enumerate(value))


def _record(value, path, field, keys):
    """Return ``value`` if it is an object with exactly the fields ``keys``."""
    if not isinstance(value, dict):
        raise _field_error(path, field, f"must be an object (got {_show(value)})")
    if set(value) != set(keys):
        missing, unknown = sorted(set(keys) - set(value)), sorted(set(value) - set(keys))
        raise _field_error(path, field, f"must have the fields {sorted(keys)} (missing: {missing}, unknown: {unknown})")
    return value


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _inside(directory, name, path, field):
    """Return the real path of file ``name`` of ``directory``: a plain file name, which (symlinks followed) stays in it."""
    separators = [s for s in (os.sep, os.altsep, "/") if s]
    if (not isinstance(name, str) or name in ("", ".", "..", MANIFEST) or "\0" in name
            or any(s in name for s in separators)):
        raise _field_error(path, field, f"must be the plain name of a file in the checkpoint's directory, with no "
                                        f"directory part (got {_show(name)})")
    home = os.path.realpath(directory)
    real = os.path.realpath(os.path.join(directory, name))
    if real == home or os.path.commonpath([home, real]) != home:
        raise _field_error(path, field, f"names {os.path.join(directory, name)}, a link to {real}, outside the "
                                        f"checkpoint's directory {home}")
    return real


def _check_shard_file(directory, fname, record, manifest_path):
    """Return the real path of shard file ``fname`` after checking it: inside ``directory``, regular, of its size."""
    field = f"files[{fname!r}]"
    real = _inside(directory, fname, manifest_path, field)
    path = os.path.join(directory, fname)
    try:
        info = os.stat(real)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint: missing shard file {path} (the manifest lists {record['bytes']} bytes: "
                              f"{manifest_path}: {field})") from None
    except OSError as exc:
        raise CheckpointError(f"checkpoint: cannot read shard file {path} ({exc.strerror or exc}; {manifest_path}: "
                              f"{field})") from None
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"checkpoint: shard file {path} is not a regular file ({manifest_path}: {field})")
    if info.st_size != record["bytes"]:
        raise CheckpointError(f"checkpoint: {path} is truncated or altered: {info.st_size} bytes on disk, manifest says "
                              f"{record['bytes']} ({manifest_path}: {field}.bytes)")
    return real


def _check_files(files, path, directory):
    if not isinstance(files, dict):
        raise _field_error(path, "files", f"must be an object of file name -> record (got {_show(files)})")
    for fname, record in files.items():
        _inside(directory, fname, path, f"files[{fname!r}]")
        _record(record, path, f"files[{fname!r}]", ("bytes", "crc32"))
        _int_field(record["bytes"], path, f"files[{fname!r}].bytes")
        _int_field(record["crc32"], path, f"files[{fname!r}].crc32", high=1 << 32)


def _chunks_of_pieces(key, shape, itemsize, pieces, path):
    """Return the chunks of a ``mpidist-checkpoint-1`` tensor's flat pieces (checked first): each piece's boxes."""
    where = f"tensors[{key!r}].pieces"
    if not isinstance(pieces, list):
        raise _field_error(path, where, f"must be a list (got {_show(pieces)})")
    chunks = []
    for i, piece in enumerate(pieces):
        at = f"{where}[{i}]"
        _record(piece, path, at, ("file", "offset", "start", "count"))
        start, count = (_int_field(piece[k], path, f"{at}.{k}") for k in ("start", "count"))
        if start + count > math.prod(shape):
            raise _field_error(path, at, f"covers elements [{start}, {start + count}) of a tensor of {math.prod(shape)}")
        offset = _int_field(piece["offset"], path, f"{at}.offset")
        chunks += [{"file": piece["file"], "offsets": list(box.offsets), "sizes": list(box.sizes),
                    "offset": offset + box.local * itemsize}
                   for box in boxes(FlatShard(None, shape, start, count, 0), (count,))]
    return chunks


def _check_chunks(key, shape, itemsize, chunks, files, path):
    """Check that the chunks of ``key`` lie inside the tensor and their files, and tile the tensor exactly once."""
    where = f"tensors[{key!r}].chunks"
    if not isinstance(chunks, list):
        raise _field_error(path, where, f"must be a list (got {_show(chunks)})")
    found = []
    for i, chunk in enumerate(chunks):
        at = f"{where}[{i}]"
        _record(chunk, path, at, ("file", "offset", "offsets", "sizes"))
        if not isinstance(chunk["file"], str) or chunk["file"] not in files:
            raise _field_error(path, f"{at}.file", f"names {_show(chunk['file'])}, which the manifest's files do not list")
        offset = _int_field(chunk["offset"], path, f"{at}.offset")
        offsets = _int_list(chunk["offsets"], path, f"{at}.offsets", len(shape))
        sizes = _int_list(chunk["sizes"], path, f"{at}.sizes", len(shape))
        if any(o + n > s for o, n, s in zip(offsets, sizes, shape)):
            raise _field_error(path, at, f"lies outside the tensor: offsets {offsets} + sizes {sizes} exceed its shape "
                                         f"{shape}")
        end, available = offset + math.prod(sizes) * itemsize, files[chunk["file"]]["bytes"]
        if end > available:
            raise _field_error(path, f"{at}.offset", f"{offset} + {math.prod(sizes)} elements of {itemsize} bytes reach "
                                                     f"byte {end} of {chunk['file']}, which has {available}")
        found.append((offsets, sizes))
    pair = first_overlap(found)
    if pair is not None:
        (offsets, sizes), (other_offsets, other_sizes) = found[pair[0]], found[pair[1]]
        raise _field_error(path, f"{where}[{pair[0]}]", f"overlaps chunks[{pair[1]}] (offsets {offsets} sizes {sizes}, "
                                                        f"offsets {other_offsets} sizes {other_sizes}): a duplicated "
                                                        f"or foreign chunk")
    covered, total = sum(math.prod(sizes) for _, sizes in found), math.prod(shape)
    if covered != total:
        raise _field_error(path, where, f"cover {covered} of the {total} elements of shape {shape}")


def _check_tensors(tensors, flat, files, path):
    """Check every tensor entry; return them with their chunks (a ``mpidist-checkpoint-1`` tensor's pieces converted)."""
    if not isinstance(tensors, dict):
        raise _field_error(path, "tensors", f"must be an object of key -> tensor (got {_show(tensors)})")
    checked = {}
    for key, entry in tensors.items():
        at = f"tensors[{key!r}]"
        _record(entry, path, at, ("shape", "dtype", "pieces" if flat else "chunks"))
        shape = entry["shape"]
        if not isinstance(shape, list):
            raise _field_error(path, f"{at}.shape", f"must be a list of ints (got {_show(shape)})")
        shape = tuple(_int_field(n, path, f"{at}.shape[{d}]") for d, n in enumerate(shape))
        if math.prod(shape) >= _MAX_INDEX:
            raise _field_error(path, f"{at}.shape", f"{shape} has more than 2**63 elements")
        try:
            itemsize = standard_json.check_dtype(entry["dtype"]).itemsize
        except ValueError as exc:
            raise _field_error(path, f"{at}.dtype", str(exc)) from None
        chunks = (_chunks_of_pieces(key, shape, itemsize, entry["pieces"], path) if flat else entry["chunks"])
        _check_chunks(key, shape, itemsize, chunks, files, path)
        checked[key] = {"shape": list(shape), "dtype": entry["dtype"], "chunks": chunks}
    return checked


def _decoded(value, path, field):
    try:
        return standard_json.decode(value, field)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint: {path}: {exc}") from None


def _manifest_json(directory):
    """Return (path, parsed JSON) of the manifest in ``directory``: a regular file in it, no key twice in an object."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.lexists(path):
        raise CheckpointError(f"checkpoint: no manifest at {path} (not a committed checkpoint)")
    real, home = os.path.realpath(path), os.path.realpath(directory)
    if real == home or os.path.commonpath([home, real]) != home:
        raise CheckpointError(f"checkpoint: manifest {path} is a link to {real}, outside its directory")
    try:
        if not stat.S_ISREG(os.stat(real).st_mode):
            raise CheckpointError(f"checkpoint: manifest {path} is not a regular file")
        with open(real, "rb") as f:
            return path, standard_json.loads(f.read())
    except OSError as exc:
        raise CheckpointError(f"checkpoint: cannot read manifest {path} ({exc.strerror or exc})") from None
    except RecursionError:
        raise CheckpointError(f"checkpoint: manifest {path} is not valid JSON (nested deeper than Python reads)") from None
    except ValueError as exc:  # not JSON, not UTF-8, a key twice
        raise CheckpointError(f"checkpoint: manifest {path} is not valid JSON ({exc})") from None


def _commit_of(manifest, path):
    """Return the commit number of a parsed manifest (-1 for manifests written before there were any)."""
    if not isinstance(manifest, dict):
        raise CheckpointError(f"checkpoint: manifest {path} must hold a JSON object (got {type(manifest).__name__})")
    return _int_field(manifest["commit"], path, "commit", high=None) if "commit" in manifest else -1


def _manifest_commit(directory):
    """Return the commit number of the manifest in ``directory``; raise CheckpointError if it cannot be read."""
    path, manifest = _manifest_json(directory)
    return _commit_of(manifest, path)


def _read_manifest(directory, step=None):
    """Return the manifest of ``directory`` after checking all of it (see above), its JSON entries decoded.

    ``step``: the step the directory is named after, which the manifest must record.
    """
    path, manifest = _manifest_json(directory)
    _commit_of(manifest, path)
    fmt = manifest.get("format")
    if fmt not in (FORMAT, FLAT_FORMAT):
        raise CheckpointError(f"checkpoint: {path} has format {_show(fmt)}, expected {FORMAT!r} (or the older "
                              f"{FLAT_FORMAT!r})")
    recorded = _int_field(manifest.get("step"), path, "step")
    if step is not None and recorded != int(step):
        raise _field_error(path, "step", f"is {recorded} in the directory of step {int(step)} (a manifest copied from "
                                         f"another checkpoint?)")
    world_size = _int_field(manifest.get("world_size"), path, "world_size", low=1, high=1 << 31)
    created = manifest.get("created", 0.0)
    if not _is_number(created) or not math.isfinite(created):
        raise _field_error(path, "created", f"must be a finite number of seconds (got {_show(created)})")
    files = manifest.get("files")
    _check_files(files, path, directory)
    manifest["tensors"] = _check_tensors(manifest.get("tensors"), fmt == FLAT_FORMAT, files, path)
    if not isinstance(manifest.get("json"), dict):
        raise _field_error(path, "json", f"must be an object (got {_show(manifest.get('json'))})")
    manifest["json"] = _decoded(manifest["json"], path, "json")
    if "json_per_rank" in manifest:
        per_rank = manifest["json_per_rank"]
        if not isinstance(per_rank, list) or len(per_rank) != world_size or not all(isinstance(e, dict) for e in per_rank):
            raise _field_error(path, "json_per_rank", f"must be a list of {world_size} objects, one per rank of "
                                                      f"world_size (got {_show(per_rank)})")
        manifest["json_per_rank"] = _decoded(per_rank, path, "json_per_rank")
    for fname, record in files.items():  # last: the cheap checks above fail first on a bad manifest
        _check_shard_file(directory, fname, record, path)
    manifest["format"] = FORMAT  # its pieces are chunks now
    return manifest


class _Reader:
    """Reads key ranges from a committed, checked checkpoint, verifying each file the first time it is opened."""

    def __init__(self, directory, manifest, verify):
        self.directory, self.manifest, self.verify = directory, manifest, verify
        self.manifest_path = os.path.join(directory, MANIFEST)
        self._maps = {}
        self.bytes_read = 0  # the stored bytes copied out by ``read`` (what a lazy load of a shard costs)

    def _open(self, fname):
        if fname in self._maps:
            return self._maps[fname]
        record = self.manifest["files"][fname]
        # Again on this rank: the file may have changed (or be another file) since rank 0 checked it.
        real = _check_shard_file(self.directory, fname, record, self.manifest_path)
        data = np.memmap(real, dtype=np.uint8, mode="r") if record["bytes"] else np.zeros(0, dtype=np.uint8)
        if self.verify:
            crc = zlib.crc32(data) if record["bytes"] else 0
            if crc != record["crc32"]:
                raise CheckpointError(f"checkpoint: checksum mismatch in {os.path.join(self.directory, fname)} (crc32 "
                                      f"{crc:#010x}, manifest {record['crc32']:#010x}: {self.manifest_path}: "
                                      f"files[{fname!r}].crc32)")
        self._maps[fname] = data
        return data

    def read(self, key, offsets, sizes, out):
        """Fill ``out`` (a host array of shape ``sizes``) with the box ``(offsets, sizes)`` of ``key``."""
        entry = self.manifest["tensors"][key]
        dtype = standard_json.check_dtype(entry["dtype"])
        copied = 0
        for chunk in entry["chunks"]:
            overlap = intersect(offsets, sizes, chunk["offsets"], chunk["sizes"])
            if overlap is None:
                continue
            raw = self._open(chunk["file"])
            first = chunk["offset"]
            stored = raw[first: first + math.prod(chunk["sizes"]) * dtype.itemsize].view(dtype).reshape(chunk["sizes"])
            out[_window(*overlap, offsets)] = stored[_window(*overlap, chunk["offsets"])]
            copied += math.prod(overlap[1])
            self.bytes_read += math.prod(overlap[1]) * dtype.itemsize
        if copied != math.prod(sizes):
            raise CheckpointError(f"checkpoint: the manifest's chunks of {key!r} hold {copied} of the "
                                  f"{math.prod(sizes)} elements of {describe_box(entry['shape'], offsets, sizes)}")


def open_step(root, step=None, verify=False):
    """Return a reader of checkpoint ``step`` (default: the newest committed) of ``root`` on this rank alone.

    It answers ``manifest["tensors"]`` (each key's shape, dtype and chunks) and ``read(key, offsets, sizes, out)``
    from memory-mapped files, so reading a box reads only the bytes of the chunks it overlaps (``bytes_read``
    counts them). ``verify``: check each file's CRC32 when first opened (reads the whole file). Not collective:
    ``mpidist.sources.CheckpointSource`` loads deferred models through it.
    """
    if step is None:
        step = latest_step(root)
        if step is None:
            raise CheckpointError(f"checkpoint: no committed step under {root}")
    _check_step("open_step", step)
    directory = _step_dir(root, step)
    return _Reader(directory, _read_manifest(directory, step), verify)


class LoadResult(NamedTuple):
    """What ``load(..., strict=False)`` did: the step loaded, and the keys only one side has (as in PyTorch)."""

    step: int
    missing_keys: List[str]     # in the state, not in the checkpoint: left as they were
    unexpected_keys: List[str]  # in the checkpoint (under an entry name of the state), in no rank's state: not read


def _key_problems(slots, tensors):
    """Return (keys the checkpoint holds with another shape or dtype than ``slots``, keys it lacks)."""
    problems, missing = [], []
    for slot in slots:
        for key, shape in {(seg.key, seg.shape): None for seg in slot.segments}:
            if key not in tensors:
                missing.append(key)
            elif tuple(tensors[key]["shape"]) != tuple(shape):
                problems.append(f"{key!r} has shape {tuple(tensors[key]['shape'])} in the checkpoint, {tuple(shape)} in the model")
            elif standard_json.check_dtype(tensors[key]["dtype"]) != slot.array.dtype:
                problems.append(f"{key!r} has dtype {standard_json.check_dtype(tensors[key]['dtype'])} in the checkpoint, "
                                f"{slot.array.dtype} in the model")
    return problems, missing


def _check_keys(slots, manifest, directory):
    """Raise naming every key the checkpoint holds with another shape or dtype than ``slots``."""
    problems, _ = _key_problems(slots, manifest["tensors"])
    if problems:
        raise CheckpointError(f"checkpoint: {os.path.join(directory, MANIFEST)} does not match this state "
                              f"(from another model?): {_listing(problems)}")


def _listing(items, limit=10):
    """Return the first ``limit`` of ``items`` joined by "; ", saying how many more there are."""
    more = f"; ... ({len(items) - limit} more)" if len(items) > limit else ""
    return "; ".join(items[:limit]) + more


def _compare_keys(state, manifest, path):
    """Return (problems, missing, spare, read): this rank's part of ``state`` against the checkpoint; change nothing.

    problems: keys held with another shape or dtype. missing: what this rank needs that the checkpoint lacks
    (tensor keys; an optimizer, or its state for one parameter, as ``optim`` or ``optim.<key>``; JSON entries
    by name). spare and read: the checkpoint's tensor keys under an entry name of ``state`` that this rank
    does not need, and those it needs. An optimizer entry of another type or parameter grouping raises.
    """
    tensors, saved = manifest["tensors"], manifest["json"]
    registry, slots, missing = _Registry(), [], []
    for name, obj in state.items():
        if _is_model(obj) and not _is_optimizer(obj):
            slots.extend(_model_slots(name, obj, registry))
    for name, obj in state.items():
        if _is_optimizer(obj):
            if name not in saved:
                missing.append(name)
                continue
            _check_optimizer_entry(name, obj, saved[name], path)
            _check_optimizer_structure(name, obj, saved[name], registry, path)
            for i, p in enumerate(obj.params):
                pkeys, segments = _registered(name, i, p, registry, obj)
                kept = saved[name]["params"].get(pkeys[0])
                if kept is None:  # (an FSDP shard's state is saved under each key it holds, so any stands for all)
                    missing.extend(f"{name}.{key}" for key in pkeys)
                else:  # the arrays it will hold, shaped and typed like the parameter's storage
                    slots.extend(_state_slots(name, segments, {k: state_like(p.data, copy=False)
                                                               for k in kept["arrays"]}))
        elif _is_array(obj):
            slots.append(_full_slot(name, obj))
        elif not _is_model(obj) and name not in saved:
            missing.append(name)
    problems, absent = _key_problems(slots, tensors)
    needed = {seg.key for slot in slots for seg in slot.segments}
    owned = [key for key in tensors if any(key.startswith(f"{n}.") or key == n for n in state)]
    return (problems, sorted(set(missing) | set(absent)), sorted(k for k in owned if k not in needed),
            sorted(k for k in owned if k in needed))


def _mismatch(path, reports, strict):
    """Return (error message or None, missing keys, unexpected keys) from every rank's ``_compare_keys``.

    A key is unexpected when some rank's state has its entry and no rank reads it: a pipeline rank needs
    only its own stages' keys, and a stage without parameters may have no optimizer at all.
    """
    problems = list(dict.fromkeys(problem for report in reports for problem in report[0]))
    missing = sorted({key for report in reports for key in report[1]})
    read = {key for report in reports for key in report[3]}
    unexpected = sorted({key for report in reports for key in report[2]} - read)
    listed = problems
    if strict:
        listed = problems + [f"{k!r} missing" for k in missing] + [f"{k!r} not in this state" for k in unexpected]
    if not listed:
        return None, missing, unexpected
    hint = "; load(..., strict=False) loads the keys both have" if listed is not problems and not problems else ""
    return (f"checkpoint: {path} does not match this state (from another model?): {_listing(listed)}{hint}",
            missing, unexpected)


def _check_optimizer_structure(name, opt, entry, registry, path):
    """Raise unless optimizer ``name``'s saved entry comes from an optimizer of ``opt``'s type and parameter groups.

    Older checkpoints record no type and no grouping: their groups' hyperparameter names tell the type apart
    (Adam's betas and eps, SGD's momentum).
    """
    at, kind = f"json[{name!r}]", _optimizer_type(opt)
    saved_kind = entry.get("type", kind)
    if saved_kind != kind:
        raise _field_error(path, f"{at}.type", f"is {_show(saved_kind)}, but optimizer {name!r} of this state is of "
                                               f"type {kind}: an optimizer's state loads only into one of its own type")
    groups = entry["param_groups"]
    if len(groups) != len(opt.param_groups):
        raise _field_error(path, f"{at}.param_groups", f"holds {len(groups)} parameter groups, optimizer {name!r} of "
                                                       f"this state {len(opt.param_groups)}")
    for index, (saved, group) in enumerate(zip(groups, opt.param_groups)):
        theirs, ours = sorted(k for k in saved if k != "params"), sorted(k for k in group if k != "params")
        if theirs != ours:
            raise _field_error(path, f"{at}.param_groups[{index}]", f"has the hyperparameters {theirs} (of an optimizer "
                                                                    f"of another type?); optimizer {name!r} of this "
                                                                    f"state, of type {kind}, has {ours}")
    group_keys = entry.get("group_keys")
    if group_keys is None:
        return
    if (not isinstance(group_keys, list) or len(group_keys) != len(groups)
            or not all(isinstance(keys, list) and all(isinstance(k, str) for k in keys) for keys in group_keys)):
        raise _field_error(path, f"{at}.group_keys", f"must be a list of {len(groups)} lists of keys, one per "
                                                     f"parameter group (got {_show(group_keys)})")
    saved_group = {key: index for index, keys in enumerate(group_keys) for key in keys}
    for index, group in enumerate(opt.param_groups):
        for p in group["params"]:
            for key in registry.by_param.get(id(p), ((),))[0]:
                if saved_group.get(key, index) != index:
                    raise _field_error(path, f"{at}.group_keys", f"puts {key!r} in parameter group {saved_group[key]}, "
                                                                 f"optimizer {name!r} of this state in group {index}")


def _check_writable(slots):
    """Raise naming the model arrays that are read-only: an elastic commit holds them (copy-on-write)."""
    held = [slot.segments[0].key for slot in slots
            if slot.segments and is_held(slot.array)]
    if held:
        raise CheckpointError(f"checkpoint: cannot load into {len(held)} read-only array(s) of the model (e.g. "
                              f"{', '.join(repr(k) for k in held[:3])}); an elastic commit holds the live parameters "
                              f"read-only (copy-on-write): load before Elastic.train starts, or call "
                              f"model.load_state_dict, which moves held parameters to new arrays")


def _restore_optimizer(name, opt, entry, registry):
    groups = entry["param_groups"]
    if len(groups) != len(opt.param_groups):
        raise CheckpointError(f"checkpoint: optimizer {name!r} has {len(opt.param_groups)} parameter groups, the checkpoint {len(groups)}")
    for group, saved in zip(opt.param_groups, groups):
        # JSON turns tuples (Adam's betas) into lists; give them back their type.
        group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()})
    kept, opt.state = opt.state, {}
    for i, p in enumerate(opt.params):
        pkeys, _ = _registered(name, i, p, registry, opt)
        saved = entry["params"].get(pkeys[0])
        if saved is None:  # only under strict=False (_compare_keys listed it): keeps its state
            if i in kept:
                opt.state[i] = kept[i]
            continue
        if not saved["arrays"] and not saved["scalars"]:
            continue
        state = dict(saved["scalars"])
        for k in saved["arrays"]:
            state[k] = state_like(p.data)  # shaped like the local storage; filled from the checkpoint below
        opt.state[i] = state


_ANY = object()  # a hyperparameter the optimizer lacks: what it may be is not known here


def _hyperparameter_problem(value, reference):
    """Return why ``value`` cannot replace the optimizer's hyperparameter ``reference`` (None: it can).

    Checked at load, so that a checkpoint saying ``lr: "fast"`` fails there and not at the next ``step()``.
    """
    if isinstance(reference, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(reference):
            return f"must be a list of {len(reference)} like the optimizer's {_show(reference)}"
        for i, (v, r) in enumerate(zip(value, reference)):
            problem = _hyperparameter_problem(v, r)
            if problem:
                return f"[{i}] {problem}"
        return None
    if isinstance(reference, (bool, np.bool_)):
        return None if isinstance(value, bool) else "must be true or false"
    if isinstance(reference, numbers.Real):
        if not _is_number(value):
            return "must be a number"
        if not math.isfinite(value):
            return "must be finite"
        return "must be >= 0" if value < 0 <= reference else None
    if isinstance(value, float) and not math.isfinite(value):
        return "must be finite"
    return None


def _check_hyperparameters(groups, references, path, field):
    """Raise naming the first hyperparameter of ``groups`` that cannot replace the one in ``references``."""
    for i, (group, reference) in enumerate(zip(groups, references)):
        if not isinstance(group, dict):
            raise _field_error(path, f"{field}[{i}]", f"must be an object of hyperparameters (got {_show(group)})")
        for k, v in group.items():
            problem = None if k == "params" else _hyperparameter_problem(v, reference.get(k, _ANY))
            if problem:
                raise _field_error(path, f"{field}[{i}].{k}", f"{problem} (got {_show(v)}; the optimizer has "
                                                              f"{_show(reference.get(k))})")


def _check_optimizer_entry(name, opt, entry, path):
    """Check the structure, hyperparameters and per-parameter scalars of optimizer ``name``'s saved entry."""
    at = f"json[{name!r}]"
    if not isinstance(entry, dict) or not {"param_groups", "params"} <= set(entry):
        raise _field_error(path, at, f"must be an optimizer's object with param_groups and params (got {_show(entry)})")
    if not isinstance(entry["param_groups"], list):
        raise _field_error(path, f"{at}.param_groups", f"must be a list (got {_show(entry['param_groups'])})")
    _check_hyperparameters(entry["param_groups"], opt.param_groups, path, f"{at}.param_groups")
    if not isinstance(entry["params"], dict):
        raise _field_error(path, f"{at}.params", f"must be an object of key -> state (got {_show(entry['params'])})")
    for key, saved in entry["params"].items():
        where = f"{at}.params[{key!r}]"
        _record(saved, path, where, ("scalars", "arrays"))
        if not isinstance(saved["scalars"], dict):
            raise _field_error(path, f"{where}.scalars", f"must be an object (got {_show(saved['scalars'])})")
        for k, v in saved["scalars"].items():
            if k == "step":
                _int_field(v, path, f"{where}.scalars.step")
            elif not (v is None or isinstance(v, (bool, str)) or (_is_number(v) and math.isfinite(v))):
                raise _field_error(path, f"{where}.scalars.{k}", f"must be a finite number, a string, true, false or "
                                                                 f"null (got {_show(v)})")
        arrays = saved["arrays"]
        if (not isinstance(arrays, list) or not all(isinstance(a, str) and a for a in arrays)
                or len(set(arrays)) != len(arrays)):
            raise _field_error(path, f"{where}.arrays", f"must be a list of distinct names (got {_show(arrays)})")


def _undo_entry(name, state):
    """Return a function that puts ``state[name]`` back as it is now (a failed load changes nothing)."""
    obj = state[name]
    if isinstance(obj, np.random.Generator):
        saved = copy.deepcopy(obj.bit_generator.state)
        put_back = lambda: setattr(obj.bit_generator, "state", saved)  # noqa: E731
    elif hasattr(obj, "set_epoch") and hasattr(obj, "epoch"):
        epoch = obj.epoch
        put_back = lambda: obj.set_epoch(epoch)  # noqa: E731
    elif hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
        saved = copy.deepcopy(obj.state_dict())
        put_back = lambda: obj.load_state_dict(saved)  # noqa: E731
    else:
        put_back = lambda: None  # noqa: E731

    def undo():
        state[name] = obj
        put_back()
    return undo


def _nothing_to_resume(root):
    """Return what rank 0 says when ``root`` holds no committed checkpoint; raise if ``root`` is one step of one."""
    where = os.path.abspath(root)
    if os.path.exists(os.path.join(root, MANIFEST)):
        raise CheckpointError(f"checkpoint: {where} is a single checkpoint (it holds {MANIFEST}); pass the directory "
                              f"that holds the step_* directories: {os.path.dirname(where)}")
    if not os.path.exists(root):
        return f"checkpoint: {where} does not exist yet: starting from scratch"
    incomplete = len(_step_dirs(root))
    why = f" ({incomplete} step directories without a manifest: saves that never finished)" if incomplete else ""
    return f"checkpoint: no checkpoint in {where}{why}: starting from scratch"


def _io_span(name, step):
    """A trace event around checkpoint I/O (nothing when tracing is off)."""
    from mpidist.trace import span  # late: the trace package imports the communicator layers this module sits on
    return span(name, "io", {"step": step})


def _print_now(line):
    print(line, flush=True)


@guard.phase("checkpoint")
def load(root, state, comm, step=None, verify=True, log=_print_now, fallback=False, strict=True):
    """Load checkpoint ``step`` (default: the newest) from ``root`` into ``state``; return the step, or None if there is none.

    Strict (the default): for every entry of ``state`` the checkpoint must hold exactly the keys that entry has
    (a model's parameters and buffers, an array, an optimizer's per-parameter state, a JSON value), and an
    optimizer's entry must come from one of the same type and parameter groups; otherwise CheckpointError on
    every rank names the keys only one side has (or both optimizers). Entries of the checkpoint that ``state``
    does not name are not read: pass ``{"model": model}`` to load only the weights of a training checkpoint.
    ``strict=False`` loads the keys both have, leaves the others as they are and returns a ``LoadResult``
    (step, missing_keys, unexpected_keys), as PyTorch's ``load_state_dict`` does; other shapes or dtypes and
    another optimizer type still raise. ``step``: an int >= 0.

    Traced (``mpidist.trace``) as one "checkpoint load" event per rank, category "io".

    Works at any layout: each rank reads just the boxes its parameters' blocks and shards need (padding
    rows of a sharded parameter, and of its optimizer state, are set to zero).
    JSON entries (sampler, RNG, learning-rate schedule, numbers) are restored in place where possible and plain values
    replace entries of ``state``. Values that differed by rank at save time (a per-rank RNG) are
    restored per rank when loading at the same world size, and from rank 0 otherwise.
    When ``root`` holds no checkpoint, rank 0 says so through ``log`` (one line; None: silent), so that a
    mistyped path is not a silent restart.

    The checkpoint is untrusted input: the whole manifest is checked before anything in ``state`` changes,
    every file it names must lie in the step's own directory, and nothing in it is executed. A problem raises
    CheckpointError on every rank naming the file and the field, and leaves ``state`` as it was. When the
    newest checkpoint is damaged (or a manifest so damaged that its commit order is unknown), that is an error:
    ``fallback=True`` instead loads the newest checkpoint that is intact, with a warning naming what was passed
    over (``step`` given: that step or an error, whatever ``fallback``).
    """
    with _io_span("checkpoint load", step):
        return _load(root, state, comm, step, verify, log, fallback, strict)


def _newest(root, fallback):
    """Return rank 0's choice: (steps to try, newest commit first; unreadable manifests; message if there are none)."""
    ordered, unreadable = [], []
    for step, directory in sorted(_step_dirs(root).items()):
        if not os.path.lexists(os.path.join(directory, MANIFEST)):
            continue  # a save that never finished: not a checkpoint
        try:
            ordered.append((_manifest_commit(directory), step))
        except CheckpointError as exc:
            unreadable.append(str(exc))
    steps = [step for _, step in sorted(ordered, reverse=True)]
    if unreadable and not (fallback and steps):
        how = ("remove or repair it, or pass fallback=True to load the newest readable checkpoint with a warning"
               if not fallback else "and no other checkpoint is readable")
        raise CheckpointError(f"checkpoint: cannot tell which checkpoint under {os.path.abspath(root)} is the newest: "
                              f"{len(unreadable)} manifest(s) cannot be read ({'; '.join(unreadable[:3])}); {how}")
    return (steps if fallback else steps[:1]), unreadable, None if steps else _nothing_to_resume(root)


def _load(root, state, comm, step=None, verify=True, log=_print_now, fallback=False, strict=True):
    check_comm("checkpoint.load", comm)
    if not isinstance(fallback, bool):
        raise TypeError(f"checkpoint.load: fallback must be True or False (got {fallback!r})")
    if not isinstance(strict, bool):
        raise TypeError(f"checkpoint.load: strict must be True or False (got {strict!r})")
    if step is not None:
        _agree(comm, "load (arguments)", lambda: _check_step("checkpoint.load", step))
        return _load_step(root, state, comm, step, verify, strict=strict)
    rank = comm.Get_rank()
    steps, unreadable, message = comm.bcast(
        _agree(comm, "load (finding the newest checkpoint)", lambda: _newest(root, fallback) if rank == 0 else None),
        root=0)
    if not steps:
        if log is not None and rank == 0:
            log(message)
        return None
    if unreadable and rank == 0:
        warnings.warn(f"checkpoint: passing over {len(unreadable)} unreadable manifest(s) (fallback=True): "
                      f"{'; '.join(unreadable)}", RuntimeWarning, stacklevel=4)
    for i, candidate in enumerate(steps):
        try:
            return _load_step(root, state, comm, candidate, verify, newest=not fallback, strict=strict)
        except CheckpointError as exc:
            if i + 1 == len(steps):
                raise
            if rank == 0:
                warnings.warn(f"checkpoint: falling back from step {candidate} to step {steps[i + 1]} (fallback=True), "
                              f"which is older: {exc}", RuntimeWarning, stacklevel=4)


def _load_step(root, state, comm, step, verify, newest=False, strict=True):
    """Load checkpoint ``step``, or raise CheckpointError on every rank with ``state`` as it was.

    ``newest``: it was chosen as the newest, and a damaged manifest says how to fall back to an older one.
    Returns the step (strict) or a ``LoadResult``.
    """
    directory = _step_dir(root, step)
    try:
        manifest = _agree(comm, f"load of step {step} (manifest)",
                          lambda: _read_manifest(directory, step) if comm.Get_rank() == 0 else None)
    except CheckpointError as exc:
        if not newest:
            raise
        raise CheckpointError(f"{exc}\nThis is the newest checkpoint: checkpoint.load(..., fallback=True) loads the "
                              f"newest intact one instead, with a warning") from exc
    manifest = comm.bcast(manifest, root=0)
    manifest_path = os.path.join(directory, MANIFEST)

    optimizers = {name: obj for name, obj in state.items() if _is_optimizer(obj)}
    before = {name: ([dict(g) for g in opt.param_groups], opt.state) for name, opt in optimizers.items()}

    # Which keys only one side has needs every rank's part (a pipeline rank holds its own stages only).
    reports = comm.allgather(_agree(comm, f"load of step {step} (comparing keys)",
                                    lambda: _compare_keys(state, manifest, manifest_path)))
    mismatch, missing, unexpected = _mismatch(manifest_path, reports, strict)

    def read():
        if mismatch:  # the same on every rank
            raise CheckpointError(mismatch)
        registry, model_slots = _Registry(), []
        for name, obj in state.items():
            if _is_model(obj) and not _is_optimizer(obj):
                model_slots.extend(_model_slots(name, obj, registry))
        _check_writable(model_slots)
        # Optimizer state arrays must exist before slots can point at them (undone below on failure).
        for name, opt in optimizers.items():
            if name in manifest["json"]:  # (strict=False: one the checkpoint lacks is left as it is)
                _restore_optimizer(name, opt, manifest["json"][name], registry)
        slots, _ = _plan(state)
        _check_keys(slots, manifest, directory)
        reader = _Reader(directory, manifest, verify)
        staged = []
        for slot in slots:  # read and verify everything before changing anything
            host = np.empty(slot.array.size, dtype=slot.array.dtype)
            host[...] = to_numpy(slot.array).reshape(-1)
            for seg in slot.segments:
                if seg.key not in manifest["tensors"]:
                    continue  # strict=False: a key the checkpoint lacks keeps its values
                host[seg.local_start: seg.local_start + seg.count] = 0  # what no chunk fills is padding: zero
                for box in seg.boxes:
                    reader.read(seg.key, box.offsets, box.sizes, box.view(host.reshape(slot.array.shape)))
            staged.append((slot, host))
        return staged

    def put_back_optimizers():
        for name, (groups, opt_state) in before.items():  # a failed load leaves the optimizer as it was
            optimizers[name].param_groups[:] = [dict(g) for g in groups]
            optimizers[name].state = opt_state

    try:
        staged = _agree(comm, f"load of step {step}", read)
    except CheckpointError:
        put_back_optimizers()
        raise

    entries = manifest["json"]
    if "json_per_rank" in manifest and manifest["world_size"] == comm.Get_size():
        entries = manifest["json_per_rank"][comm.Get_rank()]
    undo = []

    def restore_entries():
        # Before the arrays, and undone on every rank when one rank fails: an entry that does not fit (a sampler
        # epoch of "x", a schedule setting a rate of "fast") leaves the state as it was.
        for name, obj in list(state.items()):
            if name in entries and not _is_optimizer(obj):
                undo.append(_undo_entry(name, state))
                _restore_json(name, state, entries[name], manifest_path)
                for opt_name, opt in optimizers.items():  # a learning-rate schedule sets its optimizer's rates
                    _check_hyperparameters(opt.param_groups, before[opt_name][0], manifest_path,
                                           f"json[{name!r}] restored, the rates it sets: optimizer {opt_name!r}, "
                                           f"param_groups")

    try:
        _agree(comm, f"load of step {step} (state entries)", restore_entries)
    except CheckpointError:
        for put_back in reversed(undo):
            put_back()
        put_back_optimizers()
        raise

    def apply():
        for slot, host in staged:
            copy_into(slot.array, host.reshape(slot.array.shape))

    _agree(comm, f"load of step {step} (apply)", apply)
    return int(step) if strict else LoadResult(int(step), missing, unexpected)


def _restore_json(name, state, value, path):
    """Restore JSON entry ``name`` into ``state``; raise CheckpointError naming the field if it does not fit there."""
    obj = state[name]
    try:
        if isinstance(value, dict) and "__rng__" in value:
            if not isinstance(obj, np.random.Generator):
                raise TypeError("a numpy Generator's state, for an entry that is none")
            obj.bit_generator.state = value["__rng__"]
        elif isinstance(value, dict) and "__sampler__" in value:
            saved = value["__sampler__"]
            _int_field(saved.get("epoch") if isinstance(saved, dict) else None, path, f"json[{name!r}].__sampler__.epoch")
            obj.set_epoch(saved["epoch"])
        elif isinstance(value, dict) and "__stateful__" in value:
            obj.load_state_dict(value["__stateful__"])
        else:
            state[name] = value
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the object raises, named with the entry
        raise _field_error(path, f"json[{name!r}]", f"does not restore into the state's {type(obj).__name__} "
                                                    f"({type(exc).__name__}: {exc})") from None
