"""
Train the lookahead module (M embeddings + a LoRA on their rows) with the paper's KL loss, the base model frozen:
it learns to attend to the prompt as the model's own answer will. A recipe is a JSON file of TrainConfig fields.

The learner's run, from scratch on 2 CPU cores in about 25 minutes, data included (README shows what it prints):
    python train.py --config research/configs/train-quick.json --out runs/quick
It prints progress bars, the validation KL at step 0 and every --eval-every steps (also in OUT/log.jsonl),
where the adapter was saved and, at the end, the held-out answer KL at C = 128 beside SnapKV's and the shipped
adapter's. Longer recipes (after a kill, the same command with --resume goes on):
    python train.py --config research/configs/train-cpu.json --out runs/cpu   # 2 CPU cores: hours
    python train.py --config research/configs/train-gpu.json --out runs/gpu   # one GPU, paper-like scale
    python train.py --config research/configs/train-gpu.json --out runs/gpu --stage data && torchrun \\
        --nproc_per_node=8 train.py --config research/configs/train-gpu.json --out runs/gpu --stage train

Stages: 1. data: prompts (support/data.py), the base model's greedy answer on the full cache, then the
target: lookaheadkv.answer_attention of that answer over the prompt cache; cache and target kept on disk
(OUT/samples), the rows in OUT/data.jsonl. 2. train: the M lookahead tokens on micro-batches of cached
prompts, loss = lookaheadkv.kl_loss; AdamW, warm-up then cosine, clipping. Checks, checkpoint and resume
bookkeeping: support/recipe.py. Research options: python -m research.train_lab --help.
"""

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
from lookaheadkv import answer_attention, kl_loss, lookahead_pass
from support import cli, data, recipe, selection
from support.data import left_pad, load_batch, sample_ok, sample_path, save_sample

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
    copy_frac: float | None = None  # share of training prompts whose answer copies a span (None: about a third)
    max_new_tokens: int = 256  # --max-new-tokens: length cap of the base model's answers (paper: 512)
    gen_batch: int | None = None  # prompts answered together (None: 32 on CUDA, 8 on CPU)
    store_dtype: str = "bfloat16"  # prompt caches on disk: bfloat16 | float16 | float32 | none (each step remakes them)
    store_gb: float = 40.0  # refuse to build samples that would take more disk than this (GiB)
    # the module
    n_tokens: int = 32  # M, lookahead tokens
    rank: int = 8  # LoRA rank r
    alpha: float = 32.0  # LoRA alpha (the delta is scaled by alpha / r)
    targets: str = "all"  # --targets: LoRA targets: all (the seven projections), a comma list, or none
    rule: str | None = None  # a selection the adapter's .json recommends beyond the paper, e.g. "span:8:1024"
    # (support/selection.py; generate.py applies it only with --pool); None: the paper's form, max-pool 7
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
    dtype: str | None = None  # --dtype: base model's, float32 | bfloat16 (None: bf16 on CUDA); the module's is fp32
    seed: int = 0  # --seed: prompts, init, batch order
    compare: int | None = None  # end with the held-out answer KL at this C beside SnapKV's and the shipped adapter's


def parser(prog="train.py", stages=("data", "train", "all")):
    """The flags (support/recipe.py: each names a TrainConfig field); --help prints this file's docstring."""
    return recipe.parser(prog, __doc__, TrainConfig(), stages)


def get_args(argv=None, Config=TrainConfig, p=None):
    """The run's config: flag > --config file > default."""
    flags = vars((p or parser()).parse_args(argv))
    path = flags.pop("config", None)
    return dataclasses.replace(Config(), **{**(recipe.read_config(path, Config) if path else {}), **flags})


# -----------------------------------------------------------------------------
# Stage data: each prompt's greedy answer, and the target: that answer's attention over the prompt (Eq. 3)

def full_cache(model, ids, pad_mask):
    """Prefill, nothing evicted: (cache, first-token logits, next positions)."""
    return compress(model, ids, methods.make_scorer(EvictConfig("full")), pad_mask=pad_mask)[:3]


@torch.no_grad()
def answer_and_target(model, tok, prompts, max_new_tokens):
    """B prompts (id lists) prefilled together: per prompt, the greedy answer (its stop token kept: the end is part
    of its future), the prompt's cache k, v (L, H_kv, S_b, D) and the target (L, H, S_b), padding removed."""
    ids, pad_mask = left_pad(prompts, model.lm_head.weight.device)
    run, answers = full_answer(model, ids, max_new_tokens, tok.stop_ids, pad_mask)
    return samples_of(model, run.cache, run.next_pos, prompts, answers)


def answer_targets(model, cache, next_pos, answers):
    """answer_attention of B answers (id lists, right-padded: answer_mask) on their prompts' cache."""
    R, dev = max(len(a) for a in answers), cache.k[0].device
    answer_ids = torch.tensor([a + [0] * (R - len(a)) for a in answers], device=dev)  # (B, R)
    answer_mask = torch.tensor([[True] * len(a) + [False] * (R - len(a)) for a in answers], device=dev)
    return answer_attention(model, cache, answer_ids, next_pos, answer_mask, per_query_head=True)  # {l: (B, H, S)}


def samples_of(model, cache, next_pos, prompts, answers):
    """B samples from their prompts' cache (left-padded): the target, then each row's own slots."""
    target, S = answer_targets(model, cache, next_pos, answers), len(cache)
    return [dict(response_ids=a, k=torch.stack([cache.k[l][b][:, S - len(p):] for l in target]),  # (L, H_kv, S_b, D)
                 v=torch.stack([cache.v[l][b][:, S - len(p):] for l in target]),
                 target=torch.stack([target[l][b][:, S - len(p):] for l in target]))  # (L, H, S_b)
            for b, (p, a) in enumerate(zip(prompts, answers))]


def build_dataset(model, tok, cfg, out, rows):
    """Append rows to OUT/data.jsonl until it holds n_train + n_heldout, each training row's sample file first
    (a killed run loses one batch); a row there without a whole sample file gets one from its own answer."""
    todo = data.prompts_to_answer(tok, rows, cfg.n_train, cfg.n_heldout, **{k: getattr(cfg, k) for k in (
        "copy_frac", "seed", "min_tokens", "max_tokens", "long_frac", "long_max")})
    store = None if cfg.store_dtype == "none" else getattr(torch, cfg.store_dtype)
    recipe.check_store(cfg, model.config, rows + todo, store)  # the folder's whole disk, before any work
    missing = [r for r in rows if r["split"] == "train" and not sample_ok(sample_path(out, r["id"]))]
    for r in tqdm(missing, desc="samples from data.jsonl", disable=not missing):
        if sample_path(out, r["id"]).exists():
            print(f"training sample {sample_path(out, r['id'])} is unreadable (cut short?): made again")
        cache, _, next_pos = full_cache(model, *left_pad([r["prompt_ids"]], model.lm_head.weight.device))
        save_sample(sample_path(out, r["id"]), samples_of(model, cache, next_pos, [r["prompt_ids"]],
                                                          [r["response_ids"]])[0], store)
    todo.sort(key=lambda p: (p["split"] != "heldout", len(p["prompt_ids"])))  # held-out first; little padding
    B = cfg.gen_batch or (32 if cfg.device.startswith("cuda") else 8)
    made_in = str(model.lm_head.weight.dtype).removeprefix("torch.")  # each row records it: check_data_dtype
    for i in tqdm(range(0, len(todo), B), desc="answering prompts", disable=not todo):
        if recipe.past_max_minutes(cfg):  # --max-minutes covers the data stage; the rows so far are kept
            print(f"--max-minutes reached in the data stage: {len(rows)} rows kept; the same command goes on")
            break
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
# Stage train: the loss (the M lookahead rows on the prompt cache, the two-pass form) and one optimiser step

@torch.no_grad()
def prompt_cache(model, prompts):
    """The prompts' KV cache, left-padded as load_batch pads them: a step's, with store_dtype none."""
    return full_cache(model, *left_pad(prompts, model.lm_head.weight.device))[0]


def read_batch(model, src, rows):
    """(cache, targets, lengths) of a micro-batch of rows, read from src (the cache made if not stored)."""
    cache, gt, lengths = load_batch([sample_path(src, r["id"]) for r in rows], model.lm_head.weight.device,
                                    model.lm_head.weight.dtype)
    return (cache if cache is not None else prompt_cache(model, [r["prompt_ids"] for r in rows])), gt, lengths


def batch_loss(model, module, cache, gt, lengths, loss=kl_loss):
    """One micro-batch's loss: the M lookahead rows on each prompt's cache (at its own length) against the target."""
    return loss(gt, lookahead_pass(model, module, cache, lengths, per_query_head=True))


def optimizer_step(module, opt, model, micro, n_samples, clip, world=1, loss=kl_loss):
    """One optimiser step over this rank's micro-batches (load_batch results), each sample weighing the same in
    the mean over n_samples (all ranks); the ranks' gradients averaged, then clip and step: the loss (0-dim)."""
    total = torch.zeros((), device=next(module.parameters()).device)
    for cache, gt, lengths in micro:
        part = batch_loss(model, module, cache, gt, lengths, loss) * lengths.shape[0] * world / n_samples
        part.backward()
        total += part.detach().float() / world
    for p in module.parameters() if world > 1 else ():  # DDP by hand: the module is a hook, not a forward to wrap
        if p.grad is not None:  # None: the last layer's v/o/MLP LoRA (LookaheadModule says why)
            dist.all_reduce(p.grad)  # a sum (gloo has no average)
            p.grad /= world
    recipe.clip_finite(module, opt, clip)  # a nan or inf: ValueError, nothing stepped
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
    """The untrained module of this run's settings, seeded by cfg.seed (its .json recommends cfg.rule, if any)."""
    module = methods.untrained(model, cfg.seed, n_tokens=cfg.n_tokens, rank=cfg.rank, alpha=cfg.alpha,
                               targets=recipe.parse_targets(cfg.targets))
    if cfg.rule is not None:
        module.info["rule"] = cfg.rule
    return module


def validation(model, cfg, rows, src):
    """The paper's validation loss: kl_loss on the held-out rows of data.jsonl (rank 0), a micro-batch at a time."""
    held = [r for r in rows if r["split"] == "heldout"]

    @torch.no_grad()
    def check(module, prefix):
        kl = 0.0
        for i in range(0, len(held), cfg.micro_batch):
            batch = held[i:i + cfg.micro_batch]
            cache, _, next_pos = full_cache(model, *left_pad([r["prompt_ids"] for r in batch], model.lm_head.weight.device))
            target = answer_targets(model, cache, next_pos, [r["response_ids"] for r in batch])
            kl += kl_loss(target, lookahead_pass(model, module, cache, next_pos, per_query_head=True)).item() * len(batch)
        return dict(kl=kl / len(held)), f"{prefix}validation KL {kl / len(held):.4f}"
    return check if held else None


# -----------------------------------------------------------------------------
# The loop and the run: AdamW, the schedule, optimiser steps over micro-batches, the validation KL every
# --eval-every steps, a checkpoint every --save-every, at the end the adapter (safetensors + .json)

master_process = True  # rank 0 (or no torchrun): the one that checks, saves and prints


def print0(*args):
    if master_process:
        print(*args)


class Recipe:
    """The paper's recipe, a method per step; research/train_lab.py subclasses it for its options."""

    def __init__(self, cfg):
        self.cfg = cfg

    def check(self):  # everything checked before the model loads: a recipe.Checked
        return recipe.check_run(self.cfg, parser(), selection.parse_rule)
    def build_dataset(self, model, tok, out, rows):  # stage data: rows, each training row with its sample file
        return build_dataset(model, tok, self.cfg, out, rows)
    def train_rows(self, rows):  # the rows with samples -> the rows to train on: all of them
        return rows
    def start(self, model, adapter):  # the module to train: an untrained one
        return new_module(model, self.cfg)
    def loss(self, target, prediction):  # the paper's KL (Eq. 4)
        return kl_loss(target, prediction)
    def heldout(self, model, rows, src):  # check(module, prefix) -> (dict, line), or None
        return validation(model, self.cfg, rows, src)
    def describe(self, log, info):  # what the adapter's .json adds about the run: nothing more
        pass


def check_heldout(heldout, module, step, total, log, out):
    """The module as it is now on the held-out rows (rank 0): one line printed, one row in OUT/log.jsonl."""
    if heldout and master_process:
        metrics, line = heldout(module, f"step {step}/{total} ")
        log.append(dict(step=step, **metrics))
        print(line)
        with open(out / "log.jsonl", "a") as f:
            f.write(json.dumps(log[-1]) + "\n")


def train_loop(model, cfg, steps, rows, heldout, out, src, adapter, ckpt, rank, world, run_start):
    """AdamW from the checkpoint's step (or 0) to the planned total, or until --max-minutes after run_start:
    (module, opt, step, total, log). Step 0 checks the untrained module (or --init's), the honest reference."""
    module = steps.start(model, adapter)
    opt = torch.optim.AdamW(module.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    # micro-batches of similar prompt lengths (little padding); each epoch shuffles them, not what is in them
    order = sorted(range(len(rows)), key=lambda i: (len(rows[i]["prompt_ids"]), rows[i]["id"]))
    batches = [order[i:i + cfg.micro_batch] for i in range(0, len(order), cfg.micro_batch)]
    per_step = max(world, cfg.batch // cfg.micro_batch)  # micro-batches per optimiser step, all ranks
    steps_per_epoch = max(1, len(batches) // per_step)
    total = max(1, round(steps_per_epoch * cfg.epochs))
    step, log = recipe.resume_from(ckpt, module, opt, out / "ckpt.pt") if ckpt is not None else (0, [])
    if note := recipe.resume_note(cfg.resume, out / "ckpt.pt", ckpt is not None, step, total):
        print0(note)
    if step == 0:
        check_heldout(heldout, module, step, total, log, out)
    reader, n_seen, t0 = ThreadPoolExecutor(max_workers=1), 0, time.perf_counter()
    bar = tqdm(total=total, initial=step, desc="training", disable=not master_process)
    while step < total:
        if cfg.max_minutes and time.perf_counter() - run_start > 60 * cfg.max_minutes:
            print0(f"--max-minutes {cfg.max_minutes} reached at step {step}/{total}: saving what we have")
            check_heldout(heldout, module, step, total, log, out)
            break
        epoch, k = divmod(step, steps_per_epoch)
        random.Random(cfg.seed + epoch).shuffle(epoch_order := list(batches))  # the same on every rank, on resume
        step_batches = epoch_order[k * per_step:(k + 1) * per_step]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, cfg)
        # this rank's share of the step, read from disk by a second thread while the first ones train
        loads = [reader.submit(read_batch, model, src, [rows[i] for i in idx]) for idx in step_batches[rank::world]]
        n_step = sum(len(b) for b in step_batches)  # samples in this step, all ranks
        loss = optimizer_step(module, opt, model, (l.result() for l in loads), n_step, cfg.clip, world, steps.loss)
        step, n_seen = step + 1, n_seen + n_step
        bar.set_postfix(loss=f"{loss.item():.4f}", samples_s=f"{n_seen / (time.perf_counter() - t0):.1f}")
        bar.update()
        if n_seen == n_step and master_process:  # this process's first step: its peak memory is known now
            recipe.warn_memory(cfg.device)
        if step % cfg.eval_every == 0 or step == total:
            check_heldout(heldout, module, step, total, log, out)
        if master_process and (step % cfg.save_every == 0 or step == total):
            recipe.save_checkpoint(out / "ckpt.pt", module, opt, step, log, recipe.schedule_of(cfg))
    bar.close()
    return module, opt, step, total, log


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    again = "python train.py " + shlex.join([a for a in argv if a != "--resume"] + ["--resume"])
    return cli.run(lambda: train(get_args(argv)), resume=again)


def train(cfg, steps=None):
    """The run, stage by stage: checks, the base model, data and/or train, the adapter."""
    global master_process
    steps, run_start = steps or Recipe(cfg), time.perf_counter()  # --max-minutes counts from here
    run = steps.check()  # everything checked before the model loads

    # --- DDP under torchrun: one process per GPU (gloo on a CPU), each takes every world-th micro-batch
    ddp = int(os.environ.get("WORLD_SIZE", 1)) > 1
    if ddp:
        dist.init_process_group("nccl" if cfg.device.startswith("cuda") else "gloo")
        if cfg.device.startswith("cuda"):
            cfg.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
            torch.cuda.set_device(cfg.device)
    rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
    master_process = rank == 0
    if master_process:  # one writer per folder: two runs on one --out would interleave their rows and checkpoints
        recipe.claim_folders(run.out, run.src)
    torch.manual_seed(cfg.seed)
    model, tok, _ = cli.load(cfg.model, cfg.device, cfg.dtype, tokenizer=cfg.stage in ("data", "all"))

    # --- stage data: the samples
    rows = run.rows
    if cfg.stage in ("data", "all"):
        if master_process:
            rows = steps.build_dataset(model, tok, run.out, rows)
        else:
            recipe.check_data_made(cfg, run.out, rows)
    if cfg.stage == "all" and recipe.past_max_minutes(cfg):
        return print0("--max-minutes reached in the data stage: training not started; the same command goes on")
    train_rows = steps.train_rows([r for r in rows if r["split"] == "train" and sample_path(run.src, r["id"]).exists()])
    n_held = sum(r["split"] == "heldout" for r in rows)
    if cfg.stage == "data":
        return print0(f"data ready: {len(train_rows)} train, {n_held} held-out rows in {run.out / 'data.jsonl'}")

    # --- stage train
    heldout, train_start = steps.heldout(model, rows if master_process else [], run.src), time.perf_counter()
    module, opt, step, total, log = train_loop(model, cfg, steps, train_rows, heldout, run.out, run.src, run.adapter,
                                               run.ckpt, rank, world, run_start)

    # --- the adapter and its metadata (stopped early: a checkpoint too, to resume from where it stopped)
    if master_process:
        if step < total:
            recipe.save_checkpoint(run.out / "ckpt.pt", module, opt, step, log, recipe.schedule_of(cfg))
        module.info = recipe.adapter_metadata(cfg, train_rows, n_held, step, total, step < total, log)
        steps.describe(log, module.info)
        recipe.save_adapter(module, run.dest)
        print(f"saved {run.dest} (+ .json) after {step} steps, {time.perf_counter() - train_start:.0f} s")
        if cfg.compare:  # the learner's run ends with what it bought, in answers
            recipe.compare(model, [r for r in rows if r["split"] == "heldout"], cfg.compare,
                            {"this adapter": module, "untrained (step 0)": new_module(model, cfg)})
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
