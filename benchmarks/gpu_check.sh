#!/usr/bin/env bash
# The GPU checklist of docs/gpu.md in one command, for a lent GPU machine (the device tool) or any CUDA node:
# versions, `mpidist info` under mpiexec, the collective benchmark, the GPT on the GPU, then tests/test_gpu.py on
# SimComm worlds and under mpiexec -n 2 and 4. Every step has its own time limit so that one hang cannot eat
# the lease; logs and JSON go to $OUT (default out/gpu).
#
#   OUT=out/gpu bash benchmarks/gpu_check.sh [steps...]     # steps: info bench gpt sim mpi2 mpi4 (default), mpi1, p16
#
# Wheels the machine lacks (pytest, pytest-mpi, pytest-timeout, hypothesis, ...) are read from .gpuwheels/ when
# that folder exists: they are unpacked onto PYTHONPATH, so no pip and no network is needed. Make it here first
# (pure-Python wheels; add .gpuwheels/ to .git/info/exclude and name it in the device tool's carry):
#   pip download --only-binary :all: --no-deps -d .gpuwheels pytest pytest-mpi pytest-timeout \
#       'hypothesis==6.100.0' pluggy iniconfig packaging attrs sortedcontainers pygments exceptiongroup
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
PY=${PYTHON:-python3}
SITE=$PWD/.gpusite
if [ -d .gpuwheels ]; then
  rm -rf "$SITE"; mkdir -p "$SITE"
  for w in .gpuwheels/*.whl; do "$PY" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$w" "$SITE"; done
fi
export PYTHONPATH=$SITE:$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}
# Containers often forbid the cross-memory attach Open MPI's shared-memory transport tries first.
MPIEXEC="mpiexec --oversubscribe --mca btl_vader_single_copy_mechanism none"
PYTEST="-m pytest -q -p no:cacheprovider --color=no --timeout=120 --timeout-method=thread -m gpu tests/test_gpu.py"
STEPS=${*:-info bench gpt sim mpi2 mpi4}
P16="sixteen or ring16 or 16_bit or float16_on or policy_on or bfloat16"  # issue 30's tests (16-bit floats on CuPy)

step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, print a one-line verdict
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
  tail -n 25 "$OUT/$name.log"
}

for s in $STEPS; do
  case $s in
    info)
      { nvidia-smi -L; "$PY" -c "import sys, numpy, cupy, mpi4py; print(sys.version.split()[0], 'numpy', numpy.__version__, 'cupy', cupy.__version__, 'mpi4py', mpi4py.__version__, 'cuda runtime', cupy.cuda.runtime.runtimeGetVersion())";
        ompi_info 2>/dev/null | grep -i cuda; } > "$OUT/versions.log" 2>&1
      cat "$OUT/versions.log"
      step info 45 $MPIEXEC -n 2 "$PY" -m mpidist info ;;
    bench) step bench 75 $MPIEXEC -n 2 "$PY" benchmarks/gpu_collectives.py --json "$OUT/gpu_collectives.json" ;;
    gpt) step gpt 100 "$PY" benchmarks/gpt_gpu.py --json "$OUT/gpt_gpu.json" ;;
    sim) step sim 130 "$PY" $PYTEST ;;
    mpi1) step mpi1 90 $MPIEXEC -n 1 "$PY" $PYTEST --with-mpi ;;
    mpi2) step mpi2 80 $MPIEXEC -n 2 "$PY" $PYTEST --with-mpi ;;
    mpi4) step mpi4 80 $MPIEXEC -n 4 "$PY" $PYTEST --with-mpi ;;
    p16) step p16 240 "$PY" $PYTEST -k "$P16"; step p16-mpi2 180 $MPIEXEC -n 2 "$PY" $PYTEST --with-mpi -k "$P16" ;;
    *) echo "gpu_check: unknown step '$s' (expected info bench gpt sim mpi1 mpi2 mpi4 p16)"; exit 2 ;;
  esac
done
