"""The Makefile's MPI choices: each has its own venv and launcher, what the tests see, what is refused.

Every check runs ``make -n`` (prints the commands, runs none) or a recipe that only prints, with a VENV in a
temporary directory, so no venv is built or touched. The child make gets an environment without the
variables a surrounding ``make test`` exports (MAKEFLAGS carries its command line, e.g. ``MPI=openmpi``).
"""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # as make sees its CURDIR
MAKE = shutil.which("make")
CHOICES = "mpich openmpi system"

pytestmark = [pytest.mark.mpi_skip, pytest.mark.skipif(MAKE is None, reason="no make on PATH")]

_INHERITED = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "MPI", "VENV", "MPIEXEC_FLAGS",
              "MPIDIST_MPIEXEC", "BENCH_OUT", "OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")


def make(*args, path=None):
    """Run ``make ARGS`` in the repository with a clean environment; return the CompletedProcess."""
    env = {k: v for k, v in os.environ.items() if k not in _INHERITED}
    if path is not None:
        env["PATH"] = path
    return subprocess.run([MAKE, "--no-print-directory", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)


LAUNCH_VARS = ("MPIDIST_MPIEXEC", "MPIEXEC_FLAGS", "OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")


def exported(*args):
    """Return the launch variables in the environment a recipe (and so pytest) gets under ``make ARGS``."""
    result = make("-s", *args, "--eval", "print-env: ; @env", "print-env")
    assert result.returncode == 0, result.stderr
    env = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    return {k: v for k, v in env.items() if k in LAUNCH_VARS}


@pytest.mark.parametrize("value", ["bogus", "wheel", "openmpi mpich", ""])
def test_an_unknown_mpi_is_refused_with_the_choices(value, tmp_path):
    result = make("-n", "test", f"MPI={value}", f"VENV={tmp_path / 'venv'}")
    assert result.returncode != 0 and result.stdout == "", result.stdout
    assert f"MPI='{value}' is not an MPI choice: use one of {CHOICES}" in result.stderr, result.stderr


@pytest.mark.parametrize("mpi, package", [("mpich", "mpich"), ("openmpi", "openmpi"),
                                          ("system", "--no-binary mpi4py mpi4py")])
def test_each_choice_installs_its_own_mpi_and_wipes_nothing(mpi, package, tmp_path):
    venv = tmp_path / "venv"
    result = make("-n", "venv", f"MPI={mpi}", f"VENV={venv}")
    assert result.returncode == 0, result.stderr
    [install] = [line for line in result.stdout.splitlines() if "pip install" in line]
    assert install.startswith(f"{venv}/bin/python -m pip install") and install.endswith(package), install
    assert ("mpich" in install) == (mpi == "mpich") and "rm " not in result.stdout, result.stdout


def test_each_choice_exports_its_launcher_to_the_tests():
    mpich, openmpi, system = (exported(f"MPI={mpi}") for mpi in CHOICES.split())
    assert exported() == mpich  # mpich is the default
    assert (mpich["MPIDIST_MPIEXEC"], mpich["MPIEXEC_FLAGS"]) == (f"{ROOT}/.venv/bin/mpiexec", "")
    assert "OMPI_ALLOW_RUN_AS_ROOT" not in mpich
    # Open MPI's wheel: its own venv, allowed to run as root and to start more ranks than cores.
    assert (openmpi["MPIDIST_MPIEXEC"], openmpi["MPIEXEC_FLAGS"]) == (f"{ROOT}/.venv-openmpi/bin/mpiexec", "--oversubscribe")
    assert openmpi["OMPI_ALLOW_RUN_AS_ROOT"] == openmpi["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert (system["MPIDIST_MPIEXEC"], system["MPIEXEC_FLAGS"]) == ("mpiexec", "")


def test_mpiexec_flags_reach_make_and_the_tests(tmp_path):
    flags = "--bind-to none -x 'A=1 2'"
    assert exported("MPI=openmpi", f"MPIEXEC_FLAGS={flags}")["MPIEXEC_FLAGS"] == f"--oversubscribe {flags}"
    assert exported("MPI=system", f"MPIEXEC_FLAGS={flags}")["MPIEXEC_FLAGS"] == flags
    result = make("-n", "test-mpi", "demo", "bench", "MPI=system", f"VENV={tmp_path / 'venv'}", f"MPIEXEC_FLAGS={flags}")
    launches = [line for line in result.stdout.splitlines() if " -n " in line]
    assert len(launches) == 4 and all(line.startswith(f"mpiexec {flags} -n ") for line in launches), result.stdout


@pytest.mark.parametrize("marker, owner", [(".installed-mpich", "mpich"), (".installed-wheel", "mpich"),
                                           (".installed-openmpi", "openmpi")])
def test_a_venv_set_up_for_another_mpi_is_refused_not_wiped(marker, owner, tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / marker).touch()
    other = "system" if owner == "openmpi" else "openmpi"
    for target in ("test", "clean"):
        result = make("-n", target, f"MPI={other}", f"VENV={venv}")
        assert result.returncode != 0 and result.stdout == "", result.stdout
        assert f"VENV={venv} was set up for MPI={owner}, not MPI={other}" in result.stderr, result.stderr
    # Its own MPI uses it as it is: a venv made before MPI=mpich had that name (.installed-wheel) included.
    result = make("-n", "venv", f"MPI={owner}", f"VENV={venv}")
    assert result.returncode == 0 and "Nothing to be done for 'venv'" in result.stdout, result.stdout + result.stderr


def test_system_mpi_without_mpicc_on_path_stops_before_making_a_venv(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    venv = tmp_path / "venv"
    result = make("venv", "MPI=system", f"VENV={venv}", path=str(empty))
    assert result.returncode != 0 and not venv.exists()
    assert "MPI=system: needs mpicc and mpiexec on PATH" in result.stderr, result.stderr


def test_bench_plot_writes_untracked_files_unless_told_otherwise(tmp_path):
    def outputs(*args):
        result = make("-n", "bench-plot", f"VENV={tmp_path / 'venv'}", *args)
        [line] = [line for line in result.stdout.replace("\\\n", " ").splitlines() if "mpidist bench" in line]
        words = line.split()
        return [words[words.index("--plot") + 1], words[words.index("--json") + 1]]

    default = outputs()
    assert default == ["out/bench.png", "out/bench.json"]
    if shutil.which("git") and os.path.isdir(os.path.join(ROOT, ".git")):
        ignored = subprocess.run(["git", "check-ignore", *default], cwd=ROOT, capture_output=True, text=True)
        assert ignored.stdout.split() == default  # git never sees them
    assert outputs("BENCH_OUT=docs") == ["docs/bench.png", "docs/bench.json"]
