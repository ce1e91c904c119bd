"""
A from-scratch Llama / Mistral / Qwen2 / Qwen3 decoder in one file, loading Hugging Face
checkpoints directly (config.json + *.safetensors + tokenizer.json).

    from model import load_model
    model = load_model("weights/SmolLM2-135M-Instruct")          # float32 on CPU
    tok = Tokenizer("weights/SmolLM2-135M-Instruct")
    ids = torch.tensor([tok.encode(tok.chat("Hello!"))])
    cache = KVCache(model.config.num_hidden_layers)
    logits = model(ids, positions=torch.arange(ids.shape[1])[None], cache=cache)

What is here, top to bottom: the config (every family difference in one place), RMSNorm,
RoPE, attention (GQA through SDPA), the SwiGLU MLP, the KV cache, the model, the loader,
and the tokenizer with its chat formats.

Two things the KV-eviction code relies on:
- Positions are explicit and separate from cache slots. After eviction a layer keeps C
  slots, but the next token's position is still S (the prompt length): RoPE uses
  `positions`, the cache only stores whatever keys it was given.
- A `Hook` is the only door for an eviction method into the model: it may add a LoRA
  delta to any projection for the current chunk (the "masked LoRA" of LookaheadKV) and it
  sees every layer's queries and keys after RoPE (to compute the scores it needs).
"""

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

# -----------------------------------------------------------------------------
# Config: all differences between the supported families live here.

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
_REQUIRED = object()  # ConfigCheck: the key has no default
# The largest size (vocab, hidden, layers, heads, ...) config.json may state: a 32-bit signed index's reach
# (many CUDA kernels index with int32, the tokenizers library's ids are 32-bit). The largest dimension of any real
# model, a vocabulary, is ~2**18: past the limit it is a typo such as vocab_size 1e11. Within it, load_model
# still checks every size against the tensors' shapes before it builds anything.
SIZE_LIMIT = 2**31 - 1
# Positions reach RoPE as float32 (as in HF), which holds every whole number only up to 2**24: past it,
# neighbouring positions get the same rotation, so no context can be longer.
POSITION_LIMIT = 2**24
# rms_norm_eps is added to the mean square of activations of order 1 before the rsqrt: real models use
# 1e-6 .. 1e-5; near 1 it swamps the mean square and every norm's output shrinks towards 0 (issue 53:
# 1e30 answered nothing, with exit 0). 1e-2 leaves a wide margin above any real value.
EPS_LIMIT = 1e-2


def read_json(file, fix):
    """A JSON object from `file`; ValueError naming the file and `fix` (what to do) if it is not one."""
    try:
        d = json.loads(Path(file).read_bytes())
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError both are
        raise ValueError(f"{file} is not valid JSON ({short_reason(e)}): {fix}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{file} holds a JSON {type(d).__name__}, not an object: {fix}")
    return d


def short_reason(e):
    return " ".join(str(e).split())[:200] or type(e).__name__


class ConfigCheck:
    """Reads typed fields out of a config dict; a wrong one is a ValueError naming file, key, value and fix."""

    def __init__(self, file, d, prefix=""):
        self.file, self.d, self.prefix = file, d, prefix

    def fail(self, key, want):
        value = json.dumps(self.d.get(key))[:60]
        raise ValueError(f"{self.file}: {self.prefix}{key} is {value}, it must be {want}: fix that key, "
                         f"or use the config.json that came with these weights")

    def get(self, key, default):
        if default is _REQUIRED:
            if key not in self.d:
                self.fail(key, "present")
            return self.d[key]
        v = self.d.get(key)
        return default if v is None else v  # HF writes null for "not set"

    def whole(self, key, default=_REQUIRED, limit=SIZE_LIMIT):
        """A whole number from 1 to `limit`; JSON's 1e11 or 64.0 is a float, refused (no size is one)."""
        v = self.get(key, default)
        if not (isinstance(v, int) and not isinstance(v, bool) and 0 < v <= limit):
            self.fail(key, f"a whole number from 1 to {limit} (digits only, no decimal point or exponent)")
        return v

    def positive(self, key, default=_REQUIRED, above=0, at_most=math.inf, why=""):
        """A finite number > `above` and <= `at_most`; `why` says where the bounds come from."""
        v = self.get(key, default)
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and above < v <= at_most):
            self.fail(key, f"a finite number > {above}" + (f" and <= {at_most}" if at_most < math.inf else "")
                      + (f" ({why})" if why else ""))
        return v

    def flag(self, key, default):
        v = self.get(key, default)
        if not isinstance(v, bool):
            self.fail(key, "true or false")
        return v


@dataclass
class ModelConfig:
    model_type: str = "llama"
    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3  # GQA: each KV head serves num_attention_heads // this query heads
    head_dim: int = 64  # explicit in Qwen3 / newer Mistral configs, else hidden // heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3", "factor", "low_freq_factor", ...}
    max_position_embeddings: int = 8192
    sliding_window: int | None = None  # Mistral v0.1: we do not implement it, so it caps the context
    tie_word_embeddings: bool = True  # lm_head shares the token embedding (SmolLM2, small Qwens)
    attention_bias: bool = False  # Qwen2 has biases on q/k/v
    qk_norm: bool = False  # Qwen3 RMS-normalises q and k per head before RoPE
    eos_token_id: list = field(default_factory=list)
    name: str = ""  # folder name, for messages and adapter metadata

    @classmethod
    def from_hf_config(cls, path):
        """Read a Hugging Face config.json (a folder or the file itself). Every field we use is checked
        (type and range): a bad one is a ValueError naming the file, the key, its value and what to do."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        check = ConfigCheck(file, read_json(file, redo(file.parent)))
        mt = read_family(check)
        sizes = read_sizes(check)
        rope = read_rope(check)
        eos = read_eos(check, sizes["vocab_size"])
        sliding_window = read_sliding_window(check, mt)
        return cls(
            model_type=mt,
            **sizes,
            **rope,
            rms_norm_eps=check.positive("rms_norm_eps", default=1e-6, at_most=EPS_LIMIT,
                                        why="it is added to a mean square of order 1; real models use 1e-6 .. 1e-5"),
            max_position_embeddings=check.whole("max_position_embeddings", default=4096, limit=POSITION_LIMIT),
            sliding_window=sliding_window,
            tie_word_embeddings=check.flag("tie_word_embeddings", default=mt != "mistral"),
            attention_bias=check.flag("attention_bias", default=mt == "qwen2"),  # Qwen2 configs omit the key
            qk_norm=mt == "qwen3",
            eos_token_id=eos,
            name=path.name if path.is_dir() else path.parent.name,
        )

    @property
    def max_context(self):
        return min(self.max_position_embeddings, self.sliding_window or math.inf)

    def fingerprint(self):
        """A short hash of the architecture, so an adapter refuses to load on another model."""
        import hashlib

        keys = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "intermediate_size", "rope_theta", "rope_scaling",
                "tie_word_embeddings", "attention_bias", "qk_norm")
        s = json.dumps({k: getattr(self, k) for k in keys}, sort_keys=True)
        return hashlib.sha256(s.encode()).hexdigest()[:16]


# The steps of from_hf_config, one group of fields each.


def read_family(check):
    """model_type, and the MLP activation every supported family shares (any other would compute silently wrong)."""
    mt = check.d.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {mt!r} in {check.file} is not supported; "
                         f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if check.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers: two names for one function
        check.fail("hidden_act", "\"silu\", the SwiGLU activation of every family this file implements")
    return mt


def read_sizes(check):
    """The dimensions: vocab, hidden, MLP, layers, query heads, key/value heads and the head size."""
    names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in names if k not in check.d]
    if missing:
        raise ValueError(f"{check.file} lacks {', '.join(missing)}: not a complete Hugging Face model config")
    sizes = {k: check.whole(k) for k in names}
    heads = sizes["num_attention_heads"]
    kv_heads = check.whole("num_key_value_heads", default=heads)
    if heads % kv_heads:
        check.fail("num_key_value_heads", f"a divisor of num_attention_heads ({heads}; each key/value "
                   f"head serves a whole group of query heads)")
    return dict(sizes, num_key_value_heads=kv_heads, head_dim=read_head_dim(check, sizes["hidden_size"], heads))


def read_head_dim(check, hidden, heads):
    """head_dim if config.json says it (Qwen3, newer Mistral), else hidden // heads; even, as RoPE needs."""
    if check.d.get("head_dim") is not None:
        head_dim = check.whole("head_dim")
        if head_dim % 2:
            check.fail("head_dim", "an even number (RoPE rotates pairs of channels)")
        return head_dim
    if hidden % heads:
        check.fail("num_attention_heads", f"a divisor of hidden_size ({hidden}) when config.json has no head_dim")
    if hidden // heads % 2:
        check.fail("num_attention_heads", f"such that hidden_size / num_attention_heads (the head size, "
                   f"{hidden // heads}) is even (RoPE rotates pairs of channels)")
    return hidden // heads


def read_rope(check):
    """rope_theta and rope_scaling (llama3 only). Older configs say rope_theta + rope_scaling,
    transformers >= 4.56 says rope_parameters (theta included)."""
    d = check.d
    rope_key = "rope_parameters" if d.get("rope_parameters") not in (None, {}) else "rope_scaling"
    rope = d.get(rope_key)
    if rope is None:
        rope = {}
    elif not isinstance(rope, dict):
        check.fail(rope_key, "an object such as {\"rope_type\": \"llama3\", \"factor\": 8.0, ...} or null")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} in {check.file} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    rope_check = ConfigCheck(check.file, rope, prefix=rope_key + ".")
    # theta > 1: RoPE's wavelengths 2 pi theta^(2i / head_dim) must grow along the channels; theta 1 makes them
    # all equal, below 1 they shrink (real models: 1e4 .. 1e6)
    why = "RoPE's wavelengths 2 pi theta^(2i / head_dim) grow along the channels only then; real models use 1e4 .. 1e6"
    theta = (rope_check.positive("rope_theta", above=1, why=why) if "rope_theta" in rope
             else check.positive("rope_theta", default=10000.0, above=1, why=why))
    if rope_type == "llama3":
        for k in ("factor", "low_freq_factor", "high_freq_factor"):
            rope_check.positive(k)
        rope_check.whole("original_max_position_embeddings")
        if not rope["high_freq_factor"] > rope["low_freq_factor"]:
            rope_check.fail("high_freq_factor", f"greater than low_freq_factor ({rope['low_freq_factor']})")
    return dict(rope_theta=theta, rope_scaling=dict(rope) if rope_type == "llama3" else None)


def read_eos(check, vocab_size):
    """eos_token_id as a list (HF writes one id, a list or null); each one a token the model can produce."""
    eos = check.d.get("eos_token_id")
    eos = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in eos):
        check.fail("eos_token_id", "a token id (a whole number >= 0), a list of them, or null")
    if any(e >= vocab_size for e in eos):  # the LM head could never produce it: decoding would never stop on it
        check.fail("eos_token_id", f"below vocab_size ({vocab_size})")
    return eos


def read_sliding_window(check, model_type):
    """Mistral v0.1's window, or Qwen's when use_sliding_window is on: we do not implement it, so it caps the context."""
    if model_type != "mistral" and not check.flag("use_sliding_window", default=False):
        return None
    return None if check.d.get("sliding_window") is None else check.whole("sliding_window")


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
    """Inverse frequencies of RoPE (head_dim // 2,), with Llama-3.1's frequency-dependent scaling."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device="cpu") / d))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    # llama3: long wavelengths are slowed down by `factor`, short ones kept, the band between
    # them interpolated smoothly (one torch.where instead of a loop over frequencies)
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_ctx / wavelen - lo) / (hi - lo)).clamp(0, 1)  # 0 below the band, 1 above it
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def apply_rope(x, cos, sin):
    # split-halves rotation (HF layout): pairs are (x[i], x[i + D/2]), not interleaved
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Hook:
    """The one door for a KV-eviction method into the model, per forward call (a "chunk").

    lora(layer, name, x): an extra term added to projection `name` ("q_proj", ..., "down_proj")
        of layer `layer` for input x (B, T, in), or None; it may cover only the last T' rows
        (B, T', out). LookaheadKV adds its LoRA here, on the lookahead rows only.
    attn(layer, q, k, key_valid): sees the queries (B, H, Tq, D) after RoPE and all keys the
        chunk attends to (B, H_kv, Tk, D), cache included; the chunk's queries sit at the LAST Tq
        key slots. key_valid (B, 1 or H_kv, Tk) bool or None (all valid). Scorers read attention
        from here; the model does not change.
    attn_output(layer, v): called right after attn. A hook that computed the softmax of the chunk's
        LAST n queries in attn (LookaheadHook: the M lookahead rows, whose attention is their score)
        may return their attention output (B, H, n, D) from it: the model then runs SDPA on the other
        rows only, so those n rows are attended for once, not twice. None (the default): SDPA does all.
    hidden(h): sees the chunk's final normed hidden states (B, T, hidden).
    """

    def lora(self, layer, name, x):
        return None

    def attn(self, layer, q, k, key_valid):
        pass

    def attn_output(self, layer, v):
        return None

    def hidden(self, h):  # what the LM head reads: a selection rule may ask how predictable the prompt was
        pass


def project(module, name, x, layer, hook):
    """module.<name>(x), plus the hook's term for this projection if it has one. The term may
    cover only the LAST rows of the chunk (B, T' <= T, out): the rows before it get nothing."""
    y = getattr(module, name)(x)
    if hook is not None and (delta := hook.lora(layer, name, x)) is not None:
        if delta.shape[1] == y.shape[1]:
            y = y + delta
        else:  # in place on the fresh output: no (T, out) tensor of zeros for the other rows
            y[:, -delta.shape[1]:] += delta
    return y


def attention_mask(Tq, Tk, key_valid, device):
    """Boolean mask (B or 1, H_kv or 1, Tq, Tk), True = may attend, for a chunk of Tq queries
    that sits at the last Tq of Tk key slots (bottom-right causal: SDPA's is_causal is top-left
    aligned, which is wrong as soon as there is a cache)."""
    q_slot = torch.arange(Tk - Tq, Tk, device=device)[:, None]  # (Tq, 1)
    k_slot = torch.arange(Tk, device=device)[None, :]  # (1, Tk)
    mask = (k_slot <= q_slot)[None, None]  # (1, 1, Tq, Tk)
    if key_valid is not None:
        # padding / empty slots are never attended to, except a query's own slot, so that the
        # rows of left-padding tokens are not all -inf (they would give NaN; they are never used)
        mask = mask & (key_valid[:, :, None, :] | (k_slot == q_slot))
    return mask


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
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
        y_last = None
        if hook is not None:
            hook.attn(i, q, k, key_valid)
            y_last = hook.attn_output(i, v)  # (B, H, n, D) for the chunk's last n queries, or None
        # SDPA attends for every row, or for all but the hook's last n: no earlier row sees their keys (causal)
        n, Tk = 0 if y_last is None else y_last.shape[2], k.shape[2]
        valid = None if key_valid is None else key_valid[..., : Tk - n]
        y = self.sdpa(q[:, :, : T - n], k[:, :, : Tk - n], v[:, :, : Tk - n], valid) if n < T else None  # (B, H, T - n, D)
        parts = [part.transpose(1, 2) for part in (y, y_last) if part is not None]  # (B, T - n and n, H, D)
        y = torch.cat(parts, dim=1).reshape(B, T, self.n_head * self.head_dim)  # one copy, as a reshape alone makes
        return project(self, "o_proj", y, i, hook)

    def sdpa(self, q, k, v, key_valid):
        """Causal attention of q (B, H, Tq, D), the last Tq of the Tk slots of k, v (B, H_kv, Tk, D)."""
        T, Tk = q.shape[2], k.shape[2]
        if key_valid is None and T == Tk:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        if key_valid is None and T == 1:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # one new token sees everything
        if key_valid is None:
            # a chunk on top of a cache: causal, aligned bottom-right. As a CausalBias rather than a
            # bool mask, so CUDA keeps its flash kernel (which takes GQA but no explicit mask); on
            # CPU it becomes the same (T, Tk) mask as attention_mask(T, Tk, None)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, Tk), enable_gqa=True)
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
        h = F.silu(project(self, "gate_proj", x, i, hook)) * project(self, "up_proj", x, i, hook)  # SwiGLU
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


# -----------------------------------------------------------------------------
# KV cache


class KVCache:
    """Per layer: keys and values (B, H_kv, T, D) and which slots hold a real token.

    Slots are not positions: RoPE was applied before a key was stored, so the cache may drop
    or reorder slots freely (eviction) without touching any position.
    valid[l] is None (every slot real) or a bool tensor (B, 1, T) before eviction and
    (B, H_kv, T) after it, since each KV head may then keep different tokens.
    """

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
                all_valid = lambda T: torch.ones(B, 1, T, dtype=torch.bool, device=k.device)  # (B, 1, T)
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


# -----------------------------------------------------------------------------
# The model


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
        """input_ids (B, T) or inputs_embeds (B, T, hidden); positions (B, T) the RoPE position of
        each token; cache: a KVCache that the chunk is appended to; pad_mask (B, T) True for
        real tokens (left padding); hook: see Hook; logits_at: None for the logits of every row,
        or one row index (a prompt's other logits are never used: skip a (T, vocab) matmul).
        Returns logits (B, T or 1, vocab)."""
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self.inv_freq.device != x.device:
            self.inv_freq = self.inv_freq.to(x.device)
        freqs = positions[..., None].float() * self.inv_freq  # (B, T, D/2), float32 like HF
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, T, D), broadcast over heads
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, cache, pad_mask, hook)
        h = self.model.norm(x)  # (B, T, hidden)
        if hook is not None:
            hook.hidden(h)
        return self.lm_head(h if logits_at is None else h[:, logits_at].unsqueeze(1))  # (B, T or 1, vocab)


# -----------------------------------------------------------------------------
# Loading a Hugging Face folder


def default_dtype(device):
    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


def load_model(path, device="cpu", dtype=None):
    """Load config.json and *.safetensors (single or sharded) from an HF folder. Every tensor is checked:
    its name and shape against config.json, its values finite."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json there; pass a Hugging Face folder (config.json, "
                                f"*.safetensors, tokenizer.json)")
    cfg = ModelConfig.from_hf_config(path)
    dtype = dtype or default_dtype(device)
    fix = redo(path)
    files, weight_map = weight_files(path, fix)
    opened = open_files(path, files, fix)
    stored = stored_tensors(path, opened, weight_map, fix)
    # config.json against the tensors' headers (no tensor read) before anything is built: a layer count or a
    # size the weights do not have would build for hours or allocate terabytes before the names check below
    check_layer_count(path, cfg, stored)
    check_header_shapes(path, cfg, opened, fix)
    with torch.device("meta"):  # no random init: every weight is copied from the checkpoint
        model = Transformer(cfg)
    model = model.to_empty(device=device).to(dtype)
    params = dict(model.named_parameters())  # to_empty made new Parameters: lm_head.weight is its own here
    if cfg.tie_word_embeddings:
        params.pop("lm_head.weight", None)  # tied: the head is the embedding, whatever else the checkpoint holds
    # names first (cheap): a checkpoint that does not fit its config.json fails before any copying
    check_tensor_names(path, cfg, stored, params, fix)
    sums = {}
    for fname, f in opened:
        with f:
            for name in f.keys():
                if name in params:
                    sums[name] = copy_tensor(path / fname, f, name, params[name], cfg, fix)
    check_finite(path, stored, params, sums, dtype, fix)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        check_tied_head(path, stored, model.lm_head.weight, fix)
    model.requires_grad_(False).eval()  # the base model is frozen: only adapters ever train
    return model


def weight_files(path, fix):
    """The checkpoint's files: model.safetensors, or the shards model.safetensors.index.json names, with
    that index's weight_map (tensor name -> file; {} for a single file)."""
    index = path / "model.safetensors.index.json"
    if not index.exists():
        return ["model.safetensors"], {}
    weight_map = read_json(index, fix).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ValueError(f"{index} has no \"weight_map\" object (tensor name -> file): {fix}")
    return sorted(set(weight_map.values())), weight_map


def open_files(path, files, fix):
    """[(file name, open safetensors file)]; a missing or unreadable file is named."""
    from safetensors import safe_open

    opened = []
    for fname in files:
        if not (path / fname).exists():
            raise FileNotFoundError(f"{path / fname} is missing: {fix}")
        try:
            opened.append((fname, safe_open(path / fname, framework="pt", device="cpu")))
        except Exception as e:
            raise ValueError(f"{path / fname} is not a readable safetensors file ({short_reason(e)}): {fix}") from None
    return opened


def stored_tensors(path, opened, weight_map, fix):
    """tensor name -> the file that holds it. Refused: a tensor in two files (which one would load?), and
    shards that disagree with the index about where a tensor is (shards of two downloads, or a stale
    index: the model would be part one checkpoint, part another)."""
    stored = {}
    for fname, f in opened:
        for name in f.keys():
            if name in stored:
                raise ValueError(f"tensor {name} is stored twice, in {path / stored[name]} and {path / fname}: {fix}")
            stored[name] = fname
    for name in sorted(set(weight_map) | set(stored)) if weight_map else []:
        if weight_map.get(name) != stored.get(name):
            where = f"{stored[name]} holds it" if name in stored else "no file holds it"
            raise ValueError(f"{path / 'model.safetensors.index.json'} puts tensor {name} in "
                             f"{weight_map.get(name, 'no file')}, but {where}: the index and the shards come from "
                             f"different downloads; {fix}")
    # buffers some HF checkpoints carry and transformers ignores: RoPE's inv_freq is recomputed from config.json
    return {name: fname for name, fname in stored.items() if not name.endswith("rotary_emb.inv_freq")}


def check_tensor_names(path, cfg, stored, params, fix):
    """Every parameter stored, nothing else stored. A tied checkpoint may hold its head too (check_tied_head)."""
    names = set(stored) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    missing, unexpected = sorted(set(params) - names), sorted(names - set(params))
    if missing or unexpected:
        raise ValueError(mismatch_message(path, cfg, missing, unexpected, stored, fix))


def copy_tensor(file, f, name, param, cfg, fix):
    """Copy tensor `name` of the open file f into `param`; returns its float32 sum (not finite if any value is not)."""
    try:
        t = f.get_tensor(name)
    except Exception as e:
        raise ValueError(f"{file}: tensor {name} cannot be read ({short_reason(e)}): {fix}") from None
    if not t.is_floating_point():  # an int8 or bool tensor cast to float would load as garbage, silently
        raise ValueError(f"{file}: tensor {name} is stored as {t.dtype}, not a floating type: "
                         f"a quantised or damaged checkpoint we cannot load; {fix}")
    if tuple(t.shape) != tuple(param.shape):
        raise ValueError(shape_mismatch(file, name, t.shape, param.shape, cfg))
    with torch.no_grad():
        param.copy_(t)
        return param.sum(dtype=torch.float32)  # NaN or inf anywhere -> not finite


def shape_mismatch(file, name, shape, want, cfg):
    return (f"{file}: tensor {name} has shape {tuple(shape)}, but {file.parent / 'config.json'} "
            f"({shape_fields(name, cfg)}) implies {tuple(want)}: the checkpoint does not match "
            f"its config; use the config.json that came with these weights")


def layer_indices(names):
    return {int(m.group(1)) for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n))}


def check_layer_count(path, cfg, stored):
    """config.json's num_hidden_layers against the layers the checkpoint's tensor names hold."""
    has = layer_indices(stored)
    if has and len(has) != cfg.num_hidden_layers:
        raise ValueError(f"{path / 'config.json'} says num_hidden_layers {cfg.num_hidden_layers} but the checkpoint "
                         f"has {len(has)} layers: is {path / 'config.json'} from another model? Use the config.json "
                         f"that came with these weights")


def implied_shapes(cfg):
    """The shape config.json implies for each tensor, by name; a layer's names without their
    "model.layers.<i>." prefix. What Transformer(cfg) builds, stated without building it
    (tests/test_edges_model.py checks the two agree)."""
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, H), "lm_head.weight": (cfg.vocab_size, H),
              "model.norm.weight": (H,), "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
              "self_attn.q_proj.weight": (q, H), "self_attn.k_proj.weight": (kv, H),
              "self_attn.v_proj.weight": (kv, H), "self_attn.o_proj.weight": (H, q),
              "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I)}
    if cfg.attention_bias:
        shapes.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    if cfg.qk_norm:
        shapes.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    return shapes


def check_header_shapes(path, cfg, opened, fix):
    """Each stored tensor's shape, read from its file's header (no tensor is loaded), against the shape
    config.json implies: vocab, hidden, MLP, head and key/value head sizes all show in them. Names config.json
    does not imply are left to check_tensor_names, once the model is built."""
    shapes = implied_shapes(cfg)
    for fname, f in opened:
        for name in f.keys():
            want = shapes.get(re.sub(r"^model\.layers\.\d+\.", "", name))
            if want is None:
                continue
            try:
                shape = tuple(f.get_slice(name).get_shape())
            except Exception as e:
                raise ValueError(f"{path / fname}: tensor {name} cannot be read ({short_reason(e)}): {fix}") from None
            if shape != want:
                raise ValueError(shape_mismatch(path / fname, name, shape, want, cfg))


def shape_fields(name, cfg):
    """The config.json fields a tensor's shape follows from, e.g. "vocab_size 128, hidden_size 64"."""
    kv = ("num_key_value_heads", "head_dim", "hidden_size")
    fields = dict(embed_tokens=("vocab_size", "hidden_size"), lm_head=("vocab_size", "hidden_size"),
                  q_proj=("num_attention_heads", "head_dim", "hidden_size"), k_proj=kv, v_proj=kv,
                  o_proj=("hidden_size", "num_attention_heads", "head_dim"), q_norm=("head_dim",),
                  k_norm=("head_dim",), gate_proj=("intermediate_size", "hidden_size"),
                  up_proj=("intermediate_size", "hidden_size"), down_proj=("hidden_size", "intermediate_size"))
    return ", ".join(f"{k} {getattr(cfg, k)}" for k in fields.get(name.split(".")[-2], ("hidden_size",)))


def check_finite(path, stored, params, sums, dtype, fix):
    """A NaN or inf in any weight is refused, naming the tensor: in the file (damaged), or made by the cast to dtype."""
    from safetensors import safe_open

    finite = torch.isfinite(torch.stack(list(sums.values()))).tolist()  # one device sync, not one per tensor
    for name, ok in zip(sums, finite):
        if ok or torch.isfinite(params[name]).all():  # a sum can overflow on finite values
            continue
        what, file = ("NaN" if torch.isnan(params[name]).any() else "inf"), path / stored[name]
        with safe_open(file, framework="pt", device="cpu") as f:
            if torch.isfinite(f.get_tensor(name)).all():  # finite in the file: too large for `dtype`
                raise ValueError(f"tensor {name} in {file} holds values too large for {dtype} ({what} after "
                                 f"conversion): load the model in float32 or bfloat16")
        raise ValueError(f"tensor {name} in {file} holds {what}: the file is damaged; {fix}")


def check_tied_head(path, stored, embedding, fix):
    """Some tied checkpoints store the head too: it must be the embedding, or config.json's
    tie_word_embeddings (true, or absent: true for all but Mistral) contradicts the weights."""
    from safetensors import safe_open

    if "lm_head.weight" not in stored:
        return
    file = path / stored["lm_head.weight"]
    with safe_open(file, framework="pt", device="cpu") as f:
        head = f.get_tensor("lm_head.weight")
    if head.shape != embedding.shape or not torch.equal(head.to(embedding.device, embedding.dtype), embedding):
        raise ValueError(f"{path / 'config.json'} says tie_word_embeddings true (the head is the embedding), but "
                         f"{file} holds an lm_head.weight that differs from model.embed_tokens.weight: set "
                         f"tie_word_embeddings to false in config.json, or {fix}")


def redo(path):
    """What to do about a broken file in the model folder `path`."""
    if (Path(path) / ".prepared").exists():  # made by weights/prepare.py
        return f"delete the folder {path} and rerun python weights/prepare.py"
    return "re-download the checkpoint"


def mismatch_message(path, cfg, missing, unexpected, stored, fix):
    """Why the checkpoint's tensor names differ from those config.json implies. Where another model_type
    would explain the difference, blame config.json, not the download (another layer count was refused before
    the model was built: check_layer_count). A head missing from an untied checkpoint is refused too: its
    embedding would stand in for a head it was never trained as."""
    file = path / "config.json"
    bias = lambda names: [n for n in names if re.search(r"self_attn\.[qkv]_proj\.bias$", n)]
    qk_norm = lambda names: [n for n in names if re.search(r"self_attn\.[qk]_norm\.weight$", n)]
    other = f": is {file} from another model? Use the config.json that came with these weights"
    if bias(missing) and len(bias(missing)) == 3 * cfg.num_hidden_layers:
        return (f"{file} says model_type {cfg.model_type} with q/k/v biases (attention_bias) but the checkpoint "
                f"has none{other}")
    if bias(unexpected):
        return (f"the checkpoint has q/k/v biases (e.g. {bias(unexpected)[0]}, as in Qwen2) but {file} says "
                f"model_type {cfg.model_type} without attention_bias{other}")
    if qk_norm(missing) and len(qk_norm(missing)) == 2 * cfg.num_hidden_layers:
        return f"{file} says model_type {cfg.model_type} (q/k norms) but the checkpoint has none{other}"
    if qk_norm(unexpected):
        return (f"the checkpoint has q/k norms (e.g. {qk_norm(unexpected)[0]}, as in Qwen3) but {file} says "
                f"model_type {cfg.model_type}{other}")
    if missing == ["lm_head.weight"]:
        return (f"{file} says tie_word_embeddings false (a head of its own) but the checkpoint has no lm_head.weight: "
                f"set it to true if this model's head is its embedding, else {fix}")
    if unexpected:
        return (f"unexpected tensor {unexpected[0]} in {stored[unexpected[0]]}"
                f"{f' (and {len(unexpected) - 1} more)' if len(unexpected) > 1 else ''}: "
                f"not a {cfg.model_type} checkpoint we support")
    return f"checkpoint {path} lacks {len(missing)} tensors, e.g. {missing[0]}: {fix}"


def decode_utf8(raw, where):
    """bytes -> str (a leading BOM dropped); UTF-16 text that says so with its BOM (Windows editors write it)
    is read as such. ValueError naming `where` and the first bad byte if they are not UTF-8 (Python's own
    message names neither the file nor the fix)."""
    if raw[:2] in (b"\xff\xfe", b"\xfe\xff"):
        try:
            return raw.decode("utf-16")
        except UnicodeDecodeError:
            raise ValueError(f"{where} starts with a UTF-16 byte order mark but is not UTF-16 text: convert it "
                             f"to UTF-8, e.g. iconv -t utf-8") from None
    try:
        return raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}): "
                         f"convert it, e.g. iconv -t utf-8") from None


# -----------------------------------------------------------------------------
# Tokenizer and chat formats (no jinja: the two formats our models use, written out)


class Tokenizer:
    def __init__(self, path, cfg=None):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        if not (path / "tokenizer.json").exists():
            raise FileNotFoundError(f"no tokenizer.json in {path}: use a Hugging Face model folder that has one")
        fix = redo(path)
        try:
            self.tk = HFTokenizer.from_file(str(path / "tokenizer.json"))
            self.tk.encode("a probe, 42 \u00e9")  # some damage (an unk token not in the vocab) shows at encode only
        except Exception as e:  # the tokenizers library raises a bare Exception
            raise ValueError(f"{path / 'tokenizer.json'} is not a tokenizer we can read ({short_reason(e)}): "
                             f"{fix}") from None
        tc_file = path / "tokenizer_config.json"
        tc = read_json(tc_file, fix) if tc_file.exists() else {}
        template = tc.get("chat_template") or ""
        if isinstance(template, list):  # several named templates: [{"name": "default", "template": "..."}, ...]
            template = next((t.get("template") for t in template
                             if isinstance(t, dict) and t.get("name") == "default"), "")
        if not isinstance(template, str):
            raise ValueError(f"{tc_file}: chat_template is {json.dumps(template)[:60]}, it must be a string "
                             f"(a jinja template): {fix}")
        vocab = self.tk.get_vocab(with_added_tokens=True)
        if cfg is not None and vocab and max(vocab.values()) >= cfg.vocab_size:  # two files, one model: they agree
            raise ValueError(f"{path / 'tokenizer.json'} makes token ids up to {max(vocab.values())} but "
                             f"{path / 'config.json'} says vocab_size {cfg.vocab_size}: the two files come from "
                             f"different models; use the tokenizer.json that came with the weights ({fix})")
        if "<|im_start|>" in vocab:
            self.format = "chatml"  # SmolLM2, Qwen
            # a template that opens with a fixed system message (SmolLM2, Qwen2.5) uses it when
            # the user gives none; we read that literal text out of the template (its newline is
            # a real one in HF's tokenizer_config.json, or a jinja "\n" escape in hand-written ones)
            m = re.search(r"<\|im_start\|>system(?:\n|\\n)([^'\"{}]+?)<\|im_end\|>", template)
            self.default_system = m.group(1) if m else None
            stop = ["<|im_end|>", "<|endoftext|>"]
        elif "<|start_header_id|>" in vocab:
            self.format = "llama3"
            self.default_system = None
            stop = ["<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"]
        else:
            self.format, self.default_system, stop = None, None, []
        ids = [vocab[s] for s in stop if s in vocab] + (list(cfg.eos_token_id) if cfg else [])
        gen = path / "generation_config.json"
        if gen.exists():
            e = read_json(gen, fix).get("eos_token_id")
            e = e if isinstance(e, list) else ([] if e is None else [e])
            if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in e):
                raise ValueError(f"{gen}: eos_token_id must be a token id (a whole number >= 0) or a list of "
                                 f"them: {fix}")
            ids += e
        self.stop_ids = sorted(set(ids))
        if cfg is not None and self.stop_ids and self.stop_ids[-1] >= cfg.vocab_size:
            raise ValueError(f"stop token id {self.stop_ids[-1]} (config.json or generation_config.json's "
                             f"eos_token_id) is outside vocab_size {cfg.vocab_size} in {path}: {fix}")
        self.bos = "<|begin_of_text|>" if self.format == "llama3" else ""

    def encode(self, text):
        return self.tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.tk.decode(list(ids), skip_special_tokens=False)

    def chat(self, user, system=None):
        """The prompt text for one user turn, ready for the assistant's answer."""
        system = system if system is not None else self.default_system
        if self.format == "chatml":
            s = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
            return s + f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        if self.format == "llama3":
            h = lambda role: f"<|start_header_id|>{role}<|end_header_id|>\n\n"
            s = h("system") + system + "<|eot_id|>" if system else ""
            return self.bos + s + h("user") + user + "<|eot_id|>" + h("assistant")
        raise ValueError("this tokenizer has no chat format we know (ChatML or Llama-3): "
                         "send the prompt without a chat template")

    def next_turn(self, user):
        """The text that follows an assistant's answer: its end-of-turn token (decoding stops at a stop
        token without feeding it), then the next user turn, ready for the next answer. So
        chat(u1) + answer + next_turn(u2) is the template's own rendering of the conversation."""
        if self.format == "chatml":
            return f"<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        if self.format == "llama3":
            h = lambda role: f"<|start_header_id|>{role}<|end_header_id|>\n\n"
            return "<|eot_id|>" + h("user") + user + "<|eot_id|>" + h("assistant")
        raise ValueError("this tokenizer has no chat format we know (ChatML or Llama-3): a conversation needs one")
