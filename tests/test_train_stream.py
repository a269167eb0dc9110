"""train.data stream (eaglet.stages.train.stream): the training samples' states from the capture
server as training reads them, none stored as shards.

A tiny random Llama stands in for the target. The server's side is its connector's request
file (written here from the model as the connector writes it, tests/test_extract_vllm_parts);
the real vLLM server is exercised by tests/test_workflow.py. Against those files, stream mode
trains the drafter shard mode trains on shards packed from the same files, bit for bit, and
a run stopped mid-epoch resumes to the same weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eaglet.core.config import ConfigError, validate
from eaglet.core.io import atomic_open, request_path, write_jsonl
from eaglet.stages.train import stream as train_stream
from eaglet.stages.train.data import TrainError
from eaglet.stages.train.loop import train
from tests.test_extract_vllm_parts import connector_file
from tests.tiny_llama import VOCAB, greedy_records, make_tiny_llama, one_thread

AUX = [1, 3, 4]
TRAIN = {
    "epochs": 2,
    "lr": 3e-3,
    "max_tokens_per_batch": 64,
    "ttt_steps": 2,
    "log_every": 1,
    "checkpoint_every": 2,
    "warmup_steps": 1,
    "seed": 0,
    "device": "cpu",
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny target, greedy samples of it (train and held out), every training sample's
    request file as the connector writes it (kept in ``files``), the training shards packed
    from those files by the vllm extraction, the held-out shard, a vocabulary map."""
    from safetensors.torch import save

    from eaglet.engine.capture import Extractor
    from eaglet.stages.extract.vllm import capture_shards, staged_shards
    from eaglet.target.checkpoint import prepare_target

    root = tmp_path_factory.mktemp("stream")
    with one_thread():
        model = make_tiny_llama(root / "model", seed=11)
        records = greedy_records(model, n=9, seed=4)
        held_out = greedy_records(model, n=3, seed=8, prefix="e")
    info = prepare_target(str(root / "model"), root / "target")
    write_jsonl(root / "train.jsonl", records)
    cfg = validate(
        {
            "extract": {
                "backend": "vllm",
                "device": "cpu",
                "dtype": "float32",
                "max_len": 64,
                "aux_layer_ids": AUX,
                "num_shards": 3,
                "concurrency": 2,
            },
            "target": {"dtype": "float32"},
        }
    )
    files = root / "files"
    files.mkdir()
    (root / "work" / "requests").mkdir(parents=True)
    work, hidden = root / "work", root / "hidden"
    for r in records + held_out:  # the training samples' kept, to be copied for each run
        connector_file(
            model,
            request_path(files if r in records else work / "requests", r["id"]),
            r["prompt_token_ids"] + r["completion_token_ids"],
        )
    shutil.copytree(files, work / "requests", dirs_exist_ok=True)
    jobs = staged_shards(
        records,
        3,
        [str(hidden / f"shard_{i:05d}.safetensors") for i in range(3)],
        [str(hidden / f"shard_{i:05d}.json") for i in range(3)],
        work,
        "train",
    ) + staged_shards(
        held_out,
        1,
        [str(hidden / "eval" / "shard_00000.safetensors")],
        [str(hidden / "eval" / "shard_00000.json")],
        work,
        "eval",
    )
    Extractor.ensure_server, saved = (
        lambda self: pytest.fail("a server was started"),
        Extractor.ensure_server,
    )
    try:
        with one_thread():
            capture_shards(cfg, info, jobs, work, root / "server.log")
    finally:
        Extractor.ensure_server = saved
    t2d = torch.ones(VOCAB, dtype=torch.bool)
    with atomic_open(root / "vocab_map.safetensors", "wb") as handle:
        handle.write(save({"d2t": torch.zeros(VOCAB, dtype=torch.int64), "t2d": t2d}))
    return {
        "root": root,
        "model": model,
        "info": info,
        "cfg": cfg,
        "records": records,
        "files": files,
        "train": [str(j.shard_path) for j in jobs[:3]],
        "eval": [str(jobs[3].shard_path)],
        "vocab": str(root / "vocab_map.safetensors"),
    }


def requests_dir(world, tmp: Path, with_files: bool = True) -> Path:
    """A streaming run's work directory, its requests/ holding every training sample's file
    (as generation with capture leaves them) or none."""
    work = tmp / "work"
    if with_files:
        shutil.copytree(world["files"], work / "requests")
    else:
        (work / "requests").mkdir(parents=True)
    return work


def stream_args(world, work: Path) -> dict:
    from eaglet.target.checkpoint import read_target

    target_json = world["root"] / "target" / "target.json"
    assert read_target(target_json)["path"]
    return {
        "cfg": world["cfg"],
        "target_json": str(target_json),
        "data": str(world["root"] / "train.jsonl"),
        "work_dir": str(work),
        "server_log": str(work / "server.log"),
    }


def run(world, tmp: Path, name: str, cfg: dict, stream: dict | None = None, **kwargs) -> dict:
    with one_thread():
        return train(
            cfg,
            [] if stream else world["train"],
            world["eval"],
            world["vocab"],
            world["info"]["path"],
            out_dir=str(tmp / name / "drafter"),
            checkpoint_dir=str(tmp / name / "ckpt"),
            progress_path=None,
            log_path=None,
            stream=stream,
            **kwargs,
        )


def weights(tmp: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(tmp / name / "drafter" / "model.safetensors"))


class Requests:
    """A stand-in for the capture server's side of a prefill request: the connector's file
    written from the model; counts the requests."""

    def __init__(self, model, monkeypatch, save: bool = True):
        self.sent: list[str] = []

        async def request(feed, i, path):
            self.sent.append(feed.records[i]["id"])
            if save:
                ids = feed.seqs[i]
                with one_thread():
                    connector_file(model, path, ids)

        monkeypatch.setattr(train_stream.StateFeed, "_request", request)


def test_stream_trains_the_drafter_of_shards_packed_from_the_same_states(
    world, tmp_path, monkeypatch
):
    """Every training sample's states are saved (generation with capture): stream mode uses
    them without a request, keeps them for the second epoch in its cache, and trains the
    drafter shard mode trains, bit for bit; the cache is emptied at the end."""
    requests = Requests(world["model"], monkeypatch)
    run(world, tmp_path, "shards", TRAIN)
    work = requests_dir(world, tmp_path)
    summary = run(
        world,
        tmp_path,
        "stream",
        {**TRAIN, "data": "stream", "stream_cache_gib": 1},
        stream_args(world, work),
    )
    assert requests.sent == []  # all saved, all kept for epoch 2
    stream = summary["stream"]
    n = len(world["records"])
    assert stream["saved_files"] == n and stream["reread_files"] == n
    assert stream["cache_files"] == n
    assert stream["samples"] >= 2 * n and not stream["server_started"]
    assert stream["teacher_agreement"] == 1.0
    ours, theirs = weights(tmp_path, "stream"), weights(tmp_path, "shards")
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert not list((work / "requests").glob("*.safetensors"))


def test_the_teacher_check_of_a_streamed_sample_runs_in_chunks_once(world, tmp_path, monkeypatch):
    """A long answer's full-vocabulary logits are computed a chunk of rows at a time (as
    extraction's are), not all at once beside the server, and once a sample: later epochs
    reuse its argmax, as shards store it once; the argmax, and so the drafter, is the shard
    mode's."""
    from eaglet.target import states as extract_common
    from eaglet.target.states import TeacherHead

    monkeypatch.setattr(extract_common, "TEACHER_CHUNK_ROWS", 4)
    rows, product = [], TeacherHead.product
    monkeypatch.setattr(
        TeacherHead,
        "product",
        lambda self, states, nxt: rows.append(len(states)) or product(self, states, nxt),
    )
    run(world, tmp_path, "shards", TRAIN)
    del rows[:]
    summary = run(
        world,
        tmp_path,
        "stream",
        {**TRAIN, "data": "stream", "stream_cache_gib": 1},
        stream_args(world, requests_dir(world, tmp_path)),
    )
    answer_rows = sum(
        sum(mask[1:])
        for _, mask in train_stream.sequences(world["records"], world["cfg"]["extract"]["max_len"])
    )
    assert TRAIN["epochs"] == 2 and summary["stream"]["samples"] == 2 * len(world["records"])
    assert max(rows) == 4 and summary["stream"]["teacher_agreement"] == 1.0
    # every answer row once, in one epoch of two
    assert sum(rows) == summary["stream"]["teacher_positions"] == answer_rows
    stream, shards = weights(tmp_path, "stream"), weights(tmp_path, "shards")
    for name in shards:
        assert torch.equal(stream[name], shards[name]), name


@pytest.mark.subprocess  # its fixture starts the capture server when it runs first
def test_streamed_states_that_do_not_reproduce_greedy_answers_stop_training(
    world, tmp_path, monkeypatch
):
    """As extraction refuses a shard whose teacher disagrees with the target's greedy answers,
    streaming stops once the samples in fail extract.min_teacher_agreement, naming the worst;
    answers the target sampled are not held to their argmax."""
    from eaglet.target.states import ExtractionError, TeacherHead

    product = TeacherHead.product

    def off_by_one(self, states, nxt):  # a capture of the wrong layer, say
        argmax, logprob = product(self, states, nxt)
        return argmax + 1, logprob

    monkeypatch.setattr(TeacherHead, "product", off_by_one)
    args = stream_args(world, requests_dir(world, tmp_path / "greedy"))
    with pytest.raises(
        ExtractionError,
        match=r"teacher agreement 0\.00% in the \d+ samples "
        r"streamed so far is below extract.min_teacher_agreement=99\.00%.*"
        r"Worst samples: ",
    ):
        run(world, tmp_path, "greedy", {**TRAIN, "data": "stream"}, args)
    sampled = tmp_path / "sampled.jsonl"
    write_jsonl(sampled, [{**r, "sampling": {"temperature": 1.0}} for r in world["records"]])
    args = {**stream_args(world, requests_dir(world, tmp_path / "sampled")), "data": str(sampled)}
    summary = run(world, tmp_path, "sampled", {**TRAIN, "data": "stream", "epochs": 1}, args)
    assert summary["stream"]["teacher_agreement"] == 0.0  # reported, not enforced


@pytest.mark.parametrize("overlap,prefetch", [(True, 0), (False, 0), (False, 2)])
def test_with_overlap_off_the_server_computes_only_while_the_trainer_waits(
    world, tmp_path, monkeypatch, overlap, prefetch
):
    """train.stream_overlap false (auto where server and trainer share the CPU's cores): no
    request is in flight while a training step computes, and the drafter is the shards' one;
    overlapping, requests run beside the steps (what the turns prevent is there to see).
    With micro-batches packed ahead in a thread (train.prefetch_batches, the GPU default),
    which takes the samples while the steps compute, a turn still waits for the steps."""
    import asyncio
    import threading

    from eaglet.stages.train.loop import Trainer

    training, seen = threading.Event(), []  # set while a step computes, not while it takes
    step, take = Trainer.train_step, train_stream.StateFeed.take

    def timed_step(self, *args, **kwargs):
        training.set()
        try:
            return step(self, *args, **kwargs)
        finally:
            training.clear()

    def timed_take(self, index):  # taken in the step (no prefetcher): not computing
        training.clear()
        try:
            return take(self, index)
        finally:
            training.set()

    async def request(feed, i, path):
        for _ in range(10):  # long enough for a step beside it to be seen
            seen.append(training.is_set())
            await asyncio.sleep(0.005)
        connector_file(world["model"], path, feed.seqs[i])

    monkeypatch.setattr(train_stream.StateFeed, "_request", request)
    monkeypatch.setattr(Trainer, "train_step", timed_step)
    if not prefetch:
        monkeypatch.setattr(train_stream.StateFeed, "take", timed_take)
    summary = run(
        world,
        tmp_path,
        "stream",
        {
            **TRAIN,
            "data": "stream",
            "stream_ahead": 3,
            "stream_overlap": overlap,
            "prefetch_batches": prefetch,
        },
        stream_args(world, requests_dir(world, tmp_path, with_files=False)),
    )
    assert summary["stream"]["overlap"] is overlap and summary["stream"]["requests"] > 6
    assert any(seen) is overlap
    if not overlap:  # the same order, the same batches
        run(world, tmp_path, "shards", TRAIN)
        stream, shards = weights(tmp_path, "stream"), weights(tmp_path, "shards")
        for name in shards:
            assert torch.equal(stream[name], shards[name]), name


def test_without_a_cache_later_epochs_ask_the_engine_again(world, tmp_path, monkeypatch):
    """stream_cache_gib 0: a sample's file is deleted once trained on, so the second epoch
    sends one request per sample (with one sample ahead: none is shared by two positions
    in flight); nothing is left on disk."""
    requests = Requests(world["model"], monkeypatch)
    work = requests_dir(world, tmp_path)
    # left by a data-parallel run killed before: swept at the end, not read
    for left in ("rank-001", "cache"):
        (work / "requests" / left).mkdir()
        shutil.copy(next(world["files"].glob("*.safetensors")), work / "requests" / left)
    summary = run(
        world,
        tmp_path,
        "stream",
        {**TRAIN, "data": "stream", "stream_ahead": 1},
        stream_args(world, work),
    )
    n = len(world["records"])
    assert sorted(requests.sent) == sorted(r["id"] for r in world["records"])
    assert summary["stream"]["requests"] == n and summary["stream"]["cache_files"] == 0
    assert not list((work / "requests").rglob("*.safetensors"))
    assert not list((work / "requests").iterdir())


def test_the_default_window_holds_the_largest_micro_batch_beside_the_requests_in_flight(
    world, tmp_path, monkeypatch
):
    """train.stream_ahead null: the feed keeps extract.concurrency requests beside the
    samples of the largest micro-batch the trainer takes (here larger than the concurrency,
    so twice the concurrency would leave the server idle while a step trains), and never
    more than that many positions scheduled ahead of the trainer."""
    from eaglet.stages.train.loop import Trainer

    Requests(world["model"], monkeypatch)
    taken, most = [], [0]
    host_batch = Trainer.host_batch

    def record(self, data, indices):
        if data is self.train_data:
            taken.append(len(indices))
        return host_batch(self, data, indices)

    monkeypatch.setattr(Trainer, "host_batch", record)
    feed_request = train_stream.StateFeed._request

    async def request(feed, i, path):  # positions scheduled and not yet taken by the trainer
        most[0] = max(most[0], feed.ahead - feed._slots._value)
        await feed_request(feed, i, path)

    monkeypatch.setattr(train_stream.StateFeed, "_request", request)
    summary = run(
        world,
        tmp_path,
        "stream",
        {**TRAIN, "data": "stream"},
        stream_args(world, requests_dir(world, tmp_path, False)),
    )
    concurrency = world["cfg"]["extract"]["concurrency"]
    assert max(taken) > concurrency  # a batch of more samples than requests in flight
    assert summary["stream"]["window"] == concurrency + max(taken)
    assert 0 < most[0] <= summary["stream"]["window"]
    feed = object.__new__(train_stream.StateFeed)
    feed.concurrency, feed.configured_ahead = 16, None
    assert (feed.window(3), feed.window(40)) == (32, 56)  # at least twice the concurrency
    feed.configured_ahead = 5
    assert feed.window(40) == 5  # train.stream_ahead, as set


def test_a_stopped_stream_run_resumes_to_the_uninterrupted_weights(world, tmp_path, monkeypatch):
    """Stopped mid-epoch (as if killed) with requests in flight and files left on disk, the
    rerun resumes from the checkpoint, asks for what it still needs, and ends with the
    weights of an uninterrupted run: no sample trained twice in an epoch, none skipped."""
    Requests(world["model"], monkeypatch)  # answers the run's prefill requests
    cfg = {**TRAIN, "data": "stream", "stream_ahead": 3}
    whole = run(
        world,
        tmp_path,
        "whole",
        cfg,
        stream_args(world, requests_dir(world, tmp_path / "a", False)),
    )
    work = requests_dir(world, tmp_path / "b", False)
    stopped = run(world, tmp_path, "resumed", cfg, stream_args(world, work), stop_after_steps=3)
    assert stopped == {"stopped_at_step": 3}
    resumed = run(world, tmp_path, "resumed", cfg, stream_args(world, work))
    assert resumed["resumed_from_step"] == 2 and resumed["steps"] == whole["steps"]
    ours, theirs = weights(tmp_path, "resumed"), weights(tmp_path, "whole")
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert not list((work / "requests").glob("*.safetensors"))


def test_a_server_that_saves_nothing_stops_training_naming_the_file(world, tmp_path, monkeypatch):
    Requests(world["model"], monkeypatch, save=False)
    work = requests_dir(world, tmp_path, False)
    with pytest.raises(TrainError, match="saved no states .* see the server log"):
        run(world, tmp_path, "stream", {**TRAIN, "data": "stream"}, stream_args(world, work))


def test_the_stream_layout_is_the_shards_and_changes_with_the_samples(world):
    """The samples planned as the shards extraction writes (blocks, lengths, ids); the
    fingerprint's contents hash follows the token ids."""
    from eaglet.stages.train.data import index_shard

    records = world["records"]
    infos = train_stream.layout(
        records, train_stream.sequences(records, 64), 3, 64, AUX, {"name": "t"}, "float32"
    )
    for info, path in zip(infos, world["train"]):
        shard = index_shard(path, VOCAB)
        assert (info.lengths, info.sample_ids) == (shard.lengths, shard.sample_ids)
    changed = [
        dict(records[0], completion_token_ids=records[0]["completion_token_ids"][:-1]),
        *records[1:],
    ]
    again = train_stream.layout(
        changed, train_stream.sequences(changed, 64), 3, 64, AUX, {"name": "t"}, "float32"
    )
    assert again[0].sha256 != infos[0].sha256 and again[1].sha256 == infos[1].sha256
    with pytest.raises(TrainError, match="lower extract.num_shards"):
        train_stream.layout(
            records[:2], train_stream.sequences(records[:2], 64), 3, 64, AUX, {}, "float32"
        )


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"extract": {"backend": "hf"}}, "set extract.backend: vllm"),
        ({"scaling": {"enabled": True}}, "set scaling.enabled: false"),
        (
            {"server": {"gpus": 8}},
            "take its default 0.9 of each GPU .* Set train.stream_kv_cache_gib",
        ),
        # a share of each GPU, as generation wants it, says nothing of the trainer beside it
        (
            {"server": {"gpus": 8, "memory_utilization": 0.9}},
            "server.memory_utilization 0.9 of each GPU .* Set train.stream_kv_cache_gib",
        ),
    ],
)
def test_stream_mode_refuses_settings_it_cannot_serve(overrides, message):
    cfg = {"train": {"data": "stream"}}
    for section, values in overrides.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    with pytest.raises(ConfigError, match=message):
        validate(cfg)
    # the trainer beside the server with a KV cache of a fixed size, or on GPUs of its own
    assert validate({"train": {"data": "stream"}, "server": {"gpus": 8, "kv_cache_gib": 40}})
    assert validate(
        {
            "train": {"data": "stream", "stream_kv_cache_gib": 4},
            "server": {"gpus": 8, "memory_utilization": 0.9},
        }
    )
    assert validate({"train": {"data": "stream", "gpus": 1}, "server": {"gpus": 8}})
    assert validate({"train": {"data": "stream", "gpus": 4}, "server": {"gpus": 8}})


def test_the_trainers_wait_during_the_servers_start_is_told_apart():
    """The trainer waits 0.4 s for a sample; the server's start (begun before the wait)
    ends 0.15 s into it: that part is counted as waiting for the start, the rest for
    states. A start the trainer did not wait for (it ended before the wait) counts nothing."""
    import queue
    import threading
    import time
    from collections import Counter
    from types import SimpleNamespace

    feed = object.__new__(train_stream.StateFeed)
    feed.stats, feed._ready = Counter(), queue.Queue()
    feed.overlap, feed._held, feed._taken = True, [], 0
    feed._loop = SimpleNamespace(call_soon_threadsafe=lambda f: None)
    feed._slots = SimpleNamespace(release=None)
    began = time.perf_counter() - 5.0
    feed._starting = (began, None)

    def serve(start_ends: float, ready: float):
        time.sleep(start_ends)
        feed._starting = (began, time.perf_counter())
        time.sleep(ready - start_ends)
        feed._ready.put((0, "states", None))

    threading.Thread(target=serve, args=(0.15, 0.4)).start()
    assert feed.take(0) == "states"
    assert feed.stats["trainer_wait_s"] == pytest.approx(0.4, abs=0.1)
    assert feed.stats["trainer_wait_start_s"] == pytest.approx(0.15, abs=0.05)
    before = feed.stats["trainer_wait_start_s"]
    threading.Thread(target=serve, args=(0.0, 0.2)).start()
    time.sleep(0.05)  # the start ended before this wait began
    feed.take(0)
    assert feed.stats["trainer_wait_start_s"] == pytest.approx(before, abs=0.01)


# -- data parallel ---------------------------------------------------------------------------


def _stream_rank(
    rank: int,
    world,
    tmp: Path,
    cfg: dict,
    port: int,
    name: str = "stream",
    stop_after_steps: int | None = None,
) -> None:
    """One rank of a two-process streaming run (torch.multiprocessing's worker): the server's
    start and its prefill requests stood in for as in :class:`Requests`; which rank started a
    server, and where rank 1 sent its requests, are written to ``tmp``."""
    import os

    from transformers import LlamaForCausalLM

    from eaglet.engine.capture import Extractor

    model = LlamaForCausalLM.from_pretrained(world["root"] / "model").eval()
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )

    def start(extractor):
        (tmp / f"started-by-{rank}").touch()
        extractor.server.port, extractor.started = 8123, True

    async def prefill(feed, i, path):
        assert path.parent.name == f"rank-{rank:03d}"  # each rank requests into its own
        (tmp / f"rank-{rank}-asked-{feed.extractor.server.url.rsplit(':', 1)[1]}").touch()
        with one_thread():
            connector_file(model, path, feed.seqs[i])

    Extractor.ensure_server = start
    train_stream.StateFeed._prefill = prefill
    summary = run(
        world, tmp, name, cfg, stream_args(world, tmp / "work"), stop_after_steps=stop_after_steps
    )
    if rank == 0:
        torch.save(summary, tmp / f"{name}.pt")


@pytest.mark.subprocess  # two ranks
def test_two_ranks_stream_as_one_process_accumulating_both_and_share_one_server(world, tmp_path):
    """train.data stream on two data-parallel ranks (gloo processes): each feeds its own share
    of every step, rank 0 starts the one server when a rank first needs it and rank 1 sends
    its requests there; the second epoch reads the ranks' shared cache and the files saved
    before the run, whichever rank kept them; the drafter is the one a single process trains
    from shards accumulating both ranks' micro-batches, and nothing is left on disk."""
    import torch.multiprocessing as mp

    from eaglet.engine.server import free_port

    records = world["records"]
    saved = [r["id"] for r in records[::3]]  # as generation with capture left them
    work = requests_dir(world, tmp_path, False)
    for sid in saved:
        shutil.copy(request_path(world["files"], sid), request_path(work / "requests", sid))
    cfg = {**TRAIN, "data": "stream", "stream_cache_gib": 1, "checkpoint_every": 100}
    portable = {k: v for k, v in world.items() if k != "model"}  # loaded by each rank
    mp.start_processes(
        _stream_rank,
        args=(portable, tmp_path, cfg, free_port("127.0.0.1")),
        nprocs=2,
        start_method="spawn",
    )
    run(world, tmp_path, "single", {**cfg, "data": "shards", "grad_accum": 2})
    ours, theirs = weights(tmp_path, "stream"), weights(tmp_path, "single")
    for name in theirs:
        assert torch.allclose(ours[name], theirs[name], rtol=1e-4, atol=1e-6), name
    summary = torch.load(tmp_path / "stream.pt")
    stream, n = summary["stream"], len(records)
    assert stream["ranks"] == 2 and stream["samples"] >= 2 * n  # two epochs, all ranks
    # each saved file counted once, though it stays for the second epoch's rank to read
    assert stream["saved_files"] == len(saved) and stream["reread_files"] > 0
    # every sample not saved asked for once, a few more where one rank's window reached the
    # second epoch before the other rank's first use had reached the cache
    assert n - len(saved) <= stream["requests"] < 2 * (n - len(saved))
    assert stream["server_started"] and stream["teacher_agreement"] == 1.0
    assert sorted(p.name for p in tmp_path.glob("started-by-*")) == ["started-by-0"]
    assert {p.name for p in tmp_path.glob("rank-*-asked-*")} == {
        "rank-0-asked-8123",
        "rank-1-asked-8123",
    }
    assert not list((work / "requests").rglob("*.safetensors"))
    assert (
        not list((work / "requests").glob("rank-*"))
        and not (work / "requests" / "server.json").exists()
    )


def test_a_streaming_job_gives_the_server_its_gpus_and_the_trainer_the_rest(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7,0")
    assert train_stream.stream_devices(4, 1) == "4,5,6,7"
    assert __import__("os").environ["CUDA_VISIBLE_DEVICES"] == "0"  # not the server's first
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert train_stream.stream_devices(4, 0) == "4,5,6,7"  # beside it: a rank on each
    assert __import__("os").environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    with pytest.raises(TrainError, match="needs 5: server.gpus 4 and train.gpus 1"):
        train_stream.stream_devices(4, 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert train_stream.stream_devices(4, 1) is None  # no list: left alone


def test_server_and_trainer_take_turns_by_default_where_they_share_devices(monkeypatch):
    """train.stream_overlap auto: turns where the trainer computes on the server's devices
    (a CPU server and a CPU trainer; a rank on each of the server's GPUs); overlap where
    training has devices of its own; an explicit setting wins."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not train_stream.overlaps("auto", 0, 0, "cpu")
    assert not train_stream.overlaps("auto", 0, 1, "auto")
    assert train_stream.overlaps("auto", 8, 0, "cpu")  # the server on GPUs
    assert train_stream.overlaps(True, 0, 0, "cpu") and not train_stream.overlaps(
        False, 8, 8, "cuda"
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not train_stream.overlaps("auto", 8, 0, "auto")  # a rank beside the server
    assert train_stream.overlaps("auto", 8, 8, "auto")  # GPUs of its own
    assert train_stream.overlaps("auto", 0, 1, "cuda")  # the server on the CPU
    for value in ("auto", True, False):
        assert validate({"train": {"stream_overlap": value}})["train"]["stream_overlap"] == value
    with pytest.raises(ConfigError):
        validate({"train": {"stream_overlap": "sometimes"}})


def test_a_rank_learns_the_servers_health_without_probing_inside_its_event_loop(
    monkeypatch, tmp_path
):
    """Ranks other than 0 probe rank 0's server in a thread of their own: check_alive, run
    before every request in the feed's event loop, returns at once while a probe hangs, and
    raises once a probe failed."""
    import threading

    from eaglet.engine.server import ServerError, VLLMServer

    probing, release, where = threading.Event(), threading.Event(), []

    def healthy(self, timeout=2.0):  # a hung server: the probe waits for its timeout
        where.append(threading.current_thread().name)
        probing.set()
        release.wait(10)
        return False

    monkeypatch.setattr(VLLMServer, "healthy", healthy)
    server = train_stream.SharedServer(
        "http://127.0.0.1:9", tmp_path / "server.log", probe_every_s=0.01
    )
    assert probing.wait(10)
    server.check_alive()  # not held by the hanging probe
    release.set()
    server._thread.join(10)
    with pytest.raises(
        ServerError,
        match="which rank 0 started, does not answer: see rank 0's log and the server log",
    ):
        server.check_alive()
    assert where == ["eaglet-server-probe"]
    server.close()


def test_a_rank_waiting_for_the_server_gets_rank_0s_failure(tmp_path):
    """Rank 1 asks for the server and waits; rank 0's start failed and said why."""
    import asyncio
    from types import SimpleNamespace

    feed = object.__new__(train_stream.StateFeed)
    feed.rank = 1
    feed.extractor = SimpleNamespace(
        requests=tmp_path, server=SimpleNamespace(startup_timeout_s=1.0, log_path="server.log")
    )
    feed._announce({"error": "the vLLM server exited with code 1 before it was ready"})
    with pytest.raises(TrainError, match="rank 0 could not start .* exited with code 1"):
        asyncio.run(feed._shared_server())
    assert (tmp_path / "server.wanted").exists()
    (tmp_path / "server.json").unlink()
    feed.extractor.server.startup_timeout_s = -119.5  # waits half a second, then gives up
    with pytest.raises(TrainError, match="waited 0 s for rank 0 to start the capture server"):
        asyncio.run(feed._shared_server())


@pytest.mark.subprocess  # two ranks
def test_two_ranks_stopped_mid_epoch_resume_to_the_uninterrupted_weights(world, tmp_path):
    """Both ranks stopped after 3 steps (as if the job were killed) with requests in their own
    directories and files in the cache; the rerun resumes from the checkpoint, each rank
    reads what it had asked for, and ends with the weights of an uninterrupted two-rank run;
    nothing is left on disk."""
    import torch.multiprocessing as mp

    from eaglet.engine.server import free_port

    portable = {k: v for k, v in world.items() if k != "model"}
    cfg = {**TRAIN, "data": "stream", "stream_cache_gib": 1, "stream_ahead": 6}
    runs = {"whole": tmp_path / "a", "resumed": tmp_path / "b"}
    for directory in runs.values():
        requests_dir(world, directory, False)
    spawn = lambda *args: mp.start_processes(  # noqa: E731
        _stream_rank, args=(portable, *args), nprocs=2, start_method="spawn"
    )
    spawn(runs["whole"], cfg, free_port("127.0.0.1"), "whole")
    spawn(runs["resumed"], cfg, free_port("127.0.0.1"), "resumed", 3)
    assert torch.load(runs["resumed"] / "resumed.pt") == {"stopped_at_step": 3}
    left = runs["resumed"] / "work" / "requests"
    assert list(left.glob("rank-*/*.safetensors")) or list(left.glob("cache/*.safetensors"))
    spawn(runs["resumed"], cfg, free_port("127.0.0.1"), "resumed")
    resumed, whole = (torch.load(runs[name] / f"{name}.pt") for name in ("resumed", "whole"))
    assert resumed["resumed_from_step"] == 2 and resumed["steps"] == whole["steps"]
    ours, theirs = weights(runs["resumed"], "resumed"), weights(runs["whole"], "whole")
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert not list(left.rglob("*.safetensors"))


def test_rank_0_starts_the_server_another_rank_wants_though_it_needs_none(
    world, tmp_path, monkeypatch
):
    """Every sample of rank 0's share is saved, so it sends no request of its own; another
    rank's ``server.wanted`` still has it start the server and announce where it listens."""
    import time

    from eaglet.engine.capture import Extractor

    started = []

    def start(extractor):
        started.append(True)
        extractor.server.port, extractor.started = 8123, True

    monkeypatch.setattr(Extractor, "ensure_server", start)
    work = requests_dir(world, tmp_path)
    samples = train_stream.open_stream(
        stream_args(world, work), {"stream_ahead": None, "stream_cache_gib": 0}, rank=0, world=2
    )
    feed = samples.feed
    try:
        (work / "requests" / "server.wanted").touch()  # rank 1 needs a request
        order = list(range(len(world["records"])))
        feed.start(order, batch=2)
        for i in order:
            assert feed.take(i)[0] == world["records"][i]["id"]
        deadline = time.monotonic() + 30
        while not (work / "requests" / "server.json").exists():
            assert time.monotonic() < deadline, "rank 0 never announced the server"
            time.sleep(0.1)
    finally:
        samples.close()
    assert started == [True] and feed.stats["requests"] == 0
    assert not (work / "requests" / "server.json").exists()  # removed when it stopped


def test_the_streaming_jobs_server_takes_its_own_kv_cache_size(world, tmp_path):
    """train.stream_kv_cache_gib sizes the KV cache of the server the training job starts,
    in place of server.kv_cache_gib (which generation's server keeps); unset, the server
    section's is used."""

    def kv_bytes(server_gib, stream_gib):
        args = stream_args(
            world, requests_dir(world, tmp_path / f"{server_gib}-{stream_gib}", False)
        )
        args["cfg"] = {
            **args["cfg"],
            "server": {**args["cfg"]["server"], "kv_cache_gib": server_gib},
        }
        samples = train_stream.open_stream(
            args, {"stream_ahead": None, "stream_cache_gib": 0, "stream_kv_cache_gib": stream_gib}
        )
        try:
            served = samples.feed.extractor.server.args
        finally:
            samples.close()
        at = (
            served.index("--kv-cache-memory-bytes") if "--kv-cache-memory-bytes" in served else None
        )
        return None if at is None else int(served[at + 1])

    assert kv_bytes(None, None) is None
    assert kv_bytes(2, None) == 2 << 30
    assert kv_bytes(2, 3.5) == int(3.5 * 2**30)
    assert kv_bytes(None, 0.5) == 1 << 29
