"""Write a model's arrays as a safetensors file that other tools read, with a JSON config beside it; read it back.

safetensors is a flat file format (a JSON header naming each tensor's dtype, shape and byte range, then the raw
little-endian bytes): `safetensors.torch`, `safetensors.numpy`, Hugging Face `transformers` and most inference
tools read it without running any code from the file. This module writes *plain* (unsharded) models and state
dicts; ``mpidist.models.hf_gpt2`` builds Hugging Face GPT-2 checkpoints on it.

Files: ``save_safetensors(model, "out/model.safetensors", config=...)`` writes ``out/model.safetensors`` and
``out/config.json`` (the name Hugging Face uses: one model per directory).

Any layout: a model or wrapper spread over ranks (DDP, FSDP, hybrid, tensor parallel, Pipeline, a 3-D mesh) is
saved in one call by every rank: ``mpidist.full_state_dict`` streams the unsplit tensors to the writing rank, one
at a time, and that rank writes the file. ``load_safetensors(path, model)`` is the inverse: the reading rank reads
the file and ``load_full_state_dict`` scatters it into the model's layout. Either raises on every rank when any
rank fails (``mpidist.comm.agree``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any, Dict, Optional

import numpy as np
import safetensors
import safetensors.numpy

from mpidist.comm.agree import agreed
from mpidist.files import atomic_path, write_text_atomic
from mpidist.nn.module import Module
from mpidist.nn.precision import as_dtype, bfloat16, is_floating
from mpidist.parallel.full_state import full_state_dict, load_full_state_dict
from mpidist.parallel.interface import Wrapper, as_wrapper
from mpidist.xp import to_numpy

__all__ = ["CONFIG_NAME", "config_path", "save_safetensors", "load_safetensors", "read_safetensors"]

CONFIG_NAME = "config.json"


def config_path(path) -> str:
    """Return where the JSON config of the safetensors file ``path`` lives: ``config.json`` in its directory."""
    return os.path.join(os.path.dirname(os.fspath(path)), CONFIG_NAME)


def layout_comm(obj, comm):
    """Return the communicator a full-state gather of ``obj`` runs over: ``comm``, else the layout's own."""
    return as_wrapper(obj).mesh.comm if comm is None else comm


def on_rank(comm, rank, fn, context):
    """Run ``fn()`` on ``rank`` of ``comm`` only; if it raised, raise on every rank (collective). Return its result
    there, None elsewhere. ``comm`` None: this process alone, which runs it."""
    if comm is None:
        return fn()
    return agreed(comm, lambda: fn() if comm.Get_rank() == rank else None, context)


def gather_state(obj, comm=None, *, rank=0, context="gather_state", dtype=None):
    """Return (the unsplit state of a model, wrapper or mapping on ``rank``, {} elsewhere; the communicator used).

    A mapping is this process's own state (comm None). A model or wrapper at any layout is gathered by
    ``full_state_dict`` over ``comm`` (default: the layout's own), one tensor at a time; collective there.
    ``dtype`` (float32, bfloat16, float16 or a name such as "bf16"): the floating tensors come back cast to it.
    """
    if isinstance(obj, Mapping):
        if dtype is None:
            return obj, None
        dtype = as_dtype(dtype, f"{context}: dtype")
        return {name: _cast_floating(np.asarray(to_numpy(array)), dtype) for name, array in obj.items()}, None
    if not isinstance(obj, (Module, Wrapper)):
        raise TypeError(f"{context}: expected an nn.Module, a parallel wrapper (DDP, FSDP, Pipeline) or a mapping "
                        f"name -> array (got {type(obj).__name__})")
    comm = layout_comm(obj, comm)
    return full_state_dict(obj, comm, rank=rank, dtype=dtype), comm


def _cast_floating(array, dtype):
    """Return ``array`` cast to ``dtype`` if it is floating (bfloat16 included), else as it is."""
    return array.astype(dtype, copy=False) if is_floating(array.dtype) else array


def save_safetensors(model_or_state_dict, path, *, config=None, metadata: Optional[Mapping[str, str]] = None,
                     comm=None, rank=0, dtype=None) -> None:
    """Write a model's unsplit parameters and buffers (or a state dict) to ``path`` as one safetensors file.

    ``model_or_state_dict``: a mapping name -> array (numpy or CuPy), written by this process; or an ``nn.Module``
    or parallel wrapper at any layout (plain, tensor parallel, DDP, FSDP, Pipeline, a mesh of them), whose unsplit
    state (``mpidist.full_state_dict``: the one-process model's ``state_dict()``, a tied weight once) is gathered
    onto ``rank`` of ``comm`` (default: the layout's own communicator; pass the world's when the layout has none,
    e.g. DDP over a tensor-parallel model) and written there. Collective over ``comm`` then; a failure on the
    writing rank raises on every rank. ``config``, when given (a mapping, or a dataclass such as ``gpt.config``), is
    written as JSON to ``config_path(path)``; ``metadata`` is the file header's string -> string metadata.
    Everything is checked before anything is written: names must be strings, dtypes ones safetensors stores (no
    complex128, object or string arrays), the config JSON-able. ``dtype`` (float32, bfloat16, float16 or a name
    such as "bf16") writes the floating tensors in it, e.g. a bfloat16 model's float32 copy; default: as they are
    (bfloat16 is stored as safetensors' BF16).
    """
    context = "save_safetensors"
    if not isinstance(model_or_state_dict, (Mapping, Module, Wrapper)):
        raise TypeError(f"{context}: expected an nn.Module, a parallel wrapper or a mapping name -> array "
                        f"(got {type(model_or_state_dict).__name__})")
    gather_comm = None if isinstance(model_or_state_dict, Mapping) else layout_comm(model_or_state_dict, comm)
    # The arguments are checked on every rank before the gather, so a typo costs no transfer.
    if dtype is not None:
        as_dtype(dtype, f"{context}: dtype")  # on every rank, before anything collective
    config_text = on_rank(gather_comm, rank, lambda: _check_arguments(path, config, metadata, context), context)
    state, gather_comm = gather_state(model_or_state_dict, gather_comm, rank=rank, context=context, dtype=dtype)
    on_rank(gather_comm, rank, lambda: _write(state, path, config_text, metadata, context), context)


def _check_arguments(path, config, metadata, context):
    """Return the config's JSON text (None without one) after checking ``metadata`` and that ``path`` is no directory."""
    if metadata is not None and not (isinstance(metadata, Mapping) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise TypeError(f"{context}: metadata must map strings to strings (got {metadata!r})")
    if os.path.isdir(path):
        raise IsADirectoryError(f"{context}: {os.fspath(path)} is a directory; name the .safetensors file to write")
    return None if config is None else _config_json(config, context)


def _write(state, path, config_text, metadata, context):
    bad_names = [name for name in state if not isinstance(name, str)]
    if bad_names:
        raise TypeError(f"{context}: tensor names must be strings (got {bad_names[:5]})")
    # The library reads each array's memory from its data pointer: it must be host, C-contiguous memory.
    tensors = {name: np.asarray(to_numpy(array), order="C") for name, array in state.items()}
    storable = {dtype: _storable(dtype) for dtype in {array.dtype for array in tensors.values()}}
    refused = {}
    for name, array in tensors.items():
        if not storable[array.dtype]:
            refused.setdefault(str(array.dtype), []).append(name)
    if refused:
        listed = "; ".join(f"{dtype}: {names[:5]}" for dtype, names in refused.items())
        raise ValueError(f"{context}: safetensors cannot store these dtypes ({listed}); cast them first "
                         f"(complex128 -> two float64 arrays or complex64)")
    directory = os.path.dirname(os.fspath(path))
    if directory:
        os.makedirs(directory, exist_ok=True)
    with atomic_path(path) as temporary:  # a failed or killed export never leaves a half-written file at path
        safetensors.numpy.save_file(tensors, temporary, metadata=None if metadata is None else dict(metadata))
    if config_text is not None:
        write_text_atomic(config_path(path), config_text)


def read_safetensors(path, context="load_safetensors") -> Dict[str, np.ndarray]:
    """Return every tensor of the safetensors file ``path`` as a dict name -> numpy array (this process reads).

    By name; BF16 comes back as ``ml_dtypes.bfloat16`` (safetensors.numpy cannot read it).
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"{context}: {path} is a directory; pass the .safetensors file in it")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{context}: no such file ({path})")
    try:
        with open(path, "rb") as f:
            entries = safetensors.deserialize(f.read())
    except (safetensors.SafetensorError, TypeError, ValueError) as e:  # a bad header
        raise ValueError(f"{context}: {path} cannot be read as numpy arrays ({e}); not a safetensors file") from e
    unknown = sorted({(entry["dtype"], name) for name, entry in entries if entry["dtype"] not in _NUMPY_DTYPES})
    if unknown:
        raise ValueError(f"{context}: {path} cannot be read as numpy arrays (dtypes numpy lacks, float8 and the "
                         f"like: {unknown[:5]})")
    # Little-endian bytes, as safetensors writes them; a copy, so the arrays are writable and own their memory.
    # By name, as safetensors.numpy.load_file gives them (the header's order is by dtype alignment).
    entries = sorted(entries, key=lambda item: item[0])
    return {name: np.frombuffer(entry["data"], dtype=np.dtype(_NUMPY_DTYPES[entry["dtype"]]).newbyteorder("<"))
            .reshape(entry["shape"]).astype(_NUMPY_DTYPES[entry["dtype"]]) for name, entry in entries}


# safetensors' dtype names -> numpy's: safetensors.numpy's table, plus BF16 as ml_dtypes' bfloat16.
_NUMPY_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": bfloat16, "I64": np.int64,
                 "U64": np.uint64, "I32": np.int32, "U32": np.uint32, "I16": np.int16, "U16": np.uint16,
                 "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_, "C64": np.complex64}


def load_safetensors(path, model=None, comm=None, *, rank=0) -> Dict[str, np.ndarray]:
    """Read every tensor of the safetensors file ``path``; with ``model``, scatter them into its layout.

    Without ``model``: return the dict name -> numpy array (this process reads the file). With ``model`` (an
    ``nn.Module`` or parallel wrapper at any layout): ``rank`` of ``comm`` (default: the layout's own
    communicator) reads the file and ``load_full_state_dict`` copies each tensor into every rank's part of it;
    collective over ``comm``. Missing or unexpected names, another shape, or a dtype that does not cast to the
    model's raise ValueError on every rank naming the tensors, and nothing is copied then. Returns the tensors
    on ``rank``, {} elsewhere.
    """
    context = "load_safetensors"
    if model is None:
        return read_safetensors(path, context)
    if not isinstance(model, (Module, Wrapper)):
        raise TypeError(f"{context}: model must be an nn.Module or a parallel wrapper (got {type(model).__name__})")
    comm = layout_comm(model, comm)
    tensors = on_rank(comm, rank, lambda: read_safetensors(path, context), context)
    load_full_state_dict(model, tensors, comm, rank=rank, context=f"{context}: {os.fspath(path)}")
    return {} if tensors is None else tensors


def _storable(dtype) -> bool:
    """Return whether safetensors stores ``dtype`` (asked of the library, which owns the list)."""
    try:
        safetensors.numpy.save({"probe": np.empty(0, dtype=dtype)})
    except (safetensors.SafetensorError, TypeError, ValueError):
        return False
    return True


def _config_json(config: Any, context) -> str:
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    if not isinstance(config, Mapping):
        raise TypeError(f"{context}: config must be a mapping or a dataclass instance (got {type(config).__name__})")
    try:
        return json.dumps(dict(config), indent=2, sort_keys=True) + "\n"
    except (TypeError, ValueError) as e:
        raise TypeError(f"{context}: config is not JSON-serializable ({e})") from e
