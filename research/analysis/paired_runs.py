"""
One method's rows in two evaluate.py runs over the same prompts (RULER, the 2K suite, task files), prompt by
prompt: is the difference more than the prompts can tell apart? It reads the runs' results.json; it runs no
model:

    python research/analysis/paired_runs.py --a runs/ruler4k:lookahead --b runs/curve/ruler4k-n5040:lookahead

Per budget C found in both: each side's mean of --metric (accuracy: RULER's score, or answer_kl) over the
prompts both hold, the difference b - a with a 95% paired bootstrap interval (the prompts drawn with
replacement, the same draw for both; 10,000 draws, seed 0), and on how many prompts b is better and worse.
With 5 prompts per task, as evaluate.py --suite ruler --per-task 5 makes them, the mean over prompts is
RULER's mean over tasks. Prompts are matched by id and must hold the same prompt (the same prompt_tokens).
"""

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from support import cli  # noqa: E402

DRAWS, SEED = 10_000, 0


def rows_of(spec, metric):
    """FOLDER:METHOD -> {budget: {prompt id: (value, prompt_tokens)}}, or SystemExit with one line."""
    folder, _, method = spec.rpartition(":")
    path = Path(folder) / "results.json"
    if not folder or not method:
        sys.exit(f"error: {spec}: write FOLDER:METHOD, e.g. runs/ruler4k:lookahead")
    if not path.is_file():
        sys.exit(f"error: no {path}: pass the --out folder of an evaluate.py run")
    out = {}
    for r in json.loads(path.read_text())["results"]:
        if r["method"] == method and r.get(metric) is not None:
            out.setdefault(r["budget"], {})[r["id"]] = (float(r[metric]), r.get("prompt_tokens"))
    if not out:
        methods = sorted({r["method"] for r in json.loads(path.read_text())["results"]})
        sys.exit(f"error: {path}: no {method!r} rows with {metric} (its methods: {', '.join(methods)})")
    return out


def compare(a, b, lower_is_better):
    """[(C, a's mean, b's mean, (low, high) of b - a, prompts where b is better, worse, n)] per shared budget."""
    rng, out = random.Random(SEED), []
    for C in sorted(set(a) & set(b)):
        ids = sorted(set(a[C]) & set(b[C]))
        if not ids:
            continue
        differ = [i for i in ids if a[C][i][1] != b[C][i][1]]
        if differ:
            sys.exit(f"error: prompt {differ[0]} has {a[C][differ[0]][1]} tokens in one run and {b[C][differ[0]][1]} "
                     "in the other: not the same prompts (another seed, tokenizer or length)")
        d = [b[C][i][0] - a[C][i][0] for i in ids]
        draws = sorted(sum(rng.choices(d, k=len(d))) / len(d) for _ in range(DRAWS))
        sign = -1 if lower_is_better else 1
        out.append((C, sum(a[C][i][0] for i in ids) / len(ids), sum(b[C][i][0] for i in ids) / len(ids),
                    (draws[int(0.025 * DRAWS)], draws[int(0.975 * DRAWS) - 1]),
                    sum(sign * x > 0 for x in d), sum(sign * x < 0 for x in d), len(ids)))
    return out


def main(argv=None):
    return cli.run(lambda: report(argv))


def report(argv):
    p = cli.Parser("research/analysis/paired_runs.py", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, help="FOLDER:METHOD, one evaluate.py --out folder and the row's method")
    p.add_argument("--b", required=True, help="FOLDER:METHOD, the other: the differences are b - a")
    p.add_argument("--metric", default="accuracy", help="accuracy (default; higher is better) or answer_kl, "
                   "fidelity, recall (a name ending in _kl: lower is better)")
    args = p.parse_args(argv)
    rows = compare(rows_of(args.a, args.metric), rows_of(args.b, args.metric), args.metric.endswith("_kl"))
    if not rows:
        sys.exit(f"error: {args.a} and {args.b} share no prompt at any budget")
    print(f"| C | a: {args.a} | b: {args.b} | b - a [95% paired bootstrap] | prompts where b is better / worse |")
    print("|---|---|---|---|---|")
    for C, ma, mb, (lo, hi), better, worse, n in rows:
        print(f"| {C} | {ma:.3f} | {mb:.3f} | {mb - ma:+.3f} [{lo:+.3f}, {hi:+.3f}] | {better} / {worse} of {n} |")
    return rows


if __name__ == "__main__":
    main()
