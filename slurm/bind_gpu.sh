#!/bin/bash
# Run "$@" on one GPU: the SLURM_LOCALID-th of the GPUs Slurm gave this node's tasks.
# Slurm lists the node's allocated GPUs in CUDA_VISIBLE_DEVICES; each rank keeps one entry, so
# CuPy's device 0 is that rank's GPU. (Every rank then sees only its own GPU, which rules out
# same-node CUDA IPC between ranks; drop this wrapper if your GPU path needs it.)
set -euo pipefail
IFS=, read -ra gpus <<< "${CUDA_VISIBLE_DEVICES:-}"
if [ "${#gpus[@]}" -eq 0 ]; then
    echo "bind_gpu.sh: CUDA_VISIBLE_DEVICES is empty: request GPUs with --gpus-per-node" >&2
    exit 2
fi
export CUDA_VISIBLE_DEVICES=${gpus[$(( ${SLURM_LOCALID:-0} % ${#gpus[@]} ))]}
exec "$@"
