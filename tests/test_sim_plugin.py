"""The ``--sim-world`` pytest plugin: a user's pytest-mpi test file, run by pytest in a subprocess.

The user's tests check their results against formulas (sum of ranks, the broadcast value); this file checks
pytest's verdict on each (passed, failed with the failing rank's message, skipped by ``min_size``).
``mpi_skip``: it starts pytest processes, which every rank would do again under ``mpiexec --with-mpi``.
"""

import subprocess
import sys
import textwrap
from xml.etree import ElementTree

import pytest

from mpidist.comm.sim.pytest_plugin import _sizes

pytestmark = pytest.mark.mpi_skip

USER_TESTS = """
import numpy as np
import pytest
from mpi4py import MPI

WORLD_AT_IMPORT = MPI.COMM_WORLD.Get_size()


@pytest.mark.mpi
def test_allreduce_of_ranks():
    comm = MPI.COMM_WORLD
    assert comm.allreduce(comm.Get_rank() + 1, op=MPI.SUM) == comm.Get_size() * (comm.Get_size() + 1) // 2
    assert sorted(comm.allgather(comm.Get_rank())) == list(range(comm.Get_size()))


@pytest.mark.mpi(min_size=3)
def test_bcast_needs_three():
    buf = np.arange(4.0) if MPI.COMM_WORLD.Get_rank() == 0 else np.zeros(4)
    MPI.COMM_WORLD.Bcast(buf, root=0)
    assert buf.tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.mpi
def test_wrong_on_rank_one():
    comm = MPI.COMM_WORLD
    got = comm.bcast(41 + comm.Get_rank(), root=0)
    assert comm.Get_rank() != 1, f"rank 1 saw {got}"


@pytest.mark.mpi
@pytest.mark.parametrize("count", [1, 3])
def test_shared_directory(mpi_tmp_path, count):
    comm = MPI.COMM_WORLD
    for i in range(count):
        (mpi_tmp_path / f"rank{comm.Get_rank()}-{i}").write_text("x")
    comm.Barrier()
    assert len(list(mpi_tmp_path.iterdir())) == comm.Get_size() * count


class TestInAClass:
    @pytest.mark.mpi
    def test_sendrecv_ring(self):
        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()
        assert comm.sendrecv(rank, dest=(rank + 1) % size, source=(rank - 1) % size) == (rank - 1) % size


def test_not_marked():
    assert WORLD_AT_IMPORT == 4   # at import, MPI.COMM_WORLD is rank 0 of the largest world
"""


def run_pytest(tmp_path, *args):
    """Run pytest on the user's file; return (CompletedProcess, {test id: passed/failure/skipped})."""
    (tmp_path / "test_user.py").write_text(textwrap.dedent(USER_TESTS))
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "--color=no",
                           "--junitxml=report.xml", *args, "test_user.py"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    found = {}
    for case in ElementTree.parse(tmp_path / "report.xml").iter("testcase"):
        name = case.get("classname").replace("test_user", "").lstrip(".")
        verdicts = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        found[f"{name}::{case.get('name')}" if name else case.get("name")] = verdicts[0] if verdicts else "passed"
    return done, found


def test_a_pytest_mpi_file_runs_on_simulated_worlds(tmp_path):
    done, got = run_pytest(tmp_path, "--sim-world", "2,4")
    want = {"test_not_marked": "passed"}
    for n in (2, 4):
        want.update({f"test_allreduce_of_ranks[sim{n}]": "passed", f"test_wrong_on_rank_one[sim{n}]": "failure",
                     f"test_shared_directory[sim{n}-1]": "passed", f"test_shared_directory[sim{n}-3]": "passed",
                     f"TestInAClass::test_sendrecv_ring[sim{n}]": "passed",
                     f"test_bcast_needs_three[sim{n}]": "passed" if n >= 3 else "skipped"})
    assert got == want, done.stdout
    assert done.returncode == 1
    assert "AssertionError: rank 1 saw 41" in done.stdout and "(on simulated rank 1 of 4)" in done.stdout
    assert "needs a world of at least 3 ranks (min_size=3); the simulated world has 2" in done.stdout


def test_off_unless_asked(tmp_path):
    done, got = run_pytest(tmp_path)
    # pytest-mpi's own behaviour without --with-mpi: marked tests are skipped; at import COMM_WORLD is the
    # real singleton world of 1, so test_not_marked fails on its assertion.
    assert got["test_allreduce_of_ranks"] == "skipped" and got["test_not_marked"] == "failure", done.stdout
    assert "need --with-mpi option to run" in done.stdout and not any("sim" in name for name in got)


def test_bad_sizes_are_a_usage_error():
    assert _sizes("1,4,2,4") == [1, 2, 4]
    for text in ("0", "two", "", "2,-1"):
        with pytest.raises(pytest.UsageError, match=f"expecting world sizes >= 1 .*got {text!r}"):
            _sizes(text)
