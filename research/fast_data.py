"""
A faster data maker for research-scale CPU runs (research/train_lab.py uses it): the target summed while
the answer is decoded, rather than train.py's one answer_attention forward over the answers after it.
Each decode step's attention over the prompt is one term of the answer's mean (TargetAttention), so no
second forward is needed; with --group N, training prompts come N to a shared context
(data.make_training_groups): the context is prefilled once, decoding reads its cache once for the N
answers (SharedPrefixAttention), and its cache is stored once; a prompt then costs about a fifth of what
it costs alone (research/LOG.md 8.1). tests/research/test_train_lab.py holds its targets equal to
lookaheadkv.answer_attention's, train.py's.
"""
import json
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from eviction import decode_step, left_pad
from model import Hook, KVCache
from research import harness
from support import data, files
from support.data import sample_bytes, sample_ok, sample_path, save_sample
from train import full_cache


class RoomyCache(KVCache):
    """`cache` with room for `room` more slots in every layer, reserved once: each decode step writes its key
    and value into the room. A plain KVCache concatenates the whole cache anew at every step; at batch 8 on a
    CPU that copy costs about as much as the step's own work. The values are the same either way."""

    def __init__(self, cache, room):
        super().__init__(len(cache.k))
        self.room = []
        for l in range(len(cache.k)):
            k, v, valid = cache.k[l], cache.v[l], cache.valid[l]
            B, H, T, D = k.shape
            rk, rv = k.new_empty(B, H, T + room, D), v.new_empty(B, H, T + room, D)
            rvalid = torch.ones(B, 1 if valid is None else valid.shape[1], T + room, dtype=torch.bool, device=k.device)
            rk[:, :, :T], rv[:, :, :T] = k, v
            if valid is not None:
                rvalid[..., :T] = valid
            self.room.append((rk, rv, rvalid))
            self.k[l], self.v[l], self.valid[l] = rk[:, :, :T], rv[:, :, :T], None if valid is None else rvalid[..., :T]

    def append(self, layer, k, v, pad_mask=None):
        rk, rv, rvalid = self.room[layer]
        n, T = self.k[layer].shape[2], k.shape[2]
        if pad_mask is not None or n + T > rk.shape[2] or self.k[layer].data_ptr() != rk.data_ptr():
            return super().append(layer, k, v, pad_mask)  # padding, or past the room: the plain way
        rk[:, :, n:n + T], rv[:, :, n:n + T] = k, v  # decoded tokens are real: rvalid is True there already
        self.k[layer], self.v[layer] = rk[:, :, :n + T], rv[:, :, :n + T]
        if self.valid[layer] is not None:
            self.valid[layer] = rvalid[..., :n + T]
        return self.k[layer], self.v[layer], self.valid[layer]


class TargetAttention(Hook):
    """One decode step's attention for all B rows, one batched matmul over each row's own keys, and the step's
    term of the training target: the token decoded is a query of the answer, so its attention over the S prompt
    slots is one term of the answer's mean (answer_attention's). What the data stage uses on a GPU, where a
    step's time is its kernel launches; on a CPU, SharedPrefixAttention (below) reads each group's prefix once."""

    def __init__(self, S):
        self.S, self.weight, self.target = S, None, {}  # weight (B,): 1 for a row still answering, else 0

    def add_term(self, layer, probs):
        """probs (B, H_kv, G, Tk): this step's attention; its prompt part, weighted, joins the target."""
        term = probs[..., :self.S].flatten(1, 2) * self.weight[:, None, None]  # (B, H, S)
        self.target[layer] = term if layer not in self.target else self.target[layer] + term

    def attn(self, layer, q, k, key_valid):
        B, H, T, D = q.shape
        assert T == 1, "one decode step at a time"
        Hkv = k.shape[1]
        s = (q.view(B, Hkv, H // Hkv, D) * D ** -0.5) @ k.transpose(-1, -2)  # (B, H_kv, G, Tk)
        if key_valid is not None:
            s = s.masked_fill(~key_valid.expand(B, Hkv, -1)[:, :, None, :], float("-inf"))
        self.probs = s.float().softmax(-1)  # float32, as group_attention's: it is also the target
        self.add_term(layer, self.probs)

    def attn_output(self, layer, v):
        B, Hkv, _, D = v.shape
        return (self.probs.to(v.dtype) @ v).reshape(B, -1, 1, D)  # (B, H, 1, D)


class SharedPrefixAttention(TargetAttention):
    """Decoding rows laid out as shared_prefill lays them out (slots [0, P) of every row hold its group's
    left-padded prefix, the slots after P its own tokens): the attention of each decode step, with each
    group's prefix keys and values read ONCE for all of its rows rather than once per row. The result is
    the same attention; decoding on a CPU is bound by reading the cache, and a group of 6 shares most of it.
    The prefix part is one matmul per group: its rows' G query heads per KV head stacked as one matrix."""

    def __init__(self, P, groups, S):
        super().__init__(S)
        keys = list(dict.fromkeys(groups))
        self.P, self.rows = P, [torch.tensor([b for b, g in enumerate(groups) if g == key]) for key in keys]

    def attn(self, layer, q, k, key_valid):
        B, H, T, D = q.shape
        assert T == 1, "one decode step at a time"
        P, Hkv = self.P, k.shape[1]
        G = H // Hkv
        valid = key_valid.expand(B, Hkv, -1) if key_valid is not None else None  # (B, H_kv, Tk)
        self.scores = []
        for rows in self.rows:
            n, first = len(rows), rows[0]
            qg = q[rows].view(n, Hkv, G, D) * D ** -0.5  # (n, H_kv, G, D)
            # the prefix: (H_kv, n*G, D) @ (H_kv, D, P), the group's one copy of it
            s_pre = (qg.permute(1, 0, 2, 3).reshape(Hkv, n * G, D) @ k[first, :, :P].transpose(-1, -2))
            s_pre = s_pre.view(Hkv, n, G, P).permute(1, 0, 2, 3)  # (n, H_kv, G, P)
            s_own = qg @ k[rows, :, P:].transpose(-1, -2)  # (n, H_kv, G, Tk - P)
            s = torch.cat([s_pre, s_own], dim=-1)
            if valid is not None:
                s = s.masked_fill(~valid[rows][:, :, None, :], float("-inf"))
            self.scores.append(s.float().softmax(-1))  # float32, as group_attention's: it is also the target
        probs = torch.empty(B, Hkv, G, self.S, device=q.device)  # this step's attention over the prompt
        for rows, p in zip(self.rows, self.scores):
            probs[rows] = p[..., :self.S]
        self.add_term(layer, probs)

    def attn_output(self, layer, v):
        B, Hkv, Tk, D = v.shape
        P = self.P
        out = v.new_empty(B, Hkv, self.scores[0].shape[2], D)  # (B, H_kv, G, D)
        for rows, p in zip(self.rows, self.scores):
            n, G, p = len(rows), p.shape[2], p.to(v.dtype)
            pre = p[..., :P].permute(1, 0, 2, 3).reshape(Hkv, n * G, P) @ v[rows[0], :, :P]  # (H_kv, n*G, D)
            out[rows] = pre.view(Hkv, n, G, D).permute(1, 0, 2, 3) + p[..., P:] @ v[rows, :, P:]
        return out.reshape(B, Hkv * out.shape[2], 1, D)  # (B, H, 1, D)


def shared_prefix(prompts):
    """How many leading tokens all of `prompts` share, leaving each at least one token of its own (its last
    token gives its first-token logits)."""
    n = min(len(p) for p in prompts) - 1
    for i in range(n):
        if any(p[i] != prompts[0][i] for p in prompts):
            return i
    return max(n, 0)


@torch.no_grad()
def shared_prefill(model, prompts, groups):
    """Prefill B prompts, those of one group (groups[b]: any key) sharing their common prefix: each group's
    prefix once, the groups left-padded together into one prefill, then every prompt's own tail on top of a
    copy of its group's cache (left-padded too, so padding sits between prefix and tail; positions say where
    each token is). Returns (cache, first-token logits (B, V), next positions (B,), slots: per prompt the
    cache slots that hold its tokens, in order, and shared: per prompt its group's prefix length)."""
    dev = model.lm_head.weight.device
    keys = list(dict.fromkeys(groups))
    shared = {g: shared_prefix([p for p, h in zip(prompts, groups) if h == g]) for g in keys}
    firsts = [next(p for p, h in zip(prompts, groups) if h == g)[:shared[g]] for g in keys]
    prefix_ids, prefix_pad = left_pad([f or [0] for f in firsts], dev)  # an empty prefix: one pad slot
    prefix_pad[:, -1] &= torch.tensor([len(f) > 0 for f in firsts], device=dev)
    cache = full_cache(model, prefix_ids, prefix_pad)[0]  # (G rows)
    row = torch.tensor([keys.index(g) for g in groups], device=dev)
    for l in range(len(cache.k)):  # one copy of its group's prefix per prompt
        cache.k[l], cache.v[l] = cache.k[l].index_select(0, row), cache.v[l].index_select(0, row)
        cache.valid[l] = None if cache.valid[l] is None else cache.valid[l].index_select(0, row)
    tails = [p[shared[g]:] for p, g in zip(prompts, groups)]
    tail_ids, tail_pad = left_pad(tails, dev)
    start = torch.tensor([shared[g] for g in groups], device=dev)  # (B,) position of each tail's first token
    positions = start[:, None] + (tail_pad.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(tail_ids, positions=positions, cache=cache, pad_mask=tail_pad, logits_at=-1)[:, -1]
    P, T = prefix_ids.shape[1], tail_ids.shape[1]
    slots = [list(range(P - shared[g], P)) + list(range(P + T - len(t), P + T)) for g, t in zip(groups, tails)]
    next_pos = start + torch.tensor([len(t) for t in tails], device=dev)
    return cache, logits, next_pos, slots, [shared[g] for g in groups], P


@torch.no_grad()
def answer_and_target(model, tok, prompts, max_new_tokens, groups=None):
    """For B prompts (token-id lists) prefilled ONCE, together (shared_prefill: prompts of one group share
    their prefix's prefill; groups None: no two share): the greedy full-cache answer and, summed while it is
    decoded, the target: per layer and query head, the mean attention of the answer's tokens over the prompt
    (answer_attention's, without a second forward over the answers: each answer token, the last one too, is
    fed once, and its attention at that step is its term). Returns per prompt a dict: response_ids (the stop
    token kept: the answer's end is part of its future), k and v (L, H_kv, S_b, D) the prompt's cache,
    target (L, H, S_b), padding removed, and shared (how many of its first tokens its group shares: the data
    stage stores those once per group)."""
    dev, L = model.lm_head.weight.device, model.config.num_hidden_layers
    B, groups = len(prompts), list(range(len(prompts))) if groups is None else groups
    cache, logits, next_pos, slots, shared, P = shared_prefill(model, prompts, groups)
    S = len(cache)  # the prompt's slots (padding included); decoding appends after them, into a roomy copy
    # a CPU's decoding is bound by reading the cache: each group's prefix read once; a GPU's by its launches:
    # one batched attention (the per-group loop made the data stage of gpu_train.sh ~7x slower)
    hook = SharedPrefixAttention(P, groups, S) if dev.type == "cpu" else TargetAttention(S)
    roomy = RoomyCache(cache, max_new_tokens)
    # not greedy(): it never feeds an answer's last token, whose query is one term of the target
    answers, done = [[] for _ in range(B)], [False] * B
    for t in range(max_new_tokens):
        tokens = logits.argmax(-1)  # (B,) greedy; a finished row is fed on (batch decoding) with weight 0
        hook.weight = torch.tensor([0.0 if d else 1.0 for d in done], device=dev)
        for b, token in enumerate(tokens.tolist()):  # one host read per step, as greedy()'s
            if not done[b]:
                answers[b].append(token)
                done[b] = token in tok.stop_ids
        logits = decode_step(model, roomy, tokens, next_pos + t, hook)  # this token's attention: its term
        if all(done):
            break
    lengths = torch.tensor([len(a) for a in answers], device=dev, dtype=torch.float32)
    out = []
    for b in range(B):
        real = torch.tensor(slots[b], device=dev)  # this row's slots, without the padding
        out.append(dict(response_ids=answers[b], shared=shared[b],
                        k=torch.stack([cache.k[l][b][:, real] for l in range(L)]),  # (L, H_kv, S_b, D)
                        v=torch.stack([cache.v[l][b][:, real] for l in range(L)]),
                        target=torch.stack([hook.target[l][b][:, real] / lengths[b] for l in range(L)])))  # (L, H, S_b)
    return out


def new_prompts(tok, cfg, split, n):
    """The split's prompts as the recipe makes them: training prompts in groups on shared contexts when
    cfg.group > 1; held-out prompts always one per context, in the default task mix (comparable across runs)."""
    kw = dict(min_tokens=cfg.min_tokens, max_tokens=cfg.max_tokens, long_frac=cfg.long_frac, long_max=cfg.long_max,
              seed=cfg.seed)
    if split == "train" and cfg.group > 1:
        return data.make_training_groups(tok, n, split=split, group=cfg.group, first_frac=cfg.first_frac,
                                         copy_frac=cfg.copy_frac, **kw)
    return data.make_training_prompts(tok, n, split=split, copy_frac=cfg.copy_frac if split == "train" else None, **kw)


def answer_batches(todo, gen_batch, seed):
    """The prompts to answer, in batches of up to gen_batch prompts, a group never split: held-out rows first (an
    early check), then blocks of 8 batches in a seeded random order, sorted by length inside a block (little
    padding, and a run stopped early leaves a random subset)."""
    units = {}
    for p in todo:
        units.setdefault(p.get("group", p["id"]), []).append(p)
    units = list(units.values())
    random.Random(seed).shuffle(units)
    units.sort(key=lambda u: u[0]["split"] != "heldout")
    block = 8 * gen_batch
    ordered, i = [], 0
    while i < len(units):
        j, n = i, 0
        while j < len(units) and n < block:
            n, j = n + len(units[j]), j + 1
        ordered += sorted(units[i:j], key=lambda u: len(u[0]["prompt_ids"]))
        i = j
    batches, batch = [], []
    for u in ordered:
        if batch and len(batch) + len(u) > gen_batch:
            batches.append(batch)
            batch = []
        batch += u
    return batches + ([batch] if batch else [])


def stored_bytes(cfg, model_cfg, rows, store):
    """Disk the training rows' samples take: a group's shared prefix counted once."""
    groups = {}
    for r in rows:
        if r["split"] == "train":
            groups.setdefault(r.get("group", r["id"]), []).append(r["prompt_ids"])
    target = lambda S: sample_bytes(model_cfg, S, None)
    cache = lambda S: sample_bytes(model_cfg, S, store) - target(S)
    n = 0
    for prompts in groups.values():
        shared = shared_prefix(prompts) if len(prompts) > 1 else 0
        n += cache(shared) + sum(cache(len(p) - shared) + target(len(p)) for p in prompts)
    return n


def save_batch(out, batch, samples, store):
    """Each training row's sample file; a group's shared prefix (in this batch, two or more rows) once, in a
    file of its own that the members' files name."""
    by_group = {}
    for p, s in zip(batch, samples):
        if p["split"] == "train":
            by_group.setdefault(p.get("group", p["id"]), []).append((p, s))
    for key, members in by_group.items():
        shared = members[0][1]["shared"] if len(members) > 1 and store is not None else 0
        if shared:
            data.save_prefix(data.prefix_path(out, key), members[0][1], shared, store)
        for p, s in members:
            save_sample(sample_path(out, p["id"]), s, store, prefix=data.prefix_path(out, key) if shared else None)


def build_dataset(model, tok, cfg, folder, rows, out_of_time=lambda: False):
    """Append {id, split, task, prompt_ids, response_ids} rows to OUT/data.jsonl until it holds
    n_train + n_heldout of them, and write each training row's sample file (cache + target) in the
    same pass. Rows and samples already there are kept (resume); a row without a whole sample file
    (e.g. a data.jsonl from elsewhere, a file cut short) gets one from one forward over [prompt; answer].
    Prints what the new rows cost (wall clock and CPU time, prompts per hour)."""
    out = folder.out
    fp, path = model.config.fingerprint(), Path(out) / "data.jsonl"
    made_in = str(model.lm_head.weight.dtype).removeprefix("torch.")  # each row records it: check_data_dtype
    have = {split: sum(r.get("split") == split for r in rows) for split in ("train", "heldout")}
    todo = []
    if have["train"] < cfg.n_train or have["heldout"] < cfg.n_heldout:
        done = {r["id"] for r in rows}
        for split, n in (("train", cfg.n_train), ("heldout", cfg.n_heldout)):
            todo += [dict(p, split=split) for p in new_prompts(tok, cfg, split, n) if p["id"] not in done]
    store = None if cfg.store_dtype == "none" else getattr(torch, cfg.store_dtype)
    missing = []
    for r in rows:
        if r["split"] == "train" and not sample_ok(sample_path(out, r["id"])):
            if sample_path(out, r["id"]).exists():
                print(f"training sample {sample_path(out, r['id'])} is unreadable (cut short?): made again")
            missing.append(r)
    for p in todo:
        p["prompt_ids"] = tok.encode(tok.chat(p["prompt"]))
    folder.check_store(cfg, model.config, rows + todo, store, stored_bytes(cfg, model.config, rows + todo, store))
    for r in tqdm(missing, desc="samples from data.jsonl", disable=not missing):
        cache, gt, _ = harness.ground_truth(model, r["prompt_ids"], r["response_ids"])
        save_sample(sample_path(out, r["id"]), dict(k=torch.cat(cache.k), v=torch.cat(cache.v),
                                                    target=torch.cat([gt[l] for l in range(len(gt))])), store)
    bar = tqdm(total=len(todo), desc="answering prompts", disable=not todo)
    wall, cpu = time.perf_counter(), time.process_time()
    for batch in answer_batches(todo, cfg.gen_batch or (32 if cfg.device.startswith("cuda") else 8), cfg.seed):
        if out_of_time():  # --max-minutes counts the data stage; the rows so far are kept
            print(f"--max-minutes reached in the data stage: {len(rows)} rows kept; the same command goes on")
            break
        samples = answer_and_target(model, tok, [p["prompt_ids"] for p in batch], cfg.max_new_tokens,
                                    groups=[p.get("group", p["id"]) for p in batch])
        new = [dict(id=p["id"], split=p["split"], source=p["source"], task=p["task"], base_model=model.config.name,
                    fingerprint=fp, dtype=made_in, prompt_ids=p["prompt_ids"], response_ids=s["response_ids"],
                    **({"group": p["group"]} if "group" in p else {}))
               for p, s in zip(batch, samples)]
        save_batch(out, batch, samples, store)  # the sample files first, then the rows that point to them
        # appended batch by batch (a killed run loses one batch at most), never through a link (files.append_text)
        files.append_text(path, "".join(json.dumps(r) + "\n" for r in new))
        rows = rows + new
        bar.update(len(batch))
    bar.close()
    if todo:
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        print(f"data stage: {len(todo)} prompts in {wall:.0f} s ({wall / len(todo):.2f} s per prompt, "
              f"{3600 * len(todo) / wall:.0f} prompts per hour; CPU time {cpu / len(todo):.2f} s per prompt)")
    return rows
