"""The ``vllm`` extraction backend: the serving engine computes the hidden states.

One vLLM server, started with the generation's target settings plus the capture options
(``extract_hidden_states`` speculation and :mod:`eaglet.engine.connector`), serves every
shard of the run. Each training sequence is one prefill request (``/v1/completions`` with the
token ids as the prompt and ``max_tokens`` 1); the connector saves the states of every
prompt token to ``<work>/requests/<sample>.safetensors``: the aux layers and layer L (the
last decoder layer's output before the final norm). The final state stored for the teacher is
the target's final RMSNorm applied to layer L, with the norm's weight read from the
checkpoint, so the shards and the teacher-agreement check are those of the ``hf`` backend,
computed by the serving numerics.

The requests of every shard go out in one window (``extract.concurrency`` in flight); a
packing thread reads the answered requests' files in order, runs the teacher check a chunk at
a time and writes each shard as soon as its last sequence is in, while the server computes the
next ones. The window runs at most one shard ahead of the shard being packed: the request
files on disk stay within two shards, the states in memory within one.

Resume: a request whose file exists (and holds the same token ids) is not sent again; a shard
is packed into ``<work>/shards/`` and its request files are removed; the packed shards get
their final names when all are done (hard links: the packed names stay), so a failed run keeps
everything it finished, and a rerun that Snakemake starts by deleting the outputs (one shard
damaged, one prompt edited) extracts only the shards whose samples or bytes changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import os
import shutil
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from eaglet.core import rates
from eaglet.core.dtypes import BYTES
from eaglet.core.io import (hold_directory, read_json, read_jsonl, request_lock, request_path,
                            writer_done)
from eaglet.core.progress import Progress
from eaglet.engine.capture import capture_args, capture_layer_ids
from eaglet.engine.client import RequestFailed, gather_or_cancel, post_json, with_retries
from eaglet.engine.server import VLLMServer, target_server
from eaglet.target.checkpoint import load_head
from eaglet.target.norm import FinalNorm
from eaglet.target.states import (ExtractionError, ShardStates, ShardTeacher, Target,
                                  TeacherHead, check_disk, enforce_agreement, estimate_bytes,
                                  resolve_aux_layer_ids, sequence, shard_problem,
                                  shard_records, target_identity, write_shard)

log = logging.getLogger("eaglet.engine.extraction")

# the rates `eaglet status` estimates this stage from: sequences sent as prefill requests, or
# states that generation captured, only packed
RATE_PREFILL, RATE_PACK = "extract_vllm", "extract_pack"


# -- the server ------------------------------------------------------------------------------

def capture_server(cfg: dict, model_path: str, layer_ids: list[int], storage_dir: Path,
                   log_path: str | os.PathLike) -> VLLMServer:
    """The target served as generation serves it, plus the capture options; its context length
    fits the longest extracted sequence and the one token a request must generate."""
    target = dict(cfg["target"])
    target["max_model_len"] = max(target["max_model_len"], cfg["extract"]["max_len"] + 1)
    return target_server(cfg, model_path, log_path, capture_args(layer_ids, storage_dir),
                         target=target)


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
        return states[:len(ids)]
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
    if saved[:len(ids)] == ids:
        return "same"
    if len(saved) == len(ids) - 1 and saved == ids[:-1]:
        return "one short"
    return None


def remove_request(path: Path) -> None:
    for p in (path, request_lock(path)):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


async def prefill(client: httpx.AsyncClient, ids: list[int], path: Path, timeout: float,
                  max_retries: int, health_check=None) -> None:
    """One prefill request whose states the connector saves to ``path``; ``health_check`` (the
    server process's) runs after every failed attempt and ends the retries of a dead server."""
    payload = {"model": "target", "prompt": list(ids), "max_tokens": 1, "temperature": 0.0,
               "kv_transfer_params": {"hidden_states_path": str(path)}}
    try:
        body = await with_retries(
            lambda: post_json(client, "/v1/completions", payload, timeout), max_retries,
            health_check=health_check)
    except RequestFailed as exc:
        raise ExtractionError(f"prefill request failed: {exc}") from exc
    saved = (body.get("kv_transfer_params") or {}).get("hidden_states_path")
    if saved is None:
        raise ExtractionError(
            "the server answered without kv_transfer_params.hidden_states_path: it runs "
            "without eaglet's capture options (extract.backend: vllm starts its own server; "
            "server.url is not used for extraction)")
    if Path(saved) != path:  # a connector that ignores the requested path
        await asyncio.to_thread(_move_when_written, Path(saved), path)


async def prefill_each(url: str, work: list[tuple[list[int], Path]], concurrency: int,
                       timeout: float, max_retries: int, after, health_check=None,
                       before=None) -> None:
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


def split_states(states: torch.Tensor, layer_ids: list[int], aux_layer_ids: list[int],
                 norm: FinalNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """Aux [N, 3H] (in aux id order, repeats allowed) and final-norm [N, H] states from the
    saved [N, layers, H] (layers in ``layer_ids`` order, the last being L)."""
    aux = torch.cat([states[:, layer_ids.index(i)] for i in aux_layer_ids], dim=-1)
    return aux, norm(states[:, -1])


# -- shards ----------------------------------------------------------------------------------

@dataclass
class ShardJob:
    """One shard to write: its samples, its final paths and its staging paths."""
    label: str
    records: list[dict]
    shard_path: Path
    meta_path: Path
    staged_path: Path
    staged_meta_path: Path


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
        return ", ".join(f"{name} {s:.1f} s" for name, s in
                         sorted(self.seconds.items(), key=lambda kv: -kv[1]))


@dataclass
class ShardPacker:
    """One shard's states as its sequences come in, in order: split and normed, the teacher
    check's chunks computed as soon as their rows are there; :meth:`finish` writes it."""
    job: ShardJob
    target: Target
    ext: dict
    aux_layer_ids: list[int]
    layer_ids: list[int]
    norm: FinalNorm
    identity: dict
    head: TeacherHead
    got: ShardStates = field(init=False)
    teacher: ShardTeacher = field(init=False)

    def __post_init__(self) -> None:
        seqs, masks, truncated = [], [], 0
        for record in self.job.records:
            ids, mask, cut = sequence(record, self.ext["max_len"])
            seqs.append(ids)
            masks.append(mask)
            truncated += cut
        self.got = ShardStates(self.job.records, seqs, masks, truncated, [], [], time.monotonic())
        self.teacher = ShardTeacher(self.head, self.ext["dtype"], sum(map(len, seqs)))

    @property
    def complete(self) -> bool:
        return len(self.got.aux_rows) == len(self.got.seqs)

    def add(self, states: torch.Tensor, times: PartTimes) -> None:
        """The next sequence's saved states [n, layers, H]."""
        k = len(self.got.aux_rows)
        with times.part("states"):
            aux, final = split_states(states, self.layer_ids, self.aux_layer_ids, self.norm)
        self.got.aux_rows.append(aux)
        self.got.final_rows.append(final)
        with times.part("teacher"):
            self.teacher.add(final, self.got.seqs[k], self.got.masks[k])

    def finish(self, captured_during_generation: int, times: PartTimes) -> dict:
        """Write the shard and its sidecar to their staging paths; raise below the teacher
        agreement threshold (as :func:`write_shard`)."""
        with times.part("teacher"):
            teacher = self.teacher.finish()
        self.job.staged_path.parent.mkdir(parents=True, exist_ok=True)
        with times.part("writing"):
            return write_shard(self.target, self.got, self.ext, self.aux_layer_ids,
                               self.identity, self.job.staged_path, self.job.staged_meta_path,
                               backend="vllm", teacher=teacher,
                               captured_during_generation=captured_during_generation)


class Extractor:
    """Serves the target with capture on first use and computes the states of sequences."""

    # the packing thread yields the CPU to the server's (see _yield_cpu)
    low_priority = True

    def __init__(self, cfg: dict, model_path: str, layer_ids: list[int], work_dir: Path,
                 server_log: str | os.PathLike, progress: Progress | None):
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

        self.stream([r["id"] for r in records], seqs,
                    [request_path(self.requests, r["id"]) for r in records], keep, progress)
        return [r[0] for r in rows], [r[1] for r in rows]

    def stream(self, sample_ids: list[str], seqs: list[list[int]], paths: list[Path],
               consume, progress: Progress | None, ahead: list[int] | None = None) -> None:
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
            log.info("%d of %d sequences have no saved states: sending them as prefill "
                     "requests", len(missing), len(seqs))
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
                        f"server log {self.server.log_path}")
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
                tasks.append(asyncio.ensure_future(prefill_each(
                    self.server.url, [(seqs[i], paths[i]) for i in missing],
                    self.cfg["extract"]["concurrency"], gen["request_timeout_s"],
                    gen["max_retries"], after, health_check=self.server.check_alive, **hooks)))
            try:
                pending = set(tasks)
                while pending:  # the first failure ends both sides
                    done, pending = await asyncio.wait(pending,
                                                       return_when=asyncio.FIRST_EXCEPTION)
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
        return sum(r.get("hidden_states") == "saved" and r["id"] not in self.prefilled
                   for r in records)


def pack_shards(extractor: Extractor, jobs: list[ShardJob], target: Target, ext: dict,
                aux_layer_ids: list[int], identity: dict, progress: Progress | None
                ) -> list[dict]:
    """Write the shards of ``jobs`` to their staging paths: the sequences of all of them
    streamed in order through ``extractor``'s one request window (:meth:`Extractor.stream`),
    each shard checked and written by the packing thread as soon as its last sequence is in,
    its request files then removed; the sidecars' records, in ``jobs`` order."""
    if not jobs:
        return []
    head = TeacherHead(target.lm_head)
    packers = [ShardPacker(job, target, ext, aux_layer_ids, extractor.layer_ids, extractor.norm,
                           identity, head) for job in jobs]
    owner = [p for p in packers for _ in p.got.seqs]
    # request i of shard j waits until shard j-2 is written: the window runs at most one
    # shard ahead of the shard being packed
    ends = [0, *itertools.accumulate(len(p.got.seqs) for p in packers)]
    ahead = [ends[max(j - 1, 0)] for j, p in enumerate(packers) for _ in p.got.seqs]
    metas: list[dict] = []
    last = [time.monotonic()]  # when the previous shard was written

    def consume(i: int, states: torch.Tensor) -> None:
        packer = owner[i]
        if not packer.got.aux_rows:  # a shard's time runs from the end of the one before
            packer.got.started = last[0]
        packer.add(states, extractor.times)
        if not packer.complete:
            return
        job = packer.job
        meta = packer.finish(extractor.captured_during_generation(job.records),
                             extractor.times)
        packer.got = None  # the states of the next shard take its place
        for record in job.records:  # packed: the per-request files are not needed again
            remove_request(request_path(extractor.requests, record["id"]))
        log.info("%s: %d samples, %d tokens, %.0f tokens/s, teacher agreement %s",
                 job.label, meta["num_samples"], meta["tokens"], meta["tokens_per_s"] or 0,
                 _fmt(meta["teacher"]["agreement"]))
        metas.append(meta)
        last[0] = time.monotonic()

    records = [r for job in jobs for r in job.records]
    extractor.stream([r["id"] for r in records], [s for p in packers for s in p.got.seqs],
                     [request_path(extractor.requests, r["id"]) for r in records], consume,
                     progress, ahead)
    return metas


def extract_shards(cfg: dict, info: dict, jobs: list[ShardJob], work_dir: Path,
                   server_log: str | os.PathLike, progress: Progress | None = None,
                   server: VLLMServer | None = None, stats: dict | None = None) -> list[dict]:
    """Write every shard of ``jobs`` with one server (started only if some shard needs it,
    unless a running ``server`` with the capture options of :func:`capture_server` for
    ``<work_dir>/requests`` is given) and move them to their final names; returns the
    shards' records. ``stats`` gets whether the server was started and the packing
    thread's seconds per part."""
    ext = cfg["extract"]
    head = load_head(info["path"], cfg["target"]["dtype"])
    target, norm = Target.from_head(head, ext["device"]), head.norm
    aux_ids = resolve_aux_layer_ids(ext["aux_layer_ids"], target.num_layers)
    layer_ids = capture_layer_ids(aux_ids, target.num_layers)
    identity = target_identity(info)
    expected = {"aux_layer_ids": aux_ids, "dtype": ext["dtype"], "target": identity}
    todo = [job for job in jobs if staged_problem(job, expected, ext["max_len"])]
    needed = sum(estimate_bytes(job.records, ext["max_len"], target.hidden_size, ext["dtype"])
                 for job in todo) + request_bytes(todo, ext["max_len"], len(layer_ids),
                                                  target.hidden_size, cfg["target"]["dtype"])
    check_disk(work_dir, needed)
    if progress is not None:
        progress.restart(already_done=sum(len(j.records) for j in jobs if j not in todo))
    extractor = Extractor(cfg, info["path"], layer_ids, work_dir, server_log, progress)
    extractor.norm = norm
    if server is not None:
        extractor.server, extractor.started = server, True
    metas: dict[int, dict] = {}
    for index, job in enumerate(jobs):
        if job not in todo:
            log.info("%s: packed by an earlier run, kept", job.label)
            metas[index] = read_json(job.staged_meta_path)
            enforce_agreement(metas[index], ext["min_teacher_agreement"])
            for record in job.records:  # states saved again (by generation) are not needed
                remove_request(request_path(extractor.requests, record["id"]))
    with contextlib.ExitStack() as stack:
        extractor.stack = stack
        written = pack_shards(extractor, todo, target, ext, aux_ids, identity, progress)
    metas.update(zip([i for i, job in enumerate(jobs) if job in todo], written))
    if extractor.times.seconds:
        log.info("packing thread: %s", extractor.times.summary())
    if extractor.started and server is None:
        rates.record(RATE_PREFILL, info["spec"], server_start_s=extractor.server.ready_after_s)
    if stats is not None:
        stats["server_started"] = extractor.started
        stats["parts_s"] = dict(extractor.times.seconds)
    for job in jobs:  # all shards are good: give them their final names
        job.shard_path.parent.mkdir(parents=True, exist_ok=True)
        publish(job.staged_path, job.shard_path)
        publish(job.staged_meta_path, job.meta_path)
    # shards packed for an earlier run's jobs (another shard count, another split) hold disk
    # that no output shares any more
    current = {p for job in jobs for p in (job.staged_path, job.staged_meta_path)}
    for path in (work_dir / "shards").rglob("shard_*"):
        if path not in current:
            path.unlink(missing_ok=True)
    return [metas[i] for i in range(len(jobs))]


def publish(staged: Path, final: Path) -> None:
    """Give a packed shard (or its record) its final name and keep the packed name too: a
    hard link, the same bytes on disk under both. Snakemake deletes a job's outputs before it
    runs the job again (one damaged shard, one edited prompt), so without the packed name
    every intact shard was extracted again, hours of a real run; with it the rerun finds them
    packed, checks each by its digest and keeps those that match. Where the filesystem has no
    hard links, the shard is moved, as before."""
    final.unlink(missing_ok=True)
    try:
        os.link(staged, final)
    except OSError:
        os.replace(staged, final)


def request_bytes(jobs: list[ShardJob], max_len: int, layers: int, hidden: int,
                  dtype: str) -> int:
    """The most the request files the server saves hold at once: every captured layer of
    every token, in the served dtype, for the two largest shards (the request window runs at
    most one shard ahead of the one being packed)."""
    width = BYTES.get(dtype, 2)  # auto: counted as bfloat16
    tokens = sorted((sum(min(len(r["prompt_token_ids"]) + len(r["completion_token_ids"]),
                             max_len) for r in job.records) for job in jobs), reverse=True)
    return sum(tokens[:2]) * layers * hidden * width


def staged_problem(job: ShardJob, expected: dict, max_len: int) -> str | None:
    """Why a shard packed by an earlier run cannot be used for ``job``, or None."""
    problem = shard_problem(job.staged_meta_path, job.staged_path, expected)
    if problem:
        return problem
    meta = read_json(job.staged_meta_path)
    tokens = sum(min(len(r["prompt_token_ids"]) + len(r["completion_token_ids"]), max_len)
                 for r in job.records)
    if meta["samples"] != [r["id"] for r in job.records] or meta["tokens"] != tokens:
        return "it holds other samples or sequences (the synthetic data or max_len changed)"
    return None


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def shard_jobs(records: list[dict], num_shards: int, shard_paths: list[str],
               meta_paths: list[str], work_dir: Path, split: str) -> list[ShardJob]:
    """Jobs of one split's shards (contiguous blocks of its records, as the hf backend)."""
    jobs = []
    for index, (shard, meta) in enumerate(zip(shard_paths, meta_paths)):
        staged = work_dir / "shards" / split / Path(shard).name
        jobs.append(ShardJob(f"{split} shard {index}", shard_records(records, num_shards, index),
                             Path(shard), Path(meta), staged, staged.with_suffix(".json")))
    empty = [j.label for j in jobs if not j.records]
    if empty:
        setting = "num_eval_shards" if split == "eval" else "num_shards"
        raise ExtractionError(f"{', '.join(empty)} of {num_shards} would hold no samples: lower "
                              f"extract.{setting} to at most the number of {split} samples")
    return jobs


def run_stage(cfg: dict, target_json: str, splits: dict[str, dict], work_dir: str,
              server_log: str, progress_path: str | None = None,
              log_path: str | None = None) -> list[dict]:
    """The ``extract_vllm`` rule: every shard of every split (``splits`` maps a split name to
    its ``data`` file and its ``shards`` and ``metas`` paths) with one server."""

    info = read_json(target_json)
    work = Path(work_dir)
    jobs = []
    for split, files in splits.items():
        records = read_jsonl(files["data"])
        jobs += shard_jobs(records, len(files["shards"]), files["shards"], files["metas"], work,
                           split)
    total = sum(len(j.records) for j in jobs)
    progress = Progress("extract", total=total, path=progress_path, log_path=log_path)
    started = time.monotonic()
    stats: dict = {}
    with hold_directory(work, "extract_vllm"):  # its request files and shards in the making
        try:
            metas = extract_shards(cfg, info, jobs, work, server_log, progress, stats=stats)
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise
            free = shutil.disk_usage(work).free
            where = error.filename or "a shard or a request file"
            raise ExtractionError(
                f"the disk of {work} filled up while extracting ({where}: {error.strerror}); "
                f"{free / 2**30:.2f} GiB free now. The "
                f"shards packed so far are kept under {work / 'shards'} and the saved requests "
                f"under {work / 'requests'}: free space (or point results_dir at a larger disk, "
                f"or store fp8 shards, extract.dtype: fp8) and rerun to go on from there.") \
                from None
    run = progress.report("finished")
    if run["done"] > run["resumed_from"]:  # prefill and packing run at rates of their own
        rates.record(RATE_PREFILL if stats["server_started"] else RATE_PACK, info["spec"],
                     settings=rates.prefill_settings(cfg) if stats["server_started"] else None,
                     tokens_per_s=run["tokens_per_s"])
    log.info("%d shards, %d samples, %d tokens in %.0f s", len(metas),
             sum(m["num_samples"] for m in metas), sum(m["tokens"] for m in metas),
             time.monotonic() - started)
    return metas
