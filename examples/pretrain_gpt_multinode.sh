#!/usr/bin/env bash
# Multi-node training through DeepSpeed's launcher and a hostfile ("host slots=8" per line).
# P x T x DP must equal the total GPU count: by default 2 nodes x 8 GPUs = P 8 x DP 2.
# Extra flags pass through to pretrain_gpt.py. Layout: --pp-partition-method fastest, the split with
# the smallest simulated 1F1B step that fits the GPUs' memory; for this model at P=8 that is 3 layers
# per stage (see pretrain_gpt_1.3B.sh for the planner's comparison with dedicated embedding stages).
set -euo pipefail
cd "$(dirname "$0")/.."

HOSTFILE=${HOSTFILE:-hostfile}
NUM_NODES=${NUM_NODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-$(head -n1 "$HOSTFILE" | awk '{print $1}')}
MASTER_PORT=${MASTER_PORT:-29500}
DATA_PATH=${DATA_PATH:?set DATA_PATH}
TOKENIZER_MODEL=${TOKENIZER_MODEL:?set TOKENIZER_MODEL}
SAVE_DIR=${SAVE_DIR:-checkpoints/gpt_multinode}
PP=${PP:-8}

deepspeed --hostfile "$HOSTFILE" --num_nodes "$NUM_NODES" --num_gpus "$GPUS_PER_NODE" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" pretrain_gpt.py \
  --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 \
  --pipeline-model-parallel-size "$PP" --pp-partition-method fastest \
  --micro-batch-size 2 --global-batch-size 1024 --train-iters 100000 \
  --bf16 --zero-stage 1 --checkpoint-activations \
  --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01 --clip-grad 1.0 \
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER_MODEL" --data-path "$DATA_PATH" \
  --log-interval 10 --eval-interval 1000 --eval-iters 10 \
  --save "$SAVE_DIR" --load "$SAVE_DIR" --save-interval 1000 \
  "$@"
