"""
The tokenizer of a Hugging Face model folder and its chat formats (no jinja: the two formats our models
use, ChatML and Llama-3, written out), and decode_utf8, which reads every text file the scripts take as
a prompt.

    from support.tokenizer import Tokenizer
    tok = Tokenizer("weights/SmolLM2-135M-Instruct")
    ids = tok.encode(tok.chat("Hello!"))
"""

import json
import re
from pathlib import Path

from weights.checks import read_json, redo, short_reason


class Tokenizer:
    """tokenizer.json through the tokenizers library, the chat format its special tokens name, and the ids
    that stop decoding. cfg (a ModelConfig) if given: the tokenizer must fit its vocab_size."""

    def __init__(self, path, cfg=None):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        if not (path / "tokenizer.json").exists():
            raise FileNotFoundError(f"no tokenizer.json in {path}: use a Hugging Face model folder that has one")
        fix = redo(path)
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
        if cfg is not None and vocab and max(vocab.values()) >= cfg.vocab_size:  # two files, one model: they agree
            raise ValueError(f"{path / 'tokenizer.json'} makes token ids up to {max(vocab.values())} but "
                             f"{path / 'config.json'} says vocab_size {cfg.vocab_size}: the two files come from "
                             f"different models; use the tokenizer.json that came with the weights ({fix})")
        if "<|im_start|>" in vocab:
            self.format = "chatml"  # SmolLM2, Qwen
            # a template that opens with a fixed system message (SmolLM2, Qwen2.5) uses it when
            # the user gives none; we read that literal text out of the template (its newline is
            # a real one in HF's tokenizer_config.json, or a jinja "\n" escape in hand-written ones)
            m = re.search(r"<\|im_start\|>system(?:\n|\\n)([^'\"{}]+?)<\|im_end\|>", template)
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

    def encode(self, text):
        return self.tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.tk.decode(list(ids), skip_special_tokens=False)

    def chat(self, user, system=None):
        """The prompt text for one user turn, ready for the assistant's answer."""
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
        if self.format == "chatml":
            return f"<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        if self.format == "llama3":
            h = lambda role: f"<|start_header_id|>{role}<|end_header_id|>\n\n"
            return "<|eot_id|>" + h("user") + user + "<|eot_id|>" + h("assistant")
        raise ValueError("this tokenizer has no chat format we know (ChatML or Llama-3): a conversation needs one")


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
