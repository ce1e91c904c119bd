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

generate.py's stats of one answer (answer_stats: what ran, its KV bytes) time it with a Stopwatch;
keep_fraction draws its kept tokens (--show).
"""

import dataclasses
import random
import time

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


class Stopwatch:
    """Time marks on the device's own timeline. On CUDA they are events recorded in the stream, not
    synchronisations: the CPU keeps queueing the scoring kernels while the GPU still runs the
    prefill, so their launch cost hides behind it, as it would in a server. On CPU, wall time.
    compress(..., clock=Stopwatch(device)) marks the end of the prefill and of the eviction."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.marks = []

    def mark(self):
        if self.cuda:
            self.marks.append(torch.cuda.Event(enable_timing=True))
            self.marks[-1].record()
        else:
            self.marks.append(time.perf_counter())

    def ms(self, i, j):  # from mark i to mark j (waits for mark j on CUDA)
        if self.cuda:
            self.marks[j].synchronize()
            return self.marks[i].elapsed_time(self.marks[j])
        return (self.marks[j] - self.marks[i]) * 1e3


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


def answer_stats(args, model, selection, S, kept, text, timing, cache, evictor=None, module=None):
    """What generate.py ran and what it cost, as --json prints it. selection: (rule, budget policy) in words
    (methods.selection_of); kept: (slots per layer, bytes) of the cache right after the eviction; timing:
    prefill_ms, evict_ms, ttft_ms, decode_tokens_per_s; cache, evictor: at the end of the answer (beyond the
    paper: --decode-budget's DecodeEviction, whose log holds (position, slots before, slots after) per eviction);
    module: the adapter, whose .json may recommend a selection beyond the paper (said, never applied unasked)."""
    cfg, itemsize = model.config, model.lm_head.weight.element_size()
    (per_layer, kv_kept), (rule, budgets) = kept, selection
    kv_full = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * S * itemsize  # K and V, every slot
    stats = dict(method=args.method, rule=rule, budgets=budgets, budget=args.budget, prompt_tokens=S,
                 kept_tokens=round(sum(per_layer) / len(per_layer)), kept_range=[min(per_layer), max(per_layer)],
                 text=text, **timing, kv_bytes_full=kv_full, kv_bytes_kept=kv_kept)
    recommends = recommended_flags(module.info) if module is not None else ""
    if recommends and (rule, budgets) != (module.info.get("rule", rule), "per-layer budgets"):
        stats["recommends"] = recommends
    if evictor is not None:  # the cache only grows between evictions: its peak is where one began, or an end
        stats.update(decode_budget=args.decode_budget, every=args.every, decode_evictions=len(evictor.log),
                     peak_slots=max([max(per_layer), len(cache)] + [before for _, before, _ in evictor.log]),
                     kv_bytes_end=cache.nbytes())
    return stats


def recommended_flags(info):
    """The flags that select as an adapter's .json recommends, e.g. "--pool span:8:1024 --layer-budgets"."""
    return " ".join(([f"--pool {info['rule']}"] if info.get("rule") else [])
                    + (["--layer-budgets"] if info.get("layer_weights") else []))


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
