"""Where LookaheadKV's cost goes, part by part (its tables: research/LOG.md 11; RESULTS.md section 5 reads the
whole prefill against its floor, bench.py's full+M row, timed in the same rounds).

bench.py times the whole against FullKV's, and on a shared CPU its rounds scatter by a few % of a 10 s
prefill: more than the method costs. This script times each piece the one-pass form adds on its own,
on the real model, the fastest of several calls (a piece's work is fixed; noise only adds time):

- the M rows' attention, per layer: their scores and their output from the same softmax (LookaheadHook);
- their LoRA on all the adapter's projections;
- the linear layers' work for M more rows, as M / S of the prompt's (the same matmuls, M more rows);
- the scoring and the eviction after the prefill: the paper's form (scores max-pooled, width 7, then the
  top C, C in every layer), our unpooled variant, and as shipped (its .json's rule, the span rule's gate,
  and its per-layer budgets).

The norms, RoPE and SiLU of the M rows are left out (M / S of a few % of the prefill). The sum is a
floor for what bench.py's overhead rows measure, with no noise in it; on this CPU the whole is above it, as
FullKV on 32 more tokens (full+M) is above its share of the arithmetic (RESULTS.md section 5).

    python research/analysis/overhead_parts.py --lengths 2048,4096
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from research import bench  # noqa: E402
from support import cli  # noqa: E402
from eviction import EvictConfig, Pool, prefill_and_score, uniform_budgets  # noqa: E402
from lookaheadkv import LookaheadHook  # noqa: E402
from methods import adapter_selection, load_adapter, make_scorer  # noqa: E402


def fastest(fn, calls):
    """The fastest of `calls` calls of fn, in ms, after one warm-up call."""
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


@torch.inference_mode()
def parts(model, tok, module, S, calls):
    cfg, M, L = model.config, module.n_tokens, model.config.num_hidden_layers
    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, S + M, H, D, generator=g).transpose(1, 2)  # as the model hands them to a hook
    k = torch.randn(1, S + M, Hkv, D, generator=g).transpose(1, 2)
    v = torch.randn(1, S + M, Hkv, D, generator=g).transpose(1, 2)
    hook = LookaheadHook(module, S)
    out = {"the M rows' attention (scores + output)": L * fastest(lambda: (hook.attn(0, q, k, None),
                                                                          hook.attn_output(0, v)), calls)}
    layer = model.model.layers[0]
    x, xi = torch.randn(1, S, cfg.hidden_size, generator=g), torch.randn(1, S, cfg.intermediate_size, generator=g)
    inputs = {n: (layer.self_attn, x) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    inputs.update(gate_proj=(layer.mlp, x), up_proj=(layer.mlp, x), down_proj=(layer.mlp, xi))  # name -> (owner, input)
    linear = L * fastest(lambda: [getattr(owner, n)(inp) for n, (owner, inp) in inputs.items()], calls)
    out[f"linear layers: M / S of the prompt's {linear:.0f} ms"] = linear * M / S
    out["LoRA on the M rows"] = L * fastest(lambda: [module.delta(0, n, inp[:, -M:]) for n, (_, inp) in inputs.items()],
                                            calls)
    ids = bench.text_ids(model, tok, S)
    full = fastest(lambda: prefill_and_score(model, ids, make_scorer(EvictConfig("full"))), 3)
    recommended = dict(zip(("rule", "budgets"), adapter_selection(module)))  # beyond the paper: the .json's
    forms = (("the paper's form", dict(rule=Pool("max", 7), budgets=uniform_budgets)),
             ("unpooled", dict(rule=Pool("none"), budgets=uniform_budgets)), ("as shipped", recommended))
    for name, over in forms:
        scorer = make_scorer(EvictConfig("lookahead", 128, **over), module)
        run = prefill_and_score(model, ids, scorer)
        out[f"score + evict, {name} ({scorer.rule})"] = fastest(lambda: scorer.evict(scorer.score(model, run), run), calls)
    return full, out


def main(argv=None):
    return cli.run(lambda: measure(argv))


def measure(argv):
    p = cli.Parser("research/analysis/overhead_parts.py", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="2048", help="prompt lengths, comma-separated (default 2048)")
    p.add_argument("--calls", type=int, default=9, help="calls per piece; the fastest counts (default 9)")
    p.add_argument("--model", default=None, help="HF folder (default: the prepared SmolLM2)")
    p.add_argument("--adapter", default=None, help="adapter (default: the one shipped for the model)")
    args = p.parse_args(argv)
    lengths = cli.counts(args.lengths, "--lengths")  # every flag checked before the model loads
    cli.check_fit_context("--lengths", lengths, args.model)
    cli.at_least("--calls", args.calls, 1)
    cli.check_model_dir(args.model)
    if args.adapter is not None:
        cli.input_file("--adapter", args.adapter)
    torch.set_num_threads(1)
    model, tok, _ = cli.load(args.model)
    module = load_adapter(args.adapter or cli.default_adapter_path(model.config), model.config)
    for S in lengths:
        full, out = parts(model, tok, module, S, args.calls)
        print(f"\nS = {S}, C = 128, one thread: FullKV's prefill {full:.0f} ms (the fastest of 3)")
        for what, ms in out.items():
            print(f"  {what:58s} {ms:7.1f} ms  {100 * ms / full:5.2f}%")
        common = sum(ms for what, ms in out.items() if not what.startswith("score"))
        for what, ms in out.items():
            if what.startswith("score"):
                form = what.split(", ", 1)[1]
                print(f"  sum, {form:53s} {common + ms:7.1f} ms  {100 * (common + ms) / full:5.2f}%")

if __name__ == "__main__":
    main()
