"""
The steps every KV-eviction method shares: prefill -> score -> evict -> decode. Each (layer, KV
head) keeps C of the prompt's S KV slots; a method (a Scorer: lookaheadkv.py, baselines.py) says
what it adds to the prefill and how it scores what it saw. The rest is shared and lives here:

    cache, logits, next_pos, kept = compress(model, ids, scorer)
        1. prefill   the prompt (and the method's appended rows), chunk by chunk, its hook watching
        2. score     scorer.score(...) -> (L, B, H_kv, S)
        3. evict     smooth (Pool), protect (sinks, window), top C_l per (layer, KV head), gather
    decode(model, cache, logits, next_pos, n)  # positions go on from S whatever the cache holds
"""
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from model import Hook, Hooks, KVCache


@dataclass
class EvictConfig:
    method: str = "full"
    budget: int = 128  # C: KV slots kept per (layer, KV head), protected tokens included
    window: int = 32  # snapkv/pyramidkv/h2o/laq: the last `window` prompt tokens are always kept
    rule: object = None  # a Pool, a wrapping rule, or its text ("max:7"); None: the method's
    budgets: object = None  # (C, n_layers, S, least) -> slots per layer; None: default_budgets
    chunk_size: int = None  # prefill chunk length; None: the longest CHUNK_BYTES allows (max_chunk)
    options: dict = field(default_factory=dict)  # the method's own (its default_options only)


# -----------------------------------------------------------------------------
# 1. Attention over the prompt, computed explicitly for a few queries
def group_attention(q, k, key_valid=None, causal=True):
    """Softmax attention of q (B, H, Tq, D) over k (B, H_kv, Tk, D) without copying K for GQA;
    the queries sit at the last Tq key slots (causal) or after them all (causal=False). Returns
    float32 probabilities (B, H_kv, G*Tq, Tk): a KV head's G query heads stacked as rows."""
    (B, H, Tq, D), (Hkv, Tk) = q.shape, k.shape[1:3]
    G = H // Hkv
    qg = q.reshape(B, Hkv, G * Tq, D) / math.sqrt(D)  # (B, H_kv, G*Tq, D), scaled before Q K^T
    logits = (qg @ k.transpose(-1, -2)).float()  # (B, H_kv, G*Tq, Tk): float32, as HF's eager
    if causal:  # query t (row g*Tq + t) sits at slot Tk - Tq + t: only the last Tq keys follow it
        t = torch.arange(Tq, device=q.device)
        logits[..., Tk - Tq:].masked_fill_(t[None, :] > t.repeat(G)[:, None],  # (G*Tq, Tq)
                                           float("-inf"))
    if key_valid is None:
        return logits.softmax(dim=-1)
    logits.masked_fill_(~key_valid[:, :, None, :], float("-inf"))  # (B, 1|H_kv, 1, Tk)
    # with padding, a left-padding query may see no real key: its all -inf row is NaN, make it 0
    return logits.softmax(dim=-1).nan_to_num(nan=0.0)


def stack_layers(scores):
    """{layer: (B, H_kv, S)} -> (L, B, H_kv, S)."""
    return torch.stack([scores[l] for l in range(len(scores))])


# -----------------------------------------------------------------------------
# 2. From scores to kept slots: smoothing, the budget per layer, top C, one gather per layer
class Pool:
    """SnapKV's smoothing of scores (..., S) before the top C, so a kept token keeps its neighbours:
    "avg" (SnapKV's code, kernel 5, zero-padded, over the full width) or "max" (its LongBench
    configs, kernel 7) over a centred window, or "none". A protected window is not smoothed."""

    KINDS = ("none", "avg", "max")

    def __init__(self, kind="avg", kernel=5):
        if kind not in self.KINDS:
            raise ValueError(f"unknown pooling {kind!r}: use one of {', '.join(self.KINDS)}")
        if kind != "none" and (kernel < 1 or kernel % 2 == 0):
            raise ValueError(f"pooling width {kernel} must be odd and >= 1 (a window centred on "
                             "each token): use e.g. 1, 3, 5 or 7")
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


def uniform_budgets(budget, n_layers, S, least=1):
    """The papers' budget policy: C slots in every layer (all S when the prompt is shorter)."""
    return [min(budget, S)] * n_layers


def select(scores, budget, key_valid=None, protect=None):
    """Indices (..., B, H_kv, C) of the top `budget` scores (..., B, H_kv, S), in slot order;
    protect (B, 1, S) is kept whatever its score, padding (key_valid False) never preferred."""
    s = scores.float()
    if protect is not None:
        s = s.masked_fill(protect, float("inf"))
    if key_valid is not None:
        s = s.masked_fill(~key_valid, float("-inf"))
    return s.topk(min(budget, s.shape[-1]), dim=-1).indices.sort(dim=-1).values


def keep_slots(cache, kept):
    """Eviction itself: per layer, keep the slots `kept` (B, H_kv, C_l), in place."""
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
    """A KV-eviction method: what it adds to the prefill (`prefill_hook`, `appended_embeddings`:
    rows after the prompt, scored then discarded) and how it scores what it saw (`score`).
    `evict` is the shared step: smooth by the rule, protect, top C_l per (layer, KV head)."""

    evicts = True  # False: FullKV
    window = 0  # the last `window` prompt tokens are always kept (inside the budget)
    sinks = 0  # the first `sinks` tokens are always kept (inside the budget)
    budget_dependent = False  # True: the scores depend on C (they cannot serve other budgets)
    default_rule = Pool("avg", 5)  # unless EvictConfig.rule says otherwise
    default_options = {}  # the method's own options and defaults (EvictConfig.options overrides)

    def __init__(self, eviction, module=None, response=None):  # make_scorer checks the config
        self.eviction, self.options = eviction, {**self.default_options, **eviction.options}
        self.rule = eviction.rule if eviction.rule is not None else self.default_rule

    def prefill_hook(self, ids):  # a Hook watching the prefill of the prompt ids (B, S), or None
        return None

    def appended_embeddings(self):  # embeddings (M, hidden) to append after the prompt, or None
        return None

    def score(self, model, prefilled):  # (L, B, H_kv, S)
        raise NotImplementedError

    def protect(self, positions):
        """(B, 1, S) bool, kept whatever the score: the last `window`, first `sinks`; or None."""
        if not (self.window or self.sinks):
            return None
        S = positions.shape[1]
        return ((torch.arange(S, device=positions.device) >= S - self.window)
                | (positions < self.sinks))[:, None]

    def default_budgets(self, budget, n_layers, S, least):  # PyramidKV overrides it
        return uniform_budgets(budget, n_layers, S, least)

    def layer_budgets(self, n_layers, S):
        """Slots per layer, by EvictConfig.budgets if given, else by default_budgets."""
        policy = self.eviction.budgets or self.default_budgets
        return policy(self.eviction.budget, n_layers, S, least=self.window + self.sinks + 1)

    def evict(self, scores, prefilled, layer_budgets=None):
        """The shared step: scores (L, B, H_kv, S) -> per layer the kept slots (B, H_kv, C_l), in
        slot order; `prefilled` tells protected and padding. None budgets: self.layer_budgets."""
        L, S = scores.shape[0], scores.shape[-1]
        budgets = self.layer_budgets(L, S) if layer_budgets is None else layer_budgets
        scores = self.rule.smooth(scores, self.window)
        protect = self.protect(prefilled.positions)
        if len(set(budgets)) == 1:  # one top-k for all layers
            return list(select(scores, budgets[0], prefilled.valid, protect))
        return [select(scores[l], b, prefilled.valid, protect) for l, b in enumerate(budgets)]


# -----------------------------------------------------------------------------
# 4. prefill -> score -> evict -> return, then decode
CHUNK_BYTES = 1 << 30  # a chunk's activations at most: SmolLM2 fp32 ~30K tokens, Llama-8B bf16 ~7K


def max_chunk(cfg, x, pad_mask=None):
    """The longest prefill chunk whose activations fit CHUNK_BYTES. Why not a fixed 4,096: a chunk
    on a cache needs a bottom-right causal mask, which takes CPU SDPA off its fused causal kernel
    (1.4x slower per chunk); one call runs the fused kernel over the whole prompt, as transformers
    does. Per row: the MLP's three (T, intermediate) tensors, q/k/v and a few (T, hidden) copies;
    with padding also the chunk's (T, T_k) mask, bool and SDPA's float copy (T_k <= x's length)."""
    B, T = x.shape[:2]
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    per_row = x.element_size() * (3 * cfg.intermediate_size + 6 * cfg.hidden_size + qkv)
    if pad_mask is not None:
        per_row += 5 * T
    return max(1, CHUNK_BYTES // (B * per_row))


def prefill(model, x, positions, cache, pad_mask=None, hook=None, chunk_size=None, logits_at=-1,
            tail=0):
    """Run embeddings x (B, T, hidden) into `cache`, chunk by chunk (chunk_size None: max_chunk's,
    one call where memory allows). The LAST chunk is full, so window scorers find all their
    queries in it, and the last `tail` rows (appended embeddings) ride in it; a hook sees only it
    unless every_chunk. Returns the logits at row `logits_at`."""
    T, P = x.shape[1], x.shape[1] - tail  # all rows, the prompt's
    chunk_size = chunk_size or max_chunk(model.config, x, pad_mask)
    bounds = sorted({0, *range(P % chunk_size, P, chunk_size)}) + [T]
    hooks = hook.hooks if isinstance(hook, Hooks) else [hook]
    for a, b in zip(bounds[:-1], bounds[1:]):
        last = b == T
        watching = [h for h in hooks
                    if h is not None and (last or getattr(h, "every_chunk", False))]
        h = None if not watching else watching[0] if len(watching) == 1 else Hooks(*watching)
        out = model(inputs_embeds=x[:, a:b], positions=positions[:, a:b], cache=cache,
                    pad_mask=None if pad_mask is None else pad_mask[:, a:b], hook=h,
                    logits_at=(logits_at % T - a) if last else -1)
    return out


def left_pad(prompts, dev):
    """Token-id lists -> ids (B, S) with left padding, and pad_mask (B, S) True on real tokens."""
    S = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (S - len(p)) + p for p in prompts], device=dev)
    pad_mask = torch.tensor([[False] * (S - len(p)) + [True] * len(p) for p in prompts], device=dev)
    return ids, pad_mask


def prompt_positions(ids, pad_mask=None):
    """The prompt ids (B, S) -> each token's position (B, S) (left padding: a row's first real token
    is at 0), the first generated token's (B,) = S_b, and which slots hold a token (B, 1, S) or None."""
    B, S = ids.shape
    positions = torch.arange(S, device=ids.device).expand(B, S)
    if pad_mask is not None:
        positions = (pad_mask.long().cumsum(-1) - 1).clamp(min=0)
    valid = None if pad_mask is None else pad_mask[:, None, :]  # (B, 1, S)
    return positions, positions[:, -1] + 1, valid


def append_rows(x, positions, pad_mask, rows, next_pos):
    """rows (M, hidden) after the prompt's embeddings x (B, S, hidden), at positions next_pos (B,)
    onwards: (x (B, S+M, hidden), positions (B, S+M), pad_mask (B, S+M) or None)."""
    B, M = x.shape[0], rows.shape[0]
    x = torch.cat([x, rows.to(x.dtype).expand(B, -1, -1)], dim=1)
    positions = torch.cat([positions, next_pos[:, None] + torch.arange(M, device=x.device)], dim=1)
    pad_mask = None if pad_mask is None else torch.cat([pad_mask, pad_mask.new_ones(B, M)], dim=1)
    return x, positions, pad_mask


def prefill_and_score(model, ids, scorer, pad_mask=None, clock=None):
    """Steps 1 and 2 of compress: a Prefilled, the prompt cache and its scores (L, B, H_kv, S) or
    None if nothing is evicted. Scores do not depend on C (but LAQ's): one call serves every budget.
    A list of scorers shares ONE prefill: a Prefilled each, one cache (evict into copies)."""
    scorers = list(scorer) if isinstance(scorer, (list, tuple)) else [scorer]
    S = ids.shape[1]
    positions, next_pos, valid = prompt_positions(ids, pad_mask)  # (B, S), (B,), (B, 1, S)
    evicting = [s.evicts and S > s.eviction.budget for s in scorers]  # not when the prompt fits

    # 1. prefill, the scorer's hook watching; rows it appends (the lookahead rows, positions
    # S_b .. S_b+M-1) ride in the last chunk (other scorers' hooks would take them for prompt)
    hooks = [s.prefill_hook(ids) if e else None for s, e in zip(scorers, evicting)]
    appended = [a for s, e in zip(scorers, evicting)
                if e and (a := s.appended_embeddings()) is not None]
    if appended and len(scorers) > 1:
        raise ValueError("a scorer that adds rows after the prompt (one-pass lookahead) prefills "
                         "alone: use its two-pass form (options=dict(one_pass=False)) beside "
                         "other scorers")
    x, x_positions, x_mask = model.model.embed_tokens(ids), positions, pad_mask  # (B, S, hidden)
    if appended:
        x, x_positions, x_mask = append_rows(x, positions, pad_mask, appended[0], next_pos)
    chunk = max([scorers[0].eviction.chunk_size or max_chunk(model.config, x, x_mask)]
                + [s.window for s in scorers])  # the last chunk holds the window
    cache = KVCache(model.config.num_hidden_layers)
    watch = Hooks(*hooks) if len(hooks) > 1 else hooks[0]
    logits = prefill(model, x, x_positions, cache, x_mask, watch, chunk, logits_at=S - 1,
                     tail=x.shape[1] - S)
    cache.truncate(S)  # appended rows are scored, then discarded: never in the cache
    prefilled = [Prefilled(cache, h, logits[:, -1], positions, next_pos, valid) for h in hooks]
    if clock is not None:
        clock.mark()

    # 2. score: (L, B, H_kv, S), every layer at once (smoothing and top-k: a few launches in all)
    for p, s, e in zip(prefilled, scorers, evicting):
        if e:
            p.scores = s.score(model, p)
    return prefilled if isinstance(scorer, (list, tuple)) else prefilled[0]


class Stopwatch:
    """Time marks on the device's timeline: on CUDA, events in the stream, not synchronisations
    (scoring kernels' launch cost hides behind the prefill, as in a server); on CPU, wall time."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.marks = []

    def mark(self):
        if self.cuda:
            self.marks.append(torch.cuda.Event(enable_timing=True))
            self.marks[-1].record()
        else:
            self.marks.append(time.perf_counter())

    def ms(self, i, j):  # from mark i to mark j (waits for mark j on CUDA)
        if self.cuda:
            self.marks[j].synchronize()
            return self.marks[i].elapsed_time(self.marks[j])
        return (self.marks[j] - self.marks[i]) * 1e3


def compress(model, ids, scorer, pad_mask=None, clock=None):
    """Prefill the prompt ids (B, S) (pad_mask: False on left padding), evict to C slots per
    (layer, KV head): (cache, first-token logits (B, V), next positions (B,), kept: per layer the
    slots (B, H_kv, C_l), None if none evicted). clock (a Stopwatch): marked after each step."""
    # 1. prefill and 2. score
    prefilled = prefill_and_score(model, ids, scorer, pad_mask, clock)
    kept = None
    if prefilled.scores is not None:
        # 3. evict: smooth, top-k (per layer when budgets differ), one gather per layer
        kept = scorer.evict(prefilled.scores, prefilled)
        keep_slots(prefilled.cache, kept)
    if clock is not None:
        clock.mark()
    # 4. return the compact cache; the first token is decoded from the prefill's own logits
    return prefilled.cache, prefilled.logits, prefilled.next_pos, kept


def decode_step(model, cache, tokens, positions, hook=None):
    """Feed tokens (B,) at positions (B,) into the cache; the next token's logits (B, V)."""
    return model(tokens[:, None], positions=positions[:, None], cache=cache, hook=hook)[:, -1]


@torch.no_grad()
def decode(model, cache, logits, next_pos, max_new_tokens, stop_ids=(), pick=None, hook=None,
           after_step=None):
    """Yield token ids (B,) from first-token logits (B, V) on `cache`: greedy or pick(logits); a
    row that hit a stop token is fed it on. Positions go on from next_pos. hook watches each step;
    after_step(model, cache, next_pos) runs once a token is in the cache (decode-phase eviction)."""
    stop = torch.tensor(list(stop_ids) or [-1], device=logits.device)
    done = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    for t in range(max_new_tokens):
        tokens = logits.argmax(-1) if pick is None else pick(logits)  # (B,)
        tokens = torch.where(done, stop[0].clamp(min=0), tokens)
        yield tokens
        done |= torch.isin(tokens, stop)
        if t == max_new_tokens - 1 or done.all():
            return
        logits = decode_step(model, cache, tokens, next_pos + t, hook)
        if after_step is not None:
            after_step(model, cache, next_pos + t + 1)


@torch.no_grad()
def greedy(model, cache, logits, next_pos, max_new_tokens, stop_ids):
    """Greedy answers on `cache` (it grows), one id list per batch row, each ending at its stop
    token (kept: the end is part of the answer's future, and makes one of an empty answer)."""
    answers, done = [[] for _ in range(logits.shape[0])], [False] * logits.shape[0]
    for tokens in decode(model, cache, logits, next_pos, max_new_tokens, stop_ids):
        for b, t in enumerate(tokens.tolist()):
            if not done[b]:
                answers[b].append(t)
                done[b] = t in stop_ids
    return answers
