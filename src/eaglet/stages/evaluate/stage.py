"""The evaluate stage: start the servers of the run plan, measure every level, and write
the results, the verdict and serve.json (the package's doc says what is measured)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path

import httpx

from eaglet.core import rates
from eaglet.core.io import hold_directory, read_json, write_json
from eaglet.core.layout import server_log as layout_server_log
from eaglet.core.methods import MTP, drafts_every_step
from eaglet.core.progress import Progress
from eaglet.engine.server import ServerError, start_together, target_server
from eaglet.engine.support import mtp_layers, mtp_served
from eaglet.stages.evaluate.metrics import (
    _answer_counts,
    _spec_counts,
    _sum_deltas,
    acceptance,
    counter_delta,
    per_request_acceptance,
    read_metrics,
    spec_counters,
)
from eaglet.stages.evaluate.offline import (
    _greedy_divergence,
    _public,
    expected_check,
    expected_warnings,
    offline_check,
    top_token_note,
)
from eaglet.stages.evaluate.placement import placement
from eaglet.stages.evaluate.runs import (
    PER_REQUEST_METRICS,
    EvaluationError,
    at_temperature,
    cut,
    drafted_k,
    is_drafter,
    is_untrained,
    level_prompts,
    load_prompt_sets,
    not_measured,
    sampling,
    sampling_text,
    serving,
    speculative_config,
    temperatures,
)
from eaglet.stages.evaluate.schedule import (
    best_k_by_concurrency,
    check_compare_drafters,
    schedule_run,
    serve_recommendation,
    sweep_runs,
    work_plan,
)
from eaglet.stages.evaluate.statistics import _pooled, _speed, add_speedups, methods_table
from eaglet.stages.evaluate.verdict import _al_text, verdict
from eaglet.target.checkpoint import read_target

log = logging.getLogger("eaglet.stages.evaluate.stage")


async def _run_prompts(
    url: str,
    prompts: list[dict],
    max_tokens: int,
    concurrency: int,
    timeout: float,
    template_kwargs: dict | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> list[dict]:
    extra = {"chat_template_kwargs": template_kwargs} if template_kwargs else {}
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(
        base_url=url, timeout=timeout, limits=httpx.Limits(max_connections=concurrency)
    ) as client:

        async def one(prompt: dict) -> dict:
            async with gate:
                start = time.perf_counter()
                resp = await client.post(
                    "/v1/chat/completions",
                    json={
                        "model": "target",
                        "messages": prompt["messages"],
                        **sampling(temperature, top_p, top_k),
                        "max_tokens": max_tokens,
                        "return_token_ids": True,
                        **extra,
                    },
                )
                if resp.status_code != 200:
                    raise EvaluationError(
                        f"request for {prompt['id']} failed: HTTP "
                        f"{resp.status_code}: {resp.text[:300]}"
                    )
                body = resp.json()
                return {
                    "id": prompt["id"],
                    "latency_s": time.perf_counter() - start,
                    "completion_tokens": body["usage"]["completion_tokens"],
                    "prompt_token_ids": body.get("prompt_token_ids"),
                    "token_ids": body["choices"][0].get("token_ids"),
                    "spec_decoding": _spec_counts(body),
                }

        return await asyncio.gather(*(one(p) for p in prompts))


# -- prompt sets and the sweep ---------------------------------------------------------------


def _measure(
    url: str,
    prompts: list[dict],
    ev: dict,
    concurrency: int,
    template_kwargs: dict | None = None,
    temperature: float = 0.0,
) -> dict:
    before = spec_counters(read_metrics(url))
    start = time.perf_counter()
    answers = asyncio.run(
        _run_prompts(
            url,
            prompts,
            ev["max_tokens"],
            concurrency,
            ev["request_timeout_s"],
            template_kwargs,
            temperature,
            **cut(ev),
        )
    )
    wall = time.perf_counter() - start
    delta = counter_delta(before, spec_counters(read_metrics(url)))
    tokens = sum(a["completion_tokens"] for a in answers)
    return {
        "concurrency": concurrency,
        "requests": len(answers),
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        "mean_latency_s": sum(a["latency_s"] for a in answers) / len(answers),
        "_delta": delta,
        "_answers": answers,
    }


def _start(
    cfg: dict,
    target_path: str,
    placed: list[tuple[contextlib.ExitStack, dict]],
    log_dir: str,
    unmeasured: list[dict] | None = None,
) -> dict[str, str]:
    """Start the servers of the runs in ``placed`` at once, each inside the stack beside it
    (:func:`eaglet.engine.server.start_together`); their base URLs by run name. With
    ``unmeasured``, a run of vLLM's own speculation (:func:`is_untrained`) whose server
    cannot start is added there (:func:`not_measured`, the reason from its log) and the
    others go on; the target alone's and a drafter's failure fails the stage."""
    servers = []
    for stack, run in placed:
        spec = speculative_config(run)
        log.info(
            "%s: starting vLLM (%s)", run["name"], json.dumps(spec) if spec else "no speculation"
        )
        servers.append(
            (
                stack,
                target_server(
                    cfg,
                    target_path,
                    server_log(log_dir, run),
                    ["--speculative-config", json.dumps(spec), *PER_REQUEST_METRICS]
                    if spec is not None
                    else [],
                ),
            )
        )
    optional = (
        {i for i, (_, run) in enumerate(placed) if is_untrained(run)}
        if unmeasured is not None
        else set()
    )
    try:
        failed = start_together(servers, optional)
    except ServerError as exc:
        # waited for in order: the first that must start and has no ready time failed
        run = next(
            run
            for i, ((_, run), (_, server)) in enumerate(zip(placed, servers))
            if server.ready_after_s is None and i not in optional
        )
        what = "vLLM refused the drafter" if is_drafter(run) else "vLLM did not start"
        raise EvaluationError(f"{run['name']}: {what}.\n{exc}") from None
    for i, error in failed.items():
        run = placed[i][1]
        reason = f"vLLM did not start it: {str(error).splitlines()[0]} (server log: " + (
            f"{server_log(log_dir, run)})"
        )
        log.warning("%s: not measured: %s", run["name"], reason)
        unmeasured.append(not_measured(run, reason))
    return {
        run["name"]: server.url
        for i, ((_, run), (_, server)) in enumerate(zip(placed, servers))
        if i not in failed
    }


# -- the servers side by side, or one at a time ----------------------------------------------
#
# Interleaved, every engine run's server holds the target at once (three or more copies of
# it): right for a small target on a machine whose speed drifts, impossible for a target that
# fills its GPUs. evaluate.interleave auto decides from the target's size against the memory
# the servers would share; `eaglet status` plans the stage's time from the same decision.


def _merge(parts: list[dict]) -> dict:
    """One level's measurement from the measurements of its rounds, each round's tokens and
    wall time kept (``by_round``: the speedup's interval comes from them)."""
    answers = [a for p in parts for a in p["_answers"]]
    tokens, wall = sum(p["output_tokens"] for p in parts), sum(p["wall_s"] for p in parts)
    return {
        "concurrency": parts[0]["concurrency"],
        "requests": len(answers),
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        "by_round": [{"output_tokens": p["output_tokens"], "wall_s": p["wall_s"]} for p in parts],
        "mean_latency_s": sum(a["latency_s"] for a in answers) / len(answers),
        "_delta": _sum_deltas([p["_delta"] for p in parts]),
        "_answers": answers,
    }


def server_log(log_dir: str, run: dict) -> str:
    """The log of the server of one engine run: ``logs/evaluate.<run>.server.log``."""
    name = Path(layout_server_log(f"evaluate.{run['name']}")).name
    return f"{log_dir}/{name}"


def engine_runs(
    cfg: dict,
    target_path: str,
    runs: list[dict],
    prompt_sets: dict[str, list[dict]],
    log_dir: str,
    progress: Progress | None = None,
    unmeasured: list[dict] | None = None,
) -> list[dict]:
    """Serve each of ``runs`` with its speculation and send every prompt set at every
    concurrency of the sweep and every temperature through that one server
    (:func:`measure_runs`; several runs: their servers side by side). With ``unmeasured``,
    a run of vLLM's own speculation that cannot start is added there and left out
    (:func:`_start`)."""
    served = serving(cfg, side_by_side=len(runs) > 1)
    with contextlib.ExitStack() as stack:
        urls = _start(served, target_path, [(stack, run) for run in runs], log_dir, unmeasured)
        started = [run for run in runs if run["name"] in urls]
        return measure_runs(cfg, urls, started, prompt_sets, log_dir, progress) if started else []


def measure_runs(
    cfg: dict,
    urls: dict[str, str],
    runs: list[dict],
    prompt_sets: dict[str, list[dict]],
    log_dir: str,
    progress: Progress | None = None,
) -> list[dict]:
    """Every prompt set at every concurrency of the sweep and every temperature through each
    run's server (``urls`` by run name); the measurements per level and in all, one result per
    run and temperature (:func:`at_temperature`), temperature by temperature.

    Each level is sent round by round (``concurrency`` prompts a round), so that every
    speedup has rounds to take its interval from (:func:`speedup_interval`): round r of every
    run sends the same prompts. Several runs: each round goes to every server in turn, the
    first server of each round rotating: a machine whose speed drifts while they run slows
    every run alike, so their speedups compare like with like."""
    ev = cfg["evaluate"]
    template_kwargs = cfg.get("generate", {}).get("chat_template_kwargs")
    names = " and ".join(run["name"] for run in runs)
    temps = temperatures(ev)
    order_of = [run["name"] for run in runs]
    levels: dict[tuple[str, float], list[dict]] = {
        (run["name"], t): [] for t in temps for run in runs
    }
    for t in temps:
        at = f", {sampling_text(t, ev)}" if len(temps) > 1 or t else ""
        for concurrency in ev["concurrency"]:
            for set_name, prompts in prompt_sets.items():
                if progress is not None:
                    progress.enter_phase(
                        f"{names} in vLLM: {set_name} at concurrency {concurrency}{at}"
                    )
                sent = level_prompts(prompts, concurrency, ev["rounds"])
                rounds = [sent[i : i + concurrency] for i in range(0, len(sent), concurrency)]
                parts: dict[str, list[dict]] = {name: [] for name in order_of}
                for r, chunk in enumerate(rounds):
                    order = order_of[r % len(order_of) :] + order_of[: r % len(order_of)]
                    for name in order:
                        # the chat template renders prompts as it did for the training data
                        parts[name].append(
                            _measure(urls[name], chunk, ev, concurrency, template_kwargs, t)
                        )
                for run in runs:
                    level = _merge(parts[run["name"]])
                    k = drafted_k(run, concurrency)
                    levels[(run["name"], t)].append(
                        {
                            "set": set_name,
                            "temperature": t,
                            **level,
                            **acceptance(level["_delta"], k),
                            **per_request_acceptance(_answer_counts(level), k),
                        }
                    )
    return [
        _run_result(
            at_temperature(run, t, ev),
            levels[(run["name"], t)],
            prompt_sets,
            server_log(log_dir, run),
        )
        for t in temps
        for run in runs
    ]


def _run_result(run: dict, levels: list[dict], prompt_sets: dict, log_path: str) -> dict:
    name, spec = run["name"], speculative_config(run)

    def pooled(chosen: list[dict]) -> dict:
        return {
            **acceptance(_sum_deltas([lv["_delta"] for lv in chosen]), run.get("k")),
            **per_request_acceptance(
                [c for lv in chosen for c in _answer_counts(lv)], run.get("k")
            ),
        }

    result = {
        "name": name,
        "method": run["method"],
        "k": run.get("k"),
        "temperature": run.get("temperature", 0.0),
        **({"sampling": run["sampling"]} if run.get("sampling") else {}),
        "schedule": bool(run.get("schedule")),
        "speculative_config": spec,
        "levels": levels,
        "sets": {s: pooled([lv for lv in levels if lv["set"] == s]) for s in prompt_sets},
        "output_tokens": sum(lv["output_tokens"] for lv in levels),
        **pooled(levels),
        **({"drafter": run["drafter"]} if run.get("drafter") else {}),
        # served beside this run's drafter for comparison only (compare_runs)
        **({"compare": True, "kind": run["kind"]} if run.get("compare") else {}),
    }
    if spec is not None and not result["drafts"]:
        if not drafts_every_step(run["method"]):  # n-gram lookup: only where one recurs
            log.warning(
                "%s: ngram proposed no draft on these prompts (no n-gram of a prompt "
                "or answer recurred in it)",
                name,
            )
        else:  # a drafter model proposes at every step it is given
            raise EvaluationError(
                f"{name}: vLLM served without drafting anything (no spec-decode drafts in "
                f"/metrics): the speculative config was not applied. Server log: {log_path}"
            )
    if spec is not None and result["drafts"] and result["requests_drafted"] is None:
        log.warning(
            "%s: vLLM returned no per-request spec-decode counts (its answers have no "
            "metrics.speculative_decoding; %s needs a vLLM that knows it, as 0.32 "
            "does): the acceptance length per request is left empty",
            name,
            PER_REQUEST_METRICS[0],
        )
    for lv in levels:
        log.info(
            "%s: %s at concurrency %d: %d tokens in %.1f s (%.1f tok/s)%s%s",
            name,
            lv["set"],
            lv["concurrency"],
            lv["output_tokens"],
            lv["wall_s"],
            lv["output_tokens_per_s"],
            f", AL {lv['acceptance_length']:.3f}" if lv["acceptance_length"] else "",
            f" ({lv['acceptance_length_per_request']:.3f} per request)"
            if lv.get("acceptance_length_per_request")
            else "",
        )
    return result


# -- the k schedule --------------------------------------------------------------------------


# -- the verdict -----------------------------------------------------------------------------


# -- the stage -------------------------------------------------------------------------------


def _offline_checks(
    cfg: dict,
    target_path: str,
    drafter_dir: str,
    plan: list[dict],
    runs_at: dict[float, list[dict]],
    temps: list[float],
    progress: Progress,
    held_out_paths: list[str] | None,
) -> tuple[dict | None, dict | None, dict, dict]:
    """``evaluate.offline``: the greedy runs replayed offline for the drafter and each drafter
    served beside it (:func:`offline_check`: the comparison per run and where each set's
    states came from; both None without a greedy run), and every drafter's sampled runs
    checked against their expected acceptance (:func:`expected_check`), the drafter's and
    the compared ones' apart."""
    offline = replayed = None
    others = list(dict.fromkeys(r["drafter"] for r in plan if r.get("compare")))
    # every replay of this evaluation loads the target once, and each greedy answer's
    # states are computed once for all the drafters replayed on it
    shared: dict = {}
    held = held_out_paths or []
    if 0.0 in runs_at:
        offline, replayed = offline_check(
            cfg, target_path, drafter_dir, runs_at[0.0], progress, held, shared=shared
        )
        # each drafter served beside it, replayed on the same answers as its own
        for other in others:
            offline.update(
                offline_check(
                    cfg,
                    target_path,
                    other,
                    runs_at[0.0],
                    progress,
                    held,
                    compared=True,
                    shared=shared,
                )[0]
            )
    # every drafter's sampled runs, checked alike; the compared drafters' are tabled,
    # never judged
    checked = {
        (name, compared): entry
        for t in temps
        if t
        for drafter, compared in [(drafter_dir, False)] + [(o, True) for o in others]
        for name, entry in expected_check(
            cfg, target_path, drafter, runs_at[t], progress, held, compared=compared, shared=shared
        ).items()
    }
    expected = {name: e for (name, compared), e in checked.items() if not compared}
    expected_compared = {name: e for (name, compared), e in checked.items() if compared}
    return offline, replayed, expected, expected_compared


def run_stage(
    cfg: dict,
    target_json: str,
    drafter_dir: str,
    prompts_path: str,
    out_path: str,
    log_dir: str,
    progress_path: str | None = None,
    log_path: str | None = None,
    serve_path: str | None = None,
    train_prompts_path: str | None = None,
    held_out_paths: list[str] | None = None,
) -> dict:
    """The stage: every engine run in vLLM, the k schedule, the offline replay (from the
    held-out shards ``held_out_paths`` where they store the answers' states), the verdict.
    It holds the directory it writes (``eval/``): an evaluation left running by a killed
    Snakemake and its rerun would each start their servers on the same machine (each speed
    table measured under the other's load) and write the same files; the second is refused,
    naming the first, before any server starts."""
    with hold_directory(Path(out_path).parent, "evaluate"):
        return _run_stage(
            cfg,
            target_json,
            drafter_dir,
            prompts_path,
            out_path,
            log_dir,
            progress_path,
            log_path,
            serve_path,
            train_prompts_path,
            held_out_paths,
        )


def _run_stage(
    cfg,
    target_json,
    drafter_dir,
    prompts_path,
    out_path,
    log_dir,
    progress_path,
    log_path,
    serve_path,
    train_prompts_path,
    held_out_paths,
) -> dict:
    ev = cfg["evaluate"]
    target = read_target(target_json)
    prompt_sets, about = load_prompt_sets(ev, prompts_path, train_prompts_path)
    check_compare_drafters(ev)
    # the target's own MTP layers where its checkpoint holds them; where it declares layers
    # whose weights it lacks, that baseline is not measured, and the reason is said
    config = Path(target["path"]) / "config.json"
    plan, replays = sweep_runs(
        ev, drafter_dir, mtp_layers(read_json(config)) if config.is_file() else 0
    )
    _, mtp_missing = mtp_served(target["path"])
    unmeasured = [
        not_measured(r, mtp_missing) for r in plan if mtp_missing and r["method"] == MTP.name
    ]
    plan = [r for r in plan if r["name"] not in {u["name"] for u in unmeasured}]
    place = placement(cfg, target["path"], len(plan))
    log.info(
        "evaluation servers %s: %s",
        "side by side" if place.together else "one at a time",
        place.reason,
    )
    if place.together and place.fits is False:
        log.warning(
            "evaluate.interleave is true but the servers may not fit together: set "
            "evaluate.interleave auto (or false) to run them one at a time"
        )
    progress = Progress(
        "evaluate",
        total=len(plan) + replays,
        path=progress_path,
        log_path=log_path,
        unit="runs",
        interval_s=0.0,
        plan=work_plan(
            ev,
            len(plan),
            replays,
            place.together,
            {name: len(prompts) for name, prompts in prompt_sets.items()},
        ),
    )
    # the servers take a minute or more to start: the stage runs from now, and says so
    progress.enter_phase(f"starting vLLM for {', '.join(run['name'] for run in plan)}")
    concurrencies = ev["concurrency"]

    temps = temperatures(ev)
    served_at = temps[-1]  # the verdict, the schedule and serve.json are taken there

    def advanced(measured: list[dict]) -> list[dict]:
        # a unit is one engine run (its server), whatever the temperatures it was measured at
        progress.advance(
            done=len(measured) // len(temps), tokens=sum(r["output_tokens"] for r in measured)
        )
        return measured

    with contextlib.ExitStack() as baseline:
        if place.together:
            # every run's server side by side; the target alone's stays up for the schedule
            served = serving(cfg, side_by_side=True)
            with contextlib.ExitStack() as others:
                started = time.monotonic()
                failed = len(unmeasured)
                urls = _start(
                    served,
                    target["path"],
                    [(baseline, plan[0])] + [(others, run) for run in plan[1:]],
                    log_dir,
                    unmeasured,
                )
                progress.advance(done=len(unmeasured) - failed)
                # for status: how long this many servers took to start up together here
                rates.record(
                    rates.EVALUATE,
                    target["spec"],
                    sweep_servers=len(plan),
                    sweep_start_s=time.monotonic() - started,
                )
                up = [run for run in plan if run["name"] in urls]
                measured = advanced(measure_runs(cfg, urls, up, prompt_sets, log_dir, progress))
        else:
            measured = []
            for run in plan:
                failed = len(unmeasured)
                measured += advanced(
                    engine_runs(
                        cfg, target["path"], [run], prompt_sets, log_dir, progress, unmeasured
                    )
                )
                progress.advance(done=len(unmeasured) - failed)
        # each temperature's runs apart, the target alone first, as the plan orders them
        runs_at = {t: [r for r in measured if r["temperature"] == t] for t in temps}
        for group in runs_at.values():
            add_speedups(group, concurrencies)
        choice = best_k_by_concurrency(runs_at[served_at], concurrencies)
        extra = schedule_run(choice, drafter_dir) if ev["schedule"] else None
        progress.plan["schedule_check"] = extra is not None
        if extra is None:
            progress.report()
        else:
            progress.total += 1
            progress.enter_phase(f"{extra['name']}: starting vLLM to check the k schedule")
            if place.together:
                # measured beside the target alone once more, like the sweep
                with contextlib.ExitStack() as check:
                    urls.update(_start(served, target["path"], [(check, extra)], log_dir))
                    again = measure_runs(
                        cfg, urls, [plan[0], extra], prompt_sets, log_dir, progress
                    )
                progress.advance(
                    done=1, tokens=sum(r["output_tokens"] for r in again if r.get("schedule"))
                )
                bases = {r["temperature"]: r for r in again if not r.get("schedule")}
                checks = [r for r in again if r.get("schedule")]
            else:
                bases = {t: group[0] for t, group in runs_at.items()}
                checks = advanced(
                    engine_runs(cfg, target["path"], [extra], prompt_sets, log_dir, progress)
                )
            for checked in checks:
                add_speedups([checked], concurrencies, bases[checked["temperature"]])
                runs_at[checked["temperature"]].append(checked)
    runs = [r for t in temps for r in runs_at[t]]
    rates.record(
        rates.EVALUATE,
        target["spec"],
        settings=rates.evaluate_settings(cfg),
        baseline_tokens_per_s=_pooled(runs[0], concurrencies)[concurrencies[0]],
    )
    # greedy speculative decoding reproduces the target's answers; sampled answers differ
    mismatched = _greedy_divergence(runs_at[0.0]) if 0.0 in runs_at else {}
    offline = replayed = expected = None
    expected_compared: dict = {}
    if ev["offline"]:
        offline, replayed, expected, expected_compared = _offline_checks(
            cfg, target["path"], drafter_dir, plan, runs_at, temps, progress, held_out_paths
        )
    progress.report("finished")
    recommendation = {
        **serve_recommendation(choice, runs_at[served_at], drafter_dir),
        "temperature": served_at,
        **(cut(ev) if served_at else {}),
    }
    verdicts = {
        t: verdict(
            runs_at[t], concurrencies, recommendation if t == served_at else None, unmeasured
        )
        for t in temps
    }
    verdicts[served_at]["warnings"] += expected_warnings(expected or {}, offline, cfg)
    for entry in (expected or {}).values():
        note = top_token_note(entry)
        if note and entry["temperature"] in verdicts:
            verdicts[entry["temperature"]]["summary"] += " " + note
    result = {
        "prompt_sets": about,
        "max_tokens": ev["max_tokens"],
        "rounds": ev["rounds"],
        "concurrency": concurrencies,
        "temperature": temps,
        **cut(ev),
        "target": target["path"],
        "drafter": drafter_dir,
        "runs": [_public(r) for r in runs],
        "methods": [row for t in temps for row in methods_table(runs_at[t], concurrencies)],
        "not_measured": unmeasured,
        "outputs_differ_from_baseline": mismatched,
        "offline": offline,
        "offline_replay": replayed,
        **(
            {"offline_expected": {**expected, **expected_compared}}
            if expected or expected_compared
            else {}
        ),
        "servers": {"side_by_side": place.together, "why": place.reason},
        "serve": recommendation,
        "verdict": verdicts[served_at],
        **(
            {"verdict_by_temperature": {f"{t:g}": v for t, v in verdicts.items()}}
            if len(temps) > 1
            else {}
        ),
    }
    for row in result["methods"]:
        # greedy: the replay's AL on the same answers; sampled: the expected AL of the run's
        # own answers; and whether vLLM's agrees
        check = (offline or {}).get(row["name"]) or result.get("offline_expected", {}).get(
            row["name"]
        )
        if check:
            row.update(
                offline_acceptance_length=check["acceptance_length"], offline_agrees=check["agrees"]
            )
    if serve_path:
        write_json(serve_path, recommendation)
    write_json(out_path, result)
    side_by_side = any(r["compared"] for r in result["methods"])
    for row in result["methods"] if side_by_side else ():
        log.info(
            "side by side: %s at temperature %g: AL %s; %s",
            row["name"],
            row["temperature"],
            _al_text(row["acceptance_length"]),
            "; ".join(
                f"concurrency {e['concurrency']}: "
                + (_speed(e) if e["speedup"] is not None else "?")
                + (
                    f", {e['step_ms']:.1f} ms/step ({e['step_over_target_ms']:+.1f})"
                    if e["step_over_target_ms"] is not None
                    else ""
                )
                for e in row["by_concurrency"]
            ),
        )
    for warning in result["verdict"]["warnings"]:
        log.warning(warning)
    if "summary" in result["verdict"]:
        log.info(result["verdict"]["summary"])
    return result
