"""Hidden-state extraction: run the target over every training sequence and keep what the
drafter learns from.

One Snakemake job per shard. Only the layers the drafter reads are captured, with forward
pre-hooks (aux id ``i`` is the *input* of decoder layer ``i``, i.e. HF ``hidden_states[i]``),
plus the final-norm output that the target's lm_head reads. Sequences are the exact
``prompt_token_ids + completion_token_ids`` the server saw and emitted, run in token-budget
batches sorted by length, and packed into the shard without padding.

Every shard is checked against the server: the teacher's argmax, computed from the stored
(cast) final state, must reproduce the greedy tokens the server generated.

This module is the ``hf`` backend (the target run by transformers): the ``extract`` rule (one
shard) and ``extract_all`` (every shard from one job, the target loaded once). The checks and
the shard write both backends share are in :mod:`eaglet.target.states`, the ``vllm`` backend in
:mod:`eaglet.stages.extract.vllm`, the manifest over the shards of either in
:mod:`eaglet.stages.extract.manifest`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglet.core import rates
from eaglet.core.dtypes import torch_dtype
from eaglet.core.io import read_jsonl
from eaglet.core.progress import Progress
from eaglet.data import shards
from eaglet.target.checkpoint import load_text_config, read_target
from eaglet.target.hooks import AuxCapture, decoder_layers
from eaglet.target.states import (
    ExtractionError,
    ShardStates,
    Target,
    TeacherHead,
    check_disk,
    estimate_bytes,
    packed_sequences,
    pick_device,
    predicting_rows,
    record_shard,
    resolve_aux_layer_ids,
    sequence,
    shard_records,
    stored_tokens,
    target_identity,
    teacher_check,
)

log = logging.getLogger("eaglet.stages.extract.hf")


def token_budget_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped so that (longest in batch) x (batch size) <= batch_tokens, longest
    first; a sequence longer than the budget runs alone."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and longest * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def load_target(
    path: str, dtype: str, device: str = "auto", trust_remote_code: bool = False
) -> Target:
    from transformers import AutoModelForCausalLM

    if device == "sharded":  # split across every visible GPU (accelerate's device_map)
        log.info("loading the target %s in %s across the visible devices", path, dtype)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype(dtype), trust_remote_code=trust_remote_code, device_map="auto"
        )
        dev = model.get_input_embeddings().weight.device  # where the input ids go
        model.eval()
    else:
        dev = pick_device(device)
        log.info("loading the target %s in %s on %s", path, dtype, dev)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype(dtype), trust_remote_code=trust_remote_code
        )
        model.to(dev).eval()
    config = model.config.get_text_config()
    lm_head = model.get_output_embeddings().weight.detach()
    return Target(
        model, lm_head, dev, config.num_hidden_layers, config.hidden_size, lm_head.shape[0]
    )


def right_padded(seqs: list[list[int]], device: torch.device) -> torch.Tensor:
    """Input ids [B, T], padded with 0 on the right. On a GPU they are built in pinned memory
    and sent without blocking: a copy from pageable memory would wait for the forward pass
    still running. No attention mask goes with them: attention is causal, so a real token
    never sees the padding after it, and the padding's own states are dropped."""
    return _to_device([_padded_host(seqs)], device)[0]


def _padded_host(seqs: list[list[int]]) -> torch.Tensor:
    longest = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = torch.tensor(s)
    return ids


def _to_device(tensors, device: torch.device) -> list[torch.Tensor]:
    if device.type != "cuda":
        return [t.to(device) for t in tensors]
    # the caching host allocator keeps a pinned block until the copy reading it is done
    return [t.pin_memory().to(device, non_blocking=True) for t in tensors]


def packed_rows(lengths: list[int], longest: int) -> torch.Tensor:
    """Row indices, in a right-padded batch flattened to [B * T], of every real token, sample
    after sample: what the packed states keep."""
    return torch.cat([torch.arange(n) + row * longest for row, n in enumerate(lengths)])


@torch.inference_mode()
def forward_batch(
    target: Target, capture: AuxCapture, seqs: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The aux states [sum L, 3H] and final-norm states [sum L, H] of one right-padded batch,
    each packed on the device without padding, sample after sample. Nothing here waits for
    the device: the padding is dropped by a gather whose indices the host knows, and no
    attention mask is passed (so transformers has no mask to inspect), so the host queues
    the next batch while this one runs."""
    lengths = [len(s) for s in seqs]
    ids, rows = _to_device([_padded_host(seqs), packed_rows(lengths, max(lengths))], target.device)
    out = target.model.get_decoder()(input_ids=ids, use_cache=False)
    final = out.last_hidden_state  # [B, T, H], after the final norm
    parts = capture.take()  # the 3 aux states
    hidden = final.shape[-1]
    aux = torch.empty(rows.numel(), len(parts) * hidden, dtype=final.dtype, device=final.device)
    index = {rows.device: rows}

    def gather(
        part: torch.Tensor,
    ) -> torch.Tensor:  # a sharded target's parts lie on several devices
        if part.device not in index:
            index[part.device] = rows.to(part.device, non_blocking=True)
        return part.reshape(-1, hidden)[index[part.device]]

    for k, part in enumerate(parts):
        aux[:, k * hidden : (k + 1) * hidden] = gather(part)
    return aux, gather(final)


def stored_states(aux: torch.Tensor, final: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """A batch's states as the shard stores them (cast, or quantized to fp8 with their
    scales), on the device they were computed on: the shard's fields by name."""
    if dtype == "fp8":
        aux_q, aux_scale = shards.quantize_fp8(aux, aux.shape[1] // final.shape[1])
        final_q, final_scale = shards.quantize_fp8(final, 1)
        return {
            "aux_hidden": aux_q,
            "aux_scale": aux_scale,
            "final_hidden": final_q,
            "final_scale": final_scale,
        }
    stored = shards.STORAGE_DTYPES[dtype]
    return {"aux_hidden": aux.to(stored), "final_hidden": final.to(stored)}


class BatchWriter:
    """Writes each batch's stored states (and its teacher) into the shard file from a thread
    of its own, while the device runs the next batch.

    :meth:`put` takes one batch's tensors (a dict by shard field, rows packed sample after
    sample) and where each of its samples goes in the shard. ``staged`` (the default on a
    GPU): the tensors are copied, without blocking, into one of ``depth`` page-locked host
    buffers on a side stream that waits for the forward that made them; the thread waits for
    that copy, writes the rows at their places in the file and frees the buffer, so at most
    ``depth`` batches are in flight and nothing pinned outlives the shard. Unstaged (CPU),
    the thread writes the tensors as they are. ``teacher_argmax``/``teacher_logprob`` are not
    written but gathered into :attr:`argmax`/:attr:`logprob` (the shard's rows [N]), which
    the caller writes once every batch is in. The first error in the thread is raised by the
    next :meth:`put` or by :meth:`finish`. ``overlap`` False writes each batch in :meth:`put`
    itself, the device waiting meanwhile (what the thread buys, for benchmarks)."""

    TEACHER = ("teacher_argmax", "teacher_logprob")

    def __init__(
        self,
        out: shards.ShardFile,
        num_rows: int,
        capacity_rows: int,
        device: torch.device,
        depth: int = 2,
        staged: bool | None = None,
        done=None,
        overlap: bool = True,
    ):
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self.out, self.capacity, self.done = out, capacity_rows, done
        self.cuda = device.type == "cuda"
        self.staged = self.cuda if staged is None else staged
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.argmax = torch.full((num_rows,), -1, dtype=torch.int64)
        self.logprob = torch.full((num_rows,), float("nan"), dtype=torch.float32)
        self.slots: list[dict[str, torch.Tensor]] = (
            [{} for _ in range(depth)] if self.staged else []
        )
        self.free: queue.Queue = queue.Queue()
        for slot in range(len(self.slots)):
            self.free.put(slot)
        self.work: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="shard-writer", daemon=True)
        self.overlap = overlap
        if overlap:
            self.thread.start()

    def put(
        self,
        tensors: dict[str, torch.Tensor],
        places: list[tuple[int, int, int]],
        teacher_rows: torch.Tensor,
        info=None,
    ) -> None:
        """One batch: ``places`` (shard row, first row in the batch, rows) per sample;
        ``teacher_rows`` the shard rows of the teacher's values, in their order."""
        self._raise()
        if not self.staged:
            self._queue((tensors, None, None, places, teacher_rows, info))
            return
        slot = self._take_slot()
        host = self.slots[slot]
        event = None
        if self.cuda:
            made = torch.cuda.Event()
            made.record(torch.cuda.current_stream(next(iter(tensors.values())).device))
            self.stream.wait_event(made)
        with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
            for name, t in tensors.items():
                if name not in host:
                    rows = self.capacity
                    host[name] = torch.empty(
                        (rows, *t.shape[1:]), dtype=t.dtype, pin_memory=self.cuda
                    )
                host[name][: t.shape[0]].copy_(t, non_blocking=self.cuda)
            if self.cuda:
                event = torch.cuda.Event()
                event.record(self.stream)
        # the device tensors are kept until their copy is done: then their memory may go
        views = {name: host[name][: t.shape[0]] for name, t in tensors.items()}
        self._queue((views, event, slot, places, teacher_rows, (info, tensors)))

    def _take_slot(self) -> int:
        while True:
            try:
                return self.free.get(timeout=0.5)
            except queue.Empty:
                self._raise()

    def _queue(self, item) -> None:
        if not self.overlap:  # written here and now
            self.work.put(item)
            self.work.put(None)
            self._run()
            self._raise()
            return
        while True:
            try:
                self.work.put(item, timeout=0.5)
                return
            except queue.Full:
                self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        while (item := self.work.get()) is not None:
            tensors, event, slot, places, teacher_rows, info = item
            try:
                if self.error is None:
                    if event is not None:
                        event.synchronize()
                    self._write(tensors, places, teacher_rows)
                    if self.done is not None:
                        self.done(places, info)
            except BaseException as error:  # kept for the caller; later batches are dropped
                self.error = error
            finally:
                del tensors, info
                if slot is not None:
                    self.free.put(slot)

    def _write(self, tensors: dict[str, torch.Tensor], places, teacher_rows) -> None:
        for name, t in tensors.items():
            if name in self.TEACHER:
                continue
            for row, start, count in places:
                self.out.write(name, row, t[start : start + count])
        if "teacher_argmax" in tensors and teacher_rows.numel():
            self.argmax[teacher_rows] = tensors["teacher_argmax"]
            self.logprob[teacher_rows] = tensors["teacher_logprob"]

    def finish(self) -> None:
        """Wait for every batch put; raise the thread's error, if any."""
        if self.overlap:
            self.work.put(None)
            self.thread.join()
        self._raise()


def plan_shard(records: list[dict], max_len: int) -> ShardStates:
    """A shard's sequences (cut at ``max_len``), before any state is computed."""
    seqs, masks, truncated = [], [], 0
    for record in records:
        ids, mask, cut = sequence(record, max_len)
        seqs.append(ids)
        masks.append(mask)
        truncated += cut
    return ShardStates(records, seqs, masks, truncated, [], [], time.monotonic())


@dataclass
class OpenShard:
    """A shard whose states are all computed and on their way to disk: what
    :func:`finish_shard` checks, closes and records."""

    plan: ShardStates
    out: shards.ShardFile
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    offsets: torch.Tensor
    argmax: torch.Tensor
    logprob: torch.Tensor


def stream_shard(
    target: Target,
    records: list[dict],
    cfg: dict,
    aux_layer_ids: list[int],
    identity: dict,
    shard_path: str | os.PathLike,
    progress: Progress | None = None,
    depth: int = 2,
    staged: bool | None = None,
    overlap: bool = True,
) -> OpenShard:
    """Run the target over one shard's sequences and stream their states into the shard file.

    Batches run longest first (token-budget batches); each batch's states are cast (or
    quantized) to the storage dtype and the teacher check's full-vocabulary head is applied to
    its stored final states on the device, then a :class:`BatchWriter` copies them to the host
    and writes every sample's rows at its place in the file while the next batch runs, and the
    file is digested block by block as its blocks fill (:class:`eaglet.data.shards.ShardFile`).
    Returns the shard with every state written; :func:`finish_shard` closes it."""
    plan = plan_shard(records, cfg["max_len"])
    input_ids, loss_mask, offsets = packed_sequences(plan.seqs, plan.masks)
    predicting = predicting_rows(loss_mask, offsets)
    next_ids = torch.roll(input_ids, -1)
    lengths = [len(s) for s in plan.seqs]
    starts = offsets[:-1].tolist()
    fields = [
        *shards.state_fields(len(input_ids), target.hidden_size, len(aux_layer_ids), cfg["dtype"]),
        shards.Field("offsets", torch.int64, (offsets.numel(),)),
    ]
    metadata = shards.shard_metadata(
        cfg["dtype"], target.hidden_size, aux_layer_ids, [r["id"] for r in records], identity
    )
    out = shards.ShardFile(shard_path, fields, metadata)
    try:
        batches = token_budget_batches(lengths, cfg["batch_tokens"])
        capacity = max((sum(lengths[i] for i in b) for b in batches), default=1)

        def advanced(places, info):
            if progress is not None:
                progress.advance(done=len(places), tokens=sum(n for _, _, n in places))

        writer = BatchWriter(
            out,
            len(input_ids),
            capacity,
            target.device,
            depth,
            staged,
            done=advanced,
            overlap=overlap,
        )
        head = TeacherHead(target.lm_head)
        capture = AuxCapture(decoder_layers(target.model), aux_layer_ids)
        try:
            for batch in batches:
                aux, final = forward_batch(target, capture, [plan.seqs[i] for i in batch])
                tensors = stored_states(aux, final, cfg["dtype"])
                del aux, final
                # the teacher as training will see it: from the stored final states
                shard_rows = torch.cat(
                    [torch.arange(starts[i], starts[i] + lengths[i]) for i in batch]
                )
                local = predicting[shard_rows].nonzero().squeeze(1)
                stored_final = shards.to_float(tensors["final_hidden"], tensors.get("final_scale"))
                index, predicted = _to_device(
                    [local, next_ids[shard_rows[local]]], stored_final.device
                )
                tensors["teacher_argmax"], tensors["teacher_logprob"] = head.on_device(
                    stored_final[index], predicted
                )
                del stored_final
                places, at = [], 0
                for i in batch:
                    places.append((starts[i], at, lengths[i]))
                    at += lengths[i]
                writer.put(tensors, places, shard_rows[local])
                del tensors
        finally:
            capture.close()
            writer.finish()
        return OpenShard(plan, out, input_ids, loss_mask, offsets, writer.argmax, writer.logprob)
    except BaseException:
        out.abort()
        raise


def finish_shard(
    target: Target,
    shard: OpenShard,
    cfg: dict,
    aux_layer_ids: list[int],
    identity: dict,
    shard_path: str | os.PathLike,
    meta_path: str | os.PathLike,
    backend: str = "hf",
) -> dict:
    """Write a streamed shard's token ids, masks, offsets and teacher, check the teacher,
    close the file (digest, fsync, rename) and write its sidecar JSON; raise below the
    teacher-agreement threshold (the shard stays, as :func:`write_shard` leaves it)."""
    out = shard.out
    try:
        out.write("input_ids", 0, shard.input_ids)
        out.write("loss_mask", 0, shard.loss_mask)
        out.write("offsets", 0, shard.offsets)
        out.write("teacher_argmax", 0, shard.argmax)
        check = teacher_check(
            shard.plan.records,
            shard.input_ids,
            shard.loss_mask,
            shard.offsets,
            shard.argmax,
            shard.logprob,
        )
        written = out.close()
    except BaseException:
        out.abort()
        raise
    return record_shard(
        target.hidden_size,
        shard.plan.records,
        shard.plan.truncated,
        shard.input_ids,
        shard.loss_mask,
        written,
        check,
        cfg,
        aux_layer_ids,
        identity,
        shard_path,
        meta_path,
        backend,
        shard.plan.started,
    )


def extract_shard(
    target: Target,
    records: list[dict],
    cfg: dict,
    aux_layer_ids: list[int],
    identity: dict,
    shard_path: str | os.PathLike,
    meta_path: str | os.PathLike,
    progress: Progress | None = None,
    backend: str = "hf",
) -> dict:
    """Extract one shard and its sidecar JSON (:func:`stream_shard`, :func:`finish_shard`);
    raise below the teacher-agreement threshold."""
    shard = stream_shard(target, records, cfg, aux_layer_ids, identity, shard_path, progress)
    return finish_shard(target, shard, cfg, aux_layer_ids, identity, shard_path, meta_path, backend)


# -- the stage -------------------------------------------------------------------------------


def extract_shards(
    target: Target,
    parts: list[tuple[list[dict], str | os.PathLike, str | os.PathLike]],
    cfg: dict,
    aux_layer_ids: list[int],
    identity: dict,
    progress: Progress | None = None,
) -> list[dict]:
    """:func:`extract_shard` for each ``(records, shard_path, meta_path)`` of ``parts`` in
    turn, each shard's last blocks digested, fsynced and recorded in a second thread while the
    next shard's batches run (one shard finishing at a time). The first error raised is raised
    here, once the shard finishing has ended."""
    metas: list[dict] = []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-finish") as finisher:
        finishing = None
        for records, shard_path, meta_path in parts:
            shard = stream_shard(
                target, records, cfg, aux_layer_ids, identity, shard_path, progress
            )
            if finishing is not None:
                metas.append(finishing.result())
            finishing = finisher.submit(
                finish_shard, target, shard, cfg, aux_layer_ids, identity, shard_path, meta_path
            )
            del shard
        if finishing is not None:
            metas.append(finishing.result())
    return metas


@dataclass
class ShardJob:
    """One shard a job writes: shard ``index`` of ``num_shards`` of the samples in ``data``."""

    data: str
    num_shards: int
    index: int
    shard: str
    meta: str


def run_shard(
    cfg: dict,
    target_json: str,
    data_path: str,
    index: int,
    num_shards: int,
    shard_path: str,
    meta_path: str,
    progress_path: str | None = None,
    log_path: str | None = None,
) -> dict:
    """The ``extract`` rule for one shard (``cfg`` holds ``extract`` and ``target``)."""
    return run_shards(
        cfg,
        target_json,
        [ShardJob(data_path, num_shards, index, shard_path, meta_path)],
        progress_path,
        log_path,
        name=f"extract[{index}]",
    )[0]


def run_shards(
    cfg: dict,
    target_json: str,
    jobs: list[ShardJob],
    progress_path: str | None = None,
    log_path: str | None = None,
    name: str = "extract",
) -> list[dict]:
    """Several shards from one job (``extract.jobs: one``; one shard for the ``extract`` rule):
    the target loaded once, the shards extracted by :func:`extract_shards` (each write beside
    the next shard's forward)."""
    ext = cfg["extract"]
    info = read_target(target_json)
    data: dict[str, list[dict]] = {}
    for job in jobs:
        if job.data not in data:
            data[job.data] = read_jsonl(job.data)
    records = [shard_records(data[job.data], job.num_shards, job.index) for job in jobs]
    for job, recs in zip(jobs, records):
        if job.num_shards > len(data[job.data]) and data[job.data]:
            log.warning(
                "%d shards for %d samples: some shards are empty (lower extract.num_shards)",
                job.num_shards,
                len(data[job.data]),
            )
        if not recs:
            held_out = Path(job.shard).parent.name == "eval"
            raise ExtractionError(
                f"{'held-out ' if held_out else ''}shard {job.index} of {job.num_shards} has no "
                f"samples: lower extract.{'num_eval_shards' if held_out else 'num_shards'} to at "
                f"most the number of {'held-out ' if held_out else ''}samples"
            )
    # every shard of each split not yet on disk: its other shards may be written beside this job
    splits = {(Path(job.shard).parent, job.data, job.num_shards) for job in jobs}
    needed = sum(
        estimate_bytes(
            shard_records(data[d], count, i), ext["max_len"], hidden_size_of(info), ext["dtype"]
        )
        for directory, d, count in splits
        for i in range(count)
        if not shards.shard_path(directory, i).exists()
    )
    check_disk(Path(jobs[0].shard).parent, needed)  # before minutes of loading a large model
    target = load_target(
        info["path"],
        cfg["target"]["dtype"],
        ext["device"],
        cfg["target"].get("trust_remote_code", False),
    )
    aux_ids = resolve_aux_layer_ids(ext["aux_layer_ids"], target.num_layers)
    plan = {
        "kind": "prefill",
        "servers": 0,
        "shards": len(jobs),
        "samples": sum(map(len, records)),
        "tokens": sum(stored_tokens(recs, ext["max_len"]) for recs in records),
    }
    progress = Progress(
        name, total=plan["samples"], path=progress_path, log_path=log_path, plan=plan
    )
    started = time.monotonic()
    metas = extract_shards(
        target,
        [(recs, job.shard, job.meta) for job, recs in zip(jobs, records)],
        ext,
        aux_ids,
        target_identity(info),
        progress,
    )
    progress.report("finished")
    tokens = sum(m["tokens"] for m in metas)
    elapsed = time.monotonic() - started
    rates.record(rates.EXTRACT, info["spec"], tokens_per_s=tokens / elapsed if elapsed else None)
    for job, meta in zip(jobs, metas):
        log.info(
            "shard %s: %d samples, %d tokens (%d truncated), %.1f MB, %.0f tokens/s, teacher "
            "agreement %s",
            job.shard,
            meta["num_samples"],
            meta["tokens"],
            meta["truncated"],
            meta["bytes"] / 1e6,
            meta["tokens_per_s"] or 0,
            f"{meta['teacher']['agreement']:.4f}"
            if meta["teacher"]["agreement"] is not None
            else "-",
        )
    return metas


def hidden_size_of(info: dict) -> int:
    """The target's hidden size from target.json, else from its config (no weights loaded)."""
    if info.get("hidden_size"):
        return info["hidden_size"]

    return load_text_config(info["path"])["hidden_size"]
