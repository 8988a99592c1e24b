#!/usr/bin/env bash
# GPT-3 1.3B on one 8-GPU node: P=8, bf16, ZeRO-1, through DeepSpeed's launcher. Extra flags pass
# through to pretrain_gpt.py.
# Layout: --pp-partition-method fastest (the split with the smallest simulated 1F1B step whose stages
# fit the GPU's memory). `python -m megatron_ds.plan pipeline --num-layers 24 --hidden-size 2048
# --num-attention-heads 16 --seq-length 2048 --vocab-size 32000 --num-gpus 8 --gpu A100-80GB
# --global-batch-size 512 --micro-batch-size 2 --pipeline-model-parallel-size 8 --zero-stage 1
# --checkpoint-activations` picks 3 layers on every stage (Et*3|...|t*3L): simulated step 1.246 x the
# ideal, against 1.275 for dedicated embedding stages (E|t*4 x6|L), whose two end stages hold no layer
# (a 32000 x 2048 embedding is 65M parameters, a layer 50M) and sit mostly idle. A different
# pipeline size or model gets its own fastest split.
set -euo pipefail
cd "$(dirname "$0")/.."

DATA_PATH=${DATA_PATH:?set DATA_PATH to a <prefix>_text_document made by tools/preprocess_data.py}
TOKENIZER_MODEL=${TOKENIZER_MODEL:?set TOKENIZER_MODEL to a SentencePiece .model}
SAVE_DIR=${SAVE_DIR:-checkpoints/gpt_1.3B}
NUM_GPUS=${NUM_GPUS:-8}
MICRO_BATCH=${MICRO_BATCH:-2}
GLOBAL_BATCH=${GLOBAL_BATCH:-512}
TRAIN_ITERS=${TRAIN_ITERS:-143000}
TIMEOUT_MINUTES=${TIMEOUT_MINUTES:-30}

deepspeed --num_gpus "$NUM_GPUS" pretrain_gpt.py \
  --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 \
  --max-position-embeddings 2048 --init-method-std 0.013 \
  --pipeline-model-parallel-size "$NUM_GPUS" --pp-partition-method fastest \
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS" \
  --bf16 --zero-stage 1 --checkpoint-activations \
  --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01 \
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 \
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER_MODEL" \
  --data-path "$DATA_PATH" --split 949,50,1 \
  --log-interval 10 --eval-interval 1000 --eval-iters 10 \
  --save "$SAVE_DIR" --load "$SAVE_DIR" --save-interval 1000 \
  --distributed-timeout-minutes "$TIMEOUT_MINUTES" \
  "$@"
