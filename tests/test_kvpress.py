"""Our baselines against NVIDIA kvpress 0.5.5 (`pip install kvpress==0.5.5`), the field's reference
library: one HF folder runs through transformers with a kvpress press and through our model with our
Scorer, and the slots each keeps per (layer, KV head) are compared. kvpress keeps
int(S * (1 - compression_ratio)) slots per (layer, KV head), so S and the ratio are picked to give our
C exactly; its kept slots are recovered by matching its compressed keys against the layer's full keys.

What each press does (kvpress/presses/*.py, 0.5.5) and what ours does:

  SnapKVPress(window_size, kernel_size=5)    SnapKV (baselines.SnapKV + eviction.Pool("avg", 5))
    softmax of the last w queries over all S     the same (group_attention over all S keys, causal
    keys (causal inside the window), mean over   inside the window), mean over the window queries
    the w queries, avg_pool1d(k=5, zero pad,     and the GQA group, then avg_pool1d(k=5, zero pad,
    count_include_pad) on the S-w prefix, PER    count_include_pad) on the prefix. Pooling and the
    QUERY HEAD, then mean over the GQA group;    means are linear, so the order does not matter.
    window padded with max+1: kept, inside C.    Window protected (inf), inside C.  -> identical
  StreamingLLMPress(n_sink=4)                StreamingLLM: first 4 + the C-4 most recent -> identical
    score 0 on slots n_sink..n_sink+S-C-1, else 1: the first 4 and the last C-4.
  PyramidKVPress(window_size, beta=20)       PyramidKV (baselines.pyramid_budgets)
    per layer n_l = round(hi - l (hi-lo)/(L-1))  C_l = w + round(hi' - l (hi'-lo')/(L-1)) with
    with lo = C/beta, hi = 2C - lo: the window   lo' = (C-w)//beta, hi' = 2(C-w) - lo': KVCache-
    INSIDE the pyramid; falls back to SnapKV     Factory's formula (pyramidkv_utils.py,
    (C in every layer) unless S >= hi >= lo >=   PyramidKVCluster: window ON TOP of a pyramid of
    w, i.e. whenever C < beta * w (640 for       C - w), steps exact instead of floor-divided (so
    w = 32: every budget we run).                the mean is C), no fallback (fit_to_prompt
    Selection: SnapKV's scores, top n_l.         clips at S instead). Selection: the same scores.
                                                 -> identical given the same budgets; the budgets
                                                 differ by definition (measured below)
  ObservedAttentionPress (eager attention:      H2O (baselines.H2OHook): sum over all queries and
    the layer's attention weights, output[1])    the group / (G (S - j)) = the same score. But ours
    sum over all S queries / (S - j), mean       also keeps the last `window` = 32 and avg-pools the
    over the GQA group; no window, no pooling.   prefix (METHOD.md section 4: H2O "as for SnapKV").
                                                 With window=0, rule=Pool("none"): identical.

transformers >= 5.3 renamed the attention layer's `past_key_values` keyword to `cache` and no longer
passes `cache_position`; kvpress 0.5.5 (which pins transformers < 5.3) reads both in its forward hook,
so on a newer transformers `run_press` hands them to it under the old names. Nothing else is changed.
"""
from pathlib import Path

import pytest
import torch

kvpress = pytest.importorskip("kvpress", reason="pip install kvpress==0.5.5")
transformers = pytest.importorskip("transformers")

from kvpress import ObservedAttentionPress, PyramidKVPress, SnapKVPress, StreamingLLMPress  # noqa: E402
from kvpress.utils import compute_n_kept  # noqa: E402

from baselines import pyramid_budgets  # noqa: E402
from eviction import EvictConfig, Pool, prefill_and_score  # noqa: E402
from methods import make_scorer  # noqa: E402
from model import load_model  # noqa: E402
from support.tokenizer import Tokenizer  # noqa: E402

# kvpress's hook is driven through past_key_values=, which transformers >= 5.3 still takes (deprecated)
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

REAL = Path(__file__).resolve().parents[1] / "weights" / "SmolLM2-135M-Instruct"
S, C, W = 256, 64, 32  # tiny model: prompt length, budget, SnapKV's window


def ratio(S, C):
    """kvpress's compression_ratio that keeps exactly C of S slots."""
    r = 1 - C / S
    assert compute_n_kept(S, r) == C
    return r


def run_press(hf, ids, press):
    """kvpress's `press` on hf over ids (1, S): per layer the kept slots (1, H_kv, n_l), in slot order,
    read off the compressed cache (each kept key matched against the layer's full keys)."""
    kept, compress, hook = {}, press.compress, press.forward_hook

    def compress_and_record(module, hidden_states, keys, values, attentions, kwargs):
        k, v = compress(module, hidden_states, keys, values, attentions, kwargs)
        same = (k[:, :, :, None, :] == keys[:, :, None, :, :]).all(-1)  # (1, H_kv, n, S)
        assert (same.sum(-1) == 1).all(), "a kept key matches no (or several) full-cache keys"
        kept[module.layer_idx] = same.float().argmax(-1).sort(-1).values
        return k, v

    def forward_hook(module, args, kwargs, output):  # transformers >= 5.3: see the module docstring
        if "past_key_values" not in kwargs:
            kwargs = {**kwargs, "past_key_values": kwargs["cache"]}
        if "cache_position" not in kwargs:
            kwargs = {**kwargs, "cache_position": torch.arange(kwargs["hidden_states"].shape[1])}
        return hook(module, args, kwargs, output)

    press.compress, press.forward_hook = compress_and_record, forward_hook
    cache = transformers.DynamicCache()
    with torch.no_grad(), press(hf):
        hf(ids, past_key_values=cache, use_cache=True)
    out = [kept[l] for l in range(hf.config.num_hidden_layers)]
    assert [cache.layers[l].keys.shape[2] for l in range(len(out))] == [x.shape[-1] for x in out]
    return out


def ours(model, ids, budget, methods, **config):
    """Our kept slots per layer (1, H_kv, C_l) for each method in `methods` (a name, or a (name, config)
    pair), from one prefill: the methods given share their scores (snapkv, pyramidkv) or not."""
    names = [m if isinstance(m, str) else m[0] for m in methods]
    assert len(set(names)) == 1 or set(names) <= {"snapkv", "pyramidkv"}
    scorers = [make_scorer(EvictConfig(m, budget, **config)) if isinstance(m, str)
               else make_scorer(EvictConfig(m[0], budget, **{**config, **m[1]})) for m in methods]
    run = prefill_and_score(model, ids, scorers[0])
    return [list(s.evict(run.scores, run)) for s in scorers]


def agreement(a, b):
    """The fraction of identical kept slots: sum over (layer, KV head) of |a & b| / max(|a|, |b|)
    (1 when every (layer, KV head) keeps the same set)."""
    same = total = 0
    for x, y in zip(a, b):
        for h in range(x.shape[1]):
            s, t = set(x[0, h].tolist()), set(y[0, h].tolist())
            same, total = same + len(s & t), total + max(len(s), len(t))
    return same / total


def nested(a, b):
    """The agreement of two selections from the same scores that differ only in their budgets."""
    H = a[0].shape[1]
    return sum(min(x.shape[-1], y.shape[-1]) for x, y in zip(a, b)) * H / (
        sum(max(x.shape[-1], y.shape[-1]) for x, y in zip(a, b)) * H)


@pytest.fixture(scope="module")
def tiny(tiny_hf_model):
    """(ours, HF with SDPA, HF with eager attention, ids (1, S)): a random 4-layer Llama, 4 query heads
    on 2 KV heads (GQA), so the group's aggregation is checked too."""
    folder = tiny_hf_model("llama", num_hidden_layers=4)
    hf = {a: transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation=a).float().eval()
          for a in ("sdpa", "eager")}
    ids = torch.randint(0, 128, (1, S), generator=torch.Generator().manual_seed(0))
    return load_model(folder), hf["sdpa"], hf["eager"], ids


@pytest.mark.parametrize("attn,window,budget", [("sdpa", 32, C), ("sdpa", 64, 96), ("eager", 32, C)])
def test_snapkv_matches_kvpress(tiny, attn, window, budget):
    """Identical kept slots. SDPA: kvpress recomputes the window's attention (compute_window_attention);
    eager: it reads the layer's attention weights. window 64 is kvpress's default (ours refuses C <= window)."""
    model, sdpa, eager, ids = tiny
    theirs = run_press(sdpa if attn == "sdpa" else eager, ids,
                       SnapKVPress(compression_ratio=ratio(S, budget), window_size=window, kernel_size=5))
    [mine] = ours(model, ids, budget, ["snapkv"], window=window)
    assert agreement(mine, theirs) == 1.0
    assert all(torch.equal(x, y) for x, y in zip(mine, theirs))


def test_streaming_matches_kvpress(tiny):
    model, sdpa, _, ids = tiny
    theirs = run_press(sdpa, ids, StreamingLLMPress(compression_ratio=ratio(S, C), n_sink=4))
    [mine] = ours(model, ids, C, ["streaming"])
    assert all(torch.equal(x, y) for x, y in zip(mine, theirs))
    assert torch.equal(mine[0][0, 0], torch.cat([torch.arange(4), torch.arange(S - C + 4, S)]))


def test_pyramidkv_selects_like_kvpress_given_its_budgets(tiny):
    """beta = 2, C = 64: kvpress's pyramid is active (lo = C/beta = 32 >= the window), 96/75/53/32 slots
    by layer. Ours, handed those budgets (EvictConfig.budgets), keeps the same slots: the scores and
    the selection are kvpress's; only the budget formula differs (next test)."""
    model, sdpa, _, ids = tiny
    press = PyramidKVPress(compression_ratio=ratio(S, C), window_size=W, kernel_size=5, beta=2)
    theirs = run_press(sdpa, ids, press)
    sizes = [x.shape[-1] for x in theirs]
    assert sizes == [press.get_layer_budget(layer.self_attn, S) for layer in sdpa.model.layers] == [96, 75, 53, 32]
    [mine] = ours(model, ids, C, [("pyramidkv", {"budgets": lambda *a, **k: sizes, "options": {"beta": 2}})])
    assert all(torch.equal(x, y) for x, y in zip(mine, theirs))


def test_pyramidkv_budgets_follow_kvcache_factory_not_kvpress(tiny):
    """A deliberate difference of definition, not a bug. Ours is KVCache-Factory's pyramid
    (pyramidkv_utils.py, PyramidKVCluster.update_kv): the window ON TOP of a pyramid of C - window
    prefix slots, lo = (C - w)//beta, hi = 2(C - w) - lo, so C_l = w + hi .. w + lo with mean C (its
    steps are exact, not floor-divided, so the mean is exactly C; no fallback: fit_to_prompt clips at S).
    kvpress 0.5.5 puts the window INSIDE a pyramid of C (lo = C/beta, hi = 2C - lo) and falls back to
    SnapKV (C in every layer) unless lo >= w, i.e. for every C < beta * w = 640 at beta 20, w 32.
    Both select from the same scores, so the kept sets are nested and the agreement is exactly
    sum(min(C_l, n_l)) / sum(max(C_l, n_l)): 0.724 at beta 20 (kvpress: 64 x 4, ours 95/74/54/33),
    0.842 at beta 2 (kvpress 96/75/53/32, ours 80/69/59/48)."""
    model, sdpa, _, ids = tiny
    for beta, theirs_sizes, our_sizes, expect in [(20, [64] * 4, [95, 74, 54, 33], 0.724),
                                                  (2, [96, 75, 53, 32], [80, 69, 59, 48], 0.842)]:
        theirs = run_press(sdpa, ids, PyramidKVPress(compression_ratio=ratio(S, C), window_size=W, beta=beta))
        snap, mine = ours(model, ids, C, ["snapkv", ("pyramidkv", {"options": {"beta": beta}})])
        assert [x.shape[-1] for x in theirs] == theirs_sizes and [x.shape[-1] for x in mine] == our_sizes
        assert sum(our_sizes) == sum(theirs_sizes) == 4 * C
        if beta == 20:  # kvpress's fallback is SnapKV itself
            assert all(torch.equal(x, y) for x, y in zip(theirs, snap))
        assert agreement(mine, theirs) == pytest.approx(nested(mine, theirs)) == pytest.approx(expect, abs=1e-3)


def test_pyramid_budget_formulas():
    """The three definitions side by side at C = 128, w = 32, beta = 20, L = 30 (SmolLM2's depth)."""
    Cb, w, beta, L = 128, 32, 20, 30
    mine = pyramid_budgets(Cb, w, L, beta)
    avail = Cb - w  # KVCache-Factory: max_capacity_prompt = C, the window added to each layer's prefix
    lo, hi = avail // beta, 2 * avail - avail // beta
    factory = [w + hi - l * ((hi - lo) // (L - 1)) for l in range(L)]
    assert mine[0] == factory[0] == 220 and mine[-1] == w + lo == 36 and sum(mine) == L * Cb
    # its floor-divided steps (184 // 29 = 6) stop short: 220 .. 46, a mean of 133 slots, not C
    assert factory[-1] == 46 and sum(factory) == L * 133
    # kvpress: lo = C / beta = 6.4 < w: the SnapKV fallback, C in every layer
    press = PyramidKVPress(compression_ratio=ratio(512, Cb), window_size=w, beta=beta)
    layer = type("Attn", (), {"config": type("Cfg", (), {"num_hidden_layers": L})(), "layer_idx": 0})()
    assert press.get_layer_budget(layer, 512) == Cb


def test_h2o_matches_observed_attention_without_window_and_pooling(tiny):
    """ObservedAttentionPress (eager attention weights) = our H2O score exactly; with no window and no
    pooling the kept slots are identical."""
    model, _, eager, ids = tiny
    theirs = run_press(eager, ids, ObservedAttentionPress(compression_ratio=ratio(S, C)))
    [mine] = ours(model, ids, C, ["h2o"], window=0, rule=Pool("none"))
    assert all(torch.equal(x, y) for x, y in zip(mine, theirs))


def test_h2o_default_keeps_window_and_pools(tiny):
    """A deliberate difference: our H2O keeps the last `window` = 32 tokens and avg-pools (5) the prefix
    before the top C, as for SnapKV (METHOD.md section 4), so that it is compared with SnapKV and
    LookaheadKV on the same footing; kvpress's ObservedAttentionPress does neither. Measured on this
    random model: 0.455 of kept slots in common (0.549 with the window alone, 0.656 with the pooling
    alone); every difference comes from the window and the pooling (the previous test)."""
    model, _, eager, ids = tiny
    theirs = run_press(eager, ids, ObservedAttentionPress(compression_ratio=ratio(S, C)))
    [default] = ours(model, ids, C, ["h2o"])
    [window_only] = ours(model, ids, C, ["h2o"], rule=Pool("none"))
    [pool_only] = ours(model, ids, C, ["h2o"], window=0)
    assert all((x[0, :, -W:] == torch.arange(S - W, S)).all() for x in default)  # the window is kept
    measured = [agreement(m, theirs) for m in (default, window_only, pool_only)]
    assert measured == pytest.approx([0.455, 0.549, 0.656], abs=1e-3)


@pytest.mark.skipif(not (REAL / "model.safetensors").exists(), reason="run python weights/prepare.py")
def test_real_model_matches_kvpress():
    """SmolLM2-135M-Instruct (30 layers, 9 query heads on 3 KV heads), float32, a 512-token prompt,
    C = 128 (ratio 0.75), window 32: SnapKV, StreamingLLM and H2O (no window, no pooling) keep the
    same slots as kvpress up to float ties (our model and transformers round differently); PyramidKV
    agrees by its budgets alone (kvpress falls back to SnapKV at C = 128, ours is 220 .. 36 slots).
    Measured (transformers 5.2.0 and 5.24.0 alike): SnapKV 1.0, StreamingLLM 1.0, H2O 1.0 (0.665 with
    our default window and pooling), PyramidKV 0.686 = sum(min) / sum(max) of the budgets. ~20 s, one core."""
    n, Cb = 512, 128
    model = load_model(REAL)
    text = (Path(__file__).resolve().parents[1] / "examples" / "needle.txt").read_text()
    ids = torch.tensor([Tokenizer(REAL, model.config).encode(text)[-n:]])
    assert ids.shape == (1, n)
    hf = transformers.AutoModelForCausalLM.from_pretrained(REAL, attn_implementation="sdpa").float().eval()
    r = ratio(n, Cb)

    snap, pyramid = ours(model, ids, Cb, ["snapkv", "pyramidkv"])
    theirs = run_press(hf, ids, SnapKVPress(compression_ratio=r, window_size=32, kernel_size=5))
    snap_agree = agreement(snap, theirs)
    assert snap_agree >= 0.995, snap_agree
    pyr_agree = agreement(pyramid, theirs)  # kvpress's PyramidKV at C = 128 is its SnapKV (fallback)
    assert pyr_agree == pytest.approx(nested(pyramid, theirs), abs=5e-3), pyr_agree

    [stream] = ours(model, ids, Cb, ["streaming"])
    assert agreement(stream, run_press(hf, ids, StreamingLLMPress(compression_ratio=r, n_sink=4))) == 1.0

    hf.set_attn_implementation("eager")
    [h2o] = ours(model, ids, Cb, ["h2o"], window=0, rule=Pool("none"))
    h2o_agree = agreement(h2o, run_press(hf, ids, ObservedAttentionPress(compression_ratio=r)))
    assert h2o_agree >= 0.995, h2o_agree
