"""Issue 78, item 5: long prompts in the research tools. The held-out ground truth kept on disk and read one
prompt at a time (harness.OnDisk) gives the very numbers of the one kept in memory, and holds no prompt's cache
between calls; a --suite/--tasks run that adds a method to a results folder reuses FullKV's answers from it
instead of decoding them again, and gives the rows of a run that made every method at once."""

import copy
import json

import pytest
import torch

from lookaheadkv import LookaheadModule
from model import load_model
from research import evaluate
from research import harness
from test_evaluate import tiny  # noqa: F401 (a fixture: the tiny model, tokenizer, adapter and task file)


# -----------------------------------------------------------------------------
# (a) the held-out ground truth on disk


@pytest.fixture(scope="module")
def small(tiny_hf_model):
    model = load_model(tiny_hf_model("llama"))
    torch.manual_seed(0)
    modules = []
    for rule in (None, "span:3", "avg:3"):  # the paper's form; a span rule (its runs keep hidden states); avg
        m = LookaheadModule(model.config, n_tokens=4, embed_std=model.model.embed_tokens.weight.std().item())
        with torch.no_grad():
            for p in m.lora.parameters():
                p.normal_(0, 0.1)
        m.info = {} if rule is None else dict(rule=rule)
        modules.append((rule or "paper", m))
    g = torch.Generator().manual_seed(4)
    rows = [dict(prompt_ids=torch.randint(1, 128, (30 + 9 * i,), generator=g).tolist(),
                 response_ids=torch.randint(1, 128, (5,), generator=g).tolist()) for i in range(4)]
    return model, modules, rows


def test_on_disk_ground_truth_gives_the_numbers_of_the_one_in_memory(small, tmp_path, capsys):
    """compare() of three modules (the baselines' answer KL with the first, each module's rows always): on the
    ground truth in memory (out=None), on the one just written to OUT/heldout and read back a prompt at a time,
    and on the one a later run finds there: the same metrics to the digit."""
    model, modules, rows = small
    in_memory = harness.heldout_ground_truth(model, rows)
    assert isinstance(in_memory, list)
    expected = harness.compare(model, modules, in_memory, budgets=(8, 16), answer_kl=True, window=4)
    for attempt in ("made", "found"):
        on_disk = harness.heldout_ground_truth(model, rows, out=tmp_path)
        assert isinstance(on_disk, harness.OnDisk) and len(on_disk) == len(rows)
        got = harness.compare(model, modules, on_disk, budgets=(8, 16), answer_kl=True, window=4)
        assert [(label, r) for label, _, r in got] == [(label, r) for label, _, r in expected], attempt
        # after compare() no prompt keeps its runs (their scores, a span rule's hidden states)
        assert not any("runs" in extra for extra in on_disk.extras)
    assert len(list((tmp_path / "heldout").glob("*.pt"))) == len(rows)
    printed = capsys.readouterr().out
    assert "held-out ground truth: 4 prompts, up to 57 tokens: " in printed and "all kept in memory; " in printed
    assert f"kept in {tmp_path / 'heldout'} and read back one at a time; expected peak memory " in printed


def test_on_disk_items_are_read_one_at_a_time(small, tmp_path, monkeypatch):
    """heldout_metrics reads an item when it measures it, and not at all when `done` has it (a resumed run);
    the item read before is let go first (at most one prompt's cache alive)."""
    model, modules, rows = small
    heldout = harness.heldout_ground_truth(model, rows, out=tmp_path)
    alive, most, real = [], [0], harness.prompt_metrics
    import weakref

    def measured(model, module, item, *a):
        alive.append(weakref.ref(item[0]))
        most[0] = max(most[0], sum(r() is not None for r in alive))
        return real(model, module, item, *a)

    monkeypatch.setattr(harness, "prompt_metrics", measured)
    done = {0: harness.heldout_metrics(model, modules[0][1], [heldout[0]], (8,), window=4)}
    harness.heldout_metrics(model, modules[0][1], heldout, (8,), window=4, done=done)
    assert len(alive) == 1 + 3 and most[0] == 1


def test_compare_holds_one_prompts_runs_at_a_time(small, tmp_path, monkeypatch):
    """compare() measures every module on a prompt before it reads the next: each item is read once, and when a
    module is measured no other prompt holds runs (a module by module loop held every prompt's between its
    passes: 6.3 GB at ~4K x 48). A prompt that a resumed run measured for every module is not read."""
    model, modules, rows = small
    heldout = harness.heldout_ground_truth(model, rows, out=tmp_path)
    reads, calls, real_read, real = [], [], harness.load_item, harness.prompt_metrics

    def read(path, device):
        reads.append(path)
        return real_read(path, device)

    def measured(model, module, item, *a):
        calls.append(sum("runs" in extra for extra in heldout.extras if extra is not item[2]))
        return real(model, module, item, *a)

    monkeypatch.setattr(harness, "load_item", read)
    monkeypatch.setattr(harness, "prompt_metrics", measured)
    done = {label: {} for label, _ in modules}
    done[modules[0][0]][0] = done[modules[1][0]][0] = done[modules[2][0]][0] = dict(kl=0.0)  # prompt 0: resumed
    done[modules[1][0]][1] = dict(kl=0.0)  # prompt 1: one module of three left
    harness.compare(model, modules, heldout, budgets=(8,), window=4, done=done)
    assert calls == [0] * (2 + 3 + 3)
    assert reads == heldout.paths[1:]
    assert not any("runs" in extra for extra in heldout.extras)


def test_snapkv_given_an_adapters_budgets_is_measured_with_that_adapter(small):
    """snapkv-layered (SnapKV given an adapter's per-layer budgets) is measured with the module whose budgets
    it takes, not with the untrained one, which has none (measured so, the row was plain SnapKV under another
    name); the table prints it under that adapter."""
    model, modules, rows = small
    untrained, layered = modules[0][1], copy.deepcopy(modules[1][1])
    layered.info = dict(layer_weights=[0.5] * (model.config.num_hidden_layers - 1) + [1.5])
    heldout = harness.heldout_ground_truth(model, rows)
    table = harness.compare(model, [("untrained", untrained), ("layered", layered)], heldout, budgets=(8, 16),
                            answer_kl=True, window=4)
    first, second = table[0][2], table[1][2]
    assert not any("snapkv-layered" in k for k in first if k.startswith("answer_kl"))
    for C in (8, 16):
        assert f"answer_kl_snapkv-layered@{C}" in second
    assert any(second[f"answer_kl_snapkv-layered@{C}"] != first[f"answer_kl_snapkv@{C}"] for C in (8, 16))
    assert any(second[f"recall_snapkv-layered@{C}"] != first[f"recall_snapkv@{C}"] for C in (8, 16))
    text = harness.tables(table, (8, 16), len(rows))
    assert text.count("| snapkv, layered's per-layer budgets | ") == 2  # answer KL and recall


def test_unreadable_file_is_made_again(small, tmp_path, capsys):
    """A file cut short (a kill before files.write_with moved files in whole) is found when the run starts, and
    made again: not an error in the middle of the metrics."""
    model, _, rows = small
    harness.heldout_ground_truth(model, rows[:2], out=tmp_path)
    path = sorted((tmp_path / "heldout").glob("*.pt"))[0]
    path.write_bytes(path.read_bytes()[:100])
    heldout = harness.heldout_ground_truth(model, rows[:2], out=tmp_path)
    assert "is unreadable: computing it again" in capsys.readouterr().out
    assert [len(heldout[i][0]) for i in range(2)] == [len(r["prompt_ids"]) for r in rows[:2]]


# -----------------------------------------------------------------------------
# (b) FullKV's answers reused by a run that adds a method


def argv(root, out, methods):
    return ["--tasks", str(root / "tasks.jsonl"), "--model", str(root / "tiny-llama"),
            "--budgets", "8,16", "--window", "4", "--max-new-tokens", "6",
            "--methods", methods, "--device", "cpu", "--out", str(root / out)]


def test_a_run_that_adds_a_method_reuses_fullkv_answers(tiny, monkeypatch):  # noqa: F811
    """A folder made with full,snapkv, then h2o,oracle added: FullKV's answers are not decoded again (greedy is
    called on no full cache the second time; the answers' token ids are in the full rows) and every row but the
    timings is the row of one run of all four methods; a full row without answer_ids (an older results.json) is
    decoded as before."""
    decoded, real = [], evaluate.greedy

    def counted(model, cache, *a):  # FullKV's answer: greedy on the whole prompt's cache (methods' on C + d < S)
        decoded.append(len(cache))
        return real(model, cache, *a)

    monkeypatch.setattr(evaluate, "greedy", counted)
    at_once = evaluate.main(argv(tiny, "reuse-once", "full,snapkv,h2o,oracle"))
    sizes = {r["id"]: r["prompt_tokens"] for r in at_once}
    full_decodes = lambda: sum(n in sizes.values() for n in decoded)  # noqa: E731
    assert full_decodes() == 3
    decoded.clear()
    evaluate.main(argv(tiny, "reuse-added", "full,snapkv"))
    assert full_decodes() == 3
    saved = json.loads((tiny / "reuse-added" / "results.json").read_text())
    assert all(r["answer_ids"] for r in saved["results"] if r["method"] == "full")
    decoded.clear()
    added = evaluate.main(argv(tiny, "reuse-added", "full,snapkv,h2o,oracle"))
    assert full_decodes() == 0

    timing = ("score_ms", "prefill_ms", "answer_ms")
    same = lambda rows: sorted(json.dumps({k: v for k, v in r.items() if k not in timing}, sort_keys=True)  # noqa: E731
                               for r in rows)
    assert same(added) == same(at_once)

    # an older folder: its full rows hold no answer_ids, so FullKV's answers are decoded as before
    path = tiny / "reuse-added" / "results.json"
    saved = json.loads(path.read_text())
    saved["results"] = [{k: v for k, v in r.items() if k != "answer_ids"} for r in saved["results"]
                        if r["method"] in ("full", "snapkv")]
    path.write_text(json.dumps(saved))
    decoded.clear()
    again = evaluate.main(argv(tiny, "reuse-added", "full,snapkv,h2o,oracle"))
    assert full_decodes() == 3
    assert same(r for r in again if r["method"] in ("h2o", "oracle")) == \
        same(r for r in at_once if r["method"] in ("h2o", "oracle"))


def test_a_stored_answer_serves_only_the_caps_it_answers_for():
    """Greedy under cap N is the first N tokens of the uncapped answer, up to its first stop token: a stored
    answer that stopped within N, or fills N exactly, is the one a decode would give; one cut at a smaller cap
    is not."""
    stop = [2]
    assert evaluate.known_answer([5, 6, 2], 6, stop) and evaluate.known_answer([5, 6, 2], 3, stop)
    assert not evaluate.known_answer([5, 6, 2], 2, stop)  # a decode under cap 2 stops at [5, 6]
    assert evaluate.known_answer([5, 6, 7], 3, stop)  # made under this very cap
    assert not evaluate.known_answer([5, 6, 7], 6, stop)  # cut at 3: a decode under 6 goes on
    assert not evaluate.known_answer(None, 6, stop) and not evaluate.known_answer([], 6, stop)
