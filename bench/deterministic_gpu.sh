#!/usr/bin/env bash
# engine.deterministic on the GPU: its targets in one command (8B geometry, random bf16 weights, sampled
# at temperature 0.7 / top_p 0.9, 256 new tokens; the job workload of `batchgen bench --workload job`):
#   1. identical completion token ids between max_num_seqs 16 and 256
#   2. between an uninterrupted run and one killed twice (kill -9 after a commit) and resumed
#   3. between --gpus 1 and --gpus 2 (only where the machine has two GPUs)
#   4. its cost: tok/s of the deterministic mode against the default mode at 256 sequences, same rows (A B B A;
#      COST_ROWS 0 skips it)
# Usage: bash bench/deterministic_gpu.sh [WORK_DIR] [ROWS] [COST_ROWS] [TOKENIZER_DIR]
#        (defaults: /tmp/batchgen-det 500 4000, SmolLM2's tokenizer from the embedded GGUF); PYTHON=python3 by default
# Each comparison prints "identical completions: N / N"; the script stops at the first that is not identical.
set -euo pipefail
WORK=${1:-/tmp/batchgen-det}
ROWS=${2:-500}
COST_ROWS=${3:-4000}
TOK=(); [ -n "${4:-}" ] && TOK=(--tokenizer "$4")
PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
COMPARE="$PY $HERE/compare_outputs.py --require-identical"
KEEP=(--job-set output.keep_token_ids=true)
batchgen() { "$PY" -m batchgen.cli "$@"; }
mkdir -p "$WORK"

echo "== 1. deterministic mode at max_num_seqs 16 and 256 ($ROWS rows)"
batchgen bench --workload job "${TOK[@]}" --rows "$ROWS" --seqs 16,256 --penalties 1.0 --profile-steps 0 --work-dir "$WORK" \
  --job-set engine.deterministic=true "${KEEP[@]}" --json "$WORK/det-16-256.json"
$COMPARE "$WORK/out-16-1.0" "$WORK/out-256-1.0"

echo "== 2. killed twice and resumed, against the uninterrupted run (max_num_seqs 256)"
RUN=(batchgen run "$WORK/job.yaml" -o "$WORK/out-killed" --no-progress --deterministic
     --set engine.max_num_seqs=256 --set output.keep_token_ids=true --set output.rows_per_shard=50)
rm -rf "$WORK/out-killed"
BATCHGEN_FAULT=commit_done:2 "${RUN[@]}" || echo "(killed, as intended)"
BATCHGEN_FAULT=commit_done:3 "${RUN[@]}" || echo "(killed, as intended)"
"${RUN[@]}"
$COMPARE "$WORK/out-256-1.0" "$WORK/out-killed"

if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  echo "== 3. --gpus 2 against --gpus 1 (max_num_seqs 256)"
  rm -rf "$WORK/out-2gpus"
  batchgen run "$WORK/job.yaml" -o "$WORK/out-2gpus" --no-progress --deterministic --gpus 2 \
    --set engine.max_num_seqs=256 --set output.keep_token_ids=true
  $COMPARE "$WORK/out-256-1.0" "$WORK/out-2gpus"
else
  echo "== 3. skipped: one GPU here (run this script on a two-GPU machine for --gpus 2)"
fi

if [ "$COST_ROWS" -gt 0 ]; then
  echo "== 4. cost: default (A) vs deterministic (B), $COST_ROWS rows at 256 sequences, A B B A (see B/A)"
  batchgen bench --workload job "${TOK[@]}" --rows "$COST_ROWS" --seqs 256 --penalties 1.0 --profile-steps 0 \
    --work-dir "$WORK" --ab-set engine.deterministic=true --json "$WORK/cost.json"
fi
