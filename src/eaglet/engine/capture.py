"""How eaglet asks vLLM for hidden states, in eaglet's process (the connector runs inside the
server; nothing here imports vLLM).

The server arguments that load :mod:`eaglet.engine.connector` with the ``extract_hidden_states``
method and the layers the server saves: both servers that capture take them from here,
generation's with ``generate.capture_hidden_states`` (the states of every answer) and the
capture server (:func:`capture_server`: the target served as generation serves it, plus these
options) that the ``vllm`` extraction backend and training's stream mode send their prefill
requests to.

A prefill request (:func:`prefill`, many through one window: :func:`prefill_each`) is one
sequence's token ids as the prompt and ``max_tokens`` 1; the connector saves the states of every
prompt token to ``<requests>/<sample>.safetensors``: the aux layers and layer L (the last decoder
layer's output before the final norm). :func:`read_request` reads such a file back (checked
against the sequence, a torn one discarded), :func:`split_states` makes the aux states and the
final state (the target's final RMSNorm applied to layer L, with the norm's weight read from
the checkpoint) of it, and :class:`Extractor` starts the server on first need and streams the
states of many sequences through one request window to a thread that consumes them in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from eaglet.core.io import request_lock, request_path, writer_done
from eaglet.core.progress import Progress
from eaglet.engine.client import RequestFailed, gather_or_cancel, post_json, with_retries
from eaglet.engine.server import VLLMServer, target_server
from eaglet.target.norm import FinalNorm
from eaglet.target.states import ExtractionError

log = logging.getLogger("eaglet.engine.capture")

CONNECTOR = "EagletHiddenStatesConnector"
CONNECTOR_MODULE = "eaglet.engine.connector"


def capture_layer_ids(aux_layer_ids: list[int], num_layers: int) -> list[int]:
    """Layers the server saves: the distinct aux ids, then ``num_layers`` (layer L's output
    before the final norm, which gives the teacher's final state)."""
    return [*dict.fromkeys(aux_layer_ids), num_layers]


def capture_args(layer_ids: list[int], storage_dir: str | os.PathLike) -> list[str]:
    """vLLM arguments that make every request save its hidden states under ``storage_dir``."""
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
    }
    transfer = {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "shared_storage_path": str(storage_dir),
            "allow_custom_save_path": True,
        },
    }
    return [
        "--speculative-config",
        json.dumps(speculative),
        "--kv-transfer-config",
        json.dumps(transfer),
        "--no-enable-prefix-caching",
    ]


# -- the capture server ----------------------------------------------------------------------


def capture_server(
    cfg: dict, model_path: str, layer_ids: list[int], storage_dir: Path, log_path: str | os.PathLike
) -> VLLMServer:
    """The target served as generation serves it, plus the capture options; its context length
    fits the longest extracted sequence and the one token a request must generate."""
    target = dict(cfg["target"])
    target["max_model_len"] = max(target["max_model_len"], cfg["extract"]["max_len"] + 1)
    return target_server(
        cfg, model_path, log_path, capture_args(layer_ids, storage_dir), target=target
    )


# -- one request -----------------------------------------------------------------------------


def read_request(path: Path, ids: list[int]) -> torch.Tensor | None:
    """The saved states [len(ids), layers, H] of ``ids``, or None when the file is missing,
    unreadable (cut short by a crash) or from another sequence; waits for a write in flight.

    A file may hold more tokens than ``ids`` (the sequence was cut to ``extract.max_len``:
    its first rows are the states of the cut sequence) or one fewer: generation with
    ``capture_hidden_states`` saves every token but the last generated one, which no forward
    pass has read. That last row is returned as zeros: no training loss reads it (row t
    predicts token t+2 and later; the last row predicts nothing and no other row attends to
    it) and the teacher check skips it (it predicts no token)."""
    try:
        writer_done(path)
        if not path.exists():
            return None
        data = load_file(str(path))
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:  # a torn file
        log.warning("discarding the unreadable request file %s (%s)", path.name, exc)
        remove_request(path)
        return None
    token_ids = data.get("token_ids")
    states = data.get("hidden_states")
    match = None if states is None else _match(token_ids, ids)
    if match == "same":
        return states[: len(ids)]
    if match == "one short":
        return torch.cat([states, states.new_zeros((1, *states.shape[1:]))])
    log.warning("discarding %s: it holds the states of another sequence", path.name)
    remove_request(path)
    return None


def holds_states(path: Path, ids: list[int]) -> bool:
    """Whether ``path`` holds the states :func:`read_request` would return for ``ids``, read
    from its token ids alone (the states stay on disk until they are packed); a file that
    cannot be used is removed, as :func:`read_request` does."""
    try:
        writer_done(path)
        if not path.exists():
            return False
        with safe_open(str(path), framework="pt") as handle:
            token_ids = handle.get_tensor("token_ids") if "token_ids" in handle.keys() else None
            has_states = "hidden_states" in handle.keys()
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        log.warning("discarding the unreadable request file %s (%s)", path.name, exc)
        remove_request(path)
        return False
    if has_states and _match(token_ids, ids) is not None:
        return True
    log.warning("discarding %s: it holds the states of another sequence", path.name)
    remove_request(path)
    return False


def _match(token_ids: torch.Tensor | None, ids: list[int]) -> str | None:
    """How a request file's saved ``token_ids`` cover ``ids``: "same" (the sequence, or a
    longer one it was cut from), "one short" (saved while generating) or None."""
    saved, ids = ([] if token_ids is None else token_ids.tolist()), list(ids)
    if saved[: len(ids)] == ids:
        return "same"
    if len(saved) == len(ids) - 1 and saved == ids[:-1]:
        return "one short"
    return None


def remove_request(path: Path) -> None:
    for p in (path, request_lock(path)):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


async def prefill(
    client: httpx.AsyncClient,
    ids: list[int],
    path: Path,
    timeout: float,
    max_retries: int,
    health_check=None,
) -> None:
    """One prefill request whose states the connector saves to ``path``; ``health_check`` (the
    server process's) runs after every failed attempt and ends the retries of a dead server."""
    payload = {
        "model": "target",
        "prompt": list(ids),
        "max_tokens": 1,
        "temperature": 0.0,
        "kv_transfer_params": {"hidden_states_path": str(path)},
    }
    try:
        body = await with_retries(
            lambda: post_json(client, "/v1/completions", payload, timeout),
            max_retries,
            health_check=health_check,
        )
    except RequestFailed as exc:
        raise ExtractionError(f"prefill request failed: {exc}") from exc
    saved = (body.get("kv_transfer_params") or {}).get("hidden_states_path")
    if saved is None:
        raise ExtractionError(
            "the server answered without kv_transfer_params.hidden_states_path: it runs "
            "without eaglet's capture options (extract.backend: vllm starts its own server; "
            "server.url is not used for extraction)"
        )
    if Path(saved) != path:  # a connector that ignores the requested path
        await asyncio.to_thread(_move_when_written, Path(saved), path)


async def prefill_each(
    url: str,
    work: list[tuple[list[int], Path]],
    concurrency: int,
    timeout: float,
    max_retries: int,
    after,
    health_check=None,
    before=None,
) -> None:
    """Send every ``(ids, path)`` of ``work`` as one prefill request to the capturing server
    at ``url``, ``concurrency`` at a time, in order; ``await after(i)`` once the i-th was
    answered (outside the concurrency gate: reading a file does not hold a request slot back)
    and ``await before(i)`` ahead of the i-th (outside the gate too: it holds back the
    requests that may not run ahead yet, not those in flight). ``health_check()`` (the
    server process's, when eaglet started it) runs ahead of each request and after every
    failed attempt: a server that died stops the stage at once, with its exit named. The
    first failure cancels the rest."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits) as client:

        async def one(i: int, ids: list[int], path: Path) -> None:
            if before is not None:
                await before(i)
            async with gate:
                if health_check is not None:
                    health_check()
                await prefill(client, ids, path, timeout, max_retries, health_check)
            await after(i)

        await gather_or_cancel(one(i, ids, path) for i, (ids, path) in enumerate(work))


def _move_when_written(source: Path, dest: Path) -> None:
    writer_done(source)
    os.replace(source, dest)
    with contextlib.suppress(FileNotFoundError):
        request_lock(source).unlink()


def split_states(
    states: torch.Tensor, layer_ids: list[int], aux_layer_ids: list[int], norm: FinalNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """Aux [N, 3H] (in aux id order, repeats allowed) and final-norm [N, H] states from the
    saved [N, layers, H] (layers in ``layer_ids`` order, the last being L)."""
    aux = torch.cat([states[:, layer_ids.index(i)] for i in aux_layer_ids], dim=-1)
    return aux, norm(states[:, -1])


# -- many requests through one window -----------------------------------------------------


class PartTimes:
    """Wall seconds the packing thread spends per part (reading the request files, the
    states, the teacher check, writing, waiting for the server): the stage's log says which
    side waited for which."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def part(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def summary(self) -> str:
        return ", ".join(
            f"{name} {s:.1f} s" for name, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])
        )


class Extractor:
    """Serves the target with capture on first use and computes the states of sequences."""

    # the packing thread yields the CPU to the server's (see _yield_cpu)
    low_priority = True

    def __init__(
        self,
        cfg: dict,
        model_path: str,
        layer_ids: list[int],
        work_dir: Path,
        server_log: str | os.PathLike,
        progress: Progress | None,
    ):
        self.cfg, self.layer_ids, self.progress = cfg, layer_ids, progress
        self.requests = (work_dir / "requests").resolve()
        self.requests.mkdir(parents=True, exist_ok=True)
        self.server = capture_server(cfg, model_path, layer_ids, self.requests, server_log)
        self.started = False
        self.norm: FinalNorm | None = None
        # samples whose states this run sent as prefill requests (not those generation saved)
        self.prefilled: set[str] = set()
        # what stops the server once it was started (set by the caller)
        self.stack: contextlib.ExitStack | None = None
        self.times = PartTimes()

    def ensure_server(self) -> None:
        """Start the server on first need: states saved by generation need none."""
        if self.started:
            return
        if self.progress is not None:
            self.progress.enter_phase("starting the vLLM server")
        assert self.stack is not None, "Extractor.stack is not set"
        self.stack.enter_context(self.server)
        self.started = True

    def states(self, target, records, seqs, cfg, aux_layer_ids, progress):
        """``extract_shard``'s ``states``: one prefill request per sequence not saved yet."""
        rows: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(seqs)

        def keep(i: int, saved: torch.Tensor) -> None:
            rows[i] = split_states(saved, self.layer_ids, aux_layer_ids, self.norm)

        self.stream(
            [r["id"] for r in records],
            seqs,
            [request_path(self.requests, r["id"]) for r in records],
            keep,
            progress,
        )
        return [r[0] for r in rows], [r[1] for r in rows]

    def stream(
        self,
        sample_ids: list[str],
        seqs: list[list[int]],
        paths: list[Path],
        consume,
        progress: Progress | None,
        ahead: list[int] | None = None,
    ) -> None:
        """``consume(i, states)`` for every sequence, in order, in a packing thread (states
        as :func:`read_request` returns them): those saved already (by an earlier run, or by
        generation) read as they are, the others sent as prefill requests through one
        window while the thread consumes what is answered. ``ahead[i]``: how many sequences
        the thread must have consumed before request i may be sent (None: no bound).

        With requests to send, the progress clock restarts once the server is up and counts
        only the requested sequences (the saved ones are counted as done): the rate that
        ``eaglet status`` learns is the prefill's, without the server's start."""
        saved = [holds_states(path, ids) for path, ids in zip(paths, seqs)]
        missing = [i for i, ok in enumerate(saved) if not ok]
        if missing:
            log.info(
                "%d of %d sequences have no saved states: sending them as prefill requests",
                len(missing),
                len(seqs),
            )
            self.ensure_server()
            self.prefilled.update(sample_ids[i] for i in missing)
            if progress is not None:
                progress.restart(already_done=progress.done + len(seqs) - len(missing))
                progress.enter_phase(None)
        asyncio.run(self._pipeline(seqs, paths, saved, missing, consume, progress, ahead))

    async def _pipeline(self, seqs, paths, saved, missing, consume, progress, ahead) -> None:
        loop = asyncio.get_running_loop()
        answered = [threading.Event() for _ in seqs]
        for event, ok in zip(answered, saved):
            if ok:
                event.set()
        stop = threading.Event()
        # how many sequences consumed let the requests that wait on that number go
        consumed = {n: asyncio.Event() for n in set(ahead or ()) if n > 0}
        counted = set(missing) if missing else None  # what the progress counts

        def pack() -> None:
            self._yield_cpu()
            for i, (ids, path) in enumerate(zip(seqs, paths)):
                with self.times.part("waiting for the server"):
                    while not answered[i].wait(0.1):
                        if stop.is_set():
                            return
                with self.times.part("reading"):
                    states = read_request(path, ids)
                if states is None:
                    raise ExtractionError(
                        f"the server saved no states of {len(ids)} tokens to {path}: see the "
                        f"server log {self.server.log_path}"
                    )
                consume(i, states)
                del states
                if progress is not None and (counted is None or i in counted):
                    progress.advance(done=1, tokens=len(ids))
                if i + 1 in consumed:
                    loop.call_soon_threadsafe(consumed[i + 1].set)

        async def after(j: int) -> None:
            answered[missing[j]].set()

        async def before(j: int) -> None:
            if ahead[missing[j]] in consumed:
                await consumed[ahead[missing[j]]].wait()

        gen = self.cfg["generate"]
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-packer") as thread:
            tasks = [loop.run_in_executor(thread, pack)]
            if missing:
                hooks = {"before": before} if consumed else {}
                tasks.append(
                    asyncio.ensure_future(
                        prefill_each(
                            self.server.url,
                            [(seqs[i], paths[i]) for i in missing],
                            self.cfg["extract"]["concurrency"],
                            gen["request_timeout_s"],
                            gen["max_retries"],
                            after,
                            health_check=self.server.check_alive,
                            **hooks,
                        )
                    )
                )
            try:
                pending = set(tasks)
                while pending:  # the first failure ends both sides
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                    for task in done:
                        task.result()
            finally:
                stop.set()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    def _yield_cpu(self) -> None:
        """On the CPU engine (``server.gpus`` 0) the server computes on the cores this
        process runs on, and each of its forward passes waits for its slowest thread: the
        packing thread (and the threads its torch calls start, which inherit it) runs at the
        lowest priority (nice 19, per thread on Linux), mostly on the CPU time the server
        leaves, and at full speed once the server has nothing left to compute. Not the idle
        scheduling class: another busy process would starve the packing, and the requests
        wait on it."""
        if not (self.low_priority and self.started) or self.cfg["server"]["gpus"]:
            return
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError) as exc:  # not Linux, or not allowed
            log.debug("the packing thread keeps its priority (%s)", exc)

    def captured_during_generation(self, records: list[dict]) -> int:
        """How many of ``records`` have the states generation's own forward passes saved
        (``generate.capture_hidden_states`` marks them ``hidden_states: saved``) rather than
        a prefill request of this run."""
        return sum(
            r.get("hidden_states") == "saved" and r["id"] not in self.prefilled for r in records
        )
