"""The GPU path, proven without a GPU: every path that runs on CUDA (prefill, compress with all nine
methods, the span rule and per-layer budgets, decode, decode-phase eviction and a new chat turn, the
data stage, a training step, the adapter round trip) runs here on the META device under a checker
that raises as soon as one aten op
receives tensors on two devices, as a CUDA kernel would. A tensor created on the CPU inside such a
path (`torch.arange(n)` without `device=`, a CPU index, a CPU mask) fails here, on a CPU-only torch.

Why meta + a dispatch-mode checker, and not FakeTensorMode with fake CUDA tensors:
- meta runs everything the paths need, forward and backward (SDPA with GQA and masks, topk, sort,
  gather, pooling, AdamW, clip_grad_norm_), with no values and no cost; FakeTensorMode cannot
  random-init or `.to("cuda")` on a CPU-only build, and an nn.Parameter holding a fake CUDA tensor
  aborted the process, so the library's own modules and optimiser could not run unchanged;
- but meta alone is no check: TensorIterator ops (add, where, cat, masked_fill) refuse a CPU operand,
  while matmul, gather, index, einsum and SDPA silently accept one (test_meta_alone_misses_...).
  `OneDevice`, a TorchDispatchMode, sees every aten op, backward and optimiser ops included, and
  applies FakeTensor's own rule (FakeTensor._find_common_device): all tensor operands on one device,
  except 0-dim CPU tensors (CUDA kernels take those as scalars), device moves (_to_copy, copy_), and
  CPU index tensors in indexing (CUDA accepts those: "indices should be either on cpu or on the same
  device as the indexed tensor"). So OneDevice is as strict as CUDA and never stricter (meta's own
  kernels are, in one place met here: masked_fill refuses a 0-dim CPU fill value, which CUDA takes).
- The base model runs in bfloat16 where the CUDA scripts put it there (train.py, generate.py,
  bench.py: default_dtype), the lookahead module in float32 (train.py). The other GPU-only bug, a
  dtype mix that fp32 CPU runs never meet, is checked too: SDPA's meta kernel refuses mixed q/k/v
  dtypes itself, and OneDevice refuses matmuls (mm, bmm, addmm, ...) of two floating dtypes, which
  meta lets through and CUDA refuses ("expected mat1 and mat2 to have the same dtype").
What it cannot see: anything that depends on values (numerics: tests/test_bf16.py; real CUDA:
gpu_check.sh), and kernels' own constraints (flash attention's shapes).

Seams (the places where values would be needed; each is named here and nowhere hidden):
1. HOST READS. `.item()`, `bool(t)`, `int(t)` of a meta tensor answer 0 / False, and `.cpu()`,
   `.tolist()`, `.to("cpu")` answer zeros (OneDevice: aten._local_scalar_dense, aten._to_copy to
   cpu). Each read is recorded with its file:line (`OneDevice.host_reads`, printed with -s): on CUDA
   each is a device-to-host sync. The sites today: decode()'s `done.all()` (once per generated
   token), greedy()'s and answer_and_target's `tokens.tolist()` (the answers: zeros, so every answer
   runs to max_new_tokens; the stop-id stub excludes 0), DecodeEviction.evict's `int(next_pos[0])` (its
   log), the untrained module's embedding std (`.item()`), the training step's `loss.item()`, and
   the device-to-host copies of LookaheadModule.save and save_sample (`.cpu()`: zeros are written,
   so the round trip checks shapes and placement, not values); metrics.keep_fraction (`.cpu()`,
   and seam 2) for generate.py --show.
2. DATA-DEPENDENT SHAPES. aten.bincount on meta answers zeros of `minlength` (it has no meta kernel;
   metrics.keep_fraction uses it, outside the paths checked here). aten.nonzero on meta answers every
   index, as if the mask were all True (extensions/span.token_surprisal: the candidate tokens, and its
   two parts of log Z: the tokens' own ids, the rest, the tokens still undecided; each on CUDA a
   device-to-host sync). Any other op without a meta kernel (unique, masked_select) fails the test:
   name it here if library code ever needs one.
3. CausalBias. torch cannot create the CausalBias tensor subclass (model.py's causal_lower_right, a
   chunk on top of a cache) while a Python dispatch mode is active ("Creating a new Tensor subclass
   CausalBias but the raw Tensor object is already associated..."): its constructor runs with the
   mode switched off (monkeypatched CausalBias.__new__). It holds no device tensor; SDPA's
   __torch_function__ materialises its mask on the query's device, under the mode.
4. Stopwatch / torch.cuda.Event: not exercised (meta is not "cuda"); gpu_check.sh runs them for real.

The planted failures (test_planted_*) show the check is real: each breaks one path the way a careless
edit would (a CPU index into a gather; torch.arange without device= in one of six functions; a CPU
tensor in the LoRA's backward; the LoRA's float32 weights not cast to the bf16 activations) and
asserts the checker's error names the op; the same paths unplanted pass above.

CPU only, tiny configs, one thread; the tests take about 3 s in all (plus imports)."""

import inspect
import sys
import traceback
import types
from pathlib import Path

import pytest
import torch
from torch.nn.attention.bias import CausalBias
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

import dataclasses

import eviction as ev
import lookaheadkv as lk
import train
from eviction import EvictConfig, decode
from support import data
from extensions.decode import DecodeEviction, add_turn
from extensions.layer_budgets import LayerBudgets
from extensions.span import SpanRule
from lookaheadkv import LookaheadModule, lookahead_pass
from methods import METHODS, adapter_selection, make_scorer
from model import KVCache, ModelConfig, Transformer
from test_lookaheadkv import compress_by, settings

aten = torch.ops.aten
DEV = torch.device("meta")  # stands for "cuda"
BF16 = torch.bfloat16  # the base model's dtype on CUDA (model.default_dtype, train.py --dtype)
REPO = Path(__file__).resolve().parent.parent
V = 128
TINY = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, name="tiny")
FAMILIES = {  # the features of the configs the GPU runs (bench.py --quick: Llama-3.1-8B, Qwen3-8B)
    "llama": {},
    "llama3-rope": dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=64)),
    "qwen2": dict(model_type="qwen2", attention_bias=True),
    "qwen3": dict(model_type="qwen3", qk_norm=True, tie_word_embeddings=False),
}


# -----------------------------------------------------------------------------
# The checker


class DeviceMismatch(RuntimeError):
    pass


class DtypeMismatch(RuntimeError):
    pass


MOVES = {aten._to_copy.default, aten.copy_.default, aten._copy_from.default, aten._copy_from_and_resize.default,
         aten._foreach_copy_.default, aten.lift_fresh.default}  # device moves: cross-device by design
MATMULS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default, aten.addbmm.default,
           aten.mv.default, aten.addmv.default, aten.dot.default}  # CUDA: one floating dtype for all operands
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
            aten._index_put_impl_.default}  # CUDA accepts CPU index tensors (argument 1) in these


def _site():
    """file:line of the innermost repository frame (the checker's own excepted) that led to the op."""
    for f in reversed(traceback.extract_stack()):
        p = Path(f.filename)
        if (p.parent == REPO or p.parent.parent == REPO) and f.name not in ("_site", "__torch_dispatch__"):
            return f"{p.relative_to(REPO)}:{f.lineno}"
    return "?"


class OneDevice(TorchDispatchMode):
    """Every aten op, forward, backward and optimiser alike: its tensor operands must share one device,
    as on CUDA (FakeTensor._find_common_device's rule; see the module docstring), and a matmul's
    floating operands one dtype. Host reads of a meta tensor answer 0 / False / zeros and are recorded in
    host_reads (seams 1 and 2)."""

    def __init__(self):
        super().__init__()
        self.host_reads = []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in MOVES:
            operands = [args[0], *args[2:]] if func in INDEXING else args
            devices = {t.device for t in tree_flatten((operands, kwargs))[0]
                       if isinstance(t, torch.Tensor) and not (t.device.type == "cpu" and t.dim() == 0)}
            if len(devices) > 1:
                raise DeviceMismatch(f"{func} got tensors on {' and '.join(sorted(map(str, devices)))} "
                                     f"(at {_site()})")
        if func in MATMULS:
            dtypes = {t.dtype for t in args if isinstance(t, torch.Tensor) and t.is_floating_point()}
            if len(dtypes) > 1:
                raise DtypeMismatch(f"{func} got {' and '.join(sorted(map(str, dtypes)))} (at {_site()})")
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is not None and x.device.type == "meta":
            if func is aten._local_scalar_dense.default:  # seam 1: .item(), bool(), int()
                self.host_reads.append(("item", _site()))
                return False if x.dtype == torch.bool else 0
            if func is aten._to_copy.default and torch.device(kwargs.get("device") or "meta").type == "cpu":
                self.host_reads.append(("to cpu", _site()))  # seam 1: .cpu(), .tolist(), .to("cpu")
                return torch.zeros(x.shape, dtype=kwargs.get("dtype") or x.dtype)
            if func is aten.bincount.default:  # seam 2: metrics.keep_fraction
                self.host_reads.append(("bincount", _site()))
                minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
                return torch.zeros(minlength, dtype=torch.long, device=x.device)
            if func is aten.nonzero.default:  # seam 2: every index, as if all True (the span rule's candidates)
                self.host_reads.append(("nonzero", _site()))
                return torch.ones(x.shape, dtype=torch.bool).nonzero().to(x.device)
        return func(*args, **kwargs)


def _causal_bias_new(cls, *args, **kwargs):  # seam 3
    with _disable_current_modes():
        return torch.Tensor.__new__(cls, *args, **kwargs)


@pytest.fixture(autouse=True)
def _causal_bias(monkeypatch):
    monkeypatch.setattr(CausalBias, "__new__", _causal_bias_new)


@pytest.fixture
def check():
    """The checker around a test's device work; its host reads are printed (pytest -s)."""
    mode = OneDevice()
    with mode:
        yield mode
    if mode.host_reads:
        print("host reads:", sorted(set(mode.host_reads)))


# -----------------------------------------------------------------------------
# Tiny models on the device


def device_model(dtype=BF16, **kw):
    """As load_model builds it: on meta first (no random init), here left there, in the CUDA dtype."""
    cfg = ModelConfig(**{**TINY, **kw})
    with torch.device("meta"):
        model = Transformer(cfg)
    return model.to(dtype).eval().requires_grad_(False)


def device_module(cfg, M=8, targets=LookaheadModule.TARGETS):
    """A LookaheadModule made on the CPU and moved, as train.new_module and LookaheadModule.load do."""
    return LookaheadModule(cfg, n_tokens=M, targets=targets).to(DEV)


def ids_on(B, T, seed=0):
    return torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(seed)).to(DEV)


def left_padded(lengths, seed=0):
    ids, mask = ev.left_pad([torch.randint(1, V, (n,), generator=torch.Generator().manual_seed(seed + n)).tolist()
                                for n in lengths], DEV)
    return ids, mask


def on_device(*tensors):
    for t in tensors:
        assert t.device == DEV, f"a result is on {t.device}"


def assert_cache_on_device(cache):
    for l in range(len(cache.k)):
        on_device(cache.k[l], cache.v[l], *([] if cache.valid[l] is None else [cache.valid[l]]))


def decode_evicting(model, cache, logits, next_pos, n, evictor):
    """decode() with the evictor watching every step and evicting after it."""
    return list(decode(model, cache, logits, next_pos, n, hook=evictor.hook, after_step=evictor.after_step))


# -----------------------------------------------------------------------------
# The checker itself


def test_checker_follows_cudas_rules():
    """What CUDA refuses raises DeviceMismatch, what CUDA accepts passes: 0-dim CPU operands, device
    moves (.to, copy_ into a device tensor), CPU index tensors in indexing."""
    x, cpu = torch.ones(4, 3, device=DEV), torch.ones(4, 3)
    with OneDevice():
        for bad in (lambda: x + cpu, lambda: x @ cpu.T, lambda: x.gather(1, torch.zeros(4, 1, dtype=torch.long)),
                    lambda: torch.where(cpu > 0, x, x), lambda: x.masked_fill(cpu > 0, 0.0),
                    lambda: x.index_select(0, torch.tensor([0, 1])), lambda: torch.cat([x, cpu]),
                    lambda: x.index_put_((torch.tensor([0]),), torch.ones(3))):
            with pytest.raises(DeviceMismatch):
                bad()
        on_device(x * torch.tensor(2.0), torch.where(x > 0, x, torch.tensor(0.0)), cpu.to(DEV), x[torch.tensor([0, 2])],
                  x.index_put((torch.tensor([0]),), torch.tensor(5.0)))
        x[:2] = cpu[:2]  # copy_ from the host into a device tensor: what load_batch does
        assert (x.sum().item(), bool(x.any()), x.cpu().shape) == (0, False, (4, 3))  # seam 1


def test_meta_alone_misses_what_the_checker_catches():
    """Why the checker exists: meta accepts a CPU index in gather, a CPU operand in a matmul and a
    bf16 x fp32 matmul, which CUDA refuses; under OneDevice all three raise."""
    x, idx = torch.ones(2, 3, device=DEV), torch.zeros(2, 1, dtype=torch.long)
    on_device(x.gather(1, idx), x @ torch.ones(3, 2))  # silently accepted by meta
    with OneDevice(), pytest.raises(DeviceMismatch, match="gather"):
        x.gather(1, idx)
    with OneDevice(), pytest.raises(DeviceMismatch, match="mm"):
        x @ torch.ones(3, 2)
    on_device(x.bfloat16() @ torch.ones(3, 2, device=DEV))  # nor does meta check a matmul's dtypes
    with OneDevice(), pytest.raises(DtypeMismatch, match="mm.*bfloat16 and torch.float32"):
        x.bfloat16() @ torch.ones(3, 2, device=DEV)


# -----------------------------------------------------------------------------
# The paths


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_and_chunked_prefill(family, check):
    """The model's forward in each GPU config family: a whole prompt (SDPA causal), a left-padded batch
    prefilled in chunks of 8 (a chunk on top of a cache: CausalBias, and the explicit padding mask),
    then a one-token step."""
    model = device_model(**FAMILIES[family])
    cache = KVCache(model.config.num_hidden_layers)
    ids = ids_on(1, 12)
    logits = model(ids, positions=torch.arange(12, device=DEV)[None], cache=cache)
    on_device(logits)
    assert logits.shape == (1, 12, V) and logits.dtype == BF16
    ids, mask = left_padded([21, 14])
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    cache = KVCache(model.config.num_hidden_layers)
    out = ev.prefill(model, model.model.embed_tokens(ids), positions, cache, mask, chunk_size=8)
    cache2 = KVCache(model.config.num_hidden_layers)
    ev.prefill(model, model.model.embed_tokens(ids[:1]), positions[:1], cache2, chunk_size=8)  # no padding
    step = model(ids[:, -1:], positions=positions[:, -1:] + 1, cache=cache)
    on_device(out, step)
    assert_cache_on_device(cache)
    assert_cache_on_device(cache2)
    assert len(cache) == 22 and len(cache2) == 21


@pytest.mark.parametrize("method", list(METHODS))
def test_compress_every_method_then_decode(method, check):
    """compress() with each of the nine methods on a left-padded batch of two prompts (B = 2), prefilled
    in chunks of 16, then three greedy decode steps on the compressed cache; lookahead both one-pass
    and two-pass. Everything it returns stays on the device."""
    model = device_model()
    ids, mask = left_padded([40, 33])
    kw = dict(module=device_module(model.config)) if method == "lookahead" else {}
    if method == "oracle":
        kw["response"] = ids_on(2, 5, seed=3)
    for one_pass in (True, False) if method == "lookahead" else (True,):
        ec = EvictConfig(method, budget=16, window=4, chunk_size=16, options=settings(method, one_pass, 3))
        cache, logits, next_pos = compress_by(model, ids, ec, pad_mask=mask, **kw)[:3]
        on_device(logits, next_pos)
        assert_cache_on_device(cache)
        assert logits.shape == (2, V) and (len(cache) == 40 if method == "full" else len(cache) <= 40)
        n = len(cache)
        tokens = list(decode(model, cache, logits, next_pos, 3))
        on_device(*tokens)
        assert len(tokens) == 3 and len(cache) == n + 2  # the last token is yielded, not fed


@pytest.mark.parametrize("method", ["snapkv", "lookahead"])
def test_span_rule_and_layer_budgets(method, check):
    """The ideas beyond the paper on the device: the span rule (the prefill's hidden states kept chunk by
    chunk, the LM head on the candidate tokens, span_scores) with per-layer budgets, on a left-padded batch
    prefilled in chunks of 16; for lookahead, the rule and weights its .json recommends, asked for by name."""
    model = device_model()
    module = device_module(model.config)
    module.info = dict(rule="span:8", layer_weights=[0.5, 1.5])
    ids, mask = left_padded([40, 33])
    rule, budgets = (SpanRule(8), LayerBudgets([0.5, 1.5])) if method == "snapkv" else adapter_selection(module)
    scorer = make_scorer(EvictConfig(method, budget=16, window=4, chunk_size=16, rule=rule, budgets=budgets), module)
    assert isinstance(scorer.rule, SpanRule)
    cache, logits, next_pos, kept = ev.compress(model, ids, scorer, pad_mask=mask)
    on_device(logits, next_pos, *kept)
    assert_cache_on_device(cache)
    assert [k.shape[-1] for k in kept] == [8, 24]
    on_device(*decode(model, cache, logits, next_pos, 2))


@pytest.mark.parametrize("method", ["streaming", "snapkv", "h2o", "lookahead"])
def test_decode_eviction_and_new_turn(method, check):
    """Beyond the paper, on the device: decoding with DecodeEviction (the cache evicted back to its
    budget every 3 tokens: decode-phase scores, the gather, H2O's running sums), then a new chat turn
    (add_turn: the turn prefilled in chunks with the hook watching, every slot re-scored and evicted)."""
    model = device_model()
    module = device_module(model.config)
    cache, logits, next_pos = compress_by(model, ids_on(1, 30), EvictConfig(method, budget=12, window=4),
                                       module=module if method == "lookahead" else None)[:3]
    evictor = DecodeEviction(make_scorer(EvictConfig(method, 12, window=4), module), every=3, window=4)
    tokens = decode_evicting(model, cache, logits, next_pos, 8, evictor)
    on_device(*tokens)
    assert len(evictor.log) >= 2 and len(cache) <= 12 + 3  # it did evict, more than once
    assert_cache_on_device(cache)
    logits, next_pos = add_turn(model, cache, ids_on(1, 9, seed=4), next_pos + len(tokens), evictor, chunk_size=4)
    on_device(logits, next_pos)
    assert_cache_on_device(cache)
    assert len(cache) == 12


def test_data_stage_answer_and_target_then_save(tmp_path, check):
    """The data stage's batch, as train.py runs it on CUDA (bfloat16 model): three prompts of different
    lengths prefilled together (left padding), greedy answers, the answers' attention over the prompt
    (the target); then each sample written to disk (save_sample: the device-to-host copy)."""
    model = device_model()
    prompts = [torch.randint(1, V, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (20, 13, 17)]
    tok = types.SimpleNamespace(stop_ids=(V - 1,))  # seam 1: the zeros of tolist() are no stop token
    samples = train.answer_and_target(model, tok, prompts, 4)
    L, Hkv, H, D = 2, 2, 4, 16
    for s, p in zip(samples, prompts):
        assert s["response_ids"] == [0] * 4
        on_device(s["k"], s["v"], s["target"])
        assert s["k"].shape == (L, Hkv, len(p), D) and s["target"].shape == (L, H, len(p))
        path = tmp_path / f"{len(p)}.safetensors"
        data.save_sample(path, s, BF16)
        assert data.sample_ok(path)  # a whole file: its header and its length agree


def new_module_on_device(model):
    """train.new_module as train.py calls it (--device cuda, default targets: all seven projections)."""
    return train.new_module(model, dataclasses.replace(train.TrainConfig(), device=str(DEV), n_tokens=8))


def write_samples(tmp_path, lengths, cfg, seed=0):
    """Sample files as the data stage writes them (bfloat16 cache, float32 target), random values."""
    g = torch.Generator().manual_seed(seed)
    L, Hkv, H, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim
    paths = []
    for i, n in enumerate(lengths):
        s = dict(k=torch.randn(L, Hkv, n, D, generator=g), v=torch.randn(L, Hkv, n, D, generator=g),
                 target=torch.rand(L, H, n, generator=g))
        paths.append(tmp_path / f"s{i}.safetensors")
        data.save_sample(paths[-1], s, BF16)
    return paths


def training_step(model, module, opt, paths):
    """train.py's own optimiser step (train.optimizer_step: batch_loss, backward, clip, AdamW) over one
    micro-batch loaded as train.py loads it; then the prediction again, for the checks."""
    cache, gt, lengths = train.get_batch(paths, DEV, model.lm_head.weight.dtype)
    loss = train.optimizer_step(module, opt, model, [(cache, gt, lengths)], len(paths), clip=1.0)
    loss.item()  # train.py logs it: a host read
    with torch.no_grad():
        pred = lookahead_pass(model, module, cache, lengths, per_query_head=True)
    return cache, gt, lengths, pred, loss


def test_training_step(tmp_path, check):
    """One optimiser step of train.py on the device: samples of three lengths from disk (load_batch:
    left-padded into one bfloat16 cache, the padding masked), the M lookahead rows on top with
    gradients (lookahead_pass, per query head), the KL loss, backward into the float32 module (LoRA
    on all seven projections), gradient clipping and AdamW (foreach, as on CUDA)."""
    model = device_model()
    module = new_module_on_device(model)
    params = list(module.parameters())
    on_device(*params)
    assert all(p.dtype == torch.float32 for p in params)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    paths = write_samples(tmp_path, (19, 12, 16), model.config)
    grads = {}  # name -> the gradient's device, as backward made it
    for name, p in module.named_parameters():
        p.register_hook(lambda g, name=name: grads.__setitem__(name, g.device))
    cache, gt, lengths, pred, loss = training_step(model, module, opt, paths)
    assert_cache_on_device(cache)
    on_device(lengths, loss, *gt.values(), *pred.values())
    assert pred[0].shape == (3, 4, 19) and loss.dtype == torch.float32
    # every parameter but the last layer's v/o/MLP LoRA (nothing after them reads their output) got a device gradient
    last = f"lora.{model.config.num_hidden_layers - 1}."
    no_grad = {n for n, _ in module.named_parameters() if n.startswith(last) and not n[len(last):].startswith(("q_", "k_"))}
    assert set(grads) == {n for n, _ in module.named_parameters()} - no_grad and set(grads.values()) == {DEV}
    state = [s for p in params for s in opt.state[p].values()]
    assert state and all(s.device == DEV or s.dim() == 0 for s in state)  # exp_avg(_sq) on it; step: 0-dim
    # --store-dtype none: the step makes the prompt caches itself (train.prompt_cache), left-padded
    assert_cache_on_device(train.prompt_cache(model, [list(range(3, 15)), list(range(2, 21))]))


def test_adapter_round_trip(tmp_path, check):
    """LookaheadModule.save from the device (the device-to-host copy) and .load(device=) back onto it;
    the loaded adapter then scores a prompt on the device."""
    model = device_model()
    module = device_module(model.config)
    module.save(tmp_path / "a.safetensors")
    loaded = LookaheadModule.load(tmp_path / "a.safetensors", model.config, device=DEV)
    on_device(*loaded.parameters())
    assert [(n, p.shape) for n, p in loaded.named_parameters()] == [(n, p.shape) for n, p in module.named_parameters()]
    cache = compress_by(model, ids_on(1, 30), EvictConfig("lookahead", budget=12), module=loaded)[0]
    assert_cache_on_device(cache)


# -----------------------------------------------------------------------------
# Planted failures: the check is real


def test_planted_cpu_index_in_the_eviction_gather(monkeypatch):
    """select() made to return its kept slots on the CPU (as if it ended in .cpu(), or built them with
    torch.arange(C)): meta would take them; the checker stops compress at the cache's gather."""
    select = ev.select
    monkeypatch.setattr(ev, "select", lambda *a, **k: select(*a, **k).to("cpu"))
    model = device_model()
    with OneDevice(), pytest.raises(DeviceMismatch, match=r"aten\.gather.* cpu and meta"):
        compress_by(model, ids_on(1, 30), EvictConfig("snapkv", budget=12, window=4))


class _ArangeOnCPU:
    """A module's view of torch in which torch.arange(..., device=...), called from the function named
    `where`, forgets its device: the bug of a new line written without device=. `fired` counts it."""

    def __init__(self, where):
        self._fn, self.fired = where, 0

    def __getattr__(self, name):
        if name != "arange":
            return getattr(torch, name)

        def arange(*args, device=None, **kwargs):
            if sys._getframe(1).f_code.co_name != self._fn:
                return torch.arange(*args, device=device, **kwargs)
            self.fired += 1
            return torch.arange(*args, **kwargs)

        return arange


def _compress(method, **kw):
    def run(model, module):
        compress_by(model, ids_on(1, 30), EvictConfig(method, budget=12, window=4, **kw),
                 module=module if method == "lookahead" else None)
    return run


def _decode_evicting(model, module):
    cache, logits, next_pos = compress_by(model, ids_on(1, 30), EvictConfig("snapkv", budget=12, window=4))[:3]
    evictor = DecodeEviction(make_scorer(EvictConfig("snapkv", 12, window=4)), every=3, window=4)
    decode_evicting(model, cache, logits, next_pos, 6, evictor)


PLANTS = {  # the function whose torch.arange loses its device -> a path that runs it
    "prompt_positions": (lambda: ev.prompt_positions, _compress("lookahead")),  # the prompt's positions
    "append_rows": (lambda: ev.append_rows, _compress("lookahead")),  # the lookahead rows' positions
    "group_attention": (lambda: ev.group_attention, _compress("snapkv")),  # the window queries' causal mask
    "protect": (lambda: ev.Scorer.protect, _compress("snapkv")),  # the protected window
    "score": (lambda: type(make_scorer(EvictConfig("streaming", 12))).score, _compress("streaming")),  # recency
    "lookahead_pass": (lambda: lk.lookahead_pass, _compress("lookahead", options=dict(one_pass=False))),  # two-pass positions
    "evict": (lambda: DecodeEviction.evict, _decode_evicting),  # the decode-phase slot order / window
}


@pytest.mark.parametrize("where", PLANTS)
def test_planted_arange_without_device(where, monkeypatch):
    """One torch.arange made on the CPU, in the named function only: the path through it fails under
    the checker (DeviceMismatch naming the op and where it ran), though meta alone may run it."""
    fn, run = PLANTS[where]
    fn = inspect.unwrap(fn())
    plant = _ArangeOnCPU(fn.__name__)
    monkeypatch.setattr(sys.modules[fn.__module__], "torch", plant)  # the module that defines it
    model = device_model()
    with OneDevice(), pytest.raises(DeviceMismatch, match="cpu and meta"):
        run(model, device_module(model.config))
    assert plant.fired, f"{fn.__qualname__} no longer calls torch.arange: plant the bug elsewhere"


def test_planted_cpu_tensor_in_the_backward(tmp_path, monkeypatch):
    """A LoRA delta whose forward is clean but whose backward multiplies by a CPU tensor: the training
    step's forward passes, its backward fails under the checker: backward ops are checked too."""

    class CpuInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g @ torch.eye(g.shape[-1], dtype=g.dtype)  # the planted CPU tensor

    delta = LookaheadModule.delta
    monkeypatch.setattr(LookaheadModule, "delta",
                        lambda self, *a: None if (d := delta(self, *a)) is None else CpuInBackward.apply(d))
    model = device_model()
    module = device_module(model.config)
    paths = write_samples(tmp_path, (10, 7), model.config)
    with OneDevice():
        cache, gt, lengths = train.get_batch(paths, DEV, BF16)
        loss = lk.kl_loss(gt, lookahead_pass(model, module, cache, lengths, per_query_head=True))  # forward: fine
        with pytest.raises(DeviceMismatch, match="mm.* cpu and meta"):
            loss.backward()


def test_planted_lora_weights_not_cast_to_the_activations(monkeypatch):
    """LookaheadModule.delta without its .to(x.dtype): harmless in the float32 CPU tests, fatal on CUDA
    where the activations are bf16 and the LoRA float32. The checker stops the lookahead prefill."""

    def delta(self, layer, name, x):
        if name not in self.targets:
            return None
        p = self.lora[layer]
        return (x @ p[name + "_A"].T) @ p[name + "_B"].T * (self.alpha / self.rank)

    monkeypatch.setattr(LookaheadModule, "delta", delta)
    model = device_model()
    with OneDevice(), pytest.raises(DtypeMismatch, match="bfloat16 and torch.float32"):
        compress_by(model, ids_on(1, 30), EvictConfig("lookahead", budget=12), module=device_module(model.config))
