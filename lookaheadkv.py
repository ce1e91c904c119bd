"""
LookaheadKV and the KV-eviction baselines it is compared with, in one file.

Every method follows the same four steps (PAPER.md, "Problem"):

    prefill  the prompt (S tokens) into a KV cache, normally;
    score    every prompt token per (layer, KV head): how much will the answer attend to it?
    evict    keep the top C slots per (layer, batch row, KV head), C = the budget;
    decode   on the compact cache; the next token's position is still S.

Methods differ only in the score:
    streaming   4 sink tokens + the most recent ones (no attention at all)
    random      random scores (a sanity floor)
    snapkv      attention of the last `window` prompt queries, pooled along the sequence
    pyramidkv   snapkv scores, per-layer budgets falling with depth (mean = C)
    h2o         attention each key gets from ALL prompt queries, normalised by how many see it
    laq         snapkv-compress, draft 8 tokens on that cache, re-score the full cache with
                their queries (a "pseudo future")
    oracle      the true future: attention of the full-cache greedy answer (needs that answer)
    lookahead   LookaheadKV: M learned embeddings appended after the prompt, with a LoRA that
                acts only on their rows; their mean attention over the prompt is the score

    from model import load_model, Tokenizer
    from lookaheadkv import EvictConfig, compress, decode
    cache, logits, pos, stats = compress(model, ids, EvictConfig("snapkv", budget=128))
    for tok in decode(model, cache, logits, pos, 64): ...

No S x S attention matrix is ever built here: scores need only (queries x S) per layer.
"""

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import Hook, KVCache

METHODS = ("full", "streaming", "random", "snapkv", "pyramidkv", "h2o", "laq", "oracle", "lookahead")


@dataclass
class EvictConfig:
    method: str = "full"
    budget: int = 128  # C: KV slots kept per (layer, KV head), protected tokens included
    window: int = 32  # snapkv/pyramidkv/h2o/laq: the last `window` prompt tokens are always kept
    pool: str = "avg"  # smoothing of scores along the sequence before top-k: "avg", "max" or "none"
    kernel: int = 5  # pooling width (SnapKV's code: avg 5; KVCache-Factory's LongBench: max 7)
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
    # with padding, a left-padding query sees no real key: its all -inf row is NaN, make it 0
    return probs if key_valid is None else probs.nan_to_num(0.0)


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
            probs = group_attention(q[:, :, i:j], k[:, :, : Tk - Tq + j], None if key_valid is None else key_valid[..., : Tk - Tq + j])
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


# -----------------------------------------------------------------------------
# The lookahead module: M embeddings + a LoRA that is active on their rows only


class LookaheadModule(nn.Module):
    """M learnable lookahead embeddings P and, per layer and target projection, a LoRA
    W' = W + (alpha / r) B A applied ONLY to the lookahead rows (PAPER.md, "Method"):
        Q = [X; P] Wq + [0; P] dWq   (and the same for every other target)
    The base model is frozen and never sees the LoRA on prompt rows, so the prompt's KV cache
    is exactly the base model's."""

    TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def __init__(self, cfg, n_tokens=32, rank=8, alpha=32, targets=("q_proj", "k_proj"), embed_std=0.02,
                 pool="avg", kernel=5):
        super().__init__()
        bad = [t for t in targets if t not in self.TARGETS]
        if bad:
            raise ValueError(f"unknown LoRA targets {bad}; choose from {', '.join(self.TARGETS)}")
        self.cfg, self.n_tokens, self.rank, self.alpha, self.targets = cfg, n_tokens, rank, alpha, tuple(targets)
        self.pool, self.kernel = pool, kernel  # the scoring options it was trained with
        self.info = {}  # training metadata, saved with the adapter
        # random init with the scale of real token embeddings (PAPER.md: a GUESS that measured well)
        self.embeddings = nn.Parameter(torch.randn(n_tokens, cfg.hidden_size) * embed_std)
        H, Hkv, D, C, I = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
        dims = dict(q_proj=(C, H * D), k_proj=(C, Hkv * D), v_proj=(C, Hkv * D), o_proj=(H * D, C),
                    gate_proj=(C, I), up_proj=(C, I), down_proj=(I, C))
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
                    kernel=self.kernel, **self.info)

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
            raise SystemExit(f"error: adapter {path} (and its .json) not found: train one with python train.py")
        meta = json.loads(meta_file.read_text())
        if meta.get("base_fingerprint") != cfg.fingerprint():
            raise SystemExit(f"error: adapter {path.name} was trained for {meta.get('base_model')!r} "
                             f"(fingerprint {meta.get('base_fingerprint')}), not for this model "
                             f"{cfg.name!r} ({cfg.fingerprint()}): train one for it with python train.py")
        m = cls(cfg, meta["n_tokens"], meta["rank"], meta["alpha"], meta["targets"], pool=meta.get("pool", "avg"),
                kernel=meta.get("kernel", 5))
        m.info = {k: v for k, v in meta.items() if k not in m.metadata()}
        try:
            m.load_state_dict(load_file(str(path)))
        except Exception as e:
            raise SystemExit(f"error: adapter {path} is corrupt or incomplete ({str(e).splitlines()[0]}): retrain it")
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
    emb = module.embeddings.to(cache.k[0].dtype).expand(B, -1, -1)  # (B, M, C)
    hook = LookaheadHook(module, len(cache), per_query_head)
    model(inputs_embeds=emb, positions=positions.expand(B, M), cache=cache.copy(), hook=hook, logits_at=-1)
    return hook.scores



# -----------------------------------------------------------------------------
# Turning scores into kept indices


def pool_scores(s, pool, kernel):
    """Smooth scores (..., S) along the sequence, as SnapKV does: a token next to an
    important one is kept too, which keeps whole phrases rather than scattered tokens."""
    if pool == "none" or kernel <= 1:
        return s
    fn = F.avg_pool1d if pool == "avg" else F.max_pool1d
    x = s.reshape(-1, 1, s.shape[-1])  # (..., S) -> (rows, 1, S)
    return fn(x, kernel, stride=1, padding=kernel // 2).reshape(s.shape)


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


def pyramid_budgets(budget, window, n_layers, beta):
    """PyramidKV: budgets fall linearly from the first layer to the last, mean over layers = C."""
    if n_layers == 1:
        return [budget]
    avail = budget - window
    lo = avail // beta
    hi = 2 * avail - lo
    return [window + round(hi - l * (hi - lo) / max(n_layers - 1, 1)) for l in range(n_layers)]


# -----------------------------------------------------------------------------
# prefill -> score -> evict


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


def compress(model, ids, ec, pad_mask=None, module=None, response=None):
    """Prefill the prompt ids (B, S) and evict its cache down to ec.budget slots per (layer, KV head).

    module: the LookaheadModule (method "lookahead"); response: the full-cache greedy answer
    (B, R) ids (method "oracle"). Returns (cache, first-token logits (B, V), next positions (B,),
    stats) where stats has prefill_ms, score_ms, kept (per layer, the kept slots (B, H_kv, C_l);
    None when nothing was evicted) and keep_frac (S,): per prompt token of row 0, the fraction
    of (layer, KV head) pairs that kept it."""
    cfg, dev = model.config, ids.device
    L, G = cfg.num_hidden_layers, cfg.num_attention_heads // cfg.num_key_value_heads
    B, S = ids.shape
    method, C = ec.method, ec.budget
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    if pad_mask is None:
        positions = torch.arange(S, device=dev).expand(B, S)
        valid = None
    else:
        positions = (pad_mask.long().cumsum(-1) - 1).clamp(min=0)  # each row starts at position 0
        valid = pad_mask[:, None, :]  # (B, 1, S)
    next_pos = positions[:, -1] + 1  # (B,) the position of the first generated token, = S_b
    evict = method != "full" and S > C  # nothing to evict when the whole prompt fits
    windowed = method in ("snapkv", "pyramidkv", "h2o", "laq")
    if evict and windowed and C < ec.window + 1:
        raise SystemExit(f"error: budget {C} is too small for {method}: it keeps the last {ec.window} tokens; use --budget > {ec.window} or a smaller --window")
    if evict and method == "streaming" and C < ec.n_sink + 1:
        raise SystemExit(f"error: budget {C} is too small for streaming: it keeps {ec.n_sink} sink tokens plus recent ones")
    if method == "lookahead" and module is None:
        raise SystemExit("error: method lookahead needs an adapter: train one with python train.py, or pass --adapter")
    if method == "oracle" and response is None:
        raise SystemExit("error: method oracle needs the full-cache answer first")

    # 1. prefill (for one-pass lookahead the M lookahead rows ride along at positions S_b..S_b+M-1)
    x = model.model.embed_tokens(ids)  # (B, S, C)
    hook = None
    if evict and method in ("snapkv", "pyramidkv", "laq"):
        hook = WindowHook(ec.window, S, keep_queries=ec.laq_tokens if method == "laq" else 0)
    elif evict and method == "h2o":
        hook = H2OHook()
    elif evict and method == "lookahead" and ec.one_pass:
        M = module.n_tokens
        x = torch.cat([x, module.embeddings.to(x.dtype).expand(B, -1, -1)], dim=1)  # (B, S+M, C)
        positions = torch.cat([positions, next_pos[:, None] + torch.arange(M, device=dev)], dim=1)
        if pad_mask is not None:
            pad_mask = torch.cat([pad_mask, pad_mask.new_ones(B, M)], dim=1)
        hook = LookaheadHook(module, S)
    # the scoring hook sees the last prefill chunk only: it must hold the whole window
    chunk = max(ec.chunk_size, ec.window if windowed else 0)
    cache = KVCache(L)
    clock = Stopwatch(dev)
    clock.mark()
    logits = prefill(model, x, positions, cache, pad_mask, hook, chunk, logits_at=S - 1, tail=x.shape[1] - S)[:, -1]
    clock.mark()
    stats = dict(prefill_ms=None, score_ms=0.0, keep_frac=None, kept=None)
    if not evict:
        stats["prefill_ms"] = clock.ms(0, 1)
        return cache, logits, next_pos, stats

    # 2. score: (L, B, H_kv, S), every layer at once (the hooks give {layer: (B, H_kv, S)}), so that
    # pooling and top-k are a few launches in all rather than a few per layer
    protect = None
    slot = torch.arange(S, device=dev)
    if method == "streaming":
        scores = slot.float().expand(L, B, cfg.num_key_value_heads, S)  # recency
        protect = (positions[:, :S] < ec.n_sink)[:, None, :]  # the first n_sink real tokens of each row
    elif method == "random":
        g = torch.Generator(device="cpu").manual_seed(ec.seed)
        scores = torch.rand(L, B, cfg.num_key_value_heads, S, generator=g).to(dev)
    elif method == "h2o":
        scores = hook.scores(valid, G)
    elif method == "lookahead" and ec.one_pass:
        cache.truncate(S)  # the lookahead tokens are scored, then discarded: never in the cache
        scores = hook.scores
    elif method == "lookahead":  # reference form: a second forward of the M rows on the prompt cache
        scores = lookahead_pass(model, module, cache, next_pos)
    elif method == "oracle":
        scores = oracle_scores(model, cache, response, next_pos)
    else:  # snapkv, pyramidkv, laq
        scores = hook.scores
    if method not in ("streaming", "random"):
        scores = pool_scores(torch.stack([scores[l] for l in range(L)]), ec.pool, ec.kernel)  # (L, B, H_kv, S)
    if windowed:
        protect = (slot >= S - ec.window)[None, None, :]  # the observation window itself is kept
    if method == "laq":  # draft on the snapkv-compressed cache, then re-score the FULL cache
        draft_cache = cache.copy()
        for l, idx in enumerate(select(scores, C, valid, protect)):
            draft_cache.gather(l, idx)
        scores = laq_scores(model, cache, draft_cache, logits, next_pos, hook.queries, ec, S, valid)
        scores = torch.stack([scores[l] for l in range(L)])

    # 3. evict: one top-k for all layers, then one gather per layer
    if method == "pyramidkv":  # its budgets differ per layer
        budgets = [min(b, S) for b in pyramid_budgets(C, ec.window, L, ec.pyramid_beta)]
        kept = [select(scores[l], budgets[l], valid, protect) for l in range(L)]
    else:
        kept = list(select(scores, C, valid, protect))  # L x (B, H_kv, C)
    for l in range(L):
        cache.gather(l, kept[l])
    clock.mark()
    stats["prefill_ms"], stats["score_ms"] = clock.ms(0, 1), clock.ms(1, 2)
    stats["kept"] = kept
    keep_count = torch.bincount(torch.cat([k[0].flatten() for k in kept]), minlength=S)  # row 0, (S,)
    stats["keep_frac"] = (keep_count / (L * cfg.num_key_value_heads)).cpu()
    return cache, logits, next_pos, stats


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
def laq_scores(model, cache, draft_cache, logits, next_pos, window_q, ec, S, valid):
    """LAQ: greedily draft ec.laq_tokens on the compressed cache, keep the drafted tokens' queries,
    then score the FULL prompt cache with them plus the last laq_tokens prompt queries."""
    n = ec.laq_tokens
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
def decode(model, cache, logits, next_pos, max_new_tokens, stop_ids=(), temperature=0.0, top_p=1.0, generator=None):
    """Generate from first-token logits (B, V) on `cache`, yielding token ids (B,) step by step.
    Rows that hit a stop token keep being fed it (batch decoding); the caller stops reading them."""
    stop = torch.tensor(list(stop_ids) or [-1], device=logits.device)
    done = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    for t in range(max_new_tokens):
        tok = sample(logits, temperature, top_p, generator)  # (B,)
        tok = torch.where(done, stop[0].clamp(min=0), tok)
        yield tok
        done |= torch.isin(tok, stop)
        if done.all() or t == max_new_tokens - 1:
            return
        logits = model(tok[:, None], positions=(next_pos + t)[:, None], cache=cache)[:, -1]


def sample(logits, temperature=0.0, top_p=1.0, generator=None):
    if temperature <= 0:
        return logits.argmax(-1)  # greedy
    probs = (logits.float() / temperature).softmax(-1)
    if top_p < 1.0:  # nucleus: keep the smallest set of tokens whose mass reaches top_p
        p, i = probs.sort(-1, descending=True)
        p[(p.cumsum(-1) - p) > top_p] = 0
        probs = torch.zeros_like(probs).scatter(-1, i, p)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


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
