"""
How a compressed cache is judged: the measures every evaluation here shares (harness.py, evaluate.py).

    recall@C    the share of the true future attention (the full-cache answer's attention over the
                prompt, per layer and KV head) that the kept slots hold: recall_of_kept
    answer KL   FullKV's answer teacher-forced through the full and the compressed cache; the mean
                KL(full || compressed) of the next-token distributions: forced_logprobs, answer_kl
    gap closed  how much of the distance from SnapKV to the oracle a method covers: gap_closed

Answer KL counts answer tokens 2..R. The first answer token is predicted by the prefill itself,
before any eviction, so it is the same for every method; tokens 2..R are the ones a compressed
cache predicts. An answer of one token (the stop token) has KL 0.

keep_fraction draws generate.py's kept tokens (--show).
"""

import dataclasses
import random

import torch

from eviction import prefill_and_score
from methods import make_scorer


def recall_of_kept(kept, true):
    """Share of the true future attention mass that the kept slots hold. kept: per layer, the
    kept prompt slots (B, H_kv, C_l); true: per layer, scores (B, H_kv, S), L1-normalised here
    per (row, KV head). Mean over layers, KV heads and rows."""
    r = []
    for layer, idx in enumerate(kept):
        t = true[layer].float()
        t = t / t.sum(-1, keepdim=True).clamp(min=1e-12)
        r.append(t.gather(-1, idx).sum(-1).mean())
    return torch.stack(r).mean().item()


@torch.no_grad()
def forced_logprobs(model, cache, response, next_pos):
    """(R-1, V) float32 log-probs of answer tokens 2..R, with the answer `response` (1, R)
    teacher-forced on a copy of `cache` in ONE forward of its first R-1 tokens at next_pos (1,) on."""
    R = response.shape[1]
    if R < 2:
        return torch.zeros(0, model.lm_head.weight.shape[0], device=response.device)
    positions = next_pos[:, None] + torch.arange(R - 1, device=response.device)  # next_pos .. next_pos+R-2
    logits = model(response[:, :-1], positions=positions, cache=cache.copy(), logits_at=None)  # (1, R-1, V)
    return logits[0].float().log_softmax(-1)


def answer_kl(logp_full, logp):
    """Mean over the answer positions of KL(p_full || p), from log-probs (R-1, V) in float32 as
    forced_logprobs returns them. Clamped at 0 per position: identical distributions can round to -1e-9."""
    if logp.shape[0] == 0:
        return 0.0
    kl = (logp_full.exp() * (logp_full - logp)).sum(-1)  # (R-1,)
    return kl.clamp(min=0).mean().item()


def gap_closed(method, snapkv, oracle, lower_is_better=False):
    """The share of the SnapKV-to-oracle gap a method closes: 0 = SnapKV, 1 = the oracle, < 0 worse
    than SnapKV. For answer KL (lower is better) and recall (higher is better) alike; None when
    there is no gap to close."""
    gap = (snapkv - oracle) if lower_is_better else (oracle - snapkv)
    if gap <= 1e-12:
        return None
    return ((snapkv - method) if lower_is_better else (method - snapkv)) / gap


def paired_ci(diffs, n=2000, seed=0):
    """95% bootstrap interval of the mean of paired differences (one per prompt): resample prompts."""
    rng = random.Random(seed)
    means = sorted(sum(rng.choice(diffs) for _ in diffs) / len(diffs) for _ in range(n))
    return means[int(0.025 * n)], means[int(0.975 * n)]


def keep_fraction(kept, S):
    """(S,) per prompt token of batch row 0, the share of (layer, KV head) pairs that kept it
    (generate.py --show and research/analysis/plot_kept.py draw it). kept: per layer (B, H_kv, C_l)."""
    slots = torch.cat([k[0].flatten() for k in kept])  # row 0's kept slots, every layer and KV head
    return (torch.bincount(slots, minlength=S) / (len(kept) * kept[0].shape[1])).cpu()


@torch.no_grad()
def answer_kls(model, row, scorers, budgets):
    """{name@C: answer KL} of one held-out row (prompt_ids, response_ids: the base model's own greedy answer):
    ONE prefill of the prompt with every scorer watching (lookahead in its two-pass form: its one-pass rows
    cannot ride beside other hooks; the same scores), then for each budget C the scores evicted into a copy of
    the cache and the answer teacher-forced through it. A prompt of at most C tokens evicts nothing: KL 0."""
    dev = model.lm_head.weight.device
    ids, response = torch.tensor([row["prompt_ids"]], device=dev), torch.tensor([row["response_ids"]], device=dev)
    names = list(scorers)
    runs = prefill_and_score(model, ids, [scorers[n] for n in names])  # one Prefilled each, one shared cache
    full = forced_logprobs(model, runs[0].cache, response, runs[0].next_pos)
    out = {}
    for name, run in zip(names, runs):
        for C in budgets:
            if run.scores is None or ids.shape[1] <= C:
                out[f"{name}@{C}"] = 0.0
                continue
            at_C = make_scorer(dataclasses.replace(scorers[name].eviction, budget=C), getattr(scorers[name], "module", None))
            cache = run.cache.copy()  # the shared cache stays whole for the next scorer and budget
            for layer, idx in enumerate(at_C.evict(run.scores, run)):
                cache.gather(layer, idx)
            out[f"{name}@{C}"] = answer_kl(full, forced_logprobs(model, cache, response, run.next_pos))
    return out
