"""End-to-end on the real default checkpoint (weights/SmolLM2-135M-Instruct, made by
python weights/prepare.py, which the README's test command runs first). Skipped without it."""

import json
from pathlib import Path

import pytest
import torch

import generate
from model import load_model
from support.tokenizer import Tokenizer

FOLDER = Path(__file__).resolve().parents[1] / "weights" / "SmolLM2-135M-Instruct"
ADAPTER = FOLDER.parent / "SmolLM2-135M-Instruct.lookahead.safetensors"  # shipped in the repo
pytestmark = pytest.mark.skipif(not (FOLDER / "model.safetensors").exists(), reason="run python weights/prepare.py")

FILLER = ("The committee met again in the spring to review the harbour accounts, the state of the roads "
          "and the many letters received from the northern districts about the price of grain. ")


@pytest.fixture(scope="module")
def needle_file(tmp_path_factory):
    """A ~1K-token haystack with one planted fact in the middle and the question at the end."""
    parts = [FILLER] * 30
    parts.insert(15, "The special magic number for the blue lighthouse is: 7381924. ")
    text = "".join(parts) + "\nWhat is the special magic number for the blue lighthouse? Answer with the number only."
    path = tmp_path_factory.mktemp("needle") / "needle.txt"
    path.write_text(text)
    return path


def run_generate(capsys, *argv):
    generate.main(["--model", str(FOLDER), "--json", "--max-new-tokens", "24", *argv])
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_needle_answered_with_full_cache(needle_file, capsys):
    out = run_generate(capsys, "--prompt", str(needle_file), "--method", "full")
    assert 900 <= out["prompt_tokens"] <= 1300
    assert "7381924" in out["text"]
    assert out["kept_tokens"] == out["prompt_tokens"] and out["kv_bytes_kept"] == out["kv_bytes_full"]


def test_streaming_keeps_at_most_the_budget(needle_file, capsys):
    out = run_generate(capsys, "--prompt", str(needle_file), "--method", "streaming", "--budget", "128")
    assert out["kept_tokens"] <= 128
    # 4 sinks + 124 recent of ~1K tokens: the cache is the budget's share of the full one
    assert out["kv_bytes_kept"] == pytest.approx(out["kv_bytes_full"] * 128 / out["prompt_tokens"], rel=1e-6)


@pytest.mark.skipif(not ADAPTER.exists(), reason="no shipped adapter yet")
def test_shipped_adapter_loads_and_answers_the_needle(needle_file, capsys):
    out = run_generate(capsys, "--prompt", str(needle_file), "--method", "lookahead", "--budget", "128")
    assert out["kept_tokens"] == 128
    assert "7381924" in out["text"]


def test_logits_match_transformers():
    transformers = pytest.importorskip("transformers")
    tok = Tokenizer(FOLDER)
    ids = torch.tensor([tok.encode(tok.chat(FILLER * 8 + "Summarise the text."))])  # ~300 tokens
    ours = load_model(FOLDER)
    with torch.no_grad():
        a = ours(ids, positions=torch.arange(ids.shape[1])[None])
    del ours
    hf = transformers.LlamaForCausalLM.from_pretrained(FOLDER, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        b = hf(ids).logits
    rel = ((a - b).abs().max() / b.abs().max()).item()
    assert rel < 1e-3, rel
    assert torch.equal(a[0, -1].argmax(), b[0, -1].argmax())


@pytest.mark.skipif(not ADAPTER.exists(), reason="no shipped adapter yet")
def test_one_pass_and_two_pass_keep_the_same_tokens():
    # the fast path (lookahead rows ride in the last prefill chunk) against the readable two-pass
    # reference (a second forward of the M rows on the prompt cache), on the real model in fp32,
    # with chunked prefill so that the rows join a chunk that sits on a cache; both select in the
    # paper's form (max-pool 7, C in every layer: the adapter's .json recommends more, applied only
    # when a flag asks)
    from eviction import EvictConfig, compress
    from methods import load_adapter, make_scorer

    model = load_model(FOLDER)
    tok = Tokenizer(FOLDER, model.config)
    module = load_adapter(ADAPTER, model.config)
    text = (Path(__file__).resolve().parents[1] / "examples" / "needle.txt").read_text()
    ids = torch.tensor([tok.encode(tok.chat(text))])
    with torch.no_grad():
        runs = [compress(model, ids, make_scorer(EvictConfig("lookahead", budget=128, chunk_size=256,
                                                             options=dict(one_pass=one_pass)), module))
                for one_pass in (True, False)]
    (c1, logits1, _, kept1), (c2, logits2, _, kept2) = runs
    assert ids.shape[1] > 3 * 256  # four chunks
    assert torch.allclose(logits1, logits2, atol=1e-4)  # the M rows never change the prompt's logits
    same = sum(torch.equal(a, b) for a, b in zip(kept1, kept2))
    n_layers = model.config.num_hidden_layers
    assert same == n_layers, f"kept slots differ in {n_layers - same} layers"
    for l in range(model.config.num_hidden_layers):
        assert torch.allclose(c1.k[l], c2.k[l], atol=1e-4) and torch.allclose(c1.v[l], c2.v[l], atol=1e-4)
