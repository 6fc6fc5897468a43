"""MPIDIST_TRACE=DIR on an unmodified program under a real mpiexec: one merged Chrome trace, a row per rank.

This test launches its job itself, so it runs once in the single-process session (``mpi_skip``).
"""

import json
import subprocess
import sys

import pytest

import launcher

pytestmark = [pytest.mark.mpi_skip, launcher.needed]

PROGRAM = """
import numpy as np
import mpidist
from mpidist import nn, optim
comm, _ = mpidist.init()
model = mpidist.DDP(nn.Sequential(nn.Linear(4, 8, rng=np.random.default_rng(0)), nn.ReLU(),
                                  nn.Linear(8, 2, rng=np.random.default_rng(1))), comm)
opt = optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    opt.zero_grad()
    model(np.ones((3, 4), np.float32)).sum().backward()
    opt.step()
"""


def test_environment_variable_traces_an_unmodified_program(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(PROGRAM)
    directory = tmp_path / "trace"
    proc = subprocess.run(launcher.mpiexec(2, sys.executable, str(script)), capture_output=True, text=True,
                          timeout=120, env=launcher.env(MPIDIST_TRACE=str(directory)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"mpidist: trace in {directory / 'trace.json'}" in proc.stdout
    events = [e for e in json.loads((directory / "trace.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    for rank in (0, 1):
        mine = [e for e in events if e["pid"] == rank]
        assert sum(e["name"] == "SGD.step" for e in mine) == 2
        assert sum(e["cat"] == "comm" and e["name"] in ("iallreduce", "allreduce") for e in mine) >= 2
        assert {e["cat"] for e in mine} >= {"forward", "backward", "optimizer", "comm"}
