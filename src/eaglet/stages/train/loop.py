"""Train the EAGLE-3 drafter on the target's hidden-state shards with training-time test (TTT).

Data: every sample of the shards, shuffled per epoch (seeded), packed whole into micro-batches
of at most ``max_tokens_per_batch`` rows; a sample longer than ``max_len`` is cut to its first
``max_len`` tokens. One optimizer step consumes ``world_size * grad_accum`` micro-batches, and
its loss is normalized by the valid positions of all of them, so N ranks compute exactly what
one process accumulating N micro-batches computes.

Loss: at TTT step ``k`` row ``t`` predicts token ``t+2+k`` (see ``eaglet.model.drafter``); the
teacher is the target's distribution at position ``t+1+k`` restricted to the draft vocabulary
(softmax of ``final_hidden @ lm_head[draft ids].T``). A position counts when that token lies
in the sample, is a completion token (loss_mask 1) and the target's argmax there is in the
draft vocabulary. ``loss = sum_k ttt_decay**k * mean cross-entropy_k``.

Files: checkpoints ``checkpoint_dir/step_XXXXXXXX/`` (weights, optimizer, schedule, RNG and the
data position, each directory renamed into place whole); ``training_log.csv`` rewritten
atomically at every logged step (live copy in ``checkpoint_dir``, final copy in ``out_dir``);
the drafter in vLLM's format in ``out_dir`` (``eaglet.model.export``) and ``out_dir/stats.json``
(the run's summary). A rerun continues from the newest checkpoint and ends with the weights an
uninterrupted run would have.

The drafter that ships is the one of the best held-out evaluation (highest simulated AL; a tie
goes to the later one), not necessarily the last: on small data the held-out curve flattens or
turns while the training loss still falls. Its weights are kept beside the checkpoints
(``train_checkpoints.save_best``) so that a resumed run ships it too. Without a held-out split
there is nothing to choose by, and the last weights ship; the log and stats.json say which.

Here: :class:`Trainer`, a run's drafter, data and data position a step at a time;
:class:`TrainingRun`, which trains it to the end; and ``train``, the stage. Beside them, in
this package: ``setup`` (the inputs checked, the drafter built), ``plans`` (which micro-batches
each step trains on), ``step`` (the loss, one optimizer step, one held-out evaluation),
``training_log`` (the log's rows) and ``best`` (the weights that ship).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from eaglet.core import rates
from eaglet.core.config import ConfigError, validate
from eaglet.core.io import hold_directory, human_size, read_json, write_json
from eaglet.core.progress import Progress
from eaglet.engine.server import Terminated
from eaglet.model import methods
from eaglet.model.drafter import Eagle3Drafter, num_params
from eaglet.stages.scripting import run_stage
from eaglet.stages.train import checkpoints as ckpt
from eaglet.stages.train.best import Best
from eaglet.stages.train.data import (
    Batch,
    Prefetcher,
    Samples,
    TrainError,
    data_memory,
    make_batch,
    pack,
    prefetch_depth,
    step_micro_batches,
    steps_in,
)
from eaglet.stages.train.epoch_batches import EpochBatches
from eaglet.stages.train.setup import build_drafter, fingerprint_and_subset, read_inputs
from eaglet.stages.train.step import Learner, check_finite, summarize
from eaglet.stages.train.tracking import Trackers
from eaglet.stages.train.training_log import TrainingLog, peak_rss_mb, write_csv

log = logging.getLogger("eaglet.stages.train.loop")


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
        raise TrainError(
            f"train.max_len {out['max_len']} exceeds train.max_tokens_per_batch "
            f"{out['max_tokens_per_batch']}: a sample must fit one batch"
        )
    return out


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


# -- one step at a time ----------------------------------------------------------------------


class Trainer:
    """One training run's drafter, data and data position, a step at a time: ``train_step``
    takes one optimizer step, ``evaluate`` measures the held-out split, and
    :class:`TrainingRun` trains to the end with them. ``from_files`` builds it from a run's
    files; a caller with samples and a drafter of its own (``benchmarks/gpu_check.py``)
    builds it directly."""

    def __init__(
        self,
        cfg: dict,
        model: Eagle3Drafter,
        teacher_head: torch.Tensor,
        train_data: Samples,
        eval_data: Samples,
        checkpoint_dir: str | Path,
        device: torch.device,
        dist_: Dist,
        fingerprint: dict | None = None,
        subset: set[int] | None = None,
    ):
        self.cfg, self.dist, self.device = cfg, dist_, device
        self.checkpoint_dir = Path(checkpoint_dir)
        self.group = dist_.world * cfg["grad_accum"]
        self.train_data, self.eval_data = train_data, eval_data
        self.fingerprint = fingerprint
        # the data's plan (subset: the training samples trained on, global indices; None: all)
        self.plans = EpochBatches(cfg, train_data, subset, self.group, dist_.rank)
        self.total_steps = self.plans.total_steps
        self.learner = Learner(cfg, model, teacher_head, device, dist_, self.total_steps)
        self.model = self.learner.model
        self.t2d = model.t2d.cpu()
        self.eval_plan = pack(
            list(range(len(self.eval_data))),
            [min(n, cfg["max_len"]) for n in self.eval_data.lengths],
            cfg["max_tokens_per_batch"],
        )
        self.step, self.epoch, self.next_in_epoch = 0, 0, 0

    @classmethod
    def from_files(
        cls,
        cfg: dict,
        shard_paths,
        eval_shard_paths,
        vocab_map: str,
        target_dir: str,
        checkpoint_dir: str,
        device: torch.device,
        dist_: Dist,
        manifest: str | None = None,
        train_samples: list[str] | None = None,
        stream: dict | None = None,
    ) -> Trainer:
        """Check the shards and the vocabulary map against the target, and build the drafter
        from the target's embedding (and lm_head rows and last layer, as configured).
        ``train_samples``: the ids of the shards' samples to train on (None: all).
        ``stream``: the training samples' states come from the capture server as training
        reads them (``train.data: stream``, :func:`eaglet.stages.train.stream.open_stream`'s
        argument), not from ``shard_paths``."""
        inputs = read_inputs(
            cfg, shard_paths, eval_shard_paths, vocab_map, target_dir, dist_, manifest, stream
        )
        infos, eval_infos = inputs.infos, inputs.eval_infos
        cfg = {**cfg, "prefetch_batches": prefetch_depth(cfg["prefetch_batches"], device)}
        memory = data_memory(cfg, infos + eval_infos)  # shared: one budget per process
        train_data = inputs.streamed or Samples(infos, cfg["shards_in_memory"], memory)
        eval_data = Samples(eval_infos, cfg["shards_in_memory"], memory)
        train_data.preload()
        eval_data.preload()

        model, teacher_head, layer_init = build_drafter(cfg, inputs, target_dir, dist_.rank)
        fingerprint, subset = fingerprint_and_subset(
            cfg, infos, dist_.world * cfg["grad_accum"], vocab_map, train_samples
        )
        trainer = cls(
            cfg,
            model,
            teacher_head,
            train_data,
            eval_data,
            checkpoint_dir,
            device,
            dist_,
            fingerprint,
            subset,
        )
        trainer.layer_init = layer_init  # in train()'s summary: what the layer started from
        if dist_.rank == 0:
            log.info(
                "drafter: %.1fM trainable parameters, draft vocab %d, aux layers %s, "
                "%s attention, %d training samples in %d shards, %d held out, %d steps",
                num_params(model) / 1e6,
                inputs.d2t.numel(),
                model.config.aux_layer_ids,
                model.attention,
                len(subset or train_data),
                len(infos),
                len(eval_data),
                trainer.total_steps,
            )
        return trainer

    # -- the data and the position in it --

    def plan(self, epoch: int) -> list[list[int]]:
        return self.plans.plan(epoch)

    def epoch_plan(self, epoch: int) -> list[list[int]]:
        return self.plans.epoch_plan(epoch)

    def upcoming(self):
        """This rank's micro-batches from the current data position to the end of training,
        in the order :meth:`TrainingRun.run` trains on them, each keyed (epoch, step in
        epoch, index)."""
        yield from self.plans.upcoming(self.step, self.epoch, self.next_in_epoch)

    def prefetcher(self) -> Prefetcher | None:
        if not self.cfg["prefetch_batches"]:
            return None
        feed = Prefetcher(
            lambda indices: self.host_batch(self.train_data, indices),
            self.upcoming(),
            self.cfg["prefetch_batches"],
        )
        ahead = getattr(self.train_data, "taken_ahead", None)
        if ahead is not None:  # streamed states: their server's turns wait for the steps
            ahead(feed.wait_for_consumer)
        return feed

    def host_batch(self, data: Samples, indices: list[int]) -> Batch:
        """The micro-batch of these samples packed on the host, features in their stored
        dtype (page-locked for a CUDA device): what the prefetcher builds ahead."""
        pieces = [data.get(i, self.cfg["max_len"]) for i in indices]
        # held-out metrics stay on the answers, what speculation drafts
        training = data is self.train_data
        return make_batch(
            pieces,
            self.cfg["ttt_steps"],
            self.t2d,
            self.cfg["loss_on_prompt"] and training,
            pin=self.device.type == "cuda",
        )

    def load_batch(self, data: Samples, indices: list[int]) -> Batch:
        return self.learner.device_batch(self.host_batch(data, indices), data is self.train_data)

    # -- one optimizer step, one evaluation --

    def train_step(
        self, micro: list[list[int]], host_batches: list[Batch] | None = None
    ) -> tuple[torch.Tensor, int]:
        """One optimizer step over this rank's share of ``micro`` (``host_batches``: those
        micro-batches already packed, by the prefetcher; the list is emptied, each host copy
        let go once it is on the device); returns this rank's summed [cross-entropy, valid
        positions, agreements] per TTT step [3, K] and its rows."""
        if host_batches is None:
            host_batches = [self.host_batch(self.train_data, m) for m in self.plans.share(micro)]
        batches = []
        while host_batches:
            batches.append(self.learner.device_batch(host_batches.pop(0), training=True))
        return self.learner.step(batches, self.fail)

    def check_losses(self, losses: list[torch.Tensor], batches: list[Batch]) -> None:
        """Fail naming the micro-batches whose loss is not finite, on any rank (the step's
        check, :func:`eaglet.stages.train.step.check_finite`)."""
        check_finite(losses, batches, self.dist, self.device, self.fail)

    def fail(self, what: str, *batches: Batch) -> None:
        kept = ckpt.checkpoints(self.checkpoint_dir)
        samples = ", ".join(i for batch in batches for i in batch.sample_ids)
        where = "the batch" if len(batches) == 1 else f"these {len(batches)} micro-batches"
        raise TrainError(
            f"{what} at step {self.step + 1} (epoch {self.epoch + 1}, batch "
            f"{self.next_in_epoch + 1}); samples in {where}: {samples}. "
            f"The last good checkpoint is {kept[-1] if kept else '(none yet)'}; check these "
            f"samples' features (rerun extract for their shard) or lower train.lr, then rerun"
        )

    def evaluate(self) -> dict:
        """The held-out split's metrics (:func:`eaglet.stages.train.step.summarize`), every
        rank's share of it together."""
        share = self.eval_plan[self.dist.rank :: self.dist.world]
        return self.learner.evaluate(self.load_batch(self.eval_data, indices) for indices in share)


# -- the run to the end ----------------------------------------------------------------------


class TrainingRun:
    """A :class:`Trainer` trained to the end (``run``), and what its steps are framed by: the
    resume from the newest checkpoint, the room on disk for those to come, a row of the log
    every train.log_every steps, the held-out evaluations (at each epoch's end, or every
    train.eval_every steps) whose weights are kept while they are the best, a checkpoint every
    train.checkpoint_every steps, and the weights that ship (``ship``)."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.log = TrainingLog(trainer.cfg, trainer.checkpoint_dir, trainer.dist.rank)
        self.best = Best(trainer.checkpoint_dir, trainer.fingerprint, trainer.dist.rank)

    # -- checkpoints --

    def check_disk(self) -> None:
        """Before the first step: room for the checkpoints still to come (one more than
        train.keep_checkpoints exists while the newest is written) and the drafter."""
        trainer, checkpoint_dir = self.trainer, self.trainer.checkpoint_dir
        state = sum(t.numel() * t.element_size() for t in trainer.model.state_dict().values())
        params = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
        per_checkpoint = state + 2 * params  # weights, and AdamW's two moments
        keep = trainer.cfg["keep_checkpoints"]
        to_write = max(keep + 1 - len(ckpt.checkpoints(checkpoint_dir)), 1)
        # the best held-out weights: one named by each kept checkpoint, one newer than them
        bests = max(keep + 1 - len(ckpt.bests(checkpoint_dir)), 0) if len(trainer.eval_data) else 0
        needed = to_write * per_checkpoint + bests * state + state
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(checkpoint_dir).free
        if needed > free:
            raise TrainError(
                f"not enough disk for training: about {human_size(needed)} still to write "
                f"({to_write} checkpoints of {human_size(per_checkpoint)}, {bests} copies of "
                f"the best held-out weights and the drafter), "
                f"{human_size(free)} free on {checkpoint_dir}. Free space, lower "
                f"train.keep_checkpoints, or point results_dir at a larger disk."
            )

    def save_checkpoint(self) -> None:
        trainer = self.trainer
        if trainer.dist.rank != 0:
            return
        ckpt.save(
            trainer.checkpoint_dir,
            trainer.step,
            trainer.model,
            trainer.learner.optimizer,
            trainer.learner.scheduler,
            {
                "step": trainer.step,
                "epoch": trainer.epoch,
                "next_in_epoch": trainer.next_in_epoch,
                "epoch_plan": trainer.plan(trainer.epoch),
                "total_steps": trainer.total_steps,
                "fingerprint": trainer.fingerprint,
                "log": self.log.rows,
                "best": self.best.record,
                "best_since": self.best.since,
            },
            trainer.cfg["keep_checkpoints"],
        )

    def resume(self) -> Path | None:
        trainer = self.trainer
        path = ckpt.to_resume(
            trainer.checkpoint_dir, trainer.fingerprint, trainer.cfg["resume"], trainer.dist.rank
        )
        if path is None:
            return None
        state = ckpt.load(path, trainer.model, trainer.learner.optimizer, trainer.learner.scheduler)
        trainer.step, trainer.epoch, trainer.next_in_epoch = (
            state["step"],
            state["epoch"],
            state["next_in_epoch"],
        )
        trainer.plans.restore(trainer.epoch, state["epoch_plan"])
        self.log.rows = state["log"]
        self.best.restore(state, self.log.rows, trainer.step)
        log.info("resumed from %s (step %d/%d)", path, trainer.step, trainer.total_steps)
        return path

    # -- the loop --

    def log_row(self, split: str, metrics: dict, **extra) -> dict:
        trainer = self.trainer
        plan_len = steps_in(trainer.plan(trainer.epoch), trainer.group)
        epoch = round(trainer.epoch + trainer.next_in_epoch / plan_len, 4)
        return self.log.add(split, metrics, trainer.step, epoch, trainer.total_steps, **extra)

    def run(self, progress: Progress | None, stop_after_steps: int | None = None) -> bool:
        """Train to the end (True), or until ``stop_after_steps`` (False: as if killed)."""
        trainer = self.trainer
        start = getattr(trainer.train_data, "start", None)
        if start is not None:  # streamed states: asked for in the order training reads them
            upcoming = [indices for _, indices in trainer.upcoming()]
            start(
                [i for indices in upcoming for i in indices],
                progress,
                max(map(len, upcoming), default=0),
            )
        feed = trainer.prefetcher()
        try:
            with stop_signals() as self.stopping:
                return self._run(progress, stop_after_steps, feed)
        finally:
            if feed is not None:
                feed.close()

    def _run(
        self, progress: Progress | None, stop_after_steps: int | None, feed: Prefetcher | None
    ) -> bool:
        trainer, cfg, K = self.trainer, self.trainer.cfg, self.trainer.cfg["ttt_steps"]
        world = trainer.dist.world
        window = torch.zeros(3, K, dtype=torch.float64, device=trainer.device)
        window_tokens, window_start = 0, time.monotonic()
        if cfg.get("init_from") and trainer.step == 0 and len(trainer.eval_data):
            # a fine-tune's step-0 row: the starting drafter's held-out quality, which the
            # fine-tune must beat to ship other weights than the start's
            self.best.consider(self.log_row("eval", trainer.evaluate()), trainer.model)
        while trainer.step < trainer.total_steps and trainer.epoch < cfg["epochs"]:
            plan = trainer.plan(trainer.epoch)
            steps = steps_in(plan, trainer.group)
            if trainer.next_in_epoch >= steps:
                trainer.epoch, trainer.next_in_epoch = trainer.epoch + 1, 0
                continue
            micro = step_micro_batches(plan, trainer.next_in_epoch, trainer.group)
            ready = (
                None
                if feed is None
                else [
                    feed.take((trainer.epoch, trainer.next_in_epoch, i))
                    for i in range(len(trainer.plans.share(micro)))
                ]
            )
            sums, tokens = trainer.train_step(micro, ready)
            trainer.step += 1
            trainer.next_in_epoch += 1
            window += sums
            window_tokens += tokens
            if progress is not None:
                progress.advance(done=1, tokens=tokens * world)
            last = trainer.step == trainer.total_steps
            if trainer.step % cfg["log_every"] == 0 or last:
                sums = trainer.dist.all_reduce(window.clone()).cpu()
                rate = world * window_tokens / (time.monotonic() - window_start)
                rss = trainer.dist.all_reduce(
                    torch.tensor([peak_rss_mb()], device=trainer.device),
                    dist.ReduceOp.MAX if world > 1 else None,
                )
                self.log_row(
                    "train",
                    summarize(*sums, cfg["ttt_decay"]),
                    lr=f"{trainer.learner.scheduler.get_last_lr()[0]:.6g}",
                    tokens_per_s=round(rate, 1),
                    peak_rss_mb=round(float(rss), 1),
                )
                window.zero_()
                window_tokens, window_start = 0, time.monotonic()
            epoch_end = trainer.next_in_epoch == steps
            due = (trainer.step % cfg["eval_every"] == 0) if cfg["eval_every"] else epoch_end
            if len(trainer.eval_data) and (due or last):
                self.best.consider(self.log_row("eval", trainer.evaluate()), trainer.model)
            saved = trainer.step % cfg["checkpoint_every"] == 0 or last
            if saved:
                self.save_checkpoint()
            if self.stop_requested() and not last:
                # a scheduler's time limit or preemption: what is done is kept, within the
                # grace period before its SIGKILL, and the requeued job resumes from here
                if not saved:
                    self.save_checkpoint()
                message = (
                    f"received {self.stopping['signal']} at step {trainer.step} of "
                    f"{trainer.total_steps}: checkpoint written, a rerun resumes "
                    f"from step {trainer.step}"
                )
                if trainer.dist.rank == 0:
                    log.warning("%s", message)
                raise Terminated(message)
            if stop_after_steps is not None and trainer.step >= stop_after_steps and not last:
                return False
        return True

    def stop_requested(self) -> bool:
        """Whether any rank received SIGTERM (or SIGHUP) since training started: every rank
        stops after the same step, so that the checkpoint holds all of them."""
        asked = torch.tensor([1.0 if self.stopping["signal"] else 0.0], device=self.trainer.device)
        if self.trainer.dist.world > 1:
            asked = self.trainer.dist.all_reduce(asked, dist.ReduceOp.MAX)
            if asked.item() and not self.stopping["signal"]:
                self.stopping["signal"] = "SIGTERM (on another rank)"
        return bool(asked.item())

    def ship(self) -> dict:
        """Put the weights to export in the drafter (:meth:`Best.ship`): the best held-out
        evaluation's, else the last; returns what was chosen and against what."""
        return self.best.ship(self.trainer.model, self.log.rows, self.trainer.step)


@contextlib.contextmanager
def stop_signals():
    """While the block runs, SIGTERM and SIGHUP (a scheduler's time limit or preemption, a
    Snakemake stopping its jobs) only note which arrived (``["signal"]``), for the loop to stop
    after its step with a checkpoint; the previous handlers come back after. Outside the main
    thread nothing changes."""
    state = {"signal": None}

    def note(signum, frame):
        state["signal"] = signal.Signals(signum).name

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            previous[sig] = signal.signal(sig, note)
        except ValueError:  # not the main thread
            pass
    try:
        yield state
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def train(
    cfg: dict,
    shard_paths: list[str],
    eval_shard_paths: list[str],
    vocab_map: str,
    target_dir: str,
    out_dir: str,
    checkpoint_dir: str,
    progress_path: str | None,
    log_path: str | None,
    *,
    rate_key: str | None = None,
    stop_after_steps: int | None = None,
    manifest: str | None = None,
    train_samples: list[str] | None = None,
    stream: dict | None = None,
) -> dict:
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
    (see :func:`eaglet.stages.train.stream.open_stream`); ``shard_paths`` is then empty.
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
    with hold_directory(checkpoint_dir, "train") if dist_.rank == 0 else contextlib.nullcontext():
        return _train(
            cfg,
            device,
            dist_,
            shard_paths,
            eval_shard_paths,
            vocab_map,
            target_dir,
            out_dir,
            checkpoint_dir,
            progress_path,
            log_path,
            rate_key,
            stop_after_steps,
            manifest,
            train_samples,
            stream,
        )


def _train(
    cfg,
    device,
    dist_,
    shard_paths,
    eval_shard_paths,
    vocab_map,
    target_dir,
    out_dir,
    checkpoint_dir,
    progress_path,
    log_path,
    rate_key,
    stop_after_steps,
    manifest,
    train_samples,
    stream,
) -> dict:
    started = time.monotonic()
    trainer = training = None
    try:
        trainer = Trainer.from_files(
            cfg,
            list(shard_paths),
            list(eval_shard_paths),
            vocab_map,
            target_dir,
            checkpoint_dir,
            device,
            dist_,
            manifest,
            train_samples,
            stream,
        )
        training = TrainingRun(trainer)
        training.resume()
        if dist_.rank == 0:
            training.check_disk()
            training.log.trackers = Trackers(
                cfg["report_to"], Path(checkpoint_dir) / "tracking", cfg
            )
        first_step = trainer.step
        progress = (
            Progress(
                "train",
                total=trainer.total_steps,
                path=progress_path,
                log_path=log_path,
                unit="steps",
                already_done=first_step,
                plan={
                    "kind": "training",
                    "steps": trainer.total_steps,
                    "epochs": cfg["epochs"],
                    "from_step": first_step,
                    "samples": len(trainer.train_data),
                    "ranks": dist_.world,
                },
            )
            if dist_.rank == 0
            else None
        )
        finished = training.run(progress, stop_after_steps)
        if not finished:
            return {"stopped_at_step": trainer.step}
        rows = training.log.rows
        last = {
            split: next((r for r in reversed(rows) if r["split"] == split), None)
            for split in ("train", "eval")
        }
        summary = {
            "steps": trainer.step,
            "resumed_from_step": first_step,
            "train": last["train"],
            "eval": last["eval"],
            "layer_init": trainer.layer_init,
        }
        if stream is not None:  # every rank's feed
            summary["stream"] = trainer.train_data.summary()
            trainer.train_data.finish()  # trained: no epoch reads them again
            if dist_.rank == 0:
                log.info("streamed states: %s", summary["stream"])
        if dist_.rank == 0:
            summary["shipped"] = training.ship()
            methods.export(
                trainer.model,
                out_dir,
                cfg["export_dtype"],  # any method
                block_size=cfg["ttt_steps"] + 1,
            )
            write_csv(Path(out_dir) / "training_log.csv", training.log.rows, training.log.columns)
            run = progress.report("finished")
            # a rate of work done; a streamed run's includes its waits for the server, which
            # `eaglet status` adds from the prefill's own rate
            if rate_key is not None and trainer.step > first_step and stream is None:
                rates.record(
                    rates.TRAIN,
                    rate_key,
                    settings=rates.train_settings(cfg, dist_.world),
                    tokens_per_s=run["tokens_per_s"],
                    ttt_steps=rates.train_passes(cfg),
                )  # what the rate scales by
        if dist_.world > 1:
            dist.barrier()
        summary.update(elapsed_s=time.monotonic() - started, peak_rss_mb=round(peak_rss_mb(), 1))
        if dist_.rank == 0:
            write_json(Path(out_dir) / "stats.json", summary)
        return summary
    finally:
        if training is not None:
            training.log.trackers.close()
        if trainer is not None:
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
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "eaglet.stages.train.loop",
            str(args_path),
        ],
        check=True,
    )


def main(argv: list[str] | None = None) -> None:
    """Worker of a multi-GPU run: ``python -m torch.distributed.run --nproc-per-node N -m
    eaglet.stages.train.loop ARGS.json``, ARGS.json holding ``train``'s keyword arguments."""
    args = read_json((argv or sys.argv[1:])[0])
    rank = int(os.environ.get("RANK", "0"))
    run_stage("train", args["log_path"] if rank == 0 else None, lambda: train(**args))


if __name__ == "__main__":
    main()
