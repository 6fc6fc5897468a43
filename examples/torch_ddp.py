"""Train a PyTorch digit classifier with unmodified DistributedDataParallel over MPI, and check it against one process.

Run:  mpiexec -n 4 python examples/torch_ddp.py        (needs `pip install -e '.[torch,examples]'`)
      mpiexec -n 2 python examples/torch_ddp.py --backend gloo     (the same script over gloo, to compare)

The one line that makes a PyTorch script run over MPI is ``import mpidist.torch`` (it registers the backend);
``init_process_group("mpidist")`` takes rank and world size from MPI: no MASTER_ADDR, no port, no torchrun.
The data is scikit-learn's bundled digits set (no download). Each rank trains on its rows of every global
batch; at the end rank 0 trains the same model on the same global batches in one process (float64) and
compares the weights, as examples/digits.py does for mpidist's own DDP.
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import mpidist.torch  # noqa: F401 - the one changed line: registers the "mpidist" backend


def load_digits(seed=0, test_fraction=0.2):
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError:
        sys.exit("torch_ddp example: scikit-learn is required (pip install -e '.[examples]')")
    data = sk_load_digits()
    x, y = torch.tensor(data.data / 16.0), torch.tensor(data.target)
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(x)))
    n_test = int(len(x) * test_fraction)
    return x[order[n_test:]], y[order[n_test:]], x[order[:n_test]], y[order[:n_test]]


def build_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def global_batches(n_samples, batch, epochs, seed):
    """Yield the index tensor of every global batch (the same on every rank)."""
    for epoch in range(epochs):
        order = torch.randperm(n_samples, generator=torch.Generator().manual_seed(seed + epoch))
        for start in range(0, n_samples - batch + 1, batch):
            yield order[start: start + batch]


def train(model, x, y, args, world, rank=None):
    """Train on every global batch: this rank's rows of it, or (``rank`` None) all of it in one process."""
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for idx in global_batches(len(x), args.batch * world, args.epochs, args.seed):
        mine = idx if rank is None else idx[rank * args.batch:(rank + 1) * args.batch]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
        opt.step()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="mpidist")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="rows per rank of each global batch")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    # What slurm/cpu.sbatch passes (MPIDIST_PROGRAM=examples/torch_ddp.py): DDP is the one strategy here.
    parser.add_argument("--strategy", default="ddp", choices=["ddp"])
    parser.add_argument("--out", help="directory for result.json (rank 0)")
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)

    dist.init_process_group(args.backend)  # rank and world size from MPI
    rank, world = dist.get_rank(), dist.get_world_size()
    x_train, y_train, x_test, y_test = load_digits(args.seed)
    model = DDP(build_model(args.seed))
    start = time.perf_counter()
    train(model, x_train, y_train, args, world, rank)
    seconds = time.perf_counter() - start
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).double().mean().item()
    ok = True
    if rank == 0:
        print(f"{args.backend}: {world} ranks, {args.epochs} epochs in {seconds:.2f} s, test accuracy {accuracy:.3f}")
        reference = build_model(args.seed)
        train(reference, x_train, y_train, args, world)
        diff = max((a - b).abs().max().item() for a, b in zip(model.module.parameters(), reference.parameters()))
        ok = diff < 1e-9
        print(f"check: max |w_distributed - w_single_process| = {diff:.2e} ({'OK' if ok else 'MISMATCH'})")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "result.json"), "w") as f:
                json.dump({"backend": args.backend, "world": world, "epochs": args.epochs, "seconds": seconds,
                           "test_accuracy": accuracy, "max_abs_diff_vs_single_process": diff}, f, indent=1)
    verdict = torch.tensor([int(ok)])
    dist.broadcast(verdict, 0)
    dist.destroy_process_group()
    return 0 if verdict.item() else 1


if __name__ == "__main__":
    sys.exit(main())
