"""
LookaheadKV (arXiv 2603.10899, ICLR 2026): KV-cache eviction by glimpsing into the future
without generating it. This file is the paper, in the paper's order, and nothing else (METHOD.md
has each equation next to its code).

The problem: keep only C KV slots per (layer, KV head) of a prefilled prompt of S tokens: the
ones the *answer* will attend to. The paper appends M learned "lookahead" embeddings P after the
prompt (positions S .. S+M-1), gives their rows alone a LoRA, and reads off where they attend:

    1. the module   every LoRA target W becomes  [X; P] W + [0; P] (alpha / r) B A
                    so the prompt rows (and the prompt's KV cache) are exactly the frozen model's
    2. the scores   s[j] = mean over the M lookahead queries i (and the G query heads of a KV head)
                    of softmax_j(q_i . k_j / sqrt(d)); the lookahead K/V are dropped after scoring
    3. the target   the attention the model's own answer pays to the prompt (answer_attention)
    4. the loss     KL(s_gt / |s_gt|_1 || s / |s|_1), averaged over layers and query heads
    5. eviction     the scores max-pooled (width 7), then the top C per (layer, KV head), C in
                    every layer: lookahead_compress, the paper's inference on one screen, calling
                    the steps of eviction.py that every baseline runs too (prefill, top C, gather)
"""
import json
import math
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file

from eviction import (Pool, Prefilled, Scorer, append_rows, compress, group_attention, keep_slots,
                      prefill, prompt_positions, stack_layers)
from model import Hook, KVCache
from support import checks

# -----------------------------------------------------------------------------
# 1. The lookahead module: M embeddings + a LoRA that is active on their rows only
class LookaheadModule(nn.Module):
    """M learnable lookahead embeddings P and, per layer and target projection, a LoRA
    W' = W + (alpha / r) B A applied ONLY to the lookahead rows:
        Q = [X; P] Wq + [0; P] dWq   (and the same for every other target)
    so the prompt's KV cache is exactly the base model's. The paper shows q and k; all seven
    measured better (RESULTS.md 10.1). The LAST layer's v, o, MLP LoRA feed no score: no grad."""

    TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def __init__(self, cfg, n_tokens=32, rank=8, alpha=32, targets=TARGETS, embed_std=0.02):
        super().__init__()
        bad = [t for t in targets if t not in self.TARGETS]
        if bad:
            raise ValueError(f"unknown LoRA targets {bad}; choose from {', '.join(self.TARGETS)}")
        if n_tokens < 1 or rank < 1:
            raise ValueError(f"a lookahead module needs at least 1 token and rank 1, "
                             f"got M = {n_tokens}, r = {rank}")
        self.cfg, self.n_tokens, self.rank, self.alpha, self.targets = (cfg, n_tokens, rank, alpha,
                                                                        tuple(targets))
        self.info = {}  # everything else its .json says (how it was trained, how it selects)
        # random init with the scale of real token embeddings: untrained, they already act as
        # generic queries from "somewhere after the prompt", a strong baseline of their own
        self.embeddings = nn.Parameter(torch.randn(n_tokens, cfg.hidden_size) * embed_std)
        dims = self.dims(cfg)
        self.lora = nn.ModuleList()
        for _ in range(cfg.num_hidden_layers):
            p = nn.ParameterDict()
            for t in self.targets:
                d_in, d_out = dims[t]
                # as in LoRA: A random, B zero: training starts from the base model's projections
                p[t + "_A"] = nn.Parameter(torch.empty(rank, d_in).uniform_(-1, 1)
                                           / math.sqrt(d_in))
                p[t + "_B"] = nn.Parameter(torch.zeros(d_out, rank))
            self.lora.append(p)

    @staticmethod
    def dims(cfg):
        """(in, out) of each LoRA target's projection."""
        H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        return dict(q_proj=(hidden, H * D), k_proj=(hidden, Hkv * D), v_proj=(hidden, Hkv * D),
                    o_proj=(H * D, hidden), gate_proj=(hidden, inter), up_proj=(hidden, inter),
                    down_proj=(inter, hidden))

    def delta(self, layer, name, x):
        """The LoRA term for rows x (B, M, in) -> (B, M, out), or None if `name` is no target."""
        if name not in self.targets:
            return None
        p = self.lora[layer]
        A, B = p[name + "_A"].to(x.dtype), p[name + "_B"].to(x.dtype)
        return (x @ A.T) @ B.T * (self.alpha / self.rank)

    def metadata(self):
        return dict(base_model=self.cfg.name, base_fingerprint=self.cfg.fingerprint(),
                    n_tokens=self.n_tokens, rank=self.rank, alpha=self.alpha,
                    targets=list(self.targets), **self.info)

    def save(self, path):
        """path (.safetensors) + the same name with .json (metadata), each through a temporary
        file, so a failure leaves any earlier adapter at that path whole."""
        path = Path(path)
        if path.suffix != ".safetensors":
            raise ValueError(f"adapter path {path} must end in .safetensors "
                             "(its metadata goes beside it as .json)")
        tensors = {k: v.detach().float().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(tensors, str(path.with_suffix(".safetensors.tmp")))
        path.with_suffix(".json.tmp").write_text(json.dumps(self.metadata(), indent=2) + "\n")
        path.with_suffix(".safetensors.tmp").replace(path)
        path.with_suffix(".json.tmp").replace(path.with_suffix(".json"))

    @classmethod
    def load(cls, path, cfg, device="cpu"):
        """An adapter saved by save(), checked by support/checks.py; the .json's keys beyond
        checks.ADAPTER_KEYS (how it was made, what it recommends) stay in `info`, saved back."""
        path, dims = Path(path), cls.dims(cfg)
        meta, tensors = checks.read_adapter(path)
        checks.check_adapter_metadata(meta, path.with_suffix(".json"), cfg, path.stat().st_size,
                                      cls.TARGETS, dims)
        m = cls(cfg, meta["n_tokens"], meta["rank"], meta["alpha"], meta["targets"])
        m.info = {k: v for k, v in meta.items() if k not in checks.ADAPTER_KEYS}
        checks.check_adapter_tensors(path, tensors, m.state_dict(), m.alpha, m.rank)
        m.load_state_dict(tensors)
        return m.to(device)


def untrained_module(model, n_tokens=32, rank=8, alpha=32, targets=LookaheadModule.TARGETS):
    """The module before training: P drawn with the std of `model`'s token embeddings, LoRA B = 0,
    in float32 (it trains in float32 whatever the model's dtype) on the model's device."""
    embed = model.model.embed_tokens.weight
    module = LookaheadModule(model.config, n_tokens, rank, alpha, targets,
                             embed.float().std().item())
    return module.to(embed.device)


# -----------------------------------------------------------------------------
# 2. The scores: the M rows' attention over the prompt
class LookaheadHook(Hook):
    """In the forward holding the lookahead rows (the chunk's LAST M): adds their LoRA and scores
    the S prompt slots by their mean attention per layer, per KV head (or query head: training)."""

    def __init__(self, module, S, per_query_head=False):
        self.module, self.S, self.per_query_head = module, S, per_query_head
        self.scores, self.probs = {}, None

    def lora(self, layer, name, x):
        # only the last M rows get a delta: model.project adds it to those rows alone
        return self.module.delta(layer, name, x[:, -self.module.n_tokens:])

    def attn(self, layer, q, k, key_valid):
        M = self.module.n_tokens  # the softmax runs over every key they see, lookahead rows too
        # (B, H_kv, G*M, Tk): row g*M + i is query i of query head kv*G + g
        self.probs = group_attention(q[:, :, -M:], k, key_valid)
        probs = self.probs[..., :self.S]  # (B, H_kv, G*M, S): only the prompt's columns are scores
        if self.per_query_head:  # training: the mean over the M queries of each query head
            B, Hkv, _, S = probs.shape
            self.scores[layer] = probs.view(B, Hkv, -1, M, S).mean(dim=3).flatten(1, 2)  # (B, H, S)
        else:  # eviction: s[j], the mean over the M queries and the G query heads of the group
            self.scores[layer] = probs.mean(dim=2)  # (B, H_kv, S)

    def attn_output(self, layer, v):
        """The M rows' attention output (B, H, M, D) from the probabilities of their scores: SDPA
        runs for the prompt rows alone (FullKV's very call), the M rows are attended once."""
        probs, self.probs = self.probs, None  # (B, H_kv, G*M, Tk), float32
        # in the model's dtype, as HF's eager attention (training keeps no float32 copy of V)
        y = probs.to(v.dtype) @ v  # (B, H_kv, G*M, D): row g*M + i: query i of head kv*G + g
        return y.view(v.shape[0], -1, self.module.n_tokens, v.shape[-1])  # (B, H, M, D)


def lookahead_pass(model, module, cache, next_pos, per_query_head=False):
    """The two-pass form: the M rows at positions next_pos .. (an int S, or (B,)) on a copy of the
    prompt cache: their scores per layer. Gradients reach only the module (the cache has none)."""
    B, M, dev = cache.k[0].shape[0], module.n_tokens, cache.k[0].device
    positions = (torch.as_tensor(next_pos, device=dev).reshape(-1, 1)
                 + torch.arange(M, device=dev))  # (B|1, M)
    emb = module.embeddings.to(cache.k[0].dtype).expand(B, -1, -1)  # (B, M, hidden)
    hook = LookaheadHook(module, len(cache), per_query_head)
    model(inputs_embeds=emb, positions=positions.expand(B, M), cache=cache.copy(), hook=hook,
          logits_at=-1)
    return hook.scores


# -----------------------------------------------------------------------------
# 3. The target: the real answer's attention over the prompt (also the oracle's scores)
class AnswerHook(Hook):
    """Per layer, the mean attention of each row's real answer queries over the S prompt slots:
    per query head (B, H, S: the training target) or per KV head (B, H_kv, S: the oracle's)."""

    def __init__(self, S, answer_mask, per_query_head):
        self.S, self.per_query_head, self.scores = S, per_query_head, {}
        self.weights = answer_mask.float() / answer_mask.sum(-1, keepdim=True).float()  # (B, R)

    def attn(self, layer, q, k, key_valid):
        B, H, R, _ = q.shape
        Hkv, S = k.shape[1], self.S
        # (B, H_kv, G, R, S)
        probs = group_attention(q, k, key_valid)[..., :S].view(B, Hkv, H // Hkv, R, S)
        per_head = torch.einsum("bkgrs,br->bkgs", probs, self.weights)  # (B, H_kv, G, S)
        self.scores[layer] = per_head.flatten(1, 2) if self.per_query_head else per_head.mean(dim=2)


@torch.no_grad()
def answer_attention(model, cache, answers, next_pos, answer_mask=None, per_query_head=False):
    """The answers (B, R) on a copy of the prompt cache at positions next_pos (B,) onwards: {layer:
    each row's mean attention of its answer queries over the prompt, (B, H, S) or (B, H_kv, S)}.
    answer_mask (B, R): real tokens of right-padded answers (padding weighs 0). One forward."""
    B, R = answers.shape
    mask = (torch.ones(B, R, dtype=torch.bool, device=answers.device) if answer_mask is None
            else answer_mask)
    hook = AnswerHook(len(cache), mask, per_query_head)
    positions = next_pos.reshape(-1, 1) + torch.arange(R, device=answers.device)  # (B, R)
    model(answers, positions=positions.expand(B, R), cache=cache.copy(), hook=hook, logits_at=-1)
    return hook.scores


# -----------------------------------------------------------------------------
# 4. The loss
def kl_loss(gt, pred, eps=1e-8):
    """KL(gt || pred) of the L1-normalised scores {layer: (B, H, S)}, averaged over layers, heads
    and rows: the future's attention is the target, the lookahead rows' the prediction; padding
    holds 0 in both. (The paper notes this is ListNet's loss with the identity in place of exp.)"""
    losses = []
    for l, g in gt.items():
        p = g.float() / g.float().sum(-1, keepdim=True)
        q = pred[l].float() / pred[l].float().sum(-1, keepdim=True)
        losses.append((p * ((p + eps).log() - (q + eps).log())).sum(-1).mean())
    return torch.stack(losses).mean()


# -----------------------------------------------------------------------------
# 5. Eviction: the paper's inference on one screen, and LookaheadKV as a Scorer
@torch.no_grad()
def lookahead_compress(model, ids, scorer, pad_mask=None, clock=None):
    """The paper's inference for the prompt ids (B, S) with `scorer`, a LookaheadKV (its module, C,
    max-pool 7): append the M rows, one prefill with their LoRA, score, max-pool, top C per (layer,
    KV head), drop the rows' K/V, gather. Returns what eviction.compress returns (cache, first-token
    logits (B, V), next positions (B,), kept slots per layer (B, H_kv, C)), and keeps the same slots:
    the steps are eviction.py's, the ones every baseline runs through compress. clock: a Stopwatch."""
    module, S = scorer.module, ids.shape[1]
    if S <= scorer.eviction.budget or not scorer.options["one_pass"]:  # the prompt fits (nothing is
        return compress(model, ids, scorer, pad_mask, clock)  # evicted), or the two-pass form
    positions, next_pos, valid = prompt_positions(ids, pad_mask)  # (B, S), (B,) = S_b, (B, 1, S)

    # 1. append the M lookahead embeddings P after the prompt, at positions S .. S + M - 1
    x, x_positions, x_mask = append_rows(model.model.embed_tokens(ids), positions, pad_mask,
                                         module.embeddings, next_pos)  # (B, S + M, hidden)
    # 2. one prefill, the hook adding the LoRA (alpha / r) B A to the M rows alone (the prompt's K/V
    # stay the frozen model's) and 3. keeping each layer's scores: the M rows' attention over the S
    # prompt slots, the mean over the M queries and the G query heads of each KV head
    hook, cache = LookaheadHook(module, S), KVCache(model.config.num_hidden_layers)
    logits = prefill(model, x, x_positions, cache, x_mask, hook, scorer.eviction.chunk_size,
                     logits_at=S - 1, tail=module.n_tokens)[:, -1]  # (B, V): the first token's
    # 4. drop the M rows' K/V: they were scored, they are never in the cache
    cache.truncate(S)
    if clock is not None:
        clock.mark()
    scores = stack_layers(hook.scores)  # (L, B, H_kv, S)

    # 5. max-pool (width 7) and 6. the top C per (layer, KV head): Scorer.evict, every method's step
    prefilled = Prefilled(cache, hook, logits, positions, next_pos, valid, scores)
    kept = scorer.evict(scores, prefilled)  # per layer (B, H_kv, C), in slot order
    # 7. gather: each (layer, KV head) keeps its C slots; decoding goes on at position S
    keep_slots(cache, kept)
    if clock is not None:
        clock.mark()
    return cache, logits, next_pos, kept


class LookaheadKV(Scorer):
    """LookaheadKV: the M lookahead rows' mean attention over the prompt predicts the answer's. As
    the paper says ("mean-aggregated and pooled, then top-K"): max-pool 7 (as in its code's base,
    KVCache-Factory), then the top C per (layer, KV head), C in every layer. One-pass (default):
    the rows ride in the prefill's last chunk, their K/V cut after scoring; two-pass (training's
    form): a second forward of the M rows on the prompt cache. Same scores (causal; LoRA on M)."""

    default_rule = Pool("max", 7)
    default_options = dict(one_pass=True)  # False: a second forward (training's form)

    def __init__(self, eviction, module=None, response=None):
        if module is None:
            raise ValueError("method lookahead needs an adapter (a LookaheadModule): train one "
                             "with python train.py, or pass --adapter")
        self.module = module
        super().__init__(eviction)

    def prefill_hook(self, ids):
        return LookaheadHook(self.module, ids.shape[1]) if self.options["one_pass"] else None

    def appended_embeddings(self):
        return self.module.embeddings if self.options["one_pass"] else None

    def score(self, model, prefilled):
        if self.options["one_pass"]:
            return stack_layers(prefilled.hook.scores)
        return stack_layers(lookahead_pass(model, self.module, prefilled.cache,
                                           prefilled.next_pos))
