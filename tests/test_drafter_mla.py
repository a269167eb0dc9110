"""The drafter with multi-head latent attention (``train.drafter_attention: mla``): it trains
on an MLA target's features, its export is what vLLM's ``Eagle3DeepseekV2ForCausalLM``
(deepseek_eagle3.py) loads, vLLM's own forward of the exported weights equals eaglet's, and
the offline replay drafts with it.

The world is test_train's, with a tiny random DeepSeek-V3 target in place of its Llama (MLA
with q_lora_rank, YaRN RoPE, a dense first layer and MoE layers after it), whose greedy
answers and features make the shards.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, DeepseekV3Config, DeepseekV3ForCausalLM

from eaglet.data import shards
from eaglet.model.config import DrafterConfig
from eaglet.model.drafter import Eagle3Drafter
from eaglet.model.export import export_drafter, export_speculators, load_drafter, vllm_tensors
from eaglet.model.replay import draft_chain, replay_counts
from eaglet.stages.train.loop import Dist, Trainer, settings
from tests.helpers.paths import HELPERS
from tests.test_train import (
    AUX_LAYERS,
    DRAFT_VOCAB,
    FAST,
    VOCAB,
    read_log,
    run,
    write_shards,
    write_vocab_map,
)
from tests.tiny_llama import one_thread

HIDDEN = 64
MLA_DIMS = {
    "kv_lora_rank": 32,
    "q_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
}
YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
HELPER = HELPERS / "vllm_mla_drafter.py"


def make_mla_target(directory: Path) -> DeepseekV3ForCausalLM:
    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_scaling=YARN,
        **MLA_DIMS,
    )
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # a confident teacher, as in test_train
        model.lm_head.weight.mul_(40)
    model.save_pretrained(directory)
    return model


class CachedGreedy:
    """The target as test_train's write_shards calls it, except that a call whose tokens
    extend the previous call's by one runs only the new token, through the KV cache: the
    tiny DeepSeek-V3's full forward is too slow on CPU to rerun for every generated token."""

    def __init__(self, lm):
        self.lm, self.model = lm, lm.model
        self.ids, self.cache = None, None

    def __call__(self, ids, output_hidden_states=False):
        if output_hidden_states:
            return self.lm(ids, output_hidden_states=True)
        extends = (
            self.ids is not None
            and ids.shape[1] == self.ids.shape[1] + 1
            and torch.equal(ids[:, :-1], self.ids)
        )
        out = (
            self.lm(ids[:, -1:], past_key_values=self.cache, use_cache=True)
            if extends
            else self.lm(ids, use_cache=True)
        )
        self.ids, self.cache = ids, out.past_key_values
        return out


@pytest.fixture(scope="module")
def mla_world(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla_world")
    with one_thread():
        model = CachedGreedy(make_mla_target(root / "target"))
        train_paths = write_shards(model, root / "hidden", 2, 8, seed=1)
        eval_paths = write_shards(model, root / "heldout", 1, 4, seed=2, prefix="e")
    vocab = write_vocab_map(train_paths, root / "vocab_map.safetensors")
    return {
        "root": root,
        "target": str(root / "target"),
        "train": train_paths,
        "eval": eval_paths,
        "vocab": vocab,
    }


@pytest.fixture(scope="module")
def trained(mla_world, tmp_path_factory):
    """One MLA drafter trained on the world (6 epochs), and what train() returned."""
    tmp = tmp_path_factory.mktemp("mla_run")
    result = run(mla_world, tmp, {**FAST, "epochs": 6, "drafter_attention": "mla"})
    return tmp / "run" / "drafter", result


def target_config(world) -> dict:
    return json.loads((Path(world["target"]) / "config.json").read_text())


def random_drafter(world, seed: int = 0) -> Eagle3Drafter:
    """An MLA drafter of the world's target with its reduced vocabulary, norms away from 1."""
    torch.manual_seed(seed)
    vocab = load_file(world["vocab"])
    config = DrafterConfig.from_target(target_config(world), DRAFT_VOCAB, AUX_LAYERS, "mla")
    embed = load_file(str(Path(world["target"]) / "model.safetensors"))["model.embed_tokens.weight"]
    model = Eagle3Drafter(config, embed, vocab["d2t"], vocab["t2d"])
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    return model.eval()


def held_out_sequence(world) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [T, 3H], ids [T]) of the first held-out sample: the target's real features."""
    shard = shards.load(world["eval"][0])
    rows = shard.sample(0)
    return shard.aux_hidden[rows].float(), shard.input_ids[rows]


def chain_logits(model: Eagle3Drafter, aux, ids, p: int, drafts: list[int]) -> list[torch.Tensor]:
    """Draft-vocabulary logits of row ``p`` at each TTT step of the training forward, the
    steps after the first embedding ``drafts`` (target ids) as drafting does."""
    k = len(drafts)
    steps = torch.stack([ids[1 + j : p + 2 + j] for j in range(k)])
    for j in range(1, k):
        steps[j, p] = drafts[j - 1]
    with torch.no_grad():
        logits = model(
            aux[: p + 1], steps, torch.arange(p + 1), torch.zeros(p + 1, dtype=torch.long)
        )
    return [z[p] for z in logits]


# -- the configuration ------------------------------------------------------------------------


def test_the_drafter_takes_the_targets_mla_shapes_and_refuses_what_vllm_cannot_load(mla_world):
    target = target_config(mla_world)
    config = DrafterConfig.from_target({"text_config": target}, DRAFT_VOCAB, AUX_LAYERS, "mla")
    assert config.attention_kind == "mla" and config.q_lora_rank == 16
    assert (
        config.kv_lora_rank,
        config.qk_nope_head_dim,
        config.qk_rope_head_dim,
        config.v_head_dim,
    ) == (32, 16, 8, 16)
    assert config.num_key_value_heads == config.num_attention_heads == 4
    assert config.rope_parameters["rope_type"] == "yarn"
    assert DrafterConfig.from_target(target, DRAFT_VOCAB, AUX_LAYERS).attention_kind == "llama"

    llama = {
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "vocab_size": VOCAB,
    }
    with pytest.raises(ValueError, match="lacks kv_lora_rank.*set train.drafter_attention: llama"):
        DrafterConfig.from_target(llama, DRAFT_VOCAB, AUX_LAYERS, "mla")
    with pytest.raises(ValueError, match="no q_lora_rank.*fused_qkv_a_proj"):
        DrafterConfig.from_target({**target, "q_lora_rank": None}, DRAFT_VOCAB, AUX_LAYERS, "mla")
    with pytest.raises(ValueError, match="drafter_attention 'gqa' is none of llama, mla"):
        DrafterConfig.from_target(target, DRAFT_VOCAB, AUX_LAYERS, "gqa")
    assert settings({})["drafter_attention"] == "llama"


def test_mla_rope_and_scale_follow_deepseek_yarn(mla_world):
    """YaRN as vLLM's DeepseekScalingRotaryEmbedding: the fast dims keep their frequency,
    the slow ones are divided by the factor; cos/sin scaled by mscale/mscale_all_dim (1 here);
    the softmax scale of 1/sqrt(24) times mscale(4, 1)^2 (vLLM: deepseek_yarn)."""
    model = random_drafter(mla_world)
    plain = 1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float) / 8)
    assert model.inv_freq[0] == plain[0] and model.inv_freq[-1] == pytest.approx(plain[-1] / 4)
    assert model.rope_scale == 1.0
    mscale = 0.1 * math.log(4.0) + 1
    assert model.midlayer.self_attn.scale == pytest.approx(24**-0.5 * mscale**2)
    cos, sin = model.rope(torch.tensor([5]))
    assert cos.shape == (1, 8) and torch.equal(cos[0, ::2], cos[0, 1::2])  # GPT-J pairs


# -- training ----------------------------------------------------------------------------------


def test_an_mla_drafter_trains_and_its_loss_falls(trained):
    out, result = trained
    rows = read_log(out / "training_log.csv")
    train_rows = [r for r in rows if r["split"] == "train"]
    eval_rows = [r for r in rows if r["split"] == "eval"]
    first, last = float(train_rows[0]["loss"]), float(train_rows[-1]["loss"])
    assert last < 0.7 * first, (first, last)
    assert float(eval_rows[-1]["loss"]) < float(eval_rows[0]["loss"])
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert "midlayer.self_attn.kv_b_proj.weight" in load_file(str(out / "model.safetensors"))
    assert result["steps"] == int(train_rows[-1]["step"])


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_mla_ttt_attention_kernels_agree_in_values_and_gradients(mla_world, attention):
    """Keys of 24 and values of 16 per head through the fused kernel and its sink: the same
    logits and gradients as the plain matmuls."""
    model = random_drafter(mla_world)
    aux, ids = held_out_sequence(mla_world)
    n = len(ids) - 3
    steps = torch.stack([ids[1 + j : n + 1 + j] for j in range(3)])
    segments = torch.tensor([0] * (n // 2) + [1] * (n - n // 2))
    positions = torch.cat([torch.arange(n // 2), torch.arange(n - n // 2)])
    results = {}
    for kind in ("eager", attention):
        model.attention = kind
        model.zero_grad()
        logits = model(aux[:n], steps, positions, segments)
        sum(z.logsumexp(-1).sum() for z in logits).backward()
        results[kind] = (
            [z.detach() for z in logits],
            {n_: p.grad.clone() for n_, p in model.named_parameters()},
        )
    for a, b in zip(results["eager"][0], results[attention][0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for name, grad in results["eager"][1].items():
        torch.testing.assert_close(results[attention][1][name], grad, rtol=1e-4, atol=1e-5)


def test_layer_init_target_starts_the_mla_attention_from_the_targets_last_layer(
    mla_world, tmp_path
):
    """The target's last layer is MLA + MoE: its attention fits the MLA drafter's and is
    taken (the hidden half of q_a_proj and kv_a_proj_with_mqa, the rest whole); the MoE MLP
    does not, and stays random."""
    cfg = settings({**FAST, "layer_init": "target", "drafter_attention": "mla"})
    trainer = Trainer.from_files(
        cfg,
        mla_world["train"],
        [],
        mla_world["vocab"],
        mla_world["target"],
        str(tmp_path / "ckpt"),
        torch.device("cpu"),
        Dist(),
    )
    assert trainer.layer_init["from_target"] == ["attention"]
    assert "mlp.experts.N.gate_proj.weight" in trainer.layer_init["random"]["mlp"]
    last = {
        n[len("model.layers.3.") :]: t
        for n, t in load_file(str(Path(mla_world["target"]) / "model.safetensors")).items()
        if n.startswith("model.layers.3.")
    }
    attn, exact = trainer.model.midlayer.self_attn, dict(rtol=0, atol=0)
    for name in ("q_a_proj", "kv_a_proj_with_mqa"):
        torch.testing.assert_close(
            getattr(attn, name).weight[:, HIDDEN:], last[f"self_attn.{name}.weight"], **exact
        )
    for name in ("q_a_layernorm", "q_b_proj", "kv_a_layernorm", "kv_b_proj", "o_proj"):
        torch.testing.assert_close(
            getattr(attn, name).weight, last[f"self_attn.{name}.weight"], **exact
        )
    torch.testing.assert_close(
        trainer.model.midlayer.hidden_norm.weight, last["input_layernorm.weight"], **exact
    )


# -- the export --------------------------------------------------------------------------------


def test_the_export_is_what_deepseek_eagle3_reads(mla_world, tmp_path):
    """Field by field what deepseek_eagle3.py's __init__ reads from the config (as
    transformers' DeepseekV2Config, the type vLLM builds for model_type deepseek_v2), and
    the tensors its load_weights maps; a speculators copy is refused (vLLM's speculators
    format has no DeepSeek layer)."""
    model = random_drafter(mla_world)
    config = export_drafter(model, tmp_path / "drafter")
    target = target_config(mla_world)
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert config["model_type"] == "deepseek_v2"  # deepseek_v3 would become vLLM's MTP model
    read = AutoConfig.for_model(**json.loads((tmp_path / "drafter" / "config.json").read_text()))
    assert type(read).__name__ == "DeepseekV2Config"
    for name in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
        *MLA_DIMS,
    ):
        assert getattr(read, name) == target[name], name
    assert read.num_hidden_layers == 1 and read.hidden_act == "silu"
    assert read.rope_parameters["rope_type"] == "yarn"
    assert {
        k: read.rope_parameters[k]
        for k in (
            "factor",
            "original_max_position_embeddings",
            "mscale",
            "mscale_all_dim",
            "rope_theta",
        )
    } == {
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "rope_theta": 10000.0,
    }
    assert (read.draft_vocab_size, read.target_hidden_size) == (DRAFT_VOCAB, HIDDEN)
    assert read.eagle_config["eagle_aux_hidden_state_layer_ids"] == AUX_LAYERS
    assert read.norm_before_residual is False and not hasattr(read, "index_topk")

    with safe_open(str(tmp_path / "drafter" / "model.safetensors"), framework="pt") as handle:
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    expected = vllm_tensors(model.config)
    assert shapes == {name: shape for name, (shape, _) in expected.items()}
    h, n = HIDDEN, 4
    assert shapes["midlayer.self_attn.q_a_proj.weight"] == (16, 2 * h)
    assert shapes["midlayer.self_attn.kv_a_proj_with_mqa.weight"] == (32 + 8, 2 * h)
    assert shapes["midlayer.self_attn.q_b_proj.weight"] == (n * (16 + 8), 16)
    assert shapes["midlayer.self_attn.kv_b_proj.weight"] == (n * (16 + 16), 32)
    assert shapes["midlayer.self_attn.o_proj.weight"] == (h, n * 16)
    assert not any("embed_tokens" in name for name in shapes)

    loaded = load_drafter(tmp_path / "drafter", mla_world["target"])
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)
    with pytest.raises(ValueError, match="speculators format.*--speculative-config"):
        export_speculators(tmp_path / "drafter", tmp_path / "spec", mla_world["target"], 3)


def stacked(exported: dict[str, torch.Tensor], expected: dict) -> dict[str, torch.Tensor]:
    """vLLM parameter -> the exported tensors it receives (``vllm_tensors``: ``NAME[shard]``
    for a stacked parameter), stacked in shard order as vLLM's weight loader stacks them."""
    parts: dict[str, list[tuple[str, str]]] = {}
    for name, (_, destination) in expected.items():
        if destination.startswith("("):  # not loaded (t2d)
            continue
        base, _, shard = destination.partition("[")
        param = f"{base}.weight" if shard else base
        parts.setdefault(param, []).append((shard, name))
    return {
        param: torch.cat([exported[name] for _, name in sorted(names)])
        for param, names in parts.items()
    }


@pytest.mark.subprocess
def test_vllm_loads_the_export_and_its_forward_equals_eaglets(mla_world, tmp_path):
    """vLLM's Eagle3DeepseekV2ForCausalLM, built from the engine config of
    --speculative-config and loaded by its own load_weights, holds every exported tensor where
    eaglet says it goes, and its forward (fc, MLA projections, RoPE, norms, MLP, lm_head, the
    d2t scatter; the attention softmax over the keys and values it makes) drafts from a
    held-out row what eaglet's training forward and offline chain draft, to float rounding."""
    if importlib.util.find_spec("vllm") is None:  # found, not imported: the helper runs it
        pytest.skip("vLLM is not installed")
    model = random_drafter(mla_world, seed=1)
    export_drafter(model, tmp_path / "drafter")
    aux, ids = held_out_sequence(mla_world)
    p, k = len(ids) - 6, 3
    save_file(
        {"aux": aux, "ids": ids, "p": torch.tensor(p), "k": torch.tensor(k)},
        str(tmp_path / "inputs.safetensors"),
    )
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    done = subprocess.run(
        [
            sys.executable,
            str(HELPER),
            mla_world["target"],
            str(tmp_path / "drafter"),
            str(tmp_path / "inputs.safetensors"),
            str(tmp_path / "vllm.safetensors"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = load_file(str(tmp_path / "vllm.safetensors"))

    exported = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    loaded = {n[len("loaded.") :]: t for n, t in out.items() if n.startswith("loaded.")}
    wanted = stacked(exported, vllm_tensors(model.config))
    assert set(loaded) - set(wanted) == {"model.embed_tokens.weight"}  # shared from the target
    for param, want in wanted.items():  # lm_head's rows are padded to a multiple of 64
        torch.testing.assert_close(loaded[param][: len(want)], want, rtol=0, atol=0, msg=param)
    assert float(out["config.scale"]) == pytest.approx(model.midlayer.self_attn.scale, rel=1e-12)

    drafts = [int(out[f"logits.{j}"].argmax()) for j in range(k)]
    eaglet = chain_logits(model, aux, ids, p, drafts)
    draft_ids = torch.arange(DRAFT_VOCAB) + model.d2t
    for j in range(k):
        theirs = out[f"logits.{j}"]
        assert torch.isfinite(theirs).sum() == DRAFT_VOCAB  # the draft vocabulary, scattered
        torch.testing.assert_close(theirs[draft_ids], eaglet[j], rtol=1e-4, atol=1e-5)
    assert draft_chain(model, aux, ids, p, k) == drafts


# -- the offline replay ------------------------------------------------------------------------


def test_the_offline_chain_drafts_what_the_training_forward_predicts(mla_world):
    """draft_chain (offline_eval) runs the MLA drafter and its k drafts are the argmaxes of
    the TTT forward fed with them: drafting and training compute one model."""
    model = random_drafter(mla_world, seed=2)
    aux, ids = held_out_sequence(mla_world)
    for p in (3, len(ids) - 5):
        drafts = draft_chain(model, aux, ids, p, 4)
        logits = chain_logits(model, aux, ids, p, drafts)
        assert drafts == [int(model.to_target_ids(z.argmax())) for z in logits]


def test_the_trained_mla_drafter_replays_offline(mla_world, trained):
    """The exported drafter, read back as evaluation reads it, replays the held-out answers
    and gets some of its drafts accepted."""
    out, _ = trained
    model = load_drafter(out, mla_world["target"])
    shard = shards.load(mla_world["eval"][0])
    accepted = drafts = 0
    for s in range(shard.num_samples):
        rows = shard.sample(s)
        ids, mask = shard.input_ids[rows], shard.loss_mask[rows]
        prompt = int((mask == 0).sum())
        counts = replay_counts(
            model, shard.aux_hidden[rows], ids[:prompt].tolist(), ids[prompt:].tolist(), 3
        )
        accepted, drafts = accepted + counts["accepted"], drafts + counts["drafts"]
        assert counts["draft_tokens"] == 3 * counts["drafts"]
    assert drafts > 0 and accepted > 0, (accepted, drafts)
