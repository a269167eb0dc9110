"""`eaglet plan`: memory estimates per stage, checked against the real drafter and against the
tensors autograd keeps for a tiny TTT step on CPU."""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch

from eaglet.core import gpus, methods
from eaglet.model import sizes
from eaglet.model.config import DrafterConfig
from eaglet.model.drafter import Eagle3Drafter, num_params
from eaglet.model.methods import make_drafter
from eaglet.stages.train.data import make_batch
from eaglet.stages.train.step import batch_sums
from eaglet.target.checkpoint import TEACHER_CHUNK_ROWS
from eaglet.tools import memory_plan, plan
from eaglet.tools.cli import main as cli_main
from tests.helpers.paths import REPO, STANDINS

GIB = 2**30


def tiny_shape(**over) -> sizes.Shape:
    fields = dict(
        hidden=48,
        layers=2,
        heads=6,
        kv_heads=2,
        head_dim=8,
        intermediate=112,
        vocab=300,
        draft_vocab=200,
    )
    fields.update(over)
    return sizes.Shape("tiny", **fields)


# a tiny target with multi-head latent attention; v_head_dim = qk_nope + qk_rope, so that
# PyTorch's fused CPU kernel takes it (with unequal head sizes it computes the plain math)
TINY_MLA = dict(
    q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24
)


def tiny_mla_shape(**over) -> sizes.Shape:
    return tiny_shape(kv_heads=6, **{**TINY_MLA, "drafter_attention": "mla", **over})


def build(s: sizes.Shape, seed: int = 0) -> Eagle3Drafter:
    mla = {}
    if s.mla:
        mla = dict(
            attention_kind="mla",
            q_lora_rank=s.q_lora_rank,
            kv_lora_rank=s.kv_lora_rank,
            qk_nope_head_dim=s.qk_nope_head_dim,
            qk_rope_head_dim=s.qk_rope_head_dim,
            v_head_dim=s.v_head_dim,
        )
    config = DrafterConfig(
        hidden_size=s.hidden,
        intermediate_size=s.d_intermediate,
        num_attention_heads=s.d_heads,
        num_key_value_heads=s.d_kv_heads,
        head_dim=s.d_qk_dim,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        max_position_embeddings=4096,
        vocab_size=s.vocab,
        draft_vocab_size=s.draft_vocab,
        target_hidden_size=s.hidden,
        aux_layer_ids=[1, 2, 3],
        **mla,
    )
    torch.manual_seed(seed)
    keep = torch.sort(torch.randperm(s.vocab)[: s.draft_vocab]).values
    t2d = torch.zeros(s.vocab, dtype=torch.bool)
    t2d[keep] = True
    return Eagle3Drafter(
        config, torch.randn(s.vocab, s.hidden), keep - torch.arange(s.draft_vocab), t2d
    )


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"heads": 4, "kv_heads": 4, "head_dim": 16},
        {"drafter_intermediate": 64, "draft_vocab": 150},
    ],
)
def test_drafter_parameter_formula_matches_the_model(over):
    s = tiny_shape(**over)
    assert sizes.drafter_params(s) == num_params(build(s))


def test_preset_parameter_counts():
    llama = sizes.PRESETS["llama-3.1-8b"]
    assert sizes.target_params(llama) == 8_030_261_248  # Llama-3.1-8B's published count
    # fc 3*4096^2 + q 8192*4096 + k,v 2*8192*1024 + o 4096^2 + MLP 3*4096*14336
    # + 4 norms 4*4096 + lm_head 4096*32000
    assert sizes.drafter_params(llama) == 424_689_664
    kimi = sizes.PRESETS["kimi-k2.5"]
    # fc 3H^2; q, k, v from 2H to 64 x 112 = H each and o_proj: 7H^2; MLP; norms; lm_head
    assert (
        sizes.drafter_params(kimi)
        == (3 * 7168**2 + 7 * 7168**2 + 3 * 7168 * 18432 + 4 * 7168 + 7168 * 32000)
        == 1_139_568_640
    )
    assert kimi.assumptions  # the numbers that are not from a checkpoint are said
    # with train.drafter_attention mla: q_a from 2H to 1536, its norm, q_b to 64 heads of
    # 128 + 64; kv_a from 2H to 512 + 64, its norm, kv_b to 64 x (128 + 128); o_proj 64 x 128
    h = 7168
    mla = 2 * h * 1536 + 1536 + 1536 * 64 * 192 + 2 * h * 576 + 512 + 512 * 64 * 256 + 64 * 128 * h
    assert sizes.drafter_params(sizes.with_drafter(kimi, "mla")) == (
        3 * h * h + mla + 3 * h * 18432 + 4 * h + h * 32000
    )
    # the target: embedding and lm_head; 61 MLA layers (q_a, q_b, kv_a, kv_b, o_proj and
    # their norms) with two norms each; one dense MLP; 60 MoE layers of 384 routed and one
    # shared expert of width 2048 and a router; the final norm
    attention = h * 1536 + 1536 + 1536 * 64 * 192 + h * 576 + 512 + 512 * 64 * 256 + 64 * 128 * h
    routed = 60 * 384 * 3 * h * 2048
    total = (
        2 * 163840 * h
        + 61 * (attention + 2 * h)
        + 3 * h * 18432
        + 60 * (3 * h * 2048 + 384 * h)
        + routed
        + h
    )
    assert sizes.target_params(kimi) == total
    assert 1.0e12 < total < 1.05e12  # "1T parameters"
    # served: INT4 experts (half a byte a weight and a bfloat16 scale a group of 32), the rest
    # in bfloat16: the hub checkpoint's 554 GiB (594 GB)
    split, whole = sizes.serving_weights(kimi, "bfloat16")
    assert split + whole == routed // 2 + routed // 32 * 2 + 2 * (total - routed)
    assert round((split + whole) / GIB) == 553 and round((split + whole) / 1e9) == 594
    # every rank holds MLA's q_a/kv_a projections, the routers and the norms whole
    assert whole == 2 * (61 * (h * 1536 + 1536 + h * 576 + 512 + 2 * h) + 60 * 384 * h + h)


def saved_bytes(
    s: sizes.Shape, tokens: int, steps: int, bf16: bool, attention: str, fused: bool = False
) -> int:
    """Bytes of the tensors autograd keeps for backward in one TTT forward and loss on a
    single sample of ``tokens`` rows, parameters and buffers not counted."""
    model = build(s)
    model.attention = attention
    ids = torch.randint(0, s.vocab, (tokens,))
    piece = (
        "s",
        ids,
        torch.ones(tokens, dtype=torch.uint8),
        ids.roll(-1),
        torch.randn(tokens, 3 * s.hidden),
        torch.randn(tokens, s.hidden),
    )
    batch = make_batch([piece], steps, torch.ones(s.vocab, dtype=torch.bool))
    storages: dict[int, int] = {}

    def keep(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    cast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with cast, torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        batch_sums(model, batch, torch.randn(s.draft_vocab, s.hidden), fused=fused)
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    return sum(n for ptr, n in storages.items() if ptr not in own)


@pytest.mark.parametrize("fused", [False, True], ids=["autograd loss", "fused loss"])
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", ["llama", "mla"])
def test_activation_estimate_matches_what_autograd_keeps(bf16, attention, kind, fused):
    # MLA's projections keep more a row: more rows, so that the eager scores dominate again
    s, tokens, steps = (tiny_shape(), 384, 3) if kind == "llama" else (tiny_mla_shape(), 640, 3)
    # the drafter pads the fused kernel's head dim by 1 on CPU (8 on CUDA, what plan assumes)
    device = memory_plan.training(
        s,
        tokens,
        tokens,
        steps,
        "bfloat16" if bf16 else "float32",
        attention=attention,
        sink_pad=1,
        fused_loss=fused,
    )["device"]
    attention_key = (
        f"TTT attention scores [heads, n, n] float32, n = {tokens}"
        if attention == "eager"
        else "TTT attention, sdpa (kernel inputs and outputs, log-sum-exp; no [heads, n, n] scores)"
    )
    estimated = (
        device["batch inputs and the teacher"]
        + device[f"TTT activations, {steps} steps (norms, projections, MLP, logits)"]
        + device[attention_key]
        + device.get("bf16 autocast weight copies", 0)
    )
    if fused:  # the teacher's logits: alive through the step, but no tensor autograd keeps
        estimated -= tokens * (s.draft_vocab * (2 if bf16 else 4) + 4)
    measured = saved_bytes(s, tokens, steps, bf16, attention, fused)
    if attention == "eager":
        assert measured > 10 * 2**20  # the [heads, n, n] scores dominate at this shape
        assert abs(estimated / measured - 1) < (0.03 if not bf16 else 0.06), (estimated, measured)
    else:  # no scores: the estimate of the rest, coarser per tensor, is what is left
        assert measured < 0.5 * saved_bytes(s, tokens, steps, bf16, "eager")
        assert abs(estimated / measured - 1) < 0.12, (estimated, measured)


def test_llama_8b_numbers():
    s = sizes.PRESETS["llama-3.1-8b"]
    t = memory_plan.training(s, 8192, 8192, 7, attention="eager")["device"]
    scores = t["TTT attention scores [heads, n, n] float32, n = 8192"]
    # 7 steps x (32 heads x 8192^2 x (4 + 2) bytes + the 8192^2 mask + float32 output)
    assert scores == 7 * (32 * 8192**2 * 6 + 8192**2 + 8192 * 32 * 128 * 4)
    assert round(scores / GIB, 1) == 85.3
    assert t["AdamW states (2 x float32)"] == 8 * 424_689_664
    p = memory_plan.plan(
        s,
        tokens=8192,
        max_len=8192,
        steps=7,
        batch_tokens=16384,
        extract_max_len=8192,
        target_dtype="bfloat16",
        store_dtype="bfloat16",
        shard_tokens=1_000_000,
    )
    assert p["attention"] == "sdpa"  # train.attention auto: the fused kernel
    assert p["training_device"] == p["training_device_fused_attention"]
    # the loss fused with lm_head (train.fused_loss, the default) keeps no float32 logits
    assert round(p["training_device"] / GIB, 1) == 31.7
    unfused = memory_plan.plan(
        s,
        tokens=8192,
        max_len=8192,
        steps=7,
        batch_tokens=16384,
        extract_max_len=8192,
        target_dtype="bfloat16",
        store_dtype="bfloat16",
        shard_tokens=1_000_000,
        fused_loss=False,
    )
    assert round(unfused["training_device"] / GIB, 1) == 41.1
    assert memory_plan.fits(p["training_device"])
    assert round(p["training_device_eager_attention"] / GIB, 1) == 125.6
    assert not memory_plan.fits(unfused["training_device_eager_attention"])  # 135.0 GiB
    eager = memory_plan.plan(
        s,
        tokens=8192,
        max_len=8192,
        steps=7,
        batch_tokens=16384,
        extract_max_len=8192,
        target_dtype="bfloat16",
        store_dtype="bfloat16",
        shard_tokens=1_000_000,
        attention="eager",
    )
    assert eager["training_device"] == p["training_device_eager_attention"]
    assert p["extraction"]["device"]["target weights"] == 2 * 8_030_261_248
    # + 0.5 GiB: the stored states of the batch whose copy to the host is in flight, and the
    # batch's final states in float32 for the teacher check
    assert round(p["extraction_device"] / GIB, 1) == 19.7
    assert p["shard_bytes_per_token"] == 8 + 1 + 8 + 4 * 4096 * 2
    short = memory_plan.plan(
        s,
        tokens=2048,
        max_len=2048,
        steps=7,
        batch_tokens=16384,
        extract_max_len=2048,
        target_dtype="bfloat16",
        store_dtype="fp8",
        shard_tokens=1_000_000,
    )
    assert round(short["training_device"] / GIB, 1) == 14.8
    assert round(short["training_device_eager_attention"] / GIB, 1) == 20.2
    assert short["shard_bytes_per_token"] == 8 + 1 + 8 + 4 * 4096 + 4 * 4


def test_cli_prints_presets(capsys):
    assert cli_main(["plan", "--preset", "kimi-k2.5", "--max-tokens-per-batch", "8192"]) == 0
    out = capsys.readouterr().out
    assert "assumed: drafter layer, train.drafter_attention llama: 64 heads" in out
    kimi = sizes.PRESETS["kimi-k2.5"]
    # the hf backend holds the whole target in bfloat16: more than one GPU
    weights = 2 * sizes.target_params(kimi)
    assert f"{plan.gib(weights):>11}  target weights" in out
    assert "total: does NOT fit one 141 GB GPU" in out
    assert "training (one rank, train.attention sdpa)" in out
    assert "59.7 GiB  total: fits one 141 GB GPU" in out  # training, fused
    assert "246.4 GiB  with eager attention instead" in out
    assert "57,361 bytes per token (bfloat16)" in out
    # the drafter eaglet builds for train.drafter_attention llama, and the MLA one beside it
    assert (
        f"drafter {sizes.drafter_params(kimi) / 1e6:.1f}M trainable (train.drafter_attention "
        f"llama, drafter_variant eagle3, method eagle3)"
    ) in out
    mla = sizes.drafter_params(sizes.with_drafter(kimi, "mla"))
    assert f"with train.drafter_attention mla instead: drafter {mla / 1e6:.1f}M" in out
    assert "--tokens N for N training tokens" in out  # no dataset named
    assert "one H200" in out and "one B200" in out
    assert (
        cli_main(
            [
                "plan",
                "--preset",
                "kimi-k2.5",
                "--drafter-attention",
                "mla",
                "--max-tokens-per-batch",
                "2048",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"drafter {mla / 1e6:.1f}M trainable (train.drafter_attention mla," in out
    assert cli_main(["plan", "--preset", "llama-3.1-8b", "--drafter-attention", "mla"]) == 2
    assert "--drafter-attention llama" in capsys.readouterr().err  # no MLA to take


def test_issue_command_prints_the_disk_of_each_training_data_mode(capsys):
    """`eaglet plan --preset kimi-k2.5 --tokens 100000000`: 100M training tokens at the
    schema's defaults (bf16 shards, 4 shards, a tenth of the samples held out)."""
    assert cli_main(["plan", "--preset", "kimi-k2.5", "--tokens", "100000000", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert [p["tokens_per_batch"] for p in plans] == [2048, 8192]
    h, train, heldout = 7168, 100_000_000, round(100_000_000 * 0.1 / 0.9)
    shard = 8 + 1 + 8 + 4 * h * 2  # ids, mask, argmax, 3 aux + final states in bf16
    request = 4 * h * 2 + 8  # the capture file: 4 layers in bf16, an int64 id
    for p in plans:
        disk = p["disk"]
        assert (disk["train_tokens"], disk["heldout_tokens"]) == (train, heldout)
        # shards: all shards, and the request files of the shard being packed and of the
        # next (25M tokens each)
        assert disk["shards"]["peak"] == (train + heldout) * shard + 2 * train // 4 * request
        # stream: the held-out shard, and its request files (more than the window's)
        window = 2 * 16 * p["tokens_per_batch"]  # twice extract.concurrency, longest samples
        assert disk["window_tokens"] == window < heldout
        assert disk["stream"]["peak"] == heldout * shard + heldout * request
        assert p["colocation"]["ranks"] == 8
        assert set(p["colocation"]["devices"]) == {"H200", "B200"}
    assert round(plans[0]["disk"]["shards"]["stored"] * train / (train + heldout) / 1e12, 1) == 5.7
    assert cli_main(["plan", "--preset", "kimi-k2.5", "--tokens", "100000000"]) == 0
    out = capsys.readouterr().out
    shards_peak = plans[1]["disk"]["shards"]["peak"]
    assert f"train.data shards {plan.size(shards_peak):>24} at the peak" in out
    assert "train.data stream" in out and "of shards mode" in out
    assert "capture server and trainer on the same 8 GPUs" in out
    assert "hold this memory at once and take turns computing (train.stream_overlap auto)" in out
    # 11M held-out tokens are most of stream mode's disk and 111 times what its figures need
    assert "The held-out split is most of it" in out and "111 times smaller" in out
    assert cli_main(["plan", "--preset", "kimi-k2.5", "--tokens", "5000000"]) == 0
    assert "The held-out split is most of it" not in capsys.readouterr().out  # 0.56M: no hint


def test_dataset_disk_of_both_modes():
    s = tiny_shape(hidden=40)
    train, heldout, shards, window = 10_000, 900, 4, 3 * 2 * 256
    bf16 = 8 + 1 + 8 + 4 * 40 * 2  # a shard's token: ids, mask, argmax, 4 states
    fp8 = 8 + 1 + 8 + 4 * 40 + 4 * 4  # fp8 states and a float32 scale each
    request = 4 * 40 * 4 + 8  # served in float32: 4 layers, an int64 id
    d = memory_plan.dataset_disk(
        s,
        train_tokens=train,
        heldout_tokens=heldout,
        store_dtype="bfloat16",
        serving_dtype="float32",
        num_shards=shards,
        capture_during_generation=False,
        window_tokens=window,
    )
    assert d["shards"]["stored"] == (train + heldout) * bf16
    # packed shard by shard, the server a shard ahead: two shards' (2,500 tokens each)
    # request files on top
    assert d["shards"]["peak"] == (train + heldout) * bf16 + 2 * 2500 * request
    # stream: the held-out shard, and the larger of its request files and the window
    assert d["stream"]["peak"] == heldout * bf16 + max(heldout, window) * request
    # generation captured every sample: all request files wait, the first shard beside them
    c = memory_plan.dataset_disk(
        s,
        train_tokens=train,
        heldout_tokens=heldout,
        store_dtype="fp8",
        serving_dtype="float32",
        num_shards=shards,
        capture_during_generation=True,
        window_tokens=window,
    )
    assert c["shards"]["peak"] == (train + heldout) * request + 2500 * fp8
    assert c["shards"]["stored"] == (train + heldout) * fp8
    # the vllm backend packs the largest shard in host memory: a training one (2,500) here
    assert d["packing_host_bytes"] == 2500 * request


def test_a_held_out_split_in_shards_of_its_own_is_packed_a_shard_at_a_time():
    """extract.num_eval_shards: the held-out split in shards of its own size, so the largest
    shard (what extraction holds in host memory) and stream mode's window of held-out
    request files (two shards') shrink with their number."""
    s = tiny_shape(hidden=40)
    request = 4 * 40 * 4 + 8
    for count, largest in ((1, 9_000), (3, 3_000), (9, 2_500)):  # 2,500: a training shard
        d = memory_plan.dataset_disk(
            s,
            train_tokens=10_000,
            heldout_tokens=9_000,
            store_dtype="bfloat16",
            serving_dtype="float32",
            num_shards=4,
            capture_during_generation=False,
            window_tokens=100,
            num_eval_shards=count,
        )
        assert d["heldout_shard_tokens"] == 9_000 // count
        assert d["packing_host_bytes"] == largest * request
        assert d["stream"]["peak_requests"] == min(count, 2) * (9_000 // count) * request


@pytest.mark.subprocess  # the connector's path runs `file -b` (platform.architecture)
def test_request_file_bytes_are_what_the_connector_writes(tmp_path):
    """A capture request file holds request_bytes_per_token a token, beside its header."""
    from eaglet.engine.connector import write_states

    s, tokens = tiny_shape(hidden=40), 37
    path = tmp_path / "r.safetensors"
    # as vLLM hands them over: the cache's [tokens, layers, H] and torch.tensor(prompt ids)
    write_states(
        torch.zeros(tokens, 4, 40, dtype=torch.bfloat16),
        torch.tensor(list(range(tokens))),
        str(path),
    )
    data = path.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    assert len(data) - header == tokens * memory_plan.request_bytes_per_token(s, "bfloat16")


def test_server_and_trainer_fit_together_where_the_gpu_holds_both():
    # MLA and 8 experts of INT4 (a bfloat16 scale a group of 16) in 3 of 4 layers
    s = tiny_mla_shape(
        hidden=64,
        layers=4,
        vocab=500,
        draft_vocab=100,
        experts=8,
        expert_intermediate=32,
        shared_experts=1,
        dense_layers=1,
        expert_bits=4,
        expert_group=16,
        drafter_attention="llama",
    )
    h, ranks = 64, 4
    routed = 3 * 8 * 3 * h * 32
    q_a, kv_a = h * 24 + 24, h * (32 + 8) + 32  # replicated, with their norms
    attention = q_a + kv_a + 24 * 6 * 24 + 32 * 6 * (16 + 24) + 6 * 24 * h
    total = (
        2 * 500 * h + 4 * (attention + 2 * h) + 3 * h * 112 + 3 * (h * 32 * 3 + 8 * h) + routed + h
    )
    assert sizes.target_params(s) == total
    whole = 2 * (4 * (q_a + kv_a + 2 * h) + 3 * 8 * h + h)
    split = 2 * (total - routed) - whole + routed // 2 + routed // 16 * 2
    p = memory_plan.plan(
        s,
        tokens=256,
        max_len=256,
        steps=3,
        batch_tokens=1024,
        extract_max_len=256,
        target_dtype="bfloat16",
        store_dtype="bfloat16",
        shard_tokens=10_000,
        ranks=ranks,
        kv_tokens=2 * 256,
    )
    c = p["colocation"]
    assert c["server"]["weights"] == split // ranks + whole
    # a token's cache: MLA's latent and rope key of 4 layers, and 4 captured states
    assert c["server"]["kv_cache"] == 2 * 256 * (4 * (32 + 8) * 2 + 4 * h * 2)
    server = split // ranks + whole + c["server"]["kv_cache"] + memory_plan.SERVER_ALLOWANCE
    # a rank trains and runs the teacher check of the streamed states: the full lm_head (bf16)
    # and a chunk of rows' logits (bf16, their float32 copy, float32 log-probabilities)
    assert c["teacher_check"] == 500 * h * 2 + TEACHER_CHUNK_ROWS * 500 * (2 + 4 + 4)
    rank = p["training_device"] + c["teacher_check"]
    assert c["total"] == server + rank
    # the verdict turns where a GPU's usable share (95%) holds both, and not a byte before
    edge = math.ceil(c["total"] / gpus.GPU_USABLE)
    verdicts = memory_plan.colocation(server, rank, {"less": edge - 2, "enough": edge + 1})
    assert not verdicts["less"]["fits"] and verdicts["enough"]["fits"]
    # a configured KV cache size replaces the tokens' count
    sized = memory_plan.plan(
        s,
        tokens=256,
        max_len=256,
        steps=3,
        batch_tokens=1024,
        extract_max_len=256,
        target_dtype="bfloat16",
        store_dtype="bfloat16",
        shard_tokens=10_000,
        ranks=ranks,
        kv_cache_bytes=3 * GIB,
    )
    assert sized["colocation"]["server"]["kv_cache"] == 3 * GIB


def test_mla_drafter_size_is_the_model_drafter_py_builds():
    """For an MLA target with train.drafter_attention mla, the plan counts the drafter that
    ``DrafterConfig.from_target`` and ``Eagle3Drafter`` build for it."""
    target = {
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 500,
        "q_lora_rank": 16,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 4,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "config_groups": {
                "group_0": {"weights": {"type": "int", "num_bits": 4, "group_size": 32}}
            },
        },
    }
    config = DrafterConfig.from_target(target, 100, [1, 2, 3], attention="mla")
    keep = torch.arange(100)
    t2d = torch.zeros(500, dtype=torch.bool)
    t2d[keep] = True
    model = Eagle3Drafter(config, torch.randn(500, 64), keep - keep, t2d)
    s = sizes.shape_from_target_config(target, 100, "tiny", drafter_attention="mla")
    assert sizes.drafter_params(s) == sum(p.numel() for p in model.parameters())
    assert (s.expert_bits, s.expert_group) == (4, 32)
    llama = sizes.shape_from_target_config(target, 100, "tiny")
    assert sizes.drafter_params(llama) == sum(p.numel() for p in build(llama).parameters())
    with pytest.raises(ValueError, match="drafter-attention llama"):
        sizes.shape_from_target_config({**target, "kv_lora_rank": None}, 100, "t", "mla")


# every build of every method: the settings its record takes (refusals: test_method_records)
KINDS = [
    (attention, variant, m.name)
    for m in methods.METHODS.values()
    for attention in m.attentions
    for variant in m.variants
]


@pytest.mark.parametrize("attention,variant,method", KINDS)
def test_drafter_size_counts_every_weight_of_each_method_and_variant(attention, variant, method):
    """The plan counts the parameters of the drafter train.py builds (``from_target`` and
    ``make_drafter``) for each train.drafter_attention, drafter_variant and method: EAGLE-3.1's
    fc_norm, P-EAGLE's mask_hidden and DFlash's layers (two here) and mask embedding included."""
    target = {
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 500,
        "bos_token_id": 1,
        "q_lora_rank": 16,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
    }
    config = DrafterConfig.from_target(target, 100, [1, 2, 3], attention, variant)
    keep = torch.arange(100)
    t2d = torch.zeros(500, dtype=torch.bool)
    t2d[keep] = True
    layers = 2 if method == "dflash" else 1
    model = make_drafter(method, target, config, torch.randn(500, 64), keep - keep, t2d, layers)
    s = sizes.shape_from_target_config(target, 100, "tiny", attention, variant, method, layers)
    assert sizes.drafter_params(s) == num_params(model)
    extra = sizes.drafter_extra_params(s)
    assert ("fc_norm" in extra) == config.fc_norm
    assert ("mask_hidden" in extra) == (method == "peagle")
    named = {name: p.numel() for name, p in model.named_parameters()}
    assert extra.get("mask_hidden", 0) == named.get("mask_hidden", 0)
    assert extra.get("fc_norm", 0) == sum(n for k, n in named.items() if k.startswith("fc_norm."))
    # what the plan reports a run of those settings trains
    p = memory_plan.plan(
        s,
        tokens=64,
        max_len=64,
        steps=2,
        batch_tokens=256,
        extract_max_len=64,
        target_dtype="float32",
        store_dtype="float32",
        shard_tokens=1000,
    )
    assert p["drafter_params"] == num_params(model)
    assert p["training"]["AdamW states (2 x float32)"] == 8 * num_params(model)
    assert (p["drafter_variant"], p["method"]) == (variant, method)


def test_the_plan_knows_the_settings_the_drafter_knows():
    # the plan refuses with the method's own reason what training would refuse
    with pytest.raises(ValueError, match="train.drafter_attention: llama"):
        sizes.with_drafter(sizes.PRESETS["kimi-k2.5"], "mla", method="peagle")
    with pytest.raises(ValueError, match="drafter_variant"):
        sizes.with_drafter(sizes.PRESETS["kimi-k2.5"], "llama", variant="eagle4")
    for attention, variant in (("mla", "eagle3"), ("llama", "eagle3.1")):
        with pytest.raises(ValueError, match="dflash"):
            sizes.with_drafter(sizes.PRESETS["kimi-k2.5"], attention, variant, "dflash")


@pytest.mark.subprocess  # plan asks vLLM in a subprocess
def test_plan_of_a_run_reads_its_target(tmp_path, capsys):
    target_dir = tmp_path / "model"
    target_dir.mkdir()
    (target_dir / "config.json").write_text(
        json.dumps(
            {
                "hidden_size": 64,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 128,
                "vocab_size": 500,
                "tie_word_embeddings": True,
            }
        )
    )
    results = tmp_path / "results"
    (results / "target").mkdir(parents=True)
    (results / "target" / "target.json").write_text(json.dumps({"path": str(target_dir)}))
    config = tmp_path / "my.yaml"
    config.write_text(
        f"results_dir: {results}\nvocab: {{draft_vocab_size: 100}}\n"
        "train: {max_tokens_per_batch: 256, ttt_steps: 2}\n"
        "target: {dtype: float32}\n"
    )
    assert plan.main(["--configfile", str(config), "--workflow", str(REPO), "--json"]) == 0
    [p] = json.loads(capsys.readouterr().out)
    s = tiny_shape(
        hidden=64,
        layers=4,
        heads=4,
        kv_heads=2,
        head_dim=16,
        intermediate=128,
        vocab=500,
        draft_vocab=100,
    )
    assert p["drafter_params"] == num_params(build(s))
    # tied embeddings: one [V, H] matrix; 4 layers; the final norm
    assert (
        p["target_params"] == 500 * 64 + 4 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 128) + 64
    )
    assert p["tokens_per_batch"] == 256 and p["ttt_steps"] == 2
    assert p["attention"] == "sdpa" and p["training_device"] == p["training_device_fused_attention"]
    assert "disk" not in p  # nothing generated, no --tokens: no dataset
    # once generated, the dataset is the run's samples (synthetic/stats.json)
    (results / "synthetic").mkdir()
    (results / "synthetic" / "stats.json").write_text(
        json.dumps(
            {
                "splits": {
                    "train": {"prompt_tokens": 3000, "completion_tokens": 9000},
                    "eval": {"prompt_tokens": 100, "completion_tokens": 400},
                }
            }
        )
    )
    assert plan.main(["--configfile", str(config), "--workflow", str(REPO), "--json"]) == 0
    [p] = json.loads(capsys.readouterr().out)
    # the config's float32 target: 4 float32 states a token and its id
    request = 4 * 64 * 4 + 8
    assert p["disk"]["request_bytes_per_token"] == request
    assert (p["disk"]["train_tokens"], p["disk"]["heldout_tokens"]) == (12_000, 500)
    shard = p["shard_bytes_per_token"]
    assert p["disk"]["shards"]["peak"] == 12_500 * shard + 2 * 12_000 // 4 * request
    config.write_text(config.read_text().replace("ttt_steps: 2", "ttt_steps: 2, attention: eager"))
    assert plan.main(["--configfile", str(config), "--workflow", str(REPO)]) == 0
    out = capsys.readouterr().out
    assert "training (one rank, train.attention eager)" in out
    assert "TTT attention scores [heads, n, n] float32, n = 256" in out
    assert "with fused attention instead" in out
    assert "MTP layers" not in out  # the target declares none
    # a target whose config declares an MTP layer its checkpoint's index does not name: the
    # plan says so up front, and that the evaluation reports that baseline as not measured
    declared = json.loads((target_dir / "config.json").read_text())
    declared["num_nextn_predict_layers"] = 1
    (target_dir / "config.json").write_text(json.dumps(declared))
    index = {"weight_map": {"model.layers.3.mlp.down_proj.weight": "model.safetensors"}}
    (target_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    assert plan.main(["--configfile", str(config), "--workflow", str(REPO), "--json"]) == 0
    [p] = json.loads(capsys.readouterr().out)
    assert p["mtp_weights"]["held"] is None
    assert "the checkpoint holds no MTP weights" in p["mtp_weights"]["note"]
    index["weight_map"]["model.layers.4.eh_proj.weight"] = "model.safetensors"
    (target_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    assert plan.main(["--configfile", str(config), "--workflow", str(REPO)]) == 0
    out = capsys.readouterr().out
    assert "its checkpoint holds their weights: the evaluation measures vLLM's mtp at k 1" in out


def test_plan_without_a_prepared_target_says_what_to_do(tmp_path, capsys):
    config = tmp_path / "my.yaml"
    config.write_text(f"results_dir: {tmp_path / 'results'}\n")
    assert plan.main(["--configfile", str(config), "--workflow", str(REPO)]) == 2
    assert "--preset" in capsys.readouterr().err


def test_the_stream_window_counts_every_training_ranks_feed():
    """One feed: extract.concurrency samples at their longest beside a micro-batch, at least
    twice the concurrency; of 8 ranks each feeds its share of the concurrency (2) beside a
    micro-batch of its own; train.stream_ahead is shared by the ranks."""
    assert memory_plan.stream_window_tokens(None, 16, 1, 8192, 8192) == 2 * 16 * 8192
    assert memory_plan.stream_window_tokens(None, 16, 8, 8192, 8192) == 8 * (2 + 2) * 8192
    assert memory_plan.stream_window_tokens(None, 16, 8, 8192, 65536) == 8 * (2 * 8192 + 65536)
    assert memory_plan.stream_window_tokens(12, 16, 8, 100, 65536) == 8 * 2 * 100


def test_a_quantized_targets_weights_are_sized_as_its_format_stores_them():
    """vLLM serves gpt-oss's experts in mxfp4 (4-bit floats, one e8m0 exponent per 32) as its
    config declares: sized at bfloat16, its 20.9B parameters would read 39 GiB where its
    checkpoint holds about 13 GB. The format is read from the config, not from the model's
    name: the same experts declared in fp8 blocks weigh a byte each and a float32 scale a
    block."""
    from eaglet.model.sizes import serving_weights, target_params

    standin = STANDINS / "gpt-oss-20b" / "config.json"
    config = json.loads(standin.read_text())
    mxfp4 = sizes.shape_from_target_config(config, 32000, "gpt-oss-20b")
    assert mxfp4.expert_format == "mxfp4" and 20.8e9 < target_params(mxfp4) < 21e9
    served = sum(serving_weights(mxfp4, "bfloat16"))
    assert 12.5 * 2**30 < served < 13.5 * 2**30, served / 2**30
    plain = sizes.shape_from_target_config(
        {k: v for k, v in config.items() if k != "quantization_config"}, 32000, "plain"
    )
    assert sum(serving_weights(plain, "bfloat16")) > 2.9 * served
    fp8 = sizes.shape_from_target_config(
        {**config, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
        32000,
        "fp8",
    )
    routed = 24 * 32 * 3 * 2880 * 2880
    # a byte and a float32 scale a block, where mxfp4 has half a byte and a byte per 32
    assert sum(serving_weights(fp8, "bfloat16")) - served == pytest.approx(
        routed / 2 + routed / 16384 * 4 - routed / 32, rel=0.01
    )
