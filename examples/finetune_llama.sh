#!/usr/bin/env bash
# Fine-tune a Hugging Face Llama on Alpaca-style instructions, as Megatron-DeepSpeed's
# examples_deepspeed/finetune_hf_llama/finetune_llama.sh does (T=2, P=2, bf16, micro-batch 16, global 256,
# 3500 iterations at lr 2e-5, sequence 512), in two steps:
#   1. tools/convert_checkpoint.py --from hf writes the Hugging Face weights as our checkpoint (once; in place of
#      upstream's hf2megads_weight_converter.py);
#   2. finetune_llama.py trains on the JSON of examples (docs/data.md "Supervised fine-tuning"), with the
#      architecture taken from that checkpoint (--use-checkpoint-args) and the tokenizer read from the Hugging Face
#      directory as upstream's HFTokenizer reads it.
# Then `python tools/convert_checkpoint.py --to hf "$SAVE_DIR" OUT` gives a Hugging Face directory again.
# Extra flags pass through to finetune_llama.py (e.g. --print-layout to check the line without training).
set -euo pipefail
cd "$(dirname "$0")/.."

HF_DIR=${HF_DIR:?set HF_DIR to a Hugging Face Llama directory (config.json, safetensors, tokenizer files)}
DATA_PATH=${DATA_PATH:?set DATA_PATH to a JSON list of Alpaca-style examples (instruction, input, output), e.g. alpaca_data.json}
CONVERTED=${CONVERTED:-checkpoints/$(basename "$HF_DIR")-converted}
SAVE_DIR=${SAVE_DIR:-checkpoints/$(basename "$HF_DIR")-sft}
NUM_GPUS=${NUM_GPUS:-4}
TP=${TP:-2}
PP=${PP:-2}
SEQ_LENGTH=${SEQ_LENGTH:-512}
MICRO_BATCH=${MICRO_BATCH:-16}
GLOBAL_BATCH=${GLOBAL_BATCH:-256}
TRAIN_ITERS=${TRAIN_ITERS:-3500}
PRECISION=${PRECISION:---bf16}
LAUNCHER=${LAUNCHER:-torchrun --nproc_per_node $NUM_GPUS}
TIMEOUT_MINUTES=${TIMEOUT_MINUTES:-30}

if [ ! -e "$CONVERTED/latest" ]; then
  python tools/convert_checkpoint.py --from hf "$HF_DIR" "$CONVERTED" --tensor-model-parallel-size "$TP"
fi

# shellcheck disable=SC2086  # LAUNCHER is a command line
$LAUNCHER finetune_llama.py \
  --load "$CONVERTED" --use-checkpoint-args --finetune \
  --tokenizer-type HFTokenizer --tokenizer-model "$HF_DIR" \
  --data-path "$DATA_PATH" --repeated-dataloader --split 100,0,0 \
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
  --seq-length "$SEQ_LENGTH" --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" \
  --train-iters "$TRAIN_ITERS" --lr 2e-5 --lr-decay-style cosine --lr-decay-iters 320000 --lr-warmup-iters 2000 \
  --weight-decay 0.1 --clip-grad 1 --attention-dropout 0 --hidden-dropout 0 $PRECISION \
  --log-interval 1 --eval-iters 0 --num-workers 0 \
  --save "$SAVE_DIR" --save-interval 1500 \
  --distributed-timeout-minutes "$TIMEOUT_MINUTES" \
  "$@"
