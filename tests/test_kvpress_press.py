"""LookaheadKVPress (extensions/kvpress_press.py): our adapters as a kvpress 0.5.5 press on Hugging Face models,
against our own LookaheadKV scorer in the paper's form (make_scorer with rule max:7 and C in every layer, both
named explicitly, so no default decides it).

The two sides share the adapter and the selection code (Scorer.evict), not the model: the press runs HF's
modules with the LoRA hooked onto its projections and the M rows as a second forward on HF's cache; ours runs
model.py with the rows inside the prefill. So:
- the kept slots must be identical per (layer, KV head). The scores differ by float rounding only (measured:
  6e-9 on the tiny Llama, 1.8e-7 on SmolLM2, where the smallest non-zero gap at the C-th score is 4e-6; the
  other boundaries are exact max-pool ties, which hold the same value at the same slots on both sides);
- the kept keys and values must be HF's own prefill's, bit for bit (the press only gathers), and no more
  slots than kept (no lookahead K/V);
- logits (the prefill's first token, then the next ones on the compressed caches) agree within fp32_bound.

Tiny random HF models (conftest.tiny_hf_model) on CPU, one thread; SmolLM2 with the shipped adapter when
weights/ holds it (python weights/prepare.py): ~15 s."""
import math
import shutil

import pytest
import torch

kvpress = pytest.importorskip("kvpress", reason="pip install '.[kvpress]'")
transformers = pytest.importorskip("transformers")

from conftest import REAL_ADAPTER, REAL_FOLDER  # noqa: E402
from eviction import EvictConfig, Pool, compress, prefill_and_score, uniform_budgets  # noqa: E402
from extensions.kvpress_press import LookaheadKVPress  # noqa: E402
from lookaheadkv import LookaheadModule, untrained_module  # noqa: E402
from methods import load_adapter, make_scorer  # noqa: E402
from model import load_model  # noqa: E402
from support.selection import layer_budgets, parse_rule  # noqa: E402
from test_kvpress import ratio  # noqa: E402 (kvpress's compression_ratio that keeps exactly C of S)

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

S, C = 200, 48  # the tiny models' prompt and budget


def fp32_bound(cfg, scale):
    """How far two float32 computations of one value of size `scale` may drift apart when they order their sums
    differently: a sum of K terms errs by ~sqrt(K) 2^-24 |x| (conftest.REORDER_ATOL's argument), K the widest
    dot product, through the model's chain of dependent matmuls (6 a layer: q/k/v, q k^T, p v, o, gate/up,
    down), added in the worst case. Tiny (2 layers, K = 128): 8e-6 x scale; SmolLM2 (30, 1536): 4e-4 x scale."""
    K = max(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim)
    return 6 * cfg.num_hidden_layers * math.sqrt(K) * 2 ** -24 * scale


def random_adapter(model, path, seed=0, targets=LookaheadModule.TARGETS, **info):
    """An adapter for `model` with a LoRA that matters: all seven targets, B drawn (an untrained one has B = 0)."""
    torch.manual_seed(seed)
    module = untrained_module(model, targets=targets)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("_B"):
                p.normal_(0.0, 0.1)
    module.info.update(info)
    module.save(path)
    return path


@pytest.fixture(scope="module")
def tiny(tiny_hf_model, tmp_path_factory):
    """family -> (ours, HF (SDPA), adapter path, prompt ids (1, S)): a random Llama and a random Qwen3 (q/k norm,
    head_dim 128 apart from hidden / heads), 4 query heads on 2 KV heads (GQA)."""
    out = {}
    for family in ("llama", "qwen3"):
        folder = tiny_hf_model(family)
        ours = load_model(folder)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").float().eval()
        adapter = random_adapter(ours, tmp_path_factory.mktemp("adapter") / f"{family}.safetensors",
                                 layer_weights=[0.5, 1.5])
        ids = torch.randint(0, 128, (1, S), generator=torch.Generator().manual_seed(1))
        out[family] = ours, hf, adapter, ids
    return out


def ours_and_press(ours, hf, ids, press, scorer, question):
    """Both sides on the prompt ids (1, S), then `question` ids (1, Q) and one greedy token on each compressed
    cache. Checks what must hold exactly (kept slots, the kept K/V are HF's own, nothing else in the cache) and
    returns the two sides' logits: [first token (the prefill's), after the question, after the next token]."""
    full = transformers.DynamicCache()
    hf(ids, past_key_values=full)  # HF's own K/V of the prompt, for reference
    cache = transformers.DynamicCache()
    with press(hf):
        theirs = [hf(ids, past_key_values=cache).logits[:, -1]]
    our_cache, logits, next_pos, kept = compress(ours, ids, scorer)
    mine = [logits]

    assert all(torch.equal(a, b) for a, b in zip(press.kept, kept))
    for l, idx in enumerate(kept):
        layer, hidden = cache.layers[l], hf.model.layers[l].self_attn.masked_key_indices
        visible = torch.ones(layer.keys.shape[:3], dtype=torch.bool)
        if hidden is not None:  # per-layer budgets: this layer's extra slots are hidden by kvpress's patch
            visible[hidden] = False
        assert layer.keys.shape[2] == max(x.shape[-1] for x in kept)  # C_l kept + hidden ones, no lookahead row
        for got, want in ((layer.keys, full.layers[l].keys), (layer.values, full.layers[l].values)):
            D = got.shape[-1]
            assert torch.equal(got[visible].view(*idx.shape, D), want.gather(2, idx[..., None].expand(-1, -1, -1, D)))

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


def paper_form(module, budget, rule=Pool("max", 7), budgets=uniform_budgets):
    return make_scorer(EvictConfig("lookahead", budget=budget, rule=rule, budgets=budgets), module=module)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("by", ["budget", "compression_ratio"])
@torch.no_grad()
def test_keeps_our_scorers_slots(tiny, family, by):
    """budget=C and kvpress's compression_ratio keeping C of S alike: our scorer's slots, HF's K/V, our logits."""
    ours, hf, adapter, ids = tiny[family]
    press = LookaheadKVPress.from_adapter(adapter, **({"budget": C} if by == "budget" else
                                                      {"compression_ratio": ratio(S, C)}))
    scorer = paper_form(LookaheadModule.load(adapter, ours.config), C)
    question = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    mine, theirs = ours_and_press(ours, hf, ids, press, scorer, question)
    assert [x.shape[-1] for x in press.kept] == [C] * ours.config.num_hidden_layers
    assert_logits_close(mine, theirs, ours.config)


@torch.no_grad()
def test_every_lora_target_is_applied(tiny):
    """The parity above covers each of the seven LoRA targets: without any one of them, our scores move by far
    more than the press's and ours differ (so a press that skipped one could not match)."""
    ours, hf, adapter, ids = tiny["llama"]
    press = LookaheadKVPress.from_adapter(adapter, budget=C)
    with press(hf):
        hf(ids, past_key_values=transformers.DynamicCache())
    module = LookaheadModule.load(adapter, ours.config)

    def scores(m):
        return prefill_and_score(ours, ids, paper_form(m, C)).scores

    full = scores(module)
    parity = (full - press.scores).abs().max()
    for target in module.targets:
        without = LookaheadModule.load(adapter, ours.config)
        for p in without.lora:
            p[target + "_B"].data.zero_()
        assert (scores(without) - full).abs().max() > 100 * parity, target


@torch.no_grad()
def test_an_adapter_without_a_query_lora(tiny, tmp_path):
    """The scores need the M rows' queries whether or not the adapter puts a LoRA on q_proj (here k and v only)."""
    ours, hf, _, ids = tiny["qwen3"]
    adapter = random_adapter(ours, tmp_path / "kv.safetensors", targets=("k_proj", "v_proj"))
    press = LookaheadKVPress.from_adapter(adapter, budget=C)
    question = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    mine, theirs = ours_and_press(ours, hf, ids, press, paper_form(LookaheadModule.load(adapter, ours.config), C),
                                  question)
    assert_logits_close(mine, theirs, ours.config)


@torch.no_grad()
def test_span_rule_and_layer_budgets(tiny):
    """The options, as our scripts run them (extensions/span.py, extensions/layer_budgets.py): the span rule and
    the adapter's per-layer budgets (weights 0.5, 1.5: 24 and 72 slots). Layer 0 then holds 72 slots, 48 of
    them hidden by kvpress's attention patch, so that a question of several tokens still attends right."""
    ours, hf, adapter, ids = tiny["llama"]
    press = LookaheadKVPress.from_adapter(adapter, budget=C, rule="span:4", layer_budgets=True)
    module = load_adapter(adapter, ours.config)
    scorer = paper_form(module, C, rule=parse_rule("span:4"), budgets=layer_budgets(module.info["layer_weights"]))
    question = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    mine, theirs = ours_and_press(ours, hf, ids, press, scorer, question)
    assert [x.shape[-1] for x in press.kept] == [24, 72]
    assert_logits_close(mine, theirs, ours.config)


@torch.no_grad()
def test_nothing_to_evict_leaves_the_cache(tiny):
    """C >= S, or compression_ratio 0: the cache keeps its S slots, and no lookahead pass runs."""
    _, hf, adapter, ids = tiny["llama"]
    for press in (LookaheadKVPress.from_adapter(adapter, budget=S), LookaheadKVPress.from_adapter(adapter)):
        cache = transformers.DynamicCache()
        with press(hf):
            hf(ids, past_key_values=cache)
        assert [x.keys.shape[2] for x in cache.layers] == [S, S] and press.kept is None


@torch.no_grad()
def test_only_the_prefill_goes_inside(tiny):
    _, hf, adapter, ids = tiny["llama"]
    cache = transformers.DynamicCache()
    with pytest.raises(ValueError, match="only the prompt's forward"):
        with LookaheadKVPress.from_adapter(adapter, budget=C)(hf):
            hf(ids, past_key_values=cache)
            hf(ids[:, :1], past_key_values=cache)


# --- bad input: one clear error, before any forward ---------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    (dict(compression_ratio=1.0), "compression_ratio 1.0"), (dict(compression_ratio=-0.1), "compression_ratio -0.1"),
    (dict(compression_ratio=float("nan")), "compression_ratio nan"), (dict(compression_ratio="0.5"), "'0.5'"),
    (dict(budget=0), "budget 0"), (dict(budget=-3), "budget -3"), (dict(budget=2.5), "budget 2.5"),
    (dict(budget=True), "budget True"), (dict(budget=64, compression_ratio=0.5), "not both"),
    (dict(rule="max:6"), "max:6"),
])
def test_refuses_bad_values(tiny, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LookaheadKVPress.from_adapter(tiny["llama"][2], **kwargs)


def test_refuses_missing_or_broken_adapter_files(tiny, tmp_path):
    good = tiny["llama"][2]
    with pytest.raises(FileNotFoundError, match="nowhere.safetensors"):
        LookaheadKVPress.from_adapter(tmp_path / "nowhere.safetensors", budget=C)
    lone = tmp_path / "lone.safetensors"
    shutil.copy(good, lone)  # its .json missing
    with pytest.raises(FileNotFoundError, match="lone.safetensors"):
        LookaheadKVPress.from_adapter(lone, budget=C)
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"not a safetensors file")
    shutil.copy(good.with_suffix(".json"), broken.with_suffix(".json"))
    with pytest.raises(ValueError, match="broken.safetensors"):
        LookaheadKVPress.from_adapter(broken, budget=C)
    bad_json = tmp_path / "badjson.safetensors"
    shutil.copy(good, bad_json)
    bad_json.with_suffix(".json").write_text("{not json")
    with pytest.raises(ValueError, match="badjson.json"):
        LookaheadKVPress.from_adapter(bad_json, budget=C)


def refused_before_any_forward(press, hf, match):
    """press(hf) raises ValueError matching `match`, and the model never ran."""
    ran = []
    hook = hf.model.register_forward_pre_hook(lambda *a: ran.append(1))
    try:
        with pytest.raises(ValueError, match=match):
            with press(hf):
                hf(torch.zeros(1, 4, dtype=torch.long))
    finally:
        hook.remove()
    assert not ran


def test_refuses_an_adapter_made_for_another_model(tiny):
    press = LookaheadKVPress.from_adapter(tiny["llama"][2], budget=C)
    refused_before_any_forward(press, tiny["qwen3"][1], r"llama\.safetensors was trained for")


def test_refuses_an_architecture_model_py_does_not_load(tiny):
    phi3 = transformers.Phi3ForCausalLM(transformers.Phi3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0)).eval()  # kvpress supports Phi-3; model.py does not
    refused_before_any_forward(LookaheadKVPress.from_adapter(tiny["llama"][2], budget=C), phi3, "'phi3'")


def test_refuses_layer_budgets_it_cannot_apply(tiny, tmp_path, tiny_hf_model):
    ours, hf, adapter, _ = tiny["llama"]
    plain = random_adapter(ours, tmp_path / "plain.safetensors")  # no layer_weights in its .json
    refused_before_any_forward(LookaheadKVPress.from_adapter(plain, budget=C, layer_budgets=True), hf,
                               r"plain\.json holds no \"layer_weights\"")
    eager = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_model("llama"), attn_implementation="eager")
    refused_before_any_forward(LookaheadKVPress.from_adapter(adapter, budget=C, layer_budgets=True), eager,
                               "eager attention")


# --- SmolLM2-135M-Instruct with the shipped adapter -----------------------------------------------------------

needs_real = pytest.mark.skipif(not (REAL_FOLDER / "model.safetensors").exists(),
                                reason="run python weights/prepare.py")


@pytest.fixture(scope="module")
def real():
    """(ours, HF (SDPA), HF tokenizer, needle.txt's text)."""
    ours = load_model(REAL_FOLDER)
    hf = transformers.AutoModelForCausalLM.from_pretrained(REAL_FOLDER, attn_implementation="sdpa").float().eval()
    text = (REAL_FOLDER.parents[1] / "examples" / "needle.txt").read_text()
    return ours, hf, transformers.AutoTokenizer.from_pretrained(REAL_FOLDER), text


@needs_real
@torch.no_grad()
def test_smollm2_keeps_our_scorers_slots(real):
    """C = 128 on a 600-token prompt (the end of examples/needle.txt), the shipped adapter in the paper's form."""
    ours, hf, tok, text = real
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)[-600:]])
    press = LookaheadKVPress.from_adapter(REAL_ADAPTER, budget=128)
    scorer = paper_form(load_adapter(REAL_ADAPTER, ours.config), 128)
    question = torch.tensor([tok.encode("\nThe number is", add_special_tokens=False)])
    mine, theirs = ours_and_press(ours, hf, ids, press, scorer, question)
    assert [x.shape[-1] for x in press.kept] == [128] * 30
    assert_logits_close(mine, theirs, ours.config)


@needs_real
@torch.no_grad()
def test_smollm2_in_kvpress_pipeline(real):
    """pipeline("kv-press-text-generation"): the context compressed to our scorer's 128 slots per (layer, KV
    head), the question after it; the cache it leaves holds those slots only."""
    ours, hf, tok, text = real
    context, _, question = text.rpartition("\n\n")
    pipe = transformers.pipeline("kv-press-text-generation", model=hf, tokenizer=tok, device="cpu")
    press = LookaheadKVPress.from_adapter(REAL_ADAPTER, budget=128)
    cache = transformers.DynamicCache()
    answer = pipe(context, question=question, press=press, cache=cache, max_new_tokens=4)["answer"]
    assert isinstance(answer, str) and answer
    assert [x.keys.shape[2] for x in cache.layers] == [128] * 30
    ids = pipe.preprocess(context, [question], "", 10**6)["context_ids"]
    _, _, _, kept = compress(ours, ids, paper_form(load_adapter(REAL_ADAPTER, ours.config), 128))
    assert all(torch.equal(a, b) for a, b in zip(press.kept, kept))
