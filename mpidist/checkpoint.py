"""Sharded, atomic, reshardable checkpoints.

Glossary:
- key: the global name of one tensor, e.g. ``model.0.weight`` or ``optim.model.0.weight.exp_avg``.
  Keys name *parameters*, never ranks or shards, so a checkpoint loads at any world size and into a
  plain model, DDP or FSDP alike.
- piece: a contiguous range ``[start, start + count)`` of a key's flattened tensor, stored in one
  rank file. A replicated tensor is one piece written by one of the ranks holding it (writers are
  balanced by bytes); an FSDP shard contributes the pieces of the parameters it overlaps, read from
  FSDP's public ``shard_layout()`` (which element of which parameter lies where in the shard).
- slot: a local array and the segments of keys it holds (where each key's range sits in the array).
- commit point: ``manifest.json``. Rank files are written to temporary names, fsynced and renamed;
  rank 0 writes the manifest last, the same way. A checkpoint without a manifest does not exist,
  so a crash at any moment leaves the previous checkpoint loadable. What a failed save leaves is
  removed: its temporary files at once, and (a killed process cannot clean up) temporary files and
  never-committed step directories when the next save starts.
- commit number: each manifest records one more than the newest committed before it; "latest" and
  pruning follow it, never file times.

Format: ``ROOT/step_00000006/rank00000.bin`` (raw little-endian bytes of this rank's pieces, read
back lazily with ``numpy.memmap`` so resharding reads only the ranges it needs) and
``manifest.json`` (global shapes and dtypes, which file holds which range, the world size, the step,
the commit number, a CRC32 and byte count per file, and the JSON-able state: sampler, RNG, optimizer hyperparameters,
learning-rate schedules (anything whose ``state_dict()`` is JSON-able),
user extras). The format needs nothing beyond numpy: safetensors would give the same lazy slice
reads, but the global layout has to live in a manifest anyway, and one file per rank keeps the
write path a single sequential stream.
"""

import json
import os
import shutil
import time
import zlib

import numpy as np

from . import guard
from .comm import check_comm
from .comm.agree import agreed
from .xp import copy_into, to_numpy

__all__ = ["save", "load", "latest_step", "list_steps", "check_writable", "CheckpointError"]

FORMAT = "mpidist-checkpoint-1"
MANIFEST = "manifest.json"
TMP_MARK = ".tmp."  # in the name of every file not yet renamed into place: "rank00003.bin.tmp.<pid>"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file and the problem."""


# -- slots: where each key's values live in local arrays -------------------------------------------
class _Slot:
    """A local array plus the key ranges it holds: ``segments`` = [(key, shape, global_start, local_start, count)]."""

    def __init__(self, array, segments):
        self.array = array
        self.segments = segments


def _full_slot(key, array):
    return _Slot(array, [(key, tuple(array.shape), 0, 0, int(array.size))])


class _Registry:
    """Maps every Parameter object in the state to the keys it holds and to how its local storage maps onto them."""

    def __init__(self):
        self.by_param = {}  # id(Parameter) -> (keys, layout(local array) -> _Slot)

    def add_full(self, key, param):
        self.by_param[id(param)] = ([key], lambda arr, key=key: _full_slot(key, arr))

    def add_flat(self, keys, param, layout):
        self.by_param[id(param)] = (keys, layout)


def _shard_segments(unit_shard, prefix):
    """Return the key segments of one FSDP unit's shard, from FSDP's public shard layout."""
    return [(f"{prefix}{piece.name}", piece.shape, piece.start, piece.offset, piece.count)
            for piece in unit_shard.pieces()]


def _is_fsdp(obj):
    return callable(getattr(obj, "shard_layout", None))


def _model_slots(name, obj, registry):
    """Return the slots of a model-like object (Module, DDP, FSDP, Pipeline) and register its parameters."""
    slots = []
    if _is_fsdp(obj):
        for unit_shard in obj.shard_layout():
            segments = _shard_segments(unit_shard, f"{name}.")
            slots.append(_Slot(unit_shard.parameter.data, segments))
            keys = [f"{name}.{span.name}" for span in unit_shard.params]
            registry.add_flat(keys, unit_shard.parameter, lambda arr, s=segments: _Slot(arr, s))
        module = obj.module
        for bname, buf in module.named_buffers():
            slots.append(_full_slot(f"{name}.{bname}", buf))
        return slots
    if hasattr(obj, "checkpoint_modules"):  # a pipeline: its layers named by their index in the unsplit model
        modules = obj.checkpoint_modules()
    else:
        modules = [("", getattr(obj, "module", obj))]
    for stage_prefix, module in modules:
        prefix = f"{name}.{stage_prefix}" if stage_prefix else f"{name}."
        for pname, p in module.named_parameters():
            slots.append(_full_slot(prefix + pname, p.data))
            registry.add_full(prefix + pname, p)
        for bname, buf in module.named_buffers():
            slots.append(_full_slot(prefix + bname, buf))
    return slots


def _name_pipeline_layers(state):
    """Let every pipeline in ``state`` number its layers globally (collective over its ranks, once).

    Done first, before any step that can fail on some ranks only, so that no rank waits in it for a
    rank that has already left with an error.
    """
    for obj in state.values() if isinstance(state, dict) else ():
        if hasattr(obj, "checkpoint_modules"):
            obj.checkpoint_modules()


def _is_model(obj):
    return _is_fsdp(obj) or hasattr(obj, "named_parameters") or hasattr(obj, "checkpoint_modules")


def _is_optimizer(obj):
    return hasattr(obj, "param_groups") and hasattr(obj, "state") and hasattr(obj, "params")


def _optimizer_plan(name, opt, registry):
    """Return (slots, json) for an optimizer; its per-parameter arrays are keyed by the parameter's key."""
    slots, params_json = [], {}
    for i, p in enumerate(opt.params):
        if id(p) not in registry.by_param:
            raise CheckpointError(f"checkpoint: optimizer {name!r} holds a parameter (index {i}, shape {tuple(p.data.shape)}) "
                                  f"that belongs to no model in the state; put the model in the same save() call")
        pkeys, layout = registry.by_param[id(p)]
        state = opt.state.get(i, {})
        arrays = sorted(k for k, v in state.items() if hasattr(v, "shape"))
        for pkey in pkeys:  # per parameter, so the checkpoint does not depend on how parameters were sharded
            params_json[pkey] = {"scalars": {k: v for k, v in state.items() if not hasattr(v, "shape")}, "arrays": arrays}
        for k in arrays:
            base = layout(state[k])
            slots.append(_Slot(state[k], [(f"{name}.{seg[0]}.{k}",) + seg[1:] for seg in base.segments]))
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return slots, {"param_groups": groups, "params": params_json}


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
        elif hasattr(obj, "shape") and hasattr(obj, "dtype"):
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


def _fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path, chunks):
    """Write byte chunks to ``path`` through a temporary name, fsync, rename; return (bytes, crc32).

    On failure the temporary file is removed (a full disk must not fill up further with each retry).
    """
    tmp = f"{path}{TMP_MARK}{os.getpid()}"
    crc, total = 0, 0
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                f.write(view)
                crc = zlib.crc32(view, crc)
                total += view.nbytes
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    return total, crc


def _step_dir(root, step):
    return os.path.join(root, f"step_{int(step):08d}")


def _step_dirs(root):
    """Return {step: directory} of every step directory under ``root``, committed or not."""
    if not os.path.isdir(root):
        return {}
    return {int(entry[5:]): os.path.join(root, entry) for entry in os.listdir(root)
            if entry.startswith("step_") and entry[5:].isdigit() and os.path.isdir(os.path.join(root, entry))}


def _commit_number(manifest_path):
    """Return the commit number a manifest records (-1 if it records none or cannot be read: those sort first, by step)."""
    try:
        with open(manifest_path) as f:
            return int(json.load(f).get("commit", -1))
    except (OSError, ValueError, TypeError, AttributeError):
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


def _remove_leftovers(root):
    """Remove what failed or killed saves left under ``root``: temporary files, and step directories never committed."""
    for directory in _step_dirs(root).values():
        if not os.path.exists(os.path.join(directory, MANIFEST)):
            shutil.rmtree(directory, ignore_errors=True)
            continue
        for entry in os.listdir(directory):
            if TMP_MARK in entry:
                try:
                    os.remove(os.path.join(directory, entry))
                except OSError:
                    pass


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
def _write_rank_file(path, pieces):
    """Write this rank's pieces to ``path``; return (file record, piece records)."""
    records, offset, chunks = [], 0, []
    for key, shape, dtype, start, data in pieces:
        records.append({"key": key, "start": start, "count": int(data.size), "offset": offset})
        chunks.append(np.ascontiguousarray(data))
        offset += data.nbytes
    nbytes, crc = _write_atomic(path, chunks)
    return {"bytes": nbytes, "crc32": crc}, records


@guard.phase("checkpoint")  # its own time limit: writing a large checkpoint takes long
def save(root, state, comm, step, keep_last=3):
    """Write ``state`` as checkpoint ``step`` under ``root``; every rank writes its own file.

    Returns the checkpoint directory. Keeps the newest ``keep_last`` checkpoints (None keeps all).
    """
    check_comm("checkpoint.save", comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    directory = _step_dir(root, step)
    _name_pipeline_layers(state)

    def declare():
        slots, entries = _plan(state)
        held = []  # (key, shape, dtype, start, host array)
        for slot in slots:
            flat = to_numpy(slot.array).reshape(-1)
            for key, shape, gstart, lstart, count in slot.segments:
                held.append((key, tuple(int(s) for s in shape), flat.dtype.str, int(gstart), flat[lstart: lstart + count]))
        return held, entries

    held, entries = _agree(comm, f"save of step {step} (collecting state)", declare)
    # Rank 0 assigns every distinct piece to one of the ranks holding it, balancing bytes written.
    declarations = comm.gather([(k, s, d, st, a.size, a.nbytes) for k, s, d, st, a in held], root=0)

    def assign():
        if rank != 0:
            return None
        load_bytes, owner = [0] * size, {}
        holders = {}
        for r, decl in enumerate(declarations):
            for key, shape, dtype, start, count, nbytes in decl:
                holders.setdefault((key, start, count), []).append((r, shape, dtype, nbytes))
        for piece, hs in sorted(holders.items(), key=lambda item: -item[1][0][3]):
            r = min((h[0] for h in hs), key=lambda q: (load_bytes[q], q))
            owner[piece] = r
            load_bytes[r] += hs[0][3]
        assignment = [sorted(p for p, r in owner.items() if r == q) for q in range(size)]
        # Saving a step that already exists: withdraw its manifest before any rank file is replaced,
        # so a crash in between leaves no manifest pointing at half-new files (older steps stay valid).
        existing = os.path.join(directory, MANIFEST)
        if os.path.exists(existing):
            os.remove(existing)
            _fsync_dir(directory)
        _remove_leftovers(root)  # of failed or killed saves; no rank of this job writes until the scatter
        return assignment

    assignment = _agree(comm, f"save of step {step} (assigning pieces)", assign)
    mine = set(comm.scatter(assignment, root=0))  # no rank writes before rank 0 got here

    def write():
        os.makedirs(directory, exist_ok=True)
        pieces = [p for p in held if (p[0], p[3], p[4].size) in mine]
        fname = f"rank{rank:05d}.bin"
        file_record, records = _write_rank_file(os.path.join(directory, fname), pieces)
        tensors = {}
        for (key, shape, dtype, start, data), rec in zip(pieces, records):
            tensors.setdefault(key, {"shape": list(shape), "dtype": dtype, "pieces": []})
            tensors[key]["pieces"].append({"file": fname, **rec})
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
                entry = tensors.setdefault(key, {"shape": info["shape"], "dtype": info["dtype"], "pieces": []})
                entry["pieces"].extend(info["pieces"])
        for key, entry in tensors.items():
            entry["pieces"].sort(key=lambda p: p["start"])
            covered = sum(p["count"] for p in entry["pieces"])
            if covered != int(np.prod(entry["shape"], dtype=np.int64)):
                raise CheckpointError(f"checkpoint: tensor {key!r} is covered by {covered} elements, expected shape {entry['shape']}")
        for name, entry in entries.items():
            if isinstance(entry, dict) and "param_groups" in entry and "params" in entry:
                # Per-parameter optimizer state from every rank: pipeline stages each hold their own.
                for other in per_rank:
                    entry["params"].update(other.get(name, {}).get("params", {}))
        commit_number = 1 + max((number for number, _ in _committed(root)), default=0)
        manifest = {"format": FORMAT, "step": int(step), "commit": commit_number, "world_size": size,
                    "created": time.time(), "files": files, "tensors": dict(sorted(tensors.items())), "json": entries}
        if any(e != entries for e in per_rank):
            # Per-rank values (e.g. each rank's RNG): restored rank by rank when loaded at the same size.
            manifest["json_per_rank"] = per_rank
        _write_atomic(os.path.join(directory, MANIFEST), [json.dumps(manifest, indent=1).encode()])
        _fsync_dir(directory)
        _fsync_dir(root)
        if keep_last:
            for _, old in _committed(root)[:-keep_last]:  # the least recently committed go first
                shutil.rmtree(_step_dir(root, old), ignore_errors=True)
        return directory

    _agree(comm, f"save of step {step} (commit)", commit)
    return directory


# -- load ------------------------------------------------------------------------------------------
class _Reader:
    """Reads key ranges from a committed checkpoint, verifying each file the first time it is opened."""

    def __init__(self, directory, manifest, verify):
        self.directory, self.manifest, self.verify = directory, manifest, verify
        self._maps = {}

    def _open(self, fname):
        if fname in self._maps:
            return self._maps[fname]
        path = os.path.join(self.directory, fname)
        record = self.manifest["files"].get(fname)
        if record is None:
            raise CheckpointError(f"checkpoint: {path} is referenced by a tensor but not listed in the manifest")
        if not os.path.exists(path):
            raise CheckpointError(f"checkpoint: missing shard file {path} (the manifest lists {record['bytes']} bytes)")
        actual = os.path.getsize(path)
        if actual != record["bytes"]:
            raise CheckpointError(f"checkpoint: {path} is truncated or altered: {actual} bytes on disk, manifest says {record['bytes']}")
        data = np.memmap(path, dtype=np.uint8, mode="r") if actual else np.zeros(0, dtype=np.uint8)
        if self.verify:
            crc = zlib.crc32(data) if actual else 0
            if crc != record["crc32"]:
                raise CheckpointError(f"checkpoint: checksum mismatch in {path} (crc32 {crc:#010x}, manifest {record['crc32']:#010x})")
        self._maps[fname] = data
        return data

    def read(self, key, start, count, out):
        """Fill flat ``out`` (host array of ``count`` elements) with ``key[start:start+count]``."""
        entry = self.manifest["tensors"][key]
        dtype = np.dtype(entry["dtype"])
        stop = start + count
        for piece in entry["pieces"]:
            lo, hi = max(start, piece["start"]), min(stop, piece["start"] + piece["count"])
            if lo >= hi:
                continue
            raw = self._open(piece["file"])
            first = piece["offset"] + (lo - piece["start"]) * dtype.itemsize
            out[lo - start: hi - start] = raw[first: first + (hi - lo) * dtype.itemsize].view(dtype)


def _read_manifest(directory):
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint: no manifest at {path} (not a committed checkpoint)") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"checkpoint: manifest {path} is not valid JSON ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint: {path} has format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def _check_keys(slots, manifest, directory):
    """Raise naming every key the model needs that the checkpoint lacks or holds with another shape or dtype."""
    tensors = manifest["tensors"]
    problems = []
    for slot in slots:
        for key, shape, *_ in slot.segments:
            if key not in tensors:
                problems.append(f"{key!r} missing")
            elif tuple(tensors[key]["shape"]) != tuple(shape):
                problems.append(f"{key!r} has shape {tuple(tensors[key]['shape'])} in the checkpoint, {tuple(shape)} in the model")
            elif np.dtype(tensors[key]["dtype"]) != slot.array.dtype:
                problems.append(f"{key!r} has dtype {np.dtype(tensors[key]['dtype'])} in the checkpoint, {slot.array.dtype} in the model")
    if problems:
        raise CheckpointError(f"checkpoint: {os.path.join(directory, MANIFEST)} does not match this state "
                              f"(from another model?): {'; '.join(problems[:10])}{' ...' if len(problems) > 10 else ''}")


def _restore_optimizer(name, opt, entry, registry):
    groups = entry["param_groups"]
    if len(groups) != len(opt.param_groups):
        raise CheckpointError(f"checkpoint: optimizer {name!r} has {len(opt.param_groups)} parameter groups, the checkpoint {len(groups)}")
    for group, saved in zip(opt.param_groups, groups):
        # JSON turns tuples (Adam's betas) into lists; give them back their type.
        group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()})
    opt.state = {}
    for i, p in enumerate(opt.params):
        pkeys, _ = registry.by_param[id(p)]
        saved = entry["params"].get(pkeys[0])
        if saved is None:
            raise CheckpointError(f"checkpoint: optimizer {name!r} has no saved state for parameter {pkeys[0]!r}")
        if not saved["arrays"] and not saved["scalars"]:
            continue
        state = dict(saved["scalars"])
        for k in saved["arrays"]:
            state[k] = p.data.copy()  # shaped like the local storage; filled from the checkpoint below
        opt.state[i] = state


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


def _print_now(line):
    print(line, flush=True)


@guard.phase("checkpoint")
def load(root, state, comm, step=None, verify=True, log=_print_now):
    """Load checkpoint ``step`` (default: the newest) from ``root`` into ``state``; return the step, or None if there is none.

    Works at any world size: each rank reads just the ranges its parameters and shards need.
    JSON entries (sampler, RNG, learning-rate schedule, numbers) are restored in place where possible and plain values
    replace entries of ``state``. Values that differed by rank at save time (a per-rank RNG) are
    restored per rank when loading at the same world size, and from rank 0 otherwise.
    When ``root`` holds no checkpoint, rank 0 says so through ``log`` (one line; None: silent), so that a
    mistyped path is not a silent restart.
    """
    check_comm("checkpoint.load", comm)
    _name_pipeline_layers(state)
    if step is None:
        def newest():
            if comm.Get_rank() != 0:
                return None
            found = latest_step(root)
            return (found, None) if found is not None else (None, _nothing_to_resume(root))
        step, message = comm.bcast(_agree(comm, "load (finding the newest checkpoint)", newest), root=0)
        if step is None:
            if log is not None and comm.Get_rank() == 0:
                log(message)
            return None
    directory = _step_dir(root, step)
    manifest = _agree(comm, f"load of step {step} (manifest)",
                      lambda: _read_manifest(directory) if comm.Get_rank() == 0 else None)
    manifest = comm.bcast(manifest, root=0)

    optimizers = {name: obj for name, obj in state.items() if _is_optimizer(obj)}
    before = {name: ([dict(g) for g in opt.param_groups], opt.state) for name, opt in optimizers.items()}

    def read():
        # The models' keys first: a checkpoint of another model is reported by its parameters, not by
        # the optimizer state that then does not fit either.
        registry, model_slots = _Registry(), []
        for name, obj in state.items():
            if _is_model(obj) and not _is_optimizer(obj):
                model_slots.extend(_model_slots(name, obj, registry))
        _check_keys(model_slots, manifest, directory)
        # Optimizer state arrays must exist before slots can point at them (undone below on failure).
        for name, opt in optimizers.items():
            if name not in manifest["json"]:
                raise CheckpointError(f"checkpoint: {directory} holds no optimizer {name!r}")
            _restore_optimizer(name, opt, manifest["json"][name], registry)
        slots, _ = _plan(state)
        _check_keys(slots, manifest, directory)
        reader = _Reader(directory, manifest, verify)
        staged = []
        for slot in slots:  # read and verify everything before changing anything
            host = np.empty(slot.array.size, dtype=slot.array.dtype)
            host[...] = to_numpy(slot.array).reshape(-1)
            for key, shape, gstart, lstart, count in slot.segments:
                reader.read(key, gstart, count, host[lstart: lstart + count])
            staged.append((slot, host))
        return staged

    try:
        staged = _agree(comm, f"load of step {step}", read)
    except CheckpointError:
        for name, (groups, opt_state) in before.items():  # a failed load leaves the optimizer as it was
            optimizers[name].param_groups[:] = [dict(g) for g in groups]
            optimizers[name].state = opt_state
        raise

    def apply():
        for slot, host in staged:
            copy_into(slot.array, host.reshape(slot.array.shape))
        entries = manifest["json"]
        if "json_per_rank" in manifest and manifest["world_size"] == comm.Get_size():
            entries = manifest["json_per_rank"][comm.Get_rank()]
        for name, obj in state.items():
            if name in entries and not _is_optimizer(obj):
                _restore_json(name, state, entries[name])

    _agree(comm, f"load of step {step} (apply)", apply)
    return int(step)


def _restore_json(name, state, value):
    obj = state[name]
    if isinstance(value, dict) and "__rng__" in value:
        obj.bit_generator.state = value["__rng__"]
    elif isinstance(value, dict) and "__sampler__" in value:
        obj.set_epoch(value["__sampler__"]["epoch"])
    elif isinstance(value, dict) and "__stateful__" in value:
        obj.load_state_dict(value["__stateful__"])
    else:
        state[name] = value
