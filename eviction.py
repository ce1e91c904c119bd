"""
The steps every KV-eviction method shares: prefill -> score -> evict -> decode.

After a prompt of S tokens is prefilled, each (layer, KV head) keeps only C of its S KV slots and
decoding goes on with that compact cache. A method (a Scorer) says two things: what it adds to the
prefill (a Hook that watches the queries, or rows appended after the prompt) and how it turns what
it saw into scores (L, B, H_kv, S), higher = keep. Everything else is shared and lives here:

    scorer = make_scorer(EvictConfig("snapkv", budget=128))   # methods.py
    cache, logits, next_pos, kept = compress(model, ids, scorer)
        1. prefill   the prompt (and the method's extra rows), chunk by chunk, its hook watching
        2. score     scorer.score(...) -> (L, B, H_kv, S)
        3. evict     smooth (a selection rule), protect (sinks, the recent window), top C per
                     (layer, KV head), one gather per layer
    decode(model, cache, logits, next_pos, n)  # positions go on from S whatever the cache holds

Two settings say how scores become kept slots: the smoothing before the top C (EvictConfig.rule, a
Pool: SnapKV's avg- or max-pooling, or none) and the budget policy (EvictConfig.budgets: how many
slots each layer gets). Defaults are the papers': the method's own pooling and C in every layer.
A method's own settings (StreamingLLM's sinks, LAQ's draft length, ...) live with its class
(Scorer.settings, with their defaults); EvictConfig.own sets them by name.
An idea beyond the papers wraps a Scorer from its own file in extensions/ (as kvpress's wrappers
wrap any press) and this file never names it.

The methods themselves: lookaheadkv.py (the paper) and baselines.py; methods.py names them all.
Library errors are exceptions (ValueError); the scripts turn them into one line.
"""
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from model import Hook, KVCache


@dataclass
class EvictConfig:
    method: str = "full"
    budget: int = 128  # C: KV slots kept per (layer, KV head), protected tokens included
    window: int = 32  # snapkv/pyramidkv/h2o/laq: the last `window` prompt tokens are always kept
    rule: object = None  # how scores are smoothed before the top C (a Pool); None = the method's own
    # (SnapKV-like: avg-pool 5; lookahead: its adapter's; the oracle: none). methods.make_scorer also
    # takes a rule from extensions/ here, and wraps the method in it
    budgets: object = None  # slots per layer: budgets(C, n_layers, S, least) -> list (extensions/);
    # None = the method's own (C in every layer; pyramidkv: its pyramid; lookahead: its adapter's)
    chunk_size: int = 4096  # prefill in chunks of this many tokens (bounded activations at 32K)
    own: dict = field(default_factory=dict)  # the method's own settings by name, e.g. {"n_sink": 4}: its
    # class lists them with their defaults (Scorer.settings) and refuses any other


# -----------------------------------------------------------------------------
# 1. Attention over the prompt, computed explicitly for a few queries


def group_attention(q, k, key_valid=None, causal=True):
    """Softmax attention of a chunk's queries over all keys, without copying K for GQA.

    q (B, H, Tq, D) sit at the last Tq of the Tk key slots (causal=True) or after all of them
    (causal=False: every query sees every key); k (B, H_kv, Tk, D).
    Returns float32 probabilities (B, H_kv, G*Tq, Tk): the G query heads that share a KV head
    are stacked as extra rows (query head h uses KV head h // G, as in HF's repeat_kv).
    """
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    G = H // Hkv
    qg = q.reshape(B, Hkv, G * Tq, D) / math.sqrt(D)  # (B, H_kv, G*Tq, D), scaled before Q K^T
    logits = (qg @ k.transpose(-1, -2)).float()  # (B, H_kv, G*Tq, Tk): the softmax in float32, as in HF's eager
    if causal:  # query t (row g*Tq + t) sits at slot Tk - Tq + t: only the last Tq keys can come after it
        t = torch.arange(Tq, device=q.device)
        logits[..., Tk - Tq:].masked_fill_(t[None, :] > t.repeat(G)[:, None], float("-inf"))  # (G*Tq, Tq)
    if key_valid is None:
        return logits.softmax(dim=-1)
    logits.masked_fill_(~key_valid[:, :, None, :], float("-inf"))  # (B, 1|H_kv, 1, Tk)
    # with padding, a left-padding query may see no real key: its all -inf row is NaN, make it 0
    return logits.softmax(dim=-1).nan_to_num(nan=0.0)


class WindowHook(Hook):
    """Mean attention of the chunk's last `n` queries over the first S keys, per layer and KV head
    (B, H_kv, S), or per query head (B, H, S). SnapKV (the last prompt queries) and the lookahead
    rows score this way; they differ in which queries they use."""

    keep_probs = False  # a subclass that makes its rows' output from them (Hook.attn_output) keeps them

    def __init__(self, n, S, per_query_head=False):
        self.n, self.S, self.per_query_head = n, S, per_query_head
        self.scores = {}

    def attn(self, layer, q, k, key_valid):
        q = q[:, :, -self.n:]  # (B, H, n, D)
        probs = group_attention(q, k, key_valid)  # (B, H_kv, G*n, Tk)
        if self.keep_probs:
            self.probs = probs
        probs = probs[..., : self.S]  # (B, H_kv, G*n, S)
        if self.per_query_head:  # training: one distribution per query head, (B, H, S)
            B, Hkv, _, S = probs.shape
            self.scores[layer] = probs.view(B, Hkv, -1, self.n, S).mean(dim=3).flatten(1, 2)
        else:  # eviction: mean over the GQA group and the queries, (B, H_kv, S)
            self.scores[layer] = probs.mean(dim=2)


class RecentQueries(Hook):
    """The queries of the last `n` tokens run, per layer, across every forward it watches (a prompt's
    last chunk, decode steps, new turns): LAQ's draft and window, SnapKV's decode-phase form."""

    every_chunk = True

    def __init__(self, n):
        self.n, self.q = n, {}

    def attn(self, layer, q, k, key_valid):
        prev = self.q.get(layer)
        self.q[layer] = (q if prev is None else torch.cat([prev, q], dim=2))[:, :, -self.n:]  # (B, H, <=n, D)


class Hooks(Hook):
    """Several hooks watching one forward (a method's and its selection rule's). At most one adds a LoRA.
    prefill() hands each of them the chunks it asks for (every_chunk, or the last one only)."""

    def __init__(self, *hooks):
        self.hooks = [x for h in hooks if h is not None for x in (h.hooks if isinstance(h, Hooks) else [h])]

    def lora(self, layer, name, x):
        return next((d for h in self.hooks if (d := h.lora(layer, name, x)) is not None), None)

    def attn(self, layer, q, k, key_valid):
        for h in self.hooks:
            h.attn(layer, q, k, key_valid)

    def attn_output(self, layer, v):
        return next((y for h in self.hooks if (y := h.attn_output(layer, v)) is not None), None)

    def hidden(self, h):
        for hook in self.hooks:
            hook.hidden(h)


def stack_layers(scores):
    """{layer: (B, H_kv, S)} -> (L, B, H_kv, S)."""
    return torch.stack([scores[l] for l in range(len(scores))])


# -----------------------------------------------------------------------------
# 2. From scores to kept slots: smoothing, the budget per layer, top C, one gather per layer


class Pool:
    """SnapKV's smoothing of scores (..., S) along the sequence before the top C, so that a kept
    token brings its neighbours: "avg" (SnapKV's code, kernel 5) or "max" (its LongBench configs,
    kernel 7: a dilation, a peak spreads at full height) over a centred window; "none" keeps the
    raw scores. With a protected window (kept anyway) only the prefix before it is smoothed, as in
    SnapKV's code, so the window's large scores do not leak into the tokens before it. avg pads
    with zeros and divides by the full width; max ignores the padding."""

    KINDS = ("none", "avg", "max")

    def __init__(self, kind="avg", kernel=5):
        if kind not in self.KINDS:
            raise ValueError(f"unknown pooling {kind!r}: use one of {', '.join(self.KINDS)}")
        if kind != "none" and (kernel < 1 or kernel % 2 == 0):
            raise ValueError(f"pooling width {kernel} must be odd and >= 1 (a window centred on each token): "
                             "use e.g. 1, 3, 5 or 7")
        self.kind, self.kernel = kind, (1 if kind == "none" else kernel)

    def __repr__(self):
        return self.kind if self.kind == "none" else f"{self.kind}:{self.kernel}"

    def smooth(self, scores, window=0):
        if self.kernel == 1:
            return scores
        n = scores.shape[-1] - window  # the smoothed prefix
        x = scores[..., :n].reshape(-1, 1, n).float()  # (rows, 1, n)
        pool = F.avg_pool1d if self.kind == "avg" else F.max_pool1d
        pooled = pool(x, self.kernel, stride=1, padding=self.kernel // 2).to(scores.dtype)
        pooled = pooled.reshape(*scores.shape[:-1], n)
        return torch.cat([pooled, scores[..., n:]], dim=-1) if window else pooled


def fit_to_prompt(budgets, S):
    """A layer cannot keep more than the S prompt tokens: what a clipped layer cannot use goes to
    the other layers, evenly, so the mean stays C (while C <= S)."""
    b = list(budgets)
    spare = sum(max(x - S, 0) for x in b)
    b = [min(x, S) for x in b]
    while spare > 0 and any(x < S for x in b):
        room = [l for l in range(len(b)) if b[l] < S]
        share, extra = divmod(spare, len(room))
        for i, l in enumerate(room):
            b[l] += share + (i < extra)
        spare = sum(max(x - S, 0) for x in b)
        b = [min(x, S) for x in b]
    return b


def uniform_budgets(budget, n_layers, S, least=1):
    """The papers' budget policy: C slots in every layer (all S when the prompt is shorter)."""
    return [min(budget, S)] * n_layers


def select(scores, budget, key_valid=None, protect=None):
    """Indices (..., B, H_kv, C) of the top `budget` scores (..., B, H_kv, S) per batch row and KV
    head (and layer, when the layers are stacked in front), in slot order.
    protect (B, 1, S) bool marks tokens kept whatever their score (counted inside the budget);
    padding slots are never preferred over a real token."""
    s = scores.float()
    if protect is not None:
        s = s.masked_fill(protect, float("inf"))
    if key_valid is not None:
        s = s.masked_fill(~key_valid, float("-inf"))
    return s.topk(min(budget, s.shape[-1]), dim=-1).indices.sort(dim=-1).values


def keep_slots(cache, kept):
    """Eviction itself: per layer, keep the slots `kept` (B, H_kv, C_l) of the cache, in place."""
    for layer, idx in enumerate(kept):
        cache.gather(layer, idx)
    return cache


# -----------------------------------------------------------------------------
# 3. A method is a Scorer: what it adds to the prefill, and how it scores what it saw


@dataclass
class Prefilled:
    """What a scorer (and a selection rule) may read once the prompt is prefilled."""

    cache: KVCache  # the prompt's KV, S slots per layer
    hook: Hook | None  # the scorer's own hook, after it watched the prefill
    logits: torch.Tensor  # (B, V) the first generated token's logits
    positions: torch.Tensor  # (B, S) each prompt token's position (left padding: row starts at 0)
    next_pos: torch.Tensor  # (B,) the position of the first generated token, = S_b
    valid: torch.Tensor | None  # (B, 1, S) False on left padding, or None
    scores: torch.Tensor | None = None  # (L, B, H_kv, S) once scored


class Scorer:
    """A KV-eviction method, in two parts: what it adds to the prefill (`prefill_hook`: a Hook that
    watches the queries; `extra_rows`: rows after the prompt, scored then discarded), and how it
    turns what it saw into scores (`score`: (L, B, H_kv, S), higher = keep). `protect` says which
    tokens it always keeps; `evict` is the step every method shares: smooth by the selection rule,
    top C_l per (layer, KV head) by the budget policy, in slot order."""

    evicts = True  # False: FullKV
    window = 0  # the last `window` prompt tokens are always kept (inside the budget)
    sinks = 0  # the first `sinks` tokens are always kept (inside the budget)
    budget_dependent = False  # True: the scores themselves depend on C (they cannot serve other budgets)
    default_rule = Pool("avg", 5)  # the smoothing it uses unless EvictConfig.rule says otherwise
    settings = {}  # the method's own settings and their defaults (EvictConfig.own overrides them by name)

    def __init__(self, eviction, module=None, response=None):
        self.eviction = eviction
        unknown = sorted(set(eviction.own) - set(self.settings))
        if unknown:
            raise ValueError(f"method {eviction.method} has no setting {', '.join(unknown)}; its own: "
                             f"{', '.join(self.settings) or 'none'}")
        self.own = {**self.settings, **eviction.own}
        self.rule = eviction.rule if eviction.rule is not None else self.default_rule
        if not isinstance(self.rule, Pool):  # a rule from extensions/ wraps the scorer instead
            raise ValueError(f"selection rule {self.rule!r} is not a pooling: build the method with "
                             "methods.make_scorer, which wraps it in that rule")
        if eviction.budget < 1:
            raise ValueError(f"budget {eviction.budget} must be at least 1 KV slot per (layer, KV head)")
        if self.evicts and eviction.budget < self.window + self.sinks + 1:
            kept = f"the last {self.window} tokens" if self.window else f"{self.sinks} sink tokens"
            smaller = " or a smaller window" if self.window else ""
            raise ValueError(f"budget {eviction.budget} is too small for {eviction.method}: it always keeps {kept}; "
                             f"use a budget > {self.window + self.sinks}{smaller}")

    def prefill_hook(self, ids):  # a Hook watching the prefill of the prompt ids (B, S), or None
        return None

    def extra_rows(self):  # embeddings (M, hidden) to append after the prompt, or None
        return None

    def score(self, model, run):  # (L, B, H_kv, S)
        raise NotImplementedError

    def protect(self, positions):
        """(B, 1, S) bool: the tokens kept whatever their score, or None."""
        S = positions.shape[1]
        keep = torch.zeros_like(positions, dtype=torch.bool)
        if self.window:
            keep |= torch.arange(S, device=positions.device) >= S - self.window  # the most recent
        if self.sinks:
            keep |= positions < self.sinks  # the first real tokens of each row
        return keep[:, None, :] if (self.window or self.sinks) else None

    def own_budgets(self, budget, n_layers, S, least):  # the method's budget policy (PyramidKV overrides it)
        return uniform_budgets(budget, n_layers, S, least)

    def budgets(self, n_layers, S):
        """Slots per layer: EvictConfig.budgets if given, else the method's own (C in every layer)."""
        policy = self.eviction.budgets or self.own_budgets
        return policy(self.eviction.budget, n_layers, S, least=self.window + self.sinks + 1)

    def evict(self, scores, run, budgets=None):
        """The shared step: scores (L, B, H_kv, S) -> per layer the kept slots (B, H_kv, C_l), in slot
        order. run: the Prefilled the scores are of (its positions say what is protected, its valid what
        is padding). budgets: slots per layer; None = the budget policy's (self.budgets)."""
        L, S = scores.shape[0], scores.shape[-1]
        budgets = self.budgets(L, S) if budgets is None else budgets
        scores = self.rule.smooth(scores, self.window)
        protect = self.protect(run.positions)
        if len(set(budgets)) == 1:  # one top-k for all layers
            return list(select(scores, budgets[0], run.valid, protect))
        return [select(scores[l], b, run.valid, protect) for l, b in enumerate(budgets)]


# -----------------------------------------------------------------------------
# 4. prefill -> score -> evict -> return, then decode


def prefill(model, x, positions, cache, pad_mask=None, hook=None, chunk_size=4096, logits_at=-1, tail=0):
    """Run embeddings x (B, T, hidden) through the model into `cache`, chunk by chunk so a 32K prompt's
    activations stay bounded. The LAST chunk is a full one (the first takes the remainder), so
    window scorers find all their queries in it; the last `tail` rows (the lookahead rows) ride
    along with it, so the prompt is chunked exactly as without them. The hook sees only the last
    chunk unless it says every_chunk. Returns the logits at row `logits_at` (B, 1, V)."""
    T = x.shape[1]
    P = T - tail  # the prompt
    bounds = sorted({0, *range(P % chunk_size, P, chunk_size)}) + [T]
    hooks = hook.hooks if isinstance(hook, Hooks) else [hook]
    for a, b in zip(bounds[:-1], bounds[1:]):
        last = b == T
        watching = [h for h in hooks if h is not None and (last or getattr(h, "every_chunk", False))]
        h = None if not watching else watching[0] if len(watching) == 1 else Hooks(*watching)
        out = model(inputs_embeds=x[:, a:b], positions=positions[:, a:b], cache=cache,
                    pad_mask=None if pad_mask is None else pad_mask[:, a:b], hook=h,
                    logits_at=(logits_at % T - a) if last else -1)
    return out


def prefill_and_score(model, ids, scorer, pad_mask=None, clock=None):
    """Steps 1 and 2 of compress: returns run, a Prefilled with the full prompt cache and run.scores
    (L, B, H_kv, S), or None when there is nothing to evict (S <= C, full). Scores do not depend on
    the budget (except LAQ's), so one call serves every budget. clock: anything with a mark() method
    (e.g. metrics.Stopwatch), marked after the prefill.

    scorer may also be a list of scorers that watch ONE prefill together (harness.py: every method on
    one forward); then a list of runs, one per scorer, sharing one cache (evict into copies of it). None
    of them may add rows after the prompt (the two-pass lookahead adds none): the others' hooks would
    take those rows for the prompt's last queries."""
    scorers = list(scorer) if isinstance(scorer, (list, tuple)) else [scorer]
    B, S = ids.shape
    dev = ids.device
    positions = torch.arange(S, device=dev).expand(B, S)
    if pad_mask is not None:  # left padding: each row's first real token is at position 0
        positions = (pad_mask.long().cumsum(-1) - 1).clamp(min=0)
    valid = None if pad_mask is None else pad_mask[:, None, :]  # (B, 1, S)
    next_pos = positions[:, -1] + 1  # (B,) the position of the first generated token, = S_b
    evicting = [s.evicts and S > s.eviction.budget for s in scorers]  # nothing to evict when the prompt fits

    # 1. prefill; the scorer may watch it, and add rows after the prompt (the lookahead rows, at
    # positions S_b .. S_b+M-1, riding in the last chunk)
    hooks = [s.prefill_hook(ids) if e else None for s, e in zip(scorers, evicting)]
    rows = [r for s, e in zip(scorers, evicting) if e and (r := s.extra_rows()) is not None]
    if rows and len(scorers) > 1:
        raise ValueError("a scorer that adds rows after the prompt (one-pass lookahead) prefills alone: "
                         "use its two-pass form (own=dict(one_pass=False)) beside other scorers")
    x_all, pos_all, mask_all = model.model.embed_tokens(ids), positions, pad_mask  # (B, S, hidden)
    if rows:
        M = rows[0].shape[0]
        x_all = torch.cat([x_all, rows[0].to(x_all.dtype).expand(B, -1, -1)], dim=1)  # (B, S+M, hidden)
        pos_all = torch.cat([positions, next_pos[:, None] + torch.arange(M, device=dev)], dim=1)
        mask_all = None if pad_mask is None else torch.cat([pad_mask, pad_mask.new_ones(B, M)], dim=1)
    # a hook sees the last chunk only: it holds the whole window
    chunk = max([scorers[0].eviction.chunk_size] + [s.window for s in scorers])
    cache = KVCache(model.config.num_hidden_layers)
    watch = Hooks(*hooks) if len(hooks) > 1 else hooks[0]
    logits = prefill(model, x_all, pos_all, cache, mask_all, watch, chunk, logits_at=S - 1, tail=x_all.shape[1] - S)
    cache.truncate(S)  # rows after the prompt are scored, then discarded: never in the cache
    runs = [Prefilled(cache, h, logits[:, -1], positions, next_pos, valid) for h in hooks]
    if clock is not None:
        clock.mark()

    # 2. score: (L, B, H_kv, S), every layer at once, so smoothing and top-k are a few launches in all
    for run, s, e in zip(runs, scorers, evicting):
        if e:
            run.scores = s.score(model, run)
    return runs if isinstance(scorer, (list, tuple)) else runs[0]


def compress(model, ids, scorer, pad_mask=None, clock=None):
    """Prefill the prompt ids (B, S) and evict its cache down to C = scorer.eviction.budget slots per
    (layer, KV head) by the method `scorer` (methods.make_scorer(EvictConfig(...))). pad_mask (B, S): False on left padding.
    Returns (cache, first-token logits (B, V), next positions (B,), kept): kept is, per layer, the kept
    slots (B, H_kv, C_l), or None when nothing was evicted. clock (a Stopwatch, or None) is marked after
    the prefill and after the eviction, so a caller times the two steps without the library timing anything."""
    # 1. prefill and 2. score
    run = prefill_and_score(model, ids, scorer, pad_mask, clock)
    kept = None
    if run.scores is not None:
        # 3. evict: smooth, one top-k for all layers (per layer when budgets differ), one gather per layer
        kept = scorer.evict(run.scores, run)
        keep_slots(run.cache, kept)
    if clock is not None:
        clock.mark()
    # 4. return the compact cache; the first token is decoded from the prefill's own logits
    return run.cache, run.logits, run.next_pos, kept


def decode_step(model, cache, tokens, positions, hook=None):
    """Feed tokens (B,) at positions (B,) into the cache; the next token's logits (B, V)."""
    return model(tokens[:, None], positions=positions[:, None], cache=cache, hook=hook)[:, -1]


@torch.no_grad()
def decode(model, cache, logits, next_pos, max_new_tokens, stop_ids=(), temperature=0.0, top_p=1.0, generator=None,
           hook=None, after_step=None):
    """Generate from first-token logits (B, V) on `cache`, yielding token ids (B,) step by step
    (greedy at temperature 0). Rows that hit a stop token keep being fed it (batch decoding); the
    caller stops reading them. The positions go on from next_pos whatever the cache holds.
    hook watches every step's forward, and after_step(model, cache, next_pos) runs once a token is
    in the cache, next_pos then being where the next one goes (extensions/decode.py evicts there)."""
    stop = torch.tensor(list(stop_ids) or [-1], device=logits.device)
    done = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    for t in range(max_new_tokens):
        tokens = sample(logits, temperature, top_p, generator)  # (B,)
        tokens = torch.where(done, stop[0].clamp(min=0), tokens)
        yield tokens
        done |= torch.isin(tokens, stop)
        if t == max_new_tokens - 1 or done.all():
            return
        logits = decode_step(model, cache, tokens, next_pos + t, hook)
        if after_step is not None:
            after_step(model, cache, next_pos + t + 1)


def sample(logits, temperature=0.0, top_p=1.0, generator=None):
    if temperature <= 0:
        return logits.argmax(-1)  # greedy
    probs = (logits.float() / temperature).softmax(-1)
    if top_p < 1.0:  # nucleus: keep the smallest set of tokens whose mass reaches top_p
        p, i = probs.sort(-1, descending=True)
        p[(p.cumsum(-1) - p) > top_p] = 0
        probs = torch.zeros_like(probs).scatter(-1, i, p)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@torch.no_grad()
def greedy(model, cache, logits, next_pos, max_new_tokens, stop_ids):
    """Greedy answers on `cache` (it grows), one id list per batch row, each ending at its stop token
    (kept: the end of the answer is part of its future, and it makes a future of an empty answer)."""
    answers, done = [[] for _ in range(logits.shape[0])], [False] * logits.shape[0]
    for tokens in decode(model, cache, logits, next_pos, max_new_tokens, stop_ids):
        for b, t in enumerate(tokens.tolist()):
            if not done[b]:
                answers[b].append(t)
                done[b] = t in stop_ids
    return answers
