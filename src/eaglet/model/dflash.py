"""DFlash: a block drafter that proposes all ``k`` tokens in one forward, conditioned on the
target's hidden states (block diffusion's one denoising step).

vLLM 0.32 serves it with ``"method": "dflash"`` (``v1/spec_decode/dflash.py``, the model
``models/qwen3_dflash.py``, architecture ``DFlashDraftModel``). After the target verifies a
round whose last verified position is ``p`` and samples token ``p+1``, the proposer:

- writes the *context* into the drafter's KV cache: for every verified position ``t <= p``,
  ``c_t = hidden_norm(fc(aux[t]))`` (the target's aux features, concatenated) through each
  layer's ``k_proj`` (then the per-head ``k_norm`` and RoPE at ``t``) and ``v_proj``; the
  context never passes through a layer;
- runs one forward over the *block* of ``k + 1`` query slots at positions ``p+1 .. p+1+k``:
  slot 0 embeds token ``p+1`` (the bonus token), slots ``1..k`` the mask token (here a learned
  ``mask_embedding``, which vLLM reads from ``mask_embedding.pt``). Each slot goes through a
  Qwen3 decoder layer (input_layernorm, q/k/v with per-head q_norm/k_norm and RoPE, attention
  over the whole context and over every slot of its block both ways (non-causal), o_proj,
  residual, post_attention_layernorm, SwiGLU MLP, residual), then the final norm and lm_head;
- takes slot ``j``'s argmax as the draft of position ``p+1+j`` (slot 0 is not sampled).

Training (``train.method: dflash``) computes that forward for every row ``t`` of a packed batch
at once, each row the anchor of its own block: its queries see the context keys of rows
``<= t`` of its sample and the keys of its own block's slots, which is the TTT attention's
pattern with every slot's keys on the diagonal (``eaglet.model.attention``). Slot ``j`` of row
``t`` predicts token ``t+1+j``, the token TTT step ``j-1`` of row ``t`` predicts, against the
same teacher and with the same weight ``ttt_decay**(j-1)`` (the peers' ``exp(-(j-1)/gamma)``
with gamma = -1/ln(decay), 4.5 at 0.8): the loss, held-out metrics, checkpoints and the choice
of the best weights are EAGLE-3's. The peers (SpecForge, speculators) sample up to 512
anchors a sequence; here every supervised row is an anchor. ``train.ttt_steps`` is the number
of masked slots, so the block is ``ttt_steps + 1`` long (written as ``block_size``; vLLM
serves any ``num_speculative_tokens`` up to it minus one).

The drafter shares the target's token embedding (not saved: vLLM shares it) and keeps its own
lm_head over the draft vocabulary with ``d2t`` (as eaglet's EAGLE-3 drafter; vLLM scatters the
draft logits to target ids). Its layers have the target's geometry.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from eaglet.core import methods
from eaglet.core.io import atomic_open, read_json, write_json
from eaglet.core.methods import DFLASH
from eaglet.data.shards import STORAGE_DTYPES
from eaglet.model.attention import BLOCK_ROWS, attend, attention_blocks
from eaglet.model.config import ATTENTION, DrafterConfig, config_from_vllm
from eaglet.model.drafter import MLP, RMSNorm, compute_dtype
from eaglet.model.export import vllm_config, write_weights
from eaglet.model.init import LayerFit, fit_target_layer
from eaglet.model.kernels import EAGER
from eaglet.model.rope import rope_inv_freq
from eaglet.target.checkpoint import load_target_embedding, load_target_layer, target_layer_meta

MASK_EMBEDDING_FILE = "mask_embedding.pt"  # qwen3_dflash's _read_mask_embedding


class DFlashAttention(nn.Module):
    """Qwen3's attention as ``DFlashQwen3Attention``: q/k/v of the [H] input, per-head RMSNorm
    of queries and keys before RoPE (NeoX), GQA, no bias."""

    kernels = EAGER

    def __init__(self, config: DrafterConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.implementation = "sdpa"  # ATTENTION: the same math, another kernel

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Keys (k_norm, RoPE) and values [Hkv, 1, N, D] of the states ``x`` [N, H]."""
        n, d = x.shape[0], self.head_dim
        x = compute_dtype(x)
        k = self.k_norm(self.k_proj(x).view(n, self.kv_heads, d)).permute(1, 0, 2)[:, None]
        v = self.v_proj(x).view(n, self.kv_heads, d).permute(1, 0, 2)[:, None]
        return self.kernels.rotate(k, cos, sin), v

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Queries [Hkv, G, N, D] (q_norm, RoPE) of ``x`` [N, H]; head j*G+g reads KV head j."""
        n, d = x.shape[0], self.head_dim
        q = self.q_norm(self.q_proj(compute_dtype(x)).view(n, self.heads, d))
        q = q.view(n, self.kv_heads, self.heads // self.kv_heads, d).permute(1, 2, 0, 3)
        return self.kernels.rotate(q, cos, sin)


class DFlashLayer(nn.Module):
    """``DFlashQwen3DecoderLayer``: the block's slots through a pre-norm Qwen3 layer whose
    attention also sees the context's keys (the context's states never pass through it)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, context: torch.Tensor, context_rope, slot_rope, blocks):
        """x [S, T, H]: slot s of each row's block; context [T, H] the normed context states.
        Slot s of row t attends to the context keys of rows <= t of its sample and to the keys
        of all S slots of row t."""
        slots, rows, h = x.shape
        attn = self.self_attn
        normed = self.input_layernorm(x).reshape(slots * rows, h)
        q = attn.queries(normed, *slot_rope)  # [Hkv, G, S*T, D]
        k, v = attn.keys(normed, *slot_rope)  # [Hkv, 1, S*T, D]
        parts = [slice(s * rows, (s + 1) * rows) for s in range(slots)]
        cache = [attn.keys(context, *context_rope)] + [(k[..., p, :], v[..., p, :]) for p in parts]
        scale = attn.head_dim**-0.5
        out = torch.cat(
            [
                attend(attn.implementation, q[..., p, :], cache, blocks, scale, attn.kernels)
                for p in parts
            ],
            dim=-2,
        )  # [Hkv, G, S*T, D]
        out = attn.o_proj(out.permute(2, 0, 1, 3).reshape(slots * rows, attn.heads * attn.head_dim))
        residual = x + out.view(slots, rows, h)
        return residual + self.mlp(self.post_attention_layernorm(residual))


class DFlashDrafter(nn.Module):
    """Parameters and persistent buffers named as in the checkpoint vLLM loads (module doc):
    ``fc``, ``hidden_norm``, ``layers.{i}.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``, and the
    learned ``mask_embedding`` (written to its own file)."""

    CONSTANT_BUFFERS = ("embed_tokens", "d2t", "t2d", "inv_freq")

    def __init__(
        self,
        config: DrafterConfig,
        embed_tokens: torch.Tensor,
        d2t: torch.Tensor,
        t2d: torch.Tensor,
        mask_token_id: int,
        num_layers: int = 1,
        attention: str = "sdpa",
    ):
        super().__init__()
        if config.attention_kind != "llama" or any(config.norm_flags.values()):
            raise ValueError(
                "train.method: dflash takes train.drafter_attention: llama and "
                "train.drafter_variant: eagle3 (vLLM's DFlash drafter is a stack of "
                "Qwen3 layers with norms of its own)"
            )
        if not 0 <= mask_token_id < config.vocab_size:
            raise ValueError(
                f"mask_token_id {mask_token_id} is outside the target's vocabulary "
                f"(0..{config.vocab_size - 1})"
            )
        if num_layers < 1:
            raise ValueError(f"a DFlash drafter needs at least one layer, not {num_layers}")
        self.config, self.mask_token_id = config, int(mask_token_id)
        h = config.hidden_size
        self.register_buffer("embed_tokens", embed_tokens, persistent=False)  # [V, H], frozen
        self.fc = nn.Linear(config.fc_input_size, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(num_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        # the masked slots' input: starts as the target's embedding of mask_token_id
        self.mask_embedding = nn.Parameter(
            embed_tokens[self.mask_token_id].detach().clone().float()
        )
        self.register_buffer("d2t", d2t.to(torch.int64))  # [Vd] target id = i + d2t[i]
        self.register_buffer("t2d", t2d.to(torch.bool))  # [V] in the draft vocabulary
        inv_freq, self.rope_scale = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention = attention

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def attention(self) -> str:
        """The kernel of the block attention (ATTENTION): the same math either way."""
        return self.layers[0].self_attn.implementation

    @attention.setter
    def attention(self, name: str) -> None:
        if name not in ATTENTION:
            raise ValueError(f"attention {name!r} is none of {', '.join(ATTENTION)}")
        for layer in self.layers:
            layer.self_attn.implementation = name

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, D] of ``positions`` (NeoX layout)."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos() * self.rope_scale, angles.sin() * self.rope_scale

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def context(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The context states [T, H] every layer's keys and values read: hidden_norm(fc(aux))."""
        return self.hidden_norm(self.fc(aux_hidden))

    def forward(
        self,
        aux_hidden: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        segments: torch.Tensor,
        logit_rows: list[torch.Tensor] | None = None,
        heads: bool = True,
    ) -> list[torch.Tensor]:
        """Every row's block at once, with ``Eagle3Drafter.forward``'s arguments and result:
        ``K = len(input_ids)`` masked slots; only ``input_ids[0]`` (token t+1, the bonus
        token of row t's block) is read; result k is slot k+1's, which predicts token t+2+k."""
        blocks = attention_blocks(
            segments, len(segments) if self.attention == "flex" else BLOCK_ROWS
        )
        context = self.context(aux_hidden)  # [T, H]
        rows, slots = context.shape[0], len(input_ids) + 1
        bonus = self.embed_tokens[input_ids[0]].to(context.dtype)
        masked = self.mask_embedding.to(context.dtype).expand(slots - 1, rows, -1)
        x = torch.cat([bonus[None], masked])  # [S, T, H]
        offsets = torch.arange(1, slots + 1, device=positions.device)
        slot_rope = self.rope((positions[None, :] + offsets[:, None]).reshape(-1))
        context_rope = self.rope(positions)
        for layer in self.layers:
            x = layer(x, context, context_rope, slot_rope, blocks)
        out = []
        for k in range(slots - 1):
            states = x[k + 1] if logit_rows is None else x[k + 1][logit_rows[k]]
            normed = self.norm(states)
            out.append(self.lm_head(normed) if heads else normed)
        return out


# -- starting from the target's last layer (train.layer_init: target) --------------------------


def init_from_target(model: DFlashDrafter, target_dir, layer: int) -> LayerFit:
    """Start every DFlash layer as the target's layer ``layer`` where its tensors fit (a
    Qwen3-style layer fits whole; a Llama one fits but for q_norm and k_norm, which stay at 1),
    ``hidden_norm`` as its input norm (the context enters the layer's keys as the target's
    layer reads its input), the final norm as the target's, and ``fc`` passing the deepest
    aux feature through. MoE, MLA or quantized layers leave those parts random."""
    meta = target_layer_meta(target_dir, layer)
    first = model.layers[0]
    h = model.config.hidden_size
    attention = {
        "input_layernorm.weight": (h,),
        **{
            f"self_attn.{n}.weight": tuple(getattr(first.self_attn, n).weight.shape)
            for n in ("q_proj", "k_proj", "v_proj", "o_proj")
        },
    }
    for n in ("q_norm", "k_norm"):  # Qwen3's; a Llama layer has none
        if f"self_attn.{n}.weight" in meta:
            attention[f"self_attn.{n}.weight"] = (model.config.head_dim,)
    expected = {
        "attention": attention,
        "mlp": {
            "post_attention_layernorm.weight": (h,),
            **{
                f"mlp.{n}.weight": tuple(getattr(first.mlp, n).weight.shape)
                for n in ("gate_proj", "up_proj", "down_proj")
            },
        },
    }
    fit = fit_target_layer(model, meta, layer, expected, "DFlash")
    if not fit.parts:
        return fit
    weights = load_target_layer(target_dir, layer, fit.names)
    with torch.no_grad():
        for block in model.layers:
            for name, param in block.named_parameters():
                if name in weights:  # the fitting parts' tensors alone were read
                    param.copy_(weights[name])
        if "attention" in fit.parts:
            model.hidden_norm.weight.copy_(weights["input_layernorm.weight"])
        model.norm.weight.copy_(weights["norm"])
        model.fc.weight.zero_()
        model.fc.weight[:, -h:].copy_(torch.eye(h))
    return fit


# -- the checkpoint ---------------------------------------------------------------------------


def vllm_tensors(model: DFlashDrafter) -> dict[str, tuple[int, ...]]:
    """Every tensor of ``model.safetensors`` and its shape, as ``DFlashQwen3ForCausalLM
    .load_weights`` reads it: every name but lm_head and d2t gets ``model.``; q/k/v and
    gate/up stack into qkv_proj and gate_up_proj; ``t2d`` is skipped (kept for other
    readers); ``d2t`` only with a draft vocabulary smaller than the target's (vLLM has no
    parameter for it otherwise)."""
    c = model.config
    h, d, i = c.hidden_size, c.head_dim, c.intermediate_size
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    tensors = {
        "fc.weight": (h, c.fc_input_size),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (c.draft_vocab_size, h),
        "d2t": (c.draft_vocab_size,),
        "t2d": (c.vocab_size,),
    }
    for n in range(model.num_layers):
        layer = f"layers.{n}."
        tensors.update(
            {
                layer + "input_layernorm.weight": (h,),
                layer + "self_attn.q_proj.weight": (q, h),
                layer + "self_attn.k_proj.weight": (kv, h),
                layer + "self_attn.v_proj.weight": (kv, h),
                layer + "self_attn.o_proj.weight": (h, q),
                layer + "self_attn.q_norm.weight": (d,),
                layer + "self_attn.k_norm.weight": (d,),
                layer + "post_attention_layernorm.weight": (h,),
                layer + "mlp.gate_proj.weight": (i, h),
                layer + "mlp.up_proj.weight": (i, h),
                layer + "mlp.down_proj.weight": (h, i),
            }
        )
    if c.draft_vocab_size == c.vocab_size:
        del tensors["d2t"]
    return tensors


def dflash_config(model: DFlashDrafter, dtype: str, block_size: int) -> dict:
    """config.json as vLLM reads a DFlash drafter: a Qwen3 config (model_type qwen3, the
    target's geometry and RoPE), every layer full attention and non-causal, ``dflash_config``
    with the mask token and the target layers (vLLM adds 1 to each: eaglet's aux ids are the
    inputs of layers, DFlash's ids the outputs of the one before), and the aux ids as vLLM
    uses them at the top (``eagle_aux_hidden_state_layer_ids`` is read first, unchanged)."""
    base = vllm_config(model.config, dtype)
    aux = list(model.config.aux_layer_ids)
    out = {k: v for k, v in base.items() if k not in ("eagle_config", "mlp_bias")}
    out.update(
        {
            "architectures": [DFLASH.architecture],
            "model_type": "qwen3",
            "num_hidden_layers": model.num_layers,
            "layer_types": ["full_attention"] * model.num_layers,
            "num_key_value_heads": model.config.num_key_value_heads,
            "head_dim": model.config.head_dim,
            "block_size": block_size,
            "dflash_config": {
                "mask_token_id": model.mask_token_id,
                "target_layer_ids": [i - 1 for i in aux],
                "causal": False,
            },
            "eagle_aux_hidden_state_layer_ids": aux,
        }
    )
    return out


def export_dflash(
    model: DFlashDrafter, out_dir: str | Path, dtype: str = "float32", block_size: int | None = None
) -> dict:
    """Write ``config.json``, ``model.safetensors`` and ``mask_embedding.pt`` atomically;
    returns the config. ``block_size``: the trained block (train.ttt_steps + 1)."""
    out_dir = Path(out_dir)
    write_weights(
        {n: t for n, t in model.state_dict().items() if n != "mask_embedding"},
        vllm_tensors(model),
        out_dir,
        dtype,
    )
    with atomic_open(out_dir / MASK_EMBEDDING_FILE, "wb") as handle:
        torch.save(
            {
                "mask_token_id": model.mask_token_id,
                "embedding": model.mask_embedding.detach().cpu().to(STORAGE_DTYPES[dtype]),
            },
            handle,
        )
    config = dflash_config(model, dtype, block_size or 0)
    if not block_size:
        del config["block_size"]
    write_json(out_dir / "config.json", config)
    return config


def load_dflash(
    drafter_dir: str | Path, target_dir: str | Path, dtype: torch.dtype = torch.float32
) -> DFlashDrafter:
    """An exported DFlash drafter with the target's embedding, ready to run (eval mode)."""
    drafter_dir = Path(drafter_dir)
    raw = read_json(drafter_dir / "config.json")
    if methods.from_config(raw) is not DFLASH:
        raise ValueError(
            f"{drafter_dir}/config.json is not a DFlash drafter's "
            f"(architectures {raw.get('architectures')})"
        )
    config = config_from_vllm(
        {
            **raw,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": raw["eagle_aux_hidden_state_layer_ids"]
            },
        }
    )
    weights = load_file(str(drafter_dir / "model.safetensors"))
    weights.setdefault("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
    mask = torch.load(drafter_dir / MASK_EMBEDDING_FILE, weights_only=True)
    weights["mask_embedding"] = mask["embedding"].reshape(-1)
    model = DFlashDrafter(
        config,
        load_target_embedding(target_dir),
        weights["d2t"],
        weights["t2d"],
        raw["dflash_config"]["mask_token_id"],
        raw["num_hidden_layers"],
    )
    model.load_state_dict(weights, strict=True)
    return model.to(dtype).eval()
