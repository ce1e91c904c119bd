"""
A from-scratch Llama / Mistral / Qwen2 / Qwen3 decoder in one file, loading Hugging Face
checkpoints directly (config.json + *.safetensors).

Top to bottom: the config (every family difference in one place), RMSNorm, RoPE, the Hook,
attention (GQA through SDPA), the SwiGLU MLP, the KV cache, the model and the loader. What a
config.json or a checkpoint may not be is refused in support/checks.py.

Two things the KV-eviction code relies on:
- Positions are explicit and separate from cache slots: after eviction a layer keeps C slots,
  but the next token's position is still S. RoPE uses `positions`; the cache stores any keys.
- A `Hook` is the only door for an eviction method into the model: it may add a LoRA delta to
  any projection (LookaheadKV's "masked LoRA"), see every layer's queries and keys after RoPE,
  supply the attention output of the chunk's last rows, and see the final hidden states.
"""

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from support import checks

# -----------------------------------------------------------------------------
# Config: all differences between the supported families live here.
@dataclass
class ModelConfig:
    model_type: str = "llama"  # llama, mistral, qwen2 or qwen3
    vocab_size: int = 49152  # rows of the token embedding and of the LM head
    hidden_size: int = 576  # the residual stream's width
    intermediate_size: int = 1536  # the SwiGLU MLP's inner width
    num_hidden_layers: int = 30
    num_attention_heads: int = 9  # query heads
    num_key_value_heads: int = 3  # GQA: each KV head serves heads // this query heads
    head_dim: int = 64  # explicit in Qwen3 / newer Mistral configs, else hidden // heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0  # RoPE's base: wavelengths 2 pi theta^(2i / head_dim)
    rope_scaling: dict | None = None  # {"rope_type": "llama3", "factor", ...}
    max_position_embeddings: int = 8192  # the longest context the model was trained for
    sliding_window: int | None = None  # Mistral v0.1: not implemented, so it caps the context
    tie_word_embeddings: bool = True  # lm_head shares the token embedding (SmolLM2, small Qwens)
    attention_bias: bool = False  # Qwen2 has biases on q/k/v
    qk_norm: bool = False  # Qwen3 RMS-normalises q and k per head before RoPE
    eos_token_id: list = field(default_factory=list)  # the ids that end an answer
    name: str = ""  # folder name, for messages and adapter metadata

    @classmethod
    def from_hf_config(cls, path):
        """Read a Hugging Face config.json (folder or file), checked by support/checks.py."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        raw = checks.check_config(file)  # the JSON object, checked; HF's nulls ("not set") dropped
        mt, heads = raw["model_type"], raw["num_attention_heads"]
        # transformers >= 4.56 writes rope_parameters (theta included), older ones rope_scaling
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        llama3 = rope.get("rope_type", rope.get("type")) == "llama3"  # the only scaling
        eos = raw.get("eos_token_id", [])  # HF writes one id or a list
        return cls(
            model_type=mt,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads", heads),  # absent: MHA
            head_dim=raw.get("head_dim", raw["hidden_size"] // heads),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
            rope_scaling=dict(rope) if llama3 else None,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            # Mistral v0.1 always has its window; Qwen's is on only with use_sliding_window
            sliding_window=(raw.get("sliding_window")
                            if mt == "mistral" or raw.get("use_sliding_window") else None),
            tie_word_embeddings=raw.get("tie_word_embeddings", mt != "mistral"),
            attention_bias=raw.get("attention_bias", mt == "qwen2"),  # Qwen2 configs omit the key
            qk_norm=mt == "qwen3",
            eos_token_id=eos if isinstance(eos, list) else [eos],
            name=path.name if path.is_dir() else path.parent.name,
        )

    @property
    def max_context(self):
        return min(self.max_position_embeddings, self.sliding_window or math.inf)

    def fingerprint(self):
        """A short hash of the architecture, so an adapter refuses to load on another model."""
        keys = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "rope_theta", "rope_scaling", "tie_word_embeddings", "attention_bias", "qk_norm")
        s = json.dumps({k: getattr(self, k) for k in keys}, sort_keys=True)
        return hashlib.sha256(s.encode()).hexdigest()[:16]


# -----------------------------------------------------------------------------
# Building blocks
class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # normalise in float32 as HF does, then cast back before the scale
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg):
    """Inverse frequencies of RoPE (head_dim // 2,), with Llama-3.1's scaling."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta
                      ** (torch.arange(0, d, 2, dtype=torch.float32, device="cpu") / d))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    # llama3: long wavelengths slowed by `factor`, short ones kept, the band between interpolated
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_ctx / wavelen - lo) / (hi - lo)).clamp(0, 1)  # 0 below the band, 1 above it
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def rope_cos_sin(positions, inv_freq, dtype):
    """RoPE's cos and sin at positions (B, T): (B, 1, T, head_dim) each, broadcast over heads. A
    function of its own so that its float32 angles are freed before the layers run (as in HF)."""
    freqs = positions[..., None].float() * inv_freq  # (B, T, D/2), float32 like HF
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, T, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    # split-halves rotation (HF layout): pairs are (x[i], x[i + D/2]), not interleaved
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Hook:
    """The one door for a KV-eviction method into the model, per forward call (a "chunk").

    lora(layer, name, x): a term added to projection `name` for input x (B, T, in), or None;
        it may cover only the last T' rows (B, T', out): LookaheadKV's LoRA, on its rows only.
    attn(layer, q, k, key_valid): queries (B, H, Tq, D) after RoPE, at the LAST Tq of the keys
        the chunk sees (B, H_kv, Tk, D), cache included; key_valid (B, 1|H_kv, Tk) bool or None.
    attn_output(layer, v): right after attn, the output (B, H, n, D) of the chunk's LAST n
        queries whose softmax the hook computed (LookaheadHook), or None: SDPA does the rest.
    hidden(h): the chunk's final normed hidden states (B, T, hidden).
    """

    def lora(self, layer, name, x):
        return None

    def attn(self, layer, q, k, key_valid):
        pass

    def attn_output(self, layer, v):
        return None

    def hidden(self, h):  # what the LM head reads (a selection rule may ask)
        pass


class Hooks(Hook):
    """Several hooks watching one forward (a method's and its selection rule's); at most one
    adds a LoRA. prefill() hands each the chunks it asks for (every_chunk, or the last one)."""

    def __init__(self, *hooks):
        self.hooks = [x for h in hooks if h is not None
                      for x in (h.hooks if isinstance(h, Hooks) else [h])]

    def lora(self, layer, name, x):
        return next((d for h in self.hooks
                     if (d := h.lora(layer, name, x)) is not None), None)

    def attn(self, layer, q, k, key_valid):
        for h in self.hooks:
            h.attn(layer, q, k, key_valid)

    def attn_output(self, layer, v):
        return next((y for h in self.hooks
                     if (y := h.attn_output(layer, v)) is not None), None)

    def hidden(self, h):
        for hook in self.hooks:
            hook.hidden(h)


def project(module, name, x, layer, hook):
    """module.<name>(x) plus the hook's term, if any, which may cover only the LAST T' rows."""
    y = getattr(module, name)(x)
    if hook is not None and (delta := hook.lora(layer, name, x)) is not None:
        if delta.shape[1] == y.shape[1]:
            y = y + delta
        else:  # in place on the fresh output: no (T, out) tensor of zeros for the other rows
            y[:, -delta.shape[1]:] += delta
    return y


def attention_mask(Tq, Tk, key_valid, device):
    """Bool mask (B|1, H_kv|1, Tq, Tk), True = may attend, for Tq queries at the last Tq of Tk
    slots: bottom-right causal (SDPA's is_causal is top-left aligned, wrong with a cache)."""
    q_slot = torch.arange(Tk - Tq, Tk, device=device)[:, None]  # (Tq, 1)
    k_slot = torch.arange(Tk, device=device)[None, :]  # (1, Tk)
    mask = (k_slot <= q_slot)[None, None]  # (1, 1, Tq, Tk)
    if key_valid is not None:
        # no padding / empty slot, except a query's own: a left-padding row all -inf would be NaN
        mask = mask & (key_valid[:, :, None, :] | (k_slot == q_slot))
    return mask


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.head_dim = (cfg.num_attention_heads,
                                                      cfg.num_key_value_heads, cfg.head_dim)
        hd, b = cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_head * hd, bias=b)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv_head * hd, bias=b)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv_head * hd, bias=b)
        self.o_proj = nn.Linear(self.n_head * hd, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache, pad_mask, hook):
        B, T, _ = x.shape
        i = self.layer_idx
        q = project(self, "q_proj", x, i, hook).view(B, T, self.n_head, self.head_dim)
        k = project(self, "k_proj", x, i, hook).view(B, T, self.n_kv_head, self.head_dim)
        v = project(self, "v_proj", x, i, hook).view(B, T, self.n_kv_head, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, H, T, D)
        k = apply_rope(k.transpose(1, 2), cos, sin)  # (B, H_kv, T, D)
        v = v.transpose(1, 2)  # (B, H_kv, T, D)
        key_valid = None
        if cache is not None:
            k, v, key_valid = cache.append(i, k, v, pad_mask)  # (B, H_kv, Tk, D), Tk = cached + T
        elif pad_mask is not None:
            key_valid = pad_mask[:, None, :]  # (B, 1, T)
        if hook is not None:
            hook.attn(i, q, k, key_valid)
        y_last = None if hook is None else hook.attn_output(i, v)  # (B, H, n, D) or None
        if y_last is None:
            y = self.sdpa(q, k, v, key_valid)  # (B, H, T, D)
        else:  # the hook attended its last n rows already: the same values, one softmax fewer
            y = self.sdpa_before_last(q, k, v, key_valid, y_last)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)
        return project(self, "o_proj", y, i, hook)

    def sdpa_before_last(self, q, k, v, key_valid, y_last):
        """sdpa(q, k, v, key_valid) when a hook already computed the output y_last (B, H, n, D) of
        the last n queries (LookaheadHook, from the probabilities of its scores): SDPA runs for the
        other rows alone, over the keys before the last n (causal: no earlier row sees those), and
        y_last joins after them. Equal to sdpa() on every row (tests/test_model.py)."""
        T, n, Tk = q.shape[2], y_last.shape[2], k.shape[2]
        if n == T:
            return y_last
        valid = None if key_valid is None else key_valid[..., : Tk - n]
        # (B, H, T-n, D)
        y = self.sdpa(q[:, :, : T - n], k[:, :, : Tk - n], v[:, :, : Tk - n], valid)
        return torch.cat([y, y_last], dim=2)  # (B, H, T, D)

    def sdpa(self, q, k, v, key_valid):
        """Causal attention of q (B, H, Tq, D), at the last Tq slots of k, v (B, H_kv, Tk, D)."""
        T, Tk = q.shape[2], k.shape[2]
        if key_valid is None and T == Tk:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        if key_valid is None and T == 1:  # one new token sees everything
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        if key_valid is None:
            # a chunk on a cache: bottom-right causal, as a CausalBias so CUDA keeps its flash
            # kernel (GQA, no explicit mask); on CPU the mask of attention_mask(T, Tk, None),
            # served ~1.4x slower than is_causal: so eviction.prefill runs one call where memory
            # allows (max_chunk) and comes here only past that, or for a turn added to a cache
            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, Tk),
                                                  enable_gqa=True)
        mask = attention_mask(T, Tk, key_valid, q.device)  # (B|1, H_kv|1, T, Tk)
        if mask.shape[1] > 1:  # per-KV-head validity (after eviction): one row per query head
            mask = mask.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class MLP(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, hook):
        i = self.layer_idx
        h = F.silu(project(self, "gate_proj", x, i, hook)) * project(self, "up_proj", x, i, hook)
        return project(self, "down_proj", h, i, hook)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, layer_idx)

    def forward(self, x, cos, sin, cache, pad_mask, hook):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, pad_mask, hook)
        return x + self.mlp(self.post_attention_layernorm(x), hook)


class KVCache:
    """Per layer: keys and values (B, H_kv, T, D) and which slots hold a real token. Slots are not
    positions (RoPE was applied before a key was stored): eviction may drop or reorder them freely.
    valid[l]: None (all real) or bool (B, 1, T); (B, H_kv, T) after eviction (per KV head)."""

    def __init__(self, n_layers):
        self.k, self.v, self.valid = [None] * n_layers, [None] * n_layers, [None] * n_layers

    def __len__(self):  # number of slots (the same in every layer)
        return 0 if self.k[0] is None else self.k[0].shape[2]

    def append(self, layer, k, v, pad_mask=None):
        """Add a chunk's keys/values (B, H_kv, T, D); pad_mask (B, T) marks real tokens."""
        new_valid = None if pad_mask is None else pad_mask[:, None, :]  # (B, 1, T)
        if self.k[layer] is not None:
            old_valid = self.valid[layer]
            if old_valid is not None or new_valid is not None:
                B, T_old = k.shape[0], self.k[layer].shape[2]
                all_valid = lambda T: torch.ones(B, 1, T, dtype=torch.bool, device=k.device)
                old = old_valid if old_valid is not None else all_valid(T_old)
                new = new_valid if new_valid is not None else all_valid(k.shape[2])
                if old.shape[1] != new.shape[1]:
                    new = new.expand(-1, old.shape[1], -1)
                new_valid = torch.cat([old, new], dim=2)
            k = torch.cat([self.k[layer], k], dim=2)
            v = torch.cat([self.v[layer], v], dim=2)
        self.k[layer], self.v[layer], self.valid[layer] = k, v, new_valid
        return k, v, new_valid

    def gather(self, layer, idx):
        """Keep, in layer `layer`, the slots idx (B, H_kv, C) per batch row and KV head."""
        k = self.k[layer]
        D = k.shape[-1]
        self.k[layer] = k.gather(2, idx[..., None].expand(-1, -1, -1, D))  # (B, H_kv, C, D)
        self.v[layer] = self.v[layer].gather(2, idx[..., None].expand(-1, -1, -1, D))
        if self.valid[layer] is not None:
            valid = self.valid[layer].expand(-1, k.shape[1], -1)
            self.valid[layer] = valid.gather(2, idx)  # (B, H_kv, C)

    def truncate(self, n):
        """Drop every slot after the first n (e.g. the lookahead tokens once they are scored)."""
        for l in range(len(self.k)):
            self.k[l], self.v[l] = self.k[l][:, :, :n], self.v[l][:, :, :n]
            if self.valid[l] is not None:
                self.valid[l] = self.valid[l][:, :, :n]

    def copy(self):
        """A shallow copy: appending to it leaves this cache as it is."""
        c = KVCache(len(self.k))
        c.k, c.v, c.valid = list(self.k), list(self.v), list(self.valid)
        return c

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        # nested names mirror the HF checkpoint: model.embed_tokens, model.layers.3.mlp.up_proj, ...
        self.model = nn.ModuleDict(dict(
            embed_tokens=nn.Embedding(cfg.vocab_size, cfg.hidden_size),
            layers=nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)),
            norm=RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
        ))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # a plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies
        self.inv_freq = rope_inv_freq(cfg)

    def forward(self, input_ids=None, positions=None, cache=None, pad_mask=None, inputs_embeds=None,
                hook=None, logits_at=None):
        """input_ids (B, T) or inputs_embeds (B, T, hidden); positions (B, T) for RoPE; cache: a
        KVCache the chunk is appended to; pad_mask (B, T) True on real tokens; hook: see Hook;
        logits_at: one row's logits only (no (T, vocab) matmul), or None. -> (B, T or 1, vocab)"""
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self.inv_freq.device != x.device:
            self.inv_freq = self.inv_freq.to(x.device)
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)  # (B, 1, T, D) each
        for layer in self.model.layers:
            x = layer(x, cos, sin, cache, pad_mask, hook)
        h = self.model.norm(x)  # (B, T, hidden)
        if hook is not None:
            hook.hidden(h)
        return self.lm_head(h if logits_at is None else h[:, logits_at].unsqueeze(1))


def default_dtype(device):
    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


def load_model(path, device="cpu", dtype=None):
    """Load config.json and *.safetensors (one file or shards) of an HF folder into parameters of
    the same names; support/checks.py refuses a checkpoint that does not fit its config.json."""
    path = Path(path)
    checks.check_folder(path)
    cfg = ModelConfig.from_hf_config(path)
    dtype = dtype or default_dtype(device)
    opened, stored = checks.open_checkpoint(path)  # [(file, safetensors)], name -> file
    checks.check_headers(path, cfg, opened, stored)  # before a layer is built
    with torch.device("meta"):  # no random init: every weight is copied from the checkpoint
        model = Transformer(cfg)
    model = model.to_empty(device=device).to(dtype)
    params = dict(model.named_parameters())  # to_empty untied lm_head.weight
    if cfg.tie_word_embeddings:
        params.pop("lm_head.weight", None)  # tied: the head is the embedding, whatever is stored
    checks.check_tensor_names(path, cfg, stored, params)  # every parameter stored, nothing else
    sums = {}  # name -> float32 sum: NaN or inf anywhere makes it so (one device sync for all)
    for fname, f in opened:
        with f, torch.no_grad():
            for name in f.keys():
                if name in params:
                    tensor = checks.read_tensor(path, fname, f, name)
                    checks.check_shape(path / fname, name, tensor.shape, params[name].shape, cfg)
                    params[name].copy_(tensor)  # cast to dtype
                    sums[name] = params[name].sum(dtype=torch.float32)
    checks.check_finite(path, stored, params, sums, dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        checks.check_tied_head(path, stored, model.lm_head.weight)  # a stored head must equal it
    model.requires_grad_(False).eval()  # the base model is frozen: only adapters ever train
    return model
