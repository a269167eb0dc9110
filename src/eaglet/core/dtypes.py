"""The dtypes eaglet's settings name (``target.dtype``, ``extract.dtype``,
``train.export_dtype``), once: bytes per element, mantissa bits and the torch dtype of each;
and the dtype codes of a safetensors header (what a checkpoint stores, what a shard writes).

Importing this module loads no PyTorch (``eaglet status``, ``eaglet plan`` and every Snakefile
parse read the sizes): :func:`torch_dtype` imports it when first asked.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# the float dtypes a target is served and run in (target.dtype, but "auto"): bytes per element
SERVED_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# ... and every dtype a hidden-state shard or a drafter's weights are stored in (extract.dtype's
# fp8 is e4m3, with a per-token scale)
BYTES = {**SERVED_BYTES, "fp8": 1}
# mantissa bits (the implicit one counted) of each: which one rounds more
MANTISSA_BITS = {"float32": 24, "float16": 11, "bfloat16": 8, "fp8": 4}

# a safetensors header's dtype codes: bytes per element
SAFETENSORS_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "U64": 8,
    "I32": 4,
    "U32": 4,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
# ... the wide floats among them (a server casts them to target.dtype), by torch's names
SAFETENSORS_FLOATS = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


@functools.cache
def safetensors_codes() -> dict[torch.dtype, str]:
    """The torch dtypes a shard stores -> their safetensors codes, in the order a shard's data
    holds them (wider first, so every tensor stays aligned)."""
    import torch

    return {
        torch.int64: "I64",
        torch.float32: "F32",
        torch.bfloat16: "BF16",
        torch.float16: "F16",
        torch.float8_e4m3fn: "F8_E4M3",
        torch.uint8: "U8",
    }


@functools.cache
def torch_dtypes() -> dict[str, torch.dtype]:
    """Name -> torch dtype, for every name of :data:`BYTES`, in its order."""
    import torch

    return {
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "fp8": torch.float8_e4m3fn,
    }


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a setting names (``float32``, ``bfloat16``, ``float16``, ``fp8``)."""
    return torch_dtypes()[name]
