"""
Beyond the paper: a KV cache held to a budget after the prefill too.

The paper evicts once, after the prefill, and names what follows as its main limitation: a long
answer grows the cache again by one slot per token, and in a chat every turn is prefilled on top
of all the turns before it. Here the cache is held to `budget` slots per (layer, KV head)
throughout: each time it holds budget + `every` slots while decoding, and once per new turn
(add_turn), EVERY current slot is scored by the method's decode-phase form (FORMS, below: a hook that
watches every forward after the prefill, and the scores it gives a grown cache; streaming, snapkv, h2o,
lookahead) and the cache is gathered back to the budget by the shared eviction step (Scorer.evict),
the last `window` slots always kept. Nothing in the methods' own files knows of it.

    from extensions.decode import DecodeEviction
    evictor = DecodeEviction(make_scorer(EvictConfig("lookahead", 128), module), every=32)
    for tok in decode(model, cache, logits, pos, 512, hook=evictor.hook, after_step=evictor.after_step): ...
"""
import sys

if __name__ == "__main__":  # a library module, run by -m or by its path: said before any import can fail
    sys.exit("error: extensions.decode is not a script: "
             "it is generate.py's --decode-budget (and evaluate.py's --mode decode): import DecodeEviction from it")

import copy

import torch

from baselines import H2O, H2OHook, RecentQueries, SnapKV, StreamingLLM
from eviction import Prefilled, decode_step, group_attention, keep_slots, max_chunk, prefill, stack_layers
from lookaheadkv import LookaheadKV, lookahead_pass

# -----------------------------------------------------------------------------
# Each method's decode-phase form: the hook that watches every forward after the prefill (or None), and the
# scores (L, B, H_kv, n) of every slot of the grown cache from what it saw


class RunningH2O(H2OHook):
    """H2O's native decode-phase form: H2OHook's running sums of the attention each slot has received, over
    every forward watched since (decode steps, new turns), and how many queries saw each slot (x the group).
    Both travel with their slots when the cache is gathered; the score is their ratio, as in the prefill."""

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

    def gather(self, layer, idx):
        self.sums[layer] = self.sums[layer].gather(-1, idx)
        self.seen[layer] = self.seen[layer].gather(-1, idx)



def recency(scorer, model, cache, hook, next_pos):
    """StreamingLLM: slots stay in position order, so recency is the slot order again."""
    (B, Hkv, n), L = cache.k[0].shape[:3], len(cache.k)
    return torch.arange(n, device=cache.k[0].device).float().expand(L, B, Hkv, n)


def recent_queries_attention(scorer, model, cache, hook, next_pos):
    """SnapKV: the attention of the last `window` fed tokens' queries over every slot, mean over the GQA group."""
    return torch.stack([group_attention(hook.q[l], cache.k[l], cache.valid[l]).mean(dim=2) for l in range(len(cache.k))])


def running_h2o(scorer, model, cache, hook, next_pos):
    """H2O: the attention each slot received from every query since the prefill, per query that saw it."""
    return stack_layers({l: s / hook.seen[l] for l, s in hook.sums.items()})


def lookahead_rows(scorer, model, cache, hook, next_pos):
    """LookaheadKV: nothing new to watch; the M rows at the next positions on top of whatever the cache now
    holds (the two-pass form; their K/V go with the copy lookahead_pass runs them on)."""
    return stack_layers(lookahead_pass(model, scorer.module, cache, next_pos))


FORMS = {  # the scorer's class -> (the hook for a window, the scores); a class not here has no decode-phase form
    StreamingLLM: (lambda window: None, recency),
    SnapKV: (RecentQueries, recent_queries_attention),
    H2O: (lambda window: RunningH2O(), running_h2o),
    LookaheadKV: (lambda window: None, lookahead_rows),
}
DECODE_METHODS = ("streaming", "snapkv", "h2o", "lookahead")  # the methods.METHODS names of FORMS' classes


def unwrapped(scorer):
    """The method inside any wrappers (extensions/: a wrapper keeps the method it wraps as .scorer). A wrapper
    like the span rule watches the prefill for what it smooths with; generated tokens bring none of that, so
    after the prefill the method it wraps (built unpooled) holds the cache alone."""
    while hasattr(scorer, "scorer"):
        scorer = scorer.scorer
    return scorer


def form_of(scorer):
    """(hook maker, scores) of the scorer's own class (not a subclass: PyramidKV and LAQ are SnapKVs that
    have no decode-phase form of their own)."""
    if type(scorer) not in FORMS:
        raise ValueError(f"method {scorer.eviction.method} has no decode-phase form here")
    return FORMS[type(scorer)]


# -----------------------------------------------------------------------------
# The cache held to its budget


def check_flags(args, methods):
    """generate.py's --decode-budget and --turns (a chat evicts as this file does) against its other flags,
    before any file is read: ValueError. methods: the methods.METHODS table (a method's sinks)."""
    if args.decode_budget is not None and args.method not in DECODE_METHODS:
        raise ValueError(f"--decode-budget re-scores the cache while decoding, by a method's decode-phase form: "
                         f"use --method {', '.join(DECODE_METHODS)}")
    if args.turns is not None and args.method not in (*DECODE_METHODS, "full"):
        raise ValueError(f"a chat re-scores the whole cache at each turn, by a method's decode-phase form: "
                         f"use --method {', '.join(DECODE_METHODS)} or full")
    if args.decode_budget is not None and args.decode_budget < args.budget:
        raise ValueError(f"--decode-budget {args.decode_budget} is below --budget {args.budget}: the prompt's "
                         f"cache would not fit it; use --decode-budget >= --budget")
    if args.method in DECODE_METHODS:
        sinks = methods[args.method].default_options.get("n_sink", 0)  # StreamingLLM's, kept at every eviction
        check_budget(args.decode_budget or args.budget, args.window, sinks)


def check_budget(budget, window, sinks=0):
    """A decode budget must leave room to choose beyond the last `window` slots and the sinks: ValueError."""
    if budget <= window + sinks:
        kept = f"the last {window} slots" + (f" and {sinks} sinks" if sinks else "")
        raise ValueError(f"decode budget {budget} leaves no room to choose: it always keeps {kept}; "
                         f"use a budget > {window + sinks} or a smaller window")


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
        scorer = unwrapped(scorer)
        self.check(scorer, every, window)
        self.scorer = scorer
        scorer.window = window  # after the prefill, every method keeps the latest `window` slots
        self.budget, self.every, self.window = scorer.eviction.budget, every, window
        make_hook, self.scores = form_of(scorer)
        self.hook = make_hook(window)  # watches every forward on the cache from now on
        self.log = []

    @staticmethod
    def check(scorer, every=None, window=32):
        """The checks that need no model: ValueError."""
        scorer = unwrapped(scorer)
        form_of(scorer)  # raises for a method without a decode-phase form
        if every is not None and every < 1:
            raise ValueError(f"evict every {every} tokens: must be at least 1, e.g. 32")
        check_budget(scorer.eviction.budget, window, scorer.sinks)

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
        scores = self.scores(self.scorer, model, cache, self.hook, next_pos)  # (L, B, H_kv, n)
        # the eviction step reads positions only to protect the sinks (positions < sinks) and the window (the
        # last slots). Slots stay in position order and the sinks are always kept, so in every (layer, KV
        # head) the first `sinks` slots hold positions 0 .. sinks-1: the slot order protects what the
        # positions would (the cache has no padding: valid None)
        order = torch.arange(n, device=scores.device).expand(scores.shape[1], n)  # (B, n)
        prefilled = Prefilled(cache, self.hook, None, order, next_pos, None)  # what evict reads of it
        kept = self.scorer.evict(scores, prefilled, [self.budget if budget is None else budget] * len(scores))
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
def add_turn(model, cache, ids, next_pos, evictor=None, budget=None, chunk_size=None):
    """One more conversation turn on top of a compressed cache. ids (1, T): the end of the previous
    answer, the next user message and the assistant's header, in the chat format (Tokenizer.next_turn);
    prefilled at positions next_pos .. next_pos+T-1 with the evictor's hook watching. Then every slot, old
    turns and the new one alike, is scored by the method's decode-phase form and the cache is evicted to
    `budget` (default: the evictor's; evictor None: FullKV, nothing evicted). Returns the first answer
    token's logits (1, V) and the next position (1,)."""
    T = ids.shape[1]
    positions = next_pos[:, None] + torch.arange(T, device=ids.device)  # (1, T)
    hook = None if evictor is None else evictor.hook
    x = model.model.embed_tokens(ids)  # (1, T, hidden)
    # chunk_size None: as long as memory allows (max_chunk); the last chunk holds the whole window
    chunk = max(chunk_size or max_chunk(model.config, x), 0 if evictor is None else evictor.window)
    logits = prefill(model, x, positions, cache, hook=hook, chunk_size=chunk)[:, -1]
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
