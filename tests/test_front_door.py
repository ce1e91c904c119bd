"""Issue 66, in-process: a closed stdin is one line; a flag is taken whole or refused (a rule with an empty
field, --pool where no row takes it, a number from numpy or torch taken as one); a message names exactly
what is missing; results are keyed by the weights and the adapter that made them; advice deletes only a
folder weights/prepare.py made as it made it."""
import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/: test_cli's helpers
from test_cli import error_of, no_loading, one_line  # noqa: E402, F401 (a fixture)

import methods  # noqa: E402
from extensions import chat  # noqa: E402
from research import bench, evaluate  # noqa: E402
from support import cli, files  # noqa: E402
from support import checks  # noqa: E402
from weights import prepare  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ADAPTER = ROOT / "weights" / "SmolLM2-135M-Instruct.lookahead.safetensors"


# ----------------------------------------------------------------------------- a closed stdin (`<&-`)

def test_a_closed_stdin_is_one_line_in_a_chat(monkeypatch):
    monkeypatch.setattr(sys, "stdin", None)
    with pytest.raises(ValueError, match="stdin is closed"):
        next(chat.stdin_lines())


def test_a_closed_stdin_is_one_line_through_the_front_door(monkeypatch):
    """generate.py --prompt - reads sys.stdin.buffer: under cli.run a closed stdin reads as one error line."""
    monkeypatch.setattr(sys, "stdin", None)
    with pytest.raises(SystemExit) as e:
        cli.run(lambda: sys.stdin.buffer.read(10))
    one_line(e.value.code, "stdin is closed")


def test_an_unforeseen_exception_is_one_line_naming_its_type():
    with pytest.raises(SystemExit) as e:
        cli.run(lambda: {}["key"])
    one_line(e.value.code, "KeyError", "please report it")


# ----------------------------------------------------------------------------- a flag taken whole or refused

@pytest.mark.parametrize("text", ["max:", "avg:", "span:8:", "span::1024", "span:"])
def test_a_rule_with_an_empty_field_is_refused(text):
    with pytest.raises(ValueError, match="empty field"):
        methods.parse_rule(text)


def test_rules_without_the_colon_keep_their_defaults():
    assert [repr(methods.parse_rule(t)) for t in ("max", "max:7", "none")] == ["max:7", "max:7", "none"]


@pytest.mark.parametrize("value", [np.float32(0.5), np.float64(0.5), torch.tensor(0.5), np.int64(1), torch.tensor(1)])
def test_numpy_and_torch_scalars_are_numbers(value):
    assert cli.as_number(value) == float(value)  # read as the Python number it holds
    cli.fraction("--ratio", value)  # and taken by the checks (each raises on what is no number)
    cli.at_least("--budget", value, 0)
    cli.positive("--budget", value)


@pytest.mark.parametrize("value", ["0.5", True, torch.tensor([0.5, 0.5]), None, float("nan")])
def test_what_is_no_number_is_refused_as_one(value):
    with pytest.raises(ValueError, match="--ratio"):
        cli.fraction("--ratio", value)


def test_pool_that_no_row_takes_is_refused_before_loading(no_loading):
    one_line(error_of(evaluate.main, "--methods", "streaming,random", "--pool", "max:3", "--device", "cpu"),
             "--pool max:3", "applies to none")


# ----------------------------------------------------------------------------- messages that name what is missing

@pytest.mark.parametrize("make, said", [(lambda j: None, "is missing"), (lambda j: j.mkdir(), "is a folder")])
def test_an_adapter_without_its_json_names_the_json(tmp_path, make, said):
    tensors = tmp_path / "a.safetensors"
    shutil.copyfile(ADAPTER, tensors)
    make(tmp_path / "a.json")
    with pytest.raises(FileNotFoundError) as e:
        checks.read_adapter(tensors)
    assert f"its metadata {tmp_path / 'a.json'} {said}" in str(e.value) and "not found" not in str(e.value)


@pytest.mark.parametrize("theta", [1.5, 1.0, 50])
def test_an_absurd_rope_theta_is_refused_naming_the_field(tmp_path, theta):
    config = json.loads((ROOT / "weights" / "SmolLM2-135M-Instruct" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_theta": theta}))
    with pytest.raises(ValueError, match="rope_theta is"):
        checks.check_config(tmp_path / "config.json")


# ----------------------------------------------------------------------------- results keyed by what made them

def test_another_adapter_in_an_evaluate_out_is_refused_before_loading(tmp_path, no_loading):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text(json.dumps(dict(settings=dict(adapter="0" * 16), results=[])))
    message = error_of(evaluate.main, "--methods", "lookahead", "--adapter", ADAPTER, "--out", out,
                       "--device", "cpu", "--limit", "1")
    one_line(message, f"--out {out} was made with other settings: adapter {'0' * 16}", "another adapter's",
             files.file_identity(ADAPTER))


def test_bench_rows_of_one_model_from_other_weights_are_refused(tmp_path):
    path = tmp_path / "b.json"
    path.write_text(json.dumps(dict(torch="x", rows=[dict(model="m", weights_id="aaa", adapter_id=None),
                                                     dict(model="other", weights_id="ccc")])))
    args = argparse.Namespace(json=str(path), made_by=dict(weights_id="bbb", adapter_id=None))
    with pytest.raises(ValueError, match=r"holds rows of m made with another weights \(weights_id aaa"):
        bench.check_same_makers(args, "m")
    bench.check_same_makers(args, "other2")  # rows of other models stay welcome
    args.made_by["weights_id"] = "aaa"
    bench.check_same_makers(args, "m")


# ----------------------------------------------------------------------------- advice never deletes what we did not make

def prepared(folder):
    """A folder as prepare.py leaves it: its files, then its marker (stamp) recording them."""
    folder.mkdir()
    for f in prepare.FILES:
        (folder / f).write_text('{"x": 1}\n')
    (folder / prepare.MARKER).write_text(prepare.stamp(folder))
    return folder


def test_a_damaged_folder_prepare_made_is_to_be_rebuilt(tmp_path):
    folder = prepared(tmp_path / "ours")
    assert checks.redo(folder) == f"delete the folder {folder} and rerun python weights/prepare.py --out {folder}"
    assert prepare.not_whole(folder) != "not prepared"  # the longer marker still reads as prepared


def test_a_copy_or_a_changed_folder_is_never_to_be_deleted(tmp_path):
    folder = prepared(tmp_path / "ours")
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    assert "delete" not in checks.redo(copy) and f"a copy of {folder.resolve()}" in checks.redo(copy)
    (folder / "tokenizer.json").write_text('{"another": "tokenizer"}\n')
    assert "delete" not in checks.redo(folder) and "tokenizer.json changed" in checks.redo(folder)


def test_files_that_disagree_are_never_fixed_by_deleting(tmp_path):
    """A tokenizer of another model in a folder with an older marker (the GGUF's sha256 alone): whole files that
    someone put there, so the fix never deletes the folder."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / ".prepared").write_text("sha\n")
    assert "delete" not in checks.redo(folder, damaged=False)
    assert "delete the folder" in checks.redo(folder)  # damage in a folder it made: rebuilt, as before
