"""LookaheadKVPress (extensions/lookaheadkv_press.py, self-contained) against our LookaheadKV scorer in the paper's
form (make_scorer with max:7 and C in every layer, named explicitly, so no default decides it), and the export
that makes its folder (extensions/export_peft.py).

The two sides share nothing but the adapter's numbers: the press runs HF's modules, its LoRA applied by hooks to the
M rows riding in HF's prefill; ours runs model.py with the rows inside the prefill. So:
- the kept slots must be identical per (layer, KV head) (the scores differ by float rounding only);
- the kept keys and values must be HF's own prefill's (within float rounding: the prefill holds M more rows), and
  nothing else in the cache;
- logits (the first token, then the next ones on the compressed caches) agree within fp32_bound.
Then kvpress's wrappers on the press, end to end, and the user's model as it was after the press (and after an
exception inside it).

Tiny random HF models (conftest.tiny_hf_model) on CPU; SmolLM2 with the shipped adapter's export (weights/)."""
import ast
import json
import math
from pathlib import Path

import pytest
import torch

kvpress = pytest.importorskip("kvpress", reason="pip install '.[kvpress]'")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from conftest import REAL_ADAPTER, REAL_FOLDER  # noqa: E402
from eviction import EvictConfig, Pool, compress, prefill_and_score, uniform_budgets  # noqa: E402
from extensions import lookaheadkv_press  # noqa: E402
from extensions.export_peft import export_peft, main as export_main  # noqa: E402
from extensions.lookaheadkv_press import LookaheadKVPress, config_fingerprint  # noqa: E402
from lookaheadkv import LookaheadModule, untrained_module  # noqa: E402
from methods import load_adapter, make_scorer  # noqa: E402
from model import ModelConfig, load_model  # noqa: E402
from test_kvpress import ratio  # noqa: E402 (kvpress's compression_ratio that keeps exactly C of S)

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

S, C = 200, 48  # the tiny models' prompt and budget
SHIPPED = REAL_FOLDER.parent / "SmolLM2-135M-Instruct.lookahead-peft"  # the shipped adapter's export


def fp32_bound(cfg, scale):
    """How far two float32 computations of one value of size `scale` may drift apart when they order their
    sums differently: ~sqrt(K) 2^-24 |x| per sum of K terms, 6 dependent matmuls a layer, added up."""
    K = max(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim)
    return 6 * cfg.num_hidden_layers * math.sqrt(K) * 2 ** -24 * scale


def random_adapter(model, path, seed=0, targets=LookaheadModule.TARGETS):
    """An adapter for `model` with a LoRA that matters: B drawn (an untrained one has B = 0)."""
    torch.manual_seed(seed)
    module = untrained_module(model, targets=targets)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("_B"):
                p.normal_(0.0, 0.1)
    module.save(path)
    return path


def hf_model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").float().eval()


@pytest.fixture(scope="module")
def tiny(tiny_hf_model, tmp_path_factory):
    """family -> (ours, HF (SDPA), adapter path, its exported folder, prompt ids (1, S)): a random Llama and
    a random Qwen3 (q/k norm, head_dim apart from hidden / heads), 4 query heads on 2 KV heads (GQA)."""
    out = {}
    for family in ("llama", "qwen3"):
        folder = tiny_hf_model(family)
        ours = load_model(folder)
        tmp = tmp_path_factory.mktemp(family)
        adapter = random_adapter(ours, tmp / f"{family}.safetensors")
        exported = export_peft(adapter, tmp / "peft", model_folder=folder)
        ids = torch.randint(0, 128, (1, S), generator=torch.Generator().manual_seed(1))
        out[family] = ours, hf_model(folder), adapter, exported, ids
    return out


def paper_form(module, budget):
    return make_scorer(EvictConfig("lookahead", budget=budget, rule=Pool("max", 7), budgets=uniform_budgets),
                       module=module)


def kept_slots(cache, full):
    """Per layer the slots (B, H_kv, C) a compressed cache kept, in slot order: each kept key is the nearest of the
    full prefill's keys (the same up to float rounding: the press's prefill holds M more rows), and its value is
    that slot's value. Nothing else is in the cache."""
    out = []
    for layer, ref in zip(cache.layers, full.layers):
        dist = (layer.keys[:, :, :, None] - ref.keys[:, :, None]).abs().amax(-1)  # (B, H_kv, C, S)
        near = dist.min(-1)
        assert near.values.max() <= 1e-4 * ref.keys.abs().max(), near.values.max()
        idx = near.indices[..., None].expand(-1, -1, -1, ref.values.shape[-1])
        assert (layer.values - ref.values.gather(2, idx)).abs().max() <= 1e-4 * ref.values.abs().max()
        out.append(near.indices.sort(-1).values)
    return out


def ours_and_press(ours, hf, ids, press, scorer, question):
    """Both sides on the prompt ids (1, S), then `question` (1, Q) and one greedy token on each compressed
    cache. Checks what must hold (kept slots exactly; the kept K/V are HF's own; nothing else in the cache)
    and returns both sides' logits: [first token, after the question, after the next token]."""
    full = transformers.DynamicCache()
    hf(ids, past_key_values=full)  # HF's own K/V of the prompt, for reference
    cache = transformers.DynamicCache()
    with press(hf):
        theirs = [hf(ids, past_key_values=cache).logits[:, -1]]
    our_cache, logits, _, kept = compress(ours, ids, scorer)
    mine = [logits]

    assert all(torch.equal(a, b) for a, b in zip(kept_slots(cache, full), kept))

    Q, n = question.shape[1], ids.shape[1]
    at = torch.arange(n, n + Q + 1)[None]
    theirs.append(hf(question, past_key_values=cache, position_ids=at[:, :Q]).logits[:, -1])
    mine.append(ours(question, positions=at[:, :Q], cache=our_cache)[:, -1])
    token = mine[-1].argmax(-1, keepdim=True)
    theirs.append(hf(token, past_key_values=cache, position_ids=at[:, Q:]).logits[:, -1])
    mine.append(ours(token, positions=at[:, Q:], cache=our_cache)[:, -1])
    return mine, theirs


def assert_logits_close(mine, theirs, cfg):
    for a, b in zip(mine, theirs):
        assert (a - b).abs().max() <= fp32_bound(cfg, a.abs().max()), (a - b).abs().max()


def test_the_press_file_imports_nothing_from_this_repository():
    """It can be copied into kvpress as it is: torch, transformers, kvpress, safetensors, peft and the
    standard library only."""
    tree = ast.parse(Path(lookaheadkv_press.__file__).read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    import sys
    assert names - set(sys.stdlib_module_names) <= {"torch", "transformers", "kvpress", "safetensors", "peft"}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("by", ["budget", "compression_ratio"])
@torch.no_grad()
def test_keeps_our_scorers_slots(tiny, family, by):
    """budget=C and kvpress's compression_ratio keeping C of S alike: our scorer's slots, HF's K/V, our logits."""
    ours, hf, adapter, folder, ids = tiny[family]
    press = LookaheadKVPress.from_pretrained(folder, **({"budget": C} if by == "budget" else
                                                        {"compression_ratio": ratio(S, C)}))
    question = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    mine, theirs = ours_and_press(ours, hf, ids, press, paper_form(load_adapter(adapter, ours.config), C),
                                  question)
    assert press.compression_ratio == pytest.approx(1 - C / S)  # a budget cut reads as its ratio too
    assert_logits_close(mine, theirs, ours.config)


@torch.no_grad()
def test_every_lora_target_is_applied(tiny):
    """The parity above covers each of the seven LoRA targets: without any one of them our scores move by far
    more than the press's and ours differ (so a press that skipped one could not match). The press's unpooled
    scores (kernel_size=1) on the full prefill's keys, from the rows its forward set aside."""
    ours, hf, adapter, folder, ids = tiny["llama"]
    press, full = LookaheadKVPress.from_pretrained(folder, budget=C, kernel_size=1), transformers.DynamicCache()
    hf(ids, past_key_values=full)
    with press(hf):
        hf(ids, past_key_values=transformers.DynamicCache())
    theirs = torch.stack([press.score(layer.self_attn, None, full.layers[l].keys, None, None, {})
                          for l, layer in enumerate(hf.model.layers)])

    def scores(m):
        return prefill_and_score(ours, ids, paper_form(m, C)).scores

    full_scores = scores(LookaheadModule.load(adapter, ours.config))
    parity = (full_scores - theirs).abs().max()
    for target in LookaheadModule.TARGETS:
        without = LookaheadModule.load(adapter, ours.config)
        for p in without.lora:
            p[target + "_B"].data.zero_()
        assert (scores(without) - full_scores).abs().max() > 100 * parity, target


@torch.no_grad()
def test_an_adapter_without_a_query_lora_beside_another_on_the_same_model(tiny, tmp_path):
    """The scores need the M rows' queries whether or not the LoRA is on q_proj (here k and v only). The model
    already holds the first adapter's LoRA: this one's is loaded beside it, and only this one runs."""
    ours, hf, _, _, ids = tiny["qwen3"]
    adapter = random_adapter(ours, tmp_path / "kv.safetensors", seed=3, targets=("k_proj", "v_proj"))
    folder = export_peft(adapter, tmp_path / "kv-peft", model_folder=Path(hf.config.name_or_path))
    press = LookaheadKVPress.from_pretrained(folder, budget=C)
    question = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    mine, theirs = ours_and_press(ours, hf, ids, press, paper_form(load_adapter(adapter, ours.config), C),
                                  question)
    assert_logits_close(mine, theirs, ours.config)


@torch.no_grad()
def test_nothing_to_evict_leaves_the_cache(tiny):
    """budget = S, or compression_ratio 0: the cache keeps its S slots (the rows' K/V gone all the same)."""
    _, hf, _, folder, ids = tiny["llama"]
    for press in (LookaheadKVPress.from_pretrained(folder, budget=S), LookaheadKVPress.from_pretrained(folder)):
        cache = transformers.DynamicCache()
        with press(hf):
            hf(ids, past_key_values=cache)
        assert [x.keys.shape[2] for x in cache.layers] == [S, S] and press.compression_ratio == 0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fingerprint_is_our_model_configs(tiny_hf_model, family):
    """The press's own fingerprint of an HF config is model.py's, which our adapters record."""
    folder = tiny_hf_model(family)
    assert config_fingerprint(transformers.AutoConfig.from_pretrained(folder)) == \
        ModelConfig.from_hf_config(folder).fingerprint()


# --- the export: PEFT reads our LoRA as ours ------------------------------------------------------------------


@torch.no_grad()
def test_peft_loads_the_export_with_our_lora_deltas(tiny, tiny_hf_model):
    """PEFT itself (PeftModel.from_pretrained) on a fresh HF model: every LoRA target of every layer, its delta
    on random rows equals our module's, and its config says our rank, alpha and targets."""
    ours, _, adapter, folder, _ = tiny["qwen3"]
    module = LookaheadModule.load(adapter, ours.config)
    wrapped = peft.PeftModel.from_pretrained(hf_model(tiny_hf_model("qwen3")), str(folder))
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == \
        (module.rank, module.alpha, sorted(module.targets))
    layers, dims, n = wrapped.base_model.model.model.layers, module.dims(ours.config), 0
    for l, layer in enumerate(layers):
        for t in module.targets:
            proj = getattr(layer.self_attn if t in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp, t)
            x = torch.randn(2, 5, dims[t][0])
            theirs = proj.lora_B["default"](proj.lora_A["default"](x)) * proj.scaling["default"]
            mine = module.delta(l, t, x)
            assert mine.abs().max() > 0 and (theirs - mine).abs().max() <= 1e-6 * mine.abs().max(), (l, t)
            forward = proj(x) - proj.base_layer(x)  # the wrapped projection's own forward adds the same
            assert (forward - mine).abs().max() <= 1e-5 * proj.base_layer(x).abs().max(), (l, t)
            n += 1
    assert n == len(layers) * 7


def test_export_refuses_folders_it_did_not_make(tiny, tmp_path, tiny_hf_model):
    ours, _, adapter, _, _ = tiny["llama"]
    model_folder = tiny_hf_model("llama")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="did not make .notes.txt"):
        export_peft(adapter, theirs, model_folder)
    assert (theirs / "notes.txt").read_text() == "mine" and len(list(theirs.iterdir())) == 1
    for bad in ("", "/", "."):
        with pytest.raises(ValueError, match="pass a folder of its own"):
            export_peft(adapter, bad, model_folder)
    made = export_peft(adapter, tmp_path / "made", model_folder)
    export_peft(adapter, made, model_folder)  # its own folder: written again
    (made / "adapter_config.json").write_text("{}")
    (made / "lookahead_config.json").write_text("{}")  # no longer marked as made by the export
    with pytest.raises(ValueError, match="did not make"):
        export_peft(adapter, made, model_folder)


def test_export_writes_through_no_link_and_keeps_another_adapters_export(tiny, tmp_path, tiny_hf_model, monkeypatch):
    """A planted link where a file goes is refused in one line (nothing written through it); an export of another
    adapter is never replaced; a write that fails leaves no file, not even an empty one."""
    ours, _, adapter, _, _ = tiny["llama"]
    model_folder = tiny_hf_model("llama")
    linked, target = tmp_path / "linked", tmp_path / "elsewhere.json"
    linked.mkdir()
    target.write_text("mine")
    (linked / "adapter_config.json").symlink_to(target)
    with pytest.raises(ValueError, match="adapter_config.json is a symbolic link") as e:
        export_peft(adapter, linked, model_folder)
    assert target.read_text() == "mine" and "\n" not in str(e.value)
    made = export_peft(adapter, tmp_path / "made", model_folder)
    before = {f.name: f.read_bytes() for f in made.iterdir()}
    other = random_adapter(ours, tmp_path / "other.safetensors", seed=5)
    with pytest.raises(ValueError, match=r"holds the export of another adapter \(llama.safetensors\)"):
        export_peft(other, made, model_folder)
    assert {f.name: f.read_bytes() for f in made.iterdir()} == before

    def broken(*a, **k):
        raise RuntimeError("disk gone")

    monkeypatch.setattr("safetensors.torch.save_file", broken)
    with pytest.raises(RuntimeError, match="disk gone"):
        export_peft(adapter, tmp_path / "fails", model_folder)
    assert not [f for f in (tmp_path / "fails").rglob("*") if f.is_file()]


def test_export_command_is_one_error_line(tmp_path):
    with pytest.raises(SystemExit) as e:
        export_main([str(tmp_path / "nowhere.safetensors"), str(tmp_path / "out")])
    assert str(e.value).startswith("error: adapter") and "\n" not in str(e.value)


# --- bad input: one clear exception, before any forward --------------------------------------------------------


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(compression_ratio=1.0), ValueError, r"compression_ratio=1.0 must be in \[0, 1\)"),
    (dict(compression_ratio=-0.1), ValueError, "compression_ratio=-0.1"),
    (dict(compression_ratio=float("nan")), ValueError, "compression_ratio=nan"),
    (dict(compression_ratio="0.5"), TypeError, "compression_ratio='0.5' is a str"),
    (dict(compression_ratio=True), TypeError, "compression_ratio=True is a bool"),
    (dict(budget=True), TypeError, "budget=True is a bool"), (dict(budget=2.5), TypeError, "budget=2.5"),
    (dict(budget=0), ValueError, "budget=0"), (dict(budget=64, compression_ratio=0.5), ValueError, "without"),
    (dict(kernel_size=6), ValueError, "kernel_size=6 must be odd"),
    (dict(kernel_size=False), TypeError, "kernel_size=False is a bool"),
])
def test_refuses_bad_settings(tiny, kwargs, error, match):
    with pytest.raises(error, match=match):
        LookaheadKVPress.from_pretrained(tiny["llama"][3], **kwargs)


def test_refuses_a_folder_without_its_files(tmp_path, tiny):
    """A folder without its files at construction; LookaheadKVPress() constructs, and finds no folder beside a
    model that has none (before any forward)."""
    with pytest.raises(FileNotFoundError, match="adapter_config.json is missing"):
        LookaheadKVPress.from_pretrained(tmp_path, budget=C)
    press = LookaheadKVPress(budget=C)
    refused_before_any_forward(press, tiny["llama"][1], r"\.lookahead-peft/adapter_config.json is missing",
                               error=FileNotFoundError)


@pytest.mark.parametrize("name,content,match", [
    ("adapter_config.json", b"{not json", "adapter_config.json cannot be read"),
    ("adapter_config.json", bytes(range(256)), "adapter_config.json cannot be read"),
    ("adapter_config.json", b"[1, 2]", "holds list, not a JSON object"),
    ("lookahead_config.json", b"\x00\xff", "lookahead_config.json cannot be read"),
    ("adapter_model.safetensors", "half", "adapter_model.safetensors cannot be read"),
    ("lookahead_embeddings.safetensors", "half", "lookahead_embeddings.safetensors cannot be read"),
    ("adapter_config.json", {"r": 10**9}, r"r=1000000000 must be a number in \(0, 4096\]"),
    ("adapter_config.json", {"r": "8"}, "r='8'"),
    ("adapter_config.json", {"lora_alpha": float("inf")}, "lora_alpha=inf"),
    ("adapter_config.json", {"target_modules": ["lm_head"]}, "target_modules=.'lm_head'."),
    ("lookahead_config.json", {"n_tokens": 0}, "n_tokens=0"),
])
def test_refuses_a_broken_folder_in_one_line(tiny, tmp_path, name, content, match):
    """Each file parsed under its own error, one line naming it: corrupt JSON, binary bytes, a safetensors cut in
    half, sizes out of range (checked before any tensor is read)."""
    import shutil

    folder = tmp_path / "broken"
    shutil.copytree(tiny["llama"][3], folder)
    path = folder / name
    if content == "half":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif isinstance(content, dict):
        path.write_text(json.dumps({**json.loads(path.read_text()), **content}))
    else:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=match) as e:
        LookaheadKVPress.from_pretrained(folder, budget=C)
    assert "\n" not in str(e.value) and str(path.parent) in str(e.value)


def refused_before_any_forward(press, hf, match, error=ValueError, **call):
    """press(hf) raises `error` matching `match`, no layer ran, and no hook of the press is left on the model."""
    ran, before = [], hooks_on(hf)
    hook = hf.model.layers[0].register_forward_pre_hook(lambda *a: ran.append(1))
    try:
        with pytest.raises(error, match=match):
            with press(hf):
                hf(**{"input_ids": torch.zeros(1, 4, dtype=torch.long), **call})
    finally:
        hook.remove()
    assert not ran and hooks_on(hf) == before


def hooks_on(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_refuses_an_adapter_made_for_another_model(tiny):
    press = LookaheadKVPress.from_pretrained(tiny["llama"][3], budget=C)
    refused_before_any_forward(press, tiny["qwen3"][1], "was trained for llama-")


def test_refuses_a_family_it_cannot_score(tiny):
    phi3 = transformers.Phi3ForCausalLM(transformers.Phi3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0)).eval()  # kvpress supports Phi-3: its qkv_proj is fused
    refused_before_any_forward(LookaheadKVPress.from_pretrained(tiny["llama"][3], budget=C), phi3, "'phi3'")


def test_refuses_a_gpt2_model_in_one_line(tiny):
    """The family is checked before anything reads the config's shape (no KeyError 'num_attention_heads')."""
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="model_type 'gpt2' .GPT2LMHeadModel. is not supported"):
        LookaheadKVPress.from_pretrained(tiny["llama"][3], budget=C).post_init_from_model(gpt2)


LEFT_PADDED = torch.ones(2, 60, dtype=torch.long)
LEFT_PADDED[1, :10] = 0  # the second row is 50 tokens, padded on the left


@pytest.mark.parametrize("call,match", [
    (dict(input_ids=torch.ones(2, 60, dtype=torch.long), attention_mask=LEFT_PADDED), "padded"),
    (dict(input_ids=torch.ones(1, 20, dtype=torch.long)), r"budget=48 is larger than the prompt \(20 tokens\)"),
    (dict(input_ids=torch.ones(1, 60, dtype=torch.long), use_cache=False), "use_cache=True"),
    ("static", "not StaticCache"),
])
def test_refuses_inputs_it_cannot_score(tiny, call, match):
    """A left-padded batch, a budget past the prompt, no cache, a preallocated cache: before any layer runs."""
    _, hf, _, folder, _ = tiny["llama"]
    if call == "static":
        call = dict(input_ids=torch.ones(1, 60, dtype=torch.long),
                    past_key_values=transformers.StaticCache(config=hf.config, max_cache_len=128))
    refused_before_any_forward(LookaheadKVPress.from_pretrained(folder, budget=C), hf, match, **call)


@torch.no_grad()
def test_a_second_forward_inside_is_the_plain_models(tiny):
    """The rows ride in the first forward only: a decode step inside the press is the model's own."""
    import copy

    _, hf, _, folder, ids = tiny["llama"]
    cache, step = transformers.DynamicCache(), dict(input_ids=ids[:, :1], position_ids=torch.tensor([[S]]))
    with LookaheadKVPress.from_pretrained(folder, budget=C)(hf):
        hf(ids, past_key_values=cache)
        same = copy.deepcopy(cache)
        inside = hf(**step, past_key_values=cache).logits
    assert cache.get_seq_length() == C + 1
    assert torch.equal(inside, hf(**step, past_key_values=same).logits)


# --- kvpress's wrappers on the press, and the user's model after it ---------------------------------------------


def run(press, hf, ids, steps=0):
    """The prompt under the press (then `steps` greedy tokens inside it); the cache's slots per layer."""
    cache, position = transformers.DynamicCache(), ids.shape[1]
    with torch.no_grad(), press(hf):
        logits = hf(ids, past_key_values=cache).logits[:, -1]
        for _ in range(steps):
            token = logits.argmax(-1, keepdim=True)
            logits = hf(token, past_key_values=cache, position_ids=torch.tensor([[position]])).logits[:, -1]
            position += 1
    return [layer.keys.shape[2] for layer in cache.layers]


@pytest.mark.parametrize("wrap,slots", [
    (lambda p: kvpress.AdaKVPress(p), [S, S]),  # AdaKV masks per head: the tensors keep S slots
    (lambda p: kvpress.KeyRerotationPress(p), [C, C]),
    (lambda p: kvpress.ChunkPress(p, chunk_length=64), [46, 46]),  # 3 chunks of 64 and one of 8, each cut
    (lambda p: kvpress.CriticalKVPress(p), [C, C]),
    (lambda p: kvpress.ComposedPress([p, kvpress.KnormPress(compression_ratio=0.5)]), [C // 2] * 2),
    (lambda p: kvpress.ComposedPress([kvpress.KnormPress(compression_ratio=0.5), p]), [C // 2] * 2),
    (lambda p: kvpress.DMSPress(p, threshold=0.0, sliding_window_size=32), [S, S]),  # masks below the threshold
    (lambda p: kvpress.PerLayerCompressionPress(p, [ratio(S, C), 0.5]), [C, S // 2]),
    (lambda p: kvpress.CriticalAdaKVPress(p), [S, S]),
])
def test_kvpress_wrappers_run_on_the_press(tiny, wrap, slots):
    """Each wrapper calls the press's score per layer as it does any scorer's, the rows set aside before it: the
    slots it keeps, and no hook left on the model after. PerLayerCompressionPress and CriticalAdaKVPress do not
    pass post_init_from_model on: called once on the press first, as kvpress's own test does."""
    _, hf, _, folder, ids = tiny["llama"]
    press, before = LookaheadKVPress.from_pretrained(folder, compression_ratio=ratio(S, C)), hooks_on(hf)
    wrapper = wrap(press)
    if isinstance(wrapper, (kvpress.PerLayerCompressionPress, kvpress.CriticalAdaKVPress)):
        press.post_init_from_model(hf)
    assert run(wrapper, hf, ids) == slots and hooks_on(hf) == before and 0 in press.rows


def test_a_wrapper_that_skips_post_init_is_refused_in_one_line(tiny):
    _, hf, _, folder, ids = tiny["llama"]
    press = kvpress.CriticalAdaKVPress(LookaheadKVPress.from_pretrained(folder, compression_ratio=0.5))
    with pytest.raises(ValueError, match="call press.post_init_from_model.model. first"):
        run(press, hf, ids)


def test_decoding_press_scores_with_the_first_forwards_rows(tiny):
    """DecodingPress: the rows ride in the first forward inside it; every compression while decoding scores with
    their queries (the cache cut to target_size every compression_interval steps). PrefillDecodingPress: the press
    cuts the prompt, SnapKV the decoding."""
    _, hf, _, folder, ids = tiny["llama"]
    press = LookaheadKVPress.from_pretrained(folder)
    assert run(kvpress.DecodingPress(press, compression_interval=4, target_size=C), hf, ids, steps=8) == [C] * 2
    both = kvpress.PrefillDecodingPress(LookaheadKVPress.from_pretrained(folder, budget=C), kvpress.DecodingPress(
        kvpress.SnapKVPress(window_size=2), compression_interval=4, target_size=C // 2))
    assert run(both, hf, ids, steps=8) == [C // 2] * 2


@pytest.fixture
def user_model(tiny, tmp_path):
    """The tiny Llama with a LoRA adapter of the user's own, loaded by transformers' PEFT integration."""
    _, tiny_hf, _, folder, ids = tiny["llama"]
    hf = hf_model(tiny_hf.config.name_or_path)
    lora = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft.get_peft_model(hf_model(hf.config.name_or_path), lora).save_pretrained(tmp_path / "user")
    hf.load_adapter(str(tmp_path / "user"), adapter_name="users")
    return hf, folder, ids


def state_of(model, ids):
    """What a user can see of a model: its modules (each object), parameters, adapters and hooks, and logits."""
    with torch.no_grad():
        logits = model(ids).logits
    return ({id(m): type(m) for m in model.modules()}, {k: v.clone() for k, v in model.state_dict().items()},
            dict(model.peft_config), model.active_adapters(), hooks_on(model), logits)


def assert_same_state(a, b):
    assert a[0] == b[0] and a[2:5] == b[2:5] and torch.equal(a[5], b[5])
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def test_the_users_model_is_as_it_was(user_model):
    """After the press, under a wrapper, and after an exception inside it (in the forward and after it): the
    same modules, parameters, adapters (the user's still on) and hooks, and the same logits."""
    hf, folder, ids = user_model
    before = state_of(hf, ids)
    assert before[3] == ["users"]
    run(LookaheadKVPress.from_pretrained(folder, budget=C), hf, ids)
    assert_same_state(before, state_of(hf, ids))
    run(kvpress.AdaKVPress(LookaheadKVPress(compression_ratio=0.5, adapter=folder)), hf, ids)
    assert_same_state(before, state_of(hf, ids))
    press, mask = LookaheadKVPress.from_pretrained(folder, budget=C), torch.ones(1, S, dtype=torch.long)
    mask[0, 0] = 0
    with pytest.raises(ValueError, match="padded"), torch.no_grad(), press(hf):
        hf(ids, attention_mask=mask)  # refused before any layer runs
    assert_same_state(before, state_of(hf, ids))

    def fail(*args):
        raise RuntimeError("in the middle")

    hook = hf.model.layers[1].register_forward_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="in the middle"), torch.no_grad(), press(hf):
            hf(ids, past_key_values=transformers.DynamicCache())
    finally:
        hook.remove()
    assert_same_state(before, state_of(hf, ids))
    with pytest.raises(RuntimeError, match="after it"), torch.no_grad(), press(hf):
        hf(ids, past_key_values=transformers.DynamicCache())
        raise RuntimeError("after it")
    assert_same_state(before, state_of(hf, ids))


# --- SmolLM2-135M-Instruct with the shipped adapter's export ---------------------------------------------------

needs_real = pytest.mark.skipif(not (REAL_FOLDER / "model.safetensors").exists(),
                                reason="run python weights/prepare.py")


@pytest.fixture(scope="module")
def real():
    """(ours, HF (SDPA), HF tokenizer, needle.txt's text)."""
    text = (REAL_FOLDER.parents[1] / "examples" / "needle.txt").read_text()
    return (load_model(REAL_FOLDER), hf_model(REAL_FOLDER), transformers.AutoTokenizer.from_pretrained(REAL_FOLDER),
            text)


@needs_real
def test_the_shipped_export_is_the_shipped_adapters(real, tmp_path):
    """weights/'s folder is what the export writes from the shipped adapter today (nothing stale)."""
    made = export_peft(REAL_ADAPTER, tmp_path / "peft", REAL_FOLDER)
    for name in ("adapter_model.safetensors", "lookahead_embeddings.safetensors"):
        assert (made / name).read_bytes() == (SHIPPED / name).read_bytes(), name
    assert json.loads((made / "lookahead_config.json").read_text()) == \
        json.loads((SHIPPED / "lookahead_config.json").read_text())
    assert config_fingerprint(real[1].config) == load_adapter(REAL_ADAPTER, real[0].config).cfg.fingerprint()


@needs_real
@torch.no_grad()
def test_smollm2_keeps_our_scorers_slots(real):
    """C = 128 on a 600-token prompt (the end of examples/needle.txt), the shipped adapter in the paper's form."""
    ours, hf, tok, text = real
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)[-600:]])
    press = LookaheadKVPress.from_pretrained(SHIPPED, budget=128)
    question = torch.tensor([tok.encode("\nThe number is", add_special_tokens=False)])
    mine, theirs = ours_and_press(ours, hf, ids, press, paper_form(load_adapter(REAL_ADAPTER, ours.config), 128),
                                  question)
    assert_logits_close(mine, theirs, ours.config)


@needs_real
@torch.no_grad()
def test_smollm2_answers_the_needle_in_kvpress_pipeline(real):
    """pipeline("kv-press-text-generation") with the README's needle prompt (its question inside the compressed
    text, as generate.py runs it), C = 128: the answer names the number; the cache holds our scorer's slots."""
    ours, hf, tok, text = real
    pipe = transformers.pipeline("kv-press-text-generation", model=hf, tokenizer=tok, device="cpu")
    press = LookaheadKVPress.from_pretrained(SHIPPED, budget=128)
    cache, full = transformers.DynamicCache(), transformers.DynamicCache()
    answer = pipe(text, press=press, cache=cache, max_new_tokens=20)["answer"]
    assert "7381924" in answer, answer
    assert [x.keys.shape[2] for x in cache.layers] == [128] * 30
    ids = pipe.preprocess(text, [""], "", 10**6)["context_ids"]
    hf.model(ids, past_key_values=full)
    _, _, _, kept = compress(ours, ids, paper_form(load_adapter(REAL_ADAPTER, ours.config), 128))
    assert all(torch.equal(a, b) for a, b in zip(kept_slots(cache, full), kept))


@needs_real
@torch.no_grad()
def test_smollm2_under_adakv_in_kvpress_pipeline(real):
    """kvpress's leaderboard form: AdaKVPress on the press in the pipeline, the needle prompt's question inside,
    C = 128 per (layer, KV head) on average (spread over heads): the answer names the number."""
    _, hf, tok, text = real
    pipe = transformers.pipeline("kv-press-text-generation", model=hf, tokenizer=tok, device="cpu")
    S = pipe.preprocess(text, [""], "", 10**6)["context_ids"].shape[1]
    press = kvpress.AdaKVPress(LookaheadKVPress.from_pretrained(SHIPPED, compression_ratio=ratio(S, 128)))
    assert "7381924" in pipe(text, press=press, max_new_tokens=20)["answer"]


def test_a_fractional_budget_is_told_to_be_a_whole_number():
    """budget=12.5 is a float where a count of slots is asked: the line says a whole number, not "a number"."""
    from extensions.lookaheadkv_press import LookaheadKVPress

    with pytest.raises(TypeError, match=r"budget=12\.5 is a float: pass a whole number"):
        LookaheadKVPress(budget=12.5)
    with pytest.raises(TypeError, match=r"compression_ratio='0.5' is a str: pass a number$"):
        LookaheadKVPress(compression_ratio="0.5")
