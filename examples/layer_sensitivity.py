"""Which layers' selection the answer depends on, and the loss weights that follow from it.

    python examples/layer_sensitivity.py --out runs/ans --rows 32 --group 3 \
        --adapter-out runs/lb/adapter.safetensors     # ~4 min on 1 CPU thread
    python train.py ... --layer-weights runs/ans/layer_weights.json              # or weigh the loss with them

For each of the first --rows training rows of a train.py OUT folder (its cached prompt KV, target and
the base model's answer): the adapter's own selection at C (the top C of its GQA-mean scores, per
layer and KV head) and the oracle's (the top C of the answer's true attention). Then, one group of
--group layers at a time, the oracle's slots in those layers only and the adapter's everywhere else:
how much of the adapter's answer KL goes away is what that group's choice costs the answer
(metrics.swap_gains). Prints, per group, that gain and the training KL(gt || pred) of its layers, e.g.

    layers  answer-KL gain  KL(gt || pred)  weight
    0-2     0.0021          0.0902          0.36
    15-17   0.0493          0.1305          2.71
    ...

and writes OUT/layer_weights.json: {"weights": one per layer, "budget": one per layer, ...}. A layer's
weight is its group's gain (0 if negative) over the mean gain, mixed with the plain mean,
(1 - floor) * gain / mean + floor, so every layer keeps a share and the weights average 1 (train.py
--layer-weights reads them). The per-layer budgets are softer, C_l proportional to weight ** power
(0.5: the recall of the broad layers is not given up; RESULTS.md, section 4.4); with --adapter-out,
a copy of the adapter whose .json carries them (LookaheadModule.layer_budget, used by compress).
Measured on training rows, never on the held-out prompts the adapters are judged on. Selection is
unpooled and uniform here (the span rule needs each token's surprisal, which the training samples
do not keep).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root

import torch
from tqdm import tqdm

import data
from lookaheadkv import LookaheadModule, default_adapter_path, lookahead_pass, select, stack_layers
from metrics import swap_gains
from model import load_model, resolve_model
from train import group_mean, kl_loss, load_batch, sample_path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/ans", help="a train.py OUT folder with training samples")
    p.add_argument("--adapter", default=None, help="default: the shipped adapter")
    p.add_argument("--model", default=None, help="HF folder of the base model (default: weights/SmolLM2-135M-Instruct)")
    p.add_argument("--rows", type=int, default=32, help="training rows measured (the first ones with samples)")
    p.add_argument("--budget", type=int, default=128, help="C: slots kept per (layer, KV head)")
    p.add_argument("--group", type=int, default=3, help="layers swapped together (fewer answer forwards)")
    p.add_argument("--floor", type=float, default=0.25, help="share of the plain mean kept in every weight")
    p.add_argument("--budget-power", type=float, default=0.5, help="per-layer budgets proportional to weight ** this")
    p.add_argument("--adapter-out", default=None, help="write a copy of the adapter with these per-layer budgets")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    try:
        run(args)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}")


def run(args):
    if args.rows < 1 or args.budget < 1 or args.group < 1 or not 0 <= args.floor <= 1 or args.budget_power < 0:
        raise ValueError("--rows, --budget and --group must be at least 1, --floor a fraction between 0 and 1, "
                         "--budget-power >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(str(resolve_model(args.model)), "cpu")
    cfg = model.config
    adapter = args.adapter or default_adapter_path(cfg)
    module = LookaheadModule.load(adapter, cfg)
    path = Path(args.out) / "data.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: build the samples first (python train.py --stage data)")
    rows = [r for r in data.read_jsonl(path, required=("id", "prompt_ids", "response_ids"))
            if r.get("split") == "train" and sample_path(args.out, r["id"]).exists()][: args.rows]
    if not rows:
        raise ValueError(f"no training samples in {args.out}: build them first (python train.py --stage data)")
    L, Hkv = cfg.num_hidden_layers, cfg.num_key_value_heads
    groups = [range(a, min(a + args.group, L)) for a in range(0, L, args.group)]
    base, gains, kls = [], [[] for _ in groups], [[] for _ in range(L)]
    for r in tqdm(rows, desc="rows"):
        cache, gt, _ = load_batch([sample_path(args.out, r["id"])], "cpu", torch.float32)
        S = len(cache)
        with torch.no_grad():
            pred = lookahead_pass(model, module, cache, S, per_query_head=True)  # {layer: (1, H, S)}
        for l in range(L):
            kls[l].append(kl_loss({l: gt[l]}, {l: pred[l]}).item())
        kept = list(select(stack_layers(group_mean(pred, Hkv)), args.budget))
        oracle = list(select(stack_layers(group_mean(gt, Hkv)), args.budget))
        b, g = swap_gains(model, cache, torch.tensor([r["response_ids"]]), torch.tensor([S]), kept, oracle, groups)
        base.append(b)
        for i, x in enumerate(g):
            gains[i].append(x)
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    gain = [mean(v) for v in gains]
    kl = [mean(v) for v in kls]
    pos = [max(x, 0.0) for x in gain]
    per_group = [(1 - args.floor) * x / mean(pos) + args.floor for x in pos] if sum(pos) > 0 else [1.0] * len(pos)
    weights = [per_group[i] for i, g in enumerate(groups) for _ in g]  # one per layer; no gain anywhere: all 1
    soft = [x ** args.budget_power for x in weights]
    budget = [round(x * L / sum(soft), 4) for x in soft]  # mean 1
    print(f"adapter {Path(adapter).name}, {len(rows)} training rows of {args.out}, C = {args.budget}: "
          f"answer KL {mean(base):.4f}")
    print("layers  answer-KL gain  KL(gt || pred)  weight  budget at C")
    for i, g in enumerate(groups):
        print(f"{g.start}-{g.stop - 1:<5d} {gain[i]:<15.4f} {mean(kl[g.start:g.stop]):<15.4f} {weights[g.start]:<7.2f} "
              f"{round(args.budget * budget[g.start])}")
    how = dict(adapter=Path(adapter).name, rows=len(rows), C=args.budget, group=args.group, floor=args.floor,
               budget_power=args.budget_power)
    out = dict(weights=weights, budget=budget, **how, answer_kl=mean(base), groups=[[g.start, g.stop - 1] for g in groups],
               gain=gain, kl=kl)
    dest = Path(args.out) / "layer_weights.json"
    dest.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {dest}")
    if args.adapter_out:  # the adapter's weights as they are, its .json with the per-layer budgets
        module.layer_budget = tuple(budget)
        module.info = dict(module.info, layer_budget_from=dict(script="examples/layer_sensitivity.py", **how))
        module.save(args.adapter_out)
        print(f"wrote {args.adapter_out} (+ .json)")


if __name__ == "__main__":
    main()
