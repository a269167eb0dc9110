"""The shard format's facts, torch-free: its name, where shard i lives, bytes per token,
and the digests a manifest records (``eaglet.data.shards`` reads and writes the tensors)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from eaglet.core.dtypes import BYTES
from eaglet.core.layout import shard_name

FORMAT = "eaglet.hidden.v1"
DIGEST_BLOCK = 8 << 20
DIGEST_PREFIX = "sha256-8MiB-blocks:"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_path(path: str | os.PathLike, block_bytes: int = 4 << 20) -> str:
    """The file's sha256, read into one reused block (never more of it in memory)."""
    digest = hashlib.sha256()
    block = bytearray(block_bytes)
    view = memoryview(block)
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(block):
            digest.update(view[:count])
    return digest.hexdigest()


CONTENT_PREFIX = "safetensors-content-sha256:"


def safetensors_digest(path: str | os.PathLike) -> str:
    """A digest of what a safetensors file means, not of its bytes: its metadata (sorted by
    key) and each tensor (by name: dtype, shape, data). safetensors writes its metadata in an
    order that changes between processes, so two writes of the same tensors can differ in
    their header's bytes; this digest is the same for both."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(size))
        start = 8 + size
        digest.update(json.dumps(header.pop("__metadata__", {}), sort_keys=True).encode())
        for name in sorted(header):
            entry = header[name]
            begin, end = entry["data_offsets"]
            digest.update(json.dumps([name, entry["dtype"], entry["shape"]]).encode())
            handle.seek(start + begin)
            left = end - begin
            while left:
                block = handle.read(min(left, 4 << 20))
                if not block:
                    raise ValueError(f"{path}: truncated safetensors file")
                digest.update(block)
                left -= len(block)
    return CONTENT_PREFIX + digest.hexdigest()


def bytes_per_token(hidden_size: int, num_aux: int, dtype: str) -> int:
    """Tensor bytes per packed token: id, mask, teacher argmax, aux and final states (and
    the fp8 scales)."""
    width = hidden_size * (num_aux + 1)
    if dtype == "fp8":
        return 8 + 1 + 8 + width + 4 * (num_aux + 1)
    return 8 + 1 + 8 + width * BYTES[dtype]


def shard_path(directory: str | os.PathLike, index: int) -> Path:
    return Path(directory) / shard_name(index)
