"""research/analysis/reading_trace.py on hand-made traces (no model runs): each line that ran counts once, in the
category of its outermost function, and the tracer sees the threads the traced function starts."""
import importlib.util
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("reading_trace", ROOT / "research" / "analysis" / "reading_trace.py")
rt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rt)


def lines_of(rel, name):
    """Every line of function `name` in file `rel` (as if all of it ran)."""
    a = next(a for a, (b, n) in rt.def_spans(ROOT / rel).items() if n == name)
    return set(range(a, rt.def_spans(ROOT / rel)[a][0] + 1))


def test_each_line_counts_once_in_its_functions_category():
    recipe = lines_of("support/recipe.py", "check") | lines_of("support/recipe.py", "compare") \
        | lines_of("support/recipe.py", "read_rows")
    seen = {"support/recipe.py": recipe, "support/metrics.py": lines_of("support/metrics.py", "keep_fraction"),
            "support/checks.py": lines_of("support/checks.py", "read_tensor") | lines_of("support/checks.py", "check_shape")}
    got = rt.line_counts(seen)
    read, skip, checks, names = got["support/recipe.py"]
    # the closing comparison the learner's run prints is read; the checks raise; reading rows is I/O
    assert (read, names) == (len(lines_of("support/recipe.py", "compare")), ["compare"])
    assert checks == len(lines_of("support/recipe.py", "check")) and skip == len(lines_of("support/recipe.py", "read_rows"))
    assert got["support/metrics.py"][1] == len(lines_of("support/metrics.py", "keep_fraction"))  # --show's formatting
    # the loader's reading of a tensor is read, its shape check is a check
    assert got["support/checks.py"][3] == ["read_tensor"]
    assert got["support/checks.py"][2] == len(lines_of("support/checks.py", "check_shape"))


def test_a_line_counts_once_however_often_it_ran_and_nested_defs_count_in_the_outer_one():
    rel = "train.py"
    outer = lines_of(rel, "train_loop")
    got = rt.line_counts({rel: outer | lines_of(rel, "batch")})
    assert sum(got[rel][:3]) == len(outer)


def test_the_tracer_sees_the_lines_that_run_in_threads_too():
    import torch

    import support.metrics as metrics

    def fn():
        t = threading.Thread(target=metrics.keep_fraction, args=([torch.tensor([[[0, 1]]])], 4))
        t.start()
        t.join()
    seen = rt.trace(fn)
    keep = lines_of("support/metrics.py", "keep_fraction")
    assert seen["support/metrics.py"] & keep, "the thread's lines were not seen"
