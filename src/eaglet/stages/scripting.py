"""Glue between Snakemake ``script:`` entry points and the library.

``run_stage`` sends the stage's logging to its Snakemake log file (and stderr), gives a GPU
job its own devices (``eaglet.core.gpus``), and turns an exception into one clear error block
instead of a traceback buried in Snakemake's output.
"""

from __future__ import annotations

import logging
import logging.handlers
import sys
import traceback
from collections.abc import Callable

from eaglet.core.gpus import hold_gpus
from eaglet.engine.server import Terminated

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(log_path: str | None, level: int = logging.INFO) -> None:
    """The stage's log lines to stderr and to ``log_path``. The file is watched: Snakemake
    removes a job's log before the job runs, so a rerun refused beside a live stage (which
    holds its directory) deleted the live stage's log, and its lines went on into a file no
    path names; a watched handler opens the path again on its next line."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_path:
        handlers.append(logging.handlers.WatchedFileHandler(log_path))
    logging.basicConfig(level=level, format=FORMAT, handlers=handlers, force=True)


# what an interrupted stage's rerun does: resume from its finished work, or start over
RESUMES = "finished work is kept, rerun to resume"
STARTS_OVER = "it keeps no partial work: a rerun starts it over"


def run_stage(
    name: str,
    log_path: str | None,
    body: Callable[[], object],
    gpus: int = 0,
    resumes: bool = True,
) -> None:
    """Run ``body``; ``gpus`` (the job's Snakemake ``gpu`` resource) are claimed first, before
    anything initializes CUDA (``eaglet.core.gpus.hold_gpus``). ``resumes``: whether a rerun
    of the stage resumes from its finished work (generation, extraction, training) or starts
    over (the evaluation's engine runs are measured again), as an interruption says."""
    setup_logging(log_path)
    log = logging.getLogger(f"eaglet.{name}")
    try:
        hold_gpus(gpus)
        body()
    except (KeyboardInterrupt, Terminated) as exc:
        log.error(
            "%s interrupted (%s); %s",
            name,
            type(exc).__name__ if isinstance(exc, KeyboardInterrupt) else exc,
            RESUMES if resumes else STARTS_OVER,
        )
        sys.exit(130)
    except Exception as exc:  # the message is the product here: say what broke and the fix
        if log_path:  # the traceback is for the log; the terminal gets the message
            with open(log_path, "a") as handle:
                handle.write(traceback.format_exc())
        log.error("%s failed: %s", name, exc)
        sys.exit(1)
