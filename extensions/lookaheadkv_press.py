# SPDX-FileCopyrightText: Copyright (c) 2026 lookaheadkv contributors. All rights reserved.
# SPDX-License-Identifier: Apache-2.0

import hashlib
import json
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import rotate_half

from kvpress.presses.base_press import BasePress
from kvpress.presses.scorer_press import ScorerPress
from kvpress.utils import compute_n_kept, get_prerope_query_states

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # q_proj apart, RoPE, GQA: what scores here
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FILES = {
    "adapter_config.json": 1 << 20,
    "lookahead_config.json": 1 << 20,  # name: the most bytes it may hold
    "adapter_model.safetensors": 1 << 32,
    "lookahead_embeddings.safetensors": 1 << 32,
}


def config_fingerprint(config) -> str:
    """A short hash of the architecture, as the adapter's trainer recorded it."""
    c = {k: v for k, v in config.to_dict().items() if v is not None}
    family, heads = c["model_type"], c["num_attention_heads"]
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    llama3 = rope.get("rope_type", rope.get("type")) == "llama3"
    arch = dict(
        model_type=family,
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        num_hidden_layers=c["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=c.get("num_key_value_heads", heads),
        head_dim=c.get("head_dim", c["hidden_size"] // heads),
        intermediate_size=c["intermediate_size"],
        rope_theta=rope.get("rope_theta", c.get("rope_theta", 10000.0)),
        rope_scaling=dict(rope) if llama3 else None,
        tie_word_embeddings=c.get("tie_word_embeddings", family != "mistral"),
        attention_bias=c.get("attention_bias", family == "qwen2"),
        qk_norm=family == "qwen3",
    )
    return hashlib.sha256(json.dumps(arch, sort_keys=True).encode()).hexdigest()[:16]


def read(folder: Path, name: str):
    """One file of the folder, parsed (a dict of JSON or of tensors); anything else is one line naming the file."""
    path = folder / name
    if not path.is_file():
        raise FileNotFoundError(f"LookaheadKVPress: {path} is missing: pass the folder that holds {', '.join(FILES)}")
    if path.stat().st_size > FILES[name]:
        raise ValueError(f"LookaheadKVPress: {path} is {path.stat().st_size} bytes, more than such a file can be")
    try:
        data = json.loads(path.read_text()) if name.endswith(".json") else load_file(path)
    except Exception as e:  # corrupt JSON, binary bytes, a safetensors cut short: said in its first line
        raise ValueError(f"LookaheadKVPress: {path} cannot be read: {(str(e) or type(e).__name__).splitlines()[0]}")
    if not isinstance(data, dict):
        raise ValueError(f"LookaheadKVPress: {path} holds {type(data).__name__}, not a JSON object")
    return data


@dataclass
class LookaheadKVPress(ScorerPress):
    """
    LookaheadKV (https://arxiv.org/abs/2603.10899): M learned embeddings glimpse where the answer will attend.

    The M lookahead rows ride in the first forward inside the press: appended to its input at positions S..S+M-1,
    a LoRA on their rows only (every other row is the frozen model's, exactly). In each layer their post-RoPE
    queries and their keys are set aside and their K/V leave the cache before any press hook runs, so the hooks see
    the prompt alone. A prompt slot's score is the rows' mean softmax attention on it (over the M rows and the query
    heads of its KV head, the rows' own keys in the softmax), max-pooled over `kernel_size` slots; ScorerPress keeps
    the top slots. Wrappers that call `score` (AdaKVPress, ChunkPress, KeyRerotationPress, PerLayerCompressionPress,
    CriticalKVPress, DMSPress, ComposedPress) apply as they do to any scorer; under DecodingPress the rows' queries
    from the first forward score every later compression. The paper scores the prompt with its question inside:
    prefill the whole prompt under the press (the pipeline's `question=` compresses the context before it).

    Parameters
    ----------
    compression_ratio : float, default=0.0
        Fraction of key-value pairs to remove.
    budget : int, optional
        Slots kept per (layer, KV head) instead, whatever S; after the cut `compression_ratio` reads 1 - budget / S.
    kernel_size : int, default=7
        Max-pool width before the top-k (KVCache-Factory's LongBench setting).
    adapter : str or Path, optional
        The folder of adapter_config.json and adapter_model.safetensors (the LoRA, under PEFT's names),
        lookahead_embeddings.safetensors and lookahead_config.json (M, base model fingerprint). Default: the folder
        `<model folder>.lookahead-peft` beside the model's own.
    """

    budget: int | None = None
    kernel_size: int = 7
    adapter: str | Path | None = None
    embeddings: torch.Tensor | None = field(init=False, default=None, repr=False)  # (M, hidden)
    lora: dict = field(init=False, default_factory=dict, repr=False)  # module path -> (A (r, in), B (out, r))
    scale: float = field(init=False, default=1.0, repr=False)  # lora_alpha / r
    info: dict = field(init=False, default_factory=dict, repr=False)  # lookahead_config.json
    rows: dict = field(init=False, default_factory=dict, repr=False)  # layer -> (queries (B, H, M, D), keys)
    hooks: list = field(init=False, default_factory=list, repr=False)

    @classmethod
    def from_pretrained(cls, folder, **settings):
        return cls(adapter=folder, **settings)

    def __post_init__(self):
        r, C, k = self.compression_ratio, self.budget, self.kernel_size
        for name, value, kinds in (
            ("compression_ratio", r, (int, float)),
            ("budget", C, (int, type(None))),
            ("kernel_size", k, int),
        ):
            if isinstance(value, bool) or not isinstance(value, kinds):
                want = "a number" if kinds is not int and float in kinds else "a whole number (an int)"
                raise TypeError(f"LookaheadKVPress: {name}={value!r} is a {type(value).__name__}: pass {want}")
        if not 0 <= r < 1:  # NaN fails it too
            raise ValueError(f"LookaheadKVPress: compression_ratio={r} must be in [0, 1)")
        if C is not None and (C < 1 or r):
            raise ValueError(f"LookaheadKVPress: budget={C} must be >= 1, without a ratio")
        if k < 1 or k % 2 == 0:
            raise ValueError(f"LookaheadKVPress: kernel_size={k} must be odd and >= 1")
        if self.adapter is not None:
            self.load(Path(self.adapter))

    def load(self, folder: Path):
        """The folder's four files, each checked before the next is read."""
        config, self.info = read(folder, "adapter_config.json"), read(folder, "lookahead_config.json")
        r, alpha, M = config.get("r"), config.get("lora_alpha"), self.info.get("n_tokens")
        targets = config.get("target_modules")
        for name, value, kinds, top in (
            ("r", r, int, 4096),
            ("lora_alpha", alpha, (int, float), 1e6),
            ("n_tokens", M, int, 4096),
        ):  # before any tensor is read
            if isinstance(value, bool) or not isinstance(value, kinds) or not 0 < value <= top:
                raise ValueError(f"LookaheadKVPress: {folder}: {name}={value!r} must be a number in (0, {top}]")
        if not isinstance(targets, list) or not targets or set(targets) - set(TARGETS) or config.get("use_dora"):
            raise ValueError(
                f"LookaheadKVPress: {folder}/adapter_config.json: target_modules={targets!r} "
                f"(use_dora={config.get('use_dora')}): a plain LoRA on some of {', '.join(TARGETS)}"
            )
        self.scale = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
        tensors, self.lora = read(folder, "adapter_model.safetensors"), {}
        for name, A in tensors.items():  # base_model.model.{path}.lora_A.weight (r, in); its lora_B (out, r)
            path = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            B = tensors.get(name.replace("lora_A", "lora_B"))
            if "lora_A" in name and (B is None or A.shape[0] != r or B.shape[1] != r):
                raise ValueError(
                    f"LookaheadKVPress: {folder}/adapter_model.safetensors: {name} is not a rank-{r} " f"LoRA pair"
                )
            if "lora_A" in name:
                self.lora[path] = (A, B)
        self.embeddings = read(folder, "lookahead_embeddings.safetensors").get("lookahead_embeddings")
        if self.embeddings is None or self.embeddings.shape[0] != M or not self.embeddings.isfinite().all():
            raise ValueError(f"LookaheadKVPress: {folder}'s lookahead_embeddings do not match n_tokens={M}")
        self.adapter = folder

    def post_init_from_model(self, model):
        """Family and fingerprint checked, the adapter found; then the next forward under a press carries the rows."""
        family = model.config.model_type
        if family not in FAMILIES:
            raise ValueError(
                f"LookaheadKVPress: model_type {family!r} ({type(model).__name__}) is not supported; "
                f"supported: {', '.join(FAMILIES)}"
            )
        if self.adapter is None:
            self.load(Path(f"{Path(model.config.name_or_path or '.').resolve()}.lookahead-peft"))
        trained, fingerprint = self.info.get("base_fingerprint"), config_fingerprint(model.config)
        if fingerprint != trained:
            raise ValueError(
                f"LookaheadKVPress: {self.adapter} was trained for {self.info.get('base_model')} "
                f"({trained}), not for {model.config.name_or_path or 'this model'} ({fingerprint})"
            )
        modules = dict(model.named_modules())
        for path, (A, B) in self.lora.items():
            proj = modules.get(path)
            if proj is None or (proj.in_features, proj.out_features) != (A.shape[1], B.shape[0]):
                raise ValueError(f"LookaheadKVPress: {self.adapter}: the LoRA of {path} does not fit its shape")
        self.embeddings = self.embeddings.to(model.device, model.dtype)
        self.lora = {
            p: (A.to(model.device, model.dtype), B.to(model.device, model.dtype)) for p, (A, B) in self.lora.items()
        }
        self.disarm()
        self.hooks = [
            model.model.register_forward_pre_hook(lambda m, a, kw: self.ride(model, a, kw), with_kwargs=True),
            model.model.register_forward_hook(self.trim, with_kwargs=True, always_call=True),
        ]

    def disarm(self):
        for hook in self.hooks:
            hook.remove()
        self.hooks = []

    @contextmanager
    def __call__(self, model):
        try:
            with super().__call__(model):
                yield
        finally:
            self.disarm()

    def ride(self, model, args, kwargs):
        """Before the forward: the checks, the M rows appended to its input, the LoRA and strip hooks for it."""
        layers = model.model.layers
        if not any(
            isinstance(getattr(h, "__self__", None), BasePress) for h in layers[0].self_attn._forward_hooks.values()
        ):
            return self.disarm()  # no press context is open on this model any more: a plain forward
        kwargs = {**dict(zip(("input_ids", "attention_mask", "position_ids", "past_key_values"), args)), **kwargs}
        embeds = kwargs.get("inputs_embeds")
        embeds = model.model.embed_tokens(kwargs["input_ids"]) if embeds is None else embeds  # (B, S, hidden)
        (B, S, _), M = embeds.shape, self.embeddings.shape[0]
        mask, cache = kwargs.get("attention_mask"), kwargs.get("past_key_values")
        if mask is not None and not bool(mask.bool().all()):
            raise ValueError("LookaheadKVPress scores prompts of equal length: this batch is padded")
        if kwargs.get("use_cache") is False or not isinstance(cache, (DynamicCache, type(None))):
            raise ValueError(
                f"LookaheadKVPress evicts from a DynamicCache with use_cache=True, not "
                f"{type(cache).__name__} (use_cache={kwargs.get('use_cache')})"
            )
        if self.budget is not None and (cache is None or cache.get_seq_length() == 0):  # a prefill: C of S
            if self.budget > S:
                raise ValueError(f"LookaheadKVPress: budget={self.budget} is larger than the prompt ({S} tokens)")
            self.compression_ratio = 1 - self.budget / S
            while compute_n_kept(S, self.compression_ratio) < self.budget:  # float truncation: within ulps of it
                self.compression_ratio = math.nextafter(self.compression_ratio, 0.0)
        step = torch.arange(1, M + 1, device=embeds.device)
        kwargs.update(input_ids=None, inputs_embeds=torch.cat([embeds, self.embeddings.expand(B, M, -1)], 1))
        if mask is not None:
            kwargs["attention_mask"] = torch.cat([mask, mask.new_ones(B, M)], 1)
        for name in ("position_ids", "cache_position"):
            if kwargs.get(name) is not None:
                kwargs[name] = torch.cat([kwargs[name], kwargs[name][..., -1:] + step], -1)
        self.rows = {}
        for path in self.lora:
            self.hooks.append(model.get_submodule(path).register_forward_hook(self.delta(path, M)))
        for layer in layers:
            self.hooks.append(layer.self_attn.register_forward_hook(self.strip(M), with_kwargs=True, prepend=True))
        return (), kwargs

    def delta(self, path, M):
        """The LoRA on the last M rows of what the projection sees (the lookahead rows): W' = W + scale B A."""

        def hook(module, args, output):
            A, B = self.lora[path]
            output[:, -M:] += (args[0][:, -M:] @ A.T) @ B.T * self.scale  # (B, M, out)
            return output

        return hook

    def strip(self, M):
        """After a layer's attention, first of its hooks: the rows' queries (after RoPE) and keys set aside, their
        K/V out of the cache, and the press hooks after it handed the prompt's inputs alone."""

        def hook(module, args, kwargs, output):
            hidden, (cos, sin) = kwargs["hidden_states"], kwargs["position_embeddings"]
            queries = get_prerope_query_states(module, hidden[:, -M:])  # (B, H, M, D), q_proj's LoRA on
            cos_m, sin_m = cos[:, -M:].unsqueeze(1), sin[:, -M:].unsqueeze(1)  # (B, 1, M, D)
            queries = queries * cos_m + rotate_half(queries) * sin_m
            layer = kwargs["past_key_values"].layers[module.layer_idx]
            self.rows[module.layer_idx] = queries.detach(), layer.keys[:, :, -M:].detach()
            layer.keys, layer.values = layer.keys[:, :, :-M], layer.values[:, :, :-M]
            kwargs.update(hidden_states=hidden[:, :-M], position_embeddings=(cos[:, :-M], sin[:, :-M]))
            kwargs["cache_position"] = kwargs["cache_position"][:-M]
            if isinstance(kwargs.get("attention_mask"), torch.Tensor):
                kwargs["attention_mask"] = kwargs["attention_mask"][..., :-M, :-M]
            return output if output[1] is None else (output[0], output[1][..., :-M, :-M])

        return hook

    def trim(self, module, args, kwargs, output):
        """After the forward (or its exception): every hook gone, the rows' hidden states off its output."""
        riding, M = len(self.hooks) > 2, self.embeddings.shape[0]  # ride() added the LoRA and strip hooks
        self.disarm()
        if riding and isinstance(output, tuple):  # return_dict=False
            return (output[0][:, :-M], *output[1:])
        if riding and output is not None:
            output.last_hidden_state = output.last_hidden_state[:, :-M]
        return output

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        """The M rows' mean attention on each of `keys` (B, H_kv, n, D), their own keys in the softmax, causal among
        them, over the M rows and the G query heads of a KV head; max-pooled. (B, H_kv, n), float32."""
        if module.layer_idx not in self.rows:
            raise ValueError(
                "LookaheadKVPress: no lookahead rows ran in this forward (a wrapper that does not call its "
                "post_init_from_model, as CriticalAdaKVPress): call press.post_init_from_model(model) first"
            )
        queries, rows = self.rows[module.layer_idx]
        (B, H, M, D), H_kv = queries.shape, keys.shape[1]
        q = queries.float().reshape(B, H_kv, H // H_kv * M, D) / math.sqrt(D)  # row g*M + i: query i of head g
        logits = q @ torch.cat([keys, rows], 2).float().transpose(-1, -2)  # (B, H_kv, G*M, n+M)
        later = torch.ones(M, M, dtype=torch.bool, device=q.device).triu(1)  # row i sees rows <= i
        logits[..., -M:].masked_fill_(later.repeat(H // H_kv, 1), float("-inf"))
        scores = logits.softmax(dim=-1)[..., :-M].mean(dim=2)
        return F.max_pool1d(scores, self.kernel_size, stride=1, padding=self.kernel_size // 2)
