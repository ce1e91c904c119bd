#!/usr/bin/env bash
# Issue 67, stage 4 (after judge.sh): the paired comparisons of the training-length axis, in the paper's form, on
# each held-out set (runs no model; each table: answer KL per C, b - a with its 95% paired bootstrap interval):
#   bash research/length_axis/report.sh            (LENGTHS="1k 2k" while 4K's adapters are not trained)
# 1. each longer length against the shortest (the two seeds of each averaged per prompt);
# 2. each length (its seeds averaged) against the shipped adapter's weights, in the same form;
# 3. the answer length, once its adapters are trained: ~1K's recipe with answers up to 64 (a) against 256 tokens (b).
set -euo pipefail
cd "$(dirname "$0")/../.."
read -r -a lengths <<< "${LENGTHS:-1k 2k 4k}"
seeds() { echo "runs/length/train-$1-s0/adapter.safetensors,runs/length/train-$1-s1/adapter.safetensors"; }
paired() { python research/analysis/paired_heldout.py --row lookahead-paper --heldout "$@"; }
for H in 2k 4k; do
    [ -e "runs/length/judge-$H/heldout.json" ] || { echo "runs/length/judge-$H: not judged yet"; continue; }
    echo "## held-out prompts at ~$H"
    for L in "${lengths[@]:1}"; do
        echo "### trained at ${lengths[0]} (a) against $L (b)"
        paired "runs/length/judge-$H" --a "$(seeds "${lengths[0]}")" --b "$(seeds "$L")"
    done
    for L in "${lengths[@]}"; do
        echo "### the shipped adapter's weights (a) against trained at $L (b)"
        paired "runs/length/judge-$H" --a runs/length/shipped-paper-form.safetensors --b "$(seeds "$L")"
    done
    if [ -e runs/length/train-1k-a256-s1/adapter.safetensors ]; then
        echo "### answers up to 64 tokens (a) against up to 256 (b), both ~1K's recipe"
        paired "runs/length/judge-$H" --a "$(seeds 1k)" --b "$(seeds 1k-a256)"
    fi
done
