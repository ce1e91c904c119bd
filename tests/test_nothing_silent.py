"""Nothing silent: no wrong answer with exit 0, no user's file replaced, no resume onto other weights. Each
case runs the command (in-process through main(argv), or as a subprocess where the user's view is
the point) and asserts exit status 1 with one `error:` line, before the model loads where the check needs none
(tests/test_cli.py: the contract and its helpers), or that it works for valid input and leaves the user's files
as they were. Every model here is a tiny random one: the whole file runs in well under a minute."""
import errno
import io
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

from test_cli import error_of, no_loading, one_line, script_error, write_tiny  # noqa: F401 (a fixture)

import generate as generate_py
import model
import train
from baselines import H2O, SnapKV, WindowHook
from eviction import EvictConfig
from research import bench, evaluate
from research import train_lab
from support import cli, data, files, recipe
from support.tokenizer import Tokenizer

WORDS = ["[UNK]", "</s>", "<|im_start|>", "<|im_end|>", "user", "assistant", "?", "."]


class Loaded(Exception):
    """Raised in place of loading the model: the run got past every check."""


@pytest.fixture
def loads_nothing(monkeypatch):
    """cli.load raises Loaded: a valid run is seen to reach the load."""
    def load(*a, **k):
        raise Loaded()
    monkeypatch.setattr(cli, "load", load)
    monkeypatch.setattr(train, "load_model", load)
    monkeypatch.setattr(generate_py, "load_model", load)


def edit_config(folder, **changes):
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return folder


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """A tiny ChatML model with a 64-token context (tests/test_cli.py's chat_model)."""
    return write_tiny(tmp_path_factory.mktemp("chat"), WORDS)


@pytest.fixture(scope="module")
def roomy(tmp_path_factory):
    """The same, with a context of 8192: train.py's and evaluate.py's default prompt lengths fit it."""
    return edit_config(write_tiny(tmp_path_factory.mktemp("roomy"), WORDS), max_position_embeddings=8192)


@pytest.fixture
def prompt(tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("user ?")
    return p


def other_weights_copy(folder, dest):
    """A copy of `folder` with the same config and one tensor value changed (a fine-tuned copy)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    name = sorted(tensors)[len(tensors) // 2]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1.0
    save_file(tensors, str(dest / "model.safetensors"))
    return dest


# ----------------------------------------------------------------------------- a window of 0

def test_window_0_is_refused_for_snapkv_as_a_script_would_say_it(prompt, chat):
    """It answered "TheTheThe" with exit 0: q[:, :, -0:] is every query of the prompt's last chunk."""
    one_line(script_error("generate.py", ["--prompt", str(prompt), "--model", str(chat), "--method", "snapkv",
                                          "--window", "0", "--budget", "64", "--device", "cpu"]),
             "--window 0: method snapkv scores with the attention of the last --window", "at least 1")


@pytest.mark.parametrize("method", ["pyramidkv", "laq"])
def test_window_0_is_refused_for_every_method_that_scores_with_it(method, prompt, chat, no_loading):
    one_line(error_of(generate_py.main, "--prompt", prompt, "--model", chat, "--method", method, "--window", "0",
                      "--budget", "8", "--device", "cpu"), f"--window 0: method {method}")


def test_a_window_of_1_answers(prompt, chat):
    out = generate_py.main(["--prompt", str(prompt), "--model", str(chat), "--method", "snapkv", "--window", "1",
                            "--budget", "4", "--max-new-tokens", "2", "--device", "cpu", "--json"])
    assert out["prompt_tokens"] > 4 and out["kept_tokens"] == 4


def test_window_0_means_no_window_where_it_only_protects():
    """H2O scores every query; its window only keeps the last tokens: 0 keeps none, explicitly."""
    assert H2O(EvictConfig("h2o", 8, window=0)).window == 0
    with pytest.raises(ValueError, match="--window -1"):
        SnapKV(EvictConfig("snapkv", 8, window=-1))
    with pytest.raises(ValueError, match="--window 0"):
        WindowHook(0, 10)


def test_window_0_in_evaluate_and_bench_stops_before_the_model(roomy, tmp_path, no_loading, monkeypatch):
    monkeypatch.setattr(bench, "random_model", lambda *a, **k: pytest.fail("the model was built"))
    one_line(error_of(evaluate.main, "--model", roomy, "--methods", "full,snapkv", "--window", "0", "--device", "cpu",
                      "--out", tmp_path / "eval"), "--window 0: method snapkv")
    one_line(error_of(bench.main, "--model", roomy, "--methods", "snapkv", "--window", "0", "--device", "cpu"),
             "row snapkv: --window 0")
    assert not (tmp_path / "eval").exists()


# ----------------------------------------------------------------------------- no writer replaces another's file

@pytest.mark.parametrize("name", ["model.safetensors", "config.safetensors"])
def test_adapter_out_onto_a_model_s_own_files_is_refused(name, chat, tmp_path, no_loading):
    """--adapter-out DIR/model.safetensors replaced the weights (the original moved to model.prev.safetensors);
    DIR/config.safetensors would replace config.json, its .json. Refused before the model loads."""
    folder = shutil.copytree(chat, tmp_path / "model")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    for main in (train.main, train_lab.main):
        one_line(error_of(main, "--model", folder, "--out", tmp_path / "out", "--adapter-out", folder / name,
                          "--device", "cpu"), f"--adapter-out {folder / name}: saving the adapter would replace",
                 "not an adapter this project saved")
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_an_adapter_of_ours_may_be_replaced_and_is_kept(chat, tmp_path):
    from lookaheadkv import LookaheadModule

    cfg = model.ModelConfig.from_hf_config(chat)
    dest = tmp_path / "a.safetensors"
    recipe.save_adapter(LookaheadModule(cfg, n_tokens=2, rank=1), dest)
    assert recipe.is_adapter(dest)
    recipe.check_adapter_dest("--adapter-out", dest)  # ours: fine
    first = dest.read_bytes()
    recipe.save_adapter(LookaheadModule(cfg, n_tokens=2, rank=1), dest)
    assert (tmp_path / "a.prev.safetensors").read_bytes() == first and (tmp_path / "a.prev.json").exists()
    assert dest.read_bytes() != first
    # saved adapters are readable by others (safetensors alone makes 0600), as a new file of the user's would be
    for p in (dest, dest.with_suffix(".json")):
        assert p.stat().st_mode & 0o777 == files.NEW_FILE_MODE
    if files.NEW_FILE_MODE == 0o644:
        assert oct(dest.stat().st_mode & 0o777) == "0o644"


# ----------------------------------------------------------------------------- the weights' identity

def test_weights_identity_reads_every_byte_once_and_is_cached(chat, tmp_path, monkeypatch):
    other = other_weights_copy(chat, tmp_path / "other")
    same = shutil.copytree(chat, tmp_path / "same")
    run = tmp_path / "run"
    run.mkdir()
    ident = files.weights_identity(chat, cache_dir=run)
    assert ident == files.weights_identity(same) != files.weights_identity(other)
    assert not (run / files.CACHE_NAME).exists()  # kept only once the run's checks have passed
    files.keep_identity(chat, run, ident)
    monkeypatch.setattr(files.hashlib, "file_digest", lambda *a: pytest.fail("hashed again"))
    assert files.weights_identity(chat, cache_dir=run) == ident  # read back: unchanged sizes and times


def checkpointed_run(roomy, tmp_path):
    """tmp_path/out holding a checkpoint of one step, made on roomy's weights (their identity recorded)."""
    from lookaheadkv import LookaheadModule

    out = tmp_path / "out"
    out.mkdir()
    cfg = train.TrainConfig(model=str(roomy), out=str(out), device="cpu", dtype="float32")
    module = LookaheadModule(model.ModelConfig.from_hf_config(roomy), cfg.n_tokens, cfg.rank, cfg.alpha)
    recipe.save_checkpoint(out / "ckpt.pt", module, torch.optim.AdamW(module.parameters()), 1, [],
                           recipe.schedule_of(cfg, files.weights_identity(roomy)))
    return out


def test_resume_onto_other_weights_of_the_same_config_is_refused(roomy, tmp_path, no_loading):
    """train.py compared the config's fingerprint only: a copy with other tensors resumed without a word."""
    out = checkpointed_run(roomy, tmp_path)
    other = other_weights_copy(roomy, tmp_path / "copy")
    argv = ["--out", out, "--device", "cpu", "--dtype", "float32"]
    one_line(error_of(train.main, "--model", other, "--resume", *argv),
             "--resume:", "was trained on other weights", "resume with the model it was trained on")
    one_line(error_of(train.main, "--model", other, *argv), f"--out {out} holds another run's checkpoint",
             "trained on other weights")


def test_resume_onto_the_same_weights_elsewhere_goes_on(roomy, tmp_path, loads_nothing):
    out = checkpointed_run(roomy, tmp_path)
    copy = shutil.copytree(roomy, tmp_path / "copy")
    with pytest.raises(Loaded):
        train.main(["--model", str(copy), "--resume", "--out", str(out), "--device", "cpu", "--dtype", "float32"])


def test_evaluate_refuses_a_table_made_on_other_weights(roomy, tmp_path, no_loading):
    """A same-named copy whose changed tensor falls between the 64 slices model_identity samples: its model_id is
    the same, every byte's identity is not."""
    other = other_weights_copy(roomy, tmp_path / "m" / roomy.name)
    out = tmp_path / "out"
    out.mkdir()
    saved = dict(settings=dict(model_id=evaluate.model_identity(other), weights_id=files.weights_identity(roomy)),
                 results=[])
    (out / "results.json").write_text(json.dumps(saved))
    one_line(error_of(evaluate.main, "--model", other, "--methods", "full,snapkv", "--device", "cpu", "--out", out),
             f"{out / 'results.json'} holds results made on other weights than {other}")
    assert json.loads((out / "results.json").read_text()) == saved


# ----------------------------------------------------------------------------- the tokenizer against its model

def test_a_tokenizer_far_smaller_than_the_vocabulary_is_another_model_s(chat, tmp_path, prompt, no_loading):
    folder = edit_config(shutil.copytree(chat, tmp_path / "m"), vocab_size=4096)
    one_line(error_of(generate_py.main, "--prompt", prompt, "--model", folder, "--method", "full"),
             "tokenizer.json has 8 token ids but", "vocab_size 4096", "belongs to another model")


def test_a_tokenizer_whose_special_tokens_sit_elsewhere_is_another_model_s(chat, tmp_path, prompt, no_loading):
    folder = shutil.copytree(chat, tmp_path / "m")  # config.json: eos_token_id 1, "</s>" in this tokenizer
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    one_line(error_of(generate_py.main, "--prompt", prompt, "--model", folder, "--method", "full"),
             "gives eos_token '<|im_end|>' the id 3, but eos_token_id in config.json or generation_config.json says 1")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    one_line(error_of(generate_py.main, "--prompt", prompt, "--model", folder, "--method", "full"),
             "tokenizer.json has no token '<eos>', the eos_token of")


def test_the_shipped_model_s_tokenizer_serves_it():
    folder = Path(__file__).resolve().parents[1] / "weights" / "SmolLM2-135M-Instruct"
    if not (folder / "tokenizer.json").is_file():
        pytest.skip("the default model is not prepared here")
    tok = Tokenizer(folder, model.ModelConfig.from_hf_config(folder))
    assert tok.format is not None and tok.stop_ids  # a chat format, and the tokens that end an answer
    text = "What is the special magic number?"
    ids = tok.encode(tok.chat(text))
    assert tok.decode(tok.encode(text)) == text and text in tok.decode(ids)
    assert all(0 <= i < tok_vocab(folder) for i in ids)


def tok_vocab(folder):
    return model.ModelConfig.from_hf_config(folder).vocab_size


def test_template_control_text_in_a_message_gets_one_warning(capsys):
    folder = Path(__file__).resolve().parents[1] / "weights" / "SmolLM2-135M-Instruct"
    if not (folder / "tokenizer.json").is_file():
        pytest.skip("the default model is not prepared here")
    tok = Tokenizer(folder)
    tok.chat("what is <|im_end|> here?")
    tok.chat("what is <|im_end|> here?")  # a chat's first turn is wrapped twice: checked, then answered
    tok.next_turn("plain text")
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "<|im_end|>" in err and "control token" in err, err


# ----------------------------------------------------------------------------- every write through one door

def test_a_full_disk_is_one_line_and_leaves_the_file_whole(tmp_path):
    path = tmp_path / "results.json"
    path.write_text("before")

    def fills_the_disk(tmp):
        Path(tmp).write_text("half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with pytest.raises(ValueError) as e:
        files.write_with(path, fills_the_disk)
    assert f"cannot write {path}: No space left on device" in str(e.value)
    assert path.read_text() == "before" and [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_an_oserror_is_said_in_words_not_errno(monkeypatch):
    def work():
        raise OSError(errno.ENOSPC, "No space left on device", "runs/x/data.jsonl")
    with pytest.raises(SystemExit) as e:
        cli.run(work)
    one_line(e.value.code, "cannot write runs/x/data.jsonl: No space left on device", "free some space")
    assert "[Errno" not in e.value.code


def test_a_sample_on_a_full_disk_is_one_line_not_a_safetensors_traceback(tmp_path, monkeypatch):
    import safetensors.torch

    path = tmp_path / "samples" / "1.safetensors"
    data.save_safetensors(path, dict(target=torch.ones(2)))
    before = path.read_bytes()

    def full(tensors, filename, metadata=None):  # safetensors' own error: no errno, a SafetensorError
        Path(filename).write_bytes(b"trunc")
        raise Exception('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                        'left on device" })')
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(ValueError, match="No space left on device"):
        data.save_safetensors(path, dict(target=torch.zeros(2)))
    assert path.read_bytes() == before and sorted(p.name for p in path.parent.iterdir()) == ["1.safetensors"]


def test_saving_an_adapter_on_a_full_disk_leaves_the_old_pair_and_no_backup(chat, tmp_path, monkeypatch):
    from lookaheadkv import LookaheadModule

    cfg = model.ModelConfig.from_hf_config(chat)
    dest = tmp_path / "a.safetensors"
    recipe.save_adapter(LookaheadModule(cfg, n_tokens=2, rank=1), dest)
    before = sorted((p.name, p.read_bytes()) for p in tmp_path.iterdir())

    def full(self, path):
        Path(path).write_bytes(b"trunc")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(LookaheadModule, "save", full)
    with pytest.raises(ValueError, match=f"cannot write {dest}: No space left on device"):
        recipe.save_adapter(LookaheadModule(cfg, n_tokens=2, rank=1), dest)
    assert sorted((p.name, p.read_bytes()) for p in tmp_path.iterdir()) == before


def test_a_backup_copy_cut_short_by_a_full_disk_is_removed(tmp_path, monkeypatch):
    """Where hard links are not supported keep_previous copies: a full disk left a truncated file under the
    backup's name."""
    src, dst = tmp_path / "a.safetensors", tmp_path / "a.prev.safetensors"
    src.write_bytes(b"x" * 1000)
    monkeypatch.setattr(recipe.os, "link", lambda *a: (_ for _ in ()).throw(OSError(errno.EXDEV, "cross-device")))

    def copy_then_fill(fsrc, fdst, *a):
        fdst.write(fsrc.read(10))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(recipe.shutil, "copyfileobj", copy_then_fill)
    with pytest.raises(ValueError, match="No space left on device"):
        recipe.keep_one(src, dst)
    assert not dst.exists() and src.read_bytes() == b"x" * 1000


# ----------------------------------------------------------------------------- a chat's stdin, the --prompt - reader

@pytest.mark.parametrize("raw, byte", [(b"caf\xe9 ?\n", "0xe9 at offset 3"), (bytes(range(128, 256)) * 4, "0x80"),
                                       (b"\xff\xfe\x00" + bytes(range(256)), "UTF-16 byte order mark")],
                         ids=["latin-1", "binary", "binary-with-a-bom"])
def test_a_chat_s_stdin_is_read_as_the_prompt_is(raw, byte, chat, monkeypatch, no_loading):
    """It reached the tokenizer as a lone surrogate: a TypeError traceback once the model had loaded."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(raw)))
    message = one_line(error_of(generate_py.main, "--turns", "-", "--model", chat, "--method", "full", "--device",
                                "cpu", "--max-new-tokens", "4"), "stdin (line 1)")
    assert byte is None or byte in message, message


def test_a_chat_s_stdin_not_utf8_as_a_script_sees_it(chat):
    import subprocess

    r = subprocess.run([sys.executable, "generate.py", "--turns", "-", "--model", str(chat), "--method", "full",
                        "--device", "cpu", "--max-new-tokens", "4"], cwd=Path(__file__).resolve().parents[1],
                       input=b"caf\xe9\n", capture_output=True, timeout=300)
    err = r.stderr.decode()
    assert r.returncode == 1 and len(err.splitlines()) == 1, err
    one_line(err.strip(), "stdin (line 1) is not UTF-8 text (byte 0xe9 at offset 3)", "iconv")


# ----------------------------------------------------------------------------- threads, sizes, modes

@pytest.mark.parametrize("main", [bench.main, evaluate.main], ids=["bench", "evaluate"])
def test_threads_above_the_cores_are_refused(main, no_loading, monkeypatch):
    monkeypatch.setattr(bench, "random_model", lambda *a, **k: pytest.fail("the model was built"))
    n = cli.cores()
    one_line(error_of(main, "--threads", 1000, "--device", "cpu"), f"--threads 1000: this machine gives this "
             f"process {n} CPU core", f"--threads 1 to {n}")
    cli.check_threads("--threads", n)  # all of them: fine


def test_a_config_too_large_for_memory_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    """A config of a million layers built on the meta device for minutes before the memory check (and was
    killed)."""
    config = json.loads((Path(__file__).resolve().parents[1] / "research" / "configs" /
                         "llama-3.1-8b.json").read_text())
    path = tmp_path / "huge.json"
    path.write_text(json.dumps({**config, "num_hidden_layers": 1_000_000}))
    monkeypatch.setattr(bench, "Transformer", lambda *a, **k: pytest.fail("a module was built"))
    t = time.perf_counter()
    one_line(error_of(bench.main, "--random-init", path, "--device", "cpu", "--mode", "decode-cost",
                      "--lengths", "64", "--methods", "streaming"), "huge's weights take", "(1,000,000 layers")
    with pytest.raises(ValueError, match="huge's weights"):
        bench.random_model(path, "cpu")
    assert time.perf_counter() - t < 10


def test_parameter_count_is_what_the_model_builds(chat):
    from support.checks import parameter_count

    cfg = model.ModelConfig.from_hf_config(chat)
    assert parameter_count(cfg) == sum(p.numel() for p in model.Transformer(cfg).parameters())


@pytest.mark.parametrize("argv, needle", [
    (["--methods", ""], "--methods '' names no method"),
    (["--first-answer-tokens", "8"], "--first-answer-tokens is read by --mode conversation, not --mode prefill"),
    (["--every", "8"], "--every is read by --mode decode and conversation, not --mode prefill"),
    (["--fidelity-tokens", "8", "--mode", "conversation"], "--fidelity-tokens is read by --mode decode"),
], ids=["methods-empty", "first-answer-tokens", "every", "fidelity-tokens"])
def test_evaluate_flags_its_mode_ignores_are_refused(argv, needle, roomy, tmp_path, no_loading):
    one_line(error_of(evaluate.main, "--model", roomy, "--device", "cpu", "--out", tmp_path / "o", *argv), needle)


def test_evaluate_mode_flags_keep_their_defaults():
    args = evaluate.get_args([])
    assert (args.every, args.fidelity_tokens, args.first_answer_tokens, args.given) == (32, 64, 64, set())
    evaluate.check_mode_flags(evaluate.get_args(["--mode", "conversation", "--first-answer-tokens", "8"]))


def test_bench_methods_empty_is_refused(no_loading, monkeypatch):
    monkeypatch.setattr(bench, "random_model", lambda *a, **k: pytest.fail("the model was built"))
    one_line(error_of(bench.main, "--methods", "", "--device", "cpu"), "--methods '' names no row")


def test_targets_empty_is_refused(roomy, tmp_path, no_loading):
    one_line(error_of(train.main, "--model", roomy, "--out", tmp_path / "o", "--targets", "", "--device", "cpu"),
             "--targets '' names no target", "none for the embeddings alone")


def test_generate_flags_a_mode_ignores_are_refused():
    """cli.check_generate_flags (support/generate_checks.check_flags calls it): --json with --show, and --show or
    --no-chat in a chat, were dropped without a word."""
    args = generate_py.get_args(["--prompt", "p", "--json", "--show"])
    with pytest.raises(ValueError, match="--show has no effect with --json"):
        cli.check_generate_flags(args)
    for flag in (["--show"], ["--no-chat"]):
        args = generate_py.get_args(["--turns", "-", *flag])
        with pytest.raises(ValueError, match=f"{flag[0]} has no effect in a chat"):
            cli.check_generate_flags(args)
    cli.check_generate_flags(generate_py.get_args(["--prompt", "p", "--show"]))


def test_max_minutes_runs_out_in_the_data_stage_too():
    assert train.time_limit(0.001, time.perf_counter() - 1)()  # the data stage asks it between batches
    assert not train.time_limit(None, time.perf_counter() - 1)()


# ----------------------------------------------------------------------------- what a path is, said as it is

def test_paths_that_are_not_files_are_said_as_what_they_are(tmp_path, chat, no_loading):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    one_line(error_of(generate_py.main, "--prompt", loop, "--model", chat), f"--prompt {loop} is a symlink loop")
    for dev in ("/dev/null", "/dev/zero"):
        if os.path.exists(dev):
            one_line(error_of(generate_py.main, "--prompt", dev, "--model", chat), f"--prompt {dev} is a device")
    with pytest.raises(ValueError, match="is a device, not a folder"):
        cli.output_folder("--out", "/dev/null")
    with pytest.raises(ValueError, match="is a symlink loop, not a folder"):
        cli.output_folder("--out", loop)


def test_a_sliding_window_that_shortens_the_context_is_named(chat, tmp_path):
    folder = edit_config(shutil.copytree(chat, tmp_path / "m"), model_type="mistral", sliding_window=16,
                         max_position_embeddings=4096)
    cfg = model.ModelConfig.from_hf_config(folder)
    with pytest.raises(ValueError, match=r"--window 32 is longer than .* context of 16 \(its sliding_window in "
                                         r"config.json, shorter than max_position_embeddings 4096\)"):
        cli.check_window_fits("--window", 32, cfg)
    cli.check_window_fits("--window", 16, cfg)


def test_a_checkpoint_too_large_for_the_memory_free_is_refused_before_it_loads(chat, monkeypatch):
    monkeypatch.setattr(cli, "free_memory_gib", lambda device: 1e-7)
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(ValueError, match=r"weights take .* \(1 layers of hidden size 16\), more than the 0.0 GiB free"):
        cli.load(chat, "cpu")


def test_no_message_recommends_a_stage_train_py_does_not_have():
    """train.py has no --stage budgets (research/train_lab.py has): messages said to run it."""
    root = Path(__file__).resolve().parents[1]
    said = [str(f.relative_to(root)) for f in root.rglob("*.py") if "tests" not in f.relative_to(root).parts
            and "train.py --stage budgets" in f.read_text(errors="replace")]
    assert said == []


# ----------------------------------------------------------------------------- damaged adapter files

@pytest.mark.parametrize("suffix", [".safetensors", ".json"])
@pytest.mark.parametrize("damage", ["garbage", "cut in half"])
@pytest.mark.parametrize("entry", ["generate.py", "export_peft"])
def test_each_adapter_loader_names_a_damaged_file_in_one_line(entry, damage, suffix, chat, prompt, tmp_path,
                                                             no_loading):
    """Every command that reads an adapter reads it through methods.load_adapter (LookaheadModule.load): a garbage
    or truncated copy of either of its two files is one `error:` line naming that file, before any model loads."""
    from lookaheadkv import LookaheadModule
    from extensions.export_peft import main as export_main

    adapter = tmp_path / "a.safetensors"
    torch.manual_seed(0)
    LookaheadModule(model.ModelConfig.from_hf_config(chat), n_tokens=4).save(adapter)
    damaged = adapter.with_suffix(suffix)
    raw = damaged.read_bytes()
    damaged.write_bytes(bytes(range(256)) * 4 if damage == "garbage" else raw[: len(raw) // 2])
    if entry == "generate.py":
        said = error_of(generate_py.main, "--prompt", prompt, "--model", chat, "--adapter", adapter)
    else:
        said = error_of(export_main, adapter, tmp_path / "peft", "--model", chat)
    one_line(said, str(damaged))
    assert not (tmp_path / "peft").exists()
