"""
Draw one recall / answer-KL / accuracy plot from several evaluate.py runs over the same prompts,
e.g. the baselines of one run next to the lookahead rows of a run with another selection rule:

    python research/analysis/plot_eval.py --out research/figures/eval-plot.png \
        "runs/eval2k:full,snapkv,pyramidkv,h2o,laq,streaming,oracle,lookahead=lookahead unpooled" \
        "runs/eval2k-avg:lookahead=lookahead (avg:5),lookahead-untrained=untrained (avg:5)"

Each argument is DIR (every method of DIR/results.json) or DIR:METHOD[=LABEL],... (those methods,
renamed). Rows are averaged over the prompts each run holds, as evaluate.py's tables are
(harness.mean_of). --tables also prints the merged rows as markdown tables (answer KL, recall,
fidelity, accuracy); --out is then optional.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from research.harness import plot_results, results_table  # noqa: E402
from support import cli  # noqa: E402

TABLES = {"answer_kl": ("answer KL: mean KL(FullKV || method) along FullKV's answer, nats", "{:.4f}"),
          "recall": ("recall@C against the true future attention", "{:.3f}"),
          "fidelity": ("fidelity: share of FullKV's greedy tokens reproduced", "{:.3f}"),
          "accuracy": ("accuracy: share of the expected answers found in the output", "{:.3f}")}


def read_run(folder):
    """The result rows of an evaluate.py --out folder (SystemExit with one line otherwise)."""
    path = Path(folder) / "results.json"
    if not path.is_file():
        sys.exit(f"error: no {path}: run evaluate.py --out {folder} first")
    try:
        rows = json.loads(path.read_text())["results"]
        assert isinstance(rows, list) and all(isinstance(r, dict) and {"method", "budget"} <= r.keys() for r in rows)
    except (ValueError, KeyError, TypeError, AssertionError):
        sys.exit(f"error: {path} is not an evaluate.py results file: pass the --out folder of an evaluate.py run")
    return rows


def main(argv=None):
    return cli.run(lambda: merge(argv))


def merge(argv):
    p = cli.Parser("research/analysis/plot_eval.py", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="DIR or DIR:METHOD[=LABEL],...")
    p.add_argument("--out", default=None, help="image to write")
    p.add_argument("--tables", action="store_true", help="print markdown tables of the merged rows")
    args = p.parse_args(argv)
    if not args.out and not args.tables:
        sys.exit("error: nothing to do: give --out IMAGE, --tables or both")
    if args.out:
        cli.output_file("--out", args.out, Path(args.out).suffix or ".png")
    results, methods, budgets = [], [], set()
    for spec in args.runs:
        folder, _, picks = spec.partition(":")
        rows = read_run(folder)
        names = dict(x.partition("=")[::2] for x in picks.split(",")) if picks else {r["method"]: "" for r in rows}
        for r in rows:
            if r["method"] in names:
                label = names[r["method"]] or r["method"]
                results.append(dict(r, method=label))
                budgets.add(r["budget"])
                methods += [label] if label not in methods else []
    n = len({r["id"] for r in results})
    for metric, (title, fmt) in TABLES.items() if args.tables else ():
        if any(r.get(metric) is not None for r in results):
            print(f"### {title} ({n} samples)\n\n{results_table(results, metric, methods, sorted(budgets), fmt)}\n")
    if args.out:
        plot_results(results, methods, sorted(budgets), args.out)
        print(f"wrote {args.out}: {', '.join(methods)}")


if __name__ == "__main__":
    main()
