#!/usr/bin/env bash
# Set up, generate a small real-text corpus, and run a short resilient GPT pretraining job in CPU
# mode (4 processes: PP 2 x DP 2) on Megatron-LM's own loop with a detection-only resilience layer,
# printing Megatron's iteration lines. The corpus is tokenized byte by byte (ids 0..255, end of
# document 256), which Megatron's NullTokenizer with a vocabulary of 257 reads as is.
# Extra arguments are passed to pretrain_gpt_resilient.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh
source scripts/python_env.sh
mkdir -p data/generated runs
[ -f data/generated/corpus.jsonl ] || python tools/make_corpus.py --output data/generated/corpus.jsonl
[ -f data/generated/pydocs_text_document.idx ] || python tools/preprocess_data.py \
    --input data/generated/corpus.jsonl --json-keys text --output-prefix data/generated/pydocs \
    --tokenizer-type ByteLevelTokenizer --append-eod --workers 2
export OMP_NUM_THREADS=1
exec python -m torch.distributed.run --standalone --nproc-per-node 4 pretrain_gpt_resilient.py \
    --device cpu --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 \
    --micro-batch-size 4 --global-batch-size 32 --train-iters 60 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine \
    --lr-warmup-iters 5 --weight-decay 0.01 --clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0 \
    --data-path data/generated/pydocs_text_document --split 98,2,0 --tokenizer-type NullTokenizer --vocab-size 257 \
    --log-interval 5 --eval-interval 30 --eval-iters 2 \
    --resihp-detect-only --resihp-event-log runs/demo_events.jsonl "$@"
