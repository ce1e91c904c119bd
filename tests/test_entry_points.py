"""Every entry point among the research scripts, the analyses, extensions.answer_weights and weights/prepare.py
goes through one front door (support/cli.run): a bad value is one "error: ..." line and exit status 1, before
any model loads; a library module run as a script says how it is used instead of exiting 0 (issue 66).

The walk: each script, each flag, a handful of generic bad values (0, negative, huge, garbage text, a missing
path, an existing file where a folder goes, a folder where a file goes, ""). They run in-process through the
script's main(argv), with loading a model made to fail the test; one subprocess per script checks the contract
where a user meets it (stderr, the exit status, no traceback). generate.py, train.py and research.kvpress_eval
have their own walks (tests/test_cli.py, tests/research/)."""
import importlib
import importlib.util
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/: test_cli's helpers
from test_cli import error_of, one_line, script_error  # noqa: E402

import model  # noqa: E402
from support import cli  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# generic bad values by the kind of flag; {tmp} is a folder holding a file "a-file" and a folder "a-folder"
MISSING, FILE, FOLDER = "{tmp}/no/such/thing", "{tmp}/a-file", "{tmp}/a-folder"
BAD = {
    "count": ["0", "-1", "garbage", "1.5"],
    "threads": ["0", "-1", "99999", "garbage"],
    "tokens": ["0", "-1", "10000000", "garbage"],  # token counts: past any context too
    "counts": ["0", "-1", "garbage", "", "64,,x"],  # comma-separated whole numbers
    "file": [MISSING, FOLDER],
    "folder": [MISSING, FILE],
    "model": [MISSING, FILE, FOLDER],  # a model folder: config.json in it
    "out-file": [FOLDER, ""],
    "out-folder": [FILE, "", "/"],
    "rule": ["max:", "span:8:", "span::1024", "garbage", "max:0"],
}

# script -> (how main is found, the arguments every case starts from, {flag: kind})
SCRIPTS = {
    "-m research.evaluate": ("research.evaluate", ["--device", "cpu", "--out", "{tmp}/out"], {
        "--budgets": "counts", "--lengths": "counts", "--limit": "count", "--threads": "threads",
        "--max-new-tokens": "count", "--model": "model", "--adapter": "file", "--tasks": "file", "--pool": "rule",
        "--out": "out-folder", "--per-task": "count"}),
    "-m research.bench": ("research.bench", ["--device", "cpu"], {
        "--budget": "count", "--lengths": "counts", "--model": "model", "--adapter": "file",
        "--random-init": "file", "--json": "out-file", "--threads": "threads", "--repeats": "count"}),
    "-m extensions.answer_weights": ("extensions.answer_weights", ["--data", "{tmp}/data", "--out", "{tmp}/aw"], {
        "--data": "folder", "--out": "out-folder", "--first": "count", "--threads": "threads", "--model": "model"}),
    "weights/prepare.py": ("weights.prepare", [], {"--out": "out-folder"}),
    "research/analysis/answer_length.py": ("research/analysis/answer_length.py", ["--out", "{tmp}/data"], {
        "--out": "folder", "--tokens": "counts", "--limit": "count", "--model": "model"}),
    "research/analysis/foreign_tasks.py": ("research/analysis/foreign_tasks.py", ["--out", "{tmp}/t.jsonl"], {
        "--out": "out-file", "--per-kind": "count", "--max-chars": "count", "--n-facts": "count"}),
    "research/analysis/learning_curve.py": ("research/analysis/learning_curve.py", ["--heldout", "{tmp}/a-folder"], {
        "--heldout": "folder", "--budget": "count", "--out": "out-file"}),
    "research/analysis/lora_targets.py": ("research/analysis/lora_targets.py", [
        "--heldout", FILE, "--adapters", "a=" + FILE, "--out", "{tmp}/l.jsonl"], {
        "--heldout": "file", "--budgets": "counts", "--limit": "count", "--threads": "threads", "--out": "out-file"}),
    "research/analysis/overhead_parts.py": ("research/analysis/overhead_parts.py", [], {
        "--lengths": "counts", "--calls": "count", "--model": "model", "--adapter": "file"}),
    "research/analysis/prefill_profile.py": ("research/analysis/prefill_profile.py", [], {
        "--length": "tokens", "--budget": "count", "--rounds": "count", "--top": "count", "--threads": "threads",
        "--model": "model", "--adapter": "file", "--json": "out-file"}),
    "research/analysis/reading_trace.py": ("research/analysis/reading_trace.py", [], {"--only": "count"}),
    "research/analysis/paired_heldout.py": ("research/analysis/paired_heldout.py", ["--a", "x", "--b", "y"], {
        "--heldout": "folder"}),
    "research/analysis/paired_runs.py": ("research/analysis/paired_runs.py", ["--b", "{tmp}/a-folder:full"], {
        "--a": "folder"}),
    "research/analysis/plot_eval.py": ("research/analysis/plot_eval.py", ["--tables"], {"": "folder"}),
    "research/analysis/plot_kept.py": ("research/analysis/plot_kept.py", [], {
        "--prompt": "file", "--budget": "count", "--max-new-tokens": "count", "--out": "out-file"}),
    "research/analysis/attention_picture.py": ("research/analysis/attention_picture.py", [], {
        "--prompt": "file", "--budget": "count", "--max-new-tokens": "count", "--out": "out-file"}),
    "research/analysis/span_gate.py": ("research/analysis/span_gate.py", [], {
        "--first": "counts", "--tokens": "tokens", "--model": "model", "--adapter": "file"}),
    "research/analysis/weighted_oracle.py": ("research/analysis/weighted_oracle.py", ["--data", "{tmp}/data"], {
        "--data": "folder", "--rows": "count", "--budgets": "counts", "--threads": "threads", "--model": "model"}),
}

# library modules: run as scripts, each says how it is used (one error line), not exit 0 having done nothing
LIBRARIES = ["extensions.chat", "extensions.decode", "extensions.span", "extensions.layer_budgets",
             "extensions.layer_loss", "research.harness", "research.ruler", "support.cli", "support.selection",
             "support.files", "support.tokenizer", "support.lock"]


def main_of(where):
    """The main() of a module name or of a script's path (the analyses are files, not a package)."""
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(where).stem, ROOT / where)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.main
    return importlib.import_module(where).main


@pytest.fixture
def tmp(tmp_path, monkeypatch):
    """A file, a folder, and a train.py-like data folder; loading or building any model fails the test."""
    (tmp_path / "a-file").write_text("not what any flag wants\n")
    (tmp_path / "a-folder").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "data.jsonl").write_text("")
    fail = lambda *a, **k: pytest.fail("a model was loaded: the check must come first")  # noqa: E731
    monkeypatch.setattr(cli, "load", fail)
    monkeypatch.setattr(model, "load_model", fail)
    monkeypatch.setattr(model, "Transformer", fail)
    return tmp_path


CASES = [(script, flag, value) for script, (_, _, flags) in SCRIPTS.items() for flag, kind in flags.items()
         for value in BAD[kind]]


@pytest.mark.parametrize("script, flag, value", CASES, ids=[f"{s.split('/')[-1]} {f} {v!r}" for s, f, v in CASES])
def test_every_bad_value_is_one_error_line_before_any_model(script, flag, value, tmp):
    where, base, _ = SCRIPTS[script]
    argv = [a.format(tmp=tmp) for a in base] + ([flag] if flag else []) + [value.format(tmp=tmp)]
    one_line(error_of(main_of(where), *argv))


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_keeps_the_contract_in_a_process(script, tmp_path):
    """One run per script, as a user meets it: one line on stderr, exit status 1, no traceback."""
    bad = {"weights/prepare.py": ["--out", ""], "research/analysis/plot_eval.py": ["--tables", str(tmp_path / "no")]}
    one_line(script_error(script, bad.get(script, ["--no-such-flag"])))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # runpy: the module is imported already in this process
@pytest.mark.parametrize("name", LIBRARIES)
def test_a_library_module_says_it_is_not_a_script(name):
    with pytest.raises(SystemExit) as e:
        runpy.run_module(name, run_name="__main__")
    one_line(e.value.code, f"{name} is not a script")


def test_a_library_module_says_so_in_a_process():
    r = subprocess.run([sys.executable, "-m", "extensions.chat"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and r.stdout == "", r.stderr
    assert r.stderr.splitlines() == [one_line(r.stderr.strip(), "generate.py --turns")]
