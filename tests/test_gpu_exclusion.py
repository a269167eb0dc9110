"""The `gpu` resource keeps the inference server and the extraction off the same GPU.

(a) A miniature workflow (tests/workflows/gpu_exclusion) with a server job and extraction
    jobs, all ready at once and each holding `gpu=1`: under profiles/default's cap of one GPU
    they never overlap in time; with the cap raised to two they do.
(b) The real workflow's GPU rules take their `gpu` resource from the config (server.gpus,
    extract.gpus, train.gpus) and the CPU rules hold none, as a dry run shows.
"""

from __future__ import annotations

import itertools
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers.paths import REPO, SNAKEMAKE, TINY
from tests.workflows.dryrun import parse_dry_run

# each test runs Snakemake on a small workflow or the real one's dry run
pytestmark = pytest.mark.subprocess

MINI = REPO / "tests" / "workflows" / "gpu_exclusion" / "Snakefile"
DEFAULT_PROFILE = REPO / "profiles" / "default"
SLEEP_S = 1.5


def _env() -> dict[str, str]:
    env = os.environ.copy()
    env.pop("SNAKEMAKE_PROFILE", None)  # a user's global profile must not change the run
    return env


def run_mini(workdir: Path, *extra: str) -> dict[str, tuple[float, float]]:
    """Run the miniature workflow; every job's (start, end) by job name."""
    cmd = [
        str(SNAKEMAKE),
        "--snakefile",
        str(MINI),
        "--directory",
        str(workdir),
        "--cores",
        "2",
        "--workflow-profile",
        str(DEFAULT_PROFILE),
        *extra,
        "--config",
        f"sleep={SLEEP_S}",
        "shards=3",
    ]
    proc = subprocess.run(cmd, cwd=REPO, text=True, capture_output=True, timeout=120, env=_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    spans = {}
    for path in sorted(workdir.glob("*/*.txt")):
        name, start, end = path.read_text().split()
        spans[name] = (float(start), float(end))
    assert set(spans) == {"server", "extract_00000", "extract_00001", "extract_00002", "prepare"}, (
        spans
    )
    for start, end in spans.values():
        assert end - start >= SLEEP_S * 0.9
    return spans


def overlapping(spans: dict[str, tuple[float, float]], names) -> list[tuple[str, str]]:
    return [
        (a, b)
        for a, b in itertools.combinations(sorted(names), 2)
        if spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]
    ]


GPU_JOBS = ("server", "extract_00000", "extract_00001", "extract_00002")


def test_gpu_jobs_never_overlap_under_the_default_profile_cap(tmp_path):
    spans = run_mini(tmp_path)
    assert overlapping(spans, GPU_JOBS) == [], spans
    # the cap holds GPU jobs apart, not the whole workflow: the CPU job ran beside one
    assert any(pair for pair in overlapping(spans, (*GPU_JOBS, "prepare")) if "prepare" in pair), (
        spans
    )


def test_gpu_jobs_overlap_when_the_cap_is_raised(tmp_path):
    spans = run_mini(tmp_path, "--resources", "gpu=2")
    assert overlapping(spans, GPU_JOBS), spans


@pytest.fixture(scope="module")
def dry_run_jobs(tmp_path_factory):
    """Dry run of the real workflow on the tiny config with GPUs for server and extraction."""
    tmp = tmp_path_factory.mktemp("gpu_resources")
    overrides = tmp / "gpus.yaml"
    # `--config server.gpus=1` is no valid Snakemake config entry (and `server={gpus: 1}`
    # reads 1 as a string): nested overrides go in a config file.
    overrides.write_text("server: {gpus: 1}\nextract: {gpus: 1, backend: hf}\n")
    cmd = [
        str(SNAKEMAKE),
        "--dry-run",
        "--workflow-profile",
        str(DEFAULT_PROFILE),
        "--configfile",
        str(TINY),
        str(overrides),
        "--config",
        f"results_dir={tmp / 'results'}",
    ]
    proc = subprocess.run(cmd, cwd=REPO, text=True, capture_output=True, timeout=120, env=_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    jobs = parse_dry_run(proc.stdout + "\n" + proc.stderr)
    assert jobs, proc.stdout[-2000:] + proc.stderr[-2000:]
    return jobs


def _gpu(job) -> int:
    return int(job.resources.get("gpu", 0))


def test_real_workflow_gpu_rules_declare_their_gpus_from_config(dry_run_jobs):
    by_rule: dict[str, list] = {}
    for job in dry_run_jobs:
        by_rule.setdefault(job.rule, []).append(job)
    for rule in ("generate", "extract", "hidden_manifest", "evaluate"):
        assert rule in by_rule, sorted(by_rule)
        assert all(_gpu(job) == 1 for job in by_rule[rule]), (rule, by_rule[rule])
    # tiny.yaml: two training shards and the held-out one, one job each
    assert sorted(job.wildcards.get("split", "") for job in by_rule["extract"]) == ["", "", "eval/"]
    # train.gpus keeps its default (0); the CPU rules hold no GPU at all
    assert [_gpu(job) for job in by_rule["train"]] == [0]
    for rule in ("prepare_target", "prepare_prompts", "vocab_map", "plots"):
        assert rule in by_rule, sorted(by_rule)
        assert all(_gpu(job) == 0 for job in by_rule[rule]), (rule, by_rule[rule])


def test_model_jobs_get_every_core_of_a_local_run(dry_run_jobs):
    """Snakemake sets OMP_NUM_THREADS to a job's threads (1 unless the rule says more): the
    model jobs computed on one core of the profile's two. Jobs that run no model keep one."""
    threads = {job.rule: job.threads for job in dry_run_jobs if job.rule != "all"}
    for rule in ("generate", "extract", "hidden_manifest", "train", "evaluate"):
        assert threads[rule] == 2, threads  # profiles/default: cores 2
    for rule in ("prepare_target", "prepare_prompts", "vocab_map", "plots"):
        assert threads[rule] == 1, threads


def dry_run(tmp: Path, extract: str) -> list:
    tmp.mkdir(parents=True, exist_ok=True)
    overrides = tmp / "extract.yaml"
    overrides.write_text(f"extract: {{{extract}}}\n")
    cmd = [
        str(SNAKEMAKE),
        "--dry-run",
        "--workflow-profile",
        str(DEFAULT_PROFILE),
        "--configfile",
        str(TINY),
        str(overrides),
        "--config",
        f"results_dir={tmp / 'results'}",
    ]
    proc = subprocess.run(cmd, cwd=REPO, text=True, capture_output=True, timeout=120, env=_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return parse_dry_run(proc.stdout + "\n" + proc.stderr)


def test_one_extraction_job_writes_every_shard(tmp_path):
    """extract.jobs: one: a single job (one target load) holding extract.gpus writes the very
    files the per-shard jobs write, and everything downstream reads the same files."""
    per_shard = dry_run(tmp_path / "per_shard", "gpus: 1, backend: hf")
    one = dry_run(tmp_path / "one", "gpus: 1, backend: hf, jobs: one")
    shard_jobs = [j for j in per_shard if j.rule == "extract"]
    all_jobs = [j for j in one if j.rule == "extract_all"]
    assert len(shard_jobs) == 3 and not [j for j in one if j.rule == "extract"]
    assert len(all_jobs) == 1 and _gpu(all_jobs[0]) == 1 and all_jobs[0].threads == 2
    # relative to each results dir: the same shard files, and nothing else
    outputs = {str(Path(f).relative_to(tmp_path / "one" / "results")) for f in all_jobs[0].output}
    assert outputs == {
        str(Path(f).relative_to(tmp_path / "per_shard" / "results"))
        for j in shard_jobs
        for f in j.output
    }
    assert outputs == {
        f"hidden/{split}shard_{i}.{ext}"
        for split, i in (("", "00000"), ("", "00001"), ("eval/", "00000"))
        for ext in ("safetensors", "json")
    }

    def downstream(jobs, root):
        return {
            j.rule: sorted(
                str(Path(f).relative_to(root)) if f.startswith(str(root)) else f for f in j.input
            )
            for j in jobs
            if j.rule not in ("extract", "extract_all")
        }

    assert downstream(one, tmp_path / "one" / "results") == downstream(
        per_shard, tmp_path / "per_shard" / "results"
    )
