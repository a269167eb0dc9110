"""The drafter's training data: shards checked against the target and the vocabulary map,
samples held in memory (``train.shards_in_memory`` at a time), packed whole into micro-batches
of at most ``max_tokens_per_batch`` rows per epoch (shuffled, seeded), and laid out for
training-time test (``make_batch``: which rows count at each TTT step).

A sample longer than ``max_len`` is cut to its first ``max_len`` tokens. At TTT step ``k`` row
``t`` predicts token ``t+2+k``; that position counts when the token lies in the sample, is a
completion token (or any token with ``loss_on_prompt``) and the target's argmax there is in
the draft vocabulary.
"""

from __future__ import annotations

import math
import os
import random
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from eaglet import shards as shard_format
from eaglet.io import read_json
from eaglet.target import model_identity


class TrainError(RuntimeError):
    """The inputs or the run cannot go on; the message says what to change."""


@dataclass
class ShardInfo:
    path: str
    lengths: list[int]
    sample_ids: list[str]
    hidden_size: int
    aux_layer_ids: list[int]
    target: dict
    sha256: str | None = None  # recorded in the manifest at extraction; None: not verified


def manifest_hashes(manifest_path: str, paths: list[str]) -> dict[str, str]:
    """The sha256 that ``manifest.json`` records for each shard of ``paths``."""
    manifest = read_json(manifest_path)
    root = Path(manifest_path).parent
    listed = {os.path.realpath(root / entry["file"]): entry["sha256"]
              for entry in manifest.get("shards", []) + manifest.get("eval_shards", [])}
    hashes = {}
    for path in paths:
        sha256 = listed.get(os.path.realpath(path))
        if sha256 is None:
            raise TrainError(f"{path} is not listed in {manifest_path}, so it cannot be verified: "
                             f"rebuild the manifest (snakemake --forcerun hidden_manifest)")
        hashes[path] = sha256
    return hashes


def damaged(exc: shard_format.ShardDamaged) -> TrainError:
    """Move a damaged shard aside, so that the next run extracts it again, and say so."""
    aside = shard_format.set_aside(exc.path)
    where = f"it was moved to {aside.name}" if aside else "it is gone"
    return TrainError(f"{exc}. No training step used its damaged bytes; {where}, so that "
                      f"rerunning the workflow extracts it again (finished checkpoints are kept)")


def index_shard(path: str, vocab_size: int, sha256: str | None = None) -> ShardInfo:
    """What training needs to know of a shard before loading it, with its token ids checked.
    With ``sha256`` a shard that cannot be read, or whose check fails because its bytes
    changed since extraction, is refused as damaged."""
    def refuse(message: str) -> TrainError:
        if sha256 is not None and shard_format.sha256_path(path) != sha256:
            return damaged(shard_format.ShardDamaged(
                path, "its sha256 is not the one recorded at extraction (truncated or modified "
                      f"on disk; {message})"))
        return TrainError(message)

    try:
        meta = shard_format.read_metadata(path)
        with safe_open(str(path), framework="pt") as handle:
            offsets = handle.get_tensor("offsets")
            width = handle.get_slice("aux_hidden").get_shape()[1]
            # teacher_argmax is -1 on rows no loss reads (see eaglet.shards)
            ranges = {}
            for name in ("input_ids", "teacher_argmax"):
                ids = handle.get_tensor(name)
                ranges[name] = (int(ids.min()), int(ids.max())) if ids.numel() else None
    except Exception as exc:  # safetensors' own message names no file
        if sha256 is None:
            raise TrainError(f"{path} cannot be read ({exc}): rerun extract for it") from exc
        raise damaged(shard_format.ShardDamaged(path, f"it cannot be read ({exc})")) from exc
    for name, lowest in (("input_ids", 0), ("teacher_argmax", -1)):
        if ranges[name] is None:
            continue
        low, high = ranges[name]
        if low < lowest or high >= vocab_size:
            bad = low if low < lowest else high
            raise refuse(f"{path}: {name} holds id {bad} outside the target vocabulary of "
                         f"{vocab_size}: the shard was extracted for another "
                         f"tokenizer; rerun extract for this target")
    if width != meta["hidden_size"] * len(meta["aux_layer_ids"]):
        raise refuse(f"{path}: aux_hidden is {width} wide, not hidden size {meta['hidden_size']}"
                     f" x {len(meta['aux_layer_ids'])} aux layers: the shard is corrupt; rerun extract")
    return ShardInfo(str(path), (offsets[1:] - offsets[:-1]).tolist(), meta["sample_ids"],
                     meta["hidden_size"], meta["aux_layer_ids"], meta["target"], sha256)


def check_vocab_map(target_config: dict, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    vocab = target_config["vocab_size"]
    fix = "rebuild vocab/vocab_map.safetensors for this target (rerun the vocab_map rule)"
    if t2d.numel() != vocab:
        raise TrainError(f"the vocab map's t2d covers {t2d.numel()} tokens but the target's "
                         f"vocab_size is {vocab}: {fix}")
    draft_to_target = torch.arange(d2t.numel()) + d2t
    if (int(t2d.sum()) != d2t.numel() or int(draft_to_target.min()) < 0
            or int(draft_to_target.max()) >= vocab or not bool(t2d[draft_to_target].all())):
        raise TrainError(f"the vocab map is inconsistent: d2t maps {d2t.numel()} draft ids but "
                         f"t2d marks {int(t2d.sum())} target ids, or they disagree: {fix}")


def check_shards(infos: list[ShardInfo], target_config: dict, target_dir: str) -> None:
    """Refuse shards that disagree with each other or with the target."""
    first, identity = infos[0], None
    for info in infos:
        if info.hidden_size != target_config["hidden_size"]:
            raise TrainError(f"{info.path} has hidden size {info.hidden_size} but the target has "
                             f"{target_config['hidden_size']}: it was extracted from another "
                             f"model; rerun extract")
        for what in ("aux_layer_ids", "target"):
            if getattr(info, what) != getattr(first, what):
                raise TrainError(
                    f"{info.path} has {what} {getattr(info, what)} but {first.path} has "
                    f"{getattr(first, what)}: the shards come from different extract runs; "
                    f"delete the stale ones and rerun extract")
        if "config_sha256" in info.target:
            identity = identity or model_identity(Path(target_dir))
            if info.target["config_sha256"] != identity["config_sha256"]:
                raise TrainError(f"{info.path} was extracted from a target whose config differs "
                                 f"from {target_dir}: rerun extract for this target")


# -- samples, packing and batches -------------------------------------------------------------

class Samples:
    """The samples of a list of shards under one global index; shards are loaded on first use
    and at most ``keep`` of them (0: all) stay in memory."""

    def __init__(self, infos: list[ShardInfo], keep: int = 0):
        self.infos = infos
        self.keep = keep
        self.lengths = [n for info in infos for n in info.lengths]
        self.shard_of = [s for s, info in enumerate(infos) for _ in info.lengths]
        self.first = [0]  # global index of each shard's first sample
        for info in infos[:-1]:
            self.first.append(self.first[-1] + len(info.lengths))
        self._loaded: OrderedDict[int, shard_format.Shard] = OrderedDict()

    def __len__(self) -> int:
        return len(self.lengths)

    def preload(self) -> None:
        """Load (and so verify) every shard now when all of them stay in memory anyway, so
        that a damaged one stops the run before its first step."""
        if not self.keep:
            for number in range(len(self.infos)):
                self.shard(number)

    def shard(self, number: int) -> shard_format.Shard:
        if number in self._loaded:
            self._loaded.move_to_end(number)
        else:
            info = self.infos[number]
            try:  # read once, hashed as it is read, against the manifest
                self._loaded[number] = shard_format.load(info.path, info.sha256)
            except shard_format.ShardDamaged as exc:
                raise damaged(exc) from exc
            if self.keep and len(self._loaded) > self.keep:
                self._loaded.popitem(last=False)
        return self._loaded[number]

    def get(self, index: int, max_len: int) -> tuple:
        """(sample id, input_ids, loss_mask, teacher_argmax, aux_hidden, final_hidden)."""
        number = self.shard_of[index]
        local = index - self.first[number]
        shard = self.shard(number)
        rows = shard.sample(local)
        rows = slice(rows.start, min(rows.stop, rows.start + max_len))
        return (shard.sample_ids[local], shard.input_ids[rows], shard.loss_mask[rows],
                shard.teacher_argmax[rows], shard.aux_hidden[rows], shard.final_hidden[rows])


def pack(order: list[int], lengths: list[int], budget: int, open_bins: int = 8) -> list[list[int]]:
    """Whole samples (``lengths`` already cut to max_len) into batches of at most ``budget``
    rows, first fit over the few newest open batches (keeps the shuffled order nearly intact)."""
    done, bins = [], []  # bins: [rows used, [sample indices]]
    for index in order:
        rows = lengths[index]
        for b in bins:
            if b[0] + rows <= budget:
                b[0] += rows
                b[1].append(index)
                break
        else:
            bins.append([rows, [index]])
            if len(bins) > open_bins:
                done.append(bins.pop(0)[1])
    return done + [b[1] for b in bins]


def plan_epoch(samples: Samples, epoch: int, cfg: dict) -> list[list[int]]:
    """The epoch's micro-batches (lists of global sample indices), a pure function of the seed."""
    rng = random.Random(f"eaglet-train:{cfg['seed']}:{epoch}")
    shard_order = list(range(len(samples.infos)))
    if cfg["shuffle"]:
        rng.shuffle(shard_order)
    window = cfg["shards_in_memory"] or len(shard_order)
    lengths = [min(n, cfg["max_len"]) for n in samples.lengths]
    batches = []
    for start in range(0, len(shard_order), window):
        order = [samples.first[s] + i for s in shard_order[start:start + window]
                 for i in range(len(samples.infos[s].lengths))]
        if cfg["shuffle"]:
            rng.shuffle(order)
        batches += pack(order, lengths, cfg["max_tokens_per_batch"])
    return batches


def steps_in(plan: list, group: int) -> int:
    return math.ceil(len(plan) / group)


def step_micro_batches(plan: list, step: int, group: int) -> list:
    """The ``group`` micro-batches of one optimizer step; the last step of an epoch wraps
    around to the epoch's first batches so that every rank has work."""
    return [plan[(step * group + i) % len(plan)] for i in range(group)]


@dataclass
class Batch:
    """A packed micro-batch laid out for TTT (T rows, K steps)."""

    aux: torch.Tensor             # [T, A*H] aux features of each row
    final: torch.Tensor           # [T, H] the target's final-norm output (teacher)
    teacher_argmax: torch.Tensor  # [T] the target's full-vocab argmax (predicts row + 1)
    step_ids: torch.Tensor        # [K, T] token embedded by each row at step k (t+1+k)
    positions: torch.Tensor       # [T] position within the sample
    segments: torch.Tensor        # [T] packed sample number
    rows: list[torch.Tensor]      # K x [n_k] rows whose step-k prediction counts
    sample_ids: list[str]

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    def counts(self) -> torch.Tensor:
        return torch.tensor([r.numel() for r in self.rows], dtype=torch.float64)

    def to(self, device: torch.device) -> "Batch":
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return Batch(move(self.aux), move(self.final), move(self.teacher_argmax),
                     move(self.step_ids), move(self.positions), move(self.segments),
                     [move(r) for r in self.rows], self.sample_ids)


def make_batch(pieces: list[tuple], ttt_steps: int, t2d: torch.Tensor,
               prompt_loss: bool = False) -> Batch:
    """Pack samples (as ``Samples.get`` returns them) into one TTT batch. ``prompt_loss``:
    prompt tokens count too (the target's distribution exists there as well). The shards
    store the target's full-vocabulary argmax only where it predicts an answer token (-1
    elsewhere), so a prompt position is not filtered by it: its teacher is the target's
    distribution over the draft vocabulary, as everywhere."""
    ids, loss_mask, argmax = (torch.cat([p[i] for p in pieces]) for i in (1, 2, 3))
    unchecked = torch.zeros_like(argmax, dtype=torch.bool)  # rows with no stored argmax
    if prompt_loss:
        loss_mask = torch.ones_like(loss_mask)
        unchecked = argmax < 0
    lengths = torch.tensor([p[1].numel() for p in pieces])
    starts = torch.cumsum(lengths, 0) - lengths
    segments = torch.repeat_interleave(torch.arange(len(pieces)), lengths)
    end = (starts + lengths)[segments]                   # [T] first row after the row's sample
    row = torch.arange(ids.numel())
    step_ids, rows = [], []
    for k in range(ttt_steps):
        step_ids.append(ids[torch.minimum(row + 1 + k, end - 1)])
        predicted = row + 2 + k                          # the token step k predicts
        inside = predicted < end
        predicted = torch.minimum(predicted, end - 1)
        in_vocab = t2d[argmax[predicted - 1].clamp(min=0)] | unchecked[predicted - 1]
        valid = inside & loss_mask[predicted].bool() & in_vocab
        rows.append(valid.nonzero().squeeze(1))
    return Batch(torch.cat([p[4] for p in pieces]), torch.cat([p[5] for p in pieces]), argmax,
                 torch.stack(step_ids), row - starts[segments], segments, rows,
                 [p[0] for p in pieces])


def add_feature_noise(aux: torch.Tensor, layers: int, scale: float,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """``aux`` [T, layers*H] plus Gaussian noise of ``scale`` times each row's RMS per layer."""
    x = aux.float().view(aux.shape[0], layers, -1)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    return (x + scale * rms * noise).view_as(aux).to(aux.dtype)
