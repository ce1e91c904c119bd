"""Tests of train.py: the target against transformers' explicit attention matrices, one optimiser loop
that must lower the loss, the training pass == the inference scorer, batching == one sample at a time,
and train.main end to end on a tiny random Llama folder (resume == uninterrupted run, --config recipes,
every bad input of issue 28 as one `error:` line before the model loads, and a
2-process gloo DDP run whose ranks end identical and equal to a 1-process run).

The end-to-end runs use a pre-written OUT/data.jsonl and replace data.make_training_prompts by a
stub that yields the same ids, so no document is read and no answer is generated."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from support import cli
from support import data, recipe
from support import recipe as train_recipe
import lookaheadkv as lk
import methods
import train
from baselines import full_answer
from eviction import EvictConfig, prefill_and_score
from extensions import layer_budgets
from lookaheadkv import LookaheadHook, LookaheadModule
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


def ground_truth(model, row):
    """One row's (cache, target {layer: (1, H, S)}, extra) as train.py's data stage makes them: FullKV's prefill
    (train.full_cache), then the answer's attention over it (train.answer_targets: lookaheadkv.answer_attention)."""
    prompt, response = torch.tensor([row["prompt_ids"]]), torch.tensor([row["response_ids"]])
    cache, _, next_pos = train.full_cache(model, prompt, None)
    target = train.answer_targets(model, cache, next_pos, [row["response_ids"]])
    return cache, target, dict(prompt=prompt, response=response)


def batch_loss(model, module, cache, gt, lengths):
    """One micro-batch's loss as train.optimizer_step computes it: the M lookahead rows on each prompt's
    cache (at its own length) against the target, the paper's KL."""
    return lk.kl_loss(gt, lk.lookahead_pass(model, module, cache, lengths, per_query_head=True))


def group_mean(scores, n_kv_heads):
    """Per-query-head scores (B, H, S) -> per-KV-head (B, H_kv, S), as eviction uses them."""
    return {l: s.view(s.shape[0], n_kv_heads, -1, s.shape[-1]).mean(2) for l, s in scores.items()}


def write_samples(model, rows, folder):
    """Each row's sample file (its prompt cache and target, float32) in folder; their paths."""
    paths = []
    for i, r in enumerate(rows):
        cache, gt, _ = ground_truth(model, r)
        paths.append(folder / f"{i}.safetensors")
        data.save_sample(paths[-1], dict(k=torch.cat(cache.k), v=torch.cat(cache.v),
                                         target=torch.cat([gt[l] for l in range(len(gt))])), torch.float32)
    return paths


def test_parse_targets():
    assert recipe.parse_targets("all") == LookaheadModule.TARGETS and len(recipe.parse_targets("all")) == 7
    assert recipe.parse_targets("q_proj, k_proj") == ("q_proj", "k_proj")
    assert recipe.parse_targets("none") == () == recipe.parse_targets("")
    with pytest.raises(ValueError, match="--targets: unknown qq"):
        recipe.parse_targets("q_proj,qq")


# -----------------------------------------------------------------------------
# the target against transformers' explicit attention matrices


@pytest.fixture(scope="module")
def hf_folder(tiny_hf_model):
    return tiny_hf_model("llama")


def test_target_equals_explicit_attention(hf_folder):
    """gt[l] (1, H, S) = mean over the answer's rows of the causal softmax over prompt + answer,
    columns = the prompt; SnapKV's and H2O's scores from the same matrix. Reference: HF eager attention
    with output_attentions (an independent implementation of the whole model)."""
    from transformers import AutoModelForCausalLM

    model = load_model(hf_folder)
    cfg = model.config
    hf = AutoModelForCausalLM.from_pretrained(hf_folder, attn_implementation="eager").eval()
    S, R, W = 40, 9, 32
    row = dict(prompt_ids=rand_list(S, 1), response_ids=rand_list(R, 2))
    cache, gt, extra = ground_truth(model, row)
    with torch.no_grad():
        att = hf(torch.tensor([row["prompt_ids"] + row["response_ids"]]), output_attentions=True).attentions
    # SnapKV's and H2O's scores from one prefill watched by both (what harness.heldout_metrics runs)
    snap, heavy = prefill_and_score(model, torch.tensor([row["prompt_ids"]]),
                                    [methods.make_scorer(EvictConfig(m, W + 1, window=W)) for m in ("snapkv", "h2o")])
    G = cfg.num_attention_heads // cfg.num_key_value_heads
    group = lambda x: x.view(1, cfg.num_key_value_heads, G, S).mean(2)  # noqa: E731
    assert len(cache) == S and len(gt) == cfg.num_hidden_layers
    for l, A in enumerate(att):  # A (1, H, S+R, S+R)
        assert gt[l].shape == (1, cfg.num_attention_heads, S)
        assert torch.allclose(gt[l], A[:, :, S:, :S].mean(2), atol=1e-5), l
        assert (gt[l].sum(-1) < 1).all()  # the answer attends to itself too: mass on the prompt < 1
        assert torch.allclose(snap.scores[l], group(A[:, :, S - W:S, :S].mean(2)), atol=1e-5)
        h2o = group(A[:, :, :S, :S].sum(2)) / (S - torch.arange(S))
        assert torch.allclose(heavy.scores[l], h2o, atol=1e-5)
    # the cache is the prompt's KV exactly (train.full_cache, what the data stage prefills, builds the same)
    full, _, _ = train.full_cache(model, torch.tensor([row["prompt_ids"]]), None)
    for l in range(cfg.num_hidden_layers):
        assert torch.allclose(cache.k[l], full.k[l], atol=1e-5) and torch.allclose(cache.v[l], full.v[l], atol=1e-5)
    # the oracle's scores (answer_attention per KV head) are the GQA mean of the same target
    oracle = lk.answer_attention(model, full, torch.tensor([row["response_ids"]]), torch.tensor([S]))
    for l, g in group_mean(gt, cfg.num_key_value_heads).items():
        assert torch.allclose(oracle[l], g, atol=1e-5)


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
    cache, gt, _ = ground_truth(model, row)
    k0 = [k.clone() for k in cache.k]
    pred = lk.lookahead_pass(model, mod, cache, S, per_query_head=True)
    assert len(cache) == S and all(torch.equal(a, b) for a, b in zip(k0, cache.k))  # not appended to
    # the same scores as inference: one pass over [prompt; P] with LookaheadHook, GQA-mean
    ids = torch.tensor([row["prompt_ids"]])
    hook = LookaheadHook(mod, S)
    with torch.no_grad():
        x = torch.cat([model.model.embed_tokens(ids), mod.embeddings[None]], 1)
        model(inputs_embeds=x, positions=torch.arange(S + 8)[None], hook=hook)
    for l, g in group_mean(pred, cfg.num_key_value_heads).items():
        assert torch.allclose(g, hook.scores[l], atol=1e-5)
    # gradients reach the module only
    lk.kl_loss(gt, pred).backward()
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
    micro = [(c, gt, torch.tensor([len(c)])) for c, gt, _ in (ground_truth(model, r) for r in rows)]
    opt = torch.optim.AdamW(mod.parameters(), lr=1e-2)
    losses = [train.optimizer_step(mod, opt, model, micro, 2, clip=1.0).item() for _ in range(8)]
    with torch.no_grad():
        final = sum(batch_loss(model, mod, *m).item() for m in micro) / 2
    assert final < 0.8 * losses[0], losses + [final]
    assert final > 0


def test_lr_schedule():
    cfg = train.TrainConfig(lr=1e-3, warmup=0.1)
    lrs = [train.lr_at(s, 100, cfg) for s in range(100)]
    assert lrs[:10] == pytest.approx([1e-3 * (s + 1) / 10 for s in range(10)])  # linear warmup
    assert lrs[10] == pytest.approx(1e-3) and lrs[55] == pytest.approx(0.5e-3)  # cosine, half way
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and lrs[-1] < 1e-6


# -----------------------------------------------------------------------------
# settings: flag > --config file > TrainConfig default


def test_config_file_and_flags(tmp_path):
    assert train.get_args([]) == train.TrainConfig()
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps(dict(n_train=10, lr=0.5, epochs=2, copy_frac=None, rule="max:7", resume=True)))
    cfg = train.get_args(["--config", str(recipe), "--lr", "0.25"])
    assert (cfg.n_train, cfg.lr, cfg.epochs, cfg.rule, cfg.resume) == (10, 0.25, 2, "max:7", True)  # the flag wins
    assert cfg.batch == train.TrainConfig.batch  # neither: the default
    # the shipped recipes are valid and say what their docstring says
    cpu = train.get_args(["--config", str(REPO / "research" / "configs" / "train-cpu.json")])
    assert (cpu.n_train, cpu.n_heldout, cpu.max_new_tokens, cpu.long_frac, cpu.gen_batch, cpu.epochs,
            cpu.eval_every, cpu.save_every) == (1000, 64, 128, 0.05, 16, 2, 25, 5)
    gpu = train.get_args(["--config", str(REPO / "research" / "configs" / "train-gpu.json")])
    assert (gpu.n_train, gpu.n_heldout, gpu.max_tokens, gpu.max_new_tokens, gpu.gen_batch, gpu.micro_batch,
            gpu.epochs, gpu.store_dtype) == (8000, 128, 4096, 256, 64, 32, 2, "none")
    # a bad file: one line naming the file and the key
    for text, match in [('{"n_trian": 3}', "unknown key 'n_trian'"), ('{"n_train": "3"}', "'n_train' must be int"),
                        ('{"n_train": 2.5}', "'n_train' must be int"), ('{"lr": true}', "'lr' must be float"),
                        ('{"resume": 1}', "'resume' must be bool"), ('[1]', "holds a JSON list, not an object"),
                        ('{"lr": ', "not valid JSON")]:
        recipe.write_text(text)
        with pytest.raises(SystemExit, match=rf"^error: --config {recipe}:? .*{match}"):
            train.main(["--config", str(recipe)])
    with pytest.raises(SystemExit, match=r"^error: --config .*nope.json: no such file"):
        train.main(["--config", str(tmp_path / "nope.json")])


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


def argv(model_dir, out, *extra, **recipe):
    """A tiny run's command line; its recipe (TrainConfig fields that are not flags) in a --config file, with
    prompt lengths that fit the tiny model's context of 512 (train.check_fit)."""
    path = Path(out).parent / f"recipe-{Path(out).name}.json"
    fit = dict(min_tokens=16, max_tokens=64, long_max=128)
    path.write_text(json.dumps({**dict(n_tokens=8, warmup=0.25), **fit, **recipe}))
    return ["--config", str(path), "--model", str(model_dir), "--out", str(out), "--n-train", "4", "--n-heldout",
            "1", "--batch", "2", "--epochs", "2", "--lr", "1e-2", "--micro-batch", "1", "--eval-every", "100",
            "--save-every", "100", "--device", "cpu", *extra]


@pytest.fixture
def stub_prompts(monkeypatch):
    monkeypatch.setattr(data, "make_training_prompts", fake_prompts)


def adapter(path):
    return load_file(str(path))


def error_line(excinfo):
    """The one line a SystemExit from train.main carries."""
    text = str(excinfo.value)
    assert text.startswith("error: ") and "\n" not in text, text
    return text


class Interrupted(Exception):
    pass


def test_resume_equals_uninterrupted_run(model_dir, tmp_path, stub_prompts, monkeypatch, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        write_data(out, model_dir)
    train.main(argv(model_dir, a))  # 4 steps straight (4 samples / batch 2 x 2 epochs)
    meta_a = json.loads((a / "adapter.json").read_text())
    assert meta_a["steps"] == 4 and "rule" not in meta_a  # nothing recommended beyond the paper's form

    # run B: checkpoint every step, killed right after step 2's checkpoint
    orig_save = recipe.save_checkpoint

    def save_then_die(path, module, opt, step, log, settings=None):
        orig_save(path, module, opt, step, log, settings)
        if step == 2:
            raise Interrupted

    monkeypatch.setattr(recipe, "save_checkpoint", save_then_die)
    with pytest.raises(Interrupted):
        train.main(argv(model_dir, b, "--save-every", "1"))
    monkeypatch.setattr(recipe, "save_checkpoint", orig_save)
    assert not (b / "adapter.safetensors").exists()
    ck = torch.load(b / "ckpt.pt", weights_only=True)
    assert ck["step"] == 2
    # a resume with settings the checkpoint was not made with is refused, naming them, and changes nothing
    with pytest.raises(SystemExit, match=r"^error: --resume: .*ckpt.pt was made with other settings: --batch 2 "
                                         r"\(this run: 4\); --lr 0.01 \(this run: 0.02\)"):
        train.main(argv(model_dir, b, "--resume", "--batch", "4", "--lr", "2e-2"))
    assert torch.load(b / "ckpt.pt", weights_only=True)["step"] == 2 and not (b / "adapter.safetensors").exists()
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
    # and the logged validation KL ran on the untrained module (step 0) and at the end
    log = [json.loads(line) for line in (a / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [0, 4] and all(r["kl"] >= 0 for r in log)
    assert meta_a["heldout"] == log[-1] and meta_a["untrained"] == log[0]
    # a rerun without --resume says it replaces the checkpoint, and that it replaces the adapter (kept as .prev)
    capsys.readouterr()
    train.main(argv(model_dir, a))
    said = capsys.readouterr().out
    assert "--resume was not given" in said and "adapter.prev.safetensors" in said
    assert adapter(a / "adapter.prev.safetensors").keys() == pa.keys()
    assert all(torch.equal(adapter(a / "adapter.prev.safetensors")[k], pa[k]) for k in pa)
    assert json.loads((a / "adapter.prev.json").read_text()) == meta_a


def test_interrupt_says_how_to_resume(model_dir, tmp_path, stub_prompts, monkeypatch):
    """Ctrl-C (or SIGTERM, which cli.run turns into the same) mid-training: one line with the command that resumes."""
    out = tmp_path / "i"
    write_data(out, model_dir)

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "optimizer_step", interrupt)
    args = argv(model_dir, out)
    with pytest.raises(SystemExit) as e:
        train.main(args)
    text = str(e.value)
    assert text.startswith("interrupted:") and "\n" not in text
    assert text.endswith("python train.py " + " ".join(args) + " --resume")


def test_stage_train_without_samples_says_to_run_the_data_stage(model_dir, tmp_path, stub_prompts):
    with pytest.raises(SystemExit, match=r"^error: --n-train 0: must be a number >= 1$"):  # before the model loads
        train.main(argv(model_dir, tmp_path / "o", "--n-train", "0", "--n-heldout", "0"))
    write_data(tmp_path / "o", model_dir)  # rows, but no sample file written yet
    with pytest.raises(SystemExit) as e:
        train.main(argv(model_dir, tmp_path / "o", "--stage", "train", "--adapter-out", str(tmp_path / "x.safetensors")))
    assert "no training samples" in error_line(e) and "--stage data" in error_line(e)


def test_data_from_another_base_model_is_refused(model_dir, tmp_path, stub_prompts):
    write_data(tmp_path / "o", model_dir, fingerprint="0123456789abcdef", base_model="OtherModel-1B")
    with pytest.raises(SystemExit, match=r"made with another base model \(OtherModel-1B\)"):
        train.main(argv(model_dir, tmp_path / "o"))


def test_checkpoint_corrupt_or_of_other_settings(model_dir, tmp_path, monkeypatch):
    out = tmp_path / "o"
    write_data(out, model_dir)
    guard_loading(monkeypatch)  # every case below stops before the model loads
    (out / "ckpt.pt").write_bytes(b"\x80\x04 this is not a checkpoint" * 20)
    with pytest.raises(SystemExit) as e:
        train.main(argv(model_dir, out, "--resume"))
    assert "is corrupt" in error_line(e) and "ckpt.pt" in error_line(e)
    # a checkpoint of another model's module
    other = LookaheadModule(ModelConfig(**{**TINY, "hidden_size": 32}), n_tokens=8)
    recipe.save_checkpoint(out / "ckpt.pt", other, torch.optim.AdamW(other.parameters()), 1, [])
    with pytest.raises(SystemExit, match="was trained for tiny"):
        train.main(argv(model_dir, out, "--resume"))
    # a valid checkpoint made with another rank and targets: named, and not called corrupt
    cfg = ModelConfig.from_hf_config(model_dir)
    mine = LookaheadModule(cfg, n_tokens=8, rank=8, targets=("q_proj", "k_proj"))
    recipe.save_checkpoint(out / "ckpt.pt", mine, torch.optim.AdamW(mine.parameters()), 1, [])
    with pytest.raises(SystemExit) as e:
        train.main(argv(model_dir, out, "--resume", "--targets", "q_proj"))
    line = error_line(e)
    assert "other settings" in line and "targets" in line and "It is not corrupt" in line and "rank" not in line
    assert (out / "ckpt.pt").exists()


def guard_loading(monkeypatch):
    """Any attempt to load the model's weights fails the test (train.py's loader, and cli.load's)."""
    from support import cli

    monkeypatch.setattr(cli, "load", no_model)
    monkeypatch.setattr(train, "load_model", no_model)


def no_model(*a, **k):
    pytest.fail("the model must not load for this input")


def test_bad_flags_and_paths_stop_before_the_model_loads(model_dir, tmp_path, monkeypatch):
    """Issue 28: each class of bad input ends in one `error:` line naming the flag or file, before the model
    loads, and nothing that was there is touched."""
    out = tmp_path / "o"
    write_data(out, model_dir)
    guard_loading(monkeypatch)
    weights = tmp_path / "w.json"
    weights.write_text("precious")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    cases = [
        (["--lr", "nan"], "--lr nan"), (["--epochs", "inf"], "--epochs inf"), (["--max-minutes", "-1"], "--max-minutes"),
        (["--adapter-out", str(weights)], "must end in .safetensors"),
        (["--adapter-out", str(a_file / "a.safetensors")], "--adapter-out (its folder)"),
        (["--out", str(a_file)], f"--out {a_file} is a file"),
        (["--targets", "q_proj,nope"], "--targets"),
    ]
    for extra, says in cases:
        with pytest.raises(SystemExit) as e:
            train.main(argv(model_dir, out, *extra))
        assert says in error_line(e), (extra, str(e.value))
    for key, value, says in [("long_frac", float("nan"), "long_frac nan"), ("rule", "span:x", "selection rule"),
                             ("store_dtype", "int8", "store_dtype"), ("clip", 0, "clip 0")]:
        with pytest.raises(SystemExit) as e:
            train.main(argv(model_dir, out, **{key: value}))
        assert says in error_line(e), key
    assert weights.read_text() == "precious" and a_file.read_text() == "x"


@pytest.mark.parametrize("recipe, flags, says", [
    (dict(adapter_out=""), [], "--adapter-out '' is empty"),  # wrote OUT/adapter.safetensors, before
    (dict(), ["--out", ""], "--out '' is empty"),  # wrote into the current folder, before
    (dict(seed=2**64), [], "--seed 18446744073709551616: must be a whole number"),  # "Overflow when unpacking"
    (dict(), ["--batch", "10", "--micro-batch", "8"], "--batch 10 is not a whole number of micro-batches of 8"),
    (dict(rank=10**6), [], "rank 1000000: at most TinyLlama's hidden size 64"),  # the memory, when training began
    (dict(long_max=4096), ["--n-train", "5"], "long_max 4096 + 64 (the chat template) + --max-new-tokens 256 is 4416 "
                                               "tokens, past TinyLlama's context of 512: lower long_max"),
    (dict(n_tokens=500), [], "data.jsonl's longest prompt (48 tokens) with the M lookahead rows after it is past "
                             "TinyLlama's context of 512: lower n_tokens"),  # RoPE past the context, without a word
    (dict(), ["--n-train", str(10**9)], "--n-train 1000000000, --n-heldout 1: the training samples and the "
                                        "held-out ground truth would take at least "),  # once every prompt was made
    (dict(), ["--n-heldout", str(10**9)], "--n-heldout 1000000000: the training samples and the held-out ground "
                                          "truth would take at least "),  # (days), before
], ids=["adapter-out-empty", "out-empty", "seed-too-large", "batch-not-micro-batches", "rank-past-hidden", "prompts-past-context", "lookahead-past-context",
        "n-train-past-disk", "n-heldout-past-disk"])
def test_recipe_values_that_failed_late_or_silently_stop_before_the_model_loads(model_dir, tmp_path, monkeypatch,
                                                                              recipe, flags, says):
    """Issue 37: recipe values (a --config key, or its flag) that were taken without a word, or failed only after
    the data stage, are one `error:` line naming the key before the model loads; OUT is left as it was."""
    out = tmp_path / "o"
    write_data(out, model_dir)
    before = {f: f.read_bytes() for f in out.rglob("*") if f.is_file()}
    guard_loading(monkeypatch)
    monkeypatch.chdir(tmp_path)
    args = argv(model_dir, out, *flags, **recipe)
    if "--out" in flags:  # the one given last wins
        args = args[:args.index("--out")] + args[args.index("--out") + 2:]
    with pytest.raises(SystemExit) as e:
        train.main(args)
    assert says in error_line(e)
    assert {f: f.read_bytes() for f in out.rglob("*") if f.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o", "recipe-o.json"]


def test_a_batch_below_the_micro_batch_is_one_micro_batch_of_it():
    """The docstring's smoke run (--batch 4, micro_batch 8 by default) trained on 8 samples a step: now 4."""
    cfg = train.resolved(train.TrainConfig(batch=4))
    recipe.check_numbers(cfg)
    assert (cfg.batch, cfg.micro_batch) == (4, 4)
    recipe.check_numbers(cfg := train.resolved(train.TrainConfig(batch=32, micro_batch=8)))
    assert (cfg.batch, cfg.micro_batch) == (32, 8)


def test_adapter_out_json_is_refused_and_left_untouched(model_dir, tmp_path):
    """One `error:` line naming the flag, before anything loads, and the .json there untouched (the process
    contract itself, exit 1 with that line on stderr, is tested once per script in tests/test_cli.py)."""
    weights = tmp_path / "x.json"
    weights.write_text("{}")
    with pytest.raises(SystemExit) as e:
        train.main(["--model", str(model_dir), "--out", str(tmp_path / "o"), "--adapter-out", str(weights),
                    "--device", "cpu"])
    assert error_line(e).startswith(f"error: --adapter-out {weights}") and "\n" not in error_line(e)
    assert weights.read_text() == "{}"


# -----------------------------------------------------------------------------
# issue 53: runs that mixed with another run, data of another dtype, outputs written only at the end


def own_checkpoint(model_dir, out, *flags, **recipe):
    """OUT/ckpt.pt as the run of argv(model_dir, out, *flags, **recipe) saves it (its checked settings), without
    training; (its path, its bytes)."""
    cfg = train.resolved(train.get_args(argv(model_dir, out, *flags, **recipe)))
    (out / "ckpt.pt").unlink(missing_ok=True)
    train_recipe.check(cfg, train.parser())
    module = LookaheadModule(ModelConfig.from_hf_config(model_dir), n_tokens=cfg.n_tokens, rank=cfg.rank,
                             alpha=cfg.alpha, targets=train_recipe.parse_targets(cfg.targets))
    train_recipe.save_checkpoint(out / "ckpt.pt", module, torch.optim.AdamW(module.parameters()), 1, [],
                          train_recipe.schedule_of(cfg))
    return out / "ckpt.pt", (out / "ckpt.pt").read_bytes()


@pytest.mark.parametrize("flags, recipe, says", [
    (["--micro-batch", "1"], {}, "--micro-batch 2 (this run: 1)"),  # resumed without a word
    (["--n-train", "8"], {}, "--n-train 6 (this run: 8)"),  # resumed without a word, after answering 2 more prompts
    (["--dtype", "bfloat16"], {}, '--dtype "float32" (this run: "bfloat16")'),  # a step, then a traceback
    ([], dict(warmup=0.5), "warmup 0.25 (this run: 0.5)"),  # a recipe key without a flag: named as the key
    ([], dict(rule="max:7"), 'rule null (this run: "max:7")'),
], ids=["micro-batch", "n-train", "dtype", "recipe-key", "rule"])
def test_resume_with_any_other_setting_is_refused_naming_it(model_dir, tmp_path, monkeypatch, flags, recipe, says):
    """Issue 53: the checkpoint records every setting that defines the run (recipe.resume_keys(train.TrainConfig)); --resume with one
    that differs is one line naming its flag (or recipe key) and both values, before the model loads."""
    out = tmp_path / "o"
    write_data(out, model_dir, n_train=6)
    path, before = own_checkpoint(model_dir, out, "--n-train", "6", "--micro-batch", "2")
    guard_loading(monkeypatch)
    with pytest.raises(SystemExit) as e:
        train.main(argv(model_dir, out, "--n-train", "6", "--micro-batch", "2", "--resume", *flags, **recipe))
    assert error_line(e).startswith(f"error: --resume: {path} was made with other settings: {says}. It is not corrupt")
    assert path.read_bytes() == before and not (out / "log.jsonl").exists()


def test_every_setting_that_defines_the_run_is_recorded_and_compared(model_dir, tmp_path, monkeypatch):
    """The mechanism, key by key: a checkpoint whose recorded value of any RESUME_KEYS field is not this run's is
    refused naming that field's flag; the fields a resume may change (MAY_CHANGE) are the only others."""
    import dataclasses

    out = tmp_path / "o"
    write_data(out, model_dir)
    path, _ = own_checkpoint(model_dir, out)
    ck = torch.load(path, weights_only=True)
    fields = {f.name for f in dataclasses.fields(train.TrainConfig)}
    assert set(ck["settings"]) == set(recipe.resume_keys(train.TrainConfig)) == fields - set(recipe.MAY_CHANGE) - set(recipe.MODULE_KEYS)
    assert {"micro_batch", "n_train", "dtype", "rule", "store_dtype"} <= set(recipe.resume_keys(train.TrainConfig))
    guard_loading(monkeypatch)
    for key in recipe.resume_keys(train.TrainConfig):
        torch.save(dict(ck, settings=dict(ck["settings"], **{key: "OTHER"})), path)
        with pytest.raises(SystemExit) as e:
            train.main(argv(model_dir, out, "--resume"))
        assert f'other settings: {recipe.flag_of(key, train.parser())} "OTHER" (this run: ' in error_line(e), key


def test_out_holding_another_runs_checkpoint_is_refused_without_resume(model_dir, tmp_path, monkeypatch, capsys):
    """Issue 53: without --resume a run replaced OUT/ckpt.pt at its first checkpoint and appended to OUT/log.jsonl,
    whoever's they were. Another run's checkpoint (other settings, another model, or not one at all) is refused;
    this run's own (the same settings) is still started over, as it says."""
    out = tmp_path / "o"
    write_data(out, model_dir)
    path, before = own_checkpoint(model_dir, out, "--lr", "0.05")
    guard_loading(monkeypatch)
    with pytest.raises(SystemExit) as e:
        train.main(argv(model_dir, out))
    assert error_line(e) == (f"error: --out {out} holds another run's checkpoint ({path}: made with other settings: "
                             f"--lr 0.05 (this run: 0.01)): pass another --out, continue that run with its own "
                             f"settings and --resume, or delete {path} to start this one over there")
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit) as e:
        train.main(argv(model_dir, out))
    assert "holds another run's checkpoint" in error_line(e) and "cannot read as a checkpoint" in error_line(e)
    assert path.read_bytes() == b"not a checkpoint" and not (out / "log.jsonl").exists()
    own_checkpoint(model_dir, out)  # this run's own: checked, and started over (None: nothing to resume)
    cfg = train.resolved(train.get_args(argv(model_dir, out)))
    recipe.check(cfg, train.parser())  # this run's own checkpoint passes the checks
    assert recipe.checkpoint_to_resume(cfg, out, ModelConfig.from_hf_config(model_dir), None,
                                             train.parser()) is None


def test_adapter_backups_never_replace_an_earlier_one(model_dir, tmp_path, capsys):
    """Issue 53: a second run on one --adapter-out copied the first one's adapter over .prev, losing the original,
    while saying "the previous one is kept". Each backup now takes the first free name, and the line names it."""
    cfg = ModelConfig.from_hf_config(model_dir)
    dest = tmp_path / "a.safetensors"
    for n in range(3):
        module = LookaheadModule(cfg, n_tokens=8)
        module.info = dict(run=n)
        recipe.save_adapter(module, dest)
    said = capsys.readouterr().out.splitlines()
    assert said == [f"{dest} existed: replaced; the previous one is kept as {tmp_path / 'a.prev.safetensors'} + "
                    f"{tmp_path / 'a.prev.json'}",
                    f"{dest} existed: replaced; the previous one is kept as {tmp_path / 'a.prev2.safetensors'} + "
                    f"{tmp_path / 'a.prev2.json'}"]
    runs = {name: json.loads((tmp_path / name).read_text())["run"] for name in ("a.prev.json", "a.prev2.json", "a.json")}
    assert runs == {"a.prev.json": 0, "a.prev2.json": 1, "a.json": 2}  # the first adapter is still there


def test_an_adapter_out_that_cannot_be_written_stops_before_the_model_loads(model_dir, tmp_path, monkeypatch):
    """Issue 53: --adapter-out where nothing can be written passed the checks (os.access says yes to root), trained
    to the end, then failed with nothing saved. A file is made and removed there first, and a folder in the place
    of a file the save writes (its .json) is named."""
    out = tmp_path / "o"
    write_data(out, model_dir)
    guard_loading(monkeypatch)
    if Path("/proc/self").exists():  # procfs: no file can be made in /proc, not even by root
        with pytest.raises(SystemExit) as e:
            train.main(argv(model_dir, out, "--adapter-out", "/proc/adapter.safetensors"))
        assert error_line(e).startswith("error: --adapter-out /proc/adapter.safetensors: this folder is not writable")
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "a.json").mkdir()
    with pytest.raises(SystemExit) as e:
        train.main(argv(model_dir, out, "--adapter-out", str(tmp_path / "w" / "a.safetensors")))
    assert error_line(e) == (f"error: --adapter-out {tmp_path / 'w' / 'a.safetensors'}: {tmp_path / 'w' / 'a.json'}, "
                             f"which this run writes, is a folder (or not a file): move it away, or pass another "
                             f"--adapter-out")
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["a.json"] and not (out / "ckpt.pt").exists()


def test_a_rule_wider_than_the_context_stops_before_the_model_loads(model_dir, tmp_path, monkeypatch):
    """Issue 53: "rule": "max:99999999999" passed the checks and hung at the first held-out check (a pooling window
    that wide). The recipe's rule is read by methods.parse_rule with the model's context."""
    out = tmp_path / "o"
    write_data(out, model_dir)
    guard_loading(monkeypatch)
    for rule, says in [("max:99999999999", "context of 512"), ("span:513", "context of 512"),
                       ("avg:513", "context of 512")]:
        with pytest.raises(SystemExit) as e:
            train.main(argv(model_dir, out, rule=rule))
        assert error_line(e).startswith(f"error: rule '{rule}' (the recipe's selection rule): ") and says in \
            error_line(e), rule
    cfg = ModelConfig.from_hf_config(model_dir)
    recipe.check_rule("span:512", cfg, methods.parse_rule), recipe.check_rule("max:511", cfg, methods.parse_rule)  # within TinyLlama's 512: taken


def test_a_truncated_sample_is_named_deleted_and_rebuilt(model_dir, tmp_path, stub_prompts):
    out = tmp_path / "t"
    write_data(out, model_dir)
    train.main(argv(model_dir, out, "--stage", "data"))
    files = sorted((out / "samples").glob("*.safetensors"))
    whole = files[1].read_bytes()
    files[1].write_bytes(whole[: len(whole) // 2])
    with pytest.raises(SystemExit) as e:
        train.main(argv(model_dir, out, "--stage", "train"))
    assert str(files[1]) in error_line(e) and "--stage data" in error_line(e)
    assert not files[1].exists()
    files[1].write_bytes(whole[:-3])  # cut short again; the data stage makes it again, saying so
    train.main(argv(model_dir, out, "--stage", "data"))
    assert files[1].read_bytes() == whole
    # one that goes bad mid-training (after the checks): named and deleted, not a traceback
    real = train.get_batch

    def cut(paths, *a):
        paths[0].write_bytes(b"\x00" * 20)
        return real(paths, *a)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "get_batch", cut)
        with pytest.raises(SystemExit) as e:
            train.main(argv(model_dir, out, "--stage", "train"))
    assert "training sample" in error_line(e) and "deleted" in error_line(e)


def test_embeddings_alone_without_lora_train(model_dir, tmp_path, stub_prompts):
    """--targets none: the ablation without a LoRA; only the M embeddings learn, and they do."""
    out = tmp_path / "n"
    write_data(out, model_dir)
    train.main(argv(model_dir, out, "--targets", "none", "--eval-every", "1"))
    meta = json.loads((out / "adapter.json").read_text())
    assert meta["targets"] == [] and meta["steps"] == 4
    weights = adapter(out / "adapter.safetensors")
    assert list(weights) == ["embeddings"]  # no LoRA tensors at all
    log = [json.loads(l) for l in (out / "log.jsonl").read_text().splitlines()]
    assert log[-1]["kl"] != log[0]["kl"]  # the embeddings moved the prediction
    cfg = ModelConfig.from_hf_config(model_dir)
    m = LookaheadModule.load(out / "adapter.safetensors", cfg)
    assert m.targets == () and m.delta(0, "q_proj", torch.zeros(1, 8, cfg.hidden_size)) is None


def test_a_killed_data_stage_resumes_and_rebuilds_missing_samples(model_dir, tmp_path, stub_prompts):
    out = tmp_path / "d"
    write_data(out, model_dir)
    train.main(argv(model_dir, out, "--stage", "data"))
    files = sorted((out / "samples").glob("*.safetensors"))
    assert len(files) == 4  # one per training row; held-out rows are checked from data.jsonl
    before = load_file(str(files[0]))
    files[0].unlink()  # as if the run died before writing it
    train.main(argv(model_dir, out, "--stage", "data"))
    after = load_file(str(files[0]))
    assert all(torch.equal(before[k], after[k]) for k in before)
    write_data(tmp_path / "e", model_dir)  # 4 samples of ~45 tokens: ~45 KB in bfloat16
    with pytest.raises(SystemExit, match="over store_gb"):
        train.main(argv(model_dir, tmp_path / "e", store_gb=0.00001))


def test_memory_warning_when_less_than_half_the_first_steps_peak_is_left():
    assert recipe.memory_warning(12, 7) is None  # 12.9 GB alone on this 24 GiB machine: no warning
    said = recipe.memory_warning(13, 5)  # beside the data job (5-6 GB): research/LOG.md 8.3's OOM kills
    assert "13.0 GiB" in said and "5.0 GiB left" in said
    assert cli.free_memory_gib("cpu") is None or cli.free_memory_gib("cpu") > 0
    assert recipe.peak_memory_gib() > 0


def test_copy_frac_reaches_the_training_prompts_only(model_dir, tmp_path, monkeypatch):
    asked = []

    def recording(tok, n, split="train", **kw):
        asked.append((split, kw["copy_frac"]))
        return fake_prompts(tok, n, split)

    monkeypatch.setattr(data, "make_training_prompts", recording)
    out = tmp_path / "c"
    write_data(out, model_dir)
    train.main(argv(model_dir, out, "--stage", "data", "--n-train", "5", "--max-new-tokens", "3", copy_frac=0.7))
    assert asked == [("train", 0.7), ("heldout", None)]  # held-out prompts keep the default mix
    assert len((out / "data.jsonl").read_text().splitlines()) == 6  # the one new row answered and appended


def test_new_module_is_the_seeded_untrained_module(model_dir):
    model = load_model(model_dir)
    cfg = train.TrainConfig(n_tokens=6, rank=4, targets="q_proj,v_proj", rule="max:3", seed=5)
    torch.manual_seed(123)  # whatever the global state: the seed decides the draw
    got = train.new_module(model, cfg)
    torch.manual_seed(5)
    want = lk.untrained_module(model, 6, 4, cfg.alpha, ("q_proj", "v_proj"))
    assert got.metadata() == {**want.metadata(), "rule": "max:3"} and got.targets == ("q_proj", "v_proj")
    assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(), want.state_dict().values()))
    assert train.new_module(model, train.TrainConfig()).targets == LookaheadModule.TARGETS  # targets all


def test_recomputed_prompt_caches_train_like_stored_ones(model_dir, tmp_path, stub_prompts):
    """store_dtype none keeps only the targets and recomputes each prompt's cache in the step
    (prompt_cache): the same adapter as caches kept on disk in float32, and sample files without k, v."""
    stored, recomputed = tmp_path / "stored", tmp_path / "recomputed"
    for out in (stored, recomputed):
        write_data(out, model_dir)
    train.main(argv(model_dir, stored, store_dtype="float32"))
    train.main(argv(model_dir, recomputed, store_dtype="none"))
    files = sorted((recomputed / "samples").glob("*.safetensors"))
    assert files and all(set(load_file(str(f))) == {"target"} for f in files)
    pa, pb = adapter(stored / "adapter.safetensors"), adapter(recomputed / "adapter.safetensors")
    for k in pa:
        assert torch.allclose(pa[k], pb[k], atol=1e-5), k


# -----------------------------------------------------------------------------
# DDP on CPU (gloo)

WRAPPER = """
import os, sys
sys.path.insert(0, os.environ["LKV_REPO"])
import torch
from support import data
import train
sys.path.insert(0, os.environ["LKV_TESTS"])
from test_train import fake_prompts
data.make_training_prompts = fake_prompts
made = []
new_module = train.new_module

def recording(model, cfg):  # to save every rank's final module (train.py saves rank 0's)
    made.append(new_module(model, cfg))
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
    r0, r1 = torch.load(ddp / "rank0.pt", weights_only=True), torch.load(ddp / "rank1.pt", weights_only=True)
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
        assert s["response_ids"] == full_answer(model, torch.tensor([p]), 6, {stop})[1][0]  # FullKV's answer
        cache, gt, _ = ground_truth(model, dict(prompt_ids=p, response_ids=s["response_ids"]))
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
        cache, gt, _ = ground_truth(model, r)
        per_sample.append(batch_loss(model, mod, cache, gt, len(cache)))
    mean = sum(per_sample) / 3
    mean.backward()
    # (None: the last layer's v/o/MLP LoRA, which no score reads)
    grad = lambda p: torch.zeros_like(p) if p.grad is None else p.grad.clone()  # noqa: E731
    grads = {n: grad(p) for n, p in mod.named_parameters()}
    assert sum(g.abs().sum() > 0 for g in grads.values()) > len(grads) / 2
    mod.zero_grad()
    cache, gt, lengths = train.get_batch(paths, "cpu", torch.float32)
    assert lengths.tolist() == [20, 33, 27] and cache.k[0].shape[2] == 33
    loss = batch_loss(model, mod, cache, gt, lengths)
    assert loss.item() == pytest.approx(mean.item(), rel=1e-5)
    loss.backward()
    for n, p in mod.named_parameters():
        assert torch.allclose(grad(p), grads[n], atol=1e-6), n
    mod.zero_grad(set_to_none=True)

    # optimizer_step: micro-batches of 1 and 2 samples, each sample weighing 1/3 of the step; SGD with lr 1
    # moves every parameter by minus the gradient of the mean (no clipping at 1e9)
    before = {n: p.detach().clone() for n, p in mod.named_parameters()}
    micro = [train.get_batch(paths[:1], "cpu", torch.float32), train.get_batch(paths[1:], "cpu", torch.float32)]
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




def test_a_non_finite_loss_stops_the_run_keeping_the_last_good_checkpoint(model_dir, tmp_path, stub_prompts,
                                                                         monkeypatch):
    """A step whose loss is nan (a bad adapter, a bad sample) steps nothing: one error line, exit 1, the last
    checkpoint as it was, and no adapter written from the bad weights."""
    out = tmp_path / "run"
    write_data(out, model_dir)
    real, calls = train.kl_loss, []

    def nan_at_step_3(*a):
        if torch.is_grad_enabled():  # a training step's, not the validation's
            calls.append(1)
        loss = real(*a)
        return loss * float("nan") if len(calls) > 4 else loss  # micro-batch 1, 2 per step: step 3 on

    monkeypatch.setattr(train, "kl_loss", nan_at_step_3)
    with pytest.raises(SystemExit, match=r"^error: the training loss or its gradient is not finite") as e:
        train.main(argv(model_dir, out, "--save-every", "1"))
    assert "\n" not in str(e.value)
    ck = torch.load(out / "ckpt.pt", weights_only=True)
    assert ck["step"] == 2 and all(torch.isfinite(t).all() for t in ck["module"].values())
    assert not (out / "adapter.safetensors").exists()


# -----------------------------------------------------------------------------
# extensions/answer_weights.py: a target weighted toward the answer queries that need the prompt's body


def test_answer_weights_of_uniform_tokens_are_the_papers_target_and_the_body_decides_the_rest():
    from extensions import answer_weights as aw

    model = tiny_model()
    row = dict(prompt_ids=rand_list(60, 1), response_ids=rand_list(7, 2))
    cache, gt, extra = ground_truth(model, row)
    S, R = len(cache), len(row["response_ids"])
    next_pos = torch.tensor([S])
    same = aw.weighted_target(model, cache, extra["response"], next_pos, torch.ones(R))
    assert all(torch.allclose(same[l], gt[l], atol=1e-6) for l in gt)  # equal weights: the plain mean
    one = torch.zeros(R)
    one[2] = 1.0  # all the weight on query 2: its attention alone, as a 3-token answer's last query
    only = aw.weighted_target(model, cache, extra["response"], next_pos, one)
    three = lk.answer_attention(model, cache, extra["response"][:, :3], next_pos, per_query_head=True)
    two = lk.answer_attention(model, cache, extra["response"][:, :2], next_pos, per_query_head=True)
    assert all(torch.allclose(only[l], 3 * three[l] - 2 * two[l], atol=1e-5) for l in gt)
    d = aw.dependence(model, cache, extra["response"], next_pos)
    assert d.shape == (R,) and d[-1] == 0 and (d[:-1] > 0).all()  # a random model: every query needs the body
    short = dict(prompt_ids=rand_list(aw.N_SINK + aw.WINDOW, 3), response_ids=rand_list(5, 4))
    c2, _, e2 = ground_truth(model, short)
    assert aw.dependence(model, c2, e2["response"], torch.tensor([len(c2)])).abs().max() < 1e-6  # nothing evicted
    assert torch.equal(aw.token_weights(torch.zeros(4)), torch.ones(4))
    w = aw.token_weights(torch.tensor([0.0, 1.0, 3.0, 0.0]))
    assert torch.allclose(w, torch.tensor([0.25, 1.0, 2.5, 0.25])) and w.mean() == 1


@pytest.mark.parametrize("change, said", [
    (dict(out="DATA"), "--out .*: the source folder itself"),
    (dict(data="NOWHERE"), "--data .*NOWHERE: no data.jsonl there"),
    (dict(first="0"), "--first 0: must be"),
    (dict(first="99", out="FRESH"), "--first 99: .* holds 4 training rows"),
    (dict(weights="mean"), "invalid choice: 'mean'"),
    (dict(out="OTHER"), "holds a data stage of its own"),
    (dict(first="3"), "other settings: first 2 \\(this run: 3\\)"),
])
def test_answer_weights_mistakes_are_one_line(model_dir, tmp_path, stub_prompts, monkeypatch, change, said):
    from extensions import answer_weights as aw

    src, other = tmp_path / "data", tmp_path / "other"
    write_data(src, model_dir)
    write_data(other, model_dir)
    train.main(argv(model_dir, src, "--stage", "data"))
    flags = dict(data=str(src), out=str(tmp_path / "out"), first="2", weights="dependence")
    aw.main([x for k, v in flags.items() for x in (f"--{k}", v)] + ["--model", str(model_dir)])
    places = dict(DATA=str(src), OTHER=str(other), NOWHERE=str(tmp_path / "NOWHERE"), FRESH=str(tmp_path / "new"))
    flags.update({k: places.get(v, v) for k, v in change.items()})
    monkeypatch.setattr(cli, "load", no_model)  # each mistake is said before the model loads
    with pytest.raises(SystemExit) as e:
        aw.main([x for k, v in flags.items() for x in (f"--{k}", v)] + ["--model", str(model_dir)])
    assert re.search(said, error_line(e))


@pytest.mark.parametrize("recipe_values, flags, says", [
    (dict(), ["--lr", "1e30"], "--lr 1e+30: an AdamW step moves each parameter by about lr"),  # saved, then refused
    (dict(compare=10**9), [], "compare 1000000000: the held-out comparison's C must be from 1 to below the longest"),
    (dict(compare=0), [], "compare 0: the held-out comparison's C must be from 1"),  # skipped without a word
    (dict(), ["--targets", "none,q_proj"], "--targets none,q_proj: none (no LoRA) and LoRA targets"),  # 'none' dropped
], ids=["lr-overflows", "compare-past-every-prompt", "compare-0", "targets-contradict"])
def test_recipe_values_that_cannot_train_are_refused_before_work(model_dir, tmp_path, monkeypatch, recipe_values,
                                                                flags, says):
    """Issue 66: a value that trains into an artifact nothing can use, or a comparison of zeros, is one `error:`
    line before the model loads; OUT is left as it was."""
    out = tmp_path / "o"
    write_data(out, model_dir)
    before = {f: f.read_bytes() for f in out.rglob("*") if f.is_file()}
    guard_loading(monkeypatch)
    with pytest.raises(SystemExit) as e:
        train.main(argv(model_dir, out, *flags, **recipe_values))
    assert says in error_line(e)
    assert {f: f.read_bytes() for f in out.rglob("*") if f.is_file()} == before


def test_a_data_stage_past_the_free_disk_is_refused_before_work(model_dir, tmp_path, monkeypatch):
    """Issue 66: the disk check compared with store_gb only; a full disk was found after the data stage."""
    out = tmp_path / "o"
    write_data(out, model_dir)
    guard_loading(monkeypatch)
    monkeypatch.setattr(recipe, "free_disk", lambda path: 1024)  # 1 KiB free
    with pytest.raises(SystemExit) as e:
        train.main(argv(model_dir, out, "--n-train", "8"))
    # sizes in the unit that shows them (issue 76: "at least 0.0 GiB ... has 0.0 GiB free" said nothing)
    assert " on disk, and " in error_line(e) and "has 1.0 KiB free: free some space" in error_line(e)


def test_an_adapter_the_loader_would_refuse_is_not_saved(tmp_path):
    """Issue 66: lr 1e30 trained, said it saved an adapter, and generate.py refused it; now the loader's checks
    run before it is called saved, and nothing is written."""
    module = LookaheadModule(ModelConfig(**TINY), n_tokens=2, rank=1)
    with torch.no_grad():
        module.embeddings.fill_(1e30)
    dest = tmp_path / "a.safetensors"
    with pytest.raises(ValueError, match="the trained adapter is not usable, so it was not saved .*embeddings reach"):
        recipe.save_adapter(module, dest)
    assert not dest.exists() and not dest.with_suffix(".json").exists()


def test_samples_already_on_disk_do_not_count_against_the_free_space(tmp_path, monkeypatch):
    """A resumed data stage compares with the free space only what it has still to write: the samples made
    before the kill are on the disk already (counting them refused a resume that fits)."""
    cfg = train.TrainConfig(out=str(tmp_path))
    rows = [dict(id=f"r{i}", split="train", prompt_ids=list(range(64))) for i in range(4)]
    one = data.sample_bytes(ModelConfig(**TINY), 64, torch.bfloat16)
    for r in rows[:3]:  # three of the four made before the kill
        data.sample_path(tmp_path, r["id"]).parent.mkdir(parents=True, exist_ok=True)
        data.sample_path(tmp_path, r["id"]).write_bytes(b"x")
    monkeypatch.setattr(recipe, "free_disk", lambda path: 2 * one)
    recipe.check_store(cfg, ModelConfig(**TINY), rows, torch.bfloat16)  # one still to write: it fits
    data.sample_path(tmp_path, rows[0]["id"]).unlink()
    data.sample_path(tmp_path, rows[1]["id"]).unlink()
    with pytest.raises(ValueError, match="the training samples still to write would take"):
        recipe.check_store(cfg, ModelConfig(**TINY), rows, torch.bfloat16)  # three: they do not
