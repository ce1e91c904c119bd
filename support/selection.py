"""
Beside the reading path: the text of a selection rule (--pool, an adapter .json's "rule") and an adapter's
recommended selection, read into the objects eviction.py and extensions/ define, with their checks.

The paper's rules (none, avg:K, max:K) are eviction.Pool. The span rule (span:K, span:K:N) and per-layer
budgets are beyond the paper (extensions/span.py, extensions/layer_budgets.py): they are imported here, and
only when a flag or a caller asks for them, so the reading path runs with extensions/ deleted.
"""
import sys

if __name__ == "__main__":  # a library module, run by -m or by its path: said before any import can fail
    sys.exit("error: support.selection is not a script: "
             "it reads --pool's rule: python generate.py --pool RULE")

import importlib
import json
import math

from eviction import Pool

RULES = ("none", "avg:K", "max:K", "span:K", "span:K:N")  # what --pool accepts (K: the width; N: the gate's first ids)
WIDTHS = {"avg": 5, "max": 7, "span": 8}  # a rule's width when the text names none (SnapKV's avg and max; span:8)
OLD_KEYS = ("pool", "kernel", "window", "layer_budget")  # an adapter .json's keys before 2026-12-02


def parse_rule(text, context=None, vocab=None):
    """"avg:5", "max:7", "none", "span:8" -> the selection rule (ValueError naming the text otherwise).
    context: the model's context length: a width wider than it is refused, as no prompt is that long (and a
    huge width is one endless pooling op). vocab: the model's vocabulary size: a span shortlist past it is
    refused (it would silently be the whole vocabulary, the exact surprisal)."""
    kind, width, first = rule_parts(text)
    if kind == "span":  # beyond the paper
        rule = extension("span", f"selection rule {text!r}").SpanRule(int(width or WIDTHS[kind]), int(first) if first else None)
        rule.check_fits(context, vocab)
        return rule
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


def layer_budgets(weights):
    """The per-layer budget policy of these weights (extensions/layer_budgets.py, beyond the paper)."""
    return extension("layer_budgets", "per-layer budgets").LayerBudgets(weights)


class MissingExtension(ValueError):
    """A flag or an adapter asks for an idea beyond the paper whose file is not in this checkout."""


def extension(name, what):
    """extensions/NAME.py, imported when a flag or an adapter asks for `what` (ValueError if it is not there)."""
    try:
        return importlib.import_module(f"extensions.{name}")
    except ModuleNotFoundError as e:
        if e.name not in ("extensions", f"extensions.{name}"):
            raise
        raise MissingExtension(f"{what} is beyond the paper and lives in extensions/{name}.py, which this checkout does "
                         "not have: restore the file, or select in the paper's form (no --pool)") from None


def adapter_selection(module):
    """(selection rule, budget policy) an adapter's .json recommends (module None: no adapter); None for what it
    leaves to the method.
    Nothing applies them unless asked (generate.py --pool, --layer-budgets): the default is the paper's form."""
    info = module.info if module is not None else {}  # no adapter: nothing recommended
    rule, weights = info.get("rule"), info.get("layer_weights")
    return (parse_rule(rule) if rule else None), (layer_budgets(weights) if weights else None)


def check_adapter_selection(path, info, n_layers, context=None):
    """An adapter .json's recommended "rule" and "layer_weights", checked when it is loaded (ValueError naming
    the file): a broken recommendation is a broken file, whether or not a flag asks for it. A recommendation
    whose extension is not in this checkout (extensions/ deleted) cannot be used, and is not checked."""
    old = [k for k in OLD_KEYS if k in info]
    if old:  # an adapter saved before 2026-12-02: say so rather than select differently
        raise ValueError(f"adapter {path}: its .json names {', '.join(old)}, keys of an older format: write its rule "
                         f"as \"rule\": \"span:8\" (pool:kernel) and layer_budget as \"layer_weights\"")
    try:
        check_selection(info.get("rule"), info.get("layer_weights"), n_layers, context)
    except ValueError as e:
        if isinstance(e, MissingExtension):
            return  # never applied unasked: a recommendation of a deleted extension is only unusable
        raise ValueError(f"adapter {path}: its .json's selection is not usable ({e}): fix or retrain it") from None


def check_selection(rule, weights, n_layers, context=None):
    """An adapter's "rule" and "layer_weights" (None: not given) as text and numbers, or ValueError. Nothing
    is imported: a recommendation beyond the paper is applied, its extension loaded, only when a flag asks.
    A weight must be a JSON number: float() would take "2" or true as 2.0 and 1.0 without a word. A span
    rule's shortlist is not held to the model's vocabulary: an adapter's rule is a recipe for any model."""
    if rule is not None:
        if rule_parts(rule)[0] != "span":
            parse_rule(rule, context)
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
                         "support.selection.parse_rule")
    if eviction.budget < 1:
        raise ValueError(f"budget {eviction.budget} must be at least 1 KV slot per (layer, KV head)")
    window, sinks = scorer.window, scorer.sinks
    if scorer.evicts and eviction.budget < window + sinks + 1:
        kept = f"the last {window} tokens" if window else f"{sinks} sink tokens"
        smaller = " or a smaller window" if window else ""
        raise ValueError(f"budget {eviction.budget} is too small for {eviction.method}: it always keeps {kept}; "
                         f"use a budget > {window + sinks}{smaller}")
