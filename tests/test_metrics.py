"""metrics.py: recall@C, answer KL (answer tokens 2..R), the share of the SnapKV-to-oracle gap closed,
keep_fraction and the Stopwatch, on hand-made values and on a tiny random model; and
extensions/layer_budgets.swap_gains, which is built from them."""

import math

import pytest
import torch

import eviction

from support import metrics
from eviction import EvictConfig, compress, keep_slots
from extensions.layer_budgets import swap_gains
from methods import make_scorer
from conftest import REORDER_ATOL
from test_lookaheadkv import V, tiny_model  # one tiny-model builder for the tests


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def rand_ids(B, T, seed=0):
    return torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(seed))


def full_cache(model, ids):
    return compress(model, ids, make_scorer(EvictConfig("full")))


def test_recall_of_kept_known_value():
    # layer 1 unnormalised: recall_of_kept normalises per (row, KV head)
    true = {0: torch.tensor([[[0.5, 0.3, 0.2, 0.0]]]), 1: torch.tensor([[[2.0, 0.0, 0.0, 2.0]]])}
    kept = [torch.tensor([[[0, 2]]]), torch.tensor([[[0, 2]]])]
    assert metrics.recall_of_kept(kept[:1], true) == pytest.approx(0.7)
    assert metrics.recall_of_kept(kept, true) == pytest.approx((0.7 + 0.5) / 2)  # the mean over layers
    # per layer its own budget, and the mean over KV heads and rows
    true2 = {0: torch.tensor([[[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]], [[0.2, 0.3, 0.5], [1 / 3, 1 / 3, 1 / 3]]])}
    kept2 = [torch.tensor([[[0], [0]], [[2], [1]]])]  # (B=2, H_kv=2, C=1)
    assert metrics.recall_of_kept(kept2, true2) == pytest.approx((1.0 + 0.0 + 0.5 + 1 / 3) / 4)


def test_answer_kl_known_values():
    p = torch.tensor([[0.5, 0.5], [0.9, 0.1]]).log()
    q = torch.tensor([[0.5, 0.5], [0.5, 0.5]]).log()
    kl1 = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    assert metrics.answer_kl(p, q) == pytest.approx(kl1 / 2)  # the mean over the answer positions
    assert metrics.answer_kl(q, p) != pytest.approx(kl1 / 2)  # KL(full || method), not the reverse
    assert metrics.answer_kl(p, p) == 0.0  # clamped at 0: never a rounding -1e-9
    assert metrics.answer_kl(torch.zeros(0, 2), torch.zeros(0, 2)) == 0.0  # a one-token answer: nothing to compare


def test_forced_logprobs_are_answer_tokens_2_to_R():
    """forced_logprobs(cache, answer) == the log-softmax of ONE forward over [prompt; answer] at the rows
    that predict answer tokens 2..R (prompt + answer positions S .. S+R-2); the cache is left as it was;
    an answer of one token has no rows, and its answer KL is 0."""
    model = tiny_model()
    S, R = 30, 6
    ids, answer = rand_ids(1, S, seed=1), rand_ids(1, R, seed=2)
    cache, logits, next_pos, _ = full_cache(model, ids)
    k0 = list(cache.k)
    got = metrics.forced_logprobs(model, cache, answer, next_pos)
    assert got.shape == (R - 1, V) and got.dtype == torch.float32
    assert len(cache) == S and all(a is b for a, b in zip(k0, cache.k))
    whole = model(torch.cat([ids, answer], 1), positions=torch.arange(S + R)[None], logits_at=None)[0]
    torch.testing.assert_close(got, whole[S:S + R - 1].float().log_softmax(-1), atol=1e-4, rtol=1e-4)
    # the first answer token is the prefill's own prediction (every method shares it): not a row
    assert torch.allclose(whole[S - 1], logits[0], atol=1e-4)
    one = metrics.forced_logprobs(model, cache, answer[:, :1], next_pos)
    assert one.shape == (0, V) and metrics.answer_kl(one, one) == 0.0
    # on a compressed cache the answer keeps its positions S.. (not len(cache)..): positions matter
    small = keep_slots(cache.copy(), [torch.arange(0, S, 3)[None, None].expand(1, 2, -1)] * 2)
    at_S = metrics.forced_logprobs(model, small, answer, next_pos)
    at_C = metrics.forced_logprobs(model, small, answer, torch.tensor([len(small)]))
    assert metrics.answer_kl(got, at_S) > 0 and not torch.allclose(at_S, at_C, atol=1e-3)


def test_swap_gains_is_the_answer_kl_each_layer_group_costs():
    """extensions.layer_budgets.swap_gains: the method's answer KL, and per group of layers how much lower
    it is with the oracle's slots in those layers alone; the same slots give no gain, all layers swapped give
    the whole gap."""
    model = tiny_model()  # 2 layers, 2 KV heads
    S, R = 40, 6
    ids, answer = rand_ids(1, S, seed=3), rand_ids(1, R, seed=4)
    cache, _, next_pos, _ = full_cache(model, ids)
    method = [torch.arange(0, 8)[None, None].expand(1, 2, -1)] * 2  # the first 8 slots in both layers
    oracle = [torch.arange(S - 8, S)[None, None].expand(1, 2, -1)] * 2  # the last 8
    full = metrics.forced_logprobs(model, cache, answer, next_pos)
    kl = lambda kept: metrics.answer_kl(full, metrics.forced_logprobs(model, keep_slots(cache.copy(), kept),  # noqa
                                                                      answer, next_pos))
    base, gains = swap_gains(model, cache, answer, next_pos, method, oracle, [[0], [1], [0, 1]])
    assert base == pytest.approx(kl(method)) and base > 0
    assert gains[0] == pytest.approx(base - kl([oracle[0], method[1]]))
    assert gains[1] == pytest.approx(base - kl([method[0], oracle[1]]))
    assert gains[2] == pytest.approx(base - kl(oracle)) and gains[0] != pytest.approx(gains[1])
    assert swap_gains(model, cache, answer, next_pos, oracle, oracle, [[0], [1]])[1] == [0.0, 0.0]
    assert len(cache) == S  # the cache is left as it was


def test_gap_closed_hand_values():
    # recall (higher is better): SnapKV 0.6, oracle 0.8
    assert metrics.gap_closed(0.7, 0.6, 0.8) == pytest.approx(0.5)
    assert metrics.gap_closed(0.8, 0.6, 0.8) == pytest.approx(1.0)
    assert metrics.gap_closed(0.6, 0.6, 0.8) == pytest.approx(0.0)
    assert metrics.gap_closed(0.5, 0.6, 0.8) == pytest.approx(-0.5)  # worse than SnapKV
    # answer KL (lower is better): SnapKV 0.4, oracle 0.1
    assert metrics.gap_closed(0.25, 0.4, 0.1, lower_is_better=True) == pytest.approx(0.5)
    assert metrics.gap_closed(0.1, 0.4, 0.1, lower_is_better=True) == pytest.approx(1.0)
    assert metrics.gap_closed(0.55, 0.4, 0.1, lower_is_better=True) == pytest.approx(-0.5)
    # no gap to close: equal, or the oracle no better than SnapKV (either direction)
    assert metrics.gap_closed(0.7, 0.6, 0.6) is None
    assert metrics.gap_closed(0.7, 0.8, 0.6) is None
    assert metrics.gap_closed(0.2, 0.1, 0.1, lower_is_better=True) is None
    assert metrics.gap_closed(0.2, 0.1, 0.4, lower_is_better=True) is None


def test_keep_fraction_counts_layers_and_kv_heads_of_row_0():
    kept = [torch.tensor([[[0, 1], [1, 3]], [[2, 3], [2, 3]]]),  # layer 0 (B=2, H_kv=2, C=2); row 1 ignored
            torch.tensor([[[1, 2, 3], [0, 1, 3]], [[0, 1, 2], [0, 1, 2]]])]  # layer 1, C=3
    frac = metrics.keep_fraction(kept, 5)
    # row 0: token 0 kept by 2 of the 4 (layer, KV head) pairs, 1 by 4, 2 by 1, 3 by 3, 4 by none
    assert frac.tolist() == pytest.approx([0.5, 1.0, 0.25, 0.75, 0.0])


def test_stopwatch_on_cpu():
    clock = eviction.Stopwatch("cpu")
    clock.mark()
    sum(range(10000))
    clock.mark()
    clock.mark()
    assert not clock.cuda and len(clock.marks) == 3
    assert clock.ms(0, 1) > 0 and clock.ms(0, 2) >= clock.ms(0, 1) and clock.ms(1, 2) >= 0


def test_answer_kls_of_one_shared_prefill_equal_each_method_alone():
    """support.metrics.answer_kls (one prefill, every scorer watching, each budget evicted into a copy) gives
    each method's answer KL as its own compress() does: SnapKV as is, LookaheadKV two-pass beside it equal to
    its one-pass form alone (the same scores, rounding apart); a budget holding the whole prompt gives 0."""
    from test_lookaheadkv import random_module

    model = tiny_model()
    ids, answer = rand_ids(1, 40, seed=3), rand_ids(1, 9, seed=4)
    module = random_module(model.config, 4)
    row = dict(prompt_ids=ids[0].tolist(), response_ids=answer[0].tolist())
    scorers = {"snapkv": make_scorer(EvictConfig("snapkv", 24, window=4)),
               "lookahead": make_scorer(EvictConfig("lookahead", 24, options=dict(one_pass=False)), module)}
    got = metrics.answer_kls(model, row, scorers, (12, 24, 40))
    cache, _, pos, _ = full_cache(model, ids)
    full = metrics.forced_logprobs(model, cache, answer, pos)
    for C in (12, 24):
        for name, ec in (("snapkv", EvictConfig("snapkv", C, window=4)), ("lookahead", EvictConfig("lookahead", C))):
            cache, _, pos, _ = compress(model, ids, make_scorer(ec, module if name == "lookahead" else None))
            alone = metrics.answer_kl(full, metrics.forced_logprobs(model, cache, answer, pos))
            # the two forms' logits agree to REORDER_ATOL (conftest: float32 summed in another order); a KL's
            # terms p (log p - log q) move by at most twice the logits' change
            assert got[f"{name}@{C}"] == pytest.approx(alone, abs=2 * REORDER_ATOL), (name, C)
    assert got["snapkv@12"] > 0 and got["snapkv@40"] == got["lookahead@40"] == 0.0
