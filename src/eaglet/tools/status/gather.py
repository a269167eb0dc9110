"""``eaglet status``'s collection of a run: for each stage whether it finished, runs (its
progress file's pid, or a log newer than the running Snakemake's start) or failed (the last
error line of its log), which outputs Snakemake would make again, and a stale Snakemake lock
with the command that removes it (:func:`collect`)."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from eaglet.core.layout import RUN_CONFIG, RUN_SNAKEMAKE
from eaglet.core.progress import took
from eaglet.engine.server import pid_alive
from eaglet.tools.status.estimates import _read, process_alive
from eaglet.tools.status.stage import Stage
from eaglet.tools.status.stages import run_stages
from eaglet.tools.status.time_left import estimate

# -- gathering -------------------------------------------------------------------------------

_FAILED = re.compile(r" ERROR eaglet\.[\w.]+: [\w\[\]]+ failed: (?P<why>.*)")


_HELD = re.compile(r"is held by another \w+ process, pid (?P<pid>\d+) on host (?P<host>\S+)")


def _refusal_of_the_past(why: str) -> bool:
    """Whether ``why`` is a rerun refused beside a live job of its stage (the directory it
    writes was held) whose holder has ended since: the stage itself did not fail, and the
    holder's own lines follow in the same log."""
    held = _HELD.search(why)
    return bool(held) and held["host"] == socket.gethostname() and not pid_alive(int(held["pid"]))


def _last_error(log: Path) -> tuple[str, float] | None:
    """The reason a stage's job last failed, as its ``run_stage`` logged it, and when (the
    log's modification time). Snakemake deletes a job's log before running it again, so a
    failure in a log is its job's last run."""
    files = sorted(log.rglob("*.log")) if log.is_dir() else [log]
    found = []
    for path in files:
        try:
            lines = path.read_text(errors="replace").splitlines()
            mtime = path.stat().st_mtime
        except OSError:
            continue
        for line in reversed(lines[-200:]):
            match = _FAILED.search(line)
            if match and not _refusal_of_the_past(match["why"]):
                found.append((match["why"][:300], mtime))
                break
    return max(found, key=lambda f: f[1]) if found else None


def _newest_output(r: Path, stage: Stage) -> float:
    return max(os.stat(p).st_mtime for out in stage.outputs for p in glob.glob(str(r / out)))


def snakemake_run(r: Path) -> dict | None:
    """The Snakemake that last started on ``r`` (``run/snakemake.json``, written by the
    Snakefile's onstart): its record, whether it still runs, and when it started."""
    path = r / RUN_SNAKEMAKE
    record = _read(path)
    if not isinstance(record, dict) or not record.get("pid"):
        return None
    try:
        started = path.stat().st_mtime
    except OSError:
        return None
    return {**record, "alive": pid_alive(record["pid"]), "started": started}


def _log_started(log: Path) -> float | None:
    """When a stage's job began logging: the time of its log's first line (``run_stage``
    opens the log as the job starts)."""
    try:
        with open(log, errors="replace") as handle:
            first = handle.readline()
        return datetime.strptime(first[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except (OSError, ValueError):
        return None


def _job_without_progress(stage: Stage, r: Path) -> dict | None:
    """A record like a progress file's for a stage that writes none (prepare_target,
    prepare_prompts, vocab_map) while its job runs: its log was written since the run's
    Snakemake started and its outputs are not all there yet. Without it such a stage read
    pending for as long as it ran (an embedded target's dequantization: a minute or more).
    Its state is ``interrupted`` once that Snakemake is gone."""
    run = snakemake_run(r)
    log = r / stage.log
    if run is None or not log.is_file():
        return None
    try:
        if log.stat().st_mtime < run["started"]:
            return None  # an earlier run's log
    except OSError:
        return None
    began = _log_started(log) or run["started"]
    return {
        "stage": stage.name,
        "state": "running" if run["alive"] else "interrupted",
        "pid": run["pid"],
        "snakemake_job": True,
        "log": str(log),
        "elapsed_s": max(time.time() - began, 0.0),
        "eta_s": None,
        "started_at": datetime.fromtimestamp(began, UTC).isoformat(timespec="seconds"),
    }


def stage_status(stage: Stage, r: Path, cfg: dict, outdated: set[str]) -> dict:
    """Where ``stage`` stands; ``outdated``: the rules Snakemake would run now."""
    done = all(glob.glob(str(r / out)) for out in stage.outputs)
    progress_files = sorted(glob.glob(str(r / stage.progress))) if stage.progress else []
    progresses = [p for p in (stage.read_progress(r, Path(f)) for f in progress_files) if p]
    active = [p for p in progresses if p.get("state") == "running"]
    running = [p for p in active if process_alive(p) is not False]
    stale = [p for p in active if process_alive(p) is False]
    failure = _last_error(r / stage.log) if not running else None
    if failure and done and failure[1] <= _newest_output(r, stage):
        failure = None  # an older failure: the outputs were made after it
    job = None if done or failure or stage.progress else _job_without_progress(stage, r)
    if job is not None:
        (running if job["state"] == "running" else stale).append(job)
    out: dict[str, Any] = {"stage": stage.name}
    if running:
        out["state"] = "running"
        out["progress"] = running
    elif failure:  # also when its process is gone or an older output is still there
        out["state"] = "failed"
        out["error"] = failure[0]
    elif done:
        out["state"] = "outdated" if outdated & set(stage.rules) else "completed"
        out["facts"] = stage.facts(r)
        out["took_s"] = took(progresses)
    elif stale:
        out["state"] = "interrupted"
        out["progress"] = stale
    else:
        out["state"] = "pending"
    if stage.gpu_key:
        out["gpus"] = stage.gpus(cfg)
    if out["state"] != "completed":
        first = (out.get("progress") or [None])[0]
        est = estimate(stage.name, r, cfg, first if out["state"] == "running" else None)
        out["estimate_s"], out["estimate_basis"] = est.seconds, est.basis
        # the measurement of this run the estimate rests on: this machine's speed for a kind of
        # work (the factor over the estimate's rate), and the stage that measured it
        out["speed_factor"] = est.speed.factor if est.speed else None
        out["speed_kind"] = est.speed.kind if est.speed else None
        out["speed_from"] = est.speed.stage if est.speed else None
    out["log"] = str(r / stage.log)
    return out


# what the Snakefile says, at parse, of a stage whose recorded settings differ from the
# config's (rules/common.smk settings_file): a dry run records nothing, so its plan alone
# does not show the rerun the next real run makes
SETTINGS_CHANGED = re.compile(
    r"^(?:\S+\s+)*?(\w+): settings changed since its outputs were made \((.*?)\): it runs again",
    re.M,
)


def snakemake_outdated(
    workflow: Path, config_args: list[str], forced: tuple[str, ...] = ()
) -> tuple[set[str], dict[str, str]] | None:
    """Rules Snakemake would run now (a dry run without taking the lock), and the stages
    whose settings changed with what changed (:data:`SETTINGS_CHANGED`); None where the dry
    run fails. ``forced``: rules run again whatever their outputs (Snakemake's --forcerun),
    with every rule after them."""
    if not (workflow / "Snakefile").exists():
        return None
    cmd = [
        str(Path(sys.executable).parent / "snakemake"),
        "-n",
        "--nolock",
        "--quiet",
        "rules",
        *config_args,
        *(["--forcerun", *forced] if forced else []),
    ]
    try:
        proc = subprocess.run(cmd, cwd=workflow, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    rules = set()
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit() and parts[0] not in ("total", "job"):
            rules.add(parts[0])
    changed = {m.group(1): m.group(2) for m in SETTINGS_CHANGED.finditer(proc.stdout + proc.stderr)}
    return rules, changed


def _outdated(workflow: Path, config_args: list[str], cfg: dict) -> tuple[set[str] | None, dict]:
    """The rules the next real run runs: Snakemake's plan, and where the config's settings
    differ from those a stage's outputs were made with, that stage's rules and every rule
    after them (a second dry run forcing them: the first plans nothing for a change the
    settings files have not recorded yet). With what changed, per stage."""
    seen = snakemake_outdated(workflow, config_args)
    if seen is None:
        return None, {}
    rules, changed = seen
    forced = tuple(
        sorted(
            {
                rule
                for stage in run_stages(cfg)
                if any(name == stage.name or name.startswith(f"{stage.name}_") for name in changed)
                for rule in stage.rules
            }
        )
    )
    if forced:
        again = snakemake_outdated(workflow, config_args, forced)
        if again is not None:
            rules |= again[0]
    return rules, changed


def snakemake_config_args(results: Path, config_path: str | None) -> list[str]:
    """Snakemake arguments that give the dry run the config this run was made with: the
    given file, else the run's own record (results/run/config.json), so that a run started
    with ``--configfile`` is not judged against the workflow's default config."""
    recorded = results / RUN_CONFIG
    if config_path is None and recorded.exists():
        config_path = str(recorded.resolve())
    args = ["--config", f"results_dir={results}"]
    return ["--configfile", config_path, *args] if config_path else args


def _names_results(line: str, workdir: str, roots: set[str]) -> bool:
    """Whether a path in a Snakemake lock file (as the rules name it: relative to the
    working directory, or absolute) lies in one of ``roots``."""
    path = os.path.normpath(os.path.join(workdir, line.strip()))
    return any(path == root or path.startswith(root + os.sep) for root in roots)


def stale_lock(
    workdir: Path, results: Path, config_args: list[str], command: str | None = None
) -> dict | None:
    """The lock a Snakemake left in ``workdir/.snakemake/locks`` when it was killed (it
    removes the lock only on its way out), if the lock names files of ``results``: the next
    run on them stops with Snakemake's LockException until ``snakemake --unlock`` (with the
    run's config, so that the Snakefile reads as it did) removes it. Call it only when the
    Snakemake that ran ``results`` is gone: a running one holds its lock rightly."""
    lock_dir = workdir / ".snakemake" / "locks"
    files = sorted(lock_dir.glob("*.lock")) if lock_dir.is_dir() else []
    roots = {os.path.abspath(results), os.path.realpath(results)}
    base = os.path.abspath(workdir)
    named = False
    for path in files:
        with contextlib.suppress(OSError):
            named = any(
                _names_results(line, base, roots)
                for line in path.read_text(errors="replace").splitlines()
                if line.strip()
            )
        if named:
            break
    if not named:
        return None
    words: list[str] = []
    with contextlib.suppress(ValueError):  # an unbalanced quote in the recorded command
        words = shlex.split(command or "")
    # the Snakemake the run used (.venv/bin/snakemake), as the recorded command names it
    program = words[0] if words and os.path.basename(words[0]) == "snakemake" else "snakemake"
    unlock = shlex.join([program, "--unlock", *config_args])
    if os.path.realpath(workdir) != os.path.realpath(os.getcwd()):
        unlock = f"cd {shlex.quote(str(workdir))} && {unlock}"
    return {"lock_dir": str(lock_dir), "files": [p.name for p in files], "unlock": unlock}


def collect(
    results: Path,
    cfg: dict,
    workflow: Path | None = None,
    config_args: list[str] | None = None,
    workdir: Path | None = None,
) -> dict:
    """Everything status shows. ``workdir``: the directory Snakemake runs in, whose
    ``.snakemake/locks`` a killed run leaves behind (default: ``workflow``, else the
    current directory)."""
    outdated, changed = _outdated(workflow, config_args or [], cfg) if workflow else (None, {})
    stages = [stage_status(s, results, cfg, outdated or set()) for s in run_stages(cfg)]
    for s in stages:
        said = [f"{name}: {what}" for name, what in changed.items() if name.startswith(s["stage"])]
        if said and s["state"] == "outdated":
            s["settings_changed"] = "; ".join(said)
    remaining = [s for s in stages if s["state"] not in ("completed",)]
    known = [s["estimate_s"] for s in remaining if s.get("estimate_s") is not None]
    # nothing left is no time left (None: some remaining stage has no estimate at all)
    total = sum(known) if known or not remaining else None
    snake = _read(results / RUN_SNAKEMAKE) or {}
    alive = pid_alive(snake.get("pid"))
    lock = None
    if snake.get("pid") and not alive:
        lock = stale_lock(
            workdir or workflow or Path("."),
            results,
            config_args if config_args is not None else snakemake_config_args(results, None),
            snake.get("command"),
        )
    return {
        "results": str(results),
        "checked_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "snakemake": {
            "pid": snake.get("pid"),
            "running": alive,
            "command": snake.get("command"),
            "stale_lock": lock,
        },
        "stages": stages,
        "remaining_s": total,
        "remaining_complete": len(known) == len(remaining),
        "finishes_at": (
            (datetime.now(UTC) + timedelta(seconds=total)).isoformat(timespec="minutes")
            if total is not None
            else None
        ),
        "snakemake_view": "checked" if outdated is not None else "not checked",
    }
