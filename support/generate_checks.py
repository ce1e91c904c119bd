"""
generate.py's flags and files, checked in the order they are read, all before the weights load:

    checked = check(args, method)  # raises, or what it read and made: the folder, the text, the
                                   # tokenizer, the adapter, the method (generate.method) and the ids

each flag alone first (a bad value stops in a second, before a default model is prepared), then the
model's config.json against them, the tokenizer, the adapter, the memory the weights need, the prompt
file and its tokens against the context. A bad one raises ValueError or OSError, which cli.run turns
into one `error:` line. What check() reads or makes it returns, so nothing is built twice; the method
is made by generate.py's own method(args, adapter), which check() calls where its config is checked.

Beyond the paper: this file imports no extension; methods.py loads each by name (methods.extension), only
when its flag is given. --decode-budget and --turns are checked by extensions/decode.py's check_flags and
extensions/chat.py's turns_of, which generate.py loads so; --pool span:K is read by methods.parse_rule
(extensions/span.py), and --layer-budgets is built by methods.layer_budgets in generate.py.
"""
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from baselines import Unpooled
from eviction import EvictConfig
from methods import METHODS, load_adapter, make_scorer, parse_rule
from model import ModelConfig, default_dtype
from support import cli
from support.tokenizer import Tokenizer


@dataclass
class Checked:
    """What check() had to read to check it, handed to generate.py: each is made once per run (the model's
    weights are not read: generate.py loads them once every check has passed)."""

    folder: Path  # the model's folder (prepared if it was the missing default)
    config: ModelConfig  # its config.json, read
    text: str | None  # the prompt's text (None with --turns: the chat reads its own)
    tok: Tokenizer  # the model's tokenizer
    adapter: object  # --method lookahead's LookaheadModule (on the CPU), else None
    eviction: EvictConfig  # the method's config (method's)
    scorer: object  # the method, a Scorer (None for the oracle: made once FullKV has answered)
    ids: list | None  # the prompt's ids, in the chat template unless --no-chat (None with --turns)


def check(args, method):
    """Every flag and file of generate.py, in the order they are read, before the weights load: raises
    (ValueError, OSError) or returns what it read and made (Checked). method(args, adapter) -> (EvictConfig,
    Scorer): generate.py's, called once the adapter is read. With --turns the turns are the chat's to read
    (extensions/chat.py's turns_of, which generate.py calls)."""
    check_flags(args)
    folder = cli.resolve_model(args.model)
    cfg = ModelConfig.from_hf_config(folder)
    check_fits_model(args, cfg)
    if args.pool is not None:  # the rule's width against the context, its shortlist against the vocabulary
        cli.flag_value("--pool", parse_rule, args.pool, cfg.max_context, cfg.vocab_size)
    text = None
    if args.prompt is not None:
        text, note = read_prompt(args.prompt, cfg.max_context)
        if note:
            cli.warn(note)
    tok = Tokenizer(folder, cfg)
    adapter = check_adapter(args, cfg, folder)
    eviction, scorer = method(args, adapter)  # make_scorer checks its config
    dtype = getattr(torch, args.dtype) if args.dtype else default_dtype(args.device)
    cli.check_fits_memory(cfg, dtype, args.device, f"the model in {folder} needs a machine (or device) with "
                          "more free memory, or a smaller --dtype")
    ids = None if args.turns is not None else prompt_ids(args, tok, text, cfg.max_context)
    return Checked(folder, cfg, text, tok, adapter, eviction, scorer, ids)


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
        cli.flag_value("--pool", parse_rule, args.pool)
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
        make_scorer(EvictConfig(args.method, args.budget, window=args.window),  # no rule: refused above
                    response=torch.zeros(1, 1, dtype=torch.long))
    cli.check_generate_flags(args)  # --show with --json, --show/--no-chat in a chat: refused, not dropped
    cli.check_device(args.device)
    cli.check_model_dir(args.model)


def check_fits_model(args, cfg):
    """The flags against what the model can use (config.json, read before the weights): a length past its
    context is one no prompt or answer can reach, so it would do nothing (--pool's width, which would run without
    end, is held to it by check()). --max-new-tokens is held to the context with the prompt's tokens
    (prompt_ids) or a chat's first turns
    (extensions/chat.py)."""
    ctx = cfg.max_context
    cli.check_window_fits("--window", args.window, cfg)  # names a sliding_window that shortened the context
    cli.check_window_read(args)  # a --window the method keeps none of (the default lookahead): refused (issue 76)
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


def check_adapter(args, cfg, folder):
    """--method lookahead's adapter (--adapter, or the one shipped for the model) as the loader reads it,
    with what --layer-budgets asks of its .json (generate.py builds the budgets); None for others."""
    if args.method != "lookahead":
        return None
    path = args.adapter or cli.default_adapter_path(cfg)
    if args.adapter is None and not path.is_file():
        raise FileNotFoundError(f"no lookahead adapter for {cfg.name} ({path}): "
                                f"train one with python train.py --model {folder}, or pass --adapter")
    module = load_adapter(path, cfg)
    if args.layer_budgets:
        if module.info.get("layer_weights") is None:  # refused rather than C in every layer unannounced
            raise ValueError(f"--layer-budgets: the adapter {path} has no layer_weights in its .json; drop the "
                             "flag, or measure them (python -m research.train_lab --stage budgets)")
    return module
