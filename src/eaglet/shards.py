"""The hidden-state shard format, shared by extraction (writer) and training (reader).

A shard is one safetensors file holding many samples packed end to end without padding:

    input_ids     int64 [N]        prompt + completion token ids of every sample
    loss_mask     uint8 [N]        1 on completion tokens (what the drafter learns), else 0
    offsets       int64 [n+1]      sample s spans rows offsets[s]:offsets[s+1]
    aux_hidden    [N, 3H]          inputs of the target's decoder layers aux_layer_ids
                                   (HF hidden_states[i]), concatenated in that order
    final_hidden  [N, H]           the final-norm output that the target's lm_head reads:
                                   logits = final_hidden @ lm_head.T is the teacher
    teacher_argmax int64 [N]       argmax over the full vocabulary of the target's logits
                                   at each position whose next token is a completion token
                                   (its prediction of that token); -1 at the others, which
                                   no drafter loss reads (prompt rows, each sample's last)
    aux_scale     float32 [N, 3]   fp8 only: per-token, per-layer scale of aux_hidden
    final_scale   float32 [N, 1]   fp8 only: per-token scale of final_hidden

The ``__metadata__`` header (strings, readable with ``safetensors.safe_open``) names the
format, the dtype, the aux layer ids, the hidden size, the sample ids and the target, so a
shard explains itself to whoever opens it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load as load_bytes
from safetensors.torch import save

FORMAT = "eaglet.hidden.v1"
STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                  "float16": torch.float16, "fp8": torch.float8_e4m3fn}
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


@dataclass
class Shard:
    """A shard in memory; hidden states are dequantized to ``float32`` on load."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    offsets: torch.Tensor
    teacher_argmax: torch.Tensor
    aux_hidden: torch.Tensor
    final_hidden: torch.Tensor
    sample_ids: list[str]
    aux_layer_ids: list[int]
    dtype: str
    target: dict

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def sample(self, index: int) -> slice:
        return slice(int(self.offsets[index]), int(self.offsets[index + 1]))


def quantize_fp8(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 with one scale per token and group of columns (``groups`` equal slices)."""
    n, width = x.shape
    grouped = x.float().reshape(n, groups, width // groups)
    scale = grouped.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX  # [N, groups]
    q = (grouped / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
    return q.reshape(n, width), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, width = q.shape
    groups = scale.shape[1]
    return (q.float().reshape(n, groups, width // groups) * scale.unsqueeze(-1)).reshape(n, width)


def encode(input_ids, loss_mask, offsets, teacher_argmax, aux_hidden, final_hidden, *, sample_ids,
           aux_layer_ids, dtype: str, target: dict) -> bytes:
    """Serialize one shard; ``aux_hidden``/``final_hidden`` are given in any float dtype."""
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"unknown shard dtype {dtype!r}; allowed: {', '.join(STORAGE_DTYPES)}")
    tensors = {"input_ids": input_ids.to(torch.int64).contiguous(),
               "loss_mask": loss_mask.to(torch.uint8).contiguous(),
               "offsets": offsets.to(torch.int64).contiguous(),
               "teacher_argmax": teacher_argmax.to(torch.int64).contiguous()}
    if dtype == "fp8":
        tensors["aux_hidden"], tensors["aux_scale"] = quantize_fp8(aux_hidden, len(aux_layer_ids))
        tensors["final_hidden"], tensors["final_scale"] = quantize_fp8(final_hidden, 1)
    else:
        tensors["aux_hidden"] = aux_hidden.to(STORAGE_DTYPES[dtype]).contiguous()
        tensors["final_hidden"] = final_hidden.to(STORAGE_DTYPES[dtype]).contiguous()
    metadata = {"format": FORMAT, "dtype": dtype,
                "hidden_size": str(final_hidden.shape[1]),
                "aux_layer_ids": json.dumps(list(aux_layer_ids)),
                "sample_ids": json.dumps(list(sample_ids)),
                "target": json.dumps(target, sort_keys=True)}
    return _sorted_header(save(tensors, metadata=metadata))


def _sorted_header(data: bytes) -> bytes:
    """safetensors writes the metadata in no fixed order; sort it so that equal shards are
    equal bytes (and a rebuilt shard has the sha256 of the original)."""
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    return data[:8] + text.ljust(n, b" ") + data[8 + n:]


class ShardDamaged(ValueError):
    """A shard's bytes are not the ones extraction wrote (truncated, modified, unreadable)."""

    def __init__(self, path: str | os.PathLike, reason: str):
        super().__init__(f"hidden-state shard {path} is damaged: {reason}")
        self.path = Path(path)
        self.reason = reason


def _parse_metadata(meta: dict, path: str | os.PathLike) -> dict:
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not an eaglet hidden-state shard (format {meta.get('format')!r})")
    return {"dtype": meta["dtype"], "hidden_size": int(meta["hidden_size"]),
            "aux_layer_ids": json.loads(meta["aux_layer_ids"]),
            "sample_ids": json.loads(meta["sample_ids"]), "target": json.loads(meta["target"])}


def read_metadata(path: str | os.PathLike) -> dict:
    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata() or {}
    return _parse_metadata(meta, path)


def load(path: str | os.PathLike, sha256: str | None = None) -> Shard:
    """The shard at ``path``. With ``sha256`` (the hash recorded at extraction) the file is
    read once into memory, hashed over those same bytes and decoded from them; a mismatch or
    an undecodable file raises :class:`ShardDamaged` naming it."""
    if sha256 is None:
        meta = read_metadata(path)
        with safe_open(str(path), framework="pt") as handle:
            t = {name: handle.get_tensor(name) for name in handle.keys()}
    else:
        with open(path, "rb") as handle:
            data = handle.read()
        actual = sha256_bytes(data)
        if actual != sha256:
            raise ShardDamaged(path, f"its sha256 {actual[:12]}… is not the {sha256[:12]}… "
                                     f"recorded at extraction (truncated or modified on disk)")
        t = load_bytes(data)
        meta = _parse_metadata(_header(data).get("__metadata__") or {}, path)
        del data
    if meta["dtype"] == "fp8":
        aux = dequantize_fp8(t["aux_hidden"], t["aux_scale"])
        final = dequantize_fp8(t["final_hidden"], t["final_scale"])
    else:
        aux, final = t["aux_hidden"].float(), t["final_hidden"].float()
    return Shard(t["input_ids"], t["loss_mask"], t["offsets"], t["teacher_argmax"], aux, final,
                 meta["sample_ids"], meta["aux_layer_ids"], meta["dtype"], meta["target"])


def _header(data: bytes) -> dict:
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n])


def set_aside(path: str | os.PathLike) -> Path | None:
    """Move a damaged shard to ``<name>.damaged`` beside it, so that the workflow sees it
    missing and extracts it again; None when it is already gone."""
    path = Path(path)
    aside = path.with_name(path.name + ".damaged")
    try:
        os.replace(path, aside)
    except FileNotFoundError:
        return None
    return aside


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_path(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def bytes_per_token(hidden_size: int, num_aux: int, dtype: str) -> int:
    """Tensor bytes per packed token: id, mask, teacher argmax, aux and final states (and
    the fp8 scales)."""
    width = hidden_size * (num_aux + 1)
    if dtype == "fp8":
        return 8 + 1 + 8 + width + 4 * (num_aux + 1)
    return 8 + 1 + 8 + width * STORAGE_DTYPES[dtype].itemsize


def shard_path(directory: str | os.PathLike, index: int) -> Path:
    return Path(directory) / f"shard_{index:05d}.safetensors"
