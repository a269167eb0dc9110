"""The drafter's training data: shards checked against the target and the vocabulary map,
memory-mapped in their stored dtype (hash-checked once each), packed whole into micro-batches
of at most ``max_tokens_per_batch`` rows per epoch (shuffled, seeded, ``train.shards_in_memory``
shards mixed at a time), laid out for training-time test (``make_batch``: which rows count at
each TTT step), and built ahead of the step that needs them (``Prefetcher``).

Host memory stays under ``train.host_ram_mb`` (``DataMemory``): the micro-batches built ahead,
and the shard pages a process has read, which are given back to the kernel whenever what was
read since would exceed the rest. Features reach the device in their stored dtype and become
float32 there, a micro-batch at a time (``Batch.to``).

A sample longer than ``max_len`` is cut to its first ``max_len`` tokens. At TTT step ``k`` row
``t`` predicts token ``t+2+k``; that position counts when the token lies in the sample, is a
completion token (or any token with ``loss_on_prompt``) and the target's argmax there is in
the draft vocabulary.
"""

from __future__ import annotations

import math
import operator
import os
import queue
import random
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from eaglet.core.io import read_json
from eaglet.data import shards as shard_format
from eaglet.target.checkpoint import model_identity


class TrainError(RuntimeError):
    """The inputs or the run cannot go on; the message says what to change."""


@dataclass
class ShardInfo:
    path: str
    lengths: list[int]
    sample_ids: list[str]
    hidden_size: int
    aux_layer_ids: list[int]
    target: dict
    sha256: str | None = None  # recorded in the manifest at extraction; None: not verified
    dtype: str = "float32"  # storage dtype of the hidden states

    @property
    def bytes_per_token(self) -> int:
        return shard_format.bytes_per_token(self.hidden_size, len(self.aux_layer_ids), self.dtype)


def manifest_hashes(manifest_path: str, paths: list[str]) -> dict[str, str]:
    """The sha256 that ``manifest.json`` records for each shard of ``paths``."""
    manifest = read_json(manifest_path)
    root = Path(manifest_path).parent
    listed = {
        os.path.realpath(root / entry["file"]): entry["sha256"]
        for entry in manifest.get("shards", []) + manifest.get("eval_shards", [])
    }
    hashes = {}
    for path in paths:
        sha256 = listed.get(os.path.realpath(path))
        if sha256 is None:
            raise TrainError(
                f"{path} is not listed in {manifest_path}, so it cannot be verified: "
                f"rebuild the manifest (snakemake --forcerun hidden_manifest)"
            )
        hashes[path] = sha256
    return hashes


def damaged(exc: shard_format.ShardDamaged) -> TrainError:
    """Move a damaged shard aside, so that the next run extracts it again, and say so."""
    aside = shard_format.set_aside(exc.path)
    where = f"it was moved to {aside.name}" if aside else "it is gone"
    return TrainError(
        f"{exc}. No training step used its damaged bytes; {where}, so that "
        f"rerunning the workflow extracts it again (finished checkpoints are kept)"
    )


def index_shard(path: str, vocab_size: int, sha256: str | None = None) -> ShardInfo:
    """What training needs to know of a shard before loading it, with its token ids checked.
    With ``sha256`` a shard that cannot be read, or whose check fails because its bytes
    changed since extraction, is refused as damaged."""

    def refuse(message: str) -> TrainError:
        if sha256 is not None and not shard_format.digest_matches(sha256, path=path)[0]:
            return damaged(
                shard_format.ShardDamaged(
                    path,
                    "its sha256 is not the one recorded at extraction (truncated or modified "
                    f"on disk; {message})",
                )
            )
        return TrainError(message)

    try:
        meta = shard_format.read_metadata(path)
        with safe_open(str(path), framework="pt") as handle:
            offsets = handle.get_tensor("offsets")
            width = handle.get_slice("aux_hidden").get_shape()[1]
            # teacher_argmax is -1 on rows no loss reads (see eaglet.data.shards)
            ranges = {}
            for name in ("input_ids", "teacher_argmax"):
                ids = handle.get_tensor(name)
                ranges[name] = (int(ids.min()), int(ids.max())) if ids.numel() else None
    except Exception as exc:  # safetensors' own message names no file
        if sha256 is None:
            raise TrainError(f"{path} cannot be read ({exc}): rerun extract for it") from exc
        raise damaged(shard_format.ShardDamaged(path, f"it cannot be read ({exc})")) from exc
    for name, lowest in (("input_ids", 0), ("teacher_argmax", -1)):
        if ranges[name] is None:
            continue
        low, high = ranges[name]
        if low < lowest or high >= vocab_size:
            bad = low if low < lowest else high
            raise refuse(
                f"{path}: {name} holds id {bad} outside the target vocabulary of "
                f"{vocab_size}: the shard was extracted for another "
                f"tokenizer; rerun extract for this target"
            )
    if width != meta["hidden_size"] * len(meta["aux_layer_ids"]):
        raise refuse(
            f"{path}: aux_hidden is {width} wide, not hidden size {meta['hidden_size']}"
            f" x {len(meta['aux_layer_ids'])} aux layers: the shard is corrupt; rerun extract"
        )
    return ShardInfo(
        str(path),
        (offsets[1:] - offsets[:-1]).tolist(),
        meta["sample_ids"],
        meta["hidden_size"],
        meta["aux_layer_ids"],
        meta["target"],
        sha256,
        meta["dtype"],
    )


def check_vocab_map(target_config: dict, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    vocab = target_config["vocab_size"]
    fix = "rebuild vocab/vocab_map.safetensors for this target (rerun the vocab_map rule)"
    if t2d.numel() != vocab:
        raise TrainError(
            f"the vocab map's t2d covers {t2d.numel()} tokens but the target's "
            f"vocab_size is {vocab}: {fix}"
        )
    draft_to_target = torch.arange(d2t.numel()) + d2t
    if (
        int(t2d.sum()) != d2t.numel()
        or int(draft_to_target.min()) < 0
        or int(draft_to_target.max()) >= vocab
        or not bool(t2d[draft_to_target].all())
    ):
        raise TrainError(
            f"the vocab map is inconsistent: d2t maps {d2t.numel()} draft ids but "
            f"t2d marks {int(t2d.sum())} target ids, or they disagree: {fix}"
        )


def same_model(a: dict, b: dict) -> bool:
    """Whether two shards' targets are one model: by its checkpoint's hashes where both hold
    them (two runs' copies of one model live at different paths), else field by field."""
    hashes = ("source_sha256", "config_sha256")
    if all(k in a and k in b for k in hashes):
        return all(a[k] == b[k] for k in hashes)
    return a == b


def check_shards(infos: list[ShardInfo], target_config: dict, target_dir: str) -> None:
    """Refuse shards that disagree with each other or with the target."""
    first, identity = infos[0], None
    for info in infos:
        if info.hidden_size != target_config["hidden_size"]:
            raise TrainError(
                f"{info.path} has hidden size {info.hidden_size} but the target has "
                f"{target_config['hidden_size']}: it was extracted from another "
                f"model; rerun extract"
            )
        for what, same in (("aux_layer_ids", operator.eq), ("target", same_model)):
            if not same(getattr(info, what), getattr(first, what)):
                raise TrainError(
                    f"{info.path} has {what} {getattr(info, what)} but {first.path} has "
                    f"{getattr(first, what)}: the shards come from different extract runs; "
                    f"delete the stale ones and rerun extract"
                )
        if "config_sha256" in info.target:
            identity = identity or model_identity(Path(target_dir))
            if info.target["config_sha256"] != identity["config_sha256"]:
                raise TrainError(
                    f"{info.path} was extracted from a target whose config differs "
                    f"from {target_dir}: rerun extract for this target"
                )


# -- samples, packing and batches -------------------------------------------------------------

MB = 1 << 20
MAX_OPEN_SHARDS = 256  # mapped files at once with shards_in_memory 0 (each holds a descriptor)


class DataMemory:
    """The host memory of the training data in one process (``train.host_ram_mb``): room for
    the micro-batches built ahead, and a limit on the shard pages mapped in. Every mapping
    registers here; when the rows read since the last release would pass the limit, the
    pages of every mapping are given back (they stay in the page cache)."""

    def __init__(self, page_limit: int | None):
        self.page_limit = page_limit
        self.read = 0
        self.releases = 0
        self._mappings: set = set()
        self._lock = threading.Lock()

    def add(self, mapping) -> None:
        with self._lock:
            self._mappings.add(mapping)

    def discard(self, mapping) -> None:
        with self._lock:
            self._mappings.discard(mapping)
        mapping.release()

    def reading(self, nbytes: int) -> None:
        """``nbytes`` of mapped rows are about to be read."""
        with self._lock:
            self.read += nbytes
            if self.page_limit is None or self.read <= self.page_limit:
                return
            self.read, self.releases = nbytes, self.releases + 1
            mappings = list(self._mappings)
        for mapping in mappings:
            mapping.release()


def prefetch_depth(configured: int | None, device: torch.device) -> int:
    """``train.prefetch_batches``, its null resolved for the device: packing ahead in a thread
    pays where a GPU computes, and costs on the CPU, whose cores the step itself uses (the
    demo's training ran at 0.65x its tokens/s with 2 batches ahead on 2 cores)."""
    if configured is not None:
        return configured
    return 2 if device.type == "cuda" else 0


def data_memory(cfg: dict, infos: list[ShardInfo]) -> DataMemory:
    """Split ``train.host_ram_mb`` between the micro-batches built ahead (``prefetch_batches``
    waiting and one being built, in the stored dtype) and the shard pages; refuse a budget
    that cannot hold those batches and one more batch of pages."""
    per_token = max(info.bytes_per_token for info in infos)
    layout = 8 * (2 * cfg["ttt_steps"] + 3)  # step ids, rows, positions, segments
    batch = cfg["max_tokens_per_batch"] * (per_token + layout)
    ahead = (cfg["prefetch_batches"] + 1) * batch
    pages = cfg["host_ram_mb"] * MB - ahead
    if pages < cfg["max_tokens_per_batch"] * per_token:
        need = math.ceil((ahead + cfg["max_tokens_per_batch"] * per_token) / MB)
        raise TrainError(
            f"train.host_ram_mb {cfg['host_ram_mb']} cannot hold {cfg['prefetch_batches'] + 1} "
            f"micro-batches of {batch / MB:.0f} MB ({cfg['prefetch_batches']} built ahead, "
            f"train.prefetch_batches, and one being built) and the shard pages of one more: "
            f"set train.host_ram_mb to at least {need}, or lower train.prefetch_batches or "
            f"train.max_tokens_per_batch"
        )
    return DataMemory(pages)


class Samples:
    """The samples of a list of shards under one global index. A shard is mapped on first
    use, its file hash-checked against the manifest the first time (again only if the file
    changed), and at most ``keep`` of them stay mapped (0: all, up to MAX_OPEN_SHARDS);
    the pages read are bounded by ``memory``. Safe to use from one thread at a time per
    shard list (the prefetcher's, or the loop's)."""

    def __init__(self, infos: list[ShardInfo], keep: int = 0, memory: DataMemory | None = None):
        self.infos = infos
        self.keep = keep
        self.memory = memory or DataMemory(None)
        self.lengths = [n for info in infos for n in info.lengths]
        self.shard_of = [s for s, info in enumerate(infos) for _ in info.lengths]
        self.first = [0]  # global index of each shard's first sample
        for info in infos[:-1]:
            self.first.append(self.first[-1] + len(info.lengths))
        self._open: OrderedDict[int, shard_format.Shard] = OrderedDict()
        self._verified: dict[int, tuple] = {}  # shard -> (inode, size, mtime) when checked
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.lengths)

    def preload(self) -> None:
        """With every shard in one mixing window (``keep`` 0), hash-check every shard now, so
        that a damaged one stops the run before its first step; otherwise each is checked
        when first used."""
        if not self.keep:
            for number in range(len(self.infos)):
                self.shard(number)

    def close(self) -> None:
        with self._lock:
            while self._open:
                self.memory.discard(self._open.popitem()[1].mapping)

    def shard(self, number: int) -> shard_format.Shard:
        with self._lock:
            if number in self._open:
                self._open.move_to_end(number)
                return self._open[number]
            info = self.infos[number]
            stat = os.stat(info.path)
            signature = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
            check = info.sha256 if self._verified.get(number) != signature else None
            try:  # hashed in blocks against the manifest, then mapped
                shard = shard_format.open_mapped(info.path, check)
            except shard_format.ShardDamaged as exc:
                raise damaged(exc) from exc
            self._verified[number] = signature
            self._open[number] = shard
            self.memory.add(shard.mapping)
            if len(self._open) > (self.keep or MAX_OPEN_SHARDS):
                self.memory.discard(self._open.popitem(last=False)[1].mapping)
            return shard

    def get(self, index: int, max_len: int) -> tuple:
        """(sample id, input_ids, loss_mask, teacher_argmax, aux_hidden, final_hidden,
        aux_scale, final_scale): views of the mapped shard, states in the stored dtype
        (scales: fp8 only, else None)."""
        number = self.shard_of[index]
        local = index - self.first[number]
        shard = self.shard(number)
        rows = shard.sample(local)
        rows = slice(rows.start, min(rows.stop, rows.start + max_len))
        self.memory.reading((rows.stop - rows.start) * self.infos[number].bytes_per_token)
        scales = (
            (shard.aux_scale[rows], shard.final_scale[rows])
            if shard.aux_scale is not None
            else (None, None)
        )
        return (
            shard.sample_ids[local],
            shard.input_ids[rows],
            shard.loss_mask[rows],
            shard.teacher_argmax[rows],
            shard.aux_hidden[rows],
            shard.final_hidden[rows],
            *scales,
        )


def pack(order: list[int], lengths: list[int], budget: int, open_bins: int = 8) -> list[list[int]]:
    """Whole samples (``lengths`` already cut to max_len) into batches of at most ``budget``
    rows, first fit over the few newest open batches (keeps the shuffled order nearly intact)."""
    done, bins = [], []  # bins: [rows used, [sample indices]]
    for index in order:
        rows = lengths[index]
        for b in bins:
            if b[0] + rows <= budget:
                b[0] += rows
                b[1].append(index)
                break
        else:
            bins.append([rows, [index]])
            if len(bins) > open_bins:
                done.append(bins.pop(0)[1])
    return done + [b[1] for b in bins]


def pack_epoch(samples: Samples, epoch: int, cfg: dict) -> list[list[int]]:
    """The epoch's micro-batches (lists of global sample indices), a pure function of the seed."""
    rng = random.Random(f"eaglet-train:{cfg['seed']}:{epoch}")
    shard_order = list(range(len(samples.infos)))
    if cfg["shuffle"]:
        rng.shuffle(shard_order)
    window = cfg["shards_in_memory"] or len(shard_order)
    lengths = [min(n, cfg["max_len"]) for n in samples.lengths]
    batches = []
    for start in range(0, len(shard_order), window):
        order = [
            samples.first[s] + i
            for s in shard_order[start : start + window]
            for i in range(len(samples.infos[s].lengths))
        ]
        if cfg["shuffle"]:
            rng.shuffle(order)
        batches += pack(order, lengths, cfg["max_tokens_per_batch"])
    return batches


def steps_in(plan: list, group: int) -> int:
    return math.ceil(len(plan) / group)


def step_micro_batches(plan: list, step: int, group: int) -> list:
    """The ``group`` micro-batches of one optimizer step; the last step of an epoch wraps
    around to the epoch's first batches so that every rank has work."""
    return [plan[(step * group + i) % len(plan)] for i in range(group)]


@dataclass
class Batch:
    """A packed micro-batch laid out for TTT (T rows, K steps)."""

    aux: torch.Tensor  # [T, A*H] aux features of each row
    final: torch.Tensor  # [T, H] the target's final-norm output (teacher)
    teacher_argmax: torch.Tensor  # [T] the target's full-vocab argmax (predicts row + 1)
    step_ids: torch.Tensor  # [K, T] token embedded by each row at step k (t+1+k)
    positions: torch.Tensor  # [T] position within the sample
    segments: torch.Tensor  # [T] packed sample number
    rows: list[torch.Tensor]  # K x [n_k] rows whose step-k prediction counts
    sample_ids: list[str]
    aux_scale: torch.Tensor | None = None  # fp8 storage: [T, A] scales of aux, else None
    final_scale: torch.Tensor | None = None  # fp8 storage: [T, 1]

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    def counts(self) -> torch.Tensor:
        return torch.tensor([r.numel() for r in self.rows], dtype=torch.float64)

    def to(self, device: torch.device, dtype: torch.dtype = torch.float32) -> Batch:
        """On ``device`` (asynchronous copies from pinned memory) with the features in
        ``dtype``: the stored dtype crosses to the device and is converted there."""
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        scale = lambda t: None if t is None else move(t)  # noqa: E731
        return Batch(
            shard_format.to_dtype(move(self.aux), scale(self.aux_scale), dtype),
            shard_format.to_dtype(move(self.final), scale(self.final_scale), dtype),
            move(self.teacher_argmax),
            move(self.step_ids),
            move(self.positions),
            move(self.segments),
            [move(r) for r in self.rows],
            self.sample_ids,
        )


def _cat(tensors: list[torch.Tensor], pin: bool) -> torch.Tensor:
    """Row blocks into one tensor (in page-locked memory with ``pin``, for asynchronous
    copies to a GPU: written there directly, not copied again)."""
    if not pin:
        return torch.cat(tensors)
    shape = (sum(t.shape[0] for t in tensors), *tensors[0].shape[1:])
    return torch.cat(tensors, out=torch.empty(shape, dtype=tensors[0].dtype, pin_memory=True))


def make_batch(
    pieces: list[tuple],
    ttt_steps: int,
    t2d: torch.Tensor,
    prompt_loss: bool = False,
    pin: bool = False,
) -> Batch:
    """Pack samples (as ``Samples.get`` returns them; the two fp8 scales may be left out)
    into one TTT batch, features in the dtype they come in. ``prompt_loss``: prompt tokens
    count too (the target's distribution exists there as well). The shards
    store the target's full-vocabulary argmax only where it predicts an answer token (-1
    elsewhere), so a prompt position is not filtered by it: its teacher is the target's
    distribution over the draft vocabulary, as everywhere. ``pin``: in page-locked memory."""
    ids, loss_mask, argmax = (torch.cat([p[i] for p in pieces]) for i in (1, 2, 3))
    unchecked = torch.zeros_like(argmax, dtype=torch.bool)  # rows with no stored argmax
    if prompt_loss:
        loss_mask = torch.ones_like(loss_mask)
        unchecked = argmax < 0
    lengths = torch.tensor([p[1].numel() for p in pieces])
    starts = torch.cumsum(lengths, 0) - lengths
    segments = torch.repeat_interleave(torch.arange(len(pieces)), lengths)
    end = (starts + lengths)[segments]  # [T] first row after the row's sample
    row = torch.arange(ids.numel())
    step_ids, rows = [], []
    for k in range(ttt_steps):
        step_ids.append(ids[torch.minimum(row + 1 + k, end - 1)])
        predicted = row + 2 + k  # the token step k predicts
        inside = predicted < end
        predicted = torch.minimum(predicted, end - 1)
        in_vocab = t2d[argmax[predicted - 1].clamp(min=0)] | unchecked[predicted - 1]
        valid = inside & loss_mask[predicted].bool() & in_vocab
        rows.append(valid.nonzero().squeeze(1))
    fp8 = len(pieces[0]) > 6 and pieces[0][6] is not None
    scales = [_cat([p[i] for p in pieces], pin) if fp8 else None for i in (6, 7)]
    small = lambda t: t.pin_memory() if pin else t  # noqa: E731
    return Batch(
        _cat([p[4] for p in pieces], pin),
        _cat([p[5] for p in pieces], pin),
        small(argmax),
        small(torch.stack(step_ids)),
        small(row - starts[segments]),
        small(segments),
        [small(r) for r in rows],
        [p[0] for p in pieces],
        *scales,
    )


class Prefetcher:
    """Builds items in a background thread, in order, at most ``depth`` of them waiting, so
    that the next micro-batches are packed (and copied into page-locked memory) while the
    current step runs. :meth:`take` hands them out in the order of ``keys``; an exception
    raised while building one is raised by :meth:`take` in its place."""

    def __init__(self, build: Callable, keyed: Iterable[tuple], depth: int):
        if depth < 1:
            raise ValueError(f"a prefetcher needs a depth of at least 1, got {depth}")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        # items handed out and built, and the item the consumer waits for (None: it is not
        # waiting): see wait_for_consumer
        self._taken = self._built = 0
        self._waiting_for: int | None = None
        self._changed = threading.Condition()
        self._thread = threading.Thread(
            target=self._work, args=(build, keyed), daemon=True, name="eaglet-prefetch"
        )
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _work(self, build: Callable, keyed: Iterable[tuple]) -> None:
        try:
            for key, what in keyed:
                if self._stop.is_set() or not self._put((key, build(what), None)):
                    return
                with self._changed:
                    self._built += 1
        except BaseException as exc:  # handed to the consumer, raised there
            self._put((None, None, exc))
            return
        self._put((None, None, StopIteration()))

    def take(self, key=None):
        """The next item; with ``key``, checked to be the one the caller expects."""
        with self._changed:
            self._waiting_for = self._taken + 1
            self._changed.notify_all()
        try:
            got, item, error = self._queue.get()
        finally:
            with self._changed:
                self._taken += 1
                self._waiting_for = None
        if error is not None:
            self._stop.set()
            raise error
        if key is not None and got != key:
            self.close()
            raise RuntimeError(
                f"the prefetcher built {got} where {key} was due: its order "
                f"differs from the training loop's"
            )
        return item

    def wait_for_consumer(self) -> None:
        """Called by a build (in the prefetcher's thread): return once the consumer has taken
        every item built and waits for the one being built, or the prefetcher is closed. A
        build that needs compute the consumer's steps would share (a streamed state's turn
        on the server, StateFeed) asks for it only then: never while a step computes."""
        with self._changed:
            self._changed.wait_for(
                lambda: self._stop.is_set() or self._waiting_for == self._built + 1
            )

    def close(self) -> None:
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        while True:  # let a blocked producer see the stop
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=60)


def add_feature_noise(
    aux: torch.Tensor, layers: int, scale: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``aux`` [T, layers*H] plus Gaussian noise of ``scale`` times each row's RMS per layer."""
    x = aux.float().view(aux.shape[0], layers, -1)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    return (x + scale * rms * noise).view_as(aux).to(aux.dtype)
