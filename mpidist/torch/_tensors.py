"""Tensors as MPI buffers: numpy views of CPU tensors, staged copies where a view cannot serve.

Glossary:
- view: a numpy array sharing the tensor's memory (a contiguous CPU tensor): MPI reads and writes the
  tensor itself, no copy.
- bytes: the tensor's memory as a flat uint8 array. Operations that only move data (broadcast, gathers,
  all-to-all, send/recv) move bytes, so every dtype works, bfloat16 and float8 included.
- staged: a contiguous CPU copy in the dtype MPI computes in, copied back into the tensor when the
  operation finishes. Used for CUDA tensors (after synchronising the producing stream: MPI must not read
  memory a kernel is still writing), non-contiguous tensors, and reductions of float16/bfloat16, which
  are summed in float32 (numpy has no bfloat16, and an MPI float16 SUM is missing or unreliable in the
  MPI libraries we meet); that also rounds once instead of once per rank.
"""

import numpy as np
import torch

from .. import wire

__all__ = ["UnsupportedError", "Buffer", "check_device", "dtype_name", "reduce_dtype", "as_bytes", "as_reducible"]

_DEVICES = ("cpu", "cuda")


class UnsupportedError(TypeError):
    """An operation got input the backend cannot handle (the message names op, dtype and device)."""


def _describe(t):
    return f"dtype {t.dtype} on device {t.device}"


def dtype_name(dtype):
    """Return torch ``dtype``'s name (``torch.float32`` -> "float32"), as ``wire.DTYPES`` names it."""
    return str(dtype).removeprefix("torch.")


def check_device(op, t):
    """Raise UnsupportedError unless ``t`` is a tensor on a device the backend serves."""
    if not isinstance(t, torch.Tensor):
        raise UnsupportedError(f"mpidist {op}: expected a torch.Tensor (got {type(t).__name__})")
    if t.device.type not in _DEVICES:
        raise UnsupportedError(f"mpidist {op}: {_describe(t)} is not supported (devices: cpu, cuda)")
    if t.is_sparse or t.layout != torch.strided:
        raise UnsupportedError(f"mpidist {op}: {_describe(t)} with layout {t.layout} is not supported (dense tensors only)")


def reduce_dtype(op, t):
    """Return the torch dtype ``t`` is reduced in, or raise naming op, dtype and device."""
    check_device(op, t)
    name = wire.reduce_dtype(dtype_name(t.dtype))  # itself, or float32 for float16/bfloat16 (see the glossary)
    if name is not None:
        return getattr(torch, name)
    supported = ", ".join(sorted(row.name for row in wire.DTYPES if row.reduce_as is not None))
    raise UnsupportedError(f"mpidist {op}: {_describe(t)} cannot be reduced (reducible dtypes: {supported})")


class Buffer:
    """A numpy array holding a tensor's data for MPI, and how to put results back (see the glossary)."""

    __slots__ = ("tensor", "array", "_staged")

    def __init__(self, tensor, array, staged):
        self.tensor = tensor
        self.array = array
        self._staged = staged  # the CPU tensor behind ``array`` when it is a copy, else None

    def write_back(self):
        """Copy a staged result into the tensor (nothing for a view)."""
        if self._staged is not None:
            with torch.no_grad():
                self.tensor.copy_(self._staged.view(self.tensor.shape) if self._staged.dtype == self.tensor.dtype
                                  else self._staged.view(self.tensor.shape).to(self.tensor.dtype))


def _sync_stream(t):
    if t.is_cuda:
        # MPI reads host memory; the device-to-host copy below is ordered after the producing kernels on
        # the current stream, and .cpu() waits for it, but other streams' pending writes are the caller's.
        torch.cuda.current_stream(t.device).synchronize()


def _viewable(t):
    return t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def as_reducible(op, t, copy_in=True):
    """Return a Buffer of ``t`` in its reduce dtype: a view when possible, else a staged copy.

    ``copy_in=False``: the staged copy starts uninitialised (an output only).
    """
    dtype = reduce_dtype(op, t)
    if dtype == t.dtype and _viewable(t):
        return Buffer(t, t.detach().reshape(-1).numpy(), None)
    _sync_stream(t)
    if copy_in:
        staged = t.detach().to("cpu", dtype=dtype).resolve_conj().resolve_neg().contiguous().reshape(-1)
        if staged.data_ptr() == t.data_ptr():
            staged = staged.clone()
    else:
        staged = torch.empty(t.numel(), dtype=dtype)
    return Buffer(t, staged.numpy(), staged)


def as_bytes(op, t, copy_in=True):
    """Return a Buffer of ``t``'s memory as flat uint8: a view when possible, else a staged copy."""
    check_device(op, t)
    if _viewable(t):
        return Buffer(t, _byte_view(op, t.detach()), None)
    _sync_stream(t)
    if copy_in:
        staged = t.detach().to("cpu").resolve_conj().resolve_neg().contiguous().clone()
    else:
        staged = torch.empty(t.shape, dtype=t.dtype)
    return Buffer(t, _byte_view(op, staged), staged)


def _byte_view(op, t):
    try:
        return t.reshape(-1).view(torch.uint8).numpy()
    except (RuntimeError, TypeError) as exc:
        raise UnsupportedError(f"mpidist {op}: {_describe(t)} has no byte view ({exc})") from None


def empty_bytes(nbytes):
    return np.empty(nbytes, dtype=np.uint8)
