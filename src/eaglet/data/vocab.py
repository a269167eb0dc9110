"""The draft vocabulary: the target tokens the drafter may propose.

The drafter's lm_head covers only ``Vd`` tokens: the ``Vd`` most frequent completion tokens
of the synthetic data, sorted by id. vLLM maps a draft index ``i`` back to a target id as
``i + d2t[i]`` (an offset, not an id), and ``t2d`` marks which target ids are drafted.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterable

import torch
from safetensors.torch import load_file, save

from eaglet.core.io import atomic_open, write_json
from eaglet.data.prompts import recorded_answer

log = logging.getLogger("eaglet.data.vocab")

# Below this share of the completion tokens a draft vocabulary is warned about. A token outside
# it can never be drafted, so coverage caps every draft position's chance to be accepted; a
# trained drafter's own acceptance per position is usually under 0.9, so above this floor the
# drafter, not its vocabulary, limits the acceptance length, and below it the vocabulary
# starts to (a 3-token draft outlives the vocabulary alone at most 0.9^3 = 73% of the time).
COVERAGE_FLOOR = 0.9


def count_completion_tokens(records: Iterable[dict]) -> Counter:
    counts: Counter = Counter()
    for record in records:
        counts.update(record["completion_token_ids"])
    return counts


def choose_draft_tokens(
    counts: Counter, vocab_size: int, draft_vocab_size: int
) -> tuple[list[int], int]:
    """The ``draft_vocab_size`` most frequent ids (ties: lower id first), sorted by id.

    When fewer distinct tokens were seen, the rest is filled with the lowest unused ids
    (deterministic); the number filled is returned beside the ids."""
    if draft_vocab_size > vocab_size:
        raise ValueError(
            f"vocab.draft_vocab_size {draft_vocab_size} exceeds the target's "
            f"vocabulary of {vocab_size} tokens; lower it"
        )
    bad = [t for t in counts if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"token ids {sorted(bad)[:5]} are outside the target's vocabulary "
            f"of {vocab_size}: the synthetic data comes from another tokenizer"
        )
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:draft_vocab_size]
    chosen = set(ranked)
    filled = 0
    next_id = 0
    while len(chosen) < draft_vocab_size:
        if next_id not in chosen:
            chosen.add(next_id)
            filled += 1
        next_id += 1
    return sorted(chosen), filled


def size_for_coverage(ranked: Counter, counts: Counter, share: float) -> int:
    """The smallest draft vocabulary whose tokens, taken in ``ranked``'s order (as
    :func:`choose_draft_tokens` takes them), cover ``share`` of the ``counts``."""
    needed = share * sum(counts.values())
    covered = 0
    order = sorted(ranked, key=lambda t: (-ranked[t], t))
    for size, token in enumerate(order, start=1):
        covered += counts[token]
        if covered >= needed - 1e-9:
            return size
    return len(order)


def warn_low_coverage(stats: dict, size_for_floor: int) -> None:
    """A warning when the draft vocabulary covers less than COVERAGE_FLOOR of the completion
    tokens, naming the size that would reach it (from this data's counts)."""
    if stats["coverage"] >= COVERAGE_FLOOR:
        return
    log.warning(
        "vocab.draft_vocab_size %d covers only %.2f%% of the %d completion tokens (floor "
        "%.0f%%): the drafter can never propose the other %.2f%%, so its acceptance stops "
        "there. vocab.draft_vocab_size: %d would cover %.0f%% of this data (of %d distinct "
        "tokens; the target's vocabulary has %d).",
        stats["draft_vocab_size"],
        100 * stats["coverage"],
        stats["completion_tokens"],
        100 * COVERAGE_FLOOR,
        100 * (1 - stats["coverage"]),
        size_for_floor,
        100 * COVERAGE_FLOOR,
        stats["distinct_completion_tokens"],
        stats["target_vocab_size"],
    )


def build_maps(draft_ids: list[int], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor(draft_ids, dtype=torch.int64)
    d2t = ids - torch.arange(len(draft_ids), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def draft_to_target(d2t: torch.Tensor, draft_index: torch.Tensor) -> torch.Tensor:
    return draft_index + d2t[draft_index]


class VocabError(ValueError):
    """A draft vocabulary that would waste the run: it covers too little of the answers."""


def build_vocab_map(
    records: list[dict],
    vocab_size: int,
    draft_vocab_size: int,
    out_path: str | os.PathLike,
    stats_path: str | os.PathLike,
    min_coverage: float = 0.0,
) -> dict:
    """The ``draft_vocab_size`` tokens the target emitted most often; where it emitted fewer
    distinct ones, the most frequent of the recorded answers (``answers: dataset``) fill the
    rest: the target's own choices come first, another writer's only after them. Below
    ``min_coverage`` of the completion tokens (``vocab.min_coverage``) nothing is written and
    a :class:`VocabError` names the size that would cover COVERAGE_FLOOR of them: the run
    stops here, before extraction and training spend their hours on a drafter that could
    propose too few of the target's tokens."""
    counts = count_completion_tokens(r for r in records if not recorded_answer(r))
    recorded = count_completion_tokens(r for r in records if recorded_answer(r))
    both = counts + recorded
    total = sum(both.values())
    if not total:
        raise ValueError("the synthetic data has no completion tokens to build a vocabulary from")
    # any count of the target's beats every recorded one: ranked after all of the target's
    top = max(recorded.values(), default=0) + 1
    ranked = Counter({t: n * top for t, n in counts.items()})
    for t, n in recorded.items():
        ranked[t] += n
    draft_ids, filled = choose_draft_tokens(ranked, vocab_size, draft_vocab_size)
    d2t, t2d = build_maps(draft_ids, vocab_size)
    covered = sum(both[t] for t in draft_ids)
    stats = {
        "draft_vocab_size": draft_vocab_size,
        "target_vocab_size": vocab_size,
        "distinct_completion_tokens": len(both),
        "completion_tokens": total,
        "coverage": covered / total,
        "filled": filled,
        "target_tokens": sum(counts.values()),
        "target_distinct": len(counts),
        "target_coverage": (
            sum(counts[t] for t in draft_ids) / sum(counts.values()) if counts else None
        ),
        "coverage_floor": COVERAGE_FLOOR,
        "draft_vocab_size_for_floor": size_for_coverage(ranked, both, COVERAGE_FLOOR),
    }
    if filled:
        log.info(
            "only %d distinct completion tokens for a draft vocabulary of %d: filled %d "
            "slots with the lowest unused token ids",
            len(both),
            draft_vocab_size,
            filled,
        )
    log.info(
        "draft vocabulary of %d covers %.2f%% of %d completion tokens (%d distinct)",
        draft_vocab_size,
        100 * stats["coverage"],
        total,
        len(both),
    )
    if stats["coverage"] < min_coverage:
        raise VocabError(
            f"vocab.draft_vocab_size {draft_vocab_size} covers only "
            f"{100 * stats['coverage']:.1f}% of the {total} completion tokens, below "
            f"vocab.min_coverage {100 * min_coverage:.0f}%: a drafter of it could never propose "
            f"the other {100 * (1 - stats['coverage']):.1f}%. Set vocab.draft_vocab_size: "
            f"{stats['draft_vocab_size_for_floor']} (covers {100 * COVERAGE_FLOOR:.0f}% of this "
            f"data, of {len(both)} distinct tokens), or lower vocab.min_coverage (0 allows any "
            f"vocabulary) to go on with this one."
        )
    warn_low_coverage(stats, stats["draft_vocab_size_for_floor"])
    write_vocab_map(out_path, d2t, t2d)
    write_json(stats_path, stats)
    return stats


def write_vocab_map(out_path: str | os.PathLike, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    with atomic_open(out_path, "wb") as handle:
        handle.write(
            save(
                {"d2t": d2t.to(torch.int64), "t2d": t2d.to(torch.bool)},
                metadata={
                    "draft_vocab_size": str(d2t.numel()),
                    "target_vocab_size": str(t2d.numel()),
                },
            )
        )


def adopt_vocab_map(
    records: list[dict],
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    source: str,
    out_path: str | os.PathLike,
    stats_path: str | os.PathLike,
) -> dict:
    """The starting drafter's vocabulary map (``train.init_from``) as the run's: its lm_head
    rows are those tokens, so it is kept as it is; the stats say how much of this run's
    completion tokens it covers beside a map of the same size built from this data, with a
    warning where it covers less (what fine-tuning cannot add: tokens it can never propose)."""
    counts = count_completion_tokens(records)
    total = sum(counts.values())
    if not total:
        raise ValueError(
            "the synthetic data has no completion tokens to measure the starting "
            "drafter's vocabulary on"
        )
    size, vocab_size = d2t.numel(), t2d.numel()
    ids = (torch.arange(size) + d2t.to(torch.int64)).tolist()
    bad = [t for t in counts if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"token ids {sorted(bad)[:5]} are outside the starting drafter's "
            f"vocabulary of {vocab_size}: it was trained for another tokenizer"
        )
    covered = sum(counts[t] for t in ids)
    own, _ = choose_draft_tokens(counts, vocab_size, size)
    stats = {
        "draft_vocab_size": size,
        "target_vocab_size": vocab_size,
        "from": source,
        "distinct_completion_tokens": len(counts),
        "completion_tokens": total,
        "coverage": covered / total,
        "coverage_of_a_map_from_this_data": sum(counts[t] for t in own) / total,
        "coverage_floor": COVERAGE_FLOOR,
        "draft_vocab_size_for_floor": size_for_coverage(counts, counts, COVERAGE_FLOOR),
    }
    log.info(
        "the starting drafter's vocabulary of %d (%s) covers %.2f%% of %d completion "
        "tokens; a map of that size from this data would cover %.2f%%",
        size,
        source,
        100 * stats["coverage"],
        total,
        100 * stats["coverage_of_a_map_from_this_data"],
    )
    if stats["coverage"] < stats["coverage_of_a_map_from_this_data"] - 0.01:
        log.warning(
            "the starting drafter's vocabulary covers %.2f%% of this run's completion "
            "tokens, a map built from them %.2f%%: it can never propose the other "
            "%.2f%%, however it is fine-tuned (training from scratch keeps the better "
            "map)",
            100 * stats["coverage"],
            100 * stats["coverage_of_a_map_from_this_data"],
            100 * (1 - stats["coverage"]),
        )
    warn_low_coverage(stats, stats["draft_vocab_size_for_floor"])
    write_vocab_map(out_path, d2t, t2d)
    write_json(stats_path, stats)
    return stats


def load_vocab_map(path: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    """``d2t`` (int64 offsets: target id = draft id + d2t) and ``t2d`` (bool mask of the
    target vocabulary) of a vocab map."""
    tensors = load_file(str(path))
    return tensors["d2t"].to(torch.int64), tensors["t2d"].to(torch.bool)
