"""
Beyond the paper: a KV cache held to a budget after the prefill too.

The paper evicts once, after the prefill, and names what follows as its main limitation: a long
answer grows the cache again by one slot per token, and in a chat every turn is prefilled on top
of all the turns before it. Here the cache is held to `budget` slots per (layer, KV head)
throughout: each time it holds budget + `every` slots while decoding, and once per new turn
(add_turn), EVERY current slot is scored by the method's decode-phase form (its Scorer's
decode_hook / decode_scores: lookahead, snapkv, h2o, streaming) and the cache is gathered back to
the budget by the shared eviction step (Scorer.evict), the last `window` slots always kept.

    from extensions.decode import DecodeEviction
    evictor = DecodeEviction(make_scorer(EvictConfig("lookahead", 128), module), every=32)
    for tok in decode(model, cache, logits, pos, 512, hook=evictor.hook, after_step=evictor.after_step): ...
"""
import copy

import torch

from eviction import Pool, Prefilled, decode_step, keep_slots, prefill


class DecodeEviction:
    """Holds a cache to scorer.eviction.budget slots per (layer, KV head) after the prefill: decode(...,
    hook=this.hook, after_step=this.after_step) evicts each time the cache holds budget + `every` slots,
    and add_turn once per new turn. The last `window` slots, the most recent tokens, are always kept
    (inside the budget). Slots stay in position order, so the last slots stay the latest tokens, and
    positions never change: RoPE was applied before caching, so the next token is at S + t whatever
    was evicted. Written for batch size 1 and a cache without padding. every=None never evicts while
    decoding (the hook still watches: a chat's next turn is scored with what it saw). `log` gets
    (next position, slots before, slots after) per eviction."""

    def __init__(self, scorer, every=None, window=32):
        self.check(scorer, every, window)
        self.scorer = scorer
        scorer.window = window  # after the prefill, every method keeps the latest `window` slots
        if not isinstance(scorer.rule, Pool):  # a rule that watches the prefill (the span rule) has nothing to
            scorer.rule = Pool("none")  # watch for generated tokens: select unpooled
        self.budget, self.every, self.window = scorer.eviction.budget, every, window
        self.hook = scorer.decode_hook(window)  # watches every forward on the cache from now on
        self.log = []

    @staticmethod
    def check(scorer, every=None, window=32):
        """The checks that need no model: ValueError."""
        scorer.decode_hook(window)  # raises for a method without a decode-phase form
        if every is not None and every < 1:
            raise ValueError(f"evict every {every} tokens: must be at least 1, e.g. 32")
        budget, sinks = scorer.eviction.budget, scorer.sinks
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
        scores = self.scorer.decode_scores(model, cache, self.hook, next_pos)  # (L, B, H_kv, n)
        slots = torch.arange(n, device=scores.device).expand(scores.shape[1], n)  # (B, n): a slot's order
        run = Prefilled(cache, self.hook, None, slots, next_pos, None)
        kept = self.scorer.evict(scores, run, budget=self.budget if budget is None else budget)
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
    """One more conversation turn on top of a compressed cache. ids (1, T): the end of the previous
    answer, the next user message and the assistant's header, in the chat format (Tokenizer.next_turn);
    prefilled at positions next_pos .. next_pos+T-1 with the evictor's hook watching. Then every slot, old
    turns and the new one alike, is scored by the method's decode-phase form and the cache is evicted to
    `budget` (default: the evictor's; evictor None: FullKV, nothing evicted). Returns the first answer
    token's logits (1, V) and the next position (1,)."""
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
