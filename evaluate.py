"""
Evaluate KV-eviction methods against FullKV on long prompts, at several budgets C: how much the
answer changes (answer KL, fidelity), whether it is still right (accuracy), how much of the
true future attention the kept slots hold (recall@C), and what scoring costs.

The README's run: 24 RULER-style prompts at 2K tokens (6 tasks x 4), every method, C = 64..512
(--threads 1 when other jobs share the CPU: a multi-threaded torch waits for busy cores at every op):

    python evaluate.py --untrained --threads 1 --plot runs/eval/plot.png

    python evaluate.py --tasks my.jsonl --methods snapkv,lookahead --budgets 128   # your own prompts
    python evaluate.py --limit 3 ...        # the first 3 prompts only, for a quick look

Tasks: --tasks (JSON lines {"id", "task", "prompt", "answers": [...]}; empty answers: no
accuracy, the other metrics still) or data.make_eval_suite (RULER-style, "eval" split texts).

Per prompt, FullKV runs once: a prefill and a greedy answer `ref` (R tokens, the stop token
kept). ref is the "full" row and the reference of every metric:
  answer_kl  ref teacher-forced through the compressed cache and through the full one (one
             forward of ref[:-1] each); the mean over answer tokens 2..R of KL(p_full || p_method)
             of the next-token distributions (metrics.answer_kl; the first token is the prefill's,
             the same for every method). 0 when nothing changed, and smooth where accuracy
             jumps: what a user feels as "the answer changed". With snapkv and oracle in the run,
             a table gives each method's share of the SnapKV-to-oracle gap closed.
  accuracy   RULER string match of the method's own greedy answer; fidelity and exact: how much
             of ref that answer reproduces.
  recall     share of the true future attention (ref run on the full prompt cache,
             lookaheadkv.answer_attention) that the slots eviction really kept hold; the oracle
             keeps the exact top C of those scores (no pooling): its recall is the ceiling.
--untrained adds "lookahead-untrained", a module with the adapter's M / rank / targets and a
fresh init (seeded): the trained adapter's gain over it is what training bought.

Cost: scores do not depend on C, so each method prefills and scores once per prompt and every
budget is a top C of the same scores (lookaheadkv.prefill_and_score, then Scorer.evict). LAQ's
scores do depend on C (its draft runs on the C-slot cache): it re-scores per budget, on the same
prefill. Methods that do not watch the prefill (streaming, random, oracle) would prefill exactly
as FullKV does: they reuse its prefill. A greedy answer starts decoding where the teacher-forced
argmax first leaves ref (up to there greedy reproduces ref), so a method that keeps the answer
costs one forward, not R. A budget C >= S evicts nothing: that row is FullKV's own.

Prints a tqdm bar, then a markdown table per metric (accuracy, answer_kl, fidelity, exact,
recall, prefill_ms, score_ms) and, per method, the smallest budget at which it reaches 90% of
FullKV's accuracy. E.g. the shipped adapter (span 8 and its per-layer budgets, its .json) on the 24
prompts of the 2K suite (RESULTS.md section 2; ~15 min on one CPU thread next to another job):

    $ python evaluate.py --methods lookahead,lookahead-untrained --threads 1 --out runs/lb/eval2k-sqrt
    ...
    ### answer_kl: mean KL(FullKV || method) of the next-token distributions along FullKV's answer, ...

    | method | C=64 | C=128 | C=256 | C=512 |
    |---|---|---|---|---|
    | full | 0.0000 | 0.0000 | 0.0000 | 0.0000 |
    | lookahead | 0.5146 | 0.2504 | 0.1314 | 0.0563 |
    | lookahead-untrained | 0.6333 | 0.3502 | 0.1833 | 0.0850 |
    ...

(--uniform-budgets keeps C in every layer, as the paper: lookahead 0.6368 / 0.3788 / 0.1970 / 0.0839.)

and writes OUT/results.md (these tables, plus accuracy per task) and OUT/results.json (one
entry per (sample, method, budget)). Rerunning the same command skips every entry already in
results.json, so a killed run continues where it stopped; new methods or budgets are added.

Beyond the paper, two modes hold the cache to C after the prefill too (decode_eviction.DecodeEviction:
each time it holds C + --every slots, every slot is re-scored and the last --window always kept;
methods full, streaming, snapkv, h2o, lookahead, lookahead-untrained):

    python evaluate.py --mode decode --untrained --threads 2 --lengths 1024,2048 --per-task 1 \
        --budgets 128,256 --every 32 --max-new-tokens 384 --plot runs/eval-decode/plot.png      # ~20 min
    python evaluate.py --mode conversation --untrained --threads 2 --lengths 1024 --per-task 6 \
        --budgets 128,256,512 --every 32 --first-answer-tokens 96 --max-new-tokens 24 \
        --plot runs/eval-conversation/plot.png

decode: long answers (long_answer_suite: detailed explanations of speeches and essays, step by step
ones of stdlib code). Each method compresses the prompt to C, then FullKV's greedy answer is
teacher-forced through its cache while it is held to C, evicting on the very steps generation would
(decode_eviction.forced_logprobs_evicting): answer_kl along the whole answer, head_fidelity (FullKV's first
--fidelity-tokens tokens reproduced), peak_slots; --plot adds the cache size over the answer.
conversation: two-turn chats (conversation_suite: a document with one planted fact and a request for
a summary, then a question about the fact). FullKV's turn-1 answer is teacher-forced (held to C), turn
2 is added on top and all slots evicted to C (add_turn); accuracy, fidelity and answer_kl of turn 2
against FullKV on the whole conversation. Both run token by token: a row costs about one decode step
per answer token (bench.py --mode decode-cost measures the eviction's share).
"""

import argparse
import dataclasses
import hashlib
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

import data
from decode_eviction import DECODE_METHODS, DecodeEviction, add_turn, forced_logprobs_evicting
from lookaheadkv import (METHODS, POOLS, EvictConfig, LookaheadModule, Prefilled, answer_attention, check_pooling,
                         decode, default_adapter_path, greedy, keep_slots, make_scorer, prefill_and_score,
                         untrained_module)
from metrics import Stopwatch, answer_kl, forced_logprobs, gap_closed, recall_of_kept
from model import Tokenizer, check_device, check_model_dir, load_model, resolve_model

UNTRAINED = "lookahead-untrained"
METRICS = {  # name -> (title, format)
    "accuracy": ("accuracy: share of the expected answers found in the output (RULER string match)", "{:.3f}"),
    "answer_kl": ("answer_kl: mean KL(FullKV || method) of the next-token distributions along FullKV's answer, "
                  "teacher-forced, nats", "{:.4f}"),
    "fidelity": ("fidelity: share of FullKV's greedy tokens reproduced before the first divergence", "{:.3f}"),
    "exact": ("exact: rate of answers identical to FullKV's", "{:.3f}"),
    "recall": ("recall: attention recall@C against the true future attention", "{:.3f}"),
    # hook-based scorers (snapkv, h2o, laq, one-pass lookahead) do part of their work inside the
    # prefill, so compare prefill_ms + score_ms with full's prefill (bench.py measures this properly)
    "prefill_ms": ("prefill_ms: the prefill, with whatever scoring runs inside it, ms (once per method, all budgets)",
                   "{:.0f}"),
    "score_ms": ("score_ms: scoring + eviction after the prefill, ms (oracle: + the full-cache answer it needs)",
                 "{:.1f}"),
    # --mode decode and conversation (beyond the paper: the cache held to C while the answers grow)
    "head_fidelity": ("head_fidelity: share of FullKV's first --fidelity-tokens greedy tokens reproduced before the "
                      "first divergence", "{:.3f}"),
    "peak_slots": ("peak_slots: the most KV slots per (layer, KV head) the cache held", "{:.0f}"),
    "answer_tokens": ("answer_tokens: length of FullKV's answer, the one every method is teacher-forced along",
                      "{:.0f}"),
}
MODE_METRICS = {"prefill": ["accuracy", "answer_kl", "fidelity", "exact", "recall", "prefill_ms", "score_ms"],
                "decode": ["answer_kl", "head_fidelity", "peak_slots", "answer_tokens"],
                "conversation": ["accuracy", "answer_kl", "fidelity", "peak_slots"]}
REACH = 0.9  # "reaches FullKV": the smallest budget with at least this share of FullKV's accuracy

# -----------------------------------------------------------------------------
# Metrics


def fidelity(pred, ref):
    """(share of ref's tokens that pred reproduces before the first divergence, pred == ref)."""
    n = 0
    for a, b in zip(pred, ref):
        if a != b:
            break
        n += 1
    return n / max(len(ref), 1), list(pred) == list(ref)


def mean_of(results, metric, method, budget):
    v = [r[metric] for r in results if r["method"] == method and r["budget"] == budget and r.get(metric) is not None]
    return sum(v) / len(v) if v else None


def first_budget_reaching(results, method, budgets, share=REACH):
    """The smallest budget at which `method`'s mean accuracy is at least `share` of FullKV's at the
    same budget, or None (never, or FullKV itself scores 0: then every method would "reach" it)."""
    for b in sorted(budgets):
        full, acc = mean_of(results, "accuracy", "full", b), mean_of(results, "accuracy", method, b)
        if full and acc is not None and acc >= share * full:
            return b
    return None


def table(results, metric, methods, budgets):
    """Markdown: a row per method, a column per budget, the mean of `metric` over samples."""
    fmt = METRICS[metric][1]
    lines = ["| method | " + " | ".join(f"C={b}" for b in budgets) + " |", "|---" * (len(budgets) + 1) + "|"]
    for m in methods:
        cells = [mean_of(results, metric, m, b) for b in budgets]
        lines.append(f"| {m} | " + " | ".join("-" if c is None else fmt.format(c) for c in cells) + " |")
    return "\n".join(lines)


def gap_table(results, methods, budgets):
    """Markdown: per method and budget, the share of the SnapKV-to-oracle gap it closes in answer KL
    and in recall (metrics.gap_closed; 100% = the oracle, 0% = SnapKV): the headline."""
    lines = ["| method | " + " | ".join(f"C={b}" for b in budgets) + " |", "|---" * (len(budgets) + 1) + "|"]
    for m in methods:
        if m in ("full", "oracle", "snapkv"):
            continue
        cells = []
        for b in budgets:
            shares = []
            for metric, lower in (("answer_kl", True), ("recall", False)):
                v, snap, oracle = (mean_of(results, metric, x, b) for x in (m, "snapkv", "oracle"))
                g = None if None in (v, snap, oracle) else gap_closed(v, snap, oracle, lower_is_better=lower)
                shares.append("-" if g is None else f"{g:.0%}")
            cells.append(" / ".join(shares))
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def reach_table(results, methods, budgets):
    """Markdown: per method, the first budget reaching REACH of FullKV's accuracy ("-": never)."""
    lines = [f"| method | C reaching {REACH:.0%} of FullKV |", "|---|---|"]
    for m in methods:
        if m != "full":
            b = first_budget_reaching(results, m, budgets)
            lines.append(f"| {m} | {'-' if b is None else b} |")
    return "\n".join(lines)


def report(results, methods, budgets, per_task=False, metrics=MODE_METRICS["prefill"]):
    n = len({r["id"] for r in results})
    parts = [f"### {METRICS[m][0]} ({n} samples)\n\n{table(results, m, methods, budgets)}\n" for m in metrics]
    if {"snapkv", "oracle"} <= set(methods) and "answer_kl" in metrics:
        parts.append(f"### share of the SnapKV-to-oracle gap closed: answer KL / recall ({n} samples)\n\n"
                     f"{gap_table(results, methods, budgets)}\n")
    full = [r["accuracy"] for r in results if r["method"] == "full" and r.get("accuracy") is not None]
    if full:  # only prompts with expected answers have an accuracy
        parts.append(f"### the smallest budget at which each method reaches {REACH:.0%} of FullKV's accuracy "
                     f"({sum(full) / len(full):.3f}; '-': not within these budgets)\n\n"
                     f"{reach_table(results, methods, budgets)}\n")
    for task in sorted({r["task"] for r in results}) if per_task and "accuracy" in metrics else []:
        rows = [r for r in results if r["task"] == task]
        parts.append(f"### accuracy, task {task} ({len({r['id'] for r in rows})} samples)\n\n"
                     f"{table(rows, 'accuracy', methods, budgets)}\n")
    return "\n".join(parts)


def plot(results, methods, budgets, path, metrics=("recall", "answer_kl", "accuracy"), sizes=False):
    """Recall, answer KL (log axis) and accuracy (or `metrics`) against the budget, one line per method;
    sizes: first a panel of the cache size over the generated tokens (--mode decode)."""
    plt = need_matplotlib()
    fig, axes = plt.subplots(1, len(metrics) + sizes, figsize=(5 * (len(metrics) + sizes), 4))
    if sizes:
        size_panel(axes[0], results, budgets)
    for ax, metric in zip(axes[sizes:], metrics):
        for m in methods:
            ys = [mean_of(results, metric, m, b) for b in budgets]
            if metric == "answer_kl":  # FullKV's 0 (and any budget >= S) has no place on a log axis
                ys = [y if y is not None and y > 0 else None for y in ys]
            ax.plot(budgets, [float("nan") if y is None else y for y in ys], marker="o", label=m,
                    linestyle="--" if m in ("full", "oracle") else "-")  # the references dashed
        ax.set_xscale("log", base=2)
        if metric == "answer_kl":
            ax.set_yscale("log")
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("budget C (KV slots per layer and KV head)")
        ax.set_ylabel(metric + (" (nats, log)" if metric == "answer_kl" else ""))
        ax.grid(alpha=0.3)
    fig.legend(*axes[-1].get_legend_handles_labels(), loc="lower center", ncol=len(methods), fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))  # room for the legend below the plots
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)


def size_panel(ax, results, budgets):
    """KV slots per (layer, KV head) when each answer token is generated, on the first prompt: FullKV's
    cache grows by one a token; held to C it saws between C and C + every. Every method evicts on the
    same steps (the schedule depends only on the cache's size), so one line per budget stands for all."""
    first = results[0]["id"]
    rows = [r for r in results if r["id"] == first and r.get("sizes")]
    full = next((r for r in rows if r["method"] == "full"), None)
    if full:
        ax.plot(full["sizes"], "k--", label="full")
    for b in budgets:
        r = next((r for r in rows if r["method"] != "full" and r["budget"] == b), None)
        if r:
            ax.plot(r["sizes"], label=f"C={b} (every method)")
    ax.set_xlabel(f"generated token ({first})")
    ax.set_ylabel("KV slots per (layer, KV head)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def need_matplotlib():
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only, no window
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install matplotlib (or pip install '.[plot]')")
    return plt

# -----------------------------------------------------------------------------
# Answers on a cache: greedy, and FullKV's answer teacher-forced


def answer(model, cache, logits, logp, ref, next_pos, max_new_tokens, stop_ids):
    """The greedy answer on `cache`, given its first-token logits (1, V) and logp (R-1, V): ref
    teacher-forced on it. Up to the first position d where the argmax leaves ref, greedy decoding
    would produce ref's own tokens (up to rounding: one forward instead of one per token), so
    decoding starts there: ref[:d] goes into a copy of the cache in one forward, and greedy
    continues from the logits at d."""
    steps = torch.cat([logits.float().log_softmax(-1), logp])  # (R, V): what predicts ref[0], ref[1], ...
    d = next((i for i, (a, b) in enumerate(zip(steps.argmax(-1).tolist(), ref)) if a != b), None)
    if d is None:  # greedy reproduces ref, its stop token (or length cap) included
        return list(ref)
    cache = cache.copy()
    if d:
        prefix = torch.tensor([ref[:d]], device=next_pos.device)
        model(prefix, positions=next_pos[:, None] + torch.arange(d, device=next_pos.device), cache=cache, logits_at=-1)
    return ref[:d] + greedy(model, cache, steps[d][None], next_pos + d, max_new_tokens - d, stop_ids)[0]

# -----------------------------------------------------------------------------
# One prompt, every (method, budget)


@dataclass
class Reference:
    """FullKV on one prompt: what every method is measured against."""

    run: Prefilled  # the full prompt cache (S slots), the first-token logits, positions
    ref: list  # FullKV's greedy answer ids (R), the stop token kept
    response: torch.Tensor  # the same, (1, R)
    logp: torch.Tensor  # (R-1, V) float32: ref teacher-forced on the full cache (computed once per prompt)
    true: dict  # layer -> (1, H_kv, S): the answer's mean attention over the prompt, recall's truth
    prefill_ms: float
    answer_ms: float  # prefill + greedy answer: what the oracle needs before it can score


def reference(model, ids, max_new_tokens, stop_ids):
    """FullKV on the prompt ids (1, S): prefill, greedy answer, its true attention and its log-probs."""
    t0 = time.perf_counter()
    clock = Stopwatch(ids.device)
    clock.mark()
    _, run = prefill_and_score(model, ids, EvictConfig("full"), clock=clock)
    # decoding appends to the cache it is given: hand out copies, run.cache stays the prompt's alone
    ref = greedy(model, run.cache.copy(), run.logits, run.next_pos, max_new_tokens, stop_ids)[0]
    answer_ms = (time.perf_counter() - t0) * 1e3
    response = torch.tensor([ref], device=ids.device)
    true = answer_attention(model, run.cache, response, run.next_pos)
    logp = forced_logprobs(model, run.cache, response, run.next_pos)
    return Reference(run, ref, response, logp, true, clock.ms(0, 1), answer_ms)


def eviction_config(method, budget, args):
    """The EvictConfig of a row: lookahead-untrained runs as lookahead; pooling None = the method's own
    (lookaheadkv's scorers: avg 5 for attention scores, the adapter's for lookahead, none for the oracle)."""
    name = "lookahead" if method == UNTRAINED else method
    return EvictConfig(name, budget, window=args.window, pool=args.pool, kernel=args.kernel,
                       layer_weights="uniform" if args.uniform_budgets else None)


def prefill_once(model, ids, scorer, eviction, module, full):
    """The method's prefill and scores, shared by every budget: (run, prefill_ms, score_ms)."""
    if scorer.prefill_hook(ids.shape[1]) is None and scorer.extra_rows() is None and not scorer.needs_surprisal:
        # nothing watches the prefill (streaming, random, oracle): it would be FullKV's own, so reuse it
        run = dataclasses.replace(full.run, cache=full.run.cache.copy())
        clock = Stopwatch(ids.device)
        clock.mark()
        run.scores = scorer.score(model, run)
        clock.mark()
        return run, full.prefill_ms, clock.ms(0, 1)
    clock = Stopwatch(ids.device)
    clock.mark()
    _, run = prefill_and_score(model, ids, eviction, module=module, response=full.response, clock=clock)
    clock.mark()  # prefill_and_score marked the prefill's end; this marks the scoring's end
    return run, clock.ms(0, 1), clock.ms(1, 2)


def compact_caches(model, ids, method, budgets, full, modules, args):
    """For each budget C in `budgets` (all < S), the prompt cache evicted to C slots per (layer, KV
    head), from ONE prefill and one scoring. Yields (C, run, cache, kept, prefill_ms, score_ms): run
    the method's prefill (first-token logits, positions), kept the slots kept per layer (B, H_kv, C_l),
    score_ms scoring + this budget's eviction, as compress() reports it."""
    module = modules.get(method)  # lookahead, trained or not
    eviction = eviction_config(method, min(budgets), args)  # the smallest: it evicts if any budget does
    scorer = make_scorer(eviction, module, full.response)
    run, prefill_ms, score_ms = prefill_once(model, ids, scorer, eviction, module, full)
    for C in budgets:
        clock = Stopwatch(ids.device)
        clock.mark()
        scorer_c = make_scorer(dataclasses.replace(eviction, budget=C), module, full.response)
        scores, rescore = run.scores, scorer.budget_dependent and C != eviction.budget
        if rescore:  # LAQ: its draft runs on the C-slot cache, so each C scores anew (on the same prefill)
            scores = scorer_c.score(model, run)
        kept = scorer_c.evict(scores, run.positions, run.valid, surprisal=run.surprisal)
        cache = keep_slots(run.cache.copy(), kept)  # shallow copy: gather replaces its entries, run.cache stays whole
        clock.mark()
        yield C, run, cache, kept, prefill_ms, (0.0 if rescore else score_ms) + clock.ms(0, 1)


@torch.no_grad()
def run_sample(model, tok, row, ids, todo, modules, args, progress=None):
    """One result dict per (method, budget) in todo, for one prompt (ids: its token ids).
    progress(n) is called as each method's n rows are done."""
    ids = torch.tensor([ids], device=model.lm_head.weight.device)  # (1, S)
    full = reference(model, ids, args.max_new_tokens, tok.stop_ids)

    def result(method, budget, out, kl, recall, score_ms, prefill_ms):
        prefix, exact = fidelity(out, full.ref)
        text = tok.decode([i for i in out if i not in tok.stop_ids])
        return dict(id=row["id"], task=row["task"], method=method, budget=budget, prompt_tokens=ids.shape[1],
                    accuracy=data.is_correct(text, row["answers"]) if row["answers"] else None, answer_kl=kl,
                    fidelity=prefix, exact=exact, recall=recall, score_ms=round(score_ms, 2),
                    prefill_ms=round(prefill_ms, 2), output=text)

    results = []
    for method in dict.fromkeys(m for m, _ in todo):  # methods in order, each with its budgets left to do
        budgets = [b for m, b in todo if m == method]
        # FullKV, and a budget that holds the whole prompt (nothing evicted: compress would prefill
        # exactly as FullKV does and keep every slot): the row is FullKV's own
        rows = {b: result(method, b, full.ref, 0.0, 1.0, 0.0, full.prefill_ms)
                for b in budgets if method == "full" or b >= ids.shape[1]}
        evicting = [b for b in budgets if b not in rows]
        for C, run, cache, kept, prefill_ms, score_ms in (
                compact_caches(model, ids, method, evicting, full, modules, args) if evicting else []):
            logp = forced_logprobs(model, cache, full.response, run.next_pos)
            out = answer(model, cache, run.logits, logp, full.ref, run.next_pos, args.max_new_tokens, tok.stop_ids)
            score_ms += full.answer_ms if method == "oracle" else 0.0
            rows[C] = result(method, C, out, answer_kl(full.logp, logp), recall_of_kept(kept, full.true),
                             score_ms, prefill_ms)
        results += [rows[b] for b in budgets]
        if progress:
            progress(len(budgets))
    return results

# -----------------------------------------------------------------------------
# Beyond the paper: long answers and conversations on a cache held to C (--mode decode, conversation)

LONG_ASKS = {  # instructions whose answers run to hundreds of tokens
    "text": data.SIMPLE["detailed"],
    "code": ["Explain step by step what this code does, part by part.",
             "Explain every function and class in this code in detail: what it does, what it takes and returns, "
             "and how they work together.",
             "Write a detailed tutorial on how to use this code, with examples."],
}


def long_answer_suite(tok, lengths, per_task, seed, split="eval", docs=None):
    """--mode decode's prompts: per length, per_task documents of text (speeches, essays) and per_task of
    code (the stdlib), cut to ~length tokens with data.take_tokens and followed by a request for a long,
    detailed answer (data.py's "detailed" instructions, step-by-step explanations of code)."""
    docs = data.split_documents(data.load_documents() if docs is None else docs, split)
    pools = {"text": [d for d in docs if d.source != "stdlib"], "code": [d for d in docs if d.source == "stdlib"]}
    rows = []
    for length in lengths:
        for kind in [k for k in pools if pools[k]]:
            for i in range(per_task):
                key = f"long_{kind}/{length}/{seed}-{i}"
                rng = random.Random(key)
                ask = rng.choice(LONG_ASKS[kind])
                ctx = data.take_tokens(tok, pools[kind], rng, length - len(tok.encode(ask)) - 40)[0]  # 40: the template
                rows.append(dict(id=key, task=f"long_{kind}", prompt=f"{ctx}\n\n{ask}", answers=[]))
    return rows


def conversation_suite(tok, lengths, per_task, seed, split="eval", docs=None):
    """--mode conversation's two-turn chats: turn 1 is a ~length-token text (speeches, essays) with one
    made-up fact planted in it (data.FACTS) and a request for a summary; turn 2 asks for the fact, which
    only turn 1 holds: whatever the eviction after turn 1 and during its answer dropped is gone."""
    docs = [d for d in data.split_documents(data.load_documents(("sotu", "essays")) if docs is None else docs, split)
            if d.source != "stdlib"]
    rows = []
    for length in lengths:
        for i in range(per_task):
            key = f"conversation/{length}/{seed}-{i}"
            rng = random.Random(key)
            statement, question, answer = data.fact(rng, rng.choice(data.FACTS))
            ask = rng.choice(data.SIMPLE["summary"])
            ctx = data.plant(data.take_tokens(tok, docs, rng, length - 40)[0], [(rng.uniform(0.1, 0.9), statement)])
            turns = [f"{ctx}\n\n{ask}", f"{question} Answer in a few words."]
            rows.append(dict(id=key, task="conversation", turns=turns, answers=[answer]))
    return rows


def peak_of(sizes):
    """The most slots a forward saw: each fed token adds one to the size it was generated at (the last
    token is never fed), and an eviction follows at once when the cache is full."""
    return max([sizes[0]] + [s + 1 for s in sizes[:-1]])


def head_fidelity(logp, ref, n):
    """Share of ref's first n tokens reproduced before the first divergence. Greedy decoding repeats
    ref, evictions included, up to the first step where the teacher-forced argmax leaves it (as in answer())."""
    d = next((i for i, (a, b) in enumerate(zip(logp.argmax(-1).tolist(), ref)) if a != b), len(ref))
    n = min(n, len(ref))
    return min(d, n) / n


def start_caches(model, ids, method, budgets, full, modules, args):
    """{C: (first-token logits, next position, cache)}: the prompt compressed to C by the method's own
    prefill eviction, one prefill for every budget (compact_caches); C >= S keeps FullKV's cache."""
    out = {C: (full.run.logits, full.run.next_pos, full.run.cache.copy()) for C in budgets if C >= ids.shape[1]}
    evicting = [C for C in budgets if C < ids.shape[1]]
    for C, run, cache, *_ in compact_caches(model, ids, method, evicting, full, modules, args) if evicting else []:
        out[C] = run.logits, run.next_pos, cache
    return out


def decode_evictor(method, budget, modules, args):
    name = "lookahead" if method == UNTRAINED else method
    return DecodeEviction(name, budget, args.every, args.window, modules.get(method), args.pool, args.kernel)


@torch.no_grad()
def run_long_answer(model, tok, row, ids, todo, modules, args, progress=None):
    """--mode decode, one prompt: FullKV's greedy answer (up to --max-new-tokens, the stop token kept),
    then per (method, budget C) the prompt compressed to C and that answer teacher-forced with the cache
    held to C, evicting each time it holds C + --every slots. Metrics: answer KL against FullKV, the
    fidelity of the first --fidelity-tokens tokens, the peak slots, and the size at every step."""
    ids = torch.tensor([ids], device=model.lm_head.weight.device)  # (1, S)
    full = reference(model, ids, args.max_new_tokens, tok.stop_ids)
    S, R = ids.shape[1], len(full.ref)

    def result(method, budget, kl, fid, sizes):
        return dict(id=row["id"], task=row["task"], method=method, budget=budget, prompt_tokens=S, answer_tokens=R,
                    answer_kl=kl, head_fidelity=fid, peak_slots=peak_of(sizes), sizes=sizes)

    results = []
    for method in dict.fromkeys(m for m, _ in todo):
        budgets = [b for m, b in todo if m == method]
        if method == "full":  # the reference: its cache grows by one slot per token
            results += [result(method, b, 0.0, 1.0, list(range(S, S + R))) for b in budgets]
        else:
            starts = start_caches(model, ids, method, budgets, full, modules, args)
            for C in budgets:
                logits, pos, cache = starts[C]
                logp, sizes = forced_logprobs_evicting(model, cache, logits, pos, full.response,
                                                       decode_evictor(method, C, modules, args))
                steps = torch.cat([logits.float().log_softmax(-1), logp])  # what predicts each answer token
                results.append(result(method, C, answer_kl(full.logp, logp),
                                      head_fidelity(steps, full.ref, args.fidelity_tokens), sizes))
        if progress:
            progress(len(budgets))
    return results


@torch.no_grad()
def run_conversation(model, tok, row, ids, todo, modules, args, progress=None):
    """--mode conversation, one two-turn chat (ids: turn 1 in the chat format). FullKV answers turn 1
    (up to --first-answer-tokens), and FullKV on the whole conversation (turn 1, that answer, turn 2,
    token for token) gives the reference answer to turn 2. Per (method, budget C): turn 1 compressed to C,
    FullKV's turn-1 answer teacher-forced with the cache held to C (every method continues the same
    conversation), turn 2 added on top and everything evicted to C (add_turn), then the method's own
    greedy answer (accuracy, fidelity) and FullKV's teacher-forced (answer KL), both held to C."""
    dev = model.lm_head.weight.device
    ids = torch.tensor([ids], device=dev)  # (1, S1)
    first = reference(model, ids, args.first_answer_tokens, tok.stop_ids)
    a1 = first.ref  # the last token is never fed: it opens turn 2 unless it is a stop token
    turn2 = ([] if a1[-1] in tok.stop_ids else a1[-1:]) + tok.encode(tok.next_turn(row["turns"][1]))
    whole = torch.tensor([ids[0].tolist() + a1[:-1] + turn2], device=dev)  # the conversation, token for token
    second = reference(model, whole, args.max_new_tokens, tok.stop_ids)

    def result(method, budget, out, kl, peak):
        text = tok.decode([i for i in out if i not in tok.stop_ids])
        return dict(id=row["id"], task=row["task"], method=method, budget=budget, prompt_tokens=ids.shape[1],
                    conversation_tokens=whole.shape[1], accuracy=data.is_correct(text, row["answers"]), answer_kl=kl,
                    fidelity=fidelity(out, second.ref)[0], peak_slots=peak, output=text)

    results = []
    for method in dict.fromkeys(m for m, _ in todo):
        budgets = [b for m, b in todo if m == method]
        if method == "full":
            results += [result(method, b, second.ref, 0.0, whole.shape[1] + len(second.ref) - 1) for b in budgets]
        else:
            starts = start_caches(model, ids, method, budgets, first, modules, args)
            for C in budgets:
                logits, pos, cache = starts[C]
                ev = decode_evictor(method, C, modules, args)
                _, sizes1 = forced_logprobs_evicting(model, cache, logits, pos, first.response, ev)  # turn 1, held to C
                prefilled = len(cache) + len(turn2)
                logits, pos = add_turn(model, cache, torch.tensor([turn2], device=dev), pos + len(a1) - 1, ev, C)
                ev_forced, cache_forced = ev.fork(), cache.copy()  # two answers from here
                out = [t[0].item() for t in decode(model, cache, logits, pos, args.max_new_tokens, tok.stop_ids,
                                                   hook=ev.hook, after_step=ev.after_step)]
                logp, sizes2 = forced_logprobs_evicting(model, cache_forced, logits, pos, second.response, ev_forced)
                results.append(result(method, C, out, answer_kl(second.logp, logp),
                                      max(peak_of(sizes1), prefilled, peak_of(sizes2))))
        if progress:
            progress(len(budgets))
    return results

# -----------------------------------------------------------------------------
# Command line


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--mode", default="prefill", choices=list(MODE_METRICS),
      help="prefill: evict once after the prompt (the paper); decode: long answers with the cache held to C "
      "while they grow; conversation: two-turn chats held to C (beyond the paper)")
    a("--methods", default=None,
      help=f"comma-separated, from {', '.join(METHODS)}, {UNTRAINED} (decode, conversation: "
      f"{', '.join(DECODE_METHODS)}, {UNTRAINED}; default: all; full always runs: it is the reference)")
    a("--budgets", default="64,128,256,512", help="comma-separated budgets C (KV slots kept per layer and KV head)")
    a("--tasks", default=None, help='JSON lines {"id", "task", "prompt", "answers"}; conversation: "turns" (two user '
      'messages) instead of "prompt" (default: the built-in suite of the mode)')
    a("--lengths", default="2048", help="built-in suite: prompt lengths in tokens, comma-separated")
    a("--per-task", type=int, default=4, help="built-in suite: prompts per (task, length)")
    a("--limit", type=int, default=None, help="evaluate only the first N prompts")
    a("--max-new-tokens", type=int, default=64, help="length cap of every answer (conversation: of turn 2's)")
    a("--every", type=int, default=32, help="decode, conversation: evict each time the cache holds C + every slots")
    a("--fidelity-tokens", type=int, default=64, help="decode: fidelity over FullKV's first this many tokens")
    a("--first-answer-tokens", type=int, default=64, help="conversation: length cap of the answer to turn 1")
    a("--out", default=None, help="folder for results.json and results.md (default: runs/eval, runs/eval-decode, "
      "runs/eval-conversation)")
    a("--plot", default=None,
      help="save recall, answer KL and accuracy against budget to this image (needs matplotlib)")
    a("--adapter", default=None, help="lookahead adapter .safetensors (default: the one shipped for the model)")
    a("--untrained", action="store_true", help=f"add {UNTRAINED}: same M/rank/targets, fresh seeded init, LoRA B = 0")
    a("--window", type=int, default=32, help="snapkv/pyramidkv/h2o/laq: last prompt tokens always kept; decode, "
      "conversation: every method's last slots kept at each eviction after the prefill")
    a("--pool", default=None, choices=POOLS,
      help="score pooling for every method (default: each method's own: avg for attention scores, the adapter's "
      "for lookahead, none for the oracle)")
    a("--kernel", type=int, default=None, help="pooling width, odd (default: each method's own: 5, the adapter's)")
    a("--uniform-budgets", action="store_true", help="C slots in every layer for every method, as the paper "
      "evaluates (default: each method's own; lookahead: its adapter's per-layer budgets, mean C)")
    a("--chat", action=argparse.BooleanOptionalAction, default=None,
      help="wrap prompts in the chat template (default: when the tokenizer has one)")
    a("--model", default=None, help="an HF folder (default: weights/SmolLM2-135M-Instruct, prepared if missing)")
    a("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a("--threads", type=int, default=None,
      help="CPU threads for torch (default: torch's own); 1 is much faster when other jobs share the cores")
    a("--seed", type=int, default=0, help="built-in suite and the untrained module's init")
    return p.parse_args(argv)


def parse_list(text, flag, kind=str):
    try:
        return list(dict.fromkeys(kind(x.strip()) for x in text.split(",") if x.strip()))  # unique, in order
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected a comma-separated list of {kind.__name__}")


def load_modules(args, model, methods, folder):
    """{method: LookaheadModule} for lookahead (the adapter) and lookahead-untrained."""
    cfg, dev, dtype = model.config, args.device, model.lm_head.weight.dtype
    modules = {}
    path = Path(args.adapter) if args.adapter else default_adapter_path(cfg)
    if "lookahead" in methods:
        if not path.exists():
            raise ValueError(f"no lookahead adapter at {path}: train one with python train.py --model {folder} "
                             f"--adapter-out {path}, pass --adapter, or drop lookahead from --methods")
        modules["lookahead"] = LookaheadModule.load(path, cfg, dev)
    if UNTRAINED in methods:
        like = modules.get("lookahead")
        if like is None and path.exists():  # the untrained row alone: still the adapter's shape and pooling
            like = LookaheadModule.load(path, cfg, dev)
        kw = dict(n_tokens=like.n_tokens, rank=like.rank, alpha=like.alpha, targets=like.targets, pool=like.pool,
                  kernel=like.kernel, window=like.window, layer_budget=like.layer_budget) if like else {}
        torch.manual_seed(args.seed)  # the same draw on every run: P ~ N(0, std of the token embeddings)
        modules[UNTRAINED] = untrained_module(model, **kw)
    return {m: mod.to(dev).to(dtype).eval() for m, mod in modules.items()}


def save_json(obj, path):
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, path)  # atomic: a kill mid-write leaves the previous file whole


def main(argv=None):
    try:
        return evaluate(get_args(argv))
    except (ValueError, OSError, ImportError) as e:  # library errors: one line that says what to do, no traceback
        raise SystemExit(f"error: {e}")


def evaluate(args):
    t_start = time.perf_counter()
    prefill_mode = args.mode == "prefill"
    known = (METHODS if prefill_mode else ("full",) + DECODE_METHODS) + (UNTRAINED,)
    methods = parse_list(args.methods or ",".join(known[:-1]), "--methods")
    bad = [m for m in methods if m not in known]
    if bad:
        raise ValueError(f"unknown method(s) {', '.join(bad)} for --mode {args.mode}; choose from {', '.join(known)}")
    methods = list(dict.fromkeys(["full"] + methods + ([UNTRAINED] if args.untrained else [])))  # full first
    budgets = parse_list(args.budgets, "--budgets", int)
    if not budgets or min(budgets) <= 0:
        raise ValueError(f"--budgets {args.budgets!r}: every budget must be a positive number of KV slots")
    for m in methods:  # each method's own checks (budget vs its protected tokens, pooling width), before any work
        if m not in ("lookahead", UNTRAINED, "oracle"):  # those need their adapter / answer: checked when they run
            make_scorer(eviction_config(m, min(budgets), args))
            if not prefill_mode and m != "full":  # the decode-phase form's own: window, --every
                decode_evictor(m, min(budgets), {}, args)
    at_least = [("--max-new-tokens", args.max_new_tokens, 1), ("--first-answer-tokens", args.first_answer_tokens, 1),
                ("--every", args.every, 1), ("--fidelity-tokens", args.fidelity_tokens, 1),
                ("--per-task", args.per_task, 1), ("--limit", args.limit or 1, 1), ("--threads", args.threads or 1, 1),
                ("--window", args.window, 0)]
    for flag, value, lo in at_least:
        if value < lo:
            raise ValueError(f"{flag} {value}: must be at least {lo}")
    if args.kernel is not None:
        check_pooling(args.pool or "avg", args.kernel)
    lengths = parse_list(args.lengths, "--lengths", int)
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--lengths {args.lengths!r}: prompt lengths must be positive numbers of tokens")
    check_device(args.device)
    check_model_dir(args.model)
    for flag, path in [("--tasks", args.tasks), ("--adapter", args.adapter)]:
        if path is not None and not Path(path).is_file():
            raise FileNotFoundError(f"{flag} {path} not found")
    if args.plot:
        need_matplotlib()  # fail now, not after the whole run

    if args.threads:  # a thread that waits for a busy core stalls every op, the small ones of decoding most
        torch.set_num_threads(args.threads)
    args.model = str(resolve_model(args.model))  # weights/SmolLM2-135M-Instruct by default
    model = load_model(args.model, args.device)
    tok = Tokenizer(args.model, model.config)
    modules = load_modules(args, model, methods, args.model)
    chat = args.chat if args.chat is not None else tok.format is not None
    conversation = args.mode == "conversation"
    if conversation and not chat:
        raise ValueError("--mode conversation needs the chat format (ChatML or Llama-3): drop --no-chat")

    if args.tasks:
        keys = ("id", "task", "turns", "answers") if conversation else data.EVAL_KEYS
        rows = data.read_jsonl(args.tasks, required=keys)
        for r in rows if conversation else []:
            turns = r["turns"]
            if not (isinstance(turns, list) and len(turns) == 2 and all(isinstance(t, str) for t in turns)):
                raise ValueError(f"{args.tasks}: {r['id']}: 'turns' must be a list of two user messages")
    else:
        suite = dict(prefill=data.make_eval_suite, decode=long_answer_suite, conversation=conversation_suite)[args.mode]
        rows = suite(tok, lengths, args.per_task, args.seed)
    rows = rows[:args.limit] if args.limit else rows
    if len({r["id"] for r in rows}) < len(rows):
        raise ValueError(f"{args.tasks}: ids must be unique (they key the results for resuming)")
    first = [r["turns"][0] if conversation else r["prompt"] for r in rows]
    prompts = [tok.encode(tok.chat(text) if chat else text) for text in first]
    ctx = model.config.max_context
    for r, ids in zip(rows, prompts):
        more = args.first_answer_tokens + len(tok.encode(tok.next_turn(r["turns"][1]))) if conversation else 0
        if len(ids) + more + args.max_new_tokens > ctx:
            raise ValueError(f"prompt {r['id']} is {len(ids)} tokens" + (f" (+ {more}: turn 2)" if more else "")
                             + f"; with --max-new-tokens {args.max_new_tokens} it exceeds the model's context of "
                             f"{ctx}: shorten it or lower --max-new-tokens")

    # resume: entries already in results.json are kept, if they were made with the same settings
    out = Path(args.out or {"prefill": "runs/eval"}.get(args.mode, f"runs/eval-{args.mode}"))
    out.mkdir(parents=True, exist_ok=True)
    settings = dict(model=model.config.name, fingerprint=model.config.fingerprint(), max_new_tokens=args.max_new_tokens,
                    window=args.window, pool=args.pool, kernel=args.kernel, chat=chat, seed=args.seed)
    if not prefill_mode:
        settings.update(mode=args.mode, every=args.every, fidelity_tokens=args.fidelity_tokens,
                        first_answer_tokens=args.first_answer_tokens)
    if "lookahead" in modules:
        adapter = Path(args.adapter or default_adapter_path(model.config)).read_bytes()
        settings["adapter"] = hashlib.sha256(adapter).hexdigest()[:16]  # a retrained adapter needs a new --out
        # and so does another selection rule in its .json (the weights alone do not say how it selects)
        la = modules["lookahead"]
        settings["adapter_rule"] = f"{la.pool}:{la.kernel}:{la.window}" + (  # and its per-layer budgets, if any
            "" if la.layer_budget is None else ":" + hashlib.sha256(str(la.layer_budget).encode()).hexdigest()[:8])
    settings["uniform_budgets"] = args.uniform_budgets  # C in every layer is another eviction
    path = out / "results.json"
    saved = dict(settings={}, results=[])
    if path.exists():
        try:
            saved = json.loads(path.read_text())
        except json.JSONDecodeError:
            raise ValueError(f"{path} is not valid JSON: delete it to start over")
        clash = [k for k in settings if k in saved["settings"] and saved["settings"][k] != settings[k]]
        if clash:
            was = ", ".join(f"{k} {saved['settings'][k]} (now {settings[k]})" for k in clash)
            raise ValueError(f"{path} was made with other settings: {was}; use another --out")
    saved["settings"] = {**saved["settings"], **settings}
    stale = [r for r in saved["results"] if "answer_kl" not in r]  # made before answer_kl existed: redo them
    if stale:
        print(f"{path}: {len(stale)} entries lack answer_kl (an older evaluate.py): dropped, this run redoes its own")
        saved["results"] = [r for r in saved["results"] if "answer_kl" in r]
    done = {(r["id"], r["method"], r["budget"]) for r in saved["results"]}
    work = [(row, ids, [(m, b) for m in methods for b in budgets if (row["id"], m, b) not in done])
            for row, ids in zip(rows, prompts)]
    work = [w for w in work if w[2]]

    runner = dict(prefill=run_sample, decode=run_long_answer, conversation=run_conversation)[args.mode]
    bar = tqdm(total=sum(len(todo) for _, _, todo in work), desc="evaluating", unit="run")
    for row, ids, todo in work:
        bar.set_postfix_str(f"{row['id']} ({len(ids)} tokens)")
        saved["results"] += runner(model, tok, row, ids, todo, modules, args, progress=bar.update)
        save_json(saved, path)  # after every prompt: a killed run loses one prompt at most
    bar.close()

    wanted = {(r["id"], m, b) for r in rows for m in methods for b in budgets}
    results = [r for r in saved["results"] if (r["id"], r["method"], r["budget"]) in wanted]
    metrics = MODE_METRICS[args.mode]
    print(report(results, methods, budgets, metrics=metrics))
    (out / "results.md").write_text(report(results, methods, budgets, per_task=True, metrics=metrics))
    if args.plot and prefill_mode:
        plot(results, methods, budgets, args.plot)
    elif args.plot:  # the cache's size over the answer (decode), then the answer's metrics against C
        shown = [m for m in metrics if m not in ("peak_slots", "answer_tokens")]
        plot(results, methods, budgets, args.plot, metrics=shown, sizes=args.mode == "decode")
    print(f"wrote {out / 'results.md'} and {path}" + (f", {args.plot}" if args.plot else "")
          + f" in {time.perf_counter() - t_start:.0f} s ({len(work)} of {len(rows)} prompts had work left)")
    return results


if __name__ == "__main__":
    main()
