"""
Two adapters of one held-out run, prompt by prompt: is the difference between them more than its prompts can
tell apart? It reads what `evaluate.py --heldout ... --answer-kl --out DIR` kept (DIR/heldout.json and
DIR/heldout-prompts.jsonl, each prompt's values per module); it runs no model:

    python research/analysis/paired_heldout.py --heldout runs/curve/heldout --a runs/curve/n2500-lw.safetensors \
        --b runs/curve/n5040-lw.safetensors

Per budget C: each adapter's mean answer KL and the share of the SnapKV-to-oracle gap it closes (that run's
SnapKV and oracle, on the same prompts), the difference b - a in gap closed and in answer KL, each with a 95%
paired bootstrap interval (the prompts drawn with replacement, the same draw for a, b, SnapKV and the oracle;
10,000 draws, seed 0), and on how many prompts b's answer KL is the lower.

--a and --b may each name several adapters, comma-separated (the seeds of one recipe): per prompt, the mean
of their answer KL. --row picks the selection compared: lookahead (as each adapter's .json says, the default),
lookahead-paper (the paper's form: max-pool 7, C in every layer, measured for every adapter):

    python research/analysis/paired_heldout.py --heldout runs/length/judge-2k --row lookahead-paper \
        --a runs/length/train-1k-s0/adapter.safetensors,runs/length/train-1k-s1/adapter.safetensors \
        --b runs/length/train-2k-s0/adapter.safetensors,runs/length/train-2k-s1/adapter.safetensors

or lookahead-unpooled (the top C of the unpooled scores). --b-row gives b a selection of its own: the same
adapters under two selections, paired (the paper's max-pool 7 against no pooling):

    python research/analysis/paired_heldout.py --heldout runs/length/judge-4k --a A --b A \
        --row lookahead-paper --b-row lookahead-unpooled

--a may also name a baseline (snapkv, pyramidkv, h2o, streaming): its own row, which the run measured with its
first module, against b's adapters on the same prompts (`--a h2o --b A --row lookahead-paper`).

The prompt log names each module by a digest of its weights and settings, which heldout.json does not hold:
each heldout.json row is matched to the one digest whose prompts' means give that row's answer KL at every C.
"""

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from support import cli  # noqa: E402
from support.metrics import gap_closed  # noqa: E402

DRAWS, SEED = 10_000, 0
BASELINES = ("snapkv", "pyramidkv", "h2o", "streaming")  # rows of the run's first module, given by name


def read_run(folder):
    """(heldout.json as saved, {digest: {prompt: values}} from the prompt log), or SystemExit with one line."""
    folder = Path(folder)
    saved, log = folder / "heldout.json", folder / "heldout-prompts.jsonl"
    for path in (saved, log):
        if not path.is_file():
            sys.exit(f"error: no {path}: pass the --out folder of an evaluate.py --heldout --answer-kl run")
    run = json.loads(saved.read_text())
    if not run.get("answer_kl"):
        sys.exit(f"error: {saved}: that run measured no answer KL: rerun it with --answer-kl")
    by_key = {}
    for line in log.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
            by_key.setdefault(entry["key"], {})[entry["row"]] = entry["values"]
        except (ValueError, KeyError, TypeError):  # a line cut short by a kill
            continue
    return run, by_key


def prompts_of(by_key, metrics, name, budgets, what):
    """{prompt: values} of the one module whose prompts' mean of `name`@C is metrics' at every C."""
    def same(a, b):
        return abs(a - b) <= 1e-9 + 1e-7 * abs(b)

    found = [p for p in by_key.values()
             if all(all(f"{name}@{C}" in v for v in p.values()) and
                    same(sum(v[f"{name}@{C}"] for v in p.values()) / len(p), metrics[f"{name}@{C}"]) for C in budgets)]
    if len(found) != 1:
        sys.exit(f"error: {what}: {len(found)} modules of the prompt log match its heldout.json row (need one): "
                 "was the log of this folder written by the run that wrote its heldout.json?")
    return found[0]


def row_of(run, adapter):
    rows = ([r for r in run["rows"][1:] if r["adapter"] == adapter]  # its path as given, else its file name
            or [r for r in run["rows"][1:] if Path(r["adapter"]).name == Path(adapter).name])
    if len(rows) != 1:
        names = ", ".join(r["adapter"] for r in run["rows"][1:])
        sys.exit(f"error: {adapter}: not one of this run's adapters ({names})")
    return rows[0]


def gap(values, prompts, C, method):
    """Gap closed of the mean over `prompts` (a list; repeats count) of `method`'s answer KL."""
    mean = lambda key, src: sum(src[p][f"answer_kl_{key}@{C}"] for p in prompts) / len(prompts)  # noqa: E731
    return gap_closed(mean("lookahead", values[method]), mean("snapkv", values["base"]), mean("oracle", values["base"]),
                      lower_is_better=True)


def averaged(run, by_key, adapters, row, budgets, base):
    """{prompt: {answer_kl_lookahead@C: the mean over `adapters` (one, or a recipe's seeds) of their `row`}};
    a baseline's name (BASELINES) stands for its own row in `base`, the prompts of the run's first module."""
    def prompts(a):  # {prompt: values} of the module whose row `a` is, and the key of a's answer KL there
        if a in BASELINES:
            return base, a
        return prompts_of(by_key, row_of(run, a)["metrics"], f"answer_kl_{row}", budgets, a), row

    each = [prompts(a) for a in adapters]
    common = set.intersection(*(set(e) for e, _ in each))
    return {p: {f"answer_kl_lookahead@{C}": sum(e[p][f"answer_kl_{r}@{C}"] for e, r in each) / len(each)
                for C in budgets} for p in common}


def interval(diffs):
    diffs = sorted(diffs)
    return diffs[int(0.025 * len(diffs))], diffs[int(0.975 * len(diffs)) - 1]


def compare(run, by_key, a, b, row="lookahead", b_row=None):
    """[(C, a's mean KL, a's gap, b's mean KL, b's gap, (low, high) of b - a in gap closed, prompts where b is
    lower, n, (low, high) of b - a in answer KL)]; a, b: lists of adapters (each averaged per prompt), a's
    selection `row`, b's `b_row` (default: the same; another: two selections of the same adapters)."""
    budgets = run["budgets"]
    base = prompts_of(by_key, run["rows"][0]["metrics"], "answer_kl_snapkv", budgets, "the baselines")
    values = dict(base=base, a=averaged(run, by_key, a, row, budgets, base),
                  b=averaged(run, by_key, b, b_row or row, budgets, base))
    prompts = sorted(set(values["base"]) & set(values["a"]) & set(values["b"]))
    rng = random.Random(SEED)
    out = []
    for C in budgets:
        kl = lambda m, ps: sum(values[m][p][f"answer_kl_lookahead@{C}"] for p in ps) / len(ps)  # noqa: E731
        gaps, kls = [], []
        for _ in range(DRAWS):
            draw = rng.choices(prompts, k=len(prompts))
            gaps.append(gap(values, draw, C, "b") - gap(values, draw, C, "a"))
            kls.append(kl("b", draw) - kl("a", draw))
        lower = sum(values["b"][p][f"answer_kl_lookahead@{C}"] < values["a"][p][f"answer_kl_lookahead@{C}"]
                    for p in prompts)
        out.append((C, kl("a", prompts), gap(values, prompts, C, "a"), kl("b", prompts), gap(values, prompts, C, "b"),
                    interval(gaps), lower, len(prompts), interval(kls)))
    return out


def main(argv=None):
    return cli.run(lambda: report(argv))


def report(argv):
    p = cli.Parser("research/analysis/paired_heldout.py", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heldout", required=True, help="the --out folder of an evaluate.py --heldout --answer-kl run")
    p.add_argument("--a", required=True, help="adapters of that run (their paths as given to --adapters), "
                   f"comma-separated: averaged per prompt; or a baseline's row: {', '.join(BASELINES)}")
    p.add_argument("--b", required=True, help="others of that run, the same way: the differences are b - a")
    selections = ["lookahead", "lookahead-paper", "lookahead-unpooled"]
    p.add_argument("--row", default="lookahead", choices=selections, help="lookahead: as each adapter's .json selects; "
                   "lookahead-paper: the paper's form; lookahead-unpooled: the top C of the unpooled scores")
    p.add_argument("--b-row", default=None, choices=selections, help="--b's selection, if not --row's (--a and --b may "
                   "then name the same adapters: one selection against another, paired)")
    args = p.parse_args(argv)
    a, b = ([x.strip() for x in v.split(",") if x.strip()] for v in (args.a, args.b))
    if not a or not b:
        raise ValueError(f"--{'a' if not a else 'b'} names no adapter")
    run, by_key = read_run(args.heldout)
    rows = compare(run, by_key, a, b, args.row, args.b_row)
    name = lambda xs: Path(xs[0]).stem if len(xs) == 1 else f"mean of {len(xs)} ({Path(xs[0]).parent.name}, ...)"  # noqa: E731
    a, b = name(a), name(b)
    if args.b_row and args.b_row != args.row:
        a, b = f"{a}, {args.row}", f"{b}, {args.b_row}"
    print(f"| C | a = {a}: answer KL (gap closed) | b = {b} | b - a, answer KL [95% paired bootstrap] | "
          f"b - a, gap closed [95%] | prompts where b is lower |")
    print("|---|---|---|---|---|---|")
    for C, ka, ga, kb, gb, (lo, hi), lower, n, (klo, khi) in rows:
        print(f"| {C} | {ka:.3f} ({ga:.0%}) | {kb:.3f} ({gb:.0%}) | {kb - ka:+.3f} [{klo:+.3f}, {khi:+.3f}] | "
              f"{gb - ga:+.1%} [{lo:+.1%}, {hi:+.1%}] | {lower} of {n} |")
    return rows


if __name__ == "__main__":
    main()
