"""Progress of a long-running stage: log lines for people, a JSON file for `eaglet status`.

Each stage that takes long writes ``<results>/progress/<stage>.json`` (atomically, every few
seconds) with done/total, failures, rates, ETA, its pid and log path, and logs a line such as
``generate: 120/433 done, 2 failed, 1.9 req/s, 71 tok/s, ETA 2m45s``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from eaglet.core.io import write_json

log = logging.getLogger("eaglet.core.progress")


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass
class Progress:
    """Tracks one stage. ``already_done`` counts work finished by an earlier, resumed run:
    it is shown as done but left out of this run's rates."""

    stage: str
    total: int
    path: str | os.PathLike | None = None
    log_path: str | None = None
    unit: str = "samples"
    already_done: int = 0
    interval_s: float = 5.0
    # what the stage is doing now when that is not the counted work itself, e.g. "starting
    # the vLLM server" (minutes for a large model, with nothing counted yet); None otherwise
    phase: str | None = None
    # the stage's plan of work, written when it starts, before the work (units, their kind,
    # tokens, servers: what `eaglet status` multiplies its measured rates by)
    plan: dict | None = None

    done: int = field(default=0, init=False)
    failed: int = field(default=0, init=False)
    tokens: int = field(default=0, init=False)
    started: float = field(default_factory=time.monotonic, init=False)
    started_at: str = field(default_factory=now_iso, init=False)
    _last_report: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self.done = self.already_done

    def restart(self, already_done: int) -> None:
        """Start the clock now, counting ``already_done`` as finished by an earlier run."""
        self.already_done = self.done = already_done
        self.failed = self.tokens = 0
        self.started = time.monotonic()

    def advance(self, done: int = 0, failed: int = 0, tokens: int = 0) -> None:
        self.done += done
        self.failed += failed
        self.tokens += tokens
        if time.monotonic() - self._last_report >= self.interval_s:
            self.report()

    def snapshot(self, state: str = "running") -> dict:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        new = self.done - self.already_done + self.failed
        rate = new / elapsed if new else None
        remaining = max(self.total - self.done - self.failed, 0)
        eta = remaining / rate if rate else None
        return {
            "stage": self.stage,
            "state": state,
            "unit": self.unit,
            "done": self.done,
            "failed": self.failed,
            "total": self.total,
            "resumed_from": self.already_done,
            "rate_per_s": rate,
            "tokens": self.tokens,
            "tokens_per_s": self.tokens / elapsed,
            "elapsed_s": elapsed,
            "eta_s": 0.0 if state == "finished" else eta,
            "phase": None if state == "finished" else self.phase,
            "plan": self.plan,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "log": self.log_path,
            "started_at": self.started_at,
            "updated_at": now_iso(),
        }

    def enter_phase(self, phase: str | None) -> None:
        """Say what the stage is doing now (None: the counted work) and report it at once."""
        self.phase = phase
        self.report()

    def report(self, state: str = "running") -> dict:
        self._last_report = time.monotonic()
        snap = self.snapshot(state)
        rate = f"{snap['rate_per_s']:.2f}" if snap["rate_per_s"] else "-"
        doing = f" ({snap['phase']})" if snap["phase"] else ""
        log.info(
            "%s%s: %d/%d %s done, %d failed, %s/s, %.0f tok/s, ETA %s",
            self.stage,
            doing,
            snap["done"],
            self.total,
            self.unit,
            snap["failed"],
            rate,
            snap["tokens_per_s"],
            format_duration(snap["eta_s"]),
        )
        if self.path is not None:
            write_json(self.path, snap)
        return snap


def took(progresses: list[dict]) -> float | None:
    """Wall time of a finished stage: from its first job's start to its last job's end (the
    shards of extract run as separate jobs, in parallel where resources allow)."""
    try:
        starts = [datetime.fromisoformat(p["started_at"]) for p in progresses]
        ends = [datetime.fromisoformat(p["updated_at"]) for p in progresses]
    except (KeyError, TypeError, ValueError):
        return None
    if not starts or any(p.get("state") != "finished" for p in progresses):
        return None
    return (max(ends) - min(starts)).total_seconds()
