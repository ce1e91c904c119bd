"""Issue 53: config.json values that cannot work, or that the tensors contradict, are refused by load_model
before anything is built, as one ValueError line naming config.json, the field, the value and what to do.

Before: num_hidden_layers 1000000 (30 layers stored) built layers until killed, vocab_size 100000000000 ended in
an allocator traceback, rms_norm_eps 1e30 answered nothing with exit 0. Tiny checkpoints from conftest.py.
"""

import json
import re
import shutil

import pytest
import torch

from support import cli
import model
from model import ModelConfig, load_model
from support.checks import POSITION_LIMIT, implied_shapes


@pytest.fixture
def folder(tiny_hf_model, tmp_path):
    """A writable copy of a tiny untied llama checkpoint: 2 layers, vocab 128, hidden 64, 2 KV heads of 16."""
    src = tiny_hf_model("llama", tie_word_embeddings=False)
    return shutil.copytree(src, tmp_path / "tiny")


@pytest.fixture
def nothing_built(monkeypatch):
    """Building the model fails the test: the refusal must come before any module or allocation."""
    monkeypatch.setattr(model, "Transformer", lambda cfg: pytest.fail("the model was built"))


def edit(folder, **fields):
    p = folder / "config.json"
    p.write_text(json.dumps({**json.loads(p.read_text()), **fields}))


def refusal(folder, *needles):
    """load_model's ValueError message, checked to be one line holding every needle."""
    with pytest.raises(ValueError) as e:
        load_model(folder)
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg
    return msg


def bad_field(folder, key, value):
    """The ConfigCheck refusal: config.json, the key, its value, and the fix."""
    return refusal(folder, str(folder / "config.json"), f"{key} is {value}", "fix that key")


def test_layer_count_the_checkpoint_lacks_is_refused_before_building(folder, nothing_built):
    """The issue's first case: the layer count is checked against the stored tensor names, not discovered by
    building a million layers."""
    edit(folder, num_hidden_layers=1000000)
    refusal(folder, str(folder / "config.json"), "says num_hidden_layers 1000000 but the checkpoint has 2 layers",
            "Use the config.json that came with these weights")


@pytest.mark.parametrize("written", ["100000000000", "1e11"])
def test_size_past_the_limit_is_refused(folder, written):
    """The issue's second case: 1e11 is a float in JSON, 100000000000 a whole number past SIZE_LIMIT; both are
    refused from config.json alone, naming the value as written."""
    p = folder / "config.json"
    p.write_text(re.sub(r'"vocab_size": \d+', f'"vocab_size": {written}', p.read_text()))
    msg = bad_field(folder, "vocab_size", "100000000000")
    assert "whole number from 1 to 2147483647" in msg, msg
    with pytest.raises(ValueError, match="vocab_size is 100000000000"):
        ModelConfig.from_hf_config(folder)  # what generate.py and train.py read before the model loads


# config.json sizes within the limits that the stored shapes contradict: (edit, tensor and field the message names)
CONTRADICTED = {
    "vocab": (dict(vocab_size=1000000), "lm_head.weight", "vocab_size 1000000"),
    "hidden": (dict(hidden_size=128), "lm_head.weight", "hidden_size 128"),
    "kv-heads": (dict(num_key_value_heads=4), "model.layers.0.self_attn.k_proj.weight", "num_key_value_heads 4"),
    "head-dim": (dict(head_dim=32), "model.layers.0.self_attn.k_proj.weight", "head_dim 32"),
    "intermediate": (dict(intermediate_size=10**9), "model.layers.0.mlp.down_proj.weight",
                     "intermediate_size 1000000000"),
}


@pytest.mark.parametrize("case", CONTRADICTED)
def test_sizes_the_tensor_headers_contradict_are_refused_before_building(folder, nothing_built, case):
    """Every size shows in some tensor's shape, read from its file's header: a mismatch is said before the
    model is built (intermediate_size 1e9 would allocate 768 GB first)."""
    fields, tensor, says = CONTRADICTED[case]
    edit(folder, **fields)
    refusal(folder, str(folder / "model.safetensors"), f"tensor {tensor} has shape", str(folder / "config.json"),
            says, "use the config.json that came with these weights")


def test_sharded_checkpoint_is_checked_from_its_shard_headers(tiny_hf_model, tmp_path, nothing_built):
    folder = shutil.copytree(tiny_hf_model("llama", seed=3, max_shard_size="20KB", tie_word_embeddings=False),
                             tmp_path / "sharded")
    edit(folder, vocab_size=1000)
    msg = refusal(folder, "has shape (128, 64)", "vocab_size 1000")
    assert re.search(r"model-\d+-of-\d+\.safetensors", msg), msg


@pytest.mark.parametrize("eps", [1e30, 0.5])
def test_rms_norm_eps_that_swamps_the_activations_is_refused(folder, nothing_built, eps):
    """The issue's third case: eps near 1 or above swamps the mean square it is added to."""
    edit(folder, rms_norm_eps=eps)
    assert "<= 0.01" in bad_field(folder, "rms_norm_eps", json.dumps(eps))


@pytest.mark.parametrize("where", ["rope_parameters", "top level"])
def test_rope_theta_of_one_or_less_is_refused(folder, nothing_built, where):
    """theta <= 1: RoPE's wavelengths would not grow along the channels (they are all equal at 1)."""
    d = json.loads((folder / "config.json").read_text())
    if where == "rope_parameters":
        d["rope_parameters"]["rope_theta"] = 1.0
    else:
        d.pop("rope_parameters")
        d["rope_theta"] = 0.5
    (folder / "config.json").write_text(json.dumps(d))
    assert "> 1" in bad_field(folder, "rope_theta", "1.0" if where == "rope_parameters" else "0.5")


def test_max_position_embeddings_past_float32_positions_is_refused(folder):
    edit(folder, max_position_embeddings=POSITION_LIMIT)
    assert ModelConfig.from_hf_config(folder).max_position_embeddings == 2**24  # the limit itself: fine
    edit(folder, max_position_embeddings=POSITION_LIMIT + 1)
    bad_field(folder, "max_position_embeddings", str(2**24 + 1))


def test_values_at_the_bounds_load(folder):
    """Valid input stays accepted: eps at its bound, a theta just above its floor (checks.THETA_FLOOR)."""
    d = json.loads((folder / "config.json").read_text())
    d["rms_norm_eps"], d["rope_parameters"]["rope_theta"] = 1e-2, 100.5
    (folder / "config.json").write_text(json.dumps(d))
    m = load_model(folder)
    assert (m.config.rms_norm_eps, m.config.rope_theta) == (1e-2, 100.5)


def test_a_refusal_is_one_error_line_through_cli(folder):
    edit(folder, rms_norm_eps=1e30)
    with pytest.raises(SystemExit) as e:
        cli.run(lambda: load_model(folder))
    msg = e.value.code
    assert isinstance(msg, str) and msg.startswith(f"error: {folder / 'config.json'}: rms_norm_eps is 1e+30"), msg
    assert "\n" not in msg


@pytest.mark.parametrize("family, config", [
    ("llama", dict(tie_word_embeddings=False)),
    ("llama", dict(tie_word_embeddings=True)),
    ("qwen2", dict(tie_word_embeddings=True)),  # q/k/v biases
    ("qwen3", dict(tie_word_embeddings=False, head_dim=32)),  # q/k norms, head_dim != hidden / heads
])
def test_implied_shapes_are_what_the_model_builds(tiny_hf_model, family, config):
    """implied_shapes states Transformer's parameters without building it: the two must not drift apart."""
    cfg = ModelConfig.from_hf_config(tiny_hf_model(family, **config))
    with torch.device("meta"):
        built = {re.sub(r"^model\.layers\.\d+\.", "", n): tuple(p.shape)
                 for n, p in model.Transformer(cfg).named_parameters()}  # tied: lm_head is the embedding, not listed
    implied = implied_shapes(cfg)
    if cfg.tie_word_embeddings:
        implied.pop("lm_head.weight")
    assert built == implied
