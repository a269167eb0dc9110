"""A stage's time left as ``eaglet status`` says it (:func:`estimate`): a running stage's own
ETA once it has settled, else the stage's plan (less the time it has run), and whether a plan
rests on this machine's own measure of the stage's kind of work."""

from __future__ import annotations

from pathlib import Path

from eaglet.core.progress import format_duration
from eaglet.tools.status.estimates import EARLIER_RUN, MEASURED_AFTER_S, Estimate
from eaglet.tools.status.stages import _BY_NAME


def _grounded(planned: Estimate, kind: str | None) -> bool:
    """Whether a plan rests on this machine's own measure of the stage's kind of work: this
    run's speed of that kind, or an earlier run's rate here."""
    if planned.speed is not None:
        return planned.speed.kind == kind
    return EARLIER_RUN in planned.basis


def estimate(stage: str, r: Path, cfg: dict, progress: dict | None) -> Estimate:
    """Time left of ``stage``: a running stage's own ETA once it has settled, else the
    stage's plan (less the time it has run, while it runs)."""
    running = bool(progress) and progress.get("state") == "running"
    own = progress.get("eta_s") if running else None
    spec = _BY_NAME.get(stage)
    if own is not None:
        done, total = progress.get("done"), progress.get("total")
        if spec is None or not total or done is None or done / total >= spec.settles_at:
            return Estimate(own, "this run's progress")
        planned = spec.estimate(r, cfg, progress if spec.plans_from_progress else None)
        if planned.seconds is None:
            return Estimate(own, "this run's progress")
        elapsed = progress.get("elapsed_s") or 0.0
        if planned.seconds <= elapsed:  # the plan is spent and the stage goes on: the plan was
            return Estimate(
                own,
                f"this run's progress ({done}/{total} done; its plan of "  # wrong
                f"{format_duration(planned.seconds)} is spent)",
            )
        if (
            spec.settles_at < 1.0
            and elapsed >= MEASURED_AFTER_S
            and not _grounded(planned, spec.kind(cfg))
        ):
            # a plan from another kind of work's speed (or from the reference and benchmarks
            # alone) is a guess next to a minute of the stage's own work: a first run's
            # training, planned by extraction's prefill speed, read 0.7 minutes left where
            # its own 144 of 705 steps in 59 s said 3.8 (4.1 in truth)
            return Estimate(
                own,
                f"this run's progress ({done}/{total} done in "
                f"{format_duration(elapsed)}; its plan rested on "
                f"{planned.basis})",
            )
        return Estimate(
            planned.seconds - elapsed,
            f"{planned.basis}, less the {format_duration(elapsed)} it has run "
            f"({done}/{total} done: its own rate is not settled)",
            planned.speed,
        )
    if spec is None:
        return Estimate(None, "unknown stage")
    planned = spec.estimate(r, cfg, progress)
    if running and planned.seconds is not None:
        # no rate of its own yet (nothing done: a server starting, an interleaved evaluation
        # that finishes its runs together): the plan, less the time it has run
        elapsed = progress.get("elapsed_s") or 0.0
        return Estimate(
            max(planned.seconds - elapsed, 0.0),
            f"{planned.basis}, less the {format_duration(elapsed)} it has run",
            planned.speed,
        )
    return planned
