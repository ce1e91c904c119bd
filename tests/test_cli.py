"""Bad inputs to generate.py end in one line on stderr ("error: ..." saying what to do), exit
status 1 and no traceback; library functions raise exceptions and leave that line to the script.
Most cases are caught before any model loads; --model points nowhere so that a check that came
too late would show up as the wrong message, not as a slow test."""
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import data
import generate as generate_py
import model

ROOT = Path(__file__).resolve().parent.parent
NOWHERE = "no/such/model"


def generate(*argv, stdin=b""):
    return subprocess.run([sys.executable, "generate.py", *argv], cwd=ROOT, input=stdin, capture_output=True,
                          timeout=300)


def assert_one_line_error(r, *needles):
    err = r.stderr.decode("utf-8", "replace")
    lines = err.splitlines()
    assert r.returncode == 1, err
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0] != "error: ", err
    for needle in needles:
        assert needle in lines[0], err


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


# ----------------------------------------------------------------------------- before the model loads

def test_prompt_not_utf8(tmp_path):
    p = tmp_path / "x.txt"
    p.write_bytes(b"\xff" + random.Random(0).randbytes(2999))  # 0xff never occurs in UTF-8
    assert_one_line_error(generate("--prompt", str(p), "--model", NOWHERE),
                          f"prompt file {p} is not UTF-8 text (byte 0xff at offset 0)", "iconv")


def test_prompt_not_found(tmp_path):
    assert_one_line_error(generate("--prompt", str(tmp_path / "missing.txt"), "--model", NOWHERE),
                          "missing.txt not found", "- to read stdin")


def test_prompt_file_empty(tmp_path):
    p = tmp_path / "empty.txt"
    p.write_text("")
    assert_one_line_error(generate("--prompt", str(p), "--model", NOWHERE), "empty.txt) is empty")


def test_prompt_stdin_only_whitespace():
    assert_one_line_error(generate("--prompt", "-", "--model", NOWHERE, stdin=b" \n\t\n"), "(stdin) is empty")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda(prompt):
    assert_one_line_error(generate("--prompt", str(prompt), "--model", NOWHERE, "--device", "cuda"),
                          "CUDA is not available on this machine: use --device cpu")


@pytest.mark.parametrize("device, needle", [("gpu", "is not a device: use cpu or cuda"),
                                            ("meta", "only cpu and cuda are supported")])
def test_device_unknown(prompt, device, needle):
    assert_one_line_error(generate("--prompt", str(prompt), "--model", NOWHERE, "--device", device), needle)


def test_budget_below_one(prompt):
    assert_one_line_error(generate("--prompt", str(prompt), "--model", NOWHERE, "--budget", "0"),
                          "--budget 0", "at least 1")


def test_kernel_even(prompt):
    assert_one_line_error(generate("--prompt", str(prompt), "--model", NOWHERE, "--kernel", "4"),
                          "--kernel 4: pooling width must be odd")


@pytest.mark.parametrize("flag, value, needle", [("--max-new-tokens", "0", "at least 1 token"),
                                                 ("--window", "-1", "must be >= 0")])
def test_other_bad_numbers(prompt, flag, value, needle):
    assert_one_line_error(generate("--prompt", str(prompt), "--model", NOWHERE, flag, value), f"{flag} {value}", needle)


@pytest.mark.parametrize("argv, needle", [
    (["--budget", "-5"], "at least 1"), (["--kernel", "0"], "must be odd"), (["--kernel", "-3"], "must be odd"),
    (["--temperature", "-1"], "must be >= 0"), (["--top-p", "0"], "must be in (0, 1]"),
    (["--top-p", "1.5"], "must be in (0, 1]"), (["--device", "cuda:x"], "is not a device")])
def test_more_bad_values_in_process(argv, needle):  # the same checks, without a subprocess each
    with pytest.raises(ValueError, match=re.escape(needle)):
        generate_py.check_args(generate_py.get_args(["--prompt", "p.txt", *argv]))


def test_good_values_pass_the_checks():
    for argv in ([], ["--budget", "1", "--kernel", "1", "--window", "0", "--max-new-tokens", "1", "--device", "cpu"]):
        generate_py.check_args(generate_py.get_args(["--prompt", "p.txt", *argv]))


def test_adapter_not_found(prompt, tmp_path):
    assert_one_line_error(generate("--prompt", str(prompt), "--model", NOWHERE, "--adapter", str(tmp_path / "a.st")),
                          "a.st not found")


def test_model_folder_not_found(prompt):
    assert_one_line_error(generate("--prompt", str(prompt), "--model", NOWHERE), f"no config.json in {NOWHERE}")


# ----------------------------------------------------------------------------- with a (tiny) model

def test_prompt_longer_than_context(tmp_path, tiny_model):
    p = tmp_path / "long.txt"
    p.write_text("what is two and two ? " * 12)  # 72 tokens > the 64-token context
    assert_one_line_error(generate("--prompt", str(p), "--model", str(tiny_model), "--method", "full",
                                   "--max-new-tokens", "4"),
                          "the prompt is 72 tokens", "context is 64", "shorten the prompt")


def test_no_adapter_for_the_model(prompt, tiny_model):
    assert_one_line_error(generate("--prompt", str(prompt), "--model", str(tiny_model), "--method", "lookahead",
                                   "--max-new-tokens", "4"),
                          "no lookahead adapter for", "train one with python train.py")


def test_good_arguments_still_run(prompt, tiny_model):
    r = generate("--prompt", str(prompt), "--model", str(tiny_model), "--method", "snapkv", "--budget", "4",
                 "--window", "2", "--kernel", "3", "--max-new-tokens", "3", "--device", "cpu", "--json")
    assert r.returncode == 0, r.stderr.decode()
    out = json.loads(r.stdout.decode().strip().splitlines()[-1])
    assert out["prompt_tokens"] == 6 and out["kept_tokens"] == 4  # What is 2 + 2 ?


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


# ----------------------------------------------------------------------------- beyond the paper: decode budget, chat

@pytest.mark.parametrize("argv, needle", [
    (["--every", "0"], "--every 0: evict at most once per generated token"),
    (["--decode-budget", "32"], "--decode-budget 32: it always keeps the last --window 32 slots; use more than 32"),
    (["--decode-budget", "36", "--method", "streaming"], "slots and 4 sinks; use more than 36"),
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
    (["--turns", "t.json", "--budget", "32"], "--budget 32: each turn keeps the last --window 32 slots"),
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


def test_decode_budget_error_is_one_line(prompt):
    assert_one_line_error(generate("--prompt", str(prompt), "--model", NOWHERE, "--decode-budget", "8"),
                          "--decode-budget 8", "smaller --window")


def test_missing_turns_file_and_chat_without_a_chat_format(tmp_path, tiny_model):
    with pytest.raises(SystemExit, match="error: turns file .*none.json not found: pass a JSON list"):
        generate_py.main(["--turns", str(tmp_path / "none.json"), "--model", NOWHERE])
    p = tmp_path / "t.json"
    p.write_text('["what is two ?"]')
    with pytest.raises(SystemExit, match="error: a chat needs a chat format"):
        generate_py.main(["--turns", str(p), "--model", str(tiny_model), "--method", "full", "--device", "cpu"])


def test_decode_budget_runs_and_reports(prompt, tiny_model, capsys):
    out = generate_py.main(["--prompt", str(prompt), "--model", str(tiny_model), "--method", "snapkv", "--budget", "4",
                            "--window", "2", "--decode-budget", "5", "--every", "2", "--max-new-tokens", "12",
                            "--device", "cpu", "--json"])
    slot_bytes = 2 * 8 * 4  # K and V of one layer, one KV head, head_dim 8, float32
    assert out["decode_budget"] == 5 and out["decode_evictions"] == 5  # 4 slots, 11 fed: 7 -> 5 every 2
    assert out["peak_slots"] == 5 + 2 and out["kv_bytes_end"] == 5 * slot_bytes
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == out
