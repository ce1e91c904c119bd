"""
Beyond the paper: a KV cache held to a budget after the prefill too.

The paper evicts once, after the prefill, and names what follows as its main limitation: a long
answer grows the cache again by one slot per token, and in a chat every turn is prefilled on top
of all the turns before it. Here the cache is held to `budget` slots per (layer, KV head)
throughout: each time it holds budget + `every` slots while decoding, and once per new turn
(add_turn), EVERY current slot is scored by the method's decode-phase form and the cache is
gathered back to the budget by the methods' shared eviction step (Scorer.evict):

    lookahead  the M lookahead rows, LoRA on, at the next positions on top of the current cache:
               their mean attention over its slots (lookahead_pass; their K/V are discarded)
    snapkv     the queries of the last `window` tokens run (the generated ones) over every slot
    h2o        the attention each slot has received from every query run since decoding began,
               per query that saw it (RunningH2O: H2O's native, accumulating decode form)
    streaming  recency; the first n_sink slots (attention sinks) kept

    from decode_eviction import DecodeEviction
    evictor = DecodeEviction("lookahead", budget=128, every=32, module=module)
    for tok in decode(model, cache, logits, pos, 512, hook=evictor.hook, after_step=evictor.after_step): ...
"""
import copy

import torch

from baselines import H2OHook
from lookaheadkv import (EvictConfig, decode_step, group_attention, keep_slots, lookahead_pass, make_scorer, prefill,
                         stack_layers)
from model import Hook


# The decode-phase form of each method: the scores (L, B, H_kv, n) of the n slots of a grown cache.


def streaming_scores(model, scorer, cache, hook, next_pos):
    (B, Hkv, n), L = cache.k[0].shape[:3], len(cache.k)  # slots stay in position order: recency again
    return torch.arange(n, device=cache.k[0].device).float().expand(L, B, Hkv, n)


def snapkv_scores(model, scorer, cache, hook, next_pos):
    # the last `window` tokens' queries (the latest generated ones, or a new turn's last ones) over every
    # slot; those tokens are the last slots (the window is always kept), so causal alignment holds
    return torch.stack([group_attention(hook.q[l], cache.k[l], cache.valid[l]).mean(dim=2)
                        for l in range(len(cache.k))])


def h2o_scores(model, scorer, cache, hook, next_pos):
    return stack_layers(hook.per_query_scores())


def lookahead_scores(model, scorer, cache, hook, next_pos):
    # nothing new: the M rows at the next positions on top of whatever the cache now holds (LoRA on),
    # their mean attention over its slots; their K/V go with the copy lookahead_pass runs them on
    return stack_layers(lookahead_pass(model, scorer.module, cache, next_pos))


DECODE_FORMS = {  # method -> (the hook that watches every forward after the prefill, the scores)
    "streaming": (lambda window: None, streaming_scores),
    "snapkv": (lambda window: RecentQueries(window), snapkv_scores),
    "h2o": (lambda window: RunningH2O(), h2o_scores),
    "lookahead": (lambda window: None, lookahead_scores),
}
DECODE_METHODS = tuple(DECODE_FORMS)


class RecentQueries(Hook):
    """The queries of the last `n` tokens run, per layer, across forwards: decode steps and new turns
    (SnapKV's decode-phase form scores with them)."""

    def __init__(self, n):
        self.n, self.q = n, {}

    def attn(self, layer, q, k, key_valid):
        prev = self.q.get(layer)
        self.q[layer] = (q if prev is None else torch.cat([prev, q], dim=2))[:, :, -self.n:]  # (B, H, <=n, D)


class RunningH2O(H2OHook):
    """H2O's decode-phase form: H2OHook's running sums of the attention each slot has received, over every
    forward watched since (decode steps, new turns), and how many queries saw each slot (x the group). Both
    travel with their slots when the cache is gathered; the score is their ratio, as in the prefill form."""

    def __init__(self):
        super().__init__()
        self.seen = {}

    def attn(self, layer, q, k, key_valid):
        super().attn(layer, q, k, key_valid)  # self.sums[layer]: (B, H_kv, Tk), the earlier sums on their slots
        Tq, Tk, G = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
        # the chunk's queries sit at the last Tq slots: slot j is seen by min(Tq, Tk - j) of them
        seen = torch.zeros_like(self.sums[layer]) + (Tk - torch.arange(Tk, device=k.device)).clamp(max=Tq) * G
        prev = self.seen.get(layer)
        if prev is not None:
            seen[..., : prev.shape[-1]] += prev
        self.seen[layer] = seen

    def per_query_scores(self):
        return {l: s / self.seen[l] for l, s in self.sums.items()}

    def gather(self, layer, idx):
        self.sums[layer] = self.sums[layer].gather(-1, idx)
        self.seen[layer] = self.seen[layer].gather(-1, idx)


class DecodeEviction:
    """Holds a cache to `budget` slots per (layer, KV head) after the prefill: decode(...,
    hook=this.hook, after_step=this.after_step) evicts each time the cache holds budget + `every`
    slots, and add_turn once per new turn. The last `window` slots, the most recent tokens, are
    always kept (inside the budget); each method pools its scores as it does after the prefill
    (over neighbouring slots now). Gathering keeps slots in position order, so the last slots stay
    the latest tokens, and positions never change: RoPE was applied before caching, so the next
    token is at S + t whatever was evicted. Written for batch size 1 and a cache without padding.
    every=None never evicts while decoding (the hook still watches: a chat's next turn is scored
    with what it saw). `log` gets (next position, slots before, slots after) per eviction."""

    def __init__(self, method, budget, every=None, window=32, module=None, pool=None, kernel=None, n_sink=4):
        self.check(method, budget, every, window, n_sink)
        self.scorer = make_scorer(EvictConfig(method, budget, window=window, pool=pool, kernel=kernel, n_sink=n_sink),
                                  module)  # the method's pooling (lookahead: its adapter's)
        self.scorer.window = window  # after the prefill, every method keeps the latest `window` slots
        if self.scorer.needs_surprisal:  # the span rule reads each token's surprisal, which is not kept for
            self.scorer.pool, self.scorer.kernel = "none", 1  # generated tokens: here it selects unpooled
        make_hook, self.scores = DECODE_FORMS[method]
        self.budget, self.every, self.window = budget, every, window
        self.hook = make_hook(window)  # watches every forward on the cache from now on
        self.log = []

    @staticmethod
    def check(method, budget, every=None, window=32, n_sink=4):
        """The checks that need no model (generate.py runs them before loading one): ValueError."""
        if method not in DECODE_FORMS:
            raise ValueError(f"method {method} has no decode-phase eviction here: use one of "
                             f"{', '.join(DECODE_METHODS)}")
        if every is not None and every < 1:
            raise ValueError(f"evict every {every} tokens: must be at least 1, e.g. 32")
        sinks = n_sink if method == "streaming" else 0
        if budget <= window + sinks:
            kept = f"the last {window} slots" + (f" and {sinks} sinks" if sinks else "")
            raise ValueError(f"decode budget {budget} leaves no room to choose: it always keeps {kept}; "
                             f"use a budget > {window + sinks} or a smaller window")

    def after_step(self, model, cache, next_pos):
        """decode()'s after_step: evict once the cache holds budget + every slots."""
        if self.every is not None and len(cache) >= self.budget + self.every:
            self.evict(model, cache, next_pos)

    @torch.no_grad()
    def evict(self, model, cache, next_pos, budget=None):
        """Score the n slots of `cache` and keep `budget` (default: the decode budget) per (layer, KV head).
        next_pos: the position of the next token (where the lookahead rows go). Returns the kept slots
        per layer (B, H_kv, budget), in slot order."""
        n = len(cache)
        scores = self.scores(model, self.scorer, cache, self.hook, next_pos)  # (L, B, H_kv, n)
        slots = torch.arange(n, device=scores.device).expand(scores.shape[1], n)  # (B, n): a slot's order
        kept = self.scorer.evict(scores, slots, budget=self.budget if budget is None else budget)
        keep_slots(cache, kept)
        if hasattr(self.hook, "gather"):  # H2O's running sums travel with their slots
            for layer, idx in enumerate(kept):
                self.hook.gather(layer, idx)
        self.log.append((int(next_pos[0]), n, len(cache)))
        return kept

    def fork(self):
        """A copy with its own hook state: two answers from one cache (evaluate.py: greedy and forced)."""
        other = copy.copy(self)
        other.hook, other.log = copy.deepcopy(self.hook), list(self.log)
        return other


@torch.no_grad()
def add_turn(model, cache, ids, next_pos, evictor=None, budget=None, chunk_size=4096):
    """Beyond the paper: one more conversation turn on top of a compressed cache. ids (1, T): the end of
    the previous answer, the next user message and the assistant's header, in the chat format
    (Tokenizer.next_turn); prefilled at positions next_pos .. next_pos+T-1 with the evictor's hook
    watching. Then every slot, old turns and the new one alike, is scored by the method's decode-phase
    form and the cache is evicted to `budget` (default: the evictor's; evictor None: FullKV, nothing
    evicted). Returns the first answer token's logits (1, V) and the next position (1,)."""
    T = ids.shape[1]
    positions = next_pos[:, None] + torch.arange(T, device=ids.device)  # (1, T)
    hook = None if evictor is None else evictor.hook
    chunk = max(chunk_size, 0 if evictor is None else evictor.window)  # the last chunk holds the whole window
    logits = prefill(model, model.model.embed_tokens(ids), positions, cache, hook=hook, chunk_size=chunk)[:, -1]
    next_pos = next_pos + T
    if evictor is not None and len(cache) > (evictor.budget if budget is None else budget):
        evictor.evict(model, cache, next_pos, budget)
    return logits, next_pos


@torch.no_grad()
def forced_logprobs_evicting(model, cache, logits, next_pos, response, evictor):
    """FullKV's answer `response` (1, R) teacher-forced through `cache`, held to its budget by
    `evictor` step by step, exactly as decode() holds it. Returns the (R-1, V) float32 log-probs of
    answer tokens 2..R (as metrics.forced_logprobs) and the cache's size (slots per layer and KV
    head) as each answer token is generated."""
    rows, sizes, R = [], [len(cache)], response.shape[1]
    for t in range(R - 1):
        logits = decode_step(model, cache, response[:, t], next_pos + t, evictor.hook)  # as decode() feeds a token
        rows.append(logits)
        evictor.after_step(model, cache, next_pos + t + 1)
        sizes.append(len(cache))
    if not rows:
        return torch.zeros(0, logits.shape[-1], device=logits.device), sizes
    return torch.stack(rows, dim=1)[0].float().log_softmax(-1), sizes
