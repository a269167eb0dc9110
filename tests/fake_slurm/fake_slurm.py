"""A fake SLURM for tests: what snakemake-executor-plugin-slurm 2.6 calls, recorded.

Run as ``fake_slurm.py <command> <args...>``; tests put one small wrapper per command name
(``install(bin_dir)``) first on PATH. State lives in ``$FAKE_SLURM_DIR``:

- ``calls.jsonl``        every call: command and argv
- ``submissions.jsonl``  every ``sbatch``: job id, argv, the job name/comment, stdin (the
                         job script when the plugin passes it through stdin), time
- ``jobs.json``          (optional, written by the test) comment -> {"outputs": [paths],
                         "state": "COMPLETED" | "FAILED" | ...}: sbatch creates the outputs
                         (as if the job had run) and sacct/squeue report the state
                         (default COMPLETED)

The plugin's commands: sbatch (submit, ``--parsable`` answers the job id), sacct (job states
of the run's job name; the account guess; failure reasons; failed nodes), squeue (job
states), scancel, sinfo (``-o %P``: partitions, the default one starred), scontrol (``show
config``: MinJobAge, MaxArraySize), sacctmgr and sshare (the user's accounts).
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import sys
import time
from pathlib import Path

COMMANDS = (
    "sbatch",
    "sacct",
    "squeue",
    "scancel",
    "sinfo",
    "scontrol",
    "sacctmgr",
    "sshare",
    "srun",
)
ACCOUNT = "fake_account"
DEFAULT_PARTITION = "fake_default"
FIRST_JOB_ID = 1000


def install(bin_dir: Path, python: str = sys.executable) -> Path:
    """Write one executable wrapper per SLURM command into ``bin_dir``."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    me = Path(__file__).resolve()
    for name in COMMANDS:
        wrapper = bin_dir / name
        wrapper.write_text(
            f'#!/bin/sh\nexec {shlex.quote(python)} {shlex.quote(str(me))} {name} "$@"\n'
        )
        wrapper.chmod(0o755)
    return bin_dir


def _state_dir(state_dir: Path | None = None) -> Path:
    return Path(state_dir) if state_dir is not None else Path(os.environ["FAKE_SLURM_DIR"])


class _Lock:
    """Serialize the plugin's concurrent sbatch calls (it submits from two threads)."""

    def __enter__(self):
        self.handle = open(_state_dir() / ".lock", "a")
        fcntl.flock(self.handle, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.handle, fcntl.LOCK_UN)
        self.handle.close()


def _append(name: str, record: dict) -> None:
    with open(_state_dir() / name, "a") as handle:
        handle.write(json.dumps(record) + "\n")


def _read_jsonl(name: str, state_dir: Path | None = None) -> list[dict]:
    path = _state_dir(state_dir) / name
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _jobs_spec() -> dict:
    path = _state_dir() / "jobs.json"
    return json.loads(path.read_text()) if path.exists() else {}


def option(argv: list[str], *names: str) -> str | None:
    """Value of ``--name value``, ``--name=value`` or ``-n value`` in argv."""
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if name.startswith("--") and arg.startswith(name + "="):
                return arg[len(name) + 1 :]
    return None


def submissions(state_dir: Path | None = None) -> list[dict]:
    """Every sbatch call so far, in order (tests pass the state directory)."""
    return _read_jsonl("submissions.jsonl", state_dir)


def calls(state_dir: Path | None = None) -> list[dict]:
    """Every call of any fake command so far, in order."""
    return _read_jsonl("calls.jsonl", state_dir)


def _state_of(submission: dict) -> str:
    return _jobs_spec().get(submission["comment"], {}).get("state", "COMPLETED")


def sbatch(argv: list[str]) -> int:
    stdin = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
    comment = option(argv, "--comment") or ""
    with _Lock():
        jobid = FIRST_JOB_ID + len(submissions())
        spec = _jobs_spec().get(comment, {})
        for out in spec.get("outputs", []):  # the job "ran": its outputs exist
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(f"written by fake SLURM job {jobid}\n")
        _append(
            "submissions.jsonl",
            {
                "jobid": str(jobid),
                "argv": argv,
                "comment": comment,
                "job_name": option(argv, "--job-name", "-J"),
                "stdin": stdin,
                "time": time.time(),
            },
        )
    print(jobid)
    return 0


def _status_lines(argv: list[str]) -> str:
    name = option(argv, "--name")
    return "".join(
        f"{s['jobid']}|{_state_of(s)}\n"
        for s in submissions()
        if name is None or s["job_name"] == name
    )


def sacct(argv: list[str]) -> int:
    fmt = (option(argv, "--format", "-o") or "").lower()
    if "state" in fmt:  # the status query of the run's jobs
        sys.stdout.write(_status_lines(argv))
    elif "account" in fmt:  # the account guess from the user's recent jobs
        print(ACCOUNT)
    elif "reason" in fmt:  # why a failed job step failed
        job = option(argv, "-j") or ""
        print("NonZeroExitCode" if job.endswith(".0") else "")
    elif "nodelist" in fmt:
        print("fake-node-1")
    return 0


def squeue(argv: list[str]) -> int:
    sys.stdout.write(_status_lines(argv))
    return 0


def sinfo(argv: list[str]) -> int:
    print(f"PARTITION\n{DEFAULT_PARTITION}*\nfake_gpu")
    return 0


def scontrol(argv: list[str]) -> int:
    if argv[:2] == ["show", "config"]:
        print(
            "Configuration data as of 2026-01-01T00:00:00\nMaxArraySize            = 1001\n"
            "MinJobAge               = 300 sec"
        )
        return 0
    print(f"fake scontrol: unsupported {argv}", file=sys.stderr)
    return 1


def accounts(argv: list[str]) -> int:  # sacctmgr and sshare
    print(ACCOUNT)
    return 0


def scancel(argv: list[str]) -> int:
    return 0


def srun(argv: list[str]) -> int:  # only the job step runs srun: never in these tests
    print("fake srun: jobs do not run here", file=sys.stderr)
    return 1


def main() -> int:
    command, argv = sys.argv[1], sys.argv[2:]
    _append("calls.jsonl", {"command": command, "argv": argv, "time": time.time()})
    handler = {
        "sbatch": sbatch,
        "sacct": sacct,
        "squeue": squeue,
        "scancel": scancel,
        "sinfo": sinfo,
        "scontrol": scontrol,
        "sacctmgr": accounts,
        "sshare": accounts,
        "srun": srun,
    }[command]
    return handler(argv)


if __name__ == "__main__":
    sys.exit(main())
