"""
Train the lookahead module (M embeddings + a LoRA on their rows) with the paper's KL loss, the base
model frozen: the module learns to attend to the prompt the way the model's own answer will.

A recipe is a JSON file of TrainConfig fields (below); a flag overrides its file, the file the defaults.
CPU recipe, the shipped adapter (2 cores, float32; RESULTS.md says how long it took; after a kill, rerun
the same command with --resume: the data stage keeps what it wrote, the checkpoint has the optimiser):
    python train.py --config research/configs/train-cpu.json --out runs/cpu \\
        --adapter-out weights/SmolLM2-135M-Instruct.lookahead.safetensors
One GPU, paper-like scale (the prompt caches recomputed in the step instead of kept on disk, which
would take ~430 GB here: research/configs/train-gpu.json's store_dtype "none"; RESULTS.md section 5):
    python train.py --config research/configs/train-gpu.json --out runs/gpu --adapter-out runs/gpu/adapter.safetensors
Several GPUs (data parallel: each rank takes every world_size-th micro-batch; build the samples first):
    python train.py --config research/configs/train-gpu.json --out runs/gpu --stage data && \\
        torchrun --nproc_per_node=8 train.py --config research/configs/train-gpu.json --out runs/gpu --stage train
CPU smoke run (a few minutes on 2 cores):
    python train.py --out runs/smoke --n-train 8 --n-heldout 4 --max-tokens 600 --max-new-tokens 32 --batch 4 --epochs 1

It prints progress bars (answering prompts; training, with the step's loss and samples/s), at step 0 and
every --eval-every steps the validation KL (kl_loss on the held-out samples; also in OUT/log.jsonl), and
at the end where the adapter was saved. Ctrl-C prints the command that resumes. A `warning:` line on a
CPU left with less than half of the first step's memory (the OOM killer ends a run without a line).
Research options (another run's data, a row draw, --init, a weighted loss, shared-context prompts, the
per-layer budgets, the harness's held-out table): python -m research.train_lab --help.

Stages, each resumable (rerun the same command; --resume for the optimiser state: the checkpoint records
the settings that define the run, and a resume with any other is refused; support/recipe.py):
1. data: prompts from offline sources (support/data.py), B at a time: the base model's greedy answer on
   the full cache (baselines.full_answer), then the target: lookaheadkv.answer_attention of the answers on
   the prompt cache, per layer and query head. The prompt's cache (bfloat16) and the target are kept on
   disk, one file per sample (OUT/samples), the rows in OUT/data.jsonl: nothing is prefilled twice.
2. train: B samples at a time, left-padded into one batch (data.load_batch); the M lookahead tokens run
   on top of their caches with gradients (the two-pass form); loss = lookaheadkv.kl_loss.
"""

import argparse
import dataclasses
import json
import math
import os
import random
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from tqdm import tqdm

import methods
from baselines import full_answer
from eviction import EvictConfig, compress
from lookaheadkv import LookaheadModule, answer_attention, kl_loss, lookahead_pass
from support import cli, data, recipe
from support.data import load_batch, sample_ok, sample_path, save_sample

# -----------------------------------------------------------------------------
# Settings: a recipe file (--config) holds any of these; a flag overrides it


@dataclasses.dataclass
class TrainConfig:
    # where
    model: str | None = None  # --model: HF folder of the base model (None: weights/SmolLM2-135M-Instruct)
    out: str = "runs/lookahead"  # --out: the run's folder (data.jsonl, samples/, ckpt.pt, log.jsonl)
    adapter_out: str | None = None  # --adapter-out: the adapter, .safetensors + .json (None: OUT/adapter.safetensors)
    stage: str = "all"  # --stage: data | train (on the samples OUT holds, read only) | all (data + train)
    # data: the prompts and the base model's answers
    n_train: int = 800  # --n-train: training prompts
    n_heldout: int = 32  # --n-heldout: held-out prompts (other documents) for the validation KL
    min_tokens: int = 512  # shortest prompt, in tokens
    max_tokens: int = 2048  # --max-tokens: longest prompt, but for a long_frac share
    long_frac: float = 0.1  # share of prompts longer than max_tokens, up to long_max
    long_max: int = 4096  # longest of the long prompts
    copy_frac: float | None = None  # share of training prompts whose answer copies a span (data.COPY_TASKS;
    # None: the task weights, about a third); the held-out prompts keep the default mix
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
    # optimisation
    epochs: float = 3.0  # --epochs: passes over the training rows (a fraction ends mid-pass)
    batch: int = 32  # --batch: samples per optimiser step, all ranks
    micro_batch: int = 8  # --micro-batch: samples in one lookahead forward (left-padded together)
    lr: float = 1e-3  # --lr: peak learning rate (AdamW)
    weight_decay: float = 0.0  # AdamW weight decay
    warmup: float = 0.02  # share of steps with linear warmup, then cosine to 0
    clip: float = 1.0  # gradient norm clip
    # the validation KL, checkpoints, time
    eval_every: int = 10  # --eval-every: optimiser steps between validation checks
    save_every: int = 10  # --save-every: optimiser steps between checkpoints (OUT/ckpt.pt)
    resume: bool = False  # --resume: continue from OUT/ckpt.pt
    max_minutes: float | None = None  # --max-minutes: stop training (checkpoint + adapter saved) after this long
    # the machine
    device: str | None = None  # --device: cpu, cuda, cuda:1 (None: cuda if there is one)
    dtype: str | None = None  # --dtype: base model dtype, float32 | bfloat16 (None: bfloat16 on CUDA, float32
    # on CPU); the module trains in float32
    seed: int = 0  # --seed: prompts, init, batch order


def parser(prog="train.py", stages=("data", "train", "all")):
    D = TrainConfig()
    p = cli.Parser(prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                   argument_default=argparse.SUPPRESS)
    a = p.add_argument
    a("--config", metavar="JSON", help="a recipe: a JSON object of TrainConfig fields, e.g. research/configs/train-cpu.json")
    a("--model", help="HF folder of the base model (default: weights/SmolLM2-135M-Instruct)")
    a("--out", help=f"the run's folder: data.jsonl, samples, checkpoint, log (default {D.out})")
    a("--adapter-out", help="where the adapter goes, a .safetensors name (its .json beside it; default "
      "OUT/adapter.safetensors); one there already is kept as NAME.prev.safetensors, or NAME.prev2 (3, ...) when "
      "that name is taken: an earlier backup is never replaced")
    a("--stage", choices=stages, help="data: build OUT's samples; train: train on them (read only); all (default): "
      "data, then train")
    a("--n-train", type=int, help=f"training prompts (default {D.n_train})")
    a("--n-heldout", type=int, help=f"held-out prompts for the validation KL (default {D.n_heldout})")
    a("--max-tokens", type=int, help=f"longest prompt, in tokens (default {D.max_tokens})")
    a("--max-new-tokens", type=int, help=f"length cap of the base model's answers (default {D.max_new_tokens})")
    a("--epochs", type=float, help=f"passes over the training rows (default {D.epochs:g})")
    a("--batch", type=int, help=f"samples per optimiser step, all ranks (default {D.batch})")
    a("--micro-batch", type=int, help=f"samples per lookahead forward (default {D.micro_batch})")
    a("--lr", type=float, help=f"peak learning rate (default {D.lr:g})")
    a("--targets", help="LoRA targets: all (default), none, or a comma list of q,k,v,o,gate,up,down _proj")
    a("--resume", action="store_true", help="continue from OUT/ckpt.pt")
    a("--eval-every", type=int, help=f"steps between validation checks (default {D.eval_every})")
    a("--save-every", type=int, help=f"steps between checkpoints (default {D.save_every})")
    a("--max-minutes", type=float, help="stop once this long has passed since the start, data included "
      "(checkpoint + adapter saved, noted in its .json)")
    a("--device", help="cpu, cuda, cuda:1 (default: cuda if there is one)")
    a("--dtype", choices=["float32", "bfloat16"], help="base model dtype (default: bfloat16 on CUDA, else float32)")
    a("--seed", type=int, help=f"default {D.seed}")
    return p


def get_args(argv=None, Config=TrainConfig, p=None):
    """The run's config: flag > --config file > default."""
    flags = vars((p or parser()).parse_args(argv))
    path = flags.pop("config", None)
    return dataclasses.replace(Config(), **{**(recipe.read_config(path, Config) if path else {}), **flags})


def check(cfg, read_adapter=None):
    """Every check that needs no model weights (support/recipe.py), before the model loads."""
    return recipe.check_run(cfg, parser(), methods.parse_rule, read_adapter)


# -----------------------------------------------------------------------------
# Stage data: the base model's greedy answer to each prompt, and the target: that answer's attention
# over the prompt (Eq. 3), per layer and query head. One prefill per prompt, kept on disk with it.


def left_pad(prompts, dev):
    """Token-id lists -> ids (B, S) with left padding, and pad_mask (B, S) True on real tokens."""
    S = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (S - len(p)) + p for p in prompts], device=dev)
    pad_mask = torch.tensor([[False] * (S - len(p)) + [True] * len(p) for p in prompts], device=dev)
    return ids, pad_mask


def full_cache(model, ids, pad_mask):
    """Prefill, nothing evicted: (cache, first-token logits, next positions)."""
    return compress(model, ids, methods.make_scorer(EvictConfig("full")), pad_mask=pad_mask)[:3]


@torch.no_grad()
def answer_and_target(model, tok, prompts, max_new_tokens):
    """For B prompts (token-id lists), prefilled together: the greedy full-cache answer (the stop token
    kept: the answer's end is part of its future) and its target. Returns per prompt a dict: response_ids,
    k and v (L, H_kv, S_b, D) the prompt's cache, target (L, H, S_b), padding removed."""
    ids, pad_mask = left_pad(prompts, model.lm_head.weight.device)
    run, answers = full_answer(model, ids, max_new_tokens, tok.stop_ids, pad_mask)
    return samples_of(model, run.cache, run.next_pos, prompts, answers)


def answer_targets(model, cache, next_pos, answers):
    """The target of B answers (id lists) on their prompts' cache: answer_attention over the answers,
    right-padded (answer_mask), per query head: {layer: (B, H, S)}, 0 on the prompts' padding."""
    R, dev = max(len(a) for a in answers), cache.k[0].device
    answer_ids = torch.tensor([a + [0] * (R - len(a)) for a in answers], device=dev)  # (B, R)
    answer_mask = torch.tensor([[True] * len(a) + [False] * (R - len(a)) for a in answers], device=dev)
    return answer_attention(model, cache, answer_ids, next_pos, answer_mask, per_query_head=True)


def samples_of(model, cache, next_pos, prompts, answers):
    """The samples of B prompts (their cache, left-padded) and answers: each row's own slots of the cache
    and of the target."""
    target, S = answer_targets(model, cache, next_pos, answers), len(cache)
    return [dict(response_ids=a, k=torch.stack([cache.k[l][b][:, S - len(p):] for l in target]),  # (L, H_kv, S_b, D)
                 v=torch.stack([cache.v[l][b][:, S - len(p):] for l in target]),
                 target=torch.stack([target[l][b][:, S - len(p):] for l in target]))  # (L, H, S_b)
            for b, (p, a) in enumerate(zip(prompts, answers))]


def build_dataset(model, tok, cfg, out, rows):
    """Append {id, split, task, prompt_ids, response_ids} rows to OUT/data.jsonl until it holds n_train +
    n_heldout, each row's sample file written first (a killed run loses one batch at most). Rows already
    there are kept; one without a whole sample file gets one from one forward over [prompt; answer]."""
    have = {split: sum(r.get("split") == split for r in rows) for split in ("train", "heldout")}
    done, todo = {r["id"] for r in rows}, []
    todo_any = have["train"] < cfg.n_train or have["heldout"] < cfg.n_heldout
    for split, n in (("train", cfg.n_train), ("heldout", cfg.n_heldout)) if todo_any else ():
        todo += [dict(p, split=split) for p in data.make_training_prompts(
            tok, n, split=split, min_tokens=cfg.min_tokens, max_tokens=cfg.max_tokens, long_frac=cfg.long_frac,
            long_max=cfg.long_max, seed=cfg.seed, copy_frac=cfg.copy_frac if split == "train" else None)
            if p["id"] not in done]
    for p in todo:
        p["prompt_ids"] = tok.encode(tok.chat(p["prompt"]))
    store = None if cfg.store_dtype == "none" else getattr(torch, cfg.store_dtype)
    recipe.check_store(sum(data.sample_bytes(model.config, len(p["prompt_ids"]), store) for p in rows + todo
                           if p["split"] == "train"), cfg)  # the folder's whole disk
    missing = [r for r in rows if r["split"] == "train" and not sample_ok(sample_path(out, r["id"]))]
    for r in tqdm(missing, desc="samples from data.jsonl", disable=not missing):
        if sample_path(out, r["id"]).exists():
            print(f"training sample {sample_path(out, r['id'])} is unreadable (cut short?): made again")
        ids, pad_mask = left_pad([r["prompt_ids"]], model.lm_head.weight.device)
        cache, _, next_pos = full_cache(model, ids, pad_mask)
        save_sample(sample_path(out, r["id"]), samples_of(model, cache, next_pos, [r["prompt_ids"]],
                                                          [r["response_ids"]])[0], store)
    todo.sort(key=lambda p: (p["split"] != "heldout", len(p["prompt_ids"])))  # held-out first; little padding
    B = cfg.gen_batch or (32 if cfg.device.startswith("cuda") else 8)
    made_in = str(model.lm_head.weight.dtype).removeprefix("torch.")  # each row records it: check_data_dtype
    for i in tqdm(range(0, len(todo), B), desc="answering prompts", disable=not todo):
        batch = todo[i:i + B]
        samples = answer_and_target(model, tok, [p["prompt_ids"] for p in batch], cfg.max_new_tokens)
        new = [dict(id=p["id"], split=p["split"], source=p["source"], task=p["task"], base_model=model.config.name,
                    fingerprint=model.config.fingerprint(), dtype=made_in, prompt_ids=p["prompt_ids"],
                    response_ids=s["response_ids"]) for p, s in zip(batch, samples)]
        for r, s in zip(new, samples):  # the sample files first, then the rows that point to them
            if r["split"] == "train":  # held-out rows: validation makes their targets from data.jsonl
                save_sample(sample_path(out, r["id"]), s, store)
        with open(out / "data.jsonl", "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in new)
        rows = rows + new
    return rows


# -----------------------------------------------------------------------------
# Stage train: the loss and one optimiser step. The prediction is lookahead_pass(..., per_query_head=True):
# the M lookahead rows on top of the prompt cache (the two-pass form), the only rows with gradients.


@torch.no_grad()
def prompt_cache(model, prompts):
    """The prompts' KV cache, left-padded together as load_batch pads them, made by one prefill: what a
    training step does instead of reading it from disk with store_dtype none (cheap on a GPU)."""
    return full_cache(model, *left_pad(prompts, model.lm_head.weight.device))[0]


def read_batch(model, src, rows):
    """(cache, targets, lengths) of a micro-batch of rows, read from src (the cache made if not stored)."""
    cache, gt, lengths = load_batch([sample_path(src, r["id"]) for r in rows], model.lm_head.weight.device,
                                    model.lm_head.weight.dtype)
    return (cache if cache is not None else prompt_cache(model, [r["prompt_ids"] for r in rows])), gt, lengths


def batch_loss(model, module, cache, gt, lengths, loss=kl_loss):
    """The loss of one micro-batch: the M lookahead rows on top of each sample's prompt cache (B samples
    in one forward, each at its own prompt length), their attention per query head against the target."""
    return loss(gt, lookahead_pass(model, module, cache, lengths, per_query_head=True))


def optimizer_step(module, opt, model, micro, n_samples, clip, world=1, loss=kl_loss):
    """One optimiser step over this rank's micro-batches (load_batch results), each sample weighing the same
    in the mean over n_samples (all ranks); the ranks' gradients averaged, then clip and step. Returns the
    loss (0-dim). A non-finite loss or gradient steps nothing and raises ValueError (the last checkpoint stays)."""
    total = torch.zeros((), device=next(module.parameters()).device)
    for cache, gt, lengths in micro:
        part = batch_loss(model, module, cache, gt, lengths, loss) * lengths.shape[0] * world / n_samples
        part.backward()
        total += part.detach().float() / world
    for p in module.parameters() if world > 1 else ():  # DDP by hand: the module is a hook, not a forward to wrap
        if p.grad is not None:  # None: e.g. the last layer's v/o/MLP LoRA, which nothing after it reads
            dist.all_reduce(p.grad)  # a sum (gloo has no average)
            p.grad /= world
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
    """Linear warm-up over the first `warmup` share of the steps, then cosine to 0."""
    warm = max(1, round(cfg.warmup * total))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


def new_module(model, cfg):
    """The untrained module of this run's settings, seeded by cfg.seed, selecting with cfg.rule."""
    module = methods.untrained(model, cfg.seed, n_tokens=cfg.n_tokens, rank=cfg.rank, alpha=cfg.alpha,
                               targets=recipe.parse_targets(cfg.targets))
    module.info["rule"] = cfg.rule
    return module


@torch.no_grad()
def validation(model, cfg, rows, src):
    """The paper's validation loss: kl_loss on the held-out rows (rank 0), a micro-batch at a time. Their
    targets are made once; their prompt caches again at each check, as with store_dtype none."""
    held, batches = [r for r in rows if r["split"] == "heldout"], []
    for i in range(0, len(held), cfg.micro_batch):
        prompts = [r["prompt_ids"] for r in held[i:i + cfg.micro_batch]]
        cache, _, next_pos = full_cache(model, *left_pad(prompts, model.lm_head.weight.device))
        batches.append((prompts, next_pos, answer_targets(model, cache, next_pos,
                                                          [r["response_ids"] for r in held[i:i + cfg.micro_batch]])))

    @torch.no_grad()
    def check(module, prefix):
        kl = sum(kl_loss(gt, lookahead_pass(model, module, prompt_cache(model, prompts), next_pos, per_query_head=True))
                 .item() * len(prompts) for prompts, next_pos, gt in batches) / len(held)
        return dict(kl=kl), f"{prefix}validation KL {kl:.4f}"
    return check if held else None


# -----------------------------------------------------------------------------
# The training loop: AdamW, the schedule, an optimiser step over micro-batches, the validation KL every
# --eval-every steps, a checkpoint every --save-every, at the end the adapter (safetensors + .json)

master_process = True  # rank 0 (or no torchrun): the one that checks, saves and prints


def print0(*args):
    if master_process:
        print(*args)


@dataclasses.dataclass
class Pieces:
    """What research/train_lab.py swaps in; train.py's own by default."""
    check: object = lambda cfg: check(cfg)  # cfg -> recipe.check_run's tuple
    build_dataset: object = lambda *a: build_dataset(*a)  # (model, tok, cfg, out, rows) -> rows
    train_rows: object = lambda rows, cfg: rows  # the rows with samples -> the rows to train on
    start: object = lambda model, cfg, adapter: new_module(model, cfg)  # the module to train
    loss: object = kl_loss  # (target, prediction) -> loss
    heldout: object = validation  # (model, cfg, rows, src) -> check(module, prefix) -> (dict, line), or None
    describe: object = lambda cfg, run, info: None  # adds to the adapter's .json (info)


@dataclasses.dataclass
class Run:
    """One run's module and progress: what the loop advances and the checks and the save read."""
    module: LookaheadModule
    opt: torch.optim.Optimizer  # AdamW on the module's parameters
    batches: list  # micro-batches of similar prompt lengths (little padding): lists of indices into the rows
    per_step: int  # micro-batches per optimiser step, all ranks
    steps_per_epoch: int
    total: int  # the optimiser steps planned
    step: int = 0  # optimiser steps done
    log: list = dataclasses.field(default_factory=list)  # the held-out checks so far (also in OUT/log.jsonl)


def new_run(model, cfg, pieces, rows, adapter, ckpt, out, world):
    """The module, AdamW, the schedule, and the step and log of the checkpoint to resume (None: step 0)."""
    module = pieces.start(model, cfg, adapter)
    opt = torch.optim.AdamW(module.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    order = sorted(range(len(rows)), key=lambda i: (len(rows[i]["prompt_ids"]), rows[i]["id"]))
    batches = [order[i:i + cfg.micro_batch] for i in range(0, len(order), cfg.micro_batch)]
    per_step = max(world, cfg.batch // cfg.micro_batch)
    steps_per_epoch = max(1, len(batches) // per_step)
    run = Run(module, opt, batches, per_step, steps_per_epoch, max(1, round(steps_per_epoch * cfg.epochs)))
    if ckpt is not None:
        run.step, run.log = recipe.resume_from(ckpt, module, opt, out / "ckpt.pt")
        print0(f"resumed at step {run.step}/{run.total}")
    elif cfg.resume:
        print0(f"no checkpoint at {out / 'ckpt.pt'}: starting from step 0")
    elif (out / "ckpt.pt").exists():
        print0(f"{out / 'ckpt.pt'} exists and --resume was not given: starting from step 0; it is replaced at the "
               "first checkpoint")
    return run


def check_heldout(run, heldout, out):
    """The module as it is now on the held-out rows (rank 0): one line printed, one row in OUT/log.jsonl."""
    if heldout and master_process:
        metrics, line = heldout(run.module, f"step {run.step}/{run.total} ")
        run.log.append(dict(step=run.step, **metrics))
        print(line)
        with open(out / "log.jsonl", "a") as f:
            f.write(json.dumps(run.log[-1]) + "\n")


def training_step(run, model, cfg, rows, src, loss, reader, rank, world):
    """One optimiser step on this rank's share of the step's micro-batches; the order is a shuffle seeded
    by the epoch (the same on every rank and on resume); a second thread reads the next ones meanwhile."""
    epoch, k = divmod(run.step, run.steps_per_epoch)
    order = list(run.batches)
    random.Random(cfg.seed + epoch).shuffle(order)
    step_batches = order[k * run.per_step:(k + 1) * run.per_step]
    for g in run.opt.param_groups:
        g["lr"] = lr_at(run.step, run.total, cfg)
    loads = [reader.submit(read_batch, model, src, [rows[i] for i in idx]) for idx in step_batches[rank::world]]
    n_step = sum(len(b) for b in step_batches)  # samples in this step, all ranks
    micro = (load.result() for load in loads)
    return optimizer_step(run.module, run.opt, model, micro, n_step, cfg.clip, world, loss).item(), n_step


def train_loop(run, model, cfg, pieces, rows, heldout, out, src, rank, world, run_start):
    """From run.step to run.total, or until --max-minutes after run_start. Step 0 checks the untrained
    module (or --init's), the honest reference."""
    reader, n_seen, t0 = ThreadPoolExecutor(max_workers=1), 0, time.perf_counter()
    if run.step == 0:
        check_heldout(run, heldout, out)
    bar = tqdm(total=run.total, initial=run.step, desc="training", disable=not master_process)
    while run.step < run.total:
        if cfg.max_minutes and time.perf_counter() - run_start > 60 * cfg.max_minutes:
            print0(f"--max-minutes {cfg.max_minutes} reached at step {run.step}/{run.total}: saving what we have")
            check_heldout(run, heldout, out)
            break
        loss, n = training_step(run, model, cfg, rows, src, pieces.loss, reader, rank, world)
        run.step, n_seen = run.step + 1, n_seen + n
        bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{n_seen / (time.perf_counter() - t0):.1f}")
        if n_seen == n and master_process:  # this process's first step: its peak memory is known now
            recipe.warn_memory(cfg.device)
        bar.update()
        if run.step % cfg.eval_every == 0 or run.step == run.total:
            check_heldout(run, heldout, out)
        if master_process and (run.step % cfg.save_every == 0 or run.step == run.total):
            recipe.save_checkpoint(out / "ckpt.pt", run.module, run.opt, run.step, run.log, recipe.schedule_of(cfg))
    bar.close()


# -----------------------------------------------------------------------------
# The run


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    again = "python train.py " + shlex.join([a for a in argv if a != "--resume"] + ["--resume"])
    return cli.run(lambda: train(get_args(argv)), resume=again)


def train(cfg, pieces=None):
    """The run, stage by stage: checks, the base model, data and/or train, the adapter."""
    global master_process
    pieces, run_start = pieces or Pieces(), time.perf_counter()  # --max-minutes counts from here
    out, src, dest, _, rows, adapter, ckpt = pieces.check(cfg)  # everything checked before the model loads

    # --- DDP under torchrun: one process per GPU (gloo on a CPU), each takes every world-th micro-batch
    ddp = int(os.environ.get("WORLD_SIZE", 1)) > 1
    if ddp:
        dist.init_process_group("nccl" if cfg.device.startswith("cuda") else "gloo")
        if cfg.device.startswith("cuda"):
            cfg.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
            torch.cuda.set_device(cfg.device)
    rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
    master_process = rank == 0
    if master_process:  # two runs on one --out would interleave their rows and checkpoints
        cli.claim_folder("--out", out)
        if src != out:  # a data stage still appending to --data's rows would change them under this run
            cli.claim_folder("--data", src)
    torch.manual_seed(cfg.seed)
    model, tok, _ = cli.load(cfg.model, cfg.device, cfg.dtype, tokenizer=cfg.stage in ("data", "all"))

    # --- stage data: the samples
    if cfg.stage in ("data", "all"):
        if master_process:
            rows = pieces.build_dataset(model, tok, cfg, out, rows)
        else:
            recipe.check_data_made(cfg, out, rows)
    train_rows = pieces.train_rows([r for r in rows if r["split"] == "train" and sample_path(src, r["id"]).exists()], cfg)
    n_held = sum(r["split"] == "heldout" for r in rows)
    if cfg.stage == "data":
        return print0(f"data ready: {len(train_rows)} train, {n_held} held-out rows in {out / 'data.jsonl'}")

    # --- stage train
    run = new_run(model, cfg, pieces, train_rows, adapter, ckpt, out, world)
    heldout = pieces.heldout(model, cfg, rows if master_process else [], src)
    train_start = time.perf_counter()
    train_loop(run, model, cfg, pieces, train_rows, heldout, out, src, rank, world, run_start)

    # --- the adapter and its metadata (stopped early: a checkpoint too, to resume from where it stopped)
    if master_process:
        early = run.step < run.total
        if early:
            recipe.save_checkpoint(out / "ckpt.pt", run.module, run.opt, run.step, run.log, recipe.schedule_of(cfg))
        run.module.info = recipe.adapter_metadata(cfg, train_rows, n_held, run.step, run.total, early, run.log)
        pieces.describe(cfg, run, run.module.info)
        recipe.save_adapter(run.module, dest)
        print(f"saved {dest} (+ .json) after {run.step} steps, {time.perf_counter() - train_start:.0f} s")
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
