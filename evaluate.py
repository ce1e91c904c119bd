"""
Evaluate KV-eviction methods against FullKV on long prompts: answer accuracy, fidelity to
FullKV's own answer, attention recall@C against the oracle, and the time scoring takes.

    python evaluate.py --methods full,streaming,snapkv,pyramidkv,h2o,laq,lookahead,oracle \\
        --budgets 64,128,256 --lengths 1024,2048 --per-task 2 --untrained --plot runs/eval/plot.png
    python evaluate.py --tasks my.jsonl --methods snapkv,lookahead --budgets 128   # your own prompts
    python evaluate.py --limit 3 ...        # the first 3 prompts only, for a quick look

Tasks: --tasks (JSON lines {"id", "task", "prompt", "answers": [...]}; empty answers: only
fidelity and recall are scored) or data.make_eval_suite (RULER-style, "eval" split texts).
Per prompt, FullKV runs once: a prefill and a greedy answer. That answer is the "full" row, the
reference for fidelity and, run on top of the prompt cache, the true future attention that
recall is measured against (lookaheadkv.oracle_scores) and the oracle's source. Then, for each
(method, budget): compress() (its own prefill), a greedy answer on the compact cache, metrics.
Recall is measured on what eviction really kept (compress's stats["kept"]: the slots it
gathered per layer), not on a method's scores, so it needs no knowledge of how one scores.
The oracle keeps the exact top-C of the true scores (no pooling): its recall is the ceiling.
--untrained adds "lookahead-untrained", a module with the adapter's M / rank / targets and a
fresh init (seeded): the trained adapter's gain over it is what training bought.

Prints a tqdm bar, then a markdown table per metric (accuracy, fidelity, exact, recall,
prefill_ms, score_ms). E.g. SmolLM2-135M-Instruct, the 6 suite tasks at ~1050 tokens, 2 busy
CPU cores: 30 min, ~25 s per (prompt, method, budget), since every compress() prefills again:

    $ python evaluate.py --methods full,streaming,snapkv,h2o,oracle --untrained \\
          --budgets 64,128 --lengths 1024 --per-task 1 --max-new-tokens 32 --out runs/eval-check
    ...
    ### recall: attention recall@C against the true future attention (6 samples)

    | method | C=64 | C=128 |
    |---|---|---|
    | full | 1.000 | 1.000 |
    | streaming | 0.635 | 0.673 |
    | snapkv | 0.735 | 0.824 |
    | h2o | 0.720 | 0.800 |
    | oracle | 0.839 | 0.891 |
    | lookahead-untrained | 0.742 | 0.815 |
    ...

and writes OUT/results.md (these tables, plus accuracy per task) and OUT/results.json (one
entry per (sample, method, budget)). Rerunning the same command skips every entry already in
results.json, so a killed run continues where it stopped; new methods or budgets are added.
"""

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

import data
from generate import resolve_model
from lookaheadkv import (METHODS, EvictConfig, LookaheadModule, compress, decode, default_adapter_path, make_scorer,
                         oracle_scores, recall_of_kept)
from model import Tokenizer, load_model

UNTRAINED = "lookahead-untrained"
METRICS = {  # name -> (title, format)
    "accuracy": ("accuracy: share of the expected answers found in the output (RULER string match)", "{:.3f}"),
    "fidelity": ("fidelity: share of FullKV's greedy tokens reproduced before the first divergence", "{:.3f}"),
    "exact": ("exact: rate of answers identical to FullKV's", "{:.3f}"),
    "recall": ("recall: attention recall@C against the true future attention", "{:.3f}"),
    # hook-based scorers (snapkv, h2o, laq, one-pass lookahead) do part of their work inside the
    # prefill, so compare prefill_ms + score_ms with full's prefill (bench.py measures this properly)
    "prefill_ms": ("prefill_ms: the prefill, with whatever scoring runs inside it, ms", "{:.0f}"),
    "score_ms": ("score_ms: scoring + eviction after the prefill, ms (oracle: + the full-cache answer it needs)",
                 "{:.1f}"),
}

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


def table(results, metric, methods, budgets):
    """Markdown: a row per method, a column per budget, the mean of `metric` over samples."""
    fmt = METRICS[metric][1]
    lines = ["| method | " + " | ".join(f"C={b}" for b in budgets) + " |", "|---" * (len(budgets) + 1) + "|"]
    for m in methods:
        cells = [mean_of(results, metric, m, b) for b in budgets]
        lines.append(f"| {m} | " + " | ".join("-" if c is None else fmt.format(c) for c in cells) + " |")
    return "\n".join(lines)


def report(results, methods, budgets, per_task=False):
    n = len({r["id"] for r in results})
    parts = [f"### {METRICS[m][0]} ({n} samples)\n\n{table(results, m, methods, budgets)}\n" for m in METRICS]
    for task in sorted({r["task"] for r in results}) if per_task else []:
        rows = [r for r in results if r["task"] == task]
        parts.append(f"### accuracy, task {task} ({len({r['id'] for r in rows})} samples)\n\n"
                     f"{table(rows, 'accuracy', methods, budgets)}\n")
    return "\n".join(parts)


def plot(results, methods, budgets, path):
    plt = need_matplotlib()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric in zip(axes, ("accuracy", "recall")):
        for m in methods:
            ys = [mean_of(results, metric, m, b) for b in budgets]
            ax.plot(budgets, [float("nan") if y is None else y for y in ys], marker="o", label=m,
                    linestyle="--" if m in ("full", "oracle") else "-")  # the references dashed
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("budget C (KV slots per layer and KV head)")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=len(methods), fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))  # room for the legend below the plots
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)


def need_matplotlib():
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only, no window
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install matplotlib (or pip install '.[plot]')")
    return plt

# -----------------------------------------------------------------------------
# One prompt, every (method, budget)


def greedy(model, cache, logits, pos, max_new_tokens, stop_ids):
    """Greedy answer ids; the stop token is kept, as in train.py: the answer's end is part of
    its future (and it makes the oracle's future non-empty even for an empty answer)."""
    out = []
    for t in decode(model, cache, logits, pos, max_new_tokens, stop_ids):
        out.append(t[0].item())
    return out


def eviction_config(method, budget, args):
    """The EvictConfig of a row: lookahead-untrained runs as lookahead; pooling None = the method's own
    (lookaheadkv's scorers: avg 5 for attention scores, the adapter's for lookahead, none for the oracle)."""
    name = "lookahead" if method == UNTRAINED else method
    return EvictConfig(name, budget, window=args.window, pool=args.pool, kernel=args.kernel)


@torch.no_grad()
def run_sample(model, tok, row, ids, todo, modules, args):
    """One result dict per (method, budget) in todo, for one prompt (ids: its token ids)."""
    dev = model.lm_head.weight.device
    ids = torch.tensor([ids], device=dev)  # (1, S)
    t0 = time.perf_counter()
    cache, logits, pos, st = compress(model, ids, EvictConfig("full"))
    full_prefill_ms = st["prefill_ms"]
    prompt_cache = cache.copy()  # decoding appends to `cache`; the oracle's pass needs the prompt's alone
    ref = greedy(model, cache, logits, pos, args.max_new_tokens, tok.stop_ids)
    full_ms = (time.perf_counter() - t0) * 1e3
    response = torch.tensor([ref], device=dev)  # (1, R)
    true = oracle_scores(model, prompt_cache, response, pos)  # {layer: (1, H_kv, S)}, the future's attention
    results = []
    for method, budget in todo:
        if method == "full":
            out, recall, score_ms, prefill_ms = ref, 1.0, 0.0, full_prefill_ms
        else:
            module = modules.get(method)  # lookahead, trained or not (scored with its adapter's pooling)
            cache, logits, pos, st = compress(model, ids, eviction_config(method, budget, args), module=module,
                                              response=response)
            recall = 1.0 if st["kept"] is None else recall_of_kept(st["kept"], true)  # None: S <= C, all kept
            out = greedy(model, cache, logits, pos, args.max_new_tokens, tok.stop_ids)
            score_ms = st["score_ms"] + (full_ms if method == "oracle" else 0.0)
            prefill_ms = st["prefill_ms"]
        prefix, exact = fidelity(out, ref)
        text = tok.decode([i for i in out if i not in tok.stop_ids])
        results.append(dict(id=row["id"], task=row["task"], method=method, budget=budget, prompt_tokens=ids.shape[1],
                            accuracy=data.is_correct(text, row["answers"]) if row["answers"] else None,
                            fidelity=prefix, exact=exact, recall=recall, score_ms=round(score_ms, 2),
                            prefill_ms=round(prefill_ms, 2), output=text))
    return results

# -----------------------------------------------------------------------------
# Command line


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--methods", default="full,streaming,snapkv,pyramidkv,h2o,laq,lookahead,oracle",
      help=f"comma-separated, from {', '.join(METHODS)}, {UNTRAINED} (full always runs: it is the reference)")
    a("--budgets", default="64,128,256", help="comma-separated budgets C (KV slots kept per layer and KV head)")
    a("--tasks", default=None, help='JSON lines {"id", "task", "prompt", "answers"} (default: the built-in suite)')
    a("--lengths", default="1024,2048", help="built-in suite: prompt lengths in tokens")
    a("--per-task", type=int, default=2, help="built-in suite: prompts per (task, length)")
    a("--limit", type=int, default=None, help="evaluate only the first N prompts")
    a("--max-new-tokens", type=int, default=64, help="length cap of every answer")
    a("--out", default="runs/eval", help="folder for results.json and results.md")
    a("--plot", default=None, help="save accuracy and recall against budget to this image (needs matplotlib)")
    a("--adapter", default=None, help="lookahead adapter .safetensors (default: the one shipped for the model)")
    a("--untrained", action="store_true", help=f"add {UNTRAINED}: same M/rank/targets, fresh seeded init, LoRA B = 0")
    a("--window", type=int, default=32, help="snapkv/pyramidkv/h2o/laq: last prompt tokens always kept")
    a("--pool", default=None, choices=["avg", "max", "none"],
      help="score pooling for every method (default: each method's own: avg for attention scores, the adapter's "
      "for lookahead, none for the oracle)")
    a("--kernel", type=int, default=None, help="pooling width, odd (default: each method's own: 5, the adapter's)")
    a("--chat", action=argparse.BooleanOptionalAction, default=None,
      help="wrap prompts in the chat template (default: when the tokenizer has one)")
    a("--model", default=None, help="an HF folder (default: weights/SmolLM2-135M-Instruct, prepared if missing)")
    a("--device", default="cuda" if torch.cuda.is_available() else "cpu")
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
    if "lookahead" in methods:
        path = Path(args.adapter) if args.adapter else default_adapter_path(cfg)
        if not path.exists():
            raise ValueError(f"no lookahead adapter at {path}: train one with python train.py --model {folder} "
                             f"--adapter-out {path}, pass --adapter, or drop lookahead from --methods")
        modules["lookahead"] = LookaheadModule.load(path, cfg, dev)
    if UNTRAINED in methods:
        like = modules.get("lookahead")
        kw = dict(n_tokens=like.n_tokens, rank=like.rank, alpha=like.alpha, targets=like.targets, pool=like.pool,
                  kernel=like.kernel) if like else {}
        torch.manual_seed(args.seed)  # the same draw on every run: P ~ N(0, std of the token embeddings)
        std = model.model.embed_tokens.weight.float().std().item()
        modules[UNTRAINED] = LookaheadModule(cfg, embed_std=std, **kw)
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
    methods = parse_list(args.methods, "--methods")
    bad = [m for m in methods if m not in METHODS + (UNTRAINED,)]
    if bad:
        raise ValueError(f"unknown method(s) {', '.join(bad)}; choose from {', '.join(METHODS + (UNTRAINED,))}")
    methods = list(dict.fromkeys(["full"] + methods + ([UNTRAINED] if args.untrained else [])))  # full first
    budgets = parse_list(args.budgets, "--budgets", int)
    if not budgets or min(budgets) <= 0:
        raise ValueError(f"--budgets {args.budgets!r}: every budget must be a positive number of KV slots")
    for m in methods:  # each method's own checks (budget vs its protected tokens, pooling width), before any work
        if m not in ("lookahead", UNTRAINED, "oracle"):  # those need their adapter / answer: checked when they run
            make_scorer(eviction_config(m, min(budgets), args))
    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be at least 1")
    if args.plot:
        need_matplotlib()  # fail now, not after the whole run

    args.model = str(resolve_model(args.model))  # weights/SmolLM2-135M-Instruct by default
    model = load_model(args.model, args.device)
    tok = Tokenizer(args.model, model.config)
    modules = load_modules(args, model, methods, args.model)
    chat = args.chat if args.chat is not None else tok.format is not None

    if args.tasks:
        rows = data.read_jsonl(args.tasks, required=data.EVAL_KEYS)
    else:
        lengths = parse_list(args.lengths, "--lengths", int)
        rows = data.make_eval_suite(tok, lengths, args.per_task, args.seed)
    rows = rows[:args.limit] if args.limit else rows
    if len({r["id"] for r in rows}) < len(rows):
        raise ValueError(f"{args.tasks}: ids must be unique (they key the results for resuming)")
    prompts = [tok.encode(tok.chat(r["prompt"]) if chat else r["prompt"]) for r in rows]
    ctx = model.config.max_context
    for r, ids in zip(rows, prompts):
        if len(ids) + args.max_new_tokens > ctx:
            raise ValueError(f"prompt {r['id']} is {len(ids)} tokens; with --max-new-tokens {args.max_new_tokens} "
                             f"it exceeds the model's context of {ctx}: shorten it or lower --max-new-tokens")

    # resume: entries already in results.json are kept, if they were made with the same settings
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = dict(model=model.config.name, fingerprint=model.config.fingerprint(), max_new_tokens=args.max_new_tokens,
                    window=args.window, pool=args.pool, kernel=args.kernel, chat=chat, seed=args.seed)
    if "lookahead" in modules:
        adapter = Path(args.adapter or default_adapter_path(model.config)).read_bytes()
        settings["adapter"] = hashlib.sha256(adapter).hexdigest()[:16]  # a retrained adapter needs a new --out
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
    done = {(r["id"], r["method"], r["budget"]) for r in saved["results"]}
    work = [(row, ids, [(m, b) for m in methods for b in budgets if (row["id"], m, b) not in done])
            for row, ids in zip(rows, prompts)]
    work = [w for w in work if w[2]]

    bar = tqdm(total=sum(len(todo) for _, _, todo in work), desc="evaluating", unit="run")
    for row, ids, todo in work:
        bar.set_postfix_str(f"{row['id']} ({len(ids)} tokens)")
        saved["results"] += run_sample(model, tok, row, ids, todo, modules, args)
        save_json(saved, path)  # after every prompt: a killed run loses one prompt at most
        bar.update(len(todo))
    bar.close()

    wanted = {(r["id"], m, b) for r in rows for m in methods for b in budgets}
    results = [r for r in saved["results"] if (r["id"], r["method"], r["budget"]) in wanted]
    print(report(results, methods, budgets))
    (out / "results.md").write_text(report(results, methods, budgets, per_task=True))
    if args.plot:
        plot(results, methods, budgets, args.plot)
    print(f"wrote {out / 'results.md'} and {path}" + (f", {args.plot}" if args.plot else "")
          + f" in {time.perf_counter() - t_start:.0f} s ({len(work)} of {len(rows)} prompts had work left)")
    return results


if __name__ == "__main__":
    main()
