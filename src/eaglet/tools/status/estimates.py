"""What ``eaglet status`` estimates time from: the rates measured by this run, by earlier runs
(:mod:`eaglet.core.rates`) or by the shipped benchmarks, in that order (:func:`_rate`, each
with its :class:`Basis`), the token totals of the prompts and answers (measured, projected or
guessed), and the speed of this machine measured from the progress files of the stages that
ran (:class:`Machine`)."""

from __future__ import annotations

import contextlib
import csv
import glob
import json
import math
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from eaglet.core import rates
from eaglet.core.layout import (
    BENCHMARK_RESULTS,
    CHECKPOINTS,
    HIDDEN,
    HIDDEN_EVAL,
    PROMPT_STATS,
    PROMPTS_TRAIN,
    SHARD_GLOB,
    SYNTHETIC_PARTIAL,
    SYNTHETIC_STATS,
    TRAINING_LOG,
    VLLM_WORK,
)
from eaglet.engine.server import pid_alive

BENCHMARKS = BENCHMARK_RESULTS
SERVER_START_GUESS_S = 60.0  # vLLM CPU with --enforce-eager: about 55 s here
COMPLETION_FILL_GUESS = 0.75  # share of max_tokens a completion uses before it is measured
CHARS_PER_TOKEN = 4.0  # of prompt text, before any prompt is tokenized
TEMPLATE_TOKENS_GUESS = 30  # the chat template's tokens around a prompt (system turn, roles)
OFFLINE_REPLAY_SHARE = 0.7  # an offline replay's time over its vLLM run's (2 CPU cores)


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def process_alive(record: dict) -> bool | None:
    """Whether the process a progress record names still runs; None when it runs on another
    host (a cluster node), where its pid cannot be checked from here."""
    host = record.get("host")
    if host and host != socket.gethostname():
        return None
    return pid_alive(record.get("pid"))


# -- rates and sizes the estimates use ------------------------------------------------------


@dataclass
class Estimate:
    seconds: float | None
    basis: str
    speed: Speed | None = None  # this run's measurement the estimate rests on, if any


# ``before`` of an estimate read from the reference run or the benchmarks alone, never the rates
# history: the rate a speed factor is measured against (:func:`machine_speed`)
BENCHMARKS_ONLY = "benchmarks only"
EARLIER_RUN = "an earlier run"  # the source of an estimate read from this machine's rates history


class Basis(str):
    """What an estimate's rate rests on, in words, and whether it was measured on this kind of
    machine (``here``): such a rate is used as it is, never scaled by a speed factor."""

    here: bool

    def __new__(cls, text: str, here: bool = False) -> Basis:
        basis = super().__new__(cls, text)
        basis.here = here
        return basis


def _earlier_source(entry: dict) -> Basis:
    """Where an estimate read from the rates history comes from: this machine (EARLIER_RUN), or
    another kind of machine, which is estimated as the benchmarks are (scaled by this machine's
    speed)."""
    device = entry.get("device")
    if entry.get("reference"):
        # measured by another machine, however alike its name: scaled by this one's speed
        return Basis(f"the reference demo run ({device})")
    if device in (None, rates.device_kind()):
        return Basis(EARLIER_RUN, here=True)
    return Basis(f"an earlier run on another machine ({device})")


def _rate(
    stage: str,
    key: str,
    target: str | None,
    measured: float | None = None,
    benchmark: Callable[[], float | None] | None = None,
    before: str | None = None,
    settings: dict | None = None,
) -> tuple[float | None, str]:
    """``before``: the rates history as it was then (see :func:`_at_machine_speed`), or
    BENCHMARKS_ONLY; ``settings``: only rates measured at them
    (:func:`eaglet.core.rates.lookup_entry`)."""
    if measured:
        return measured, "this run"
    entry = (
        rates.reference_entry(stage, key, target, settings)
        if before == BENCHMARKS_ONLY
        else rates.lookup_entry(stage, key, target, before, settings)
    )
    if entry is not None:
        return float(entry[key]), _earlier_source(entry)
    if benchmark is not None:
        value = benchmark()
        if value:
            return value, "benchmarks/results"
    return None, "no rate measured yet"


def _train_rate(
    target: str,
    ttt_steps: int,
    max_len: int | None = None,
    before: str | None = None,
    settings: dict | None = None,
) -> tuple[float | None, str]:
    """An earlier run's training tokens/s, else ``benchmarks/results/train.json``'s for this
    target's shape (the row whose sample length is nearest ``max_len``), scaled to this run's
    TTT steps: each step runs the drafter layer and its lm_head once more, so the cost per
    token grows about linearly."""
    entry = (
        rates.reference_entry(rates.TRAIN, rates.TOKENS_PER_S, target, settings)
        if before == BENCHMARKS_ONLY
        else rates.lookup_entry(rates.TRAIN, rates.TOKENS_PER_S, target, before, settings)
    )
    source = _earlier_source(entry) if entry is not None else Basis("")
    if entry is None:
        rows = [
            row
            for row in (_read(BENCHMARKS / "train.json") or {}).values()
            if row.get("shape") and row["shape"] in target and row.get("tokens_per_s")
        ]
        if not rows:
            return None, "no rate measured yet"
        entry = min(
            rows, key=lambda row: abs(math.log(row["sample_len"] / (max_len or row["sample_len"])))
        )
        source = Basis(f"benchmarks/results, {entry['sample_len']}-token samples")
    measured_at = int(entry.get("ttt_steps") or ttt_steps)
    rate = float(entry["tokens_per_s"]) * measured_at / ttt_steps
    if measured_at == ttt_steps:
        return rate, source
    return rate, Basis(
        f"{source} at {measured_at} TTT steps, scaled to {ttt_steps}", here=source.here
    )


def _bench_generate(concurrency: int) -> float | None:
    data = _read(BENCHMARKS / "generate.json") or {}
    levels = {
        int(k): v["tokens_per_s"]
        for k, v in (data.get("server_tokens_per_s_by_concurrency") or {}).items()
    }
    if not levels:
        return None
    nearest = min(levels, key=lambda c: abs(c - concurrency))
    return levels[nearest]


def _server_start(stage: str, target: str) -> float:
    start, _ = _rate(stage, rates.SERVER_START_S, target)
    return start or SERVER_START_GUESS_S


def _prompt_counts(r: Path) -> tuple[int | None, int | None]:
    s = _read(r / PROMPT_STATS)
    return (s["n_train"], s["n_eval"]) if s else (None, None)


def _token_totals(r: Path, cfg: dict | None = None) -> dict | None:
    """Tokens per split: from the final stats, or, while generation runs, projected from the
    samples finished so far (mean length x prompts), or, before the first one, guessed from
    the prompts' characters and ``generate.max_tokens`` (``guessed`` is then set)."""
    s = _read(r / SYNTHETIC_STATS)
    if not s:
        counts = _prompt_counts(r)
        if counts[0] is None:
            return None
        return _projected_totals(r, counts) or (_guessed_totals(r, cfg, counts) if cfg else None)
    splits = s["splits"]
    return {
        split: {
            "samples": v["samples"],
            "tokens": v["prompt_tokens"] + v["completion_tokens"],
            "completion_tokens": v["completion_tokens"],
        }
        for split, v in splits.items()
    }


def _per_split(counts: tuple[int, int], prompt: float, completion: float, **extra) -> dict:
    """Tokens per split from the prompt counts (train, eval) and mean lengths per sample."""
    return {
        split: {
            "samples": n,
            "tokens": int(n * (prompt + completion)),
            "completion_tokens": int(n * completion),
            **extra,
        }
        for split, n in zip(("train", "eval"), counts)
    }


def _projected_totals(r: Path, counts: tuple[int, int]) -> dict | None:
    """Mean lengths of the answers in generation's partial file, times the prompt counts.
    Only answers count: a failed request has an ``error`` and a prompt too long to ask is
    recorded as ``skipped``, neither with token ids."""
    partial = r / SYNTHETIC_PARTIAL
    if not partial.exists():
        return None
    lengths = []
    with open(partial) as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(record, dict) or "error" in record or "skipped" in record:
                continue
            with contextlib.suppress(KeyError, TypeError):
                lengths.append(
                    (len(record["prompt_token_ids"]), len(record["completion_token_ids"]))
                )
    if not lengths:
        return None
    return _per_split(
        counts, sum(p for p, _ in lengths) / len(lengths), sum(c for _, c in lengths) / len(lengths)
    )


def _guessed_totals(r: Path, cfg: dict, counts: tuple[int, int]) -> dict | None:
    """Before any answer exists: the prompts' characters at CHARS_PER_TOKEN plus the chat
    template's tokens, and answers at COMPLETION_FILL_GUESS of max_tokens."""
    prompts = r / PROMPTS_TRAIN
    if not prompts.exists():
        return None
    chars = []
    with open(prompts) as handle:
        for line in handle:
            with contextlib.suppress(json.JSONDecodeError, KeyError, TypeError):
                chars.append(sum(len(m["content"] or "") for m in json.loads(line)["messages"]))
    if not chars:
        return None
    prompt = sum(chars) / len(chars) / CHARS_PER_TOKEN + TEMPLATE_TOKENS_GUESS
    return _per_split(
        counts, prompt, cfg["generate"]["max_tokens"] * COMPLETION_FILL_GUESS, guessed=True
    )


NO_TOKENS = "token count unknown until generate runs"


def _guessed(totals: dict) -> str:
    return "; tokens guessed from the prompts" if totals["train"].get("guessed") else ""


def _checkpointed_steps(r: Path) -> tuple[int | None, int | None]:
    """Step and total steps of the newest training checkpoint, which a rerun resumes."""
    for directory in sorted((r / CHECKPOINTS).glob("step_*"), reverse=True):
        state = _read(directory / "state.json")
        if state and state.get("total_steps"):
            return int(state["step"]), int(state["total_steps"])
    return None, None


def _training_rows(r: Path) -> list[dict]:
    try:
        with open(r / TRAINING_LOG, newline="") as handle:
            return list(csv.DictReader(handle))
    except OSError:
        return []


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.2f}%"


def _timestamp(iso: str | None) -> float | None:
    """Seconds since the epoch of an ISO time a progress file records, or None."""
    try:
        return datetime.fromisoformat(iso).timestamp() if iso else None
    except (TypeError, ValueError):
        return None


# a shard's .json beside its .safetensors: where a job writes them directly (hf backend), and
# where the vllm backend stages them until every shard is packed (hidden/vllm/shards/<split>)
SHARD_METAS = (
    f"{HIDDEN}/{SHARD_GLOB}.json",
    f"{HIDDEN_EVAL}/{SHARD_GLOB}.json",
    f"{VLLM_WORK}/shards/*/{SHARD_GLOB}.json",
)


def _packed_samples(r: Path, since: float) -> int:
    """Samples in the shards written at or after ``since`` (a job's start; older ones are an
    earlier run's, which the job counts as resumed)."""
    total = 0
    for pattern in SHARD_METAS:
        for path in glob.glob(str(r / pattern)):
            with contextlib.suppress(OSError):
                if os.stat(path).st_mtime < since:
                    continue
            meta = _read(Path(path))
            if isinstance(meta, dict) and isinstance(meta.get("num_samples"), int):
                total += meta["num_samples"]
    return total


# packing states that generation captured (read, teacher check, shard write), 2 CPU cores
PACK_TOKENS_PER_S = 2000


# -- this machine's speed --------------------------------------------------------------------

# a running stage's rate speaks for the machine once it has worked this long (before, it is
# its first requests or steps: warm-up, the first batch still in flight)
MEASURED_AFTER_S = 60.0


@dataclass
class Measurement:
    """A stage's tokens/s in this run, the seconds of work it was measured over, and when the
    stage started (None where its files do not say)."""

    rate: float
    elapsed_s: float
    started_at: str | None


@dataclass
class Speed:
    """One kind of work (``decode``, ``prefill``, ``training``) as a stage of this run did it:
    its measured tokens/s beside the rate the benchmarks give it (``expected``; None where
    they give none). The benchmarks were measured on other machines, each at its stage's
    own workload, so the ratio is this machine against theirs: it scales the estimates read from
    the benchmarks. A rate from this machine's rates history is no such yardstick: a
    measurement against it mixes the day's speed with how the earlier run's workload
    differed (a tiny test run's generation estimated the next demo's at 0.7x its rate, and
    training, estimated right by an earlier demo, was then estimated 1.4x too fast)."""

    stage: str
    kind: str
    rate: float
    expected: float | None
    elapsed_s: float

    @property
    def factor(self) -> float | None:
        """How much faster this machine did the work than the benchmarks' machine."""
        return self.rate / self.expected if self.expected else None

    def says(self, kind: str) -> str:
        """How an estimate of ``kind`` work scaled by this speed names it."""
        if kind == self.kind:
            return f"x{self.factor:.2f} this machine's {kind} speed measured by {self.stage}"
        return f"x{self.factor:.2f} this machine's speed from {self.stage}'s {self.kind}"


@dataclass
class Machine:
    """What this run measured of the machine it runs on. ``since``: when the first measured
    stage started; an estimate scaled by a speed reads the rates history as it was then, the
    history its speed was measured against (a finished stage records its own rate there,
    which would otherwise read as an earlier run's)."""

    speeds: list[Speed]
    since: str | None

    def measured_by(self, stage: str) -> Speed | None:
        return next((s for s in self.speeds if s.stage == stage), None)

    def speed(self, kind: str, estimated_by: str) -> Speed | None:
        """The speed an estimate of ``kind`` work by stage ``estimated_by`` is scaled by: measured by
        another stage (a running stage's own rate is its ETA once settled), of the same kind
        where one was measured, else of any kind; of those, the one measured over the most
        time."""
        known = [s for s in self.speeds if s.factor and s.stage != estimated_by]
        same = [s for s in known if s.kind == kind]
        return max(same or known, key=lambda s: s.elapsed_s, default=None)


def _measured_record(record: Any) -> bool:
    """Whether a progress record measured a rate of this machine: new work done (not only
    resumed), tokens counted, and finished or at it for MEASURED_AFTER_S."""
    if not isinstance(record, dict) or record.get("state") not in ("running", "finished"):
        return False
    try:
        new = int(record.get("done") or 0) - int(record.get("resumed_from") or 0)
        tokens, elapsed = float(record.get("tokens") or 0), float(record.get("elapsed_s") or 0)
    except (TypeError, ValueError):
        return False
    return (
        new > 0
        and tokens > 0
        and elapsed > 0
        and (record["state"] == "finished" or elapsed >= MEASURED_AFTER_S)
    )


def measured_from_progress(paths: list[str]) -> Measurement | None:
    """The tokens/s of the progress files ``paths`` that measured one (the mean over their
    jobs, weighted by time, as each job records its own rate)."""
    records = [p for p in (_read(Path(path)) for path in paths) if _measured_record(p)]
    if not records:
        return None
    elapsed = sum(float(p["elapsed_s"]) for p in records)
    starts = [p["started_at"] for p in records if _timestamp(p.get("started_at")) is not None]
    return Measurement(
        sum(float(p["tokens"]) for p in records) / elapsed,
        elapsed,
        min(starts, key=_timestamp) if starts else None,
    )
