"""The GPT demo (examples/gpt.py, what `make demo` runs) under a real mpiexec, every strategy for a few steps in
float64: its own end-of-run check against single-process training on the same global batches must say OK at
float64 precision, and the run must write its result and loss curve.

These tests launch jobs themselves, so they run once in the single-process session (``mpi_skip``).
"""

import json
import os
import re
import subprocess
import sys

import pytest

import launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "examples", "gpt.py")
TINY = ["--steps", "3", "--check-steps", "3", "--layers", "2", "--width", "32", "--heads", "4", "--context", "16",
        "--dtype", "float64", "--log-every", "1", "--eval-every", "3", "--eval-batches", "1", "--sample", "16",
        "--margin", "-1"]

pytestmark = [pytest.mark.mpi_skip, launcher.needed]


@pytest.mark.parametrize("n, strategy, extra", [(2, "ddp", ["--accum", "2"]),
                                                (2, "fsdp", ["--checkpoint-activations", "--metrics", "METRICS"]),
                                                (4, "mesh", ["--microbatches", "2", "--kv-heads", "2", "--llama", "--zero1"])])
def test_every_strategy_matches_single_process_training(tmp_path, n, strategy, extra):
    out = tmp_path / "out"
    extra = [str(tmp_path / "metrics") if a == "METRICS" else a for a in extra]
    cmd = launcher.mpiexec(n, sys.executable, DEMO, "--strategy", strategy, *TINY, *extra, "--out", str(out),
                           "--plot", str(tmp_path / "loss.png"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=launcher.env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = re.search(r"check: after 3 steps, max \|w_distributed - w_single_process\| = (\S+) over \d+ tensors", proc.stdout)
    assert match and float(match.group(1)) < 1e-10 and "-> OK" in proc.stdout, proc.stdout
    assert "unigram baseline of the validation text" in proc.stdout and "sample:" in proc.stdout
    result = json.loads((out / "result.json").read_text())
    assert result["strategy"] == strategy and result["ranks"] == n and result["check_ok"] is True
    assert len(result["history"]["train"]) == 3
    assert (tmp_path / "loss.png").stat().st_size > 1000
    if "--metrics" in extra:  # mpidist.metrics.Logger's rows: the demo's own losses, FSDP's accounted memory
        rows = [json.loads(line) for line in (tmp_path / "metrics" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert [r["loss"] for r in rows] == pytest.approx(result["history"]["train"], rel=1e-12)
        assert all(r["memory_bytes_rank0"] > 0 and r["tokens_per_s"] > 0 for r in rows)
