"""
The reading path is the paper alone (issue 60): no file on it imports extensions/, and with every extension file
deleted from a copy of the checkout the core, generate.py's default run (the paper's form: max-pool 7, C in every
layer) and train.py still work; a flag that asks for a deleted one is one error line naming it. An idea beyond the paper runs only when its
flag asks for it, and only then is its file imported, by name (methods.extension); support/ never imports one.
"""
import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lookaheadkv import LookaheadModule
from model import ModelConfig
from test_cli import write_tiny

ROOT = Path(__file__).resolve().parents[1]
READING_PATH = ["model.py", "eviction.py", "lookaheadkv.py", "baselines.py", "methods.py", "train.py", "generate.py"]
EXTENSIONS = sorted(p.name for p in (ROOT / "extensions").glob("*.py") if p.name != "__init__.py")


def imported_modules(path):
    """Every module an import statement in the file names, at any depth (inside functions too)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names += [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
    return names


@pytest.mark.parametrize("name", READING_PATH)
def test_no_file_on_the_reading_path_imports_an_extension(name):
    assert not [m for m in imported_modules(ROOT / name) if m.split(".")[0] == "extensions"], name


def test_imports_run_one_way():
    """No extension imports a script (train, generate, research/); support/ imports no extension, by an import
    statement or by name (importlib: the flag's loader is methods.extension, the scripts' business); the reading
    path imports nothing of weights/ (the weights and their preparation), whose checks live in support/checks.py."""
    scripts = {"train", "generate", "research"}
    # a dynamic import is no import statement: its call, or an extension's module name as a string
    # ('"extensions.' also finds f"extensions.{name}")
    dynamic = ("import_module", "__import__", '"extensions.', "'extensions.")
    for path in (ROOT / "extensions").glob("*.py"):
        assert not [m for m in imported_modules(path) if m.split(".")[0] in scripts], path.name
    for path in (ROOT / "support").glob("*.py"):
        assert not [m for m in imported_modules(path) if m.split(".")[0] == "extensions"], path.name
        assert not [s for s in dynamic if s in path.read_text()], path.name
    for name in READING_PATH:
        assert not [m for m in imported_modules(ROOT / name) if m.split(".")[0] == "weights"], name


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny model folder, an adapter for it (M = 4) and a prompt file."""
    folder = write_tiny(tmp_path_factory.mktemp("tiny"), ["[UNK]", "</s>", "what", "is", "two", "and", "?", "."])
    adapter = folder.parent / "adapter.safetensors"
    torch.manual_seed(0)
    LookaheadModule(ModelConfig.from_hf_config(folder), n_tokens=4).save(adapter)
    prompt = folder.parent / "prompt.txt"
    prompt.write_text(" ".join(["what is two and two ?"] * 6))
    return folder, adapter, prompt


def checkout_without(tmp_path, deleted):
    """A copy of the checkout's code (no runs, no weights) with the named extension files deleted."""
    dest = tmp_path / "checkout"
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns("runs", "weights", ".git", "__pycache__", "research",
                                                              "tests", "examples", "*.md", "*.png"))
    (dest / "weights").mkdir()
    shutil.copy(ROOT / "weights" / "prepare.py", dest / "weights" / "prepare.py")
    for name in deleted:
        (dest / "extensions" / name).unlink()
    return dest


def test_deleting_the_extensions_leaves_the_core_generate_and_train(tiny_run, tmp_path):
    """Every extension file deleted at once. Deleting any one of them is covered by this: the default run imports
    none of them (below, and test_the_default_run_with_the_shipped_adapter_loads_no_extension with all present),
    so which of them are present cannot change it; a flag that asks for a deleted one:
    test_a_flag_beyond_the_paper_names_its_deleted_file."""
    folder, adapter, prompt = tiny_run
    dest = checkout_without(tmp_path, EXTENSIONS)
    code = f"""
import json, sys
import train, generate
stats = generate.main(["--prompt", {str(prompt)!r}, "--model", {str(folder)!r}, "--adapter", {str(adapter)!r},
                       "--budget", "8", "--max-new-tokens", "3", "--json", "--device", "cpu"])
print(json.dumps(dict(rule=stats["rule"], budgets=stats["budgets"], kept=stats["kept_tokens"],
                      extensions=sorted(m for m in sys.modules if m.startswith("extensions.")))))
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=dest, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == dict(rule="max:7", budgets="C in every layer", kept=8, extensions=[])
    r = subprocess.run([sys.executable, "train.py", "--help"], cwd=dest, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--targets" in r.stdout, r.stderr[-2000:]


def test_a_flag_beyond_the_paper_names_its_deleted_file(tiny_run, tmp_path):
    """--pool span:8 with extensions/span.py deleted is one `error:` line naming the missing file, before loading."""
    folder, adapter, prompt = tiny_run
    dest = checkout_without(tmp_path, ["span.py"])
    r = subprocess.run([sys.executable, "generate.py", "--prompt", str(prompt), "--model", str(folder), "--adapter",
                        str(adapter), "--pool", "span:8", "--device", "cpu"], cwd=dest, capture_output=True,
                       text=True, timeout=120)
    said = "error: --pool span:8: selection rule 'span:8' is beyond the paper and lives in extensions/span.py"
    assert r.returncode == 1 and r.stderr.startswith(said), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_layer_budgets_asked_of_an_adapter_without_them_is_refused(tiny_run):
    """--layer-budgets with an adapter whose .json holds no layer_weights: one `error:` line, not C in every layer."""
    from test_cli import error_of, one_line

    import generate

    folder, adapter, prompt = tiny_run
    one_line(error_of(generate.main, "--prompt", prompt, "--model", folder, "--adapter", adapter, "--layer-budgets",
                      "--device", "cpu"), "--layer-budgets: the adapter", "has no layer_weights in its .json")


def test_the_default_run_with_the_shipped_adapter_loads_no_extension():
    """generate.py's default run on the real model with the shipped adapter, whose .json recommends the span rule
    and per-layer budgets (beyond the paper): it selects in the paper's form, says the recommendation, and no
    `extensions.*` module is loaded (the .json is checked as text and numbers; its extension only when a flag asks)."""
    from conftest import REAL_ADAPTER, REAL_FOLDER

    if not (REAL_FOLDER / "model.safetensors").is_file():
        pytest.skip("the real model is not prepared (python weights/prepare.py)")
    assert json.loads(REAL_ADAPTER.with_suffix(".json").read_text()).get("layer_weights"), "the shipped .json"
    code = """
import json, sys
import generate
stats = generate.main(["--prompt", "examples/needle.txt", "--max-new-tokens", "2", "--json", "--device", "cpu"])
print(json.dumps(dict(rule=stats["rule"], budgets=stats["budgets"], recommends=stats.get("recommends"),
                      extensions=sorted(m for m in sys.modules if m.startswith("extensions")))))
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == dict(rule="max:7", budgets="C in every layer", recommends="--pool span:8:1024 --layer-budgets",
                       extensions=[])
