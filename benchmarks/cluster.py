"""Collectives and DDP across the nodes of a virtual cluster with rate-shaped links (tests/cluster/vcluster.py).

Run (root; brings the cluster up and always tears it down):
    .venv/bin/python benchmarks/cluster.py [--rate 1gbit] [--json PATH] [--steps N] [--max-size 64M] [--parts ...]
    .venv/bin/python benchmarks/cluster.py --parts link [--link-rates 1gbit 200mbit none]   # the link probe

Measures, with MPICH's mpiexec starting the ranks in the namespace nodes:
- allreduce (mpidist's flat ``allreduce``, raw mpi4py ``Allreduce`` and the hierarchical one of
  ``mpidist.collectives_hier``, float32) from 8 B to 64 MiB at 2 nodes x 2 ranks: time per call (slowest
  rank, median of repetitions), algbw = size / time, busbw = algbw x 2(n-1)/n, and algbw against the
  link-bound limit: between 2 nodes an allreduce must move at least the whole buffer out of each node (half
  of it reduce-scattered, half all-gathered), so algbw <= the link's byte rate; and which of flat and
  hierarchical ``HierarchicalAllreduce(algorithm="auto")`` chose at each size;
- ``--parts link``: MPI ``Sendrecv`` between one rank on each of 2 nodes, both directions at once, in 1 MiB and
  8 MiB messages, at each of ``--link-rates`` (a cluster per rate; ``none``: unshaped): bytes per second each way
  against the rate, and the CPU it costs: where the link, not the CPU, bounds a transfer;
- allreduce also with one chunk (``chunk_bytes`` larger than the array: the three steps one after another);
- DDP step time (``DDP_MODELS``: benchmarks/ddp_step.py's MLP 784-1024-1024-10, batch 64 per rank, and a deeper
  MLP of 4 MiB layers with a bucket each, batch 1024 per rank; float32) on 1 node x 2 ranks against 2 nodes x 1
  rank (the same compute, gradients crossing the link) and 2 nodes x 2 ranks, with overlap on, off, and on with
  ``progress_poll_s=0.002``; the share of the inter-node synchronization that overlap hides behind backward;
- ``--parts layouts`` (2 nodes x 2 ranks): on the same MLP, DDP with its buckets summed flat or hierarchically
  (``DDP(allreduce=)``), FSDP (full_shard over all 4 ranks) and hybrid FSDP (hybrid_shard: shards within a
  node, replicas across nodes); and ``GPT(GPTConfig())`` (width 256, 4 layers, context 128, float32, AdamW,
  global batch 8 sequences) at (dp, tp, pp) = (2, 2, 1) with the tp pairs inside nodes (``mesh``) and across
  them (ranks {0, 2} and {1, 3}: block placement puts ranks 0, 1 on the first node), (1, 4, 1) (tp spans both
  nodes), (4, 1, 1) (DDP only), and pipelines (1F1B, 4 micro-batches): (2, 1, 2) with the stage pairs inside
  nodes (``mesh``) and across them, and (1, 1, 4); ``--gpt-batch`` sets the global batch, ``--only`` a subset. Medians of the slowest rank's step, interleaved in blocks
  (benchmarks/train_step.py's ``time_steps``).
``--worker`` is the part that runs inside the job.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SIZES = [8, 1 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def rate_bytes(rate):
    """Return tc's rate (``1gbit``, ``800mbit``, ``100mbit``) in bytes per second."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * factor / 8
    raise ValueError(f"cluster benchmark: cannot read the rate {rate!r} (use e.g. 1gbit, 800mbit)")


# -- inside the job --------------------------------------------------------------------------------------------
def allreduce_sweep(comm, max_size, budget_s=0.6):
    import numpy as np
    from mpi4py import MPI
    import mpidist
    from mpidist.collectives_hier import HierarchicalAllreduce

    rows = []
    hierarchical, auto = HierarchicalAllreduce(comm, "hierarchical"), HierarchicalAllreduce(comm, "auto")
    whole = HierarchicalAllreduce(comm, "hierarchical", chunk_bytes=1 << 40)  # one chunk: the steps in sequence
    for size in [s for s in SIZES if s <= max_size]:
        x = np.ones(max(size // 4, 1), dtype=np.float32)
        calls = {"mpidist": lambda: mpidist.allreduce(x, comm),  # in place, as DDP's buckets
                 "raw": lambda: comm.Allreduce(MPI.IN_PLACE, x),
                 "hier": lambda: hierarchical(x),
                 "hier_unpipelined": lambda: whole(x)}
        row = {"bytes": size, "auto_choice": auto.algorithm_for(x.nbytes, x)}
        for name, call in calls.items():
            comm.Barrier()
            start = time.perf_counter()
            call()  # warm-up, and the estimate of how many calls fit the budget
            once = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
            reps = comm.bcast(max(3, min(200, int(budget_s / max(once, 1e-6)))), root=0)
            times = []
            for _ in range(reps):
                comm.Barrier()
                start = time.perf_counter()
                call()
                times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
            row[f"{name}_us"] = float(np.median(times)) * 1e6
        rows.append(row)
    for instance in (hierarchical, auto, whole):
        instance.free()
    return rows


def _cpu_ticks():
    """Return (busy, total) clock ticks of the whole machine so far (/proc/stat's first line)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return sum(ticks) - idle, sum(ticks)


def link_probe(comm, seconds=2.0, sizes=(1 << 20, 8 << 20)):
    """Bytes per second each way between two ranks on two nodes (both directions at once), and the CPU it costs.

    For each message size, rank 0 and rank 1 exchange messages with ``Sendrecv`` for about ``seconds``: the raw
    MPI-over-TCP throughput of the link. CPU: the machine's busy share over the probe (/proc/stat: all cores,
    the TCP stack included) and the two ranks' own CPU seconds per second (user + system; MPICH polls while it
    waits, so up to one core each).
    """
    import numpy as np
    from mpi4py import MPI

    if comm.Get_size() != 2:
        raise SystemExit(f"cluster benchmark: the link probe needs 2 ranks on 2 nodes (got {comm.Get_size()})")
    peer, rows = 1 - comm.Get_rank(), []
    for size in sizes:
        send, recv = np.ones(size, dtype=np.uint8), np.empty(size, dtype=np.uint8)
        comm.Sendrecv(send, peer, recvbuf=recv, source=peer)  # warm-up: connections, registration
        comm.Barrier()
        busy0, total0 = _cpu_ticks()
        cpu0, start, rounds = sum(os.times()[:2]), time.perf_counter(), 0
        while True:
            comm.Sendrecv(send, peer, recvbuf=recv, source=peer)
            rounds += 1
            if comm.bcast(time.perf_counter() - start >= seconds, root=0):
                break
        elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        cpu = comm.allreduce(sum(os.times()[:2]) - cpu0)
        busy1, total1 = _cpu_ticks()
        rows.append({"message_bytes": size, "bytes_each_way_per_s": rounds * size / elapsed, "seconds": elapsed,
                     "machine_busy_share": (busy1 - busy0) / max(total1 - total0, 1), "cores": os.cpu_count(),
                     "ranks_cpu_s_per_s": cpu / elapsed})
    return rows


# DDP models: the DDP step benchmark's MLP (99% of its gradient bytes sit in one 7.4 MB bucket that fills with
# the last gradient of backward: nothing is left to hide it behind), and a deeper one whose 4 MiB layers each
# get a bucket of their own (bucket_cap_mb=4) while the layers below them still compute.
DDP_MODELS = {"mlp": ([784, 1024, 1024, 10], 64, {}),
              "deep": ([1024] * 5 + [10], 1024, {"bucket_cap_mb": 4})}


def ddp_steps(comm, steps, models):
    sys.path.insert(0, HERE)
    from ddp_step import Runner, measure  # the DDP step benchmark's setup and timing: interleaved, slowest rank

    result = {}
    for model in models:
        widths, batch, buckets = DDP_MODELS[model]
        got = measure({m: Runner(m, widths, comm, batch, buckets) for m in ("local", "ddp", "ddp_no_overlap", "ddp_poll")},
                      comm, steps)
        result[model] = {"widths": widths, "batch_per_rank": batch, "ddp_options": buckets,
                         "local_ms": got["local"][0], "ddp_ms": got["ddp"][0], "ddp_sync_ms": got["ddp"][1],
                         "ddp_no_overlap_ms": got["ddp_no_overlap"][0],
                         "ddp_no_overlap_sync_ms": got["ddp_no_overlap"][1],
                         "ddp_poll_ms": got["ddp_poll"][0], "ddp_poll_sync_ms": got["ddp_poll"][1]}
    return result


class _Step:
    """One training setup: ``step()`` runs zero_grad, forward, loss, backward and the update."""

    def __init__(self, model, loss, x, y, lr=1e-3):
        from mpidist.optim import AdamW
        self.model, self.loss, self.x, self.y = model, loss, x, y
        self.opt = AdamW(list(model.parameters()), lr=lr)

    def step(self):
        self.opt.zero_grad()
        self.loss(self.model(self.x), self.y).backward()
        self.opt.step()


class _PipeStep:
    """One pipeline training setup: ``step()`` runs the schedule's forwards and backwards, then the update."""

    def __init__(self, pipe, x, y, lr=3e-4):
        from mpidist.optim import AdamW
        self.pipe, self.x, self.y = pipe, x, y
        params = list(pipe.parameters())
        self.params, self.opt = params, AdamW(params, lr=lr) if params else None

    def step(self):
        for p in self.params:
            p.grad = None
        self.pipe.step(self.x, self.y)
        if self.opt is not None:
            self.opt.step()


def layouts(comm, steps, gpt_batch=8, only=None):
    """Step times (ms) of DDP flat/hierarchical, FSDP/hybrid FSDP (MLP) and GPT (dp, tp, pp) layouts."""
    import numpy as np
    from mpi4py import MPI
    from mpidist import nn
    from mpidist.comm.mesh import mesh
    from mpidist.models.gpt import GPT, GPTConfig
    from mpidist.models.gpt_parallel import tensor_parallel
    from mpidist.parallel.ddp import DDP
    from mpidist.parallel.fsdp import FSDP
    sys.path.insert(0, HERE)
    from ddp_step import mlp
    from train_step import time_steps

    size, rank = comm.Get_size(), comm.Get_rank()
    hosts = comm.allgather(MPI.Get_processor_name())
    if size != 4 or hosts[0] != hosts[1] or hosts[2] != hosts[3] or hosts[0] == hosts[2]:
        raise SystemExit(f"cluster benchmark: layouts need 2 nodes x 2 ranks in block placement (hosts {hosts})")
    wide = [784, 1024, 1024, 10]
    rng = np.random.default_rng(rank)
    x, y = rng.standard_normal((64, wide[0])).astype(np.float32), rng.integers(0, wide[-1], size=64)
    crit = nn.CrossEntropyLoss()
    mlps = {"ddp_flat": _Step(DDP(mlp(wide), comm), crit, x, y),
            "ddp_hierarchical": _Step(DDP(mlp(wide), comm, allreduce="hierarchical"), crit, x, y),
            "fsdp": _Step(FSDP(mlp(wide), comm), crit, x, y),
            "hybrid_fsdp": _Step(FSDP(mlp(wide), comm, strategy="hybrid_shard"), crit, x, y)}
    mlps = {name: t for name, t in mlps.items() if only is None or name in only}
    result = {f"{name}_ms": s * 1e3 for name, s in time_steps(mlps, steps, comm, warmup=2, block=2).items()}
    del mlps

    config = GPTConfig()
    tokens = np.random.default_rng(7).integers(0, config.vocab_size, (gpt_batch, config.block_size + 1))

    def gpt(dp_comm, tp_comm):
        """The GPT, split over ``tp_comm`` and data-parallel over ``dp_comm``, on its dp rank's sequences."""
        model = GPT(config, rng=np.random.default_rng(0))
        if tp_comm.Get_size() > 1:
            model = tensor_parallel(model, tp_comm)
        share = gpt_batch // dp_comm.Get_size()
        mine = slice(dp_comm.Get_rank() * share, (dp_comm.Get_rank() + 1) * share)
        wrapped = DDP(model, dp_comm) if dp_comm.Get_size() > 1 else model
        return _Step(wrapped, model.loss, tokens[mine, :-1].copy(), tokens[mine, 1:].copy(), lr=3e-4)

    inside = mesh(comm, dp=2, tp=2)
    across_tp, across_dp = comm.Split(rank % 2, rank), comm.Split(rank // 2, rank)  # tp pairs {0, 2}, {1, 3}
    tp_hosts = across_tp.allgather(MPI.Get_processor_name())
    assert tp_hosts[0] != tp_hosts[1], tp_hosts
    one = comm.Split(rank, 0)
    gpts = {"gpt_dp2_tp2_pp1_tp_inside": gpt(inside.dp_comm, inside.tp_comm),
            "gpt_dp2_tp2_pp1_tp_across": gpt(across_dp, across_tp),
            "gpt_dp1_tp4_pp1": gpt(one, comm),
            "gpt_dp4_tp1_pp1": gpt(comm, one)}

    def piped(dp_comm, pp_comm, microbatches=4):
        """The GPT cut into one stage per rank of ``pp_comm`` (1F1B), data-parallel over ``dp_comm``."""
        from mpidist.models import lm_loss
        from mpidist.parallel.pipeline import Pipeline

        stage = GPT(config, rng=np.random.default_rng(0)).pipeline_stages(pp_comm.Get_size())[pp_comm.Get_rank()]
        pipe = Pipeline(stage, pp_comm, microbatches, "1f1b", loss_fn=lm_loss,
                        dp_comm=dp_comm if dp_comm.Get_size() > 1 else None, tied_parameters=stage.tied)
        share = gpt_batch // dp_comm.Get_size()
        mine = slice(dp_comm.Get_rank() * share, (dp_comm.Get_rank() + 1) * share)
        return _PipeStep(pipe, tokens[mine, :-1].copy(), tokens[mine, 1:].copy())

    inside_pp = mesh(comm, dp=2, pp=2)
    pp_hosts = inside_pp.pp_comm.allgather(MPI.Get_processor_name())
    assert pp_hosts[0] == pp_hosts[1], pp_hosts  # the pipeline pair on one node, dp across
    gpts.update({"gpt_dp2_tp1_pp2_pp_inside": piped(inside_pp.dp_comm, inside_pp.pp_comm),
                 "gpt_dp2_tp1_pp2_pp_across": piped(across_dp, across_tp),  # pp pairs {0, 2}, {1, 3}
                 "gpt_dp1_tp1_pp4": piped(one, comm)})
    gpts = {name: t for name, t in gpts.items() if only is None or name in only}
    gpt_steps = max(2, steps // 4)
    result.update({f"{name}_ms": s * 1e3 for name, s in time_steps(gpts, gpt_steps, comm, warmup=1, block=1).items()})
    result["gpt_steps"], result["mlp_steps"], result["gpt_batch"] = gpt_steps, steps, gpt_batch
    return result


def worker(args):
    from mpi4py import MPI
    import mpidist

    comm, info = mpidist.init()
    result = {"ranks": comm.Get_size(), "nodes": info.nodes, "ranks_per_node": info.local_size,
              "hosts": sorted(set(comm.allgather(MPI.Get_processor_name())))}
    if "link" in args.parts:
        result["link"] = link_probe(comm)
    if "allreduce" in args.parts:
        result["allreduce"] = allreduce_sweep(comm, args.max_size)
    if "ddp" in args.parts:
        result["ddp"] = ddp_steps(comm, args.steps, args.ddp_models)
    if "layouts" in args.parts:
        result["layouts"] = layouts(comm, args.steps, args.gpt_batch, args.only)
    if comm.Get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


# -- the driver ------------------------------------------------------------------------------------------------
def launch(cluster, ppn, nodes, parts, args, out):
    """Run the worker on ``nodes`` nodes x ``ppn`` ranks; return its JSON."""
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--out", out, "--steps", str(args.steps),
            "--max-size", str(args.max_size), "--parts", *parts, "--ddp-models", *args.ddp_models,
            "--gpt-batch", str(args.gpt_batch)] + (["--only", *args.only] if args.only else [])
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    hosts = ",".join(f"{h}:{ppn}" for h in cluster.hosts[:nodes])
    cmd = cluster.node_argv(cluster.head, [mpiexec] + cluster.mpiexec_flags() + ["-hosts", hosts,
                                                                                    "-n", str(ppn * nodes)] + argv)
    env = dict(os.environ, OMP_NUM_THREADS="1", MPIDIST_COLLECTIVE_TIMEOUT="600")
    env.update(item.split("=", 1) for item in args.mpi_env)
    subprocess.run(cmd, check=True, env=env, timeout=1800, cwd=os.path.dirname(out))  # flight records land there
    with open(out) as f:
        return json.load(f)


def driver(args):
    sys.path.insert(0, os.path.join(REPO, "tests", "cluster"))
    import vcluster

    why = vcluster.unavailable()
    if why:
        print(why)
        return 0
    if "link" in args.parts:
        return link_driver(args, vcluster)
    link = rate_bytes(args.rate)
    with vcluster.VirtualCluster(nodes=2, rate=args.rate) as cluster, tempfile.TemporaryDirectory() as tmp:
        flat = launch(cluster, 2, 2, ["allreduce"], args, os.path.join(tmp, "flat.json")) \
            if "allreduce" in args.parts else {"ranks": 4, "nodes": 2, "allreduce": []}
        ddp = {f"{nodes}x{ppn}": launch(cluster, ppn, nodes, ["ddp"], args, os.path.join(tmp, f"ddp{nodes}{ppn}.json"))
               for nodes, ppn in args.ddp_layouts if "ddp" in args.parts}
        placed = launch(cluster, 2, 2, ["layouts"], args, os.path.join(tmp, "layouts.json")) \
            if "layouts" in args.parts else None
    n = flat["ranks"]
    for row in flat["allreduce"]:
        for name in ("mpidist", "raw", "hier", "hier_unpipelined"):
            if f"{name}_us" not in row:
                continue
            algbw = row["bytes"] / (row[f"{name}_us"] * 1e-6)
            row[f"{name}_algbw_GBps"] = algbw / 1e9
            row[f"{name}_busbw_GBps"] = algbw * 2 * (n - 1) / n / 1e9
            row[f"{name}_of_link_limit"] = algbw / link
    for run in ddp.values():
        for d in run["ddp"].values():
            d["exposed_sync_ms"] = d["ddp_sync_ms"]
            no_overlap = d["ddp_no_overlap_sync_ms"]
            d["hidden_share"] = 1 - d["ddp_sync_ms"] / no_overlap if no_overlap > 0 else None
            d["poll_hidden_share"] = 1 - d["ddp_poll_sync_ms"] / no_overlap if no_overlap > 0 else None
    result = {"rate": args.rate, "link_bytes_per_s": link, "mpi_env": args.mpi_env, "allreduce_2x2": flat, "ddp": ddp,
              "layouts_2x2": placed["layouts"] if placed else None,
              "machine": os.uname().nodename, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"virtual cluster, links shaped to {args.rate} ({link / 1e6:.0f} MB/s each way per node)")
    if flat["allreduce"]:
        print(f"allreduce float32, {flat['ranks']} ranks on {flat['nodes']} nodes")
        print(f"{'size':>10}{'flat us':>12}{'raw us':>12}{'hier us':>12}{'flat of link':>14}{'hier of link':>14}"
              f"{'hier busbw GB/s':>17}{'auto':>14}{'unpipelined of link':>21}")
    for row in flat["allreduce"]:
        print(f"{row['bytes']:>10}{row['mpidist_us']:>12.1f}{row['raw_us']:>12.1f}{row['hier_us']:>12.1f}"
              f"{row['mpidist_of_link_limit']:>14.2f}{row['hier_of_link_limit']:>14.2f}"
              f"{row['hier_busbw_GBps']:>17.3f}{row['auto_choice']:>14}"
              f"{row.get('hier_unpipelined_of_link_limit', float('nan')):>21.2f}")
    if ddp:
        print(f"DDP step (models: {', '.join(f'{m} {DDP_MODELS[m]}' for m in args.ddp_models)})")
        print(f"{'model':>6}{'nodes x ranks':>14}{'local ms':>10}{'DDP ms':>10}{'exposed sync':>14}"
              f"{'no overlap ms':>15}{'its sync':>10}{'hidden':>8}{'polled ms':>11}{'its sync':>10}{'hidden':>8}")
    for layout, run in ddp.items():  # empty with --parts allreduce
        for model, d in run["ddp"].items():
            hidden, polled = ("-" if d[k] is None else f"{d[k]:.2f}" for k in ("hidden_share", "poll_hidden_share"))
            print(f"{model:>6}{layout:>14}{d['local_ms']:>10.1f}{d['ddp_ms']:>10.1f}{d['ddp_sync_ms']:>14.1f}"
                  f"{d['ddp_no_overlap_ms']:>15.1f}{d['ddp_no_overlap_sync_ms']:>10.1f}{hidden:>8}"
                  f"{d['ddp_poll_ms']:>11.1f}{d['ddp_poll_sync_ms']:>10.1f}{polled:>8}")
    if placed:
        print("step times at 2 nodes x 2 ranks (ms, median of the slowest rank)")
        for name, ms in placed["layouts"].items():
            if name.endswith("_ms"):
                print(f"{name[:-3]:>28}{ms:>10.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def link_driver(args, vcluster):
    """Probe the link at each of ``args.link_rates`` (and unshaped): one rank on each of 2 nodes."""
    rows = []
    for rate in args.link_rates:
        shaped = None if rate in ("0", "none") else rate
        with vcluster.VirtualCluster(nodes=2, rate=shaped) as cluster, tempfile.TemporaryDirectory() as tmp:
            got = launch(cluster, 1, 2, ["link"], args, os.path.join(tmp, "link.json"))["link"]
        for row in got:
            row["rate"] = shaped or "unshaped"
            row["of_link"] = row["bytes_each_way_per_s"] / rate_bytes(shaped) if shaped else None
        rows += got
    print("MPI Sendrecv between 2 nodes (1 rank each, both directions at once)")
    print(f"{'rate':>10}{'message':>10}{'MB/s each way':>15}{'of link':>9}{'machine busy':>14}{'ranks CPU s/s':>15}")
    for row in rows:
        share = "-" if row["of_link"] is None else f"{row['of_link']:.2f}"
        print(f"{row['rate']:>10}{row['message_bytes'] >> 20:>8}Mi{row['bytes_each_way_per_s'] / 1e6:>15.1f}"
              f"{share:>9}{row['machine_busy_share']:>14.2f}{row['ranks_cpu_s_per_s']:>15.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"link": rows, "cores": os.cpu_count(), "machine": os.uname().nodename,
                       "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, f, indent=1)
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="1gbit", help="each node's link rate, tc syntax (default 1gbit)")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--steps", type=int, default=20, help="measured DDP steps per mode")
    parser.add_argument("--max-size", type=parse_size, default=64 << 20, help="largest allreduce (default 64M)")
    parser.add_argument("--ddp-models", nargs="*", default=["mlp", "deep"], choices=sorted(DDP_MODELS),
                        help="DDP models to time (default both)")
    parser.add_argument("--ddp-layouts", nargs="*", type=lambda t: tuple(int(v) for v in t.split("x")),
                        default=[(1, 2), (2, 1), (2, 2)], help="nodes x ranks per node for DDP (default 1x2 2x1 2x2)")
    parser.add_argument("--mpi-env", nargs="*", default=[], metavar="NAME=VALUE",
                        help="environment for the ranks, e.g. MPIR_CVAR_ASYNC_PROGRESS=1 (MPICH's progress thread)")
    parser.add_argument("--gpt-batch", type=int, default=8, help="layouts: GPT sequences per step, all ranks (default 8)")
    parser.add_argument("--only", nargs="*", help="layouts: run only these setups (names as printed)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--parts", nargs="*", default=["allreduce", "ddp"],
                        choices=["allreduce", "ddp", "layouts", "link"],
                        help="what to measure (default allreduce and ddp; link: the link probe alone, at --link-rates)")
    parser.add_argument("--link-rates", nargs="*", default=["1gbit", "400mbit", "200mbit", "100mbit", "none"],
                        help="rates the link probe brings the cluster up with (none: unshaped)")
    args = parser.parse_args(argv)
    return worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    sys.exit(main())
