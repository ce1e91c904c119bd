"""
LookaheadKV (arXiv 2603.10899, ICLR 2026) as a kvpress press: one file on top of torch, transformers, kvpress,
safetensors and peft, to read beside kvpress's RestoreKVPress and KVzipPress (copy it into kvpress/presses/).

    press = LookaheadKVPress.from_pretrained("weights/SmolLM2-135M-Instruct.lookahead-peft", compression_ratio=0.9)
    pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)(context, question=q, press=press)

The folder holds the learned part: a PEFT LoRA (adapter_config.json, adapter_model.safetensors), the M lookahead
embeddings (lookahead_embeddings.safetensors) and lookahead_config.json (M, the base model and its fingerprint).
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

ADAPTER_NAME = "lookaheadkv"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # separate q/k/v projections, RoPE, GQA: what scores here
FILES = ("adapter_config.json", "adapter_model.safetensors", "lookahead_embeddings.safetensors",
         "lookahead_config.json")


def config_fingerprint(config):
    """A short hash of the architecture (what the adapter's trainer recorded): another shape, another hash."""
    c = {k: v for k, v in config.to_dict().items() if v is not None}
    family, heads = c["model_type"], c["num_attention_heads"]
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    llama3 = rope.get("rope_type", rope.get("type")) == "llama3"
    arch = dict(model_type=family, vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                num_hidden_layers=c["num_hidden_layers"], num_attention_heads=heads,
                num_key_value_heads=c.get("num_key_value_heads", heads),
                head_dim=c.get("head_dim", c["hidden_size"] // heads), intermediate_size=c["intermediate_size"],
                rope_theta=rope.get("rope_theta", c.get("rope_theta", 10000.0)),
                rope_scaling=dict(rope) if llama3 else None,
                tie_word_embeddings=c.get("tie_word_embeddings", family != "mistral"),
                attention_bias=c.get("attention_bias", family == "qwen2"), qk_norm=family == "qwen3")
    return hashlib.sha256(json.dumps(arch, sort_keys=True).encode()).hexdigest()[:16]


def lookahead_scores(queries, keys, S):
    """Eq. of the paper's scores: the M lookahead queries (B, H, M, D), after RoPE, over the keys (B, H_kv, S+M, D)
    (the prompt's, then their own, causal among themselves): softmax attention on the S prompt slots, the mean over
    the M queries and the G query heads of each KV head, (B, H_kv, S). Float32, whatever the model's dtype."""
    (B, H, M, D), H_kv = queries.shape, keys.shape[1]
    q = queries.float().reshape(B, H_kv, H // H_kv * M, D) / math.sqrt(D)  # row g*M + i: query i of head g
    logits = q @ keys.float().transpose(-1, -2)  # (B, H_kv, G*M, S+M)
    later = torch.ones(M, M, dtype=torch.bool, device=q.device).triu(1)  # lookahead row i sees rows <= i
    logits[..., S:].masked_fill_(later.repeat(H // H_kv, 1), float("-inf"))
    return logits.softmax(dim=-1)[..., :S].mean(dim=2)


@dataclass
class LookaheadKVPress(BasePress):
    """LookaheadKV (https://arxiv.org/abs/2603.10899): M learned lookahead embeddings, placed after the prompt at
    positions S..S+M-1 with a LoRA active on their rows only, glimpse where the answer will attend. After the
    prefill they run as one more chunk on the cache (as RestoreKVPress's restore tokens do), the PEFT LoRA on for
    that pass only; each prompt slot scores their mean softmax attention (over the M queries and the query heads
    of its KV head), max-pooled (kernel_size), and each (layer, KV head) keeps its top C = int(S (1 - ratio)), or
    `budget` slots. The lookahead K/V are then cut off: the cache holds prompt slots only. Load with
    from_pretrained(folder). One prompt, or equal-length prompts without padding, on a DynamicCache."""

    compression_ratio: float = 0.0
    budget: int | None = None  # C slots per (layer, KV head) whatever S, instead of compression_ratio
    kernel_size: int = 7  # max-pool width before the top C (KVCache-Factory's LongBench setting)
    adapter: str | Path | None = None  # the exported folder (FILES)
    n_tokens: int = field(init=False, default=0)  # M, from the folder
    embeddings: torch.Tensor | None = field(init=False, default=None, repr=False)  # (M, hidden)
    info: dict = field(init=False, default_factory=dict, repr=False)  # lookahead_config.json
    kept: torch.Tensor | None = field(init=False, default=None, repr=False)  # (L, B, H_kv, C) of the last prompt

    @classmethod
    def from_pretrained(cls, folder, **settings):
        return cls(adapter=folder, **settings)

    def __post_init__(self):
        r, C, k = self.compression_ratio, self.budget, self.kernel_size
        for name, value, kinds in (("compression_ratio", r, (int, float)), ("budget", C, (int, type(None))),
                                   ("kernel_size", k, int)):
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise TypeError(f"LookaheadKVPress: {name}={value!r} is a {type(value).__name__}: pass a number")
        if not 0 <= r < 1:  # NaN fails it too
            raise ValueError(f"LookaheadKVPress: compression_ratio={r} must be in [0, 1), e.g. 0.9 evicts 90%")
        if C is not None and (C < 1 or r):
            raise ValueError(f"LookaheadKVPress: budget={C} must be >= 1 and not given with compression_ratio")
        if k < 1 or k % 2 == 0:
            raise ValueError(f"LookaheadKVPress: kernel_size={k} must be odd and >= 1 (a centred window)")
        if self.adapter is None:
            raise ValueError("LookaheadKVPress needs its learned folder: LookaheadKVPress.from_pretrained(folder)")
        self.adapter = Path(self.adapter)
        missing = [f for f in FILES if not (self.adapter / f).is_file()]
        if missing:
            raise FileNotFoundError(f"LookaheadKVPress: {self.adapter} lacks {', '.join(missing)}: export the "
                                    "adapter there (python -m extensions.export_peft ADAPTER FOLDER)")
        self.info = json.loads((self.adapter / "lookahead_config.json").read_text())
        self.embeddings = load_file(self.adapter / "lookahead_embeddings.safetensors")["lookahead_embeddings"]
        self.n_tokens = self.embeddings.shape[0]
        if self.n_tokens != self.info.get("n_tokens") or not self.embeddings.isfinite().all():
            raise ValueError(f"LookaheadKVPress: {self.adapter}'s embeddings do not match its "
                             f"lookahead_config.json (M = {self.info.get('n_tokens')}): export it again")

    def post_init_from_model(self, model):
        """The model's family and shape checked against the folder, then its LoRA loaded, off: before any forward."""
        family, name = model.config.model_type, model.config.name_or_path
        if family not in FAMILIES:
            raise ValueError(f"LookaheadKVPress: model_type {family!r} ({type(model).__name__}) is not supported; "
                             f"supported: {', '.join(FAMILIES)}")
        if config_fingerprint(model.config) != self.info.get("base_fingerprint"):
            raise ValueError(f"LookaheadKVPress: {self.adapter} was trained for {self.info.get('base_model')} "
                             f"(fingerprint {self.info.get('base_fingerprint')}), not for {name or 'this model'} "
                             f"({config_fingerprint(model.config)}): use the adapter trained for this model")
        if getattr(model, "peft_config", {}).get(ADAPTER_NAME, None) is None:
            model.load_adapter(str(self.adapter), adapter_name=ADAPTER_NAME)
        model.disable_adapters()  # the prompt runs through the frozen model: the LoRA is for the M rows only
        self.embeddings = self.embeddings.to(model.device, model.dtype)

    def check_prefill(self, args, kwargs):
        """The prefill's inputs, before it runs: what cannot be scored is a ValueError now. Returns S."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        S = (ids if ids is not None else kwargs["inputs_embeds"]).shape[1]
        mask, cache = kwargs.get("attention_mask"), kwargs.get("past_key_values")
        if mask is not None and not bool(mask.bool().all()):
            raise ValueError("LookaheadKVPress scores prompts of equal length: this batch is padded (its attention "
                             "mask holds zeros); run one prompt at a time")
        if kwargs.get("use_cache") is False or (cache is not None and not isinstance(cache, DynamicCache)):
            raise ValueError(f"LookaheadKVPress evicts from a DynamicCache, not {type(cache).__name__} (a static "
                             "or quantized cache keeps its slots): pass past_key_values=DynamicCache()")
        if cache is not None and cache.get_seq_length() > 0:
            raise ValueError("LookaheadKVPress compresses a prompt on a fresh cache: this one holds tokens")
        if self.budget is not None and self.budget > S:
            raise ValueError(f"LookaheadKVPress: budget={self.budget} is larger than the prompt ({S} tokens)")
        return S

    @contextmanager
    def __call__(self, model):
        """Check and watch the prefill inside the block; leaving it, score and evict its cache in place."""
        self.post_init_from_model(model)
        seen = {}

        def before(module, args, kwargs):
            if seen:
                raise ValueError("LookaheadKVPress evicts after the prefill: run one forward inside the block")
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
        """Score the S prompt slots by the lookahead rows, then keep each (layer, KV head)'s top C."""
        C = self.budget if self.budget is not None else compute_n_kept(S, self.compression_ratio)
        self.kept = None
        if C >= S:  # nothing to evict: no lookahead pass either
            return
        scores = self.score(model, cache, S)  # (L, B, H_kv, S)
        k = self.kernel_size  # max-pool: a kept peak brings its neighbours at full height
        pooled = F.max_pool1d(scores.flatten(0, 2)[:, None], k, stride=1, padding=k // 2).view_as(scores)
        self.kept = pooled.topk(C, dim=-1).indices.sort(dim=-1).values  # (L, B, H_kv, C), in slot order
        for layer, idx in zip(cache.layers, self.kept):
            idx = idx[..., None].expand(-1, -1, -1, layer.keys.shape[-1])  # (B, H_kv, C, D)
            layer.keys, layer.values = layer.keys.gather(2, idx), layer.values.gather(2, idx)

    def score(self, model, cache, S):
        """The M rows on top of the cache, the LoRA on; per layer their scores (L, B, H_kv, S). Their K/V are cut
        off the cache afterwards, whatever happened."""
        B, M, scores = cache.layers[0].keys.shape[0], self.n_tokens, {}

        def hook(module, args, kwargs, output):
            queries = get_prerope_query_states(module, kwargs["hidden_states"])  # (B, H, M, D), LoRA on q_proj
            cos, sin = kwargs["position_embeddings"]
            queries = queries * cos.unsqueeze(1) + rotate_half(queries) * sin.unsqueeze(1)
            keys = cache.layers[module.layer_idx].keys  # (B, H_kv, S+M, D): this pass's own K last
            scores[module.layer_idx] = lookahead_scores(queries, keys, S)

        hooks = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
        model.set_adapter(ADAPTER_NAME)
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
        return torch.stack([scores[l] for l in range(len(scores))])
