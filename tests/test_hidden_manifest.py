"""The hidden-state manifest says how its states were computed: the backend (hf or vllm), the
engine and its version (transformers' or vLLM's), and how many samples' states generation
captured while answering, so that a person who opens ``hidden/manifest.json`` knows it
without the run's config.

The vllm backend runs here without a server: the request files are written as the capture
connector writes them (generation's hold every token but the last generated one), and the
one prefill request extraction still sends is answered by writing its file."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from eaglet.core.config import validate
from eaglet.core.io import read_json, request_path, write_jsonl
from eaglet.data.shard_format import shard_path
from eaglet.engine import capture
from eaglet.engine.capture import capture_layer_ids
from eaglet.stages.extract import vllm as extract_vllm
from eaglet.stages.extract.hf import run_shard
from eaglet.stages.extract.manifest import build_manifest
from eaglet.target.checkpoint import prepare_target
from eaglet.target.states import installed_version
from tests.tiny_llama import LAYERS, greedy_records, make_tiny_llama, one_thread

AUX = [1, 3, 4]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    model = make_tiny_llama(root / "model", seed=0)
    prepare_target(str(root / "model"), root / "target")
    return SimpleNamespace(
        model=model,
        target_json=root / "target" / "target.json",
        records=greedy_records(model, n=4, seed=0),
    )


def stage_cfg(backend: str) -> dict:
    cfg = validate(
        {
            "extract": {
                "backend": backend,
                "device": "cpu",
                "dtype": "float32",
                "max_len": 64,
                "num_shards": 2,
                "aux_layer_ids": AUX,
            },
            "target": {"dtype": "float32"},
        }
    )
    return {section: cfg[section] for section in ("extract", "target", "server", "generate")}


@torch.inference_mode()
def saved_states(model, ids: list[int]) -> torch.Tensor:
    """What the capture connector saves for ``ids``: [tokens, layers, H], the aux layers'
    inputs and the last layer's output before the final norm."""
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda m, a, o: captured.__setitem__("L", o[0] if isinstance(o, tuple) else o)
    )
    try:
        out = model.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    finally:
        hook.remove()
    layers = [out.hidden_states[i][0] for i in dict.fromkeys(AUX)] + [captured["L"][0]]
    assert len(layers) == len(capture_layer_ids(AUX, LAYERS))
    return torch.stack(layers, dim=1)


def write_request(model, path, ids: list[int]) -> None:
    save_file(
        {"hidden_states": saved_states(model, ids), "token_ids": torch.tensor(ids)}, str(path)
    )


def test_the_manifest_of_hf_shards_names_transformers_and_its_version(tiny, tmp_path):
    data = tmp_path / "train.jsonl"
    write_jsonl(data, tiny.records)
    cfg = stage_cfg("hf")
    for i in range(2):
        run_shard(
            cfg,
            str(tiny.target_json),
            str(data),
            i,
            2,
            str(shard_path(tmp_path, i)),
            str(shard_path(tmp_path, i).with_suffix(".json")),
        )
    manifest = build_manifest(
        cfg, str(tiny.target_json), str(data), 2, str(tmp_path), str(tmp_path / "manifest.json")
    )
    assert installed_version("transformers")
    assert manifest["computed_by"] == [
        {
            "backend": "hf",
            "engine": "transformers",
            "engine_version": installed_version("transformers"),
            "shards": 2,
            "samples": 4,
            "samples_captured_during_generation": 0,
        }
    ]


def test_the_manifest_of_vllm_shards_counts_the_states_generation_captured(
    tiny, tmp_path, monkeypatch
):
    """Generation captured three samples' states; the fourth sample's file is missing, so
    extraction sends it as a prefill request: three captured, four computed by vLLM."""
    records = [{**r, "hidden_states": "saved"} for r in tiny.records]
    work = tmp_path / "hidden" / "vllm"
    requests = work / "requests"
    requests.mkdir(parents=True)
    for record in records[:3]:  # as generation saved them: all but the last generated token
        ids = record["prompt_token_ids"] + record["completion_token_ids"]
        write_request(tiny.model, request_path(requests, record["id"]), ids[:-1])

    async def prefill_each(
        url, work_items, concurrency, timeout, max_retries, after, health_check=None
    ):
        for i, (ids, path) in enumerate(work_items):  # what the server's connector writes
            write_request(tiny.model, path, ids)
            await after(i)

    monkeypatch.setattr(capture, "prefill_each", prefill_each)
    monkeypatch.setattr(capture.Extractor, "ensure_server", lambda self: None)
    data = tmp_path / "train.jsonl"
    write_jsonl(data, records)
    hidden = tmp_path / "hidden"
    paths = [shard_path(hidden, i) for i in range(2)]
    jobs = extract_vllm.staged_shards(
        records,
        2,
        [str(p) for p in paths],
        [str(p.with_suffix(".json")) for p in paths],
        work,
        "train",
    )
    cfg = stage_cfg("vllm")
    info = read_json(tiny.target_json)
    metas = extract_vllm.capture_shards(cfg, info, jobs, work, tmp_path / "server.log")
    assert [m["captured_during_generation"] for m in metas] == [2, 1]
    assert all(m["engine"] == {"name": "vllm", "version": installed_version("vllm")} for m in metas)

    manifest = build_manifest(
        cfg, str(tiny.target_json), str(data), 2, str(hidden), str(hidden / "manifest.json")
    )
    assert manifest["teacher_agreement"] == 1.0  # the served states are the target's
    assert manifest["computed_by"] == [
        {
            "backend": "vllm",
            "engine": "vllm",
            "engine_version": installed_version("vllm"),
            "shards": 2,
            "samples": 4,
            "samples_captured_during_generation": 3,
        }
    ]


def test_a_shard_from_before_the_engine_was_recorded_counts_with_no_version():
    from eaglet.stages.extract.manifest import computed_by

    old = {"backend": "vllm", "num_samples": 5}
    new = {
        "backend": "vllm",
        "num_samples": 2,
        "captured_during_generation": 2,
        "engine": {"name": "vllm", "version": "0.32.0"},
    }
    assert computed_by([old, new, dict(new)]) == [
        {
            "backend": "vllm",
            "engine": "vllm",
            "engine_version": None,
            "shards": 1,
            "samples": 5,
            "samples_captured_during_generation": 0,
        },
        {
            "backend": "vllm",
            "engine": "vllm",
            "engine_version": "0.32.0",
            "shards": 2,
            "samples": 4,
            "samples_captured_during_generation": 4,
        },
    ]
