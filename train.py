"""
Train the lookahead module (M embeddings + a LoRA on their rows) with the paper's KL loss, the base
model frozen: it learns to attend to the prompt as the model's own answer will.

    python train.py --config research/configs/train-quick.json --out runs/quick  # ~25 min, 2 CPUs
    python train.py --config research/configs/train-gpu.json --out runs/gpu      # one GPU
    torchrun --nproc_per_node=8 train.py ... --stage train    # after --stage data on one process

1. data: prompts from the text sources (support/data.py), the base model's greedy answer on the
   full cache, then the target: its attention over the prompt (lookaheadkv.answer_attention).
2. train: the M lookahead rows on micro-batches of cached prompts, lookaheadkv.kl_loss, AdamW,
   warm-up then cosine, clipping; the validation KL on held-out prompts; checkpoints (--resume).
A recipe (--config) is a JSON file of TrainConfig fields; a flag overrides it (a flag given twice: the
last counts, the earlier is still checked). Every setting and file is checked before the model loads
(support/recipe.py), the free disk for the samples, checkpoint and adapter too; a run whose validation KL
turns NaN stops there and saves no adapter. Research options: research/train_lab.py.
"""

import dataclasses
import json
import math
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from tqdm import tqdm

import methods
from baselines import full_answer
from eviction import EvictConfig, compress, left_pad
from lookaheadkv import answer_attention, kl_loss, lookahead_pass
from model import KVCache, load_model
from support.cli import run, warn
from support.data import prompts_to_answer
from support.recipe import (RunFolder, adapter_metadata, check, check_diverged, compare, parser as recipe_parser,
                            resume_command, worse_than_untrained)
from support.tokenizer import Tokenizer

# -----------------------------------------------------------------------------
# Settings: a recipe file (--config) holds any of these; a flag overrides it


@dataclasses.dataclass
class TrainConfig:
    # where
    model: str | None = None  # --model: the base model's HF folder (None: SmolLM2-135M-Instruct)
    out: str = "runs/lookahead"  # --out: the run's folder (data.jsonl, samples/, ckpt.pt, log)
    adapter_out: str | None = None  # --adapter-out: the adapter (None: OUT/adapter.safetensors)
    stage: str = "all"  # --stage: data | train (on the samples OUT holds) | all (data + train)
    # data: the prompts and the base model's answers
    n_train: int = 800  # --n-train: training prompts
    n_heldout: int = 32  # --n-heldout: held-out prompts (other documents) for the validation KL
    min_tokens: int = 512  # shortest prompt, in tokens
    max_tokens: int = 2048  # --max-tokens: longest prompt, but for a long_frac share
    long_frac: float = 0.1  # share of prompts longer than max_tokens, up to long_max
    long_max: int = 4096  # longest of the long prompts
    copy_frac: float | None = None  # share of prompts whose answer copies a span (None: ~1/3)
    max_new_tokens: int = 256  # --max-new-tokens: the base model's answers' cap (paper: 512)
    gen_batch: int | None = None  # prompts answered together (None: 32 on CUDA, 8 on CPU)
    store_dtype: str = "bfloat16"  # caches on disk: bfloat16 | float16 | float32 | none (remade)
    store_gb: float = 40.0  # refuse to build samples that would take more disk than this (GiB)
    # the module
    n_tokens: int = 32  # M, lookahead tokens
    rank: int = 8  # LoRA rank r
    alpha: float = 32.0  # LoRA alpha (the delta is scaled by alpha / r)
    targets: str = "all"  # --targets: all (the seven projections), a comma list, or none
    rule: str | None = None  # a selection the adapter's .json recommends beyond the paper, e.g.
    # "span:8:1024" (generate.py applies it only with --pool); None: the paper's form, max-pool 7
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
    max_minutes: float | None = None  # --max-minutes: stop after this long (all saved)
    # the machine
    device: str | None = None  # --device: cpu, cuda, cuda:1 (None: cuda if there is one)
    dtype: str | None = None  # --dtype: the base model's, float32 | bfloat16 (None: bf16 on CUDA)
    seed: int = 0  # --seed: prompts, init, batch order
    compare: int | None = None  # end with the held-out answer KL at this C beside SnapKV's


def parser(prog="train.py", stages=("data", "train", "all")):
    """The flags, each naming a TrainConfig field; --help prints this file's docstring."""
    return recipe_parser(prog, __doc__, TrainConfig(), stages)


def get_args(argv=None, Config=TrainConfig, p=None):  # flag > --config file > default
    return (p or parser()).config(argv, Config)


def resolved(cfg):
    """The config as this machine runs it: the device and dtype named, a micro-batch no larger than
    the batch (--batch 4 with the default micro-batch of 8 is one micro-batch of 4)."""
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = cfg.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    return dataclasses.replace(cfg, device=device, dtype=dtype,
                               micro_batch=min(cfg.micro_batch, cfg.batch))


# -----------------------------------------------------------------------------
# Stage data: each prompt's greedy answer, and the target: its attention over the prompt (Eq. 3)

def full_cache(model, ids, pad_mask):
    """Prefill, nothing evicted: (cache, first-token logits, next positions)."""
    return compress(model, ids, methods.make_scorer(EvictConfig("full")), pad_mask=pad_mask)[:3]


@torch.no_grad()
def answer_and_target(model, tok, prompts, max_new_tokens):
    """B prompts (id lists) prefilled together: per prompt, the greedy answer (its stop token kept:
    the end is part of its future), the cache k, v (L, H_kv, S_b, D) and the target (L, H, S_b)."""
    ids, pad_mask = left_pad(prompts, model.lm_head.weight.device)
    run_, answers = full_answer(model, ids, max_new_tokens, tok.stop_ids, pad_mask)
    return samples_of(model, run_.cache, run_.next_pos, prompts, answers)


def answer_targets(model, cache, next_pos, answers):
    """answer_attention of B answers (id lists, right-padded: answer_mask) on their prompts' cache.
    """
    R, dev = max(len(a) for a in answers), cache.k[0].device
    answer_ids = torch.tensor([a + [0] * (R - len(a)) for a in answers], device=dev)  # (B, R)
    answer_mask = torch.tensor([[True] * len(a) + [False] * (R - len(a)) for a in answers],
                               device=dev)
    return answer_attention(model, cache, answer_ids, next_pos, answer_mask,
                            per_query_head=True)  # {l: (B, H, S)}


def samples_of(model, cache, next_pos, prompts, answers):
    """B samples from their prompts' cache (left-padded): the target, then each row's own slots."""
    target, S = answer_targets(model, cache, next_pos, answers), len(cache)
    return [dict(response_ids=a,
                 # (L, H_kv, S_b, D)
                 k=torch.stack([cache.k[l][b][:, S - len(p):] for l in target]),
                 v=torch.stack([cache.v[l][b][:, S - len(p):] for l in target]),
                 target=torch.stack([target[l][b][:, S - len(p):] for l in target]))  # (L, H, S_b)
            for b, (p, a) in enumerate(zip(prompts, answers))]


def build_dataset(model, tok, cfg, folder, rows, out_of_time=lambda: False):
    """Append rows to OUT/data.jsonl until it holds n_train + n_heldout, each training row's sample
    file first (a killed run loses one batch); a row there without a whole sample file gets one from
    its own answer. out_of_time() is asked between batches (--max-minutes counts the data stage)."""
    todo = prompts_to_answer(tok, rows, cfg.n_train, cfg.n_heldout, **{k: getattr(cfg, k) for k in (
        "copy_frac", "seed", "min_tokens", "max_tokens", "long_frac", "long_max")})
    store = None if cfg.store_dtype == "none" else getattr(torch, cfg.store_dtype)
    folder.check_store(cfg, model.config, rows + todo, store)  # the whole disk, before any work
    dev = model.lm_head.weight.device
    for r in tqdm(folder.missing_samples(rows), desc="samples from data.jsonl"):
        cache, _, next_pos = full_cache(model, *left_pad([r["prompt_ids"]], dev))
        folder.save_sample(r["id"], samples_of(model, cache, next_pos, [r["prompt_ids"]],
                                               [r["response_ids"]])[0], store)
    todo.sort(key=lambda p: (p["split"] != "heldout", len(p["prompt_ids"])))  # little padding
    B = cfg.gen_batch or (32 if cfg.device.startswith("cuda") else 8)
    for i in tqdm(range(0, len(todo), B), desc="answering prompts", disable=not todo):
        if out_of_time():  # the rows so far are kept
            print(f"--max-minutes reached in the data stage: {len(rows)} rows kept; the same "
                  "command "
                  "goes on")
            break
        batch = todo[i:i + B]
        samples = answer_and_target(model, tok, [p["prompt_ids"] for p in batch],
                                    cfg.max_new_tokens)
        new = [dict(id=p["id"], split=p["split"], source=p["source"], task=p["task"],
                    base_model=model.config.name, fingerprint=model.config.fingerprint(),
                    dtype=cfg.dtype, prompt_ids=p["prompt_ids"], response_ids=s["response_ids"])
               for p, s in zip(batch, samples)]
        for r, s in zip(new, samples):  # the sample files first, then the rows that point to them
            if r["split"] == "train":  # held-out rows: validation makes their targets itself
                folder.save_sample(r["id"], s, store)
        folder.append_rows(new)
        rows = rows + new
    return rows


# -----------------------------------------------------------------------------
# Stage train: a batch, the learning rate, the validation KL, the loop

def get_batch(paths, dev, dtype):
    """Sample files of different lengths, left-padded into one batch: a KVCache with (B, H_kv, S, D)
    per layer and its valid mask (B, 1, S) (None when the files hold no cache: store_dtype none),
    the targets {layer: (B, H, S)} (zero on padding: they add nothing to the KL) and each row's
    prompt length (B,), where its lookahead rows start."""
    items = [RunFolder.read_sample(p) for p in paths]
    lengths = [it["target"].shape[-1] for it in items]
    B, S, (L, H) = len(items), max(lengths), items[0]["target"].shape[:2]
    target = torch.zeros(L, B, H, S, device=dev)
    stored = "k" in items[0]
    if stored:  # one copy per sample, straight into its slot of the padded batch (bf16 -> dtype)
        H_kv, D = items[0]["k"].shape[1], items[0]["k"].shape[-1]
        k = torch.zeros(L, B, H_kv, S, D, dtype=dtype, device=dev)
        v = torch.zeros_like(k)
    for b, (it, n) in enumerate(zip(items, lengths)):
        target[:, b, :, S - n:] = it["target"]
        if stored:
            k[:, b, :, S - n:], v[:, b, :, S - n:] = it["k"], it["v"]
    cache = None
    if stored:
        valid = (torch.arange(S)[None] >= S - torch.tensor(lengths)[:, None])[:, None].to(dev)
        cache = KVCache(L)
        for l in range(L):
            cache.k[l], cache.v[l], cache.valid[l] = k[l], v[l], valid
    return cache, {l: target[l] for l in range(L)}, torch.tensor(lengths, device=dev)


@torch.no_grad()
def prompt_cache(model, prompts):
    """The prompts' KV cache, left-padded as get_batch pads them (store_dtype none: each step)."""
    return full_cache(model, *left_pad(prompts, model.lm_head.weight.device))[0]


def lr_at(step, total, cfg):
    """Linear warm-up over the first `warmup` share of the steps, then cosine to 0."""
    warm = max(1, round(cfg.warmup * total))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


def new_module(model, cfg):
    """The untrained module of this run's settings, seeded by cfg.seed."""
    module = methods.untrained(model, cfg.seed, n_tokens=cfg.n_tokens, rank=cfg.rank,
                               alpha=cfg.alpha, targets=methods.parse_targets(cfg.targets))
    if cfg.rule is not None:
        module.info["rule"] = cfg.rule
    return module


def validation(model, rows, micro_batch):
    """The paper's validation loss: kl_loss on the held-out rows (rank 0), a micro-batch at a time;
    a check(module, prefix) -> (metrics, the line to print), or None without held-out rows."""
    held = [r for r in rows if r["split"] == "heldout"]
    dev = model.lm_head.weight.device

    @torch.no_grad()
    def check_kl(module, prefix):
        kl = 0.0
        for i in range(0, len(held), micro_batch):
            batch = held[i:i + micro_batch]
            cache, _, next_pos = full_cache(model, *left_pad([r["prompt_ids"] for r in batch], dev))
            target = answer_targets(model, cache, next_pos, [r["response_ids"] for r in batch])
            pred = lookahead_pass(model, module, cache, next_pos, per_query_head=True)
            kl += kl_loss(target, pred).item() * len(batch)
        return dict(kl=kl / len(held)), f"{prefix}validation KL {kl / len(held):.4f}"
    return check_kl if held else None


def optimizer_step(module, opt, model, micro, n_samples, clip, world=1, loss=None):
    """One optimiser step over this rank's micro-batches (get_batch results): the M lookahead rows
    on each prompt's cache at its own length, kl_loss against the target (or `loss`), each sample
    weighing the same in the mean over n_samples (all ranks); the ranks' gradients averaged; then
    clip and step. Returns the step's loss (0-dim). A nan or inf is one ValueError line, nothing
    stepped."""
    loss = loss or kl_loss
    total = torch.zeros((), device=next(module.parameters()).device)
    for cache, target, lengths in micro:
        pred = lookahead_pass(model, module, cache, lengths, per_query_head=True)
        part = loss(target, pred) * lengths.shape[0] * world / n_samples
        part.backward()
        total += part.detach().float() / world
    for p in module.parameters() if world > 1 else ():  # DDP by hand: the module is a hook
        if p.grad is not None:  # None: the last layer's v/o/MLP LoRA (LookaheadModule says why)
            dist.all_reduce(p.grad)  # a sum (gloo has no average)
            p.grad /= world
    try:  # a nan or inf (a bad sample, too high a rate): stop with the last good checkpoint
        torch.nn.utils.clip_grad_norm_(module.parameters(), clip, error_if_nonfinite=True)
    except RuntimeError as e:
        if "non-finite" not in str(e):
            raise
        opt.zero_grad(set_to_none=True)
        raise ValueError("the training loss or its gradient is not finite (nan or inf): stopped "
                         "before this step (OUT/ckpt.pt keeps the last good checkpoint); check the "
                         "data or --init's adapter, or lower --lr; then --resume") from None
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


master_process = True  # rank 0 (or no torchrun): the one that prints and saves


def print0(*args):
    if master_process:
        print(*args)


def train_loop(model, module, cfg, rows, folder, heldout, weights_id, out_of_time, loss=None,
               rank=0, world=1):
    """AdamW from the checkpoint's step (or 0) to the planned total, or until out_of_time():
    (module, optimiser, step, total, log). Step 0 checks the untrained module, the honest reference.
    """
    opt = torch.optim.AdamW(module.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    # micro-batches of similar prompt lengths (little padding); each epoch shuffles them
    order = sorted(range(len(rows)), key=lambda i: (len(rows[i]["prompt_ids"]), rows[i]["id"]))
    batches = [order[i:i + cfg.micro_batch] for i in range(0, len(order), cfg.micro_batch)]
    per_step = max(world, cfg.batch // cfg.micro_batch)  # micro-batches per step, all ranks
    steps_per_epoch = max(1, len(batches) // per_step)
    total = max(1, round(steps_per_epoch * cfg.epochs))
    step, log = folder.resume(module, opt, total, cfg.resume)
    dev, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype

    def evaluate():  # the held-out check (rank 0): one line printed, one row in OUT/log.jsonl
        if heldout and master_process:
            metrics, line = heldout(module, f"step {step}/{total} ")
            log.append(dict(step=step, **metrics))
            print(line)
            folder.append_log(log[-1])
            check_diverged(log, folder.out / "ckpt.pt")  # a NaN KL: stopped here, before a checkpoint is written

    def batch(idx):  # a micro-batch read from disk (its prompt caches made again if not stored)
        paths = [folder.sample_path(rows[i]["id"]) for i in idx]
        cache, target, lengths = get_batch(paths, dev, dtype)
        if cache is None:
            cache = prompt_cache(model, [rows[i]["prompt_ids"] for i in idx])
        return cache, target, lengths

    if step == 0:
        evaluate()
    reader, n_seen, t0 = ThreadPoolExecutor(max_workers=1), 0, time.perf_counter()
    bar = tqdm(total=total, initial=step, desc="training", disable=not master_process)
    while step < total:
        if out_of_time():
            print0(f"--max-minutes {cfg.max_minutes} reached at step {step}/{total}: saving what "
                   "we have")
            evaluate()
            break
        epoch, k = divmod(step, steps_per_epoch)
        epoch_order = list(batches)
        random.Random(cfg.seed + epoch).shuffle(epoch_order)  # the same on every rank
        step_batches = epoch_order[k * per_step:(k + 1) * per_step]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, cfg)
        # this rank's micro-batches, read by a second thread while the first ones train
        micro = [reader.submit(batch, idx) for idx in step_batches[rank::world]]
        n_step = sum(len(b) for b in step_batches)  # samples in this step, all ranks
        loss_ = optimizer_step(module, opt, model, (m.result() for m in micro), n_step, cfg.clip,
                               world, loss)
        step, n_seen = step + 1, n_seen + n_step
        speed = n_seen / (time.perf_counter() - t0)
        bar.set_postfix(loss=f"{loss_.item():.4f}", samples_s=f"{speed:.1f}")
        bar.update()
        if n_seen == n_step and master_process:  # the first step: its peak memory is known now
            folder.warn_memory(cfg.device)
        if step % cfg.eval_every == 0 or step == total:
            evaluate()
        if master_process and (step % cfg.save_every == 0 or step == total):
            folder.save_checkpoint(module, opt, step, log, cfg, weights_id)
    bar.close()
    return module, opt, step, total, log


# -----------------------------------------------------------------------------
# The run


def time_limit(minutes, start):
    """--max-minutes as a question asked between batches and steps: has it run out since start?"""
    return lambda: bool(minutes) and time.perf_counter() - start > 60 * minutes


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    return run(lambda: train(get_args(argv)), resume=resume_command("train.py", argv, lambda: get_args(argv)))


def train(cfg):
    """The run, stage by stage: checks, the base model, data and/or train, the adapter."""
    global master_process
    out_of_time = time_limit(cfg.max_minutes, time.perf_counter())  # data stage included
    cfg = resolved(cfg)
    weights_id = check(cfg, parser())  # every setting and file, before the model loads; raises
    folder = RunFolder(cfg)

    # DDP under torchrun: one process per GPU (gloo on a CPU), each takes every world-th micro-batch
    ddp = int(os.environ.get("WORLD_SIZE", 1)) > 1
    if ddp:
        dist.init_process_group("nccl" if cfg.device.startswith("cuda") else "gloo")
        if cfg.device.startswith("cuda"):
            cfg = dataclasses.replace(cfg, device=f"cuda:{int(os.environ['LOCAL_RANK'])}")
            torch.cuda.set_device(cfg.device)
    rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
    master_process = rank == 0
    if master_process:  # one writer per folder: two runs on one --out would mix their files
        folder.claim()
    torch.manual_seed(cfg.seed)
    model = load_model(folder.model_dir, cfg.device, getattr(torch, cfg.dtype))

    # stage 1: data
    rows = folder.rows(trim=cfg.stage in ("data", "all") and master_process)
    if cfg.stage in ("data", "all") and master_process:
        tok = Tokenizer(folder.model_dir, model.config)
        rows = build_dataset(model, tok, cfg, folder, rows, out_of_time)
    elif cfg.stage in ("data", "all"):  # the other ranks only read the data rank 0 made
        folder.check_data_made(cfg, rows)
    if cfg.stage == "all" and out_of_time():
        return print0("--max-minutes reached in the data stage: training not started; the same "
                      "command goes on")
    train_rows = [r for r in rows if r["split"] == "train" and folder.sample_path(r["id"]).exists()]
    n_held = sum(r["split"] == "heldout" for r in rows)
    if cfg.stage == "data":
        return print0(f"data ready: {len(train_rows)} train, {n_held} held-out rows in "
                      f"{folder.out / 'data.jsonl'}")

    # stage 2: train
    heldout = validation(model, rows if master_process else [], cfg.micro_batch)
    t_train = time.perf_counter()
    module, opt, step, total, log = train_loop(model, new_module(model, cfg), cfg, train_rows,
                                               folder, heldout, weights_id, out_of_time,
                                               rank=rank, world=world)

    # the adapter and its .json (stopped early: a checkpoint too, to resume from where it stopped)
    if master_process:
        if step < total:
            folder.save_checkpoint(module, opt, step, log, cfg, weights_id)
        module.info = adapter_metadata(cfg, train_rows, n_held, step, total, log, weights_id)
        folder.save_adapter(module)
        seconds = time.perf_counter() - t_train
        print(f"saved {folder.dest} (+ .json) after {step} steps, {seconds:.0f} s")
        if worse := worse_than_untrained(log):
            warn(worse)
        if cfg.compare:  # the learner's run ends with what it bought, in answers
            compare(model, [r for r in rows if r["split"] == "heldout"], cfg.compare,
                    {"this adapter": module, "untrained (step 0)": new_module(model, cfg)})
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
