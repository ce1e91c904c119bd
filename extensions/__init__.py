"""Ideas beyond the paper, one file each. Each wraps any method, as kvpress's wrappers wrap any press, and
runs only when a flag asks for it:
span.py's SpanRule wraps a method's scorer in Spanned (its prefill watched for the hidden states too, its
scores smoothed before the method's own eviction step: --pool span:8:1024); layer_budgets.py is a budget
policy any scorer takes (EvictConfig.budgets: --layer-budgets); layer_loss.py's LayerWeightedKL wraps the
paper's kl_loss, layer by layer (python -m research.train_lab --loss-weights); answer_weights.py makes a data
folder whose targets weigh the answer tokens that need the prompt; decode.py's DecodeEviction runs any
method's scorer again while the answer grows (--decode-budget); chat.py, generate.py's chat (--turns), builds
on it; lookaheadkv_press.py is LookaheadKV as a press of NVIDIA's kvpress, self-contained (torch, transformers,
kvpress, safetensors, peft: it imports nothing of this repository, so a kvpress user copies the one file), and
export_peft.py writes one of our adapters as the folder it loads (a PEFT LoRA beside the lookahead embeddings;
the optional extra [kvpress]).
Nothing on the reading path or in support/ imports them: methods.py loads one by name (methods.extension) when
its flag is given, and tests/test_reading_path.py deletes each file in turn (then all of them) and shows the
core, generate.py's default run and train.py still work."""
