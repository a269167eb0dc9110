"""The drafter that ships: the weights of the best held-out evaluation (highest simulated AL;
a tie goes to the later one), kept beside the checkpoints so that a resumed run ships them
too, or the last weights where there is no held-out evaluation to choose by (the reasons are
in ``eaglet.stages.train.loop``'s docstring).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from eaglet.stages.train import checkpoints as ckpt
from eaglet.stages.train.data import TrainError

log = logging.getLogger("eaglet.stages.train.loop")


def where(row: dict) -> str:
    """A logged row's (or a choice's) place in training, as the log names it."""
    return f"epoch {row['epoch']:g}, step {row['step']}"


class Best:
    """A run's best held-out evaluation and its weights, kept (by rank 0) in
    ``checkpoint_dir`` with the run's ``fingerprint``. ``record``: the evaluation whose weights
    are kept (step, epoch, sim_al); ``since``: the first step whose evaluations compete (later
    than 0 when a resumed run lost the best)."""

    def __init__(self, checkpoint_dir: Path, fingerprint: dict | None, rank: int):
        self.checkpoint_dir, self.fingerprint, self.rank = checkpoint_dir, fingerprint, rank
        self.record: dict | None = None
        self.since = 0

    def consider(self, row: dict, model: torch.nn.Module) -> None:
        """Keep this held-out evaluation's weights if its simulated AL (as logged) is the best
        so far; a tie goes to the later one. Every rank keeps the record (the metrics are
        all-reduced), rank 0 the weights."""
        if self.record is not None and row["sim_al"] < self.record["sim_al"]:
            return
        self.record = {"step": row["step"], "epoch": row["epoch"], "sim_al": row["sim_al"]}
        if self.rank == 0:
            ckpt.save_best(self.checkpoint_dir, self.record, model, self.fingerprint)

    def restore(self, state: dict, rows: list[dict], step: int) -> None:
        """The best held-out evaluation the checkpoint ``state`` names (``rows``: its log,
        ``step``: its step), if its kept weights are still there; otherwise only the
        evaluations from here on compete, and the log says so."""
        self.record, self.since = state.get("best"), state.get("best_since", 0)
        evaluated = any(row["split"] == "eval" for row in rows)
        if (
            self.record is not None
            and ckpt.best_path(self.checkpoint_dir, self.record, self.fingerprint) is not None
        ):
            return
        if self.record is None and not evaluated:
            return
        lost = (
            f"step {self.record['step']}, simulated AL {self.record['sim_al']:.3f}"
            if self.record
            else "the checkpoint predates kept best weights"
        )
        log.warning(
            "the weights of the best held-out evaluation before step %d (%s) are not in "
            "%s: the drafter is chosen among the held-out evaluations from step %d on",
            step,
            lost,
            self.checkpoint_dir,
            step,
        )
        self.record, self.since = None, step

    def ship(self, model: torch.nn.Module, rows: list[dict], step: int) -> dict:
        """Put the weights to export in ``model``: the best held-out evaluation's, else the
        last (``rows``: the log, ``step``: the last step); returns what was chosen and
        against what, and logs it."""
        evals = [row for row in rows if row["split"] == "eval"]
        last = evals[-1] if evals else (rows[-1] if rows else {"epoch": 0})
        best = self.record
        choice = {
            "choice": "last",
            "step": step,
            "epoch": last["epoch"],
            "heldout_al": evals[-1]["sim_al"] if evals else None,
            "best_step": best and best["step"],
            "best_epoch": best and best["epoch"],
            "best_heldout_al": best and best["sim_al"],
            "last_epoch": last["epoch"],
            "last_epoch_al": evals[-1]["sim_al"] if evals else None,
            "chosen_from_step": self.since,
        }
        if not evals:
            note = (
                "no held-out split, so no held-out simulated AL to choose by: the last "
                f"weights ship ({where(choice)})"
            )
        elif best is None:  # resumed at the end, the best's weights gone
            note = (
                f"the best held-out weights before step {self.since} are gone: the "
                f"last weights ship ({where(choice)}, held-out simulated AL "
                f"{last['sim_al']:.3f})"
            )
        elif best["step"] == step:
            note = (
                f"the last weights ship ({where(choice)}): their held-out simulated AL "
                f"{last['sim_al']:.3f} is the best"
            )
        else:
            model.load_state_dict(ckpt.load_best(self.weights()))
            choice.update(
                choice="best", step=best["step"], epoch=best["epoch"], heldout_al=best["sim_al"]
            )
            note = (
                f"the best held-out weights ship ({where(choice)}): held-out simulated AL "
                f"{best['sim_al']:.3f}, against {last['sim_al']:.3f} at the last "
                f"evaluation ({where(last)})"
            )
        if self.since and best is not None:
            note += f"; chosen among the evaluations from step {self.since} on"
        choice["note"] = note
        log.info("%s", note)
        return choice

    def weights(self) -> Path:
        """The kept weights of the best held-out evaluation."""
        path = ckpt.best_path(self.checkpoint_dir, self.record, self.fingerprint)
        if path is None:
            raise TrainError(
                f"the weights of the best held-out evaluation (step {self.record['step']}) are "
                f"missing from {self.checkpoint_dir} or are of another training: rerun with "
                f"train.resume: false to train again"
            )
        return path
