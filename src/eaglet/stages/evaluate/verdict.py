"""The verdict's prose: which run to serve, against the target, ngram and the target's own
MTP layers, with the warnings of low acceptance and of prompt sets that disagree."""

from __future__ import annotations

from typing import Any

from eaglet.core.methods import SPECULATIONS, words
from eaglet.stages.evaluate.runs import HELD_OUT
from eaglet.stages.evaluate.schedule import best_k_by_concurrency, fixed_k_runs
from eaglet.stages.evaluate.statistics import (
    FASTER,
    NO_DIFFERENCE,
    SLOWER,
    _speed,
    against_each_other,
    against_target,
    at_concurrency,
)

LOW_ACCEPTANCE = 0.3  # share of draft tokens accepted below which a drafter is suspect
DISAGREEMENT = 0.15  # relative AL gap between the held-out split and another set
UNTRAINED = tuple(SPECULATIONS)  # vLLM's speculation a run needs no drafter for


def verdict(
    runs: list[dict],
    concurrencies: list[int],
    serve: dict | None = None,
    unmeasured: list[dict] = (),
) -> dict:
    """Whether the drafter speeds serving up here, per concurrency and prompt set.
    ``unmeasured``: the runs of vLLM's own speculation that could not be served
    (:func:`eaglet.stages.evaluate.runs.not_measured`), named with their reason in the summary.

    A speedup whose interval holds 1.0 is no measurable difference, neither a win nor a loss
    (:func:`against_target`), and two runs whose intervals overlap serve alike
    (:func:`against_each_other`): ``speeds_up_serving`` is true where the best k is measurably
    faster than the target alone, ``difference_by_concurrency`` says which of the three each
    concurrency is, and the warnings name only what was measurably slower."""
    # what a user would deploy without training anything: vLLM's ngram, the target's own MTP
    untrained = {m: next((r for r in runs if r["method"] == m), None) for m in UNTRAINED}
    drafts = fixed_k_runs(runs)
    warnings = [w for r in drafts for w in _run_warnings(r, drafts, concurrencies)]
    warnings += _disagreements(drafts, concurrencies)
    temperature = runs[0].get("temperature", 0.0) if runs else 0.0
    out: dict[str, Any] = {
        "concurrency": concurrencies,
        "temperature": temperature,
        "warnings": warnings,
    }
    if not drafts:
        return out
    choice = best_k_by_concurrency(runs, concurrencies)
    best = max(drafts, key=lambda r: r["acceptance_length"] or 0)
    measured = {
        str(e["concurrency"]): at_concurrency(
            next(r for r in drafts if r["name"] == e["best_run"]), e["concurrency"]
        )
        for e in choice
    }
    difference = {c: against_target(entry) for c, entry in measured.items()}
    out.update(
        {
            "method": best["method"],
            "best_k_by_concurrency": choice,
            "speeds_up_serving": {c: d == FASTER for c, d in difference.items()},
            "difference_by_concurrency": difference,
            "acceptance_length": best["acceptance_length"],
            "acceptance_length_per_request": best.get("acceptance_length_per_request"),
            "best": best["name"],
            "ceiling": best["k"] + 1,
            "share_of_ceiling": (best["acceptance_length"] or 1) / (best["k"] + 1),
            **_by_concurrency(measured),
        }
    )
    for m, other in untrained.items():
        if other is None or not other["acceptance_length"]:
            continue
        out[f"{m}_acceptance_length"] = other["acceptance_length"]
        out[f"{m}_acceptance_length_per_request"] = other.get("acceptance_length_per_request")
        out[f"beats_{m}"] = (best["acceptance_length"] or 1) > other["acceptance_length"]
        other_measured = {str(c): at_concurrency(other, c) for c in concurrencies}
        out.update({f"{m}_{key}": value for key, value in _by_concurrency(other_measured).items()})
        out[f"against_{m}_by_concurrency"] = {
            c: against_each_other(measured[c], other_measured[c]) for c in measured
        }
    if serve is not None:
        out["serve_never_slower_than_target"] = serve["never_slower_than_target"]
        if not serve["never_slower_than_target"]:
            slower = [e for e in serve["by_concurrency"] if against_target(e) == SLOWER]
            slow = ", ".join(f"{_speed(e)} at concurrency {e['concurrency']}" for e in slower)
            text = (
                f"SERVE CONFIG SLOWER THAN NO DRAFTER: {serve['checked_by']} (serve.json) "
                f"measured {slow}."
            )
            if any(e["k"] == 0 for e in slower):
                # vLLM runs the drafter's forward pass on every step to keep its KV cache in
                # sync, drafting or not
                text += (
                    " k 0 is not free: vLLM still runs the drafter's forward pass every "
                    "step. Where this concurrency is what you serve, serve without "
                    "--speculative-config."
                )
            warnings.append(text)
    said = runs[0].get("sampling") or f"temperature {temperature:g}"
    out["summary"] = (f"At {said}: " if temperature else "") + _summary(
        best, choice, measured, [r for r in untrained.values() if r is not None]
    )
    if unmeasured:
        out["not_measured"] = {u["name"]: u["reason"] for u in unmeasured}
        out["summary"] += "".join(f" {u['name']} not measured: {u['reason']}." for u in unmeasured)
    return out


def _by_concurrency(measured: dict[str, dict]) -> dict:
    """Speedups and their intervals by concurrency, as the verdict keeps them."""
    return {
        f"{key}_by_concurrency": {c: entry.get(key) for c, entry in measured.items()}
        for key in ("speedup", "speedup_low", "speedup_high")
    }


def _run_warnings(run: dict, drafts: list[dict], concurrencies: list[int]) -> list[str]:
    warnings = []
    slow = [e for e in run["by_concurrency"] if against_target(e) == SLOWER]
    if slow:
        where = "; ".join(
            f"{_speed(e)} at concurrency {e['concurrency']} ("
            + ", ".join(
                f"{lv['set']} {_speed(lv)}"
                for lv in run["levels"]
                if lv["concurrency"] == e["concurrency"]
            )
            + ")"
            for e in slow
        )
        warnings.append(
            f"SLOWER THAN NO DRAFTER: {run['name']} serves {where} of the target alone's "
            f"tokens/s (acceptance rate {_pct(run['acceptance_rate'])}): the drafts cost more "
            f"than they save there. Serve serve.json's schedule (k 0 where no k pays), and "
            f"check the training curves (acc_0), the vocabulary coverage and the aux layer ids."
        )
    if run["acceptance_rate"] is not None and run["acceptance_rate"] < LOW_ACCEPTANCE:
        others = [o for o in drafts if (o["acceptance_rate"] or 0) >= LOW_ACCEPTANCE]
        hint = (
            f"serve a smaller k ({others[-1]['name']} accepts "
            f"{_pct(others[-1]['acceptance_rate'])})"
            if others
            else "train on more and broader data, or longer"
        )
        warnings.append(
            f"LOW ACCEPTANCE: {run['name']} accepts {_pct(run['acceptance_rate'])} of its draft "
            f"tokens; at this rate speculation slows serving down as soon as the target's "
            f"step is not far costlier than the drafter's (higher concurrency, GPUs): {hint}."
        )
    return warnings


def _disagreements(drafts: list[dict], concurrencies: list[int]) -> list[str]:
    """Warn where the held-out split (the training distribution) flatters the drafter
    against the other prompt sets: their acceptance lengths differ, or the drafter pays on
    one and not the other at some concurrency, measurably (their speedups' intervals apart)."""
    warnings = []
    for run in drafts:
        ref = run["sets"].get(HELD_OUT, {}).get("acceptance_length")
        levels = {(lv["set"], lv["concurrency"]): lv for lv in run["levels"]}
        for name, acc in run["sets"].items():
            other = acc.get("acceptance_length")
            if name == HELD_OUT or not ref or not other:
                continue
            flips = [
                c
                for c in concurrencies
                if (levels[(HELD_OUT, c)]["speedup"] >= 1.0)
                != (levels[(name, c)]["speedup"] >= 1.0)
                and against_each_other(levels[(HELD_OUT, c)], levels[(name, c)]) != NO_DIFFERENCE
            ]
            if abs(ref - other) > DISAGREEMENT * ref or flips:
                text = (
                    f"IN-DOMAIN AND OTHER PROMPTS DISAGREE: {run['name']} reaches AL "
                    f"{ref:.2f} on the held-out split but {other:.2f} on {name!r}"
                )
                if flips:
                    text += " and pays on one but not the other at concurrency " + ", ".join(
                        map(str, flips)
                    )
                warnings.append(text + ": judge it on the prompts your users send.")
    return warnings


def _summary(
    best: dict, choice: list[dict], measured: dict[str, dict], untrained: list[dict]
) -> str:
    parts, difference = [], {}
    for e in choice:
        c = e["concurrency"]
        entry = measured[str(c)]
        difference[c] = against_target(entry)
        text = f"at concurrency {c}: {e['best_run']} {_speed(entry)}"
        for run in untrained:
            other = at_concurrency(run, c)
            text += f" ({run['method']} {_speed(other)}{_versus(entry, other, run['method'])})"
        if difference[c] == NO_DIFFERENCE:
            text += ", no measurable difference from no drafter" + (
                "" if e["k"] else " (serve.json drafts none there)"
            )
        elif not e["k"]:
            text += ", slower than no drafter: serve without speculation there"
        parts.append(text)
    sets = ", ".join(
        f"{s} {a['acceptance_length']:.2f}"
        for s, a in best["sets"].items()
        if a["acceptance_length"]
    )
    ngram_al = "".join(
        f"; {run['method']} AL {run['acceptance_length']:.2f}"
        for run in untrained
        if run["acceptance_length"]
    )
    per_request = best.get("acceptance_length_per_request")
    al = f"AL {best['acceptance_length']:.2f}" + (
        f" ({per_request:.2f} per request)" if per_request else ""
    )
    return (
        f"{words(best['method'])} ({best['name']}) reaches {al} of a "
        f"possible {best['k'] + 1} ({sets}){ngram_al}. Speedup over the target alone "
        + "; ".join(parts)
        + ". "
        + _ending(difference)
    )


def _versus(entry: dict, other: dict, name: str) -> str:
    """The best k against ``name`` (ngram, mtp) at one concurrency, where both speedups have
    intervals to decide it (else the two speedups stand side by side, unjudged)."""
    if None in (entry.get("speedup_low"), other.get("speedup_low")):
        return ""
    versus = against_each_other(entry, other)
    return (
        f": no measurable difference from {name}"
        if versus == NO_DIFFERENCE
        else f": measurably {versus} than {name}"
    )


def _ending(difference: dict[int, str]) -> str:
    """The summary's last sentence: where the drafter measurably speeds serving up."""

    def listed(kind):
        return ", ".join(str(c) for c, d in difference.items() if d == kind)

    wins, ties = listed(FASTER), listed(NO_DIFFERENCE)
    if all(d == FASTER for d in difference.values()):
        return "It speeds serving up at every measured concurrency."
    if all(d == NO_DIFFERENCE for d in difference.values()):
        return "It makes no measurable difference to serving at any measured concurrency."
    tied = f" (no measurable difference at concurrency {ties})" if ties else ""
    if not wins:
        return f"It does NOT speed serving up at any measured concurrency{tied}."
    return f"It speeds serving up only at concurrency {wins}{tied}."


def _al_text(value: float | None) -> str:
    return "none" if value is None else f"{value:.3f}"


def _pct(rate: float | None) -> str:
    return "?" if rate is None else f"{rate:.0%}"
