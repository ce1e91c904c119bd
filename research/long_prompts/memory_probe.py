"""
Issue 78: does prefill-vs-hf's memory call read the same twice? Each side's prefill measured in N fresh processes
(research.bench.child_memory: load, one call unmeasured, one measured), printed one line a process:

    python research/long_prompts/memory_probe.py --length 4096 --processes 3                 # the held threshold
    python research/long_prompts/memory_probe.py --length 4096 --processes 3 --glibc-defaults
    PYTHONHASHSEED=0 setarch "$(uname -m)" -R python research/long_prompts/memory_probe.py --length 4096 \
        --processes 3 --glibc-defaults                                                        # ASLR off

--glibc-defaults leaves glibc's mmap threshold to rise as large blocks are freed (a user's process); without it
every allocation of 128 KiB or more is a mapping of its own (what bench measures). Memory, not time: it may share
the machine.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from research import bench  # noqa: E402
from support import cli  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--length", type=int, default=4096, help="prompt tokens (random ids, bench's seed)")
    p.add_argument("--processes", type=int, default=3, help="fresh processes per side")
    p.add_argument("--sides", default="ours,transformers", help="ours, transformers or both")
    p.add_argument("--glibc-defaults", action="store_true", help="leave glibc's mmap threshold to rise")
    p.add_argument("--model", default=None, help="an HF Llama/Qwen folder (default: weights/SmolLM2-135M-Instruct)")
    args = p.parse_args()
    sides = args.sides.split(",")
    if not set(sides) <= {"ours", "transformers"} or args.length < 1 or args.processes < 1:
        p.error("--sides: ours and/or transformers; --length and --processes: at least 1")
    folder = cli.resolve_model(args.model)
    ids = torch.randint(0, bench.ModelConfig.from_hf_config(folder).vocab_size, (1, args.length),
                        generator=torch.Generator().manual_seed(bench.SEED))  # bench's random_ids
    full = bench.row_scorer("full", bench.get_args(["--mode", "prefill-vs-hf"]))
    allocator = "glibc's defaults" if args.glibc_defaults else "each allocation of 128 KiB or more its own mapping"
    print(f"S {args.length}, one thread, {allocator}: peak GiB, added GiB per fresh process")
    for side in sides:
        for i in range(args.processes):
            peak, added = bench.child_memory(bench.prefill_side, side, folder, ids, full, 1,
                                             held=not args.glibc_defaults)
            print(f"{side:13s} process {i + 1}: peak {peak:.3f}  added {added:.3f}", flush=True)


if __name__ == "__main__":  # child_memory spawns: its children import this file again
    main()
