"""The digits demo with --ckpt under a real mpiexec: resumed at another world size or strategy, it still matches
its single-process reference, which replays the segments the runs took; a bad --ckpt fails before training.

These tests launch jobs themselves, so they run once in the single-process session (``mpi_skip``).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "examples", "digits.py")
BATCH = 16  # the demo's default batch per rank

pytestmark = [pytest.mark.mpi_skip, launcher.needed]
pytest.importorskip("sklearn", reason="the digits demo needs scikit-learn (the examples extra)")


def demo(n, *args, timeout=180):
    return launcher.run(launcher.mpiexec(n, sys.executable, DEMO, *args), capture_output=True, text=True,
                        timeout=timeout, env=launcher.env())


def check_ok(proc):
    """Assert the run ended normally and matched its single-process reference (short runs may miss the 95% goal)."""
    accuracy_only = proc.returncode == 1 and "is below the 95% this demo promises" in proc.stdout
    assert proc.returncode == 0 or accuracy_only, proc.stdout + proc.stderr
    assert "MISMATCH" not in proc.stdout and re.search(r"check: max \|w_distributed - w_single_process\| = \S+ over 6 tensors -> OK", proc.stdout), proc.stdout


def segments(out):
    with open(os.path.join(out, "result.json")) as f:
        return json.load(f)["segments"]


@pytest.mark.slow
def test_resumed_at_other_world_sizes_and_strategies_matches_its_reference(tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    first = demo(4, "--ckpt", ckpt, "--epochs", "2", "--out", out)
    check_ok(first)
    assert "starting from scratch" in first.stdout
    second = demo(2, "--ckpt", ckpt, "--epochs", "3", "--out", out)
    check_ok(second)
    assert "resumed from checkpoint step 46 (after epoch 2; saved on 4 ranks, now 2)" in second.stdout
    third = demo(3, "--ckpt", ckpt, "--epochs", "4", "--strategy", "fsdp", "--out", out)
    check_ok(third)
    # 1438 samples: 23 steps of 4 x 16 per epoch, then 45 of 2 x 16, then 30 of 3 x 16.
    assert "resumed from checkpoint step 91 (after epoch 3; saved on 2 ranks, now 3)" in third.stdout
    assert segments(out) == [[4, BATCH, 0, 0], [2, BATCH, 2, 0], [3, BATCH, 3, 0]]


@pytest.mark.slow
def test_stopped_mid_epoch_and_resumed_as_a_pipeline_of_another_size_matches_its_reference(tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    job = subprocess.Popen(launcher.mpiexec(4, sys.executable, DEMO, "--ckpt", ckpt, "--epochs", "3",
                                            "--epoch-seconds", "1.5"),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=launcher.env())
    first_epoch = os.path.join(ckpt, "step_00000023", "manifest.json")  # saved after epoch 1
    deadline = time.monotonic() + 120
    while not os.path.exists(first_epoch) and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)  # forwarded by mpiexec: every rank stops after the same step of epoch 2 or 3
    stdout, stderr = job.communicate(timeout=120)
    assert job.returncode == 99, stdout + stderr
    stop = re.search(r"preempted \(SIGUSR1\): saved checkpoint step (\d+) \(epoch (\d+), sample (\d+)\); exiting 99", stdout)
    assert stop, stdout
    step, epoch, sample = map(int, stop.groups())
    assert epoch in (2, 3) and sample == min((step - 23 * (epoch - 1)) * 4 * BATCH, 1440), stop.group(0)

    resumed = demo(3, "--ckpt", ckpt, "--epochs", "3", "--strategy", "pipeline", "--out", out)
    check_ok(resumed)
    assert f"resumed from checkpoint step {step} (epoch {epoch}, sample {sample}; saved on 4 ranks, now 3)" in resumed.stdout
    assert segments(out) == [[4, BATCH, 0, 0], [3, BATCH, epoch - 1, sample]]


@pytest.fixture
def unwritable(tmp_path):
    """Return a checkpoint path no rank can create (under a 0o555 directory; as root, read-only sysfs)."""
    parent = tmp_path / "read-only"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        try:
            (parent / "probe").mkdir()
        except OSError:
            yield str(parent / "ckpt")
            return
        (parent / "probe").rmdir()
        try:
            os.mkdir("/sys/kernel/mpidist-probe")
        except OSError:
            yield "/sys/kernel/mpidist-ckpt"
        else:
            os.rmdir("/sys/kernel/mpidist-probe")
            pytest.skip("running as root and no read-only file system to test on")
    finally:
        parent.chmod(0o755)


@pytest.mark.slow
def test_an_unwritable_ckpt_fails_before_the_first_epoch_naming_the_path(unwritable):
    t0 = time.monotonic()
    proc = demo(2, "--ckpt", unwritable, "--epochs", "2")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "epoch 1/2" not in proc.stdout and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert f"checkpoint directory '{unwritable}' is not writable" in proc.stdout, proc.stdout
    assert time.monotonic() - t0 < 60


@pytest.mark.slow
def test_metrics_rows_are_one_per_step_with_the_memory_fsdp_accounts(tmp_path):
    """--metrics: mpidist.metrics.Logger writes one row per global step (ceil(train / (ranks x batch)) per epoch)."""
    metrics = tmp_path / "metrics"
    proc = demo(2, "--strategy", "fsdp", "--epochs", "2", "--metrics", str(metrics))
    check_ok(proc)
    n_train = int(re.search(r"digits: (\d+) train", proc.stdout).group(1))
    per_epoch = -(-n_train // (2 * BATCH))
    rows = [json.loads(line) for line in (metrics / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 2 * per_epoch + 1))
    assert [r["epoch"] for r in rows] == [1] * per_epoch + [2] * per_epoch
    assert all(r["memory_bytes_rank0"] > 0 and r["memory_bytes_rank1"] > 0 and r["samples_per_s"] > 0 for r in rows)
    assert (metrics / "metrics.csv").read_text().count("\n") == len(rows) + 1  # a header and the rows
