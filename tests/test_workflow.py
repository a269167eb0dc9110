"""End to end with the real vLLM CPU server and SmolLM2, on the tiny config.

The tests share one results directory and run in file order, each taking the workflow one
stage further, as a user would: generation (interrupted with Ctrl-C and resumed), then the
vocabulary and the hidden states (vLLM prefill, the default backend, checked row for row against
the transformers backend), training and evaluation (vLLM loads the exported drafter); last,
generation once more with the hidden states captured by vLLM as it generates
(generate.capture_hidden_states), streamed into training (train.data stream).
"""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import shutil
import signal
import time
from html import unescape

import pytest
import torch
from safetensors.torch import load_file

from eaglet.core.config import load_run_config
from eaglet.core.io import read_json, read_jsonl
from eaglet.data import shards
from eaglet.engine.server import port_is_free
from eaglet.stages.extract.hf import extract_shard, load_target
from eaglet.target.checkpoint import read_target
from eaglet.target.states import target_identity
from eaglet.tools import status as eaglet_status
from tests import workflow

pytestmark = pytest.mark.e2e


def wait_for(predicate, timeout: float, what: str, proc=None, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"snakemake exited ({proc.returncode}) while waiting for {what}")
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def status(results, config: str | None = str(workflow.TINY)) -> dict[str, dict]:
    """`eaglet status` of the run, stage by stage (Snakemake's view included); with
    ``config=None`` from the config the run recorded, as `eaglet status --results` does."""
    cfg = load_run_config(results, config, workflow.REPO)
    report = eaglet_status.collect(
        results, cfg, workflow.REPO, eaglet_status.snakemake_config_args(results, config)
    )
    text = eaglet_status.render(report)  # renders at every point of a run, naming each stage
    assert text.startswith(f"eaglet status of {results}"), text[:200]
    for s in report["stages"]:
        if s["state"] in ("completed", "pending", "failed"):
            assert f" {s['stage']} " in text, (s["stage"], text)
    return {s["stage"]: s for s in report["stages"]}


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
    fresh = status(results)
    assert {s["state"] for s in fresh.values()} == {"pending"}
    with open(tmp_path / "snakemake.out", "w") as out:
        proc = workflow.start(results, "synthetic/train.jsonl", log_file=out)
        try:
            # status while the server loads (slow: it runs a Snakemake dry run, long enough
            # for the whole tiny generation to finish if it were asked after the first sample)
            progress_file = results / "progress" / "generate.json"
            wait_for(progress_file.exists, 600, "the generate stage to start", proc)
            prompts = read_jsonl(results / "prompts" / "train.jsonl") + read_jsonl(
                results / "prompts" / "eval.jsonl"
            )
            # the ShareGPT source trains on its recorded answers: the target answers the rest
            asked = [p for p in prompts if "answer" not in p]
            assert 0 < len(asked) < len(prompts)
            mid = status(results)
            assert mid["prepare_prompts"]["state"] == "completed"
            assert mid["generate"]["state"] == "running"
            running = mid["generate"]["progress"][0]
            assert running["total"] == len(asked) and running["pid"] > 0
            if running["phase"] is None:  # the dry run outlasted the server's start
                assert "server ready" in (results / "logs" / "generate.log").read_text()
            else:
                assert running["phase"] == "starting the vLLM server" and running["done"] == 0
            wait_for(
                lambda: len(partial_lines(partial)) >= 1, 600, "the first sample", proc, poll_s=0.1
            )
            assert len(partial_lines(partial)) < len(asked), "finished before the interrupt"
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

    assert status(results)["generate"]["state"] == "interrupted"

    before = {r["id"]: r for r in partial_lines(partial) if "error" not in r}
    assert 1 <= len(before) < len(asked)

    workflow.run(results, "synthetic/train.jsonl")
    train = read_jsonl(results / "synthetic" / "train.jsonl")
    held_out = read_jsonl(results / "synthetic" / "eval.jsonl")
    records = train + held_out
    ids = [r["id"] for r in records]
    assert sorted(ids) == sorted(p["id"] for p in prompts)  # each prompt exactly once
    assert {r["id"] for r in held_out} == {
        p["id"] for p in read_jsonl(results / "prompts" / "eval.jsonl")
    }
    for record in records:
        if record["id"] in before:  # finished samples were kept, not regenerated
            assert record == before[record["id"]]
        assert record["completion_token_ids"] and record["prompt_token_ids"]
    assert (
        "resuming: %d of %d" % (len(before), len(asked))
        in (results / "logs" / "generate.log").read_text()
    )

    stats = read_json(results / "synthetic" / "stats.json")
    assert sum(s["samples"] for s in stats["splits"].values()) == len(prompts)
    assert all(s["failed"] == 0 for s in stats["splits"].values())
    assert stats["this_run"]["resumed_from"] == len(before)
    assert stats["template_check"]["mismatched"] == 0
    assert stats["template_check"]["checked"] == len(prompts)
    recorded = [r for r in records if r["model"] == "dataset"]
    assert stats["dataset_answers"] == len(recorded) == len(prompts) - len(asked)
    assert {r["id"] for r in recorded} <= {r["id"] for r in train}  # held-out: the target's
    # greedy answers end with the end-of-turn token the template closes the turn with
    stopped = [r for r in records if r["finish_reason"] == "stop"]
    assert all(r["completion_token_ids"][-1] == 2 for r in stopped)


def test_hidden_states_reproduce_the_servers_greedy_tokens(results, tmp_path):
    workflow.run(
        results,
        "hidden/manifest.json",
        "hidden/eval/shard_00000.safetensors",
        "vocab/vocab_map.safetensors",
    )
    manifest = read_json(results / "hidden" / "manifest.json")
    train = read_jsonl(results / "synthetic" / "train.jsonl")
    assert manifest["num_samples"] == len(train)
    assert sorted(s for shard in manifest["shards"] for s in shard["samples"]) == sorted(
        r["id"] for r in train
    )
    assert manifest["aux_layer_ids"] == [2, 15, 27]  # vLLM's default for 30 layers
    assert manifest["greedy"]
    # vLLM's prefill states against its own greedy tokens (bf16 storage ties aside)
    assert manifest["teacher_agreement"] >= 0.99
    for shard in manifest["shards"]:  # the default backend: one server wrote every shard
        assert (
            read_json(results / "hidden" / shard["file"].replace(".safetensors", ".json"))[
                "backend"
            ]
            == "vllm"
        )
    vocab = read_json(results / "vocab" / "stats.json")
    assert vocab["coverage"] == 1.0  # every completion token fits in the tiny draft vocab

    # vLLM's prefill states equal the transformers backend's, row for row (the tiny config
    # stores float32): the captured layers, their order and the final norm are the ones the
    # drafter is trained on
    cfg = load_run_config(results, str(workflow.TINY), workflow.REPO)
    info = read_target(results / "target" / "target.json")
    target = load_target(info["path"], "float32", "cpu")
    by_id = {r["id"]: r for r in train}
    shard = manifest["shards"][0]
    ours = shards.load(results / "hidden" / shard["file"])
    hf_path = tmp_path / "hf.safetensors"
    extract_shard(
        target,
        [by_id[i] for i in shard["samples"]],
        {**cfg["extract"], "backend": "hf"},
        manifest["aux_layer_ids"],
        target_identity(info),
        hf_path,
        tmp_path / "hf.json",
    )
    theirs = shards.load(hf_path)
    for name in ("input_ids", "offsets", "loss_mask"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    for name in ("aux_hidden", "final_hidden"):
        a, b = getattr(ours, name).float(), getattr(theirs, name).float()
        assert a.shape == b.shape, name
        rel = ((a - b).norm(dim=-1) / b.norm(dim=-1).clamp(min=1e-6)).max()
        assert rel < 1e-3, f"{name}: max relative row error {rel:.2e}"
    assert (ours.teacher_argmax == theirs.teacher_argmax).float().mean() > 0.99

    after = status(results)
    assert after["extract"]["state"] == "completed"
    assert after["extract"]["facts"]["teacher_agreement"] == manifest["teacher_agreement"]
    assert after["train"]["state"] == "pending"


def report_first_page(page: str) -> str:
    """The text of a Snakemake report's first page: the workflow description, which the
    report keeps rendered to HTML in a JSON string of its script (``var workflow_desc =
    "...";``), tags dropped, entities decoded (docutils writes ``"`` as ``&quot;``) and
    whitespace collapsed."""
    match = re.search(r"var workflow_desc = (.*?);\n", page)
    assert match, "the report has no first page (workflow_desc)"
    return " ".join(unescape(re.sub(r"<[^>]+>", " ", json.loads(match.group(1)))).split())


def test_trained_drafter_is_measured_in_vllm_and_reported(results, tmp_path):
    workflow.run(results, "eval/acceptance.json", "eval/training_curves.png")
    manifest = read_json(results / "hidden" / "manifest.json")
    drafter = read_json(results / "drafter" / "config.json")
    assert drafter["architectures"] == ["LlamaForCausalLMEagle3"]
    assert drafter["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == manifest["aux_layer_ids"]
    assert drafter["draft_vocab_size"] == 2048 and drafter["vocab_size"] == 49152

    # vLLM loaded the export as an EAGLE-3 drafter sharing the target's embedding
    served = (results / "logs" / "evaluate.eagle3_k3.server.log").read_text()
    assert "Resolved architecture: LlamaForCausalLMEagle3" in served
    assert "without its own embed_tokens" in served

    acceptance = read_json(results / "eval" / "acceptance.json")
    runs = {r["name"]: r for r in acceptance["runs"]}
    # the schedule run follows only when the sweep chose different k at different levels
    assert set(runs) - {"eagle3_schedule"} == {"baseline", "ngram_k3", "eagle3_k3"}
    assert runs["baseline"]["drafts"] == 0
    # every run measured both prompt sets at both concurrencies through its one server
    assert set(acceptance["prompt_sets"]) == {"heldout", "everyday"}
    base_levels = {(lv["set"], lv["concurrency"]): lv for lv in runs["baseline"]["levels"]}
    assert set(base_levels) == {(s, c) for s in ("heldout", "everyday") for c in (1, 4)}
    assert base_levels[("everyday", 1)]["requests"] == 2  # rounds x concurrency
    assert base_levels[("everyday", 4)]["requests"] == 4  # capped at the set's 4 prompts
    # the stage wrote its plan of work into its progress file (what `eaglet status` reads),
    # and it is what the stage did
    plan = read_json(results / "progress" / "evaluate.json")["plan"]
    assert plan["engine_runs"] == 3 and plan["schedule_check"] == ("eagle3_schedule" in runs)
    assert plan["prompt_sets"]["everyday"] == 4
    for c in (1, 4):
        sent = sum(lv["requests"] for lv in base_levels.values() if lv["concurrency"] == c)
        assert plan["requests"][str(c)] == sent
    for name in set(runs) - {"baseline"}:
        run = runs[name]
        assert run["drafts"] > 0 and run["draft_tokens"] <= run["k"] * run["drafts"]
        # AL = 1 + sum of the per-position rates, for every run and every prompt set
        assert run["acceptance_length"] == pytest.approx(1 + sum(run["per_position_rate"]))
        for per_set in run["sets"].values():
            assert per_set["acceptance_length"] == pytest.approx(
                1 + sum(per_set["per_position_rate"])
            )
        assert sum(lv["drafts"] for lv in run["levels"]) == run["drafts"]
        # over the target alone measured beside it: the sweep's, or the schedule check's own
        refs = (
            {(lv["set"], lv["concurrency"]): lv for lv in run["baseline_levels"]}
            if "baseline_levels" in run
            else base_levels
        )
        for lv in run["levels"]:
            ref = refs[(lv["set"], lv["concurrency"])]
            assert lv["speedup"] == pytest.approx(
                (lv["output_tokens"] / lv["wall_s"]) / (ref["output_tokens"] / ref["wall_s"])
            )
    # the offline PyTorch replay agrees with vLLM: export, layer ids and d2t are right
    offline = acceptance["offline"]["eagle3_k3"]
    assert offline["ratio_offline_over_vllm"] == pytest.approx(1.0, abs=0.05)
    verdict = acceptance["verdict"]
    assert set(verdict["speeds_up_serving"]) == {"1", "4"} and "summary" in verdict
    # serve.json is what the sweep chose, checked in vLLM at every concurrency
    serve = read_json(results / "eval" / "serve.json")
    assert serve == acceptance["serve"]
    chosen = {e["concurrency"]: e["k"] for e in verdict["best_k_by_concurrency"]}
    assert {e["concurrency"]: e["k"] for e in serve["by_concurrency"]} == chosen
    if len(set(chosen.values())) > 1:
        assert serve["checked_by"] == "eagle3_schedule"
        schedule = serve["speculative_config"]["num_speculative_tokens_per_batch_size"]
        assert schedule[0][:2] == [1, 2] and schedule[0][2] == chosen[1]
    elif chosen[1]:
        assert serve["checked_by"] == f"eagle3_k{chosen[1]}"
    else:
        assert serve["speculative_config"] is None

    finished = status(results)
    assert all(s["state"] == "completed" for s in finished.values()), finished
    # how the server starts and stops, and how the stages go (requests at once, timeouts,
    # logging, checkpoints: core.config.RUN_ONLY), change no output: nothing reruns (the
    # params Snakemake recorded are checked, which a touched tree would not have)
    overlay = tmp_path / "server.yaml"
    overlay.write_text(
        "server: {startup_timeout_s: 7200, kv_cache_gib: 1}\n"
        "generate: {concurrency: 2, request_timeout_s: 99, max_retries: 1}\n"
        "train: {log_every: 3, checkpoint_every: 7, keep_checkpoints: 1}\n"
        "evaluate: {request_timeout_s: 99}\n"
    )
    proc = workflow.run(results, extra=("-n",), configs=(overlay,))
    assert "Nothing to be done" in proc.stdout + proc.stderr, proc.stdout[-3000:]
    # judged against the config the run recorded, nothing is outdated either
    recorded = status(results, config=None)
    assert all(s["state"] == "completed" for s in recorded.values()), recorded
    assert finished["evaluate"]["facts"]["acceptance_length"] == pytest.approx(
        runs["eagle3_k3"]["acceptance_length"]
    )

    # figures are redrawn from the results alone, without running a model again
    (results / "eval" / "per_position.png").unlink()
    proc = workflow.run(results, "eval/per_position.png")
    assert (results / "eval" / "per_position.png").stat().st_size > 0
    assert "rule evaluate" not in proc.stdout + proc.stderr
    assert "rule train" not in proc.stdout + proc.stderr

    report = results / "report.html"
    workflow.run(results, extra=("--report", str(report)))
    html = report.read_text(errors="replace")
    assert "acceptance.json" in html and "training_curves.png" in html
    # the first page opens on this run's verdict, word for word, and holds the command that
    # serves the drafter as serve.json says (eaglet.tools.report_page)
    first_page = report_first_page(html)
    assert first_page.startswith("Verdict on the drafter for "), first_page[:300]
    for sentence in [verdict["summary"], *verdict["warnings"]]:
        assert " ".join(sentence.split()) in first_page, (sentence, first_page[:3000])
    served = shlex.join(
        ["--model", read_target(results / "target" / "target.json")["path"], *serve["vllm_args"]]
    )
    assert served in first_page, (served, first_page[:3000])


def test_a_finished_run_copied_elsewhere_reruns_nothing_and_reads_its_own_target(results, tmp_path):
    """A results directory moved or copied (to larger storage, off a cluster's scratch) is
    still the run: nothing reruns, and it reads the target it holds (the embedded default's,
    under target/), not the original's, whose absolute path target.json recorded."""
    from eaglet.stages.evaluate.placement import recorded_target_dir

    copy = tmp_path / "elsewhere" / "results"
    try:  # hard links: the same bytes and times, no copy of a run's states
        shutil.copytree(results, copy, copy_function=os.link)
    except OSError:
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(results, copy)
    proc = workflow.run(copy, extra=("-n",))
    assert "Nothing to be done" in proc.stdout + proc.stderr, proc.stdout[-3000:]
    target = read_target(copy / "target" / "target.json")
    assert target["path"] == str((copy / "target").resolve())
    assert read_json(copy / "target" / "target.json")["path"] == str((results / "target").resolve())
    assert recorded_target_dir(copy, target["spec"]) == target["path"]


def test_a_dflash_drafter_trains_and_is_served_beside_eagle3(results, tmp_path):
    """train.method dflash on the same shards, in a results dir of its own (the finished
    run's data linked, as docs/training.md says to compare methods): the export loads in vLLM as
    its DFlash drafter (the mask embedding read), is served with method dflash beside the
    first run's EAGLE-3 drafter in one evaluation (evaluate.compare_drafters), and eaglet's
    offline replay of its one forward a round counts what vLLM counted. Two layers: vLLM's
    CPU kernel normalizes the keys of a second layer wrongly unless eaglet's plugin fixes it
    in the engine's worker, and the replay would then disagree."""
    dflash = results.parent / "dflash"
    dflash.mkdir()
    for part in results.iterdir():
        if part.name in ("drafter", "drafter_checkpoints", "eval", "logs", "run"):
            continue
        if part.is_dir():
            shutil.copytree(part, dflash / part.name, copy_function=os.link)
    overlay = tmp_path / "dflash.yaml"
    # DFlash learns more slowly than EAGLE-3 from few steps: 12 epochs (36 steps) so that it
    # accepts some drafts and the replay's agreement is about drafts that matter
    overlay.write_text(
        f"train:\n  method: dflash\n  dflash_layers: 2\n  epochs: 12\n"
        f"  lr: 3.0e-3\n"
        f"evaluate:\n  ngram: false\n  schedule: false\n"
        f"  compare_drafters: [{results / 'drafter'}]\n"
    )
    proc = workflow.run(
        dflash,
        "eval/acceptance.json",
        configs=(overlay,),
        extra=("--rerun-triggers", "mtime"),
        timeout=1800,
    )
    ran = proc.stdout + proc.stderr
    assert "rule train" in ran and "rule extract" not in ran and "rule generate" not in ran
    drafter = read_json(dflash / "drafter" / "config.json")
    assert drafter["architectures"] == ["DFlashDraftModel"] and drafter["num_hidden_layers"] == 2
    assert drafter["block_size"] == 4  # train.ttt_steps 3 masked slots after the bonus token
    served = (dflash / "logs" / "evaluate.dflash_k3.server.log").read_text()
    assert "Loaded DFlash mask embedding" in served
    # loaded whole: no warning about its weights or the K/V buffers load_weights builds
    assert not [
        line
        for line in served.splitlines()
        if "WARNING" in line and ("weight" in line.lower() or "DFlash" in line)
    ], served[-3000:]
    assert "wrapped vllm._custom_ops.rms_norm" in served  # the worker's grouped norm fixed
    acceptance = read_json(dflash / "eval" / "acceptance.json")
    runs = {r["name"]: r for r in acceptance["runs"]}
    assert set(runs) == {"baseline", "dflash_k3", "eagle3_k3"}
    assert runs["dflash_k3"]["method"] == "dflash" and runs["dflash_k3"]["drafts"] > 0
    assert runs["eagle3_k3"]["compare"]
    assert acceptance["verdict"]["method"] == "dflash"  # the run's own drafter is judged
    table = {row["name"]: row for row in acceptance["methods"]}
    assert table["dflash_k3"]["kind"] == "DFlash, 2 layers" and table["eagle3_k3"]["compared"]
    for name in ("dflash_k3", "eagle3_k3"):
        row = table[name]
        assert row["acceptance_length"] == pytest.approx(1 + sum(row["per_position_rate"]))
        # the replay of each drafter's own drafting agrees with vLLM's counters
        assert acceptance["offline"][name]["ratio_offline_over_vllm"] == pytest.approx(
            1.0, abs=0.01
        )
    assert acceptance["offline"]["dflash_k3"]["acceptance_length"] > 1.0  # it drafts something
    assert status(dflash, str(workflow.TINY))["train"]["facts"]["method"] == "dflash"


def test_a_published_drafter_is_fine_tuned_and_served_beside_its_start(results, tmp_path):
    """train.init_from: the first run's exported drafter, as a user would start from a
    published one, fine-tuned on the same data in a results dir of its own: the start is
    converted (every tensor from it, none new), its vocabulary map is the run's, training
    starts from its weights (step 0's held-out AL is the start's, not a random drafter's),
    and the evaluation serves it as published (start_k3) beside the fine-tune (eagle3_k3)."""
    tuned = results.parent / "tuned"
    tuned.mkdir()
    for part in results.iterdir():
        if part.name in ("drafter", "drafter_checkpoints", "eval", "logs", "run", "vocab"):
            continue
        if part.is_dir():
            shutil.copytree(part, tuned / part.name, copy_function=os.link)
    overlay = tmp_path / "tuned.yaml"
    overlay.write_text(
        f"train:\n  init_from: {results / 'drafter'}\n  epochs: 1\n"
        f"evaluate:\n  ngram: false\n  schedule: false\n  offline: false\n"
    )
    proc = workflow.run(
        tuned,
        "eval/acceptance.json",
        configs=(overlay,),
        extra=("--rerun-triggers", "mtime"),
        timeout=1800,
    )
    ran = proc.stdout + proc.stderr
    assert "rule start_drafter" in ran and not re.search(r"\brule extract", ran), ran[-3000:]
    record = read_json(tuned / "start_drafter" / "start.json")
    assert record["format"] == "eaglet / vLLM EAGLE-3 layout" and not record["new"]
    start_map = load_file(str(results / "drafter" / "model.safetensors"))
    tuned_map = load_file(str(tuned / "vocab" / "vocab_map.safetensors"))
    assert torch.equal(tuned_map["t2d"], start_map["t2d"].to(torch.bool))
    vocab = read_json(tuned / "vocab" / "stats.json")
    assert vocab["from"] == str(results / "drafter") and vocab["coverage"] > 0
    # training started from the drafter: its step-0 held-out row is the start's quality,
    # the first run's shipped held-out AL on the same held-out shards
    first = read_json(results / "drafter" / "stats.json")
    rows = list(csv.DictReader((tuned / "drafter" / "training_log.csv").open()))
    step0 = next(r for r in rows if r["split"] == "eval")
    assert int(step0["step"]) == 0
    assert float(step0["sim_al"]) == pytest.approx(first["shipped"]["heldout_al"], rel=1e-3)
    log = (tuned / "logs" / "train.log").read_text()
    assert "fine-tuning the drafter of" in log and "0 tensors" not in log
    stats = read_json(tuned / "drafter" / "stats.json")
    assert stats["layer_init"]["setting"] == "init_from"
    acceptance = read_json(tuned / "eval" / "acceptance.json")
    runs = {r["name"]: r for r in acceptance["runs"]}
    assert set(runs) == {"baseline", "eagle3_k3", "start_k3"}
    assert runs["start_k3"]["compare"] and runs["start_k3"]["drafts"] > 0
    table = {row["name"]: row for row in acceptance["methods"]}
    assert table["start_k3"]["kind"] == "EAGLE-3, as published"


def test_states_captured_while_generating_stream_into_training_like_the_extracted_ones(
    results, tmp_path
):
    """generate.capture_hidden_states with train.data stream: generation runs again on a
    server with the capture options (the recorded answers, never generated, sent to it as
    prefill requests); extraction packs the held-out split's states alone, and the training
    job trains on the training samples' as generation saved them (the first epoch, no request)
    and as its own capture server computes them again (the later epochs: no cache). No
    training shard is written; the drafter is as good as the one trained on the shards of the
    prefill extraction after generation."""
    before_manifest = read_json(results / "hidden" / "manifest.json")
    before_train = status(results)["train"]["facts"]
    overlay = tmp_path / "fused.yaml"
    overlay.write_text(
        "generate:\n  capture_hidden_states: true\nextract:\n  backend: vllm\n"
        "train:\n  data: stream\n"
    )
    proc = workflow.run(results, "drafter/model.safetensors", configs=(overlay,), timeout=1800)
    assert "rule generate" in proc.stdout + proc.stderr  # the samples are made again, captured
    extract_log = (results / "logs" / "extract" / "vllm.log").read_text()
    assert "1 shards" in extract_log  # the held-out split's alone
    # every sample's states came from the generation server: the generated answers' as they
    # were generated, the recorded answers' (answers: dataset, never generated) from prefill
    # requests to that same server; extraction only packed them and loaded no target
    recorded = sum(
        r["model"] == "dataset"
        for split in ("train", "eval")
        for r in read_jsonl(results / "synthetic" / f"{split}.jsonl")
    )
    assert (
        recorded
        and f"prefilling {recorded} recorded answers on the capturing server"
        in (results / "logs" / "generate.log").read_text()
    )
    assert "no saved states" not in extract_log and "starting server" not in extract_log
    manifest = read_json(results / "hidden" / "manifest.json")
    assert manifest["num_shards"] == 0 and len(manifest["eval_shards"]) == 1
    stats = read_json(results / "drafter" / "stats.json")
    stream = stats["stream"]
    n = len(read_jsonl(results / "synthetic" / "train.jsonl"))
    epochs = load_run_config(results, str(workflow.TINY), workflow.REPO)["train"]["epochs"]
    # the first epoch on generation's files; the later ones asked the real server again
    assert stream["saved_files"] == n and stream["samples"] == epochs * n
    assert stream["server_started"] and stream["requests"] > 0
    # greedy answers against the engine's own states
    assert stream["teacher_agreement"] >= 0.99
    # nothing left on disk: not a training sample's states, not a held-out one's; the packed
    # held-out shard is its final shard under a second name (the same bytes: a rerun keeps
    # it), and the training shards of the earlier prefill run are gone
    assert not list((results / "hidden" / "vllm" / "requests").glob("*.safetensors"))
    packed = list((results / "hidden" / "vllm").rglob("shard_*.safetensors"))
    assert [p.parent.name for p in packed] == ["eval"]
    assert os.path.samefile(packed[0], results / "hidden" / "eval" / packed[0].name)
    assert (results / "logs" / "train.server.log").exists()
    facts = eaglet_status.collect(
        results, load_run_config(results, str(workflow.TINY), workflow.REPO), None
    )
    train = {s["stage"]: s for s in facts["stages"]}["train"]
    assert train["facts"]["eval_simulated_al"] == pytest.approx(
        before_train["eval_simulated_al"], abs=0.15
    )
    assert "states streamed: %d prefill requests, %d saved by generation" % (
        stream["requests"],
        n,
    ) in eaglet_status.render(facts)
    print(
        f"teacher agreement prefill {before_manifest['teacher_agreement']:.4f} streamed "
        f"{stream['teacher_agreement']:.4f}; eval simulated AL shards "
        f"{before_train['eval_simulated_al']:.3f} streamed "
        f"{train['facts']['eval_simulated_al']:.3f}; {stream}"
    )
