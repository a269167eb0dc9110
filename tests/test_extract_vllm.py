"""The vLLM extraction backend against the real engine: vLLM CPU serves the embedded target
with eaglet's capture options, greedy answers come from that server, and the shards the
vLLM backend writes for them must equal the transformers backend's within float tolerance,
row for row, and pass the teacher-agreement check. Also: per-request files are gone once a
shard is packed, and saved requests are not sent again."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch
from safetensors.torch import save_file

from eaglet import shards
from eaglet.config import validate
from eaglet.extract import extract_shard, load_target, resolve_aux_layer_ids, target_identity
from eaglet.extract_vllm import (Extractor, capture_layer_ids, capture_server, extract_shards,
                                 load_head, request_path, shard_jobs)
from eaglet.target import prepare_target

pytestmark = pytest.mark.e2e

PROMPTS = ["Write a Python function that returns the sum of a list.",
           "What is the capital of France? Answer in one sentence.",
           "Count from one to ten in words.",
           "Explain recursion to a child.",
           "Name three primary colors."]


def chat(url: str, prompt: str, max_tokens: int = 24) -> dict:
    body = json.dumps({"model": "target", "temperature": 0, "max_tokens": max_tokens,
                       "return_token_ids": True,
                       "messages": [{"role": "user", "content": prompt}]}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        answer = json.loads(response.read())
    return answer


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Greedy records from the capture server and the shards the vLLM backend packs for them."""
    root = tmp_path_factory.mktemp("vllm_extract")
    info = prepare_target("embedded:smollm2-135m-instruct", root / "target")
    # a small KV reserve: the model is tiny and the machine may be shared
    cfg = validate({"target": {"dtype": "float32", "max_model_len": 1024},
                    "server": {"memory_utilization": 0.25, "enforce_eager": True},
                    "extract": {"backend": "vllm", "dtype": "float32", "max_len": 512,
                                "device": "cpu", "concurrency": 4}})
    head, _ = load_head(info["path"], "float32", "cpu")
    aux = resolve_aux_layer_ids(None, head.num_layers)
    work = root / "work"
    server = capture_server(cfg, info["path"], capture_layer_ids(aux, head.num_layers),
                            work / "requests", root / "server.log")
    with server:
        records = []
        for i, prompt in enumerate(PROMPTS):
            answer = chat(server.url, prompt)
            choice = answer["choices"][0]
            records.append({"id": f"p{i}", "prompt_token_ids": answer["prompt_token_ids"],
                            "completion_token_ids": choice["token_ids"],
                            "sampling": {"temperature": 0.0}})
        jobs = shard_jobs(records, 2, [str(root / "hidden" / f"shard_{i:05d}.safetensors")
                                       for i in range(2)],
                          [str(root / "hidden" / f"shard_{i:05d}.json") for i in range(2)],
                          work, "train")
        metas = extract_shards(cfg, info, jobs, work, root / "server.log", server=server)
    return dict(root=root, info=info, cfg=cfg, records=records, jobs=jobs, metas=metas,
                aux=aux, work=work)


def test_vllm_states_equal_the_transformers_states(run, tmp_path):
    target = load_target(run["info"]["path"], "float32", "cpu")
    ext = {**run["cfg"]["extract"], "backend": "hf"}
    for job in run["jobs"]:
        hf_path = tmp_path / job.shard_path.name
        extract_shard(target, job.records, ext, run["aux"], target_identity(run["info"]), hf_path,
                      hf_path.with_suffix(".json"))
        ours, theirs = shards.load(job.shard_path), shards.load(hf_path)
        assert torch.equal(ours.input_ids, theirs.input_ids)
        assert torch.equal(ours.offsets, theirs.offsets)
        assert torch.equal(ours.loss_mask, theirs.loss_mask)
        assert ours.aux_hidden.shape == theirs.aux_hidden.shape
        for name in ("aux_hidden", "final_hidden"):
            a, b = getattr(ours, name), getattr(theirs, name)
            rel = ((a - b).norm(dim=-1) / b.norm(dim=-1).clamp(min=1e-6)).max()
            assert rel < 1e-3, f"{name}: max relative row error {rel:.2e}"
        assert (ours.teacher_argmax == theirs.teacher_argmax).float().mean() > 0.99


def test_teacher_agrees_with_the_served_greedy_tokens(run):
    for meta in run["metas"]:
        assert meta["backend"] == "vllm"
        assert meta["teacher"]["positions"] > 0
        assert meta["teacher"]["agreement"] >= 0.99


def test_shards_are_moved_into_place_and_request_files_removed(run):
    for job in run["jobs"]:
        assert job.shard_path.exists() and job.meta_path.exists()
        assert not job.staged_path.exists()
        for record in job.records:
            assert not request_path(run["work"] / "requests", record["id"]).exists()


def test_saved_requests_are_not_sent_again(run, tmp_path):
    """States already on disk are read back without a server (this one is not running)."""
    cfg = run["cfg"]
    head, norm = load_head(run["info"]["path"], "float32", "cpu")
    layer_ids = capture_layer_ids(run["aux"], head.num_layers)
    # pack the states of the first shard's samples as request files, as the connector saves them
    shard = shards.load(run["jobs"][0].shard_path)
    extractor = Extractor(cfg, run["info"]["path"], layer_ids, tmp_path, tmp_path / "log", None)
    extractor.norm = norm
    seqs = []
    for s, record in enumerate(run["jobs"][0].records):
        rows = shard.sample(s)
        ids = shard.input_ids[rows]
        seqs.append(ids.tolist())
        fake = torch.randn(len(ids), len(layer_ids), head.hidden_size)
        save_file({"hidden_states": fake, "token_ids": ids},
                  str(request_path(extractor.requests, record["id"])))
    aux_rows, final_rows = extractor.states(head, run["jobs"][0].records, seqs, cfg["extract"],
                                            run["aux"], None)
    assert [len(a) for a in aux_rows] == [len(s) for s in seqs]
    assert not extractor.started
