"""How far the span rule's cheap gate is from the exact one (extensions/span.py, RESULTS.md section 4.2.1).

The span rule needs to know which prompt tokens the model could not predict (surprisal > 2 nats). The
exact surprisal normalises over the whole vocabulary: one LM-head row per prompt token. The gate
(`span:8:N`) normalises over a shortlist: the first N ids and the prompt's own ids. This script runs
the shipped adapter on a few prompts of text the training never reads (needle.txt, two licences, two
standard-library files; the last 2K tokens of each, with a question after) and prints, per prompt:

- the share of tokens the exact surprisal calls unpredictable, and the share on which the gate agrees;
- for C = 64 / 128 / 256, the share of the exact rule's kept slots the gate's rule keeps too
  (the same prefill and scores; only the gate differs), and, for scale, the unpooled rule's share.

    python examples/span_gate.py --first 256,1024
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cli  # noqa: E402
from eviction import EvictConfig, Pool, prefill_and_score  # noqa: E402
from extensions.span import SURPRISE_NATS, SpanRule, shortlist, token_surprisal  # noqa: E402
from methods import load_adapter, make_scorer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "\n\nWhat are the most important points of the text above? Quote any numbers or names exactly."


def prompts():
    lib = Path(argparse.__file__).parent
    texts = {"needle.txt": (ROOT / "examples" / "needle.txt").read_text()}
    for name in ("Apache-2.0", "GPL-3"):
        path = Path("/usr/share/common-licenses") / name
        if path.is_file():
            texts[name] = path.read_text()
    for name in ("typing.py", "argparse.py"):
        texts[name] = (lib / name).read_text()
    return texts


def kept_share(got, want):
    """The share of `want`'s kept slots (per layer: (B, H_kv, C_l)) that `got` keeps too."""
    same = sum((g[..., :, None] == w[..., None, :]).any(-1).sum().item() for g, w in zip(got, want))
    return same / sum(w.numel() for w in want)


@torch.no_grad()
def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--first", default="256,1024", help="comma-separated N of the gates span:8:N (default 256,1024)")
    p.add_argument("--tokens", type=int, default=2048, help="prompt tokens (default 2048)")
    p.add_argument("--model", default=None, help="HF folder (default: the prepared SmolLM2)")
    p.add_argument("--adapter", default=None, help="adapter (default: the one shipped for the model)")
    args = p.parse_args()
    firsts = [int(x) for x in args.first.split(",")]
    torch.set_num_threads(1)
    model, tok, _ = cli.load(args.model)
    module = load_adapter(args.adapter or cli.default_adapter_path(model.config), model.config)
    V = model.config.vocab_size
    print(f"{'prompt':12s} {'S':>5s} {'unpred.':>7s} " + " ".join(f"{'agree N=' + str(n):>12s}" for n in firsts)
          + "   kept-slot share of the exact rule's, C=64/128/256: " + ", ".join(f"N={n}" for n in firsts) + ", unpooled")
    for name, text in prompts().items():
        ids = tok.encode(tok.chat(text + QUESTION))
        ids = torch.tensor([ids[:1] + ids[-(args.tokens - 1):]])  # the first token, then the end: the question
        exact_rule = SpanRule(8)
        run = prefill_and_score(model, ids, make_scorer(EvictConfig("lookahead", 128, rule=exact_rule), module))
        hidden = run.rule_hook.states()
        exact = token_surprisal(model.lm_head, hidden, ids)[0, 1:] > SURPRISE_NATS
        agree = [(token_surprisal(model.lm_head, hidden, ids, vocab=shortlist(ids, V, n))[0, 1:] > SURPRISE_NATS)
                 .eq(exact).float().mean().item() for n in firsts]
        shares = []
        for C in (64, 128, 256):
            want = make_scorer(EvictConfig("lookahead", C, rule=exact_rule), module).evict(run.scores, run)
            rules = [SpanRule(8, n) for n in firsts] + [Pool("none")]
            shares.append([kept_share(make_scorer(EvictConfig("lookahead", C, rule=r), module).evict(run.scores, run),
                                      want) for r in rules])
        cells = [" / ".join(f"{s[i]:.3f}" for s in shares) for i in range(len(firsts) + 1)]
        print(f"{name:12s} {ids.shape[1]:5d} {exact.float().mean().item():7.2f} "
              + " ".join(f"{a:12.3f}" for a in agree) + "   " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    main()
