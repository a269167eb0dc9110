"""Parts of the vLLM extraction backend that need no server: the layers it asks the server
for, the teacher's final state from layer L with the checkpoint's norm, the request files it
resumes from, and the capture options it starts the server with."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from eaglet.core.config import validate
from eaglet.core.io import request_path
from eaglet.engine.capture import (
    capture_args,
    capture_layer_ids,
    capture_server,
    read_request,
    split_states,
)
from eaglet.target.checkpoint import load_head
from tests.tiny_llama import HIDDEN, LAYERS, make_tiny_llama, one_thread


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    with one_thread():
        model = make_tiny_llama(directory, seed=3)
    return model, directory


def test_capture_layers_are_the_distinct_aux_ids_then_L():
    assert capture_layer_ids([2, 3, 3], 6) == [2, 3, 6]
    assert capture_layer_ids([1, 3, 4], 6) == [1, 3, 4, 6]


@torch.inference_mode()
def test_final_state_from_layer_L_is_what_the_lm_head_reads(tiny):
    """Layer L (the last layer's output before the final norm) through the checkpoint's norm
    equals transformers' last_hidden_state; aux ids map to HF hidden_states[i]."""
    model, directory = tiny
    head = load_head(directory, "float32")
    norm = head.norm
    assert torch.equal(head.lm_head, model.lm_head.weight)
    ids = torch.tensor([[5, 17, 42, 8, 99, 3]])
    with one_thread():
        out = model.model(input_ids=ids, output_hidden_states=True)
    hidden = out.hidden_states  # [0] embeddings, [i] input of layer i, [L] after the final norm
    aux_ids = [1, 3, 3]
    layer_ids = capture_layer_ids(aux_ids, LAYERS)
    # what vLLM saves for id L is the pre-norm output of the last layer: undo HF's final norm
    # by capturing it with a hook instead
    captured = {}
    handle = model.model.layers[-1].register_forward_hook(
        lambda m, a, o: captured.__setitem__("pre", (o[0] if isinstance(o, tuple) else o))
    )
    with one_thread():
        model.model(input_ids=ids)
    handle.remove()
    saved = torch.stack([hidden[1][0], hidden[3][0], captured["pre"][0]], dim=1)  # [N, 3, H]
    aux, final = split_states(saved, layer_ids, aux_ids, norm)
    assert aux.shape == (6, 3 * HIDDEN)
    assert torch.equal(aux[:, 2 * HIDDEN :], hidden[3][0])
    torch.testing.assert_close(final, out.last_hidden_state[0], rtol=1e-6, atol=1e-6)


def test_read_request_checks_the_tokens_and_drops_torn_files(tmp_path):
    path = request_path(tmp_path, "sample/with odd:chars")
    assert path.parent == tmp_path and path.suffix == ".safetensors"
    assert read_request(path, [1, 2]) is None  # not saved yet
    save_file({"hidden_states": torch.ones(2, 4, 3), "token_ids": torch.tensor([1, 2])}, str(path))
    assert read_request(path, [1, 2]).shape == (2, 4, 3)
    assert read_request(path, [1, 3]) is None and not path.exists()  # another sequence
    path.write_bytes(b'\x10\x00\x00\x00\x00\x00\x00\x00{"a')  # cut short by a crash
    assert read_request(path, [1, 2]) is None and not path.exists()


def test_read_request_takes_states_saved_while_generating_and_cut_sequences(tmp_path):
    """Generation with capture saves every token but the last generated one: the missing row
    comes back as zeros. A sequence cut to extract.max_len takes the file's first rows."""
    path = request_path(tmp_path, "s")
    states = torch.arange(3 * 2 * 4, dtype=torch.float32).reshape(3, 2, 4)
    save_file({"hidden_states": states, "token_ids": torch.tensor([5, 6, 7])}, str(path))
    padded = read_request(path, [5, 6, 7, 8])
    assert padded.shape == (4, 2, 4)
    assert torch.equal(padded[:3], states) and not padded[3].any()
    assert torch.equal(read_request(path, [5, 6]), states[:2])
    assert read_request(path, [5, 6, 7, 8, 9]) is None  # two rows short: another sequence


def test_server_gets_the_generation_settings_plus_capture(tmp_path):
    cfg = validate(
        {
            "server": {
                "tensor_parallel_size": 2,
                "extra_args": ["--quantization", "awq"],
                "env": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
            },
            "target": {"max_model_len": 1024},
            "extract": {"max_len": 4096},
        }
    )
    server = capture_server(cfg, "/models/t", [2, 15, 27, 30], tmp_path / "req", tmp_path / "log")
    # server.env reaches the server over the workflow's own environment
    assert server.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and server.env["PATH"]
    args = server.args
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert "--quantization" in args and "--no-enable-prefix-caching" in args
    assert args[args.index("--max-model-len") + 1] == "4097"  # the longest sequence + 1 token
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [
        2,
        15,
        27,
        30,
    ]
    transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector_module_path"] == "eaglet.engine.connector"
    assert transfer["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path / "req")
    assert capture_args([1], "x")[-1] == "--no-enable-prefix-caching"


# -- resume at the shard level: packed shards of an earlier run, no server needed -------------


def packed_run(tiny, tmp_path):
    """A vLLM-backend run interrupted after packing both shards (packed here with the hf
    backend, which gives the same shard)."""
    from eaglet.stages.extract.hf import extract_shard, load_target
    from eaglet.stages.extract.vllm import staged_shards
    from eaglet.target.checkpoint import prepare_target
    from eaglet.target.states import target_identity
    from tests.tiny_llama import greedy_records

    model, directory = tiny
    info = prepare_target(str(directory), tmp_path / "target")
    with one_thread():
        records = greedy_records(model, n=4)
    cfg = validate(
        {
            "extract": {
                "backend": "vllm",
                "dtype": "float32",
                "max_len": 64,
                "aux_layer_ids": [1, 3, 4],
                "device": "cpu",
            }
        }
    )
    work = tmp_path / "work"
    hidden = tmp_path / "hidden"
    jobs = staged_shards(
        records,
        2,
        [str(hidden / f"shard_{i:05d}.safetensors") for i in range(2)],
        [str(hidden / f"shard_{i:05d}.json") for i in range(2)],
        work,
        "train",
    )
    target = load_target(info["path"], "float32", "cpu")
    with one_thread():
        for job in jobs:
            job.staged_path.parent.mkdir(parents=True, exist_ok=True)
            extract_shard(
                target,
                job.records,
                cfg["extract"],
                [1, 3, 4],
                target_identity(info),
                job.staged_path,
                job.staged_meta_path,
                backend="vllm",
            )
    return cfg, info, jobs, work


def test_packed_shards_are_kept_and_moved_without_a_server(tiny, tmp_path, monkeypatch):
    from eaglet.core.io import request_path
    from eaglet.data import shards
    from eaglet.engine.capture import Extractor
    from eaglet.stages.extract.vllm import capture_shards

    cfg, info, jobs, work = packed_run(tiny, tmp_path)
    hashes = [shards.digest_path(job.staged_path) for job in jobs]
    # states saved again for the same samples (generation capturing them): not needed
    saved_again = [request_path(work / "requests", r["id"]) for r in jobs[0].records]
    for path in saved_again:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"states")
    stale = work / "shards" / "train" / "shard_00009.safetensors"  # an earlier shard count's
    stale.write_bytes(b"old states")
    monkeypatch.setattr(
        Extractor, "ensure_server", lambda self: pytest.fail("a server was started")
    )
    with one_thread():
        metas = capture_shards(cfg, info, jobs, work, tmp_path / "server.log")
    assert [m["backend"] for m in metas] == ["vllm", "vllm"]
    for job, digest in zip(jobs, hashes):
        assert shards.digest_path(job.shard_path) == digest and job.meta_path.exists()
        # the packed name stays, the same bytes on disk (a hard link, no second copy)
        assert os.path.samefile(job.staged_path, job.shard_path)
    assert not any(path.exists() for path in saved_again)
    assert not stale.exists()


def test_a_rerun_after_snakemake_deleted_the_outputs_extracts_only_a_damaged_shard(
    tiny, tmp_path, monkeypatch
):
    """Snakemake deletes every output of the one extraction job before running it again (one
    damaged shard, one edited prompt): the intact shards come back from their packed names,
    checked by their digests, and only the damaged one is extracted again."""
    from eaglet.data import shards
    from eaglet.engine.capture import Extractor
    from eaglet.stages.extract.vllm import capture_shards

    cfg, info, jobs, work = packed_run(tiny, tmp_path)
    with one_thread():
        capture_shards(cfg, info, jobs, work, tmp_path / "server.log")
    intact = shards.digest_path(jobs[0].shard_path)
    with open(jobs[1].shard_path, "r+b") as handle:  # damaged in place
        handle.seek(-8, os.SEEK_END)
        handle.write(b"\xff" * 8)
    for job in jobs:  # what Snakemake does before the rerun
        job.shard_path.unlink()
        job.meta_path.unlink()
    sent = []

    def stream(self, sample_ids, seqs, paths, consume, progress, ahead=None):
        sent.extend(sample_ids)
        raise RuntimeError("extracting again")

    monkeypatch.setattr(Extractor, "ensure_server", lambda self: None)
    monkeypatch.setattr(Extractor, "stream", stream)
    with one_thread(), pytest.raises(RuntimeError, match="extracting again"):
        capture_shards(cfg, info, jobs, work, tmp_path / "server.log")
    assert sent == [r["id"] for r in jobs[1].records]  # the damaged shard's samples alone
    assert shards.digest_path(jobs[0].staged_path) == intact


def test_a_packed_shard_of_other_samples_is_not_reused(tiny, tmp_path, monkeypatch):
    from eaglet.engine.capture import Extractor
    from eaglet.stages.extract.vllm import capture_shards

    cfg, info, jobs, work = packed_run(tiny, tmp_path)
    jobs[1].records[0] = {
        **jobs[1].records[0],
        "completion_token_ids": jobs[1].records[0]["completion_token_ids"][:-1],
    }
    started = []

    def no_server(self):
        started.append(1)
        raise RuntimeError("would start the server")

    monkeypatch.setattr(Extractor, "ensure_server", no_server)
    with one_thread(), pytest.raises(RuntimeError, match="would start the server"):
        capture_shards(cfg, info, jobs, work, tmp_path / "server.log")
    assert started == [1]
    assert not jobs[0].shard_path.exists()  # nothing is moved before every shard is done


def test_prefill_retries_a_busy_server_and_names_a_server_without_capture(tmp_path):
    """A 503 is retried; an answer without hidden_states_path means the server runs without
    the capture options, which the error says."""
    import asyncio

    import httpx

    from eaglet.engine.capture import prefill
    from eaglet.target.states import ExtractionError

    answers = [
        httpx.Response(503, text="busy"),
        httpx.Response(
            200,
            json={"kv_transfer_params": {"hidden_states_path": str(tmp_path / "a.safetensors")}},
        ),
        httpx.Response(200, json={"choices": []}),
    ]
    sent = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return answers.pop(0)

    async def run(path):
        async with httpx.AsyncClient(
            transport=httpx.MockTransport(handler), base_url="http://server"
        ) as client:
            await prefill(client, [1, 2, 3], path, timeout=5, max_retries=2)

    asyncio.run(run(tmp_path / "a.safetensors"))
    assert len(sent) == 2 and sent[1]["prompt"] == [1, 2, 3] and sent[1]["max_tokens"] == 1
    assert sent[1]["kv_transfer_params"] == {"hidden_states_path": str(tmp_path / "a.safetensors")}
    with pytest.raises(ExtractionError, match="without eaglet's capture options"):
        asyncio.run(run(tmp_path / "b.safetensors"))


# -- the packing pipeline: one request window, shards packed while the server computes -------


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_the_teacher_of_a_shard_fed_a_sequence_at_a_time_equals_the_whole_shard(dtype):
    """ShardTeacher (sequences as their states come in, chunks computed as they fill) gives
    the argmax and log-probabilities of teacher_from_stored over the whole shard, bit for
    bit, with chunks that span sequences."""
    from eaglet.target.states import (
        ShardTeacher,
        Target,
        TeacherHead,
        _round_trip,
        predicting_rows,
        teacher_from_stored,
    )

    gen = torch.Generator().manual_seed(0)
    lm_head = torch.randn(50, 16, generator=gen)
    lengths = [5, 1, 9, 4, 12]
    seqs = [torch.randint(0, 50, (n,), generator=gen).tolist() for n in lengths]
    masks = [[0] * (n // 2) + [1] * (n - n // 2) for n in lengths]
    finals = [torch.randn(n, 16, generator=gen) * 3 for n in lengths]
    target = Target(None, lm_head, torch.device("cpu"), 2, 16, 50)
    input_ids = torch.tensor([t for s in seqs for t in s])
    loss_mask = torch.tensor([m for ms in masks for m in ms], dtype=torch.uint8)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    rows = predicting_rows(loss_mask, offsets)
    whole = teacher_from_stored(
        target, _round_trip(torch.cat(finals), dtype), torch.roll(input_ids, -1), rows, chunk=4
    )
    teacher = ShardTeacher(TeacherHead(lm_head), dtype, sum(lengths), chunk=4)
    for final, ids, mask in zip(finals, seqs, masks):
        teacher.add(final, ids, mask)
    argmax, logprob = teacher.finish()
    assert int((argmax >= 0).sum()) == int(rows.sum()) > 8  # several chunks
    assert torch.equal(argmax, whole[0])
    torch.testing.assert_close(logprob, whole[1], rtol=0, atol=0, equal_nan=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny target as extraction reads it, and greedy samples of it."""
    from eaglet.target.checkpoint import prepare_target
    from tests.tiny_llama import greedy_records

    root = tmp_path_factory.mktemp("served")
    with one_thread():
        model = make_tiny_llama(root / "model", seed=5)
        records = greedy_records(model, n=7, seed=2)
    info = prepare_target(str(root / "model"), root / "target")
    return model, info, records


@torch.inference_mode()
def connector_file(model, path, ids: list[int]) -> None:
    """The request file the capture connector writes for ``ids``: the aux layers' inputs and
    the last layer's output before the final norm, [tokens, layers, H]."""
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda m, a, o: captured.__setitem__("L", o[0] if isinstance(o, tuple) else o)
    )
    try:
        with one_thread():
            out = model.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    finally:
        hook.remove()
    states = torch.stack(
        [
            out.hidden_states[1][0],
            out.hidden_states[3][0],
            out.hidden_states[4][0],
            captured["L"][0],
        ],
        dim=1,
    )
    save_file({"hidden_states": states, "token_ids": torch.tensor(ids)}, str(path))


def pipeline_run(
    served, tmp_path, monkeypatch, num_shards: int, dtype: str = "float32", answer=None, **extract
):
    """capture_shards with a stand-in server: each prefill request is answered by writing
    its file as the connector does (``answer(i, ids, path)`` may do otherwise); returns the
    metas, the jobs, and for each request the shards already written when it was sent."""
    from eaglet.engine import capture
    from eaglet.stages.extract import vllm as extract_vllm
    from eaglet.stages.extract.vllm import staged_shards

    model, info, records = served
    cfg = validate(
        {
            "extract": {
                "backend": "vllm",
                "device": "cpu",
                "dtype": dtype,
                "max_len": 64,
                "aux_layer_ids": [1, 3, 4],
                **extract,
            },
            "target": {"dtype": "float32"},
        }
    )
    work, hidden = tmp_path / "work", tmp_path / "hidden"
    jobs = staged_shards(
        records,
        num_shards,
        [str(hidden / f"shard_{i:05d}.safetensors") for i in range(num_shards)],
        [str(hidden / f"shard_{i:05d}.json") for i in range(num_shards)],
        work,
        "train",
    )
    written_when_sent = []

    async def prefill_each(
        url, work_items, concurrency, timeout, max_retries, after, health_check=None, before=None
    ):
        for i, (ids, path) in enumerate(work_items):
            if before is not None:
                await before(i)
            written_when_sent.append(sum(j.staged_meta_path.exists() for j in jobs))
            (answer or (lambda i, ids, path: connector_file(model, path, ids)))(i, ids, path)
            await after(i)

    monkeypatch.setattr(capture, "prefill_each", prefill_each)
    monkeypatch.setattr(capture.Extractor, "ensure_server", lambda self: None)
    with one_thread():
        metas = extract_vllm.capture_shards(cfg, info, jobs, work, tmp_path / "server.log")
    return metas, jobs, written_when_sent


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8"])
def test_pipelined_shards_are_those_written_one_shard_at_a_time(
    served, tmp_path, monkeypatch, dtype
):
    """The same request files packed shard by shard (write_shard computing the teacher of
    the whole shard) give the same shard files, byte for byte, and the same teacher check,
    with teacher chunks that span sequences."""
    from eaglet.data import shards
    from eaglet.engine.capture import read_request
    from eaglet.target import states as extract_common
    from eaglet.target.states import Target, shard_states, target_identity, write_shard

    monkeypatch.setattr(extract_common, "TEACHER_CHUNK_ROWS", 16)
    model, info, records = served
    # the storage cast flips a near-tie of the tiny target's logits: not what this compares
    metas, jobs, _ = pipeline_run(
        served, tmp_path, monkeypatch, 3, dtype, min_teacher_agreement=0.0
    )
    head = load_head(info["path"], "float32")
    target, norm = Target.from_head(head, "cpu"), head.norm
    cfg = validate({"extract": {"dtype": dtype, "max_len": 64, "min_teacher_agreement": 0.0}})[
        "extract"
    ]
    layer_ids = capture_layer_ids([1, 3, 4], LAYERS)

    def from_files(target, records, seqs, cfg, aux_layer_ids, progress):
        rows = []
        for ids in seqs:
            path = tmp_path / "again.safetensors"
            connector_file(model, path, ids)
            rows.append(split_states(read_request(path, ids), layer_ids, aux_layer_ids, norm))
        return [r[0] for r in rows], [r[1] for r in rows]

    assert sum(m["teacher"]["positions"] for m in metas) > 2 * 16
    for job, meta in zip(jobs, metas):
        got = shard_states(target, job.records, cfg, [1, 3, 4], None, from_files)
        reference = write_shard(
            target,
            got,
            cfg,
            [1, 3, 4],
            target_identity(info),
            tmp_path / "ref.safetensors",
            tmp_path / "ref.json",
            backend="vllm",
        )
        assert shards.digest_path(job.shard_path) == meta["sha256"] == reference["sha256"]
        assert meta["teacher"] == reference["teacher"]
        if dtype == "float32":  # the served states are the target's
            assert meta["teacher"]["agreement"] == 1.0
    assert not list((tmp_path / "work" / "requests").glob("*.safetensors"))  # all packed


def test_the_request_window_runs_at_most_one_shard_ahead_of_the_packing(
    served, tmp_path, monkeypatch
):
    """Requests of shard j are sent only once shard j-2 is written, however slow the packing
    (here slower than the server): the request files on disk stay within two shards."""
    import time

    from eaglet.stages.extract.vllm import ShardPacker
    from eaglet.target.states import shard_records

    _, _, records = served
    add = ShardPacker.add

    def slow_add(self, states, times):
        time.sleep(0.1)
        add(self, states, times)

    monkeypatch.setattr(ShardPacker, "add", slow_add)
    _, jobs, written_when_sent = pipeline_run(served, tmp_path, monkeypatch, 4)
    shard_of = [j for j in range(4) for _ in shard_records(records, 4, j)]
    assert len(written_when_sent) == len(records)
    assert all(written >= shard - 1 for written, shard in zip(written_when_sent, shard_of))
    assert all(job.shard_path.exists() for job in jobs)


def test_a_request_without_states_stops_the_stage_and_keeps_what_was_packed(
    served, tmp_path, monkeypatch
):
    from eaglet.target.states import ExtractionError

    model, _, records = served

    def answer(i, ids, path):
        if i < 4:  # the last request's states are never saved
            connector_file(model, path, ids)

    with pytest.raises(ExtractionError, match="saved no states"):
        pipeline_run(served, tmp_path, monkeypatch, 2, answer=answer)
    staged = sorted(p.name for p in (tmp_path / "work" / "shards" / "train").glob("*.safetensors"))
    assert staged == ["shard_00000.safetensors"]  # the first shard was whole: it is kept
    assert not (tmp_path / "hidden").exists()


def test_the_progress_clock_starts_when_the_server_is_up(served, tmp_path, monkeypatch):
    """Generation saved the states of two samples; the rest are prefill requests. The
    progress (whose rate `eaglet status` learns) starts its clock once the server is up and
    counts the requested sequences only, the saved ones as done already."""
    import time

    from eaglet.core.progress import Progress
    from eaglet.engine import capture
    from eaglet.stages.extract import vllm as extract_vllm
    from eaglet.stages.extract.vllm import staged_shards
    from eaglet.target.states import sequence

    model, info, records = served
    records = [{**r, "hidden_states": "saved"} for r in records]
    work = tmp_path / "work"
    (work / "requests").mkdir(parents=True)
    for record in records[:2]:
        connector_file(
            model, request_path(work / "requests", record["id"]), sequence(record, 64)[0]
        )
    ready = []

    def start_server(self):
        time.sleep(0.5)  # the server's start, which the prefill rate leaves out
        ready.append(time.monotonic())

    async def prefill_each(
        url, work_items, concurrency, timeout, max_retries, after, health_check=None, before=None
    ):
        for i, (ids, path) in enumerate(work_items):
            connector_file(model, path, ids)
            await after(i)

    monkeypatch.setattr(capture, "prefill_each", prefill_each)
    monkeypatch.setattr(capture.Extractor, "ensure_server", start_server)
    cfg = validate(
        {
            "extract": {
                "backend": "vllm",
                "device": "cpu",
                "dtype": "float32",
                "max_len": 64,
                "aux_layer_ids": [1, 3, 4],
            },
            "target": {"dtype": "float32"},
        }
    )
    jobs = staged_shards(
        records,
        2,
        [str(tmp_path / f"s{i}.safetensors") for i in range(2)],
        [str(tmp_path / f"s{i}.json") for i in range(2)],
        work,
        "train",
    )
    progress = Progress("extract", total=len(records))
    with one_thread():
        metas = extract_vllm.capture_shards(
            cfg, info, jobs, work, tmp_path / "server.log", progress
        )
    assert progress.started >= ready[0]
    assert progress.already_done == 2 and progress.done == len(records)
    assert progress.tokens == sum(len(sequence(r, 64)[0]) for r in records[2:])
    assert [m["captured_during_generation"] for m in metas] == [2, 0]


@pytest.mark.parametrize("split, setting", [("train", "num_shards"), ("eval", "num_eval_shards")])
def test_a_split_with_more_shards_than_samples_names_its_own_setting(tmp_path, split, setting):
    from eaglet.stages.extract.vllm import staged_shards
    from eaglet.target.states import ExtractionError

    paths = [str(tmp_path / f"shard_{i:05d}.safetensors") for i in range(3)]
    records = [{"id": "a"}, {"id": "b"}]
    with pytest.raises(
        ExtractionError,
        match=rf"{split} shard 0 of 3 would hold no samples: "
        rf"lower extract.{setting} to at most the number "
        rf"of {split} samples",
    ):
        staged_shards(
            records, 3, paths, [p.replace(".safetensors", ".json") for p in paths], tmp_path, split
        )


def test_the_disk_check_counts_the_request_files_and_a_full_disk_names_its_path(
    tmp_path, monkeypatch
):
    """The up-front check left out the request files the server saves beside the shards (every
    captured layer, in the served dtype, for up to two shards at once); a disk that filled up
    anyway said only "[Errno 28] No space left on device"."""
    import errno

    from eaglet.core.io import write_json, write_jsonl
    from eaglet.stages.extract import vllm as extraction
    from eaglet.stages.extract.vllm import StagedShard, request_bytes
    from eaglet.target.states import ExtractionError

    records = [
        {"id": f"s{i}", "prompt_token_ids": [1] * 10, "completion_token_ids": [2] * 6}
        for i in range(6)
    ]
    jobs = [
        StagedShard(
            f"shard {i}",
            records[i : i + 1 + i],
            tmp_path / "a",
            tmp_path / "b",
            tmp_path / "c",
            tmp_path / "d",
        )
        for i in range(3)
    ]
    # the two largest shards: 3 and 2 samples of 16 tokens, 4 layers of 8, float32
    assert request_bytes(jobs, 64, 4, 8, "float32") == (48 + 32) * 4 * 8 * 4
    assert request_bytes(jobs, 12, 4, 8, "bfloat16") == (36 + 24) * 4 * 8 * 2  # cut at max_len

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "work" / "x"))

    monkeypatch.setattr(extraction, "capture_shards", full)
    write_json(tmp_path / "target.json", {"path": str(tmp_path), "spec": "t"})
    write_jsonl(tmp_path / "train.jsonl", records)
    splits = {
        "train": {
            "data": str(tmp_path / "train.jsonl"),
            "shards": [str(tmp_path / "h" / "shard_00000.safetensors")],
            "metas": [str(tmp_path / "h" / "shard_00000.json")],
        }
    }
    with pytest.raises(ExtractionError) as info:
        extraction.run_stage(
            validate({}),
            str(tmp_path / "target.json"),
            splits,
            str(tmp_path / "work"),
            str(tmp_path / "server.log"),
        )
    message = str(info.value)
    assert f"the disk of {tmp_path / 'work'} filled up" in message
    assert str(tmp_path / "work" / "x") in message and "GiB free now" in message
    assert "rerun to go on" in message
