"""A job for the virtual cluster: report where every rank runs and which ranks share its layout groups.

    mpiexec ... python tests/cluster/node_job.py OUT_DIR

Each rank writes OUT_DIR/rank<r>.json: its host (``MPI.Get_processor_name``), what ``mpidist.init()`` reports,
and the world ranks in its groups of ``mesh(tp=2)``, ``mesh(pp=2)`` and hybrid FSDP without ``shard_size``,
plus an 8 MiB allreduce's result, flat and through ``HierarchicalAllreduce`` (with its node leaders). tests/test_cluster.py checks these against the host names.
"""

import json
import os
import sys

import numpy as np
from mpi4py import MPI

import mpidist
import mpidist.nn as nn
from mpidist.collectives_hier import HierarchicalAllreduce
from mpidist.parallel import mesh
from mpidist.parallel.fsdp import FSDP


def members(sub, comm):
    return sub.allgather(comm.Get_rank())


def main(out_dir):
    comm = MPI.COMM_WORLD
    _, info = mpidist.init()
    rank, size = comm.Get_rank(), comm.Get_size()
    tp = mesh(comm, tp=2)
    pp = mesh(comm, pp=2)
    fsdp = FSDP(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)), comm, strategy="hybrid_shard")
    shard, replicate = fsdp.communicators()
    x = np.full(1 << 20, float(rank + 1))  # 8 MiB of float64
    total = mpidist.allreduce(x, comm)
    with HierarchicalAllreduce(comm, "hierarchical") as hierarchical:
        leaders = comm.allgather(rank if hierarchical.local_rank == 0 else None)
        y = np.full(1 << 20, float(rank + 1))
        hierarchical(y)
    report = {
        "rank": rank, "size": size, "host": MPI.Get_processor_name(),
        "init": {"nodes": info.nodes, "local_rank": info.local_rank, "local_size": info.local_size,
                 "launcher": info.launcher},
        "tp": members(tp.tp_comm, comm), "tp_dp": members(tp.dp_comm, comm),
        "pp": members(pp.pp_comm, comm), "pp_dp": members(pp.dp_comm, comm),
        "shard": members(shard, comm), "replicate": members(replicate, comm),
        "allreduce_ok": bool(np.all(total == size * (size + 1) / 2)),
        "hierarchical_ok": bool(np.all(y == size * (size + 1) / 2)),
        "leaders": [r for r in leaders if r is not None],
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
