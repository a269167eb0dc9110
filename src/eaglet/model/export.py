"""Write the drafter as the checkpoint vLLM 0.32 loads with ``"method": "eagle3"``, and read it back.

vLLM reads ``config.json`` into its ``EAGLEConfig`` (``LlamaForCausalLMEagle3`` is registered
to ``llama_eagle3.Eagle3LlamaForCausalLM``) and streams ``model.safetensors`` through
``Eagle3LlamaForCausalLM.load_weights``, which prefixes every name except ``lm_head``/``d2t``
with ``model.``, renames ``d2t`` to ``draft_id_to_target_id``, drops ``t2d``, and maps
``midlayer.`` to ``layers.0.`` and q/k/v and gate/up into its fused ``qkv_proj`` and
``gate_up_proj``. No ``embed_tokens`` is written, so vLLM shares the target's embedding
(``_maybe_share_embeddings``: ``has_own_embed_tokens`` stays False); ``lm_head`` is written, so
the drafter keeps its own (``process_eagle_weight`` sets ``has_own_lm_head``).

A drafter with MLA attention (``train.drafter_attention: mla``) is written as
``Eagle3DeepseekV2ForCausalLM`` (``deepseek_eagle3.py``, model_type ``deepseek_v2``) under the
same naming rules, its attention tensors named as the target's MLA (``mla_attention``).

The norm flags (``drafter.NORM_FLAGS``; ``train.drafter_variant`` sets them) are written as the
top-level config.json keys vLLM reads, all four once any is set (a plain EAGLE-3 export keeps
today's keys), and their weights as vLLM names them: ``fc_norm.{i}.weight`` and
``input_norm.weight``, under ``model.`` like fc.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from eaglet.core import methods
from eaglet.core.io import atomic_open, read_json, write_json
from eaglet.data.shards import STORAGE_DTYPES
from eaglet.model.config import NORM_FLAGS, DrafterConfig, config_from_vllm
from eaglet.model.drafter import Eagle3Drafter
from eaglet.target.checkpoint import load_target_embedding

LAYER = "model.layers.0."  # vLLM's drafter models map ``midlayer.`` to their layer 0


def vllm_tensors(config: DrafterConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of the checkpoint: name -> (shape, the vLLM parameter that receives it).
    Both drafter kinds share all but the attention (``llama_attention``, ``mla_attention``):
    vLLM's LlamaForCausalLMEagle3 and Eagle3DeepseekV2ForCausalLM read the same names."""
    h, i, vd = config.hidden_size, config.intermediate_size, config.draft_vocab_size
    attention = mla_attention if config.attention_kind == "mla" else llama_attention
    tensors = {
        # the model's fc = ReplicatedLinear(fc_input_size = target_hidden_size * num aux, hidden)
        "fc.weight": ((h, config.fc_input_size), "model.fc.weight"),
        # the decoder layer at layer_idx 0: input_layernorm(embeds) ...
        "midlayer.input_layernorm.weight": ((h,), LAYER + "input_layernorm.weight"),
        # ... hidden_norm(hidden_states), the residual being the un-normed hidden state
        "midlayer.hidden_norm.weight": ((h,), LAYER + "hidden_norm.weight"),
        **attention(config),
        "midlayer.post_attention_layernorm.weight": (
            (h,),
            LAYER + "post_attention_layernorm.weight",
        ),
        # a dense MLP (LlamaMLP, DeepseekV2MLP): gate_up_proj stacked shards 0 (gate) and 1 (up)
        "midlayer.mlp.gate_proj.weight": ((i, h), LAYER + "mlp.gate_up_proj[0]"),
        "midlayer.mlp.up_proj.weight": ((i, h), LAYER + "mlp.gate_up_proj[1]"),
        "midlayer.mlp.down_proj.weight": ((h, i), LAYER + "mlp.down_proj.weight"),
        # the model's norm: its residual input is the pre-norm hidden state fed back
        "norm.weight": ((h,), "model.norm.weight"),
        # lm_head = ParallelLMHead(draft_vocab_size, hidden_size)
        "lm_head.weight": ((vd, h), "lm_head.weight"),
        # "d2t" -> draft_id_to_target_id; compute_logits scatters draft logit i to target id
        # i + d2t[i]. The parameter exists only when draft_vocab_size != vocab_size: with the full
        # vocabulary, writing d2t would fail the load ("There is no module or parameter named")
        "d2t": ((vd,), "draft_id_to_target_id"),
        # skipped by load_weights ("t2d" in name: continue); kept for other readers
        "t2d": ((config.vocab_size,), "(not loaded by vLLM)"),
    }
    if vd == config.vocab_size:
        del tensors["d2t"]
    return {**norm_tensors(config), **tensors}


def norm_tensors(config: DrafterConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """The norms before fc that the norm flags add (``combine_hidden_states``):
    norm_before_fc's RMSNorm(fc_input_size) ``input_norm`` (the Llama drafter only; vLLM's
    load_weights drops it unless the flag is on) and fc_norm's ModuleList of one
    RMSNorm(target_hidden_size) per aux layer."""
    tensors = {}
    if config.norm_before_fc:
        tensors["input_norm.weight"] = ((config.fc_input_size,), "model.input_norm.weight")
    if config.fc_norm:
        for i in range(len(config.aux_layer_ids)):
            tensors[f"fc_norm.{i}.weight"] = (
                (config.target_hidden_size,),
                f"model.fc_norm.{i}.weight",
            )
    return tensors


def llama_attention(config: DrafterConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """The Llama drafter's attention: qkv_proj = QKVParallelLinear(2 * hidden_size, ...),
    stacked shards "q", "k", "v"."""
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    return {
        "midlayer.self_attn.q_proj.weight": ((q, 2 * h), LAYER + "self_attn.qkv_proj[q]"),
        "midlayer.self_attn.k_proj.weight": ((kv, 2 * h), LAYER + "self_attn.qkv_proj[k]"),
        "midlayer.self_attn.v_proj.weight": ((kv, 2 * h), LAYER + "self_attn.qkv_proj[v]"),
        "midlayer.self_attn.o_proj.weight": ((h, q), LAYER + "self_attn.o_proj.weight"),
    }


def mla_attention(config: DrafterConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """The MLA drafter's attention as ``Eagle3DeepseekV2ForCausalLM.load_weights`` reads it:
    DeepseekV2MLAAttention(input_size=2 * hidden), whose DeepSeekV2FusedQkvAProjLinear stacks
    q_a_proj and kv_a_proj_with_mqa ([q_lora_rank, kv_lora_rank + qk_rope_head_dim], shards 0
    and 1) into ``fused_qkv_a_proj``."""
    h, n = config.hidden_size, config.num_attention_heads
    qk, rope = config.qk_nope_head_dim + config.qk_rope_head_dim, config.qk_rope_head_dim
    lora, kv_lora = config.q_lora_rank, config.kv_lora_rank
    attn = LAYER + "self_attn."
    return {
        "midlayer.self_attn.q_a_proj.weight": ((lora, 2 * h), attn + "fused_qkv_a_proj[0]"),
        "midlayer.self_attn.q_a_layernorm.weight": ((lora,), attn + "q_a_layernorm.weight"),
        "midlayer.self_attn.q_b_proj.weight": ((n * qk, lora), attn + "q_b_proj.weight"),
        "midlayer.self_attn.kv_a_proj_with_mqa.weight": (
            (kv_lora + rope, 2 * h),
            attn + "fused_qkv_a_proj[1]",
        ),
        "midlayer.self_attn.kv_a_layernorm.weight": ((kv_lora,), attn + "kv_a_layernorm.weight"),
        # per head [qk_nope_head_dim keys, v_head_dim values]
        "midlayer.self_attn.kv_b_proj.weight": (
            (n * (config.qk_nope_head_dim + config.v_head_dim), kv_lora),
            attn + "kv_b_proj.weight",
        ),
        "midlayer.self_attn.o_proj.weight": ((h, n * config.v_head_dim), attn + "o_proj.weight"),
    }


def vllm_config(config: DrafterConfig, dtype: str) -> dict:
    """``config.json``: the target's layer shape, one layer, and the EAGLE-3 fields; the
    attention's own fields from :func:`llama_fields` or :func:`mla_fields`."""
    rope = dict(config.rope_parameters)
    out = {
        **(mla_fields(config) if config.attention_kind == "mla" else llama_fields(config)),
        "num_hidden_layers": 1,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        # transformers 5 reads rope_parameters; transformers 4 readers (vLLM on GPU images)
        # read rope_theta and rope_scaling
        "rope_parameters": rope,
        "rope_theta": rope["rope_theta"],
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
            "use_aux_hidden_state": True,
        },
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if rope["rope_type"] != "default":
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if any(config.norm_flags.values()):  # vLLM reads each with getattr(config, flag, False)
        out.update(config.norm_flags)
    return out


def llama_fields(config: DrafterConfig) -> dict:
    """The Llama drafter's own fields: vLLM's ``LlamaForCausalLMEagle3`` (llama_eagle3.py)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "mlp_bias": False,
    }


def mla_fields(config: DrafterConfig) -> dict:
    """The MLA drafter's own fields, read by vLLM as a ``DeepseekV2Config``: the architecture
    ``Eagle3DeepseekV2ForCausalLM`` (deepseek_eagle3.py) and model_type ``deepseek_v2``. Not
    ``deepseek_v3``: vLLM's speculative config rewrites a draft config of that type into its
    DeepSeek MTP model. ``q_lora_rank`` is always written (DeepseekV2Config defaults it to
    1536), and so is ``norm_before_residual`` false (the residual stream starts at the
    un-normed hidden state, as in the Llama drafter)."""
    return {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "num_key_value_heads": config.num_attention_heads,
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "norm_before_residual": False,
    }


def export_drafter(model: Eagle3Drafter, out_dir: str | Path, dtype: str = "float32") -> dict:
    """Write ``out_dir/config.json`` and ``out_dir/model.safetensors`` atomically; returns the config."""
    expected = {name: shape for name, (shape, _) in vllm_tensors(model.config).items()}
    write_weights(model.state_dict(), expected, out_dir, dtype)
    config = vllm_config(model.config, dtype)
    write_json(Path(out_dir) / "config.json", config)
    return config


def write_weights(
    state: dict[str, torch.Tensor],
    expected: dict[str, tuple[int, ...]],
    out_dir: str | Path,
    dtype: str,
) -> None:
    """``out_dir/model.safetensors`` (atomically) of the tensors ``state`` holds, which must be
    exactly those vLLM loads, ``expected`` (name -> shape), floats in ``dtype``; ``d2t`` may
    be in ``state`` and not expected only as the identity map (a full draft vocabulary, for
    which vLLM has no parameter)."""
    state = dict(state)
    if "d2t" not in expected and "d2t" in state and state.pop("d2t").any():
        raise RuntimeError(
            "a draft vocabulary as large as the target's must map ids to themselves (d2t all 0)"
        )
    if set(state) != set(expected):
        raise RuntimeError(
            f"drafter tensors {sorted(state)} differ from the vLLM checkpoint's {sorted(expected)}"
        )
    tensors = {}
    for name, shape in expected.items():
        tensor = state[name].detach().cpu()
        if tuple(tensor.shape) != shape:
            raise RuntimeError(f"{name} has shape {tuple(tensor.shape)}, vLLM expects {shape}")
        if tensor.is_floating_point():
            tensor = tensor.to(STORAGE_DTYPES[dtype])
        tensors[name] = tensor.contiguous()
    data = save(tensors, metadata={"format": "pt"})
    with atomic_open(Path(out_dir) / "model.safetensors", "wb") as handle:
        handle.write(data)


SPECULATORS_VERSION = "0.9.0"  # the speculators release whose config format this follows
EAGLE_KEYS = ("architectures", "draft_vocab_size", "target_hidden_size", "eagle_config")


def speculators_config(
    config: dict, verifier: str, verifier_architectures: list[str], num_speculative_tokens: int
) -> dict:
    """The speculators-format ``config.json`` of an exported drafter (its vLLM ``config``),
    with which ``vllm serve DIR`` serves ``verifier`` with this drafter on its own.

    The layer shape goes to ``transformer_layer_config``; the EAGLE-3 fields sit at the top,
    as speculators' ``Eagle3SpeculatorConfig`` writes them. ``norm_before_residual`` is
    stated: vLLM assumes true for a speculators config that omits it, while this drafter adds
    the un-normed hidden state to the attention output (vLLM's default for plain EAGLE-3
    checkpoints); so are the other EAGLE-3.1 flags, at the top where vLLM's ``update_eagle3``
    reads them. The weights keep their names: vLLM maps ``midlayer.`` to ``layers.0.``."""
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": methods.EAGLE3.served_as,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": {
            k: v for k, v in config.items() if k not in EAGLE_KEYS + NORM_FLAGS
        },
        "draft_vocab_size": config["draft_vocab_size"],
        "target_hidden_size": config["target_hidden_size"],
        "eagle_aux_hidden_state_layer_ids": config["eagle_config"][
            "eagle_aux_hidden_state_layer_ids"
        ],
        **{flag: bool(config.get(flag, False)) for flag in NORM_FLAGS},
        "speculators_config": {
            "algorithm": methods.EAGLE3.served_as,
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens}
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures},
        },
    }


def export_speculators(
    drafter_dir: str | Path, out_dir: str | Path, verifier: str, num_speculative_tokens: int
) -> dict:
    """A speculators-format copy of an exported drafter in ``out_dir`` (``config.json``, and
    ``model.safetensors`` linked or copied, and its model card ``README.md`` where it has
    one), so ``vllm serve out_dir`` needs no ``--speculative-config``; ``drafter_dir`` itself
    is left as it is."""
    drafter_dir, out_dir = Path(drafter_dir), Path(out_dir)
    drafter = read_json(drafter_dir / "config.json")
    method = methods.from_config(drafter)
    if method is not methods.EAGLE3:
        spec = method.speculative_config(drafter_dir, num_speculative_tokens)
        raise ValueError(
            f"the drafter in {drafter_dir} is a {method.words} drafter, which "
            f"this speculators format (Eagle-3) does not describe: serve it with "
            f"--speculative-config {json.dumps(spec)}"
        )
    if drafter.get("model_type", "llama") != "llama":
        raise ValueError(
            f"the drafter in {drafter_dir} has {drafter['model_type']} (MLA) "
            f"attention, which vLLM 0.32's speculators format does not take (its "
            f"Eagle-3 speculators are Llama or Qwen3 layers): serve it with "
            f'--speculative-config and "method": "eagle3" instead'
        )
    local = Path(verifier) / "config.json"  # else a Hugging Face id: a Llama target assumed
    architectures = read_json(local).get("architectures") if local.exists() else None
    config = speculators_config(
        drafter, str(verifier), architectures or ["LlamaForCausalLM"], num_speculative_tokens
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = out_dir / "model.safetensors"
    weights.unlink(missing_ok=True)
    try:
        os.link(drafter_dir / "model.safetensors", weights)
    except OSError:  # another filesystem
        shutil.copyfile(drafter_dir / "model.safetensors", weights)
    card = drafter_dir / "README.md"  # its model card (eaglet.tools.model_card), the same
    if card.is_file():
        with atomic_open(out_dir / "README.md") as handle:
            handle.write(card.read_text())
    write_json(out_dir / "config.json", config)
    return config


def load_drafter(
    drafter_dir: str | Path, target_dir: str | Path, dtype: torch.dtype = torch.float32
) -> Eagle3Drafter:
    """An exported drafter with the target's embedding, ready to run (eval mode)."""
    drafter_dir = Path(drafter_dir)
    config = config_from_vllm(read_json(drafter_dir / "config.json"))
    weights = load_file(str(drafter_dir / "model.safetensors"))
    weights.setdefault("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
    embed = load_target_embedding(target_dir)
    model = Eagle3Drafter(config, embed, weights["d2t"], weights["t2d"])
    model.load_state_dict(weights, strict=True)
    return model.to(dtype).eval()
