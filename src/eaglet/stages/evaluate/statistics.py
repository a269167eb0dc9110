"""Speedups with their intervals: rounds' ratios, the t quantile, and the comparisons the
verdict words (faster, slower, no measurable difference)."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from eaglet.core.io import read_json
from eaglet.core.methods import words
from eaglet.stages.evaluate.runs import drafter_kind, is_drafter

# two-sided 95%: the share of Student's t distribution within +-t
CONFIDENCE = 0.95


def _t_within(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with ``df`` degrees of freedom, in closed form for whole df
    (Abramowitz and Stegun 26.7.3 and 26.7.4)."""
    theta = math.atan(t / math.sqrt(df))
    cos2 = math.cos(theta) ** 2
    if df % 2 == 0:
        term = total = 1.0
        for j in range(2, df - 1, 2):
            term *= cos2 * (j - 1) / j
            total += term
        return math.sin(theta) * total
    if df == 1:
        return 2 * theta / math.pi
    term = total = math.cos(theta)
    for j in range(3, df - 1, 2):
        term *= cos2 * (j - 1) / j
        total += term
    return 2 / math.pi * (theta + math.sin(theta) * total)


def t_quantile(df: int, confidence: float = CONFIDENCE) -> float:
    """The t with ``confidence`` of Student's t distribution (``df`` degrees of freedom)
    within +-t: 12.71 at df 1, 2.78 at 4, 1.96 as df grows."""
    low, high = 0.0, 1e4
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if _t_within(mid, df) < confidence else (low, mid)
    return (low + high) / 2


def speedup_interval(speedup: float, ratios: list[float]) -> dict:
    """``speedup_low`` and ``speedup_high`` of a speedup measured in rounds: the speedup
    (pooled tokens/s over the target alone's) +- t(0.975, n-1) s/sqrt(n), with s the standard
    deviation of the n rounds' own speedups (each round's tokens/s over the target alone's in
    the same round, on the same prompts): a 95% interval, taking the rounds as independent
    repeats. Side by side, a round's two runs share the machine's state at that time; one at a
    time they share the prompts only, so a machine that drifts between the runs moves every
    round's ratio alike, which no interval shows. None with fewer than two rounds (a level of
    one round: the prompt set held no more than ``concurrency`` prompts)."""
    n = len(ratios)
    if n < 2:
        return {"speedup_low": None, "speedup_high": None}
    mean = sum(ratios) / n
    sd = math.sqrt(sum((r - mean) ** 2 for r in ratios) / (n - 1))
    half = t_quantile(n - 1) * sd / math.sqrt(n)
    return {"speedup_low": speedup - half, "speedup_high": speedup + half}


def _round_ratios(levels: list[dict], refs: list[dict]) -> list[float]:
    """The speedup round by round of ``levels`` (one, or every set's at one concurrency)
    over the target alone's same rounds ``refs``: round r's tokens over its wall time, pooled
    over the levels as the speedup itself is, against the target alone's round r."""

    def per_round(chosen: list[dict]) -> list[float]:
        tokens: dict[int, float] = defaultdict(float)
        wall: dict[int, float] = defaultdict(float)
        for lv in chosen:
            for r, part in enumerate(lv.get("by_round") or []):
                tokens[r] += part["output_tokens"]
                wall[r] += part["wall_s"]
        return [tokens[r] / wall[r] for r in sorted(wall)]

    return [mine / theirs for mine, theirs in zip(per_round(levels), per_round(refs))]


def add_speedups(runs: list[dict], concurrencies: list[int], base: dict | None = None) -> None:
    """Speedup of every level over the baseline's same set and concurrency, and per
    concurrency over all sets together (tokens over wall time, pooled), each with its 95%
    interval from the rounds (:func:`speedup_interval`; per concurrency, round r of every set
    pooled). ``base``: the baseline measured beside these runs (default: the first run). A
    baseline other than the first run is kept in each run (``baseline_levels``), so its
    speedups can be read back."""
    kept = None
    if base is not None:
        kept = [
            {
                k: lv[k]
                for k in (
                    "set",
                    "concurrency",
                    "output_tokens",
                    "wall_s",
                    "output_tokens_per_s",
                    "by_round",
                    "mean_latency_s",
                )
                if k in lv
            }
            for lv in base["levels"]
        ]
    base = base or runs[0]
    ref_levels = {(lv["set"], lv["concurrency"]): lv for lv in base["levels"]}
    base_pooled = _pooled(base, concurrencies)
    for run in runs:
        if kept is not None:
            run["baseline_levels"] = kept
        for lv in run["levels"]:
            ref = ref_levels[(lv["set"], lv["concurrency"])]
            lv["speedup"] = lv["output_tokens_per_s"] / ref["output_tokens_per_s"]
            lv.update(speedup_interval(lv["speedup"], _round_ratios([lv], [ref])))
            lv["latency_ratio"] = lv["mean_latency_s"] / ref["mean_latency_s"]
        run["by_concurrency"] = []
        for c, tps in _pooled(run, concurrencies).items():
            mine = [lv for lv in run["levels"] if lv["concurrency"] == c]
            refs = [ref_levels[(lv["set"], c)] for lv in mine]
            run["by_concurrency"].append(
                {
                    "concurrency": c,
                    "output_tokens_per_s": tps,
                    "speedup": tps / base_pooled[c],
                    **speedup_interval(tps / base_pooled[c], _round_ratios(mine, refs)),
                }
            )


def step_ms(levels: list[dict]) -> float | None:
    """Milliseconds per decoding step of one request, over ``levels`` at one concurrency:
    wall time over the steps each request in flight took. A step of a drafting run is one
    draft and its verification (vLLM's drafts counter counts one per request and step); the
    target alone's step is one token. Prefill is spread over the steps, alike in every run.
    Beside the target alone's at the same concurrency, the difference is what drafting and
    verifying k tokens costs per step on this machine."""
    steps = sum((lv.get("drafts") or lv["output_tokens"]) / lv["concurrency"] for lv in levels)
    return 1000 * sum(lv["wall_s"] for lv in levels) / steps if steps else None


def methods_table(runs: list[dict], concurrencies: list[int]) -> list[dict]:
    """Every drafter served at one fixed k, this run's and those compared with it
    (:func:`compare_runs`), side by side from one temperature's runs (the target alone first,
    their speedups added): acceptance length pooled and per request, acceptance per position,
    and at each concurrency the speedup with its interval and the time per step beside the
    target alone's; the minutes its training took where its directory says
    (``stats.json``)."""
    base = runs[0]
    alone = {
        c: step_ms([lv for lv in base["levels"] if lv["concurrency"] == c]) for c in concurrencies
    }
    rows = []
    for run in runs:
        if not is_drafter(run) or run.get("schedule"):
            continue
        by_c = []
        for c in concurrencies:
            entry = at_concurrency(run, c) if run.get("by_concurrency") else {}
            mine = step_ms([lv for lv in run["levels"] if lv["concurrency"] == c])
            by_c.append(
                {
                    "concurrency": c,
                    **{key: entry.get(key) for key in ("speedup", "speedup_low", "speedup_high")},
                    "step_ms": mine,
                    "target_step_ms": alone[c],
                    "step_over_target_ms": (mine - alone[c]) if mine and alone[c] else None,
                }
            )
        stats = Path(run.get("drafter") or ".", "stats.json")
        elapsed = read_json(stats).get("elapsed_s") if stats.is_file() else None
        rows.append(
            {
                "name": run["name"],
                "method": run["method"],
                "kind": run.get("kind")
                or (
                    drafter_kind(run["drafter"])[2] if run.get("drafter") else words(run["method"])
                ),
                "drafter": run.get("drafter"),
                "compared": bool(run.get("compare")),
                "k": run["k"],
                "temperature": run.get("temperature", 0.0),
                "acceptance_length": run["acceptance_length"],
                "acceptance_length_per_request": run.get("acceptance_length_per_request"),
                "per_position_rate": run["per_position_rate"],
                "by_concurrency": by_c,
                "training_minutes": elapsed / 60 if elapsed else None,
            }
        )
    return rows


def _pooled(run: dict, concurrencies: list[int]) -> dict[int, float]:
    out = {}
    for c in concurrencies:
        levels = [lv for lv in run["levels"] if lv["concurrency"] == c]
        out[c] = sum(lv["output_tokens"] for lv in levels) / sum(lv["wall_s"] for lv in levels)
    return out


def at_concurrency(run: dict, concurrency: int) -> dict:
    """A run's ``by_concurrency`` entry: its speedup over all sets there, with the interval."""
    return next(e for e in run["by_concurrency"] if e["concurrency"] == concurrency)


def speedup_at(run: dict, concurrency: int) -> float:
    return at_concurrency(run, concurrency)["speedup"]


def _interval(entry: dict) -> tuple[float, float]:
    """A speedup's interval; the speedup alone where the rounds gave none (one round)."""
    low, high = entry.get("speedup_low"), entry.get("speedup_high")
    if low is None or high is None:
        return entry["speedup"], entry["speedup"]
    return low, high


def _order(a: tuple[float, float], b: tuple[float, float]) -> str:
    return FASTER if a[0] > b[1] else SLOWER if a[1] < b[0] else NO_DIFFERENCE


def against_target(entry: dict) -> str:
    """Whether a speedup (a level or a ``by_concurrency`` entry) is measurably faster or
    slower than the target alone, or no measurable difference: its interval holds 1.0.
    Without an interval the speedup alone decides, as before intervals were measured."""
    return _order(_interval(entry), (1.0, 1.0))


def against_each_other(a: dict, b: dict) -> str:
    """Whether ``a`` serves measurably faster or slower than ``b`` (two speedups at the same
    concurrency), or no measurable difference: their intervals overlap."""
    return _order(_interval(a), _interval(b))


def _speed(entry: dict) -> str:
    """A speedup in words, with its interval where the rounds gave one: 1.14x [1.05, 1.23]."""
    text = f"{entry['speedup']:.2f}x"
    if entry.get("speedup_low") is not None and entry.get("speedup_high") is not None:
        text += f" [{entry['speedup_low']:.2f}, {entry['speedup_high']:.2f}]"
    return text


FASTER, SLOWER, NO_DIFFERENCE = "faster", "slower", "no measurable difference"
