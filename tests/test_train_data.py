"""Training data that streams: mapped shards give the batches the eager load gave, the
prefetcher hands out exactly the batches of the loop in its order, host memory stays under
train.host_ram_mb on a shard larger than it, and the budget refuses what it cannot hold."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from eaglet.data import shards
from eaglet.stages.train.data import (
    MB,
    DataMemory,
    Prefetcher,
    Samples,
    ShardInfo,
    TrainError,
    data_memory,
    index_shard,
    make_batch,
)

AUX_IDS = [1, 2, 3]
VOCAB = 300


def write_shard(path, lengths, hidden, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    mask = (torch.rand(n, generator=g) < 0.7).to(torch.uint8)
    argmax = torch.where(mask.bool(), torch.randint(0, VOCAB, (n,), generator=g), -1)
    written = shards.write(
        path,
        torch.randint(0, VOCAB, (n,), generator=g),
        mask,
        offsets,
        argmax,
        torch.randn(n, 3 * hidden, generator=g) * 3,
        torch.randn(n, hidden, generator=g),
        sample_ids=[f"{path.stem}-{i}" for i in range(len(lengths))],
        aux_layer_ids=AUX_IDS,
        dtype=dtype,
        target={"spec": "t"},
    )
    return str(path), written.sha256


@pytest.fixture(params=["float32", "bfloat16", "fp8"])
def shard_set(tmp_path, request):
    g = torch.Generator().manual_seed(1)
    infos = []
    for s in range(3):
        lengths = torch.randint(3, 40, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g)
        path, sha = write_shard(
            tmp_path / f"shard_{s:05d}.safetensors", lengths.tolist(), 16, request.param, seed=s
        )
        infos.append(index_shard(path, VOCAB, sha))
    return infos


def eager_get(loaded, samples: Samples, index: int, max_len: int) -> tuple:
    """What Samples.get returned when shards were loaded whole in float32 (shards.load)."""
    number = samples.shard_of[index]
    local = index - samples.first[number]
    shard = loaded[number]
    rows = shard.sample(local)
    rows = slice(rows.start, min(rows.stop, rows.start + max_len))
    return (
        shard.sample_ids[local],
        shard.input_ids[rows],
        shard.loss_mask[rows],
        shard.teacher_argmax[rows],
        shard.aux_hidden[rows],
        shard.final_hidden[rows],
    )


def assert_batches_equal(a, b):
    for name in ("aux", "final", "teacher_argmax", "step_ids", "positions", "segments"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert len(a.rows) == len(b.rows) and all(torch.equal(x, y) for x, y in zip(a.rows, b.rows))
    assert a.sample_ids == b.sample_ids


def test_mapped_samples_give_the_batches_of_the_eager_load(shard_set):
    """Batches packed from mapped shards in their stored dtype, converted per micro-batch
    (Batch.to), equal those packed from the whole shards loaded in float32."""
    infos = shard_set
    samples = Samples(infos, keep=1)  # one mapped at a time: remapping must not change a bit
    loaded = [shards.load(info.path, info.sha256) for info in infos]
    t2d = torch.arange(VOCAB) % 3 != 0
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(samples), generator=g).tolist()
    stored = shards.STORAGE_DTYPES[infos[0].dtype]
    for start in range(0, len(order), 5):
        group = order[start : start + 5]
        mapped = make_batch([samples.get(i, 25) for i in group], 3, t2d)
        assert mapped.aux.dtype == stored  # packed in the stored dtype, converted later
        assert (mapped.aux_scale is not None) == (infos[0].dtype == "fp8")
        want = make_batch([eager_get(loaded, samples, i, 25) for i in group], 3, t2d)
        assert_batches_equal(mapped.to(torch.device("cpu")), want.to(torch.device("cpu")))


def test_a_shard_is_hashed_once_unless_its_file_changes(shard_set, monkeypatch):
    hashed = []
    real = shards.digest_path
    monkeypatch.setattr(shards, "digest_path", lambda p, threads=None: hashed.append(p) or real(p))
    samples = Samples(shard_set, keep=1)
    for _ in range(3):  # every shard evicted and mapped again each round
        for number in range(len(shard_set)):
            samples.shard(number)
    assert hashed == [info.path for info in shard_set]
    path = shard_set[0].path
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0x01  # changed after its check: the next mapping checks it again
    with open(path, "wb") as handle:
        handle.write(bytes(data))
    with pytest.raises(TrainError, match=rf"{path} is damaged: its sha256"):
        samples.shard(0)


# -- the prefetcher --------------------------------------------------------------------------


def test_prefetcher_hands_out_every_item_in_order_while_building_ahead():
    built, gate = [], threading.Event()

    def build(x):
        built.append(x)
        if x == 5:
            gate.wait(10)
        return x * x

    feed = Prefetcher(build, ((i, i) for i in range(12)), depth=3)
    try:
        assert [feed.take(i) for i in range(2)] == [0, 1]
        deadline = time.monotonic() + 10
        while len(built) < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert built == list(range(6))  # ahead of the consumer, up to its depth
        gate.set()
        assert [feed.take(i) for i in range(2, 12)] == [i * i for i in range(2, 12)]
        with pytest.raises(StopIteration):
            feed.take()
    finally:
        feed.close()


def test_prefetcher_raises_a_build_error_in_place_of_its_item_and_checks_keys():
    def build(x):
        if x == 3:
            raise TrainError("shard 3 is damaged")
        return x

    feed = Prefetcher(build, ((i, i) for i in range(10)), depth=2)
    assert [feed.take(i) for i in range(3)] == [0, 1, 2]
    with pytest.raises(TrainError, match="shard 3 is damaged"):
        feed.take(3)
    feed.close()
    feed = Prefetcher(lambda x: x, ((i, i) for i in range(10)), depth=2)
    with pytest.raises(RuntimeError, match=r"built 0 where 1 was due"):
        feed.take(1)
    feed.close()


def test_prefetcher_closes_while_its_producer_waits_on_a_full_queue():
    feed = Prefetcher(lambda x: x, ((i, i) for i in range(1000)), depth=1)
    assert feed.take(0) == 0
    feed.close()
    assert not feed._thread.is_alive()


def test_a_build_can_wait_until_the_consumer_has_taken_everything_and_waits():
    """wait_for_consumer (a streamed state's turn on the server): the build of item 2 goes on
    only once items 0 and 1 are taken and the consumer waits for 2, never while the consumer
    holds an item it has not come back from; close releases a build still waiting."""
    events, busy, made, feeds = [], threading.Event(), threading.Event(), []

    def build(x):
        if x == 2:
            made.wait(10)
            feeds[0].wait_for_consumer()
            events.append(("went on", busy.is_set()))
        return x

    feed = Prefetcher(build, ((i, i) for i in range(4)), depth=3)
    feeds.append(feed)
    made.set()
    try:
        for i in range(4):
            busy.clear()
            assert feed.take(i) == i
            busy.set()  # the consumer's step computes
            events.append(("took", i))
            if i < 2:
                time.sleep(0.2)  # long enough for a build that did not wait to show
        assert events == [("took", 0), ("took", 1), ("went on", False), ("took", 2), ("took", 3)]
    finally:
        feed.close()
    made.clear()
    feeds[0] = feed = Prefetcher(
        lambda x: made.wait(10) and feeds[0].wait_for_consumer() or x,
        ((i, i) for i in range(9)),
        depth=1,
    )
    made.set()
    time.sleep(0.1)
    feed.close()  # never taken: the waiting build is let go
    assert not feed._thread.is_alive()


# -- the memory budget -----------------------------------------------------------------------


def test_budget_splits_batches_and_pages_and_refuses_too_little():
    info = ShardInfo("x", [10], ["a"], 576, AUX_IDS, {}, None, "bfloat16")
    cfg = {"max_tokens_per_batch": 8192, "ttt_steps": 7, "prefetch_batches": 2}
    per_token = shards.bytes_per_token(576, 3, "bfloat16")
    batch = 8192 * (per_token + 8 * 17)
    memory = data_memory({**cfg, "host_ram_mb": 512}, [info])
    assert memory.page_limit == 512 * MB - 3 * batch
    with pytest.raises(
        TrainError,
        match=r"train.host_ram_mb 64 cannot hold 3 micro-batches .*"
        r"set train.host_ram_mb to at least \d+.*prefetch_batches",
    ):
        data_memory({**cfg, "host_ram_mb": 64}, [info])


def test_pages_read_past_the_limit_are_given_back():
    class Fake:
        released = 0

        def release(self):
            self.released += 1

    memory, a, b = DataMemory(100), Fake(), Fake()
    memory.add(a)
    memory.add(b)
    for _ in range(5):
        memory.reading(40)  # 40, 80, then 120 > 100: release, count restarts at 40
    assert (a.released, b.released, memory.releases, memory.read) == (2, 2, 2, 40)
    memory.discard(a)
    memory.reading(100)
    assert (a.released, b.released) == (3, 3)


RSS_PROBE = textwrap.dedent("""
    import sys, torch
    from eaglet.data import shards
    from eaglet.stages.train.data import DataMemory, Samples, index_shard, make_batch

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    path, sha, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
    info = index_shard(path, 1000, sha)
    samples = Samples([info], 0, DataMemory(limit))
    t2d = torch.ones(1000, dtype=torch.bool)
    base = status("VmHWM")
    samples.preload()            # the hash check: the whole file, read in blocks
    tokens = 0
    for index in range(len(samples)):  # one 1024-row sample a batch, as the loop builds it
        batch = make_batch([samples.get(index, 10**9)], 3, t2d).to(torch.device("cpu"))
        tokens += batch.num_tokens
        del batch
    print(status("VmHWM") - base, tokens, samples.memory.releases)
""")


@pytest.mark.subprocess
def test_reading_a_large_shard_keeps_peak_rss_far_below_it(tmp_path):
    """A ~300 MB bf16 shard, hash-checked and read through completely, raises the peak
    resident memory (mapped pages included) by the page limit and a batch, not the shard.
    Measured in a fresh interpreter so that nothing else this test session did counts."""
    hidden, rows, blocks = 1024, 2048, 18
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(rows, 3 * hidden, generator=g).to(torch.bfloat16)
    final = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
    n = rows * blocks
    offsets = torch.arange(0, n + 1, 1024)
    path = tmp_path / "shard_00000.safetensors"
    written = shards.write(
        path,
        torch.randint(0, 1000, (n,), generator=g),
        torch.ones(n, dtype=torch.uint8),
        offsets,
        torch.full((n,), -1),
        [aux] * blocks,
        [final] * blocks,  # one block repeated: little memory
        sample_ids=[f"p-{i}" for i in range(len(offsets) - 1)],
        aux_layer_ids=AUX_IDS,
        dtype="bfloat16",
        target={"spec": "x"},
    )
    del aux, final
    assert written.bytes > 290e6
    limit = 24 * MB
    out = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, str(path), written.sha256, str(limit)],
        check=True,
        capture_output=True,
        text=True,
        timeout=180,
    ).stdout
    extra, tokens, releases = map(int, out.split())
    assert tokens == n and releases >= written.bytes // limit - 1
    # the limit, a batch (1024 rows: 8 MB in bf16, 16 MB in float32) and allocator slack
    assert extra < written.bytes / 4, f"reading raised the peak RSS by {extra / 1e6:.0f} MB"


def test_prefetch_depth_packs_ahead_on_gpus_only_unless_set():
    """null: a packing thread beside the step pays where a GPU computes; on the CPU it takes
    the cores the step uses (0.65x the demo's training tokens/s on 2 cores)."""
    from eaglet.stages.train.data import prefetch_depth

    assert prefetch_depth(None, torch.device("cuda")) == 2
    assert prefetch_depth(None, torch.device("cpu")) == 0
    assert (
        prefetch_depth(3, torch.device("cpu")) == 3 and prefetch_depth(0, torch.device("cuda")) == 0
    )
