"""Train a handwritten-digit classifier with mpidist and check it against a single-process run.

Run:  mpiexec -n 4 python examples/digits.py --strategy ddp      (or fsdp, pipeline; make demo STRATEGY=...)

The data is scikit-learn's bundled digits set (1,797 8x8 images, shipped inside scikit-learn: no
download). Every rank reads its shard of each global batch (DistributedSampler); at the end rank 0
trains the same model on the same global batches in a single process and compares the weights.

With --ckpt the run can stop (SIGTERM, SIGUSR1, Ctrl-C) and resume at another world size: each
global batch is the next block of the epoch's sample order, so a resumed run goes on from the sample
where the last one stopped. The checkpoint records each run's segment (world size, batch per rank,
where it started), and the single-process reference replays those segments: the run as it happened.
"""

import argparse
import json
import os
import sys
import time

import numpy as np

import mpidist
from mpidist import checkpoint, nn, optim
from mpidist.data import DistributedSampler
from mpidist.preemption import Preemption

N_CLASSES = 10


def load_digits(seed=0, test_fraction=0.2):
    """Return (x_train, y_train, x_test, y_test) as float64 features in [0, 1] and int labels."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError:
        sys.exit("digits demo: scikit-learn is required (pip install -e '.[examples]')")
    data = sk_load_digits()
    x, y = data.data.astype(np.float64) / 16.0, data.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def build_layers(seed, hidden=128):
    """Return the classifier's layers (built from ``seed``, identical on every rank)."""
    rng = np.random.default_rng(seed)
    return [nn.Linear(64, hidden, rng=rng, dtype=np.float64), nn.ReLU(),
            nn.Linear(hidden, hidden, rng=rng, dtype=np.float64), nn.ReLU(),
            nn.Linear(hidden, N_CLASSES, rng=rng, dtype=np.float64)]


def epoch_order(n_samples, seed, epoch, size):
    """Return the epoch's global sample order (padded to a multiple of ``size``), as every rank's sampler has it."""
    sampler = DistributedSampler(n_samples, _LayoutOnly(size), seed=seed)
    sampler.set_epoch(epoch)
    return sampler.global_order()


def global_batches(order, batch_per_rank, size, start=0):
    """Yield (position after the step, every rank's index batch) for the steps of an epoch from sample ``start``.

    A step takes the next ``size * batch_per_rank`` samples of ``order``, rank r every size-th of them:
    from the start of an epoch that is exactly ``DistributedSampler``'s shard of each rank, batch by
    batch. From a position another world size stopped at, what is left is padded (as the sampler pads)
    to a multiple of ``size``, so every rank still gets as many samples as the others.
    """
    rest = order[start:]
    rest = np.concatenate([rest, np.resize(rest, -len(rest) % size)]) if len(rest) else rest
    step = size * batch_per_rank
    for first in range(0, len(rest), step):
        block = rest[first:first + step]
        yield start + first + len(block), [block[r::size] for r in range(size)]


def as_array(x):
    """Return the array of a Tensor (a plain array as it is)."""
    return x.data if isinstance(x, nn.Tensor) else x


def accuracy(forward, x, y):
    with nn.no_grad():
        return float((as_array(forward(x)).argmax(axis=1) == y).mean())


# -- strategies: each returns (trainer with step(batches) -> loss, full state dict getter on rank 0) --
class DDPTrainer:
    def __init__(self, comm, args):
        self.comm = comm
        self.model = mpidist.DDP(nn.Sequential(*build_layers(args.seed)), comm)
        self.opt = optim.Adam(self.model.parameters(), lr=args.lr)
        self.crit = nn.CrossEntropyLoss()

    def step(self, x, y):
        self.opt.zero_grad()
        loss = self.crit(self.model(x), y)
        loss.backward()  # DDP/FSDP hooks average the gradients during backward
        self.opt.step()
        return float(loss)

    def predict(self, x):
        return self.model.module(x)

    def epoch_loss(self, losses):
        """Mean loss over the epoch's global batches (each rank's losses are of its shard only)."""
        return mpidist.allreduce(np.array([np.mean(losses)]), self.comm, op="mean")[0]

    def comm_seconds(self):
        return self.model.stats["sync_wait_s"]

    def full_state(self):
        return self.model.state_dict()


class FSDPTrainer(DDPTrainer):
    def __init__(self, comm, args):
        self.comm = comm
        self.model = mpidist.FSDP(nn.Sequential(*build_layers(args.seed)), comm, strategy=args.fsdp_strategy)
        self.opt = optim.Adam(self.model.parameters(), lr=args.lr)
        self.crit = nn.CrossEntropyLoss()

    def predict(self, x):
        return self.model(x)  # gathers unit by unit: every rank evaluates together

    def comm_seconds(self):
        return self.model.stats["comm_wait_s"]

    def full_state(self):
        return self.model.full_state_dict()


class PipelineTrainer:
    """The layers split into ``pp`` stages (1F1B over micro-batches); ``dp`` replicas of that pipeline."""

    def __init__(self, comm, args):
        size = comm.Get_size()
        if size % args.dp:
            sys.exit(f"digits demo: --dp {args.dp} does not divide the {size} ranks")
        self.comm, self.grid = comm, mpidist.mesh(comm, dp=args.dp, pp=size // args.dp)
        layers = build_layers(args.seed)
        self.bounds = np.linspace(0, len(layers), self.grid.pp + 1).round().astype(int)
        first, last = self.bounds[self.grid.pp_rank], self.bounds[self.grid.pp_rank + 1]
        self.stage = nn.Sequential(*layers[first:last])
        self.pipe = mpidist.Pipeline(self.stage, self.grid.pp_comm, num_microbatches=args.microbatches,
                                     schedule=args.schedule, loss_fn=nn.CrossEntropyLoss(),
                                     dp_comm=self.grid.dp_comm if self.grid.dp > 1 else None)
        self.model = self.pipe
        params = list(self.stage.parameters())
        self.opt = optim.Adam(params, lr=args.lr) if params else None  # a stage may be just a ReLU
        self.idle_s = 0.0

    @property
    def first(self):
        return self.grid.pp_rank == 0

    @property
    def last(self):
        return self.grid.pp_rank == self.grid.pp - 1

    def step(self, x, y):
        # The demo hands each world rank its shard; a replica's batch is the shards of its pp ranks.
        x, y = self.comm.allgather(x), self.comm.allgather(y)
        replica = slice(self.grid.dp_rank * self.grid.pp, (self.grid.dp_rank + 1) * self.grid.pp)
        x, y = np.concatenate(x[replica]), np.concatenate(y[replica])
        self.stage.zero_grad()
        loss = self.pipe.step(x if self.first else None, y if self.last else None, broadcast_loss=True)
        if self.opt is not None:
            self.opt.step()
        self.idle_s += self.pipe.stats.idle_s
        return loss

    def predict(self, x):
        """Run the stages one after another (no micro-batching) and give every rank the logits."""
        pp_comm = self.grid.pp_comm
        with nn.no_grad():
            h = x if self.first else mpidist.recv(self.grid.pp_rank - 1, pp_comm)
            h = as_array(self.stage(h))
            if not self.last:
                mpidist.send(h, self.grid.pp_rank + 1, pp_comm)
        logits = h if self.last else np.empty((len(x), N_CLASSES))
        return mpidist.broadcast(logits, pp_comm, root=self.grid.pp - 1)

    def epoch_loss(self, losses):
        return float(np.mean(losses))  # step() returns the loss of the whole global batch already

    def comm_seconds(self):
        return self.idle_s

    def full_state(self):
        """Gather every stage's parameters to world rank 0 under the unsplit model's names."""
        first = self.bounds[self.grid.pp_rank]
        mine = {}
        if self.grid.dp_rank == 0:
            for key, value in self.stage.state_dict().items():
                index, rest = key.split(".", 1)
                mine[f"{first + int(index)}.{rest}"] = value
        parts = self.comm.gather(mine, root=0)
        return {k: v for part in parts for k, v in part.items()} if self.comm.Get_rank() == 0 else {}


STRATEGIES = {"ddp": DDPTrainer, "fsdp": FSDPTrainer, "pipeline": PipelineTrainer}


def replayed_steps(segments, n_samples, seed, epochs):
    """Yield the global batch (all ranks' indices) of every step the runs in ``segments`` took, in order.

    ``segments``: [world size, batch per rank, epoch, position] where each run (the first, and each
    resumed one) started; a run went on until where the next one started, the last one to the end.
    """
    ends = [(epoch, position) for _, _, epoch, position in segments[1:]] + [(epochs, 0)]
    for (size, batch, epoch, position), end in zip(segments, ends):
        while (epoch, position) < end:
            order = epoch_order(n_samples, seed, epoch, size)
            for after, batches in global_batches(order, batch, size, start=position):
                yield np.concatenate(batches)
                if (epoch, after) >= end:
                    break
            epoch, position = epoch + 1, 0


def train_reference(args, x_train, y_train, segments):
    """Train the unsplit model in this process on the global batches the distributed runs took; return its state."""
    model = nn.Sequential(*build_layers(args.seed))
    opt = optim.Adam(model.parameters(), lr=args.lr)
    crit = nn.CrossEntropyLoss()
    for idx in replayed_steps(segments, len(x_train), args.seed, args.epochs):
        opt.zero_grad()
        crit(model(x_train[idx]), y_train[idx]).backward()
        opt.step()
    return model.state_dict()


class _LayoutOnly:
    """Stands in for a communicator where only its size matters (the sampler's global order)."""

    def __init__(self, size):
        self.size = size

    def Get_size(self):
        return self.size

    def Get_rank(self):
        return 0


def wait_quietly(comm):
    """Wait for every rank without busy-polling (MPI spins in blocking waits, stealing rank 0's CPU)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.005)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="ddp", choices=sorted(STRATEGIES))
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dp", type=int, default=1, help="pipeline: data-parallel replicas (dp x pp mesh)")
    parser.add_argument("--microbatches", type=int, default=4, help="pipeline: micro-batches per step")
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "zb_h1"], help="pipeline schedule")
    parser.add_argument("--fsdp-strategy", default="full_shard", choices=["full_shard", "shard_grad_op", "no_shard"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="directory to write result.json into")
    parser.add_argument("--metrics", default=None, help="directory for per-step metrics (mpidist.metrics.Logger: "
                        "metrics.jsonl and .csv, TensorBoard with tensorboardX, a tqdm bar on a terminal)")
    parser.add_argument("--no-check", action="store_true", help="skip the single-process comparison")
    parser.add_argument("--ckpt", default=None, help="checkpoint directory: save after every epoch, resume from the "
                        "newest checkpoint (also at another world size or strategy), and on SIGTERM/SIGUSR1/Ctrl-C save and exit "
                        "with status 99 (requeue me; a second Ctrl-C aborts at once)")
    parser.add_argument("--epoch-seconds", type=float, default=0.0, help="make each epoch last at least this long "
                        "(sleeping): the demo trains in well under a second, too fast to preempt by hand")
    args = parser.parse_args(argv)

    comm, info = mpidist.init()
    size, rank = comm.Get_size(), comm.Get_rank()
    log = print if rank == 0 else (lambda *a, **k: None)
    x_train, y_train, x_test, y_test = load_digits(args.seed)
    log(f"digits: {len(x_train)} train / {len(x_test)} test images, strategy {args.strategy}, {info}")

    trainer = STRATEGIES[args.strategy](comm, args)
    # What a resumed run needs: weights, optimizer moments, where in which epoch it stopped (``position``:
    # samples of the epoch's order done), and for the reference, the segments the runs so far took.
    state = {"model": trainer.model, "epoch": 0, "position": 0, "global_step": 0, "segments": []}
    if trainer.opt is not None:
        state["optim"] = trainer.opt
    preemption = None
    if args.ckpt:
        try:  # a read-only or mistyped --ckpt fails now, not after the first epoch (on every rank alike)
            checkpoint.check_writable(args.ckpt, comm)
        except checkpoint.CheckpointError as exc:
            log(f"digits demo: {str(exc).splitlines()[0]}", flush=True)
            return 2
        resumed = checkpoint.load(args.ckpt, state, comm)  # says "starting from scratch" if there is none
        if resumed is not None:
            was = state["segments"][-1][0] if state["segments"] else "?"
            where = (f"epoch {state['epoch'] + 1}, sample {state['position']}" if state["position"]
                     else f"after epoch {state['epoch']}")
            log(f"resumed from checkpoint step {resumed} ({where}; saved on {was} ranks, now {size})")
        preemption = Preemption(comm).install()
    state["segments"] = state["segments"] + [[size, args.batch, state["epoch"], state["position"]]]
    logger = None
    if args.metrics:
        from mpidist.metrics import Logger
        n_params = sum(p.data.size for layer in build_layers(args.seed) for p in layer.parameters())
        memory = trainer.model if hasattr(trainer.model, "memory_stats") else None
        steps_per_epoch = -(-len(epoch_order(len(x_train), args.seed, 0, size)) // (args.batch * size))
        # 6 flop per parameter and sample: 2 forward, 4 backward (float64: no MFU, no float32 peak applies)
        logger = Logger(comm, args.metrics, flops_per_sample=6 * n_params, memory=memory,
                        total_steps=steps_per_epoch * (args.epochs - state["epoch"]))
    start = time.perf_counter()
    acc = None
    for epoch in range(state["epoch"], args.epochs):
        order = epoch_order(len(x_train), args.seed, epoch, size)  # the DistributedSampler's, at this size
        t0, comm0, losses, seen = time.perf_counter(), trainer.comm_seconds() or 0.0, [], 0
        position = state["position"] if epoch == state["epoch"] else 0  # done before the run was stopped
        for position, batches in global_batches(order, args.batch, size, start=position):
            mine = batches[rank]
            losses.append(trainer.step(x_train[mine], y_train[mine]))
            seen += sum(len(b) for b in batches)
            state["global_step"] += 1
            if logger is not None:
                logger.log(state["global_step"], losses[-1], samples=len(mine), epoch=epoch + 1)
            if preemption is not None and preemption.should_stop():
                state.update(epoch=epoch, position=position)
                checkpoint.save(args.ckpt, state, comm, step=state["global_step"])
                log(f"preempted ({preemption.received or 'signal on another rank'}): saved checkpoint step "
                    f"{state['global_step']} (epoch {epoch + 1}, sample {position}); exiting 99", flush=True)
                preemption.exit()
        elapsed = time.perf_counter() - t0
        comm_now = trainer.comm_seconds()  # before the evaluation, whose FSDP gathers are not training
        if args.epoch_seconds > elapsed:
            time.sleep(args.epoch_seconds - elapsed)
        acc = accuracy(trainer.predict, x_test, y_test)
        comm_share = "n/a" if comm_now is None else f"{(comm_now - comm0) / elapsed:.0%}"
        epoch_loss = trainer.epoch_loss(losses) if losses else float("nan")
        log(f"epoch {epoch + 1}/{args.epochs}  loss {epoch_loss:.4f}  test acc {acc:.2%}  "
            f"{seen / elapsed:8.0f} samples/s  comm {comm_share}", flush=True)
        state.update(epoch=epoch + 1, position=0)
        if args.ckpt:
            checkpoint.save(args.ckpt, state, comm, step=state["global_step"])
    train_seconds = time.perf_counter() - start
    if logger is not None:
        logger.close()
    if acc is None:  # resumed from a checkpoint of the last epoch: nothing left to train
        acc = accuracy(trainer.predict, x_test, y_test)

    result = {"strategy": args.strategy, "ranks": size, "epochs": args.epochs, "test_accuracy": acc,
              "train_seconds": train_seconds, "segments": state["segments"]}
    segments = state["segments"]
    state = trainer.full_state()
    if rank == 0 and not args.no_check:
        reference = train_reference(args, x_train, y_train, segments)
        diff = max(float(np.max(np.abs(state[k] - reference[k]))) for k in reference)
        result["max_abs_diff_vs_single_process"] = diff
        ok = diff < 1e-8
        log(f"check: max |w_distributed - w_single_process| = {diff:.2e} over {len(reference)} tensors "
            f"-> {'OK' if ok else 'MISMATCH'}")
        result["check_ok"] = ok
    log(f"trained in {train_seconds:.1f} s on {size} ranks: test accuracy {acc:.2%}")
    if rank == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f, indent=2)
    failed = rank == 0 and (not result.get("check_ok", True) or acc < 0.95)
    if rank == 0 and acc < 0.95:
        log(f"digits demo: test accuracy {acc:.2%} is below the 95% this demo promises: FAILED (exit 1)")
    wait_quietly(comm)
    failed = comm.bcast(failed, root=0)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
