"""benchmarks/gpu_check.py at toy shapes on whatever device there is: every section runs, its
rates are positive and its ratios are the ones its raw numbers give, the extracted shard reads
back, and the script's schema defaults are the ones validation fills in. The script runs on
GPU machines without jsonschema: it must import nothing that needs it."""

from __future__ import annotations

import builtins
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eaglet.core.config import validate
from eaglet.data import shards
from tests.helpers.paths import REPO

SCRIPT = REPO / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict, Path, str]:
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # the compiled variant is left out: it spends a minute compiling on CPU, and its
    # equality with the plain step is tests/test_ttt_loss.py's
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--tiny",
            "--out",
            str(out),
            "--keep-shard",
            "--variants",
            "plain,fused_loss",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads((out / "gpu_check.json").read_text()), out, proc.stdout


def close(a: float, b: float) -> bool:
    return a == pytest.approx(b, rel=1e-9)


@pytest.mark.subprocess
def test_every_section_ran(run):
    result, out, stdout = run
    assert result["errors"] == {} and result["skipped"] == {}
    assert set(result["sections"]) == {"extraction", "train_llama", "train_kimi", "profile", "disk"}
    assert all(result["elapsed_s"][name] > 0 for name in result["sections"])
    assert result["torch"] and result["device"]
    md = (out / "gpu_check.md").read_text()
    assert "| extraction / hooked forward (tiny-llama target, one shard written) | >= 0.85 |" in md
    assert "| fused_loss |" in md and "| category | ms a step | share |" in md
    assert "gpu_check on" in stdout  # timestamped progress lines


@pytest.mark.subprocess
def test_extraction_rates_and_shard(run):
    result, out, _ = run
    ext = result["sections"]["extraction"]
    tokens = ext["tokens"]
    assert tokens == ext["samples"] * ext["sample_len"] > 0
    for kind in (
        "plain_forward",
        "hooked_forward",
        "extraction",
        "shards_in_one_job",
        "extraction_not_overlapped",
    ):
        assert ext[f"{kind}_s"] > 0
        assert close(ext[f"{kind}_tokens_per_s"], tokens / ext[f"{kind}_s"])
    assert close(
        ext["shards_in_one_job_over_forward"],
        ext["shards_in_one_job_tokens_per_s"] / ext["hooked_forward_tokens_per_s"],
    )
    # the same tokens in shards of their own: the shard file's bytes but for the headers
    assert ext["shards_in_one_job"] == 2
    assert abs(ext["shards_in_one_job_bytes"] - ext["shard_bytes"]) < 4096
    assert close(
        ext["extraction_over_forward"],
        ext["extraction_tokens_per_s"] / ext["hooked_forward_tokens_per_s"],
    )
    assert close(
        ext["extraction_over_plain_forward"],
        ext["extraction_tokens_per_s"] / ext["plain_forward_tokens_per_s"],
    )
    assert close(
        ext["extraction_not_overlapped_over_forward"],
        ext["extraction_not_overlapped_tokens_per_s"] / ext["hooked_forward_tokens_per_s"],
    )
    shard = shards.load(out / "gpu_check_shard.safetensors", ext["shard_sha256"])
    assert shard.num_tokens == tokens == ext["shard_tokens_in_file"]
    assert shard.num_samples == ext["samples"]
    assert shard.aux_hidden.shape == (tokens, 3 * ext["hidden"])
    assert shard.aux_layer_ids == ext["aux_layer_ids"]
    assert int(shard.loss_mask.sum()) == ext["samples"] * (ext["sample_len"] - ext["prompt_len"])


@pytest.mark.subprocess
@pytest.mark.parametrize("section", ["train_llama", "train_kimi"])
def test_training_rates(run, section):
    result, _, _ = run
    train = result["sections"][section]
    shape = result["shapes"]["llama" if section == "train_llama" else "kimi"]
    assert (train["hidden"], train["target_vocab"], train["draft_vocab"]) == (
        shape["hidden"],
        shape["vocab"],
        shape["draft_vocab"],
    )
    assert train["ttt_steps"] == 7 and train["tokens_per_step"] > 0 and train["step_s"] > 0
    assert train["step_s"] in train["step_s_all"]
    assert close(train["tokens_per_s"], train["tokens_per_step"] / train["step_s"])
    assert close(
        train["model_tflops_per_s"], train["flops_per_token"] * train["tokens_per_s"] / 1e12
    )
    if train["mfu"] is not None:  # on a GPU
        assert close(
            train["mfu"], train["flops_per_token"] * train["tokens_per_s"] / train["peak_flops"]
        )
    assert all(loss == loss and loss > 0 for loss in train["losses"])  # finite, steps ran
    if section == "train_llama":
        assert close(train["over_naive_anchor"], train["tokens_per_s"] / 17_000)
    # every variant from the same weights over the same batches: the same losses
    variants = train["variants"]
    assert list(variants) == ["plain", "fused_loss"] and train["variant"] == "fused_loss"
    assert variants["fused_loss"]["max_loss_rel_diff"] < 1e-5
    assert close(
        variants["fused_loss"]["over_plain"],
        variants["fused_loss"]["tokens_per_s"] / variants["plain"]["tokens_per_s"],
    )


@pytest.mark.subprocess
def test_profile_accounts_for_the_step(run):
    result, _, _ = run
    p = result["sections"]["profile"]
    assert p["variant"] == "fused_loss" and p["kernels"] > 0
    assert sum(c["share"] for c in p["by_category"].values()) == pytest.approx(1.0)
    assert p["top"] and all(t["ms_per_step"] > 0 for t in p["top"])


@pytest.mark.subprocess
def test_disk_rates(run):
    result, _, _ = run
    d = result["sections"]["disk"]
    assert d["bytes"] >= result["sizes"]["disk_bytes"] * 0.99
    for kind in ("shard", "plain"):
        assert close(
            d[f"{kind}_write_gb_per_s"],
            d[f"{kind}_bytes" if kind == "plain" else "bytes"] / d[f"{kind}_write_s"] / 1e9,
        )
    assert close(d["shard_over_plain"], d["shard_write_gb_per_s"] / d["plain_write_gb_per_s"])


def load_script(name: str = "gpu_check_under_test"):
    spec = importlib.util.spec_from_file_location(name, SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_schema_defaults_match_validation():
    script = load_script()
    defaults = validate({})
    for section in ("extract", "train"):
        assert script.schema_defaults(section) == defaults[section]


def test_imports_without_jsonschema(monkeypatch):
    """The device machine has no jsonschema: the script and what it imports must load
    without it (the eaglet modules are imported afresh under the block)."""
    real = builtins.__import__

    def refuse(name, *args, **kwargs):
        if name.split(".")[0] == "jsonschema":
            raise ImportError("jsonschema is not installed on the device machine")
        return real(name, *args, **kwargs)

    for name in [
        m for m in sys.modules if m == "jsonschema" or m.startswith(("jsonschema.", "eaglet"))
    ]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(builtins, "__import__", refuse)
    assert load_script("gpu_check_without_jsonschema").SECTIONS
