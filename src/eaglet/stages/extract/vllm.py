"""The ``vllm`` extraction backend: the serving engine computes the hidden states.

One vLLM server, started with the generation's target settings plus the capture options
(:mod:`eaglet.engine.capture`: ``extract_hidden_states`` speculation and
:mod:`eaglet.engine.connector`), serves every shard of the run. Each training sequence is one
prefill request (``/v1/completions`` with the token ids as the prompt and ``max_tokens`` 1);
the connector saves the states of every prompt token to
``<work>/requests/<sample>.safetensors``: the aux layers and layer L (the last decoder layer's
output before the final norm). The final state stored for the teacher is
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

import contextlib
import errno
import itertools
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eaglet.core import rates
from eaglet.core.dtypes import BYTES
from eaglet.core.io import hold_directory, read_json, read_jsonl, request_path
from eaglet.core.layout import SHARD_GLOB
from eaglet.core.progress import Progress
from eaglet.engine.capture import (
    Extractor,
    PartTimes,
    capture_layer_ids,
    remove_request,
    split_states,
)
from eaglet.engine.server import VLLMServer
from eaglet.target.checkpoint import load_head, read_target
from eaglet.target.norm import FinalNorm
from eaglet.target.states import (
    ExtractionError,
    ShardStates,
    ShardTeacher,
    Target,
    TeacherHead,
    check_disk,
    enforce_agreement,
    estimate_bytes,
    resolve_aux_layer_ids,
    sequence,
    shard_problem,
    shard_records,
    stored_tokens,
    target_identity,
    write_shard,
)

log = logging.getLogger("eaglet.stages.extract.vllm")

# the rates `eaglet status` estimates this stage from: sequences sent as prefill requests, or
# states that generation captured, only packed


@dataclass
class StagedShard:
    """One shard this backend writes: its samples, its final paths and the staging paths it
    is packed to first (kept for a rerun: :func:`publish`)."""

    label: str
    records: list[dict]
    shard_path: Path
    meta_path: Path
    staged_path: Path
    staged_meta_path: Path


@dataclass
class ShardPacker:
    """One shard's states as its sequences come in, in order: split and normed, the teacher
    check's chunks computed as soon as their rows are there; :meth:`finish` writes it."""

    job: StagedShard
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
            return write_shard(
                self.target,
                self.got,
                self.ext,
                self.aux_layer_ids,
                self.identity,
                self.job.staged_path,
                self.job.staged_meta_path,
                backend="vllm",
                teacher=teacher,
                captured_during_generation=captured_during_generation,
            )


def pack_shards(
    extractor: Extractor,
    jobs: list[StagedShard],
    target: Target,
    ext: dict,
    aux_layer_ids: list[int],
    identity: dict,
    progress: Progress | None,
) -> list[dict]:
    """Write the shards of ``jobs`` to their staging paths: the sequences of all of them
    streamed in order through ``extractor``'s one request window (:meth:`Extractor.stream`),
    each shard checked and written by the packing thread as soon as its last sequence is in,
    its request files then removed; the sidecars' records, in ``jobs`` order."""
    if not jobs:
        return []
    head = TeacherHead(target.lm_head)
    packers = [
        ShardPacker(
            job, target, ext, aux_layer_ids, extractor.layer_ids, extractor.norm, identity, head
        )
        for job in jobs
    ]
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
        meta = packer.finish(extractor.captured_during_generation(job.records), extractor.times)
        packer.got = None  # the states of the next shard take its place
        for record in job.records:  # packed: the per-request files are not needed again
            remove_request(request_path(extractor.requests, record["id"]))
        log.info(
            "%s: %d samples, %d tokens, %.0f tokens/s, teacher agreement %s",
            job.label,
            meta["num_samples"],
            meta["tokens"],
            meta["tokens_per_s"] or 0,
            _fmt(meta["teacher"]["agreement"]),
        )
        metas.append(meta)
        last[0] = time.monotonic()

    records = [r for job in jobs for r in job.records]
    extractor.stream(
        [r["id"] for r in records],
        [s for p in packers for s in p.got.seqs],
        [request_path(extractor.requests, r["id"]) for r in records],
        consume,
        progress,
        ahead,
    )
    return metas


def capture_shards(
    cfg: dict,
    info: dict,
    jobs: list[StagedShard],
    work_dir: Path,
    server_log: str | os.PathLike,
    progress: Progress | None = None,
    server: VLLMServer | None = None,
    stats: dict | None = None,
) -> list[dict]:
    """Write every shard of ``jobs`` with one capture server (started only if some shard
    needs it, unless a running ``server`` with the capture options of
    :func:`eaglet.engine.capture.capture_server` for ``<work_dir>/requests`` is given) and
    move them to their final names; returns the shards' records. ``stats`` gets whether the
    server was started and the packing thread's seconds per part."""
    ext = cfg["extract"]
    head = load_head(info["path"], cfg["target"]["dtype"])
    target, norm = Target.from_head(head, ext["device"]), head.norm
    aux_ids = resolve_aux_layer_ids(ext["aux_layer_ids"], target.num_layers)
    layer_ids = capture_layer_ids(aux_ids, target.num_layers)
    identity = target_identity(info)
    expected = {"aux_layer_ids": aux_ids, "dtype": ext["dtype"], "target": identity}
    todo = [job for job in jobs if staged_problem(job, expected, ext["max_len"])]
    needed = sum(
        estimate_bytes(job.records, ext["max_len"], target.hidden_size, ext["dtype"])
        for job in todo
    ) + request_bytes(
        todo, ext["max_len"], len(layer_ids), target.hidden_size, cfg["target"]["dtype"]
    )
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
        rates.record(rates.PREFILL, info["spec"], server_start_s=extractor.server.ready_after_s)
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
    for path in (work_dir / "shards").rglob(SHARD_GLOB):
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


def request_bytes(
    jobs: list[StagedShard], max_len: int, layers: int, hidden: int, dtype: str
) -> int:
    """The most the request files the server saves hold at once: every captured layer of
    every token, in the served dtype, for the two largest shards (the request window runs at
    most one shard ahead of the one being packed)."""
    width = BYTES.get(dtype, 2)  # auto: counted as bfloat16
    tokens = sorted((stored_tokens(job.records, max_len) for job in jobs), reverse=True)
    return sum(tokens[:2]) * layers * hidden * width


def staged_problem(job: StagedShard, expected: dict, max_len: int) -> str | None:
    """Why a shard packed by an earlier run cannot be used for ``job``, or None."""
    problem = shard_problem(job.staged_meta_path, job.staged_path, expected)
    if problem:
        return problem
    meta = read_json(job.staged_meta_path)
    tokens = stored_tokens(job.records, max_len)
    if meta["samples"] != [r["id"] for r in job.records] or meta["tokens"] != tokens:
        return "it holds other samples or sequences (the synthetic data or max_len changed)"
    return None


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def staged_shards(
    records: list[dict],
    num_shards: int,
    shard_paths: list[str],
    meta_paths: list[str],
    work_dir: Path,
    split: str,
) -> list[StagedShard]:
    """The shards of one split (contiguous blocks of its records, as the hf backend)."""
    jobs = []
    for index, (shard, meta) in enumerate(zip(shard_paths, meta_paths)):
        staged = work_dir / "shards" / split / Path(shard).name
        jobs.append(
            StagedShard(
                f"{split} shard {index}",
                shard_records(records, num_shards, index),
                Path(shard),
                Path(meta),
                staged,
                staged.with_suffix(".json"),
            )
        )
    empty = [j.label for j in jobs if not j.records]
    if empty:
        setting = "num_eval_shards" if split == "eval" else "num_shards"
        raise ExtractionError(
            f"{', '.join(empty)} of {num_shards} would hold no samples: lower "
            f"extract.{setting} to at most the number of {split} samples"
        )
    return jobs


def run_stage(
    cfg: dict,
    target_json: str,
    splits: dict[str, dict],
    work_dir: str,
    server_log: str,
    progress_path: str | None = None,
    log_path: str | None = None,
) -> list[dict]:
    """The ``extract_vllm`` rule: every shard of every split (``splits`` maps a split name to
    its ``data`` file and its ``shards`` and ``metas`` paths) with one server."""

    info = read_target(target_json)
    work = Path(work_dir)
    jobs = []
    for split, files in splits.items():
        records = read_jsonl(files["data"])
        jobs += staged_shards(
            records, len(files["shards"]), files["shards"], files["metas"], work, split
        )
    total = sum(len(j.records) for j in jobs)
    plan = {
        "kind": "prefill",
        "servers": 1,
        "shards": len(jobs),
        "samples": total,
        "tokens": sum(stored_tokens(j.records, cfg["extract"]["max_len"]) for j in jobs),
    }
    progress = Progress("extract", total=total, path=progress_path, log_path=log_path, plan=plan)
    started = time.monotonic()
    stats: dict = {}
    with hold_directory(work, "extract_vllm"):  # its request files and shards in the making
        try:
            metas = capture_shards(cfg, info, jobs, work, server_log, progress, stats=stats)
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
                f"or store fp8 shards, extract.dtype: fp8) and rerun to go on from there."
            ) from None
    run = progress.report("finished")
    if run["done"] > run["resumed_from"]:  # prefill and packing run at rates of their own
        rates.record(
            rates.PREFILL if stats["server_started"] else rates.PACK,
            info["spec"],
            settings=rates.prefill_settings(cfg) if stats["server_started"] else None,
            tokens_per_s=run["tokens_per_s"],
        )
    log.info(
        "%d shards, %d samples, %d tokens in %.0f s",
        len(metas),
        sum(m["num_samples"] for m in metas),
        sum(m["tokens"] for m in metas),
        time.monotonic() - started,
    )
    return metas
