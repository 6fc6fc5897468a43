"""Write a model's arrays as a safetensors file that other tools read, with a JSON config beside it; read it back.

safetensors is a flat file format (a JSON header naming each tensor's dtype, shape and byte range, then the raw
little-endian bytes): `safetensors.torch`, `safetensors.numpy`, Hugging Face `transformers` and most inference
tools read it without running any code from the file. This module writes *plain* (unsharded) models and state
dicts; ``mpidist.models.hf_gpt2`` builds Hugging Face GPT-2 checkpoints on it.

Files: ``save_safetensors(model, "out/model.safetensors", config=...)`` writes ``out/model.safetensors`` and
``out/config.json`` (the name Hugging Face uses: one model per directory).
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

from mpidist.files import atomic_path, write_text_atomic
from mpidist.nn.module import Module
from mpidist.xp import to_numpy

__all__ = ["CONFIG_NAME", "config_path", "save_safetensors", "load_safetensors"]

CONFIG_NAME = "config.json"


def config_path(path) -> str:
    """Return where the JSON config of the safetensors file ``path`` lives: ``config.json`` in its directory."""
    return os.path.join(os.path.dirname(os.fspath(path)), CONFIG_NAME)


def save_safetensors(model_or_state_dict, path, *, config=None, metadata: Optional[Mapping[str, str]] = None) -> None:
    """Write a plain model's parameters and buffers (or a state dict) to ``path`` as one safetensors file.

    ``model_or_state_dict`` is an ``nn.Module`` (its ``state_dict()``: parameters, then buffers; a tied weight
    once) or a mapping name -> array (numpy or CuPy). ``config``, when given (a mapping, or a dataclass such as
    ``gpt.config``), is written as JSON to ``config_path(path)``; ``metadata`` is the file header's string ->
    string metadata. Everything is checked before anything is written: names must be
    strings, dtypes ones safetensors stores (no complex128, object or string arrays), the config JSON-able.
    """
    context = "save_safetensors"
    if isinstance(model_or_state_dict, Module):
        state = model_or_state_dict.state_dict()
    elif isinstance(model_or_state_dict, Mapping):
        state = model_or_state_dict
    else:
        raise TypeError(f"{context}: expected an nn.Module or a mapping name -> array "
                        f"(got {type(model_or_state_dict).__name__})")
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
    if metadata is not None:
        if not isinstance(metadata, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                        for k, v in metadata.items()):
            raise TypeError(f"{context}: metadata must map strings to strings (got {metadata!r})")
        metadata = dict(metadata)
    config_text = None if config is None else _config_json(config, context)
    if os.path.isdir(path):
        raise IsADirectoryError(f"{context}: {os.fspath(path)} is a directory; name the .safetensors file to write")
    directory = os.path.dirname(os.fspath(path))
    if directory:
        os.makedirs(directory, exist_ok=True)
    with atomic_path(path) as temporary:  # a failed or killed export never leaves a half-written file at path
        safetensors.numpy.save_file(tensors, temporary, metadata=metadata)
    if config_text is not None:
        write_text_atomic(config_path(path), config_text)


def load_safetensors(path, module: Optional[Module] = None) -> Dict[str, np.ndarray]:
    """Read every tensor of the safetensors file ``path`` into a dict name -> numpy array.

    With ``module``, also copy them into it in place (``module.load_state_dict``, strict): missing or unexpected
    names, another shape or another dtype raise ValueError naming the tensors, and nothing is copied then.
    """
    context = "load_safetensors"
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"{context}: {path} is a directory; pass the .safetensors file in it")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{context}: no such file ({path})")
    try:
        tensors = safetensors.numpy.load_file(path)
    except (safetensors.SafetensorError, TypeError, ValueError) as e:  # bad header, a dtype numpy lacks (bf16)
        raise ValueError(f"{context}: {path} cannot be read as numpy arrays ({e}); not a safetensors file, or "
                         f"a dtype numpy lacks (bfloat16, float8)") from e
    if module is not None:
        _check_fits(module, tensors, f"{context}: {path}")
        module.load_state_dict(tensors, strict=True)
    return tensors


def _check_fits(module, tensors, context):
    own = {**{name: p.data for name, p in module.named_parameters()}, **dict(module.named_buffers())}
    missing = [name for name in own if name not in tensors]
    unexpected = [name for name in tensors if name not in own]
    if missing or unexpected:
        raise ValueError(f"{context}: names do not match {type(module).__name__}'s "
                         f"(missing: {missing[:8]}, unexpected: {unexpected[:8]})")
    wrong = [f"{name}: {tensors[name].shape} {tensors[name].dtype} (model: {array.shape} {array.dtype})"
             for name, array in own.items()
             if tuple(tensors[name].shape) != tuple(array.shape) or tensors[name].dtype != array.dtype]
    if wrong:
        raise ValueError(f"{context}: tensors do not fit {type(module).__name__} ({'; '.join(wrong[:8])})")


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
