#!/usr/bin/env bash
# Issue 78 item 5: the held-out judge at ~4K x 48 prompts, its peak memory measured. Before issue 78 the judge kept
# every prompt's KV cache in memory and was killed at 15.7 GB on this 24 GB machine; research.harness now keeps
# them in OUT/heldout and reads one back at a time (harness.OnDisk), and prints its expected peak before it starts.
#   bash research/long_prompts/judge_memory.sh     (resumable: rerun after a kill)
# 1. the ~4K held-out set (48 prompts of 3072-4096 tokens, the base model's greedy answers up to 128 tokens), the
#    length axis's own (research/length_axis/data.sh heldout-4k; skipped when made);
# 2. the judge as research/length_axis/judge.sh runs it (--budgets 64,128,256 --answer-kl), on the shipped adapter
#    and the untrained module, under GNU time: its "Maximum resident set size" is the peak, printed at the end.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
bash research/length_axis/data.sh heldout-4k
out=runs/long-prompts/judge-4k
mkdir -p runs/long-prompts
# a finished run's tables are kept under another name (evaluate.py refuses to write over them); a rerun after a
# kill resumes from what the first one logged (its peak then is the rerun's, not the whole judge's)
for f in heldout.json heldout.md; do
    if [ -e "$out/$f" ]; then mv "$out/$f" "$out/${f%.*}-before-$(date +%Y%m%d-%H%M%S).${f##*.}"; fi
done
/usr/bin/time -v -o runs/long-prompts/judge-4k.time python -m research.evaluate --heldout runs/length/heldout-4k \
    --adapters weights/SmolLM2-135M-Instruct.lookahead.safetensors --untrained --budgets 64,128,256 --answer-kl \
    --threads "$OMP_NUM_THREADS" --out "$out"
grep -E "Maximum resident set size|Elapsed \(wall clock\)" runs/long-prompts/judge-4k.time
