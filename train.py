"""
Train the lookahead module (M embeddings + a LoRA on their rows) with the KL loss, the base
model frozen: the module learns to attend to the prompt the way the model's own answer will.

CPU recipe, the shipped adapter (2 cores, float32; RESULTS.md says what it printed and how long it took;
after a kill, rerun the same command: the data stage keeps what it wrote, --resume the training checkpoint):
    python train.py --out runs/cpu --n-train 1000 --n-heldout 64 --max-new-tokens 128 --long-frac 0.05 \
        --gen-batch 16 --epochs 2 --eval-every 25 --save-every 5 --resume \
        --adapter-out weights/SmolLM2-135M-Instruct.lookahead.safetensors
(the LoRA on all seven projections, the default --targets all; with --targets q_proj,k_proj: the
adapter shipped before it, weights/SmolLM2-135M-Instruct.lookahead-qk.safetensors), then a fine-tune
on copy-heavy prompts (--init, RESULTS.md section 8) and the adapter's per-layer budgets, measured on
training rows where its choice decides the answer (not part of training; RESULTS.md section 4.4):
    python examples/layer_sensitivity.py --out runs/ans --adapter-out weights/SmolLM2-135M-Instruct.lookahead.safetensors
One GPU, paper-like scale (longer prompts and answers, more of them; the prompt caches recomputed in
the step instead of kept on disk, which would take ~430 GB here: README.md, "Training on one GPU"):
    python train.py --out runs/gpu --n-train 8000 --n-heldout 128 --max-tokens 4096 --max-new-tokens 256 \
        --gen-batch 64 --micro-batch 32 --epochs 2 --store-dtype none
Several GPUs (data parallel: each rank takes every world_size-th micro-batch; build the samples first):
    python train.py --stage data ... && torchrun --nproc_per_node=8 train.py ...
CPU smoke run (a few minutes on 2 cores):
    python train.py --out runs/smoke --n-train 8 --n-heldout 4 --max-tokens 600 --max-new-tokens 32 --batch 4 --epochs 1

It prints, per optimiser step, the loss (tqdm), and every --eval-every steps the held-out KL
and recall@C of lookahead / snapkv / h2o / streaming, e.g.
    step 20/66  heldout kl 0.161  recall@128 lookahead 0.842 snapkv 0.781 h2o 0.790 streaming 0.597
Held-out tables of adapters next to the untrained module and the baselines, with the headline (the
share of the SnapKV-to-oracle gap each closes in answer KL and in recall), no training:
    python train.py --out runs/cpu --n-heldout 64 --budgets 64,128,256 --answer-kl \
        --eval-only weights/SmolLM2-135M-Instruct.lookahead.safetensors --rules max:7,chunk:8

Two stages, each resumable (rerun the same command; --resume for the optimiser state):
1. data (`build_dataset`): prompts from offline sources (data.py), prefilled ONCE, B at a time
   (`answer_and_target`): the base model's greedy answer on that full cache, then the answers run
   on top of the prompt cache, which gives the target: per layer and query head, the mean
   attention of the answer's queries over the prompt (R x S, never S x S). The prompt's cache
   (bfloat16) and the target are kept on disk, one file per sample (OUT/samples), the rows in
   OUT/data.jsonl: every epoch reuses them, nothing is prefilled twice.
2. training: B cached samples at a time, left-padded into one batch (`load_batch`); the M
   lookahead tokens run on top of their caches with gradients (only they carry any: the
   two-pass form), their mean attention over the prompt is the prediction; loss = KL(gt || pred)
   of the L1-normalised scores, averaged over layers, query heads and samples.
"""

import argparse
import dataclasses
import hashlib
import json
import math
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from tqdm import tqdm

import data
from lookaheadkv import (POOLS, EvictConfig, LookaheadModule, Prefilled, answer_attention, check_pooling, compress,
                         greedy, keep_slots, lookahead_pass, make_scorer, pool_scores, select, stack_layers,
                         token_surprisal, untrained_module)
from metrics import answer_kl, forced_logprobs, gap_closed, recall_of_kept
from model import Hook, KVCache, Tokenizer, check_device, check_model_dir, load_model, resolve_model

# -----------------------------------------------------------------------------
# Stage 1: samples. One prefill per prompt gives the base model's own answer, the target (the
# answer's attention over the prompt) and the training cache (the prompt's KV), kept on disk.


def left_pad(prompts, dev):
    """Token-id lists -> ids (B, S) with left padding, and pad_mask (B, S) True on real tokens."""
    S = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (S - len(p)) + p for p in prompts], device=dev)
    pad_mask = torch.tensor([[False] * (S - len(p)) + [True] * len(p) for p in prompts], device=dev)
    return ids, pad_mask


@torch.no_grad()
def answer_and_target(model, tok, prompts, max_new_tokens):
    """For B prompts (token-id lists) prefilled ONCE, together (left-padded): the greedy full-cache
    answer, then the answers run on top of the prompt cache for the target (answer_attention, per
    query head). Returns per prompt a dict: response_ids (the stop token kept: the answer's end is
    part of its future), k and v (L, H_kv, S_b, D) the prompt's cache, target (L, H, S_b), padding removed."""
    dev, L = model.lm_head.weight.device, model.config.num_hidden_layers
    ids, pad_mask = left_pad(prompts, dev)
    S = ids.shape[1]
    cache, logits, next_pos, _ = compress(model, ids, EvictConfig("full"), pad_mask=pad_mask)
    prompt_cache = cache.copy()  # decoding appends to `cache`; this one stays the prompt's
    answers = greedy(model, cache, logits, next_pos, max_new_tokens, tok.stop_ids)
    R = max(len(a) for a in answers)
    padded = torch.tensor([a + [a[-1]] * (R - len(a)) for a in answers], device=dev)  # (B, R), right-padded
    answer_mask = torch.arange(R, device=dev)[None] < torch.tensor([len(a) for a in answers], device=dev)[:, None]
    target = answer_attention(model, prompt_cache, padded, next_pos, answer_mask, per_query_head=True)
    out = []
    for b, p in enumerate(prompts):
        real = slice(S - len(p), S)  # this row's slots, without the left padding
        out.append(dict(response_ids=answers[b],
                        k=torch.stack([prompt_cache.k[l][b, :, real] for l in range(L)]),  # (L, H_kv, S_b, D)
                        v=torch.stack([prompt_cache.v[l][b, :, real] for l in range(L)]),
                        target=torch.stack([target[l][b, :, real] for l in range(L)])))  # (L, H, S_b)
    return out


def sample_path(out, row_id):
    return Path(out) / "samples" / (hashlib.sha1(row_id.encode()).hexdigest()[:16] + ".safetensors")


def save_sample(path, sample, store_dtype):
    """The prompt's cache in store_dtype (bfloat16 halves the disk: the cache is an input, not a
    target), the target in float32; store_dtype None: the target alone (the cache is recomputed at
    every step, prompt_cache). Written to a temporary name first: a kill leaves no half file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = dict(target=sample["target"].float())
    if store_dtype is not None:
        tensors.update(k=sample["k"].to(store_dtype), v=sample["v"].to(store_dtype))
    save_file({n: t.contiguous().cpu() for n, t in tensors.items()}, str(path.with_suffix(".tmp")))
    os.replace(path.with_suffix(".tmp"), path)


def sample_bytes(cfg, S, store_dtype):
    """Disk size of one sample of S prompt tokens."""
    kv = 0 if store_dtype is None else 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * S * \
        store_dtype.itemsize
    return kv + cfg.num_hidden_layers * cfg.num_attention_heads * S * 4


def build_dataset(model, tok, args, out, rank=0):
    """Append {id, split, task, prompt_ids, response_ids} rows to OUT/data.jsonl until it holds
    n_train + n_heldout of them, and write each training row's sample file (cache + target) in the
    same pass. Rows and samples already there are kept (resume); a row without its sample file
    (e.g. a data.jsonl from elsewhere) gets one from ground_truth, one forward over [prompt; answer]."""
    fp, path = model.config.fingerprint(), Path(out) / "data.jsonl"
    read_only = args.eval_only or args.stage == "train"  # another run may be appending: never write
    if path.exists() and not read_only:  # a run killed mid-write leaves a partial last line: drop it
        text = path.read_text()
        if text and not text.endswith("\n"):
            path.write_text(text[: text.rfind("\n") + 1])
    rows = data.read_jsonl(path, required=("id", "prompt_ids", "response_ids")) if path.exists() else []
    if args.eval_only:  # the held-out rows are all it needs
        return [r for r in rows if r.get("split") == "heldout"]
    if read_only:  # --stage train: the training rows whose sample files are written
        return [r for r in rows if r.get("split") == "heldout" or sample_path(out, r["id"]).exists()]
    for r in rows:
        if r.get("fingerprint") != fp:
            raise ValueError(f"{path} was made with another base model ({r.get('base_model')}): use another --out")
    have = {split: sum(r.get("split") == split for r in rows) for split in ("train", "heldout")}
    todo = []
    if not args.eval_only and (have["train"] < args.n_train or have["heldout"] < args.n_heldout):
        done = {r["id"] for r in rows}
        for split, n in (("train", args.n_train), ("heldout", args.n_heldout)):
            prompts = data.make_training_prompts(tok, n, split=split, min_tokens=args.min_tokens,
                                                 max_tokens=args.max_tokens, long_frac=args.long_frac,
                                                 long_max=args.long_max, seed=args.seed,
                                                 copy_frac=args.copy_frac if split == "train" else None)
            todo += [dict(p, split=split) for p in prompts if p["id"] not in done]
    store = None if args.store_dtype == "none" else getattr(torch, args.store_dtype)
    missing = [r for r in rows if r["split"] == "train" and not sample_path(out, r["id"]).exists()]
    if (todo or missing) and rank != 0:
        raise ValueError("build the dataset first on one process (python train.py --stage data)")
    for p in todo:
        p["prompt_ids"] = tok.encode(tok.chat(p["prompt"]))
    n_bytes = sum(sample_bytes(model.config, len(r["prompt_ids"]), store) for r in rows + todo if r["split"] == "train")
    if n_bytes > args.store_gb * 2**30:
        raise ValueError(f"the training samples would take {n_bytes / 2**30:.1f} GiB on disk, over --store-gb "
                         f"{args.store_gb}: raise it, or use fewer/shorter prompts (--n-train, --max-tokens)")
    for r in tqdm(missing, desc="samples from data.jsonl", disable=not missing):
        cache, gt, _ = ground_truth(model, r)
        save_sample(sample_path(out, r["id"]), dict(k=torch.cat(cache.k), v=torch.cat(cache.v),
                                                    target=torch.cat([gt[l] for l in range(len(gt))])), store)
    # held-out rows first (an early eval), then blocks of 8 batches in a seeded random order, sorted
    # by length inside a block: little padding, and a run stopped early leaves a random subset
    random.Random(args.seed).shuffle(todo)
    todo.sort(key=lambda p: p["split"] != "heldout")
    block = 8 * args.gen_batch
    todo = [p for i in range(0, len(todo), block)
            for p in sorted(todo[i:i + block], key=lambda p: len(p["prompt_ids"]))]
    bar = tqdm(total=len(todo), desc="answering prompts", disable=not todo)
    for i in range(0, len(todo), args.gen_batch):
        batch = todo[i:i + args.gen_batch]
        samples = answer_and_target(model, tok, [p["prompt_ids"] for p in batch], args.max_new_tokens)
        new = [dict(id=p["id"], split=p["split"], source=p["source"], task=p["task"], base_model=model.config.name,
                    fingerprint=fp, prompt_ids=p["prompt_ids"], response_ids=s["response_ids"])
               for p, s in zip(batch, samples)]
        for r, s in zip(new, samples):  # the sample files first, then the rows that point to them
            if r["split"] == "train":
                save_sample(sample_path(out, r["id"]), s, store)
        with open(path, "a") as f:  # appended batch by batch: a killed run loses one batch at most
            for r in new:
                f.write(json.dumps(r) + "\n")
        rows += new
        bar.update(len(batch))
    bar.close()
    return rows


# -----------------------------------------------------------------------------
# Stage 2: ground truth, and the held-out baselines from the same forward


class PromptHooks(Hook):
    """SnapKV's and H2O's own prefill hooks, watching one forward of the prompt together."""

    def __init__(self, S, window):
        eviction = EvictConfig(budget=window + 1, window=window)
        self.snapkv = make_scorer(dataclasses.replace(eviction, method="snapkv")).prefill_hook(S)
        self.h2o = make_scorer(dataclasses.replace(eviction, method="h2o")).prefill_hook(S)

    def attn(self, layer, q, k, key_valid):
        self.snapkv.attn(layer, q, k, key_valid)
        self.h2o.attn(layer, q, k, key_valid)


@torch.no_grad()
def ground_truth(model, row, window=0):
    """For a data.jsonl row: the prompt's KV cache, the target {layer: (1, H, S)} (the answer's
    attention over the prompt, answer_attention per query head) and extra: the answer (1, R), each
    prompt token's surprisal (1, S) (the span rule's input) and, with window > 0, SnapKV's and H2O's
    scores {layer: (1, H_kv, S)}, all from the same prompt forward."""
    dev = model.lm_head.weight.device
    prompt, response = torch.tensor([row["prompt_ids"]], device=dev), torch.tensor([row["response_ids"]], device=dev)
    S = prompt.shape[1]
    cache = KVCache(model.config.num_hidden_layers)
    hook = PromptHooks(S, window) if window else None
    _, hidden = model(prompt, positions=torch.arange(S, device=dev)[None], cache=cache, hook=hook, logits_at=-1,
                      hidden=True)
    gt = answer_attention(model, cache, response, torch.tensor([S], device=dev), per_query_head=True)
    extra = dict(response=response, surprisal=token_surprisal(model, hidden, prompt))
    if window:
        G = model.config.num_attention_heads // model.config.num_key_value_heads
        extra.update(snapkv=hook.snapkv.scores, h2o=hook.h2o.scores(None, G))
    return cache, gt, extra


def heldout_ground_truth(model, rows, window, out=None):
    """ground_truth of every held-out row, kept in OUT/heldout (one file per row, ~50 KB per prompt
    token) so that later --eval-only runs on the same rows skip the forwards. Without out: computed."""
    items = []
    for r in tqdm(rows, desc="held-out ground truth"):
        # named by what it is made of: the model, the prompt, the answer and the window
        key = json.dumps([model.config.fingerprint(), r["prompt_ids"], r["response_ids"], window])
        path = None if out is None else Path(out) / "heldout" / (hashlib.sha1(key.encode()).hexdigest()[:16] + ".pt")
        saved = torch.load(path, map_location=model.lm_head.weight.device) if path and path.exists() else None
        if saved is not None and "surprisal" in saved["extra"]:  # (a file from before the span rule is made again)
            cache = KVCache(len(saved["k"]))
            cache.k, cache.v = saved["k"], saved["v"]
            items.append((cache, saved["gt"], saved["extra"]))
            continue
        cache, gt, extra = ground_truth(model, r, window)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(dict(k=cache.k, v=cache.v, gt=gt, extra=extra), path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)
        items.append((cache, gt, extra))
    return items


# -----------------------------------------------------------------------------
# Stage 3: the loss. The prediction is lookaheadkv.lookahead_pass(..., per_query_head=True): the M
# lookahead rows on top of the prompt cache (the two-pass form), the only rows with gradients.


def load_batch(paths, dev, dtype):
    """Sample files of different lengths, left-padded into one batch: a KVCache with (B, H_kv, S, D)
    per layer and its valid mask (B, 1, S), the targets {layer: (B, H, S)} (zero on padding, so
    they add nothing to the KL) and each row's prompt length (B,), where its lookahead rows start.
    Files without the cache (--store-dtype none) give cache None: prompt_cache makes it."""
    items = [load_file(str(p)) for p in paths]
    lengths = [it["target"].shape[-1] for it in items]
    B, S = len(items), max(lengths)
    L, H = items[0]["target"].shape[:2]
    stored = "k" in items[0]
    # one copy per sample, straight into its slot of the padded batch (and from bfloat16 to dtype)
    target = torch.zeros(L, B, H, S, device=dev)
    if stored:
        k = torch.zeros(L, B, *items[0]["k"].shape[1:2], S, items[0]["k"].shape[-1], dtype=dtype, device=dev)
        v = torch.zeros_like(k)
    for b, (it, n) in enumerate(zip(items, lengths)):
        target[:, b, :, S - n:] = it["target"]
        if stored:
            k[:, b, :, S - n:] = it["k"]
            v[:, b, :, S - n:] = it["v"]
    cache = None
    if stored:
        valid = (torch.arange(S)[None] >= S - torch.tensor(lengths)[:, None])[:, None].to(dev)  # (B, 1, S)
        cache = KVCache(L)
        for l in range(L):
            cache.k[l], cache.v[l], cache.valid[l] = k[l], v[l], valid
    return cache, {l: target[l] for l in range(L)}, torch.tensor(lengths, device=dev)


@torch.no_grad()
def prompt_cache(model, prompts):
    """The prompts' KV cache, left-padded together as load_batch pads them, made by one prefill: what a
    training step does instead of reading it from disk with --store-dtype none (cheap on a GPU)."""
    ids, pad_mask = left_pad(prompts, model.lm_head.weight.device)
    return compress(model, ids, EvictConfig("full"), pad_mask=pad_mask)[0]


def micro_batches(rows, size):
    """Training rows cut into micro-batches of similar prompt lengths (little padding): indices
    sorted by length, then cut. Each epoch shuffles the micro-batches, not what is in them."""
    order = sorted(range(len(rows)), key=lambda i: (len(rows[i]["prompt_ids"]), rows[i]["id"]))
    return [order[i:i + size] for i in range(0, len(order), size)]


@dataclasses.dataclass
class Loss:
    """How the KL is taken; the defaults are the paper's loss. Each field is one train.py flag."""

    pool: str = "none"  # --pool-loss: smooth target and prediction with the shipped rule first
    kernel: int = 1  # its width
    skip: int = 0  # --loss-skip: each prompt's first N tokens (the sinks) left out of both distributions
    power: float = 1.0  # --loss-power: compare s**power (renormalised); < 1 flattens both (see kl_loss)
    layer_weights: tuple | None = None  # --layer-weights: each layer's weight in the mean (None: all equal)


def kl_loss(gt, pred, pool="none", kernel=1, eps=1e-8, drop=None, power=1.0, layer_weights=None):
    """KL(gt || pred) of the L1-normalised scores, averaged over layers and heads: the future's
    attention is the target distribution, the lookahead rows' the prediction. With a pool
    (--pool-loss), both are first smoothed as eviction will smooth the prediction: the module
    then learns which stretch of the prompt the answer reads, not which token of it. drop (B, 1, S)
    True on slots left out of both distributions before they are normalised (--loss-skip: the
    first tokens, attention sinks that every method keeps, so the loss is spent on the open ones).
    power < 1 (--loss-power) compares s**power instead of s: a token's weight in the KL is its
    share of the target, so the few slots every method keeps (the sinks, the question: half the
    mass) dominate the paper's loss, while eviction is decided by the ranks around the C-th slot,
    where the mass is small. Raising both to power 0.5 turns a 400:1 mass ratio into 20:1, and
    the ranks are unchanged (top-C of s and of s**power are the same slots).
    layer_weights (one per layer, --layer-weights): a weighted mean over the layers instead of the plain
    one, to spend the loss in the layers whose selection the answer depends on (layer_sensitivity)."""
    losses = []
    for l, g in gt.items():
        g, s = pool_scores(g.float(), pool, kernel), pool_scores(pred[l].float(), pool, kernel)
        if drop is not None:
            g, s = g.masked_fill(drop, 0.0), s.masked_fill(drop, 0.0)
        if power != 1:  # padding and dropped slots stay 0 (and get no gradient: clamp_min passes none)
            g, s = g.clamp_min(1e-30) ** power * (g > 0), s.clamp_min(1e-30) ** power * (s > 0)
        p = g / g.sum(-1, keepdim=True)
        q = s / s.sum(-1, keepdim=True)
        losses.append((p * ((p + eps).log() - (q + eps).log())).sum(-1).mean())
    if layer_weights is None:
        return torch.stack(losses).mean()
    w = torch.as_tensor([layer_weights[l] for l in gt], dtype=torch.float32, device=losses[0].device)
    return (torch.stack(losses) * w).sum() / w.sum()


def batch_loss(model, module, cache, gt, lengths, loss=Loss()):
    """The loss of one micro-batch: the M lookahead rows on top of each sample's prompt cache (the
    two-pass form, B samples in one forward), their attention per query head against the target.
    loss.skip > 0: each sample's first `skip` real tokens are left out of the loss (kl_loss's drop)."""
    pred = lookahead_pass(model, module, cache, lengths, per_query_head=True)
    drop = None
    if loss.skip:
        S = next(iter(gt.values())).shape[-1]
        first = S - torch.as_tensor(lengths, device=cache.k[0].device).reshape(-1, 1)  # (B, 1): first real slot
        slot = torch.arange(S, device=first.device)[None]  # (1, S)
        drop = (slot < first + loss.skip)[:, None]  # (B, 1, S): the padding and the first `skip` tokens
    return kl_loss(gt, pred, loss.pool, loss.kernel, drop=drop, power=loss.power, layer_weights=loss.layer_weights)


def optimizer_step(module, opt, model, micro, n_samples, clip, loss=Loss(), world=1):
    """One optimiser step over this rank's micro-batches `micro` (an iterable of load_batch results):
    each sample weighs the same in the step's mean over n_samples (all ranks), ranks average their
    gradients, then clip and step. Returns the step's loss as a 0-dim tensor (no sync here)."""
    total = torch.zeros((), device=next(module.parameters()).device)
    for cache, gt, lengths in micro:
        part = batch_loss(model, module, cache, gt, lengths, loss) * lengths.shape[0] * world / n_samples
        part.backward()
        total += part.detach().float() / world
    if world > 1:
        all_reduce_grads(module, world)
    torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


# -----------------------------------------------------------------------------
# The held-out eval: every method kept by its own scorer's eviction step, from one ground-truth forward


def group_mean(scores, n_kv_heads):
    """Per-query-head scores (B, H, S) -> per-KV-head (B, H_kv, S), as eviction uses them."""
    return {l: s.view(s.shape[0], n_kv_heads, -1, s.shape[-1]).mean(2) for l, s in scores.items()}


HELDOUT_ROWS = {  # row -> (method, pooling, width[, layer budgets]): None = the method's own (lookahead: its adapter's)
    "oracle": ("oracle", None, None), "lookahead": ("lookahead", None, None),
    "lookahead_unpooled": ("lookahead", "none", None), "snapkv": ("snapkv", None, None),
    "pyramidkv": ("pyramidkv", None, None), "h2o": ("h2o", None, None), "streaming": ("streaming", None, None),
}
LAYERED_ROWS = {  # with an adapter that has per-layer budgets: the paper's C in every layer, and SnapKV given
    # the adapter's budgets (what the budgets alone buy a prompt-only method)
    "lookahead_uniform": ("lookahead", None, None, "uniform"), "snapkv_layered": ("snapkv", None, None, "adapter"),
}


def rule_rows(rules):
    """--rules "max:7,chunk:8" -> extra rows {"lookahead_max7": ("lookahead", "max", 7), ...}: the adapter's
    scores kept under other selection rules (lookaheadkv.pool_scores)."""
    rows = {}
    for rule in filter(None, (r.strip() for r in rules.split(","))):
        pool, _, width = rule.partition(":")
        if width and not width.isdigit():
            raise ValueError(f"--rules {rules!r}: each rule is POOL or POOL:WIDTH, e.g. max:7,chunk:8")
        kernel = int(width) if width else 1
        check_pooling(pool, kernel)
        rows[f"lookahead_{pool}{kernel if pool != 'none' else ''}"] = ("lookahead", pool, kernel)
    return rows


@torch.no_grad()
def heldout_metrics(model, module, heldout, budget, window=32, budgets=(), answer_kl_rows=(), rows=None):
    """Held-out KL(gt || pred) and, per row of HELDOUT_ROWS, recall@C: each method kept by its own
    scorer's eviction step (pooling, protected tokens, per-layer budgets: Scorer.evict) from the
    scores of the ground-truth forward; the lookahead adapter pooled as it ships and unpooled; the
    oracle keeps the exact top C of the truth. Keys: recall_<row> at `budget` (the training log's
    line) and recall_<row>@<C> for every C in `budgets`. For the rows in `answer_kl_rows`, also
    answer_kl_<row>@<C> (metrics.answer_kl: FullKV's answer teacher-forced through the compressed
    cache; one forward per row and C). Items of `heldout` are (cache, gt, extra) from ground_truth."""
    Hkv = model.config.num_key_value_heads
    Cs = list(dict.fromkeys([budget, *budgets]))
    rows = HELDOUT_ROWS if rows is None else rows
    kl, rec = [], {(row, C): [] for row in rows for C in Cs}
    akl = {(row, C): [] for row in answer_kl_rows for C in Cs}
    for cache, gt, extra in tqdm(heldout, desc="held-out metrics", leave=False, disable=len(heldout) < 8):
        S = len(cache)
        positions = torch.arange(S, device=cache.k[0].device)[None]  # (1, S)
        next_pos = torch.tensor([S], device=positions.device)
        pred = lookahead_pass(model, module, cache, S, per_query_head=True)
        kl.append(kl_loss(gt, pred).item())
        true = group_mean(gt, Hkv)
        snap = stack_layers(extra["snapkv"])
        scores = dict(oracle=stack_layers(true), lookahead=stack_layers(group_mean(pred, Hkv)), snapkv=snap,
                      pyramidkv=snap, h2o=stack_layers(extra["h2o"]))
        logp_full = forced_logprobs(model, cache, extra["response"], next_pos) if akl else None
        for (row, C), r in rec.items():
            method, pool, kernel, layers = (*rows[row], None)[:4]
            layers = module.layer_budget if layers == "adapter" else layers
            if method == "oracle":  # its scorer needs a response to run; its eviction is a plain top C
                kept = list(select(scores["oracle"], C))
            else:
                scorer = make_scorer(EvictConfig(method, C, window=window, pool=pool, kernel=kernel,
                                                 layer_weights=layers), module=module)
                if method == "streaming":  # scores from positions alone
                    scores[method] = scorer.score(model, Prefilled(cache, None, None, positions, next_pos, None))
                kept = scorer.evict(scores[method], positions, surprisal=extra.get("surprisal"))
            r.append(recall_of_kept(kept, true))
            if (row, C) in akl:
                small = keep_slots(cache.copy(), kept)
                akl[row, C].append(answer_kl(logp_full, forced_logprobs(model, small, extra["response"], next_pos)))
    out = dict(kl=sum(kl) / len(kl))
    for (row, C), v in rec.items():
        out[f"recall_{row}@{C}"] = sum(v) / len(v)
        if C == budget:
            out[f"recall_{row}"] = out[f"recall_{row}@{C}"]
    for (row, C), v in akl.items():
        out[f"answer_kl_{row}@{C}"] = sum(v) / len(v)
    return out


# -----------------------------------------------------------------------------
# The loop


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", default=None, help="HF folder of the base model (default: weights/SmolLM2-135M-Instruct)")
    a("--out", default="runs/lookahead", help="folder for data.jsonl, checkpoints and logs")
    a("--adapter-out", default=None, help="where the final adapter goes (default: OUT/adapter.safetensors)")
    a("--stage", default="all", choices=["data", "train", "all"],
      help="data: build OUT's samples only; train: train on the samples OUT already holds (read only)")
    # data
    a("--n-train", type=int, default=800, help="training prompts")
    a("--n-heldout", type=int, default=32, help="held-out prompts (other documents) for the eval")
    a("--min-tokens", type=int, default=512)
    a("--max-tokens", type=int, default=2048)
    a("--long-frac", type=float, default=0.1, help="fraction of prompts longer than --max-tokens, up to --long-max")
    a("--long-max", type=int, default=4096)
    a("--copy-frac", type=float, default=None, help="share of training prompts whose answer copies a span "
      "exactly (data.COPY_TASKS; default: the task weights, about a third); held-out prompts keep the default")
    a("--max-new-tokens", type=int, default=256, help="length cap of the base model's answers (paper: 512)")
    a("--gen-batch", type=int, default=None, help="prompts answered together (default 32 on CUDA, 8 on CPU)")
    a("--store-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "none"],
      help="dtype of the prompt caches kept on disk (OUT/samples) for every epoch; none: keep only the targets "
      "and recompute each prompt's cache at every step (a GPU's choice: on the CPU it is 7.6x slower)")
    a("--store-gb", type=float, default=40, help="refuse to build samples that would take more disk than this")
    # module
    a("--n-tokens", type=int, default=32, help="M, lookahead tokens")
    a("--rank", type=int, default=8)
    a("--alpha", type=float, default=32)
    a("--targets", default="all", help="LoRA targets: all (the seven projections, as the shipped adapter and "
      "the paper's release), or any of q,k,v,o,gate,up,down _proj; '' or none: the embeddings alone")
    a("--pool", default="span", choices=POOLS,
      help="the selection rule the adapter's .json will name (lookaheadkv.pool_scores; the shipped one: span 8, "
      "chosen on held-out answers and checked on two other sets: RESULTS.md, section 4.2)")
    a("--kernel", type=int, default=8, help="the rule's width (avg, max: odd)")
    a("--pool-loss", action="store_true", help="smooth target and prediction with --pool / --kernel in the loss "
      "too (train with the pooling you ship; default: the loss compares unpooled scores)")
    a("--loss-skip", type=int, default=0, help="leave each prompt's first N tokens (attention sinks, kept by "
      "every method) out of the KL, renormalising over the rest (default 0: the paper's loss)")
    a("--loss-power", type=float, default=1.0, help="compare target and prediction raised to this power, each "
      "renormalised: < 1 weighs the tokens near the top-C boundary more and the sinks less (default 1: the paper's)")
    a("--layer-weights", default=None, metavar="JSON", help="weigh each layer's KL by the \"weights\" list of "
      "this file (one per layer; examples/layer_sensitivity.py writes it from the answer KL each layer's selection "
      "costs) instead of the plain mean over layers (the paper's)")
    a("--lookahead-window", type=int, default=0, help="last prompt tokens the adapter always keeps (SnapKV keeps 32)")
    # optimisation
    a("--epochs", type=float, default=3, help="passes over the training rows (a fraction ends mid-pass)")
    a("--batch", type=int, default=32, help="effective batch (samples per optimiser step, all ranks)")
    a("--micro-batch", type=int, default=8, help="samples in one lookahead forward (left-padded together)")
    a("--lr", type=float, default=1e-3)
    a("--weight-decay", type=float, default=0.0)
    a("--warmup", type=float, default=0.02, help="fraction of steps with linear warmup, then cosine to 0")
    a("--clip", type=float, default=1.0)
    a("--budget", type=int, default=128, help="C for the held-out recall")
    a("--budgets", default="64,128,256", help="--eval-only: also a table of recall at these C (comma-separated)")
    a("--window", type=int, default=32, help="the held-out SnapKV / H2O rows: last prompt tokens always kept")
    a("--rules", default="", help="--eval-only: also each adapter under these selection rules, e.g. "
      "max:7,chunk:8,carry:5 (lookaheadkv.pool_scores)")
    a("--answer-kl", action="store_true", help="--eval-only: also the answer KL at --budgets (one forward per "
      "prompt, method and C: slower)")
    a("--eval-every", type=int, default=10, help="optimiser steps between held-out evals")
    a("--save-every", type=int, default=10, help="optimiser steps between checkpoints")
    a("--resume", action="store_true", help="continue from OUT/ckpt.pt")
    a("--init", default=None, metavar="ADAPTER", help="start from this adapter (its M, rank and targets) "
      "with a fresh optimiser and schedule: more steps for an adapter whose run ended early")
    a("--eval-only", default=None, metavar="ADAPTER[,ADAPTER...]",
      help="no training: held-out metrics of each ADAPTER and of the untrained init on OUT/data.jsonl")
    a("--max-minutes", type=float, default=None, help="stop training once this long has passed since the start, "
      "data generation included (checkpoint + adapter saved, noted in the metadata)")
    a("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a("--dtype", default=None, choices=["float32", "bfloat16"],
      help="base model dtype (default: bfloat16 on CUDA, float32 on CPU); the module trains in float32")
    a("--seed", type=int, default=0)
    return p.parse_args(argv)


def check_args(args):
    """Every check that needs no model, so a bad value stops at once, not after an hour of answering."""
    check_device(args.device)
    check_model_dir(args.model)
    at_least = [("--n-heldout", args.n_heldout, 1 if args.eval_only else 0), ("--min-tokens", args.min_tokens, 1),
                ("--max-new-tokens", args.max_new_tokens, 1), ("--gen-batch", args.gen_batch or 1, 1),
                ("--n-tokens", args.n_tokens, 1), ("--rank", args.rank, 1), ("--batch", args.batch, 1),
                ("--micro-batch", args.micro_batch, 1), ("--budget", args.budget, 1), ("--window", args.window, 0),
                ("--eval-every", args.eval_every, 1), ("--save-every", args.save_every, 1),
                ("--loss-skip", args.loss_skip, 0), ("--lookahead-window", args.lookahead_window, 0),
                ("--n-train", args.n_train, 0 if args.eval_only or args.stage == "train" else 1)]
    for flag, value, lo in at_least:
        if value < lo:
            raise ValueError(f"{flag} {value}: must be at least {lo}")
    positive = [("--lr", args.lr), ("--alpha", args.alpha), ("--epochs", args.epochs), ("--clip", args.clip),
                ("--store-gb", args.store_gb), ("--max-minutes", args.max_minutes or 1), ("--loss-power", args.loss_power)]
    for flag, value in positive:
        if not value > 0:
            raise ValueError(f"{flag} {value}: must be greater than 0")
    fractions = [("--warmup", args.warmup), ("--long-frac", args.long_frac), ("--copy-frac", args.copy_frac or 0)]
    for flag, value in fractions:
        if not 0 <= value <= 1:
            raise ValueError(f"{flag} {value}: must be a fraction between 0 and 1")
    if args.weight_decay < 0:
        raise ValueError(f"--weight-decay {args.weight_decay}: must be >= 0")
    if not args.min_tokens <= args.max_tokens <= args.long_max:
        raise ValueError(f"--min-tokens {args.min_tokens}, --max-tokens {args.max_tokens}, --long-max {args.long_max}: "
                         f"need min <= max <= long-max")
    parse_targets(args.targets)
    check_pooling(args.pool, args.kernel)
    if args.pool_loss and args.pool == "span":
        raise ValueError("--pool-loss cannot use the span rule (the loss has no surprisal): pass --pool none, avg, "
                         "max, chunk or carry with it, or drop --pool-loss (the rule is applied at eviction)")
    rule_rows(args.rules)
    try:
        budgets = [int(c) for c in args.budgets.split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"--budgets {args.budgets!r}: expected comma-separated numbers of KV slots, e.g. 64,128,256")
    if any(c < 1 for c in budgets):
        raise ValueError(f"--budgets {args.budgets!r}: every budget must be at least 1")
    if args.layer_weights:  # a bad file stops here; its length is checked once the model is loaded
        read_layer_weights(args.layer_weights)
    for path in ([args.init] if args.init else []) + (args.eval_only.split(",") if args.eval_only else []):
        if not Path(path).is_file() or not Path(path).with_suffix(".json").is_file():
            raise FileNotFoundError(f"adapter {path} (and its .json) not found: pass a .safetensors file from train.py")


def read_layer_weights(path, n_layers=None):
    """--layer-weights: the "weights" list of a JSON file, non-negative numbers, not all 0 (one per layer)."""
    try:
        weights = json.loads(Path(path).read_text())["weights"]
    except FileNotFoundError:
        raise FileNotFoundError(f"--layer-weights {path}: no such file (examples/layer_sensitivity.py writes one)")
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ValueError(f"--layer-weights {path}: expected JSON with a \"weights\" list, one number per layer")
    if not all(isinstance(w, (int, float)) and w >= 0 for w in weights) or not sum(weights) > 0:
        raise ValueError(f"--layer-weights {path}: the weights must be numbers >= 0, not all 0")
    if n_layers is not None and len(weights) != n_layers:
        raise ValueError(f"--layer-weights {path}: {len(weights)} weights for a model of {n_layers} layers: "
                         "measure them for this model (examples/layer_sensitivity.py)")
    return tuple(float(w) for w in weights)


def lr_at(step, total, args):
    warm = max(1, round(args.warmup * total))
    if step < warm:
        return args.lr * (step + 1) / warm
    return args.lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


def save_checkpoint(path, module, opt, step, log):
    tmp = path.with_suffix(".tmp")
    torch.save(dict(module=module.state_dict(), meta=module.metadata(), opt=opt.state_dict(), step=step, log=log,
                    rng=torch.get_rng_state()), tmp)
    os.replace(tmp, path)  # atomic: a kill mid-save leaves the previous checkpoint intact


def load_checkpoint(path, module, opt):
    try:
        ck = torch.load(path, map_location="cpu", weights_only=False)
        meta = ck["meta"]
    except Exception as e:
        raise ValueError(f"checkpoint {path} is corrupt ({type(e).__name__}): delete it to start over")
    if meta["base_fingerprint"] != module.cfg.fingerprint():
        raise ValueError(f"{path} was trained for {meta['base_model']}, not {module.cfg.name}: use another --out")
    try:
        module.load_state_dict(ck["module"])
        opt.load_state_dict(ck["opt"])
    except Exception as e:
        raise ValueError(f"checkpoint {path} is corrupt ({type(e).__name__}): delete it to start over")
    torch.set_rng_state(ck["rng"])
    return ck["step"], ck["log"]


def setup_ddp(args):
    """(rank, world size); under torchrun, one process per GPU (or gloo on CPU for the test)."""
    if int(os.environ.get("WORLD_SIZE", 1)) <= 1:
        return 0, 1
    dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
    if args.device.startswith("cuda"):
        args.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(args.device)
    return dist.get_rank(), dist.get_world_size()


def all_reduce_grads(module, world):
    """Average the gradients of all ranks (the module runs as a hook inside the frozen model, not as
    a forward DDP could wrap, so we reduce by hand)."""
    for p in module.parameters():
        if p.grad is not None:  # None: e.g. the last layer's v/o/MLP LoRA, which nothing after it reads
            dist.all_reduce(p.grad)  # a sum (gloo has no average)
            p.grad /= world


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


def new_module(model, args):
    """The untrained module of this run's flags (lookaheadkv.untrained_module), seeded by --seed."""
    torch.manual_seed(args.seed)
    return untrained_module(model, args.n_tokens, args.rank, args.alpha, parse_targets(args.targets), args.pool,
                            args.kernel, args.lookahead_window)


def print_heldout(name, r, budget):
    print(f"{name} heldout kl {r['kl']:.4f}  recall@{budget} lookahead {r['recall_lookahead']:.3f} "
          f"(unpooled {r['recall_lookahead_unpooled']:.3f}) snapkv {r['recall_snapkv']:.3f} "
          f"h2o {r['recall_h2o']:.3f} streaming {r['recall_streaming']:.3f}")


def eval_only(model, module, held_rows, args):
    """--eval-only ADAPTER[,ADAPTER...]: held-out metrics of each adapter next to the untrained init
    (same seed), on one held-out ground truth: the table of an ablation in one command. With
    --answer-kl, the headline: the share of the SnapKV-to-oracle gap each row closes in answer KL."""
    heldout = heldout_ground_truth(model, held_rows, args.window, args.out)
    adapters = [("untrained", module)] + [(path, LookaheadModule.load(path, model.config, args.device))
                                          for path in args.eval_only.split(",")]
    # the untrained row selects as the adapters do: with the layer budgets of the first adapter that has them
    module.layer_budget = next((m.layer_budget for _, m in adapters[1:] if m.layer_budget is not None), None)
    Cs = [int(c) for c in args.budgets.split(",") if c.strip()] if args.budgets else []
    extra = rule_rows(args.rules)
    if any(m.layer_budget is not None for _, m in adapters):
        extra = {**LAYERED_ROWS, **extra}
    rows = {**HELDOUT_ROWS, **extra}
    table = []
    for i, (name, m) in enumerate(adapters):
        label = "untrained" if i == 0 else ("adapter" if len(adapters) == 2 else name)
        # the answer KL of the prompt-only baselines once (with the first row), of each adapter's rows always
        # (its pooled row only if it pools: unpooled, the two rows keep the same slots)
        own = ("lookahead", "lookahead_unpooled") if m.pool != "none" else ("lookahead_unpooled",)
        base = tuple(r for r in rows if not r.startswith("lookahead")) if i == 0 else ()
        akl = base + own + tuple(r for r in extra if r.startswith("lookahead")) if args.answer_kl and Cs else ()
        result = heldout_metrics(model, m, heldout, args.budget, args.window, Cs, answer_kl_rows=akl, rows=rows)
        print_heldout(f"{label:9s} ({len(heldout)})", result, args.budget)
        table.append((label, m, result))
    if Cs:
        print_tables(table, Cs, len(heldout), extra)


def print_tables(table, Cs, n, extra=()):
    """Markdown tables of eval_only's rows: the prompt-only baselines once, then each adapter pooled as
    its .json says and unpooled; per metric, the value and the share of the SnapKV-to-oracle gap closed."""
    first = table[0][2]
    for metric, title, fmt, lower in [("answer_kl", "answer KL", ".4f", True), ("recall", "recall@C", ".3f", False)]:
        if f"{metric}_oracle@{Cs[0]}" not in first:
            continue

        def cells(r, row):
            out = []
            for C in Cs:
                v = r.get(f"{metric}_{row}@{C}")
                gap = None if v is None else gap_closed(v, first[f"{metric}_snapkv@{C}"], first[f"{metric}_oracle@{C}"],
                                                        lower_is_better=lower)
                out.append("" if v is None else f"{v:{fmt}}" + ("" if gap is None else f" ({gap:.0%})"))
            return " | ".join(out)

        print(f"\n| {title} ({n} held-out; gap closed) | " + " | ".join(f"C={C}" for C in Cs) + " | KL(gt ‖ pred) |")
        print("|---" * (len(Cs) + 2) + "|")
        for row in ("oracle", "snapkv", "pyramidkv", "h2o", "streaming") + (("snapkv_layered",) if "snapkv_layered"
                                                                             in extra else ()):
            print(f"| {row} | {cells(first, row)} | |")
        for label, m, r in table:
            if m.pool != "none":
                print(f"| {label}, as shipped ({m.pool} {m.kernel}) | {cells(r, 'lookahead')} | {r['kl']:.4f} |")
            print(f"| {label}, unpooled | {cells(r, 'lookahead_unpooled')} | {r['kl']:.4f} |")
            for row in (r for r in extra if r.startswith("lookahead")):
                print(f"| {label}, {row.removeprefix('lookahead_')} | {cells(r, row)} | {r['kl']:.4f} |")


def describe_rows(train_rows, n_held):
    """The training data as its rows are, not as this command's flags say (with --stage train or --init the
    data stage ran earlier, maybe with other flags): sources, prompt and answer lengths, the copy tasks' share."""
    prompt = [len(r["prompt_ids"]) for r in train_rows] or [0]
    answer = [len(r["response_ids"]) for r in train_rows] or [0]
    return dict(sources=sorted({r.get("source", "?") for r in train_rows}), n_train=len(train_rows), n_heldout=n_held,
                prompt_tokens=[min(prompt), max(prompt)], answer_tokens_max=max(answer),
                copy_share=round(sum(r.get("task") in data.COPY_TASKS for r in train_rows) / max(1, len(train_rows)),
                                 3), python=data.PYTHON)


def adapter_metadata(args, train_rows, n_held, step, total, stopped_early, log, init_info):
    """What the shipped .json says about how the adapter was made."""
    info = dict(train_data=describe_rows(train_rows, n_held),
                steps=step, planned_steps=total, stopped_early=stopped_early, batch=args.batch, lr=args.lr,
                pool_loss=args.pool_loss, loss_skip=args.loss_skip, loss_power=args.loss_power,
                layer_weights=args.layer_weights,
                epochs=args.epochs, heldout=log[-1] if log else None, untrained=log[0] if log else None)
    if init_info:  # step 0 was the init adapter, not an untrained module: keep the init's own reference
        info.update(untrained=init_info.get("untrained"),
                    init=dict(path=init_info["path"], steps=init_info.get("steps"), heldout=log[0] if log else None))
    return info


def main(argv=None):
    try:
        return train(get_args(argv))
    except (ValueError, OSError) as e:  # library errors: one line that says what to do, no traceback
        raise SystemExit(f"error: {e}")


def train(args):
    check_args(args)
    t_start = time.perf_counter()  # --max-minutes counts from here (data generation included)
    rank, world = setup_ddp(args)
    ddp = world > 1
    print0 = lambda *a: print(*a) if rank == 0 else None
    torch.manual_seed(args.seed)
    dev = args.device
    args.gen_batch = args.gen_batch or (32 if dev.startswith("cuda") else 8)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    # --- the frozen base model and the data (stage 1)
    args.model = str(resolve_model(args.model))
    model = load_model(args.model, dev, getattr(torch, args.dtype) if args.dtype else None)
    tok = Tokenizer(args.model, model.config)
    rows = build_dataset(model, tok, args, out, rank)
    train_rows = [r for r in rows if r["split"] == "train"]
    held_rows = [r for r in rows if r["split"] == "heldout"]
    if not train_rows and not args.eval_only:
        raise ValueError(f"no training samples in {out / 'data.jsonl'}: set --n-train > 0")
    if args.stage == "data":
        print0(f"data ready: {len(train_rows)} train, {len(held_rows)} held-out rows in {out / 'data.jsonl'}")
        return

    # --- the module (untrained, or --init), the optimiser, the schedule, a checkpoint to resume
    module = new_module(model, args)
    init_info = None
    if args.init:  # fine-tune an adapter: the same module shape, its weights, a new schedule
        module = LookaheadModule.load(args.init, model.config, dev)
        init_info = dict(path=Path(args.init).name, **module.info)
        if module.layer_budget is not None and not args.eval_only:  # measured for the init's weights, not the new ones
            print0(f"--init {args.init}: its per-layer budgets are dropped; measure them again for the trained "
                   "adapter (examples/layer_sensitivity.py)")
            module.layer_budget = None
    if args.eval_only:
        return eval_only(model, module, held_rows, args)
    opt = torch.optim.AdamW(module.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    layer_weights = read_layer_weights(args.layer_weights, model.config.num_hidden_layers) if args.layer_weights else None
    loss = Loss(pool=args.pool if args.pool_loss else "none", kernel=args.kernel if args.pool_loss else 1,
                skip=args.loss_skip, power=args.loss_power, layer_weights=layer_weights)
    batches = micro_batches(train_rows, args.micro_batch)
    per_step = max(world, args.batch // args.micro_batch)  # micro-batches per optimiser step, all ranks
    steps_per_epoch = max(1, len(batches) // per_step)
    total = max(1, round(steps_per_epoch * args.epochs))
    step, log = 0, []
    ckpt = out / "ckpt.pt"
    if args.resume and ckpt.exists():
        step, log = load_checkpoint(ckpt, module, opt)
        print0(f"resumed at step {step}/{total}")
    elif args.resume:
        print0(f"no checkpoint at {ckpt}: starting from step 0")

    # --- held-out ground truth with the SnapKV / H2O scores of the same forward (rank 0 evaluates alone)
    t0 = time.perf_counter()
    held_rows = held_rows if rank == 0 else []
    heldout = heldout_ground_truth(model, held_rows, args.window, out)
    dtype = model.lm_head.weight.dtype
    reader = ThreadPoolExecutor(max_workers=1)

    def do_eval():
        if heldout and rank == 0:
            m = heldout_metrics(model, module, heldout, args.budget, args.window)
            log.append(dict(step=step, **m))
            print_heldout(f"step {step}/{total} ", m, args.budget)
            with open(out / "log.jsonl", "a") as f:
                f.write(json.dumps(log[-1]) + "\n")

    # --- the loop (stage 3): step 0 evaluates the untrained module (or the --init adapter), the honest reference
    if step == 0:
        do_eval()
    bar = tqdm(total=total, initial=step, desc="training", disable=rank > 0)
    n_seen, stopped_early = 0, False
    while step < total:
        if args.max_minutes and time.perf_counter() - t_start > 60 * args.max_minutes:
            stopped_early = True
            print0(f"--max-minutes {args.max_minutes} reached at step {step}/{total}: saving what we have")
            do_eval()
            break
        epoch, k = divmod(step, steps_per_epoch)
        order = list(batches)
        random.Random(args.seed + epoch).shuffle(order)  # the same order on every rank and on resume
        step_batches = order[k * per_step:(k + 1) * per_step]
        n_step = sum(len(b) for b in step_batches)  # samples in this step, all ranks
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, args)
        mine = step_batches[rank::world]
        # the step's micro-batches are read from disk by a second thread while the first ones train
        loads = [reader.submit(load_batch, [sample_path(out, train_rows[i]["id"]) for i in idx], dev, dtype)
                 for idx in mine]

        def batch(idx, load):  # (cache, targets, lengths), the cache recomputed if the files do not hold it
            cache, gt, lengths = load.result()
            cache = cache if cache is not None else prompt_cache(model, [train_rows[i]["prompt_ids"] for i in idx])
            return cache, gt, lengths

        step_loss = optimizer_step(module, opt, model, (batch(idx, load) for idx, load in zip(mine, loads)), n_step,
                                   args.clip, loss, world).item()
        step += 1
        n_seen += n_step
        bar.set_postfix(loss=f"{step_loss:.4f}", samples_s=f"{n_seen / (time.perf_counter() - t0):.1f}")
        bar.update()
        if step % args.eval_every == 0 or step == total:
            do_eval()
        if rank == 0 and (step % args.save_every == 0 or step == total):
            save_checkpoint(ckpt, module, opt, step, log)
    bar.close()

    # --- the adapter and its metadata
    if rank == 0:
        if stopped_early:
            save_checkpoint(ckpt, module, opt, step, log)
        module.info = adapter_metadata(args, train_rows, len(held_rows), step, total, stopped_early, log,
                                       init_info)
        dest = Path(args.adapter_out) if args.adapter_out else out / "adapter.safetensors"
        module.save(dest)
        print0(f"saved {dest} (+ .json) after {step} steps, {time.perf_counter() - t0:.0f} s")
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
