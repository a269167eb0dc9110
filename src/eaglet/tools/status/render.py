"""`eaglet status`: the report of where a run stands, as text, and the command that prints it
(the package's doc says what it reads)."""

from __future__ import annotations

import json
import shlex
import socket
import sys
import time
from pathlib import Path

from eaglet.core.config import ConfigError, load_run_config, run_config_notes
from eaglet.core.progress import format_duration
from eaglet.tools.status.gather import collect, snakemake_config_args
from eaglet.tools.status.stages import _BY_NAME, STAGES


def _facts_line(s: dict) -> str:
    stage = _BY_NAME.get(s["stage"])
    facts = s.get("facts", {})
    return stage.line(facts) if stage else json.dumps(facts)


def plan_text(plan: dict) -> str:
    """A stage's plan of work as its progress file states it, in words: its kind first, then
    each count (``tokens 52311``; lists as they are, tables left to --json)."""
    parts = [str(plan["kind"])] if plan.get("kind") else []
    for key, value in plan.items():
        if key == "kind" or value is None or isinstance(value, dict):
            continue
        parts.append(f"{key.replace('_', ' ')} {value}")
    return ", ".join(parts)


def order_line(names: list[str] | None = None) -> str:
    """The stages in the workflow's order (``names``: a run's, else every one there is)."""
    stages = [_BY_NAME[n] for n in names if n in _BY_NAME] if names is not None else STAGES
    return "Order: " + " -> ".join(s.name + (f" ({s.note})" if s.note else "") for s in stages)


def render(report: dict) -> str:
    lines = [f"eaglet status of {report['results']} at {report['checked_at']}"]
    snake = report["snakemake"]
    if snake["pid"]:
        lines.append(
            f"snakemake: {'running' if snake['running'] else 'not running'} (pid {snake['pid']})"
        )
    unlock = (snake.get("stale_lock") or {}).get("unlock")
    # jobs that outlived their Snakemake: a rerun beside them would write their files twice
    orphans = (
        [
            p
            for s in report["stages"]
            if s["state"] == "running"
            for p in s["progress"]
            if p.get("pid")
        ]
        if snake["pid"] and not snake["running"]
        else []
    )
    if orphans:
        pids = " ".join(str(p["pid"]) for p in orphans)
        lines.append(
            "  its jobs still run without it: "
            + ", ".join(f"{p['stage']} (pid {p['pid']})" for p in orphans)
            + f"; stop them first (kill {pids}): a rerun's jobs refuse to start beside "
            f"them (they would write the same files)"
        )
    if unlock:
        first = "stop the jobs above, then " if orphans else ""
        lines.append(
            f"  it was stopped and left its lock in {snake['stale_lock']['lock_dir']}: "
            f"the next run stops with LockException until you {first}run\n    {unlock}"
        )
    by_state: dict[str, list[dict]] = {}
    for s in report["stages"]:
        by_state.setdefault(s["state"], []).append(s)

    lines.append("\nCompleted:")
    for s in by_state.get("completed", []) + by_state.get("outdated", []):
        mark = "~" if s["state"] == "outdated" else "+"
        note = (
            f"  (outdated: {'settings changed: ' + s['settings_changed'] if s.get('settings_changed') else 'Snakemake will rerun it'})"
            if s["state"] == "outdated"
            else ""
        )
        took = f"[{format_duration(s['took_s'])}] " if s.get("took_s") is not None else ""
        lines.append(f"  {mark} {s['stage']:<16}{took}{_facts_line(s)}{note}")
    if not by_state.get("completed") and not by_state.get("outdated"):
        lines.append("  (nothing yet)")

    active = (
        by_state.get("running", []) + by_state.get("interrupted", []) + by_state.get("failed", [])
    )
    if active:
        lines.append("\nRunning / stopped:")
    for s in active:
        if s["state"] == "failed":
            lines.append(f"  ! {s['stage']:<16}FAILED: {s['error']}\n{'':20}log: {s['log']}")
            continue
        for p in s["progress"]:
            rate = f"{p['rate_per_s']:.2f} {p['unit']}/s" if p.get("rate_per_s") else "rate ?"
            word = (
                "running"
                if s["state"] == "running"
                else "INTERRUPTED (process gone; "
                + (
                    "remove Snakemake's lock as said above, then rerun snakemake to resume)"
                    if unlock
                    else "rerun snakemake to resume)"
                )
            )
            if p.get("phase"):
                word += f" ({p['phase']})"
            if p.get("snakemake_job"):  # a stage that counts nothing: Snakemake runs its job
                since = (
                    f" for {format_duration(p.get('elapsed_s'))}" if s["state"] == "running" else ""
                )
                lines.append(
                    f"  > {p['stage']:<16}{word}{since} (Snakemake's job, pid "
                    f"{p['pid']})\n{'':20}log: {p['log']}"
                )
                continue
            gpu = f", holds {s['gpus']} GPU(s)" if s.get("gpus") and s["state"] == "running" else ""
            if p.get("host") and p["host"] != socket.gethostname():
                gpu += f", on host {p['host']}"
            lines.append(
                f"  > {p['stage']:<16}{word}: {p['done']}/{p['total']} {p['unit']}, "
                f"{p['failed']} failed, {rate}, ETA {format_duration(p.get('eta_s'))}, "
                f"pid {p['pid']}{gpu}\n{'':20}log: {p.get('log') or s.get('log')}"
            )
            if p.get("plan"):
                lines.append(f"{'':20}work: {plan_text(p['plan'])}")

    todo = [
        s
        for s in report["stages"]
        if s["state"] in ("pending", "outdated", "interrupted", "failed")
    ]
    lines.append("\nRemaining (estimated):")
    for s in todo:
        lines.append(
            f"  - {s['stage']:<16}{'~' + format_duration(s.get('estimate_s')):<10}"
            f"{s.get('estimate_basis', '')}"
        )
    if not todo and not by_state.get("running"):
        lines.append("  nothing: the run is complete")
    if report["remaining_s"] is not None and (todo or by_state.get("running")):
        partial = "" if report["remaining_complete"] else " (some stages have no estimate yet)"
        lines.append(
            f"  total remaining ~{format_duration(report['remaining_s'])}, finishing "
            f"around {report['finishes_at']}{partial}"
        )
    lines.append("\n" + order_line([s["stage"] for s in report["stages"]]))
    running_logs = [p.get("log") for s in by_state.get("running", []) for p in s["progress"]]
    lines.append(
        f"Follow it: eaglet status --results {shlex.quote(report['results'])} --watch 10"
        + (
            f"   or   tail -f {shlex.quote(running_logs[0])}"
            if running_logs and running_logs[0]
            else ""
        )
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="eaglet status", description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=None, help="results directory (default: the config's)")
    parser.add_argument(
        "--configfile",
        dest="config",
        default=None,
        help="config file, as Snakemake took it (default: the one the run "
        "recorded in RESULTS/run/config.json, else ./config.yaml)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--watch", type=float, default=None, metavar="SECONDS")
    parser.add_argument("--workflow", default=".", help="workflow directory, for Snakemake's view")
    parser.add_argument(
        "--no-snakemake",
        action="store_true",
        help="do not ask Snakemake which outputs are out of date (faster)",
    )
    args = parser.parse_args(argv)

    results_hint = Path(args.results) if args.results else None
    try:
        cfg = load_run_config(results_hint or Path("results"), args.config, Path(args.workflow))
    except ConfigError as error:
        print(f"eaglet status: {error}", file=sys.stderr)
        return 2
    results = results_hint or Path(cfg["results_dir"])
    if results_hint is not None and not results.is_dir():
        print(
            f"eaglet status: {results} is not a results directory (nothing has run there). "
            f"Give the results_dir of a run, e.g. --results {shlex.quote(cfg['results_dir'])}",
            file=sys.stderr,
        )
        return 2
    for note in run_config_notes(results, args.config, cfg):
        print(f"eaglet status: note: {note}", file=sys.stderr)
    config_args = snakemake_config_args(results, args.config)
    workflow = None if args.no_snakemake else Path(args.workflow)
    while True:
        report = collect(results, cfg, workflow, config_args, workdir=Path(args.workflow))
        text = json.dumps(report, indent=2) if args.json else render(report)
        if args.watch:
            print("\033[2J\033[H" + text, flush=True)
            time.sleep(args.watch)
            continue
        print(text)
        return 0
