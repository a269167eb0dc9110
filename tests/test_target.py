"""prepare_target: settings the target cannot honour stop before generation starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eaglet.target import TargetError, prepare_target
from tests.tiny_llama import LAYERS, VOCAB, make_tiny_llama

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = Path(sys.executable).parent / "snakemake"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "model"
    make_tiny_llama(path)
    return path


def test_a_draft_vocab_larger_than_the_targets_stops_prepare_target(model_dir, tmp_path):
    with pytest.raises(TargetError) as info:
        prepare_target(str(model_dir), tmp_path / "target", draft_vocab_size=VOCAB + 1)
    assert f"vocab.draft_vocab_size {VOCAB + 1} exceeds" in str(info.value)
    assert f"at most {VOCAB}" in str(info.value)
    assert not (tmp_path / "target" / "target.json").exists()


def test_aux_layer_ids_past_the_targets_layers_stop_prepare_target(model_dir, tmp_path):
    with pytest.raises(TargetError) as info:
        prepare_target(str(model_dir), tmp_path / "target", aux_layer_ids=[1, 2, LAYERS])
    assert f"extract.aux_layer_ids [1, 2, {LAYERS}]: [{LAYERS}] outside 0..{LAYERS - 1}" in str(info.value)
    assert not (tmp_path / "target" / "target.json").exists()


def test_settings_that_fit_are_accepted(model_dir, tmp_path):
    info = prepare_target(str(model_dir), tmp_path / "target", draft_vocab_size=VOCAB,
                          aux_layer_ids=[0, 2, LAYERS - 1])
    assert info["vocab_size"] == VOCAB and (tmp_path / "target" / "target.json").exists()


def test_the_dry_run_checks_a_prepared_target_against_changed_settings(model_dir, tmp_path):
    """A run that only changes vocab.draft_vocab_size reruns no prepare_target: the plan
    itself refuses the setting."""
    results = tmp_path / "results"
    info = prepare_target(str(model_dir), results / "target")
    configfile = tmp_path / "config.yaml"
    configfile.write_text(yaml.safe_dump({"results_dir": str(results),
                                          "target": {"model": str(model_dir)},
                                          "vocab": {"draft_vocab_size": VOCAB * 2}}))
    run = subprocess.run([str(SNAKEMAKE), "-n", "--cores", "1", "--configfile", str(configfile)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0, run.stdout
    assert f"vocab.draft_vocab_size {VOCAB * 2} exceeds" in run.stderr + run.stdout
    assert json.loads((results / "target" / "target.json").read_text()) == info
