"""The cluster path on a real scheduler: a one-node SLURM of Debian's packages on this machine
(tests/slurm/cluster.sh), the tiny workflow submitted through profiles/slurm job by job to its
report, on a cluster that binds no CPUs, with a training job whose time limit is shorter than
its work (SLURM ends it, Snakemake submits it again, it resumes from its checkpoint); a cluster
without accounting, followed with squeue;
a config too large for the partition, refused before anything is submitted.

`make test-slurm` runs it (EAGLET_SLURM=1; root, as CI is); elsewhere it is skipped. It starts
and stops the daemons itself; where apt or the daemons are not there, it says so and skips."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers.paths import REPO, SNAKEMAKE, TESTS, TINY

CLUSTER = TESTS / "slurm" / "cluster.sh"
MODEL_RULES = ("generate", "extract_vllm", "hidden_manifest", "train", "evaluate")

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(
        not os.environ.get("EAGLET_SLURM"),
        reason="a real SLURM cluster on this machine: make test-slurm (EAGLET_SLURM=1, as root)",
    ),
]


def cluster(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(CLUSTER), *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


@pytest.fixture(scope="module")
def slurm():
    """The daemons' packages installed (or the module skipped, saying why); each test starts
    the cluster it needs, and it is stopped after."""
    if os.geteuid() != 0:
        pytest.skip("the SLURM daemons are started as root")
    done = cluster("install", timeout=900)
    if done.returncode != 0:
        pytest.skip(f"SLURM could not be installed here: {done.stderr.strip()[-500:]}")
    yield
    cluster("stop")


def up(*settings: str) -> None:
    cluster("stop")
    done = cluster("start", *settings)
    if done.returncode != 0:
        cluster("stop")
        pytest.skip(f"the SLURM daemons did not start: {(done.stdout + done.stderr)[-800:]}")


def config_file(tmp_path: Path, name: str, **sections) -> Path:
    config = yaml.safe_load(TINY.read_text())
    config["results_dir"] = str(tmp_path / "results")  # its resources fit a CPU node
    for section, values in sections.items():
        if values is None:
            config.pop(section, None)
        else:
            config.setdefault(section, {}).update(values)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def submit(config: Path, *targets: str, timeout: float, extra=()) -> subprocess.CompletedProcess:
    """snakemake with profiles/slurm, from the repository root (its .snakemake/ holds the
    plugin's SLURM logs); the output also goes to a file beside the config."""
    threads = [f"{rule}=2" for rule in MODEL_RULES]  # a model job holds the node's 2 CPUs
    command = [
        str(SNAKEMAKE),
        *targets,
        "--workflow-profile",
        "profiles/slurm",
        "--configfile",
        str(config),
        "--set-threads",
        *threads,
        *extra,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    (config.parent / f"{config.stem}.snakemake.log").write_text(done.stdout + done.stderr)
    return done


def sacct(*fields: str, since: str = "now-1days") -> list[list[str]]:
    """The cluster's jobs since ``since`` (sacct's -S): each job's ``fields``. Job ids start
    over with each new cluster (its saved state is removed), so a test asks for its own."""
    done = subprocess.run(
        ["sacct", "-n", "-P", "-X", "-S", since, "-o", ",".join(fields)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return [line.split("|") for line in done.stdout.splitlines() if line.strip()]


def test_the_tiny_workflow_runs_on_slurm_to_its_report_through_a_time_limit(slurm, tmp_path):
    """Accounting on, CPU binding off (TaskPlugin=task/none: the jobs' own Snakemake asked srun
    for the node's every core, more than the job held, and every model job failed). Training
    is given one minute, less than its work: SLURM ends it (SIGTERM, then SIGKILL 20 s later),
    it checkpoints, and Snakemake submits it again until it is done."""
    up("accounting", "none")
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    shutil.rmtree(REPO / ".snakemake" / "slurm_logs", ignore_errors=True)
    config = config_file(
        tmp_path, "slurm", train={"epochs": 60}, resources={"train": {"mem_mb": 6000, "runtime": 1}}
    )
    assert yaml.safe_load(config.read_text())["resources"]["generate"]["runtime"] == 30
    done = submit(config, timeout=2400, extra=["--retries", "6"])
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    results = tmp_path / "results"
    acceptance = json.loads((results / "eval" / "acceptance.json").read_text())
    assert acceptance["verdict"]["acceptance_length"] > 1.0
    ended = [job for job, state in sacct("JobID", "State", since=started) if state == "TIMEOUT"]
    assert ended, sacct("JobID", "State", since=started)
    # an attempt SLURM ended said so in its SLURM log (Snakemake removes the stage's own log
    # before the next attempt), and the next attempt resumed from its checkpoint. Not every
    # ended job is one: an attempt that finishes its last step near the limit is ended while
    # Snakemake stores its output, after training said it was done.
    logs = REPO / ".snakemake" / "slurm_logs" / "rule_train"
    stops = []
    for job in ended:
        said = logs / f"{job}.log"
        said = said.read_text() if said.exists() else ""
        if "received SIGTERM at step" in said:
            assert "checkpoint written" in said, said[-3000:]
            stops.append(int(said.split("received SIGTERM at step ")[1].split()[0]))
    assert stops, f"no ended train job says it received SIGTERM: {ended}"
    # the last attempt resumed where one was stopped (or from the last step's checkpoint where
    # it was an attempt ended after its work), not from the start
    train_log = (results / "logs" / "train.log").read_text()
    assert "resumed from" in train_log, train_log[-3000:]
    step, total = train_log.split("resumed from ")[1].split("(step ")[1].split(")")[0].split("/")
    assert int(step) in stops or step == total, (step, total, stops)
    report = subprocess.run(
        [str(SNAKEMAKE), "--report", str(tmp_path / "report.html"), "--configfile", str(config)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert report.returncode == 0 and (tmp_path / "report.html").stat().st_size > 10_000

    # that a resumed training ships the weights an uninterrupted one does is proven in process
    # (tests/test_train.py: a SIGTERM during a step, the checkpoint, the rerun): here, that
    # SLURM's SIGTERM reaches the trainer, which checkpoints, and the next job resumes


def test_a_cluster_without_accounting_is_followed_with_squeue(slurm, tmp_path):
    """Without slurmdbd the plugin's sacct queries fail, and it waited forever after its
    jobs had finished. The profile reads the cluster's accounting and follows jobs with
    squeue: the job finishes and Snakemake notices."""
    up("none", "affinity")
    config = config_file(tmp_path, "plain")
    done = submit(config, str(tmp_path / "results" / "prompts" / "train.jsonl"), timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert (tmp_path / "results" / "prompts" / "train.jsonl").exists()


def test_a_config_too_large_for_the_partition_is_refused_before_anything_is_submitted(
    slurm, tmp_path
):
    """The schema's model-job sizes (32-64 GB, up to a day) fit GPU nodes, not this one:
    sbatch refused each job in turn ("Memory specification can not be satisfied"). The run is
    refused at once, the stages and their sizes named, and no job reaches the queue."""
    up("accounting", "affinity")
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    config = config_file(tmp_path, "big", resources=None)
    done = submit(config, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "the cluster cannot run these jobs as the config sizes them" in output, output[-3000:]
    assert "train: mem_mb 64000 is more than the" in output
    assert sacct("JobID", since=started) == []
