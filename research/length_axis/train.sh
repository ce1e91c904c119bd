#!/usr/bin/env bash
# Issue 67, stage 2 (after data.sh): the learner's recipe trained on each prompt length, two seeds each, every
# run on its length's data stage (python -m research.train_lab --data: the data is only read), resumable:
#   bash research/length_axis/train.sh         (each run ~64 steps; a kill: the same command goes on)
#   LENGTHS="1k 2k" bash research/length_axis/train.sh     (only those lengths, e.g. while 4K's data is made)
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
for L in ${LENGTHS:-1k 2k 4k}; do
    for seed in 0 1; do
        out=runs/length/train-$L-s$seed
        [ -e "$out/adapter.safetensors" ] && continue
        resume=(); [ -e "$out/ckpt.pt" ] && resume=(--resume)
        python -m research.train_lab --config runs/length/train-$L.json --stage train \
            --data runs/length/train-$L --out "$out" --seed "$seed" "${resume[@]}"
    done
done
echo "length-axis training: done"
