"""The EAGLE-3 drafter: one Llama decoder layer that drafts from the target's features.

It computes what vLLM's ``llama_eagle3.py`` computes (``Eagle3LlamaForCausalLM`` with one
layer, ``norm_before_residual`` off), with the same module names, so its state dict *is* the
checkpoint vLLM loads (see ``eaglet.export``). One drafting step at a position::

    e  = embed_tokens[token]                      the target's embedding, frozen, not saved
    h  = fc(aux) at step 0                        aux = 3 target layer inputs, [3H] -> [H]
       = the previous step's pre-norm output      at steps 1, 2, ...
    x  = cat(input_layernorm(e), hidden_norm(h))  [2H]
    r  = h + o_proj(attention(q/k/v_proj(x)))     the residual stream starts at h, not at e
    r  = r + mlp(post_attention_layernorm(r))     this pre-norm r is fed back to the next step
    logits = lm_head(norm(r))                     [Vd], draft vocabulary; id i is target id i + d2t[i]

Training-time test (TTT) runs ``K`` such steps over a packed batch of rows at once. Row ``t``
of a sample holds the target's features at position ``t``; step ``k`` reads the embedding of
token ``t+1+k``, uses RoPE position ``t+k`` and predicts token ``t+2+k``. Its query attends to
the step-0 keys of rows ``<= t`` of its own sample and to its own keys of steps ``1..k``: the
drafter's KV cache at inference after ``k`` drafted tokens. ``ttt_attention`` computes that
with plain matmuls (``eager``), ``sdpa_ttt_attention`` and ``flex_ttt_attention`` through
PyTorch's fused kernels, exactly the same softmax (``Eagle3Drafter.attention``).

With ``train.drafter_attention: mla`` the layer's attention is the target's multi-head latent
attention (``MLAAttention``), the layer vLLM's ``deepseek_eagle3.py`` builds: everything above
holds, with keys of qk_nope + qk_rope and values of v_head_dim per head, and RoPE (GPT-J
layout, DeepSeek's YaRN) on the rope part only.

``train.drafter_variant: eagle3.1`` (``DRAFTER_VARIANTS``) switches on the flags vLLM reads from
a drafter's config.json, each applied where vLLM's forward applies it:

    fc_norm               aux = cat(fc_norm.i(aux_i)): one RMSNorm per aux feature, before fc
    norm_output           the next step reads norm(r), not r (lm_head reads norm(r) either way)
    norm_before_fc        aux = input_norm(aux): one RMSNorm over all [3H], before fc
    norm_before_residual  r starts at hidden_norm(h) instead of h

EAGLE-3.1 (its paper, SpecForge, TorchSpec) is fc_norm + norm_output: the aux features enter
fc at one scale whatever their layer's, and the state fed back keeps the scale of the target's
final-normed features over the steps. vLLM's MLA drafter (deepseek_eagle3) has no
``norm_before_fc``; the other three it applies as the Llama drafter does.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn



# -- configuration ---------------------------------------------------------------------------

@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict          # {"rope_theta": ..., "rope_type": ..., scaling keys}
    max_position_embeddings: int
    vocab_size: int                # the target's vocabulary (input ids, d2t's range)
    draft_vocab_size: int          # rows of lm_head
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
            raise ValueError("norm_before_fc with train.drafter_attention: mla: vLLM 0.32's MLA "
                             "drafter (deepseek_eagle3) has no input_norm before fc and would not "
                             "load it; use fc_norm (train.drafter_variant: eagle3.1) or llama "
                             "attention")

    @property
    def fc_input_size(self) -> int:
        return self.target_hidden_size * len(self.aux_layer_ids)

    @property
    def norm_flags(self) -> dict[str, bool]:
        return {name: getattr(self, name) for name in NORM_FLAGS}

    @classmethod
    def from_target(cls, target: dict, draft_vocab_size: int, aux_layer_ids: list[int],
                    attention: str = "llama", variant: str = "eagle3") -> "DrafterConfig":
        """The drafter's shape from the target's ``config.json`` (dict): every field is read
        here. ``attention`` (train.drafter_attention) picks the layer's attention kind,
        ``variant`` (train.drafter_variant) its norms (DRAFTER_VARIANTS)."""
        target = target.get("text_config", target)  # multimodal wrappers nest the LM config
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"train.drafter_attention {attention!r} is none of "
                             f"{', '.join(ATTENTION_KINDS)}")
        if variant not in DRAFTER_VARIANTS:
            raise ValueError(f"train.drafter_variant {variant!r} is none of "
                             f"{', '.join(DRAFTER_VARIANTS)}")
        if target.get("hidden_act", "silu") != "silu":
            raise ValueError(f"the target uses hidden_act {target['hidden_act']!r}; the EAGLE-3 "
                             f"drafters vLLM loads (llama_eagle3, deepseek_eagle3) have a SiLU MLP")
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
            aux_layer_ids=list(aux_layer_ids))
        config = with_mla(config, target) if attention == "mla" else config
        return replace(config, **DRAFTER_VARIANTS[variant])


# the config.json keys vLLM 0.32's EAGLE-3 drafters read (llama_eagle3.py; deepseek_eagle3.py
# all but norm_before_fc), each false when absent from a plain (non-speculators) config
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
# train.drafter_variant: the flags each variant sets (the rest stay false)
DRAFTER_VARIANTS = {"eagle3": {}, "eagle3.1": {"fc_norm": True, "norm_output": True}}


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
    if (params["rope_type"] == "proportional" or "rope_dim" in params
            or params.get("partial_rotary_factor", 1.0) != 1.0):
        params = {"rope_type": "default", "rope_theta": params["rope_theta"]}
    params.pop("partial_rotary_factor", None)
    return params


MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def with_mla(config: DrafterConfig, target: dict) -> DrafterConfig:
    """``config`` with the target's MLA attention shapes (``train.drafter_attention: mla``):
    the layer vLLM's ``Eagle3DeepseekV2ForCausalLM`` builds from the exported config."""
    missing = [name for name in MLA_FIELDS if not target.get(name)]
    if missing:
        raise ValueError(f"train.drafter_attention: mla needs a target with multi-head latent "
                         f"attention (DeepSeek-V2/V3, Kimi-K2), whose config.json gives "
                         f"{', '.join(MLA_FIELDS)}; this one lacks {', '.join(missing)}: "
                         f"set train.drafter_attention: llama")
    if not target.get("q_lora_rank"):
        # deepseek_eagle3's weight mapper renames kv_a_proj_with_mqa into fused_qkv_a_proj,
        # which vLLM builds only with a q_lora_rank: such a drafter would not load
        raise ValueError("train.drafter_attention: mla: the target has no q_lora_rank, and vLLM "
                         "0.32's deepseek_eagle3 loads an MLA drafter only with one (it maps "
                         "kv_a_proj_with_mqa into fused_qkv_a_proj); set train.drafter_attention: "
                         "llama (which serves beside an MLA target on GPUs)")
    rope = config.rope_parameters
    if rope["rope_type"] != "default":
        absent = [k for k in ("factor", "original_max_position_embeddings") if k not in rope]
        if absent:
            raise ValueError(f"the target's rope_parameters (rope_type {rope['rope_type']!r}) "
                             f"lack {', '.join(absent)}, which vLLM's MLA attention reads for its "
                             f"DeepSeek YaRN RoPE: train.drafter_attention: mla cannot match it")
    nope, rope_dim = target["qk_nope_head_dim"], target["qk_rope_head_dim"]
    return replace(config, attention_kind="mla", q_lora_rank=target["q_lora_rank"],
                   kv_lora_rank=target["kv_lora_rank"], qk_nope_head_dim=nope,
                   qk_rope_head_dim=rope_dim, v_head_dim=target["v_head_dim"],
                   head_dim=nope + rope_dim,  # the query/key head size
                   num_key_value_heads=config.num_attention_heads)  # one K/V per query head


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
    scale = (yarn_mscale(factor, float(params.get("mscale", 1)))
             / yarn_mscale(factor, float(params.get("mscale_all_dim", 0))))
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
    hf = LlamaConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                     head_dim=config.head_dim, rope_parameters=dict(params),
                     max_position_embeddings=config.max_position_embeddings)
    inv_freq, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, torch.device("cpu"))
    return inv_freq.float(), float(scale)


# -- layers ----------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) in float32, rounded to x's dtype, times the weight (vLLM's and HF's order)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def gated_silu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The SwiGLU MLP's elementwise middle: silu(gate) * up."""
    return F.silu(gate) * up


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, NeoX layout (vLLM's is_neox_style=True, HF's rotate_half): halves, not pairs."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, GPT-J layout (vLLM's is_neox_style=False, which its DeepSeek MLA uses): each
    pair (2i, 2i+1) turns by one angle; ``cos``/``sin`` repeat each angle twice."""
    rotated = torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)
    return x * cos + rotated * sin


def ttt_attention(q: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]],
                  mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of step ``k = len(cache) - 1`` over the drafter's KV cache (``eager``).

    q        [Hkv, G, T, D]   queries, G = query heads per KV head (GQA)
    cache[0] [Hkv, 1, T, D]   step-0 keys/values of every row, seen through ``mask``
    cache[j] [Hkv, 1, T, D]   step-j keys/values (j >= 1), seen only by the same row
    mask     [T, T] bool      query row may see key row: same sample and key row <= query row
    returns  [Hkv, G, T, Dv]  values may be of another head size than queries and keys (MLA)

    One softmax over both key sets, computed as exp(score - rowmax) / sum without ever
    concatenating them: the [T, T] scores are written once, in place, in float32.
    """
    (k0, v0), diagonal = cache[0], cache[1:]
    q = q * scale
    scores = torch.matmul(q, k0.transpose(-1, -2)).float()                 # [Hkv, G, T, T]
    scores.masked_fill_(~mask, float("-inf"))
    top = scores.amax(-1, keepdim=True)                                    # [Hkv, G, T, 1]
    if diagonal:
        own = torch.stack([(q * k).sum(-1) for k, _ in diagonal], -1).float()  # [Hkv, G, T, k]
        top = torch.maximum(top, own.amax(-1, keepdim=True))
    top = top.detach()  # any shift gives the same softmax; no gradient through it
    weights = scores.sub_(top).exp_()                                      # unnormalized
    total = weights.sum(-1, keepdim=True)
    out = torch.matmul(weights.to(v0.dtype), v0).float()                   # [Hkv, G, T, D]
    if diagonal:
        own = torch.exp(own - top)
        total = total + own.sum(-1, keepdim=True)
        for j, (_, v) in enumerate(diagonal):
            out = out + own[..., j:j + 1] * v
    return (out / total).to(v0.dtype)


# The fused path (``sdpa``, ``flex``): one call of PyTorch's attention kernel per step over
# the step-0 keys, with the diagonal keys of steps 1..k folded in exactly through a "sink".
#
# A query row t of step k attends to the shared step-0 keys i (rows <= t of its sample,
# scores s_i) and to its own keys of steps 1..k (scores s_j, one set per row, which no
# kernel takes as shared keys). The kernel gets one extra key, the sink, whose score for
# row t is c_t = max_j s_j (detached) and whose value is a unit vector e in an extra column:
#
#   kernel output   o = sum_i e^(s_i) v_i / (S + e^c),   m = e^c / (S + e^c)  (the e column)
#   own keys        D = sum_j e^(s_j - c) v_j,           Z = sum_j e^(s_j - c)  (>= 1)
#   attention       (sum_i e^(s_i) v_i + e^c D) / (S + e^c Z) = (o + m D) / (1 + m (Z - 1))
#
# with S = sum_i e^(s_i). The result does not depend on c, so c carries no gradient (as the
# row max of ``ttt_attention``); 1 + m (Z - 1) >= 1 has no cancellation; every term is
# differentiable through the kernel's output. The sink score reaches the kernel as an extra
# coordinate of the query (c / scale) against 1 in the sink key, so no [T, T] mask or bias
# carries it. The sink is key 0, and a dummy query row 0 keeps the problem square, so a
# block of one sample is plain causal attention (``is_causal``: no mask at all).

def _sink_problem(q, cache, scale):
    """Queries, keys and values [1, heads, 1 + n, D + pad] with the sink of step k, the
    own-key sums D [Hkv, G, n, D] and Z [Hkv, G, n] in float32."""
    (k0, v0), diagonal = cache[0], cache[1:]
    hkv, g, n, d = q.shape
    dv = v0.shape[-1]  # the value head size: d, or MLA's v_head_dim
    pad = 1 if q.device.type == "cpu" else 8  # CUDA kernels want head dims in multiples of 8
    own = torch.stack([(q * k).sum(-1) for k, _ in diagonal], -1).float() * scale  # [Hkv, G, n, k]
    top = (own.amax(-1).detach() / scale).to(q.dtype)      # c / scale, as the kernel will see it
    c = top.float() * scale
    weights = torch.exp(own - c[..., None])                # [Hkv, G, n, k]
    total = weights.sum(-1)                                # Z
    # float32 weights times v in its dtype: float32 D, and v itself kept for backward
    values = sum(weights[..., j:j + 1] * v for j, (_, v) in enumerate(diagonal))  # D
    query = torch.cat([q, top[..., None], q.new_zeros(hkv, g, n, pad - 1)], -1)
    query = F.pad(query, (0, 0, 1, 0))                     # dummy row 0 (sees only the sink)
    sink = q.new_zeros(hkv, 1, 1, d + pad)
    sink[..., d] = 1
    sink_value = sink
    if dv != d:
        sink_value = q.new_zeros(hkv, 1, 1, dv + pad)
        sink_value[..., dv] = 1
    key = torch.cat([sink, F.pad(k0, (0, pad))], -2)     # [Hkv, 1, 1 + n, D + pad]
    value = torch.cat([sink_value, F.pad(v0, (0, pad))], -2)  # [Hkv, 1, 1 + n, Dv + pad]
    heads = hkv * g
    return (query.reshape(1, heads, n + 1, d + pad), key.reshape(1, hkv, n + 1, d + pad),
            value.reshape(1, hkv, n + 1, dv + pad), values, total)


def _combine(out, values, total, shape, dtype):
    """(o + m D) / (1 + m (Z - 1)) from the kernel's output [1, heads, 1 + n, Dv + pad]."""
    hkv, g, n, _ = shape
    d = values.shape[-1]  # the value head size
    out = out.reshape(hkv, g, n + 1, -1)[..., 1:, :]
    o, m = out[..., :d].float(), out[..., d].float()
    return ((o + m[..., None] * values) / (1 + m * (total - 1))[..., None]).to(dtype)


def sdpa_ttt_attention(q: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]],
                       block: "AttentionBlock", scale: float, kernels: "Kernels | None" = None
                       ) -> torch.Tensor:
    """What ``ttt_attention`` computes, through ``F.scaled_dot_product_attention`` (fused
    kernels: no [heads, n, n] scores kept). Shapes as ``ttt_attention``."""
    (k0, v0), diagonal = cache[0], cache[1:]
    hkv, g, n, d = q.shape
    dv = v0.shape[-1]
    if not diagonal:  # step 0: the step-0 keys alone
        out = F.scaled_dot_product_attention(
            q.reshape(1, hkv * g, n, d), k0.reshape(1, hkv, n, d), v0.reshape(1, hkv, n, dv),
            attn_mask=block.mask, is_causal=block.mask is None, scale=scale, enable_gqa=True)
        return out.reshape(hkv, g, n, dv)
    kernels = kernels or EAGER
    query, key, value, values, total = kernels.sink_problem(q, cache, scale)
    mask = block.sink_mask()
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                         is_causal=mask is None, scale=scale, enable_gqa=True)
    return kernels.combine(out, values, total, q.shape, v0.dtype)


def ttt_mask_mod(segments: torch.Tensor, sink: bool):
    """flex attention's mask_mod of the TTT pattern over rows with samples ``segments`` [n]:
    same sample and key row <= query row; with ``sink``, index 0 is the sink key (seen by
    every query) and the dummy query row, rows start at 1 (``sdpa_ttt_attention``)."""
    if not sink:
        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (segments[q_idx] == segments[kv_idx])
        return mask_mod
    shifted = F.pad(segments, (1, 0), value=-1)  # row r - 1's sample at index r

    def sink_mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx == 0) | ((kv_idx <= q_idx) & (shifted[q_idx] == shifted[kv_idx]))
    return sink_mask_mod


_FLEX = {}


def _flex():
    """flex_attention, compiled on first use where it runs (CUDA; eager elsewhere)."""
    if not _FLEX:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        _FLEX["create_block_mask"] = create_block_mask
        _FLEX["plain"] = flex_attention
        _FLEX["compiled"] = torch.compile(flex_attention, dynamic=True)
    return _FLEX


def flex_ttt_attention(q: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]],
                       block: AttentionBlock, scale: float) -> torch.Tensor:
    """What ``sdpa_ttt_attention`` computes, through flex attention with a block mask of the
    TTT pattern: packed samples in one block skip each other's tiles, no [n, n] mask."""
    flex = _flex()
    (k0, v0), diagonal = cache[0], cache[1:]
    hkv, g, n, d = q.shape
    dv = v0.shape[-1]
    attend = flex["compiled"] if q.is_cuda else flex["plain"]
    key = "sink" if diagonal else "plain"
    if key not in block._masks:
        size = n + 1 if diagonal else n
        block._masks[key] = flex["create_block_mask"](
            ttt_mask_mod(block.segments, bool(diagonal)), None, None, size, size,
            device=q.device)
    if not diagonal:
        out = attend(q.reshape(1, hkv * g, n, d), k0.reshape(1, hkv, n, d),
                     v0.reshape(1, hkv, n, dv), block_mask=block._masks[key], scale=scale,
                     enable_gqa=True)
        return out.reshape(hkv, g, n, dv)
    query, key_, value, values, total = _sink_problem(q, cache, scale)
    out = attend(query, key_, value, block_mask=block._masks[key], scale=scale, enable_gqa=True)
    return _combine(out, values, total, q.shape, v0.dtype)


def attend(implementation: str, q: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]],
           blocks: list["AttentionBlock"], scale: float, kernels: "Kernels | None" = None
           ) -> torch.Tensor:
    """The TTT attention of ``q`` [Hkv, G, T, D] over ``cache`` (its step's keys and values
    appended), block by block with ``implementation`` (ATTENTION): [Hkv, G, T, Dv]."""
    outs = []
    for block in blocks:
        a, b = block.start, block.end
        part = [(ck[..., a:b, :], cv[..., a:b, :]) for ck, cv in cache]
        if implementation == "eager":
            outs.append(ttt_attention(q[..., a:b, :], part, block.dense_mask(), scale))
        elif implementation == "sdpa":
            outs.append(sdpa_ttt_attention(q[..., a:b, :], part, block, scale, kernels))
        else:
            outs.append(flex_ttt_attention(q[..., a:b, :], part, block, scale))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)


def compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype autocast computes matmuls in (bf16 under bf16 autocast), so that
    several matmuls reading it share one cast instead of one each; unchanged without
    autocast. The same numbers either way."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind) and x.is_floating_point():
        return x.to(torch.get_autocast_dtype(kind))
    return x


@dataclass(frozen=True)
class Kernels:
    """The elementwise pieces of the drafter's step (norms, SwiGLU, RoPE, the fused TTT
    attention's sink), plain (:data:`EAGER`) or compiled into fused kernels by
    :func:`compile_drafter`: the same mathematics either way."""

    rms_norm: object = rms_norm
    gated_silu: object = gated_silu
    rotate: object = rotate
    sink_problem: object = _sink_problem
    combine: object = _combine


EAGER = Kernels()
RMSNorm.kernels = EAGER  # each layer's, until compile_drafter gives it the compiled ones
_COMPILED: list[Kernels] = []


def compiled_kernels() -> Kernels:
    """:data:`EAGER`'s functions through ``torch.compile`` (shapes dynamic, so a new number of
    rows does not compile again), made once per process."""
    if not _COMPILED:
        import torch._dynamo

        # one graph per function and number of cached steps (the sink's), train and eval
        for limit in ("cache_size_limit", "recompile_limit"):
            if hasattr(torch._dynamo.config, limit):
                setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 64))
        _COMPILED.append(Kernels(**{name: torch.compile(getattr(EAGER, name), dynamic=True)
                                    for name in Kernels.__dataclass_fields__}))
    return _COMPILED[0]


def compile_drafter(model: nn.Module, on: bool = True) -> None:
    """Give every layer of ``model`` the compiled kernels (``on``) or the plain ones."""
    kernels = compiled_kernels() if on else EAGER
    for module in model.modules():
        if isinstance(module, (RMSNorm, MLP, Attention, MLAAttention)):
            module.kernels = kernels


class Attention(nn.Module):
    """GQA self-attention whose q/k/v read the 2H-wide [embedding, hidden] input."""

    input_projections = ("q_proj", "k_proj", "v_proj")  # those reading the 2H-wide input
    kernels = EAGER

    def __init__(self, config: DrafterConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = (config.num_attention_heads,
                                                    config.num_key_value_heads, d)
        self.q_proj = nn.Linear(2 * h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.implementation = "sdpa"  # ATTENTION: the same math, another kernel

    def forward(self, x, cos, sin, blocks, cache):
        rows = x.shape[0]
        group = self.heads // self.kv_heads
        x = compute_dtype(x)  # cast once for the three projections (autocast would, thrice)
        # query head j*G+g reads KV head j (vLLM/HF GQA order)
        q = self.q_proj(x).view(rows, self.kv_heads, group, self.head_dim).permute(1, 2, 0, 3)
        k = self.k_proj(x).view(rows, self.kv_heads, 1, self.head_dim).permute(1, 2, 0, 3)
        v = self.v_proj(x).view(rows, self.kv_heads, 1, self.head_dim).permute(1, 2, 0, 3)
        q = self.kernels.rotate(q, cos, sin)
        cache.append((self.kernels.rotate(k, cos, sin), v))
        scale = self.head_dim ** -0.5
        out = attend(self.implementation, q, cache, blocks, scale, self.kernels)  # [Hkv, G, T, D]
        return self.o_proj(out.permute(2, 0, 1, 3).reshape(rows, self.heads * self.head_dim))


class MLAAttention(nn.Module):
    """Multi-head latent attention as vLLM's ``DeepseekV2MLAAttention`` computes it for the
    EAGLE-3 layer (``input_size`` 2H), with its parameter names::

        q        = q_b_proj(q_a_layernorm(q_a_proj(x)))       [heads, nope + rope]
        c, k_pe  = kv_a_proj_with_mqa(x)                      latent [kv_lora], k_pe [rope]
        k_nope, v = kv_b_proj(kv_a_layernorm(c))              [heads, nope], [heads, v_head]
        k        = [k_nope, rotate(k_pe)] (k_pe shared by all heads), q = [q_nope, rotate(q_pe)]

    RoPE in GPT-J layout on the rope parts only. Every head has its own key and value (vLLM's
    decode absorbs kv_b_proj into q and the output; the same attention), so the TTT attention
    runs with G = 1 and value heads of v_head_dim."""

    kernels = EAGER

    def __init__(self, config: DrafterConfig):
        super().__init__()
        h, n = config.hidden_size, config.num_attention_heads
        self.heads, self.q_lora_rank, self.kv_lora_rank = n, config.q_lora_rank, config.kv_lora_rank
        self.nope, self.rope, self.v_dim = (config.qk_nope_head_dim, config.qk_rope_head_dim,
                                            config.v_head_dim)
        qk = self.nope + self.rope
        if not self.q_lora_rank:  # DrafterConfig.from_target refuses such a target (with_mla)
            raise ValueError("an MLA drafter needs a q_lora_rank: vLLM 0.32 loads none without")
        self.q_a_proj = nn.Linear(2 * h, self.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(self.q_lora_rank, n * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * h, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, n * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(n * self.v_dim, h, bias=False)
        self.input_projections = ("q_a_proj", "kv_a_proj_with_mqa")
        self.scale = mla_softmax_scale(config)
        self.implementation = "sdpa"  # ATTENTION: the same math, another kernel

    def forward(self, x, cos, sin, blocks, cache):
        """x [T, 2H]; cos, sin [T, rope] (GPT-J layout) -> [T, H]; appends this step's
        keys [heads, 1, T, nope + rope] and values [heads, 1, T, v_head] to ``cache``."""
        rows = x.shape[0]
        x = compute_dtype(x)  # cast once for both projections that read it
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(rows, self.heads, self.nope + self.rope)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(rows, self.heads,
                                                              self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_pe = rotate_pairs(q[..., self.nope:], cos[:, None], sin[:, None])
        k_pe = rotate_pairs(k_pe, cos, sin)[:, None].expand(rows, self.heads, self.rope)
        q = torch.cat([q[..., :self.nope], q_pe], dim=-1).permute(1, 0, 2)[:, None]
        k = torch.cat([k_nope, k_pe], dim=-1).permute(1, 0, 2)[:, None]  # [heads, 1, T, qk]
        cache.append((k, v.permute(1, 0, 2)[:, None]))                    # v [heads, 1, T, Dv]
        out = attend(self.implementation, q, cache, blocks, self.scale,
                     self.kernels)                                        # [heads, 1, T, Dv]
        return self.o_proj(out.permute(2, 0, 1, 3).reshape(rows, self.heads * self.v_dim))


class MLP(nn.Module):
    kernels = EAGER

    def __init__(self, config: DrafterConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        x = compute_dtype(x)  # cast once for both projections (autocast would, twice)
        return self.down_proj(self.kernels.gated_silu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    """vLLM's ``LlamaDecoderLayer`` of llama_eagle3 at layer_idx 0 plus the final residual add;
    with MLA attention, deepseek_eagle3's ``DeepseekV2Eagle3DecoderLayer`` (the same
    norms, residuals and dense SiLU MLP around another attention)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAAttention(config) if config.attention_kind == "mla" else Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.norm_before_residual = config.norm_before_residual

    def forward(self, embeds, hidden, cos, sin, blocks, cache):
        """embeds, hidden [T, H] -> the pre-norm hidden state [T, H]."""
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)              # [T, 2H]
        residual = normed if self.norm_before_residual else hidden
        residual = residual + self.self_attn(x, cos, sin, blocks, cache)
        return residual + self.mlp(self.post_attention_layernorm(residual))


# -- the drafter -----------------------------------------------------------------------------

BLOCK_ROWS = 512
ATTENTION = ("eager", "sdpa", "flex")
ATTENTION_KINDS = ("llama", "mla")  # train.drafter_attention


def resolve_attention(name: str, device: torch.device | str) -> str:
    """``train.attention``: ``auto`` is ``sdpa``, the fused kernel, equal to ``eager`` within
    float rounding and without its [heads, n, n] scores (benchmarks/results/train.md for
    the speed); ``flex`` runs on CUDA only (PyTorch has no flex attention backward on CPU)."""
    if name == "auto":
        return "sdpa"
    if name not in ATTENTION:
        raise ValueError(f"attention {name!r} is none of auto, {', '.join(ATTENTION)}")
    if name == "flex" and torch.device(device).type != "cuda":
        raise ValueError("attention flex needs a CUDA device (PyTorch's flex attention has no "
                         "backward pass on CPU); use sdpa")
    return name


@dataclass(eq=False)
class AttentionBlock:
    """Rows ``start:end`` of the batch: whole samples that attend among themselves only.
    ``segments`` [n] names each row's sample; ``mask`` [n, n] bool (same sample and key row
    <= query row) is None for a block of one sample, plain causal attention."""
    start: int
    end: int
    segments: torch.Tensor
    mask: torch.Tensor | None
    _masks: dict = field(default_factory=dict, repr=False)

    def dense_mask(self) -> torch.Tensor:
        """The [n, n] mask, also for one sample (``eager`` needs it)."""
        if self.mask is not None:
            return self.mask
        if "causal" not in self._masks:
            n = self.end - self.start
            self._masks["causal"] = torch.ones(n, n, dtype=torch.bool,
                                               device=self.segments.device).tril()
        return self._masks["causal"]

    def sink_mask(self) -> torch.Tensor | None:
        """The mask [1 + n, 1 + n] of the fused path with its sink (key 0, seen by every
        query) and dummy query row 0; None for one sample (plain causal does it)."""
        if self.mask is None:
            return None
        if "sink" not in self._masks:
            n = self.end - self.start
            mask = torch.zeros(n + 1, n + 1, dtype=torch.bool, device=self.mask.device)
            mask[:, 0] = True
            mask[1:, 1:] = self.mask
            self._masks["sink"] = mask
        return self._masks["sink"]


def attention_blocks(segments: torch.Tensor, block_rows: int = BLOCK_ROWS
                     ) -> list[AttentionBlock]:
    """Consecutive whole samples grouped into blocks of at most ``block_rows`` rows (or one
    longer sample), each with its mask (same sample, key row <= query row; None when the
    block is one sample). Attention never crosses samples, so blocks are computed apart:
    short packed samples cost far less than one [T, T] mask over the whole batch."""
    _, lengths = torch.unique_consecutive(segments, return_counts=True)
    spans, start, end, samples = [], 0, 0, 0
    for length in lengths.tolist():
        if end > start and end + length - start > block_rows:
            spans.append((start, end, samples))
            start, samples = end, 0
        end += length
        samples += 1
    spans.append((start, end, samples))
    blocks = []
    for a, b, samples in spans:
        seg = segments[a:b]
        mask = None
        if samples > 1:
            causal = torch.ones(b - a, b - a, dtype=torch.bool, device=segments.device).tril()
            mask = causal & (seg[:, None] == seg[None, :])
        blocks.append(AttentionBlock(a, b, seg, mask))
    return blocks


class Eagle3Drafter(nn.Module):
    """Parameters and persistent buffers are named as in the vLLM checkpoint (export.py)."""

    def __init__(self, config: DrafterConfig, embed_tokens: torch.Tensor, d2t: torch.Tensor,
                 t2d: torch.Tensor, attention: str = "sdpa"):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.register_buffer("embed_tokens", embed_tokens, persistent=False)   # [V, H], frozen
        if config.norm_before_fc:  # vLLM's input_norm: one norm over the concatenated [A*Ht]
            self.input_norm = RMSNorm(config.fc_input_size, config.rms_norm_eps)
        if config.fc_norm:  # one norm per aux feature [Ht], vLLM's fc_norm.i
            self.fc_norm = nn.ModuleList(RMSNorm(config.target_hidden_size, config.rms_norm_eps)
                                         for _ in config.aux_layer_ids)
        self.fc = nn.Linear(config.fc_input_size, h, bias=False)
        self.midlayer = DecoderLayer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", d2t.to(torch.int64))        # [Vd] target id = i + d2t[i]
        self.register_buffer("t2d", t2d.to(torch.bool))         # [V] in the draft vocabulary
        inv_freq, self.rope_scale = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention = attention

    CONSTANT_BUFFERS = ("embed_tokens", "d2t", "t2d", "inv_freq")

    @property
    def attention(self) -> str:
        """Which kernel computes the TTT attention (ATTENTION): the same math either way,
        so it is no part of the checkpoint."""
        return self.midlayer.self_attn.implementation

    @attention.setter
    def attention(self, name: str) -> None:
        if name not in ATTENTION:
            raise ValueError(f"attention {name!r} is none of {', '.join(ATTENTION)}")
        self.midlayer.self_attn.implementation = name

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] of ``positions``: NeoX layout (halves), or for MLA the GPT-J
        layout (each angle twice in a row) over the rope part of the head, D = qk_rope_head_dim."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]        # [T, D/2]
        if self.config.attention_kind == "mla":
            angles = angles.repeat_interleave(2, dim=-1)                   # [T, D]
        else:
            angles = torch.cat([angles, angles], dim=-1)                   # [T, D]
        return angles.cos() * self.rope_scale, angles.sin() * self.rope_scale

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The step-0 hidden state [T, H] from the aux features [T, A*Ht], as vLLM's
        ``combine_hidden_states``: input_norm (norm_before_fc), then fc_norm, then fc."""
        if self.config.norm_before_fc:
            aux_hidden = self.input_norm(aux_hidden)
        if self.config.fc_norm:
            chunks = aux_hidden.chunk(len(self.fc_norm), dim=-1)
            aux_hidden = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux_hidden)

    def draft_step(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, blocks: list[AttentionBlock], cache: list,
                   rows: torch.Tensor | int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafting step over all rows: (the final-normed state lm_head reads, of
        ``rows`` only when given; the state [T, H] the next step reads: the pre-norm one, or
        with norm_output the normed one, as vLLM's forward returns them)."""
        out = self.midlayer(embeds, hidden, cos, sin, blocks, cache)           # pre-norm
        if self.config.norm_output:
            normed = self.norm(out)
            return (normed if rows is None else normed[rows]), normed
        return self.norm(out if rows is None else out[rows]), out

    def forward(self, aux_hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                segments: torch.Tensor, logit_rows: list[torch.Tensor] | None = None,
                heads: bool = True) -> list[torch.Tensor]:
        """Run ``K = len(input_ids)`` TTT steps over a packed batch of T rows.

        aux_hidden  [T, A*Ht]  the target's aux features of each row
        input_ids   [K, T]     the token each row embeds at step k (token t+1+k of its sample)
        positions   [T]        position of the row within its sample (RoPE of step k: + k)
        segments    [T]        which packed sample the row belongs to
        logit_rows  K x [n_k]  rows whose logits each step returns (all rows when None)
        heads       False: the final-normed states lm_head reads instead of the logits
                    (the fused loss applies lm_head itself: ``eaglet.ttt_loss``)
        returns     K x [n_k, Vd] draft-vocabulary logits (or K x [n_k, H] states)
        """
        # flex attention skips other samples' tiles itself: one block for the whole batch
        blocks = attention_blocks(segments, len(segments) if self.attention == "flex"
                                  else BLOCK_ROWS)
        hidden = self.combine(aux_hidden)                                        # [T, H]
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        logits = []
        for step, ids in enumerate(input_ids):
            cos, sin = self.rope(positions + step)
            embeds = self.embed_tokens[ids].to(hidden.dtype)
            normed, hidden = self.draft_step(embeds, hidden, cos, sin, blocks, cache,
                                             None if logit_rows is None else logit_rows[step])
            logits.append(self.lm_head(normed) if heads else normed)
        return logits


def init_lm_head(model: Eagle3Drafter, target_lm_head: torch.Tensor) -> None:
    """Start lm_head from the target's lm_head rows of the draft vocabulary [Vd, H]."""
    with torch.no_grad():
        model.lm_head.weight.copy_(target_lm_head.to(model.lm_head.weight.dtype))


# -- starting from the target's layer (train.layer_init: target) ----------------------------

# the drafter's layer in two parts, each with the tensors of a target layer it starts from:
# a part is taken only when the target's module holds exactly these (a Llama-style layer)
LAYER_PARTS = {
    "attention": ("input_layernorm.", "self_attn."),
    "mlp": ("post_attention_layernorm.", "mlp."),
}
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
IGNORED = ("rotary_emb.inv_freq",)  # a buffer old Llama checkpoints store, not a weight


def _is_input_projection(attn: nn.Module, name: str) -> bool:
    """Whether parameter ``name`` of the attention reads the [embedding, hidden] input."""
    return name.removesuffix(".weight") in attn.input_projections


def target_layer_shapes(model: Eagle3Drafter) -> dict[str, dict[str, tuple[int, ...]]]:
    """By part, the shape each target tensor must have to start the drafter's layer: the
    drafter's own shapes, the hidden half [.., H] of the projections that read [embedding,
    hidden] (q/k/v; MLA's q_a_proj and kv_a_proj_with_mqa)."""
    h = model.config.hidden_size
    attn, mlp = model.midlayer.self_attn, model.midlayer.mlp
    return {
        "attention": {"input_layernorm.weight": (h,),
                      **{f"self_attn.{n}": ((p.shape[0], h) if _is_input_projection(attn, n)
                                            else tuple(p.shape))
                         for n, p in attn.named_parameters()}},
        "mlp": {"post_attention_layernorm.weight": (h,),
                **{f"mlp.{n}.weight": tuple(getattr(mlp, n).weight.shape)
                   for n in ("gate_proj", "up_proj", "down_proj")}},
    }


def _patterns(names: list[str], limit: int = 4) -> str:
    """Tensor names with their indices folded (``mlp.experts.N.up_proj.weight x384``), the
    first ``limit`` of them: an MoE layer's thousands of names in one readable line."""
    counts: dict[str, int] = {}
    for name in names:
        folded = re.sub(r"\.\d+\.", ".N.", name)
        counts[folded] = counts.get(folded, 0) + 1
    shown = [f"{n} x{c}" if c > 1 else n for n, c in list(counts.items())[:limit]]
    more = len(counts) - limit
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def _misfit(expected: dict[str, tuple[int, ...]], meta: dict[str, tuple[tuple[int, ...], str]],
            own: list[str]) -> str:
    """Why a target module (its tensors ``own``) does not fit the drafter's ``expected``
    tensors ('' when it does): what is missing, stored quantized, shaped otherwise, or extra."""
    problems = []
    missing = [name for name in expected if name not in meta]
    for name in missing:  # a quantized layout stores other tensors in the weight's place
        module = name.removesuffix("weight")
        stored = [n.removeprefix(module) for n in own if n.startswith(module)]
        if stored:
            problems.append(f"{module}weight is stored as {', '.join(stored)} (quantized)")
    if missing:
        problems.append(f"no {_patterns(missing)}")
    for name, shape in expected.items():
        if name not in meta:
            continue
        stored, dtype = meta[name]
        if dtype not in FLOAT_DTYPES:
            problems.append(f"{name} is stored as {dtype} (quantized)")
        elif tuple(stored) != shape:
            problems.append(f"{name} is {list(stored)} where the drafter needs {list(shape)}")
    extra = sorted(name for name in own if name not in expected)
    if extra:
        problems.append(f"also {_patterns(extra)}, which the drafter's layer lacks")
    return "; ".join(problems)


@dataclass
class LayerFit:
    """Which parts of the drafter's layer a target layer can start (``parts``, with the
    target tensors they read) and why the others cannot (``reasons``: part -> why)."""
    layer: int | None
    parts: dict[str, list[str]]
    reasons: dict[str, str]
    style: str = "Llama-style"  # the drafter's layer, as the log names it

    @property
    def names(self) -> list[str]:
        """The target tensors to read: the fitting parts' and the final norm (when any fits)."""
        return [n for names in self.parts.values() for n in names] + (["norm"] if self.parts else [])

    def record(self) -> dict:
        """What the run reports (``train``'s summary): the parts taken and why others were not."""
        return {"setting": "target", "layer": self.layer, "from_target": list(self.parts),
                "random": dict(self.reasons)}

    def message(self) -> str:
        """One log line: what the drafter's layer starts from and, where not all of it is the
        target's, why and how to silence it."""
        layer = "the target's last layer" if self.layer is None else f"the target's layer {self.layer}"
        reasons = set(self.reasons.values())
        why = (next(iter(reasons)) if len(reasons) == 1 and len(self.reasons) > 1 else
               "; ".join(f"{part}: {reason}" for part, reason in self.reasons.items()))
        if not self.reasons:
            return (f"layer_init target: the drafter's layer starts as {layer} (attention, mlp "
                    f"and final norm) applied to the deepest aux feature")
        silence = "train.layer_init: random silences this"
        if not self.parts:
            return (f"layer_init target: {layer} does not fit the drafter's {self.style} layer, "
                    f"which starts random ({why}); {silence}")
        taken, left = " and ".join(self.parts), " and ".join(self.reasons)
        return (f"layer_init target: the drafter's {taken} and final norm start from {layer} "
                f"(fc passes the deepest aux feature through); its {left} starts random "
                f"({why}); {silence}")


def fit_target_layer(model: Eagle3Drafter, meta: dict[str, tuple[tuple[int, ...], str]],
                     layer: int | None = None) -> LayerFit:
    """Which parts of the drafter's layer a target layer fits, from its tensors' names,
    shapes and dtypes (``target_layer_meta``, or ``tensor_meta`` of loaded weights): MLA
    attention, MoE experts, other shapes and quantized weights do not."""
    h = model.config.hidden_size
    style = "MLA" if model.config.attention_kind == "mla" else "Llama-style"
    names = [n for n in meta if n != "norm" and not n.endswith(IGNORED)]
    if not names:
        reason = "the checkpoint holds no tensor of that layer"
        return LayerFit(layer, {}, {part: reason for part in LAYER_PARTS}, style)
    norm = ("the checkpoint holds no final norm" if "norm" not in meta
            else _misfit({"norm": (h,)}, meta, []))
    if norm:
        return LayerFit(layer, {}, {part: norm for part in LAYER_PARTS}, style)
    unclaimed = [n for n in names
                 if not any(n.startswith(p) for prefixes in LAYER_PARTS.values() for p in prefixes)]
    parts, reasons = {}, {}
    for part, expected in target_layer_shapes(model).items():
        own = [n for n in names if n.startswith(LAYER_PARTS[part])]
        if part == "mlp":  # what follows attention: an MoE block by another name (Mixtral's
            own += unclaimed  # block_sparse_moe), extra norms
        reason = _misfit(expected, meta, own)
        if reason:
            reasons[part] = reason
        else:
            parts[part] = list(expected)
    return LayerFit(layer, parts, reasons, style)


def tensor_meta(weights: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Shape and dtype (without ``torch.``) of loaded weights, as ``target_layer_meta`` gives them."""
    return {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in weights.items()}


def init_from_target_layer(model: Eagle3Drafter, weights: dict[str, torch.Tensor],
                           fit: LayerFit | None = None) -> LayerFit:
    """Start the drafter as the target's layer ``weights`` (``load_target_layer``) applied to
    the deepest aux feature: ``fc`` passes that feature through, the hidden half of the input
    projections (q/k/v, or MLA's), the rest of the attention, the MLP and the norms are the
    layer's, and the final norm is the target's. The embedding half of the input projections
    keeps its random init: the target layer has no such input.
    Only the parts that fit (``fit``, judged from ``weights`` when not given) are copied; a
    layer of which none fits leaves the drafter as it was (random). With the EAGLE-3.1 norms
    (fc_norm, norm_before_fc) fc passes the normed feature through: a start, not the layer."""
    fit = fit or fit_target_layer(model, tensor_meta(weights))
    h = model.config.hidden_size
    layer = model.midlayer
    with torch.no_grad():
        if "attention" in fit.parts:
            for name, param in layer.self_attn.named_parameters():
                own = param[:, h:] if _is_input_projection(layer.self_attn, name) else param
                own.copy_(weights[f"self_attn.{name}"])
            layer.hidden_norm.weight.copy_(weights["input_layernorm.weight"])
        if "mlp" in fit.parts:
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.mlp, name).weight.copy_(weights[f"mlp.{name}.weight"])
            layer.post_attention_layernorm.weight.copy_(weights["post_attention_layernorm.weight"])
        if fit.parts:
            model.norm.weight.copy_(weights["norm"])
            model.fc.weight.zero_()
            model.fc.weight[:, -h:].copy_(torch.eye(h))
    return fit


def init_from_target(model: Eagle3Drafter, target_dir, layer: int) -> LayerFit:
    """``train.layer_init: target``: judge the target's layer ``layer`` from its checkpoint's
    headers, then read only the tensors of the parts that fit (an MoE layer's experts are
    never read) and start the drafter from them (``init_from_target_layer``)."""
    from eaglet.target import load_target_layer, target_layer_meta

    fit = fit_target_layer(model, target_layer_meta(target_dir, layer), layer)
    if fit.parts:
        init_from_target_layer(model, load_target_layer(target_dir, layer, fit.names), fit)
    return fit


def count_flops_per_token(config: DrafterConfig, ttt_steps: int, context: int) -> float:
    """Training FLOPs per packed token (forward + backward = 3x forward, every row scored),
    plus the teacher's head; ``context`` is the mean number of step-0 keys a query sees."""
    h, d = config.hidden_size, config.head_dim
    layer = (2 * h * (config.num_attention_heads + 2 * config.num_key_value_heads) * d
             + config.num_attention_heads * d * h + 3 * h * config.intermediate_size
             + h * config.draft_vocab_size)
    per_key = 4 * config.num_attention_heads * d  # q.k and the weighted v, per key seen
    if config.attention_kind == "mla":
        layer, per_key = mla_layer_weights(config), 2 * config.num_attention_heads * (
            config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)
    forward = 2 * config.fc_input_size * h
    for step in range(ttt_steps):
        forward += 2 * layer + per_key * (context + step)
    return 3 * forward + 2 * h * config.draft_vocab_size


def mla_layer_weights(config: DrafterConfig) -> int:
    """Weights a token passes through in the MLA layer (its multiply-adds), lm_head included."""
    h, n = config.hidden_size, config.num_attention_heads
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    q = 2 * h * config.q_lora_rank + config.q_lora_rank * n * qk
    kv = (2 * h * (config.kv_lora_rank + config.qk_rope_head_dim)
          + config.kv_lora_rank * n * (config.qk_nope_head_dim + config.v_head_dim))
    return (q + kv + n * config.v_head_dim * h + 3 * h * config.intermediate_size
            + h * config.draft_vocab_size)


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())

