"""prepare_target: settings the target cannot honour stop before generation starts."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from eaglet.target.checkpoint import (
    TargetError,
    check_recorded_target,
    model_identity,
    prepare_target,
)
from tests.helpers.paths import REPO, SNAKEMAKE
from tests.tiny_llama import LAYERS, VOCAB, make_tiny_llama


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
    assert f"extract.aux_layer_ids [1, 2, {LAYERS}]: [{LAYERS}] outside 1..{LAYERS - 1}" in str(
        info.value
    )
    assert not (tmp_path / "target" / "target.json").exists()


def test_aux_layer_id_0_stops_prepare_target_with_the_reason_and_the_fix(model_dir, tmp_path):
    """vLLM's DeepSeek-V2/V3 model adds the residual at a layer's input, and there is none at
    layer 0: id 0 crashes the capture there, so it is refused for every target."""
    with pytest.raises(TargetError) as info:
        prepare_target(str(model_dir), tmp_path / "target", aux_layer_ids=[0, 2, LAYERS - 1])
    message = str(info.value)
    assert f"extract.aux_layer_ids [0, 2, {LAYERS - 1}]" in message
    assert "no residual" in message and "pick ids from 1" in message
    assert not (tmp_path / "target" / "target.json").exists()


def test_settings_that_fit_are_accepted(model_dir, tmp_path):
    info = prepare_target(
        str(model_dir),
        tmp_path / "target",
        draft_vocab_size=VOCAB,
        aux_layer_ids=[1, 2, LAYERS - 1],
    )
    assert info["vocab_size"] == VOCAB and (tmp_path / "target" / "target.json").exists()


@pytest.mark.subprocess
def test_the_dry_run_checks_a_prepared_target_against_changed_settings(model_dir, tmp_path):
    """A run that only changes vocab.draft_vocab_size reruns no prepare_target: the plan
    itself refuses the setting."""
    results = tmp_path / "results"
    info = prepare_target(str(model_dir), results / "target")
    configfile = tmp_path / "config.yaml"
    configfile.write_text(
        yaml.safe_dump(
            {
                "results_dir": str(results),
                "target": {"model": str(model_dir)},
                "vocab": {"draft_vocab_size": VOCAB * 2},
            }
        )
    )
    run = subprocess.run(
        [str(SNAKEMAKE), "-n", "--cores", "1", "--configfile", str(configfile)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0, run.stdout
    assert f"vocab.draft_vocab_size {VOCAB * 2} exceeds" in run.stderr + run.stdout
    assert json.loads((results / "target" / "target.json").read_text()) == info


# -- a multimodal wrapper: the language model's shape lives in text_config -------------------

# Kimi-K2.5's config.json as published: the wrapper's top level has no layers, hidden size or
# vocabulary of its own; the DeepSeek-V3 language model is its text_config.
WRAPPER_CONFIG = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "media_placeholder_token_id": 163605,
    "text_config": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "vocab_size": 163840,
        "kv_lora_rank": 512,
        "first_k_dense_replace": 1,
    },
    "vision_config": {"hidden_size": 1152, "num_hidden_layers": 27},
}


@pytest.fixture
def wrapper_dir(tmp_path) -> Path:
    path = tmp_path / "kimi"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(WRAPPER_CONFIG))
    return path


def test_model_identity_records_the_text_models_shape(wrapper_dir):
    identity = model_identity(wrapper_dir)
    assert (identity["num_hidden_layers"], identity["hidden_size"], identity["vocab_size"]) == (
        61,
        7168,
        163840,
    )
    assert identity["architectures"] == ["KimiK25ForConditionalGeneration"]


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({"draft_vocab_size": 163841}, "vocab.draft_vocab_size 163841 exceeds the vocabulary"),
        ({"aux_layer_ids": [2, 30, 61]}, "[61] outside 1..60, the 61 decoder layers"),
    ],
)
def test_a_wrappers_text_model_bounds_the_settings(wrapper_dir, tmp_path, settings, expected):
    with pytest.raises(TargetError) as info:
        prepare_target(str(wrapper_dir), tmp_path / "target", **settings)
    assert expected in str(info.value)
    info = prepare_target(
        str(wrapper_dir), tmp_path / "target", draft_vocab_size=32000, aux_layer_ids=[2, 30, 58]
    )
    assert info["vocab_size"] == 163840


def test_a_wrappers_target_json_recorded_without_its_shape_is_still_checked(wrapper_dir, tmp_path):
    """A target.json written before the text model's shape was recorded has None there: the
    check reads the target's config.json instead of passing every setting."""
    target_json = tmp_path / "target.json"
    target_json.write_text(
        json.dumps(
            {
                "spec": str(wrapper_dir),
                "path": str(wrapper_dir),
                "num_hidden_layers": None,
                "vocab_size": None,
            }
        )
    )
    with pytest.raises(TargetError, match="163840 tokens"):
        check_recorded_target(target_json, str(wrapper_dir), 200000, None)
    check_recorded_target(target_json, str(wrapper_dir), 32000, [2, 30, 58])


# -- the embedded target's disk check ----------------------------------------------------------

EMBEDDED_SPEC = "embedded:smollm2-135m-instruct"


@pytest.mark.subprocess  # heavy in-process: 6 s
def test_the_embedded_target_checks_the_disk_before_loading_it(tmp_path, monkeypatch):
    """A 200 MB disk failed mid-save ("No space left on device") after a minute of
    dequantizing: the weights the GGUF's parameters make at float32 are checked against the
    free space before anything is loaded or written."""
    import re
    import shutil

    import transformers

    from eaglet.target.checkpoint import find_embedded_gguf

    try:
        find_embedded_gguf(EMBEDDED_SPEC)
    except TargetError as exc:
        pytest.skip(str(exc))

    class Loaded(Exception):
        pass

    def load(*args, **kwargs):
        raise Loaded

    for auto in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        monkeypatch.setattr(auto, "from_pretrained", load)
    free = {"bytes": 200 * 10**6}
    monkeypatch.setattr(
        shutil,
        "disk_usage",
        lambda path: shutil._ntuple_diskusage(10**12, 10**12 - free["bytes"], free["bytes"]),
    )
    with pytest.raises(TargetError) as info:
        prepare_target(EMBEDDED_SPEC, tmp_path / "target")
    message = str(info.value)
    needed = re.search(
        r"about ([\d.]+) MiB to write \((\d+) parameters dequantized to float32", message
    )
    assert needed, message
    # SmolLM2-135M: about 135M parameters, 4 bytes each
    assert 100e6 < int(needed[2]) < 200e6 and float(needed[1]) * 2**20 > 4 * int(needed[2])
    assert "190.73 MiB free on" in message and "point results_dir at a larger disk" in message
    assert not (tmp_path / "target" / "target.json").exists()
    assert not list((tmp_path / "target").glob("*.safetensors"))
    # room enough: the check lets the dequantization start
    free["bytes"] = 10**10
    with pytest.raises(Loaded):
        prepare_target(EMBEDDED_SPEC, tmp_path / "target")


def test_the_embedded_target_is_read_where_the_results_are_now(tmp_path):
    """prepare_target writes the embedded default beside target.json: moved or copied with
    the results, it is read there, not at the absolute path recorded when it was prepared
    (a moved run failed on a missing config.json; a copy read the original's). A local
    directory or a hub snapshot stays where it was recorded."""
    from eaglet.core.io import write_json
    from eaglet.target.checkpoint import read_target

    moved = tmp_path / "moved" / "target"
    moved.mkdir(parents=True)
    write_json(moved / "target.json", {"spec": "embedded:smollm2-135m-instruct", "path": "/old"})
    assert read_target(moved / "target.json")["path"] == str(moved.resolve())
    write_json(moved / "target.json", {"spec": "/models/mine", "path": "/models/mine"})
    assert read_target(moved / "target.json")["path"] == "/models/mine"
