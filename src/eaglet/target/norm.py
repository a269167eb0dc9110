"""The RMSNorm of a Llama-family model, once: the target's final norm (the teacher's final state
from the state the serving engine saves) and every norm of the drafter compute it so.

Importing this module loads no PyTorch (:mod:`eaglet.target.checkpoint` reads a norm's weight
into a :class:`FinalNorm` without it): the tensors bring their own methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) in float32, rounded to x's dtype, times the weight (vLLM's and HF's order)."""
    x32 = x.float()
    x32 = x32 * (x32.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    return weight * x32.to(x.dtype)


@dataclass
class FinalNorm:
    """The target's final norm: its weight [H] and epsilon, as its checkpoint holds them."""

    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
