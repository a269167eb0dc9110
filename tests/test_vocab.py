"""The draft vocabulary: which target ids the drafter may propose, and the d2t/t2d maps
vLLM reads (target_id = i + d2t[i])."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch
from safetensors import safe_open

from eaglet.core.io import read_json
from eaglet.data.vocab import (
    build_maps,
    build_vocab_map,
    choose_draft_tokens,
    count_completion_tokens,
    draft_to_target,
    load_vocab_map,
)


def record(i, prompt, completion):
    return {
        "id": f"p-{i}",
        "prompt_token_ids": list(prompt),
        "completion_token_ids": list(completion),
        "sampling": {"temperature": 0.0},
    }


# -- choose_draft_tokens ---------------------------------------------------------------------


def test_keeps_most_frequent_ids_sorted_by_id():
    counts = Counter({50: 10, 7: 9, 99: 8, 3: 1, 12: 2, 40: 7})
    ids, filled = choose_draft_tokens(counts, vocab_size=100, draft_vocab_size=4)
    assert ids == [7, 40, 50, 99]
    assert filled == 0


def test_ties_go_to_the_lower_id():
    counts = Counter({9: 5, 4: 5, 6: 5, 2: 5, 8: 1})
    ids, filled = choose_draft_tokens(counts, vocab_size=10, draft_vocab_size=3)
    assert ids == [2, 4, 6]
    assert filled == 0
    # a higher count still beats a lower id
    counts[9] = 6
    assert choose_draft_tokens(counts, 10, 3)[0] == [2, 4, 9]


def test_output_is_sorted_whatever_the_counts():
    rng = random.Random(0)
    counts = Counter({rng.randrange(1000): rng.randrange(1, 50) for _ in range(400)})
    ids, _ = choose_draft_tokens(counts, 1000, 64)
    assert ids == sorted(ids)
    assert len(set(ids)) == 64
    # exactly the top 64 by (count desc, id asc)
    assert set(ids) == set(sorted(counts, key=lambda t: (-counts[t], t))[:64])


def test_fill_when_fewer_distinct_tokens_is_deterministic_and_counted():
    counts = Counter({0: 3, 2: 1, 5: 9})
    ids, filled = choose_draft_tokens(counts, vocab_size=20, draft_vocab_size=6)
    # the 3 seen ids plus the lowest unused ones: 1, 3, 4
    assert ids == [0, 1, 2, 3, 4, 5]
    assert filled == 3
    assert choose_draft_tokens(Counter(counts), 20, 6) == (ids, filled)

    ids, filled = choose_draft_tokens(Counter({10: 1, 11: 1}), vocab_size=20, draft_vocab_size=5)
    assert ids == [0, 1, 2, 10, 11]
    assert filled == 3


def test_draft_vocab_equal_to_vocab_takes_everything():
    ids, filled = choose_draft_tokens(Counter({3: 2, 1: 1}), vocab_size=5, draft_vocab_size=5)
    assert ids == [0, 1, 2, 3, 4]
    assert filled == 3


def test_draft_vocab_larger_than_vocab_raises_naming_the_key():
    with pytest.raises(ValueError, match=r"vocab\.draft_vocab_size"):
        choose_draft_tokens(Counter({1: 1}), vocab_size=10, draft_vocab_size=11)


@pytest.mark.parametrize("bad", [10, 1000, -1])
def test_out_of_vocab_ids_raise(bad):
    with pytest.raises(ValueError, match=str(bad)):
        choose_draft_tokens(Counter({1: 4, bad: 1}), vocab_size=10, draft_vocab_size=2)


# -- maps ------------------------------------------------------------------------------------


def test_build_maps_offsets_and_mask():
    rng = random.Random(1)
    vocab = 500
    draft_ids = sorted(rng.sample(range(vocab), 37))
    d2t, t2d = build_maps(draft_ids, vocab)
    assert d2t.dtype == torch.int64 and d2t.shape == (37,)
    assert t2d.dtype == torch.bool and t2d.shape == (vocab,)
    for i, target_id in enumerate(draft_ids):
        assert i + int(d2t[i]) == target_id
    assert int(t2d.sum()) == 37
    assert torch.nonzero(t2d).flatten().tolist() == draft_ids
    # offsets of a sorted id list never go negative and never decrease
    assert (d2t >= 0).all() and (d2t[1:] >= d2t[:-1]).all()


def test_draft_to_target_maps_a_tensor_of_indices():
    draft_ids = [3, 8, 9, 20, 41]
    d2t, _ = build_maps(draft_ids, 50)
    index = torch.tensor([[4, 0], [2, 2], [1, 3]])
    out = draft_to_target(d2t, index)
    assert out.shape == index.shape
    assert out.tolist() == [[41, 3], [9, 9], [8, 20]]
    assert draft_to_target(d2t, torch.arange(5)).tolist() == draft_ids


# -- build_vocab_map -------------------------------------------------------------------------


def test_only_completion_tokens_count():
    records = [record(0, [1, 1, 1, 1], [2, 3]), record(1, [1, 4], [3])]
    assert count_completion_tokens(records) == Counter({3: 2, 2: 1})


def test_build_vocab_map_writes_maps_and_stats(tmp_path):
    # prompt tokens (7, 8) are very frequent but must not count
    records = [
        record(0, [7] * 50 + [8] * 40, [1, 2, 2, 3, 3, 3]),
        record(1, [7] * 30, [3, 4, 4, 5]),
        record(2, [8, 8, 8], [6, 3, 2]),
    ]
    out, stats_path = (
        tmp_path / "vocab" / "vocab_map.safetensors",
        tmp_path / "vocab" / "stats.json",
    )
    stats = build_vocab_map(
        records, vocab_size=16, draft_vocab_size=3, out_path=out, stats_path=stats_path
    )
    # completion counts: 3:5, 2:3, 4:2, 1:1, 5:1, 6:1 -> top 3 = {2, 3, 4}; 10 of 13 tokens
    assert stats == read_json(stats_path)
    assert stats["coverage"] == pytest.approx(10 / 13)
    assert stats["completion_tokens"] == 13
    assert stats["distinct_completion_tokens"] == 6
    assert stats["filled"] == 0
    assert stats["draft_vocab_size"] == 3 and stats["target_vocab_size"] == 16

    with safe_open(str(out), framework="pt") as handle:
        assert set(handle.keys()) == {"d2t", "t2d"}
        meta = handle.metadata()
        d2t, t2d = handle.get_tensor("d2t"), handle.get_tensor("t2d")
    assert meta["draft_vocab_size"] == "3" and meta["target_vocab_size"] == "16"
    assert d2t.dtype == torch.int64 and d2t.shape == (3,)
    assert t2d.dtype == torch.bool and t2d.shape == (16,)
    assert draft_to_target(d2t, torch.arange(3)).tolist() == [2, 3, 4]
    assert torch.nonzero(t2d).flatten().tolist() == [2, 3, 4]
    assert not t2d[7] and not t2d[8]

    loaded_d2t, loaded_t2d = load_vocab_map(out)
    assert torch.equal(loaded_d2t, d2t) and torch.equal(loaded_t2d, t2d)
    assert not list(out.parent.glob(".*.tmp"))  # atomic write left nothing behind


def test_build_vocab_map_coverage_matches_a_hand_count(tmp_path):
    rng = random.Random(3)
    vocab, draft = 200, 25
    records = [
        record(
            i,
            [rng.randrange(vocab) for _ in range(10)],
            [min(int(rng.expovariate(0.05)), vocab - 1) for _ in range(rng.randrange(5, 40))],
        )
        for i in range(30)
    ]
    stats = build_vocab_map(records, vocab, draft, tmp_path / "v.safetensors", tmp_path / "s.json")
    d2t, t2d = load_vocab_map(tmp_path / "v.safetensors")
    chosen = set(torch.nonzero(t2d).flatten().tolist())
    assert chosen == set(draft_to_target(d2t, torch.arange(draft)).tolist())
    tokens = [t for r in records for t in r["completion_token_ids"]]
    hand = sum(t in chosen for t in tokens) / len(tokens)
    assert stats["coverage"] == pytest.approx(hand)
    assert stats["completion_tokens"] == len(tokens)
    # no other choice of `draft` ids covers more
    top = sum(c for _, c in Counter(tokens).most_common(draft)) / len(tokens)
    assert stats["coverage"] == pytest.approx(top)
    assert json.loads((tmp_path / "s.json").read_text())["coverage"] == pytest.approx(hand)


def test_build_vocab_map_fills_and_reports(tmp_path):
    records = [record(0, [9, 9], [5, 5, 6])]
    stats = build_vocab_map(records, 10, 4, tmp_path / "v.safetensors", tmp_path / "s.json")
    assert stats["filled"] == 2 and stats["coverage"] == 1.0
    d2t, t2d = load_vocab_map(tmp_path / "v.safetensors")
    assert draft_to_target(d2t, torch.arange(4)).tolist() == [0, 1, 5, 6]


def test_build_vocab_map_without_completion_tokens_raises(tmp_path):
    with pytest.raises(ValueError, match="no completion tokens"):
        build_vocab_map(
            [record(0, [1, 2, 3], [])], 10, 4, tmp_path / "v.safetensors", tmp_path / "s.json"
        )
    assert not (tmp_path / "v.safetensors").exists()


def test_the_targets_own_tokens_come_before_recorded_answers(tmp_path):
    """answers: dataset: a token the target emitted once ranks above one a recorded answer
    holds a hundred times; recorded tokens fill only what the target's leave free."""
    from eaglet.data.vocab import build_vocab_map, load_vocab_map

    target = [{"completion_token_ids": [5, 5, 6]}]
    recorded = [{"model": "dataset", "completion_token_ids": [9] * 100 + [8] * 50 + [7]}]
    stats = build_vocab_map(
        target + recorded, 16, 3, tmp_path / "v.safetensors", tmp_path / "v.json"
    )
    _, t2d = load_vocab_map(tmp_path / "v.safetensors")
    assert t2d.nonzero().squeeze(1).tolist() == [5, 6, 9]
    assert stats["target_coverage"] == 1.0 and stats["target_tokens"] == 3
    assert stats["completion_tokens"] == 154


def test_a_draft_vocabulary_below_the_coverage_floor_is_warned_with_the_size_that_reaches_it(
    tmp_path, caplog
):
    """vocab.draft_vocab_size: 10 trained with 27% coverage and only an INFO line: below
    COVERAGE_FLOOR it warns, naming the smallest size that covers the floor of this data."""
    import logging

    from eaglet.data.vocab import COVERAGE_FLOOR

    # token t appears 100 - 4 * t times: 20 distinct tokens, 1240 tokens in all
    completion = [t for t in range(20) for _ in range(100 - 4 * t)]
    records = [record(0, [1], completion)]
    total = len(completion)
    covered, reach = 0, None
    for size, t in enumerate(range(20), start=1):  # the hand count of the floor's size
        covered += 100 - 4 * t
        if reach is None and covered >= COVERAGE_FLOOR * total:
            reach = size
    with caplog.at_level(logging.INFO, logger="eaglet.data.vocab"):
        stats = build_vocab_map(records, 64, 4, tmp_path / "v.safetensors", tmp_path / "s.json")
    assert stats["coverage"] == pytest.approx((100 + 96 + 92 + 88) / total)
    assert reach == 16 and stats["draft_vocab_size_for_floor"] == reach
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "vocab.draft_vocab_size 4 covers only 30.32%" in warnings[0]
    assert f"vocab.draft_vocab_size: {reach} would cover 90%" in warnings[0]
    # at the floor's size: no warning
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="eaglet.data.vocab"):
        stats = build_vocab_map(records, 64, reach, tmp_path / "v.safetensors", tmp_path / "s.json")
    assert stats["coverage"] >= COVERAGE_FLOOR
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_a_vocabulary_far_below_the_floor_stops_the_run_before_extraction(tmp_path):
    """draft_vocab_size 4 of this data covers 30%: with vocab.min_coverage 0.5 (the default)
    the stage writes nothing and says the size that covers 90%; min_coverage 0 lets it on."""
    from eaglet.core.config import validate
    from eaglet.data.vocab import VocabError

    completion = [t for t in range(20) for _ in range(100 - 4 * t)]
    records = [record(0, [1], completion)]
    floor = validate({})["vocab"]["min_coverage"]
    assert floor == 0.5
    with pytest.raises(
        VocabError,
        match=r"draft_vocab_size 4 covers only 30\.3% .* "
        r"vocab\.draft_vocab_size: 16 \(covers 90%",
    ):
        build_vocab_map(
            records, 64, 4, tmp_path / "v.safetensors", tmp_path / "s.json", min_coverage=floor
        )
    assert not (tmp_path / "v.safetensors").exists() and not (tmp_path / "s.json").exists()
    stats = build_vocab_map(
        records, 64, 4, tmp_path / "v.safetensors", tmp_path / "s.json", min_coverage=0.0
    )
    assert stats["coverage"] < 0.5 and (tmp_path / "v.safetensors").exists()


# -- the map's identity across rebuilds -------------------------------------------------------

WRITE_MAP = """
import sys
from eaglet.data.vocab import build_vocab_map
records = [{"id": f"p-{i}", "prompt_token_ids": [1], "completion_token_ids": [i % 7, 9, 11],
            "sampling": {"temperature": 0.0}} for i in range(20)]
build_vocab_map(records, 64, 8, sys.argv[1], sys.argv[1] + ".json")
"""


@pytest.mark.subprocess
def test_an_identical_rebuild_of_the_map_keeps_the_trainings_fingerprint(tmp_path):
    """safetensors writes the map's metadata in an order that changes between processes: the
    same tensors rebuilt in another process may differ in their header's bytes. The training's
    fingerprint holds what the map means, so a finished training is not thrown away."""
    import os
    import subprocess
    import sys

    from eaglet.data.shard_format import safetensors_digest, sha256_path
    from eaglet.stages.train import checkpoints as ckpt
    from eaglet.stages.train.setup import fingerprint_and_subset

    paths = []
    for seed in range(12):  # fresh processes, each with its own hash seed
        path = tmp_path / f"map_{seed}.safetensors"
        subprocess.run(
            [sys.executable, "-c", WRITE_MAP, str(path)],
            check=True,
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
        )
        paths.append(path)
    assert len({sha256_path(p) for p in paths}) > 1, "the writer's header order never varied"
    assert len({safetensors_digest(p) for p in paths}) == 1
    prints = [fingerprint_and_subset({"lr": 1e-3}, [], 1, str(p), None)[0] for p in paths]
    assert all(ckpt.same_training(prints[0], other) for other in prints[1:])
    # another map is another training
    other = tmp_path / "other.safetensors"
    with open(other, "wb") as handle:
        from safetensors.torch import save

        handle.write(
            save(
                {"d2t": torch.zeros(8, dtype=torch.int64), "t2d": torch.zeros(64, dtype=torch.bool)}
            )
        )
    changed = fingerprint_and_subset({"lr": 1e-3}, [], 1, str(other), None)[0]
    assert ckpt.input_differences(prints[0], changed) == ["vocab_map_sha256"]
    # a checkpoint of an earlier eaglet recorded the file's bytes: the same file still matches
    earlier = {
        **prints[0],
        "inputs": {**prints[0]["inputs"], "vocab_map_sha256": sha256_path(paths[0])},
    }
    assert ckpt.input_differences(earlier, prints[0]) == []
