"""A stage's time left as ``eaglet status`` says it (:func:`estimate`): a running stage's own
ETA once it has settled, else the stage's estimate (less the time it has run), and whether an estimate
rests on this machine's own measure of the stage's kind of work."""

from __future__ import annotations

from pathlib import Path

from eaglet.core.progress import format_duration
from eaglet.tools.status.estimates import EARLIER_RUN, MEASURED_AFTER_S, Estimate
from eaglet.tools.status.stages import _BY_NAME


def _grounded(expected: Estimate, kind: str | None) -> bool:
    """Whether an estimate rests on this machine's own measure of the stage's kind of work: this
    run's speed of that kind, or an earlier run's rate here."""
    if expected.speed is not None:
        return expected.speed.kind == kind
    return EARLIER_RUN in expected.basis


def estimate(stage: str, r: Path, cfg: dict, progress: dict | None) -> Estimate:
    """Time left of ``stage``: a running stage's own ETA once it has settled, else the
    stage's estimate (less the time it has run, while it runs)."""
    running = bool(progress) and progress.get("state") == "running"
    own = progress.get("eta_s") if running else None
    spec = _BY_NAME.get(stage)
    if own is not None:
        done, total = progress.get("done"), progress.get("total")
        if spec is None or not total or done is None or done / total >= spec.settles_at:
            return Estimate(own, "this run's progress")
        expected = spec.estimate(r, cfg, progress if spec.estimates_from_progress else None)
        if expected.seconds is None:
            return Estimate(own, "this run's progress")
        elapsed = progress.get("elapsed_s") or 0.0
        if expected.seconds <= elapsed:  # the estimate is spent and the stage goes on: it was
            return Estimate(
                own,
                f"this run's progress ({done}/{total} done; its estimate of "  # wrong
                f"{format_duration(expected.seconds)} is spent)",
            )
        if (
            spec.settles_at < 1.0
            and elapsed >= MEASURED_AFTER_S
            and not _grounded(expected, spec.kind(cfg))
        ):
            # an estimate from another kind of work's speed (or from the reference and benchmarks
            # alone) is a guess next to a minute of the stage's own work: a first run's
            # training, estimated at extraction's prefill speed, read 0.7 minutes left where
            # its own 144 of 705 steps in 59 s said 3.8 (4.1 in truth)
            return Estimate(
                own,
                f"this run's progress ({done}/{total} done in "
                f"{format_duration(elapsed)}; its estimate rested on "
                f"{expected.basis})",
            )
        return Estimate(
            expected.seconds - elapsed,
            f"{expected.basis}, less the {format_duration(elapsed)} it has run "
            f"({done}/{total} done: its own rate is not settled)",
            expected.speed,
        )
    if spec is None:
        return Estimate(None, "unknown stage")
    expected = spec.estimate(r, cfg, progress)
    if running and expected.seconds is not None:
        # no rate of its own yet (nothing done: a server starting, an interleaved evaluation
        # that finishes its runs together): the estimate, less the time it has run
        elapsed = progress.get("elapsed_s") or 0.0
        return Estimate(
            max(expected.seconds - elapsed, 0.0),
            f"{expected.basis}, less the {format_duration(elapsed)} it has run",
            expected.speed,
        )
    return expected
