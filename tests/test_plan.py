"""`eaglet plan`: memory estimates per stage, checked against the real drafter and against the
tensors autograd keeps for a tiny TTT step on CPU."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from eaglet import plan
from eaglet.cli import main as cli_main
from eaglet.drafter import DrafterConfig, Eagle3Drafter, num_params
from eaglet.train import batch_sums
from eaglet.train_data import make_batch

REPO = Path(__file__).resolve().parents[1]
GIB = 2 ** 30


def tiny_shape(**over) -> plan.Shape:
    fields = dict(hidden=48, layers=2, heads=6, kv_heads=2, head_dim=8, intermediate=112,
                  vocab=300, draft_vocab=200)
    fields.update(over)
    return plan.Shape("tiny", **fields)


def build(s: plan.Shape, seed: int = 0) -> Eagle3Drafter:
    config = DrafterConfig(
        hidden_size=s.hidden, intermediate_size=s.d_intermediate,
        num_attention_heads=s.d_heads, num_key_value_heads=s.d_kv_heads, head_dim=s.head_dim,
        rms_norm_eps=1e-6, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        max_position_embeddings=4096, vocab_size=s.vocab, draft_vocab_size=s.draft_vocab,
        target_hidden_size=s.hidden, aux_layer_ids=[1, 2, 3])
    torch.manual_seed(seed)
    keep = torch.sort(torch.randperm(s.vocab)[:s.draft_vocab]).values
    t2d = torch.zeros(s.vocab, dtype=torch.bool)
    t2d[keep] = True
    return Eagle3Drafter(config, torch.randn(s.vocab, s.hidden), keep - torch.arange(s.draft_vocab), t2d)


@pytest.mark.parametrize("over", [{}, {"heads": 4, "kv_heads": 4, "head_dim": 16},
                                  {"drafter_intermediate": 64, "draft_vocab": 150}])
def test_drafter_parameter_formula_matches_the_model(over):
    s = tiny_shape(**over)
    assert plan.drafter_params(s) == num_params(build(s))


def test_preset_parameter_counts():
    llama = plan.PRESETS["llama-3.1-8b"]
    assert plan.target_params(llama) == 8_030_261_248            # Llama-3.1-8B's published count
    # fc 3*4096^2 + q 8192*4096 + k,v 2*8192*1024 + o 4096^2 + MLP 3*4096*14336
    # + 4 norms 4*4096 + lm_head 4096*32000
    assert plan.drafter_params(llama) == 424_689_664
    kimi = plan.PRESETS["kimi-k2.5"]
    # fc 3H^2; q, k, v from 2H to 64 x 112 = H each and o_proj: 7H^2; MLP; norms; lm_head
    assert plan.drafter_params(kimi) == (3 * 7168 ** 2 + 7 * 7168 ** 2 + 3 * 7168 * 18432
                                         + 4 * 7168 + 7168 * 32000) == 1_139_568_640
    assert kimi.assumptions  # the numbers that are not from a checkpoint are said


def saved_bytes(s: plan.Shape, tokens: int, steps: int, bf16: bool, attention: str) -> int:
    """Bytes of the tensors autograd keeps for backward in one TTT forward and loss on a
    single sample of ``tokens`` rows, parameters and buffers not counted."""
    model = build(s)
    model.attention = attention
    ids = torch.randint(0, s.vocab, (tokens,))
    piece = ("s", ids, torch.ones(tokens, dtype=torch.uint8), ids.roll(-1),
             torch.randn(tokens, 3 * s.hidden), torch.randn(tokens, s.hidden))
    batch = make_batch([piece], steps, torch.ones(s.vocab, dtype=torch.bool))
    storages: dict[int, int] = {}

    def keep(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    cast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with cast, torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        batch_sums(model, batch, torch.randn(s.draft_vocab, s.hidden))
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    return sum(n for ptr, n in storages.items() if ptr not in own)


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_activation_estimate_matches_what_autograd_keeps(bf16, attention):
    s, tokens, steps = tiny_shape(), 384, 3
    # the drafter pads the fused kernel's head dim by 1 on CPU (8 on CUDA, what plan assumes)
    device = plan.training(s, tokens, tokens, steps, "bfloat16" if bf16 else "float32",
                           attention=attention, sink_pad=1)["device"]
    attention_key = (f"TTT attention scores [heads, n, n] float32, n = {tokens}"
                     if attention == "eager" else
                     "TTT attention, sdpa (kernel inputs and outputs, log-sum-exp; no "
                     "[heads, n, n] scores)")
    estimated = (device["batch inputs and teacher probabilities"]
                 + device[f"TTT activations, {steps} steps (norms, projections, MLP, logits)"]
                 + device[attention_key] + device.get("bf16 autocast weight copies", 0))
    measured = saved_bytes(s, tokens, steps, bf16, attention)
    if attention == "eager":
        assert measured > 10 * 2 ** 20  # the [heads, n, n] scores dominate at this shape
        assert abs(estimated / measured - 1) < (0.03 if not bf16 else 0.06), (estimated, measured)
    else:  # no scores: the estimate of the rest, coarser per tensor, is what is left
        assert measured < 0.5 * saved_bytes(s, tokens, steps, bf16, "eager")
        assert abs(estimated / measured - 1) < 0.12, (estimated, measured)


def test_llama_8b_numbers():
    s = plan.PRESETS["llama-3.1-8b"]
    t = plan.training(s, 8192, 8192, 7, attention="eager")["device"]
    scores = t["TTT attention scores [heads, n, n] float32, n = 8192"]
    # 7 steps x (32 heads x 8192^2 x (4 + 2) bytes + the 8192^2 mask + float32 output)
    assert scores == 7 * (32 * 8192 ** 2 * 6 + 8192 ** 2 + 8192 * 32 * 128 * 4)
    assert round(scores / GIB, 1) == 85.3
    assert t["AdamW states (2 x float32)"] == 8 * 424_689_664
    p = plan.plan(s, tokens=8192, max_len=8192, steps=7, batch_tokens=16384,
                  extract_max_len=8192, target_dtype="bfloat16", store_dtype="bfloat16",
                  shard_tokens=1_000_000)
    assert p["attention"] == "sdpa"  # train.attention auto: the fused kernel
    assert p["training_device"] == p["training_device_fused_attention"]
    assert round(p["training_device"] / GIB, 1) == 41.1
    assert plan.fits(p["training_device"])
    assert round(p["training_device_eager_attention"] / GIB, 1) == 135.0
    assert not plan.fits(p["training_device_eager_attention"])
    eager = plan.plan(s, tokens=8192, max_len=8192, steps=7, batch_tokens=16384,
                      extract_max_len=8192, target_dtype="bfloat16", store_dtype="bfloat16",
                      shard_tokens=1_000_000, attention="eager")
    assert eager["training_device"] == p["training_device_eager_attention"]
    assert p["extraction"]["device"]["target weights"] == 2 * 8_030_261_248
    # + 0.5 GiB: the packed states of the batch whose copy to the host is in flight
    assert round(p["extraction_device"] / GIB, 1) == 19.6
    assert p["shard_bytes_per_token"] == 8 + 1 + 8 + 4 * 4096 * 2
    short = plan.plan(s, tokens=2048, max_len=2048, steps=7, batch_tokens=16384,
                      extract_max_len=2048, target_dtype="bfloat16", store_dtype="fp8",
                      shard_tokens=1_000_000)
    assert round(short["training_device"] / GIB, 1) == 16.5
    assert round(short["training_device_eager_attention"] / GIB, 1) == 21.9
    assert short["shard_bytes_per_token"] == 8 + 1 + 8 + 4 * 4096 + 4 * 4


def test_cli_prints_presets(capsys):
    assert cli_main(["plan", "--preset", "kimi-k2.5", "--tokens", "8192"]) == 0
    out = capsys.readouterr().out
    assert "assumed: drafter layer: 64 heads" in out
    assert "1869.5 GiB  total: does NOT fit one 141 GB GPU" in out        # the 1T target
    assert "training (one rank, train.attention sdpa)" in out
    assert "68.8 GiB  total: fits one 141 GB GPU" in out                  # training, fused
    assert "255.5 GiB  with eager attention instead" in out
    assert "57,361 bytes per token (bfloat16)" in out


def test_plan_of_a_run_reads_its_target(tmp_path, capsys):
    target_dir = tmp_path / "model"
    target_dir.mkdir()
    (target_dir / "config.json").write_text(json.dumps({
        "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 500,
        "tie_word_embeddings": True}))
    results = tmp_path / "results"
    (results / "target").mkdir(parents=True)
    (results / "target" / "target.json").write_text(json.dumps({"path": str(target_dir)}))
    config = tmp_path / "my.yaml"
    config.write_text(f"results_dir: {results}\nvocab: {{draft_vocab_size: 100}}\n"
                      "train: {max_tokens_per_batch: 256, ttt_steps: 2}\n")
    assert plan.main(["--config", str(config), "--workflow", str(REPO), "--json"]) == 0
    [p] = json.loads(capsys.readouterr().out)
    s = tiny_shape(hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                   vocab=500, draft_vocab=100)
    assert p["drafter_params"] == num_params(build(s))
    # tied embeddings: one [V, H] matrix; 4 layers; the final norm
    assert p["target_params"] == 500 * 64 + 4 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 128) + 64
    assert p["tokens_per_batch"] == 256 and p["ttt_steps"] == 2
    assert p["attention"] == "sdpa" and p["training_device"] == p["training_device_fused_attention"]
    config.write_text(config.read_text().replace("ttt_steps: 2", "ttt_steps: 2, attention: eager"))
    assert plan.main(["--config", str(config), "--workflow", str(REPO)]) == 0
    out = capsys.readouterr().out
    assert "training (one rank, train.attention eager)" in out
    assert "TTT attention scores [heads, n, n] float32, n = 256" in out
    assert "with fused attention instead" in out


def test_plan_without_a_prepared_target_says_what_to_do(tmp_path, capsys):
    config = tmp_path / "my.yaml"
    config.write_text(f"results_dir: {tmp_path / 'results'}\n")
    assert plan.main(["--config", str(config), "--workflow", str(REPO)]) == 2
    assert "--preset" in capsys.readouterr().err
