"""Ask the MPI library mpi4py loaded whether it takes CUDA device buffers.

mpi4py 4.1 has no ``MPI.Query_cuda_support``, so the C extensions are called through ctypes:
``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)`` (MPICH) and ``MPIX_Query_cuda_support()``
(Open MPI; MPICH has it too). The answer is a claim, not a proof (some builds answer from build-time
configuration), so path selection adds a device-buffer self-test. A missing symbol or library means
"unknown", never a crash.
"""

import ctypes
import dataclasses
import os

__all__ = ["MPIProbe", "probe_mpi_cuda_support", "find_mpi_library"]

_MPIX_GPU_SUPPORT_CUDA = 0  # MPICH mpi.h: #define MPIX_GPU_SUPPORT_CUDA (0)


@dataclasses.dataclass(frozen=True)
class MPIProbe:
    """What the MPI library said about CUDA device buffers."""

    library: str         # the shared library asked ('' when none was found)
    symbol: str          # the symbol that answered ('' when none exists)
    cuda_support: object  # True, False, or None when the library cannot say

    def __str__(self):
        if not self.library:
            return "no MPI shared library found in this process"
        if not self.symbol:
            return f"{os.path.basename(self.library)} has neither MPIX_GPU_query_support nor MPIX_Query_cuda_support"
        answer = {True: "yes", False: "no"}[self.cuda_support]
        return f"{self.symbol} in {os.path.basename(self.library)} says {answer}"


def find_mpi_library(maps_path="/proc/self/maps"):
    """Return the path of the libmpi shared library mapped into this process ('' if none)."""
    from mpi4py import MPI  # noqa: F401 - importing MPI is what loads (and initializes) libmpi

    try:
        with open(maps_path) as f:
            paths = {line.split()[-1] for line in f if "/libmpi" in line}
    except OSError:
        return ""
    # libmpi.so.12 (MPICH) or libmpi.so.40 (Open MPI); not libmpi_cxx, libmpi_mpifh, ...
    candidates = sorted(p for p in paths if os.path.basename(p).startswith("libmpi.so"))
    return candidates[0] if candidates else ""


def _open(path):
    # mpi4py dlopens libmpi with RTLD_LOCAL, so its symbols are not in the global namespace:
    # open the already-mapped library by path (RTLD_NOLOAD: never load a second copy).
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LOCAL", 0)
    try:
        return ctypes.CDLL(path, mode=mode)
    except OSError:
        return None


def probe_mpi_cuda_support(library=None):
    """Return an ``MPIProbe``: which symbol of which libmpi answered, and what it said."""
    path = find_mpi_library() if library is None else library
    lib = _open(path) if path else None
    if lib is None and library is None:
        # No /proc/self/maps (not Linux) or a static libmpi: try the global symbol namespace.
        lib, path = ctypes.CDLL(None), "(process symbols)"
    if lib is None:
        return MPIProbe("", "", None)
    if hasattr(lib, "MPIX_GPU_query_support"):
        fn = lib.MPIX_GPU_query_support
        fn.argtypes, fn.restype = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)], ctypes.c_int
        flag = ctypes.c_int(0)
        if fn(_MPIX_GPU_SUPPORT_CUDA, ctypes.byref(flag)) == 0:
            return MPIProbe(path, "MPIX_GPU_query_support", bool(flag.value))
    if hasattr(lib, "MPIX_Query_cuda_support"):
        fn = lib.MPIX_Query_cuda_support
        fn.argtypes, fn.restype = [], ctypes.c_int
        return MPIProbe(path, "MPIX_Query_cuda_support", bool(fn()))
    return MPIProbe(path, "", None)
