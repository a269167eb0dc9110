"""`eaglet status` against the truth: the demo's workflow run from nothing, status read every
minute, each reading's time left against the time the run truly had left.

    .venv/bin/python benchmarks/status_poll.py [--history fresh|keep] [--every 60]
        [--name NAME] [--results DIR]

``--history fresh`` (the default) points ``EAGLET_RATES`` at a new, empty file: a newcomer's
first run, with nothing but the shipped benchmark rates to plan from; ``keep`` uses this
machine's rates history as it is. The workflow runs on config.yaml (the demo's settings) in a
results directory of its own, which is removed first, and nothing else should run beside it.
Afterwards each reading's ``remaining_s`` is held against the run's true end: the goal (issue
"status right on a first run") is every reading after generation starts within 25% of the time
truly left, or within 5% of the whole run where that is more; within 10% while training runs.

Writes benchmarks/results/status_poll_<NAME>.json (every reading) and adds its table to
benchmarks/results/status_poll.md under a heading of its own. ``--reference`` (with a fresh
history) also keeps the rates the run recorded as benchmarks/results/reference_rates.jsonl:
the rates a first run plans from, scaled by the speed it measures of its own machine
(eaglet.core.rates.REFERENCE_RATES); rerun it so when a change makes a stage faster or slower.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results"
BIN = Path(sys.executable).parent


def poll(results: Path, every: float, env: dict) -> tuple[list[dict], float, float, int]:
    """Run the workflow and read status every ``every`` seconds; the readings, the start and
    end times and Snakemake's exit code."""
    cmd = [
        str(BIN / "snakemake"),
        "--cores",
        "2",
        "--workflow-profile",
        "profiles/default",
        "--config",
        f"results_dir={results}",
    ]
    readings = []
    started = time.time()
    results.mkdir(parents=True, exist_ok=True)
    with open(results / "status_poll.snakemake.log", "w") as log:
        run = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
        while run.poll() is None:
            time.sleep(every)
            if run.poll() is not None:
                break
            status = subprocess.run(
                [
                    str(BIN / "eaglet"),
                    "status",
                    "--results",
                    str(results),
                    "--json",
                    "--no-snakemake",
                ],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
            )
            try:
                report = json.loads(status.stdout)
            except ValueError:
                continue
            readings.append(
                {
                    "at": time.time(),
                    "remaining_s": report.get("remaining_s"),
                    "running": [s["stage"] for s in report["stages"] if s["state"] == "running"],
                    "estimates": {
                        s["stage"]: s.get("estimate_s")
                        for s in report["stages"]
                        if s.get("estimate_s") is not None
                    },
                    "bases": {
                        s["stage"]: s.get("estimate_basis")
                        for s in report["stages"]
                        if s.get("estimate_basis")
                    },
                }
            )
    return readings, started, time.time(), run.returncode


def judged(readings: list[dict], started: float, ended: float) -> list[dict]:
    """Each reading beside the time truly left, and whether it meets the goal."""
    whole = ended - started
    rows = []
    generating = False
    for r in readings:
        generating = generating or "generate" in r["running"]
        true_left = ended - r["at"]
        said = r["remaining_s"]
        ratio = said / true_left if said is not None and true_left > 0 else None
        training = "train" in r["running"]
        bound = 0.10 if training else 0.25
        within = said is not None and (
            abs(said - true_left) <= bound * true_left or abs(said - true_left) <= 0.05 * whole
        )
        rows.append(
            {
                "minutes_in": (r["at"] - started) / 60,
                "running": r["running"],
                "said_left_min": None if said is None else said / 60,
                "true_left_min": true_left / 60,
                "ratio": ratio,
                "counted": generating,
                "within": within,
                "bound": bound,
            }
        )
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| minutes in | running | said left | truly left | said/true | |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        mark = (
            "-" if not row["counted"] else "ok" if row["within"] else f"off (> {row['bound']:.0%})"
        )
        said = "-" if row["said_left_min"] is None else f"{row['said_left_min']:.1f}"
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
        lines.append(
            f"| {row['minutes_in']:.1f} | {', '.join(row['running']) or '(between)'} | "
            f"{said} | {row['true_left_min']:.1f} | {ratio} | {mark} |"
        )
    return lines


def keep_reference(rates_file: Path, out: Path = OUT / "reference_rates.jsonl") -> None:
    """The rates one fresh-history run recorded, as the reference rates (each entry as it
    was recorded: stage, target, device, settings, values)."""
    lines = [line for line in rates_file.read_text().splitlines() if line.strip()]
    for line in lines:
        json.loads(line)  # a damaged line is no reference
    out.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--history", choices=["fresh", "keep"], default="fresh")
    parser.add_argument("--every", type=float, default=60.0)
    parser.add_argument("--name", default=None, help="results file suffix (default: --history)")
    parser.add_argument(
        "--results",
        default=None,
        help="results directory (default: a fresh "
        "results-status-poll beside the repository's results)",
    )
    parser.add_argument(
        "--reference",
        action="store_true",
        help="keep the fresh history's rates as the reference rates",
    )
    args = parser.parse_args()
    if args.reference and args.history != "fresh":
        parser.error("--reference needs --history fresh: the reference is one run's rates")
    name = args.name or args.history
    results = Path(args.results or REPO / "results-status-poll").resolve()
    shutil.rmtree(results, ignore_errors=True)
    env = dict(os.environ)
    if args.history == "fresh":
        env["EAGLET_RATES"] = str(Path(tempfile.mkdtemp(prefix="eaglet-rates.")) / "rates.jsonl")
    readings, started, ended, code = poll(results, args.every, env)
    if args.reference and code == 0:
        keep_reference(Path(env["EAGLET_RATES"]))
    rows = judged(readings, started, ended)
    counted = [row for row in rows if row["counted"]]
    off = [row for row in counted if not row["within"]]
    summary = {
        "history": args.history,
        "exit_code": code,
        "run_minutes": (ended - started) / 60,
        "readings": len(rows),
        "counted": len(counted),
        "off": len(off),
        "worst_ratio": max(
            (row["ratio"] for row in counted if row["ratio"]),
            key=lambda x: abs(x - 1),
            default=None,
        ),
        "rows": rows,
        "raw": readings,
        "measured_at": time.strftime("%Y-%m-%d %H:%M"),
    }
    (OUT / f"status_poll_{name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    kind = (
        "First run (no rates history)" if args.history == "fresh" else "With this machine's history"
    )
    heading = (
        f"## {kind}, {name}: {summary['measured_at']}, run of {summary['run_minutes']:.1f} minutes"
    )
    lines = [
        heading,
        "",
        *table(rows),
        "",
        f"{len(off)} of {len(counted)} readings after generation started off the goal "
        f"(25% of the time left, 10% in training, or 5% of the run)."
        + (f" Worst said/true: {summary['worst_ratio']:.2f}." if summary["worst_ratio"] else ""),
        "",
    ]
    path = OUT / "status_poll.md"
    text = path.read_text() if path.exists() else "# `eaglet status` against the truth\n\n"
    path.write_text(text.rstrip("\n") + "\n\n" + "\n".join(lines))
    print("\n".join(lines))
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
