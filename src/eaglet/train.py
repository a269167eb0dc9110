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
the drafter in vLLM's format in ``out_dir`` (``eaglet.export``) and ``out_dir/stats.json``
(the run's summary). A rerun continues from the newest checkpoint and ends with the weights an
uninterrupted run would have.

The drafter that ships is the one of the best held-out evaluation (highest simulated AL; a tie
goes to the later one), not necessarily the last: on small data the held-out curve flattens or
turns while the training loss still falls. Its weights are kept beside the checkpoints
(``train_checkpoints.save_best``) so that a resumed run ships it too. Without a held-out split
there is nothing to choose by, and the last weights ship; the log and stats.json say which.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import logging
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from eaglet import peagle, rates, ttt_loss
from eaglet import train_checkpoints as ckpt
from eaglet.config import ConfigError, validate
from eaglet.drafter import (DrafterConfig, Eagle3Drafter, compile_drafter, init_from_target,
                            init_lm_head, num_params, resolve_attention)
from eaglet.io import atomic_open, hold_directory, human_size, read_json, write_json
from eaglet.progress import Progress
from eaglet.shards import sha256_path
from eaglet.target import (load_target_embedding, load_target_lm_head, read_target_config,
                           text_config)
from eaglet.tracking import Trackers
from eaglet.train_data import (Batch, Prefetcher, Samples, TrainError, add_feature_noise,
                               check_shards, check_vocab_map, data_memory, index_shard,
                               make_batch, manifest_hashes, pack, plan_epoch, prefetch_depth,
                               step_micro_batches, steps_in)
from eaglet.vocab import load_vocab_map

log = logging.getLogger("eaglet.train")

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


# -- loss ------------------------------------------------------------------------------------

def batch_sums(model, batch: Batch, teacher_head: torch.Tensor, fused: bool = False,
               kernels: ttt_loss.ChunkKernels = ttt_loss.PLAIN
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per TTT step: summed cross-entropy against the teacher (differentiable) [K] and the
    number of top-1 agreements with the target's argmax [K]. ``model`` may be DDP-wrapped.
    ``fused``: the loss fused with lm_head, a chunk of rows at a time (``eaglet.ttt_loss``);
    the same values."""
    drafter = getattr(model, "module", model)
    if fused:
        states = model(batch.aux, batch.step_ids, batch.positions, batch.segments, batch.rows,
                       heads=False)
        t_logits, t_lse = ttt_loss.teacher(batch.final, teacher_head)
        weight = drafter.lm_head.weight.to(ttt_loss.compute_dtype_of(states[0]))  # cast once
        ce, agree = [], []
        for k, (h, rows) in enumerate(zip(states, batch.rows)):
            target_rows = rows + 1 + k
            loss, argmax = ttt_loss.head_loss(h, weight, t_logits, t_lse, target_rows, kernels)
            ce.append(loss)
            agree.append((drafter.to_target_ids(argmax) == batch.teacher_argmax[target_rows]).sum())
        return torch.stack(ce), torch.stack(agree).double()
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

    def all_gather(self, out: list, obj) -> None:
        """Every rank's ``obj`` (picklable) into ``out``, in rank order."""
        if self.world > 1:
            dist.all_gather_object(out, obj)
        else:
            out[:] = [obj]

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def resolve_compile(setting, device: torch.device) -> bool:
    """``train.compile``: auto compiles on CUDA (fused kernels pay there:
    benchmarks/results/gpu_check.md), not on the CPU, where compiling costs more than it saves
    on a run of the demo's size."""
    if setting == "auto":
        return device.type == "cuda"
    return bool(setting)


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


# -- the log ---------------------------------------------------------------------------------

def peak_rss_mb() -> float:
    """The peak resident memory of this process so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    with atomic_open(path, "w") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


# -- the run ---------------------------------------------------------------------------------

class Trainer:
    """One training run: the drafter, its optimizer and schedule, the data position, the log
    and the checkpoints. ``from_files`` builds it from a run's files; a caller with samples and
    a drafter of its own (``benchmarks/gpu_check.py``) builds it directly."""

    def __init__(self, cfg: dict, model: Eagle3Drafter, teacher_head: torch.Tensor,
                 train_data: Samples, eval_data: Samples, checkpoint_dir: str | Path,
                 device: torch.device, dist_: Dist, fingerprint: dict | None = None,
                 subset: set[int] | None = None):
        self.cfg, self.dist, self.device = cfg, dist_, device
        self.subset = subset  # the training samples trained on (global indices); None: all
        self.checkpoint_dir = Path(checkpoint_dir)
        self.trackers = Trackers([], self.checkpoint_dir / "tracking", cfg)  # train() opens them
        self.group = dist_.world * cfg["grad_accum"]
        self.train_data, self.eval_data = train_data, eval_data
        self.fingerprint = fingerprint
        self.model = model.to(device)
        try:  # the kernel of the TTT attention; the same math, so no part of the fingerprint
            self.model.attention = resolve_attention(cfg.get("attention", "auto"), device)
        except ValueError as error:
            raise TrainError(f"train.attention: {error}") from None
        # the step's kernels (fused loss, compiled elementwise work): the same math, no part
        # of the fingerprint either
        self.fused_loss = cfg.get("fused_loss", True)
        compiled = resolve_compile(cfg.get("compile", "auto"), device)
        compile_drafter(self.model, compiled)
        self.loss_kernels = ttt_loss.ChunkKernels(compiled)
        norms_before_fc = model.config.fc_norm or model.config.norm_before_fc
        # features as the matmuls read them (bf16 under bf16 autocast): a bf16 shard's are not
        # converted at all. Norms before fc read them in float32, as they always have.
        self.feature_dtype = (torch.bfloat16 if self.precision() == "bfloat16"
                              and not norms_before_fc else torch.float32)
        self.t2d = model.t2d.cpu()
        self.num_aux = len(model.config.aux_layer_ids)
        self.teacher_head = teacher_head.to(device)
        decay = [p for n, p in self.model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg["weight_decay"]},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg["lr"], betas=tuple(cfg["betas"]))
        self.plans = {0: self.epoch_plan(0)}
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
                        + ["sim_al", "lr", "tokens_per_s", "peak_rss_mb"])
        self.rows: list[dict] = []
        self.step, self.epoch, self.next_in_epoch = 0, 0, 0
        # the best held-out evaluation whose weights are kept (step, epoch, sim_al), and the
        # first step whose evaluations compete (later than 0 when a resumed run lost the best)
        self.best: dict | None = None
        self.best_since = 0
        self.wrapped = self.model
        if dist_.world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP
            DDP._set_params_and_buffers_to_ignore_for_model(self.model, list(Eagle3Drafter.CONSTANT_BUFFERS))
            self.wrapped = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None,
                               broadcast_buffers=False)

    @classmethod
    def from_files(cls, cfg: dict, shard_paths, eval_shard_paths, vocab_map: str,
                   target_dir: str, checkpoint_dir: str, device: torch.device, dist_: Dist,
                   manifest: str | None = None,
                   train_samples: list[str] | None = None,
                   stream: dict | None = None) -> "Trainer":
        """Check the shards and the vocabulary map against the target, and build the drafter
        from the target's embedding (and lm_head rows and last layer, as configured).
        ``train_samples``: the ids of the shards' samples to train on (None: all).
        ``stream``: the training samples' states come from the capture server as training
        reads them (``train.data: stream``, :func:`eaglet.train_stream.open_stream`'s
        argument), not from ``shard_paths``."""
        if not shard_paths and stream is None:
            raise TrainError("no training shards: the extract stage produced none")
        target_config = read_target_config(target_dir)
        text = text_config(target_config)
        d2t, t2d = load_vocab_map(vocab_map)
        check_vocab_map(text, d2t, t2d)
        hashes = manifest_hashes(manifest, shard_paths + eval_shard_paths) if manifest else {}
        eval_infos = [index_shard(p, t2d.numel(), hashes.get(p)) for p in eval_shard_paths]
        streamed = None
        if stream is not None:
            from eaglet.train_stream import open_stream
            streamed = open_stream(stream, cfg, dist_.rank, dist_.world, dist_)
            infos = streamed.infos
        else:
            infos = [index_shard(p, t2d.numel(), hashes.get(p)) for p in shard_paths]
        check_shards(infos + eval_infos, text, target_dir)
        cfg = {**cfg, "prefetch_batches": prefetch_depth(cfg["prefetch_batches"], device)}
        memory = data_memory(cfg, infos + eval_infos)  # shared: one budget per process
        train_data = streamed or Samples(infos, cfg["shards_in_memory"], memory)
        eval_data = Samples(eval_infos, cfg["shards_in_memory"], memory)
        train_data.preload()
        eval_data.preload()

        torch.manual_seed(cfg["seed"])
        config = DrafterConfig.from_target(target_config, d2t.numel(), infos[0].aux_layer_ids,
                                           cfg["drafter_attention"], cfg["drafter_variant"])
        embed = load_target_embedding(target_dir)
        teacher_head = load_target_lm_head(target_dir, torch.arange(d2t.numel()) + d2t)
        model = peagle.make_drafter(cfg["method"], target_config, config, embed, d2t, t2d)
        if cfg["lm_head_init"] == "target":
            init_lm_head(model, teacher_head)
        layer_init = {"setting": cfg["layer_init"]}
        if cfg["layer_init"] == "target":  # only the parts of the target's layer that fit
            fit = init_from_target(model, target_dir, text["num_hidden_layers"] - 1)
            layer_init = fit.record()
            if dist_.rank == 0:
                log.log(logging.WARNING if fit.reasons else logging.INFO, "%s", fit.message())
        group = dist_.world * cfg["grad_accum"]
        fingerprint = ckpt.fingerprint(cfg, infos, group, sha256_path(vocab_map))
        subset = None
        if train_samples is not None:
            index = {sid: i for i, sid in enumerate(s for info in infos for s in info.sample_ids)}
            missing = [sid for sid in train_samples if sid not in index]
            if missing or not train_samples:
                raise TrainError(f"{len(missing)} of the {len(train_samples)} samples to train on "
                                 f"are in no training shard (first: {missing[:1]}): name at least "
                                 "one, each from this run's hidden/manifest.json")
            subset = {index[sid] for sid in train_samples}
            # a checkpoint of another subset of the same shards must not resume this one
            fingerprint["sample_ids_sha256"] = hashlib.sha256(json.dumps(
                [fingerprint["sample_ids_sha256"], sorted(train_samples)]).encode()).hexdigest()
        trainer = cls(cfg, model, teacher_head, train_data, eval_data, checkpoint_dir, device,
                      dist_, fingerprint, subset)
        trainer.layer_init = layer_init  # in train()'s summary: what the layer started from
        if dist_.rank == 0:
            log.info("drafter: %.1fM trainable parameters, draft vocab %d, aux layers %s, "
                     "%s attention, %d training samples in %d shards, %d held out, %d steps",
                     num_params(model) / 1e6, d2t.numel(), config.aux_layer_ids, model.attention,
                     len(subset or train_data), len(infos), len(eval_data), trainer.total_steps)
        return trainer

    # -- schedule and data position --

    def plan(self, epoch: int) -> list[list[int]]:
        if epoch not in self.plans:
            self.plans = {epoch: self.epoch_plan(epoch)}
        return self.plans[epoch]

    def epoch_plan(self, epoch: int) -> list[list[int]]:
        """The epoch's micro-batches; with a subset, its samples in the epoch's shuffled order,
        packed again (the same settings over less data: ``eaglet.scaling``)."""
        plan = plan_epoch(self.train_data, epoch, self.cfg)
        if self.subset is None:
            return plan
        lengths = [min(n, self.cfg["max_len"]) for n in self.train_data.lengths]
        return pack([i for batch in plan for i in batch if i in self.subset], lengths,
                    self.cfg["max_tokens_per_batch"])

    def count_steps(self) -> int:
        total = sum(steps_in(self.epoch_plan(e), self.group)
                    for e in range(self.cfg["epochs"]))
        return min(total, self.cfg["max_steps"] or total)

    def precision(self) -> str:
        precision = self.cfg["precision"]
        if precision == "auto":
            precision = "bfloat16" if self.device.type == "cuda" else "float32"
        return precision

    def autocast(self):
        if self.precision() == "float32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def host_batch(self, data: Samples, indices: list[int]) -> Batch:
        """The micro-batch of these samples packed on the host, features in their stored
        dtype (page-locked for a CUDA device): what the prefetcher builds ahead."""
        pieces = [data.get(i, self.cfg["max_len"]) for i in indices]
        # held-out metrics stay on the answers, what speculation drafts
        training = data is self.train_data
        return make_batch(pieces, self.cfg["ttt_steps"], self.t2d,
                          self.cfg["loss_on_prompt"] and training,
                          pin=self.device.type == "cuda")

    def device_batch(self, batch: Batch, training: bool) -> Batch:
        """A host batch on the device, features in float32; the feature noise is drawn here,
        in the loop, so that the random stream (saved in checkpoints) does not depend on how
        far ahead batches were built."""
        batch = batch.to(self.device, self.feature_dtype)
        if training and self.cfg["feature_noise"]:
            batch.aux = add_feature_noise(batch.aux, self.num_aux, self.cfg["feature_noise"])
        return batch

    def load_batch(self, data: Samples, indices: list[int]) -> Batch:
        return self.device_batch(self.host_batch(data, indices), data is self.train_data)

    def share(self, micro: list[list[int]]) -> list[list[int]]:
        """This rank's micro-batches of one optimizer step's."""
        ga = self.cfg["grad_accum"]
        return micro[self.dist.rank * ga:(self.dist.rank + 1) * ga]

    def upcoming(self):
        """This rank's micro-batches from the current data position to the end of training,
        in the order :meth:`run` trains on them, each keyed (epoch, step in epoch, index)."""
        cfg, step, epoch, at = self.cfg, self.step, self.epoch, self.next_in_epoch
        plan = self.plan(epoch) if epoch < cfg["epochs"] else []
        while step < self.total_steps and epoch < cfg["epochs"]:
            if at >= steps_in(plan, self.group):
                epoch, at = epoch + 1, 0
                plan = self.epoch_plan(epoch) if epoch < cfg["epochs"] else []
                continue
            for i, indices in enumerate(self.share(step_micro_batches(plan, at, self.group))):
                yield (epoch, at, i), indices
            step, at = step + 1, at + 1

    def prefetcher(self) -> Prefetcher | None:
        if not self.cfg["prefetch_batches"]:
            return None
        feed = Prefetcher(lambda indices: self.host_batch(self.train_data, indices),
                          self.upcoming(), self.cfg["prefetch_batches"])
        ahead = getattr(self.train_data, "taken_ahead", None)
        if ahead is not None:  # streamed states: their server's turns wait for the steps
            ahead(feed.wait_for_consumer)
        return feed

    # -- checkpoints --

    def check_disk(self) -> None:
        """Before the first step: room for the checkpoints still to come (one more than
        train.keep_checkpoints exists while the newest is written) and the drafter."""
        state = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        per_checkpoint = state + 2 * params  # weights, and AdamW's two moments
        keep = self.cfg["keep_checkpoints"]
        to_write = max(keep + 1 - len(ckpt.checkpoints(self.checkpoint_dir)), 1)
        # the best held-out weights: one named by each kept checkpoint, one newer than them
        bests = (max(keep + 1 - len(ckpt.bests(self.checkpoint_dir)), 0)
                 if len(self.eval_data) else 0)
        needed = to_write * per_checkpoint + bests * state + state
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.checkpoint_dir).free
        if needed > free:
            raise TrainError(
                f"not enough disk for training: about {human_size(needed)} still to write "
                f"({to_write} checkpoints of {human_size(per_checkpoint)}, {bests} copies of "
                f"the best held-out weights and the drafter), "
                f"{human_size(free)} free on {self.checkpoint_dir}. Free space, lower "
                f"train.keep_checkpoints, or point results_dir at a larger disk.")

    def save_checkpoint(self) -> None:
        if self.dist.rank != 0:
            return
        ckpt.save(self.checkpoint_dir, self.step, self.model, self.optimizer, self.scheduler, {
            "step": self.step, "epoch": self.epoch, "next_in_epoch": self.next_in_epoch,
            "epoch_plan": self.plan(self.epoch), "total_steps": self.total_steps,
            "fingerprint": self.fingerprint, "log": self.rows, "best": self.best,
            "best_since": self.best_since}, self.cfg["keep_checkpoints"])

    def resume(self) -> Path | None:
        path = ckpt.to_resume(self.checkpoint_dir, self.fingerprint, self.cfg["resume"],
                              self.dist.rank)
        if path is None:
            return None
        state = ckpt.load(path, self.model, self.optimizer, self.scheduler)
        self.step, self.epoch, self.next_in_epoch = (state["step"], state["epoch"],
                                                     state["next_in_epoch"])
        self.plans = {self.epoch: state["epoch_plan"]}
        self.rows = state["log"]
        self.restore_best(state)
        log.info("resumed from %s (step %d/%d)", path, self.step, self.total_steps)
        return path

    def restore_best(self, state: dict) -> None:
        """The best held-out evaluation the checkpoint names, if its kept weights are still
        there; otherwise only the evaluations from here on compete, and the log says so."""
        self.best, self.best_since = state.get("best"), state.get("best_since", 0)
        evaluated = any(row["split"] == "eval" for row in self.rows)
        if self.best is not None and ckpt.best_path(self.checkpoint_dir, self.best,
                                                    self.fingerprint) is not None:
            return
        if self.best is None and not evaluated:
            return
        lost = (f"step {self.best['step']}, simulated AL {self.best['sim_al']:.3f}"
                if self.best else "the checkpoint predates kept best weights")
        log.warning("the weights of the best held-out evaluation before step %d (%s) are not in "
                    "%s: the drafter is chosen among the held-out evaluations from step %d on",
                    self.step, lost, self.checkpoint_dir, self.step)
        self.best, self.best_since = None, self.step

    # -- one optimizer step --

    def train_step(self, micro: list[list[int]],
                   host_batches: list[Batch] | None = None) -> tuple[torch.Tensor, int]:
        """One optimizer step over this rank's share of ``micro`` (``host_batches``: those
        micro-batches already packed, by the prefetcher; the list is emptied, each host copy
        let go once it is on the device); returns this rank's summed [cross-entropy, valid
        positions, agreements] per TTT step [3, K] and its rows."""
        cfg, K = self.cfg, self.cfg["ttt_steps"]
        if host_batches is None:
            host_batches = [self.host_batch(self.train_data, m) for m in self.share(micro)]
        batches = []
        while host_batches:
            batches.append(self.device_batch(host_batches.pop(0), training=True))
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
                ce, agree = batch_sums(self.wrapped, batch, self.teacher_head, self.fused_loss,
                                       self.loss_kernels)
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
        kept = ckpt.checkpoints(self.checkpoint_dir)
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
                ce, agree = batch_sums(self.model, batch, self.teacher_head, self.fused_loss,
                                       self.loss_kernels)
            sums += torch.stack([ce.double(), batch.counts().to(self.device), agree])
        ce, counts, agree = self.dist.all_reduce(sums).cpu()
        return summarize(ce, counts, agree, self.cfg["ttt_decay"])

    # -- the loop --

    def log_row(self, split: str, metrics: dict, **extra) -> dict:
        plan_len = steps_in(self.plan(self.epoch), self.group)
        row = {"step": self.step, "epoch": round(self.epoch + self.next_in_epoch / plan_len, 4),
               "split": split, **{k: round(v, 6) for k, v in metrics.items()}, "lr": "",
               "tokens_per_s": "", "peak_rss_mb": "", **extra}
        self.rows.append(row)
        if self.dist.rank != 0:
            return row
        self.trackers.log(row)
        accs = " ".join(f"{metrics[f'acc_{k}']:.3f}" for k in range(self.cfg["ttt_steps"]))
        rss = f" peak RSS {row['peak_rss_mb']:.0f} MiB" if row["peak_rss_mb"] != "" else ""
        log.info("%s step %d/%d epoch %.2f: loss %.4f acc %s sim_al %.3f%s", split, self.step,
                 self.total_steps, row["epoch"], metrics["loss"], accs, metrics["sim_al"], rss)
        write_csv(self.checkpoint_dir / "training_log.csv", self.rows, self.columns)
        return row

    def consider(self, row: dict) -> None:
        """Keep this held-out evaluation's weights if its simulated AL (as logged) is the best
        so far; a tie goes to the later one. Every rank keeps the record (the metrics are
        all-reduced), rank 0 the weights."""
        if self.best is not None and row["sim_al"] < self.best["sim_al"]:
            return
        self.best = {"step": row["step"], "epoch": row["epoch"], "sim_al": row["sim_al"]}
        if self.dist.rank == 0:
            ckpt.save_best(self.checkpoint_dir, self.best, self.model, self.fingerprint)

    def ship(self) -> dict:
        """Put the weights to export in the model: the best held-out evaluation's, else the
        last; returns what was chosen and against what, and logs it."""
        evals = [row for row in self.rows if row["split"] == "eval"]
        last = evals[-1] if evals else (self.rows[-1] if self.rows else {"epoch": 0})
        best = self.best
        choice = {"choice": "last", "step": self.step, "epoch": last["epoch"],
                  "heldout_al": evals[-1]["sim_al"] if evals else None,
                  "best_step": best and best["step"], "best_epoch": best and best["epoch"],
                  "best_heldout_al": best and best["sim_al"], "last_epoch": last["epoch"],
                  "last_epoch_al": evals[-1]["sim_al"] if evals else None,
                  "chosen_from_step": self.best_since}
        if not evals:
            note = ("no held-out split, so no held-out simulated AL to choose by: the last "
                    f"weights ship ({where(choice)})")
        elif best is None:  # resumed at the end, the best's weights gone
            note = (f"the best held-out weights before step {self.best_since} are gone: the "
                    f"last weights ship ({where(choice)}, held-out simulated AL "
                    f"{last['sim_al']:.3f})")
        elif best["step"] == self.step:
            note = (f"the last weights ship ({where(choice)}): their held-out simulated AL "
                    f"{last['sim_al']:.3f} is the best")
        else:
            self.model.load_state_dict(ckpt.load_best(self.best_weights()))
            choice.update(choice="best", step=best["step"], epoch=best["epoch"],
                          heldout_al=best["sim_al"])
            note = (f"the best held-out weights ship ({where(choice)}): held-out simulated AL "
                    f"{best['sim_al']:.3f}, against {last['sim_al']:.3f} at the last "
                    f"evaluation ({where(last)})")
        if self.best_since and best is not None:
            note += f"; chosen among the evaluations from step {self.best_since} on"
        choice["note"] = note
        log.info("%s", note)
        return choice

    def best_weights(self) -> Path:
        path = ckpt.best_path(self.checkpoint_dir, self.best, self.fingerprint)
        if path is None:
            raise TrainError(
                f"the weights of the best held-out evaluation (step {self.best['step']}) are "
                f"missing from {self.checkpoint_dir} or are of another training: rerun with "
                f"train.resume: false to train again")
        return path

    def run(self, progress: Progress | None, stop_after_steps: int | None = None) -> bool:
        """Train to the end (True), or until ``stop_after_steps`` (False: as if killed)."""
        start = getattr(self.train_data, "start", None)
        if start is not None:  # streamed states: asked for in the order training reads them
            upcoming = [indices for _, indices in self.upcoming()]
            start([i for indices in upcoming for i in indices], progress,
                  max(map(len, upcoming), default=0))
        feed = self.prefetcher()
        try:
            return self._run(progress, stop_after_steps, feed)
        finally:
            if feed is not None:
                feed.close()

    def _run(self, progress: Progress | None, stop_after_steps: int | None,
             feed: Prefetcher | None) -> bool:
        cfg, K = self.cfg, self.cfg["ttt_steps"]
        window = torch.zeros(3, K, dtype=torch.float64, device=self.device)
        window_tokens, window_start = 0, time.monotonic()
        while self.step < self.total_steps and self.epoch < cfg["epochs"]:
            plan = self.plan(self.epoch)
            steps = steps_in(plan, self.group)
            if self.next_in_epoch >= steps:
                self.epoch, self.next_in_epoch = self.epoch + 1, 0
                continue
            micro = step_micro_batches(plan, self.next_in_epoch, self.group)
            ready = None if feed is None else [
                feed.take((self.epoch, self.next_in_epoch, i))
                for i in range(len(self.share(micro)))]
            sums, tokens = self.train_step(micro, ready)
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
                rss = self.dist.all_reduce(torch.tensor([peak_rss_mb()], device=self.device),
                                           dist.ReduceOp.MAX if self.dist.world > 1 else None)
                self.log_row("train", summarize(*sums, cfg["ttt_decay"]),
                             lr=f"{self.scheduler.get_last_lr()[0]:.6g}", tokens_per_s=round(rate, 1),
                             peak_rss_mb=round(float(rss), 1))
                window.zero_()
                window_tokens, window_start = 0, time.monotonic()
            epoch_end = self.next_in_epoch == steps
            due = (self.step % cfg["eval_every"] == 0) if cfg["eval_every"] else epoch_end
            if len(self.eval_data) and (due or last):
                self.consider(self.log_row("eval", self.evaluate()))
            if self.step % cfg["checkpoint_every"] == 0 or last:
                self.save_checkpoint()
            if stop_after_steps is not None and self.step >= stop_after_steps and not last:
                return False
        return True


def where(row: dict) -> str:
    """A logged row's (or a choice's) place in training, as the log names it."""
    return f"epoch {row['epoch']:g}, step {row['step']}"


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup from 0, then cosine decay to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def train(cfg: dict, shard_paths: list[str], eval_shard_paths: list[str], vocab_map: str,
          target_dir: str, out_dir: str, checkpoint_dir: str, progress_path: str | None,
          log_path: str | None, *, rate_key: str | None = None,
          stop_after_steps: int | None = None, manifest: str | None = None,
          train_samples: list[str] | None = None, stream: dict | None = None) -> dict:
    """Train a drafter and write ``out_dir/{config.json, model.safetensors, training_log.csv,
    stats.json}``: the weights of the best held-out evaluation (see the module's docstring).

    Runs data-parallel when launched by ``torchrun`` (WORLD_SIZE > 1): each rank takes its
    share of every step's micro-batches and only rank 0 writes files. ``stop_after_steps``
    is a test hook: return after that many steps as if the process had been killed.
    ``manifest`` (``hidden/manifest.json``) holds the sha256 every shard must have: each
    shard is hashed as it is read, and a damaged one is moved aside and named in the error.
    ``rate_key`` (the target's spec) records the measured tokens/s in the rates history that
    `eaglet status` estimates later runs from; None (benchmarks, tests) records nothing.
    ``train_samples``: the ids of the samples to train on, a subset of the shards' (None: all).
    ``stream``: ``train.data: stream``, the training samples' states from the capture server
    (see :func:`eaglet.train_stream.open_stream`); ``shard_paths`` is then empty.
    Returns the run's summary, as stats.json holds it: the last training and held-out rows,
    throughput, and (rank 0) ``shipped``: which weights were exported (``choice`` best or
    last, their ``step``, ``epoch`` and ``heldout_al``) against ``best_epoch``/
    ``best_heldout_al`` and ``last_epoch``/``last_epoch_al``, with a ``note`` saying so.
    """
    cfg = settings(cfg)
    device = resolve_device(cfg["device"])
    dist_ = init_distributed(device)
    # rank 0 holds the checkpoints: a trainer still running (a killed Snakemake's orphan) and
    # its rerun would both write them, and an old drafter could land after the rerun's
    with (hold_directory(checkpoint_dir, "train") if dist_.rank == 0
          else contextlib.nullcontext()):
        return _train(cfg, device, dist_, shard_paths, eval_shard_paths, vocab_map, target_dir,
                      out_dir, checkpoint_dir, progress_path, log_path, rate_key,
                      stop_after_steps, manifest, train_samples, stream)


def _train(cfg, device, dist_, shard_paths, eval_shard_paths, vocab_map, target_dir, out_dir,
           checkpoint_dir, progress_path, log_path, rate_key, stop_after_steps, manifest,
           train_samples, stream) -> dict:
    started = time.monotonic()
    trainer = None
    try:
        trainer = Trainer.from_files(cfg, list(shard_paths), list(eval_shard_paths), vocab_map,
                                     target_dir,
                          checkpoint_dir, device, dist_, manifest, train_samples, stream)
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
        last = {split: next((r for r in reversed(trainer.rows) if r["split"] == split), None)
                for split in ("train", "eval")}
        summary = {"steps": trainer.step, "resumed_from_step": first_step,
                   "train": last["train"], "eval": last["eval"],
                   "layer_init": trainer.layer_init}
        if stream is not None:  # every rank's feed
            summary["stream"] = trainer.train_data.summary()
            trainer.train_data.finish()  # trained: no epoch reads them again
            if dist_.rank == 0:
                log.info("streamed states: %s", summary["stream"])
        if dist_.rank == 0:
            summary["shipped"] = trainer.ship()
            peagle.export(trainer.model, out_dir, cfg["export_dtype"])  # either method
            write_csv(Path(out_dir) / "training_log.csv", trainer.rows, trainer.columns)
            run = progress.report("finished")
            # a rate of work done; a streamed run's includes its waits for the server, which
            # `eaglet status` adds from the prefill's own rate
            if rate_key is not None and trainer.step > first_step and stream is None:
                rates.record("train", rate_key, settings=rates.train_settings(cfg, dist_.world),
                             tokens_per_s=run["tokens_per_s"], ttt_steps=cfg["ttt_steps"])
        if dist_.world > 1:
            dist.barrier()
        summary.update(elapsed_s=time.monotonic() - started, peak_rss_mb=round(peak_rss_mb(), 1))
        if dist_.rank == 0:
            write_json(Path(out_dir) / "stats.json", summary)
        return summary
    finally:
        if trainer is not None:
            trainer.trackers.close()
            trainer.train_data.close()
            trainer.eval_data.close()
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
