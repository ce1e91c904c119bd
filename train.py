"""
Train the lookahead module (M embeddings + a LoRA on their rows) with the KL loss, the base
model frozen: the module learns to attend to the prompt the way the model's own answer will.

CPU recipe, the shipped adapter (2 cores, float32; README.md says what it printed and how long it took;
after a kill, rerun the same command: the data stage keeps what it wrote, --resume the training checkpoint):
    python train.py --out runs/cpu --n-train 1000 --n-heldout 64 --max-new-tokens 128 --long-frac 0.05 \
        --gen-batch 16 --epochs 2 --eval-every 25 --save-every 5 --resume \
        --adapter-out weights/SmolLM2-135M-Instruct.lookahead.safetensors
(the LoRA on all seven projections, the default --targets all; with --targets q_proj,k_proj: the
adapter shipped before it, weights/SmolLM2-135M-Instruct.lookahead-qk.safetensors)
One GPU, paper-like scale (longer prompts and answers, more of them):
    python train.py --out runs/gpu --n-train 8000 --n-heldout 128 --max-tokens 4096 --max-new-tokens 256 \
        --gen-batch 64 --micro-batch 32 --epochs 2
Several GPUs (data parallel: each rank takes every world_size-th micro-batch; build the samples first):
    python train.py --stage data ... && torchrun --nproc_per_node=8 train.py ...
CPU smoke run (a few minutes on 2 cores):
    python train.py --out runs/smoke --n-train 8 --n-heldout 4 --max-tokens 600 --max-new-tokens 32 --batch 4 --epochs 1

It prints, per optimiser step, the loss (tqdm), and every --eval-every steps the held-out KL
and recall@C of lookahead / snapkv / h2o / streaming, e.g.
    step 20/66  heldout kl 0.161  recall@128 lookahead 0.842 snapkv 0.781 h2o 0.790 streaming 0.597

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
from evaluate import answer_kl as mean_answer_kl, forced_logprobs  # (train.evaluate is the held-out eval)
from lookaheadkv import (SCORERS, EvictConfig, LookaheadModule, Prefilled, WindowHook, compress, decode,
                         group_attention, lookahead_pass, make_scorer, pool_scores, recall_of_kept, select, stack)
from model import Hook, KVCache, Tokenizer, load_model

# -----------------------------------------------------------------------------
# Stage 1: samples. One prefill per prompt gives the base model's own answer, the target (the
# answer's attention over the prompt) and the training cache (the prompt's KV), kept on disk.


class TargetHook(Hook):
    """In the forward of the answers (B, R, right-padded) on top of the prompt cache: per layer
    and query head, the mean attention of each row's real answer queries over the S prompt slots.
    The same target as ground_truth's, for a batch."""

    def __init__(self, S, answer_mask):
        self.S, self.scores = S, {}
        self.weights = answer_mask.float() / answer_mask.sum(-1, keepdim=True).float()  # (B, R), mean over real ones

    def attn(self, layer, q, k, key_valid):
        B, H, R, _ = q.shape
        Hkv, S = k.shape[1], self.S
        probs = group_attention(q, k, key_valid)[..., :S].view(B, Hkv, H // Hkv, R, S)  # (B, H_kv, G, R, S)
        self.scores[layer] = torch.einsum("bkgrs,br->bkgs", probs, self.weights).flatten(1, 2)  # (B, H, S)


def left_pad(prompts, dev):
    """Token-id lists -> ids (B, S) with left padding, and pad_mask (B, S) True on real tokens."""
    S = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (S - len(p)) + p for p in prompts], device=dev)
    pad_mask = torch.tensor([[False] * (S - len(p)) + [True] * len(p) for p in prompts], device=dev)
    return ids, pad_mask


@torch.no_grad()
def answer_and_target(model, tok, prompts, max_new_tokens):
    """For B prompts (token-id lists) prefilled ONCE, together (left-padded): the greedy full-cache
    answer, then the answers run on top of the prompt cache for the target. Returns per prompt a
    dict: response_ids (the stop token kept: the answer's end is part of its future), k and v
    (L, H_kv, S_b, D) the prompt's cache, target (L, H, S_b), padding removed."""
    dev, L = model.lm_head.weight.device, model.config.num_hidden_layers
    ids, pad_mask = left_pad(prompts, dev)
    S = ids.shape[1]
    cache, logits, next_pos, _ = compress(model, ids, EvictConfig("full"), pad_mask=pad_mask)
    prompt_cache = cache.copy()  # decoding appends to `cache`; this one stays the prompt's
    answers, done = [[] for _ in prompts], [False] * len(prompts)
    for t in decode(model, cache, logits, next_pos, max_new_tokens, tok.stop_ids):
        for b, i in enumerate(t.tolist()):
            if not done[b]:
                done[b] = i in tok.stop_ids
                answers[b].append(i)
    target = answer_targets(model, prompt_cache, next_pos, answers)
    out = []
    for b, p in enumerate(prompts):
        real = slice(S - len(p), S)  # this row's slots, without the left padding
        out.append(dict(response_ids=answers[b],
                        k=torch.stack([prompt_cache.k[l][b, :, real] for l in range(L)]),  # (L, H_kv, S_b, D)
                        v=torch.stack([prompt_cache.v[l][b, :, real] for l in range(L)]),
                        target=torch.stack([target[l][b, :, real] for l in range(L)])))  # (L, H, S_b)
    return out


@torch.no_grad()
def answer_targets(model, prompt_cache, next_pos, answers):
    """The answers (B lists of ids, any lengths) run together on top of the prompt cache (B rows,
    S slots, next_pos (B,)): per layer, the target (B, H, S), each row's mean over its own answer's
    queries. One forward of (B, R_max) tokens; the right padding after a short answer is never seen
    by it (causal) and its queries get weight 0."""
    dev, S = next_pos.device, len(prompt_cache)
    R = max(len(a) for a in answers)
    answer_ids = torch.tensor([a + [a[-1]] * (R - len(a)) for a in answers], device=dev)  # (B, R), right-padded
    answer_mask = torch.arange(R, device=dev)[None] < torch.tensor([len(a) for a in answers], device=dev)[:, None]
    hook = TargetHook(S, answer_mask)
    model(answer_ids, positions=next_pos[:, None] + torch.arange(R, device=dev), cache=prompt_cache.copy(),
          hook=hook, logits_at=-1)
    return hook.scores


def sample_path(out, row_id):
    return Path(out) / "samples" / (hashlib.sha1(row_id.encode()).hexdigest()[:16] + ".safetensors")


def save_sample(path, sample, store_dtype):
    """The prompt's cache in store_dtype (bfloat16 halves the disk: the cache is an input, not a
    target), the target in float32. Written to a temporary name first: a kill leaves no half file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = dict(k=sample["k"].to(store_dtype), v=sample["v"].to(store_dtype), target=sample["target"].float())
    save_file({n: t.contiguous().cpu() for n, t in tensors.items()}, str(path.with_suffix(".tmp")))
    os.replace(path.with_suffix(".tmp"), path)


def sample_bytes(cfg, S, store_dtype):
    """Disk size of one sample of S prompt tokens."""
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * S * store_dtype.itemsize
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
    store = getattr(torch, args.store_dtype)
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


class GroundTruthHook(Hook):
    """In one no_grad forward over [prompt; answer] (S + R tokens): the answer's mean attention
    over the prompt per query head (the target), and optionally what SnapKV and H2O would
    score from the prompt's own queries (causal attention: the answer does not change them);
    their hooks are the scorers' own (lookaheadkv.SnapKV, lookaheadkv.H2O)."""

    def __init__(self, S, R, window=0):
        self.S, self.window = S, window
        self.gt = WindowHook(R, S, per_query_head=True)
        if window:
            eviction = EvictConfig(budget=window + 1, window=window)
            self.snapkv = SCORERS["snapkv"](eviction).prefill_hook(S)
            self.h2o = SCORERS["h2o"](eviction).prefill_hook(S)

    def attn(self, layer, q, k, key_valid):
        self.gt.attn(layer, q, k, key_valid)
        if self.window:
            S = self.S
            self.snapkv.attn(layer, q[:, :, max(S - self.window, 0):S], k[:, :, :S], None)
            self.h2o.attn(layer, q[:, :, :S], k[:, :, :S], None)


@torch.no_grad()
def ground_truth(model, row, window=0):
    """Returns the prompt's KV cache, the target scores {layer: (1, H, S)} and, with window > 0,
    SnapKV and H2O scores {layer: (1, H_kv, S)}."""
    dev = model.lm_head.weight.device
    p, r = row["prompt_ids"], row["response_ids"]
    S, R = len(p), len(r)
    ids = torch.tensor([p + r], device=dev)
    cache = KVCache(model.config.num_hidden_layers)
    hook = GroundTruthHook(S, R, window)
    model(ids, positions=torch.arange(S + R, device=dev)[None], cache=cache, hook=hook, logits_at=-1)
    cache.truncate(S)  # keep the prompt's KV only: the answer is what the lookahead must predict
    G = model.config.num_attention_heads // model.config.num_key_value_heads
    extra = dict(response=ids[:, S:])  # (1, R): the answer, for the held-out answer KL
    if window:
        extra.update(snapkv=hook.snapkv.scores, h2o=hook.h2o.scores(None, G))
    return cache, hook.gt.scores, extra


# -----------------------------------------------------------------------------
# Stage 3: the loss. The prediction is lookaheadkv.lookahead_pass(..., per_query_head=True): the M
# lookahead rows on top of the prompt cache (the two-pass form), the only rows with gradients.


def load_batch(paths, dev, dtype):
    """Sample files of different lengths, left-padded into one batch: a KVCache with (B, H_kv, S, D)
    per layer and its valid mask (B, 1, S), the targets {layer: (B, H, S)} (zero on padding, so
    they add nothing to the KL) and each row's prompt length (B,), where its lookahead rows start."""
    items = [load_file(str(p)) for p in paths]
    lengths = [it["target"].shape[-1] for it in items]
    B, S = len(items), max(lengths)
    L, Hkv, _, D = items[0]["k"].shape
    H = items[0]["target"].shape[1]
    # one copy per sample, straight into its slot of the padded batch (and from bfloat16 to dtype)
    k = torch.zeros(L, B, Hkv, S, D, dtype=dtype, device=dev)
    v = torch.zeros_like(k)
    target = torch.zeros(L, B, H, S, device=dev)
    for b, (it, n) in enumerate(zip(items, lengths)):
        k[:, b, :, S - n:] = it["k"]
        v[:, b, :, S - n:] = it["v"]
        target[:, b, :, S - n:] = it["target"]
    valid = (torch.arange(S)[None] >= S - torch.tensor(lengths)[:, None])[:, None].to(dev)  # (B, 1, S)
    cache = KVCache(L)
    for l in range(L):
        cache.k[l], cache.v[l], cache.valid[l] = k[l], v[l], valid
    return cache, {l: target[l] for l in range(L)}, torch.tensor(lengths, device=dev)


def micro_batches(rows, size):
    """Training rows cut into micro-batches of similar prompt lengths (little padding): indices
    sorted by length, then cut. Each epoch shuffles the micro-batches, not what is in them."""
    order = sorted(range(len(rows)), key=lambda i: (len(rows[i]["prompt_ids"]), rows[i]["id"]))
    return [order[i:i + size] for i in range(0, len(order), size)]


def kl_loss(gt, pred, pool="none", kernel=1, eps=1e-8):
    """KL(gt || pred) of the L1-normalised scores, averaged over layers and heads: the future's
    attention is the target distribution, the lookahead rows' the prediction. With a pool
    (--pool-loss), both are first smoothed as eviction will smooth the prediction: the module
    then learns which stretch of the prompt the answer reads, not which token of it."""
    losses = []
    for l, g in gt.items():
        g, s = pool_scores(g.float(), pool, kernel), pool_scores(pred[l].float(), pool, kernel)
        p = g / g.sum(-1, keepdim=True)
        q = s / s.sum(-1, keepdim=True)
        losses.append((p * ((p + eps).log() - (q + eps).log())).sum(-1).mean())
    return torch.stack(losses).mean()


def group_mean(scores, n_kv_heads):
    """Per-query-head scores (B, H, S) -> per-KV-head (B, H_kv, S), as eviction uses them."""
    return {l: s.view(s.shape[0], n_kv_heads, -1, s.shape[-1]).mean(2) for l, s in scores.items()}


HELDOUT_METHODS = ("oracle", "lookahead", "lookahead_nopool", "snapkv", "pyramidkv", "h2o", "streaming")


@torch.no_grad()
def evaluate(model, module, heldout, budget, window=32, budgets=(), answer_kl=()):
    """Held-out KL and recall@C of lookahead, snapkv, pyramidkv, h2o and streaming, each kept by
    its own scorer's eviction step (pooling, protected tokens, per-layer budgets:
    lookaheadkv.Scorer.evict) from the scores of the ground-truth forward; lookahead unpooled
    ("lookahead_nopool"), since pooling may blur a sharp predictor; and the oracle (the exact top
    C of the truth), the ceiling. Keys: recall_<method> at `budget` (the training log's line) and
    recall_<method>@<C> for every C in `budgets` too: scores are computed once for all of them.
    For the methods in `answer_kl`, also answer_kl_<method>@<C>: the base model's own answer
    teacher-forced through the compressed cache, mean KL(full cache || compressed) of the next-token
    distributions (one forward per method and C; what recall cannot see: which lost tokens matter).
    Items are (cache, gt, extra) from ground_truth(..., window)."""
    Hkv = model.config.num_key_value_heads
    Cs = list(dict.fromkeys([budget, *budgets]))
    kl, rec = [], {(m, C): [] for m in HELDOUT_METHODS for C in Cs}
    akl = {(m, C): [] for m in answer_kl for C in Cs}
    for cache, gt, extra in heldout:
        S = len(cache)
        positions = torch.arange(S, device=cache.k[0].device)[None]  # (1, S)
        pred = lookahead_pass(model, module, cache, S, per_query_head=True)
        kl.append(kl_loss(gt, pred).item())
        true = group_mean(gt, Hkv)
        lookahead, snap = stack(group_mean(pred, Hkv)), stack(extra["snapkv"])
        scores = dict(oracle=stack(true), lookahead=lookahead, lookahead_nopool=lookahead, snapkv=snap,
                      pyramidkv=snap, h2o=stack(extra["h2o"]))
        # answer tokens 2..R teacher-forced (the first is predicted under the full cache by every method)
        next_pos = torch.tensor([S], device=positions.device)
        logp_full = forced_logprobs(model, cache, None, extra["response"], next_pos) if akl else None
        for (method, C), r in rec.items():
            pool = "none" if method in ("lookahead_nopool", "oracle") else None
            if method == "oracle":  # the oracle scorer needs a response to run; its eviction is a plain top C
                kept = list(select(scores["oracle"], C))
            else:
                eviction = EvictConfig(method.removesuffix("_nopool"), C, window=window, pool=pool)
                scorer = make_scorer(eviction, module=module)
                if method == "streaming":  # scores from positions alone
                    run = Prefilled(cache, None, None, positions, positions[:, -1] + 1, None)
                    scores[method] = scorer.score(model, run)
                kept = scorer.evict(scores[method], positions)
            r.append(recall_of_kept(kept, true))
            if (method, C) in akl:
                small = cache.copy()
                for l, idx in enumerate(kept):
                    small.gather(l, idx)
                logp = forced_logprobs(model, small, None, extra["response"], next_pos)  # positions stay S..
                akl[method, C].append(mean_answer_kl(logp_full, logp))
    out = dict(kl=sum(kl) / len(kl))
    for (m, C), v in rec.items():
        out[f"recall_{m}@{C}"] = sum(v) / len(v)
        if C == budget:
            out[f"recall_{m}"] = out[f"recall_{m}@{C}"]
    for (m, C), v in akl.items():
        out[f"answer_kl_{m}@{C}"] = sum(v) / len(v)
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
    a("--store-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
      help="dtype of the prompt caches kept on disk (OUT/samples) for every epoch")
    a("--store-gb", type=float, default=40, help="refuse to build samples that would take more disk than this")
    # module
    a("--n-tokens", type=int, default=32, help="M, lookahead tokens")
    a("--rank", type=int, default=8)
    a("--alpha", type=float, default=32)
    a("--targets", default="all", help="LoRA targets: all (the seven projections, as the shipped adapter and "
      "the paper's release), or any of q,k,v,o,gate,up,down _proj; '' or none: the embeddings alone")
    a("--pool", default="avg", choices=["avg", "max", "none"],
      help="scoring pooling the adapter will use at eviction (README sections 1-2)")
    a("--kernel", type=int, default=5)
    a("--pool-loss", action="store_true", help="smooth target and prediction with --pool / --kernel in the loss "
      "too (train with the pooling you ship; default: the loss compares unpooled scores)")
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
    return tuple(t.strip() for t in text.split(",") if t.strip() and t.strip() != "none")


def new_module(model, args):
    """The untrained module: P drawn with the std of the token embeddings, LoRA B = 0."""
    emb_std = model.model.embed_tokens.weight.float().std().item()  # P starts at the scale of real tokens
    return LookaheadModule(model.config, args.n_tokens, args.rank, args.alpha, parse_targets(args.targets), emb_std,
                           args.pool, args.kernel, args.lookahead_window).to(args.device)


def print_heldout(name, r, budget):
    print(f"{name} heldout kl {r['kl']:.4f}  recall@{budget} lookahead {r['recall_lookahead']:.3f} "
          f"(unpooled {r['recall_lookahead_nopool']:.3f}) snapkv {r['recall_snapkv']:.3f} h2o {r['recall_h2o']:.3f} "
          f"streaming {r['recall_streaming']:.3f}")


def eval_only(model, module, held_rows, args):
    """--eval-only ADAPTER[,ADAPTER...]: held-out metrics of each adapter next to the untrained init
    (same seed), on one held-out ground truth: the table of an ablation in one command."""
    heldout = [ground_truth(model, r, window=args.window) for r in tqdm(held_rows, desc="held-out ground truth")]
    adapters = [("untrained", module)] + [(path, LookaheadModule.load(path, model.config, args.device))
                                          for path in args.eval_only.split(",")]
    Cs = [int(c) for c in args.budgets.split(",")] if args.budgets else []
    table = []
    for i, (name, m) in enumerate(adapters):
        label = "untrained" if i == 0 else ("adapter" if len(adapters) == 2 else name)
        # the answer KL of the prompt-only baselines once (with the first row), of each adapter's rows always
        # (its pooled row only if it pools: unpooled, the two rows keep the same slots)
        own = ("lookahead", "lookahead_nopool") if m.pool != "none" else ("lookahead_nopool",)
        base = tuple(x for x in HELDOUT_METHODS if not x.startswith("lookahead")) if i == 0 else ()
        akl = base + own if args.answer_kl and Cs else ()
        result = evaluate(model, m, heldout, args.budget, args.window, Cs, answer_kl=akl)
        print_heldout(f"{label:9s} ({len(heldout)})", result, args.budget)
        table.append((label, m.pool, result))
    if not Cs:
        return
    # markdown tables: the prompt-only baselines once, then each adapter pooled as its .json says and unpooled
    first = table[0][2]
    for metric, title, fmt in [("recall", "recall@C", ".3f"), ("answer_kl", "answer KL", ".4f")]:
        if f"{metric}_oracle@{Cs[0]}" not in first:
            continue
        row = lambda name, r, m, kl="": (f"| {name} | " + " | ".join(f"{r[f'{metric}_{m}@{C}']:{fmt}}" for C in Cs)
                                         + f" | {kl} |")
        print(f"\n| {title} ({len(heldout)} held-out) | " + " | ".join(f"C={C}" for C in Cs) + " | KL(gt ‖ pred) |")
        print("|---" * (len(Cs) + 2) + "|")
        for m in ("oracle", "snapkv", "pyramidkv", "h2o", "streaming"):
            print(row(m, first, m))
        for label, pool, r in table:
            if pool != "none":
                print(row(f"{label}, pool {pool}", r, "lookahead", f"{r['kl']:.4f}"))
            print(row(f"{label}, unpooled", r, "lookahead_nopool", f"{r['kl']:.4f}"))
    gap = lambda r, m, C: (r[f"recall_{m}@{C}"] - first[f"recall_snapkv@{C}"]) / max(
        1e-9, first[f"recall_oracle@{C}"] - first[f"recall_snapkv@{C}"])
    for label, pool, r in table:
        print(f"{label}: share of the SnapKV-to-oracle gap closed, as shipped ({pool}): "
              + ", ".join(f"C={C} {gap(r, 'lookahead', C):.0%}" for C in Cs)
              + "; unpooled: " + ", ".join(f"C={C} {gap(r, 'lookahead_nopool', C):.0%}" for C in Cs))


def adapter_metadata(args, n_train, n_held, step, total, stopped_early, log, init_info):
    """What the shipped .json says about how the adapter was made."""
    info = dict(train_data=dict(sources=list(data.SOURCES), n_train=n_train, n_heldout=n_held,
                                min_tokens=args.min_tokens, max_tokens=args.max_tokens,
                                max_new_tokens=args.max_new_tokens, long_frac=args.long_frac,
                                copy_frac=args.copy_frac,
                                long_max=args.long_max, python=data.PYTHON),
                steps=step, planned_steps=total, stopped_early=stopped_early, batch=args.batch, lr=args.lr,
                pool_loss=args.pool_loss,
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
    if args.model is None:
        from weights.prepare import DEFAULT_DIR, ensure_default
        args.model = str(ensure_default(DEFAULT_DIR))
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
    if args.eval_only:
        return eval_only(model, module, held_rows, args)
    opt = torch.optim.AdamW(module.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    loss_pool = (args.pool, args.kernel) if args.pool_loss else ("none", 1)
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
    heldout = [ground_truth(model, r, window=args.window)
               for r in tqdm(held_rows, desc="held-out ground truth", disable=rank > 0)]
    dtype = model.lm_head.weight.dtype
    reader = ThreadPoolExecutor(max_workers=1)

    def do_eval():
        if heldout and rank == 0:
            m = evaluate(model, module, heldout, args.budget, args.window)
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
        loss_sum = 0.0
        mine = step_batches[rank::world]
        # the step's micro-batches are read from disk by a second thread while the first ones train
        loads = [reader.submit(load_batch, [sample_path(out, train_rows[i]["id"]) for i in idx], dev, dtype)
                 for idx in mine]
        for idx, load in zip(mine, loads):
            cache, gt, lengths = load.result()
            pred = lookahead_pass(model, module, cache, lengths, per_query_head=True)  # B samples in one forward
            # each sample weighs the same in the step's mean; ranks average their gradients after
            loss = kl_loss(gt, pred, *loss_pool) * len(idx) * world / n_step
            loss.backward()
            loss_sum += loss.item() / world
        if ddp:
            all_reduce_grads(module, world)
        torch.nn.utils.clip_grad_norm_(module.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        n_seen += n_step
        bar.set_postfix(loss=f"{loss_sum:.4f}", samples_s=f"{n_seen / (time.perf_counter() - t0):.1f}")
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
        module.info = adapter_metadata(args, len(train_rows), len(held_rows), step, total, stopped_early, log,
                                       init_info)
        dest = Path(args.adapter_out) if args.adapter_out else out / "adapter.safetensors"
        module.save(dest)
        print0(f"saved {dest} (+ .json) after {step} steps, {time.perf_counter() - t0:.0f} s")
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
