"""``train.data: stream``: the training samples' hidden states computed by the serving engine
while the drafter trains, none stored as shards.

The samples keep the layout the shards would have had (``extract.num_shards`` contiguous
blocks of the training split, each sample cut at ``extract.max_len``), so an epoch's
micro-batches are those of shard mode (:func:`eaglet.stages.train.data.pack_epoch`), and a
stream-trained drafter is the shard-trained one up to the engine's float rounding.

:class:`StateFeed` walks the samples in the order training will read them (every remaining
epoch, from the data position a resumed run starts at) and keeps ``ahead`` of them requested
or prepared ahead of the trainer (:meth:`StateFeed.window`): each one a prefill request to
the capture server of the ``vllm`` extraction backend (:mod:`eaglet.engine.capture`), whose
connector saves the states to ``<work>/requests/<sample>.safetensors``; a packing thread
reads each file in order, splits it into the aux and final-norm states, runs the teacher
check and casts them to ``extract.dtype`` exactly as a shard stores them. A file that exists
already is used without a request: states generation saved
(``generate.capture_hidden_states``), or a request in flight when an earlier run was killed.
Once trained on, a sample's file is deleted, unless the cache (``train.stream_cache_gib``)
still has room: then it stays, and later epochs read it instead of asking the engine again.
The server starts on the first sample that needs a request, so a run whose states are all
saved never starts one. Where the trainer computes on the server's devices, the CPU's cores or
the server's GPUs (``train.stream_overlap``, :func:`overlaps`), the two take turns: the
server computes a window's states while the trainer waits, then the trainer trains on them
with no request in flight. Where a thread packs micro-batches ahead of the steps
(``train.prefetch_batches``, the GPU default), a turn opens only once the steps have used
every batch packed and wait for the next.

Data-parallel (``train.gpus`` or, beside the server, one rank per server GPU): each rank feeds
its own share of every step's micro-batches through a feed of its own, with its share of the
requests in flight and of the cache. No two ranks write or delete one file: a rank's requests
go to ``requests/rank-NNN/``, its cache to ``requests/cache/`` (moved there whole, so any rank
may read it), and the files saved before the run stay until every rank has trained
(:meth:`StreamSamples.finish`). Rank 0 owns the one server: it starts it when it or another
rank first needs it (``requests/server.wanted``) and tells the others where it listens
(``requests/server.json``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path

import torch

from eaglet.core.config import stream_overlaps
from eaglet.core.io import read_jsonl, request_path
from eaglet.engine.capture import Extractor, capture_layer_ids, remove_request
from eaglet.model.sizes import default_window
from eaglet.stages.train.data import Samples, ShardInfo, TrainError
from eaglet.stages.train.feed_cache import StateFiles
from eaglet.stages.train.feed_check import TeacherCheck
from eaglet.stages.train.feed_loop import FeedLoop
from eaglet.stages.train.feed_requests import FeedRequests, SharedServer
from eaglet.target.checkpoint import load_head, read_target
from eaglet.target.states import (
    Target,
    TeacherHead,
    is_greedy,
    resolve_aux_layer_ids,
    sequence,
    shard_bounds,
    target_identity,
)

log = logging.getLogger("eaglet.stages.train.loop")

GIB = 1 << 30


def sequences(records: list[dict], max_len: int) -> list[tuple[list[int], list[int]]]:
    """Each sample's token ids and loss mask, cut at ``max_len`` (as extraction cuts them)."""
    return [sequence(r, max_len)[:2] for r in records]


def layout(
    records: list[dict],
    seqs: list[tuple[list[int], list[int]]],
    num_shards: int,
    hidden_size: int,
    aux_layer_ids: list[int],
    identity: dict,
    dtype: str,
) -> list[ShardInfo]:
    """The shards extraction would write for ``records`` (``seqs``: their :func:`sequences`),
    described without their states: each one's sample lengths and ids, and (as its
    ``sha256``) a hash of its token ids and loss masks, which a checkpoint's fingerprint
    holds as the shard's contents."""
    infos = []
    for index in range(num_shards):
        lo, hi = shard_bounds(len(records), num_shards, index)
        if lo == hi:
            raise TrainError(
                f"stream shard {index} of {num_shards} would hold no samples: "
                f"lower extract.num_shards to at most the number of samples"
            )
        block = seqs[lo:hi]
        digest = hashlib.sha256(json.dumps(block).encode()).hexdigest()
        infos.append(
            ShardInfo(
                f"stream_{index:05d}",
                [len(ids) for ids, _ in block],
                [r["id"] for r in records[lo:hi]],
                hidden_size,
                list(aux_layer_ids),
                identity,
                digest,
                dtype,
            )
        )
    return infos


class StateFeed(FeedLoop, FeedRequests):
    """The states of the training samples, from the capture server, in training order.

    :meth:`start` takes the order (global sample indices, repeats allowed); :meth:`take`
    returns the next sample as :meth:`eaglet.stages.train.data.Samples.get` does (uncut). Errors of
    the server or of a file are raised by :meth:`take`.

    Here is the trainer's side; the feed's thread walks the order (:class:`FeedLoop`) and
    sends the prefill requests (:class:`FeedRequests`); ``files`` finds, keeps and deletes
    the samples' files (:class:`StateFiles`), ``check`` is the teacher check
    (:class:`TeacherCheck`)."""

    def __init__(
        self,
        extractor: Extractor,
        records: list[dict],
        seqs: list[tuple[list[int], list[int]]],
        aux_layer_ids: list[int],
        head: TeacherHead,
        norm,
        dtype: str,
        concurrency: int,
        ahead: int | None,
        cache_bytes: int,
        timeout: float,
        max_retries: int,
        rank: int = 0,
        world: int = 1,
    ):
        self.extractor, self.records, self.norm = extractor, records, norm
        self.rank, self.world = rank, world
        self.aux_layer_ids, self.dtype = aux_layer_ids, dtype
        self.seqs = [ids for ids, _ in seqs]
        self.masks = [mask for _, mask in seqs]
        self.files = StateFiles(extractor.requests, records, self.seqs, cache_bytes, rank, world)
        self.check = TeacherCheck(head, records, dtype)
        # ahead: train.stream_ahead; None: sized when training starts (see window)
        self.concurrency, self.configured_ahead, self.ahead = concurrency, ahead, None
        self.timeout, self.max_retries = timeout, max_retries
        # False: the server computes only while the trainer waits for states, and the trainer
        # trains only once the server has nothing in flight (train.stream_overlap, overlaps)
        self.overlap = True
        self._held: deque = deque()  # a turn's states, in order
        # where samples are taken in a thread that packs ahead of the trainer's steps (the
        # prefetcher's): returns once the trainer waits, its steps done (None: samples are
        # taken by the trainer itself, which waits while it takes them)
        self.trainer_waits: Callable[[], None] | None = None
        self._taken = self._due = 0  # samples taken by the trainer, of the order's
        self.stats = Counter()  # requests, reused files, waits, teacher agreement counts
        self._ready: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None  # the event loop's (FeedLoop)

    def window(self, batch: int) -> int:
        """Samples requested or prepared ahead of the trainer: ``train.stream_ahead``, else
        a micro-batch of ``batch`` samples (the largest: the trainer takes a batch's samples
        at once, then computes) beside the ``concurrency`` requests in flight, so that the
        server works through the next batch while the trainer computes this one; at least
        twice the concurrency."""
        if self.configured_ahead:
            return max(1, self.configured_ahead)
        return default_window(self.concurrency, batch)

    def start(self, order: list[int], batch: int = 0) -> None:
        """Feed the samples of ``order``, the training loop's; ``batch``: the samples of
        its largest micro-batch (:meth:`window`)."""
        if self._thread is not None:
            raise RuntimeError("the state feed was started already")
        self.ahead = self.window(batch)
        self._due = len(order)
        self.check.expect(order, self.masks)
        log.info(
            "stream: up to %d samples requested or prepared ahead of the trainer (%s)",
            self.ahead,
            "train.stream_ahead"
            if self.configured_ahead
            else f"{self.concurrency} requests in flight beside a micro-batch of up to "
            f"{batch} samples, at least twice the concurrency",
        )
        if not self.overlap:
            log.info(
                "stream: the server and the trainer take turns (train.stream_overlap): "
                "the server computes a window's states while the trainer waits, then "
                "the trainer trains on them"
            )
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, args=(list(order), started), daemon=True, name="eaglet-stream"
        )
        self._thread.start()
        started.wait()

    def take(self, index: int) -> tuple:
        waited = time.perf_counter()
        if not self.overlap and not self._held:
            self._server_turn()
        got, item, error = self._held.popleft() if self._held else self._ready.get()
        self._taken += 1
        now = time.perf_counter()
        self.stats["trainer_wait_s"] += now - waited
        if self._starting is not None:  # the part of this wait that the server's start took
            began, ended = self._starting
            self.stats["trainer_wait_start_s"] += max(
                0.0, min(now, ended or now) - max(waited, began)
            )
        if error is not None:
            raise error
        if got != index:
            raise RuntimeError(
                f"the state feed prepared sample {got} where {index} was due: "
                f"its order differs from the training loop's"
            )
        with contextlib.suppress(RuntimeError):  # the feed has scheduled everything
            self._loop.call_soon_threadsafe(self._slots.release)
        return item

    def _server_turn(self) -> None:
        """Overlap off: let the server compute while the trainer waits for the whole window's
        states (or the order's rest), then stop it starting requests: none is left in flight
        once they are all prepared, as the window holds no more."""
        want = min(self.ahead, self._due - self._taken)
        if self.trainer_waits is not None:  # not while a step computes
            self.trainer_waits()
        self._turn_to(True)
        try:
            while len(self._held) < want:
                self._held.append(item := self._ready.get())
                if item[2] is not None:  # an error: raised by take
                    break
        finally:
            self._turn_to(False)

    def _turn_to(self, server: bool) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has ended: every state is in
            self._loop.call_soon_threadsafe(self._turn.set if server else self._turn.clear)

    def close(self) -> None:
        if self._loop is not None and self._main is not None:
            with contextlib.suppress(RuntimeError):  # the loop has ended already
                self._loop.call_soon_threadsafe(self._main.cancel)
        if self._thread is not None:
            self._thread.join(timeout=120)
        if isinstance(self.extractor.server, SharedServer):
            self.extractor.server.close()

    def summary(self) -> dict:
        """What the feed did: requests sent, files reused, the cache, who waited for whom."""
        agreed, positions = self.check.agreed
        server = self.extractor.server
        return {
            "samples": self.stats["samples"],
            "requests": self.stats["requests"],
            "window": self.ahead,
            "overlap": self.overlap,
            # saved before this run's requests: by generation, or by a run killed with
            # requests in flight
            "saved_files": len(self.files.saved),
            # the rest read a file this run had used before: kept by the cache, or still
            # on disk for a position in the window
            "reread_files": self.stats["samples"] - self.stats["requests"] - len(self.files.saved),
            "cache_files": len(self.files.cached),
            "cache_bytes": sum(self.files.cached.values()),
            "cache_budget_bytes": self.files.cache_bytes,
            "server_started": self.extractor.started,
            "server_start_s": server.ready_after_s if self.extractor.started else None,
            "trainer_wait_s": round(self.stats["trainer_wait_s"], 2),
            # of which while the server started (a start in a later epoch, with the
            # trainer busy on states already there, is not all waited for)
            "trainer_wait_start_s": round(self.stats["trainer_wait_start_s"], 2),
            "feed_wait_s": round(self.stats["feed_wait_s"], 2),
            "server_idle_s": round(self.stats["server_idle_s"], 2),
            "teacher_agreement": (agreed / positions) if positions else None,
            "teacher_positions": positions,
        }


def combine(ranks: list[tuple[dict, list[int]]]) -> dict:
    """The ranks' :meth:`StateFeed.summary` and :attr:`StateFiles.saved` as one summary:
    counts summed, a saved file counted once whichever ranks read it (it stays for every
    rank: :meth:`StreamSamples.finish`); the trainer's waits the longest rank's (every step
    waits for the slowest), the server's idle time and the feeds' waits the shortest rank's
    (a bound: the server idles only while no rank asks)."""
    summaries = [summary for summary, _ in ranks]
    out = dict(summaries[0])
    for key in (
        "samples",
        "requests",
        "window",
        "cache_files",
        "cache_bytes",
        "cache_budget_bytes",
        "teacher_positions",
    ):
        out[key] = sum(s[key] for s in summaries)
    out["saved_files"] = len(set().union(*(saved for _, saved in ranks)))
    out["reread_files"] = out["samples"] - out["requests"] - out["saved_files"]
    for key in ("trainer_wait_s", "trainer_wait_start_s"):
        out[key] = max(s[key] for s in summaries)
    for key in ("feed_wait_s", "server_idle_s"):
        out[key] = min(s[key] for s in summaries)
    agree = sum((s["teacher_agreement"] or 0.0) * s["teacher_positions"] for s in summaries)
    out["teacher_agreement"] = (
        agree / out["teacher_positions"] if out["teacher_positions"] else None
    )
    out["server_started"] = any(s["server_started"] for s in summaries)
    out["ranks"] = len(summaries)
    return out


class StreamSamples(Samples):
    """The training samples of stream mode: the layout of shards (so that epochs are planned
    as in shard mode), the states from a :class:`StateFeed`, read once each in the order the
    feed was started with. ``dist``: the training's ranks
    (:class:`eaglet.stages.train.loop.Dist`)."""

    def __init__(
        self, infos: list[ShardInfo], feed: StateFeed, stack: contextlib.ExitStack, dist=None
    ):
        super().__init__(infos)
        self.feed, self.stack, self.dist = feed, stack, dist

    def preload(self) -> None:
        pass

    def taken_ahead(self, trainer_waits: Callable[[], None]) -> None:
        """Samples are taken by a thread packing micro-batches ahead of the steps (the
        prefetcher): where the server and the trainer take turns, a turn opens only once
        ``trainer_waits`` returns."""
        self.feed.trainer_waits = trainer_waits

    def start(self, order: list[int], progress=None, batch: int = 0) -> None:
        """Feed the samples of ``order`` (this rank's); ``progress`` (the training's) shows
        the server's start as its phase; ``batch``: the samples of the largest micro-batch."""
        if self.feed.world > 1:  # a killed run's handshake must not be taken for this one's
            if not self.feed.rank:
                self.feed.clear_handshake()
            self.dist.barrier()
        self.feed.extractor.progress = progress
        self.feed.start(order, batch)

    def get(self, index: int, max_len: int) -> tuple:
        sid, ids, mask, argmax, aux, final, aux_scale, final_scale = self.feed.take(index)
        rows = slice(0, max_len)
        scales = (aux_scale[rows], final_scale[rows]) if aux_scale is not None else (None, None)
        return sid, ids[rows], mask[rows], argmax[rows], aux[rows], final[rows], *scales

    def summary(self) -> dict:
        """What the feeds of every rank did, as one (:func:`combine`); call on every rank."""
        mine = self.feed.summary()
        if self.feed.world == 1:
            return mine
        every: list = [None] * self.feed.world
        self.dist.all_gather(every, (mine, sorted(self.feed.files.saved)))
        return combine(every)

    def finish(self) -> None:
        """Training has ended: delete every file the feeds kept (call on every rank); of
        several ranks, rank 0 deletes once all have trained the files saved before the run,
        the cache's and what a killed run left in a rank's directory (also where a single
        process resumes a data-parallel run)."""
        self.feed.files.clear()
        root = self.feed.extractor.requests
        if self.feed.world > 1:
            self.dist.barrier()
            if self.feed.rank:
                return
            for record in self.feed.records:
                remove_request(request_path(root, record["id"]))
        # the ranks' directories (of a data-parallel run, or one killed before this run)
        for directory in [root / "cache", *root.glob("rank-*")]:
            for path in directory.glob("*.safetensors"):
                remove_request(path)
            with contextlib.suppress(OSError):  # not empty: not ours to remove
                directory.rmdir()

    def close(self) -> None:
        self.feed.close()
        self.stack.close()  # stops the server if the feed started one
        if self.feed.world > 1 and not self.feed.rank:
            self.feed.clear_handshake()


def overlaps(setting, server_gpus: int, train_gpus: int, train_device: str) -> bool:
    """:func:`eaglet.core.config.stream_overlaps` for a trainer on ``train_device``. Why auto takes
    turns where the two share devices: on 2 cores, with a cache, the two at once took 1.13x
    shard mode's time and turns 1.05x (benchmarks/results/stream_train.md): each waits for
    compute the other holds, and the server's tensor-parallel steps and the ranks' gradient
    reductions wait for their slowest member, which a device shared in time slices makes
    slow. Devices of its own (or a GPU that either leaves idle) are what the overlap is for."""
    on_cpu = train_device == "cpu" or (train_device == "auto" and not torch.cuda.is_available())
    return stream_overlaps(setting, server_gpus, train_gpus, on_cpu)


def stream_devices(server_gpus: int, train_gpus: int) -> str | None:
    """Split the job's GPUs (``CUDA_VISIBLE_DEVICES``, as :func:`eaglet.core.gpus.hold_gpus` set
    it) between the capture server and the trainer: the server takes the first
    ``server_gpus``, the trainer's ranks the next ``train_gpus`` (0: the server's own, one
    rank on each). Sets the trainer's list in this process's environment and returns the
    server's (None where no list is set, or the server takes no GPU)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible or not server_gpus:
        return None
    ids = [d for d in visible.split(",") if d.strip()]
    if len(ids) < server_gpus + train_gpus:
        raise TrainError(
            f"the streaming job holds the GPUs {visible} but needs "
            f"{server_gpus + train_gpus}: server.gpus {server_gpus} and "
            f"train.gpus {train_gpus}"
        )
    server = ids[:server_gpus]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(
        ids[server_gpus : server_gpus + train_gpus] if train_gpus else server
    )
    return ",".join(server)


def open_stream(
    stream: dict, train_cfg: dict, rank: int = 0, world: int = 1, dist=None
) -> StreamSamples:
    """The stream-mode training samples of a run: ``stream`` holds the run's ``cfg`` (its
    extract, target, server and generate sections), ``target_json``, the training split's
    ``data`` file, the ``work_dir`` whose ``requests/`` the capture server writes to (the
    ``vllm`` extraction's, where generation with capture saves too), the ``server_log`` and
    (optional) ``server_devices``, the server's ``CUDA_VISIBLE_DEVICES``
    (:func:`stream_devices`); ``train.stream_kv_cache_gib`` sizes this server's KV cache.
    Of ``world`` ranks, this one (``rank``) feeds its own share; ``dist``
    (:class:`eaglet.stages.train.loop.Dist`) lets the ranks' feeds meet."""
    cfg = stream["cfg"]
    if train_cfg.get("stream_kv_cache_gib") is not None:  # this job's server alone
        cfg = {**cfg, "server": {**cfg["server"], "kv_cache_gib": train_cfg["stream_kv_cache_gib"]}}
    if stream.get("server_devices"):
        server = cfg["server"]
        cfg = {
            **cfg,
            "server": {
                **server,
                "env": {
                    **(server.get("env") or {}),
                    "CUDA_VISIBLE_DEVICES": stream["server_devices"],
                },
            },
        }
    ext = cfg["extract"]
    info = read_target(stream["target_json"])
    records = read_jsonl(stream["data"])
    if not records:
        raise TrainError(
            f"{stream['data']} holds no training samples: the generate stage produced none"
        )
    head = load_head(info["path"], cfg["target"]["dtype"])
    target, norm = Target.from_head(head, ext["device"]), head.norm
    aux_ids = resolve_aux_layer_ids(ext["aux_layer_ids"], target.num_layers)
    seqs = sequences(records, ext["max_len"])
    infos = layout(
        records,
        seqs,
        ext["num_shards"],
        target.hidden_size,
        aux_ids,
        target_identity(info),
        ext["dtype"],
    )
    extractor = Extractor(
        cfg,
        info["path"],
        capture_layer_ids(aux_ids, target.num_layers),
        Path(stream["work_dir"]),
        stream["server_log"],
        None,
    )
    extractor.norm = norm
    stack = contextlib.ExitStack()
    extractor.stack = stack
    # the ranks share the server's extract.concurrency, the window and the cache's budget
    feed = StateFeed(
        extractor,
        records,
        seqs,
        aux_ids,
        TeacherHead(target.lm_head),
        norm,
        ext["dtype"],
        -(-ext["concurrency"] // world),
        -(-train_cfg["stream_ahead"] // world) if train_cfg["stream_ahead"] else None,
        int(train_cfg["stream_cache_gib"] * GIB) // world,
        cfg["generate"]["request_timeout_s"],
        cfg["generate"]["max_retries"],
        rank,
        world,
    )
    if is_greedy(records):  # the target's own greedy answers: the teacher must reproduce them
        feed.check.min_agreement = ext["min_teacher_agreement"]
    feed.overlap = overlaps(
        train_cfg.get("stream_overlap", "auto"),
        cfg["server"]["gpus"],
        cfg["train"]["gpus"],
        train_cfg.get("device", "auto"),
    )
    return StreamSamples(infos, feed, stack, dist)
