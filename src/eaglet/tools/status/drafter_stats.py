"""What ``eaglet status`` keeps and says of a trained drafter's ``drafter/stats.json``: which
epoch's weights it ships and their held-out AL (``shipped``), and how a streamed training got
its states and which side waited for the other (``stream``)."""

from __future__ import annotations

from typing import Any

from eaglet.core.io import human_size

# what status keeps of drafter/stats.json's ``shipped`` (``eaglet.stages.train.best.Best.ship``)
SHIPPED_KEYS = (
    "choice",
    "step",
    "epoch",
    "heldout_al",
    "best_epoch",
    "best_heldout_al",
    "last_epoch",
    "last_epoch_al",
    "note",
)


def _epoch(value: Any) -> str:
    return "?" if value is None else f"{value:g}"


def _shipped_line(s: dict) -> str:
    """Which epoch's weights the drafter ships and their held-out simulated AL: training
    ships the best held-out evaluation, which on small data is often not the last, so the
    last evaluation's AL alone would misstate the drafter that evaluate serves."""
    if s.get("heldout_al") is None:
        return f"ships the last epoch {_epoch(s.get('epoch'))} (no held-out split to choose by)"
    if s.get("choice") == "best":
        last = (
            ""
            if s.get("last_epoch_al") is None
            else f"; last epoch {_epoch(s.get('last_epoch'))} had {s['last_epoch_al']:.2f}"
        )
        return f"ships epoch {_epoch(s.get('epoch'))} (held-out AL {s['heldout_al']:.2f}{last})"
    best = s.get("best_heldout_al")
    which = ", the best" if best is not None and best <= s["heldout_al"] else ""
    return (
        f"ships the last epoch {_epoch(s.get('epoch'))} (held-out AL {s['heldout_al']:.2f}{which})"
    )


# what status keeps of drafter/stats.json's ``stream`` (train_stream.StateFeed.summary)
STREAM_KEYS = (
    "requests",
    "saved_files",
    "reread_files",
    "cache_files",
    "cache_bytes",
    "trainer_wait_s",
    "trainer_wait_start_s",
    "feed_wait_s",
    "server_idle_s",
    "server_start_s",
    "window",
    "ranks",
    "overlap",
)


def _stream_line(s: dict, elapsed_s: float | None) -> str:
    """How a streamed training got its states, and which side waited for the other: the
    trainer for the server's states, or the feed (its window full) for the trainer."""
    got = (
        f"states streamed: {s.get('requests') or 0} prefill requests, "
        f"{s.get('saved_files') or 0} saved by generation or an earlier run, "
        f"{s.get('reread_files') or 0} read again (cache "
        f"{s.get('cache_files') or 0} files, {human_size(s.get('cache_bytes') or 0)})"
    )
    start = s.get("trainer_wait_start_s")
    if start is None:  # a run from before the feed timed the wait during the start itself
        start = s.get("server_start_s") or 0.0
    waited = max((s.get("trainer_wait_s") or 0.0) - start, 0.0)
    whole = f" of {elapsed_s:.0f} s" if elapsed_s else ""
    return (
        f"{got}; the trainer waited {waited:.0f} s{whole} for states (besides "
        f"{start:.0f} s while the server started), the server "
        f"{s.get('server_idle_s') or 0:.0f} s "
        f"with no request (the feed {s.get('feed_wait_s') or 0:.0f} s for the trainer"
        + (f", its window of {s['window']} samples full" if s.get("window") else "")
        + ("; the two took turns, train.stream_overlap" if s.get("overlap") is False else "")
        + (
            f"; {s['ranks']} training ranks, each with a feed of its own: the longest "
            f"rank's wait, the shortest's idle time"
            if (s.get("ranks") or 1) > 1
            else ""
        )
        + ")"
    )
