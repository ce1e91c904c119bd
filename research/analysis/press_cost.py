"""
What LookaheadKVPress adds to kvpress's pipeline, against no press and SnapKVPress in the same rounds (issue 79):
pipeline("kv-press-text-generation") on a prompt of S tokens (examples/needle.txt tiled, its question inside the
compressed text), prefill + compression + one answer token, C = 128 slots per (layer, KV head) for both presses.
One thread, process CPU time (time.process_time: what other jobs on the machine do not add to), the three runs of a
round in rotated order, a warm-up round dropped, the median of --rounds rounds. Run it alone on the machine.

    python research/analysis/press_cost.py --lengths 1024,2048,4096 --rounds 5

Prints per S the median seconds of each and what each press adds to no press's time (%: the median over rounds of
the press's time less no press's in the same round, against no press's median; freed memory kept for reuse as in
research/bench.py), e.g.
    S 2048  none 1.234 s  snapkv +1.0%  lookahead +2.3%

--flops counts instead what each press adds in floating-point operations (torch's FlopCounterMode: the matmuls
and attention of one pipeline call, the same count on any machine), the arithmetic the timing is to be read against
where a machine's rounds spread wider than the press's share (~1 min):

    python research/analysis/press_cost.py --lengths 2048,4096 --flops

--needle instead answers examples/needle.txt at C = --budget in both protocols (inside: the question in the
compressed text, the paper's; after: kvpress's question=), with no press, LookaheadKVPress, AdaKVPress on it and
SnapKVPress (~2 min):

    python research/analysis/press_cost.py --needle
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from research.bench import keep_freed_memory  # noqa: E402
from support import cli  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def prompt_of(tok, n):
    """examples/needle.txt tiled to about n tokens of the pipeline's context (its template adds a few)."""
    text = (ROOT / "examples" / "needle.txt").read_text()
    ids = tok.encode(text, add_special_tokens=False)
    ids = (ids * (n // len(ids) + 1))[-n:]  # the end kept: the question stays last
    return tok.decode(ids)


def make_press(name, S, C, adapter):
    import kvpress

    from extensions.lookaheadkv_press import LookaheadKVPress

    if name == "none":
        return None
    if name == "snapkv":
        return kvpress.SnapKVPress(compression_ratio=max(0.0, 1 - (C + 0.5) / S))  # keeps int(S (1 - r)) = C
    return LookaheadKVPress.from_pretrained(adapter, budget=C)


def needle(pipe, args):
    """examples/needle.txt's answer per protocol and press, C = args.budget slots per (layer, KV head)."""
    import kvpress

    from extensions.lookaheadkv_press import LookaheadKVPress

    text = (ROOT / "examples" / "needle.txt").read_text()
    context, _, question = text.rpartition("\n\n")
    for protocol, call in (("inside", dict(inputs=text)), ("after", dict(inputs=context, question=question))):
        S = pipe.preprocess(call["inputs"], [""], "", 10**9)["context_ids"].shape[1]
        r = max(0.0, 1 - (args.budget + 0.5) / S)
        adakv = kvpress.AdaKVPress(LookaheadKVPress.from_pretrained(args.adapter, compression_ratio=r))
        for name, press in (("none", None), ("lookahead", make_press("lookahead", S, args.budget, args.adapter)),
                            ("adakv-lookahead", adakv), ("snapkv", make_press("snapkv", S, args.budget, None))):
            with torch.no_grad():
                answer = pipe(**call, press=press, max_new_tokens=20)["answer"]
            print(f"{protocol} S={S} {name}: {answer.strip()!r}", flush=True)


def flops_of(pipe, text, press):
    """Floating-point operations of one pipeline call (prefill, compression, one answer token) as torch counts them:
    matmuls and SDPA, the work that scales with the prompt (elementwise ops are not counted)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        pipe(text, press=press, max_new_tokens=1)
    return counter.get_total_flops()


def main(argv=None):
    p = cli.Parser("research/analysis/press_cost.py", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1024,2048,4096", help="prompt lengths S in tokens")
    p.add_argument("--rounds", type=int, default=5, help="rounds after the warm-up one; the median is reported")
    p.add_argument("--budget", type=int, default=128, help="C: KV slots kept per (layer, KV head)")
    p.add_argument("--model", type=Path, default=ROOT / "weights" / "SmolLM2-135M-Instruct")
    p.add_argument("--adapter", type=Path, default=ROOT / "weights" / "SmolLM2-135M-Instruct.lookahead-peft")
    p.add_argument("--needle", action="store_true", help="answer the needle prompt in both protocols instead")
    p.add_argument("--flops", action="store_true", help="count each press's added floating-point operations instead")

    def work():
        args = p.parse_args(argv)
        lengths = cli.counts(args.lengths, "--lengths")
        cli.at_least("--rounds", args.rounds, 1)
        cli.check_model_dir(args.model)
        import kvpress  # noqa: F401 (registers the pipeline)
        import transformers

        torch.set_num_threads(1)
        keep_freed_memory()  # as research.bench: no call pays again the page faults an earlier one paid
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa")
        model = model.float().eval()
        tok = transformers.AutoTokenizer.from_pretrained(args.model)
        pipe = transformers.pipeline("kv-press-text-generation", model=model, tokenizer=tok, device="cpu")
        if args.needle:
            return needle(pipe, args)
        names = ["none", "snapkv", "lookahead"]
        for n in lengths:
            text = prompt_of(tok, n)
            S = pipe.preprocess(text, [""], "", 10**9)["context_ids"].shape[1]
            if args.flops:
                flops = {name: flops_of(pipe, text, make_press(name, S, args.budget, args.adapter)) for name in names}
                print(f"S {S}  none {flops['none'] / 1e9:.1f} GFLOP  " + "  ".join(
                    f"{name} {100 * (flops[name] / flops['none'] - 1):+.2f}%" for name in names[1:]), flush=True)
                continue
            seconds = {name: [] for name in names}
            for r in range(args.rounds + 1):
                for name in names[r % 3:] + names[:r % 3]:  # rotated: no press always first or last
                    press = make_press(name, S, args.budget, args.adapter)
                    start = time.process_time()
                    with torch.no_grad():
                        pipe(text, press=press, max_new_tokens=1)
                    if r:  # round 0 warms up
                        seconds[name].append(time.process_time() - start)
            med = {name: statistics.median(v) for name, v in seconds.items()}
            # what a press adds: the median over rounds of (press - none) timed in the same round (drift cancels, as
            # research.bench's overhead rows), as a share of no press's median
            added = "  ".join(
                f"{name} {100 * statistics.median(a - b for a, b in zip(seconds[name], seconds['none'])) / med['none']:+.1f}%"
                for name in names[1:])
            print(f"S {S}  none {med['none']:.3f} s  {added}  (median of {args.rounds}: "
                  + ", ".join(f"{k} {v:.3f} s" for k, v in med.items()) + ")", flush=True)

    return cli.run(work)


if __name__ == "__main__":
    main()
