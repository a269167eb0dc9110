"""train.init_from: a published drafter read in each format a user finds, each written here by
code that knows that format's layout, converted into eaglet's export with the same tensors;
one that does not fit the target refused with the reason."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglet.core import methods as records
from eaglet.core.config import validate
from eaglet.core.methods import default_aux_layer_ids
from eaglet.data.vocab import adopt_vocab_map, load_vocab_map
from eaglet.model import methods, published
from eaglet.model.config import DrafterConfig
from eaglet.model.export import export_speculators
from tests.helpers.paths import HELPERS, REPO, pythonpath_env
from tests.tiny_llama import LAYERS, VOCAB, make_tiny_llama

DRAFT = 40


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny target and an EAGLE-3 drafter for it, exported by eaglet, with random weights
    (a trained drafter's are no different to a reader)."""
    root = tmp_path_factory.mktemp("published")
    target = make_tiny_llama(root / "target")
    config = json.loads((root / "target" / "config.json").read_text())
    ids = torch.arange(0, 2 * DRAFT, 2)
    d2t = ids - torch.arange(DRAFT)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    drafter_config = DrafterConfig.from_target(config, DRAFT, default_aux_layer_ids(LAYERS))
    torch.manual_seed(1)
    model = methods.make_drafter(
        records.EAGLE3.name,
        config,
        drafter_config,
        target.model.embed_tokens.weight.detach(),
        d2t,
        t2d,
    )
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.2)
    methods.export(model.eval(), root / "eaglet")
    return {
        "root": root,
        "target": root / "target",
        "model": model,
        "state": {k: v.clone() for k, v in model.state_dict().items()},
    }


def _plain_config(world) -> dict:
    """The EAGLE authors' / SpecForge's config.json: a Llama config with draft_vocab_size and
    no eagle_config."""
    exported = json.loads((world["root"] / "eaglet" / "config.json").read_text())
    return {k: v for k, v in exported.items() if k != "eagle_config"}


def write_vllm_layout(world, out: Path) -> Path:
    """vLLM's EAGLE-3 names: the layer as ``layers.0.``, everything under ``model.`` (as its
    loader prefixes them), lm_head and d2t at the top."""
    out.mkdir()
    shutil.copy(world["root"] / "eaglet" / "config.json", out)
    weights = load_file(str(world["root"] / "eaglet" / "model.safetensors"))
    renamed = {
        (
            n
            if n in ("lm_head.weight", "d2t", "t2d")
            else "model." + n.replace("midlayer.", "layers.0.")
        ): t
        for n, t in weights.items()
    }
    save_file(renamed, str(out / "model.safetensors"))
    return out


def write_eagle_original(world, out: Path) -> Path:
    """The EAGLE authors' checkpoint: pytorch_model.bin with ``midlayer.`` names, the
    embedding written too, no t2d (derived from d2t)."""
    out.mkdir()
    (out / "config.json").write_text(json.dumps(_plain_config(world)))
    state = {k: v for k, v in world["state"].items() if k != "t2d"}
    state["embed_tokens.weight"] = torch.randn(VOCAB, 64)
    torch.save(state, out / "pytorch_model.bin")
    return out


def write_specforge(world, out: Path) -> Path:
    """SpecForge's output: model.safetensors with the embedding, no eagle_config."""
    out.mkdir()
    (out / "config.json").write_text(json.dumps(_plain_config(world)))
    weights = load_file(str(world["root"] / "eaglet" / "model.safetensors"))
    save_file(
        {**weights, "embed_tokens.weight": torch.randn(VOCAB, 64)}, str(out / "model.safetensors")
    )
    return out


def write_speculators(world, out: Path) -> Path:
    export_speculators(world["root"] / "eaglet", out, str(world["target"]), 3)
    return out


FORMATS = {
    "eaglet": lambda w, out: w["root"] / "eaglet",
    "vllm": write_vllm_layout,
    "speculators": write_speculators,
    "eagle_original": write_eagle_original,
    "specforge": write_specforge,
}


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_format_converts_to_the_same_drafter(world, tmp_path, name):
    source = FORMATS[name](world, tmp_path / name)
    start = published.read(source)
    assert start.method is records.EAGLE3
    assert start.settings()["vocab.draft_vocab_size"] == DRAFT
    record = published.convert(start, world["target"], tmp_path / "out")
    loaded = methods.load(tmp_path / "out", world["target"])
    for tensor_name, want in world["state"].items():
        torch.testing.assert_close(loaded.state_dict()[tensor_name], want, msg=tensor_name)
    assert list(loaded.config.aux_layer_ids) == default_aux_layer_ids(LAYERS)
    assert not record["new"], record  # every tensor of the drafter came from the files
    if name in ("eagle_original", "specforge"):
        assert "embed_tokens.weight" in record["left_out"]  # the target's, which vLLM shares
    if name == "eagle_original":
        assert record["derived"] == ["t2d (from d2t)"]
    if name == "speculators":
        # vLLM reads a speculators config that omits norm_before_residual as true; eaglet's
        # export states it, so the drafter keeps its own residual
        assert start.config["norm_before_residual"] is False


PEER = REPO / "benchmarks" / ".peer"  # make peer-bench-install: speculators, beside eaglet


@pytest.mark.subprocess
@pytest.mark.skipif(
    not (PEER / "speculators").is_dir(), reason="speculators not installed: make peer-bench-install"
)
def test_a_drafter_saved_by_speculators_itself_converts(world, tmp_path):
    """Not a layout written here: speculators' own builder and save_pretrained make the
    drafter (tests/helpers/speculators_drafter.py), as a repository it published holds it.
    Every tensor it saved is the converted drafter's, its norm flag and target layers are
    the run's, and the embedding (the target's, which vLLM shares) is left out."""
    out = tmp_path / "speculators"
    done = subprocess.run(
        [
            sys.executable,
            str(HELPERS / "speculators_drafter.py"),
            str(world["target"]),
            str(out),
            str(DRAFT),
            "1,2,4",
        ],
        env=pythonpath_env(PEER),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "speculators_config" in json.loads((out / "config.json").read_text())
    start = published.read(out)
    assert start.format == "speculators" and start.method is records.EAGLE3
    assert start.settings()["extract.aux_layer_ids"] == [1, 2, 4]
    record = published.convert(start, world["target"], tmp_path / "out")
    assert not record["new"] and record["left_out"] == ["embed_tokens.weight"], record
    loaded = methods.load(tmp_path / "out", world["target"])
    assert list(loaded.config.aux_layer_ids) == [1, 2, 4]
    assert loaded.config.norm_before_residual is True
    state = loaded.state_dict()
    saved = load_file(str(out / "model.safetensors"))
    for name, tensor in saved.items():
        if name != "embed_tokens.weight":
            mine = name.replace("layers.0.", "midlayer.")
            torch.testing.assert_close(state[mine], tensor.to(state[mine].dtype), msg=name)


def test_a_drafter_that_does_not_fit_the_target_is_refused(world, tmp_path):
    other = tmp_path / "other_target"
    shutil.copytree(world["target"], other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(
        json.dumps({**config, "hidden_size": 96, "vocab_size": VOCAB + 5})
    )
    start = published.read(world["root"] / "eaglet")
    with pytest.raises(published.DrafterFormatError, match="hidden_size is 64, the target's 96"):
        published.convert(start, other, tmp_path / "out")
    with pytest.raises(published.DrafterFormatError, match="vocab_size is 300, the target's 305"):
        published.convert(start, other, tmp_path / "out")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(published.DrafterFormatError, match="no config.json"):
        published.read(empty)
    (empty / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (empty / "model.safetensors").write_bytes(b"")
    with pytest.raises(published.DrafterFormatError, match="no EAGLE-3 drafter"):
        published.read(empty)


def test_a_missing_tensor_starts_new_and_is_said(world, tmp_path):
    source = write_specforge(world, tmp_path / "partial")
    weights = load_file(str(source / "model.safetensors"))
    del weights["midlayer.hidden_norm.weight"]
    save_file(weights, str(source / "model.safetensors"))
    record = published.convert(published.read(source), world["target"], tmp_path / "out")
    assert record["new"] == ["midlayer.hidden_norm.weight"]
    assert "midlayer.hidden_norm.weight" not in record["from_drafter"]


def test_the_drafter_decides_the_runs_settings_and_is_served_beside(world, tmp_path):
    cfg = validate(
        {
            "train": {"init_from": str(world["root"] / "eaglet")},
            "vocab": {"draft_vocab_size": 1000},
            "extract": {"aux_layer_ids": [1, 2, 3]},
        }
    )
    notes = published.apply(cfg, "results/start_drafter")
    assert cfg["vocab"]["draft_vocab_size"] == DRAFT
    assert cfg["extract"]["aux_layer_ids"] == default_aux_layer_ids(LAYERS)
    assert cfg["evaluate"]["compare_drafters"] == ["results/start_drafter"]
    assert any(n.startswith("vocab.draft_vocab_size: 1000 -> 40") for n in notes), notes
    assert published.apply(validate({}), "x") == []  # no init_from: nothing changes


def test_the_vocab_stage_adopts_the_drafters_map_and_measures_it(world, tmp_path):
    d2t, t2d = world["state"]["d2t"], world["state"]["t2d"]
    # answers of odd tokens the drafter's (even) vocabulary never proposes, and some even ones
    data = [{"completion_token_ids": [1, 3, 5, 7, 0, 2]}]
    stats = adopt_vocab_map(
        data, d2t, t2d, "drafter", tmp_path / "map.safetensors", tmp_path / "stats.json"
    )
    assert stats["coverage"] == pytest.approx(2 / 6)
    assert stats["coverage_of_a_map_from_this_data"] == 1.0
    got_d2t, got_t2d = load_vocab_map(tmp_path / "map.safetensors")
    assert torch.equal(got_d2t, d2t) and torch.equal(got_t2d, t2d)


def test_a_hub_id_that_cannot_be_reached_says_so(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(published.DrafterFormatError, match="Hugging Face hub"):
        published.read("nobody-here/no-such-drafter")
    with pytest.raises(published.DrafterFormatError, match="no directory there"):
        published.read("./no/such/dir")


def test_a_mistyped_relative_path_is_named_as_a_path_not_a_hub_id(tmp_path, monkeypatch):
    """drafters/mine read as organization/name: the user got the hub's error for a typo in a
    local path. Where "drafters" is a local directory, the path is named, with what it holds."""
    (tmp_path / "drafters" / "my-drafter").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(published.DrafterFormatError, match="its parent holds my-drafter"):
        published.read("drafters/my-drafer")


def test_the_targets_default_layers_stay_unset(world, tmp_path):
    """A drafter reading the target's default aux layers leaves extract.aux_layer_ids unset
    once the target is prepared: set, it would count as a changed setting and redo a finished
    extraction."""
    cfg = validate({"train": {"init_from": str(world["root"] / "eaglet")}})
    published.apply(cfg, "s", world["target"] / "config.json")
    assert cfg["extract"]["aux_layer_ids"] is None
    cfg = validate({"train": {"init_from": str(world["root"] / "eaglet")}})
    published.apply(cfg, "s")  # before the target is prepared: the drafter's, named
    assert cfg["extract"]["aux_layer_ids"] == default_aux_layer_ids(LAYERS)


@pytest.mark.subprocess  # plan asks vLLM in a subprocess
def test_the_plan_of_a_fine_tune_names_its_start(world, tmp_path, capsys):
    """eaglet plan of a run with train.init_from: the drafter it plans is the start's (its
    draft vocabulary), and it says the start's format, parameters and weights to read."""
    from eaglet.tools import plan

    results = tmp_path / "results"
    (results / "target").mkdir(parents=True)
    (results / "target" / "target.json").write_text(json.dumps({"path": str(world["target"])}))
    config = tmp_path / "my.yaml"
    config.write_text(
        f"results_dir: {results}\nvocab: {{draft_vocab_size: 100}}\n"
        f"train: {{init_from: {world['root'] / 'eaglet'}, epochs: 1}}\ntarget: {{dtype: float32}}\n"
    )
    assert plan.main(["--configfile", str(config), "--json"]) == 0
    [p] = json.loads(capsys.readouterr().out)
    start = p["start_drafter"]
    assert start["format"] == "eaglet / vLLM EAGLE-3 layout"
    params = sum(
        t.numel() for t in load_file(str(world["root"] / "eaglet" / "model.safetensors")).values()
    )
    assert start["parameters"] == params
    assert start["bytes"] == (world["root"] / "eaglet" / "model.safetensors").stat().st_size
    # the drafter planned is the start's (its draft vocabulary, not the config's 100)
    assert p["drafter_params"] == sum(t.numel() for t in world["model"].parameters())


def test_damaged_weights_are_named_with_the_file(tmp_path):
    """A cut-short or overwritten weights file: safetensors' header error named no file."""
    from eaglet.target.checkpoint import DamagedWeights, safetensors_tensors

    damaged = tmp_path / "model.safetensors"
    damaged.write_bytes(b"\xff" * 8 + b"not a header")
    with pytest.raises(DamagedWeights, match="model.safetensors is not a readable"):
        safetensors_tensors(damaged)
    with pytest.raises(published.DrafterFormatError, match="model.safetensors cannot be read"):
        published._load_file(damaged)
