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
            for name, module in list(sys.modules.items()):
                if str(getattr(module, "__file__", None) or "").startswith(str(ROOT)):
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
