"""
How much the training target changes when the base model's answer is cut shorter: for each training
row of a data-stage run (OUT/data.jsonl and its sample files), the target of the answer's first N tokens
against the stored target of the whole answer, KL(whole || first N) per (layer, query head) as
lookaheadkv.kl_loss computes it, for rows whose answer is longer than N (shorter ones are the same).

    python research/analysis/answer_length.py --out runs/cost-g6 --tokens 32,64,96

Prints, per N, the mean and quartiles of that KL over the rows, and for scale the KL of the whole answer's
target against a uniform guess over the prompt (the trained adapter's held-out loss is in train.py's log).
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from support import cli  # noqa: E402
from support import data  # noqa: E402
from lookaheadkv import answer_attention, kl_loss  # noqa: E402
from train import get_batch  # noqa: E402


def main(argv=None):
    return cli.run(lambda: measure(argv))


def measure(argv):
    p = cli.Parser("research/analysis/answer_length.py", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="a train.py run's folder (data.jsonl + samples/)")
    p.add_argument("--tokens", default="64", help="comma list of answer lengths N")
    p.add_argument("--model", default=None)
    p.add_argument("--limit", type=int, default=None, help="at most this many rows")
    a = p.parse_args(argv)
    lengths = cli.counts(a.tokens, "--tokens")  # every flag and file checked before the model loads
    if a.limit is not None:
        cli.at_least("--limit", a.limit, 1)
    cli.input_file("--out (its data.jsonl)", Path(a.out) / "data.jsonl")
    cli.check_model_dir(a.model)
    model, _, _ = cli.load(a.model, "cpu", torch.float32)
    rows = [r for r in data.read_jsonl(Path(a.out) / "data.jsonl", required=("id", "response_ids")) if r.get("split") == "train"
            and data.sample_ok(data.sample_path(a.out, r["id"]))][:a.limit]
    kls, uni = {n: [] for n in lengths}, []
    for r in rows:  # each row's sample read once, for every N
        longer = [n for n in lengths if len(r["response_ids"]) > n]
        if not longer:
            continue
        cache, gt, S = get_batch([data.sample_path(a.out, r["id"])], "cpu", torch.float32)
        uni.append(kl_loss(gt, {l: torch.ones_like(g) for l, g in gt.items()}).item())
        for n in longer:
            short = answer_attention(model, cache, torch.tensor([r["response_ids"][:n]]), S, per_query_head=True)
            kls[n].append(kl_loss(gt, short).item())
    for n in lengths:
        if not kls[n]:
            print(f"N = {n}: no row's answer is longer")
            continue
        q = torch.tensor(kls[n]).quantile(torch.tensor([0.25, 0.5, 0.75])).tolist()
        print(f"N = {n}: {len(kls[n])} of {len(rows)} rows longer; KL(whole || first {n}) mean "
              f"{sum(kls[n]) / len(kls[n]):.4f} (quartiles {q[0]:.4f} {q[1]:.4f} {q[2]:.4f}); "
              f"KL(whole || uniform) mean {sum(uni) / len(uni):.4f} (rows with any N)")

if __name__ == "__main__":
    main()
