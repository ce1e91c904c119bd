"""research/analysis/attention_picture.py on a tiny random model: its data are the library's own numbers (the four
arrays over the prompt, the kept marks exactly the slots compress keeps), and it draws them to a file."""
import argparse
import importlib.util

import pytest
import torch

from baselines import full_answer
from eviction import EvictConfig, compress
from lookaheadkv import LookaheadModule, answer_attention
from methods import make_scorer
from model import ModelConfig, Transformer
from research.analysis.attention_picture import draw, needle_pairs, picture_data

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, name="tiny")
S, BUDGET = 80, 40  # C above SnapKV's protected window (32) and below S: something is evicted


@pytest.fixture
def tiny():
    """(model, a "trained" module: LoRA B non-zero, prompt ids (1, S), picture_data's dict), made in each test's
    own one-thread setting, so that computing a number again runs the very same kernels (equal to the bit)."""
    torch.manual_seed(0)
    cfg = ModelConfig(**TINY)
    model = Transformer(cfg).float().eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.15)
        module = LookaheadModule(cfg, n_tokens=4, embed_std=0.15)
        for p in module.lora.parameters():
            p.normal_(0.0, 0.1)
    ids = torch.randint(1, 128, (1, S), generator=torch.Generator().manual_seed(1))
    return model, module, ids, picture_data(model, ids, module, BUDGET, max_new_tokens=5, stop_ids=())


def test_the_picture_s_data_are_the_four_arrays_over_the_prompt(tiny):
    """answer, lookahead and snapkv scores (L, H_kv, S), each a distribution over the prompt per (layer, KV
    head) (the answer's and SnapKV's sum to at most 1: the rest of their softmax lies past the prompt), and
    the kept marks (L, H_kv, S) with C marked per (layer, KV head)."""
    data = tiny[3]
    for name in ("answer", "lookahead", "snapkv"):
        assert data[name].shape == (3, 2, S), name
        assert (data[name] >= 0).all() and (data[name].sum(-1) <= 1 + 1e-5).all(), name
    for name, marks in data["kept"].items():
        assert marks.shape == (3, 2, S) and marks.dtype == torch.bool, name
        assert (marks.sum(-1) == BUDGET).all(), name
    assert len(data["response"]) == 5


def test_the_kept_marks_are_the_slots_compress_keeps(tiny):
    """The marks are what generate.py's eviction keeps (compress with the same scorer), slot for slot; the
    answer strip is the answer's attention over the prompt cache (lookaheadkv.answer_attention)."""
    model, module, ids, data = tiny
    for name, scorer in (("lookahead", make_scorer(EvictConfig("lookahead", BUDGET), module)),
                         ("snapkv", make_scorer(EvictConfig("snapkv", BUDGET)))):
        kept = compress(model, ids, scorer)[3]  # per layer (1, H_kv, C), in slot order
        for layer, idx in enumerate(kept):
            assert torch.equal(data["kept"][name][layer].nonzero()[:, 1].view(2, -1), idx[0]), (name, layer)
    prefilled, answers = full_answer(model, ids, 5, ())
    true = answer_attention(model, prefilled.cache, torch.tensor(answers), prefilled.next_pos)
    assert answers[0] == data["response"]
    assert torch.equal(torch.stack([true[l][0] for l in range(3)]), data["answer"])


def test_needle_pairs_are_those_whose_answer_looks_at_the_needle_most():
    answer = torch.full((3, 2, 10), 0.1)
    answer[2, 1, 4:6], answer[0, 0, 4:6] = 5.0, 2.0  # (2, 1) pays the span most, then (0, 0)
    assert needle_pairs(answer, (4, 6), 2) == [(2, 1), (0, 0)]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="the plot extra: pip install matplotlib")
def test_the_picture_is_drawn_to_a_file(tiny, tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    data = tiny[3]
    args = argparse.Namespace(budget=BUDGET, prompt="tiny.txt", out=tmp_path / "picture.png")
    pairs = needle_pairs(data["answer"], (30, 40), 2)
    draw(data, {"needle": (30, 40), "question": (70, 76)}, [f"w{i}" for i in range(S)], pairs,
         {"lookahead": 0.5, "snapkv": 0.5}, args)
    assert (tmp_path / "picture.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
