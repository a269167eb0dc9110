"""Measured rates of finished stages, kept across runs for `eaglet status` ETAs.

Each stage appends what it measured (tokens/s, server start-up seconds) to
``$EAGLET_RATES`` or ``~/.cache/eaglet/rates.jsonl``, keyed by the target and the device
kind, so a new run can estimate its stages before it has measured anything itself.
"""

from __future__ import annotations

import json
import os
import platform
from datetime import datetime
from pathlib import Path

from eaglet.core import methods
from eaglet.core.layout import BENCHMARK_RESULTS
from eaglet.core.progress import now_iso

# The rates one `make demo` recorded with a fresh history (benchmarks/status_poll.py
# --reference): every kind of work measured by the same code on one machine in one run, so a
# first run, which has no history of its own, plans each stage from them scaled by the speed
# it measures of this machine (eaglet.tools.status), where the separate benchmarks, measured at
# other times by other code, disagreed with each other by up to 3x in their ratios.
REFERENCE_RATES = BENCHMARK_RESULTS / "reference_rates.jsonl"

# The kinds of work a rate is recorded for (an entry's "stage") and the fields each records,
# named once: the stages that measure them and `eaglet status` that reads them use these, and
# record() and lookup_entry() refuse any other.
GENERATE = "generate"  # generation: its server's start-up, decode tokens/s of the answers
EXTRACT = "extract"  # the hf backend's forward tokens/s
PREFILL = "extract_vllm"  # vLLM extraction's prefill tokens/s, its server's start-up
PACK = "extract_pack"  # packing captured states into shards (no server), tokens/s
TRAIN = "train"  # training tokens/s and the layer passes a token cost (train_passes)
EVALUATE = "evaluate"  # the target alone's decode tokens/s; the sweep's servers' start-up
TOKENS_PER_S, SERVER_START_S = "tokens_per_s", "server_start_s"
FIELDS = {
    GENERATE: (SERVER_START_S, "completion_tokens_per_s"),
    EXTRACT: (TOKENS_PER_S,),
    PREFILL: (SERVER_START_S, TOKENS_PER_S),
    PACK: (TOKENS_PER_S,),
    TRAIN: (TOKENS_PER_S, "ttt_steps"),
    EVALUATE: ("baseline_tokens_per_s", "sweep_servers", "sweep_start_s"),
}


def _declared(stage: str, keys) -> None:
    """Refuse a rate of a kind of work or a field not declared in :data:`FIELDS`."""
    undeclared = [k for k in keys if k not in FIELDS.get(stage, ())]
    if stage not in FIELDS or undeclared:
        raise ValueError(
            f"rates: {stage!r} {undeclared} is not declared in eaglet.core.rates.FIELDS"
        )


def reference_path() -> Path | None:
    """``$EAGLET_REFERENCE_RATES`` ("" for none) or the shipped reference rates."""
    if "EAGLET_REFERENCE_RATES" in os.environ:
        value = os.environ["EAGLET_REFERENCE_RATES"]
        return Path(value) if value else None
    return REFERENCE_RATES


def history_path() -> Path:
    if os.environ.get("EAGLET_RATES"):
        return Path(os.environ["EAGLET_RATES"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "eaglet" / "rates.jsonl"


def device_kind() -> str:
    """A cheap name for the kind of machine (no torch import: status must stay fast)."""
    if Path("/proc/driver/nvidia/version").exists():
        return f"nvidia:{platform.node()}"
    return f"cpu:{platform.machine()}:{os.cpu_count()}"


# The settings a stage's rate depends on, recorded beside it and matched when it is read: the
# engine's throughput grows with the requests it has in flight.
def generate_settings(cfg: dict) -> dict:
    """Generation's decode tokens/s: at ``generate.concurrency``."""
    return {"concurrency": cfg["generate"]["concurrency"]}


def prefill_settings(cfg: dict) -> dict:
    """vLLM extraction's prefill tokens/s: at ``extract.concurrency``."""
    return {"concurrency": cfg["extract"]["concurrency"]}


def evaluate_settings(cfg: dict) -> dict:
    """The evaluation's target-alone decode tokens/s: at its first concurrency level."""
    return {"concurrency": cfg["evaluate"]["concurrency"][0]}


def train_settings(train: dict, ranks: int = 1) -> dict:
    """Training tokens/s (``train``: the config's train section): at its micro-batch size and
    method (the TTT steps are scaled for, not matched) and its number of data-parallel
    ``ranks`` (None for one: a rate recorded before ranks were kept was one process's)."""
    return {
        "max_tokens_per_batch": train["max_tokens_per_batch"],
        "method": train.get("method", methods.DEFAULT.name),
        "ranks": ranks if ranks > 1 else None,
    }


def train_passes(train: dict) -> int:
    """The drafter layer passes one training token costs (``train``: the config's train
    section), which a training rate is scaled by between runs: a TTT step each (EAGLE-3,
    P-EAGLE); DFlash's block of ttt_steps + 1 slots through each of its layers."""
    return methods.method(train.get("method", methods.DEFAULT.name)).layer_passes(
        train["ttt_steps"], train.get("dflash_layers", 1)
    )


def training_ranks(cfg: dict) -> int:
    """The data-parallel processes rule train runs (scripts/train.py): one per GPU of its own,
    or with train.data stream and train.gpus 0 one on each of the server's GPUs."""
    train = cfg["train"]
    if train.get("data") == "stream":
        return max(1, train["gpus"] or cfg["server"]["gpus"])
    return max(1, train["gpus"])


def _measured(value) -> bool:
    """A rate or time that measured something: a number above zero (a stage that did no work
    measures 0, which no estimate can divide by)."""
    try:
        return float(value) > 0
    except (TypeError, ValueError):
        return False


def record(stage: str, target: str, settings: dict | None = None, **values: float | None) -> None:
    """Append one measurement (values that measured nothing are left out), with the
    ``settings`` it was measured at (a decode rate at concurrency 4 is no rate for
    concurrency 32); never fails the stage that measured it."""
    _declared(stage, values)
    kept = {k: v for k, v in values.items() if _measured(v)}
    if not kept:
        return
    entry = {"stage": stage, "target": target, "device": device_kind(), "at": now_iso(), **kept}
    if settings:
        entry["settings"] = settings
    try:
        path = history_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as handle:
            handle.write(json.dumps(entry) + "\n")
    except OSError:
        pass


def lookup(
    stage: str,
    key: str,
    target: str | None = None,
    before: str | None = None,
    settings: dict | None = None,
) -> float | None:
    """Latest recorded ``key`` of ``stage`` for ``target``: on this device first, then on any.
    ``before`` (an ISO time): only what was recorded before it. ``settings``: only what was
    measured at them (see :func:`lookup_entry`)."""
    entry = lookup_entry(stage, key, target, before, settings)
    return None if entry is None else float(entry[key])


def _recorded_before(entry: dict, before: str | None) -> bool:
    """Whether ``entry`` was recorded before ``before`` (an entry without a time is old)."""
    if before is None or not entry.get("at"):
        return True
    try:
        return datetime.fromisoformat(entry["at"]) < datetime.fromisoformat(before)
    except (TypeError, ValueError):
        return True


def _measured_at(entry: dict, settings: dict | None) -> bool | None:
    """Whether ``entry`` was measured at ``settings``: True, False, or None where it does
    not say (recorded before stages kept their settings)."""
    if not settings:
        return True
    recorded = entry.get("settings")
    if not isinstance(recorded, dict):
        return None
    return all(recorded.get(k) == v for k, v in settings.items())


def lookup_entry(
    stage: str,
    key: str,
    target: str | None = None,
    before: str | None = None,
    settings: dict | None = None,
) -> dict | None:
    """The whole entry :func:`lookup` reads ``key`` from (with the settings it was measured
    at, where the stage recorded them). ``settings``: an entry measured at other settings is
    never used (a test run at concurrency 4 planned a demo at 32 eight times too slow); one
    that does not say is used only where none measured at them."""
    _declared(stage, (key,))
    entries = [e for e in _entries(history_path(), stage, key) if _recorded_before(e, before)]
    found = _match(entries, target, settings)
    if found is None:
        found = reference_entry(stage, key, target, settings)
    return found


def reference_entry(
    stage: str, key: str, target: str | None = None, settings: dict | None = None
) -> dict | None:
    """The reference run's entry for ``key`` of ``stage`` (:data:`REFERENCE_RATES`), for this
    target and measured at exactly ``settings``, marked ``"reference": True``; None where it
    has none."""
    path = reference_path()
    if path is None:
        return None
    entries = [e for e in _entries(path, stage, key) if _measured_at(e, settings) is True]
    found = _match(entries, target, settings)
    return None if found is None else {**found, "reference": True}


def _entries(path: Path, stage: str, key: str) -> list[dict]:
    """The entries of a rates file that measured ``key`` of ``stage``, oldest first."""
    if not path.exists():
        return []
    entries = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict) and entry.get("stage") == stage and _measured(entry.get(key)):
            entries.append(entry)
    return entries


def _match(entries: list[dict], target: str | None, settings: dict | None) -> dict | None:
    # Only this target's own rates: another target's (a rehearsal's miniature before the real
    # run, most often) is no rate for this one: the Kimi miniature trained at 4x SmolLM2's
    # tokens/s and the demo after it was planned at that. Without one, the benchmarks for this
    # target's shape, else this run's own first minute, plan the stage.
    here = device_kind()
    entries = [e for e in entries if _measured_at(e, settings) is not False]
    for match in (
        lambda e: e.get("target") == target and e.get("device") == here,
        lambda e: e.get("target") == target,
    ):
        found = [e for e in entries if match(e)]
        if found:
            same = [e for e in found if _measured_at(e, settings)]
            return (same or found)[-1]
    return None
