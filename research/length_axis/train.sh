#!/usr/bin/env bash
# Issue 67, stage 2 (after data.sh): the learner's recipe trained on each prompt length, two seeds each, every
# run on its length's data stage (python -m research.train_lab --data: the data is only read), resumable:
#   bash research/length_axis/train.sh         (each run ~64 steps; a kill: the same command goes on)
#   LENGTHS="1k 2k" bash research/length_axis/train.sh     (only those lengths, e.g. while 4K's data is made)
#   SIDE_BY_SIDE=1 LENGTHS=1k-a256 bash research/length_axis/train.sh   (the answer length: data.sh's stage 3)
#   SIDE_BY_SIDE=1 LENGTHS=2k bash research/length_axis/train.sh   (a length's two seeds at once, one thread each)
# Memory: a ~4K run holds ~14 GB (its 16 held-out prompts' caches and a micro-batch of 8 at 4K), so ~4K's two seeds
# side by side were killed for memory on a 24 GB machine: there, run ~4K's one after the other (the default).
# A --data folder admits one run at a time (support/recipe.RunFolder.claim: a data stage may still be appending),
# so side by side, seed 1 reads a hard-linked copy of the folder: the same files, no more disk.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
train() {  # train LENGTH SEED DATA
    local out=runs/length/train-$1-s$2 resume=()
    [ -e "$out/adapter.safetensors" ] && return 0
    [ -e "$out/ckpt.pt" ] && resume=(--resume)
    python -m research.train_lab --config runs/length/train-$1.json --stage train \
        --data "$3" --out "$out" --seed "$2" "${resume[@]}"
}
for L in ${LENGTHS:-1k 2k 4k}; do
    data=runs/length/train-$L
    if [ -n "${SIDE_BY_SIDE:-}" ]; then
        [ -e "$data-s1-data" ] || cp -al "$data" "$data-s1-data"
        train "$L" 0 "$data" > "runs/length-train-$L-s0.log" 2>&1 & s0=$!
        train "$L" 1 "$data-s1-data" > "runs/length-train-$L-s1.log" 2>&1 & s1=$!
        failed=""  # each run goes on to its end whatever the other does (a kill loses a run's steps since its last save)
        wait "$s0" || failed+=" runs/length-train-$L-s0.log"
        wait "$s1" || failed+=" runs/length-train-$L-s1.log"
        [ -z "$failed" ] || { echo "error: a ~$L run failed (the same command resumes it):$failed"; exit 1; }
    else
        train "$L" 0 "$data"
        train "$L" 1 "$data"
    fi
done
echo "length-axis training: done"
