"""
Issue 77: a folder a user is handed (a run folder, a model folder, an export, a turns file) is data. Each test
here is an attack: what the folder holds tries to run code, redirect a write, or hang the run, and the run ends
in one `error:` line (exit 1) with nothing outside the folder touched.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from support import files

ROOT = Path(__file__).resolve().parent.parent
FIT = dict(n_tokens=8, min_tokens=16, max_tokens=64, long_max=128)  # prompt lengths the tiny model's context fits


def script_error(argv, timeout=120):
    """`python ARGV` from the repository root: its one stderr line, after exit status 1."""
    r = subprocess.run([sys.executable, *map(str, argv)], cwd=ROOT, capture_output=True, timeout=timeout,
                       env={**os.environ, "PIP_NO_INDEX": "1"})
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 1, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err  # no traceback, no warning
    return err.rstrip("\n")


class Planted:
    """Pickled, it rebuilds by calling os.mkdir(MARKER): what a checkpoint from a stranger could run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.fixture(scope="module")
def model_dir(tiny_hf_model):
    return tiny_hf_model("llama")


def train_argv(model_dir, out, *extra):
    recipe = Path(out).parent / f"recipe-{Path(out).name}.json"
    recipe.write_text(json.dumps(FIT))
    return ["train.py", "--config", recipe, "--model", model_dir, "--out", out, "--device", "cpu", *extra]


# -----------------------------------------------------------------------------
# 1. No pickle executes


@pytest.mark.parametrize("resume", [False, True])
def test_a_checkpoint_that_would_run_code_is_refused_before_it_runs(model_dir, tmp_path, resume):
    out, marker = tmp_path / "handed", tmp_path / "marker"
    out.mkdir()
    torch.save(dict(meta=dict(base_fingerprint="x"), step=Planted(marker)), out / "ckpt.pt")
    before = (out / "ckpt.pt").read_bytes()
    err = script_error(train_argv(model_dir, out, *(["--resume"] if resume else [])))
    assert f"checkpoint {out / 'ckpt.pt'} holds a pickled object (posix.mkdir)" in err, err
    assert not marker.exists()  # nothing in it ran
    assert (out / "ckpt.pt").read_bytes() == before and not (out / "log.jsonl").exists()


def test_a_checkpoint_holds_only_what_loads_without_pickled_objects(tmp_path):
    from lookaheadkv import LookaheadModule
    from model import ModelConfig
    from support import recipe

    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, name="tiny")
    module = LookaheadModule(cfg, n_tokens=2, rank=2)
    opt = torch.optim.AdamW(module.parameters())
    schedule = recipe.Schedule(dict(lr=0.01, batch=2, rule=None, copy_frac=0.5), "0123abcd")
    recipe.save_checkpoint(tmp_path / "ckpt.pt", module, opt, 3, [dict(step=0, kl=float("nan"))], schedule)
    ck = torch.load(tmp_path / "ckpt.pt", weights_only=True)  # raises if anything needs more than weights_only
    assert ck["step"] == 3 and ck["settings"] == dict(schedule) and ck["weights_id"] == "0123abcd"
    assert type(ck["settings"]) is dict and recipe.load_checkpoint(tmp_path / "ckpt.pt")["step"] == 3
    os.mkfifo(tmp_path / "pipe.pt")  # a named pipe blocked torch.load forever
    with pytest.raises(ValueError, match=f"^checkpoint {tmp_path / 'pipe.pt'} is a named pipe, not a regular file"):
        recipe.load_checkpoint(tmp_path / "pipe.pt")


# -----------------------------------------------------------------------------
# 2. Every write lands in the folder the user named


@pytest.mark.parametrize("name", [".prepared", "config.json"])
def test_a_model_folder_with_a_planted_link_is_refused_before_any_write(tmp_path, name):
    """weights/prepare.py wrote "building" through a .prepared link (offline, before any download), and each
    config through its link: now the link is named and its target, outside the folder, stays as it was."""
    out, victim = tmp_path / "model", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("the user's own file\n")
    if name != ".prepared":
        (out / ".prepared").write_text("building\n")  # a folder prepare.py was making
    (out / name).symlink_to(victim)
    err = script_error(["weights/prepare.py", "--out", out])
    assert err.startswith(f"error: --out {out / name} is a symbolic link (to {victim})"), err
    assert victim.read_text() == "the user's own file\n" and (out / name).is_symlink()


@pytest.mark.parametrize("name, dangling", [("log.jsonl", False), ("log.jsonl", True), ("ckpt.pt", True)])
def test_a_run_folder_with_a_planted_link_is_refused_before_the_model_loads(model_dir, tmp_path, name, dangling):
    """log.jsonl was appended through a link to any file the user can write, and a dangling link made a file
    wherever it pointed (check_writable followed links)."""
    out, victim = tmp_path / "handed", tmp_path / "elsewhere" / "victim.txt"
    out.mkdir()
    victim.parent.mkdir()
    if not dangling:
        victim.write_text("the user's own file\n")
    (out / name).symlink_to(victim)
    err = script_error(train_argv(model_dir, out))
    assert f"{out / name} is a symbolic link (to {victim})" in err, err
    assert (victim.read_text() == "the user's own file\n") if not dangling else not victim.exists()


def test_appends_and_atomic_writes_never_follow_a_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("kept\n")
    for i, name in enumerate(["log.jsonl", "dangling.jsonl"]):
        (tmp_path / name).symlink_to(victim if i == 0 else tmp_path / "made-elsewhere")
        for write in (files.append_text, files.write_atomic):
            with pytest.raises(ValueError, match=f"^{tmp_path / name} is a symbolic link"):
                write(tmp_path / name, "x\n")
    assert victim.read_text() == "kept\n" and not (tmp_path / "made-elsewhere").exists()
    files.append_text(tmp_path / "new.jsonl", "a\n")
    files.append_text(tmp_path / "new.jsonl", "b\n")
    assert (tmp_path / "new.jsonl").read_text() == "a\nb\n"


# -----------------------------------------------------------------------------
# 3. Every read is bounded


def test_a_lock_that_is_a_pipe_a_device_or_huge_is_refused_at_once(tmp_path):
    """A .lock that was a named pipe hung the run forever, and one linked to /dev/zero read until memory ran out."""
    for name, plant in [("pipe", os.mkfifo), ("zero", lambda p: os.symlink("/dev/zero", p)),
                        ("huge", lambda p: p.write_bytes(b"1" * 10_000))]:
        out = tmp_path / name
        out.mkdir()
        plant(out / ".lock")
        start = time.monotonic()
        err = script_error(["weights/prepare.py", "--out", out], timeout=60)
        assert err.startswith(f"error: --out {out}: cannot take its lock: {out / '.lock'} is "), err
        assert time.monotonic() - start < 30 and os.path.lexists(out / ".lock")  # said, and left for the user


def test_a_huge_turns_file_is_refused_by_its_size_before_it_is_read(tmp_path):
    from extensions import chat

    big = tmp_path / "turns.json"
    with open(big, "wb") as f:
        f.truncate(200 * 2**20)  # sparse: 200 MB that take no disk
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"^--turns {big} is 209715200 bytes, more than the \d+ such a file can be"):
        chat.read_turns(big, 8192)
    assert time.monotonic() - start < 2
    os.mkfifo(tmp_path / "pipe.json")
    with pytest.raises(ValueError, match="is a named pipe, not a regular file"):
        chat.read_turns(tmp_path / "pipe.json", 8192)


def test_a_chat_template_of_many_tags_is_read_in_one_pass(tmp_path):
    """A 480 KB template of "<|im_start|>system" tags took minutes in one regex (quadratic): now a template past
    any model's size is refused by its length, and one just under it is read in one pass."""
    import shutil

    from support.tokenizer import MAX_TEMPLATE, Tokenizer

    real = ROOT / "weights" / "SmolLM2-135M-Instruct"
    if not (real / "tokenizer.json").exists():
        pytest.skip("the default model is not prepared (python weights/prepare.py)")
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(real / "tokenizer.json", folder)
    tc = json.loads((real / "tokenizer_config.json").read_text())
    for n, says in [(25_000, "more than the"), (MAX_TEMPLATE // 19, None)]:
        (folder / "tokenizer_config.json").write_text(json.dumps(dict(tc, chat_template="<|im_start|>system\n" * n)))
        start = time.monotonic()
        if says:
            with pytest.raises(ValueError, match=f"chat_template is {19 * n} characters, {says}"):
                Tokenizer(folder)
        else:
            assert Tokenizer(folder).default_system is None
        assert time.monotonic() - start < 5


def test_sample_references_stay_among_sample_files_and_never_loop(tmp_path):
    """A sample's metadata "cache" naming itself ended in a RecursionError ("unexpected failure"), and "cache" or
    "prefix" could name any file. Now each names a sample file (of this data folder, or another data stage's for
    extensions/answer_weights.py) or the sample is refused in one line, as not whole."""
    from support import data

    def sample(folder, row_id, **meta):
        path = data.sample_path(folder, row_id)
        tensors = dict(target=torch.ones(1, 2, 3)) if meta else dict(target=torch.ones(1, 2, 3),
                                                                       k=torch.ones(1, 1, 3, 2), v=torch.ones(1, 1, 3, 2))
        data.save_safetensors(path, tensors, meta or None)
        (Path(folder) / "data.jsonl").touch()
        return path

    src, out = tmp_path / "src", tmp_path / "out"
    own = sample(src, "r0")
    ok = sample(out, "r0", cache=os.path.relpath(own, out / "samples"))  # as answer_weights.py names its source's
    assert data.sample_ok(ok) and data.read_sample(ok)["k"].shape == (1, 1, 3, 2)
    outside = tmp_path / "elsewhere" / "samples" / own.name  # a sample's name, but in no data folder
    outside.parent.mkdir(parents=True)
    outside.write_bytes(own.read_bytes())
    for key, ref in [("cache", data.sample_path(out, "self").name), ("cache", "../../elsewhere/samples/" + own.name),
                     ("cache", "/etc/passwd"), ("prefix", "../../src/samples/" + own.name), ("prefix", "x.txt"),
                     ("cache", os.path.relpath(ok, out / "samples").replace(ok.name, data.sample_path(out, "r1").name))]:
        path = sample(out, "self" if ref.startswith(data.sample_path(out, "self").name) else "r1", **{key: ref})
        assert not data.sample_ok(path), (key, ref)
        with pytest.raises(ValueError) as e:
            data.read_sample(path)
        assert str(e.value).startswith(f"sample file {path}") and "\n" not in str(e.value), (key, ref)
    chained = sample(out, "r2", cache=os.path.relpath(ok, out / "samples"))  # names one that names another: refused
    assert not data.sample_ok(chained)
    with pytest.raises(ValueError, match="names a cache of its own"):
        data.read_sample(chained)


def test_epochs_that_would_plan_endless_steps_are_refused(model_dir, tmp_path):
    """A handed --config's "epochs": 1e308 planned 10^307 steps."""
    import train

    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps(dict(FIT, epochs=1e308)))
    with pytest.raises(SystemExit) as e:
        train.main(["--config", str(recipe), "--model", str(model_dir), "--out", str(tmp_path / "o"), "--device", "cpu"])
    assert str(e.value).startswith("error: --epochs 1e+308: at most 1000 passes") and "\n" not in str(e.value)
