"""
RULER-4K measured in kvpress's own pipeline (NVIDIA kvpress 0.5.5, transformers): LookaheadKVPress
(extensions/kvpress_press.py, the shipped adapter) beside kvpress's presses, at C = 128 and 512 KV slots per
(layer, KV head), on the HF model SmolLM2-135M-Instruct, in two protocols:

  inside  ours (research/evaluate.py's): the whole chat prompt, question and answer prefix included
          (research/ruler.py's chat_prompt), is prefilled inside `with press(model)` and compressed; the first
          token comes from the prefill's logits, the rest by greedy decoding on the compressed cache.
  after   kvpress's: pipeline("kv-press-text-generation")(context, question=..., answer_prefix=...): only the
          context is compressed (its chat template opened, by the HF tokenizer's template); the question, the
          template's end of turn and the answer prefix come after the compression, then greedy decoding.
          RULER's input is split at its last line: the question (every RULER template asks it there).

Presses (kvpress's defaults unless said): full (no press, the reference), lookahead (our adapter in the paper's
form: max-pool 7, C in every layer), lookahead-shipped (the same adapter as its .json recommends: span:8:1024
and per-layer budgets), snapkv (window 64, avg-pool 5), pyramidkv, streaming, tova, expected
(ExpectedAttentionPress), adakv-expected (AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))), kvzip.
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
attention patch; LookaheadKV's per-layer budgets pad each layer to the largest C_l the same way): "held_mb" is
what the tensors occupy, "kept_mb" what is not hidden. At the end (and with --report alone), the mean per
(protocol, press, C), per task, and RULER's average over tasks, and LookaheadKV (both forms) against each other
press paired over the rows both ran (the mean difference, a 95% bootstrap interval over rows), printed and
written to summary.md. Rows go sample by sample over the tasks (sample 0 of all 11 tasks, then sample 1, ...),
so a run stopped early holds as many samples of every task, give or take one.

The full run (11 tasks x 5 samples x 2 protocols x (2 budgets x 9 presses + full): many CPU hours; KVzip alone
costs 2-3 prefills a row):

    python -m research.kvpress_eval --lengths 4096 --per-task 5 --budgets 128,512 --threads 2 \\
        --out runs/kvpress-ruler4k

The smallest run (one row of vt, 1K tokens, one press, one budget: ~8 s a protocol on one free core; --threads 1
whenever other jobs share the CPU, as torch's threads otherwise wait for busy cores at every op):

    python -m research.kvpress_eval --tasks vt --lengths 1024 --per-task 1 --budgets 128 --presses lookahead \\
        --protocols inside,after --threads 1 --out runs/kvpress-smoke
"""
import argparse
import contextlib
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "weights" / "SmolLM2-135M-Instruct"
ADAPTER = ROOT / "weights" / "SmolLM2-135M-Instruct.lookahead.safetensors"
PRESSES = ("full", "lookahead", "lookahead-shipped", "snapkv", "pyramidkv", "streaming", "tova", "expected",
           "adakv-expected", "kvzip")
PROTOCOLS = ("inside", "after")


def make_press(name, C, S, adapter):
    """The press `name` keeping C slots per (layer, KV head) of a prompt of S tokens (None for full)."""
    import kvpress
    from kvpress.utils import compute_n_kept

    from extensions.kvpress_press import LookaheadKVPress

    if name == "full":
        return None
    if name == "lookahead":
        return LookaheadKVPress.from_adapter(adapter, budget=C)
    if name == "lookahead-shipped":
        return LookaheadKVPress.from_adapter(adapter, budget=C, rule="span:8:1024", layer_budgets=True)
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
        for ours in ("lookahead", "lookahead-shipped"):
            for other in PRESSES:
                theirs = (protocol, other, 0 if other == "full" else C)
                ids = [i for (*key, i) in score if tuple(key) == (protocol, ours, C) and (*theirs, i) in score]
                if other in (ours, "lookahead") or not ids:  # (shipped - paper: once, the other way round)
                    continue
                diffs = [score[protocol, ours, C, i] - score[(*theirs, i)] for i in ids]
                lo, hi = paired_ci(diffs)
                paired.append(f"| {protocol} | {C} | {ours} | {other} | {len(ids)} | "
                              f"{mean(diffs):+.3f} [{lo:+.3f}, {hi:+.3f}] |")
    text = "\n".join(lines + per_task + paired) + "\n"
    (out / "summary.md").write_text(text)
    print(text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for results.jsonl and summary.md (runs/...)")
    p.add_argument("--model", type=Path, default=MODEL, help="an HF folder of a family model.py loads")
    p.add_argument("--adapter", type=Path, default=ADAPTER, help="our adapter for that model (.safetensors)")
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[4096])
    p.add_argument("--per-task", type=int, default=5)
    p.add_argument("--tasks", type=lambda s: s.split(","), default=None, help="RULER tasks (default: all 11)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budgets", type=lambda s: [int(x) for x in s.split(",")], default=[128, 512])
    p.add_argument("--presses", type=lambda s: s.split(","), default=list(PRESSES))
    p.add_argument("--protocols", type=lambda s: s.split(","), default=list(PROTOCOLS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--report", action="store_true", help="only summarise what --out holds")
    args = p.parse_args(argv)
    for name, given, allowed in (("press", args.presses, PRESSES), ("protocol", args.protocols, PROTOCOLS)):
        bad = [x for x in given if x not in allowed]
        if bad:
            extra = " (RestoreKV: its adapters are on the HF hub, for 8B models only)" if "restorekv" in bad else ""
            sys.exit(f"error: unknown {name} {', '.join(bad)}{extra}; choose from {', '.join(allowed)}")
    from research import ruler
    bad = [t for t in args.tasks or [] if t not in ruler.TASKS]
    if bad:
        sys.exit(f"error: unknown RULER task {', '.join(bad)}; choose from {', '.join(ruler.TASKS)}")
    if any(c < 1 for c in args.budgets):
        sys.exit(f"error: every budget must be >= 1 KV slot, got {args.budgets}")
    args.out.mkdir(parents=True, exist_ok=True)
    results_file = args.out / "results.jsonl"
    results = [json.loads(x) for x in results_file.read_text().splitlines() if x] if results_file.exists() else []
    if args.report:
        return report(results, args.out)

    import transformers  # noqa: F401 (kvpress registers its pipeline with transformers)
    import kvpress  # noqa: F401
    from support.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa").float().eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(args.model)
    tok = Tokenizer(args.model)  # ours: the chat prompt research/evaluate.py encodes
    pipe = transformers.pipeline("kv-press-text-generation", model=model, tokenizer=hf_tok, device="cpu")
    stop = set(tok.stop_ids)
    done = {(r["protocol"], r["press"], r["budget"], r["id"]) for r in results}
    todo = [(name, C) for name in args.presses for C in ([0] if name == "full" else args.budgets)]
    with results_file.open("a") as f:
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
                                  held_mb=round(memory[2], 4), answer=answer)
                    f.write(json.dumps(result) + "\n")
                    f.flush()
                    results.append(result)
                    print(f"{row['id']} {protocol} {name} C={C or '-'}: score {result['score']:.2f}, "
                          f"{seconds:.1f} s, {memory[0]:.0f} slots kept ({memory[1]:.2f} of {memory[2]:.2f} MB)",
                          flush=True)
    report(results, args.out)


if __name__ == "__main__":
    main()
