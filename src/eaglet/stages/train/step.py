"""One optimizer step and one held-out evaluation of the drafter: the TTT loss of a batch
against the teacher (``batch_sums``), the metrics the log shows (``summarize``), and the
``Learner``, which holds the drafter on its device with its kernels, AdamW and the
learning-rate schedule, and steps over a rank's micro-batches with one check for non-finite
losses per step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from eaglet.model import loss as ttt_loss
from eaglet.model.config import resolve_attention
from eaglet.model.drafter import Eagle3Drafter, compile_drafter
from eaglet.stages.train.data import Batch, TrainError, add_feature_noise

# -- loss ------------------------------------------------------------------------------------


def batch_sums(
    model,
    batch: Batch,
    teacher_head: torch.Tensor,
    fused: bool = False,
    kernels: ttt_loss.ChunkKernels = ttt_loss.PLAIN,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per TTT step: summed cross-entropy against the teacher (differentiable) [K] and the
    number of top-1 agreements with the target's argmax [K]. ``model`` may be DDP-wrapped.
    ``fused``: the loss fused with lm_head, a chunk of rows at a time (``eaglet.model.loss``);
    the same values."""
    drafter = getattr(model, "module", model)
    if fused:
        states = model(
            batch.aux, batch.step_ids, batch.positions, batch.segments, batch.rows, heads=False
        )
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
        teacher = torch.softmax((batch.final @ teacher_head.T).float(), dim=-1)  # [T, Vd]
    ce, agree = [], []
    for k, (z, rows) in enumerate(zip(logits, batch.rows)):
        z, target_rows = z.float(), rows + 1 + k
        ce.append((torch.logsumexp(z, -1) - (teacher[target_rows] * z).sum(-1)).sum())
        agree.append(
            (drafter.to_target_ids(z.argmax(-1)) == batch.teacher_argmax[target_rows]).sum()
        )
    return torch.stack(ce), torch.stack(agree).double()


def summarize(ce: torch.Tensor, counts: torch.Tensor, agree: torch.Tensor, decay: float) -> dict:
    """Loss, per-step accuracy and simulated acceptance length from summed statistics."""
    n = counts.clamp(min=1)
    weights = decay ** torch.arange(len(ce), dtype=torch.float64)
    acc = (agree / n).tolist()
    return {
        "loss": float((weights * ce / n).sum()),
        **{f"acc_{k}": a for k, a in enumerate(acc)},
        "sim_al": 1.0 + sum(math.prod(acc[: k + 1]) for k in range(len(acc))),
    }


def check_finite(
    losses: list[torch.Tensor], batches: list[Batch], dist_, device: torch.device, fail: Callable
) -> None:
    """Fail (``fail(what, *batches)``) naming the micro-batches whose loss is not finite, on
    any rank: one host sync (and one all-reduce) per optimizer step."""
    finite = torch.isfinite(torch.stack(losses)) if losses else torch.ones(0, dtype=torch.bool)
    everywhere = finite.all().float().reshape(1).to(device)  # the one sync below
    if dist_.world > 1:
        everywhere = dist_.all_reduce(everywhere, dist.ReduceOp.MIN)
    if bool(everywhere):
        return
    bad = [i for i, ok in enumerate(finite.tolist()) if not ok]
    if not bad:
        fail("non-finite loss on another rank", *batches)
    values = ", ".join(f"{float(losses[i]):.4g}" for i in bad)
    fail(f"non-finite loss ({values} here)", *(batches[i] for i in bad))


# -- the step's settings ---------------------------------------------------------------------


def resolve_compile(setting, device: torch.device) -> bool:
    """``train.compile``: auto compiles on CUDA (fused kernels pay there:
    benchmarks/gpu_check.py measures it on a GPU), not on the CPU, where compiling costs more than it saves
    on a run of the demo's size."""
    if setting == "auto":
        return device.type == "cuda"
    return bool(setting)


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup from 0, then cosine decay to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


# -- the drafter and what trains it ----------------------------------------------------------


class Learner:
    """The drafter on ``device`` with the kernels of its TTT attention and of the step (the
    same math whichever, so no part of the fingerprint), AdamW with its learning-rate schedule
    over ``total_steps``, and the DDP wrapper the step runs it through when data-parallel.
    ``dist_``: the ranks (:class:`eaglet.stages.train.loop.Dist`)."""

    def __init__(
        self,
        cfg: dict,
        model: Eagle3Drafter,
        teacher_head: torch.Tensor,
        device: torch.device,
        dist_,
        total_steps: int,
    ):
        self.cfg, self.device, self.dist = cfg, device, dist_
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
        self.feature_dtype = (
            torch.bfloat16
            if self.precision() == "bfloat16" and not norms_before_fc
            else torch.float32
        )
        self.num_aux = len(model.config.aux_layer_ids)
        self.teacher_head = teacher_head.to(device)
        decay = [p for n, p in self.model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": cfg["weight_decay"]},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=cfg["lr"],
            betas=tuple(cfg["betas"]),
        )
        warmup = (
            cfg["warmup_steps"]
            if cfg["warmup_steps"] is not None
            else math.ceil(cfg["warmup_ratio"] * total_steps)
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, warmup, total_steps, cfg["min_lr_ratio"])
        )
        self.wrapped = self.model
        if dist_.world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            DDP._set_params_and_buffers_to_ignore_for_model(
                self.model, list(Eagle3Drafter.CONSTANT_BUFFERS)
            )
            self.wrapped = DDP(
                self.model,
                device_ids=[device.index] if device.type == "cuda" else None,
                broadcast_buffers=False,
            )

    def precision(self) -> str:
        precision = self.cfg["precision"]
        if precision == "auto":
            precision = "bfloat16" if self.device.type == "cuda" else "float32"
        return precision

    def autocast(self):
        if self.precision() == "float32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def device_batch(self, batch: Batch, training: bool) -> Batch:
        """A host batch on the device, features in float32; the feature noise is drawn here,
        in the loop, so that the random stream (saved in checkpoints) does not depend on how
        far ahead batches were built."""
        batch = batch.to(self.device, self.feature_dtype)
        if training and self.cfg["feature_noise"]:
            batch.aux = add_feature_noise(batch.aux, self.num_aux, self.cfg["feature_noise"])
        return batch

    def step(self, batches: list[Batch], fail: Callable) -> tuple[torch.Tensor, int]:
        """One optimizer step over this rank's micro-batches of it, on the device, each one's
        loss normalized by the valid positions of the whole step (every rank's); ``fail(what,
        *batches)`` raises, naming the batches, on a non-finite loss or gradient norm. Returns
        this rank's summed [cross-entropy, valid positions, agreements] per TTT step [3, K]
        and its rows."""
        cfg, K = self.cfg, self.cfg["ttt_steps"]
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
            with contextlib.nullcontext() if sync else self.wrapped.no_sync(), self.autocast():
                ce, agree = batch_sums(
                    self.wrapped, batch, self.teacher_head, self.fused_loss, self.loss_kernels
                )
                loss = (scale * ce).sum()
            loss.backward()
            losses.append(loss.detach())
            ce_total += ce.detach().double()
            agree_total += agree
        # before the optimizer can take a non-finite step
        check_finite(losses, batches, self.dist, self.device, fail)
        if cfg["grad_clip"]:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg["grad_clip"])
            if not torch.isfinite(norm):
                fail(f"non-finite gradient norm ({float(norm):.4g})", batches[-1])
        self.optimizer.step()
        self.scheduler.step()
        return (
            torch.stack([ce_total, local_counts, agree_total]),
            sum(b.num_tokens for b in batches),
        )

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch]) -> dict:
        """The metrics (:func:`summarize`) of the drafter as it is on ``batches``, this rank's
        share of the held-out split on the device, summed over every rank's."""
        K = self.cfg["ttt_steps"]
        sums = torch.zeros(3, K, dtype=torch.float64, device=self.device)
        self.model.eval()
        for batch in batches:
            with self.autocast():
                ce, agree = batch_sums(
                    self.model, batch, self.teacher_head, self.fused_loss, self.loss_kernels
                )
            sums += torch.stack([ce.double(), batch.counts().to(self.device), agree])
        ce, counts, agree = self.dist.all_reduce(sums).cpu()
        return summarize(ce, counts, agree, self.cfg["ttt_decay"])
