"""How far the span rule's cheap gate is from the exact one (extensions/span.py, research/LOG.md 4.2.1).

The span rule needs to know which prompt tokens the model could not predict (surprisal > 2 nats). The
exact surprisal normalises over the whole vocabulary: one LM-head row per prompt token. The gate
(`span:8:N`) normalises over a shortlist: the first N ids and the prompt's own ids. This script runs
the shipped adapter on a few prompts of text the training never reads (needle.txt, two licences, two
standard-library files; the last 2K tokens of each, with a question after) and prints, per prompt:

- the share of tokens the exact surprisal calls unpredictable, and the share on which the gate agrees;
- for C = 64 / 128 / 256, the share of the exact rule's kept slots the gate's rule keeps too
  (the same prefill and scores; only the gate differs), and, for scale, the unpooled rule's share;
- "own ids decide": of the tokens the last gate calls unpredictable, the share already above 2 nats when
  log Z is summed over the tokens' own ids alone (the first of token_surprisal's two parts: the others
  read the rest of the shortlist);
- with --probe, a candidate the rule does not use: log Z predicted by a linear probe of the hidden state
  (one dot product per token), fitted by least squares on 2K tokens of each of seven other texts, and
  how often it agrees with the exact surprisal.

    python research/analysis/span_gate.py --first 256,1024 --probe
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from support import cli  # noqa: E402
from eviction import EvictConfig, Pool, prefill_and_score  # noqa: E402
from extensions.span import SURPRISE_NATS, HiddenStates, SpanRule, shortlist, token_surprisal  # noqa: E402
from methods import load_adapter, make_scorer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
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


PROBE_FIT = ["collections/__init__.py", "json/decoder.py", "email/message.py", "pathlib.py", "textwrap.py",
             "difflib.py", "/usr/share/common-licenses/LGPL-2.1"]  # none of them among prompts()


def final_states(model, ids):
    """The final normed hidden states of a plain forward of ids (1, S)."""
    hook = HiddenStates(ids)
    model(ids, positions=torch.arange(ids.shape[1])[None], hook=hook, logits_at=-1)
    return hook.states()  # (1, S, hidden)


def exact_log_z(lm_head, hidden, rows=256):
    """(n,) log Z over the whole vocabulary for the hidden states (n, hidden), `rows` at a time."""
    return torch.cat([F.linear(hidden[a:a + rows], lm_head.weight).logsumexp(-1) for a in range(0, len(hidden), rows)])


def fit_probe(model, tok, tokens):
    """Least squares (ridge 1e-2) of log Z on [hidden state, 1] over PROBE_FIT's texts: (hidden + 1,)."""
    lib, X, y = Path(argparse.__file__).parent, [], []
    for name in PROBE_FIT:
        path = Path(name) if name.startswith("/") else lib / name
        if not path.is_file():
            continue
        ids = torch.tensor([tok.encode(path.read_text())[:tokens]])
        hidden = final_states(model, ids)[0]
        X.append(torch.cat([hidden, torch.ones(len(hidden), 1)], 1).double())
        y.append(exact_log_z(model.lm_head, hidden).double())
    X, y = torch.cat(X), torch.cat(y)
    return torch.linalg.solve(X.T @ X + 1e-2 * torch.eye(X.shape[1], dtype=X.dtype), X.T @ y).float()


def kept_share(got, want):
    """The share of `want`'s kept slots (per layer: (B, H_kv, C_l)) that `got` keeps too."""
    same = sum((g[..., :, None] == w[..., None, :]).any(-1).sum().item() for g, w in zip(got, want))
    return same / sum(w.numel() for w in want)


@torch.no_grad()
def main(argv=None):
    return cli.run(lambda: measure(argv))


def measure(argv):
    p = cli.Parser("research/analysis/span_gate.py", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--first", default="256,1024", help="comma-separated N of the gates span:8:N (default 256,1024)")
    p.add_argument("--tokens", type=int, default=2048, help="prompt tokens (default 2048)")
    p.add_argument("--model", default=None, help="HF folder (default: the prepared SmolLM2)")
    p.add_argument("--adapter", default=None, help="adapter (default: the one shipped for the model)")
    p.add_argument("--probe", action="store_true", help="also fit and test a linear probe of log Z (slower)")
    args = p.parse_args(argv)
    firsts = cli.counts(args.first, "--first")  # every flag checked before the model loads
    cli.at_least("--tokens", args.tokens, 2)  # the first token, then the end of the prompt
    cli.check_fit_context("--tokens", [args.tokens], args.model)
    cli.check_model_dir(args.model)
    if args.adapter is not None:
        cli.input_file("--adapter", args.adapter)
    torch.set_num_threads(1)
    model, tok, _ = cli.load(args.model)
    module = load_adapter(args.adapter or cli.default_adapter_path(model.config), model.config)
    V = model.config.vocab_size
    probe = fit_probe(model, tok, args.tokens) if args.probe else None
    print(f"{'prompt':12s} {'S':>5s} {'unpred.':>7s} " + " ".join(f"{'agree N=' + str(n):>12s}" for n in firsts)
          + "   kept-slot share of the exact rule's, C=64/128/256: " + ", ".join(f"N={n}" for n in firsts) + ", unpooled"
          + "   own ids decide" + ("   probe agrees" if args.probe else ""))
    for name, text in prompts().items():
        ids = tok.encode(tok.chat(text + QUESTION))
        ids = torch.tensor([ids[:1] + ids[-(args.tokens - 1):]])  # the first token, then the end: the question
        exact_rule = SpanRule(8)
        run = prefill_and_score(model, ids, make_scorer(EvictConfig("lookahead", 128, rule=exact_rule), module))
        hidden = run.hook.states.states()  # what the span rule's HiddenStates kept
        exact = token_surprisal(model.lm_head, hidden, ids)[0, 1:] > SURPRISE_NATS
        agree = [(token_surprisal(model.lm_head, hidden, ids, vocab=shortlist(ids, V, n))[0, 1:] > SURPRISE_NATS)
                 .eq(exact).float().mean().item() for n in firsts]
        gate = token_surprisal(model.lm_head, hidden, ids, vocab=shortlist(ids, V, firsts[-1]))[0, 1:] > SURPRISE_NATS
        own = token_surprisal(model.lm_head, hidden, ids, vocab=ids.unique())[0, 1:] > SURPRISE_NATS
        decide = (own & gate).sum().item() / max(gate.sum().item(), 1)
        extra = f"   {decide:15.3f}"
        if probe is not None:
            h = hidden[0, :-1]  # row t - 1 predicts token t
            logit = (h * model.lm_head.weight[ids[0, 1:]]).sum(-1)
            extra += f"   {((h @ probe[:-1] + probe[-1] - logit > SURPRISE_NATS) == exact).float().mean().item():13.3f}"
        shares = []
        for C in (64, 128, 256):
            want = make_scorer(EvictConfig("lookahead", C, rule=exact_rule), module).evict(run.scores, run)
            rules = [SpanRule(8, n) for n in firsts] + [Pool("none")]
            shares.append([kept_share(make_scorer(EvictConfig("lookahead", C, rule=r), module).evict(run.scores, run),
                                      want) for r in rules])
        cells = [" / ".join(f"{s[i]:.3f}" for s in shares) for i in range(len(firsts) + 1)]
        print(f"{name:12s} {ids.shape[1]:5d} {exact.float().mean().item():7.2f} "
              + " ".join(f"{a:12.3f}" for a in agree) + "   " + "   ".join(cells) + extra, flush=True)


if __name__ == "__main__":
    main()
