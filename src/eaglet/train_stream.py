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

import asyncio
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from eaglet import shards as shard_format
from eaglet.config import stream_overlaps
from eaglet.engine_client import gather_or_cancel
from eaglet.extract_common import (TeacherHead, answer_rows, enforce_agreement, is_greedy,
                                   recorded_answer, resolve_aux_layer_ids, sequence,
                                   shard_bounds, target_identity)
from eaglet.extract_vllm import (Extractor, holds_states, load_head, prefill, read_request,
                                 remove_request, split_states)
from eaglet.hidden_capture import capture_layer_ids
from eaglet.io import atomic_open, read_json, read_jsonl, request_path
from eaglet.server import ServerError, VLLMServer
from eaglet.train_data import Samples, ShardInfo, TrainError

log = logging.getLogger("eaglet.train")

GIB = 1 << 30
# answer positions between two checks of the streamed teacher agreement (greedy data), as
# extraction checks each shard's: a wrong capture stops training early, not after an epoch
AGREEMENT_EVERY = 2048


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


def default_window(concurrency: float, batch: float) -> float:
    """A feed's default window (:meth:`StateFeed.window`) in any unit, samples or tokens:
    the ``concurrency`` requests in flight beside the trainer's largest micro-batch
    (``batch``), at least twice the requests. :func:`eaglet.plan.stream_window_tokens`
    counts it in tokens."""
    return concurrency + max(concurrency, batch)


class StateFeed:
    """The states of the training samples, from the capture server, in training order.

    :meth:`start` takes the order (global sample indices, repeats allowed); :meth:`take`
    returns the next sample as :meth:`eaglet.train_data.Samples.get` does (uncut). Errors of
    the server or of a file are raised by :meth:`take`."""

    def __init__(self, extractor: Extractor, records: list[dict],
                 seqs: list[tuple[list[int], list[int]]], aux_layer_ids: list[int],
                 head: TeacherHead, norm, dtype: str, concurrency: int, ahead: int | None,
                 cache_bytes: int, timeout: float, max_retries: int, rank: int = 0,
                 world: int = 1):
        self.extractor, self.records, self.head, self.norm = extractor, records, head, norm
        self.rank, self.world = rank, world
        root = extractor.requests
        # where this rank's requests save their states, and where files kept for later
        # epochs lie (one directory for a single process, as generation saves them)
        self.own = root if world == 1 else root / f"rank-{rank:03d}"
        self.keep = root if world == 1 else root / "cache"
        for directory in (self.own, self.keep):
            directory.mkdir(parents=True, exist_ok=True)
        self.at: dict[int, Path] = {}  # sample -> the file its states are read from
        # samples read from a file saved before this run's requests (by generation, or by a
        # run killed with requests in flight)
        self.saved: set[int] = set()
        # extract.min_teacher_agreement where the target answered greedily (None: sampled
        # answers, whose argmax the sample need not be); each sample's first check, by sample
        self.min_agreement: float | None = None
        self.agreement: dict[int, tuple[int, int]] = {}
        # each sample's teacher argmax, computed at its first epoch and reused after it, as
        # shard mode computes it once at extraction (int32: 4 bytes a token, beside the
        # states' thousands)
        self.teacher: dict[int, torch.Tensor] = {}
        self._agreed = [0, 0]  # their sums: agreements, positions
        self._next_check, self._checked_at_end = AGREEMENT_EVERY, 0
        self.aux_layer_ids, self.dtype = aux_layer_ids, dtype
        self.seqs = [ids for ids, _ in seqs]
        self.masks = [mask for _, mask in seqs]
        # ahead: train.stream_ahead; None: sized when training starts (see window)
        self.concurrency, self.configured_ahead, self.ahead = concurrency, ahead, None
        self.cache_bytes, self.timeout, self.max_retries = cache_bytes, timeout, max_retries
        # False: the server computes only while the trainer waits for states, and the trainer
        # trains only once the server has nothing in flight (train.stream_overlap, overlaps)
        self.overlap = True
        self._held: deque = deque()  # a turn's states, in order
        # where samples are taken in a thread that packs ahead of the trainer's steps (the
        # prefetcher's): returns once the trainer waits, its steps done (None: samples are
        # taken by the trainer itself, which waits while it takes them)
        self.trainer_waits: Callable[[], None] | None = None
        self._taken = self._due = 0  # samples taken by the trainer, of the order's
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
        """The file sample ``index`` is read from: where it was found or requested to."""
        return self.at.get(index) or request_path(self.own, self.records[index]["id"])

    def find(self, index: int) -> Path | None:
        """A file already holding sample ``index``'s states: this rank's own (a request of
        a killed run), the cache's, or one saved before the run (generation with capture)."""
        sid = self.records[index]["id"]
        places = dict.fromkeys((self.own, self.keep, self.extractor.requests))
        return next((path for path in (request_path(d, sid) for d in places)
                     if holds_states(path, self.seqs[index])), None)

    # -- the trainer's side --

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
        # the samples whose agreement is checked (the target's own answers): all of them in,
        # the last check
        self._checked_at_end = sum(1 for i in set(order) if not recorded_answer(self.records[i])
                                   and any(self.masks[i][1:]))
        log.info("stream: up to %d samples requested or prepared ahead of the trainer (%s)",
                 self.ahead, "train.stream_ahead" if self.configured_ahead else
                 f"{self.concurrency} requests in flight beside a micro-batch of up to "
                 f"{batch} samples, at least twice the concurrency")
        if not self.overlap:
            log.info("stream: the server and the trainer take turns (train.stream_overlap): "
                     "the server computes a window's states while the trainer waits, then "
                     "the trainer trains on them")
        started = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(list(order), started),
                                        daemon=True, name="eaglet-stream")
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
                0.0, min(now, ended or now) - max(waited, began))
        if error is not None:
            raise error
        if got != index:
            raise RuntimeError(f"the state feed prepared sample {got} where {index} was due: "
                               f"its order differs from the training loop's")
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
        positions = self._agreed[1]
        server = self.extractor.server
        return {"samples": self.stats["samples"], "requests": self.stats["requests"],
                "window": self.ahead, "overlap": self.overlap,
                # saved before this run's requests: by generation, or by a run killed with
                # requests in flight
                "saved_files": len(self.saved),
                # the rest read a file this run had used before: kept by the cache, or still
                # on disk for a position in the window
                "reread_files": self.stats["samples"] - self.stats["requests"]
                - len(self.saved),
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
                "teacher_agreement": (self._agreed[0] / positions) if positions else None,
                "teacher_positions": positions}

    def clear_cache(self) -> None:
        """Delete the files kept for later epochs (training has ended)."""
        for i in list(self.cached):
            remove_request(request_path(self.keep, self.records[i]["id"]))
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
        self._turn = asyncio.Event()  # requests may start (always, where the two overlap)
        if self.overlap:
            self._turn.set()
        started.set()
        self._gate = asyncio.Semaphore(self.concurrency)
        self._server_lock = asyncio.Lock()
        files: dict[int, asyncio.Task] = {}  # sample -> the task that makes its file
        refs: Counter = Counter()            # sample -> scheduled positions not yet prepared
        due: asyncio.Queue = asyncio.Queue()

        async def obtain(i: int) -> None:
            found = await asyncio.to_thread(self.find, i)
            if found is not None:
                self.at[i] = found
                # not a file this run made or read before (nor another rank's cache)
                if i not in self.cached and (self.world == 1 or found.parent != self.keep):
                    self.saved.add(i)
                return
            self.at[i] = path = request_path(self.own, self.records[i]["id"])
            await self._turn.wait()  # the server's turn (always, where the two overlap)
            await self._request(i, path)
            self.stats["requests"] += 1

        async def watch() -> None:  # rank 0 of several: start the server another rank wants
            while self._client is None:
                if self._wanted().exists():
                    async with self._server_lock:
                        if self._client is None:
                            await self._connect()
                    return
                await asyncio.sleep(0.5)

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
            await gather_or_cancel([schedule(), pack()]
                                   + ([watch()] if self.world > 1 and not self.rank else []))
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
                await self._connect()
        await self._prefill(i, path)

    async def _connect(self) -> None:
        """Start the server (rank 0), or wait for rank 0's (:meth:`_shared_server`); then
        make the client."""
        self._starting = (time.perf_counter(), None)
        try:
            if self.rank:
                self.extractor.server = await self._shared_server()
            else:
                try:
                    await asyncio.to_thread(self.extractor.ensure_server)
                except BaseException as exc:
                    if self.world > 1:  # the other ranks stop waiting, with the reason
                        self._announce({"error": str(exc) or type(exc).__name__})
                    raise
                if self.world > 1:
                    self._announce({"url": self.extractor.server.url})
        finally:
            self._starting = (self._starting[0], time.perf_counter())
        if self.extractor.progress is not None:  # started: training again
            self.extractor.progress.enter_phase(None)
        self._client = httpx.AsyncClient(
            base_url=self.extractor.server.url,
            limits=httpx.Limits(max_connections=self.concurrency))
        self._idle_since = time.monotonic()

    def _wanted(self) -> Path:
        return self.extractor.requests / "server.wanted"

    def clear_handshake(self) -> None:
        """Remove ``server.wanted`` and ``server.json`` (rank 0: before the ranks start, and
        once its server has stopped)."""
        for path in (self._wanted(), self._announcement()):
            path.unlink(missing_ok=True)

    def _announcement(self) -> Path:
        return self.extractor.requests / "server.json"

    def _announce(self, what: dict) -> None:
        with atomic_open(self._announcement(), "w") as handle:
            json.dump(what, handle)

    async def _shared_server(self) -> "SharedServer":
        """Rank 0's server, once it is ready: asked for through ``server.wanted``, found
        through ``server.json``."""
        self._wanted().touch()
        server = self.extractor.server
        patience = getattr(server, "startup_timeout_s", 900.0) + 120.0
        deadline = time.monotonic() + patience
        while not self._announcement().exists():
            if time.monotonic() > deadline:
                raise TrainError(f"rank {self.rank} waited {patience:.0f} s for rank 0 to start "
                                 f"the capture server ({self._announcement()} never appeared): "
                                 f"see rank 0's log and the server log {server.log_path}")
            await asyncio.sleep(0.5)
        told = read_json(self._announcement())
        if "error" in told:
            raise TrainError(f"rank 0 could not start the capture server: {told['error']}")
        return SharedServer(told["url"], server.log_path)

    async def _prefill(self, i: int, path: Path) -> None:
        """The prefill request itself, one of ``concurrency`` in flight."""
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

    def _check_agreement(self) -> None:
        """Greedy data: the samples' teacher agreement so far against
        ``extract.min_teacher_agreement``, every AGREEMENT_EVERY answer positions and once every
        sample is in, as extraction checks each shard (:func:`enforce_agreement`'s error)."""
        agreed, positions = self._agreed
        if self.min_agreement is None or not positions:
            return
        if positions < self._next_check and len(self.agreement) < self._checked_at_end:
            return
        self._next_check = positions + AGREEMENT_EVERY
        if agreed / positions >= self.min_agreement:
            return
        per_sample = [{"id": self.records[i]["id"], "agreement": a / n, "positions": n}
                      for i, (a, n) in self.agreement.items()]
        enforce_agreement({"greedy": True, "backend": "vllm",
                           "file": f"the {len(per_sample)} samples streamed so far",
                           "teacher": {"agreement": agreed / positions,
                                       "worst": sorted(per_sample,
                                                       key=lambda r: r["agreement"])[:3]}},
                          self.min_agreement)

    def _release(self, i: int) -> None:
        """A sample's file after its last scheduled use: kept while the cache has room.
        Of several ranks, each deletes only the files it requested; the others' cache and
        the files saved before the run stay for any rank to read, until :meth:`finish`."""
        path = self.path(i)
        self.at.pop(i, None)
        if i in self.cached or (self.world > 1 and path.parent != self.own):
            return
        size = path.stat().st_size if path.exists() else 0
        if size and sum(self.cached.values()) + size <= self.cache_bytes:
            if path.parent != self.keep:  # moved whole: a rank finds it there complete
                path.replace(self.keep / path.name)
                remove_request(path)  # its lock
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
        known = self.teacher.get(i)
        if known is not None:  # a later epoch: the head's product once a sample, as a shard's
            argmax = known.long()
        else:
            argmax = torch.full((len(ids),), -1, dtype=torch.int64)
            rows, checked, nxt = answer_rows(final, ids, mask, self.dtype)
            argmax[rows], _ = self.head(checked, nxt)  # a chunk of rows at a time
            self.teacher[i] = argmax.to(torch.int32)
            if rows.numel() and not recorded_answer(self.records[i]):  # the target's answers
                agree = int((argmax[rows] == nxt).sum())
                self.agreement[i] = (agree, rows.numel())
                self._agreed[0] += agree
                self._agreed[1] += rows.numel()
                self._check_agreement()
        aux_stored, aux_scale = stored(aux, self.dtype, len(self.aux_layer_ids))
        final_stored, final_scale = stored(final, self.dtype, 1)
        self.stats["samples"] += 1
        return (self.records[i]["id"], input_ids, loss_mask, argmax, aux_stored, final_stored,
                aux_scale, final_scale)


class SharedServer:
    """Rank 0's capture server as the other ranks see it: its address, and whether it still
    answers. A thread of its own probes it every ``probe_every_s``; :meth:`check_alive`, which
    runs before every request inside the feed's event loop, only reads the verdict (the probe
    itself would stall the loop for its timeout on a hung server)."""

    def __init__(self, url: str, log_path, probe_every_s: float = 5.0):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.probe = VLLMServer(model="", log_path=log_path, host=host, port=int(port))
        self.url, self.log_path, self.down = url, log_path, False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(probe_every_s,), daemon=True,
                                        name="eaglet-server-probe")
        self._thread.start()

    def _watch(self, every: float) -> None:
        while not self._stop.wait(every):
            if not self.probe.healthy(timeout=10.0):
                self.down = True
                return

    def check_alive(self) -> None:
        if self.down:
            raise ServerError(f"the capture server at {self.url}, which rank 0 started, does "
                              f"not answer: see rank 0's log and the server log {self.log_path}")

    def close(self) -> None:
        self._stop.set()


def combine(ranks: list[tuple[dict, list[int]]]) -> dict:
    """The ranks' :meth:`StateFeed.summary` and :attr:`StateFeed.saved` as one summary:
    counts summed, a saved file counted once whichever ranks read it (it stays for every
    rank: :meth:`StreamSamples.finish`); the trainer's waits the longest rank's (every step
    waits for the slowest), the server's idle time and the feeds' waits the shortest rank's
    (a bound: the server idles only while no rank asks)."""
    summaries = [summary for summary, _ in ranks]
    out = dict(summaries[0])
    for key in ("samples", "requests", "window", "cache_files", "cache_bytes",
                "cache_budget_bytes", "teacher_positions"):
        out[key] = sum(s[key] for s in summaries)
    out["saved_files"] = len(set().union(*(saved for _, saved in ranks)))
    out["reread_files"] = out["samples"] - out["requests"] - out["saved_files"]
    for key in ("trainer_wait_s", "trainer_wait_start_s"):
        out[key] = max(s[key] for s in summaries)
    for key in ("feed_wait_s", "server_idle_s"):
        out[key] = min(s[key] for s in summaries)
    agree = sum((s["teacher_agreement"] or 0.0) * s["teacher_positions"] for s in summaries)
    out["teacher_agreement"] = (agree / out["teacher_positions"]
                                if out["teacher_positions"] else None)
    out["server_started"] = any(s["server_started"] for s in summaries)
    out["ranks"] = len(summaries)
    return out


class StreamSamples(Samples):
    """The training samples of stream mode: the layout of shards (so that epochs are planned
    as in shard mode), the states from a :class:`StateFeed`, read once each in the order the
    feed was started with. ``dist``: the training's ranks (:class:`eaglet.train.Dist`)."""

    def __init__(self, infos: list[ShardInfo], feed: StateFeed, stack: contextlib.ExitStack,
                 dist=None):
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
        self.dist.all_gather(every, (mine, sorted(self.feed.saved)))
        return combine(every)

    def finish(self) -> None:
        """Training has ended: delete every file the feeds kept (call on every rank); of
        several ranks, rank 0 deletes once all have trained the files saved before the run,
        the cache's and what a killed run left in a rank's directory (also where a single
        process resumes a data-parallel run)."""
        self.feed.clear_cache()
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
    """:func:`eaglet.config.stream_overlaps` for a trainer on ``train_device``. Why auto takes
    turns where the two share devices: on 2 cores, with a cache, the two at once took 1.13x
    shard mode's time and turns 1.05x (benchmarks/results/stream_train.md): each waits for
    compute the other holds, and the server's tensor-parallel steps and the ranks' gradient
    reductions wait for their slowest member, which a device shared in time slices makes
    slow. Devices of its own (or a GPU that either leaves idle) are what the overlap is for."""
    on_cpu = train_device == "cpu" or (train_device == "auto" and not torch.cuda.is_available())
    return stream_overlaps(setting, server_gpus, train_gpus, on_cpu)


def stream_devices(server_gpus: int, train_gpus: int) -> str | None:
    """Split the job's GPUs (``CUDA_VISIBLE_DEVICES``, as :func:`eaglet.gpus.hold_gpus` set
    it) between the capture server and the trainer: the server takes the first
    ``server_gpus``, the trainer's ranks the next ``train_gpus`` (0: the server's own, one
    rank on each). Sets the trainer's list in this process's environment and returns the
    server's (None where no list is set, or the server takes no GPU)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible or not server_gpus:
        return None
    ids = [d for d in visible.split(",") if d.strip()]
    if len(ids) < server_gpus + train_gpus:
        raise TrainError(f"the streaming job holds the GPUs {visible} but needs "
                         f"{server_gpus + train_gpus}: server.gpus {server_gpus} and "
                         f"train.gpus {train_gpus}")
    server = ids[:server_gpus]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(
        ids[server_gpus:server_gpus + train_gpus] if train_gpus else server)
    return ",".join(server)


def open_stream(stream: dict, train_cfg: dict, rank: int = 0, world: int = 1,
                dist=None) -> StreamSamples:
    """The stream-mode training samples of a run: ``stream`` holds the run's ``cfg`` (its
    extract, target, server and generate sections), ``target_json``, the training split's
    ``data`` file, the ``work_dir`` whose ``requests/`` the capture server writes to (the
    ``vllm`` extraction's, where generation with capture saves too), the ``server_log`` and
    (optional) ``server_devices``, the server's ``CUDA_VISIBLE_DEVICES``
    (:func:`stream_devices`); ``train.stream_kv_cache_gib`` sizes this server's KV cache.
    Of ``world`` ranks, this one (``rank``) feeds its own share; ``dist``
    (:class:`eaglet.train.Dist`) lets the ranks' feeds meet."""
    cfg = stream["cfg"]
    if train_cfg.get("stream_kv_cache_gib") is not None:  # this job's server alone
        cfg = {**cfg, "server": {**cfg["server"],
                                 "kv_cache_gib": train_cfg["stream_kv_cache_gib"]}}
    if stream.get("server_devices"):
        server = cfg["server"]
        cfg = {**cfg, "server": {**server, "env": {**(server.get("env") or {}),
                                                    "CUDA_VISIBLE_DEVICES":
                                                    stream["server_devices"]}}}
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
    # the ranks share the server's extract.concurrency, the window and the cache's budget
    feed = StateFeed(extractor, records, seqs, aux_ids, TeacherHead(target.lm_head),
                     norm, ext["dtype"], -(-ext["concurrency"] // world),
                     -(-train_cfg["stream_ahead"] // world) if train_cfg["stream_ahead"]
                     else None,
                     int(train_cfg["stream_cache_gib"] * GIB) // world,
                     cfg["generate"]["request_timeout_s"], cfg["generate"]["max_retries"],
                     rank, world)
    if is_greedy(records):  # the target's own greedy answers: the teacher must reproduce them
        feed.min_agreement = ext["min_teacher_agreement"]
    feed.overlap = overlaps(train_cfg.get("stream_overlap", "auto"), cfg["server"]["gpus"],
                            cfg["train"]["gpus"], train_cfg.get("device", "auto"))
    return StreamSamples(infos, feed, stack, dist)
