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

import bisect
import ctypes
import hashlib
import json
import math
import mmap
import os
import struct
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import load as load_bytes

from eaglet.core.dtypes import safetensors_codes, torch_dtypes
from eaglet.core.io import umask
from eaglet.data.shard_format import (  # noqa: F401 (the
    DIGEST_BLOCK,
    DIGEST_PREFIX,
    FORMAT,
    bytes_per_token,  # format's facts,
    sha256_bytes,
    sha256_path,
    shard_path,  # read as shards.X)
)

STORAGE_DTYPES = torch_dtypes()  # extract.dtype's name -> the torch dtype a shard holds
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
    aux_scale: torch.Tensor | None = None  # fp8 from open_mapped only: [N, A]
    final_scale: torch.Tensor | None = None  # fp8 from open_mapped only: [N, 1]
    mapping: Mapping | None = None  # the file's pages (open_mapped)

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


def fp8_apply(
    x: torch.Tensor,
    scale: torch.Tensor,
    work: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
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
# A shard's layout is fixed by the shapes alone: the safetensors header is computed first, and
# every tensor has its place in the file before any of its bytes exist. :class:`ShardFile`
# writes rows at those places in any order (extraction writes each batch's states as soon as
# they reach the host, batches sorted by length rather than by sample), and digests the file
# block by block (:data:`DIGEST_BLOCK`) on a pool of threads as soon as a block's last byte is
# written, starting its writeback to disk at the same time; closing waits for the last blocks,
# fsyncs and renames. So neither hashing nor the disk waits for the whole shard, and neither
# holds up the thread that computes the states. The layout is the one ``safetensors.torch.save``
# gives the same tensors (its tensor order, its compact JSON, spaces up to a multiple of 8),
# with the ``__metadata__`` keys sorted so that equal shards are equal bytes.
#
# The digest a shard's record keeps (``sha256`` in its JSON and the manifest) is the sha256 of
# the sha256s of the file's 8 MiB blocks, written ``sha256-8MiB-blocks:<hex>``: the blocks can
# be hashed in any order and in parallel, when writing and when verifying. A bare hex value is
# the plain sha256 of the whole file, which shards written before the block digest record;
# :func:`digest_matches` checks either.

CHUNK_BYTES = 4 << 20  # float32 bytes of a row block of the hidden states, per write


class Written(NamedTuple):
    """What :func:`write` wrote: the file's digest (``sha256-8MiB-blocks:<hex>``) and size."""

    sha256: str
    bytes: int


def _root_digest(block_digests: Sequence[bytes]) -> str:
    return DIGEST_PREFIX + hashlib.sha256(b"".join(block_digests)).hexdigest()


def digest_bytes(data: bytes | memoryview) -> str:
    """The block digest of a file's bytes held in memory."""
    view = memoryview(data)
    return _root_digest(
        [
            hashlib.sha256(view[i : i + DIGEST_BLOCK]).digest()
            for i in range(0, len(view), DIGEST_BLOCK)
        ]
        or [hashlib.sha256().digest()]
    )


def _hash_threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def digest_path(path: str | os.PathLike, threads: int | None = None) -> str:
    """The block digest of the file at ``path``, its blocks read and hashed by ``threads``
    threads (hashlib lets go of the GIL), one block each in memory at a time."""
    with open(path, "rb", buffering=0) as handle:
        fd = handle.fileno()
        size = os.fstat(fd).st_size
        count = max(1, -(-size // DIGEST_BLOCK))
        local = threading.local()

        def block(index: int) -> bytes:
            buffer = getattr(local, "buffer", None)
            if buffer is None:
                buffer = local.buffer = bytearray(DIGEST_BLOCK)
            want = min(DIGEST_BLOCK, size - index * DIGEST_BLOCK)
            got = os.preadv(fd, [memoryview(buffer)[:want]], index * DIGEST_BLOCK)
            return hashlib.sha256(memoryview(buffer)[:got]).digest()

        with ThreadPoolExecutor(max_workers=threads or _hash_threads()) as pool:
            return _root_digest(list(pool.map(block, range(count))))


def digest_matches(
    recorded: str, *, path: str | os.PathLike | None = None, data: bytes | None = None
) -> tuple[bool, str]:
    """Whether the file at ``path`` (or the bytes ``data``) has the ``recorded`` digest, and
    the digest it has: a block digest, or the plain sha256 a shard of an earlier eaglet
    recorded."""
    plain = not recorded.startswith(DIGEST_PREFIX)
    if data is not None:
        actual = sha256_bytes(data) if plain else digest_bytes(data)
    else:
        actual = sha256_path(path) if plain else digest_path(path)
    return actual == recorded, actual


def short_digest(value: str) -> str:
    """A digest for messages: its scheme's tag dropped, 12 hex digits."""
    return value.removeprefix(DIGEST_PREFIX)[:12] + "…"


def _sync_file_range():
    """Linux's ``sync_file_range`` (start writing a file range back to disk without waiting),
    or None where the C library has none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return call


_WRITEBACK = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


@dataclass(frozen=True)
class Field:
    """One tensor of a shard as stored: its name, stored dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize


def _header(fields: Sequence[Field], metadata: dict[str, str]) -> tuple[bytes, dict[str, int]]:
    """The safetensors header (length prefix included) and each field's offset in the file."""
    ordered = sorted(fields, key=lambda f: (list(safetensors_codes()).index(f.dtype), f.name))
    header: dict = {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    places = {}
    for f in ordered:
        header[f.name] = {
            "dtype": safetensors_codes()[f.dtype],
            "shape": list(f.shape),
            "data_offsets": [offset, offset + f.nbytes],
        }
        places[f.name] = offset
        offset += f.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    return head, {name: len(head) + at for name, at in places.items()}


def state_fields(tokens: int, hidden_size: int, num_aux: int, dtype: str) -> list[Field]:
    """Every tensor of a shard of ``tokens`` rows, as stored in ``dtype``."""
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"unknown shard dtype {dtype!r}; allowed: {', '.join(STORAGE_DTYPES)}")
    stored = STORAGE_DTYPES[dtype]
    fields = [
        Field("input_ids", torch.int64, (tokens,)),
        Field("loss_mask", torch.uint8, (tokens,)),
        Field("teacher_argmax", torch.int64, (tokens,)),
        Field("aux_hidden", stored, (tokens, num_aux * hidden_size)),
        Field("final_hidden", stored, (tokens, hidden_size)),
    ]
    if dtype == "fp8":
        fields += [
            Field("aux_scale", torch.float32, (tokens, num_aux)),
            Field("final_scale", torch.float32, (tokens, 1)),
        ]
    return fields


def shard_metadata(
    dtype: str, hidden_size: int, aux_layer_ids, sample_ids, target: dict
) -> dict[str, str]:
    """The ``__metadata__`` strings that make a shard explain itself."""
    return {
        "format": FORMAT,
        "dtype": dtype,
        "hidden_size": str(hidden_size),
        "aux_layer_ids": json.dumps(list(aux_layer_ids)),
        "sample_ids": json.dumps(list(sample_ids)),
        "target": json.dumps(target, sort_keys=True),
    }


class ShardFile:
    """A shard file being written: a temporary sibling of ``path`` whose layout is fixed by
    ``fields`` (:func:`state_fields` plus ``offsets``) up front; :meth:`write` puts rows of a
    field at their place, from any thread, in any order. Each block of the file is digested
    (and its writeback started) as soon as its last byte is written; :meth:`close` checks that
    every byte was written exactly once, waits for the digests, fsyncs and renames the file
    into place. Used as a context manager, an exception removes the temporary file."""

    def __init__(
        self,
        path: str | os.PathLike,
        fields: Sequence[Field],
        metadata: dict[str, str],
        hash_threads: int | None = None,
    ):
        self.path = Path(path)
        self.fields = {f.name: f for f in fields}
        head, self.places = _header(fields, metadata)
        self.size = len(head) + sum(f.nbytes for f in fields)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd, self.tmp = tempfile.mkstemp(
            prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent
        )
        os.fchmod(self.fd, 0o666 & ~umask())  # mkstemp's 0600 would outlive the rename
        count = max(1, -(-self.size // DIGEST_BLOCK))
        self._filled = [0] * count
        self._digests: list[bytes | None] = [None] * count
        self._lock = threading.Lock()
        self._rows: dict[str, list[tuple[int, int]]] = {}
        self._pool = ThreadPoolExecutor(
            max_workers=hash_threads or _hash_threads(), thread_name_prefix="shard-digest"
        )
        self._pending: list = []
        self._closed = False
        self._write_at(0, memoryview(head))

    def write(self, name: str, row: int, data: torch.Tensor) -> None:
        """Rows ``row:row + len(data)`` of field ``name``: ``data`` on the host, in the field's
        stored dtype and row shape."""
        field_ = self.fields[name]
        if data.dtype != field_.dtype or tuple(data.shape[1:]) != field_.shape[1:]:
            raise ValueError(
                f"{name}: rows of {data.dtype} {list(data.shape[1:])} given, the "
                f"shard stores {field_.dtype} {list(field_.shape[1:])}"
            )
        if row < 0 or row + data.shape[0] > field_.shape[0]:
            raise ValueError(
                f"{name}: rows {row}:{row + data.shape[0]} outside its {field_.shape[0]} rows"
            )
        if not data.numel():
            return
        self._claim(name, row, row + data.shape[0])
        raw = memoryview(data.contiguous().view(torch.uint8).numpy()).cast("B")
        self._write_at(self.places[name] + row * field_.row_bytes, raw)

    def _claim(self, name: str, start: int, end: int) -> None:
        """Record rows ``start:end`` of ``name`` as written; rows written before are refused."""
        with self._lock:
            spans = self._rows.setdefault(name, [])  # sorted, disjoint, merged (start, end)
            at = bisect.bisect_left(spans, (start, end))
            if (at and spans[at - 1][1] > start) or (at < len(spans) and spans[at][0] < end):
                raise ValueError(f"{self.path.name}: rows {start}:{end} of {name} written twice")
            if at and spans[at - 1][1] == start:
                at -= 1
                start = spans.pop(at)[0]
            if at < len(spans) and spans[at][0] == end:
                end = spans.pop(at)[1]
            spans.insert(at, (start, end))

    def _write_at(self, offset: int, raw: memoryview) -> None:
        done = 0
        while done < len(raw):
            done += os.pwrite(self.fd, raw[done:], offset + done)
        first, last = offset // DIGEST_BLOCK, (offset + len(raw) - 1) // DIGEST_BLOCK
        complete = []
        with self._lock:
            for block in range(first, last + 1):
                lo, hi = block * DIGEST_BLOCK, min((block + 1) * DIGEST_BLOCK, self.size)
                self._filled[block] += min(hi, offset + len(raw)) - max(lo, offset)
                if self._filled[block] == hi - lo:
                    complete.append((block, lo, hi - lo))
        for block, lo, size in complete:
            self._done(block, lo, size)

    def _done(self, block: int, lo: int, size: int) -> None:
        self._pending.append(self._pool.submit(self._digest, block, lo, size))

    def _digest(self, block: int, lo: int, size: int) -> None:
        data = os.pread(self.fd, size, lo)
        if len(data) != size:
            raise OSError(f"{self.tmp}: read {len(data)} of {size} bytes at {lo} back")
        self._digests[block] = hashlib.sha256(data).digest()
        if _WRITEBACK is not None and size:  # start its writeback now, not at the fsync
            _WRITEBACK(self.fd, lo, size, _SYNC_FILE_RANGE_WRITE)

    def close(self) -> Written:
        """Wait for the digests, fsync and rename into place; the file's digest and size."""
        try:
            missing = [
                f"{b * DIGEST_BLOCK}:{min((b + 1) * DIGEST_BLOCK, self.size)}"
                for b, filled in enumerate(self._filled)
                if filled != min(DIGEST_BLOCK, self.size - b * DIGEST_BLOCK)
            ]
            if missing:
                raise ValueError(
                    f"{self.path.name}: bytes {', '.join(missing[:4])} were never "
                    f"written ({len(missing)} blocks incomplete)"
                )
            for future in self._pending:
                future.result()
            os.fsync(self.fd)
            os.close(self.fd)
            self._closed = True
            os.replace(self.tmp, self.path)
        except BaseException:
            self.abort()
            raise
        finally:
            self._pool.shutdown(wait=True)
        return Written(_root_digest(self._digests), self.size)

    def abort(self) -> None:
        """Stop: the temporary file is removed, nothing is renamed."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        if not self._closed:
            self._closed = True
            os.close(self.fd)
        Path(self.tmp).unlink(missing_ok=True)

    def __enter__(self) -> ShardFile:
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is not None:
            self.abort()


def _pieces(x: torch.Tensor | Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
    """Row pieces of a [N, W] tensor (one tensor, or consecutive row blocks of it)."""
    pieces = [x] if isinstance(x, torch.Tensor) else list(x)
    if not pieces or any(p.dim() != 2 or p.shape[1] != pieces[0].shape[1] for p in pieces):
        raise ValueError(
            f"{name} must be a [N, W] tensor or a non-empty list of row blocks of "
            f"one width, got shapes {[tuple(p.shape) for p in pieces]}"
        )
    return pieces


def _row_blocks(pieces: list[torch.Tensor], bytes_per_row: int, chunk_bytes: int):
    rows = max(1, chunk_bytes // max(1, bytes_per_row))
    for piece in pieces:
        for start in range(0, piece.shape[0], rows):
            yield piece[start : start + rows]


def _write_states(
    out: ShardFile,
    name: str,
    pieces: list[torch.Tensor],
    storage: str,
    groups: int,
    chunk_bytes: int,
) -> None:
    """The hidden-state tensor ``name`` (and ``<prefix>_scale`` for fp8), cast or quantized a
    row block at a time."""
    width = pieces[0].shape[1]
    if storage == "fp8" and width % groups:
        raise ValueError(f"{name} has {width} columns, not a multiple of its {groups} fp8 groups")
    rows = max(1, chunk_bytes // (4 * width))  # float32 rows per block
    # Work buffers of one row block, reused: fresh temporaries per block cost page faults, and
    # small results kept alive between them fragment the heap so that the memory of every
    # block stays resident (measured: a shard's worth).
    work = torch.empty(rows, width, dtype=torch.float32) if storage == "fp8" else None
    q = torch.empty(rows, width, dtype=torch.float8_e4m3fn) if storage == "fp8" else None
    mags: dict[torch.dtype, torch.Tensor] = {}
    prefix = name.removesuffix("_hidden")
    start = 0
    for block in _row_blocks(pieces, 4 * width, chunk_bytes):
        if storage != "fp8":
            out.write(name, start, block.to(STORAGE_DTYPES[storage]))
        else:
            if (
                block.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and block.dtype not in mags
            ):
                mags[block.dtype] = torch.empty(rows, width, dtype=block.dtype)
            scale = fp8_scale(block, groups, mags.get(block.dtype))
            out.write(f"{prefix}_scale", start, scale)
            out.write(name, start, fp8_apply(block, scale, work, q))
        start += block.shape[0]


def write(
    path: str | os.PathLike,
    input_ids,
    loss_mask,
    offsets,
    teacher_argmax,
    aux_hidden,
    final_hidden,
    *,
    sample_ids,
    aux_layer_ids,
    dtype: str,
    target: dict,
    chunk_bytes: int = CHUNK_BYTES,
) -> Written:
    """Write one shard to ``path`` (atomically: a temporary sibling, fsynced, renamed) and
    return its digest and size, digested while writing (:class:`ShardFile`).

    ``aux_hidden``/``final_hidden`` are given in any float dtype, each as one [N, W] tensor
    or as a list of consecutive row blocks of it (extraction's per-sequence states, so that
    they need not be concatenated first); they are cast or quantized ``chunk_bytes`` at a
    time."""
    aux_pieces, final_pieces = (
        _pieces(aux_hidden, "aux_hidden"),
        _pieces(final_hidden, "final_hidden"),
    )
    tokens, hidden = sum(p.shape[0] for p in final_pieces), final_pieces[0].shape[1]
    if sum(p.shape[0] for p in aux_pieces) != tokens:
        raise ValueError(
            f"aux_hidden has {sum(p.shape[0] for p in aux_pieces)} rows, final_hidden {tokens}"
        )
    groups = len(aux_layer_ids)
    if aux_pieces[0].shape[1] != groups * hidden:
        raise ValueError(
            f"aux_hidden has {aux_pieces[0].shape[1]} columns, {groups} aux layers "
            f"of hidden size {hidden} make {groups * hidden}"
        )
    offsets = torch.as_tensor(offsets).reshape(-1)
    fields = [
        *state_fields(tokens, hidden, groups, dtype),
        Field("offsets", torch.int64, (offsets.numel(),)),
    ]
    metadata = shard_metadata(dtype, hidden, aux_layer_ids, sample_ids, target)
    with ShardFile(path, fields, metadata) as out:
        for name, values, stored in (
            ("input_ids", input_ids, torch.int64),
            ("loss_mask", loss_mask, torch.uint8),
            ("offsets", offsets, torch.int64),
            ("teacher_argmax", teacher_argmax, torch.int64),
        ):
            values = torch.as_tensor(values).reshape(-1)
            step = max(1, chunk_bytes // stored.itemsize)
            for at in range(0, values.numel(), step):
                out.write(name, at, values[at : at + step].to(stored))
        _write_states(out, "aux_hidden", aux_pieces, dtype, groups, chunk_bytes)
        _write_states(out, "final_hidden", final_pieces, dtype, 1, chunk_bytes)
        return out.close()


class ShardDamaged(ValueError):
    """A shard's bytes are not the ones extraction wrote (truncated, modified, unreadable)."""

    def __init__(self, path: str | os.PathLike, reason: str):
        super().__init__(f"hidden-state shard {path} is damaged: {reason}")
        self.path = Path(path)
        self.reason = reason


def _parse_metadata(meta: dict, path: str | os.PathLike) -> dict:
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"{path} is not an eaglet hidden-state shard (format {meta.get('format')!r})"
        )
    return {
        "dtype": meta["dtype"],
        "hidden_size": int(meta["hidden_size"]),
        "aux_layer_ids": json.loads(meta["aux_layer_ids"]),
        "sample_ids": json.loads(meta["sample_ids"]),
        "target": json.loads(meta["target"]),
    }


def read_metadata(path: str | os.PathLike) -> dict:
    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata() or {}
    return _parse_metadata(meta, path)


def load(path: str | os.PathLike, sha256: str | None = None) -> Shard:
    """The shard at ``path``. With ``sha256`` (the digest recorded at extraction) the file is
    read once into memory, digested over those same bytes and decoded from them; a mismatch or
    an undecodable file raises :class:`ShardDamaged` naming it."""
    if sha256 is None:
        meta = read_metadata(path)
        with safe_open(str(path), framework="pt") as handle:
            t = {name: handle.get_tensor(name) for name in handle.keys()}
    else:
        with open(path, "rb") as handle:
            data = handle.read()
        _check_digest(path, sha256, data=data)
        t = load_bytes(data)
        meta = _parse_metadata(_file_header(data).get("__metadata__") or {}, path)
        del data
    aux = to_float(t["aux_hidden"], t.get("aux_scale"))
    final = to_float(t["final_hidden"], t.get("final_scale"))
    return Shard(
        t["input_ids"],
        t["loss_mask"],
        t["offsets"],
        t["teacher_argmax"],
        aux,
        final,
        meta["sample_ids"],
        meta["aux_layer_ids"],
        meta["dtype"],
        meta["target"],
    )


def _check_digest(path: str | os.PathLike, recorded: str, data: bytes | None = None) -> None:
    ok, actual = digest_matches(recorded, path=path, data=data)
    if not ok:
        raise ShardDamaged(
            path,
            f"its sha256 {short_digest(actual)} is not the "
            f"{short_digest(recorded)} recorded at extraction (truncated or "
            f"modified on disk)",
        )


def _file_header(data: bytes) -> dict:
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + n])


# -- reading without holding -----------------------------------------------------------------
#
# Training maps a shard instead of reading it: its tensors are views of the file's pages in
# the stored dtype, the kernel reads what a batch touches, and the pages a process has touched
# are given back with ``Mapping.release`` (they stay in the page cache, shared by every rank,
# and are read again from there when needed). The hash check reads the file once in blocks
# before mapping it, so the guarantee of :func:`load` (no byte used that extraction did not
# write) holds without the shard ever being in memory whole.

_STORED = {code: dtype for dtype, code in safetensors_codes().items()}


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
        header = json.loads(self._map[8 : 8 + length])
        meta = header.pop("__metadata__", None) or {}
        data = torch.frombuffer(self._map, dtype=torch.uint8)[8 + length :]
        out = {}
        for name, entry in header.items():
            dtype, shape = _STORED.get(entry["dtype"]), tuple(entry["shape"])
            begin, end = entry["data_offsets"]
            if dtype is None:
                raise ValueError(f"{name} has dtype {entry['dtype']}, not one of a shard's")
            if end - begin != math.prod(shape) * dtype.itemsize or end > data.numel():
                raise ValueError(
                    f"{name} spans bytes {begin}:{end} of {data.numel()} for shape {list(shape)}"
                )
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
    read until used). With ``sha256`` the file is first digested in blocks (never held whole);
    a mismatch or an undecodable file raises :class:`ShardDamaged` naming it."""
    if sha256 is not None:
        _check_digest(path, sha256)
    try:
        mapping = Mapping(path)
        t, raw_meta = mapping.tensors()
        meta = _parse_metadata(raw_meta, path)
        stored = [
            t[name]
            for name in (
                "input_ids",
                "loss_mask",
                "offsets",
                "teacher_argmax",
                "aux_hidden",
                "final_hidden",
            )
        ]
    except (ValueError, OSError, KeyError, TypeError) as exc:
        raise ShardDamaged(path, f"it cannot be read ({exc!r})") from exc
    return Shard(
        *stored,
        meta["sample_ids"],
        meta["aux_layer_ids"],
        meta["dtype"],
        meta["target"],
        t.get("aux_scale"),
        t.get("final_scale"),
        mapping,
    )


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
