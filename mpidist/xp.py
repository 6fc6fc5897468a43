"""The one place that asks "numpy or CuPy?"; everything else asks it.

Only this module may import cupy, and only lazily: a numpy-only install never
pays for (or fails on) a cupy import.
"""

import sys

import ml_dtypes
import numpy as np

__all__ = ["get_array_module", "is_device_array", "to_numpy", "asarray_like", "copy_into", "scatter_add",
           "get_cupy", "get_nccl", "gpu_count", "bfloat16_problem", "check_dtype"]

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


# bfloat16 on CuPy: CuPy 14 added it, through ml_dtypes.bfloat16 ("Minimal support for bfloat16", CuPy's upgrade guide
# for v14; cupy/cupy#9494; it needs NumPy >= 2.1.2). CuPy 13 and older have no bfloat16 arrays (cupy/cupy#7527).
# Whether an installed CuPy has it is asked of CuPy itself (a round trip through a kernel), once per module.
_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_bfloat16_problems = {}  # id(array module) -> (module, None or why it has no bfloat16)


def _probe_bfloat16(xp):
    values = [1.5, -2.0, 3.015625]  # exact in bfloat16 (8 significant bits)
    try:
        up = to_numpy(xp.asarray(np.array(values, _BFLOAT16)).astype(np.float32))
        down = to_numpy(xp.asarray(np.array(values, np.float32)).astype(_BFLOAT16))
    except Exception as exc:  # noqa: BLE001 - any failure (no dtype, a kernel that does not compile) means no
        return f"{type(exc).__name__}: {exc}"
    if up.tolist() != values or down.dtype != _BFLOAT16 or down.astype(np.float32).tolist() != values:
        return f"a bfloat16 round trip of {values} gave {up.tolist()} and {down.tolist()}"
    return None


def bfloat16_problem(xp):
    """Return None if array module ``xp`` (numpy or cupy) holds bfloat16 arrays, else why it does not."""
    if xp is np:
        return None
    entry = _bfloat16_problems.get(id(xp))
    if entry is None or entry[0] is not xp:
        entry = _bfloat16_problems[id(xp)] = (xp, _probe_bfloat16(xp))
    return entry[1]


def check_dtype(like, dtype, context):
    """Raise TypeError if arrays of ``like``'s module (an array, or numpy/cupy itself) cannot hold ``dtype``.

    Only bfloat16 on a CuPy without it fails: the error names the dtype and CuPy's version, never a silent float32.
    """
    xp = like if isinstance(like, type(np)) else get_array_module(like)
    if np.dtype(dtype) != _BFLOAT16:
        return
    problem = bfloat16_problem(xp)
    if problem is not None:
        raise TypeError(f"{context}: CuPy {getattr(xp, '__version__', '?')} has no bfloat16 arrays ({problem}); "
                        f"bfloat16 on CuPy needs CuPy >= 14 with ml_dtypes and NumPy >= 2.1.2: use float16 or "
                        f"float32 on this GPU")
