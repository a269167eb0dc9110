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
shard explains itself to whoever opens it. :func:`write` streams a shard to disk a row
block at a time and returns its sha256; the bytes are those ``safetensors.torch.save`` gives
the same tensors, with the metadata keys sorted.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import load as load_bytes

from eaglet.io import atomic_open

FORMAT = "eaglet.hidden.v1"
STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                  "float16": torch.float16, "fp8": torch.float8_e4m3fn}
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


@dataclass
class Shard:
    """A shard's tensors. From :func:`load` they are in memory with the hidden states
    dequantized to ``float32``; from :func:`open_mapped` they are views of the file's pages in
    their stored dtype (``aux_scale``/``final_scale`` set for fp8; :func:`to_float` converts)."""

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
    aux_scale: torch.Tensor | None = None    # fp8 from open_mapped only: [N, A]
    final_scale: torch.Tensor | None = None  # fp8 from open_mapped only: [N, 1]
    mapping: "Mapping | None" = None         # the file's pages (open_mapped)

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def sample(self, index: int) -> slice:
        return slice(int(self.offsets[index]), int(self.offsets[index + 1]))


def fp8_scale(x: torch.Tensor, groups: int, work: torch.Tensor | None = None) -> torch.Tensor:
    """The e4m3 scale of each token and group of columns (``groups`` equal slices) [N, groups].
    The largest magnitude is found in ``x``'s own dtype when it is a float32 subset (abs and
    max are exact there, and so is the widening), without a float32 copy of ``x``; ``work``
    (at least [N, W] of that dtype) takes the magnitudes instead of a new tensor."""
    n, width = x.shape
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.float()
    mag = x.abs() if work is None else torch.abs(x, out=work[:n])
    amax = mag.reshape(n, groups, width // groups).amax(dim=-1).float()
    return amax.clamp(min=1e-12) / FP8_MAX


def fp8_apply(x: torch.Tensor, scale: torch.Tensor, work: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` in e4m3 with the given per-token, per-group ``scale`` (from :func:`fp8_scale`).
    ``work`` (float32) and ``out`` (e4m3), at least [N, W], are used instead of new tensors:
    the streaming writer reuses them from one row block to the next."""
    n, width = x.shape
    groups = scale.shape[1]
    if work is not None:
        scaled = work[:n].copy_(x).reshape(n, groups, width // groups).div_(scale.unsqueeze(-1))
    elif x.dtype == torch.float32:
        scaled = x.reshape(n, groups, width // groups) / scale.unsqueeze(-1)
    else:  # divide the widened copy in place: one float32 temporary, not two
        scaled = x.float().reshape(n, groups, width // groups).div_(scale.unsqueeze(-1))
    if out is None:
        return scaled.to(torch.float8_e4m3fn).reshape(n, width)
    return out[:n].copy_(scaled.reshape(n, width))


def quantize_fp8(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 with one scale per token and group of columns (``groups`` equal slices). Every
    row is quantized on its own, so quantizing row blocks gives the same bits as the whole."""
    scale = fp8_scale(x, groups)
    return fp8_apply(x, scale), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, width = q.shape
    groups = scale.shape[1]
    return (q.float().reshape(n, groups, width // groups) * scale.unsqueeze(-1)).reshape(n, width)


def to_float(x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Hidden states as stored (any float dtype; e4m3 with its ``scale``) in ``float32``, on
    the device they are on: the conversion :func:`load` applies to a whole shard."""
    return x.float() if scale is None else dequantize_fp8(x, scale)


def to_dtype(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Hidden states as stored in ``dtype``: the float32 values of :func:`to_float` rounded
    to ``dtype`` (a bf16 shard read in bf16 is not converted at all); training converts one
    micro-batch at a time into what its matmuls read."""
    return x.to(dtype) if scale is None else dequantize_fp8(x, scale).to(dtype)


# -- writing ---------------------------------------------------------------------------------
#
# A shard is written in one pass over the file: the safetensors header is computed from the
# shapes alone, then every tensor is converted (cast or quantized) and written a row block at
# a time while the file's sha256 is updated, so neither the whole encoded shard nor a second
# converted copy of the hidden states is ever in memory. fp8 reads the states twice: the
# per-token scales come first in the file, so they are computed (small) before the data. The layout is the one ``safetensors.torch.save``
# gives the same tensors (its tensor order, its compact JSON, spaces up to a multiple of 8),
# with the ``__metadata__`` keys sorted so that equal shards are equal bytes.

SAFETENSORS_DTYPES = {torch.int64: "I64", torch.float32: "F32", torch.bfloat16: "BF16",
                      torch.float16: "F16", torch.float8_e4m3fn: "F8_E4M3", torch.uint8: "U8"}
# safetensors' data order: wider dtypes first (so every tensor stays aligned), then by name
_DTYPE_ORDER = ["I64", "F32", "BF16", "F16", "F8_E4M3", "U8"]
CHUNK_BYTES = 4 << 20  # float32 bytes of a row block of the hidden states, per write


class Written(NamedTuple):
    """What :func:`write` wrote: the file's sha256 and its size in bytes."""

    sha256: str
    bytes: int


@dataclass
class _Field:
    name: str
    dtype: torch.dtype                  # as stored
    shape: tuple[int, ...]
    blocks: Callable[[], Iterator[torch.Tensor]]  # the stored tensor, a row block at a time

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _pieces(x: torch.Tensor | Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
    """Row pieces of a [N, W] tensor (one tensor, or consecutive row blocks of it)."""
    pieces = [x] if isinstance(x, torch.Tensor) else list(x)
    if not pieces or any(p.dim() != 2 or p.shape[1] != pieces[0].shape[1] for p in pieces):
        raise ValueError(f"{name} must be a [N, W] tensor or a non-empty list of row blocks of "
                         f"one width, got shapes {[tuple(p.shape) for p in pieces]}")
    return pieces


def _row_blocks(pieces: list[torch.Tensor], bytes_per_row: int, chunk_bytes: int):
    rows = max(1, chunk_bytes // max(1, bytes_per_row))
    for piece in pieces:
        for start in range(0, piece.shape[0], rows):
            yield piece[start:start + rows]


def _state_fields(name: str, x, storage: str, groups: int, chunk_bytes: int) -> list[_Field]:
    """The hidden-state tensor ``name`` (and ``<prefix>_scale`` for fp8) as written fields."""
    pieces = _pieces(x, name)
    n, width = sum(p.shape[0] for p in pieces), pieces[0].shape[1]
    blocks = lambda: _row_blocks(pieces, 4 * width, chunk_bytes)  # noqa: E731  (float32 rows)
    if storage != "fp8":
        to = STORAGE_DTYPES[storage]
        return [_Field(name, to, (n, width), lambda: (b.to(to) for b in blocks()))]
    if width % groups:
        raise ValueError(f"{name} has {width} columns, not a multiple of its {groups} fp8 groups")
    # Work buffers of one row block, reused: fresh temporaries per block cost page faults, and
    # small results kept alive between them fragment the heap so that the memory of every
    # block stays resident (measured: a shard's worth). The scales are filled in place.
    rows = min(n, max(1, chunk_bytes // (4 * width)))
    mags: dict[torch.dtype, torch.Tensor] = {}
    scale = torch.empty(n, groups, dtype=torch.float32)
    start = 0
    for b in blocks():
        if b.dtype in (torch.float32, torch.bfloat16, torch.float16) and b.dtype not in mags:
            mags[b.dtype] = torch.empty(rows, width, dtype=b.dtype)
        scale[start:start + b.shape[0]] = fp8_scale(b, groups, mags.get(b.dtype))
        start += b.shape[0]
    mags.clear()

    def quantized():
        work = torch.empty(rows, width, dtype=torch.float32)
        out = torch.empty(rows, width, dtype=torch.float8_e4m3fn)
        start = 0
        for b in blocks():
            yield fp8_apply(b, scale[start:start + b.shape[0]], work, out)
            start += b.shape[0]

    prefix = name.removesuffix("_hidden")
    return [_Field(name, torch.float8_e4m3fn, (n, width), quantized),
            _Field(f"{prefix}_scale", torch.float32, (n, groups), lambda: iter([scale]))]


def _vector_field(name: str, x: torch.Tensor, dtype: torch.dtype, chunk_bytes: int) -> _Field:
    x = x.reshape(-1)
    rows = max(1, chunk_bytes // dtype.itemsize)
    return _Field(name, dtype, (x.numel(),),
                  lambda: (x[i:i + rows].to(dtype) for i in range(0, x.numel(), rows)))


def _header(fields: list[_Field], metadata: dict[str, str]) -> tuple[bytes, list[_Field]]:
    """The safetensors header (length prefix included) and the fields in data order."""
    ordered = sorted(fields, key=lambda f: (_DTYPE_ORDER.index(SAFETENSORS_DTYPES[f.dtype]), f.name))
    header: dict = {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    for f in ordered:
        header[f.name] = {"dtype": SAFETENSORS_DTYPES[f.dtype], "shape": list(f.shape),
                          "data_offsets": [offset, offset + f.nbytes]}
        offset += f.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, ordered


def write(path: str | os.PathLike, input_ids, loss_mask, offsets, teacher_argmax,
          aux_hidden, final_hidden, *, sample_ids, aux_layer_ids, dtype: str, target: dict,
          chunk_bytes: int = CHUNK_BYTES) -> Written:
    """Write one shard to ``path`` (atomically: a temporary sibling, fsynced, renamed) and
    return its sha256 and size, hashed while writing.

    ``aux_hidden``/``final_hidden`` are given in any float dtype, each as one [N, W] tensor
    or as a list of consecutive row blocks of it (extraction's per-sequence states, so that
    they need not be concatenated first); they are cast or quantized ``chunk_bytes`` at a
    time."""
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"unknown shard dtype {dtype!r}; allowed: {', '.join(STORAGE_DTYPES)}")
    final_pieces = _pieces(final_hidden, "final_hidden")
    fields = [_vector_field("input_ids", input_ids, torch.int64, chunk_bytes),
              _vector_field("loss_mask", loss_mask, torch.uint8, chunk_bytes),
              _vector_field("offsets", offsets, torch.int64, chunk_bytes),
              _vector_field("teacher_argmax", teacher_argmax, torch.int64, chunk_bytes),
              *_state_fields("aux_hidden", aux_hidden, dtype, len(aux_layer_ids), chunk_bytes),
              *_state_fields("final_hidden", final_pieces, dtype, 1, chunk_bytes)]
    metadata = {"format": FORMAT, "dtype": dtype,
                "hidden_size": str(final_pieces[0].shape[1]),
                "aux_layer_ids": json.dumps(list(aux_layer_ids)),
                "sample_ids": json.dumps(list(sample_ids)),
                "target": json.dumps(target, sort_keys=True)}
    head, ordered = _header(fields, metadata)
    digest = hashlib.sha256(head)
    size = len(head)
    with atomic_open(path, "wb") as handle:
        handle.write(head)
        for f in ordered:
            written = 0
            for block in f.blocks():
                if not block.numel():
                    continue
                raw = memoryview(block.contiguous().view(torch.uint8).numpy()).cast("B")
                handle.write(raw)
                digest.update(raw)
                written += len(raw)
            if written != f.nbytes:  # a shape promised in the header that the data broke
                raise ValueError(f"{f.name}: wrote {written} bytes, the header says {f.nbytes}")
            size += written
    return Written(digest.hexdigest(), size)


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
        meta = _parse_metadata(_file_header(data).get("__metadata__") or {}, path)
        del data
    aux = to_float(t["aux_hidden"], t.get("aux_scale"))
    final = to_float(t["final_hidden"], t.get("final_scale"))
    return Shard(t["input_ids"], t["loss_mask"], t["offsets"], t["teacher_argmax"], aux, final,
                 meta["sample_ids"], meta["aux_layer_ids"], meta["dtype"], meta["target"])


def _file_header(data: bytes) -> dict:
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n])


# -- reading without holding -----------------------------------------------------------------
#
# Training maps a shard instead of reading it: its tensors are views of the file's pages in
# the stored dtype, the kernel reads what a batch touches, and the pages a process has touched
# are given back with ``Mapping.release`` (they stay in the page cache, shared by every rank,
# and are read again from there when needed). The hash check reads the file once in blocks
# before mapping it, so the guarantee of :func:`load` (no byte used that extraction did not
# write) holds without the shard ever being in memory whole.

_STORED = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


class Mapping:
    """A shard file mapped into memory (copy-on-write, so a stray in-place write changes
    this process's copy of a page, never the file, and cannot fault)."""

    def __init__(self, path: str | os.PathLike):
        with open(path, "rb") as handle:
            self.size = os.fstat(handle.fileno()).st_size
            if self.size < 8:
                raise ValueError(f"{self.size} bytes, too short for a safetensors header")
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        self._lock = threading.Lock()

    def tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Every tensor of the file as a view of its pages, and the ``__metadata__``."""
        (length,) = struct.unpack("<Q", self._map[:8])
        if 8 + length > self.size:
            raise ValueError(f"its header claims {length} bytes, the file has {self.size}")
        header = json.loads(self._map[8:8 + length])
        meta = header.pop("__metadata__", None) or {}
        data = torch.frombuffer(self._map, dtype=torch.uint8)[8 + length:]
        out = {}
        for name, entry in header.items():
            dtype, shape = _STORED.get(entry["dtype"]), tuple(entry["shape"])
            begin, end = entry["data_offsets"]
            if dtype is None:
                raise ValueError(f"{name} has dtype {entry['dtype']}, not one of a shard's")
            if end - begin != math.prod(shape) * dtype.itemsize or end > data.numel():
                raise ValueError(f"{name} spans bytes {begin}:{end} of {data.numel()} for "
                                 f"shape {list(shape)}")
            raw = data[begin:end]
            if (8 + length + begin) % dtype.itemsize:  # not aligned: a copy, not a view
                raw = raw.clone()
            out[name] = raw.view(dtype).reshape(shape)
        return out, meta

    def release(self) -> None:
        """Give back the pages this process has touched; the data stays readable."""
        with self._lock:
            if not self._map.closed and hasattr(mmap, "MADV_DONTNEED"):
                self._map.madvise(mmap.MADV_DONTNEED)


def open_mapped(path: str | os.PathLike, sha256: str | None = None) -> Shard:
    """The shard at ``path`` memory-mapped, its tensors in their stored dtype (nothing is
    read until used). With ``sha256`` the file is first hashed in blocks (never held whole);
    a mismatch or an undecodable file raises :class:`ShardDamaged` naming it."""
    if sha256 is not None:
        actual = sha256_path(path)
        if actual != sha256:
            raise ShardDamaged(path, f"its sha256 {actual[:12]}… is not the {sha256[:12]}… "
                                     f"recorded at extraction (truncated or modified on disk)")
    try:
        mapping = Mapping(path)
        t, raw_meta = mapping.tensors()
        meta = _parse_metadata(raw_meta, path)
        stored = [t[name] for name in ("input_ids", "loss_mask", "offsets", "teacher_argmax",
                                       "aux_hidden", "final_hidden")]
    except (ValueError, OSError, KeyError, TypeError) as exc:
        raise ShardDamaged(path, f"it cannot be read ({exc!r})") from exc
    return Shard(*stored, meta["sample_ids"], meta["aux_layer_ids"], meta["dtype"],
                 meta["target"], t.get("aux_scale"), t.get("final_scale"), mapping)


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


def sha256_path(path: str | os.PathLike, block_bytes: int = 4 << 20) -> str:
    """The file's sha256, read into one reused block (never more of it in memory)."""
    digest = hashlib.sha256()
    block = bytearray(block_bytes)
    view = memoryview(block)
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(block):
            digest.update(view[:count])
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
