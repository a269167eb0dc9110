"""What a rerun redoes: Snakemake's own plan (a dry run) over a results tree that looks
finished, after a user edits an input or a stage sets a damaged file aside."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helpers.paths import REPO, SNAKEMAKE, TINY
from tests.workflows.dryrun import parse_dry_run

# each test runs Snakemake
pytestmark = pytest.mark.subprocess


def snakemake(results: Path, configfile: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            str(SNAKEMAKE),
            *args,
            "--cores",
            "1",
            "--configfile",
            str(TINY),
            str(configfile),
            "--config",
            f"results_dir={results}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def planned(results: Path, configfile: Path) -> dict[str, list[dict]]:
    """Rule -> wildcards of each job the dry run plans."""
    run = snakemake(results, configfile, "-n")
    assert run.returncode == 0, run.stdout + run.stderr
    jobs: dict[str, list[dict]] = {}
    for job in parse_dry_run(run.stdout):
        jobs.setdefault(job.rule, []).append(job.wildcards)
    return jobs


def finished_tree(tmp_path: Path, config: dict) -> tuple[Path, Path]:
    """A results dir holding every output of the workflow, up to date by modification
    time (contents are placeholders: a dry run reads none)."""
    configfile = tmp_path / "config.yaml"
    configfile.write_text(yaml.safe_dump(config))
    results = tmp_path / "results"
    run = snakemake(results, configfile, "-n")
    assert run.returncode == 0, run.stdout + run.stderr
    for job in parse_dry_run(run.stdout):
        for output in job.output:
            Path(output).parent.mkdir(parents=True, exist_ok=True)
            Path(output).touch()
    touched = snakemake(results, configfile, "--touch")
    assert touched.returncode == 0, touched.stdout + touched.stderr
    assert planned(results, configfile) == {}
    return results, configfile


def later(path: Path) -> None:
    """Give ``path`` a modification time after everything the tree holds."""
    stamp = max(p.stat().st_mtime for p in path.parent.rglob("*")) + 60
    os.utime(path, (stamp, stamp))


def test_an_edited_prompt_file_reruns_prepare_prompts_and_what_follows(tmp_path):
    prompts = tmp_path / "my_prompts.jsonl"
    prompts.write_text('{"text": "Say hello."}\n{"text": "Name a colour."}\n')
    source = {"type": "file", "path": str(prompts), "text_field": "text"}
    results, configfile = finished_tree(tmp_path, {"data": {"sources": [source]}})
    prompts.write_text(prompts.read_text() + '{"text": "Count to three."}\n')
    later(prompts)
    jobs = planned(results, configfile)
    assert {"prepare_prompts", "generate", "train", "evaluate"} <= set(jobs), jobs


def test_a_shard_that_training_set_aside_is_extracted_again(tmp_path):
    """The hf backend: one job per shard, and only the damaged one runs again."""
    results, configfile = finished_tree(tmp_path, {"extract": {"backend": "hf"}})
    for shard, wildcards in [
        ("hidden/shard_00001.safetensors", {"split": "", "i": "00001"}),
        ("hidden/eval/shard_00000.safetensors", {"split": "eval/", "i": "00000"}),
    ]:
        path = results / shard
        path.rename(path.with_name(path.name + ".damaged"))  # what training does with it
        after_train = [*(results / "drafter").iterdir(), *(results / "eval").iterdir()]
        for output in after_train:  # training failed: its outputs removed, nothing after it ran
            output.unlink()
        jobs = planned(results, configfile)
        assert jobs.get("extract") == [wildcards], jobs  # only that shard
        assert {"hidden_manifest", "train", "evaluate"} <= set(jobs), jobs
        for output in [path, *after_train]:
            output.touch()
        assert snakemake(results, configfile, "--touch").returncode == 0


def test_a_shard_set_aside_brings_back_the_one_vllm_extraction_job(tmp_path):
    """The vllm backend writes every shard from one job (one server): a damaged shard plans
    that job again, and what follows it."""
    results, configfile = finished_tree(tmp_path, {"extract": {"backend": "vllm"}})
    path = results / "hidden" / "shard_00001.safetensors"
    path.rename(path.with_name(path.name + ".damaged"))
    for output in [*(results / "drafter").iterdir(), *(results / "eval").iterdir()]:
        output.unlink()
    jobs = planned(results, configfile)
    assert jobs.get("extract_vllm") == [{}], jobs
    assert "extract" not in jobs and "generate" not in jobs, jobs
    assert {"hidden_manifest", "train", "evaluate"} <= set(jobs), jobs
