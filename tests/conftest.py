"""One test suite for the simulated and the real communicator.

- The ``comm`` fixture binds a test to SimComm worlds of sizes 1..4 (the test body runs once per
  simulated rank, each on its own thread) or, under ``mpiexec -n N pytest --with-mpi``, to a Dup of
  ``MPI.COMM_WORLD``. ``@pytest.mark.world_sizes(2, 4)`` restricts both.
- The ``world`` fixture does the same for tests that draw their inputs first (hypothesis):
  ``world.run(fn, *args)`` runs ``fn(comm, *args)`` on every rank.
- Under MPI a failing rank tells the others (an allgather after every comm test), so every rank fails
  the same test and the ranks stay in step; non-zero ranks are silent and rank 0 reports failures
  from every rank with one summary line and the worst exit status.
"""

import pytest
from mpi4py import MPI

from mpidist import simulate

SIM_SIZES = (1, 2, 3, 4)

try:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "mpidist", derandomize=True, database=None, deadline=None, max_examples=30,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    settings.load_profile("mpidist")
except ImportError:  # pragma: no cover - hypothesis is in the test extra
    pass


def _with_mpi(config):
    return bool(config.getoption("with_mpi", default=False))


class SimWorld:
    """A simulated world of ``size`` ranks (stands in for the comm argument until the test runs)."""

    def __init__(self, size):
        self.size = size

    def run(self, fn, *args, **kwargs):
        """Run ``fn(comm, *args, **kwargs)`` on every simulated rank; return results by rank."""
        return simulate(self.size, fn, *args, **kwargs)

    def __repr__(self):
        return f"sim{self.size}"


class MPIWorld:
    """The real world communicator (one Dup per test, so tests never see each other's messages)."""

    def __init__(self, comm):
        self.comm = comm
        self.size = comm.Get_size()

    def run(self, fn, *args, **kwargs):
        """Run ``fn(MPI comm, ...)`` on this rank, failing on every rank if it fails on any."""
        return [_agreed(MPI.COMM_WORLD, lambda: fn(self.comm, *args, **kwargs))]


def _agreed(comm, call):
    """Call ``call()``; if it raised on any rank, raise on every rank (the original error where it happened)."""
    error, skipped, result = None, None, None
    try:
        result = call()
    except pytest.skip.Exception as exc:  # agreed too: a rank that skipped alone would leave the others waiting
        skipped = exc
    except BaseException as exc:  # noqa: BLE001 - reported to the other ranks, then re-raised
        error = exc
    outcomes = comm.allgather(("failed", f"{type(error).__name__}: {error}"[:2000]) if error is not None
                              else ("skipped", str(skipped)) if skipped is not None else None)
    if error is not None:
        raise error
    failed = [(r, o[1]) for r, o in enumerate(outcomes) if o and o[0] == "failed"]
    if failed:
        pytest.fail("; ".join(f"rank {r} failed: {m}" for r, m in failed), pytrace=False)
    if skipped is not None:
        raise skipped
    skips = [(r, o[1]) for r, o in enumerate(outcomes) if o]
    if skips:
        pytest.skip("; ".join(f"rank {r} skipped: {m}" for r, m in skips))
    return result


def _sizes_for(item_or_def):
    marker = item_or_def.get_closest_marker("world_sizes")
    return tuple(marker.args) if marker else None


def pytest_generate_tests(metafunc):
    for name in ("comm", "world"):
        if name in metafunc.fixturenames:
            allowed = _sizes_for(metafunc.definition)
            if _with_mpi(metafunc.config):
                metafunc.parametrize(name, ["mpi"], indirect=True)
            else:
                sizes = [n for n in SIM_SIZES if allowed is None or n in allowed]
                metafunc.parametrize(name, [f"sim{n}" for n in sizes], indirect=True)


def _world_param(request):
    allowed = _sizes_for(request.node)
    if request.param == "mpi":
        size = MPI.COMM_WORLD.Get_size()
        if allowed is not None and size not in allowed:
            pytest.skip(f"needs a world of {allowed} ranks (this one has {size})")
        comm = MPI.COMM_WORLD.Dup()
        request.addfinalizer(comm.Free)
        return MPIWorld(comm)
    return SimWorld(int(request.param[3:]))


@pytest.fixture
def comm(request):
    """A communicator: SimComm of size 1..4, or Dup(MPI.COMM_WORLD) under --with-mpi."""
    world = _world_param(request)
    return world.comm if isinstance(world, MPIWorld) else world


@pytest.fixture
def world(request):
    """A world to ``run(fn, *args)`` test bodies on: simulated ranks or the real MPI ranks."""
    return _world_param(request)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    comm = pyfuncitem.funcargs.get("comm")
    if comm is None:
        return None
    argnames = pyfuncitem._fixtureinfo.argnames
    kwargs = {name: pyfuncitem.funcargs[name] for name in argnames}
    test = pyfuncitem.obj
    if isinstance(comm, SimWorld):
        simulate(comm.size, lambda c: test(**dict(kwargs, comm=c)))
    else:
        _agreed(MPI.COMM_WORLD, lambda: test(**kwargs))
    return True


# -- one report under mpiexec -----------------------------------------------------------------------
_failed_reports = []


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    if _with_mpi(config) and MPI.COMM_WORLD.Get_rank() != 0:
        reporter = config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


def pytest_runtest_logreport(report):
    if report.failed:
        _failed_reports.append(report)


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if not _with_mpi(config) or MPI.COMM_WORLD.Get_size() == 1:
        return
    world = MPI.COMM_WORLD
    mine = [config.hook.pytest_report_to_serializable(config=config, report=r) for r in _failed_reports]
    gathered = world.gather(mine, root=0)
    worst = world.allreduce(int(exitstatus), op=MPI.MAX)
    if world.Get_rank() == 0:
        reporter = config.pluginmanager.getplugin("terminalreporter")
        seen = {(r.nodeid, r.when) for r in _failed_reports}
        for rank, reports in enumerate(gathered[1:], start=1):
            for data in reports:
                report = config.hook.pytest_report_from_serializable(config=config, data=data)
                if (report.nodeid, report.when) in seen:
                    continue  # the same test already failed here (ranks agree on comm tests)
                seen.add((report.nodeid, report.when))
                if reporter is not None:
                    # Count the test once, as failed: drop rank 0's pass of it.
                    passed = reporter.stats.get("passed", [])
                    passed[:] = [r for r in passed if r.nodeid != report.nodeid]
                    report.nodeid = f"{report.nodeid} [rank {rank}]"
                    reporter.stats.setdefault("failed", []).append(report)
    session.exitstatus = max(worst, int(session.exitstatus))
