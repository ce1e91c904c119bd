"""Beyond the paper: eviction while decoding and across conversation turns (extensions/decode.py: DecodeEviction,
add_turn, forced_logprobs_evicting; decode(..., hook=, after_step=); generate.py's chat). Each method's
decode-phase form lives there too (extensions.decode.FORMS): the methods' own files know nothing of it.

The cache never holds more than C_d + every slots; a budget that holds everything changes nothing (FullKV
token for token); decoding with evictions equals ONE masked full forward in which each generated token sees,
per (layer, KV head), exactly the slots the cache held when it was fed; the decode-phase lookahead and
SnapKV scores equal explicit attention (LoRA by hand with a row mask) over the current slots; RunningH2O
equals explicit column sums; a two-turn chat with a large budget equals FullKV on the concatenated
conversation; the chat format matches transformers' rendering.

Tiny random models on CPU, float32, one thread (see test_lookaheadkv.py)."""

import io
import json
import math
import sys

import pytest
import torch
from safetensors.torch import save_file

import eviction as ev_
import lookaheadkv as lk
from eviction import EvictConfig, decode, stack_layers
from extensions.decode import DECODE_METHODS, DecodeEviction, add_turn, forced_logprobs_evicting, form_of
from extensions.span import SpanRule
from methods import METHODS, make_scorer
from model import Hook, ModelConfig, Transformer, attention_mask, load_model
from support.tokenizer import Tokenizer
from test_lookaheadkv import compress_by, method_kwargs, rand_ids, random_module, tiny_model
from test_lookaheadkv import _no_grad  # noqa: F401 (autouse)

W, C, N = 4, 16, 5  # window, (decode) budget, every
ATOL = 1e-4


def test_decode_phase_forms_are_the_extensions_own():
    """Every method in DECODE_METHODS has its decode-phase form in extensions.decode.FORMS (the hook that watches
    after the prefill: SnapKV's recent queries, H2O's running sums; StreamingLLM and LookaheadKV watch
    nothing); every other method, PyramidKV and LAQ (SnapKVs) too, is refused in one line."""
    cfg = tiny_model().config
    for name in METHODS:
        scorer = make_scorer(EvictConfig(name, budget=16, window=4), **method_kwargs(name, cfg))
        if name in DECODE_METHODS:
            hook = form_of(scorer)[0](4)
            assert isinstance(hook, Hook) if name in ("snapkv", "h2o") else hook is None, name
        else:
            with pytest.raises(ValueError, match=f"method {name} has no decode-phase form"):
                form_of(scorer)


def watching(ev):
    """decode()'s arguments for a DecodeEviction: its hook and its after_step ({} for None)."""
    return {} if ev is None else dict(hook=ev.hook, after_step=ev.after_step)


def evictor(method, budget=C, every=N, module=None, window=W):
    """A DecodeEviction holding the cache to `budget` by the method's decode-phase form."""
    return DecodeEviction(make_scorer(EvictConfig(method, budget, window=window), module), every, window)


def generate_recording(model, cache, logits, pos, n, ev=None, stop_ids=()):
    """decode() with `ev` holding the cache; returns its tokens and the logits (1, V) each one was chosen
    from: the first-token logits, then every decode step's (recorded in eviction.decode_step)."""
    seen, real = [logits], ev_.decode_step

    def step(*a, **k):
        seen.append(real(*a, **k))
        return seen[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ev_, "decode_step", step)
        toks = [t.item() for t in decode(model, cache, logits, pos, n, stop_ids, **watching(ev))]
    assert len(seen) == len(toks)
    return toks, seen


def setup(method, S=40, layers=3, seed=0):
    """A tiny model, a module with a non-zero LoRA, a prompt of S tokens compressed to C by the method."""
    model = tiny_model(seed, num_hidden_layers=layers)
    mod = random_module(model.config, 8)
    ids = rand_ids(1, S, seed=seed + 3)
    cache, logits, pos, _ = compress_by(model, ids, EvictConfig(method, budget=C, window=W), module=mod)
    return model, mod, ids, cache, logits, pos


class Positions:
    """Watches cache.append on ONE cache (the one decode grows; lookahead_pass's copies are other objects):
    before each decode forward, which positions each (layer, KV head) holds, found by matching the cached
    keys against every key ever made (the prompt's from a full prefill, then each fed token's own), so
    eviction, gathers and their order are all checked. allowed[p][l]: (H_kv, n) positions seen by the
    token at position p in layer l; sizes: the slot count after every append."""

    def __init__(self, model, ids, cache, start):
        full, _, _, _ = compress_by(model, ids, EvictConfig("full"))
        self.bank = [k.clone() for k in full.k]  # per layer (1, H_kv, P, D), slot j = position j
        self.L, self.p, self.allowed, self.sizes = len(full.k), start, {}, []
        self.cache, self.orig = cache, cache.append
        cache.append = self.append  # an instance attribute: only this cache is watched

    def held(self, layer, k):
        d = torch.cdist(k.double(), self.bank[layer].double())  # (1, H_kv, n, P)
        dist, pos = d.min(dim=-1)
        assert dist.max().item() < 1e-4, "a cached key is no key of this sequence"
        return pos[0]  # (H_kv, n)

    def append(self, layer, k, v, pad_mask=None):
        assert k.shape[2] == 1, "decode feeds one token at a time"
        self.allowed.setdefault(self.p, {})[layer] = self.held(layer, self.cache.k[layer])
        self.bank[layer] = torch.cat([self.bank[layer], k], dim=2)
        out = self.orig(layer, k, v, pad_mask)
        self.sizes.append(len(self.cache) if layer == self.L - 1 else None)
        if layer == self.L - 1:
            self.p += 1
        return out

    def now(self):
        """The positions the cache holds now, per layer (H_kv, n)."""
        return {l: self.held(l, self.cache.k[l]) for l in range(self.L)}


class Restricted(Hook):
    """The reference forward's hook: tells the mask wrapper which layer runs; optionally adds a LoRA to
    the last M rows the paper's way (the delta on EVERY row times a row mask [0..0, 1..1]) and keeps the
    queries and keys (after RoPE) of every layer."""

    def __init__(self, module=None, T=None, M_=0):
        self.layer, self.module, self.T, self.M = None, module, T, M_
        self.q, self.k = {}, {}

    def lora(self, layer, name, x):
        if self.module is None or (d := self.module.delta(layer, name, x)) is None:
            return None
        return d * torch.cat([torch.zeros(self.T - self.M), torch.ones(self.M)])[None, :, None]

    def attn(self, layer, q, k, key_valid):
        self.layer = layer
        self.q[layer], self.k[layer] = q, k


def masked_forward(model, monkeypatch, x, allowed_rows, hook):
    """ONE forward over embeddings x (1, T, hidden) without a cache, positions 0..T-1, in which row p
    (when allowed_rows has it) attends per (layer, KV head) only to allowed_rows[p][l][h] and to itself;
    the other rows are causal as usual. Returns the logits (1, T, V) and the masks per layer."""
    T, Hkv = x.shape[1], model.config.num_key_value_heads
    masks = []
    for l in range(model.config.num_hidden_layers):
        a = torch.ones(1, Hkv, T, T, dtype=torch.bool).tril()
        for p, per_layer in allowed_rows.items():
            for h in range(Hkv):
                row = torch.zeros(T, dtype=torch.bool)
                row[per_layer[l][h]] = True
                row[p] = True
                a[0, h, p] = row
        masks.append(a)
    with monkeypatch.context() as mp:  # where Attention looks it up; attention_mask is the original
        mp.setattr("model.attention_mask", lambda Tq, Tk, kv, dev: attention_mask(Tq, Tk, kv, dev) & masks[hook.layer])
        out = model(inputs_embeds=x, positions=torch.arange(T)[None], pad_mask=torch.ones(1, T, dtype=torch.bool),
                    hook=hook)
    return out, masks


def explicit_scores(q, k, mask, cols, G):
    """Mean attention of queries q (1, H, n_q, D) over keys k (1, H_kv, T, D) under mask (1, H_kv, n_q, T),
    read at the positions cols (H_kv, n) of each KV head: (1, H_kv, n), mean over the queries and the group."""
    kr = k.repeat_interleave(G, dim=1).double()
    logits = q.double() @ kr.transpose(-1, -2) / math.sqrt(q.shape[-1])
    p = logits.masked_fill(~mask.repeat_interleave(G, dim=1), float("-inf")).softmax(-1)  # (1, H, n_q, T)
    Hkv = k.shape[1]
    return torch.stack([p[0, h * G:(h + 1) * G, :, cols[h]].mean(dim=(0, 1)) for h in range(Hkv)])[None].float()


# -----------------------------------------------------------------------------
# the budget


@pytest.mark.parametrize("method", DECODE_METHODS)
def test_cache_never_exceeds_budget_plus_every(method):
    model, mod, ids, cache, logits, pos = setup(method)
    S = ids.shape[1]
    watch = Positions(model, ids, cache, start=S)
    ev = evictor(method, module=mod)
    before_after = []
    evict = ev.evict

    def spy(model_, cache_, next_pos, budget=None):  # the last W slots (the latest tokens) survive every eviction
        last = [k[:, :, -W:].clone() for k in cache_.k]
        kept = evict(model_, cache_, next_pos, budget)
        before_after.append((int(next_pos), len(cache_)))
        assert all(torch.equal(a, k[:, :, -W:]) for a, k in zip(last, cache_.k))
        return kept

    ev.evict = spy  # after_step calls self.evict
    toks = list(decode(model, cache, logits, pos, 31, **watching(ev)))
    sizes = [s for s in watch.sizes if s is not None]
    assert len(toks) == 31 and len(sizes) == 30  # 30 tokens fed
    assert max(sizes) == C + N and all(s <= C + N for s in sizes)
    # the cache fills from C to C + N, then goes back to C: 6 evictions, the next rows at S + 5, S + 10, ...
    assert [e[1:] for e in ev.log] == [(C + N, C)] * 6 and before_after == [(S + 5 * i, C) for i in range(1, 7)]
    assert [e[0] for e in ev.log] == [S + 5 * i for i in range(1, 7)]
    assert len(cache) == C + 30 - 6 * N and watch.p == S + 30  # every layer and KV head the same count


def test_an_adapter_with_the_span_rule_selects_unpooled_while_decoding():
    """The span rule reads the prefill's hidden states, which generated tokens do not leave: decode-phase
    eviction with such an adapter selects unpooled (its window kept) instead of failing mid-answer."""
    model, mod, ids, _, _, _ = setup("lookahead")
    scorer = make_scorer(EvictConfig("lookahead", C, window=W, rule=SpanRule(8)), mod)
    assert isinstance(scorer.rule, SpanRule)  # the prefill's eviction uses it
    cache, logits, pos, _ = ev_.compress(model, ids, scorer)
    ev = DecodeEviction(scorer, N, W)
    assert repr(ev.scorer.rule) == "none"
    toks = list(decode(model, cache, logits, pos, 12, **watching(ev)))
    assert len(toks) == 12 and ev.log and all(after == C for _, _, after in ev.log)


@pytest.mark.parametrize("method", DECODE_METHODS)
def test_a_budget_that_holds_everything_is_fullkv(method):
    """C_d >= prompt + answer: nothing is evicted, and decoding equals FullKV's token for token."""
    model, mod, ids, _, _, _ = setup(method, S=30)
    full, l0, p0, _ = compress_by(model, ids, EvictConfig("full"))
    want, want_logits = generate_recording(model, full, l0, p0, 20)
    cache, logits, pos, _ = compress_by(model, ids, EvictConfig(method, budget=30, window=W), module=mod)  # C >= S
    ev = evictor(method, 50, module=mod)
    got, got_logits = generate_recording(model, cache, logits, pos, 20, ev)
    assert got == want and not ev.log and len(cache) == 30 + 19
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got_logits, want_logits))


@pytest.mark.parametrize("method", DECODE_METHODS)
def test_forcing_the_answer_gives_the_logits_generation_saw(method):
    """forced_logprobs_evicting (evaluate.py's teacher forcing) runs the very path generation runs,
    evictions included: forcing the generated answer gives the log-probs of the logits each of its
    tokens 2..R was chosen from, the same evictions at the same positions, and the cache's sizes."""
    model, mod, ids, cache, logits, pos = setup(method)
    c2 = cache.copy()
    ev = evictor(method, module=mod)
    toks, seen = generate_recording(model, cache, logits, pos, 25, ev)  # 24 fed: 4 evictions
    ev2 = evictor(method, module=mod)
    logp, sizes = forced_logprobs_evicting(model, c2, logits, pos, torch.tensor([toks]), ev2)
    assert logp.shape == (24, logits.shape[-1]) and logp.dtype == torch.float32
    want = torch.cat(seen[1:]).float().log_softmax(-1)  # the first token's logits are the prefill's, not a row
    assert torch.allclose(logp, want, atol=1e-5)
    assert ev.log == ev2.log and len(ev.log) == 4 and len(c2) == len(cache)
    # the size as each answer token is generated: C, then one more per fed token, back to C at C + N
    assert sizes == [C + i % N for i in range(25)]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(c2.k, cache.k))  # the same slots kept
    # a one-token answer: no rows, nothing fed
    logp1, sizes1 = forced_logprobs_evicting(model, c2.copy(), logits, pos, torch.tensor([toks[:1]]),
                                             evictor(method, module=mod))
    assert logp1.shape == (0, logits.shape[-1]) and sizes1 == [len(c2)]


# -----------------------------------------------------------------------------
# against explicit computations


@pytest.mark.parametrize("method", DECODE_METHODS)
def test_decoding_with_evictions_equals_a_masked_full_forward(method, monkeypatch):
    """Reference: ONE forward over [prompt; fed tokens], no cache, where the token at position p attends
    per (layer, KV head) only to the positions the cache held when p was fed (found by key matching) and
    to itself; prompt rows are causal, as in the prefill. Positions (the next token is always at S + t),
    the per-head gathers and the order of slots all have to be right for the logits to agree."""
    model, mod, ids, cache, logits, pos = setup(method)
    S = ids.shape[1]
    watch = Positions(model, ids, cache, start=S)
    ev = evictor(method, module=mod)
    toks, rec = generate_recording(model, cache, logits, pos, 24, ev)
    assert len(ev.log) == 4
    seq = torch.tensor([ids[0].tolist() + toks[:-1]])  # (1, S + 23)
    held = watch.allowed
    differ = any(set(held[p][l][0].tolist()) != set(held[p][l][1].tolist()) for p in held for l in held[p])
    assert differ != (method == "streaming"), "streaming keeps the same slots in every head, the others need not"
    ref, _ = masked_forward(model, monkeypatch, model.model.embed_tokens(seq), held, Restricted())
    for t in range(24):
        assert torch.allclose(rec[t], ref[:, S - 1 + t], atol=ATOL), t
    # control: with nothing masked, the same forward is FullKV's, which differs
    plain = model(seq, positions=torch.arange(seq.shape[1])[None])
    assert (plain[:, S:] - ref[:, S:]).abs().max() > 1e-2


def scores_without_lora(model, mod, cache, next_pos):
    """The decode-phase lookahead scores of mod's embeddings with the LoRA off (B = 0)."""
    zero = random_module(model.config, mod.n_tokens, randomise_B=False)
    zero.embeddings.copy_(mod.embeddings)
    return stack_layers(lk.lookahead_pass(model, zero, cache, torch.tensor([next_pos])))


@pytest.mark.parametrize("method", ["lookahead", "snapkv"])
def test_decode_phase_scores_equal_explicit_attention(method, monkeypatch):
    """After evictions, the decode-phase scores of the current slots equal an explicit computation.
    lookahead: the M rows appended after the fed tokens (positions next_pos ..), in one masked forward with
    the LoRA by hand (delta on every row x a row mask), seeing per (layer, KV head) exactly the slots the
    cache holds now (+ the earlier lookahead rows): their mean softmax over those slots. snapkv: the last W
    fed tokens' queries (from the same kind of forward) over the slots held now, causal by position."""
    model, mod, ids, cache, logits, pos = setup(method)
    S, cfg = ids.shape[1], model.config
    G, Mr = cfg.num_attention_heads // cfg.num_key_value_heads, mod.n_tokens
    watch = Positions(model, ids, cache, start=S)
    ev = evictor(method, module=mod)
    toks = [t.item() for t in decode(model, cache, logits, pos, 19, **watching(ev))]
    assert len(ev.log) == 3 and len(cache) == C + 3  # scored below on a cache that evicted and grew again
    next_pos = S + 18
    now = watch.now()
    got = ev.scores(ev.scorer, model, cache, ev.hook, torch.tensor([next_pos]))  # (L, 1, H_kv, n)
    seq_x = model.model.embed_tokens(torch.tensor([ids[0].tolist() + toks[:-1]]))  # (1, next_pos, hidden)
    if method == "lookahead":
        x = torch.cat([seq_x, mod.embeddings[None]], dim=1)
        T = x.shape[1]
        rows = dict(watch.allowed)
        for i in range(Mr):  # lookahead row i: the held slots and the lookahead rows up to itself
            rows[next_pos + i] = {l: [torch.cat([now[l][h], torch.arange(next_pos, next_pos + i)])
                                      for h in range(cfg.num_key_value_heads)] for l in now}
        hook = Restricted(mod, T, Mr)
        _, masks = masked_forward(model, monkeypatch, x, rows, hook)
        queries = slice(T - Mr, T)
    else:
        hook = Restricted()
        _, masks = masked_forward(model, monkeypatch, seq_x, watch.allowed, hook)
        queries = slice(next_pos - W, next_pos)
    for l in range(cfg.num_hidden_layers):
        mask = masks[l][:, :, queries].clone()
        if method == "snapkv":  # over the slots held NOW (not what those queries saw when they ran), causal
            mask[:] = False
            for h in range(cfg.num_key_value_heads):
                for i, p in enumerate(range(next_pos - W, next_pos)):
                    mask[0, h, i, now[l][h][now[l][h] <= p]] = True
        want = explicit_scores(hook.q[l][:, :, queries], hook.k[l], mask, now[l], G)
        assert got[l].shape == (1, cfg.num_key_value_heads, C + 3)
        assert torch.allclose(got[l], want, atol=1e-5), l
    if method == "lookahead":  # the LoRA mattered: the same forward without it scores otherwise
        assert not torch.allclose(scores_without_lora(model, mod, cache, next_pos), got, atol=1e-3)


def test_running_h2o_equals_explicit_column_sums(monkeypatch):
    """RunningH2O after evictions: for each slot held now, the attention it received from every fed token's
    query (over what that token saw when it ran: the masked forward's rows), divided by how many of those
    queries saw it, x the group: explicit column sums / counts. The running sums travel with their slots."""
    model, mod, ids, cache, logits, pos = setup("h2o")
    S, cfg = ids.shape[1], model.config
    G = cfg.num_attention_heads // cfg.num_key_value_heads
    watch = Positions(model, ids, cache, start=S)
    ev = evictor("h2o")
    toks = [t.item() for t in decode(model, cache, logits, pos, 19, **watching(ev))]
    assert len(ev.log) == 3
    T, now = S + 18, watch.now()
    hook = Restricted()
    _, masks = masked_forward(model, monkeypatch, model.model.embed_tokens(torch.tensor([ids[0].tolist() + toks[:-1]])),
                              watch.allowed, hook)
    got = ev.scores(ev.scorer, model, cache, ev.hook, torch.tensor([T]))  # (L, 1, H_kv, n)
    for l in range(cfg.num_hidden_layers):
        kr = hook.k[l].repeat_interleave(G, dim=1).double()
        logits_ = hook.q[l][:, :, S:].double() @ kr.transpose(-1, -2) / math.sqrt(cfg.head_dim)  # the fed rows
        mask = masks[l][:, :, S:]  # (1, H_kv, T - S, T)
        p = logits_.masked_fill(~mask.repeat_interleave(G, dim=1), float("-inf")).softmax(-1)
        col = p[0].sum(1).view(cfg.num_key_value_heads, G, T).sum(1)  # (H_kv, T)
        seen = mask[0].sum(1) * G  # (H_kv, T): the fed queries that saw each position
        want = torch.stack([(col[h] / seen[h])[now[l][h]] for h in range(cfg.num_key_value_heads)])
        assert got[l].shape == (1, cfg.num_key_value_heads, C + 3)
        assert torch.allclose(got[l][0], want.float(), atol=1e-5), l


# -----------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("method, budget, every, message", [
    pytest.param("pyramidkv", C, N, "method pyramidkv has no decode-phase form"),
    ("full", C, N, "method full has no decode-phase form"),
    pytest.param("laq", C, N, "method laq has no decode-phase form"),
    ("snapkv", C, 0, "every 0 tokens: must be at least 1"),
    ("snapkv", 4, N, "decode budget 4 leaves no room to choose: it always keeps the last 4 slots"),
    ("streaming", 8, N, "the last 4 slots and 4 sinks; use a budget > 8"),
])
def test_bad_decode_eviction_values(method, budget, every, message):
    scorer = make_scorer(EvictConfig(method, budget, window=2))  # the prefill's own window may be smaller
    with pytest.raises(ValueError, match=message):
        DecodeEviction(scorer, every, window=W)
    with pytest.raises(ValueError, match=message):  # generate.py runs these before loading a model
        DecodeEviction.check(scorer, every, window=W)


# -----------------------------------------------------------------------------
# conversation turns


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A random 2-layer llama (model.py's own files) with a word-level ChatML tokenizer."""
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("chat")
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    words = specials + ["[UNK]", "system", "user", "assistant"] + [f"w{i}" for i in range(57)]
    config = dict(model_type="llama", vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=400, eos_token_id=2)
    (folder / "config.json").write_text(json.dumps(config))
    net = Transformer(ModelConfig.from_hf_config(folder))
    torch.manual_seed(0)
    for n, p in net.named_parameters():
        p.data = torch.rand_like(p) + 0.5 if "norm" in n else torch.randn_like(p) * 0.3
    save_file({n: p.detach().contiguous() for n, p in net.named_parameters()}, str(folder / "model.safetensors"))
    tk = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens(specials)
    tk.save(str(folder / "tokenizer.json"))
    return folder


def words(n, seed):
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"w{i}" for i in torch.randint(0, 57, (n,), generator=g).tolist())


def chat(folder, tmp_path, turns, *argv):
    import generate

    path = tmp_path / "turns.json"
    path.write_text(json.dumps(turns))
    return generate.main(["--turns", str(path), "--model", str(folder), "--device", "cpu", "--json", "--window",
                          str(W), "--max-new-tokens", "7", *argv])


@pytest.mark.parametrize("method", ["full", *DECODE_METHODS])
def test_two_turns_with_a_large_budget_equal_fullkv_on_the_whole_conversation(chat_model, chat_adapter, tmp_path,
                                                                               method, capsys):
    """Nothing evicted: turn 2's answer is FullKV's on [chat(u1); answer 1; next_turn(u2)], token for token
    (answer_ids hold the answer as it stands in the conversation: its last token, which decode never feeds,
    opens turn 2 unless it was the stop token)."""
    turns = [words(60, 1), words(12, 2)]
    budgets = [] if method == "full" else ["--budget", "300", "--decode-budget", "300",
                                           *adapter_flag(method, chat_adapter)]
    stats = chat(chat_model, tmp_path, turns, "--method", method, *budgets)
    assert [s["turn"] for s in stats] == [1, 2] and all(s["kept"] == s["cache_before"] for s in stats)
    model = load_model(chat_model)
    tok = Tokenizer(chat_model, model.config)
    conversation = tok.encode(tok.chat(turns[0])) + stats[0]["answer_ids"] + tok.encode(tok.next_turn(turns[1]))
    assert stats[1]["cache_before"] == len(conversation)
    cache, logits, pos, _ = compress_by(model, torch.tensor([conversation]), EvictConfig("full"))
    want = [t.item() for t in decode(model, cache, logits, pos, 7, tok.stop_ids)]
    want = want[:-1] if want[-1] in tok.stop_ids else want
    assert stats[1]["answer_ids"] == want
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [p["turn"] for p in printed] == [1, 2]


def adapter_flag(method, path):
    return ["--adapter", str(path)] if method == "lookahead" else []  # the others refuse one


@pytest.fixture(scope="module")
def chat_adapter(chat_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("adapter") / "adapter.safetensors"
    with torch.no_grad():
        random_module(ModelConfig.from_hf_config(chat_model), 4).save(path)
    return path


@pytest.mark.parametrize("method", DECODE_METHODS)
def test_a_small_budget_holds_every_turn(chat_model, chat_adapter, tmp_path, method):
    turns = [words(60, 3), words(30, 4), words(30, 5)]
    stats = chat(chat_model, tmp_path, turns, "--method", method, "--budget", "12", "--decode-budget", "14",
                 "--every", "3", "--max-new-tokens", "10", *adapter_flag(method, chat_adapter))
    assert [s["turn"] for s in stats] == [1, 2, 3]
    slot_bytes = 2 * 2 * 2 * 8 * 4  # K and V, 2 layers, 2 KV heads, head_dim 8, float32
    for prev, s in zip([None] + stats, stats):
        assert s["kept"] == 12 and s["peak_slots"] == max(s["cache_before"], 14 + 3 if s["decode_evictions"] else 0,
                                                          s["kv_bytes"] // slot_bytes)
        # the turn was prefilled on top of everything the last one left, then all of it evicted to 12
        assert s["cache_before"] == (prev["kv_bytes"] // slot_bytes if prev else 0) + s["prompt_tokens"] > 12
        assert s["kv_bytes"] // slot_bytes <= 14 + 3


def test_chat_loop_reset_and_end_of_input(chat_model, monkeypatch, capsys):
    """--turns -: one turn a line on stdin; /reset starts over (the same turn then answers the same); end of
    input ends."""
    u = words(20, 6)
    import generate

    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{u}\n\n{words(5, 7)}\n/reset\n{u}\n"))
    stats = generate.main(["--turns", "-", "--model", str(chat_model), "--device", "cpu", "--method", "snapkv",
                           "--budget", "12", "--window", str(W), "--max-new-tokens", "5"])
    assert [s["turn"] for s in stats] == [1, 2, 1]
    assert stats[2]["answer_ids"] == stats[0]["answer_ids"] and stats[2]["cache_before"] == stats[0]["cache_before"]
    out = capsys.readouterr().out
    assert out.count("--- turn 1: prompt +") == 2 and "--- turn 2: prompt +" in out and "--- new conversation" in out
    assert "slots per (layer, KV head)" in out


def test_add_turn_equals_one_prefill_of_both_turns():
    """add_turn without an evictor (FullKV) == prefilling the two turns at once; with one and a large budget
    it changes nothing either; with a small one, every slot is a candidate and the window stays."""
    model = tiny_model(num_hidden_layers=2)
    a, b = rand_ids(1, 30, seed=1), rand_ids(1, 12, seed=2)
    whole, l_whole, _, _ = compress_by(model, torch.cat([a, b], 1), EvictConfig("full"))
    for ev, budget in ((None, None), (evictor("snapkv", 60, None), 60)):
        cache, _, pos, _ = compress_by(model, a, EvictConfig("full"))
        logits, pos = add_turn(model, cache, b, pos, ev, budget)
        assert pos.tolist() == [42] and len(cache) == 42 and torch.allclose(logits, l_whole, atol=1e-5)
    cache, _, pos, _ = compress_by(model, a, EvictConfig("full"))
    ev = evictor("snapkv", 10, None)
    last = [k[:, :, -W:] for k in whole.k]
    add_turn(model, cache, b, pos, ev, 10)
    assert len(cache) == 10 and ev.log == [(42, 42, 10)]
    assert all(torch.allclose(k[:, :, -W:], want, atol=1e-5) for k, want in zip(cache.k, last))


@pytest.mark.parametrize("fmt", ["chatml", "llama3"])
def test_next_turn_is_the_templates_rendering(tmp_path, fmt):
    pytest.importorskip("transformers")
    import test_model as tm

    specials, template, cfg = dict(
        chatml=(tm.CHATML_SPECIALS, tm.SMOLLM2_TEMPLATE, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}),
        llama3=(tm.LLAMA3_SPECIALS, tm.LLAMA3_TEMPLATE, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    )[fmt]
    folder = tm.make_tokenizer(tmp_path / fmt, specials, template, cfg)
    tok = Tokenizer(folder)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "there ."},
                {"role": "user", "content": "be brief ."}]
    assert tok.chat("hi") + "there ." + tok.next_turn("be brief .") == tm.rendered_by_transformers(folder, messages)


def test_the_rest_runs_without_this_extension(tmp_path):
    """Deleting extensions/decode.py (and the lines that name it in the scripts) leaves every other feature
    working: in a fresh interpreter where it cannot be imported, the core, the other extensions and the
    training import, and every method compresses a prompt (the cheap form of the check). The research
    harness's half: tests/research/test_evaluate.py."""
    import subprocess
    from pathlib import Path

    from test_lookaheadkv import TINY

    code = f"""
import sys, torch
sys.modules["extensions.decode"] = None  # import extensions.decode now raises ImportError
import eviction, methods, model, train
from lookaheadkv import LookaheadModule
torch.manual_seed(0)
cfg = model.ModelConfig(**{TINY!r})
m = model.Transformer(cfg).eval()
ids = torch.randint(1, cfg.vocab_size, (1, 40))
for name in methods.METHODS:
    kw = dict(module=LookaheadModule(cfg, n_tokens=4)) if name == "lookahead" else {{}}
    if name == "oracle":
        kw["response"] = torch.randint(1, cfg.vocab_size, (1, 5))
    with torch.no_grad():
        eviction.compress(m, ids, methods.make_scorer(eviction.EvictConfig(name, budget=16, window=4), **kw))
print("ok")
"""
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_the_rest_runs_without_the_chat(chat_model, tmp_path, monkeypatch):
    """Deleting extensions/chat.py leaves every other feature
    working: no other file imports it, and generate.py answers a prompt, its cache held to --decode-budget
    (extensions/decode.py, which the chat builds on), without calling it (the cheap form of the check)."""
    from pathlib import Path

    import generate

    root = Path(__file__).resolve().parents[1]
    files = [*root.glob("*.py"), *root.glob("extensions/*.py"), *root.glob("support/*.py"), *root.glob("research/**/*.py"), *root.glob("weights/*.py")]
    naming = {p.name for p in files if p.name != "chat.py" and ("extensions.chat" in p.read_text()
                                                                   or "extensions import chat" in p.read_text())}
    assert naming == set(), naming  # generate.py asks for it by name when --turns is given (extension("chat"))
    from extensions import chat
    for name in ("chat_loop", "turns_of", "chat"):
        monkeypatch.setattr(chat, name, lambda *a, **k: pytest.fail("the chat was called"))
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(words(60, 8))
    stats = generate.main(["--prompt", str(prompt), "--model", str(chat_model), "--device", "cpu", "--json",
                           "--method", "snapkv", "--budget", "12", "--decode-budget", "14", "--every", "3",
                           "--window", str(W), "--max-new-tokens", "10"])
    assert stats["kept_tokens"] == 12 and stats["decode_evictions"] >= 1
