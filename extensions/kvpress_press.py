"""
LookaheadKV (arXiv 2603.10899, ICLR 2026) as a press of NVIDIA's kvpress (0.5.5), the library where the field
compares KV-cache eviction methods: our adapters (.safetensors + .json) on Hugging Face transformers models.

    press = LookaheadKVPress.from_adapter("weights/SmolLM2-135M-Instruct.lookahead.safetensors", compression_ratio=0.9)
    press = LookaheadKVPress.from_adapter(path, budget=128)            # or C slots per (layer, KV head)
    pipe = pipeline("kv-press-text-generation", model=hf_model, tokenizer=tokenizer)
    pipe(context, question=question, press=press)["answer"]
    with press(hf_model):                                              # or around the prefill itself
        hf_model(ids, past_key_values=cache)                           # the cache then holds the kept slots only

It has the shape of kvpress's RestoreKVPress (learned embeddings and a LoRA for one extra pass over the cached
context, then eviction), with the paper's steps:
  1. the prompt (S tokens) is prefilled by the HF model as it is: its keys and values are the ones kept;
  2. after the prefill, the M lookahead embeddings run as one more chunk on top of the cache, at positions
     S .. S+M-1, with the adapter's LoRA on every projection it names (q, k, v, o, gate, up, down). The chunk
     holds the M rows only, so a LoRA on the whole chunk is a LoRA "on the lookahead rows only";
  3. per layer, each prompt slot scores the M rows' softmax attention on it, averaged over the M queries and
     the G query heads of its KV head (our eviction.group_attention, the function our scorer uses);
  4. the M rows' K/V are cut off the cache, and each (layer, KV head) keeps the top C slots of the scores
     smoothed by the rule: the paper's form is max-pool 7 with C in every layer (our Scorer.evict does it).
kvpress's ScorerPress scores inside each layer's forward hook, while the prefill runs; here the M rows need
every layer's full cache first, so, as KVzipPress does, the press works after the prefill, in its __call__.
The span rule and per-layer budgets (extensions/span.py, extensions/layer_budgets.py) are options:
rule="span:8:1024", layer_budgets=True (the shipped adapter's recommended selection).

Nothing on the reading path imports this file; kvpress and transformers are the optional extra [kvpress].
"""
import json
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from kvpress import BasePress
from kvpress.utils import compute_n_kept
from transformers.models.llama.modeling_llama import rotate_half

from eviction import EvictConfig, Prefilled, group_attention, stack_layers, uniform_budgets
from methods import load_adapter, make_scorer
from model import ModelConfig
from support.selection import layer_budgets as budget_policy, parse_rule
from weights import checks

TARGETS = dict(q_proj="self_attn", k_proj="self_attn", v_proj="self_attn", o_proj="self_attn",
               gate_proj="mlp", up_proj="mlp", down_proj="mlp")  # LoRA target -> the HF submodule that holds it


def hf_model_config(config):
    """Our ModelConfig of an HF model's config (its fingerprint ties an adapter to its model): the config dict
    written where ModelConfig.from_hf_config reads one, so it is read and checked as a config.json is."""
    name = Path(str(getattr(config, "name_or_path", "") or "model")).name or "model"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config.to_dict(), default=str))
        try:
            return ModelConfig.from_hf_config(folder)
        except ValueError as e:  # it names the temporary file: say whose config it was
            raise ValueError(f"LookaheadKVPress: the model's config ({name}) is not one model.py reads: {e}") from None


def padded(kept, width, S):
    """Per-layer budgets in one cache. HF builds one attention mask for all layers from layer 0's length, so a
    question of several tokens fails on layers of other lengths. So every layer holds `width` slots (the largest
    C_l): its kept ones, then the first slots it did not keep, which kvpress's attention patch hides (it swaps
    their keys for one that gets no attention in every later forward), as AdaKVPress does. Returns the slots to
    gather (B, H_kv, width), in slot order, and module.masked_key_indices for them (None when nothing is hidden)."""
    B, H, C = kept.shape
    if C == width:
        return kept, None
    is_kept = torch.zeros(B, H, S, dtype=torch.bool, device=kept.device).scatter_(2, kept, True)
    # the earliest slots not kept: their order key S - j is largest first, kept ones are 0
    rest = torch.where(is_kept, 0, S - torch.arange(S, device=kept.device)).topk(width - C, dim=-1).indices
    idx, order = torch.cat([kept, rest], dim=-1).sort(dim=-1)
    b, h, j = (order >= C).nonzero(as_tuple=True)  # where the hidden ones landed
    return idx, (b, h, j)


@dataclass
class LookaheadKVPress(BasePress):
    """LookaheadKV (arXiv 2603.10899): M learned lookahead rows and a LoRA active on their rows only, run after
    the prefill; their mean attention over the prompt scores each slot, and each (layer, KV head) keeps its top C.

    adapter: our adapter's .safetensors (its .json beside it). compression_ratio: kvpress's, in [0, 1): keep
    int(S * (1 - ratio)) slots; or budget: C slots per (layer, KV head) whatever S. rule: the smoothing before
    the top C (support.selection.parse_rule: none, avg:K, max:K, span:K[:N]); the paper's is max:7.
    layer_budgets: C * w_l in layer l by the adapter's "layer_weights" (mean C) instead of C in every layer.
    Batches of equal-length prompts only (no padding mask is read), as kvpress's pipeline runs one prompt."""

    adapter: str | Path = ""
    compression_ratio: float = 0.0
    budget: int | None = None
    rule: str = "max:7"
    layer_budgets: bool = False
    module: object = field(default=None, init=False, repr=False)  # the LookaheadModule, for the model last seen
    scores: torch.Tensor | None = field(default=None, init=False, repr=False)  # (L, B, H_kv, S) of the last prompt
    kept: list | None = field(default=None, init=False, repr=False)  # per layer the kept slots (B, H_kv, C_l)

    @classmethod
    def from_adapter(cls, path, compression_ratio=0.0, budget=None, rule="max:7", layer_budgets=False):
        return cls(adapter=path, compression_ratio=compression_ratio, budget=budget, rule=rule,
                   layer_budgets=layer_budgets)

    def __post_init__(self):
        # every value and the adapter's files are checked here, before any model is seen, so a bad one is one
        # line naming it rather than a failure after a prefill
        r = self.compression_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < 1:  # NaN fails 0 <= r too
            raise ValueError(f"compression_ratio {r!r} must be a number in [0, 1): the share of the prompt's KV "
                             "slots to evict, e.g. 0.9")
        if self.budget is not None:
            if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 1:
                raise ValueError(f"budget {self.budget!r} must be a whole number >= 1: the KV slots kept per "
                                 "(layer, KV head), e.g. 128")
            if r:
                raise ValueError(f"give compression_ratio ({r}) or budget ({self.budget}), not both")
        try:
            self.parsed_rule = parse_rule(self.rule)
        except ValueError as e:  # Pool's own message names the width, not the text it came from
            raise ValueError(f"rule {self.rule!r}: {e}") from None
        self.adapter = Path(self.adapter)
        checks.read_adapter(self.adapter)  # FileNotFoundError or ValueError naming the file

    def post_init_from_model(self, model):
        """The adapter for this model: its architecture one model.py loads, the adapter's fingerprint this
        config's (ValueError naming the file otherwise), every tensor checked; called before any forward."""
        model_type = getattr(model.config, "model_type", None)
        if model_type not in checks.SUPPORTED_MODEL_TYPES:
            raise ValueError(f"LookaheadKVPress: model_type {model_type!r} ({type(model).__name__}) is not one "
                             f"LookaheadKV's model.py loads; supported: {', '.join(checks.SUPPORTED_MODEL_TYPES)}")
        cfg = hf_model_config(model.config)
        if self.module is None or self.module.cfg.fingerprint() != cfg.fingerprint():
            self.module = load_adapter(self.adapter, cfg, device=model.device)
        self.parsed_rule = parse_rule(self.rule, cfg.max_context, cfg.vocab_size)
        if self.layer_budgets and not self.module.info.get("layer_weights"):
            raise ValueError(f"layer_budgets=True, but adapter {self.adapter.with_suffix('.json')} holds no "
                             "\"layer_weights\": measure them (python -m research.train_lab --stage budgets)")
        if self.layer_budgets and model.config._attn_implementation == "eager":  # see padded()
            raise ValueError("layer_budgets=True hides slots through kvpress's attention patch, which eager "
                             "attention does not go through: load the model with attn_implementation=\"sdpa\"")

    def budgets(self, S):
        """C (the mean over layers) and the budget policy for a prompt of S tokens; C = 0: nothing to evict."""
        C = self.budget if self.budget is not None else (compute_n_kept(S, self.compression_ratio)
                                                         if self.compression_ratio else S)
        policy = budget_policy(self.module.info["layer_weights"]) if self.layer_budgets else uniform_budgets
        return (0 if C >= S else C), policy

    @contextmanager
    def __call__(self, model):
        """Watch the prefill run inside the block (its cache, its length S; the ids and final hidden states
        when the span rule needs them), then, leaving it, score and evict that cache in place."""
        self.post_init_from_model(model)
        seen, span = {}, hasattr(self.parsed_rule, "wrap")
        layers = model.model.layers

        def watch_attention(module, args, kwargs, output):  # layer 0's attention: once per forward
            cache = kwargs.get("past_key_values", kwargs.get("cache"))  # transformers >= 5.3 calls it "cache"
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            seen["calls"] = seen.get("calls", 0) + 1
            if cache is not None and cache.get_seq_length(0) == x.shape[1]:  # a prefill: nothing cached before
                seen["cache"], seen["S"] = cache, x.shape[1]

        def watch_ids(module, args, output):  # embed_tokens(ids): the prompt's ids, for the span rule's surprisal
            seen.setdefault("ids", args[0])

        def watch_final(module, args, output):  # the final norm: what the LM head reads, for the same
            seen.setdefault("hidden", output)

        hooks = [layers[0].self_attn.register_forward_hook(watch_attention, with_kwargs=True)]
        if span:
            hooks += [model.model.embed_tokens.register_forward_hook(watch_ids),
                      model.model.norm.register_forward_hook(watch_final)]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()
        if "calls" not in seen:  # no forward inside the block: nothing to evict
            return
        if "cache" not in seen:
            raise ValueError("LookaheadKVPress found no KV cache to evict: call the model with use_cache=True (or "
                             "past_key_values=DynamicCache()) on a fresh cache inside `with press(model)`")
        if span and "ids" not in seen:
            raise ValueError(f"the span rule ({self.rule}) reads the prompt's ids: call the model with input_ids")
        if seen["calls"] > 1:  # decoding or a second chunk went into the cache: its slots are not the prompt's
            raise ValueError("LookaheadKVPress evicts after the prefill: run only the prompt's forward inside "
                             "`with press(model)`, and generate after the block")
        self.compress_cache(model, seen["cache"], seen["S"], seen.get("ids"), seen.get("hidden"))

    @torch.no_grad()
    def compress_cache(self, model, cache, S, ids=None, hidden=None):
        """Score the S prompt slots of `cache` by the lookahead rows, then keep each (layer, KV head)'s top C_l."""
        C, policy = self.budgets(S)
        self.scores, self.kept = None, None
        if C == 0:
            return
        try:
            self.scores = self.lookahead_scores(model, cache, S)  # (L, B, H_kv, S)
        finally:
            for layer in cache.layers:  # the M rows' K/V are never kept, whatever happened
                layer.keys, layer.values = layer.keys[:, :, :S], layer.values[:, :, :S]
        scorer = make_scorer(EvictConfig("lookahead", budget=C, rule=self.parsed_rule, budgets=policy),
                             module=self.module)
        B = self.scores.shape[1]
        positions = torch.arange(S, device=self.scores.device).expand(B, S)
        hook = None
        if hasattr(self.parsed_rule, "wrap"):  # the span rule reads the prompt's surprisal from the LM head
            from extensions.span import HiddenStates, SpanHooks
            states = HiddenStates(ids, model.lm_head)
            states.hidden(hidden)
            hook = SpanHooks(None, states)
        prefilled = Prefilled(cache=None, hook=hook, logits=None, positions=positions, next_pos=positions[:, -1] + 1,
                              valid=None)
        self.kept = scorer.evict(self.scores, prefilled)
        width = max(idx.shape[-1] for idx in self.kept)
        for layer, attn, idx in zip(cache.layers, (x.self_attn for x in model.model.layers), self.kept):
            idx, masked = padded(idx, width, S)
            gather = idx[..., None].expand(-1, -1, -1, layer.keys.shape[-1])  # (B, H_kv, width, D)
            layer.keys = layer.keys.gather(2, gather).contiguous()
            layer.values = layer.values.gather(2, gather).contiguous()
            attn.masked_key_indices = masked  # None when the layer keeps `width` slots

    def lookahead_scores(self, model, cache, S):
        """The M rows at positions S .. S+M-1 on top of the cache, the LoRA on: per layer the mean over the M
        queries and the GQA group of their softmax attention over the S prompt slots, (L, B, H_kv, S)."""
        module, dev = self.module, cache.layers[0].keys.device
        B, M = cache.layers[0].keys.shape[0], module.n_tokens
        queries, scores, hooks = {}, {}, []

        def lora(l, name):
            def add(proj, args, out):  # every row of this chunk is a lookahead row
                delta = module.delta(l, name, args[0])  # None: `name` is no target of this adapter
                out = out if delta is None else out + delta
                if name == "q_proj":
                    queries[l] = out  # the queries HF's attention uses, before q_norm and RoPE
                return out
            return add

        def score(attn, args, kwargs, out):
            l = attn.layer_idx
            q = queries.pop(l).view(B, M, -1, attn.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3 normalises q per head before RoPE
                q = attn.q_norm(q)
            cos, sin = kwargs["position_embeddings"]
            q = q.transpose(1, 2)  # (B, H, M, D)
            q = q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)
            keys = cache.layers[l].keys  # (B, H_kv, S+M, D): the prompt's and, last, the M rows' own
            # the softmax runs over every key the M rows see (causal among themselves), as in lookaheadkv.py
            scores[l] = group_attention(q, keys)[..., :S].mean(dim=2)  # (B, H_kv, S)

        for l, layer in enumerate(model.model.layers):
            for name in {*module.targets, "q_proj"}:  # q_proj always: its output is what the scores need
                proj = getattr(getattr(layer, TARGETS[name]), name)
                hooks.append(proj.register_forward_hook(lora(l, name)))
            hooks.append(layer.self_attn.register_forward_hook(score, with_kwargs=True))
        try:
            emb = module.embeddings.to(device=dev, dtype=cache.layers[0].keys.dtype).expand(B, -1, -1)
            positions = (S + torch.arange(M, device=dev)).expand(B, M)
            model.model(inputs_embeds=emb, past_key_values=cache, position_ids=positions, use_cache=True)
        finally:
            for h in hooks:
                h.remove()
        return stack_layers(scores)
