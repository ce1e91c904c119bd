#!/usr/bin/env bash
# Issue 67, stage 1: the data of the training-length axis, every step resumable (rerun the same command after a
# kill: train.py's data stage appends to each OUT/data.jsonl until it holds what the recipe asks).
#   bash research/length_axis/data.sh            (one thread; ~4 hours here in all, disk ~45 GB in bf16)
#   bash research/length_axis/data.sh NAME       (one set alone, e.g. heldout-4k)
# 1. Held-out judges: 48 prompts of the held-out split at ~2K (1536-2048 tokens) and at ~4K (3072-4096), with the
#    base model's greedy answers up to 128 tokens (as RESULTS 3's held-out set): runs/length/heldout-2k, -4k.
#    (n_train 1: train.py's data stage makes at least one training row; the judge reads only the held-out ones.)
# 2. The learner's recipe (research/configs/train-quick.json: 256 prompts, 16 held-out, answers up to 64 tokens,
#    the same tasks and seed) with its prompt lengths moved: 1K = 768-1024, 2K = 1536-2048, 4K = 3072-4096 tokens
#    (each band [3/4 L, L]; long_frac 0 as the learner's). A 4K sample is ~94 MB (bf16): ~24 GB for 4K's 256.
# 3. The answer length: ~1K's recipe with answers up to 256 tokens (runs/length/train-1k-a256, ~6 GB).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p runs/length
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
only=${1:-}  # a name (e.g. heldout-4k): that set's data alone (research/long_prompts/judge_memory.sh)
run() {  # run NAME JSON-OVERRIDES: write the config once (kept as it was when the run began), then the data stage
    local name=$1 cfg=runs/length/$1.json
    if [ -n "$only" ] && [ "$only" != "$name" ]; then return 0; fi
    [ -e "$cfg" ] || python - "$cfg" "$2" <<'PY'
import json, sys
base = json.load(open("research/configs/train-quick.json"))
json.dump({**base, **json.loads(sys.argv[2])}, open(sys.argv[1], "w"), indent=1)
PY
    # no --resume: a data stage goes on from the rows OUT holds by itself (train.py refuses --resume with it)
    python train.py --config "$cfg" --out "runs/length/$name" --stage data
}
run heldout-2k '{"n_train": 1, "n_heldout": 48, "min_tokens": 1536, "max_tokens": 2048, "max_new_tokens": 128, "seed": 67}'
run heldout-4k '{"n_train": 1, "n_heldout": 48, "min_tokens": 3072, "max_tokens": 4096, "max_new_tokens": 128, "seed": 67}'
run train-1k '{"min_tokens": 768, "max_tokens": 1024}'
run train-2k '{"min_tokens": 1536, "max_tokens": 2048}'
run train-4k '{"min_tokens": 3072, "max_tokens": 4096}'
# 3. The answer length: ~1K's recipe (the same prompts: same seed and band) with answers up to 256 tokens, not 64.
run train-1k-a256 '{"min_tokens": 768, "max_tokens": 1024, "max_new_tokens": 256}'
echo "length-axis data: done${only:+ ($only)}"
