#!/usr/bin/env bash
# Train on 2 processes writing a sharded checkpoint, consolidate it into one file, then resume from that file
# on 1 process (plain Lightning, no flatshard strategy) and on 3 processes (flatshard) - and from the sharded
# directory itself on 3 processes.
#
#   bash examples/checkpoints/resume_elsewhere.sh [WORK_DIR] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/../.."
work=${1:-/tmp/flatshard-resume}
steps=${2:-20}
tiny=(--d-model 32 --n-layer 2 --n-head 2 --batch-size 6 --block-size 32)
mkdir -p "$work"

echo "== 1. train $steps steps on 2 processes, sharded checkpoint: $work/sharded"
python examples/gpt/train.py "${tiny[@]}" --devices 2 --max-steps "$steps" \
  --state-dict-type sharded --ckpt-out "$work/sharded"

echo "== 2. consolidate the directory into one plain Lightning checkpoint: $work/full.ckpt"
flatshard consolidate "$work/sharded" "$work/full.ckpt"
flatshard inspect "$work/full.ckpt"

echo "== 3. resume from the file on 1 process without flatshard (strategy auto), $steps more steps"
python examples/gpt/train.py "${tiny[@]}" --strategy auto --devices 1 --max-steps $((2 * steps)) \
  --resume "$work/full.ckpt"

echo "== 4. resume from the file on 3 processes with flatshard"
python examples/gpt/train.py "${tiny[@]}" --devices 3 --max-steps $((2 * steps)) --resume "$work/full.ckpt"

echo "== 5. resume from the sharded directory itself on 3 processes"
python examples/gpt/train.py "${tiny[@]}" --devices 3 --max-steps $((2 * steps)) --resume "$work/sharded"
echo "done"
