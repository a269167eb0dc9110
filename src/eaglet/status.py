"""Where a run stands: what finished (and what it verified), what runs now, what remains,
and how long that will take. Read-only: it reads the files the stages write.

Each stage leaves behind its outputs, a stats or manifest file with its checks, a log under
``logs/`` and, while it runs, ``progress/<stage>.json`` with its pid. A progress file whose
pid is gone belongs to an interrupted stage. A stage that writes no progress file runs while
its log is newer than the start of the Snakemake that runs it (``run/snakemake.json``), and
a Snakemake that is gone may have left its lock, which status names with the command that
removes it. Remaining time comes from the sizes in the config and the rates measured by
this run, by earlier runs (``eaglet.rates``) or by the benchmarks, in that order, and says
which one it used. Those rates come from other days and machines: once a model stage of this
run has worked for a minute (or finished), its measured rate over the rate its plan assumed is
this machine's speed for that kind of work, and the plans of the other stages are scaled by it
(by their own kind's where measured, else by another kind's).
"""

from __future__ import annotations

import contextlib
import csv
import glob
import json
import math
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable

from eaglet import rates
from eaglet.config import ConfigError, load_run_config, stream_overlaps
from eaglet.io import human_size
from eaglet.evaluate import level_prompts, run_plan
from eaglet.progress import format_duration
from eaglet.server import pid_alive

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
SERVER_START_GUESS_S = 60.0      # vLLM CPU with --enforce-eager: about 55 s here
COMPLETION_FILL_GUESS = 0.75     # share of max_tokens a completion uses before it is measured
CHARS_PER_TOKEN = 4.0            # of prompt text, before any prompt is tokenized
TEMPLATE_TOKENS_GUESS = 30       # the chat template's tokens around a prompt (system turn, roles)
OFFLINE_REPLAY_SHARE = 0.7       # an offline replay's time over its vLLM run's (2 CPU cores)


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
    speed: Speed | None = None   # this run's measurement the plan rests on, if any


# ``before`` of a plan read from the reference run or the benchmarks alone, never the rates
# history: the rate a speed factor is measured against (:func:`machine_speed`)
BENCHMARKS_ONLY = "benchmarks only"
EARLIER_RUN = "an earlier run"   # the source of a plan read from this machine's rates history


class Basis(str):
    """What a plan's rate rests on, in words, and whether it was measured on this kind of
    machine (``here``): such a rate is used as it is, never scaled by a speed factor."""

    here: bool

    def __new__(cls, text: str, here: bool = False) -> "Basis":
        basis = super().__new__(cls, text)
        basis.here = here
        return basis


def _earlier_source(entry: dict) -> Basis:
    """Where a plan read from the rates history comes from: this machine (EARLIER_RUN), or
    another kind of machine, which is planned as the benchmarks are (scaled by this machine's
    speed)."""
    device = entry.get("device")
    if entry.get("reference"):
        # measured by another machine, however alike its name: scaled by this one's speed
        return Basis(f"the reference demo run ({device})")
    if device in (None, rates.device_kind()):
        return Basis(EARLIER_RUN, here=True)
    return Basis(f"an earlier run on another machine ({device})")


def _rate(stage: str, key: str, target: str | None, measured: float | None = None,
          benchmark: Callable[[], float | None] | None = None,
          before: str | None = None, settings: dict | None = None) -> tuple[float | None, str]:
    """``before``: the rates history as it was then (see :func:`_at_machine_speed`), or
    BENCHMARKS_ONLY; ``settings``: only rates measured at them
    (:func:`eaglet.rates.lookup_entry`)."""
    if measured:
        return measured, "this run"
    entry = (rates.reference_entry(stage, key, target, settings) if before == BENCHMARKS_ONLY
             else rates.lookup_entry(stage, key, target, before, settings))
    if entry is not None:
        return float(entry[key]), _earlier_source(entry)
    if benchmark is not None:
        value = benchmark()
        if value:
            return value, "benchmarks/results"
    return None, "no rate measured yet"


def _train_rate(target: str, ttt_steps: int, max_len: int | None = None,
                before: str | None = None, settings: dict | None = None
                ) -> tuple[float | None, str]:
    """An earlier run's training tokens/s, else ``benchmarks/results/train.json``'s for this
    target's shape (the row whose sample length is nearest ``max_len``), scaled to this run's
    TTT steps: each step runs the drafter layer and its lm_head once more, so the cost per
    token grows about linearly."""
    entry = (rates.reference_entry("train", "tokens_per_s", target, settings)
             if before == BENCHMARKS_ONLY
             else rates.lookup_entry("train", "tokens_per_s", target, before, settings))
    source = _earlier_source(entry) if entry is not None else Basis("")
    if entry is None:
        rows = [row for row in (_read(BENCHMARKS / "train.json") or {}).values()
                if row.get("shape") and row["shape"] in target and row.get("tokens_per_s")]
        if not rows:
            return None, "no rate measured yet"
        entry = min(rows, key=lambda row: abs(math.log(row["sample_len"] / (max_len or row["sample_len"]))))
        source = Basis(f"benchmarks/results, {entry['sample_len']}-token samples")
    measured_at = int(entry.get("ttt_steps") or ttt_steps)
    rate = float(entry["tokens_per_s"]) * measured_at / ttt_steps
    if measured_at == ttt_steps:
        return rate, source
    return rate, Basis(f"{source} at {measured_at} TTT steps, scaled to {ttt_steps}",
                       here=source.here)


def _bench_generate(concurrency: int) -> float | None:
    data = _read(BENCHMARKS / "generate.json") or {}
    levels = {int(k): v["tokens_per_s"] for k, v in
              (data.get("server_tokens_per_s_by_concurrency") or {}).items()}
    if not levels:
        return None
    nearest = min(levels, key=lambda c: abs(c - concurrency))
    return levels[nearest]


def _server_start(stage: str, target: str) -> float:
    start, _ = _rate(stage, "server_start_s", target)
    return start or SERVER_START_GUESS_S


def _prompt_counts(r: Path) -> tuple[int | None, int | None]:
    s = _read(r / "prompts/stats.json")
    return (s["n_train"], s["n_eval"]) if s else (None, None)


def _token_totals(r: Path, cfg: dict | None = None) -> dict | None:
    """Tokens per split: from the final stats, or, while generation runs, projected from the
    samples finished so far (mean length x prompts), or, before the first one, guessed from
    the prompts' characters and ``generate.max_tokens`` (``guessed`` is then set)."""
    s = _read(r / "synthetic/stats.json")
    if not s:
        counts = _prompt_counts(r)
        if counts[0] is None:
            return None
        return _projected_totals(r, counts) or (_guessed_totals(r, cfg, counts) if cfg else None)
    splits = s["splits"]
    return {split: {"samples": v["samples"],
                    "tokens": v["prompt_tokens"] + v["completion_tokens"],
                    "completion_tokens": v["completion_tokens"]} for split, v in splits.items()}


def _per_split(counts: tuple[int, int], prompt: float, completion: float, **extra) -> dict:
    """Tokens per split from the prompt counts (train, eval) and mean lengths per sample."""
    return {split: {"samples": n, "tokens": int(n * (prompt + completion)),
                    "completion_tokens": int(n * completion), **extra}
            for split, n in zip(("train", "eval"), counts)}


def _projected_totals(r: Path, counts: tuple[int, int]) -> dict | None:
    """Mean lengths of the answers in generation's partial file, times the prompt counts.
    Only answers count: a failed request has an ``error`` and a prompt too long to ask is
    recorded as ``skipped``, neither with token ids."""
    partial = r / "synthetic" / "generate.partial.jsonl"
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
                lengths.append((len(record["prompt_token_ids"]), len(record["completion_token_ids"])))
    if not lengths:
        return None
    return _per_split(counts, sum(p for p, _ in lengths) / len(lengths),
                      sum(c for _, c in lengths) / len(lengths))


def _guessed_totals(r: Path, cfg: dict, counts: tuple[int, int]) -> dict | None:
    """Before any answer exists: the prompts' characters at CHARS_PER_TOKEN plus the chat
    template's tokens, and answers at COMPLETION_FILL_GUESS of max_tokens."""
    prompts = r / "prompts" / "train.jsonl"
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
    return _per_split(counts, prompt, cfg["generate"]["max_tokens"] * COMPLETION_FILL_GUESS,
                      guessed=True)


NO_TOKENS = "token count unknown until generate runs"


def _guessed(totals: dict) -> str:
    return "; tokens guessed from the prompts" if totals["train"].get("guessed") else ""


def _checkpointed_steps(r: Path) -> tuple[int | None, int | None]:
    """Step and total steps of the newest training checkpoint, which a rerun resumes."""
    for directory in sorted((r / "drafter_checkpoints").glob("step_*"), reverse=True):
        state = _read(directory / "state.json")
        if state and state.get("total_steps"):
            return int(state["step"]), int(state["total_steps"])
    return None, None


def _training_rows(r: Path) -> list[dict]:
    try:
        with open(r / "drafter/training_log.csv", newline="") as handle:
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
SHARD_METAS = ("hidden/shard_*.json", "hidden/eval/shard_*.json",
               "hidden/vllm/shards/*/shard_*.json")


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
    its measured tokens/s beside the rate the benchmarks give it (``planned``; None where
    they give none). The benchmarks were measured on other machines, each at its stage's
    own workload, so the ratio is this machine against theirs: it scales the plans read from
    the benchmarks. A rate from this machine's rates history is no such yardstick: a
    measurement against it mixes the day's speed with how the earlier run's workload
    differed (a tiny test run's generation planned the next demo's at 0.7x its rate, and
    training, planned right by an earlier demo, was then planned 1.4x too fast)."""

    stage: str
    kind: str
    rate: float
    planned: float | None
    elapsed_s: float

    @property
    def factor(self) -> float | None:
        """How much faster this machine did the work than the benchmarks' machine."""
        return self.rate / self.planned if self.planned else None

    def says(self, kind: str) -> str:
        """How a plan of ``kind`` work scaled by this speed names it."""
        if kind == self.kind:
            return f"x{self.factor:.2f} this machine's {kind} speed measured by {self.stage}"
        return f"x{self.factor:.2f} this machine's speed from {self.stage}'s {self.kind}"


@dataclass
class Machine:
    """What this run measured of the machine it runs on. ``since``: when the first measured
    stage started; a plan scaled by a speed reads the rates history as it was then, the
    history its speed was measured against (a finished stage records its own rate there,
    which would otherwise read as an earlier run's)."""

    speeds: list[Speed]
    since: str | None

    def measured_by(self, stage: str) -> Speed | None:
        return next((s for s in self.speeds if s.stage == stage), None)

    def speed(self, kind: str, planned_by: str) -> Speed | None:
        """The speed a plan of ``kind`` work by stage ``planned_by`` is scaled by: measured by
        another stage (a running stage's own rate is its ETA once settled), of the same kind
        where one was measured, else of any kind; of those, the one measured over the most
        time."""
        known = [s for s in self.speeds if s.factor and s.stage != planned_by]
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
    return (new > 0 and tokens > 0 and elapsed > 0
            and (record["state"] == "finished" or elapsed >= MEASURED_AFTER_S))


def measured_from_progress(paths: list[str]) -> Measurement | None:
    """The tokens/s of the progress files ``paths`` that measured one (the mean over their
    jobs, weighted by time, as each job records its own rate)."""
    records = [p for p in (_read(Path(path)) for path in paths) if _measured_record(p)]
    if not records:
        return None
    elapsed = sum(float(p["elapsed_s"]) for p in records)
    starts = [p["started_at"] for p in records if _timestamp(p.get("started_at")) is not None]
    return Measurement(sum(float(p["tokens"]) for p in records) / elapsed, elapsed,
                       min(starts, key=_timestamp) if starts else None)


def machine_speed(r: Path, cfg: dict) -> Machine:
    """This run's measurements of the machine, each beside the rate its plan assumed."""
    measured = []
    for stage in STAGES:
        kind = stage.kind(cfg)
        found = stage.measured(r, cfg) if kind else None
        if found is not None:
            measured.append((stage, kind, found))
    starts = [m.started_at for _, _, m in measured if m.started_at]
    since = min(starts, key=_timestamp) if starts else None
    return Machine([Speed(stage.name, kind, m.rate, stage.planned_rate(cfg, BENCHMARKS_ONLY)[0],
                          m.elapsed_s) for stage, kind, m in measured], since)


def _at_machine_speed(stage: Stage, kind: str, r: Path, cfg: dict,
                      lookup: Callable[[str | None], tuple[float | None, str]]
                      ) -> tuple[float | None, str, Speed | None]:
    """The rate a plan of ``kind`` work by ``stage`` rests on, its basis and the speed that
    scaled it: ``lookup(before)``, an earlier run's rate on this machine (the rates history
    before ``before``) as it is; else the benchmarks' times this machine's speed where
    another stage of this run measured one (:class:`Speed`); else ``lookup(None)`` as it
    is."""
    machine = machine_speed(r, cfg)
    rate, basis = lookup(machine.since)
    if rate is not None and getattr(basis, "here", False):
        # this machine already: scaled by nothing
        return rate, basis, None
    speed = machine.speed(kind, stage.name)
    if speed is not None and rate is not None:
        return rate * speed.factor, f"{basis}, {speed.says(kind)}", speed
    rate, basis = lookup(None)
    return rate, basis, None


# -- the stages ------------------------------------------------------------------------------

class Stage:
    """Everything status knows of one stage: the Snakemake rules that make it, the outputs
    that show it finished, the progress files its jobs write while they run (a glob under
    the results dir), its log, the config key of the GPUs it holds, the facts its outputs
    record and their line in the report, and an estimate of the time it takes."""

    name: str
    rules: tuple[str, ...] = ()                # () means the rule of the stage's name
    outputs: tuple[str, ...] = ()
    progress: str | None = None
    log: str = ""                              # "" means logs/<name>.log
    gpu_key: tuple[str, str] | None = None     # config section and key
    note: str = ""                             # what the order line says of it
    typical_s: float | None = None
    # share of its units done before a running stage's own ETA is trusted over its plan less
    # the time it has run (until then its rate carries the server start and the first units)
    settles_at: float = 0.25
    # whether the plan of a running stage reads its progress (what the stage has decided
    # while it runs), not only the time it has run
    plans_from_progress: bool = False

    def __init__(self) -> None:
        self.rules = self.rules or (self.name,)
        self.log = self.log or f"logs/{self.name}.log"

    def gpus(self, cfg: dict) -> int | None:
        """GPUs the stage's jobs hold (None: it runs no model)."""
        if not self.gpu_key:
            return None
        section, key = self.gpu_key
        return cfg[section].get(key, 0)

    def facts(self, r: Path) -> dict:
        return {}

    def read_progress(self, r: Path, path: Path) -> dict | None:
        """One of the stage's progress files, as status shows it."""
        return _read(path)

    def line(self, f: dict) -> str:
        return json.dumps(f)

    def estimate(self, r: Path, cfg: dict, progress: dict | None) -> Estimate:
        """Time left when the stage is not running (a running one has its own ETA)."""
        return Estimate(self.typical_s, "typical")

    def kind(self, cfg: dict) -> str | None:
        """The kind of model work its rate measures (None: no model's)."""
        return None

    def planned_rate(self, cfg: dict, before: str | None = None) -> tuple[float | None, str]:
        """The tokens/s its plan rests on and where it comes from; ``before``: the rates
        history as it was then."""
        return None, "no rate"

    def rate_files(self, r: Path, cfg: dict) -> list[str]:
        """The progress files that measure its rate."""
        return sorted(glob.glob(str(r / self.progress))) if self.progress else []

    def measured(self, r: Path, cfg: dict) -> Measurement | None:
        """Its rate in this run, where it has worked a minute or finished."""
        return measured_from_progress(self.rate_files(r, cfg))


class PrepareTarget(Stage):
    name = "prepare_target"
    outputs = ("target/target.json",)

    def facts(self, r):
        t = _read(r / "target/target.json") or {}
        return {"model": t.get("spec"), "layers": t.get("num_hidden_layers"),
                "hidden_size": t.get("hidden_size"), "vocab_size": t.get("vocab_size")}

    def line(self, f):
        return f"{f['model']}: {f['layers']} layers, hidden {f['hidden_size']}, vocab {f['vocab_size']}"

    def estimate(self, r, cfg, progress):
        return Estimate(40.0 if cfg["target"]["model"].startswith("embedded:") else 5.0, "typical")


class PreparePrompts(Stage):
    name = "prepare_prompts"
    outputs = ("prompts/train.jsonl", "prompts/eval.jsonl")
    typical_s = 10.0

    def facts(self, r):
        s = _read(r / "prompts/stats.json") or {}
        totals = s.get("totals", {})
        return {"train_prompts": s.get("n_train"), "eval_prompts": s.get("n_eval"),
                "bad_rows": totals.get("bad"), "duplicates": totals.get("duplicates")}

    def line(self, f):
        return (f"{f['train_prompts']} train / {f['eval_prompts']} eval prompts, "
                f"{f['bad_rows']} bad rows, {f['duplicates']} duplicates")


class Generate(Stage):
    name = "generate"
    outputs = ("synthetic/train.jsonl", "synthetic/eval.jsonl")
    progress = "progress/generate.json"
    gpu_key = ("server", "gpus")
    note = "vLLM server"

    def facts(self, r):
        s = _read(r / "synthetic/stats.json") or {}
        splits = s.get("splits", {})
        tc = s.get("template_check", {})
        return {"samples": sum(v["samples"] for v in splits.values()),
                "failed": sum(v["failed"] for v in splits.values()),
                "truncated": sum(v["truncated"] for v in splits.values()),
                "completion_tokens": sum(v["completion_tokens"] for v in splits.values()),
                "template_mismatched": tc.get("mismatched"), "template_checked": tc.get("checked"),
                "retokenized": tc.get("retokenized")}

    def line(self, f):
        return (f"{f['samples']} samples ({f['failed']} failed, {f['truncated']} truncated), "
                f"{f['completion_tokens']} completion tokens; template check "
                f"{f['template_mismatched']}/{f['template_checked']} mismatched")

    def kind(self, cfg):
        return "decode"

    def planned_rate(self, cfg, before=None):
        return _rate("generate", "completion_tokens_per_s", cfg["target"]["model"],
                     benchmark=lambda: _bench_generate(cfg["generate"]["concurrency"]),
                     before=before, settings=rates.generate_settings(cfg))

    def estimate(self, r, cfg, progress):
        target, gen = cfg["target"]["model"], cfg["generate"]
        n_train, n_eval = _prompt_counts(r)
        if n_train is None:
            return Estimate(None, "prompt count unknown until prepare_prompts runs")
        # prompts with recorded answers (answers: dataset) are not asked
        recorded = (_read(r / "prompts/stats.json") or {}).get("n_train_recorded_answers", 0)
        remaining = n_train - recorded + n_eval - (progress or {}).get("done", 0)
        rate, basis, speed = _at_machine_speed(self, "decode", r, cfg,
                                               lambda before: self.planned_rate(cfg, before))
        if rate is None:
            return Estimate(None, basis)
        per_sample = gen["max_tokens"] * COMPLETION_FILL_GUESS
        seconds = _server_start("generate", target) + remaining * per_sample / rate
        text = f"{remaining} samples x ~{per_sample:.0f} tokens at {rate:.0f} tok/s ({basis})"
        if gen.get("capture_hidden_states") and recorded:
            # the capturing server prefills the recorded answers for their states as well
            prefill, _, scaled = _at_machine_speed(
                self, "prefill", r, cfg,
                lambda before: _rate("extract_vllm", "tokens_per_s", target, before=before,
                                     settings=rates.prefill_settings(cfg)))
            if prefill:
                seconds += recorded * per_sample / prefill
                text += f", then {recorded} recorded answers prefilled at {prefill:.0f} tok/s"
                text += f" ({scaled.says('prefill')})" if scaled else ""
        return Estimate(seconds, text, speed)


class VocabMap(Stage):
    name = "vocab_map"
    outputs = ("vocab/vocab_map.safetensors",)
    typical_s = 10.0

    def facts(self, r):
        s = _read(r / "vocab/stats.json") or {}
        return {"draft_vocab_size": s.get("draft_vocab_size"), "coverage": s.get("coverage"),
                "distinct_tokens": s.get("distinct_completion_tokens"), "filled": s.get("filled")}

    def line(self, f):
        return (f"Vd {f['draft_vocab_size']} covers {_pct(f['coverage'])} of completion tokens "
                f"({f['distinct_tokens']} distinct)")


class Extract(Stage):
    """Shards by the hf backend (a job each), by one vLLM capture server, or packed from
    what generation captured; the manifest verifies them all."""

    name = "extract"
    rules = ("extract", "extract_all", "extract_vllm", "hidden_manifest")
    outputs = ("hidden/manifest.json",)
    progress = "progress/extract_*.json"
    log = "logs/extract"
    gpu_key = ("extract", "gpus")
    note = "starts only after the server stopped: both need the GPU"

    def gpus(self, cfg):
        # the vllm backend and captured states: the extraction server holds server.gpus
        from_vllm = (cfg["extract"].get("backend") == "vllm"
                     or cfg.get("generate", {}).get("capture_hidden_states"))
        return cfg["server" if from_vllm else "extract"].get("gpus", 0)

    def read_progress(self, r, path):
        """A job that writes every shard (the vllm backend, captured states, extract.jobs:
        one) rewrites its progress file every few seconds at most, so the file can lag a
        whole shard behind (a status read 0/31 after the first shard was packed): the
        samples of the shards it wrote since it started count as done as well."""
        record = _read(path)
        if (not record or record.get("state") != "running"
                or path.stem not in ("extract_vllm", "extract_all")):
            return record
        since = _timestamp(record.get("started_at"))
        if since is None:
            return record
        packed = (record.get("resumed_from") or 0) + _packed_samples(r, since)
        if record.get("total"):
            packed = min(packed, record["total"])
        return {**record, "done": packed} if packed > (record.get("done") or 0) else record

    def facts(self, r):
        m = _read(r / "hidden/manifest.json") or {}
        return {"shards": m.get("num_shards"), "samples": m.get("num_samples"),
                "tokens": m.get("tokens"), "truncated": m.get("truncated"),
                "bytes": m.get("bytes"), "dtype": m.get("dtype"),
                "aux_layer_ids": m.get("aux_layer_ids"),
                "teacher_agreement": m.get("teacher_agreement")}

    def line(self, f):
        gib = (f["bytes"] or 0) / 2**30
        return (f"{f['shards']} shards, {f['samples']} samples, {f['tokens']} tokens, "
                f"{gib:.2f} GiB {f['dtype']}, layers {f['aux_layer_ids']}; teacher agreement "
                f"{_pct(f['teacher_agreement'])}")

    def kind(self, cfg):
        # packing captured states reads and writes files: no model's work
        return None if cfg["generate"].get("capture_hidden_states") else "prefill"

    def planned_rate(self, cfg, before=None):
        target = cfg["target"]["model"]
        if cfg["extract"]["backend"] == "vllm":
            return _rate("extract_vllm", "tokens_per_s", target, before=before,
                         benchmark=lambda: (_read(BENCHMARKS / "extract.json") or {}).get(
                             "vllm_backend_tokens_per_s"), settings=rates.prefill_settings(cfg))
        return _rate("extract", "tokens_per_s", target, before=before)

    def rate_files(self, r, cfg):
        vllm = str(r / "progress" / "extract_vllm.json")
        files = super().rate_files(r, cfg)
        return ([f for f in files if f == vllm] if cfg["extract"]["backend"] == "vllm"
                else [f for f in files if f != vllm])

    def estimate(self, r, cfg, progress):
        target, totals = cfg["target"]["model"], _token_totals(r, cfg)
        # train.data stream: only the held-out split is extracted here
        splits = ("eval",) if cfg["train"].get("data") == "stream" else ("train", "eval")
        tokens = (sum(totals[split]["tokens"] for split in splits if split in totals)
                  if totals is not None else None)
        if cfg["generate"].get("capture_hidden_states"):
            # generation saved the states: the stage reads, checks and packs them
            if tokens is None:
                return Estimate(None, NO_TOKENS)
            rate, basis = _rate("extract_pack", "tokens_per_s", target)
            if rate is None:
                rate, basis = PACK_TOKENS_PER_S, "typical"
            return Estimate(tokens / rate,
                            f"packing {tokens} captured tokens at {rate:.0f} tok/s ({basis})"
                            + _guessed(totals))
        rate, basis, speed = _at_machine_speed(self, "prefill", r, cfg,
                                               lambda before: self.planned_rate(cfg, before))
        if tokens is None or rate is None:
            return Estimate(None, basis if totals else NO_TOKENS)
        if cfg["extract"]["backend"] == "vllm":
            # one capture server; every sequence (train and held-out) is a prefill request
            return Estimate(_server_start("extract_vllm", target) + tokens / rate,
                            f"server start + {tokens} tokens of prefill at {rate:.0f} tok/s "
                            f"({basis})" + _guessed(totals), speed)
        done = len(glob.glob(str(r / "hidden/shard_*.safetensors")))
        left = tokens * (1 - done / max(cfg["extract"]["num_shards"], 1))
        return Estimate(left / rate, f"{left:.0f} tokens at {rate:.0f} tok/s ({basis})"
                        + _guessed(totals), speed)


# what status keeps of drafter/stats.json's ``shipped`` (train.py's ``Trainer.ship``)
SHIPPED_KEYS = ("choice", "step", "epoch", "heldout_al", "best_epoch", "best_heldout_al",
                "last_epoch", "last_epoch_al", "note")


def _epoch(value: Any) -> str:
    return "?" if value is None else f"{value:g}"


def _shipped_line(s: dict) -> str:
    """Which epoch's weights the drafter ships and their held-out simulated AL: training
    ships the best held-out evaluation, which on small data is often not the last, so the
    last evaluation's AL alone would misstate the drafter that evaluate serves."""
    if s.get("heldout_al") is None:
        return f"ships the last epoch {_epoch(s.get('epoch'))} (no held-out split to choose by)"
    if s.get("choice") == "best":
        last = ("" if s.get("last_epoch_al") is None else
                f"; last epoch {_epoch(s.get('last_epoch'))} had {s['last_epoch_al']:.2f}")
        return f"ships epoch {_epoch(s.get('epoch'))} (held-out AL {s['heldout_al']:.2f}{last})"
    best = s.get("best_heldout_al")
    which = ", the best" if best is not None and best <= s["heldout_al"] else ""
    return (f"ships the last epoch {_epoch(s.get('epoch'))} "
            f"(held-out AL {s['heldout_al']:.2f}{which})")


# what status keeps of drafter/stats.json's ``stream`` (train_stream.StateFeed.summary)
STREAM_KEYS = ("requests", "saved_files", "reread_files", "cache_files", "cache_bytes",
               "trainer_wait_s", "trainer_wait_start_s", "feed_wait_s", "server_idle_s",
               "server_start_s", "window", "ranks", "overlap")


def _stream_line(s: dict, elapsed_s: float | None) -> str:
    """How a streamed training got its states, and which side waited for the other: the
    trainer for the server's states, or the feed (its window full) for the trainer."""
    got = (f"states streamed: {s.get('requests') or 0} prefill requests, "
           f"{s.get('saved_files') or 0} saved by generation or an earlier run, "
           f"{s.get('reread_files') or 0} read again (cache "
           f"{s.get('cache_files') or 0} files, {human_size(s.get('cache_bytes') or 0)})")
    start = s.get("trainer_wait_start_s")
    if start is None:  # a run from before the feed timed the wait during the start itself
        start = s.get("server_start_s") or 0.0
    waited = max((s.get("trainer_wait_s") or 0.0) - start, 0.0)
    whole = f" of {elapsed_s:.0f} s" if elapsed_s else ""
    return (f"{got}; the trainer waited {waited:.0f} s{whole} for states (besides "
            f"{start:.0f} s while the server started), the server "
            f"{s.get('server_idle_s') or 0:.0f} s "
            f"with no request (the feed {s.get('feed_wait_s') or 0:.0f} s for the trainer"
            + (f", its window of {s['window']} samples full" if s.get("window") else "")
            + ("; the two took turns, train.stream_overlap" if s.get("overlap") is False
               else "")
            + (f"; {s['ranks']} training ranks, each with a feed of its own: the longest "
               f"rank's wait, the shortest's idle time" if (s.get("ranks") or 1) > 1 else "")
            + ")")


class Train(Stage):
    name = "train"
    outputs = ("drafter/model.safetensors",)
    progress = "progress/train.json"
    gpu_key = ("train", "gpus")

    def facts(self, r):
        rows = _training_rows(r)
        out: dict[str, Any] = {}
        for split in ("train", "eval"):
            last = [row for row in rows if row.get("split") == split]
            if last:
                out[f"{split}_acc_0"] = float(last[-1]["acc_0"])
                out[f"{split}_simulated_al"] = float(last[-1]["sim_al"])
        if rows:
            out["steps"] = int(rows[-1]["step"])
        stats = _read(r / "drafter/stats.json") or {}
        shipped = stats.get("shipped")
        if isinstance(shipped, dict):
            out["shipped"] = {key: shipped.get(key) for key in SHIPPED_KEYS}
        if isinstance(stats.get("stream"), dict):  # train.data stream
            out["stream"] = {key: stats["stream"].get(key) for key in STREAM_KEYS}
            out["elapsed_s"] = stats.get("elapsed_s")
        return out

    def line(self, f):
        parts = [f"step {f.get('steps')}"]
        # the eval row is the last evaluation's; the shipped drafter's is said instead
        splits = ("train",) if f.get("shipped") else ("train", "eval")
        for split in splits:
            if f"{split}_acc_0" in f:
                parts.append(f"{split} acc_0 {f[f'{split}_acc_0']:.3f}, simulated AL "
                             f"{f[f'{split}_simulated_al']:.2f}")
        if f.get("shipped"):
            parts.append(_shipped_line(f["shipped"]))
        if f.get("stream"):
            parts.append(_stream_line(f["stream"], f.get("elapsed_s")))
        return "; ".join(parts)

    def read_progress(self, r, path):
        """The progress file, its count raised to the newest checkpoint where the process
        wrote one after its last progress report and was then stopped (a kill between the
        two read "INTERRUPTED 1/12 steps" beside "resuming from the checkpoint at step 4")."""
        progress = super().read_progress(r, path)
        step, _ = _checkpointed_steps(r)
        if (progress and step and progress.get("state") == "running"
                and process_alive(progress) is False and step > int(progress.get("done") or 0)):
            progress = {**progress, "done": step}
        return progress

    def kind(self, cfg):
        return "training"

    def planned_rate(self, cfg, before=None):
        train = cfg["train"]
        return _train_rate(cfg["target"]["model"], train["ttt_steps"],
                           train["max_len"] or train["max_tokens_per_batch"], before,
                           rates.train_settings(train, rates.training_ranks(cfg)))

    def estimate(self, r, cfg, progress):
        totals, epochs = _token_totals(r, cfg), cfg["train"]["epochs"]
        rate, basis, speed = _at_machine_speed(self, "training", r, cfg,
                                               lambda before: self.planned_rate(cfg, before))
        if totals is None or rate is None:
            return Estimate(None, basis if totals else NO_TOKENS)
        tokens = totals["train"]["tokens"] * epochs
        text = f"{epochs} epochs x {totals['train']['tokens']} tokens" + _guessed(totals)
        step, steps = _checkpointed_steps(r)
        running = _read(r / self.progress) or {}
        if (running.get("state") == "running" and running.get("resumed_from") is not None
                and process_alive(running) is not False):
            # a training under way resumed from where its progress says, not from the
            # checkpoints it has written since
            step = int(running["resumed_from"])
        left = max(steps - step, 0) / steps if step else 1.0
        if step:  # a rerun continues from the newest checkpoint
            tokens *= left
            text += f", resuming from the checkpoint at step {step}/{steps}"
        seconds, text = tokens / rate, f"{text} at {rate:.0f} tok/s ({basis})"
        if cfg["train"].get("data") == "stream":
            seconds, text = self._streamed(r, cfg, totals, left, seconds, text)
        return Estimate(seconds, text, speed)

    @staticmethod
    def _streamed(r, cfg, totals, left: float, seconds: float, text: str) -> tuple:
        """train.data stream: the server's prefill of the samples still to train on (every
        epoch's without a cache, the first epoch's with one, assuming it holds every
        sample), beside the training where the two overlap (training GPUs of its own), on top
        of it where they take turns (``train.stream_overlap``: on the CPU engine's cores, or
        on the server's GPUs)."""
        extract = Extract()
        rate, basis, _ = _at_machine_speed(extract, "prefill", r, cfg,
                                           lambda before: extract.planned_rate(cfg, before))
        if rate is None:
            return seconds, text + "; the server's prefill not estimated (" + basis + ")"
        train = cfg["train"]
        passes = train["epochs"] if not train.get("stream_cache_gib") else 1
        tokens = totals["train"]["tokens"] * passes * left
        prefill = _server_start("extract_vllm", cfg["target"]["model"]) + tokens / rate
        # the run trains on the CPU where it says so, or where it counts no GPU at all
        on_cpu = train["device"] == "cpu" or (train["device"] == "auto" and not
                                              (cfg["server"]["gpus"] or train["gpus"]))
        beside = stream_overlaps(train.get("stream_overlap", "auto"), cfg["server"]["gpus"],
                                 train["gpus"], on_cpu)
        total = max(seconds, prefill) if beside else seconds + prefill
        return total, (f"{text}; states streamed: server start + {tokens:.0f} tokens of "
                       f"prefill at {rate:.0f} tok/s ({basis}), "
                       + ("beside the training" if beside else
                          "taking turns with it" if cfg["server"]["gpus"] else
                          "on the same cores"))


class Evaluate(Stage):
    name = "evaluate"
    outputs = ("eval/acceptance.json",)
    progress = "progress/evaluate.json"
    gpu_key = ("server", "gpus")
    note = "vLLM server again"
    # its units are whole engine runs of very different lengths (the target alone is the
    # fastest, the drafter at concurrency 16 the slowest): a rate per run predicts nothing
    settles_at = 1.0
    plans_from_progress = True   # whether the sweep chose a schedule to check

    def facts(self, r):
        v = (_read(r / "eval/acceptance.json") or {}).get("verdict", {})
        keys = ("acceptance_length", "speedup_by_concurrency", "ngram_acceptance_length",
                "speeds_up_serving", "serve_never_slower_than_target", "warnings")
        return {key: v.get(key) for key in keys}

    def line(self, f):
        if f.get("acceptance_length") is None:
            return "no drafter run"
        speedups = f.get("speedup_by_concurrency") or {}
        text = f"AL {f['acceptance_length']:.2f}, best k " + ", ".join(
            f"{x:.2f}x at concurrency {c}" for c, x in speedups.items())
        if f.get("ngram_acceptance_length"):
            text += f" (ngram AL {f['ngram_acceptance_length']:.2f})"
        slow = [c for c, pays in (f.get("speeds_up_serving") or {}).items() if not pays]
        if slow:
            text += f"; does NOT speed serving up at concurrency {', '.join(slow)}"
        if f.get("serve_never_slower_than_target") is False:
            text += "; serve.json slower than the target alone somewhere"
        return text

    def kind(self, cfg):
        return "decode"

    def planned_rate(self, cfg, before=None):
        first = cfg["evaluate"]["concurrency"][0]
        return _rate("evaluate", "baseline_tokens_per_s", cfg["target"]["model"],
                     benchmark=lambda: _bench_generate(first), before=before,
                     settings=rates.evaluate_settings(cfg))

    def measured(self, r, cfg):
        """The target alone's decode rate at the first concurrency, as a finished evaluation
        measured it (its progress counts whole engine runs, server starts and all)."""
        result = _read(r / "eval/acceptance.json") or {}
        first = (result.get("concurrency") or [None])[0]
        with contextlib.suppress(LookupError, TypeError, ValueError, ZeroDivisionError):
            levels = [lv for lv in result["runs"][0]["levels"] if lv["concurrency"] == first]
            wall = sum(float(lv["wall_s"]) for lv in levels)
            rate = sum(float(lv["output_tokens"]) for lv in levels) / wall
            if rate > 0:
                started = (_read(r / "progress/evaluate.json") or {}).get("started_at")
                return Measurement(rate, wall, started if _timestamp(started) else None)
        return None

    def decode_rates(self, r, cfg) -> tuple[Callable[[int], float] | None, str, Speed | None]:
        """The target's decode tokens/s at each concurrency of the sweep, what it rests on,
        and the measurement of this run it rests on: generation's rate where it has worked
        a minute or finished (the same engine and target on this machine), else an earlier
        evaluation's or the benchmark's at the first level, at this machine's speed where a
        stage measured one. The benchmark's server rates scale it to the other levels (how
        decode grows with more requests in flight)."""
        machine = machine_speed(r, cfg)
        generated = machine.measured_by("generate")
        at = cfg["evaluate"]["concurrency"][0]
        earlier, source = self.planned_rate(cfg, machine.since)
        if earlier is not None and getattr(source, "here", False):
            # an earlier evaluation's own rate on this machine: generation's long answers
            # at its concurrency decode faster per request than the sweep's short ones (the
            # benchmark's curve put a demo's c=1 at 18 tok/s where its evaluation measured
            # 13.5, and generation's 72 tok/s at 32 planned one 1.3x long)
            rate, speed = earlier, None
            basis = f"decode {rate:.0f} tok/s at concurrency {at} (an earlier evaluation)"
        elif generated is not None:
            at, rate, speed = cfg["generate"]["concurrency"], generated.rate, generated
            basis = (f"decode {rate:.0f} tok/s at concurrency {at}, measured by generate"
                     + (f" (x{speed.factor:.2f} the benchmark's)" if speed.factor else ""))
        else:
            rate, source, speed = _at_machine_speed(self, "decode", r, cfg,
                                                    lambda before: self.planned_rate(cfg, before))
            if rate is None:
                return None, source, None
            basis = f"decode {rate:.0f} tok/s at concurrency {at} ({source})"
        base = _bench_generate(at)

        def rate_at(concurrency: int) -> float:
            level = _bench_generate(concurrency)
            return rate * (level / base if level and base else 1.0)

        return rate_at, basis, speed

    def estimate(self, r, cfg, progress):
        ev, target = cfg["evaluate"], cfg["target"]["model"]
        plan, replays = run_plan(ev)
        _, n_eval = _prompt_counts(r)
        if n_eval is None:
            return Estimate(None, "prompt count unknown")
        # the sets of their own are read by the stage itself: assume the held-out split's size
        sizes = [min(n_eval, ev["max_prompts"] or n_eval)] * (1 + len(ev["prompt_sets"]))
        rate_at, basis, speed = self.decode_rates(r, cfg)
        if rate_at is None:
            return Estimate(None, basis)
        start, measure = _server_start("generate", target), 0.0
        for c in ev["concurrency"]:
            requests = sum(len(level_prompts(range(n), c, ev["rounds"])) for n in sizes)
            measure += requests * ev["max_tokens"] * COMPLETION_FILL_GUESS / rate_at(c)
        measure *= len(ev.get("temperature") or [0])   # every level at each temperature
        # the derived k schedule gets a run of its own unless it is one fixed k or k 0
        # everywhere (nothing to check): counted until the sweep has chosen, or the last
        # minutes read near zero (interleaved, it is measured beside the target alone once
        # more: two runs); a running evaluation's progress says whether it chose one (its
        # total grows by the check)
        check = ev["schedule"] and len(ev["concurrency"]) > 1
        decided = _schedule_check_decided(progress, len(plan), replays)
        if decided is not None:
            check = check and decided
        # side by side or one at a time, as the stage itself decides (evaluate.interleave)
        from eaglet.evaluate import placement, recorded_target_dir
        together = placement(cfg, recorded_target_dir(r, target), len(plan)).together
        runs = len(plan) + ((2 if together else 1) if check else 0)
        if together:
            # the sweep's servers start up together; the check's one server on its own
            starts = _together_start(target, len(plan), start) + (start if check else 0.0)
        else:
            starts = runs * start
        seconds = starts + runs * measure + OFFLINE_REPLAY_SHARE * replays * (start + measure)
        schedule = ("" if not (ev["schedule"] and len(ev["concurrency"]) > 1) else
                    " (the schedule's check counted until the sweep has chosen)"
                    if decided is None else " (the sweep chose a schedule to check)" if check
                    else " (the sweep chose no schedule to check)")
        return Estimate(seconds,
                        f"{runs} vLLM runs {'side by side' if together else 'one at a time'}"
                        f"{schedule} x {len(sizes)} prompt sets at concurrency "
                        f"{ev['concurrency']}, {basis}"
                        + (f", {replays} offline replays" if replays else ""), speed)


def _schedule_check_decided(progress: dict | None, runs: int, replays: int) -> bool | None:
    """Whether a running evaluation checks a derived k schedule in a run of its own: True once
    its progress counts that run (the total grew past its ``runs`` engine runs and
    ``replays`` offline replays), False once its sweep has finished without it (all ``runs``
    done, the total as planned), None before (or without progress)."""
    if not progress or progress.get("state") not in ("running", "finished"):
        return None
    try:
        done, total = int(progress.get("done") or 0), int(progress.get("total") or 0)
    except (TypeError, ValueError):
        return None
    if total > runs + replays:
        return True
    return False if total == runs + replays and done >= runs else None


def _together_start(target: str, servers: int, start: float) -> float:
    """Seconds for ``servers`` vLLM servers started together to be ready: an earlier
    evaluation's measurement, scaled to this many (on a few CPU cores their start-ups share
    the cores), else as long as one after another."""
    entry = rates.lookup_entry("evaluate", "sweep_start_s", target)
    if entry is None:
        return servers * start
    return float(entry["sweep_start_s"]) * servers / float(entry.get("sweep_servers") or servers)


class Scaling(Stage):
    """Optional (scaling.enabled): the drafter trained again on nested subsets of the samples
    and the fit that predicts the data a target AL needs (eaglet.scaling)."""
    name = "scaling"
    rules = ("scaling_train", "scaling")
    outputs = ("eval/scaling.json",)
    progress = "progress/scaling_*.json"
    log = "logs/scaling"
    gpu_key = ("train", "gpus")

    def enabled(self, cfg: dict) -> bool:
        return bool(cfg.get("scaling", {}).get("enabled"))

    def facts(self, r):
        s = _read(r / "eval/scaling.json") or {}
        return {"sentence": s.get("sentence"), "check": s.get("check")}

    def line(self, f):
        return f.get("sentence") or "no prediction"

    def estimate(self, r, cfg, progress):
        # the subsets not trained yet, each its share of the full training
        left = sum(f for f in cfg["scaling"]["fractions"]
                   if not (r / "scaling" / f"{f:g}" / "stats.json").exists())
        totals, train = _token_totals(r, cfg), cfg["train"]
        rate, basis, speed = _at_machine_speed(
            self, "training", r, cfg, lambda before: Train().planned_rate(cfg, before))
        if totals is None or rate is None:
            return Estimate(None, basis if totals else NO_TOKENS)
        epochs = train["epochs"]
        tokens = totals["train"]["tokens"] * epochs * left
        return Estimate(tokens / rate, f"{left:g} x {epochs} epochs x {totals['train']['tokens']} "
                        f"tokens at {rate:.0f} tok/s ({basis})", speed)


# The stages in the workflow's order. Status also reads a results dir without Snakemake
# (--no-snakemake, a copied results dir, no workflow at hand), so their order, rules and
# outputs are listed here, in one place; tests/test_status.py checks them against the jobs
# of a Snakemake dry run.
STAGES: list[Stage] = [PrepareTarget(), PreparePrompts(), Generate(), VocabMap(), Extract(),
                       Train(), Evaluate()]
# stages a config turns on (``enabled(cfg)``), after all of the above
OPTIONAL_STAGES: list[Stage] = [Scaling()]
_BY_NAME = {s.name: s for s in STAGES + OPTIONAL_STAGES}


def _grounded(planned: Estimate, kind: str | None) -> bool:
    """Whether a plan rests on this machine's own measure of the stage's kind of work: this
    run's speed of that kind, or an earlier run's rate here."""
    if planned.speed is not None:
        return planned.speed.kind == kind
    return EARLIER_RUN in planned.basis


def estimate(stage: str, r: Path, cfg: dict, progress: dict | None) -> Estimate:
    """Time left of ``stage``: a running stage's own ETA once it has settled, else the
    stage's plan (less the time it has run, while it runs)."""
    running = bool(progress) and progress.get("state") == "running"
    own = progress.get("eta_s") if running else None
    spec = _BY_NAME.get(stage)
    if own is not None:
        done, total = progress.get("done"), progress.get("total")
        if spec is None or not total or done is None or done / total >= spec.settles_at:
            return Estimate(own, "this run's progress")
        planned = spec.estimate(r, cfg, progress if spec.plans_from_progress else None)
        if planned.seconds is None:
            return Estimate(own, "this run's progress")
        elapsed = progress.get("elapsed_s") or 0.0
        if planned.seconds <= elapsed:  # the plan is spent and the stage goes on: the plan was
            return Estimate(own, f"this run's progress ({done}/{total} done; its plan of "  # wrong
                                 f"{format_duration(planned.seconds)} is spent)")
        if (spec.settles_at < 1.0 and elapsed >= MEASURED_AFTER_S
                and not _grounded(planned, spec.kind(cfg))):
            # a plan from another kind of work's speed (or from the reference and benchmarks
            # alone) is a guess next to a minute of the stage's own work: a first run's
            # training, planned by extraction's prefill speed, read 0.7 minutes left where
            # its own 144 of 705 steps in 59 s said 3.8 (4.1 in truth)
            return Estimate(own, f"this run's progress ({done}/{total} done in "
                                 f"{format_duration(elapsed)}; its plan rested on "
                                 f"{planned.basis})")
        return Estimate(planned.seconds - elapsed,
                        f"{planned.basis}, less the {format_duration(elapsed)} it has run "
                        f"({done}/{total} done: its own rate is not settled)", planned.speed)
    if spec is None:
        return Estimate(None, "unknown stage")
    planned = spec.estimate(r, cfg, progress)
    if running and planned.seconds is not None:
        # no rate of its own yet (nothing done: a server starting, an interleaved evaluation
        # that finishes its runs together): the plan, less the time it has run
        elapsed = progress.get("elapsed_s") or 0.0
        return Estimate(max(planned.seconds - elapsed, 0.0),
                        f"{planned.basis}, less the {format_duration(elapsed)} it has run",
                        planned.speed)
    return planned


# -- gathering -------------------------------------------------------------------------------

_FAILED = re.compile(r" ERROR eaglet\.[\w.]+: [\w\[\]]+ failed: (?P<why>.*)")


def _last_error(log: Path) -> tuple[str, float] | None:
    """The reason a stage's job last failed, as its ``run_stage`` logged it, and when (the
    log's modification time). Snakemake deletes a job's log before running it again, so a
    failure in a log is its job's last run."""
    files = sorted(log.rglob("*.log")) if log.is_dir() else [log]
    found = []
    for path in files:
        try:
            lines = path.read_text(errors="replace").splitlines()
            mtime = path.stat().st_mtime
        except OSError:
            continue
        for line in reversed(lines[-200:]):
            match = _FAILED.search(line)
            if match:
                found.append((match["why"][:300], mtime))
                break
    return max(found, key=lambda f: f[1]) if found else None


def _newest_output(r: Path, stage: Stage) -> float:
    return max(os.stat(p).st_mtime for out in stage.outputs for p in glob.glob(str(r / out)))


def _took(progresses: list[dict]) -> float | None:
    """Wall time of a finished stage: from its first job's start to its last job's end (the
    shards of extract run as separate jobs, in parallel where resources allow)."""
    try:
        starts = [datetime.fromisoformat(p["started_at"]) for p in progresses]
        ends = [datetime.fromisoformat(p["updated_at"]) for p in progresses]
    except (KeyError, TypeError, ValueError):
        return None
    if not starts or any(p.get("state") != "finished" for p in progresses):
        return None
    return (max(ends) - min(starts)).total_seconds()


def snakemake_run(r: Path) -> dict | None:
    """The Snakemake that last started on ``r`` (``run/snakemake.json``, written by the
    Snakefile's onstart): its record, whether it still runs, and when it started."""
    path = r / "run" / "snakemake.json"
    record = _read(path)
    if not isinstance(record, dict) or not record.get("pid"):
        return None
    try:
        started = path.stat().st_mtime
    except OSError:
        return None
    return {**record, "alive": pid_alive(record["pid"]), "started": started}


def _log_started(log: Path) -> float | None:
    """When a stage's job began logging: the time of its log's first line (``run_stage``
    opens the log as the job starts)."""
    try:
        with open(log, errors="replace") as handle:
            first = handle.readline()
        return datetime.strptime(first[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except (OSError, ValueError):
        return None


def _job_without_progress(stage: Stage, r: Path) -> dict | None:
    """A record like a progress file's for a stage that writes none (prepare_target,
    prepare_prompts, vocab_map) while its job runs: its log was written since the run's
    Snakemake started and its outputs are not all there yet. Without it such a stage read
    pending for as long as it ran (an embedded target's dequantization: a minute or more).
    Its state is ``interrupted`` once that Snakemake is gone."""
    run = snakemake_run(r)
    log = r / stage.log
    if run is None or not log.is_file():
        return None
    try:
        if log.stat().st_mtime < run["started"]:
            return None  # an earlier run's log
    except OSError:
        return None
    began = _log_started(log) or run["started"]
    return {"stage": stage.name, "state": "running" if run["alive"] else "interrupted",
            "pid": run["pid"], "snakemake_job": True, "log": str(log),
            "elapsed_s": max(time.time() - began, 0.0), "eta_s": None,
            "started_at": datetime.fromtimestamp(began, timezone.utc).isoformat(timespec="seconds")}


def stage_status(stage: Stage, r: Path, cfg: dict, outdated: set[str]) -> dict:
    """Where ``stage`` stands; ``outdated``: the rules Snakemake would run now."""
    done = all(glob.glob(str(r / out)) for out in stage.outputs)
    progress_files = sorted(glob.glob(str(r / stage.progress))) if stage.progress else []
    progresses = [p for p in (stage.read_progress(r, Path(f)) for f in progress_files) if p]
    active = [p for p in progresses if p.get("state") == "running"]
    running = [p for p in active if process_alive(p) is not False]
    stale = [p for p in active if process_alive(p) is False]
    failure = _last_error(r / stage.log) if not running else None
    if failure and done and failure[1] <= _newest_output(r, stage):
        failure = None  # an older failure: the outputs were made after it
    job = None if done or failure or stage.progress else _job_without_progress(stage, r)
    if job is not None:
        (running if job["state"] == "running" else stale).append(job)
    out: dict[str, Any] = {"stage": stage.name}
    if running:
        out["state"] = "running"
        out["progress"] = running
    elif failure:  # also when its process is gone or an older output is still there
        out["state"] = "failed"
        out["error"] = failure[0]
    elif done:
        out["state"] = "outdated" if outdated & set(stage.rules) else "completed"
        out["facts"] = stage.facts(r)
        out["took_s"] = _took(progresses)
    elif stale:
        out["state"] = "interrupted"
        out["progress"] = stale
    else:
        out["state"] = "pending"
    if stage.gpu_key:
        out["gpus"] = stage.gpus(cfg)
    if out["state"] != "completed":
        first = (out.get("progress") or [None])[0]
        est = estimate(stage.name, r, cfg, first if out["state"] == "running" else None)
        out["estimate_s"], out["estimate_basis"] = est.seconds, est.basis
        # the measurement of this run the plan rests on: this machine's speed for a kind of
        # work (the factor over the plan's rate), and the stage that measured it
        out["speed_factor"] = est.speed.factor if est.speed else None
        out["speed_kind"] = est.speed.kind if est.speed else None
        out["speed_from"] = est.speed.stage if est.speed else None
    out["log"] = str(r / stage.log)
    return out


def snakemake_outdated(workflow: Path, config_args: list[str]) -> set[str] | None:
    """Rules Snakemake would run now (a dry run without taking the lock), or None."""
    if not (workflow / "Snakefile").exists():
        return None
    cmd = [str(Path(sys.executable).parent / "snakemake"), "-n", "--nolock", "--quiet",
           "rules", *config_args]
    try:
        proc = subprocess.run(cmd, cwd=workflow, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    rules = set()
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit() and parts[0] not in ("total", "job"):
            rules.add(parts[0])
    return rules


def snakemake_config_args(results: Path, config_path: str | None) -> list[str]:
    """Snakemake arguments that give the dry run the config this run was made with: the
    given file, else the run's own record (results/run/config.json), so that a run started
    with ``--configfile`` is not judged against the workflow's default config."""
    recorded = results / "run" / "config.json"
    if config_path is None and recorded.exists():
        config_path = str(recorded.resolve())
    args = ["--config", f"results_dir={results}"]
    return ["--configfile", config_path, *args] if config_path else args


def _names_results(line: str, workdir: str, roots: set[str]) -> bool:
    """Whether a path in a Snakemake lock file (as the rules name it: relative to the
    working directory, or absolute) lies in one of ``roots``."""
    path = os.path.normpath(os.path.join(workdir, line.strip()))
    return any(path == root or path.startswith(root + os.sep) for root in roots)


def stale_lock(workdir: Path, results: Path, config_args: list[str],
               command: str | None = None) -> dict | None:
    """The lock a Snakemake left in ``workdir/.snakemake/locks`` when it was killed (it
    removes the lock only on its way out), if the lock names files of ``results``: the next
    run on them stops with Snakemake's LockException until ``snakemake --unlock`` (with the
    run's config, so that the Snakefile reads as it did) removes it. Call it only when the
    Snakemake that ran ``results`` is gone: a running one holds its lock rightly."""
    lock_dir = workdir / ".snakemake" / "locks"
    files = sorted(lock_dir.glob("*.lock")) if lock_dir.is_dir() else []
    roots = {os.path.abspath(results), os.path.realpath(results)}
    base = os.path.abspath(workdir)
    named = False
    for path in files:
        with contextlib.suppress(OSError):
            named = any(_names_results(line, base, roots)
                        for line in path.read_text(errors="replace").splitlines() if line.strip())
        if named:
            break
    if not named:
        return None
    words: list[str] = []
    with contextlib.suppress(ValueError):  # an unbalanced quote in the recorded command
        words = shlex.split(command or "")
    # the Snakemake the run used (.venv/bin/snakemake), as the recorded command names it
    program = words[0] if words and os.path.basename(words[0]) == "snakemake" else "snakemake"
    unlock = shlex.join([program, "--unlock", *config_args])
    if os.path.realpath(workdir) != os.path.realpath(os.getcwd()):
        unlock = f"cd {shlex.quote(str(workdir))} && {unlock}"
    return {"lock_dir": str(lock_dir), "files": [p.name for p in files], "unlock": unlock}


def collect(results: Path, cfg: dict, workflow: Path | None = None,
            config_args: list[str] | None = None, workdir: Path | None = None) -> dict:
    """Everything status shows. ``workdir``: the directory Snakemake runs in, whose
    ``.snakemake/locks`` a killed run leaves behind (default: ``workflow``, else the
    current directory)."""
    outdated = snakemake_outdated(workflow, config_args or []) if workflow else None
    stages = [stage_status(s, results, cfg, outdated or set())
              for s in STAGES + [o for o in OPTIONAL_STAGES if o.enabled(cfg)]]
    remaining = [s for s in stages if s["state"] not in ("completed",)]
    known = [s["estimate_s"] for s in remaining if s.get("estimate_s") is not None]
    # nothing left is no time left (None: some remaining stage has no estimate at all)
    total = sum(known) if known or not remaining else None
    snake = _read(results / "run" / "snakemake.json") or {}
    alive = pid_alive(snake.get("pid"))
    lock = None
    if snake.get("pid") and not alive:
        lock = stale_lock(workdir or workflow or Path("."), results,
                          config_args if config_args is not None
                          else snakemake_config_args(results, None), snake.get("command"))
    return {
        "results": str(results), "checked_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "snakemake": {"pid": snake.get("pid"), "running": alive,
                      "command": snake.get("command"), "stale_lock": lock},
        "stages": stages,
        "remaining_s": total,
        "remaining_complete": len(known) == len(remaining),
        "finishes_at": ((datetime.now(timezone.utc) + timedelta(seconds=total)).isoformat(timespec="minutes")
                        if total is not None else None),
        "snakemake_view": "checked" if outdated is not None else "not checked",
    }


# -- rendering -------------------------------------------------------------------------------

def _facts_line(s: dict) -> str:
    stage = _BY_NAME.get(s["stage"])
    facts = s.get("facts", {})
    return stage.line(facts) if stage else json.dumps(facts)


def order_line() -> str:
    return "Order: " + " -> ".join(s.name + (f" ({s.note})" if s.note else "") for s in STAGES)


def render(report: dict) -> str:
    lines = [f"eaglet status of {report['results']} at {report['checked_at']}"]
    snake = report["snakemake"]
    if snake["pid"]:
        lines.append(f"snakemake: {'running' if snake['running'] else 'not running'} "
                     f"(pid {snake['pid']})")
    unlock = (snake.get("stale_lock") or {}).get("unlock")
    # jobs that outlived their Snakemake: a rerun beside them would write their files twice
    orphans = ([p for s in report["stages"] if s["state"] == "running" for p in s["progress"]
                if p.get("pid")] if snake["pid"] and not snake["running"] else [])
    if orphans:
        pids = " ".join(str(p["pid"]) for p in orphans)
        lines.append("  its jobs still run without it: "
                     + ", ".join(f"{p['stage']} (pid {p['pid']})" for p in orphans)
                     + f"; stop them first (kill {pids}): a rerun's jobs refuse to start beside "
                     f"them (they would write the same files)")
    if unlock:
        first = "stop the jobs above, then " if orphans else ""
        lines.append(f"  it was stopped and left its lock in {snake['stale_lock']['lock_dir']}: "
                     f"the next run stops with LockException until you {first}run\n    {unlock}")
    by_state: dict[str, list[dict]] = {}
    for s in report["stages"]:
        by_state.setdefault(s["state"], []).append(s)

    lines.append("\nCompleted:")
    for s in by_state.get("completed", []) + by_state.get("outdated", []):
        mark = "~" if s["state"] == "outdated" else "+"
        note = "  (outdated: Snakemake will rerun it)" if s["state"] == "outdated" else ""
        took = f"[{format_duration(s['took_s'])}] " if s.get("took_s") is not None else ""
        lines.append(f"  {mark} {s['stage']:<16}{took}{_facts_line(s)}{note}")
    if not by_state.get("completed") and not by_state.get("outdated"):
        lines.append("  (nothing yet)")

    active = by_state.get("running", []) + by_state.get("interrupted", []) + by_state.get("failed", [])
    if active:
        lines.append("\nRunning / stopped:")
    for s in active:
        if s["state"] == "failed":
            lines.append(f"  ! {s['stage']:<16}FAILED: {s['error']}\n{'':20}log: {s['log']}")
            continue
        for p in s["progress"]:
            rate = f"{p['rate_per_s']:.2f} {p['unit']}/s" if p.get("rate_per_s") else "rate ?"
            word = "running" if s["state"] == "running" else "INTERRUPTED (process gone; " + (
                "remove Snakemake's lock as said above, then rerun snakemake to resume)"
                if unlock else "rerun snakemake to resume)")
            if p.get("phase"):
                word += f" ({p['phase']})"
            if p.get("snakemake_job"):  # a stage that counts nothing: Snakemake runs its job
                since = (f" for {format_duration(p.get('elapsed_s'))}"
                         if s["state"] == "running" else "")
                lines.append(f"  > {p['stage']:<16}{word}{since} (Snakemake's job, pid "
                             f"{p['pid']})\n{'':20}log: {p['log']}")
                continue
            gpu = f", holds {s['gpus']} GPU(s)" if s.get("gpus") and s["state"] == "running" else ""
            if p.get("host") and p["host"] != socket.gethostname():
                gpu += f", on host {p['host']}"
            lines.append(f"  > {p['stage']:<16}{word}: {p['done']}/{p['total']} {p['unit']}, "
                         f"{p['failed']} failed, {rate}, ETA {format_duration(p.get('eta_s'))}, "
                         f"pid {p['pid']}{gpu}\n{'':20}log: {p.get('log') or s.get('log')}")

    todo = [s for s in report["stages"] if s["state"] in ("pending", "outdated", "interrupted", "failed")]
    lines.append("\nRemaining (estimated):")
    for s in todo:
        lines.append(f"  - {s['stage']:<16}{'~' + format_duration(s.get('estimate_s')):<10}"
                     f"{s.get('estimate_basis', '')}")
    if not todo and not by_state.get("running"):
        lines.append("  nothing: the run is complete")
    if report["remaining_s"] is not None and (todo or by_state.get("running")):
        partial = "" if report["remaining_complete"] else " (some stages have no estimate yet)"
        lines.append(f"  total remaining ~{format_duration(report['remaining_s'])}, finishing "
                     f"around {report['finishes_at']}{partial}")
    lines.append("\n" + order_line())
    running_logs = [p.get("log") for s in by_state.get("running", []) for p in s["progress"]]
    lines.append(f"Follow it: eaglet status --results {shlex.quote(report['results'])} --watch 10"
                 + (f"   or   tail -f {shlex.quote(running_logs[0])}"
                    if running_logs and running_logs[0] else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="eaglet status", description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=None, help="results directory (default: the config's)")
    parser.add_argument("--configfile", dest="config", default=None,
                        help="config file, as Snakemake took it (default: the one the run "
                        "recorded in RESULTS/run/config.json, else ./config.yaml)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--watch", type=float, default=None, metavar="SECONDS")
    parser.add_argument("--workflow", default=".", help="workflow directory, for Snakemake's view")
    parser.add_argument("--no-snakemake", action="store_true",
                        help="do not ask Snakemake which outputs are out of date (faster)")
    args = parser.parse_args(argv)

    results_hint = Path(args.results) if args.results else None
    try:
        cfg = load_run_config(results_hint or Path("results"), args.config, Path(args.workflow))
    except ConfigError as error:
        print(f"eaglet status: {error}", file=sys.stderr)
        return 2
    results = results_hint or Path(cfg["results_dir"])
    if results_hint is not None and not results.is_dir():
        print(f"eaglet status: {results} is not a results directory (nothing has run there). "
              f"Give the results_dir of a run, e.g. --results {shlex.quote(cfg['results_dir'])}",
              file=sys.stderr)
        return 2
    config_args = snakemake_config_args(results, args.config)
    workflow = None if args.no_snakemake else Path(args.workflow)
    while True:
        report = collect(results, cfg, workflow, config_args, workdir=Path(args.workflow))
        text = json.dumps(report, indent=2) if args.json else render(report)
        if args.watch:
            print("\033[2J\033[H" + text, flush=True)
            time.sleep(args.watch)
            continue
        print(text)
        return 0
