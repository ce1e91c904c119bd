"""
Every method by name: the one table the scripts and the harness read. Nothing below this file
(eviction.py, lookaheadkv.py, baselines.py) knows the names.

What the EvictConfig leaves unset is its paper's: LookaheadKV selects by max-pool 7, C in every
layer, whatever its adapter's .json recommends. A rule beyond the paper (extensions/span.py) wraps
the method as kvpress's wrappers wrap any press (`rule.wrap`). An idea beyond the paper is named
here only in extension(), which imports its file by name when a flag or an adapter asks for it
(parse_rule, layer_budgets, and the scripts' own flags): nothing imports extensions/ unasked.
"""
import dataclasses
import importlib

import torch

from baselines import H2O, LAQ, FullKV, Oracle, PyramidKV, RandomKV, SnapKV, StreamingLLM, Unpooled
from eviction import Pool, Scorer
from lookaheadkv import LookaheadKV, LookaheadModule, untrained_module
from support import selection

METHODS = {"full": FullKV, "streaming": StreamingLLM, "random": RandomKV, "snapkv": SnapKV,
           "pyramidkv": PyramidKV, "h2o": H2O, "laq": LAQ, "oracle": Oracle,
           "lookahead": LookaheadKV}


def make_scorer(eviction, module=None, response=None):
    """The Scorer of eviction.method (module: the adapter; response: the oracle's answer), its
    config checked (ValueError). A rule's text ("max:7") is read here (parse_rule); a rule that
    wraps gets the method unpooled and wraps it."""
    if eviction.method not in METHODS:
        raise ValueError(f"unknown method {eviction.method!r}; choose from {', '.join(METHODS)}")
    method = METHODS[eviction.method]
    if issubclass(method, Unpooled) and eviction.rule is not None:
        raise ValueError(f"method {eviction.method} selects by its own scores alone: a selection "
                         f"rule (--pool {eviction.rule}) does not apply to it")
    if isinstance(eviction.rule, str):  # a rule's text, e.g. "max:7" (generate.py's --pool)
        eviction = dataclasses.replace(eviction, rule=parse_rule(eviction.rule))
    if hasattr(eviction.rule, "wrap"):  # the method, unpooled, wrapped in the rule
        scorer = eviction.rule.wrap(method(dataclasses.replace(eviction, rule=Pool("none")), module,
                                           response))
    else:
        scorer = method(eviction, module=module, response=response)
    selection.check_scorer(scorer)
    return scorer


def parse_rule(text, context=None, vocab=None):
    """"avg:5", "max:7", "none", "span:8" -> the selection rule (ValueError naming the text
    otherwise). context: the model's context length: a width wider than it is refused, as no
    prompt is that long (and a huge width is one endless pooling op). vocab: the model's
    vocabulary size: a span shortlist past it is refused (it would silently be the whole
    vocabulary, the exact surprisal)."""
    kind, width, first = selection.rule_parts(text)  # the syntax, checked as text
    if kind != "span":  # the paper's: eviction.Pool
        return selection.paper_pool(kind, width, context)
    # beyond the paper: extensions/span.py, imported only now that a rule's text names it
    span = extension("span", f"selection rule {text!r}")
    rule = span.SpanRule(int(width or selection.WIDTHS[kind]), int(first) if first else None)
    rule.check_fits(context, vocab)
    return rule


def selection_of(scorer):
    """What a scorer selects by, in words, e.g. ("max:7", "C in every layer") for LookaheadKV."""
    if not scorer.evicts:
        return "none", "nothing evicted"
    policy = scorer.eviction.budgets
    if policy is None and scorer.default_budgets.__func__ is not Scorer.default_budgets:
        return repr(scorer.rule), "pyramid budgets"  # PyramidKV's own
    return repr(scorer.rule), getattr(policy, "name", "C in every layer")


def load_adapter(path, cfg, device="cpu"):
    """A LookaheadModule from path (.safetensors + .json); its recommended selection (used only if
    a flag asks) checked now as text, no extension imported: a ValueError, not a failed prefill."""
    module = LookaheadModule.load(path, cfg, device)
    selection.check_adapter_selection(path, module.info, cfg.num_hidden_layers, cfg.max_context)
    return module


def adapter_selection(module):
    """(selection rule, budget policy) an adapter's .json recommends (module None: no adapter);
    None for what it leaves to the method. Nothing applies them unless asked (generate.py --pool,
    --layer-budgets): the default is the paper's form."""
    info = module.info if module is not None else {}  # no adapter: nothing recommended
    rule, weights = info.get("rule"), info.get("layer_weights")
    return (parse_rule(rule) if rule else None), (layer_budgets(weights) if weights else None)


def layer_budgets(weights):
    """The per-layer budget policy of these weights (extensions/layer_budgets.py, beyond the
    paper)."""
    return extension("layer_budgets", "per-layer budgets").LayerBudgets(weights)


class MissingExtension(ValueError):
    """A flag or an adapter asks for an idea beyond the paper whose file is not in this
    checkout."""


def extension(name, what):
    """extensions/NAME.py, imported when a flag or an adapter asks for `what` (ValueError if it is
    not there). By name, not by an import statement: the reading path runs with extensions/
    deleted, and a deleted file is one error line naming it only when it is asked for."""
    try:
        return importlib.import_module(f"extensions.{name}")
    except ModuleNotFoundError as e:
        if e.name not in ("extensions", f"extensions.{name}"):  # its own import failed: say so
            raise
        raise MissingExtension(f"{what} is beyond the paper and lives in extensions/{name}.py, "
                               "which this checkout does not have: restore the file, or select in "
                               "the paper's form (no --pool)") from None


def parse_targets(text):
    """"q_proj,k_proj" -> the tuple; "all" -> all seven; "" or "none" -> () (no LoRA)."""
    if text.strip() == "all":
        return LookaheadModule.TARGETS
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in LookaheadModule.TARGETS + ("none",)]
    if bad:
        raise ValueError(f"--targets: unknown {', '.join(bad)}; use all, none, or any of "
                         f"{', '.join(LookaheadModule.TARGETS)}")
    if "none" in names and len(names) > 1:  # "none,q_proj" contradicts itself
        raise ValueError(f"--targets {text}: none (no LoRA) and LoRA targets: give one of them")
    return tuple(t for t in names if t != "none")


def untrained(model, seed, like=None, **shape):
    """The one way the scripts build an untrained module: drawn from `seed`, of the shape of
    `like` (an adapter: its M, rank, alpha and targets) or of `shape` (defaults where not given)."""
    torch.manual_seed(seed)  # the same draw on every run: P ~ N(0, std of the token embeddings)
    if like is not None:
        shape = dict(n_tokens=like.n_tokens, rank=like.rank, alpha=like.alpha, targets=like.targets)
    return untrained_module(model, **shape)
