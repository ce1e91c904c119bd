"""
The LoRA targets, measured (issue 60 item 4): adapters trained on the same data rows with the LoRA on q,k only
and on all seven projections, two seeds each, compared on held-out prompts by their answer KL in the paper's form
(max-pool 7, C in every layer), paired per prompt (support.metrics.answer_kls: one prefill per prompt, every adapter scoring it in its
two-pass form beside SnapKV, each budget evicted into its own copy of the cache). Resumable: one JSON line per
prompt in --out.

    python -m research.analysis.lora_targets --heldout runs/quick --budgets 64,128,256 --out runs/targets/kl.jsonl \
        --adapters qk-s0=runs/targets/qk-s0.safetensors,qk-s1=...,all-s0=...,all-s1=...

It prints per adapter and budget the mean answer KL, then per budget the paired difference q,k - all (the mean
over a target's seeds, per prompt) with a 95% bootstrap interval over prompts.
"""
import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from eviction import EvictConfig  # noqa: E402
from methods import load_adapter, make_scorer  # noqa: E402
from support import cli, files  # noqa: E402
from support.metrics import answer_kls, paired_ci  # noqa: E402


def rows_of(folder, limit):
    rows = [json.loads(line) for line in (Path(folder) / "data.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r["split"] == "heldout"][:limit]


def main(argv=None):
    return cli.run(lambda: measure(argv))


def measure(argv):
    p = cli.Parser("research/analysis/lora_targets.py", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heldout", required=True)
    p.add_argument("--adapters", required=True, help="label=path,...; labels qk-* and all-* are paired")
    p.add_argument("--budgets", default="64,128,256")
    p.add_argument("--limit", type=int, default=64)
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    budgets = cli.counts(args.budgets, "--budgets")  # every flag and file checked before the model loads
    cli.at_least("--limit", args.limit, 1)
    cli.check_threads("--threads", args.threads)
    cli.input_file("--heldout", args.heldout)
    adapters = [item.partition("=") for item in args.adapters.split(",")]
    for label, eq, path in adapters:
        if not (label and eq and path):
            raise ValueError(f"--adapters {args.adapters}: write label=path,..., e.g. qk-1=a.safetensors")
        cli.input_file(f"--adapters {label}", path)
    cli.output_file("--out", args.out, ".jsonl")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _, _ = cli.load(None, "cpu", None, tokenizer=False)
    scorers = {"snapkv": make_scorer(EvictConfig("snapkv", max(budgets)))}
    for label, _, path in adapters:
        scorers[label] = make_scorer(EvictConfig("lookahead", max(budgets), options=dict(one_pass=False)),
                                     load_adapter(path, model.config))
    out = Path(args.out)
    done = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    rows = rows_of(args.heldout, args.limit)
    for i, row in enumerate(tqdm(rows, desc="held-out prompts")):
        if i < len(done):
            continue
        done.append(dict(id=row["id"], **answer_kls(model, row, scorers, budgets)))
        files.append_text(out, json.dumps(done[-1]) + "\n")  # never through a link (O_NOFOLLOW)
    print(f"{len(done)} held-out prompts of {args.heldout}; answer KL (nats), the paper's form:")
    for name in scorers:
        print(f"  {name:<10s} " + "  ".join(f"C={C}: {sum(d[f'{name}@{C}'] for d in done) / len(done):.4f}"
                                            for C in budgets))
    qk, al = [n for n in scorers if n.startswith("qk")], [n for n in scorers if n.startswith("all")]
    for C in budgets if qk and al else ():
        diffs = [sum(d[f"{n}@{C}"] for n in qk) / len(qk) - sum(d[f"{n}@{C}"] for n in al) / len(al) for d in done]
        lo, hi = paired_ci(diffs)
        print(f"  C={C}: q,k - all = {sum(diffs) / len(diffs):+.4f} [{lo:+.4f}, {hi:+.4f}] (paired, 95% bootstrap)")


if __name__ == "__main__":
    main()
