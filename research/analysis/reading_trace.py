"""
The reading claim, measured (issues 64, 75): run the two default commands under a line tracer, every thread
included (train.py's data stage and batches run in a thread pool), and print, per file, the lines that run:
the reading path's files whole (`wc -l`), and beside the path what a learner must open to follow what runs,
with the checks that only raise listed apart.

    python research/analysis/reading_trace.py            # generate.py's default, then train.py (2 steps)
    python research/analysis/reading_trace.py --only generate

generate.py: `--prompt examples/needle.txt --budget 128` (the README's command; 16 new tokens). train.py: the
learner's recipe (research/configs/train-quick.json) on a small run, 8 training and 2 held-out prompts, two
optimiser steps of 4 samples, in a temporary folder. A line counts once if it ran, in any thread; it belongs
to its outermost `def`. Beside the path, each line that ran is one of:
- a check (it only raises): its function's name starts with "check" or is in CHECK_FUNCTIONS, or it is in
  support/generate_checks.py or support/checks.py (but the loader's reading of files, LOADER_FUNCTIONS,
  which a learner follows to see a checkpoint become parameters);
- what a learner may skip (file I/O, locks and hashing, the tokenizer and chat formats, the text sources'
  download, the flags' parser and the error wrapper, the stats block's formatting): SKIP_FILES, and
  SKIP_FUNCTIONS by name in the other files;
- what a learner must open: everything else, the closing comparison the learner's run prints (recipe.compare,
  the held-out answer KL) and the training task mix the adapter learns from (support/data.py) included.
Lines outside functions (a dataclass's fields, imports) are in the path's `wc -l` only.
"""
import argparse
import ast
import json
import sys
import tempfile
import threading
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from support import cli  # noqa: E402
READING_PATH = ["model.py", "eviction.py", "lookaheadkv.py", "baselines.py", "methods.py", "train.py",
                "generate.py"]
CHECK_FILES = ("support/generate_checks.py", "support/checks.py")
# the loader's reading (support/checks.py): what turns files into tensors, not a check
LOADER_FUNCTIONS = {"read_json", "open_checkpoint", "weight_files", "stored_tensors", "read_tensor",
                    "read_adapter"}
# they raise; rule_parts and number (support/selection.py) run in the default commands only to check the
# adapter .json's recommended rule as text (--pool would make them build one)
CHECK_FUNCTIONS = {"at_least", "positive", "fraction", "as_number", "flag_value", "counts", "rule_parts",
                   "number", "data_folder", "data_dtypes", "output_paths", "free_disk"}
SKIP_FILES = ("support/files.py", "support/lock.py", "support/tokenizer.py", "weights/prepare.py",
              "research/analysis/reading_trace.py", "support/__init__.py")
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
    "support/data.py": {"decode_utf8", "file_header", "sample_path", "prefix_path", "save_safetensors",
                        "read_sample", "cache_file", "download", "fetch", "unzip", "sha256_of"},  # file I/O
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
    """{file (relative to the repository): {each line that ran}} while fn() runs, in every thread (the
    tracer is set for the threads fn() starts too: train.py's thread pool)."""
    seen, files = defaultdict(set), {}

    def repo_file(code):  # the file's path relative to the repository, or None for another library's
        name = code.co_filename
        if name not in files:
            try:
                files[name] = None if name.startswith("<") else str(Path(name).resolve().relative_to(ROOT))
            except ValueError:
                files[name] = None
        return files[name]

    def tracer(frame, event, arg):
        rel = repo_file(frame.f_code)
        if rel is None:
            return None  # no line events inside other libraries (torch, tokenizers)
        lines = seen[rel]

        def local(frame, event, arg):
            if event == "line":
                lines.add(frame.f_lineno)
            return local
        lines.add(frame.f_lineno)
        return local
    threading.settrace(tracer)
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
        threading.settrace(None)
    return seen


def outermost_defs(path):
    """[(first line, last line, name)] of the defs of a file that no other def holds."""
    spans = sorted((a, b, name) for a, (b, name) in def_spans(path).items())
    return [(a, b, name) for i, (a, b, name) in enumerate(spans)
            if not any(a0 < a and b <= b0 for a0, b0, _ in spans[:i])]


def category(rel, name):
    """Where a line of function `name` in file `rel` counts: "check", "skip" or "read"."""
    if (name.startswith("check") or name in CHECK_FUNCTIONS or rel in CHECK_FILES) \
            and name not in LOADER_FUNCTIONS:
        return "check"
    if rel in SKIP_FILES or name in SKIP_FUNCTIONS.get(rel, ()):
        return "skip"
    return "read"


def line_counts(seen):
    """{file: (lines to read, lines a learner may skip, lines of checks, the functions to read)}: the lines
    that ran (seen: {file: {line}}), each in its outermost def's category; lines outside any def uncounted."""
    out = {}
    for rel, lines in seen.items():
        counts, names = dict(read=0, skip=0, check=0), []
        for a, b, name in outermost_defs(ROOT / rel):
            n = sum(1 for line in lines if a <= line <= b)
            if n:
                kind = category(rel, name)
                counts[kind] += n
                if kind == "read":
                    names.append(name)
        out[rel] = (counts["read"], counts["skip"], counts["check"], names)
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
        print(f"  path  {f:<34s} {path[f]:5d} lines ({sum(counts.get(f, (0,) * 3)[:3]):5d} of them ran)")
    for f, (read, skip, checks, names) in sorted(rest.items()):
        print(f"  beside {f:<33s} {read:5d} to read  {skip:5d} may skip  {checks:5d} checks (raise)"
              + (f"  to read: {', '.join(names)}" if names else ""))
    total, opened = sum(path.values()), sum(c[0] for c in rest.values())
    skipped, checked = sum(c[1] for c in rest.values()), sum(c[2] for c in rest.values())
    print(f"  path {total} + what a learner must open beside it {opened} = {total + opened} lines "
          f"(apart: {skipped} lines ran that they may skip, {checked} of checks)")
    return dict(path=total, must_open=opened, may_skip=skipped, checks=checked)


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
