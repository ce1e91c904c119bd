"""
Beyond the paper: a training loss weighted toward the layers whose selection the answer depends on.

The paper's loss (lookaheadkv.kl_loss) averages KL(gt || pred) over layers and heads: every layer's
prediction counts the same. On SmolLM2 a few layers decide most of the answer (18-20: research/LOG.md 4.4),
and the learning curve (research/LOG.md 8.3) saw the average KL keep falling with more data while the
held-out answer KL stopped. This loss weighs each layer's KL by its share of the answer, as
layer_budgets.measure found it for an earlier adapter on training rows (its answer-KL swap gains g):

    loss = sum_l v_l * KL_l / sum_l v_l,     v_l = w_l ** 2

w_l: that adapter's layer_weights (its .json, written by python -m research.train_lab --stage budgets). They are
sqrt(0.75 * g_l / mean(g) + 0.25) rescaled, so v_l is the floored share itself, up to a constant that
the normalisation removes: every layer keeps at least a quarter of the mean's pull.

    python train.py ... --loss-weights runs/curve/n1300-lw.json
"""
import sys

if __name__ == "__main__":  # a library module, run by -m or by its path: said before any import can fail
    sys.exit("error: extensions.layer_loss is not a script: "
             "its loss is chosen with python -m research.train_lab --loss-weights ADAPTER")

import json

import torch

from extensions.layer_budgets import checked_weights
from lookaheadkv import kl_loss


class LayerWeightedKL:
    """kl_loss per layer, then a weighted mean over layers (v_l as above); with all weights equal it is
    kl_loss itself. Called as the loss: (gt, pred) -> 0-dim tensor."""

    def __init__(self, weights):
        self.weights = checked_weights(weights)

    def __call__(self, gt, pred):
        if len(gt) != len(self.weights):
            raise ValueError(f"{len(self.weights)} layer loss weights for targets of {len(gt)} layers")
        v = [self.weights[l] for l in gt]
        per_layer = torch.stack([kl_loss({l: g}, {l: pred[l]}) for l, g in gt.items()])  # (L,)
        return (per_layer * torch.tensor(v, device=per_layer.device)).sum() / sum(v)


def read_weights(path, n_layers):
    """The loss weights v_l = w_l ** 2 from an adapter's .json (its layer_weights), checked against the
    model's layer count. ValueError naming the file otherwise, before any long work."""
    try:
        info = json.loads(open(path).read())
    except (OSError, ValueError) as e:
        raise ValueError(f"--loss-weights {path}: not a readable JSON file ({type(e).__name__}): pass an adapter's "
                         ".json measured by python -m research.train_lab --stage budgets") from None
    weights = info.get("layer_weights") if isinstance(info, dict) else None
    if not isinstance(weights, list) or not all(isinstance(w, (int, float)) for w in weights):
        raise ValueError(f"--loss-weights {path}: no layer_weights list in it: measure them first with "
                         "python -m research.train_lab --stage budgets --init ADAPTER --adapter-out ADAPTER")
    if len(weights) != n_layers:
        raise ValueError(f"--loss-weights {path}: {len(weights)} layer weights for a model of {n_layers} layers "
                         "(measured for another model)")
    return [w ** 2 for w in weights]
