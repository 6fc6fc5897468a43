"""PyTorch over MPI: a ``torch.distributed`` backend named ``"mpidist"`` on mpi4py (the optional extra
``mpidist[torch]``; the only part of mpidist that imports torch).

Importing it registers the backend; then, under mpiexec or srun::

    import mpidist.torch
    torch.distributed.init_process_group("mpidist")   # rank and world size come from MPI

- ``ProcessGroupMPI``: the process group (every operation torch's wrappers call, nonblocking).
- ``Work``: what its operations return (``wait()``, ``get_future()``).
- ``mpi_store()``: a TCPStore whose address travels over MPI (``init_method="mpi://"`` uses it).
See docs/torch.md.
"""

try:
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(f"mpidist.torch needs PyTorch ({exc}); install it with `pip install mpidist[torch]` "
                      f"(or `pip install torch`)") from exc

from ._backend import BACKEND_NAME, ProcessGroupMPI
from ._check import DesyncError
from ._init import mpi_store, register
from ._tensors import UnsupportedError
from ._work import Work

__all__ = ["BACKEND_NAME", "ProcessGroupMPI", "Work", "mpi_store", "register", "UnsupportedError", "DesyncError"]

register()
