"""The training log: a row for every logged window of training steps and for every held-out
evaluation, logged, passed to the trackers and written whole to ``training_log.csv`` as each
one comes.
"""

from __future__ import annotations

import csv
import logging
import resource
from pathlib import Path

from eaglet.core.io import atomic_open
from eaglet.stages.train.tracking import Trackers

log = logging.getLogger("eaglet.stages.train.loop")


def peak_rss_mb() -> float:
    """The peak resident memory of this process so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    with atomic_open(path, "w") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


class TrainingLog:
    """A run's rows and their columns. Every rank keeps the rows (a checkpoint holds them);
    rank 0 logs each one, passes it to the trackers (none until ``train()`` opens those of
    train.report_to) and rewrites ``checkpoint_dir/training_log.csv``."""

    def __init__(self, cfg: dict, checkpoint_dir: Path, rank: int):
        self.cfg, self.checkpoint_dir, self.rank = cfg, checkpoint_dir, rank
        self.trackers = Trackers([], checkpoint_dir / "tracking", cfg)  # train() opens them
        self.columns = (
            ["step", "epoch", "split", "loss"]
            + [f"acc_{k}" for k in range(cfg["ttt_steps"])]
            + ["sim_al", "lr", "tokens_per_s", "peak_rss_mb"]
        )
        self.rows: list[dict] = []

    def add(
        self, split: str, metrics: dict, step: int, epoch: float, total_steps: int, **extra
    ) -> dict:
        """The row of ``metrics`` (``split``: train or eval) at ``step`` of ``total_steps``,
        ``epoch`` (fractional) into training, with ``extra`` columns; added and returned."""
        row = {
            "step": step,
            "epoch": epoch,
            "split": split,
            **{k: round(v, 6) for k, v in metrics.items()},
            "lr": "",
            "tokens_per_s": "",
            "peak_rss_mb": "",
            **extra,
        }
        self.rows.append(row)
        if self.rank != 0:
            return row
        self.trackers.log(row)
        accs = " ".join(f"{metrics[f'acc_{k}']:.3f}" for k in range(self.cfg["ttt_steps"]))
        rss = f" peak RSS {row['peak_rss_mb']:.0f} MiB" if row["peak_rss_mb"] != "" else ""
        log.info(
            "%s step %d/%d epoch %.2f: loss %.4f acc %s sim_al %.3f%s",
            split,
            step,
            total_steps,
            row["epoch"],
            metrics["loss"],
            accs,
            metrics["sim_al"],
            rss,
        )
        write_csv(self.checkpoint_dir / "training_log.csv", self.rows, self.columns)
        return row
