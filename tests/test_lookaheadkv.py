"""Tests of lookaheadkv.py (the paper), eviction.py (the shared steps) and baselines.py: every method
through compress (shapes, budgets, decode), select and the SnapKV pooling, the exactness of the
lookahead pass (two passes == one masked pass == a by-hand masked LoRA), H2O and GQA attention
against explicit full attention matrices, decoding on an evicted cache against a full forward with
the evicted keys masked out, chunked prefill, left padding, and the adapter file format. The
extensions (span rule, per-layer budgets) are in test_extensions.py.

Everything runs on CPU in float32 on tiny random models (weights re-drawn N(0, 0.15) so that
attention is far from uniform and a wrong index or position changes the numbers)."""

import json
import math

import pytest
from conftest import REORDER_ATOL
import torch

import baselines
import eviction as ev
import lookaheadkv as lk
import methods
from support import metrics
from baselines import H2OHook, WindowHook
from eviction import EvictConfig, Pool, compress, decode, select, stack_layers
from lookaheadkv import LookaheadHook, LookaheadModule
from methods import make_scorer
from model import Hook, KVCache, ModelConfig, Transformer, attention_mask
from torch.nn.attention.bias import causal_lower_right

V = 128
TINY = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, name="tiny")
ATOL = 1e-5


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def tiny_model(seed=0, **kw):
    cfg = ModelConfig(**{**TINY, **kw})
    torch.manual_seed(seed)
    model = Transformer(cfg).float().eval().requires_grad_(False)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.uniform_(0.5, 1.5)
        else:
            p.normal_(0.0, 0.15)
    return model


def rand_ids(B, T, seed=0, low=1):
    return torch.randint(low, V, (B, T), generator=torch.Generator().manual_seed(seed))


def pos(start, n, B=1):
    return torch.arange(start, start + n)[None].expand(B, n)


def random_module(cfg, M_=8, targets=("q_proj", "k_proj"), seed=1, randomise_B=True):
    """A LookaheadModule whose embeddings look like tokens and whose LoRA B is nonzero (an
    untrained module has B = 0, which would hide any bug in where the delta is applied)."""
    torch.manual_seed(seed)
    mod = LookaheadModule(cfg, n_tokens=M_, targets=targets, embed_std=0.15)
    if randomise_B:
        for name, p in mod.named_parameters():
            if name.endswith("_B"):
                p.normal_(0.0, 0.1)
    return mod.eval().requires_grad_(False)


def compress_by(model, ids, ec, module=None, response=None, pad_mask=None, clock=None):
    """compress() by the method an EvictConfig names (methods.make_scorer, then the shared steps)."""
    return compress(model, ids, make_scorer(ec, module, response), pad_mask, clock)


def kept_slots(full_k, kept_k):
    """Recover which prompt slots a compressed cache kept: each kept key (B, H_kv, C, D) must be an
    exact copy of one key of the full cache (B, H_kv, S, D) of the same row and KV head.
    Returns (B, H_kv, C) slot indices."""
    d = torch.cdist(kept_k.double(), full_k.double())  # (B, H_kv, C, S)
    dist, idx = d.min(dim=-1)
    assert dist.max().item() < 1e-4, "a kept key is not a key of the prompt"
    return idx


def explicit_probs(q, k, causal=True, key_valid=None):
    """Reference attention with K copied for GQA (HF's repeat_kv): (B, H, Tq, Tk)."""
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    kr = k.repeat_interleave(H // k.shape[1], dim=1)
    logits = (q.double() @ kr.double().transpose(-1, -2)) / math.sqrt(D)
    allowed = torch.ones(Tq, Tk, dtype=torch.bool)
    if causal:
        allowed = torch.arange(Tk)[None, :] <= torch.arange(Tk - Tq, Tk)[:, None]
    allowed = allowed[None, None]
    if key_valid is not None:  # (B, 1|H_kv, Tk): one row per KV head -> one per query head
        if key_valid.shape[1] > 1:
            key_valid = key_valid.repeat_interleave(H // key_valid.shape[1], dim=1)
        allowed = allowed & key_valid[:, :, None, :]
    return logits.masked_fill(~allowed, float("-inf")).softmax(-1)


class Capture(Hook):
    """Records each layer's post-RoPE queries and keys."""

    def __init__(self):
        self.q, self.k = {}, {}

    def attn(self, layer, q, k, key_valid):
        self.q[layer], self.k[layer] = q.clone(), k.clone()


# -----------------------------------------------------------------------------
# 1. every method through compress: budgets, kept slots, decode


def settings(method, one_pass=True, draft_tokens=4):
    """EvictConfig.options for a test's method: lookahead's pass, LAQ's draft length; the others have none here."""
    return {"lookahead": dict(one_pass=one_pass), "laq": dict(draft_tokens=draft_tokens)}.get(method, {})


def method_kwargs(method, cfg, seed=0):
    kw = {}
    if method == "lookahead":
        kw["module"] = LookaheadModule(cfg, n_tokens=8)  # untrained: B = 0
    if method == "oracle":
        kw["response"] = rand_ids(1, 6, seed=seed + 7)
    return kw


@pytest.mark.parametrize("method", list(methods.METHODS))
def test_every_method_keeps_min_S_C_per_head_and_decodes(method):
    model = tiny_model(num_hidden_layers=3)
    cfg = model.config
    S, C, W = 48, 24, 8
    ids = rand_ids(1, S)
    ec = EvictConfig(method, budget=C, window=W, options=dict(draft_tokens=4) if method == "laq" else {})
    full, full_logits, full_pos, _ = compress_by(model, ids, EvictConfig("full"))
    torch.manual_seed(0)
    cache, logits, next_pos, kept = compress_by(model, ids, ec, **method_kwargs(method, cfg))
    assert next_pos.tolist() == [S]
    assert torch.allclose(logits, full_logits, atol=ATOL)  # eviction happens after the first token's logits
    if method == "full":
        budgets = [S] * 3
        assert kept is None
    elif method == "pyramidkv":
        budgets = baselines.pyramid_budgets(C, W, 3, baselines.PyramidKV.default_options["beta"])
        assert budgets == [40, 24, 8] and sum(budgets) / 3 == C  # falling with depth, mean C
    else:
        budgets = [C] * 3
    for l in range(3):
        assert cache.k[l].shape == (1, cfg.num_key_value_heads, budgets[l], cfg.head_dim)
        assert cache.v[l].shape == cache.k[l].shape
        idx = kept_slots(full.k[l], cache.k[l])  # (1, H_kv, C_l)
        if method != "full":  # compress reports the very slots its cache holds
            assert torch.equal(kept[l], idx)
        for h in range(cfg.num_key_value_heads):
            slots = idx[0, h].tolist()
            assert len(set(slots)) == budgets[l], "a slot kept twice"
            assert slots == sorted(slots)  # slot order is kept
            if method in ("snapkv", "pyramidkv", "h2o", "laq"):
                assert set(range(S - W, S)) <= set(slots)  # the window is protected
            if method == "streaming":
                assert slots == list(range(4)) + list(range(S - (C - 4), S))
        # values travel with their keys
        # (the two prefills differ in their rows, so another CPU's kernels may round them apart: REORDER_ATOL)
        want_v = full.v[l].gather(2, idx[..., None].expand(-1, -1, -1, cfg.head_dim))
        assert (cache.v[l] - want_v).abs().max() <= REORDER_ATOL
    if method != "full":
        # keep_fraction: per prompt token, the fraction of (layer, KV head) pairs that kept it
        frac = metrics.keep_fraction(kept, S)
        assert frac.shape == (S,) and ((frac >= 0) & (frac <= 1)).all()
        assert frac.sum().item() == pytest.approx(sum(budgets) / len(budgets))  # mean slots kept per layer
    toks = list(decode(model, cache, logits, next_pos, 3))
    assert len(toks) == 3 and all(t.shape == (1,) and 0 <= t.item() < V for t in toks)
    assert toks[0].item() == full_logits.argmax(-1).item()
    for l in range(3):  # two tokens were fed after the first one
        assert cache.k[l].shape[2] == budgets[l] + 2


@pytest.mark.parametrize("method", list(methods.METHODS))
@pytest.mark.parametrize("S", [24, 16])  # == C and < C: nothing to evict
def test_no_eviction_when_prompt_fits(method, S):
    model = tiny_model()
    ids = rand_ids(1, S, seed=3)
    _, full_logits, _, _ = compress_by(model, ids, EvictConfig("full"))
    cache, logits, next_pos, kept = compress_by(model, ids, EvictConfig(method, budget=24, window=8),
                                             **method_kwargs(method, model.config))
    assert len(cache) == S and all(k.shape[2] == S for k in cache.k)
    assert kept is None and next_pos.tolist() == [S]
    assert torch.allclose(logits, full_logits, atol=ATOL)
    toks = list(decode(model, cache, logits, next_pos, 3))
    assert len(toks) == 3 and len(cache) == S + 2


# -----------------------------------------------------------------------------
# 2. select and the budget errors


def test_select_keeps_top_scores_in_slot_order():
    s = torch.tensor([[[0.1, 0.9, 0.3, 0.8, 0.05, 0.7], [0.6, 0.1, 0.2, 0.3, 0.9, 0.0]]])  # (1, 2, 6)
    idx = select(s, 3)
    assert idx.tolist() == [[[1, 3, 5], [0, 3, 4]]]
    assert select(s, 10).tolist() == [[list(range(6))] * 2]  # budget > S keeps everything


def test_select_protected_tokens_count_inside_budget():
    s = torch.tensor([[[0.1, 0.9, 0.3, 0.8, 0.05, 0.7]]])
    protect = torch.tensor([[[True, False, False, False, True, False]]])  # low scores, kept anyway
    assert select(s, 3, protect=protect).tolist() == [[[0, 1, 4]]]  # 2 protected + best other one
    assert select(s, 2, protect=protect).tolist() == [[[0, 4]]]


def test_select_never_prefers_padding():
    s = torch.tensor([[[5.0, 4.0, 0.1, 0.2, 0.3]], [[0.5, 0.1, 0.2, 0.3, 0.4]]])  # (2, 1, 5)
    valid = torch.tensor([[True, True, True, True, True], [False, False, True, True, True]])[:, None]
    assert select(s, 2, key_valid=valid).tolist() == [[[0, 1]], [[3, 4]]]  # row 1: padding has the top score
    assert select(s, 3, key_valid=valid)[1].tolist() == [[2, 3, 4]]
    # only when the budget exceeds the real tokens does padding fill the remaining slots
    assert select(s, 4, key_valid=valid)[1, 0, -3:].tolist() == [2, 3, 4]
    # protect does not override padding (streaming protects position 0, which padding also has)
    protect = torch.tensor([[True, False, False, False, False]])[None].expand(2, 1, 5)
    assert select(s, 2, key_valid=valid, protect=protect)[1].tolist() == [[3, 4]]


@pytest.mark.parametrize("method,kw,msg", [
    ("snapkv", dict(budget=8, window=8), "budget 8 is too small for snapkv"),
    ("pyramidkv", dict(budget=4, window=8), "too small for pyramidkv"),
    ("h2o", dict(budget=8, window=8), "too small for h2o"),
    ("laq", dict(budget=8, window=8), "too small for laq"),
    ("streaming", dict(budget=4, options=dict(n_sink=4)), "too small for streaming"),
])
def test_budget_below_protected_tokens_is_refused(method, kw, msg):
    model = tiny_model()
    with pytest.raises(ValueError, match=msg):
        compress_by(model, rand_ids(1, 40), EvictConfig(method, **kw))
    # one slot more than the protected tokens is fine
    b = kw.get("window", kw.get("options", {}).get("n_sink")) + 1
    cache, *_ = compress_by(model, rand_ids(1, 40), EvictConfig(method, **{**kw, "budget": b}))
    assert cache.k[-1].shape[2] <= b


def test_each_method_takes_its_own_settings_only():
    """A method's own options live with its class (Scorer.default_options); EvictConfig.options sets them by
    name, and an option the method does not have is refused, not silently ignored."""
    assert methods.METHODS["streaming"].default_options == dict(n_sink=4)
    assert methods.METHODS["snapkv"].default_options == {}
    assert methods.make_scorer(EvictConfig("streaming", 16, options=dict(n_sink=2))).sinks == 2
    assert methods.make_scorer(EvictConfig("laq", 40)).options == dict(draft_tokens=8)  # the default
    with pytest.raises(ValueError, match="method snapkv has no setting n_sink; its own: none"):
        methods.make_scorer(EvictConfig("snapkv", 64, options=dict(n_sink=4)))
    with pytest.raises(ValueError, match="method pyramidkv has no setting one_pass; its own: beta"):
        methods.make_scorer(EvictConfig("pyramidkv", 64, options=dict(one_pass=False)))


def test_missing_inputs_are_refused():
    model = tiny_model()
    ids = rand_ids(1, 40)
    with pytest.raises(ValueError, match="needs an adapter"):
        compress_by(model, ids, EvictConfig("lookahead", budget=16))
    with pytest.raises(ValueError, match="full-cache answer"):
        compress_by(model, ids, EvictConfig("oracle", budget=16))
    with pytest.raises(ValueError, match="unknown method"):
        compress_by(model, ids, EvictConfig("nope", budget=16))


# -----------------------------------------------------------------------------
# 3, 4. the lookahead pass: two passes == one masked pass == a masked LoRA by hand


class MaskedLoRAByHand(Hook):
    """The paper's equation written out: Q = [X; P] Wq + [0; P] dWq with the delta computed on
    EVERY row and multiplied by a row mask [0..0, 1..1]; scores from explicit attention with K
    copied per query head (no group_attention)."""

    def __init__(self, module, S, M_):
        self.module, self.S, self.M = module, S, M_
        self.scores = {}

    def lora(self, layer, name, x):
        d = self.module.delta(layer, name, x)
        if d is None:
            return None
        mask = torch.cat([torch.zeros(self.S), torch.ones(self.M)])[None, :, None]
        return d * mask

    def attn(self, layer, q, k, key_valid):
        p = explicit_probs(q, k)[:, :, -self.M:, : self.S]  # (B, H, M, S)
        B, H = p.shape[:2]
        Hkv = k.shape[1]
        self.scores[layer] = p.mean(2).view(B, Hkv, H // Hkv, self.S).mean(2).float()  # mean over M, then group


@pytest.mark.parametrize("targets", [("q_proj", "k_proj"), LookaheadModule.TARGETS])
def test_two_pass_equals_one_masked_pass(targets):
    model = tiny_model(num_hidden_layers=3)
    cfg = model.config
    S, M_, C = 40, 8, 16
    mod = random_module(cfg, M_, targets)
    ids = rand_ids(1, S, seed=5)
    P = mod.embeddings[None]
    # (a) two passes: the prompt alone, then the M rows on its cache with the LoRA
    cache = KVCache(cfg.num_hidden_layers)
    logits_a = model(ids, positions=pos(0, S), cache=cache, logits_at=-1)[:, -1]
    ha = LookaheadHook(mod, S)
    model(inputs_embeds=P, positions=pos(S, M_), cache=cache, hook=ha, logits_at=-1)
    # (b) one pass over [prompt; P]: the hook adds the LoRA to the last M rows only
    x = torch.cat([model.model.embed_tokens(ids), P], dim=1)
    hb = LookaheadHook(mod, S)
    out_b = model(inputs_embeds=x, positions=pos(0, S + M_), hook=hb)
    # (c) by hand: full-length delta times a row mask, explicit attention
    hc = MaskedLoRAByHand(mod, S, M_)
    out_c = model(inputs_embeds=x, positions=pos(0, S + M_), hook=hc)
    plain = model(inputs_embeds=x, positions=pos(0, S + M_))
    for l in range(cfg.num_hidden_layers):
        assert ha.scores[l].shape == (1, cfg.num_key_value_heads, S)
        assert torch.allclose(ha.scores[l], hb.scores[l], atol=ATOL)
        assert torch.allclose(hc.scores[l], hb.scores[l], atol=ATOL)
        pa, pb = (Pool("avg", 5).smooth(h.scores[l]) for h in (ha, hb))
        assert torch.equal(select(pa, C), select(pb, C))
    assert torch.allclose(out_b, out_c, atol=1e-4)  # the whole forward, lookahead rows included
    # the prompt rows never see the LoRA: their logits are the base model's
    assert torch.allclose(out_b[:, :S], plain[:, :S], atol=ATOL)
    assert torch.allclose(logits_a, plain[:, S - 1], atol=ATOL)
    # and the LoRA does act on the lookahead rows (else this test would prove nothing)
    assert (out_b[:, S:] - plain[:, S:]).abs().max() > 1e-2

    # the same through compress: one_pass=True vs the two-pass reference
    res = {}
    for one_pass in (True, False):
        res[one_pass] = compress_by(model, ids, EvictConfig("lookahead", budget=C, options=dict(one_pass=one_pass)), module=mod)
    (c1, l1, p1, k1), (c2, l2, p2, k2) = res[True], res[False]
    assert torch.allclose(l1, l2, atol=ATOL) and torch.equal(p1, p2)
    assert all(torch.equal(a, b) for a, b in zip(k1, k2))
    for l in range(cfg.num_hidden_layers):
        assert c1.k[l].shape[2] == C  # the lookahead rows are gone from the cache
        assert torch.allclose(c1.k[l], c2.k[l], atol=ATOL) and torch.allclose(c1.v[l], c2.v[l], atol=ATOL)
        # and the kept set is the top C of the two-pass scores, max-pooled (width 7): the paper's form,
        # LookaheadKV's default (it was unpooled, our variant, before issue 52)
        assert torch.equal(kept_slots(cache.k[l][:, :, :S], c1.k[l]), select(Pool("max", 7).smooth(ha.scores[l]), C))


def test_kl_loss_of_a_2_by_3_example_worked_by_hand():
    """Two heads over three prompt slots, scores as given (not yet normalised):

        head 0: target [1, 1, 2] -> [1/4, 1/4, 1/2]; prediction [1, 1, 2] -> the same: KL 0
        head 1: target [2, 0, 2] -> [1/2, 0, 1/2]; prediction [1, 2, 1] -> [1/4, 1/2, 1/4]:
                KL = 1/2 ln(1/2 / 1/4) + 0 + 1/2 ln(1/2 / 1/4) = ln 2  (a slot the target gives 0 adds 0)

    kl_loss averages over heads (and rows and layers): (0 + ln 2) / 2 = 0.3466. The target is the first argument:
    swapped, the slot the target gave 0 would count."""
    gt = {0: torch.tensor([[[1.0, 1.0, 2.0], [2.0, 0.0, 2.0]]])}  # (B, H, S) = (1, 2, 3)
    pred = {0: torch.tensor([[[1.0, 1.0, 2.0], [1.0, 2.0, 1.0]]])}
    assert lk.kl_loss(gt, pred).item() == pytest.approx(math.log(2) / 2, abs=1e-6)
    assert lk.kl_loss(gt, gt).item() == pytest.approx(0.0, abs=1e-7)
    assert lk.kl_loss(pred, gt).item() > 1.0  # KL(pred || gt) pays for the slot gt holds at 0


def test_lora_delta_is_alpha_over_r_B_A_x():
    cfg = ModelConfig(**TINY)
    mod = random_module(cfg, 8, ("k_proj", "down_proj"))
    mod.alpha = 16.0
    x = torch.randn(2, 5, cfg.hidden_size)
    A, B = mod.lora[1]["k_proj_A"], mod.lora[1]["k_proj_B"]
    assert A.shape == (8, cfg.hidden_size) and B.shape == (cfg.num_key_value_heads * cfg.head_dim, 8)
    ref = torch.einsum("btc,rc,or->bto", x, A, B) * 16.0 / 8
    assert torch.allclose(mod.delta(1, "k_proj", x), ref, atol=1e-6)
    xi = torch.randn(1, 3, cfg.intermediate_size)
    assert mod.delta(0, "down_proj", xi).shape == (1, 3, cfg.hidden_size)
    assert mod.delta(0, "q_proj", x) is None  # not a target
    with pytest.raises(ValueError, match="unknown LoRA targets"):
        LookaheadModule(cfg, targets=("qkv",))
    fresh = LookaheadModule(cfg, n_tokens=8)  # LoRA starts at B = 0, A != 0
    assert all((p == 0).all() == n.endswith("_B") for n, p in fresh.lora.named_parameters())


def test_zero_lora_gives_the_base_models_attention():
    """With B = 0 the lookahead rows are plain embeddings run through the frozen model."""
    model = tiny_model()
    cfg = model.config
    S, M_ = 30, 8
    mod = random_module(cfg, M_, LookaheadModule.TARGETS, randomise_B=False)
    assert all(p.abs().max() == 0 for n, p in mod.named_parameters() if n.endswith("_B"))
    x = torch.cat([model.model.embed_tokens(rand_ids(1, S, seed=2)), mod.embeddings[None]], dim=1)
    hl, hw = LookaheadHook(mod, S), WindowHook(M_, S)
    model(inputs_embeds=x, positions=pos(0, S + M_), hook=hl)
    model(inputs_embeds=x, positions=pos(0, S + M_), hook=hw)
    for l in range(cfg.num_hidden_layers):
        assert torch.allclose(hl.scores[l], hw.scores[l], atol=1e-6)
    # control: a nonzero B changes them
    mod2 = random_module(cfg, M_, LookaheadModule.TARGETS)
    h2 = LookaheadHook(mod2, S)
    model(inputs_embeds=torch.cat([x[:, :S], mod2.embeddings[None]], 1), positions=pos(0, S + M_), hook=h2)
    assert (h2.scores[1] - hw.scores[1]).abs().max() > 1e-3


def test_lookahead_scores_are_mean_attention_of_the_M_rows():
    """LookaheadHook's scores == explicit softmax rows of the M lookahead queries (their LoRA on) over the
    S prompt keys, mean over those queries and the GQA group; per_query_head keeps the query heads apart
    (training)."""
    model = tiny_model()
    cfg = model.config
    S, n = 25, 6
    mod = random_module(cfg, n, LookaheadModule.TARGETS)
    x = torch.cat([model.model.embed_tokens(rand_ids(1, S, seed=9)), mod.embeddings[None]], dim=1)
    cap, h, hq = Capture(), LookaheadHook(mod, S), LookaheadHook(mod, S, per_query_head=True)

    class Both(Hook):
        def lora(self, layer, name, x):
            return h.lora(layer, name, x)

        def attn(self, layer, q, k, kv):
            for hook in (cap, h, hq):
                hook.attn(layer, q, k, kv)

    model(inputs_embeds=x, positions=pos(0, S + n), hook=Both())
    G = cfg.num_attention_heads // cfg.num_key_value_heads
    for l in range(cfg.num_hidden_layers):
        p = explicit_probs(cap.q[l], cap.k[l])[:, :, -n:, :S].mean(2)  # (1, H, S)
        assert torch.allclose(hq.scores[l], p.float(), atol=1e-6)
        assert torch.allclose(h.scores[l], p.view(1, -1, G, S).mean(2).float(), atol=1e-6)


# -----------------------------------------------------------------------------
# 5. attention recall


def recall(pred, true, C, protect=None):
    """Attention recall@C of scores `pred` (what lookaheadkv.attention_recall was): keep each layer's
    top C (protected tokens inside the budget), then metrics.recall_of_kept against `true`."""
    return metrics.recall_of_kept([select(pred[l], C, protect=protect) for l in range(len(pred))], true)


def test_attention_recall_known_value_and_oracle_bound():
    true = {0: torch.tensor([[[0.5, 0.3, 0.2, 0.0]]]), 1: torch.tensor([[[2.0, 0.0, 0.0, 2.0]]])}
    pred = {0: torch.tensor([[[0.9, 0.0, 0.8, 0.1]]]), 1: torch.tensor([[[0.9, 0.0, 0.8, 0.1]]])}  # keeps {0, 2}
    assert recall(pred, true, 2) == pytest.approx((0.7 + 0.5) / 2)
    protect = torch.tensor([[[False, False, False, True]]])  # slot 3 forced in: keeps {0, 3}
    assert recall(pred, true, 2, protect=protect) == pytest.approx((0.5 + 1.0) / 2)

    model = tiny_model()
    cfg = model.config
    S, C = 40, 12
    ids = rand_ids(1, S, seed=4)
    cache = KVCache(cfg.num_hidden_layers)
    hw, h2o = WindowHook(8, S), H2OHook()

    class Both(Hook):
        def attn(self, layer, q, k, kv):
            hw.attn(layer, q, k, kv)
            h2o.attn(layer, q, k, kv)

    model(ids, positions=pos(0, S), cache=cache, hook=Both())
    k0 = list(cache.k)
    true = lk.answer_attention(model, cache, rand_ids(1, 10, seed=8), torch.tensor([S]))
    assert len(cache) == S and all(a is b for a, b in zip(k0, cache.k))  # the answer is not left in the cache
    g = torch.Generator().manual_seed(0)
    others = dict(snapkv=hw.scores, h2o=h2o.scores(None, 2),
                  random={l: torch.rand(1, 2, S, generator=g) for l in range(cfg.num_hidden_layers)})
    best = recall(true, true, C)
    for name, s in others.items():
        r = recall(s, true, C)
        assert 0.0 < r <= best + 1e-7, name
    assert best < 1.0
    assert recall(true, true, S) == pytest.approx(1.0)
    assert recall(others["random"], true, S + 5) == pytest.approx(1.0)


# -----------------------------------------------------------------------------
# 5b. the answer's attention (the oracle, the training target, recall's truth) against explicit attention


def test_answer_attention_equals_explicit_attention_for_a_padded_batch():
    """answer_attention on a batch: prompts of different lengths (left-padded into one cache) and answers
    of different lengths (right-padded, answer_mask). Reference, per row alone and without any padding:
    ONE forward over [prompt; answer], its causal softmax matrix written out (explicit_probs), the mean
    of the answer's rows over the prompt's columns, per query head, and its GQA-group mean per KV head."""
    model = tiny_model(num_hidden_layers=3)
    cfg = model.config
    G, L = cfg.num_attention_heads // cfg.num_key_value_heads, cfg.num_hidden_layers
    lens, alens = (30, 21), (4, 7)
    S, R = max(lens), max(alens)
    prompts = [rand_ids(1, n, seed=40 + i) for i, n in enumerate(lens)]
    answers = [rand_ids(1, r, seed=50 + i) for i, r in enumerate(alens)]
    ids = torch.cat([torch.cat([torch.zeros(1, S - p.shape[1], dtype=torch.long), p], 1) for p in prompts])
    pad = torch.stack([torch.arange(S) >= S - n for n in lens])
    cache, _, next_pos, _ = compress_by(model, ids, EvictConfig("full"), pad_mask=pad)
    assert next_pos.tolist() == list(lens)
    padded = torch.cat([torch.cat([a, a[:, -1:].expand(1, R - a.shape[1])], 1) for a in answers])  # (2, R)
    mask = torch.arange(R)[None] < torch.tensor(alens)[:, None]
    k0 = [k.clone() for k in cache.k]
    per_q = lk.answer_attention(model, cache, padded, next_pos, mask, per_query_head=True)
    per_kv = lk.answer_attention(model, cache, padded, next_pos, mask)
    assert len(cache) == S and all(torch.equal(a, b) for a, b in zip(k0, cache.k))  # the cache is left as it was
    for b, (p, a) in enumerate(zip(prompts, answers)):
        n, r = p.shape[1], a.shape[1]
        cap = Capture()
        model(torch.cat([p, a], 1), positions=pos(0, n + r), hook=cap)
        for l in range(L):
            A = explicit_probs(cap.q[l], cap.k[l])  # (1, H, n + r, n + r)
            want = A[0, :, n:, :n].mean(1).float()  # (H, n): the answer's rows over the prompt
            got = per_q[l][b]  # (H, S): left padding first
            assert got.shape == (cfg.num_attention_heads, S)
            assert torch.allclose(got[:, S - n:], want, atol=1e-5), (b, l)
            assert (got[:, : S - n] == 0).all()  # the padding gets nothing
            assert (got.sum(-1) < 1).all()  # the answer attends to itself too
            assert torch.allclose(per_kv[l][b, :, S - n:], want.view(-1, G, n).mean(1), atol=1e-5), (b, l)
    # control: without the mask, row 0's padded answer tokens count, and its scores change
    unmasked = lk.answer_attention(model, cache, padded, next_pos)
    assert not torch.allclose(unmasked[0][0], per_kv[0][0], atol=1e-4)
    assert torch.allclose(unmasked[0][1], per_kv[0][1], atol=1e-6)  # row 1's answer has no padding


# -----------------------------------------------------------------------------
# 5c. the small pieces: keep_slots, untrained_module, greedy, the clock


def test_keep_slots_gathers_each_layer_and_kv_head_in_place():
    model = tiny_model()
    cfg = model.config
    full, _, _, _ = compress_by(model, rand_ids(2, 12, seed=3), EvictConfig("full"))
    cache = full.copy()
    g = torch.Generator().manual_seed(0)
    kept = [torch.rand(2, cfg.num_key_value_heads, 12, generator=g).topk(c, -1).indices.sort(-1).values
            for c in (5, 3)]  # per layer its own budget, per row and KV head its own slots
    assert ev.keep_slots(cache, kept) is cache
    for l, idx in enumerate(kept):
        for b in range(2):
            for h in range(cfg.num_key_value_heads):
                assert torch.equal(cache.k[l][b, h], full.k[l][b, h, idx[b, h]])
                assert torch.equal(cache.v[l][b, h], full.v[l][b, h, idx[b, h]])
    assert [k.shape[2] for k in full.k] == [12, 12]  # the copy it was given was gathered, not the original
    assert ev.keep_slots(cache, []) is cache  # nothing to keep per layer: nothing done


def test_untrained_module_starts_at_the_token_scale_with_B_zero():
    model = tiny_model()
    torch.manual_seed(3)
    mod = lk.untrained_module(model, n_tokens=16, rank=4)
    torch.manual_seed(3)
    again = lk.untrained_module(model, n_tokens=16, rank=4)
    assert all(torch.equal(a, b) for a, b in zip(mod.state_dict().values(), again.state_dict().values()))  # seeded
    std = model.model.embed_tokens.weight.float().std().item()  # 0.15 here, not LookaheadModule's default 0.02
    assert mod.embeddings.shape == (16, model.config.hidden_size)
    assert mod.embeddings.std().item() == pytest.approx(std, rel=0.1)
    assert mod.targets == LookaheadModule.TARGETS and len(mod.targets) == 7
    assert (mod.rank, mod.alpha) == (4, 32)
    for name, p in mod.named_parameters():
        assert p.dtype == torch.float32 and p.device == model.lm_head.weight.device, name
        assert (p == 0).all() == name.endswith("_B"), name  # LoRA B zero, A and P not


def test_the_defaults_are_the_shipped_configuration():
    """LookaheadModule's and untrained_module's defaults are what the shipped adapter's .json says: an
    untrained row next to it differs only in training, and a new adapter trains the shipped shape."""
    import json
    from pathlib import Path

    shipped = json.loads((Path(lk.__file__).parent / "weights" / "SmolLM2-135M-Instruct.lookahead.json").read_text())
    model = tiny_model()
    mod = lk.untrained_module(model)
    got = dict(n_tokens=mod.n_tokens, rank=mod.rank, alpha=mod.alpha, targets=list(mod.targets))
    assert got == {k: shipped[k] for k in got}
    # what the shipped .json recommends beyond the paper (applied only when a flag asks: generate.py --pool,
    # --layer-budgets): its rule parses, its per-layer weights are one per layer of SmolLM2-135M (30)
    assert repr(methods.parse_rule(shipped["rule"])) == shipped["rule"]
    assert len(shipped["layer_weights"]) == 30 and mod.info == {}
    assert len([n for n, _ in mod.named_parameters() if n.endswith("_B")]) == 7 * model.config.num_hidden_layers
    # float32 whatever the model's dtype (the module trains in float32)
    half = tiny_model().to(torch.bfloat16)
    assert all(p.dtype == torch.float32 for p in lk.untrained_module(half, n_tokens=4).parameters())
    # the default targets of LookaheadModule itself are the seven as well
    assert LookaheadModule(model.config, n_tokens=4).targets == LookaheadModule.TARGETS


def test_greedy_returns_each_rows_answer_up_to_its_stop_token():
    model = tiny_model()
    ids = rand_ids(2, 20, seed=6)
    cache, logits, pos_, _ = compress_by(model, ids, EvictConfig("full"))
    free = ev.greedy(model, cache.copy(), logits, pos_, 8, ())
    assert [len(a) for a in free] == [8, 8]
    assert free == torch.stack(list(decode(model, cache.copy(), logits, pos_, 8)), 1).tolist()
    stop = free[1][2]  # row 1 stops at its third token
    got = ev.greedy(model, cache, logits, pos_, 8, (stop,))
    assert got[1] == free[1][:3]  # the stop token kept
    assert got[0] == free[0][:free[0].index(stop) + 1] if stop in free[0] else got[0] == free[0]


def test_compress_marks_the_clock_after_the_prefill_and_after_the_eviction():
    model = tiny_model()

    class Clock:
        def __init__(self):
            self.marks = []

        def mark(self):
            self.marks.append(len(cache_sizes))

    cache_sizes = []
    real = ev.keep_slots
    clock = Clock()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ev, "keep_slots", lambda cache, kept: (cache_sizes.append(len(cache)), real(cache, kept))[1])
        compress_by(model, rand_ids(1, 40), EvictConfig("snapkv", budget=16, window=4), clock=clock)
    assert clock.marks == [0, 1]  # one mark before the eviction's gather, one after it
    clock = ev.Stopwatch("cpu")
    clock.mark()
    compress_by(model, rand_ids(1, 40), EvictConfig("full"), clock=clock)
    assert len(clock.marks) == 3 and clock.ms(0, 1) > 0 and clock.ms(1, 2) >= 0  # full: nothing evicted


@pytest.mark.parametrize("chunk_size", [4096, 12])
def test_the_papers_inference_on_one_screen_keeps_what_the_shared_steps_keep(chunk_size):
    """lookahead_compress (append the M rows, prefill with their LoRA, score, max-pool, top C, drop the rows'
    K/V, gather) against compress(), the steps every method runs, on a left-padded batch, in one chunk and in
    several: the same kept slots, the same cache, the same first-token logits; a prompt that fits C and the
    two-pass form go through compress() itself."""
    model = tiny_model()
    mod = random_module(model.config, 8, targets=LookaheadModule.TARGETS)
    lens, S = (40, 31), 40
    ids = rand_ids(2, S, seed=3)
    pad = torch.stack([torch.arange(S) >= S - n for n in lens])
    ids = ids.masked_fill(~pad, 0)
    scorer = make_scorer(EvictConfig("lookahead", budget=16, chunk_size=chunk_size), mod)
    cache, logits, next_pos, kept = lk.lookahead_compress(model, ids, scorer, pad)
    ref_cache, ref_logits, ref_pos, ref_kept = compress(model, ids, scorer, pad)
    assert next_pos.tolist() == ref_pos.tolist() == list(lens)
    assert torch.allclose(logits, ref_logits, atol=REORDER_ATOL)
    assert all(torch.equal(a, b) for a, b in zip(kept, ref_kept))
    assert len(cache) == 16 and all(torch.equal(a, b) for a, b in zip(cache.k + cache.v, ref_cache.k + ref_cache.v))
    fits = make_scorer(EvictConfig("lookahead", budget=S), mod)
    assert lk.lookahead_compress(model, ids, fits, pad)[3] is None
    two_pass = make_scorer(EvictConfig("lookahead", budget=16, options=dict(one_pass=False)), mod)
    assert all(torch.equal(a, b) for a, b in zip(lk.lookahead_compress(model, ids, two_pass, pad)[3], kept))


# -----------------------------------------------------------------------------
# 6. decoding after eviction == a full forward with the evicted keys masked out


def test_decode_after_eviction_equals_masked_full_forward(monkeypatch):
    """After snapkv eviction, decode 3 tokens on the compact cache. Reference: ONE forward over
    prompt + the 2 fed tokens with no cache at all, in which the queries of the generated tokens
    may attend, per (layer, KV head), only to the prompt keys that head kept (+ all generated
    keys); prompt queries keep their normal causal attention, since the prompt's KV was computed
    before eviction. The restriction is applied by wrapping model.attention_mask (the function
    Attention uses for its boolean mask; a per-KV-head mask is repeated over the query heads by
    Attention itself); a Hook tells the wrapper which layer is running, and a pad_mask of all
    True forces the masked path. Positions, the gather and the per-head masks all have to be
    right for the logits to agree."""
    model = tiny_model(num_hidden_layers=3)
    cfg = model.config
    L, Hkv = cfg.num_hidden_layers, cfg.num_key_value_heads
    S, C = 32, 12
    ids = rand_ids(1, S, seed=11)
    full, _, _, _ = compress_by(model, ids, EvictConfig("full"))
    cache, logits0, next_pos, _ = compress_by(model, ids, EvictConfig("snapkv", budget=C, window=4))
    kept = [kept_slots(full.k[l], cache.k[l])[0] for l in range(L)]  # (H_kv, C) per layer
    assert any(set(kept[l][0].tolist()) != set(kept[l][1].tolist()) for l in range(L)), "heads kept the same"
    # decode by hand, keeping the logits
    step_logits, toks = [logits0], [logits0.argmax(-1)]
    for t in range(2):
        lg = model(toks[-1][:, None], positions=(next_pos + t)[:, None], cache=cache)[:, -1]
        step_logits.append(lg)
        toks.append(lg.argmax(-1))
    # decode yields the same tokens on a fresh compressed cache
    cache2, lg0, np2, _ = compress_by(model, ids, EvictConfig("snapkv", budget=C, window=4))
    assert [t.item() for t in decode(model, cache2, lg0, np2, 3)] == [t.item() for t in toks]

    # reference
    seq = torch.cat([ids, toks[0][:, None], toks[1][:, None]], dim=1)  # (1, S + 2)
    T = S + 2
    allowed = []
    for l in range(L):
        a = torch.ones(1, Hkv, T, T, dtype=torch.bool)
        for h in range(Hkv):
            row = torch.zeros(T, dtype=torch.bool)
            row[kept[l][h]] = True
            row[S:] = True
            a[0, h, S:] = row  # generated queries only
        allowed.append(a)

    class Layer(Hook):
        layer = None

        def attn(self, layer, q, k, kv):
            self.layer = layer

    tracker = Layer()

    def restricted(Tq, Tk, key_valid, device, restrict=True):
        m = attention_mask(Tq, Tk, key_valid, device)  # the original
        return m & allowed[tracker.layer] if restrict else m

    monkeypatch.setattr("model.attention_mask", restricted)  # where Attention looks it up
    ref = model(seq, positions=pos(0, T), pad_mask=torch.ones(1, T, dtype=torch.bool), hook=tracker)
    for t in range(3):
        assert torch.allclose(step_logits[t], ref[:, S - 1 + t], atol=1e-4), t
    # control: without the restriction the reference is the full-cache model, which differs
    monkeypatch.setattr("model.attention_mask", lambda *a: restricted(*a, restrict=False))
    unrestricted = model(seq, positions=pos(0, T), pad_mask=torch.ones(1, T, dtype=torch.bool), hook=tracker)
    assert (unrestricted[:, S:] - ref[:, S:]).abs().max() > 1e-2


# -----------------------------------------------------------------------------
# 7. H2O against the explicit S x S attention matrix


def h2o_reference(cap, G, S):
    """Column sums of the causal softmax over all S queries, per query head, averaged over the
    GQA group, divided by the number of queries that see each key (S - j)."""
    out = {}
    for l in cap.q:
        A = explicit_probs(cap.q[l], cap.k[l])  # (B, H, S, S)
        col = A.sum(2)  # (B, H, S)
        B, H, _ = col.shape
        out[l] = (col.view(B, H // G, G, S).mean(2) / (S - torch.arange(S))).float()
    return out


def test_h2o_equals_explicit_attention_matrix_and_chunking():
    model = tiny_model(num_hidden_layers=3)
    cfg = model.config
    G = cfg.num_attention_heads // cfg.num_key_value_heads
    S = 37
    ids = rand_ids(1, S, seed=12)
    cap = Capture()
    model(ids, positions=pos(0, S), hook=cap)
    ref = h2o_reference(cap, G, S)
    x = model.model.embed_tokens(ids)
    for rows, chunk in [(256, 4096), (5, 4096), (256, 8), (3, 10)]:  # query sub-chunks, prefill chunks
        h = H2OHook(rows=rows)
        ev.prefill(model, x, pos(0, S), KVCache(cfg.num_hidden_layers), hook=h, chunk_size=chunk)
        got = h.scores(None, G)
        for l in range(cfg.num_hidden_layers):
            assert torch.allclose(got[l], ref[l], atol=1e-6), (rows, chunk, l)
    # a late key is not favoured by position alone: the last key's score is its one query's weight
    last_row = explicit_probs(cap.q[0], cap.k[0])[:, :, -1, -1].view(1, 2, G).mean(-1).float()
    assert torch.allclose(ref[0][..., -1], last_row)
    # compress: chunked h2o keeps the same cache
    a = compress_by(model, ids, EvictConfig("h2o", budget=16, window=4))
    b = compress_by(model, ids, EvictConfig("h2o", budget=16, window=4, chunk_size=8))
    for l in range(cfg.num_hidden_layers):
        assert torch.allclose(a[0].k[l], b[0].k[l], atol=ATOL)
    assert torch.allclose(a[1], b[1], atol=ATOL)


# -----------------------------------------------------------------------------
# 8. chunked prefill


def _same_compress_by(model, ids, ec_a, ec_b, **kw):
    a = compress_by(model, ids, ec_a, **kw)
    b = compress_by(model, ids, ec_b, **kw)
    assert torch.allclose(a[1], b[1], atol=ATOL), "first-token logits differ"
    assert torch.equal(a[2], b[2])
    for l in range(model.config.num_hidden_layers):
        assert a[0].k[l].shape == b[0].k[l].shape
        assert torch.allclose(a[0].k[l], b[0].k[l], atol=ATOL) and torch.allclose(a[0].v[l], b[0].v[l], atol=ATOL)


@pytest.mark.parametrize("method,extra", [("full", {}), ("snapkv", {}), ("pyramidkv", {}), ("laq", {}),
                                          ("lookahead", dict(one_pass=True)), ("lookahead", dict(one_pass=False)),
                                          ("oracle", {})])
def test_chunked_prefill_changes_nothing(method, extra):
    model = tiny_model(num_hidden_layers=3)
    ids = rand_ids(1, 50, seed=13)
    kw = {}
    if method == "lookahead":
        kw["module"] = random_module(model.config, 8)
    if method == "oracle":
        kw["response"] = rand_ids(1, 5, seed=14)
    base = dict(budget=20, window=8, options=dict(draft_tokens=4) if method == "laq" else extra)
    _same_compress_by(model, ids, EvictConfig(method, **base), EvictConfig(method, chunk_size=16, **base), **kw)


@pytest.mark.parametrize("method", ["snapkv", "lookahead"])
def test_chunk_smaller_than_window_or_lookahead_rows(method):
    model = tiny_model()
    ids = rand_ids(1, 50, seed=13)
    kw = dict(module=random_module(model.config, 8)) if method == "lookahead" else {}
    base = dict(budget=20, window=8)
    _same_compress_by(model, ids, EvictConfig(method, **base), EvictConfig(method, chunk_size=4, **base), **kw)


# -----------------------------------------------------------------------------
# 9. left-padded batches


def _padded_batch_matches_rows(method, model, mod=None, rule=None):
    cfg = model.config
    lens = (40, 28)
    S = max(lens)
    rows = [rand_ids(1, n, seed=20 + i) for i, n in enumerate(lens)]
    ids = torch.cat([torch.cat([torch.zeros(1, S - r.shape[1], dtype=torch.long), r], 1) for r in rows])
    pad = torch.stack([torch.arange(S) >= S - n for n in lens])
    ec = EvictConfig(method, budget=16, window=4, rule=rule)
    kw = dict(module=mod) if mod is not None else {}
    full_b, _, _, _ = compress_by(model, ids, EvictConfig("full"), pad_mask=pad)
    cache_b, logits_b, pos_b, _ = compress_by(model, ids, ec, pad_mask=pad, **kw)
    assert pos_b.tolist() == list(lens)
    tok = torch.tensor([5, 9])
    step_b = model(tok[:, None], positions=pos_b[:, None], cache=cache_b)[:, -1]  # one decode step
    for b, (r, n) in enumerate(zip(rows, lens)):
        full_r, _, _, _ = compress_by(model, r, EvictConfig("full"))
        cache_r, logits_r, pos_r, _ = compress_by(model, r, ec, **kw)
        assert torch.allclose(logits_b[b], logits_r[0], atol=1e-4), "first logits"
        step_r = model(tok[b:b + 1, None], positions=pos_r[:, None], cache=cache_r)[:, -1]
        assert torch.allclose(step_b[b], step_r[0], atol=1e-4), "logits after one decode step"
        for l in range(cfg.num_hidden_layers):
            kb = cache_b.k[l][b:b + 1, :, :16]
            slots_b = kept_slots(full_b.k[l][b:b + 1], kb) - (S - n)  # batch slot -> prompt position
            slots_r = kept_slots(full_r.k[l], cache_r.k[l][:, :, :16])
            assert torch.equal(slots_b, slots_r), (b, l)
            assert cache_b.valid[l][b, :, :16].all()  # no padding kept


@pytest.mark.parametrize("method", ["snapkv", "streaming", "lookahead"])
def test_left_padded_batch_matches_each_row_alone(method):
    model = tiny_model()
    mod = random_module(model.config, 8) if method == "lookahead" else None
    # lookahead avg-pooled: its default max-pooling makes plateaus of exactly equal scores, and topk may break
    # such a tie at the C-th slot one way in a padded row and the other alone (both are the top C)
    _padded_batch_matches_rows(method, model, mod, Pool("avg", 5) if method == "lookahead" else None)


def test_left_padded_batch_h2o():
    model = tiny_model()
    S = 20
    pad = (torch.arange(S) >= 6)[None]  # 6 padding slots
    h = H2OHook()
    ev.prefill(model, model.model.embed_tokens(rand_ids(1, S)), (pad.long().cumsum(-1) - 1).clamp(min=0),
               KVCache(model.config.num_hidden_layers), pad, hook=h)
    scores = h.scores(pad[:, None], 2)
    assert all(torch.isfinite(s[..., 6:]).all() for s in scores.values()), "NaN scores for the real tokens"
    _padded_batch_matches_rows("h2o", model)


@pytest.mark.parametrize("L", [1, 2, 3, 4, 5, 30])
@pytest.mark.parametrize("C,W", [(24, 8), (128, 32), (64, 8)])
def test_pyramid_budgets_fall_with_depth_and_average_C(L, C, W):
    b = baselines.pyramid_budgets(C, W, L, 20)
    assert len(b) == L and b == sorted(b, reverse=True) and b[-1] >= W
    assert abs(sum(b) / L - C) <= 0.5


# -----------------------------------------------------------------------------
# 10. the adapter file


def test_adapter_round_trip(tmp_path):
    cfg = ModelConfig(**TINY)
    mod = random_module(cfg, 8, ("q_proj", "k_proj", "down_proj"))
    mod.info = dict(rule="max:7", layer_weights=[1.0, 3.0], steps=12, heldout=dict(kl=0.25))
    path = tmp_path / "a.safetensors"
    mod.save(path)
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["base_model"] == "tiny" and meta["base_fingerprint"] == cfg.fingerprint()
    back = LookaheadModule.load(path, cfg)
    assert (back.n_tokens, back.rank, back.alpha, back.targets) == (8, 8, 32, ("q_proj", "k_proj", "down_proj"))
    assert back.info == dict(rule="max:7", layer_weights=[1.0, 3.0], steps=12, heldout=dict(kl=0.25))
    assert meta["rule"] == "max:7" and meta["layer_weights"] == [1.0, 3.0]  # beside the keys, as written
    sa, sb = mod.state_dict(), back.state_dict()
    assert sa.keys() == sb.keys() and len(sa) == 1 + 3 * 2 * cfg.num_hidden_layers
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert back.metadata() == mod.metadata()


def test_adapter_for_another_model_is_refused(tmp_path):
    cfg = ModelConfig(**TINY)
    path = tmp_path / "a.safetensors"
    random_module(cfg, 8).save(path)
    other = ModelConfig(**{**TINY, "hidden_size": 32, "name": "other-model"})
    with pytest.raises(ValueError, match=r"trained for 'tiny'.*not for this model 'other-model'"):
        LookaheadModule.load(path, other)
    with pytest.raises(FileNotFoundError, match="not found"):
        LookaheadModule.load(tmp_path / "missing.safetensors", cfg)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "wrong_shape"])
def test_corrupt_adapter_is_refused(tmp_path, damage):
    cfg = ModelConfig(**TINY)
    path = tmp_path / "a.safetensors"
    random_module(cfg, 8).save(path)
    raw = path.read_bytes()
    if damage == "garbage":
        path.write_bytes(b"\x00\x01not a safetensors file at all" * 10)
    elif damage == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "empty":
        path.write_bytes(b"")
    else:  # the metadata says rank 4, the tensors have rank 8
        meta = json.loads(path.with_suffix(".json").read_text())
        path.with_suffix(".json").write_text(json.dumps(dict(meta, rank=4)))
    said = "has shape .* its .json implies" if damage == "wrong_shape" else "is not a readable safetensors file"
    with pytest.raises(ValueError, match=f"{said}.*retrain it"):
        LookaheadModule.load(path, cfg)


# -----------------------------------------------------------------------------
# 11. group_attention


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("valid", [None, "shared", "per_head", "blind"])
def test_group_attention_equals_repeat_interleave(causal, valid):
    torch.manual_seed(0)
    B, H, Hkv, Tq, Tk, D = 2, 6, 2, 3, 9, 8
    q = torch.randn(B, H, Tq, D) * 2
    k = torch.randn(B, Hkv, Tk, D) * 2
    kv = None
    if valid == "shared":
        kv = torch.ones(B, 1, Tk, dtype=torch.bool)
        kv[1, 0, :3] = False  # left padding of row 1
    elif valid == "per_head":
        kv = torch.rand(B, Hkv, Tk, generator=torch.Generator().manual_seed(1)) > 0.3
        kv[..., -Tq:] = True  # every query row keeps at least its own key
    elif valid == "blind":  # row 1 is all padding but its last key: its first queries see no key at all
        kv = torch.ones(B, 1, Tk, dtype=torch.bool)
        kv[1, 0, :-1] = False
    got = ev.group_attention(q, k, kv, causal=causal)  # (B, H_kv, G*Tq, Tk)
    if valid == "blind":  # such a query's row is 0 (never NaN); the others attend as usual
        assert not got.isnan().any()
        seen = got.view(B, Hkv, 3, Tq, Tk)[1].sum(-1)  # (H_kv, G, Tq)
        if causal:
            assert (seen[..., :-1] == 0).all() and torch.allclose(seen[..., -1], torch.ones(Hkv, 3))
        else:
            assert torch.allclose(seen, torch.ones(Hkv, 3, Tq))
        got, q, k, kv, B = got[:1], q[:1], k[:1], kv[:1], 1  # the reference below: the other row
    assert got.shape == (B, Hkv, 3 * Tq, Tk) and got.dtype == torch.float32
    ref = explicit_probs(q, k, causal, kv)  # (B, H, Tq, Tk)
    assert torch.allclose(got.view(B, Hkv, 3, Tq, Tk).reshape(B, H, Tq, Tk), ref.float(), atol=1e-6)
    if causal:  # bottom-right: query t sits at slot Tk - Tq + t
        assert got.view(B, Hkv, 3, Tq, Tk)[..., 0, Tk - Tq + 1:].abs().max() == 0
        if valid is None:  # the last query sees every key
            assert (got.view(B, Hkv, 3, Tq, Tk)[..., -1, :] > 0).all()


# -----------------------------------------------------------------------------
# 11. memory: nothing on the inference path is S x S


class Shapes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the shape of every tensor any aten op returns."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out


@pytest.mark.parametrize("method", list(methods.METHODS))
def test_inference_never_builds_an_S_by_S_tensor(method, monkeypatch):
    # with chunked prefill every attention matrix, mask and score is (rows <= chunk) x S; a tensor
    # with two dims >= S would be an S x S attention matrix (or mask) somewhere
    from torch.utils._python_dispatch import _disable_current_modes

    def causal_bias(T, Tk):  # a Tensor subclass cannot be created under a dispatch mode: build it outside
        with _disable_current_modes():
            return causal_lower_right(T, Tk)  # the ops SDPA runs with it are still recorded

    monkeypatch.setattr("model.causal_lower_right", causal_bias)
    model = tiny_model()
    S, chunk = 200, 48  # S > vocab (128), so a (S, V) tensor cannot hide here either
    ids = rand_ids(1, S, seed=3)
    kw = method_kwargs(method, model.config)
    if method == "lookahead":
        kw["module"] = random_module(model.config, 8)
    for one_pass in ((True, False) if method == "lookahead" else (True,)):
        ec = EvictConfig(method, budget=32, window=8, chunk_size=chunk, options=settings(method, one_pass, 4))
        with Shapes() as rec:
            cache, logits, next_pos, _ = compress_by(model, ids, ec, **kw)
            for _ in decode(model, cache, logits, next_pos, 3):
                pass
        big = [(f, s) for f, s in rec.shapes if sum(d >= S for d in s) >= 2]
        assert not big, big[:3]
        assert any(len(s) >= 2 and s[-1] >= S for _, s in rec.shapes)  # the recorder saw the (rows, S) scores


# -----------------------------------------------------------------------------
# baselines as their authors wrote them: pooling, LAQ, PyramidKV


@pytest.mark.parametrize("kernel", [0, 2, 4, -1])
def test_even_or_non_positive_pooling_width_is_refused(kernel):
    with pytest.raises(ValueError, match="must be odd"):
        Pool("avg", kernel)
    with pytest.raises(ValueError, match="must be odd"):
        Pool("max", kernel)
    # as text (--pool, an adapter's "rule"): an even width says so, a negative one is no width at all
    with pytest.raises(ValueError, match="must be odd" if kernel >= 0 else "selection rule 'avg:-1'"):
        methods.parse_rule(f"avg:{kernel}")


def test_rules_parse_from_text_and_unknown_ones_are_refused():
    assert [repr(methods.parse_rule(t)) for t in ("none", "avg:5", "max:7", "avg", "max", "span:8", "span")] == [
        "none", "avg:5", "max:7", "avg:5", "max:7", "span:8", "span:8"]
    for bad in ("sum:3", "chunk:4", "carry:3", "none:3", "avg:x", ""):
        with pytest.raises(ValueError, match="selection rule"):
            methods.parse_rule(bad)
    with pytest.raises(ValueError, match="unknown pooling 'sum'"):
        Pool("sum", 3)


@pytest.mark.parametrize("method", ["full", "streaming", "random", "oracle"])
def test_unpooled_methods_refuse_a_selection_rule(method):
    """Methods that select by their own scores alone (position, chance, the truth) take no rule."""
    kw = method_kwargs(method, ModelConfig(**TINY))
    with pytest.raises(ValueError, match="selects by its own scores alone"):
        make_scorer(EvictConfig(method, budget=16, rule=Pool("avg", 5)), **kw)
    assert repr(make_scorer(EvictConfig(method, budget=16), **kw).rule) == "none"


@pytest.mark.parametrize("budget", [0, -3])
@pytest.mark.parametrize("method", ["lookahead", "random", "full"])
def test_budget_below_one_is_refused(method, budget):
    model = tiny_model()
    with pytest.raises(ValueError, match="at least 1"):
        compress_by(model, rand_ids(1, 40), EvictConfig(method, budget=budget), **method_kwargs(method, model.config))


def test_pooling_with_a_window_pools_only_the_prefix():
    """SnapKV's code pools the scores before the window only: the window (kept anyway) must not
    lend its large scores to the tokens just before it."""
    s = torch.zeros(1, 1, 12)
    s[..., 8:] = 10.0  # a window of 4 with huge scores
    s[..., 2] = 1.0
    p = Pool("avg", 5).smooth(s, window=4)
    assert torch.equal(p[..., 8:], s[..., 8:])  # the window as it was
    assert p[0, 0, :8].tolist() == pytest.approx([0.2, 0.2, 0.2, 0.2, 0.2, 0, 0, 0])  # no leak into 5..7
    whole = Pool("avg", 5).smooth(s)  # without the window argument everything is pooled
    assert whole[0, 0, 7].item() == pytest.approx(4.0)  # (10 + 10) / 5: the window leaks in
    # max pooling ignores the padding at the edges; avg divides by the full width (damped edges)
    e = torch.tensor([[[3.0, 0.0, 0.0, 0.0, 0.0]]])
    assert Pool("max", 3).smooth(e).tolist() == [[[3.0, 3.0, 0.0, 0.0, 0.0]]]
    assert Pool("avg", 3).smooth(e)[0, 0].tolist() == pytest.approx([1.0, 1.0, 0.0, 0.0, 0.0])
    assert Pool("none").smooth(e) is e and Pool("avg", 1).smooth(e) is e  # width 1: unpooled
    # broadcast over the layers stacked in front
    assert torch.equal(Pool("max", 3).smooth(e.expand(2, 1, 3, 5))[1, 0, 2], torch.tensor([3.0, 3, 0, 0, 0]))


def test_laq_pools_its_final_rescores(monkeypatch):
    """LAQ's reference code pools the re-scores of the draft queries like its SnapKV step."""
    model = tiny_model()
    S, C, W = 48, 16, 4
    ids = rand_ids(1, S, seed=31)
    seen = {}
    real = baselines.laq_scores
    monkeypatch.setattr(baselines, "laq_scores", lambda *a: seen.setdefault("s", real(*a)))
    _, _, _, kept = compress_by(model, ids, EvictConfig("laq", budget=C, window=W, rule=Pool("avg", 5), options=dict(draft_tokens=4)))
    win = (torch.arange(S) >= S - W)[None, None]
    pooled = select(Pool("avg", 5).smooth(stack_layers(seen["s"]), W), C, protect=win)
    unpooled = select(stack_layers(seen["s"]), C, protect=win)
    assert all(torch.equal(k, p) for k, p in zip(kept, pooled))
    assert not all(torch.equal(k, u) for k, u in zip(kept, unpooled))  # pooling changes what is kept


@pytest.mark.parametrize("L,C,W,S", [(3, 24, 8, 30), (30, 128, 32, 140), (5, 64, 8, 65), (4, 20, 4, 21)])
def test_pyramid_budgets_clipped_at_S_give_the_rest_to_other_layers(L, C, W, S):
    raw = baselines.pyramid_budgets(C, W, L, 20)
    assert max(raw) > S  # the first layers would want more than the prompt holds
    b = baselines.pyramid_budgets(C, W, L, 20, S)
    assert max(b) <= S and min(b) >= W
    assert abs(sum(b) - sum(raw)) == 0  # nothing lost: the mean stays as it was (C, up to rounding)
    assert b == sorted(b, reverse=True)  # still falling with depth


def test_pyramidkv_keeps_C_per_layer_on_average_when_layers_clip():
    model = tiny_model(num_hidden_layers=3)
    S, C, W = 30, 24, 8  # raw budgets 40, 24, 8: the first layer clips at 30
    _, _, _, kept = compress_by(model, rand_ids(1, S, seed=5), EvictConfig("pyramidkv", budget=C, window=W))
    sizes = [k.shape[-1] for k in kept]
    assert max(sizes) <= S and sum(sizes) == 3 * C
    # the paper's C in every layer overrides the pyramid
    flat = EvictConfig("pyramidkv", budget=C, window=W, budgets=ev.uniform_budgets)
    assert [k.shape[-1] for k in compress_by(model, rand_ids(1, S, seed=5), flat)[3]] == [C] * 3


def test_every_method_is_one_scorer_in_the_table():
    assert list(methods.METHODS) == ["full", "streaming", "random", "snapkv", "pyramidkv", "h2o", "laq", "oracle",
                                     "lookahead"]
    cfg = ModelConfig(**TINY)
    for name, cls in methods.METHODS.items():
        assert issubclass(cls, ev.Scorer) and cls.__doc__, name
        scorer = make_scorer(EvictConfig(name, budget=16, window=4), **method_kwargs(name, cfg))
        assert scorer.eviction.method == name and type(scorer) is cls, name
        # the core knows only the paper and the baselines: no scorer carries an extension's method
        assert not [n for n in dir(scorer) if n.startswith("decode")], name


def test_adapter_json_keys_beyond_the_modules_shape_are_kept_unread(tmp_path):
    """The loader's rule for an adapter .json's other keys (LookaheadModule.load): kept as they are in
    module.info, never refused, and written back by save(); selection reads only "rule" and "layer_weights"."""
    cfg = ModelConfig(**TINY)
    LookaheadModule(cfg, n_tokens=4).save(tmp_path / "a.safetensors")
    meta = dict(json.loads((tmp_path / "a.json").read_text()), note="a person's words", train_data=dict(n_train=3))
    (tmp_path / "a.json").write_text(json.dumps(meta))
    module = methods.load_adapter(tmp_path / "a.safetensors", cfg)
    assert module.info == dict(note="a person's words", train_data=dict(n_train=3))
    assert methods.adapter_selection(module) == (None, None)  # nothing of it selects
    module.save(tmp_path / "b.safetensors")
    assert json.loads((tmp_path / "b.json").read_text()) == meta


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-1", "0"])
def test_adapter_numbers_that_parse_but_cannot_work_are_refused(tmp_path, bad):
    """An adapter .json with "alpha": NaN (JSON that Python parses) would answer nonsense with exit 0: refused at
    load, naming the file and the key."""
    cfg = ModelConfig(**TINY)
    LookaheadModule(cfg, n_tokens=4).save(tmp_path / "a.safetensors")
    meta = tmp_path / "a.json"
    meta.write_text(meta.read_text().replace('"alpha": 32,', f'"alpha": {bad},'))
    assert f'"alpha": {bad}' in meta.read_text()
    with pytest.raises(ValueError, match=rf"{meta}: 'alpha' is .*, not a finite number > 0"):
        LookaheadModule.load(tmp_path / "a.safetensors", cfg)


@pytest.mark.parametrize("key, value, said", [
    ("n_tokens", 10**30, r"n_tokens 10{30}, rank 8 and its targets make \d+ numbers, more than its tensors file"),
    ("rank", 10**12, r"n_tokens 4, rank 10{12} and its targets make \d+ numbers, more than its tensors file"),
    ("alpha", 1e30, r"its LoRA on layer 0's q_proj has gain \(alpha / rank\) \|B\| \|A\| = .*e\+29, past 1e\+06"),
    ("embeddings", 1e12, r"its embeddings reach 1e\+12, past 1e\+06"),
    ("layer_weights", ["1", "2"], r'layer_weights must be a list of numbers, got \["1", "2"\]'),
    ("layer_weights", [True, False], r"layer_weights must be a list of numbers, got \[true, false\]"),
    ("layer_weights", [1e308, 1e308], r"layer_weights sum to inf: write them with mean 1"),
], ids=["n_tokens-huge", "rank-huge", "alpha-overflows", "embeddings-huge", "weights-strings", "weights-bools",
        "weights-sum-inf"])
def test_adapter_values_that_are_finite_but_cannot_work_are_refused(tmp_path, key, value, said):
    """Values of an adapter's .json (or tensors) that parse and are finite, yet fail late or silently: a rank
    of 10**12 allocated the module first (an overflow TypeError, or all the memory), an "alpha" of 1e30 made the
    M rows' attention NaN (a selection at random, exit 0), layer weights "1" or true read as numbers. Each is
    one ValueError naming the file, at load."""
    cfg = ModelConfig(**TINY)
    module = random_module(cfg, 4)
    if key == "embeddings":
        with torch.no_grad():
            module.embeddings.mul_(value / module.embeddings.abs().max())
    module.save(tmp_path / "a.safetensors")
    meta = json.loads((tmp_path / "a.json").read_text())
    if key != "embeddings":
        meta[key] = value
    (tmp_path / "a.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=rf"a\.(json|safetensors)\b.*{said}") as e:
        methods.load_adapter(tmp_path / "a.safetensors", cfg)
    assert "\n" not in str(e.value) and ("retrain" in str(e.value) or "fix" in str(e.value))
    if key == "alpha":  # the same adapter with its own alpha loads
        (tmp_path / "a.json").write_text(json.dumps(dict(meta, alpha=32)))
        assert methods.load_adapter(tmp_path / "a.safetensors", cfg).alpha == 32
