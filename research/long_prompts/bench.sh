#!/usr/bin/env bash
# Issue 78: our prefill against transformers' at every length a user meets, and what eviction costs and buys at
# 8K, each table's rows kept in runs/long-prompts/*.json (bench.py --json adds each row as it is measured; a
# killed run keeps them). Timings need the machine to themselves: run it when no data job or suite runs.
#   bash research/long_prompts/bench.sh            # every step, ~40 min on this 2-core machine
#   STEPS="hf16k" bash research/long_prompts/bench.sh   # some of them: hf (1K-8K), hf16k, overhead8k, decode8k
set -euo pipefail
cd "$(dirname "$0")/../.."
out=runs/long-prompts
mkdir -p "$out"
steps=${STEPS:-"hf hf16k overhead8k decode8k"}
common=(--threads 1 --clock cpu --repeats 3)
for step in $steps; do
    case $step in
    hf)  # SmolLM2-135M, 1K-8K: ours / transformers' (SDPA), time and peak memory
        python -m research.bench --mode prefill-vs-hf --lengths 1024,2048,4096,8192 "${common[@]}" \
            --json "$out/prefill-vs-hf.json" ;;
    hf16k)  # 16K on a random-init Llama of SmolLM2's widths, 8 layers, a 32K context: the same weights both sides
        python -m research.bench --mode prefill-vs-hf --random-init research/configs/llama-small-32k.json \
            --lengths 16384 "${common[@]}" --json "$out/prefill-vs-hf-16k.json" ;;
    overhead8k)  # the one-pass default's whole-prefill overhead beside FullKV's (8,160 + its 32 rows = 8,192)
        python -m research.bench --mode overhead --lengths 8160 --budget 128 "${common[@]}" \
            --methods full,lookahead --json "$out/overhead-8k.json" ;;
    decode8k)  # decode tokens/s on the evicted cache (C = 128) against FullKV's, batch 1
        python -m research.bench --mode decode --lengths 8160 --budget 128 --methods lookahead --batches 1 \
            "${common[@]}" --json "$out/decode-8k.json" ;;
    *) echo "error: unknown step $step (hf, hf16k, overhead8k, decode8k)" >&2; exit 1 ;;
    esac
done
