#!/usr/bin/env bash
# Issue 67, stage 3 (after train.sh): every length's adapters (two seeds each), in the
# paper's form (max-pool 7, C in every layer: the trained adapters recommend nothing beyond it), judged by answer
# KL on the held-out prompts at ~2K and ~4K (documents never trained on), each prompt's values kept for pairing:
#   bash research/length_axis/judge.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
adapters=$(ls runs/length/train-*-s*/adapter.safetensors | paste -sd,)
for H in 2k 4k; do
    python -m research.evaluate --heldout runs/length/heldout-$H --adapters "$adapters" \
        --budgets 64,128,256 --answer-kl --threads "$OMP_NUM_THREADS" --out runs/length/judge-$H
done
