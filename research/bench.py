"""
Speed of LookaheadKV and the baselines, printed as RATIOS: medians over --repeats rounds after
one warm-up round (CUDA: torch.cuda.Event; CPU: wall time, or --clock cpu). Five modes:

    python -m research.bench --mode overhead --lengths 1024,2048 --budget 128  # eviction cost / prefill
    python -m research.bench --mode decode --methods snapkv,lookahead  # decode tok/s, evicted vs full cache
    python -m research.bench --mode prefill-vs-hf               # our prefill / transformers' (SDPA), time and memory
    python -m research.bench --mode train-cost                  # training: M-row pass vs whole sequence
    python -m research.bench --mode decode-cost --lengths 128,512 --every 32   # beyond the paper: below
    python -m research.bench --quick --json out/bench.json      # the H200 preset, about 2-3 minutes

overhead: each row is one method's compress() (prefill, scoring, eviction) on a prompt of the standard
library's source (text_ids; random ids with --random-init) at each prompt length, and
overhead = the median over rounds of (method - full) timed in the same round (drift cancels), printed
in ms and as % of FullKV's prefill; "middle half" is the 25th..75th percentile of those differences (the
noise of the machine); "fastest" is the method's fastest round against FullKV's fastest (a call's work is
fixed and a shared machine only adds time to it, so the fastest call is the least disturbed one, as
timeit advises; RESULTS.md, section 5, gives both). --json adds every round's ms (rounds_ms).
Rows (--methods): full, snapkv, h2o, laq, and
    lookahead            as shipped: the model's adapter (weights/<model>.lookahead.safetensors, or
                         --adapter) with the rule and per-layer budgets of its .json
    lookahead-unpooled   the same adapter, top C of its raw scores, C in every layer (our variant: the
                         paper pools the scores first; --pool max:7 --uniform-budgets on lookahead is that)
    lookahead-2pass      as shipped, scored by a second forward of the M rows (the training form)
    lookahead-exact      as shipped, but span:8 with the exact surprisal (what the shortlist gate saves)
    full-1chunk          the prefill in one chunk whatever --chunk-size or its memory (a diagnostic)
    full+M               the floor of the one-pass form: the prompt's M next tokens of the same text ride in
                         its last chunk as the lookahead rows do (M more rows through every layer, their K/V
                         dropped after), through SDPA, with no LoRA, no scores, no eviction (floor_prefill);
                         lookahead minus full+M is what the method adds beyond its floor
(pyramidkv, streaming and random may be named too.) A model without an adapter (--random-init) times
an untrained module of the same shapes (timing does not depend on training) selecting by the shipped
adapter's rule. The run's first lines say which adapter, rule and budgets the lookahead rows use.

Without --model it loads weights/SmolLM2-135M-Instruct; --random-init research/configs/llama-3.1-8b.json
builds that shape with random weights (bf16 on CUDA): timing needs no trained weights. --quick
(CUDA only): overhead, repeats 5, Llama-3.1-8B shape at 8K and 32K, Qwen3-8B at 8K; h2o skipped
above 16K (it scores with every prompt query: S x S work in row chunks). Rows print as they are
measured and each is added to --json OUT at once (a killed run keeps them; an earlier run's rows in OUT are
kept, each row saying its torch); --markdown prints markdown.
On a shared CPU, --threads 1 --clock cpu counts only this process's CPU time. On CPU, freed memory is kept
for reuse (keep_freed_memory), so no round pays page faults an earlier one already paid.
RESULTS.md gives each measured table with the command that made it; the issue 27 row:
    python -m research.bench --mode overhead --lengths 2048 --budget 128 --threads 1 --clock cpu --repeats 5

decode: greedy steps per second on the evicted cache of each --methods row (default snapkv) against
the full cache, at batch sizes --batches.

decode-cost (beyond the paper: extensions/decode.py): what holding the cache to C_d while decoding costs
per generated token. --lengths are the decode budgets C_d here: the cache starts with C_d slots (a random
prompt of C_d tokens, prefilled whole) and every method decodes PERIODS x every tokens, evicting back to
C_d each time it holds C_d + every slots, so its forwards see C_d + 1 .. C_d + every slots over and over.
"plain" is decode() without eviction over one such period (every tokens from C_d slots): the same cache
sizes, no scoring. overhead per token = method's ms per token - plain's; per eviction = that x every.
The lookahead refresh is one M-row forward per eviction (lookahead_pass). On the GPU with the 8B shapes:
    python -m research.bench --mode decode-cost --random-init research/configs/llama-3.1-8b.json --lengths 512,4096

Every flag is checked, and every row's scorer made, before a model loads: a bad one is one `error:` line. So
are --lengths, with what each mode appends after them (lookahead rows, decode steps), against the model's
context (config.json's max_position_embeddings).
"""
import sys

if __name__ == "__main__" and not __package__:  # run by its path: the repository is not on sys.path
    sys.exit("error: run it from the repository root as python -m research.bench")

import argparse
import ctypes
import inspect
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from support import cli, files
from eviction import EvictConfig, Pool, compress, decode, prefill, uniform_budgets
from extensions.decode import DECODE_METHODS, DecodeEviction
from extensions.span import SpanRule
from lookaheadkv import LookaheadHook, answer_attention, kl_loss, lookahead_pass, untrained_module
import methods
from methods import METHODS, adapter_selection, load_adapter, make_scorer, parse_rule
from model import KVCache, ModelConfig, Transformer, default_dtype
from support.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]  # the repository root
KEPT_MEMORY = False  # keep_freed_memory() took: set when run as a script
# row name -> EvictConfig fields; any other name in methods.METHODS runs as itself
VARIANTS = {
    "lookahead": dict(method="lookahead"),  # the paper's form, LookaheadKV's default: max-pool 7, C in every layer
    # beyond the paper, as the shipped adapter's .json recommends: the span rule and per-layer budgets
    "lookahead-shipped": dict(method="lookahead", rule="adapter", budgets="adapter"),
    "lookahead-2pass": dict(method="lookahead", options=dict(one_pass=False)),  # a 2nd forward of the M rows
    # unpooled top C in every layer, our variant (the paper pools first)
    "lookahead-unpooled": dict(method="lookahead", rule=Pool("none"), budgets=uniform_budgets),
    # the paper's form as its text states it: scores pooled (max, width 7) before the top C, C in every layer
    "lookahead-paper": dict(method="lookahead", rule=Pool("max", 7), budgets=uniform_budgets),
    # the span rule with the exact surprisal (every LM-head row), the adapter's budgets: what the gate saves
    "lookahead-exact": dict(method="lookahead", rule=SpanRule(8), budgets="adapter"),
    "full-1chunk": dict(method="full", chunk_size=1 << 30),  # prefill in one chunk, whatever its memory (a diagnostic)
    # the one-pass form's floor (issue 68): M more tokens in the last chunk, no LoRA, no scores (floor_prefill)
    "full+M": dict(method="full"),
}
OVERHEAD_ROWS = "full,snapkv,h2o,laq,lookahead,lookahead-shipped,lookahead-unpooled,lookahead-2pass"
DEFAULT_METHODS = {"overhead": OVERHEAD_ROWS, "decode": "snapkv", "decode-cost": ",".join(DECODE_METHODS)}
DEFAULT_LENGTHS = {"overhead": ([1024, 2048], [8192, 32768]), "decode": ([1024], [8192]),  # (CPU, CUDA)
                   "prefill-vs-hf": ([1024, 2048], [1024, 2048]), "train-cost": ([1024], [1024]),
                   "decode-cost": ([128, 512], [512, 4096])}  # decode-cost: the decode budgets C_d
CONFIGS = ROOT / "research" / "configs"
QUICK = [(CONFIGS / "llama-3.1-8b.json", [8192, 32768]), (CONFIGS / "qwen3-8b.json", [8192])]
QUICK_ROWS = ["full", "full-1chunk", "snapkv", "h2o", "laq", "lookahead", "lookahead-unpooled", "lookahead-2pass"]
# the shipped adapter's .json: its rule is what an untrained module (a model without an adapter) selects by
SHIPPED = ROOT / "weights" / "SmolLM2-135M-Instruct.lookahead.json"
NEW_TOKENS = 32  # decode: greedy steps timed per round
PERIODS = 4  # decode-cost: evictions timed per round (PERIODS x every tokens)
RESPONSE = 128  # train-cost: the answer whose attention is the target
SEED = 0  # the random prompts and the untrained module
COLUMNS = {  # mode -> (row key, header) of the printed table; --json has every key
    "overhead": [("method", "method"), ("S", "S"), ("prefill_ms", "prefill ms"), ("total_ms", "total ms"),
                 ("overhead_ms", "overhead ms"), ("overhead_pct", "overhead %"), ("spread", "middle half %"),
                 ("fastest_pct", "fastest %"), ("kv_mib", "KV MiB"),
                 ("full_kv_mib", "full KV MiB"), ("peak_gib", "peak GiB")],
    "decode": [("method", "method"), ("S", "S"), ("batch", "batch"), ("full_tok_s", "full tok/s"),
               ("evicted_tok_s", "evicted tok/s"), ("speedup", "evicted / full"), ("kv_mib", "KV MiB"),
               ("full_kv_mib", "full KV MiB")],
    "prefill-vs-hf": [("S", "S"), ("ours_ms", "ours ms"), ("hf_ms", "transformers ms"), ("ratio", "ours / theirs"),
                      ("logits_diff", "max |logits diff|"), ("ours_peak_gib", "ours peak GiB"),
                      ("hf_peak_gib", "transformers peak GiB"), ("ours_added_gib", "ours added GiB"),
                      ("hf_added_gib", "transformers added GiB")],
    "train-cost": [("S", "S"), ("efficient_samples_s", "efficient samples/s"), ("naive_samples_s", "naive samples/s"),
                   ("speedup", "efficient / naive"), ("loss_efficient", "loss efficient"), ("loss_naive", "loss naive")],
    "decode-cost": [("method", "method"), ("budget", "C_d"), ("every", "every"), ("plain_ms_tok", "plain ms/tok"),
                    ("ms_tok", "ms/tok"), ("overhead_ms_tok", "overhead ms/tok"), ("overhead_pct", "overhead %"),
                    ("ms_per_eviction", "ms/eviction")],
}
med = statistics.median


def peak_rss_reset():
    """Linux: restart the process's peak-RSS counter (VmHWM). False where /proc cannot do it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_gib():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20  # kB -> GiB


def keep_freed_memory():
    """CPU timing: ask glibc to keep freed memory for the next allocation rather than give it back to the
    kernel. Otherwise every large activation is mmap'ed and unmapped in each call and each round pays its
    page faults again: 0.3-1.2 s of system time per 2K prefill on this 2-core machine, varying from call to
    call (CUDA's caching allocator keeps its memory the same way). True if it took (glibc only)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))


def time_rounds(fns, repeats, device, desc="", clock=time.perf_counter):
    """One warm-up round, then `repeats` rounds calling every fn of {name: fn} in turn, the order rotated
    by one each round (on a shared machine a call's speed drifts within a round: no row may always take
    one place in it). Returns {name: [ms per round]}, {name: peak GiB}, {name: last
    result}. Peak: on CUDA the allocator's peak during the call; on CPU (Linux) the process's peak RSS
    during the call, which includes the weights and Python (None where /proc cannot be reset)."""
    cuda = torch.device(device).type == "cuda"
    times, peak, out = {n: [] for n in fns}, {n: None for n in fns}, {}
    names = list(fns)
    for r in tqdm(range(repeats + 1), desc=desc, leave=False):
        for n in names[r % len(names):] + names[:r % len(names)]:
            fn = fns[n]
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                out[n] = fn()
                b.record()
                b.synchronize()
                ms = a.elapsed_time(b)
                peak[n] = max(peak[n] or 0.0, torch.cuda.max_memory_allocated() / 2**30)
            else:
                rss = peak_rss_reset()
                t0 = clock()
                out[n] = fn()
                ms = (clock() - t0) * 1e3
                if rss:
                    peak[n] = max(peak[n] or 0.0, peak_rss_gib())
            if r > 0:  # round 0 only warms up (allocator, kernels, caches)
                times[n].append(ms)
    return times, peak, out


# -----------------------------------------------------------------------------
# Rows, models, adapters


def row_config(name, args, budget=None):
    """A row's EvictConfig; rule and budgets None = the method's own (lookahead: the paper's form), "adapter" = as
    the adapter's .json recommends (row_scorer reads them)."""
    f = VARIANTS.get(name, dict(method=name))
    return EvictConfig(**{"budget": args.budget if budget is None else budget, "window": args.window,
                          "chunk_size": args.chunk_size, **f})


def row_scorer(name, args, module=None, budget=None):
    """A row's Scorer (methods.make_scorer checks budget, window and rule: ValueError naming the row)."""
    try:
        eviction, (rule, budgets) = row_config(name, args, budget), adapter_selection(module)
        eviction.rule = rule if eviction.rule == "adapter" else eviction.rule  # what the .json recommends, by name
        eviction.budgets = budgets if eviction.budgets == "adapter" else eviction.budgets
        return make_scorer(eviction, module)
    except ValueError as e:
        raise ValueError(f"row {name}: {e}") from None


def random_model(config_path, device, dtype=None):
    """config.json's shape with random weights (normal std 0.02, norms 1): built on meta and
    materialised once on `device`, so an 8B model never exists in float32 on the CPU."""
    cfg = ModelConfig.from_hf_config(config_path)
    cfg.name = Path(config_path).stem
    dtype = dtype or default_dtype(device)
    check_memory(cfg, config_path, device, dtype)  # counted from the config: said now, not by the OOM killer
    with torch.device("meta"):
        model = Transformer(cfg).to(dtype)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty makes new Parameters: tie the head again
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    return model.requires_grad_(False).eval()


def check_memory(cfg, config_path, device, dtype):
    """--random-init's weights within the memory free on `device`, counted from its config.json before any module
    is built (a config of a million layers took minutes to build on the meta device before this was said)."""
    cli.check_fits_memory(cfg, dtype, device, f"run --random-init {config_path} on a GPU (--device cuda), or time a "
                                              f"smaller config")


def adapter_path(cfg, args):
    """--adapter, or the adapter shipped for this model, or None (there is none: --random-init)."""
    if args.adapter:
        return Path(args.adapter)
    path = cli.default_adapter_path(cfg)
    return path if path.is_file() else None


def shipped_rule():
    """The rule the shipped adapter selects by (its .json), for an untrained module; None if unknown."""
    try:
        rule = json.loads(SHIPPED.read_text()).get("rule")
        return str(parse_rule(rule)) if rule else None
    except (OSError, ValueError, AttributeError):
        return None


def untrained(model):
    """An untrained module (random P, LoRA B = 0: same shapes, same FLOPs, same time as a trained one),
    seeded, selecting by the shipped adapter's rule (its per-layer budgets fit the shipped model only)."""
    module = methods.untrained(model, SEED)  # the shipped configuration: LoRA on all seven projections
    rule = shipped_rule()
    if rule:
        module.info["rule"] = rule
    return module


def setup(args, config_path, lookahead):
    """(model, lookahead module or None, {row: Scorer}). For a checkpoint, config.json and the adapter are
    read, and the lookahead rows' scorers made (the adapter's rule and budgets against --budget), BEFORE the
    weights load. Without an adapter (--random-init) the untrained module takes the scale of the model's
    embeddings, so the model comes first."""
    dtype = getattr(torch, args.dtype) if args.dtype else None
    module = path = None
    args.text_from = None  # the folder whose tokenizer makes the overhead rows' text prompts (a checkpoint's)
    if config_path:
        args.made_by = dict(weights_id=f"random {files.file_identity(config_path)}", adapter_id=None)
        model = random_model(config_path, args.device, dtype)
    else:
        folder = cli.resolve_model(args.model)
        args.model = str(folder)
        cfg = ModelConfig.from_hf_config(folder)
        path = adapter_path(cfg, args) if lookahead else None
        # what the rows are made by, checked against --json's earlier rows of this model before the weights load
        args.made_by = dict(weights_id=files.weights_identity(folder),
                            adapter_id=files.file_identity(path) if path else None)
        check_same_makers(args, cfg.name)
        if path:
            module = load_adapter(path, cfg)
            scorers_for(args, module)
        model = cli.load(folder, args.device, dtype, tokenizer=False)[0]
        args.text_from = folder
    if lookahead and module is None:
        module = untrained(model)
    if module is not None:
        module = module.to(args.device)  # float32, as trained: its rows are cast to the model's dtype
        module.source = str(path) if path else "untrained"
    return model, module, scorers_for(args, module)


def scorers_for(args, module):
    """{row: Scorer} of the overhead and decode modes, full first (every row's baseline)."""
    if args.mode not in ("overhead", "decode"):
        return {}
    return {name: row_scorer(name, args, module) for name in dict.fromkeys(["full"] + args.methods)}


def random_ids(model, B, S, seed=SEED):  # timing only: the tokens do not matter
    ids = torch.randint(0, model.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(seed))
    return ids.to(model.lm_head.weight.device)


def text_ids(model, tok, S):
    """(1, S) ids of real text, the standard library's own source (every Python has it), for the overhead rows:
    the span rule's gate reads the LM-head rows of the prompt's distinct tokens, which random ids overstate
    (2K random ids hold ~1.9K distinct tokens; 2K tokens of this text ~500). Without a tokenizer: random ids."""
    if tok is None:
        return random_ids(model, 1, S)
    ids = []
    for f in sorted(Path(argparse.__file__).parent.glob("*.py")):  # the same files, in the same order, every run
        ids += tok.encode(f.read_text(errors="replace"))
        if len(ids) >= S:
            break
    return torch.tensor([ids[:S]], device=model.lm_head.weight.device)


def describe(model, args, module=None, scorers=None, note=None):
    """The run's conditions, then the table header (rows follow as they are measured)."""
    dt = next(model.parameters()).dtype
    print(f"\n{model.config.name}  {args.device} {str(dt)[6:]}  threads {torch.get_num_threads()}  budget {args.budget}"
          f"  window {args.window}  repeats {args.repeats}  clock {args.clock.__name__}  torch {torch.__version__}")
    if KEPT_MEMORY and torch.device(args.device).type == "cpu":
        kept = "" if args.mode == "prefill-vs-hf" else "; peak GiB includes what is kept"  # its peaks: a process apart
        print(f"allocator: freed memory kept for reuse (glibc mallopt), as CUDA's caching allocator does{kept}")
    if module is not None:
        kind = ("untrained LookaheadModule" if module.source == "untrained" else f"adapter {module.source}")
        print(f"lookahead rows: {kind} (M={module.n_tokens}, LoRA {','.join(module.targets)} r={module.rank})")
        for name, s in (scorers or {}).items():
            if name.startswith("lookahead"):
                budgets = "per-layer budgets" if type(s.eviction.budgets).__name__ == "LayerBudgets" else "C every layer"
                print(f"  {name}: rule {s.rule}, {budgets}, {'one pass' if s.options['one_pass'] else 'two passes'}")
    if note:
        print(note)
    if torch.device(args.device).type == "cuda":
        print(sdpa_kernels(model.config, args.device, dt))
    print_line([h for _, h in COLUMNS[args.mode]], args)
    if args.markdown:
        print("|" + "---|" * len(COLUMNS[args.mode]))


def sdpa_kernels(cfg, device, dtype):
    """Which fused CUDA kernels can take model.Attention's call for a prefill chunk on a cache
    (GQA, causal_lower_right: no explicit mask, which is what flash needs)? With neither, the
    CausalBias is materialised as a (T, Tk) mask and SDPA picks a masked kernel (cuDNN or math)."""
    try:
        from torch.backends import cuda as tbc
        q, k = (torch.zeros(1, h, 256, cfg.head_dim, device=device, dtype=dtype)
                for h in (cfg.num_attention_heads, cfg.num_key_value_heads))
        p = tbc.SDPAParams(q, k, k, None, 0.0, False, True)  # what CausalBias asks for (bias.py)
        return "SDPA kernels for a GQA chunk on a cache: " + ", ".join(
            f"{n} {getattr(tbc, f'can_use_{n}_attention')(p)}" for n in ("flash", "efficient")
            if hasattr(tbc, f"can_use_{n}_attention"))
    except Exception as e:  # a diagnostic: never stop a GPU run for it
        return f"SDPA kernel check failed: {type(e).__name__}: {e}"


def fmt(v):
    if v is None or isinstance(v, (str, int)):
        return "-" if v is None else str(v)
    return f"{v:.1f}" if abs(v) >= 100 or v == 0 else f"{v:.2f}" if abs(v) >= 0.1 else f"{v:.1e}"


def print_line(values, args):
    cells = [fmt(v) for v in values]
    if args.markdown:
        print("| " + " | ".join(cells) + " |")
    else:
        w = [18 if k == "method" else max(len(h), 8) for k, h in COLUMNS[args.mode]]
        print("  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(cells)))


# -----------------------------------------------------------------------------
# Modes: each passes its rows (one dict per table line) to emit()


def floor_prefill(model, ids, M, chunk_size):
    """The full+M row: the prompt ids[:, :-M] prefilled as FullKV's, its M next tokens riding in the last chunk
    as the one-pass form's lookahead rows do (eviction.prefill's tail), their K/V dropped after: what M more
    rows cost by themselves, through the same linear layers and SDPA, without a LoRA, a score or an eviction."""
    S = ids.shape[1] - M
    cache = KVCache(model.config.num_hidden_layers)
    positions = torch.arange(S + M, device=ids.device).expand(ids.shape[0], -1)
    prefill(model, model.model.embed_tokens(ids), positions, cache, chunk_size=chunk_size, logits_at=S - 1, tail=M)
    cache.truncate(S)
    return cache


@torch.inference_mode()
def run_overhead(model, module, scorers, args, lengths, emit):
    skip = [S for S in lengths if "h2o" in args.methods and args.h2o_max_len and S > args.h2o_max_len]
    describe(model, args, module, scorers, note=skip and f"h2o skipped at S = {skip} (> --h2o-max-len): it scores "
             "with every prompt query, S x S work in row chunks, several times the prefill at such lengths")
    tok = Tokenizer(args.text_from, model.config) if args.text_from else None
    M = lookahead_tokens(args, model.config, bool(args.random_init))  # the full+M row's extra tokens
    for S in lengths:
        ids = text_ids(model, tok, S + M)  # the prompt, then the M tokens only full+M reads
        fns = {}
        for name in scorers:  # full first: the baseline of every row
            if name == "h2o" and S in skip:
                continue
            # the returned cache is freed at once: only the eviction's work is timed
            if name == "full+M":
                fns[name] = lambda: floor_prefill(model, ids, M, scorers["full"].eviction.chunk_size).nbytes()
            else:
                fns[name] = lambda s=scorers[name]: compress(model, ids[:, :S], s)[0].nbytes()
        times, peak, kv = time_rounds(fns, args.repeats, args.device, f"overhead S={S}", args.clock)
        full_ms = med(times["full"])  # FullKV's prefill: every row's share is of it
        for name in [m for m in fns if m in args.methods]:
            diffs = [t - f for t, f in zip(times[name], times["full"])]  # paired: drift cancels
            over = med(diffs)
            # the middle half of the rounds' differences: how far apart the rounds were (the noise)
            q1, q3 = (statistics.quantiles(diffs, n=4)[::2] if len(diffs) > 1 else diffs * 2)
            emit(dict(mode="overhead", model=model.config.name, method=name, S=S, budget=args.budget,
                      prefill_ms=full_ms, total_ms=med(times[name]), overhead_ms=over,
                      overhead_pct=100 * over / full_ms, overhead_pct_q1=100 * q1 / full_ms,
                      overhead_pct_q3=100 * q3 / full_ms, spread=f"{100 * q1 / full_ms:+.1f}..{100 * q3 / full_ms:+.1f}",
                      kv_mib=kv[name] / 2**20, full_kv_mib=kv["full"] / 2**20,
                      fastest_pct=100 * (min(times[name]) - min(times["full"])) / min(times["full"]),
                      peak_gib=peak[name], rounds_ms=times[name], full_rounds_ms=times["full"]))


@torch.inference_mode()
def run_decode(model, module, scorers, args, lengths, emit):
    describe(model, args, module, scorers, note=f"{NEW_TOKENS} greedy decode steps per batch, after the prefill "
             "(untimed)")
    for name in [m for m in args.methods if m != "full"]:
        for S in lengths:
            for B in args.batches:
                ids = random_ids(model, B, S)
                states = dict(full=compress(model, ids, scorers["full"]), evicted=compress(model, ids, scorers[name]))

                def steps(st):  # NEW_TOKENS forward steps: the first token comes from the prefill's logits
                    cache, logits, pos, _ = st
                    for _ in decode(model, cache.copy(), logits, pos, NEW_TOKENS + 1):  # a copy: the state is reused
                        pass

                fns = {k: (lambda st=st: steps(st)) for k, st in states.items()}
                times, _, _ = time_rounds(fns, args.repeats, args.device, f"decode {name} S={S} B={B}", args.clock)
                tok_s = {k: B * NEW_TOKENS / (med(t) / 1e3) for k, t in times.items()}
                emit(dict(mode="decode", model=model.config.name, method=name, S=S, batch=B, budget=args.budget,
                          full_tok_s=tok_s["full"], evicted_tok_s=tok_s["evicted"],
                          speedup=tok_s["evicted"] / tok_s["full"], full_kv_mib=states["full"][0].nbytes() / 2**20,
                          kv_mib=states["evicted"][0].nbytes() / 2**20))
                del states


@torch.inference_mode()
def run_prefill_vs_hf(args, lengths, emit):
    try:
        import transformers  # noqa: F401 (load_hf uses it; a missing one is said before any model loads)
    except ImportError:
        raise ValueError("--mode prefill-vs-hf needs transformers (pip install transformers), "
                         "a test/bench dependency only") from None
    cuda = torch.device(args.device).type == "cuda"
    with tempfile.TemporaryDirectory(prefix="bench-random-") as tmp:  # held to the end: the memory calls load it
        if args.random_init:  # the same random weights on both sides: ours, saved once as an HF folder
            ours = random_model(args.random_init, args.device, torch.float32)
            folder = save_hf_folder(ours, args.random_init, Path(tmp))
        else:
            folder = cli.resolve_model(args.model)
            ours = cli.load(folder, args.device, torch.float32, tokenizer=False)[0]
        theirs = load_hf(folder, args.device)
        full = row_scorer("full", args)
        where = ("this process, the allocator's own counters" if cuda else
                 "a fresh process of its own per side, which loads that side's model alone, each tensor of 128 KiB or "
                 "more its own mapping (measure_one_call)")
        describe(ours, args, note="both float32, torch.inference_mode, same threads, last token's logits only "
                 "(transformers: logits_to_keep=1), each building its KV cache; peak: the peak memory during one "
                 f"more call of each side, after one unmeasured, in {where}; added: that less what was held before "
                 "the call")
        for S in lengths:
            ids = random_ids(ours, 1, S)
            fns = dict(ours=prefill_call(ours, ids, full), transformers=prefill_call(theirs, ids))
            times, _, out = time_rounds(fns, args.repeats, args.device, f"prefill S={S}", args.clock)
            t_ours, t_hf = med(times["ours"]), med(times["transformers"])
            if cuda:
                (ours_peak, ours_added), (hf_peak, hf_added) = (cuda_memory(fns[n]) for n in fns)
            else:  # not here: after the timing rounds, this process's heap decides what a call adds (child_memory)
                (ours_peak, ours_added), (hf_peak, hf_added) = (
                    child_memory(prefill_side, n, folder, ids.cpu(), full, args.threads) for n in fns)
            emit(dict(mode="prefill-vs-hf", model=ours.config.name, S=S, ours_ms=t_ours, hf_ms=t_hf,
                      ratio=t_ours / t_hf, logits_diff=(out["ours"] - out["transformers"]).abs().max().item(),
                      ours_peak_gib=ours_peak, hf_peak_gib=hf_peak, ours_added_gib=ours_added,
                      hf_added_gib=hf_added, rounds_ms=times["ours"], hf_rounds_ms=times["transformers"]))


def load_hf(folder, device):
    """transformers' model of an HF folder, float32, its SDPA attention."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # a bar per tensor: hundreds of lines in the table
    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").to(device).float().eval()


def prefill_call(model, ids, full=None):
    """One prefill of ids as a call returning the last token's logits: ours (a Transformer, with FullKV's scorer
    `full`: compress() keeps every slot) or transformers' (logits_to_keep=1); each builds its KV cache."""
    if isinstance(model, Transformer):
        return torch.inference_mode()(lambda: compress(model, ids, full)[1])
    return torch.inference_mode()(lambda: model(input_ids=ids, logits_to_keep=1).logits[:, -1])


def prefill_side(side, folder, ids, full, threads):
    """child_memory's maker: side ("ours" or "transformers")'s model loaded from folder on the CPU, and its
    prefill of ids as a call."""
    if threads:
        torch.set_num_threads(threads)
    if side == "ours":
        return prefill_call(cli.load(folder, "cpu", torch.float32, tokenizer=False)[0], ids, full)
    return prefill_call(load_hf(folder, "cpu"), ids)


def save_hf_folder(model, config_path, folder):
    """A random model as a Hugging Face folder (its config.json as given, model.safetensors of its tensors,
    whose names mirror the checkpoint's) that transformers loads: both sides then run the very same weights."""
    from safetensors.torch import save_file

    tensors = {n: t.contiguous() for n, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # tied: stored once, as the embedding
    config = json.loads(Path(config_path).read_text())
    # as we read it: a config that leaves tying out is tied for us (and in HF's Qwen/Llama-3.2 files), not in
    # every transformers class
    config["tie_word_embeddings"] = model.config.tie_word_embeddings
    files.write_atomic(folder / "config.json", json.dumps(config, indent=1))
    files.write_with(folder / "model.safetensors", lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    return folder


def cuda_memory(fn):
    """(peak, added) in GiB: the CUDA allocator's peak during one call of fn, and that less what it held before."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    peak = torch.cuda.max_memory_allocated()
    return peak / 2**30, (peak - before) / 2**30


def child_memory(make, *make_args, held=True):
    """(peak, added) in GiB on the CPU: a fresh process (spawned) builds fn = make(*make_args) (loads a model),
    then reads its peak resident memory (VmHWM) over one call of fn (measure_one_call), and that less its
    resident memory just before the call (VmRSS). (None, None) where /proc cannot say (not Linux).

    Why a process of its own: in the timing process, after its rounds, the very same 8K prefill read 0.60 and
    1.04 GiB added in two runs (2026-12-07): what a call adds there depends on how the rounds left the heap.
    Spawn imports the caller's main module again: a script that calls this keeps its work under
    `if __name__ == "__main__"` (bench.py does)."""
    import concurrent.futures
    import multiprocessing

    spawn = multiprocessing.get_context("spawn")  # not fork: a forked child would inherit this heap
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        return pool.submit(measure_one_call, make, make_args, held).result()


def measure_one_call(make, make_args, held=True):
    """child_memory's child: (peak, added) in GiB over one call of make(*make_args), after one call unmeasured
    (as the timing rounds' warm-up: transformers leaves its weights mapped from the file, read in by the first
    call, and SmolLM2's 0.5 GiB would count as the call's own).

    held: every allocation of 128 KiB or more gets a mapping of its own, given back when freed (glibc's
    M_MMAP_THRESHOLD at its starting value, held there), so the peak counts the tensors alive at once, not how
    the allocator reuses freed blocks. With glibc's defaults the threshold rises as large blocks are freed, and
    what the heap then keeps around the tensors differs from process to process, on both sides: at 4K ours read
    0.417-0.471 GiB added in three fresh processes, transformers' 0.416-0.561; at the held threshold 0.283-0.284
    every time, both sides (2026-12-08, research/long_prompts/memory_probe.py)."""
    import gc

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        libc = None
    if libc is not None and held:
        libc.mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD (glibc's malloc.h); set, it no longer rises
    fn = make(*make_args)
    fn()
    gc.collect()
    if libc is not None:
        libc.malloc_trim(0)  # what the load and the first call freed is not held
    if not peak_rss_reset():
        return None, None
    before = resident_gib()
    fn()
    peak = peak_rss_gib()
    return peak, peak - before


def resident_gib():
    """The process's resident memory now (VmRSS), in GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20  # kB -> GiB


@torch.inference_mode()
def run_decode_cost(model, module, scorers, args, lengths, emit):
    methods = args.methods
    N, k = args.every, PERIODS
    describe(model, args, module, note=f"{k} x every={N} decode steps with eviction per round; plain: {N} steps "
             f"without, from the same C_d slots; window {args.window}")
    for C in lengths:
        ids = random_ids(model, 1, C)
        cache, logits, pos, _ = compress(model, ids, row_scorer("full", args))  # C slots

        def steps(n, evict=None):  # a copy: every round starts from the same C slots
            watch = {} if evict is None else dict(hook=evict.hook, after_step=evict.after_step)
            for _ in decode(model, cache.copy(), logits, pos, n + 1, **watch):  # n forwards
                pass

        def evictor(m):  # a fresh one per round: DecodeEviction keeps a log and (h2o) running sums
            return DecodeEviction(row_scorer(m, args, module, budget=C), N, args.window)

        fns = dict(plain=lambda: steps(N))
        for m in methods:
            fns[m] = lambda m=m: steps(k * N, evictor(m))
        times, _, _ = time_rounds(fns, args.repeats, args.device, f"decode-cost C_d={C}", args.clock)
        plain = med(times["plain"]) / N
        for m in methods:
            over = med([t / (k * N) - p / N for t, p in zip(times[m], times["plain"])])  # paired: drift cancels
            emit(dict(mode="decode-cost", model=model.config.name, method=m, budget=C, every=N, periods=k,
                      plain_ms_tok=plain, ms_tok=med(times[m]) / (k * N), overhead_ms_tok=over,
                      overhead_pct=100 * over / plain, ms_per_eviction=over * N))


def run_train_cost(model, module, scorers, args, lengths, emit):
    """Training's per-sample cost, from the library's pieces: the M rows' forward on the no-grad prompt
    cache + the KL loss + backward (lookahead_pass: what training does), against the whole [prompt; P]
    sequence recorded by autograd (the naive form). The target (answer_attention over a RESPONSE-token
    answer) is made once, untimed: it is the same for both."""
    module = untrained(model).requires_grad_(True)  # training starts from it, in float32
    M, dev = module.n_tokens, args.device
    describe(model, args, note=f"timed per sample: the forward of the M={M} rows + KL loss + backward "
             "(efficient: on the no_grad prompt cache; naive: the whole [prompt; P] sequence with gradients). "
             f"Not timed: the target, the attention of a {RESPONSE}-token answer, the same for both")
    for S in lengths:
        ids = random_ids(model, 1, S + RESPONSE)
        with torch.no_grad():
            cache, _, pos, _ = compress(model, ids[:, :S], row_scorer("full", args))
            gt = answer_attention(model, cache, ids[:, S:], pos, per_query_head=True)  # {layer: (1, H, S)}
            prompt_emb = model.model.embed_tokens(ids[:, :S])  # (1, S, hidden)

        def backward(loss):
            loss.backward()
            module.zero_grad(set_to_none=True)
            return loss.item()

        def efficient():  # gradients reach only the module: the cache was made without them
            return backward(kl_loss(gt, lookahead_pass(model, module, cache, S, per_query_head=True)))

        def naive():  # every op over all S + M rows is recorded: x depends on P as a whole
            x = torch.cat([prompt_emb, module.embeddings.to(prompt_emb.dtype)[None]], dim=1)  # (1, S+M, hidden)
            hook = LookaheadHook(module, S, per_query_head=True)
            model(inputs_embeds=x, positions=torch.arange(S + M, device=dev)[None], hook=hook, logits_at=-1)
            return backward(kl_loss(gt, hook.scores))

        times, peak, loss = time_rounds(dict(efficient=efficient, naive=naive), args.repeats, dev, f"train S={S}",
                                        args.clock)
        sps = {k: 1e3 / med(t) for k, t in times.items()}
        emit(dict(mode="train-cost", model=model.config.name, S=S, efficient_samples_s=sps["efficient"],
                  naive_samples_s=sps["naive"], speedup=sps["efficient"] / sps["naive"],
                  loss_efficient=loss["efficient"], loss_naive=loss["naive"],
                  peak_gib_efficient=peak["efficient"], peak_gib_naive=peak["naive"]))


# -----------------------------------------------------------------------------


def get_args(argv=None):
    p = cli.Parser("-m research.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--mode", default="overhead", choices=list(DEFAULT_LENGTHS))
    a("--model", default=None, help="HF folder (default: weights/SmolLM2-135M-Instruct, prepared if missing)")
    a("--random-init", default=None, metavar="CONFIG", help="a config.json: random weights of that shape instead")
    a("--adapter", default=None, help="lookahead adapter .safetensors (default: the one shipped for the model; "
      "an untrained module where there is none)")
    a("--methods", default=None, help="rows, comma-separated; overhead: any of "
      f"{', '.join(m for m in METHODS if m != 'oracle')}, {', '.join(VARIANTS)} (default {OVERHEAD_ROWS}); "
      f"decode: the evicted caches (default snapkv); decode-cost: any of {', '.join(DECODE_METHODS)} (default all)")
    a("--lengths", default=None, help="prompt lengths, comma-separated (default, CPU / CUDA: "
      + "; ".join(f"{m} {c[0]} / {c[1]}" for m, c in DEFAULT_LENGTHS.items()) + ")")
    a("--budget", type=int, default=128, help="C: KV slots kept per (layer, KV head)")
    a("--window", type=int, default=32, help="the last prompt tokens always kept (snapkv, pyramidkv, h2o, laq); "
      "decode-cost: every method's last slots")
    a("--chunk-size", type=int, default=None, help="prefill chunk length (EvictConfig.chunk_size; default: the "
      "longest that eviction.CHUNK_BYTES of activations allow, one call for SmolLM2 up to ~30K tokens)")
    a("--repeats", type=int, default=5, help="timed rounds after one warm-up round; medians are reported")
    a("--batches", default="1,4,16", help="decode: batch sizes")
    a("--every", type=int, default=32, help="decode-cost: evict each time the cache holds C_d + every slots")
    a("--h2o-max-len", type=int, default=None, help="skip h2o above this prompt length, >= 1 (--quick: 16384)")
    a("--quick", action="store_true", help="the CUDA preset described at the top")
    a("--device", default=cli.default_device())
    a("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
      help="model dtype (default: bfloat16 on CUDA, float32 on CPU, where bfloat16 matmuls are ~60x slower)")
    a("--threads", type=int, default=None, help="torch threads, >= 1 (default: torch's choice)")
    a("--clock", default="wall", choices=["wall", "cpu"], help="CPU timing: wall time, or this process's CPU "
      "time (with --threads 1 the time slices other jobs take from a shared machine do not count)")
    a("--json", default=None, metavar="OUT", help="add every row to this .json file (made if missing; the rows "
      "of earlier runs in it are kept)")
    a("--markdown", action="store_true", help="print markdown tables")
    return p.parse_args(argv)


def check_args(args):
    """Every check that needs no model, and every row's scorer that needs no adapter: a bad value stops
    before anything loads. Fills in the defaults that depend on the mode and the device."""
    cli.check_device(args.device)
    cli.check_model_dir(args.model)
    cuda = torch.device(args.device).type == "cuda"
    if args.quick and not cuda:
        raise ValueError("--quick is the GPU preset (8B shapes at 8K-32K); on CPU run e.g. "
                         "python -m research.bench --mode overhead --lengths 1024,2048")
    for flag, value, lo in [("--budget", args.budget, 1), ("--chunk-size", args.chunk_size, 1),
                            ("--repeats", args.repeats, 1), ("--every", args.every, 1), ("--window", args.window, 0),
                            ("--threads", args.threads, 1)]:
        if value is not None and value < lo:  # None: the default (torch's threads)
            raise ValueError(f"{flag} {value}: must be at least {lo}")
    cli.check_threads("--threads", args.threads)  # at most the cores: above them every op waits
    if args.h2o_max_len is not None and args.h2o_max_len < 1:  # h2o would be skipped at every length
        raise ValueError(f"--h2o-max-len {args.h2o_max_len}: must be at least 1 (h2o is skipped above this prompt "
                         "length); to leave h2o out altogether, drop it from --methods")
    if args.quick:  # after the flags' own checks: the preset fills in what was not given
        quick(args)
    args.batches = cli.counts(args.batches, "--batches")
    # "" is a slip, not the default: counts() refuses it
    args.lengths = (cli.counts(args.lengths, "--lengths") if args.lengths is not None
                    else DEFAULT_LENGTHS[args.mode][cuda])
    if isinstance(args.methods, str) and not [m for m in args.methods.split(",") if m.strip()]:
        # "" is not "the default rows": it names none (an empty variable in a script), and was run as every default
        raise ValueError(f"--methods {args.methods!r} names no row: name some, or leave --methods out for the default")
    if isinstance(args.methods, str) or args.methods is None:
        args.methods = [m.strip() for m in (args.methods or DEFAULT_METHODS.get(args.mode, "")).split(",") if m.strip()]
    allowed = (list(DECODE_METHODS) if args.mode == "decode-cost"
               else [m for m in METHODS if m != "oracle"] + list(VARIANTS))
    bad = [m for m in args.methods if m not in allowed]
    if bad:
        raise ValueError(f"--methods {','.join(bad)}: not a row of --mode {args.mode}; choose from {', '.join(allowed)}"
                         + (" (oracle needs the full-cache answer: not a speed row)" if "oracle" in bad else ""))
    if args.mode == "decode-cost" and not args.methods:
        raise ValueError(f"--mode decode-cost times {', '.join(DECODE_METHODS)}: pick some with --methods")
    if args.adapter and (args.random_init or args.quick):
        raise ValueError("--adapter: a --random-init (or --quick) model has random weights, which no trained adapter "
                         "fits; drop --adapter (an untrained module of the same shapes is timed)")
    for flag, path in [("--adapter", args.adapter), ("--random-init", args.random_init)]:
        if path is not None:
            cli.input_file(flag, path)
    if args.json is not None:  # "" is a slip, not "no --json"
        cli.output_file("--json", args.json, ".json")
        earlier_rows(Path(args.json))
    # the rows' own checks (budget against window and sinks, a rule a method refuses) before any model:
    # every row that needs no adapter now, the lookahead rows once their adapter is read
    for name in args.methods if args.mode in ("overhead", "decode") else []:
        if row_config(name, args).method != "lookahead":
            row_scorer(name, args)
    if args.mode == "decode-cost":
        for C in args.lengths:
            for m in args.methods:
                if m != "lookahead":
                    DecodeEviction.check(row_scorer(m, args, budget=C), args.every, args.window)
                elif C <= args.window:
                    raise ValueError(f"decode budget {C} leaves no room to choose: it always keeps the last "
                                     f"{args.window} slots; use a budget > {args.window} or a smaller window")
    for config_path, lengths in jobs_of(args):  # each model whose config.json is here already (the default
        # model may be prepared only when it loads: run() checks it then)
        cfg = job_config(args, config_path, prepare=False)
        if cfg is not None:
            check_fits(args, cfg, lengths, random_init=bool(config_path))
        if config_path:  # a random model's weights within memory, counted from its config, before it is built
            check_memory(cfg, config_path, args.device, getattr(torch, args.dtype) if args.dtype
                         else default_dtype(args.device))
    args.clock = time.process_time if args.clock == "cpu" else time.perf_counter  # CUDA: events either way


def main(argv=None):
    return cli.run(lambda: bench(get_args(argv)))


def bench(args):
    check_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    return run(args, jobs_of(args))


def quick(args):
    """The GPU preset: sets args, returns the (config, lengths) jobs."""
    args.mode, args.repeats = "overhead", 5
    args.h2o_max_len = 16384 if args.h2o_max_len is None else args.h2o_max_len
    args.methods = list(QUICK_ROWS)
    return QUICK


def jobs_of(args):
    """[(config.json of a random model, or None for the checkpoint --model, lengths)]: what run() measures."""
    return QUICK if args.quick else [(args.random_init, args.lengths)]


# -----------------------------------------------------------------------------
# Lengths against the model's context, read from config.json before the model loads


def job_config(args, config_path, prepare=True):
    """The ModelConfig of a job: its --random-init config, or the checkpoint's config.json (the default model
    is prepared first when prepare, else None while it is not there)."""
    if config_path:
        cfg = ModelConfig.from_hf_config(config_path)
        cfg.name = Path(config_path).stem  # as random_model names it
        return cfg
    if prepare:
        return ModelConfig.from_hf_config(cli.resolve_model(args.model))
    from weights.prepare import DEFAULT_DIR  # cli.resolve_model's default, without preparing it

    folder = Path(args.model) if args.model else DEFAULT_DIR
    return ModelConfig.from_hf_config(folder) if (folder / "config.json").is_file() else None


def lookahead_tokens(args, cfg, random_init):
    """M, the lookahead rows the run appends after the prompt: 0 without a lookahead row; the adapter's
    n_tokens (its .json); an untrained module's (lookaheadkv.untrained_module's default: random weights, train-cost,
    or a model without an adapter)."""
    untrained_m = inspect.signature(untrained_module).parameters["n_tokens"].default
    if args.mode == "train-cost":
        return untrained_m
    if args.mode == "prefill-vs-hf" or not any(row_config(m, args).method == "lookahead" or m == "full+M"
                                               for m in args.methods):
        return 0
    path = None if random_init else adapter_path(cfg, args)
    if path is None:
        return untrained_m
    try:
        return int(json.loads(path.with_suffix(".json").read_text())["n_tokens"])
    except (OSError, ValueError, KeyError, TypeError):  # an adapter load_adapter will refuse, in its own words
        return untrained_m


def appended(args, M):
    """(positions a row uses past its --lengths value, what they are), per mode."""
    parts = {"overhead": [(M, "lookahead rows")], "decode": [(max(M, NEW_TOKENS), "decode steps or lookahead rows")],
             "prefill-vs-hf": [], "train-cost": [(max(M, RESPONSE), "answer tokens or lookahead rows")],
             "decode-cost": [(PERIODS * args.every, f"decode steps ({PERIODS} x --every)"), (M, "lookahead rows")]}
    parts = [(n, what) for n, what in parts[args.mode] if n]
    return sum(n for n, _ in parts), " + ".join(f"{n} {what}" for n, what in parts)


def check_fits(args, cfg, lengths, random_init):
    """Every length, with what is appended after it, within cfg's context (max_position_embeddings): past it
    RoPE runs at positions the model never saw, and a 100K prefill on an 8K model runs until killed."""
    extra, what = appended(args, lookahead_tokens(args, cfg, random_init))
    ctx = cfg.max_context
    flag = "--lengths (the decode budgets C_d)" if args.mode == "decode-cost" else "--lengths"
    fix = (f"use lengths up to {ctx - extra}" if ctx > extra else "lower --every" if args.mode == "decode-cost"
           else "time a model with a longer context")
    for n in lengths:
        if n + extra > ctx:
            plus = f" + {what}" if extra else ""
            raise ValueError(f"{flag} {n}{plus} = {n + extra} positions, past {cfg.name}'s context of "
                             f"{cli.context_words(cfg, ' (max_position_embeddings in its config.json)')}: {fix}")


# -----------------------------------------------------------------------------
# --json: every run's rows kept


def earlier_rows(path):
    """The rows of an earlier bench.py output at --json ([] where there is none); a file of another kind is
    refused (ValueError), and never changed."""
    if not path.exists():
        return []
    try:
        old = json.loads(path.read_text())
        ours = (isinstance(old, dict) and set(old) == {"torch", "rows"} and isinstance(old["rows"], list)
                and all(isinstance(r, dict) for r in old["rows"]))
    except (ValueError, OSError):
        ours = False
    if not ours:
        raise ValueError(f"--json {path} exists and is not a bench.py output: pass a new name, or move it away")
    return [r if "torch" in r else {**r, "torch": old["torch"]} for r in old["rows"]]  # each row says its torch


def check_same_makers(args, name):
    """--json's earlier rows of the model `name` were made on these weights and this adapter (args.made_by), or
    ValueError naming the file: rows of one name from two checkpoints (or two adapters) would sit side by side
    in one table as if one model made them. Rows of other models (the --quick preset's two) stay welcome."""
    if not args.json:
        return
    for row in earlier_rows(Path(args.json)):
        if row.get("model") != name:
            continue
        for key, now in args.made_by.items():
            if key in row and row[key] != now:
                raise ValueError(f"--json {args.json} holds rows of {name} made with another "
                                 f"{key.removesuffix('_id')} ({key} {row[key]}, this run's is {now}): pass "
                                 "another --json, or move that one away")


def add_row(path, row):
    """Add one row to --json: its rows are read again (another run may have added some since) and the whole
    written to a temporary file that then replaces it (os.replace, atomic): a kill mid-write leaves it whole."""
    rows = earlier_rows(path) + [row]
    files.write_atomic(path, json.dumps(dict(torch=torch.__version__, rows=rows), indent=1))  # a temporary of its
    # own, then os.replace; a full disk one `error:` line


def run(args, jobs):
    cuda = torch.device(args.device).type == "cuda"
    rows = []

    def emit(row):
        row["torch"] = torch.__version__  # --json keeps the rows of several runs
        row.update(getattr(args, "made_by", {}))  # and each says the weights and the adapter that made it
        rows.append(row)
        print_line([row.get(k) for k, _ in COLUMNS[args.mode]], args)
        if args.json:  # added at once: a killed run keeps what it measured
            add_row(Path(args.json), row)

    runs = {"overhead": run_overhead, "decode": run_decode, "train-cost": run_train_cost,
            "decode-cost": run_decode_cost}
    for config_path, lengths in jobs:
        check_fits(args, job_config(args, config_path), lengths, random_init=bool(config_path))  # before it loads
        if args.mode == "prefill-vs-hf":
            run_prefill_vs_hf(args, lengths, emit)
            continue
        lookahead = args.mode != "train-cost" and any(row_config(m, args).method == "lookahead" for m in args.methods)
        model, module, scorers = setup(args, config_path, lookahead)
        runs[args.mode](model, module, scorers, args, lengths, emit)
        del model, module, scorers  # before the next model: two 8B models need not fit at once
        if cuda:
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    KEPT_MEMORY = keep_freed_memory()  # the whole process, so only when run as a script (not under pytest)
    main()
