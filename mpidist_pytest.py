"""pytest entry point for mpidist's simulated worlds (``pytest --sim-world 4``; see mpidist/comm/sim/pytest_plugin.py).

It sits outside the ``mpidist`` package on purpose: pytest loads every installed plugin at start-up, and importing
anything inside ``mpidist`` imports the package, mpi4py and so MPI itself. A pytest run that does not ask for
``--sim-world`` only gets the option added here.
"""

SIM_WORLD_OPTION = "--sim-world"


def pytest_addoption(parser):
    parser.getgroup("mpidist").addoption(
        SIM_WORLD_OPTION, default=None, metavar="SIZES",
        help="run tests marked mpi (pytest-mpi) on simulated worlds of these sizes in this process, "
             "e.g. 4 or 1,2,4 (mpidist's simulator; no mpiexec)")


def pytest_configure(config):
    if config.getoption("sim_world", None) is None:
        return
    from mpidist.comm.sim import pytest_plugin  # only now: the simulator, mpidist and mpi4py
    pytest_plugin.pytest_configure(config)
