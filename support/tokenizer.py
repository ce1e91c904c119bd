"""
The tokenizer of a Hugging Face model folder and its chat formats (no jinja: the two formats our models
use, ChatML and Llama-3, written out), and decode_utf8, which reads every text file the scripts take as
a prompt.

    from support.tokenizer import Tokenizer
    tok = Tokenizer("weights/SmolLM2-135M-Instruct")
    ids = tok.encode(tok.chat("Hello!"))
"""
import sys

if __name__ == "__main__":  # a library module, run by -m or by its path: said before any import can fail
    sys.exit("error: support.tokenizer is not a script: "
             "the scripts read a model's tokenizer with it: run generate.py")

import json
import re
from pathlib import Path

from tqdm import tqdm

from support.checks import read_json, redo, short_reason


CONTROL = {  # each chat format's control tokens, as its template writes them
    "chatml": ("<|im_start|>", "<|im_end|>", "<|endoftext|>"),
    "llama3": ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
               "<|end_of_text|>"),
}


class Tokenizer:
    """tokenizer.json through the tokenizers library, the chat format its special tokens name, and the ids
    that stop decoding. cfg (a ModelConfig) if given: the tokenizer must fit its vocab_size."""

    def __init__(self, path, cfg=None):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        if not (path / "tokenizer.json").exists():
            raise FileNotFoundError(f"no tokenizer.json in {path}: use a Hugging Face model folder that has one")
        fix = Advice(path)  # what to do about a broken file, made only if a message needs it
        try:
            self.tk = HFTokenizer.from_file(str(path / "tokenizer.json"))
            self.tk.encode("a probe, 42 \u00e9")  # some damage (an unk token not in the vocab) shows at encode only
        except Exception as e:  # the tokenizers library raises a bare Exception
            raise ValueError(f"{path / 'tokenizer.json'} is not a tokenizer we can read ({short_reason(e)}): "
                             f"{fix}") from None
        configs = {name: read_json(path / name, fix) if (path / name).exists() else {}
                   for name in ("tokenizer_config.json", "generation_config.json")}  # both optional
        template = chat_template(configs["tokenizer_config.json"], path, fix)
        vocab = self.tk.get_vocab(with_added_tokens=True)
        fix = Advice(path, damaged=False)  # from here on the files are whole but may not agree
        if cfg is not None and vocab and max(vocab.values()) >= cfg.vocab_size:  # two files, one model: they agree
            raise ValueError(f"{path / 'tokenizer.json'} makes token ids up to {max(vocab.values())} but "
                             f"{path / 'config.json'} says vocab_size {cfg.vocab_size}: the two files come from "
                             f"different models; use the tokenizer.json that came with the weights ({fix})")
        if cfg is not None:
            check_serves(path, vocab, cfg, configs, fix)
        if "<|im_start|>" in vocab:
            self.format = "chatml"  # SmolLM2, Qwen
            # a template that opens with a fixed system message (SmolLM2, Qwen2.5) uses it when
            # the user gives none; we read that literal text out of the template (its newline is
            # a real one in HF's tokenizer_config.json, or a jinja "\n" escape in hand-written ones)
            # (no "<" in it either: each match then stops at the next tag, so a template of many
            # "<|im_start|>system" is read in one pass, not once per tag, quadratic: 480 KB took minutes)
            m = re.search(r"<\|im_start\|>system(?:\n|\\n)([^'\"{}<]+)<\|im_end\|>", template)
            self.default_system = m.group(1) if m else None
            stop = ["<|im_end|>", "<|endoftext|>"]
        elif "<|start_header_id|>" in vocab:
            self.format = "llama3"
            self.default_system = None
            stop = ["<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"]
        else:
            self.format, self.default_system, stop = None, None, []
        ids = [vocab[s] for s in stop if s in vocab] + (list(cfg.eos_token_id) if cfg else [])
        self.stop_ids = sorted(set(ids + generation_eos(configs["generation_config.json"], path, fix)))
        if cfg is not None and self.stop_ids and self.stop_ids[-1] >= cfg.vocab_size:
            raise ValueError(f"stop token id {self.stop_ids[-1]} (config.json or generation_config.json's "
                             f"eos_token_id) is outside vocab_size {cfg.vocab_size} in {path}: {fix}")
        self.bos = "<|begin_of_text|>" if self.format == "llama3" else ""
        # the chat template's own control tokens: a user's text that holds one is encoded as the control token
        # itself (a turn ended, a role opened), said once (warn_control). The tokenizer's other special tokens
        # (SmolLM2's <filename>, <jupyter_code>, ...) are no part of a chat's structure
        specials = {t.content for t in self.tk.get_added_tokens_decoder().values() if t.special}
        self.specials = [t for t in CONTROL.get(self.format, ()) if t in specials]
        self.warned = set()

    def encode(self, text):
        return self.tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.tk.decode(list(ids), skip_special_tokens=False)

    def control_text(self, text):
        """The chat template's control tokens (<|im_end|>, <|eot_id|>, ...) that `text` holds."""
        return [t for t in self.specials if t in text]

    def warn_control(self, text):
        """One `warning:` line when a user's text holds the template's control text, which encode() reads as the
        control tokens themselves (the turn ends there, a role opens): said once per text, as chat() and
        next_turn() wrap it (a chat's first turn is wrapped twice: checked, then answered)."""
        found = self.control_text(text)
        if not found or text in self.warned:
            return
        self.warned.add(text)
        # cli.warn's line (cli imports this file, so it is written here): on a line of its own, past any progress bar
        tqdm.write(f"warning: the message holds {', '.join(found[:3])}{', ...' if len(found) > 3 else ''}, the chat "
                   f"template's control text: it is read as the control token itself (the turn ends or a role opens "
                   f"there), not as text; remove it if that is not meant", file=sys.stderr)

    def chat(self, user, system=None):
        """The prompt text for one user turn, ready for the assistant's answer."""
        self.warn_control(user)
        system = system if system is not None else self.default_system
        if self.format == "chatml":
            s = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
            return s + f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        if self.format == "llama3":
            h = lambda role: f"<|start_header_id|>{role}<|end_header_id|>\n\n"
            s = h("system") + system + "<|eot_id|>" if system else ""
            return self.bos + s + h("user") + user + "<|eot_id|>" + h("assistant")
        raise ValueError("this tokenizer has no chat format we know (ChatML or Llama-3): "
                         "send the prompt without a chat template")

    def next_turn(self, user):
        """The text that follows an assistant's answer: its end-of-turn token (decoding stops at a stop
        token without feeding it), then the next user turn, ready for the next answer. So
        chat(u1) + answer + next_turn(u2) is the template's own rendering of the conversation."""
        self.warn_control(user)
        if self.format == "chatml":
            return f"<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        if self.format == "llama3":
            h = lambda role: f"<|start_header_id|>{role}<|end_header_id|>\n\n"
            return "<|eot_id|>" + h("user") + user + "<|eot_id|>" + h("assistant")
        raise ValueError("this tokenizer has no chat format we know (ChatML or Llama-3): a conversation needs one")


# A model's embedding may have more rows than its tokenizer has ids (Qwen2.5: 151936 for 151665 ids, padded to a
# multiple the kernels like), never many more: a tokenizer this far short of vocab_size is another model's
SPARE_IDS, SPARE_SHARE = 1024, 0.05


def special_name(value):
    """A special token as tokenizer_config.json writes it: a string, or {"content": "<|im_end|>", ...}; else None."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class Advice:
    """support/checks.redo's advice for a model folder, as text only when a message is made: redo reads the
    folder's marker and hashes its files, which a tokenizer that loads fine never needs."""

    def __init__(self, path, damaged=True):
        self.path, self.damaged = path, damaged

    def __str__(self):
        return redo(self.path, damaged=self.damaged)


def check_serves(path, vocab, cfg, configs, fix):
    """tokenizer.json against the model it claims to serve, before any weight loads: a tokenizer of another model
    whose ids all fall below vocab_size encodes every prompt into other tokens, and the model answers nonsense with
    exit 0. Two signs, each cheap and each true of every real checkpoint folder: (1) its size: ids far fewer than
    config.json's vocab_size (more than SPARE_IDS and SPARE_SHARE of it unused); (2) its special tokens: the
    eos_token and bos_token that tokenizer_config.json names must be in tokenizer.json, at the ids config.json and
    generation_config.json give them (eos: any of their eos_token_id; bos: bos_token_id)."""
    tok_file, n = path / "tokenizer.json", max(vocab.values(), default=-1) + 1
    spare = cfg.vocab_size - n
    if spare > SPARE_IDS and spare > SPARE_SHARE * cfg.vocab_size:
        raise ValueError(f"{tok_file} has {n} token ids but {path / 'config.json'} says vocab_size {cfg.vocab_size}: "
                         f"{spare} embedding rows no token would reach, so the tokenizer belongs to another model; "
                         f"use the tokenizer.json that came with the weights ({fix})")
    tc, gc = configs["tokenizer_config.json"], configs["generation_config.json"]
    model = read_json(path / "config.json", fix) if (path / "config.json").is_file() else {}
    eos_ids = set(cfg.eos_token_id) | set(generation_eos(gc, path, fix))
    bos_id = model.get("bos_token_id")
    bos_ids = {bos_id} if isinstance(bos_id, int) and not isinstance(bos_id, bool) else set()
    for key, ids, where in (("eos_token", eos_ids, "eos_token_id in config.json or generation_config.json"),
                            ("bos_token", bos_ids, "bos_token_id in config.json")):
        name = special_name(tc.get(key))
        if name is None or not ids:
            continue
        if name not in vocab:
            raise ValueError(f"{tok_file} has no token {name!r}, the {key} of {path / 'tokenizer_config.json'}: the "
                             f"tokenizer belongs to another model; use the tokenizer.json that came with the weights "
                             f"({fix})")
        if vocab[name] not in ids:
            raise ValueError(f"{tok_file} gives {key} {name!r} the id {vocab[name]}, but {where} says "
                             f"{', '.join(map(str, sorted(ids)))}: the tokenizer belongs to another model; use the "
                             f"tokenizer.json that came with the weights ({fix})")


MAX_TEMPLATE = 100_000  # characters of a chat template (Llama 3.1's, with tools: ~4,000)


def chat_template(tc, path, fix):
    """tokenizer_config.json's (tc) chat_template ("" if none): only read for the default system message."""
    tc_file = path / "tokenizer_config.json"
    template = tc.get("chat_template") or ""
    if isinstance(template, list):  # several named templates: [{"name": "default", "template": "..."}, ...]
        template = next((t.get("template") for t in template
                         if isinstance(t, dict) and t.get("name") == "default"), "")
    if not isinstance(template, str):
        raise ValueError(f"{tc_file}: chat_template is {json.dumps(template)[:60]}, it must be a string "
                         f"(a jinja template): {fix}")
    if len(template) > MAX_TEMPLATE:  # a handed folder's: no model's template is near this
        raise ValueError(f"{tc_file}: chat_template is {len(template)} characters, more than the {MAX_TEMPLATE} any "
                         f"model's needs: {fix}")
    return template


def generation_eos(gc, path, fix):
    """generation_config.json's (gc) eos_token_id as a list ([] if none): more ids that stop decoding."""
    gen = path / "generation_config.json"
    e = gc.get("eos_token_id")
    e = e if isinstance(e, list) else ([] if e is None else [e])
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in e):
        raise ValueError(f"{gen}: eos_token_id must be a token id (a whole number >= 0) or a list of "
                         f"them: {fix}")
    return e


def decode_utf8(raw, where):
    """bytes -> str (a leading BOM dropped); UTF-16 text that says so with its BOM (Windows editors write it)
    is read as such. ValueError naming `where` and the first bad byte if they are not UTF-8 (Python's own
    message names neither the file nor the fix)."""
    if raw[:2] in (b"\xff\xfe", b"\xfe\xff"):
        try:
            return raw.decode("utf-16")
        except UnicodeDecodeError:
            raise ValueError(f"{where} starts with a UTF-16 byte order mark but is not UTF-16 text: convert it "
                             f"to UTF-8, e.g. iconv -t utf-8") from None
    try:
        return raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}): "
                         f"convert it, e.g. iconv -t utf-8") from None
