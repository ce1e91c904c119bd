"""
Train the lookahead module (M embeddings + a LoRA on their rows) with the paper's KL loss, the base
model frozen: the module learns to attend to the prompt the way the model's own answer will.

A recipe is a JSON file of TrainConfig fields (below); a flag overrides its file, the file the defaults.
CPU recipe, the shipped adapter (2 cores, float32; RESULTS.md says how long it took; after a kill, rerun
the same command with --resume: the data stage keeps what it wrote, the checkpoint has the optimiser):
    python train.py --config research/configs/train-cpu.json --out runs/cpu \\
        --adapter-out weights/SmolLM2-135M-Instruct.lookahead.safetensors
(the LoRA on all seven projections, --targets all; with --targets q_proj,k_proj: the adapter shipped before
it, weights/SmolLM2-135M-Instruct.lookahead-qk.safetensors), then a fine-tune on copy-heavy prompts (--init,
RESULTS.md section 8), then the adapter's per-layer weights, measured on the first 32 training samples of
OUT (where its choice decides the answer; RESULTS.md section 4.4) and written into its .json:
    python train.py --stage budgets --out runs/cpu --adapter-out weights/SmolLM2-135M-Instruct.lookahead.safetensors
(the adapter measured: --init, default the shipped weights/<model>.lookahead.safetensors).
One GPU, paper-like scale (the prompt caches recomputed in the step instead of kept on disk, which
would take ~430 GB here: research/configs/train-gpu.json's store_dtype "none"; RESULTS.md section 5):
    python train.py --config research/configs/train-gpu.json --out runs/gpu --adapter-out runs/gpu/adapter.safetensors
Several GPUs (data parallel: each rank takes every world_size-th micro-batch; build the samples first):
    python train.py --config research/configs/train-gpu.json --out runs/gpu --stage data && \\
        torchrun --nproc_per_node=8 train.py --config research/configs/train-gpu.json --out runs/gpu --stage train
CPU smoke run (a few minutes on 2 cores):
    python train.py --out runs/smoke --n-train 8 --n-heldout 4 --max-tokens 600 --max-new-tokens 32 --batch 4 --epochs 1

It prints progress bars (answering prompts; training, with the step's loss and samples/s), and at step 0
and every --eval-every steps one line of the held-out check (harness.heldout_line): KL(gt || pred) and
recall@C (C = the config's budget, 128) of the adapter as it selects and unpooled, SnapKV, H2O and
StreamingLLM; the same numbers go to OUT/log.jsonl. At the end: where the adapter was saved. --stage
budgets prints one line per group of layers (layers, answer-KL gain, weight). Ctrl-C prints the
command that resumes. Two `warning:` lines, neither of which stops the run: --stage train on fewer samples
than the recipe's n_train (a data stage stopped part way?), and, on a CPU, a machine left with less than half
of the first step's memory (the OOM killer ends a run without a line of its own). The held-out tables of
adapters side by side: python -m research.evaluate --heldout.

Stages, each resumable (rerun the same command; --resume for the optimiser state: the checkpoint records the
settings that define the run, RESUME_KEYS, and a resume with any other is refused, as is a run without --resume
into an OUT that holds another run's checkpoint):
1. data (`build_dataset`): prompts from offline sources (data.py), prefilled ONCE, B at a time
   (`answer_and_target`): the base model's greedy answer on that full cache, and the target summed while
   the answer is decoded: per layer and query head, the mean attention of the answer's tokens over the
   prompt (R x S, never S x S; no second forward over the answer). The prompt's cache (bfloat16) and the
   target are kept on disk, one file per sample (OUT/samples), the rows in OUT/data.jsonl: every epoch
   reuses them, nothing is prefilled twice. With --group N (research/configs/train-cpu-5k.json), most training
   prompts come N to a shared context (data.make_training_groups): the context is prefilled once, decoding
   reads its cache once for the N answers (SharedPrefixAttention), and its cache is stored once; a prompt
   then costs about a fifth of what it costs alone (RESULTS.md section 8).
2. train: B cached samples at a time, left-padded into one batch (data.load_batch); the M
   lookahead tokens run on top of their caches with gradients (only they carry any: the
   two-pass form), their mean attention over the prompt is the prediction; loss = lookaheadkv.kl_loss
   (--loss-weights, beyond the paper: extensions/layer_loss.py weighs the layers by the answer's use).
3. budgets (not part of --stage all): extensions/layer_budgets.measure on an adapter.
"""

import argparse
import dataclasses
import json
import math
import os
import random
import shlex
import shutil
import sys
import tempfile
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from support import cli
from support import data
from research import harness
import methods
from support.data import load_batch, sample_bytes, sample_ok, sample_path, save_sample, unreadable_sample
from eviction import EvictConfig, compress, decode_step
from extensions import layer_budgets, layer_loss
from lookaheadkv import LookaheadModule, kl_loss, lookahead_pass
from model import Hook, KVCache, ModelConfig, default_dtype
from weights.checks import read_json

# -----------------------------------------------------------------------------
# Settings: a recipe file (--config) holds any of these; a flag overrides it


@dataclasses.dataclass
class TrainConfig:
    # where
    model: str | None = None  # --model: HF folder of the base model (None: weights/SmolLM2-135M-Instruct)
    out: str = "runs/lookahead"  # --out: the run's folder (data.jsonl, samples/, heldout/, ckpt.pt, log.jsonl)
    adapter_out: str | None = None  # --adapter-out: the adapter, .safetensors + .json (None: OUT/adapter.safetensors)
    stage: str = "all"  # --stage: data | train (on the samples OUT holds, read only) | budgets | all (data + train)
    data: str | None = None  # --data: with --stage train (or budgets), the folder whose samples it reads (another
    # run's data stage: the learning curve's adapters share one); None: OUT's own. OUT keeps checkpoint, log, table
    train_rows: int | None = None  # --train-rows: train on about this many of the training rows (whole groups,
    # a seeded draw: each smaller draw inside the larger ones; RESULTS.md's learning curve); None: all of them
    # data: the prompts and the base model's answers
    n_train: int = 800  # --n-train: training prompts
    n_heldout: int = 32  # --n-heldout: held-out prompts (other documents) for the periodic check
    min_tokens: int = 512  # shortest prompt, in tokens
    max_tokens: int = 2048  # --max-tokens: longest prompt, but for a long_frac share
    long_frac: float = 0.1  # share of prompts longer than max_tokens, up to long_max
    long_max: int = 4096  # longest of the long prompts
    copy_frac: float | None = None  # share of training prompts whose answer copies a span (data.COPY_TASKS;
    # None: the task weights, about a third); the held-out prompts keep the default mix
    group: int = 1  # --group: training prompts per shared context (data.make_training_groups: the context's
    # prefill, cache and disk are paid once per group); 1: each prompt its own context (make_training_prompts)
    first_frac: float = 0.15  # with group > 1: the share of training prompts that open with their instruction
    max_new_tokens: int = 256  # --max-new-tokens: length cap of the base model's answers (paper: 512)
    gen_batch: int | None = None  # prompts answered together (None: 32 on CUDA, 8 on CPU)
    store_dtype: str = "bfloat16"  # dtype of the prompt caches kept on disk: bfloat16 | float16 | float32 | none
    # (none: only the targets; each step recomputes its prompts' caches: a GPU's choice, 7.6x slower on a CPU)
    store_gb: float = 40.0  # refuse to build samples that would take more disk than this (GiB)
    # the module
    n_tokens: int = 32  # M, lookahead tokens
    rank: int = 8  # LoRA rank r
    alpha: float = 32.0  # LoRA alpha (the delta is scaled by alpha / r)
    targets: str = "all"  # --targets: LoRA targets: all (the seven projections), a comma list, or none
    rule: str = "span:8:1024"  # the selection rule the adapter's .json names (methods.parse_rule; RESULTS.md 4.2)
    init: str | None = None  # --init: start from this adapter (its M, rank, targets), new optimiser and schedule
    loss_weights: str | None = None  # --loss-weights: an adapter's .json whose layer_weights weigh each layer's KL
    # (extensions/layer_loss.py, beyond the paper); None: the paper's loss, every layer the same
    # optimisation
    epochs: float = 3.0  # --epochs: passes over the training rows (a fraction ends mid-pass)
    batch: int = 32  # --batch: samples per optimiser step, all ranks
    micro_batch: int = 8  # --micro-batch: samples in one lookahead forward (left-padded together)
    lr: float = 1e-3  # --lr: peak learning rate (AdamW)
    weight_decay: float = 0.0  # AdamW weight decay
    warmup: float = 0.02  # share of steps with linear warmup, then cosine to 0
    clip: float = 1.0  # gradient norm clip
    # the held-out check, checkpoints, time
    budget: int = 128  # C of the held-out recall (and of --stage budgets)
    window: int = 32  # the held-out SnapKV / H2O rows: last prompt tokens always kept
    eval_every: int = 10  # --eval-every: optimiser steps between held-out checks
    save_every: int = 10  # --save-every: optimiser steps between checkpoints (OUT/ckpt.pt)
    resume: bool = False  # --resume: continue from OUT/ckpt.pt
    max_minutes: float | None = None  # --max-minutes: stop training (checkpoint + adapter saved) after this long
    # the machine
    device: str | None = None  # --device: cpu, cuda, cuda:1 (None: cuda if there is one)
    dtype: str | None = None  # --dtype: base model dtype, float32 | bfloat16 (None: bfloat16 on CUDA, float32
    # on CPU); the module trains in float32
    seed: int = 0  # --seed: prompts, init, batch order


STAGES = ("data", "train", "budgets", "all")
STORE_DTYPES = ("bfloat16", "float16", "float32", "none")
BUDGET_SAMPLES = 32  # --stage budgets measures on this many training samples


def get_args(argv=None):
    """The run's TrainConfig: flag > --config file > default."""
    flags = vars(parser().parse_args(argv))
    path = flags.pop("config", None)
    return dataclasses.replace(TrainConfig(), **{**(read_config(path) if path else {}), **flags})


def flag_of(key):
    """How a TrainConfig field is given: its flag (--micro-batch) if it has one, else its --config key (warmup)."""
    flag = "--" + key.replace("_", "-")
    return flag if flag in parser()._option_string_actions else key


def parser():
    D = TrainConfig()
    p = cli.Parser("train.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                argument_default=argparse.SUPPRESS)
    a = p.add_argument
    a("--config", metavar="JSON", help="a recipe: a JSON object of TrainConfig fields, e.g. research/configs/train-cpu.json")
    a("--model", help="HF folder of the base model (default: weights/SmolLM2-135M-Instruct)")
    a("--out", help=f"the run's folder: data.jsonl, samples, checkpoint, log (default {D.out})")
    a("--adapter-out", help="where the adapter goes, a .safetensors name (its .json beside it; default "
      "OUT/adapter.safetensors); one there already is kept as NAME.prev.safetensors, or NAME.prev2 (3, ...) when "
      "that name is taken: an earlier backup is never replaced")
    a("--stage", choices=STAGES, help="data: build OUT's samples; train: train on them (read only); budgets: "
      "measure an adapter's per-layer weights on them into --adapter-out; all (default): data, then train")
    a("--data", metavar="DIR", help="--stage train or budgets: read the samples of this data-stage folder instead "
      "of OUT's (it is only read, but for its held-out ground truth cache); OUT keeps checkpoint, log, adapter")
    a("--train-rows", type=int, metavar="N", help="--stage train: about N of the training rows (whole groups, "
      "a seeded draw: a smaller N's rows are inside a larger N's); default all")
    a("--n-train", type=int, help=f"training prompts (default {D.n_train})")
    a("--n-heldout", type=int, help=f"held-out prompts for the periodic check (default {D.n_heldout})")
    a("--group", type=int, help=f"training prompts per shared context (default {D.group}: none shared)")
    a("--max-tokens", type=int, help=f"longest prompt, in tokens (default {D.max_tokens})")
    a("--max-new-tokens", type=int, help=f"length cap of the base model's answers (default {D.max_new_tokens})")
    a("--epochs", type=float, help=f"passes over the training rows (default {D.epochs:g})")
    a("--batch", type=int, help=f"samples per optimiser step, all ranks (default {D.batch})")
    a("--micro-batch", type=int, help=f"samples per lookahead forward (default {D.micro_batch})")
    a("--lr", type=float, help=f"peak learning rate (default {D.lr:g})")
    a("--targets", help="LoRA targets: all (default), none, or a comma list of q,k,v,o,gate,up,down _proj")
    a("--init", metavar="ADAPTER", help="start from this adapter (or, --stage budgets: measure it)")
    a("--loss-weights", metavar="JSON", help="beyond the paper: weigh each layer's KL by this adapter .json's "
      "layer_weights, squared (extensions/layer_loss.py); default the paper's mean over layers")
    a("--resume", action="store_true", help="continue from OUT/ckpt.pt")
    a("--eval-every", type=int, help=f"steps between held-out checks (default {D.eval_every})")
    a("--save-every", type=int, help=f"steps between checkpoints (default {D.save_every})")
    a("--max-minutes", type=float, help="stop once this long has passed since the start, data included "
      "(checkpoint + adapter saved, noted in its .json)")
    a("--device", help="cpu, cuda, cuda:1 (default: cuda if there is one)")
    a("--dtype", choices=["float32", "bfloat16"], help="base model dtype (default: bfloat16 on CUDA, else float32)")
    a("--seed", type=int, help=f"default {D.seed}")
    return p


def read_config(path):
    """A recipe file: a JSON object of TrainConfig fields, each of its field's type (ValueError naming the
    file and the key otherwise)."""
    path = cli.input_file("--config", path)
    try:
        values = read_json(path, "write a JSON object of TrainConfig fields (research/configs/train-cpu.json is one)")
    except ValueError as e:
        raise ValueError(f"--config {e}") from None
    fields = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    for key, value in values.items():
        if key not in fields:
            raise ValueError(f"--config {path}: unknown key {key!r}; the keys are TrainConfig's fields: "
                             f"{', '.join(fields)}")
        kinds = fields[key].__args__ if isinstance(fields[key], types.UnionType) else (fields[key],)
        ok = any(value is None if k is type(None) else
                 (isinstance(value, bool) if k is bool else
                  isinstance(value, (int, float) if k is float else k) and not isinstance(value, bool))
                 for k in kinds)
        if not ok:
            want = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise ValueError(f"--config {path}: {key!r} must be {want}, got {json.dumps(value)}")
    return values


def parse_targets(text):
    """"q_proj,k_proj" -> the tuple; "all" -> all seven; "" or "none" -> () (the embeddings alone, no LoRA)."""
    if text.strip() == "all":
        return LookaheadModule.TARGETS
    targets = tuple(t.strip() for t in text.split(",") if t.strip() and t.strip() != "none")
    bad = [t for t in targets if t not in LookaheadModule.TARGETS]
    if bad:
        raise ValueError(f"--targets: unknown {', '.join(bad)}; use all, none, or any of "
                         f"{', '.join(LookaheadModule.TARGETS)}")
    return targets


def check_config(cfg):
    """Every check that needs no model weights, so a bad value stops at once, not after an hour of answering.
    Returns what the run reads: (out, dest, model config, rows of OUT/data.jsonl, adapter (--init / the
    measured one) or None, checkpoint or None)."""
    check_choices(cfg)
    check_given(cfg)
    cfg.device = cfg.device or cli.default_device()
    cli.check_device(cfg.device)
    # the dtype the model will load in, named now: a checkpoint and a data folder record it (compared on --resume)
    cfg.dtype = cfg.dtype or str(default_dtype(cfg.device)).removeprefix("torch.")
    cli.check_model_dir(cfg.model)
    check_numbers(cfg)
    parse_targets(cfg.targets)
    methods.parse_rule(cfg.rule)
    check_heldout_budget(cfg)

    # the files: OUT, where the adapter goes, what is read from OUT, the adapter to start from or measure
    out, dest = output_paths(cfg)
    src = data_folder(cfg, out)
    folder = cli.resolve_model(cfg.model)
    model_cfg = ModelConfig.from_hf_config(folder)
    check_rule(cfg.rule, model_cfg)
    rows = read_rows(src, model_cfg, trim=cfg.stage in ("data", "all"))
    check_data_dtype(cfg, src, rows)
    check_samples(cfg, src, rows)
    adapter = adapter_to_read(cfg, model_cfg)
    training_loss(cfg, model_cfg)
    check_fit(cfg, model_cfg, src, rows, adapter)
    check_disk(cfg, model_cfg, rows)
    ckpt = checkpoint_to_resume(cfg, out, model_cfg, adapter)
    return out, src, dest, model_cfg, rows, adapter, ckpt


def data_folder(cfg, out):
    """Where the samples are read: --data (another run's data stage; --stage train and budgets), else OUT.
    --train-rows draws from them, so it too belongs to training (--stage train and all)."""
    if cfg.train_rows is not None:
        if cfg.stage not in ("train", "all"):
            raise ValueError(f"--train-rows is read when training: it has no use with --stage {cfg.stage}")
        cli.at_least("--train-rows", cfg.train_rows, 1)
    if cfg.data is None:
        return out
    if cfg.stage not in ("train", "budgets"):
        raise ValueError(f"--data is read by --stage train and budgets (--stage {cfg.stage} makes OUT's own data): "
                         "add --stage train, or drop --data")
    src = Path(cfg.data)
    if not (src / "data.jsonl").is_file():
        raise ValueError(f"--data {cfg.data}: no data.jsonl there: pass the --out folder of a data stage "
                         "(python train.py --stage data --out DIR)")
    return src


def check_given(cfg):
    """A path or device given as "" is a slip, not the default: --init "" trained from scratch, --adapter-out ""
    wrote OUT/adapter.safetensors and --out "" the current folder, each without a word."""
    for flag, value in (("--model", cfg.model), ("--out", cfg.out), ("--adapter-out", cfg.adapter_out),
                        ("--init", cfg.init), ("--device", cfg.device), ("--loss-weights", cfg.loss_weights)):
        if value is not None and not value.strip():
            raise ValueError(f"{flag} {value!r} is empty: give a value, or leave it out (in a --config file: drop "
                             f"the key) for the default")


def check_choices(cfg):
    """The settings that name one of a few choices."""
    for name, value, choices in (("--stage", cfg.stage, STAGES), ("store_dtype", cfg.store_dtype, STORE_DTYPES),
                                 ("--dtype", cfg.dtype, (None, "float32", "bfloat16"))):
        if value not in choices:
            raise ValueError(f"{name} {value!r}: choose from {', '.join(map(str, choices))}")


def check_numbers(cfg):
    """Every number in its range: counts, rates and shares, and the prompt lengths in order."""
    makes_data = cfg.stage in ("data", "all")
    for flag, value, lo in [("--n-train", cfg.n_train, 1 if makes_data else 0), ("--n-heldout", cfg.n_heldout, 0),
                            ("min_tokens", cfg.min_tokens, 1), ("--max-new-tokens", cfg.max_new_tokens, 1),
                            ("gen_batch", 1 if cfg.gen_batch is None else cfg.gen_batch, 1), ("n_tokens", cfg.n_tokens, 1),
                            ("--group", cfg.group, 1), ("rank", cfg.rank, 1), ("--batch", cfg.batch, 1),
                            ("--micro-batch", cfg.micro_batch, 1), ("budget", cfg.budget, 1), ("window", cfg.window, 0),
                            ("--eval-every", cfg.eval_every, 1), ("--save-every", cfg.save_every, 1),
                            ("weight_decay", cfg.weight_decay, 0)]:
        cli.at_least(flag, value, lo)
    minutes = [("--max-minutes", cfg.max_minutes)] if cfg.max_minutes is not None else []
    for flag, value in [("--lr", cfg.lr), ("alpha", cfg.alpha), ("--epochs", cfg.epochs), ("clip", cfg.clip),
                        ("store_gb", cfg.store_gb)] + minutes:
        cli.positive(flag, value)
    for flag, value in [("warmup", cfg.warmup), ("long_frac", cfg.long_frac), ("first_frac", cfg.first_frac)] + \
            ([("copy_frac", cfg.copy_frac)] if cfg.copy_frac is not None else []):
        cli.fraction(flag, value)
    if not cfg.min_tokens <= cfg.max_tokens <= cfg.long_max:
        raise ValueError(f"min_tokens {cfg.min_tokens}, --max-tokens {cfg.max_tokens}, long_max {cfg.long_max}: "
                         "need min <= max <= long_max")
    # a step is batch // micro_batch micro-batches, at least one: --batch 4 with the default micro-batch of 8 trained
    # on 8 samples a step, and --batch 10 on 8; the first is one micro-batch of 4, the second is refused
    cfg.micro_batch = min(cfg.micro_batch, cfg.batch)
    if cfg.batch % cfg.micro_batch:
        step = cfg.micro_batch * max(1, cfg.batch // cfg.micro_batch)
        raise ValueError(f"--batch {cfg.batch} is not a whole number of micro-batches of {cfg.micro_batch} "
                         f"(--micro-batch): each step would train on {step} samples; use --batch {step}, or a "
                         f"--micro-batch that divides {cfg.batch}")
    if not -2**63 <= cfg.seed < 2**63:  # torch.manual_seed's range; past it, an OverflowError that named no flag
        raise ValueError(f"--seed {cfg.seed}: must be a whole number from -2**63 to 2**63 - 1")


def check_heldout_budget(cfg):
    """The held-out check's baselines (harness.BASELINES: SnapKV, PyramidKV and H2O keep the last `window` tokens
    anyway) at C = budget: a window that leaves them no room failed at the first check, after the data stage."""
    if cfg.stage not in ("train", "all"):
        return
    for method in harness.BASELINES:
        if method != "oracle":  # its scores need the answer; it keeps no window
            try:
                methods.make_scorer(EvictConfig(method, cfg.budget, window=cfg.window))
            except ValueError as e:
                raise ValueError(f"budget {cfg.budget}, window {cfg.window} (the held-out check's): {e}") from None


CHAT_ROOM = 64  # tokens a chat template adds around a prompt (SmolLM2's, with its system message: 30)


def check_fit(cfg, model_cfg, out, rows, adapter):
    """The module and the prompts fit the model, said before the data stage rather than after it (rank 10**6
    filled the memory when training began) or never (a prompt past the context runs on RoPE positions the model
    never saw): a LoRA rank at most its hidden size (a higher one adds nothing), every prompt with its answer
    and the M lookahead rows after it within its context. The recipe's longest prompt counts when this run
    makes prompts; the longest OUT/data.jsonl holds always. M and rank are --init's adapter's when there is one."""
    ctx, name = model_cfg.max_context, model_cfg.name
    M = adapter.n_tokens if adapter is not None else cfg.n_tokens
    if adapter is None and cfg.rank > model_cfg.hidden_size:
        raise ValueError(f"rank {cfg.rank}: at most {name}'s hidden size {model_cfg.hidden_size} (a LoRA of higher "
                         f"rank adds nothing)")
    have = {split: sum(r.get("split") == split for r in rows) for split in ("train", "heldout")}
    if cfg.stage in ("data", "all") and (have["train"] < cfg.n_train or have["heldout"] < cfg.n_heldout):
        key, longest = ("long_max", cfg.long_max) if cfg.long_frac > 0 else ("--max-tokens", cfg.max_tokens)
        after, room = ("--max-new-tokens", cfg.max_new_tokens) if cfg.max_new_tokens >= M else ("n_tokens", M)
        if longest + CHAT_ROOM + room > ctx:
            raise ValueError(f"{key} {longest} + {CHAT_ROOM} (the chat template) + {after} {room} is "
                             f"{longest + CHAT_ROOM + room} tokens, past {name}'s context of {ctx}: lower {key} or "
                             f"{after}")
    longest = max((len(r["prompt_ids"]) for r in rows), default=0)
    if longest + M > ctx:
        raise ValueError(f"n_tokens {M}: {out / 'data.jsonl'}'s longest prompt ({longest} tokens) with the M "
                         f"lookahead rows after it is past {name}'s context of {ctx}: lower n_tokens")


def check_rule(rule, model_cfg):
    """The recipe's selection rule (the adapter's .json names it) as methods.parse_rule reads it for this model: a
    width within its context ("max:99999999999" passed the syntax check alone and then hung in the first held-out
    check, pooling over a window that size). Its vocabulary is not passed: a span shortlist past it is the whole
    vocabulary (extensions/span.shortlist clamps it), and the default span:8:1024 would refuse every small model."""
    try:
        methods.parse_rule(rule, context=model_cfg.max_context)
    except ValueError as e:
        raise ValueError(f"rule {rule!r} (the recipe's selection rule): {e}") from None


def data_dtypes(src, rows):
    """[(dtype, what says so)]: the dtype the base model ran in when src's data was made, as its rows record it
    (build_dataset), and as the held-out ground truth kept there holds it (harness.heldout_ground_truth saves the
    cache in the model's dtype and loads it back as it is: a float32 one in a bfloat16 model failed at step 0).
    A folder made before the rows recorded it is known by the second alone; [] when neither is there."""
    found = [(d, f"its rows in {src / 'data.jsonl'}") for d in sorted({r["dtype"] for r in rows if "dtype" in r})]
    for path in sorted((Path(src) / "heldout").glob("*.pt"))[:1]:  # one file says: one model made them all
        try:
            kept = torch.load(path, map_location="cpu", mmap=True, weights_only=True)["k"][0].dtype
        except Exception:  # cut short by a kill: the held-out check makes it again (harness)
            continue
        found.append((str(kept).removeprefix("torch."), f"its held-out ground truth {path.parent}"))
    return found


def check_data_dtype(cfg, src, rows):
    """One data folder, one dtype: the answers and targets there are the base model's in the dtype it ran in, and
    its held-out ground truth is kept in that dtype; a run in another dtype (--dtype, or the device's default) is
    refused rather than mixing two models' data or failing at its first held-out check. --stage budgets reads the
    samples alone (load_batch casts their cache to the model's dtype): an adapter measured on another machine's data."""
    if cfg.stage == "budgets":
        return
    for made, where in data_dtypes(src, rows):
        if made != cfg.dtype:
            flag = "--data" if cfg.data else "--out"
            raise ValueError(f"--dtype {cfg.dtype}: {flag} {src} was made with the base model in {made} ({where}): "
                             f"run in its dtype (--dtype {made}), or make a data stage of your own in {cfg.dtype} "
                             f"(python train.py --stage data --dtype {cfg.dtype} --out NEW)")


def check_disk(cfg, model_cfg, rows):
    """build_dataset's store_gb check on the least the new rows can take, with S >= min_tokens: a training row keeps
    its target (L x H x S floats), a held-out row its ground truth in OUT/heldout (the float32 cache too, made by
    the held-out check): --n-train or --n-heldout 10**9 is refused now, not once their prompts have all been made."""
    if cfg.stage not in ("data", "all"):
        return
    have = {split: sum(r.get("split") == split for r in rows) for split in ("train", "heldout")}
    new_train, new_held = max(0, cfg.n_train - have["train"]), max(0, cfg.n_heldout - have["heldout"])
    least = (new_train * sample_bytes(model_cfg, cfg.min_tokens, None)
             + new_held * sample_bytes(model_cfg, cfg.min_tokens, torch.float32))
    if least > cfg.store_gb * 2**30:
        raise ValueError(f"--n-train {cfg.n_train}, --n-heldout {cfg.n_heldout}: the training samples and the held-out "
                         f"ground truth would take at least {least / 2**30:.1f} GiB on disk, over store_gb "
                         f"{cfg.store_gb}: raise it in the --config file, or use fewer prompts")


def output_paths(cfg):
    """(OUT, where the adapter goes), both writable now (check_writable); --stage budgets must be told where (it
    rewrites an adapter)."""
    out = cli.output_folder("--out", cfg.out)
    if cfg.stage == "budgets" and not cfg.adapter_out:
        raise ValueError("--stage budgets needs --adapter-out: where the adapter with its layer weights goes "
                         "(it may be the measured adapter itself; the old pair is kept as NAME.prev.safetensors)")
    dest = cli.output_file("--adapter-out", cfg.adapter_out, ".safetensors") if cfg.adapter_out \
        else out / "adapter.safetensors"
    check_writable("--out", out, out, [out / "ckpt.pt", out / "ckpt.tmp", out / "log.jsonl"])
    if cfg.stage != "data":  # the data stage writes no adapter
        # what LookaheadModule.save writes: the pair, each through a temporary name
        files = [dest, dest.with_suffix(".json"), dest.with_suffix(".safetensors.tmp"), dest.with_suffix(".json.tmp")]
        check_writable("--adapter-out" if cfg.adapter_out else "--out", dest, dest.parent, files)
    return out, dest


def check_writable(flag, path, folder, files):
    """That this run can write `files` into `folder` at its end, said now rather than after training: a file is made
    there and removed (os.access says yes to root everywhere, and to a read-only mount), and none of `files` is a
    folder or other non-file that a file cannot replace."""
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{flag} {path}: this folder is not writable (making a file in {folder} failed: "
                         f"{e.strerror}): pass another") from None
    for f in files:
        if f.exists() and not f.is_file():
            raise ValueError(f"{flag} {path}: {f}, which this run writes, is a folder (or not a file): move it "
                             f"away, or pass another {flag}")


def check_samples(cfg, out, rows):
    """--stage train and budgets read the samples OUT holds: there must be some, and those read must open."""
    if cfg.stage not in ("train", "budgets"):
        return
    have = [r for r in rows if r.get("split") == "train" and sample_path(out, r["id"]).exists()]
    if not have:
        raise ValueError(f"--stage {cfg.stage}: {out} holds no training samples yet: build them first with "
                         f"python train.py --stage data --out {out} (and this run's --config)")
    if cfg.train_rows is not None and cfg.train_rows > len(have):
        raise ValueError(f"--train-rows {cfg.train_rows}: {out} holds {len(have)} training samples: ask for at "
                         "most that many, or make more with its data stage")
    if cfg.stage == "train" and len(have) < cfg.n_train:
        # a data stage stopped part way trains without a word otherwise, and a --train-rows draw among the rows
        # there is not the draw of the finished folder (draw_rows shuffles the groups it finds)
        cli.warn(f"{out} holds {len(have)} training samples, fewer than n_train {cfg.n_train}: if its data stage "
                 f"has not finished, rerun it first (python train.py --stage data --out {out} and its --config); "
                 f"training on these {len(have)}" + (", --train-rows drawing among them" if cfg.train_rows else ""))
    for r in have[:BUDGET_SAMPLES] if cfg.stage == "budgets" else have:
        if not sample_ok(sample_path(out, r["id"])):
            raise unreadable_sample(sample_path(out, r["id"]))


def adapter_to_read(cfg, model_cfg):
    """The adapter to start from (--init) or to measure (--stage budgets: --init, default the shipped one),
    its path in info["path"]; None when the run reads none."""
    if not (cfg.stage == "budgets" or cfg.init):
        return None
    path = cfg.init or cli.default_adapter_path(model_cfg)
    adapter = methods.load_adapter(cli.input_file("--init", path) if cfg.init else path, model_cfg)
    adapter.info["path"] = str(path)
    return adapter


def training_loss(cfg, model_cfg):
    """The loss the module trains on: the paper's kl_loss, or with --loss-weights the layer-weighted one
    (extensions/layer_loss.py), its file checked now."""
    if cfg.loss_weights is None:
        return kl_loss
    if cfg.stage not in ("train", "all"):
        raise ValueError(f"--loss-weights is read when training: it has no use with --stage {cfg.stage}")
    path = cli.input_file("--loss-weights", cfg.loss_weights)
    return layer_loss.LayerWeightedKL(layer_loss.read_weights(path, model_cfg.num_hidden_layers))


def checkpoint_to_resume(cfg, out, model_cfg, adapter):
    """OUT/ckpt.pt checked against this run (read_checkpoint) when --resume trains and one is there, else None;
    without --resume, one there must be this run's own (check_own_checkpoint): training replaces it."""
    if not (cfg.stage in ("train", "all") and (out / "ckpt.pt").exists()):
        return None
    shape = adapter.metadata() if adapter is not None else dict(
        n_tokens=cfg.n_tokens, rank=cfg.rank, alpha=cfg.alpha, targets=list(parse_targets(cfg.targets)))
    if not cfg.resume:
        return check_own_checkpoint(out, model_cfg, shape, schedule_of(cfg))
    return read_checkpoint(out / "ckpt.pt", model_cfg, shape, schedule_of(cfg))


def read_rows(out, model_cfg, trim=False):
    """The rows of OUT/data.jsonl ([] if none), all made by this base model. trim: drop a partial last line
    (a run killed mid-write), before this run appends to the file."""
    path = out / "data.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    if trim and text and not text.endswith("\n"):
        path.write_text(text[: text.rfind("\n") + 1])
    rows = data.read_jsonl(path, required=("id", "prompt_ids", "response_ids"), allow_empty=True)
    for r in rows:
        if r.get("fingerprint") != model_cfg.fingerprint():
            raise ValueError(f"{path} was made with another base model ({r.get('base_model')}): use another --out")
    return rows


# -----------------------------------------------------------------------------
# Stage data: samples. One prefill per prompt gives the base model's own answer, the target (the
# answer's attention over the prompt) and the training cache (the prompt's KV), kept on disk.


def left_pad(prompts, dev):
    """Token-id lists -> ids (B, S) with left padding, and pad_mask (B, S) True on real tokens."""
    S = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (S - len(p)) + p for p in prompts], device=dev)
    pad_mask = torch.tensor([[False] * (S - len(p)) + [True] * len(p) for p in prompts], device=dev)
    return ids, pad_mask


def full_cache(model, ids, pad_mask):
    """Prefill, nothing evicted: (cache, first-token logits, next positions)."""
    return compress(model, ids, methods.make_scorer(EvictConfig("full")), pad_mask=pad_mask)[:3]


class RoomyCache(KVCache):
    """`cache` with room for `room` more slots in every layer, reserved once: each decode step writes its key
    and value into the room. A plain KVCache concatenates the whole cache anew at every step; at batch 8 on a
    CPU that copy costs about as much as the step's own work. The values are the same either way."""

    def __init__(self, cache, room):
        super().__init__(len(cache.k))
        self.room = []
        for l in range(len(cache.k)):
            k, v, valid = cache.k[l], cache.v[l], cache.valid[l]
            B, H, T, D = k.shape
            rk, rv = k.new_empty(B, H, T + room, D), v.new_empty(B, H, T + room, D)
            rvalid = torch.ones(B, 1 if valid is None else valid.shape[1], T + room, dtype=torch.bool, device=k.device)
            rk[:, :, :T], rv[:, :, :T] = k, v
            if valid is not None:
                rvalid[..., :T] = valid
            self.room.append((rk, rv, rvalid))
            self.k[l], self.v[l], self.valid[l] = rk[:, :, :T], rv[:, :, :T], None if valid is None else rvalid[..., :T]

    def append(self, layer, k, v, pad_mask=None):
        rk, rv, rvalid = self.room[layer]
        n, T = self.k[layer].shape[2], k.shape[2]
        if pad_mask is not None or n + T > rk.shape[2] or self.k[layer].data_ptr() != rk.data_ptr():
            return super().append(layer, k, v, pad_mask)  # padding, or past the room: the plain way
        rk[:, :, n:n + T], rv[:, :, n:n + T] = k, v  # decoded tokens are real: rvalid is True there already
        self.k[layer], self.v[layer] = rk[:, :, :n + T], rv[:, :, :n + T]
        if self.valid[layer] is not None:
            self.valid[layer] = rvalid[..., :n + T]
        return self.k[layer], self.v[layer], self.valid[layer]


class TargetAttention(Hook):
    """One decode step's attention for all B rows, one batched matmul over each row's own keys, and the step's
    term of the training target: the token decoded is a query of the answer, so its attention over the S prompt
    slots is one term of the answer's mean (answer_attention's). What the data stage uses on a GPU, where a
    step's time is its kernel launches; on a CPU, SharedPrefixAttention (below) reads each group's prefix once."""

    def __init__(self, S):
        self.S, self.weight, self.target = S, None, {}  # weight (B,): 1 for a row still answering, else 0

    def add_term(self, layer, probs):
        """probs (B, H_kv, G, Tk): this step's attention; its prompt part, weighted, joins the target."""
        term = probs[..., :self.S].flatten(1, 2) * self.weight[:, None, None]  # (B, H, S)
        self.target[layer] = term if layer not in self.target else self.target[layer] + term

    def attn(self, layer, q, k, key_valid):
        B, H, T, D = q.shape
        assert T == 1, "one decode step at a time"
        Hkv = k.shape[1]
        s = (q.view(B, Hkv, H // Hkv, D) * D ** -0.5) @ k.transpose(-1, -2)  # (B, H_kv, G, Tk)
        if key_valid is not None:
            s = s.masked_fill(~key_valid.expand(B, Hkv, -1)[:, :, None, :], float("-inf"))
        self.probs = s.float().softmax(-1)  # float32, as group_attention's: it is also the target
        self.add_term(layer, self.probs)

    def attn_output(self, layer, v):
        B, Hkv, _, D = v.shape
        return (self.probs.to(v.dtype) @ v).reshape(B, -1, 1, D)  # (B, H, 1, D)


class SharedPrefixAttention(TargetAttention):
    """Decoding rows laid out as shared_prefill lays them out (slots [0, P) of every row hold its group's
    left-padded prefix, the slots after P its own tokens): the attention of each decode step, with each
    group's prefix keys and values read ONCE for all of its rows rather than once per row. The result is
    the same attention; decoding on a CPU is bound by reading the cache, and a group of 6 shares most of it.
    The prefix part is one matmul per group: its rows' G query heads per KV head stacked as one matrix."""

    def __init__(self, P, groups, S):
        super().__init__(S)
        keys = list(dict.fromkeys(groups))
        self.P, self.rows = P, [torch.tensor([b for b, g in enumerate(groups) if g == key]) for key in keys]

    def attn(self, layer, q, k, key_valid):
        B, H, T, D = q.shape
        assert T == 1, "one decode step at a time"
        P, Hkv = self.P, k.shape[1]
        G = H // Hkv
        valid = key_valid.expand(B, Hkv, -1) if key_valid is not None else None  # (B, H_kv, Tk)
        self.scores = []
        for rows in self.rows:
            n, first = len(rows), rows[0]
            qg = q[rows].view(n, Hkv, G, D) * D ** -0.5  # (n, H_kv, G, D)
            # the prefix: (H_kv, n*G, D) @ (H_kv, D, P), the group's one copy of it
            s_pre = (qg.permute(1, 0, 2, 3).reshape(Hkv, n * G, D) @ k[first, :, :P].transpose(-1, -2))
            s_pre = s_pre.view(Hkv, n, G, P).permute(1, 0, 2, 3)  # (n, H_kv, G, P)
            s_own = qg @ k[rows, :, P:].transpose(-1, -2)  # (n, H_kv, G, Tk - P)
            s = torch.cat([s_pre, s_own], dim=-1)
            if valid is not None:
                s = s.masked_fill(~valid[rows][:, :, None, :], float("-inf"))
            self.scores.append(s.float().softmax(-1))  # float32, as group_attention's: it is also the target
        probs = torch.empty(B, Hkv, G, self.S, device=q.device)  # this step's attention over the prompt
        for rows, p in zip(self.rows, self.scores):
            probs[rows] = p[..., :self.S]
        self.add_term(layer, probs)

    def attn_output(self, layer, v):
        B, Hkv, Tk, D = v.shape
        P = self.P
        out = v.new_empty(B, Hkv, self.scores[0].shape[2], D)  # (B, H_kv, G, D)
        for rows, p in zip(self.rows, self.scores):
            n, G, p = len(rows), p.shape[2], p.to(v.dtype)
            pre = p[..., :P].permute(1, 0, 2, 3).reshape(Hkv, n * G, P) @ v[rows[0], :, :P]  # (H_kv, n*G, D)
            out[rows] = pre.view(Hkv, n, G, D).permute(1, 0, 2, 3) + p[..., P:] @ v[rows, :, P:]
        return out.reshape(B, Hkv * out.shape[2], 1, D)  # (B, H, 1, D)


def shared_prefix(prompts):
    """How many leading tokens all of `prompts` share, leaving each at least one token of its own (its last
    token gives its first-token logits)."""
    n = min(len(p) for p in prompts) - 1
    for i in range(n):
        if any(p[i] != prompts[0][i] for p in prompts):
            return i
    return max(n, 0)


@torch.no_grad()
def shared_prefill(model, prompts, groups):
    """Prefill B prompts, those of one group (groups[b]: any key) sharing their common prefix: each group's
    prefix once, the groups left-padded together into one prefill, then every prompt's own tail on top of a
    copy of its group's cache (left-padded too, so padding sits between prefix and tail; positions say where
    each token is). Returns (cache, first-token logits (B, V), next positions (B,), slots: per prompt the
    cache slots that hold its tokens, in order, and shared: per prompt its group's prefix length)."""
    dev = model.lm_head.weight.device
    keys = list(dict.fromkeys(groups))
    shared = {g: shared_prefix([p for p, h in zip(prompts, groups) if h == g]) for g in keys}
    firsts = [next(p for p, h in zip(prompts, groups) if h == g)[:shared[g]] for g in keys]
    prefix_ids, prefix_pad = left_pad([f or [0] for f in firsts], dev)  # an empty prefix: one pad slot
    prefix_pad[:, -1] &= torch.tensor([len(f) > 0 for f in firsts], device=dev)
    cache = full_cache(model, prefix_ids, prefix_pad)[0]  # (G rows)
    row = torch.tensor([keys.index(g) for g in groups], device=dev)
    for l in range(len(cache.k)):  # one copy of its group's prefix per prompt
        cache.k[l], cache.v[l] = cache.k[l].index_select(0, row), cache.v[l].index_select(0, row)
        cache.valid[l] = None if cache.valid[l] is None else cache.valid[l].index_select(0, row)
    tails = [p[shared[g]:] for p, g in zip(prompts, groups)]
    tail_ids, tail_pad = left_pad(tails, dev)
    start = torch.tensor([shared[g] for g in groups], device=dev)  # (B,) position of each tail's first token
    positions = start[:, None] + (tail_pad.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(tail_ids, positions=positions, cache=cache, pad_mask=tail_pad, logits_at=-1)[:, -1]
    P, T = prefix_ids.shape[1], tail_ids.shape[1]
    slots = [list(range(P - shared[g], P)) + list(range(P + T - len(t), P + T)) for g, t in zip(groups, tails)]
    next_pos = start + torch.tensor([len(t) for t in tails], device=dev)
    return cache, logits, next_pos, slots, [shared[g] for g in groups], P


@torch.no_grad()
def answer_and_target(model, tok, prompts, max_new_tokens, groups=None):
    """For B prompts (token-id lists) prefilled ONCE, together (shared_prefill: prompts of one group share
    their prefix's prefill; groups None: no two share): the greedy full-cache answer and, summed while it is
    decoded, the target: per layer and query head, the mean attention of the answer's tokens over the prompt
    (answer_attention's, without a second forward over the answers: each answer token, the last one too, is
    fed once, and its attention at that step is its term). Returns per prompt a dict: response_ids (the stop
    token kept: the answer's end is part of its future), k and v (L, H_kv, S_b, D) the prompt's cache,
    target (L, H, S_b), padding removed, and shared (how many of its first tokens its group shares: the data
    stage stores those once per group)."""
    dev, L = model.lm_head.weight.device, model.config.num_hidden_layers
    B, groups = len(prompts), list(range(len(prompts))) if groups is None else groups
    cache, logits, next_pos, slots, shared, P = shared_prefill(model, prompts, groups)
    S = len(cache)  # the prompt's slots (padding included); decoding appends after them, into a roomy copy
    # a CPU's decoding is bound by reading the cache: each group's prefix read once; a GPU's by its launches:
    # one batched attention (the per-group loop made the data stage of gpu_train.sh ~7x slower)
    hook = SharedPrefixAttention(P, groups, S) if dev.type == "cpu" else TargetAttention(S)
    roomy = RoomyCache(cache, max_new_tokens)
    # not greedy(): it never feeds an answer's last token, whose query is one term of the target
    answers, done = [[] for _ in range(B)], [False] * B
    for t in range(max_new_tokens):
        tokens = logits.argmax(-1)  # (B,) greedy; a finished row is fed on (batch decoding) with weight 0
        hook.weight = torch.tensor([0.0 if d else 1.0 for d in done], device=dev)
        for b, token in enumerate(tokens.tolist()):  # one host read per step, as greedy()'s
            if not done[b]:
                answers[b].append(token)
                done[b] = token in tok.stop_ids
        logits = decode_step(model, roomy, tokens, next_pos + t, hook)  # this token's attention: its term
        if all(done):
            break
    lengths = torch.tensor([len(a) for a in answers], device=dev, dtype=torch.float32)
    out = []
    for b in range(B):
        real = torch.tensor(slots[b], device=dev)  # this row's slots, without the padding
        out.append(dict(response_ids=answers[b], shared=shared[b],
                        k=torch.stack([cache.k[l][b][:, real] for l in range(L)]),  # (L, H_kv, S_b, D)
                        v=torch.stack([cache.v[l][b][:, real] for l in range(L)]),
                        target=torch.stack([hook.target[l][b][:, real] / lengths[b] for l in range(L)])))  # (L, H, S_b)
    return out


def new_prompts(tok, cfg, split, n):
    """The split's prompts as the recipe makes them: training prompts in groups on shared contexts when
    cfg.group > 1; held-out prompts always one per context, in the default task mix (comparable across runs)."""
    kw = dict(min_tokens=cfg.min_tokens, max_tokens=cfg.max_tokens, long_frac=cfg.long_frac, long_max=cfg.long_max,
              seed=cfg.seed)
    if split == "train" and cfg.group > 1:
        return data.make_training_groups(tok, n, split=split, group=cfg.group, first_frac=cfg.first_frac,
                                         copy_frac=cfg.copy_frac, **kw)
    return data.make_training_prompts(tok, n, split=split, copy_frac=cfg.copy_frac if split == "train" else None, **kw)


def answer_batches(todo, gen_batch, seed):
    """The prompts to answer, in batches of up to gen_batch prompts, a group never split: held-out rows first (an
    early check), then blocks of 8 batches in a seeded random order, sorted by length inside a block (little
    padding, and a run stopped early leaves a random subset)."""
    units = {}
    for p in todo:
        units.setdefault(p.get("group", p["id"]), []).append(p)
    units = list(units.values())
    random.Random(seed).shuffle(units)
    units.sort(key=lambda u: u[0]["split"] != "heldout")
    block = 8 * gen_batch
    ordered, i = [], 0
    while i < len(units):
        j, n = i, 0
        while j < len(units) and n < block:
            n, j = n + len(units[j]), j + 1
        ordered += sorted(units[i:j], key=lambda u: len(u[0]["prompt_ids"]))
        i = j
    batches, batch = [], []
    for u in ordered:
        if batch and len(batch) + len(u) > gen_batch:
            batches.append(batch)
            batch = []
        batch += u
    return batches + ([batch] if batch else [])


def stored_bytes(cfg, model_cfg, rows, store):
    """Disk the training rows' samples take: a group's shared prefix counted once."""
    groups = {}
    for r in rows:
        if r["split"] == "train":
            groups.setdefault(r.get("group", r["id"]), []).append(r["prompt_ids"])
    target = lambda S: sample_bytes(model_cfg, S, None)
    cache = lambda S: sample_bytes(model_cfg, S, store) - target(S)
    n = 0
    for prompts in groups.values():
        shared = shared_prefix(prompts) if len(prompts) > 1 else 0
        n += cache(shared) + sum(cache(len(p) - shared) + target(len(p)) for p in prompts)
    return n


def save_batch(out, batch, samples, store):
    """Each training row's sample file; a group's shared prefix (in this batch, two or more rows) once, in a
    file of its own that the members' files name."""
    by_group = {}
    for p, s in zip(batch, samples):
        if p["split"] == "train":
            by_group.setdefault(p.get("group", p["id"]), []).append((p, s))
    for key, members in by_group.items():
        shared = members[0][1]["shared"] if len(members) > 1 and store is not None else 0
        if shared:
            data.save_prefix(data.prefix_path(out, key), members[0][1], shared, store)
        for p, s in members:
            save_sample(sample_path(out, p["id"]), s, store, prefix=data.prefix_path(out, key) if shared else None)


def build_dataset(model, tok, cfg, out, rows, rank=0):
    """Append {id, split, task, prompt_ids, response_ids} rows to OUT/data.jsonl until it holds
    n_train + n_heldout of them, and write each training row's sample file (cache + target) in the
    same pass. Rows and samples already there are kept (resume); a row without a whole sample file
    (e.g. a data.jsonl from elsewhere, a file cut short) gets one from one forward over [prompt; answer].
    Prints what the new rows cost (wall clock and CPU time, prompts per hour)."""
    fp, path = model.config.fingerprint(), Path(out) / "data.jsonl"
    made_in = str(model.lm_head.weight.dtype).removeprefix("torch.")  # each row records it: check_data_dtype
    have = {split: sum(r.get("split") == split for r in rows) for split in ("train", "heldout")}
    todo = []
    if have["train"] < cfg.n_train or have["heldout"] < cfg.n_heldout:
        done = {r["id"] for r in rows}
        for split, n in (("train", cfg.n_train), ("heldout", cfg.n_heldout)):
            todo += [dict(p, split=split) for p in new_prompts(tok, cfg, split, n) if p["id"] not in done]
    store = None if cfg.store_dtype == "none" else getattr(torch, cfg.store_dtype)
    missing = []
    for r in rows:
        if r["split"] == "train" and not sample_ok(sample_path(out, r["id"])):
            if sample_path(out, r["id"]).exists():
                print(f"training sample {sample_path(out, r['id'])} is unreadable (cut short?): made again")
            missing.append(r)
    if (todo or missing) and rank != 0:
        raise ValueError("build the dataset first on one process (python train.py --stage data)")
    for p in todo:
        p["prompt_ids"] = tok.encode(tok.chat(p["prompt"]))
    n_bytes = stored_bytes(cfg, model.config, rows + todo, store)
    if n_bytes > cfg.store_gb * 2**30:
        raise ValueError(f"the training samples would take {n_bytes / 2**30:.1f} GiB on disk, over store_gb "
                         f"{cfg.store_gb}: raise it in the --config file, or use fewer/shorter prompts "
                         "(--n-train, --max-tokens)")
    for r in tqdm(missing, desc="samples from data.jsonl", disable=not missing):
        cache, gt, _ = harness.ground_truth(model, r["prompt_ids"], r["response_ids"])
        save_sample(sample_path(out, r["id"]), dict(k=torch.cat(cache.k), v=torch.cat(cache.v),
                                                    target=torch.cat([gt[l] for l in range(len(gt))])), store)
    bar = tqdm(total=len(todo), desc="answering prompts", disable=not todo)
    wall, cpu = time.perf_counter(), time.process_time()
    for batch in answer_batches(todo, cfg.gen_batch or (32 if cfg.device.startswith("cuda") else 8), cfg.seed):
        samples = answer_and_target(model, tok, [p["prompt_ids"] for p in batch], cfg.max_new_tokens,
                                    groups=[p.get("group", p["id"]) for p in batch])
        new = [dict(id=p["id"], split=p["split"], source=p["source"], task=p["task"], base_model=model.config.name,
                    fingerprint=fp, dtype=made_in, prompt_ids=p["prompt_ids"], response_ids=s["response_ids"],
                    **({"group": p["group"]} if "group" in p else {}))
               for p, s in zip(batch, samples)]
        save_batch(out, batch, samples, store)  # the sample files first, then the rows that point to them
        with open(path, "a") as f:  # appended batch by batch: a killed run loses one batch at most
            for r in new:
                f.write(json.dumps(r) + "\n")
        rows = rows + new
        bar.update(len(batch))
    bar.close()
    if todo:
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        print(f"data stage: {len(todo)} prompts in {wall:.0f} s ({wall / len(todo):.2f} s per prompt, "
              f"{3600 * len(todo) / wall:.0f} prompts per hour; CPU time {cpu / len(todo):.2f} s per prompt)")
    return rows


# -----------------------------------------------------------------------------
# Stage train: the loss. The prediction is lookahead_pass(..., per_query_head=True): the M lookahead
# rows on top of the prompt cache (the two-pass form), the only rows with gradients.


@torch.no_grad()
def prompt_cache(model, prompts):
    """The prompts' KV cache, left-padded together as load_batch pads them, made by one prefill: what a
    training step does instead of reading it from disk with store_dtype none (cheap on a GPU)."""
    return full_cache(model, *left_pad(prompts, model.lm_head.weight.device))[0]


def micro_batches(rows, size):
    """Training rows cut into micro-batches of similar prompt lengths (little padding): indices
    sorted by length, then cut. Each epoch shuffles the micro-batches, not what is in them."""
    order = sorted(range(len(rows)), key=lambda i: (len(rows[i]["prompt_ids"]), rows[i]["id"]))
    return [order[i:i + size] for i in range(0, len(order), size)]


def batch_loss(model, module, cache, gt, lengths, loss=kl_loss):
    """The loss of one micro-batch: the M lookahead rows on top of each sample's prompt cache (B samples
    in one forward, each at its own prompt length), their attention per query head against the target."""
    return loss(gt, lookahead_pass(model, module, cache, lengths, per_query_head=True))


def optimizer_step(module, opt, model, micro, n_samples, clip, world=1, loss=kl_loss):
    """One optimiser step over this rank's micro-batches `micro` (an iterable of load_batch results):
    each sample weighs the same in the step's mean over n_samples (all ranks), ranks average their
    gradients, then clip and step. Returns the step's loss as a 0-dim tensor. A non-finite loss or gradient
    (nan, inf: from a bad adapter, a bad sample, too high a rate) steps nothing and raises ValueError: the
    run stops in one line with its last good checkpoint, rather than training on nan and saving it."""
    total = torch.zeros((), device=next(module.parameters()).device)
    for cache, gt, lengths in micro:
        part = batch_loss(model, module, cache, gt, lengths, loss) * lengths.shape[0] * world / n_samples
        part.backward()
        total += part.detach().float() / world
    if world > 1:
        all_reduce_grads(module, world)
    try:
        torch.nn.utils.clip_grad_norm_(module.parameters(), clip, error_if_nonfinite=True)
    except RuntimeError as e:
        if "non-finite" not in str(e):
            raise
        opt.zero_grad(set_to_none=True)
        raise ValueError("the training loss or its gradient is not finite (nan or inf): stopped before this step, "
                         "nothing saved from it (OUT/ckpt.pt keeps the last good checkpoint); check --init's adapter "
                         "and its .json, and the data, or lower --lr, then rerun with --resume") from None
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def lr_at(step, total, cfg):
    warm = max(1, round(cfg.warmup * total))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


def new_module(model, cfg):
    """The untrained module of this run's settings (lookaheadkv.untrained_module), seeded by cfg.seed,
    selecting with cfg.rule."""
    module = methods.untrained(model, cfg.seed, n_tokens=cfg.n_tokens, rank=cfg.rank, alpha=cfg.alpha,
                               targets=parse_targets(cfg.targets))
    module.info["rule"] = cfg.rule
    return module


# The settings a resume may change, the rest of TrainConfig's fields defining the run: where it reads the model
# (its weights are compared by fingerprint) and writes, which stage runs, when it stops, checks and saves, the device
# (its dtype is compared: that changes the numbers), and the data stage's batch size and disk cap (neither changes
# a row). The module's shape (n_tokens, rank, alpha, targets) is compared from the checkpoint's module itself.
MAY_CHANGE = ("model", "out", "adapter_out", "stage", "resume", "max_minutes", "eval_every", "save_every", "device",
              "gen_batch", "store_gb")
MODULE_KEYS = ("n_tokens", "rank", "alpha", "targets")
# what the result depends on (--data and --init as given: the same file under two spellings is refused, never mixed)
RESUME_KEYS = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name not in MAY_CHANGE + MODULE_KEYS)


def schedule_of(cfg):
    """The settings a checkpoint is only good for (--resume with others would train a mix of two runs and record
    one of them in the adapter's .json): every TrainConfig field but MAY_CHANGE's, checked (check_config) first."""
    return {k: getattr(cfg, k) for k in RESUME_KEYS}


def save_checkpoint(path, module, opt, step, log, settings=None):
    tmp = path.with_suffix(".tmp")
    torch.save(dict(module=module.state_dict(), meta=module.metadata(), opt=opt.state_dict(), step=step, log=log,
                    rng=torch.get_rng_state(), settings=settings), tmp)
    os.replace(tmp, path)  # atomic: a kill mid-save leaves the previous checkpoint intact


def load_checkpoint(path):
    """OUT/ckpt.pt's dict, or None if it cannot be read as one (cut short, or not a checkpoint at all)."""
    try:
        ck = torch.load(path, map_location="cpu", weights_only=False)
        ck["meta"]["base_fingerprint"]
        return ck
    except Exception:
        return None


def checkpoint_differences(ck, cfg, now, schedule=None):
    """What a readable checkpoint was made with that this run is not, one "FLAG OLD (this run: NEW)" each: the
    module (now: its n_tokens, rank, alpha, targets) and the settings (schedule: schedule_of; a checkpoint from
    before a key was saved is not checked for it)."""
    meta, saved = ck["meta"], ck.get("settings") or {}
    differ = [f"{flag_of(k)} {json.dumps(meta.get(k))} (this run: {json.dumps(now[k])})"
              for k in MODULE_KEYS if meta.get(k) != now[k]]
    return differ + [f"{flag_of(k)} {json.dumps(saved[k])} (this run: {json.dumps(schedule[k])})"
                     for k in RESUME_KEYS if schedule is not None and k in saved and saved[k] != schedule[k]]


def read_checkpoint(path, cfg, now, schedule=None):
    """OUT/ckpt.pt to resume, checked against the base model (cfg), the module this run would train and its
    settings (checkpoint_differences): each that differs is named with both values, in one line."""
    ck = load_checkpoint(path)
    if ck is None:
        raise ValueError(f"--resume: checkpoint {path} is corrupt (unreadable): delete it to start over, "
                         "or drop --resume")
    if ck["meta"]["base_fingerprint"] != cfg.fingerprint():
        raise ValueError(f"--resume: {path} was trained for {ck['meta'].get('base_model')}, not {cfg.name}: "
                         "use another --out")
    differ = checkpoint_differences(ck, cfg, now, schedule)
    if differ:
        raise ValueError(f"--resume: {path} was made with other settings: {'; '.join(differ)}. It is not corrupt: "
                         "resume with its settings, or pass another --out")
    return ck


def check_own_checkpoint(out, cfg, now, schedule):
    """Without --resume, a run starts at step 0 and replaces OUT/ckpt.pt at its first checkpoint, and appends to
    OUT/log.jsonl: fine for this run's own checkpoint (the same settings, started over), refused for another run's
    (other settings or model, or a file it cannot read), which it would destroy and whose log it would mix into."""
    path = out / "ckpt.pt"
    ck = load_checkpoint(path)
    if ck is None:
        why = "a file train.py cannot read as a checkpoint"
    elif ck["meta"]["base_fingerprint"] != cfg.fingerprint():
        why = f"trained for {ck['meta'].get('base_model')}, not {cfg.name}"
    else:
        differ = checkpoint_differences(ck, cfg, now, schedule)
        if not differ:
            return
        why = f"made with other settings: {'; '.join(differ)}"
    raise ValueError(f"--out {out} holds another run's checkpoint ({path}: {why}): pass another --out, continue that "
                     f"run with its own settings and --resume, or delete {path} to start this one over there")


def resume_from(ck, module, opt, path):
    try:
        module.load_state_dict(ck["module"])
        opt.load_state_dict(ck["opt"])
        torch.set_rng_state(ck["rng"])
    except Exception as e:
        raise ValueError(f"--resume: checkpoint {path} is corrupt ({type(e).__name__}): delete it to start over, "
                         "or drop --resume") from None
    return ck["step"], ck["log"]


def setup_ddp(cfg):
    """(rank, world size); under torchrun, one process per GPU (or gloo on CPU for the test)."""
    if int(os.environ.get("WORLD_SIZE", 1)) <= 1:
        return 0, 1
    dist.init_process_group("nccl" if cfg.device.startswith("cuda") else "gloo")
    if cfg.device.startswith("cuda"):
        cfg.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(cfg.device)
    return dist.get_rank(), dist.get_world_size()


def print0(rank, *args):
    """print on rank 0 alone (under torchrun every rank runs this script)."""
    if rank == 0:
        print(*args)


def all_reduce_grads(module, world):
    """Average the gradients of all ranks (the module runs as a hook inside the frozen model, not as
    a forward DDP could wrap, so we reduce by hand)."""
    for p in module.parameters():
        if p.grad is not None:  # None: e.g. the last layer's v/o/MLP LoRA, which nothing after it reads
            dist.all_reduce(p.grad)  # a sum (gloo has no average)
            p.grad /= world


def draw_rows(rows, n, seed):
    """About n of the training rows for --train-rows: whole groups (a group's members share their context, so a
    split group would hand a small run the same document several times over) drawn in a seeded order until n are
    in, the draw's rows in data.jsonl's order. The same seed draws the same order, so a smaller n's rows are all
    inside a larger n's (a learning curve adds data, it does not swap it)."""
    units = {}
    for r in rows:
        units.setdefault(r.get("group", r["id"]), []).append(r)
    keys = sorted(units)
    random.Random(seed).shuffle(keys)
    chosen, count = set(), 0
    for key in keys:
        if count >= n:
            break
        chosen.add(key)
        count += len(units[key])
    return [r for r in rows if r.get("group", r["id"]) in chosen]


def describe_rows(train_rows, n_held):
    """The training data as its rows are, not as this command's flags say (with --stage train or --init the
    data stage ran earlier, maybe with other flags): sources, prompt and answer lengths, the copy tasks' share."""
    prompt = [len(r["prompt_ids"]) for r in train_rows] or [0]
    answer = [len(r["response_ids"]) for r in train_rows] or [0]
    return dict(sources=sorted({r.get("source", "?") for r in train_rows}), n_train=len(train_rows), n_heldout=n_held,
                prompt_tokens=[min(prompt), max(prompt)], answer_tokens_max=max(answer),
                copy_share=round(sum(r.get("task") in data.COPY_TASKS for r in train_rows) / max(1, len(train_rows)),
                                 3), python=data.PYTHON)


def adapter_metadata(cfg, train_rows, n_held, step, total, stopped_early, log, init_info):
    """What the shipped .json says about how the adapter was made (and how it selects: its rule)."""
    info = dict(rule=cfg.rule, train_data=describe_rows(train_rows, n_held), steps=step, planned_steps=total,
                stopped_early=stopped_early, batch=cfg.batch, lr=cfg.lr, epochs=cfg.epochs,
                heldout=log[-1] if log else None, untrained=log[0] if log else None)
    info["train_data"].update(folder=cfg.data or cfg.out,  # the data stage's folder it trained on
                              **({"drawn": dict(asked=cfg.train_rows, seed=cfg.seed)} if cfg.train_rows else {}))
    if cfg.loss_weights:  # beyond the paper: the layer-weighted loss (extensions/layer_loss.py)
        info["loss"] = dict(layer_weights_from=Path(cfg.loss_weights).name)
    if init_info:  # step 0 was the init adapter, not an untrained module: keep the init's own reference
        info.update(untrained=init_info.get("untrained"),
                    init=dict(path=init_info["path"], steps=init_info.get("steps"), heldout=log[0] if log else None))
    return info


def save_adapter(module, dest):
    """module.save(dest), an adapter already there kept (keep_previous), saying where."""
    if dest.exists() or dest.with_suffix(".json").exists():
        _, kept = keep_previous(dest)
        print(f"{dest} existed: replaced; the previous one is kept as {' + '.join(str(p) for p in kept)}")
    module.save(dest)


def backup_names(dest):
    """NAME.prev.safetensors, NAME.prev2.safetensors, NAME.prev3...: where keep_previous may keep dest."""
    n = 1
    while True:
        yield dest.with_name(f"{dest.stem}.prev{n if n > 1 else ''}.safetensors")
        n += 1


def keep_previous(dest):
    """Copy the adapter at dest (+ .json) to the first backup name (backup_names) free of both files: an earlier
    backup is never replaced (a second run on one --adapter-out replaced .prev, the first adapter with it, while
    saying it was kept). The first file is made with O_EXCL, so two runs saving at once keep theirs under two names.
    Returns (the backup's .safetensors path, the files written)."""
    sources = [src for src in (dest, dest.with_suffix(".json")) if src.exists()]
    for prev in backup_names(dest):
        copies = [(src, prev.with_suffix(src.suffix)) for src in sources]
        if any(p.exists() for p in (prev, prev.with_suffix(".json"))):
            continue
        try:
            with open(copies[0][0], "rb") as first, open(copies[0][1], "xb") as f:  # "xb": the claim
                shutil.copyfileobj(first, f)
        except FileExistsError:  # taken meanwhile by another run
            continue
        shutil.copystat(*copies[0])
        for src, dst in copies[1:]:
            shutil.copy2(src, dst)
        return prev, [dst for _, dst in copies]


# -----------------------------------------------------------------------------
# Stage train: the loop. The module and its optimiser, one optimiser step at a time, the held-out check
# every --eval-every steps, a checkpoint every --save-every, and at the end the adapter


@dataclasses.dataclass
class Training:
    """What the loop advances and the held-out check and the save read: one run's module and progress."""
    module: LookaheadModule  # untrained, or --init's adapter
    opt: torch.optim.Optimizer  # AdamW on the module's parameters
    rows: list  # the training rows with a sample file
    batches: list  # micro-batches: lists of indices into rows
    per_step: int  # micro-batches per optimiser step, all ranks
    steps_per_epoch: int
    total: int  # the optimiser steps planned
    rank: int  # this process's rank (0 without torchrun)
    world: int  # how many ranks
    init_info: dict | None = None  # --init's .json (its file name as "path"), kept in the new one's
    loss: object = kl_loss  # (gt, pred) -> the loss: the paper's, or --loss-weights' (training_loss)
    step: int = 0  # optimiser steps done
    log: list = dataclasses.field(default_factory=list)  # the held-out checks so far (also in OUT/log.jsonl)
    stopped_early: bool = False  # --max-minutes ended the loop before total


def starting_module(model, cfg, adapter, rank):
    """(the module to train, --init's .json or None): --init's adapter (its shape and weights, a new
    schedule) or an untrained module (new_module)."""
    if adapter is None:
        return new_module(model, cfg), None
    module = adapter.to(cfg.device)
    init_info = dict(module.info, path=Path(module.info["path"]).name)
    if "layer_weights" in module.info:  # measured for the init's weights, not the new ones
        print0(rank, f"--init {cfg.init}: its per-layer weights are dropped; measure them again for the trained "
               "adapter (python train.py --stage budgets)")
    module.info = dict(rule=cfg.rule)
    return module, init_info


def new_training(model, cfg, out, train_rows, adapter, ckpt, rank, world):
    """The module, the optimiser, the schedule (steps per epoch, total), and the step and log of the
    checkpoint to resume (ckpt: check_config's; None starts at step 0)."""
    module, init_info = starting_module(model, cfg, adapter, rank)
    opt = torch.optim.AdamW(module.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    batches = micro_batches(train_rows, cfg.micro_batch)
    per_step = max(world, cfg.batch // cfg.micro_batch)  # micro-batches per optimiser step, all ranks
    steps_per_epoch = max(1, len(batches) // per_step)
    total = max(1, round(steps_per_epoch * cfg.epochs))
    run = Training(module, opt, train_rows, batches, per_step, steps_per_epoch, total, rank, world, init_info,
                   loss=training_loss(cfg, model.config))
    ckpt_path = out / "ckpt.pt"
    if ckpt is not None:
        run.step, run.log = resume_from(ckpt, module, opt, ckpt_path)
        print0(rank, f"resumed at step {run.step}/{total}")
    elif cfg.resume:
        print0(rank, f"no checkpoint at {ckpt_path}: starting from step 0")
    elif ckpt_path.exists():
        print0(rank, f"{ckpt_path} exists and --resume was not given: starting from step 0; it is replaced at the "
               "first checkpoint")
    return run


def heldout_check(run, model, heldout, cfg, out):
    """The module as it is now on the held-out prompts (rank 0 alone): one line printed, one row in the
    run's log and in OUT/log.jsonl."""
    if heldout and run.rank == 0:
        m = harness.heldout_metrics(model, run.module, heldout, budgets=(cfg.budget,), window=cfg.window)
        run.log.append(dict(step=run.step, **m))
        print(harness.heldout_line(f"step {run.step}/{run.total} ", m, cfg.budget))
        with open(out / "log.jsonl", "a") as f:
            f.write(json.dumps(run.log[-1]) + "\n")


def loaded_batch(model, rows, indices, load):
    """(cache, targets, lengths) of a micro-batch read from disk, the cache recomputed if the files do not
    hold it."""
    cache, gt, lengths = load.result()
    cache = cache if cache is not None else prompt_cache(model, [rows[i]["prompt_ids"] for i in indices])
    return cache, gt, lengths


def training_step(run, model, reader, cfg, src):
    """One optimiser step on this rank's share of the step's micro-batches: (loss, samples in the step, all
    ranks). The order is a shuffle seeded by the epoch, so every rank and a resumed run take the same."""
    epoch, k = divmod(run.step, run.steps_per_epoch)
    order = list(run.batches)
    random.Random(cfg.seed + epoch).shuffle(order)  # the same order on every rank and on resume
    step_batches = order[k * run.per_step:(k + 1) * run.per_step]
    n_step = sum(len(b) for b in step_batches)  # samples in this step, all ranks
    for g in run.opt.param_groups:
        g["lr"] = lr_at(run.step, run.total, cfg)
    mine = step_batches[run.rank::run.world]
    # the step's micro-batches are read from disk by a second thread while the first ones train
    dtype = model.lm_head.weight.dtype
    loads = [reader.submit(load_batch, [sample_path(src, run.rows[i]["id"]) for i in idx], cfg.device, dtype)
             for idx in mine]
    micro = (loaded_batch(model, run.rows, idx, load) for idx, load in zip(mine, loads))
    return optimizer_step(run.module, run.opt, model, micro, n_step, cfg.clip, run.world, run.loss).item(), n_step


def training_loop(run, model, heldout, cfg, src, out, run_start, train_start):
    """From run.step to run.total, or until --max-minutes after run_start; samples/s count from train_start.
    The samples are read from src, the checkpoint and log written to out. Step 0 checks the untrained module
    (or the --init adapter), the honest reference."""
    reader = ThreadPoolExecutor(max_workers=1)
    if run.step == 0:
        heldout_check(run, model, heldout, cfg, out)
    bar = tqdm(total=run.total, initial=run.step, desc="training", disable=run.rank > 0)
    n_seen = 0
    while run.step < run.total:
        if cfg.max_minutes and time.perf_counter() - run_start > 60 * cfg.max_minutes:
            run.stopped_early = True
            print0(run.rank, f"--max-minutes {cfg.max_minutes} reached at step {run.step}/{run.total}: "
                   "saving what we have")
            heldout_check(run, model, heldout, cfg, out)
            break
        step_loss, n_step = training_step(run, model, reader, cfg, src)
        run.step += 1
        n_seen += n_step
        bar.set_postfix(loss=f"{step_loss:.4f}", samples_s=f"{n_seen / (time.perf_counter() - train_start):.1f}")
        if n_seen == n_step and run.rank == 0 and cfg.device == "cpu":  # this process's first step
            warning = memory_warning(peak_memory_gib(), cli.free_memory_gib("cpu"))  # None where it is unknown
            if warning:
                cli.warn(warning)
        bar.update()
        if run.step % cfg.eval_every == 0 or run.step == run.total:
            heldout_check(run, model, heldout, cfg, out)
        if run.rank == 0 and (run.step % cfg.save_every == 0 or run.step == run.total):
            save_checkpoint(out / "ckpt.pt", run.module, run.opt, run.step, run.log, schedule_of(cfg))
    bar.close()


def peak_memory_gib():
    """This process's peak resident memory so far (Linux reports ru_maxrss in KiB)."""
    import resource  # Unix only: called where /proc/meminfo exists
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def memory_warning(peak, available):
    """After the first step on a CPU (GiB): a warning when what the machine has left is under half of the step's
    peak, else None. A step grows with its batch's prompt lengths (RESULTS.md 8.3: 12.9 GB at step 3 of the 5K
    recipe, 16-17 GB later), and the kernel's OOM killer ends a run without a line in its log; half is that growth
    with room to spare, a rule of thumb, not a measurement of this run's longest batch."""
    if available is None or available >= peak / 2:
        return None
    return (f"the first training step held {peak:.1f} GiB and the machine has {available:.1f} GiB left: a batch "
            "of longer prompts may get this run killed for memory (no line in the log says so); stop the other "
            "jobs (a data stage resumes), or lower --micro-batch")


def save_trained_adapter(run, cfg, out, dest, n_held, train_start):
    """The adapter and its metadata (rank 0); stopped early, a checkpoint too, to resume from where it stopped."""
    if run.stopped_early:
        save_checkpoint(out / "ckpt.pt", run.module, run.opt, run.step, run.log, schedule_of(cfg))
    run.module.info = adapter_metadata(cfg, run.rows, n_held, run.step, run.total, run.stopped_early, run.log,
                                       run.init_info)
    save_adapter(run.module, dest)
    print(f"saved {dest} (+ .json) after {run.step} steps, {time.perf_counter() - train_start:.0f} s")


# -----------------------------------------------------------------------------
# Stage budgets: the adapter's per-layer weights (extensions/layer_budgets.py), written into its .json


def stored_samples(model, out, rows):
    """(cache, target, answer ids (1, R)) of each row from its sample file (the cache recomputed if the
    file holds only the target)."""
    dev, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    for r in rows:
        cache, gt, _ = load_batch([sample_path(out, r["id"])], dev, dtype)
        cache = cache if cache is not None else prompt_cache(model, [r["prompt_ids"]])
        yield cache, gt, torch.tensor([r["response_ids"]], device=dev)


def measure_budgets(model, module, cfg, src, out, rows, dest):
    """The adapter's per-layer weights measured on the first BUDGET_SAMPLES training samples of src (OUT, or --data),
    written into its .json at dest and, as a table, into OUT/layer_weights.json."""
    rows = [r for r in rows if r["split"] == "train" and sample_path(src, r["id"]).exists()][:BUDGET_SAMPLES]
    weights, report = layer_budgets.measure(model, module, stored_samples(model, src, rows), budget=cfg.budget,
                                            progress=lambda it: tqdm(it, total=len(rows), desc="samples"))
    source = module.info.pop("path")
    print(f"adapter {source}, {len(rows)} training samples of {src}, C = {cfg.budget}: "
          f"answer KL {report['answer_kl']:.4f}")
    print("layers  answer-KL gain  weight")
    for (a, b), gain in zip(report["groups"], report["gain"]):
        print(f"{f'{a}-{b}':<7s} {gain:<15.4f} {weights[a]:.2f}")
    how = {k: report[k] for k in ("rows", "C", "group", "floor", "power")}
    table = out / "layer_weights.json"
    if table.exists():
        print(f"{table} existed: replaced")
    table.write_text(json.dumps(dict(weights=weights, adapter=Path(source).name, **report), indent=1) + "\n")
    print(f"wrote {table}")
    module.info.update(layer_weights=weights, layer_weights_from=how)
    save_adapter(module, dest)
    print(f"wrote {dest} (+ .json): its weights as they were, its .json with layer_weights")


# -----------------------------------------------------------------------------
# The run


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    again = "python train.py " + shlex.join([a for a in argv if a != "--resume"] + ["--resume"])
    return cli.run(lambda: train(get_args(argv)), resume=again)


def train(cfg):
    """The run, stage by stage: checks, the base model, then budgets, or data and/or train."""
    run_start = time.perf_counter()  # --max-minutes counts from here (data generation included)
    out, src, dest, _, rows, adapter, ckpt = check_config(cfg)  # everything checked before the model loads
    rank, world = setup_ddp(cfg)
    if rank == 0:  # two runs on one --out would interleave their rows and checkpoints
        cli.claim_folder("--out", out)
        if src != out:  # a data stage still appending to --data's rows would change them under this run
            cli.claim_folder("--data", src)
    torch.manual_seed(cfg.seed)

    # --- the frozen base model
    model, tok, _ = cli.load(cfg.model, cfg.device, cfg.dtype, tokenizer=cfg.stage in ("data", "all"))

    # --- stage budgets: an adapter's per-layer weights (no training)
    if cfg.stage == "budgets":
        if rank == 0:
            measure_budgets(model, adapter.to(cfg.device), cfg, src, out, rows, dest)
        return

    # --- stage data: the samples
    if cfg.stage in ("data", "all"):
        rows = build_dataset(model, tok, cfg, out, rows, rank)
    train_rows = [r for r in rows if r["split"] == "train" and sample_path(src, r["id"]).exists()]
    if cfg.train_rows is not None:
        train_rows = draw_rows(train_rows, cfg.train_rows, cfg.seed)
    held_rows = [r for r in rows if r["split"] == "heldout"]
    if cfg.stage == "data":
        print0(rank, f"data ready: {len(train_rows)} train, {len(held_rows)} held-out rows in {out / 'data.jsonl'}")
        return

    # --- stage train: the module (untrained, or --init), the optimiser, the schedule, a checkpoint to resume
    run = new_training(model, cfg, out, train_rows, adapter, ckpt, rank, world)
    train_start = time.perf_counter()
    # held-out ground truth (rank 0 checks alone), kept beside the rows it is made of (src/heldout)
    heldout = harness.heldout_ground_truth(model, held_rows if rank == 0 else [], out=src)
    training_loop(run, model, heldout, cfg, src, out, run_start, train_start)

    # --- the adapter and its metadata
    if rank == 0:
        save_trained_adapter(run, cfg, out, dest, len(held_rows), train_start)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
