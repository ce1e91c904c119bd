"""evaluate.py: the metrics on hand-made cases, its errors (one `error:` line before the model loads), the
shared prefill against compress() per budget, the held-out check, and end-to-end runs on a tiny random
Llama (with a word-level chat tokenizer) that take seconds."""

import contextlib
import importlib.util
import io
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from support import cli
from support import data
from research import evaluate
from research import harness
from eviction import compress, greedy
from lookaheadkv import LookaheadModule
from methods import load_adapter, make_scorer
from support.metrics import forced_logprobs
from support import tokenizer
from model import load_model

ROOT = Path(__file__).resolve().parents[2]


# -----------------------------------------------------------------------------
# metrics


def test_fidelity_known_values():
    assert evaluate.fidelity([1, 2, 9], [1, 2, 3, 4]) == (0.5, False)
    assert evaluate.fidelity([1, 2, 3, 4], [1, 2, 3, 4]) == (1.0, True)
    assert evaluate.fidelity([7, 2, 3, 4], [1, 2, 3, 4]) == (0.0, False)
    assert evaluate.fidelity([1, 2], [1, 2, 3, 4]) == (0.5, False)  # stopped early


def test_table_layout():
    res = [dict(id="a", method=m, budget=b, accuracy=v, score_ms=1.0) for m, b, v in
           [("full", 8, 1.0), ("full", 16, 1.0), ("snapkv", 8, 0.0), ("snapkv", 8, 1.0), ("snapkv", 16, None)]]
    assert evaluate.table(res, "accuracy", ["full", "snapkv"], [8, 16]).splitlines() == [
        "| method | C=8 | C=16 |", "|---|---|---|", "| full | 1.000 | 1.000 |", "| snapkv | 0.500 | - |"]


def test_gap_table_and_when_the_report_has_it():
    """Per method and budget, the share of the SnapKV-to-oracle gap closed in answer KL / in recall, from
    the means over samples (metrics.gap_closed); "-" where there is no gap; only with snapkv and oracle."""
    vals = {"full": (0.0, 1.0), "snapkv": (0.4, 0.6), "oracle": (0.1, 0.8), "lookahead": (0.25, 0.65),
            "h2o": (0.55, 0.9)}  # (answer_kl, recall) at C=8; at C=16 the oracle's recall is SnapKV's: no gap
    res = [dict(id=i, method=m, budget=b, answer_kl=kl, recall=rec if b == 8 or m != "oracle" else 0.6,
                accuracy=None)
           for m, (kl, rec) in vals.items() for b in (8, 16) for i in ("a", "b")]
    assert evaluate.gap_table(res, list(vals), [8, 16]).splitlines() == [
        "| method | C=8 | C=16 |", "|---|---|---|", "| lookahead | 50% / 25% | 50% / - |",
        "| h2o | -50% / 150% | -50% / - |"]
    assert "gap closed" in evaluate.report(res, list(vals), [8, 16])
    assert "gap closed" not in evaluate.report([r for r in res if r["method"] != "oracle"],
                                               ["full", "snapkv", "lookahead", "h2o"], [8, 16])
    assert "gap closed" not in evaluate.report(res, list(vals), [8, 16], metrics=["recall"])


def test_first_budget_reaching_90_percent_of_full():
    acc = {"full": [1.0, 1.0, 1.0, 1.0], "snapkv": [0.5, 0.95, 1.0, 1.0], "streaming": [0.2, 0.3, 0.4, 0.89],
           "h2o": [0.9, 0.5, 1.0, 1.0], "oracle": [1.0, 1.0, 1.0, 1.0]}
    budgets = [64, 128, 256, 512]
    res = [dict(id=f"p{i}", method=m, budget=b, accuracy=v) for m, vs in acc.items() for b, v in zip(budgets, vs)
           for i in range(2)]
    reach = {m: evaluate.first_budget_reaching(res, m, budgets) for m in acc}
    assert reach == {"full": 64, "snapkv": 128, "streaming": None, "h2o": 64, "oracle": 64}  # 0.9 counts
    assert evaluate.first_budget_reaching(res, "snapkv", budgets[::-1]) == 128  # the smallest, in any order
    assert evaluate.reach_table(res, list(acc), budgets).splitlines() == [
        "| method | C reaching 90% of FullKV |", "|---|---|", "| snapkv | 128 |", "| streaming | - |", "| h2o | 64 |",
        "| oracle | 64 |"]
    zero = [dict(r, accuracy=0.0) for r in res]  # FullKV never right: nobody "reaches" it
    assert evaluate.first_budget_reaching(zero, "snapkv", budgets) is None
    assert "reaches 90% of FullKV's accuracy (1.000" in evaluate.report(res, list(acc), budgets)


def test_plot_results_has_three_panels(tmp_path, monkeypatch):
    """The figure harness.plot_results saves: recall, answer KL (log axis) and accuracy against C, one line per
    method (FullKV's answer KL of 0 has no place on a log axis: no point); --mode decode adds the
    cache-size panel in front."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure
    import matplotlib.pyplot as plt

    saved, real = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (saved.append(fig), real(fig, *a, **k))[1])
    res = [dict(id="a", method=m, budget=b, accuracy=0.5, recall=0.5, answer_kl=0.0 if m == "full" else 0.1 / b,
                sizes=[b, b + 1, b]) for m in ("full", "snapkv") for b in (8, 16)]
    harness.plot_results(res, ["full", "snapkv"], [8, 16], tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0 and len(saved) == 1
    axes = saved[0].get_axes()
    assert [ax.get_ylabel() for ax in axes] == ["recall", "answer_kl (nats, log)", "accuracy"]
    assert [ax.get_yscale() for ax in axes] == ["linear", "log", "linear"]
    assert all(ax.get_xscale() == "log" and len(ax.get_lines()) == 2 for ax in axes)  # full and snapkv
    full_kl = axes[1].get_lines()[0].get_ydata()
    assert all(math.isnan(y) for y in full_kl)
    harness.plot_results(res, ["full", "snapkv"], [8, 16], tmp_path / "d.png", metrics=("answer_kl",), sizes=True)
    axes = saved[1].get_axes()
    assert [ax.get_ylabel() for ax in axes] == ["KV slots per (layer, KV head)", "answer_kl (nats, log)"]
    assert len(axes[0].get_lines()) == 3  # full, and one line per budget
    for fig in saved:
        plt.close(fig)


def test_learning_curve_gathers_heldout_foreign_and_ruler_runs(tmp_path, monkeypatch, capsys):
    """research/analysis/learning_curve.py: one row per adapter, fewest training prompts first, each column from the run
    that measured it (held-out gap closed against that run's SnapKV and oracle, RULER's mean over tasks); a
    missing or foreign file is one error line."""
    spec = importlib.util.spec_from_file_location("curve", ROOT / "research" / "analysis" / "learning_curve.py")
    curve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(curve)
    assert "evaluate" not in vars(curve)  # no example imports a script
    base = {"answer_kl_snapkv@64": 1.0, "answer_kl_oracle@64": 0.2, "answer_kl_snapkv@128": 0.5,
            "answer_kl_oracle@128": 0.1}
    adapters = [("n1300", 1300, 0.6, 0.3), ("n300", 300, 0.9, 0.4)]  # listed out of order on purpose
    rows = [dict(label="untrained", adapter=None, info={}, metrics=base)] + [
        dict(label=f"runs/{s}.safetensors", adapter=f"runs/{s}.safetensors", info={"train_data": {"n_train": n}},
             metrics={"answer_kl_lookahead@64": k64, "answer_kl_lookahead@128": k128, "recall_lookahead@128": 0.8})
        for s, n, k64, k128 in adapters]
    (tmp_path / "held").mkdir()
    (tmp_path / "held" / "heldout.json").write_text(json.dumps(dict(budgets=[64, 128], rows=rows)))
    foreign = [dict(id="f", method=m, budget=128, answer_kl=v) for m, v in
               (("snapkv", 0.5), ("oracle", 0.1), ("lookahead@n300", 0.3), ("lookahead@n1300", 0.2))]
    ruler = [dict(id=f"{t}{i}", task=t, method="lookahead@n300", budget=128, accuracy=a)
             for t, accs in (("niah", (1.0, 1.0, 0.0)), ("vt", (0.0,))) for i, a in enumerate(accs)]
    for name, res in (("foreign", foreign), ("ruler", ruler)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(dict(settings={}, results=res)))
    got = curve.main(["--heldout", str(tmp_path / "held"), "--foreign", str(tmp_path / "foreign"),
                      "--ruler", str(tmp_path / "ruler")])
    assert [(stem, n) for stem, n, _ in got] == [("n300", 300), ("n1300", 1300)]
    small, large = got[0][2], got[1][2]
    assert small["gap closed, C=64"] == pytest.approx(0.125) and large["gap closed, C=128"] == pytest.approx(0.5)
    assert small["recall@128"] == 0.8 and large["foreign gap closed, C=128"] == pytest.approx(0.75)
    assert small["RULER mean, C=128"] == pytest.approx((2 / 3 + 0.0) / 2)  # over tasks, not over prompts
    assert large["RULER mean, C=128"] is None  # no RULER rows of its own: "-"
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("| adapter | prompts | held-out answer KL, C=64 | gap closed, C=64 |")
    assert printed[2].startswith("| n300 | 300 | 0.900 | 12% |") and printed[3].endswith("| 75% | - |")
    for argv, message in [([], "no .*heldout.json: run evaluate.py --heldout"),
                          (["--ruler", str(tmp_path / "nowhere")], "no .*results.json: run evaluate.py --suite ruler"),
                          (["--out", str(tmp_path / "curve.jpg")], "--out .*curve.jpg: the name must end in .png")]:
        with pytest.raises(SystemExit, match=f"^error: {message}"):
            curve.main(["--heldout", str(tmp_path / ("none" if not argv else "held")), *argv])
    (tmp_path / "held" / "heldout.json").write_text("[]")
    with pytest.raises(SystemExit, match="^error: .*heldout.json is not what evaluate.py writes"):
        curve.main(["--heldout", str(tmp_path / "held")])


def paired_heldout():
    """research/analysis/paired_heldout.py as a module (a script, not a package member), with fewer draws."""
    spec = importlib.util.spec_from_file_location("paired", ROOT / "research" / "analysis" / "paired_heldout.py")
    paired = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(paired)
    paired.DRAWS = 500
    return paired


def write_heldout(folder, budgets, rows, logs):
    """What evaluate.py --heldout --answer-kl --out keeps: heldout.json (rows) and the prompt log ({key: {prompt: values}})."""
    (folder / "heldout.json").write_text(json.dumps(dict(budgets=budgets, answer_kl=True, rows=rows)))
    lines = [json.dumps(dict(key=k, row=p, values=v)) for k, src in logs.items() for p, v in src.items()]
    (folder / "heldout-prompts.jsonl").write_text("\n".join(lines) + "\n")


def test_paired_heldout_matches_modules_by_their_means_and_bootstraps_the_difference(tmp_path, capsys):
    """research/analysis/paired_heldout.py: each heldout.json row is found in the prompt log by its means (another module's
    lines in the log are ignored), the gap closed is the run's, and the paired interval holds the difference;
    b better on every prompt gives an interval above 0. A log that matches no row is one error line."""
    paired = paired_heldout()
    rng = random.Random(1)
    prompts = [f"p{i}" for i in range(20)]
    base = {p: {"answer_kl_snapkv@128": 1.0 + rng.random(), "answer_kl_oracle@128": 0.1 * rng.random()} for p in prompts}
    a = {p: {"answer_kl_lookahead@128": 0.6 + 0.2 * rng.random()} for p in prompts}
    b = {p: {"answer_kl_lookahead@128": a[p]["answer_kl_lookahead@128"] - 0.1 - 0.05 * rng.random()} for p in prompts}
    other = {p: {"answer_kl_lookahead@128": 0.3} for p in prompts}  # a module of another run in the same log
    mean = lambda src, k: sum(v[k] for v in src.values()) / len(src)  # noqa: E731
    rows = [dict(label="untrained", adapter=None, metrics={k: mean(base, k) for k in base["p0"]})] + [
        dict(label=n, adapter=n, metrics={"answer_kl_lookahead@128": mean(src, "answer_kl_lookahead@128")})
        for n, src in (("runs/a.safetensors", a), ("runs/b.safetensors", b))]
    write_heldout(tmp_path, [128], rows, dict(k0=base, ka=a, kb=b, kx=other))
    [(C, ka, ga, kb, gb, (lo, hi), lower, n, (klo, khi))] = paired.main(["--heldout", str(tmp_path), "--a", "runs/a.safetensors",
                                                              "--b", "b.safetensors"])
    snap, oracle = mean(base, "answer_kl_snapkv@128"), mean(base, "answer_kl_oracle@128")
    assert ka == pytest.approx(mean(a, "answer_kl_lookahead@128"))
    assert gb == pytest.approx((snap - kb) / (snap - oracle)) and gb > ga
    assert 0 < lo <= gb - ga <= hi and (C, lower, n) == (128, 20, 20)
    assert klo <= kb - ka <= khi < 0  # b's answer KL lower on every prompt: the interval below 0
    assert "| 128 | " in capsys.readouterr().out
    # two adapters per side (a recipe's seeds): per prompt, their mean; a against itself is 0 exactly
    [(_, ka2, _, kb2, _, _, _, n2, (klo2, khi2))] = paired.main(
        ["--heldout", str(tmp_path), "--a", "runs/a.safetensors,runs/b.safetensors", "--b", "runs/a.safetensors"])
    assert ka2 == pytest.approx((ka + kb) / 2) and kb2 == pytest.approx(ka) and n2 == 20
    assert klo2 <= kb2 - ka2 <= khi2 and khi2 > 0
    write_heldout(tmp_path, [128], rows, dict(k0=base))  # the baselines alone in the log
    with pytest.raises(SystemExit, match="^error: runs/a.safetensors: 0 modules of the prompt log match"):
        paired.main(["--heldout", str(tmp_path), "--a", "runs/a.safetensors", "--b", "runs/b.safetensors"])


def test_paired_heldout_pairs_two_selections_of_one_adapter(tmp_path, capsys):
    """--b-row: the same adapter under two selections (the paper's max-pool 7 against the unpooled top C), each
    side matched by its own row's means; b - a is the per-prompt difference of the two rows. A baseline's name
    on a side is its row of the first module."""
    paired = paired_heldout()
    rng = random.Random(2)
    prompts = [f"p{i}" for i in range(12)]
    base = {p: {"answer_kl_snapkv@64": 1.0 + rng.random(), "answer_kl_oracle@64": 0.1 * rng.random()} for p in prompts}
    a = {}
    for p in prompts:
        pooled = 0.5 + 0.3 * rng.random()
        a[p] = {"answer_kl_lookahead-paper@64": pooled, "answer_kl_lookahead-unpooled@64": pooled - 0.1 * (1 + rng.random())}
    mean = lambda src, k: sum(v[k] for v in src.values()) / len(src)  # noqa: E731
    rows = [dict(label="untrained", adapter=None, metrics={k: mean(base, k) for k in base["p0"]}),
            dict(label="a", adapter="runs/a.safetensors", metrics={k: mean(a, k) for k in a["p0"]})]
    write_heldout(tmp_path, [64], rows, dict(k0=base, ka=a))
    [(C, ka, _, kb, _, _, lower, n, (klo, khi))] = paired.main(
        ["--heldout", str(tmp_path), "--a", "runs/a.safetensors", "--b", "runs/a.safetensors",
         "--row", "lookahead-paper", "--b-row", "lookahead-unpooled"])
    assert ka == pytest.approx(mean(a, "answer_kl_lookahead-paper@64"))
    assert kb == pytest.approx(mean(a, "answer_kl_lookahead-unpooled@64"))
    assert (C, lower, n) == (64, 12, 12) and -0.2 <= klo <= kb - ka <= khi <= -0.1  # every prompt 0.1-0.2 lower
    assert "a, lookahead-paper" in capsys.readouterr().out
    # without --b-row both sides are the same row: a against itself, 0 on every draw
    [(_, ka2, _, kb2, _, _, lower2, _, (klo2, khi2))] = paired.main(
        ["--heldout", str(tmp_path), "--a", "runs/a.safetensors", "--b", "runs/a.safetensors", "--row", "lookahead-paper"])
    assert kb2 == ka2 and (klo2, khi2, lower2) == (0, 0, 0)
    # a baseline's name on a side: its own row of the first module, against the adapter on the same prompts
    [(_, ka3, _, kb3, _, _, lower3, _, (klo3, khi3))] = paired.main(
        ["--heldout", str(tmp_path), "--a", "snapkv", "--b", "runs/a.safetensors", "--row", "lookahead-paper"])
    assert ka3 == pytest.approx(mean(base, "answer_kl_snapkv@64")) and kb3 == pytest.approx(ka)
    assert lower3 == 12 and klo3 <= kb3 - ka3 <= khi3 < 0  # SnapKV's 1-2 nats against the adapter's 0.5-0.8


def test_paired_runs_pairs_one_methods_rows_by_prompt(tmp_path, capsys):
    """research/analysis/paired_runs.py: the prompts both runs hold, per budget both have; b - a with an interval that
    holds it; better/worse counted by the metric's direction (answer KL: lower); other prompts are refused."""
    spec = importlib.util.spec_from_file_location("pruns", ROOT / "research" / "analysis" / "paired_runs.py")
    pruns = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pruns)
    pruns.DRAWS = 500
    acc_a, acc_b = [1, 0, 0, 1, 0, 0], [1, 1, 0, 1, 1, 0]
    for name, accs, method in (("a", acc_a, "lookahead"), ("b", acc_b + [1], "lookahead@x")):
        res = [dict(id=f"t/{i}", task="t", method=method, budget=C, prompt_tokens=100 + i, accuracy=float(v),
                    answer_kl=1.0 - 0.5 * v) for i, v in enumerate(accs) for C in (128, 256)]
        res += [dict(id="t/0", task="t", method="snapkv", budget=64, prompt_tokens=100, accuracy=0.0)]
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(dict(settings={}, results=res)))
    rows = pruns.main(["--a", f"{tmp_path / 'a'}:lookahead", "--b", f"{tmp_path / 'b'}:lookahead@x"])
    assert [r[0] for r in rows] == [128, 256]  # 64: snapkv only
    C, ma, mb, (lo, hi), better, worse, n = rows[0]
    assert (ma, mb, better, worse, n) == (pytest.approx(2 / 6), pytest.approx(4 / 6), 2, 0, 6)  # b's 7th prompt: not in a
    assert 0 <= lo <= mb - ma <= hi  # b never worse: no draw falls below 0
    kl = pruns.main(["--a", f"{tmp_path / 'a'}:lookahead", "--b", f"{tmp_path / 'b'}:lookahead@x", "--metric", "answer_kl"])
    assert kl[0][4:6] == (2, 0) and kl[0][2] < kl[0][1]  # lower answer KL counts as better
    assert "| 128 | 0.333 | 0.667 |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="^error: .*no 'oracle' rows with accuracy \\(its methods: lookahead, snapkv\\)"):
        pruns.main(["--a", f"{tmp_path / 'a'}:oracle", "--b", f"{tmp_path / 'b'}:lookahead@x"])
    res = json.loads((tmp_path / "b" / "results.json").read_text())
    res["results"][0]["prompt_tokens"] = 999
    (tmp_path / "b" / "results.json").write_text(json.dumps(res))
    with pytest.raises(SystemExit, match="^error: prompt t/0 has 100 tokens in one run and 999 in the other"):
        pruns.main(["--a", f"{tmp_path / 'a'}:lookahead", "--b", f"{tmp_path / 'b'}:lookahead@x"])


def test_plot_eval_merges_runs_and_renames_rows(tmp_path, monkeypatch, capsys):
    """research/analysis/plot_eval.py: the baselines of one run next to renamed rows of another."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("plot_eval", ROOT / "research" / "analysis" / "plot_eval.py")
    plot_eval = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_eval)
    assert "evaluate" not in vars(plot_eval)  # no example imports a script
    for name, methods in (("a", ("full", "snapkv", "lookahead")), ("b", ("full", "lookahead"))):
        (tmp_path / name).mkdir()
        rows = [dict(id="p", method=m, budget=b, accuracy=0.5, recall=0.5, answer_kl=0.1) for m in methods for b in (8, 16)]
        (tmp_path / name / "results.json").write_text(json.dumps(dict(settings={}, results=rows)))
    drawn = {}
    monkeypatch.setattr(plot_eval, "plot_results",
                        lambda res, methods, budgets, path: drawn.update(res=res, methods=methods, budgets=budgets))
    plot_eval.main([f"{tmp_path / 'a'}:full,snapkv,lookahead=lookahead unpooled", f"{tmp_path / 'b'}:lookahead=shipped",
                    "--out", str(tmp_path / "p.png")])
    assert drawn["methods"] == ["full", "snapkv", "lookahead unpooled", "shipped"] and drawn["budgets"] == [8, 16]
    assert len(drawn["res"]) == 8  # b's full row was not asked for
    with pytest.raises(SystemExit, match="no .*results.json"):
        plot_eval.main([str(tmp_path / "missing"), "--out", str(tmp_path / "p.png")])
    capsys.readouterr()
    plot_eval.main([f"{tmp_path / 'a'}:snapkv", f"{tmp_path / 'b'}:lookahead=shipped", "--tables"])  # no image
    out = capsys.readouterr().out
    assert "| snapkv | 0.1000 | 0.1000 |" in out and "| shipped | 0.500 | 0.500 |" in out and "wrote" not in out
    with pytest.raises(SystemExit, match="nothing to do"):
        plot_eval.main([str(tmp_path / "a")])


def test_foreign_tasks_cut_at_paragraphs_and_alternate_the_request(tmp_path, monkeypatch):
    """research/analysis/foreign_tasks.py: documents cut at a paragraph end, each request once after and once
    before a document, no expected answers, a task file evaluate.py reads."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("foreign", ROOT / "research" / "analysis" / "foreign_tasks.py")
    foreign = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(foreign)
    text = "\n\n".join(f"paragraph {i} " + "word " * 30 for i in range(40))  # ~6.5K chars
    assert foreign.cut(text, 1000).endswith("word") and len(foreign.cut(text, 1000)) <= 1000
    assert foreign.cut("short", 1000) == "short"
    docs = [(f"reference/t{i}", "reference", text) for i in range(4)] + [("licence/L", "licence", text)]
    monkeypatch.setattr(foreign, "documents", lambda min_chars: docs)
    rows = foreign.build(per_kind=4, max_chars=2000)
    assert [r["id"] for r in rows] == ["reference/t0", "reference/t1", "reference/t2", "reference/t3", "licence/L"]
    asks = foreign.REFERENCE_ASKS
    assert rows[0]["prompt"].endswith(asks[0]) and rows[1]["prompt"].startswith(asks[0])
    assert rows[2]["prompt"].endswith(asks[1]) and rows[3]["prompt"].startswith(asks[1])
    assert all(r["answers"] == [] and len(r["prompt"]) < 2000 + 200 for r in rows)
    out = tmp_path / "t.jsonl"
    foreign.main(["--out", str(out), "--per-kind", "2", "--max-chars", "2000"])
    assert [json.loads(l)["task"] for l in out.read_text().splitlines()] == ["reference", "reference", "licence"]
    # --facts: documents after the first 8 references, one planted fact each with its exact answer, the question last
    docs = [(f"reference/t{i}", "reference", text) for i in range(14)]
    facts = foreign.build_facts(n=6, max_chars=3000)
    assert [r["id"].split("/", 2)[2] for r in facts] == [f"reference/t{i}" for i in range(8, 14)]
    assert [r["task"] for r in facts[:3]] == ["fact_code", "fact_number", "fact_name"]
    for r in facts:
        (value,) = r["answers"]
        assert r["prompt"].count(value) == 1 and r["prompt"].endswith("only.")
        assert r["prompt"].index(value) < r["prompt"].rindex("\n\n")  # planted inside the document
    assert len(facts[0]["answers"][0]) == 5 and len(facts[1]["answers"][0]) == 7 and " " in facts[2]["answers"][0]
    assert foreign.build_facts(n=6, max_chars=3000) == facts  # a fixed seed: the same prompts every time


# -----------------------------------------------------------------------------
# a tiny model, tokenizer, adapter and task file

WORDS = [f"{a}{b}" for a in "bcdfghklmnprstvz" for b in ("a", "e", "i", "o", "u", "ar", "el", "on")]  # 128 words
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]"]  # LlamaConfig's eos id 2 = <|im_end|>


@pytest.fixture(scope="module")
def tiny(tiny_hf_model, tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("eval")
    folder = root / "tiny-llama"
    shutil.copytree(tiny_hf_model("llama", vocab_size=300), folder)
    vocab = {w: i for i, w in enumerate(SPECIALS + ["system", "user", "assistant"] + WORDS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens(SPECIALS)
    tk.save(str(folder / "tokenizer.json"))
    model = load_model(folder)
    torch.manual_seed(1)  # a "trained" adapter: another draw than the untrained row, LoRA B non-zero
    module = LookaheadModule(model.config, n_tokens=4, embed_std=model.model.embed_tokens.weight.std().item())
    with torch.no_grad():
        for p in module.lora.parameters():
            p.normal_(0, 0.1)
    module.save(root / "adapter.safetensors")
    rng = random.Random(0)
    rows = []
    for i, n in enumerate((40, 60, 80)):
        words = [rng.choice(WORDS) for _ in range(n)]
        rows.append(dict(id=f"t{i}", task="copy" if i < 2 else "free", prompt=" ".join(words),
                         answers=[words[n // 2]] if i < 2 else []))
    data.write_jsonl(rows, root / "tasks.jsonl")
    return root


def argv(root, out="out", *extra):
    return ["--model", str(root / "tiny-llama"), "--tasks", str(root / "tasks.jsonl"), "--adapter",
            str(root / "adapter.safetensors"), "--budgets", "8,16", "--window", "4", "--max-new-tokens", "6",
            "--methods", "full,streaming,snapkv,h2o,oracle,lookahead", "--untrained", "--device", "cpu",
            "--out", str(root / out), *extra]


def test_end_to_end_and_resume(tiny, capsys):
    results = evaluate.main(argv(tiny))
    path = tiny / "out" / "results.json"
    saved = json.loads(path.read_text())["results"]
    methods = ["full", "streaming", "snapkv", "h2o", "oracle", "lookahead", "lookahead-untrained"]
    keys = {(r["id"], r["method"], r["budget"]) for r in saved}
    assert len(saved) == len(keys) == 3 * len(methods) * 2 and results == saved
    by = {(r["id"], r["method"], r["budget"]): r for r in saved}
    for (i, m, b), r in by.items():
        assert 0.0 <= r["recall"] <= 1.0 + 1e-6 and 0.0 <= r["fidelity"] <= 1.0 and r["answer_kl"] >= 0.0
        # the oracle keeps the top-C of the very scores recall is measured with
        assert by[i, "oracle", b]["recall"] >= r["recall"] - 1e-6 or m == "full", (i, m, b)
        assert (r["accuracy"] is None) == (i == "t2")  # no answers: no accuracy
        if m == "full":
            assert r["fidelity"] == 1.0 and r["exact"] and r["recall"] == 1.0 and r["answer_kl"] == 0.0
    assert all(by["t0", m, 8]["recall"] < 1.0 for m in methods if m != "full")  # 8 of ~50 slots: eviction happened
    assert all(by["t0", m, 8]["answer_kl"] > 0.0 for m in methods if m != "full")  # ... and the answer felt it
    assert by["t0", "lookahead", 8]["recall"] != by["t0", "lookahead-untrained", 8]["recall"]
    printed = capsys.readouterr().out
    assert "| full | 1.000 | 1.000 |" in printed and "### recall" in printed and "### answer_kl" in printed
    assert "| full | 0.0000 | 0.0000 |" in printed and "reaches 90% of FullKV" in printed
    # what each row selected by, said above the tables (methods.selection_of)
    assert "selection: full (none, nothing evicted); " in printed and "; streaming (none, C in every layer)" in printed
    # snapkv and oracle ran: the headline table, a row per other method, full/snapkv/oracle not among them
    gap = printed[printed.index("### share of the SnapKV-to-oracle gap closed"):].split("\n\n")[1].splitlines()
    assert [l.split(" | ")[0][2:] for l in gap[2:]] == ["streaming", "h2o", "lookahead", "lookahead-untrained"]
    assert gap[2 + 2] == evaluate.gap_table(results, ["lookahead"], [8, 16]).splitlines()[2]  # from the means
    per_task = (tiny / "out" / "results.md").read_text().split("### accuracy per task at C=8")[1].splitlines()
    assert per_task[2].startswith("| method | ") and "| copy |" in per_task[2] and per_task[2].endswith("| mean |")
    full = next(line for line in per_task if line.startswith("| full |")).split(" | ")
    assert full[2] == "-" and full[-1] == full[1] + " |"  # "free" has no answers: "-", the mean is copy's alone

    before, mtime = path.read_bytes(), path.stat().st_mtime_ns
    t0 = time.perf_counter()
    again = evaluate.main(argv(tiny))  # everything is in results.json: nothing to do
    assert time.perf_counter() - t0 < 5 and again == results
    assert path.read_bytes() == before and path.stat().st_mtime_ns == mtime

    # a new budget only adds its entries; the old ones are kept as they were
    more = evaluate.main(argv(tiny) + ["--budgets", "8,16,32", "--limit", "1"])
    saved2 = json.loads(path.read_text())["results"]
    assert saved2[:len(saved)] == saved and len(saved2) == len(saved) + len(methods)
    assert len(more) == 3 * len(methods)

    with pytest.raises(SystemExit, match="other settings: max_new_tokens 6 \\(now 5\\)"):
        evaluate.main(argv(tiny) + ["--max-new-tokens", "5"])
    # the same weights with another selection in the .json are another adapter; so are --pool and --uniform-budgets
    meta = json.loads((tiny / "adapter.json").read_text())
    (tiny / "rule.safetensors").write_bytes((tiny / "adapter.safetensors").read_bytes())
    (tiny / "rule.json").write_text(json.dumps({**meta, "rule": "max:3"}))
    with pytest.raises(SystemExit, match="other settings: adapter_rule none \\(now max:3\\)"):
        evaluate.main(argv(tiny) + ["--adapter", str(tiny / "rule.safetensors")])
    (tiny / "rule.json").write_text(json.dumps({**meta, "layer_weights": [0.5, 1.5]}))  # and other layer budgets
    with pytest.raises(SystemExit, match="other settings: adapter_rule"):
        evaluate.main(argv(tiny) + ["--adapter", str(tiny / "rule.safetensors")])
    with pytest.raises(SystemExit, match="other settings: rule None \\(now span:4\\)"):
        evaluate.main(argv(tiny) + ["--pool", "span:4"])
    with pytest.raises(SystemExit, match="other settings: uniform_budgets False \\(now True\\)"):
        evaluate.main(argv(tiny) + ["--uniform-budgets"])
    assert json.loads(path.read_text())["results"] == saved2  # refused runs leave the file as it was


def test_several_adapters_are_rows_of_one_run(tiny):
    """--adapters A,B in --mode prefill: lookahead becomes lookahead@A and lookahead@B, on the same prefill and
    FullKV answer; each row is its adapter's own (the same results as a run of that adapter alone); a third
    adapter added later runs only its rows; a retrained adapter under the same name is refused."""
    other = tiny / "other.safetensors"  # a second adapter: other weights, the same .json
    module = LookaheadModule.load(tiny / "adapter.safetensors", load_model(tiny / "tiny-llama").config)
    torch.manual_seed(2)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p), alpha=0.3)
    module.save(other)
    base = ["--model", str(tiny / "tiny-llama"), "--tasks", str(tiny / "tasks.jsonl"), "--budgets", "8,16",
            "--window", "4", "--max-new-tokens", "6", "--methods", "snapkv,lookahead", "--device", "cpu"]
    both = evaluate.main(base + ["--adapters", f"{tiny / 'adapter.safetensors'},{other}", "--out", str(tiny / "two")])
    alone = evaluate.main(base + ["--adapter", str(other), "--out", str(tiny / "one")])
    rows = lambda results, m: [{k: v for k, v in r.items() if not k.endswith("_ms") and k != "method"}
                               for r in results if r["method"] == m]
    assert {r["method"] for r in both} == {"full", "snapkv", "lookahead@adapter", "lookahead@other"}
    assert rows(both, "lookahead@other") == rows(alone, "lookahead") != rows(both, "lookahead@adapter")
    assert rows(both, "snapkv") == rows(alone, "snapkv")
    third = tiny / "third.safetensors"
    third.write_bytes(other.read_bytes())
    (tiny / "third.json").write_text((tiny / "other.json").read_text())
    more = evaluate.main(base + ["--adapters", f"{tiny / 'adapter.safetensors'},{other},{third}", "--out",
                                 str(tiny / "two"), "--limit", "1"])
    assert rows(more, "lookahead@third") == rows(more, "lookahead@other")
    retrained = tiny / "retrained" / "other.safetensors"  # other weights under the name "other"
    retrained.parent.mkdir()
    retrained.write_bytes((tiny / "adapter.safetensors").read_bytes())
    retrained.with_suffix(".json").write_text((tiny / "adapter.json").read_text())
    with pytest.raises(SystemExit, match="other settings: adapter@other"):
        evaluate.main(base + ["--adapters", f"{tiny / 'adapter.safetensors'},{retrained}", "--out", str(tiny / "two")])
    with pytest.raises(SystemExit, match="two adapters with one file name"):
        evaluate.main(base + ["--adapters", f"{other},{retrained}", "--out", str(tiny / "three")])


def test_the_papers_form_is_a_row_of_its_own(tiny, capsys):
    """lookahead and lookahead-paper: the adapter selecting as the paper states (max-pool 7, C in every layer),
    the same rows as a run of lookahead with --pool max:7 --uniform-budgets; lookahead-shipped: as its .json
    recommends (here unpooled), beside them in one run."""
    (tiny / "unpooled.safetensors").write_bytes((tiny / "adapter.safetensors").read_bytes())
    (tiny / "unpooled.json").write_text(json.dumps(dict(json.loads((tiny / "adapter.json").read_text()), rule="none")))
    base = ["--model", str(tiny / "tiny-llama"), "--tasks", str(tiny / "tasks.jsonl"), "--budgets", "8,16",
            "--window", "4", "--max-new-tokens", "6", "--device", "cpu", "--adapter", str(tiny / "unpooled.safetensors")]
    one = evaluate.main(base + ["--methods", "snapkv,lookahead,lookahead-paper,lookahead-shipped", "--out",
                                str(tiny / "paper1")])
    said = capsys.readouterr().out
    assert "lookahead-paper (max:7, C in every layer)" in said and "lookahead (max:7, C in every layer)" in said
    assert "lookahead-shipped (none, C in every layer)" in said  # as the adapter's .json recommends
    apart = evaluate.main(base + ["--methods", "lookahead", "--pool", "max:7", "--uniform-budgets", "--out",
                                  str(tiny / "paper2")])
    rows = lambda results, m: [{k: v for k, v in r.items() if not k.endswith("_ms") and k != "method"}
                               for r in results if r["method"] == m]
    assert rows(one, "lookahead-paper") == rows(apart, "lookahead") == rows(one, "lookahead")
    assert rows(one, "lookahead") != rows(one, "lookahead-shipped")


def test_interrupted_run_says_the_command_that_resumes(tiny, monkeypatch):
    """Ctrl-C (or SIGTERM, which cli.run turns into the same) mid-run: one line with the very command."""
    def stop(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(evaluate, "run_sample", stop)
    args = argv(tiny, "out-int")
    with pytest.raises(SystemExit) as e:
        evaluate.main(args)
    message = str(e.value)
    assert message.startswith("interrupted: ") and "\n" not in message
    assert message.endswith("continue with: python -m research.evaluate " + " ".join(args))


def test_selection_rules_and_uniform_budgets_run(tiny):
    """--pool takes rule text (span:K included) and --uniform-budgets keeps C in every layer; the untrained row
    has the adapter's shape and selects as lookahead does (the paper's form unless a flag asks otherwise)."""
    meta = json.loads((tiny / "adapter.json").read_text())
    (tiny / "layered.safetensors").write_bytes((tiny / "adapter.safetensors").read_bytes())
    (tiny / "layered.json").write_text(json.dumps({**meta, "rule": "span:4", "layer_weights": [0.5, 1.5]}))
    base = argv(tiny, "out-rules") + ["--adapter", str(tiny / "layered.safetensors"), "--limit", "1",
                                      "--methods", "snapkv,lookahead"]
    layered = {(r["method"], r["budget"]): r for r in evaluate.main(base)}
    uniform = {(r["method"], r["budget"]): r for r in evaluate.main(
        base + ["--uniform-budgets", "--pool", "max:3", "--out", str(tiny / "out-rules-u")])}
    assert set(layered) == set(uniform) and len(layered) == 4 * 2  # full, snapkv, lookahead, untrained
    assert any(layered[k]["recall"] != uniform[k]["recall"] for k in layered if k[0] != "full")
    model = load_model(tiny / "tiny-llama")
    adapter = load_adapter(tiny / "layered.safetensors", model.config)
    untrained = evaluate.untrained(model, 0, adapter)
    assert untrained.info == {}  # it selects as lookahead does by default: the paper's form
    assert untrained.n_tokens == adapter.n_tokens and untrained.rank == adapter.rank
    assert torch.equal(untrained.embeddings, evaluate.untrained(model, 0, adapter).embeddings)  # seeded


ALL = ["full", "streaming", "random", "snapkv", "pyramidkv", "h2o", "laq", "oracle", "lookahead", "lookahead-untrained"]


def test_budget_holding_the_whole_prompt_is_fullkv(tiny):
    """C >= S evicts nothing: every method's row is FullKV's (answer KL 0, recall 1, same answer)."""
    methods = ",".join(ALL[:-1])  # argv adds lookahead-untrained
    results = evaluate.main(argv(tiny, "out-big") + ["--methods", methods, "--budgets", "8,400", "--limit", "1"])
    assert len(results) == len(ALL) * 2 and results[0]["prompt_tokens"] < 400
    for r in results:
        if r["budget"] == 400:
            assert r["answer_kl"] == pytest.approx(0.0, abs=1e-6) and r["recall"] == 1.0 and r["exact"], r
        elif r["method"] != "full":
            assert r["recall"] < 1.0 and r["answer_kl"] > 0.0, r


@pytest.mark.parametrize("one_prefill", [False, True])
def test_shared_prefill_equals_compress_per_budget(tiny, one_prefill):
    """One prefill (and one scoring) for all budgets keeps the very slots compress() keeps at each
    budget, and gives the same greedy answer; LAQ re-scores per budget on its shared prefill, and
    streaming / random / oracle reuse FullKV's prefill. one_prefill: --mode prefill's way, every method
    watching FullKV's own prefill (evaluate.watchers; LookaheadKV in its two-pass form there)."""
    model = load_model(tiny / "tiny-llama")
    modules = {"lookahead": load_adapter(tiny / "adapter.safetensors", model.config)}
    args = evaluate.get_args(["--window", "4", "--max-new-tokens", "10"])
    torch.manual_seed(0)
    ids = torch.randint(10, 300, (1, 70))
    budgets, diverged = [8, 16, 32], 0
    all_methods = ["full", "snapkv", "pyramidkv", "h2o", "laq", "lookahead", "streaming", "random", "oracle"]
    with torch.no_grad():
        watching = evaluate.watchers({m: budgets for m in all_methods}, ids.shape[1], modules, args) \
            if one_prefill else None
        full = evaluate.reference(model, ids, args.max_new_tokens, stop_ids=[2], watchers=watching)
        # every method that evicts watched the one prefill, but the oracle (it needs the answer first)
        assert set(full.scored) == (set(all_methods) - {"full", "oracle"} if one_prefill else set())
        assert full.logp.shape == (len(full.ref) - 1, model.config.vocab_size)  # answer tokens 2..R
        assert evaluate.answer(model, full.run.cache, full.run.logits, full.logp, full.ref, full.run.next_pos, 10,
                               [2]) == full.ref
        for method in ["snapkv", "pyramidkv", "h2o", "laq", "lookahead", "streaming", "random", "oracle"]:
            caches = list(evaluate.compact_caches(model, ids, method, budgets, full, modules, args))
            assert [c[0] for c in caches] == budgets
            for C, run, cache, kept, prefill_ms, score_ms in caches:
                scorer = make_scorer(evaluate.eviction_config(method, C, args), modules.get(method), full.response)
                ref_cache, logits, pos, ref_kept = compress(model, ids, scorer)
                assert len(kept) == len(ref_kept) and all(torch.equal(a, b) for a, b in zip(kept, ref_kept)), \
                    (method, C)
                assert torch.allclose(run.logits, logits, atol=1e-5) and torch.equal(run.next_pos, pos)
                want = greedy(model, ref_cache, logits, pos, args.max_new_tokens, [2])[0]
                logp = forced_logprobs(model, cache, full.response, run.next_pos)
                got = evaluate.answer(model, cache, run.logits, logp, full.ref, run.next_pos, args.max_new_tokens, [2])
                assert got == want, (method, C)
                assert cache.k[0].shape[2] == kept[0].shape[-1] == ref_kept[0].shape[-1]
                diverged += got != full.ref
    assert diverged > 3  # the answers that start decoding mid-way were checked too


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_end_to_end_on_cuda_in_bfloat16(tiny):
    """bfloat16 on the GPU: kept keys are still found in the full cache (one-pass lookahead's
    prefill is S + M rows long, so its prompt keys may differ from FullKV's by rounding)."""
    args = argv(tiny, "out-cuda")
    args[args.index("--device") + 1] = "cuda"
    results = evaluate.main(args + ["--methods", "full,streaming,snapkv,pyramidkv,h2o,laq,oracle,lookahead"])
    assert len(results) == 3 * 9 * 2
    by = {(r["id"], r["method"], r["budget"]): r for r in results}
    for (i, m, b), r in by.items():
        assert by[i, "oracle", b]["recall"] >= r["recall"] - 1e-6 or m in ("full", "pyramidkv"), (i, m, b)
        assert m != "full" or (r["fidelity"] == 1.0 and r["exact"] and r["answer_kl"] == 0.0)
        assert r["answer_kl"] >= 0.0


@pytest.mark.parametrize("extra, message", [
    (["--methods", "full,snapkv,bogus"], "unknown method\\(s\\) bogus"),
    (["--budgets", "8,0"], "--budgets '8,0': every value must be at least 1"),
    (["--budgets", "8,x"], "--budgets '8,x': expected comma-separated whole numbers"),
    (["--window", "8"], "budget 8 is too small for snapkv: it always keeps the last 8 tokens"),
    (["--pool", "chunk:8"], "selection rule 'chunk:8'"),
    (["--kernel", "5"], "unrecognized arguments: --kernel 5"),
    (["--answer-kl"], "--answer-kl applies to --heldout"),
    (["--plot", "plot.txt"], "--plot plot.txt: the name must end in .png"),
    (["--plot", "TASKS/plot.png"], "--plot .*tasks.jsonl is a file"),
])
def test_argument_errors(tiny, extra, message):
    extra = [x.replace("TASKS", str(tiny / "tasks.jsonl")) for x in extra]
    with pytest.raises(SystemExit, match=f"^error: .*{message}"):
        evaluate.main(argv(tiny) + extra)


def test_plot_without_matplotlib_is_one_line(tiny, tmp_path, monkeypatch):
    """A good --plot path on a machine without matplotlib: one line saying how to get it, before any work."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    with pytest.raises(SystemExit, match=r"^error: --plot needs matplotlib: pip install matplotlib"):
        evaluate.main(argv(tiny) + ["--plot", str(tmp_path / "plot.png")])
    assert not (tmp_path / "plot.png").exists()


def test_missing_adapter_says_how_to_train(tiny):
    with pytest.raises(SystemExit, match=r"^error: --adapter .*nowhere.safetensors: no such file$"):  # before loading
        evaluate.main(argv(tiny) + ["--adapter", str(tiny / "nowhere.safetensors")])
    no_adapter = argv(tiny)
    del no_adapter[no_adapter.index("--adapter"):no_adapter.index("--adapter") + 2]  # none shipped for tiny-llama
    with pytest.raises(SystemExit, match="no lookahead adapter at .*tiny-llama.lookahead.safetensors: train one with "
                                         "python train.py"):
        evaluate.main(no_adapter)


@pytest.mark.parametrize("text, message", [
    ('{"id": "a", "task": "x", "prompt": "ba", "answers": []}\n{"id": "b", "task"\n', "line 2: not valid JSON"),
    ('{"id": "a", "task": "x", "prompt": "ba"}\n', "line 1: missing key\\(s\\) answers"),
    ('{"id": "a", "task": "x", "prompt": "ba", "answers": "ba"}\n', "line 1: 'answers' must be a list"),
    ('{"id": "a", "task": "x", "prompt": "ba", "answers": []}\n' * 2, "line 2: id 'a' again: ids must be unique"),
    ('\n{"id": "a", "task": "x", "prompt": "ba", "answers": []}\n\n{"id": [1], "task": "x", "prompt": "ba", '
     '"answers": []}\n', "line 4: 'id' must be a string or a whole number"),
    ('{"id": "a", "task": 3, "prompt": "ba", "answers": []}\n', "line 1: 'task' must be a string"),
    ("\n\n", "bad.jsonl.*(empty|no tasks in it)"),
    ('{"id": "a", "task": "x", "prompt": "' + "ba " * 600 + '", "answers": []}\n',
     "prompt a is 6.. tokens.*context of 512"),
], ids=["bad-json", "no-answers", "answers-not-list", "duplicate-ids", "id-list", "task-number", "empty", "too-long"])
def test_bad_task_files(tiny, text, message):
    bad = tiny / "bad.jsonl"
    bad.write_text(text)
    args = argv(tiny, "out-bad")
    args[args.index("--tasks") + 1] = str(bad)
    with pytest.raises(SystemExit, match=message):
        evaluate.main(args)


def run_script(*args):
    """evaluate.main as the process runs it: (exit status, printed lines + the exit message). In-process: the
    process contract itself (a string SystemExit is exit 1 with that line on stderr) is tested once per script
    in tests/research/test_research_cli.py."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            evaluate.main(list(args))
            code = 0
        except SystemExit as e:
            code = e.code
    lines = out.getvalue().strip().splitlines()
    if isinstance(code, str):
        return 1, lines + code.splitlines()
    return code or 0, lines


@pytest.mark.parametrize("case", ["id-list", "results-not-ours", "empty-tasks", "nan-flag", "out-is-a-file",
                                  "blank-prompt", "empty-answer", "id-1-and-'1'"])
def test_bad_input_is_one_error_line_before_the_model_loads(tiny, tmp_path, case):
    """Issue 28's process contract: exit status 1, ONE line `error: ...` naming the file or flag, within
    seconds (no model is loaded: --model names a folder whose weights would not even load), nothing overwritten."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # were it loaded, it would fail otherwise
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "a", "task": "x", "prompt": "ba", "answers": []}\n')
    out = tmp_path / "out"
    extra, named = [], None
    if case == "id-list":
        tasks.write_text('{"id": ["a"], "task": "x", "prompt": "ba", "answers": []}\n')
        named = f"{tasks} line 1: 'id'"
    elif case == "results-not-ours":
        out.mkdir()
        (out / "results.json").write_text("[1, 2, 3]")
        named = f"{out / 'results.json'} is not an evaluate.py results file"
    elif case == "empty-tasks":
        tasks.write_text("")
        named = str(tasks)  # "no tasks in it", or data.read_jsonl's own word for an empty file
    elif case == "nan-flag":
        extra, named = ["--window", "nan"], "--window"
    elif case == "out-is-a-file":
        out.write_text("mine")
        named = f"--out {out} is a file"
    elif case == "blank-prompt":  # no token to prefill: an IndexError once the model had loaded, before
        tasks.write_text('{"id": "a", "task": "x", "prompt": " \\n ", "answers": []}\n')
        named = f"{tasks} line 1: 'prompt' is empty: write the text"
    elif case == "empty-answer":  # every output contains "": accuracy 1.0 whatever the model said, before
        tasks.write_text('{"id": "a", "task": "x", "prompt": "ba", "answers": ["be", " "]}\n')
        named = f"{tasks} line 1: 'answers' holds an empty answer"
    elif case == "id-1-and-'1'":  # one key in results.json's prompt digests: made again on every resume, before
        tasks.write_text('{"id": 1, "task": "x", "prompt": "ba", "answers": []}\n'
                         '{"id": "1", "task": "x", "prompt": "be", "answers": []}\n')
        named = f"{tasks} line 2: id '1' again: ids must be unique"
    status, lines = run_script("--model", str(model), "--tasks", str(tasks), "--out", str(out), "--device", "cpu",
                               "--methods", "snapkv", *extra)
    assert status == 1 and len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], lines
    if case == "results-not-ours":
        assert (out / "results.json").read_text() == "[1, 2, 3]" and "move it away or pass another --out" in lines[0]
    if case == "out-is-a-file":
        assert out.read_text() == "mine"
    elif case != "results-not-ours":
        assert not (out / "results.json").exists()


def heldout_folder(root, name, rows):
    folder = root / name
    folder.mkdir(exist_ok=True)
    data.write_jsonl(rows, folder / "data.jsonl")
    return folder


def test_heldout_compares_adapters_with_the_untrained_module(tiny, capsys):
    """--heldout OUT: the held-out rows of OUT/data.jsonl (train rows ignored), the untrained module selecting
    like the first adapter, then each adapter; recall tables and, with --answer-kl, the answer-KL tables; the
    ground truth kept in OUT/heldout, so that a second run only scores."""
    g = torch.Generator().manual_seed(3)
    ids = lambda n: torch.randint(10, 130, (n,), generator=g).tolist()  # noqa: E731
    rows = [dict(id=f"h{i}", split="heldout" if i < 3 else "train", prompt_ids=ids(40 + 10 * i), response_ids=ids(6))
            for i in range(5)]
    folder = heldout_folder(tiny, "held", rows)
    (tiny / "second.safetensors").write_bytes((tiny / "adapter.safetensors").read_bytes())
    meta = json.loads((tiny / "adapter.json").read_text())
    (tiny / "second.json").write_text(json.dumps({**meta, "rule": "avg:3"}))
    args = ["--heldout", str(folder), "--adapters", f"{tiny / 'adapter.safetensors'},{tiny / 'second.safetensors'}",
            "--budgets", "8,16", "--window", "4", "--model", str(tiny / "tiny-llama"), "--device", "cpu"]
    table = evaluate.main(args + ["--answer-kl"])
    assert [label for label, _, _ in table] == ["untrained", str(tiny / "adapter.safetensors"),
                                                str(tiny / "second.safetensors")]
    assert table[0][1].info.get("rule") is None  # like the first adapter, which ships no rule
    for _, _, r in table:
        assert 0 < r["recall_lookahead-unpooled@8"] <= r["recall_oracle@8"] + 1e-6
        assert math.isfinite(r["answer_kl_lookahead-unpooled@16"])  # (clamped at 0 by metrics.answer_kl)
    assert "answer_kl_snapkv@8" in table[0][2] and "answer_kl_snapkv@8" not in table[1][2]  # the baselines once
    assert "answer_kl_lookahead@8" in table[2][2]  # the second adapter's own rule
    printed = capsys.readouterr().out
    assert "| recall@C (3 held-out; gap closed) | C=8 | C=16 |" in printed and "answer KL (3 held-out" in printed
    assert f"| {tiny / 'second.safetensors'}, as shipped (avg:3, C in every layer) |" in printed
    assert f"| {tiny / 'second.safetensors'}, the paper's form (max:7, C in every layer) |" in printed
    assert len(list((folder / "heldout").glob("*.pt"))) == 3  # the held-out rows only
    again = evaluate.main(args + ["--out", str(tiny / "held-out")])  # the ground truth from OUT/heldout; recall only
    assert all(a[2][k] == pytest.approx(b[2][k]) for a, b in zip(table, again) for k in b[2])
    assert "answer KL" not in capsys.readouterr().out
    # --out: every number of the tables in heldout.json, with each row's adapter and its .json; heldout.md as printed
    saved = json.loads((tiny / "held-out" / "heldout.json").read_text())
    assert saved["budgets"] == [8, 16] and saved["held_out_rows"] == 3 and saved["answer_kl"] is False
    assert [r["adapter"] for r in saved["rows"]] == [None, str(tiny / "adapter.safetensors"),
                                                    str(tiny / "second.safetensors")]
    assert [r["metrics"] for r in saved["rows"]] == [r for _, _, r in again] and saved["rows"][2]["info"]["rule"] == "avg:3"
    assert (tiny / "held-out" / "heldout.md").read_text().startswith(harness.tables(again, [8, 16], 3))
    before = (tiny / "held-out" / "heldout.json").read_bytes()
    with pytest.raises(SystemExit, match="^error: --out .*held-out already holds heldout.json .*: move it away"):
        evaluate.main(args + ["--out", str(tiny / "held-out")])  # refused before the model loads: kept as it was
    assert (tiny / "held-out" / "heldout.json").read_bytes() == before


def test_heldout_run_resumes_where_it_was_interrupted(tiny, monkeypatch, capsys):
    """--heldout --out: each prompt's values go into OUT/heldout-prompts.jsonl as they are made; the same command
    after an interruption measures only the prompts left and gives the numbers of a run never stopped; one that
    adds an adapter measures only that one. The lines of other settings (here another --window) or cut short by a
    kill are not used, and the run says so."""
    g = torch.Generator().manual_seed(5)
    ids = lambda n: torch.randint(10, 130, (n,), generator=g).tolist()  # noqa: E731
    rows = [dict(id=f"r{i}", split="heldout", prompt_ids=ids(30 + 10 * i), response_ids=ids(5)) for i in range(3)]
    folder, out = heldout_folder(tiny, "resume", rows), tiny / "resume-out"
    args = ["--heldout", str(folder), "--adapters", str(tiny / "adapter.safetensors"), "--budgets", "8",
            "--answer-kl", "--model", str(tiny / "tiny-llama"), "--device", "cpu"]
    whole = evaluate.main(args + ["--window", "4"])  # no --out: nothing logged
    real, calls = harness.prompt_metrics, []

    def stops_at(n):
        def counted(*a, **kw):
            calls.append(1)
            if len(calls) == n:
                raise KeyboardInterrupt
            return real(*a, **kw)
        calls.clear()
        monkeypatch.setattr(harness, "prompt_metrics", counted)

    stops_at(5)  # 2 modules x 3 prompts: the untrained module's 3 and the adapter's first are logged
    with pytest.raises(SystemExit, match="^interrupted: nothing saved so far is lost"):
        evaluate.main(args + ["--window", "4", "--out", str(out)])
    assert len((out / "heldout-prompts.jsonl").read_text().splitlines()) == 4
    stops_at(1)  # another command on the same --out: measures from the start
    with pytest.raises(SystemExit, match="^interrupted"):
        evaluate.main(args + ["--window", "6", "--out", str(out)])
    assert "0 prompt results of an earlier run kept; 4 lines of other settings" in capsys.readouterr().out
    with open(out / "heldout-prompts.jsonl", "a") as f:
        f.write('{"key": "cut sh')  # a line a kill cut short
    stops_at(0)
    again = evaluate.main(args + ["--window", "4", "--out", str(out)])
    assert len(calls) == 2  # the adapter's last two prompts only
    assert "4 prompt results of an earlier run kept; 1 lines of other settings or modules, or cut short" in \
        capsys.readouterr().out
    assert [r for _, _, r in again] == [r for _, _, r in whole]
    (out / "heldout.json").rename(out / "first.json")
    (tiny / "other.safetensors").write_bytes((tiny / "adapter.safetensors").read_bytes())
    (tiny / "other.json").write_text(json.dumps({**json.loads((tiny / "adapter.json").read_text()), "rule": "avg:3"}))
    calls.clear()
    more = evaluate.main(args[:3] + [f"{tiny / 'adapter.safetensors'},{tiny / 'other.safetensors'}"] + args[4:]
                         + ["--window", "4", "--out", str(out)])
    assert len(calls) == 3 and [r for _, _, r in more][:2] == [r for _, _, r in whole]  # the added adapter's only


@pytest.mark.parametrize("case, message", [
    ("no-data", "no data.jsonl in this folder"),
    ("no-heldout-rows", "has no rows with split \"heldout\": add some with python train.py"),
    ("bad-ids", "data.jsonl line 1: 'prompt_ids' must be a"),
    ("with-tasks", "--tasks does not apply to --heldout"),
    ("id-past-vocab", "data.jsonl: row 'a' holds token id 300, past tiny-llama's vocabulary of 300: pass the --model"),
    ("past-context", "data.jsonl: row 'a' is 601 tokens \\(prompt and answer\\), past tiny-llama's context of 512"),
    ("window-fills-budget", "budget 8 is too small for snapkv: it always keeps the last 32 tokens"),
])
def test_heldout_errors(tiny, tmp_path, case, message):
    folder = tmp_path / "held"
    folder.mkdir()
    row = dict(id="a", split="heldout", prompt_ids=[5, 6, 7], response_ids=[8])
    if case == "no-heldout-rows":
        data.write_jsonl([dict(row, split="train")], folder / "data.jsonl")
    elif case == "bad-ids":
        data.write_jsonl([dict(row, prompt_ids="5 6 7")], folder / "data.jsonl")
    elif case in ("with-tasks", "window-fills-budget"):  # the second: failed once the ground truth was made
        data.write_jsonl([row], folder / "data.jsonl")
    elif case == "id-past-vocab":  # an IndexError in the embedding, before
        data.write_jsonl([dict(row, prompt_ids=[5, 300, 7])], folder / "data.jsonl")
    elif case == "past-context":  # RoPE positions the model never saw, without a word, before
        data.write_jsonl([dict(row, prompt_ids=[5] * 600)], folder / "data.jsonl")
    extra = {"with-tasks": ["--tasks", str(tiny / "tasks.jsonl")],
             "window-fills-budget": ["--budgets", "8,64", "--window", "32"]}.get(case, [])
    with pytest.raises(SystemExit, match=f"^error: .*{message}"):
        evaluate.main(["--heldout", str(folder), "--model", str(tiny / "tiny-llama"), "--device", "cpu", *extra])
    assert not list(folder.glob("heldout/*.pt"))  # no ground truth made


def test_heldout_ground_truth_has_one_writer(tiny, tmp_path, monkeypatch):
    """Two --heldout runs on one OUT would write OUT/heldout's files at once: while a live process holds
    OUT/heldout/.lock, a second run is refused in one line before the model loads, nothing written. The claim
    is OUT/heldout's, not OUT's: a train.py run holding OUT (its data stage appending rows) does not block it."""
    folder = heldout_folder(tmp_path, "held", [dict(id="a", split="heldout", prompt_ids=[5, 6, 7], response_ids=[8])])
    (folder / "heldout").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    reached = []

    def load(*a, **k):  # the claim passed: stop where the model would load
        reached.append((folder / "heldout" / ".lock").read_text())
        raise ValueError("the model loads now")

    monkeypatch.setattr(cli, "load", load)
    args = ["--heldout", str(folder), "--model", str(tiny / "tiny-llama"), "--device", "cpu"]
    try:
        (folder / "heldout" / ".lock").write_text(str(holder.pid))
        status, lines = run_script(*args)
        assert status == 1 and lines == [f"error: --heldout {folder / 'heldout'}: another run (process {holder.pid}) "
                                         f"is writing into this folder: wait for it to end, or pass another --heldout"]
        assert not reached and sorted(p.name for p in (folder / "heldout").iterdir()) == [".lock"]
        (folder / "heldout" / ".lock").unlink()
        (folder / ".lock").write_text(str(holder.pid))  # train.py holds OUT
        assert run_script(*args) == (1, ["error: the model loads now"]) and reached == [str(os.getpid())]
    finally:
        holder.kill()
        holder.wait()
    assert (folder / ".lock").read_text() == str(holder.pid)  # train.py's lock is not ours to take
    assert not (folder / "heldout" / ".lock").exists()  # ours went when the run ended

# -----------------------------------------------------------------------------
# beyond the paper: --mode decode (long answers held to C) and --mode conversation (two turns held to C)


def decode_argv(root, mode, out, *extra):
    return ["--mode", mode, "--model", str(root / "tiny-llama"), "--adapter", str(root / "adapter.safetensors"),
            "--budgets", "12,400", "--every", "4", "--window", "4", "--max-new-tokens", "16", "--device", "cpu",
            "--methods", "streaming,snapkv,h2o,lookahead", "--out", str(root / out), *extra]


def test_decode_mode_end_to_end(tiny, tmp_path, capsys):
    plot = tmp_path / "decode.png" if _has_matplotlib() else None
    args = decode_argv(tiny, "decode", "out-decode", "--tasks", str(tiny / "tasks.jsonl"), "--limit", "2",
                       "--fidelity-tokens", "8", *(["--plot", str(plot)] if plot else []))
    results = evaluate.main(args)
    assert len(results) == 2 * 5 * 2
    by = {(r["id"], r["method"], r["budget"]): r for r in results}
    for (i, m, b), r in by.items():
        S, R = r["prompt_tokens"], r["answer_tokens"]
        full = by[i, "full", b]
        assert full["sizes"] == list(range(S, S + R)) and full["peak_slots"] == S + R - 1 and full["answer_kl"] == 0
        if b == 400:  # holds the prompt and the answer: nothing evicted, FullKV's numbers
            assert r["sizes"] == full["sizes"] and r["answer_kl"] == pytest.approx(0, abs=1e-5), (i, m)
            assert r["head_fidelity"] == 1.0
        elif m != "full":  # compressed to 12 after the prompt, then 12 .. 16 slots while the answer grows
            assert r["sizes"][0] == 12 and max(r["sizes"]) <= 15 and r["peak_slots"] == min(16, 12 + R - 1)
            assert r["answer_kl"] > 0 and 0 <= r["head_fidelity"] <= 1
    printed = capsys.readouterr().out
    assert "### answer_kl" in printed and "### head_fidelity" in printed and "### peak_slots" in printed
    assert "### answer_tokens" in printed
    assert "### recall" not in printed
    if plot:
        assert plot.stat().st_size > 0
    t0 = time.perf_counter()
    assert evaluate.main(args) == results and time.perf_counter() - t0 < 5  # resumed: nothing left to do


def _has_matplotlib():
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def test_conversation_mode_end_to_end(tiny):
    rng = random.Random(1)
    rows = []
    for i in range(2):
        doc = [rng.choice(WORDS) for _ in range(50)]
        rows.append(dict(id=f"c{i}", task="conversation", turns=[" ".join(doc), " ".join(doc[20:23])],
                         answers=[doc[23]]))
    data.write_jsonl(rows, tiny / "conversations.jsonl")
    results = evaluate.main(decode_argv(tiny, "conversation", "out-conv", "--tasks", str(tiny / "conversations.jsonl"),
                                        "--first-answer-tokens", "10", "--max-new-tokens", "6"))
    assert len(results) == 2 * 5 * 2
    by = {(r["id"], r["method"], r["budget"]): r for r in results}
    for (i, m, b), r in by.items():
        full = by[i, "full", b]
        assert r["accuracy"] is not None and r["conversation_tokens"] > r["prompt_tokens"] + 10
        if b == 400 or m == "full":  # nothing evicted: the same answer as FullKV on the whole conversation
            assert r["answer_kl"] == pytest.approx(0, abs=1e-5) and r["fidelity"] == 1.0, (i, m, b)
            assert r["output"] == full["output"] and r["accuracy"] == full["accuracy"]
        else:  # turn 2 added on top of 12 .. 16 slots, and all of it evicted to 12
            assert r["peak_slots"] > 16 and r["answer_kl"] > 0, (i, m)


@pytest.mark.parametrize("mode, extra, message", [
    ("decode", ["--methods", "pyramidkv"], "unknown method\\(s\\) pyramidkv for --mode decode"),
    ("decode", ["--every", "0"], "--every 0: must be a number >= 1"),
    ("decode", ["--budgets", "4,12", "--methods", "h2o"], "budget 4 is too small for h2o"),
    ("conversation", ["--budgets", "8"], "decode budget 8 leaves no room to choose"),
    ("conversation", ["--no-chat"], "needs the chat format"),
])
def test_decode_mode_errors(tiny, mode, extra, message):
    with pytest.raises(SystemExit, match=message):
        evaluate.main(decode_argv(tiny, mode, "out-bad", "--tasks", str(tiny / "tasks.jsonl"), *extra))


def test_conversation_turns_must_be_two_messages(tiny):
    (tiny / "conv-bad.jsonl").write_text('{"id": "a", "task": "x", "turns": ["ba"], "answers": []}\n')
    with pytest.raises(SystemExit, match="'turns' must be a list of two user messages"):
        evaluate.main(decode_argv(tiny, "conversation", "out-bad", "--tasks", str(tiny / "conv-bad.jsonl")))


def test_built_in_long_answer_and_conversation_suites(tiny):
    from support.tokenizer import Tokenizer

    tok = Tokenizer(tiny / "tiny-llama")
    rng = random.Random(2)
    text = lambda: ". ".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(120)) + "."
    docs = [data.Document(src, f"{src}{i}", text()) for src in ("sotu", "essays") for i in range(7)]
    docs += [data.Document("stdlib", f"m{i}.py", "def f(x):\n    return x\n" * 200) for i in range(7)]
    long = evaluate.long_answer_suite(tok, [300, 600], 2, seed=0, docs=docs)
    assert [r["task"] for r in long] == ["long_text"] * 2 + ["long_code"] * 2 + ["long_text"] * 2 + ["long_code"] * 2
    assert len({r["id"] for r in long}) == 8 and all(r["answers"] == [] for r in long)
    for r in long:
        ask = r["prompt"].rsplit("\n\n", 1)[1]
        assert ask in evaluate.LONG_ASKS[r["task"][5:]]
        assert len(tok.encode(tok.chat(r["prompt"]))) <= int(r["id"].split("/")[1])
    conv = evaluate.conversation_suite(tok, [300], 3, seed=0, docs=docs)
    assert len(conv) == 3 and len({r["id"] for r in conv}) == 3
    for r in conv:
        first, second = r["turns"]
        assert second.endswith("Answer in a few words.") and len(r["answers"]) == 1
        assert r["answers"][0] in first and r["answers"][0] not in second  # only turn 1 holds the fact


# -----------------------------------------------------------------------------
# --suite ruler (ruler.make_suite replaced by hand-made samples with its fields: the tiny word-level
# tokenizer cannot spell RULER's essays, keys or numbers)


def ruler_samples(tok, length, per_task, seed=0, **_):
    """Samples as ruler.make_suite gives them: two tasks with their own answer lengths, each answer planted
    in the input, and an answer prefix that opens the assistant's turn."""
    samples = []
    for task, n_answers, tokens_to_generate in (("niah_single_1", 1, 5), ("vt", 2, 7)):
        for i in range(per_task):
            rng = random.Random(f"{seed}-{task}-{i}")  # the same samples on every call (a rerun resumes them)
            words = [rng.choice(WORDS) for _ in range(50)]
            answers = [words[10 + 15 * k] for k in range(n_answers)]
            sample = dict(id=f"{task}/{length}/{seed}-{i}", task=task, length=length, input=" ".join(words) + " ba be",
                          answer_prefix=" bi bo bu", answers=answers, tokens_to_generate=tokens_to_generate,
                          metric="string_match_all")
            samples.append(dict(sample, tokens=len(tok.encode(evaluate.ruler.chat_prompt(tok, sample)))))
    return samples


def ruler_argv(root, out, *extra):
    return ["--suite", "ruler", "--lengths", "300", "--per-task", "2", "--model", str(root / "tiny-llama"),
            "--adapter", str(root / "adapter.safetensors"), "--budgets", "8,16", "--window", "4",
            "--methods", "full,snapkv,lookahead", "--device", "cpu", "--out", str(root / out), *extra]


def test_ruler_suite_end_to_end_and_resume(tiny, monkeypatch, capsys):
    """--suite ruler: each prompt is ruler.chat_prompt's ids (not wrapped in the template again), FullKV and every
    method answer in the task's tokens_to_generate, the score is ruler.score with the sample's metric
    (string_match_all), the tables per task print, --plot draws the score against the share of the prompt kept,
    and a rerun finds nothing left to do."""
    from support.tokenizer import Tokenizer

    monkeypatch.setattr(evaluate.ruler, "make_suite", ruler_samples)
    refs, caps, scored = [], [], []
    real_reference, real_answer, real_score = evaluate.reference, evaluate.answer, evaluate.ruler.score
    monkeypatch.setattr(evaluate, "reference", lambda model, ids, n, stop, watchers=None, known=None: (
        refs.append((ids[0].tolist(), n)), real_reference(model, ids, n, stop, watchers, known))[1])
    monkeypatch.setattr(evaluate, "answer", lambda *a: (caps.append(a[6]), real_answer(*a))[1])
    monkeypatch.setattr(evaluate.ruler, "score", lambda metric, text, answers: (
        scored.append(metric), real_score(metric, text, answers))[1])
    monkeypatch.setattr(evaluate.data, "is_correct", lambda *a: pytest.fail("RULER rows are scored by ruler.score"))
    drawn = []
    if _has_matplotlib():
        from matplotlib.figure import Figure
        monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    args = ruler_argv(tiny, "out-ruler", *(["--plot", str(tiny / "ruler.png")] if _has_matplotlib() else []))
    results = evaluate.main(args)

    tok = Tokenizer(tiny / "tiny-llama")
    samples = ruler_samples(tok, 300, 2)
    prompts = [tok.encode(evaluate.ruler.chat_prompt(tok, s)) for s in samples]
    assert [ids for ids, _ in refs] == prompts and prompts[0] != tok.encode(tok.chat(evaluate.ruler.chat_prompt(
        tok, samples[0])))
    assert [n for _, n in refs] == [5, 5, 7, 7]  # FullKV's answer: the task's tokens_to_generate
    assert caps == [5] * 8 + [7] * 8  # snapkv and lookahead at C = 8, 16, per prompt
    assert len(results) == 4 * 3 * 2 and scored == ["string_match_all"] * len(results)
    by_id = {s["id"]: s for s in samples}
    for r in results:
        assert r["accuracy"] == real_score("string_match_all", r["output"], by_id[r["id"]]["answers"])
        assert r["prompt_tokens"] == by_id[r["id"]]["tokens"]
    printed = capsys.readouterr().out
    assert "### accuracy: share of the expected answers" in printed and "(4 samples)" in printed
    per_task = printed[printed.index("### accuracy per task at C=8 (samples per task: 2)"):]
    lines = per_task.splitlines()
    header, snap = lines[2], next(line for line in lines if line.startswith("| snapkv |"))  # heading, blank, table
    assert header == "| method | niah_single_1 | vt | mean |"
    cells = [float(c) for c in snap.strip("| ").split(" | ")[1:]]
    expect = [sum(r["accuracy"] for r in results if r["task"] == t and r["method"] == "snapkv" and r["budget"] == 8)
              / 2 for t in ("niah_single_1", "vt")]
    assert cells == pytest.approx([*expect, sum(expect) / 2], abs=0.006)
    saved = json.loads((tiny / "out-ruler" / "results.json").read_text())
    assert saved["settings"]["suite"] == "ruler" and saved["settings"]["max_new_tokens"] is None
    if drawn:  # one panel: a line per method over the kept shares, mean C / S
        (ax,) = drawn[0].get_axes()
        shares = [sum(C / s["tokens"] for s in samples) / 4 for C in (8, 16)]
        assert ax.get_xlabel().startswith("share of the prompt kept") and len(ax.get_lines()) == 3
        assert list(ax.get_lines()[1].get_xdata()) == pytest.approx(shares)

    refs.clear()
    before = (tiny / "out-ruler" / "results.json").read_bytes()
    assert evaluate.main(args) == results and refs == []  # resumed: no prompt had work left
    assert (tiny / "out-ruler" / "results.json").read_bytes() == before


@pytest.mark.parametrize("extra, message", [
    (["--max-new-tokens", "9"], "--max-new-tokens does not apply to --suite ruler"),
    (["--mode", "decode"], "--mode does not apply to --suite ruler"),
    (["--no-chat"], "--no-chat does not apply to --suite ruler"),
    (["--suite", "rulers"], "invalid choice: 'rulers'"),
])
def test_ruler_suite_flag_errors(tiny, extra, message):
    with pytest.raises(SystemExit, match=message):
        evaluate.main(ruler_argv(tiny, "out-bad", *extra))


def test_a_changed_task_under_the_same_id_is_made_again(tiny, tmp_path, capsys):
    """Editing a task's prompt in the --tasks file and rerunning into the same --out: its old results go and are
    made again (one line says so), never reported stale; the unchanged tasks are not redone."""
    rows = data.read_jsonl(tiny / "tasks.jsonl", required=("id", "prompt"))[:2]
    tasks = tmp_path / "tasks.jsonl"
    data.write_jsonl(rows, tasks)
    args = argv(tiny, str(tmp_path / "out"), "--methods", "full,snapkv", "--tasks", str(tasks))
    args.remove("--untrained")
    first = {(r["id"], r["method"], r["budget"]): r for r in evaluate.main(args)}
    rows[0]["prompt"] = " ".join(rows[0]["prompt"].split()[:-10])  # the same id, a shorter prompt
    data.write_jsonl(rows, tasks)
    capsys.readouterr()
    again = {(r["id"], r["method"], r["budget"]): r for r in evaluate.main(args)}
    printed = capsys.readouterr().out
    assert "prompt t0 changed since its results were made: made again" in printed and "t1 changed" not in printed
    assert again["t0", "full", 8]["prompt_tokens"] == first["t0", "full", 8]["prompt_tokens"] - 10
    assert again["t1", "snapkv", 8] == first["t1", "snapkv", 8] and "1 of 2 prompts had work left" in printed


@pytest.fixture
def no_loading(monkeypatch):
    """Fails the test if the model loads."""
    monkeypatch.setattr(cli, "load", lambda *a, **k: pytest.fail("the model loaded before the check"))


def refused(args, message):
    """evaluate.main(args) ends in one `error:` line matching message."""
    with pytest.raises(SystemExit, match="^error: " + message) as e:
        evaluate.main(args)
    assert "\n" not in str(e.value)


def test_a_task_prompt_past_the_context_is_refused_by_its_bytes(tiny, tmp_path, monkeypatch):
    """A --tasks prompt whose size in bytes cannot fit the context never reaches the tokenizer: refused while the
    file is read, from config.json's context, before the model loads; where that context is not known then (the
    default model not prepared yet), once it has loaded, still before the tokenizer."""
    tasks = tmp_path / "big.jsonl"
    data.write_jsonl([dict(id="big", task="t", prompt="word " * 8_000, answers=[])], tasks)  # 39 KB > 64 x 512 bytes
    monkeypatch.setattr(tokenizer.Tokenizer, "encode", lambda *a: pytest.fail("the prompt was tokenized"))
    args = argv(tiny, str(tmp_path / "out"), "--tasks", str(tasks), "--methods", "full")
    with monkeypatch.context() as m:
        m.setattr(cli, "load", lambda *a, **k: pytest.fail("the model loaded before the check"))
        refused(args, f"--tasks {tasks} line 1: prompt big is 39 KB, more than the model's context of 512 tokens can "
                      "hold: shorten it$")
    monkeypatch.setattr(evaluate, "early_context", lambda model: None)
    refused(args, r"prompt big is 39 KB, more than the model's context of 512 tokens can hold: shorten it$")


def test_a_conversation_past_the_context_is_refused_by_its_bytes(tiny, tmp_path, monkeypatch):
    """Issue 53: --mode conversation on a file whose turn 2 was huge aborted in the tokenizer ("memory allocation
    of 1140850704 bytes failed", exit 134, no error line): only turn 1 was measured. Both turns share one
    context: their bytes together are checked, before the model loads and again before the tokenizer."""
    tasks = tmp_path / "conv.jsonl"
    data.write_jsonl([dict(id="c", task="t", turns=["ba be", "word " * 8_000], answers=["ba"])], tasks)
    monkeypatch.setattr(tokenizer.Tokenizer, "encode", lambda *a: pytest.fail("a turn was tokenized"))
    args = decode_argv(tiny, "conversation", str(tmp_path / "out"), "--tasks", str(tasks))
    with monkeypatch.context() as m:
        m.setattr(cli, "load", lambda *a, **k: pytest.fail("the model loaded before the check"))
        refused(args, f"--tasks {tasks} line 1: conversation c is 39 KB \\(both turns\\), more than the model's "
                      "context of 512 tokens can hold: shorten it$")
    monkeypatch.setattr(evaluate, "early_context", lambda model: None)
    refused(args, r"conversation c is 39 KB \(both turns\), more than the model's context of 512 tokens")


def test_a_tasks_line_past_what_a_row_can_hold_is_refused_before_it_is_parsed(tiny, tmp_path, monkeypatch,
                                                                               no_loading):
    """Each line is read at most a row's worth at a time (texts and answers within the context, JSON-escaped):
    a longer one is refused by its size, before the file is parsed."""
    tasks = tmp_path / "huge.jsonl"
    data.write_jsonl([dict(id="a", task="t", prompt="ba be", answers=[]),
                      dict(id="b", task="t", prompt="ba", answers=["x" * (400 * 2**10)])], tasks)
    monkeypatch.setattr(data, "read_jsonl", lambda *a, **k: pytest.fail("the file was parsed"))
    limit = 2 * evaluate.JSON_ESCAPE * cli.BYTES_PER_TOKEN * 512
    refused(argv(tiny, str(tmp_path / "out"), "--tasks", str(tasks)),
            f"--tasks {tasks} line 2 is over {limit // 2**10} KB, more than a row for a model with a context of 512 "
            "tokens can hold: shorten it$")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, message", [
    (["--suite", "ruler", "--lengths", "256,100000"], r"--lengths 100000 \(prompt and answer\) is past the model's "
                                                       r"context of 512 tokens: use lengths up to 512$"),
    (["--lengths", "500"], r"--lengths 500 \+ 64 answer tokens is past the model's context of 512 tokens: use "
                           r"lengths up to 448$"),
    (["--mode", "conversation", "--lengths", "400", "--budgets", "16"],
     r"--lengths 400 \+ 128 answer tokens is past the model's context of 512 tokens: use lengths up to 384$"),
], ids=["ruler", "prefill", "conversation"])
def test_suite_lengths_past_the_context_are_refused_before_any_prompt_is_made(tiny, tmp_path, monkeypatch, extra,
                                                                              message):
    """Issue 53: --suite ruler --lengths 100000 was refused only after 41 s of making prompts. The built-in suites'
    lengths (with the answers that follow, where the length is the prompt's) are checked against config.json's
    context before the model loads, and, where it could not be read then, before any prompt is made."""
    def no_prompts(*a, **k):
        pytest.fail("prompts were made before the check")
    monkeypatch.setattr(data, "make_eval_suite", no_prompts)
    monkeypatch.setattr(evaluate.ruler, "make_suite", no_prompts)
    monkeypatch.setattr(evaluate, "conversation_suite", no_prompts)
    args = ["--model", str(tiny / "tiny-llama"), "--methods", "full,snapkv", "--window", "4", "--device", "cpu",
            "--out", str(tmp_path / "out"), *extra]
    with monkeypatch.context() as m:
        m.setattr(cli, "load", lambda *a, **k: pytest.fail("the model loaded before the check"))
        refused(args, message)
    assert not (tmp_path / "out").exists()
    monkeypatch.setattr(evaluate, "early_context", lambda model: None)  # the context known once the model loads
    refused(args, message)


def test_resuming_onto_another_model_s_rows_is_refused(tiny, tiny_hf_model, tmp_path, monkeypatch):
    """Issue 53: resuming an --out made with another model folder of the same name and shape mixed both models'
    rows in one table. results.json's settings keep the model's identity (config.json and samples of its weights
    files); another model's is refused before it loads, naming an --out to use. A copy of the same files resumes."""
    one, other, copy = (tmp_path / d / "tiny-llama" for d in ("one", "other", "copy"))
    shutil.copytree(tiny / "tiny-llama", one)
    shutil.copytree(tiny_hf_model("llama", seed=1, vocab_size=300), other)  # same name and shape, other weights
    shutil.copy(one / "tokenizer.json", other / "tokenizer.json")
    shutil.copytree(one, copy)
    out = tmp_path / "out"

    def args(model):
        return ["--model", str(model), "--tasks", str(tiny / "tasks.jsonl"), "--limit", "1", "--budgets", "8",
                "--window", "4", "--max-new-tokens", "4", "--methods", "full,snapkv", "--device", "cpu",
                "--out", str(out)]
    first = evaluate.main(args(one))
    saved = json.loads((out / "results.json").read_text())
    assert saved["settings"]["model_id"] == evaluate.model_identity(one) != evaluate.model_identity(other)
    with monkeypatch.context() as m:
        m.setattr(cli, "load", lambda *a, **k: pytest.fail("the model loaded before the check"))
        refused(args(other), f"{out / 'results.json'} holds results of another model than {other} \\(model_id "
                             f"{saved['settings']['model_id']}, this one's is {evaluate.model_identity(other)}: the "
                             f"same name and shape, other weights or config\\): pass another --out, e.g. --out "
                             f"{out}-{evaluate.model_identity(other)[:8]}$")
    assert json.loads((out / "results.json").read_text()) == saved
    assert evaluate.main(args(copy)) == first  # the same files elsewhere: the same model, nothing left to do


def test_an_out_folder_of_other_files_is_refused(tiny, tmp_path, no_loading):
    """Issue 53: --out onto a folder holding the user's results.md replaced it. A folder that is neither new,
    empty nor an earlier run's (its results.json) is refused before anything is written."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "results.md").write_text("my notes")
    refused(argv(tiny, str(out)), f"--out {out} holds files evaluate.py did not write \\(results.md\\) and no "
                                  "results.json of an earlier run: pass a new or empty folder$")
    assert [p.name for p in out.iterdir()] == ["results.md"] and (out / "results.md").read_text() == "my notes"


def test_the_harness_runs_without_the_decode_extension():
    """Deleting extensions/decode.py leaves the harness working (tests/test_decode_evict.py checks the core's
    half): in a fresh interpreter where it cannot be imported, research/harness.py imports and scores a prompt's
    held-out metrics' ground truth."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the core half's tiny config
    from test_lookaheadkv import TINY

    code = f"""
import sys, torch
sys.modules["extensions.decode"] = None  # import extensions.decode now raises ImportError
from research import harness
import model
torch.manual_seed(0)
m = model.Transformer(model.ModelConfig(**{TINY!r})).eval()
with torch.no_grad():
    cache, gt, _ = harness.ground_truth(m, list(range(1, 30)), [3, 4, 5])
assert set(gt) == set(range(2)) and gt[0].shape == (1, 4, 29), {{l: g.shape for l, g in gt.items()}}
print("ok")
"""
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
