"""`eaglet status` estimates and the Snakemake view it asks for (``eaglet.tools.status``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from datetime import UTC
from pathlib import Path

import pytest
import yaml

from eaglet.core import rates
from eaglet.core.layout import BENCHMARK_RESULTS
from eaglet.core.progress import Progress, took
from eaglet.stages.evaluate.schedule import sweep_runs, work_plan
from eaglet.tools import status
from eaglet.tools.status.estimates import _bench_generate, _server_start, _token_totals, _train_rate
from eaglet.tools.status.stages import _BY_NAME
from tests.helpers.paths import EAGLET, REPO, SNAKEMAKE, SRC, TINY, pythonpath_env


@pytest.fixture
def history(tmp_path, monkeypatch):
    path = tmp_path / "rates.jsonl"
    monkeypatch.setenv("EAGLET_RATES", str(path))
    return path


def test_train_rate_is_scaled_to_this_runs_ttt_steps(history):
    rates.record("train", "embedded:m", tokens_per_s=600.0, ttt_steps=3)
    same, basis_same = _train_rate("embedded:m", 3)
    more, basis_more = _train_rate("embedded:m", 6)
    assert same == pytest.approx(600.0) and basis_same == "an earlier run"
    assert more == pytest.approx(300.0) and "scaled to 6" in basis_more


def test_rate_lookup_prefers_the_same_target(history):
    rates.record("train", "embedded:a", tokens_per_s=100.0, ttt_steps=3)
    rates.record("train", "embedded:b", tokens_per_s=900.0, ttt_steps=3)
    assert rates.lookup("train", "tokens_per_s", "embedded:a") == pytest.approx(100.0)
    assert rates.lookup_entry("train", "tokens_per_s", "embedded:b")["ttt_steps"] == 3
    # another target's rate is no rate for this one (a miniature's, rehearsed before the run)
    assert rates.lookup("train", "tokens_per_s", "nothing-recorded") is None
    assert _train_rate("nothing-recorded", 3) == (None, "no rate measured yet")


def test_a_rate_measured_at_other_settings_plans_nothing(history, tmp_path):
    """A tiny test run generated at concurrency 4 (19 tok/s) after a demo at 32 (155 tok/s):
    the next demo's status planned generation at 19 tok/s (12 minutes, truly 2) and then read
    its machine as 8 times faster than planned. A rate is read at the settings it was
    measured at; one that does not say counts only where none measured at them."""
    r = tmp_path / "results"
    _prompts(r, 30, 10)
    cfg = _full_config(r)
    target = cfg["target"]["model"]
    demo = {**cfg["generate"], "concurrency": 32}
    tiny = {**cfg["generate"], "concurrency": 4}
    history.write_text(
        json.dumps(
            {
                "stage": "generate",
                "target": target,
                "device": rates.device_kind(),
                "completion_tokens_per_s": 120.0,
            }
        )
        + "\n"
    )
    assert status.Generate().expected_rate({**cfg, "generate": demo}) == (120.0, "an earlier run")
    rates.record(
        "generate",
        target,
        settings=rates.generate_settings({"generate": demo}),
        completion_tokens_per_s=155.0,
    )
    rates.record(
        "generate",
        target,
        settings=rates.generate_settings({"generate": tiny}),
        completion_tokens_per_s=19.0,
    )
    assert status.Generate().expected_rate({**cfg, "generate": demo})[0] == pytest.approx(155.0)
    assert status.Generate().expected_rate({**cfg, "generate": tiny})[0] == pytest.approx(19.0)
    # at settings nothing was measured at: the entry that does not say, never another's
    other = {**cfg["generate"], "concurrency": 8}
    assert status.Generate().expected_rate({**cfg, "generate": other})[0] == pytest.approx(120.0)
    history.write_text(
        "\n".join(line for line in history.read_text().splitlines() if "settings" in line) + "\n"
    )
    rate, basis = status.Generate().expected_rate({**cfg, "generate": other})
    assert basis == "benchmarks/results" or rate is None


def test_a_rate_of_no_work_is_not_recorded_and_an_old_one_is_ignored(history):
    """A training resumed at its last step measured 0 tokens/s: recorded, every later
    training estimate divided by it (ZeroDivisionError in every status)."""
    rates.record("train", "embedded:m", tokens_per_s=0.0, ttt_steps=3)
    recorded = [json.loads(line) for line in history.read_text().splitlines()]
    assert recorded and not any("tokens_per_s" in entry for entry in recorded)
    history.write_text(
        json.dumps(
            {
                "stage": "train",
                "target": "embedded:m",
                "device": rates.device_kind(),
                "tokens_per_s": 0.0,
                "ttt_steps": 3,
            }
        )
        + "\n"
    )
    assert _train_rate("embedded:m", 3) == (None, "no rate measured yet")
    rates.record("train", "embedded:m", tokens_per_s=300.0, ttt_steps=3)
    history.write_text(
        history.read_text()
        + json.dumps(
            {
                "stage": "train",
                "target": "embedded:m",
                "device": rates.device_kind(),
                "tokens_per_s": -1,
                "ttt_steps": 3,
            }
        )
        + "\n"
    )
    assert rates.lookup("train", "tokens_per_s", "embedded:m") == pytest.approx(300.0)


def test_no_history_no_train_rate(history):
    assert _train_rate("embedded:m", 3) == (None, "no rate measured yet")


def test_without_history_training_is_estimated_from_the_benchmark_of_the_targets_shape(history):
    """A fresh clone has no earlier run: the training benchmark's row for the embedded
    target's shape, the one nearest the run's sample length, scaled to its TTT steps."""
    rows = [
        r
        for r in json.loads((BENCHMARK_RESULTS / "train.json").read_text()).values()
        if r["shape"] == "smollm2-135m"
    ]
    assert len({r["sample_len"] for r in rows}) >= 2
    for max_len in (256, 2048):
        nearest = min(rows, key=lambda r: abs(r["sample_len"] - max_len))
        rate, basis = _train_rate("embedded:smollm2-135m-instruct", 3, max_len)
        assert rate == pytest.approx(nearest["tokens_per_s"] * nearest["ttt_steps"] / 3)
        assert basis.startswith(f"benchmarks/results, {nearest['sample_len']}-token samples")


def test_dry_run_uses_the_config_the_run_recorded(tmp_path):
    results = tmp_path / "results-large"
    assert status.snakemake_config_args(results, None) == ["--config", f"results_dir={results}"]
    (results / "run").mkdir(parents=True)
    (results / "run" / "config.json").write_text(json.dumps({"results_dir": str(results)}))
    args = status.snakemake_config_args(results, None)
    assert args[:2] == ["--configfile", str((results / "run" / "config.json").resolve())]
    # a config given on the command line wins over the record
    assert status.snakemake_config_args(results, "my.yaml")[:2] == ["--configfile", "my.yaml"]


def test_a_finished_stage_took_from_its_first_start_to_its_last_end(tmp_path):
    """Extract's shards run as separate, overlapping jobs: the stage took the whole span."""
    r = tmp_path / "results"
    (r / "progress").mkdir(parents=True)
    (r / "hidden").mkdir()
    (r / "hidden" / "manifest.json").write_text(json.dumps({"num_shards": 2}))
    for name, start, end in (
        ("extract_00000", "10:00:00", "10:02:00"),
        ("extract_00001", "10:00:30", "10:03:10"),
    ):
        (r / "progress" / f"{name}.json").write_text(
            json.dumps(
                {
                    "stage": name,
                    "state": "finished",
                    "started_at": f"2026-01-01T{start}+00:00",
                    "updated_at": f"2026-01-01T{end}+00:00",
                }
            )
        )
    cfg = {"extract": {"gpus": 0}}
    stage = next(s for s in status.STAGES if s.name == "extract")
    assert status.stage_status(stage, r, cfg, set())["took_s"] == pytest.approx(190.0)
    assert "[3m10s]" in status.render(status.collect(r, _full_config(r), None))
    # a shard still running: the stage has not finished, so no duration
    assert (
        took(
            [
                {
                    "state": "running",
                    "started_at": "2026-01-01T10:00:00+00:00",
                    "updated_at": "2026-01-01T10:01:00+00:00",
                }
            ]
        )
        is None
    )


def _full_config(r):
    from eaglet.core.config import validate

    return validate({"results_dir": str(r)})


def test_a_fine_tunes_start_is_a_stage_of_its_run_only(tmp_path):
    """train.init_from adds rule start_drafter before the prompts: status lists it (its
    estimate, then what the conversion recorded), in the order line too; a run from scratch
    has no such stage."""
    r = tmp_path / "results"
    cfg = _full_config(r)
    assert "start_drafter" not in [s["stage"] for s in status.collect(r, cfg, None)["stages"]]
    cfg["train"]["init_from"] = str(tmp_path / "published")
    shown = status.collect(r, cfg, None)
    names = [s["stage"] for s in shown["stages"]]
    assert names[:3] == ["prepare_target", "start_drafter", "prepare_prompts"]
    start = shown["stages"][1]
    assert start["state"] == "pending" and "hub id" in start["estimate_basis"]
    (r / "start_drafter").mkdir(parents=True)
    (r / "start_drafter" / "model.safetensors").write_bytes(b"")
    record = {
        "source": str(tmp_path / "published"),
        "format": "speculators",
        "method": "eagle3",
        "from_drafter": ["fc.weight", "midlayer.mlp.up_proj.weight"],
        "new": ["norm.weight"],
    }
    (r / "start_drafter" / "start.json").write_text(json.dumps(record))
    text = status.render(status.collect(r, cfg, None))
    assert "(speculators, eagle3): 2 tensors from it, 1 new" in text
    assert "Order: prepare_target -> start_drafter -> prepare_prompts" in text


def test_a_stage_starting_its_server_says_so_until_the_work_starts(tmp_path):
    """A large model's server loads for many minutes with nothing counted: status must say
    what the stage is doing, and the phase must end once the counted work starts."""
    r = tmp_path / "results"
    progress = Progress("generate", total=10, path=r / "progress" / "generate.json")
    progress.enter_phase("starting the vLLM server")
    stage = next(s for s in status.STAGES if s.name == "generate")
    cfg = _full_config(r)
    shown = status.stage_status(stage, r, cfg, set())
    assert shown["state"] == "running" and shown["progress"][0]["pid"] == os.getpid()
    assert "running (starting the vLLM server): 0/10" in status.render(status.collect(r, cfg, None))
    progress.enter_phase(None)
    progress.advance(done=3)
    progress.report()
    assert "running: 3/10" in status.render(status.collect(r, cfg, None))
    assert progress.report("finished")["phase"] is None


def test_a_running_stage_shows_the_plan_of_work_it_wrote(tmp_path):
    """A stage states its estimate of work in its progress file when it starts (units, their kind,
    tokens, servers): status shows it under the stage's line, and --json carries it whole."""
    r = tmp_path / "results"
    plan = {"kind": "prefill", "servers": 1, "shards": 2, "samples": 31, "tokens": 52311}
    progress = Progress(
        "extract", total=31, path=r / "progress" / "extract_vllm.json", plan=plan, unit="samples"
    )
    progress.advance(done=4)
    progress.report()
    shown = status.collect(r, _full_config(r), None)
    extract = next(s for s in shown["stages"] if s["stage"] == "extract")
    assert extract["progress"][0]["plan"] == plan
    text = status.render(shown)
    assert "work: prefill, servers 1, shards 2, samples 31, tokens 52311" in text


# -- stopped stages, missing results, resumable training, quoting -----------------------------


def _stage(name):
    return next(s for s in status.STAGES if s.name == name)


def _dead_progress(r, name, **fields):
    """A progress file as a stage leaves it when its process is gone."""
    (r / "progress").mkdir(parents=True, exist_ok=True)
    record = {
        "stage": name,
        "state": "running",
        "unit": "samples",
        "done": 3,
        "failed": 0,
        "total": 10,
        "pid": 2**22 + 7,
        "host": None,
        "rate_per_s": None,
        "eta_s": None,
        "started_at": "2026-01-01T10:00:00+00:00",
        "updated_at": "2026-01-01T10:01:00+00:00",
        **fields,
    }
    (r / "progress" / f"{name}.json").write_text(json.dumps(record))


def _log(path, *lines):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"2026-01-01 10:00:0{i} {line}\n" for i, line in enumerate(lines)))


def test_a_generate_whose_server_died_shows_failed_with_the_reason(tmp_path):
    r = tmp_path / "results"
    _dead_progress(r, "generate")
    _log(
        r / "logs" / "generate.log",
        "INFO eaglet.core.progress: generate: 3/10 samples done, 0 failed, 0.50/s, 20 tok/s, ETA 14s",
        "ERROR eaglet.stages.generate: generate failed: the vLLM server died (exit code -9).",
        "--- last lines of results/logs/generate.server.log ---",
        "Killed",
    )
    shown = status.stage_status(_stage("generate"), r, _full_config(r), set())
    assert shown["state"] == "failed"
    assert shown["error"] == "the vLLM server died (exit code -9)."
    assert "FAILED: the vLLM server died" in status.render(status.collect(r, _full_config(r), None))


@pytest.mark.subprocess
def test_a_refused_rerun_is_not_the_stages_failure_once_its_holder_is_gone(tmp_path):
    """A rerun refused beside a live train (its checkpoints held) logs "train failed: ... held
    by another train process, pid N ... still running". Once that process has ended, the
    refusal says nothing of the stage: status shows what the stage itself did, not a live
    holder that is gone; while the holder lives, the refusal stands."""
    import socket
    import subprocess

    r = tmp_path / "results"
    (r / "drafter").mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "training_log.csv"):
        (r / "drafter" / name).write_text("{}")
    ended = subprocess.Popen(["true"])
    ended.wait()
    refusal = (
        f"ERROR eaglet.stages.train: train failed: train: results/drafter_checkpoints is "
        f"held by another train process, pid {{pid}} on host {socket.gethostname()} "
        f"(since 2026-01-01T10:00:00+00:00), still running: two would write the same "
        f"files. Stop it first (kill {{pid}} on {socket.gethostname()}), or wait for it, "
        f"then rerun."
    )
    _log(
        r / "logs" / "train.log",
        refusal.format(pid=ended.pid),
        "INFO eaglet.stages.train.loop: exported the drafter",
    )
    assert status.stage_status(_stage("train"), r, _full_config(r), set())["state"] == "completed"
    _log(r / "logs" / "train.log", refusal.format(pid=os.getpid()))  # the holder still runs
    shown = status.stage_status(_stage("train"), r, _full_config(r), set())
    assert shown["state"] == "failed" and "held by another train process" in shown["error"]


def test_a_killed_stage_without_a_failure_is_interrupted(tmp_path):
    r = tmp_path / "results"
    _dead_progress(r, "generate")
    _log(
        r / "logs" / "generate.log",
        "ERROR eaglet.stages.generate: generate interrupted (KeyboardInterrupt); finished work is kept, "
        "rerun to resume",
    )
    assert (
        status.stage_status(_stage("generate"), r, _full_config(r), set())["state"] == "interrupted"
    )


def test_a_failed_extract_is_failed_not_outdated_with_old_facts(tmp_path):
    r = tmp_path / "results"
    (r / "hidden").mkdir(parents=True)
    (r / "hidden" / "manifest.json").write_text(json.dumps({"num_shards": 2, "samples": 9}))
    os.utime(r / "hidden" / "manifest.json", (1_000_000, 1_000_000))  # from an earlier run
    _log(
        r / "logs" / "extract" / "shard_00001.log",
        "ERROR eaglet.stages.extract.hf: extract failed: teacher agreement 41.00% in shard_00001 is low",
    )
    shown = status.stage_status(_stage("extract"), r, _full_config(r), {"extract"})
    assert shown["state"] == "failed" and "teacher agreement 41.00%" in shown["error"]
    assert "facts" not in shown
    # an older failure than the outputs: the stage was made again after it
    os.utime(r / "logs" / "extract" / "shard_00001.log", (999_000, 999_000))
    assert status.stage_status(_stage("extract"), r, _full_config(r), set())["state"] == "completed"


def _answered(tmp_path):
    """A results dir whose generation finished: 10 samples of 1,000 tokens a split."""
    r = tmp_path / "results"
    (r / "synthetic").mkdir(parents=True)
    (r / "synthetic" / "stats.json").write_text(
        json.dumps(
            {
                "splits": {
                    split: {"samples": 10, "prompt_tokens": 400, "completion_tokens": 600}
                    for split in ("train", "eval")
                }
            }
        )
    )
    return r


def test_the_training_estimate_after_a_kill_counts_only_the_steps_left(tmp_path, history):
    r = _answered(tmp_path)
    cfg = _full_config(r)
    rates.record(
        "train", cfg["target"]["model"], tokens_per_s=100.0, ttt_steps=cfg["train"]["ttt_steps"]
    )
    whole = status.estimate("train", r, cfg, None).seconds
    checkpoint = r / "drafter_checkpoints" / "step_00000030"
    checkpoint.mkdir(parents=True)
    (checkpoint / "state.json").write_text(json.dumps({"step": 30, "total_steps": 40}))
    resumed = status.estimate("train", r, cfg, None)
    assert resumed.seconds == pytest.approx(whole / 4)
    assert "resuming from the checkpoint at step 30/40" in resumed.basis


def test_a_killed_training_reads_its_newest_checkpoint_not_its_older_progress(tmp_path, history):
    """Killed after a checkpoint and before its next progress report: status read
    "INTERRUPTED 1/12 steps" beside "resuming from the checkpoint at step 4/12"."""
    r = _answered(tmp_path)
    cfg = _full_config(r)
    _dead_progress(r, "train", unit="steps", done=1, total=12)
    checkpoint = r / "drafter_checkpoints" / "step_00000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / "state.json").write_text(json.dumps({"step": 4, "total_steps": 12}))
    text = status.render(status.collect(r, cfg, None))
    line = next(line for line in text.splitlines() if "> train" in line)
    assert "INTERRUPTED" in line and ": 4/12 steps" in line
    assert "resuming from the checkpoint at step 4/12" in text


def test_status_of_a_results_dir_that_does_not_exist_is_an_error(tmp_path, capsys):
    assert (
        status.main(
            [
                "--results",
                str(tmp_path / "does-not-exist"),
                "--no-snakemake",
                "--workflow",
                str(tmp_path),
            ]
        )
        == 2
    )
    assert "does-not-exist is not a results directory" in capsys.readouterr().err


def test_the_printed_hint_quotes_a_results_dir_with_spaces(tmp_path):
    import shlex

    r = tmp_path / "my results"
    text = status.render(status.collect(r, _full_config(r), None))
    hint = text.split("Follow it: ", 1)[1].split("   or")[0]
    assert shlex.split(hint) == ["eaglet", "status", "--results", str(r), "--watch", "10"]


def test_a_stage_is_outdated_when_snakemake_would_rerun_any_of_its_rules(tmp_path, history):
    """The vllm backend's extraction is two rules, neither named extract (the hf backend's
    with extract.jobs: one is extract_all and hidden_manifest): any of them rerunning makes
    the stage outdated, with its old facts and an estimate like any remaining stage."""
    r = tmp_path / "results"
    (r / "hidden").mkdir(parents=True)
    (r / "hidden" / "manifest.json").write_text(json.dumps({"num_shards": 2}))
    for rule in ("extract_vllm", "extract_all", "hidden_manifest"):
        shown = status.stage_status(_stage("extract"), r, _full_config(r), {rule})
        assert shown["state"] == "outdated" and shown["facts"]["shards"] == 2
        assert "estimate_basis" in shown
    assert (
        status.stage_status(_stage("extract"), r, _full_config(r), {"train"})["state"]
        == "completed"
    )


# -- estimates in seconds, from known sizes and rates ------------------------------------------


def _prompts(r, n_train, n_eval):
    (r / "prompts").mkdir(parents=True, exist_ok=True)
    (r / "prompts" / "stats.json").write_text(json.dumps({"n_train": n_train, "n_eval": n_eval}))


def test_the_generate_estimate_is_server_start_plus_the_samples_left_at_the_recorded_rate(
    tmp_path, history
):
    r = tmp_path / "results"
    _prompts(r, 30, 10)
    cfg = _full_config(r)
    target = cfg["target"]["model"]
    rates.record("generate", target, completion_tokens_per_s=50.0, server_start_s=20.0)
    guess = cfg["generate"]["max_tokens"] * status.COMPLETION_FILL_GUESS  # tokens per sample
    got = status.estimate("generate", r, cfg, None)
    assert got.seconds == pytest.approx(20.0 + 40 * guess / 50.0)
    assert "40 samples" in got.basis and "an earlier run" in got.basis
    # 10 samples done by an interrupted run: only the other 30 remain
    later = status.estimate("generate", r, cfg, {"state": "interrupted", "done": 10})
    assert later.seconds == pytest.approx(20.0 + 30 * guess / 50.0)
    # 12 training prompts keep their recorded answers (answers: dataset): not asked; with
    # capture on, the same server prefills them for their states, at the prefill rate
    stats = json.loads((r / "prompts" / "stats.json").read_text())
    (r / "prompts" / "stats.json").write_text(json.dumps({**stats, "n_train_recorded_answers": 12}))
    assert status.estimate("generate", r, cfg, None).seconds == pytest.approx(
        20.0 + 28 * guess / 50.0
    )
    cfg["generate"]["capture_hidden_states"] = True
    rates.record("extract_vllm", target, tokens_per_s=400.0)
    got = status.estimate("generate", r, cfg, None)
    assert got.seconds == pytest.approx(20.0 + 28 * guess / 50.0 + 12 * guess / 400.0)
    assert "12 recorded answers prefilled at 400 tok/s" in got.basis


def test_the_extract_estimate_counts_the_tokens_of_the_shards_not_yet_written(tmp_path, history):
    r = tmp_path / "results"
    (r / "synthetic").mkdir(parents=True)
    (r / "synthetic" / "stats.json").write_text(
        json.dumps(
            {
                "splits": {
                    "train": {"samples": 10, "prompt_tokens": 700, "completion_tokens": 900},
                    "eval": {"samples": 2, "prompt_tokens": 150, "completion_tokens": 250},
                }
            }
        )
    )
    cfg = _full_config(r)
    cfg["extract"]["num_shards"] = 4
    cfg["generate"]["capture_hidden_states"] = True  # the states are packed, not computed
    got = status.estimate("extract", r, cfg, None)
    assert got.seconds == pytest.approx(2000 / status.PACK_TOKENS_PER_S)
    assert "packing 2000 captured tokens" in got.basis
    cfg["generate"]["capture_hidden_states"] = False
    # vllm backend: one server start, then every token as prefill, at its own recorded rate
    rates.record("extract_vllm", cfg["target"]["model"], tokens_per_s=400.0, server_start_s=70.0)
    got = status.estimate("extract", r, cfg, None)
    assert got.seconds == pytest.approx(70.0 + 2000 / 400.0)
    assert "prefill at 400 tok/s (an earlier run)" in got.basis
    # hf backend: one job per shard, the shards not yet written
    cfg["extract"]["backend"] = "hf"
    rates.record("extract", cfg["target"]["model"], tokens_per_s=100.0)
    assert status.estimate("extract", r, cfg, None).seconds == pytest.approx(2000 / 100.0)
    (r / "hidden").mkdir()
    (r / "hidden" / "shard_00000.safetensors").write_bytes(b"")
    assert status.estimate("extract", r, cfg, None).seconds == pytest.approx(1500 / 100.0)


def test_before_the_first_answer_extract_and_train_are_estimated_from_the_prompts(
    tmp_path, history
):
    """From the first status after generation starts: the tokens are guessed from the
    prompts' characters and max_tokens (and said to be), then taken from the answers."""
    r = tmp_path / "results"
    _prompts(r, 3, 1)
    texts = ["x" * 400, "y" * 800, "z" * 1200]  # 800 characters on average
    (r / "prompts" / "train.jsonl").write_text(
        "".join(
            json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": t}]}) + "\n"
            for i, t in enumerate(texts)
        )
    )
    cfg = _full_config(r)
    cfg["generate"]["max_tokens"] = 100
    rates.record("extract_vllm", cfg["target"]["model"], tokens_per_s=50.0, server_start_s=10.0)
    per_sample = (
        800 / status.CHARS_PER_TOKEN
        + status.TEMPLATE_TOKENS_GUESS
        + 100 * status.COMPLETION_FILL_GUESS
    )
    tokens = int(3 * per_sample) + int(1 * per_sample)  # the held-out prompts alike
    got = status.estimate("extract", r, cfg, None)
    assert got.seconds == pytest.approx(10.0 + tokens / 50.0)
    assert got.basis.endswith("tokens guessed from the prompts")
    train = status.estimate("train", r, cfg, None)
    assert train.seconds is not None and "guessed" in train.basis
    # the first answer replaces the guess
    (r / "synthetic").mkdir()
    (r / "synthetic" / "generate.partial.jsonl").write_text(
        json.dumps({"id": "p0", "prompt_token_ids": [1] * 40, "completion_token_ids": [2] * 60})
        + "\n"
    )
    got = status.estimate("extract", r, cfg, None)
    assert got.seconds == pytest.approx(10.0 + 4 * 100 / 50.0)
    assert "guessed" not in got.basis


def test_a_running_stage_is_estimated_by_its_own_eta_and_the_total_sums_the_stages(
    tmp_path, history
):
    r = tmp_path / "results"
    _prompts(r, 30, 10)
    cfg = _full_config(r)
    assert status.estimate(
        "generate", r, cfg, {"state": "running", "eta_s": 123.0}
    ) == status.Estimate(123.0, "this run's progress")
    report = status.collect(r, cfg, None)
    known = [s["estimate_s"] for s in report["stages"] if s.get("estimate_s") is not None]
    assert known and report["remaining_s"] == pytest.approx(sum(known))
    assert report["remaining_complete"] == (len(known) == len(report["stages"]))


def test_a_stage_just_started_is_estimated_by_its_plan_less_the_time_it_has_run(tmp_path, history):
    """Right after a start the stage's own rate carries the server start and its first units
    (a fresh demo's status said 5 hours for an extraction of 6 minutes): its plan counts until
    a quarter of it is done; evaluate's units, whole engine runs, never give a rate."""
    r = tmp_path / "results"
    _prompts(r, 30, 10)
    cfg = _full_config(r)
    rates.record(
        "generate", cfg["target"]["model"], completion_tokens_per_s=50.0, server_start_s=20.0
    )
    plan = status.estimate("generate", r, cfg, None).seconds
    early = {"state": "running", "done": 2, "total": 40, "eta_s": 18000.0, "elapsed_s": 60.0}
    got = status.estimate("generate", r, cfg, early)
    assert got.seconds == pytest.approx(plan - 60.0) and "not settled" in got.basis
    settled = {**early, "done": 10, "eta_s": 300.0}
    assert status.estimate("generate", r, cfg, settled) == status.Estimate(
        300.0, "this run's progress"
    )
    # past its plan and still going: the plan was wrong, the stage's own rate is all there is
    # (not "nothing left": a demo's training read 0 s left for two minutes of eight)
    later = {**early, "eta_s": 1800.0, "elapsed_s": plan + 100}
    got = status.estimate("generate", r, cfg, later)
    assert got.seconds == 1800.0 and "spent" in got.basis
    rates.record(rates.EVALUATE, cfg["target"]["model"], baseline_tokens_per_s=20.0)
    evaluate_plan = status.estimate("evaluate", r, cfg, None).seconds
    assert evaluate_plan
    nearly = {"state": "running", "done": 2, "total": 4, "eta_s": 900.0, "elapsed_s": 50.0}
    assert status.estimate("evaluate", r, cfg, nearly).seconds == pytest.approx(
        evaluate_plan - 50.0
    )
    # interleaved, the runs finish together: nothing done, no rate, for most of the stage
    # (a fresh demo's status read the same 12.6 minutes for 5 minutes of evaluation)
    together = {"state": "running", "done": 0, "total": 4, "eta_s": None, "elapsed_s": 300.0}
    got = status.estimate("evaluate", r, cfg, together)
    assert got.seconds == pytest.approx(evaluate_plan - 300.0) and "less the 5m" in got.basis


def test_evaluate_counts_the_run_that_checks_the_derived_schedule(tmp_path, history):
    """With several concurrency levels the derived k schedule gets one more vLLM run: a plan
    without it read 27 s left with nearly 3 minutes to go on a fresh demo."""
    r = tmp_path / "results"
    _prompts(r, 30, 10)
    cfg = _full_config(r)
    rates.record(rates.EVALUATE, cfg["target"]["model"], baseline_tokens_per_s=20.0)
    ev = cfg["evaluate"]
    assert ev["schedule"] and ev["ngram"] and ev["offline"] and len(ev["concurrency"]) > 1
    with_check = status.estimate("evaluate", r, cfg, None)
    cfg["evaluate"] = {**ev, "schedule": False}
    without = status.estimate("evaluate", r, cfg, None)
    runs = 2 + len(ev["num_speculative_tokens"])  # the target alone, ngram, each k
    replays = status.OFFLINE_REPLAY_SHARE * len(ev["num_speculative_tokens"])
    assert with_check.seconds / without.seconds == pytest.approx(
        (runs + 1 + replays) / (runs + replays)
    )
    assert f"{runs + 1} vLLM runs" in with_check.basis and f"{runs} vLLM runs" in without.basis
    cfg["evaluate"] = {**ev, "concurrency": [1]}  # one level: the schedule is one fixed k
    assert f"{runs} vLLM runs" in status.estimate("evaluate", r, cfg, None).basis


def test_interleaved_the_sweeps_servers_start_together_as_an_earlier_evaluation_measured(
    tmp_path, history
):
    """Side by side, the sweep's servers start up together (the check's alone): before any
    evaluation measured that, as long as one after another; then that evaluation's time for
    as many servers, scaled to this sweep's count."""
    r = tmp_path / "results"
    _prompts(r, 30, 10)
    cfg = _full_config(r)
    target = cfg["target"]["model"]
    rates.record("evaluate", target, baseline_tokens_per_s=20.0)
    rates.record("generate", target, server_start_s=30.0)
    cfg["evaluate"] = {**cfg["evaluate"], "interleave": True, "offline": False}
    assert len(sweep_runs(cfg["evaluate"])[0]) == 3  # the target alone, ngram, k 3
    unmeasured = status.estimate("evaluate", r, cfg, None).seconds
    rates.record("evaluate", target, sweep_servers=3, sweep_start_s=45.0)
    measured = status.estimate("evaluate", r, cfg, None).seconds
    assert unmeasured - measured == pytest.approx(3 * 30.0 - 45.0)
    cfg["evaluate"] = {**cfg["evaluate"], "num_speculative_tokens": [2, 3, 4]}  # five servers
    five = status.estimate("evaluate", r, cfg, None).seconds
    cfg["evaluate"] = {**cfg["evaluate"], "interleave": False}
    one_by_one = status.estimate("evaluate", r, cfg, None).seconds
    # one after another: five starts and the check's; together: 45 s x 5/3 and the check's,
    # and the check is measured beside the target alone (one more measurement)
    per_run = (measured - 45.0 - 30.0) / 5  # 3 sweep runs + the check and the target again
    assert one_by_one - five == pytest.approx(6 * 30.0 - (75.0 + 30.0) - per_run)


# -- the command line --------------------------------------------------------------------------


def _finished_prompts(tmp_path):
    r = tmp_path / "results"
    _prompts(r, 30, 10)
    (r / "prompts" / "train.jsonl").write_text("")
    (r / "prompts" / "eval.jsonl").write_text("")
    return r


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "command",
    [[sys.executable, "-m", "eaglet.tools.cli"], [str(EAGLET)]],
    ids=["python -m eaglet.tools.cli", "the eaglet console script"],
)
def test_the_eaglet_command_prints_the_status_as_json(tmp_path, history, command):
    r = _finished_prompts(tmp_path)
    proc = subprocess.run(
        [*command, "status", "--results", str(r), "--no-snakemake", "--json"],
        cwd=REPO,
        env=pythonpath_env(SRC),
        text=True,
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["results"] == str(r)
    states = {s["stage"]: s["state"] for s in report["stages"]}
    assert states["prepare_prompts"] == "completed" and states["generate"] == "pending"
    unknown = subprocess.run(
        [*command, "stats"],
        cwd=REPO,
        env=pythonpath_env(SRC),
        text=True,
        capture_output=True,
        timeout=120,
    )
    assert unknown.returncode == 2 and "unknown command 'stats'" in unknown.stderr


@pytest.mark.subprocess
def test_watch_redraws_the_status_until_stopped(tmp_path, history):
    r = _finished_prompts(tmp_path)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "eaglet.tools.cli",
            "status",
            "--results",
            str(r),
            "--no-snakemake",
            "--watch",
            "0.1",
        ],
        cwd=REPO,
        env=pythonpath_env(SRC),
        text=True,
        stdout=subprocess.PIPE,
    )
    screens = []
    try:
        for line in proc.stdout:  # blocks until the next line; ends if the process exits
            if "eaglet status of" in line:
                screens.append(line)
                if len(screens) == 3:
                    break
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert len(screens) == 3, "the status was not redrawn"
    # each screen clears the terminal first and shows the same results dir
    assert all(s.startswith("\033[2J\033[H") and str(r) in s for s in screens)


# -- the stages against the workflow -------------------------------------------------------------

NOT_STAGES = {"all", "plots"}  # plots redraws the figures from the results in seconds


@pytest.mark.subprocess
@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_the_stages_are_the_workflows_rules_in_its_order(tmp_path, backend):
    """Status lists the stages itself, as it also reads results without Snakemake: every rule
    of a dry run belongs to one stage, a stage's outputs and log are its rules', and no stage
    comes before one whose outputs it reads."""
    from tests.workflows.dryrun import parse_dry_run

    r = tmp_path / "results"
    overlay = tmp_path / "backend.yaml"
    overlay.write_text(f"extract:\n  backend: {backend}\n")
    proc = subprocess.run(
        [
            str(SNAKEMAKE),
            "-n",
            "--cores",
            "1",
            "--configfile",
            str(TINY),
            str(overlay),
            "--config",
            f"results_dir={r}",
        ],
        cwd=REPO,
        env=pythonpath_env(SRC),
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    jobs = [job for job in parse_dry_run(proc.stdout) if job.rule not in NOT_STAGES]
    stages = status.run_stages(yaml.safe_load(TINY.read_text()))
    position = {rule: i for i, s in enumerate(stages) for rule in s.rules}
    assert {job.rule for job in jobs} <= set(position)
    made_by = {out: position[job.rule] for job in jobs for out in job.output}
    for i, stage in enumerate(stages):
        own = [job for job in jobs if position[job.rule] == i]
        assert own, f"no rule of {stage.name} in the workflow"
        outputs = {out for job in own for out in job.output}
        assert {str(r / out) for out in stage.outputs} <= outputs, stage.name
        logs = [Path(log) for job in own for log in job.log]
        assert any(r / stage.log in (log, *log.parents) for log in logs), stage.name
        read = {made_by[path] for job in own for path in job.input if path in made_by}
        assert all(j <= i for j in read), stage.name
    assert status.order_line().startswith(f"Order: {status.STAGES[0].name} -> ")


@pytest.mark.parametrize(
    "backend, capture, holds", [("vllm", False, 2), ("hf", True, 2), ("hf", False, 1)]
)
def test_extract_reports_the_gpus_its_jobs_hold(tmp_path, backend, capture, holds):
    """The vllm backend and captured states extract through a server on server.gpus (as
    rules/extract.smk declares it); the hf backend's jobs hold extract.gpus."""
    from eaglet.core.config import validate

    r = tmp_path / "results"
    cfg = validate(
        {
            "results_dir": str(r),
            "server": {"gpus": 2},
            "extract": {"gpus": 1, "backend": backend},
            "generate": {"capture_hidden_states": capture},
        }
    )
    assert status.stage_status(_stage("extract"), r, cfg, set())["gpus"] == holds


# -- generation's skipped prompts, Snakemake's leftover lock, stages seen while they run --------


def test_a_prompt_skipped_as_too_long_leaves_the_estimates_during_generation_working(
    tmp_path, history
):
    """A prompt too long for target.max_model_len is recorded as skipped, without token ids:
    status raised KeyError 'prompt_token_ids' on every reading until generation ended."""
    r = tmp_path / "results"
    _prompts(r, 3, 1)
    (r / "synthetic").mkdir()
    messages = [{"role": "user", "content": "x"}]
    records = (
        {
            "id": "p0",
            "source": "s",
            "messages": messages,
            "created_at": "2026-01-01T10:00:00+00:00",
            "skipped": "the prompt's 9000 tokens leave no room for an answer",
        },
        {"id": "p1", "prompt_token_ids": [1] * 40, "completion_token_ids": [2] * 60},
        {"id": "p2", "messages": messages, "error": "ReadTimeout"},
    )
    (r / "synthetic" / "generate.partial.jsonl").write_text(
        "".join(json.dumps(record) + "\n" for record in records)
    )
    cfg = _full_config(r)
    rates.record("extract_vllm", cfg["target"]["model"], tokens_per_s=50.0, server_start_s=10.0)
    got = status.estimate("extract", r, cfg, None)
    assert got.seconds == pytest.approx(10.0 + 4 * 100 / 50.0)  # from the one answer
    assert "guessed" not in got.basis
    shown = {s["stage"]: s for s in status.collect(r, cfg, None)["stages"]}
    assert shown["extract"]["estimate_s"] == pytest.approx(got.seconds)


def _snakemake_record(r, pid, started=None, command="snakemake --cores 2"):
    (r / "run").mkdir(parents=True, exist_ok=True)
    path = r / "run" / "snakemake.json"
    path.write_text(json.dumps({"pid": pid, "command": command}))
    if started is not None:
        os.utime(path, (started, started))


DEAD_PID = 2**22 + 7


def test_a_killed_snakemakes_lock_is_named_with_the_command_that_removes_it(tmp_path, capsys):
    """Snakemake removes its lock only on its way out: after a kill the rerun stopped with
    LockException while status said only "rerun snakemake to resume"."""
    import shlex

    workdir = tmp_path / "workflow"
    r = workdir / "results"
    (r / "run").mkdir(parents=True)
    (r / "run" / "config.json").write_text(json.dumps({"results_dir": str(r)}))
    _snakemake_record(r, DEAD_PID, command="/somewhere/.venv/bin/snakemake --cores 2")
    _dead_progress(r, "generate")
    locks = workdir / ".snakemake" / "locks"
    locks.mkdir(parents=True)
    # Snakemake writes the paths as the rules name them: here relative to its directory
    (locks / "0.input.lock").write_text("results/prompts/train.jsonl\n")
    (locks / "0.output.lock").write_text(
        "results/synthetic/train.jsonl\nresults/target/target.json\n"
    )
    assert status.main(["--results", str(r), "--no-snakemake", "--workflow", str(workdir)]) == 0
    text = capsys.readouterr().out
    assert "LockException" in text and str(locks) in text
    command = next(line for line in text.splitlines() if "--unlock" in line).strip()
    assert command.startswith(f"cd {shlex.quote(str(workdir))} && ")
    assert shlex.split(command.split(" && ", 1)[1]) == [
        "/somewhere/.venv/bin/snakemake",
        "--unlock",
        *status.snakemake_config_args(r, None),
    ]
    assert "INTERRUPTED (process gone; remove Snakemake's lock" in text

    def lock():
        return status.collect(r, _full_config(r), None, workdir=workdir)["snakemake"]["stale_lock"]

    assert lock()["files"] == ["0.input.lock", "0.output.lock"]
    # a lock of another results dir, or one a running Snakemake holds, is not this run's
    (locks / "0.output.lock").write_text(f"{tmp_path / 'other' / 'target.json'}\n")
    (locks / "0.input.lock").write_text(f"{workdir / 'results-other' / 'x'}\n")
    assert lock() is None
    (locks / "0.output.lock").write_text(f"{r / 'target' / 'target.json'}\n")  # absolute
    assert lock() is not None
    _snakemake_record(r, os.getpid())
    assert lock() is None


def test_a_job_that_outlived_its_killed_snakemake_is_named_to_stop_before_the_unlock(
    tmp_path, capsys
):
    """kill -9 of Snakemake alone leaves its training running: status listed it as running
    and advised the unlock, after which the orphan and the rerun's trainer both wrote the
    checkpoints. Status names the live job and its pid, and puts stopping it first."""
    workdir = tmp_path / "workflow"
    r = workdir / "results"
    (r / "run").mkdir(parents=True)
    (r / "run" / "config.json").write_text(json.dumps({"results_dir": str(r)}))
    _snakemake_record(r, DEAD_PID, command="snakemake --cores 2")
    _dead_progress(r, "train", pid=os.getpid(), unit="steps")  # alive: this process
    locks = workdir / ".snakemake" / "locks"
    locks.mkdir(parents=True)
    (locks / "0.output.lock").write_text("results/drafter/config.json\n")
    assert status.main(["--results", str(r), "--no-snakemake", "--workflow", str(workdir)]) == 0
    text = capsys.readouterr().out
    said = next(line for line in text.splitlines() if "still run without it" in line)
    assert f"train (pid {os.getpid()})" in said and f"kill {os.getpid()}" in said
    assert "stop the jobs above, then run" in text
    assert text.index("still run without it") < text.index("--unlock")


def test_a_stage_without_a_progress_file_shows_running_while_snakemake_runs_its_job(tmp_path):
    """prepare_target writes no progress file: status read it pending for the whole
    minute its dequantization took. Its log, newer than the Snakemake that runs it, says
    it runs; once that Snakemake is gone, it was interrupted."""
    import time
    from datetime import datetime, timedelta

    r = tmp_path / "results"
    cfg = _full_config(r)
    assert cfg["target"]["model"].startswith("embedded:")  # a plan of 40 s
    _snakemake_record(r, os.getpid(), started=time.time() - 300)
    began = (datetime.now() - timedelta(seconds=25)).strftime("%Y-%m-%d %H:%M:%S,%f")[:23]
    (r / "logs").mkdir(parents=True)
    (r / "logs" / "prepare_target.log").write_text(
        f"{began} INFO eaglet.target.checkpoint: dequantizing the GGUF (about 30 s)\n"
    )
    shown = status.stage_status(_stage("prepare_target"), r, cfg, set())
    assert shown["state"] == "running"
    assert shown["progress"][0]["elapsed_s"] == pytest.approx(25, abs=5)
    assert shown["estimate_s"] == pytest.approx(40 - 25, abs=5)
    assert "less the" in shown["estimate_basis"]
    text = status.render(status.collect(r, cfg, None))
    assert "> prepare_target  running for " in text and f"pid {os.getpid()}" in text
    # the Snakemake that ran it is gone: interrupted, not pending
    _snakemake_record(r, DEAD_PID, started=time.time() - 300)
    assert status.stage_status(_stage("prepare_target"), r, cfg, set())["state"] == "interrupted"
    # a log older than the Snakemake now running is an earlier run's: the job has not started
    _snakemake_record(r, os.getpid())
    os.utime(r / "logs" / "prepare_target.log", (time.time() - 600, time.time() - 600))
    assert status.stage_status(_stage("prepare_target"), r, cfg, set())["state"] == "pending"
    (r / "target").mkdir()
    (r / "target" / "target.json").write_text(json.dumps({"spec": cfg["target"]["model"]}))
    assert status.stage_status(_stage("prepare_target"), r, cfg, set())["state"] == "completed"


def test_extract_counts_the_shards_its_job_has_packed_beyond_its_progress_file(tmp_path):
    """One job packs every shard and rewrites its progress file every few seconds at most:
    a status read 0/31 after the first shard was packed. The shards written since the job
    started count, besides those an earlier run packed (resumed)."""
    import time
    from datetime import datetime

    r = tmp_path / "results"
    started = time.time() - 60
    (r / "progress").mkdir(parents=True)
    (r / "progress" / "extract_vllm.json").write_text(
        json.dumps(
            {
                "stage": "extract",
                "state": "running",
                "unit": "samples",
                "done": 8,
                "failed": 0,
                "total": 31,
                "resumed_from": 8,
                "pid": os.getpid(),
                "rate_per_s": None,
                "eta_s": None,
                "started_at": datetime.fromtimestamp(started, UTC).isoformat(timespec="seconds"),
            }
        )
    )
    staged = r / "hidden" / "vllm" / "shards"
    for split, samples, when in (("eval", 8, started - 600), ("train", 12, time.time())):
        (staged / split).mkdir(parents=True)
        (staged / split / "shard_00000.json").write_text(json.dumps({"num_samples": samples}))
        os.utime(staged / split / "shard_00000.json", (when, when))
    cfg = _full_config(r)
    shown = status.stage_status(_stage("extract"), r, cfg, set())
    assert shown["state"] == "running" and shown["progress"][0]["done"] == 8 + 12
    assert "running: 20/31 samples" in status.render(status.collect(r, cfg, None))
    # a shard job of the hf backend counts its own shard only: its file is read as written
    (r / "progress" / "extract_vllm.json").rename(r / "progress" / "extract_00001.json")
    assert status.stage_status(_stage("extract"), r, cfg, set())["progress"][0]["done"] == 8


def _trained(r, shipped=None):
    """A finished train stage: the drafter, its log (evaluations at epochs 1, 2 and 3, the
    held-out AL peaking at epoch 2) and, unless ``shipped`` is None, its stats.json."""
    drafter = r / "drafter"
    drafter.mkdir(parents=True)
    (drafter / "model.safetensors").write_bytes(b"")
    rows = [
        (10, 1, "eval", 0.30, 1.40),
        (20, 2, "eval", 0.42, 1.60),
        (30, 3, "train", 0.55, 1.90),
        (30, 3, "eval", 0.35, 1.30),
    ]
    (drafter / "training_log.csv").write_text(
        "step,epoch,split,acc_0,sim_al\n"
        + "".join(f"{step},{epoch},{split},{acc},{al}\n" for step, epoch, split, acc, al in rows)
    )
    if shipped is not None:
        (drafter / "stats.json").write_text(json.dumps({"steps": 30, "shipped": shipped}))


BEST_SHIPPED = {
    "choice": "best",
    "step": 20,
    "epoch": 2.0,
    "heldout_al": 1.6,
    "best_step": 20,
    "best_epoch": 2.0,
    "best_heldout_al": 1.6,
    "last_epoch": 3.0,
    "last_epoch_al": 1.3,
    "chosen_from_step": 0,
    "note": "the best held-out weights ship (epoch 2, step 20)",
}


def test_train_shows_the_shipped_epoch_and_its_held_out_al_not_the_last(tmp_path, capsys):
    r = tmp_path / "results"
    _trained(r, BEST_SHIPPED)
    train = status.stage_status(_stage("train"), r, _full_config(r), set())
    assert train["state"] == "completed"
    assert train["facts"]["shipped"]["choice"] == "best"
    assert train["facts"]["shipped"]["heldout_al"] == pytest.approx(1.6)
    assert train["facts"]["shipped"]["epoch"] == 2.0
    assert train["facts"]["shipped"]["last_epoch_al"] == pytest.approx(1.3)
    line = status.render(status.collect(r, _full_config(r), None))
    shown = next(x for x in line.splitlines() if x.strip().startswith("+ train"))
    assert "ships epoch 2 (held-out AL 1.60; last epoch 3 had 1.30)" in shown
    assert "simulated AL 1.30" not in shown  # the last evaluation is not the drafter's
    assert (
        status.main(["--results", str(r), "--no-snakemake", "--workflow", str(tmp_path), "--json"])
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    facts = {s["stage"]: s for s in report["stages"]}["train"]["facts"]
    assert facts["shipped"]["epoch"] == 2.0 and facts["shipped"]["heldout_al"] == 1.6
    assert facts["shipped"]["choice"] == "best"


@pytest.mark.parametrize(
    "shipped, says",
    [
        (
            {
                **BEST_SHIPPED,
                "choice": "last",
                "step": 30,
                "epoch": 3.0,
                "heldout_al": 1.7,
                "best_step": 30,
                "best_epoch": 3.0,
                "best_heldout_al": 1.7,
                "last_epoch_al": 1.7,
            },
            "ships the last epoch 3 (held-out AL 1.70, the best)",
        ),
        (
            {
                **BEST_SHIPPED,
                "choice": "last",
                "step": 30,
                "epoch": 3.0,
                "heldout_al": 1.3,
                "best_step": None,
                "best_epoch": None,
                "best_heldout_al": None,
            },
            "ships the last epoch 3 (held-out AL 1.30)",
        ),
        (
            {
                **BEST_SHIPPED,
                "choice": "last",
                "step": 30,
                "epoch": 3.0,
                "heldout_al": None,
                "best_step": None,
                "best_epoch": None,
                "best_heldout_al": None,
                "last_epoch_al": None,
            },
            "ships the last epoch 3 (no held-out split to choose by)",
        ),
    ],
    ids=["last is best", "best weights gone", "no held-out split"],
)
def test_train_says_when_the_last_epoch_ships(tmp_path, shipped, says):
    r = tmp_path / "results"
    _trained(r, shipped)
    facts = status.stage_status(_stage("train"), r, _full_config(r), set())["facts"]
    line = _stage("train").line(facts)
    assert line.endswith(says)
    assert "ships epoch" not in line


def test_train_trained_before_stats_json_shows_the_last_evaluation(tmp_path):
    r = tmp_path / "results"
    _trained(r)
    facts = status.stage_status(_stage("train"), r, _full_config(r), set())["facts"]
    assert "shipped" not in facts
    assert _stage("train").line(facts) == (
        "step 30; train acc_0 0.550, simulated AL 1.90; eval acc_0 0.350, simulated AL 1.30"
    )


# -- this machine's speed, measured by this run --------------------------------------------------


def _worked(r, name, tokens_per_s, elapsed_s=200.0, state="finished", resumed_from=0, **fields):
    """A progress file as a stage of this run leaves it after ``elapsed_s`` seconds of work at
    ``tokens_per_s`` (started that long ago, so the rates it records come after its start)."""
    from datetime import datetime, timedelta

    started = datetime.now(UTC) - timedelta(seconds=elapsed_s + 30)
    (r / "progress").mkdir(parents=True, exist_ok=True)
    (r / "progress" / f"{name}.json").write_text(
        json.dumps(
            {
                "stage": name,
                "state": state,
                "unit": "samples",
                "done": 40,
                "failed": 0,
                "total": 40,
                "resumed_from": resumed_from,
                "tokens": tokens_per_s * elapsed_s,
                "tokens_per_s": tokens_per_s,
                "elapsed_s": elapsed_s,
                "pid": DEAD_PID,
                "started_at": started.isoformat(timespec="seconds"),
                **fields,
            }
        )
    )


def _generated(r):
    """A results dir whose generation finished: 30 train and 10 held-out prompts answered,
    12000 tokens (the size of every later stage)."""
    _prompts(r, 30, 10)
    (r / "synthetic").mkdir(parents=True)
    for split in ("train", "eval"):
        (r / "synthetic" / f"{split}.jsonl").write_text("")
    (r / "synthetic" / "stats.json").write_text(
        json.dumps(
            {
                "splits": {
                    split: {
                        "samples": n,
                        "prompt_tokens": 100 * n,
                        "completion_tokens": 200 * n,
                        "failed": 0,
                        "truncated": 0,
                    }
                    for split, n in (("train", 30), ("eval", 10))
                }
            }
        )
    )
    cfg = _full_config(r)
    # one server after another, no check run, no replay: the plan is starts + decoding
    cfg["evaluate"] = {**cfg["evaluate"], "interleave": False, "schedule": False, "offline": False}
    return cfg


def _decoding(estimate, r, cfg):
    """An evaluation plan less its server starts (one per engine run)."""
    runs = len(sweep_runs(cfg["evaluate"])[0])
    return estimate.seconds - runs * _server_start("generate", cfg["target"]["model"])


def _extract_benchmark():
    return json.loads((BENCHMARK_RESULTS / "extract.json").read_text())["vllm_backend_tokens_per_s"]


def test_a_generation_twice_as_fast_as_its_benchmark_halves_the_plans_after_it(tmp_path, history):
    """Plans rest on rates of other days and machines: a fresh demo on a faster machine read
    every stage not yet started 1.3-1.7x too long. Generation's rate over the one its plan
    assumed is this machine's speed: extraction and training (other kinds of work) are
    planned at it, evaluation decodes at generation's own rate."""
    r = tmp_path / "results"
    cfg = _generated(r)
    target = cfg["target"]["model"]
    planned = {
        name: status.estimate(name, r, cfg, None) for name in ("extract", "train", "evaluate")
    }
    assert all(e.seconds and e.speed is None for e in planned.values())
    benchmark = _bench_generate(cfg["generate"]["concurrency"])
    _worked(r, "generate", 2 * benchmark)
    # the finished stage records its rate, as generate does: not the rate its estimate assumed
    rates.record("generate", target, completion_tokens_per_s=2 * benchmark)
    now = {name: status.estimate(name, r, cfg, None) for name in planned}
    start = _server_start("extract_vllm", target)
    assert now["extract"].seconds - start == pytest.approx((planned["extract"].seconds - start) / 2)
    assert now["train"].seconds == pytest.approx(planned["train"].seconds / 2)
    assert _decoding(now["evaluate"], r, cfg) == pytest.approx(
        _decoding(planned["evaluate"], r, cfg) / 2
    )
    for name in ("extract", "train"):
        assert "x2.00 this machine's speed from generate's decode" in now[name].basis
    assert (
        f"decode {2 * benchmark:.0f} tok/s at concurrency {cfg['generate']['concurrency']}, "
        "measured by generate (x2.00 the benchmark's)" in now["evaluate"].basis
    )
    shown = {s["stage"]: s for s in status.collect(r, cfg, None)["stages"]}
    assert shown["generate"]["state"] == "completed"
    for name in planned:
        assert shown[name]["speed_from"] == "generate" and shown[name]["speed_kind"] == "decode"
        assert shown[name]["speed_factor"] == pytest.approx(2.0)
        assert shown[name]["estimate_s"] == pytest.approx(now[name].seconds)


def test_a_kind_measured_directly_beats_another_kinds_speed(tmp_path, history):
    """Evaluation decodes like generation, even where extraction measured a different speed
    over more time; training, a kind no stage measured, takes the speed measured longest; a
    generation to do again is planned at the decode speed evaluation measured."""
    r = tmp_path / "results"
    cfg = _generated(r)
    gen_bench = _bench_generate(cfg["generate"]["concurrency"])
    train_plan = status.estimate("train", r, cfg, None).seconds
    _worked(r, "generate", 2 * gen_bench, elapsed_s=120.0)
    _worked(r, "extract_vllm", 3 * _extract_benchmark(), elapsed_s=600.0)
    evaluation = status.estimate("evaluate", r, cfg, None)
    assert evaluation.speed.stage == "generate" and "measured by generate" in evaluation.basis
    train = status.estimate("train", r, cfg, None)
    assert train.speed.stage == "extract" and train.seconds == pytest.approx(train_plan / 3)
    assert "x3.00 this machine's speed from extract's prefill" in train.basis
    # an evaluation finished at 4x its plan's rate (the benchmark at its first concurrency)
    first = cfg["evaluate"]["concurrency"][0]
    rate = 4 * _bench_generate(first)
    (r / "eval").mkdir()
    (r / "eval" / "acceptance.json").write_text(
        json.dumps(
            {
                "concurrency": cfg["evaluate"]["concurrency"],
                "runs": [
                    {
                        "levels": [
                            {
                                "set": "held-out",
                                "concurrency": first,
                                "output_tokens": rate * 30,
                                "wall_s": 30.0,
                            },
                            {
                                "set": "held-out",
                                "concurrency": 16,
                                "output_tokens": 10.0,
                                "wall_s": 30.0,
                            },
                        ]
                    }
                ],
            }
        )
    )
    # generation to do again: its own measurement does not plan it, evaluation's decode does
    again = status.estimate("generate", r, cfg, None)
    assert again.speed.stage == "evaluate" and again.speed.factor == pytest.approx(4.0)
    assert "x4.00 this machine's decode speed measured by evaluate" in again.basis
    per_sample = cfg["generate"]["max_tokens"] * status.COMPLETION_FILL_GUESS
    assert again.seconds == pytest.approx(
        _server_start("generate", cfg["target"]["model"]) + 40 * per_sample / (4 * gen_bench)
    )


def test_a_stage_at_work_for_less_than_a_minute_does_not_measure_the_machine(tmp_path, history):
    """Its first requests or steps are warm-up: the plans keep their rates until a minute of
    work (or the stage's end), and a stage that only resumed an earlier run's work measured
    nothing."""
    r = tmp_path / "results"
    cfg = _generated(r)
    planned = status.estimate("train", r, cfg, None)
    benchmark = _bench_generate(cfg["generate"]["concurrency"])
    _worked(r, "generate", 2 * benchmark, elapsed_s=50.0, state="running", done=10)
    assert status.estimate("train", r, cfg, None) == planned
    _worked(r, "generate", 2 * benchmark, elapsed_s=61.0, state="running", done=10)
    assert status.estimate("train", r, cfg, None).seconds == pytest.approx(planned.seconds / 2)
    _worked(r, "generate", 2 * benchmark, elapsed_s=200.0, resumed_from=40)
    assert status.estimate("train", r, cfg, None) == planned


def test_without_a_measurement_of_this_run_the_plans_are_as_before(tmp_path, history):
    """No stage of this run has worked a minute: every plan rests on the rates history and the
    benchmarks as it did, and says no speed of this machine."""
    r = tmp_path / "results"
    cfg = _generated(r)
    target, train = cfg["target"]["model"], cfg["train"]
    rates.record("train", target, tokens_per_s=500.0, ttt_steps=train["ttt_steps"])
    rates.record("evaluate", target, baseline_tokens_per_s=20.0)
    expected = {
        "train": (
            train["epochs"] * 9000 / 500.0,
            f"{train['epochs']} epochs x 9000 tokens at 500 tok/s (an earlier run)",
        ),
        "extract": (
            _server_start("extract_vllm", target) + 12000 / _extract_benchmark(),
            f"server start + 12000 tokens of prefill at {_extract_benchmark():.0f} tok/s "
            "(benchmarks/results)",
        ),
    }
    evaluation = status.estimate("evaluate", r, cfg, None)
    assert "decode 20 tok/s at concurrency 1 (an earlier evaluation)" in evaluation.basis
    _worked(r, "prepare_prompts", 100.0)  # no model's work
    _worked(r, "generate", 100.0, elapsed_s=30.0, state="running", done=5)
    _worked(r, "train", 900.0, resumed_from=40)
    for name, (seconds, basis) in expected.items():
        got = status.estimate(name, r, cfg, None)
        assert got == status.Estimate(pytest.approx(seconds), basis)
    assert status.estimate("evaluate", r, cfg, None) == evaluation
    shown = status.collect(r, cfg, None)["stages"]
    assert not any(s.get("speed_factor") or s.get("speed_from") for s in shown)


def test_a_running_training_is_not_planned_from_its_own_new_checkpoint(tmp_path, history):
    """A demo's training wrote its checkpoint at step 100 of 705 and status planned it as a
    rerun resuming there (with a plan already spent: 0 s left while 8 minutes remained)."""
    import os

    r = tmp_path / "results"
    (r / "drafter_checkpoints/step_00000100").mkdir(parents=True)
    (r / "drafter_checkpoints/step_00000100/state.json").write_text(
        json.dumps({"step": 100, "total_steps": 705})
    )
    (r / "progress").mkdir()
    record = {
        "stage": "train",
        "state": "running",
        "unit": "steps",
        "done": 120,
        "total": 705,
        "resumed_from": 0,
        "eta_s": 450.0,
        "elapsed_s": 90.0,
        "pid": os.getpid(),
        "host": socket.gethostname(),
    }
    (r / "progress/train.json").write_text(json.dumps(record))
    (r / "synthetic").mkdir()
    (r / "synthetic/stats.json").write_text(
        json.dumps(
            {
                "splits": {
                    "train": {"samples": 10, "prompt_tokens": 1000, "completion_tokens": 3000},
                    "eval": {"samples": 2, "prompt_tokens": 200, "completion_tokens": 600},
                }
            }
        )
    )
    cfg = _full_config(r)
    rates.record(
        "train",
        cfg["target"]["model"],
        tokens_per_s=1e6,  # a plan far too short
        ttt_steps=cfg["train"]["ttt_steps"],
    )
    train = _BY_NAME["train"]
    planned = train.estimate(r, cfg, None)
    assert "resuming" not in planned.basis
    left = status.estimate("train", r, cfg, record)
    # the plan (16K tokens at 1M tok/s) is spent after 90 s: the stage's own ETA, not 0
    assert left.seconds == pytest.approx(450.0) and "spent" in left.basis
    record["pid"] = 2**22 + 12345  # a dead run: its rerun resumes from the checkpoint
    (r / "progress/train.json").write_text(json.dumps(record))
    assert "resuming from the checkpoint at step 100/705" in train.estimate(r, cfg, None).basis


def test_a_running_evaluation_is_estimated_from_the_plan_it_wrote(tmp_path, history):
    """A started evaluation's progress carries its estimate of work (evaluate.schedule.work_plan):
    status multiplies the rates by it, not by what it derives from the config. A fresh demo
    whose drafter paid at no concurrency ran no schedule check, and its status counted one to
    the end (4.5 minutes said, 2.3 left): the plan says whether the sweep chose one."""
    r = tmp_path / "results"
    _prompts(r, 30, 10)
    cfg = _full_config(r)
    rates.record(rates.EVALUATE, cfg["target"]["model"], baseline_tokens_per_s=20.0)
    plan, replays = sweep_runs(cfg["evaluate"])
    units = len(plan) + replays
    with_check = status.estimate("evaluate", r, cfg, None).seconds
    cfg_without = {**cfg, "evaluate": {**cfg["evaluate"], "schedule": False}}
    without_check = status.estimate("evaluate", r, cfg_without, None).seconds
    assert with_check > without_check
    sets = {"heldout": 10, **{entry["name"]: 10 for entry in cfg["evaluate"]["prompt_sets"]}}
    work = work_plan(cfg["evaluate"], len(plan), replays, False, sets)
    assert work["schedule_check"] is None
    sweeping = {
        "state": "running",
        "done": 0,
        "total": units,
        "eta_s": None,
        "elapsed_s": 60.0,
        "plan": work,
    }
    assert status.estimate("evaluate", r, cfg, sweeping).seconds == pytest.approx(with_check - 60)
    swept = {
        **sweeping,
        "done": len(plan),
        "eta_s": 120.0,
        "plan": {**work, "schedule_check": False},
    }
    got = status.estimate("evaluate", r, cfg, swept)
    assert got.seconds == pytest.approx(without_check - 60) and "chose no schedule" in got.basis
    checking = {**swept, "total": units + 1, "plan": {**work, "schedule_check": True}}
    got = status.estimate("evaluate", r, cfg, checking)
    assert got.seconds == pytest.approx(with_check - 60) and "chose a schedule" in got.basis
    # the stage's own prompt counts, not the config's guess: sets of 2 prompts take less
    small = work_plan(cfg["evaluate"], len(plan), replays, False, dict.fromkeys(sets, 2))
    fewer = status.estimate("evaluate", r, cfg, {**sweeping, "plan": small}).seconds
    assert fewer < with_check - 60


def test_an_earlier_run_on_this_machine_plans_its_stage_unscaled(tmp_path, history):
    """A fresh demo after `make test`: the tiny test run's generation at the same concurrency
    was the plan generation measured 1.46x against (its few short prompts decode slower),
    and that factor then planned training 1.4x too fast and evaluation 1.3x too long, where
    the earlier demo's own training and evaluation rates were right (588 tok/s planned, 603
    measured; 10.6 minutes planned, 10.4 taken). A plan read from this machine's history is
    this machine already: unscaled. Generation's rate carried by the benchmark's curve plans
    the evaluation only where no earlier evaluation at its settings did; one at other
    settings does not."""
    r = tmp_path / "results"
    cfg = _generated(r)
    target = cfg["target"]["model"]
    first = cfg["evaluate"]["concurrency"][0]
    benchmark = _bench_generate(cfg["generate"]["concurrency"])
    other = {**cfg, "evaluate": {**cfg["evaluate"], "concurrency": [first + 3]}}

    def earlier(stage, settings, **values):  # recorded by a run before this one
        entry = {
            "stage": stage,
            "target": target,
            "device": rates.device_kind(),
            "at": "2026-01-01T00:00:00+00:00",
            "settings": settings,
            **values,
        }
        with open(history, "a") as handle:
            handle.write(json.dumps(entry) + "\n")

    earlier("generate", rates.generate_settings(cfg), completion_tokens_per_s=benchmark / 1.46)
    earlier("train", rates.train_settings(cfg["train"]), tokens_per_s=588.0)
    earlier("evaluate", rates.evaluate_settings(other), baseline_tokens_per_s=99.0)
    train_before = status.estimate("train", r, cfg, None)
    _worked(r, "generate", benchmark)
    train = status.estimate("train", r, cfg, None)
    assert train.seconds == pytest.approx(train_before.seconds)
    assert train.speed is None and "at 588 tok/s (an earlier run)" in train.basis
    without = status.estimate("evaluate", r, cfg, None)
    assert "measured by generate" in without.basis and "earlier evaluation" not in without.basis
    earlier("evaluate", rates.evaluate_settings(cfg), baseline_tokens_per_s=10.0)
    got = status.estimate("evaluate", r, cfg, None)
    assert f"decode 10 tok/s at concurrency {first} (an earlier evaluation)" in got.basis
    assert got.speed is None and got.seconds != without.seconds


def test_an_earlier_run_on_another_machine_is_planned_at_this_machines_speed(tmp_path, history):
    """The rates history of another kind of machine (a cluster's other GPU type) is no plan
    for this one as it is: like the benchmarks, it is scaled by the speed this run measured
    against them."""
    r = tmp_path / "results"
    cfg = _generated(r)
    entry = {
        "stage": "train",
        "target": cfg["target"]["model"],
        "device": "nvidia:other",
        "at": "2026-01-01T00:00:00+00:00",
        "settings": rates.train_settings(cfg["train"]),
        "tokens_per_s": 500.0,
    }
    history.write_text(json.dumps(entry) + "\n")
    before = status.estimate("train", r, cfg, None)
    assert "an earlier run on another machine (nvidia:other)" in before.basis
    _worked(r, "generate", 2 * _bench_generate(cfg["generate"]["concurrency"]))
    after = status.estimate("train", r, cfg, None)
    assert after.seconds == pytest.approx(before.seconds / 2)
    assert after.speed.stage == "generate"


def test_a_streamed_training_says_how_it_got_its_states_and_who_waited(tmp_path):
    r = tmp_path / "results"
    _trained(r, BEST_SHIPPED)
    stats = json.loads((r / "drafter" / "stats.json").read_text())
    stats.update(
        elapsed_s=300.0,
        stream={
            "samples": 40,
            "requests": 10,
            "saved_files": 0,
            "reread_files": 30,
            "cache_files": 10,
            "cache_bytes": 3 << 20,
            "trainer_wait_s": 50.0,
            "feed_wait_s": 120.0,
            "server_idle_s": 140.0,
            "server_start_s": 35.0,
        },
    )
    (r / "drafter" / "stats.json").write_text(json.dumps(stats))
    facts = status.stage_status(_stage("train"), r, _full_config(r), set())["facts"]
    line = _stage("train").line(facts)
    assert (
        "states streamed: 10 prefill requests, 0 saved by generation or an earlier run, "
        "30 read again (cache 10 files, 3.00 MiB)" in line
    ), line
    assert (
        "the trainer waited 15 s of 300 s for states (besides 35 s while the server "
        "started), the server 140 s with no request (the feed 120 s for the trainer)" in line
    ), line
    # the feed timed the trainer's wait during the start: a start in a later epoch, with
    # states already there to train on, was waited for only in part
    stats["stream"]["trainer_wait_start_s"] = 5.0
    (r / "drafter" / "stats.json").write_text(json.dumps(stats))
    facts = status.stage_status(_stage("train"), r, _full_config(r), set())["facts"]
    assert (
        "the trainer waited 45 s of 300 s for states (besides 5 s while the server "
        "started)" in _stage("train").line(facts)
    )
    stats["stream"]["window"] = 34  # the feed's window, named where the feed waited
    (r / "drafter" / "stats.json").write_text(json.dumps(stats))
    facts = status.stage_status(_stage("train"), r, _full_config(r), set())["facts"]
    assert "(the feed 120 s for the trainer, its window of 34 samples full)" in _stage(
        "train"
    ).line(facts)
    stats["stream"]["ranks"] = 4  # data-parallel: each rank's feed, combined
    (r / "drafter" / "stats.json").write_text(json.dumps(stats))
    facts = status.stage_status(_stage("train"), r, _full_config(r), set())["facts"]
    assert (
        "its window of 34 samples full; 4 training ranks, each with a feed of its own: "
        "the longest rank's wait, the shortest's idle time)" in _stage("train").line(facts)
    )
    stats["stream"]["overlap"] = False  # the server and the trainer took turns
    (r / "drafter" / "stats.json").write_text(json.dumps(stats))
    facts = status.stage_status(_stage("train"), r, _full_config(r), set())["facts"]
    assert "full; the two took turns, train.stream_overlap; 4 training ranks" in _stage(
        "train"
    ).line(facts)


def test_streamed_training_is_estimated_with_the_servers_prefill(tmp_path, history):
    """train.data stream: extraction is the held-out split's alone; training adds the
    server's prefill of every epoch (no cache) or of the first (a cache), on the CPU engine
    on top of the training (the same cores)."""
    r = _answered(tmp_path)
    cfg = _full_config(r)
    model = cfg["target"]["model"]
    rates.record("train", model, tokens_per_s=100.0, ttt_steps=cfg["train"]["ttt_steps"])
    rates.record("extract_vllm", model, settings=rates.prefill_settings(cfg), tokens_per_s=50.0)
    rates.record("extract_vllm", model, server_start_s=30.0)
    shards = status.estimate("train", r, cfg, None).seconds
    shard_extract = status.estimate("extract", r, cfg, None).seconds
    stream = {**cfg, "train": {**cfg["train"], "data": "stream"}}
    streamed = status.estimate("train", r, stream, None)
    epochs = cfg["train"]["epochs"]
    assert streamed.seconds == pytest.approx(shards + 30 + epochs * 1000 / 50)
    assert (
        "states streamed: server start + %d tokens of prefill" % (epochs * 1000) in streamed.basis
    )
    cached = {**cfg, "train": {**cfg["train"], "data": "stream", "stream_cache_gib": 4}}
    assert status.estimate("train", r, cached, None).seconds == pytest.approx(
        shards + 30 + 1000 / 50
    )
    assert status.estimate("extract", r, stream, None).seconds == pytest.approx(
        shard_extract - 1000 / 50
    )


def test_a_training_rate_is_read_back_only_at_its_number_of_ranks(history):
    """Training tokens/s of 8 data-parallel ranks is no estimate for one process, nor the other
    way round; a rate recorded before ranks were kept was one process's."""
    one = rates.train_settings({"max_tokens_per_batch": 2048})
    eight = rates.train_settings({"max_tokens_per_batch": 2048}, 8)
    rates.record("train", "embedded:r", settings=eight, tokens_per_s=8000.0, ttt_steps=3)
    assert rates.lookup("train", "tokens_per_s", "embedded:r", settings=one) is None
    assert rates.lookup("train", "tokens_per_s", "embedded:r", settings=eight) == 8000.0
    rates.record(
        "train",
        "embedded:r",
        tokens_per_s=900.0,
        ttt_steps=3,
        settings={"max_tokens_per_batch": 2048, "method": "eagle3"},
    )  # before ranks
    assert rates.lookup("train", "tokens_per_s", "embedded:r", settings=one) == 900.0
    cfg = {"train": {"gpus": 0, "data": "stream"}, "server": {"gpus": 8}}
    assert rates.training_ranks(cfg) == 8  # a rank beside each server GPU
    assert rates.training_ranks({**cfg, "train": {"gpus": 2, "data": "shards"}}) == 2
    assert rates.training_ranks({**cfg, "train": {"gpus": 0, "data": "shards"}}) == 1


def _reference(path, cfg, device="cpu:elsewhere", **rates_by_stage):
    """A reference run's rates file: each stage's rate as eaglet.core.rates.record writes it, at
    this config's settings, measured on ``device``."""
    target = cfg["target"]["model"]
    settings = {
        "generate": rates.generate_settings(cfg),
        "extract_vllm": rates.prefill_settings(cfg),
        "train": rates.train_settings(cfg["train"]),
    }
    keys = {
        "generate": "completion_tokens_per_s",
        "extract_vllm": "tokens_per_s",
        "train": "tokens_per_s",
    }
    lines = []
    for stage, rate in rates_by_stage.items():
        entry = {
            "stage": stage,
            "target": target,
            "device": device,
            "at": "2026-01-01T00:00:00",
            keys[stage]: rate,
            "settings": settings[stage],
        }
        if stage == "train":
            entry["ttt_steps"] = cfg["train"]["ttt_steps"]
        lines.append(json.dumps(entry))
        lines.append(
            json.dumps(
                {
                    "stage": stage,
                    "target": target,
                    "device": device,
                    "at": "2026-01-01T00:00:00",
                    "server_start_s": 30.0,
                }
            )
        )
    path.write_text("\n".join(lines) + "\n")


def test_a_first_run_plans_from_the_reference_run_at_this_machines_speed(
    tmp_path, history, monkeypatch
):
    """A first run has no history; the shipped benchmarks, measured at other times by other
    code, disagreed in their ratios (a fresh demo's generation ran at 2.1x its benchmark, its
    extraction at 4.2x, its training at 1.4x: training planned at extraction's speed read 0.7
    minutes where 5.1 were left). One reference run measured every kind with the same code:
    before anything is measured it plans each stage as it is, and once generation has
    measured this machine, every later stage is planned at the reference times that speed."""
    r = tmp_path / "results"
    cfg = _generated(r)
    reference = tmp_path / "reference.jsonl"
    monkeypatch.setenv("EAGLET_REFERENCE_RATES", str(reference))
    before = status.estimate("train", r, cfg, None)
    _reference(reference, cfg, generate=200.0, extract_vllm=500.0, train=900.0)
    train_tokens = _token_totals(r, cfg)["train"]["tokens"] * cfg["train"]["epochs"]
    first = status.estimate("train", r, cfg, None)
    assert first.seconds == pytest.approx(train_tokens / 900.0)
    assert "the reference demo run (cpu:elsewhere)" in first.basis and first.speed is None
    assert first.seconds != pytest.approx(before.seconds)  # not the benchmarks' plan
    # this machine generates at half the reference's speed: training is planned at half too
    _worked(r, "generate", 100.0)
    rates.record(
        "generate",
        cfg["target"]["model"],
        completion_tokens_per_s=100.0,
        settings=rates.generate_settings(cfg),
    )
    now = status.estimate("train", r, cfg, None)
    assert now.seconds == pytest.approx(train_tokens / 450.0)
    assert "x0.50 this machine's speed from generate's decode" in now.basis
    extract = status.estimate("extract", r, cfg, None)
    assert "the reference demo run" in extract.basis and "x0.50" in extract.basis
    # a reference measured at other settings is none: the benchmarks plan, as before
    other = {**cfg, "train": {**cfg["train"], "max_tokens_per_batch": 99}}
    assert "reference" not in status.estimate("train", r, other, None).basis


def test_a_running_stage_planned_from_another_kind_of_work_trusts_its_own_minute(tmp_path, history):
    """Training planned at extraction's prefill speed (another kind of work) gave way to its
    own rate only at a quarter of its steps: a minute in, 144 of 705 steps done, status read
    0.7 minutes left where its own rate said 3.8 (4.1 in truth). After a minute of its own
    work a stage whose plan rests on no measure of its kind reads its own rate; a plan from
    this machine's history of the same kind still holds until the stage settles."""
    r = tmp_path / "results"
    cfg = _generated(r)
    _worked(r, "extract_vllm", 4 * _extract_benchmark(), elapsed_s=300.0)
    running = {
        "state": "running",
        "done": 144,
        "total": 705,
        "eta_s": 230.0,
        "elapsed_s": 59.0,
        "resumed_from": 0,
    }
    early = status.estimate("train", r, cfg, running)
    assert "less the" in early.basis and "not settled" in early.basis  # under a minute
    got = status.estimate("train", r, cfg, {**running, "elapsed_s": 61.0})
    assert got.seconds == pytest.approx(230.0)
    assert "this run's progress (144/705 done in" in got.basis and "prefill" in got.basis
    # an earlier run's training on this machine: the plan holds until the stage settles
    history.write_text(
        json.dumps(
            {
                "stage": "train",
                "target": cfg["target"]["model"],
                "device": rates.device_kind(),
                "at": "2026-01-01T00:00:00+00:00",
                "tokens_per_s": 300.0,
                "ttt_steps": cfg["train"]["ttt_steps"],
                "settings": rates.train_settings(cfg["train"]),
            }
        )
        + "\n"
    )
    held = status.estimate("train", r, cfg, {**running, "elapsed_s": 61.0})
    assert "an earlier run" in held.basis and "not settled" in held.basis


def test_a_finished_run_has_no_time_left_not_an_unknown_one(tmp_path, history):
    """With every stage completed, status said remaining_s null (unknown), which a poll of a
    finished demo read as an estimate missing; nothing left is 0 seconds."""
    r = tmp_path / "results"
    cfg = _generated(r)
    for stage in status.STAGES:
        for output in stage.outputs:
            (r / output).parent.mkdir(parents=True, exist_ok=True)
            (r / output).touch()
    report = status.collect(r, cfg, None)
    assert all(s["state"] == "completed" for s in report["stages"]), [
        (s["stage"], s["state"]) for s in report["stages"] if s["state"] != "completed"
    ]
    assert report["remaining_s"] == 0
    assert "nothing: the run is complete" in status.render(report)


def test_status_says_when_the_runs_record_is_unreadable_or_another_config_differs(tmp_path):
    """An unreadable run/config.json made status estimate silently from ./config.yaml (42
    minutes said where 5 were left); status given another run's config said nothing of the
    mismatch."""
    from eaglet.core.config import run_config_notes, validate

    r = tmp_path / "results"
    (r / "run").mkdir(parents=True)
    (r / "run" / "config.json").write_text('{"vocab": {"draft_vocab_size": 20')  # torn
    [note] = run_config_notes(r, None, validate({}))
    assert "cannot be read" in note and "the workflow's config.yaml" in note
    (r / "run" / "config.json").write_text(
        json.dumps(validate({"vocab": {"draft_vocab_size": 2048}}))
    )
    assert run_config_notes(r, None, validate({})) == []  # its own record: nothing to say
    other = tmp_path / "other.yaml"
    other.write_text("vocab: {draft_vocab_size: 1024}\n")
    [note] = run_config_notes(r, str(other), validate({"vocab": {"draft_vocab_size": 1024}}))
    assert "other settings than" in note and "vocab.draft_vocab_size: 2048 -> 1024" in note
    assert run_config_notes(r, str(other), validate({"vocab": {"draft_vocab_size": 2048}})) == []


def test_a_finished_evaluation_names_the_baselines_it_could_not_measure(tmp_path):
    (tmp_path / "eval").mkdir()
    verdict = {
        "acceptance_length": 2.5,
        "speedup_by_concurrency": {"1": 1.3},
        "speeds_up_serving": {"1": True},
        "not_measured": {"mtp_k1": "the checkpoint holds no MTP weights"},
    }
    (tmp_path / "eval" / "acceptance.json").write_text(json.dumps({"verdict": verdict}))
    stage = _stage("evaluate")
    assert stage.line(stage.facts(tmp_path)).endswith("; not measured: mtp_k1")
