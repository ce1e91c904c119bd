"""Tests of research/train_lab.py: train.py with the research options (--data, --train-rows, --init,
--loss-weights, --group's shared-prefix data from research/fast_data.py, --stage budgets, the harness's
held-out line), end to end on the tiny random Llama folder of tests/test_train.py, and fast_data's
decode-time targets against lookaheadkv.answer_attention's (train.py's)."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: test_train's fixtures and helpers
import test_train as tt
from test_train import (StubTok, TINY, adapter, guard_loading, error_line, fake_prompts, ground_truth, model_dir,
                        no_model, rand_list, stub_prompts, tiny_model, write_data)

from support import cli, data, recipe
import methods
import eviction
import train
from baselines import full_answer
from extensions import layer_budgets
from lookaheadkv import LookaheadModule
from model import ModelConfig
from research import fast_data, train_lab


def argv(model_dir, out, *extra, **fields):
    """test_train's tiny run, with the held-out check's C and window (LabConfig's budget, window)."""
    return tt.argv(model_dir, out, *extra, **{**dict(budget=16, window=4), **fields})


def test_batched_targets_equal_one_forward_over_prompt_and_answer():
    """fast_data.answer_and_target sums the target while it decodes B prompts of different lengths,
    prefilled once together: each row's answer, target and cache equal answer_attention's single forward
    over [prompt; answer] (harness.ground_truth, train.py's target)."""
    model = tiny_model()
    prompts = [rand_list(n, 40 + n) for n in (30, 45, 38)]
    first = [fast_data.answer_and_target(model, StubTok(set()), [p], 6)[0]["response_ids"] for p in prompts]
    stop = first[1][2]  # a stop id that one row hits early, so the answers have different lengths
    samples = fast_data.answer_and_target(model, StubTok({stop}), prompts, 6)
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
    # and train.py's own answer_and_target (answer_attention after the answer) makes the same samples
    for s, t in zip(samples, train.answer_and_target(model, StubTok({stop}), prompts, 6)):
        assert s["response_ids"] == t["response_ids"] and torch.allclose(s["target"], t["target"], atol=1e-5)


def test_stage_budgets_without_samples_says_to_run_the_data_stage(model_dir, tmp_path, stub_prompts):
    write_data(tmp_path / "o", model_dir)  # rows, but no sample file written yet
    with pytest.raises(SystemExit) as e:
        train_lab.main(argv(model_dir, tmp_path / "o", "--stage", "budgets", "--adapter-out",
                            str(tmp_path / "x.safetensors")))
    assert "no training samples" in error_line(e) and "--stage data" in error_line(e)


def test_bad_research_flags_stop_before_the_model_loads(model_dir, tmp_path, monkeypatch):
    """test_train's issue 28 cases for the research flags: one `error:` line naming the flag or file, before
    the model loads, and nothing that was there is touched."""
    out = tmp_path / "o"
    write_data(out, model_dir)
    guard_loading(monkeypatch)
    monkeypatch.setattr(train_lab, "load_model", no_model)
    weights = tmp_path / "w.json"
    weights.write_text("precious")
    cases = [
        (["--stage", "budgets"], "--stage budgets needs --adapter-out"),
        (["--init", str(tmp_path / "none.safetensors")], "--init"),
        (["--loss-weights", str(tmp_path / "none.json")], "--loss-weights"),
        (["--loss-weights", str(weights)], f"--loss-weights {weights}: not a readable JSON file"),
        (["--loss-weights", str(weights), "--stage", "data"], "--loss-weights is read when training"),
    ]
    for extra, says in cases:
        with pytest.raises(SystemExit) as e:
            train_lab.main(argv(model_dir, out, *extra))
        assert says in error_line(e), (extra, str(e.value))
    assert weights.read_text() == "precious"


@pytest.mark.parametrize("fields, flags, says", [
    (dict(init=""), [], "--init '' is empty: give a value, or leave it out"),  # trained from scratch, before
    (dict(budget=16, window=16), [], "budget 16, window 16 (the held-out check's): budget 16 is too small for snapkv"),
], ids=["init-empty", "window-fills-budget"])
def test_recipe_values_that_failed_late_or_silently_stop_before_the_model_loads(model_dir, tmp_path, monkeypatch,
                                                                              fields, flags, says):
    """Issue 37, the research settings: one `error:` line naming the key before the model loads; OUT is left
    as it was."""
    out = tmp_path / "o"
    write_data(out, model_dir)
    before = {f: f.read_bytes() for f in out.rglob("*") if f.is_file()}
    guard_loading(monkeypatch)
    monkeypatch.setattr(train_lab, "load_model", no_model)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        train_lab.main(argv(model_dir, out, *flags, **fields))
    assert says in error_line(e)
    assert {f: f.read_bytes() for f in out.rglob("*") if f.is_file()} == before


def test_every_research_setting_is_recorded_and_compared(model_dir, tmp_path, monkeypatch):
    """LabConfig's fields define the run as TrainConfig's do: a checkpoint records them, --resume compares them."""
    assert {"budget", "init", "data", "train_rows", "group", "loss_weights"} <= set(recipe.resume_keys(train_lab.LabConfig))
    out = tmp_path / "o"
    write_data(out, model_dir)
    cfg = train.resolved(train.get_args(argv(model_dir, out), train_lab.LabConfig, train_lab.parser()))
    train_lab.check(cfg)
    module = LookaheadModule(ModelConfig.from_hf_config(model_dir), n_tokens=cfg.n_tokens, rank=cfg.rank,
                             alpha=cfg.alpha, targets=recipe.parse_targets(cfg.targets))
    recipe.save_checkpoint(out / "ckpt.pt", module, torch.optim.AdamW(module.parameters()), 1, [],
                           recipe.schedule_of(cfg))
    guard_loading(monkeypatch)
    monkeypatch.setattr(train_lab, "load_model", no_model)
    with pytest.raises(SystemExit) as e:
        train_lab.main(argv(model_dir, out, "--resume", budget=17))
    assert 'other settings: budget 16 (this run: 17)' in error_line(e)


def test_a_data_folder_made_in_another_dtype_is_refused(model_dir, tmp_path, monkeypatch, stub_prompts):
    """Issue 53: --data of a float32 data stage with --dtype bfloat16 failed at step 0 (its held-out ground truth,
    kept in float32, met a bfloat16 model). The rows record the dtype the model ran in (build_dataset), a folder
    made before they did is known by its held-out ground truth, and a run in another dtype is refused."""
    src = tmp_path / "data"
    write_data(src, model_dir, n_train=4)
    train_lab.main(argv(model_dir, src, "--stage", "data", "--n-train", "5"))  # one new row: answered here, in float32
    rows = [json.loads(line) for line in (src / "data.jsonl").read_text().splitlines()]
    assert [r.get("dtype") for r in rows] == [None] * 5 + ["float32"]  # write_data's rows predate the field
    old = tmp_path / "old"  # no row says; its held-out ground truth (harness.heldout_ground_truth's file) does
    write_data(old, model_dir)
    train_lab.main(argv(model_dir, old, "--stage", "data"))  # the sample files, no new rows
    (old / "heldout").mkdir()
    torch.save(dict(k=[torch.zeros(1, 2, 3, 16)], v=[torch.zeros(1, 2, 3, 16)], gt={}, extra={}),
               old / "heldout" / "0123456789abcdef.pt")
    guard_loading(monkeypatch)
    monkeypatch.setattr(train_lab, "load_model", no_model)
    for folder in (src, old):
        with pytest.raises(SystemExit) as e:
            train_lab.main(argv(model_dir, tmp_path / "b", "--stage", "train", "--data", str(folder), "--dtype", "bfloat16"))
        assert error_line(e).startswith(f"error: --dtype bfloat16: --data {folder} was made with the base model in "
                                        f"float32 ("), folder
        assert "--dtype float32" in error_line(e)
    with pytest.raises(SystemExit) as e:  # a data stage adding bfloat16 rows to float32 ones: refused too
        train_lab.main(argv(model_dir, src, "--stage", "data", "--n-train", "6", "--dtype", "bfloat16"))
    assert error_line(e).startswith(f"error: --dtype bfloat16: --out {src} was made with the base model in float32")
    assert not (tmp_path / "b" / "ckpt.pt").exists()


def test_stage_budgets_writes_weights_into_the_adapter(model_dir, tmp_path, stub_prompts, monkeypatch, capsys):
    """--stage budgets on a tiny run: per group of layers a gain and a weight (mean 1, a larger gain a larger
    weight), OUT/layer_weights.json, and the adapter at --adapter-out: the same tensors, its .json with
    layer_weights and how they were measured; an adapter it replaces is kept as .prev."""
    out = tmp_path / "s"
    write_data(out, model_dir)
    train_lab.main(argv(model_dir, out))
    trained = out / "adapter.safetensors"
    # without --init: the default adapter for this model (weights/TinyLlama.lookahead.safetensors), missing here
    with pytest.raises(SystemExit) as e:
        train_lab.main(argv(model_dir, out, "--stage", "budgets", "--adapter-out", str(tmp_path / "lb.safetensors")))
    assert "TinyLlama.lookahead.safetensors" in error_line(e)
    monkeypatch.setattr(layer_budgets, "GROUP", 1)  # 2 layers: one group each
    capsys.readouterr()
    before = trained.read_bytes(), (out / "adapter.json").read_text()
    train_lab.main(argv(model_dir, out, "--stage", "budgets", "--init", str(trained), "--adapter-out", str(trained),
                    budget=6))
    said = capsys.readouterr().out
    assert "layers  answer-KL gain  weight" in said and "adapter.prev.safetensors" in said
    got = json.loads((out / "layer_weights.json").read_text())
    L = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    assert got["rows"] == 4 and got["C"] == 6 and len(got["weights"]) == len(got["gain"]) == L
    assert sum(got["weights"]) / L == pytest.approx(1.0, abs=1e-3) and len(set(got["weights"])) > 1
    order = sorted(range(L), key=lambda l: got["gain"][l])
    assert [got["weights"][l] for l in order] == sorted(got["weights"])
    meta = json.loads((out / "adapter.json").read_text())
    assert meta["layer_weights"] == got["weights"] and "rule" not in meta  # train.py's default recommends none
    assert meta["layer_weights_from"] == dict(rows=4, C=6, group=1, floor=layer_budgets.FLOOR,
                                              power=layer_budgets.POWER)
    assert (out / "adapter.prev.safetensors").read_bytes() == before[0]
    assert (out / "adapter.prev.json").read_text() == before[1]
    a, b = adapter(out / "adapter.prev.safetensors"), adapter(trained)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same weights: only the .json is new
    m = methods.load_adapter(trained, ModelConfig.from_hf_config(model_dir))  # usable as it ships
    assert m.info["layer_weights"] == got["weights"]
    # --init with per-layer weights: the weights are dropped (measured for the init's tensors), and said so
    capsys.readouterr()
    b_out = tmp_path / "b"
    write_data(b_out, model_dir)
    train_lab.main(argv(model_dir, b_out, "--init", str(trained)))
    assert "per-layer weights are dropped" in capsys.readouterr().out
    meta_b = json.loads((b_out / "adapter.json").read_text())
    assert "layer_weights" not in meta_b and "layer_weights_from" not in meta_b


def test_init_continues_an_adapter_and_keeps_its_untrained_reference(model_dir, tmp_path, stub_prompts):
    """--init: step 0 of the new run is the init adapter (not a fresh module), its shape wins over
    the recipe's, and the saved metadata keeps the original untrained reference."""
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        write_data(out, model_dir)
    train_lab.main(argv(model_dir, a))
    meta_a = json.loads((a / "adapter.json").read_text())
    train_lab.main(argv(model_dir, b, "--init", str(a / "adapter.safetensors"), n_tokens=4))
    meta_b = json.loads((b / "adapter.json").read_text())
    log_b = [json.loads(line) for line in (b / "log.jsonl").read_text().splitlines()]
    assert meta_b["n_tokens"] == 8 and meta_b["steps"] == 4
    assert log_b[0]["kl"] == pytest.approx(meta_a["heldout"]["kl"])  # step 0 = the init adapter
    assert meta_b["untrained"] == meta_a["untrained"]
    assert meta_b["init"] == dict(path="adapter.safetensors", steps=4, heldout=log_b[0])
    pa, pb = adapter(a / "adapter.safetensors"), adapter(b / "adapter.safetensors")
    assert max((pa[k] - pb[k]).abs().max().item() for k in pa) > 1e-3  # and it trained further


def test_loss_weights_train_on_the_layer_weighted_loss_and_say_so(model_dir, tmp_path, stub_prompts):
    """--loss-weights (extensions/layer_loss.py, beyond the paper): equal weights train exactly the paper's loss,
    unequal ones another adapter; the .json names the weights' file, and a file for another layer count is refused."""
    L = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    equal, tilted, wrong = tmp_path / "equal.json", tmp_path / "tilted.json", tmp_path / "wrong.json"
    equal.write_text(json.dumps(dict(layer_weights=[1.3] * L)))
    tilted.write_text(json.dumps(dict(layer_weights=[0.2] + [1.8] * (L - 1))))
    wrong.write_text(json.dumps(dict(layer_weights=[1.0] * (L + 1))))
    runs = {}
    for name, extra in (("paper", []), ("equal", ["--loss-weights", str(equal)]),
                        ("tilted", ["--loss-weights", str(tilted)])):
        write_data(tmp_path / name, model_dir)
        train_lab.main(argv(model_dir, tmp_path / name, *extra))
        runs[name] = adapter(tmp_path / name / "adapter.safetensors")
    assert all(torch.allclose(runs["paper"][k], runs["equal"][k], atol=1e-5) for k in runs["paper"])
    assert max((runs["paper"][k] - runs["tilted"][k]).abs().max().item() for k in runs["paper"]) > 1e-3
    assert json.loads((tmp_path / "tilted" / "adapter.json").read_text())["loss"] == dict(
        layer_weights_from="tilted.json")
    assert "loss" not in json.loads((tmp_path / "paper" / "adapter.json").read_text())
    with pytest.raises(SystemExit) as e:
        train_lab.main(argv(model_dir, tmp_path / "paper", "--loss-weights", str(wrong)))
    assert f"{L + 1} layer weights for a model of {L} layers" in error_line(e)


def test_stage_train_only_reads_and_trains_on_the_rows_with_samples(model_dir, tmp_path, monkeypatch, capsys):
    """--stage train never writes data (a data stage may be appending to OUT): no prompt made, no sample
    rebuilt, data.jsonl untouched; it trains on the training rows whose sample files exist, and says in one
    warning that they are fewer than the recipe's n_train (a data stage stopped part way); a machine short of
    memory after the first step is said too, once (the OOM killer leaves no line)."""
    out = tmp_path / "t"
    write_data(out, model_dir)
    monkeypatch.setattr(data, "make_training_prompts", fake_prompts)
    train_lab.main(argv(model_dir, out, "--stage", "data"))
    files = sorted((out / "samples").glob("*.safetensors"))
    files[0].unlink()  # its row is in data.jsonl, its sample not (yet)
    jsonl, left = (out / "data.jsonl").read_bytes(), {f: f.read_bytes() for f in files[1:]}
    monkeypatch.setattr(data, "make_training_prompts", lambda *a, **k: pytest.fail("no prompt may be made"))
    read, get_batch = [], train.get_batch
    monkeypatch.setattr(train, "get_batch", lambda paths, *a: (read.extend(paths), get_batch(paths, *a))[1])
    capsys.readouterr()
    train_lab.main(argv(model_dir, out, "--stage", "train", "--n-train", "9"))
    warned = re.findall(r"warning: [^\r\n]*", capsys.readouterr().err)  # a bar left by an earlier test moves the cursor
    assert len(warned) == 1 and f"{out} holds 3 training samples, fewer than n_train 9" in warned[0], warned
    monkeypatch.setattr(cli, "free_memory_gib", lambda device: 2**-10)  # 1 MiB left: under half of any step's peak
    train_lab.main(argv(model_dir, out, "--stage", "train", "--n-train", "3", "--out", str(tmp_path / "t2"),
                    "--data", str(out)))
    warned = re.findall(r"warning: [^\r\n]*", capsys.readouterr().err)
    assert len(warned) == 1 and "0.0 GiB left" in warned[0] and "--micro-batch" in warned[0], warned  # once a run
    assert (out / "data.jsonl").read_bytes() == jsonl and not files[0].exists()
    assert sorted((out / "samples").glob("*.safetensors")) == files[1:]
    assert all(f.read_bytes() == b for f, b in left.items())
    assert set(read) == set(files[1:])  # every epoch: the three samples there are, never the missing one
    meta = json.loads((out / "adapter.json").read_text())
    assert meta["train_data"]["n_train"] == 3 and meta["steps"] == 2  # 3 micro-batches of 1, 2 a step, 2 epochs
    # the data as its rows are (lengths, copy share), whatever this command's data flags say
    rows = [json.loads(l) for l in (out / "data.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["split"] == "train" and data.sample_path(out, r["id"]).exists()]
    lengths = [len(r["prompt_ids"]) for r in train_rows]
    assert meta["train_data"]["prompt_tokens"] == [min(lengths), max(lengths)]
    assert meta["train_data"]["answer_tokens_max"] == max(len(r["response_ids"]) for r in train_rows)
    assert 0 <= meta["train_data"]["copy_share"] <= 1


@pytest.mark.parametrize("gpu_form", [False, True])
def test_grouped_prompts_share_one_prefill_and_give_each_its_own_sample(tmp_path, monkeypatch, gpu_form):
    """answer_and_target with groups: prompts of a group share their prefix's prefill (and the decode reads it
    once: SharedPrefixAttention), yet each row's answer, target and cache equal a forward of it alone; the
    data stage stores the prefix once (save_batch) and load_batch puts each sample back together whole.
    gpu_form: the decode-time attention a GPU runs (TargetAttention, one batched matmul), here on the CPU."""
    if gpu_form:
        made = []
        monkeypatch.setattr(fast_data, "SharedPrefixAttention", lambda P, groups, S: made.append(1) or fast_data.TargetAttention(S))
    model = tiny_model()
    base = rand_list(40, 7)
    prompts = [base + rand_list(n, 50 + n) for n in (3, 9, 5)] + [rand_list(33, 8)]  # a group of 3 and a single
    groups = ["a", "a", "a", "b"]
    alone = [fast_data.answer_and_target(model, StubTok(set()), [p], 6)[0]["response_ids"] for p in prompts]
    stop = alone[1][2]
    samples = fast_data.answer_and_target(model, StubTok({stop}), prompts, 6, groups=groups)
    assert [s["shared"] for s in samples][3] == 32 and all(s["shared"] >= 40 for s in samples[:3])
    assert samples[1]["response_ids"][-1] == stop
    for p, s, a in zip(prompts, samples, alone):
        assert s["response_ids"] == a[:len(s["response_ids"])]
        cache, gt, _ = ground_truth(model, dict(prompt_ids=p, response_ids=s["response_ids"]))
        assert torch.allclose(s["target"], torch.cat([gt[l] for l in range(len(gt))]), atol=1e-5)
        assert torch.allclose(s["k"], torch.cat(cache.k), atol=1e-5) and torch.allclose(s["v"], torch.cat(cache.v), atol=1e-5)
    rows = [dict(id=f"r{i}", split="train", group=g) for i, g in enumerate(groups)]
    fast_data.save_batch(tmp_path, rows, samples, torch.float32)
    files = sorted((tmp_path / "samples").iterdir())
    assert len(files) == 5  # four samples and the group's one prefix file
    for r, s in zip(rows, samples):
        path = data.sample_path(tmp_path, r["id"])
        assert data.sample_ok(path)
        cache, gt, lengths = train.get_batch([path], "cpu", torch.float32)
        assert lengths.tolist() == [s["target"].shape[-1]]
        assert torch.equal(torch.cat(cache.k), s["k"]) and torch.equal(gt[0][0], s["target"][0])
    data.prefix_path(tmp_path, "a").unlink()  # a member without its prefix file is not a whole sample
    assert not data.sample_ok(data.sample_path(tmp_path, "r0")) and data.sample_ok(data.sample_path(tmp_path, "r3"))
    assert not gpu_form or made  # the batched form is the one that ran


def test_roomy_cache_holds_what_a_plain_cache_holds():
    """RoomyCache: decoding writes into reserved room; the keys, values and validity it shows are a plain
    KVCache's, and past its room it goes on as a plain cache does."""
    model = tiny_model()
    ids, pad = eviction.left_pad([rand_list(12, 1), rand_list(9, 2)], "cpu")
    cache = train.full_cache(model, ids, pad)[0]
    plain, roomy = cache.copy(), fast_data.RoomyCache(cache.copy(), 2)
    for t in range(4):  # two steps in the room, two past it
        tok = torch.tensor([[3 + t], [5 + t]])
        pos = torch.tensor([[12 + t], [9 + t]])
        a = model(tok, positions=pos, cache=plain)
        b = model(tok, positions=pos, cache=roomy)
        assert torch.allclose(a, b, atol=1e-6)
        for l in range(len(plain.k)):
            assert torch.equal(plain.k[l], roomy.k[l]) and torch.equal(plain.valid[l], roomy.valid[l])


def test_draw_rows_takes_whole_groups_and_nests_the_smaller_draws():
    rows = [dict(id=f"g{g}-{i}", group=f"g{g}") for g in range(10) for i in range(3)] + \
           [dict(id=f"single-{i}") for i in range(5)]
    small, large = train_lab.draw_rows(rows, 7, seed=0), train_lab.draw_rows(rows, 20, seed=0)
    for drawn in (small, large):
        groups = {r.get("group", r["id"]) for r in drawn}
        # every drawn group whole: all its members, in data.jsonl's order
        assert drawn == [r for r in rows if r.get("group", r["id"]) in groups]
    assert 7 <= len(small) < 7 + 3 and 20 <= len(large) < 20 + 3
    assert {r["id"] for r in small} <= {r["id"] for r in large}  # a learning curve adds data, never swaps it
    assert train_lab.draw_rows(rows, 7, seed=1) != small  # the seed draws (the same seed: the same rows)
    assert train_lab.draw_rows(rows, 7, seed=0) == small and train_lab.draw_rows(rows, 10**6, seed=0) == rows


def test_data_trains_on_another_runs_samples_and_writes_only_out(model_dir, tmp_path, stub_prompts, capsys):
    """--data: one data stage, several training runs (the learning curve). The data folder is read, never changed
    (but for its held-out ground truth cache); OUT gets the checkpoint, log and adapter; --train-rows draws."""
    src, out = tmp_path / "data", tmp_path / "curve"
    write_data(src, model_dir)
    train_lab.main(argv(model_dir, src, "--stage", "data"))
    before = {f: f.read_bytes() for f in src.rglob("*") if f.is_file() and "heldout" not in f.parts}
    train_lab.main(argv(model_dir, out, "--stage", "train", "--data", str(src), "--train-rows", "2"))
    after = {f: f.read_bytes() for f in src.rglob("*") if f.is_file() and "heldout" not in f.parts}
    assert after == before
    assert not (out / "data.jsonl").exists() and not (out / "samples").exists()
    assert (out / "ckpt.pt").exists() and (out / "log.jsonl").exists()
    meta = json.loads((out / "adapter.json").read_text())
    assert meta["train_data"]["n_train"] == 2 and meta["steps"] == 2  # 2 samples, batch 2, 2 epochs
    assert meta["train_data"]["folder"] == str(src) and meta["train_data"]["drawn"] == dict(asked=2, seed=0)
    # what the result depends on is a resume key: another draw or another data folder is not resumed into this one
    assert {"data", "train_rows"} <= set(recipe.resume_keys(train_lab.LabConfig))
    with pytest.raises(SystemExit, match="other settings: --train-rows 2 \\(this run: 3\\)"):
        train_lab.main(argv(model_dir, out, "--stage", "train", "--data", str(src), "--train-rows", "3", "--resume"))
    # --stage budgets reads --data's samples too, and writes its table into OUT
    table = tmp_path / "table"
    train_lab.main(argv(model_dir, table, "--stage", "budgets", "--data", str(src), "--init", str(out / "adapter.safetensors"),
                    "--adapter-out", str(table / "measured.safetensors")))
    assert (table / "layer_weights.json").exists() and "layer_weights" in json.loads((table / "measured.json").read_text())
    assert {f: f.read_bytes() for f in src.rglob("*") if f.is_file() and "heldout" not in f.parts} == before


@pytest.mark.parametrize("extra, said", [
    (["--stage", "data", "--data", "DATA"], "--data is read by --stage train and budgets"),
    (["--stage", "train", "--data", "NOWHERE"], "--data NOWHERE: no data.jsonl there"),
    (["--stage", "train", "--data", "DATA", "--train-rows", "99"], "--train-rows 99: .* holds 4 training samples"),
    (["--stage", "train", "--data", "DATA", "--train-rows", "0"], "--train-rows"),
    (["--stage", "data", "--train-rows", "2"], "--train-rows is read when training"),
])
def test_data_and_train_rows_mistakes_stop_before_the_model_loads(model_dir, tmp_path, monkeypatch, extra, said):
    src, out = tmp_path / "data", tmp_path / "curve"
    write_data(src, model_dir)
    for r in data.read_jsonl(src / "data.jsonl", required=("id",)):  # samples for the four training rows (no model needed: any file)
        if r["split"] == "train":
            data.sample_path(src, r["id"]).parent.mkdir(parents=True, exist_ok=True)
            data.sample_path(src, r["id"]).write_bytes(b"x")
    monkeypatch.setattr(recipe, "sample_ok", lambda path: True)
    monkeypatch.setattr(cli, "load", no_model)
    monkeypatch.setattr(train_lab, "load_model", no_model)
    before = {f: f.read_bytes() for f in src.rglob("*") if f.is_file()}
    extra = [str(src) if e == "DATA" else str(tmp_path / e) if e == "NOWHERE" else e for e in extra]
    said = said.replace("NOWHERE", str(tmp_path / "NOWHERE"))
    with pytest.raises(SystemExit) as e:
        train_lab.main(argv(model_dir, out, *extra))
    assert re.search(said, error_line(e)), error_line(e)
    assert {f: f.read_bytes() for f in src.rglob("*") if f.is_file()} == before


def test_answer_weights_folder_trains_like_its_source_and_never_changes_it(model_dir, tmp_path, stub_prompts,
                                                                           capsys):
    """The new folder's samples hold a target and point to the source's cache: --weights uniform on every row
    trains the very adapter the source trains; dependence makes other targets, of the same shapes."""
    from extensions import answer_weights as aw

    src = tmp_path / "data"
    write_data(src, model_dir)
    train_lab.main(argv(model_dir, src, "--stage", "data"))
    before = {f: f.read_bytes() for f in src.rglob("*") if f.is_file() and "heldout" not in f.parts}
    paper, dep = tmp_path / "paper", tmp_path / "dep"
    aw.main(["--data", str(src), "--out", str(paper), "--weights", "uniform", "--model", str(model_dir)])
    aw.main(["--data", str(src), "--out", str(dep), "--first", "2", "--model", str(model_dir)])
    assert "2 training rows (2 made now" in capsys.readouterr().out
    train_lab.main(argv(model_dir, tmp_path / "a", "--stage", "train", "--data", str(src)))
    train_lab.main(argv(model_dir, tmp_path / "b", "--stage", "train", "--data", str(paper)))
    a, b = adapter(tmp_path / "a" / "adapter.safetensors"), adapter(tmp_path / "b" / "adapter.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [r for r in data.read_jsonl(dep / "data.jsonl", required=("id",)) if r["split"] == "train"]
    assert [r["id"] for r in rows] == [r["id"] for r in data.read_jsonl(src / "data.jsonl", required=("id",))][:2]
    for r in rows:
        mine, theirs = data.sample_path(dep, r["id"]), data.sample_path(src, r["id"])
        assert set(load_file(str(mine))) == {"target"} and mine.stat().st_size < theirs.stat().st_size
        t, t0 = load_file(str(mine))["target"], load_file(str(theirs))["target"]
        assert t.shape == t0.shape and not torch.allclose(t, t0)
    train_lab.main(argv(model_dir, tmp_path / "c", "--stage", "train", "--data", str(dep)))
    assert json.loads((tmp_path / "c" / "adapter.json").read_text())["train_data"]["n_train"] == 2
    assert {f: f.read_bytes() for f in src.rglob("*") if f.is_file() and "heldout" not in f.parts} == before
    aw.main(["--data", str(src), "--out", str(dep), "--first", "2", "--model", str(model_dir)])  # resumed: all done
    assert "(0 made now" in capsys.readouterr().out
    theirs.unlink()  # a sample whose cache is gone is not whole
    assert not data.sample_ok(mine)


def test_init_says_the_module_settings_it_does_not_use(model_dir, tmp_path, capsys):
    """Issue 66: --init overrode --targets, rank and M with no word; now each that differs is said (the init
    adapter's shape trains: test_init_continues_an_adapter_and_keeps_its_untrained_reference)."""
    path = tmp_path / "init.safetensors"
    LookaheadModule(ModelConfig.from_hf_config(model_dir), n_tokens=8).save(path)
    cfg = train_lab.LabConfig(init=str(path), stage="train", targets="q_proj", rank=4, device="cpu")
    module = train_lab.read_adapter(cfg, ModelConfig.from_hf_config(model_dir))
    said = capsys.readouterr().err
    assert module.n_tokens == 8 and module.rank == 8  # the adapter's own shape
    assert f"--init {path} trains the adapter's own M, rank, alpha and targets" in said
    assert "rank 4" in said and "targets q_proj" in said and "not used" in said
