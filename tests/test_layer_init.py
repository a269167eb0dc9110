"""train.layer_init: target on targets whose weights sit under a multimodal wrapper's prefix
and whose last layer is not the drafter's Llama layer (MLA attention, MoE experts, quantized
or otherwise shaped weights).

The targets are tiny and random, saved with save_pretrained and then renamed into the layout
a wrapper's checkpoint has (Kimi-K2.5's ``language_model.model.`` and the transformers-5
``model.language_model.``), split in two files with an index as hub checkpoints are. The
training data is test_train's tiny world: its features fit any target of hidden size 64 and
vocabulary 256.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, MixtralConfig, MixtralForCausalLM

from eaglet.model.config import DrafterConfig
from eaglet.model.drafter import Eagle3Drafter
from eaglet.model.init import fit_target_layer, init_from_target, tensor_meta
from eaglet.stages.train.loop import Dist, Trainer, settings
from eaglet.target import checkpoint as target_mod
from eaglet.target.checkpoint import (
    checkpoint_layout,
    load_target_embedding,
    load_target_final_norm,
    load_target_layer,
    load_target_lm_head,
    target_layer_meta,
)
from tests.test_train import FAST, VOCAB, run, world  # noqa: F401 (world is a fixture)

HIDDEN = 64
# tensor name of a plain causal LM -> its name in each layout
LAYOUTS = {
    "model.": lambda name: name,
    # hub checkpoints of wrappers around a whole causal LM (Kimi-K2.5, LLaVA)
    "language_model.model.": lambda name: f"language_model.{name}",
    # wrappers as transformers 5 saves them (Qwen3-VL): the lm_head stays at the top
    "model.language_model.": lambda name: (
        f"model.language_model.{name[len('model.') :]}" if name.startswith("model.") else name
    ),
}


# -- targets in a wrapper's layout ------------------------------------------------------------


def relayout(src: Path, dst: Path, layout: str) -> Path:
    """The checkpoint in ``src`` renamed into ``layout`` and split into two files with an
    index; for a wrapper layout, config.json nests the original as ``text_config``."""
    tensors = load_file(str(src / "model.safetensors"))
    renamed = {LAYOUTS[layout](name): t for name, t in tensors.items()}
    dst.mkdir(parents=True)
    weight_map = {}
    for i, file in enumerate(
        ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    ):
        part = {
            name: t.contiguous()
            for k, (name, t) in enumerate(sorted(renamed.items()))
            if k % 2 == i
        }
        save_file(part, str(dst / file))
        weight_map.update({name: file for name in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    if layout != "model.":
        config = {
            "architectures": ["KimiK25ForConditionalGeneration"],
            "model_type": "kimi_k25",
            "text_config": config,
        }
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def make_deepseek(directory: Path) -> DeepseekV3ForCausalLM:
    """A tiny random DeepSeek-V3: MLA attention (q_lora_rank set, as Kimi-K2.5's), a dense
    first layer and MoE layers after it, saved with save_pretrained."""
    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        first_k_dense_replace=1,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model = DeepseekV3ForCausalLM(config).eval()
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    model = make_deepseek(root / "plain")
    return model, relayout(root / "plain", root / "wrapped", "language_model.model.")


def trainer_for(world, target_dir: Path, tmp_path: Path, layer_init: str) -> Trainer:
    cfg = settings({**FAST, "layer_init": layer_init})
    return Trainer.from_files(
        cfg,
        world["train"],
        [],
        world["vocab"],
        str(target_dir),
        str(tmp_path / f"ckpt-{layer_init}"),
        torch.device("cpu"),
        Dist(),
    )


def target_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(directory) / "model.safetensors"))


def drafter_for(config: dict) -> Eagle3Drafter:
    """A drafter of the target's shape (built as training builds it), full draft vocabulary."""
    torch.manual_seed(0)
    text = config.get("text_config", config)
    vocab = text["vocab_size"]
    return Eagle3Drafter(
        DrafterConfig.from_target(config, vocab, [1, 2, 3]),
        torch.randn(vocab, text["hidden_size"]),
        torch.zeros(vocab, dtype=torch.long),
        torch.ones(vocab, dtype=torch.bool),
    )


# -- reading a wrapped checkpoint -------------------------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_readers_find_the_embedding_lm_head_norm_and_layers_in_every_layout(
    world, tmp_path, layout
):
    plain = target_tensors(world["target"])
    directory = relayout(Path(world["target"]), tmp_path / "target", layout)
    rows = torch.tensor([3, 0, 255, 7])
    torch.testing.assert_close(
        load_target_embedding(directory), plain["model.embed_tokens.weight"], rtol=0, atol=0
    )
    torch.testing.assert_close(
        load_target_lm_head(directory, rows), plain["lm_head.weight"][rows], rtol=0, atol=0
    )
    torch.testing.assert_close(
        load_target_final_norm(directory), plain["model.norm.weight"], rtol=0, atol=0
    )
    layer = load_target_layer(directory, 3)
    assert set(layer) == {
        name[len("model.layers.3.") :] for name in plain if name.startswith("model.layers.3.")
    } | {"norm"}
    torch.testing.assert_close(
        layer["mlp.down_proj.weight"], plain["model.layers.3.mlp.down_proj.weight"], rtol=0, atol=0
    )
    assert target_layer_meta(directory, 3)["self_attn.k_proj.weight"] == ((32, HIDDEN), "float32")


def test_a_wrapped_mla_moe_target_is_read_and_its_layer_init_falls_back_to_random(
    world, deepseek, tmp_path, caplog
):
    """Kimi-K2.5's shape in small: the embedding and lm_head are read under the wrapper's
    prefix, and the MLA + MoE last layer leaves the drafter exactly as layer_init random
    would, with one warning that names what did not fit and how to silence it."""
    model, directory = deepseek
    assert (
        checkpoint_layout(target_mod._weight_files(directory), directory).prefix
        == "language_model.model."
    )
    torch.testing.assert_close(
        load_target_embedding(directory), model.model.embed_tokens.weight.detach(), rtol=0, atol=0
    )
    rows = torch.arange(0, VOCAB, 3)
    torch.testing.assert_close(
        load_target_lm_head(directory, rows), model.lm_head.weight.detach()[rows], rtol=0, atol=0
    )

    with caplog.at_level(logging.INFO, logger="eaglet.stages.train.loop"):
        started = trainer_for(world, directory, tmp_path, "target")
    random = trainer_for(world, directory, tmp_path, "random")
    for name, tensor in random.model.state_dict().items():
        torch.testing.assert_close(started.model.state_dict()[name], tensor, rtol=0, atol=0)

    [line] = [r for r in caplog.records if "layer_init" in r.getMessage()]
    message = line.getMessage()
    assert line.levelno == logging.WARNING
    assert "layer 2 does not fit" in message and "starts random" in message
    assert (
        "no self_attn.q_proj.weight" in message and "self_attn.kv_a_proj_with_mqa.weight" in message
    )
    assert "no mlp.gate_proj.weight" in message and "mlp.experts.N.gate_proj.weight x4" in message
    assert "train.layer_init: random silences this" in message
    assert started.layer_init["from_target"] == [] and started.layer_init["layer"] == 2
    assert set(started.layer_init["random"]) == {"attention", "mlp"}
    assert random.layer_init == {"setting": "random"}


def test_training_from_a_wrapped_mla_moe_target_reports_its_layer_init(world, deepseek, tmp_path):
    """train() runs to its end on such a target, and its summary says what the layer started from."""
    _, directory = deepseek
    result = run(
        {**world, "target": str(directory)},
        tmp_path,
        {**FAST, "layer_init": "target", "max_steps": 2},
    )
    assert result["steps"] == 2
    assert result["layer_init"]["from_target"] == []
    assert "kv_b_proj" in result["layer_init"]["random"]["attention"]
    assert (tmp_path / "run" / "drafter" / "model.safetensors").exists()


@pytest.mark.parametrize("layout", ["language_model.model.", "model.language_model."])
def test_a_wrapped_llama_target_starts_the_drafter_as_its_last_layer(
    world, tmp_path, caplog, layout
):
    """The drafter's layer holds the target's last-layer tensors as init_from_target_layer
    maps them: the hidden half of q/k/v, o_proj, the MLP, the norms, the final norm, and fc
    passing the deepest aux feature through."""
    directory = relayout(Path(world["target"]), tmp_path / "target", layout)
    with caplog.at_level(logging.INFO, logger="eaglet.stages.train.loop"):
        trainer = trainer_for(world, directory, tmp_path, "target")
    [line] = [r for r in caplog.records if "layer_init" in r.getMessage()]
    assert line.levelno == logging.INFO and "starts as the target's layer 3" in line.getMessage()
    assert trainer.layer_init == {
        "setting": "target",
        "layer": 3,
        "from_target": ["attention", "mlp"],
        "random": {},
    }

    plain = target_tensors(world["target"])
    last = {
        name[len("model.layers.3.") :]: t
        for name, t in plain.items()
        if name.startswith("model.layers.3.")
    }
    model = trainer.model
    layer, exact = model.midlayer, dict(rtol=0, atol=0)
    for name in ("q_proj", "k_proj", "v_proj"):
        torch.testing.assert_close(
            getattr(layer.self_attn, name).weight[:, HIDDEN:],
            last[f"self_attn.{name}.weight"],
            **exact,
        )
    torch.testing.assert_close(
        layer.self_attn.o_proj.weight, last["self_attn.o_proj.weight"], **exact
    )
    for name in ("gate_proj", "up_proj", "down_proj"):
        torch.testing.assert_close(
            getattr(layer.mlp, name).weight, last[f"mlp.{name}.weight"], **exact
        )
    torch.testing.assert_close(layer.hidden_norm.weight, last["input_layernorm.weight"], **exact)
    torch.testing.assert_close(
        layer.post_attention_layernorm.weight, last["post_attention_layernorm.weight"], **exact
    )
    torch.testing.assert_close(model.norm.weight, plain["model.norm.weight"], **exact)
    expected_fc = torch.cat([torch.zeros(HIDDEN, 2 * HIDDEN), torch.eye(HIDDEN)], dim=1)
    torch.testing.assert_close(model.fc.weight, expected_fc, **exact)


# -- partial and failed fits ------------------------------------------------------------------


def test_a_moe_target_with_llama_attention_gives_its_attention_only(tmp_path, monkeypatch):
    """Mixtral: the attention fits and is taken; the MoE block (block_sparse_moe, no mlp.*)
    leaves the drafter's MLP random, and no expert is ever read from the checkpoint."""
    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    )
    MixtralForCausalLM(config).save_pretrained(tmp_path / "plain")
    directory = relayout(tmp_path / "plain", tmp_path / "wrapped", "language_model.model.")
    plain = target_tensors(tmp_path / "plain")
    model = drafter_for(json.loads((directory / "config.json").read_text()))
    mlp_before = {n: t.clone() for n, t in model.midlayer.mlp.state_dict().items()}
    post_norm_before = model.midlayer.post_attention_layernorm.weight.detach().clone()
    read = []
    real = target_mod.load_target_layer
    monkeypatch.setattr(
        target_mod,
        "load_target_layer",
        lambda d, layer, names=None: read.extend(names) or real(d, layer, names),
    )

    fit = init_from_target(model, directory, 1)

    assert list(fit.parts) == ["attention"] and set(fit.reasons) == {"mlp"}
    assert "no mlp.gate_proj.weight" in fit.reasons["mlp"]
    assert "block_sparse_moe.experts.N.w1.weight x4" in fit.reasons["mlp"]
    assert not any("block_sparse_moe" in name or name.startswith("mlp.") for name in read)
    torch.testing.assert_close(
        model.midlayer.self_attn.q_proj.weight[:, HIDDEN:],
        plain["model.layers.1.self_attn.q_proj.weight"],
        rtol=0,
        atol=0,
    )
    torch.testing.assert_close(
        model.midlayer.hidden_norm.weight,
        plain["model.layers.1.input_layernorm.weight"],
        rtol=0,
        atol=0,
    )
    torch.testing.assert_close(model.norm.weight, plain["model.norm.weight"], rtol=0, atol=0)
    for name, tensor in model.midlayer.mlp.state_dict().items():
        torch.testing.assert_close(tensor, mlp_before[name], rtol=0, atol=0)
    torch.testing.assert_close(
        model.midlayer.post_attention_layernorm.weight, post_norm_before, rtol=0, atol=0
    )
    message = fit.message()
    assert "attention and final norm start from the target's layer 1" in message
    assert "its mlp starts random" in message and "train.layer_init: random" in message


def llama_layer_meta(model: Eagle3Drafter) -> dict:
    """The metadata of a target layer that fits ``model`` exactly, as target_layer_meta gives it."""
    h, i = HIDDEN, model.config.intermediate_size
    q, kv = (
        model.midlayer.self_attn.q_proj.weight.shape[0],
        model.midlayer.self_attn.k_proj.weight.shape[0],
    )
    shapes = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
        "norm": (h,),
    }
    return {name: (shape, "bfloat16") for name, shape in shapes.items()}


def test_quantized_reshaped_and_extra_tensors_do_not_fit(world):
    """Judged from names, shapes and dtypes alone: FP8 and packed INT4 weights, a projection
    of another shape, biases the drafter lacks and a missing final norm each keep the part
    (or the whole layer) random, and say why; an old checkpoint's rotary buffer is no weight."""
    model = drafter_for(json.loads((Path(world["target"]) / "config.json").read_text()))
    fits = llama_layer_meta(model)
    assert (
        fit_target_layer(
            model, {**fits, "self_attn.rotary_emb.inv_freq": ((8,), "float32")}
        ).reasons
        == {}
    )

    fp8 = {
        **fits,
        "self_attn.q_proj.weight": (fits["self_attn.q_proj.weight"][0], "float8_e4m3fn"),
        "self_attn.q_proj.weight_scale": ((1,), "float32"),
    }
    fit = fit_target_layer(model, fp8)
    assert list(fit.parts) == ["mlp"]
    assert (
        "self_attn.q_proj.weight is stored as float8_e4m3fn (quantized)" in fit.reasons["attention"]
    )
    assert "self_attn.q_proj.weight_scale" in fit.reasons["attention"]

    packed = {n: m for n, m in fits.items() if not n.startswith("mlp.")}
    packed.update(
        {
            f"mlp.{p}.{suffix}": ((8, 8), dtype)
            for p in ("gate_proj", "up_proj", "down_proj")
            for suffix, dtype in (("weight_packed", "i32"), ("weight_scale", "bfloat16"))
        }
    )
    fit = fit_target_layer(model, packed)
    assert list(fit.parts) == ["attention"]
    assert (
        "mlp.up_proj.weight is stored as weight_packed, weight_scale (quantized)"
        in fit.reasons["mlp"]
    )

    reshaped = {
        **fits,
        "self_attn.q_proj.weight": ((96, HIDDEN), "bfloat16"),
        "self_attn.q_proj.bias": ((96,), "bfloat16"),
    }
    reason = fit_target_layer(model, reshaped).reasons["attention"]
    assert f"self_attn.q_proj.weight is [96, {HIDDEN}] where the drafter needs" in reason
    assert "self_attn.q_proj.bias" in reason

    no_norm = {n: m for n, m in fits.items() if n != "norm"}
    assert fit_target_layer(model, no_norm).parts == {}
    assert (
        fit_target_layer(model, {}).reasons["attention"]
        == "the checkpoint holds no tensor of that layer"
    )


def test_loaded_weights_are_judged_as_their_headers_are(world):
    """tensor_meta of the loaded layer equals target_layer_meta from the headers alone."""
    assert tensor_meta(load_target_layer(world["target"], 3)) == target_layer_meta(
        world["target"], 3
    )
