"""GPU-aware collectives for CuPy arrays: the path per communicator, chosen safely and logged.

Files are the design: ``device.py`` (the device API and its CuPy implementation), ``probe.py`` (what
the MPI library says about CUDA), ``select.py`` (the choice, cached per communicator), one file per
path (``direct.py``, ``nccl.py``, ``ipc.py``, ``hierarchical.py``, ``staged.py``), and ``dispatch.py``
(what ``mpidist.collectives`` calls). Logger: ``mpidist.gpu``. See docs/gpu.md.
"""

from .base import Op, Settings
from .device import CupyDevice, DeviceAPI, NcclComm
from .probe import MPIProbe, find_mpi_library, probe_mpi_cuda_support
from .select import PATHS, Choice, attach, describe, engine, release

__all__ = ["attach", "describe", "engine", "release", "Choice", "PATHS", "Settings", "Op",
           "DeviceAPI", "CupyDevice", "NcclComm", "MPIProbe", "probe_mpi_cuda_support", "find_mpi_library"]
