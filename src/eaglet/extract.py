"""Hidden-state extraction: run the target over every training sequence and keep what the
drafter learns from.

One Snakemake job per shard. Only the layers the drafter reads are captured, with forward
pre-hooks (aux id ``i`` is the *input* of decoder layer ``i``, i.e. HF ``hidden_states[i]``),
plus the final-norm output that the target's lm_head reads. Sequences are the exact
``prompt_token_ids + completion_token_ids`` the server saw and emitted, run in token-budget
batches sorted by length, and packed into the shard without padding.

Every shard is checked against the server: the teacher's argmax, computed from the stored
(cast) final state, must reproduce the greedy tokens the server generated.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eaglet import rates, shards
from eaglet.io import read_json, read_jsonl, write_json
from eaglet.progress import Progress
from eaglet.prompts import recorded_answer

log = logging.getLogger("eaglet.extract")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExtractionError(RuntimeError):
    pass


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 aux layers: early, middle and late."""
    return [2, num_layers // 2, num_layers - 3]


def resolve_aux_layer_ids(configured: list[int] | None, num_layers: int) -> list[int]:
    ids = list(configured) if configured else default_aux_layer_ids(num_layers)
    if len(ids) != 3:
        raise ExtractionError(f"extract.aux_layer_ids needs 3 layer ids (EAGLE-3 fuses three), got {ids}")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ExtractionError(f"aux layer ids {bad} are outside 0..{num_layers - 1}: id i is the "
                              f"input of decoder layer i of the target's {num_layers} layers")
    return ids


def shard_bounds(num_samples: int, num_shards: int, index: int) -> tuple[int, int]:
    """Contiguous, balanced block of sample indices for shard ``index`` of ``num_shards``."""
    return index * num_samples // num_shards, (index + 1) * num_samples // num_shards


def sequence(record: dict, max_len: int) -> tuple[list[int], list[int], bool]:
    """Token ids and loss mask (1 on completion tokens) of one sample, cut at ``max_len``."""
    prompt, completion = record["prompt_token_ids"], record["completion_token_ids"]
    ids = list(prompt) + list(completion)
    mask = [0] * len(prompt) + [1] * len(completion)
    truncated = len(ids) > max_len
    return ids[:max_len], mask[:max_len], truncated


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


@dataclass
class Target:
    model: Any
    lm_head: torch.Tensor   # [V, H]
    device: torch.device
    num_layers: int
    hidden_size: int
    vocab_size: int


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


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


def predicting_rows(loss_mask: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows whose next token is a completion token of the same sample: the only rows whose
    teacher training reads and the greedy check compares."""
    predicted_by = torch.zeros_like(loss_mask, dtype=torch.bool)
    predicted_by[:-1] = loss_mask[1:].bool()            # position t predicts completion token t+1
    starts = offsets[1:-1] - 1                           # the last row of a sample predicts nothing
    predicted_by[starts[starts >= 0]] = False
    return predicted_by


@torch.inference_mode()
def teacher_from_stored(target: Target, final_stored: torch.Tensor, targets: torch.Tensor,
                        rows: torch.Tensor, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Argmax over the full vocabulary and log-probability of ``targets`` (the next tokens),
    from the final states as they are stored (after the cast to the shard dtype), at the
    ``rows`` mask only: -1 and NaN elsewhere. Prompt rows are most of a sample on short answers
    and the full-vocabulary head is the costliest part of the check, so they are skipped."""
    argmax = torch.full((final_stored.shape[0],), -1, dtype=torch.int64)
    logprob = torch.full((final_stored.shape[0],), float("nan"), dtype=torch.float32)
    index = rows.nonzero().squeeze(1)
    weight = target.lm_head
    for start in range(0, index.numel(), chunk):
        at = index[start:start + chunk]
        h = final_stored[at].to(weight.device, weight.dtype)  # the lm_head's device when sharded
        logits = (h @ weight.T).float()
        argmax[at] = logits.argmax(-1).cpu()
        nxt = targets[at].to(weight.device)
        logprob[at] = torch.log_softmax(logits, -1).gather(1, nxt[:, None]).squeeze(1).cpu()
    return argmax, logprob


def agreement(records: list[dict], input_ids: torch.Tensor, predicted_by: torch.Tensor,
              offsets: torch.Tensor, teacher_argmax: torch.Tensor, next_logprob: torch.Tensor,
              worst: int = 5) -> dict:
    """How often the teacher's argmax at t equals the generated token at t+1, over completion
    tokens (the ``predicted_by`` rows); per sample, the worst ones named."""
    next_ids = torch.roll(input_ids, -1)
    hits = (teacher_argmax == next_ids) & predicted_by
    per_sample = []
    for s, record in enumerate(records):
        lo, hi = int(offsets[s]), int(offsets[s + 1])
        n = int(predicted_by[lo:hi].sum())
        if n:
            per_sample.append({"id": record["id"], "positions": n,
                               "agreement": float(hits[lo:hi].sum()) / n,
                               "mean_logprob": float(next_logprob[lo:hi][predicted_by[lo:hi]].mean())})
    total = int(predicted_by.sum())
    return {
        "positions": total,
        "agreement": float(hits.sum()) / total if total else None,
        "mean_logprob": float(next_logprob[predicted_by].mean()) if total else None,
        "worst": sorted(per_sample, key=lambda r: r["agreement"])[:worst],
    }


def estimate_bytes(records: list[dict], max_len: int, hidden_size: int, dtype: str) -> int:
    tokens = sum(min(len(r["prompt_token_ids"]) + len(r["completion_token_ids"]), max_len)
                 for r in records)
    return tokens * shards.bytes_per_token(hidden_size, 3, dtype)


def check_disk(directory: Path, needed: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if needed > free:
        raise ExtractionError(
            f"not enough disk for the hidden states: about {_size(needed)} still to "
            f"write, {_size(free)} free on {directory}. Free space, point results_dir "
            f"at a larger disk, or store fp8 shards (extract.dtype: fp8) to halve the bytes.")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"


def is_greedy(records: list[dict]) -> bool:
    """Whether the target answered these samples greedily (recorded answers aside; at least
    one answered by the target): what the teacher check compares."""
    generated = [r for r in records if not recorded_answer(r)]
    return bool(generated) and all((r.get("sampling") or {}).get("temperature", 0.0) == 0.0
                                   for r in generated)


def generated_rows(records: list[dict], offsets: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` less those of samples with a recorded answer: the teacher check compares the
    target with its own answers only (a recorded answer is another writer's)."""
    keep = rows.clone()
    for s, record in enumerate(records):
        if recorded_answer(record):
            keep[int(offsets[s]):int(offsets[s + 1])] = False
    return keep


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


@dataclass
class ShardStates:
    """One shard's sequences and their states on the host, not yet checked nor written."""

    records: list[dict]
    seqs: list[list[int]]
    masks: list[list[int]]
    truncated: int
    aux_rows: list[torch.Tensor]
    final_rows: list[torch.Tensor]
    started: float


def shard_states(target: Target, records: list[dict], cfg: dict, aux_layer_ids: list[int],
                 progress: Progress | None = None, states=hf_states) -> ShardStates:
    """The sequences of ``records`` (cut at ``max_len``) and their states, by ``states``."""
    started = time.monotonic()
    seqs, masks, truncated = [], [], 0
    for record in records:
        ids, mask, cut = sequence(record, cfg["max_len"])
        seqs.append(ids)
        masks.append(mask)
        truncated += cut
    aux_rows, final_rows = states(target, records, seqs, cfg, aux_layer_ids, progress)
    return ShardStates(records, seqs, masks, truncated, aux_rows, final_rows, started)


def write_shard(target: Target, got: ShardStates, cfg: dict, aux_layer_ids: list[int],
                identity: dict, shard_path: str | os.PathLike, meta_path: str | os.PathLike,
                backend: str = "hf") -> dict:
    """Check the teacher of computed states, write the shard and its sidecar JSON; raise below
    the teacher-agreement threshold."""
    records, seqs = got.records, got.seqs
    lengths = [len(s) for s in seqs]
    input_ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64)
    loss_mask = torch.tensor([m for ms in got.masks for m in ms], dtype=torch.uint8)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    final_all = torch.cat(got.final_rows)  # the aux states are written from their rows as they are

    # the teacher as training will see it: from the final state after the storage cast
    stored_final = _round_trip(final_all, cfg["dtype"])
    rows = predicting_rows(loss_mask, offsets)
    teacher_argmax, next_logprob = teacher_from_stored(target, stored_final,
                                                       torch.roll(input_ids, -1), rows)
    del stored_final
    generated = generated_rows(records, offsets, rows)
    check = agreement(records, input_ids, generated, offsets, teacher_argmax, next_logprob)
    if any(map(recorded_answer, records)):  # how far the recorded answers are from the target
        other = agreement(records, input_ids, rows & ~generated, offsets, teacher_argmax,
                          next_logprob, worst=0)
        check["recorded_answers"] = {k: other[k] for k in ("positions", "agreement",
                                                           "mean_logprob")}

    written = shards.write(shard_path, input_ids, loss_mask, offsets, teacher_argmax, got.aux_rows,
                           final_all, sample_ids=[r["id"] for r in records],
                           aux_layer_ids=aux_layer_ids, dtype=cfg["dtype"], target=identity)
    elapsed = time.monotonic() - got.started
    tensor_bytes = input_ids.numel() * shards.bytes_per_token(target.hidden_size, 3, cfg["dtype"])
    meta = {
        "file": Path(shard_path).name, "sha256": written.sha256, "bytes": written.bytes,
        "tensor_bytes": tensor_bytes, "samples": [r["id"] for r in records],
        "num_samples": len(records), "tokens": int(input_ids.numel()),
        "loss_tokens": int(loss_mask.sum()), "truncated": got.truncated, "dtype": cfg["dtype"],
        "aux_layer_ids": aux_layer_ids, "hidden_size": target.hidden_size, "target": identity,
        "greedy": is_greedy(records), "teacher": check, "backend": backend, "elapsed_s": elapsed,
        "recorded_answers": sum(map(recorded_answer, records)),
        "tokens_per_s": input_ids.numel() / elapsed if elapsed else None,
    }
    write_json(meta_path, meta)
    enforce_agreement(meta, cfg["min_teacher_agreement"])
    return meta


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


def _round_trip(x: torch.Tensor, dtype: str) -> torch.Tensor:
    if dtype == "fp8":
        return shards.dequantize_fp8(*shards.quantize_fp8(x, 1))
    return x.to(shards.STORAGE_DTYPES[dtype]).float()


def enforce_agreement(meta: dict, threshold: float) -> None:
    check = meta["teacher"]
    if not meta["greedy"] or check["agreement"] is None:
        return  # sampled data: the mean log-probability is reported instead
    if check["agreement"] >= threshold:
        return
    worst = "; ".join(f"{w['id']}: {w['agreement']:.2%} of {w['positions']}" for w in check["worst"])
    raise ExtractionError(
        f"teacher agreement {check['agreement']:.2%} in {meta['file']} is below "
        f"extract.min_teacher_agreement={threshold:.2%}: the target run by "
        f"{BACKEND_NAMES.get(meta.get('backend', 'hf'), meta.get('backend'))} does not "
        f"reproduce the tokens the server generated greedily. Worst samples: {worst}. Check that "
        f"the server and extraction use the same weights, dtype (target.dtype) and tokenizer, "
        f"and that prompt_token_ids came from the server (not re-tokenized).")


BACKEND_NAMES = {"hf": "transformers (extract.backend: hf)",
                 "vllm": "the vLLM server's prefill (extract.backend: vllm)"}


# -- the stage -------------------------------------------------------------------------------

def target_identity(target_info: dict) -> dict:
    keys = ("spec", "path", "hub_id", "source_sha256", "config_sha256")
    return {k: target_info[k] for k in keys if k in target_info}


def shard_records(records: list[dict], num_shards: int, index: int) -> list[dict]:
    lo, hi = shard_bounds(len(records), num_shards, index)
    return records[lo:hi]


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
            got = shard_states(target, records, cfg, aux_layer_ids, progress)
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
            raise ExtractionError(f"shard {job.index} of {job.num_shards} has no samples: lower "
                                  f"extract.num_shards to at most the number of samples")
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


def shard_problem(meta_path: Path, shard_file: Path, expected: dict) -> str | None:
    """Why a finished shard cannot be used as it is, or None when it matches."""
    if not meta_path.exists() or not shard_file.exists():
        return "missing"
    try:
        meta = read_json(meta_path)
    except ValueError:
        return f"its record {meta_path.name} is unreadable"
    if shards.sha256_path(shard_file) != meta["sha256"]:
        return "its sha256 does not match the one recorded at extraction (truncated or modified)"
    for key in ("aux_layer_ids", "dtype", "target"):
        if meta[key] != expected[key]:
            return f"it was extracted with {key}={meta[key]!r}, the run now asks for {expected[key]!r}"
    return None


def build_manifest(cfg: dict, target_json: str, data_path: str, num_shards: int,
                   hidden_dir: str, manifest_path: str, eval_data_path: str | None = None) -> dict:
    """Verify every shard (hash, layers, dtype, target), re-extract the ones that fail, and
    write ``manifest.json``. With ``eval_data_path`` the held-out shard (``eval/`` beside
    the training shards) is verified too and listed under ``eval_shards``."""
    from eaglet.target import load_text_config

    ext = cfg["extract"]
    info = read_json(target_json)
    num_layers = load_text_config(info["path"])["num_hidden_layers"]
    expected = {"aux_layer_ids": resolve_aux_layer_ids(ext["aux_layer_ids"], num_layers),
                "dtype": ext["dtype"], "target": target_identity(info)}
    jobs = [(Path(hidden_dir), data_path, num_shards, index) for index in range(num_shards)]
    if eval_data_path is not None:
        jobs.append((Path(hidden_dir) / "eval", eval_data_path, 1, 0))
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
