"""
Generate with a compressed KV cache, as the paper does: load -> prefill -> score -> evict -> decode.

    python generate.py --prompt examples/needle.txt --budget 128

finds a number hidden in a speech of 878 tokens, keeping 128 KV slots per (layer, KV head) with
LookaheadKV in the paper's form (the shipped adapter's M = 32 rows, max-pool 7, C in every layer),
and streams the answer, then the stats: "prefill" (the M rows ride in it), "eviction" (all the
method adds after it: scores, pooling, top C, gather), "ttft" (the prefill's start to the first
token).

    python generate.py --prompt examples/needle.txt --method snapkv --show   # the kept tokens, lit
    echo "What is 2+2?" | python generate.py --prompt - --method full --json  # one JSON object

Beyond the paper, only when their flags ask: --pool span:8:1024, --layer-budgets, --decode-budget,
--turns (a chat). --model takes any HF Llama, Mistral, Qwen2 or Qwen3 folder. Every flag and file is
checked before the weights load (support/generate_checks.py): a bad one is one `error:` line.
"""
import argparse
import time
import torch

from baselines import full_answer
from eviction import EvictConfig, Stopwatch, compress, decode, uniform_budgets
from lookaheadkv import LookaheadKV, lookahead_compress
from methods import METHODS, extension, layer_budgets, load_adapter, make_scorer, selection_of
from model import load_model
from support.cli import Parser, print_stats, run
from support.generate_checks import check


def get_args(argv=None):
    p = Parser("generate.py", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--prompt", help="a text file with the user message, or - for stdin")
    a("--model", help="an HF folder (default: weights/SmolLM2-135M-Instruct, prepared if missing)")
    a("--method", default="lookahead", choices=METHODS, help="how to choose the kept tokens")
    a("--budget", type=int, default=128, help="C: KV slots kept per (layer, KV head)")
    a("--adapter", help="lookahead adapter .safetensors (default: the one shipped for the model)")
    a("--window", type=int, default=32, help="snapkv/pyramidkv/h2o/laq: last prompt tokens always "
      "kept; with --decode-budget or in a chat, every method's at each later eviction")
    a("--pool", metavar="RULE", help="selection rule: none | avg:K | max:K | span:K | span:K:N "
      "(default: the method's own: lookahead max:7, snapkv avg:5); span is beyond the paper")
    a("--layer-budgets", action="store_true", help="beyond the paper: the adapter's per-layer "
      "budgets (its .json's layer_weights, mean C) instead of C in every layer")
    a("--uniform-budgets", action="store_true", help="C in every layer (pyramidkv: no pyramid)")
    a("--two-pass", action="store_true", help="lookahead: score in a second forward (the "
      "reference form) instead of in the prefill")
    a("--max-new-tokens", type=int, default=256)
    a("--decode-budget", type=int, help="beyond the paper: hold the cache to this many slots "
      "while decoding too")
    a("--every", type=int, default=32, help="with --decode-budget: evict once the cache holds "
      "decode-budget + every slots")
    a("--turns", help="beyond the paper: a chat, a JSON list of user turns, or - for stdin, one "
      "line a turn (/reset starts over)")
    a("--chat", action=argparse.BooleanOptionalAction,
      help="wrap the prompt in the chat template (default: when the tokenizer has one)")
    a("--temperature", type=float, default=0.0, help="0 = greedy")
    a("--top-p", type=float, default=1.0)
    a("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a("--dtype", choices=["float32", "bfloat16", "float16"],
      help="default: float32 on CPU, bfloat16 on CUDA")
    a("--seed", type=int, default=0)
    a("--show", action="store_true", help="print the prompt, the kept tokens lit")
    a("--json", action="store_true", help="print one JSON object instead of streaming text")
    return p.parse_args(argv)


def sampler(args):
    """decode()'s pick for --temperature/--top-p, seeded by --seed: None (greedy) at temperature 0,
    else a draw from the softmax at that temperature, cut to the nucleus of mass top_p."""
    if args.temperature <= 0:
        return None
    generator = torch.Generator(device=args.device).manual_seed(args.seed)

    def pick(logits):  # (B, V) -> (B,)
        probs = (logits.float() / args.temperature).softmax(-1)
        if args.top_p < 1.0:  # nucleus: the smallest set of tokens whose mass reaches top_p
            p, i = probs.sort(-1, descending=True)
            p[(p.cumsum(-1) - p) > args.top_p] = 0
            probs = torch.zeros_like(probs).scatter(-1, i, p)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]
    return pick


@torch.no_grad()
def generate(model, tok, ids, scorer, args, pick=None, evictor=None):
    """Prefill -> score -> evict, then decode on the compact cache, printing the answer as it comes
    (pick: the sampler, None: greedy; evictor: --decode-budget's, beyond the paper). Returns the
    answer's ids, the text printed, the last token, the cache, the kept slots, (slots per layer,
    bytes) after the eviction, and the timings in ms."""
    ids = torch.tensor([ids], device=args.device)  # (1, S)
    t0, clock = time.perf_counter(), Stopwatch(args.device)
    clock.mark()
    # LookaheadKV: the paper's inference on one screen (lookaheadkv.lookahead_compress): append the
    # M rows, prefill with their LoRA, score, max-pool, top C, drop the rows' K/V, gather. Any other
    # method (or one wrapped by a rule beyond the paper): the same steps for any Scorer (compress)
    steps = lookahead_compress if type(scorer) is LookaheadKV else compress
    cache, logits, pos, kept = steps(model, ids, scorer, clock=clock)
    if not torch.isfinite(logits).all():  # a bad tensor in the checkpoint: said, not an empty text
        folder = args.model or f"weights/{model.config.name}"
        raise ValueError(f"the model in {folder} gives NaN or inf logits: a weight holds NaN or "
                         f"inf; delete the folder {folder} and download the checkpoint again")
    kv_kept = [int(k.shape[2]) for k in cache.k], cache.nbytes()  # per-layer budgets vary them
    # 4. decode: positions go on from S whatever the cache holds; --decode-budget evicts as it grows
    watch = {} if evictor is None else dict(hook=evictor.hook, after_step=evictor.after_step)
    answer, printed, last, t_first = [], "", None, None
    for token in decode(model, cache, logits, pos, args.max_new_tokens, tok.stop_ids, pick,
                        **watch):
        t_first, last = t_first or time.perf_counter(), token.item()
        if last in tok.stop_ids:
            break
        answer.append(last)
        text = tok.decode(answer)
        if not args.json and not text.endswith("\ufffd"):  # wait for a character's last byte
            print(text[len(printed):], end="", flush=True)
            printed = text
    t_end = time.perf_counter()
    n = max(len(answer) - 1, 0)  # tokens decoded after the first
    timing = dict(prefill_ms=round(clock.ms(0, 1), 1), evict_ms=round(clock.ms(1, 2), 1),
                  ttft_ms=round((t_first - t0) * 1e3, 1),
                  decode_tokens_per_s=round(n / (t_end - t_first), 2) if n else None)
    return answer, printed, last, cache, kept, kv_kept, timing


def method(args, module):
    """The method the flags name, made before the weights load (check() calls it, so that a config
    make_scorer refuses is one error line): its EvictConfig and its Scorer, e.g. LookaheadKV, max-pool
    7, C = --budget in every layer. What the flags leave unset is the method's own, its paper's
    (whatever the adapter's .json recommends). The oracle's Scorer waits for FullKV's answer: None."""
    budgets = uniform_budgets if args.uniform_budgets else None
    if args.layer_budgets:  # beyond the paper: extensions/layer_budgets.py, asked for by its flag
        budgets = layer_budgets(module.info["layer_weights"])
    options = {k: v for k, v in dict(one_pass=not args.two_pass, seed=args.seed).items()
               if k in METHODS[args.method].default_options}  # the flags that set its options
    eviction = EvictConfig(args.method, args.budget, window=args.window, rule=args.pool,
                           options=options, budgets=budgets)  # rule: text, e.g. "max:7"
    # a chat (--turns) makes a Scorer per conversation: this one checks the config it will use
    return eviction, None if args.method == "oracle" else make_scorer(eviction, module)


def main(argv=None):
    """generate.py as a command: any bad flag or file is one `error:` line and exit 1."""
    return run(lambda: answer(get_args(argv)))


def answer(args):
    """Check, build the method, load, compress the prompt, decode it, report: the stats."""
    if args.turns is not None or args.decode_budget is not None:  # beyond the paper: its own checks
        extension("decode", "--decode-budget").check_flags(args, METHODS)
    checked = check(args, method)  # every flag and file: raises, or what it read and made (Checked)
    tok, module, ids = checked.tok, checked.adapter, checked.ids  # module: the paper's P and LoRA
    eviction, scorer = checked.eviction, checked.scorer  # the method, made once by method()
    turns = (None if args.turns is None  # a chat's turns: a list, or stdin's lines, the first one read
             else extension("chat", "--turns").turns_of(args, tok, checked.config.max_context))
    torch.manual_seed(args.seed)
    pick = sampler(args)  # greedy (None) unless --temperature

    # the model; the adapter joins it on its device, in its dtype
    model = load_model(checked.folder, args.device, args.dtype and getattr(torch, args.dtype))
    if module is not None:
        module.to(args.device, model.lm_head.weight.dtype)
    if turns is not None:  # beyond the paper: a chat, evicted to --budget at every turn
        chat = extension("chat", "--turns").chat
        return chat(args, model, tok, checked.folder, turns, eviction, module, pick)
    evictor = None
    if args.decode_budget is not None:  # beyond the paper: the cache held while decoding
        held = make_scorer(EvictConfig(**{**vars(eviction), "budget": args.decode_budget}), module)
        DecodeEviction = extension("decode", "--decode-budget").DecodeEviction
        evictor = DecodeEviction(held, args.every, args.window)

    response = None
    if args.method == "oracle":  # needs FullKV's answer first: its time counts as its eviction
        t = time.perf_counter()
        _, response = full_answer(model, torch.tensor([ids], device=args.device),
                                  args.max_new_tokens, tok.stop_ids)
        oracle_ms = (time.perf_counter() - t) * 1e3
        response = torch.tensor(response, device=args.device)
        scorer = make_scorer(eviction, module, response)

    answer_ids, printed, last, cache, kept, (per_layer, kv_bytes), timing = generate(
        model, tok, ids, scorer, args, pick, evictor)
    if response is not None:
        timing["evict_ms"], timing["ttft_ms"] = (round(timing[k] + oracle_ms, 1)
                                                 for k in ("evict_ms", "ttft_ms"))

    # the stats: what ran (the rule and budgets by name), what it cost, what the cache holds
    cfg, (rule, budgets) = model.config, selection_of(scorer)
    stats = dict(method=args.method, rule=rule, budgets=budgets, budget=args.budget,
                 prompt_tokens=len(ids), kept_tokens=round(sum(per_layer) / len(per_layer)),
                 kept_range=[min(per_layer), max(per_layer)], text=tok.decode(answer_ids), **timing,
                 kv_bytes_full=2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
                 * len(ids) * model.lm_head.weight.element_size(), kv_bytes_kept=kv_bytes)
    info = module.info if module is not None else {}  # beyond the paper: said, not applied
    recommends = " ".join(([f"--pool {info['rule']}"] if info.get("rule") else [])
                          + (["--layer-budgets"] if info.get("layer_weights") else []))
    if recommends and (rule, budgets) != (info.get("rule", rule), "per-layer budgets"):
        stats["recommends"] = recommends
    if evictor is not None:  # the cache only grows between evictions: its peak is where one began
        stats.update(decode_budget=args.decode_budget, every=args.every,
                     decode_evictions=len(evictor.log), kv_bytes_end=cache.nbytes(),
                     peak_slots=max([max(per_layer), len(cache)] + [b for _, b, _ in evictor.log]))
    print_stats(args, stats, tok, printed, last, blank=not checked.text.strip(), ids=ids, kept=kept)
    return stats


if __name__ == "__main__":
    main()
