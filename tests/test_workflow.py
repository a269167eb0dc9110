"""End to end with the real vLLM CPU server and SmolLM2, on the tiny config.

The tests share one results directory and run in file order, each taking the workflow one
stage further, as a user would: generation (interrupted with Ctrl-C and resumed), then the
vocabulary and the hidden states.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from eaglet.io import read_json, read_jsonl
from eaglet.server import port_is_free
from tests import workflow

pytestmark = pytest.mark.e2e


def wait_for(predicate, timeout: float, what: str, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"snakemake exited ({proc.returncode}) while waiting for {what}")
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def partial_lines(path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def server_port(server_log) -> int:
    for line in server_log.read_text().splitlines():
        if line.startswith("$ ") and "--port" in line:
            args = line.split()
            return int(args[args.index("--port") + 1])
    raise AssertionError("no server command line in the server log")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return tmp_path_factory.mktemp("workflow") / "results"


def test_generate_is_interrupted_and_resumes_without_regenerating(results, tmp_path):
    partial = results / "synthetic" / "generate.partial.jsonl"
    with open(tmp_path / "snakemake.out", "w") as out:
        proc = workflow.start(results, "synthetic/train.jsonl", log_file=out)
        try:
            wait_for(lambda: len(partial_lines(partial)) >= 1, 600, "the first sample", proc)
            prompts = (read_jsonl(results / "prompts" / "train.jsonl")
                       + read_jsonl(results / "prompts" / "eval.jsonl"))
            assert len(partial_lines(partial)) < len(prompts), "finished before the interrupt"
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert not (results / "synthetic" / "train.jsonl").exists()
    port = server_port(results / "logs" / "generate.server.log")
    assert port_is_free(port), "the vLLM server still holds its port after the interrupt"
    progress = read_json(results / "progress" / "generate.json")
    with pytest.raises(ProcessLookupError):
        os.kill(progress["pid"], 0)

    before = {r["id"]: r for r in partial_lines(partial) if "error" not in r}
    assert 1 <= len(before) < len(prompts)

    workflow.run(results, "synthetic/train.jsonl")
    train = read_jsonl(results / "synthetic" / "train.jsonl")
    held_out = read_jsonl(results / "synthetic" / "eval.jsonl")
    records = train + held_out
    ids = [r["id"] for r in records]
    assert sorted(ids) == sorted(p["id"] for p in prompts)  # each prompt exactly once
    assert {r["id"] for r in held_out} == {
        p["id"] for p in read_jsonl(results / "prompts" / "eval.jsonl")}
    for record in records:
        if record["id"] in before:  # finished samples were kept, not regenerated
            assert record == before[record["id"]]
        assert record["completion_token_ids"] and record["prompt_token_ids"]
    assert "resuming: %d of %d" % (len(before), len(prompts)) in (
        results / "logs" / "generate.log").read_text()

    stats = read_json(results / "synthetic" / "stats.json")
    assert sum(s["samples"] for s in stats["splits"].values()) == len(prompts)
    assert all(s["failed"] == 0 for s in stats["splits"].values())
    assert stats["this_run"]["resumed_from"] == len(before)
    assert stats["template_check"]["mismatched"] == 0
    assert stats["template_check"]["checked"] == len(prompts)
    # greedy answers end with the end-of-turn token the template closes the turn with
    stopped = [r for r in records if r["finish_reason"] == "stop"]
    assert all(r["completion_token_ids"][-1] == 2 for r in stopped)


def test_hidden_states_reproduce_the_servers_greedy_tokens(results):
    workflow.run(results, "hidden/manifest.json", "hidden/eval/shard_00000.safetensors")
    manifest = read_json(results / "hidden" / "manifest.json")
    train = read_jsonl(results / "synthetic" / "train.jsonl")
    assert manifest["num_samples"] == len(train)
    assert sorted(s for shard in manifest["shards"] for s in shard["samples"]) == sorted(
        r["id"] for r in train)
    assert manifest["aux_layer_ids"] == [2, 15, 27]  # vLLM's default for 30 layers
    assert manifest["greedy"]
    # HF float32 extraction against vLLM float32 greedy tokens (bf16 storage ties aside)
    assert manifest["teacher_agreement"] >= 0.99
    vocab = read_json(results / "vocab" / "stats.json")
    assert vocab["coverage"] == 1.0  # every completion token fits in the tiny draft vocab
