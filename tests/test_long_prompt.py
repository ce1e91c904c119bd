"""Long prompts: the prefill never holds an S x S tensor, at any length (issue 78).

A prompt of S = 32,768 tokens on a one-layer model runs in a child process whose address space is capped at
what it uses before the prefill plus 3 GiB: one S x S float32 tensor (4 GiB) cannot be made there, which the
child checks too (the control: without it a cap that never bites would pass). Fused SDPA and max_chunk's chunks
(the padded mask is a (chunk, S) tensor) keep every method's prefill, scoring and eviction under it."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHILD = r"""
import resource, sys
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(1)
from model import ModelConfig, Transformer
from eviction import EvictConfig, compress
import methods

S, method, batch = int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=1 << 17, name="tiny-long")
torch.manual_seed(0)
model = Transformer(cfg).eval()
module = methods.untrained(model, 0, n_tokens=4, rank=2) if method == "lookahead" else None
ids = torch.randint(0, 64, (batch, S))
pad_mask = None
if batch > 1:  # left padding: the masked path, in chunks
    pad_mask = torch.ones(batch, S, dtype=torch.bool)
    pad_mask[1:, :100] = False
used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
cap = used + (3 << 30)
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
try:
    torch.empty(S, S)  # 4 GiB: the cap must refuse it, or this test proves nothing
    print("control: an S x S tensor fit under the cap")
    sys.exit(2)
except RuntimeError:
    pass
with torch.no_grad():
    cache = compress(model, ids, methods.make_scorer(EvictConfig(method, budget=64), module), pad_mask=pad_mask)[0]
print("slots", len(cache))
"""


@pytest.mark.parametrize("method,batch", [("full", 1), ("lookahead", 1), ("snapkv", 1), ("lookahead", 2)])
def test_a_32k_prompt_prefills_without_an_s_by_s_tensor(method, batch):
    S = 32768
    r = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), str(S), method, str(batch)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    assert f"slots {S if method == 'full' else 64}" in r.stdout


def test_max_chunk_is_one_call_for_the_default_model_at_its_context_and_bounded_for_large_models():
    import torch
    from eviction import CHUNK_BYTES, max_chunk
    from model import ModelConfig

    smol = ModelConfig()  # SmolLM2-135M's shape (the dataclass defaults)
    x = torch.empty(1, 8192, smol.hidden_size, device="meta")
    assert max_chunk(smol, x) >= smol.max_position_embeddings  # its whole context in one call
    big = ModelConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128)  # Llama-3.1-8B's shape, bf16
    x = torch.empty(1, 32768, 4096, dtype=torch.bfloat16, device="meta")
    n = max_chunk(big, x)
    assert n < 32768 and n * 2 * (3 * 14336) <= CHUNK_BYTES  # chunks, each within the bound
    padded = max_chunk(smol, torch.empty(4, 8192, smol.hidden_size, device="meta"), pad_mask=True)
    assert padded * 8192 * 5 * 4 <= CHUNK_BYTES  # with padding the (chunk, S) masks count too
