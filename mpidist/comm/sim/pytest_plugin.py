"""pytest plugin: run a pytest-mpi suite (tests marked ``@pytest.mark.mpi``) on simulated worlds, no mpiexec.

Off unless asked: ``pytest --sim-world 4`` (or ``--sim-world 1,2,4``) runs every ``mpi``-marked test once per
world size, each time on that many rank threads in this process, ``[sim4]`` in its id. While the option is
on, ``from mpi4py import MPI`` gives the simulated namespace (``mpidist.comm.sim.MPI``), so ``MPI.COMM_WORLD``
in a test is the calling rank's world; at import time (outside a test) it is rank 0 of the largest world.

- ``@pytest.mark.mpi(min_size=k)`` skips, with the reason, on worlds smaller than k (as pytest-mpi does).
- The test fails if any rank fails, with the first failing rank's error and a note naming that rank;
  ``pytest.skip`` on a rank skips the test.
- Fixtures are set up once, in the main thread, and shared by the ranks: pytest-mpi's ``mpi_tmp_path``,
  ``mpi_tmpdir`` and ``mpi_file_name`` (one path for every rank) are ``tmp_path``/``tmpdir`` here.
- Tests without the marker run once, as usual. ``mpi_skip``/``mpi_xfail`` concern runs under mpirun
  (every test on every rank) and are ignored.
"""

import pytest

__all__ = ["SIM_WORLD_OPTION"]

# The option itself is added by the top-level entry point module mpidist_pytest (kept out of this package so
# that a pytest run without it imports neither mpidist nor mpi4py); its pytest_configure calls the one below.
SIM_WORLD_OPTION = "--sim-world"
_PARAM = "_mpidist_sim_size"   # the parametrized name carrying a test's world size


def _sizes(text):
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(n < 1 for n in sizes):
        raise pytest.UsageError(f"{SIM_WORLD_OPTION}: expecting world sizes >= 1 separated by commas, "
                                f"e.g. 4 or 1,2,4 (got {text!r})")
    return sorted(set(sizes))


def pytest_configure(config):
    text = config.getoption("sim_world", None)
    if text is None:
        return
    if config.getoption("with_mpi", False) or config.getoption("only_mpi", False):
        raise pytest.UsageError(f"{SIM_WORLD_OPTION} runs mpi tests on simulated ranks in one process; "
                                f"--with-mpi/--only-mpi run them under mpiexec: choose one")
    config.addinivalue_line("markers", "mpi(min_size=None): a test that runs on every rank of an MPI world")
    config.pluginmanager.register(SimWorldPlugin(_sizes(text)), "mpidist-sim-world")


class SimWorldPlugin:
    """What ``--sim-world`` turns on (registered after pytest-mpi, so its fixtures take precedence)."""

    def __init__(self, sizes):
        self.sizes = sizes
        self._installed = None

    def pytest_configure(self, config):
        from .program import install_mpi4py
        from .runner import bind_thread
        self._installed = install_mpi4py()
        bind_thread(max(self.sizes), 0)   # MPI.COMM_WORLD queries made while test modules are imported

    def pytest_unconfigure(self, config):
        if self._installed is not None:
            self._installed()
            self._installed = None

    def pytest_generate_tests(self, metafunc):
        if metafunc.definition.get_closest_marker("mpi") is None:
            return
        metafunc.fixturenames.append(_PARAM)   # a parameter the test function does not name
        metafunc.parametrize(_PARAM, self.sizes, ids=[f"sim{n}" for n in self.sizes])

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        # pytest-mpi skips mpi tests without --with-mpi; here they run, on simulated ranks.
        for item in items:
            if _size_of(item) is not None:
                item.own_markers[:] = [m for m in item.own_markers
                                       if not (m.name == "skip" and "--with-mpi" in str(m.kwargs.get("reason", "")))]

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        size = _size_of(item)
        if size is None:
            return
        for mark in item.iter_markers(name="mpi"):
            if mark.args:
                raise ValueError(f"{item.nodeid}: the mpi mark takes only min_size= (got {mark.args!r})")
            min_size = mark.kwargs.get("min_size")
            if min_size is not None and size < min_size:
                pytest.skip(f"needs a world of at least {min_size} ranks (min_size={min_size}); "
                            f"the simulated world has {size}")

    @pytest.hookimpl(tryfirst=True)
    def pytest_pyfunc_call(self, pyfuncitem):
        size = _size_of(pyfuncitem)
        if size is None:
            return None
        kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
        run_on_ranks(size, lambda: pyfuncitem.obj(**kwargs))
        return True

    @pytest.fixture
    def mpi_tmp_path(self, tmp_path):
        """``tmp_path``: the ranks share this process, so one directory serves every rank."""
        return tmp_path

    @pytest.fixture
    def mpi_tmpdir(self, tmpdir):
        """``tmpdir``, shared by every rank."""
        return tmpdir

    @pytest.fixture
    def mpi_file_name(self, tmpdir, request):
        """A file name in ``tmpdir``, the same on every rank (as pytest-mpi's)."""
        return str(tmpdir.join(str(request.node) + ".hdf5"))


def _size_of(item):
    callspec = getattr(item, "callspec", None)
    return None if callspec is None else callspec.params.get(_PARAM)


def run_on_ranks(size, test):
    """Run ``test()`` on ``size`` rank threads; raise the first failing rank's error (noting the rank)."""
    from .runner import rank_threads
    _, errors, universe = rank_threads(size, lambda rank, comm: test(), abandon_after=5.0)
    if universe.failure is not None:
        rank, exc = universe.failure
    else:
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if not failed:
            return
        rank, exc = failed[0]
    if not isinstance(exc, pytest.skip.Exception) and hasattr(exc, "add_note"):
        exc.add_note(f"(on simulated rank {rank} of {size})")
    raise exc
