"""Where a run stands: what finished (and what it verified), what runs now, what remains,
and how long that will take. Read-only: it reads the files the stages write.

Each stage leaves behind its outputs, a stats or manifest file with its checks, a log under
``logs/`` and, while it runs, ``progress/<stage>.json`` with its pid. A progress file whose
pid is gone belongs to an interrupted stage. A stage that writes no progress file runs while
its log is newer than the start of the Snakemake that runs it (``run/snakemake.json``), and
a Snakemake that is gone may have left its lock, which status names with the command that
removes it. Remaining time comes from the sizes in the config and the rates measured by
this run, by earlier runs (``eaglet.core.rates``) or by the benchmarks, in that order, and says
which one it used. Those rates come from other days and machines: once a model stage of this
run has worked for a minute (or finished), its measured rate over the rate its estimate assumed is
this machine's speed for that kind of work, and the estimates of the other stages are scaled by it
(by their own kind's where measured, else by another kind's).
"""

from eaglet.tools.status.estimates import (
    CHARS_PER_TOKEN,
    COMPLETION_FILL_GUESS,
    OFFLINE_REPLAY_SHARE,
    PACK_TOKENS_PER_S,
    TEMPLATE_TOKENS_GUESS,
    Estimate,
)
from eaglet.tools.status.gather import collect, snakemake_config_args, stage_status
from eaglet.tools.status.render import main, order_line, render
from eaglet.tools.status.stages import STAGES, Generate, run_stages
from eaglet.tools.status.time_left import estimate

__all__ = [
    "CHARS_PER_TOKEN",
    "COMPLETION_FILL_GUESS",
    "OFFLINE_REPLAY_SHARE",
    "PACK_TOKENS_PER_S",
    "STAGES",
    "TEMPLATE_TOKENS_GUESS",
    "Estimate",
    "Generate",
    "collect",
    "estimate",
    "main",
    "order_line",
    "render",
    "run_stages",
    "snakemake_config_args",
    "stage_status",
]
