"""research/kvpress_eval.py without a model: the order its rows run in, the summary it writes (means and the
paired differences), and the flags it refuses before loading anything; kvpress is needed only by the last test
(an adapter of another model refused once the model loads, before any row)."""
import json
import random
from types import SimpleNamespace

import pytest

from research import kvpress_eval, ruler
from support.metrics import paired_ci


def test_rows_go_sample_by_sample_over_the_tasks(monkeypatch):
    """A run stopped early holds as many samples of every task (give or take one)."""
    made = lambda tok, n, per_task, seed, tasks: [f"{t}/{n}/{i}" for t in tasks for i in range(per_task)]  # noqa
    monkeypatch.setattr(ruler, "make_suite", made)
    args = SimpleNamespace(tasks=["vt", "cwe", "fwe"], lengths=[1024], per_task=2, seed=0)
    assert kvpress_eval.rows(None, args) == ["vt/1024/0", "cwe/1024/0", "fwe/1024/0",
                                             "vt/1024/1", "cwe/1024/1", "fwe/1024/1"]


def row(protocol, press, C, id, score, task="vt"):
    return dict(protocol=protocol, press=press, budget=C, id=id, task=task, score=score, seconds=1.0,
                kept_slots=C or 100, kept_mb=1.0, held_mb=1.0)


def test_report_pairs_ours_against_each_press_on_the_rows_both_ran(tmp_path):
    results = [row("inside", "full", 0, "a", 1.0), row("inside", "full", 0, "b", 1.0),
               row("inside", "lookahead", 128, "a", 1.0), row("inside", "lookahead", 128, "b", 0.5),
               row("inside", "snapkv", 128, "a", 0.0), row("inside", "snapkv", 128, "b", 0.5),
               row("inside", "tova", 128, "a", 0.0)]  # tova ran on row a only
    kvpress_eval.report(results, tmp_path)
    text = (tmp_path / "summary.md").read_text()
    lines = {tuple(c.strip() for c in line.strip("|").split("|")[:5]): line for line in text.splitlines()}
    assert "+0.500" in lines["inside", "128", "lookahead", "snapkv", "2"]  # (1 - 0 + 0.5 - 0.5) / 2
    assert "+1.000" in lines["inside", "128", "lookahead", "tova", "1"]
    assert "-0.250" in lines["inside", "128", "lookahead", "full", "2"]  # full runs once, at C = 0
    assert "| inside | lookahead | 128 | 2 | 0.750 |" in text
    assert not any(k[2] == "snapkv" for k in lines if len(k) == 5)  # only LookaheadKV is "ours"


def test_paired_interval_holds_the_mean_and_is_a_point_when_every_difference_is_equal():
    rng = random.Random(1)
    diffs = [rng.choice([-1.0, 0.0, 1.0]) for _ in range(40)]
    lo, hi = paired_ci(diffs)
    assert lo <= sum(diffs) / len(diffs) <= hi and lo < hi
    assert paired_ci([0.25] * 7) == (0.25, 0.25)


@pytest.mark.parametrize("flags, message", [
    (["--presses", "snapkv,restorekv"], "error: unknown press restorekv (RestoreKV: its adapters are on the HF hub"),
    (["--protocols", "before"], "error: unknown protocol before"),
    (["--tasks", "vt,nope"], "error: unknown RULER task nope"),
    (["--budgets", "128,0"], "error: every budget must be >= 1 KV slot"),
])
def test_bad_flags_are_one_error_line_before_anything_loads(tmp_path, flags, message):
    with pytest.raises(SystemExit) as e:
        kvpress_eval.main(["--out", str(tmp_path / "out"), *flags])
    assert str(e.value).startswith(message)
    assert not (tmp_path / "out").exists()


def test_answers_are_compared_on_the_rows_both_ran(tmp_path, capsys):
    """research/analysis/kvpress_answers.py: kvpress's rows (inside only) against ours, FullKV's at C = 0 against
    evaluate's full row of any budget; a differing answer is printed and counted."""
    from research.analysis import kvpress_answers
    import json

    kv, ours = tmp_path / "kv", tmp_path / "ours"
    kv.mkdir(), ours.mkdir()
    lines = [dict(protocol="inside", press="full", budget=0, id="a", answer=" 42."),
             dict(protocol="inside", press="snapkv", budget=128, id="a", answer=" 4."),
             dict(protocol="inside", press="snapkv", budget=512, id="a", answer=" 42."),
             dict(protocol="after", press="snapkv", budget=128, id="a", answer="other"),
             dict(protocol="inside", press="snapkv", budget=128, id="b", answer=" 7")]  # b: not in ours
    (kv / "results.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    results = [dict(id="a", method="full", budget=128, output=" 42."), dict(id="a", method="snapkv", budget=128,
               output=" 42. "), dict(id="a", method="snapkv", budget=512, output="42.")]
    (ours / "results.json").write_text(json.dumps(dict(results=results)))
    assert kvpress_answers.main([str(kv), str(ours), "--press", "snapkv", "--method", "snapkv"]) == 1
    out = capsys.readouterr().out
    assert "a snapkv C=128: ours ' 42. ', kvpress ' 4.'" in out and "2 answers equal, 1 differ" in out


# --- the front door (issue 66): every bad input one `error:` line before the model loads ---------------------


def error_of(argv):
    """kvpress_eval.main(argv)'s one `error:` line (SystemExit), with the model never loaded."""
    import transformers

    loaded = []
    real = transformers.AutoModelForCausalLM.from_pretrained
    transformers.AutoModelForCausalLM.from_pretrained = lambda *a, **k: loaded.append(1)
    try:
        with pytest.raises(SystemExit) as e:
            kvpress_eval.main(argv)
    finally:
        transformers.AutoModelForCausalLM.from_pretrained = real
    assert not loaded
    text = str(e.value)
    assert text.startswith("error: ") and "\n" not in text, text
    return text


@pytest.fixture
def small(tiny_hf_model, tmp_path):
    """(a tiny HF model folder (context 512), a LookaheadKVPress folder's files (their bytes are the adapter's
    identity; the press never loads here), flags that name both)."""
    model = tiny_hf_model("llama")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    for name in kvpress_eval.ADAPTER_FILES:
        (adapter / name).write_text(name)
    return model, adapter, ["--model", str(model), "--adapter", str(adapter), "--lengths", "256",
                            "--threads", "1", "--presses", "lookahead", "--budgets", "16"]


@pytest.mark.parametrize("flags, message", [
    (["--lengths", "0"], "error: --lengths '0': every value must be at least 1"),
    (["--lengths", "100000"], "error: --lengths 100000 (prompt and answer) is past the model's context of 512"),
    (["--threads", "0"], "error: --threads 0"),
    (["--threads", "999"], "error: --threads 999: this machine gives this process"),
    (["--per-task", "0"], "error: --per-task 0"),
    (["--budgets", "x"], "error: every budget must be >= 1 KV slot"),
    (["--lengths", "1e3"], "error: --lengths '1e3'"),
    (["--budgets", "16,256"], "error: --budgets 256 keeps every token of a --lengths 256 prompt"),
])
def test_bad_numbers_are_one_error_line(small, tmp_path, flags, message):
    *_, base = small
    assert error_of(["--out", str(tmp_path / "out"), *base, *flags]).startswith(message)
    assert not (tmp_path / "out").exists()


def test_missing_model_adapter_and_foreign_folders_are_one_error_line(small, tmp_path):
    model, adapter, base = small
    out = ["--out", str(tmp_path / "out")]
    assert "--model " in error_of(out + base + ["--model", str(tmp_path / "nowhere")])
    said = error_of(out + base + ["--adapter", str(tmp_path / "nowhere")])
    assert said.startswith("error: --adapter") and "export_peft" in said
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps(dict(model_type="gpt2", vocab_size=128, n_embd=64)))
    assert "'gpt2'" in error_of(out + base + ["--model", str(gpt2)])
    assert not (tmp_path / "out").exists()
    a_file = tmp_path / "file.txt"
    a_file.write_text("mine")
    assert error_of(["--out", str(a_file)] + base).startswith(f"error: --out {a_file} is a file")
    assert a_file.read_text() == "mine"


@pytest.mark.parametrize("lines, message", [
    (["{not json"], "results.jsonl line 1 is not a kvpress_eval row (it lacks a JSON object)"),
    ([json.dumps(row("inside", "full", 0, "a", 1.0)),
      json.dumps({k: v for k, v in row("inside", "full", 0, "b", 1.0).items() if k != "task"})],
     "results.jsonl line 2 is not a kvpress_eval row (it lacks task)"),
])
def test_a_broken_results_file_is_one_error_line(small, tmp_path, lines, message):
    *_, base = small
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.jsonl").write_text("\n".join(lines) + "\n")
    for argv in (["--out", str(out), *base], ["--out", str(out), "--report"]):
        assert message in error_of(argv)


def test_rows_of_other_weights_or_another_adapter_are_refused_naming_the_folder(small, tmp_path):
    """The resume key holds what made the rows: another adapter's (or other weights', or unrecorded) rows are
    never skipped as done and reported as this run's."""
    from support import files

    model, adapter, base = small
    out = tmp_path / "out"
    out.mkdir()
    ours = dict(weights_id=files.weights_identity(model), adapter_id=kvpress_eval.adapter_identity(adapter))
    for made_by, what in ((dict(ours, adapter_id="0" * 16), "another adapter"),
                          (dict(ours, weights_id="0" * 16), "another weights"), ({}, "another weights and adapter")):
        (out / "results.jsonl").write_text(json.dumps(row("inside", "lookahead", 16, "a", 1.0) | made_by) + "\n")
        said = error_of(["--out", str(out), *base])
        assert f"--out {out} holds rows made with {what}" in said and "pass another --out" in said
    (adapter / "adapter_model.safetensors").write_text("other bytes")  # the same folder, another adapter
    (out / "results.jsonl").write_text(json.dumps(row("inside", "lookahead", 16, "a", 1.0) | ours) + "\n")
    assert "another adapter" in error_of(["--out", str(out), *base])


def test_report_never_replaces_a_file_it_did_not_write(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert "holds no results.jsonl rows: nothing to report" in error_of(["--out", str(out), "--report"])
    (out / "results.jsonl").write_text(json.dumps(row("inside", "full", 0, "a", 1.0)) + "\n")
    (out / "summary.md").write_text("my notes")
    assert "did not write (summary.md)" in error_of(["--out", str(out), "--report"])
    assert (out / "summary.md").read_text() == "my notes"
    (out / "summary.md").unlink()
    kvpress_eval.main(["--out", str(out), "--report"])  # its own summary.md: written, then written again
    kvpress_eval.main(["--out", str(out), "--report"])
    assert "| inside | full | - | 1 | 1.000 |" in (out / "summary.md").read_text()


def test_an_adapter_of_another_model_is_refused_before_the_first_row(tiny_hf_model, tmp_path):
    """The press's fit to --model (its fingerprint) is checked once the model loads, before any row: not after
    FullKV's first row has run."""
    pytest.importorskip("kvpress")
    pytest.importorskip("peft")
    from extensions.export_peft import export_peft
    from lookaheadkv import untrained_module
    from model import load_model

    llama, qwen = tiny_hf_model("llama"), tiny_hf_model("qwen3")
    untrained_module(load_model(llama)).save(tmp_path / "a.safetensors")
    adapter = export_peft(tmp_path / "a.safetensors", tmp_path / "peft", model_folder=llama)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        kvpress_eval.main(["--out", str(out), "--model", str(qwen), "--adapter", str(adapter), "--lengths", "256",
                           "--threads", "1", "--presses", "full,lookahead", "--budgets", "16", "--tasks", "vt",
                           "--per-task", "1", "--protocols", "inside"])
    said = str(e.value)
    assert said.startswith("error: ") and "\n" not in said and "was trained for" in said and str(adapter) in said
    assert not (out / "results.jsonl").exists() or not (out / "results.jsonl").read_text()
