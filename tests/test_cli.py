"""Bad inputs to the scripts end in one line ("error: ..." saying what to do), exit status 1 and no
traceback; library functions raise exceptions and leave that line to the script (cli.run).

One subprocess per script (generate.py, train.py, weights/prepare.py) checks the
contract where a user meets it: stderr, the exit status, no traceback; one more that a closed pipe
(`| head`) ends quietly. Every other bad input is checked in-process, through the script's main(argv): a
SystemExit whose message is one "error: ..." line (what Python prints to stderr, with exit status 1, for
a SystemExit with a string). One test per class of bad input (issue 28), for generate.py. The research
scripts' (research/evaluate.py, research/bench.py) are in tests/research/test_research_cli.py."""
import argparse
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

from support import cli
from support import data
from support import generate_checks
import methods
import generate as generate_py
import model
from support import tokenizer
import train
from extensions import chat

from weights import prepare

ROOT = Path(__file__).resolve().parent.parent
NOWHERE = "no/such/model"


def one_line(message, *needles):
    assert message.startswith("error: ") and message != "error: ", message
    assert "\n" not in message and "Traceback" not in message, message
    for needle in needles:
        assert needle in message, message
    return message


def check_flags(argv):
    """generate.py's checks of its flags alone (support/generate_checks.py), and of --decode-budget and --turns
    (extensions/decode.py's, which generate.py calls when one is given)."""
    args = generate_py.get_args(argv)
    generate_checks.check_flags(args)
    if args.decode_budget is not None or args.turns is not None:
        from extensions import decode
        decode.check_flags(args, methods.METHODS)


def error_of(main, *argv):
    """The message of the SystemExit that main(argv) ends with: one "error: ..." line."""
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    assert isinstance(e.value.code, str), e.value.code  # a string: Python prints it and exits with status 1
    return e.value.code


@pytest.fixture
def no_loading(monkeypatch):
    """Any attempt to load weights fails the test: the check must come first."""
    fail = lambda *a, **k: pytest.fail("the model was loaded")  # noqa: E731
    monkeypatch.setattr(cli, "load", fail)
    monkeypatch.setattr(generate_py, "load_model", fail)
    import train

    monkeypatch.setattr(train, "load_model", fail)


@pytest.fixture
def prompt(tmp_path):
    p = tmp_path / "prompt.txt"
    p.write_text("What is 2+2?")
    return p


def write_tiny(folder, words, seed=0, poison=None):
    """A random 1-layer llama with a 64-token context and a word-level tokenizer of `words`, written with
    model.py itself (no transformers). poison: a tensor name to fill with NaN (a broken checkpoint)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = dict(model_type="llama", vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, eos_token_id=1)
    (folder / "config.json").write_text(json.dumps(config))
    torch.manual_seed(seed)
    net = model.Transformer(model.ModelConfig.from_hf_config(folder))
    # named_parameters lists the tied head once, as the embedding; safetensors refuses shared tensors
    tensors = {n: p.detach().clone().contiguous() for n, p in net.named_parameters()}
    if poison:
        tensors[poison][0] = float("nan")
    save_file(tensors, str(folder / "model.safetensors"))
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """No chat format: the prompt is fed as it is."""
    return write_tiny(tmp_path_factory.mktemp("tiny"), ["[UNK]", "</s>", "what", "is", "two", "and", "?", "."])


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """The same shapes with a ChatML vocabulary: the prompt is wrapped in the chat template."""
    return write_tiny(tmp_path_factory.mktemp("chat"),
                      ["[UNK]", "</s>", "<|im_start|>", "<|im_end|>", "user", "assistant", "?", "."])


# ----------------------------------------------------------------------------- the contract, one run per script

@pytest.mark.parametrize("script, argv, needles", [
    ("generate.py", ["--prompt", "{tmp}", "--model", "{model}"], ["--prompt", "is a folder"]),
    ("train.py", ["--model", NOWHERE, "--out", "{tmp}/out"], [f"--model {NOWHERE}: no config.json"]),
    ("weights/prepare.py", ["--out", "{tmp}/a-file"], ["a-file is a file"]),
], ids=["generate", "train", "prepare"])
def test_script_error_is_one_line_on_stderr_with_status_1(script, argv, needles, tmp_path, tiny_model):
    (tmp_path / "a-file").write_text("not a folder")
    one_line(script_error(script, [a.format(tmp=tmp_path, model=tiny_model) for a in argv]), *needles)


def script_error(script, argv):
    """`python SCRIPT ARGV` run from the repository root: its stderr, exit status 1 and one line."""
    r = subprocess.run([sys.executable, *script.split(), *argv], cwd=ROOT, capture_output=True, timeout=300,
                       env={**os.environ, "PIP_NO_INDEX": "1"})  # prepare.py: never the network
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 1, err
    assert len(err.splitlines()) == 1, err  # no traceback, no progress bar, no warning
    return err.rstrip("\n")


def test_closed_pipe_ends_quietly(prompt, tiny_model):
    """`generate.py ... | head`: the reader goes away before the answer is written; exit 0, not a word."""
    p = subprocess.Popen([sys.executable, "generate.py", "--prompt", str(prompt), "--model", str(tiny_model),
                          "--method", "full", "--max-new-tokens", "8", "--device", "cpu"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # long before the child has imported torch
    err = p.stderr.read().decode("utf-8", "replace")
    assert p.wait(timeout=300) == 0, err
    assert not re.search(r"error|Traceback|Broken pipe|Exception ignored", err), err


# ----------------------------------------------------------------------------- generate.py: the prompt

def test_prompt_not_utf8(tmp_path, tiny_model):
    p = tmp_path / "x.txt"
    p.write_bytes(b"\xff" + random.Random(0).randbytes(2999))  # 0xff never occurs in UTF-8
    one_line(error_of(generate_py.main, "--prompt", p, "--model", tiny_model),
             f"prompt file {p} is not UTF-8 text (byte 0xff at offset 0)", "iconv")


@pytest.mark.parametrize("text", ["", " \n\t\n"])
def test_prompt_file_empty(tmp_path, tiny_model, text, no_loading):
    p = tmp_path / "empty.txt"
    p.write_text(text)
    one_line(error_of(generate_py.main, "--prompt", p, "--model", tiny_model), "empty.txt) is empty")


def test_prompt_stdin_only_whitespace(tiny_model, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b" \n\t\n")))
    one_line(error_of(generate_py.main, "--prompt", "-", "--model", tiny_model), "(stdin) is empty")


def test_prompt_missing_or_a_folder(tmp_path, tiny_model, no_loading):
    one_line(error_of(generate_py.main, "--prompt", tmp_path / "missing.txt", "--model", tiny_model),
             "--prompt", "missing.txt: no such file")
    one_line(error_of(generate_py.main, "--prompt", tmp_path, "--model", tiny_model), "--prompt", "is a folder")


def test_nul_prompt_answers_with_a_warning(tmp_path, chat_model, capsys):
    """300 NUL bytes are valid UTF-8: removed with a warning; the chat template alone is still answered."""
    p = tmp_path / "nul.txt"
    p.write_bytes(b"\0" * 300)
    out = generate_py.main(["--prompt", str(p), "--model", str(chat_model), "--method", "full",
                            "--max-new-tokens", "3", "--device", "cpu", "--json"])
    err = capsys.readouterr().err
    assert "warning:" in err and "only control characters (300" in err and "nul.txt" in err, err
    assert out["prompt_tokens"] > 0


def test_nul_prompt_without_a_template_is_an_error(tmp_path, tiny_model):
    p = tmp_path / "nul.txt"
    p.write_bytes(b"\0" * 300)
    one_line(error_of(generate_py.main, "--prompt", p, "--model", tiny_model, "--method", "full"),
             "nul.txt", "nothing is left to answer")


def test_control_characters_removed_with_a_warning(tmp_path, tiny_model, capsys):
    p = tmp_path / "p.txt"
    p.write_bytes(b"what is two\0 and two ?\x07")
    out = generate_py.main(["--prompt", str(p), "--model", str(tiny_model), "--method", "full",
                            "--max-new-tokens", "2", "--device", "cpu", "--json"])
    assert out["prompt_tokens"] == 6
    assert "2 control characters" in capsys.readouterr().err


def test_empty_answer_says_why(prompt, tiny_model, capsys, monkeypatch):
    stop = torch.tensor([1])  # the tiny model's eos_token_id
    monkeypatch.setattr(generate_py, "decode", lambda *a, **k: iter([stop]))
    out = generate_py.main(["--prompt", str(prompt), "--model", str(tiny_model), "--method", "full",
                            "--max-new-tokens", "4", "--device", "cpu", "--json"])
    assert out["text"] == ""
    assert "the answer is empty: the model's first token was a stop token (id 1)" in capsys.readouterr().err


def test_nan_weights_name_the_model_folder(tmp_path, prompt):
    folder = write_tiny(tmp_path, ["[UNK]", "</s>", "what", "is", "two", "and", "?", "."],
                        poison="model.norm.weight")
    # the loader or the first logits: whichever sees it first names the folder
    one_line(error_of(generate_py.main, "--prompt", prompt, "--model", folder, "--method", "full", "--device", "cpu",
                      "--max-new-tokens", "4"), str(folder), "NaN", "download")
    with pytest.raises(ValueError, match=f"the model in {re.escape(str(folder))} gives NaN or inf logits"):
        cli.check_logits(torch.tensor([[0.0, float("nan")]]), folder)


def test_prompt_longer_than_context(tmp_path, tiny_model, no_loading):
    p = tmp_path / "long.txt"
    p.write_text("what is two and two ? " * 12)  # 72 tokens > the 64-token context
    one_line(error_of(generate_py.main, "--prompt", p, "--model", tiny_model, "--method", "full",
                      "--max-new-tokens", "4"),
             "the prompt is 72 tokens", "context is 64", "shorten the prompt")


# ----------------------------------------------------------------------------- generate.py: flags, before loading

@pytest.mark.parametrize("argv, needles", [
    (["--device", "gpu"], ["is not a device: use cpu or cuda"]),
    (["--device", "meta"], ["only cpu and cuda are supported"]),
    (["--budget", "0"], ["--budget 0", "at least 1"]),
    (["--pool", "avg:4"], ["--pool avg:4", "must be odd"]),
    (["--pool", "chunk:4"], ["--pool chunk:4", "use none, avg:K, max:K"]),
    (["--max-new-tokens", "0"], ["--max-new-tokens 0", "at least 1 token"]),
    (["--window", "-1"], ["--window -1", "must be >= 0"]),
    (["--temperature", "nan"], ["--temperature nan"]),
    (["--temperature", "inf"], ["--temperature inf"]),
    (["--temperature", "-1"], ["--temperature -1"]),
    (["--top-p", "nan"], ["--top-p nan"]),
    (["--top-p", "0"], ["--top-p 0"]),
    (["--top-p", "1.5"], ["--top-p 1.5"]),
    (["--method", "snapkv", "--two-pass"], ["--two-pass: method snapkv has no lookahead rows"]),
    (["--method", "snapkv", "--budget", "8"], ["budget 8 is too small for snapkv: it always keeps the last 32"]),
    (["--decode-budget", "8"], ["--decode-budget 8 is below --budget 128"]),
    (["--decode-budget", "8", "--budget", "4"], ["decode budget 8 leaves no room to choose", "smaller window"]),
    (["--adapter", "{tmp}/a.safetensors"], ["--adapter", "a.safetensors: no such file"]),
    (["--method", "snapkv", "--adapter", "{tmp}/a.safetensors"], ["--adapter: method snapkv uses no adapter"]),
    (["--model", NOWHERE], [f"--model {NOWHERE}: no config.json there"]),
])
def test_bad_values_stop_before_the_model_loads(argv, needles, prompt, tmp_path, tiny_model, no_loading):
    argv = ["--prompt", prompt, "--model", tiny_model] + [a.format(tmp=tmp_path) for a in argv]
    one_line(error_of(generate_py.main, *argv), *needles)


@pytest.mark.parametrize("method", ["full", "streaming", "random", "oracle"])
def test_pool_refused_by_methods_that_select_by_their_own_scores(method, prompt, tiny_model, no_loading):
    one_line(error_of(generate_py.main, "--prompt", prompt, "--model", tiny_model, "--method", method,
                      "--pool", "avg:5"), f"method {method} selects by its own scores alone", "--pool avg:5")


def test_bad_adapter_stops_before_the_weights_load(prompt, tmp_path, tiny_model, no_loading):
    (tmp_path / "a.safetensors").write_bytes(b"not safetensors")
    (tmp_path / "a.json").write_text("[1, 2]")  # a JSON list, not the metadata object
    one_line(error_of(generate_py.main, "--prompt", prompt, "--model", tiny_model, "--adapter",
                      tmp_path / "a.safetensors", "--max-new-tokens", "4"), "a.json holds a JSON list, not an object",
             "retrain the adapter")


def test_adapter_alpha_that_would_overflow_stops_before_the_weights_load(prompt, tmp_path, tiny_model, no_loading):
    """An adapter .json with "alpha": 1e30 (finite, > 0) gave NaN attention for the M rows and a selection at
    random, with exit 0: now one line naming the file and the key, before the model's weights load."""
    from lookaheadkv import LookaheadModule

    module = LookaheadModule(model.ModelConfig.from_hf_config(tiny_model), n_tokens=4, rank=2)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("_B"):
                p.normal_(0.0, 0.1)  # a trained LoRA: B is not 0
    module.save(tmp_path / "a.safetensors")
    meta = json.loads((tmp_path / "a.json").read_text())
    (tmp_path / "a.json").write_text(json.dumps(dict(meta, alpha=1e30)))
    one_line(error_of(generate_py.main, "--prompt", prompt, "--model", tiny_model, "--adapter",
                      tmp_path / "a.safetensors", "--max-new-tokens", "4"),
             str(tmp_path / "a.safetensors"), "gain (alpha / rank) |B| |A|", '"alpha" 1e+30', "retrain it")


@pytest.mark.parametrize("change, said", [(dict(rank=1e30), "'rank' is 1e+30, not a whole number"),
                                          (dict(rank=None), "'rank' is missing, not a whole number"),
                                          (dict(targets="q_proj"), "'targets' is \"q_proj\", not a list"),
                                          (dict(alpha="32"), "'alpha' is \"32\", not a number")])
def test_adapter_metadata_of_the_wrong_kind_says_what_it_found(prompt, tmp_path, tiny_model, no_loading, change, said):
    from lookaheadkv import LookaheadModule

    LookaheadModule(model.ModelConfig.from_hf_config(tiny_model), n_tokens=4, rank=2).save(tmp_path / "a.safetensors")
    meta = json.loads((tmp_path / "a.json").read_text())
    meta.update({k: v for k, v in change.items() if v is not None})
    for k in [k for k, v in change.items() if v is None]:
        del meta[k]
    (tmp_path / "a.json").write_text(json.dumps(meta))
    one_line(error_of(generate_py.main, "--prompt", prompt, "--model", tiny_model, "--adapter",
                      tmp_path / "a.safetensors", "--max-new-tokens", "4"), str(tmp_path / "a.json"), said,
             "retrain the adapter")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda(prompt, tiny_model):
    one_line(error_of(generate_py.main, "--prompt", prompt, "--model", tiny_model, "--device", "cuda"),
             "CUDA is not available on this machine: use --device cpu")


def test_good_values_pass_the_checks(tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("x")
    for argv in ([], ["--budget", "1", "--pool", "max:1", "--window", "0", "--max-new-tokens", "1", "--device", "cpu"],
                 ["--method", "snapkv", "--budget", "33"], ["--method", "oracle", "--budget", "1"],
                 ["--pool", "span:8", "--two-pass", "--uniform-budgets"], ["--temperature", "0.7", "--top-p", "1"]):
        check_flags(["--prompt", str(p), *argv])


def test_no_adapter_for_the_model(prompt, tiny_model, no_loading):
    one_line(error_of(generate_py.main, "--prompt", prompt, "--model", tiny_model, "--method", "lookahead",
                      "--max-new-tokens", "4"),
             "no lookahead adapter for", "train one with python train.py")


def test_good_arguments_run_and_report_each_step(prompt, tiny_model, capsys):
    out = generate_py.main(["--prompt", str(prompt), "--model", str(tiny_model), "--method", "snapkv", "--budget", "4",
                            "--window", "2", "--pool", "avg:3", "--max-new-tokens", "3", "--device", "cpu", "--json"])
    assert out["prompt_tokens"] == 6 and out["kept_tokens"] == 4  # What is 2 + 2 ?
    assert (out["rule"], out["budgets"]) == ("avg:3", "C in every layer")  # what ran, said
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == out
    # issue 27: the prefill FullKV pays too, apart from what the method adds after it (the Stopwatch's marks)
    assert out["prefill_ms"] > 0 and out["evict_ms"] >= 0 and out["ttft_ms"] >= out["prefill_ms"]
    assert "score_ms" not in out


def test_the_default_run_builds_its_tokenizer_adapter_ids_and_method_once(tmp_path, tiny_model, monkeypatch):
    """generate.py's default run (lookahead, the paper's inference): the checks return what they read (the
    tokenizer, the adapter, the prompt's ids) and generate.py uses it; the method is made once, and its
    compression is lookaheadkv.lookahead_compress, called once."""
    import eviction
    import lookaheadkv

    adapter = tmp_path / "adapter.safetensors"
    torch.manual_seed(0)
    lookaheadkv.LookaheadModule(model.ModelConfig.from_hf_config(tiny_model), n_tokens=4).save(adapter)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(" ".join(["what is two and two ?"] * 4))
    made = dict(tokenizer=0, adapter=0, encode=0, scorer=0, compress=0)

    def counting(key, f):
        def counted(*a, **k):
            made[key] += 1
            return f(*a, **k)
        return counted

    monkeypatch.setattr(tokenizer.Tokenizer, "__init__", counting("tokenizer", tokenizer.Tokenizer.__init__))
    monkeypatch.setattr(tokenizer.Tokenizer, "encode", counting("encode", tokenizer.Tokenizer.encode))
    monkeypatch.setattr(eviction.Scorer, "__init__", counting("scorer", eviction.Scorer.__init__))
    load = lookaheadkv.LookaheadModule.load.__func__
    monkeypatch.setattr(lookaheadkv.LookaheadModule, "load",
                        classmethod(lambda cls, *a, **k: counting("adapter", load)(cls, *a, **k)))
    monkeypatch.setattr(generate_py, "lookahead_compress", counting("compress", generate_py.lookahead_compress))
    out = generate_py.main(["--prompt", str(prompt), "--model", str(tiny_model), "--adapter", str(adapter),
                            "--budget", "8", "--max-new-tokens", "2", "--device", "cpu", "--json"])
    assert (out["method"], out["rule"], out["kept_tokens"]) == ("lookahead", "max:7", 8)
    assert made == dict(tokenizer=1, adapter=1, encode=1, scorer=1, compress=1), made


def test_stats_lines(prompt, tiny_model, capsys):
    generate_py.main(["--prompt", str(prompt), "--model", str(tiny_model), "--method", "snapkv", "--budget", "4",
                      "--window", "2", "--max-new-tokens", "2", "--device", "cpu", "--show"])
    printed = capsys.readouterr().out
    assert re.search(r"^method snapkv \(avg:5, C in every layer\)  budget 4  prompt \d+ tokens", printed, re.M)
    assert re.search(r"^prefill \d+ ms  eviction \d+ ms \(score \+ select \+ gather\)  ttft \d+ ms$", printed, re.M)
    assert re.search(r"^decode [\d.]+ tok/s  KV cache [\d.]+ MB -> [\d.]+ MB$", printed, re.M)
    assert "--- kept tokens" in printed


def test_prepare_bad_out(tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    one_line(error_of(prepare.main, "--out", tmp_path / "a-file"), "a-file is a file")


# ----------------------------------------------------------------------------- library functions raise

def test_library_functions_raise_not_exit(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        model.load_model(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        tokenizer.Tokenizer(tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl line 2: not valid JSON") as e:
        data.read_jsonl(tmp_path / "bad.jsonl")
    assert not str(e.value).startswith("error:")  # the script adds it
    with pytest.raises(ValueError, match=r"^here is not UTF-8 text \(byte 0xfe at offset 1\)"):
        tokenizer.decode_utf8(b"a\xfe", "here")
    assert tokenizer.decode_utf8("\ufeffé".encode(), "x") == "é"  # a BOM dropped
    assert data.decode_utf8 is tokenizer.decode_utf8  # data files are read as the prompts are
    assert cli.resolve_model(tmp_path) == tmp_path  # a given folder as it is: nothing prepared


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
def test_bad_decode_eviction_values(argv, needle, prompt):
    with pytest.raises(ValueError, match=re.escape(needle)):
        check_flags(["--prompt", str(prompt), *argv])


@pytest.mark.parametrize("argv, needle", [
    ([], "give one of --prompt FILE"),
    (["--prompt", "-", "--turns", "-"], "give one of"),
    (["--turns", "-", "--method", "laq"], "a chat re-scores the whole cache at each turn"),
    (["--turns", "-", "--budget", "32"], "decode budget 32 leaves no room to choose: it always keeps the last 32"),
    (["--turns", "{tmp}"], "--turns"),
])
def test_bad_chat_values(argv, needle, tmp_path):
    with pytest.raises(ValueError, match=re.escape(needle)):
        check_flags([a.format(tmp=tmp_path) for a in argv])


def test_good_decode_and_chat_values_pass_the_checks(prompt):
    for argv in (["--prompt", str(prompt), "--decode-budget", "128", "--every", "1"], ["--turns", "-", "--method", "full"],
                 ["--turns", "-", "--budget", "37", "--method", "streaming", "--window", "32"]):
        check_flags(argv)


@pytest.mark.parametrize("text, needle", [("[]", "non-empty JSON list"), ('["a", 3]', "non-empty JSON list"),
                                          ('{"a": 1}', "non-empty JSON list"), ('["a", ', "is not valid JSON"),
                                          ('["\\u0000"]', "non-empty JSON list")])
def test_bad_turns_files(tmp_path, text, needle):
    p = tmp_path / "t.json"
    p.write_text(text)
    with pytest.raises(ValueError, match=re.escape(needle)):
        chat.read_turns(p)


def test_missing_turns_file_and_chat_without_a_chat_format(tmp_path, tiny_model, no_loading):
    one_line(error_of(generate_py.main, "--turns", tmp_path / "none.json", "--model", tiny_model),
             "--turns", "none.json: no such file")
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


def test_chat_on_stdin_runs(chat_model, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"user ?\n\n/reset\nuser .\n")))
    out = generate_py.main(["--turns", "-", "--model", str(chat_model), "--method", "full", "--max-new-tokens", "2",
                            "--device", "cpu", "--json"])
    assert [t["turn"] for t in out] == [1, 1]  # /reset: a new conversation
    assert '{"reset": true}' in capsys.readouterr().out


@pytest.mark.parametrize("script, argv, needle", [
    ("generate", ["--budget", "1.5"], "argument --budget: invalid int value: '1.5' (python generate.py --help)"),
    ("train", ["--epochs", "x"], "argument --epochs: invalid float value: 'x' (python train.py --help)"),
])
def test_argparse_errors_are_one_line_too(script, argv, needle, no_loading):
    """A flag argparse itself refuses ends like any other bad input: one `error:` line, exit 1, no usage block."""
    main = {"generate": generate_py.main, "train": train.main}[script]
    one_line(error_of(main, *argv), needle)


def test_a_prompt_file_too_big_for_the_context_is_refused_by_its_size(tiny_model, tmp_path, monkeypatch, no_loading):
    """tiny_model's context is 64 tokens: a file over 64 x 64 bytes cannot fit, and is refused before it is read
    or tokenized (a 200 MB prompt once took all the memory in the tokenizer)."""
    big = tmp_path / "big.txt"
    big.write_text("what is two ? " * 400)  # 5.6 KB
    monkeypatch.setattr(tokenizer.Tokenizer, "encode", lambda *a: pytest.fail("the prompt was tokenized"))
    one_line(error_of(generate_py.main, "--prompt", big, "--model", tiny_model, "--method", "full"),
             f"the prompt (prompt file {big}) is over 4 KB", "shorten it")


def test_one_writer_per_output_folder(tmp_path):
    """cli.claim_folder: a live process's lock refuses a second writer in one line; a killed run's lock (a dead
    process id) is replaced; the same process may claim again; the lock goes when the process ends."""
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (out / ".lock").write_text(str(holder.pid))
        with pytest.raises(ValueError, match=rf"--out {out}: another run \(process {holder.pid}\) is writing"):
            cli.claim_folder("--out", out)
    finally:
        holder.kill()
        holder.wait()
    cli.claim_folder("--out", out)  # the holder is dead: its lock is stale, and replaced
    assert (out / ".lock").read_text() == str(os.getpid())
    cli.claim_folder("--out", out)  # this process again: fine
    code = f"from support import cli; cli.claim_folder('--out', {str(out)!r}); print('held')"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1 and "another run" in r.stderr  # a second live process is refused
    cli.release_folders()  # what run() does when a script's work ends
    assert not (out / ".lock").exists()
    cli.claim_folder("--out", out)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1 and "another run" in r.stderr  # a second live process is refused
    other = tmp_path / "other"
    other.mkdir()
    r = subprocess.run([sys.executable, "-c", code.replace(str(out), str(other))], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.stdout.strip() == "held" and not (other / ".lock").exists()  # released when that process ended
    cli.release_folders()


def test_a_shared_folder_lock_waits_for_its_holder_and_is_released_alone(tmp_path):
    """lock.claim_folder(wait=...): weights/prepare.py's download cache, shared by every prepared folder, is
    waited for (said once) while another live process holds it, refused once the wait is over, and
    release_folder frees that one lock, not the others this process holds."""
    from support import lock

    cache, out = tmp_path / "cache", tmp_path / "out"
    cache.mkdir()
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    (cache / ".lock").write_text(str(holder.pid))
    said = []
    with pytest.raises(ValueError, match=rf"the download cache {cache}: another run \(process {holder.pid}\) is "
                                         r"writing into this folder: wait for it to end$"):
        lock.claim_folder("the download cache", cache, wait=0.3, say=said.append)
    import threading

    threading.Thread(target=holder.wait).start()  # reaped when it ends (a zombie child would look alive)
    lock.claim_folder("the download cache", cache, wait=30, say=said.append)  # the holder ends within the wait
    assert said == [f"waiting for process {holder.pid}, which is writing into {cache}"] * 2
    assert (cache / ".lock").read_text() == str(os.getpid())
    lock.claim_folder("--out", out)
    lock.release_folder(cache)
    assert not (cache / ".lock").exists() and (out / ".lock").exists()
    lock.release_folders()
    assert not (out / ".lock").exists()


def test_the_sampler_is_greedy_at_zero_and_draws_from_the_nucleus_only():
    """decode()'s pick for --temperature/--top-p: None (greedy) at 0; else draws cut to the nucleus, by --seed."""
    def sampler(temperature, top_p, seed=0):
        return generate_py.sampler(argparse.Namespace(temperature=temperature, top_p=top_p, seed=seed, device="cpu"))
    assert sampler(0.0, 0.5) is None
    logits = torch.tensor([[0.0, 3.0, 2.9, -5.0]])  # softmax ~ (0.026, 0.512, 0.463, 0.0002)
    top = sampler(1.0, 0.4)  # the top token alone reaches 0.4
    assert {top(logits).item() for _ in range(50)} == {1}
    two = sampler(1.0, 0.9)  # the top two reach 0.9 (0.975); the others are cut
    assert {two(logits).item() for _ in range(200)} == {1, 2}
    a, b = sampler(1.0, 1.0, seed=3), sampler(1.0, 1.0, seed=3)
    assert [a(logits).item() for _ in range(20)] == [b(logits).item() for _ in range(20)]
