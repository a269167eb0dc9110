"""Atomic file writes and JSON-lines helpers.

Every artifact eaglet writes appears either whole or not at all: it is written to a
temporary file in the same directory, fsynced, then renamed over the destination.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """Open a temporary sibling of ``path``; rename it to ``path`` on clean exit only."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~umask())  # mkstemp's 0600 would outlive the rename
        with os.fdopen(fd, mode) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def umask() -> int:
    """The process umask (reading it means setting it; it is put back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_json(path: str | os.PathLike, obj: Any) -> None:
    with atomic_open(path) as handle:
        json.dump(obj, handle, indent=2, sort_keys=False)
        handle.write("\n")


def read_json(path: str | os.PathLike) -> Any:
    with open(path) as handle:
        return json.load(handle)


def write_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> int:
    count = 0
    with atomic_open(path) as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    return count


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def human_size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"


def request_path(directory: str | os.PathLike, sample_id: str) -> Path:
    """Where vLLM's capture connector saves the hidden states of one sample (sample ids may
    hold any character): generation with capture and the vllm extraction backend agree on it."""
    return Path(directory) / f"{hashlib.sha256(sample_id.encode()).hexdigest()[:24]}.safetensors"


def request_lock(path: str | os.PathLike) -> Path:
    """The lock beside a request file: its writer (the capture connector; vLLM's asynchronous
    GPU writer) holds an exclusive flock on it until the file is whole."""
    return Path(f"{path}.lock")


def writer_done(path: str | os.PathLike, wait: bool = True) -> bool:
    """Whether the writer of the request file ``path`` has finished (or there is none);
    ``wait``: block until it has, else answer at once."""
    try:
        with open(request_lock(path)) as handle:
            fcntl.flock(handle, fcntl.LOCK_SH | (0 if wait else fcntl.LOCK_NB))
    except FileNotFoundError:
        return True
    except BlockingIOError:
        return False
    return True


class DirectoryBusy(RuntimeError):
    """Another live process holds the directory a stage writes."""


@contextmanager
def hold_directory(directory: str | os.PathLike, stage: str) -> Iterator[None]:
    """Hold ``directory`` for ``stage`` while the block runs: an exclusive lock on its
    ``.owner`` file (released by the kernel however the process ends), with the holder's pid,
    host and start written in it. A second process of the stage (an orphan left running by a
    killed Snakemake, and its rerun) is refused at once, by a :class:`DirectoryBusy` naming the
    live one, instead of both writing the same files."""
    import datetime
    import socket

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / ".owner"
    handle = open(path, "a+")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            try:
                holder = json.loads(handle.read() or "{}")
            except ValueError:
                holder = {}
            pid, host = holder.get("pid", "?"), holder.get("host", "?")
            raise DirectoryBusy(
                f"{stage}: {directory} is held by another {holder.get('stage', stage)} process, "
                f"pid {pid} on host {host} (since {holder.get('started', '?')}), still running: "
                f"two would write the same files. Stop it first (kill {pid} on {host}), or wait "
                f"for it, then rerun."
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(
            json.dumps(
                {
                    "stage": stage,
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                }
            )
        )
        handle.flush()
        yield
    finally:
        handle.close()  # releases the lock
