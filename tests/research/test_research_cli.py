"""Bad inputs to the research scripts (research/evaluate.py, research/bench.py) end in one line, as the core
scripts' do (tests/test_cli.py: the contract and its helpers): "error: ..." saying what to do, exit status 1,
no traceback, and before any model is loaded or built."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: test_cli's helpers
from test_cli import NOWHERE, error_of, no_loading, one_line, script_error  # noqa: F401 (a fixture)

from research import bench
from research import evaluate


@pytest.fixture
def no_building(no_loading, monkeypatch):
    """Nor may bench build its random model: the check must come first."""
    monkeypatch.setattr(bench, "random_model", lambda *a, **k: pytest.fail("the model was built"))


# ----------------------------------------------------------------------------- the contract, one run per script

@pytest.mark.parametrize("script, argv, needles", [
    ("-m research.evaluate", ["--model", NOWHERE], [f"--model {NOWHERE}: no config.json"]),
    ("-m research.bench", ["--quick", "--device", "cpu"], ["--quick is the GPU preset"]),
], ids=["evaluate", "bench"])
def test_script_error_is_one_line_on_stderr_with_status_1(script, argv, needles):
    one_line(script_error(script, argv), *needles)


# ----------------------------------------------------------------------------- bench.py, before loading

@pytest.mark.parametrize("argv, needle", [
    (["--model", NOWHERE], f"--model {NOWHERE}: no config.json"),
    (["--budget", "0"], "--budget 0: must be at least 1"),
    (["--budget", "32"], "row snapkv: budget 32 is too small for snapkv: it always keeps the last 32"),
    (["--json", "{tmp}/d.json"], "d.json is a folder"),
    (["--json", "{tmp}/rows.txt"], "must end in .json"),
    (["--methods", "snapkv,oracle"], "--methods oracle"),
    (["--methods", "full", "--pool"], "unrecognized arguments: --pool (python -m research.bench --help)"),  # argparse's own
    (["--mode", "decode-cost", "--lengths", "6", "--window", "4"], "decode budget 6 leaves no room"),
    (["--mode", "decode-cost", "--methods", "laq"], "--methods laq: not a row of --mode decode-cost"),
    (["--random-init", "{tmp}"], "--random-init"),
    (["--random-init", "{tmp}/c.json", "--adapter", "{tmp}/c.json"], "--adapter: a --random-init"),
    (["--lengths", "0"], "--lengths"),
], ids=["model", "budget", "budget-window", "json-folder", "json-suffix", "oracle", "pool", "decode-cost-window",
        "decode-cost-method", "random-init-folder", "adapter-random", "lengths"])
def test_bench_bad_values_stop_before_the_model_loads(argv, needle, tmp_path, no_building):
    (tmp_path / "c.json").write_text("{}")
    (tmp_path / "d.json").mkdir()
    argv = ["--device", "cpu"] + [a.format(tmp=tmp_path) for a in argv]
    one_line(error_of(bench.main, *argv), needle)


@pytest.mark.parametrize("script, argv, needle", [
    ("bench", ["--nope"], "unrecognized arguments: --nope (python -m research.bench --help)"),
    ("evaluate", ["--budgets"], "argument --budgets: expected one argument (python -m research.evaluate --help)"),
])
def test_argparse_errors_are_one_line_too(script, argv, needle, no_building):
    """A flag argparse itself refuses ends like any other bad input: one `error:` line, exit 1, no usage block."""
    main = {"bench": bench.main, "evaluate": evaluate.main}[script]
    one_line(error_of(main, *argv), needle)
