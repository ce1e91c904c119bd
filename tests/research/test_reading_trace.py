"""research/analysis/reading_trace.py on hand-made traces (no model runs): each executed function counts once
with its whole def, in the category its file and name put it in."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("reading_trace", ROOT / "research" / "analysis" / "reading_trace.py")
rt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rt)


def first_line(rel, name):
    return next(a for a, (b, n) in rt.def_spans(ROOT / rel).items() if n == name)


def span(rel, name):
    a = first_line(rel, name)
    return rt.def_spans(ROOT / rel)[a][0] - a + 1


def test_each_function_counts_once_in_its_category():
    seen = {"support/recipe.py": {first_line("support/recipe.py", n) for n in ("check", "compare", "read_rows")},
            "support/metrics.py": {first_line("support/metrics.py", "keep_fraction")},
            "support/selection.py": {first_line("support/selection.py", "parse_rule")}}
    got = rt.line_counts(seen)
    read, skip, checks, measure, names = got["support/recipe.py"]
    assert (read, names) == (0, [])
    assert checks == span("support/recipe.py", "check") and skip == span("support/recipe.py", "read_rows")
    assert measure == span("support/recipe.py", "compare")
    assert got["support/metrics.py"][1] == span("support/metrics.py", "keep_fraction")  # --show's formatting
    # a function no category names is what a learner must open
    assert got["support/selection.py"][0] == span("support/selection.py", "parse_rule")
    assert got["support/selection.py"][4] == ["parse_rule"]


def test_a_nested_def_inside_a_counted_one_is_not_counted_again():
    rel = "train.py"
    outer, inner = first_line(rel, "train_loop"), first_line(rel, "batch")
    got = rt.line_counts({rel: {outer, inner}})
    assert sum(got[rel][:4]) == span(rel, "train_loop")
