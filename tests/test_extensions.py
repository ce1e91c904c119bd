"""Tests of extensions/: the ideas beyond the paper, each behind one seam of eviction.py.

- span.py: the span rule computes the surprisal only on candidate tokens, yet keeps exactly the slots
  of the full computation (every token's surprisal, then span_scores and the top C), for several
  budgets, per-layer budgets and a protected window; span_scores by hand; token_surprisal is the
  model's own next-token loss.
- layer_budgets.py: LayerBudgets / spread_budgets follow the weights and keep the mean; an adapter's
  "rule" and "layer_weights" ride in its .json and methods.make_scorer applies them (an EvictConfig
  naming its own overrides them); measure() on a tiny model.
- layer_loss.py: the layer-weighted loss is kl_loss per layer, weighted; its weights are an adapter's
  layer_weights squared, a wrong file refused.
- decode.py: a fork keeps its own hook state (the rest is in test_decode_evict.py).

Tiny random models on CPU, float32, one thread (see test_lookaheadkv.py)."""

import math

import pytest
import torch

import methods
from baselines import WindowHook
from eviction import EvictConfig, Pool, compress, decode, prefill_and_score, select, uniform_budgets
from extensions.decode import DecodeEviction
from extensions.layer_budgets import FLOOR, LayerBudgets, layer_weights, measure, spread_budgets
from extensions.layer_loss import LayerWeightedKL, read_weights
from extensions.span import SURPRISE_NATS, Spanned, SpanRule, shortlist, span_scores, token_surprisal
from lookaheadkv import LookaheadModule, answer_attention, kl_loss
from methods import make_scorer
from model import Hook, KVCache
from test_lookaheadkv import _no_grad, compress_by, pos, rand_ids, random_module, tiny_model  # noqa: F401 (autouse)


class Hidden(Hook):
    """The final normed hidden states of a forward (B, T, hidden)."""

    def hidden(self, h):
        self.h = h


def every_token_surprisal(model, ids, pad_mask=None):
    """The reference: -log p(x_t | x_<t) of EVERY prompt token (where=None), from the prompt's own forward;
    with left padding, 0 on the padding and on each row's first real token (no context)."""
    B, S = ids.shape
    positions = pos(0, S, B) if pad_mask is None else (pad_mask.long().cumsum(-1) - 1).clamp(min=0)
    cap = Hidden()
    model(ids, positions=positions, pad_mask=pad_mask, hook=cap, logits_at=-1)
    return token_surprisal(model.lm_head, cap.h, ids).masked_fill(positions == 0, 0.0)


def span_reference(model, ids, scorer, run, kernel, pad_mask=None):
    """The kept slots with the surprisal of every token: span_scores on the prefix before the protected
    window, then per layer the top C_l (protected tokens inside the budget), as select does them. Returns
    them and the scores they were chosen by (L, B, H_kv, S; protected +inf, padding -inf)."""
    S, L = ids.shape[1], run.scores.shape[0]
    n = S - scorer.window
    surprisal = every_token_surprisal(model, ids, pad_mask)
    pooled = span_scores(run.scores[..., :n].float(), surprisal[:, :n], kernel).to(run.scores.dtype)
    scores = torch.cat([pooled, run.scores[..., n:]], dim=-1)
    protect = scorer.protect(run.positions)
    kept = [select(scores[l], b, run.valid, protect) for l, b in enumerate(scorer.layer_budgets(L, S))]
    scores = scores.float()
    if protect is not None:
        scores = scores.masked_fill(protect, float("inf"))
    if run.valid is not None:
        scores = scores.masked_fill(~run.valid, float("-inf"))
    return kept, scores


def assert_same_top(kept, want, scores):
    """kept is a top C_l of `scores` as much as want is, per (layer, row, KV head): the same scores kept.
    span_scores makes exact ties (a peak's x * 0.95^o reaches o places on both sides), and top-k may break
    a tie otherwise when the other scores differ (and a tiny model's attention underflows to exact 0s)."""
    for l, (a, b) in enumerate(zip(kept, want)):
        assert a.shape == b.shape
        sa, sb = (scores[l].gather(-1, x).sort(-1).values for x in (a, b))
        assert torch.equal(sa, sb), l


# -----------------------------------------------------------------------------
# span.py


@pytest.mark.parametrize("method", ["snapkv", "lookahead"])
@pytest.mark.parametrize("weights", [None, (0.5, 2.0, 0.5)])
@pytest.mark.parametrize("kernel", [4, 8])
def test_span_rule_keeps_what_the_surprisal_of_every_token_keeps(method, weights, kernel):
    """SpanRule computes the surprisal on the candidates only (the raw top C_l of any (layer, KV head),
    dilated by kernel - 1); the slots it keeps are those of the full computation, at every budget, with
    per-layer budgets, and with SnapKV's protected window. The claim is tested: at small budgets the
    candidates are a part of the prompt (one KV head, a long prompt), and the rule changes what is kept."""
    model = tiny_model(num_hidden_layers=3, num_key_value_heads=1)
    mod = random_module(model.config, 8) if method == "lookahead" else None
    S = 320
    ids = rand_ids(2, S, seed=7)
    budgets = None if weights is None else LayerBudgets(weights)
    shares, changed = [], 0
    for C in (8, 16, 32, 128):
        ec = EvictConfig(method, budget=C, window=4, rule=SpanRule(kernel), budgets=budgets)
        scorer = make_scorer(ec, mod)
        kept = compress(model, ids, scorer)[3]
        shares.append(scorer.rule.last_share)
        run = prefill_and_score(model, ids, make_scorer(ec, mod))
        want, scores = span_reference(model, ids, scorer, run, kernel)
        assert [k.shape[-1] for k in kept] == scorer.layer_budgets(3, S)
        assert_same_top(kept, want, scores)
        unpooled = make_scorer(EvictConfig(method, budget=C, window=4, rule=Pool("none"), budgets=budgets), mod)
        changed += any(not torch.equal(a, b) for a, b in zip(kept, unpooled.evict(run.scores, run)))
        if method == "snapkv":  # the window is kept whatever the rule
            assert all((k[..., -4:] == torch.arange(S - 4, S)).all() for k in kept)
    assert min(shares) < (0.5 if kernel == 4 else 0.8), shares  # sparse: the LM head ran on a part of the prompt
    assert changed >= 2  # the rule is not a no-op here


def test_span_rule_hand_values():
    """span: a peak shared, with decay 0.95 per place, inside a run of unpredictable tokens (surprisal
    above SURPRISE_NATS), on both sides, at most kernel - 1 places; predictable tokens keep their own."""
    hi, lo = 5.0, 0.1  # surprisal in nats: tokens 1..4 are one unpredictable run (a number's digits)
    assert lo < SURPRISE_NATS < hi
    surprisal = torch.tensor([[lo, hi, hi, hi, hi, lo, hi]])
    s = torch.tensor([[[0.0, 0.0, 0.0, 2.0, 0.0, 1.0, 0.0]]])  # the scorer found the number's third digit
    p = span_scores(s, surprisal, 3)[0, 0].tolist()
    # digits 1..4 within 2 places of the peak get it, decayed; token 5 (predictable) and 6 (its own run) do not
    assert p == pytest.approx([0.0, 2 * 0.95 ** 2, 2 * 0.95, 2.0, 2 * 0.95, 1.0, 0.0])
    assert select(span_scores(s, surprisal, 3), 4).tolist() == [[[1, 2, 3, 4]]]
    assert select(s, 4).tolist() != [[[1, 2, 3, 4]]]  # unpooled keeps scattered tokens
    assert span_scores(s, surprisal, 1).tolist() == s.tolist()  # width 1: unpooled
    assert SpanRule(1).smooth(s, None) is s  # and watches nothing: the method's own hook alone
    snap = make_scorer(EvictConfig("snapkv", budget=8, window=4, rule=Pool("none")))
    assert type(Spanned(snap, SpanRule(1)).prefill_hook(torch.zeros(1, 7, dtype=torch.long))) is WindowHook
    # a wider kernel carries further, but never out of the run
    assert span_scores(s, surprisal, 8)[0, 0].tolist() == pytest.approx(
        [0.0, 2 * 0.95 ** 2, 2 * 0.95, 2.0, 2 * 0.95, 1.0, 0.0])
    # broadcast over the layers stacked in front, and over the KV heads
    stacked = span_scores(s.expand(2, 1, 3, 7), surprisal, 3)
    assert torch.allclose(stacked, torch.tensor(p).expand(2, 1, 3, 7))
    with pytest.raises(ValueError, match="span width 0 must be >= 1"):
        SpanRule(0)
    assert repr(methods.parse_rule("span:4")) == "span:4" and methods.parse_rule("span:4").kernel == 4


def test_token_surprisal_is_the_models_own_next_token_loss():
    """token_surprisal reads -log p(token t | tokens < t) from the final hidden states, a slice of rows at a
    time: the same as the cross-entropy of the full logits; with `where`, those tokens only (the others
    0). In the prefill the span rule's hook keeps the prompt rows' hidden states (not the lookahead rows'),
    and compress keeps what the scorer's own evict step keeps from those scores."""
    model = tiny_model()
    ids = rand_ids(2, 37, seed=4)
    S = ids.shape[1]
    cap = Hidden()
    logits = model(ids, positions=pos(0, S, 2), cache=KVCache(model.config.num_hidden_layers), hook=cap)
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    got = token_surprisal(model.lm_head, cap.h, ids, rows=8)  # rows=8: several slices
    assert got.dtype == torch.float32 and got[:, 0].tolist() == [0.0, 0.0]
    assert torch.allclose(got[:, 1:], ref, atol=1e-5)
    where = torch.rand(2, S, generator=torch.Generator().manual_seed(1)) > 0.5
    some = token_surprisal(model.lm_head, cap.h, ids, where=where, rows=5)
    where[:, 0] = False
    assert torch.equal(some[~where], torch.zeros(int((~where).sum())))
    assert torch.allclose(some[where], got[where], atol=1e-6)
    # in the prefill (chunked, the lookahead rows riding along): the prompt rows' hidden states
    mod = random_module(model.config)
    ec = EvictConfig("lookahead", budget=12, chunk_size=16, rule=SpanRule(4))
    run = prefill_and_score(model, ids, make_scorer(ec, mod))
    assert torch.allclose(run.hook.states.states(), cap.h, atol=1e-5)
    scorer = make_scorer(ec, mod)
    assert isinstance(scorer.rule, SpanRule) and scorer.rule.kernel == 4
    kept = compress(model, ids, scorer)[3]
    assert all(torch.equal(a, b) for a, b in zip(kept, scorer.evict(run.scores, run)))
    unpooled = make_scorer(EvictConfig("lookahead", budget=12, rule=Pool("none")), mod).evict(run.scores, run)
    assert any(not torch.equal(a, b) for a, b in zip(kept, unpooled))  # the rule changed what is kept


def test_the_shortlist_gate_is_a_lower_bound_and_exact_with_the_whole_vocabulary():
    """With a shortlist of LM-head rows (the first ids and the prompt's own ids), log Z is summed over those
    rows only: every surprisal is at most the exact one (the gate can only call a token predictable), equal
    where the shortlist is the whole vocabulary; the rule with it keeps the exact rule's slots when its first
    ids cover the vocabulary, and differs from it on a short shortlist (the gate is read)."""
    model = tiny_model()
    V = model.config.vocab_size
    ids = rand_ids(2, 37, seed=4)
    cap = Hidden()
    model(ids, positions=pos(0, 37, 2), hook=cap, logits_at=-1)
    exact = token_surprisal(model.lm_head, cap.h, ids)
    vocab = shortlist(ids, V, 5)
    assert torch.equal(vocab, torch.unique(torch.cat([torch.arange(5), ids.flatten()])))  # sorted, no repeats
    assert len(vocab) < V
    cheap = token_surprisal(model.lm_head, cap.h, ids, rows=7, vocab=vocab)
    assert (cheap <= exact + 1e-5).all() and (cheap < exact - 1e-3).any()
    assert torch.allclose(token_surprisal(model.lm_head, cap.h, ids, vocab=shortlist(ids, V, V)), exact, atol=1e-5)
    mod = random_module(model.config, 8)
    ids = 10 + rand_ids(2, 37, seed=5) % 3  # three distinct ids: a shortlist of 4 rows sees no surprise
    for first, same in ((V, True), (1, False)):
        ec = dict(budget=12, window=4, budgets=None)
        run = prefill_and_score(model, ids, make_scorer(EvictConfig("lookahead", rule=SpanRule(4), **ec), mod))
        want = make_scorer(EvictConfig("lookahead", rule=SpanRule(4), **ec), mod).evict(run.scores, run)
        rule = SpanRule(4, first)
        got = make_scorer(EvictConfig("lookahead", rule=rule, **ec), mod).evict(run.scores, run)
        assert all(torch.equal(a, b) for a, b in zip(got, want)) == same, first
    assert repr(methods.parse_rule("span:8:1024")) == "span:8:1024" and methods.parse_rule("span:8:1024").first == 1024
    for bad in ("avg:5:3", "span:8:x", "span:8:0"):
        with pytest.raises(ValueError, match="span|selection rule"):
            methods.parse_rule(bad)


def test_a_span_wider_than_the_prompt_smooths_as_the_prompt_wide_one(monkeypatch):
    """Nothing is carried past the prompt's ends, so SpanRule.smooth runs a width past the n smoothed tokens
    as n (a direct caller's SpanRule(10**11) was one endless pooling op, deaf to SIGTERM): the same slots,
    and no step is given a width over n."""
    import extensions.span as span

    model = tiny_model()
    mod = random_module(model.config, 8)
    ids, ec = rand_ids(1, 30, seed=6), dict(budget=12, budgets=None)
    n = 30  # lookahead protects no window: every prompt token is smoothed
    run = prefill_and_score(model, ids, make_scorer(EvictConfig("lookahead", rule=SpanRule(n), **ec), mod))
    want = make_scorer(EvictConfig("lookahead", rule=SpanRule(n), **ec), mod).evict(run.scores, run)
    widths = []

    def watched(real):  # the width each step is given; one past n fails at once, before the endless op
        def step(*a):
            widths.append(a[-1])
            return pytest.fail(f"{real.__name__} was given a width of {a[-1]}") if a[-1] > n else real(*a)
        return step

    for name in ("span_scores", "candidates"):
        monkeypatch.setattr(span, name, watched(getattr(span, name)))
    got = make_scorer(EvictConfig("lookahead", rule=SpanRule(10**11), **ec), mod).evict(run.scores, run)
    assert widths == [n, n] and all(torch.equal(a, b) for a, b in zip(got, want))


def test_surprisal_in_two_parts_decides_as_the_one_part_sum():
    """token_surprisal(enough=e), as the span rule calls it: log Z over the tokens' own ids first, the rest
    of the vocabulary (or shortlist) only for the tokens still at or below e. The same bits (> e) and,
    wherever the value is at or below e, the same number as the one-part sum; some tokens are decided by
    the first part alone (their value is then a smaller lower bound: the rest was not read)."""
    model = tiny_model()
    V = model.config.vocab_size
    ids = rand_ids(2, 45, seed=8)
    cap = Hidden()
    model(ids, positions=pos(0, 45, 2), hook=cap, logits_at=-1)
    where = torch.rand(2, 45, generator=torch.Generator().manual_seed(2)) > 0.2
    for vocab in (None, shortlist(ids, V, 7)):
        one = token_surprisal(model.lm_head, cap.h, ids, where=where, vocab=vocab)
        for e in (SURPRISE_NATS, one[where].median().item()):
            two = token_surprisal(model.lm_head, cap.h, ids, where=where, rows=6, vocab=vocab, enough=e)
            assert torch.equal(two > e, one > e)
            low = one <= e
            assert torch.allclose(two[low], one[low], atol=1e-5)
            assert (two <= one + 1e-5).all() and (two < one - 1e-3).any()


def test_span_rule_on_a_left_padded_batch():
    """With left padding the reference surprisal is each row's own (0 on the padding and on a row's first
    real token, which has no context), and the span rule keeps the reference's top C, no padding."""
    model = tiny_model()
    lens = (64, 45)
    S = max(lens)
    rows = [rand_ids(1, n, seed=60 + i) for i, n in enumerate(lens)]
    ids = torch.cat([torch.cat([torch.zeros(1, S - r.shape[1], dtype=torch.long), r], 1) for r in rows])
    pad = torch.stack([torch.arange(S) >= S - n for n in lens])
    sur = every_token_surprisal(model, ids, pad)
    for b, (r, n) in enumerate(zip(rows, lens)):
        assert torch.allclose(sur[b, S - n:], every_token_surprisal(model, r)[0], atol=1e-4)
        assert (sur[b, : S - n + 1] == 0).all()
    for C in (8, 16):
        ec = EvictConfig("snapkv", budget=C, window=4, rule=SpanRule(4))
        scorer = make_scorer(ec)
        kept = compress(model, ids, scorer, pad_mask=pad)[3]
        run = prefill_and_score(model, ids, make_scorer(ec), pad_mask=pad)
        assert_same_top(kept, *span_reference(model, ids, scorer, run, 4, pad))
        assert all((k[1] >= S - lens[1]).all() for k in kept)  # no padding kept
    # the shortlist gate: one shortlist per row, of its own tokens, so a row keeps what it keeps alone
    small = [r % 5 + 3 + 20 * i for i, r in enumerate(rows)]  # few distinct ids, other ones per row: the gate decides
    ids = torch.cat([torch.cat([torch.full((1, S - r.shape[1]), 90), r], 1) for r in small])  # padding id 90
    ec = EvictConfig("snapkv", budget=8, window=4, rule=SpanRule(4, 1))
    batched = compress(model, ids, make_scorer(ec), pad_mask=pad)[3]
    for b, r in enumerate(small):
        alone = compress(model, r, make_scorer(ec))[3]
        assert all(torch.equal(k[b] - (S - lens[b]), a[0]) for k, a in zip(batched, alone)), b


# -----------------------------------------------------------------------------
# layer_budgets.py


@pytest.mark.parametrize("C,w,S", [(16, (1.0, 3.0, 0.0), 100), (128, (0.3,) * 10 + (4.4,) * 3 + (1.0,) * 17, 2000),
                                   (24, (1.0, 1.0, 6.0), 40), (64, (2.0, 1.0), 65)])
def test_spread_budgets_follow_the_weights_and_keep_the_mean(C, w, S):
    """spread_budgets: per layer C * w_l / mean(w), never under `least` nor over S, summing to L * C."""
    b = spread_budgets(C, w, S, least=2)
    assert sum(b) == len(w) * C and min(b) >= 2 and max(b) <= S
    raw = [C * len(w) * x / sum(w) for x in w]
    if max(raw) <= S and min(raw) >= 2:  # nothing clipped: proportional up to rounding
        assert all(abs(x - r) < 1 for x, r in zip(b, raw))
    assert [x for _, x in sorted(zip(w, b))] == sorted(b)  # a larger weight never gets fewer slots
    assert LayerBudgets(w)(C, len(w), S, least=2) == b  # the policy is spread_budgets for its own weights


@pytest.mark.parametrize("bad", [(1.0, -1.0), (0.0, 0.0), (), (1.0, float("nan")), (1.0, float("inf"))])
def test_layer_budgets_refuse_bad_weights(bad):
    with pytest.raises(ValueError, match="layer weights must be finite numbers >= 0, not all 0"):
        LayerBudgets(bad)


def test_layer_budgets_refuse_a_wrong_number_of_layers():
    model = tiny_model(num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"2 layer weights for a model of 3 layers: measure them for this model"):
        compress_by(model, rand_ids(1, 40), EvictConfig("snapkv", budget=16, window=4,
                                                        budgets=LayerBudgets((1.0, 2.0))))


def test_adapter_rule_and_layer_weights_ride_in_its_json_and_apply_only_when_asked(tmp_path):
    """An adapter's recommended selection rule and per-layer weights (mean 1) travel in its .json (module.info);
    methods.make_scorer never applies them unasked (the default is the paper's form: max-pool 7, C in every
    layer); methods.adapter_selection reads them for a flag that asks (generate.py --pool,
    --layer-budgets); SnapKV can be given the weights."""
    model = tiny_model(num_hidden_layers=3)
    cfg = model.config
    S, C = 60, 12
    mod = random_module(cfg, 8)
    mod.info = dict(rule="span:4", layer_weights=[0.5, 2.0, 0.5])
    path = tmp_path / "a.safetensors"
    mod.save(path)
    back = methods.load_adapter(path, cfg)
    assert back.info == dict(rule="span:4", layer_weights=[0.5, 2.0, 0.5])
    paper = make_scorer(EvictConfig("lookahead", budget=C), back)
    assert repr(paper.rule) == "max:7" and paper.layer_budgets(3, S) == [C] * 3
    rule, budgets = methods.adapter_selection(back)
    scorer = make_scorer(EvictConfig("lookahead", budget=C, rule=rule, budgets=budgets), back)
    assert repr(scorer.rule) == "span:4" and isinstance(scorer.eviction.budgets, LayerBudgets)
    ids = rand_ids(1, S, seed=4)
    kept = compress(model, ids, scorer)[3]
    assert [k.shape[-1] for k in kept] == [6, 24, 6]
    flat = compress_by(model, ids, EvictConfig("lookahead", budget=C), module=back)[3]
    assert [k.shape[-1] for k in flat] == [C] * 3
    # another rule with the adapter's budgets
    none = make_scorer(EvictConfig("lookahead", budget=C, rule=Pool("none"), budgets=budgets), back)
    assert repr(none.rule) == "none" and none.layer_budgets(3, S) == [6, 24, 6]
    # the budgets change how many slots, not the order: each layer's kept set nests in the larger one's
    a = compress(model, ids, none)[3]
    b = compress_by(model, ids, EvictConfig("lookahead", budget=C, rule=Pool("none"), budgets=uniform_budgets),
                    module=back)[3]
    assert set(b[0][0, 0].tolist()) >= set(a[0][0, 0].tolist())
    assert set(a[1][0, 0].tolist()) >= set(b[1][0, 0].tolist())
    snap = EvictConfig("snapkv", budget=C, window=4, budgets=LayerBudgets(back.info["layer_weights"]))
    assert [k.shape[-1] for k in compress_by(model, ids, snap)[3]] == [6, 24, 6]
    # other methods ignore the adapter's selection
    assert repr(make_scorer(EvictConfig("snapkv", budget=C, window=4), back).rule) == "avg:5"


@pytest.mark.parametrize("info, said", [(dict(rule="chunk:4"), "selection rule 'chunk:4'"),
                                        (dict(layer_weights=[1.0, 2.0]), "2 layer weights for a model of 3 layers"),
                                        (dict(layer_weights=3.0), "must be a list of numbers"),
                                        (dict(layer_weights=[1.0, -1.0, 1.0]), "finite numbers >= 0")])
def test_an_adapter_whose_selection_is_unusable_is_refused_when_loaded(tmp_path, info, said):
    model = tiny_model(num_hidden_layers=3)
    mod = random_module(model.config, 4)
    mod.info = info
    mod.save(tmp_path / "a.safetensors")
    with pytest.raises(ValueError, match=rf"a\.safetensors: its \.json's selection is not usable \(.*{said}"):
        methods.load_adapter(tmp_path / "a.safetensors", model.config)


def test_layer_weights_from_gains():
    """Per-group answer-KL gains -> one weight per layer, mean 1: sqrt(0.75 g / mean(g) + 0.25), renormalised;
    a group with a larger gain never gets less, a negative gain counts as 0, no gain at all gives 1 everywhere."""
    groups = [range(0, 3), range(3, 4)]
    w = layer_weights([3.0, 1.0], groups, 4)
    soft = [math.sqrt((1 - FLOOR) * 1.5 + FLOOR)] * 3 + [math.sqrt((1 - FLOOR) * 0.5 + FLOOR)]
    assert w == pytest.approx([x * 4 / sum(soft) for x in soft], abs=1e-4)
    assert sum(w) / 4 == pytest.approx(1.0, abs=1e-3) and w[0] > w[3]
    assert layer_weights([1.0, -2.0], groups, 4) == layer_weights([1.0, 0.0], groups, 4)
    assert layer_weights([0.0, -1.0], groups, 4) == [1.0] * 4


def test_measure_on_a_tiny_model():
    """measure(): the adapter's own unpooled top C and the oracle's per (layer, KV head), then the answer
    KL each group of layers costs; the weights (one per layer, mean 1) make a usable LayerBudgets."""
    model = tiny_model(num_hidden_layers=4)
    cfg = model.config
    mod = random_module(cfg, 8)
    samples = []
    for i, S in enumerate((30, 24)):
        ids = rand_ids(1, S, seed=70 + i)
        cache = KVCache(cfg.num_hidden_layers)
        model(ids, positions=pos(0, S), cache=cache, logits_at=-1)
        response = rand_ids(1, 6, seed=80 + i)
        gt = answer_attention(model, cache, response, torch.tensor([S]), per_query_head=True)
        samples.append((cache, gt, response))
    weights, report = measure(model, mod, samples, budget=8)
    assert len(weights) == 4 and sum(weights) / 4 == pytest.approx(1.0, abs=1e-3)
    assert report["rows"] == 2 and report["C"] == 8 and report["groups"] == [[0, 2], [3, 3]]
    assert len(report["gain"]) == 2 and len(report["kl"]) == 4 and math.isfinite(report["answer_kl"])
    assert all(math.isfinite(x) for x in report["gain"] + report["kl"])
    assert weights[0] == weights[1] == weights[2]  # one weight per group
    assert LayerBudgets(weights)(8, 4, 30) and sum(LayerBudgets(weights)(8, 4, 30)) == 32
    assert all(len(c) == S for (c, _, _), S in zip(samples, (30, 24)))  # the samples' caches are left as they were


# -----------------------------------------------------------------------------
# layer_loss.py (its use in train.py: tests/test_train.py)


def test_layer_weighted_kl_is_kl_loss_per_layer_weighted():
    """Equal weights: the paper's kl_loss itself; all weight on one layer: that layer's KL alone; in general
    the v-weighted mean of the per-layer KLs. The gradient reaches only the layers with weight."""
    g = torch.Generator().manual_seed(0)
    gt = {l: torch.rand(2, 3, 10, generator=g) for l in range(3)}
    pred = {l: torch.rand(2, 3, 10, generator=g).requires_grad_() for l in range(3)}
    per = [kl_loss({l: gt[l]}, {l: pred[l]}).item() for l in range(3)]
    assert LayerWeightedKL([2.0] * 3)(gt, pred).item() == pytest.approx(kl_loss(gt, pred).item(), rel=1e-6)
    assert LayerWeightedKL([0.0, 1.0, 0.0])(gt, pred).item() == pytest.approx(per[1], rel=1e-6)
    assert LayerWeightedKL([1.0, 3.0, 0.0])(gt, pred).item() == pytest.approx((per[0] + 3 * per[1]) / 4, rel=1e-6)
    with torch.enable_grad():  # this file's tests run under no_grad (test_lookaheadkv._no_grad)
        LayerWeightedKL([0.0, 1.0, 0.0])(gt, pred).backward()
    assert pred[1].grad.abs().sum() > 0 and pred[0].grad.abs().sum() == 0 == pred[2].grad.abs().sum()
    with pytest.raises(ValueError, match="2 layer loss weights for targets of 3 layers"):
        LayerWeightedKL([1.0, 1.0])(gt, pred)


@pytest.mark.parametrize("bad", [(1.0, -1.0), (0.0, 0.0), (), (1.0, float("nan"))])
def test_layer_weighted_kl_refuses_bad_weights(bad):
    with pytest.raises(ValueError, match="layer weights must be finite numbers >= 0, not all 0"):
        LayerWeightedKL(bad)


def test_loss_weights_are_an_adapters_layer_weights_squared(tmp_path):
    """read_weights: v_l = w_l ** 2 (the square root of layer_weights undone); a file without them, of another
    model's layer count, or not JSON is refused naming the file."""
    f = tmp_path / "a.json"
    f.write_text('{"layer_weights": [0.5, 2.0, 1.5]}')
    assert read_weights(f, 3) == [0.25, 4.0, 2.25]
    for text, says in [('{"layer_weights": [1.0, 1.0]}', "2 layer weights for a model of 3 layers"),
                       ('{"rule": "none"}', "no layer_weights list in it: measure them first"),
                       ("not json", "not a readable JSON file")]:
        f.write_text(text)
        with pytest.raises(ValueError, match=f"--loss-weights {f}: " + says):
            read_weights(f, 3)


# -----------------------------------------------------------------------------
# decode.py (the rest: tests/test_decode_evict.py)


def test_a_forked_evictor_keeps_its_own_hook_state():
    """fork(): two answers from one cache (greedy and teacher-forced) must not share H2O's running sums."""
    model = tiny_model()
    ids = rand_ids(1, 40, seed=3)
    scorer = make_scorer(EvictConfig("h2o", budget=16, window=4))
    cache, logits, next_pos, _ = compress(model, ids, scorer)
    ev = DecodeEviction(scorer, every=4, window=4)
    list(decode(model, cache, logits, next_pos, 8, hook=ev.hook, after_step=ev.after_step))
    assert ev.log
    before = {l: s.clone() for l, s in ev.hook.sums.items()}
    other = ev.fork()
    assert other.hook is not ev.hook and other.log == ev.log and other.log is not ev.log
    c2 = cache.copy()
    list(decode(model, c2, logits, next_pos + 7, 6, hook=other.hook, after_step=other.after_step))
    assert all(torch.equal(before[l], ev.hook.sums[l]) for l in before)  # the original is untouched
    assert len(other.log) > len(ev.log)


def test_planted_a_narrower_candidate_set_is_caught(monkeypatch):
    """The check above is real: with the surprisal computed on the raw top C_l alone (no dilation), the
    kept slots differ from the full computation's."""
    import extensions.span as span

    real = span.candidates
    monkeypatch.setattr(span, "candidates", lambda scores, budgets, kernel: real(scores, budgets, 1))
    model = tiny_model(num_hidden_layers=3, num_key_value_heads=1)
    ids = rand_ids(2, 320, seed=7)
    caught = 0
    for C in (8, 16, 32):
        ec = EvictConfig("snapkv", budget=C, window=4, rule=SpanRule(4))
        scorer = make_scorer(ec)
        kept = compress(model, ids, scorer)[3]
        want, scores = span_reference(model, ids, scorer, prefill_and_score(model, ids, make_scorer(ec)), 4)
        try:
            assert_same_top(kept, want, scores)
        except AssertionError:
            caught += 1
    assert caught


def test_selection_of_names_the_rule_and_the_budget_policy():
    """methods.selection_of: what generate.py's stats, bench.py and evaluate.py say ran."""
    from extensions.layer_budgets import LayerBudgets as LB
    from methods import selection_of

    cfg = tiny_model().config
    shipped = LookaheadModule(cfg, n_tokens=4)
    shipped.info.update(rule="span:8:1024", layer_weights=[1.0] * cfg.num_hidden_layers)
    assert selection_of(make_scorer(EvictConfig("lookahead", 16), shipped)) == ("max:7", "C in every layer")
    rule, budgets = methods.adapter_selection(shipped)
    as_recommended = make_scorer(EvictConfig("lookahead", 16, rule=rule, budgets=budgets), shipped)
    assert selection_of(as_recommended) == ("span:8:1024", "per-layer budgets")
    assert selection_of(make_scorer(EvictConfig("pyramidkv", 16, window=4))) == ("avg:5", "pyramid budgets")
    assert selection_of(make_scorer(EvictConfig("snapkv", 16, window=4, budgets=LB([1, 3])))) == ("avg:5", "per-layer budgets")
    assert selection_of(make_scorer(EvictConfig("full"))) == ("none", "nothing evicted")
