"""
Generate with a compressed KV cache, as the paper does: load -> prefill -> score -> evict -> decode.

    python generate.py --prompt examples/needle.txt --budget 128

finds a number hidden in a speech of 878 tokens, keeping 128 KV slots per (layer, KV head) with LookaheadKV in
the paper's form (its shipped adapter's M = 32 rows, max-pool 7, C in every layer). It streams the answer, then
the stats block:

    The special magic number for the blue lighthouse is 7381924.
    ---
    method lookahead (max:7, C in every layer)  budget 128  prompt 878 tokens  kept 128 per (layer, KV head)
    prefill 1699 ms  eviction 8 ms (score + select + gather)  ttft 1707 ms
    decode 14.7 tok/s  KV cache 40.5 MB -> 5.9 MB
    the adapter recommends --pool span:8:1024 --layer-budgets (beyond the paper; not applied)

"prefill" is the prompt's forward pass (LookaheadKV's M rows ride in it); "eviction" is all the method adds after
it: its scores, the pooling, the top C and the gather; ttft runs from the prefill's start to the first token.

    python generate.py --prompt examples/needle.txt --method snapkv --show   # the kept tokens, lit
    echo "What is 2+2?" | python generate.py --prompt - --method full --json  # one JSON object

Beyond the paper, each only when its flag asks: --pool span:8:1024 (the span rule), --layer-budgets, --decode-budget
(the cache held while decoding), --turns (a chat). --model takes any HF Llama/Mistral/Qwen2/Qwen3 folder. Every
flag and file is checked before the weights load (support/generate_checks.py): a bad one is one `error:` line.
"""
import time

import torch

from baselines import full_answer
from eviction import compress, decode
from methods import make_scorer, selection_of
from support import cli
from support.cli import check_logits, report, sampler, stream, warn, why_empty
from support.generate_checks import checked_inputs, get_args
from support.metrics import Stopwatch, answer_stats


def main(argv=None):
    return cli.run(lambda: cli.quiet_pipe(lambda: work(get_args(argv, __doc__))))


def work(args):
    """Check every flag and file, load the weights, then answer the prompt (or run the chat of --turns)."""
    run = checked_inputs(args)  # the model's folder, tokenizer, prompt ids, adapter and the method's Scorer
    torch.manual_seed(args.seed)
    model, _, _ = cli.load(run.folder, args.device, args.dtype, tokenizer=False)
    if run.module is not None:
        run.module.to(args.device, model.lm_head.weight.dtype)
    if run.chat is not None:  # beyond the paper: --turns (extensions/chat.py)
        return run.chat(args, model, run)
    return answer(args, model, run)


@torch.no_grad()
def answer(args, model, run):
    """Compress the prompt's cache, decode from it as the answer streams, then the stats block (or one JSON
    object); returns the stats."""
    ids = torch.tensor([run.ids], device=args.device)  # (1, S)
    scorer, oracle_ms = run.scorer, 0.0
    if scorer is None:  # the oracle: FullKV's greedy answer first, its time counted in the eviction
        t = time.perf_counter()
        full, response = full_answer(model, ids, args.max_new_tokens, run.tok.stop_ids)
        check_logits(full.logits, run.folder)
        scorer, oracle_ms = make_scorer(run.eviction, response=torch.tensor(response, device=args.device)), (
            time.perf_counter() - t) * 1e3
    t0, clock = time.perf_counter(), Stopwatch(args.device)
    clock.mark()
    # 1. prefill (the M lookahead rows ride in it) -> 2. score -> 3. evict: top C per (layer, KV head), one gather
    cache, logits, pos, kept_slots = compress(model, ids, scorer, clock=clock)  # marks: prefill, eviction
    check_logits(logits, run.folder)
    kept = [int(k.shape[2]) for k in cache.k], cache.nbytes()  # slots per layer (per-layer budgets vary them)
    # 4. decode on the compact cache: positions go on from S (--decode-budget's evictor: None by default)
    steps = decode(model, cache, logits, pos, args.max_new_tokens, run.tok.stop_ids, sampler(args),
                   **cli.watch(run.evictor))
    out, printed, _, last, t_first = stream(run.tok, steps, args.json)
    n_decoded, t_end = max(len(out) - 1, 0), time.perf_counter()
    timing = dict(prefill_ms=round(clock.ms(0, 1), 1), evict_ms=round(clock.ms(1, 2) + oracle_ms, 1),
                  ttft_ms=round((t_first - t0) * 1e3 + oracle_ms, 1),
                  decode_tokens_per_s=round(n_decoded / (t_end - t_first), 2) if n_decoded else None)
    # 5. the stats: what ran (the rule and budgets by name), what it cost, what the cache holds
    stats = answer_stats(args, model, selection_of(scorer), len(run.ids), kept, run.tok.decode(out), timing, cache,
                         run.evictor, run.module)
    if not stats["text"]:
        warn(why_empty(last, run.tok, run.blank))
    report(args, stats, printed, run.tok, run.ids, kept_slots)
    return stats


if __name__ == "__main__":
    main()
