"""PyTorch's own distributed tests (torch/testing/_internal/distributed/distributed_test.py) over ``mpidist``.

    python tests/jobs/torch_upstream.py --ranks 4 --out results.jsonl [--only PATTERN] [--timeout 60] [--as gloo]

PyTorch runs these tests in processes it spawns itself (so they are not MPI ranks). Here the test methods of
``DistributedTest._DistTestBase`` run instead on the ranks of ``mpiexec -n N``: one default group
initialised from MPI, every test in sorted order on every rank, the verdict of each test agreed over MPI
(failed on any rank = failed). torch's plugin hooks declare the backend (``backend_feature["plugin"]``,
plus the "ddp" and "subgroup" feature sets that gate the generic tests); tests for other backends and for
GPUs skip themselves. A test still running after ``--timeout`` seconds ends the job (recorded as a
timeout: a hang or a deadlock), and the driver starts a new job after it. Not part of ``make test``.
"""

import argparse
import fnmatch
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback

HERE = os.path.abspath(__file__)


def _worker(args):
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    temp = world.bcast(tempfile.mkdtemp(prefix="mpidist-upstream-") if rank == 0 else None, root=0)
    # --as gloo: the suite's name-gated tests (written for gloo) run too, on mpidist underneath.
    os.environ.update(BACKEND=args.as_backend, WORLD_SIZE=str(world.Get_size()), TEMP_DIR=temp)
    import torch.distributed as dist
    from torch.testing._internal.common_distributed import DistTestCases
    for feature in ("plugin", "ddp", "subgroup"):
        DistTestCases.backend_feature[feature].add(args.as_backend)
    import mpidist.torch  # noqa: F401
    from torch.testing._internal.distributed import distributed_test as dt
    from torch.testing._internal.common_distributed import TEST_SKIPS
    from torch.testing._internal.common_utils import TestCase
    import unittest
    skip_codes = {skip.exit_code: skip.message for skip in TEST_SKIPS.values()}

    if rank == 0:
        for sub in ("barrier", "test_dir", "init_dir"):
            os.makedirs(os.path.join(temp, sub), exist_ok=True)
    world.Barrier()
    dt.Barrier.init() if rank == 0 else None
    world.Barrier()
    dist.init_process_group("mpidist")

    class Upstream(dt.DistributedTest._DistTestBase, TestCase):  # torch's TestCase: its assertEqual compares tensors
        rank = world.Get_rank()
        world_size = str(world.Get_size())
        file_name = os.path.join(temp, "file")

    names = sorted(n for n in dir(Upstream) if n.startswith("test_"))
    if args.only:
        names = [n for n in names if fnmatch.fnmatch(n, args.only)]
    done = set(args.skip.split(",")) if args.skip else set()
    out = open(args.out, "a") if rank == 0 else None
    for name in names:
        if name in done:
            continue
        if rank == 0:
            out.write(json.dumps({"test": name, "verdict": "started"}) + "\n")
            out.flush()
        timer = threading.Timer(args.timeout, lambda: (sys.stderr.write(f"rank {rank}: {name} timed out\n"), os._exit(3)))
        timer.start()
        start = time.monotonic()
        verdict, detail = "passed", ""
        try:
            test = Upstream(name)
            result = unittest.TestResult()
            test.run(result)
            problems = result.errors + result.failures
            exit_code = _skip_exit(problems, skip_codes)
            if result.skipped:
                verdict, detail = "skipped", result.skipped[0][1][:200]
            elif exit_code is not None:  # torch's skip decorators end a spawned rank with a skip code
                verdict, detail = "skipped", skip_codes[exit_code]
            elif problems:
                verdict, detail = "failed", problems[0][1][-600:]
        except SystemExit as exc:
            verdict, detail = ("skipped", skip_codes.get(exc.code, f"exit {exc.code}")) if exc.code else ("passed", "")
        except BaseException:  # noqa: BLE001 - recorded
            verdict, detail = "failed", traceback.format_exc()[-600:]
        timer.cancel()
        codes = {"passed": 0, "skipped": 1, "failed": 2}
        worst = world.allreduce(codes[verdict], op=MPI.MAX)
        verdict = {v: k for k, v in codes.items()}[worst] if verdict != "failed" else verdict
        details = world.gather(detail, root=0)
        if rank == 0:
            out.write(json.dumps({"test": name, "verdict": verdict, "seconds": round(time.monotonic() - start, 2),
                                  "detail": next((d for d in details if d), "")}) + "\n")
            out.flush()
    os._exit(0)  # torch's leftover groups and threads must not hold the job at exit


def _skip_exit(problems, skip_codes):
    """Return the skip exit code a test ended with (``SystemExit: 74`` in its traceback), else None."""
    for _, text in problems:
        last = text.strip().splitlines()[-1] if text.strip() else ""
        if last.startswith("SystemExit: "):
            try:
                code = int(last.split(": ", 1)[1])
            except ValueError:
                return None
            return code if code in skip_codes else None
    return None


def _driver(args):
    open(args.out, "w").close()
    while True:
        seen, finished = [], set()
        with open(args.out) as f:
            for line in f:
                row = json.loads(line)
                seen.append(row["test"])
                if row["verdict"] != "started":
                    finished.add(row["test"])
        started_only = [t for t in seen if t not in finished]
        for t in started_only:  # the job died in it: a timeout
            with open(args.out, "a") as f:
                f.write(json.dumps({"test": t, "verdict": "timeout"}) + "\n")
            finished.add(t)
        mpiexec = os.environ.get("MPIDIST_MPIEXEC") or os.path.join(os.path.dirname(sys.executable), "mpiexec")
        cmd = [mpiexec] + os.environ.get("MPIEXEC_FLAGS", "").split() + [
            "-n", str(args.ranks), sys.executable, HERE, "--worker", "--out", args.out, "--timeout", str(args.timeout),
            "--skip", ",".join(sorted(finished)), "--as", args.as_backend] + (["--only", args.only] if args.only else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        with open(args.out) as f:
            rows = [json.loads(line) for line in f]
        if not rows or (proc.returncode != 0 and rows[-1]["verdict"] != "started"):
            sys.exit(f"the job failed outside any test (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        if proc.returncode == 0:
            break
    final = {}
    for row in rows:
        if row["verdict"] != "started":
            final[row["test"]] = row
    counts = {}
    for row in final.values():
        counts[row["verdict"]] = counts.get(row["verdict"], 0) + 1
    print(json.dumps(counts))
    for row in final.values():
        if row["verdict"] in ("failed", "timeout"):
            print(f"{row['verdict']}: {row['test']}: {row.get('detail', '').strip().splitlines()[-1:] }")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--out", default="torch_upstream.jsonl")
    parser.add_argument("--only", help="fnmatch pattern of test names")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--as", dest="as_backend", default="mpidist",
                        help="the backend name the suite sees (gloo: run its gloo-gated tests on mpidist too)")
    parser.add_argument("--skip", default="", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    return _worker(args) if args.worker else _driver(args)


if __name__ == "__main__":
    sys.exit(main())
