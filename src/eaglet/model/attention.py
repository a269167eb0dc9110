"""The training-time test attention of the drafter's layer: step ``k``'s queries over the
step-0 keys of their sample's earlier rows and their own keys of steps 1..k, computed with
plain matmuls (``ttt_attention``, ``eager``) or PyTorch's fused kernels (``sdpa``,
``flex``) through the sink of ``eaglet.model.kernels``, block by block of whole samples
(``AttentionBlock``, ``attend``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from eaglet.model.kernels import EAGER, Kernels, combine_sink, sink_problem


def ttt_attention(
    q: torch.Tensor,
    cache: list[tuple[torch.Tensor, torch.Tensor]],
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
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
    scores = torch.matmul(q, k0.transpose(-1, -2)).float()  # [Hkv, G, T, T]
    scores.masked_fill_(~mask, float("-inf"))
    top = scores.amax(-1, keepdim=True)  # [Hkv, G, T, 1]
    if diagonal:
        own = torch.stack([(q * k).sum(-1) for k, _ in diagonal], -1).float()  # [Hkv, G, T, k]
        top = torch.maximum(top, own.amax(-1, keepdim=True))
    top = top.detach()  # any shift gives the same softmax; no gradient through it
    weights = scores.sub_(top).exp_()  # unnormalized
    total = weights.sum(-1, keepdim=True)
    out = torch.matmul(weights.to(v0.dtype), v0).float()  # [Hkv, G, T, D]
    if diagonal:
        own = torch.exp(own - top)
        total = total + own.sum(-1, keepdim=True)
        for j, (_, v) in enumerate(diagonal):
            out = out + own[..., j : j + 1] * v
    return (out / total).to(v0.dtype)


def sdpa_ttt_attention(
    q: torch.Tensor,
    cache: list[tuple[torch.Tensor, torch.Tensor]],
    block: AttentionBlock,
    scale: float,
    kernels: Kernels | None = None,
) -> torch.Tensor:
    """What ``ttt_attention`` computes, through ``F.scaled_dot_product_attention`` (fused
    kernels: no [heads, n, n] scores kept). Shapes as ``ttt_attention``."""
    (k0, v0), diagonal = cache[0], cache[1:]
    hkv, g, n, d = q.shape
    dv = v0.shape[-1]
    if not diagonal:  # step 0: the step-0 keys alone
        out = F.scaled_dot_product_attention(
            q.reshape(1, hkv * g, n, d),
            k0.reshape(1, hkv, n, d),
            v0.reshape(1, hkv, n, dv),
            attn_mask=block.mask,
            is_causal=block.mask is None,
            scale=scale,
            enable_gqa=True,
        )
        return out.reshape(hkv, g, n, dv)
    kernels = kernels or EAGER
    query, key, value, values, total = kernels.sink_problem(q, cache, scale)
    mask = block.sink_mask()
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )
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


def flex_ttt_attention(
    q: torch.Tensor,
    cache: list[tuple[torch.Tensor, torch.Tensor]],
    block: AttentionBlock,
    scale: float,
) -> torch.Tensor:
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
            ttt_mask_mod(block.segments, bool(diagonal)), None, None, size, size, device=q.device
        )
    if not diagonal:
        out = attend(
            q.reshape(1, hkv * g, n, d),
            k0.reshape(1, hkv, n, d),
            v0.reshape(1, hkv, n, dv),
            block_mask=block._masks[key],
            scale=scale,
            enable_gqa=True,
        )
        return out.reshape(hkv, g, n, dv)
    query, key_, value, values, total = sink_problem(q, cache, scale)
    out = attend(query, key_, value, block_mask=block._masks[key], scale=scale, enable_gqa=True)
    return combine_sink(out, values, total, q.shape, v0.dtype)


def attend(
    implementation: str,
    q: torch.Tensor,
    cache: list[tuple[torch.Tensor, torch.Tensor]],
    blocks: list[AttentionBlock],
    scale: float,
    kernels: Kernels | None = None,
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


BLOCK_ROWS = 512


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
            self._masks["causal"] = torch.ones(
                n, n, dtype=torch.bool, device=self.segments.device
            ).tril()
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


def attention_blocks(segments: torch.Tensor, block_rows: int = BLOCK_ROWS) -> list[AttentionBlock]:
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
