"""
Every check of generate.py's flags and files, in the order they are read, all before the weights load:

    folder, cfg, tok, ids, blank, module = checked_inputs(args, build, DECODE_METHODS, load_adapter)

each flag alone first (a bad value stops in a second, before a default model is prepared), then the model's
config.json against them, the prompt file, the tokenizer, the adapter, the method as it will run, and the
prompt's tokens against the context. A bad one raises ValueError or OSError, which cli.run turns into one
`error:` line. generate.py calls it once; a chat's turns are checked where they are read (extensions/chat.py).

The method's own checks (budget, window, selection rule) are its constructors': methods.make_scorer and
extensions/decode.py's DecodeEviction, which generate.py's build() calls, here twice: with stand-ins for the
files before any is read, then with the model's config and the adapter. They sit above support/, so generate.py
hands them in (build, DECODE_METHODS, load_adapter) and this file imports none of them.
"""
import sys

import torch

from model import ModelConfig
from support import cli
from support.tokenizer import Tokenizer


def checked_inputs(args, build, decode_methods, load_adapter):
    """(model folder, its ModelConfig, Tokenizer, the prompt's ids (None in a chat), whether the prompt was blank,
    the adapter or None), every flag and file checked. build(args, cfg, module, response) -> (Scorer,
    DecodeEviction or None): generate.py's; decode_methods: the methods with a decode-phase form;
    load_adapter: methods.load_adapter."""
    check_flags(args, build, decode_methods)
    folder = cli.resolve_model(args.model)
    cfg = ModelConfig.from_hf_config(folder)
    check_fits_model(args, cfg)
    text, note = read_prompt(args.prompt, cfg.max_context) if args.prompt is not None else (None, None)
    if note:
        cli.warn(note)
    tok = Tokenizer(folder, cfg)
    module = adapter(args, cfg, folder, load_adapter)
    # the method as it will run, the oracle's answer aside: --pool's width within the context and its shortlist
    # within the vocabulary (a width of 10**11 once ran without end), the adapter's own rule and budgets
    build(args, cfg, *stand_ins(args, module))
    ids = prompt_ids(args, tok, text, cfg.max_context) if text is not None else None
    return folder, cfg, tok, ids, text is not None and not text.strip(), module


# -----------------------------------------------------------------------------
# Every flag before any file is read


class Unloaded:
    """Stands in for the adapter in the checks that need none of its tensors (budget, window, rule)."""

    info = {}


def stand_ins(args, module=None):
    """(module, response) for a build that only checks: the adapter, or for lookahead a stand-in without
    tensors; for the oracle, a one-token answer in place of FullKV's (it comes once the model is loaded)."""
    if module is None and args.method == "lookahead":
        module = Unloaded()
    return module, (torch.zeros(1, 1, dtype=torch.long) if args.method == "oracle" else None)


def check_flags(args, build, decode_methods):
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
    if args.decode_budget is not None and args.method not in decode_methods:
        raise ValueError(f"--decode-budget re-scores the cache while decoding, by a method's decode-phase form: "
                         f"use --method {', '.join(decode_methods)}")
    if args.turns is not None and args.method not in (*decode_methods, "full"):
        raise ValueError(f"a chat re-scores the whole cache at each turn, by a method's decode-phase form: "
                         f"use --method {', '.join(decode_methods)} or full")
    if args.decode_budget is not None and args.decode_budget < args.budget:
        raise ValueError(f"--decode-budget {args.decode_budget} is below --budget {args.budget}: the prompt's "
                         f"cache would not fit it; use --decode-budget >= --budget")
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
    build(args, None, *stand_ins(args))  # the library's checks of budget, window and rule (make_scorer raises)
    cli.check_device(args.device)
    cli.check_model_dir(args.model)


def check_fits_model(args, cfg):
    """The flags against what the model can use (config.json, read before the weights): a length past its
    context is one no prompt or answer can reach, so it would do nothing (--pool's width, which would run without
    end, is held to it by build(args, cfg, ...) in checked_inputs). --max-new-tokens is held to the context with the prompt's tokens (prompt_ids) or a chat's first turns
    (extensions/chat.py)."""
    ctx = cfg.max_context
    if args.window > ctx:
        raise ValueError(f"--window {args.window} is longer than the model's context of {ctx} tokens: no prompt "
                         f"has that many; use a --window of at most {ctx}")
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
