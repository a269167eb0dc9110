"""The EAGLE-3 drafter: one Llama decoder layer that drafts from the target's features.

It computes what vLLM's ``llama_eagle3.py`` computes (``Eagle3LlamaForCausalLM`` with one
layer, ``norm_before_residual`` off), with the same module names, so its state dict *is* the
checkpoint vLLM loads (see ``eaglet.model.export``). One drafting step at a position::

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

``train.drafter_variant: eagle3.1`` (``eaglet.core.methods.VARIANTS``) switches on the flags vLLM reads from
a drafter's config.json, each applied where vLLM's forward applies it:

    fc_norm               aux = cat(fc_norm.i(aux_i)): one RMSNorm per aux feature, before fc
    norm_output           the next step reads norm(r), not r (lm_head reads norm(r) either way)
    norm_before_fc        aux = input_norm(aux): one RMSNorm over all [3H], before fc
    norm_before_residual  r starts at hidden_norm(h) instead of h

EAGLE-3.1 (its paper, SpecForge, TorchSpec) is fc_norm + norm_output: the aux features enter
fc at one scale whatever their layer's, and the state fed back keeps the scale of the target's
final-normed features over the steps. vLLM's MLA drafter (deepseek_eagle3) has no
``norm_before_fc``; the other three it applies as the Llama drafter does.

This module holds the layer (``DecoderLayer``: its norms, ``Attention`` or ``MLAAttention``,
``MLP``), ``Eagle3Drafter`` and its FLOPs. The TTT attention's kernels are in
``eaglet.model.attention``, the elementwise ones and their compiled forms in
``eaglet.model.kernels``, RoPE in ``eaglet.model.rope``, and the start from the target's
weights in ``eaglet.model.init``.
"""

from __future__ import annotations

import torch
from torch import nn

from eaglet.model.attention import BLOCK_ROWS, AttentionBlock, attend, attention_blocks
from eaglet.model.config import ATTENTION, DrafterConfig
from eaglet.model.kernels import EAGER, Kernels, compiled_kernels
from eaglet.model.rope import mla_softmax_scale, rope_inv_freq, rotate_pairs

# -- layers ----------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    kernels = EAGER  # each layer's, until compile_drafter gives it the compiled ones

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)


def compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype autocast computes matmuls in (bf16 under bf16 autocast), so that
    several matmuls reading it share one cast instead of one each; unchanged without
    autocast. The same numbers either way."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind) and x.is_floating_point():
        return x.to(torch.get_autocast_dtype(kind))
    return x


def compile_drafter(model: nn.Module, on: bool = True) -> None:
    """Give every layer of ``model`` that computes through kernels (its ``kernels``: norms,
    MLPs, attentions of any method) the compiled ones (``on``) or the plain ones."""
    kernels = compiled_kernels() if on else EAGER
    for module in model.modules():
        if isinstance(getattr(module, "kernels", None), Kernels):
            module.kernels = kernels


class Attention(nn.Module):
    """GQA self-attention whose q/k/v read the 2H-wide [embedding, hidden] input."""

    input_projections = ("q_proj", "k_proj", "v_proj")  # those reading the 2H-wide input
    kernels = EAGER

    def __init__(self, config: DrafterConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            d,
        )
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
        scale = self.head_dim**-0.5
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
        self.nope, self.rope, self.v_dim = (
            config.qk_nope_head_dim,
            config.qk_rope_head_dim,
            config.v_head_dim,
        )
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
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(
            rows, self.heads, self.nope + self.v_dim
        )
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_pe = rotate_pairs(q[..., self.nope :], cos[:, None], sin[:, None])
        k_pe = rotate_pairs(k_pe, cos, sin)[:, None].expand(rows, self.heads, self.rope)
        q = torch.cat([q[..., : self.nope], q_pe], dim=-1).permute(1, 0, 2)[:, None]
        k = torch.cat([k_nope, k_pe], dim=-1).permute(1, 0, 2)[:, None]  # [heads, 1, T, qk]
        cache.append((k, v.permute(1, 0, 2)[:, None]))  # v [heads, 1, T, Dv]
        out = attend(
            self.implementation, q, cache, blocks, self.scale, self.kernels
        )  # [heads, 1, T, Dv]
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
        self.self_attn = (
            MLAAttention(config) if config.attention_kind == "mla" else Attention(config)
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.norm_before_residual = config.norm_before_residual

    def forward(self, embeds, hidden, cos, sin, blocks, cache):
        """embeds, hidden [T, H] -> the pre-norm hidden state [T, H]."""
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [T, 2H]
        residual = normed if self.norm_before_residual else hidden
        residual = residual + self.self_attn(x, cos, sin, blocks, cache)
        return residual + self.mlp(self.post_attention_layernorm(residual))


# -- the drafter -----------------------------------------------------------------------------


class Eagle3Drafter(nn.Module):
    """Parameters and persistent buffers are named as in the vLLM checkpoint (export.py)."""

    def __init__(
        self,
        config: DrafterConfig,
        embed_tokens: torch.Tensor,
        d2t: torch.Tensor,
        t2d: torch.Tensor,
        attention: str = "sdpa",
    ):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.register_buffer("embed_tokens", embed_tokens, persistent=False)  # [V, H], frozen
        if config.norm_before_fc:  # vLLM's input_norm: one norm over the concatenated [A*Ht]
            self.input_norm = RMSNorm(config.fc_input_size, config.rms_norm_eps)
        if config.fc_norm:  # one norm per aux feature [Ht], vLLM's fc_norm.i
            self.fc_norm = nn.ModuleList(
                RMSNorm(config.target_hidden_size, config.rms_norm_eps)
                for _ in config.aux_layer_ids
            )
        self.fc = nn.Linear(config.fc_input_size, h, bias=False)
        self.midlayer = DecoderLayer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", d2t.to(torch.int64))  # [Vd] target id = i + d2t[i]
        self.register_buffer("t2d", t2d.to(torch.bool))  # [V] in the draft vocabulary
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
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        if self.config.attention_kind == "mla":
            angles = angles.repeat_interleave(2, dim=-1)  # [T, D]
        else:
            angles = torch.cat([angles, angles], dim=-1)  # [T, D]
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

    def draft_step(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        blocks: list[AttentionBlock],
        cache: list,
        rows: torch.Tensor | int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafting step over all rows: (the final-normed state lm_head reads, of
        ``rows`` only when given; the state [T, H] the next step reads: the pre-norm one, or
        with norm_output the normed one, as vLLM's forward returns them)."""
        out = self.midlayer(embeds, hidden, cos, sin, blocks, cache)  # pre-norm
        if self.config.norm_output:
            normed = self.norm(out)
            return (normed if rows is None else normed[rows]), normed
        return self.norm(out if rows is None else out[rows]), out

    def forward(
        self,
        aux_hidden: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        segments: torch.Tensor,
        logit_rows: list[torch.Tensor] | None = None,
        heads: bool = True,
    ) -> list[torch.Tensor]:
        """Run ``K = len(input_ids)`` TTT steps over a packed batch of T rows.

        aux_hidden  [T, A*Ht]  the target's aux features of each row
        input_ids   [K, T]     the token each row embeds at step k (token t+1+k of its sample)
        positions   [T]        position of the row within its sample (RoPE of step k: + k)
        segments    [T]        which packed sample the row belongs to
        logit_rows  K x [n_k]  rows whose logits each step returns (all rows when None)
        heads       False: the final-normed states lm_head reads instead of the logits
                    (the fused loss applies lm_head itself: ``eaglet.model.loss``)
        returns     K x [n_k, Vd] draft-vocabulary logits (or K x [n_k, H] states)
        """
        # flex attention skips other samples' tiles itself: one block for the whole batch
        blocks = attention_blocks(
            segments, len(segments) if self.attention == "flex" else BLOCK_ROWS
        )
        hidden = self.combine(aux_hidden)  # [T, H]
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        logits = []
        for step, ids in enumerate(input_ids):
            cos, sin = self.rope(positions + step)
            embeds = self.embed_tokens[ids].to(hidden.dtype)
            normed, hidden = self.draft_step(
                embeds,
                hidden,
                cos,
                sin,
                blocks,
                cache,
                None if logit_rows is None else logit_rows[step],
            )
            logits.append(self.lm_head(normed) if heads else normed)
        return logits


def count_flops_per_token(config: DrafterConfig, ttt_steps: int, context: int) -> float:
    """Training FLOPs per packed token (forward + backward = 3x forward, every row scored),
    plus the teacher's head; ``context`` is the mean number of step-0 keys a query sees."""
    h, d = config.hidden_size, config.head_dim
    layer = (
        2 * h * (config.num_attention_heads + 2 * config.num_key_value_heads) * d
        + config.num_attention_heads * d * h
        + 3 * h * config.intermediate_size
        + h * config.draft_vocab_size
    )
    per_key = 4 * config.num_attention_heads * d  # q.k and the weighted v, per key seen
    if config.attention_kind == "mla":
        layer, per_key = (
            mla_layer_weights(config),
            2
            * config.num_attention_heads
            * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim),
        )
    forward = 2 * config.fc_input_size * h
    for step in range(ttt_steps):
        forward += 2 * layer + per_key * (context + step)
    return 3 * forward + 2 * h * config.draft_vocab_size


def mla_layer_weights(config: DrafterConfig) -> int:
    """Weights a token passes through in the MLA layer (its multiply-adds), lm_head included."""
    h, n = config.hidden_size, config.num_attention_heads
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    q = 2 * h * config.q_lora_rank + config.q_lora_rank * n * qk
    kv = 2 * h * (config.kv_lora_rank + config.qk_rope_head_dim) + config.kv_lora_rank * n * (
        config.qk_nope_head_dim + config.v_head_dim
    )
    return (
        q
        + kv
        + n * config.v_head_dim * h
        + 3 * h * config.intermediate_size
        + h * config.draft_vocab_size
    )


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
