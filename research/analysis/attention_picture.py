"""Where the answer looks, where the lookahead rows and SnapKV guess it will, and what each keeps: one picture.

    python research/analysis/attention_picture.py --prompt examples/needle.txt --budget 128 --out examples/needle-attention.png

The README's default run (generate.py --prompt examples/needle.txt --budget 128), drawn for three (layer, KV head)
pairs: by default the three whose real answer pays the needle sentence the largest share of its attention (where
keeping it matters; --pairs picks others). One KV head each, not a mean over heads: each (layer, KV head) selects
its own C slots, so its strips are exactly what that selection saw. Five aligned strips over the S prompt tokens:
  answer attends     the attention FullKV's greedy answer pays to the prompt (lookaheadkv.answer_attention): the
                     future the oracle sees, the target the adapter was trained toward
  lookahead scores   the shipped adapter's M rows: s_j, the mean over the M queries and the G query heads of the
                     group (METHOD.md section 2), as eviction.prefill_and_score returns it, before the pooling
  SnapKV scores      the same mean over the last 32 prompt queries instead
  ... keeps          the C slots each keeps: its scores max-pooled (lookahead, width 7) or avg-pooled (SnapKV,
                     width 5, its window kept whole), then the top C (Scorer.evict, the step generate.py runs)
A score strip is shaded on a log scale by its share of the strip's largest score (pale below 1/1000); the needle
sentence is framed in red, the question in blue; the right panels zoom on the needle. It prints (~2 minutes on
2 shared CPU cores: three prefills and a 64-token answer):

    prompt 878 tokens, budget 128, needle tokens (428, 447): 'The special magic number for the blue lighthouse is: 7381924.'
    full answer: 'The special magic number for the blue lighthouse is 7381924.'
    lookahead  recall@128  drawn (layer:head) 18:2 0.936  17:1 0.647  7:2 0.653  all 90 pairs 0.832
    snapkv     recall@128  drawn (layer:head) 18:2 0.952  17:1 0.725  7:2 0.760  all 90 pairs 0.845
    wrote examples/needle-attention.png

recall@C: the share of the answer's attention mass the kept slots hold (support.metrics.recall_of_kept)."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import torch

from baselines import full_answer
from eviction import EvictConfig, prefill_and_score
from lookaheadkv import answer_attention
from methods import load_adapter, make_scorer
from research.analysis.plot_kept import needle_args, spans_of
from support import cli
from support.metrics import recall_of_kept

DECADES = 3  # a score strip shows 3 decades below its largest score


def main(argv=None):
    return cli.run(lambda: picture(argv))


@torch.no_grad()
def picture_data(model, ids, module, budget, max_new_tokens, stop_ids):
    """For the prompt ids (1, S): {"answer", "lookahead", "snapkv": scores (L, H_kv, S), "kept": {"lookahead",
    "snapkv": marks (L, H_kv, S), True on the slots each keeps at C = budget}, "response": FullKV's answer ids}.
    Every number is the library's: FullKV's greedy answer and its attention over the prompt (the oracle's
    target), each method's prefill_and_score and Scorer.evict, as compress runs them."""
    S = ids.shape[1]
    if S <= budget:
        raise ValueError(f"the prompt ({S} tokens) fits in --budget {budget}: nothing to evict")
    prefilled, answers = full_answer(model, ids, max_new_tokens, stop_ids)
    response = torch.tensor(answers, device=ids.device)  # (1, R), the stop token included
    true = answer_attention(model, prefilled.cache, response, prefilled.next_pos)  # {layer: (1, H_kv, S)}
    data = dict(answer=torch.stack([true[l][0] for l in range(len(true))]), kept={},
                response=answers[0])  # (L, H_kv, S)
    for name, scorer in (("lookahead", make_scorer(EvictConfig("lookahead", budget), module)),
                         ("snapkv", make_scorer(EvictConfig("snapkv", budget)))):
        scored = prefill_and_score(model, ids, scorer)
        kept = scorer.evict(scored.scores, scored)  # per layer (1, H_kv, C), what compress gathers
        data[name] = scored.scores[:, 0]  # (L, H_kv, S)
        data["kept"][name] = torch.zeros_like(data[name], dtype=torch.bool).scatter_(
            -1, torch.stack(kept)[:, 0], True)  # (L, H_kv, S)
    return data


def picture(argv):
    p = cli.Parser("research/analysis/attention_picture.py", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", default=None, help="the (layer, KV head) pairs drawn, as layer:head,... (0 = the "
                   "first), e.g. 18:2,7:2; default: the 3 whose answer pays the needle the largest share")
    args, prompt, needle = needle_args(p, argv, "examples/needle-attention.png")
    try:
        pairs = args.pairs and [tuple(int(n) for n in pair.split(":", 1)) for pair in args.pairs.split(",")]
    except ValueError:
        raise ValueError(f"--pairs {args.pairs!r}: expected layer:head pairs, e.g. 18:2,7:2") from None
    torch.set_grad_enabled(False)
    model, tok, _ = cli.load(None)
    cfg = model.config
    if pairs and not all(len(pair) == 2 and 0 <= pair[0] < cfg.num_hidden_layers
                         and 0 <= pair[1] < cfg.num_key_value_heads for pair in pairs):
        raise ValueError(f"--pairs {args.pairs}: {cfg.name} has layers 0 .. {cfg.num_hidden_layers - 1} and KV "
                         f"heads 0 .. {cfg.num_key_value_heads - 1}")
    text = tok.chat(prompt)  # as generate.py encodes it: the chat template, the file as it is
    ids = tok.encode(text)
    module = load_adapter(cli.default_adapter_path(cfg), cfg)  # the shipped adapter
    data = picture_data(model, torch.tensor([ids]), module, args.budget, args.max_new_tokens, tok.stop_ids)
    spans = spans_of(tok, ids, text, prompt, needle)
    pairs = pairs or needle_pairs(data["answer"], spans["needle"], 3)
    answer = tok.decode([i for i in data["response"] if i not in tok.stop_ids]).strip()
    print(f"prompt {len(ids)} tokens, budget {args.budget}, needle tokens {spans['needle']}: {needle!r}")
    print(f"full answer: {answer!r}")
    every = [(l, h) for l in range(cfg.num_hidden_layers) for h in range(cfg.num_key_value_heads)]
    overall = {name: recall(data, name, every) for name in data["kept"]}
    for name in data["kept"]:
        drawn = "  ".join(f"{l}:{h} {recall(data, name, [(l, h)]):.3f}" for l, h in pairs)
        print(f"{name:10s} recall@{args.budget}  drawn (layer:head) {drawn}  all {len(every)} pairs "
              f"{overall[name]:.3f}")
    draw(data, spans, [tok.decode([i]) for i in ids], pairs, overall, args)


def needle_pairs(answer, span, n):
    """The n (layer, KV head) pairs whose answer (L, H_kv, S) pays the needle's tokens span = (a, b) the
    largest share of its attention: where keeping the needle matters."""
    share = answer[..., slice(*span)].sum(-1) / answer.sum(-1)  # (L, H_kv)
    top = share.flatten().topk(n).indices.tolist()
    return [divmod(i, answer.shape[1]) for i in top]


def recall(data, name, pairs):
    """recall@C of method `name` over the (layer, KV head) pairs given: the share of the answer's attention
    mass its kept slots hold, averaged (support.metrics.recall_of_kept)."""
    kept = [data["kept"][name][l, h].nonzero()[:, 0][None, None] for l, h in pairs]  # (1, 1, C) each
    return recall_of_kept(kept, [data["answer"][l, h][None, None] for l, h in pairs])


def shade(scores):
    """Scores (..., S) -> [0, 1]: log10 of each one's share of the largest, 0 at DECADES below it and under."""
    share = scores.float() / scores.float().amax(-1, keepdim=True).clamp(min=1e-30)
    return (share.clamp(min=10.0 ** -DECADES).log10() / DECADES + 1).numpy()


def draw(data, spans, words, pairs, overall, args):
    """One row of panels per (layer, KV head): the whole prompt on the left, the needle sentence zoomed on the right;
    scores shaded by `shade`, kept slots dark."""
    import matplotlib.pyplot as plt

    S = len(words)
    labels = ["answer attends", "lookahead scores", "SnapKV scores", "lookahead keeps", "SnapKV keeps"]
    a, b = spans["needle"]
    zoom = (max(a - 4, 0), min(b + 4, S))
    fig, axes = plt.subplots(len(pairs), 2, figsize=(14, 0.3 + 1.35 * len(pairs)), width_ratios=(3, 1),
                             sharey=True, squeeze=False)
    for row, (l, h) in zip(axes, pairs):
        strips = torch.stack([torch.as_tensor(shade(data[k][l, h])) for k in ("answer", "lookahead", "snapkv")]
                             + [data["kept"][k][l, h].float() for k in ("lookahead", "snapkv")])  # (5, S)
        for ax, (lo, hi) in zip(row, ((0, S), zoom)):
            im = ax.imshow(strips[:, lo:hi].numpy(), aspect="auto", cmap="magma_r", vmin=0, vmax=1,
                           interpolation="nearest", extent=(lo - 0.5, hi - 0.5, len(labels) - 0.5, -0.5))
            ax.hlines([2.5], lo - 0.5, hi - 0.5, color="white", lw=3)  # scores above, kept slots below
            for (name, (s0, s1)), c in zip(spans.items(), ("tab:red", "tab:blue")):
                if s0 < hi and s1 > lo:  # the span's edges, on every strip
                    ax.vlines([max(s0, lo) - 0.5, min(s1, hi) - 0.5], -0.5, len(labels) - 0.5, color=c, lw=1.2,
                              label=name)
            ax.set_xticks([])
        row[0].set_yticks(range(len(labels)), labels, fontsize=8)
        row[0].set_ylabel(f"layer {l}\nKV head {h}", fontsize=9)
        row[1].set_title(f"recall@{args.budget}: lookahead {recall(data, 'lookahead', [(l, h)]):.2f}, "
                         f"SnapKV {recall(data, 'snapkv', [(l, h)]):.2f}", fontsize=8)
    axes[-1, 0].set_xticks(range(0, S, 100))
    axes[-1, 0].set_xlabel("prompt token position (chat template included)")
    axes[-1, 0].legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=2, fontsize=9)
    axes[-1, 1].set_xticks(range(*zoom), [repr(w)[1:-1] for w in words[zoom[0]:zoom[1]]], rotation=90, fontsize=7)
    axes[0, 1].set_title(f"the needle sentence, zoomed\n{axes[0, 1].get_title()}", fontsize=8)
    pairs_all = data["answer"].shape[0] * data["answer"].shape[1]
    fig.suptitle(f"{Path(args.prompt).name}, C = {args.budget} of {S} slots per (layer, KV head): where the answer "
                 f"attends, where the lookahead rows and SnapKV predict it will, and what each keeps\nrecall@"
                 f"{args.budget} over all {pairs_all} (layer, KV head) pairs: lookahead {overall['lookahead']:.3f}, "
                 f"SnapKV {overall['snapkv']:.3f}", fontsize=10, y=1.0 + 0.12 / len(pairs))
    bar = fig.colorbar(im, ax=axes, fraction=0.012, pad=0.01, ticks=[i / DECADES for i in range(DECADES + 1)])
    bar.set_ticklabels([f"1e-{DECADES - i}" for i in range(DECADES)] + ["max\n(kept)"])
    bar.set_label("score / the strip's largest (log scale)", fontsize=9)
    fig.savefig(args.out, dpi=100, bbox_inches="tight")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
