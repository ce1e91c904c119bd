"""
Is the answer-weighted target (extensions/answer_weights.py) a better thing to predict? Before any training:
the oracle of each target, on training rows of a data stage. The oracle keeps, per (layer, KV head), the C
slots its target scores highest (the paper's oracle: the real answer's attention); a perfect predictor of a
target keeps what that target's oracle keeps. If the weighted target's oracle gives the answer no lower KL
than the paper's, a module trained toward it has nothing more to find.

    python research/analysis/weighted_oracle.py --data runs/data5k --rows 64 --budgets 64,128,256

Per C: the mean answer KL (metrics.answer_kl: the full cache's answer teacher-forced through the kept
slots) of the paper's oracle and of the weighted one, the difference with a 95% paired bootstrap interval,
and on how many rows the weighted oracle is the lower. Training rows only (never held-out or RULER rows).
"""
import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from support import cli  # noqa: E402
from support import data  # noqa: E402
from eviction import keep_slots, select, stack_layers  # noqa: E402
from extensions import answer_weights as aw  # noqa: E402
from research.harness import group_mean  # noqa: E402
from support.metrics import answer_kl, forced_logprobs  # noqa: E402
from train import get_batch  # noqa: E402


def oracle_kl(model, cache, response, next_pos, target, budget):
    """The answer KL of the cache that keeps each (layer, KV head)'s top `budget` slots of target (per query head)."""
    Hkv = model.config.num_key_value_heads
    kept = list(select(stack_layers(group_mean(target, Hkv)), budget))
    full = forced_logprobs(model, cache, response, next_pos)
    return answer_kl(full, forced_logprobs(model, keep_slots(cache.copy(), kept), response, next_pos))


def interval(diffs, draws=10_000, seed=0):
    rng = random.Random(seed)
    means = sorted(sum(rng.choice(diffs) for _ in diffs) / len(diffs) for _ in range(draws))
    return means[int(0.025 * draws)], means[int(0.975 * draws)]


def main(argv=None):
    return cli.run(lambda: measure(argv))


def measure(argv):
    p = cli.Parser("research/analysis/weighted_oracle.py", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a train.py data stage's folder (data.jsonl + samples/)")
    p.add_argument("--rows", type=int, default=64, help="its first N training rows")
    p.add_argument("--budgets", default="64,128,256")
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    if not (Path(a.data) / "data.jsonl").is_file():
        sys.exit(f"error: --data {a.data}: no data.jsonl there: pass the --out folder of a train.py data stage")
    budgets = cli.counts(a.budgets, "--budgets")  # every flag checked before the model loads
    cli.at_least("--rows", a.rows, 1)
    cli.check_threads("--threads", a.threads)
    cli.check_model_dir(a.model)
    torch.set_num_threads(a.threads)
    model, _, _ = cli.load(a.model, "cpu", torch.float32, tokenizer=False)
    rows, _ = aw.source_rows(Path(a.data), model.config, None)
    rows = rows[:a.rows]
    paper, weighted = {c: [] for c in budgets}, {c: [] for c in budgets}
    for r in rows:
        cache, gt, next_pos = get_batch([data.sample_path(a.data, r["id"])], "cpu", torch.float32)
        response = torch.tensor([r["response_ids"]])
        w = aw.token_weights(aw.dependence(model, cache, response, next_pos))
        target = aw.weighted_target(model, cache, response, next_pos, w)
        for c in budgets:
            paper[c].append(oracle_kl(model, cache, response, next_pos, gt, c))
            weighted[c].append(oracle_kl(model, cache, response, next_pos, target, c))
    print(f"{len(rows)} training rows of {a.data}: the answer KL of each target's oracle")
    for c in budgets:
        d = [w - p for p, w in zip(paper[c], weighted[c])]
        lo, hi = interval(d)
        print(f"C = {c}: paper's oracle {sum(paper[c]) / len(rows):.4f}, weighted oracle {sum(weighted[c]) / len(rows):.4f}"
              f"; weighted - paper {sum(d) / len(d):+.4f} [{lo:+.4f}, {hi:+.4f}], lower on {sum(x < 0 for x in d)} "
              f"of {len(rows)} rows")


if __name__ == "__main__":
    main()
