"""
Where the default's prefill time goes against FullKV's, op by op (issue 68): torch.profiler over the same
prompt, FullKV's compress() and LookaheadKV's (the paper's form: the M rows inside the prefill, max-pool 7,
top C), the same number of rounds in turn, one thread. It prints each method's time per round (the wall clock
of the profiled rounds, and the profiler's self CPU time summed over ops), then the ops whose self CPU time
differs most between the two, in ms per prefill: the missing time is there, by name (aten::bmm for the M
rows' extra rows through the linear layers, aten::softmax for their attention, aten::cat / copy_ for the
appended rows and the cache truncation, ...).

    python research/analysis/prefill_profile.py --length 2048 --rounds 5
    python research/analysis/prefill_profile.py --length 2048 --rounds 5 --top 30 --json runs/profile-2k.json

Run it on a quiet machine (nothing else running): the profiler's own cost is in both columns, the same ops;
the difference is what the method adds. --adapter: the shipped one by default.
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from eviction import EvictConfig, compress  # noqa: E402
from methods import load_adapter, make_scorer  # noqa: E402
from model import ModelConfig, load_model  # noqa: E402
from support import cli, files  # noqa: E402
from support.tokenizer import Tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def get_args(argv=None):
    p = cli.Parser("research/analysis/prefill_profile.py", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="an HF folder (default: the prepared SmolLM2)")
    p.add_argument("--adapter", default=None, help="default: the model's shipped adapter")
    p.add_argument("--length", type=int, default=2048, help="prompt tokens S")
    p.add_argument("--budget", type=int, default=128, help="C")
    p.add_argument("--rounds", type=int, default=5, help="profiled rounds per method (after one warm-up)")
    p.add_argument("--top", type=int, default=20, help="ops listed")
    p.add_argument("--plain", type=int, default=0, help="also this many unprofiled rounds per method, in "
                   "turn: the paired differences of user and system CPU time (the profiler adds time per op)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, help="also write every op's times here (a new file)")
    return p.parse_args(argv)


def check(args):
    """Every flag and file before the model loads: (model folder, its config, adapter path)."""
    for flag, value, lo in (("--length", args.length, 64), ("--budget", args.budget, 1),
                            ("--rounds", args.rounds, 1), ("--top", args.top, 1), ("--plain", args.plain, 0)):
        cli.at_least(flag, value, lo)
    cli.check_threads("--threads", args.threads)
    cli.check_model_dir(args.model)
    folder = cli.resolve_model(args.model)
    cfg = ModelConfig.from_hf_config(folder)
    if args.length + 64 > cfg.max_context:  # the M lookahead rows ride after the prompt
        raise ValueError(f"--length {args.length}: with the lookahead rows it passes {cfg.name}'s context "
                         f"of {cfg.max_context}; use at most {cfg.max_context - 64}")
    if args.budget >= args.length:
        raise ValueError(f"--budget {args.budget}: at least --length ({args.length}) evicts nothing")
    adapter = Path(args.adapter) if args.adapter else cli.default_adapter_path(cfg)
    cli.input_file("--adapter", adapter)
    if args.json is not None:  # "" too: a slip, not "no file"
        cli.output_file("--json", args.json, ".json")
        if Path(args.json).exists():
            raise ValueError(f"--json {args.json} exists: pass a new file")
    return folder, adapter


def prompt_ids(folder, cfg, S):
    """S token ids of the demo prompt's text, repeated (the content does not change the prefill's cost)."""
    tok = Tokenizer(folder, cfg)
    ids = tok.encode((ROOT / "examples" / "needle.txt").read_text())
    return torch.tensor([(ids * (S // len(ids) + 1))[:S]])


@torch.inference_mode()
def profile_rounds(model, ids, scorers, rounds):
    """{name: (wall ms per round, {op: self CPU ms per round})}: each round profiles every method once, in
    turn, so a load that drifts over the run falls on both (one warm-up call each first)."""
    for s in scorers.values():
        compress(model, ids, s)
    walls, ops = {n: [] for n in scorers}, {n: {} for n in scorers}
    for _ in range(rounds):
        for name, s in scorers.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                compress(model, ids, s)
                walls[name].append((time.perf_counter() - t0) * 1e3)
            for e in prof.key_averages():
                ops[name][e.key] = ops[name].get(e.key, 0.0) + e.self_cpu_time_total / 1e3 / rounds
    return {n: (walls[n], ops[n]) for n in scorers}


@torch.inference_mode()
def plain_rounds(model, ids, scorers, rounds):
    """{name: {"user": [ms], "system": [ms]}} over `rounds` unprofiled compress() calls each, the order
    rotated every round; paired by round."""
    names, out = list(scorers), {n: {"user": [], "system": []} for n in scorers}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            t0 = os.times()
            compress(model, ids, scorers[n])
            t1 = os.times()
            out[n]["user"].append((t1.user - t0.user) * 1e3)
            out[n]["system"].append((t1.system - t0.system) * 1e3)
    return out


def main(argv=None):
    return cli.run(lambda: work(get_args(argv)))


def work(args):
    folder, adapter = check(args)
    torch.set_num_threads(args.threads)
    model = load_model(folder)
    module = load_adapter(adapter, model.config)
    ids = prompt_ids(folder, model.config, args.length)
    scorers = {"full": make_scorer(EvictConfig("full", args.budget)),
               "lookahead": make_scorer(EvictConfig("lookahead", args.budget), module)}
    runs = profile_rounds(model, ids, scorers, args.rounds)
    print(f"S = {args.length}, C = {args.budget}, {args.rounds} rounds, {args.threads} thread(s)")
    for name, (walls, ops) in runs.items():
        print(f"  {name:<10s} wall {statistics.median(walls):8.1f} ms (median; fastest "
              f"{min(walls):.1f})  profiler self CPU {sum(ops.values()):8.1f} ms")
    full, look = runs["full"][1], runs["lookahead"][1]
    diff = {op: look.get(op, 0.0) - full.get(op, 0.0) for op in set(full) | set(look)}
    print(f"ops by the time LookaheadKV adds (ms per prefill; total {sum(diff.values()):+.1f}):")
    for op, d in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:args.top]:
        print(f"  {d:+9.2f}  {op:<40s} full {full.get(op, 0.0):9.2f}  lookahead {look.get(op, 0.0):9.2f}")
    if args.plain:
        plain = plain_rounds(model, ids, scorers, args.plain)
        print(f"{args.plain} unprofiled rounds each, paired: LookaheadKV minus FullKV, median (ms per prefill)")
        for kind in ("user", "system"):
            d = [a - b for a, b in zip(plain["lookahead"][kind], plain["full"][kind])]
            base = statistics.median(plain["full"]["user"])
            print(f"  {kind:<6s} CPU {statistics.median(d):+8.1f} ms  ({100 * statistics.median(d) / base:+.2f}% "
                  f"of FullKV's user time {base:.0f} ms)")
    if args.json is not None:
        files.write_atomic(Path(args.json), json.dumps(dict(length=args.length, budget=args.budget, rounds=args.rounds,
                                                   threads=args.threads, full=full, lookahead=look,
                                                   walls={k: v[0] for k, v in runs.items()}), indent=1))


if __name__ == "__main__":
    main()
