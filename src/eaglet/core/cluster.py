"""What a SLURM cluster gives a run, read from the scheduler itself: the threads a job may use,
and whether each stage's memory and time fit a partition it goes to, before anything is
submitted (``sbatch`` refuses a job that cannot fit with only "Memory specification can not be
satisfied", one job after another). Torch-free: the Snakefile reads it at every parse."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass


class ClusterError(RuntimeError):
    """The run does not fit the cluster it is submitted to."""


def job_threads(cores: int | None, env: Mapping[str, str] = os.environ) -> int:
    """The threads a model job computes with: inside a SLURM job, the CPUs the job was given
    (``SLURM_CPUS_PER_TASK``): the job's own Snakemake runs with every core of the node, and a
    step asking for more than the job holds is refused ("More processors requested than
    permitted") where the cluster does not bind CPUs; elsewhere the run's cores."""
    if env.get("SLURM_JOB_ID"):
        granted = env.get("SLURM_CPUS_PER_TASK") or env.get("SLURM_CPUS_ON_NODE")
        if granted and granted.isdigit():
            return int(granted)
        return 1
    return cores or 1


@dataclass(frozen=True)
class Partition:
    name: str
    default: bool
    memory_mb: int | None  # the largest node's memory (None: sinfo did not say)
    time_limit_min: float | None  # None: infinite
    cpus: int | None


def parse_time(text: str) -> float | None:
    """SLURM's ``[D-]HH:MM:SS`` / ``MM:SS`` / ``MM`` in minutes; None for ``infinite``."""
    text = text.strip()
    if text in ("infinite", "UNLIMITED", ""):
        return None
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:  # D-HH, D-HH:MM, D-HH:MM:SS
        hours, minutes, seconds = (parts + [0, 0])[:3]
    elif len(parts) == 3:
        hours, minutes, seconds = parts
    else:  # MM or MM:SS
        hours, (minutes, seconds) = 0, (parts + [0])[:2]
    return (int(days or 0) * 24 + hours) * 60 + minutes + seconds / 60


def partitions(run=subprocess.run) -> list[Partition] | None:
    """The cluster's partitions as ``sinfo`` lists them (None where sinfo cannot be asked)."""
    try:
        done = run(["sinfo", "-h", "-o", "%P|%m|%l|%c"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    found: dict[str, Partition] = {}
    for line in done.stdout.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 4:
            continue
        name, memory, limit, cpus = fields
        default = name.endswith("*")
        name = name.rstrip("*")
        memory_mb = int(re.sub(r"\D", "", memory)) if re.search(r"\d", memory) else None
        cpu_count = int(re.sub(r"\D", "", cpus)) if re.search(r"\d", cpus) else None
        was = found.get(name)
        if was is not None and was.memory_mb and memory_mb:  # several node kinds: the largest
            memory_mb = max(was.memory_mb, memory_mb)
        found[name] = Partition(name, default, memory_mb, parse_time(limit), cpu_count)
    return list(found.values())


def misfits(
    requests: Mapping[str, Mapping], parts: list[Partition], partition_of: Mapping[str, str | None]
) -> list[str]:
    """Which stage's request (``mem_mb``, ``runtime`` in minutes) no node of the partition it
    goes to can satisfy: ``partition_of[stage]`` (None: the cluster's default), each in words
    with the sizes and the setting to change."""
    by_name = {p.name: p for p in parts}
    default = next((p for p in parts if p.default), None)
    out = []
    for stage, request in requests.items():
        name = partition_of.get(stage)
        part = by_name.get(name) if name else default
        if part is None:
            if name:
                out.append(
                    f"{stage}: partition {name!r} is not one of this cluster's "
                    f"({', '.join(sorted(by_name))})"
                )
            continue
        memory, runtime = request.get("mem_mb"), request.get("runtime")
        if memory and part.memory_mb and memory > part.memory_mb:
            out.append(
                f"{stage}: mem_mb {memory} is more than the {part.memory_mb} MB of the "
                f"largest node of partition {part.name!r}"
            )
        if runtime and part.time_limit_min is not None and runtime > part.time_limit_min:
            out.append(
                f"{stage}: runtime {runtime} min is past partition {part.name!r}'s time "
                f"limit of {part.time_limit_min:g} min"
            )
    return out


def accounting_enabled(run=subprocess.run) -> bool | None:
    """Whether the cluster keeps job accounting (``sacct`` answers), as ``scontrol show
    config`` says; None where it cannot be asked."""
    try:
        done = run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"^AccountingStorageType\s*=\s*(\S+)", done.stdout, re.M)
    if done.returncode != 0 or not match:
        return None
    return not match.group(1).endswith("/none")


SLURM_LOGS = ".snakemake/slurm_logs"
_ERROR_LINE = re.compile(r"error|exception|killed|cancelled|time limit|oom", re.I)


def slurm_log_errors(workdir: str | os.PathLike, since: float, listed: int = 8) -> list[str]:
    """The SLURM logs of this run's jobs (written since ``since``) that hold an error, each
    with its last error line: where a failed job's real cause is (SLURM's own refusal, a
    time limit, a step it could not create), which the stage's own log never shows."""
    from pathlib import Path

    root = Path(workdir) / SLURM_LOGS
    found = []
    for path in sorted(root.rglob("*.log")) if root.is_dir() else []:
        try:
            if path.stat().st_mtime < since:
                continue
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        errors = [line.strip() for line in lines if _ERROR_LINE.search(line)]
        if errors:
            found.append(f"{path}: {errors[-1][:300]}")
    return found[:listed]
