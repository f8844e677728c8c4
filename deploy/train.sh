#!/bin/sh
# Start or resume training under torchrun: the trainer command of compose.yaml and the Slurm job.
#
#   SAVE_ROOT=s3://meshtrain/run1/checkpoints NPROC_PER_NODE=8 deploy/train.sh --config ... [train args]
#
# Adds `--load SAVE_ROOT --ckpt-step LATEST` when the root already holds a committed
# checkpoint, so a restarted container or a requeued (preempted) Slurm job continues where it
# stopped instead of starting over. These go after the caller's arguments, so the run's own
# checkpoints win over a `--load` it was started from (e.g. pretrained weights). A root that
# cannot be listed (storage down, bad keys) stops the job: starting over would lose the run.
# A root that takes no write (an object store without a writable volume, a read-only or full
# disk, keys without write access) stops it with exit status 74, like a run whose saves keep
# failing (`meshtrain train` exits 74 then): started again by compose's restart policy or a
# requeue, the run would otherwise train up to its first save again, fail there, and so on
# forever. CHECK_SAVE_ROOT=0 skips that write probe (e.g. keys that may only read, where the
# checkpoint service alone writes).
# TRAIN_ARGS adds training options from the environment, split at spaces (compose passes it:
# TRAIN_ARGS="--train.train_iters=1000 --optim.lr=3e-4"). One node: torchrun --standalone. Several: set NNODES and RDZV_ENDPOINT (HOST:PORT of a node
# of the job) for torchrun's c10d rendezvous; RDZV_ID names the job.
set -eu
: "${SAVE_ROOT:?set SAVE_ROOT to the checkpoint root (a folder or s3://bucket/prefix)}"
NPROC_PER_NODE="${NPROC_PER_NODE:-1}"
# On SIGTERM torchrun forwards it to the ranks, which checkpoint and exit 0, but by default it
# SIGKILLs them 30 s later, mid-save for any model that is not tiny. Our callers grant more:
# compose's stop_grace_period is 180 s, Slurm's --signal=B:TERM@120 leaves 120 s. 170 s stays
# inside compose's grace (torchrun, not Docker, does the killing and reports it); on Slurm the
# time limit ends the job first. A torch that predates the variable ignores it (30 s).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-170}"

# shellcheck disable=SC2086  # split on purpose: one option per word
[ -n "${TRAIN_ARGS:-}" ] && set -- "$@" ${TRAIN_ARGS}

if ! steps=$(meshtrain ckpt list --allow-empty "$SAVE_ROOT"); then
    echo "train.sh: cannot list $SAVE_ROOT; not starting (the run would start over)" >&2
    exit 1
fi
if [ "${CHECK_SAVE_ROOT:-1}" = 1 ] && ! "${PYTHON:-python}" -m meshtrain.services.checkpoint.write_probe "$SAVE_ROOT"; then
    echo "train.sh: $SAVE_ROOT takes no write; not starting (exit status 74: checkpoint storage failed)" >&2
    exit 74
fi
set -- "$@" --save "$SAVE_ROOT"
latest=$(printf '%s\n' "$steps" | grep -E '^[0-9]+$' | sort -n | tail -n 1 || true)
if [ -n "$latest" ]; then
    echo "train.sh: resuming from $SAVE_ROOT step $latest" >&2
    set -- "$@" --load "$SAVE_ROOT" --ckpt-step "$latest"
fi

if [ -n "${RDZV_ENDPOINT:-}" ]; then
    exec torchrun --nnodes="${NNODES:?set NNODES with RDZV_ENDPOINT}" --nproc-per-node="$NPROC_PER_NODE" \
        --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="${RDZV_ID:-meshtrain}" \
        -m meshtrain.services.cli train "$@"
fi
exec torchrun --standalone --nproc-per-node="$NPROC_PER_NODE" -m meshtrain.services.cli train "$@"
