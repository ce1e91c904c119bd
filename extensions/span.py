"""
Beyond the paper: the span rule, a selection rule that keeps whole runs of unpredictable tokens.

Taking the top C scores token by token keeps the most attention mass but scatters the slots over a
number's digits, and a number is copied only if every digit survives. The span rule: a run of
consecutive tokens that the model could not predict (surprisal -log p(x_t | x_<t) > 2 nats: the
digits of a number, the pieces of a rare name or an identifier) is one span; inside it every token
takes the best score within kernel - 1 places on either side, times 0.95 per place. Predictable text
is still selected token by token. After kvpress's QuerySpanPress (importance carried with decay,
granted only to tokens the model could not predict), made two-sided.

Its cost is the surprisal, one LM-head row (V x hidden) per prompt token: for SmolLM2 a quarter of the
model's work per token, several times the rest of the method (RESULTS.md, section 5). Three ways down:

- Where: only where the rule can change what is kept. Spreading only raises scores, so every token the
  rule keeps lies within kernel - 1 places of a token in its layer's raw top C_l (and the whole run
  between them does too). So the surprisal is computed on the union of the raw top C_l of every
  (layer, KV head), dilated by kernel - 1, and every other token counts as predictable: exact
  (tests/test_extensions.py checks it). At 32K that union is a small part of S; at 1-2K with 90
  (layer, KV head) pairs it is nearly all of it.
- What (the gate, span:K:N): log Z = logsumexp of the logits over a shortlist of the vocabulary, not all
  of it: the first N ids (a byte-level BPE vocabulary: bytes, then merges, most frequent first) and every
  id of the prompt (the tokens a model copying from its context expects; the token that came is one of
  them). A part of the sum, so the surprisal is a lower bound: the gate can only call an unpredictable
  token predictable, never the reverse. With N = 1024 it reads ~1.4K of SmolLM2's 49K rows at 2K tokens of text.
- How (token_surprisal(enough=2)): the rule needs one bit per token, surprisal > 2 nats, and a part of
  log Z's sum is already a lower bound. So log Z is summed over the tokens' own ids first (~500 rows at
  2K tokens: where a model copying from its context puts its mass, and they decide ~97% of the tokens
  found unpredictable), and over the rest of the shortlist only for the tokens still at or below 2 nats:
  the same bits, a fifth less work at 2K.

It wraps any method, as kvpress's wrappers wrap any press: Spanned(scorer, SpanRule(8, 1024)) watches the
prefill beside the method's own hook and smooths the method's scores before its own eviction step.

    make_scorer(EvictConfig(..., rule=SpanRule(8, 1024)))   # methods.py wraps; or generate.py --pool span:8:1024
    make_scorer(EvictConfig(..., rule=SpanRule(8)))         # the exact surprisal: --pool span:8
"""
import sys

if __name__ == "__main__":  # a library module, run by -m or by its path: said before any import can fail
    sys.exit("error: extensions.span is not a script: "
             "it is the span rule, chosen with --pool span:K or span:K:N in generate.py and research.evaluate")

import dataclasses

import torch
import torch.nn.functional as F

from eviction import Pool
from model import Hook, Hooks

SURPRISE_NATS = 2.0  # the gate: a token the model gave p < e^-2 (about 0.14) was not predictable


class HiddenStates(Hook):
    """Keeps the final normed hidden states of the first S rows (the prompt ids (B, S)) of every prefill
    chunk; lm_head, the LM head that reads them, is set by the scorer that scores the prefill."""

    every_chunk = True

    def __init__(self, ids, lm_head=None):
        self.ids, self.S, self.lm_head, self.rows = ids, ids.shape[1], lm_head, []

    def hidden(self, h):
        done = sum(r.shape[1] for r in self.rows)
        self.rows.append(h[:, : self.S - done])  # the lookahead rows after the prompt are not kept

    def states(self):
        return torch.cat(self.rows, dim=1)  # (B, S, hidden)


def token_surprisal(lm_head, hidden, ids, where=None, rows=256, vocab=None, enough=None):
    """-log p(ids[t] | ids[<t]) in nats, (B, S) float32, from the final normed hidden states (B, S, hidden)
    of the prompt's own forward (row t - 1 predicts token t), `rows` at a time so that no (S, vocab)
    tensor is made. where (B, S) bool: only those tokens (the others get 0, as the first token does).
    vocab (n,) long: normalise over these rows of the LM head only (shortlist()); it must hold every id
    of `ids`, and then the result is a lower bound of the exact one (a part of the sum in log Z).

    enough (nats): for a caller that only asks whether the surprisal is above it (the span rule). log Z is
    then summed in two parts: first over the ids of the tokens asked about (the prompt's own: where a
    model copying from its context puts its mass), then over the rest of vocab (or of the vocabulary) for
    the tokens still at or below `enough` only. A part of the sum is a lower bound, so a token above it
    after the first part stays above it: (out > enough) is the one-part sum's, and out is its number
    wherever out <= enough. The first part decides most of the tokens above it (research/LOG.md 9)."""
    B, S = ids.shape
    out = torch.zeros(B, S, device=ids.device)
    if where is None:
        where = torch.ones(B, S, dtype=torch.bool, device=ids.device)
    where = where.clone()
    where[:, 0] = False  # the first token has no context
    b, t = where.nonzero(as_tuple=True)  # the tokens asked for, row-major
    W = lm_head.weight  # (V, hidden)

    def h(r):  # (len(r), hidden): the rows that predict the tokens r
        return hidden[b[r], t[r] - 1]

    def slices(todo):
        return [todo[a:a + rows] for a in range(0, len(todo), rows)]

    todo = torch.arange(len(t), device=ids.device)  # the tokens not yet decided: all of them
    own_logit = torch.zeros(len(t), device=ids.device)  # (n,) the logit of the token that came
    for r in slices(todo):
        own_logit[r] = (h(r).float() * W[ids[b[r], t[r]]].float()).sum(-1)
    parts = [vocab]  # the LM-head rows of each part of log Z (None: all of them)
    if enough is not None:
        own_ids = torch.zeros(len(W), dtype=torch.bool, device=ids.device).index_fill_(0, ids[b, t], True)  # (V,)
        rest = (~own_ids).nonzero()[:, 0] if vocab is None else vocab[(~own_ids[vocab]).nonzero()[:, 0]]
        parts = [own_ids.nonzero()[:, 0], rest]
    log_z = torch.full_like(own_logit, float("-inf"))  # (n,) the sum so far
    for i, part in enumerate(parts):
        if i:
            todo = todo[(log_z[todo] - own_logit[todo] <= enough).nonzero()[:, 0]]
        rows_of = W if part is None else W[part]  # (V or n, hidden)
        for r in slices(todo):
            log_z[r] = torch.logaddexp(log_z[r], F.linear(h(r), rows_of).float().logsumexp(-1))
    out[b, t] = log_z - own_logit
    return out


def shortlist(ids, vocab_size, first):
    """The LM-head rows the cheap gate normalises over: the first `first` ids (a byte-level BPE vocabulary
    holds its special and 256 byte tokens first, then its merges in the order they were learnt, the most
    frequent pieces first) and every id in the prompt (what a model copying from its context expects).
    (n,) sorted, n << vocab_size."""
    head = torch.arange(min(first, vocab_size), device=ids.device)
    return torch.unique(torch.cat([head, ids.flatten()]))


def shift(t, o, fill):
    """t (..., n) moved o places along the last dim: out[i] = t[i - o] (o < 0: t[i + |o|]), `fill` outside."""
    if o == 0:
        return t
    out = torch.full_like(t, fill)
    if o > 0:
        out[..., o:] = t[..., :-o]
    else:
        out[..., :o] = t[..., -o:]
    return out


def span_scores(x, surprisal, kernel, decay=0.95):
    """Scores x (..., B, H_kv, n), surprisal (B, n): inside a run of unpredictable tokens every token
    gets the best score within kernel - 1 places on either side, times decay per place."""
    u = surprisal > SURPRISE_NATS  # (B, n)
    joined = torch.zeros_like(u)
    joined[:, 1:] = u[:, 1:] & u[:, :-1]  # token t and t - 1 in one span
    joined = joined[:, None]  # (B, 1, n), broadcast over the KV heads (and the layers in front)
    out = x
    left = right = torch.ones_like(joined)
    for o in range(1, kernel):
        left = left & shift(joined, o - 1, False)  # t - o .. t one span: joined at t - o + 1 .. t
        right = right & shift(joined, -o, False)  # t .. t + o one span: joined at t + 1 .. t + o
        carried = decay ** o
        out = torch.where(left, torch.maximum(out, shift(x, o, 0.0) * carried), out)  # from o places before
        out = torch.where(right, torch.maximum(out, shift(x, -o, 0.0) * carried), out)  # from o places after
    return out


def candidates(scores, budgets, kernel):
    """(B, n) bool: the tokens within kernel - 1 places of a raw top-C_l token of any (layer, KV head).
    scores (L, B, H_kv, n)."""
    L, B, _, n = scores.shape
    hit = torch.zeros(B, n, device=scores.device)
    for l in range(L):
        top = scores[l].topk(min(budgets[l], n), dim=-1).indices  # (B, H_kv, C_l)
        hit.scatter_(1, top.flatten(1), 1.0)
    return F.max_pool1d(hit[:, None], 2 * kernel - 1, stride=1, padding=kernel - 1)[:, 0] > 0


class SpanRule:
    """The selection rule: smooth a method's scores with span_scores, the surprisal computed on the candidate
    tokens only, over the whole vocabulary (first=None: exact) or over shortlist(ids, V, first) (the cheap
    gate; see the module docstring), from the final hidden states a HiddenStates hook kept in the prefill.
    EvictConfig(rule=SpanRule(...)) names it; methods.make_scorer asks it to wrap the method (Spanned)."""

    def __init__(self, kernel=8, first=None):
        if kernel < 1:
            raise ValueError(f"span width {kernel} must be >= 1")
        if first is not None and first < 1:
            raise ValueError(f"span shortlist {first} must be >= 1")
        self.kernel, self.first = kernel, first  # first: None = the exact surprisal, else shortlist(ids, V, first)
        self.last_share = None  # the share of prompt tokens whose surprisal the last smooth() computed

    def wrap(self, scorer):
        """The method (its rule Pool("none")) wrapped in this rule: methods.make_scorer calls it."""
        return Spanned(scorer, self)

    def __repr__(self):
        return f"span:{self.kernel}" + ("" if self.first is None else f":{self.first}")

    def check_fits(self, context=None, vocab=None):
        """ValueError if the rule asks for more than the model has: a width wider than its context (no
        prompt is that long) or a shortlist past its vocabulary (it would be the whole of it: the exact
        surprisal, not the cheap gate it names). None: not checked."""
        if context is not None and self.kernel > context:
            raise ValueError(f"span width {self.kernel} is wider than the model's context of {context} tokens: "
                             f"no prompt is that long; use a width of at most {context}, e.g. span:8")
        if vocab is not None and self.first is not None and self.first > vocab:
            raise ValueError(f"span shortlist {self.first} is past the model's vocabulary of {vocab} ids: use "
                             f"span:{self.kernel}:N with N at most {vocab}, or span:{self.kernel} for the exact "
                             f"surprisal over the whole vocabulary")

    def smooth(self, scores, states, valid=None, positions=None, window=0, budgets=None):
        """scores (L, B, H_kv, S) smoothed inside spans; states: the HiddenStates that watched the prefill
        (None, or a kernel of 1: the scores as they are); valid (B, 1, S) False on padding; positions (B, S)."""
        if self.kernel == 1 or states is None:
            return scores
        n = scores.shape[-1] - window  # the smoothed prefix
        # nothing is carried past the prefix's ends, so any width beyond n smooths as n does: a huge one
        # (a direct caller's SpanRule(10**11)) is then n small steps, not one endless pooling op
        kernel = max(min(self.kernel, n), 1)
        prefix = scores[..., :n].float()
        where = candidates(prefix, budgets or [n] * scores.shape[0], kernel)  # (B, n)
        ids, hidden, V = states.ids[:, :n], states.states()[:, :n], states.lm_head.weight.shape[0]
        real = torch.ones_like(ids, dtype=torch.bool) if valid is None else valid[:, 0, :n]
        # one batch row at a time: the gate's shortlist is of that row's own tokens (not its padding),
        # so a row scores as it would alone
        vocab = [None if self.first is None else shortlist(ids[b][real[b]], V, self.first) for b in range(len(ids))]
        surprisal = torch.cat([token_surprisal(states.lm_head, hidden[b:b + 1], ids[b:b + 1], where[b:b + 1], vocab=v,
                                               enough=SURPRISE_NATS) for b, v in enumerate(vocab)])
        if positions is not None:
            surprisal = surprisal.masked_fill(positions[:, :n] == 0, 0.0)  # each row's first real token
        self.last_share = where.float().mean().item()
        pooled = span_scores(prefix, surprisal, kernel).to(scores.dtype)
        return torch.cat([pooled, scores[..., n:]], dim=-1) if window else pooled


class SpanHooks(Hooks):
    """The wrapped method's own hook (inner) and the span rule's HiddenStates (states), on one prefill."""

    def __init__(self, inner, states):
        super().__init__(inner, states)
        self.inner, self.states = inner, states


class Spanned:
    """Any method (a Scorer, its rule a Pool("none")) wrapped in the span rule: its prefill is watched for the
    final hidden states too, its scores are smoothed by the rule before its own eviction step. Everything
    else (budgets, protected tokens, options) is the method's: attributes not defined here are its."""

    def __init__(self, scorer, rule):
        if not (isinstance(scorer.rule, Pool) and scorer.rule.kind == "none"):
            raise ValueError(f"the span rule replaces the method's pooling: build {scorer.eviction.method} "
                             f"with rule=Pool('none'), not {scorer.rule!r}")
        self.scorer, self.rule = scorer, rule  # rule: what it selects by (methods.selection_of says it)

    def __getattr__(self, name):  # only for what this class does not define: the method's own
        return getattr(self.scorer, name)

    def prefill_hook(self, ids):
        inner = self.scorer.prefill_hook(ids)
        return SpanHooks(inner, HiddenStates(ids)) if self.rule.kernel > 1 else inner

    def score(self, model, prefilled):
        if not isinstance(prefilled.hook, SpanHooks):
            return self.scorer.score(model, prefilled)
        prefilled.hook.states.lm_head = model.lm_head  # what reads the hidden states it kept, at eviction
        return self.scorer.score(model, dataclasses.replace(prefilled, hook=prefilled.hook.inner))

    def evict(self, scores, prefilled, layer_budgets=None):
        L, S = scores.shape[0], scores.shape[-1]
        budgets = self.scorer.layer_budgets(L, S) if layer_budgets is None else layer_budgets
        states = prefilled.hook.states if isinstance(prefilled.hook, SpanHooks) else None
        if states is None and self.rule.kernel > 1:  # smoothing nothing would select as the method alone, silently
            raise ValueError(f"the span rule ({self.rule!r}) did not watch this prefill: make the run with this "
                             "scorer (prefill_and_score)")
        scores = self.rule.smooth(scores, states, prefilled.valid, prefilled.positions, self.scorer.window, budgets)
        return self.scorer.evict(scores, prefilled, budgets)
