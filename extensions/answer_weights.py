"""
Beyond the paper: a training target weighted toward the answer tokens that depend on the prompt.

The paper's target is the plain mean of the attention of ALL the answer's tokens over the prompt. Many of
them (the chat format, function words, the rest of a phrase) are predicted as well from the prompt's first
and last few tokens alone; the answer KL that every method is judged by is carried by the others. This
target weighs each answer query t by how much its prediction needs the prompt's body:

    d_t = KL( p(. | whole prompt, answer<=t) || p(. | sink + last WINDOW prompt tokens, answer<=t) )
    w_t = 0.75 * d_t / mean(d) + 0.25            (every token keeps a quarter of the mean's pull)
    target = sum_t w_t * attn_t / sum_t w_t      (attn_t: query t's attention over the prompt, per layer
                                                  and query head: lookaheadkv.AnswerHook's, weighted)

d_t is the answer KL's own measure (metrics.answer_kl) for a cache that keeps no prompt body at all. The
answer's last query (its stop token) predicts past the answer: it gets the floor. An answer that needs
nothing from the body (all d_t = 0) keeps the paper's mean.

It reads a data stage's folder (rows and stored prompt caches, never changed) and writes a new one whose
sample files hold the weighted target and name the source's file for the cache (data.cache_file), so that
python train.py --data NEW trains on it as on any data stage's folder:

    python -m extensions.answer_weights --data runs/data5k --out runs/aw/dep --first 1300
    python -m extensions.answer_weights --data runs/data5k --out runs/aw/paper --first 1300 --weights uniform

(--weights uniform copies the source's own target: the paper's loss on the very same rows, to compare with.)
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

if __name__ == "__main__":  # python -m extensions.answer_weights, or the file itself
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from support import cli  # noqa: E402
from support import data, files  # noqa: E402
from eviction import keep_slots  # noqa: E402
from lookaheadkv import AnswerHook, kl_loss  # noqa: E402
from support.metrics import forced_logprobs  # noqa: E402
from model import KVCache, ModelConfig  # noqa: E402

N_SINK, WINDOW, FLOOR = 4, 32, 0.25  # what the body-less cache keeps; each token's least share of the mean


# -----------------------------------------------------------------------------
# 1. How much each answer query needs the prompt's body


def body_less(cache, n_sink=N_SINK, window=WINDOW):
    """A copy of a prompt cache (S slots per layer) with the first n_sink and the last `window` slots only."""
    S = len(cache)
    if S <= n_sink + window:
        return cache.copy()
    slots = torch.cat([torch.arange(n_sink), torch.arange(S - window, S)]).to(cache.k[0].device)
    B, Hkv = cache.k[0].shape[:2]
    kept = slots.expand(B, Hkv, -1)  # (B, H_kv, n_sink + window), the same slots in every head
    return keep_slots(cache.copy(), [kept] * len(cache.k))


@torch.no_grad()
def dependence(model, cache, response, next_pos):
    """(R,) d_t for each answer query t = 0 .. R-1 (one row: cache of batch 1, response (1, R)): the KL of its
    next-token distribution with the whole prompt against the body-less cache; the last query's is 0."""
    full = forced_logprobs(model, cache, response, next_pos)  # (R-1, V): queries 0..R-2 predict tokens 1..R-1
    part = forced_logprobs(model, body_less(cache), response, next_pos)
    d = (full.exp() * (full - part)).sum(-1).clamp(min=0)  # (R-1,)
    return torch.cat([d, d.new_zeros(1)])


def token_weights(d, floor=FLOOR):
    """(R,) w_t = (1 - floor) * d_t / mean(d) + floor; all ones when no query depends on the body."""
    mean = d.mean()
    return torch.ones_like(d) if not mean > 1e-9 else (1 - floor) * d / mean + floor


# -----------------------------------------------------------------------------
# 2. The weighted target


class WeightedAnswerHook(AnswerHook):
    """lookaheadkv.AnswerHook (per query head) with the answer queries weighted by w, not averaged."""

    def __init__(self, S, weights):  # weights (B, R), >= 0
        super().__init__(S, torch.ones_like(weights, dtype=torch.bool), per_query_head=True)
        self.weights = weights / weights.sum(-1, keepdim=True)


@torch.no_grad()
def weighted_target(model, cache, response, next_pos, weights):
    """{layer: (1, H, S)}: the answer's attention over the prompt, its queries weighted by weights (R,)."""
    R = response.shape[1]
    hook = WeightedAnswerHook(len(cache), weights[None].to(cache.k[0].device))
    positions = next_pos.reshape(-1, 1) + torch.arange(R, device=response.device)  # (1, R)
    model(response, positions=positions, cache=cache.copy(), hook=hook, logits_at=-1)
    return hook.scores


def read_one(path, dtype):
    """One data stage's sample file as a batch of one: its prompt cache (a KVCache in dtype), the paper's
    target {layer: (1, H, S)} and the prompt's length (1,), where the answer starts."""
    item = data.read_sample(path)
    L, S = item["target"].shape[0], item["target"].shape[-1]
    cache = KVCache(L)
    for l in range(L):
        cache.k[l], cache.v[l] = item["k"][l][None].to(dtype), item["v"][l][None].to(dtype)  # (1, H_kv, S, D)
    return cache, {l: item["target"][l][None].float() for l in range(L)}, torch.tensor([S])


def remade_sample(model, src, row, uniform):
    """(target (L, H, S), stats) of one training row from its sample file in src."""
    cache, gt, lengths = read_one(data.sample_path(src, row["id"]), model.lm_head.weight.dtype)
    if uniform:  # the paper's target, as the data stage stored it
        return torch.cat([gt[l] for l in range(len(gt))]), dict(shift=0.0, effective=1.0)
    response = torch.tensor([row["response_ids"]])
    w = token_weights(dependence(model, cache, response, lengths))
    target = weighted_target(model, cache, response, lengths, w)
    stats = dict(shift=kl_loss(gt, target).item(),  # KL(paper's target || this one), as the loss measures it
                 effective=(w.sum() ** 2 / (w ** 2).sum() / len(w)).item())  # the share of tokens that count
    return torch.cat([target[l] for l in range(len(target))]), stats


# -----------------------------------------------------------------------------
# 3. A data folder of weighted targets beside the source's caches


def first_rows(rows, n):
    """The first n training rows in the file's order (a random subset: the data stage answers them in a seeded
    order), a group (one context, several prompts) never split; None: all of them."""
    if n is None:
        return rows
    chosen, keys = [], set()
    for r in rows:
        key = r.get("group", r["id"])
        if len(chosen) >= n and key not in keys:
            break
        chosen.append(r)
        keys.add(key)
    return chosen


def source_rows(src, model_cfg, n):
    """(training rows with a whole sample file, first n of them; held-out rows) of the data stage in src. Its
    data.jsonl may be growing under a running data stage: a last line cut short is left out, and a row is
    read only once its sample file is whole (the data stage writes the file before the row)."""
    lines = (src / "data.jsonl").read_text().split("\n")[:-1]  # the last piece is "" or a line still written
    rows = [json.loads(x) for x in lines if x.strip()]
    if any(r.get("fingerprint") != model_cfg.fingerprint() for r in rows):
        raise ValueError(f"--data {src}: its rows were made with another base model: pass --model")
    train = [r for r in rows if r.get("split") == "train" and data.sample_ok(data.sample_path(src, r["id"]))]
    if n is not None and len(train) < n:
        raise ValueError(f"--first {n}: {src} holds {len(train)} training rows with samples so far")
    return first_rows(train, n), [r for r in rows if r.get("split") == "heldout"]


def link_heldout(src, out):
    """The source's held-out ground truth files (content-named, train.py's cache) linked into OUT, so that
    training on OUT does not compute them again; a copy where a link cannot be made."""
    import shutil

    for f in sorted((src / "heldout").glob("*.pt")) if (src / "heldout").is_dir() else []:
        dest = out / "heldout" / f.name
        if not dest.exists():
            dest.parent.mkdir(exist_ok=True)
            try:
                os.link(f, dest)
            except OSError:
                shutil.copyfile(f, dest)


def settings_of(args, src):
    return dict(source=str(src.resolve()), first=args.first, weights=args.weights, n_sink=N_SINK, window=WINDOW,
                floor=FLOOR)


def check_out(args, src, out):
    """OUT is another folder than the source, and holds nothing or this very command's earlier work (resumed)."""
    if out.resolve() == src.resolve():
        raise ValueError(f"--out {out}: the source folder itself; pass a new folder (the source is never changed)")
    info = out / "answer_weights.json"
    if (out / "data.jsonl").exists() and not info.exists():
        raise ValueError(f"--out {out} holds a data stage of its own (data.jsonl): pass a new folder")
    if info.exists():
        had = {k: v for k, v in json.loads(info.read_text()).items() if k in settings_of(args, src)}
        if had != settings_of(args, src):
            diff = ", ".join(f"{k} {had.get(k)} (this run: {v})" for k, v in settings_of(args, src).items()
                             if had.get(k) != v)
            raise ValueError(f"--out {out} was made with other settings: {diff}: pass another --out")


def build(args):
    src, out = Path(args.data), Path(args.out)
    if not (src / "data.jsonl").is_file():
        raise ValueError(f"--data {src}: no data.jsonl there: pass the --out folder of a train.py data stage")
    cli.output_folder("--out", out)
    check_out(args, src, out)
    cli.claim_folder("--out", out)
    folder = cli.resolve_model(args.model)
    train, heldout = source_rows(src, ModelConfig.from_hf_config(folder), args.first)  # before the model loads
    torch.set_num_threads(args.threads)
    model, _, _ = cli.load(folder, "cpu", torch.float32, tokenizer=False)
    files.write_atomic(out / "answer_weights.json", json.dumps(settings_of(args, src), indent=1))  # never via a link
    todo = [r for r in train if not data.sample_ok(data.sample_path(out, r["id"]))]
    stats, start = [], time.perf_counter()
    for r in tqdm(todo, desc=f"{args.weights} targets"):
        target, s = remade_sample(model, src, r, args.weights == "uniform")
        path = data.sample_path(out, r["id"])
        cache = os.path.relpath(data.sample_path(src, r["id"]), path.parent)
        data.save_safetensors(path, dict(target=target.float()), {"cache": cache})
        stats.append(s)
    data.write_jsonl(train + heldout, out / "data.jsonl")  # written last: OUT is a data folder once whole
    link_heldout(src, out)
    return summary(args, out, train, heldout, stats, time.perf_counter() - start)


def summary(args, out, train, heldout, stats, seconds):
    """One line of what was made and what it cost; the figures also into OUT/answer_weights.json."""
    mean = lambda k: sum(s[k] for s in stats) / max(1, len(stats))  # noqa: E731
    info = json.loads((out / "answer_weights.json").read_text())
    info.update(rows=len(train), heldout=len(heldout), made=len(stats), seconds=round(seconds, 1),
                shift=round(mean("shift"), 4), effective=round(mean("effective"), 3))
    files.write_atomic(out / "answer_weights.json", json.dumps(info, indent=1))
    print(f"{out}: {len(train)} training rows ({len(stats)} made now, {seconds / max(1, len(stats)):.2f} s each), "
          f"{len(heldout)} held-out rows; KL(paper's target || this one) mean {info['shift']:.4f}, tokens "
          f"that count (effective share) {info['effective']:.3f}; train with python train.py --stage train "
          f"--data {out}")
    return info


def get_args(argv=None):
    p = cli.Parser("-m extensions.answer_weights", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a train.py data stage's folder (data.jsonl + samples/), only read")
    p.add_argument("--out", required=True, help="the new data folder (resumable: the same command continues)")
    p.add_argument("--first", type=int, default=None, help="the first N training rows (whole groups); default all")
    p.add_argument("--weights", choices=("dependence", "uniform"), default="dependence",
                   help="dependence: the weighted target above; uniform: the source's own (the paper's)")
    p.add_argument("--model", default=None, help="the base model's folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if args.first is not None:
        cli.positive("--first", args.first)
    cli.check_threads("--threads", args.threads)  # at most the cores: above them every op waits
    cli.check_model_dir(args.model)
    cli.check_not_root("--out", args.out)
    return args


def main(argv=None):
    return cli.run(lambda: build(get_args(argv)))


if __name__ == "__main__":
    main()
