"""A resumable training job: checkpoints every few steps, resumes from the newest, stops cleanly on preemption.

Run:  mpiexec -n 4 python examples/resumable.py --strategy ddp --steps 10 --every 2 --ckpt /tmp/ckpt --out /tmp/final

Run it again with the same --ckpt and it continues from the newest checkpoint; the final parameters
are bit-identical to a run that was never interrupted. On SIGTERM/SIGUSR1 (Slurm's preemption
warning) or Ctrl-C every rank stops after the same step, saves, and exits with status 99 (PREEMPTED_EXIT);
a second Ctrl-C aborts at once.
``--kill-rank R --kill-step S`` sends SIGKILL to rank R in the middle of step S (for fault tests).
"""

import argparse
import os
import signal
import sys
import time

import numpy as np

import mpidist
from mpidist import checkpoint, nn, optim
from mpidist.preemption import Preemption

IN, HIDDEN, OUT, BATCH = 8, 16, 4, 24


def layers(seed=0):
    rng = np.random.default_rng(seed)
    return [nn.Linear(IN, HIDDEN, rng=rng, dtype=np.float64), nn.Tanh(),
            nn.Linear(HIDDEN, HIDDEN, rng=rng, dtype=np.float64), nn.Tanh(),
            nn.Linear(HIDDEN, HIDDEN, rng=rng, dtype=np.float64), nn.Tanh(),
            nn.Linear(HIDDEN, OUT, rng=rng, dtype=np.float64)]


def global_batch(step):
    rng = np.random.default_rng([1234, step])
    return rng.standard_normal((BATCH, IN)), rng.integers(0, OUT, size=BATCH)


class DataParallelJob:
    """DDP or FSDP: every rank takes its slice of the global batch."""

    def __init__(self, comm, strategy):
        self.comm = comm
        module = nn.Sequential(*layers())
        self.model = mpidist.DDP(module, comm) if strategy == "ddp" else mpidist.FSDP(module, comm)
        self.opt = optim.Adam(self.model.parameters(), lr=0.01)
        self.crit = nn.CrossEntropyLoss()
        self.strategy = strategy

    def step(self, step, noise_rng, fault):
        x, y = global_batch(step)
        size, rank = self.comm.Get_size(), self.comm.Get_rank()
        per = BATCH // size
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        x = x + 0.01 * noise_rng.standard_normal(x.shape)  # per-rank randomness that must resume exactly
        self.opt.zero_grad()
        loss = self.crit(self.model(x), y)
        fault()
        loss.backward()
        self.opt.step()

    def final_params(self):
        if self.strategy == "fsdp":
            return self.model.full_state_dict()
        return self.model.state_dict() if self.comm.Get_rank() == 0 else {}


class PipelineJob:
    """Each rank runs a stage of the model (1F1B); rank 0 feeds inputs, the last rank the targets."""

    def __init__(self, comm, strategy):
        from mpidist.parallel.pipeline import Pipeline
        self.comm = comm
        all_layers = layers()
        size, rank = comm.Get_size(), comm.Get_rank()
        bounds = np.linspace(0, len(all_layers), size + 1).astype(int)
        self.stage = nn.Sequential(*all_layers[bounds[rank]:bounds[rank + 1]])
        self.pipe = Pipeline(self.stage, comm, num_microbatches=3, schedule="1f1b", loss_fn=nn.CrossEntropyLoss())
        self.model = self.pipe
        self.opt = optim.Adam(self.stage.parameters(), lr=0.01)

    def step(self, step, noise_rng, fault):
        x, y = global_batch(step)
        x = x + 0.01 * noise_rng.standard_normal(x.shape)
        self.opt.zero_grad()
        fault()
        self.pipe.step(x if self.comm.Get_rank() == 0 else None, y if self.comm.Get_rank() == self.comm.Get_size() - 1 else None)
        self.opt.step()

    def final_params(self):
        parts = self.comm.gather({f"stage{self.comm.Get_rank()}.{k}": v for k, v in self.stage.state_dict().items()}, root=0)
        return {k: v for part in parts for k, v in part.items()} if self.comm.Get_rank() == 0 else {}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=["ddp", "fsdp", "pipeline"], default="ddp")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--every", type=int, default=2, help="checkpoint every N steps")
    parser.add_argument("--ckpt", required=True, help="checkpoint root directory")
    parser.add_argument("--out", required=True, help="directory for final.npz and progress files")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (gives signals time to land)")
    parser.add_argument("--kill-rank", type=int, default=None)
    parser.add_argument("--kill-step", type=int, default=None)
    args = parser.parse_args(argv)

    comm, info = mpidist.init()
    rank = comm.Get_rank()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"pid.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    job = PipelineJob(comm, args.strategy) if args.strategy == "pipeline" else DataParallelJob(comm, args.strategy)
    noise_rng = np.random.default_rng([99, rank])
    state = {"model": job.model, "optim": job.opt, "rng": noise_rng, "step": 0}
    checkpoint.check_writable(args.ckpt, comm)  # a read-only --ckpt fails here, not at the first save
    resumed = checkpoint.load(args.ckpt, state, comm)  # rank 0 says "starting from scratch" if there is none
    if rank == 0 and resumed is not None:
        print(f"resumed from step {resumed}", flush=True)

    with Preemption(comm) as preemption:
        for step in range(state["step"] + 1, args.steps + 1):  # steps are numbered from 1
            def fault():
                if rank == args.kill_rank and step == args.kill_step:
                    os.kill(os.getpid(), signal.SIGKILL)
            job.step(step, noise_rng, fault)
            state["step"] = step
            if rank == 0:
                with open(os.path.join(args.out, "progress"), "w") as f:
                    f.write(str(step))
            time.sleep(args.step_seconds)
            if step % args.every == 0:
                checkpoint.save(args.ckpt, state, comm, step=step)
            if preemption.should_stop():
                if step % args.every:
                    checkpoint.save(args.ckpt, state, comm, step=step)
                print(f"rank {rank}: preempted ({preemption.received or 'signal on another rank'}), saved step {step}", flush=True)
                preemption.exit()

    final = job.final_params()
    if rank == 0:
        np.savez(os.path.join(args.out, "final.npz"), **final)
        print(f"finished {args.steps} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
