"""bench.py end to end on a tiny random config, on CPU, in seconds: the rows it returns and
prints, not the speed (speed is read from bench.py's ratios, never asserted in a test)."""

import json
import math
import os
from pathlib import Path

import pytest
import torch

from research import bench
from support import cli
from model import ModelConfig, Transformer

TINY = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
BUDGET = 48
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _restore_threads():
    # the runs below use --threads 1: rows are checked, not speed, and 2 threads on a busy machine
    # can be 100x slower (OpenMP barriers); put back what the rest of the session uses
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def run(config, *argv):
    return bench.main(["--random-init", config, "--device", "cpu", "--threads", "1", "--repeats", "1",
                       "--budget", str(BUDGET), *argv])


def kv_bytes(slots, B=1):
    """Bytes of a float32 cache with `slots` per (layer, KV head): keys + values."""
    D = TINY["hidden_size"] // TINY["num_attention_heads"]
    return 2 * TINY["num_hidden_layers"] * B * TINY["num_key_value_heads"] * slots * D * 4


def test_overhead_rows(tiny_config, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rows = run(tiny_config, "--lengths", "64,128", "--json", str(out))
    methods = ["full", "snapkv", "h2o", "laq", "lookahead", "lookahead-shipped", "lookahead-unpooled",
               "lookahead-2pass"]
    assert [(r["method"], r["S"]) for r in rows] == [(m, S) for S in (64, 128) for m in methods]
    for r in rows:
        assert r["prefill_ms"] > 0 and r["total_ms"] > 0
        assert math.isfinite(r["overhead_ms"]) and math.isfinite(r["overhead_pct"])
        # one round: the middle half of the differences is that round's difference
        assert r["overhead_pct_q1"] == pytest.approx(r["overhead_pct"]) == pytest.approx(r["overhead_pct_q3"])
        assert r["full_kv_mib"] * 2**20 == kv_bytes(r["S"])
        if bench.peak_rss_reset():  # Linux: the process's peak RSS during the call
            assert 0.01 < r["peak_gib"] < 64
        if r["method"] == "full":
            assert r["overhead_ms"] == 0 and r["kv_mib"] == r["full_kv_mib"]
        else:  # budget < S: every evicting method keeps exactly C slots; the lookahead rows are gone
            assert r["kv_mib"] * 2**20 == kv_bytes(BUDGET) < kv_bytes(r["S"])
    assert json.loads(out.read_text())["rows"] == rows
    printed = capsys.readouterr().out
    assert "overhead %" in printed and "middle half %" in printed and "fastest %" in printed
    # no adapter for a random model: the untrained module of the shipped configuration, recommending the shipped
    # adapter's rule (lookahead-shipped applies it); the unpooled row is our variant (the paper pools first)
    assert "untrained LookaheadModule (M=32, LoRA q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj r=8)" \
        in printed
    assert "lookahead: rule max:7, C every layer, one pass" in printed  # the paper's form, the default
    assert "lookahead-shipped: rule span:8:1024, C every layer, one pass" in printed  # as the .json recommends
    assert "lookahead-unpooled: rule none, C every layer, one pass" in printed
    assert "lookahead-2pass: rule max:7, C every layer, two passes" in printed


def test_overhead_skips_h2o_above_limit(tiny_config, capsys):
    rows = run(tiny_config, "--lengths", "64,96", "--methods", "snapkv,h2o,full-1chunk", "--h2o-max-len", "64")
    assert [(r["method"], r["S"]) for r in rows] == [
        ("snapkv", 64), ("h2o", 64), ("full-1chunk", 64), ("snapkv", 96), ("full-1chunk", 96)]
    assert "h2o skipped at S = [96]" in capsys.readouterr().out


def test_the_floor_row_runs_m_more_tokens_in_the_last_chunk(tiny_config, monkeypatch):
    """full+M (issue 68): the prompt and its M next tokens (M: the adapter's, here the untrained module's 32), with
    or without a lookahead row in the run; the M rows ride in the last chunk as the lookahead rows do (a prompt of
    several chunks too) and are dropped after: S slots, none evicted. Every other row reads the first S tokens."""
    seen, chunks = [], []
    real_compress, real_model = bench.compress, Transformer.forward
    monkeypatch.setattr(bench, "compress", lambda model, ids, s: seen.append(ids) or real_compress(model, ids, s))
    monkeypatch.setattr(Transformer, "forward", lambda self, *a, **k: chunks.append(
        (k.get("inputs_embeds") if k.get("inputs_embeds") is not None else a[0]).shape[1]) or real_model(self, *a, **k))
    for methods in ("full+M,lookahead", "full+M"):
        seen.clear()
        rows = {r["method"]: r for r in run(tiny_config, "--lengths", "64", "--methods", methods)}
        assert rows["full+M"]["kv_mib"] * 2**20 == kv_bytes(64) and {x.shape[1] for x in seen} == {64}
    chunks.clear()
    run(tiny_config, "--lengths", "80", "--methods", "full+M", "--chunk-size", "64")
    assert {16, 64, 64 + 32} <= set(chunks)  # FullKV's chunks: 16, then 64; full+M's: 16, then 64 + 32


def test_overhead_spread_brackets_the_median(tiny_config):
    """Several rounds: the printed middle half (25th..75th percentile of the rounds' differences) holds the median."""
    [row] = run(tiny_config, "--lengths", "64", "--methods", "snapkv", "--repeats", "4")
    assert row["overhead_pct_q1"] <= row["overhead_pct"] <= row["overhead_pct_q3"]
    assert row["spread"] == f"{row['overhead_pct_q1']:+.1f}..{row['overhead_pct_q3']:+.1f}"
    # fastest: the fastest round of the row against FullKV's, both from the rounds --json keeps
    assert len(row["rounds_ms"]) == len(row["full_rounds_ms"]) == 4
    best = min(row["full_rounds_ms"])
    assert row["fastest_pct"] == pytest.approx(100 * (min(row["rounds_ms"]) - best) / best)


@pytest.mark.parametrize("method", ["snapkv", "lookahead"])
def test_decode_rows(tiny_config, method, capsys):
    rows = run(tiny_config, "--mode", "decode", "--lengths", "64", "--methods", method, "--markdown")
    assert [(r["batch"], r["method"]) for r in rows] == [(1, method), (4, method), (16, method)]
    for r in rows:
        assert r["full_tok_s"] > 0 and r["evicted_tok_s"] > 0
        assert r["speedup"] == pytest.approx(r["evicted_tok_s"] / r["full_tok_s"])
        assert r["kv_mib"] * 2**20 == kv_bytes(BUDGET, r["batch"]) < r["full_kv_mib"] * 2**20
    assert "| method | S | batch | full tok/s |" in capsys.readouterr().out


def test_train_cost_rows(tiny_config):
    rows = run(tiny_config, "--mode", "train-cost", "--lengths", "64")
    assert len(rows) == 1 and rows[0]["S"] == 64
    r = rows[0]
    assert r["efficient_samples_s"] > 0 and r["naive_samples_s"] > 0
    assert r["speedup"] == pytest.approx(r["efficient_samples_s"] / r["naive_samples_s"])
    # the same loss both ways: the prompt rows do not depend on P, so the two-pass form is exact
    assert r["loss_naive"] == pytest.approx(r["loss_efficient"], rel=1e-3, abs=1e-7)


def test_quick_is_cuda_only_and_methods_are_checked():
    with pytest.raises(SystemExit, match="GPU preset"):
        bench.main(["--quick", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--methods oracle"):
        bench.main(["--methods", "snapkv,oracle", "--device", "cpu"])


def test_shipped_configs_have_the_8b_shapes():
    # parameter counts of the real checkpoints (untied heads), counted on meta: nothing allocated
    for name, n_params, qk_norm in (("llama-3.1-8b", 8_030_261_248, False), ("qwen3-8b", 8_190_735_360, True)):
        cfg = ModelConfig.from_hf_config(ROOT / "research" / "configs" / f"{name}.json")
        with torch.device("meta"):
            model = Transformer(cfg)
        assert sum(p.numel() for p in model.parameters()) == n_params
        assert cfg.qk_norm == qk_norm and not cfg.tie_word_embeddings
    assert ModelConfig.from_hf_config(ROOT / "research" / "configs" / "llama-3.1-8b.json").rope_scaling["factor"] == 8.0


def test_untrained_module_is_seeded_and_selects_by_the_shipped_rule(tiny_config):
    import lookaheadkv

    model = bench.random_model(tiny_config, "cpu")
    got = bench.untrained(model)
    torch.manual_seed(bench.SEED)
    want = lookaheadkv.untrained_module(model)
    assert got.targets == lookaheadkv.LookaheadModule.TARGETS and got.n_tokens == 32
    assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(), want.state_dict().values()))
    assert got.info["rule"] == json.loads(bench.SHIPPED.read_text())["rule"]


SMOL = ROOT / "weights" / "SmolLM2-135M-Instruct"


@pytest.mark.skipif(not (SMOL / "config.json").is_file(), reason="the default model is not prepared")
def test_lookahead_rows_use_the_shipped_adapter():
    """Issue 27: by default the lookahead row is what ships (the adapter's rule and per-layer budgets), the
    unpooled row our variant (top C of the raw scores, C in every layer), both with the same adapter."""
    from eviction import Pool, uniform_budgets
    from extensions.layer_budgets import LayerBudgets
    from extensions.span import SpanRule
    from methods import load_adapter
    from model import ModelConfig

    cfg = ModelConfig.from_hf_config(SMOL)
    args = bench.get_args(["--device", "cpu"])
    bench.check_args(args)
    path = bench.adapter_path(cfg, args)
    assert path == ROOT / "weights" / "SmolLM2-135M-Instruct.lookahead.safetensors"
    module = load_adapter(path, cfg)
    scorers = bench.scorers_for(args, module)
    assert list(scorers) == args.methods == ["full", "snapkv", "h2o", "laq", "lookahead", "lookahead-shipped",
                                             "lookahead-unpooled", "lookahead-2pass"]
    paper, unpooled, two_pass = scorers["lookahead"], scorers["lookahead-unpooled"], scorers["lookahead-2pass"]
    assert repr(paper.rule) == "max:7" and paper.eviction.budgets is None  # the paper's form: C in every layer
    assert paper.layer_budgets(30, 1000) == [128] * 30
    shipped = scorers["lookahead-shipped"]  # as the adapter's .json recommends (beyond the paper)
    assert isinstance(shipped.rule, SpanRule) and isinstance(shipped.eviction.budgets, LayerBudgets)
    assert paper.options["one_pass"] and shipped.options["one_pass"] and not two_pass.options["one_pass"]
    assert repr(two_pass.rule) == "max:7"
    assert isinstance(unpooled.rule, Pool) and unpooled.rule.kind == "none"
    assert unpooled.eviction.budgets is uniform_budgets
    assert shipped.module is paper.module is unpooled.module is module


def test_random_model_ties_and_inits(tiny_config):
    model = bench.random_model(tiny_config, "cpu")  # TINY has no tie_word_embeddings: tied by default
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.all(model.model.norm.weight == 1)
    assert 0.015 < model.model.embed_tokens.weight.std().item() < 0.025
    assert not any(p.requires_grad for p in model.parameters())


def test_random_model_too_big_for_the_device_is_one_line(tiny_config, monkeypatch):
    """An 8B shape on a CPU: one error line before any memory is taken, not the kernel's OOM killer."""
    need = bench.random_model(tiny_config, "cpu")
    need = sum(p.numel() * 4 for p in need.parameters()) / 2**30
    monkeypatch.setattr(cli, "free_memory_gib", lambda device: need / 2)
    with pytest.raises(SystemExit, match=r"^error: config's weights take .* GiB free on cpu: .*--device cuda") as e:
        run(tiny_config, "--lengths", "8")
    assert "\n" not in str(e.value)
    monkeypatch.setattr(cli, "free_memory_gib", lambda device: need * 2)  # room: it builds
    built = bench.random_model(tiny_config, "cpu")
    assert sum(p.numel() * 4 for p in built.parameters()) / 2**30 == pytest.approx(need)
    assert cli.free_memory_gib("cpu") is None or cli.free_memory_gib("cpu") > 0


def shrunk(name, tmp_path):
    """research/configs/NAME.json with the width and depth cut down, everything else kept: head_dim 128,
    4 query heads per KV head, llama3 RoPE scaling (Llama) or q/k norms (Qwen3), untied head."""
    cfg = json.loads((ROOT / "research" / "configs" / f"{name}.json").read_text())
    cfg.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=2, head_dim=128, vocab_size=512, eos_token_id=511)  # eos inside the cut vocab
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return path


def test_quick_preset_runs_on_cpu_with_shrunk_8b_shapes(tmp_path, monkeypatch):
    # the CUDA preset's code (its methods, the 8B configs' features, bfloat16, a prompt in several
    # prefill chunks with the lookahead rows riding in the last one) on CPU; only the timer differs
    args = bench.get_args(["--device", "cpu", "--threads", "1", "--dtype", "bfloat16", "--budget", "64",
                           "--chunk-size", "64"])
    bench.check_args(args)
    jobs = bench.quick(args)
    assert [(Path(c).name, n) for c, n in jobs] == [("llama-3.1-8b.json", [8192, 32768]), ("qwen3-8b.json", [8192])]
    args.repeats = 1
    torch.set_num_threads(1)
    jobs = [(shrunk(Path(c).stem, tmp_path), [160, 200]) for c, _ in jobs]  # 3 and 4 chunks of 64
    rows = bench.run(args, jobs)
    methods = ["full-1chunk", "snapkv", "h2o", "laq", "lookahead", "lookahead-unpooled", "lookahead-2pass"]
    assert [(r["model"], r["method"], r["S"]) for r in rows] == [
        (m, x, S) for m in ("llama-3.1-8b", "qwen3-8b") for S in (160, 200) for x in ["full"] + methods]
    for r in rows:
        full_kv = 2 * 2 * 2 * r["S"] * 128 * 2  # K and V, 2 layers, 2 KV heads, head_dim 128, bf16
        assert r["full_kv_mib"] * 2**20 == full_kv
        kept = r["S"] if r["method"].startswith("full") else 64
        assert r["kv_mib"] * 2**20 == full_kv * kept // r["S"]
        assert math.isfinite(r["overhead_pct"])


def test_decode_cost_rows(tiny_config, capsys):
    """Beyond the paper: per-token cost of holding the cache to C_d while decoding, each decode-phase scorer
    against plain decoding over the same cache sizes."""
    rows = run(tiny_config, "--mode", "decode-cost", "--lengths", "40,64", "--every", "4", "--window", "4")
    assert [(r["method"], r["budget"]) for r in rows] == [
        (m, C) for C in (40, 64) for m in ("streaming", "snapkv", "h2o", "lookahead")]
    for r in rows:
        assert r["every"] == 4 and r["periods"] == bench.PERIODS and r["plain_ms_tok"] > 0 and r["ms_tok"] > 0
        assert math.isfinite(r["overhead_ms_tok"]) and r["ms_per_eviction"] == pytest.approx(4 * r["overhead_ms_tok"])
    assert "overhead ms/tok" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="budget 4 is too small for snapkv"):
        run(tiny_config, "--mode", "decode-cost", "--lengths", "4", "--window", "4", "--methods", "snapkv")


def test_overhead_prompts_are_text_when_there_is_a_tokenizer():
    """The span rule's gate reads the LM-head rows of the prompt's distinct tokens, so the overhead rows time a
    prompt of real text (the standard library's source, the same every run), not random ids, which hold about
    as many distinct tokens as tokens; without a tokenizer (--random-init) random ids."""
    from model import ModelConfig
    from support.tokenizer import Tokenizer

    if not (SMOL / "tokenizer.json").exists():
        pytest.skip("run python weights/prepare.py")
    cfg = ModelConfig.from_hf_config(SMOL)
    model = type("M", (), {"lm_head": torch.nn.Linear(1, 1), "config": cfg})()  # text_ids reads these two only
    tok = Tokenizer(SMOL, cfg)
    ids = bench.text_ids(model, tok, 1024)
    assert ids.shape == (1, 1024) and torch.equal(ids, bench.text_ids(model, tok, 1024))
    assert len(ids.unique()) < 512 < len(bench.random_ids(model, 1, 1024).unique())
    assert tok.decode(ids[0, :200].tolist()) in "".join(
        p.read_text() for p in sorted(Path(__import__("argparse").__file__).parent.glob("*.py"))[:3])
    assert bench.text_ids(model, None, 100).shape == (1, 100)


def test_overhead_parts_script_times_every_piece(tiny_config):
    """research/analysis/overhead_parts.py on a tiny random model: every piece timed, the three forms of score + evict."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("overhead_parts", ROOT / "research" / "analysis" / "overhead_parts.py")
    parts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(parts)
    model = bench.random_model(tiny_config, "cpu")
    module = bench.untrained(model)
    full, out = parts.parts(model, None, module, 192, calls=2)  # S > C = 128; no tokenizer: random ids
    assert full > 0 and len(out) == 6 and all(ms > 0 for ms in out.values())
    assert [k for k in out if k.startswith("score + evict")] == [
        "score + evict, the paper's form (max:7)", "score + evict, unpooled (none)",
        f"score + evict, as shipped ({bench.shipped_rule()})"]


def test_json_never_replaces_a_file_of_another_kind(tiny_config, tmp_path):
    """--json may add to an earlier bench.py output, but a file of another kind at that name is refused in one
    line, before anything is timed, and left as it was."""
    theirs = tmp_path / "notes.json"
    theirs.write_text('{"my": "notes"}')
    with pytest.raises(SystemExit, match=r"^error: --json .*notes\.json exists and is not a bench\.py output"):
        run(tiny_config, "--lengths", "8", "--json", str(theirs))
    assert theirs.read_text() == '{"my": "notes"}'
    ours = tmp_path / "ours.json"
    run(tiny_config, "--lengths", "64", "--methods", "snapkv", "--json", str(ours))
    run(tiny_config, "--lengths", "64", "--methods", "snapkv", "--json", str(ours))  # its own output: added to
    assert [r["method"] for r in json.loads(ours.read_text())["rows"]] == ["snapkv", "snapkv"]


# -----------------------------------------------------------------------------
# Issue 53: bad inputs refused before any model is built or loaded


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if a model is built (--random-init) or loaded (a checkpoint)."""
    def fail(*a, **k):
        pytest.fail("a model was built or loaded before the check")
    monkeypatch.setattr(bench, "random_model", fail)
    monkeypatch.setattr(cli, "load", fail)


@pytest.mark.parametrize("extra, message", [
    (["--lengths", "100000"], r"--lengths 100000 \+ 32 lookahead rows = 100032 positions, past config's context of "
                              r"1024 \(max_position_embeddings in its config.json\): use lengths up to 992$"),
    (["--lengths", "64,993"], r"--lengths 993 \+ 32 lookahead rows = 1025 positions"),  # the M rows count too
    (["--lengths", "1025", "--methods", "snapkv"], r"--lengths 1025 = 1025 positions, past config's context"),
    (["--mode", "decode", "--lengths", "1000", "--methods", "snapkv"], r"--lengths 1000 \+ 32 decode steps"),
    (["--mode", "train-cost", "--lengths", "900"], r"--lengths 900 \+ 128 answer tokens or lookahead rows = 1028"),
    (["--mode", "decode-cost", "--lengths", "64,900", "--every", "32", "--window", "4"],
     r"--lengths \(the decode budgets C_d\) 900 \+ 128 decode steps \(4 x --every\) \+ 32 lookahead rows = 1060"),
], ids=["100k", "lookahead-rows", "no-lookahead", "decode", "train-cost", "decode-cost"])
def test_lengths_past_the_context_are_refused_before_the_model_is_built(tiny_config, no_model, extra, message):
    """Issue 53: --lengths 100000 on a 1024-position config started the prefill and ran until killed. Each length,
    with what the mode appends after it (lookahead rows, decode steps, train-cost's answer), is checked against
    config.json's max_position_embeddings before the model is built."""
    with pytest.raises(SystemExit, match="^error: " + message) as e:
        run(tiny_config, *extra)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=message):  # by check_args, with every other flag's check
        bench.check_args(bench.get_args(["--random-init", tiny_config, "--device", "cpu", *extra]))


def test_lengths_that_fit_the_context_pass(tiny_config):
    """The bound is the context itself: a length that with its appended positions fills it exactly passes."""
    for extra in (["--lengths", "992"], ["--lengths", "1024", "--methods", "snapkv,h2o"],
                  ["--mode", "decode-cost", "--lengths", "976", "--every", "4", "--window", "4"]):
        bench.check_args(bench.get_args(["--random-init", tiny_config, "--device", "cpu", *extra]))


def test_a_checkpoint_s_lengths_are_checked_from_its_config_json(tmp_path, no_model):
    """--model: config.json is read before the weights (none here: loading would fail otherwise); run() checks
    again, for the default model that is prepared only when it loads."""
    folder = tmp_path / "tiny-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY))
    for mode in ("overhead", "prefill-vs-hf"):
        with pytest.raises(SystemExit, match=r"^error: --lengths 2048 .*past tiny-model's context of 1024"):
            bench.main(["--model", str(folder), "--mode", mode, "--lengths", "2048", "--device", "cpu",
                        "--methods", "snapkv"])
    args = bench.get_args(["--model", str(folder), "--lengths", "64", "--methods", "snapkv", "--device", "cpu"])
    bench.check_args(args)
    with pytest.raises(ValueError, match=r"--lengths 4096 = 4096 positions, past tiny-model's context of 1024"):
        bench.run(args, [(None, [4096])])


@pytest.mark.parametrize("flag, message", [
    ("--threads", r"--threads 0: must be at least 1$"),
    ("--h2o-max-len", r"--h2o-max-len 0: must be at least 1 \(h2o is skipped above this prompt length\); to leave "
                      r"h2o out altogether, drop it from --methods$"),
], ids=["threads", "h2o-max-len"])
def test_threads_and_h2o_max_len_below_1_are_refused(tiny_config, no_model, flag, message):
    """Issue 53: --threads 0 ran on torch's default threads without a word, --h2o-max-len 0 was ignored (0 is
    falsy): h2o would be skipped at every length, which is what dropping it from --methods says."""
    for value in ("0", "-2"):
        with pytest.raises(SystemExit, match="^error: " + message.replace("0", value, 1)):
            run(tiny_config, "--lengths", "64", flag, value)


def test_json_keeps_the_rows_of_every_run_and_is_replaced_whole(tiny_config, tmp_path, monkeypatch):
    """Issue 53: a second run on one --json lost the first run's rows. Each row is added to what the file holds
    (each saying its torch), written to a temporary file that replaces it: a write that fails leaves it whole."""
    out = tmp_path / "bench.json"
    first = run(tiny_config, "--lengths", "64", "--methods", "snapkv", "--json", str(out))
    second = run(tiny_config, "--lengths", "48", "--methods", "h2o", "--json", str(out))
    saved = json.loads(out.read_text())
    assert saved["rows"] == first + second and [(r["method"], r["S"]) for r in saved["rows"]] == [
        ("snapkv", 64), ("h2o", 48)]
    assert all(r["torch"] == torch.__version__ for r in saved["rows"])
    before = out.read_text()

    def replace_fails(src, dst):
        assert Path(dst) == out and Path(src) != out and Path(src).parent == out.parent
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(bench.os, "replace", replace_fails)
    with pytest.raises(SystemExit, match="No space left on device"):
        run(tiny_config, "--lengths", "32", "--methods", "snapkv", "--json", str(out))
    assert out.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "config.json"]


def test_prefill_vs_hf_runs_both_sides_on_the_same_random_weights(tiny_config, tmp_path):
    """--random-init in prefill-vs-hf (issue 78): ours is built from the config, saved once as an HF folder, and
    transformers loads that folder, so both run the very same weights: their last-token logits agree to float32
    rounding (REORDER_ATOL: ~20 operations deep, sums of up to 128 terms), a ratio and both peaks are printed."""
    from tests.conftest import REORDER_ATOL

    rows = bench.main(["--random-init", tiny_config, "--mode", "prefill-vs-hf", "--lengths", "64", "--device", "cpu",
                       "--threads", "1", "--repeats", "1", "--json", str(tmp_path / "b.json")])
    (row,) = rows
    assert row["S"] == 64 and row["ratio"] > 0
    assert row["logits_diff"] < REORDER_ATOL * 10  # random std-0.02 weights: logits ~1e-2, so far inside
    if bench.peak_rss_reset():  # Linux: the process's peak memory during each side's calls
        assert row["ours_peak_gib"] > 0 and row["hf_peak_gib"] > 0


def allocating_call(mib, parent_pid):
    """child_memory's maker in the test below: a call that holds `mib` MiB at once, and says where it ran."""
    def call():
        assert os.getpid() != parent_pid, "measured in the caller's process, whose heap decides what a call adds"
        x = torch.ones(mib << 18)  # float32: mib MiB, every page written
        return x.sum()
    return call


def test_child_memory_reads_a_calls_own_allocation_in_a_process_of_its_own():
    """prefill-vs-hf's memory (issue 78): each side's call measured in a fresh process, so the timing rounds' heap
    cannot decide what it adds (the same 8K prefill read 0.60 and 1.04 GiB added in-process). A call that holds
    64 MiB (every page written before it returns) adds that, give or take what else the call allocates or frees:
    its Python frame, the tensor's header and the scalar it returns, a few pages, far under the 1 MiB allowed."""
    if not bench.peak_rss_reset():
        pytest.skip("no /proc peak-RSS reset here (not Linux)")
    peak, added = bench.child_memory(allocating_call, 64, os.getpid())
    assert abs(added - 64 / 1024) <= 1 / 1024 and peak >= added
