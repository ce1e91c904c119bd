"""
The methods LookaheadKV is compared with, one Scorer each: what it adds to the prefill and how it
scores, its paper cited (eviction.py has the shared steps, lookaheadkv.py the paper).

    full        FullKV: no eviction
    streaming   StreamingLLM: 4 sink tokens + the most recent ones
    random      RandomKV: random scores (a sanity floor)
    snapkv      SnapKV: attention of the last `window` prompt queries, pooled
    pyramidkv   PyramidKV: SnapKV's scores, per-layer budgets falling with depth (mean C)
    h2o         H2O: attention each key gets from ALL prompt queries, per query that sees it
    laq         LAQ: SnapKV-compress, draft 8 tokens, re-score the full cache with their queries
    oracle      Oracle: the true future (the full-cache answer's attention); needs that answer
"""

import torch

from eviction import (EvictConfig, Pool, Scorer, greedy, group_attention, keep_slots,
                      prefill_and_score, stack_layers)
from lookaheadkv import answer_attention
from model import Hook, Hooks


class Unpooled(Scorer):
    """A method that selects by its own scores alone (position, chance, the truth): no smoothing,
    and no selection rule applies to it (methods.make_scorer refuses one)."""

    default_rule = Pool("none")


class FullKV(Unpooled):
    """No eviction: the reference every method is measured against."""

    evicts = False


@torch.no_grad()
def full_answer(model, ids, max_new_tokens, stop_ids, pad_mask=None, clock=None):
    """FullKV's greedy answer to the prompt ids (B, S), every method's reference and the future
    LookaheadKV learns: (FullKV's Prefilled, one id list per row ending at its stop token)."""
    prefilled = prefill_and_score(model, ids, FullKV(EvictConfig("full")), pad_mask, clock)
    cache = prefilled.cache.copy()  # the answer grows the copy: prefilled.cache stays the prompt's
    return prefilled, greedy(model, cache, prefilled.logits, prefilled.next_pos, max_new_tokens,
                             stop_ids)


class StreamingLLM(Unpooled):
    """StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks",
    arXiv 2309.17453): the first n_sink tokens (they soak up attention) and the last C - n_sink."""

    default_options = dict(n_sink=4)  # the first tokens, always kept (attention sinks)

    @property
    def sinks(self):  # what Scorer.protect keeps
        return self.options["n_sink"]

    def score(self, model, prefilled):
        (B, S), L, Hkv = (prefilled.positions.shape, len(prefilled.cache.k),
                          prefilled.cache.k[0].shape[1])
        return torch.arange(S, device=prefilled.positions.device).float().expand(L, B, Hkv, S)


class RandomKV(Unpooled):
    """Random scores: the floor any method must beat."""

    default_options = dict(seed=0)

    def score(self, model, prefilled):
        (B, S), L, Hkv = (prefilled.positions.shape, len(prefilled.cache.k),
                          prefilled.cache.k[0].shape[1])
        g = torch.Generator(device="cpu").manual_seed(self.options["seed"])
        return torch.rand(L, B, Hkv, S, generator=g).to(prefilled.positions.device)


def check_queries(n, setting, method=None):
    """At least 1 last query to score with: q[:, :, -n:] with n = 0 is EVERY query of the
    prompt's last chunk, a negative n drops the first ones. `setting` names n in the error."""
    if n is None or n < 1:
        who = f"method {method}" if method else "this method"
        raise ValueError(f"{setting} {n}: {who} scores with the attention of the last {setting} "
                         f"prompt tokens' queries (0 would silently take every query of the "
                         f"prompt's last chunk), so it needs at least 1, e.g. {setting} 32")


class WindowHook(Hook):
    """SnapKV's prefill score: the mean attention of the chunk's last `n` queries (and the GQA
    group) over the first S keys, per layer and KV head (B, H_kv, S)."""

    def __init__(self, n, S):
        check_queries(n, "--window")
        self.n, self.S, self.scores = n, S, {}

    def attn(self, layer, q, k, key_valid):
        probs = group_attention(q[:, :, -self.n:], k, key_valid)  # (B, H_kv, G*n, Tk)
        self.scores[layer] = probs[..., : self.S].mean(dim=2)  # (B, H_kv, S)


class SnapKV(Scorer):
    """SnapKV (Li et al., "SnapKV: LLM Knows What You Are Looking for Before Generation", arXiv
    2404.14469): the last `window` prompt tokens play the answer; their mean attention over the
    prompt, avg-pooled (kernel 5), is the score; the window itself is always kept, inside C."""

    def __init__(self, eviction, module=None, response=None):
        # it scores with its window, not only keeps it: at least 1, checked before a model loads
        check_queries(eviction.window, "--window", eviction.method)
        self.window = eviction.window
        super().__init__(eviction)

    def prefill_hook(self, ids):
        return WindowHook(self.window, ids.shape[1])

    def score(self, model, prefilled):
        return stack_layers(prefilled.hook.scores)


class PyramidKV(SnapKV):
    """PyramidKV (Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
    Information Funneling", arXiv 2406.02069): SnapKV's scores, but early layers (broad attention)
    get more slots than late ones (focused attention): budgets fall linearly, mean C."""

    default_options = dict(beta=20)  # prefix budgets fall to (C - window) // beta

    def default_budgets(self, budget, n_layers, S, least):
        return pyramid_budgets(budget, self.window, n_layers, self.options["beta"], S)


def pyramid_budgets(budget, window, n_layers, beta, S=None):
    """PyramidKV: budgets fall linearly with depth, mean C, fitted to the S prompt tokens."""
    if n_layers == 1:
        return [budget]
    avail = budget - window
    lo = avail // beta
    hi = 2 * avail - lo
    b = [window + round(hi - l * (hi - lo) / max(n_layers - 1, 1)) for l in range(n_layers)]
    return b if S is None else fit_to_prompt(b, S)


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


class H2OHook(Hook):
    """H2O's prefill score: each key's attention from ALL prompt queries, per query that sees it
    (else early tokens win by position alone); `rows` queries at a time: O(rows x S) memory."""

    every_chunk = True  # with chunked prefill, every chunk's queries count

    def __init__(self, rows=256):
        self.rows, self.sums = rows, {}

    def attn(self, layer, q, k, key_valid):
        Tq, Tk = q.shape[2], k.shape[2]
        total = torch.zeros(k.shape[0], k.shape[1], Tk, device=k.device)  # (B, H_kv, Tk)
        for i in range(0, Tq, self.rows):
            j = min(i + self.rows, Tq)
            seen = Tk - Tq + j  # keys the sub-chunk's queries see
            probs = group_attention(q[:, :, i:j], k[:, :, :seen],
                                    None if key_valid is None else key_valid[..., :seen])
            total[..., : Tk - Tq + j] += probs.sum(dim=2)
        prev = self.sums.get(layer)
        if prev is not None:  # an earlier prefill chunk: its keys are a prefix of these
            total[..., : prev.shape[-1]] += prev
        self.sums[layer] = total

    def scores(self, key_valid, G):
        S = next(iter(self.sums.values())).shape[-1]
        valid = (torch.ones(1, 1, S, device=self.sums[0].device) if key_valid is None
                 else key_valid.float())
        seen_by = valid.flip(-1).cumsum(-1).flip(-1) * G  # real queries at or after each slot
        return {l: s / seen_by.clamp(min=1) for l, s in self.sums.items()}


class H2O(Scorer):
    """H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
    Language Models", arXiv 2306.14048), prefill form (H2OHook); it keeps the last `window` too."""

    def __init__(self, eviction, module=None, response=None):
        self.window = eviction.window
        super().__init__(eviction)

    def prefill_hook(self, ids):
        return H2OHook()

    def score(self, model, prefilled):
        G = model.config.num_attention_heads // model.config.num_key_value_heads
        return stack_layers(prefilled.hook.scores(prefilled.valid, G))


class LAQ(SnapKV):
    """LAQ (Lookahead Q-Cache, arXiv 2505.20334): compress with SnapKV, greedily draft n =
    `draft_tokens` tokens on that cache, score the FULL prompt cache with the draft's and the last n
    prompt queries; pool, keep the top C (window kept). Decoding starts from the prefill's."""

    budget_dependent = True  # the draft runs on the SnapKV-compressed cache of size C
    default_options = dict(draft_tokens=8)  # the draft's length (and prompt queries')

    def __init__(self, eviction, module=None, response=None):
        super().__init__(eviction, module, response)
        check_queries(self.options["draft_tokens"], "draft_tokens", "laq")

    def prefill_hook(self, ids):
        # SnapKV's scores (for the draft's cache) and the last draft_tokens prompt queries
        return Hooks(WindowHook(self.window, ids.shape[1]),
                     RecentQueries(self.options["draft_tokens"]))

    def score(self, model, prefilled):
        window_hook, recent = prefilled.hook.hooks
        # shallow copy: gathering in it leaves the full cache alone
        draft_cache = keep_slots(prefilled.cache.copy(),
                                 self.evict(stack_layers(window_hook.scores), prefilled))
        return stack_layers(laq_scores(model, prefilled.cache, draft_cache, prefilled.logits,
                                       prefilled.next_pos, recent.q, self.options["draft_tokens"],
                                       prefilled.valid))


class RecentQueries(Hook):
    """The queries of the last `n` tokens run, per layer, across every forward it watches:
    LAQ's draft and window, SnapKV's decode-phase form."""

    every_chunk = True

    def __init__(self, n):
        check_queries(n, "--window")
        self.n, self.q = n, {}

    def attn(self, layer, q, k, key_valid):
        prev = self.q.get(layer)
        # (B, H, <=n, D)
        self.q[layer] = (q if prev is None else torch.cat([prev, q], dim=2))[:, :, -self.n:]


@torch.no_grad()
def laq_scores(model, cache, draft_cache, logits, next_pos, window_q, n, valid):
    """LAQ's scores: n tokens' queries drafted on draft_cache, plus the last n prompt queries
    (window_q), over the FULL prompt cache."""
    S = len(cache)
    recorder = RecentQueries(n)
    tok = logits.argmax(-1)  # (B,)
    for t in range(n):
        out = model(tok[:, None], positions=(next_pos + t)[:, None], cache=draft_cache,
                    hook=recorder)
        tok = out[:, -1].argmax(-1)
    scores = {}
    for l in range(len(cache.k)):
        k = cache.k[l][:, :, :S]
        p_window = group_attention(window_q[l], k, valid)  # (B, H_kv, G*n, S), causal
        p_draft = group_attention(recorder.q[l], k, valid, causal=False)  # after every key
        scores[l] = torch.cat([p_window, p_draft], dim=2).mean(dim=2)
    return scores


class Oracle(Unpooled):
    """The true future: the mean attention of the full-cache greedy answer's R queries over the
    prompt. It needs the whole answer first: a ceiling, not a method; unpooled (the exact top C)."""

    def __init__(self, eviction, module=None, response=None):
        if response is None:
            raise ValueError("method oracle needs the full-cache answer first (response=...)")
        self.response = response
        super().__init__(eviction)

    def score(self, model, prefilled):
        return stack_layers(answer_attention(model, prefilled.cache, self.response,
                                             prefilled.next_pos))
