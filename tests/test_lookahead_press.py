"""LookaheadKVPress (extensions/lookaheadkv_press.py, self-contained) against our LookaheadKV scorer in the paper's
form (make_scorer with max:7 and C in every layer, named explicitly, so no default decides it), and the export
that makes its folder (extensions/export_peft.py).

The two sides share nothing but the adapter's numbers: the press runs HF's modules, the LoRA loaded by PEFT, the
M rows as a second forward on HF's cache; ours runs model.py with the rows inside the prefill. So:
- the kept slots must be identical per (layer, KV head) (the scores differ by float rounding only);
- the kept keys and values must be HF's own prefill's, bit for bit, and nothing else in the cache;
- logits (the first token, then the next ones on the compressed caches) agree within fp32_bound.

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


def ours_and_press(ours, hf, ids, press, scorer, question):
    """Both sides on the prompt ids (1, S), then `question` (1, Q) and one greedy token on each compressed
    cache. Checks what must hold exactly (kept slots; the kept K/V are HF's own; nothing else in the cache)
    and returns both sides' logits: [first token, after the question, after the next token]."""
    full = transformers.DynamicCache()
    hf(ids, past_key_values=full)  # HF's own K/V of the prompt, for reference
    cache = transformers.DynamicCache()
    with press(hf):
        theirs = [hf(ids, past_key_values=cache).logits[:, -1]]
    our_cache, logits, _, kept = compress(ours, ids, scorer)
    mine = [logits]

    assert all(torch.equal(a, b) for a, b in zip(press.kept, kept))
    for l, idx in enumerate(kept):
        layer, D = cache.layers[l], cache.layers[l].keys.shape[-1]
        for got, want in ((layer.keys, full.layers[l].keys), (layer.values, full.layers[l].values)):
            assert torch.equal(got, want.gather(2, idx[..., None].expand(-1, -1, -1, D)))

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
    assert press.kept.shape == (ours.config.num_hidden_layers, 1, 2, C)
    assert_logits_close(mine, theirs, ours.config)


@torch.no_grad()
def test_every_lora_target_is_applied(tiny):
    """The parity above covers each of the seven LoRA targets: without any one of them our scores move by far
    more than the press's and ours differ (so a press that skipped one could not match)."""
    ours, hf, adapter, folder, ids = tiny["llama"]
    press = LookaheadKVPress.from_pretrained(folder, budget=C)
    with press(hf):
        hf(ids, past_key_values=transformers.DynamicCache())

    def scores(m):
        return prefill_and_score(ours, ids, paper_form(m, C)).scores

    full = scores(LookaheadModule.load(adapter, ours.config))
    parity = (full - press.scores).abs().max()
    for target in LookaheadModule.TARGETS:
        without = LookaheadModule.load(adapter, ours.config)
        for p in without.lora:
            p[target + "_B"].data.zero_()
        assert (scores(without) - full).abs().max() > 100 * parity, target


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
    """budget = S, or compression_ratio 0: the cache keeps its S slots, and no lookahead pass runs."""
    _, hf, _, folder, ids = tiny["llama"]
    for press in (LookaheadKVPress.from_pretrained(folder, budget=S), LookaheadKVPress.from_pretrained(folder)):
        cache = transformers.DynamicCache()
        with press(hf):
            hf(ids, past_key_values=cache)
        assert [x.keys.shape[2] for x in cache.layers] == [S, S] and press.kept is None


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


def test_refuses_a_folder_without_its_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="lacks adapter_config.json"):
        LookaheadKVPress.from_pretrained(tmp_path, budget=C)
    with pytest.raises(FileNotFoundError, match="from_pretrained"):
        LookaheadKVPress(budget=C)


def refused_before_any_forward(press, hf, match, **call):
    """press(hf) raises ValueError matching `match`, and no layer ran."""
    ran = []
    hook = hf.model.layers[0].register_forward_pre_hook(lambda *a: ran.append(1))
    try:
        with pytest.raises(ValueError, match=match):
            with press(hf):
                hf(**{"input_ids": torch.zeros(1, 4, dtype=torch.long), **call})
    finally:
        hook.remove()
    assert not ran


def test_refuses_an_adapter_made_for_another_model(tiny):
    press = LookaheadKVPress.from_pretrained(tiny["llama"][3], budget=C)
    refused_before_any_forward(press, tiny["qwen3"][1], "was trained for llama-")


def test_refuses_a_family_it_cannot_score(tiny):
    phi3 = transformers.Phi3ForCausalLM(transformers.Phi3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0)).eval()  # kvpress supports Phi-3: its qkv_proj is fused
    refused_before_any_forward(LookaheadKVPress.from_pretrained(tiny["llama"][3], budget=C), phi3, "'phi3'")


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
def test_refuses_a_second_forward_inside(tiny):
    _, hf, _, folder, ids = tiny["llama"]
    cache = transformers.DynamicCache()
    with pytest.raises(ValueError, match="one forward inside"):
        with LookaheadKVPress.from_pretrained(folder, budget=C)(hf):
            hf(ids, past_key_values=cache)
            hf(ids[:, :1], past_key_values=cache)
    assert cache.get_seq_length() == S  # the refused token never ran


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
    assert press.kept.shape == (30, 1, 3, 128)
    assert_logits_close(mine, theirs, ours.config)


@needs_real
@torch.no_grad()
def test_smollm2_answers_the_needle_in_kvpress_pipeline(real):
    """pipeline("kv-press-text-generation") with the README's needle prompt (its question inside the compressed
    text, as generate.py runs it), C = 128: the answer names the number; the cache holds our scorer's slots."""
    ours, hf, tok, text = real
    pipe = transformers.pipeline("kv-press-text-generation", model=hf, tokenizer=tok, device="cpu")
    press = LookaheadKVPress.from_pretrained(SHIPPED, budget=128)
    cache = transformers.DynamicCache()
    answer = pipe(text, press=press, cache=cache, max_new_tokens=20)["answer"]
    assert "7381924" in answer, answer
    assert [x.keys.shape[2] for x in cache.layers] == [128] * 30
    ids = pipe.preprocess(text, [""], "", 10**6)["context_ids"]
    _, _, _, kept = compress(ours, ids, paper_form(load_adapter(REAL_ADAPTER, ours.config), 128))
    assert all(torch.equal(a, b) for a, b in zip(press.kept, kept))
