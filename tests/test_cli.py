"""Bad inputs to the scripts end in one line ("error: ..." saying what to do), exit status 1 and no
traceback; library functions raise exceptions and leave that line to the script.

One subprocess per script (generate.py, train.py, evaluate.py, bench.py, weights/prepare.py) checks the
contract where a user meets it: stderr, the exit status, no traceback. Every other bad input is checked
in-process, through the script's main(argv): a SystemExit whose message is one "error: ..." line (what
Python prints to stderr, with exit status 1, for a SystemExit with a string)."""
import io
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bench
import data
import evaluate
import generate as generate_py
import model
import train
from weights import prepare

ROOT = Path(__file__).resolve().parent.parent
NOWHERE = "no/such/model"


def one_line(message, *needles):
    assert message.startswith("error: ") and message != "error: ", message
    assert "\n" not in message and "Traceback" not in message, message
    for needle in needles:
        assert needle in message, message
    return message


def error_of(main, *argv):
    """The message of the SystemExit that main(argv) ends with: one "error: ..." line."""
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    assert isinstance(e.value.code, str), e.value.code  # a string: Python prints it and exits with status 1
    return e.value.code


@pytest.fixture
def prompt(tmp_path):
    p = tmp_path / "prompt.txt"
    p.write_text("What is 2+2?")
    return p


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random 1-layer llama with a 64-token context and a word-level tokenizer, written with
    model.py itself (no transformers): enough to reach the checks that need the model."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("tiny")
    config = dict(model_type="llama", vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, eos_token_id=1)
    (folder / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    net = model.Transformer(model.ModelConfig.from_hf_config(folder))
    # named_parameters lists the tied head once, as the embedding; safetensors refuses shared tensors
    save_file({n: p.detach().contiguous() for n, p in net.named_parameters()}, str(folder / "model.safetensors"))
    words = ["[UNK]", "</s>", "what", "is", "two", "and", "?", "."]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(folder / "tokenizer.json"))
    return folder


# ----------------------------------------------------------------------------- the contract, one run per script

@pytest.mark.parametrize("script, argv, needles", [
    ("generate.py", ["--prompt", "{tmp}/missing.txt", "--model", "{model}"], ["missing.txt not found", "- to read stdin"]),
    ("train.py", ["--model", NOWHERE, "--out", "{tmp}/out"], [f"--model {NOWHERE}: no config.json"]),
    ("evaluate.py", ["--methods", "full,bogus", "--model", NOWHERE], ["unknown method(s) bogus"]),
    ("bench.py", ["--quick", "--device", "cpu"], ["--quick is the GPU preset"]),
    ("weights/prepare.py", ["--out", "{tmp}/a-file"], ["a-file is a file"]),
], ids=["generate", "train", "evaluate", "bench", "prepare"])
def test_script_error_is_one_line_on_stderr_with_status_1(script, argv, needles, tmp_path, tiny_model):
    (tmp_path / "a-file").write_text("not a folder")
    argv = [a.format(tmp=tmp_path, model=tiny_model) for a in argv]
    r = subprocess.run([sys.executable, script, *argv], cwd=ROOT, capture_output=True, timeout=300,
                       env={**os.environ, "PIP_NO_INDEX": "1"})  # prepare.py: never the network
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 1, err
    assert len(err.splitlines()) == 1, err  # no traceback, no progress bar, no warning
    one_line(err.rstrip("\n"), *needles)


# ----------------------------------------------------------------------------- generate.py, in-process

def test_prompt_not_utf8(tmp_path, tiny_model):
    p = tmp_path / "x.txt"
    p.write_bytes(b"\xff" + random.Random(0).randbytes(2999))  # 0xff never occurs in UTF-8
    one_line(error_of(generate_py.main, "--prompt", p, "--model", tiny_model),
             f"prompt file {p} is not UTF-8 text (byte 0xff at offset 0)", "iconv")


@pytest.mark.parametrize("text, needle", [("", "empty.txt) is empty"), (" \n\t\n", "empty.txt) is empty")])
def test_prompt_file_empty(tmp_path, tiny_model, text, needle):
    p = tmp_path / "empty.txt"
    p.write_text(text)
    one_line(error_of(generate_py.main, "--prompt", p, "--model", tiny_model), needle)


def test_prompt_stdin_only_whitespace(tiny_model, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b" \n\t\n")))
    one_line(error_of(generate_py.main, "--prompt", "-", "--model", tiny_model), "(stdin) is empty")


@pytest.mark.parametrize("argv, needles", [
    (["--device", "gpu"], ["is not a device: use cpu or cuda"]),
    (["--device", "meta"], ["only cpu and cuda are supported"]),
    (["--budget", "0"], ["--budget 0", "at least 1"]),
    (["--kernel", "4"], ["pooling width 4 must be odd"]),
    (["--max-new-tokens", "0"], ["--max-new-tokens 0", "at least 1 token"]),
    (["--window", "-1"], ["--window -1", "must be >= 0"]),
    (["--method", "snapkv", "--budget", "8"], ["budget 8 is too small for snapkv: it always keeps the last 32"]),
    (["--decode-budget", "8"], ["--decode-budget 8 is below --budget 128"]),
    (["--decode-budget", "8", "--budget", "4"], ["decode budget 8 leaves no room to choose", "smaller window"]),
    (["--adapter", "{tmp}/a.st"], ["a.st not found"]),
    (["--model", NOWHERE], [f"--model {NOWHERE}: no config.json there"]),
])
def test_bad_values_stop_before_the_model_loads(argv, needles, prompt, tmp_path, tiny_model, monkeypatch):
    monkeypatch.setattr(generate_py, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    argv = ["--prompt", prompt, "--model", tiny_model] + [a.format(tmp=tmp_path) for a in argv]
    one_line(error_of(generate_py.main, *argv), *needles)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda(prompt, tiny_model):
    one_line(error_of(generate_py.main, "--prompt", prompt, "--model", tiny_model, "--device", "cuda"),
             "CUDA is not available on this machine: use --device cpu")


@pytest.mark.parametrize("argv, needle", [
    (["--budget", "-5"], "at least 1"), (["--kernel", "0"], "must be odd"), (["--kernel", "-3"], "must be odd"),
    (["--temperature", "-1"], "must be >= 0"), (["--top-p", "0"], "must be in (0, 1]"),
    (["--top-p", "1.5"], "must be in (0, 1]"), (["--device", "cuda:x"], "is not a device"),
    (["--pool", "max", "--kernel", "2"], "pooling width 2 must be odd")])
def test_more_bad_values_in_check_args(argv, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        generate_py.check_args(generate_py.get_args(["--prompt", "p.txt", *argv]))


def test_good_values_pass_the_checks():
    for argv in ([], ["--budget", "1", "--kernel", "1", "--window", "0", "--max-new-tokens", "1", "--device", "cpu"],
                 ["--method", "snapkv", "--budget", "33"], ["--method", "oracle", "--budget", "1"]):
        generate_py.check_args(generate_py.get_args(["--prompt", "p.txt", *argv]))


def test_prompt_longer_than_context(tmp_path, tiny_model):
    p = tmp_path / "long.txt"
    p.write_text("what is two and two ? " * 12)  # 72 tokens > the 64-token context
    one_line(error_of(generate_py.main, "--prompt", p, "--model", tiny_model, "--method", "full",
                      "--max-new-tokens", "4"),
             "the prompt is 72 tokens", "context is 64", "shorten the prompt")


def test_no_adapter_for_the_model(prompt, tiny_model):
    one_line(error_of(generate_py.main, "--prompt", prompt, "--model", tiny_model, "--method", "lookahead",
                      "--max-new-tokens", "4"),
             "no lookahead adapter for", "train one with python train.py")


def test_good_arguments_still_run(prompt, tiny_model, capsys):
    out = generate_py.main(["--prompt", str(prompt), "--model", str(tiny_model), "--method", "snapkv", "--budget", "4",
                            "--window", "2", "--kernel", "3", "--max-new-tokens", "3", "--device", "cpu", "--json"])
    assert out["prompt_tokens"] == 6 and out["kept_tokens"] == 4  # What is 2 + 2 ?
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == out
    assert out["prefill_ms"] > 0 and out["score_ms"] >= 0  # the Stopwatch's two steps


# ----------------------------------------------------------------------------- the other scripts, in-process

@pytest.mark.parametrize("main, argv, needle", [
    (train.main, ["--model", "{model}", "--out", "{tmp}/o", "--n-train", "0"], "--n-train 0: must be at least 1"),
    (train.main, ["--model", "{model}", "--out", "{tmp}/o", "--pool", "avg", "--kernel", "4"], "pooling width 4 must be odd"),
    (train.main, ["--model", "{model}", "--out", "{tmp}/o", "--device", "gpu"], "is not a device"),
    (train.main, ["--model", "{model}", "--out", "{tmp}/o", "--loss-power", "0"], "--loss-power 0.0: must be greater"),
    (evaluate.main, ["--model", "{model}", "--budgets", "8,0"], "--budgets"),
    (evaluate.main, ["--model", "{model}", "--methods", "snapkv", "--budgets", "8", "--window", "8"],
     "budget 8 is too small for snapkv"),
    (bench.main, ["--model", NOWHERE], f"--model {NOWHERE}: no config.json"),
    (bench.main, ["--budget", "0", "--device", "cpu"], "--budget 0: must be at least 1"),
    (prepare.main, ["--out", "{tmp}/a-file"], "a-file is a file"),
], ids=["train-n-train", "train-kernel", "train-device", "train-loss-power", "evaluate-budgets", "evaluate-window", "bench-model",
        "bench-budget", "prepare-out"])
def test_other_scripts_bad_values_in_process(main, argv, needle, tmp_path, tiny_model):
    (tmp_path / "a-file").write_text("not a folder")
    one_line(error_of(main, *[a.format(tmp=tmp_path, model=tiny_model) for a in argv]), needle)


# ----------------------------------------------------------------------------- library functions raise

def test_library_functions_raise_not_exit(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        model.load_model(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        model.Tokenizer(tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl line 2: not valid JSON") as e:
        data.read_jsonl(tmp_path / "bad.jsonl")
    assert not str(e.value).startswith("error:")  # the script adds it
    with pytest.raises(ValueError, match=r"^here is not UTF-8 text \(byte 0xfe at offset 1\)"):
        model.decode_utf8(b"a\xfe", "here")
    assert model.decode_utf8("\ufeffé".encode(), "x") == "é"  # a BOM dropped
    assert data.decode_utf8 is model.decode_utf8  # data files are read as the prompts are
    assert model.resolve_model(tmp_path) == tmp_path  # a given folder as it is: nothing prepared


# ----------------------------------------------------------------------------- beyond the paper: decode budget, chat

@pytest.mark.parametrize("argv, needle", [
    (["--every", "0"], "--every 0: evict at most once per generated token"),
    (["--decode-budget", "32", "--budget", "8"],
     "decode budget 32 leaves no room to choose: it always keeps the last 32 slots; use a budget > 32"),
    (["--decode-budget", "36", "--budget", "8", "--method", "streaming"], "32 slots and 4 sinks; use a budget > 36"),
    (["--decode-budget", "100", "--budget", "128"], "--decode-budget 100 is below --budget 128"),
    (["--decode-budget", "256", "--method", "pyramidkv"], "use --method streaming, snapkv, h2o, lookahead"),
    (["--decode-budget", "256", "--method", "full"], "use --method streaming, snapkv, h2o, lookahead"),
])
def test_bad_decode_eviction_values(argv, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        generate_py.check_args(generate_py.get_args(["--prompt", "p.txt", *argv]))


@pytest.mark.parametrize("argv, needle", [
    ([], "give one of --prompt FILE, --turns FILE.json"),
    (["--prompt", "p.txt", "--chat-loop"], "give one of"),
    (["--turns", "t.json", "--chat-loop"], "give one of"),
    (["--chat-loop", "--method", "laq"], "a chat re-scores the whole cache at each turn"),
    (["--turns", "t.json", "--budget", "32"], "decode budget 32 leaves no room to choose: it always keeps the last 32"),
])
def test_bad_chat_values(argv, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        generate_py.check_args(generate_py.get_args(argv))


def test_good_decode_and_chat_values_pass_the_checks():
    for argv in (["--prompt", "p", "--decode-budget", "128", "--every", "1"], ["--chat-loop", "--method", "full"],
                 ["--turns", "t.json", "--budget", "37", "--method", "streaming", "--window", "32"]):
        generate_py.check_args(generate_py.get_args(argv))


@pytest.mark.parametrize("text, needle", [("[]", "non-empty JSON list"), ('["a", 3]', "non-empty JSON list"),
                                          ('{"a": 1}', "non-empty JSON list"), ('["a", ', "is not valid JSON")])
def test_bad_turns_files(tmp_path, text, needle):
    p = tmp_path / "t.json"
    p.write_text(text)
    with pytest.raises(ValueError, match=re.escape(needle)):
        generate_py.read_turns(p)


def test_missing_turns_file_and_chat_without_a_chat_format(tmp_path, tiny_model):
    one_line(error_of(generate_py.main, "--turns", tmp_path / "none.json", "--model", tiny_model),
             "none.json not found: pass a JSON list")
    p = tmp_path / "t.json"
    p.write_text('["what is two ?"]')
    one_line(error_of(generate_py.main, "--turns", p, "--model", tiny_model, "--method", "full", "--device", "cpu"),
             "a chat needs a chat format")


def test_decode_budget_runs_and_reports(prompt, tiny_model, capsys):
    out = generate_py.main(["--prompt", str(prompt), "--model", str(tiny_model), "--method", "snapkv", "--budget", "4",
                            "--window", "2", "--decode-budget", "5", "--every", "2", "--max-new-tokens", "12",
                            "--device", "cpu", "--json"])
    slot_bytes = 2 * 8 * 4  # K and V of one layer, one KV head, head_dim 8, float32
    assert out["decode_budget"] == 5 and out["decode_evictions"] == 5  # 4 slots, 11 fed: 7 -> 5 every 2
    assert out["peak_slots"] == 5 + 2 and out["kv_bytes_end"] == 5 * slot_bytes
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == out
