#!/bin/sh
# Start or resume training under torchrun: the trainer command of compose.yaml and the Slurm job.
#
#   SAVE_ROOT=s3://meshtrain/run1/checkpoints NPROC_PER_NODE=8 deploy/train.sh --config ... [train args]
#
# Adds `--load SAVE_ROOT` when the root already holds a committed checkpoint, so a restarted
# container or a requeued (preempted) Slurm job continues where it stopped instead of
# starting over. One node: torchrun --standalone. Several: set NNODES and RDZV_ENDPOINT
# (HOST:PORT of a node of the job) for torchrun's c10d rendezvous; RDZV_ID names the job.
set -eu
: "${SAVE_ROOT:?set SAVE_ROOT to the checkpoint root (a folder or s3://bucket/prefix)}"
NPROC_PER_NODE="${NPROC_PER_NODE:-1}"

set -- --save "$SAVE_ROOT" "$@"
if meshtrain ckpt list "$SAVE_ROOT" | grep -Eq '^[0-9]+$'; then
    echo "train.sh: resuming from $SAVE_ROOT" >&2
    set -- --load "$SAVE_ROOT" "$@"
fi

if [ -n "${RDZV_ENDPOINT:-}" ]; then
    exec torchrun --nnodes="${NNODES:?set NNODES with RDZV_ENDPOINT}" --nproc-per-node="$NPROC_PER_NODE" \
        --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="${RDZV_ID:-meshtrain}" \
        -m services.cli train "$@"
fi
exec torchrun --standalone --nproc-per-node="$NPROC_PER_NODE" -m services.cli train "$@"
