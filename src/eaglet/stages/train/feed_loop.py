"""The thread of a :class:`eaglet.stages.train.stream.StateFeed`: an event loop that walks the
training order and receives each sample's states for the trainer.

Each position of the order waits for a slot of the window (one freed by every sample the
trainer takes); its sample's file is then found on disk or requested
(:class:`eaglet.stages.train.feed_requests.FeedRequests`), once however many positions of the
window read it. A packing thread reads the files in order, splits each into the aux and
final-norm states, runs the teacher check (:class:`eaglet.stages.train.feed_check.TeacherCheck`)
and casts them to ``extract.dtype`` exactly as a shard stores them; after a file's last
scheduled use the cache keeps or deletes it
(:class:`eaglet.stages.train.feed_cache.StateFiles`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import torch

from eaglet.data import shards as shard_format
from eaglet.engine.capture import read_request, split_states
from eaglet.engine.client import gather_or_cancel
from eaglet.stages.train.data import TrainError


def stored(x: torch.Tensor, dtype: str, groups: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` as a shard stores it: cast, or quantized to fp8 with its per-row scales."""
    if dtype == "fp8":
        return shard_format.quantize_fp8(x.float(), groups)
    return x.to(shard_format.STORAGE_DTYPES[dtype]), None


class FeedLoop:
    """The feed's thread (a base of :class:`eaglet.stages.train.stream.StateFeed`): walks the
    order, obtains each sample's file and hands the prepared samples to the trainer through
    the feed's ``_ready`` queue (an error too, which :meth:`StateFeed.take` raises). It reads
    the feed's ``ahead``, ``overlap``, the samples and their ``files``, and counts in its
    ``stats``; the trainer's side reaches the loop's objects below through
    ``call_soon_threadsafe``."""

    _loop: asyncio.AbstractEventLoop | None = None
    _main: asyncio.Task | None = None
    _slots: asyncio.Semaphore | None = None  # the window: one per position ahead of the trainer
    _turn: asyncio.Event  # requests may start (always, where the two overlap)

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
        self._turn = asyncio.Event()
        if self.overlap:
            self._turn.set()
        started.set()
        self._gate = asyncio.Semaphore(self.concurrency)
        self._server_lock = asyncio.Lock()
        files: dict[int, asyncio.Task] = {}  # sample -> the task that makes its file
        refs: Counter = Counter()  # sample -> scheduled positions not yet prepared
        due: asyncio.Queue = asyncio.Queue()

        async def obtain(i: int) -> None:
            found = await asyncio.to_thread(self.files.find, i)
            if found is not None:
                self.files.found(i, found)
                return
            path = self.files.requested(i)
            await self._turn.wait()  # the server's turn (always, where the two overlap)
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
                        self.files.release(i)

        serving = [self._serve_wanted()] if self.world > 1 and not self.rank else []
        try:
            await gather_or_cancel([schedule(), pack(), *serving])
        finally:
            for task in files.values():
                task.cancel()
            await asyncio.gather(*files.values(), return_exceptions=True)
            if self._client is not None:
                await self._client.aclose()

    def _prepare(self, i: int) -> tuple:
        """Sample ``i`` as a shard would hold it: token ids, loss mask, the teacher's argmax
        (-1 except where it predicts an answer token), aux and final states in the stored
        dtype (and their fp8 scales)."""
        ids, mask = self.seqs[i], self.masks[i]
        states = read_request(self.files.path(i), ids)
        if states is None:
            raise TrainError(
                f"the server saved no states of {len(ids)} tokens to "
                f"{self.files.path(i)}: see the server log "
                f"{self.extractor.server.log_path}"
            )
        aux, final = split_states(states, self.extractor.layer_ids, self.aux_layer_ids, self.norm)
        del states
        input_ids = torch.tensor(ids, dtype=torch.int64)
        loss_mask = torch.tensor(mask, dtype=torch.uint8)
        argmax = self.check.argmax(i, final, ids, mask)
        aux_stored, aux_scale = stored(aux, self.dtype, len(self.aux_layer_ids))
        final_stored, final_scale = stored(final, self.dtype, 1)
        self.stats["samples"] += 1
        return (
            self.records[i]["id"],
            input_ids,
            loss_mask,
            argmax,
            aux_stored,
            final_stored,
            aux_scale,
            final_scale,
        )
