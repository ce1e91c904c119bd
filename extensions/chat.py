"""
Beyond the paper: a chat on a bounded cache (generate.py --turns).

Turn 1 is the paper's setting: compress() keeps --budget slots of the prompt. Each later turn (the end
of the previous answer, the user message and the assistant's header, Tokenizer.next_turn) is prefilled
on top of the compressed cache, and every slot, old turns and the new one alike, is scored by the
method's decode-phase form and evicted to --budget before the answer is decoded (add_turn, in
extensions/decode.py, which this file builds on); --decode-budget holds the answers too. "/reset"
starts a new conversation.

    python generate.py --turns - --budget 128           # one line a turn on stdin, /reset, Ctrl-D
    python generate.py --turns turns.json --budget 128  # a JSON list of user turns

It prints each answer and one stats line per turn (--json: one JSON object per turn).
"""
import sys

if __name__ == "__main__":  # a library module, run by -m or by its path: said before any import can fail
    sys.exit("error: extensions.chat is not a script: "
             "it is generate.py's chat: python generate.py --turns FILE (or - for stdin)")

import dataclasses
import itertools
import json
import time

import torch

from support import cli, files
from eviction import compress, decode
from extensions.decode import DecodeEviction, add_turn
from methods import make_scorer

# -----------------------------------------------------------------------------
# The user turns


def turns_of(args, tok, context):
    """generate.py's --turns, checked before the model loads: a JSON file, read now, or "-": stdin, read a line
    at a time as the chat goes, its first turn read now (first_then_rest), so that a bad one (not UTF-8, binary)
    stops before the weights load. context: the model's, in tokens: text too long for it is refused by its size,
    before it is tokenized; a conversation's first turn, with --max-new-tokens, by its tokens."""
    if tok.format is None:
        raise ValueError("a chat needs a chat format (ChatML or Llama-3); this tokenizer has none: use --prompt")
    if args.turns != "-":
        turns = read_turns(args.turns, context)  # sizes first: a turn too big never reaches the tokenizer
        check_first_turns(turns, tok, args.max_new_tokens, context)
        return turns
    check_first_turns(None, tok, args.max_new_tokens, context)  # the template alone fits, before a turn is awaited
    return first_then_rest(stdin_turns(context))


def first_then_rest(turns):
    """The turns of a generator, its first one read now (before the model loads), the rest as the chat goes. A
    /reset before the first turn has nothing to reset; a stdin without a turn (empty, blank lines, only /reset) is
    refused as a turns file without one is (no_turn), not a chat of nothing that exits 0 without a word."""
    for first in turns:
        if first.strip() != "/reset":
            return itertools.chain([first], turns)
    raise no_turn("stdin", "pipe or type one user turn a line, e.g. echo 'What is 2+2?' | python generate.py --turns -")


def no_turn(where, fix):
    """The one rule for a chat with nothing to answer, from a file or from stdin."""
    return ValueError(f"{where} holds no turn to answer (nothing, blank lines or only /reset): {fix}")


TURNS_CONTEXT = 8192  # tokens: a turns file read without a model's context is bounded as if by SmolLM2's
TURNS_CONTEXTS = 16  # a turns file holds at most this many contexts' worth of text (each turn fits one context)


def read_turns(path, context=None):
    """The user turns of --turns: a JSON list of strings ("/reset" starts a new conversation)."""
    p, where = cli.input_file("--turns", path), f"turns file {path}"
    # its kind and size before it is parsed, as --prompt's: 156 MB of turns took 2.2 GB of memory to refuse
    limit = cli.BYTES_PER_TOKEN * (context or TURNS_CONTEXT) * TURNS_CONTEXTS
    try:
        turns = json.loads(cli.read_text(files.read_limited(p, limit, "--turns"), where))
    except json.JSONDecodeError as e:
        raise ValueError(f"turns file {path} is not valid JSON ({e.msg}): write a list of strings") from None
    bad = (f"turns file {path}: expected a non-empty JSON list of non-empty strings, "
           f'e.g. ["Read this: ...", "And then?"]')
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise ValueError(bad)
    check_sizes(turns, context, where)  # before the slower reads of every character below, and the tokenizer
    if not all(cli.printable(t)[0].strip() for t in turns):
        raise ValueError(bad)
    if all(t.strip() == "/reset" for t in turns):
        raise no_turn(f"turns file {path}", 'write the user turns, e.g. ["Read this: ...", "And then?"]')
    return [cli.printable(t)[0] for t in turns]


def check_sizes(turns, context, where):
    """ValueError if a conversation's turns (those between two /reset) hold more bytes than `context` tokens
    can at cli.BYTES_PER_TOKEN: it cannot fit the context whatever the tokenizer does (as a --prompt file
    too big is refused by its size). Each conversation, not the file: /reset starts a new context."""
    if context is None:
        return
    limit, size, first = cli.BYTES_PER_TOKEN * context, 0, 1
    for i, t in enumerate(turns, 1):
        if t.strip() == "/reset":
            size, first = 0, i + 1
            continue
        size += len(t.encode("utf-8", "surrogatepass"))
        if size > limit:
            span = f"turn {i} holds" if i == first else f"turns {first}-{i} of one conversation hold"
            raise ValueError(f"{where}: {span} over {limit // 2**10} KB, more than the "
                             f"model's context of {context} tokens can hold: shorten them, or start a new "
                             f'conversation with "/reset" between them')


def stdin_turns(context=None):
    """User turns from stdin, one a line, until end of input (Ctrl-D). Each line is read as bytes and goes through
    the reader of --prompt - (cli.read_text: UTF-8, or refused in one line naming the line and the byte; a
    Latin-1 byte or binary once reached the tokenizer as a lone surrogate, a TypeError traceback once the model
    had loaded). A line too long for `context` tokens is said in an `error:` line and skipped, unread past the
    limit (as a turn too long for the context is, once tokenized: fits), and the chat goes on."""
    limit = None if context is None else cli.BYTES_PER_TOKEN * context
    for n, line in enumerate(stdin_lines(limit), 1):
        if line is None:
            print(f"error: this turn is over {limit // 2**10} KB, more than the model's context of {context} tokens "
                  f"can hold: shorten it", file=sys.stderr)
            continue
        if line[:2] in (b"\xff\xfe", b"\xfe\xff"):  # UTF-16's mark: its lines are not split at the byte b"\n"
            raise ValueError(f"stdin (line {n}) starts with a UTF-16 byte order mark: a chat reads stdin as UTF-8 "
                             f"lines; convert it, e.g. iconv -f UTF-16 -t UTF-8")
        line = cli.printable(cli.read_text(line, f"stdin (line {n})"))[0]
        if line.strip():
            yield line.rstrip("\n")


def stdin_lines(limit=None):
    """stdin's lines as bytes (a text stream without a buffer, as tests set it: its text, encoded back as it was
    decoded), each read at most limit + 1 bytes at a time; None for a line over `limit`, whose rest is dropped."""
    if sys.stdin is None:  # closed by the shell (`--turns - <&-`): Python sets it to None
        raise ValueError(cli.CLOSED_STDIN)
    stream = getattr(sys.stdin, "buffer", None)

    def read(n):
        if stream is not None:
            return stream.readline(n)
        text = sys.stdin.readline(n)
        return text.encode("utf-8", "surrogateescape")

    n = -1 if limit is None else limit + 1
    while True:
        if sys.stdin.isatty():
            print("> ", end="", flush=True, file=sys.stderr)
        line = read(n)
        if not line:
            return
        if limit is not None and len(line) > limit:
            while line and not line.endswith(b"\n"):  # the rest of the line, a chunk at a time, dropped
                line = read(n)
            yield None
            continue
        yield line


def check_first_turns(turns, tok, max_new_tokens, context):
    """Before the model loads: ValueError if no turn can fit the context with --max-new-tokens (the chat
    template alone, plus one token), or (a list of turns) if a conversation's first turn cannot: its position
    is known now, the later turns' only once the answers before them are."""
    floor = len(tok.encode(tok.chat(""))) + 1
    if floor + max_new_tokens > context:
        raise ValueError(f"--max-new-tokens {max_new_tokens} leaves no room for a turn: the chat template and one "
                         f"token take {floor} of the model's context of {context}; lower --max-new-tokens")
    if not isinstance(turns, list):
        return
    for i, text in enumerate(turns, 1):
        if i == 1 or turns[i - 2].strip() == "/reset":
            if text.strip() == "/reset":
                continue
            end = len(tok.encode(tok.chat(text))) + max_new_tokens
            if end > context:
                raise ValueError(f"--turns entry {i}, the first turn of its conversation, would reach position "
                                 f"{end}, beyond the model's context of {context}: shorten it, or lower "
                                 f"--max-new-tokens")


# -----------------------------------------------------------------------------
# The conversation


class Conversation:
    """A chat so far: the turn number, the compressed cache (None: nothing said yet), the next position,
    the last answer token (never fed: it opens the next turn unless it was a stop token), the scorer and
    the evictor."""

    def __init__(self):
        self.n, self.cache, self.pos, self.pending, self.scorer, self.evictor = 0, None, None, [], None, None


@torch.no_grad()
def chat_loop(args, model, tok, folder, turns, build, pick=None):
    """The chat of generate.py's flags (args) over `turns`. build() makes the prompt's Scorer and the
    DecodeEviction that holds the cache to --budget from turn 2 on (None: FullKV), once per conversation;
    pick: generate.py's sampler, one generator for the whole chat (None: greedy). Returns the turns' stats."""
    talk, out = Conversation(), []
    for text in turns:
        if text.strip() == "/reset":
            talk = Conversation()
            print(json.dumps(dict(reset=True)) if args.json else "--- new conversation")
            continue
        ids = next_ids(talk, tok, text)
        if not fits(args, model, talk, ids):
            continue
        if talk.n == 1:
            talk.scorer, talk.evictor = build()
        st, printed, last = take_turn(args, model, tok, folder, talk, ids, pick)
        out.append(st)
        report_turn(args, tok, st, printed, last)
    return out


def next_ids(talk, tok, text):
    """The turn's ids in the chat format, numbering the turn (a turn refused for the context keeps its number)."""
    if talk.cache is None:  # turn 1: the prompt compressed once, as in the paper
        talk.n = 1
        return tok.encode(tok.chat(text))
    talk.n += 1
    return talk.pending + tok.encode(tok.next_turn(text))


def fits(args, model, talk, ids):
    """Whether the turn and its answer fit the model's context. When not: an error, or in a chat on stdin an
    `error:` line and the chat goes on (/reset starts over)."""
    ctx, end = model.config.max_context, (0 if talk.cache is None else int(talk.pos)) + len(ids) + args.max_new_tokens
    if end <= ctx:
        return True
    message = (f"turn {talk.n} would reach position {end}, beyond the model's context of {ctx}: /reset to start "
               f"over, or lower --max-new-tokens")
    if args.turns != "-":
        raise ValueError(message)
    print(f"error: {message}", file=sys.stderr)
    return False


def take_turn(args, model, tok, folder, talk, ids, pick):
    """Prefill the turn (turn 1: compress the prompt; later: add_turn and evict to --budget), then decode and
    stream its answer. Returns (the turn's stats, the text printed, the last token)."""
    t0 = time.perf_counter()
    ids_t = torch.tensor([ids], device=args.device)
    before = len(ids) + (len(talk.cache) if talk.n > 1 else 0)  # slots once the turn is prefilled, before eviction
    if talk.n == 1:
        talk.cache, logits, talk.pos, _ = compress(model, ids_t, talk.scorer)
    else:
        logits, talk.pos = add_turn(model, talk.cache, ids_t, talk.pos, talk.evictor, args.budget)
    cli.check_logits(logits, folder)
    kept, log_start = len(talk.cache), len(talk.evictor.log) if talk.evictor else 0
    answer, printed, steps, last, t_first = cli.stream(tok, decode(  # without --decode-budget it only watches
        model, talk.cache, logits, talk.pos, args.max_new_tokens, tok.stop_ids, pick,
        **cli.watch(talk.evictor)), args.json)
    t_end = time.perf_counter()
    talk.pos, talk.pending = talk.pos + steps - 1, [] if last in tok.stop_ids else [last]  # steps - 1 tokens fed
    grown = [b for _, b, _ in talk.evictor.log[log_start:]] if talk.evictor else []  # evictions while decoding
    st = dict(turn=talk.n, prompt_tokens=len(ids), cache_before=before, kept=kept, answer_tokens=len(answer),
              decode_evictions=len(grown), peak_slots=max([before, len(talk.cache)] + grown),
              kv_bytes=talk.cache.nbytes(), text=tok.decode(answer), answer_ids=answer,
              ttft_ms=round((t_first - t0) * 1e3, 1),
              decode_tokens_per_s=round((steps - 1) / (t_end - t_first), 2) if steps > 1 else None)
    return st, printed, last


def report_turn(args, tok, st, printed, last):
    """The rest of the answer and the turn's stats line (--json: the turn's JSON object)."""
    if not st["text"]:
        cli.warn(f"turn {st['turn']}: " + cli.why_empty(last, tok, False))
    if args.json:
        print(json.dumps(st))
        return
    print(st["text"][len(printed):])
    print(f"--- turn {st['turn']}: prompt +{st['prompt_tokens']} tokens, cache {st['cache_before']} -> kept "
          f"{st['kept']} slots per (layer, KV head); answer {st['answer_tokens']} tokens, evictions while decoding "
          f"{st['decode_evictions']}, peak {st['peak_slots']} slots; KV {st['kv_bytes'] / 1e6:.1f} MB; "
          f"ttft {st['ttft_ms']:.0f} ms, {st['decode_tokens_per_s'] or 0:.1f} tok/s")


# -----------------------------------------------------------------------------
# generate.py --turns: what generate.py calls once the model is loaded (turns_of checked the turns before)


def chat(args, model, tok, folder, turns, eviction, module, pick=None):
    """The chat of generate.py's flags over `turns` (turns_of's), each conversation with its own Scorer
    of `eviction` (module: the adapter) and DecodeEviction: the turns' stats."""
    def fresh():
        scorer = make_scorer(eviction, module)
        if args.method == "full":
            return scorer, None
        held = make_scorer(dataclasses.replace(eviction, budget=args.decode_budget or args.budget), module)
        return scorer, DecodeEviction(held, args.every if args.decode_budget is not None else None, args.window)
    return chat_loop(args, model, tok, folder, turns, build=fresh, pick=pick)
