"""
train.py with the research options (RESULTS.md and research/LOG.md name the runs): the same recipe and flags,
plus
    --data DIR        train (or measure budgets) on another run's data stage; OUT keeps checkpoint, log, adapter
    --train-rows N    about N of the training rows, whole groups, a seeded draw (the learning curve)
    --init ADAPTER    start from this adapter (its M, rank, targets), a new optimiser and schedule
    --loss-weights J  weigh each layer's KL by an adapter .json's layer_weights (extensions/layer_loss.py)
    --group N         training prompts N to a shared context, made by research/fast_data.py
    --stage budgets   an adapter's per-layer weights (extensions/layer_budgets.py), written into its .json
and, at step 0 and every --eval-every steps, the held-out line of research/harness.py (KL(gt || pred) and
recall@C of the adapter as it selects and unpooled, SnapKV, H2O and StreamingLLM) in place of train.py's
validation KL. Its data stage is research/fast_data.py's (the target summed while the answer is decoded).
    python -m research.train_lab --config research/configs/train-cpu-5k.json --stage data --out runs/data5k
    python -m research.train_lab --config research/configs/train-cpu-5k.json --stage train --data runs/data5k \\
        --train-rows 1300 --out runs/curve/n1300
    python -m research.train_lab --stage budgets --data runs/data5k --init runs/curve/n1300/adapter.safetensors \\
        --out runs/curve/n1300 --adapter-out runs/curve/n1300/adapter.safetensors
"""
import sys

if __name__ == "__main__" and not __package__:  # run by its path: the repository is not on sys.path
    sys.exit("error: run it from the repository root as python -m research.train_lab")

import dataclasses
import json
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

import methods
import train
from eviction import EvictConfig
from extensions import layer_budgets, layer_loss
from lookaheadkv import kl_loss
from research import fast_data, harness
from model import ModelConfig, load_model
from support import cli, files, recipe
from support.data import sample_path
from support.tokenizer import Tokenizer


@dataclasses.dataclass
class LabConfig(train.TrainConfig):
    data: str | None = None  # --data: with --stage train (or budgets), the folder whose samples it reads (another
    # run's data stage: the learning curve's adapters share one); None: OUT's own. OUT keeps checkpoint, log, table
    train_rows: int | None = None  # --train-rows: train on about this many of the training rows (whole groups,
    # a seeded draw: each smaller draw inside the larger ones; the learning curve); None: all of them
    group: int = 1  # --group: training prompts per shared context (data.make_training_groups: the context's
    # prefill, cache and disk are paid once per group); 1: each prompt its own context (make_training_prompts)
    first_frac: float = 0.15  # with group > 1: the share of training prompts that open with their instruction
    init: str | None = None  # --init: start from this adapter (its M, rank, targets), new optimiser and schedule
    loss_weights: str | None = None  # --loss-weights: an adapter's .json whose layer_weights weigh each layer's KL
    # (extensions/layer_loss.py, beyond the paper); None: the paper's loss, every layer the same
    budget: int = 128  # C of the held-out recall (and of --stage budgets)
    window: int = 32  # the held-out SnapKV / H2O rows: last prompt tokens always kept


def parser():
    D = LabConfig()
    p = train.parser("python -m research.train_lab", stages=("data", "train", "budgets", "all"))
    a = p.add_argument
    a("--data", metavar="DIR", help="--stage train or budgets: read the samples of this data-stage folder instead "
      "of OUT's (it is only read, but for its held-out ground truth cache); OUT keeps checkpoint, log, adapter")
    a("--train-rows", type=int, metavar="N", help="--stage train: about N of the training rows (whole groups, "
      "a seeded draw: a smaller N's rows are inside a larger N's); default all")
    a("--group", type=int, help=f"training prompts per shared context (default {D.group}: none shared)")
    a("--init", metavar="ADAPTER", help="start from this adapter (or, --stage budgets: measure it)")
    a("--loss-weights", metavar="JSON", help="beyond the paper: weigh each layer's KL by this adapter .json's "
      "layer_weights, squared (extensions/layer_loss.py); default the paper's mean over layers")
    return p


# -----------------------------------------------------------------------------
# The checks of the research options (support/recipe.py has the rest), before the model loads


def read_adapter(cfg, model_cfg):
    """The held-out check's baselines at C = budget, --loss-weights' file, and the adapter to start from (--init)
    or to measure (--stage budgets: --init, default the shipped one), its path in info["path"]; None if none."""
    if cfg.stage in ("train", "all"):
        for method in harness.BASELINES:  # SnapKV, PyramidKV and H2O keep the last `window` tokens anyway
            if method != "oracle":  # its scores need the answer; it keeps no window
                try:
                    methods.make_scorer(EvictConfig(method, cfg.budget, window=cfg.window))
                except ValueError as e:
                    raise ValueError(f"budget {cfg.budget}, window {cfg.window} (the held-out check's): {e}") from None
    training_loss(cfg, model_cfg)
    if not (cfg.stage == "budgets" or cfg.init):
        return None
    if cfg.init:  # the adapter's own M, rank, alpha and targets train on: other settings are said, not used
        D = LabConfig()
        given = [k for k in ("n_tokens", "rank", "alpha", "targets") if getattr(cfg, k) != getattr(D, k)]
        if given:
            cli.warn(f"--init {cfg.init} trains the adapter's own M, rank, alpha and targets: "
                     f"{', '.join(f'{k} {getattr(cfg, k)}' for k in given)} not used")
    path = cfg.init or cli.default_adapter_path(model_cfg)
    adapter = methods.load_adapter(cli.input_file("--init", path) if cfg.init else path, model_cfg)
    adapter.info["path"] = str(path)
    return adapter


def training_loss(cfg, model_cfg):
    """The loss the module trains on: the paper's kl_loss, or with --loss-weights the layer-weighted one
    (extensions/layer_loss.py), its file checked now."""
    if cfg.loss_weights is None:
        return kl_loss
    if cfg.stage not in ("train", "all"):
        raise ValueError(f"--loss-weights is read when training: it has no use with --stage {cfg.stage}")
    path = cli.input_file("--loss-weights", cfg.loss_weights)
    return layer_loss.LayerWeightedKL(layer_loss.read_weights(path, model_cfg.num_hidden_layers))


def check(cfg):
    """Every setting and file, before the model loads (recipe.check with the research options'):
    the base weights' identity."""
    return recipe.check(cfg, parser(), read_adapter)


# -----------------------------------------------------------------------------
# The research options' steps, around train.py's functions


def draw_rows(rows, n, seed):
    """About n of the training rows for --train-rows: whole groups (a group's members share their context, so a
    split group would hand a small run the same document several times over) drawn in a seeded order until n are
    in, the draw's rows in data.jsonl's order. The same seed draws the same order, so a smaller n's rows are all
    inside a larger n's (a learning curve adds data, it does not swap it)."""
    units = {}
    for r in rows:
        units.setdefault(r.get("group", r["id"]), []).append(r)
    keys = sorted(units)
    random.Random(seed).shuffle(keys)
    chosen, count = set(), 0
    for key in keys:
        if count >= n:
            break
        chosen.add(key)
        count += len(units[key])
    return [r for r in rows if r.get("group", r["id"]) in chosen]


def harness_check(model, cfg, rows, src):
    """The held-out line of research/harness.py, its ground truth kept beside the rows (src/heldout)."""
    heldout = harness.heldout_ground_truth(model, [r for r in rows if r["split"] == "heldout"], out=src,
                                           keep_runs=True)  # heldout_metrics keeps them between checks

    def check(module, prefix):
        m = harness.heldout_metrics(model, module, heldout, budgets=(cfg.budget,), window=cfg.window)
        return m, harness.heldout_line(prefix, m, cfg.budget)
    return check if heldout else None


def start_module(model, cfg, adapter, init):
    """The module to train: --init's adapter (its per-layer weights dropped: they were measured for
    its weights, not the new ones; what it was is kept in `init` for the .json), or an untrained one."""
    if adapter is None:
        return train.new_module(model, cfg)
    module = adapter.to(cfg.device)
    init.update(module.info, path=Path(module.info["path"]).name)
    if "layer_weights" in module.info:
        print(f"--init {cfg.init}: its per-layer weights are dropped; measure them again for the trained "
              "adapter (python -m research.train_lab --stage budgets)")
    module.info = dict(rule=cfg.rule) if cfg.rule is not None else {}
    return module


def describe(cfg, info, log, init):
    """What the adapter's .json adds about the research options."""
    if cfg.train_rows:
        info["train_data"]["drawn"] = dict(asked=cfg.train_rows, seed=cfg.seed)
    if cfg.loss_weights:  # beyond the paper: the layer-weighted loss (extensions/layer_loss.py)
        info["loss"] = dict(layer_weights_from=Path(cfg.loss_weights).name)
    if init:  # step 0 was the init adapter, not an untrained module: keep the init's own reference
        info.update(untrained=init.get("untrained"), init=dict(
            path=init["path"], steps=init.get("steps"), heldout=log[0] if log else None))


# -----------------------------------------------------------------------------
# Stage budgets: the adapter's per-layer weights (extensions/layer_budgets.py), written into its .json


def stored_samples(model, out, rows):
    """(cache, target, answer ids (1, R)) of each row from its sample file (the cache recomputed if the
    file holds only the target)."""
    dev, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    for r in rows:
        cache, gt, _ = train.get_batch([sample_path(out, r["id"])], dev, dtype)
        cache = cache if cache is not None else train.prompt_cache(model, [r["prompt_ids"]])
        yield cache, gt, torch.tensor([r["response_ids"]], device=dev)


def measure_budgets(model, module, cfg, src, out, rows, dest):
    """The adapter's per-layer weights measured on the first BUDGET_SAMPLES training samples of src (OUT, or --data),
    written into its .json at dest and, as a table, into OUT/layer_weights.json."""
    rows = [r for r in rows if r["split"] == "train" and sample_path(src, r["id"]).exists()][:recipe.BUDGET_SAMPLES]
    weights, report = layer_budgets.measure(model, module, stored_samples(model, src, rows), budget=cfg.budget,
                                            progress=lambda it: tqdm(it, total=len(rows), desc="samples"))
    source = module.info.pop("path")
    print(f"adapter {source}, {len(rows)} training samples of {src}, C = {cfg.budget}: "
          f"answer KL {report['answer_kl']:.4f}")
    print("layers  answer-KL gain  weight")
    for (a, b), gain in zip(report["groups"], report["gain"]):
        print(f"{f'{a}-{b}':<7s} {gain:<15.4f} {weights[a]:.2f}")
    how = {k: report[k] for k in ("rows", "C", "group", "floor", "power")}
    table = out / "layer_weights.json"
    if table.exists():
        print(f"{table} existed: replaced")
    files.write_atomic(table, json.dumps(dict(weights=weights, adapter=Path(source).name, **report), indent=1) + "\n")
    print(f"wrote {table}")
    module.info.update(layer_weights=weights, layer_weights_from=how)
    recipe.save_adapter(module, dest)
    print(f"wrote {dest} (+ .json): its weights as they were, its .json with layer_weights")


def budgets(cfg, adapter):
    folder = recipe.RunFolder(cfg)
    folder.claim()
    model = load_model(folder.model_dir, cfg.device, getattr(torch, cfg.dtype))
    measure_budgets(model, adapter.to(cfg.device), cfg, folder.src, folder.out, folder.rows(),
                    folder.dest)


# -----------------------------------------------------------------------------
# The run


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    config = lambda: train.get_args(argv, LabConfig, parser())  # noqa: E731
    return cli.run(lambda: run(config()), resume=recipe.resume_command("-m research.train_lab", argv, config))


def run(cfg):
    """train.py's run with the research options, on one process: its functions, called in its order."""
    start = time.perf_counter()  # --max-minutes counts from here, data stage included
    cfg = train.resolved(cfg)
    weights_id = check(cfg)  # every setting and file, before the model loads
    adapter = read_adapter(cfg, ModelConfig.from_hf_config(cli.resolve_model(cfg.model)))
    if cfg.stage == "budgets":
        return budgets(cfg, adapter)
    out_of_time = train.time_limit(cfg.max_minutes, start)
    folder = recipe.RunFolder(cfg)
    folder.claim()
    torch.manual_seed(cfg.seed)
    model = load_model(folder.model_dir, cfg.device, getattr(torch, cfg.dtype))
    rows = folder.rows(trim=cfg.stage in ("data", "all"))
    if cfg.stage in ("data", "all"):  # research/fast_data.py: the target summed while answering
        tok = Tokenizer(folder.model_dir, model.config)
        rows = fast_data.build_dataset(model, tok, cfg, folder, rows, out_of_time)
    if cfg.stage == "all" and out_of_time():
        return print("--max-minutes reached in the data stage: training not started; the same command "
                     "goes on")
    have = [r for r in rows if r["split"] == "train" and folder.sample_path(r["id"]).exists()]
    n_held = sum(r["split"] == "heldout" for r in rows)
    if cfg.stage == "data":
        return print(f"data ready: {len(have)} train, {n_held} held-out rows in {folder.out / 'data.jsonl'}")
    train_rows = draw_rows(have, cfg.train_rows, cfg.seed) if cfg.train_rows else have
    init = {}
    module = start_module(model, cfg, adapter, init)
    heldout = harness_check(model, cfg, rows, folder.src)
    t_train = time.perf_counter()
    module, opt, step, total, log = train.train_loop(
        model, module, cfg, train_rows, folder, heldout, weights_id, out_of_time,
        loss=training_loss(cfg, model.config))
    if step < total:
        folder.save_checkpoint(module, opt, step, log, cfg, weights_id)
    module.info = recipe.adapter_metadata(cfg, train_rows, n_held, step, total, log, weights_id)
    describe(cfg, module.info, log, init)
    folder.save_adapter(module)
    print(f"saved {folder.dest} (+ .json) after {step} steps, {time.perf_counter() - t_train:.0f} s")


if __name__ == "__main__":
    main()
