"""Where the sweep's servers go: host or GPU memory per server from the target's size, and
how many run side by side."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from eaglet.core.gpus import GPU_BYTES, GPU_USABLE
from eaglet.core.io import human_size
from eaglet.core.layout import TARGET_JSON
from eaglet.model.sizes import target_size
from eaglet.stages.evaluate.runs import serving
from eaglet.target.checkpoint import read_target

# per server (per GPU of a GPU server): the engine process, its activations and buffers, the
# CUDA context, the drafter's one layer. On the CPU engine the embedded model's server process
# measured about 1.4 GB with its 0.5 GB of weights.
SERVER_OVERHEAD = 1 << 30
# share of the machine's RAM the servers (or the offline replay's forward) may hold together:
# the rest is the stage's own process, the OS and its page cache
HOST_USABLE = 0.8
VLLM_MEMORY_UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization


@dataclass
class Placement:
    """Whether evaluation's servers run side by side, and why (the log and status say it)."""

    together: bool
    reason: str
    fits: bool | None = None  # what the sizes say (None: unknown)


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class ServerMemory(NamedTuple):
    """One evaluation server's memory, the memory every server up at once shares, what that
    memory is, and what sizes the server (its own contents, or vLLM's share of the memory)."""

    each: int
    budget: int
    where: str
    sized_by: str


def server_memory(cfg: dict, weights: int, host_bytes: int | None = None) -> ServerMemory:
    """What one evaluation server holds with ``weights`` bytes of weights, against the memory
    every server up at once shares.

    GPUs (server.gpus): each server stacks on the same GPUs; vLLM asks its
    memory_utilization of each GPU free at start (whatever the KV cache's size), and holds
    the weights, its KV cache (evaluate.kv_cache_gib per GPU) and its overhead; plan.py's
    device of 141 GB, 95% usable. CPU: the weights, the KV cache (or, without a size, the
    memory_utilization share of the RAM vLLM's CPU engine reserves) and the overhead, within
    80% of the machine's RAM."""

    server = serving(cfg)["server"]
    util = server["memory_utilization"] or VLLM_MEMORY_UTILIZATION
    kv = server.get("kv_cache_gib")
    gpus = server["gpus"]
    contents = "weights, KV cache and engine" if kv is not None else "weights and engine"
    share = f"vLLM's memory_utilization {util} of the memory"
    if gpus:
        total = gpus * GPU_BYTES
        own = weights + gpus * (SERVER_OVERHEAD + (int(kv * 2**30) if kv is not None else 0))
        reserved = int(util * total)
        return ServerMemory(
            max(own, reserved),
            int(GPU_USABLE * total),
            f"{GPU_USABLE:.0%} of {gpus} GPUs of {human_size(GPU_BYTES)}",
            contents if own >= reserved else share,
        )
    ram = host_bytes or host_memory_bytes()
    where = f"{HOST_USABLE:.0%} of the machine's {human_size(ram)} RAM"
    own = weights + SERVER_OVERHEAD
    if kv is not None:
        return ServerMemory(own + int(kv * 2**30), int(HOST_USABLE * ram), where, contents)
    # without a KV cache size the CPU engine reserves its memory_utilization share
    reserved = int(util * ram)
    return ServerMemory(
        max(own, reserved), int(HOST_USABLE * ram), where, contents if own >= reserved else share
    )


def placement(
    cfg: dict, target_dir: str | os.PathLike | None, servers: int, host_bytes: int | None = None
) -> Placement:
    """Whether the stage's ``servers`` engine runs serve side by side: evaluate.interleave
    true or false as set; auto: where they fit together (:func:`server_memory` of the
    target's size, :func:`target_size`), else one at a time. The run and `eaglet status`
    both ask here, so the plan and the run agree."""
    setting = cfg["evaluate"]["interleave"]
    size = target_size(target_dir, cfg["target"]["dtype"]) if target_dir else None
    if size is None:
        fits, sizes = (
            None,
            (
                f"the target's size is unknown (no safetensors or config.json in {target_dir})"
                if target_dir
                else "the target is not prepared yet"
            ),
        )
    else:
        memory = server_memory(cfg, size.served, host_bytes)
        fits = servers * memory.each <= memory.budget
        sizes = (
            f"{servers} servers of about {human_size(memory.each)} each ({memory.sized_by}; "
            f"the target's weights {human_size(size.served)}, from {size.source}) "
            f"{'fit within' if fits else 'need more than'} {human_size(memory.budget)}, "
            f"{memory.where}"
        )
    if setting != "auto":
        return Placement(
            bool(setting), f"evaluate.interleave: {str(setting).lower()}; {sizes}", fits
        )
    return Placement(bool(fits), f"evaluate.interleave: auto; {sizes}", fits)


def recorded_target_dir(results: str | os.PathLike, spec: str) -> str | None:
    """The target's directory as prepare_target recorded it in ``results``, else the
    configured one where it is a local directory; None before a hub target is prepared."""
    try:
        return read_target(Path(results) / TARGET_JSON)["path"]
    except (OSError, ValueError, KeyError):
        return spec if Path(spec).is_dir() else None
