"""Planner vs measurement: per-rank peak memory and step time of dp/fsdp/tp/pp layouts on this machine and on the virtual cluster.

Run from the repo root, one part per call (each under a few minutes, so each fits one quiet window), then merge:

    .venv/bin/python benchmarks/plan_validate.py --vcluster 200mbit --calibrate mpidist/plan/profiles/local-quiet.json \
        mpidist/plan/profiles/vcluster-2x2.json          # the profile's inter tier on the shaped link (needs root)
    .venv/bin/python benchmarks/plan_validate.py --ranks 2 --profile local --json docs/plan_validate_2.json
    .venv/bin/python benchmarks/plan_validate.py --ranks 4 --profile local --json docs/plan_validate_4.json
    (``local``: the shipped calibration of the development machine; on another machine ``python -m mpidist plan
    --calibrate my.json`` first and pass ``--profile my.json``)
    .venv/bin/python benchmarks/plan_validate.py --vcluster 200mbit --profile vcluster-2x2 \
        --json docs/plan_validate_vcluster.json          # 2 nodes x 2 ranks, links shaped (needs root)
    .venv/bin/python benchmarks/plan_validate.py --merge docs/plan_validate_2.json docs/plan_validate_4.json \
        docs/plan_validate_vcluster.json --json docs/plan_validate.json

Peak memory alone (deterministic: ``tracemalloc`` counts bytes, not time; no quiet machine needed), every layout
at 2 and 4 ranks and the virtual cluster's (as 4 ranks of one node) against the planner: ``.venv/bin/python benchmarks/plan_validate.py --memory-only --json
docs/plan_validate_memory.json``.

Each layout is built for real (``mpidist.plan.execute.LayoutRun``: a GPT, the mesh, tensor parallel,
DDP/FSDP/Pipeline, AdamW), all of a part at once, and stepped interleaved: one warm-up step each, then
``--rounds`` rounds in which every layout in turn takes one untimed and ``--steps`` timed steps (the slowest
rank's); a layout's step time is the median of all its timed steps, so the machine's slow minutes fall on every
layout alike. Peak memory per rank: a fresh run of the layout built under ``tracemalloc``, the most it saw alive
during the run's second step (parameters, gradients, optimizer state, activations, gathered parameters, buffers:
each byte once, see ``_peak_bytes``); the largest over ranks is compared with the planner's per-rank total.

Interference: the machine is shared, so each layout's timed steps also record the CPU time the whole machine
spent (``/proc/stat``: user, nice, system, steal) minus the CPU time of this job's ranks: the "foreign" share of
the cores. A layout whose share exceeds ``--max-foreign`` is measured again (up to ``--tries`` times); the
attempt with the least foreign share is kept, and its share is reported with the row.

Prediction: ``mpidist.plan.estimate`` with the profile (``python -m mpidist plan --calibrate`` writes one), and
``ranks_per_node`` = the ranks on one node. Reported: signed errors per layout, their median, Kendall's tau
between predicted and measured step times, and the measured step of the layout the planner ranks first against
the measured best.
"""
import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import tracemalloc

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"   # one BLAS thread per rank, as --calibrate measures (before numpy loads)

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

from mpidist.plan import Layout, ModelShape, Profile, estimate, load_profile  # noqa: E402
from mpidist.plan.calibrate import machine_busy_seconds  # noqa: E402

SHAPE = ModelShape(layers=4, hidden=128, heads=4, vocab=256, seq=64)
BATCH = 16
LAYOUTS = {
    "2": [Layout(2, 1, 1, micro_batch=8), Layout(2, 1, 1, micro_batch=4, num_micro=2),
          Layout(2, 1, 1, "fsdp", micro_batch=8),
          Layout(1, 2, 1, micro_batch=16), Layout(1, 2, 1, micro_batch=16, sequence_parallel=True),
          Layout(1, 1, 2, micro_batch=4, num_micro=4, schedule="1f1b"),
          Layout(1, 1, 2, micro_batch=2, num_micro=8, schedule="gpipe"),
          Layout(2, 1, 1, micro_batch=8, recompute="full"), Layout(2, 1, 1, "zero1", micro_batch=8)],
    "4": [Layout(4, 1, 1, micro_batch=4), Layout(4, 1, 1, "fsdp", micro_batch=4),
          Layout(2, 2, 1, micro_batch=8), Layout(1, 4, 1, micro_batch=16),
          Layout(2, 1, 2, micro_batch=4, num_micro=2, schedule="1f1b"),
          Layout(1, 1, 4, micro_batch=2, num_micro=8, schedule="1f1b"),
          Layout(1, 2, 2, micro_batch=4, num_micro=4, schedule="1f1b"),
          Layout(4, 1, 1, "zero1", micro_batch=4), Layout(2, 1, 2, "zero1", micro_batch=4, num_micro=2, schedule="1f1b")],
    # 2 nodes x 2 ranks (block placement): tensor-parallel pairs inside a node, the rest across the link
    "2x2": [Layout(4, 1, 1, micro_batch=4), Layout(4, 1, 1, "fsdp", micro_batch=4),
            Layout(4, 1, 1, "hybrid", micro_batch=4, shard_size=2),
            Layout(2, 2, 1, micro_batch=8),
            Layout(2, 1, 2, micro_batch=4, num_micro=2, schedule="1f1b"),
            Layout(1, 2, 2, micro_batch=4, num_micro=4, schedule="1f1b")],
}


def _timed_steps(run, comm, steps):
    """Return (the slowest rank's step seconds, foreign share of the cores during them), after one untimed step
    (the layout's arrays back in cache after the others ran)."""
    from mpi4py import MPI
    run.step()
    comm.Barrier()
    busy0, own0, wall0 = machine_busy_seconds(), time.process_time(), time.perf_counter()
    times = []
    for _ in range(steps):
        comm.Barrier()
        times.append(comm.allreduce(run.step(), op=MPI.MAX))
    comm.Barrier()
    own = comm.allreduce(time.process_time() - own0, op=MPI.SUM)
    wall = time.perf_counter() - wall0
    busy = comm.bcast(machine_busy_seconds() - busy0 if comm.Get_rank() == 0 else None)
    foreign = max(0.0, busy - own) / (wall * (os.cpu_count() or 1))
    return times, foreign


def _peak_bytes(layout, comm):
    """Return the largest over ranks of: bytes a fresh run of ``layout`` holds between steps, its peak in a step,
    and its wrapper's ``memory_stats`` persistent bytes (what the wrapper accounts for of the held bytes).

    One tracer counts every byte once: ``tracemalloc`` starts before the run is built, so whatever the run
    allocated and still holds at the step's peak (parameters, gradients wherever they live: DDP's buckets, FSDP's
    shards, a pipeline stage's or a tensor-parallel slice's own arrays; optimizer state; activations, gathered
    parameters, messages) is in its traced total exactly once, and what the step frees first (``zero_grad`` sets
    gradients to None, backward allocates them again) is not counted both before and during the step, as
    adding a wrapper's ``memory_stats`` (gradients held before the step) to the step's traced peak did. The
    second step is the one measured: the first creates the optimizer's state. Not counted: MPI's own buffers
    (allocated in C, outside Python's allocator); counted beyond the planner's terms: the run's input batch
    (16 KiB) and its Python objects; held beyond ``memory_stats``: AdamW's persistent work arrays."""
    from mpi4py import MPI

    from mpidist.plan.execute import LayoutRun
    gc.collect()
    comm.Barrier()
    tracemalloc.start()
    run = LayoutRun(SHAPE, layout, comm)
    run.step()
    gc.collect()   # the unsplit model's freed stages and slices (cycles), as a long run's collector would
    held = tracemalloc.get_traced_memory()[0]
    persistent = run.interface.memory_stats(run.opt)["persistent_bytes"]
    tracemalloc.reset_peak()
    run.step()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del run
    return tuple(comm.allreduce(x, op=MPI.MAX) for x in (held, peak, persistent))


def memory_worker(part):
    """Measure every layout of ``part``'s peak memory (``_peak_bytes``, no timing) and print the rows."""
    from mpi4py import MPI
    from mpidist.plan.execute import LayoutRun
    comm = MPI.COMM_WORLD
    for layout in LAYOUTS[part]:   # untraced: what the first run imports and caches is not any layout's memory
        LayoutRun(SHAPE, layout, comm).step()
    rows = []
    for layout in LAYOUTS[part]:
        held, peak, persistent = _peak_bytes(layout, comm)
        rows.append({"layout": layout.to_dict(), "name": layout.name(), "peak_bytes": peak, "held_bytes": held,
                     "persistent_bytes": persistent})
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps(rows))


def predict_memory(rows, ranks_per_node):
    """Add the planner's per-rank memory and its error to ``rows``; return the median and largest |error|."""
    for row in rows:
        est = estimate(SHAPE, Layout(**row["layout"]), load_profile("local"), ranks_per_node)
        row["predicted_peak_bytes"] = est.memory["total"]
        row["predicted_memory"] = est.memory
        row["memory_error"] = est.memory["total"] / row["peak_bytes"] - 1
    errors = [abs(r["memory_error"]) for r in rows]
    return {"median_abs_memory_error": statistics.median(errors), "max_abs_memory_error": max(errors)}


def memory_only(args):
    """Measure and predict every layout's peak memory (``--ranks``, else 2 and 4 ranks and the virtual cluster's
    2x2 layouts run as 4 ranks of this node): deterministic (``tracemalloc`` counts bytes, not time), so it needs
    no quiet machine."""
    import platform
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "mpidist"],
                                capture_output=True, text=True, cwd=REPO).stdout.strip())
    report = {"model": SHAPE.__dict__, "global_batch": BATCH, "commit": commit + ("+" if dirty else ""),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": platform.python_version(),
              "runs": {}}
    # the virtual cluster's layouts too, on 4 ranks of this node: memory does not depend on where ranks run
    for part in [args.ranks] if args.ranks else ["2", "4", "2x2"]:
        rows = launch(part, args, memory_only=True)
        summary = predict_memory(rows, 2 if part == "2x2" else int(part))
        report["runs"][part] = {"ranks": 4 if part == "2x2" else int(part), "rows": rows, "summary": summary}
        print(f"-- {'2x2 layouts, 4' if part == '2x2' else part} ranks (peak memory only; commit {report['commit']}, "
              f"{report['date']})")
        print(f"{'layout':<36} {'meas MiB':>9} {'pred MiB':>9} {'err':>7}")
        for r in rows:
            print(f"{r['name']:<36} {r['peak_bytes'] / 2**20:>9.3f} {r['predicted_peak_bytes'] / 2**20:>9.3f} "
                  f"{r['memory_error']:>+7.1%}")
        print(f"median |memory error| {summary['median_abs_memory_error']:.1%}; largest "
              f"{summary['max_abs_memory_error']:.1%}")
    return report


def worker(part, steps, tries, max_foreign, rounds):
    """Build every layout of ``part``, then time them interleaved: ``rounds`` rounds, each giving every layout
    ``steps`` timed steps in turn, so a slow minute of the machine (another job, the scheduler's placement of
    the ranks) falls on all layouts alike instead of on one; a layout's step is the median of all its steps."""
    from mpi4py import MPI

    from mpidist.plan.execute import LayoutRun
    comm = MPI.COMM_WORLD
    runs = [LayoutRun(SHAPE, layout, comm) for layout in LAYOUTS[part]]
    for run in runs:
        run.step()
    rounds_of = [[] for _ in runs]
    for _ in range(rounds):
        for k, run in enumerate(runs):
            attempts = []
            for _ in range(tries):
                attempts.append(_timed_steps(run, comm, steps))
                if attempts[-1][1] <= max_foreign:
                    break
                time.sleep(2.0)   # another job's burst: let it pass
            rounds_of[k].append((min(attempts, key=lambda a: a[1]), attempts))
    rows = []
    for layout, measured in zip(LAYOUTS[part], rounds_of):
        steps_s = [t for (times, _), _ in measured for t in times]
        step_s, foreign = statistics.median(steps_s), max(f for (_, f), _ in measured)
        attempts = [a for _, tried in measured for a in tried]
        held, peak, persistent = _peak_bytes(layout, comm)
        rows.append({"layout": layout.to_dict(), "name": layout.name(), "step_s": step_s, "peak_bytes": peak,
                     "held_bytes": held, "persistent_bytes": persistent,
                     "foreign_cpu_share": foreign, "rounds_step_s": [statistics.median(t) for (t, _), _ in measured],
                     "attempts": [{"step_s": statistics.median(a[0]), "foreign_cpu_share": a[1]} for a in attempts]})
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps(rows))


def kendall_tau(a, b):
    """Kendall's tau-a of two equal-length sequences (pairs tied in either count as neither)."""
    concordant = discordant = 0
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            s = (a[i] - a[j]) * (b[i] - b[j])
            concordant += s > 0
            discordant += s < 0
    pairs = len(a) * (len(a) - 1) / 2
    return (concordant - discordant) / pairs if pairs else float("nan")


def _scores(rows, predicted):
    measured = [r["step_s"] for r in rows]
    chosen = predicted.index(min(predicted))
    return {"kendall_tau": kendall_tau(predicted, measured),
            "median_abs_step_error": statistics.median(abs(p / m - 1) for p, m in zip(predicted, measured)),
            "chosen": rows[chosen]["name"], "chosen_vs_best": measured[chosen] / min(measured) - 1}


def repeat_tau(rows, key):
    """Return {"median", "min", "max", "repeats"} of Kendall's tau between every two repeats of the measurement
    (``key``: each row's per-round or per-run steps): how well the machine ranks the layouts against itself, the
    ceiling of any model's tau on it; None without two repeats."""
    series = [r.get(key) or [] for r in rows]
    repeats = min(len(x) for x in series)
    if repeats < 2:
        return None
    taus = [kendall_tau([x[i] for x in series], [x[j] for x in series])
            for i in range(repeats) for j in range(i + 1, repeats)]
    return {"median": statistics.median(taus), "min": min(taus), "max": max(taus), "repeats": repeats}


def predict(rows, profile, ranks_per_node, ranks, cores):
    """Add the planner's prediction and the errors to ``rows``; return the part's summary (with the same
    scores for the profile's knobs left neutral, ``compute_scale`` 1, no per-layer overhead and no tensor-parallel
    replicated terms: uncalibrated)."""
    neutral = Profile.from_dict(dict(profile.to_dict(), compute_scale=1.0, layer_overhead_s=0.0,
                                     tp_replicated_s=0.0, sp_replicated_s=0.0))
    for row in rows:
        row["uncalibrated_step_s"] = estimate(SHAPE, Layout(**row["layout"]), neutral, ranks_per_node).time["step"]
        est = estimate(SHAPE, Layout(**row["layout"]), profile, ranks_per_node)
        row["predicted_step_s"] = est.time["step"]
        row["predicted_peak_bytes"] = est.memory["total"]
        row["predicted_time"] = est.time
        row["predicted_memory"] = est.memory
        row["step_error"] = est.time["step"] / row["step_s"] - 1
        row["memory_error"] = est.memory["total"] / row["peak_bytes"] - 1
    measured = [r["step_s"] for r in rows]
    predicted = [r["predicted_step_s"] for r in rows]
    chosen = rows[predicted.index(min(predicted))]
    return {"kendall_tau": kendall_tau(predicted, measured),
            "median_abs_step_error": statistics.median(abs(r["step_error"]) for r in rows),
            "median_abs_memory_error": statistics.median(abs(r["memory_error"]) for r in rows),
            "chosen": chosen["name"], "chosen_vs_best": chosen["step_s"] / min(measured) - 1,
            "best": rows[measured.index(min(measured))]["name"],
            "max_foreign_cpu_share": max(r["foreign_cpu_share"] for r in rows),
            "oversubscribed": ranks > cores, "uncalibrated": _scores(rows, [r["uncalibrated_step_s"] for r in rows]),
            "repeat_tau_rounds": repeat_tau(rows, "rounds_step_s"), "repeat_tau_runs": repeat_tau(rows, "runs_step_s"),
            "without": {term: _scores(rows, [estimate(SHAPE, Layout(**r["layout"]), Profile.from_dict(
                dict(profile.to_dict(), **off)), ranks_per_node).time["step"] for r in rows])
                for term, off in (("microbatch_cost", {"microbatch_cost": []}),
                                  ("oversubscribed_tier", {"oversubscribed_tier": None, "oversubscribed_groups": {}}),
                                  ("oversubscribed_groups", {"oversubscribed_groups": {}}),
                                  ("tp_replicated_s", {"tp_replicated_s": 0.0}),
                                  ("sp_replicated_s", {"sp_replicated_s": 0.0}))}}


def print_part(name, part):
    s = part["summary"]
    print(f"-- {name}: {part['ranks']} ranks, {part['ranks_per_node']} per node, {part['cores']} cores "
          f"(profile {part['profile']}, {part['date']})")
    print(f"{'layout':<36} {'meas ms':>8} {'pred ms':>8} {'err':>7} {'meas MiB':>9} {'pred MiB':>9} {'err':>7} "
          f"{'foreign':>8}")
    for r in part["rows"]:
        print(f"{r['name']:<36} {r['step_s'] * 1e3:>8.1f} {r['predicted_step_s'] * 1e3:>8.1f} "
              f"{r['step_error']:>+7.0%} {r['peak_bytes'] / 2**20:>9.2f} {r['predicted_peak_bytes'] / 2**20:>9.2f} "
              f"{r['memory_error']:>+7.0%} {r['foreign_cpu_share']:>8.0%}")
    print(f"Kendall tau {s['kendall_tau']:.2f}; median |step error| {s['median_abs_step_error']:.0%}; "
          f"median |memory error| {s['median_abs_memory_error']:.0%}; chosen {s['chosen']} "
          f"({s['chosen_vs_best']:+.0%} vs the measured best, {s['best']})")
    for kind in ("rounds", "runs"):
        rt = s.get(f"repeat_tau_{kind}")
        if rt:
            print(f"the measurement against itself, between {rt['repeats']} {kind}: Kendall tau median "
                  f"{rt['median']:.2f} (min {rt['min']:.2f}, max {rt['max']:.2f})")
    for term, w in s["without"].items():
        print(f"without {term}: Kendall tau {w['kendall_tau']:.2f}; median |step error| "
              f"{w['median_abs_step_error']:.0%}; chosen {w['chosen']} ({w['chosen_vs_best']:+.0%})")
    u = s["uncalibrated"]
    print(f"uncalibrated (compute_scale 1, no layer overhead or tp/sp_replicated_s): Kendall tau "
          f"{u['kendall_tau']:.2f}; median |step "
          f"error| {u['median_abs_step_error']:.0%}; chosen {u['chosen']} ({u['chosen_vs_best']:+.0%})")


def launch(part, args, cluster=None, memory_only=False):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", part, "--steps", str(args.steps),
           "--rounds", str(args.rounds),
           "--tries", str(args.tries), "--max-foreign", str(args.max_foreign)] + (["--memory-only"] if memory_only
                                                                                  else [])
    if cluster is None:
        mpiexec = os.environ.get("MPIDIST_MPIEXEC") or os.path.join(os.path.dirname(sys.executable), "mpiexec")
        argv = [mpiexec, "-n", "4" if part == "2x2" else part] + cmd   # 2x2 on one node: memory only
    else:
        argv = cluster.mpiexec(cmd, ppn=2)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800, cwd=REPO)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        sys.exit(f"plan_validate: {part} failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def _vcluster():
    """Return the virtual-cluster harness of this checkout (tests/cluster/vcluster.py), or exit saying why not."""
    sys.path.insert(0, os.path.join(REPO, "tests", "cluster"))
    import vcluster
    why = vcluster.unavailable()
    if why:
        sys.exit(f"plan_validate: {why}")
    return vcluster


def calibrate_vcluster(rate, base_path, out_path, nodes=2, ranks_per_node=2):
    """Write ``base_path``'s profile with its inter tier measured between two nodes of a virtual cluster whose
    links are shaped to ``rate`` to ``out_path``: ``mpidist.plan.calibrate --inter`` run with one rank on each of
    two nodes, the link shared by the ranks of a node (``ranks_per_link``), and ``cores_per_node`` the machine's
    cores split over the nodes (the namespaces share them)."""
    import tempfile
    with open(base_path) as f:
        base = json.load(f)
    with tempfile.TemporaryDirectory() as tmp:
        measured = os.path.join(tmp, "inter.json")
        cmd = [sys.executable, "-m", "mpidist.plan.calibrate", "--inter", os.path.abspath(base_path), measured,
               "--ranks-per-link", str(ranks_per_node), "--name", f"vcluster-{nodes}x{ranks_per_node}-{rate}"]
        with _vcluster().VirtualCluster(nodes=nodes, rate=rate) as cluster:
            done = subprocess.run(cluster.mpiexec(cmd, ppn=1), capture_output=True, text=True, timeout=600,
                                  cwd=REPO)
        if done.returncode:
            sys.exit(f"plan_validate: calibrate --inter failed ({done.returncode}): {done.stderr[-2000:]}")
        with open(measured) as f:
            data = json.load(f)
    data["cores_per_node"] = max(1, (base.get("cores_per_node") or os.cpu_count() or 1) // nodes)
    data["source"] += f" (virtual cluster, links shaped to {rate})"
    data["fit"]["inter"]["rate"] = rate
    Profile.from_dict(data, where="plan_validate --calibrate")   # what is written loads
    with open(out_path, "w") as f:
        f.write(json.dumps(data, indent=1) + "\n")
    print(f"plan_validate: wrote {out_path} (inter tier {data['tiers']['inter']['latency_s'] * 1e6:.1f} us, "
          f"{data['tiers']['inter']['bandwidth'] / 1e6:.1f} MB/s)")


def merge(args):
    """Return the parts of ``args.merge`` by name; several runs of one part become one: per layout the median
    of the runs' steps whose foreign share is at most ``--max-foreign``, predicted again with ``--profile``
    (one node) or ``--vcluster-profile`` (the virtual cluster)."""
    runs = {}
    for path in args.merge:
        with open(path) as f:
            for name, part in json.load(f)["runs"].items():
                runs.setdefault(name, []).append(part)
    out = {}
    for name, parts in runs.items():
        last = parts[-1]
        rows = []
        for k, row in enumerate(last["rows"]):
            quiet = [p["rows"][k]["step_s"] for p in parts if p["rows"][k]["foreign_cpu_share"] <= args.max_foreign]
            every = [p["rows"][k]["step_s"] for p in parts]
            rows.append({"layout": row["layout"], "name": row["name"], "peak_bytes": row["peak_bytes"],
                         **{k: row[k] for k in ("held_bytes", "persistent_bytes") if k in row},
                         "rounds_step_s": [x for p in parts for x in p["rows"][k].get("rounds_step_s", [])],
                         "step_s": statistics.median(quiet or every), "runs_step_s": every,
                         "runs_foreign_cpu_share": [p["rows"][k]["foreign_cpu_share"] for p in parts],
                         "foreign_cpu_share": max(p["rows"][k]["foreign_cpu_share"] for p in parts)
                         if not quiet else max(p["rows"][k]["foreign_cpu_share"] for p in parts
                                               if p["rows"][k]["foreign_cpu_share"] <= args.max_foreign)})
        profile = load_profile(args.vcluster_profile if last["ranks_per_node"] < last["ranks"] else args.profile)
        part = {k: v for k, v in last.items() if k not in ("rows", "summary", "date", "load_average")}
        part.update(rows=rows, profile=profile.name, profile_source=profile.source,
                    dates=[p["date"] for p in parts], load_averages=[p["load_average"] for p in parts],
                    date=", ".join(p["date"][11:16] for p in parts) + " UTC " + last["date"][:10],
                    load_average=max(p["load_average"] for p in parts))
        part["summary"] = predict(rows, profile, last["ranks_per_node"], last["ranks"], last["cores"])
        part["summary"]["runs"] = len(parts)
        out[name] = part
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--profile", default="local", help="profile name or JSON path")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per layout and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds over the layouts (a layout's step: the "
                        "median of its steps of all rounds)")
    parser.add_argument("--ranks", choices=["2", "4"], help="one node: this many ranks")
    parser.add_argument("--vcluster", metavar="RATE", help="2 nodes x 2 ranks of the virtual cluster, links at RATE")
    parser.add_argument("--tries", type=int, default=8, help="measurements of a layout at most (interference)")
    parser.add_argument("--max-foreign", type=float, default=0.05,
                        help="accept a measurement when other jobs used at most this share of the cores")
    parser.add_argument("--merge", nargs="+", metavar="PART", help="merge these part files into --json (runs of one "
                        "part: the median of their quiet measurements)")
    parser.add_argument("--vcluster-profile", default="vcluster-2x2", help="--merge: the virtual cluster's profile")
    parser.add_argument("--calibrate", nargs=2, metavar=("BASE", "OUT"), help="with --vcluster: write BASE's "
                        "profile with the inter tier measured on the virtual cluster's shaped link to OUT")
    parser.add_argument("--memory-only", action="store_true", help="peak memory only, no timing (--ranks, else "
                        "2 and 4 ranks): measured per layout and compared with the planner")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        if args.memory_only:
            return memory_worker(args.worker)
        return worker(args.worker, args.steps, args.tries, args.max_foreign, args.rounds)
    if args.memory_only:
        if args.vcluster or args.merge or args.calibrate:
            parser.error("--memory-only measures one node: give --ranks or nothing")
        report = memory_only(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
        return
    if args.calibrate:
        if not args.vcluster:
            parser.error("--calibrate needs --vcluster RATE")
        return calibrate_vcluster(args.vcluster, *args.calibrate)
    if args.merge:
        report = {"model": SHAPE.__dict__, "global_batch": BATCH, "runs": merge(args)}
        for name, part in report["runs"].items():
            print_part(name, part)
    else:
        if bool(args.ranks) == bool(args.vcluster):
            parser.error("give one of --ranks, --vcluster or --merge")
        profile = load_profile(args.profile)
        cores = os.cpu_count() or 1
        if args.ranks:
            name, ranks, per_node = args.ranks, int(args.ranks), int(args.ranks)
            rows = launch(name, args)
        else:
            name, ranks, per_node = f"2x2 {args.vcluster}", 4, 2
            with _vcluster().VirtualCluster(nodes=2, rate=args.vcluster) as cluster:
                rows = launch("2x2", args, cluster)
        part = {"rows": rows, "ranks": ranks, "ranks_per_node": per_node, "cores": cores,
                "profile": profile.name, "profile_source": profile.source,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "steps": args.steps,
                "rounds": args.rounds,
                "load_average": os.getloadavg()}
        part["summary"] = predict(rows, profile, per_node, ranks, cores)
        report = {"model": SHAPE.__dict__, "global_batch": BATCH, "runs": {name: part}}
        print_part(name, part)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
