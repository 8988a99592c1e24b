#!/usr/bin/env bash
# CPU demo (what `make demo` runs): build the built-in corpus (Python's own docstrings), train a
# SentencePiece tokenizer and an indexed dataset with the same tools a user runs, then train a
# small GPT on 5 CPU processes with dedicated embedding stages (layout E|t*2|t*2|t*2|L),
# printing the layout, the loss, evaluations, the per-stage memory report, and a checkpoint;
# then the trained model continues a prompt in one process (tools/generate.py, no launcher).
# Extra flags are passed through to pretrain_gpt.py, e.g. `--train-iters 20`.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
DATA_DIR=${DATA_DIR:-demo_data}
SAVE_DIR=${SAVE_DIR:-checkpoints/gpt_cpu_demo}
VOCAB=${VOCAB:-1000}
NPROC=${NPROC:-5}
TRAIN_ITERS=${TRAIN_ITERS:-50}
TIMEOUT=${TIMEOUT:-1200}          # hard limit for the whole training job, in seconds
PROMPT=${PROMPT:-"Return the"}    # what the trained model continues at the end
GEN_TOKENS=${GEN_TOKENS:-40}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

mkdir -p "$DATA_DIR"
if [ ! -s "$DATA_DIR/demo_corpus.jsonl" ]; then
  "$PYTHON" -c "import sys; from megatron_ds.data.demo_corpus import write_demo_corpus; \
print(write_demo_corpus(sys.argv[1]), 'documents written to', sys.argv[1])" "$DATA_DIR/demo_corpus.jsonl"
fi
if [ ! -s "$DATA_DIR/demo.model" ]; then
  "$PYTHON" tools/train_tokenizer.py --input "$DATA_DIR/demo_corpus.jsonl" --json-keys text \
    --model-prefix "$DATA_DIR/demo" --vocab-size "$VOCAB" --model-type bpe --seed 1234
fi
if [ ! -s "$DATA_DIR/demo_text_document.idx" ]; then
  "$PYTHON" tools/preprocess_data.py --input "$DATA_DIR/demo_corpus.jsonl" --json-keys text \
    --output-prefix "$DATA_DIR/demo" --tokenizer-type SentencePieceTokenizer \
    --tokenizer-model "$DATA_DIR/demo.model" --append-eod --workers 2
fi

timeout --signal=USR1 --kill-after=30 "$TIMEOUT" \
  "$PYTHON" -m torch.distributed.run --nproc_per_node "$NPROC" --master_port "${MASTER_PORT:-29500}" \
  pretrain_gpt.py \
    --num-layers 6 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
    --max-position-embeddings 128 --hidden-dropout 0.0 --attention-dropout 0.0 \
    --pipeline-model-parallel-size 5 --pp-dedicated-embedding-stages \
    --micro-batch-size 4 --global-batch-size 32 --train-iters "$TRAIN_ITERS" \
    --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 5 --weight-decay 0.1 --clip-grad 1.0 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA_DIR/demo.model" \
    --data-path "$DATA_DIR/demo_text_document" --split 949,50,1 \
    --log-interval 5 --eval-interval 25 --eval-iters 2 \
    --save "$SAVE_DIR" --save-interval 25 --distributed-timeout-minutes 3 \
    "$@"

echo "--- the trained model continues \"$PROMPT\" (tools/generate.py: one process, KV cache, top-k sampling) ---"
"$PYTHON" tools/generate.py --load "$SAVE_DIR" --prompt "$PROMPT" --max-new-tokens "$GEN_TOKENS" \
  --temperature 0.7 --top-k 40 --seed 1234
