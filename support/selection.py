"""
Beside the reading path: the text of a selection rule (--pool, an adapter .json's "rule") and an adapter's
recommended selection, checked as text and numbers; the paper's rules (none, avg:K, max:K) read into eviction.Pool.

This file imports nothing of extensions/: the span rule (span:K, span:K:N) and per-layer budgets are beyond the
paper (extensions/span.py, extensions/layer_budgets.py): methods.py builds them (methods.parse_rule, .layer_budgets),
importing their files by name only when a flag or a caller asks, so the reading path runs with extensions/ deleted.
"""
import sys

if __name__ == "__main__":  # a library module, run by -m or by its path: said before any import can fail
    sys.exit("error: support.selection is not a script: "
             "it checks --pool's rule: python generate.py --pool RULE")

import json
import math

from eviction import Pool

RULES = ("none", "avg:K", "max:K", "span:K", "span:K:N")  # what --pool accepts (K: the width; N: the gate's first ids)
WIDTHS = {"avg": 5, "max": 7, "span": 8}  # a rule's width when the text names none (SnapKV's avg and max; span:8)
OLD_KEYS = ("pool", "kernel", "window", "layer_budget")  # an adapter .json's keys before 2026-12-02


def paper_pool(kind, width, context=None):
    """The paper's rule of this kind (none, avg, max; width: its text, "" for the default) as eviction.Pool.
    context: the model's context length: a width wider than it is refused, as no prompt is that long (and a huge
    width is one endless pooling op). One check for both readers: methods.parse_rule and check_selection."""
    rule = Pool(kind, int(width or WIDTHS.get(kind, 1)))
    if context is not None and rule.kernel > context:
        raise ValueError(f"pooling width {rule.kernel} is wider than the model's context of {context} tokens: no "
                         f"prompt is that long; use a width of at most {context}, e.g. {kind}:{WIDTHS[kind]}")
    return rule


def rule_parts(text):
    """A rule's text as (kind, width, shortlist), each a string ("" when not given), its syntax checked."""
    kind, colon, width = str(text).partition(":")
    width, colon2, first = width.partition(":")
    empty = (colon and not width) or (colon2 and not first)  # "max:", "span:8:", "span::1024": a field left out
    if empty:  # taken as the default, a typo would run another rule (span:8: is 20-60x slower than span:8:1024)
        raise ValueError(f"selection rule {text!r} has an empty field after a ':': write the number "
                         f"(e.g. max:7, span:8:1024), or leave the ':' out for the default")
    if (kind not in ("none", "avg", "max", "span") or (width and not number(width)) or (kind == "none" and width)
            or (first and (kind != "span" or not number(first)))):
        raise ValueError(f"selection rule {text!r}: use none, avg:K, max:K (K odd), span:K or span:K:N, "
                         "e.g. max:7")
    return kind, width, first


def number(text):
    """Whether text is a whole number in ASCII digits ("²".isdigit() is true, but int() refuses it)."""
    return text.isascii() and text.isdigit()


def check_adapter_selection(path, info, n_layers, context=None):
    """An adapter .json's recommended "rule" and "layer_weights", checked when it is loaded (ValueError naming
    the file): a broken recommendation is a broken file, whether or not a flag asks for it. Checked as text and
    numbers (check_selection), nothing imported: a recommendation of a deleted extension is only unusable."""
    old = [k for k in OLD_KEYS if k in info]
    if old:  # an adapter saved before 2026-12-02: say so rather than select differently
        raise ValueError(f"adapter {path}: its .json names {', '.join(old)}, keys of an older format: write its rule "
                         f"as \"rule\": \"span:8\" (pool:kernel) and layer_budget as \"layer_weights\"")
    try:
        check_selection(info.get("rule"), info.get("layer_weights"), n_layers, context)
    except ValueError as e:
        raise ValueError(f"adapter {path}: its .json's selection is not usable ({e}): fix or retrain it") from None


def check_selection(rule, weights, n_layers, context=None):
    """An adapter's "rule" and "layer_weights" (None: not given) as text and numbers, or ValueError. Nothing
    is imported: a recommendation beyond the paper is built (methods.py) only when a flag asks for it.
    A weight must be a JSON number: float() would take "2" or true as 2.0 and 1.0 without a word. A span
    rule's shortlist is not held to the model's vocabulary: an adapter's rule is a recipe for any model."""
    if rule is not None:
        kind, width, _ = rule_parts(rule)
        if kind != "span":  # span: its syntax only; SpanRule checks the rest when a flag builds it
            paper_pool(kind, width, context)
    if weights is not None:
        if not (isinstance(weights, list) and all(isinstance(w, (int, float)) and not isinstance(w, bool)
                                                  for w in weights)):
            raise ValueError(f"layer_weights must be a list of numbers, got {json.dumps(weights)[:60]}")
        if not weights or min(weights) < 0 or not sum(weights) > 0 or not all(map(math.isfinite, weights)):
            raise ValueError(f"layer weights must be finite numbers >= 0, not all 0, got {weights}")
        if not math.isfinite(sum(weights)):  # each finite, their sum not (1e308 twice): spread_budgets' NaN
            raise ValueError(f"layer_weights sum to {sum(weights)}: write them with mean 1")
        if len(weights) != n_layers:
            raise ValueError(f"{len(weights)} layer weights for a model of {n_layers} layers: measure them for "
                             "this model (python -m research.train_lab --stage budgets)")


def check_scorer(scorer):
    """What methods.make_scorer refuses in a method's EvictConfig (ValueError): an option the method does not
    have, a rule that is no selection rule, a budget below 1 KV slot or below the tokens the method always keeps."""
    eviction = scorer.eviction
    unknown = sorted(set(eviction.options) - set(scorer.default_options))
    if unknown:
        raise ValueError(f"method {eviction.method} has no setting {', '.join(unknown)}; its own: "
                         f"{', '.join(scorer.default_options) or 'none'}")
    if not (isinstance(scorer.rule, Pool) or hasattr(scorer.rule, "wrap")):
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
