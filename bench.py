"""
Speed of LookaheadKV and the baselines, printed as RATIOS: medians over --repeats rounds after
one warm-up round (CUDA: torch.cuda.Event; CPU: wall time, or --clock cpu). Five modes:

    python bench.py --mode overhead --lengths 1024,2048 --budget 128  # eviction cost / prefill
    python bench.py --mode decode                      # decode tok/s, evicted vs full cache
    python bench.py --mode prefill-vs-hf               # our prefill / transformers' (SDPA)
    python bench.py --mode train-cost                  # training: M-row pass vs whole sequence
    python bench.py --mode decode-cost --lengths 128,512 --every 32   # beyond the paper: below
    python bench.py --quick --json out/bench.json      # the H200 preset, about 2-3 minutes

Without --model it loads weights/SmolLM2-135M-Instruct; --random-init configs/llama-3.1-8b.json
builds that shape with random weights (bf16 on CUDA): timing needs no trained weights. --quick
(CUDA only): overhead, repeats 5, Llama-3.1-8B shape at 8K and 32K, Qwen3-8B at 8K; h2o skipped
above 16K (it scores with every prompt query: S x S work in row chunks); "full-1chunk" is the
prefill in one chunk instead of chunks of --chunk-size. Rows print as they are measured and
--json OUT is rewritten after each (a killed run keeps them); --markdown prints markdown.
overhead = median over rounds of (method - full) timed in the same round: drift cancels.
On a shared CPU, --threads 1 --clock cpu counts only this process's CPU time (+-4% of noise
remains per round). RESULTS.md gives each measured table with the command that made it.

decode-cost (beyond the paper: decode_eviction.DecodeEviction): what holding the cache to C_d while decoding
costs per generated token. --lengths are the decode budgets C_d here: the cache starts with C_d slots (a
random prompt of C_d tokens, prefilled whole) and every method decodes periods x every tokens, evicting back
to C_d each time it holds C_d + every slots, so its forwards see C_d + 1 .. C_d + every slots over and over.
"plain" is decode() without eviction over one such period (every tokens from C_d slots): the same cache
sizes, no scoring. overhead per token = method's ms per token - plain's; per eviction = that x every.
The lookahead refresh is one M-row forward per eviction (lookahead_pass). On the GPU with the 8B shapes:
python bench.py --mode decode-cost --random-init configs/llama-3.1-8b.json --lengths 512,4096
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from decode_eviction import DECODE_METHODS, DecodeEviction
from lookaheadkv import METHODS, EvictConfig, LookaheadHook, LookaheadModule, compress, decode, untrained_module
from model import ModelConfig, Transformer, check_device, check_model_dir, default_dtype, load_model, resolve_model

# row name -> EvictConfig fields; any other name in lookaheadkv.METHODS runs as itself
VARIANTS = {
    "lookahead": dict(method="lookahead", one_pass=True),  # the M rows ride along in the prefill
    "lookahead-2pass": dict(method="lookahead", one_pass=False),  # a 2nd forward of the M rows
    # top-C of the raw scores: no surprisal to compute (the span rule's cost is lookahead minus this row)
    "lookahead-unpooled": dict(method="lookahead", one_pass=True, pool="none", kernel=1),
    "full-1chunk": dict(method="full", chunk_size=1 << 30),  # prefill in one chunk (a diagnostic)
}
DEFAULT_LENGTHS = {"overhead": ([1024, 2048], [8192, 32768]), "decode": ([1024], [8192]),  # (CPU, CUDA)
                   "prefill-vs-hf": ([1024, 2048], [1024, 2048]), "train-cost": ([1024], [1024]),
                   "decode-cost": ([128, 512], [512, 4096])}  # decode-cost: the decode budgets C_d
CONFIGS = Path(__file__).resolve().parent / "configs"
QUICK = [(CONFIGS / "llama-3.1-8b.json", [8192, 32768]), (CONFIGS / "qwen3-8b.json", [8192])]
COLUMNS = {  # mode -> (row key, header) of the printed table; --json has every key
    "overhead": [("method", "method"), ("S", "S"), ("prefill_ms", "prefill ms"), ("total_ms", "total ms"),
                 ("overhead_ms", "overhead ms"), ("overhead_pct", "overhead %"), ("kv_mib", "KV MiB"),
                 ("full_kv_mib", "full KV MiB"), ("peak_gib", "peak GiB")],
    "decode": [("method", "method"), ("S", "S"), ("batch", "batch"), ("full_tok_s", "full tok/s"),
               ("evicted_tok_s", "evicted tok/s"), ("speedup", "evicted / full"), ("kv_mib", "KV MiB"),
               ("full_kv_mib", "full KV MiB")],
    "prefill-vs-hf": [("S", "S"), ("ours_ms", "ours ms"), ("hf_ms", "transformers ms"), ("ratio", "ours / theirs"),
                      ("logits_diff", "max |logits diff|")],
    "train-cost": [("S", "S"), ("answer_target_s_per_sample", "answer+target s/sample"),
                   ("epoch_samples_s", "epoch samples/s (batched)"),
                   ("recompute_samples_s", "recomputing the cache"), ("cached_vs_recompute", "cached / recomputed"),
                   ("efficient_samples_s", "efficient samples/s"), ("naive_samples_s", "naive samples/s"),
                   ("speedup", "efficient / naive"), ("loss_efficient", "loss efficient"),
                   ("loss_naive", "loss naive")],
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


def time_rounds(fns, repeats, device, desc="", clock=time.perf_counter):
    """One warm-up round, then `repeats` rounds calling every fn of {name: fn} in turn.
    Returns {name: [ms per round]}, {name: peak GiB}, {name: last result}. Peak: on CUDA the
    allocator's peak during the call; on CPU (Linux) the process's peak RSS during the call, which
    includes the weights and Python (None where /proc cannot be reset)."""
    cuda = torch.device(device).type == "cuda"
    times, peak, out = {n: [] for n in fns}, {n: None for n in fns}, {}
    for r in tqdm(range(repeats + 1), desc=desc, leave=False):
        for n, fn in fns.items():
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
# Models and setup


def random_model(config_path, device, dtype=None):
    """config.json's shape with random weights (normal std 0.02, norms 1): built on meta and
    materialised once on `device`, so an 8B model never exists in float32 on the CPU."""
    cfg = ModelConfig.from_hf_config(config_path)
    cfg.name = Path(config_path).stem
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to(dtype or default_dtype(device)).to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty makes new Parameters: tie the head again
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    return model.requires_grad_(False).eval()


def get_model(args, config_path):
    dtype = getattr(torch, args.dtype) if args.dtype else None
    if config_path:
        return random_model(config_path, args.device, dtype)
    args.model = str(resolve_model(args.model))
    return load_model(args.model, args.device, dtype)


def get_module(model, args):
    """--adapter, or an untrained module (random P, LoRA B = 0): same shapes, same FLOPs, same time."""
    if args.adapter:
        return LookaheadModule.load(args.adapter, model.config, args.device)
    torch.manual_seed(args.seed)
    return untrained_module(model)  # the shipped configuration: LoRA on all seven projections


def random_ids(model, B, S, seed):  # timing only: the tokens do not matter
    ids = torch.randint(0, model.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(seed))
    return ids.to(model.lm_head.weight.device)


def evict_config(name, args, module):
    """A row's EvictConfig; pooling is each scorer's own (lookahead: the adapter's)."""
    f = VARIANTS.get(name, dict(method=name))
    return EvictConfig(**{"budget": args.budget, "chunk_size": args.chunk_size, **f})


def describe(model, args, module=None, note=None):
    """The run's conditions, then the table header (rows follow as they are measured)."""
    dt = next(model.parameters()).dtype
    print(f"\n{model.config.name}  {args.device} {str(dt)[6:]}  threads {torch.get_num_threads()}  budget {args.budget}"
          f"  repeats {args.repeats}  clock {args.clock.__name__}  torch {torch.__version__}")
    if module is not None:
        kind = f"adapter {args.adapter}" if args.adapter else "untrained LookaheadModule"
        print(f"lookahead rows: {kind} (M={module.n_tokens}, LoRA {','.join(module.targets)} r={module.rank}): "
              "timing does not depend on training")
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
        w = [16 if k == "method" else max(len(h), 8) for k, h in COLUMNS[args.mode]]
        print("  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(cells)))


# -----------------------------------------------------------------------------
# Modes: each passes its rows (one dict per table line) to emit()


@torch.inference_mode()
def run_overhead(model, args, lengths, emit):
    module = get_module(model, args)
    skip = [S for S in lengths if "h2o" in args.methods and args.h2o_max_len and S > args.h2o_max_len]
    describe(model, args, module, note=skip and f"h2o skipped at S = {skip} (> --h2o-max-len): it scores with "
             "every prompt query, S x S work in row chunks, several times the prefill at such lengths")
    for S in lengths:
        ids = random_ids(model, 1, S, args.seed)
        fns = {}
        for name in ["full"] + [m for m in args.methods if m != "full"]:  # full: the baseline of every row
            if name == "h2o" and S in skip:
                continue
            eviction = evict_config(name, args, module)
            # the returned cache is freed at once: only the eviction's work is timed
            fns[name] = lambda eviction=eviction: compress(model, ids, eviction, module=module)[0].nbytes()
        times, peak, kv = time_rounds(fns, args.repeats, args.device, f"overhead S={S}", args.clock)
        prefill = med(times["full"])
        for name in [m for m in fns if m in args.methods]:
            over = med([t - f for t, f in zip(times[name], times["full"])])  # paired: drift cancels
            emit(dict(mode="overhead", model=model.config.name, method=name, S=S, budget=args.budget,
                      prefill_ms=prefill, total_ms=med(times[name]), overhead_ms=over,
                      overhead_pct=100 * over / prefill, kv_mib=kv[name] / 2**20, full_kv_mib=kv["full"] / 2**20,
                      peak_gib=peak[name]))


@torch.inference_mode()
def run_decode(model, args, lengths, emit):
    module = get_module(model, args) if args.decode_method == "lookahead" else None
    n = args.new_tokens
    describe(model, args, module, note=f"{n} greedy decode steps per batch, after the prefill (untimed)")
    for S in lengths:
        for B in args.batches:
            ids = random_ids(model, B, S, args.seed)
            states = dict(full=compress(model, ids, EvictConfig("full", chunk_size=args.chunk_size)),
                          evicted=compress(model, ids, evict_config(args.decode_method, args, module), module=module))

            def steps(st):  # n forward steps: the first token comes from the prefill's logits
                cache, logits, pos, _ = st
                for _ in decode(model, cache.copy(), logits, pos, n + 1):  # a copy: the state is reused
                    pass

            fns = {k: (lambda st=st: steps(st)) for k, st in states.items()}
            times, _, _ = time_rounds(fns, args.repeats, args.device, f"decode S={S} B={B}", args.clock)
            tok_s = {k: B * n / (med(t) / 1e3) for k, t in times.items()}
            emit(dict(mode="decode", model=model.config.name, method=args.decode_method, S=S, batch=B,
                      budget=args.budget, full_tok_s=tok_s["full"], evicted_tok_s=tok_s["evicted"],
                      speedup=tok_s["evicted"] / tok_s["full"], full_kv_mib=states["full"][0].nbytes() / 2**20,
                      kv_mib=states["evicted"][0].nbytes() / 2**20))
            del states


@torch.inference_mode()
def run_prefill_vs_hf(args, lengths, emit):
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise ValueError("--mode prefill-vs-hf needs transformers (pip install transformers), "
                         "a test/bench dependency only")
    if args.random_init:
        raise ValueError("--mode prefill-vs-hf compares real checkpoints: drop --random-init")
    ours = get_model(args, None).float()
    theirs = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa").to(args.device).float().eval()
    describe(ours, args, note="both float32, torch.inference_mode, same threads, last token's logits only "
             "(transformers: logits_to_keep=1), each building its KV cache")
    for S in lengths:
        ids = random_ids(ours, 1, S, args.seed)
        fns = dict(ours=lambda: compress(ours, ids, EvictConfig("full", chunk_size=args.chunk_size))[1],
                   transformers=lambda: theirs(input_ids=ids, logits_to_keep=1).logits[:, -1])
        times, _, out = time_rounds(fns, args.repeats, args.device, f"prefill S={S}", args.clock)
        t_ours, t_hf = med(times["ours"]), med(times["transformers"])
        emit(dict(mode="prefill-vs-hf", model=ours.config.name, S=S, ours_ms=t_ours, hf_ms=t_hf, ratio=t_ours / t_hf,
                  logits_diff=(out["ours"] - out["transformers"]).abs().max().item()))


@torch.inference_mode()
def run_decode_cost(model, args, lengths, emit):
    methods = [m for m in args.methods if m in DECODE_METHODS]
    if not methods:
        raise ValueError(f"--mode decode-cost times {', '.join(DECODE_METHODS)}: pick some with --methods")
    module = get_module(model, args) if "lookahead" in methods else None
    N, k = args.every, args.periods
    describe(model, args, module, note=f"{k} x every={N} decode steps with eviction per round; plain: {N} steps "
             f"without, from the same C_d slots; window {args.window}")
    for C in lengths:
        ids = random_ids(model, 1, C, args.seed)
        cache, logits, pos, _ = compress(model, ids, EvictConfig("full", chunk_size=args.chunk_size))  # C slots

        def steps(n, evict=None):  # a copy: every round starts from the same C slots
            watch = {} if evict is None else dict(hook=evict.hook, after_step=evict.after_step)
            for _ in decode(model, cache.copy(), logits, pos, n + 1, **watch):  # n forwards
                pass

        for m in methods:  # its checks (window, every) before any timing
            DecodeEviction(m, C, N, args.window, module)
        fns = dict(plain=lambda: steps(N))
        for m in methods:
            fns[m] = lambda m=m: steps(k * N, DecodeEviction(m, C, N, args.window, module))
        times, _, _ = time_rounds(fns, args.repeats, args.device, f"decode-cost C_d={C}", args.clock)
        plain = med(times["plain"]) / N
        for m in methods:
            over = med([t / (k * N) - p / N for t, p in zip(times[m], times["plain"])])  # paired: drift cancels
            emit(dict(mode="decode-cost", model=model.config.name, method=m, budget=C, every=N, periods=k,
                      plain_ms_tok=plain, ms_tok=med(times[m]) / (k * N), overhead_ms_tok=over,
                      overhead_pct=100 * over / plain, ms_per_eviction=over * N))


def run_train_cost(model, args, lengths, emit):
    from train import batch_loss, ground_truth, kl_loss

    module = get_module(model, args).requires_grad_(True)
    M, dev = module.n_tokens, args.device
    describe(model, args, module, note=f"timed per sample: the forward of the M={M} rows + KL loss + backward "
             "(efficient: on the no_grad prompt cache; naive: the whole [prompt; P] sequence with gradients). "
             f"Not timed: the ground-truth pass over [prompt; {args.response_tokens}-token answer], the same for both")
    for S in lengths:
        ids = random_ids(model, 1, S + args.response_tokens, args.seed)[0].tolist()
        cache, gt, _ = ground_truth(model, dict(prompt_ids=ids[:S], response_ids=ids[S:]))
        with torch.no_grad():
            prompt_emb = model.model.embed_tokens(torch.tensor([ids[:S]], device=dev))  # (1, S, hidden)

        def backward(loss):
            loss.backward()
            module.zero_grad(set_to_none=True)
            return loss.item()

        def efficient():
            return backward(batch_loss(model, module, cache, gt, S))

        def naive():  # every op over all S + M rows is recorded: x depends on P as a whole
            with torch.enable_grad():
                x = torch.cat([prompt_emb, module.embeddings.to(prompt_emb.dtype)[None]], dim=1)  # (1, S+M, hidden)
                hook = LookaheadHook(module, S, per_query_head=True)
                model(inputs_embeds=x, positions=torch.arange(S + M, device=dev)[None], hook=hook, logits_at=-1)
                return backward(kl_loss(gt, hook.scores))

        fns = dict(efficient=efficient, naive=naive)
        times, peak, loss = time_rounds(fns, args.repeats, dev, f"train S={S}", args.clock)
        sps = {k: 1e3 / med(t) for k, t in times.items()}
        stages = train_stages(model, module, args, S)
        emit(dict(mode="train-cost", model=model.config.name, S=S, efficient_samples_s=sps["efficient"],
                  naive_samples_s=sps["naive"], speedup=sps["efficient"] / sps["naive"],
                  loss_efficient=loss["efficient"], loss_naive=loss["naive"],
                  peak_gib_efficient=peak["efficient"], peak_gib_naive=peak["naive"], **stages))


def train_stages(model, module, args, S):
    """train.py's own stages at prompt length S: answering + target (--gen-batch prompts prefilled
    once, together; greedy answers of --response-tokens tokens: random prompts never stop early),
    then training steps over the cached samples (--micro-batch samples per lookahead forward, read
    from disk as train.py does), and the same steps with each sample's prompt cache recomputed by a
    prefill instead of read from disk (what keeping only ids, answers and targets would cost per epoch).
    Returns seconds per sample answered, training samples per second cached and recomputed."""
    import tempfile

    from train import answer_and_target, batch_loss, load_batch, prompt_cache, save_sample

    class NoStop:
        stop_ids = set()

    prompts = [random_ids(model, 1, S, args.seed + 1 + b)[0].tolist() for b in range(args.gen_batch)]
    t = args.clock()
    samples = answer_and_target(model, NoStop(), prompts, args.response_tokens)
    answer_s = (args.clock() - t) / len(prompts)
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(tmp) / f"{i}.safetensors" for i in range(len(samples))]
        for path, sample in zip(paths, samples):
            save_sample(path, sample, torch.bfloat16)
        batch = (paths * args.micro_batch)[:args.micro_batch]

        def step():  # what one micro-batch of a training epoch costs, disk read included
            cache, gt, lengths = load_batch(batch, args.device, next(model.parameters()).dtype)
            loss = batch_loss(model, module, cache, gt, lengths)
            loss.backward()
            module.zero_grad(set_to_none=True)
            return loss.item()

        def recompute():  # the same step, the prompt caches made by a no-grad prefill instead of read from disk
            cache = prompt_cache(model, [prompts[i % len(prompts)] for i in range(args.micro_batch)])
            _, gt, lengths = load_batch(batch, args.device, next(model.parameters()).dtype)
            loss = batch_loss(model, module, cache, gt, lengths)
            loss.backward()
            module.zero_grad(set_to_none=True)
            return loss.item()

        times, _, _ = time_rounds(dict(step=step, recompute=recompute), args.repeats, args.device,
                                  f"epoch step S={S}", args.clock)
    return dict(answer_target_s_per_sample=answer_s, epoch_samples_s=args.micro_batch * 1e3 / med(times["step"]),
                recompute_samples_s=args.micro_batch * 1e3 / med(times["recompute"]),
                cached_vs_recompute=med(times["recompute"]) / med(times["step"]))


# -----------------------------------------------------------------------------


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--mode", default="overhead", choices=list(DEFAULT_LENGTHS))
    a("--model", default=None, help="HF folder (default: weights/SmolLM2-135M-Instruct, prepared if missing)")
    a("--random-init", default=None, metavar="CONFIG", help="a config.json: random weights of that shape instead")
    a("--adapter", default=None, help="lookahead adapter .safetensors (default: an untrained module, same speed)")
    a("--methods", default=None,
      help=f"overhead rows, any of: {', '.join(m for m in METHODS if m != 'oracle')}, {', '.join(VARIANTS)} (default "
      f"full,snapkv,h2o,laq,lookahead,lookahead-unpooled,lookahead-2pass); decode-cost rows: {', '.join(DECODE_METHODS)} (default all)")
    a("--lengths", default=None, help="prompt lengths, comma-separated (default, CPU / CUDA: "
      + "; ".join(f"{m} {c[0]} / {c[1]}" for m, c in DEFAULT_LENGTHS.items()) + ")")
    a("--budget", type=int, default=128, help="C: KV slots kept per (layer, KV head)")
    a("--chunk-size", type=int, default=4096, help="prefill chunk length (EvictConfig.chunk_size)")
    a("--repeats", type=int, default=5, help="timed rounds after one warm-up round; medians are reported")
    a("--batches", default="1,4,16", help="decode: batch sizes")
    a("--new-tokens", type=int, default=32, help="decode: steps timed")
    a("--decode-method", default="snapkv", choices=["snapkv", "lookahead"], help="decode: the evicted cache")
    a("--every", type=int, default=32, help="decode-cost: evict each time the cache holds C_d + every slots")
    a("--periods", type=int, default=4, help="decode-cost: evictions timed per round (periods x every tokens)")
    a("--window", type=int, default=32, help="decode-cost: the last slots always kept")
    a("--response-tokens", type=int, default=128, help="train-cost: answer length of the ground truth")
    a("--gen-batch", type=int, default=8, help="train-cost: prompts answered together (train.py --gen-batch)")
    a("--micro-batch", type=int, default=8, help="train-cost: samples per lookahead forward (train.py --micro-batch)")
    a("--h2o-max-len", type=int, default=None, help="skip h2o above this prompt length (--quick: 16384)")
    a("--quick", action="store_true", help="the CUDA preset described at the top")
    a("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
      help="model dtype (default: bfloat16 on CUDA, float32 on CPU, where bfloat16 matmuls are ~60x slower)")
    a("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    a("--clock", default="wall", choices=["wall", "cpu"], help="CPU timing: wall time, or this process's CPU "
      "time (with --threads 1 the time slices other jobs take from a shared machine do not count)")
    a("--seed", type=int, default=0)
    a("--json", default=None, metavar="OUT", help="write every row to this JSON file")
    a("--markdown", action="store_true", help="print markdown tables")
    args = p.parse_args(argv)
    if args.methods is None:  # each mode's rows
        decode_cost = args.mode == "decode-cost"
        args.methods = (",".join(DECODE_METHODS) if decode_cost
                        else "full,snapkv,h2o,laq,lookahead,lookahead-unpooled,lookahead-2pass")
    args.methods = args.methods.split(",")
    bad = [m for m in args.methods if m not in VARIANTS and (m not in METHODS or m == "oracle")]
    if bad:
        p.error(f"unknown methods {bad} (oracle needs the full-cache answer: not a speed row)")
    args.batches = parse_counts(args.batches, "--batches")
    args.lengths = parse_counts(args.lengths, "--lengths") if args.lengths else None
    args.clock = time.process_time if args.clock == "cpu" else time.perf_counter  # CUDA: events either way
    return args


def parse_counts(text, flag):
    """"1,4,16" -> [1, 4, 16]; ValueError unless every entry is a whole number >= 1."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated whole numbers, e.g. 1024,2048") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} {text!r}: every value must be at least 1")
    return values


def check_args(args):
    """Every check that needs no model: a bad value stops before anything loads."""
    check_device(args.device)
    check_model_dir(args.model)
    at_least = [("--budget", args.budget, 1), ("--chunk-size", args.chunk_size, 1), ("--repeats", args.repeats, 1),
                ("--new-tokens", args.new_tokens, 1), ("--every", args.every, 1), ("--periods", args.periods, 1),
                ("--window", args.window, 0), ("--response-tokens", args.response_tokens, 1),
                ("--gen-batch", args.gen_batch, 1), ("--micro-batch", args.micro_batch, 1),
                ("--threads", args.threads or 1, 1), ("--h2o-max-len", args.h2o_max_len or 1, 1)]
    for flag, value, lo in at_least:
        if value < lo:
            raise ValueError(f"{flag} {value}: must be at least {lo}")
    for flag, path in [("--adapter", args.adapter), ("--random-init", args.random_init)]:
        if path is not None and not Path(path).is_file():
            raise FileNotFoundError(f"{flag} {path} not found")


def main(argv=None):
    try:
        args = get_args(argv)
        check_args(args)
        return bench(args)
    except (ValueError, OSError) as e:  # library errors: one line that says what to do, no traceback
        raise SystemExit(f"error: {e}")


def bench(args):
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.device(args.device).type == "cuda"
    if args.quick:
        if not cuda:
            raise ValueError("--quick is the GPU preset (8B shapes at 8K-32K); on CPU run e.g. "
                             "python bench.py --mode overhead --lengths 1024,2048")
        jobs = quick(args)
    else:
        lengths = args.lengths or DEFAULT_LENGTHS[args.mode][cuda]
        jobs = [(args.random_init, lengths)]
    return run(args, jobs)


def quick(args):
    """The GPU preset: sets args, returns the (config, lengths) jobs."""
    args.mode, args.repeats, args.h2o_max_len = "overhead", 5, args.h2o_max_len or 16384
    args.methods = ["full", "full-1chunk", "snapkv", "h2o", "laq", "lookahead", "lookahead-unpooled", "lookahead-2pass"]
    return QUICK


def run(args, jobs):
    cuda = torch.device(args.device).type == "cuda"
    rows = []

    def emit(row):
        rows.append(row)
        print_line([row.get(k) for k, _ in COLUMNS[args.mode]], args)
        if args.json:  # rewritten after every row: a killed run keeps what it measured
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(dict(torch=torch.__version__, rows=rows), indent=1))

    runs = {"overhead": run_overhead, "decode": run_decode, "train-cost": run_train_cost,
            "decode-cost": run_decode_cost}
    for config_path, lengths in jobs:
        if args.mode == "prefill-vs-hf":
            run_prefill_vs_hf(args, lengths, emit)
            continue
        model = get_model(args, config_path)
        runs[args.mode](model, args, lengths, emit)
        del model  # before the next model: two 8B models need not fit at once
        if cuda:
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    main()
