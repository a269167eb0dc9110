"""Read the jobs out of `snakemake --dry-run` output: rule, wildcards, input, output and log
files, threads, resources."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_RULE = re.compile(r"^(?:local)?rule (?P<name>\w+):\s*$")
_FIELD = re.compile(r"^\s+(?P<key>\w+): (?P<value>.*)$")


@dataclass
class DryRunJob:
    rule: str
    wildcards: dict[str, str] = field(default_factory=dict)
    input: list[str] = field(default_factory=list)
    output: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    resources: dict[str, str] = field(default_factory=dict)
    threads: int = 1  # the dry run prints threads only above 1

    @property
    def slurm_comment(self) -> str:
        """The `--comment` the SLURM plugin gives this job's sbatch call."""
        if not self.wildcards:
            return f"rule_{self.rule}"
        # the plugin joins the values with "_" and turns slashes into "_" as well
        values = "_".join(self.wildcards.values()).replace("/", "_")
        return f"rule_{self.rule}_wildcards_{values}"


def _pairs(value: str) -> dict[str, str]:
    pairs = {}
    for item in value.split(", "):
        key, sep, val = item.partition("=")
        if sep:
            pairs[key.strip()] = val.strip()
    return pairs


def parse_dry_run(text: str) -> list[DryRunJob]:
    """Every job block (`rule NAME:` and its indented fields) of a dry run's output."""
    jobs: list[DryRunJob] = []
    current: DryRunJob | None = None
    for line in text.splitlines():
        match = _RULE.match(line)
        if match:
            current = DryRunJob(match["name"])
            jobs.append(current)
            continue
        match = _FIELD.match(line)
        if current is None or not match:
            if not line.startswith(" "):
                current = None
            continue
        key, value = match["key"], match["value"]
        if key in ("input", "output", "log"):
            setattr(current, key, value.split(", "))
        elif key == "wildcards":
            current.wildcards = _pairs(value)
        elif key == "threads":
            current.threads = int(value)
        elif key == "resources":
            current.resources = _pairs(value)
    return jobs
