"""``train.data: stream``: the training samples' hidden states computed by the serving engine
while the drafter trains, none stored as shards.

The samples keep the layout the shards would have had (``extract.num_shards`` contiguous
blocks of the training split, each sample cut at ``extract.max_len``), so an epoch's
micro-batches are those of shard mode (:func:`eaglet.train_data.plan_epoch`), and a
stream-trained drafter is the shard-trained one up to the engine's float rounding.

:class:`StateFeed` walks the samples in the order training will read them (every remaining
epoch, from the data position a resumed run starts at) and keeps ``ahead`` of them requested
or prepared ahead of the trainer (:meth:`StateFeed.window`): each one a prefill request to
the capture server of the ``vllm`` extraction backend (:mod:`eaglet.extract_vllm`), whose
connector saves the states to ``<work>/requests/<sample>.safetensors``; a packing thread
reads each file in order, splits it into the aux and final-norm states, runs the teacher
check and casts them to ``extract.dtype`` exactly as a shard stores them. A file that exists
already is used without a request: states generation saved
(``generate.capture_hidden_states``), or a request in flight when an earlier run was killed.
Once trained on, a sample's file is deleted, unless the cache (``train.stream_cache_gib``)
still has room: then it stays, and later epochs read it instead of asking the engine again.
The server starts on the first sample that needs a request, so a run whose states are all
saved never starts one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import queue
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from eaglet import shards as shard_format
from eaglet.engine_client import gather_or_cancel
from eaglet.extract_common import (TeacherHead, answer_rows, recorded_answer,
                                   resolve_aux_layer_ids, sequence, shard_bounds,
                                   target_identity)
from eaglet.extract_vllm import (Extractor, holds_states, load_head, prefill, read_request,
                                 remove_request, split_states)
from eaglet.hidden_capture import capture_layer_ids
from eaglet.io import read_json, read_jsonl, request_path
from eaglet.train_data import Samples, ShardInfo, TrainError

log = logging.getLogger("eaglet.train")

GIB = 1 << 30


def sequences(records: list[dict], max_len: int) -> list[tuple[list[int], list[int]]]:
    """Each sample's token ids and loss mask, cut at ``max_len`` (as extraction cuts them)."""
    return [sequence(r, max_len)[:2] for r in records]


def layout(records: list[dict], seqs: list[tuple[list[int], list[int]]], num_shards: int,
           hidden_size: int, aux_layer_ids: list[int], identity: dict,
           dtype: str) -> list[ShardInfo]:
    """The shards extraction would write for ``records`` (``seqs``: their :func:`sequences`),
    described without their states: each one's sample lengths and ids, and (as its
    ``sha256``) a hash of its token ids and loss masks, which a checkpoint's fingerprint
    holds as the shard's contents."""
    infos = []
    for index in range(num_shards):
        lo, hi = shard_bounds(len(records), num_shards, index)
        if lo == hi:
            raise TrainError(f"stream shard {index} of {num_shards} would hold no samples: "
                             f"lower extract.num_shards to at most the number of samples")
        block = seqs[lo:hi]
        digest = hashlib.sha256(json.dumps(block).encode()).hexdigest()
        infos.append(ShardInfo(f"stream_{index:05d}", [len(ids) for ids, _ in block],
                               [r["id"] for r in records[lo:hi]], hidden_size,
                               list(aux_layer_ids), identity, digest, dtype))
    return infos


def stored(x: torch.Tensor, dtype: str, groups: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` as a shard stores it: cast, or quantized to fp8 with its per-row scales."""
    if dtype == "fp8":
        return shard_format.quantize_fp8(x.float(), groups)
    return x.to(shard_format.STORAGE_DTYPES[dtype]), None


class StateFeed:
    """The states of the training samples, from the capture server, in training order.

    :meth:`start` takes the order (global sample indices, repeats allowed); :meth:`take`
    returns the next sample as :meth:`eaglet.train_data.Samples.get` does (uncut). Errors of
    the server or of a file are raised by :meth:`take`."""

    def __init__(self, extractor: Extractor, records: list[dict],
                 seqs: list[tuple[list[int], list[int]]], aux_layer_ids: list[int],
                 head: TeacherHead, norm, dtype: str, concurrency: int, ahead: int | None,
                 cache_bytes: int, timeout: float, max_retries: int):
        self.extractor, self.records, self.head, self.norm = extractor, records, head, norm
        self.aux_layer_ids, self.dtype = aux_layer_ids, dtype
        self.seqs = [ids for ids, _ in seqs]
        self.masks = [mask for _, mask in seqs]
        # ahead: train.stream_ahead; None: sized when training starts (see window)
        self.concurrency, self.configured_ahead, self.ahead = concurrency, ahead, None
        self.cache_bytes, self.timeout, self.max_retries = cache_bytes, timeout, max_retries
        self.cached: dict[int, int] = {}  # sample -> bytes of its file kept for later epochs
        self.stats = Counter()  # requests, reused files, waits, teacher agreement counts
        self._ready: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Task | None = None
        self._slots: asyncio.Semaphore | None = None
        self._client: httpx.AsyncClient | None = None
        self._in_flight, self._idle_since = 0, None
        self._starting: tuple[float, float | None] | None = None  # the server's start: from, to

    def path(self, index: int) -> Path:
        return request_path(self.extractor.requests, self.records[index]["id"])

    # -- the trainer's side --

    def window(self, batch: int) -> int:
        """Samples requested or prepared ahead of the trainer: ``train.stream_ahead``, else
        a micro-batch of ``batch`` samples (the largest: the trainer takes a batch's samples
        at once, then computes) beside the ``concurrency`` requests in flight, so that the
        server works through the next batch while the trainer computes this one; at least
        twice the concurrency."""
        if self.configured_ahead:
            return max(1, self.configured_ahead)
        return max(2 * self.concurrency, self.concurrency + batch)

    def start(self, order: list[int], batch: int = 0) -> None:
        """Feed the samples of ``order``, the training loop's; ``batch``: the samples of
        its largest micro-batch (:meth:`window`)."""
        if self._thread is not None:
            raise RuntimeError("the state feed was started already")
        self.ahead = self.window(batch)
        log.info("stream: up to %d samples requested or prepared ahead of the trainer (%s)",
                 self.ahead, "train.stream_ahead" if self.configured_ahead else
                 f"{self.concurrency} requests in flight beside a micro-batch of up to "
                 f"{batch} samples, at least twice the concurrency")
        started = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(list(order), started),
                                        daemon=True, name="eaglet-stream")
        self._thread.start()
        started.wait()

    def take(self, index: int) -> tuple:
        waited = time.perf_counter()
        got, item, error = self._ready.get()
        now = time.perf_counter()
        self.stats["trainer_wait_s"] += now - waited
        if self._starting is not None:  # the part of this wait that the server's start took
            began, ended = self._starting
            self.stats["trainer_wait_start_s"] += max(
                0.0, min(now, ended or now) - max(waited, began))
        if error is not None:
            raise error
        if got != index:
            raise RuntimeError(f"the state feed prepared sample {got} where {index} was due: "
                               f"its order differs from the training loop's")
        with contextlib.suppress(RuntimeError):  # the feed has scheduled everything
            self._loop.call_soon_threadsafe(self._slots.release)
        return item

    def close(self) -> None:
        if self._loop is not None and self._main is not None:
            with contextlib.suppress(RuntimeError):  # the loop has ended already
                self._loop.call_soon_threadsafe(self._main.cancel)
        if self._thread is not None:
            self._thread.join(timeout=120)

    def summary(self) -> dict:
        """What the feed did: requests sent, files reused, the cache, who waited for whom."""
        positions = self.stats["agree_positions"]
        server = self.extractor.server
        return {"samples": self.stats["samples"], "requests": self.stats["requests"],
                "window": self.ahead,
                # saved before this run's requests: by generation, or by a run killed with
                # requests in flight
                "saved_files": self.stats["reused"],
                # the rest read a file this run had used before: kept by the cache, or still
                # on disk for a position in the window
                "reread_files": self.stats["samples"] - self.stats["requests"]
                - self.stats["reused"],
                "cache_files": len(self.cached), "cache_bytes": sum(self.cached.values()),
                "cache_budget_bytes": self.cache_bytes,
                "server_started": self.extractor.started,
                "server_start_s": server.ready_after_s if self.extractor.started else None,
                "trainer_wait_s": round(self.stats["trainer_wait_s"], 2),
                # of which while the server started (a start in a later epoch, with the
                # trainer busy on states already there, is not all waited for)
                "trainer_wait_start_s": round(self.stats["trainer_wait_start_s"], 2),
                "feed_wait_s": round(self.stats["feed_wait_s"], 2),
                "server_idle_s": round(self.stats["server_idle_s"], 2),
                "teacher_agreement": (self.stats["agree"] / positions) if positions else None,
                "teacher_positions": positions}

    def clear_cache(self) -> None:
        """Delete the files kept for later epochs (training has ended)."""
        for i in list(self.cached):
            remove_request(self.path(i))
            del self.cached[i]

    # -- the feed's thread --

    def _serve(self, order: list[int], started: threading.Event) -> None:
        try:
            asyncio.run(self._run(order, started))
        except asyncio.CancelledError:
            pass
        except BaseException as exc:  # handed to the trainer, raised by take()
            self._ready.put((None, None, exc))
        finally:
            started.set()

    async def _run(self, order: list[int], started: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._main = asyncio.current_task()
        self._slots = asyncio.Semaphore(self.ahead)
        started.set()
        self._gate = asyncio.Semaphore(self.concurrency)
        self._server_lock = asyncio.Lock()
        files: dict[int, asyncio.Task] = {}  # sample -> the task that makes its file
        refs: Counter = Counter()            # sample -> scheduled positions not yet prepared
        due: asyncio.Queue = asyncio.Queue()

        async def obtain(i: int) -> None:
            path = self.path(i)
            if await asyncio.to_thread(holds_states, path, self.seqs[i]):
                if i not in self.cached:  # not a file this run made or read before
                    self.stats["reused"] += 1
                return
            await self._request(i, path)
            self.stats["requests"] += 1

        async def schedule() -> None:
            for i in order:
                waited = time.perf_counter()
                await self._slots.acquire()
                self.stats["feed_wait_s"] += time.perf_counter() - waited
                refs[i] += 1
                if i not in files:
                    files[i] = asyncio.ensure_future(obtain(i))
                await due.put((i, files[i]))
            await due.put(None)

        async def pack() -> None:
            loop = asyncio.get_running_loop()
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="stream-packer") as thread:
                while (item := await due.get()) is not None:
                    i, made = item
                    await made
                    prepared = await loop.run_in_executor(thread, self._prepare, i)
                    self._ready.put((i, prepared, None))
                    refs[i] -= 1
                    if not refs[i]:  # no scheduled position reads this file again
                        del files[i]
                        self._release(i)

        try:
            await gather_or_cancel([schedule(), pack()])
        finally:
            for task in files.values():
                task.cancel()
            await asyncio.gather(*files.values(), return_exceptions=True)
            if self._client is not None:
                await self._client.aclose()

    async def _request(self, i: int, path: Path) -> None:
        """Sample ``i``'s prefill request, its states saved to ``path``; the server is started
        (and the client made) by the first request."""
        async with self._server_lock:
            if self._client is None:
                self._starting = (time.perf_counter(), None)
                try:
                    await asyncio.to_thread(self.extractor.ensure_server)
                finally:
                    self._starting = (self._starting[0], time.perf_counter())
                if self.extractor.progress is not None:  # started: training again
                    self.extractor.progress.enter_phase(None)
                self._client = httpx.AsyncClient(
                    base_url=self.extractor.server.url,
                    limits=httpx.Limits(max_connections=self.concurrency))
                self._idle_since = time.monotonic()
        async with self._gate:
            self.extractor.server.check_alive()
            self._busy(+1)
            try:
                await prefill(self._client, self.seqs[i], path, self.timeout,
                              self.max_retries, self.extractor.server.check_alive)
            finally:
                self._busy(-1)

    def _busy(self, change: int) -> None:
        """Count the requests in flight; the time the started server had none is its idle
        time (``server_idle_s``: it waited for the trainer, or for the packing)."""
        now = time.monotonic()
        if change > 0 and not self._in_flight and self._idle_since is not None:
            self.stats["server_idle_s"] += now - self._idle_since
        self._in_flight += change
        if not self._in_flight:
            self._idle_since = now

    def _release(self, i: int) -> None:
        """A sample's file after its last scheduled use: kept while the cache has room."""
        path = self.path(i)
        if i in self.cached:
            return
        size = path.stat().st_size if path.exists() else 0
        if size and sum(self.cached.values()) + size <= self.cache_bytes:
            self.cached[i] = size
            return
        remove_request(path)

    def _prepare(self, i: int) -> tuple:
        """Sample ``i`` as a shard would hold it: token ids, loss mask, the teacher's argmax
        (-1 except where it predicts an answer token), aux and final states in the stored
        dtype (and their fp8 scales)."""
        ids, mask = self.seqs[i], self.masks[i]
        states = read_request(self.path(i), ids)
        if states is None:
            raise TrainError(f"the server saved no states of {len(ids)} tokens to "
                             f"{self.path(i)}: see the server log {self.extractor.server.log_path}")
        aux, final = split_states(states, self.extractor.layer_ids, self.aux_layer_ids, self.norm)
        del states
        input_ids = torch.tensor(ids, dtype=torch.int64)
        loss_mask = torch.tensor(mask, dtype=torch.uint8)
        argmax = torch.full((len(ids),), -1, dtype=torch.int64)
        rows, checked, nxt = answer_rows(final, ids, mask, self.dtype)
        if rows.numel():
            argmax[rows], _ = self.head(checked, nxt)
            if not recorded_answer(self.records[i]):  # the target's own answers only
                self.stats["agree"] += int((argmax[rows] == nxt).sum())
                self.stats["agree_positions"] += rows.numel()
        aux_stored, aux_scale = stored(aux, self.dtype, len(self.aux_layer_ids))
        final_stored, final_scale = stored(final, self.dtype, 1)
        self.stats["samples"] += 1
        return (self.records[i]["id"], input_ids, loss_mask, argmax, aux_stored, final_stored,
                aux_scale, final_scale)


class StreamSamples(Samples):
    """The training samples of stream mode: the layout of shards (so that epochs are planned
    as in shard mode), the states from a :class:`StateFeed`, read once each in the order the
    feed was started with."""

    def __init__(self, infos: list[ShardInfo], feed: StateFeed, stack: contextlib.ExitStack):
        super().__init__(infos)
        self.feed, self.stack = feed, stack

    def preload(self) -> None:
        pass

    def start(self, order: list[int], progress=None, batch: int = 0) -> None:
        """Feed the samples of ``order``; ``progress`` (the training's) shows the server's
        start as its phase; ``batch``: the samples of the largest micro-batch."""
        self.feed.extractor.progress = progress
        self.feed.start(order, batch)

    def get(self, index: int, max_len: int) -> tuple:
        sid, ids, mask, argmax, aux, final, aux_scale, final_scale = self.feed.take(index)
        rows = slice(0, max_len)
        scales = (aux_scale[rows], final_scale[rows]) if aux_scale is not None else (None, None)
        return sid, ids[rows], mask[rows], argmax[rows], aux[rows], final[rows], *scales

    def close(self) -> None:
        self.feed.close()
        self.stack.close()  # stops the server if the feed started one


def open_stream(stream: dict, train_cfg: dict) -> StreamSamples:
    """The stream-mode training samples of a run: ``stream`` holds the run's ``cfg`` (its
    extract, target, server and generate sections), ``target_json``, the training split's
    ``data`` file, the ``work_dir`` whose ``requests/`` the capture server writes to (the
    ``vllm`` extraction's, where generation with capture saves too) and the ``server_log``."""
    cfg = stream["cfg"]
    ext = cfg["extract"]
    info = read_json(stream["target_json"])
    records = read_jsonl(stream["data"])
    if not records:
        raise TrainError(f"{stream['data']} holds no training samples: the generate stage "
                         f"produced none")
    target, norm = load_head(info["path"], cfg["target"]["dtype"], ext["device"])
    aux_ids = resolve_aux_layer_ids(ext["aux_layer_ids"], target.num_layers)
    seqs = sequences(records, ext["max_len"])
    infos = layout(records, seqs, ext["num_shards"], target.hidden_size, aux_ids,
                   target_identity(info), ext["dtype"])
    extractor = Extractor(cfg, info["path"], capture_layer_ids(aux_ids, target.num_layers),
                          Path(stream["work_dir"]), stream["server_log"], None)
    extractor.norm = norm
    stack = contextlib.ExitStack()
    extractor.stack = stack
    feed = StateFeed(extractor, records, seqs, aux_ids, TeacherHead(target.lm_head),
                     norm, ext["dtype"], ext["concurrency"], train_cfg["stream_ahead"],
                     int(train_cfg["stream_cache_gib"] * GIB),
                     cfg["generate"]["request_timeout_s"], cfg["generate"]["max_retries"])
    return StreamSamples(infos, feed, stack)

