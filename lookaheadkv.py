"""
LookaheadKV and the KV-eviction baselines it is compared with: one class per method.

The problem: after a prompt of S tokens is prefilled, keep only C KV slots per (layer, KV head)
and decode on that compact cache. Which C? The ones the *answer* will attend to. Every method
here answers that question the same four steps (`compress`):

    prefill  the prompt into a KV cache; a method may watch it (a Hook that sees the queries)
             or add rows after the prompt (LookaheadKV's M lookahead tokens);
    score    every prompt token per (layer, KV head): (L, B, H_kv, S);
    evict    pool the scores along the sequence, keep the top C per (layer, batch row, KV head)
             (protected tokens such as SnapKV's window count inside C), one gather per layer;
    return   the compact cache, the first token's logits and the next position (still S).

A method is a `Scorer`: what it adds to the prefill (`prefill_hook`, `extra_rows`) and how it
turns what it saw into scores (`score`), plus the tokens it always keeps and its per-layer
budgets. The table `SCORERS` maps a method name to its class; generate.py, evaluate.py,
train.py and bench.py all read it.

    full        FullKV: no eviction
    streaming   StreamingLLM: 4 sink tokens + the most recent ones
    random      RandomKV: random scores (a sanity floor)
    snapkv      SnapKV: attention of the last `window` prompt queries, pooled
    pyramidkv   PyramidKV: SnapKV's scores, per-layer budgets falling with depth (mean C)
    h2o         H2O: attention each key gets from ALL prompt queries, per query that sees it
    laq         LAQ: SnapKV-compress, draft 8 tokens, re-score the full cache with their queries
    oracle      Oracle: the true future (the full-cache answer's attention); needs that answer
    lookahead   LookaheadKV: M learned embeddings after the prompt, with a LoRA active only on
                their rows; their mean attention over the prompt is the score

LookaheadKV in equations (METHOD.md has the long form). With prompt hidden states X (S rows) and
the lookahead embeddings P (M rows, positions S .. S+M-1), every LoRA target W becomes
    [X; P] W + [0; P] (alpha / r) B A         (the delta on the lookahead rows only)
so the prompt rows, and hence the prompt's KV cache, are exactly the frozen model's. The score of
prompt token j in layer l and KV head h is
    s[j] = mean over the M lookahead queries i and the G query heads g of that KV head of
           softmax_j(q_{i,g} . k_j / sqrt(d))
and the lookahead rows' own keys and values are dropped after scoring. Training (train.py) fits
P and the LoRA so that s matches the attention the model's real answer pays to the prompt:
    loss = KL(s_gt / |s_gt|_1 || s / |s|_1), averaged over layers and query heads.

    from model import load_model, Tokenizer
    from lookaheadkv import EvictConfig, compress, decode
    cache, logits, pos, stats = compress(model, ids, EvictConfig("snapkv", budget=128))
    for tok in decode(model, cache, logits, pos, 64): ...

Beyond the paper, DecodeEviction and add_turn hold the cache to a budget after the prefill too: while a
long answer grows it (decode(..., evict=)) and at each new turn of a chat, re-scoring every slot with the
method's decode-phase form (streaming, snapkv, h2o and lookahead: its M rows on top of the current cache).

No S x S attention matrix is ever built here: scores need only (queries x S) per layer.
Library errors are exceptions (ValueError, FileNotFoundError); the scripts turn them into one line.
"""

import copy
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import Hook, KVCache


@dataclass
class EvictConfig:
    method: str = "full"
    budget: int = 128  # C: KV slots kept per (layer, KV head), protected tokens included
    window: int = 32  # snapkv/pyramidkv/h2o/laq: the last `window` prompt tokens are always kept
    pool: str | None = None  # smoothing before top-k: "avg", "max", "none"; None = the method's own
    kernel: int | None = None  # pooling width, odd; None = the method's own (avg 5; lookahead: its adapter's)
    n_sink: int = 4  # streaming: first tokens always kept (attention sinks)
    laq_tokens: int = 8  # laq: draft length, and the number of last prompt queries added to it
    pyramid_beta: int = 20  # pyramidkv: last layer's budget = first layer's / ~beta (kvpress)
    one_pass: bool = True  # lookahead: append the M rows to the prefill (fast) or a 2nd pass (reference)
    chunk_size: int = 4096  # prefill in chunks of this many tokens (bounded activations at 32K)
    seed: int = 0  # random


# -----------------------------------------------------------------------------
# Attention over the prompt, computed explicitly for a few queries


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
    qg = q.reshape(B, Hkv, G * Tq, D)  # (B, H_kv, G*Tq, D), a view when q is contiguous
    logits = (qg @ k.transpose(-1, -2)).float() / math.sqrt(D)  # (B, H_kv, G*Tq, Tk)
    mask = torch.ones(1, Tk, dtype=torch.bool, device=q.device)
    if causal:
        q_slot = torch.arange(Tk - Tq, Tk, device=q.device).repeat(G)[:, None]  # row r is query r % Tq
        mask = torch.arange(Tk, device=q.device)[None, :] <= q_slot  # bottom-right aligned
    if key_valid is not None:
        mask = mask & key_valid[:, :, None, :]  # (B, 1|H_kv, G*Tq, Tk)
    probs = logits.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    blind = None if key_valid is None else ~mask.any(dim=-1, keepdim=True)  # queries that see no key
    if blind is None or not blind.any():
        return probs
    # with padding, a left-padding query sees no real key: its all -inf row is NaN, make it 0
    return probs.masked_fill(blind, 0.0)


class WindowHook(Hook):
    """Mean attention of the chunk's last `n` queries over the first S keys, per layer and KV head.
    SnapKV (the last prompt queries), the oracle (the answer's queries) and the lookahead tokens
    all score this way; they differ in which queries they use."""

    def __init__(self, n, S, keep_queries=0, per_query_head=False):
        self.n, self.S, self.keep_queries, self.per_query_head = n, S, keep_queries, per_query_head
        self.scores, self.queries = {}, {}

    def attn(self, layer, q, k, key_valid):
        probs = group_attention(q[:, :, -self.n:], k, key_valid)[..., : self.S]  # (B, H_kv, G*n, S)
        if self.per_query_head:  # training: one distribution per query head, (B, H, S)
            B, Hkv, _, S = probs.shape
            self.scores[layer] = probs.view(B, Hkv, -1, self.n, S).mean(dim=3).flatten(1, 2)
        else:  # eviction: mean over the GQA group and the queries, (B, H_kv, S)
            self.scores[layer] = probs.mean(dim=2)
        if self.keep_queries:  # laq re-scores with the last prompt queries too
            self.queries[layer] = q[:, :, -self.keep_queries:]


class H2OHook(Hook):
    """H2O's prefill score: attention each key receives from ALL prompt queries, summed, then
    divided by how many queries can see it (else early tokens win by position alone).
    Queries are processed `rows` at a time, so memory is O(rows x S), never S x S."""

    every_chunk = True  # with chunked prefill, every chunk's queries count

    def __init__(self, rows=256):
        self.rows, self.sums = rows, {}

    def attn(self, layer, q, k, key_valid):
        Tq, Tk = q.shape[2], k.shape[2]
        total = torch.zeros(k.shape[0], k.shape[1], Tk, device=k.device)  # (B, H_kv, Tk)
        for i in range(0, Tq, self.rows):
            j = min(i + self.rows, Tq)
            # keys the sub-chunk's queries see: up to slot Tk - Tq + j
            seen = Tk - Tq + j
            probs = group_attention(q[:, :, i:j], k[:, :, :seen], None if key_valid is None else key_valid[..., :seen])
            total[..., : Tk - Tq + j] += probs.sum(dim=2)
        prev = self.sums.get(layer)
        if prev is not None:  # an earlier prefill chunk: its keys are a prefix of these
            total[..., : prev.shape[-1]] += prev
        self.sums[layer] = total

    def scores(self, key_valid, G):
        S = next(iter(self.sums.values())).shape[-1]
        valid = torch.ones(1, 1, S, device=self.sums[0].device) if key_valid is None else key_valid.float()
        seen_by = valid.flip(-1).cumsum(-1).flip(-1) * G  # real queries at or after each slot, x group
        return {l: s / seen_by.clamp(min=1) for l, s in self.sums.items()}


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


# -----------------------------------------------------------------------------
# The lookahead module: M embeddings + a LoRA that is active on their rows only


class LookaheadModule(nn.Module):
    """M learnable lookahead embeddings P and, per layer and target projection, a LoRA
    W' = W + (alpha / r) B A applied ONLY to the lookahead rows:
        Q = [X; P] Wq + [0; P] dWq   (and the same for every other target)
    The base model is frozen and never sees the LoRA on prompt rows, so the prompt's KV cache
    is exactly the base model's. targets=() keeps the embeddings alone (an ablation: what the
    LoRA adds on top of M learned "future" tokens)."""

    TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def __init__(self, cfg, n_tokens=32, rank=8, alpha=32, targets=("q_proj", "k_proj"), embed_std=0.02,
                 pool="avg", kernel=5, window=0):
        check_pooling(pool, kernel)
        super().__init__()
        bad = [t for t in targets if t not in self.TARGETS]
        if bad:
            raise ValueError(f"unknown LoRA targets {bad}; choose from {', '.join(self.TARGETS)}")
        self.cfg, self.n_tokens, self.rank, self.alpha, self.targets = cfg, n_tokens, rank, alpha, tuple(targets)
        self.pool, self.kernel = pool, kernel  # the scoring options it ships with
        self.window = window  # the last `window` prompt tokens kept whatever their score (0: none)
        self.info = {}  # training metadata, saved with the adapter
        # random init with the scale of real token embeddings: untrained, they already act as
        # generic queries from "somewhere after the prompt", a strong baseline of their own
        self.embeddings = nn.Parameter(torch.randn(n_tokens, cfg.hidden_size) * embed_std)
        H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        dims = dict(q_proj=(hidden, H * D), k_proj=(hidden, Hkv * D), v_proj=(hidden, Hkv * D),
                    o_proj=(H * D, hidden), gate_proj=(hidden, inter), up_proj=(hidden, inter),
                    down_proj=(inter, hidden))
        self.lora = nn.ModuleList()
        for _ in range(cfg.num_hidden_layers):
            p = nn.ParameterDict()
            for t in self.targets:
                d_in, d_out = dims[t]
                # as in LoRA: A random, B zero, so training starts from the base model's projections
                p[t + "_A"] = nn.Parameter(torch.empty(rank, d_in).uniform_(-1, 1) / math.sqrt(d_in))
                p[t + "_B"] = nn.Parameter(torch.zeros(d_out, rank))
            self.lora.append(p)

    def delta(self, layer, name, x):
        """The LoRA term for rows x (B, M, in) -> (B, M, out), or None if `name` is no target."""
        if name not in self.targets:
            return None
        p = self.lora[layer]
        A, B = p[name + "_A"].to(x.dtype), p[name + "_B"].to(x.dtype)
        return (x @ A.T) @ B.T * (self.alpha / self.rank)

    def metadata(self):
        return dict(base_model=self.cfg.name, base_fingerprint=self.cfg.fingerprint(), n_tokens=self.n_tokens,
                    rank=self.rank, alpha=self.alpha, targets=list(self.targets), pool=self.pool,
                    kernel=self.kernel, window=self.window, **self.info)

    def save(self, path):
        """path.safetensors + path.json (metadata)."""
        from safetensors.torch import save_file

        path = Path(path)
        save_file({k: v.detach().float().contiguous().cpu() for k, v in self.state_dict().items()}, str(path))
        path.with_suffix(".json").write_text(json.dumps(self.metadata(), indent=2) + "\n")

    @classmethod
    def load(cls, path, cfg, device="cpu"):
        from safetensors.torch import load_file

        path = Path(path)
        meta_file = path.with_suffix(".json")
        if not path.exists() or not meta_file.exists():
            raise FileNotFoundError(f"adapter {path} (and its .json) not found: train one with python train.py")
        try:
            meta = json.loads(meta_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"adapter metadata {meta_file} is not valid JSON ({e.msg}): retrain the adapter")
        if meta.get("base_fingerprint") != cfg.fingerprint():
            raise ValueError(f"adapter {path.name} was trained for {meta.get('base_model')!r} "
                             f"(fingerprint {meta.get('base_fingerprint')}), not for this model "
                             f"{cfg.name!r} ({cfg.fingerprint()}): train one for it with python train.py")
        m = cls(cfg, meta["n_tokens"], meta["rank"], meta["alpha"], meta["targets"], pool=meta.get("pool", "avg"),
                kernel=meta.get("kernel", 5), window=meta.get("window", 0))
        m.info = {k: v for k, v in meta.items() if k not in m.metadata()}
        try:
            m.load_state_dict(load_file(str(path)))
        except Exception as e:
            raise ValueError(f"adapter {path} is corrupt or incomplete ({str(e).splitlines()[0]}): retrain it")
        return m.to(device)


def default_adapter_path(cfg):
    return Path(__file__).parent / "weights" / f"{cfg.name}.lookahead.safetensors"


class LookaheadHook(WindowHook):
    """Run inside the forward that contains the lookahead rows (the LAST M rows of the chunk):
    adds their LoRA delta and scores the prompt with their attention."""

    def __init__(self, module, S, per_query_head=False):
        super().__init__(module.n_tokens, S, per_query_head=per_query_head)
        self.module = module

    def lora(self, layer, name, x):
        # only the last M rows get a delta: model.project adds it to those rows alone
        return self.module.delta(layer, name, x[:, -self.n:])


def lookahead_pass(model, module, cache, next_pos, per_query_head=False):
    """The two-pass form: the M lookahead tokens at positions next_pos .. next_pos+M-1 (an int S,
    or each row's (B,) prompt length) on top of the prompt cache, LoRA on; the cache itself is
    left as it was. Returns their scores over the len(cache) prompt slots, per layer. Under
    autograd, gradients reach only the module (the cache was made without them)."""
    B, M, dev = cache.k[0].shape[0], module.n_tokens, cache.k[0].device
    positions = torch.as_tensor(next_pos, device=dev).reshape(-1, 1) + torch.arange(M, device=dev)  # (B|1, M)
    emb = module.embeddings.to(cache.k[0].dtype).expand(B, -1, -1)  # (B, M, hidden)
    hook = LookaheadHook(module, len(cache), per_query_head)
    model(inputs_embeds=emb, positions=positions.expand(B, M), cache=cache.copy(), hook=hook, logits_at=-1)
    return hook.scores


# -----------------------------------------------------------------------------
# Turning scores into kept slots: pooling, top-C, per-layer budgets


def check_pooling(pool, kernel):
    if pool not in ("avg", "max", "none"):
        raise ValueError(f"unknown pooling {pool!r}: use avg, max or none")
    if pool != "none" and (kernel < 1 or kernel % 2 == 0):
        raise ValueError(f"pooling width {kernel} must be odd and >= 1 (a window centred on each token): "
                         "use e.g. 1, 3, 5 or 7")


def pool_scores(s, pool, kernel, window=0):
    """Smooth scores (..., S) along the sequence, as SnapKV does: a token next to an important
    one is kept too, which keeps whole phrases (every digit of a number) rather than scattered
    tokens. With a protected window (kept anyway), only the prefix before it is pooled, as in
    SnapKV's code, so the window's large scores do not leak into the tokens before it.
    Edges: avg pads with zeros and divides by the full width (the first and last kernel // 2
    tokens of the pooled span are damped a little); max ignores the padding."""
    if pool == "none" or kernel == 1:
        return s
    S = s.shape[-1]
    n = S - window  # the pooled prefix
    fn = F.avg_pool1d if pool == "avg" else F.max_pool1d
    x = s[..., :n].reshape(-1, 1, n)  # (rows, 1, n)
    pooled = fn(x, kernel, stride=1, padding=kernel // 2).reshape(*s.shape[:-1], n)
    return torch.cat([pooled, s[..., n:]], dim=-1) if window else pooled


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


def pyramid_budgets(budget, window, n_layers, beta, S=None):
    """PyramidKV: budgets fall linearly from the first layer to the last, mean over layers = C.
    A layer cannot keep more than the S prompt tokens: what a clipped layer cannot use goes
    to the other layers, evenly, so the mean stays C (while C <= S)."""
    if n_layers == 1:
        return [budget]
    avail = budget - window
    lo = avail // beta
    hi = 2 * avail - lo
    b = [window + round(hi - l * (hi - lo) / max(n_layers - 1, 1)) for l in range(n_layers)]
    if S is None:
        return b
    spare = sum(max(x - S, 0) for x in b)
    b = [min(x, S) for x in b]
    while spare > 0 and any(x < S for x in b):
        room = [l for l in range(n_layers) if b[l] < S]
        share, extra = divmod(spare, len(room))
        for i, l in enumerate(room):
            b[l] += share + (i < extra)
        spare = sum(max(x - S, 0) for x in b)
        b = [min(x, S) for x in b]
    return b


# -----------------------------------------------------------------------------
# The methods: one Scorer each


@dataclass
class Prefilled:
    """What a scorer may read once the prompt is prefilled."""

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
    turns what it saw into scores (`score`: (L, B, H_kv, S), higher = keep). `protect` and
    `budgets` say which tokens it always keeps and how many slots each layer gets; `evict` is the
    step every method shares: pool, top-C, in slot order. Subclasses only say how they score."""

    evicts = True  # False: FullKV
    window = 0  # the last `window` prompt tokens are always kept (inside the budget)
    sinks = 0  # the first `sinks` tokens are always kept (inside the budget)
    pooled = True  # smooth the scores before top-k (see pool_scores)
    budget_dependent = False  # True: the scores themselves depend on C (they cannot serve other budgets)
    default_pool = ("avg", 5)

    def __init__(self, eviction, module=None, response=None):
        self.eviction = eviction
        self.pool = eviction.pool if eviction.pool is not None else self.default_pool[0]
        self.kernel = eviction.kernel if eviction.kernel is not None else self.default_pool[1]
        if not self.pooled:
            self.pool, self.kernel = "none", 1
        if eviction.budget < 1:
            raise ValueError(f"budget {eviction.budget} must be at least 1 KV slot per (layer, KV head)")
        check_pooling(self.pool, self.kernel)
        if self.evicts and eviction.budget < self.window + self.sinks + 1:
            kept = f"the last {self.window} tokens" if self.window else f"{self.sinks} sink tokens"
            smaller = " or a smaller window" if self.window else ""
            raise ValueError(f"budget {eviction.budget} is too small for {eviction.method}: it always keeps {kept}; "
                             f"use a budget > {self.window + self.sinks}{smaller}")

    def prefill_hook(self, S):  # a Hook watching the prefill's last chunk, or None
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

    def budgets(self, n_layers, S):
        return [min(self.eviction.budget, S)] * n_layers

    def evict(self, scores, positions, valid=None):
        """The shared step: scores (L, B, H_kv, S) -> per layer the kept slots (B, H_kv, C_l)."""
        scores = pool_scores(scores, self.pool, self.kernel, self.window)
        protect = self.protect(positions)
        budgets = self.budgets(scores.shape[0], scores.shape[-1])
        if len(set(budgets)) == 1:  # one top-k for all layers
            return list(select(scores, budgets[0], valid, protect))
        return [select(scores[l], b, valid, protect) for l, b in enumerate(budgets)]

    # beyond the paper, the decode-phase form (DecodeEviction): what watches the forwards after the
    # prefill, and the scores of every slot of a cache that decoding (or a new turn) has grown
    def decode_hook(self):
        return None

    def decode_scores(self, model, cache, hook, next_pos):  # (L, B, H_kv, n) for the n slots of `cache`
        raise ValueError(f"method {self.eviction.method} has no decode-phase form here: "
                         f"use one of {', '.join(DECODE_METHODS)}")


def stack(scores):
    """{layer: (B, H_kv, S)} -> (L, B, H_kv, S)."""
    return torch.stack([scores[l] for l in range(len(scores))])


class FullKV(Scorer):
    """No eviction: the reference every method is measured against."""

    evicts = False


class StreamingLLM(Scorer):
    """StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks",
    arXiv 2309.17453): keep the first n_sink tokens, which soak up attention whatever they say,
    and the most recent C - n_sink. No attention is looked at."""

    pooled = False

    def __init__(self, eviction, module=None, response=None):
        self.sinks = eviction.n_sink
        super().__init__(eviction)

    def score(self, model, run):
        S, L, Hkv = run.positions.shape[1], len(run.cache.k), run.cache.k[0].shape[1]
        slot = torch.arange(S, device=run.positions.device).float()
        return slot.expand(L, run.positions.shape[0], Hkv, S)  # recency

    def decode_scores(self, model, cache, hook, next_pos):  # slots stay in position order: recency again
        (B, Hkv, n), L = cache.k[0].shape[:3], len(cache.k)
        return torch.arange(n, device=cache.k[0].device).float().expand(L, B, Hkv, n)


class RandomKV(Scorer):
    """Random scores: the floor any method must beat."""

    pooled = False

    def score(self, model, run):
        (B, S), L, Hkv = run.positions.shape, len(run.cache.k), run.cache.k[0].shape[1]
        g = torch.Generator(device="cpu").manual_seed(self.eviction.seed)
        return torch.rand(L, B, Hkv, S, generator=g).to(run.positions.device)


class SnapKV(Scorer):
    """SnapKV (Li et al., "SnapKV: LLM Knows What You Are Looking for Before Generation", arXiv
    2404.14469): the last `window` prompt tokens play the answer; their mean attention over the
    prompt (softmax over all keys, causal inside the window, mean over the GQA group) is the
    score, pooled along the prefix; the window itself is always kept, inside C."""

    def __init__(self, eviction, module=None, response=None):
        self.window = eviction.window
        super().__init__(eviction)

    def prefill_hook(self, S):
        return WindowHook(self.window, S)

    def score(self, model, run):
        return stack(run.hook.scores)

    def decode_hook(self):
        return RecentQueries(self.window)

    def decode_scores(self, model, cache, hook, next_pos):
        # the last `window` tokens' queries (the latest generated ones, or a new turn's last ones) over every
        # slot; those tokens are the last slots (the window is always kept), so causal alignment holds
        return torch.stack([group_attention(hook.q[l], cache.k[l], cache.valid[l]).mean(dim=2)
                            for l in range(len(cache.k))])


class PyramidKV(SnapKV):
    """PyramidKV (Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
    Information Funneling", arXiv 2406.02069): SnapKV's scores, but early layers (broad attention)
    get more slots than late ones (focused attention): budgets fall linearly, mean C."""

    def budgets(self, n_layers, S):
        return pyramid_budgets(self.eviction.budget, self.window, n_layers, self.eviction.pyramid_beta, S)


class H2O(Scorer):
    """H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
    Language Models", arXiv 2306.14048), prefill form: the attention each key receives from ALL
    prompt queries, divided by how many queries can see it (else early tokens win by position
    alone). Computed in blocks of query rows inside the prefill: never an S x S matrix. Like
    SnapKV it keeps the last `window` tokens."""

    def __init__(self, eviction, module=None, response=None):
        self.window = eviction.window
        super().__init__(eviction)

    def prefill_hook(self, S):
        return H2OHook()

    def score(self, model, run):
        cfg = model.config
        return stack(run.hook.scores(run.valid, cfg.num_attention_heads // cfg.num_key_value_heads))

    def decode_hook(self):
        return RunningH2O()

    def decode_scores(self, model, cache, hook, next_pos):
        return stack(hook.per_query_scores())


class LAQ(SnapKV):
    """LAQ (Lookahead Q-Cache, arXiv 2505.20334): a pseudo future from a real draft. Compress
    with SnapKV, greedily draft `laq_tokens` tokens on that small cache, then score the FULL
    prompt cache with the draft's queries plus the last `laq_tokens` prompt queries; pool and
    keep the top C (window kept). Decoding starts from the original first-token logits."""

    budget_dependent = True  # the draft runs on the SnapKV-compressed cache of size C

    def prefill_hook(self, S):
        return WindowHook(self.window, S, keep_queries=self.eviction.laq_tokens)

    def score(self, model, run):
        draft_cache = run.cache.copy()  # shallow: gathering in it leaves the full cache alone
        for l, idx in enumerate(self.evict(stack(run.hook.scores), run.positions, run.valid)):
            draft_cache.gather(l, idx)
        return stack(laq_scores(model, run.cache, draft_cache, run.logits, run.next_pos, run.hook.queries,
                                self.eviction.laq_tokens, run.valid))


class Oracle(Scorer):
    """The true future: the full-cache greedy answer (B, R) run on top of the prompt cache; the
    mean attention of its R queries over the prompt. It needs the whole answer first, so it is a
    ceiling, not a method; unpooled (the exact top C of the truth)."""

    pooled = False

    def __init__(self, eviction, module=None, response=None):
        if response is None:
            raise ValueError("method oracle needs the full-cache answer first (response=...)")
        self.response = response
        super().__init__(eviction)

    def score(self, model, run):
        return stack(oracle_scores(model, run.cache, self.response, run.next_pos))


class LookaheadKV(Scorer):
    """LookaheadKV (arXiv 2603.10899): M learned embeddings after the prompt, at positions
    S .. S+M-1, with a LoRA on their rows only (LookaheadModule). Their mean attention over the
    prompt predicts the answer's. One-pass (default): the rows ride in the prefill's last chunk
    and their K/V are cut off after scoring; two-pass: a second forward of the M rows on top of
    the prompt cache (the training form). Both give the same scores (causal attention, LoRA on
    the lookahead rows only). Pooled, and with a protected window of recent tokens or none, as its
    adapter says (module.pool, .kernel, .window; the shipped one: none, its queries see the end)."""

    def __init__(self, eviction, module=None, response=None):
        if module is None:
            raise ValueError("method lookahead needs an adapter (a LookaheadModule): train one with python "
                             "train.py, or pass --adapter")
        self.module = module
        self.default_pool = (module.pool, module.kernel)
        self.window = module.window
        super().__init__(eviction)

    def prefill_hook(self, S):
        return LookaheadHook(self.module, S) if self.eviction.one_pass else None

    def extra_rows(self):
        return self.module.embeddings if self.eviction.one_pass else None

    def score(self, model, run):
        if self.eviction.one_pass:
            return stack(run.hook.scores)
        return stack(lookahead_pass(model, self.module, run.cache, run.next_pos))

    def decode_scores(self, model, cache, hook, next_pos):
        # nothing new: the M rows at the next positions on top of whatever the cache now holds (LoRA on),
        # their mean attention over its slots; their K/V go with the copy lookahead_pass runs them on
        return stack(lookahead_pass(model, self.module, cache, next_pos))


SCORERS = {"full": FullKV, "streaming": StreamingLLM, "random": RandomKV, "snapkv": SnapKV, "pyramidkv": PyramidKV,
           "h2o": H2O, "laq": LAQ, "oracle": Oracle, "lookahead": LookaheadKV}
METHODS = tuple(SCORERS)


def make_scorer(eviction, module=None, response=None):
    """The Scorer for eviction.method; it checks its inputs and the budget (ValueError)."""
    if eviction.method not in SCORERS:
        raise ValueError(f"unknown method {eviction.method!r}; choose from {', '.join(METHODS)}")
    return SCORERS[eviction.method](eviction, module=module, response=response)


# -----------------------------------------------------------------------------
# prefill -> score -> evict -> return


class Stopwatch:
    """Time marks on the device's own timeline. On CUDA they are events recorded in the stream, not
    synchronisations: the CPU keeps queueing the scoring kernels while the GPU still runs the
    prefill, so their launch cost hides behind it, as it would in a server. On CPU, wall time."""

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


def prefill(model, x, positions, cache, pad_mask=None, hook=None, chunk_size=4096, logits_at=-1, tail=0):
    """Run embeddings x (B, T, C) through the model into `cache`, chunk by chunk so a 32K prompt's
    activations stay bounded. The LAST chunk is a full one (the first takes the remainder), so
    window scorers find all their queries in it; the last `tail` rows (the lookahead rows) ride
    along with it, so the prompt is chunked exactly as without them. The hook sees only the last
    chunk unless it says every_chunk. Returns the logits at row `logits_at` (B, 1, V)."""
    T = x.shape[1]
    P = T - tail  # the prompt
    bounds = sorted({0, *range(P % chunk_size, P, chunk_size)}) + [T]
    for a, b in zip(bounds[:-1], bounds[1:]):
        last = b == T
        h = hook if (last or getattr(hook, "every_chunk", False)) else None
        out = model(inputs_embeds=x[:, a:b], positions=positions[:, a:b], cache=cache,
                    pad_mask=None if pad_mask is None else pad_mask[:, a:b], hook=h,
                    logits_at=(logits_at % T - a) if last else -1)
    return out


def compress(model, ids, eviction, pad_mask=None, module=None, response=None):
    """Prefill the prompt ids (B, S) and evict its cache down to eviction.budget slots per (layer, KV head).

    module: the LookaheadModule (method "lookahead"); response: the full-cache greedy answer
    (B, R) ids (method "oracle"). Returns (cache, first-token logits (B, V), next positions (B,),
    stats) where stats has prefill_ms, score_ms, kept (per layer, the kept slots (B, H_kv, C_l);
    None when nothing was evicted) and keep_frac (S,): per prompt token of row 0, the fraction
    of (layer, KV head) pairs that kept it."""
    # 1. prefill and 2. score
    scorer, run, clock = prefill_and_score(model, ids, eviction, pad_mask, module, response)
    stats = dict(prefill_ms=clock.ms(0, 1), score_ms=0.0, keep_frac=None, kept=None)
    if run.scores is None:  # nothing to evict
        return run.cache, run.logits, run.next_pos, stats
    # 3. evict: pool, one top-k for all layers (per layer when budgets differ), one gather per layer
    kept = scorer.evict(run.scores, run.positions, run.valid)
    for l, idx in enumerate(kept):
        run.cache.gather(l, idx)
    clock.mark()
    # 4. return the compact cache, what was kept, and how long it took
    stats["prefill_ms"], stats["score_ms"], stats["kept"] = clock.ms(0, 1), clock.ms(1, 2), kept
    L, Hkv, S = model.config.num_hidden_layers, model.config.num_key_value_heads, ids.shape[1]
    keep_count = torch.bincount(torch.cat([k[0].flatten() for k in kept]), minlength=S)  # row 0, (S,)
    stats["keep_frac"] = (keep_count / (L * Hkv)).cpu()
    return run.cache, run.logits, run.next_pos, stats


def prefill_and_score(model, ids, eviction, pad_mask=None, module=None, response=None):
    """Steps 1 and 2 of compress: returns (scorer, run, clock), run a Prefilled with the full prompt
    cache and run.scores (L, B, H_kv, S), or None when there is nothing to evict (S <= C, full).
    Scores do not depend on the budget (except LAQ's), so one call serves every budget."""
    scorer = make_scorer(eviction, module, response)  # checks the method's inputs and the budget
    cfg, dev = model.config, ids.device
    B, S = ids.shape
    positions = torch.arange(S, device=dev).expand(B, S)
    if pad_mask is not None:  # left padding: each row's first real token is at position 0
        positions = (pad_mask.long().cumsum(-1) - 1).clamp(min=0)
    valid = None if pad_mask is None else pad_mask[:, None, :]  # (B, 1, S)
    next_pos = positions[:, -1] + 1  # (B,) the position of the first generated token, = S_b
    evicting = scorer.evicts and S > eviction.budget  # nothing to evict when the whole prompt fits

    # 1. prefill; the scorer may watch it (hook) and add rows after the prompt (the lookahead rows,
    # at positions S_b .. S_b+M-1, riding in the last chunk)
    x = model.model.embed_tokens(ids)  # (B, S, hidden)
    hook, rows = (scorer.prefill_hook(S), scorer.extra_rows()) if evicting else (None, None)
    x_all, pos_all, mask_all = x, positions, pad_mask
    if rows is not None:
        M = rows.shape[0]
        x_all = torch.cat([x, rows.to(x.dtype).expand(B, -1, -1)], dim=1)  # (B, S+M, hidden)
        pos_all = torch.cat([positions, next_pos[:, None] + torch.arange(M, device=dev)], dim=1)
        mask_all = None if pad_mask is None else torch.cat([pad_mask, pad_mask.new_ones(B, M)], dim=1)
    chunk = max(eviction.chunk_size, scorer.window)  # a hook sees the last chunk only: it holds the whole window
    cache, clock = KVCache(cfg.num_hidden_layers), Stopwatch(dev)
    clock.mark()
    logits = prefill(model, x_all, pos_all, cache, mask_all, hook, chunk, logits_at=S - 1, tail=x_all.shape[1] - S)
    cache.truncate(S)  # rows after the prompt are scored, then discarded: never in the cache
    clock.mark()
    run = Prefilled(cache, hook, logits[:, -1], positions, next_pos, valid)

    # 2. score: (L, B, H_kv, S), every layer at once, so pooling and top-k are a few launches in all
    if evicting:
        run.scores = scorer.score(model, run)
    return scorer, run, clock


@torch.no_grad()
def oracle_scores(model, cache, response, next_pos):
    """The true future attention: the full-cache answer (B, R) run on top of the prompt cache;
    mean attention of its R queries over the S prompt keys, per layer and KV head."""
    S, R = len(cache), response.shape[1]
    hook = WindowHook(R, S)
    positions = next_pos[:, None] + torch.arange(R, device=response.device)
    model(response, positions=positions, cache=cache, hook=hook, logits_at=-1)
    cache.truncate(S)
    return hook.scores


@torch.no_grad()
def laq_scores(model, cache, draft_cache, logits, next_pos, window_q, n, valid):
    """LAQ: greedily draft n tokens on the compressed cache, keep the drafted tokens' queries,
    then score the FULL prompt cache with them plus the last n prompt queries (window_q)."""
    S = len(cache)
    recorder = QueryRecorder()
    tok = logits.argmax(-1)  # (B,)
    for t in range(n):
        out = model(tok[:, None], positions=(next_pos + t)[:, None], cache=draft_cache, hook=recorder)
        tok = out[:, -1].argmax(-1)
    scores = {}
    for l in range(len(cache.k)):
        k = cache.k[l][:, :, :S]
        draft_q = torch.cat(recorder.q[l], dim=2)  # (B, H, n, D): they come after every prompt key
        p_window = group_attention(window_q[l], k, valid)  # (B, H_kv, G*n, S), causal in the prompt
        p_draft = group_attention(draft_q, k, valid, causal=False)  # (B, H_kv, G*n, S)
        scores[l] = torch.cat([p_window, p_draft], dim=2).mean(dim=2)
    return scores


class QueryRecorder(Hook):
    """Keeps each layer's queries of every forward call (for LAQ's draft tokens)."""

    def __init__(self):
        self.q = {}

    def attn(self, layer, q, k, key_valid):
        self.q.setdefault(layer, []).append(q)


# -----------------------------------------------------------------------------
# decode


@torch.no_grad()
def decode(model, cache, logits, next_pos, max_new_tokens, stop_ids=(), temperature=0.0, top_p=1.0, generator=None,
           evict=None, force=None, record=None):
    """Generate from first-token logits (B, V) on `cache`, yielding token ids (B,) step by step.
    Rows that hit a stop token keep being fed it (batch decoding); the caller stops reading them.

    Beyond the paper: `evict`, a DecodeEviction, holds the cache to its budget while it grows: its hook
    watches every step and, whenever the cache holds budget + every slots, every slot is re-scored and the
    cache evicted back to the budget. `force` (B, >= max_new_tokens) feeds those ids instead of sampling
    (teacher forcing: evaluate.py runs FullKV's answer through the very path generation takes) and
    `record`, a list, gets each step's logits (B, V)."""
    stop = torch.tensor(list(stop_ids) or [-1], device=logits.device)
    done = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    hook = None if evict is None else evict.hook
    for t in range(max_new_tokens):
        if record is not None:
            record.append(logits)
        tok = sample(logits, temperature, top_p, generator) if force is None else force[:, t]  # (B,)
        tok = torch.where(done, stop[0].clamp(min=0), tok)
        yield tok
        done |= torch.isin(tok, stop)
        if done.all() or t == max_new_tokens - 1:
            return
        logits = model(tok[:, None], positions=(next_pos + t)[:, None], cache=cache, hook=hook)[:, -1]
        if evict is not None and evict.due(cache):  # tok is in the cache: the next rows go at next_pos + t + 1
            evict.evict(model, cache, next_pos + t + 1)


def sample(logits, temperature=0.0, top_p=1.0, generator=None):
    if temperature <= 0:
        return logits.argmax(-1)  # greedy
    probs = (logits.float() / temperature).softmax(-1)
    if top_p < 1.0:  # nucleus: keep the smallest set of tokens whose mass reaches top_p
        p, i = probs.sort(-1, descending=True)
        p[(p.cumsum(-1) - p) > top_p] = 0
        probs = torch.zeros_like(probs).scatter(-1, i, p)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


# -----------------------------------------------------------------------------
# Beyond the paper: eviction while decoding, and across conversation turns

DECODE_METHODS = ("streaming", "snapkv", "h2o", "lookahead")


class DecodeEviction:
    """The paper evicts once, after the prefill, and names what follows its main limitation: a long
    answer grows the cache again by one slot per token, and in a chat every turn is prefilled on top of
    all the turns before it. Here the cache is held to `budget` slots per (layer, KV head) throughout:
    each time it holds budget + `every` slots (decode(..., evict=this)), and once per new turn
    (add_turn), EVERY current slot is scored by the method's decode-phase form and the cache is gathered
    back to the budget:

        lookahead  the M lookahead rows, LoRA on, at the next positions on top of the current cache:
                   their mean attention over its slots (lookahead_pass; their K/V are discarded)
        snapkv     the queries of the last `window` tokens run (the generated ones) over every slot
        h2o        the attention each slot has received from every query run since decoding began,
                   per query that saw it (RunningH2O: H2O's native, accumulating decode form)
        streaming  recency; the first n_sink slots (attention sinks) kept

    The last `window` slots, the most recent tokens, are always kept (inside the budget); each method
    pools its scores as it does after the prefill (over neighbouring slots now). Gathering keeps slots
    in position order, so the last slots stay the latest tokens, and positions never change: RoPE was
    applied before caching, so the next token is at S + t whatever was evicted. Written for batch size 1
    (generate.py, the chat, evaluate.py, bench.py) and a cache without padding. every=None never evicts
    while decoding (the hook still watches: a chat's next turn is scored with what it saw). `log` gets
    (next position, slots before, slots after) per eviction."""

    def __init__(self, method, budget, every=None, window=32, module=None, pool=None, kernel=None, n_sink=4):
        if method not in DECODE_METHODS:
            raise ValueError(f"method {method} has no decode-phase eviction here: use one of "
                             f"{', '.join(DECODE_METHODS)}")
        if every is not None and every < 1:
            raise ValueError(f"evict every {every} tokens: must be at least 1, e.g. 32")
        sinks = n_sink if method == "streaming" else 0
        if budget <= window + sinks:
            kept = f"the last {window} slots" + (f" and {sinks} sinks" if sinks else "")
            raise ValueError(f"decode budget {budget} leaves no room to choose: it always keeps {kept}; "
                             f"use a budget > {window + sinks} or a smaller window")
        self.scorer = make_scorer(EvictConfig(method, budget, window=window, pool=pool, kernel=kernel, n_sink=n_sink),
                                  module)  # the method's pooling (lookahead: its adapter's)
        self.budget, self.every, self.window, self.sinks = budget, every, window, sinks
        self.hook = self.scorer.decode_hook()  # watches every forward on the cache from now on
        self.log = []

    def due(self, cache):
        return self.every is not None and len(cache) >= self.budget + self.every

    @torch.no_grad()
    def evict(self, model, cache, next_pos, budget=None):
        """Score the n slots of `cache` and keep `budget` (default: the decode budget) per (layer, KV head).
        next_pos: the position of the next token (where the lookahead rows go). Returns the kept slots
        per layer (B, H_kv, budget), in slot order."""
        budget = self.budget if budget is None else budget
        n = len(cache)
        scores = self.scorer.decode_scores(model, cache, self.hook, next_pos)  # (L, B, H_kv, n)
        scores = pool_scores(scores, self.scorer.pool, self.scorer.kernel, self.window)
        slot = torch.arange(n, device=scores.device)
        protect = (slot >= n - self.window) | (slot < self.sinks)  # (n,): the latest tokens, streaming's sinks
        kept = select(scores, budget, protect=protect)  # (L, B, H_kv, budget)
        for l, idx in enumerate(kept):
            cache.gather(l, idx)
            if hasattr(self.hook, "gather"):  # H2O's running sums travel with their slots
                self.hook.gather(l, idx)
        self.log.append((int(next_pos[0]), n, len(cache)))
        return list(kept)

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


def attention_recall(pred_scores, true_scores, budget, protect=None):
    """Recall@C: the fraction of the true future attention mass (per layer and KV head, L1-
    normalised) that the top-C tokens of `pred_scores` keep; averaged over layers, heads, rows.
    Both are dicts layer -> (B, H_kv, S); protect as in select (e.g. snapkv's window)."""
    return recall_of_kept([select(pred_scores[l], budget, protect=protect) for l in true_scores], true_scores)


def recall_of_kept(kept, true):
    """Share of the true future attention mass that the kept slots hold. kept: per layer, the
    kept prompt slots (B, H_kv, C_l); true: per layer, scores (B, H_kv, S), L1-normalised here
    per (row, KV head). Mean over layers, KV heads and rows."""
    r = []
    for l, idx in enumerate(kept):
        t = true[l].float()
        t = t / t.sum(-1, keepdim=True).clamp(min=1e-12)
        r.append(t.gather(-1, idx).sum(-1).mean())
    return torch.stack(r).mean().item()
