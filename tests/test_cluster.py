"""profiles/slurm against a fake SLURM, and `snakemake --lint`.

The real workflow runs with `--workflow-profile profiles/slurm` and the real
snakemake-executor-plugin-slurm; sbatch, sacct, squeue, scancel, sinfo, scontrol, sacctmgr
and sshare are fakes (tests/fake_slurm) first on PATH. The fake sbatch records each
submission and writes the job's outputs as if it had run; sacct reports it COMPLETED (or
FAILED where a test says so), so Snakemake walks the whole DAG and every rule is submitted
once. Each submission is checked for what it asks SLURM for.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from snakemake.profiles import ProfileConfigFileParser

from tests.fake_slurm import fake_slurm
from tests.helpers.paths import REPO, SNAKEMAKE, TINY
from tests.workflows.dryrun import parse_dry_run

# each test runs Snakemake (the fake-SLURM submissions, its lint) or the SLURM plugin's scontrol
pytestmark = pytest.mark.subprocess

SLURM_PROFILE = REPO / "profiles" / "slurm"

CPU_RULES = {"prepare_target", "prepare_prompts", "vocab_map", "plots"}
# rule -> (the config's gpus key, its `resources` section)
GPU_RULES = {
    "generate": ("server", "generate"),
    "evaluate": ("server", "evaluate"),
    "extract": ("extract", "extract"),  # the hf backend: training and held-out shards
    "hidden_manifest": ("extract", "extract"),
    "train": ("train", "train"),
}
# Every rule the workflow defines that runs a model (extract_vllm: the vllm backend's one job;
# extract_all: the hf backend's with extract.jobs: one),
# read from the rule files themselves
MODEL_RULES = (
    {
        name
        for path in (REPO / "rules").glob("*.smk")
        for name in re.findall(r"^\s*rule (\w+):", path.read_text(), re.MULTILINE)
    }
    - CPU_RULES
    - {"scaling", "start_drafter"}
)  # CPU work: the scaling stage's fit; converting train.init_from's drafter
# Distinct values, so each request can be traced to its config key. `--config
# server.gpus=1` is no valid Snakemake config entry (and `--config 'server={gpus: 1}'` reads
# 1 as a string), so nested overrides go in a second config file.
GPUS = {"server": 1, "extract": 1, "train": 2}
RESOURCES = {
    "generate": (30001, 121),
    "extract": (30002, 122),
    "train": (30003, 123),
    "evaluate": (30004, 124),
}
CPU_PARTITION, GPU_PARTITION = "eaglet_cpu", "eaglet_gpu"


def _overrides(path: Path) -> Path:
    # the hf backend: one extraction job per shard, each submitted with its own GPU
    lines = [f"{key}: {{gpus: {n}}}" for key, n in GPUS.items() if key != "extract"]
    lines.append(f"extract: {{gpus: {GPUS['extract']}, backend: hf}}")
    lines.append("resources:")
    lines += [
        f"  {rule}: {{mem_mb: {mem}, runtime: {minutes}}}"
        for rule, (mem, minutes) in RESOURCES.items()
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "EAGLET_SLURM_"))
    }
    # a user's global profile or partition file must not change what is submitted
    for key in ("SNAKEMAKE_PROFILE", "SNAKEMAKE_SLURM_PARTITIONS"):
        env.pop(key, None)
    return env


class FakeCluster:
    """The real workflow in a temporary results dir, with fake SLURM commands first on PATH."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.state = tmp / "slurm_state"
        self.state.mkdir()
        self.bin = fake_slurm.install(tmp / "bin")
        self.results = tmp / "results"
        self.overrides = _overrides(tmp / "gpus.yaml")
        self.env = _clean_env()
        self.env.update(
            PATH=f"{self.bin}{os.pathsep}{self.env.get('PATH', '')}",
            FAKE_SLURM_DIR=str(self.state),
            EAGLET_SLURM_PARTITION=CPU_PARTITION,
            EAGLET_SLURM_GPU_PARTITION=GPU_PARTITION,
            EAGLET_SLURM_ACCOUNT=fake_slurm.ACCOUNT,
        )

    def snakemake(self, *args: str, targets=(), timeout: float = 240):
        # targets first: --configfile and --config swallow every argument after them
        cmd = [
            str(SNAKEMAKE),
            *[str(self.results / t) for t in targets],
            "--workflow-profile",
            str(SLURM_PROFILE),
            *args,
            "--configfile",
            str(TINY),
            str(self.overrides),
            "--config",
            f"results_dir={self.results}",
        ]
        return subprocess.run(
            cmd, cwd=REPO, env=self.env, text=True, capture_output=True, timeout=timeout
        )

    def run(self, targets=(), extra=()):
        return self.snakemake(
            "--slurm-logdir",
            str(self.tmp / "slurm_logs"),
            "--slurm-init-seconds-before-status-checks",
            "1",
            "--seconds-between-status-checks",
            "1",
            "--latency-wait",
            "5",
            *extra,
            targets=targets,
        )

    def plan(self):
        proc = self.snakemake("--dry-run")
        assert proc.returncode == 0, proc.stderr[-4000:]
        jobs = [j for j in parse_dry_run(proc.stdout + "\n" + proc.stderr) if j.rule != "all"]
        assert jobs, proc.stdout[-3000:]
        return jobs

    def expect(self, jobs, states=None):
        """What each job's sbatch does: end in its rule's state (default COMPLETED) and, when
        it completes, leave the job's outputs behind as if it had run."""
        states = states or {}
        spec = {}
        for job in jobs:
            state = states.get(job.rule, "COMPLETED")
            spec[job.slurm_comment] = {
                "state": state,
                "outputs": job.output if state == "COMPLETED" else [],
            }
        (self.state / "jobs.json").write_text(json.dumps(spec, indent=1))


def _flag(argv: list[str], name: str) -> str | None:
    return fake_slurm.option(argv, name)


def _has(argv: list[str], prefix: str) -> bool:
    return any(arg == prefix or arg.startswith(prefix + "=") for arg in argv)


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory):
    cluster = FakeCluster(tmp_path_factory.mktemp("slurm"))
    jobs = cluster.plan()
    cluster.expect(jobs)
    proc = cluster.run()
    assert proc.returncode == 0, proc.stderr[-6000:]
    return cluster, jobs, proc


def test_every_job_of_the_dag_is_submitted_once(cluster_run):
    cluster, jobs, _ = cluster_run
    submitted = [s["comment"] for s in _submissions(cluster)]
    assert sorted(submitted) == sorted(job.slurm_comment for job in jobs)
    assert {job.rule for job in jobs} == CPU_RULES | set(GPU_RULES)
    # Snakemake itself, asked again, finds every job done: each one it submitted was recorded
    # as finished (the fake writes the outputs, so their existence alone would prove nothing)
    again = cluster.snakemake("--dry-run")
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr, (
        again.stdout[-3000:]
    )
    # all submissions of one run carry its run id as job name: sacct/squeue query by it
    assert len({s["job_name"] for s in _submissions(cluster)}) == 1


def _submissions(cluster: FakeCluster) -> list[dict]:
    return fake_slurm.submissions(cluster.state)


def _by_rule(cluster, jobs) -> dict[str, list[list[str]]]:
    rule_of = {job.slurm_comment: job.rule for job in jobs}
    out: dict[str, list[list[str]]] = {}
    for sub in _submissions(cluster):
        out.setdefault(rule_of[sub["comment"]], []).append(sub["argv"])
    return out


def test_gpu_rules_ask_for_their_gpus_memory_runtime_and_partition(cluster_run):
    cluster, jobs, _ = cluster_run
    by_rule = _by_rule(cluster, jobs)
    for rule, (gpus_key, resources_key) in GPU_RULES.items():
        mem, minutes = RESOURCES[resources_key]
        for argv in by_rule[rule]:
            assert _flag(argv, "--gpus") == str(GPUS[gpus_key]), (rule, argv)
            assert _flag(argv, "--mem") == str(mem), (rule, argv)
            assert _flag(argv, "-t") == str(minutes), (rule, argv)
            assert _flag(argv, "-p") == GPU_PARTITION, (rule, argv)
            assert _flag(argv, "-A") == fake_slurm.ACCOUNT, (rule, argv)
            assert _flag(argv, "--cpus-per-gpu") == "8", (rule, argv)
            assert _flag(argv, "--nodes") == "1", (rule, argv)
            # one task: vLLM and torchrun start their own GPU workers
            assert not _has(argv, "--ntasks-per-gpu") and not _has(argv, "--ntasks"), argv
            assert not _has(argv, "--gres"), (rule, argv)


def test_cpu_rules_ask_for_no_gpu(cluster_run):
    cluster, jobs, _ = cluster_run
    by_rule = _by_rule(cluster, jobs)
    for rule in CPU_RULES:
        for argv in by_rule[rule]:
            assert not _has(argv, "--gpus") and not _has(argv, "--gres"), (rule, argv)
            assert not _has(argv, "--cpus-per-gpu") and not _has(argv, "--ntasks-per-gpu")
            assert _flag(argv, "--mem") == "8000", (rule, argv)
            assert _flag(argv, "-t") == "60", (rule, argv)
            assert _flag(argv, "-p") == CPU_PARTITION, (rule, argv)
            assert _flag(argv, "-A") == fake_slurm.ACCOUNT, (rule, argv)
            assert _flag(argv, "--ntasks") == "1", (rule, argv)
            assert _flag(argv, "--cpus-per-task") == "1", (rule, argv)


def test_each_job_script_runs_its_own_job_of_this_workflow(cluster_run):
    cluster, jobs, _ = cluster_run
    for sub in _submissions(cluster):
        wrap = _flag(sub["argv"], "--wrap") or sub["stdin"]
        assert "--executor slurm-jobstep" in wrap, wrap
        args = shlex.split(wrap)
        target = args[args.index("--target-jobs") + 1]
        assert sub["comment"].startswith(f"rule_{target.split(':')[0]}"), (target, sub)
        assert str(cluster.overrides) in wrap and str(cluster.results) in wrap
        assert _flag(sub["argv"], "-D") == str(REPO)


def test_jobs_are_submitted_in_dependency_order(cluster_run):
    cluster, jobs, _ = cluster_run
    order = {}
    for index, sub in enumerate(_submissions(cluster)):
        order.setdefault(sub["comment"].split("_wildcards_")[0][len("rule_") :], []).append(index)
    first, last = ({r: min(i) for r, i in order.items()}, {r: max(i) for r, i in order.items()})
    assert (
        last["prepare_target"] < first["generate"] and last["prepare_prompts"] < first["generate"]
    )
    assert last["generate"] < min(first["extract"], first["vocab_map"])
    assert last["extract"] < first["hidden_manifest"] < first["train"] < first["evaluate"]
    assert first["evaluate"] < first["plots"]


def test_a_failed_slurm_job_fails_the_run(tmp_path):
    cluster = FakeCluster(tmp_path)
    jobs = cluster.plan()
    cluster.expect(jobs, states={"prepare_prompts": "FAILED"})
    # two independent jobs: one fails, the other still completes (keep-going); the failed
    # one is not submitted again (the profile's retries are for time limits and preemption,
    # tests/test_slurm.py)
    proc = cluster.run(
        targets=["prompts/train.jsonl", "target/target.json"], extra=("--retries", "0")
    )
    assert proc.returncode != 0
    assert re.search(r"SLURM-job '\d+' failed, SLURM status is: 'FAILED'", proc.stderr), (
        proc.stderr[-4000:]
    )
    assert not (cluster.results / "prompts" / "train.jsonl").exists()
    assert (cluster.results / "target" / "target.json").exists()
    # the plugin asked sacct why the job failed
    assert any(
        c["command"] == "sacct" and "--format=Reason" in c["argv"]
        for c in fake_slurm.calls(cluster.state)
    )


def _render(monkeypatch, **env) -> dict:
    for key in (
        "EAGLET_SLURM_PARTITION",
        "EAGLET_SLURM_GPU_PARTITION",
        "EAGLET_SLURM_ACCOUNT",
        "EAGLET_SLURM_GPU_MODEL",
    ):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with open(SLURM_PROFILE / "config.yaml") as handle:
        return dict(ProfileConfigFileParser().parse(handle))


def test_profile_takes_partition_account_and_gpu_model_from_the_environment(monkeypatch):
    bare = _render(monkeypatch)
    assert bare["executor"] == "slurm"
    assert "resources" not in bare  # no gpu cap on a cluster: every job has its own GPUs
    assert {"gpu=0", "mem_mb=8000", "runtime=60"} <= set(bare["default-resources"])
    assert not any(
        r.startswith(("slurm_partition", "slurm_account")) for r in bare["default-resources"]
    )
    assert "set-resources" not in bare

    one = _render(monkeypatch, EAGLET_SLURM_PARTITION="all", EAGLET_SLURM_ACCOUNT="12345")
    # repr(): Snakemake evaluates resource values, and `all` alone is a Python builtin
    assert {"slurm_partition='all'", "slurm_account='12345'"} <= set(one["default-resources"])
    assert "set-resources" not in one

    split = _render(
        monkeypatch,
        EAGLET_SLURM_PARTITION="cpu",
        EAGLET_SLURM_GPU_PARTITION="gpu",
        EAGLET_SLURM_GPU_MODEL="h100",
    )
    assert "slurm_partition='cpu'" in split["default-resources"]
    # scaling_train: the scaling stage's subset trainings (scaling.enabled; not in this DAG)
    assert MODEL_RULES == set(GPU_RULES) | {"extract_vllm", "extract_all", "scaling_train"}
    assert set(split["set-resources"]) == {
        f"{rule}:{key}"
        for rule in MODEL_RULES
        for key in ("slurm_partition='gpu'", "gpu_model='h100'")
    }


def test_lint_is_clean():
    """`snakemake --lint` has no complaint (fails until the rules carry the lint fixes)."""
    proc = subprocess.run(
        [str(SNAKEMAKE), "--lint"],
        cwd=REPO,
        text=True,
        capture_output=True,
        timeout=120,
        env=_clean_env(),
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
