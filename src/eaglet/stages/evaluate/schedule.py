"""What the sweep runs and what it recommends: the run plan (target, ngram, the drafter at
every k, compared drafters), the best k at each concurrency and the schedule served."""

from __future__ import annotations

import json
from pathlib import Path

from eaglet.core.methods import DEFAULT, MTP, NGRAM
from eaglet.stages.evaluate.runs import (
    MAX_BATCH,
    EvaluationError,
    drafter_kind,
    drafter_method,
    is_drafter,
    level_prompts,
    temperatures,
)
from eaglet.stages.evaluate.statistics import SLOWER, against_target, at_concurrency, speedup_at


def fixed_k_runs(runs: list[dict]) -> list[dict]:
    """The runs of this run's drafter at one fixed k each (not the schedule, not a drafter
    served only for comparison: :func:`compare_runs`), whatever its method."""
    return [r for r in runs if is_drafter(r) and not r.get("schedule") and not r.get("compare")]


def best_k_by_concurrency(runs: list[dict], concurrencies: list[int]) -> list[dict]:
    """Per concurrency, the fixed-k drafter run that served fastest, or k 0 (no speculation)
    where none was faster than the target alone."""
    fixed = fixed_k_runs(runs)
    choice = []
    for c in concurrencies:
        best = max(fixed, key=lambda r: speedup_at(r, c))
        pays = speedup_at(best, c) > 1.0
        choice.append(
            {
                "concurrency": c,
                "k": best["k"] if pays else 0,
                "best_run": best["name"],
                "best_speedup": speedup_at(best, c),
            }
        )
    return choice


def schedule_ranges(choice: list[dict]) -> list[list[int]]:
    """vLLM's ``num_speculative_tokens_per_batch_size`` from the per-concurrency choice: each
    measured concurrency covers the batch sizes nearest to it on a log scale (the ranges
    split at geometric midpoints), the first from 1, the last to any size; equal neighbours
    merge."""
    ordered = sorted(choice, key=lambda e: e["concurrency"])
    ranges: list[list[int]] = []
    for i, entry in enumerate(ordered):
        start = ranges[-1][1] + 1 if ranges else 1
        if i + 1 < len(ordered):
            end = max(start, int((entry["concurrency"] * ordered[i + 1]["concurrency"]) ** 0.5))
        else:
            end = MAX_BATCH
        if ranges and ranges[-1][2] == entry["k"]:
            ranges[-1][1] = end
        else:
            ranges.append([start, end, entry["k"]])
    return ranges


def schedule_run(choice: list[dict], drafter_dir: str) -> dict | None:
    """The engine run that serves the schedule, or None when it is one fixed k already
    measured (or no speculation at all: the baseline)."""
    ranges = schedule_ranges(choice)
    if len(ranges) == 1:
        return None
    k = max(r[2] for r in ranges)
    method = drafter_method(drafter_dir)
    return {
        "name": f"{method}_schedule",
        "method": method,
        "k": k,
        "drafter": drafter_dir,
        "schedule": True,
        "extra": {"num_speculative_tokens_per_batch_size": ranges},
    }


def serve_recommendation(choice: list[dict], runs: list[dict], drafter_dir: str) -> dict:
    """What ``serve.json`` holds: the speculative config to serve with, where it comes from,
    and how it did at every concurrency against the target alone (with the interval from the
    rounds); ``never_slower_than_target``: measurably slower nowhere (:func:`against_target`).
    Served without speculation, nothing was measured: speedup 1.0, no interval."""
    ranges = schedule_ranges(choice)
    fixed = fixed_k_runs(runs)
    checked = next((r for r in runs if r.get("schedule")), None)
    if checked is None and ranges[0][2]:
        checked = next(r for r in fixed if r["k"] == ranges[0][2])
    spec = checked["speculative_config"] if checked else None
    by_c = []
    for e in choice:
        measured = (
            at_concurrency(checked, e["concurrency"])
            if checked
            else {"speedup": 1.0, "speedup_low": None, "speedup_high": None}
        )
        by_c.append(
            {
                "concurrency": e["concurrency"],
                "k": e["k"],
                **{key: measured.get(key) for key in ("speedup", "speedup_low", "speedup_high")},
            }
        )
    out = {
        "speculative_config": spec,
        "vllm_args": ["--speculative-config", json.dumps(spec)] if spec else [],
        # the drafter's method (train.method): a P-EAGLE spec says parallel_drafting
        "method": fixed[0]["method"] if fixed else None,
        "checked_by": checked["name"] if checked else "baseline",
        "by_concurrency": by_c,
        "never_slower_than_target": all(against_target(e) != SLOWER for e in by_c),
    }
    if spec is None:
        out["note"] = (
            "no draft length was faster than the target alone at any measured "
            "concurrency: serve without speculation"
        )
    return out


def sweep_runs(
    ev: dict, drafter_dir: str | None = None, mtp_layers: int = 0
) -> tuple[list[dict], int]:
    """The stage's engine runs in order (the baseline first, which the others are measured
    against) and how many offline replays follow them (one per fixed-k drafter run and
    temperature). The drafter's runs are named by its method (:func:`drafter_method`:
    ``eagle3_k3``, ``peagle_k3``). ``mtp_layers``: the multi-token-prediction layers the
    target's config declares, served by vLLM's method mtp at k = their count beside ngram
    (``evaluate.mtp``). A run serving the derived k schedule may follow these, once the sweep
    has chosen it."""
    plan = [{"name": "baseline", "method": "baseline"}]
    if ev["ngram"]:
        plan.append(
            {
                "name": f"{NGRAM.name}_k{ev['ngram_k']}",
                "method": NGRAM.name,
                "k": ev["ngram_k"],
                "extra": ev["ngram_config"],
            }
        )
    if ev.get("mtp", True) and mtp_layers:
        plan.append({"name": f"{MTP.name}_k{mtp_layers}", "method": MTP.name, "k": mtp_layers})
    method = drafter_method(drafter_dir)
    plan += [
        {"name": f"{method}_k{k}", "method": method, "k": k, "drafter": drafter_dir}
        for k in ev["num_speculative_tokens"]
    ]
    plan += compare_runs(ev, method)
    # every drafter's fixed-k runs at every temperature, this run's and the compared ones
    replays = (
        len(fixed_k_runs(plan) + [r for r in plan if r.get("compare")]) * len(temperatures(ev))
        if ev["offline"]
        else 0
    )
    return plan, replays


def work_plan(ev: dict, runs: int, replays: int, together: bool, set_sizes: dict) -> dict:
    """The evaluation's work, as the stage writes it into its progress file when it starts
    (``plan``) and `eaglet status` estimates it before: ``runs`` engine runs of the sweep
    (:func:`sweep_runs`), side by side or not (``together``: evaluate.placement), ``replays``
    offline replays, and the prompts each set holds (``set_sizes``: name -> count). The
    derived k schedule is checked in a run of its own unless there is nothing to check (one
    concurrency, or evaluate.schedule off: ``schedule_to_check`` false): ``schedule_check``
    is None until the sweep has chosen (then whether it chose one), and that check costs
    ``schedule_check_runs`` (side by side it is measured beside the target alone once more)."""
    can_check = bool(ev["schedule"]) and len(ev["concurrency"]) > 1
    return {
        "engine_runs": runs,
        "side_by_side": together,
        "offline_replays": replays,
        "schedule_to_check": can_check,
        "schedule_check": None if can_check else False,
        "schedule_check_runs": 2 if together else 1,
        "prompt_sets": dict(set_sizes),
        "concurrency": list(ev["concurrency"]),
        # the requests one engine run sends at each concurrency, every set, one temperature
        "requests": {
            str(c): sum(len(level_prompts(range(n), c, ev["rounds"])) for n in set_sizes.values())
            for c in ev["concurrency"]
        },
        "temperatures": len(temperatures(ev)),
        "max_tokens": ev["max_tokens"],
    }


def compare_runs(ev: dict, own_method: str = DEFAULT.name) -> list[dict]:
    """The engine runs of the drafters named in ``evaluate.compare_drafters`` (exported drafter
    directories, such as another run's ``drafter/``), each at every k of the sweep beside this
    run's drafter, so that two methods or recipes are measured on the same prompts, the same
    rounds and the same machine moments. Each is named by its method, numbered where two
    drafters share one (``peagle_k3`` and ``eagle31_k3`` (EAGLE-3.1) beside ``eagle3_k3``;
    ``eagle3_2_k3`` for a second EAGLE-3). They
    are measured and tabled (acceptance.json ``methods``), never chosen: the verdict, the k
    schedule and serve.json judge this run's drafter only."""
    dirs = [str(d) for d in ev.get("compare_drafters") or []]
    kinds = [drafter_kind(d) for d in dirs]
    taken = [own_method] + [label for _, label, _ in kinds]
    runs = []
    for i, (d, (method, label, words)) in enumerate(zip(dirs, kinds)):
        name = label if taken.count(label) == 1 else f"{label}_{i + 2}"
        runs += [
            {
                "name": f"{name}_k{k}",
                "method": method,
                "k": k,
                "drafter": d,
                "compare": True,
                "kind": words,
            }
            for k in ev["num_speculative_tokens"]
        ]
    return runs


def check_compare_drafters(ev: dict) -> None:
    """Refuse, before any server starts, a comparison drafter that is not an exported drafter
    directory."""
    for d in ev.get("compare_drafters") or []:
        missing = [f for f in ("config.json", "model.safetensors") if not Path(d, f).is_file()]
        if missing:
            raise EvaluationError(
                f"evaluate.compare_drafters: {d} has no {' or '.join(missing)}: name an exported "
                f"drafter directory (another run's results/drafter), or remove it from the list"
            )
