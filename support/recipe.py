"""
train.py's bookkeeping, kept out of its reading path: the checks on a recipe (TrainConfig) that stop a bad
value before the model loads, the checkpoint that --resume continues (and the settings it must agree on),
the adapter's backups and .json metadata, and the memory warning. research/train_lab.py's extra settings
(--data, --train-rows, --init, --loss-weights, budget, window) are read here too when its config has them.
Every check raises ValueError with one line: what is wrong, and what to do.
"""
import argparse
import dataclasses
import errno
import json
import math
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
import types
import typing
from pathlib import Path

import torch
from tqdm import tqdm

from eviction import EvictConfig
from methods import load_adapter, make_scorer, parse_rule, parse_targets
from support import cli, data, files
from support.metrics import answer_kls
from support.data import sample_bytes, sample_ok, sample_path, unreadable_sample
from lookaheadkv import LookaheadModule
from model import ModelConfig, default_dtype
from support import checks
from support.checks import read_json

STORE_DTYPES = ("bfloat16", "float16", "float32", "none")
BUDGET_SAMPLES = 32  # --stage budgets (research/train_lab.py) measures on this many training samples
MAX_EPOCHS = 1000  # passes over the training rows a recipe may ask for: a bound on the steps it plans
CHAT_ROOM = 64  # tokens a chat template adds around a prompt (SmolLM2's, with its system message: 30)

# -----------------------------------------------------------------------------
# The recipe: a JSON file of the config's fields, and the values that name a choice


def read_config(path, Config):
    """A recipe file: a JSON object of Config's fields, each of its field's type (ValueError naming the
    file and the key otherwise)."""
    path = cli.input_file("--config", path)
    try:
        values = read_json(path, "write a JSON object of TrainConfig fields (research/configs/train-cpu.json is one)")
    except ValueError as e:
        raise ValueError(f"--config {e}") from None
    fields = {f.name: f.type for f in dataclasses.fields(Config)}
    for key, value in values.items():
        if key not in fields:
            raise ValueError(f"--config {path}: unknown key {key!r}; the keys are TrainConfig's fields: "
                             f"{', '.join(fields)}")
        kinds = fields[key].__args__ if isinstance(fields[key], types.UnionType) else (fields[key],)
        ok = any(value is None if k is type(None) else
                 (isinstance(value, bool) if k is bool else
                  isinstance(value, (int, float) if k is float else k) and not isinstance(value, bool))
                 for k in kinds)
        if not ok:
            want = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise ValueError(f"--config {path}: {key!r} must be {want}, got {json.dumps(value)}")
    return values


def flag_of(key, parser):
    """How a config field is given: its flag (--micro-batch) if it has one, else its --config key (warmup)."""
    flag = "--" + key.replace("_", "-")
    return flag if flag in parser._option_string_actions else key


# -----------------------------------------------------------------------------
# Every check that needs no model weights, so a bad value stops at once, not after an hour of answering


def check(cfg, parser, read_adapter=None):
    """Every setting and file of a run, before the model loads: raises ValueError (one line: what is
    wrong and what to do), changes nothing it is handed, and returns the identity of the base model's
    weights (files.weights_identity, None for --stage data), which the checkpoint and the adapter record.
    cfg: as train.resolved makes it (device and dtype named). read_adapter(cfg, model_cfg): the adapter
    the run starts from or measures (research/train_lab.py's --init), checked; None: none."""
    check_choices(cfg, parser._option_string_actions["--stage"].choices)
    check_given(cfg)
    cli.check_device(cfg.device)
    cli.check_model_dir(cfg.model)
    check_numbers(cfg)
    parse_targets(cfg.targets)
    if cfg.rule is not None:  # a selection the adapter's .json recommends (beyond the paper); None: none
        parse_rule(cfg.rule)
    out, dest = output_paths(cfg)
    src = data_folder(cfg, out)
    folder = cli.resolve_model(cfg.model)
    model_cfg = ModelConfig.from_hf_config(folder)
    if cfg.rule is not None:
        check_rule(cfg.rule, model_cfg, parse_rule)
    rows = read_rows(src, model_cfg, partial_ok=cfg.stage in ("data", "all"))
    check_data_dtype(cfg, src, rows)
    check_samples(cfg, src, rows)
    adapter = read_adapter(cfg, model_cfg) if read_adapter else None
    check_fit(cfg, model_cfg, src, rows, adapter)
    check_disk(cfg, model_cfg, rows)
    check_free_for_training(cfg, model_cfg, out, dest, adapter)
    weights_id = None
    if cfg.stage in ("train", "all"):  # what the checkpoint and the adapter record, a resume must match
        weights_id = files.weights_identity(folder, cache_dir=out)
    checkpoint_to_resume(cfg, out, model_cfg, adapter, parser, weights_id)
    if weights_id:  # every check passed: kept beside the run for the next one
        files.keep_identity(folder, out, weights_id)
    return weights_id


def data_folder(cfg, out):
    """Where the samples are read: --data (another run's data stage; --stage train and budgets), else OUT.
    --train-rows draws from them, so it too belongs to training (--stage train and all)."""
    src, train_rows = getattr(cfg, "data", None), getattr(cfg, "train_rows", None)
    if train_rows is not None:
        if cfg.stage not in ("train", "all"):
            raise ValueError(f"--train-rows is read when training: it has no use with --stage {cfg.stage}")
        cli.at_least("--train-rows", train_rows, 1)
    if src is None:
        return out
    if cfg.stage not in ("train", "budgets"):
        raise ValueError(f"--data is read by --stage train and budgets (--stage {cfg.stage} makes OUT's own data): "
                         "add --stage train, or drop --data")
    if not (Path(src) / "data.jsonl").is_file():
        raise ValueError(f"--data {src}: no data.jsonl there: pass the --out folder of a data stage "
                         "(python train.py --stage data --out DIR)")
    return Path(src)


def check_values(cfg, stages):
    """The checks of the values alone (no file but the recipe, no model): a flag's earlier value when it is given
    twice (RecipeParser.config) meets them as the last one does in check."""
    check_choices(cfg, stages)
    check_given(cfg)
    check_numbers(cfg)


def check_given(cfg):
    """A path or device given as "" is a slip, not the default: --init "" trained from scratch, --adapter-out ""
    wrote OUT/adapter.safetensors and --out "" the current folder, each without a word."""
    for flag in ("--model", "--out", "--adapter-out", "--init", "--device", "--loss-weights"):
        value = getattr(cfg, flag[2:].replace("-", "_"), None)
        if value is not None and not value.strip():
            raise ValueError(f"{flag} {value!r} is empty: give a value, or leave it out (in a --config file: drop "
                             f"the key) for the default")
    if not str(cfg.targets).replace(",", " ").strip():  # "" trained the embeddings alone, no LoRA, without a word
        raise ValueError(f"--targets {cfg.targets!r} names no target: write none for the embeddings alone (no LoRA), "
                         f"all (the default), or a comma list of {', '.join(LookaheadModule.TARGETS)}")


def check_choices(cfg, stages):
    """The settings that name one of a few choices (stages: the script's, its parser's --stage choices)."""
    for name, value, choices in (("--stage", cfg.stage, stages), ("store_dtype", cfg.store_dtype, STORE_DTYPES),
                                 ("--dtype", cfg.dtype, (None, "float32", "bfloat16"))):
        if value not in choices:
            raise ValueError(f"{name} {value!r}: choose from {', '.join(map(str, choices))}")


def check_numbers(cfg):
    """Every number in its range: counts, rates and shares, and the prompt lengths in order."""
    makes_data = cfg.stage in ("data", "all")
    lab = [(flag, getattr(cfg, key), lo) for flag, key, lo in (("--group", "group", 1), ("budget", "budget", 1),
                                                               ("window", "window", 0)) if hasattr(cfg, key)]
    for flag, value, lo in [("--n-train", cfg.n_train, 1 if makes_data else 0), ("--n-heldout", cfg.n_heldout, 0),
                            ("min_tokens", cfg.min_tokens, 1), ("--max-new-tokens", cfg.max_new_tokens, 1),
                            ("gen_batch", 1 if cfg.gen_batch is None else cfg.gen_batch, 1), ("n_tokens", cfg.n_tokens, 1),
                            ("rank", cfg.rank, 1), ("--batch", cfg.batch, 1), ("--micro-batch", cfg.micro_batch, 1),
                            ("--eval-every", cfg.eval_every, 1), ("--save-every", cfg.save_every, 1),
                            ("weight_decay", cfg.weight_decay, 0)] + lab:
        cli.at_least(flag, value, lo)
    minutes = [("--max-minutes", cfg.max_minutes)] if cfg.max_minutes is not None else []
    for flag, value in [("--lr", cfg.lr), ("alpha", cfg.alpha), ("--epochs", cfg.epochs), ("clip", cfg.clip),
                        ("store_gb", cfg.store_gb)] + minutes:
        cli.positive(flag, value)
    if cfg.epochs > MAX_EPOCHS:  # 1e308 (a handed --config) planned 10^307 steps before anything said so
        raise ValueError(f"--epochs {cfg.epochs:g}: at most {MAX_EPOCHS} passes over the training rows (the recipes "
                         "use 2-3)")
    shares = [("first_frac", cfg.first_frac)] if hasattr(cfg, "first_frac") else []
    for flag, value in [("warmup", cfg.warmup), ("long_frac", cfg.long_frac)] + shares + \
            ([("copy_frac", cfg.copy_frac)] if cfg.copy_frac is not None else []):
        cli.fraction(flag, value)
    if not cfg.min_tokens <= cfg.max_tokens <= cfg.long_max:
        raise ValueError(f"min_tokens {cfg.min_tokens}, --max-tokens {cfg.max_tokens}, long_max {cfg.long_max}: "
                         "need min <= max <= long_max")
    # a step is batch // micro_batch micro-batches, at least one: --batch 4 with the default micro-batch of 8 is
    # one micro-batch of 4 (train.resolved), --batch 10 would train on 8 samples a step: refused
    micro = min(cfg.micro_batch, cfg.batch)
    if cfg.batch % micro:
        step = micro * max(1, cfg.batch // micro)
        raise ValueError(f"--batch {cfg.batch} is not a whole number of micro-batches of {micro} "
                         f"(--micro-batch): each step would train on {step} samples; use --batch {step}, or a "
                         f"--micro-batch that divides {cfg.batch}")
    if cfg.lr > 1:  # an AdamW step moves each parameter by about lr: past 1 the embeddings leave any usable scale
        raise ValueError(f"--lr {cfg.lr:g}: an AdamW step moves each parameter by about lr, so the lookahead "
                         "embeddings would leave any usable scale; use at most 1 (the recipes use 1e-3)")
    if cfg.compare is not None:
        longest = max(cfg.max_tokens, cfg.long_max if cfg.long_frac > 0 else 0)
        if isinstance(cfg.compare, bool) or not 1 <= cfg.compare < longest:
            raise ValueError(f"compare {cfg.compare}: the held-out comparison's C must be from 1 to below the "
                             f"longest prompt ({longest} tokens: at C >= a prompt's length nothing is evicted and "
                             "every method's answer KL is 0); drop the key for no comparison")
    if not -2**63 <= cfg.seed < 2**63:  # torch.manual_seed's range; past it, an OverflowError that named no flag
        raise ValueError(f"--seed {cfg.seed}: must be a whole number from -2**63 to 2**63 - 1")


def check_fit(cfg, model_cfg, out, rows, adapter):
    """The module and the prompts fit the model, said before the data stage rather than after it (rank 10**6
    filled the memory when training began) or never (a prompt past the context runs on RoPE positions the model
    never saw): a LoRA rank at most its hidden size (a higher one adds nothing), every prompt with its answer
    and the M lookahead rows after it within its context. The recipe's longest prompt counts when this run
    makes prompts; the longest OUT/data.jsonl holds always. M and rank are --init's adapter's when there is one."""
    ctx, name = model_cfg.max_context, model_cfg.name
    ctx_words = cli.context_words(model_cfg)  # names a sliding_window that shortens it
    M = adapter.n_tokens if adapter is not None else cfg.n_tokens
    if adapter is None and cfg.rank > model_cfg.hidden_size:
        raise ValueError(f"rank {cfg.rank}: at most {name}'s hidden size {model_cfg.hidden_size} (a LoRA of higher "
                         f"rank adds nothing)")
    have = {split: sum(r.get("split") == split for r in rows) for split in ("train", "heldout")}
    if cfg.stage in ("data", "all") and (have["train"] < cfg.n_train or have["heldout"] < cfg.n_heldout):
        key, longest = ("long_max", cfg.long_max) if cfg.long_frac > 0 else ("--max-tokens", cfg.max_tokens)
        after, room = ("--max-new-tokens", cfg.max_new_tokens) if cfg.max_new_tokens >= M else ("n_tokens", M)
        if longest + CHAT_ROOM + room > ctx:
            raise ValueError(f"{key} {longest} + {CHAT_ROOM} (the chat template) + {after} {room} is "
                             f"{longest + CHAT_ROOM + room} tokens, past {name}'s context of {ctx_words}: lower {key} "
                             f"or {after}")
    longest = max((len(r["prompt_ids"]) for r in rows), default=0)
    if longest + M > ctx:
        raise ValueError(f"n_tokens {M}: {out / 'data.jsonl'}'s longest prompt ({longest} tokens) with the M "
                         f"lookahead rows after it is past {name}'s context of {ctx_words}: lower n_tokens")


def check_rule(rule, model_cfg, parse_rule):
    """The recipe's selection rule (the adapter's .json names it) as methods.parse_rule reads it for this model: a
    width within its context ("max:99999999999" passed the syntax check alone and then hung in the first held-out
    check, pooling over a window that size). Its vocabulary is not passed: a span shortlist past it is the whole
    vocabulary (extensions/span.shortlist clamps it), and the default span:8:1024 would refuse every small model."""
    try:
        parse_rule(rule, context=model_cfg.max_context)
    except ValueError as e:
        raise ValueError(f"rule {rule!r} (the recipe's selection rule): {e}") from None


def data_dtypes(src, rows):
    """[(dtype, what says so)]: the dtype the base model ran in when src's data was made, as its rows record it
    (build_dataset), and as the held-out ground truth kept there holds it (harness.heldout_ground_truth saves the
    cache in the model's dtype and loads it back as it is: a float32 one in a bfloat16 model failed at step 0).
    A folder made before the rows recorded it is known by the second alone; [] when neither is there."""
    found = [(d, f"its rows in {src / 'data.jsonl'}") for d in sorted({r["dtype"] for r in rows if "dtype" in r})]
    for path in sorted((Path(src) / "heldout").glob("*.pt"))[:1]:  # one file says: one model made them all
        try:
            kept = torch.load(path, map_location="cpu", mmap=True, weights_only=True)["k"][0].dtype
        except Exception:  # cut short by a kill: the held-out check makes it again (harness)
            continue
        found.append((str(kept).removeprefix("torch."), f"its held-out ground truth {path.parent}"))
    return found


def check_data_dtype(cfg, src, rows):
    """One data folder, one dtype: the answers and targets there are the base model's in the dtype it ran in, and
    its held-out ground truth is kept in that dtype; a run in another dtype (--dtype, or the device's default) is
    refused rather than mixing two models' data or failing at its first held-out check. --stage budgets reads the
    samples alone (train.get_batch casts their cache to the model's dtype): an adapter measured on another machine's data."""
    if cfg.stage == "budgets":
        return
    for made, where in data_dtypes(src, rows):
        if made != cfg.dtype:
            flag = "--data" if getattr(cfg, "data", None) else "--out"
            raise ValueError(f"--dtype {cfg.dtype}: {flag} {src} was made with the base model in {made} ({where}): "
                             f"run in its dtype (--dtype {made}), or make a data stage of your own in {cfg.dtype} "
                             f"(python train.py --stage data --dtype {cfg.dtype} --out NEW)")


def check_disk(cfg, model_cfg, rows):
    """build_dataset's store_gb check on the least the new rows can take, with S >= min_tokens: a training row keeps
    its target (L x H x S floats), a held-out row its ground truth in OUT/heldout (the float32 cache too, made by
    the held-out check): --n-train or --n-heldout 10**9 is refused now, not once their prompts have all been made."""
    if cfg.stage not in ("data", "all"):
        return
    have = {split: sum(r.get("split") == split for r in rows) for split in ("train", "heldout")}
    new_train, new_held = max(0, cfg.n_train - have["train"]), max(0, cfg.n_heldout - have["heldout"])
    least = (new_train * sample_bytes(model_cfg, cfg.min_tokens, None)
             + new_held * sample_bytes(model_cfg, cfg.min_tokens, torch.float32))
    if least > cfg.store_gb * 2**30:
        raise ValueError(f"--n-train {cfg.n_train}, --n-heldout {cfg.n_heldout}: the training samples and the held-out "
                         f"ground truth would take at least {size_text(least)} on disk, over store_gb "
                         f"{cfg.store_gb}: raise it in the --config file, or use fewer prompts")
    check_free(cfg, least, f"--n-train {cfg.n_train}, --n-heldout {cfg.n_heldout}: the training samples and the "
               "held-out ground truth would take at least")


def check_free(cfg, n_bytes, what, where=None, fix="use fewer or shorter prompts"):
    """store_gb is a cap, not the disk: the bytes a stage is about to write against the free space of the file
    system that holds `where` (OUT by default), found now, not after the stage."""
    where = Path(cfg.out) if where is None else Path(where)
    free = free_disk(where)
    if free is not None and n_bytes > free:
        raise ValueError(f"{what} {size_text(n_bytes)} on disk, and {where} has {size_text(free)} free: free some "
                         f"space, or {fix}")


def size_text(n_bytes):
    """A size in the unit that shows it: GiB down to a twentieth of one, then MiB, then KiB ("would take 0.0 GiB,
    has 0.0 GiB free" said nothing)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= scale / 20:
            return f"{n_bytes / scale:.1f} {unit}"
    return f"{int(n_bytes)} bytes"


def check_free_for_training(cfg, model_cfg, out, dest, adapter=None):
    """The training stage's own writes against the free disk, before the model loads: the adapter (float32, at
    dest's folder) and OUT/ckpt.pt (the module and AdamW's two moments: three times as much), so that a full disk is
    found now, not after the training has run (each file is written atomically in any case: files.write_with)."""
    if cfg.stage not in ("train", "all"):
        return
    shape = adapter.metadata() if adapter is not None else dict(n_tokens=cfg.n_tokens, rank=cfg.rank,
                                                                 targets=parse_targets(cfg.targets))
    dims = LookaheadModule.dims(model_cfg)
    numbers = shape["n_tokens"] * model_cfg.hidden_size + model_cfg.num_hidden_layers * shape["rank"] * sum(
        sum(dims[t]) for t in shape["targets"])
    what = "the adapter and checkpoint would take at least"
    if Path(dest).parent.resolve() == Path(out).resolve():
        return check_free(cfg, 4 * 4 * numbers, what, out, "pass another --out")
    check_free(cfg, 3 * 4 * numbers, "the checkpoint would take at least", out, "pass another --out")
    check_free(cfg, 4 * numbers, "the adapter would take at least", Path(dest).parent, "pass another --adapter-out")


def free_disk(path):
    """Bytes free on the file system that holds `path` (its nearest existing folder), or None if unknown."""
    for folder in [path, *path.parents]:
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                return None
    return None


def check_data_made(cfg, out, rows):
    """Under torchrun the ranks but rank 0 only read the data: a data stage with work left runs on one process."""
    have = {split: sum(r.get("split") == split for r in rows) for split in ("train", "heldout")}
    if have["train"] < cfg.n_train or have["heldout"] < cfg.n_heldout or not all(
            sample_ok(sample_path(out, r["id"])) for r in rows if r["split"] == "train"):
        raise ValueError("build the dataset first on one process (python train.py --stage data)")


def check_store(cfg, model_cfg, rows, store, n_bytes=None):
    """The data stage's disk, counted on the training rows' prompts once made (check_disk: the least they take);
    n_bytes: counted by the caller (research/fast_data.py: a group's shared prefix once)."""
    if n_bytes is None:
        n_bytes = sum(sample_bytes(model_cfg, len(r["prompt_ids"]), store) for r in rows if r["split"] == "train")
    if n_bytes > cfg.store_gb * 2**30:
        raise ValueError(f"the training samples would take {size_text(n_bytes)} on disk, over store_gb "
                         f"{cfg.store_gb}: raise it in the --config file, or use fewer/shorter prompts "
                         "(--n-train, --max-tokens)")
    new = sum(sample_bytes(model_cfg, len(r["prompt_ids"]), store) for r in rows  # not yet on disk
              if r["split"] == "train" and not sample_path(Path(cfg.out), r["id"]).exists())
    check_free(cfg, min(new, n_bytes), "the training samples still to write would take")


def output_paths(cfg):
    """(OUT, where the adapter goes), both writable now (check_writable); --stage budgets must be told where (it
    rewrites an adapter)."""
    out = cli.output_folder("--out", cfg.out)
    if cfg.stage == "budgets" and not cfg.adapter_out:
        raise ValueError("--stage budgets needs --adapter-out: where the adapter with its layer weights goes "
                         "(it may be the measured adapter itself; the old pair is kept as NAME.prev.safetensors)")
    dest = cli.output_file("--adapter-out", cfg.adapter_out, ".safetensors") if cfg.adapter_out \
        else out / "adapter.safetensors"
    check_writable("--out", out, out, [out / "ckpt.pt", out / "ckpt.tmp", out / "log.jsonl"])
    if cfg.stage != "data":  # the data stage writes no adapter
        # what LookaheadModule.save writes: the pair, each through a temporary name
        written = [dest, dest.with_suffix(".json"), dest.with_suffix(".safetensors.tmp"), dest.with_suffix(".json.tmp")]
        check_writable("--adapter-out" if cfg.adapter_out else "--out", dest, dest.parent, written)
        check_adapter_dest("--adapter-out" if cfg.adapter_out else "--out", dest)  # nothing of the user's replaced
    return out, dest


def is_adapter(path):
    """Whether `path` (.safetensors) and its .json are an adapter pair as save_adapter writes them: the .json an
    object with the adapter keys (support/checks.ADAPTER_KEYS), the tensors the module's alone (embeddings,
    lora.*), read from the header only."""
    from safetensors import safe_open
    from support.checks import ADAPTER_KEYS

    try:
        meta = json.loads(path.with_suffix(".json").read_text())
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
    except Exception:  # unreadable, not JSON, not safetensors: not one of ours
        return False
    return (isinstance(meta, dict) and all(k in meta for k in ADAPTER_KEYS) and "embeddings" in names
            and all(n == "embeddings" or n.startswith("lora.") for n in names))


def check_adapter_dest(flag, dest):
    """Saving replaces dest and its .json: refused, before the model loads, unless what is there is an adapter pair
    this project saved (is_adapter; the old pair is then kept as NAME.prev). --adapter-out DIR/model.safetensors
    replaced a model's weights with the adapter (and DIR/config.safetensors would replace its config.json): no
    file the run did not make is replaced."""
    there = [p for p in (dest, dest.with_suffix(".json")) if p.exists()]
    if there and not is_adapter(dest):
        which = " and ".join(str(p) for p in there)
        raise ValueError(f"{flag} {dest}: saving the adapter would replace {which}, which is not an adapter this "
                         f"project saved (a .safetensors of the adapter's tensors with its .json): pass a new file "
                         f"name, or move it away")


def check_writable(flag, path, folder, written):
    """That this run can write the files `written` into `folder` at its end, said now rather than after training: a
    file is made there and removed (os.access says yes to root everywhere, and to a read-only mount), and none of
    them is a symbolic link (a planted link: a write there would land where it points) or a folder or other
    non-file that a file cannot replace; links are seen, never followed."""
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{flag} {path}: this folder is not writable (making a file in {folder} failed: "
                         f"{e.strerror}): pass another") from None
    for f in written:
        files.refuse_link(f, flag)
        if f.exists() and not f.is_file():
            raise ValueError(f"{flag} {path}: {f}, which this run writes, is a folder (or not a file): move it "
                             f"away, or pass another {flag}")


def check_samples(cfg, out, rows):
    """--stage train and budgets read the samples OUT holds: there must be some, and those read must open."""
    if cfg.stage not in ("train", "budgets"):
        return
    train_rows = getattr(cfg, "train_rows", None)
    have = [r for r in rows if r.get("split") == "train" and sample_path(out, r["id"]).exists()]
    if not have:
        raise ValueError(f"--stage {cfg.stage}: {out} holds no training samples yet: build them first with "
                         f"python train.py --stage data --out {out} (and this run's --config)")
    if train_rows is not None and train_rows > len(have):
        raise ValueError(f"--train-rows {train_rows}: {out} holds {len(have)} training samples: ask for at "
                         "most that many, or make more with its data stage")
    if cfg.stage == "train" and len(have) < cfg.n_train:
        # a data stage stopped part way trains without a word otherwise, and a --train-rows draw among the rows
        # there is not the draw of the finished folder (draw_rows shuffles the groups it finds)
        cli.warn(f"{out} holds {len(have)} training samples, fewer than n_train {cfg.n_train}: if its data stage "
                 f"has not finished, rerun it first (python train.py --stage data --out {out} and its --config); "
                 f"training on these {len(have)}" + (", --train-rows drawing among them" if train_rows else ""))
    for r in have[:BUDGET_SAMPLES] if cfg.stage == "budgets" else have:
        if not sample_ok(sample_path(out, r["id"])):
            raise unreadable_sample(sample_path(out, r["id"]))


def read_rows(out, model_cfg, partial_ok=False, trim=False):
    """The rows of OUT/data.jsonl ([] if none), all made by this base model. partial_ok: a partial last
    line (a run killed mid-write) is left out; trim: it is also cut from the file (the data stage,
    before it appends to the file: RunFolder.rows)."""
    path = out / "data.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    if (partial_ok or trim) and text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
        if trim:
            files.write_atomic(path, text)
    rows = data.read_jsonl(path, required=("id", "prompt_ids", "response_ids"), allow_empty=True,
                           text=text)
    for r in rows:
        if r.get("fingerprint") != model_cfg.fingerprint():
            raise ValueError(f"{path} was made with another base model ({r.get('base_model')}): use another --out")
    return rows


# -----------------------------------------------------------------------------
# The checkpoint: what --resume continues, and the settings it must agree on

# The settings a resume may change, the rest of the config's fields defining the run: where it reads the model
# (its weights are compared by fingerprint) and writes, which stage runs, when it stops, checks and saves, the device
# (its dtype is compared: that changes the numbers), and the data stage's batch size and disk cap (neither changes
# a row). The module's shape (n_tokens, rank, alpha, targets) is compared from the checkpoint's module itself.
MAY_CHANGE = ("model", "out", "adapter_out", "stage", "resume", "max_minutes", "eval_every", "save_every", "device",
              "gen_batch", "store_gb")
MODULE_KEYS = ("n_tokens", "rank", "alpha", "targets")


def resume_keys(Config):
    """What the result depends on (--data and --init as given: the same file under two spellings is refused)."""
    return tuple(f.name for f in dataclasses.fields(Config) if f.name not in MAY_CHANGE + MODULE_KEYS)


def schedule_of(cfg, weights_id=None):
    """The settings a checkpoint is only good for (--resume with others would train a mix of two runs and record
    one of them in the adapter's .json): every config field but MAY_CHANGE's, checked (check) first, and the
    identity of the base model's weights (files.weights_identity, which check returns): --model may move, the weights
    may not (a copy with the same config and other tensors resumed without a word)."""
    return Schedule({k: getattr(cfg, k) for k in resume_keys(type(cfg))}, weights_id)


class Schedule(dict):
    """schedule_of's settings, a dict of config fields, and (not a field, so not a key) the identity of the base
    model's weights, which save_checkpoint records beside them as the checkpoint's "weights_id"."""

    def __init__(self, settings, weights_id=None):
        super().__init__(settings)
        self.weights_id = weights_id


def other_weights(ck, schedule):
    """Why a checkpoint's base weights are not this run's, or None: it records their identity (save_checkpoint);
    one from before it did is not checked for it."""
    was, now = ck.get("weights_id"), getattr(schedule, "weights_id", None)
    if was is None or now is None or was == now:
        return None
    return (f"trained on other weights (identity {was}; --model's are {now}: the same config, other tensors, "
            f"e.g. a fine-tuned copy)")


def resumable(cfg):
    """Whether OUT holds something --resume continues: a training stage's checkpoint, or, for --stage all, the rows
    of its data stage (a run interrupted there goes on from them, then trains from step 0). The one rule for
    checkpoint_to_resume's refusal and for the command an interrupted run advises (resume_command)."""
    out = Path(cfg.out)
    return cfg.stage in ("train", "all") and ((out / "ckpt.pt").exists() or
                                              (cfg.stage == "all" and (out / "data.jsonl").exists()))


def resume_command(prog, argv, config):
    """The command that continues an interrupted run, as cli.run says it on Ctrl-C (a callable: asked then, not at
    the start): the same flags, with --resume where OUT then holds something to continue (resumable), without it
    where --resume would be refused. config(): the run's config, from the same argv."""
    def command():
        flags = [a for a in argv if a != "--resume"]
        try:
            more = ["--resume"] if resumable(config()) else []
        except ValueError:  # the flags were read once already: only a file changed since could say so
            more = ["--resume"]
        return f"python {prog} " + shlex.join(flags + more)
    return command


def checkpoint_to_resume(cfg, out, model_cfg, adapter, parser, weights_id=None):
    """OUT/ckpt.pt checked against this run (read_checkpoint) when --resume trains and one is there, else None;
    without --resume, one there must be this run's own (check_own_checkpoint): training replaces it. --resume where
    OUT holds nothing it continues (resumable) is refused, saying so: it started a whole new run without a word."""
    if cfg.resume and not resumable(cfg):
        if cfg.stage not in ("train", "all"):
            raise ValueError(f"--resume continues training from OUT/ckpt.pt: it has no use with --stage {cfg.stage} "
                             "(a data stage goes on from the rows OUT holds by itself): drop --resume")
        made = ", no data.jsonl" if cfg.stage == "all" else ""
        raise ValueError(f"--resume: {out} holds nothing to resume (no ckpt.pt{made}): drop --resume to start this "
                         "run there")
    if not (cfg.stage in ("train", "all") and (out / "ckpt.pt").exists()):
        return None
    shape = adapter.metadata() if adapter is not None else dict(
        n_tokens=cfg.n_tokens, rank=cfg.rank, alpha=cfg.alpha, targets=list(parse_targets(cfg.targets)))
    if not cfg.resume:
        return check_own_checkpoint(out, model_cfg, shape, schedule_of(cfg, weights_id), parser)
    return read_checkpoint(out / "ckpt.pt", model_cfg, shape, schedule_of(cfg, weights_id), parser)


def save_checkpoint(path, module, opt, step, log, settings=None):
    """OUT/ckpt.pt through files.write_with (atomic: a kill or a full disk mid-save leaves the previous checkpoint
    intact, and a full disk is one `error:` line, not torch's "file write failed" traceback)."""
    weights_id = getattr(settings, "weights_id", None)  # schedule_of's (a Schedule): the base weights' identity
    # plain types only (a dict, not the Schedule; the log as its JSON lines read back), so that load_checkpoint's
    # weights_only=True reads it: a checkpoint is tensors and plain values, never an object to rebuild
    settings = plain(dict(settings)) if settings is not None else None
    files.write_with(path, lambda tmp: torch.save(dict(
        module=module.state_dict(), meta=plain(module.metadata()), opt=opt.state_dict(), step=int(step),
        log=plain(log), rng=torch.get_rng_state(), settings=settings, weights_id=weights_id), tmp))


def plain(value):
    """`value` as JSON's types (dict, list, str, int, float, bool, None), which torch.load's weights_only reads: a
    tuple becomes a list, a numpy number a Python one."""
    return json.loads(json.dumps(value, default=lambda x: x.item() if hasattr(x, "item") else str(x)))


def load_checkpoint(path):
    """OUT/ckpt.pt's dict, or None if it cannot be read as one (cut short, or not a checkpoint at all). Read with
    weights_only=True: a checkpoint holds tensors and plain values (save_checkpoint); one that pickles anything
    else, which could run code as it loads (a --out folder a user is handed is data), is refused in one line
    naming the file, before anything in it runs; so is one that is not a regular file (a named pipe blocks)."""
    import pickle
    import warnings

    files.check_regular(path, "checkpoint")
    try:
        with warnings.catch_warnings():  # torch's warning on a file of another pickle protocol: the line below says it
            warnings.simplefilter("ignore")
            ck = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if found := re.search(r"GLOBAL (\S+)", str(e)):  # the unpickler stopped at an object to rebuild: not run
            raise ValueError(f"checkpoint {path} holds a pickled object ({found.group(1).rstrip('.')}), not only "
                             "tensors and plain values: it was not loaded (loading it could run code): delete it, or "
                             "pass another --out") from None
        return None
    except Exception:
        return None
    ok = isinstance(ck, dict) and isinstance(ck.get("meta"), dict) and "base_fingerprint" in ck["meta"]
    return ck if ok else None


def checkpoint_differences(ck, now, schedule, parser):
    """What a readable checkpoint was made with that this run is not, one "FLAG OLD (this run: NEW)" each: the
    module (now: its n_tokens, rank, alpha, targets) and the settings (schedule: schedule_of; a checkpoint from
    before a key was saved is not checked for it)."""
    meta, saved = ck["meta"], ck.get("settings") or {}
    differ = [f"{flag_of(k, parser)} {json.dumps(meta.get(k))} (this run: {json.dumps(now[k])})"
              for k in MODULE_KEYS if meta.get(k) != now[k]]
    return differ + [f"{flag_of(k, parser)} {json.dumps(saved[k])} (this run: {json.dumps(schedule[k])})"
                     for k in schedule if k in saved and saved[k] != schedule[k]]


def read_checkpoint(path, model_cfg, now, schedule, parser):
    """OUT/ckpt.pt to resume, checked against the base model, the module this run would train and its
    settings (checkpoint_differences): each that differs is named with both values, in one line."""
    ck = load_checkpoint(path)
    if ck is None:
        raise ValueError(f"--resume: checkpoint {path} is corrupt (unreadable): delete it to start over, "
                         "or drop --resume")
    if ck["meta"]["base_fingerprint"] != model_cfg.fingerprint():
        raise ValueError(f"--resume: {path} was trained for {ck['meta'].get('base_model')}, not {model_cfg.name}: "
                         "use another --out")
    if why := other_weights(ck, schedule):
        raise ValueError(f"--resume: {path} was {why}: resume with the model it was trained on, or pass another "
                         "--out")
    differ = checkpoint_differences(ck, now, schedule, parser)
    if differ:
        raise ValueError(f"--resume: {path} was made with other settings: {'; '.join(differ)}. It is not corrupt: "
                         "resume with its settings, or pass another --out")
    return ck


def check_own_checkpoint(out, model_cfg, now, schedule, parser):
    """Without --resume, a run starts at step 0 and replaces OUT/ckpt.pt at its first checkpoint, and appends to
    OUT/log.jsonl: fine for this run's own checkpoint (the same settings, started over), refused for another run's
    (other settings or model, or a file it cannot read), which it would destroy and whose log it would mix into."""
    path = out / "ckpt.pt"
    ck = load_checkpoint(path)
    if ck is None:
        why = "a file train.py cannot read as a checkpoint"
    elif ck["meta"]["base_fingerprint"] != model_cfg.fingerprint():
        why = f"trained for {ck['meta'].get('base_model')}, not {model_cfg.name}"
    elif other_weights(ck, schedule):
        why = other_weights(ck, schedule)
    else:
        differ = checkpoint_differences(ck, now, schedule, parser)
        if not differ:
            return
        why = f"made with other settings: {'; '.join(differ)}"
    raise ValueError(f"--out {out} holds another run's checkpoint ({path}: {why}): pass another --out, continue that "
                     f"run with its own settings and --resume, or delete {path} to start this one over there")


def resume_note(resume, path, resumed, step, total):
    """What a training run says of OUT/ckpt.pt as it starts."""
    if resumed:
        return f"resumed at step {step}/{total}"
    if resume:
        return f"no checkpoint at {path}: starting from step 0"
    if path.exists():
        return f"{path} exists and --resume was not given: starting from step 0; it is replaced at the first checkpoint"
    return ""


def resume_from(ck, module, opt, path):
    """Load a checked checkpoint into the module and optimiser: (step, log)."""
    try:
        module.load_state_dict(ck["module"])
        opt.load_state_dict(ck["opt"])
        torch.set_rng_state(ck["rng"])
    except Exception as e:
        raise ValueError(f"--resume: checkpoint {path} is corrupt ({type(e).__name__}): delete it to start over, "
                         "or drop --resume") from None
    return ck["step"], ck["log"]


# -----------------------------------------------------------------------------
# The adapter: its .json metadata, and the backups of one it replaces


def describe_rows(train_rows, n_held):
    """The training data as its rows are, not as this command's flags say (with --stage train or --init the
    data stage ran earlier, maybe with other flags): sources, prompt and answer lengths, the copy tasks' share."""
    prompt = [len(r["prompt_ids"]) for r in train_rows] or [0]
    answer = [len(r["response_ids"]) for r in train_rows] or [0]
    return dict(sources=sorted({r.get("source", "?") for r in train_rows}), n_train=len(train_rows), n_heldout=n_held,
                prompt_tokens=[min(prompt), max(prompt)], answer_tokens_max=max(answer),
                copy_share=round(sum(r.get("task") in data.COPY_TASKS for r in train_rows) / max(1, len(train_rows)),
                                 3), python=data.PYTHON)


def check_diverged(log, ckpt):
    """The rule for a run that diverged: its latest validation KL (log: train.py's checks, {"step", "kl"}) is not
    finite (NaN or inf). Its tensors may still be finite (an lr of 0.3 went 0.67 -> 2.2 -> nan), so only the KL it
    records says so: the run stops at that check, before its checkpoint is written, and no adapter is saved (every
    loader would refuse one whose .json records it: support/checks.check_adapter_record). ValueError, one line."""
    last = log[-1] if log else None
    if last is None or not isinstance(last.get("kl"), float) or math.isfinite(last["kl"]):
        return
    if last["step"] == 0:  # before any step: the model or the data, not the rate
        raise ValueError(f"the untrained module's validation KL is {last['kl']}, not a finite number: the base model "
                         "or the held-out rows give no usable KL (check --model's weights, the data, or --init)")
    finite = [e for e in log if math.isfinite(e.get("kl", math.nan))]
    was = f"; step {finite[-1]['step']}'s was {finite[-1]['kl']:.4f}" if finite else ""
    raise ValueError(f"step {last['step']}: the validation KL is {last['kl']} (not finite: the run diverged{was}): "
                     f"stopped, no adapter saved; train again with a lower --lr (the recipes use 1e-3), in another "
                     f"--out or after deleting {ckpt}")


def worse_than_untrained(log):
    """A warning when the last validation KL ended above the untrained module's (step 0's): the adapter is usable (as
    well as an untrained one), but training made its selection worse, which a run's "saved" line alone hides."""
    if len(log) < 2 or not log[-1].get("kl", 0) > log[0].get("kl", math.inf):
        return None
    return (f"the validation KL ended at {log[-1]['kl']:.4f}, above the untrained module's {log[0]['kl']:.4f} "
            "(step 0): training made the selection worse; a lower --lr or more data may help")


def adapter_metadata(cfg, train_rows, n_held, step, total, log, weights_id=None):
    """What the shipped .json says about how the adapter was made (and how it selects: its rule)."""
    info = dict(rule=cfg.rule, train_data=describe_rows(train_rows, n_held), steps=step, planned_steps=total,
                stopped_early=step < total, batch=cfg.batch, lr=cfg.lr, epochs=cfg.epochs,
                heldout=log[-1] if log else None, untrained=log[0] if log else None)
    info["train_data"].update(folder=getattr(cfg, "data", None) or cfg.out)  # the data stage's folder it trained on
    if weights_id:  # the base model's weights it was trained on (files.weights_identity)
        info["base_weights"] = weights_id
    if cfg.rule is None:  # nothing recommended beyond the paper: it selects in the paper's form
        del info["rule"]
    return info


def save_adapter(module, dest):
    """module.save(dest) through files.write_many (the pair whole or not at all, mode 0644, a full disk one
    `error:` line), an adapter already there kept (keep_previous), saying where. check_adapter_dest refused,
    before the run, a dest that is not an adapter of ours."""
    check_adapter_dest("--adapter-out", dest)  # again: the file may have been put there while the run trained
    state = module.state_dict()
    try:  # the loader's own checks, before the adapter is called saved (an lr too high leaves huge numbers)
        checks.check_adapter_tensors(dest, state, state, module.alpha, module.rank)
        checks.check_adapter_record(module.metadata(), dest.with_suffix(".json"))  # a diverged run's NaN KL
    except ValueError as e:
        raise ValueError(f"the trained adapter is not usable, so it was not saved ({e}); OUT/ckpt.pt keeps the "
                         "run: lower --lr and train again") from None
    kept = keep_previous(dest)[1] if dest.exists() or dest.with_suffix(".json").exists() else None
    try:
        files.write_many([dest, dest.with_suffix(".json")], lambda tmp: module.save(tmp[0]))
    except BaseException:
        for p in kept or ():  # the old pair is still at dest: no backup of it is needed
            p.unlink(missing_ok=True)
        raise
    if kept:
        print(f"{dest} existed: replaced; the previous one is kept as {' + '.join(str(p) for p in kept)}")


def backup_names(dest):
    """NAME.prev.safetensors, NAME.prev2.safetensors, NAME.prev3...: where keep_previous may keep dest."""
    n = 1
    while True:
        yield dest.with_name(f"{dest.stem}.prev{n if n > 1 else ''}.safetensors")
        n += 1


def keep_previous(dest):
    """Keep the adapter at dest (+ .json) under the first backup name (backup_names) free of both files: an earlier
    backup is never replaced (a second run on one --adapter-out replaced .prev, the first adapter with it, while
    saying it was kept). Each file is kept as a hard link (os.link: atomic, no disk space, and it fails if the name
    is taken, so two runs saving at once keep theirs under two names); the new adapter then replaces dest with a
    new file, leaving the link the old one. Where links are not supported, a copy, whole or removed (a full disk
    left a truncated file under the backup's name). Returns (the backup's .safetensors path, the files kept)."""
    sources = [src for src in (dest, dest.with_suffix(".json")) if src.exists()]
    for prev in backup_names(dest):
        copies = [(src, prev.with_suffix(src.suffix)) for src in sources]
        if any(p.exists() for p in (prev, prev.with_suffix(".json"))):
            continue
        try:
            keep_one(*copies[0])  # the claim
        except FileExistsError:  # taken meanwhile by another run
            continue
        for src, dst in copies[1:]:
            keep_one(src, dst)
        return prev, [dst for _, dst in copies]


def keep_one(src, dst):
    """dst as a hard link to src, or (no links there) a copy made with O_EXCL that is removed if it fails part way;
    FileExistsError if dst is taken; any other failure one ValueError line (files.os_error_line)."""
    try:
        os.link(src, dst)
        return
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno in files.FULL or e.errno in files.DENIED and e.errno != errno.EPERM:
            raise ValueError(files.os_error_line(e, dst)) from None
    try:  # no hard links on this file system (EPERM, EXDEV, ENOTSUP...): a copy
        with open(src, "rb") as first, open(dst, "xb") as f:  # "xb": the claim
            try:
                shutil.copyfileobj(first, f)
            except BaseException:
                f.close()
                dst.unlink(missing_ok=True)
                raise
        shutil.copystat(src, dst)
    except FileExistsError:
        raise
    except OSError as e:
        raise ValueError(files.os_error_line(e, dst)) from None


# -----------------------------------------------------------------------------
# The run's folder: its rows, samples, checkpoint, log and adapter (train.py's file I/O)


class RunFolder:
    """OUT on disk as train.py reads and writes it: OUT/data.jsonl (the rows), OUT/samples/ (a training
    row's prompt cache and target), OUT/ckpt.pt, OUT/log.jsonl, and the adapter (--adapter-out, default
    OUT/adapter.safetensors). research/train_lab.py's --data reads the samples of another folder (src).
    Every write is atomic: a kill or a full disk leaves the previous file whole."""

    def __init__(self, cfg):
        self.out = Path(cfg.out)
        self.src = Path(getattr(cfg, "data", None) or cfg.out)  # where the samples are read
        self.dest = Path(cfg.adapter_out) if cfg.adapter_out else self.out / "adapter.safetensors"
        self.model_dir = cli.resolve_model(cfg.model)

    def claim(self):
        """One writer per folder (support/lock.py): OUT, and --data's folder if another (a data stage
        still appending to its rows would change them under this run)."""
        cli.claim_folder("--out", self.out)
        if self.src != self.out:
            cli.claim_folder("--data", self.src)

    def rows(self, trim=False):
        """The rows of data.jsonl (checked by recipe.check); trim: a partial last line (a run killed
        mid-write) cut from the file before the data stage appends to it."""
        return read_rows(self.src, ModelConfig.from_hf_config(self.model_dir), partial_ok=True, trim=trim)

    def append_rows(self, rows):  # appended batch by batch: a killed run loses one batch at most
        files.append_text(self.out / "data.jsonl", "".join(json.dumps(r) + "\n" for r in rows))

    def sample_path(self, row_id):
        return sample_path(self.src, row_id)

    def save_sample(self, row_id, sample, store):
        data.save_sample(sample_path(self.out, row_id), sample, store)

    @staticmethod
    def read_sample(path):
        """A sample file's tensors; one that cannot be read is deleted and named (unreadable_sample)."""
        try:
            return data.read_sample(path)
        except Exception as e:  # safetensors raises its own error type on a truncated file
            raise unreadable_sample(path, e) from None

    def missing_samples(self, rows):
        """The training rows without a whole sample file (a data stage killed mid-write), said."""
        missing = [r for r in rows if r["split"] == "train" and not sample_ok(sample_path(self.out, r["id"]))]
        for r in missing:
            if sample_path(self.out, r["id"]).exists():
                print(f"training sample {sample_path(self.out, r['id'])} is unreadable (cut short?): made again")
        return missing

    def check_store(self, cfg, model_cfg, rows, store, n_bytes=None):  # the samples' disk, now made
        check_store(cfg, model_cfg, rows, store, n_bytes)

    def check_data_made(self, cfg, rows):
        check_data_made(cfg, self.out, rows)

    def resume(self, module, opt, total, resume):
        """(step, log): from OUT/ckpt.pt with --resume (checked by recipe.check), else (0, []); said."""
        path = self.out / "ckpt.pt"
        step, log = (0, []) if not (resume and path.exists()) else resume_from(
            load_checkpoint(path), module, opt, path)
        if note := resume_note(resume, path, resume and path.exists(), step, total):
            print(note)
        return step, log

    def save_checkpoint(self, module, opt, step, log, cfg, weights_id=None):
        save_checkpoint(self.out / "ckpt.pt", module, opt, step, log, schedule_of(cfg, weights_id))

    def append_log(self, entry):  # through an O_NOFOLLOW open: a planted link is refused, its target untouched
        files.append_text(self.out / "log.jsonl", json.dumps(entry) + "\n")

    def save_adapter(self, module):
        save_adapter(module, self.dest)

    @staticmethod
    def warn_memory(device):
        warn_memory(device)


# -----------------------------------------------------------------------------
# The machine


def peak_memory_gib():
    """This process's peak resident memory so far (Linux reports ru_maxrss in KiB)."""
    import resource  # Unix only: called where /proc/meminfo exists
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def memory_warning(peak, available):
    """After the first step on a CPU (GiB): a warning when what the machine has left is under half of the step's
    peak, else None. A step grows with its batch's prompt lengths (research/LOG.md 8.3: 12.9 GB at step 3 of the 5K
    recipe, 16-17 GB later), and the kernel's OOM killer ends a run without a line in its log; half is that growth
    with room to spare, a rule of thumb, not a measurement of this run's longest batch."""
    if available is None or available >= peak / 2:
        return None
    return (f"the first training step held {peak:.1f} GiB and the machine has {available:.1f} GiB left: a batch "
            "of longer prompts may get this run killed for memory (no line in the log says so); stop the other "
            "jobs (a data stage resumes), or lower --micro-batch")


def warn_memory(device):
    """memory_warning after this process's first training step on a CPU, as a `warning:` line."""
    warning = memory_warning(peak_memory_gib(), cli.free_memory_gib("cpu")) if device == "cpu" else None
    if warning:
        cli.warn(warning)


# -----------------------------------------------------------------------------
# train.py's flags


class RecipeParser(cli.Parser):
    """train.py's flags; config(argv, Config) reads the run's config: flag > --config file > default."""

    def config(self, argv, Config):
        """A flag given twice counts as given last, and each earlier value is read and checked as the run's own
        would be (cli.Parser.earlier_argvs): `--config A --config B` ran B without opening A, whose lr of 1e30 went
        unseen."""
        argv = sys.argv[1:] if argv is None else list(argv)
        for earlier in self.earlier_argvs(argv):
            check_values(self.read(earlier, Config), self._option_string_actions["--stage"].choices)
        return self.read(argv, Config)

    def read(self, argv, Config):
        flags = vars(self.parse_args(argv))
        path = flags.pop("config", None)
        return dataclasses.replace(Config(), **{**(read_config(path, Config) if path else {}), **flags})


def parser(prog, doc, D, stages):
    """train.py's flags, each a field of its TrainConfig D (whose values are the defaults the help names)."""
    p = RecipeParser(prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
                     argument_default=argparse.SUPPRESS)
    a = p.add_argument
    a("--config", metavar="JSON", help="a recipe: a JSON object of TrainConfig fields (research/configs/)")
    a("--model", help="HF folder of the base model (default: weights/SmolLM2-135M-Instruct)")
    a("--out", help=f"the run's folder: data.jsonl, samples, checkpoint, log (default {D.out})")
    a("--adapter-out", help="the adapter, NAME.safetensors (default OUT/adapter.safetensors); one there is kept as NAME.prev")
    a("--stage", choices=stages, help="data: build OUT's samples; train: train on them; all (default): both")
    for flag, kind, what in [("--n-train", int, "training prompts"), ("--n-heldout", int, "held-out prompts"),
                             ("--max-tokens", int, "longest prompt"), ("--max-new-tokens", int, "answer length cap"),
                             ("--epochs", float, "passes over the rows"), ("--batch", int, "samples a step, all ranks"),
                             ("--micro-batch", int, "samples a forward"), ("--lr", float, "peak learning rate"),
                             ("--eval-every", int, "steps between checks"), ("--save-every", int, "steps between "
                              "checkpoints"), ("--seed", int, "the seed")]:
        a(flag, type=kind, help=f"{what} (default {getattr(D, flag[2:].replace('-', '_')):g})")
    a("--targets", help="LoRA targets: all (default), none, or a comma list of q,k,v,o,gate,up,down _proj")
    a("--resume", action="store_true", help="continue from OUT/ckpt.pt")
    a("--max-minutes", type=float, help="stop after this long, data included (checkpoint + adapter saved)")
    a("--device", help="cpu, cuda, cuda:1 (default: cuda if there is one)")
    a("--dtype", choices=["float32", "bfloat16"], help="base model dtype (default: bfloat16 on CUDA, else float32)")
    return p


# -----------------------------------------------------------------------------
# The learner's run ends with what it bought (train.py --config research/configs/train-quick.json)


def compare(model, rows, budget, modules):
    """The held-out answer KL at C = budget in the paper's form of each module ({label: LookaheadModule}),
    SnapKV's and the shipped adapter's (if the model has one), printed; returns {label: mean KL}."""
    device, shipped = model.lm_head.weight.device, cli.default_adapter_path(model.config)
    modules = {**modules, "snapkv": None}
    if shipped.is_file():
        modules["shipped adapter"] = load_adapter(shipped, model.config, device)
    scorers = {name: make_scorer(EvictConfig("snapkv", budget) if m is None else
                                 EvictConfig("lookahead", budget, options=dict(one_pass=False)), m)
               for name, m in modules.items()}
    kls = [answer_kls(model, r, scorers, (budget,)) for r in tqdm(rows, desc="held-out answer KL")]
    print(f"held-out answer KL at C = {budget} ({len(rows)} prompts, the paper's form; lower is better):")
    mean = {name: sum(k[f"{name}@{budget}"] for k in kls) / max(len(kls), 1) for name in scorers}
    for name, value in mean.items():
        print(f"  {name:<20s} {value:.4f}")
    return mean
