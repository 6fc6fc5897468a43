"""A virtual cluster on one Linux machine: K nodes made of network namespaces, joined by rate-shaped links.

Each node is a network namespace with its own address, host name (a UTS namespace, entered per command) and
private ``/dev/shm`` (a mount namespace), so MPI sees K hosts: ``Split_type(COMM_TYPE_SHARED)`` gives one group
per node and messages between nodes go over TCP through the node's link. A head namespace holds the switch
(a bridge) and an address of its own, where ``mpiexec`` or ``slurmctld`` run as on a login node. Nothing is
added to the machine's own network namespace: every address, route and link lives in namespaces this module
created, and names resolve through per-namespace host files (``/etc/netns/NAME/hosts``, which
``ip netns exec`` mounts over ``/etc/hosts`` inside the namespace only).

Python::

    with VirtualCluster(nodes=2, rate="1gbit") as cluster:
        subprocess.run(cluster.mpiexec(["python", "-m", "mpidist", "info"], ppn=2), check=True)

Shell (as root; the command runs on the head node, with ``VCLUSTER_HOSTS``, ``VCLUSTER_RSH`` and
``VCLUSTER_MPIEXEC_FLAGS`` in its environment)::

    python tests/cluster/vcluster.py --nodes 2 --rate 1gbit -- \
        sh -c '.venv/bin/mpiexec $VCLUSTER_MPIEXEC_FLAGS -ppn 2 .venv/bin/python -m mpidist info'
    python tests/cluster/vcluster.py --reap      # remove clusters whose owning process died (kill -9)

Teardown removes exactly what ``up`` created (processes left in its namespaces, by PID; the namespaces with
their links and bridge; the host files; its work directory), also after an exception, Ctrl-C or SIGTERM. Every
cluster records what it made in ``/run/mpd-vcluster/NAME.json`` first, so ``--reap`` can finish the job for a
cluster whose owner was killed outright. Needs root (``CAP_NET_ADMIN`` and ``CAP_SYS_ADMIN``), ``ip``, ``tc``
and ``unshare``; :func:`unavailable` says in one line why not.
"""

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

PREFIX = "mpd-"           # every namespace, state file and work directory of a virtual cluster starts with it
STATE_DIR = "/run/mpd-vcluster"
NETNS_ETC = "/etc/netns"
SUBNET = "10.213.7"       # only ever assigned inside this cluster's namespaces, so it cannot meet the host's
HEAD_ADDRESS = f"{SUBNET}.1"
NODE_IFACE = "eth0"       # the node's end of its link, inside the node's namespace, and the head's bridge
SHM_SIZE = "2g"


def unavailable():
    """Return why a virtual cluster cannot be made here (one line), or None when it can."""
    if os.geteuid() != 0:
        return "virtual cluster: needs root (network and mount namespaces); skipped"
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"virtual cluster: {', '.join(missing)} not found; skipped"
    probe = f"{PREFIX}probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"virtual cluster: cannot create a network namespace (no CAP_NET_ADMIN?): {made.stderr.strip()}; skipped"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args, ns=None, check=True):
    argv = ["ip"] + (["-n", ns] if ns else []) + list(args)
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode:
        raise RuntimeError(f"virtual cluster: `{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class VirtualCluster:
    """K nodes in network namespaces behind one switch; a context manager that always tears down."""

    def __init__(self, nodes=2, rate="1gbit", name=None, shm=True):
        if not isinstance(nodes, int) or isinstance(nodes, bool) or not 1 <= nodes <= 240:
            raise ValueError(f"VirtualCluster: nodes must be an int in 1..240 (got {nodes!r})")  # one /24
        self.nodes = nodes
        self.rate = rate  # tc's syntax (1gbit, 800mbit, ...); None: unshaped
        self.shm = shm    # a private /dev/shm per node (MPI's shared memory then cannot cross nodes)
        self.name = name or f"{PREFIX}{os.getpid()}-{int(time.time() * 1000) % 100000}"
        if not self.name.startswith(PREFIX):
            raise ValueError(f"VirtualCluster: name must start with {PREFIX!r} (got {self.name!r})")
        self.hosts = [f"node{k}" for k in range(1, nodes + 1)]
        self.head = "head"
        self.addresses = {self.head: HEAD_ADDRESS, **{h: f"{SUBNET}.{10 + k}" for k, h in enumerate(self.hosts, 1)}}
        self.workdir = None
        self.rsh = None       # the ssh stand-in: `rsh [options] HOST COMMAND...` runs COMMAND on node HOST
        self._namespaces = []
        self._etc_dirs = []
        self._procs = []
        self._state_file = os.path.join(STATE_DIR, f"{self.name}.json")

    # -- names -----------------------------------------------------------------------------------------------
    def namespace(self, host):
        """Return the network namespace of ``host`` (a node name or ``head``)."""
        if host != self.head and host not in self.hosts:
            raise ValueError(f"VirtualCluster: no host {host!r} (hosts: {[self.head] + self.hosts})")
        return f"{self.name}-{host}"

    # -- bring up and tear down ------------------------------------------------------------------------------
    def up(self):
        """Create the namespaces, links, addresses, host files and the ssh stand-in; tear down on any failure."""
        why = unavailable()
        if why:
            raise RuntimeError(why)
        os.makedirs(STATE_DIR, exist_ok=True)
        self.workdir = tempfile.mkdtemp(prefix=f"{self.name}-")
        self._save_state()
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self):
        head_ns = self.namespace(self.head)
        self._add_namespace(head_ns)
        _ip("link", "add", NODE_IFACE, "type", "bridge", ns=head_ns)
        _ip("addr", "add", f"{HEAD_ADDRESS}/24", "dev", NODE_IFACE, ns=head_ns)
        _ip("link", "set", "lo", "up", ns=head_ns)
        _ip("link", "set", NODE_IFACE, "up", ns=head_ns)
        for k, host in enumerate(self.hosts, 1):
            ns = self.namespace(host)
            self._add_namespace(ns)
            _ip("link", "add", f"to{host}", "netns", head_ns, "type", "veth", "peer", "name", NODE_IFACE,
                "netns", ns)
            _ip("link", "set", f"to{host}", "master", NODE_IFACE, "up", ns=head_ns)
            _ip("addr", "add", f"{self.addresses[host]}/24", "dev", NODE_IFACE, ns=ns)
            _ip("link", "set", NODE_IFACE, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            if self.rate:
                # Each direction of a node's link is shaped where the packets leave: the node's end for what it
                # sends, the switch's end for what it receives.
                for where, dev in ((ns, NODE_IFACE), (head_ns, f"to{host}")):
                    done = subprocess.run(["ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root",
                                           "tbf", "rate", self.rate, "burst", "256kb", "latency", "50ms"],
                                          capture_output=True, text=True)
                    if done.returncode:
                        raise RuntimeError(f"virtual cluster: tc tbf rate {self.rate} on {dev} failed: "
                                           f"{done.stderr.strip()}")
        lines = "127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for h, a in self.addresses.items())
        for host in [self.head] + self.hosts:
            etc = os.path.join(NETNS_ETC, self.namespace(host))
            self._etc_dirs.append(etc)
            self._save_state()  # recorded before it exists, as the namespaces are
            os.makedirs(etc, exist_ok=True)
            with open(os.path.join(etc, "hosts"), "w") as f:
                f.write(lines)
        for host in [self.head] + self.hosts:
            with open(os.path.join(self.workdir, f"boot_id-{host}"), "w") as f:
                f.write(f"{uuid.uuid4()}\n")
        self.rsh = os.path.join(self.workdir, "rsh")
        with open(self.rsh, "w") as f:
            f.write(self._rsh_script())
        os.chmod(self.rsh, 0o755)

    def _rsh_script(self):
        # What hydra (-launcher ssh -launcher-exec) and Open MPI (plm_rsh_agent) call instead of ssh: drop ssh's
        # options, then run the command line on the named node, through a shell as sshd would.
        tail = self._enter_tail('"$host"')
        return ("#!/bin/sh\n"
                "while [ $# -gt 0 ]; do case \"$1\" in\n"
                "  -o|-p|-l|-i|-F) shift 2;;\n"
                "  -*) shift;;\n"
                "  *) break;;\n"
                "esac; done\n"
                "host=$1; shift\n"
                f"case \"$host\" in {'|'.join(self.hosts + [self.head])}) ;; *) echo \"vcluster rsh: no node $host\" >&2;"
                " exit 255;; esac\n"
                f"exec ip netns exec \"{self.name}-$host\" {tail} \"$*\"\n")

    def _enter_prefix(self, host):
        return ["ip", "netns", "exec", self.namespace(host)]

    def _node_setup(self):
        """Shell commands that make a node of a fresh UTS + mount namespace (the host name is ``$0``).

        Its own host name; its own ``/dev/shm``; its own boot id, which UCX (MPICH's transport) reads to decide
        whether a peer is on the same machine: with one boot id it would move "inter-node" messages through
        shared memory or cross-memory attach and never touch the link.
        """
        steps = ['hostname "$0"', f'mount --bind {shlex.quote(self.workdir)}/boot_id-"$0" /proc/sys/kernel/random/boot_id']
        if self.shm:
            steps.append(f"mount -t tmpfs -o size={SHM_SIZE} mpd-shm /dev/shm")
        return " && ".join(steps)

    def _enter_tail(self, host_word):
        """The shell words after ``ip netns exec NS``: new UTS, IPC and mount namespaces set up as the node."""
        inner = f'{self._node_setup()} && exec sh -c "$1"'
        return f"unshare --uts --ipc --mount sh -c {shlex.quote(inner)} {host_word}"

    def node_argv(self, host, argv):
        """Return the argv that runs ``argv`` on ``host`` (its namespace, host name, boot id and ``/dev/shm``)."""
        self.namespace(host)
        inner = f'{self._node_setup()} && exec "$@"'
        return self._enter_prefix(host) + ["unshare", "--uts", "--ipc", "--mount", "sh", "-c", inner, host] + list(argv)

    def _add_namespace(self, ns):
        self._namespaces.append(ns)
        self._save_state()  # recorded before it exists, so a kill -9 between the two still gets it reaped
        _ip("netns", "add", ns)

    def _save_state(self):
        with open(self._state_file, "w") as f:
            json.dump({"owner": os.getpid(), "namespaces": self._namespaces, "etc": self._etc_dirs,
                       "workdir": self.workdir, "pids": [p.pid for p in self._procs]}, f)

    def down(self):
        """Remove everything ``up`` made; safe to call twice and after a partial ``up``."""
        for proc in self._procs:
            _stop_group(proc.pid)
        self._procs.clear()
        _remove(self._namespaces, self._etc_dirs, self.workdir)
        if os.path.exists(self._state_file):
            os.remove(self._state_file)

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()

    def leftovers(self):
        """Return what of this cluster still exists (namespaces, host files, work dir, processes): [] after down."""
        etc = [os.path.join(NETNS_ETC, self.namespace(h)) for h in [self.head] + self.hosts]
        return _leftovers(self.name, sorted(set(self._etc_dirs + etc)), self.workdir)

    # -- running things --------------------------------------------------------------------------------------
    def run(self, host, argv, **kwargs):
        """``subprocess.run(argv)`` on ``host``."""
        return subprocess.run(self.node_argv(host, argv), **kwargs)

    def popen(self, host, argv, **kwargs):
        """Start ``argv`` on ``host`` in a process group of its own, stopped (by PID) at teardown."""
        proc = subprocess.Popen(self.node_argv(host, argv), start_new_session=True, **kwargs)
        self._procs.append(proc)
        self._save_state()
        return proc

    def hostlist(self, ppn, placement="block"):
        """Return hydra's ``-hosts`` value: ``ppn`` ranks per node, in node blocks or round-robin (cyclic)."""
        if placement == "block":
            return ",".join(f"{h}:{ppn}" for h in self.hosts)
        if placement == "cyclic":
            return ",".join(self.hosts)  # hydra gives one rank per host in turn when no counts are named
        raise ValueError(f"VirtualCluster: placement must be 'block' or 'cyclic' (got {placement!r})")

    def mpiexec_flags(self, ppn=None, placement="block", mpi="mpich"):
        """Return the launcher flags that start ranks on the nodes through the ssh stand-in.

        With ``ppn`` they name the hosts too (``ppn`` ranks on each); without, add your own host list.
        """
        if mpi == "mpich":
            flags = ["-launcher", "ssh", "-launcher-exec", self.rsh, "-iface", NODE_IFACE]
            return flags + (["-hosts", self.hostlist(ppn, placement)] if ppn else [])
        if mpi == "openmpi":
            slots = ",".join(f"{h}:{ppn or 1}" for h in self.hosts)
            flags = ["--mca", "plm_rsh_agent", self.rsh, "--host", slots, "--mca", "btl_tcp_if_include", NODE_IFACE,
                     "--mca", "oob_tcp_if_include", NODE_IFACE]
            if placement != "block":
                raise ValueError(f"VirtualCluster: Open MPI launches here place ranks in node blocks only "
                                 f"(got placement={placement!r})")
            return flags + (["--map-by", f"ppr:{ppn}:node"] if ppn else [])
        raise ValueError(f"VirtualCluster: mpi must be 'mpich' or 'openmpi' (got {mpi!r})")

    def mpiexec(self, argv, ppn, placement="block", mpiexec=None, mpi="mpich", extra=()):
        """Return the argv that runs ``argv`` on ``ppn`` ranks per node, with mpiexec started on the head node."""
        mpiexec = mpiexec or os.path.join(os.path.dirname(sys.executable), "mpiexec")
        n = ppn * self.nodes
        return self.node_argv(self.head, [mpiexec] + self.mpiexec_flags(ppn, placement, mpi) + list(extra)
                              + ["-n", str(n)] + list(argv))

    def link(self, host, up):
        """Bring ``host``'s link to the switch up or down (the node stays, unreachable)."""
        _ip("link", "set", f"to{host}", "up" if up else "down", ns=self.namespace(self.head))

    def link_bytes(self, host):
        """Return the bytes ``host`` has sent over its link (its end's tx counter)."""
        done = subprocess.run(["ip", "netns", "exec", self.namespace(host), "cat",
                               f"/sys/class/net/{NODE_IFACE}/statistics/tx_bytes"], capture_output=True, text=True)
        return int(done.stdout.strip() or 0)


def _stop_group(pid):
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        for _ in range(20):
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    return
            except ChildProcessError:
                if not _alive(pid):
                    return
            time.sleep(0.05)


def _pids_in(ns):
    done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split() if p.isdigit() and int(p) != os.getpid()]


def _remove(namespaces, etc_dirs, workdir):
    present = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    for ns in namespaces:
        if ns not in present:
            continue
        for _ in range(3):  # processes left in the namespace (ranks, daemons), by PID; SIGKILL: they are ours
            pids = _pids_in(ns)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
    for ns in reversed(namespaces):  # nodes first (their links go with them), the head and its bridge last
        if ns in present:
            _ip("netns", "del", ns, check=False)
    for etc in etc_dirs:
        shutil.rmtree(etc, ignore_errors=True)
    if workdir:
        shutil.rmtree(workdir, ignore_errors=True)


def _leftovers(name, etc_dirs, workdir):
    left = [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
            if ns.startswith(f"{name}-")]
    left += [etc for etc in etc_dirs if os.path.exists(etc)]
    if workdir and os.path.exists(workdir):
        left.append(workdir)
    if os.path.exists(os.path.join(STATE_DIR, f"{name}.json")):
        left.append(os.path.join(STATE_DIR, f"{name}.json"))
    return left


def reap():
    """Tear down every recorded cluster whose owning process is gone; return their names."""
    reaped = []
    if not os.path.isdir(STATE_DIR):
        return reaped
    for entry in sorted(os.listdir(STATE_DIR)):
        path = os.path.join(STATE_DIR, entry)
        try:
            with open(path) as f:
                state = json.load(f)
        except (OSError, ValueError):
            continue
        if _alive(state["owner"]):
            continue
        for pid in state.get("pids", []):
            if _alive(pid):
                _stop_group(pid)
        _remove(state["namespaces"], state["etc"], state.get("workdir"))
        os.remove(path)
        reaped.append(entry[:-len(".json")])
    return reaped


def _raise_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--rate", default="1gbit", help="tc rate of every node's link (1gbit, 800mbit; 0: unshaped)")
    parser.add_argument("--reap", action="store_true", help="remove clusters whose owner died, then exit")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND run on the head node")
    args = parser.parse_args(argv)
    why = unavailable()
    if why:
        print(why, flush=True)
        return 0
    if args.reap:
        print(f"vcluster: reaped {reap() or 'nothing'}", flush=True)
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    # A job started in the background of a non-interactive shell (as CI ran it) inherits SIGINT ignored, and
    # Python then installs no handler of its own (seen: SigIgn had SIGINT, the harness outlived a Ctrl-C by 60 s).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with VirtualCluster(args.nodes, None if args.rate in ("0", "none") else args.rate) as cluster:
        env = dict(os.environ, VCLUSTER_HOSTS=",".join(cluster.hosts), VCLUSTER_RSH=cluster.rsh,
                   VCLUSTER_NAME=cluster.name,
                   VCLUSTER_MPIEXEC_FLAGS=" ".join(cluster.mpiexec_flags()))
        print(f"vcluster: {cluster.name} up: {', '.join(f'{h} {a}' for h, a in cluster.addresses.items())}; "
              f"rate {cluster.rate or 'unshaped'}", flush=True)
        if not command:
            return 0
        proc = subprocess.Popen(cluster.node_argv(cluster.head, command), env=env, start_new_session=True)
        try:
            return proc.wait()
        finally:
            if proc.poll() is None:
                _stop_group(proc.pid)


if __name__ == "__main__":
    sys.exit(main())
