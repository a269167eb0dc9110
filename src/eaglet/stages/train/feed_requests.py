"""The prefill requests of a :class:`eaglet.stages.train.stream.StateFeed`, issued on its event
loop's thread, and the capture server they go to.

The first request starts the server (rank 0) or waits for rank 0's, then makes the client;
each request asks the server to save one sample's states to its file, ``concurrency`` of
them in flight. Of several ranks, rank 0 owns the one server: a rank that needs it asks
through ``requests/server.wanted``, rank 0 starts it (for that rank too, though it needs
none itself) and tells where it listens through ``requests/server.json``; the other ranks
learn its health from a thread of their own (:class:`SharedServer`).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx

from eaglet.core.io import atomic_open, read_json
from eaglet.engine.capture import prefill
from eaglet.engine.server import ServerError, VLLMServer
from eaglet.stages.train.data import TrainError


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
        self._thread = threading.Thread(
            target=self._watch, args=(probe_every_s,), daemon=True, name="eaglet-server-probe"
        )
        self._thread.start()

    def _watch(self, every: float) -> None:
        while not self._stop.wait(every):
            if not self.probe.healthy(timeout=10.0):
                self.down = True
                return

    def check_alive(self) -> None:
        if self.down:
            raise ServerError(
                f"the capture server at {self.url}, which rank 0 started, does "
                f"not answer: see rank 0's log and the server log {self.log_path}"
            )

    def close(self) -> None:
        self._stop.set()


class FeedRequests:
    """The request side of :class:`eaglet.stages.train.stream.StateFeed` (a base of it), run on
    the feed's event loop. It reads the feed's ``extractor``, ``rank``, ``world``, ``seqs``,
    ``concurrency``, ``timeout`` and ``max_retries``, and counts the server's idle time in
    its ``stats``; the state below is its own (``_starting`` the trainer's side reads too)."""

    _client: httpx.AsyncClient | None = None  # made once the server is there
    _in_flight, _idle_since = 0, None  # requests in flight; since when the server had none
    _starting: tuple[float, float | None] | None = None  # the server's start: from, to
    # made on the loop (eaglet.stages.train.feed_loop.FeedLoop._run): the requests in
    # flight, and the server's start by one request at a time
    _gate: asyncio.Semaphore
    _server_lock: asyncio.Lock

    async def _request(self, i: int, path: Path) -> None:
        """Sample ``i``'s prefill request, its states saved to ``path``; the server is started
        (and the client made) by the first request."""
        async with self._server_lock:
            if self._client is None:
                await self._connect()
        await self._prefill(i, path)

    async def _serve_wanted(self) -> None:
        """Rank 0 of several: start the server another rank wants."""
        while self._client is None:
            if self._wanted().exists():
                async with self._server_lock:
                    if self._client is None:
                        await self._connect()
                return
            await asyncio.sleep(0.5)

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
            limits=httpx.Limits(max_connections=self.concurrency),
        )
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

    async def _shared_server(self) -> SharedServer:
        """Rank 0's server, once it is ready: asked for through ``server.wanted``, found
        through ``server.json``."""
        self._wanted().touch()
        server = self.extractor.server
        patience = getattr(server, "startup_timeout_s", 900.0) + 120.0
        deadline = time.monotonic() + patience
        while not self._announcement().exists():
            if time.monotonic() > deadline:
                raise TrainError(
                    f"rank {self.rank} waited {patience:.0f} s for rank 0 to start "
                    f"the capture server ({self._announcement()} never appeared): "
                    f"see rank 0's log and the server log {server.log_path}"
                )
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
                await prefill(
                    self._client,
                    self.seqs[i],
                    path,
                    self.timeout,
                    self.max_retries,
                    self.extractor.server.check_alive,
                )
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
