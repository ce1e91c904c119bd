"""
LookaheadKV (arXiv 2603.10899, ICLR 2026): KV-cache eviction by glimpsing into the future
without generating it. This file is the paper, in the paper's order, and nothing else.

The problem: after a prompt of S tokens is prefilled, keep only C KV slots per (layer, KV head)
and decode on that compact cache. Which C? The ones the *answer* will attend to. The paper's
answer: append M learned "lookahead" embeddings P after the prompt (positions S .. S+M-1), give
their rows, and only theirs, a LoRA, and read off where they attend:

    1. the module   every LoRA target W becomes  [X; P] W + [0; P] (alpha / r) B A
                    so the prompt rows (and the prompt's KV cache) are exactly the frozen model's
    2. the scores   s[j] = mean over the M lookahead queries i (and the G query heads of a KV head)
                    of softmax_j(q_i . k_j / sqrt(d)); the lookahead K/V are dropped after scoring
    3. the target   the attention the model's own answer pays to the prompt (answer_attention)
    4. the loss     KL(s_gt / |s_gt|_1 || s / |s|_1), averaged over layers and query heads
    5. eviction     the top C of s per (layer, KV head) (the LookaheadKV scorer; the shared steps
                    in eviction.py do the prefill, the top C and the gather)

METHOD.md has each equation next to its code; train.py trains the module, generate.py uses it.
What this repository adds beyond the paper (a selection rule, per-layer budgets, eviction while
decoding) lives in extensions/; the only trace here is the scorer's last two methods, how LookaheadKV
re-scores a cache that grew (each method's decode-phase form lives with the method).
"""
import json
import math
from pathlib import Path

import torch
import torch.nn as nn

from eviction import Pool, Scorer, WindowHook, group_attention, stack_layers
from model import Hook
from weights.checks import read_json

# -----------------------------------------------------------------------------
# 1. The lookahead module: M embeddings + a LoRA that is active on their rows only


class LookaheadModule(nn.Module):
    """M learnable lookahead embeddings P and, per layer and target projection, a LoRA
    W' = W + (alpha / r) B A applied ONLY to the lookahead rows:
        Q = [X; P] Wq + [0; P] dWq   (and the same for every other target)
    The base model is frozen and never sees the LoRA on prompt rows, so the prompt's KV cache
    is exactly the base model's. The paper's equations show q and k; its released config puts the
    LoRA on all seven linear layers (our default). targets=() keeps the embeddings alone."""

    TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    KEYS = dict(base_model=str, base_fingerprint=str, n_tokens=int, rank=int, alpha=(int, float), targets=list)

    def __init__(self, cfg, n_tokens=32, rank=8, alpha=32, targets=TARGETS, embed_std=0.02):
        super().__init__()
        bad = [t for t in targets if t not in self.TARGETS]
        if bad:
            raise ValueError(f"unknown LoRA targets {bad}; choose from {', '.join(self.TARGETS)}")
        if n_tokens < 1 or rank < 1:
            raise ValueError(f"a lookahead module needs at least 1 token and rank 1, got M = {n_tokens}, r = {rank}")
        self.cfg, self.n_tokens, self.rank, self.alpha, self.targets = cfg, n_tokens, rank, alpha, tuple(targets)
        self.info = {}  # everything else its .json says (how it was trained, how it selects), kept as is
        # random init with the scale of real token embeddings: untrained, they already act as
        # generic queries from "somewhere after the prompt", a strong baseline of their own
        self.embeddings = nn.Parameter(torch.randn(n_tokens, cfg.hidden_size) * embed_std)
        dims = self.dims(cfg)
        self.lora = nn.ModuleList()
        for _ in range(cfg.num_hidden_layers):
            p = nn.ParameterDict()
            for t in self.targets:
                d_in, d_out = dims[t]
                # as in LoRA: A random, B zero, so training starts from the base model's projections
                p[t + "_A"] = nn.Parameter(torch.empty(rank, d_in).uniform_(-1, 1) / math.sqrt(d_in))
                p[t + "_B"] = nn.Parameter(torch.zeros(d_out, rank))
            self.lora.append(p)

    @staticmethod
    def dims(cfg):
        """(in, out) of each LoRA target's projection."""
        H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        return dict(q_proj=(hidden, H * D), k_proj=(hidden, Hkv * D), v_proj=(hidden, Hkv * D), o_proj=(H * D, hidden),
                    gate_proj=(hidden, inter), up_proj=(hidden, inter), down_proj=(inter, hidden))

    def delta(self, layer, name, x):
        """The LoRA term for rows x (B, M, in) -> (B, M, out), or None if `name` is no target."""
        if name not in self.targets:
            return None
        p = self.lora[layer]
        A, B = p[name + "_A"].to(x.dtype), p[name + "_B"].to(x.dtype)
        return (x @ A.T) @ B.T * (self.alpha / self.rank)

    def metadata(self):
        return dict(base_model=self.cfg.name, base_fingerprint=self.cfg.fingerprint(), n_tokens=self.n_tokens,
                    rank=self.rank, alpha=self.alpha, targets=list(self.targets), **self.info)

    def save(self, path):
        """path (.safetensors) + the same name with .json (metadata). Writes each to a temporary file
        first, so a failure leaves any earlier adapter at that path whole."""
        from safetensors.torch import save_file

        path = Path(path)
        if path.suffix != ".safetensors":
            raise ValueError(f"adapter path {path} must end in .safetensors (its metadata goes beside it as .json)")
        tensors = {k: v.detach().float().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(tensors, str(path.with_suffix(".safetensors.tmp")))
        path.with_suffix(".json.tmp").write_text(json.dumps(self.metadata(), indent=2) + "\n")
        path.with_suffix(".safetensors.tmp").replace(path)
        path.with_suffix(".json.tmp").replace(path.with_suffix(".json"))

    @classmethod
    def load(cls, path, cfg, device="cpu"):
        """An adapter saved by save(); ValueError naming the file and the key when it is not one."""
        from safetensors.torch import load_file

        path, meta_file = Path(path), Path(path).with_suffix(".json")
        if path.suffix != ".safetensors" or not path.is_file() or not meta_file.is_file():
            raise FileNotFoundError(f"adapter {path} (a .safetensors file and its .json) not found: "
                                    "train one with python train.py")
        meta = read_json(meta_file, "retrain the adapter")
        try:
            tensors = load_file(str(path))
        except Exception as e:
            raise ValueError(f"adapter {path} is not a readable safetensors file ({str(e).splitlines()[0]}): "
                             "retrain it") from None
        cls.check_metadata(meta, meta_file, cfg, path.stat().st_size)
        m = cls(cfg, meta["n_tokens"], meta["rank"], meta["alpha"], meta["targets"])
        m.info = {k: v for k, v in meta.items() if k not in m.metadata()}
        want = m.state_dict()
        for name, t in want.items():
            if name not in tensors:
                raise ValueError(f"adapter {path} lacks tensor {name!r} that its .json implies: retrain it")
            if not tensors[name].is_floating_point():  # an int or bool tensor would load as garbage, silently
                raise ValueError(f"adapter {path}: tensor {name!r} is stored as {tensors[name].dtype}, not a floating "
                                 "type: retrain it")
            if tensors[name].shape != t.shape:
                raise ValueError(f"adapter {path}: tensor {name!r} has shape {tuple(tensors[name].shape)}, its .json "
                                 f"implies {tuple(t.shape)}: retrain it")
            if not torch.isfinite(tensors[name]).all():
                raise ValueError(f"adapter {path}: tensor {name!r} holds NaN or inf: retrain it")
        extra = sorted(set(tensors) - set(want))
        if extra:
            raise ValueError(f"adapter {path} has tensor {extra[0]!r} that its .json does not describe: retrain it")
        m.load_state_dict(tensors)
        too_large = m.scale_problem()
        if too_large:
            raise ValueError(f"adapter {path}: {too_large}: the M rows' attention would overflow to NaN and select "
                             f"at random; retrain it")
        return m.to(device)

    @classmethod
    def check_metadata(cls, meta, meta_file, cfg, n_bytes):
        """The .json's keys, before any tensor is made: their types, the base model, and M, rank and targets
        against the size of the tensors file (n_bytes), so that "rank": 10**12 is one line, not a module
        allocated (or an overflow) first."""
        for key, kind in cls.KEYS.items():
            value = meta.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                found = "missing" if key not in meta else json.dumps(value)[:40]
                what = {int: "a whole number", str: "a string", list: "a list"}.get(kind, "a number")
                raise ValueError(f"adapter metadata {meta_file}: {key!r} is {found}, not {what}: retrain the adapter")
            if isinstance(value, (int, float)) and not (math.isfinite(value) and value > 0):  # "alpha": NaN parses
                raise ValueError(f"adapter metadata {meta_file}: {key!r} is {value}, not a finite number > 0: "
                                 "retrain the adapter")
        if meta["base_fingerprint"] != cfg.fingerprint():
            raise ValueError(f"adapter {meta_file.with_suffix('.safetensors').name} was trained for "
                             f"{meta['base_model']!r} (fingerprint {meta['base_fingerprint']}), not for this model "
                             f"{cfg.name!r} ({cfg.fingerprint()}): train one for it with python train.py")
        bad = [t for t in meta["targets"] if t not in cls.TARGETS]
        if bad:  # named here, with the file; the constructor would name neither
            raise ValueError(f"adapter metadata {meta_file}: 'targets' holds {json.dumps(bad)[:60]}, not LoRA targets "
                             f"({', '.join(cls.TARGETS)}): retrain the adapter")
        dims = cls.dims(cfg)
        numbers = meta["n_tokens"] * cfg.hidden_size + cfg.num_hidden_layers * meta["rank"] * sum(
            sum(dims[t]) for t in set(meta["targets"]))
        if numbers > n_bytes:  # safetensors spends at least a byte on each
            raise ValueError(f"adapter metadata {meta_file}: n_tokens {meta['n_tokens']}, rank {meta['rank']} and its "
                             f"targets make {numbers} numbers, more than its tensors file of {n_bytes} bytes holds: "
                             "retrain the adapter")

    def scale_problem(self):
        """What makes the module's numbers too large to use (None if nothing): finite, but far past any trained
        adapter's. Bounds, not forwards: the embeddings' largest entry, and per LoRA the largest gain
        (alpha / rank) |B| |A| (Frobenius norms) it can put on a row."""
        largest = self.embeddings.detach().abs().max().item()
        if not largest <= SCALE_LIMIT:
            return f"its embeddings reach {largest:.3g}, past {SCALE_LIMIT:g} (a trained adapter's stay below 1)"
        for layer, p in enumerate(self.lora):
            for t in self.targets:
                gain = self.alpha / self.rank * (p[t + "_A"].detach().norm() * p[t + "_B"].detach().norm()).item()
                if not gain <= SCALE_LIMIT:
                    return (f"its LoRA on layer {layer}'s {t} has gain (alpha / rank) |B| |A| = {gain:.3g}, past "
                            f"{SCALE_LIMIT:g} (a trained adapter's is about 10; is \"alpha\" {self.alpha} right?)")
        return None


SCALE_LIMIT = 1e6  # LookaheadModule.scale_problem: far past a trained adapter (~10), far below float overflow


def untrained_module(model, n_tokens=32, rank=8, alpha=32, targets=LookaheadModule.TARGETS):
    """The module before training, for `model`: P drawn with the std of its token embeddings (so the
    M rows start at the scale of real tokens), LoRA B = 0 (so they start as the base model's own
    projections). Float32 on the model's device: the module trains in float32 whatever the model's
    dtype. Untrained, the M rows already act as generic queries from "just after the prompt": a
    strong baseline of their own, and the row every trained adapter is compared with."""
    embed = model.model.embed_tokens.weight
    module = LookaheadModule(model.config, n_tokens, rank, alpha, targets, embed.float().std().item())
    return module.to(embed.device)


# -----------------------------------------------------------------------------
# 2. The scores: the M rows' attention over the prompt


class LookaheadHook(WindowHook):
    """Run inside the forward that contains the lookahead rows (the LAST M rows of the chunk):
    adds their LoRA delta and scores the prompt with their attention (WindowHook: the mean over
    the M queries and the GQA group, or per query head for training)."""

    keep_probs = True

    def __init__(self, module, S, per_query_head=False):
        super().__init__(module.n_tokens, S, per_query_head=per_query_head)
        self.module = module

    def lora(self, layer, name, x):
        # only the last M rows get a delta: model.project adds it to those rows alone
        return self.module.delta(layer, name, x[:, -self.n:])

    def attn_output(self, layer, v):
        """The M rows' attention output (B, H, M, D), from the probabilities their scores were read from:
        the model runs SDPA for the prompt rows alone (FullKV's very call, so the prompt's cache is FullKV's
        to the bit) and the M rows are attended for once, not twice."""
        probs, self.probs = self.probs, None  # (B, H_kv, G*M, Tk), float32
        # in the model's dtype, as HF's eager attention does (training keeps no float32 copy of V for backward)
        y = probs.to(v.dtype) @ v  # (B, H_kv, G*M, D): row g*M + t is query t of query head kv*G + g
        return y.view(v.shape[0], -1, self.n, v.shape[-1])  # (B, H, M, D)


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
# 3. The target: the real answer's attention over the prompt (also the oracle's scores, recall's truth)


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
# 4. The loss


def kl_loss(gt, pred, eps=1e-8):
    """KL(gt || pred) of the L1-normalised scores, averaged over layers and heads (and batch rows):
    the future's attention is the target distribution, the lookahead rows' the prediction. gt and
    pred: {layer: (B, H, S)}; padding slots hold 0 in both and add nothing. (The paper notes this
    is ListNet's loss with the identity in place of exp.)"""
    losses = []
    for l, g in gt.items():
        p = g.float() / g.float().sum(-1, keepdim=True)
        q = pred[l].float() / pred[l].float().sum(-1, keepdim=True)
        losses.append((p * ((p + eps).log() - (q + eps).log())).sum(-1).mean())
    return torch.stack(losses).mean()


# -----------------------------------------------------------------------------
# 5. Eviction: LookaheadKV as a Scorer (eviction.py does the prefill, the top C and the gather)


class LookaheadKV(Scorer):
    """LookaheadKV: M learned embeddings after the prompt, at positions S .. S+M-1, with a LoRA on
    their rows only (LookaheadModule). Their mean attention over the prompt predicts the answer's;
    the top C per (layer, KV head) are kept, C in every layer. The paper's text pools the scores before
    the top C ("mean-aggregated and pooled", max-pool 7 in KVCache-Factory, its code's base: --pool max:7);
    unless told otherwise this class selects unpooled, our variant. An adapter may ship its own selection
    rule or per-layer budgets (its .json): methods.make_scorer applies them.
    One-pass (default): the rows ride in the prefill's last chunk and their K/V are cut off after
    scoring; two-pass: a second forward of the M rows on top of the prompt cache (the training form).
    Both give the same scores (causal attention, LoRA on the lookahead rows only)."""

    default_rule = Pool("none")
    settings = dict(one_pass=True)  # the M rows ride in the prefill (fast); False: a 2nd forward (training's form)

    def __init__(self, eviction, module=None, response=None):
        if module is None:
            raise ValueError("method lookahead needs an adapter (a LookaheadModule): train one with python "
                             "train.py, or pass --adapter")
        self.module = module
        super().__init__(eviction)

    def prefill_hook(self, ids):
        return LookaheadHook(self.module, ids.shape[1]) if self.own["one_pass"] else None

    def extra_rows(self):
        return self.module.embeddings if self.own["one_pass"] else None

    def score(self, model, run):
        if self.own["one_pass"]:
            return stack_layers(run.hook.scores)
        return stack_layers(lookahead_pass(model, self.module, run.cache, run.next_pos))
