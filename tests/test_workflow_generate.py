"""End to end through synthetic/train.jsonl with the real vLLM CPU server and SmolLM2.

Generation is interrupted midway with Ctrl-C (SIGINT to snakemake's process group), which
must stop the vLLM server and keep every finished sample; the rerun must answer each
remaining prompt once and regenerate none of the finished ones.
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


def test_generate_is_interrupted_and_resumes_without_regenerating(tmp_path):
    results = tmp_path / "results"
    partial = results / "synthetic" / "train.partial.jsonl"
    with open(tmp_path / "snakemake.out", "w") as out:
        proc = workflow.start(results, "synthetic/train.jsonl", log_file=out)
        try:
            wait_for(lambda: len(partial_lines(partial)) >= 1, 600, "the first sample", proc)
            prompts = read_jsonl(results / "prompts" / "train.jsonl")
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
    records = read_jsonl(results / "synthetic" / "train.jsonl")
    ids = [r["id"] for r in records]
    assert sorted(ids) == sorted(p["id"] for p in prompts)  # each prompt exactly once
    for record in records:
        if record["id"] in before:  # finished samples were kept, not regenerated
            assert record == before[record["id"]]
        assert record["completion_token_ids"] and record["prompt_token_ids"]
    assert "resuming: %d of %d" % (len(before), len(prompts)) in (
        results / "logs" / "generate.log").read_text()

    stats = read_json(results / "synthetic" / "stats.json")
    assert stats["samples"] == len(prompts) and stats["failed"] == 0
    assert stats["this_run"]["resumed_from"] == len(before)
    assert stats["template_check"]["mismatched"] == 0
    assert stats["template_check"]["checked"] == len(prompts)
    # greedy answers end with the end-of-turn token the template closes the turn with
    stopped = [r for r in records if r["finish_reason"] == "stop"]
    assert all(r["completion_token_ids"][-1] == 2 for r in stopped)
