"""Shapes and sizes, torch-free: a target and drafter shape (``Shape``, its presets and its
reading from a config.json), their parameter counts, the TTT loss's chunk, and the target's
weights as a server holds them (``target_size``). ``eaglet plan`` and evaluate's placement read
them."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from eaglet.core import methods
from eaglet.core.dtypes import BYTES, SAFETENSORS_BYTES, SAFETENSORS_FLOATS, SERVED_BYTES
from eaglet.target.checkpoint import safetensors_tensors

# -- the target's size, as a server holds it (evaluate's placement reads it too) ----------


@dataclass
class TargetSize:
    """The target's weights as a vLLM server holds them (float tensors in the serving dtype,
    quantized ones as stored) and as a float32 transformers forward would (the offline
    replay's), and what they were read from."""

    served: int
    float32: int
    source: str


def config_params(config: dict) -> int | None:
    """The target's parameter count from its config.json (`eaglet plan`'s, which counts a
    mixture of experts' routed and shared experts); None where the config lacks the shape."""
    try:
        return target_params(shape_from_target_config(config, 0, "target"))
    except (KeyError, TypeError, ZeroDivisionError):
        return None


def target_size(target_dir: str | os.PathLike, dtype: str) -> TargetSize | None:
    """The target's size: from its safetensors headers (every tensor's dtype and shape; no
    weight is read), else from its config.json's parameter count; None where neither is
    there. ``dtype`` is target.dtype, the dtype the server casts float weights to."""
    directory = Path(target_dir)
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if files:
        served = params = packed = 0
        for file in files:
            for entry in safetensors_tensors(file).values():
                kind, numel = entry["dtype"], math.prod(entry["shape"])
                stored = numel * SAFETENSORS_BYTES.get(kind, 1)
                cast = kind in SAFETENSORS_FLOATS and dtype in SERVED_BYTES
                served += numel * SERVED_BYTES[dtype] if cast else stored
                if kind in SAFETENSORS_FLOATS or kind.startswith("F8"):
                    params += numel
                else:
                    packed += stored
        # integer tensors are packed quantized weights (INT4 experts: 2 a byte), which a
        # transformers forward dequantizes
        return TargetSize(
            served, 4 * (params + 2 * packed), f"its safetensors headers ({len(files)} files)"
        )
    config = directory / "config.json"
    params = config_params(json.loads(config.read_text())) if config.is_file() else None
    if params is None:
        return None
    return TargetSize(
        params * SERVED_BYTES.get(dtype, 2),
        params * 4,
        f"the parameter count of its config.json ({params / 1e9:.1f}B)",
    )


DTYPE_BYTES = {**BYTES, "auto": 2}
NUM_AUX = 3


@dataclass
class Shape:
    """A target and the drafter trained for it."""

    name: str
    hidden: int  # the target's hidden size (= the drafter's, as from_target reads it)
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int  # the target's vocabulary
    draft_vocab: int
    tied_embeddings: bool = False
    # the drafter layer, when it differs from the target's (None: the target's)
    drafter_heads: int | None = None
    drafter_kv_heads: int | None = None
    drafter_intermediate: int | None = None
    # the target's parameter count when the shape's formula does not hold
    target_params: int | None = None
    assumptions: list[str] = field(default_factory=list)
    # multi-head latent attention (DeepSeek-V2/V3, Kimi-K2); kv_lora_rank 0: none
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # a mixture of experts (experts 0: dense): routed experts of width expert_intermediate and
    # shared_experts of the same width in every layer after the first dense_layers
    experts: int = 0
    expert_intermediate: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    # the routed experts as the server loads them: bits a weight plus one scale of
    # expert_scale_bytes a group of expert_group weights (compressed-tensors pack-quantized:
    # a bfloat16 scale; mxfp4: an e8m0 exponent); None: target.dtype
    expert_bits: int | None = None
    expert_group: int = 32
    expert_scale_bytes: int = 2
    expert_format: str | None = None  # the quantization's name, as its config says it
    # train.drafter_attention: llama (GQA of heads x head_dim) or mla (the target's MLA)
    drafter_attention: str = "llama"
    # train.drafter_variant (its norms) and train.method (eaglet.core.methods)
    drafter_variant: str = methods.EAGLE3_LAYER.name
    method: str = methods.DEFAULT.name
    dflash_layers: int = 1  # train.dflash_layers (method dflash)

    @property
    def mla(self) -> bool:
        """Whether the drafter's attention is MLA (``drafter.with_mla``)."""
        return self.drafter_attention == "mla"

    @property
    def d_heads(self) -> int:
        return self.heads if self.mla else self.drafter_heads or self.heads

    @property
    def d_kv_heads(self) -> int:
        # MLA: a key and a value a head
        return self.heads if self.mla else self.drafter_kv_heads or self.kv_heads

    @property
    def d_qk_dim(self) -> int:
        """The drafter's query/key head size."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def d_v_dim(self) -> int:
        """The drafter's value head size."""
        return self.v_head_dim if self.mla else self.head_dim

    @property
    def d_intermediate(self) -> int:
        return self.drafter_intermediate or self.intermediate

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.experts else 0


def with_drafter(
    s: Shape,
    attention: str,
    variant: str | None = None,
    method: str | None = None,
    dflash_layers: int | None = None,
) -> Shape:
    """``s`` with the drafter ``train.drafter_attention``, ``train.drafter_variant`` and
    ``train.method`` build (None: ``s``'s own); refuses as ``drafter.with_mla`` and
    ``methods.make_drafter`` do where the target has no MLA that the drafter can take, or the
    method cannot be built so (:meth:`eaglet.core.methods.Method.refusal`)."""
    variant = s.drafter_variant if variant is None else variant
    method = s.method if method is None else method
    dflash_layers = s.dflash_layers if dflash_layers is None else dflash_layers
    record = methods.method(method)
    refused = record.refusal(attention, variant)
    if refused:
        raise ValueError(
            f"{refused}: plan with another --drafter-attention, --drafter-variant or --method"
        )
    if attention == "mla" and not (s.kv_lora_rank and s.q_lora_rank):
        raise ValueError(
            f"train.drafter_attention: mla needs a target with multi-head latent "
            f"attention and a q_lora_rank (DeepSeek-V2/V3, Kimi-K2); {s.name} has "
            f"none: plan with --drafter-attention llama"
        )
    return replace(
        s,
        drafter_attention=attention,
        drafter_variant=variant,
        method=method,
        dflash_layers=dflash_layers,
    )


PRESETS = {
    "llama-3.1-8b": Shape(
        "Llama-3.1-8B",
        hidden=4096,
        layers=32,
        heads=32,
        kv_heads=8,
        head_dim=128,
        intermediate=14336,
        vocab=128256,
        draft_vocab=32000,
    ),
    "kimi-k2.5": Shape(
        "Kimi-K2.5",
        hidden=7168,
        layers=61,
        heads=64,
        kv_heads=64,
        head_dim=112,
        intermediate=18432,
        vocab=163840,
        draft_vocab=32000,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        experts=384,
        expert_intermediate=2048,
        shared_experts=1,
        dense_layers=1,
        expert_bits=4,
        expert_group=32,
        assumptions=[
            "target: the text_config of moonshotai/Kimi-K2.5 (MLA, 384 routed experts of "
            "width 2048 and one shared in 60 layers, a dense first layer; the vision tower "
            "left out); the server loads the routed experts as INT4 with a bfloat16 scale a "
            "group of 32 (compressed-tensors, as on the hub), the rest in target.dtype; the hf "
            "backend loads every weight in target.dtype",
            "drafter layer, train.drafter_attention llama: 64 heads and 64 KV heads (no GQA) "
            "of head_dim 112 = 7168/64 (the config gives no head_dim), intermediate 18432 "
            "(the target's dense MLP width); mla: the target's MLA shapes",
            "extraction activations as for a dense layer of intermediate 18432 (one MoE layer's "
            "routed experts per token are narrower)",
        ],
    ),
}


def _mla_params(s: Shape, input_size: int) -> tuple[int, int]:
    """(parameters, of them those vLLM replicates on every tensor-parallel rank) of an MLA
    attention reading ``input_size``: q_a_proj and kv_a_proj_with_mqa (one fused, replicated
    matrix in vLLM) with their norms, q_b_proj (or q_proj without a q_lora_rank), kv_b_proj,
    o_proj."""
    heads, qk = s.heads, s.qk_nope_head_dim + s.qk_rope_head_dim
    a_proj = input_size * (s.kv_lora_rank + s.qk_rope_head_dim) + s.kv_lora_rank
    if s.q_lora_rank:
        a_proj += input_size * s.q_lora_rank + s.q_lora_rank
        q = s.q_lora_rank * heads * qk
    else:
        q = input_size * heads * qk
    rest = (
        q
        + s.kv_lora_rank * heads * (s.qk_nope_head_dim + s.v_head_dim)
        + heads * s.v_head_dim * s.hidden
    )
    return a_proj + rest, a_proj


def _target_parts(s: Shape) -> dict[str, int]:
    """The target's parameters by part: embedding and lm_head, attention, dense MLPs, routed
    experts, shared experts, routers, norms (and of them, what vLLM replicates per rank)."""
    h = s.hidden
    if s.kv_lora_rank:
        attention, replicated = _mla_params(s, h)
    else:
        attention, replicated = h * s.heads * s.head_dim * 2 + h * s.kv_heads * s.head_dim * 2, 0
    moe = s.moe_layers
    routed = moe * s.experts * 3 * h * s.expert_intermediate
    return {
        "embedding and lm_head": (1 if s.tied_embeddings else 2) * s.vocab * h,
        "attention": s.layers * attention,
        "dense MLPs": (s.layers - moe) * 3 * h * s.intermediate,
        "routed experts": routed,
        "shared experts": moe * s.shared_experts * 3 * h * s.expert_intermediate,
        "routers": moe * s.experts * h,
        "norms": s.layers * 2 * h + h,
        "replicated": s.layers * replicated + moe * s.experts * h + s.layers * 2 * h + h,
    }


def target_params(s: Shape) -> int:
    """Embedding and lm_head, the layers (attention: GQA or MLA; a SwiGLU MLP, or routed and
    shared experts and a router; two norms), the final norm."""
    if s.target_params is not None:
        return s.target_params
    parts = _target_parts(s)
    return sum(n for name, n in parts.items() if name != "replicated")


def serving_weights(s: Shape, dtype: str) -> tuple[int, int]:
    """Bytes of the target's weights as vLLM holds them with tensor parallelism: (the bytes
    split over the ranks, the bytes every rank holds whole: MLA's q_a/kv_a projections, the
    routers, the norms). Routed experts of ``expert_bits`` weigh bits/8 a weight plus a
    bfloat16 scale a group; everything else is in ``dtype``."""
    a = DTYPE_BYTES[dtype]
    if s.target_params is not None:  # a count without its parts: all of it split
        return s.target_params * a, 0
    parts = _target_parts(s)
    replicated = parts["replicated"] * a
    routed = parts["routed experts"]
    routed_bytes = (
        routed * s.expert_bits // 8 + routed // s.expert_group * s.expert_scale_bytes
        if s.expert_bits
        else routed * a
    )
    return (target_params(s) - routed - parts["replicated"]) * a + routed_bytes, replicated


def drafter_attention_params(s: Shape) -> int:
    """The drafter's attention: q/k/v from 2H and o_proj, or MLA's projections from 2H."""
    h = s.hidden
    if s.mla:
        return _mla_params(s, 2 * h)[0]
    return 2 * h * (s.d_heads + 2 * s.d_kv_heads) * s.head_dim + s.d_heads * s.head_dim * h


def drafter_extra_params(s: Shape) -> dict[str, int]:
    """The weights ``train.drafter_variant`` and ``train.method`` add to the EAGLE-3 layer,
    each of the aux features' width [3Ht]: the per-feature RMSNorms before fc (fc_norm,
    eagle3.1; norm_output has no weights), the one norm over all of them (norm_before_fc,
    which no variant sets yet) and P-EAGLE's mask_hidden."""
    flags = methods.VARIANTS[s.drafter_variant].flags
    width = NUM_AUX * s.hidden  # target_hidden_size = hidden (DrafterConfig.from_target)
    extra = {
        "fc_norm": width if flags.get("fc_norm") else 0,
        "input_norm": width if flags.get("norm_before_fc") else 0,
        "mask_hidden": width if methods.method(s.method).mask_hidden else 0,
    }
    return {name: n for name, n in extra.items() if n}


def dflash_layer_params(s: Shape) -> int:
    """One DFlash layer (``dflash.DFlashLayer``): q/k/v of the [H] input, o_proj, the per-head
    q_norm and k_norm, the MLP and two RMSNorms."""
    h, d = s.hidden, s.head_dim
    return (
        h * (s.d_heads + 2 * s.d_kv_heads) * d
        + s.d_heads * d * h
        + 2 * d
        + 3 * h * s.d_intermediate
        + 2 * h
    )


def drafter_params(s: Shape) -> int:
    """Trainable parameters of the drafter ``train.method`` trains (``drafter.Eagle3Drafter``,
    ``peagle.PEagleDrafter`` or ``dflash.DFlashDrafter``): fc [3Ht -> H], the attention
    (:func:`drafter_attention_params`), the MLP, four RMSNorms (input, hidden,
    post-attention, final), lm_head [H -> Vd] and :func:`drafter_extra_params`; DFlash's fc,
    hidden_norm, ``dflash_layers`` layers (:func:`dflash_layer_params`), the final norm,
    lm_head and its mask embedding [H]. The exported checkpoint holds all of them (and the
    d2t/t2d maps beside)."""
    h = s.hidden
    if methods.method(s.method).block:
        return (
            NUM_AUX * h * h
            + h
            + s.dflash_layers * dflash_layer_params(s)
            + h
            + h * s.draft_vocab
            + h
        )
    return (
        NUM_AUX * h * h
        + drafter_attention_params(s)
        + 3 * h * s.d_intermediate
        + 4 * h
        + h * s.draft_vocab
        + sum(drafter_extra_params(s).values())
    )


def shape_from_target_config(
    config: dict,
    draft_vocab: int,
    name: str,
    drafter_attention: str = "llama",
    drafter_variant: str = methods.EAGLE3_LAYER.name,
    method: str = methods.DEFAULT.name,
    dflash_layers: int = 1,
) -> Shape:
    """A target's shape from its ``config.json`` (as ``DrafterConfig.from_target``): its
    multi-head latent attention and experts where it has them, with the drafter
    ``drafter_attention``, ``drafter_variant`` and ``method`` (train.*) build for it."""
    c = config.get("text_config", config)
    heads = c["num_attention_heads"]
    shape = Shape(
        name,
        hidden=c["hidden_size"],
        layers=c["num_hidden_layers"],
        heads=heads,
        kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        intermediate=c["intermediate_size"],
        vocab=c["vocab_size"],
        draft_vocab=draft_vocab,
        tied_embeddings=bool(
            c.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
        ),
    )
    if c.get("kv_lora_rank"):
        shape = replace(
            shape,
            q_lora_rank=c.get("q_lora_rank"),
            kv_lora_rank=c["kv_lora_rank"],
            qk_nope_head_dim=c["qk_nope_head_dim"],
            qk_rope_head_dim=c["qk_rope_head_dim"],
            v_head_dim=c["v_head_dim"],
        )
    experts = c.get("n_routed_experts") or c.get("num_experts") or c.get("num_local_experts")
    if experts:
        width = c.get("moe_intermediate_size") or c["intermediate_size"]
        dense = c.get("first_k_dense_replace") or 0
        shape = replace(
            shape,
            experts=experts,
            expert_intermediate=width,
            dense_layers=dense,
            shared_experts=c.get("n_shared_experts") or 0,
            **_quantized_experts(config),
        )
        shape.assumptions.append(
            f"target: {experts} experts of width {width} in {shape.moe_layers} layers counted"
        )
    return with_drafter(shape, drafter_attention, drafter_variant, method, dflash_layers)


# Quantization formats vLLM serves whose config.json says how an expert weight is stored:
# bits a weight, weights a scale, bytes a scale. mxfp4 (gpt-oss): 4-bit floats in blocks of
# 32 with one e8m0 exponent each (the OCP microscaling format); fp8 (DeepSeek-V3/R1): one
# float32 scale a weight_block_size block (128 x 128 where the config names none).
QUANTIZED_EXPERTS = {"mxfp4": (4, 32, 1), "fp8": (8, 128 * 128, 4)}


def _quantized_experts(config: dict) -> dict:
    """How the target's quantization_config stores its routed experts (``expert_bits``,
    ``expert_group``, ``expert_scale_bytes``, ``expert_format``): a compressed-tensors
    checkpoint with integer weights (Kimi-K2's INT4 experts, a bfloat16 scale a group), or a
    format of QUANTIZED_EXPERTS; empty where the experts are in target.dtype."""
    q = config.get("quantization_config") or config.get("text_config", {}).get(
        "quantization_config"
    )
    method = (q or {}).get("quant_method")
    if method in QUANTIZED_EXPERTS:
        bits, group, scale = QUANTIZED_EXPERTS[method]
        block = q.get("weight_block_size")
        if block:
            group = int(block[0]) * int(block[-1])
        return {
            "expert_bits": bits,
            "expert_group": group,
            "expert_scale_bytes": scale,
            "expert_format": method,
        }
    if method != "compressed-tensors":
        return {}
    for group in (q.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if weights.get("type") == "int" and weights.get("num_bits"):
            return {
                "expert_bits": int(weights["num_bits"]),
                "expert_group": int(weights.get("group_size") or Shape.expert_group),
                "expert_format": f"INT{int(weights['num_bits'])}",
            }
    return {}


CHUNK_ELEMENTS = 1 << 26  # logits per chunk of rows (64M: 256 MB in float32)


def default_window(concurrency: float, batch: float) -> float:
    """A feed's default window (:meth:`StateFeed.window`) in any unit, samples or tokens:
    the ``concurrency`` requests in flight beside the trainer's largest micro-batch
    (``batch``), at least twice the requests. :func:`eaglet.tools.memory_plan.stream_window_tokens`
    counts it in tokens."""
    return concurrency + max(concurrency, batch)
