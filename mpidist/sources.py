"""Where a deferred model's values come from when it starts from a file: read box by box, each rank its part.

``mpidist.nn.load_deferred(model, source, prefix)`` points every deferred parameter at ``source``; whoever then
materializes a parameter (``nn.materialize``, or a parallel wrapper: FSDP its shard of each unit, tensor
parallelism its slices, a pipeline its stage) reads only the boxes it holds. So a model saved at one layout
starts at another without a full copy on any rank, and each rank's ``bytes_read`` is its share.

A source answers ``shape(key)`` and ``dtype(key)`` (None for a key it lacks) and ``read(key, offsets, sizes,
out)``; ``bytes_read`` counts the stored bytes it copied out.
"""
from __future__ import annotations

import math
import os

import numpy as np
from safetensors import safe_open

from .checkpoint import open_step

__all__ = ["CheckpointSource", "SafetensorsSource"]


class CheckpointSource:
    """The tensors of an ``mpidist.checkpoint`` step (default: the newest), read lazily from its memory-mapped
    rank files: a box costs the bytes of the stored chunks it overlaps. Keys are the checkpoint's ("model.<name>"
    for a state saved as ``{"model": ...}``: pass ``prefix="model."`` to ``load_deferred``)."""

    def __init__(self, root, step=None, verify=False):
        self._reader = open_step(root, step, verify)
        self.step = step

    def shape(self, key):
        entry = self._reader.manifest["tensors"].get(key)
        return None if entry is None else tuple(entry["shape"])

    def dtype(self, key):
        entry = self._reader.manifest["tensors"].get(key)
        return None if entry is None else np.dtype(entry["dtype"])

    def read(self, key, offsets, sizes, out):
        """Fill ``out`` (shape ``sizes``) with the box at ``offsets`` of tensor ``key``."""
        self._reader.read(key, tuple(offsets), tuple(sizes), out)

    @property
    def bytes_read(self):
        return self._reader.bytes_read


class SafetensorsSource:
    """The tensors of a safetensors file (``mpidist.export.save_safetensors`` writes one), read as slices: a box
    costs its own bytes (the file is memory-mapped; a box's rows are contiguous runs of it)."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self._file = safe_open(self.path, framework="numpy")
        self._keys = set(self._file.keys())
        self._meta = {}
        self.bytes_read = 0

    def _slice(self, key):
        return self._file.get_slice(key)

    def shape(self, key):
        return tuple(self._slice(key).get_shape()) if key in self._keys else None

    def dtype(self, key):
        if key not in self._keys:
            return None
        # The header's dtype names ("F32", "BF16", ...): read one element to get numpy's name for it.
        if key not in self._meta:
            view = self._slice(key)
            self._meta[key] = view[tuple(slice(0, min(1, n)) for n in view.get_shape())].dtype
        return self._meta[key]

    def read(self, key, offsets, sizes, out):
        """Fill ``out`` (shape ``sizes``) with the box at ``offsets`` of tensor ``key``."""
        box = self._slice(key)[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))] if sizes else \
            self._file.get_tensor(key)
        out[...] = box
        self.bytes_read += math.prod(sizes) * out.dtype.itemsize
