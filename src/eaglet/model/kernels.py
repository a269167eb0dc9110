"""The elementwise pieces of the drafter's step, bundled as ``Kernels``: RMSNorm, SwiGLU's
middle, RoPE's rotation and the sink of the fused TTT attention, plain (``EAGER``) or
compiled into fused kernels (``compiled_kernels``). The same mathematics either way."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eaglet.model.rope import rotate
from eaglet.target.norm import rms_norm


def gated_silu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The SwiGLU MLP's elementwise middle: silu(gate) * up."""
    return F.silu(gate) * up


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


def sink_problem(q, cache, scale):
    """Queries, keys and values [1, heads, 1 + n, D + pad] with the sink of step k, the
    own-key sums D [Hkv, G, n, D] and Z [Hkv, G, n] in float32."""
    (k0, v0), diagonal = cache[0], cache[1:]
    hkv, g, n, d = q.shape
    dv = v0.shape[-1]  # the value head size: d, or MLA's v_head_dim
    pad = 1 if q.device.type == "cpu" else 8  # CUDA kernels want head dims in multiples of 8
    own = torch.stack([(q * k).sum(-1) for k, _ in diagonal], -1).float() * scale  # [Hkv, G, n, k]
    top = (own.amax(-1).detach() / scale).to(q.dtype)  # c / scale, as the kernel will see it
    c = top.float() * scale
    weights = torch.exp(own - c[..., None])  # [Hkv, G, n, k]
    total = weights.sum(-1)  # Z
    # float32 weights times v in its dtype: float32 D, and v itself kept for backward
    values = sum(weights[..., j : j + 1] * v for j, (_, v) in enumerate(diagonal))  # D
    query = torch.cat([q, top[..., None], q.new_zeros(hkv, g, n, pad - 1)], -1)
    query = F.pad(query, (0, 0, 1, 0))  # dummy row 0 (sees only the sink)
    sink = q.new_zeros(hkv, 1, 1, d + pad)
    sink[..., d] = 1
    sink_value = sink
    if dv != d:
        sink_value = q.new_zeros(hkv, 1, 1, dv + pad)
        sink_value[..., dv] = 1
    key = torch.cat([sink, F.pad(k0, (0, pad))], -2)  # [Hkv, 1, 1 + n, D + pad]
    value = torch.cat([sink_value, F.pad(v0, (0, pad))], -2)  # [Hkv, 1, 1 + n, Dv + pad]
    heads = hkv * g
    return (
        query.reshape(1, heads, n + 1, d + pad),
        key.reshape(1, hkv, n + 1, d + pad),
        value.reshape(1, hkv, n + 1, dv + pad),
        values,
        total,
    )


def combine_sink(out, values, total, shape, dtype):
    """(o + m D) / (1 + m (Z - 1)) from the kernel's output [1, heads, 1 + n, Dv + pad]."""
    hkv, g, n, _ = shape
    d = values.shape[-1]  # the value head size
    out = out.reshape(hkv, g, n + 1, -1)[..., 1:, :]
    o, m = out[..., :d].float(), out[..., d].float()
    return ((o + m[..., None] * values) / (1 + m * (total - 1))[..., None]).to(dtype)


@dataclass(frozen=True)
class Kernels:
    """The elementwise pieces of the drafter's step (norms, SwiGLU, RoPE, the fused TTT
    attention's sink), plain (:data:`EAGER`) or compiled into fused kernels by
    :func:`eaglet.model.drafter.compile_drafter`: the same mathematics either way."""

    rms_norm: object = rms_norm
    gated_silu: object = gated_silu
    rotate: object = rotate
    sink_problem: object = sink_problem
    combine: object = combine_sink


EAGER = Kernels()
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
        _COMPILED.append(
            Kernels(
                **{
                    name: torch.compile(getattr(EAGER, name), dynamic=True)
                    for name in Kernels.__dataclass_fields__
                }
            )
        )
    return _COMPILED[0]
