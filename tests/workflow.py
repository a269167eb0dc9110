"""Run the real workflow from tests: `snakemake` on the tiny config in a results dir."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from tests.helpers.paths import REPO, SNAKEMAKE, TINY


def snakemake_cmd(
    results: Path, *targets: str, extra: tuple[str, ...] = (), configs: tuple[Path, ...] = ()
) -> list[str]:
    """``configs`` are merged over the tiny config, in order."""
    # targets first: --config swallows every name=value argument after it
    return [
        str(SNAKEMAKE),
        *[str(results / t) for t in targets],
        "--cores",
        "2",
        "--workflow-profile",
        str(REPO / "profiles/default"),
        *extra,
        "--configfile",
        str(TINY),
        *map(str, configs),
        "--config",
        f"results_dir={results}",
    ]


def run(
    results: Path,
    *targets: str,
    extra: tuple[str, ...] = (),
    timeout: float = 900,
    check: bool = True,
    configs: tuple[Path, ...] = (),
) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        snakemake_cmd(results, *targets, extra=extra, configs=configs),
        cwd=REPO,
        text=True,
        capture_output=True,
        timeout=timeout,
        env=os.environ.copy(),
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake failed ({proc.returncode}):\n{proc.stderr[-5000:]}")
    return proc


def start(results: Path, *targets: str, log_file) -> subprocess.Popen:
    """Start snakemake in its own session, so a test can Ctrl-C it like a user would."""
    # SIGINT handled as in a terminal even when the tests run from a background job (whose
    # children inherit an ignored SIGINT, and Python then never raises KeyboardInterrupt)
    return subprocess.Popen(
        snakemake_cmd(results, *targets),
        cwd=REPO,
        text=True,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
