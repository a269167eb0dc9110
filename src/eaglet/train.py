"""Train the EAGLE-3 drafter on the target's hidden-state shards with training-time test (TTT).

Data: every sample of the shards, shuffled per epoch (seeded), packed whole into micro-batches
of at most ``max_tokens_per_batch`` rows; a sample longer than ``max_len`` is cut to its first
``max_len`` tokens. One optimizer step consumes ``world_size * grad_accum`` micro-batches, and
its loss is normalized by the valid positions of all of them, so N ranks compute exactly what
one process accumulating N micro-batches computes.

Loss: at TTT step ``k`` row ``t`` predicts token ``t+2+k`` (see ``eaglet.drafter``); the
teacher is the target's distribution at position ``t+1+k`` restricted to the draft vocabulary
(softmax of ``final_hidden @ lm_head[draft ids].T``). A position counts when that token lies
in the sample, is a completion token (loss_mask 1) and the target's argmax there is in the
draft vocabulary. ``loss = sum_k ttt_decay**k * mean cross-entropy_k``.

Files: checkpoints ``checkpoint_dir/step_XXXXXXXX/`` (weights, optimizer, schedule, RNG and the
data position, each directory renamed into place whole); ``training_log.csv`` rewritten
atomically at every logged step (live copy in ``checkpoint_dir``, final copy in ``out_dir``);
the drafter in vLLM's format in ``out_dir`` (``eaglet.export``). A rerun continues from the
newest checkpoint and ends with the weights an uninterrupted run would have.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import logging
import math
import os
import random
import shutil
import subprocess
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from eaglet import rates
from eaglet import shards as shard_format
from eaglet.config import ADDED_LATER, ConfigError, validate
from eaglet.drafter import (DrafterConfig, Eagle3Drafter, init_from_target_layer, init_lm_head,
                            num_params)
from eaglet.export import export_drafter
from eaglet.io import atomic_open, human_size, read_json, write_json
from eaglet.progress import Progress
from eaglet.target import (load_target_embedding, load_target_layer, load_target_lm_head,
                           model_identity, read_target_config, text_config)
from eaglet.tracking import Trackers
from eaglet.vocab import load_vocab_map

log = logging.getLogger("eaglet.train")

# keys that may change between a run and its resumption without changing the result
RESUME_FREE = {"log_every", "eval_every", "checkpoint_every", "keep_checkpoints", "resume",
               "device", "precision", "export_dtype", "report_to"}


class TrainError(RuntimeError):
    """The inputs or the run cannot go on; the message says what to change."""


def settings(cfg: dict) -> dict:
    """The train section with the schema's defaults filled in and checked against it
    (config_schema.yaml documents every key), plus the check the schema cannot express."""
    try:
        out = validate({"train": dict(cfg)})["train"]
    except ConfigError as error:
        raise TrainError(str(error)) from None
    out.pop("gpus")  # the job's GPUs (torchrun's processes), not a training setting
    if out["max_len"] is None:
        out["max_len"] = out["max_tokens_per_batch"]
    if out["max_len"] > out["max_tokens_per_batch"]:
        raise TrainError(f"train.max_len {out['max_len']} exceeds train.max_tokens_per_batch "
                         f"{out['max_tokens_per_batch']}: a sample must fit one batch")
    return out


# -- inputs and their checks -----------------------------------------------------------------

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


# -- data ------------------------------------------------------------------------------------

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


# -- loss ------------------------------------------------------------------------------------

def batch_sums(model, batch: Batch, teacher_head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per TTT step: summed cross-entropy against the teacher (differentiable) [K] and the
    number of top-1 agreements with the target's argmax [K]. ``model`` may be DDP-wrapped."""
    drafter = getattr(model, "module", model)
    logits = model(batch.aux, batch.step_ids, batch.positions, batch.segments, batch.rows)
    with torch.no_grad():
        teacher = torch.softmax((batch.final @ teacher_head.T).float(), dim=-1)   # [T, Vd]
    ce, agree = [], []
    for k, (z, rows) in enumerate(zip(logits, batch.rows)):
        z, target_rows = z.float(), rows + 1 + k
        ce.append((torch.logsumexp(z, -1) - (teacher[target_rows] * z).sum(-1)).sum())
        agree.append((drafter.to_target_ids(z.argmax(-1)) == batch.teacher_argmax[target_rows]).sum())
    return torch.stack(ce), torch.stack(agree).double()


def summarize(ce: torch.Tensor, counts: torch.Tensor, agree: torch.Tensor, decay: float) -> dict:
    """Loss, per-step accuracy and simulated acceptance length from summed statistics."""
    n = counts.clamp(min=1)
    weights = decay ** torch.arange(len(ce), dtype=torch.float64)
    acc = (agree / n).tolist()
    return {"loss": float((weights * ce / n).sum()),
            **{f"acc_{k}": a for k, a in enumerate(acc)},
            "sim_al": 1.0 + sum(math.prod(acc[:k + 1]) for k in range(len(acc)))}


# -- distributed -----------------------------------------------------------------------------

@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    owns_group: bool = False

    def all_reduce(self, tensor: torch.Tensor, op=None) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM)
        return tensor


def resolve_device(name: str) -> torch.device:
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise TrainError("train.device is cuda but no CUDA device is visible; set device: cpu")
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def init_distributed(device: torch.device) -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), owns)


# -- checkpoints and the log -----------------------------------------------------------------

def write_csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    with atomic_open(path, "w") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def checkpoints(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("step_*") if p.is_dir() and p.name[5:].isdigit())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fingerprint_differences(was: dict, now: dict) -> list[str]:
    """What differs between a checkpoint's fingerprint and this run's; settings added to
    eaglet later count only when set away from the behaviour before them."""
    later = ADDED_LATER["train"]
    what = sorted(k for k in set(was["train"]) | set(now["train"])
                  if was["train"].get(k, later.get(k)) != now["train"].get(k, later.get(k)))
    return what + [k for k in ("shards", "sample_ids_sha256", "micro_batches_per_step")
                   if was.get(k) != now[k]]


def fingerprint(cfg: dict, infos: list[ShardInfo], group: int) -> dict:
    """What a checkpoint must share with the run that resumes it."""
    samples = hashlib.sha256(json.dumps([i.sample_ids for i in infos]).encode()).hexdigest()
    return {"train": {k: v for k, v in cfg.items() if k not in RESUME_FREE},
            "shards": [Path(i.path).name for i in infos], "sample_ids_sha256": samples,
            "micro_batches_per_step": group}


# -- the run ---------------------------------------------------------------------------------

class Trainer:
    def __init__(self, cfg: dict, shard_paths, eval_shard_paths, vocab_map: str, target_dir: str,
                 checkpoint_dir: str, device: torch.device, dist_: Dist,
                 manifest: str | None = None):
        self.cfg, self.dist, self.device = cfg, dist_, device
        self.checkpoint_dir = Path(checkpoint_dir)
        self.trackers = Trackers([], self.checkpoint_dir / "tracking", cfg)  # train() opens them
        self.group = dist_.world * cfg["grad_accum"]
        if not shard_paths:
            raise TrainError("no training shards: the extract stage produced none")
        target_config = read_target_config(target_dir)
        text = text_config(target_config)
        d2t, t2d = load_vocab_map(vocab_map)
        check_vocab_map(text, d2t, t2d)
        hashes = manifest_hashes(manifest, shard_paths + eval_shard_paths) if manifest else {}
        infos = [index_shard(p, t2d.numel(), hashes.get(p)) for p in shard_paths]
        eval_infos = [index_shard(p, t2d.numel(), hashes.get(p)) for p in eval_shard_paths]
        check_shards(infos + eval_infos, text, target_dir)
        self.train_data = Samples(infos, cfg["shards_in_memory"])
        self.eval_data = Samples(eval_infos, cfg["shards_in_memory"])
        self.train_data.preload()
        self.eval_data.preload()
        self.t2d = t2d
        self.fingerprint = fingerprint(cfg, infos, self.group)

        torch.manual_seed(cfg["seed"])
        config = DrafterConfig.from_target(target_config, d2t.numel(), infos[0].aux_layer_ids)
        embed = load_target_embedding(target_dir)
        self.teacher_head = load_target_lm_head(target_dir, torch.arange(d2t.numel()) + d2t)
        self.model = Eagle3Drafter(config, embed, d2t, t2d)
        self.num_aux = len(config.aux_layer_ids)
        if cfg["lm_head_init"] == "target":
            init_lm_head(self.model, self.teacher_head)
        if cfg["layer_init"] == "target":
            last = text["num_hidden_layers"] - 1
            init_from_target_layer(self.model, load_target_layer(target_dir, last))
        self.model.to(device)
        self.teacher_head = self.teacher_head.to(device)
        decay = [p for n, p in self.model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg["weight_decay"]},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg["lr"], betas=tuple(cfg["betas"]))
        self.plans = {0: plan_epoch(self.train_data, 0, cfg)}
        self.total_steps = self.count_steps()
        warmup = (cfg["warmup_steps"] if cfg["warmup_steps"] is not None
                  else math.ceil(cfg["warmup_ratio"] * self.total_steps))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, warmup, self.total_steps, cfg["min_lr_ratio"]))
        self.eval_plan = pack(list(range(len(self.eval_data))),
                              [min(n, cfg["max_len"]) for n in self.eval_data.lengths],
                              cfg["max_tokens_per_batch"])
        self.columns = (["step", "epoch", "split", "loss"]
                        + [f"acc_{k}" for k in range(cfg["ttt_steps"])]
                        + ["sim_al", "lr", "tokens_per_s"])
        self.rows: list[dict] = []
        self.step, self.epoch, self.next_in_epoch = 0, 0, 0
        self.wrapped = self.model
        if dist_.world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP
            DDP._set_params_and_buffers_to_ignore_for_model(self.model, list(Eagle3Drafter.CONSTANT_BUFFERS))
            self.wrapped = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None,
                               broadcast_buffers=False)
        if dist_.rank == 0:
            log.info("drafter: %.1fM trainable parameters, draft vocab %d, aux layers %s, "
                     "%d training samples in %d shards, %d held out, %d steps",
                     num_params(self.model) / 1e6, d2t.numel(), config.aux_layer_ids,
                     len(self.train_data), len(infos), len(self.eval_data), self.total_steps)

    # -- schedule and data position --

    def plan(self, epoch: int) -> list[list[int]]:
        if epoch not in self.plans:
            self.plans = {epoch: plan_epoch(self.train_data, epoch, self.cfg)}
        return self.plans[epoch]

    def count_steps(self) -> int:
        total = sum(steps_in(plan_epoch(self.train_data, e, self.cfg), self.group)
                    for e in range(self.cfg["epochs"]))
        return min(total, self.cfg["max_steps"] or total)

    def autocast(self):
        precision = self.cfg["precision"]
        if precision == "auto":
            precision = "bfloat16" if self.device.type == "cuda" else "float32"
        if precision == "float32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def load_batch(self, data: Samples, indices: list[int]) -> Batch:
        pieces = [data.get(i, self.cfg["max_len"]) for i in indices]
        # held-out metrics stay on the answers, what speculation drafts
        training = data is self.train_data
        batch = make_batch(pieces, self.cfg["ttt_steps"], self.t2d,
                           self.cfg["loss_on_prompt"] and training).to(self.device)
        if training and self.cfg["feature_noise"]:
            batch.aux = add_feature_noise(batch.aux, self.num_aux, self.cfg["feature_noise"])
        return batch

    # -- checkpoints --

    def check_disk(self) -> None:
        """Before the first step: room for the checkpoints still to come (one more than
        train.keep_checkpoints exists while the newest is written) and the drafter."""
        state = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        per_checkpoint = state + 2 * params  # weights, and AdamW's two moments
        to_write = max(self.cfg["keep_checkpoints"] + 1 - len(checkpoints(self.checkpoint_dir)), 1)
        needed = to_write * per_checkpoint + state
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.checkpoint_dir).free
        if needed > free:
            raise TrainError(
                f"not enough disk for training: about {human_size(needed)} still to write "
                f"({to_write} checkpoints of {human_size(per_checkpoint)} and the drafter), "
                f"{human_size(free)} free on {self.checkpoint_dir}. Free space, lower "
                f"train.keep_checkpoints, or point results_dir at a larger disk.")

    def save_checkpoint(self) -> None:
        if self.dist.rank != 0:
            return
        final = self.checkpoint_dir / f"step_{self.step:08d}"
        tmp = self.checkpoint_dir / f".step_{self.step:08d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        with atomic_open(tmp / "model.safetensors", "wb") as handle:
            handle.write(save_safetensors({k: v.detach().cpu().contiguous()
                                           for k, v in self.model.state_dict().items()}))
        with atomic_open(tmp / "trainer.pt", "wb") as handle:
            torch.save({"optimizer": self.optimizer.state_dict(),
                        "scheduler": self.scheduler.state_dict(),
                        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}},
                       handle)
        write_json(tmp / "state.json", {
            "step": self.step, "epoch": self.epoch, "next_in_epoch": self.next_in_epoch,
            "epoch_plan": self.plan(self.epoch), "total_steps": self.total_steps,
            "fingerprint": self.fingerprint, "log": self.rows})
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(self.checkpoint_dir)
        for old in checkpoints(self.checkpoint_dir)[:-self.cfg["keep_checkpoints"]]:
            shutil.rmtree(old, ignore_errors=True)

    def resume(self) -> Path | None:
        found = checkpoints(self.checkpoint_dir)
        if found and not self.cfg["resume"]:  # start over: an old step number must not win later
            log.warning("train.resume is false: deleting %d old checkpoints in %s", len(found),
                        self.checkpoint_dir)
            if self.dist.rank == 0:
                for old in found:
                    shutil.rmtree(old)
            return None
        if not found:
            return None
        path = found[-1]
        state = read_json(path / "state.json")
        what = fingerprint_differences(state["fingerprint"], self.fingerprint)
        if what and state["step"] >= state.get("total_steps", float("inf")):
            # a finished training with other settings: nothing of it to resume (its drafter
            # is what this run replaces), so changed settings simply train again
            log.warning("the checkpoints in %s are of a finished training with other settings "
                        "or data (%s differ): deleting them and starting over",
                        self.checkpoint_dir, ", ".join(what))
            if self.dist.rank == 0:
                for old in found:
                    shutil.rmtree(old)
            return None
        if what:
            raise TrainError(f"the checkpoint {path} of an unfinished training (step "
                             f"{state['step']}) belongs to other settings or data "
                             f"({', '.join(what)} differ): restore them to resume it, or delete "
                             f"{self.checkpoint_dir} (or set train.resume: false) to start over")
        with open(path / "model.safetensors", "rb") as handle:
            self.model.load_state_dict(load_safetensors(handle.read()))
        trainer = torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)
        self.optimizer.load_state_dict(trainer["optimizer"])
        self.scheduler.load_state_dict(trainer["scheduler"])
        torch.set_rng_state(trainer["rng"]["torch"])
        random.setstate(trainer["rng"]["python"])
        if trainer["rng"]["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(trainer["rng"]["cuda"])
        self.step, self.epoch, self.next_in_epoch = (state["step"], state["epoch"],
                                                     state["next_in_epoch"])
        self.plans = {self.epoch: state["epoch_plan"]}
        self.rows = state["log"]
        log.info("resumed from %s (step %d/%d)", path, self.step, self.total_steps)
        return path

    # -- one optimizer step --

    def train_step(self, micro: list[list[int]]) -> tuple[torch.Tensor, int]:
        """One optimizer step over this rank's share of ``micro``; returns this rank's summed
        [cross-entropy, valid positions, agreements] per TTT step [3, K] and its rows."""
        cfg, K = self.cfg, self.cfg["ttt_steps"]
        mine = micro[self.dist.rank * cfg["grad_accum"]:(self.dist.rank + 1) * cfg["grad_accum"]]
        batches = [self.load_batch(self.train_data, m) for m in mine]
        local_counts = sum(b.counts() for b in batches).to(self.device)
        counts = self.dist.all_reduce(local_counts.clone())  # valid positions of the whole step
        weights = cfg["ttt_decay"] ** torch.arange(K, dtype=torch.float64, device=self.device)
        scale = (weights / counts.clamp(min=1) * self.dist.world).float()
        self.wrapped.train()
        self.optimizer.zero_grad(set_to_none=True)
        ce_total = torch.zeros(K, dtype=torch.float64, device=self.device)
        agree_total = torch.zeros_like(ce_total)
        losses = []  # checked once per step, not per micro-batch: no host sync in the loop
        for i, batch in enumerate(batches):
            sync = i == len(batches) - 1 or self.dist.world == 1
            with (contextlib.nullcontext() if sync else self.wrapped.no_sync()), self.autocast():
                ce, agree = batch_sums(self.wrapped, batch, self.teacher_head)
                loss = (scale * ce).sum()
            loss.backward()
            losses.append(loss.detach())
            ce_total += ce.detach().double()
            agree_total += agree
        self.check_losses(losses, batches)  # before the optimizer can take a non-finite step
        if cfg["grad_clip"]:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg["grad_clip"])
            if not torch.isfinite(norm):
                self.fail(f"non-finite gradient norm ({float(norm):.4g})", batches[-1])
        self.optimizer.step()
        self.scheduler.step()
        return torch.stack([ce_total, local_counts, agree_total]), sum(b.num_tokens for b in batches)

    def check_losses(self, losses: list[torch.Tensor], batches: list[Batch]) -> None:
        """Fail naming the micro-batches whose loss is not finite, on any rank: one host
        sync (and one all-reduce) per optimizer step."""
        finite = torch.isfinite(torch.stack(losses)) if losses else torch.ones(0, dtype=torch.bool)
        everywhere = finite.all().float().reshape(1).to(self.device)  # the one sync below
        if self.dist.world > 1:
            everywhere = self.dist.all_reduce(everywhere, dist.ReduceOp.MIN)
        if bool(everywhere):
            return
        bad = [i for i, ok in enumerate(finite.tolist()) if not ok]
        if not bad:
            self.fail("non-finite loss on another rank", *batches)
        values = ", ".join(f"{float(losses[i]):.4g}" for i in bad)
        self.fail(f"non-finite loss ({values} here)", *(batches[i] for i in bad))

    def fail(self, what: str, *batches: Batch) -> None:
        kept = checkpoints(self.checkpoint_dir)
        samples = ", ".join(i for batch in batches for i in batch.sample_ids)
        where = "the batch" if len(batches) == 1 else f"these {len(batches)} micro-batches"
        raise TrainError(
            f"{what} at step {self.step + 1} (epoch {self.epoch + 1}, batch "
            f"{self.next_in_epoch + 1}); samples in {where}: {samples}. "
            f"The last good checkpoint is {kept[-1] if kept else '(none yet)'}; check these "
            f"samples' features (rerun extract for their shard) or lower train.lr, then rerun")

    @torch.no_grad()
    def evaluate(self) -> dict:
        K = self.cfg["ttt_steps"]
        sums = torch.zeros(3, K, dtype=torch.float64, device=self.device)
        self.model.eval()
        for indices in self.eval_plan[self.dist.rank::self.dist.world]:
            batch = self.load_batch(self.eval_data, indices)
            with self.autocast():
                ce, agree = batch_sums(self.model, batch, self.teacher_head)
            sums += torch.stack([ce.double(), batch.counts().to(self.device), agree])
        ce, counts, agree = self.dist.all_reduce(sums).cpu()
        return summarize(ce, counts, agree, self.cfg["ttt_decay"])

    # -- the loop --

    def log_row(self, split: str, metrics: dict, **extra) -> None:
        plan_len = steps_in(self.plan(self.epoch), self.group)
        row = {"step": self.step, "epoch": round(self.epoch + self.next_in_epoch / plan_len, 4),
               "split": split, **{k: round(v, 6) for k, v in metrics.items()}, "lr": "",
               "tokens_per_s": "", **extra}
        self.rows.append(row)
        if self.dist.rank != 0:
            return
        self.trackers.log(row)
        accs = " ".join(f"{metrics[f'acc_{k}']:.3f}" for k in range(self.cfg["ttt_steps"]))
        log.info("%s step %d/%d epoch %.2f: loss %.4f acc %s sim_al %.3f", split, self.step,
                 self.total_steps, row["epoch"], metrics["loss"], accs, metrics["sim_al"])
        write_csv(self.checkpoint_dir / "training_log.csv", self.rows, self.columns)

    def run(self, progress: Progress | None, stop_after_steps: int | None = None) -> bool:
        """Train to the end (True), or until ``stop_after_steps`` (False: as if killed)."""
        cfg, K = self.cfg, self.cfg["ttt_steps"]
        window = torch.zeros(3, K, dtype=torch.float64, device=self.device)
        window_tokens, window_start = 0, time.monotonic()
        while self.step < self.total_steps and self.epoch < cfg["epochs"]:
            plan = self.plan(self.epoch)
            steps = steps_in(plan, self.group)
            if self.next_in_epoch >= steps:
                self.epoch, self.next_in_epoch = self.epoch + 1, 0
                continue
            sums, tokens = self.train_step(step_micro_batches(plan, self.next_in_epoch, self.group))
            self.step += 1
            self.next_in_epoch += 1
            window += sums
            window_tokens += tokens
            if progress is not None:
                progress.advance(done=1, tokens=tokens * self.dist.world)
            last = self.step == self.total_steps
            if self.step % cfg["log_every"] == 0 or last:
                sums = self.dist.all_reduce(window.clone()).cpu()
                rate = self.dist.world * window_tokens / (time.monotonic() - window_start)
                self.log_row("train", summarize(*sums, cfg["ttt_decay"]),
                             lr=f"{self.scheduler.get_last_lr()[0]:.6g}", tokens_per_s=round(rate, 1))
                window.zero_()
                window_tokens, window_start = 0, time.monotonic()
            epoch_end = self.next_in_epoch == steps
            due = (self.step % cfg["eval_every"] == 0) if cfg["eval_every"] else epoch_end
            if len(self.eval_data) and (due or last):
                self.log_row("eval", self.evaluate())
            if self.step % cfg["checkpoint_every"] == 0 or last:
                self.save_checkpoint()
            if stop_after_steps is not None and self.step >= stop_after_steps and not last:
                return False
        return True


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup from 0, then cosine decay to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def train(cfg: dict, shard_paths: list[str], eval_shard_paths: list[str], vocab_map: str,
          target_dir: str, out_dir: str, checkpoint_dir: str, progress_path: str | None,
          log_path: str | None, *, rate_key: str | None = None,
          stop_after_steps: int | None = None, manifest: str | None = None) -> dict:
    """Train a drafter and write ``out_dir/{config.json, model.safetensors, training_log.csv}``.

    Runs data-parallel when launched by ``torchrun`` (WORLD_SIZE > 1): each rank takes its
    share of every step's micro-batches and only rank 0 writes files. ``stop_after_steps``
    is a test hook: return after that many steps as if the process had been killed.
    ``manifest`` (``hidden/manifest.json``) holds the sha256 every shard must have: each
    shard is hashed as it is read, and a damaged one is moved aside and named in the error.
    ``rate_key`` (the target's spec) records the measured tokens/s in the rates history that
    `eaglet status` estimates later runs from; None (benchmarks, tests) records nothing.
    Returns the final metrics (last training and held-out rows, throughput).
    """
    cfg = settings(cfg)
    device = resolve_device(cfg["device"])
    dist_ = init_distributed(device)
    started = time.monotonic()
    trainer = None
    try:
        trainer = Trainer(cfg, list(shard_paths), list(eval_shard_paths), vocab_map, target_dir,
                          checkpoint_dir, device, dist_, manifest)
        trainer.resume()
        if dist_.rank == 0:
            trainer.check_disk()
            trainer.trackers = Trackers(cfg["report_to"], Path(checkpoint_dir) / "tracking", cfg)
        first_step = trainer.step
        progress = (Progress("train", total=trainer.total_steps, path=progress_path,
                             log_path=log_path, unit="steps", already_done=first_step)
                    if dist_.rank == 0 else None)
        finished = trainer.run(progress, stop_after_steps)
        if not finished:
            return {"stopped_at_step": trainer.step}
        if dist_.rank == 0:
            export_drafter(trainer.model, out_dir, cfg["export_dtype"])
            write_csv(Path(out_dir) / "training_log.csv", trainer.rows, trainer.columns)
            run = progress.report("finished")
            if rate_key is not None:
                rates.record("train", rate_key, tokens_per_s=run["tokens_per_s"],
                             ttt_steps=cfg["ttt_steps"])
        if dist_.world > 1:
            dist.barrier()
        last = {split: next((r for r in reversed(trainer.rows) if r["split"] == split), None)
                for split in ("train", "eval")}
        elapsed = time.monotonic() - started
        return {"steps": trainer.step, "resumed_from_step": first_step,
                "train": last["train"], "eval": last["eval"], "elapsed_s": elapsed}
    finally:
        if trainer is not None:
            trainer.trackers.close()
        if dist_.owns_group:
            dist.destroy_process_group()


def launch_torchrun(args: dict, nproc: int) -> None:
    """Run ``train(**args)`` data-parallel in ``nproc`` processes on this node under torchrun
    (one per GPU; gloo on CPU): the arguments go to ``checkpoint_dir/torchrun_args.json``
    and each process runs :func:`main` on them."""
    args_path = Path(args["checkpoint_dir"]) / "torchrun_args.json"
    write_json(args_path, args)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={nproc}", "-m", "eaglet.train", str(args_path)], check=True)


def main(argv: list[str] | None = None) -> None:
    """Worker of a multi-GPU run: ``python -m torch.distributed.run --nproc-per-node N -m
    eaglet.train ARGS.json``, ARGS.json holding ``train``'s keyword arguments."""
    from eaglet.scripting import run_stage
    args = read_json((argv or sys.argv[1:])[0])
    rank = int(os.environ.get("RANK", "0"))
    run_stage("train", args["log_path"] if rank == 0 else None, lambda: train(**args))


if __name__ == "__main__":
    main()
