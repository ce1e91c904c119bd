"""
Our adapter (.safetensors + .json) as the folder extensions/lookaheadkv_press.py loads: a PEFT LoRA
(adapter_config.json, adapter_model.safetensors under PEFT's tensor names) beside the M lookahead embeddings
(lookahead_embeddings.safetensors) and lookahead_config.json (M, the base model's name and fingerprint).

    python -m extensions.export_peft weights/SmolLM2-135M-Instruct.lookahead.safetensors \\
        weights/SmolLM2-135M-Instruct.lookahead-peft
    # prints: exported ... (9.4 MB): LookaheadKVPress.from_pretrained("weights/...lookahead-peft")

--model: the base model's HF folder, which the adapter is checked against (default: weights/<its base_model>).
The output folder is new, empty, or one this export made; anything else is refused (nothing of yours is replaced).
The tensors are copied as they are (float32): the PEFT LoRA's deltas are ours (tests/test_lookahead_press.py).
"""
import sys

if __name__ == "__main__" and not __package__:  # run by its path: the repository is not on sys.path
    sys.exit("error: run it from the repository root as python -m extensions.export_peft")

import argparse
import json
from pathlib import Path

import torch

from methods import load_adapter
from model import ModelConfig
from support import cli
from support import checks

ROOT = Path(__file__).resolve().parents[1]
MADE_BY = "lookaheadkv extensions/export_peft.py"  # lookahead_config.json's mark: a folder this export made
FILES = ("adapter_config.json", "adapter_model.safetensors", "lookahead_embeddings.safetensors",
         "lookahead_config.json")
SUBMODULE = dict(q_proj="self_attn", k_proj="self_attn", v_proj="self_attn", o_proj="self_attn",
                 gate_proj="mlp", up_proj="mlp", down_proj="mlp")  # where HF keeps each LoRA target


def check_out(out):
    """The output folder: not empty text or a root, not a file, and new, empty or made by this export."""
    if str(out).strip() in ("", ".") or Path(out).resolve() == Path(Path(out).resolve().anchor):
        raise ValueError(f"output folder {str(out)!r}: pass a folder of its own, e.g. weights/NAME.lookahead-peft")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output folder {out} is a file: pass a folder (it is made if missing)")
    theirs = sorted(p.name for p in out.iterdir() if p.name not in FILES) if out.is_dir() else []
    marked = (out / "lookahead_config.json").is_file() and MADE_BY in (out / "lookahead_config.json").read_text()
    if theirs or (out.is_dir() and any(out.iterdir()) and not marked):
        names = ", ".join((theirs or sorted(p.name for p in out.iterdir()))[:3])
        raise ValueError(f"output folder {out} holds files this export did not make ({names}): pass a new or "
                         "empty folder")
    return out


def peft_tensors(module):
    """Our LoRA as PEFT names it: lora.{l}.{t}_A (r, in) -> ...layers.{l}.{self_attn|mlp}.{t}.lora_A.weight, and
    the same layout (PEFT's lora_A is nn.Linear(in, r): its weight is (r, in); lora_B's (out, r), as ours)."""
    out = {}
    for l, params in enumerate(module.lora):
        for t in module.targets:
            prefix = f"base_model.model.model.layers.{l}.{SUBMODULE[t]}.{t}"
            out[f"{prefix}.lora_A.weight"] = params[t + "_A"].detach().float().contiguous()
            out[f"{prefix}.lora_B.weight"] = params[t + "_B"].detach().float().contiguous()
    return out


def export_peft(adapter, out, model_folder=None):
    """Write `adapter` (ours, .safetensors + .json) into the folder `out` as PEFT LoRA + lookahead files, checked
    against the base model's config (model_folder; default weights/<base_model>). Returns the folder."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    out = check_out(out)
    meta, _ = checks.read_adapter(adapter)  # FileNotFoundError or ValueError naming the file
    folder = Path(model_folder) if model_folder else ROOT / "weights" / str(meta.get("base_model"))
    cli.check_model_dir(folder)
    cfg = ModelConfig.from_hf_config(folder)
    module = load_adapter(adapter, cfg)  # every check a loader applies: fingerprint, shapes, finite values
    out.mkdir(parents=True, exist_ok=True)
    LoraConfig(r=module.rank, lora_alpha=module.alpha, target_modules=list(module.targets), lora_dropout=0.0,
               bias="none", task_type="CAUSAL_LM", base_model_name_or_path=cfg.name).save_pretrained(str(out))
    save_file(peft_tensors(module), str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    save_file({"lookahead_embeddings": module.embeddings.detach().float().contiguous()},
              str(out / "lookahead_embeddings.safetensors"))
    info = dict(method="LookaheadKV (arXiv 2603.10899)", n_tokens=module.n_tokens, base_model=cfg.name,
                base_fingerprint=cfg.fingerprint(), source=Path(adapter).name, made_by=MADE_BY)
    (out / "lookahead_config.json").write_text(json.dumps(info, indent=2) + "\n")
    return out


def main(argv=None):
    p = cli.Parser("-m extensions.export_peft", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("adapter", type=Path, help="our adapter (.safetensors, its .json beside it)")
    p.add_argument("out", help="the folder to write (new, empty, or one this export made)")
    p.add_argument("--model", type=Path, default=None, help="the base model's HF folder (default: weights/<name>)")

    def work():
        args = p.parse_args(argv)
        with torch.no_grad():
            out = export_peft(args.adapter, args.out, args.model)
        size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
        print(f"exported {args.adapter} to {out} ({size:.1f} MB): "
              f"LookaheadKVPress.from_pretrained(\"{out}\")")

    return cli.run(work)


if __name__ == "__main__":
    main()
