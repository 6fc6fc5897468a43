"""The one place that asks "numpy or CuPy?"; everything else asks it.

Only this module may import cupy, and only lazily: a numpy-only install never
pays for (or fails on) a cupy import.
"""

import sys

import numpy as np

__all__ = ["get_array_module", "is_device_array", "to_numpy", "asarray_like", "copy_into", "scatter_add",
           "get_cupy", "get_nccl", "gpu_count"]

_CUPY_MISSING = object()
_cupy = None  # the cupy module, _CUPY_MISSING once an import failed, None before the first try


def _is_cupy(x):
    return type(x).__module__.startswith("cupy")


def get_array_module(x):
    """Return the array module (numpy or cupy) that owns array ``x``."""
    if _is_cupy(x):
        # An array of cupy type means cupy is already imported.
        return sys.modules["cupy"]
    return np


def get_cupy():
    """Return the cupy module, or None when it is not installed (the import is tried once)."""
    global _cupy
    if _cupy is None:
        try:
            import cupy
            _cupy = cupy
        except ImportError:
            _cupy = _CUPY_MISSING
    return None if _cupy is _CUPY_MISSING else _cupy


def get_nccl():
    """Return ``cupy.cuda.nccl``; raise ImportError when cupy or its NCCL binding is missing."""
    if get_cupy() is None:
        raise ImportError("cupy is not installed")
    from cupy.cuda import nccl
    return nccl


def gpu_count():
    """Return how many CUDA GPUs this process can use: 0 without cupy or without a working GPU."""
    cupy = get_cupy()
    # `import cupy` succeeds on a machine without a GPU; the first GPU call is what fails.
    if cupy is None or not cupy.is_available():
        return 0
    return int(cupy.cuda.runtime.getDeviceCount())


def is_device_array(x):
    """Return True if ``x`` lives in GPU memory (a CuPy array)."""
    return _is_cupy(x)


def to_numpy(x):
    """Return ``x`` as a numpy array, copying from the device if needed."""
    return x.get() if _is_cupy(x) else np.asarray(x)


def scatter_add(target, indices, values):
    """Add ``values`` into ``target[indices]`` in place, summing repeated indices."""
    xp = get_array_module(target)
    if hasattr(xp, "add") and hasattr(xp.add, "at"):
        xp.add.at(target, indices, values)
    else:
        # Older CuPy has no ufunc.at; cupyx.scatter_add is its equivalent.
        import cupyx
        cupyx.scatter_add(target, indices, values)


def asarray_like(x, like):
    """Return ``x`` as an array of the same array module as ``like`` (copying across devices)."""
    xp = get_array_module(like)
    if xp is np:
        return to_numpy(x)
    return xp.asarray(x)


def copy_into(dst, src):
    """Copy ``src`` into ``dst`` in place, across numpy/CuPy if needed; ``dst`` keeps its identity."""
    dst[...] = asarray_like(src, dst)
