"""research/kvpress_eval.py without a model: the order its rows run in, the summary it writes (means and the
paired differences), and the flags it refuses before loading anything. kvpress itself is not needed."""
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
