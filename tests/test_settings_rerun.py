"""A run's settings live with its results (results/run/settings/<stage>.json), so a changed
setting reruns what it affects from any checkout: Snakemake's own records of params stay in
the workflow directory's .snakemake/, which a fresh clone pointed at existing results, or a
copied results directory, does not have (it then said "Nothing to be done" and the drafter
kept a vocabulary of 2048 where the config said 1024)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from eaglet.core.config import differences, record_settings
from tests.helpers.paths import REPO, SNAKEMAKE, TINY


def dry_run(
    workdir: Path, config: Path, *targets: str, preview: bool = True
) -> subprocess.CompletedProcess:
    """snakemake from another checkout (``workdir``: its own .snakemake/); a dry run, or with
    ``preview`` False a real run of ``targets`` (up to date ones: nothing runs, but the run's
    settings are recorded, as any real run records them)."""
    workdir.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [
            str(SNAKEMAKE),
            *targets,
            "-s",
            str(REPO / "Snakefile"),
            "--directory",
            str(workdir),
            *(["-n"] if preview else []),
            "--cores",
            "1",
            "--configfile",
            str(config),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


def jobs(done: subprocess.CompletedProcess) -> set[str]:
    """The jobs a dry run would run (its table of job counts)."""
    assert done.returncode == 0, done.stderr[-2000:]
    text = done.stdout + done.stderr
    if "Nothing to be done" in text:
        return set()
    table = text.split("Job stats:", 1)[1].split("total", 1)[0]
    return {m.group(1) for m in re.finditer(r"^(\w+)\s+\d+\s*$", table, re.M)} - {"job"}


def write_outputs(done: subprocess.CompletedProcess) -> None:
    """Every output the dry run lists, made in the order of its jobs, each a moment newer
    than the last: a finished run's results, all newer than the workflow's code (Snakemake
    reruns a script's outputs older than the script: a fresh clone's files are minutes old)
    and older than now (a settings file rewritten now must be newer than them)."""
    text = done.stdout + done.stderr
    paths = [
        path
        for line in map(str.strip, text.splitlines())
        if line.startswith("output: ")
        for path in line[len("output: ") :].split(", ")
    ]
    code = [
        REPO / "Snakefile",
        *REPO.glob("rules/*"),
        *REPO.glob("scripts/*"),
        *REPO.glob("envs/*"),
    ]
    now = time.time()
    start = max(now - 1000, max(p.stat().st_mtime for p in code) + 1)
    step = (now - 1 - start) / (len(paths) + 1)
    assert step > 0, "the workflow's code was changed less than a second ago"
    for i, path in enumerate(paths, 1):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text("made\n")
        os.utime(path, (start + i * step,) * 2)


def config_file(tmp_path: Path, name: str, **changes) -> Path:
    config = yaml.safe_load(TINY.read_text())
    config["results_dir"] = str(tmp_path / "results")
    config.setdefault("evaluate", {})["prompt_sets"] = []
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        config.setdefault(section, {})[key] = value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.subprocess
def test_a_changed_setting_reruns_what_it_affects_from_another_checkout(tmp_path):
    first = tmp_path / "checkout-1"
    plan = dry_run(first, config_file(tmp_path, "a"))
    # the vocabulary's coverage stop comes before extraction, whatever order Snakemake picks:
    # the map is one of extraction's inputs
    extract = (plan.stdout + plan.stderr).split("rule extract_vllm:", 1)[1].split("output:")[0]
    assert "vocab/vocab_map.safetensors" in extract
    write_outputs(plan)
    # another checkout (no .snakemake records) on the same results, the same settings: nothing
    assert jobs(dry_run(tmp_path / "checkout-2", config_file(tmp_path, "a"))) == set()
    # the draft vocabulary changed: a dry run says so and records nothing (a dry run with
    # another config, as `eaglet status --configfile` runs, must not make the next run
    # rerun); the next real run records it and reruns the map and all after it, not
    # generation or extraction
    smaller = config_file(tmp_path, "b", vocab__draft_vocab_size=1024)
    said = dry_run(tmp_path / "checkout-3", smaller)
    assert (
        "vocab_map: settings changed since its outputs were made "
        "(draft_vocab_size: 2048 -> 1024)" in said.stdout + said.stderr
    )
    settings = tmp_path / "results" / "run" / "settings"
    assert json.loads((settings / "vocab_map.json").read_text())["draft_vocab_size"] == 2048
    prompts = str(tmp_path / "results" / "prompts" / "train.jsonl")
    recorded = dry_run(tmp_path / "checkout-3", smaller, prompts, preview=False)
    assert recorded.returncode == 0, recorded.stderr[-2000:]
    assert "Nothing to be done" in recorded.stdout + recorded.stderr  # it ran no job
    rerun = dry_run(tmp_path / "checkout-3", smaller)
    assert jobs(rerun) >= {"vocab_map", "train", "evaluate"}, rerun.stdout[-3000:]
    assert not jobs(rerun) & {"generate", "extract_vllm", "prepare_prompts"}
    # generation's answers changed: generation and every stage after it
    longer = config_file(tmp_path, "c", vocab__draft_vocab_size=1024, generate__max_tokens=32)
    dry_run(tmp_path / "checkout-4", longer, prompts, preview=False)
    assert {"generate", "vocab_map", "extract_vllm", "train", "evaluate"} <= jobs(
        dry_run(tmp_path / "checkout-4", longer)
    )
    assert json.loads((settings / "generate.json").read_text())["generate"]["max_tokens"] == 32


@pytest.mark.subprocess
def test_status_with_another_config_shows_what_its_settings_rerun(tmp_path):
    """`eaglet status --configfile other.yaml` on a finished run: its dry run records no
    settings, so Snakemake's plan alone showed nothing to rerun and status said the run was
    complete. The stages whose settings changed, and every stage after them, are outdated,
    with what changed."""
    from eaglet.core.config import load
    from eaglet.tools.status.gather import _outdated

    write_outputs(dry_run(tmp_path / "checkout-1", config_file(tmp_path, "a")))
    other = config_file(tmp_path, "b", vocab__draft_vocab_size=1024)
    rules, changed = _outdated(REPO, ["--configfile", str(other)], load(str(other)))
    assert {"vocab_map", "train", "evaluate"} <= rules, rules
    assert not rules & {"generate", "extract_vllm", "prepare_prompts"}
    assert changed == {"vocab_map": "draft_vocab_size: 2048 -> 1024"}


def test_a_command_that_runs_no_job_records_no_settings():
    from eaglet.core.config import previews_only

    for argv in (
        ["snakemake", "-n"],
        ["snakemake", "-np", "--cores", "2"],
        ["snakemake", "--dry-run"],
        ["snakemake", "--lint"],
        ["snakemake", "--report", "r.html"],
        ["snakemake", "--summary"],
    ):
        assert previews_only(argv), argv
    for argv in (
        ["snakemake", "--cores", "2"],
        ["snakemake", "-p", "--cores", "2"],
        ["snakemake", "--touch"],
        ["snakemake", "-c", "2", "results/x"],
    ):
        assert not previews_only(argv), argv


def test_settings_are_recorded_dated_at_the_epoch_the_first_time_and_their_changes_said(tmp_path):
    """Results made before the settings were recorded are taken as made with them (not all
    rebuilt on the first run after an upgrade); a change dates the file now, and is said."""
    path = tmp_path / "settings" / "train.json"
    assert record_settings(path, {"train": {"lr": 1e-3, "epochs": 2}}) == []
    assert path.stat().st_mtime == 0
    assert record_settings(path, {"train": {"lr": 1e-3, "epochs": 2}}) == []
    assert path.stat().st_mtime == 0  # unchanged: not rewritten
    assert record_settings(path, {"train": {"lr": 2e-3, "epochs": 2}}) == [
        "train.lr: 0.001 -> 0.002"
    ]
    assert path.stat().st_mtime > 1e9
    assert differences({"a": {"b": [1, 2]}}, {"a": {"b": [1, 2], "c": None}}) == []
    assert differences({"a": 1}, {"a": 1, "x": 2}) == ["x: None -> 2"]


def test_a_settings_file_that_recorded_run_only_settings_is_read_without_them(tmp_path):
    """A file written when generate.concurrency was among the recorded settings (it never
    changed a sample: core.config.RUN_ONLY) is not rewritten for lack of it, or the stage
    and all after it would rerun."""
    path = tmp_path / "generate.json"
    path.write_text(json.dumps({"generate": {"concurrency": 64, "max_tokens": 32}}))
    before = path.stat().st_mtime_ns
    assert record_settings(path, {"generate": {"max_tokens": 32}}) == []
    assert path.stat().st_mtime_ns == before
    changed = record_settings(path, {"generate": {"max_tokens": 64}})
    assert changed and "max_tokens" in changed[0]


def test_a_settings_file_that_cannot_be_read_reruns_its_stage_and_a_preview_leaves_it(tmp_path):
    """A damaged settings file says nothing of how the outputs were made: taken as missing
    (dated at the epoch), a changed config then reran nothing, and a dry run or `eaglet
    status` rewrote it."""
    path = tmp_path / "settings" / "vocab_map.json"
    path.parent.mkdir()
    path.write_text('{"draft_vocab_size": 20')  # torn
    said = record_settings(path, {"draft_vocab_size": 1024}, write=False)
    assert said == [
        "vocab_map.json could not be read (JSONDecodeError): the next run makes the stage again"
    ]
    assert path.read_text() == '{"draft_vocab_size": 20'  # a preview leaves it
    said = record_settings(path, {"draft_vocab_size": 1024})
    assert said == ["vocab_map.json could not be read (JSONDecodeError): the stage runs again"]
    assert json.loads(path.read_text()) == {"draft_vocab_size": 1024}
    assert path.stat().st_mtime > 1e9  # dated now: newer than the outputs, which rerun


def starting_drafter(directory: Path, weights: bytes) -> Path:
    """A drafter directory in eaglet's export layout for the tiny config's target (30 layers,
    vocabulary 49152), its weights file holding ``weights``: all a Snakefile parse reads of
    train.init_from."""
    import numpy as np
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": 576,
        "vocab_size": 49152,
        "draft_vocab_size": 2048,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]},
    }
    (directory / "config.json").write_text(json.dumps(config))
    save_file(
        {"fc.weight": np.frombuffer(weights, dtype=np.uint8).copy()},
        directory / "model.safetensors",
    )
    return directory


@pytest.mark.subprocess
def test_another_drafter_put_where_init_from_points_reruns_the_start_and_training(tmp_path):
    """train.init_from names a directory (or hub id) whose files are not the start's inputs:
    another drafter put there left "Nothing to be done", and the run shipped a fine-tune of the
    old one. The files' fingerprint is a setting of the start (run/settings/
    start_drafter_files.json): the same files, copied anew, rerun nothing."""
    drafter = starting_drafter(tmp_path / "published", b"first drafter" * 100)
    config = config_file(tmp_path, "a", train__init_from=str(drafter))
    plan = dry_run(tmp_path / "checkout-1", config)
    assert "start_drafter" in jobs(plan)
    write_outputs(plan)
    assert jobs(dry_run(tmp_path / "checkout-2", config)) == set()
    # the same drafter copied over itself (new times, same bytes): nothing to do
    again = starting_drafter(tmp_path / "copy", b"first drafter" * 100)
    for name in ("config.json", "model.safetensors"):
        os.replace(again / name, drafter / name)
    assert jobs(dry_run(tmp_path / "checkout-3", config)) == set()
    # another drafter under the same name: the start and everything after it
    starting_drafter(drafter, b"other drafter" * 100)
    prompts = str(tmp_path / "results" / "prompts" / "train.jsonl")
    said = dry_run(tmp_path / "checkout-4", config, prompts, preview=False)
    assert "start_drafter_files: settings changed" in said.stdout + said.stderr
    rerun = jobs(dry_run(tmp_path / "checkout-4", config))
    assert {"start_drafter", "train", "evaluate"} <= rerun, rerun
    assert not rerun & {"generate", "prepare_prompts"}
