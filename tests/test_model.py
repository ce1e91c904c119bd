"""Tests of model.py: parity with transformers, the loader's errors (support/checks.py), and the cache
behaviour that KV eviction relies on (cached decode, left padding, gather, positions != slots, Hook);
and of support/tokenizer.py's chat formats.

Everything runs on CPU in float32 on tiny random checkpoints (see tiny_hf_model in conftest.py).
"""

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import REORDER_ATOL
import torch

from model import Hook, KVCache, ModelConfig, attention_mask, load_model, rope_inv_freq
from support.tokenizer import Tokenizer

ATOL = 1e-4
V = 128  # vocab of the tiny checkpoints
PROJ_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Llama-3.1 RoPE scaling whose band sits inside a 100-token test sequence (wavelengths 6 .. 2e4:
# below 8 kept, 8..32 interpolated, above 32 slowed 8x). Passed in the old rope_theta +
# rope_scaling kwargs, which transformers 4.x and 5.x both accept (5.x saves rope_parameters).
LLAMA3_ROPE = dict(rope_theta=10000.0, rope_scaling=dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32))


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield




def pos(start, n, B=1):
    """Positions start .. start+n-1 for every row, (B, n)."""
    return torch.arange(start, start + n)[None].expand(B, n)


def rand_ids(B, T, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def max_diff(a, b):
    return (a - b).abs().max().item()


def hf_reference(folder):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    assert hf.dtype == torch.float32
    return hf


def copy_folder(src, tmp_path):
    dst = tmp_path / Path(src).name
    shutil.copytree(src, dst)
    return dst


def edit_config(folder, fn):
    p = Path(folder) / "config.json"
    d = json.loads(p.read_text())
    fn(d)
    p.write_text(json.dumps(d))


# -----------------------------------------------------------------------------
# 1. Parity with transformers

PARITY_CASES = {
    "llama-untied": ("llama", dict(tie_word_embeddings=False), 20),
    "llama-tied": ("llama", dict(tie_word_embeddings=True), 20),
    "llama3-rope-scaling": ("llama", dict(tie_word_embeddings=False, **LLAMA3_ROPE), 100),
    "mistral": ("mistral", dict(tie_word_embeddings=False), 20),
    "qwen2-bias-tied": ("qwen2", dict(tie_word_embeddings=True), 20),
    "qwen3-headdim-qknorm": ("qwen3", dict(tie_word_embeddings=False, head_dim=32), 20),
}


@pytest.mark.parametrize("case", PARITY_CASES)
def test_logits_match_transformers(tiny_hf_model, case):
    """Our from-scratch model gives the same logits as transformers on the same checkpoint."""
    family, config, T = PARITY_CASES[case]
    folder = tiny_hf_model(family, **config)
    ours, hf = load_model(folder), hf_reference(folder)
    ids = rand_ids(2, T, seed=1)
    ref = hf(ids).logits
    out = ours(ids, positions=pos(0, T, 2))
    assert out.shape == ref.shape == (2, T, V)
    assert ref.abs().max() > 1.0  # the random weights give logits that are not all ~0
    assert max_diff(out, ref) <= ATOL
    # the family-specific parts really are in play (else parity would prove little about them)
    attn = ours.model.layers[0].self_attn
    tied = ours.lm_head.weight is ours.model.embed_tokens.weight
    assert tied == config["tie_word_embeddings"]
    if not tied:
        assert max_diff(ours.lm_head.weight, ours.model.embed_tokens.weight) > 0.1
    if family == "qwen2":
        assert attn.q_proj.bias.abs().min() > 0 and attn.k_proj.bias.abs().max() > 0.1
    if family == "qwen3":
        assert ours.config.head_dim == 32 != ours.config.hidden_size // ours.config.num_attention_heads
        assert max_diff(attn.q_norm.weight, torch.ones(32)) > 0.1 and max_diff(attn.k_norm.weight, torch.ones(32)) > 0.1
    if case == "llama3-rope-scaling":
        torch.testing.assert_close(ours.inv_freq, hf.model.rotary_emb.inv_freq, atol=1e-7, rtol=1e-6)
        plain = rope_inv_freq(dataclasses.replace(ours.config, rope_scaling=None))
        assert torch.equal(ours.inv_freq[0], plain[0])  # short wavelengths kept
        assert torch.allclose(ours.inv_freq[-1], plain[-1] / 8)  # long ones slowed by `factor`
        assert (ours.inv_freq[1] != plain[1]) and (ours.inv_freq[1] != plain[1] / 8)  # the smooth band


def test_sharded_checkpoint_matches_transformers(tiny_hf_model):
    """A checkpoint split into shards (model.safetensors.index.json) loads like a single file."""
    folder = tiny_hf_model("llama", seed=3, max_shard_size="20KB", tie_word_embeddings=False)
    assert (folder / "model.safetensors.index.json").exists() and len(list(folder.glob("*.safetensors"))) > 2
    ids = rand_ids(1, 16, seed=2)
    assert max_diff(load_model(folder)(ids, positions=pos(0, 16)), hf_reference(folder)(ids).logits) <= ATOL


@pytest.mark.parametrize("at", [-1, 4])
def test_logits_at_gives_that_row(tiny_hf_model, at):
    m = load_model(tiny_hf_model("llama", tie_word_embeddings=False))
    ids = rand_ids(2, 9)
    full, one = m(ids, positions=pos(0, 9, 2)), m(ids, positions=pos(0, 9, 2), logits_at=at)
    assert one.shape == (2, 1, V)
    # one row through the final norm and lm_head is a matmul of another shape than nine rows: its
    # sums may be blocked in another order (SSE4's kernels do), so rounding apart: REORDER_ATOL
    torch.testing.assert_close(one[:, 0], full[:, at], atol=REORDER_ATOL, rtol=0)


def test_old_rope_scaling_config_form(tiny_hf_model, tmp_path):
    """Older configs say rope_theta + rope_scaling {"type": "llama3"}: same frequencies as the
    transformers 5 form rope_parameters {"rope_type": "llama3", "rope_theta": ...}."""
    new = tiny_hf_model("llama", tie_word_embeddings=False, **LLAMA3_ROPE)
    old = copy_folder(new, tmp_path)

    def to_old_form(d):
        rp = d.pop("rope_parameters", None) or d.pop("rope_scaling")  # transformers 5 / 4 saved it
        d["rope_theta"] = rp.pop("rope_theta", d.get("rope_theta"))
        del rp["rope_type"]
        d["rope_scaling"] = {"type": "llama3", **rp}

    edit_config(old, to_old_form)
    d = json.loads((old / "config.json").read_text())
    assert "rope_parameters" not in d and d["rope_scaling"]["type"] == "llama3" and d["rope_theta"] == 10000.0
    m_new, m_old = load_model(new), load_model(old)
    assert m_old.config.rope_scaling is not None
    torch.testing.assert_close(m_old.inv_freq, m_new.inv_freq, atol=0, rtol=0)
    plain = rope_inv_freq(dataclasses.replace(m_old.config, rope_scaling=None))
    assert not torch.allclose(m_old.inv_freq, plain)  # the scaling was read, not dropped
    ids = rand_ids(1, 60)
    torch.testing.assert_close(m_old(ids, positions=pos(0, 60)), m_new(ids, positions=pos(0, 60)), atol=0, rtol=0)


# -----------------------------------------------------------------------------
# 2. Loader errors: clear messages, no deep tracebacks


@pytest.fixture
def ckpt(tiny_hf_model, tmp_path):
    """A writable copy of a tiny untied llama checkpoint (single model.safetensors)."""
    return copy_folder(tiny_hf_model("llama", tie_word_embeddings=False), tmp_path)


def test_unknown_model_type_is_a_value_error(ckpt):
    edit_config(ckpt, lambda d: d.update(model_type="gpt2"))
    with pytest.raises(ValueError) as e:
        load_model(ckpt)
    assert "gpt2" in str(e.value) and all(t in str(e.value) for t in ("llama", "mistral", "qwen2", "qwen3"))


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_unknown_rope_type_is_a_value_error(ckpt, key):
    def to_yarn(d):
        d.pop("rope_parameters", None)
        d.pop("rope_scaling", None)
        d[key] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                  **({"rope_theta": 10000.0} if key == "rope_parameters" else {})}

    edit_config(ckpt, to_yarn)
    with pytest.raises(ValueError) as e:
        load_model(ckpt)
    assert "yarn" in str(e.value) and "llama3" in str(e.value) and "default" in str(e.value)


def rewrite_tensors(folder, fn):
    from safetensors.torch import load_file, save_file

    p = folder / "model.safetensors"
    tensors = load_file(p)
    fn(tensors)
    save_file(tensors, p, metadata={"format": "pt"})


def test_missing_tensor_names_it(ckpt):
    rewrite_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(ckpt)


def test_unexpected_tensor_names_it(ckpt):
    rewrite_tensors(ckpt, lambda t: t.update({"model.layers.0.self_attn.rotary.weight": torch.zeros(3)}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.rotary\.weight"):
        load_model(ckpt)


def test_wrong_shape_names_it(ckpt):
    rewrite_tensors(ckpt, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}))
    with pytest.raises(ValueError) as e:
        load_model(ckpt)
    assert "model.layers.0.self_attn.k_proj.weight" in str(e.value) and "(16, 64)" in str(e.value)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors_is_a_value_error(ckpt, damage):
    p = ckpt / "model.safetensors"
    data = p.read_bytes()
    p.write_bytes(b"not a safetensors file " * 50 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(ckpt)


def test_missing_shard_is_file_not_found(tiny_hf_model, tmp_path):
    folder = copy_folder(tiny_hf_model("llama", seed=3, max_shard_size="20KB", tie_word_embeddings=False), tmp_path)
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_model(folder)


def test_no_config_json_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_broken_config_json_is_a_value_error(ckpt):
    edit_config(ckpt, lambda d: d.pop("hidden_size"))
    with pytest.raises(ValueError, match="config.json lacks hidden_size"):
        load_model(ckpt)
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_model(ckpt)


# one entry per class of bad config.json field: (edit, key named in the message, text of the value)
BAD_CONFIGS = {
    "size-as-string": (lambda d: d.update(hidden_size="64"), "hidden_size", '"64"'),
    "count-zero": (lambda d: d.update(num_attention_heads=0), "num_attention_heads", "0"),
    "count-float": (lambda d: d.update(num_hidden_layers=2.5), "num_hidden_layers", "2.5"),
    "vocab-negative": (lambda d: d.update(vocab_size=-1), "vocab_size", "-1"),
    "kv-heads-not-a-divisor": (lambda d: d.update(num_key_value_heads=3), "num_key_value_heads", "3"),
    "heads-not-dividing-hidden": (lambda d: (d.update(num_attention_heads=6, num_key_value_heads=2),
                                             d.pop("head_dim", None)), "num_attention_heads", "6"),
    "head-dim-odd": (lambda d: d.update(head_dim=15), "head_dim", "15"),
    "eps-not-finite": (lambda d: d.update(rms_norm_eps=float("nan")), "rms_norm_eps", "NaN"),
    "theta-not-positive": (lambda d: (d.pop("rope_parameters", None), d.update(rope_theta=-1.0)), "rope_theta", "-1.0"),
    "flag-not-bool": (lambda d: d.update(tie_word_embeddings="yes"), "tie_word_embeddings", '"yes"'),
    "rope-scaling-not-object": (lambda d: (d.pop("rope_parameters", None), d.update(rope_scaling=[8.0])),
                                "rope_scaling", "[8.0]"),
    "eos-not-an-id": (lambda d: d.update(eos_token_id="</s>"), "eos_token_id", '"</s>"'),
    # nothing silent (issue 37): JSON true is no count, NaN and Infinity parse, and what no tensor shape reveals
    "count-true": (lambda d: d.update(num_hidden_layers=True), "num_hidden_layers", "true"),
    "kv-heads-true": (lambda d: d.update(num_key_value_heads=True), "num_key_value_heads", "true"),  # 1 divides 4
    "max-positions-true": (lambda d: d.update(max_position_embeddings=True), "max_position_embeddings", "true"),
    "intermediate-zero": (lambda d: d.update(intermediate_size=0), "intermediate_size", "0"),
    "max-positions-zero": (lambda d: d.update(max_position_embeddings=0), "max_position_embeddings", "0"),
    "eps-zero": (lambda d: d.update(rms_norm_eps=0.0), "rms_norm_eps", "0.0"),
    "theta-infinite": (lambda d: d["rope_parameters"].update(rope_theta=float("inf")), "rope_parameters.rope_theta",
                       "Infinity"),
    "llama3-factor-nan": (lambda d: d["rope_parameters"].update(LLAMA3_ROPE["rope_scaling"], factor=float("nan")),
                          "rope_parameters.factor", "NaN"),
    "llama3-old-context-true": (lambda d: d["rope_parameters"].update(LLAMA3_ROPE["rope_scaling"],
                                                                      original_max_position_embeddings=True),
                                "rope_parameters.original_max_position_embeddings", "true"),
    "rope-parameters-false": (lambda d: d.update(rope_parameters=False), "rope_parameters", "false"),
    "sliding-window-zero": (lambda d: d.update(use_sliding_window=True, sliding_window=0), "sliding_window", "0"),
    "sliding-flag-not-bool": (lambda d: d.update(use_sliding_window="yes"), "use_sliding_window", '"yes"'),
    "eos-true": (lambda d: d.update(eos_token_id=True), "eos_token_id", "true"),
    "eos-outside-vocab": (lambda d: d.update(eos_token_id=[2, 128]), "eos_token_id", "[2, 128]"),
    "activation-not-silu": (lambda d: d.update(hidden_act="gelu"), "hidden_act", '"gelu"'),
}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_bad_config_field_names_file_key_and_value(ckpt, case):
    """A config.json field of the wrong type or out of range: one ValueError naming the file, the key, the
    value and what to do, before any tensor is made (not a TypeError deep in torch)."""
    edit, key, value = BAD_CONFIGS[case]
    edit_config(ckpt, edit)
    with pytest.raises(ValueError) as e:
        load_model(ckpt)
    msg = str(e.value)
    assert str(ckpt / "config.json") in msg and key in msg and value in msg and "fix that key" in msg, msg
    assert "\n" not in msg


@pytest.mark.parametrize("family, config, says", [
    ("llama", dict(model_type="qwen2", attention_bias=None), "q/k/v biases (attention_bias) but the checkpoint has none"),
    ("llama", dict(model_type="qwen3"), "(q/k norms) but the checkpoint has none"),
    ("qwen2", dict(model_type="llama"), "the checkpoint has q/k/v biases"),
    ("llama", dict(num_hidden_layers=3), "says num_hidden_layers 3 but the checkpoint has 2 layers"),
])
def test_config_from_another_model_is_blamed(tiny_hf_model, tmp_path, family, config, says):
    """Tensors that another model_type or layer count would explain: the message blames config.json, not
    the download ("lacks 91 tensors ... re-download it" sent users the wrong way)."""
    folder = copy_folder(tiny_hf_model(family, tie_word_embeddings=False), tmp_path)
    edit_config(folder, lambda d: d.update(config))  # attention_bias null: the model_type's default
    with pytest.raises(ValueError) as e:
        load_model(folder)
    assert says in str(e.value) and str(folder / "config.json") in str(e.value), str(e.value)
    assert "from another model?" in str(e.value) and "re-download" not in str(e.value)


def move_in_index(folder, name):
    """The index puts tensor `name` in the first shard."""
    p = folder / "model.safetensors.index.json"
    index = json.loads(p.read_text())
    index["weight_map"][name] = sorted(folder.glob("model-*.safetensors"))[0].name
    p.write_text(json.dumps(index))


def store_twice(folder):
    from safetensors.torch import load_file, save_file

    first, second = sorted(folder.glob("model-*.safetensors"))[:2]
    name, t = next(iter(load_file(first).items()))
    save_file({**load_file(second), name: t}, second, metadata={"format": "pt"})


# one entry per pair of facts config.json, the index and the shards state about one model:
# (sharded?, edit of the folder, what the message must name: the file(s) and the field or tensor)
CONTRADICTIONS = {
    "embed-rows-vs-vocab": (False, lambda f: edit_config(f, lambda d: d.update(vocab_size=100)),
                            ["model.safetensors", "lm_head.weight", "config.json", "vocab_size 100"]),
    "shapes-vs-hidden": (False, lambda f: edit_config(f, lambda d: d.update(hidden_size=32)),
                         ["model.safetensors", "lm_head.weight", "config.json", "hidden_size 32"]),
    "mlp-vs-intermediate": (False, lambda f: edit_config(f, lambda d: d.update(intermediate_size=96)),
                            ["model.safetensors", "mlp.down_proj.weight", "config.json", "intermediate_size 96"]),
    "k-proj-vs-kv-heads": (False, lambda f: edit_config(f, lambda d: d.update(num_key_value_heads=4)),
                           ["model.safetensors", "self_attn.k_proj.weight", "config.json", "num_key_value_heads 4"]),
    "tied-but-own-head": (False, lambda f: edit_config(f, lambda d: d.update(tie_word_embeddings=True)),
                          ["config.json", "tie_word_embeddings", "model.safetensors", "lm_head.weight"]),
    "untied-without-head": (False, lambda f: rewrite_tensors(f, lambda t: t.pop("lm_head.weight")),
                            ["config.json", "tie_word_embeddings", "lm_head.weight"]),
    "index-says-other-shard": (True, lambda f: move_in_index(f, "model.norm.weight"),
                               ["model.safetensors.index.json", "model.norm.weight", "model-00001-of-"]),
    "index-lists-no-such-tensor": (True, lambda f: move_in_index(f, "model.layers.0.mlp.extra.weight"),
                                   ["model.safetensors.index.json", "model.layers.0.mlp.extra.weight"]),
    "tensor-in-two-shards": (True, store_twice, ["model-00001-of-", "model-00002-of-", "stored twice"]),
}


@pytest.mark.parametrize("case", CONTRADICTIONS)
def test_files_that_contradict_each_other_are_refused(tiny_hf_model, tmp_path, case):
    """config.json, the index and the safetensors files state the same facts about one model (vocab, sizes, layer
    count, tied head, which shard holds what): where two disagree, one ValueError line names the files and the field or
    tensor, before a model is returned that is part one checkpoint, part another (issue 37)."""
    sharded, damage, says = CONTRADICTIONS[case]
    folder = copy_folder(tiny_hf_model("llama", seed=3, tie_word_embeddings=False,
                                       max_shard_size="20KB" if sharded else None), tmp_path)
    damage(folder)
    with pytest.raises(ValueError) as e:
        load_model(folder)
    msg = str(e.value)
    assert all(s in msg for s in says) and "\n" not in msg, msg


def test_tied_checkpoint_that_stores_its_head_too_loads_tied(tiny_hf_model, tmp_path):
    """Valid input stays accepted: a tied checkpoint may hold lm_head.weight as a copy of the embedding."""
    folder = copy_folder(tiny_hf_model("llama", tie_word_embeddings=True), tmp_path)
    before = load_model(folder)
    rewrite_tensors(folder, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    after = load_model(folder)
    ids = torch.tensor([[1, 2, 3]])
    assert after.lm_head.weight is after.model.embed_tokens.weight
    assert torch.equal(before(ids, positions=torch.arange(3)[None]), after(ids, positions=torch.arange(3)[None]))


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_non_finite_weight_names_tensor_and_file(ckpt, bad):
    """One NaN in a checkpoint made generate.py answer nothing, silently: the loader names the tensor."""
    def poison(t):
        t["model.layers.1.mlp.down_proj.weight"][3, 5] = float(bad)
    rewrite_tensors(ckpt, poison)
    with pytest.raises(ValueError) as e:
        load_model(ckpt)
    msg = str(e.value)
    assert "model.layers.1.mlp.down_proj.weight" in msg and str(ckpt / "model.safetensors") in msg
    assert ("NaN" if bad == "nan" else "inf") in msg and "re-download" in msg


def test_weight_too_large_for_dtype_says_so(ckpt):
    rewrite_tensors(ckpt, lambda t: t["model.norm.weight"].__setitem__(0, 1e6))  # finite in float32
    load_model(ckpt)
    with pytest.raises(ValueError, match=r"model\.norm\.weight .* too large for torch\.float16"):
        load_model(ckpt, dtype=torch.float16)


def test_broken_prepared_folder_says_delete_and_prepare(ckpt):
    """In a folder weights/prepare.py made (it has a .prepared stamp), the fix is to delete it and rerun
    prepare, not to "re-download" something the user never downloaded."""
    (ckpt / ".prepared").write_text("sha\n")
    p = ckpt / "model.safetensors"
    p.write_bytes(p.read_bytes()[:1000])
    with pytest.raises(ValueError) as e:
        load_model(ckpt)
    assert f"{p} is not a readable safetensors file" in str(e.value)
    assert f"delete the folder {ckpt} and rerun python weights/prepare.py" in str(e.value)


# -----------------------------------------------------------------------------
# The model the cache tests share: 3 layers, 4 query heads on 2 KV heads (GQA), untied


@pytest.fixture(scope="module")
def tiny(tiny_hf_model):
    m = load_model(tiny_hf_model("llama", seed=1, num_hidden_layers=3, tie_word_embeddings=False))
    assert (m.config.num_attention_heads, m.config.num_key_value_heads, m.config.head_dim) == (4, 2, 16)
    return m


def prefill(model, ids, positions=None, pad_mask=None):
    cache = KVCache(model.config.num_hidden_layers)
    B, T = ids.shape
    logits = model(ids, positions=pos(0, T, B) if positions is None else positions, cache=cache, pad_mask=pad_mask)
    return cache, logits


def left_pad(rows, T):
    """Left-pad token rows to length T: ids (B, T), pad_mask (B, T), positions (B, T) that start
    at 0 at each row's first real token."""
    B = len(rows)
    ids = torch.zeros(B, T, dtype=torch.long)
    pad_mask = torch.zeros(B, T, dtype=torch.bool)
    positions = torch.zeros(B, T, dtype=torch.long)
    for b, r in enumerate(rows):
        p = T - len(r)
        ids[b, p:], pad_mask[b, p:], positions[b, p:] = r, True, torch.arange(len(r))
    return ids, pad_mask, positions


# -----------------------------------------------------------------------------
# 3. Cached decode == full forward


def test_cached_decode_one_by_one_matches_full_forward(tiny):
    """Prefill then one token at a time (explicit positions) gives the full forward's logits."""
    ids = rand_ids(2, 14, seed=4)
    ref = tiny(ids, positions=pos(0, 14, 2))
    cache, first = prefill(tiny, ids[:, :8])
    out = [first]
    for t in range(8, 14):
        out.append(tiny(ids[:, t:t + 1], positions=pos(t, 1, 2), cache=cache))
    assert len(cache) == 14
    assert max_diff(torch.cat(out, 1), ref) <= ATOL


@pytest.mark.parametrize("split", [1, 5, 11])
def test_chunk_on_top_of_cache_matches_full_forward(tiny, split):
    """A multi-token chunk appended to a cache (as the lookahead chunk is) needs a bottom-right
    aligned causal mask; SDPA's is_causal would be top-left aligned and wrong here."""
    ids = rand_ids(2, 14, seed=5)
    ref = tiny(ids, positions=pos(0, 14, 2))
    cache, first = prefill(tiny, ids[:, :split])
    second = tiny(ids[:, split:], positions=pos(split, 14 - split, 2), cache=cache)
    assert max_diff(torch.cat([first, second], 1), ref) <= ATOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_lower_right_chunk_on_cuda_equals_the_explicit_mask():
    """model.Attention's call for a chunk on a cache (causal_lower_right, GQA), which CUDA sends to
    flash attention in bf16, against the same call with attention_mask's explicit bool mask
    (another kernel): outputs and gradients (training runs this call) agree."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    g = torch.Generator(device="cuda").manual_seed(0)
    q0 = torch.randn(1, 32, 40, 128, device="cuda", dtype=torch.bfloat16, generator=g)  # 40 rows after 300 slots
    k0, v0 = (torch.randn(1, 8, 340, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    outs, grads = [], []
    for mask in (causal_lower_right(40, 340), attention_mask(40, 340, None, "cuda")):
        q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        y.float().square().sum().backward()
        outs.append(y.float())
        grads.append([t.grad.float() for t in (q, k, v)])
    assert (outs[0] - outs[1]).abs().max().item() < 2e-2
    for a, b in zip(*grads):
        assert (a - b).abs().max().item() < 5e-2 * max(1.0, b.abs().max().item())


def test_attention_mask_is_bottom_right_and_never_empty():
    """The chunk's Tq queries sit at the last Tq of Tk slots; a query may see the slots up to its
    own, minus invalid ones, but always its own slot: a padding query with no key at all would
    give NaN on some SDPA kernels (torch 2.13's CPU kernels return 0, so only this direct check
    catches a missing guard), and a NaN value in the cache poisons every later query (0 * NaN)."""
    key_valid = torch.tensor([[False, False, True, True, True, True]])[:, None]  # (1, 1, 6)
    m = attention_mask(3, 6, key_valid, "cpu")
    assert m.shape == (1, 1, 3, 6)
    expected = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(m[0, 0], expected)
    pad = attention_mask(6, 6, key_valid, "cpu")[0, 0]
    assert pad.any(-1).all() and torch.equal(pad[:2], torch.eye(6, dtype=torch.bool)[:2])
    assert torch.equal(attention_mask(4, 4, None, "cpu")[0, 0], torch.ones(4, 4, dtype=torch.bool).tril())


def test_positions_shift_leaves_logits_but_not_keys(tiny):
    """RoPE is relative: shifting every position by a constant keeps the logits, while the cached
    keys (rotated) change. So positions, not slots, carry the order of tokens."""
    ids = rand_ids(1, 10, seed=6)
    c0, l0 = prefill(tiny, ids)
    c1, l1 = prefill(tiny, ids, positions=pos(37, 10))
    assert max_diff(l0, l1) <= ATOL
    assert max_diff(c0.k[0], c1.k[0]) > 0.1
    torch.testing.assert_close(c0.v[0], c1.v[0], atol=1e-5, rtol=0)  # values carry no RoPE


# -----------------------------------------------------------------------------
# 4. Left-padded batch == each row alone

ROW_LENGTHS = (10, 6, 3)


def padded_rows(seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g) for n in ROW_LENGTHS]


def test_left_padded_batch_matches_rows_alone_with_cache(tiny):
    """Batched prefill + decode of rows of different lengths equals running each row alone."""
    rows = padded_rows()
    ids, pad_mask, positions = left_pad(rows, max(ROW_LENGTHS))
    new = rand_ids(len(rows), 3, seed=8)
    cache, last = prefill(tiny, ids, positions, pad_mask)
    batch = [last[:, -1]]
    for s in range(3):
        step_pos = torch.tensor(ROW_LENGTHS)[:, None] + s
        batch.append(tiny(new[:, s:s + 1], positions=step_pos, cache=cache)[:, -1])
    for b, r in enumerate(rows):
        c, l = prefill(tiny, r[None])
        alone = [l[:, -1]] + [tiny(new[b:b + 1, s:s + 1], positions=pos(len(r) + s, 1), cache=c)[:, -1]
                              for s in range(3)]
        for step, (x, y) in enumerate(zip(batch, alone)):
            assert max_diff(x[b], y[0]) <= ATOL, f"row {b}, step {step}"


def test_left_padded_batch_without_cache_matches_rows_alone(tiny):
    rows = padded_rows(seed=9)
    T = max(ROW_LENGTHS)
    ids, pad_mask, positions = left_pad(rows, T)
    out = tiny(ids, positions=positions, pad_mask=pad_mask)
    assert torch.isfinite(out).all()  # padding rows must not turn into NaN
    for b, r in enumerate(rows):
        alone = tiny(r[None], positions=pos(0, len(r)))
        assert max_diff(out[b, T - len(r):], alone[0]) <= ATOL


# -----------------------------------------------------------------------------
# 5. Eviction that keeps everything == no eviction


@pytest.mark.parametrize("order", ["identity", "permuted"])
@pytest.mark.parametrize("padded", [False, True], ids=["equal-rows", "left-padded"])
def test_gather_keeping_every_slot_changes_nothing(tiny, order, padded):
    """gather() with all slots, in any order per KV head, leaves decoding unchanged: RoPE was
    applied before caching, so attention does not care where in the cache a key sits."""
    L, Hkv = tiny.config.num_hidden_layers, tiny.config.num_key_value_heads
    if padded:
        rows = padded_rows(seed=10)[:2]
        ids, pad_mask, positions = left_pad(rows, len(rows[0]))
        next_pos = torch.tensor([len(r) for r in rows])[:, None]
    else:
        ids, pad_mask, positions = rand_ids(2, 10, seed=10), None, None
        next_pos = torch.full((2, 1), 10)
    B, T = ids.shape
    new = rand_ids(B, 3, seed=11)
    ref_cache, _ = prefill(tiny, ids, positions, pad_mask)
    cache = ref_cache.copy()
    g = torch.Generator().manual_seed(12)
    for l in range(L):
        if order == "identity":
            idx = torch.arange(T).expand(B, Hkv, T)
        else:
            idx = torch.stack([torch.randperm(T, generator=g) for _ in range(B * Hkv)]).view(B, Hkv, T)
        cache.gather(l, idx)
    assert len(cache) == T
    if order == "permuted":
        assert max_diff(cache.k[0], ref_cache.k[0]) > 0.1  # the slots really moved
    if padded:
        assert cache.valid[0].shape == (B, Hkv, T) and cache.valid[0].sum() == pad_mask.sum() * Hkv
    for s in range(3):
        want = tiny(new[:, s:s + 1], positions=next_pos + s, cache=ref_cache)
        got = tiny(new[:, s:s + 1], positions=next_pos + s, cache=cache)
        assert max_diff(got, want) <= ATOL


# -----------------------------------------------------------------------------
# 6. Keeping a different subset per KV head


def masked_reference(model, monkeypatch, ids, positions, pad_mask, keep):
    """Full forward over all tokens where, in layer l, the LAST query may only see the keys with
    keep[l] (B, H_kv, T) True: model.attention_mask is patched to add that per-KV-head mask.
    pad_mask is always given so that Attention takes its masked path."""
    orig, calls = attention_mask, []

    def patched(Tq, Tk, key_valid, device):
        m = orig(Tq, Tk, key_valid, device)
        k = keep[len(calls)]
        calls.append(None)
        m = m.expand(k.shape[0], k.shape[1], Tq, Tk).clone()
        m[:, :, -1, :] &= k
        return m

    with monkeypatch.context() as mp:
        mp.setattr("model.attention_mask", patched)  # where Attention looks it up
        out = model(ids, positions=positions, pad_mask=pad_mask)
    assert len(calls) == model.config.num_hidden_layers  # the patch was really used, once per layer
    return out[:, -1]


@pytest.mark.parametrize("padded", [False, True], ids=["equal-rows", "left-padded"])
def test_per_kv_head_eviction_matches_masked_full_forward(tiny, monkeypatch, padded):
    """After each (row, layer, KV head) keeps its own C of the T prompt slots, decoding the next
    token at position T equals a full forward in which that token's query only sees the kept
    keys (plus itself). And the position must be T, not C: slots are not positions."""
    L, Hkv, C = tiny.config.num_hidden_layers, tiny.config.num_key_value_heads, 6
    if padded:
        rows = [rand_ids(1, 16, seed=13)[0], rand_ids(1, 11, seed=14)[0]]
        ids, pad_mask, positions = left_pad(rows, 16)
        lengths = torch.tensor([16, 11])
    else:
        ids, pad_mask, positions = rand_ids(2, 16, seed=13), None, pos(0, 16, 2)
        lengths = torch.tensor([16, 16])
    B, T = ids.shape
    new = rand_ids(B, 1, seed=15)
    cache, _ = prefill(tiny, ids, positions, pad_mask)
    full_cache = cache.copy()
    g = torch.Generator().manual_seed(16)
    keep = []
    for l in range(L):
        idx = torch.stack([torch.randperm(T, generator=g)[:C] for _ in range(B * Hkv)]).view(B, Hkv, C)
        cache.gather(l, idx)
        k = torch.zeros(B, Hkv, T + 1, dtype=torch.bool).scatter_(2, idx, True)
        k[..., T] = True  # the new token sees itself
        keep.append(k)
    assert len(cache) == C
    assert not torch.equal(keep[0][:, 0], keep[0][:, 1])  # KV heads really keep different slots
    evicted = cache.copy()
    got = tiny(new, positions=lengths[:, None], cache=cache)[:, -1]

    all_ids = torch.cat([ids, new], 1)
    all_pos = torch.cat([positions, lengths[:, None]], 1)
    all_mask = torch.ones(B, T + 1, dtype=torch.bool) if pad_mask is None else torch.cat(
        [pad_mask, torch.ones(B, 1, dtype=torch.bool)], 1)
    want = masked_reference(tiny, monkeypatch, all_ids, all_pos, all_mask, keep)
    assert max_diff(got, want) <= ATOL

    # the comparison is not vacuous: without eviction the logits differ ...
    no_evict = tiny(new, positions=lengths[:, None], cache=full_cache)[:, -1]
    assert max_diff(no_evict, got) > 1e-2
    # ... and so do they if the new token is put at position C (the slot count) instead of T
    wrong_pos = tiny(new, positions=torch.full((B, 1), C), cache=evicted)[:, -1]
    assert max_diff(wrong_pos, got) > 1e-2


# -----------------------------------------------------------------------------
# 7. Hook


class Recorder(Hook):
    def __init__(self, lora=None):
        self.lora_calls, self.attn_calls, self._lora = [], [], lora

    def lora(self, layer, name, x):
        self.lora_calls.append((layer, name))
        return None if self._lora is None else self._lora(layer, name, x)

    def attn(self, layer, q, k, key_valid):
        self.attn_calls.append((layer, q.clone(), k.clone(), None if key_valid is None else key_valid.clone()))


def test_hook_zero_lora_changes_nothing(tiny):
    ids = rand_ids(2, 9, seed=17)
    H, D = tiny.config.num_attention_heads, tiny.config.head_dim
    zero_q = lambda layer, name, x: x.new_zeros(*x.shape[:-1], H * D) if name == "q_proj" else None
    hook = Recorder(zero_q)
    out = tiny(ids, positions=pos(0, 9, 2), hook=hook)
    assert torch.equal(out, tiny(ids, positions=pos(0, 9, 2)))
    L = tiny.config.num_hidden_layers
    assert sorted(hook.lora_calls) == sorted((l, n) for l in range(L) for n in PROJ_NAMES)


def test_hook_lora_delta_equals_merged_weights(tiny):
    """A LoRA term added through the hook is the same as adding B @ A to the weight."""
    ids = rand_ids(2, 9, seed=18)
    g = torch.Generator().manual_seed(19)
    lin = tiny.model.layers[1].self_attn.v_proj
    A = torch.randn(4, lin.in_features, generator=g) * 0.3
    Bm = torch.randn(lin.out_features, 4, generator=g) * 0.3
    delta = lambda layer, name, x: x @ A.T @ Bm.T if (layer, name) == (1, "v_proj") else None
    base = tiny(ids, positions=pos(0, 9, 2))
    hooked = tiny(ids, positions=pos(0, 9, 2), hook=Recorder(delta))
    assert max_diff(hooked, base) > 1e-2
    saved = lin.weight.clone()
    try:
        lin.weight += Bm @ A
        merged = tiny(ids, positions=pos(0, 9, 2))
    finally:
        lin.weight.copy_(saved)
    assert max_diff(hooked, merged) <= ATOL


def test_hook_attn_sees_queries_and_all_cached_keys(tiny):
    """attn() gets q (B, H, Tq, D) and k (B, H_kv, cached + Tq, D): the keys are exactly what the
    cache holds after the chunk, so a scorer can compute the chunk's attention over the cache."""
    cfg = tiny.config
    H, Hkv, D, L = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
    ids = rand_ids(2, 9, seed=20)
    hook = Recorder()
    cache, _ = prefill(tiny, ids[:, :6])
    tiny(ids[:, 6:], positions=pos(6, 3, 2), cache=cache, hook=hook)
    assert [c[0] for c in hook.attn_calls] == list(range(L))
    for layer, q, k, key_valid in hook.attn_calls:
        assert q.shape == (2, H, 3, D) and k.shape == (2, Hkv, 9, D) and key_valid is None
        assert torch.equal(k, cache.k[layer])
    # the chunk's queries sit at the last Tq slots: q . k at the diagonal slot, recomputed from a
    # full forward's hook, is the same
    hook_full = Recorder()
    tiny(ids, positions=pos(0, 9, 2), hook=hook_full)
    torch.testing.assert_close(hook.attn_calls[-1][1], hook_full.attn_calls[-1][1][:, :, 6:],
                               atol=REORDER_ATOL, rtol=0)  # a chunk of 3 vs 9 rows: another sum order
    # without a cache, with padding: key_valid is the pad mask (B, 1, T)
    rows = padded_rows()
    p_ids, pad_mask, positions = left_pad(rows, max(ROW_LENGTHS))
    hook_pad = Recorder()
    tiny(p_ids, positions=positions, pad_mask=pad_mask, hook=hook_pad)
    for _, q, k, key_valid in hook_pad.attn_calls:
        assert q.shape[2] == k.shape[2] == 10 and torch.equal(key_valid, pad_mask[:, None, :])


class LastRowsByHand(Hook):
    """attn_output: the last n queries' attention computed here (as LookaheadHook does from its scores)."""

    def __init__(self, n, scale=1.0):
        self.n, self.scale, self.calls = n, scale, 0

    def attn(self, layer, q, k, key_valid):
        from eviction import group_attention
        self.probs, self.rows = group_attention(q[:, :, -self.n:], k, key_valid), min(self.n, q.shape[2])

    def attn_output(self, layer, v):
        self.calls += 1
        y = (self.probs @ v.float()) * self.scale  # (B, H_kv, G*n, D)
        return y.view(v.shape[0], -1, self.rows, v.shape[-1])


@pytest.mark.parametrize("case", ["no-cache", "on-a-cache", "left-padded", "whole-chunk"])
def test_hook_attn_output_replaces_sdpa_for_the_last_rows(tiny, case):
    """A hook's attn_output is the last n rows' attention: with the same attention computed by hand the
    forward is the one SDPA gives, and the rows before them are run exactly as a forward of those rows
    alone runs them (their keys, values and logits to the bit): how the lookahead rows ride in the prefill
    without touching the prompt's cache."""
    L, n = tiny.config.num_hidden_layers, 3
    ids, pad_mask, positions, cache = rand_ids(2, 9, seed=27), None, pos(0, 9, 2), None
    if case == "left-padded":
        ids, pad_mask, positions = left_pad(padded_rows(seed=28)[:2], 10)
    if case in ("on-a-cache", "whole-chunk"):
        cache, _ = prefill(tiny, rand_ids(2, 5, seed=29))
        positions = pos(5, 9, 2)
    if case == "whole-chunk":  # the two-pass form: every row of the chunk is the hook's
        ids, positions = ids[:, :n], positions[:, :n]
    T = ids.shape[1]
    fresh = lambda: KVCache(L) if cache is None else cache.copy()

    def run(hook, c, rows=T):
        mask = None if pad_mask is None else pad_mask[:, :rows]
        return tiny(ids[:, :rows], positions=positions[:, :rows], pad_mask=mask, cache=c, hook=hook)

    want = run(None, fresh())
    hook, hand_cache = LastRowsByHand(n), fresh()
    got = run(hook, hand_cache)
    assert hook.calls == L
    assert max_diff(got, want) <= ATOL
    if T > n:  # the first T - n rows: as a forward of them alone
        alone_cache = fresh()
        alone = run(None, alone_cache, T - n)
        # the same values: bit-equal on this machine's kernels, but SDPA over T keys against T - n may
        # block its sums differently on another CPU's (AVX2's does): rounding apart, REORDER_ATOL
        assert max_diff(got[:, : T - n], alone) <= REORDER_ATOL
        for l in range(L):
            assert max_diff(hand_cache.k[l][:, :, :-n], alone_cache.k[l]) <= REORDER_ATOL
            assert max_diff(hand_cache.v[l][:, :, :-n], alone_cache.v[l]) <= REORDER_ATOL
    # the output is used: a wrong one changes the last rows' logits (and only theirs)
    wrong = run(LastRowsByHand(n, scale=2.0), fresh())
    assert max_diff(wrong[:, -n:], want[:, -n:]) > 1e-3
    assert torch.equal(wrong[:, : T - n], got[:, : T - n])


# -----------------------------------------------------------------------------
# 8. KVCache bookkeeping


@pytest.mark.parametrize("padded", [False, True], ids=["equal-rows", "left-padded"])
def test_truncate_drops_the_lookahead_chunk(tiny, padded):
    """Appending a lookahead chunk and truncating back restores the cache exactly, so decoding
    goes on as if the chunk had never been run."""
    if padded:
        ids, pad_mask, positions = left_pad(padded_rows(seed=21)[:2], 10)
        next_pos = torch.tensor([[10], [6]])
    else:
        ids, pad_mask, positions = rand_ids(2, 10, seed=21), None, pos(0, 10, 2)
        next_pos = torch.full((2, 1), 10)
    cache, _ = prefill(tiny, ids, positions, pad_mask)
    saved = [(k.clone(), v.clone(), None if m is None else m.clone()) for k, v, m in zip(cache.k, cache.v, cache.valid)]
    new = rand_ids(2, 1, seed=22)
    want = tiny(new, positions=next_pos, cache=cache.copy())
    tiny(rand_ids(2, 4, seed=23), positions=next_pos + torch.arange(4), cache=cache)  # lookahead
    assert len(cache) == 14
    cache.truncate(10)
    assert len(cache) == 10
    for (k, v, m), k2, v2, m2 in zip(saved, cache.k, cache.v, cache.valid):
        assert torch.equal(k, k2) and torch.equal(v, v2)
        assert (m is None and m2 is None) or torch.equal(m, m2)
    assert torch.equal(tiny(new, positions=next_pos, cache=cache), want)


def test_copy_is_independent_of_appends_and_gathers(tiny):
    ids = rand_ids(2, 8, seed=24)
    cache, _ = prefill(tiny, ids)
    before = [k.clone() for k in cache.k]
    c = cache.copy()
    tiny(rand_ids(2, 3, seed=25), positions=pos(8, 3, 2), cache=c)
    c.gather(0, torch.zeros(2, 2, 1, dtype=torch.long))
    assert len(c.k[1]) and c.k[1].shape[2] == 11 and c.k[0].shape[2] == 1
    assert len(cache) == 8
    assert all(torch.equal(a, b) for a, b in zip(before, cache.k))


def test_nbytes_counts_keys_and_values(tiny):
    cfg = tiny.config
    cache, _ = prefill(tiny, rand_ids(2, 8, seed=26))
    per_slot = 2 * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4  # K+V, B=2, fp32
    assert cache.nbytes() == 8 * per_slot
    for l in range(cfg.num_hidden_layers):
        cache.gather(l, torch.arange(3).expand(2, cfg.num_key_value_heads, 3))
    assert cache.nbytes() == 3 * per_slot
    assert KVCache(3).nbytes() == 0 and len(KVCache(3)) == 0


# -----------------------------------------------------------------------------
# 9. Config fingerprint


def test_fingerprint_is_stable_and_tells_architectures_apart(tiny_hf_model):
    a = ModelConfig.from_hf_config(tiny_hf_model("llama", tie_word_embeddings=False))
    again = ModelConfig.from_hf_config(tiny_hf_model("llama", tie_word_embeddings=False))
    assert a.fingerprint() == again.fingerprint() == dataclasses.replace(a, name="elsewhere").fingerprint()
    assert all(c in "0123456789abcdef" for c in a.fingerprint()) and len(a.fingerprint()) == 16
    others = [
        ModelConfig.from_hf_config(tiny_hf_model("qwen2", tie_word_embeddings=True)),
        dataclasses.replace(a, num_hidden_layers=3),
        dataclasses.replace(a, num_key_value_heads=4),
        dataclasses.replace(a, rope_theta=500000.0),
    ]
    prints = {a.fingerprint()} | {o.fingerprint() for o in others}
    assert len(prints) == 1 + len(others)


# -----------------------------------------------------------------------------
# 10. Tokenizer and chat formats (support/tokenizer.py)

SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# verbatim from HuggingFaceTB/SmolLM2-*-Instruct tokenizer_config.json (after JSON decoding: the
# newlines inside the jinja string literals are real newline characters)
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# a Qwen3-like template: no default system message
PLAIN_CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (  # Meta-Llama-3-8B-Instruct's
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>", "<|eom_id|>"]


def make_tokenizer(folder, specials, template, extra_config=None, eos=None):
    """A tiny word-level tokenizer folder: tokenizer.json, tokenizer_config.json (+ generation_config)."""
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    words = ["[UNK]", "hi", "there", "be", "brief", "."]
    tk = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens(specials)
    tk.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, **(extra_config or {})}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    if eos is not None:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return folder


def rendered_by_transformers(folder, messages):
    """The reference: transformers renders the jinja chat template itself."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(folder)
    return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("newline", ["real", "jinja-escape"])
def test_chatml_default_system_prompt_from_template(tmp_path, newline):
    """SmolLM2's template adds a fixed system prompt when the user gives none: we must too, or
    every prompt differs from what the model was trained on."""
    template = SMOLLM2_TEMPLATE if newline == "real" else SMOLLM2_TEMPLATE.replace("\n", "\\n")
    folder = make_tokenizer(tmp_path / "smol", CHATML_SPECIALS, template,
                            {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    tok = Tokenizer(folder)
    expected = (f"<|im_start|>system\n{SMOLLM2_SYSTEM}<|im_end|>\n"
                "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.format == "chatml" and tok.default_system == SMOLLM2_SYSTEM
    assert tok.chat("hi") == expected == rendered_by_transformers(folder, [{"role": "user", "content": "hi"}])
    with_system = tok.chat("hi", system="be brief.")
    assert with_system == rendered_by_transformers(
        folder, [{"role": "system", "content": "be brief."}, {"role": "user", "content": "hi"}])
    vocab = tok.tk.get_vocab(with_added_tokens=True)
    assert vocab["<|im_end|>"] in tok.stop_ids and vocab["<|endoftext|>"] in tok.stop_ids
    ids = tok.encode(tok.chat("hi"))
    assert ids[0] == vocab["<|im_start|>"] and ids.count(vocab["<|im_end|>"]) == 2
    assert tok.decode([vocab["<|im_end|>"]]) == "<|im_end|>"


def test_chatml_without_default_system(tmp_path):
    folder = make_tokenizer(tmp_path / "qwen", CHATML_SPECIALS, PLAIN_CHATML_TEMPLATE, eos=[7])
    tok = Tokenizer(folder)
    assert tok.default_system is None
    assert tok.chat("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.chat("hi") == rendered_by_transformers(folder, [{"role": "user", "content": "hi"}])
    assert 7 in tok.stop_ids  # generation_config.json's eos_token_id


def test_llama3_chat_format(tmp_path):
    folder = make_tokenizer(tmp_path / "llama3", LLAMA3_SPECIALS, LLAMA3_TEMPLATE,
                            {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"})
    tok = Tokenizer(folder)
    assert tok.format == "llama3"
    expected = ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert tok.chat("hi") == expected == rendered_by_transformers(folder, [{"role": "user", "content": "hi"}])
    assert tok.chat("hi", system="be brief.") == rendered_by_transformers(
        folder, [{"role": "system", "content": "be brief."}, {"role": "user", "content": "hi"}])
    vocab = tok.tk.get_vocab(with_added_tokens=True)
    assert {vocab[t] for t in ("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")} <= set(tok.stop_ids)
    assert vocab["<|start_header_id|>"] not in tok.stop_ids


def test_unknown_chat_format_is_a_value_error(tmp_path):
    tok = Tokenizer(make_tokenizer(tmp_path / "plain", ["<s>", "</s>"], ""))
    assert tok.format is None
    with pytest.raises(ValueError, match="chat format"):
        tok.chat("hi")


REAL = Path(__file__).resolve().parent.parent / "weights" / "SmolLM2-135M-Instruct"


@pytest.mark.skipif(not (REAL / "tokenizer_config.json").exists() or not (REAL / "tokenizer.json").exists(),
                    reason="weights/prepare.py has not been run")
def test_real_smollm2_tokenizer_default_system():
    tok = Tokenizer(REAL)
    assert tok.default_system == SMOLLM2_SYSTEM
    assert tok.chat("hi").startswith(f"<|im_start|>system\n{SMOLLM2_SYSTEM}<|im_end|>\n<|im_start|>user\nhi")


@pytest.mark.parametrize("damage", ["tokenizer-truncated", "tokenizer-not-a-tokenizer", "config-not-json",
                                    "config-a-list", "template-not-text", "generation-not-json", "eos-not-an-id",
                                    "unk-not-in-vocab"])
def test_broken_tokenizer_files_name_the_file(tmp_path, damage):
    """Every file the Tokenizer reads is checked where it is read: one ValueError naming it and the fix."""
    folder = make_tokenizer(tmp_path / "tok", CHATML_SPECIALS, PLAIN_CHATML_TEMPLATE, eos=[7])
    name, text = {
        "tokenizer-truncated": ("tokenizer.json", (folder / "tokenizer.json").read_text()[:200]),
        "tokenizer-not-a-tokenizer": ("tokenizer.json", '{"model": 5}'),
        "config-not-json": ("tokenizer_config.json", "{chat_template: 1"),
        "config-a-list": ("tokenizer_config.json", "[]"),
        "template-not-text": ("tokenizer_config.json", '{"chat_template": 5}'),
        "generation-not-json": ("generation_config.json", "\x00\x01"),
        "eos-not-an-id": ("generation_config.json", '{"eos_token_id": ["x"]}'),
        # it loads; only encoding a word outside the vocabulary fails (the unk token has no id)
        "unk-not-in-vocab": ("tokenizer.json", (folder / "tokenizer.json").read_text()
                             .replace('"unk_token": "[UNK]"', '"unk_token": "[GONE]"')),
    }[damage]
    assert damage != "unk-not-in-vocab" or "[GONE]" in text  # the damage was made
    (folder / name).write_text(text)
    with pytest.raises(ValueError) as e:
        Tokenizer(folder)
    assert str(folder / name) in str(e.value) and "re-download" in str(e.value), str(e.value)


def test_cli_load_reads_the_tokenizer_before_the_weights(ckpt):
    """Both tokenizer.json and the weights broken: the tokenizer's error comes first, before the
    (possibly long) weight load."""
    from support import cli

    make_tokenizer(ckpt, CHATML_SPECIALS, PLAIN_CHATML_TEMPLATE)
    (ckpt / "tokenizer.json").write_text('{"trunc')
    (ckpt / "model.safetensors").write_bytes(b"junk")
    with pytest.raises(ValueError, match="tokenizer.json is not a tokenizer we can read"):
        cli.load(ckpt)


# -----------------------------------------------------------------------------
# Nothing silent (issue 37): what passes a type check but cannot work, valid input accepted


def test_rotary_inv_freq_buffers_are_accepted(ckpt):
    """Many HF Llama checkpoints carry RoPE's inv_freq buffers; transformers ignores them, and so do we (RoPE is
    recomputed from config.json): the model loads and computes what it computed without them."""
    before = load_model(ckpt)
    rewrite_tensors(ckpt, lambda t: t.update({f"model.layers.{l}.self_attn.rotary_emb.inv_freq": torch.ones(8)
                                              for l in range(2)}))
    after = load_model(ckpt)
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(before(ids, positions=torch.arange(3)[None]), after(ids, positions=torch.arange(3)[None]))


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool])
def test_a_tensor_of_a_non_floating_dtype_is_refused(ckpt, dtype):
    name = "model.layers.0.mlp.down_proj.weight"
    rewrite_tensors(ckpt, lambda t: t.update({name: t[name].to(dtype)}))
    with pytest.raises(ValueError, match=rf"tensor {re.escape(name)} is stored as torch\.{str(dtype)[6:]}, not a floating"):
        load_model(ckpt)


@pytest.mark.parametrize("damage", ["int8", "bool", "unknown-target"])
def test_adapter_that_cannot_be_what_its_json_says_is_refused(tmp_path, damage):
    """LookaheadModule.load: an int or bool tensor would be cast into the float32 parameters as garbage; a target
    the .json names that no projection has is said with the file, not by the constructor without it."""
    from safetensors.torch import load_file, save_file

    from lookaheadkv import LookaheadModule

    cfg = ModelConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, name="tiny")
    path, name = tmp_path / "a.safetensors", "lora.1.q_proj_B"
    LookaheadModule(cfg, n_tokens=4, targets=("q_proj", "v_proj")).save(path)
    LookaheadModule.load(path, cfg)  # as saved: fine
    if damage == "unknown-target":
        meta = json.loads(path.with_suffix(".json").read_text())
        path.with_suffix(".json").write_text(json.dumps(dict(meta, targets=["q_proj", "wq"])))
        file, field = path.with_suffix(".json"), "'targets' holds [\"wq\"]"
    else:
        tensors = load_file(path)
        save_file({**tensors, name: tensors[name].to(getattr(torch, damage))}, path)
        file, field = path, f"tensor {name!r} is stored as torch.{damage}"
    with pytest.raises(ValueError) as e:
        LookaheadModule.load(path, cfg)
    assert str(file) in str(e.value) and field in str(e.value) and "retrain" in str(e.value), str(e.value)


def test_a_tokenizer_bigger_than_the_vocabulary_is_refused(tmp_path, tiny_hf_model):
    """config.json's vocab_size and tokenizer.json come from different models: a high token id would index past
    the embedding inside the prefill. Said at load, naming both files."""
    folder = copy_folder(tiny_hf_model("llama"), tmp_path)
    make_tokenizer(folder, [], "")
    cfg = ModelConfig.from_hf_config(folder)
    Tokenizer(folder, cfg)  # 6 words in a vocabulary of the tiny config's size: fine
    edit_config(folder, lambda d: d.update(vocab_size=4))
    with pytest.raises(ValueError, match=r"tokenizer\.json makes token ids up to 5 but .*config\.json says vocab_size 4"):
        Tokenizer(folder, ModelConfig.from_hf_config(folder))


def test_utf16_with_a_bom_is_read_and_other_bytes_named():
    from support.tokenizer import decode_utf8

    text = "Ärger über 2 + 2?"
    assert decode_utf8(text.encode("utf-16"), "f") == text  # the BOM says which byte order
    assert decode_utf8("\ufeff".encode() + text.encode(), "f") == text
    with pytest.raises(ValueError, match=r"f is not UTF-8 text \(byte 0xc4 at offset 0\)"):
        decode_utf8(text.encode("latin-1"), "f")


@pytest.mark.parametrize("padded", [False, True])
def test_a_hook_that_attends_its_last_rows_gives_what_sdpa_gives(tiny_hf_model, padded):
    """Attention.sdpa_before_last: LookaheadHook computes the M rows' output from the probabilities of its
    scores and SDPA runs for the other rows alone; the same hook with attn_output None (SDPA for every row) gives
    the same logits and the same scores. Two float32 softmaxes of the same logits in another order: REORDER_ATOL."""
    from lookaheadkv import LookaheadHook, untrained_module

    class SdpaForEveryRow(LookaheadHook):
        def attn_output(self, layer, v):
            self.probs = None
            return None

    model = load_model(tiny_hf_model("llama", tie_word_embeddings=False))
    module = untrained_module(model, n_tokens=4, rank=2)
    with torch.no_grad():
        for p in module.parameters():  # a trained-like LoRA, so the M rows' outputs differ from the base model's
            p.normal_(0.0, 0.1)
    B, S, M = 2, 12, module.n_tokens
    x = torch.cat([model.model.embed_tokens(rand_ids(B, S)), module.embeddings[None].expand(B, -1, -1)], dim=1)
    pad_mask = None
    if padded:
        pad_mask = torch.ones(B, S + M, dtype=torch.bool)
        pad_mask[1, :3] = False
    out, calls = {}, {}
    for name, cls in [("hook", LookaheadHook), ("sdpa", SdpaForEveryRow)]:
        hook, calls[name] = cls(module, S), 0
        for layer in model.model.layers:  # count the split path's calls
            real = type(layer.self_attn).sdpa_before_last.__get__(layer.self_attn)

            def counted(*a, real=real, name=name):
                calls[name] += 1
                return real(*a)

            layer.self_attn.sdpa_before_last = counted
        logits = model(inputs_embeds=x, positions=pos(0, S + M, B), pad_mask=pad_mask, hook=hook)
        out[name] = logits, hook.scores
    assert max_diff(out["hook"][0], out["sdpa"][0]) < REORDER_ATOL
    for layer in out["hook"][1]:
        assert max_diff(out["hook"][1][layer], out["sdpa"][1][layer]) < REORDER_ATOL
    assert calls == {"hook": model.config.num_hidden_layers, "sdpa": 0}  # each form ran its own path
