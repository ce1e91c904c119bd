#!/usr/bin/env bash
# Issue 67, stage 3 (after train.sh): every length's adapters (two seeds each), in the
# paper's form (max-pool 7, C in every layer: the trained adapters recommend nothing beyond it), judged by answer
# KL on the held-out prompts at ~2K and ~4K (documents never trained on), each prompt's values kept for pairing:
#   bash research/length_axis/judge.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
# the shipped adapter beside them: its weights with a .json that recommends nothing, so that only its paper's-form
# rows run (harness.compare measures every adapter in the paper's form; the shipped .json's span rule and
# per-layer budgets would add rows this comparison does not read)
shipped=runs/length/shipped-paper-form.safetensors
if [ ! -e "$shipped" ]; then
    cp weights/SmolLM2-135M-Instruct.lookahead.safetensors "$shipped"
    python - "$shipped" <<'PY'
import json, sys
from pathlib import Path
src, dst = Path("weights/SmolLM2-135M-Instruct.lookahead.json"), Path(sys.argv[1]).with_suffix(".json")
meta = json.loads(src.read_text())
json.dump({k: v for k, v in meta.items() if k not in ("rule", "layer_weights")}, open(dst, "w"), indent=2)
PY
fi
adapters=$(ls runs/length/train-*-s*/adapter.safetensors | paste -sd,),$shipped
stamp=$(date +%Y%m%d-%H%M%S)
for H in 2k 4k; do
    # an earlier run's tables (fewer adapters) are kept under another name: evaluate.py refuses to write over them,
    # and its prompt log keeps every module's prompts, so only the new adapters are measured
    for f in heldout.json heldout.md; do
        if [ -e "runs/length/judge-$H/$f" ]; then
            mv "runs/length/judge-$H/$f" "runs/length/judge-$H/${f%.*}-before-$stamp.${f##*.}"
        fi
    done
    python -m research.evaluate --heldout runs/length/heldout-$H --adapters "$adapters" \
        --budgets 64,128,256 --answer-kl --threads "$OMP_NUM_THREADS" --out runs/length/judge-$H
done
