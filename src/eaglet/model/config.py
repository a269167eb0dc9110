"""The drafter's configuration, torch-free: its shape from the target's config (the
variant's norms, :mod:`eaglet.core.methods`), its RoPE settings, the TTT attention's kernel on a device, and
what an exported config.json says (read by ``eaglet plan``, ``eaglet status`` and the report
without loading PyTorch)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from eaglet.core.methods import ATTENTION_KINDS, EAGLE3_LAYER, VARIANTS


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict  # {"rope_theta": ..., "rope_type": ..., scaling keys}
    max_position_embeddings: int
    vocab_size: int  # the target's vocabulary (input ids, d2t's range)
    draft_vocab_size: int  # rows of lm_head
    target_hidden_size: int
    aux_layer_ids: list[int] = field(default_factory=list)
    # train.drafter_attention: "llama" (GQA, llama_eagle3) or "mla" (the target's multi-head
    # latent attention, deepseek_eagle3); the MLA shapes below are the target's, unused by llama
    attention_kind: str = "llama"
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # the norms vLLM reads from config.json (NORM_FLAGS; train.drafter_variant sets them)
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    norm_before_residual: bool = False

    def __post_init__(self):
        if self.attention_kind == "mla" and self.norm_before_fc:
            raise ValueError(
                "norm_before_fc with train.drafter_attention: mla: vLLM 0.32's MLA "
                "drafter (deepseek_eagle3) has no input_norm before fc and would not "
                "load it; use fc_norm (train.drafter_variant: eagle3.1) or llama "
                "attention"
            )

    @property
    def fc_input_size(self) -> int:
        return self.target_hidden_size * len(self.aux_layer_ids)

    @property
    def norm_flags(self) -> dict[str, bool]:
        return {name: getattr(self, name) for name in NORM_FLAGS}

    @classmethod
    def from_target(
        cls,
        target: dict,
        draft_vocab_size: int,
        aux_layer_ids: list[int],
        attention: str = "llama",
        variant: str = EAGLE3_LAYER.name,
    ) -> DrafterConfig:
        """The drafter's shape from the target's ``config.json`` (dict): every field is read
        here. ``attention`` (train.drafter_attention) picks the layer's attention kind,
        ``variant`` (train.drafter_variant) its norms (:data:`eaglet.core.methods.VARIANTS`)."""
        target = target.get("text_config", target)  # multimodal wrappers nest the LM config
        if attention not in ATTENTION_KINDS:
            raise ValueError(
                f"train.drafter_attention {attention!r} is none of {', '.join(ATTENTION_KINDS)}"
            )
        if variant not in VARIANTS:
            raise ValueError(f"train.drafter_variant {variant!r} is none of {', '.join(VARIANTS)}")
        if target.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"the target uses hidden_act {target['hidden_act']!r}; the EAGLE-3 "
                f"drafters vLLM loads (llama_eagle3, deepseek_eagle3) have a SiLU MLP"
            )
        heads = target["num_attention_heads"]
        config = cls(
            hidden_size=target["hidden_size"],
            intermediate_size=target["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=target.get("num_key_value_heads") or heads,
            head_dim=target.get("head_dim") or target["hidden_size"] // heads,
            rms_norm_eps=target.get("rms_norm_eps", 1e-6),
            rope_parameters=rope_parameters(target),
            max_position_embeddings=target.get("max_position_embeddings", 8192),
            vocab_size=target["vocab_size"],
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=target["hidden_size"],
            aux_layer_ids=list(aux_layer_ids),
        )
        config = with_mla(config, target) if attention == "mla" else config
        return replace(config, **VARIANTS[variant].flags)


# the config.json keys vLLM 0.32's EAGLE-3 drafters read (llama_eagle3.py; deepseek_eagle3.py
# all but norm_before_fc), each false when absent from a plain (non-speculators) config
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def rope_parameters(config: dict) -> dict:
    """The drafter's RoPE settings in transformers-5 form, from the target's config: either
    ``rope_parameters`` (transformers 5) or the older top-level ``rope_theta`` plus optional
    ``rope_scaling``.

    The drafter's one layer attends over the whole context, so where the target keys its
    settings by layer type (sliding and full attention layers rotate differently), it takes
    those of the target's full-attention layers. Where those rotate only part of each head
    (``partial_rotary_factor``, ``rope_dim``, or Gemma's ``proportional``), the drafter rotates
    its whole head by their base: it is trained from scratch, and what must agree is the
    trainer and vLLM's Llama layer, which rotate the whole head alike."""
    params = config.get("rope_parameters")
    if params and all(isinstance(value, dict) for value in params.values()):
        params = params.get("full_attention") or next(iter(params.values()))
    if params:
        params = dict(params)
    else:
        params = dict(config.get("rope_scaling") or {})
        params["rope_theta"] = config.get("rope_theta", 10000.0)
    params["rope_type"] = params.get("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if (
        params["rope_type"] == "proportional"
        or "rope_dim" in params
        or params.get("partial_rotary_factor", 1.0) != 1.0
    ):
        params = {"rope_type": "default", "rope_theta": params["rope_theta"]}
    params.pop("partial_rotary_factor", None)
    return params


MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def with_mla(config: DrafterConfig, target: dict) -> DrafterConfig:
    """``config`` with the target's MLA attention shapes (``train.drafter_attention: mla``):
    the layer vLLM's ``Eagle3DeepseekV2ForCausalLM`` builds from the exported config."""
    missing = [name for name in MLA_FIELDS if not target.get(name)]
    if missing:
        raise ValueError(
            f"train.drafter_attention: mla needs a target with multi-head latent "
            f"attention (DeepSeek-V2/V3, Kimi-K2), whose config.json gives "
            f"{', '.join(MLA_FIELDS)}; this one lacks {', '.join(missing)}: "
            f"set train.drafter_attention: llama"
        )
    if not target.get("q_lora_rank"):
        # deepseek_eagle3's weight mapper renames kv_a_proj_with_mqa into fused_qkv_a_proj,
        # which vLLM builds only with a q_lora_rank: such a drafter would not load
        raise ValueError(
            "train.drafter_attention: mla: the target has no q_lora_rank, and vLLM "
            "0.32's deepseek_eagle3 loads an MLA drafter only with one (it maps "
            "kv_a_proj_with_mqa into fused_qkv_a_proj); set train.drafter_attention: "
            "llama (which serves beside an MLA target on GPUs)"
        )
    rope = config.rope_parameters
    if rope["rope_type"] != "default":
        absent = [k for k in ("factor", "original_max_position_embeddings") if k not in rope]
        if absent:
            raise ValueError(
                f"the target's rope_parameters (rope_type {rope['rope_type']!r}) "
                f"lack {', '.join(absent)}, which vLLM's MLA attention reads for its "
                f"DeepSeek YaRN RoPE: train.drafter_attention: mla cannot match it"
            )
    nope, rope_dim = target["qk_nope_head_dim"], target["qk_rope_head_dim"]
    return replace(
        config,
        attention_kind="mla",
        q_lora_rank=target["q_lora_rank"],
        kv_lora_rank=target["kv_lora_rank"],
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=target["v_head_dim"],
        head_dim=nope + rope_dim,  # the query/key head size
        num_key_value_heads=config.num_attention_heads,
    )  # one K/V per query head


def config_from_vllm(config: dict) -> DrafterConfig:
    """The ``DrafterConfig`` of an exported ``config.json`` (either attention kind)."""
    mla = config.get("model_type") == "deepseek_v2"
    drafter = DrafterConfig(
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=(
            config["qk_nope_head_dim"] + config["qk_rope_head_dim"] if mla else config["head_dim"]
        ),
        rms_norm_eps=config["rms_norm_eps"],
        rope_parameters=rope_parameters(config),
        max_position_embeddings=config["max_position_embeddings"],
        vocab_size=config["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"],
        target_hidden_size=config["target_hidden_size"],
        aux_layer_ids=config["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
        **norm_flags(config),
    )
    if mla:
        drafter = replace(
            drafter,
            attention_kind="mla",
            q_lora_rank=config["q_lora_rank"],
            **{name: config[name] for name in MLA_FIELDS},
        )
    return drafter


def norm_flags(config: dict) -> dict[str, bool]:
    """The norm flags of an exported ``config.json`` as vLLM reads them: false when
    absent, and norm_before_fc from ``eagle_config`` first (llama_eagle3.py)."""
    flags = {flag: bool(config.get(flag, False)) for flag in NORM_FLAGS}
    if "norm_before_fc" in (config.get("eagle_config") or {}):
        flags["norm_before_fc"] = bool(config["eagle_config"]["norm_before_fc"])
    return flags


ATTENTION = ("eager", "sdpa", "flex")  # train.attention: kernels of the TTT attention


def resolve_attention(name: str, device: object) -> str:
    """``train.attention`` on ``device`` (a torch.device or its name): ``auto`` is ``sdpa``,
    the fused kernel, equal to ``eager`` within float rounding and without its [heads, n, n]
    scores (benchmarks/results/train.md for the speed); ``flex`` runs on CUDA only (PyTorch
    has no flex attention backward on CPU)."""
    if name == "auto":
        return "sdpa"
    if name not in ATTENTION:
        raise ValueError(f"attention {name!r} is none of auto, {', '.join(ATTENTION)}")
    if name == "flex" and str(device).partition(":")[0] != "cuda":
        raise ValueError(
            "attention flex needs a CUDA device (PyTorch's flex attention has no "
            "backward pass on CPU); use sdpa"
        )
    return name
