"""
The learning curve (issue 36): adapters trained by one recipe on more and more prompts, side by side, in
one table and one plot of each measure against the prompts the adapter saw. It reads what evaluate.py
kept; it runs no model:

    python -m research.evaluate --heldout runs/heldout5k --adapters runs/curve/n300-lw.safetensors,... \
        --budgets 64,128,256 --answer-kl --out runs/curve/heldout
    python -m research.evaluate --tasks runs/foreign/tasks.jsonl --adapters runs/curve/n300-lw.safetensors,... \
        --methods snapkv,oracle,lookahead --budgets 64,128,256 --max-new-tokens 48 --out runs/curve/foreign
    python -m research.evaluate --suite ruler --lengths 4096 --per-task 5 --adapters runs/curve/n300-lw.safetensors,... \
        --methods full,snapkv,lookahead --budgets 128 --out runs/curve/ruler4k
    python research/analysis/learning_curve.py --heldout runs/curve/heldout --foreign runs/curve/foreign \
        --ruler runs/curve/ruler4k --out research/figures/learning-curve.png

Each adapter is a row: the prompts it trained on (its .json's train_data.n_train), the held-out answer KL at
each budget with the share of the SnapKV-to-oracle gap closed, recall@C at the middle budget, and at C = 128
(--budget) the foreign-text answer KL (gap closed) and the RULER mean over tasks. Each adapter selects as its
.json says (the held-out row "lookahead": its rule, its budgets). --foreign and --ruler are optional.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from research.harness import mean_of, task_means  # noqa: E402
from support import cli  # noqa: E402
from support.metrics import gap_closed  # noqa: E402

ADAPTER_ROW = "lookahead@"  # evaluate.py's row of one adapter among several: lookahead@<file stem>


def read_json(path, what, keys):
    """A JSON object with `keys`, or SystemExit with one line saying what to run."""
    path = Path(path)
    if not path.is_file():
        sys.exit(f"error: no {path}: {what}")
    try:
        obj = json.loads(path.read_text())
        assert isinstance(obj, dict) and all(k in obj for k in keys)
    except (ValueError, AssertionError):
        sys.exit(f"error: {path} is not what evaluate.py writes ({', '.join(keys)}): {what}")
    return obj


def heldout_rows(folder):
    """The adapters of a --heldout --out folder: [(stem, prompts seen, metrics)], fewest prompts first, and the
    untrained row's metrics (the baselines and the oracle are measured with it)."""
    saved = read_json(Path(folder) / "heldout.json", "run evaluate.py --heldout DIR --adapters ... --answer-kl "
                      f"--out {folder}", ("budgets", "rows"))
    first, adapters = saved["rows"][0], saved["rows"][1:]
    if not adapters or "answer_kl_snapkv@" + str(saved["budgets"][0]) not in first["metrics"]:
        sys.exit(f"error: {folder}/heldout.json has no adapter rows or no answer KL: rerun with --adapters and --answer-kl")
    rows = [(Path(r["adapter"]).stem, r["info"].get("train_data", {}).get("n_train"), r["metrics"]) for r in adapters]
    return sorted(rows, key=lambda r: (r[1] is None, r[1] or 0)), first["metrics"], saved["budgets"]


def task_run(folder, what):
    """The result rows of an evaluate.py --out folder (None when not given)."""
    if folder is None:
        return None
    return read_json(Path(folder) / "results.json", what, ("results",))["results"]


def foreign_cell(results, stem, C):
    """Answer KL of the adapter's row at C and the gap it closes (its run must hold snapkv and oracle)."""
    v, snap, oracle = (mean_of(results, "answer_kl", m, C) for m in (ADAPTER_ROW + stem, "snapkv", "oracle"))
    if None in (v, snap, oracle):
        return None, None
    return v, gap_closed(v, snap, oracle, lower_is_better=True)


def ruler_cell(results, stem, C):
    """The RULER score at C: the mean over tasks of each task's mean (RULER's average)."""
    scored = [v for v in task_means(results, ADAPTER_ROW + stem, C).values() if v is not None]
    return sum(scored) / len(scored) if scored else None


def curve(args):
    """[(stem, n, {column: value})] and the column names, in order."""
    rows, base, budgets = heldout_rows(args.heldout)
    foreign = task_run(args.foreign, f"run evaluate.py --tasks ... --adapters ... --out {args.foreign}")
    ruler = task_run(args.ruler, f"run evaluate.py --suite ruler --adapters ... --out {args.ruler}")
    mid = budgets[len(budgets) // 2]
    out = []
    for stem, n, m in rows:
        cols = {}
        for C in budgets:
            v = m.get(f"answer_kl_lookahead@{C}")
            cols[f"held-out answer KL, C={C}"] = v
            cols[f"gap closed, C={C}"] = None if v is None else gap_closed(
                v, base[f"answer_kl_snapkv@{C}"], base[f"answer_kl_oracle@{C}"], lower_is_better=True)
        cols[f"recall@{mid}"] = m.get(f"recall_lookahead@{mid}")
        if foreign is not None:
            cols[f"foreign answer KL, C={args.budget}"], cols[f"foreign gap closed, C={args.budget}"] = \
                foreign_cell(foreign, stem, args.budget)
        if ruler is not None:
            cols[f"RULER mean, C={args.budget}"] = ruler_cell(ruler, stem, args.budget)
        out.append((stem, n, cols))
    return out


def markdown(rows):
    names = list(rows[0][2])
    lines = ["| adapter | prompts | " + " | ".join(names) + " |", "|---" * (len(names) + 2) + "|"]
    for stem, n, cols in rows:
        cells = ["-" if v is None else f"{v:.0%}" if "gap" in k else f"{v:.3f}" for k, v in cols.items()]
        lines.append(f"| {stem} | {n if n is not None else '?'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows, path):
    """One panel per measure that is not a held-out KL (the gaps say the same, on one scale), against prompts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [k for k in rows[0][2] if "answer KL" not in k]
    fig, axes = plt.subplots(1, len(shown), figsize=(3.6 * len(shown), 3.4), squeeze=False)
    xs = [n for _, n, _ in rows]
    for ax, k in zip(axes[0], shown):
        ys = [float("nan") if cols[k] is None else cols[k] for _, _, cols in rows]
        ax.plot(xs, ys, marker="o")
        ax.set_xscale("log")
        ax.set_xticks(xs, [f"{n:,}" for n in xs])  # the adapters' own counts: log-scale minor labels overlap
        ax.minorticks_off()
        ax.set_xlabel("training prompts")
        ax.set_title(k, fontsize=9)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def main(argv=None):
    return cli.run(lambda: report(argv))


def report(argv):
    p = cli.Parser("research/analysis/learning_curve.py", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heldout", required=True, help="the --out folder of an evaluate.py --heldout run (heldout.json)")
    p.add_argument("--foreign", default=None, help="the --out folder of an evaluate.py --tasks run with --adapters")
    p.add_argument("--ruler", default=None, help="the --out folder of an evaluate.py --suite ruler run with --adapters")
    p.add_argument("--budget", type=int, default=128, help="C of the foreign and RULER columns (default 128)")
    p.add_argument("--out", default=None, help="image to write (needs matplotlib); the table is always printed")
    args = p.parse_args(argv)
    cli.at_least("--budget", args.budget, 1)
    if args.out:
        cli.output_file("--out", args.out, ".png")
    rows = curve(args)
    if any(n is None for _, n, _ in rows):
        sys.exit("error: an adapter's .json has no train_data.n_train: pass adapters that train.py wrote")
    print(markdown(rows))
    if args.out:
        plot(rows, args.out)
        print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
