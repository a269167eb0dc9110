"""vLLM's spec-decode counters: read from ``/metrics`` (Prometheus text) and from each
answer, turned into deltas and acceptance (pooled, per request, per position)."""

from __future__ import annotations

import re
import urllib.request
from collections import defaultdict
from typing import Any

SPEC_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfaINFA]+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text format: metric name -> [(labels, value), ...]."""
    samples: dict[str, list] = defaultdict(list)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match:
            name, labels, value = match.groups()
            samples[name].append((dict(_LABEL.findall(labels or "")), float(value)))
    return samples


def spec_counters(text: str) -> dict[str, Any]:
    """The spec-decode counters, summed over engines; per-position counts by position."""
    samples = parse_metrics(text)
    counts: dict[str, Any] = {
        key: sum(v for _, v in samples.get(name, [])) for key, name in SPEC_COUNTERS.items()
    }
    per_pos: dict[int, float] = defaultdict(float)
    for labels, value in samples.get(PER_POSITION, []):
        per_pos[int(labels.get("position", 0))] += value
    counts["per_position"] = [per_pos[i] for i in sorted(per_pos)]
    return counts


def counter_delta(before: dict, after: dict) -> dict:
    delta = {key: after[key] - before[key] for key in SPEC_COUNTERS}
    width = max(len(before["per_position"]), len(after["per_position"]))
    pad = lambda xs: list(xs) + [0.0] * (width - len(xs))  # noqa: E731
    delta["per_position"] = [
        a - b for a, b in zip(pad(after["per_position"]), pad(before["per_position"]))
    ]
    return delta


def acceptance(delta: dict, k: int | None) -> dict:
    """Acceptance length, rate and per-position rates from counter deltas, pooled over every
    drafting step. None where nothing was drafted, and at k 0: a level where the schedule
    drafts nothing has no acceptance to report, though its counters may hold a few drafts from
    the moments its batch shrank into a range that drafts (the last requests of a round); they
    are kept as counted."""
    drafts, draft_tokens, accepted = delta["drafts"], delta["draft_tokens"], delta["accepted"]
    if not drafts or k == 0:
        return {
            "k": k,
            "drafts": int(drafts),
            "draft_tokens": int(draft_tokens),
            "accepted_tokens": int(accepted),
            "acceptance_length": None,
            "acceptance_rate": None,
            "per_position_rate": [],
        }
    return {
        "k": k,
        "drafts": int(drafts),
        "draft_tokens": int(draft_tokens),
        "accepted_tokens": int(accepted),
        "acceptance_length": 1 + accepted / drafts,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "per_position_rate": [p / drafts for p in delta["per_position"]],
    }


def per_request_acceptance(counts: list[dict | None], k: int | None) -> dict:
    """Acceptance length per request: the mean over requests of each request's own
    ``1 + accepted/drafts``, over the requests that drafted at least once, with how many those
    were (``requests_drafted``). ``counts``: each request's own counts, as vLLM returns them
    with its answer (:data:`PER_REQUEST_METRICS`, :func:`_spec_counts`) or as the offline
    replay counts one sequence; None for a request that came without.

    The pooled acceptance length weighs every drafting step alike, so long answers dominate
    it; this weighs every request alike. None at k 0 (:func:`acceptance`), where no request
    drafted, and where the server returned no per-request counts (the target alone, or a vLLM
    without the flag: ``requests_drafted`` is then None too)."""
    counted = [c for c in counts if c]
    drafted = [c for c in counted if c["drafts"]]
    mean = (
        sum(1 + c["accepted"] / c["drafts"] for c in drafted) / len(drafted)
        if drafted and k != 0
        else None
    )
    return {
        "acceptance_length_per_request": mean,
        "requests_drafted": len(drafted) if counted else None,
    }


def _answer_counts(level: dict) -> list[dict | None]:
    """Each answer's own spec-decode counts at one level (None where it came without)."""
    return [a.get("spec_decoding") for a in level["_answers"]]


def _spec_counts(body: dict) -> dict | None:
    """One answer's own spec-decode counts from the response's ``metrics`` (vLLM's
    ``metrics.speculative_decoding``), named as the counters are; None where it has none."""
    spec = (body.get("metrics") or {}).get("speculative_decoding")
    if not spec:
        return None
    return {
        "drafts": spec["num_spec_steps"],
        "draft_tokens": spec["num_draft_tokens"],
        "accepted": spec["num_accepted_draft_tokens"],
    }


def read_metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        return resp.read().decode()


def _sum_deltas(deltas: list[dict]) -> dict:
    width = max((len(d["per_position"]) for d in deltas), default=0)
    return {
        **{key: sum(d[key] for d in deltas) for key in SPEC_COUNTERS},
        "per_position": [
            sum(d["per_position"][i] for d in deltas if i < len(d["per_position"]))
            for i in range(width)
        ],
    }
