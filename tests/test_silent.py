"""Issue 76, "nothing silent, round five": each mechanism with generic values.

1. an adapter that cannot serve is never called saved (a non-finite validation KL stops training; every loader refuses
   a .json that records one); 2. every file with a __main__ is a front door, by its path and with -m; 3. zero turns on
   stdin are refused like zero turns in a file; 5. a flag is taken whole or refused (given twice, ignored by the
   method, --resume with nothing to resume); 6. free space in readable units; 7. advice that fits."""
import io
import json
import os
import runpy
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest
import torch

from test_cli import chat_model, error_of, no_loading, one_line, tiny_model  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- 2. every __main__ a front door

def main_files():
    """Every file of the repository (tests aside) with an `if __name__ == "__main__":`."""
    found = []
    for p in sorted(ROOT.rglob("*.py")):
        rel = p.relative_to(ROOT)
        if rel.parts[0] in ("tests", ".git") or any(part.startswith(".") for part in rel.parts):
            continue
        if 'if __name__ == "__main__"' in p.read_text(encoding="utf-8", errors="replace"):
            found.append(rel.as_posix())
    return found


def run_as_python_would(way, rel, argv, timeout=120):
    """(exit status, stdout, stderr) of `python REL ARGV` (way "path") or `python -m MODULE ARGV` (way "-m"), run in
    a child forked from this process (torch is imported once, not once per file): the repository's own modules are
    dropped from sys.modules and sys.path is what Python would make it: the file's folder by path, the repository's
    root with -m. Exit status and stderr as Python's own exit makes them (SystemExit's text, a traceback)."""
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            sys.stdin, sys.stdout, sys.stderr = (open(0, closefd=False), open(1, "w", closefd=False),
                                                 open(2, "w", closefd=False))
            ours = {name for name, module in sys.modules.items()
                    if str(getattr(module, "__file__", None) or "").startswith(str(ROOT))}
            for name in list(sys.modules):  # and their namespace subpackages (research.analysis: no __file__)
                if name in ours or any(name.startswith(top + ".") for top in ours):
                    del sys.modules[name]
            where = str(ROOT / Path(rel).parent) if way == "path" else str(ROOT)
            sys.path[:] = [where] + [p for p in sys.path if p not in ("", str(ROOT), str(ROOT / "tests"))]
            os.chdir(ROOT)
            try:
                if way == "path":
                    sys.argv = [rel, *argv]
                    runpy.run_path(str(ROOT / rel), run_name="__main__")
                else:
                    sys.argv = [rel, *argv]
                    runpy.run_module(rel[:-3].replace("/", "."), run_name="__main__", alter_sys=True)
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"{way} {rel} {argv}: still running after {timeout} s")
        time.sleep(0.02)
    out.seek(0), err.seek(0)
    return os.waitstatus_to_exitcode(done[1]), out.read().decode(errors="replace"), err.read().decode(errors="replace")


def test_every_file_with_a_main_is_a_front_door_by_its_path_and_with_m():
    """`python research/bench.py --help` was a ModuleNotFoundError (the file's folder, not the repository, is on
    sys.path; the "not a script" guard sat below the imports): each file now prints its help, or says in one line
    how it is run, both ways."""
    files = main_files()
    assert len(files) > 30 and "research/bench.py" in files and "support/cli.py" in files
    bad = []
    for rel in files:
        for way in ("path", "-m"):
            code, out, err = run_as_python_would(way, rel, ["--help"])
            helped = code == 0 and out.startswith("usage:") and "Traceback" not in err
            said = code == 1 and err.startswith("error: ") and len(err.splitlines()) == 1
            if not (helped or said):
                bad.append(f"{way} {rel}: exit {code}, {err.strip()[-300:]!r}")
    assert not bad, "\n".join(bad)


def test_a_module_run_by_its_path_says_how_to_run_it_in_a_process():
    """The real thing once: a new Python process, the repository not on its path."""
    import subprocess

    r = subprocess.run([sys.executable, "research/bench.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and r.stdout == "", r.stderr
    one_line(r.stderr.strip(), "python -m research.bench")
    assert len(r.stderr.splitlines()) == 1


# ----------------------------------------------------------------------------- 1. no adapter that cannot serve saved

import methods  # noqa: E402
import model  # noqa: E402
import train  # noqa: E402
import generate as generate_py  # noqa: E402
from lookaheadkv import LookaheadModule  # noqa: E402
from support import recipe  # noqa: E402
from test_train import argv as train_argv, model_dir, stub_prompts, write_data  # noqa: E402, F401 (fixtures)


def diverged_adapter(folder, tmp_path, kl=float("nan")):
    """An adapter of finite tensors whose .json records the held-out KL a diverged run ends with."""
    path = tmp_path / "diverged.safetensors"
    module = LookaheadModule(model.ModelConfig.from_hf_config(folder), n_tokens=4, rank=2)
    module.info = dict(heldout=dict(step=30, kl=kl), untrained=dict(step=0, kl=0.67))
    module.save(path)
    return path


def test_a_run_whose_validation_kl_turns_nan_stops_and_saves_no_adapter(model_dir, tmp_path, stub_prompts,
                                                                         monkeypatch):
    """lr 0.3 went 0.67 -> 2.2 -> nan and said "saved", exit 0, its .json recording "kl": NaN: now the check that
    finds the NaN stops the run in one line, before that step's checkpoint, and nothing is called saved."""
    out = tmp_path / "run"
    write_data(out, model_dir)
    real, checks = train.kl_loss, []

    def nan_from_the_second_check(*a):
        loss = real(*a)
        if not torch.is_grad_enabled():  # the validation's (one held-out row: one call a check)
            checks.append(1)
            return loss * float("nan") if len(checks) > 1 else loss
        return loss

    monkeypatch.setattr(train, "kl_loss", nan_from_the_second_check)
    message = error_of(train.main, *train_argv(model_dir, out, "--eval-every", "1", "--save-every", "1"))
    one_line(message, "step 1: the validation KL is nan", "the run diverged", "step 0's was", "no adapter saved",
             "lower --lr")
    assert not (out / "adapter.safetensors").exists() and not (out / "ckpt.pt").exists()


def test_the_rule_a_non_finite_last_kl_is_a_diverged_run():
    recipe.check_diverged([dict(step=0, kl=0.67), dict(step=10, kl=2.2)], Path("ckpt.pt"))  # worse, finite: said
    assert "above the untrained module's 0.6700" in recipe.worse_than_untrained([dict(step=0, kl=0.67),
                                                                                dict(step=10, kl=2.2)])
    assert recipe.worse_than_untrained([dict(step=0, kl=0.67), dict(step=10, kl=0.5)]) is None
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="not finite: the run diverged"):
            recipe.check_diverged([dict(step=0, kl=0.67), dict(step=10, kl=bad)], Path("ckpt.pt"))
    with pytest.raises(ValueError, match="the untrained module's validation KL is nan"):
        recipe.check_diverged([dict(step=0, kl=float("nan"))], Path("ckpt.pt"))


def test_an_adapter_recording_a_non_finite_heldout_kl_is_not_saved(tmp_path):
    module = LookaheadModule(model.ModelConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1, name="t"), n_tokens=2,
                             rank=1)
    module.info = dict(heldout=dict(step=3, kl=float("nan")))
    dest = tmp_path / "a.safetensors"
    with pytest.raises(ValueError, match=r"not usable, so it was not saved .*held-out kl of nan at step 3"):
        recipe.save_adapter(module, dest)
    assert not dest.exists() and not dest.with_suffix(".json").exists()


@pytest.mark.parametrize("kl", [float("nan"), float("inf")])
def test_every_loader_refuses_an_adapter_whose_record_is_not_finite(kl, tmp_path, tiny_model, no_loading):
    path = diverged_adapter(tiny_model, tmp_path, kl)
    cfg = model.ModelConfig.from_hf_config(tiny_model)
    with pytest.raises(ValueError, match="diverged"):
        methods.load_adapter(path, cfg)
    p = tmp_path / "p.txt"
    p.write_text("what is two ?")
    one_line(error_of(generate_py.main, "--prompt", p, "--model", tiny_model, "--adapter", path, "--budget", "40",
                      "--max-new-tokens", "4"),
             f"adapter metadata {path.with_suffix('.json')}", f"held-out kl of {kl}", "retrain it")
    from research import evaluate
    one_line(error_of(evaluate.main, "--model", tiny_model, "--adapter", path, "--device", "cpu", "--lengths", "32",
                      "--budgets", "8", "--max-new-tokens", "4", "--methods", "lookahead", "--out", tmp_path / "eval"),
             str(path.with_suffix(".json")), "diverged")


# ----------------------------------------------------------------------------- 3. zero turns refused everywhere

@pytest.mark.parametrize("stdin", [b"", b"\n\n  \n", b"/reset\n", b"\n/reset\n\n/reset\n"])
def test_zero_turns_on_stdin_are_refused_like_zero_turns_in_a_file(stdin, tmp_path, chat_model, monkeypatch,
                                                                   no_loading):
    """`printf '' | python generate.py --turns -` ended in exit 0 with nothing printed (so did blank lines or only
    /reset); a turns file of [] was refused already. Both say the same now, before the model loads."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    chat = ["--model", chat_model, "--method", "full", "--max-new-tokens", "2"]
    one_line(error_of(generate_py.main, "--turns", "-", *chat),
             "stdin holds no turn to answer")
    p = tmp_path / "t.json"
    p.write_text('["/reset", " /reset "]')
    one_line(error_of(generate_py.main, "--turns", p, *chat),
             f"turns file {p} holds no turn to answer")


def test_a_reset_before_the_first_turn_is_no_turn_but_the_chat_goes_on(chat_model, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"/reset\n\nuser ?\n")))
    out = generate_py.main(["--turns", "-", "--model", str(chat_model), "--method", "full", "--max-new-tokens", "2",
                            "--device", "cpu", "--json"])
    assert [t["turn"] for t in out] == [1]


# ----------------------------------------------------------------------------- 5. a flag taken whole or refused

def test_a_window_the_method_keeps_none_of_is_refused_with_the_reason(tmp_path, tiny_model, no_loading):
    """`--window 64` with the default method (lookahead) was accepted and ignored."""
    p = tmp_path / "p.txt"
    p.write_text("what is two ?")
    for method in ("lookahead", "full", "streaming"):
        one_line(error_of(generate_py.main, "--prompt", p, "--model", tiny_model, "--method", method, "--window", "16"),
                 f"--window 16: method {method} keeps no window", "drop it")


def test_the_methods_said_to_keep_a_window_are_those_whose_scorer_reads_it():
    from eviction import EvictConfig
    from support import cli

    for name, cls in methods.METHODS.items():
        try:
            scorer = cls(EvictConfig(name, 64, window=7))
        except ValueError:  # lookahead, oracle: an adapter or an answer first; neither keeps a window
            assert name not in cli.WINDOW_METHODS and "window" not in vars(cls)
            continue
        assert (scorer.window == 7) == (name in cli.WINDOW_METHODS), name


def test_resume_with_nothing_to_resume_is_refused_and_never_advised(model_dir, tmp_path, monkeypatch):
    """`train.py --resume` on a folder with nothing to resume started a whole new run without a word."""
    out = tmp_path / "empty"
    one_line(error_of(train.main, *train_argv(model_dir, out, "--resume")),
             f"--resume: {out} holds nothing to resume (no ckpt.pt, no data.jsonl)", "drop --resume")
    one_line(error_of(train.main, *train_argv(model_dir, out, "--resume", "--stage", "data")),
             "--resume continues training from OUT/ckpt.pt: it has no use with --stage data")
    # a Ctrl-C says the command that continues: --resume only where OUT then holds something to continue
    args = train_argv(model_dir, out)
    assert not recipe.resume_command("train.py", args, lambda: train.get_args(args))().endswith("--resume")
    write_data(out, model_dir)
    assert recipe.resume_command("train.py", args, lambda: train.get_args(args))().endswith(" --resume")


def test_a_flag_given_twice_counts_as_the_last_and_the_earlier_is_still_checked(model_dir, tmp_path):
    """A repeated --config kept the last file; the first, an lr of 1e30, was never opened."""
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    first.write_text(json.dumps(dict(lr=1e30)))
    second.write_text(json.dumps(dict(lr=1e-3)))
    out = tmp_path / "o"
    one_line(error_of(train.main, "--config", first, "--config", second, "--model", model_dir, "--out", out),
             "--lr 1e+30")
    first.write_text("{not json")
    one_line(error_of(train.main, "--config", first, "--config", second, "--model", model_dir, "--out", out),
             f"--config {first} is not valid JSON")
    cfg = train.get_args(["--config", str(second), "--lr", "0.5", "--lr=2e-3", "--out", str(out)])
    assert cfg.lr == 2e-3  # the last counts (a command that appends a flag to override one is common)
    one_line(error_of(train.main, "--lr", "5", "--lr", "1e-3", "--model", model_dir, "--out", out), "--lr 5")


# ----------------------------------------------------------------------------- 6. sizes said readably, before the work

def test_sizes_are_said_in_the_unit_that_shows_them():
    assert [recipe.size_text(n) for n in (3 * 2**30, 2**30 // 10, 3 * 2**20, 1024, 12)] == [
        "3.0 GiB", "0.1 GiB", "3.0 MiB", "1.0 KiB", "12 bytes"]


def test_a_disk_too_full_for_the_adapter_and_checkpoint_is_found_before_training(model_dir, tmp_path, monkeypatch):
    """--adapter-out met the full disk only after the training, in a message that named no file: recipe.check now
    compares the adapter's and the checkpoint's size with the free space of the folders they go to."""
    out, elsewhere = tmp_path / "o", tmp_path / "adapters"
    out.mkdir()
    elsewhere.mkdir()
    cfg, model_cfg = train.TrainConfig(out=str(out), stage="train"), model.ModelConfig.from_hf_config(model_dir)
    monkeypatch.setattr(recipe, "free_disk", lambda path: 2048)  # 2 KiB free
    with pytest.raises(ValueError, match=f"the adapter and checkpoint would take at least .* on disk, and {out} has "
                                         "2.0 KiB free: free some space, or pass another --out"):
        recipe.check_free_for_training(cfg, model_cfg, out, out / "adapter.safetensors")
    monkeypatch.setattr(recipe, "free_disk", lambda path: 2048 if path == elsewhere else 2**40)
    with pytest.raises(ValueError, match=f"the adapter would take .*{elsewhere} has 2.0 KiB free.*--adapter-out"):
        recipe.check_free_for_training(cfg, model_cfg, out, elsewhere / "a.safetensors")
    monkeypatch.setattr(recipe, "free_disk", lambda path: 2**40)
    recipe.check_free_for_training(cfg, model_cfg, out, elsewhere / "a.safetensors")


# ----------------------------------------------------------------------------- 7. advice that fits the file

def test_a_broken_config_of_the_users_own_is_not_advised_a_download(tmp_path):
    """bench's --random-init config is the user's file, not a checkpoint's: "re-download the checkpoint" did not fit."""
    from support import checks

    own = tmp_path / "llama-8b.json"
    own.write_text('{"model_type": "llama",')
    with pytest.raises(ValueError, match="fix the file") as e:
        checks.check_config(own)
    assert "re-download" not in str(e.value)
    (tmp_path / "config.json").write_text('{"model_type": "llama",')  # a model folder's: its fix stays
    with pytest.raises(ValueError, match="re-download the checkpoint"):
        checks.check_config(tmp_path / "config.json")
