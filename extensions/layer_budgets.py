"""
Beyond the paper: per-layer budgets, a budget policy that gives more of the same total cache to the
layers where a method's choice decides the answer (the paper keeps C in every layer).

Measured per adapter, on training rows: for each group of layers, how much of the adapter's answer
KL goes away when those layers alone keep the oracle's slots and every other layer keeps the
adapter's (swap_gains). On SmolLM2 layers 18-20 hold more than half of it (research/LOG.md 4.4). The
gains g become each layer's share of the slots, w (mean 1):

    w_l = sqrt(0.75 * g_l / mean(g) + 0.25), renormalised to mean 1      (layer_weights)
    C_l = C * w_l, rounded so that the C_l sum to L * C exactly, each >= 1 and <= S   (LayerBudgets)

The floor 0.25 keeps every layer a share; the square root spares the broad layers' recall. The
weights travel in the adapter's .json ("layer_weights"); python -m research.train_lab --stage budgets writes them.

    EvictConfig(..., budgets=LayerBudgets(weights))
"""
import sys

if __name__ == "__main__":  # a library module, run by -m or by its path: said before any import can fail
    sys.exit("error: extensions.layer_budgets is not a script: "
             "its budgets are chosen with generate.py --layer-budgets; research.train_lab --stage budgets measures them")

import math

import torch

from baselines import fit_to_prompt
from eviction import keep_slots, select, stack_layers
from lookaheadkv import kl_loss, lookahead_pass
from support.metrics import answer_kl, forced_logprobs

FLOOR, POWER, GROUP = 0.25, 0.5, 3  # the share every layer keeps, the softening, layers measured together


def checked_weights(weights):
    """Per-layer weights as floats: finite, >= 0, not all 0 (ValueError otherwise)."""
    weights = [float(w) for w in weights]
    if not weights or min(weights) < 0 or not sum(weights) > 0 or not all(map(math.isfinite, weights)):
        raise ValueError(f"layer weights must be finite numbers >= 0, not all 0, got {weights}")
    return weights


class LayerBudgets:
    """The budget policy: C_l = C * w_l slots in layer l, the same L * C in all."""

    name = "per-layer budgets"  # what the stats line says (methods.selection_of)

    def __init__(self, weights):
        self.weights = checked_weights(weights)

    def __call__(self, budget, n_layers, S, least=1):
        if len(self.weights) != n_layers:
            raise ValueError(f"{len(self.weights)} layer weights for a model of {n_layers} layers: measure them for "
                             "this model (python -m research.train_lab --stage budgets)")
        return spread_budgets(budget, self.weights, S, least)


def spread_budgets(budget, weights, S, least=1):
    """Per-layer budgets C * w_l / mean(w), each at least `least` slots, summing to L * C exactly
    (largest remainders get the rounding), then fitted to the prompt (baselines.fit_to_prompt)."""
    L, total = len(weights), sum(weights)
    want = [max(budget * L * w / total, least) for w in weights]
    scale = (budget * L - least * L) / max(sum(x - least for x in want), 1e-9)  # the floor comes out of the rest
    want = [least + (x - least) * scale for x in want]
    b = [math.floor(x) for x in want]
    for l in sorted(range(L), key=lambda l: b[l] - want[l])[: budget * L - sum(b)]:
        b[l] += 1
    return fit_to_prompt(b, S)


@torch.no_grad()
def swap_gains(model, cache, response, next_pos, kept, oracle_kept, groups):
    """Which layers' selection the answer depends on. kept, oracle_kept: per layer the slots (1, H_kv, C) a
    method and the oracle keep; groups: lists of layers. Returns the method's answer KL and, per group,
    how much lower it is when those layers alone keep the oracle's slots (the method's everywhere else)."""
    full = forced_logprobs(model, cache, response, next_pos)

    def kl(kept_now):
        return answer_kl(full, forced_logprobs(model, keep_slots(cache.copy(), kept_now), response, next_pos))

    base = kl(kept)
    return base, [base - kl([oracle_kept[l] if l in g else kept[l] for l in range(len(kept))]) for g in groups]


def layer_weights(gains, groups, n_layers):
    """Per-group answer-KL gains -> one weight per layer, mean 1 (the formula in the module docstring)."""
    pos = [max(g, 0.0) for g in gains]
    mean = sum(pos) / len(pos)
    per_group = [(1 - FLOOR) * g / mean + FLOOR for g in pos] if mean > 0 else [1.0] * len(pos)
    soft = [per_group[i] ** POWER for i, g in enumerate(groups) for _ in g]
    return [round(w * n_layers / sum(soft), 4) for w in soft]


@torch.no_grad()
def measure(model, module, samples, budget=128, progress=lambda it: it):
    """The adapter's layer weights from training samples: each (cache (1, H_kv, S, D) per layer, target
    {layer: (1, H, S)}, answer ids (1, R)). The adapter's own unpooled top C and the oracle's per
    (layer, KV head); then swap_gains per group of GROUP layers. Returns (weights, report dict)."""
    L, Hkv = model.config.num_hidden_layers, model.config.num_key_value_heads
    groups = [range(a, min(a + GROUP, L)) for a in range(0, L, GROUP)]
    group_mean = lambda s: {l: x.view(x.shape[0], Hkv, -1, x.shape[-1]).mean(2) for l, x in s.items()}  # noqa
    base, gains, kls = [], [[] for _ in groups], [[] for _ in range(L)]
    for cache, gt, response in progress(samples):
        S = len(cache)
        pred = lookahead_pass(model, module, cache, S, per_query_head=True)  # {layer: (1, H, S)}
        for l in range(L):
            kls[l].append(kl_loss({l: gt[l]}, {l: pred[l]}).item())
        kept = list(select(stack_layers(group_mean(pred)), budget))
        oracle = list(select(stack_layers(group_mean(gt)), budget))
        b, g = swap_gains(model, cache, response, torch.tensor([S], device=response.device), kept, oracle, groups)
        base.append(b)
        for i, x in enumerate(g):
            gains[i].append(x)
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    gain = [mean(v) for v in gains]
    weights = layer_weights(gain, groups, L)
    report = dict(rows=len(base), C=budget, group=GROUP, floor=FLOOR, power=POWER, answer_kl=mean(base),
                  groups=[[g.start, g.stop - 1] for g in groups], gain=gain, kl=[mean(v) for v in kls])
    return weights, report
