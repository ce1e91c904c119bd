"""The checks on checkpoint and adapter files: config.json values, tensor names and shapes, adapter .json keys.
Each refusal is a ValueError (or FileNotFoundError) that names the file, the key or tensor, and the fix.

model.py and lookaheadkv.py call these in one line where they read a file, so that the reading path shows
what is read and this file shows what is refused. It imports nothing of the project: it is handed the
config, the raw JSON dict or the tensors it checks. It lives in support/, beside the path: weights/ holds the
weights and their preparation, and nothing the path imports.
"""

import json
import math
import re
from pathlib import Path

import torch

# -----------------------------------------------------------------------------
# --- model checkpoints
# config.json (ModelConfig.from_hf_config calls check_config) and the *.safetensors files (load_model calls
# open_checkpoint, check_headers, check_tensor_names, read_tensor, check_shape, check_finite, check_tied_head).

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
# The largest size (vocab, hidden, layers, heads, ...) config.json may state: a 32-bit signed index's reach
# (many CUDA kernels index with int32, the tokenizers library's ids are 32-bit). The largest dimension of any real
# model, a vocabulary, is ~2**18: past the limit it is a typo such as vocab_size 1e11. Within it, load_model
# still checks every size against the tensors' shapes before it builds anything.
SIZE_LIMIT = 2**31 - 1
# Positions reach RoPE as float32 (as in HF), which holds every whole number only up to 2**24: past it,
# neighbouring positions get the same rotation, so no context can be longer.
POSITION_LIMIT = 2**24
# rms_norm_eps is added to the mean square of activations of order 1 before the rsqrt: real models use
# 1e-6 .. 1e-5; near 1 it swamps the mean square and every norm's output shrinks towards 0 (issue 53:
# 1e30 answered nothing, with exit 0). 1e-2 leaves a wide margin above any real value.
EPS_LIMIT = 1e-2
THETA_FLOOR = 100  # the least rope_theta taken (check_rope)


JSON_LIMIT = 32 * 2**20  # bytes of a config or metadata file: the largest tokenizer_config.json is a few MB


def read_json(file, fix):
    """A JSON object from `file`; ValueError naming the file and `fix` (what to do) if it is not one. Its kind and
    size are checked first (a handed folder's file: a named pipe blocked the read, a link to /dev/zero or a huge
    file filled the memory); a missing file is FileNotFoundError, as before."""
    import stat

    st = Path(file).stat()
    if not stat.S_ISREG(st.st_mode) or st.st_size > JSON_LIMIT:
        what = f"{st.st_size} bytes, more than the {JSON_LIMIT} a JSON config can be" if stat.S_ISREG(st.st_mode) \
            else "not a regular file (a named pipe or a device)"
        raise ValueError(f"{file} is {what}: {fix}")
    try:
        d = json.loads(Path(file).read_bytes())
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError both are
        raise ValueError(f"{file} is not valid JSON ({short_reason(e)}): {fix}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{file} holds a JSON {type(d).__name__}, not an object: {fix}")
    return d


def short_reason(e):
    return " ".join(str(e).split())[:200] or type(e).__name__


PREPARED = ".prepared"  # weights/prepare.py's marker: the GGUF's sha256, then the folder and the files it wrote


def redo(path, damaged=True):
    """What to do about a broken file in the model folder `path`. Deleting the folder is advised only where a
    file is damaged in a folder weights/prepare.py made (its marker) as it made it: a folder without the marker,
    a copy of a prepared one, or one whose files changed since is the user's, and the fix names what is wrong
    with it without deleting anything. damaged=False: the files are whole but do not agree (a tokenizer of
    another model): someone put them there, so deleting is never the fix."""
    made = prepared_record(path)
    if made is None:
        return "re-download the checkpoint"
    fresh = "or make a fresh copy with python weights/prepare.py --out NEW_FOLDER"
    changed = changes_since_prepared(path, made)
    if changed:
        return f"{path} is not as weights/prepare.py made it ({changed}): put back the original files, {fresh}"
    if not damaged:
        return f"put back the files that came with these weights, {fresh}"
    return f"delete the folder {path} and rerun python weights/prepare.py --out {path}"


def prepared_record(path):
    """What weights/prepare.py's marker in `path` records: None without one; {} for a marker of before
    2026-12-06 (the GGUF's sha256 alone); else {"folder": where it wrote, "files": {name: [size, sha256 or
    None]}}."""
    marker = Path(path) / PREPARED
    if not marker.is_file():
        return None
    lines = marker.read_text(errors="replace").splitlines()[1:]
    try:
        return json.loads(lines[0]) if lines else {}
    except ValueError:
        return {"folder": None, "files": {}}  # a marker we cannot read: nothing is known to be ours


def changes_since_prepared(path, made):
    """How the folder differs from what prepare.py recorded writing there (its place, each file's size and the
    small files' sha256), in words; "" if it does not. Cheap: the weights are compared by size alone."""
    if not made:
        return ""
    if made.get("folder") != str(Path(path).resolve()):
        return f"it is a copy of {made.get('folder')}"
    changed = []
    for name, (size, digest) in made.get("files", {}).items():
        f = Path(path) / name
        if not f.is_file():
            changed.append(f"{name} is missing")
        elif f.stat().st_size != size or (digest and file_sha256(f) != digest):
            changed.append(f"{name} changed")
    return ", ".join(changed)


def file_sha256(path):
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class ConfigCheck:
    """Checks typed fields of a config dict; a wrong one is a ValueError naming file, key, value and fix.
    A key that is absent or null (HF writes null for "not set") passes unless `required`: the reader's
    default applies."""

    def __init__(self, file, d, prefix=""):
        self.file, self.d, self.prefix = file, d, prefix

    def fail(self, key, want):
        value = json.dumps(self.d.get(key))[:60]
        raise ValueError(f"{self.file}: {self.prefix}{key} is {value}, it must be {want}: fix that key, "
                         f"or use the config.json that came with these weights")

    def unset(self, key, required):
        if required and key not in self.d:
            self.fail(key, "present")
        return not required and self.d.get(key) is None

    def whole(self, key, required=True, limit=SIZE_LIMIT):
        """A whole number from 1 to `limit`; JSON's 1e11 or 64.0 is a float, refused (no size is one)."""
        v = self.d.get(key)
        if not self.unset(key, required) and not (isinstance(v, int) and not isinstance(v, bool) and 0 < v <= limit):
            self.fail(key, f"a whole number from 1 to {limit} (digits only, no decimal point or exponent)")

    def positive(self, key, required=True, above=0, at_most=math.inf, why=""):
        """A finite number > `above` and <= `at_most`; `why` says where the bounds come from."""
        v = self.d.get(key)
        if not self.unset(key, required) and not (isinstance(v, (int, float)) and not isinstance(v, bool)
                                                  and math.isfinite(v) and above < v <= at_most):
            self.fail(key, f"a finite number > {above}" + (f" and <= {at_most}" if at_most < math.inf else "")
                      + (f" ({why})" if why else ""))

    def flag(self, key):
        if not self.unset(key, False) and not isinstance(self.d[key], bool):
            self.fail(key, "true or false")


def check_config(file):
    """config.json as a dict, every field ModelConfig.from_hf_config reads checked (type and range), in the
    order it reads them; null values dropped (HF writes null for "not set": the reader's default applies)."""
    # a model folder's config is config.json; any other name is a config of the user's own (bench's --random-init),
    # with no checkpoint to download again
    fix = redo(file.parent) if file.name == "config.json" else "fix the file (a Hugging Face config.json's keys)"
    check = ConfigCheck(file, read_json(file, fix))
    model_type = check_family(check)
    check_sizes(check)
    check_rope(check)
    check_eos(check)
    if model_type != "mistral":
        check.flag("use_sliding_window")  # Qwen's switch for its window; Mistral v0.1 always has one
    if model_type == "mistral" or check.d.get("use_sliding_window"):
        check.whole("sliding_window", required=False)
    check.positive("rms_norm_eps", required=False, at_most=EPS_LIMIT,
                   why="it is added to a mean square of order 1; real models use 1e-6 .. 1e-5")
    check.whole("max_position_embeddings", required=False, limit=POSITION_LIMIT)
    check.flag("tie_word_embeddings")
    check.flag("attention_bias")
    return {k: v for k, v in check.d.items() if v is not None}


def check_family(check):
    """model_type, and the MLP activation every supported family shares (any other would compute silently wrong)."""
    model_type = check.d.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} in {check.file} is not supported; "
                         f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if check.d.get("hidden_act") not in (None, "silu", "swish"):  # transformers: two names for one function
        check.fail("hidden_act", "\"silu\", the SwiGLU activation of every family this file implements")
    return model_type


def check_sizes(check):
    """The dimensions: vocab, hidden, MLP, layers, query heads, key/value heads and the head size."""
    names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in names if k not in check.d]
    if missing:
        raise ValueError(f"{check.file} lacks {', '.join(missing)}: not a complete Hugging Face model config")
    for k in names:
        check.whole(k)
    hidden, heads = check.d["hidden_size"], check.d["num_attention_heads"]
    check.whole("num_key_value_heads", required=False)
    if heads % (check.d.get("num_key_value_heads") or heads):
        check.fail("num_key_value_heads", f"a divisor of num_attention_heads ({heads}; each key/value "
                   f"head serves a whole group of query heads)")
    # head_dim if config.json says it (Qwen3, newer Mistral), else hidden // heads; even, as RoPE needs
    if check.d.get("head_dim") is not None:
        check.whole("head_dim")
        if check.d["head_dim"] % 2:
            check.fail("head_dim", "an even number (RoPE rotates pairs of channels)")
    elif hidden % heads:
        check.fail("num_attention_heads", f"a divisor of hidden_size ({hidden}) when config.json has no head_dim")
    elif hidden // heads % 2:
        check.fail("num_attention_heads", f"such that hidden_size / num_attention_heads (the head size, "
                   f"{hidden // heads}) is even (RoPE rotates pairs of channels)")


def check_rope(check):
    """rope_theta and rope_scaling (llama3 only), or transformers >= 4.56's rope_parameters (theta included)."""
    d = check.d
    rope_key = "rope_parameters" if d.get("rope_parameters") not in (None, {}) else "rope_scaling"
    rope = d.get(rope_key)
    if rope is None:
        rope = {}
    elif not isinstance(rope, dict):
        check.fail(rope_key, "an object such as {\"rope_type\": \"llama3\", \"factor\": 8.0, ...} or null")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} in {check.file} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    rope_check = ConfigCheck(check.file, rope, prefix=rope_key + ".")
    # RoPE's wavelengths 2 pi theta^(2i / head_dim) grow along the channels up to 2 pi theta: at theta <= 1 they do
    # not grow, and at a small theta (1.5 answered "----") every position past a few hundred tokens looks like a
    # nearer one. Real models use 1e4 .. 1e6; THETA_FLOOR leaves a wide margin below them
    why = (f"its wavelengths reach 2 pi theta tokens, too short below {THETA_FLOOR:g} for positions to differ; "
           "real models use 1e4 .. 1e6")
    if "rope_theta" in rope:
        rope_check.positive("rope_theta", above=THETA_FLOOR, why=why)
    else:
        check.positive("rope_theta", required=False, above=THETA_FLOOR, why=why)
    if rope_type == "llama3":
        for k in ("factor", "low_freq_factor", "high_freq_factor"):
            rope_check.positive(k)
        rope_check.whole("original_max_position_embeddings")
        if not rope["high_freq_factor"] > rope["low_freq_factor"]:
            rope_check.fail("high_freq_factor", f"greater than low_freq_factor ({rope['low_freq_factor']})")


def check_eos(check):
    """eos_token_id: one id, a list or null (HF writes each); each one a token the model can produce."""
    eos = check.d.get("eos_token_id")
    eos = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in eos):
        check.fail("eos_token_id", "a token id (a whole number >= 0), a list of them, or null")
    vocab_size = check.d["vocab_size"]
    if any(e >= vocab_size for e in eos):  # the LM head could never produce it: decoding would never stop on it
        check.fail("eos_token_id", f"below vocab_size ({vocab_size})")


def check_folder(path):
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json there; pass a Hugging Face folder (config.json, "
                                f"*.safetensors, tokenizer.json)")


def open_checkpoint(path):
    """The checkpoint's files opened, [(file name, safe_open)], and tensor name -> file name. Its files are
    model.safetensors, or the shards model.safetensors.index.json names: each must be there and readable."""
    from safetensors import safe_open

    fix = redo(path)
    files, weight_map = weight_files(path, fix)
    opened = []
    for fname in files:
        if not (path / fname).exists():
            raise FileNotFoundError(f"{path / fname} is missing: {fix}")
        try:
            opened.append((fname, safe_open(path / fname, framework="pt", device="cpu")))
        except Exception as e:
            raise ValueError(f"{path / fname} is not a readable safetensors file ({short_reason(e)}): {fix}") from None
    return opened, stored_tensors(path, opened, weight_map, fix)


def weight_files(path, fix):
    """model.safetensors, or the shards model.safetensors.index.json names, with that index's weight_map
    (tensor name -> file; {} for a single file)."""
    index = path / "model.safetensors.index.json"
    if not index.exists():
        return ["model.safetensors"], {}
    weight_map = read_json(index, fix).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ValueError(f"{index} has no \"weight_map\" object (tensor name -> file): {fix}")
    return sorted(set(weight_map.values())), weight_map


def stored_tensors(path, opened, weight_map, fix):
    """tensor name -> the file that holds it. Refused: a tensor in two files (which one would load?), and
    shards that disagree with the index about where a tensor is (shards of two downloads, or a stale
    index: the model would be part one checkpoint, part another)."""
    stored = {}
    for fname, f in opened:
        for name in f.keys():
            if name in stored:
                raise ValueError(f"tensor {name} is stored twice, in {path / stored[name]} and {path / fname}: {fix}")
            stored[name] = fname
    for name in sorted(set(weight_map) | set(stored)) if weight_map else []:
        if weight_map.get(name) != stored.get(name):
            where = f"{stored[name]} holds it" if name in stored else "no file holds it"
            raise ValueError(f"{path / 'model.safetensors.index.json'} puts tensor {name} in "
                             f"{weight_map.get(name, 'no file')}, but {where}: the index and the shards come from "
                             f"different downloads; {fix}")
    # buffers some HF checkpoints carry and transformers ignores: RoPE's inv_freq is recomputed from config.json
    return {name: fname for name, fname in stored.items() if not name.endswith("rotary_emb.inv_freq")}


def check_headers(path, cfg, opened, stored):
    """config.json against the tensors' headers (no tensor read), before anything is built: a layer count or a
    size the weights do not have would build for hours or allocate terabytes before the names are compared."""
    has = {int(m.group(1)) for n in stored if (m := re.match(r"model\.layers\.(\d+)\.", n))}
    if has and len(has) != cfg.num_hidden_layers:
        raise ValueError(f"{path / 'config.json'} says num_hidden_layers {cfg.num_hidden_layers} but the checkpoint "
                         f"has {len(has)} layers: is {path / 'config.json'} from another model? Use the config.json "
                         f"that came with these weights")
    # each stored tensor's shape against the shape config.json implies: vocab, hidden, MLP, head and key/value
    # head sizes all show in them. Names config.json does not imply are left to check_tensor_names
    shapes = implied_shapes(cfg)
    for fname, f in opened:
        for name in f.keys():
            want = shapes.get(re.sub(r"^model\.layers\.\d+\.", "", name))
            if want is None:
                continue
            try:
                shape = tuple(f.get_slice(name).get_shape())
            except Exception as e:
                raise ValueError(f"{path / fname}: tensor {name} cannot be read ({short_reason(e)}): "
                                 f"{redo(path)}") from None
            check_shape(path / fname, name, shape, want, cfg)


def implied_shapes(cfg):
    """The shape config.json implies for each tensor, by name; a layer's names without their
    "model.layers.<i>." prefix. What model.Transformer(cfg) builds, stated without building it
    (tests/test_edges_model.py checks the two agree)."""
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, H), "lm_head.weight": (cfg.vocab_size, H),
              "model.norm.weight": (H,), "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
              "self_attn.q_proj.weight": (q, H), "self_attn.k_proj.weight": (kv, H),
              "self_attn.v_proj.weight": (kv, H), "self_attn.o_proj.weight": (H, q),
              "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I)}
    if cfg.attention_bias:
        shapes.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    if cfg.qk_norm:
        shapes.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    return shapes


def parameter_count(cfg):
    """How many numbers model.Transformer(cfg) holds, from implied_shapes alone (nothing built: a config of a
    million layers is counted in a microsecond, where building it on the meta device took minutes): the
    embedding, the head unless tied, the final norm, and num_hidden_layers times a layer's tensors."""
    shapes, n = implied_shapes(cfg), lambda shape: math.prod(shape)
    top = ("model.embed_tokens.weight", "model.norm.weight") + (() if cfg.tie_word_embeddings else ("lm_head.weight",))
    layer = sum(n(shape) for name, shape in shapes.items() if not name.startswith(("model.", "lm_head.")))
    return sum(n(shapes[name]) for name in top) + cfg.num_hidden_layers * layer


def check_shape(file, name, shape, want, cfg):
    """Tensor `name` of `file` has `shape`; the model wants `want`, as config.json's sizes imply."""
    if tuple(shape) != tuple(want):
        raise ValueError(f"{file}: tensor {name} has shape {tuple(shape)}, but {file.parent / 'config.json'} "
                         f"({shape_fields(name, cfg)}) implies {tuple(want)}: the checkpoint does not match "
                         f"its config; use the config.json that came with these weights")


def shape_fields(name, cfg):
    """The config.json fields a tensor's shape follows from, e.g. "vocab_size 128, hidden_size 64"."""
    kv = ("num_key_value_heads", "head_dim", "hidden_size")
    fields = dict(embed_tokens=("vocab_size", "hidden_size"), lm_head=("vocab_size", "hidden_size"),
                  q_proj=("num_attention_heads", "head_dim", "hidden_size"), k_proj=kv, v_proj=kv,
                  o_proj=("hidden_size", "num_attention_heads", "head_dim"), q_norm=("head_dim",),
                  k_norm=("head_dim",), gate_proj=("intermediate_size", "hidden_size"),
                  up_proj=("intermediate_size", "hidden_size"), down_proj=("hidden_size", "intermediate_size"))
    return ", ".join(f"{k} {getattr(cfg, k)}" for k in fields.get(name.split(".")[-2], ("hidden_size",)))


def check_tensor_names(path, cfg, stored, params):
    """Every parameter stored, nothing else stored. A tied checkpoint may hold its head too (check_tied_head)."""
    names = set(stored) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    missing, unexpected = sorted(set(params) - names), sorted(names - set(params))
    if missing or unexpected:
        raise ValueError(mismatch_message(path, cfg, missing, unexpected, stored, redo(path, damaged=False)))


def mismatch_message(path, cfg, missing, unexpected, stored, fix):
    """Why the checkpoint's tensor names differ from those config.json implies. Where another model_type
    would explain the difference, blame config.json, not the download (another layer count was refused before
    the model was built: check_headers). A head missing from an untied checkpoint is refused too: its
    embedding would stand in for a head it was never trained as."""
    file = path / "config.json"
    bias = lambda names: [n for n in names if re.search(r"self_attn\.[qkv]_proj\.bias$", n)]
    qk_norm = lambda names: [n for n in names if re.search(r"self_attn\.[qk]_norm\.weight$", n)]
    other = f": is {file} from another model? Use the config.json that came with these weights"
    if bias(missing) and len(bias(missing)) == 3 * cfg.num_hidden_layers:
        return (f"{file} says model_type {cfg.model_type} with q/k/v biases (attention_bias) but the checkpoint "
                f"has none{other}")
    if bias(unexpected):
        return (f"the checkpoint has q/k/v biases (e.g. {bias(unexpected)[0]}, as in Qwen2) but {file} says "
                f"model_type {cfg.model_type} without attention_bias{other}")
    if qk_norm(missing) and len(qk_norm(missing)) == 2 * cfg.num_hidden_layers:
        return f"{file} says model_type {cfg.model_type} (q/k norms) but the checkpoint has none{other}"
    if qk_norm(unexpected):
        return (f"the checkpoint has q/k norms (e.g. {qk_norm(unexpected)[0]}, as in Qwen3) but {file} says "
                f"model_type {cfg.model_type}{other}")
    if missing == ["lm_head.weight"]:
        return (f"{file} says tie_word_embeddings false (a head of its own) but the checkpoint has no lm_head.weight: "
                f"set it to true if this model's head is its embedding, else {fix}")
    if unexpected:
        return (f"unexpected tensor {unexpected[0]} in {stored[unexpected[0]]}"
                f"{f' (and {len(unexpected) - 1} more)' if len(unexpected) > 1 else ''}: "
                f"not a {cfg.model_type} checkpoint we support")
    return f"checkpoint {path} lacks {len(missing)} tensors, e.g. {missing[0]}: {fix}"


def read_tensor(path, fname, f, name):
    """Tensor `name` of f, the open file `fname` of the model folder `path`; refused unless floating point."""
    try:
        t = f.get_tensor(name)
    except Exception as e:
        raise ValueError(f"{path / fname}: tensor {name} cannot be read ({short_reason(e)}): {redo(path)}") from None
    if not t.is_floating_point():  # an int8 or bool tensor cast to float would load as garbage, silently
        raise ValueError(f"{path / fname}: tensor {name} is stored as {t.dtype}, not a floating type: "
                         f"a quantised or damaged checkpoint we cannot load; {redo(path)}")
    return t


def check_finite(path, stored, params, sums, dtype):
    """A NaN or inf in any weight is refused, naming the tensor: in the file (damaged), or made by the cast to
    dtype. sums: tensor name -> the float32 sum of its copy, not finite if any value is not."""
    from safetensors import safe_open

    finite = torch.isfinite(torch.stack(list(sums.values()))).tolist()  # one device sync, not one per tensor
    for name, ok in zip(sums, finite):
        if ok or torch.isfinite(params[name]).all():  # a sum can overflow on finite values
            continue
        what, file = ("NaN" if torch.isnan(params[name]).any() else "inf"), path / stored[name]
        with safe_open(file, framework="pt", device="cpu") as f:
            if torch.isfinite(f.get_tensor(name)).all():  # finite in the file: too large for `dtype`
                raise ValueError(f"tensor {name} in {file} holds values too large for {dtype} ({what} after "
                                 f"conversion): load the model in float32 or bfloat16")
        raise ValueError(f"tensor {name} in {file} holds {what}: the file is damaged; {redo(path)}")


def check_tied_head(path, stored, embedding):
    """Some tied checkpoints store the head too: it must be the embedding, or config.json's
    tie_word_embeddings (true, or absent: true for all but Mistral) contradicts the weights."""
    from safetensors import safe_open

    if "lm_head.weight" not in stored:
        return
    file = path / stored["lm_head.weight"]
    with safe_open(file, framework="pt", device="cpu") as f:
        head = f.get_tensor("lm_head.weight")
    if head.shape != embedding.shape or not torch.equal(head.to(embedding.device, embedding.dtype), embedding):
        raise ValueError(f"{path / 'config.json'} says tie_word_embeddings true (the head is the embedding), but "
                         f"{file} holds an lm_head.weight that differs from model.embed_tokens.weight: set "
                         f"tie_word_embeddings to false in config.json, or {redo(path)}")



# -----------------------------------------------------------------------------
# --- adapter files

# the .json keys that shape a LookaheadModule, and their types (every other key is kept unread: LookaheadModule.load)
ADAPTER_KEYS = dict(base_model=str, base_fingerprint=str, n_tokens=int, rank=int, alpha=(int, float), targets=list)
SCALE_LIMIT = 1e6  # adapter_scale_problem: far past a trained adapter (~10), far below float overflow


def read_adapter(path):
    """(its .json's dict, its tensors) of adapter `path` (a .safetensors file, its .json beside it), or the error
    naming the file."""
    from safetensors.torch import load_file

    path = Path(path)
    meta_file = path.with_suffix(".json")
    if path.suffix != ".safetensors" or not path.is_file():
        raise FileNotFoundError(f"adapter {path} (a .safetensors file and its .json) not found: "
                                "train one with python train.py")
    if not meta_file.is_file():  # the tensors are there: name what is missing beside them, as it is
        what = "is a folder" if meta_file.is_dir() else "is not a file" if meta_file.exists() else "is missing"
        raise FileNotFoundError(f"adapter {path}: its metadata {meta_file} {what}: put the .json that train.py "
                                "wrote beside it, or retrain the adapter")
    meta = read_json(meta_file, "retrain the adapter")
    try:
        return meta, load_file(str(path))
    except Exception as e:
        raise ValueError(f"adapter {path} is not a readable safetensors file ({str(e).splitlines()[0]}): "
                         "retrain it") from None


def check_adapter_metadata(meta, meta_file, cfg, n_bytes, targets, dims):
    """An adapter's .json keys, before any tensor is made: their types, the base model, and M, rank and targets
    (of `targets`, the LoRA targets; `dims`, their (in, out)) against the size of the tensors file (n_bytes),
    so that "rank": 10**12 is one line, not a module allocated (or an overflow) first."""
    for key, kind in ADAPTER_KEYS.items():
        value = meta.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            found = "missing" if key not in meta else json.dumps(value)[:40]
            what = {int: "a whole number", str: "a string", list: "a list"}.get(kind, "a number")
            raise ValueError(f"adapter metadata {meta_file}: {key!r} is {found}, not {what}: retrain the adapter")
        if isinstance(value, (int, float)) and not (math.isfinite(value) and value > 0):  # "alpha": NaN parses
            raise ValueError(f"adapter metadata {meta_file}: {key!r} is {value}, not a finite number > 0: "
                             "retrain the adapter")
    check_adapter_record(meta, meta_file)
    if meta["base_fingerprint"] != cfg.fingerprint():
        raise ValueError(f"adapter {meta_file.with_suffix('.safetensors').name} was trained for "
                         f"{meta['base_model']!r} (fingerprint {meta['base_fingerprint']}), not for this model "
                         f"{cfg.name!r} ({cfg.fingerprint()}): train one for it with python train.py")
    bad = [t for t in meta["targets"] if t not in targets]
    if bad:  # named here, with the file; the module's constructor would name neither
        raise ValueError(f"adapter metadata {meta_file}: 'targets' holds {json.dumps(bad)[:60]}, not LoRA targets "
                         f"({', '.join(targets)}): retrain the adapter")
    numbers = meta["n_tokens"] * cfg.hidden_size + cfg.num_hidden_layers * meta["rank"] * sum(
        sum(dims[t]) for t in set(meta["targets"]))
    if numbers > n_bytes:  # safetensors spends at least a byte on each
        raise ValueError(f"adapter metadata {meta_file}: n_tokens {meta['n_tokens']}, rank {meta['rank']} and its "
                         f"targets make {numbers} numbers, more than its tensors file of {n_bytes} bytes holds: "
                         "retrain the adapter")


def check_adapter_record(meta, meta_file):
    """The held-out check an adapter's .json records (train.py's last validation, "heldout": {"step", "kl"}): a
    number there that is not finite (NaN or inf) is a run that diverged, whose tensors may well be finite (the M
    rows then select at random), so the adapter is refused in one line naming the file. No record (None, or an
    adapter from before it was kept) is no evidence either way: nothing to refuse. Every loader calls it:
    LookaheadModule.load through check_adapter_metadata, and the press on the export's lookahead_config.json."""
    heldout = meta.get("heldout")
    for key, value in (heldout.items() if isinstance(heldout, dict) else ()):
        if isinstance(value, float) and not math.isfinite(value):
            step = f" at step {heldout['step']}" if isinstance(heldout.get("step"), int) else ""
            raise ValueError(f"adapter metadata {meta_file}: its training ended with a held-out {key} of {value}"
                             f"{step} (not finite: the run diverged), so this adapter cannot select: retrain it "
                             "with a lower --lr (the recipes use 1e-3)")


def check_adapter_tensors(path, tensors, want, alpha, rank):
    """The tensors read from adapter `path` against `want` (the state_dict its .json implies): every one there,
    of a floating type, of its shape, finite, none beside them, and not too large to use (adapter_scale_problem)."""
    for name, t in want.items():
        if name not in tensors:
            raise ValueError(f"adapter {path} lacks tensor {name!r} that its .json implies: retrain it")
        if not tensors[name].is_floating_point():  # an int or bool tensor would load as garbage, silently
            raise ValueError(f"adapter {path}: tensor {name!r} is stored as {tensors[name].dtype}, not a floating "
                             "type: retrain it")
        if tensors[name].shape != t.shape:
            raise ValueError(f"adapter {path}: tensor {name!r} has shape {tuple(tensors[name].shape)}, its .json "
                             f"implies {tuple(t.shape)}: retrain it")
        if not torch.isfinite(tensors[name]).all():
            raise ValueError(f"adapter {path}: tensor {name!r} holds NaN or inf: retrain it")
    extra = sorted(set(tensors) - set(want))
    if extra:
        raise ValueError(f"adapter {path} has tensor {extra[0]!r} that its .json does not describe: retrain it")
    too_large = adapter_scale_problem(tensors, want, alpha, rank)
    if too_large:
        raise ValueError(f"adapter {path}: {too_large}: the M rows' attention would overflow to NaN and select "
                         f"at random; retrain it")


def adapter_scale_problem(tensors, names, alpha, rank):
    """What makes an adapter's numbers too large to use (None if nothing): finite, but far past any trained
    adapter's. Bounds, not forwards: the embeddings' largest entry, and per LoRA ("lora.{layer}.{target}_A"
    and its _B) the largest gain (alpha / rank) |B| |A| (Frobenius norms) it can put on a row."""
    largest = tensors["embeddings"].float().abs().max().item()
    if not largest <= SCALE_LIMIT:
        return f"its embeddings reach {largest:.3g}, past {SCALE_LIMIT:g} (a trained adapter's stay below 1)"
    for name in [n for n in names if n.endswith("_A")]:  # in the module's order: layer by layer, target by target
        _, layer, target = name[:-2].split(".")
        gain = alpha / rank * (tensors[name].float().norm() * tensors[name[:-1] + "B"].float().norm()).item()
        if not gain <= SCALE_LIMIT:
            return (f"its LoRA on layer {layer}'s {target} has gain (alpha / rank) |B| |A| = {gain:.3g}, past "
                    f"{SCALE_LIMIT:g} (a trained adapter's is about 10; is \"alpha\" {alpha} right?)")
    return None


if __name__ == "__main__":  # a library module: say how it runs, not exit 0 having done nothing
    raise SystemExit("error: support/checks.py is not a script: the loaders call it; python weights/prepare.py "
                     "prepares the default model")
