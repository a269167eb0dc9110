"""`eaglet status` estimates and the Snakemake view it asks for (``eaglet.status``)."""

from __future__ import annotations

import json
import os

import pytest

from eaglet import rates, status
from eaglet.progress import Progress


@pytest.fixture
def history(tmp_path, monkeypatch):
    path = tmp_path / "rates.jsonl"
    monkeypatch.setenv("EAGLET_RATES", str(path))
    return path


def test_train_rate_is_scaled_to_this_runs_ttt_steps(history):
    rates.record("train", "embedded:m", tokens_per_s=600.0, ttt_steps=3)
    same, basis_same = status._train_rate("embedded:m", 3)
    more, basis_more = status._train_rate("embedded:m", 6)
    assert same == pytest.approx(600.0) and basis_same == "an earlier run"
    assert more == pytest.approx(300.0) and "scaled to 6" in basis_more


def test_rate_lookup_prefers_the_same_target(history):
    rates.record("train", "embedded:a", tokens_per_s=100.0, ttt_steps=3)
    rates.record("train", "embedded:b", tokens_per_s=900.0, ttt_steps=3)
    assert rates.lookup("train", "tokens_per_s", "embedded:a") == pytest.approx(100.0)
    assert rates.lookup_entry("train", "tokens_per_s", "embedded:b")["ttt_steps"] == 3
    assert status._train_rate("nothing-recorded", 3)[0] == pytest.approx(900.0)  # same device


def test_no_history_no_train_rate(history):
    assert status._train_rate("embedded:m", 3) == (None, "no rate measured yet")


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
    for name, start, end in (("extract_00000", "10:00:00", "10:02:00"),
                             ("extract_00001", "10:00:30", "10:03:10")):
        (r / "progress" / f"{name}.json").write_text(json.dumps({
            "stage": name, "state": "finished", "started_at": f"2026-01-01T{start}+00:00",
            "updated_at": f"2026-01-01T{end}+00:00"}))
    cfg = {"extract": {"gpus": 0}}
    stage = next(s for s in status.STAGES if s.name == "extract")
    assert status.stage_status(stage, r, cfg, set())["took_s"] == pytest.approx(190.0)
    assert "[3m10s]" in status.render(status.collect(r, _full_config(r), None))
    # a shard still running: the stage has not finished, so no duration
    assert status._took([{"state": "running", "started_at": "2026-01-01T10:00:00+00:00",
                          "updated_at": "2026-01-01T10:01:00+00:00"}]) is None


def _full_config(r):
    from eaglet.config import validate
    return validate({"results_dir": str(r)})


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
