"""Which prompt tokens each KV-eviction method keeps: one heat strip per method.

    python research/analysis/plot_kept.py --prompt examples/needle.txt --budget 128 --out research/figures/kept.png

Runs FullKV once (its greedy answer is the future the oracle sees and recall is measured against),
then every method at budget C. Prints the FullKV answer, then per method: recall@C (the share of
the future's attention mass the kept tokens hold), the mean keep fraction of the planted needle
sentence's tokens, and the answer decoded from the compressed cache. Draws each token's keep
fraction (darker = kept by more (layer, KV head) pairs); ~3 minutes on 2 CPU cores.
"""

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import torch

from support import cli
from eviction import EvictConfig, compress, greedy
from lookaheadkv import answer_attention, untrained_module
from methods import load_adapter, make_scorer
from support.metrics import keep_fraction, recall_of_kept

ALL = "streaming,random,snapkv,pyramidkv,h2o,laq,oracle,lookahead,lookahead-untrained"


def token_span(tok, ids, text, start, end):
    """Token indices [a, b) covering characters [start, end) of text (= tok.decode(ids))."""
    ends = [len(tok.decode(ids[: i + 1])) for i in range(len(ids))]  # where each token's text ends
    covered = [i for i, e in enumerate(ends) if e > start and (i == 0 or ends[i - 1] < end)]
    return covered[0], covered[-1] + 1


def main(argv=None):
    return cli.run(lambda: plot(argv))


def needle_args(p, argv, out):
    """Parse a needle picture's flags (--prompt, --budget, --max-new-tokens, --out and p's own) and check them
    before the model loads: (args, the prompt's text, its needle: the planted sentence, the first that mentions
    the magic number). research/analysis/attention_picture.py shares them."""
    p.add_argument("--prompt", default="examples/needle.txt", help="a text file with one planted 'magic number'")
    p.add_argument("--budget", type=int, default=128, help="C: KV slots kept per (layer, KV head)")
    p.add_argument("--out", default=out, help="the picture (.png)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="length of the FullKV answer (the future)")
    args = p.parse_args(argv)
    prompt_file = cli.input_file("--prompt", args.prompt)  # every flag checked before the model loads
    cli.at_least("--budget", args.budget, 1)
    cli.at_least("--max-new-tokens", args.max_new_tokens, 1)
    cli.output_file("--out", args.out, ".png")
    prompt = cli.read_text(prompt_file.read_bytes(), f"--prompt {args.prompt}")
    needle = re.search(r"[A-Z][^.?!A-Z]*magic number[^.?!]*[.?!]", prompt)
    if needle is None:
        raise ValueError(f"--prompt {args.prompt}: no sentence with a planted 'magic number' (the needle drawn): "
                         "pass a prompt like examples/needle.txt")
    try:  # the figure's library, before the model loads
        import matplotlib
    except ImportError:
        raise ValueError(f"{p.prog} needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")  # draw to a file, no display
    return args, prompt, needle.group(0)


def spans_of(tok, ids, text, prompt, needle):
    """{"needle": (a, b), "question": (a, b)}: the token spans of the needle and of the question (the prompt's
    last line) in text, the chat-formatted prompt that ids encode."""
    question = prompt.strip().splitlines()[-1].strip()
    return {name: token_span(tok, ids, text, text.index(s), text.index(s) + len(s))
            for name, s in (("needle", needle), ("question", question))}


def plot(argv):
    p = cli.Parser("research/analysis/plot_kept.py", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=ALL, help=f"comma-separated, from {ALL}")
    args, prompt, needle = needle_args(p, argv, "research/figures/kept.png")
    unknown = [m for m in args.methods.split(",") if m not in ALL.split(",")]
    if unknown:
        raise ValueError(f"--methods {','.join(unknown)}: not a method here; choose from {ALL}")
    prompt = prompt.strip()
    torch.set_grad_enabled(False)
    model, tok, _ = cli.load(None)
    answer_ids = lambda *state: greedy(model, *state, args.max_new_tokens, tok.stop_ids)[0]
    text = tok.chat(prompt)
    ids = tok.encode(text)
    ids_t = torch.tensor([ids])  # (1, S)
    if len(ids) <= args.budget:
        raise SystemExit(f"error: the prompt ({len(ids)} tokens) fits in --budget {args.budget}: nothing to evict")
    spans = spans_of(tok, ids, text, prompt, needle)

    # FullKV: its greedy answer is the future the oracle sees and recall@C measures against
    cache, logits, pos, _ = compress(model, ids_t, make_scorer(EvictConfig("full")))
    prompt_cache = cache.copy()  # decoding appends to `cache`; the oracle's pass needs the prompt's alone
    response = torch.tensor([answer_ids(cache, logits, pos)])  # (1, R), the stop token included
    true = answer_attention(model, prompt_cache, response, pos)
    answer = lambda out: tok.decode([i for i in out if i not in tok.stop_ids]).strip()
    print(f"prompt {len(ids)} tokens, budget {args.budget}, needle tokens {spans['needle']}: {needle!r}")
    print(f"full answer: {answer(response[0].tolist())!r}")
    trained = load_adapter(cli.default_adapter_path(model.config), model.config)  # the shipped adapter
    torch.manual_seed(0)  # the untrained module: same shape, P ~ N(0, std of the token embeddings), LoRA B = 0
    untrained = untrained_module(model, trained.n_tokens, trained.rank, trained.alpha, trained.targets)
    modules = {"lookahead": trained, "lookahead-untrained": untrained}
    rows = []
    for name in args.methods.split(","):
        module = modules.get(name)  # each method selects its own way: lookahead as its adapter, the oracle unsmoothed
        scorer = make_scorer(EvictConfig("lookahead" if module is not None else name, args.budget), module, response)
        cache, logits, pos, kept = compress(model, ids_t, scorer)
        recall, keep_frac = recall_of_kept(kept, true), keep_fraction(kept, len(ids))
        needle_kept = keep_frac[slice(*spans["needle"])].mean()
        print(f"{name:20s} recall@{args.budget} {recall:.3f}  needle kept {needle_kept:.2f}"
              f"  answer {answer(answer_ids(cache, logits, pos))[:70]!r}")
        rows.append((name, recall, keep_frac))
    draw(rows, spans, [tok.decode([i]) for i in ids], model.config, args)


def draw(rows, spans, words, cfg, args):
    """Left: the whole prompt; right: the needle sentence, token by token."""
    import matplotlib.pyplot as plt

    S, n, pairs = len(words), len(rows), cfg.num_hidden_layers * cfg.num_key_value_heads
    a, b = spans["needle"]
    zoom = (max(a - 4, 0), min(b + 4, S))
    fig, axes = plt.subplots(1, 2, figsize=(14, 1.6 + 0.42 * n), width_ratios=(3, 1), sharey=True)
    heat = torch.stack([r[2] for r in rows]).numpy()
    for ax, (lo, hi) in zip(axes, ((0, S), zoom)):
        im = ax.imshow(heat[:, lo:hi], aspect="auto", cmap="Greys", vmin=0, vmax=1, interpolation="nearest",
                       extent=(lo - 0.5, hi - 0.5, n - 0.5, -0.5))
        ax.hlines([i + 0.5 for i in range(n - 1)], lo - 0.5, hi - 0.5, color="white", lw=2)  # row gaps
        for (name, (s0, s1)), c in zip(spans.items(), ("tab:red", "tab:blue")):
            if s0 < hi and s1 > lo:  # the span's edges, on every row
                ax.vlines([max(s0, lo) - 0.5, min(s1, hi) - 0.5], -0.5, n - 0.5, color=c, lw=1.5, label=name)
    axes[0].set_yticks(range(n), [f"{name}   recall {r:.3f}" for name, r, _ in rows])
    axes[0].set_xlabel("prompt token position (chat template included)")
    axes[0].legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, fontsize=9)
    axes[1].set_xticks(range(*zoom), [repr(w)[1:-1] for w in words[zoom[0]:zoom[1]]], rotation=90, fontsize=7)
    axes[1].set_title("the needle sentence, zoomed", fontsize=9)
    fig.suptitle(f"{Path(args.prompt).name}: the tokens each method keeps at C = {args.budget} of {S} "
                 f"(shade = share of the {pairs} (layer, KV head) pairs that keep the token)", fontsize=10)
    fig.colorbar(im, ax=axes, fraction=0.015, pad=0.01, label="keep fraction")
    fig.savefig(args.out, dpi=110, bbox_inches="tight")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
