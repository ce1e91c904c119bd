"""
LookaheadKV (arXiv 2603.10899, ICLR 2026) as a kvpress press: one file on torch, transformers,
kvpress, safetensors and peft, to read beside kvpress's RestoreKVPress and KVzipPress.

    press = LookaheadKVPress.from_pretrained("weights/SmolLM2-135M-Instruct.lookahead-peft",
                                             compression_ratio=0.9)
    pipeline("kv-press-text-generation", model=model, tokenizer=tok)(context, press=press)

The folder holds what was learned: a PEFT LoRA (adapter_config.json, adapter_model.safetensors),
the M lookahead embeddings (lookahead_embeddings.safetensors) and lookahead_config.json (M, the
base model and its fingerprint); python -m extensions.export_peft writes it from our adapter.
"""
import hashlib
import json
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from kvpress import BasePress
from kvpress.utils import compute_n_kept, get_prerope_query_states
from safetensors.torch import load_file
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import rotate_half

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # q_proj apart, RoPE, GQA: what scores here
FILES = ("adapter_config.json", "adapter_model.safetensors", "lookahead_embeddings.safetensors",
         "lookahead_config.json")


def config_fingerprint(config):
    """A short hash of the architecture, as the adapter's trainer recorded it."""
    c = {k: v for k, v in config.to_dict().items() if v is not None}
    family, heads = c["model_type"], c["num_attention_heads"]
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    llama3 = rope.get("rope_type", rope.get("type")) == "llama3"
    arch = dict(model_type=family, vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                num_hidden_layers=c["num_hidden_layers"], num_attention_heads=heads,
                num_key_value_heads=c.get("num_key_value_heads", heads),
                head_dim=c.get("head_dim", c["hidden_size"] // heads),
                intermediate_size=c["intermediate_size"],
                rope_theta=rope.get("rope_theta", c.get("rope_theta", 10000.0)),
                rope_scaling=dict(rope) if llama3 else None,
                tie_word_embeddings=c.get("tie_word_embeddings", family != "mistral"),
                attention_bias=c.get("attention_bias", family == "qwen2"),
                qk_norm=family == "qwen3")
    return hashlib.sha256(json.dumps(arch, sort_keys=True).encode()).hexdigest()[:16]


def lookahead_scores(queries, keys, S):
    """The paper's scores: the M lookahead queries (B, H, M, D) after RoPE over the keys
    (B, H_kv, S+M, D), causal among the M: their softmax attention on the S prompt slots, the
    mean over the M queries and the G query heads of a KV head, (B, H_kv, S), in float32."""
    (B, H, M, D), H_kv = queries.shape, keys.shape[1]
    G = H // H_kv
    q = queries.float().reshape(B, H_kv, G * M, D) / math.sqrt(D)  # row g*M + i: query i, head g
    logits = q @ keys.float().transpose(-1, -2)  # (B, H_kv, G*M, S+M)
    later = torch.ones(M, M, dtype=torch.bool, device=q.device).triu(1)  # row i sees rows <= i
    logits[..., S:].masked_fill_(later.repeat(G, 1), float("-inf"))
    return logits.softmax(dim=-1)[..., :S].mean(dim=2)


@dataclass
class LookaheadKVPress(BasePress):
    """LookaheadKV (https://arxiv.org/abs/2603.10899): M learned embeddings, placed after the prompt
    (positions S..S+M-1) with a LoRA on their rows only, glimpse where the answer will attend.
    After the prefill they run as one more chunk on the cache (as RestoreKVPress's restore tokens
    do), the PEFT LoRA on for that pass only. Each prompt slot scores their mean attention (over
    the M queries and the query heads of its KV head), max-pooled (kernel_size); each (layer, KV
    head) keeps its top C = int(S (1 - compression_ratio)), or `budget`; the M rows' K/V are cut
    off. One prompt (or equal lengths, no padding) on a DynamicCache."""

    compression_ratio: float = 0.0
    budget: int | None = None  # or C slots per (layer, KV head), whatever S
    kernel_size: int = 7  # max-pool before the top C (KVCache-Factory's LongBench setting)
    adapter: str | Path | None = None  # the folder (FILES); from_pretrained(folder) sets it
    n_tokens: int = field(init=False, default=0)  # M, read from the folder
    embeddings: torch.Tensor | None = field(init=False, default=None, repr=False)  # (M, hidden)
    info: dict = field(init=False, default_factory=dict, repr=False)  # lookahead_config.json
    adapter_name: str = field(init=False, default="", repr=False)  # on the model, by content
    scores: torch.Tensor | None = field(init=False, default=None, repr=False)  # (L, B, H_kv, S)
    kept: torch.Tensor | None = field(init=False, default=None, repr=False)  # (L, B, H_kv, C)

    @classmethod
    def from_pretrained(cls, folder, **settings):
        return cls(adapter=folder, **settings)

    def __post_init__(self):
        r, C, k = self.compression_ratio, self.budget, self.kernel_size
        for name, value, kinds in (("compression_ratio", r, (int, float)),
                                   ("budget", C, (int, type(None))), ("kernel_size", k, int)):
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise TypeError(f"LookaheadKVPress: {name}={value!r} is a "
                                f"{type(value).__name__}: pass a number")
        if not 0 <= r < 1:  # NaN fails it too
            raise ValueError(f"LookaheadKVPress: compression_ratio={r} must be in [0, 1)")
        if C is not None and (C < 1 or r):
            raise ValueError(f"LookaheadKVPress: budget={C} must be >= 1, without a ratio")
        if k < 1 or k % 2 == 0:
            raise ValueError(f"LookaheadKVPress: kernel_size={k} must be odd and >= 1")
        folder = self.adapter = Path(self.adapter or "")
        missing = [f for f in FILES if not (folder / f).is_file()]
        if self.adapter == Path("") or missing:
            raise FileNotFoundError(f"LookaheadKVPress: folder {str(folder)!r} lacks "
                                    f"{', '.join(missing)}: pass the folder that python -m "
                                    "extensions.export_peft wrote to from_pretrained(folder)")
        self.info = json.loads((folder / "lookahead_config.json").read_text())
        self.embeddings = load_file(folder / FILES[2])["lookahead_embeddings"]
        self.n_tokens = self.embeddings.shape[0]
        if self.n_tokens != self.info.get("n_tokens") or not self.embeddings.isfinite().all():
            raise ValueError(f"LookaheadKVPress: {folder}'s embeddings do not match its "
                             "lookahead_config.json: export it again")
        # a LoRA of another folder loaded on the same model must not pass for this one
        digest = hashlib.sha256((folder / FILES[1]).read_bytes()).hexdigest()
        self.adapter_name = "lookaheadkv_" + digest[:12]

    def post_init_from_model(self, model):
        """Family and shape checked against the folder; its LoRA loaded, off. No forward yet."""
        family, fingerprint = model.config.model_type, config_fingerprint(model.config)
        if family not in FAMILIES:
            raise ValueError(f"LookaheadKVPress: model_type {family!r} ({type(model).__name__}) "
                             f"is not supported; supported: {', '.join(FAMILIES)}")
        base, trained = self.info.get("base_model"), self.info.get("base_fingerprint")
        if fingerprint != trained:
            raise ValueError(f"LookaheadKVPress: {self.adapter} was trained for {base} "
                             f"({trained}), not for {model.config.name_or_path or 'this model'} "
                             f"({fingerprint}): use the adapter trained for this model")
        if self.adapter_name not in getattr(model, "peft_config", {}):
            model.load_adapter(str(self.adapter), adapter_name=self.adapter_name)
        model.disable_adapters()  # the prompt runs through the frozen model
        self.embeddings = self.embeddings.to(model.device, model.dtype)

    def check_prefill(self, args, kwargs):
        """The prefill's inputs before it runs: what cannot be scored is a ValueError. Returns S."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        S = (ids if ids is not None else kwargs["inputs_embeds"]).shape[1]
        mask, cache = kwargs.get("attention_mask"), kwargs.get("past_key_values")
        if mask is not None and not bool(mask.bool().all()):
            raise ValueError("LookaheadKVPress scores prompts of equal length: this batch is "
                             "padded (zeros in its attention mask); run one prompt at a time")
        if kwargs.get("use_cache") is False:
            raise ValueError("LookaheadKVPress evicts the prefill's cache: use_cache=True")
        if not isinstance(cache, (DynamicCache, type(None))):
            raise ValueError(f"LookaheadKVPress evicts from a DynamicCache, not "
                             f"{type(cache).__name__} (a static cache keeps its slots): pass "
                             "past_key_values=DynamicCache()")
        if cache is not None and cache.get_seq_length() > 0:
            raise ValueError("LookaheadKVPress compresses a prompt on an empty cache: this one "
                             "holds tokens")
        if self.budget is not None and self.budget > S:
            raise ValueError(f"LookaheadKVPress: budget={self.budget} is larger than the prompt "
                             f"({S} tokens)")
        return S

    @contextmanager
    def __call__(self, model):
        """Check and watch the prefill inside the block; leaving it, evict its cache in place."""
        self.post_init_from_model(model)
        seen = {}

        def before(module, args, kwargs):
            if seen:
                raise ValueError("LookaheadKVPress evicts after the prefill: one forward inside")
            seen["S"] = self.check_prefill(args, kwargs)

        def after(module, args, kwargs, output):
            seen["cache"] = output.past_key_values

        hooks = [model.model.register_forward_pre_hook(before, with_kwargs=True),
                 model.model.register_forward_hook(after, with_kwargs=True)]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
        if seen:
            self.compress_cache(model, seen["cache"], seen["S"])

    @torch.no_grad()
    def compress_cache(self, model, cache, S):
        """Score the S prompt slots by the lookahead rows; keep each (layer, KV head)'s top C."""
        C = self.budget if self.budget is not None else compute_n_kept(S, self.compression_ratio)
        self.scores, self.kept = None, None
        if C >= S:  # nothing to evict: no lookahead pass either
            return
        scores = self.scores = self.score(model, cache, S)  # (L, B, H_kv, S)
        k = self.kernel_size  # max-pool: a kept peak brings its neighbours at full height
        pooled = F.max_pool1d(scores.flatten(0, 2)[:, None], k, stride=1, padding=k // 2)
        self.kept = pooled.view_as(scores).topk(C, dim=-1).indices.sort(dim=-1).values
        for layer, idx in zip(cache.layers, self.kept):
            idx = idx[..., None].expand(-1, -1, -1, layer.keys.shape[-1])  # (B, H_kv, C, D)
            layer.keys, layer.values = layer.keys.gather(2, idx), layer.values.gather(2, idx)

    def score(self, model, cache, S):
        """The M rows on the cache, the LoRA on: their scores (L, B, H_kv, S); then their K/V are
        cut off the cache, whatever happened."""
        B, M, scores = cache.layers[0].keys.shape[0], self.n_tokens, {}

        def hook(module, args, kwargs, output):
            hidden = kwargs["hidden_states"]  # (B, M, hidden): the lookahead rows
            queries = get_prerope_query_states(module, hidden)  # (B, H, M, D), q_proj's LoRA on
            cos, sin = kwargs["position_embeddings"]
            queries = queries * cos.unsqueeze(1) + rotate_half(queries) * sin.unsqueeze(1)
            keys = cache.layers[module.layer_idx].keys  # (B, H_kv, S+M, D): the M rows' last
            scores[module.layer_idx] = lookahead_scores(queries, keys, S)

        layers = model.model.layers
        hooks = [x.self_attn.register_forward_hook(hook, with_kwargs=True) for x in layers]
        model.set_adapter(self.adapter_name)
        model.enable_adapters()
        try:
            positions = torch.arange(S, S + M, device=self.embeddings.device).expand(B, M)
            model.model(inputs_embeds=self.embeddings.expand(B, M, -1), past_key_values=cache,
                        position_ids=positions, use_cache=True)
        finally:
            model.disable_adapters()
            for h in hooks:
                h.remove()
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys[:, :, :S], layer.values[:, :, :S]
        return torch.stack([scores[l] for l in range(len(layers))])
