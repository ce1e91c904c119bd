# Put the repo root on sys.path so tests can `import model`, `from weights.prepare import ...`.
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Every test runs torch on one thread. The tensors are tiny (or, for the real model, the machine
    is a shared 2-core one): a second OpenMP thread spin-waiting on a busy core makes ops ~100x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# Two float32 computations of one value in a different order (another chunk size, row count or batch, so
# the CPU's kernels block their sums differently; AVX2, AVX-512 and AMX kernels differ here) agree only
# to rounding: a sum of K terms of size |x| errs by ~sqrt(K) 2^-24 |x|. In the tiny models K <= 128 and
# |x| <= ~8: ~5e-6 per operation, and ~20 operations deep (3 layers), added in the worst case, ~1e-4.
# Equal "to the bit" holds only where both sides run the very same kernel call on the same shapes.
REORDER_ATOL = 1e-4


# --- tiny random Hugging Face checkpoints (used by tests/test_model.py) -------------------------

HF_FAMILIES = {  # model_type -> (config class, model class) names in transformers
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


@pytest.fixture(scope="session")
def tiny_hf_model(tmp_path_factory):
    """Factory: tiny_hf_model(family, seed=0, max_shard_size=None, **config) -> folder holding a
    random transformers model saved with save_pretrained (config.json + *.safetensors).

    Weights are re-drawn larger than HF's init (std 0.02 would make attention nearly uniform, so
    RoPE or mask bugs would hardly show in the logits); norm weights and biases are randomised
    too, since HF initialises them to 1 and 0 and a loader that skipped them would go unseen.
    Identical requests share one folder."""
    import torch
    import transformers

    made = {}

    def make(family="llama", seed=0, max_shard_size=None, **config):
        key = (family, seed, max_shard_size, repr(sorted(config.items())))
        if key in made:
            return made[key]
        cfg_cls, model_cls = (getattr(transformers, n) for n in HF_FAMILIES[family])
        torch.manual_seed(seed)
        model = model_cls(cfg_cls(**{**TINY, **config})).float().eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
                elif name.endswith("bias"):
                    p.normal_(0.0, 0.5)
                else:
                    p.normal_(0.0, 0.15)
        folder = tmp_path_factory.mktemp(f"{family}-")
        kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        model.save_pretrained(folder, **kw)
        made[key] = folder
        return folder

    return make


# --- the real default checkpoint (made by python weights/prepare.py, which the README's test command runs) ---

REAL_FOLDER = Path(__file__).resolve().parents[1] / "weights" / "SmolLM2-135M-Instruct"
REAL_ADAPTER = REAL_FOLDER.parent / "SmolLM2-135M-Instruct.lookahead.safetensors"  # shipped in the repo


@pytest.fixture(scope="session")
def real_model():
    """(model, tokenizer, shipped adapter) on CPU in float32; the test is skipped without the weights."""
    if not (REAL_FOLDER / "model.safetensors").exists():
        pytest.skip("run python weights/prepare.py")
    from methods import load_adapter
    from model import load_model
    from support.tokenizer import Tokenizer

    model = load_model(REAL_FOLDER)
    return model, Tokenizer(REAL_FOLDER, model.config), load_adapter(REAL_ADAPTER, model.config)
