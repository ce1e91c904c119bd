"""
The reading claim, measured (issue 64): run the two default commands under a profiler and print, per file,
the lines of the functions they execute: the reading path's files whole (`wc -l`), and beside the path what
a learner must open to follow what runs, with the checks that only raise listed apart.

    python research/analysis/reading_trace.py            # generate.py's default, then train.py (2 steps)
    python research/analysis/reading_trace.py --only generate

generate.py: `--prompt examples/needle.txt --budget 128` (the README's command; 16 new tokens). train.py: the
learner's recipe (research/configs/train-quick.json) on a small run, 8 training and 2 held-out prompts, two
optimiser steps of 4 samples, in a temporary folder. A function counts once with its whole `def` (a nested
one inside a counted one is not counted again). Beside the path, each executed function is one of:
- a check (it only raises): its name starts with "check" or is in CHECK_FUNCTIONS, or it is in
  support/generate_checks.py or weights/checks.py;
- what a learner may skip (issue 64's support/: file I/O, locks and hashing, the tokenizer and chat formats,
  the training text sources and prompt tasks, the flags' parser and the error wrapper, the stats block's
  formatting): SKIP_FILES, and SKIP_FUNCTIONS by name in the other files;
- the measurement the learner's run ends with (MEASURE_FUNCTIONS: the held-out answer KL), listed apart;
- what a learner must open: everything else (e.g. a function that builds a scorer or the batch).
Lines of code outside functions (a dataclass's fields, imports) are in the path's `wc -l` only.
"""
import argparse
import ast
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from support import cli  # noqa: E402
READING_PATH = ["model.py", "eviction.py", "lookaheadkv.py", "baselines.py", "methods.py", "train.py",
                "generate.py"]
CHECK_FILES = ("support/generate_checks.py", "weights/checks.py")
# they raise; rule_parts and number (support/selection.py) run in the default commands only to check the
# adapter .json's recommended rule as text (--pool would make them build one)
CHECK_FUNCTIONS = {"at_least", "positive", "fraction", "as_number", "flag_value", "counts", "rule_parts",
                   "number", "data_folder", "data_dtypes", "output_paths", "free_disk"}
# the learner's run ends with a measurement of what it bought (recipe.compare: held-out answer KL beside
# SnapKV's); it judges the method, it is not the method: listed apart, as the checks are
MEASURE_FUNCTIONS = {"compare", "answer_kls", "forced_logprobs", "answer_kl"}
SKIP_FILES = ("support/files.py", "support/lock.py", "support/tokenizer.py", "support/data.py",
              "weights/prepare.py", "research/analysis/reading_trace.py", "support/__init__.py")
SKIP_FUNCTIONS = {  # file -> function names: I/O, the flags' parser, the error wrapper, formatting
    "support/cli.py": {"run", "quiet_exit", "one_line", "__init__", "error", "input_file", "read_text",
                       "printable", "resolve_model", "claim_folder", "release_folders", "warn",
                       "output_folder", "output_file", "print_stats", "show_kept", "why_empty",
                       "free_memory_gib", "universal_newlines", "default_adapter_path",
                       "context_words"},
    "support/recipe.py": {"config", "read_config", "parser", "flag_of", "rows", "read_rows",
                          "append_rows", "sample_path", "save_sample", "read_sample", "missing_samples",
                          "check_disk", "resume", "save_checkpoint", "append_log", "save_adapter",
                          "warn_memory", "peak_memory_gib", "memory_warning", "schedule_of",
                          "resume_keys", "load_checkpoint", "resume_from", "resume_note", "claim",
                          "keep_previous", "backup_names", "keep_one", "describe_rows",
                          "adapter_metadata", "is_adapter", "__init__"},
    "support/metrics.py": {"keep_fraction"},
}


def def_spans(path):
    """{first line of each def: (last line, name)} of one file (the line a code object reports as its first:
    its first decorator's, if it has one)."""
    spans = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            spans[first] = (node.end_lineno, node.name)
    return spans


def trace(fn):
    """{file (relative to the repository): {first line of each def executed}} while fn() runs."""
    seen = defaultdict(set)

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith("<"):  # frozen modules, exec'd strings
                return
            try:
                rel = Path(code.co_filename).resolve().relative_to(ROOT)
            except ValueError:  # another library's code
                return
            seen[str(rel)].add(code.co_firstlineno)
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def line_counts(seen):
    """{file: (lines to read, lines a learner may skip, lines of checks)} of executed functions,
    outermost defs only."""
    out = {}
    for rel, firsts in seen.items():
        spans = def_spans(ROOT / rel)
        ran = sorted((a, *spans[a]) for a in firsts if a in spans)
        read = skip = checks = measure = 0
        names = []
        for i, (a, b, name) in enumerate(ran):
            if any(a0 < a and b <= b0 for a0, b0, _ in ran[:i]):  # inside a counted def
                continue
            n = b - a + 1
            if name.startswith("check") or name in CHECK_FUNCTIONS or rel in CHECK_FILES:
                checks += n
            elif rel in SKIP_FILES or name in SKIP_FUNCTIONS.get(rel, ()):
                skip += n
            elif name in MEASURE_FUNCTIONS:
                measure += n
            else:
                read += n
                names.append(name)
        out[rel] = (read, skip, checks, measure, names)
    return out


def run_generate():
    import generate
    generate.main(["--prompt", "examples/needle.txt", "--budget", "128", "--max-new-tokens", "16"])


def run_train():
    import train
    with tempfile.TemporaryDirectory() as tmp:
        train.main(["--config", "research/configs/train-quick.json", "--out", tmp, "--n-train", "8",
                    "--n-heldout", "2", "--epochs", "1", "--batch", "4", "--micro-batch", "4"])


def report(name, counts):
    path = {f: sum(1 for _ in open(ROOT / f)) for f in READING_PATH}
    rest = {f: c for f, c in counts.items() if f not in READING_PATH}
    print(f"\n{name}: the path's files (wc -l), and beside them the lines of the functions that run")
    for f in READING_PATH:
        print(f"  path  {f:<34s} {path[f]:5d} lines ({sum(counts.get(f, (0,) * 4)[:4]):5d} of them run)")
    for f, (read, skip, checks, measure, names) in sorted(rest.items()):
        print(f"  beside {f:<33s} {read:5d} to read  {skip:5d} may skip  {checks:5d} checks (raise)"
              + (f"  {measure:5d} measurement" if measure else "")
              + (f"  to read: {', '.join(names)}" if names else ""))
    total, opened = sum(path.values()), sum(c[0] for c in rest.values())
    skipped, checked = sum(c[1] for c in rest.values()), sum(c[2] for c in rest.values())
    measured = sum(c[3] for c in rest.values())
    print(f"  path {total} + what a learner must open beside it {opened} = {total + opened} lines "
          f"(apart: {skipped} they may skip, {checked} of checks, {measured} of the closing measurement)")
    return dict(path=total, must_open=opened, may_skip=skipped, checks=checked, measurement=measured)


def main(argv=None):
    return cli.run(lambda: work(get_args(argv)))


def get_args(argv=None):
    p = cli.Parser("research/analysis/reading_trace.py", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["generate", "train"], default=None)
    return p.parse_args(argv)


def work(args):
    import os
    os.chdir(ROOT)
    results, merged = {}, defaultdict(set)
    for name, fn in (("generate", run_generate), ("train", run_train)):
        if args.only in (None, name):
            seen = trace(fn)
            for f, firsts in seen.items():
                merged[f] |= firsts
            results[name] = report(f"python {name}.py (default)", line_counts(seen))
    if len(results) == 2:
        results["both"] = report("both commands", line_counts(merged))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
