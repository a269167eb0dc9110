"""The training loss of one TTT step, fused with the drafter's lm_head.

At TTT step ``k`` every row that counts scores the drafter's draft-vocabulary logits
``z = lm_head(h)`` against the teacher, the target's distribution ``p`` over the draft
vocabulary at the token the step predicts::

    ce = logsumexp(z) - sum_v p_v z_v            d ce / d z = softmax(z) - p

:func:`batch_terms` computes that for every step of a batch. Unfused (``fused=False``), the
logits of all rows are one [n, Vd] tensor with autograd's copies of it (the logits, their
float32 widening, the gathered teacher rows: about 3 x 4 bytes x n x Vd kept per step, 20 GB
at 8K rows and a 32K vocabulary over 7 steps). Fused (:class:`FusedHeadLoss`), the forward
takes the rows a chunk at a time: logits, cross-entropy, argmax and the gradient in ``z``
(in the matmul's dtype) are computed at once and only that gradient is kept; the backward
multiplies it into lm_head's two gradients. The teacher is kept once per batch as logits in
the matmul's dtype and their log-normalizer, so ``p`` is rebuilt per chunk, never stored in
float32 for every row. With ``compiled`` kernels the chunk's elementwise work is one fused
pass (torch.compile). The mathematics is the unfused path's: losses and gradients agree to
rounding (``tests/test_ttt_loss.py``).
"""

from __future__ import annotations

import torch

from eaglet.model.sizes import CHUNK_ELEMENTS


def compute_dtype_of(x: torch.Tensor) -> torch.dtype:
    """The dtype matmuls of ``x`` run in: autocast's where it is on, else ``x``'s own."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


@torch.no_grad()
def teacher(final: torch.Tensor, teacher_head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher of a batch: logits ``final @ teacher_head.T`` [T, Vd] in the matmul's dtype
    (as autocast gives them) and their float32 log-normalizer [T]."""
    logits = final @ teacher_head.T
    return logits, torch.logsumexp(logits.float(), dim=-1)


def chunk_terms(
    z: torch.Tensor, t_logits: torch.Tensor, t_lse: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk: per row the cross-entropy [c], the gradient in ``z`` [c, Vd] (in ``z``'s
    dtype) and the argmax [c]. ``rows``: the teacher rows the chunk's rows predict."""
    p = torch.exp(t_logits[rows].float() - t_lse[rows, None])
    zf = z.float()
    lse = torch.logsumexp(zf, dim=-1)
    ce = lse - (p * zf).sum(-1)
    grad = (torch.exp(zf - lse[:, None]) - p).to(z.dtype)
    return ce, grad, zf.argmax(-1)


def chunk_scores(
    z: torch.Tensor, t_logits: torch.Tensor, t_lse: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunk_terms` without the gradient (held-out evaluation)."""
    p = torch.exp(t_logits[rows].float() - t_lse[rows, None])
    zf = z.float()
    return torch.logsumexp(zf, dim=-1) - (p * zf).sum(-1), zf.argmax(-1)


class ChunkKernels:
    """:func:`chunk_terms` and :func:`chunk_scores`, plain or through ``torch.compile``."""

    def __init__(self, compiled: bool = False):
        self.terms, self.scores = chunk_terms, chunk_scores
        if compiled:
            self.terms = torch.compile(chunk_terms, dynamic=True)
            self.scores = torch.compile(chunk_scores, dynamic=True)


PLAIN = ChunkKernels()


def _chunks(rows: int, vocab: int):
    size = max(1, CHUNK_ELEMENTS // max(1, vocab))
    return [(a, min(a + size, rows)) for a in range(0, rows, size)]


class FusedHeadLoss(torch.autograd.Function):
    """Summed cross-entropy [] and argmax [n] of ``h @ weight.T`` against the teacher rows
    ``rows`` (module doc); ``h`` [n, H] and ``weight`` [Vd, H] already in the matmul's dtype."""

    @staticmethod
    def forward(ctx, h, weight, t_logits, t_lse, rows, kernels):
        n, vocab = h.shape[0], weight.shape[0]
        grad_z = torch.empty(n, vocab, dtype=h.dtype, device=h.device)
        ce = torch.empty(n, dtype=torch.float32, device=h.device)
        argmax = torch.empty(n, dtype=torch.int64, device=h.device)
        with torch.autocast(h.device.type, enabled=False):
            for a, b in _chunks(n, vocab):
                z = h[a:b] @ weight.T
                ce[a:b], grad_z[a:b], argmax[a:b] = kernels.terms(z, t_logits, t_lse, rows[a:b])
        ctx.save_for_backward(h, weight, grad_z)
        ctx.mark_non_differentiable(argmax)
        return ce.sum(), argmax

    @staticmethod
    def backward(ctx, grad_ce, _grad_argmax):
        h, weight, grad_z = ctx.saved_tensors
        grad_h = grad_weight = None
        with torch.autocast(h.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                grad_h = ((grad_z @ weight).float() * grad_ce).to(h.dtype)
            if ctx.needs_input_grad[1]:
                grad_weight = ((grad_z.T @ h).float() * grad_ce).to(weight.dtype)
        return grad_h, grad_weight, None, None, None, None


def head_loss(
    h: torch.Tensor,
    weight: torch.Tensor,
    t_logits: torch.Tensor,
    t_lse: torch.Tensor,
    rows: torch.Tensor,
    kernels: ChunkKernels = PLAIN,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of the rows' logits ``lm_head(h)`` against their teacher rows, and
    their argmax (draft ids): fused (:class:`FusedHeadLoss`) where gradients are wanted, a
    chunked evaluation without them otherwise."""
    dtype = compute_dtype_of(h)
    h, weight = h.to(dtype), weight.to(dtype)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return FusedHeadLoss.apply(h, weight, t_logits, t_lse, rows, kernels)
    ce = torch.zeros((), dtype=torch.float32, device=h.device)
    argmax = torch.empty(h.shape[0], dtype=torch.int64, device=h.device)
    with torch.autocast(h.device.type, enabled=False):
        for a, b in _chunks(h.shape[0], weight.shape[0]):
            part, argmax[a:b] = kernels.scores(h[a:b] @ weight.T, t_logits, t_lse, rows[a:b])
            ce = ce + part.sum()
    return ce, argmax
