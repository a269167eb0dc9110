"""Which micro-batches each optimizer step of a run trains on: each epoch's plan (the training
samples shuffled by the seed and packed, ``eaglet.stages.train.data.pack_epoch``; with a
subset, its samples alone), a rank's share of a step's, and their sequence from a data
position to the end of training.
"""

from __future__ import annotations

from eaglet.stages.train.data import Samples, pack, pack_epoch, step_micro_batches, steps_in


class EpochBatches:
    """The epochs' plans of ``train_data`` for optimizer steps of ``group`` micro-batches,
    ``rank`` training train.grad_accum of each; one epoch's plan is kept at a time.
    ``subset``: the global indices of the samples trained on (None: all). ``total_steps``:
    the optimizer steps of the whole training."""

    def __init__(
        self, cfg: dict, train_data: Samples, subset: set[int] | None, group: int, rank: int
    ):
        self.cfg, self.train_data, self.subset = cfg, train_data, subset
        self.group, self.rank = group, rank
        self.kept = {0: self.epoch_plan(0)}
        self.total_steps = self.count_steps()

    def plan(self, epoch: int) -> list[list[int]]:
        if epoch not in self.kept:
            self.kept = {epoch: self.epoch_plan(epoch)}
        return self.kept[epoch]

    def restore(self, epoch: int, plan: list[list[int]]) -> None:
        """Keep ``plan`` as ``epoch``'s, as a checkpoint saved it."""
        self.kept = {epoch: plan}

    def epoch_plan(self, epoch: int) -> list[list[int]]:
        """The epoch's micro-batches; with a subset, its samples in the epoch's shuffled order,
        packed again (the same settings over less data: ``eaglet.stages.scaling``)."""
        plan = pack_epoch(self.train_data, epoch, self.cfg)
        if self.subset is None:
            return plan
        lengths = [min(n, self.cfg["max_len"]) for n in self.train_data.lengths]
        return pack(
            [i for batch in plan for i in batch if i in self.subset],
            lengths,
            self.cfg["max_tokens_per_batch"],
        )

    def count_steps(self) -> int:
        total = sum(steps_in(self.epoch_plan(e), self.group) for e in range(self.cfg["epochs"]))
        return min(total, self.cfg["max_steps"] or total)

    def share(self, micro: list[list[int]]) -> list[list[int]]:
        """This rank's micro-batches of one optimizer step's."""
        ga = self.cfg["grad_accum"]
        return micro[self.rank * ga : (self.rank + 1) * ga]

    def upcoming(self, step: int, epoch: int, at: int):
        """This rank's micro-batches from the data position (the optimizer ``step``, in
        ``epoch`` the step ``at``) to the end of training, in the order the training loop
        trains on them, each keyed (epoch, step in epoch, index)."""
        cfg = self.cfg
        plan = self.plan(epoch) if epoch < cfg["epochs"] else []
        while step < self.total_steps and epoch < cfg["epochs"]:
            if at >= steps_in(plan, self.group):
                epoch, at = epoch + 1, 0
                plan = self.epoch_plan(epoch) if epoch < cfg["epochs"] else []
                continue
            for i, indices in enumerate(self.share(step_micro_batches(plan, at, self.group))):
                yield (epoch, at, i), indices
            step, at = step + 1, at + 1
