"""Tests of train.py: the ground truth against transformers' explicit attention matrices, the
loss, one optimiser loop that must lower it, the training pass == the inference scorer, and
train.main end to end on a tiny random Llama folder (resume == uninterrupted run, the errors,
and a 2-process gloo DDP run whose ranks end identical and equal to a 1-process run).

The end-to-end runs use a pre-written OUT/data.jsonl and replace data.make_training_prompts by a
stub that yields the same ids, so no document is read and no answer is generated."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import data
import lookaheadkv as lk
import train
from lookaheadkv import LookaheadHook, LookaheadModule
from metrics import answer_kl, forced_logprobs, gap_closed
from model import ModelConfig, Transformer, load_model

REPO = Path(__file__).resolve().parent.parent
V = 128
TINY = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, name="tiny")


def tiny_model(seed=0):
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**TINY)).float().eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.15)
    return model


def rand_list(n, seed):
    return torch.randint(1, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -----------------------------------------------------------------------------
# the loss



def write_samples(model, rows, folder):
    """Each row's sample file (its prompt cache and target, float32) in folder; their paths."""
    paths = []
    for i, r in enumerate(rows):
        cache, gt, _ = train.ground_truth(model, r)
        paths.append(folder / f"{i}.safetensors")
        train.save_sample(paths[-1], dict(k=torch.cat(cache.k), v=torch.cat(cache.v),
                                          target=torch.cat([gt[l] for l in range(len(gt))])), torch.float32)
    return paths

def test_kl_loss_known_values():
    gt = {0: torch.tensor([[[1.0, 3.0]]])}  # p = (1/4, 3/4)
    pred = {0: torch.tensor([[[2.0, 2.0]]])}  # q = (1/2, 1/2), unnormalised on purpose
    expected = 0.25 * torch.log(torch.tensor(0.5)) + 0.75 * torch.log(torch.tensor(1.5))
    assert train.kl_loss(gt, pred).item() == pytest.approx(expected.item(), abs=1e-6)
    assert train.kl_loss(gt, {0: pred[0] * 7.0}).item() == pytest.approx(expected.item(), abs=1e-6)  # scale-free
    assert train.kl_loss(gt, {0: gt[0] * 3.0}).item() == pytest.approx(0.0, abs=1e-7)
    assert train.kl_loss(gt, gt).item() == 0.0
    # averaged over heads and layers: layer 0 has two heads (the value above and 0), layer 1 one (0)
    gt2 = {0: torch.tensor([[[1.0, 3.0], [1.0, 1.0]]]), 1: torch.tensor([[[5.0, 5.0]]])}
    pred2 = {0: torch.tensor([[[1.0, 1.0], [3.0, 3.0]]]), 1: torch.tensor([[[1.0, 1.0]]])}
    assert train.kl_loss(gt2, pred2).item() == pytest.approx((expected.item() / 2 + 0.0) / 2, abs=1e-6)
    # KL is asymmetric and positive
    assert train.kl_loss(pred, gt).item() > 0 and train.kl_loss(pred, gt).item() != pytest.approx(expected.item())
    torch.manual_seed(0)
    a, b = {0: torch.rand(1, 4, 30)}, {0: torch.rand(1, 4, 30)}
    assert train.kl_loss(a, b).item() > 0
    # drop (--loss-skip): the slots left out of both distributions before they are normalised
    drop = torch.tensor([[[True, False, False]]])
    gt3, pred3 = {0: torch.tensor([[[50.0, 1.0, 3.0]]])}, {0: torch.tensor([[[0.01, 2.0, 2.0]]])}
    assert train.kl_loss(gt3, pred3, drop=drop).item() == pytest.approx(expected.item(), abs=1e-6)


def test_loss_power_compares_flattened_distributions():
    """kl_loss(power=0.5) is the KL of sqrt(target) and sqrt(prediction), each renormalised; padding (0)
    stays out of both, with a finite gradient; a sink-heavy target weighs the small tokens more."""
    gt = {0: torch.tensor([[[9.0, 1.0, 0.0]]])}  # the last slot is padding
    pred = {0: torch.tensor([[[4.0, 1.0, 0.0]]], requires_grad=True)}
    p, q = torch.tensor([0.75, 0.25]), torch.tensor([2 / 3, 1 / 3])  # sqrt, then normalised
    expected = (p * (p / q).log()).sum().item()
    loss = train.kl_loss(gt, pred, power=0.5)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    loss.backward()
    assert torch.isfinite(pred[0].grad).all() and pred[0].grad[0, 0, 2] == 0 and pred[0].grad[0, 0, 0] != 0
    assert train.kl_loss(gt, pred, power=1.0).item() == train.kl_loss(gt, pred).item()  # the paper's loss
    # a sink with 90% of the mass, right; the tail off by 2x on two small tokens: the flattened loss
    # counts that error more, relative to the same error on the sink
    sink_gt = {0: torch.tensor([[[90.0, 4.0, 4.0, 2.0]]])}
    tail_wrong = {0: torch.tensor([[[90.0, 2.0, 2.0, 6.0]]])}
    sink_wrong = {0: torch.tensor([[[80.0, 8.0, 8.0, 4.0]]])}
    ratio = lambda power: (train.kl_loss(sink_gt, tail_wrong, power=power) /  # noqa: E731
                           train.kl_loss(sink_gt, sink_wrong, power=power)).item()
    assert ratio(0.5) > 1.5 * ratio(1.0)


def test_layer_weights_weigh_each_layers_kl(tmp_path):
    """kl_loss(layer_weights=w): the w-weighted mean of the layers' KLs (all 1: the plain mean, a 0: the
    layer left out); read_layer_weights refuses a bad file in one line, and a list for another model."""
    torch.manual_seed(0)
    gt = {l: torch.rand(1, 2, 9) for l in range(3)}
    pred = {l: torch.rand(1, 2, 9) for l in range(3)}
    per_layer = [train.kl_loss({0: gt[l]}, {0: pred[l]}).item() for l in range(3)]
    assert train.kl_loss(gt, pred, layer_weights=(1, 1, 1)).item() == pytest.approx(train.kl_loss(gt, pred).item())
    got = train.kl_loss(gt, pred, layer_weights=(2.0, 0.0, 1.0)).item()
    assert got == pytest.approx((2 * per_layer[0] + per_layer[2]) / 3, rel=1e-6)
    f = tmp_path / "w.json"
    f.write_text(json.dumps({"weights": [1, 0.5, 2]}))
    assert train.read_layer_weights(f, 3) == (1.0, 0.5, 2.0)
    with pytest.raises(ValueError, match="3 weights for a model of 30 layers"):
        train.read_layer_weights(f, 30)
    for bad in ('{"weights": [1, -1, 2]}', '{"weights": [0, 0]}', '[1, 2]', 'not json'):
        f.write_text(bad)
        with pytest.raises(ValueError, match="--layer-weights"):
            train.read_layer_weights(f)
    with pytest.raises(FileNotFoundError, match="layer_sensitivity.py writes one"):
        train.read_layer_weights(tmp_path / "none.json")


def test_loss_skip_leaves_each_samples_first_tokens_out(tmp_path):
    """batch_loss(skip=k) on a left-padded batch: each sample's loss over its prompt without its first k
    real tokens (the sinks every method keeps), as if they were not there."""
    model = tiny_model()
    rows = [dict(prompt_ids=rand_list(n, n), response_ids=rand_list(5, 100 + n)) for n in (20, 27)]
    paths = write_samples(model, rows, tmp_path)
    torch.manual_seed(3)
    mod = LookaheadModule(model.config, n_tokens=4, embed_std=0.5)
    cache, gt, lengths = train.load_batch(paths, "cpu", torch.float32)
    with torch.no_grad():
        got = train.batch_loss(model, mod, cache, gt, lengths, train.Loss(skip=4)).item()
        want = []
        for r in rows:
            c, g, _ = train.ground_truth(model, r)
            pred = lk.lookahead_pass(model, mod, c, len(c), per_query_head=True)
            want.append(train.kl_loss({l: x[..., 4:] for l, x in g.items()}, {l: x[..., 4:] for l, x in pred.items()}))
        assert got == pytest.approx(sum(want).item() / 2, rel=1e-5)
        assert got != pytest.approx(train.batch_loss(model, mod, cache, gt, lengths).item(), rel=1e-3)


def test_rule_rows():
    assert train.rule_rows("max:7, chunk:8,carry:5,none") == {
        "lookahead_max7": ("lookahead", "max", 7), "lookahead_chunk8": ("lookahead", "chunk", 8),
        "lookahead_carry5": ("lookahead", "carry", 5), "lookahead_none": ("lookahead", "none", 1)}
    assert train.rule_rows("") == {}
    with pytest.raises(ValueError, match="must be odd"):
        train.rule_rows("avg:4")


def test_parse_targets():
    assert train.parse_targets("all") == LookaheadModule.TARGETS and len(train.parse_targets("all")) == 7
    assert train.parse_targets("q_proj, k_proj") == ("q_proj", "k_proj")
    assert train.parse_targets("none") == () == train.parse_targets("")


def test_kl_loss_pooled_compares_stretches_not_tokens():
    # the mass on token 2 or on its neighbour 3: unpooled, a large KL; avg-pooled, the two smoothed
    # distributions share most of their stretch and differ only at its edges, so the KL falls
    gt = {0: torch.tensor([[[1e-3, 1e-3, 1.0, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3]]])}
    pred = {0: torch.tensor([[[1e-3, 1e-3, 1e-3, 1.0, 1e-3, 1e-3, 1e-3, 1e-3]]])}
    plain, pooled = train.kl_loss(gt, pred).item(), train.kl_loss(gt, pred, "avg", 3).item()
    assert plain > 6 and 0 < pooled < plain / 3
    assert train.kl_loss(gt, pred, "avg", 5).item() < pooled  # a wider stretch: closer still
    # by hand: zero-padded avg over 3, then L1-normalised, then KL
    sm = lambda x: torch.nn.functional.avg_pool1d(x.view(1, 1, -1), 3, 1, 1).view(-1)
    p, q = sm(gt[0]), sm(pred[0])
    p, q = p / p.sum(), q / q.sum()
    assert pooled == pytest.approx((p * ((p + 1e-8).log() - (q + 1e-8).log())).sum().item(), abs=1e-6)
    assert train.kl_loss(gt, pred, "none", 5).item() == pytest.approx(plain)  # pool none: kernel ignored


# -----------------------------------------------------------------------------
# the ground truth against transformers' explicit attention matrices


@pytest.fixture(scope="module")
def hf_folder(tiny_hf_model):
    return tiny_hf_model("llama")


def test_ground_truth_equals_explicit_attention(hf_folder):
    """gt[l] (1, H, S) = mean over the answer's rows of the causal softmax over prompt + answer,
    columns = the prompt; snapkv / h2o extras from the same matrix. Reference: HF eager attention
    with output_attentions (an independent implementation of the whole model)."""
    from transformers import AutoModelForCausalLM

    model = load_model(hf_folder)
    cfg = model.config
    hf = AutoModelForCausalLM.from_pretrained(hf_folder, attn_implementation="eager").eval()
    S, R, W = 40, 9, 32
    row = dict(prompt_ids=rand_list(S, 1), response_ids=rand_list(R, 2))
    cache, gt, extra = train.ground_truth(model, row, window=W)
    with torch.no_grad():
        att = hf(torch.tensor([row["prompt_ids"] + row["response_ids"]]), output_attentions=True).attentions
    G = cfg.num_attention_heads // cfg.num_key_value_heads
    group = lambda x: x.view(1, cfg.num_key_value_heads, G, S).mean(2)  # noqa: E731
    assert len(cache) == S and len(gt) == cfg.num_hidden_layers
    for l, A in enumerate(att):  # A (1, H, S+R, S+R)
        assert gt[l].shape == (1, cfg.num_attention_heads, S)
        assert torch.allclose(gt[l], A[:, :, S:, :S].mean(2), atol=1e-5), l
        assert (gt[l].sum(-1) < 1).all()  # the answer attends to itself too: mass on the prompt < 1
        assert torch.allclose(extra["snapkv"][l], group(A[:, :, S - W:S, :S].mean(2)), atol=1e-5)
        h2o = group(A[:, :, :S, :S].sum(2)) / (S - torch.arange(S))
        assert torch.allclose(extra["h2o"][l], h2o, atol=1e-5)
    # the cache is the prompt's KV exactly (compress would build the same)
    full, _, _, _ = lk.compress(model, torch.tensor([row["prompt_ids"]]), lk.EvictConfig("full"))
    for l in range(cfg.num_hidden_layers):
        assert torch.allclose(cache.k[l], full.k[l], atol=1e-5) and torch.allclose(cache.v[l], full.v[l], atol=1e-5)
    # the oracle's scores (answer_attention per KV head) are the GQA mean of the same target
    oracle = lk.answer_attention(model, full, torch.tensor([row["response_ids"]]), torch.tensor([S]))
    for l, g in train.group_mean(gt, cfg.num_key_value_heads).items():
        assert torch.allclose(oracle[l], g, atol=1e-5)


def test_ground_truth_extras_for_a_prompt_shorter_than_the_window():
    model = tiny_model()
    S, R, W = 20, 12, 32
    row = dict(prompt_ids=rand_list(S, 5), response_ids=rand_list(R, 6))
    _, _, extra = train.ground_truth(model, row, window=W)
    ids = torch.tensor([row["prompt_ids"]])
    h = lk.WindowHook(S, S)  # every prompt query: the window covers the whole prompt
    with torch.no_grad():
        model(ids, positions=torch.arange(S)[None], hook=h)
    for l in range(model.config.num_hidden_layers):
        assert torch.allclose(extra["snapkv"][l], h.scores[l], atol=1e-6)


# -----------------------------------------------------------------------------
# the training pass


def test_training_pass_equals_inference_scorer_and_leaves_the_cache():
    model = tiny_model()
    cfg = model.config
    S = 30
    mod = LookaheadModule(cfg, n_tokens=8, targets=LookaheadModule.TARGETS, embed_std=0.15)
    with torch.no_grad():
        for n, p in mod.named_parameters():
            if n.endswith("_B"):
                p.normal_(0, 0.1)
    row = dict(prompt_ids=rand_list(S, 3), response_ids=rand_list(6, 4))
    cache, _, _ = train.ground_truth(model, row)
    k0 = [k.clone() for k in cache.k]
    pred = lk.lookahead_pass(model, mod, cache, S, per_query_head=True)
    assert len(cache) == S and all(torch.equal(a, b) for a, b in zip(k0, cache.k))  # not appended to
    # the same scores as inference: one pass over [prompt; P] with LookaheadHook, GQA-mean
    ids = torch.tensor([row["prompt_ids"]])
    hook = LookaheadHook(mod, S)
    with torch.no_grad():
        x = torch.cat([model.model.embed_tokens(ids), mod.embeddings[None]], 1)
        model(inputs_embeds=x, positions=torch.arange(S + 8)[None], hook=hook)
    for l, g in train.group_mean(pred, cfg.num_key_value_heads).items():
        assert torch.allclose(g, hook.scores[l], atol=1e-5)
    # gradients reach the module only
    train.kl_loss(train.ground_truth(model, row)[1], pred).backward()
    assert all(p.grad is None for p in model.parameters())
    last = cfg.num_hidden_layers - 1
    for n, p in mod.named_parameters():
        # the scores read q and k; what the last layer does after its attention cannot change them
        dead = n.startswith(f"lora.{last}.") and not n.startswith((f"lora.{last}.q_proj", f"lora.{last}.k_proj"))
        live = p.grad is not None and p.grad.abs().sum() > 0
        assert live != dead, n  # (a dead one has grad None: it is not in the graph at all)


def test_a_few_steps_lower_the_loss_on_a_fixed_batch():
    model = tiny_model()
    cfg = model.config
    torch.manual_seed(0)
    mod = LookaheadModule(cfg, n_tokens=8, embed_std=0.15)  # untrained: B = 0
    rows = [dict(prompt_ids=rand_list(32 + 4 * i, 10 + i), response_ids=rand_list(8, 20 + i)) for i in range(2)]
    micro = [(c, gt, torch.tensor([len(c)])) for c, gt, _ in (train.ground_truth(model, r) for r in rows)]
    opt = torch.optim.AdamW(mod.parameters(), lr=1e-2)
    losses = [train.optimizer_step(mod, opt, model, micro, 2, clip=1.0).item() for _ in range(8)]
    with torch.no_grad():
        final = sum(train.batch_loss(model, mod, *m).item() for m in micro) / 2
    assert final < 0.8 * losses[0], losses + [final]
    assert final > 0


# -----------------------------------------------------------------------------
# train.main end to end on a tiny folder


def make_tokenizer(folder):
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    words = ["[UNK]", "hi", "there", "system", "user", "assistant"]
    tk = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


@pytest.fixture(scope="module")
def model_dir(tiny_hf_model, tmp_path_factory):
    import shutil

    dst = tmp_path_factory.mktemp("train") / "TinyLlama"
    shutil.copytree(tiny_hf_model("llama"), dst)
    make_tokenizer(dst)
    return dst


def fake_prompts(tok, n, split="train", **kw):
    """Stands in for data.make_training_prompts: the ids of the pre-written rows, no documents."""
    return [dict(id=f"{split}-{i}", source="fake", doc="d", task="t", prompt="hi there") for i in range(n)]


def write_data(out, model_dir, n_train=4, n_heldout=1, fingerprint=None, base_model=None):
    cfg = ModelConfig.from_hf_config(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for split, n in (("train", n_train), ("heldout", n_heldout)):
        for i in range(n):
            s = len(rows)
            rows.append(dict(id=f"{split}-{i}", split=split, source="fake", task="t",
                             base_model=base_model or cfg.name, fingerprint=fingerprint or cfg.fingerprint(),
                             prompt_ids=rand_list(36 + 3 * s, 100 + s), response_ids=rand_list(6, 200 + s)))
    data.write_jsonl(rows, out / "data.jsonl")
    return rows


def argv(model_dir, out, *extra):
    return ["--model", str(model_dir), "--out", str(out), "--n-train", "4", "--n-heldout", "1", "--batch", "2",
            "--epochs", "2", "--n-tokens", "8", "--lr", "1e-2", "--warmup", "0.25", "--budget", "16", "--window", "4",
            "--micro-batch", "1",
            "--eval-every", "100", "--save-every", "100", "--device", "cpu", *extra]


@pytest.fixture
def stub_prompts(monkeypatch):
    monkeypatch.setattr(data, "make_training_prompts", fake_prompts)


def adapter(path):
    return load_file(str(path))


class Interrupted(Exception):
    pass


def test_resume_equals_uninterrupted_run(model_dir, tmp_path, stub_prompts, monkeypatch, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        write_data(out, model_dir)
    train.main(argv(model_dir, a))  # 4 steps straight (4 samples / batch 2 x 2 epochs)
    meta_a = json.loads((a / "adapter.json").read_text())
    assert meta_a["steps"] == 4

    # run B: checkpoint every step, killed right after step 2's checkpoint
    orig_save = train.save_checkpoint

    def save_then_die(path, module, opt, step, log):
        orig_save(path, module, opt, step, log)
        if step == 2:
            raise Interrupted

    monkeypatch.setattr(train, "save_checkpoint", save_then_die)
    with pytest.raises(Interrupted):
        train.main(argv(model_dir, b, "--save-every", "1"))
    monkeypatch.setattr(train, "save_checkpoint", orig_save)
    assert not (b / "adapter.safetensors").exists()
    ck = torch.load(b / "ckpt.pt", weights_only=False)
    assert ck["step"] == 2
    capsys.readouterr()
    train.main(argv(model_dir, b, "--resume"))
    assert "resumed at step 2/4" in capsys.readouterr().out
    pa, pb = adapter(a / "adapter.safetensors"), adapter(b / "adapter.safetensors")
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.allclose(pa[k], pb[k], atol=1e-6), k
    assert json.loads((b / "adapter.json").read_text())["steps"] == 4
    # the comparison means something: steps 3-4 moved the parameters away from the checkpoint
    moved = max((pa[k] - ck["module"][k]).abs().max().item() for k in pa)
    assert moved > 1e-3
    # and the logged held-out eval ran on the untrained module (step 0) and at the end
    log = [json.loads(line) for line in (a / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [0, 4] and all(0 <= r["recall_lookahead"] <= 1 for r in log)


def test_no_training_data_is_an_error(model_dir, tmp_path, stub_prompts):
    with pytest.raises(SystemExit, match=r"^error: --n-train 0: must be at least 1$"):  # before the model loads
        train.main(argv(model_dir, tmp_path / "o", "--n-train", "0", "--n-heldout", "0"))
    with pytest.raises(SystemExit, match=r"^error: --pool-loss cannot use the span rule"):
        train.main(argv(model_dir, tmp_path / "o", "--pool", "span", "--kernel", "8", "--pool-loss"))
    write_data(tmp_path / "o", model_dir)  # rows, but no sample file written yet
    with pytest.raises(SystemExit, match="no training samples.*--n-train > 0"):
        train.main(argv(model_dir, tmp_path / "o", "--stage", "train"))


def test_data_from_another_base_model_is_refused(model_dir, tmp_path, stub_prompts):
    write_data(tmp_path / "o", model_dir, fingerprint="0123456789abcdef", base_model="OtherModel-1B")
    with pytest.raises(SystemExit, match=r"made with another base model \(OtherModel-1B\)"):
        train.main(argv(model_dir, tmp_path / "o"))


def test_corrupt_checkpoint_is_refused(model_dir, tmp_path, stub_prompts):
    out = tmp_path / "o"
    write_data(out, model_dir)
    (out / "ckpt.pt").write_bytes(b"\x80\x04 this is not a checkpoint" * 20)
    with pytest.raises(SystemExit, match="corrupt"):
        train.main(argv(model_dir, out, "--resume"))
    # a checkpoint of another model's module
    other = LookaheadModule(ModelConfig(**{**TINY, "hidden_size": 32}), n_tokens=8)
    train.save_checkpoint(out / "ckpt.pt", other, torch.optim.AdamW(other.parameters()), 1, [])
    with pytest.raises(SystemExit, match="was trained for tiny"):
        train.main(argv(model_dir, out, "--resume"))


def test_lr_schedule():
    args = train.get_args(["--lr", "1e-3", "--warmup", "0.1"])
    lrs = [train.lr_at(s, 100, args) for s in range(100)]
    assert lrs[:10] == pytest.approx([1e-3 * (s + 1) / 10 for s in range(10)])  # linear warmup
    assert lrs[10] == pytest.approx(1e-3) and lrs[55] == pytest.approx(0.5e-3)  # cosine, half way
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and lrs[-1] < 1e-6


# -----------------------------------------------------------------------------
# DDP on CPU (gloo)

WRAPPER = """
import os, sys
sys.path.insert(0, os.environ["LKV_REPO"])
import torch
import data, train
sys.path.insert(0, os.environ["LKV_TESTS"])
from test_train import fake_prompts
data.make_training_prompts = fake_prompts
made = []
new_module = train.new_module

def recording(model, args):  # to save every rank's final module (train.py saves rank 0's)
    made.append(new_module(model, args))
    return made[-1]

train.new_module = recording
train.main(sys.argv[1:])
torch.save({k: v.detach().clone() for k, v in made[-1].state_dict().items()},
           os.path.join(os.environ["LKV_OUT"], f"rank{os.environ['RANK']}.pt"))
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_ranks_agree_and_match_one_process(model_dir, tmp_path, stub_prompts):
    ddp, single = tmp_path / "ddp", tmp_path / "single"
    for out in (ddp, single):
        write_data(out, model_dir)
    train.main(argv(model_dir, ddp, "--stage", "data"))  # the sample files first, on one process
    script = tmp_path / "run_train.py"
    script.write_text(WRAPPER)
    env = dict(os.environ, LKV_REPO=str(REPO), LKV_TESTS=str(Path(__file__).parent), LKV_OUT=str(ddp),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(script), *argv(model_dir, ddp)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r0, r1 = torch.load(ddp / "rank0.pt"), torch.load(ddp / "rank1.pt")
    saved = adapter(ddp / "adapter.safetensors")
    assert r0.keys() == r1.keys() == saved.keys()
    for k in r0:
        assert torch.equal(r0[k], r1[k]), k  # the ranks never drift apart
        assert torch.equal(r0[k], saved[k])
    # 2 ranks x 1 sample with averaged gradients == 1 process x 2 samples
    train.main(argv(model_dir, single))
    one = adapter(single / "adapter.safetensors")
    for k in r0:
        assert torch.allclose(r0[k], one[k], atol=1e-5), k
    assert json.loads((ddp / "adapter.json").read_text())["steps"] == 4


class FakeDist:
    """torch.distributed stand-in, in-process: world size 2, this process is rank 0, and all_reduce
    acts as if rank 1 had computed the same gradient (sum = 2x, like the real one it refuses
    anything but a tensor). Enough to run train.main's DDP branch in 1 s instead of a torchrun."""

    def __init__(self):
        self.reduced = 0

    def init_process_group(self, backend):
        assert backend == "gloo"

    def get_rank(self):
        return 0

    def get_world_size(self):
        return 2

    def all_reduce(self, t):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"all_reduce expects a tensor, got {type(t).__name__}")
        t.mul_(2)
        self.reduced += 1

    def destroy_process_group(self):
        pass


@pytest.mark.parametrize("targets", ["q_proj,k_proj", ",".join(LookaheadModule.TARGETS)])
def test_ddp_gradient_reduction_with_every_lora_target(model_dir, tmp_path, stub_prompts, monkeypatch, targets):
    out = tmp_path / "o"
    write_data(out, model_dir)
    fake = FakeDist()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(train, "dist", fake)
    train.main(argv(model_dir, out, "--targets", targets))
    meta = json.loads((out / "adapter.json").read_text())
    assert meta["steps"] == 4 and meta["targets"] == targets.split(",")
    assert fake.reduced > 0


def test_eval_only_reports_the_untrained_init_and_the_adapter(model_dir, tmp_path, stub_prompts, capsys):
    """--eval-only: no training; the untrained row must equal training's step-0 eval (same seed,
    same init), and the adapter row the final eval of the run that saved it."""
    out = tmp_path / "e"
    write_data(out, model_dir, n_heldout=2)
    train.main(argv(model_dir, out, "--eval-every", "1", "--pool", "avg", "--kernel", "5"))
    log = [json.loads(l) for l in (out / "log.jsonl").read_text().splitlines()]
    capsys.readouterr()
    train.main(argv(model_dir, out, "--eval-only", str(out / "adapter.safetensors")))
    lines = [l for l in capsys.readouterr().out.splitlines() if "heldout" in l]
    assert lines[0].startswith("untrained") and lines[1].startswith("adapter")
    assert f"kl {log[0]['kl']:.4f}" in lines[0] and f"kl {log[-1]['kl']:.4f}" in lines[1]
    assert log[0]["kl"] != log[-1]["kl"]
    # several adapters (an ablation) on the same held-out set: one line each, named by path
    train.main(argv(model_dir, out, "--eval-only", f"{out / 'adapter.safetensors'},{out / 'adapter.safetensors'}"))
    lines = [l for l in capsys.readouterr().out.splitlines() if "heldout" in l]
    assert len(lines) == 3 and lines[1].startswith(str(out / "adapter.safetensors"))
    assert lines[1][-60:] == lines[2][-60:]
    # --budgets: one markdown table, the baselines once and each adapter pooled / unpooled, and per cell the
    # share of the SnapKV-to-oracle gap closed
    train.main(argv(model_dir, out, "--eval-only", str(out / "adapter.safetensors"), "--budgets", "8,16",
                    "--pool", "avg", "--kernel", "5"))
    text = capsys.readouterr().out
    table = [l for l in text.splitlines() if l.startswith("| ")]
    assert table[0].startswith("| recall@C (2 held-out; gap closed) | C=8 | C=16 |")
    names = [l.split(" | ")[0][2:] for l in table[1:]]
    assert names == ["oracle", "snapkv", "pyramidkv", "h2o", "streaming", "untrained, as shipped (avg 5)",
                     "untrained, unpooled", "adapter, as shipped (avg 5)", "adapter, unpooled"]
    assert f"{log[-1]['kl']:.4f}" in table[-1]
    cells = {name: l.split(" | ")[1:3] for name, l in zip(names, table[1:])}
    assert all(c.endswith("(100%)") for c in cells["oracle"]) and all(c.endswith("(0%)") for c in cells["snapkv"])
    for name, (c8, _) in cells.items():  # value (share): the share is gap_closed of the printed values
        v, snap, orc = (float(cells[x][0].split()[0]) for x in (name, "snapkv", "oracle"))
        share = int(c8.split("(")[1].rstrip("%)"))
        assert abs(share - 100 * gap_closed(v, snap, orc)) <= 1 + 100 * 1e-3 / (orc - snap), name
    # --answer-kl: a second table, the same rows, lower is better: it comes first (the headline)
    train.main(argv(model_dir, out, "--eval-only", str(out / "adapter.safetensors"), "--budgets", "8,16",
                    "--pool", "avg", "--kernel", "5", "--answer-kl"))
    table = [l for l in capsys.readouterr().out.splitlines() if l.startswith("| ")]
    assert table[0].startswith("| answer KL (2 held-out; gap closed) | C=8 | C=16 |")
    assert [l.split(" | ")[0][2:] for l in table[1:len(names) + 1]] == names
    assert table[len(names) + 1].startswith("| recall@C (2 held-out; gap closed) | C=8 | C=16 |")
    kl_cells = {name: l.split(" | ")[1:3] for name, l in zip(names, table[1:])}
    assert all(c.endswith("(100%)") for c in kl_cells["oracle"]) and all(c.endswith("(0%)") for c in kl_cells["snapkv"])
    # an adapter with per-layer budgets: two more rows, the paper's C in every layer (the same slots as the
    # adapter without them) and SnapKV given the adapter's budgets
    meta = json.loads((out / "adapter.json").read_text())
    n_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    (out / "layered.safetensors").write_bytes((out / "adapter.safetensors").read_bytes())
    (out / "layered.json").write_text(json.dumps(dict(meta, layer_budget=[0.5] + [1.5] * (n_layers - 1))))
    train.main(argv(model_dir, out, "--eval-only", f"{out / 'adapter.safetensors'},{out / 'layered.safetensors'}",
                    "--budgets", "8,16", "--pool", "avg", "--kernel", "5"))
    rows = {l.split(" | ")[0][2:]: l.split(" | ")[1:3] for l in capsys.readouterr().out.splitlines()
            if l.startswith("| ")}
    assert "snapkv_layered" in rows and rows["snapkv_layered"] != rows["snapkv"]
    plain, layered = str(out / "adapter.safetensors"), str(out / "layered.safetensors")
    assert rows[f"{layered}, uniform"] == rows[f"{plain}, as shipped (avg 5)"]
    assert rows[f"{layered}, as shipped (avg 5)"] != rows[f"{plain}, as shipped (avg 5)"]


def test_init_continues_an_adapter_and_keeps_its_untrained_reference(model_dir, tmp_path, stub_prompts):
    """--init: step 0 of the new run is the init adapter (not a fresh module), its shape wins over
    the CLI's, and the saved metadata keeps the original untrained reference."""
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        write_data(out, model_dir)
    train.main(argv(model_dir, a))
    meta_a = json.loads((a / "adapter.json").read_text())
    L = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    (a / "adapter.json").write_text(json.dumps(dict(meta_a, layer_budget=[1.5] + [0.5] * (L - 1))))
    train.main(argv(model_dir, b, "--init", str(a / "adapter.safetensors"), "--n-tokens", "4"))
    meta_b = json.loads((b / "adapter.json").read_text())
    assert meta_b["layer_budget"] is None  # budgets belong to the init's weights: measured again, not inherited
    log_b = [json.loads(line) for line in (b / "log.jsonl").read_text().splitlines()]
    assert meta_b["n_tokens"] == 8 and meta_b["steps"] == 4
    assert log_b[0]["kl"] == pytest.approx(meta_a["heldout"]["kl"])  # step 0 = the init adapter
    assert meta_b["untrained"] == meta_a["untrained"]
    assert meta_b["init"] == dict(path="adapter.safetensors", steps=4, heldout=log_b[0])
    pa, pb = adapter(a / "adapter.safetensors"), adapter(b / "adapter.safetensors")
    assert max((pa[k] - pb[k]).abs().max().item() for k in pa) > 1e-3  # and it trained further


def test_embeddings_alone_without_lora_train(model_dir, tmp_path, stub_prompts):
    """--targets '' : the ablation without a LoRA; only the M embeddings learn, and they do."""
    out = tmp_path / "n"
    write_data(out, model_dir)
    train.main(argv(model_dir, out, "--targets", "", "--eval-every", "1"))
    meta = json.loads((out / "adapter.json").read_text())
    assert meta["targets"] == [] and meta["steps"] == 4
    weights = adapter(out / "adapter.safetensors")
    assert list(weights) == ["embeddings"]  # no LoRA tensors at all
    log = [json.loads(l) for l in (out / "log.jsonl").read_text().splitlines()]
    assert log[-1]["kl"] != log[0]["kl"]  # the embeddings moved the prediction
    cfg = ModelConfig.from_hf_config(model_dir)
    m = LookaheadModule.load(out / "adapter.safetensors", cfg)
    assert m.targets == () and m.delta(0, "q_proj", torch.zeros(1, 8, cfg.hidden_size)) is None


# -----------------------------------------------------------------------------
# one prefill per sample, batched: the same targets, caches and losses as one sample at a time


class StubTok:
    def __init__(self, stop_ids):
        self.stop_ids = stop_ids


def test_batched_targets_equal_one_forward_over_prompt_and_answer():
    """answer_and_target prefills B prompts of different lengths once, together, and runs their
    answers (different lengths) on top: each row's target and cache equal ground_truth's single
    forward over [prompt; answer]."""
    model = tiny_model()
    prompts = [rand_list(n, 40 + n) for n in (30, 45, 38)]
    # a stop id that one row hits early, so the answers have different lengths
    first = [train.answer_and_target(model, StubTok(set()), [p], 6)[0]["response_ids"] for p in prompts]
    stop = first[1][2]
    samples = train.answer_and_target(model, StubTok({stop}), prompts, 6)
    lengths = [len(s["response_ids"]) for s in samples]
    assert len(set(lengths)) > 1 and samples[1]["response_ids"][-1] == stop  # the stop token is kept
    for p, s in zip(prompts, samples):
        assert s["response_ids"] == first[prompts.index(p)][:len(s["response_ids"])]  # batching changes no answer
        cache, gt, _ = train.ground_truth(model, dict(prompt_ids=p, response_ids=s["response_ids"]))
        L = len(gt)
        assert s["target"].shape == (L, TINY["num_attention_heads"], len(p))
        assert torch.allclose(s["target"], torch.cat([gt[l] for l in range(L)]), atol=1e-5)
        assert torch.allclose(s["k"], torch.cat(cache.k), atol=1e-5)
        assert torch.allclose(s["v"], torch.cat(cache.v), atol=1e-5)


def test_batched_loss_equals_the_mean_of_per_sample_losses(tmp_path):
    """load_batch left-pads samples of different lengths into one cache; one lookahead forward over
    the batch gives the mean of the per-sample losses, and the same gradients."""
    model = tiny_model()
    cfg = model.config
    rows = [dict(prompt_ids=rand_list(n, n), response_ids=rand_list(5, 100 + n)) for n in (20, 33, 27)]
    paths = write_samples(model, rows, tmp_path)
    torch.manual_seed(3)
    mod = LookaheadModule(cfg, n_tokens=4, embed_std=0.5)
    with torch.no_grad():
        for n, p in mod.named_parameters():
            if n.endswith("_B"):
                p.normal_(0, 0.1)  # a trained-looking LoRA, so the rows do depend on it
    per_sample = []
    for r in rows:
        cache, gt, _ = train.ground_truth(model, r)
        per_sample.append(train.batch_loss(model, mod, cache, gt, len(cache)))
    mean = sum(per_sample) / 3
    mean.backward()
    # (None: the last layer's v/o/MLP LoRA, which no score reads)
    grad = lambda p: torch.zeros_like(p) if p.grad is None else p.grad.clone()  # noqa: E731
    grads = {n: grad(p) for n, p in mod.named_parameters()}
    assert sum(g.abs().sum() > 0 for g in grads.values()) > len(grads) / 2
    mod.zero_grad()
    cache, gt, lengths = train.load_batch(paths, "cpu", torch.float32)
    assert lengths.tolist() == [20, 33, 27] and cache.k[0].shape[2] == 33
    loss = train.batch_loss(model, mod, cache, gt, lengths)
    assert loss.item() == pytest.approx(mean.item(), rel=1e-5)
    loss.backward()
    for n, p in mod.named_parameters():
        assert torch.allclose(grad(p), grads[n], atol=1e-6), n
    mod.zero_grad(set_to_none=True)

    # optimizer_step: micro-batches of 1 and 2 samples, each sample weighing 1/3 of the step; SGD with lr 1
    # moves every parameter by minus the gradient of the mean (no clipping at 1e9)
    before = {n: p.detach().clone() for n, p in mod.named_parameters()}
    micro = [train.load_batch(paths[:1], "cpu", torch.float32), train.load_batch(paths[1:], "cpu", torch.float32)]
    step_loss = train.optimizer_step(mod, torch.optim.SGD(mod.parameters(), lr=1.0), model, micro, 3, clip=1e9)
    assert step_loss.dim() == 0 and step_loss.item() == pytest.approx(mean.item(), rel=1e-5)
    for n, p in mod.named_parameters():
        assert torch.allclose(p.detach(), before[n] - grads[n], atol=1e-6), n
        assert p.grad is None  # zeroed for the next step
    # with a clip, the step's gradient norm is cut to it
    with torch.no_grad():
        for n, p in mod.named_parameters():
            p.copy_(before[n])
    train.optimizer_step(mod, torch.optim.SGD(mod.parameters(), lr=1.0), model, micro, 3, clip=1e-3)
    moved = torch.cat([(p.detach() - before[n]).flatten() for n, p in mod.named_parameters()])
    assert moved.norm().item() == pytest.approx(1e-3, rel=1e-3)
    # two ranks (FakeDist: the other rank's gradient is this one's) over 6 samples: the same step
    with torch.no_grad():
        for n, p in mod.named_parameters():
            p.copy_(before[n])
    fake = FakeDist()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "dist", fake)
        step2 = train.optimizer_step(mod, torch.optim.SGD(mod.parameters(), lr=1.0), model, micro, 6, 1e9, world=2)
    assert fake.reduced > 0 and step2.item() == pytest.approx(mean.item() / 2, rel=1e-5)  # this rank's share
    for n, p in mod.named_parameters():
        assert torch.allclose(p.detach(), before[n] - grads[n], atol=1e-6), n


def test_a_killed_data_stage_resumes_and_rebuilds_missing_samples(model_dir, tmp_path, stub_prompts):
    out = tmp_path / "d"
    write_data(out, model_dir)
    train.main(argv(model_dir, out, "--stage", "data"))
    files = sorted((out / "samples").glob("*.safetensors"))
    assert len(files) == 4  # one per training row; held-out rows are evaluated from data.jsonl
    before = load_file(str(files[0]))
    files[0].unlink()  # as if the run died before writing it
    train.main(argv(model_dir, out, "--stage", "data"))
    after = load_file(str(files[0]))
    assert all(torch.equal(before[k], after[k]) for k in before)
    write_data(tmp_path / "e", model_dir)  # 4 samples of ~45 tokens: ~45 KB in bfloat16
    with pytest.raises(SystemExit, match="over --store-gb"):
        train.main(argv(model_dir, tmp_path / "e", "--store-gb", "0.00001"))


def test_stage_train_only_reads_and_trains_on_the_rows_with_samples(model_dir, tmp_path, monkeypatch):
    """--stage train never writes data (a data stage may be appending to OUT): no prompt made, no sample
    rebuilt, data.jsonl untouched; it trains on the training rows whose sample files exist."""
    out = tmp_path / "t"
    write_data(out, model_dir)
    monkeypatch.setattr(data, "make_training_prompts", fake_prompts)
    train.main(argv(model_dir, out, "--stage", "data"))
    files = sorted((out / "samples").glob("*.safetensors"))
    files[0].unlink()  # its row is in data.jsonl, its sample not (yet)
    jsonl, left = (out / "data.jsonl").read_bytes(), {f: f.read_bytes() for f in files[1:]}
    monkeypatch.setattr(data, "make_training_prompts", lambda *a, **k: pytest.fail("no prompt may be made"))
    read, load_batch = [], train.load_batch
    monkeypatch.setattr(train, "load_batch", lambda paths, *a: (read.extend(paths), load_batch(paths, *a))[1])
    train.main(argv(model_dir, out, "--stage", "train", "--n-train", "9"))
    assert (out / "data.jsonl").read_bytes() == jsonl and not files[0].exists()
    assert sorted((out / "samples").glob("*.safetensors")) == files[1:]
    assert all(f.read_bytes() == b for f, b in left.items())
    assert set(read) == set(files[1:])  # every epoch: the three samples there are, never the missing one
    meta = json.loads((out / "adapter.json").read_text())
    assert meta["train_data"]["n_train"] == 3 and meta["steps"] == 2  # 3 micro-batches of 1, 2 a step, 2 epochs
    # the data as its rows are (lengths, copy share), whatever this command's data flags say
    rows = [json.loads(l) for l in (out / "data.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["split"] == "train" and train.sample_path(out, r["id"]).exists()]
    lengths = [len(r["prompt_ids"]) for r in train_rows]
    assert meta["train_data"]["prompt_tokens"] == [min(lengths), max(lengths)]
    assert meta["train_data"]["answer_tokens_max"] == max(len(r["response_ids"]) for r in train_rows)
    assert 0 <= meta["train_data"]["copy_share"] <= 1


def test_copy_frac_reaches_the_training_prompts_only(model_dir, tmp_path, monkeypatch):
    asked = []

    def recording(tok, n, split="train", **kw):
        asked.append((split, kw["copy_frac"]))
        return fake_prompts(tok, n, split)

    monkeypatch.setattr(data, "make_training_prompts", recording)
    out = tmp_path / "c"
    write_data(out, model_dir)
    train.main(argv(model_dir, out, "--stage", "data", "--n-train", "5", "--copy-frac", "0.7",
                    "--max-new-tokens", "3"))
    assert asked == [("train", 0.7), ("heldout", None)]  # held-out prompts keep the default mix
    assert len((out / "data.jsonl").read_text().splitlines()) == 6  # the one new row answered and appended


def test_new_module_is_the_seeded_untrained_module(model_dir):
    model = load_model(model_dir)
    args = train.get_args(["--n-tokens", "6", "--rank", "4", "--targets", "q_proj,v_proj", "--pool", "max",
                           "--kernel", "3", "--lookahead-window", "2", "--seed", "5"])
    torch.manual_seed(123)  # whatever the global state: --seed decides the draw
    got = train.new_module(model, args)
    torch.manual_seed(5)
    want = lk.untrained_module(model, 6, 4, args.alpha, ("q_proj", "v_proj"), "max", 3, 2)
    assert got.metadata() == want.metadata() and got.window == 2 and got.targets == ("q_proj", "v_proj")
    assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(), want.state_dict().values()))
    assert train.new_module(model, train.get_args([])).targets == LookaheadModule.TARGETS  # --targets all


def test_heldout_eval_reports_lookahead_with_and_without_its_pooling():
    model = tiny_model()
    rows = [dict(prompt_ids=rand_list(n, n), response_ids=rand_list(5, 100 + n)) for n in (40, 52)]
    heldout = [train.ground_truth(model, r, window=4) for r in rows]
    torch.manual_seed(0)
    plain = LookaheadModule(model.config, n_tokens=4, embed_std=0.5, pool="none")
    r = train.heldout_metrics(model, plain, heldout, budget=12, window=4)
    assert r["recall_lookahead"] == r["recall_lookahead_unpooled"]  # nothing to pool
    torch.manual_seed(0)
    pooled = LookaheadModule(model.config, n_tokens=4, embed_std=0.5, pool="avg", kernel=5)
    p = train.heldout_metrics(model, pooled, heldout, budget=12, window=4)
    assert p["recall_lookahead_unpooled"] == r["recall_lookahead_unpooled"] and p["kl"] == r["kl"]  # same module
    assert p["recall_lookahead"] != p["recall_lookahead_unpooled"]


def test_heldout_eval_scores_once_for_several_budgets_under_the_oracle():
    model = tiny_model()
    rows = [dict(prompt_ids=rand_list(n, n), response_ids=rand_list(5, 100 + n)) for n in (40, 52)]
    heldout = [train.ground_truth(model, r, window=4) for r in rows]
    torch.manual_seed(0)
    module = LookaheadModule(model.config, n_tokens=4, embed_std=0.5, pool="avg", kernel=5)
    r = train.heldout_metrics(model, module, heldout, budget=12, window=4, budgets=(8, 12, 24))
    assert r == {**r, **train.heldout_metrics(model, module, heldout, budget=12, window=4)}  # the same at C = 12
    for m in ("lookahead", "lookahead_unpooled", "snapkv", "h2o", "streaming"):  # equal budgets in every layer
        assert r[f"recall_{m}"] == r[f"recall_{m}@12"]
        for C in (8, 12, 24):
            assert 0 < r[f"recall_{m}@{C}"] <= r[f"recall_oracle@{C}"] + 1e-6  # the exact top C is the ceiling
        assert r[f"recall_{m}@8"] <= r[f"recall_{m}@12"] <= r[f"recall_{m}@24"]
    assert r["recall_oracle@8"] < r["recall_oracle@24"] < 1
    assert {k.split("@")[0] for k in r if k.startswith("recall_")} == {f"recall_{row}" for row in train.HELDOUT_ROWS}


def test_heldout_answer_kl_is_zero_without_eviction_and_uses_answer_tokens_2_to_R():
    model = tiny_model()
    rows = [dict(prompt_ids=rand_list(n, n), response_ids=rand_list(6, 100 + n)) for n in (40, 52)]
    heldout = [train.ground_truth(model, r, window=4) for r in rows]
    # the held-out answer KL on a compressed cache keeps the answer at positions S.. (not len(cache)..), and
    # counts answer tokens 2..R (metrics.forced_logprobs): the oracle's row at C = 8, computed by hand
    hand = []
    for cache, gt, extra in heldout:
        nxt = torch.tensor([len(cache)])
        small = lk.keep_slots(cache.copy(), lk.select(lk.stack_layers(train.group_mean(gt, model.config.num_key_value_heads)), 8))
        full = forced_logprobs(model, cache, extra["response"], nxt)
        assert full.shape[0] == 5  # 6 answer tokens, the first one the prefill's
        hand.append(answer_kl(full, forced_logprobs(model, small, extra["response"], nxt)))
    torch.manual_seed(0)
    plain = LookaheadModule(model.config, n_tokens=4, embed_std=0.5)
    got = train.heldout_metrics(model, plain, heldout, budget=8, window=4, answer_kl_rows=("oracle",))
    assert got["answer_kl_oracle@8"] == pytest.approx(sum(hand) / len(hand), rel=1e-5)
    torch.manual_seed(0)
    module = LookaheadModule(model.config, n_tokens=4, embed_std=0.5, pool="avg", kernel=5)
    r = train.heldout_metrics(model, module, heldout, budget=8, window=4, budgets=(8, 64),
                              answer_kl_rows=tuple(train.HELDOUT_ROWS))
    for m in train.HELDOUT_ROWS:
        assert abs(r[f"answer_kl_{m}@64"]) < 1e-5  # C >= S: nothing evicted, the same distributions
        assert r[f"answer_kl_{m}@8"] > 1e-4  # 8 of 40-52 slots: the answer changes
    assert "answer_kl_snapkv@8" not in train.heldout_metrics(model, module, heldout, budget=8, window=4, budgets=(8,),
                                                             answer_kl_rows=("lookahead",))


def test_recomputed_prompt_caches_train_like_stored_ones(model_dir, tmp_path, stub_prompts):
    """--store-dtype none keeps only the targets and recomputes each prompt's cache in the step
    (prompt_cache): the same adapter as caches kept on disk in float32, and sample files without k, v."""
    stored, recomputed = tmp_path / "stored", tmp_path / "recomputed"
    for out in (stored, recomputed):
        write_data(out, model_dir)
    train.main(argv(model_dir, stored, "--store-dtype", "float32"))
    train.main(argv(model_dir, recomputed, "--store-dtype", "none"))
    files = sorted((recomputed / "samples").glob("*.safetensors"))
    assert files and all(set(load_file(str(f))) == {"target"} for f in files)
    pa, pb = adapter(stored / "adapter.safetensors"), adapter(recomputed / "adapter.safetensors")
    for k in pa:
        assert torch.allclose(pa[k], pb[k], atol=1e-5), k


def test_heldout_ground_truth_is_kept_and_read_back(tmp_path):
    """heldout_ground_truth writes each row's ground truth once (OUT/heldout) and a second call reads
    it back: the same cache, target and baseline scores as computing it again."""
    model = tiny_model()
    rows = [dict(id=f"h{n}", prompt_ids=rand_list(n, n), response_ids=rand_list(5, 100 + n)) for n in (20, 27)]
    first = train.heldout_ground_truth(model, rows, 4, tmp_path)
    assert len(list((tmp_path / "heldout").glob("*.pt"))) == 2
    again = train.heldout_ground_truth(model, rows, 4, tmp_path)
    fresh = [train.ground_truth(model, r, 4) for r in rows]
    for (c1, g1, e1), (c2, g2, e2) in zip(again, fresh):
        for l in range(len(c1.k)):
            assert torch.equal(c1.k[l], c2.k[l]) and torch.equal(c1.v[l], c2.v[l])
            assert torch.equal(g1[l], g2[l]) and torch.equal(e1["snapkv"][l], e2["snapkv"][l])
        assert torch.equal(e1["response"], e2["response"])
        assert torch.allclose(e1["surprisal"], e2["surprisal"]) and e1["surprisal"].shape == (1, len(c1))
    assert [len(c) for c, _, _ in first] == [20, 27]
    # a file written before the span rule (no surprisal) is made again on its first read, surprisal included
    path = next((tmp_path / "heldout").glob("*.pt"))
    saved = torch.load(path)
    del saved["extra"]["surprisal"]
    torch.save(saved, path)
    train.heldout_ground_truth(model, rows, 4, tmp_path)
    added = torch.load(path)["extra"]["surprisal"]
    assert any(added.shape == e["surprisal"].shape and torch.allclose(added, e["surprisal"]) for _, _, e in fresh)


def test_layer_sensitivity_writes_weights_and_an_adapter_with_budgets(model_dir, tmp_path, stub_prompts, capsys):
    """examples/layer_sensitivity.py on a tiny run: per layer a gain and a weight (mean 1, the floor kept),
    the softer budgets (mean 1), and a copy of the adapter whose .json carries those budgets."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("layer_sensitivity", REPO / "examples" / "layer_sensitivity.py")
    ls = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ls)
    out = tmp_path / "s"
    write_data(out, model_dir)
    train.main(argv(model_dir, out))
    ls.main(["--out", str(out), "--adapter", str(out / "adapter.safetensors"), "--model", str(model_dir), "--rows", "3",
             "--budget", "6", "--group", "1", "--adapter-out", str(tmp_path / "lb.safetensors")])
    got = json.loads((out / "layer_weights.json").read_text())
    L = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    assert got["rows"] == 3 and len(got["gain"]) == len(got["weights"]) == len(got["budget"]) == L
    assert max(got["gain"]) > 0 and len(set(got["weights"])) > 1  # the adapter's choice costs something somewhere
    assert sum(got["weights"]) / L == pytest.approx(1.0) and min(got["weights"]) >= 0.25 - 1e-9
    assert sum(got["budget"]) / L == pytest.approx(1.0, abs=1e-3)
    order = sorted(range(L), key=lambda l: got["gain"][l])
    assert [got["weights"][l] for l in order] == sorted(got["weights"])  # a larger gain, a larger weight
    cfg = ModelConfig.from_hf_config(model_dir)
    back = LookaheadModule.load(tmp_path / "lb.safetensors", cfg)
    assert back.layer_budget == tuple(got["budget"])
    assert json.loads((tmp_path / "lb.json").read_text())["layer_budget_from"]["rows"] == 3
    a, b = adapter(out / "adapter.safetensors"), adapter(tmp_path / "lb.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same weights: only the budgets are new
    assert "layers  answer-KL gain" in capsys.readouterr().out
