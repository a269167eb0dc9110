"""The drafter's RoPE: the target's rotary frequencies (plain, the scaled variants
transformers implements, and DeepSeek's YaRN of vLLM's MLA), the MLA softmax scale that
YaRN changes, and the two rotations (NeoX halves, GPT-J pairs)."""

from __future__ import annotations

import math

import torch

from eaglet.model.config import DrafterConfig


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude correction for a context stretched ``factor`` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_rope_inv_freq(config: DrafterConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [qk_rope_head_dim/2] and cos/sin scale of vLLM's MLA RoPE: plain
    RoPE for rope_type default, else DeepSeek's YaRN for every scaled type (vLLM's
    DeepseekV2MLAAttention turns any other rope_type into ``deepseek_yarn``), in float32 as
    vLLM computes them."""
    params, dim = config.rope_parameters, config.qk_rope_head_dim
    base = params["rope_theta"]
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if params["rope_type"] == "default":
        return 1.0 / pos_freqs, 1.0
    factor, original = params["factor"], params["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:  # the dim that turns ``rotations`` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(params.get("beta_fast", 32))), 0)
    high = min(math.ceil(correction_dim(params.get("beta_slow", 1))), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1 on the fast dims (kept), 0 on the slow ones (interpolated)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    scale = yarn_mscale(factor, float(params.get("mscale", 1))) / yarn_mscale(
        factor, float(params.get("mscale_all_dim", 0))
    )
    return inv_freq, float(scale)


def mla_softmax_scale(config: DrafterConfig) -> float:
    """The attention scale of vLLM's MLA: 1/sqrt(qk head size), times mscale(all dims)^2 where
    the RoPE is DeepSeek's YaRN (not where its attention_factor is 1.0, llama scaling)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = config.rope_parameters
    if params["rope_type"] != "default" and params.get("attention_factor") != 1.0:
        mscale = yarn_mscale(params["factor"], float(params.get("mscale_all_dim", False)))
        scale = scale * mscale * mscale
    return scale


def rope_inv_freq(config: DrafterConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the cos/sin scale of the target's RoPE."""
    if config.attention_kind == "mla":
        return mla_rope_inv_freq(config)
    params = config.rope_parameters
    if params["rope_type"] == "default":
        exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim
        return (1.0 / params["rope_theta"] ** exponents).float(), 1.0
    # scaled variants (llama3, yarn, linear, longrope): the formulas transformers implements
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        head_dim=config.head_dim,
        rope_parameters=dict(params),
        max_position_embeddings=config.max_position_embeddings,
    )
    inv_freq, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, torch.device("cpu"))
    return inv_freq.float(), float(scale)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, NeoX layout (vLLM's is_neox_style=True, HF's rotate_half): halves, not pairs."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, GPT-J layout (vLLM's is_neox_style=False, which its DeepSeek MLA uses): each
    pair (2i, 2i+1) turns by one angle; ``cos``/``sin`` repeat each angle twice."""
    rotated = torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)
    return x * cos + rotated * sin
