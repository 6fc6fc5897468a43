"""Stand-in for examples/digits.py in the Slurm checks: same flags, tiny work, JSON out.

Each rank calls ``mpidist.init()``, allreduces ``rank + 1`` (expected: n(n+1)/2) and writes
``OUT/rank<r>.json`` with what it saw. With ``--ckpt DIR`` it follows the preemption protocol of
slurm/preemptible.sbatch through ``mpidist.preemption``: on SIGUSR1/SIGTERM every rank stops after
the same epoch, rank 0 saves the epoch reached, and all exit with ``PREEMPTED_EXIT`` (99); started
again with the same ``--ckpt`` it resumes from the saved epoch.
"""

import argparse
import json
import os
import socket
import time

import numpy as np

import mpidist
from mpidist.preemption import PREEMPTED_EXIT, Preemption


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=("ddp", "fsdp", "pipeline"), default="ddp")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", help="checkpoint directory: resume from it, save into it when preempted")
    parser.add_argument("--epoch-seconds", type=float, default=float(os.environ.get("STAND_IN_EPOCH_SECONDS", "0")))
    args = parser.parse_args()

    comm, info = mpidist.init()
    preemption = Preemption(comm).install()
    rank, size = comm.Get_rank(), comm.Get_size()
    start = 0
    state = os.path.join(args.ckpt, "epoch.json") if args.ckpt else None
    if state and os.path.exists(state):
        with open(state) as f:
            start = json.load(f)["epoch"]
    total = np.array([rank + 1.0])
    mpidist.allreduce(total, comm)
    for epoch in range(start, args.epochs):
        time.sleep(args.epoch_seconds)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} strategy {args.strategy}", flush=True)
        if preemption.should_stop() and epoch + 1 < args.epochs:
            if rank == 0 and state:
                os.makedirs(args.ckpt, exist_ok=True)
                with open(state, "w") as f:
                    json.dump({"epoch": epoch + 1}, f)
                print(f"preempted after epoch {epoch + 1}: checkpoint saved, exiting {PREEMPTED_EXIT}", flush=True)
            mpidist.barrier(comm)
            preemption.exit()
    os.makedirs(args.out, exist_ok=True)
    result = {"rank": rank, "size": size, "local_rank": info.local_rank, "launcher": info.launcher,
              "nodes": info.nodes, "host": socket.gethostname(),
              "allreduce": float(total[0]), "expected": size * (size + 1) / 2, "strategy": args.strategy,
              "epochs": args.epochs, "resumed_from": start,
              "restarts": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
              "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
              "slurm_procid": os.environ.get("SLURM_PROCID")}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
