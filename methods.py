"""
Every method by name, and what an adapter's .json or a flag may name for selection: the one table the
scripts and the harness read. Nothing below this file (eviction.py, lookaheadkv.py, baselines.py,
extensions/) knows the names.

    scorer = make_scorer(EvictConfig("lookahead", budget=128), module=load_adapter(path, model.config))
    cache, logits, next_pos, kept = eviction.compress(model, ids, scorer)

An adapter ships the way it selects: "rule" (e.g. "span:8:1024": extensions/span.py) and "layer_weights"
(extensions/layer_budgets.py) in its .json. make_scorer applies them to method lookahead unless the
EvictConfig names its own rule or budgets; an adapter that names neither selects in the paper's form
(LookaheadKV's defaults: max-pool 7, C in every layer).
"""
import dataclasses
import json
import math

import torch

from baselines import H2O, LAQ, FullKV, Oracle, PyramidKV, RandomKV, SnapKV, StreamingLLM, Unpooled
from eviction import Pool, Scorer
from extensions.layer_budgets import LayerBudgets
from extensions.span import Spanned, SpanRule
from lookaheadkv import LookaheadKV, LookaheadModule, untrained_module

METHODS = {"full": FullKV, "streaming": StreamingLLM, "random": RandomKV, "snapkv": SnapKV, "pyramidkv": PyramidKV,
           "h2o": H2O, "laq": LAQ, "oracle": Oracle, "lookahead": LookaheadKV}
RULES = ("none", "avg:K", "max:K", "span:K", "span:K:N")  # what --pool accepts (K: the width; N: the gate's first ids)
WIDTHS = {"avg": 5, "max": 7, "span": 8}  # a rule's width when the text names none (SnapKV's avg and max; span:8)


def parse_rule(text, context=None, vocab=None):
    """"avg:5", "max:7", "none", "span:8" -> the selection rule (ValueError naming the text otherwise).
    context: the model's context length (config.json, read before the model loads): a width wider than it
    is refused, as no prompt is that long (a width of 10**11 once ran as one endless pooling op that not
    even SIGTERM could stop). vocab: the model's vocabulary size: a span shortlist past it is refused (it
    would silently be the whole vocabulary, the exact surprisal)."""
    kind, _, width = str(text).partition(":")
    width, _, first = width.partition(":")
    if (kind not in ("none", "avg", "max", "span") or (width and not number(width)) or (kind == "none" and width)
            or (first and (kind != "span" or not number(first)))):
        raise ValueError(f"selection rule {text!r}: use none, avg:K, max:K (K odd), span:K or span:K:N, e.g. span:8")
    if kind == "span":
        rule = SpanRule(int(width or WIDTHS[kind]), int(first) if first else None)
        rule.check_fits(context, vocab)
        return rule
    rule = Pool(kind, int(width or WIDTHS.get(kind, 1)))
    if context is not None and rule.kernel > context:
        raise ValueError(f"pooling width {rule.kernel} is wider than the model's context of {context} tokens: no "
                         f"prompt is that long; use a width of at most {context}, e.g. {kind}:{WIDTHS[kind]}")
    return rule


def number(text):
    """Whether text is a whole number in ASCII digits ("²".isdigit() is true, but int() refuses it)."""
    return text.isascii() and text.isdigit()


def make_scorer(eviction, module=None, response=None):
    """The Scorer of eviction.method, its config checked (check_scorer: ValueError). For lookahead, the adapter's
    own selection (its .json: the shipped adapter's "rule" span:8:1024 and "layer_weights") unless the EvictConfig
    names a rule or budgets; an adapter that names none selects in the paper's form (LookaheadKV's defaults:
    max-pool 7, C in every layer)."""
    if eviction.method not in METHODS:
        raise ValueError(f"unknown method {eviction.method!r}; choose from {', '.join(METHODS)}")
    method = METHODS[eviction.method]
    if eviction.method == "lookahead" and module is not None:
        rule, budgets = adapter_selection(module)
        eviction = dataclasses.replace(eviction, rule=eviction.rule or rule, budgets=eviction.budgets or budgets)
    if issubclass(method, Unpooled) and eviction.rule is not None:
        raise ValueError(f"method {eviction.method} selects by its own scores alone: a selection rule "
                         f"(--pool {eviction.rule}) does not apply to it")
    if isinstance(eviction.rule, SpanRule):  # beyond the paper: the method, unpooled, wrapped in the span rule
        scorer = Spanned(method(dataclasses.replace(eviction, rule=Pool("none")), module, response), eviction.rule)
    else:
        scorer = method(eviction, module=module, response=response)
    check_scorer(scorer)
    return scorer


def check_scorer(scorer):
    """What make_scorer refuses in a method's EvictConfig (ValueError): an option the method does not have, a
    rule that is no selection rule, a budget below 1 KV slot or below the tokens the method always keeps."""
    eviction = scorer.eviction
    unknown = sorted(set(eviction.own) - set(scorer.default_options))
    if unknown:
        raise ValueError(f"method {eviction.method} has no setting {', '.join(unknown)}; its own: "
                         f"{', '.join(scorer.default_options) or 'none'}")
    if not isinstance(scorer.rule, (Pool, SpanRule)):
        raise ValueError(f"selection rule {scorer.rule!r} is not a pooling or a span rule: read it with "
                         "methods.parse_rule")
    if eviction.budget < 1:
        raise ValueError(f"budget {eviction.budget} must be at least 1 KV slot per (layer, KV head)")
    window, sinks = scorer.window, scorer.sinks
    if scorer.evicts and eviction.budget < window + sinks + 1:
        kept = f"the last {window} tokens" if window else f"{sinks} sink tokens"
        smaller = " or a smaller window" if window else ""
        raise ValueError(f"budget {eviction.budget} is too small for {eviction.method}: it always keeps {kept}; "
                         f"use a budget > {window + sinks}{smaller}")


def selection_of(scorer):
    """What a scorer selects by, in words: (its selection rule, its budget policy), e.g. ("span:8:1024",
    "per-layer budgets") for the shipped adapter, ("none", "C in every layer") for an unpooled top C,
    ("avg:5", "pyramid budgets") for PyramidKV: generate.py's stats, bench.py's rows and evaluate.py's tables say it."""
    if not scorer.evicts:
        return "none", "nothing evicted"
    policy = scorer.eviction.budgets
    if isinstance(policy, LayerBudgets):
        budgets = "per-layer budgets"
    elif policy is None and scorer.default_budgets.__func__ is not Scorer.default_budgets:  # PyramidKV's own
        budgets = "pyramid budgets"
    else:
        budgets = "C in every layer"
    return repr(scorer.rule), budgets


def adapter_selection(module):
    """(selection rule, budget policy) an adapter's .json names; None for what it leaves to the method."""
    rule, weights = module.info.get("rule"), module.info.get("layer_weights")
    return (parse_rule(rule) if rule else None), (LayerBudgets(weights) if weights else None)


def load_adapter(path, cfg, device="cpu"):
    """A LookaheadModule from path (.safetensors + .json), with its selection checked now rather than
    after a prefill: ValueError naming the file."""
    module = LookaheadModule.load(path, cfg, device)
    old = [k for k in ("pool", "kernel", "window", "layer_budget") if k in module.info]
    if old:  # an adapter saved before 2026-12-02: say so rather than select differently
        raise ValueError(f"adapter {path}: its .json names {', '.join(old)}, keys of an older format: write its rule "
                         f"as \"rule\": \"span:8\" (pool:kernel) and layer_budget as \"layer_weights\"")
    try:
        check_selection(module.info.get("rule"), module.info.get("layer_weights"), cfg.num_hidden_layers,
                        cfg.max_context)
    except ValueError as e:
        raise ValueError(f"adapter {path}: its .json's selection is not usable ({e}): fix or retrain it") from None
    return module


def check_selection(rule, weights, n_layers, context=None):
    """An adapter's "rule" and "layer_weights" (None: not given) as selection will read them, or ValueError.
    A weight must be a JSON number: LayerBudgets' float() would take "2" or true as 2.0 and 1.0 without a word.
    context: the model's; a rule's width past it is refused. Its span shortlist is not held to the model's
    vocabulary: an adapter's rule is a recipe for any model (train.py's default span:8:1024 on a model of
    fewer ids is the exact surprisal, as it should be)."""
    if rule is not None:
        parse_rule(rule, context)
    if weights is not None:
        if not (isinstance(weights, list) and all(isinstance(w, (int, float)) and not isinstance(w, bool)
                                                  for w in weights)):
            raise ValueError(f"layer_weights must be a list of numbers, got {json.dumps(weights)[:60]}")
        budgets = LayerBudgets(weights)  # each finite and >= 0, not all 0
        if not math.isfinite(sum(weights)):  # each finite, their sum not (1e308 twice): spread_budgets' NaN
            raise ValueError(f"layer_weights sum to {sum(weights)}: write them with mean 1")
        budgets(128, n_layers, 10**6)  # one per layer


def selecting_like(module, adapter):
    """`module` (an untrained one) selecting with `adapter`'s rule and per-layer budgets: "same rule"."""
    for key in ("rule", "layer_weights"):
        if key in adapter.info:
            module.info[key] = adapter.info[key]
    return module


def untrained(model, seed, like=None, **shape):
    """The one way the scripts build an untrained module (lookaheadkv.untrained_module): drawn from `seed`, of
    the shape of `like` (an adapter: its M, rank, alpha and targets, selecting as it does) or of `shape`
    (n_tokens, rank, alpha, targets; the defaults for what is not given)."""
    torch.manual_seed(seed)  # the same draw on every run: P ~ N(0, std of the token embeddings)
    if like is not None:
        shape = dict(n_tokens=like.n_tokens, rank=like.rank, alpha=like.alpha, targets=like.targets)
    module = untrained_module(model, **shape)
    return module if like is None else selecting_like(module, like)
