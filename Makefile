# mpidist: `make test` and `make demo` set up everything they need in .venv (pip wheels only).
PYTHON   ?= python3
VENV     ?= .venv
PY       := $(VENV)/bin/python
MPIEXEC  := $(VENV)/bin/mpiexec
NP       ?= 4
STRATEGY ?= ddp
DEMO_ARGS ?=
# MPI=wheel installs the MPICH wheel from PyPI; MPI=system builds mpi4py against the mpicc on PATH.
MPI      ?= wheel
PYTEST_MPI := -m pytest -q --with-mpi -p no:cacheprovider --timeout=300 --timeout-method=thread

ifeq ($(MPI),system)
MPIEXEC  := mpiexec
MPI_PKGS := --no-binary mpi4py mpi4py
else
MPI_PKGS := mpich
endif

.PHONY: venv test test-sim test-mpi demo bench clean test-slurm bench-plot

# One marker per MPI choice: switching MPI= (or changing the package metadata) rebuilds the venv from
# scratch, so an mpi4py built for one MPI never runs against the other's libraries or mpiexec.
$(VENV)/.installed-$(MPI): setup.cfg pyproject.toml
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,examples]' $(MPI_PKGS)
	touch $@

venv: $(VENV)/.installed-$(MPI)

test: test-sim test-mpi

test-sim: venv
	$(PY) -m pytest -q -p no:cacheprovider --timeout=300 --timeout-method=thread

test-mpi: venv
	$(MPIEXEC) -n 2 $(PY) $(PYTEST_MPI)
	$(MPIEXEC) -n 4 $(PY) $(PYTEST_MPI)

demo: venv
	$(MPIEXEC) -n $(NP) $(PY) examples/digits.py --strategy $(STRATEGY) $(DEMO_ARGS)

bench: venv
	$(MPIEXEC) -n 2 $(PY) benchmarks/collectives.py

# A private single-node Slurm on loopback runs slurm/*.sbatch for real (installs Debian's Slurm if missing; root).
test-slurm: venv
	$(PY) tests/slurm/run_slurm_checks.py

# The table and plot in docs/cluster.md (installs the plot extra, matplotlib, first).
bench-plot: venv
	$(PY) -m pip install -q --disable-pip-version-check -e '.[plot]'
	OMP_NUM_THREADS=1 $(MPIEXEC) -n 2 $(PY) -m mpidist bench allreduce allgather reduce_scatter alltoall bcast sendrecv \
		--sizes 8:64M --plot docs/bench.png --json docs/bench.json

clean:
	rm -rf $(VENV) build *.egg-info
