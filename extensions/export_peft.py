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
import os
from pathlib import Path

import torch

from methods import load_adapter
from model import ModelConfig
from support import cli, files
from support import checks

ROOT = Path(__file__).resolve().parents[1]
MADE_BY = "lookaheadkv extensions/export_peft.py"  # lookahead_config.json's mark: a folder this export made
FILES = ("adapter_config.json", "adapter_model.safetensors", "lookahead_embeddings.safetensors",
         "lookahead_config.json", "README.md")
SUBMODULE = dict(q_proj="self_attn", k_proj="self_attn", v_proj="self_attn", o_proj="self_attn",
                 gate_proj="mlp", up_proj="mlp", down_proj="mlp")  # where HF keeps each LoRA target


def check_out(out, source, source_sha256):
    """The output folder: not empty text, a root or a file; new, empty, or this export of this same adapter (an
    export of another adapter is never replaced); no link where a file goes (nothing is written through one)."""
    if str(out).strip() in ("", ".") or Path(out).resolve() == Path(Path(out).resolve().anchor):
        raise ValueError(f"output folder {str(out)!r}: pass a folder of its own, e.g. weights/NAME.lookahead-peft")
    out = Path(out)
    files.refuse_links([out, *(out / f for f in FILES)])
    if out.exists() and not out.is_dir():
        raise ValueError(f"output folder {out} is a file: pass a folder (it is made if missing)")
    present = sorted(p.name for p in out.iterdir() if not files.is_temporary(p.name)) if out.is_dir() else []
    theirs = [n for n in present if n not in FILES]
    mark = out / "lookahead_config.json"
    try:
        info = json.loads(files.read_limited(mark, 1 << 20)) if mark.is_file() else {}
    except ValueError:  # unreadable: not this export's
        info = {}
    if theirs or (present and MADE_BY not in str(info.get("made_by") if isinstance(info, dict) else "")):
        raise ValueError(f"output folder {out} holds files this export did not make "
                         f"({', '.join((theirs or present)[:3])}): pass a new or empty folder")
    if present and (info.get("source"), info.get("source_sha256", source_sha256)) != (source, source_sha256):
        raise ValueError(f"output folder {out} holds the export of another adapter ({info.get('source')}): pass a "
                         "new folder, or remove that one first")
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
    """Write `adapter` (ours, .safetensors + .json) into the folder `out` as PEFT LoRA + lookahead files + a model
    card, checked against the base model's config (model_folder; default weights/<base_model>); every file whole or
    not at all (files.write_many). Returns the folder."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    meta, _ = checks.read_adapter(adapter)  # FileNotFoundError or ValueError naming the file
    source_sha256 = files.sha256_of(adapter)  # read in blocks
    out = check_out(out, Path(adapter).name, source_sha256)
    folder = Path(model_folder) if model_folder else ROOT / "weights" / str(meta.get("base_model"))
    cli.check_model_dir(folder)
    cfg = ModelConfig.from_hf_config(folder)
    module = load_adapter(adapter, cfg)  # every check a loader applies: fingerprint, shapes, finite values
    # PEFT resolves base_model_name_or_path from the working directory: the folder as seen from here, if below it
    base = os.path.relpath(folder) if not os.path.relpath(folder).startswith("..") else cfg.name
    info = dict(method="LookaheadKV (arXiv 2603.10899)", n_tokens=module.n_tokens, base_model=cfg.name,
                base_fingerprint=cfg.fingerprint(), source=Path(adapter).name, source_sha256=source_sha256,
                made_by=MADE_BY)
    lora = LoraConfig(r=module.rank, lora_alpha=module.alpha, target_modules=list(module.targets), lora_dropout=0.0,
                      bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base)

    def write(tmps):
        lora.save_pretrained(str(tmps[0].parent))  # adapter_config.json, where tmps[0] is
        save_file(peft_tensors(module), str(tmps[1]), metadata={"format": "pt"})
        save_file({"lookahead_embeddings": module.embeddings.detach().float().contiguous()}, str(tmps[2]))
        tmps[3].write_text(json.dumps(info, indent=2) + "\n")
        tmps[4].write_text(card(meta, info, module, base))

    out.mkdir(parents=True, exist_ok=True)
    files.write_many([out / f for f in FILES], write)
    return out


def card(meta, info, module, base):
    """The folder's README.md: what the LoRA is for (the M lookahead rows only), its base, recipe and scores."""
    train, held = meta.get("train_data") or {}, meta.get("heldout") or {}
    scores = ", ".join(f"{k} {v:.3f}" for k, v in held.items() if k in ("kl", "recall_lookahead@128",
                                                                             "recall_snapkv@128", "recall_oracle@128"))
    return f"""# {info['base_model']}: LookaheadKV adapter, for LookaheadKVPress only

LookaheadKV (arXiv 2603.10899) for kvpress: M = {module.n_tokens} learned lookahead embeddings
(`lookahead_embeddings.safetensors`) and a LoRA (rank {module.rank}, alpha {module.alpha}, on {', '.join(module.targets)})
that applies to **those {module.n_tokens} rows only**. Appended after a prompt, the rows' attention predicts which prompt
tokens the answer will attend to; the press keeps those KV slots and drops the rows.

**Not a general-purpose LoRA.** Loaded with `PeftModel` or `AutoPeftModelForCausalLM` it would change every token's
output, which it was never trained for. Use it through LookaheadKVPress (`extensions/lookaheadkv_press.py` of the
lookaheadkv repository): it reads these files with safetensors and applies the LoRA to the lookahead rows alone.

```python
press = LookaheadKVPress.from_pretrained("path/to/this/folder", budget=128)  # or compression_ratio=0.75
with press(model):
    model(prompt_ids, past_key_values=cache)  # the prompt with its question inside: what the rows were trained on
```

`LookaheadKVPress()` with no folder looks for `<model folder>.lookahead-peft` beside the model's own folder.

- Base model: `{info['base_model']}` (architecture fingerprint `{info['base_fingerprint']}`, checked by the press).
  `base_model_name_or_path` is `{base}`, relative to the directory the export ran in (the repository root). The
  lookaheadkv repository's SmolLM2-135M-Instruct is dequantised from its Q4_1 GGUF to float32 (weights/README.md):
  close to, not bit-identical with, the Hub's bf16 release.
- Source: `{info['source']}` (sha256 `{info['source_sha256'][:16]}...`), written by `python -m extensions.export_peft`.
- Training: the LLM frozen; only the embeddings and the LoRA trained, on KL(answer attention || lookahead attention)
  (the paper's loss). Data: {', '.join(map(str, train.get('sources', ['?'])))}, {train.get('n_train', '?')} prompts of
  {train.get('prompt_tokens', '?')} tokens, greedy answers up to {train.get('answer_tokens_max', '?')} tokens;
  {meta.get('steps', '?')} steps of {meta.get('batch', '?')}, lr {meta.get('lr', '?')}. Recipe, as its .json says it:
  {str(meta.get('recipe', '?'))[:400]}
- Held-out scores ({train.get('n_heldout', '?')} prompts, C = 128): {scores or 'see the adapter .json'}.
  RULER and kvpress's pipeline: RESULTS.md sections 2 and 11 of the lookaheadkv repository, each with its command.
"""


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
