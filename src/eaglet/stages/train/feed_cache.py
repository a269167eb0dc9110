"""The files a :class:`eaglet.stages.train.stream.StateFeed` reads the samples' states from,
and its cache of them (``train.stream_cache_gib``).

A sample's states come from a file the capture server's connector saved: one found already
(saved by generation with capture, or by a request of a run that was killed), else the one
this rank's request saves to ``requests/`` (``requests/rank-NNN/`` of several ranks). Once
the sample's last scheduled position is trained on, its file is kept for later epochs while
the cache has room (``requests/cache/`` of several ranks, moved there whole), else deleted.
"""

from __future__ import annotations

from pathlib import Path

from eaglet.core.io import request_path
from eaglet.engine.capture import holds_states, remove_request


class StateFiles:
    """Where each sample's states are read from, and the files kept for later epochs.

    ``requests``: the extraction's request directory; ``seqs``: each sample's token ids;
    ``cache_bytes``: this rank's share of the cache."""

    def __init__(
        self,
        requests: Path,
        records: list[dict],
        seqs: list[list[int]],
        cache_bytes: int,
        rank: int = 0,
        world: int = 1,
    ):
        self.requests, self.records, self.seqs = requests, records, seqs
        self.cache_bytes, self.world = cache_bytes, world
        # where this rank's requests save their states, and where files kept for later
        # epochs lie (one directory for a single process, as generation saves them)
        self.own = requests if world == 1 else requests / f"rank-{rank:03d}"
        self.keep = requests if world == 1 else requests / "cache"
        for directory in (self.own, self.keep):
            directory.mkdir(parents=True, exist_ok=True)
        self.at: dict[int, Path] = {}  # sample -> the file its states are read from
        # samples read from a file saved before this run's requests (by generation, or by a
        # run killed with requests in flight)
        self.saved: set[int] = set()
        self.cached: dict[int, int] = {}  # sample -> bytes of its file kept for later epochs

    def path(self, index: int) -> Path:
        """The file sample ``index`` is read from: where it was found or requested to."""
        return self.at.get(index) or request_path(self.own, self.records[index]["id"])

    def find(self, index: int) -> Path | None:
        """A file already holding sample ``index``'s states: this rank's own (a request of
        a killed run), the cache's, or one saved before the run (generation with capture)."""
        sid = self.records[index]["id"]
        places = dict.fromkeys((self.own, self.keep, self.requests))
        return next(
            (
                path
                for path in (request_path(d, sid) for d in places)
                if holds_states(path, self.seqs[index])
            ),
            None,
        )

    def found(self, i: int, path: Path) -> None:
        """Sample ``i`` is read from ``path``, which :meth:`find` found."""
        self.at[i] = path
        # not a file this run made or read before (nor another rank's cache)
        if i not in self.cached and (self.world == 1 or path.parent != self.keep):
            self.saved.add(i)

    def requested(self, i: int) -> Path:
        """Sample ``i`` is read from the file its request saves: that file."""
        self.at[i] = path = request_path(self.own, self.records[i]["id"])
        return path

    def release(self, i: int) -> None:
        """A sample's file after its last scheduled use: kept while the cache has room.
        Of several ranks, each deletes only the files it requested; the others' cache and
        the files saved before the run stay for any rank to read, until
        :meth:`eaglet.stages.train.stream.StreamSamples.finish`."""
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

    def clear(self) -> None:
        """Delete the files kept for later epochs (training has ended)."""
        for i in list(self.cached):
            remove_request(request_path(self.keep, self.records[i]["id"]))
            del self.cached[i]
