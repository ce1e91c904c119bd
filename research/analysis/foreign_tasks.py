"""Prompts from text the training never reads, for `evaluate.py --tasks`: a check that the adapter
generalises beyond its own data (speeches, essays and stdlib code) and beyond the RULER-style suite.

Two kinds of document, both already on a Debian/Ubuntu machine with Python 3.11:
  - the Python language reference (pydoc_data/topics.py, which data.py never reads): prose with
    grammar rules and short code examples;
  - the free-software licences in /usr/share/common-licenses (GPL, LGPL, MPL, GFDL, Apache): legal text.
Each prompt is one document cut to about --max-chars at a paragraph end, with a request before or
after it (summaries, lists, explanations, questions about conditions). There is no expected
answer: evaluate.py compares every method with FullKV's own answer (answer KL, fidelity, recall).

    python research/analysis/foreign_tasks.py --out runs/foreign/tasks.jsonl
    python -m research.evaluate --tasks runs/foreign/tasks.jsonl --methods snapkv,pyramidkv,h2o,lookahead,lookahead-untrained \
        --budgets 64,128,256 --max-new-tokens 48 --out runs/foreign

With --facts, other documents of the same two kinds each get one planted fact instead (a five-digit
code, a seven-digit number or a made-up full name, drawn from a fixed seed, at a different depth in
each) and a question about it at the end: an exact answer that survives eviction only if every one
of its tokens does. evaluate.py scores these by string match (accuracy), as the 2K suite:

    python research/analysis/foreign_tasks.py --facts --out runs/facts/tasks.jsonl
    python -m research.evaluate --tasks runs/facts/tasks.jsonl --budgets 64,128,256 --max-new-tokens 24 --out runs/facts
"""

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from support import cli, files  # noqa: E402

LICENCES = Path("/usr/share/common-licenses")
LICENCE_FILES = ("GPL-2", "GPL-3", "LGPL-2.1", "MPL-1.1", "MPL-2.0", "GFDL-1.3", "Apache-2.0", "LGPL-2")
LICENCE_ASKS = (
    "Summarise the conditions under which someone may redistribute the work covered by this licence.",
    "What does this licence say about warranty and liability? Answer in two sentences.",
    "List the obligations a person takes on when they distribute a modified version.",
    "Explain in plain words what this licence allows and what it forbids.",
)
REFERENCE_ASKS = (
    "In two or three sentences, what does this section of the Python reference specify?",
    "List the keywords, operators or special methods this section names.",
    "Pick one code example from the text and explain what it does.",
    "What errors or restrictions does this section mention? Answer briefly.",
)


def cut(text, max_chars):
    """The text up to the last paragraph end before max_chars (whole text if shorter)."""
    if len(text) <= max_chars:
        return text.strip()
    head = text[:max_chars]
    end = head.rfind("\n\n")
    return (head[:end] if end > max_chars // 2 else head).strip()


def documents(min_chars):
    """(id, kind, text) of the reference topics and the licences, in a fixed order."""
    docs = []
    try:
        from pydoc_data.topics import topics
    except ImportError:
        topics = {}
    for name in sorted(topics):
        if len(topics[name]) >= min_chars:
            docs.append((f"reference/{name}", "reference", topics[name]))
    for name in LICENCE_FILES:
        path = LICENCES / name
        if path.exists() and path.stat().st_size >= min_chars:
            docs.append((f"licence/{name}", "licence", path.read_text(errors="replace")))
    return docs


def build(per_kind=8, max_chars=7500, min_chars=6000):
    rows = []
    for kind, asks in (("reference", REFERENCE_ASKS), ("licence", LICENCE_ASKS)):
        docs = [d for d in documents(min_chars) if d[1] == kind][:per_kind]
        for i, (doc_id, _, text) in enumerate(docs):
            ask, doc = asks[(i // 2) % len(asks)], cut(text, max_chars)
            # each request once after a document, once before the next: where the question sits matters
            prompt = f"{ask}\n\n{doc}" if i % 2 else f"{doc}\n\n{ask}"
            rows.append(dict(id=doc_id, task=kind, prompt=prompt, answers=[]))
    return rows


PLACES = ("harbour", "granite", "willow", "northern", "lantern", "copper", "meadow", "citadel", "orchard", "beacon",
          "tannery", "quarry")
FIRST = ("Ilse", "Tobin", "Marisol", "Kaspar", "Odile", "Renzo", "Saoirse", "Bertil", "Yevgenia", "Caspian")
SURNAME = (("Wendel", "Orsk", "Vantre", "Halvor", "Quill", "Brisco"), ("thorpe", "avec", "beck", "ingham", "ström", "lund"))
FACTS = (  # (the planted sentence, the question, the kind of value)
    ("The access code for the {place} archive is {value}.",
     "What is the access code for the {place} archive? Answer with the code only.", "code"),
    ("The registration number of the {place} office is {value}.",
     "What is the registration number of the {place} office? Answer with the number only.", "number"),
    ("The agreement for the {place} project was signed by {value}.",
     "Who signed the agreement for the {place} project? Answer with the full name only.", "name"),
)


def draw(kind, rng):
    if kind == "code":
        return str(rng.randrange(10_000, 100_000))  # five digits
    if kind == "number":
        return str(rng.randrange(1_000_000, 10_000_000))  # seven digits
    return f"{rng.choice(FIRST)} {rng.choice(SURNAME[0])}{rng.choice(SURNAME[1])}"


def build_facts(n=12, max_chars=7500, min_chars=6000, seed=0):
    """n prompts: documents the plain build does not use (reference topics after its first 8, in
    order), each cut to max_chars, with one fact planted at a paragraph end at depth 20-80% and the
    question after the document."""
    rng = random.Random(seed)
    refs = [d for d in documents(min_chars) if d[1] == "reference"][8:]
    rows = []
    for i, (doc_id, kind, text) in enumerate(refs[:n]):
        sentence, question, value_kind = FACTS[i % len(FACTS)]
        place, value = PLACES[i % len(PLACES)], draw(value_kind, rng)
        paragraphs = cut(text, max_chars).split("\n\n")
        at = max(1, round(len(paragraphs) * (0.2 + 0.6 * (i % 4) / 3)))  # depth 20%, 40%, 60%, 80%
        paragraphs.insert(at, sentence.format(place=place, value=value))
        prompt = "\n\n".join(paragraphs) + "\n\n" + question.format(place=place)
        rows.append(dict(id=f"fact/{value_kind}/{doc_id}", task=f"fact_{value_kind}", prompt=prompt, answers=[value]))
    return rows


def ours(path):
    """Whether path holds rows as this script writes them (an earlier run's, which a new one may replace)."""
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (ValueError, OSError):
        return False
    return bool(rows) and all(isinstance(r, dict) and {"id", "task", "prompt"} <= set(r) for r in rows)


def main(argv=None):
    return cli.run(lambda: write_tasks(argv))


def write_tasks(argv):
    p = cli.Parser("research/analysis/foreign_tasks.py", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/foreign/tasks.jsonl")
    p.add_argument("--per-kind", type=int, default=8, help="prompts per kind of document")
    p.add_argument("--max-chars", type=int, default=7500, help="document length cap (about 1.5-2K tokens)")
    p.add_argument("--facts", action="store_true", help="planted facts with exact answers instead (see above)")
    p.add_argument("--n-facts", type=int, default=12, help="--facts: how many prompts")
    args = p.parse_args(argv)
    for flag, value in (("--per-kind", args.per_kind), ("--max-chars", args.max_chars), ("--n-facts", args.n_facts)):
        if value < 1:
            sys.exit(f"error: {flag} {value}: must be at least 1")
    cli.output_file("--out", args.out, ".jsonl")
    if Path(args.out).exists() and not ours(Path(args.out)):  # a file of the user's under the same name stays
        raise ValueError(f"--out {args.out} exists and is not a task file this script wrote: move it away or pass "
                         "another --out")
    rows = build_facts(args.n_facts, args.max_chars) if args.facts else build(args.per_kind, args.max_chars)
    if not rows:
        sys.exit("error: no documents found: this needs Python's pydoc_data or /usr/share/common-licenses")
    files.write_atomic(args.out, "".join(json.dumps(r) + "\n" for r in rows))  # whole, never through a link
    kinds = {k: sum(r["task"] == k for r in rows) for k in sorted({r["task"] for r in rows})}
    print(f"wrote {len(rows)} prompts to {args.out}: {kinds}")


if __name__ == "__main__":
    main()
