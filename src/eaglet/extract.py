"""Hidden-state extraction: run the target over every training sequence and keep what the
drafter learns from.

One Snakemake job per shard. Only the layers the drafter reads are captured, with forward
pre-hooks (aux id ``i`` is the *input* of decoder layer ``i``, i.e. HF ``hidden_states[i]``),
plus the final-norm output that the target's lm_head reads. Sequences are the exact
``prompt_token_ids + completion_token_ids`` the server saw and emitted, run in token-budget
batches sorted by length, and packed into the shard without padding.

Every shard is checked against the server: the teacher's argmax, computed from the stored
(cast) final state, must reproduce the greedy tokens the server generated.

This module is the ``hf`` backend (the target run by transformers) and the manifest over the
shards of either backend; the checks and the shard write both backends share are in
:mod:`eaglet.extract_common`, the ``vllm`` backend in :mod:`eaglet.extract_vllm`.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglet import rates, shards
from eaglet.extract_common import (BACKEND_ENGINES, TORCH_DTYPES, ExtractionError, Target,
                                   check_disk, enforce_agreement, estimate_bytes, pick_device,
                                   resolve_aux_layer_ids, shard_problem, shard_records,
                                   shard_states, target_identity, write_shard)
from eaglet.io import read_json, read_jsonl, write_json
from eaglet.progress import Progress

log = logging.getLogger("eaglet.extract")


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


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layer list of a causal LM (``model.model.layers`` for Llama-like models)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ExtractionError(f"cannot find the decoder layers of {type(model).__name__}")
    return layers


class AuxCapture:
    """Forward pre-hooks that keep the input hidden states of a few decoder layers."""

    def __init__(self, layers: torch.nn.ModuleList, layer_ids: list[int]):
        self.captured: dict[int, torch.Tensor] = {}
        self.handles = [layers[i].register_forward_pre_hook(self._hook(i), with_kwargs=True)
                        for i in dict.fromkeys(layer_ids)]
        self.layer_ids = layer_ids

    def _hook(self, layer_id: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            self.captured[layer_id] = hidden.detach()
        return hook

    def take(self) -> list[torch.Tensor]:
        out = [self.captured[i] for i in self.layer_ids]  # an id may repeat on small models
        self.captured.clear()
        return out

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def load_target(path: str, dtype: str, device: str = "auto",
                trust_remote_code: bool = False) -> Target:
    from transformers import AutoModelForCausalLM

    if device == "sharded":  # split across every visible GPU (accelerate's device_map)
        log.info("loading the target %s in %s across the visible devices", path, dtype)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=TORCH_DTYPES[dtype],
                                                     trust_remote_code=trust_remote_code,
                                                     device_map="auto")
        dev = model.get_input_embeddings().weight.device  # where the input ids go
        model.eval()
    else:
        dev = pick_device(device)
        log.info("loading the target %s in %s on %s", path, dtype, dev)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=TORCH_DTYPES[dtype],
                                                     trust_remote_code=trust_remote_code)
        model.to(dev).eval()
    config = model.config.get_text_config()
    lm_head = model.get_output_embeddings().weight.detach()
    return Target(model, lm_head, dev, config.num_hidden_layers, config.hidden_size,
                  lm_head.shape[0])


def right_padded(seqs: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids [B, T] (padded with 0 on the right) and their attention mask. On a GPU they
    are built in pinned memory and sent without blocking: a copy from pageable memory would
    wait for the forward pass still running."""
    ids, attention = _to_device(_padded_host(seqs), device)
    return ids, attention


def _padded_host(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    attention = torch.zeros(len(seqs), longest, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, :len(s)] = torch.tensor(s)
        attention[row, :len(s)] = 1
    return ids, attention


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
def forward_packed(target: Target, capture: AuxCapture, seqs: list[list[int]]) -> torch.Tensor:
    """The states of one right-padded batch, packed on the device without padding: one
    [sum L, 4H] tensor, the 3 aux states then the final-norm state of each row, sample after
    sample. Nothing here waits for the device (the padding is dropped by a gather whose
    indices are known on the host, not by a mask), so the next batch can be queued while
    this one runs and is copied. (transformers itself still reads one flag of the mask
    back before the first layer, so the host does not run more than a batch ahead.)"""
    lengths = [len(s) for s in seqs]
    ids, attention, rows = _to_device([*_padded_host(seqs), packed_rows(lengths, max(lengths))],
                                      target.device)
    out = target.model.get_decoder()(input_ids=ids, attention_mask=attention, use_cache=False)
    final = out.last_hidden_state                        # [B, T, H], after the final norm
    parts = [*capture.take(), final]                     # 3 aux states, then the final one
    hidden = final.shape[-1]
    packed = torch.empty(rows.numel(), len(parts) * hidden, dtype=final.dtype, device=final.device)
    index = {rows.device: rows}
    for k, part in enumerate(parts):  # on a sharded target the parts lie on several devices
        if part.device not in index:
            index[part.device] = rows.to(part.device, non_blocking=True)
        packed[:, k * hidden:(k + 1) * hidden] = part.reshape(-1, hidden)[index[part.device]]
    return packed


def forward_batch(target: Target, capture: AuxCapture, seqs: list[list[int]]):
    """Aux states [sum L, 3H] and final-norm states [sum L, H] of a right-padded batch,
    with the padding dropped again (on the device)."""
    packed = forward_packed(target, capture, seqs)
    aux_width = packed.shape[1] - target.hidden_size
    return packed[:, :aux_width], packed[:, aux_width:]


class HostCopies:
    """Packed batch states brought to the host while the device runs the next batch.

    :meth:`put` starts the copy of one batch's packed states ([rows, W] on the device) and
    hands back, oldest first, the batches whose host copy is complete, keeping at most
    ``depth`` copies in flight. On a GPU each copy is one non-blocking device-to-host copy
    into one of ``depth`` pinned staging buffers, on a side stream that waits (by an event)
    for the forward that made the states; the host waits for that copy's own event only
    when it takes the batch, then splits it into ordinary memory, so the staging buffer
    serves the next batch and nothing pinned outlives the job. Elsewhere (``staged`` False,
    the default off a GPU) the packed tensor is already on the host and is split as it is.

    A taken batch is ``(tag, aux, final)``: ``aux`` its first ``aux_width`` columns
    [rows, 3H] and ``final`` the rest [rows, H], each a new contiguous tensor in the states'
    dtype (never a view of a staging buffer)."""

    def __init__(self, capacity_rows: int, width: int, aux_width: int, dtype: torch.dtype,
                 device: torch.device, depth: int = 2, staged: bool | None = None):
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self.aux_width = aux_width
        self.cuda = device.type == "cuda"
        self.staged = self.cuda if staged is None else staged
        self.depth = depth
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.slots = [torch.empty(capacity_rows, width, dtype=dtype, pin_memory=self.cuda)
                      for _ in range(depth)] if self.staged else []
        self.free = list(range(len(self.slots)))
        self.pending: deque = deque()

    def put(self, packed: torch.Tensor, tag) -> list[tuple]:
        taken = []
        while len(self.pending) >= self.depth:  # only with depth 1: room for this one first
            taken.append(self._take())
        if not self.staged:
            self.pending.append((tag, packed, None, None, None))
        else:
            slot = self.free.pop()
            host = self.slots[slot][:packed.shape[0]]
            event = None
            if self.cuda:
                made = torch.cuda.Event()
                made.record(torch.cuda.current_stream(packed.device))
                self.stream.wait_event(made)
                with torch.cuda.stream(self.stream):
                    host.copy_(packed, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            else:
                host.copy_(packed)
            # the device tensor is kept until its copy is done: then its memory may go
            self.pending.append((tag, host, event, slot, packed))
        while len(self.pending) >= self.depth:  # this batch is in flight: take older ones
            taken.append(self._take())
        return taken

    def drain(self) -> list[tuple]:
        """Every batch still in flight, oldest first."""
        return [self._take() for _ in range(len(self.pending))]

    def _take(self) -> tuple:
        tag, host, event, slot, _ = self.pending.popleft()
        if event is not None:
            event.synchronize()
        # copies: a one-row column slice is contiguous, and .contiguous() would keep the view
        aux = host[:, :self.aux_width].clone(memory_format=torch.contiguous_format)
        final = host[:, self.aux_width:].clone(memory_format=torch.contiguous_format)
        if slot is not None:
            self.free.append(slot)
        return tag, aux, final


def hf_states(target: Target, records: list[dict], seqs: list[list[int]], cfg: dict,
              aux_layer_ids: list[int], progress: Progress | None = None, depth: int = 2,
              staged: bool | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Aux [L, 3H] and final-norm [L, H] states of every sequence, from the target loaded by
    transformers (the ``hf`` backend), in token-budget batches. Each batch is packed on the
    device and copied to the host (:class:`HostCopies`, ``depth`` batches in flight) while
    the next one runs; a sequence's states are row blocks (views) of its batch's host copy."""
    lengths = [len(s) for s in seqs]
    aux_rows: list[torch.Tensor | None] = [None] * len(seqs)
    final_rows: list[torch.Tensor | None] = [None] * len(seqs)
    batches = token_budget_batches(lengths, cfg["batch_tokens"])
    capacity = max(sum(lengths[i] for i in batch) for batch in batches)
    copies = None
    capture = AuxCapture(decoder_layers(target.model), aux_layer_ids)

    def keep(taken):
        for batch, aux, final in taken:
            start = 0
            for i in batch:
                aux_rows[i] = aux[start:start + lengths[i]]
                final_rows[i] = final[start:start + lengths[i]]
                start += lengths[i]
            if progress is not None:
                progress.advance(done=len(batch), tokens=start)

    try:
        for batch in batches:
            packed = forward_packed(target, capture, [seqs[i] for i in batch])
            if copies is None:  # the states' width, dtype and device are known now
                copies = HostCopies(capacity, packed.shape[1], packed.shape[1] - target.hidden_size,
                                    packed.dtype, packed.device, depth=depth, staged=staged)
            keep(copies.put(packed, batch))
            del packed
        if copies is not None:
            keep(copies.drain())
    finally:
        capture.close()
    return aux_rows, final_rows


def extract_shard(target: Target, records: list[dict], cfg: dict, aux_layer_ids: list[int],
                  identity: dict, shard_path: str | os.PathLike, meta_path: str | os.PathLike,
                  progress: Progress | None = None, states=hf_states,
                  backend: str = "hf") -> dict:
    """Extract one shard and its sidecar JSON; raise below the teacher-agreement threshold.

    ``states(target, records, seqs, cfg, aux_layer_ids, progress)`` computes the aux and
    final states of each sequence (:func:`hf_states`, or the vLLM backend's); ``target``
    needs only its lm_head and device for the teacher check."""
    got = shard_states(target, records, cfg, aux_layer_ids, progress, states)
    return write_shard(target, got, cfg, aux_layer_ids, identity, shard_path, meta_path, backend)


# -- the stage -------------------------------------------------------------------------------

def extract_shards(target: Target, parts: list[tuple[list[dict], str | os.PathLike, str | os.PathLike]],
                   cfg: dict, aux_layer_ids: list[int], identity: dict,
                   progress: Progress | None = None) -> list[dict]:
    """:func:`extract_shard` for each ``(records, shard_path, meta_path)`` of ``parts`` in
    turn, with each shard's teacher check and write in a second thread while the next
    shard's batches run: the device does not wait for the disk, and at most two shards'
    states are on the host (the one being written, the one being extracted). The first
    error raised is raised here, once the write in flight has ended."""
    metas: list[dict] = []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer") as writer:
        writing = None
        for records, shard_path, meta_path in parts:
            got = shard_states(target, records, cfg, aux_layer_ids, progress, hf_states)
            if writing is not None:
                metas.append(writing.result())  # bounded: one shard written at a time
            writing = writer.submit(write_shard, target, got, cfg, aux_layer_ids, identity,
                                    shard_path, meta_path)
            del got
        if writing is not None:
            metas.append(writing.result())
    return metas


@dataclass
class ShardJob:
    """One shard a job writes: shard ``index`` of ``num_shards`` of the samples in ``data``."""

    data: str
    num_shards: int
    index: int
    shard: str
    meta: str


def run_shard(cfg: dict, target_json: str, data_path: str, index: int, num_shards: int,
              shard_path: str, meta_path: str, progress_path: str | None = None,
              log_path: str | None = None) -> dict:
    """The ``extract`` rule for one shard (``cfg`` holds ``extract`` and ``target``)."""
    return run_shards(cfg, target_json, [ShardJob(data_path, num_shards, index, shard_path, meta_path)],
                      progress_path, log_path, name=f"extract[{index}]")[0]


def run_shards(cfg: dict, target_json: str, jobs: list[ShardJob], progress_path: str | None = None,
               log_path: str | None = None, name: str = "extract") -> list[dict]:
    """Several shards from one job (``extract.jobs: one``; one shard for the ``extract`` rule):
    the target loaded once, the shards extracted by :func:`extract_shards` (each write beside
    the next shard's forward)."""
    ext = cfg["extract"]
    info = read_json(target_json)
    data: dict[str, list[dict]] = {}
    for job in jobs:
        if job.data not in data:
            data[job.data] = read_jsonl(job.data)
    records = [shard_records(data[job.data], job.num_shards, job.index) for job in jobs]
    for job, recs in zip(jobs, records):
        if job.num_shards > len(data[job.data]) and data[job.data]:
            log.warning("%d shards for %d samples: some shards are empty (lower extract.num_shards)",
                        job.num_shards, len(data[job.data]))
        if not recs:
            held_out = Path(job.shard).parent.name == "eval"
            raise ExtractionError(
                f"{'held-out ' if held_out else ''}shard {job.index} of {job.num_shards} has no "
                f"samples: lower extract.{'num_eval_shards' if held_out else 'num_shards'} to at "
                f"most the number of {'held-out ' if held_out else ''}samples")
    # every shard of each split not yet on disk: its other shards may be written beside this job
    splits = {(Path(job.shard).parent, job.data, job.num_shards) for job in jobs}
    needed = sum(estimate_bytes(shard_records(data[d], count, i), ext["max_len"],
                                hidden_size_of(info), ext["dtype"])
                 for directory, d, count in splits for i in range(count)
                 if not shards.shard_path(directory, i).exists())
    check_disk(Path(jobs[0].shard).parent, needed)  # before minutes of loading a large model
    target = load_target(info["path"], cfg["target"]["dtype"], ext["device"],
                         cfg["target"].get("trust_remote_code", False))
    aux_ids = resolve_aux_layer_ids(ext["aux_layer_ids"], target.num_layers)
    progress = Progress(name, total=sum(map(len, records)), path=progress_path, log_path=log_path)
    started = time.monotonic()
    metas = extract_shards(target, [(recs, job.shard, job.meta) for job, recs in zip(jobs, records)],
                           ext, aux_ids, target_identity(info), progress)
    progress.report("finished")
    tokens = sum(m["tokens"] for m in metas)
    elapsed = time.monotonic() - started
    rates.record("extract", info["spec"], tokens_per_s=tokens / elapsed if elapsed else None)
    for job, meta in zip(jobs, metas):
        log.info("shard %s: %d samples, %d tokens (%d truncated), %.1f MB, %.0f tokens/s, teacher "
                 "agreement %s", job.shard, meta["num_samples"], meta["tokens"], meta["truncated"],
                 meta["bytes"] / 1e6, meta["tokens_per_s"] or 0,
                 f"{meta['teacher']['agreement']:.4f}" if meta["teacher"]["agreement"] is not None else "-")
    return metas


def hidden_size_of(info: dict) -> int:
    """The target's hidden size from target.json, else from its config (no weights loaded)."""
    if info.get("hidden_size"):
        return info["hidden_size"]
    from eaglet.target import load_text_config

    return load_text_config(info["path"])["hidden_size"]


def build_manifest(cfg: dict, target_json: str, data_path: str, num_shards: int,
                   hidden_dir: str, manifest_path: str, eval_data_path: str | None = None,
                   num_eval_shards: int = 1) -> dict:
    """Verify every shard (hash, layers, dtype, target), re-extract the ones that fail, and
    write ``manifest.json``. With ``eval_data_path`` the ``num_eval_shards`` held-out shards
    (``eval/`` beside the training shards) are verified too and listed under
    ``eval_shards``."""
    from eaglet.target import load_text_config

    ext = cfg["extract"]
    info = read_json(target_json)
    num_layers = load_text_config(info["path"])["num_hidden_layers"]
    expected = {"aux_layer_ids": resolve_aux_layer_ids(ext["aux_layer_ids"], num_layers),
                "dtype": ext["dtype"], "target": target_identity(info)}
    jobs = [(Path(hidden_dir), data_path, num_shards, index) for index in range(num_shards)]
    if eval_data_path is not None:
        jobs += [(Path(hidden_dir) / "eval", eval_data_path, num_eval_shards, index)
                 for index in range(num_eval_shards)]
    target: Target | None = None
    records: dict[str, list[dict]] = {}
    problems = [shard_problem(shards.shard_path(d, i).with_suffix(".json"), shards.shard_path(d, i),
                              expected) for d, _, _, i in jobs]
    redo = [(data, count, index) for (_, data, count, index), problem in zip(jobs, problems) if problem]
    if redo:  # before loading the model: the bytes of every shard to extract again
        for data, _, _ in redo:
            if data not in records:
                records[data] = read_jsonl(data)
        check_disk(Path(hidden_dir), sum(
            estimate_bytes(shard_records(records[data], count, index), ext["max_len"],
                           hidden_size_of(info), ext["dtype"]) for data, count, index in redo))
    entries = []
    if redo and ext.get("backend") == "vllm":
        _reextract_with_vllm(cfg, info, [job for job, problem in zip(jobs, problems) if problem],
                             records, hidden_dir)
        problems = [shard_problem(shards.shard_path(d, i).with_suffix(".json"),
                                  shards.shard_path(d, i), expected) for d, _, _, i in jobs]
    for (directory, data, count, index), problem in zip(jobs, problems):
        shard_file = shards.shard_path(directory, index)
        meta_path = shard_file.with_suffix(".json")
        if problem:
            log.warning("shard %s cannot be used: %s; extracting it again", shard_file, problem)
            if target is None:
                target = load_target(info["path"], cfg["target"]["dtype"], ext["device"],
                                     cfg["target"].get("trust_remote_code", False))
            extract_shard(target, shard_records(records[data], count, index), ext,
                          expected["aux_layer_ids"], expected["target"], shard_file, meta_path)
        entry = read_json(meta_path)
        enforce_agreement(entry, ext["min_teacher_agreement"])
        entries.append({**entry, "file": shard_file.relative_to(hidden_dir).as_posix()})
    manifest = summarize(entries[:num_shards], expected, ext)
    if eval_data_path is not None:
        manifest["eval_shards"] = summarize(entries[num_shards:], expected, ext)["shards"]
    manifest["computed_by"] = computed_by(entries)
    write_json(manifest_path, manifest)
    log.info("manifest: %d shards, %d samples, %d tokens, %.1f MB, teacher agreement %s",
             manifest["num_shards"], manifest["num_samples"], manifest["tokens"], manifest["bytes"] / 1e6,
             manifest["teacher_agreement"])
    return manifest


def _reextract_with_vllm(cfg: dict, info: dict, bad: list[tuple], records: dict[str, list[dict]],
                         hidden_dir: str) -> None:
    """Backend vllm: rewrite the shards that cannot be used (``bad``: (directory, data file,
    shards of its split, index)) with one server for all of them."""
    from eaglet import extract_vllm

    work = Path(hidden_dir) / "vllm"
    jobs = []
    for directory, data, count, index in bad:
        paths = [shards.shard_path(directory, i) for i in range(count)]
        split = "eval" if Path(directory).name == "eval" else "train"
        jobs.append(extract_vllm.shard_jobs(
            records[data], count, [str(p) for p in paths],
            [str(p.with_suffix(".json")) for p in paths], work, split)[index])
    extract_vllm.extract_shards(cfg, info, jobs, work,
                                Path(hidden_dir).parent / "logs" / "extract" / "manifest.server.log")


def computed_by(entries: list[dict]) -> list[dict]:
    """How the states of the shards (``entries``, held-out ones too) were computed, one item
    per backend and engine version: ``backend`` (hf or vllm), ``engine`` and
    ``engine_version`` (transformers' or vLLM's), the ``shards`` and ``samples`` it made, and
    ``samples_captured_during_generation``: those whose states generation's own forward
    passes saved (``generate.capture_hidden_states``), the rest computed by extraction. A
    shard from an eaglet that did not record its engine counts with version None."""
    groups: dict[tuple, dict] = {}
    for entry in entries:
        backend = entry.get("backend", "hf")
        engine = entry.get("engine") or {"name": BACKEND_ENGINES[backend], "version": None}
        group = groups.setdefault((backend, engine["name"], engine["version"]), {
            "backend": backend, "engine": engine["name"], "engine_version": engine["version"],
            "shards": 0, "samples": 0, "samples_captured_during_generation": 0})
        group["shards"] += 1
        group["samples"] += entry["num_samples"]
        group["samples_captured_during_generation"] += entry.get("captured_during_generation", 0)
    return list(groups.values())


def summarize(entries: list[dict], expected: dict, ext: dict) -> dict:
    positions = sum(e["teacher"]["positions"] for e in entries)
    def weighted(key):
        if not positions:
            return None
        return sum((e["teacher"][key] or 0) * e["teacher"]["positions"] for e in entries) / positions
    tokens = sum(e["tokens"] for e in entries)
    return {
        "format": shards.FORMAT, "target": expected["target"],
        "aux_layer_ids": expected["aux_layer_ids"], "dtype": expected["dtype"],
        "hidden_size": entries[0]["hidden_size"] if entries else None,
        "max_len": ext["max_len"], "num_shards": len(entries),
        "num_samples": sum(e["num_samples"] for e in entries), "tokens": tokens,
        "loss_tokens": sum(e["loss_tokens"] for e in entries),
        "truncated": sum(e["truncated"] for e in entries),
        "bytes": sum(e["bytes"] for e in entries),
        "bytes_per_token": sum(e["bytes"] for e in entries) / tokens if tokens else None,
        # shards of recorded answers alone (answers: dataset) hold no answer of the target's
        "greedy": all(e["greedy"] for e in entries if e["teacher"]["positions"]),
        "recorded_answers": sum(e.get("recorded_answers", 0) for e in entries),
        "teacher_agreement": weighted("agreement"), "teacher_mean_logprob": weighted("mean_logprob"),
        "shards": [{k: e[k] for k in ("file", "sha256", "bytes", "samples", "num_samples",
                                      "tokens", "loss_tokens", "truncated", "teacher",
                                      "tokens_per_s")} for e in entries],
    }
