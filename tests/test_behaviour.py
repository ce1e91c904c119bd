"""
Every method and selection rule keeps what it kept before the restructure of 2026-12-02.

tests/data/behaviour_record.json was written by the code of commit 63db0d7 (before lookaheadkv.py
was split into eviction.py, lookaheadkv.py and extensions/): on a short prompt from
examples/needle.txt (C = 48), per configuration, how many (layer, KV head) pairs kept each prompt
token, and the first-token logits' top 5. The same configurations, written with today's API, must
give the same counts (up to a few slots: a near tie may fall the other way on another CPU) and the
same logits. The real model, ~20 s.
"""
import json
from pathlib import Path

import pytest
import torch

from eviction import EvictConfig, compress, greedy, uniform_budgets
from methods import make_scorer, parse_rule

RECORD = Path(__file__).parent / "data" / "behaviour_record.json"


def configs(C):
    """The recorded configurations, in today's words."""
    out = {m: EvictConfig(m, C) for m in ["full", "streaming", "random", "snapkv", "pyramidkv", "h2o", "laq", "oracle"]}
    # the adapter's rule then: span:8 with the exact surprisal (it now ships the shortlist gate, span:8:1024)
    exact = parse_rule("span:8")
    out["lookahead"] = EvictConfig("lookahead", C, rule=exact)
    out["lookahead_twopass"] = EvictConfig("lookahead", C, one_pass=False, rule=exact)
    out["lookahead_uniform"] = EvictConfig("lookahead", C, budgets=uniform_budgets, rule=exact)
    for rule, name in [("none", "none1"), ("avg:5", "avg5"), ("max:7", "max7"), ("span:4", "span4")]:
        out[f"lookahead_{name}"] = EvictConfig("lookahead", C, rule=parse_rule(rule))
    out["snapkv_max7"] = EvictConfig("snapkv", C, rule=parse_rule("max:7"))
    out["snapkv_span8"] = EvictConfig("snapkv", C, rule=parse_rule("span:8"))
    out["h2o_none"] = EvictConfig("h2o", C, rule=parse_rule("none"))
    out["pyramidkv_uniform"] = EvictConfig("pyramidkv", C, budgets=uniform_budgets)
    return out


@pytest.fixture(scope="module")
def needle_prompt(real_model):
    model, tok, adapter = real_model
    text = (Path(__file__).parent.parent / "examples" / "needle.txt").read_text()
    text = (text[:700] + text[text.index("The special magic"):][:300]
            + "\n\nWhat is the special magic number for the blue lighthouse?")
    return torch.tensor([tok.encode(tok.chat(text))])


@torch.no_grad()
def test_every_method_keeps_what_it_kept_before_the_restructure(real_model, needle_prompt):
    model, tok, adapter = real_model
    record = json.loads(RECORD.read_text())
    ids = needle_prompt
    assert ids.shape[1] == record["prompt_tokens"]
    full = compress(model, ids, make_scorer(EvictConfig("full")))
    response = torch.tensor([greedy(model, *full[:3], 12, tok.stop_ids)[0]])
    assert response[0].tolist() == record["response"]
    todo = configs(record["budget"])
    assert set(todo) == set(record["configs"])
    for name, eviction in todo.items():
        want = record["configs"][name]
        _, logits, _, kept = compress(model, ids, make_scorer(eviction, adapter, response))
        top = logits[0].float().topk(5)
        assert top.indices.tolist() == want["top_ids"], name
        assert torch.allclose(top.values, torch.tensor(want["top_logits"]), atol=2e-3), name
        if want["counts"] is None:
            assert kept is None, name
            continue
        counts = torch.bincount(torch.cat([k[0].flatten() for k in kept]), minlength=ids.shape[1])
        moved = (counts - torch.tensor(want["counts"])).abs().sum().item()
        assert moved <= 0.002 * sum(want["counts"]), f"{name}: {moved} kept slots moved"
