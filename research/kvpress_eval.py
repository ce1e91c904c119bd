"""
RULER-4K measured in kvpress's own pipeline (NVIDIA kvpress 0.5.5, transformers): LookaheadKVPress
(extensions/lookaheadkv_press.py, the shipped adapter) beside kvpress's presses, at C = 128 and 512 KV slots per
(layer, KV head), on the HF model SmolLM2-135M-Instruct, in two protocols:

  inside  ours (research/evaluate.py's): the whole chat prompt, question and answer prefix included
          (research/ruler.py's chat_prompt), is prefilled inside `with press(model)` and compressed; the first
          token comes from the prefill's logits, the rest by greedy decoding on the compressed cache.
  after   kvpress's: pipeline("kv-press-text-generation")(context, question=..., answer_prefix=...): only the
          context is compressed (its chat template opened, by the HF tokenizer's template); the question, the
          template's end of turn and the answer prefix come after the compression, then greedy decoding.
          RULER's input is split at its last line: the question (every RULER template asks it there).

Presses (kvpress's defaults unless said): full (no press, the reference), lookahead
(extensions/lookaheadkv_press.py, the paper's form: max-pool 7, C in every layer; --adapter is the folder
python -m extensions.export_peft writes, by default the shipped adapter's), snapkv (window 64, avg-pool 5),
pyramidkv, streaming, tova, expected (ExpectedAttentionPress), adakv-expected
(AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))), kvzip.
kvpress's presses take a compression ratio; a row of S tokens gets r = 1 - (C + 0.5) / S, which keeps exactly
int(S (1 - r)) = C slots (r = 0, no compression, when C >= S); LookaheadKVPress takes budget=C. KVzip and
AdaKV keep C per (layer, KV head) on average, spread over heads (and, for KVzip, over layers).
RestoreKV is not run: its adapters live on the Hugging Face hub (higokri/RestoreKV-<model>, made for
Llama-3.1-8B-Instruct and Qwen3-8B only), so it can neither run offline nor on SmolLM2.

Per row (one line of results.jsonl under --out, appended as soon as it is done: a killed run resumes where it
stopped, rows already there are skipped): protocol, press, C, the RULER score (ruler.score: the task's
metric), seconds for the row (prefill + compression + decoding) and until the cache was compressed, and the
memory the compressed cache really holds: the slots kept per (layer, KV head) and their bytes, counting kept
slots, not masked ones (KVzip and AdaKV keep every slot's tensor and hide the evicted ones behind kvpress's
attention patch): "held_mb" is what the tensors occupy, "kept_mb" what is not hidden. At the end (and with
--report alone), the mean per (protocol, press, C), per task, and RULER's average over tasks, and LookaheadKV
against each other
press paired over the rows both ran (the mean difference, a 95% bootstrap interval over rows), printed and
written to summary.md. Rows go sample by sample over the tasks (sample 0 of all 11 tasks, then sample 1, ...),
so a run stopped early holds as many samples of every task, give or take one. Every row records the identity of
the weights (every byte of --model's config.json and *.safetensors) and of the adapter (every byte of its
folder's files): a re-run into the same --out on other weights or with another adapter is refused, naming the
folder, rather than reporting the old rows as the new ones. Every flag is checked before the model loads; a bad
one is one `error:` line and exit status 1.

The full run (11 tasks x 5 samples x 2 protocols x (2 budgets x 8 presses + full): many CPU hours; KVzip alone
costs 2-3 prefills a row):

    python -m research.kvpress_eval --lengths 4096 --per-task 5 --budgets 128,512 --threads 2 \\
        --out runs/kvpress-ruler4k

The smallest run (one row of vt, 1K tokens, one press, one budget: ~8 s a protocol on one free core; --threads 1
whenever other jobs share the CPU, as torch's threads otherwise wait for busy cores at every op):

    python -m research.kvpress_eval --tasks vt --lengths 1024 --per-task 1 --budgets 128 --presses lookahead \\
        --protocols inside,after --threads 1 --out runs/kvpress-smoke
"""
import sys

if __name__ == "__main__" and not __package__:  # run by its path: the repository is not on sys.path
    sys.exit("error: run it from the repository root as python -m research.kvpress_eval")

import argparse
import contextlib
import hashlib
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from model import ModelConfig
from support import cli, files

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "weights" / "SmolLM2-135M-Instruct"
ADAPTER = ROOT / "weights" / "SmolLM2-135M-Instruct.lookahead-peft"  # python -m extensions.export_peft's folder
PRESSES = ("full", "lookahead", "snapkv", "pyramidkv", "streaming", "tova", "expected", "adakv-expected", "kvzip")
PROTOCOLS = ("inside", "after")
ROW_KEYS = ("protocol", "press", "budget", "id", "task", "score", "seconds", "kept_slots", "kept_mb", "held_mb")
SUMMARY_HEAD = "<!-- research.kvpress_eval's summary of results.jsonl: --report writes it again -->"
OURS = {"results.jsonl", "summary.md", files.CACHE_NAME}  # what a run leaves in --out


def make_press(name, C, S, adapter):
    """The press `name` keeping C slots per (layer, KV head) of a prompt of S tokens (None for full)."""
    import kvpress
    from kvpress.utils import compute_n_kept

    from extensions.lookaheadkv_press import LookaheadKVPress

    if name == "full":
        return None
    if name == "lookahead":
        return LookaheadKVPress.from_pretrained(adapter, budget=C)
    r = max(0.0, 1 - (C + 0.5) / S)
    assert r == 0 or compute_n_kept(S, r) == C
    if name == "adakv-expected":
        return kvpress.AdaKVPress(kvpress.ExpectedAttentionPress(compression_ratio=r, epsilon=1e-2))
    cls = dict(snapkv=kvpress.SnapKVPress, pyramidkv=kvpress.PyramidKVPress, streaming=kvpress.StreamingLLMPress,
               tova=kvpress.TOVAPress, expected=kvpress.ExpectedAttentionPress, kvzip=kvpress.KVzipPress)[name]
    return cls(compression_ratio=r)


def cache_memory(model, cache):
    """(slots kept per (layer, KV head) on average, MB kept, MB held): what the cache's tensors hold, less the
    slots kvpress's attention patch hides (module.masked_key_indices: KVzip, AdaKV, per-layer budgets)."""
    slots = held = hidden = 0
    for layer, block in zip(cache.layers, model.model.layers):
        B, H, T, D = layer.keys.shape
        masked = getattr(block.self_attn, "masked_key_indices", None)
        n_hidden = 0 if masked is None else len(masked[0])
        slots += B * H * T - n_hidden
        per_slot = 2 * D * layer.keys.element_size()  # a key and a value
        held += B * H * T * per_slot
        hidden += n_hidden * per_slot
    n = len(cache.layers) * B * H
    return slots / n, (held - hidden) / 2**20, held / 2**20


def greedy(model, tok, logits, cache, S, max_new_tokens, stop):
    """Greedy answer text from the first token's logits (1, V) on the cache, positions S onwards."""
    out = []
    for t in range(max_new_tokens):
        token = logits.argmax(-1)  # (1,)
        out.append(token.item())
        if out[-1] in stop or t == max_new_tokens - 1:
            break
        logits = model(token[:, None], past_key_values=cache, position_ids=torch.tensor([[S + t]])).logits[:, -1]
    return tok.decode(out, skip_special_tokens=True)


@torch.no_grad()
def run_inside(model, tok, ids, press, max_new_tokens, stop):
    """Ours: the whole chat prompt ids (1, S) compressed, the first token the prefill's. (answer, memory, s)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    start = time.perf_counter()
    with press(model) if press is not None else contextlib.nullcontext():
        logits = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits[:, -1]
    compressed = time.perf_counter() - start
    memory = cache_memory(model, cache)
    return greedy(model, tok, logits, cache, ids.shape[1], max_new_tokens, stop), memory, compressed


@torch.no_grad()
def run_after(pipe, context, question, prefix, press, max_new_tokens):
    """kvpress's: the context compressed, the question after it (its pipeline). (answer, memory, s): the time
    until the cache is compressed is not apart in the pipeline, so s is None."""
    from transformers import DynamicCache

    cache = DynamicCache()
    answer = pipe(context, question=question, answer_prefix=prefix, press=press, cache=cache,
                  max_new_tokens=max_new_tokens)["answer"]
    return answer, cache_memory(pipe.model, cache), None  # the pipeline took the answer back out of the cache


def rows(tok, args):
    """The RULER rows, sample 0 of every task first, then sample 1, ..."""
    from research import ruler

    tasks = {t: ruler.TASKS[t] for t in args.tasks} if args.tasks else ruler.TASKS
    out = []
    for n in args.lengths:
        suite = ruler.make_suite(tok, n, args.per_task, args.seed, tasks=tasks)  # task by task
        # sample by sample over the tasks instead: a run stopped early has as many rows of every task
        out += [suite[t * args.per_task + i] for i in range(args.per_task) for t in range(len(tasks))]
    return out


def report(results, out):
    """Means per (protocol, press, C): score, RULER's average over tasks, seconds, kept slots and MB."""
    groups = defaultdict(list)
    for r in results:
        groups[r["protocol"], r["press"], r["budget"]].append(r)
    lines = ["| protocol | press | C | rows | score | task average | s / row | kept slots | kept MB | held MB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    tasks = sorted({r["task"] for r in results})
    per_task = ["", "| protocol | press | C | " + " | ".join(tasks) + " |", "|---|---|---|" + "---|" * len(tasks)]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    for (protocol, press, C), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        scores = defaultdict(list)
        for r in rs:
            scores[r["task"]].append(r["score"])
        by_task = {t: mean(v) for t, v in scores.items()}
        lines.append(f"| {protocol} | {press} | {C or '-'} | {len(rs)} | {mean([r['score'] for r in rs]):.3f} | "
                     f"{mean(list(by_task.values())):.3f} | {mean([r['seconds'] for r in rs]):.1f} | "
                     f"{mean([r['kept_slots'] for r in rs]):.0f} | {mean([r['kept_mb'] for r in rs]):.2f} | "
                     f"{mean([r['held_mb'] for r in rs]):.2f} |")
        per_task.append(f"| {protocol} | {press} | {C or '-'} | " +
                        " | ".join(f"{by_task[t]:.2f}" if t in by_task else "" for t in tasks) + " |")
    # paired over the rows both ran: ours minus each other press, a 95% bootstrap interval over rows
    from support.metrics import paired_ci

    score = {(r["protocol"], r["press"], r["budget"], r["id"]): r["score"] for r in results}
    paired = ["", "| protocol | C | ours | against | rows | ours - theirs [95% CI] |", "|---|---|---|---|---|---|"]
    for protocol, C in sorted({(p, c) for p, _, c in groups if c}):
        for ours in ("lookahead",):
            for other in PRESSES:
                theirs = (protocol, other, 0 if other == "full" else C)
                ids = [i for (*key, i) in score if tuple(key) == (protocol, ours, C) and (*theirs, i) in score]
                if other == ours or not ids:
                    continue
                diffs = [score[protocol, ours, C, i] - score[(*theirs, i)] for i in ids]
                lo, hi = paired_ci(diffs)
                paired.append(f"| {protocol} | {C} | {ours} | {other} | {len(ids)} | "
                              f"{mean(diffs):+.3f} [{lo:+.3f}, {hi:+.3f}] |")
    text = "\n".join(lines + per_task + paired) + "\n"
    files.write_atomic(out / "summary.md", SUMMARY_HEAD + "\n" + text)
    print(text)


# -----------------------------------------------------------------------------
# The front door: every flag and file checked before the model loads


def get_args(argv):
    p = cli.Parser("-m research.kvpress_eval", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for results.jsonl and summary.md (runs/...)")
    p.add_argument("--model", type=Path, default=MODEL, help="an HF folder of a family model.py loads")
    p.add_argument("--adapter", type=Path, default=ADAPTER,
                   help="LookaheadKVPress's folder for that model (python -m extensions.export_peft writes it)")
    p.add_argument("--lengths", default="4096", help="RULER lengths (prompt + answer), e.g. 4096")
    p.add_argument("--per-task", type=int, default=5)
    p.add_argument("--tasks", type=lambda s: s.split(","), default=None, help="RULER tasks (default: all 11)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budgets", default="128,512", help="KV slots per (layer, KV head), e.g. 128,512")
    p.add_argument("--presses", type=lambda s: s.split(","), default=list(PRESSES))
    p.add_argument("--protocols", type=lambda s: s.split(","), default=list(PROTOCOLS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--report", action="store_true", help="only summarise what --out holds")
    return p.parse_args(argv)


def check_args(args):
    """Every flag, before anything is read or made: ValueError (or FileNotFoundError) naming it."""
    from research import ruler

    for name, given, allowed in (("press", args.presses, PRESSES), ("protocol", args.protocols, PROTOCOLS)):
        bad = [x for x in given if x not in allowed]
        if bad:
            extra = " (RestoreKV: its adapters are on the HF hub, for 8B models only)" if "restorekv" in bad else ""
            raise ValueError(f"unknown {name} {', '.join(bad)}{extra}; choose from {', '.join(allowed)}")
    bad = [t for t in args.tasks or [] if t not in ruler.TASKS]
    if bad:
        raise ValueError(f"unknown RULER task {', '.join(bad)}; choose from {', '.join(ruler.TASKS)}")
    try:
        args.budgets = cli.counts(args.budgets, "--budgets")
    except ValueError:
        raise ValueError(f"every budget must be >= 1 KV slot, got {args.budgets}") from None
    args.lengths = cli.counts(args.lengths, "--lengths")
    cli.at_least("--per-task", args.per_task, 1)
    cli.check_seed("--seed", args.seed)
    cli.check_threads("--threads", args.threads)
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out} is a file: pass a folder (it is made if missing)")
    if args.report:
        return
    cli.check_model_dir(args.model)
    ctx = ModelConfig.from_hf_config(args.model).max_context  # a family model.py reads, or ValueError
    for n in args.lengths:
        if n > ctx:
            raise ValueError(f"--lengths {n} (prompt and answer) is past the model's context of {ctx} tokens: "
                             f"use lengths up to {ctx}")
    if max(args.budgets) >= min(args.lengths):  # a prompt is shorter than its length: such a row keeps every token
        raise ValueError(f"--budgets {max(args.budgets)} keeps every token of a --lengths {min(args.lengths)} prompt "
                         f"(prompt and answer are {min(args.lengths)} tokens): nothing would be compressed; use "
                         f"budgets below {min(args.lengths)}")
    if "lookahead" in args.presses:
        missing = [f for f in ADAPTER_FILES if not (args.adapter / f).is_file()]
        if missing:
            raise FileNotFoundError(f"--adapter {args.adapter}: no LookaheadKVPress folder there (it lacks "
                                    f"{', '.join(missing)}): pass the folder python -m extensions.export_peft "
                                    "ADAPTER FOLDER wrote")


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "lookahead_embeddings.safetensors",
                 "lookahead_config.json")


def adapter_identity(folder):
    """A digest (16 hex) of every byte of the adapter folder's files: another adapter, another identity."""
    h = hashlib.sha256()
    for name in ADAPTER_FILES:  # each file read in blocks (a 4 GB adapter costs a block of memory)
        with open(Path(folder) / name, "rb") as fh:
            h.update(name.encode() + b"\0" + hashlib.file_digest(fh, "sha256").digest())
    return h.hexdigest()[:16]


def read_results(out):
    """results.jsonl's rows, each checked (a line of JSON holding ROW_KEYS): ValueError naming the line."""
    path = out / "results.jsonl"
    if not path.is_file():
        return []
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        missing = [k for k in ROW_KEYS if k not in row] if isinstance(row, dict) else ["a JSON object"]
        if missing:
            raise ValueError(f"{path} line {n} is not a kvpress_eval row (it lacks {', '.join(missing)}): pass "
                             "another --out, or remove that line")
        rows.append(row)
    return rows


def check_out(out, results, report):
    """--out holds only what a run writes (a summary.md it did not write is never replaced), and --report has
    rows to summarise."""
    if report and not results:
        raise ValueError(f"--out {out} holds no results.jsonl rows: nothing to report")
    if not out.is_dir():
        return
    theirs = sorted(p.name for p in out.iterdir() if p.name not in OURS)
    summary = out / "summary.md"
    if summary.exists() and (not summary.is_file() or not summary.read_text().startswith(SUMMARY_HEAD)):
        theirs.insert(0, "summary.md")
    if theirs:
        raise ValueError(f"--out {out} holds files research.kvpress_eval did not write ({', '.join(theirs[:3])}): "
                         "pass a new folder, or one an earlier run wrote")


def check_same_run(results, identity, out):
    """Rows made on other weights or with another adapter (or before identities were recorded) are not this
    run's: refused, naming the folder, rather than skipped as done and reported as this run's."""
    for r in results:
        was = {k: r.get(k) for k in identity}
        if was != identity:
            what = " and ".join(k for k in identity if was[k] != identity[k])
            raise ValueError(f"--out {out} holds rows made with another {what.replace('_id', '')} ({was}; this run: "
                             f"{identity}): pass another --out for these weights and this adapter")


def main(argv=None):
    return cli.run(lambda: evaluate(get_args(argv)))


def evaluate(args):
    check_args(args)
    results = read_results(args.out)
    check_out(args.out, results, args.report)
    if args.report:
        return report(results, args.out)
    identity = dict(weights_id=files.weights_identity(args.model, args.out if args.out.is_dir() else None),
                    adapter_id=adapter_identity(args.adapter) if "lookahead" in args.presses else None)
    if identity["adapter_id"] is None:  # no lookahead rows: any earlier run's adapter does not matter
        identity.pop("adapter_id")
    check_same_run(results, identity, args.out)
    cli.output_folder("--out", args.out)
    files.keep_identity(args.model, args.out, identity["weights_id"])

    import transformers  # noqa: F401 (kvpress registers its pipeline with transformers)
    import kvpress  # noqa: F401
    from research import ruler
    from support.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa").float().eval()
    if "lookahead" in args.presses:  # the adapter's files and its fit to --model, before the first row (not after it)
        probe = make_press("lookahead", args.budgets[0], None, args.adapter)
        probe.post_init_from_model(model)
        probe.disarm()
    hf_tok = transformers.AutoTokenizer.from_pretrained(args.model)
    tok = Tokenizer(args.model)  # ours: the chat prompt research/evaluate.py encodes
    pipe = transformers.pipeline("kv-press-text-generation", model=model, tokenizer=hf_tok, device="cpu")
    stop = set(tok.stop_ids)
    done = {(r["protocol"], r["press"], r["budget"], r["id"]) for r in results}
    todo = [(name, C) for name in args.presses for C in ([0] if name == "full" else args.budgets)]
    files.refuse_link(args.out / "results.jsonl", "--out")  # a handed folder's link: lines would land where it points
    with (args.out / "results.jsonl").open("a") as f:
        for row in rows(tok, args):
            ids = torch.tensor([tok.encode(ruler.chat_prompt(tok, row))])
            context, cut, question = row["input"].rpartition("\n")
            question = cut + question  # the pipeline puts it right after the context: RULER's own text again
            for protocol in args.protocols:
                if protocol == "after":
                    S = pipe.preprocess(context, [question], row["answer_prefix"], 10**9)["context_ids"].shape[1]
                else:
                    S = ids.shape[1]
                for name, C in todo:
                    if (protocol, name, C, row["id"]) in done:
                        continue
                    press = make_press(name, C, S, args.adapter)
                    start = time.perf_counter()
                    if protocol == "inside":
                        answer, memory, compressed = run_inside(model, hf_tok, ids, press, row["tokens_to_generate"],
                                                                stop)
                    else:
                        answer, memory, compressed = run_after(pipe, context, question, row["answer_prefix"], press,
                                                               row["tokens_to_generate"])
                    seconds = time.perf_counter() - start
                    result = dict(protocol=protocol, press=name, budget=C, id=row["id"], task=row["task"],
                                  prompt_tokens=S, score=ruler.score(row["task"], answer, row["answers"]),
                                  seconds=round(seconds, 3), compressed_s=compressed and round(compressed, 3),
                                  kept_slots=round(memory[0], 1), kept_mb=round(memory[1], 4),
                                  held_mb=round(memory[2], 4), answer=answer, **identity)
                    f.write(json.dumps(result) + "\n")
                    f.flush()
                    results.append(result)
                    print(f"{row['id']} {protocol} {name} C={C or '-'}: score {result['score']:.2f}, "
                          f"{seconds:.1f} s, {memory[0]:.0f} slots kept ({memory[1]:.2f} of {memory[2]:.2f} MB)",
                          flush=True)
    report(results, args.out)


if __name__ == "__main__":
    main()
