# LookaheadKVPress's tests as they would be proposed to kvpress (tests/presses/test_lookaheadkv_press.py there):
# a tiny random model, a random LookaheadKV folder made with PEFT itself, press fixtures; offline, CPU.
# Here the press is imported from extensions/; upstream: from kvpress import LookaheadKVPress.

import json

import pytest
import torch

pytest.importorskip("kvpress")
peft = pytest.importorskip("peft")
from kvpress.utils import compute_n_kept  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache  # noqa: E402

from extensions.lookaheadkv_press import LookaheadKVPress, config_fingerprint  # noqa: E402


@pytest.fixture(scope="module")
def unit_test_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def lookaheadkv_folder(unit_test_model, tmp_path_factory):
    """A LookaheadKV folder for unit_test_model: a PEFT LoRA (B drawn, so it changes the scores), 8 embeddings."""
    folder = tmp_path_factory.mktemp("lookaheadkv")
    base = LlamaForCausalLM(unit_test_model.config)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False)
    peft.get_peft_model(base, lora).save_pretrained(folder)
    save_file({"lookahead_embeddings": torch.randn(8, 64)}, folder / "lookahead_embeddings.safetensors")
    config = dict(n_tokens=8, base_model="unit-test", base_fingerprint=config_fingerprint(unit_test_model.config))
    (folder / "lookahead_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def press(lookaheadkv_folder):
    return LookaheadKVPress.from_pretrained(lookaheadkv_folder, compression_ratio=0.5)


@pytest.mark.parametrize("compression_ratio", [0.0, 0.2, 0.5, 0.8])
def test_press_keeps_n_kept_slots(unit_test_model, lookaheadkv_folder, compression_ratio):
    press = LookaheadKVPress.from_pretrained(lookaheadkv_folder, compression_ratio=compression_ratio)
    cache = DynamicCache()
    with torch.no_grad(), press(unit_test_model):
        unit_test_model(torch.randint(0, 128, (1, 100)), past_key_values=cache)
    assert all(layer.keys.shape[2] == compute_n_kept(100, compression_ratio) for layer in cache.layers)


def test_lookahead_tokens_and_lora_are_gone_after_compression(unit_test_model, press):
    """The cache holds prompt slots only (its keys are the prefill's own, up to float rounding) and no hook is left:
    the next forward is the base model's."""
    ids = torch.randint(0, 128, (1, 64))
    full, cache = DynamicCache(), DynamicCache()
    with torch.no_grad():
        before = unit_test_model(ids, past_key_values=full).logits
        with press(unit_test_model):
            unit_test_model(ids, past_key_values=cache)
        after = unit_test_model(ids).logits
    assert torch.equal(before, after)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in unit_test_model.modules())
    for layer, ref in zip(cache.layers, full.layers):
        assert layer.keys.shape[2] == 32
        assert (layer.keys[..., None, :] - ref.keys[:, :, None]).abs().amax(-1).amin(-1).max() < 1e-5
    # a softmax share of the prompt per KV head: the M rows also attend to themselves
    scores = press.score(unit_test_model.model.layers[0].self_attn, None, full.layers[0].keys, None, None, {})
    assert scores.shape == (1, 2, 64)


def test_lora_changes_the_selection(unit_test_model, lookaheadkv_folder, tmp_path):
    """The same embeddings without the LoRA (B = 0) keep other slots: the LoRA is on for the lookahead rows."""
    import shutil

    from safetensors.torch import load_file

    zero = tmp_path / "zero"
    shutil.copytree(lookaheadkv_folder, zero)
    tensors = load_file(zero / "adapter_model.safetensors")
    save_file(
        {k: v if "lora_A" in k else torch.zeros_like(v) for k, v in tensors.items()}, zero / "adapter_model.safetensors"
    )
    ids = torch.randint(0, 128, (1, 100))
    kept = []
    for folder in (lookaheadkv_folder, zero):
        press, cache = LookaheadKVPress.from_pretrained(folder, compression_ratio=0.5), DynamicCache()
        with torch.no_grad(), press(unit_test_model):
            unit_test_model(ids, past_key_values=cache)
        kept.append(cache.layers[0].keys.sort(2).values)
    assert not torch.equal(*kept)


def test_budget_sets_the_compression_ratio(unit_test_model, lookaheadkv_folder):
    press = LookaheadKVPress.from_pretrained(lookaheadkv_folder, budget=30)
    with torch.no_grad(), press(unit_test_model):
        unit_test_model(torch.randint(0, 128, (1, 100)), past_key_values=DynamicCache())
    assert press.compression_ratio == pytest.approx(0.7)
    LookaheadKVPress()  # constructs: the folder is found beside the model in post_init_from_model


@pytest.mark.parametrize("kwargs", [dict(compression_ratio=1.0), dict(compression_ratio=-0.5),
                                    dict(kernel_size=4), dict(budget=0)])
def test_invalid_settings(lookaheadkv_folder, kwargs):
    with pytest.raises(ValueError):
        LookaheadKVPress.from_pretrained(lookaheadkv_folder, **kwargs)


def test_padded_batch_and_static_cache_are_refused(unit_test_model, press):
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[0, :4] = 0
    with pytest.raises(ValueError, match="padded"), press(unit_test_model):
        unit_test_model(torch.ones(2, 32, dtype=torch.long), attention_mask=mask)
    static = StaticCache(config=unit_test_model.config, max_cache_len=64)
    with pytest.raises(ValueError, match="StaticCache"), press(unit_test_model):
        unit_test_model(torch.ones(1, 32, dtype=torch.long), past_key_values=static)
