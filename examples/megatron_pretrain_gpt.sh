#!/bin/bash
# A Megatron-LM `pretrain_gpt.py` argument list, laid out as Megatron-LM's example scripts lay it
# out, given to `meshtrain train` as it is: a small GPT on the built-in corpus (or on DATA_PATH, an
# indexed dataset prefix, with GPT-2's VOCAB_FILE and MERGE_FILE), on CPU or one GPU.
#
#   bash examples/megatron_pretrain_gpt.sh [more flags]
#   DATA_PATH=data/corpus_text_document VOCAB_FILE=gpt2-vocab.json MERGE_FILE=gpt2-merges.txt \
#       bash examples/megatron_pretrain_gpt.sh --bf16
#
# Like most such scripts it leaves out dropout, weight decay, Adam's beta2, the minimum learning
# rate, the decay style and the logging and evaluation settings: a Megatron-LM command line takes
# Megatron-LM's defaults for them, and the run logs which it took (docs/training.md, "Megatron-LM
# command lines"; the table: services/trainer/config/megatron_defaults.py).
set -euo pipefail

GPT_MODEL_ARGS=(
    --num-layers 4
    --hidden-size 128
    --num-attention-heads 4
    --seq-length 128
    --max-position-embeddings 128
    --openai-gelu
)

TRAINING_ARGS=(
    --micro-batch-size 4
    --global-batch-size 16
    --train-iters 50
    --lr 6.0e-4
    --lr-warmup-iters 5
    --clip-grad 1.0
    --eval-interval 25
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
)

DATA_ARGS=()
if [[ -n "${DATA_PATH:-}" ]]; then
    DATA_ARGS=(
        --data-path "$DATA_PATH"
        --vocab-file "${VOCAB_FILE:?set VOCAB_FILE with DATA_PATH}"
        --merge-file "${MERGE_FILE:?set MERGE_FILE with DATA_PATH}"
        --split 949,50,1
    )
fi

EVAL_AND_LOGGING_ARGS=(
    --save-interval 25
    --save "${CHECKPOINT_PATH:-runs/megatron_pretrain_gpt/checkpoints}"
    --load "${CHECKPOINT_PATH:-runs/megatron_pretrain_gpt/checkpoints}"
)

meshtrain train \
    "${GPT_MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}" \
    "$@"
