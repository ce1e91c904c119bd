"""
LookaheadKV (ICLR 2026) and the KV-eviction baselines it is compared with, one class per method.

The problem: after a prompt of S tokens is prefilled, keep only C KV slots per (layer, KV head)
and decode on that compact cache. Which C? The ones the *answer* will attend to. LookaheadKV's
answer: append M learned "lookahead" embeddings after the prompt, give their rows (and only
theirs) a LoRA, and read off where they attend. Trained (train.py) to attend like the model's
real answer does, they glimpse the future without generating it.

In equations (METHOD.md has the long form). With prompt hidden states X (S rows) and the
lookahead embeddings P (M rows, positions S .. S+M-1), every LoRA target W becomes
    [X; P] W + [0; P] (alpha / r) B A         (the delta on the lookahead rows only)
so the prompt rows, and hence the prompt's KV cache, are exactly the frozen model's. The score of
prompt token j in layer l and KV head h is
    s[j] = mean over the M lookahead queries i and the G query heads g of that KV head of
           softmax_j(q_{i,g} . k_j / sqrt(d))
and the lookahead rows' own keys and values are dropped after scoring. Training fits P and the
LoRA so that s matches the attention the model's real answer pays to the prompt:
    loss = KL(s_gt / |s_gt|_1 || s / |s|_1), averaged over layers and query heads.

The file follows the method: (1) a few queries' attention over the prompt, (2) the lookahead
module and its hook, (3) the truth: the real answer's attention over the prompt, (4) the rules
that smooth scores and the top-C selection, (5) a method as a Scorer: LookaheadKV's, (6) compress
and decode. The baselines it is compared with (full, streaming, random, snapkv, pyramidkv, h2o,
laq, oracle) are in baselines.py, one class each; make_scorer finds any of them by name.

    from model import load_model, Tokenizer
    from lookaheadkv import EvictConfig, compress, decode
    cache, logits, pos, kept = compress(model, ids, EvictConfig("snapkv", budget=128))
    for tok in decode(model, cache, logits, pos, 64): ...

Beyond the paper, decode_eviction.py holds the cache to a budget while a long answer grows and
across the turns of a chat. Library errors are exceptions (ValueError, FileNotFoundError); the
scripts turn them into one line.
"""
import json
import math
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
    pool: str | None = None  # the rule that smooths scores before top-k (POOLS); None = the method's own
    kernel: int | None = None  # its width (avg, max: odd); None = the method's own (avg 5; lookahead: its adapter's)
    n_sink: int = 4  # streaming: first tokens always kept (attention sinks)
    laq_tokens: int = 8  # laq: draft length, and the number of last prompt queries added to it
    pyramid_beta: int = 20  # pyramidkv: last layer's budget = first layer's / ~beta (kvpress)
    one_pass: bool = True  # lookahead: append the M rows to the prefill (fast) or a 2nd pass (reference)
    layer_weights: tuple | str | None = None  # per-layer budgets C * w_l / mean(w); None = the method's own
    # (lookahead: its adapter's, measured where its selection decides the answer; pyramidkv: the pyramid;
    # others: C in every layer); "uniform" = C in every layer, as the paper evaluates LookaheadKV
    chunk_size: int = 4096  # prefill in chunks of this many tokens (bounded activations at 32K)
    seed: int = 0  # random


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


# -----------------------------------------------------------------------------
# 2. The lookahead module: M embeddings + a LoRA that is active on their rows only


class LookaheadModule(nn.Module):
    """M learnable lookahead embeddings P and, per layer and target projection, a LoRA
    W' = W + (alpha / r) B A applied ONLY to the lookahead rows:
        Q = [X; P] Wq + [0; P] dWq   (and the same for every other target)
    The base model is frozen and never sees the LoRA on prompt rows, so the prompt's KV cache
    is exactly the base model's. targets=() keeps the embeddings alone (an ablation: what the
    LoRA adds on top of M learned "future" tokens)."""

    TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def __init__(self, cfg, n_tokens=32, rank=8, alpha=32, targets=TARGETS, embed_std=0.02, pool="span", kernel=8,
                 window=0, layer_budget=None):
        check_pooling(pool, kernel)
        super().__init__()
        bad = [t for t in targets if t not in self.TARGETS]
        if bad:
            raise ValueError(f"unknown LoRA targets {bad}; choose from {', '.join(self.TARGETS)}")
        self.cfg, self.n_tokens, self.rank, self.alpha, self.targets = cfg, n_tokens, rank, alpha, tuple(targets)
        self.pool, self.kernel = pool, kernel  # the scoring options it ships with
        self.window = window  # the last `window` prompt tokens kept whatever their score (0: none)
        # per-layer budget weights (mean 1), or None: C in every layer. Measured for an adapter by
        # examples/layer_sensitivity.py: more slots where its choice decides the answer, fewer elsewhere
        self.layer_budget = None if layer_budget is None else tuple(float(w) for w in layer_budget)
        if self.layer_budget is not None and len(self.layer_budget) != cfg.num_hidden_layers:
            raise ValueError(f"layer_budget has {len(self.layer_budget)} weights for a model of "
                             f"{cfg.num_hidden_layers} layers: measure them for this model (examples/layer_sensitivity.py)")
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
                    kernel=self.kernel, window=self.window,
                    layer_budget=None if self.layer_budget is None else list(self.layer_budget), **self.info)

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
                kernel=meta.get("kernel", 5), window=meta.get("window", 0), layer_budget=meta.get("layer_budget"))
        m.info = {k: v for k, v in meta.items() if k not in m.metadata()}
        try:
            m.load_state_dict(load_file(str(path)))
        except Exception as e:
            raise ValueError(f"adapter {path} is corrupt or incomplete ({str(e).splitlines()[0]}): retrain it")
        return m.to(device)


def untrained_module(model, n_tokens=32, rank=8, alpha=32, targets=LookaheadModule.TARGETS, pool="span", kernel=8,
                     window=0, layer_budget=None):
    """The module before training, for `model`: P drawn with the std of its token embeddings (so the
    M rows start at the scale of real tokens), LoRA B = 0 (so they start as the base model's own
    projections). Float32 on the model's device: the module trains in float32 whatever the model's
    dtype. Untrained, the M rows already act as generic queries from "just after the prompt": a
    strong baseline of their own, and the row every trained adapter is compared with."""
    embed = model.model.embed_tokens.weight
    std = embed.float().std().item()
    module = LookaheadModule(model.config, n_tokens, rank, alpha, targets, std, pool, kernel, window, layer_budget)
    return module.to(embed.device)


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
# 3. The answer's attention over the prompt: the training target, the oracle, recall's truth


class AnswerHook(Hook):
    """In the forward of the answers (B, R, right-padded) on top of the prompt cache: per layer, the
    mean attention of each row's real answer queries over the S prompt slots, per query head
    (B, H, S: the training target) or per KV head (B, H_kv, S: the oracle's scores, recall's truth)."""

    def __init__(self, S, answer_mask, per_query_head):
        self.S, self.per_query_head, self.scores = S, per_query_head, {}
        self.weights = answer_mask.float() / answer_mask.sum(-1, keepdim=True).float()  # (B, R): mean over real ones

    def attn(self, layer, q, k, key_valid):
        B, H, R, _ = q.shape
        Hkv, S = k.shape[1], self.S
        probs = group_attention(q, k, key_valid)[..., :S].view(B, Hkv, H // Hkv, R, S)  # (B, H_kv, G, R, S)
        per_head = torch.einsum("bkgrs,br->bkgs", probs, self.weights)  # (B, H_kv, G, S)
        self.scores[layer] = per_head.flatten(1, 2) if self.per_query_head else per_head.mean(dim=2)


@torch.no_grad()
def answer_attention(model, cache, answers, next_pos, answer_mask=None, per_query_head=False):
    """The answers (B, R) ids, run on top of the prompt cache (left as it was) at positions next_pos
    (B,) onwards: per layer, each row's mean attention of its answer queries over the len(cache)
    prompt slots, {layer: (B, H, S)} per query head or (B, H_kv, S) per KV head. Answers of different
    lengths are right-padded and answer_mask (B, R) marks the real tokens: the padding comes after a
    row's answer, so causal attention hides it from the real queries, and its own queries weigh 0.
    One forward of R tokens: R x S attention per layer, never (S + R) x (S + R)."""
    B, R = answers.shape
    mask = torch.ones(B, R, dtype=torch.bool, device=answers.device) if answer_mask is None else answer_mask
    hook = AnswerHook(len(cache), mask, per_query_head)
    positions = next_pos.reshape(-1, 1) + torch.arange(R, device=answers.device)  # (B, R)
    model(answers, positions=positions.expand(B, R), cache=cache.copy(), hook=hook, logits_at=-1)
    return hook.scores


# -----------------------------------------------------------------------------
# 4. Turning scores into kept slots: the smoothing rules, top-C, one gather per layer


POOLS = ("none", "avg", "max", "chunk", "carry", "span")  # the rules a method may smooth its scores with before top-C
SURPRISE_NATS = 2.0  # the span rule's gate: a token the model gave p < e^-2 (about 0.14) was not predictable


def check_pooling(pool, kernel):
    if pool not in POOLS:
        raise ValueError(f"unknown pooling {pool!r}: use one of {', '.join(POOLS)}")
    if pool in ("avg", "max") and (kernel < 1 or kernel % 2 == 0):
        raise ValueError(f"pooling width {kernel} must be odd and >= 1 (a window centred on each token): "
                         "use e.g. 1, 3, 5 or 7")
    if kernel < 1:
        raise ValueError(f"pooling width {kernel} must be >= 1")


def token_surprisal(model, hidden, ids, rows=256):
    """How unpredictable each prompt token was to the model: -log p(ids[t] | ids[<t]) in nats, (B, S)
    float32, from the final normed hidden states (B, S, hidden) of the prompt's own forward (row
    t - 1 predicts token t), `rows` rows at a time so that no (S, vocab) tensor is made. The first
    token has no context and gets 0 (with left padding the caller zeroes each row's first real token)."""
    B, S = ids.shape
    out = torch.zeros(B, S, device=ids.device)
    for a in range(0, S - 1, rows):
        b = min(a + rows, S - 1)
        logp = model.lm_head(hidden[:, a:b]).float().log_softmax(-1)  # (B, b - a, V)
        out[:, a + 1:b + 1] = -logp.gather(-1, ids[:, a + 1:b + 1, None])[..., 0]
    return out


def _shift(t, o, fill):
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
    """The span rule: scores x (..., B, H_kv, n), surprisal (B, n). A run of consecutive tokens that
    were each unpredictable (surprisal > SURPRISE_NATS: the digits of a number, the pieces of a rare
    name or an identifier) is one span; inside it every token gets the best score within kernel - 1
    places on either side, times decay per place. So once any token of a number is scored, the
    whole number is kept, while predictable text is selected token by token as unpooled. After
    kvpress's QuerySpanPress (carry with decay, granted only to tokens the model could not
    predict), made two-sided: the lookahead rows may score any digit of the number, not its first."""
    u = surprisal > SURPRISE_NATS  # (B, n)
    joined = torch.zeros_like(u)
    joined[:, 1:] = u[:, 1:] & u[:, :-1]  # token t and t - 1 in one span
    joined = joined[:, None]  # (B, 1, n), broadcast over the KV heads (and the layers in front)
    out = x
    left = right = torch.ones_like(joined)
    for o in range(1, kernel):
        left = left & _shift(joined, o - 1, False)  # t - o .. t one span: joined at t - o + 1 .. t
        right = right & _shift(joined, -o, False)  # t .. t + o one span: joined at t + 1 .. t + o
        carried = decay ** o
        out = torch.where(left, torch.maximum(out, _shift(x, o, 0.0) * carried), out)  # from o places before
        out = torch.where(right, torch.maximum(out, _shift(x, -o, 0.0) * carried), out)  # from o places after
    return out


def pool_scores(s, pool, kernel, window=0, surprisal=None):
    """Smooth scores (..., S) along the sequence before the top C, so that whole spans (every digit
    of a number, every token of a name) are kept rather than scattered tokens. One rule each:
        avg    SnapKV's pooling: the mean over a centred window; a peak is divided by the width
        max    SnapKV's max-pool option, a dilation: a peak spreads to its neighbours at full height
        chunk  ChunkKV (Liu et al., arXiv 2502.00299): the prompt cut into chunks of `kernel` tokens,
               each token scored by its chunk's sum, so whole chunks are kept (a token's own score
               breaks ties: a chunk cut by the budget keeps its best tokens)
        carry  a peak carried forward over the next kernel - 1 tokens (a one-sided dilation, after
               kvpress's QuerySpanPress, without its decay and surprise gate): once the first token
               of a number or identifier is scored, the rest of it follows
        span   a peak shared, with decay, inside a run of tokens the model could not predict
               (span_scores; needs `surprisal` (B, S), which prefill_and_score computes for it)
    With a protected window (kept anyway), only the prefix before it is smoothed, as in SnapKV's
    code, so the window's large scores do not leak into the tokens before it. Edges: avg pads with
    zeros and divides by the full width; max, carry, chunk and span ignore the padding."""
    if pool == "none" or kernel == 1:
        return s
    S = s.shape[-1]
    n = S - window  # the smoothed prefix
    if pool == "span":
        if surprisal is None:
            raise ValueError("the span rule needs each prompt token's surprisal (prefill_and_score computes it)")
        pooled = span_scores(s[..., :n].float(), surprisal[:, :n].to(s.device), kernel).to(s.dtype)
        return torch.cat([pooled, s[..., n:]], dim=-1) if window else pooled
    x = s[..., :n].reshape(-1, 1, n).float()  # (rows, 1, n)
    if pool == "avg":
        pooled = F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2)
    elif pool == "max":
        pooled = F.max_pool1d(x, kernel, stride=1, padding=kernel // 2)
    elif pool == "carry":  # c(t) = max(s(t - kernel + 1 .. t))
        pooled = F.max_pool1d(F.pad(x, (kernel - 1, 0), value=float("-inf")), kernel, stride=1)
    else:  # chunk: every token gets its chunk's sum, + a little of its own score
        chunks = F.pad(x, (0, -n % kernel)).view(x.shape[0], 1, -1, kernel).sum(-1)  # (rows, 1, n_chunks)
        pooled = chunks.repeat_interleave(kernel, dim=-1)[..., :n] + 1e-3 * x
    pooled = pooled.to(s.dtype).reshape(*s.shape[:-1], n)
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


def keep_slots(cache, kept):
    """Eviction itself: per layer, keep the slots `kept` (B, H_kv, C_l) of the cache, in place."""
    for layer, idx in enumerate(kept):
        cache.gather(layer, idx)
    return cache




# -----------------------------------------------------------------------------
# 5. A method is a Scorer: what it adds to the prefill and how it scores (the baselines: baselines.py)


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
    surprisal: torch.Tensor | None = None  # (B, S) -log p of each prompt token, when the rule needs it (span)


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

    own_layer_weights = None  # the method's own per-layer budget weights (None: C in every layer)

    def budgets(self, n_layers, S):
        """Slots per layer: C each, or C * w_l for per-layer weights w (EvictConfig.layer_weights, else the
        method's own), with the same total (spread_budgets)."""
        w = self.eviction.layer_weights if self.eviction.layer_weights is not None else self.own_layer_weights
        if w is None or w == "uniform":
            return [min(self.eviction.budget, S)] * n_layers
        if len(w) != n_layers:
            raise ValueError(f"{len(w)} layer budget weights for a model of {n_layers} layers")
        return spread_budgets(self.eviction.budget, w, S, least=self.window + self.sinks + 1)

    @property
    def needs_surprisal(self):  # the span rule reads how predictable each prompt token was
        return self.pool == "span" and self.kernel > 1

    def evict(self, scores, positions, valid=None, budget=None, surprisal=None):
        """The shared step: scores (L, B, H_kv, S) -> per layer the kept slots (B, H_kv, C_l), in slot
        order. budget: the same C for every layer instead of the method's (decode_eviction.py);
        surprisal (B, S): the span rule's input (Prefilled.surprisal)."""
        scores = pool_scores(scores, self.pool, self.kernel, self.window, surprisal)
        protect = self.protect(positions)
        budgets = self.budgets(scores.shape[0], scores.shape[-1]) if budget is None else [budget] * scores.shape[0]
        if len(set(budgets)) == 1:  # one top-k for all layers
            return list(select(scores, budgets[0], valid, protect))
        return [select(scores[l], b, valid, protect) for l, b in enumerate(budgets)]


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


def spread_budgets(budget, weights, S, least=1):
    """Per-layer budgets C * w_l / mean(w), each at least `least` slots, summing to L * C exactly
    (largest remainders get the rounding), then fitted to the prompt (fit_to_prompt)."""
    L = len(weights)
    total = sum(weights)
    if not total > 0 or min(weights) < 0:
        raise ValueError(f"layer budget weights must be >= 0 and not all 0, got {list(weights)}")
    want = [max(budget * L * w / total, least) for w in weights]
    scale = (budget * L - least * L) / max(sum(x - least for x in want), 1e-9)  # the floor comes out of the rest
    want = [least + (x - least) * scale for x in want]
    b = [math.floor(x) for x in want]
    for l in sorted(range(L), key=lambda l: b[l] - want[l])[: budget * L - sum(b)]:
        b[l] += 1
    return fit_to_prompt(b, S)


def stack_layers(scores):
    """{layer: (B, H_kv, S)} -> (L, B, H_kv, S)."""
    return torch.stack([scores[l] for l in range(len(scores))])


class LookaheadKV(Scorer):
    """LookaheadKV (arXiv 2603.10899): M learned embeddings after the prompt, at positions
    S .. S+M-1, with a LoRA on their rows only (LookaheadModule). Their mean attention over the
    prompt predicts the answer's. One-pass (default): the rows ride in the prefill's last chunk
    and their K/V are cut off after scoring; two-pass: a second forward of the M rows on top of
    the prompt cache (the training form). Both give the same scores (causal attention, LoRA on
    the lookahead rows only). Its selection rule and protected window of recent tokens are its
    adapter's (module.pool, .kernel, .window; the shipped one: the span rule of width 8, no window:
    its queries already sit after the prompt's last tokens), and so are its per-layer budgets
    (module.layer_budget, beyond the paper: C_l slots in layer l, mean C; see budgets())."""

    def __init__(self, eviction, module=None, response=None):
        if module is None:
            raise ValueError("method lookahead needs an adapter (a LookaheadModule): train one with python "
                             "train.py, or pass --adapter")
        self.module = module
        self.default_pool = (module.pool, module.kernel)
        self.window = module.window
        self.own_layer_weights = module.layer_budget
        super().__init__(eviction)

    def prefill_hook(self, S):
        return LookaheadHook(self.module, S) if self.eviction.one_pass else None

    def extra_rows(self):
        return self.module.embeddings if self.eviction.one_pass else None

    def score(self, model, run):
        if self.eviction.one_pass:
            return stack_layers(run.hook.scores)
        return stack_layers(lookahead_pass(model, self.module, run.cache, run.next_pos))


# -----------------------------------------------------------------------------
# 6. prefill -> score -> evict -> return, then decode


def prefill(model, x, positions, cache, pad_mask=None, hook=None, chunk_size=4096, logits_at=-1, tail=0,
            keep_hidden=False):
    """Run embeddings x (B, T, C) through the model into `cache`, chunk by chunk so a 32K prompt's
    activations stay bounded. The LAST chunk is a full one (the first takes the remainder), so
    window scorers find all their queries in it; the last `tail` rows (the lookahead rows) ride
    along with it, so the prompt is chunked exactly as without them. The hook sees only the last
    chunk unless it says every_chunk. Returns the logits at row `logits_at` (B, 1, V); with
    keep_hidden, (logits, the prompt rows' final normed hidden states (B, P, hidden))."""
    T = x.shape[1]
    P = T - tail  # the prompt
    bounds = sorted({0, *range(P % chunk_size, P, chunk_size)}) + [T]
    hidden = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        last = b == T
        h = hook if (last or getattr(hook, "every_chunk", False)) else None
        out = model(inputs_embeds=x[:, a:b], positions=positions[:, a:b], cache=cache,
                    pad_mask=None if pad_mask is None else pad_mask[:, a:b], hook=h,
                    logits_at=(logits_at % T - a) if last else -1, hidden=keep_hidden)
        if keep_hidden:
            out, rows = out
            hidden.append(rows[:, :P - a])  # the prompt's rows only, not the lookahead rows after it
    return (out, torch.cat(hidden, dim=1)) if keep_hidden else out


def prefill_and_score(model, ids, eviction, pad_mask=None, module=None, response=None, clock=None):
    """Steps 1 and 2 of compress: returns (scorer, run), run a Prefilled with the full prompt cache
    and run.scores (L, B, H_kv, S), or None when there is nothing to evict (S <= C, full).
    Scores do not depend on the budget (except LAQ's), so one call serves every budget.
    clock: anything with a mark() method (e.g. a Stopwatch), marked after the prefill (and the
    span rule's surprisal, read from it)."""
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
    cache = KVCache(cfg.num_hidden_layers)
    surprise = evicting and scorer.needs_surprisal
    logits = prefill(model, x_all, pos_all, cache, mask_all, hook, chunk, logits_at=S - 1, tail=x_all.shape[1] - S,
                     keep_hidden=surprise)
    cache.truncate(S)  # rows after the prompt are scored, then discarded: never in the cache
    run = Prefilled(cache, hook, None, positions, next_pos, valid)
    if surprise:  # the span rule: how unpredictable each prompt token was, from this same forward
        logits, hidden = logits
        run.surprisal = token_surprisal(model, hidden, ids).masked_fill(positions == 0, 0.0)  # (B, S)
    run.logits = logits[:, -1]
    if clock is not None:
        clock.mark()

    # 2. score: (L, B, H_kv, S), every layer at once, so pooling and top-k are a few launches in all
    if evicting:
        run.scores = scorer.score(model, run)
    return scorer, run


def compress(model, ids, eviction, pad_mask=None, module=None, response=None, clock=None):
    """Prefill the prompt ids (B, S) and evict its cache down to eviction.budget slots per (layer, KV head).

    module: the LookaheadModule (method "lookahead"); response: the full-cache greedy answer (B, R)
    ids (method "oracle"); pad_mask (B, S): False on left padding. Returns (cache, first-token
    logits (B, V), next positions (B,), kept): kept is, per layer, the kept slots (B, H_kv, C_l), or
    None when nothing was evicted. clock (a Stopwatch, or None) is marked after the prefill and
    after the eviction, so a caller times the two steps without the library timing anything."""
    # 1. prefill and 2. score
    scorer, run = prefill_and_score(model, ids, eviction, pad_mask, module, response, clock)
    kept = None
    if run.scores is not None:
        # 3. evict: pool, one top-k for all layers (per layer when budgets differ), one gather per layer
        kept = scorer.evict(run.scores, run.positions, run.valid, surprisal=run.surprisal)
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
    in the cache, next_pos then being where the next one goes (decode_eviction.py evicts there)."""
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


METHODS = ("full", "streaming", "random", "snapkv", "pyramidkv", "h2o", "laq", "oracle", "lookahead")


def make_scorer(eviction, module=None, response=None):
    """The Scorer for eviction.method; it checks its inputs and the budget (ValueError)."""
    # the table of every method's class lives with the baselines, which subclass Scorer: imported here,
    # when it is needed, so that baselines.py can import this file
    from baselines import SCORERS

    if eviction.method not in SCORERS:
        raise ValueError(f"unknown method {eviction.method!r}; choose from {', '.join(METHODS)}")
    return SCORERS[eviction.method](eviction, module=module, response=response)
