"""Hidden-state extraction on a tiny random Llama: layer-id semantics, padding, batching,
the teacher-agreement check against greedy data, fp8 storage, and the manifest's resume and
corruption handling."""

from __future__ import annotations

import math
import os
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from torch.utils._python_dispatch import TorchDispatchMode

import eaglet.stages.extract.hf as extract_mod
import eaglet.stages.extract.manifest as manifest_mod
from eaglet.core.config import validate
from eaglet.core.io import read_json, write_json, write_jsonl
from eaglet.core.methods import default_aux_layer_ids
from eaglet.data import shards
from eaglet.stages.extract.hf import (
    ShardJob,
    extract_shard,
    forward_batch,
    load_target,
    run_shard,
    run_shards,
    token_budget_batches,
)
from eaglet.stages.extract.manifest import build_manifest
from eaglet.target.checkpoint import prepare_target
from eaglet.target.hooks import AuxCapture, decoder_layers
from eaglet.target.states import (
    ExtractionError,
    Target,
    check_disk,
    predicting_rows,
    resolve_aux_layer_ids,
    sequence,
    shard_bounds,
    target_identity,
    teacher_from_stored,
)
from tests.tiny_llama import (
    LAYERS,
    greedy_records,
    make_tiny_llama,
    one_thread,
    random_records,
    record,
)

# ids of three distinct layers of the 6-layer model (its vLLM default is (2, 3, 3); see
# test_default_aux_ids_of_a_six_layer_model_extract)
AUX = [1, 3, 4]


def ext_cfg(**overrides) -> dict:
    base = {
        "backend": "hf",
        "device": "cpu",
        "dtype": "float32",
        "max_len": 64,
        "batch_tokens": 48,
        "num_shards": 2,
        "aux_layer_ids": AUX,
    }
    base.update(overrides)
    return validate({"extract": base})["extract"]


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    model_dir = root / "model"
    model = make_tiny_llama(model_dir, seed=0)
    info = prepare_target(str(model_dir), root / "target")
    return SimpleNamespace(
        model=model, dir=model_dir, info=info, target_json=root / "target" / "target.json"
    )


@pytest.fixture(scope="module")
def target(tiny) -> Target:
    return load_target(str(tiny.dir), "float32", "cpu")


@pytest.fixture(scope="module")
def greedy(tiny) -> list[dict]:
    return greedy_records(tiny.model, n=6, seed=0)


@torch.inference_mode()
def reference_states(model, ids: list[int]):
    """HF's own hidden_states (all L+1 of them) and logits of one unpadded sequence."""
    out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    return [h[0] for h in out.hidden_states], out.logits[0]


# -- layer ids -------------------------------------------------------------------------------


def test_aux_id_i_is_the_input_of_decoder_layer_i(target):
    ids = [5, 17, 42, 99, 3, 250, 7, 1]
    hidden_states, logits = reference_states(target.model, ids)
    assert len(hidden_states) == LAYERS + 1
    for layer_ids in ([1, 2, 5], [1, 3, 4]):
        capture = AuxCapture(decoder_layers(target.model), layer_ids)
        try:
            aux, final = forward_batch(target, capture, [ids])
        finally:
            capture.close()
        assert aux.shape == (len(ids), 3 * target.hidden_size)
        for k, layer in enumerate(layer_ids):
            got = aux[:, k * target.hidden_size : (k + 1) * target.hidden_size]
            torch.testing.assert_close(got, hidden_states[layer], rtol=0, atol=1e-6)
    # id 0 is the embedding output itself
    torch.testing.assert_close(
        hidden_states[0], target.model.get_input_embeddings()(torch.tensor(ids)), rtol=0, atol=0
    )
    # the final state is what lm_head reads (after the final norm); in transformers 5.19 that is
    # also hidden_states[-1], which is therefore *not* the output of the last decoder layer
    torch.testing.assert_close(final, hidden_states[-1], rtol=0, atol=1e-6)
    torch.testing.assert_close(final @ target.lm_head.T, logits, rtol=0, atol=1e-5)
    assert target.lm_head.shape == (300, 64) and target.vocab_size == 300
    assert target.num_layers == LAYERS and target.hidden_size == 64
    # the hooks are gone after close
    assert all(not layer._forward_pre_hooks for layer in decoder_layers(target.model))


def test_right_padding_does_not_change_any_sequence(target):
    seqs = [[3, 9, 27], list(range(40, 57)), [200, 1, 5, 8, 13, 21, 34, 55, 89]]
    capture = AuxCapture(decoder_layers(target.model), AUX)
    try:
        aux, final = forward_batch(target, capture, seqs)
        alone = [forward_batch(target, capture, [s]) for s in seqs]
    finally:
        capture.close()
    assert aux.shape == (sum(map(len, seqs)), 3 * 64) and final.shape == (29, 64)
    start = 0
    for s, (aux1, final1) in zip(seqs, alone):
        torch.testing.assert_close(aux[start : start + len(s)], aux1, rtol=0, atol=1e-5)
        torch.testing.assert_close(final[start : start + len(s)], final1, rtol=0, atol=1e-5)
        start += len(s)
    assert not capture.captured  # everything taken, nothing left over for the next batch


def test_resolve_aux_layer_ids():
    assert default_aux_layer_ids(30) == [2, 15, 27]
    assert default_aux_layer_ids(32) == [2, 16, 29]
    assert resolve_aux_layer_ids(None, 30) == [2, 15, 27]
    assert resolve_aux_layer_ids([], 30) == [2, 15, 27]
    assert resolve_aux_layer_ids([0, 1, 29], 30) == [0, 1, 29]
    with pytest.raises(ExtractionError, match=r"\[30\] are outside 0\.\.29"):
        resolve_aux_layer_ids([2, 15, 30], 30)
    with pytest.raises(ExtractionError, match=r"\[-1\]"):
        resolve_aux_layer_ids([-1, 15, 27], 30)
    for wrong in ([2, 15], [2, 15, 27, 28]):
        with pytest.raises(ExtractionError, match=r"extract\.aux_layer_ids needs 3"):
            resolve_aux_layer_ids(wrong, 30)
    with pytest.raises(ExtractionError, match="outside"):  # too few layers for the default
        resolve_aux_layer_ids(None, 2)


def test_default_aux_ids_of_a_six_layer_model_extract(target):
    ids = resolve_aux_layer_ids(None, LAYERS)
    assert ids == [2, 3, 3]
    capture = AuxCapture(decoder_layers(target.model), ids)
    try:
        aux, _ = forward_batch(target, capture, [[1, 2, 3, 4]])
    finally:
        capture.close()
    assert torch.equal(aux[:, 64:128], aux[:, 128:])


# -- the batch loop: packing on the device, copies to the host -------------------------------


@torch.inference_mode()
def per_sample_states(target, seqs, batch_tokens, layer_ids):
    """The batch loop as it was before the copies overlapped the forward: padding dropped by
    a boolean mask, every sample copied to the host on its own. The oracle of hf_states."""
    lengths = [len(s) for s in seqs]
    aux_rows, final_rows = [None] * len(seqs), [None] * len(seqs)
    capture = AuxCapture(decoder_layers(target.model), layer_ids)
    try:
        for batch in token_budget_batches(lengths, batch_tokens):
            longest = max(lengths[i] for i in batch)
            ids = torch.zeros(len(batch), longest, dtype=torch.long)
            attention = torch.zeros(len(batch), longest, dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, : lengths[i]] = torch.tensor(seqs[i])
                attention[row, : lengths[i]] = 1
            out = target.model.get_decoder()(
                input_ids=ids, attention_mask=attention, use_cache=False
            )
            keep = attention.bool()
            aux = torch.cat(capture.take(), dim=-1)[keep]
            final = out.last_hidden_state[keep]
            start = 0
            for i in batch:
                aux_rows[i] = aux[start : start + lengths[i]].cpu()
                final_rows[i] = final[start : start + lengths[i]].cpu()
                start += lengths[i]
    finally:
        capture.close()
    return aux_rows, final_rows


def uneven_seqs(n: int = 11, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 2] + torch.randint(3, 40, (n - 2,), generator=g).tolist()  # a one-row batch too
    return [torch.randint(0, 300, (n_,), generator=g).tolist() for n_ in lengths]


@pytest.mark.parametrize("depth, staged", [(2, None), (1, True), (2, True), (3, True)])
@pytest.mark.parametrize("dtype", ["float32", "fp8"])
def test_a_streamed_shard_holds_each_sample_s_states_and_teacher(
    target, depth, staged, dtype, tmp_path
):
    """Batches of uneven sizes, longest first, written at their samples' places while the
    next batch runs (through reused staging buffers or not): every sample's stored states
    are its states computed alone with a padding mask (the oracle), and the teacher is the
    one computed from the stored final states afterwards (the former path)."""
    seqs = uneven_seqs()
    records = [record(f"p-{i}", s[: len(s) // 2], s[len(s) // 2 :]) for i, s in enumerate(seqs)]
    cfg = ext_cfg(batch_tokens=60, dtype=dtype, min_teacher_agreement=0.0)  # random answers
    batches = token_budget_batches([len(s) for s in seqs], cfg["batch_tokens"])
    assert len(batches) >= 4 and len({len(b) for b in batches}) > 1
    seen = []
    progress = SimpleNamespace(advance=lambda done, tokens: seen.append((done, tokens)))
    path = tmp_path / "shard.safetensors"
    shard = extract_mod.stream_shard(
        target, records, cfg, AUX, {"spec": "tiny"}, path, progress, depth=depth, staged=staged
    )
    meta = extract_mod.finish_shard(
        target, shard, cfg, AUX, {"spec": "tiny"}, path, path.with_suffix(".json")
    )
    got = shards.load(path, meta["sha256"])
    want_aux, want_final = per_sample_states(target, seqs, cfg["batch_tokens"], AUX)
    want_aux, want_final = torch.cat(want_aux), torch.cat(want_final)
    if dtype == "fp8":  # the oracle's states through the same quantization
        want_aux = shards.dequantize_fp8(*shards.quantize_fp8(want_aux, 3))
        want_final = shards.dequantize_fp8(*shards.quantize_fp8(want_final, 1))
    tolerance = {"rtol": 0.07, "atol": 1e-4} if dtype == "fp8" else {"rtol": 0, "atol": 1e-5}
    torch.testing.assert_close(got.aux_hidden, want_aux, **tolerance)
    torch.testing.assert_close(got.final_hidden, want_final, **tolerance)
    rows = predicting_rows(got.loss_mask, got.offsets)
    argmax, logprob = teacher_from_stored(
        target, got.final_hidden, torch.roll(got.input_ids, -1), rows
    )
    assert torch.equal(got.teacher_argmax, argmax)
    assert torch.equal(torch.isnan(shard.logprob), torch.isnan(logprob))
    torch.testing.assert_close(shard.logprob[rows], logprob[rows], rtol=0, atol=1e-5)
    # every batch reported once, in order, with its tokens
    assert seen == [(len(b), sum(len(seqs[i]) for i in b)) for b in batches]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard.json", "shard.safetensors"]


def tagged(rows: int, width: int, tag: int) -> torch.Tensor:
    """Rows whose every value names its batch and row."""
    return (tag * 1000 + torch.arange(rows)[:, None] * 10 + torch.arange(width)[None, :]).float()


@pytest.mark.parametrize("depth, overlap", [(1, True), (2, True), (3, True), (2, False)])
@pytest.mark.parametrize("staged", [False, True])
def test_the_batch_writer_puts_every_row_at_its_place(depth, overlap, staged, tmp_path):
    lengths = [5, 1, 9, 3, 7, 1, 2, 4]
    starts = torch.tensor([0, *lengths]).cumsum(0).tolist()
    batches = [[2, 4], [0, 3, 7], [1, 5, 6]]  # out of shard order, as extraction runs them
    fields = [
        shards.Field("aux_hidden", torch.float32, (sum(lengths), 6)),
        shards.Field("final_hidden", torch.float32, (sum(lengths), 2)),
    ]
    out = shards.ShardFile(tmp_path / "x.safetensors", fields, {})
    writer = extract_mod.BatchWriter(
        out, sum(lengths), 16, torch.device("cpu"), depth, staged, overlap=overlap
    )
    for tag, batch in enumerate(batches):
        rows = sum(lengths[i] for i in batch)
        whole = tagged(rows, 8, tag)
        places, at = [], 0
        for i in batch:
            places.append((starts[i], at, lengths[i]))
            at += lengths[i]
        teacher_rows = torch.tensor([starts[batch[0]]])
        writer.put(
            {
                "aux_hidden": whole[:, :6],
                "final_hidden": whole[:, 6:].contiguous(),
                "teacher_argmax": torch.tensor([tag]),
                "teacher_logprob": torch.tensor([-1.0]),
            },
            places,
            teacher_rows,
        )
    writer.finish()
    out.close()
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as handle:
        aux, final = handle.get_tensor("aux_hidden"), handle.get_tensor("final_hidden")
    for tag, batch in enumerate(batches):
        whole, at = tagged(sum(lengths[i] for i in batch), 8, tag), 0
        for i in batch:
            span = slice(starts[i], starts[i] + lengths[i])
            assert torch.equal(aux[span], whole[at : at + lengths[i], :6]), (tag, i)
            assert torch.equal(final[span], whole[at : at + lengths[i], 6:]), (tag, i)
            at += lengths[i]
        assert writer.argmax[starts[batch[0]]] == tag and writer.logprob[starts[batch[0]]] == -1
    assert int((writer.argmax >= 0).sum()) == len(batches)


def test_an_error_in_the_batch_writer_reaches_the_caller(tmp_path):
    fields = [shards.Field("aux_hidden", torch.float32, (4, 2))]
    with shards.ShardFile(tmp_path / "x.safetensors", fields, {}) as out:
        writer = extract_mod.BatchWriter(out, 4, 4, torch.device("cpu"), 2, staged=True)
        writer.put({"aux_hidden": torch.zeros(4, 2)}, [(0, 0, 4)], torch.zeros(0, dtype=torch.long))
        writer.put({"aux_hidden": torch.zeros(1, 2)}, [(3, 0, 1)], torch.zeros(0, dtype=torch.long))
        with pytest.raises(ValueError, match="written twice"):
            for _ in range(50):  # raised by a later put or by finish
                writer.put({"aux_hidden": torch.zeros(0, 2)}, [], torch.zeros(0, dtype=torch.long))
            writer.finish()
        out.abort()
    assert list(tmp_path.iterdir()) == []


class DeviceWaits(TorchDispatchMode):
    """The ops that make the host wait for the device: a value read back (item, bool of a
    tensor) or a result whose size is data (nonzero, masked_select, a boolean-mask index)."""

    READS = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.item")
    SIZED = ("aten.nonzero", "aten.masked_select")

    def __init__(self):
        super().__init__()
        self.reads, self.sized = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(self.READS):
            self.reads.append(name)
        bool_index = name.startswith("aten.index") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for a in args
            if isinstance(a, (list, tuple))
            for i in a
        )
        if name.startswith(self.SIZED) or bool_index:
            self.sized.append(name)
        return func(*args, **(kwargs or {}))


def test_forward_batch_does_not_wait_for_the_device(target):
    """Dropping the padding with a boolean mask waits for the device (how many rows remain is
    data); eaglet gathers rows whose indices the host knows. No attention mask is passed
    (right padding under causal attention needs none), so transformers reads none back;
    it still reads back one flag of the position ids it makes."""
    capture = AuxCapture(decoder_layers(target.model), AUX)
    try:
        with DeviceWaits() as waits:
            aux, final = forward_batch(target, capture, [[1, 2, 3], [4, 5, 6, 7, 8]])
    finally:
        capture.close()
    assert aux.shape == (8, 192) and final.shape == (8, 64)
    assert waits.sized == []
    # transformers' own check of its position ids for packed sequences, nothing per sample
    assert len(waits.reads) <= 1


# -- batching and bounds ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("budget", [1, 16, 100, 1000])
def test_token_budget_batches(seed, budget):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(
        1, 120, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g
    ).tolist()
    batches = token_budget_batches(lengths, budget)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(lengths)))  # every index once
    assert flat == sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))  # longest first
    for batch in batches:
        padded = max(lengths[i] for i in batch) * len(batch)
        assert padded <= budget or len(batch) == 1  # within the budget
        if max(lengths[i] for i in batch) > budget:
            assert len(batch) == 1  # too long: alone


def test_token_budget_batches_examples():
    assert token_budget_batches([5, 100, 5, 5], 50) == [[1], [0, 2, 3]]
    assert token_budget_batches([10, 10, 10, 10], 20) == [[0, 1], [2, 3]]
    assert token_budget_batches([10, 10, 10], 29) == [[0, 1], [2]]
    assert token_budget_batches([], 10) == []


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("num_samples", [0, 1, 5, 16, 17, 433])
def test_shard_bounds_cover_everything_once(num_samples, num_shards):
    bounds = [shard_bounds(num_samples, num_shards, i) for i in range(num_shards)]
    assert bounds[0][0] == 0 and bounds[-1][1] == num_samples
    for (_, hi), (lo, _) in zip(bounds, bounds[1:]):
        assert hi == lo  # contiguous
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1  # balanced
    assert [i for lo, hi in bounds for i in range(lo, hi)] == list(range(num_samples))


def test_sequence_mask_and_truncation():
    r = record("p-1", [1, 2, 3], [4, 5, 6, 7])
    assert sequence(r, 100) == ([1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 1, 1, 1, 1], False)
    assert sequence(r, 7) == ([1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 1, 1, 1, 1], False)
    assert sequence(r, 5) == ([1, 2, 3, 4, 5], [0, 0, 0, 1, 1], True)
    assert sequence(r, 2) == ([1, 2], [0, 0], True)
    assert sequence(record("p-2", [], [9, 8]), 10) == ([9, 8], [1, 1], False)


# -- extract_shard ---------------------------------------------------------------------------


def extract(target, records, tmp_path, name="shard_00000", aux=AUX, identity=None, **cfg):
    path = tmp_path / f"{name}.safetensors"
    meta = extract_shard(
        target,
        records,
        ext_cfg(**cfg),
        aux,
        identity or {"spec": "tiny"},
        path,
        path.with_suffix(".json"),
    )
    return meta, path


@pytest.fixture(scope="module")
def greedy_shard(target, greedy, tmp_path_factory):
    meta, path = extract(target, greedy, tmp_path_factory.mktemp("greedy"))
    return SimpleNamespace(meta=meta, path=path, shard=shards.load(path))


def test_greedy_shard_contents(greedy_shard, greedy):
    shard, meta = greedy_shard.shard, greedy_shard.meta
    ids = [t for r in greedy for t in r["prompt_token_ids"] + r["completion_token_ids"]]
    mask = [
        m
        for r in greedy
        for m in [0] * len(r["prompt_token_ids"]) + [1] * len(r["completion_token_ids"])
    ]
    lengths = [len(r["prompt_token_ids"]) + len(r["completion_token_ids"]) for r in greedy]
    # the fixture exercises padded multi-sequence batches (of unequal lengths)
    assert any(
        len(b) > 1 and len({lengths[i] for i in b}) > 1
        for b in token_budget_batches(lengths, ext_cfg()["batch_tokens"])
    )
    assert shard.input_ids.tolist() == ids  # in record order, not batch order
    assert shard.loss_mask.tolist() == mask
    assert shard.offsets.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert shard.sample_ids == [r["id"] for r in greedy]
    assert shard.aux_layer_ids == AUX and shard.dtype == "float32"
    assert shard.target == {"spec": "tiny"}
    completion = sum(len(r["completion_token_ids"]) for r in greedy)
    assert meta["tokens"] == len(ids) and meta["loss_tokens"] == completion
    assert meta["num_samples"] == 6 and meta["samples"] == shard.sample_ids
    assert meta["truncated"] == 0 and meta["greedy"] is True
    assert meta["sha256"] == shards.digest_path(greedy_shard.path)
    assert meta["bytes"] == greedy_shard.path.stat().st_size
    assert meta["tensor_bytes"] == len(ids) * shards.bytes_per_token(64, 3, "float32")
    assert read_json(greedy_shard.path.with_suffix(".json")) == meta


def test_greedy_shard_teacher_agrees(greedy_shard, greedy):
    teacher = greedy_shard.meta["teacher"]
    # every completion token is predicted by the position before it (prompts are non-empty)
    assert teacher["positions"] == sum(len(r["completion_token_ids"]) for r in greedy)
    assert teacher["agreement"] == 1.0
    # the argmax token has probability >= 1/V
    assert -math.log(300) <= teacher["mean_logprob"] < 0
    assert all(
        w["agreement"] == 1.0 and w["mean_logprob"] >= -math.log(300) for w in teacher["worst"]
    )
    assert len(teacher["worst"]) == 5


def test_stored_states_match_each_sequence_alone(greedy_shard, greedy, target):
    shard = greedy_shard.shard
    for s, r in enumerate(greedy):
        hidden_states, logits = reference_states(
            target.model, r["prompt_token_ids"] + r["completion_token_ids"]
        )
        rows = shard.sample(s)
        want_aux = torch.cat([hidden_states[i] for i in AUX], dim=-1)
        torch.testing.assert_close(shard.aux_hidden[rows], want_aux, rtol=0, atol=1e-5)
        torch.testing.assert_close(shard.final_hidden[rows], hidden_states[-1], rtol=0, atol=1e-5)
        # the teacher at every row that predicts a completion token, -1 (not computed) elsewhere
        n_prompt = len(r["prompt_token_ids"])
        want = torch.full_like(shard.teacher_argmax[rows], -1)
        want[n_prompt - 1 : -1] = logits.argmax(-1)[n_prompt - 1 : -1]
        assert torch.equal(shard.teacher_argmax[rows], want)


def assert_teacher_of_stored_state(shard, target):
    """The stored teacher is the argmax of the final state training reads back, at exactly the
    rows whose next token is a completion token."""
    rows = predicting_rows(shard.loss_mask, shard.offsets)
    assert rows.sum() == shard.loss_mask.sum() and not rows[shard.offsets[1:] - 1].any()
    argmax = (shard.final_hidden @ target.lm_head.T).argmax(-1)
    assert torch.equal(shard.teacher_argmax[rows], argmax[rows])
    assert (shard.teacher_argmax[~rows] == -1).all()


def test_teacher_argmax_is_argmax_of_the_stored_final_state(greedy_shard, target):
    assert_teacher_of_stored_state(greedy_shard.shard, target)


def test_truncation_is_counted(target, greedy, tmp_path):
    meta, path = extract(target, greedy[:3], tmp_path, max_len=12)
    shard = shards.load(path)
    full = [len(r["prompt_token_ids"]) + len(r["completion_token_ids"]) for r in greedy[:3]]
    assert meta["truncated"] == sum(n > 12 for n in full) > 0
    assert shard.offsets.diff().tolist() == [min(n, 12) for n in full]
    for s, r in enumerate(greedy[:3]):
        assert (
            shard.input_ids[shard.sample(s)].tolist()
            == (r["prompt_token_ids"] + r["completion_token_ids"])[:12]
        )
    assert meta["teacher"]["agreement"] == 1.0


def test_random_completions_fail_the_greedy_check(target, greedy, tmp_path):
    wrong = random_records(n=2, seed=7)
    records = greedy[:4] + wrong
    with pytest.raises(ExtractionError) as info:
        extract(target, records, tmp_path)
    message = str(info.value)
    assert "extract.min_teacher_agreement=99.00%" in message
    for r in wrong:
        assert r["id"] in message
    # the worst samples are named first (five at most)
    named = [r["id"] for r in greedy[:4] if r["id"] in message]
    assert len(named) == 3
    assert (
        message.index("Worst samples:")
        < max(message.index(r["id"]) for r in wrong)
        < min(message.index(i) for i in named)
    )
    meta = read_json(tmp_path / "shard_00000.json")
    assert meta["teacher"]["agreement"] < 0.8
    assert {w["id"] for w in meta["teacher"]["worst"][:2]} == {r["id"] for r in wrong}


def test_random_completions_alone_fail_too(target, tmp_path):
    with pytest.raises(ExtractionError, match=r"teacher agreement \d+\.\d+% .* is below"):
        extract(target, random_records(n=3, seed=11), tmp_path)


def test_sampled_records_are_reported_not_enforced(target, tmp_path):
    sampled = random_records(n=3, seed=5, temperature=0.8)
    meta, _ = extract(target, sampled, tmp_path)
    assert meta["greedy"] is False
    teacher = meta["teacher"]
    assert 0 <= teacher["agreement"] < 0.5
    assert teacher["positions"] == sum(len(r["completion_token_ids"]) for r in sampled)
    # random tokens from a near-uniform 300-way distribution: log-prob near -log(300)
    assert -8 < teacher["mean_logprob"] < -3


def test_threshold_is_configurable(target, greedy, tmp_path):
    records = greedy[:4] + random_records(n=2, seed=7)
    meta, _ = extract(target, records, tmp_path, min_teacher_agreement=0.5)
    assert 0.5 <= meta["teacher"]["agreement"] < 0.99


def test_fp8_shards_are_smaller_and_still_agree(target, greedy, tmp_path):
    metas = {}
    for dtype in ("float32", "bfloat16", "fp8"):
        meta, path = extract(
            target, greedy, tmp_path, name=f"shard_{dtype}", dtype=dtype, min_teacher_agreement=0.0
        )
        shard = shards.load(path)
        # the stored teacher is the argmax of what training will read back
        assert_teacher_of_stored_state(shard, target)
        metas[dtype] = meta
    ratio = metas["fp8"]["bytes"] / metas["bfloat16"]["bytes"]
    summary = (
        f"\n[fp8 vs bf16] bytes fp8={metas['fp8']['bytes']} bf16={metas['bfloat16']['bytes']} "
        f"f32={metas['float32']['bytes']} ratio={ratio:.3f}; agreement "
        + " ".join(
            f"{d}={m['teacher']['agreement']:.4f}/{m['teacher']['mean_logprob']:.4f}"
            for d, m in metas.items()
        )
    )
    print(summary)  # shown with -s or on failure
    assert 0.5 <= ratio <= 0.6, summary
    assert metas["float32"]["teacher"]["agreement"] == 1.0
    assert metas["bfloat16"]["teacher"]["agreement"] >= 0.9
    assert metas["fp8"]["teacher"]["agreement"] >= 0.9, summary
    for meta in metas.values():
        assert meta["teacher"]["mean_logprob"] == pytest.approx(
            metas["float32"]["teacher"]["mean_logprob"], abs=0.05
        )


# -- disk ------------------------------------------------------------------------------------


def test_check_disk_names_both_numbers(tmp_path, monkeypatch):
    free = 3 * 2**30
    monkeypatch.setattr(
        shutil,
        "disk_usage",
        lambda path: SimpleNamespace(total=10 * 2**30, used=7 * 2**30, free=free),
    )
    check_disk(tmp_path / "hidden", free)  # exactly enough is enough
    assert (tmp_path / "hidden").is_dir()
    with pytest.raises(ExtractionError) as info:
        check_disk(tmp_path / "hidden", int(7.5 * 2**30))
    assert "7.50 GiB" in str(info.value) and "3.00 GiB" in str(info.value)
    assert "extract.dtype: fp8" in str(info.value)


# -- the stage: run_shard, build_manifest ----------------------------------------------------


def stage_cfg(**overrides) -> dict:
    return {"extract": ext_cfg(**overrides), "target": {"dtype": "float32"}}


@pytest.fixture(scope="module")
def extracted(tiny, greedy, tmp_path_factory):
    """Two shards of the greedy records, extracted by the rule's entry point."""
    root = tmp_path_factory.mktemp("stage")
    data = root / "synthetic" / "train.jsonl"
    write_jsonl(data, greedy)
    hidden = root / "hidden"
    metas = [
        run_shard(
            stage_cfg(),
            str(tiny.target_json),
            str(data),
            i,
            2,
            str(shards.shard_path(hidden, i)),
            str(shards.shard_path(hidden, i).with_suffix(".json")),
            progress_path=str(root / "progress" / f"extract_{i}.json"),
        )
        for i in range(2)
    ]
    return SimpleNamespace(
        root=root, data=data, hidden=hidden, metas=metas, sha=[m["sha256"] for m in metas]
    )


@pytest.fixture
def hidden_copy(extracted, tmp_path):
    dst = tmp_path / "hidden"
    shutil.copytree(extracted.hidden, dst)
    return dst


@pytest.fixture
def extract_calls(monkeypatch):
    """Names of the shards that build_manifest extracts again."""
    calls = []
    real = extract_mod.extract_shard

    def counting(
        target, records, cfg, aux_layer_ids, identity, shard_path, meta_path, progress=None
    ):
        calls.append(Path(shard_path).name)
        return real(target, records, cfg, aux_layer_ids, identity, shard_path, meta_path, progress)

    monkeypatch.setattr(manifest_mod, "extract_shard", counting)
    return calls


def manifest_of(tiny, extracted, hidden, cfg=None, target_json=None):
    return build_manifest(
        cfg or stage_cfg(),
        str(target_json or tiny.target_json),
        str(extracted.data),
        2,
        str(hidden),
        str(hidden / "manifest.json"),
    )


def assert_same_shard(a: Path, b: Path) -> None:
    """Same tensors and same header content (the bytes may differ: see
    test_rebuilt_shards_are_byte_identical)."""
    assert shards.read_metadata(a) == shards.read_metadata(b)
    sa, sb = shards.load(a), shards.load(b)
    for name in (
        "input_ids",
        "loss_mask",
        "offsets",
        "teacher_argmax",
        "aux_hidden",
        "final_hidden",
    ):
        assert torch.equal(getattr(sa, name), getattr(sb, name)), name


def test_rebuilt_shards_are_byte_identical(target, greedy, tmp_path):
    hashes = {
        extract(target, greedy[:2], tmp_path, name=f"shard_{k}")[0]["sha256"] for k in range(4)
    }
    assert len(hashes) == 1


def test_run_shard_writes_contiguous_blocks(extracted, greedy, tiny):
    assert [m["samples"] for m in extracted.metas] == [
        [r["id"] for r in greedy[:3]],
        [r["id"] for r in greedy[3:]],
    ]
    for i, meta in enumerate(extracted.metas):
        shard = shards.load(shards.shard_path(extracted.hidden, i))
        assert shard.target == target_identity(tiny.info)
        assert shard.target["config_sha256"] == tiny.info["config_sha256"]
        assert meta["teacher"]["agreement"] == 1.0
        progress = read_json(extracted.root / "progress" / f"extract_{i}.json")
        assert progress["state"] == "finished" and progress["done"] == 3


def shard_job(data, count, index, directory) -> ShardJob:
    path = shards.shard_path(directory, index)
    return ShardJob(str(data), count, index, str(path), str(path.with_suffix(".json")))


def test_one_job_writes_every_shard_with_one_target_load(
    tiny, extracted, greedy, tmp_path, monkeypatch
):
    """extract.jobs: one: the training shards and the held-out one from one target load, the
    same bytes as one job per shard, each finished (digest, fsync, record) by a thread of its
    own beside the next shard's forward."""
    loads, writers = [], []
    real_load, real_finish = extract_mod.load_target, extract_mod.finish_shard
    monkeypatch.setattr(
        extract_mod, "load_target", lambda *a, **k: loads.append(a) or real_load(*a, **k)
    )
    monkeypatch.setattr(
        extract_mod,
        "finish_shard",
        lambda *a, **k: writers.append(threading.current_thread().name) or real_finish(*a, **k),
    )
    eval_data = tmp_path / "eval.jsonl"
    write_jsonl(eval_data, greedy[:2])
    hidden = tmp_path / "hidden"
    jobs = [shard_job(extracted.data, 2, i, hidden) for i in range(2)]
    jobs.append(shard_job(eval_data, 1, 0, hidden / "eval"))
    metas = run_shards(
        stage_cfg(), str(tiny.target_json), jobs, progress_path=str(tmp_path / "progress.json")
    )
    assert len(loads) == 1
    assert [m["sha256"] for m in metas[:2]] == extracted.sha  # as the per-shard jobs wrote them
    assert [shards.digest_path(j.shard) for j in jobs] == [m["sha256"] for m in metas]
    assert [read_json(j.meta)["sha256"] for j in jobs] == [m["sha256"] for m in metas]
    assert metas[2]["samples"] == [r["id"] for r in greedy[:2]]
    assert all(m["teacher"]["agreement"] == 1.0 for m in metas)
    assert len(writers) == 3 and all(name.startswith("shard-finish") for name in writers)
    progress = read_json(tmp_path / "progress.json")
    assert progress["state"] == "finished" and progress["done"] == len(greedy) + 2


def test_one_job_stops_at_a_shard_that_fails_its_check(tiny, greedy, tmp_path):
    data = tmp_path / "train.jsonl"
    write_jsonl(data, greedy[:3] + random_records(n=3, seed=7))
    hidden = tmp_path / "hidden"
    jobs = [shard_job(data, 2, i, hidden) for i in range(2)]
    with pytest.raises(ExtractionError, match="teacher agreement"):
        run_shards(stage_cfg(), str(tiny.target_json), jobs)
    assert read_json(jobs[0].meta)["teacher"]["agreement"] == 1.0  # the good shard is kept
    assert read_json(jobs[1].meta)["teacher"]["agreement"] < 0.99


def test_manifest_reuses_matching_shards(tiny, extracted, hidden_copy, extract_calls, monkeypatch):
    before = [os.stat(shards.shard_path(hidden_copy, i)) for i in range(2)]
    monkeypatch.setattr(
        manifest_mod,
        "load_target",
        lambda *a, **k: pytest.fail("loaded the target with nothing to extract"),
    )
    manifest = manifest_of(tiny, extracted, hidden_copy)
    assert extract_calls == []
    after = [os.stat(shards.shard_path(hidden_copy, i)) for i in range(2)]
    assert [(s.st_ino, s.st_mtime_ns) for s in before] == [(s.st_ino, s.st_mtime_ns) for s in after]
    assert read_json(hidden_copy / "manifest.json") == manifest
    # totals are the sums over the shards
    metas = extracted.metas
    assert manifest["num_shards"] == 2
    for key in ("num_samples", "tokens", "loss_tokens", "truncated", "bytes"):
        assert manifest[key] == sum(m[key] for m in metas), key
    assert manifest["bytes_per_token"] == pytest.approx(manifest["bytes"] / manifest["tokens"])
    assert [s["sha256"] for s in manifest["shards"]] == extracted.sha
    assert manifest["aux_layer_ids"] == AUX and manifest["dtype"] == "float32"
    assert manifest["hidden_size"] == 64 and manifest["max_len"] == 64
    assert manifest["target"] == target_identity(tiny.info)
    assert manifest["greedy"] is True and manifest["teacher_agreement"] == 1.0
    positions = sum(m["teacher"]["positions"] for m in metas)
    assert manifest["teacher_mean_logprob"] == pytest.approx(
        sum(m["teacher"]["mean_logprob"] * m["teacher"]["positions"] for m in metas) / positions
    )


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "delete_sidecar"])
def test_manifest_rebuilds_exactly_the_damaged_shard(
    tiny, extracted, hidden_copy, extract_calls, damage
):
    bad = shards.shard_path(hidden_copy, 1)
    good_stat = os.stat(shards.shard_path(hidden_copy, 0))
    data = bad.read_bytes()
    if damage == "truncate":
        bad.write_bytes(data[: len(data) - 100])
    elif damage == "flip":
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0x01
        bad.write_bytes(bytes(flipped))
    elif damage == "delete":
        bad.unlink()
    else:
        bad.with_suffix(".json").unlink()
    manifest = manifest_of(tiny, extracted, hidden_copy)
    assert extract_calls == [bad.name]
    # CPU float32 extraction is deterministic: the rebuilt shard holds the same tensors and header
    assert_same_shard(bad, shards.shard_path(extracted.hidden, 1))
    assert [s["sha256"] for s in manifest["shards"]] == [extracted.sha[0], shards.digest_path(bad)]
    assert os.stat(shards.shard_path(hidden_copy, 0)).st_mtime_ns == good_stat.st_mtime_ns
    assert manifest["tokens"] == sum(m["tokens"] for m in extracted.metas)


def test_manifest_lists_and_rebuilds_the_eval_shard(
    tiny, extracted, greedy, hidden_copy, extract_calls
):
    eval_data = hidden_copy.parent / "synthetic" / "eval.jsonl"
    write_jsonl(eval_data, greedy[:2])
    eval_shard = shards.shard_path(hidden_copy / "eval", 0)
    run_shard(
        stage_cfg(),
        str(tiny.target_json),
        str(eval_data),
        0,
        1,
        str(eval_shard),
        str(eval_shard.with_suffix(".json")),
    )
    sha = shards.digest_path(eval_shard)
    extract_calls.clear()
    eval_shard.write_bytes(eval_shard.read_bytes()[:-100])  # truncated after extraction
    manifest = build_manifest(
        stage_cfg(),
        str(tiny.target_json),
        str(extracted.data),
        2,
        str(hidden_copy),
        str(hidden_copy / "manifest.json"),
        eval_data_path=str(eval_data),
    )
    assert extract_calls == [eval_shard.name]  # only the damaged eval shard, from eval data
    assert [(s["file"], s["sha256"], s["samples"]) for s in manifest["eval_shards"]] == [
        ("eval/shard_00000.safetensors", sha, [r["id"] for r in greedy[:2]])
    ]
    assert [s["file"] for s in manifest["shards"]] == [
        "shard_00000.safetensors",
        "shard_00001.safetensors",
    ]
    assert manifest["num_shards"] == 2 and manifest["num_samples"] == len(greedy)


def test_a_held_out_split_of_several_shards_is_listed_and_rebuilt_shard_by_shard(
    tiny, extracted, greedy, hidden_copy, extract_calls
):
    """extract.num_eval_shards 2: contiguous blocks of the held-out samples, as the training
    split's; the damaged one is extracted again from its own block, the other kept."""
    eval_data = hidden_copy.parent / "synthetic" / "eval.jsonl"
    write_jsonl(eval_data, greedy[:3])
    paths = [shards.shard_path(hidden_copy / "eval", i) for i in range(2)]
    for i, path in enumerate(paths):
        run_shard(
            stage_cfg(),
            str(tiny.target_json),
            str(eval_data),
            i,
            2,
            str(path),
            str(path.with_suffix(".json")),
        )
    sha = [shards.digest_path(p) for p in paths]
    extract_calls.clear()
    paths[1].write_bytes(paths[1].read_bytes()[:-100])
    manifest = build_manifest(
        stage_cfg(),
        str(tiny.target_json),
        str(extracted.data),
        2,
        str(hidden_copy),
        str(hidden_copy / "manifest.json"),
        eval_data_path=str(eval_data),
        num_eval_shards=2,
    )
    assert extract_calls == [paths[1].name]
    assert [(s["file"], s["sha256"], s["samples"]) for s in manifest["eval_shards"]] == [
        ("eval/shard_00000.safetensors", sha[0], [greedy[0]["id"]]),
        ("eval/shard_00001.safetensors", sha[1], [r["id"] for r in greedy[1:3]]),
    ]
    assert manifest["num_shards"] == 2


def test_an_empty_held_out_shard_names_its_own_setting(tiny, greedy, tmp_path):
    data = tmp_path / "eval.jsonl"
    write_jsonl(data, greedy[:1])
    shard = shards.shard_path(tmp_path / "hidden" / "eval", 0)  # the one sample is shard 1's
    with pytest.raises(
        ExtractionError,
        match=r"held-out shard 0 of 2 has no samples: lower "
        r"extract.num_eval_shards",
    ):
        run_shard(
            stage_cfg(),
            str(tiny.target_json),
            str(data),
            0,
            2,
            str(shard),
            str(shard.with_suffix(".json")),
        )


@pytest.mark.parametrize(
    "key, value",
    [
        ("aux_layer_ids", [0, 1, 2]),
        ("target", {"spec": "another/model", "config_sha256": "y"}),
        ("dtype", "bfloat16"),
    ],
)
def test_manifest_rebuilds_a_shard_from_another_run(
    tiny, extracted, hidden_copy, extract_calls, key, value
):
    sidecar = shards.shard_path(hidden_copy, 0).with_suffix(".json")
    meta = read_json(sidecar)
    meta[key] = value
    write_json(sidecar, meta)
    manifest = manifest_of(tiny, extracted, hidden_copy)
    assert extract_calls == ["shard_00000.safetensors"]
    assert read_json(sidecar)[key] != value
    assert_same_shard(shards.shard_path(hidden_copy, 0), shards.shard_path(extracted.hidden, 0))
    assert manifest["shards"][1]["sha256"] == extracted.sha[1]
    assert manifest["shards"][0]["sha256"] == shards.digest_path(shards.shard_path(hidden_copy, 0))


def test_manifest_follows_a_changed_run(tiny, extracted, hidden_copy, extract_calls, tmp_path):
    # other layers asked for: every shard is extracted again with them
    manifest = manifest_of(tiny, extracted, hidden_copy, cfg=stage_cfg(aux_layer_ids=[1, 2, 5]))
    assert extract_calls == ["shard_00000.safetensors", "shard_00001.safetensors"]
    assert manifest["aux_layer_ids"] == [1, 2, 5]
    for i in range(2):
        assert shards.load(shards.shard_path(hidden_copy, i)).aux_layer_ids == [1, 2, 5]
    # another target identity (new weights behind the same path): extracted again, not mixed in
    extract_calls.clear()
    other = dict(read_json(tiny.target_json), config_sha256="0" * 64)
    write_json(tmp_path / "target.json", other)
    manifest = manifest_of(
        tiny,
        extracted,
        hidden_copy,
        cfg=stage_cfg(aux_layer_ids=[1, 2, 5]),
        target_json=tmp_path / "target.json",
    )
    assert len(extract_calls) == 2
    assert manifest["target"]["config_sha256"] == "0" * 64
    assert all(
        shards.read_metadata(shards.shard_path(hidden_copy, i))["target"]["config_sha256"]
        == "0" * 64
        for i in range(2)
    )


def test_run_shard_checks_disk_before_extracting(tiny, extracted, tmp_path, monkeypatch):
    monkeypatch.setattr(
        shutil,
        "disk_usage",
        lambda path: SimpleNamespace(total=2**20, used=2**20 - 1000, free=1000),
    )
    hidden = tmp_path / "hidden"
    with pytest.raises(ExtractionError, match="not enough disk"):
        run_shard(
            stage_cfg(),
            str(tiny.target_json),
            str(extracted.data),
            0,
            2,
            str(shards.shard_path(hidden, 0)),
            str(hidden / "shard_00000.json"),
        )
    assert not list(hidden.iterdir())


def no_disk(monkeypatch) -> None:
    monkeypatch.setattr(
        shutil,
        "disk_usage",
        lambda path: SimpleNamespace(total=2**20, used=2**20 - 1000, free=1000),
    )
    for module in (extract_mod, manifest_mod):  # the hf jobs' and the manifest's loads
        monkeypatch.setattr(
            module,
            "load_target",
            lambda *a, **k: pytest.fail("loaded the model before checking the disk"),
        )


def test_run_shard_checks_disk_before_loading_the_model(tiny, extracted, tmp_path, monkeypatch):
    no_disk(monkeypatch)
    hidden = tmp_path / "hidden"
    with pytest.raises(ExtractionError, match="not enough disk"):
        run_shard(
            stage_cfg(),
            str(tiny.target_json),
            str(extracted.data),
            0,
            2,
            str(shards.shard_path(hidden, 0)),
            str(hidden / "shard_00000.json"),
        )


def test_manifest_checks_disk_before_extracting_a_shard_again(
    tiny, extracted, hidden_copy, monkeypatch
):
    bad = shards.shard_path(hidden_copy, 1)
    bad.write_bytes(bad.read_bytes()[:-100])
    no_disk(monkeypatch)
    with pytest.raises(ExtractionError, match=r"not enough disk.*1000 bytes free"):
        manifest_of(tiny, extracted, hidden_copy)
    assert not (hidden_copy / "manifest.json").exists()


def test_run_shard_rejects_an_empty_shard(tiny, extracted, tmp_path):
    with pytest.raises(ExtractionError, match="lower extract.num_shards"):
        # 6 samples in 8 shards: shard 0 gets samples [0, 0)
        run_shard(
            stage_cfg(),
            str(tiny.target_json),
            str(extracted.data),
            0,
            8,
            str(shards.shard_path(tmp_path, 0)),
            str(tmp_path / "shard_00000.json"),
        )


def test_a_shard_that_failed_the_teacher_check_is_never_accepted(tiny, greedy, tmp_path):
    data = tmp_path / "train.jsonl"
    write_jsonl(data, greedy[:2] + random_records(n=2, seed=7))
    hidden = tmp_path / "hidden"
    cfg = stage_cfg()
    with pytest.raises(ExtractionError):
        build_manifest(
            cfg, str(tiny.target_json), str(data), 1, str(hidden), str(hidden / "manifest.json")
        )
    with pytest.raises(ExtractionError):  # the second try must fail the same way
        build_manifest(
            cfg, str(tiny.target_json), str(data), 1, str(hidden), str(hidden / "manifest.json")
        )


def test_a_sharded_target_writes_the_same_shard(tiny, greedy, greedy_shard, tmp_path):
    """extract.device: sharded (device_map=auto: every GPU of a node; the CPU here) loads the
    target where accelerate puts it, feeds the ids to the embedding's device, runs the
    teacher on the lm_head's, and must give the very same shard."""
    sharded = load_target(str(tiny.dir), "float32", "sharded")
    assert sharded.device == sharded.model.get_input_embeddings().weight.device
    meta, _ = extract(sharded, greedy, tmp_path)  # as the greedy_shard fixture, same name
    assert meta["sha256"] == greedy_shard.meta["sha256"]


def test_recorded_answers_are_left_out_of_the_greedy_check_and_reported(target, greedy, tmp_path):
    """answers: dataset: another writer's answers disagree with the target's argmax; the greedy
    check covers the target's own answers, the recorded ones are reported apart."""
    recorded = [{**r, "model": "dataset", "sampling": None} for r in random_records(n=2, seed=7)]
    meta, _ = extract(target, greedy[:4] + recorded, tmp_path)
    assert meta["greedy"] is True and meta["recorded_answers"] == 2
    assert meta["teacher"]["agreement"] == 1.0
    assert meta["teacher"]["positions"] == sum(len(r["completion_token_ids"]) for r in greedy[:4])
    other = meta["teacher"]["recorded_answers"]
    assert other["positions"] == sum(len(r["completion_token_ids"]) for r in recorded)
    assert other["agreement"] < 0.5 and other["mean_logprob"] < -3
    # a shard of recorded answers alone: nothing to enforce
    meta, _ = extract(target, recorded, tmp_path / "alone")
    assert meta["greedy"] is False and meta["teacher"]["agreement"] is None
