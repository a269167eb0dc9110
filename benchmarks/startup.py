"""What a person waits for before anything runs: `snakemake -n` and `eaglet status` on a
finished run, for this checkout beside another one (an earlier commit), in one run.

Each command runs ``--repeats`` times per checkout, the checkouts taking turns, so the drift
of a shared machine falls on both alike; every run also records whether PyTorch was imported
(a ``sitecustomize`` probe on the path writes it at exit). The results are a table of the
median and the range of each, and the ratio of the medians.

    python benchmarks/startup.py --results results --before ../eaglet-before \\
        --out benchmarks/results/startup.md

``--before`` is a checkout of the earlier code (``git worktree add ../eaglet-before <commit>``);
both run with this environment's Python, each with its own ``src`` first on the path.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

PROBE = """\
import atexit, os, sys
def _report():
    with open(os.environ["EAGLET_STARTUP_PROBE"], "a") as handle:
        handle.write("torch\\n" if "torch" in sys.modules else "no torch\\n")
atexit.register(_report)
"""


def commands(tree: Path, results: Path) -> dict[str, list[str]]:
    """The commands timed, as this checkout spells them (the CLI moved with the packages)."""
    cli = "eaglet.tools.cli" if (tree / "src/eaglet/tools/cli.py").exists() else "eaglet.cli"
    status = [sys.executable, "-m", cli, "status", "--results", str(results)]
    return {
        "snakemake -n": [
            sys.executable,
            "-m",
            "snakemake",
            "-n",
            "--cores",
            "1",
            "--config",
            f"results_dir={results}",
        ],
        "eaglet status": status,
        "eaglet status --no-snakemake": status + ["--no-snakemake"],
    }


def timed(command: list[str], tree: Path, probe_dir: Path, record: Path) -> tuple[float, bool]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(probe_dir), str(tree / "src")]),
        "EAGLET_STARTUP_PROBE": str(record),
    }
    record.write_text("")
    start = time.perf_counter()
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} in {tree} failed:\n{done.stderr[-2000:]}")
    return seconds, "torch\n" in record.read_text().splitlines(keepends=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, required=True, help="a finished run's results")
    parser.add_argument("--before", type=Path, required=True, help="a checkout of earlier code")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="markdown table (else stdout)")
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "now": HERE}
    results = args.results.resolve()
    times: dict[tuple[str, str], list[float]] = {}
    torch: dict[tuple[str, str], set[bool]] = {}
    with tempfile.TemporaryDirectory() as work:
        probe_dir = Path(work) / "probe"
        probe_dir.mkdir()
        (probe_dir / "sitecustomize.py").write_text(PROBE)
        record = Path(work) / "record"
        for _ in range(args.repeats):
            for label, tree in trees.items():
                for name, command in commands(tree, results).items():
                    seconds, imported = timed(command, tree, probe_dir, record)
                    times.setdefault((name, label), []).append(seconds)
                    torch.setdefault((name, label), set()).add(imported)
    lines = [
        f"{args.repeats} runs each, the checkouts taking turns; {results.name}/ of a "
        f"finished run; seconds, median (min-max)",
        "",
        "| command | before | now | now/before | torch imported (before, now) |",
        "|---|---|---|---|---|",
    ]
    for name in commands(HERE, results):
        before, now = times[(name, "before")], times[(name, "now")]
        said = [
            ", ".join(sorted({"yes" if t else "no" for t in torch[(name, label)]}))
            for label in trees
        ]
        lines.append(
            f"| `{name}` | {statistics.median(before):.2f} ({min(before):.2f}-"
            f"{max(before):.2f}) | {statistics.median(now):.2f} ({min(now):.2f}-"
            f"{max(now):.2f}) | {statistics.median(now) / statistics.median(before):.2f}"
            f" | {said[0]}, {said[1]} |"
        )
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
