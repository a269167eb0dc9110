"""A GPU job's own GPUs: which devices of the node a Snakemake job may use.

Snakemake's ``gpu`` resource only counts GPUs; it does not say which ones a job holds. On a
local multi-GPU machine, concurrent extraction shards (and the vLLM server beside them)
would all open ``cuda:0``. :func:`hold_gpus` gives each job its own devices:

* ``CUDA_VISIBLE_DEVICES`` already set (SLURM sets it per job, or you did): kept as it is.
* otherwise the job claims ``n`` free slots of the node's GPU list (``EAGLET_GPUS``, e.g.
  ``0,1,2,3``, else the GPUs ``nvidia-smi`` lists) by taking an exclusive ``flock`` on one
  lock file per slot, held for the life of the process, and sets ``CUDA_VISIBLE_DEVICES``
  to them. The kernel drops a process's locks when it exits, however it exits (SIGKILL
  too), so a dead job never keeps a slot.
* When fewer than ``n`` slots are free the job waits for them (another job still holds
  them), logging once who holds them; ``EAGLET_GPU_WAIT_S`` bounds the wait (unset: wait as
  long as it takes), after which it fails naming the holders. A job that asks for more GPUs
  than the node has fails at once.

The lock files live in a node-local directory (``EAGLET_GPU_LOCK_DIR``, default
``<tmp>/eaglet-gpu-slots-<uid>``): GPUs belong to the node, so two runs of different results
directories on one machine share the slots, and flock on a network filesystem is not
reliable. Call it before anything initializes CUDA (torch reads ``CUDA_VISIBLE_DEVICES``
once, at its first CUDA call); child processes (the vLLM server, torchrun's workers)
inherit the variable.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

LIST_ENV = "EAGLET_GPUS"
LOCK_DIR_ENV = "EAGLET_GPU_LOCK_DIR"
WAIT_ENV = "EAGLET_GPU_WAIT_S"
POLL_S = 0.5

_held: list[int] = []  # open lock-file descriptors: the slots this process holds


class GpuSlotsBusy(RuntimeError):
    """Not enough free GPU slots (within the wait), or more asked for than the node has."""


def node_gpus() -> list[str]:
    """The node's GPU ids: ``EAGLET_GPUS`` (comma-separated; empty for none), else the
    indices ``nvidia-smi`` lists (without initializing CUDA in this process), else none."""
    listed = os.environ.get(LIST_ENV)
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def lock_dir() -> Path:
    configured = os.environ.get(LOCK_DIR_ENV)
    if configured:
        return Path(configured)
    return Path(tempfile.gettempdir()) / f"eaglet-gpu-slots-{os.getuid()}"


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "?"
    except OSError:
        return "?"


def _try_claim(gpus: list[str], n: int, directory: Path) -> list[tuple[str, int]]:
    """Lock up to ``n`` free slots; all of them, or none (the partial set is released)."""
    got: list[tuple[str, int]] = []
    for gpu in gpus:
        fd = os.open(directory / f"gpu_{gpu}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        got.append((gpu, fd))
        if len(got) == n:
            return got
    for _, fd in got:
        os.close(fd)  # closing the only descriptor drops its lock
    return []


def claim(
    n: int,
    gpus: list[str] | None = None,
    directory: Path | None = None,
    wait_s: float | None = None,
) -> list[str]:
    """Hold ``n`` free GPU slots for the rest of this process; their ids. Waits while other
    processes hold too many (``wait_s`` None: without limit)."""
    gpus = node_gpus() if gpus is None else gpus
    directory = lock_dir() if directory is None else directory
    if n > len(gpus):
        raise GpuSlotsBusy(
            f"the job asks for {n} GPUs but this node has {len(gpus)} "
            f"({','.join(gpus) or 'none'}; from ${LIST_ENV} or nvidia-smi)"
        )
    directory.mkdir(parents=True, exist_ok=True)
    deadline = None if wait_s is None else time.monotonic() + wait_s
    announced = False
    while True:
        got = _try_claim(gpus, n, directory)
        if got:
            break
        holders = ", ".join(f"GPU {g}: {_holder(directory / f'gpu_{g}.lock')}" for g in gpus)
        if deadline is not None and time.monotonic() >= deadline:
            raise GpuSlotsBusy(
                f"no {n} free GPUs of {len(gpus)} after {wait_s:g} s "
                f"(held: {holders}; lock files in {directory}). Lower the "
                f"`gpu` resource cap (--resources gpu=N) to the node's GPUs."
            )
        if not announced:
            log.info("waiting for %d free GPUs (held: %s)", n, holders)
            announced = True
        time.sleep(POLL_S)
    for _gpu, fd in got:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
        _held.append(fd)
    return [gpu for gpu, _ in got]


def hold_gpus(n: int) -> str | None:
    """Give this job ``n`` GPUs of its own through ``CUDA_VISIBLE_DEVICES`` (see the module
    docstring); the value in force, or None when nothing was set (``n`` 0, or no GPU list)."""
    n = int(n or 0)
    if n <= 0:
        return None
    preset = os.environ.get("CUDA_VISIBLE_DEVICES")
    if preset is not None:
        log.info("GPUs from the scheduler: CUDA_VISIBLE_DEVICES=%s", preset)
        return preset
    gpus = node_gpus()
    if not gpus:
        log.warning(
            "the job holds %d GPUs but none are listed (no $%s, no nvidia-smi); "
            "CUDA_VISIBLE_DEVICES left unset",
            n,
            LIST_ENV,
        )
        return None
    wait = os.environ.get(WAIT_ENV)
    ids = claim(n, gpus, wait_s=float(wait) if wait else None)
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # CUDA's order = nvidia-smi's
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
    log.info(
        "GPU slots %s of %s: CUDA_VISIBLE_DEVICES=%s", ids, gpus, os.environ["CUDA_VISIBLE_DEVICES"]
    )
    return os.environ["CUDA_VISIBLE_DEVICES"]


# one H200 ("141 GB"): 143,771 MiB as nvidia-smi reports it; 5% is kept for the CUDA
# context, NCCL buffers and allocator fragmentation
GPU_NAME = "one 141 GB GPU"
GPU_BYTES = 143_771 * 2**20
GPU_USABLE = 0.95
