"""Issue 53, generate.py's side: lengths, pooling and span widths, shortlists, windows, new tokens, decode budgets,
chat turns, seeds and encodings past what the model or the prompt can use end in one `error:` line before the
model loads (the tiny models of test_cli.py: a 64-token context, 8 ids)."""
import io
import json
import sys

import pytest
import torch

from support import cli, generate_checks
import generate as generate_py
import methods
import model
from support import tokenizer
from extensions import chat
from lookaheadkv import LookaheadModule
from test_cli import check_flags, chat_model, error_of, no_loading, one_line, tiny_model  # noqa: F401 (fixtures)

HUGE = 99999999999  # the width of the runs: one pooling op that ran until killed, deaf to SIGTERM


def gen(*argv):
    return error_of(generate_py.main, *argv)


# ----------------------------------------------------------------------------- rules: widths and shortlists

@pytest.mark.parametrize("rule, says", [
    (f"max:{HUGE}", f"pooling width {HUGE} is wider than the model's context of 64 tokens"),
    ("avg:65", "pooling width 65 is wider than the model's context of 64 tokens"),
    (f"span:{HUGE}", f"span width {HUGE} is wider than the model's context of 64 tokens"),
    ("span:65", "span width 65 is wider"),
    (f"span:8:{HUGE}", f"span shortlist {HUGE} is past the model's vocabulary of 8 ids"),
    ("span:8:9", "span shortlist 9 is past the model's vocabulary of 8 ids"),
])
def test_a_rule_past_what_the_model_can_use_is_refused_before_it_loads(rule, says, tmp_path, tiny_model, no_loading):
    p = tmp_path / "p.txt"
    p.write_text("what is two ?")
    one_line(gen("--prompt", p, "--model", tiny_model, "--method", "snapkv", "--budget", "40", "--pool", rule),
             f"--pool {rule}: {says}")


def test_the_rule_parser_holds_every_caller_to_the_model():
    """methods.parse_rule checks what it is given (the context, the vocabulary): every caller that passes them
    gets the same check; the widest and longest usable rules pass."""
    assert repr(methods.parse_rule(f"max:{HUGE}")) == f"max:{HUGE}"  # the text alone: no model to hold it to
    for rule in (f"max:{HUGE}", f"span:{HUGE}", f"span:8:{HUGE}"):
        with pytest.raises(ValueError, match="context of 64|vocabulary of 8"):
            methods.parse_rule(rule, 64, 8)
    assert [repr(methods.parse_rule(r, 64, 8)) for r in ("max:63", "span:64", "span:8:8")] == [
        "max:63", "span:64", "span:8:8"]
    with pytest.raises(ValueError, match="selection rule 'avg:²'"):  # a Unicode digit: refused as text, not by int()
        methods.parse_rule("avg:²")


def adapter_with(folder, tmp_path, rule):
    path = tmp_path / "a.safetensors"
    LookaheadModule(model.ModelConfig.from_hf_config(folder), n_tokens=4, rank=2).save(path)
    meta = json.loads((tmp_path / "a.json").read_text())
    (tmp_path / "a.json").write_text(json.dumps(dict(meta, rule=rule)))
    return path


def test_an_adapter_rule_past_the_context_is_refused_when_its_json_is_read(tmp_path, tiny_model, no_loading):
    """An adapter .json's "rule": "max:99999999999" ran until killed (65 s): now refused by methods.load_adapter,
    before the model's weights load. Its shortlist is not held to the vocabulary: an adapter's rule is a
    recipe for any model (train.py's span:8:1024 on 8 ids is the exact surprisal)."""
    p = tmp_path / "p.txt"
    p.write_text("what is two ?")
    path = adapter_with(tiny_model, tmp_path, f"max:{HUGE}")
    one_line(gen("--prompt", p, "--model", tiny_model, "--adapter", path, "--budget", "40", "--max-new-tokens", "4"),
             str(path), f"pooling width {HUGE} is wider than the model's context of 64 tokens", "fix or retrain it")
    path = adapter_with(tiny_model, tmp_path, "span:8:1024")
    assert repr(methods.adapter_selection(methods.load_adapter(path, model.ModelConfig.from_hf_config(tiny_model)))[0]
                ) == "span:8:1024"


# ----------------------------------------------------------------------------- flags against the context

@pytest.mark.parametrize("argv, says", [
    (["--window", "65"], "--window 65 is longer than the model's context of 64 tokens"),
    (["--method", "snapkv", "--budget", "40", "--decode-budget", "40"],
     "--decode-budget 40 with --every 32: the cache would have to hold 72 slots before an eviction, past the "
     "model's context of 64: use a --decode-budget of at most 32"),
    (["--seed", str(2**64)], f"--seed {2**64}: a seed must be a whole number from -2**63 to 2**64 - 1"),
    (["--seed", str(-2**63 - 1)], "--seed -9223372036854775809: a seed must be"),
])
def test_flags_past_the_context_or_the_seed_range_are_refused(argv, says, tmp_path, tiny_model, no_loading):
    p = tmp_path / "p.txt"
    p.write_text("what is two ?")
    one_line(gen("--prompt", p, "--model", tiny_model, "--method", "full", *argv), says)


def test_the_widest_seeds_and_flags_pass(tmp_path, tiny_model):
    p = tmp_path / "p.txt"
    p.write_text("x")
    for seed in (2**64 - 1, -2**63):
        check_flags(["--prompt", str(p), "--seed", str(seed)])
    cfg = model.ModelConfig.from_hf_config(tiny_model)
    argv = ["--prompt", str(p), "--window", "64", "--decode-budget", "32", "--budget", "32", "--every", "32"]
    generate_checks.check_fits_model(generate_py.get_args(argv), cfg)


# ----------------------------------------------------------------------------- the chat's turns

def turns_file(tmp_path, turns):
    p = tmp_path / "t.json"
    p.write_text(json.dumps(turns))
    return p


def test_a_turns_file_too_big_for_the_context_is_refused_by_its_size(tmp_path, chat_model, monkeypatch, no_loading):
    """A 50 MB --turns file was tokenized for 68 s before it was refused: now, as a --prompt file, its size says
    it: the turns of one conversation (between two /reset) over 64 x 64 bytes cannot fit 64 tokens."""
    big = turns_file(tmp_path, ["user ? " * 300, "user ? " * 400])  # 2.1 KB, then 4.9 KB (2.8 KB alone)
    monkeypatch.setattr(tokenizer.Tokenizer, "encode", lambda *a: pytest.fail("the turns were tokenized"))
    monkeypatch.setattr(cli, "printable", lambda *a: pytest.fail("every character was read"))
    one_line(gen("--turns", big, "--model", chat_model, "--method", "full"),
             f"turns file {big}: turns 1-2 of one conversation hold over 4 KB", "context of 64 tokens", "/reset")
    monkeypatch.undo()
    assert len(chat.read_turns(turns_file(tmp_path, ["user ? " * 300, "/reset", "user ? " * 400]), 64)) == 3


def test_turns_that_cannot_fit_with_their_answer_are_refused_before_the_model_loads(tmp_path, chat_model, no_loading):
    long = turns_file(tmp_path, ["user ?", "/reset", "user ? " * 30])  # entry 3 opens a conversation: 60 + 14 tokens
    one_line(gen("--turns", long, "--model", chat_model, "--method", "full", "--max-new-tokens", "8"),
             "--turns entry 3, the first turn of its conversation, would reach position", "context of 64")
    one_line(gen("--turns", "-", "--model", chat_model, "--method", "full", "--max-new-tokens", "60"),
             "--max-new-tokens 60 leaves no room for a turn", "of the model's context of 64")


def test_a_stdin_turn_too_long_is_said_and_skipped_unread(chat_model, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"user ? " * 1000 + b"\nuser .\n")))
    out = generate_py.main(["--turns", "-", "--model", str(chat_model), "--method", "full", "--max-new-tokens", "2",
                            "--device", "cpu", "--json"])
    assert [t["turn"] for t in out] == [1] and out[0]["prompt_tokens"] < 20  # only "user ." was answered
    assert "error: this turn is over 4 KB, more than the model's context of 64 tokens" in capsys.readouterr().err


# ----------------------------------------------------------------------------- encodings and line ends

@pytest.mark.parametrize("order", ["UTF-16LE", "UTF-16BE"])
def test_utf16_without_a_byte_order_mark_is_refused(order, tmp_path, chat_model, monkeypatch, no_loading):
    """It was read as UTF-8 with its NULs removed (a warning) and answered."""
    p = tmp_path / "p.txt"
    p.write_bytes("what is two ?\n".encode(order.lower()))
    one_line(gen("--prompt", p, "--model", chat_model, "--method", "full"),
             f"prompt file {p} looks like {order} text without a byte order mark", f"iconv -f {order} -t UTF-8")
    t = tmp_path / "t.json"
    t.write_bytes(json.dumps(["user ?"]).encode(order.lower()))
    one_line(gen("--turns", t, "--model", chat_model, "--method", "full"), f"turns file {t} looks like {order}")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("user ?".encode(order.lower()))))
    one_line(gen("--prompt", "-", "--model", chat_model, "--method", "full"), f"stdin looks like {order}")


def test_nul_bytes_alone_or_stray_are_not_taken_for_utf16():
    for raw in (b"\0" * 300, b"what is two\0 and two ?\x07", b"\0", "é".encode("utf-16")):  # the last: with its BOM
        cli.check_not_utf16(raw, "here")


@pytest.mark.parametrize("end", ["\r\n", "\r"])
def test_windows_and_old_mac_line_ends_are_line_ends_not_control_characters(end, tmp_path, tiny_model, capsys):
    p, q = tmp_path / "crlf.txt", tmp_path / "lf.txt"
    p.write_bytes(f"what is two{end}and two ?{end}".encode())
    q.write_bytes(b"what is two\nand two ?\n")
    argv = ["--model", str(tiny_model), "--method", "full", "--max-new-tokens", "2", "--device", "cpu", "--json"]
    got = generate_py.main(["--prompt", str(p), *argv])
    assert "warning" not in capsys.readouterr().err
    assert got == {**generate_py.main(["--prompt", str(q), *argv]), **{k: got[k] for k in got if k.endswith("ms")
                                                                       or k.endswith("_per_s")}}
    assert generate_checks.read_prompt(str(p), 64) == ("what is two\nand two ?\n", None)
