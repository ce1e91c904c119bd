"""
The behaviour record: every method and selection rule keeps the slots it is recorded to keep, with the
recorded first-token logits, and the decode-phase eviction and the chat (extensions/decode.py) answer as
recorded.

tests/data/behaviour_record.json was written by the code of commit 63db0d7 (before lookaheadkv.py
was split into eviction.py, lookaheadkv.py and extensions/): on a short prompt from
examples/needle.txt (C = 48), per configuration, how many (layer, KV head) pairs kept each prompt
token, and the first-token logits' top 5. The same configurations, written with today's API, must
give the same counts (up to a few slots: a near tie may fall the other way on another CPU) and the
same logits. The real model, ~20 s.

tests/data/behaviour_decode.json was written by commit 9263f83 (before issue 34's restructure) through
generate.py's own command line (--json), so it holds whatever the code inside becomes: per method, the
answer with the cache held to --decode-budget while decoding (its text, how many evictions, the peak
and final cache), and a two-turn chat at --budget (each turn's answer ids, cache before and kept).
To rewrite it after a change MEANT to change behaviour: BEHAVIOUR_RECORD=write python -m pytest
tests/test_behaviour.py, and say why in the commit.
"""
import os
import json
from pathlib import Path

import pytest
import torch

from eviction import EvictConfig, compress, greedy, uniform_budgets
from methods import adapter_selection, make_scorer, parse_rule

RECORD = Path(__file__).parent / "data" / "behaviour_record.json"
DECODE_RECORD = Path(__file__).parent / "data" / "behaviour_decode.json"


def configs(C, adapter):
    """The recorded configurations, in today's words. "lookahead_paper" is today's default, the paper's form
    (max-pool 7, C in every layer), recorded 2026-12-06 when it became the default (issue 60). The other lookahead
    rows were recorded when the adapter's .json selection applied by default: its per-layer budgets are now asked
    for by name (generate.py --layer-budgets), and they keep their record under it."""
    out = {m: EvictConfig(m, C) for m in ["full", "streaming", "random", "snapkv", "pyramidkv", "h2o", "laq", "oracle"]}
    out["lookahead_paper"] = EvictConfig("lookahead", C)
    layered = adapter_selection(adapter)[1]  # the shipped adapter's per-layer budgets
    # the adapter's rule then: span:8 with the exact surprisal (it now recommends the shortlist gate, span:8:1024)
    exact = parse_rule("span:8")
    out["lookahead"] = EvictConfig("lookahead", C, rule=exact, budgets=layered)
    out["lookahead_twopass"] = EvictConfig("lookahead", C, rule=exact, options=dict(one_pass=False), budgets=layered)
    out["lookahead_uniform"] = EvictConfig("lookahead", C, budgets=uniform_budgets, rule=exact)
    for rule, name in [("none", "none1"), ("avg:5", "avg5"), ("max:7", "max7"), ("span:4", "span4")]:
        out[f"lookahead_{name}"] = EvictConfig("lookahead", C, rule=parse_rule(rule), budgets=layered)
    out["snapkv_max7"] = EvictConfig("snapkv", C, rule=parse_rule("max:7"))
    out["snapkv_span8"] = EvictConfig("snapkv", C, rule=parse_rule("span:8"))
    out["h2o_none"] = EvictConfig("h2o", C, rule=parse_rule("none"))
    out["pyramidkv_uniform"] = EvictConfig("pyramidkv", C, budgets=uniform_budgets)
    return out


def needle_text():
    text = (Path(__file__).parent.parent / "examples" / "needle.txt").read_text()
    return (text[:700] + text[text.index("The special magic"):][:300]
            + "\n\nWhat is the special magic number for the blue lighthouse?")


@pytest.fixture(scope="module")
def needle_prompt(real_model):
    model, tok, adapter = real_model
    return torch.tensor([tok.encode(tok.chat(needle_text()))])


@torch.no_grad()
def test_every_method_keeps_its_recorded_slots_and_first_token_logits(real_model, needle_prompt):
    model, tok, adapter = real_model
    record = json.loads(RECORD.read_text())
    ids = needle_prompt
    assert ids.shape[1] == record["prompt_tokens"]
    full = compress(model, ids, make_scorer(EvictConfig("full")))
    response = torch.tensor([greedy(model, *full[:3], 12, tok.stop_ids)[0]])
    assert response[0].tolist() == record["response"]
    todo = configs(record["budget"], adapter)
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


TURNS = ["Where is the blue lighthouse? Answer in one sentence.", "And what number did I ask about?"]
# generate.py runs: the cache evicted to 40 after the prefill and held there while decoding (an eviction every 8 tokens, the last
# 16 slots kept), and a two-turn chat at --budget 64, for every method with a decode-phase form
# (lookahead: as its adapter's .json recommends, the default when the record was written; "_paper": today's default)
DECODE_RUNS = {f"decode_{m}": ["--method", m, "--budget", "40", "--decode-budget", "40", "--every", "8", "--window",
                               "16", "--max-new-tokens", "32"] for m in ["streaming", "snapkv", "h2o", "lookahead"]}
DECODE_RUNS["decode_lookahead_paper"] = list(DECODE_RUNS["decode_lookahead"])
DECODE_RUNS["decode_lookahead_uniform"] = DECODE_RUNS["decode_lookahead"] + ["--pool", "span:8:1024", "--uniform-budgets"]
DECODE_RUNS["decode_lookahead"] += ["--pool", "span:8:1024", "--layer-budgets"]
DECODE_RUNS.update({f"chat_{m}": ["--method", m, "--budget", "64", "--max-new-tokens", "20"] for m in ["snapkv", "lookahead"]})
DECODE_RUNS["chat_lookahead_paper"] = list(DECODE_RUNS["chat_lookahead"])
DECODE_RUNS["chat_lookahead"] += ["--pool", "span:8:1024", "--layer-budgets"]
KEPT_FIELDS = ("text", "answer_ids", "decode_evictions", "peak_slots", "kv_bytes_end", "cache_before", "kept")


def run_generate(args, tmp_path, capsys):
    """generate.py's --json output, as the objects it prints (one per chat turn)."""
    import generate

    capsys.readouterr()
    generate.main(args + ["--json"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    return [{k: v for k, v in line.items() if k in KEPT_FIELDS} for line in lines]


@torch.no_grad()
def test_decode_phase_and_chat_answer_what_they_answered(real_model, tmp_path, capsys):
    prompt, turns = tmp_path / "needle.txt", tmp_path / "turns.json"
    prompt.write_text(needle_text())
    turns.write_text(json.dumps(TURNS))
    got = {name: run_generate((["--turns", str(turns)] if name.startswith("chat") else ["--prompt", str(prompt)]) + args,
                              tmp_path, capsys) for name, args in DECODE_RUNS.items()}
    if os.environ.get("BEHAVIOUR_RECORD") == "write":
        DECODE_RECORD.write_text(json.dumps(got, indent=1) + "\n")
    want = json.loads(DECODE_RECORD.read_text())
    assert set(got) == set(want)
    assert any(run[0]["decode_evictions"] >= 3 for name, run in want.items() if name.startswith("decode"))
    assert all(len(run) == 2 and run[1]["cache_before"] > run[1]["kept"] for name, run in want.items()
               if name.startswith("chat"))  # the second turn did evict: the record covers what it should
    for name in want:
        assert got[name] == want[name], name
