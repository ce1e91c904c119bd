"""
generate.py's flags and their checks, in the order they are read, all before the weights load:

    args = get_args(argv)
    run = checked_inputs(args)   # run.folder, cfg, tok, ids, blank, module, eviction, scorer, evictor, chat

each flag alone first (a bad value stops in a second, before a default model is prepared), then the model's
config.json against them, the prompt file, the tokenizer, the adapter, the method as it will run (its Scorer,
built once here and used by generate.py: its constructor checks budget, window and rule), and the prompt's
tokens against the context. A bad one raises ValueError or OSError, which cli.run turns into one `error:` line.

Beyond the paper, and imported only when its flag asks: --pool span:K:N (extensions/span.py), --layer-budgets
(extensions/layer_budgets.py), --decode-budget (extensions/decode.py) and --turns (extensions/chat.py).
"""
import argparse
import dataclasses
import sys

import torch

from baselines import Unpooled
from eviction import EvictConfig, uniform_budgets
from methods import METHODS, load_adapter, make_scorer
from model import ModelConfig
from support import cli, selection
from support.tokenizer import Tokenizer

def get_args(argv=None, doc=None):
    p = cli.Parser("generate.py", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--prompt", default=None, help="a text file with the user message, or - for stdin")
    a("--model", default=None, help="an HF folder (default: weights/SmolLM2-135M-Instruct, prepared if missing)")
    a("--method", default="lookahead", choices=METHODS, help="how to choose the kept tokens")
    a("--budget", type=int, default=128, help="KV slots kept per (layer, KV head), protected tokens included")
    a("--adapter", default=None, help="lookahead adapter .safetensors (default: the one shipped for the model)")
    a("--window", type=int, default=32, help="snapkv/pyramidkv/h2o/laq: last prompt tokens always kept (>= 1); "
      "with --decode-budget or in a chat, every method's last slots kept at each later eviction")
    a("--pool", default=None, metavar="RULE", help=f"selection rule: {' | '.join(selection.RULES)} (default: the "
      "method's own, the paper's: lookahead max:7, snapkv avg:5). span:K:N is beyond the paper: the span rule "
      "(extensions/span.py) keeps a run of tokens the model could not predict whole once one of them scores")
    a("--layer-budgets", action="store_true", help="beyond the paper (extensions/layer_budgets.py): lookahead "
      "keeps its adapter's per-layer budgets (its .json's layer_weights, mean C) instead of C in every layer")
    a("--uniform-budgets", action="store_true", help="C slots in every layer (the paper's; pyramidkv: instead of its "
      "pyramid; lookahead: its default)")
    a("--two-pass", action="store_true",
      help="lookahead: score in a second forward (the reference form) instead of inside the prefill")
    a("--max-new-tokens", type=int, default=256)
    a("--decode-budget", type=int, default=None,
      help="beyond the paper (extensions/decode.py): hold the cache to this many slots while decoding too")
    a("--every", type=int, default=32,
      help="with --decode-budget: re-score and evict once the cache holds decode-budget + every slots")
    a("--turns", default=None, help="beyond the paper (extensions/chat.py): a chat, a JSON list of user turns, "
      "or - for stdin, one line a turn (/reset starts over, end of input ends it)")
    a("--chat", action=argparse.BooleanOptionalAction, default=None,
      help="wrap the prompt in the chat template (default: when the tokenizer has one)")
    a("--temperature", type=float, default=0.0, help="0 = greedy")
    a("--top-p", type=float, default=1.0)
    a("--device", default=cli.default_device(), help="cpu, cuda or cuda:N")
    a("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
      help="default: float32 on CPU, bfloat16 on CUDA")
    a("--seed", type=int, default=0)
    a("--show", action="store_true",
      help="print the prompt with the kept tokens highlighted (brighter = kept by more layers and heads)")
    a("--json", action="store_true", help="print one JSON object instead of streaming text")
    return p.parse_args(argv)


@dataclasses.dataclass
class Run:
    """What generate.py needs, every part of it checked."""
    folder: object  # the model's folder
    cfg: ModelConfig
    tok: Tokenizer
    ids: list | None  # the prompt's token ids (None in a chat)
    blank: bool  # the prompt was blank once control characters were removed
    module: object  # the adapter (LookaheadModule) or None
    eviction: EvictConfig  # the method as the flags set it
    scorer: object  # its Scorer (None for the oracle: it needs the full-cache answer, made after the load)
    evictor: object = None  # beyond the paper: --decode-budget's DecodeEviction
    chat: object = None  # beyond the paper: --turns' chat(args, model, run), its turns checked


def checked_inputs(args):
    """Every flag and file checked, in the order they are read, then the method as it will run (a Run)."""
    check_flags(args)
    folder = cli.resolve_model(args.model)
    cfg = ModelConfig.from_hf_config(folder)
    check_fits_model(args, cfg)
    text, note = read_prompt(args.prompt, cfg.max_context) if args.prompt is not None else (None, None)
    if note:
        cli.warn(note)
    tok = Tokenizer(folder, cfg)
    module = adapter(args, cfg, folder, load_adapter)
    eviction = eviction_config(args, args.budget, cfg, module)
    scorer = make_scorer(eviction, module) if args.method != "oracle" else None
    ids = prompt_ids(args, tok, text, cfg.max_context) if text is not None else None
    run = Run(folder, cfg, tok, ids, text is not None and not text.strip(), module, eviction, scorer)
    if args.decode_budget is not None and args.turns is None:  # beyond the paper: the cache held while decoding
        from extensions.decode import DecodeEviction
        run.evictor = DecodeEviction(make_scorer(dataclasses.replace(eviction, budget=args.decode_budget), module),
                                     args.every, args.window)
    if args.turns is not None:  # beyond the paper: a chat, evicted to --budget at every turn
        from extensions import chat
        run.chat = chat.checked(args, run)
    return run


def eviction_config(args, budget, cfg=None, module=None):
    """The EvictConfig of the flags: what they leave unset is the method's own, the paper's. cfg: the model's
    config, whose context and vocabulary bound --pool's rule; module: the adapter, whose per-layer budgets
    --layer-budgets asks for."""
    bounds = (cfg.max_context, cfg.vocab_size) if cfg is not None else ()
    rule = cli.flag_value("--pool", selection.parse_rule, args.pool, *bounds) if args.pool is not None else None
    if args.layer_budgets and module is not None:
        budgets = selection.adapter_selection(module)[1]
        if budgets is None:  # nothing to apply: refused rather than running C in every layer unannounced
            raise ValueError(f"--layer-budgets: the adapter {args.adapter or cli.default_adapter_path(cfg)} has no "
                             "layer_weights in its .json; drop the flag, or measure them (python -m "
                             "research.train_lab --stage budgets)")
    else:
        budgets = uniform_budgets if args.uniform_budgets else None
    flags = dict(one_pass=not args.two_pass, seed=args.seed)  # the flags that set a method's own options
    options = {k: v for k, v in flags.items() if k in METHODS[args.method].default_options}
    return EvictConfig(args.method, budget, window=args.window, rule=rule, options=options, budgets=budgets)


# -----------------------------------------------------------------------------
# Every flag before any file is read


def check_flags(args):
    """Every check that needs no file but the prompt's name: a bad value stops in a second."""
    if (args.prompt is None) == (args.turns is None):
        raise ValueError("give one of --prompt FILE (or - for stdin) and --turns FILE.json (a chat; - reads "
                         "stdin, one line a turn)")
    if args.prompt not in (None, "-"):
        cli.input_file("--prompt", args.prompt)
    if args.turns not in (None, "-"):
        cli.input_file("--turns", args.turns)
    if args.every < 1:
        raise ValueError(f"--every {args.every}: evict at most once per generated token, e.g. --every 32")
    if args.pool is not None:  # its text alone now (its width against the model's context once config.json is read)
        cli.flag_value("--pool", selection.parse_rule, args.pool)
    if args.decode_budget is not None or args.turns is not None:  # beyond the paper: asked for by a flag
        from extensions.decode import DECODE_METHODS, check_budget
    if args.decode_budget is not None and args.method not in DECODE_METHODS:
        raise ValueError(f"--decode-budget re-scores the cache while decoding, by a method's decode-phase form: "
                         f"use --method {', '.join(DECODE_METHODS)}")
    if args.turns is not None and args.method not in (*DECODE_METHODS, "full"):
        raise ValueError(f"a chat re-scores the whole cache at each turn, by a method's decode-phase form: "
                         f"use --method {', '.join(DECODE_METHODS)} or full")
    if args.decode_budget is not None and args.decode_budget < args.budget:
        raise ValueError(f"--decode-budget {args.decode_budget} is below --budget {args.budget}: the prompt's "
                         f"cache would not fit it; use --decode-budget >= --budget")
    if (args.decode_budget is not None or args.turns is not None) and args.method in DECODE_METHODS:
        sinks = METHODS[args.method].default_options.get("n_sink", 0)  # StreamingLLM's, kept at every eviction
        check_budget(args.decode_budget or args.budget, args.window, sinks)
    if args.window < 0:
        raise ValueError(f"--window {args.window}: the number of always-kept last tokens must be >= 0")
    if args.budget < 1:
        raise ValueError(f"--budget {args.budget}: keep at least 1 KV slot per (layer, KV head), e.g. --budget 128")
    if args.two_pass and args.method != "lookahead":
        raise ValueError(f"--two-pass: method {args.method} has no lookahead rows to score in a second pass; "
                         "drop it, or use --method lookahead")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens}: generate at least 1 token")
    cli.check_seed("--seed", args.seed)
    cli.at_least("--temperature", args.temperature, 0)
    cli.positive("--top-p", args.top_p)
    cli.fraction("--top-p", args.top_p)
    if args.adapter is not None:
        if args.method != "lookahead":
            raise ValueError(f"--adapter: method {args.method} uses no adapter; drop it, or use --method lookahead")
        cli.input_file("--adapter", args.adapter)
    if args.layer_budgets and args.method != "lookahead":
        raise ValueError(f"--layer-budgets are the adapter's: method {args.method} has none; use --method lookahead")
    if args.uniform_budgets and args.layer_budgets:
        raise ValueError("--uniform-budgets and --layer-budgets: choose one (the default is C in every layer)")
    if args.pool is not None and issubclass(METHODS[args.method], Unpooled):
        raise ValueError(f"method {args.method} selects by its own scores alone: a selection rule (--pool "
                         f"{args.pool}) does not apply to it")
    if args.method == "oracle":  # its Scorer is made once its answer is known: its config is checked now
        make_scorer(eviction_config(args, args.budget), response=torch.zeros(1, 1, dtype=torch.long))
    cli.check_generate_flags(args)  # --show with --json, --show/--no-chat in a chat: refused, not dropped
    cli.check_device(args.device)
    cli.check_model_dir(args.model)


def check_fits_model(args, cfg):
    """The flags against what the model can use (config.json, read before the weights): a length past its
    context is one no prompt or answer can reach, so it would do nothing (--pool's width, which would run without
    end, is held to it by eviction_config(args, budget, cfg) in checked_inputs). --max-new-tokens is held to the context with the prompt's tokens (prompt_ids) or a chat's first turns
    (extensions/chat.py)."""
    ctx = cfg.max_context
    cli.check_window_fits("--window", args.window, cfg)  # names a sliding_window that shortened the context
    if args.decode_budget is not None and args.decode_budget + args.every > ctx:
        raise ValueError(f"--decode-budget {args.decode_budget} with --every {args.every}: the cache would have to "
                         f"hold {args.decode_budget + args.every} slots before an eviction, past the model's context "
                         f"of {ctx}: use a --decode-budget of at most {ctx - args.every}, or a smaller --every")


# -----------------------------------------------------------------------------
# The files: the prompt, its tokens, the adapter


def read_prompt(arg, context):
    """(the user message, a warning or None) from a UTF-8 file, or from stdin for "-". A blank file is an
    error; control characters are removed, with a warning (all of them: the answer runs on the template).
    A file too big to fit `context` tokens at cli.BYTES_PER_TOKEN is refused by its size, before it is read
    or tokenized (a 200 MB file would otherwise take all the memory in the tokenizer)."""
    limit = cli.BYTES_PER_TOKEN * context
    if arg == "-":
        raw, where = sys.stdin.buffer.read(limit + 1), "stdin"
        size = len(raw)
    else:
        path, where = cli.input_file("--prompt", arg), f"prompt file {arg}"
        size = path.stat().st_size
        raw = path.read_bytes() if size <= limit else b""
    if size > limit:
        raise ValueError(f"the prompt ({where}) is over {limit // 2**10} KB, more than the model's context of "
                         f"{context} tokens can hold: shorten it")
    text = cli.read_text(raw, where)  # UTF-16 without its BOM would be read as UTF-8, NULs removed, and answered
    if not text.strip():
        raise ValueError(f"the prompt ({where}) is empty: write the user message into it")
    text, removed = cli.printable(text)
    if not removed:
        return text, None
    if not text.strip():
        return text, (f"the prompt ({where}) holds only control characters ({removed}, e.g. NUL bytes): they are "
                      "removed, and the model answers an empty message")
    return text, f"{removed} control characters (e.g. NUL bytes) removed from the prompt ({where})"


def prompt_ids(args, tok, text, context):
    """The prompt's token ids, in the chat template unless --no-chat (default: when the tokenizer has one),
    held to the context with --max-new-tokens."""
    chat = args.chat if args.chat is not None else tok.format is not None
    if chat and tok.format is None:
        raise ValueError("--chat: this tokenizer has no chat format we know (ChatML or Llama-3): use --no-chat")
    ids = tok.encode(tok.chat(text) if chat else text)
    if not ids:
        raise ValueError(f"the prompt ({args.prompt}) is empty once control characters are removed, and "
                         "without a chat template nothing is left to answer: write the user message into it")
    if len(ids) + args.max_new_tokens > context:
        raise ValueError(f"the prompt is {len(ids)} tokens and --max-new-tokens {args.max_new_tokens}; "
                         f"the model's context is {context}: shorten the prompt or lower --max-new-tokens")
    return ids


def adapter(args, cfg, folder, load_adapter):
    """The LookaheadModule for --method lookahead (--adapter, or the one shipped for the model), else None."""
    if args.method != "lookahead":
        return None
    path = args.adapter or cli.default_adapter_path(cfg)
    if args.adapter is None and not path.is_file():
        raise FileNotFoundError(f"no lookahead adapter for {cfg.name} ({path}): "
                                f"train one with python train.py --model {folder}, or pass --adapter")
    return load_adapter(path, cfg)
