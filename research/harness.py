"""
The held-out check, in one place: for prompts the training never saw, how close each method's kept
cache comes to the truth. evaluate.py --heldout prints its tables; train.py's periodic check calls
heldout_metrics on the same ground truth.

Per prompt, ground_truth runs the prompt and the model's own answer on top of it once: the prompt's KV
cache and the target (the answer's attention over the prompt, per query head). Then every row of ROWS
is kept by the same steps compress() runs (eviction.prefill_and_score, Scorer.evict), its scorer built
by methods.make_scorer: one prefill of the prompt watched by every row's scorer at once (made once per
prompt and kept), each row's scores, its eviction step. metrics.py judges the kept slots: recall@C, and
with answer_kl the answer KL (FullKV's answer teacher-forced through the compressed cache), and the
share of the SnapKV-to-oracle gap each closes. LookaheadKV runs in its two-pass form here (its M rows
on top of the prompt cache, the training form: the same scores as one pass), so that its prefill is the
one every row shares and a new module needs only its rows run again.
"""
import sys

if __name__ == "__main__":  # a library module, run by -m or by its path: said before any import can fail
    sys.exit("error: research.harness is not a script: "
             "it is the held-out check: python -m research.evaluate --heldout RUN")

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from baselines import full_answer
from eviction import EvictConfig, keep_slots, prefill_and_score, uniform_budgets
from lookaheadkv import answer_attention, kl_loss, lookahead_pass
from methods import adapter_selection, make_scorer, parse_rule
from support import files
from support.metrics import answer_kl, forced_logprobs, gap_closed, recall_of_kept
from model import KVCache

# row -> (method, rule, budgets): None = the method's own; for lookahead, as its adapter's .json recommends
# (the shipped adapter: span:8:1024 and per-layer budgets; row_scorer asks for them by name)
ROWS = {"oracle": ("oracle", None, None), "lookahead": ("lookahead", None, None),
        "lookahead-unpooled": ("lookahead", "none", None), "snapkv": ("snapkv", None, None),
        "pyramidkv": ("pyramidkv", None, None), "h2o": ("h2o", None, None), "streaming": ("streaming", None, None)}
# the paper's form (its text: mean-aggregated scores, pooled, top C in every layer; KVCache-Factory, the code
# it builds on, pools with max 7), and with an adapter that has per-layer budgets: the paper's C in every
# layer, and SnapKV given the adapter's budgets (what the budgets alone buy a prompt-only method)
PAPER_ROWS = {"lookahead-paper": ("lookahead", "max:7", "uniform")}
LAYERED_ROWS = {"lookahead-uniform": ("lookahead", None, "uniform"), "snapkv-layered": ("snapkv", None, "adapter")}
BASELINES = ("oracle", "snapkv", "pyramidkv", "h2o", "streaming")


@torch.no_grad()
def ground_truth(model, prompt_ids, response_ids):
    """One prompt: (cache, target {layer: (1, H, S)}, extra): extra holds the prompt and answer ids (1, S), (1, R)."""
    dev = model.lm_head.weight.device
    prompt, response = torch.tensor([prompt_ids], device=dev), torch.tensor([response_ids], device=dev)
    run, _ = full_answer(model, prompt, 0, ())  # FullKV's prefill; the answer is the row's (the data stage's)
    gt = answer_attention(model, run.cache, response, run.next_pos, per_query_head=True)
    return run.cache, gt, dict(prompt=prompt, response=response)


def heldout_ground_truth(model, rows, out=None, keep_runs=False):
    """ground_truth of every row ({"prompt_ids", "response_ids"}). Without `out`, a list of (cache, target, extra)
    items, every prompt's in memory. With it, each is kept in OUT/heldout (one file per row, ~50 KB per prompt
    token), so that later runs on the same rows skip the forwards, and the items are an OnDisk: each prompt's
    cache and target read back when it is measured, one prompt's in memory at a time (48 prompts of 4K tokens
    held at once took 15.7 GB). keep_runs: the caller keeps every prompt's runs between calls (memory_plan)."""
    dev = model.lm_head.weight.device
    print(memory_plan(model, rows, out, keep_runs))
    items, paths = [], []
    for r in tqdm(rows, desc="held-out ground truth", disable=len(rows) < 4):
        # named by what it is made of: the model, the prompt and the answer
        key = json.dumps([model.config.fingerprint(), r["prompt_ids"], r["response_ids"], "v3"])
        path = None if out is None else Path(out) / "heldout" / (hashlib.sha1(key.encode()).hexdigest()[:16] + ".pt")
        paths.append(path)
        if path is not None and path.is_file():  # a named pipe there would block the read: made again below
            try:  # tensors only (weights_only): a file that pickles an object is not run, but made again below
                if out is None:
                    items.append(load_item(path, dev))
                else:  # read when measured (OnDisk); opened here (mmap: no tensor is read) to find a file cut short
                    torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                continue
            except Exception:  # a file cut short by a kill: made again below
                print(f"{path} is unreadable: computing it again")
        cache, gt, extra = ground_truth(model, r["prompt_ids"], r["response_ids"])
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            # a file named by its content, written whole under a temporary name of its own, then moved in at
            # once (files.write_with): a train.py run and an evaluate.py --heldout run on one folder never mix
            # their halves, and a full disk is one `error:` line
            files.write_with(path, lambda tmp: torch.save(dict(k=cache.k, v=cache.v, gt=gt, extra=extra), tmp))
        if out is None:
            items.append((cache, gt, extra))
        cache = gt = None  # with `out`: on disk, not held while the next prompt's is made
    if out is None:
        return items
    # what stays in memory per prompt: its ids (ground_truth's extra: the same tensors as the file's) and, while
    # scored_runs' runs are kept (heldout_metrics between calls), their scores
    ids = lambda key: [torch.tensor([r[key]], device=dev) for r in rows]  # noqa: E731
    extras = [dict(prompt=p, response=a) for p, a in zip(ids("prompt_ids"), ids("response_ids"))]
    return OnDisk(paths, extras, dev)


def load_item(path, device):
    """One ground_truth item (cache, target, extra) from its file in OUT/heldout."""
    saved = torch.load(path, map_location=device, weights_only=True)
    cache = KVCache(len(saved["k"]))
    cache.k, cache.v = saved["k"], saved["v"]
    return cache, saved["gt"], saved["extra"]


class OnDisk(Sequence):
    """heldout_ground_truth's items kept in OUT/heldout: item i's cache and target are read from its file when
    it is asked for, and let go with it; its extra (the prompt and answer ids, and the runs scored_runs keeps
    until compare() lets them go, whose scores are small and outlive the cache) stays in memory, the same dict on
    every read."""

    def __init__(self, paths, extras, device):
        self.paths, self.extras, self.device = paths, extras, device

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        cache, gt, _ = load_item(self.paths[i], self.device)  # the file's extra: the same ids as extras[i]
        return cache, gt, self.extras[i]


def memory_plan(model, rows, out, keep_runs=False):
    """The line printed before the ground truth is made: one prompt's (its KV cache and target, from the longest
    prompt's length and the model's config), every prompt's (on disk with `out`, else in memory), and the expected
    peak. Measured on SmolLM2-135M, 8 prompts of 1K, compare() of two modules, answer KL (peak RSS 1.26 GB): the
    weights and ~0.3 GB of torch's own; ~8 prompts' worth while one is measured (its cache, the prefill's own, the
    cache with the answer or the lookahead rows appended, gathered copies, allocator slack); and a prompt's runs,
    ~7.5 KB a prompt token measured with the shipped adapter (12 rows' scores and their hooks' sums, about 15
    tensors (L, H_kv, S) float32, and the span rule's hidden states (S, hidden)): compare() holds one prompt's,
    a check that keeps them between calls (keep_runs: train_lab's heldout_metrics) every prompt's."""
    cfg = model.config
    S = max((len(r["prompt_ids"]) for r in rows), default=0)
    tokens = sum(len(r["prompt_ids"]) for r in rows)
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * model.lm_head.weight.element_size()
    per_token = kv + cfg.num_hidden_layers * cfg.num_attention_heads * 4  # K and V, and the target (float32)
    runs = 15 * cfg.num_hidden_layers * cfg.num_key_value_heads * 4 + cfg.hidden_size * 4
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    one, every = per_token * S, per_token * tokens
    peak = weights + 0.3 * 2**30 + 8 * one + runs * (tokens if keep_runs else S) + (every if out is None else 0)
    where = ("all kept in memory" if out is None else
             f"kept in {Path(out) / 'heldout'} and read back one at a time")
    return (f"held-out ground truth: {len(rows)} prompts, up to {S} tokens: {one / 2**20:.0f} MB a prompt (its KV "
            f"cache and target), {every / 2**20:.0f} MB in all, {where}; expected peak memory {peak / 2**30:.1f} GB")


def group_mean(scores, n_kv_heads):
    """Per-query-head scores (B, H, S) -> per-KV-head (B, H_kv, S), as eviction uses them."""
    return {l: s.view(s.shape[0], n_kv_heads, -1, s.shape[-1]).mean(2) for l, s in scores.items()}


def row_scorer(row, C, module, window, response=None):
    """The Scorer of a ROWS entry at budget C ("adapter" budgets: the adapter's, given to another method);
    lookahead in its two-pass form (the module docstring says why)."""
    method, rule, budgets = row
    recommended = adapter_selection(module)  # what the adapter's .json recommends
    if method == "lookahead":  # None: as the adapter's .json recommends (the rows' "lookahead": as shipped)
        rule, budgets = (rule or recommended[0]), (budgets or "adapter")
    budgets = {"uniform": uniform_budgets, "adapter": recommended[1], None: None}[budgets]
    rule = parse_rule(rule) if isinstance(rule, str) else rule
    eviction = EvictConfig(method, C, window=window, rule=rule, budgets=budgets,
                           options=dict(one_pass=False) if method == "lookahead" else {})
    return make_scorer(eviction, module=module, response=response)


def scored_runs(model, module, item, rows, C, window):
    """{row: run}: the item's prompt prefilled ONCE, watched by every row's scorer (prefill_and_score with a
    list of scorers), kept in the item for the next call (by row and selection rule: a span rule needs a
    prefill it watched); the rows of `module` (lookahead) are scored anew on every call, the module being
    what changes between calls (train.py's periodic check, compare()'s adapters). Each run's cache is the
    item's, set on every call: prompt_metrics lets it go after the prompt (an OnDisk item's is on disk)."""
    cache, gt, extra = item
    runs = extra.setdefault("runs", {})
    scorers = {row: row_scorer(rows[row], C, module, window, extra["response"]) for row in rows}
    keys = {row: (row, repr(s.rule)) for row, s in scorers.items()}
    todo = [row for row in rows if keys[row] not in runs]
    if todo:
        made = prefill_and_score(model, extra["prompt"], [scorers[row] for row in todo])
        for row, run in zip(todo, made):
            runs[keys[row]] = run
    for row in rows:  # its cache is the ground truth's (the same prefill): one copy is kept
        runs[keys[row]].cache = cache
    fresh = None  # the module's scores, made once: every lookahead row runs the same M rows on the same cache
    for row in rows:
        if rows[row][0] == "lookahead" and row not in todo:
            fresh = scorers[row].score(model, runs[keys[row]]) if fresh is None else fresh
            runs[keys[row]].scores = fresh
    return {row: runs[keys[row]] for row in rows}


def kept_by(model, module, row, run, C, window, response):
    """The slots a row keeps at budget C, by its scorer's own eviction step; every slot when S <= C."""
    S, L, Hkv = run.positions.shape[1], len(run.cache.k), run.cache.k[0].shape[1]
    if S <= C:
        return [torch.arange(S, device=run.positions.device).expand(1, Hkv, S)] * L
    return row_scorer(row, C, module, window, response).evict(run.scores, run)


@torch.no_grad()
def prompt_metrics(model, module, item, budgets, rows, answer_kl_rows, window):
    """One held-out prompt: KL(gt || pred) of the module ("kl") and, per row and C, recall@C and, for the rows in
    answer_kl_rows, the answer KL (keys recall_<row>@<C>, answer_kl_<row>@<C>). item: (cache, gt, extra)."""
    cache, gt, extra = item
    S = len(cache)
    next_pos = torch.tensor([S], device=cache.k[0].device)
    out = dict(kl=kl_loss(gt, lookahead_pass(model, module, cache, S, per_query_head=True)).item())
    true = group_mean(gt, model.config.num_key_value_heads)
    runs = scored_runs(model, module, item, rows, min(budgets), window)
    logp_full = forced_logprobs(model, cache, extra["response"], next_pos) if answer_kl_rows else None
    answer = {}
    for row in rows:
        for C in budgets:
            kept = kept_by(model, module, rows[row], runs[row], C, window, extra["response"])
            out[f"recall_{row}@{C}"] = recall_of_kept(kept, true)
            if row in answer_kl_rows:
                small = keep_slots(cache.copy(), kept)
                answer[f"answer_kl_{row}@{C}"] = answer_kl(logp_full,
                                                           forced_logprobs(model, small, extra["response"], next_pos))
    for run in runs.values():  # the runs (their scores) outlive the prompt's cache, which is not theirs to keep
        run.cache = None
    return {**out, **answer}


def heldout_metrics(model, module, heldout, budgets=(128,), rows=None, answer_kl_rows=(), window=32, done=None):
    """The mean over the held-out prompts of prompt_metrics: KL(gt || pred) of the module and, per row of `rows`
    (default ROWS) and C in budgets, recall@C (keys recall_<row>@<C>) and, for rows in answer_kl_rows, the answer
    KL (answer_kl_<row>@<C>). Items of `heldout` (a list, or an OnDisk) are (cache, gt, extra) from ground_truth.
    done: {prompt index: its values} of prompts already measured, which are not measured again (nor read from
    disk); each new prompt's values are put in it as soon as they are made (evaluate.py's --heldout log, for a
    run that resumes). Each prompt's runs stay in its extra for the next call (train_lab's periodic check: the
    baselines' prefills are made once)."""
    rows = ROWS if rows is None else rows
    done = {} if done is None else done
    for i in tqdm(range(len(heldout)), desc="held-out metrics", leave=False, disable=len(heldout) < 8):
        if i not in done:  # heldout[i]: an OnDisk item is read here, and let go before the next is read
            done[i] = prompt_metrics(model, module, heldout[i], budgets, rows, answer_kl_rows, window)
    return mean_values(done, len(heldout))


def mean_values(done, n):
    """{metric: mean} of prompts 0..n-1's values in done ({prompt index: {metric: value}})."""
    values = [done[i] for i in range(n)]
    if not values:
        return dict(kl=0.0)
    return {k: sum(v[k] for v in values) / len(values) for k in values[0]}


def heldout_line(name, r, C):
    """One line of the training log."""
    return (f"{name} heldout kl {r['kl']:.4f}  recall@{C} lookahead {r[f'recall_lookahead@{C}']:.3f} "
            f"(unpooled {r[f'recall_lookahead-unpooled@{C}']:.3f}) snapkv {r[f'recall_snapkv@{C}']:.3f} "
            f"h2o {r[f'recall_h2o@{C}']:.3f} streaming {r[f'recall_streaming@{C}']:.3f}")


def compared_rows(modules):
    """The rows compare() measures: ROWS, the paper's form and, when a module has per-layer budgets, the rows
    that tell what the budgets buy (LAYERED_ROWS)."""
    layered = any(m.info.get("layer_weights") for m in modules)
    return {**ROWS, **PAPER_ROWS, **(LAYERED_ROWS if layered else {})}


def compare_plan(adapters, rows, answer_kl):
    """[(label, module, the rows whose answer KL it measures)] for compare(): the first module (the untrained
    one) also measures the prompt-only baselines; each module its own lookahead rows and, when it has per-layer
    budgets, SnapKV given them (snapkv-layered: the untrained module has none, so measured with it the row
    would be plain SnapKV under another name)."""
    plan = []
    for i, (label, m) in enumerate(adapters):
        own = ("lookahead", "lookahead-unpooled") if (m.info.get("rule") or "none") != "none" else ("lookahead-unpooled",)
        own += tuple(PAPER_ROWS) + tuple(r for r in LAYERED_ROWS if r in rows and
                                         (r.startswith("lookahead") or m.info.get("layer_weights")))
        base = tuple(r for r in rows if not r.startswith("lookahead") and r not in LAYERED_ROWS) if i == 0 else ()
        plan.append((label, m, (base + own) if answer_kl else ()))
    return plan


def compare(model, adapters, heldout, budgets, answer_kl=False, window=32, done=None):
    """Held-out metrics of each (label, module) in `adapters` (the first: the untrained module) on one
    ground truth: the prompt-only baselines' answer KL once (with the first), each adapter's rows always
    (compare_plan). Prompt by prompt: every module is measured on a prompt (its baselines' prefills made once,
    in its runs), then the prompt's runs are let go, so one prompt's runs are in memory at a time. (A module by
    module loop kept every prompt's runs, ~7.5 KB a prompt token, between the passes, and the process grew
    ~90 MiB a prompt, to 6.3 GiB at ~4K x 48: the runs ~16-23 MiB of it, the rest freed heap that glibc kept
    around them (malloc_trim gave it back); RESULTS 5.1.) done: {label: heldout_metrics' done} of a run that
    resumes. Returns [(label, module, metrics)] for tables()."""
    rows = compared_rows([m for _, m in adapters])
    done = {label: {} for label, _ in adapters} if done is None else done
    plan = compare_plan(adapters, rows, answer_kl)
    for i in tqdm(range(len(heldout)), desc="held-out metrics", leave=False, disable=len(heldout) < 8):
        todo = [(label, m, kl_rows) for label, m, kl_rows in plan if i not in done[label]]
        if not todo:  # measured by a run this one resumes: not read from disk
            continue
        item = heldout[i]  # an OnDisk item is read here, and let go before the next is read
        for label, m, kl_rows in todo:
            done[label][i] = prompt_metrics(model, m, item, budgets, rows, kl_rows, window)
        item[2].pop("runs", None)  # no module reads this prompt again
        item = None
    return [(label, m, mean_values(done[label], len(heldout))) for label, m, _ in plan]


def tables(table, budgets, n):
    """Markdown tables of compare()'s rows: the prompt-only baselines once, then each adapter as it ships
    and unpooled; per metric, the value and the share of the SnapKV-to-oracle gap closed."""
    first, lines = table[0][2], []
    for metric, title, fmt, lower in [("answer_kl", "answer KL", ".4f", True), ("recall", "recall@C", ".3f", False)]:
        if f"{metric}_oracle@{budgets[0]}" not in first:
            continue

        def cells(r, row):
            out = []
            for C in budgets:
                v = r.get(f"{metric}_{row}@{C}")
                gap = None if v is None else gap_closed(v, first[f"{metric}_snapkv@{C}"], first[f"{metric}_oracle@{C}"],
                                                        lower_is_better=lower)
                out.append("" if v is None else f"{v:{fmt}}" + ("" if gap is None else f" ({gap:.0%})"))
            return " | ".join(out)

        lines += [f"\n| {title} ({n} held-out; gap closed) | " + " | ".join(f"C={C}" for C in budgets)
                  + " | KL(gt ‖ pred) |", "|---" * (len(budgets) + 2) + "|"]
        for row in BASELINES:
            lines.append(f"| {row} | {cells(first, row)} | |")
        for label, m, r in table:
            # every row says what it selects by and how many slots each layer gets
            own = "its per-layer budgets" if m.info.get("layer_weights") else "C in every layer"
            if m.info.get("layer_weights") and f"{metric}_snapkv-layered@{budgets[0]}" in r:
                lines.append(f"| snapkv, {label}'s per-layer budgets | {cells(r, 'snapkv-layered')} | |")
            # as shipped unless another row is it: no rule is the paper's max:7, "none" is the unpooled row
            if (m.info.get("rule") or "none") != "none":
                lines.append(f"| {label}, as shipped ({m.info['rule']}, {own}) | {cells(r, 'lookahead')} "
                             f"| {r['kl']:.4f} |")
            if f"{metric}_lookahead-paper@{budgets[0]}" in r:
                lines.append(f"| {label}, the paper's form (max:7, C in every layer) | {cells(r, 'lookahead-paper')} "
                             f"| {r['kl']:.4f} |")
            lines.append(f"| {label}, unpooled top C ({own}; our variant) | {cells(r, 'lookahead-unpooled')} "
                         f"| {r['kl']:.4f} |")
            if f"{metric}_lookahead-uniform@{budgets[0]}" in r:
                lines.append(f"| {label}, {m.info.get('rule') or 'max:7'}, C in every layer | "
                             f"{cells(r, 'lookahead-uniform')} | {r['kl']:.4f} |")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# evaluate.py's results (one dict per prompt, method and budget): means, tables and plots, shared with
# research/analysis/plot_eval.py, which merges several runs


def mean_of(results, metric, method, budget):
    """The mean of `metric` over the results of (method, budget) that have it, or None."""
    v = [r[metric] for r in results if r["method"] == method and r["budget"] == budget and r.get(metric) is not None]
    return sum(v) / len(v) if v else None


def task_means(results, method, budget, metric="accuracy"):
    """{task: the mean of `metric` over the task's results of (method, budget)}, tasks in the order they first
    appear; a task with no value (no expected answers) maps to None. RULER's score is the mean of these."""
    tasks = list(dict.fromkeys(r["task"] for r in results))
    return {t: mean_of([r for r in results if r["task"] == t], metric, method, budget) for t in tasks}


def results_table(results, metric, methods, budgets, fmt="{:.3f}"):
    """Markdown: a row per method, a column per budget, the mean of `metric` over samples ("-": none)."""
    lines = ["| method | " + " | ".join(f"C={b}" for b in budgets) + " |", "|---" * (len(budgets) + 1) + "|"]
    for m in methods:
        cells = [mean_of(results, metric, m, b) for b in budgets]
        lines.append(f"| {m} | " + " | ".join("-" if c is None else fmt.format(c) for c in cells) + " |")
    return "\n".join(lines)


def plot_results(results, methods, budgets, path, metrics=("recall", "answer_kl", "accuracy"), sizes=False):
    """Recall, answer KL (log axis) and accuracy (or `metrics`) against the budget, one line per method,
    saved to `path`; sizes: first a panel of the cache size over the generated tokens (evaluate.py --mode
    decode). Needs matplotlib (imported here, so that nothing else does)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no window
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics) + sizes, figsize=(5 * (len(metrics) + sizes), 4), squeeze=False)
    axes = list(axes[0])
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
    # atomic, mode 0644, a full disk one line (files.write_with); the format by path's suffix, not the temporary's
    files.write_with(path, lambda tmp: fig.savefig(tmp, dpi=150, format=Path(path).suffix[1:].lower()))
    plt.close(fig)


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
