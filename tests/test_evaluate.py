"""Acceptance arithmetic from vLLM's Prometheus counters, the sweep, the k schedule and the
verdict, on recorded numbers."""

from __future__ import annotations

import csv
import math
import statistics

import pytest

from eaglet.stages.evaluate.metrics import (
    _spec_counts,
    acceptance,
    counter_delta,
    parse_metrics,
    per_request_acceptance,
    spec_counters,
)
from eaglet.stages.evaluate.offline import _public
from eaglet.stages.evaluate.runs import MAX_BATCH, drafted_k, level_prompts, speculative_config
from eaglet.stages.evaluate.schedule import (
    best_k_by_concurrency,
    schedule_ranges,
    schedule_run,
    serve_recommendation,
)
from eaglet.stages.evaluate.statistics import NO_DIFFERENCE, add_speedups, t_quantile
from eaglet.stages.evaluate.verdict import verdict
from tests.helpers.paths import REPO, pythonpath_env

# the shape vLLM 0.32 serves on /metrics (trimmed), two engines to check the sums
METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 100.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="target"} 20.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 300.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="target"} 60.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 150.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="target"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} 80.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="1"} 50.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="2"} 20.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="target",position="0"} 16.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="target",position="1"} 10.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="target",position="2"} 4.0
vllm:num_requests_running{engine="0",model_name="target"} 0.0
"""


def test_parse_metrics_reads_labels_and_values():
    samples = parse_metrics(METRICS)
    assert samples["vllm:num_requests_running"] == [({"engine": "0", "model_name": "target"}, 0.0)]
    assert len(samples["vllm:spec_decode_num_accepted_tokens_per_pos_total"]) == 6


def test_counters_are_summed_over_engines_and_positions_kept_apart():
    counts = spec_counters(METRICS)
    assert counts["drafts"] == 120 and counts["draft_tokens"] == 360 and counts["accepted"] == 180
    assert counts["per_position"] == [96, 60, 24]


def test_acceptance_from_deltas_satisfies_the_identity():
    before = spec_counters(METRICS.replace("100.0", "40.0"))
    after = spec_counters(METRICS)
    delta = counter_delta(before, after)
    assert delta["drafts"] == 60
    zero = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_position": []}
    result = acceptance(counter_delta(zero, after), k=3)
    assert result["acceptance_length"] == pytest.approx(1 + 180 / 120)
    assert result["acceptance_rate"] == pytest.approx(180 / 360)
    assert result["per_position_rate"] == pytest.approx([96 / 120, 60 / 120, 24 / 120])
    # AL = 1 + sum of the per-position rates, for every run
    assert result["acceptance_length"] == pytest.approx(1 + sum(result["per_position_rate"]))


def test_no_drafts_gives_no_acceptance_instead_of_dividing_by_zero():
    zero = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_position": []}
    result = acceptance(zero, k=None)
    assert result["acceptance_length"] is None and result["drafts"] == 0


# -- acceptance length pooled and per request ------------------------------------------------

# an answer's body as vLLM 0.32 returns it with --per-request-spec-decode-metrics summary
# (trimmed)
RESPONSE = {
    "choices": [{"message": {"content": "Paris."}, "token_ids": [9, 8]}],
    "usage": {"completion_tokens": 35},
    "metrics": {
        "speculative_decoding": {
            "mean_acceptance_length": 1.2325581395348837,
            "draft_acceptance_rate": 0.07751937984496124,
            "acceptance_histogram": [39, 1, 0, 3],
            "num_spec_steps": 43,
            "num_accepted_draft_tokens": 10,
            "num_draft_tokens": 129,
            "num_spec_tokens": 3,
        }
    },
}


def test_each_answer_keeps_its_own_spec_decode_counts():
    counts = _spec_counts(RESPONSE)
    assert counts == {"drafts": 43, "draft_tokens": 129, "accepted": 10}
    # the acceptance length vLLM reports for the request is what its counts give
    assert per_request_acceptance([counts], 3)["acceptance_length_per_request"] == pytest.approx(
        RESPONSE["metrics"]["speculative_decoding"]["mean_acceptance_length"]
    )
    # the target alone's answers carry none
    assert _spec_counts({"choices": [], "usage": {}}) is None


def test_acceptance_length_per_request_weighs_every_request_alike():
    long = {"drafts": 30, "draft_tokens": 90, "accepted": 60}  # AL 3.0 over 30 steps
    short = {"drafts": 2, "draft_tokens": 6, "accepted": 0}  # AL 1.0 over 2 steps
    never = {"drafts": 0, "draft_tokens": 0, "accepted": 0}  # answered in one token
    got = per_request_acceptance([long, short, never], 3)
    assert got == {"acceptance_length_per_request": pytest.approx(2.0), "requests_drafted": 2}
    # pooled, the long answer's steps outweigh the short one's
    pooled = acceptance(
        {"drafts": 32, "draft_tokens": 96, "accepted": 60, "per_position": [30, 20, 10]}, 3
    )
    assert pooled["acceptance_length"] == pytest.approx(1 + 60 / 32)
    # no per-request counts came back (the target alone; a vLLM without the flag)
    assert per_request_acceptance([None, None], None) == {
        "acceptance_length_per_request": None,
        "requests_drafted": None,
    }


def test_speculative_servers_are_asked_for_each_answers_own_counts(monkeypatch, tmp_path):
    import contextlib
    from pathlib import Path

    from eaglet.core.config import validate
    from eaglet.stages.evaluate import stage as evaluate

    args = {}

    class Server:
        url = "http://server"

    def server(cfg, model, log_path, extra_args=()):
        args[Path(log_path).name.split(".")[1]] = list(extra_args)
        return Server()

    monkeypatch.setattr(evaluate, "target_server", server)
    monkeypatch.setattr(evaluate, "start_together", lambda servers, may_fail=(): {})
    with contextlib.ExitStack() as stack:
        evaluate._start(validate({}), "target", [(stack, run) for run in RUNS], str(tmp_path))
    # vLLM refuses the flag without a speculative config
    assert args["baseline"] == []
    assert args["eagle3_k3"][0] == "--speculative-config"
    assert args["eagle3_k3"][2:] == ["--per-request-spec-decode-metrics", "summary"]


SWEEP = [1, 16]


def run(name, method, tokens_per_s, al=None, rate=None, k=None, set_al=None, rounds=None):
    """A finished engine run from recorded numbers: ``tokens_per_s`` maps (set, concurrency)
    to the measured output tokens/s; ``set_al`` the acceptance length per set (default al);
    ``rounds`` a level's tokens/s round by round, 10 s each (default: one round, so no
    interval); its tokens/s is then theirs pooled."""
    levels = []
    for (s, c), tps in tokens_per_s.items():
        by_round = [
            {"output_tokens": t * 10, "wall_s": 10.0} for t in (rounds or {}).get((s, c), [tps])
        ]
        tokens, wall = sum(r["output_tokens"] for r in by_round), 10.0 * len(by_round)
        levels.append(
            {
                "set": s,
                "concurrency": c,
                "output_tokens": tokens,
                "wall_s": wall,
                "output_tokens_per_s": tokens / wall,
                "mean_latency_s": 1.0,
                "by_round": by_round,
            }
        )
    sets = {
        s: {"acceptance_length": (set_al or {}).get(s, al), "per_position_rate": []}
        for s, _ in tokens_per_s
    }
    spec = {"method": method, "num_speculative_tokens": k} if method != "baseline" else None
    return {
        "name": name,
        "method": method,
        "k": k,
        "levels": levels,
        "sets": sets,
        "speculative_config": spec,
        "schedule": False,
        "acceptance_length": al,
        "acceptance_rate": rate,
    }


def same(tps_1: float, tps_16: float, sets=("heldout",)) -> dict:
    return {(s, c): t for s in sets for c, t in ((1, tps_1), (16, tps_16))}


def judged(*runs):
    runs = list(runs)
    add_speedups(runs, SWEEP)
    return runs


def test_speedups_are_per_set_and_concurrency_and_pooled():
    base = run(
        "baseline",
        "baseline",
        {("heldout", 1): 10.0, ("chat", 1): 10.0, ("heldout", 16): 80.0, ("chat", 16): 40.0},
    )
    drafter = run(
        "eagle3_k3",
        "eagle3",
        {("heldout", 1): 15.0, ("chat", 1): 12.0, ("heldout", 16): 40.0, ("chat", 16): 40.0},
        2.0,
        0.4,
        3,
    )
    judged(base, drafter)
    speedups = {(lv["set"], lv["concurrency"]): lv["speedup"] for lv in drafter["levels"]}
    assert speedups == {
        ("heldout", 1): 1.5,
        ("chat", 1): 1.2,
        ("heldout", 16): 0.5,
        ("chat", 16): 1.0,
    }
    # pooled: (400 + 400) tokens in 20 s against (800 + 400) tokens in 20 s; one round
    # each, so no interval
    assert drafter["by_concurrency"][1] == {
        "concurrency": 16,
        "output_tokens_per_s": 40.0,
        "speedup": pytest.approx(40 / 60),
        "speedup_low": None,
        "speedup_high": None,
    }


def test_verdict_of_a_drafter_that_helps_at_every_concurrency():
    runs = judged(
        run("baseline", "baseline", same(10.0, 80.0)),
        run("ngram_k3", "ngram", same(11.0, 78.0), 2.0, 0.33, 3),
        run("eagle3_k3", "eagle3", same(13.0, 88.0), 2.5, 0.5, 3),
    )
    v = verdict(runs, SWEEP)
    assert v["speeds_up_serving"] == {"1": True, "16": True} and v["beats_ngram"]
    assert v["ceiling"] == 4 and v["share_of_ceiling"] == pytest.approx(2.5 / 4)
    assert v["speedup_by_concurrency"] == {"1": pytest.approx(1.3), "16": pytest.approx(1.1)}
    assert not v["warnings"]
    assert "speeds serving up at every measured concurrency" in v["summary"]
    # one k pays everywhere: serve.json is that run's own config, checked by that run
    choice = best_k_by_concurrency(runs, SWEEP)
    assert schedule_run(choice, "d") is None
    serve = serve_recommendation(choice, runs, "d")
    assert serve["checked_by"] == "eagle3_k3" and serve["never_slower_than_target"]
    assert serve["speculative_config"] == runs[2]["speculative_config"]


def test_the_targets_own_mtp_layers_are_measured_beside_ngram_and_the_verdict_says_which_wins():
    """A target whose config declares multi-token-prediction layers is served with them (vLLM's
    method mtp, k = their count) beside ngram: what a user would deploy without training; the
    verdict sets the drafter against both."""
    from eaglet.core.config import validate
    from eaglet.engine.support import mtp_layers
    from eaglet.stages.evaluate.runs import speculative_config
    from eaglet.stages.evaluate.schedule import sweep_runs

    ev = validate({})["evaluate"]
    assert [
        r["name"] for r in sweep_runs(ev, None, mtp_layers({"num_nextn_predict_layers": 1}))[0]
    ][:3] == ["baseline", "ngram_k3", "mtp_k1"]
    assert "mtp_k1" not in [r["name"] for r in sweep_runs(ev, None, 0)[0]]  # none declared
    assert "mtp_k1" not in [r["name"] for r in sweep_runs({**ev, "mtp": False}, None, 1)[0]]
    assert mtp_layers({"text_config": {"mtp_num_hidden_layers": 2}}) == 2
    mtp = next(r for r in sweep_runs(ev, None, 1)[0] if r["method"] == "mtp")
    assert speculative_config(mtp) == {"method": "mtp", "num_speculative_tokens": 1}
    runs = judged(
        run("baseline", "baseline", same(10.0, 80.0)),
        run("ngram_k3", "ngram", same(11.0, 78.0), 2.0, 0.33, 3),
        run("mtp_k1", "mtp", same(14.0, 90.0), 1.8, 0.8, 1),
        run("eagle3_k3", "eagle3", same(13.0, 88.0), 2.5, 0.5, 3),
    )
    v = verdict(runs, SWEEP)
    assert v["mtp_acceptance_length"] == 1.8 and v["beats_mtp"] and v["beats_ngram"]
    assert v["mtp_speedup_by_concurrency"] == {
        "1": pytest.approx(1.4),
        "16": pytest.approx(90 / 80),
    }
    assert "(mtp 1.40x" in v["summary"] and "; mtp AL 1.80" in v["summary"]
    assert v["best"] == "eagle3_k3"  # MTP is measured beside the drafter, never chosen


def test_a_drafter_that_pays_at_1_and_halves_throughput_at_16_is_called_out():
    """The founding failure: 1.18x at concurrency 1, 0.46x at 16."""
    runs = judged(
        run("baseline", "baseline", same(10.0, 100.0)),
        run("eagle3_k3", "eagle3", same(11.8, 46.0), 1.19, 0.063, 3),
    )
    v = verdict(runs, SWEEP)
    assert v["speeds_up_serving"] == {"1": True, "16": False}
    slower = [w for w in v["warnings"] if w.startswith("SLOWER THAN NO DRAFTER")]
    assert len(slower) == 1 and "0.46x at concurrency 16" in slower[0]
    assert "1.18x" not in slower[0]  # concurrency 1 pays: not named as slower
    assert "only at concurrency 1" in v["summary"]
    assert "at concurrency 16: eagle3_k3 0.46x, slower than no drafter" in v["summary"]
    choice = best_k_by_concurrency(runs, SWEEP)
    assert [(e["concurrency"], e["k"]) for e in choice] == [(1, 3), (16, 0)]
    # batch sizes up to the geometric midpoint of 1 and 16 draft 3 tokens, the rest none
    assert schedule_ranges(choice) == [[1, 4, 3], [5, MAX_BATCH, 0]]
    extra = schedule_run(choice, "drafter")
    assert extra["k"] == 3 and extra["extra"] == {
        "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, MAX_BATCH, 0]]
    }


def test_best_k_per_concurrency_and_a_three_level_schedule():
    sweep = [1, 4, 16]
    tps = lambda a, b, c: {("heldout", 1): a, ("heldout", 4): b, ("heldout", 16): c}  # noqa: E731
    runs = [
        run("baseline", "baseline", tps(10.0, 30.0, 80.0)),
        run("eagle3_k2", "eagle3", tps(14.0, 36.0, 70.0), 1.9, 0.45, 2),
        run("eagle3_k4", "eagle3", tps(16.0, 33.0, 60.0), 2.2, 0.3, 4),
    ]
    add_speedups(runs, sweep)
    choice = best_k_by_concurrency(runs, sweep)
    assert [e["k"] for e in choice] == [4, 2, 0]
    assert [e["best_run"] for e in choice] == ["eagle3_k4", "eagle3_k2", "eagle3_k2"]
    assert schedule_ranges(choice) == [[1, 2, 4], [3, 8, 2], [9, MAX_BATCH, 0]]
    same_k = [{"concurrency": c, "k": 3} for c in sweep]
    assert schedule_ranges(same_k) == [[1, MAX_BATCH, 3]]  # equal neighbours merge
    assert (
        schedule_run([{**e, "best_run": "x", "best_speedup": 1.2} for e in same_k], "drafter")
        is None
    )  # one fixed k: measured already


def test_serve_recommendation_is_checked_against_the_target_alone():
    runs = judged(
        run("baseline", "baseline", same(10.0, 100.0)),
        run("eagle3_k3", "eagle3", same(12.0, 46.0), 1.5, 0.2, 3),
    )
    choice = best_k_by_concurrency(runs, SWEEP)
    extra = schedule_run(choice, "d")
    checked = {
        **run("eagle3_schedule", "eagle3", same(12.1, 99.0), 1.5, 0.2, 3),
        "schedule": True,
        "speculative_config": speculative_config(extra),
    }
    runs.append(checked)
    add_speedups(runs, SWEEP)
    serve = serve_recommendation(choice, runs, "d")
    assert serve["checked_by"] == "eagle3_schedule"
    assert serve["speculative_config"]["num_speculative_tokens_per_batch_size"] == [
        [1, 4, 3],
        [5, MAX_BATCH, 0],
    ]
    assert serve["vllm_args"][0] == "--speculative-config"
    assert [e["speedup"] for e in serve["by_concurrency"]] == pytest.approx([1.21, 0.99])
    assert serve["never_slower_than_target"] is False
    v = verdict(runs, SWEEP, serve)
    warning = next(w for w in v["warnings"] if w.startswith("SERVE CONFIG SLOWER THAN NO DRAFTER"))
    assert "0.99x at concurrency 16" in warning
    # k 0 there: the drafter still runs every step, and the warning says so
    assert "k 0 is not free" in warning and "without --speculative-config" in warning


def test_no_k_that_pays_anywhere_recommends_no_speculation():
    runs = judged(
        run("baseline", "baseline", same(10.0, 100.0)),
        run("eagle3_k3", "eagle3", same(9.0, 50.0), 1.1, 0.05, 3),
    )
    choice = best_k_by_concurrency(runs, SWEEP)
    assert schedule_run(choice, "d") is None
    serve = serve_recommendation(choice, runs, "d")
    assert serve["speculative_config"] is None and serve["vllm_args"] == []
    assert serve["never_slower_than_target"] and "serve without speculation" in serve["note"]
    assert (
        "does NOT speed serving up at any measured concurrency" in verdict(runs, SWEEP)["summary"]
    )


def test_held_out_split_that_flatters_the_drafter_is_flagged():
    sets = ("heldout", "everyday")
    runs = judged(
        run("baseline", "baseline", same(10.0, 100.0, sets)),
        run(
            "eagle3_k3",
            "eagle3",
            {
                ("heldout", 1): 14.4,
                ("everyday", 1): 11.8,
                ("heldout", 16): 105.0,
                ("everyday", 16): 46.0,
            },
            1.35,
            0.12,
            3,
            set_al={"heldout": 1.51, "everyday": 1.19},
        ),
    )
    warnings = [w for w in verdict(runs, SWEEP)["warnings"] if w.startswith("IN-DOMAIN")]
    assert len(warnings) == 1
    assert "AL 1.51 on the held-out split but 1.19 on 'everyday'" in warnings[0]
    assert "pays on one but not the other at concurrency 16" in warnings[0]
    agreeing = judged(
        run("baseline", "baseline", same(10.0, 100.0, sets)),
        run(
            "eagle3_k3",
            "eagle3",
            same(14.0, 110.0, sets),
            2.0,
            0.4,
            3,
            set_al={"heldout": 2.0, "everyday": 1.9},
        ),
    )
    assert not any(w.startswith("IN-DOMAIN") for w in verdict(agreeing, SWEEP)["warnings"])


def test_low_acceptance_is_flagged_with_a_smaller_k():
    runs = judged(
        run("baseline", "baseline", same(10.0, 100.0)),
        run("eagle3_k3", "eagle3", same(15.9, 120.0), 2.1, 0.37, 3),
        run("eagle3_k4", "eagle3", same(16.3, 118.0), 2.2, 0.25, 4),
    )
    [warning] = verdict(runs, SWEEP)["warnings"]
    assert warning.startswith("LOW ACCEPTANCE: eagle3_k4 accepts 25%")
    assert "eagle3_k3 accepts 37%" in warning


def test_each_level_sends_rounds_times_its_concurrency():
    prompts = list(range(40))
    assert level_prompts(prompts, 1, 4) == [0, 1, 2, 3]
    assert level_prompts(prompts, 16, 4) == prompts  # at most the whole set


# -- interleaved measurement on a machine whose speed drifts ---------------------------------


def drafted(prompt: dict) -> dict:
    """One answer's own spec-decode counts, as vLLM returns them with it: even prompts draft
    6 times and get 2 tokens accepted (AL 1.33), odd ones 2 times and 6 (AL 4.0); together
    AL 2.0 pooled, 2.67 per request."""
    steps, accepted = (6, 2) if int(prompt["id"][1:]) % 2 == 0 else (2, 6)
    return {"drafts": steps, "draft_tokens": 3 * steps, "accepted": accepted}


class DriftingMachine:
    """Stands in for vLLM servers on a machine that slows down as it works: each request's
    answer of 10 tokens takes ``cost[run] * clock`` seconds, where the clock grows by a half
    per minute of machine time. Records the order the servers were asked in. A speculative
    run's counters add up its answers' own counts (:func:`drafted`)."""

    def __init__(self, cost: dict[str, float]):
        self.cost, self.clock_s, self.calls = cost, 0.0, []

    def start(self, cfg, target_path, placed, log_dir, unmeasured=None):
        runs = [run for _, run in placed]
        self.started_with = getattr(self, "started_with", []) + [cfg["server"]] * len(runs)
        return {run["name"]: run["name"] for run in runs}

    def measure(self, url, prompts, ev, concurrency, template_kwargs=None, temperature=0.0):
        self.calls.append((url, tuple(p["id"] for p in prompts)))
        self.temperatures = getattr(self, "temperatures", []) + [temperature]
        slowdown = 1.0 + 0.5 * self.clock_s / 60
        wall = self.cost[url] * slowdown * len(prompts) / concurrency
        self.clock_s += wall
        own = [None if url == "baseline" else drafted(p) for p in prompts]
        answers = [
            {
                "id": p["id"],
                "latency_s": wall,
                "completion_tokens": 10,
                "token_ids": [7] * 10,
                "spec_decoding": counts,
            }
            for p, counts in zip(prompts, own)
        ]
        drafts = sum(c["drafts"] for c in own if c)
        accepted = sum(c["accepted"] for c in own if c)
        delta = {
            "drafts": drafts,
            "draft_tokens": 3 * drafts,
            "accepted": accepted,
            "per_position": [accepted / 2, accepted / 4, accepted / 4],
        }
        return {
            "concurrency": concurrency,
            "requests": len(prompts),
            "output_tokens": 10 * len(prompts),
            "wall_s": wall,
            "output_tokens_per_s": 10 * len(prompts) / wall,
            "mean_latency_s": wall,
            "_delta": delta,
            "_answers": answers,
        }


def priced_machine(monkeypatch, per_token: dict) -> DriftingMachine:
    """A DriftingMachine patched in as the evaluation's servers, each run's cost per token
    set by the concurrency it is measured at (``per_token``: run name -> {concurrency: cost});
    ``started`` lists the runs of each server start."""
    from eaglet.stages.evaluate import stage as evaluate

    class Machine(DriftingMachine):
        def measure(self, url, prompts, ev, concurrency, template_kwargs=None, temperature=0.0):
            self.cost = {name: costs[concurrency] for name, costs in per_token.items()}
            return super().measure(url, prompts, ev, concurrency, template_kwargs, temperature)

        def start(self, cfg, target_path, placed, log_dir, unmeasured=None):
            self.started = getattr(self, "started", []) + [[run["name"] for _, run in placed]]
            return super().start(cfg, target_path, placed, log_dir, unmeasured)

    machine = Machine({})
    monkeypatch.setattr(evaluate, "_start", machine.start)
    monkeypatch.setattr(evaluate, "_measure", machine.measure)
    return machine


def _measured(machine, monkeypatch, runs, interleave, concurrency=(1,)):
    from eaglet.core.config import validate
    from eaglet.stages.evaluate import stage as evaluate

    monkeypatch.setattr(evaluate, "_start", machine.start)
    monkeypatch.setattr(evaluate, "_measure", machine.measure)
    cfg = validate(
        {
            "evaluate": {
                "concurrency": list(concurrency),
                "rounds": 6,
                "interleave": interleave,
                "memory_utilization": 0.1,
                "kv_cache_gib": 0.25,
            },
            "server": {"memory_utilization": 0.3, "kv_cache_gib": 2, "port": 8000},
        }
    )
    prompt_sets = {"heldout": [{"id": f"p{i}", "messages": []} for i in range(6)]}
    groups = [runs] if interleave else [[r] for r in runs]
    measured = [
        m
        for group in groups
        for m in evaluate.engine_runs(cfg, "target", group, prompt_sets, "logs")
    ]
    add_speedups(measured, list(concurrency))
    machine.runs = measured
    return {m["name"]: m["by_concurrency"][0]["speedup"] for m in measured}


RUNS = [
    {"name": "baseline", "method": "baseline"},
    {"name": "eagle3_k3", "method": "ngram", "k": 3},
]  # ngram: no drafter dir needed


def test_interleaved_runs_see_the_same_drift_and_measure_the_true_speedup(monkeypatch):
    # the drafter truly serves 1.2x the target's tokens/s
    cost = {"baseline": 6.0, "eagle3_k3": 5.0}
    one_at_a_time = _measured(DriftingMachine(cost), monkeypatch, RUNS, interleave=False)
    machine = DriftingMachine(cost)
    side_by_side = _measured(machine, monkeypatch, RUNS, interleave=True)
    # measured after the target alone, the drafter pays for the machine's slowdown
    assert one_at_a_time["eagle3_k3"] < 1.0
    assert side_by_side["eagle3_k3"] == pytest.approx(1.2, abs=0.03)
    # every prompt went to both servers, a round each in turn, the first server rotating
    assert [c[0] for c in machine.calls[:4]] == ["baseline", "eagle3_k3", "eagle3_k3", "baseline"]
    assert [c[1] for c in machine.calls[:2]] == [("p0",), ("p0",)]
    assert sorted(c[1][0] for c in machine.calls) == sorted([f"p{i}" for i in range(6)] * 2)
    # the rounds' measurements add up to the level's
    level = machine.runs[1]["levels"][0]
    assert level["requests"] == 6 and level["output_tokens"] == 60
    assert level["drafts"] == 24 and level["acceptance_length"] == pytest.approx(2.0)
    # the servers share the machine: free ports, the evaluation's memory share each
    assert (
        machine.started_with
        == [{**machine.started_with[0], "port": 0, "memory_utilization": 0.1, "kv_cache_gib": 0.25}]
        * 2
    )


def test_one_run_alone_sends_each_level_round_by_round_on_its_own_port(monkeypatch):
    machine = DriftingMachine({"baseline": 6.0})
    _measured(machine, monkeypatch, RUNS[:1], interleave=False)
    # the rounds its speedups' intervals come from, the same prompts as any other run's
    assert [c[1] for c in machine.calls] == [(f"p{i}",) for i in range(6)]
    assert len(machine.runs[0]["levels"][0]["by_round"]) == 6
    assert machine.started_with[0]["port"] == 8000
    assert machine.started_with[0]["memory_utilization"] == 0.1
    assert machine.started_with[0]["kv_cache_gib"] == 0.25


def test_the_stage_says_it_runs_while_its_first_servers_start(monkeypatch, tmp_path):
    """Status read evaluate as pending for the minute its servers took to start: its progress
    file came with the first measurement. It is there, with the phase, before any start."""
    from eaglet.core.config import validate
    from eaglet.core.io import read_json, write_json
    from eaglet.stages.evaluate import stage as evaluate

    machine = priced_machine(monkeypatch, {"baseline": {1: 6.0}, "eagle3_k3": {1: 5.0}})
    seen = []
    start = machine.start

    def starting(cfg, target_path, placed, log_dir, unmeasured=None):
        seen.append(read_json(tmp_path / "progress.json"))
        return start(cfg, target_path, placed, log_dir)

    monkeypatch.setattr(evaluate, "_start", starting)
    cfg = validate(
        {
            "evaluate": {
                "concurrency": [1],
                "rounds": 1,
                "interleave": True,
                "offline": False,
                "ngram": False,
                "schedule": False,
            }
        }
    )
    write_json(tmp_path / "target.json", {"path": "target", "spec": "t"})
    (tmp_path / "eval.jsonl").write_text(
        '{"id": "p0", "messages": [{"role": "user", "content": "q"}]}\n'
    )
    evaluate.run_stage(
        cfg,
        str(tmp_path / "target.json"),
        "drafter",
        str(tmp_path / "eval.jsonl"),
        str(tmp_path / "acceptance.json"),
        str(tmp_path),
        progress_path=str(tmp_path / "progress.json"),
    )
    assert seen[0]["state"] == "running" and seen[0]["done"] == 0
    assert seen[0]["phase"] == "starting vLLM for baseline, eagle3_k3"


def test_the_schedule_is_checked_beside_the_target_alone_kept_up(monkeypatch, tmp_path):
    """Interleaved: the drafter pays at 1 and not at 16, so the stage derives a schedule and
    checks it beside a second measurement of the target alone, whose server stayed up."""
    from eaglet.core.config import validate
    from eaglet.core.io import read_json, write_json
    from eaglet.stages.evaluate import stage as evaluate

    machine = priced_machine(
        monkeypatch,
        {
            "baseline": {1: 6.0, 16: 1.0},
            "ngram_k3": {1: 7.0, 16: 2.0},
            "eagle3_k3": {1: 5.0, 16: 1.5},
            "eagle3_schedule": {1: 5.0, 16: 1.1},
        },
    )
    cfg = validate(
        {
            "evaluate": {"concurrency": [1, 16], "rounds": 2, "interleave": True, "offline": False},
            "server": {"memory_utilization": 0.3, "port": 8000},
        }
    )
    write_json(tmp_path / "target.json", {"path": "target", "spec": "t"})
    (tmp_path / "eval.jsonl").write_text(
        "".join(
            f'{{"id": "p{i}", "messages": [{{"role": "user", "content": "q{i}"}}]}}\n'
            for i in range(16)
        )
    )
    result = evaluate.run_stage(
        cfg,
        str(tmp_path / "target.json"),
        "drafter",
        str(tmp_path / "eval.jsonl"),
        str(tmp_path / "acceptance.json"),
        str(tmp_path),
        serve_path=str(tmp_path / "serve.json"),
    )
    # the sweep's servers start together; the schedule's beside the target alone's, kept up
    assert machine.started == [["baseline", "ngram_k3", "eagle3_k3"], ["eagle3_schedule"]]
    # the check's rounds alternate between the schedule and the target alone
    check = [url for url, _ in machine.calls if url in ("baseline", "eagle3_schedule")][-4:]
    assert sorted(check) == ["baseline", "baseline", "eagle3_schedule", "eagle3_schedule"]
    # evaluate.memory_utilization unset: the server's share; each on a free port
    assert {
        (s["memory_utilization"], s["kv_cache_gib"], s["port"]) for s in machine.started_with
    } == {(0.3, None, 0)}
    serve = read_json(tmp_path / "serve.json")
    assert serve["checked_by"] == "eagle3_schedule"
    speedups = {e["concurrency"]: e["speedup"] for e in serve["by_concurrency"]}
    assert speedups[1] == pytest.approx(1.2, abs=0.05)
    assert speedups[16] == pytest.approx(1 / 1.1, abs=0.05)
    assert not serve["never_slower_than_target"]
    assert [r["name"] for r in result["runs"]] == [
        "baseline",
        "ngram_k3",
        "eagle3_k3",
        "eagle3_schedule",
    ]
    # its speedups are over the target alone measured beside it, kept with the run
    checked = result["runs"][-1]
    refs = {(lv["set"], lv["concurrency"]): lv for lv in checked["baseline_levels"]}
    assert refs.keys() == {(lv["set"], lv["concurrency"]) for lv in checked["levels"]}
    for lv in checked["levels"]:
        ref = refs[(lv["set"], lv["concurrency"])]
        assert lv["speedup"] == pytest.approx(
            lv["output_tokens_per_s"] / ref["output_tokens_per_s"]
        )
    assert "baseline_levels" not in result["runs"][2]
    # at 16 the schedule drafts k 0: no acceptance there, though its counters hold drafts
    at16 = next(lv for lv in checked["levels"] if lv["concurrency"] == 16)
    assert at16["k"] == 0 and at16["drafts"] and at16["acceptance_length"] is None
    # two rounds at 1 give an interval; 16 prompts at 16 are one round, and give none
    assert serve["by_concurrency"][0]["speedup_low"] < speedups[1]
    assert serve["by_concurrency"][1]["speedup_low"] is None


def serve_with_health_servers(monkeypatch, behaviour: dict[str, list[str]]) -> None:
    """The evaluation's servers as stand-ins (tests.helpers.health_server) that start, crash
    or hang as ``behaviour`` says for each run (its arguments by run name)."""
    from pathlib import Path

    from eaglet.engine.server import VLLMServer
    from eaglet.stages.evaluate import stage as evaluate

    def health_server(cfg, model, log_path, extra_args=()):
        name = Path(log_path).name.split(".")[1]  # evaluate.<run>.server.log
        return VLLMServer(
            model=model,
            log_path=log_path,
            args=behaviour[name],
            module="tests.helpers.health_server",
            env=pythonpath_env(REPO),
            startup_timeout_s=10,
            shutdown_grace_s=0.5,
        )

    monkeypatch.setattr(evaluate, "target_server", health_server)


@pytest.mark.subprocess
def test_a_drafter_vllm_refuses_is_named_and_every_server_started_with_it_stops(
    monkeypatch, tmp_path
):
    """Side by side, the servers start together; the one that fails names its run, and the
    others (one up already, one still starting) are stopped with it."""
    import re
    from pathlib import Path

    from eaglet.core.config import validate
    from eaglet.engine.server import pid_alive
    from eaglet.stages.evaluate import stage as evaluate

    behaviour = {
        "baseline": ["--ready-after", "0.5"],
        "eagle3_k3": ["--ready-after", "1000", "--crash-after", "0.3"],
        "ngram_k3": ["--ready-after", "0.5"],
    }

    serve_with_health_servers(monkeypatch, behaviour)
    cfg = validate({"evaluate": {"concurrency": [1], "interleave": True}})
    runs = [
        {"name": "baseline", "method": "baseline"},
        {"name": "eagle3_k3", "method": "eagle3", "k": 3, "drafter": "drafter"},
        {"name": "ngram_k3", "method": "ngram", "k": 3},
    ]
    with pytest.raises(evaluate.EvaluationError, match="eagle3_k3: vLLM refused the drafter"):
        evaluate.engine_runs(cfg, "target", runs, {"heldout": []}, str(tmp_path))
    for run in runs:
        text = Path(evaluate.server_log(str(tmp_path), run)).read_text()
        pid = int(re.search(r"health server pid (\d+)", text).group(1))
        assert not pid_alive(pid), run["name"]


@pytest.mark.subprocess
def test_a_baseline_vllm_cannot_serve_is_not_measured_and_the_drafters_servers_go_on(
    monkeypatch, tmp_path
):
    """vLLM's own speculation (here its MTP layers, whose weights the checkpoint lacks) is a
    baseline to compare with: where its server cannot start, the run is recorded as not
    measured with the cause from its log, and the target alone and the drafter serve on."""
    import contextlib

    from eaglet.core.config import validate
    from eaglet.stages.evaluate import stage as evaluate

    cause = "ValueError: MTP speculative decoding layer 8 weights missing from checkpoint."
    behaviour = {
        "baseline": ["--ready-after", "0.5"],
        "mtp_k1": ["--ready-after", "1000", "--crash-after", "0.3", "--crash-message", cause],
        "eagle3_k3": ["--ready-after", "0.5"],
    }

    serve_with_health_servers(monkeypatch, behaviour)
    cfg = validate({"evaluate": {"concurrency": [1], "interleave": True}})
    runs = [
        {"name": "baseline", "method": "baseline"},
        {"name": "mtp_k1", "method": "mtp", "k": 1},
        {"name": "eagle3_k3", "method": "eagle3", "k": 3, "drafter": "drafter"},
    ]
    unmeasured: list[dict] = []
    with contextlib.ExitStack() as stack:
        urls = evaluate._start(
            cfg, "target", [(stack, run) for run in runs], str(tmp_path), unmeasured
        )
        assert sorted(urls) == ["baseline", "eagle3_k3"]
    assert [(u["name"], u["method"], u["k"]) for u in unmeasured] == [("mtp_k1", "mtp", 1)]
    assert "weights missing from checkpoint" in unmeasured[0]["reason"], unmeasured
    assert "evaluate.mtp_k1.server.log" in unmeasured[0]["reason"]
    # without a list to report in (the benchmarks' callers), any failure fails as before
    with pytest.raises(evaluate.EvaluationError, match="mtp_k1: vLLM did not start"):
        with contextlib.ExitStack() as stack:
            evaluate._start(cfg, "target", [(stack, run) for run in runs], str(tmp_path))
    # a drafter vLLM refuses fails the stage whatever the list
    behaviour["mtp_k1"], behaviour["eagle3_k3"] = behaviour["eagle3_k3"], behaviour["mtp_k1"]
    with pytest.raises(evaluate.EvaluationError, match="eagle3_k3: vLLM refused the drafter"):
        with contextlib.ExitStack() as stack:
            evaluate._start(cfg, "target", [(stack, run) for run in runs], str(tmp_path), [])


def test_the_verdict_comes_out_and_names_a_baseline_that_was_not_measured():
    from eaglet.stages.evaluate.runs import not_measured

    runs = judged(
        run("baseline", "baseline", same(10.0, 80.0)),
        run("eagle3_k3", "eagle3", same(13.0, 88.0), 2.5, 0.5, 3),
    )
    why = "the checkpoint holds no MTP weights"
    v = verdict(runs, SWEEP, None, [not_measured({"name": "mtp_k1", "method": "mtp", "k": 1}, why)])
    assert v["not_measured"] == {"mtp_k1": why}
    assert v["summary"].endswith(f"mtp_k1 not measured: {why}.")
    assert v["speeds_up_serving"] == {"1": True, "16": True}


# -- servers side by side only where they fit ------------------------------------------------


def _weights_header(directory, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors file's header alone (the sizes are read from it, no weight is): a
    checkpoint of any size in a few bytes."""
    import json
    import math
    import struct

    directory.mkdir(parents=True, exist_ok=True)
    header, offset = {}, 0
    width = {"BF16": 2, "F32": 4, "I32": 4}
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * width[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text)


GB = 10**9


def test_servers_run_side_by_side_only_where_they_fit(tmp_path):
    from eaglet.core.config import ConfigError, validate
    from eaglet.model.sizes import target_size
    from eaglet.stages.evaluate.placement import placement

    small, large = tmp_path / "small", tmp_path / "large"
    _weights_header(small, {"w": ("F32", [1000, 1000])})  # 4 MB
    # Kimi-K2.5's scale: 554 GB, most of it INT4 experts packed in int32
    _weights_header(
        large, {"experts": ("I32", [124_000_000, 1000]), "rest": ("BF16", [29_000_000, 1000])}
    )
    assert target_size(large, "bfloat16").served == 554 * GB
    # float tensors are held in the serving dtype; a forward dequantizes 8 int4 to an int32
    assert target_size(small, "bfloat16").served == 2 * 10**6
    assert target_size(large, "bfloat16").float32 == 4 * (29 * GB + 2 * 496 * GB)

    cpu = validate({"evaluate": {"kv_cache_gib": 0.5}})
    got = placement(cpu, small, 3, host_bytes=16 << 30)
    assert got.together and got.fits and "3 servers" in got.reason and "fit within" in got.reason
    got = placement(cpu, small, 3, host_bytes=4 << 30)  # 3 x 1.5 GiB past 80% of 4 GiB
    assert not got.together and "need more than" in got.reason

    gpus = validate({"server": {"gpus": 8, "tensor_parallel_size": 8}})
    got = placement(gpus, large, 3)
    assert not got.together and "8 GPUs" in got.reason and "554" not in got.reason
    assert "weights 515.95 GiB" in got.reason and "memory_utilization 0.9" in got.reason
    # a small target on GPUs: each server asks vLLM's memory_utilization free at its start
    assert not placement(gpus, small, 3).together  # 3 x 0.9 of the GPUs
    shared = validate({"server": {"gpus": 8}, "evaluate": {"memory_utilization": 0.3}})
    assert placement(shared, small, 3).together  # 3 x 0.3

    # a setting is obeyed, and says what the sizes say
    forced = validate({"server": {"gpus": 8}, "evaluate": {"interleave": True}})
    got = placement(forced, large, 3)
    assert got.together and got.fits is False and "interleave: true" in got.reason
    assert not placement(
        validate({"evaluate": {"interleave": False}}), small, 3, host_bytes=16 << 30
    ).together
    # the default decides; a setting other than auto, true or false is refused
    assert validate({})["evaluate"]["interleave"] == "auto"
    with pytest.raises(ConfigError, match="interleave"):
        validate({"evaluate": {"interleave": "sometimes"}})
    # nothing to judge by: one at a time
    assert not placement(cpu, None, 3).together
    assert not placement(cpu, tmp_path / "nothing", 3).together


def test_a_targets_size_comes_from_its_config_where_no_weights_are_there(tmp_path):
    """A hub config alone (a wrapper's text_config, an MoE with MLA): `eaglet plan`'s dense
    count plus the experts, about 1T for Kimi-K2.5's shape."""
    import json

    from eaglet.core.config import validate
    from eaglet.model.sizes import config_params, target_size
    from eaglet.stages.evaluate.placement import placement

    text = {
        "model_type": "kimi_k2",
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 384,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "vocab_size": 163840,
    }
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": text}
    assert 0.95e12 < config_params(config) < 1.1e12
    dense = {**text, "moe_intermediate_size": None, "n_routed_experts": None}
    assert config_params({"text_config": dense}) < 0.05e12
    (tmp_path / "config.json").write_text(json.dumps(config))
    size = target_size(tmp_path, "bfloat16")
    assert size.served == 2 * config_params(config) and "config.json" in size.source
    assert not placement(validate({"server": {"gpus": 8}}), tmp_path, 3).together
    assert config_params({"architectures": ["X"]}) is None  # no shape: unknown


def test_status_plans_the_evaluation_as_the_stage_places_its_servers(tmp_path, monkeypatch):
    """`eaglet status` asks the stage's own decision: one target planned side by side, a
    larger one one at a time (each run's server starting on its own)."""
    import json

    from eaglet.core import rates
    from eaglet.core.config import validate
    from eaglet.stages.evaluate import placement as evaluate
    from eaglet.stages.evaluate.schedule import sweep_runs
    from eaglet.tools import status

    monkeypatch.setenv("EAGLET_RATES", str(tmp_path / "rates.jsonl"))
    monkeypatch.setattr(evaluate, "host_memory_bytes", lambda: 16 << 30)
    r = tmp_path / "results"
    (r / "prompts").mkdir(parents=True)
    (r / "prompts" / "stats.json").write_text(json.dumps({"n_train": 30, "n_eval": 10}))
    (r / "target").mkdir()
    cfg = validate({"results_dir": str(r), "evaluate": {"kv_cache_gib": 0.5, "offline": False}})
    rates.record(rates.EVALUATE, cfg["target"]["model"], baseline_tokens_per_s=20.0)
    plans = {}
    for name, tensors in {
        "small": {"w": ("F32", [1000, 1000])},
        "large": {"w": ("BF16", [8_000_000, 1000])},
    }.items():  # 16 GB
        _weights_header(tmp_path / name, tensors)
        (r / "target" / "target.json").write_text(json.dumps({"path": str(tmp_path / name)}))
        plans[name] = status.estimate("evaluate", r, cfg, None)
        runs = len(sweep_runs(cfg["evaluate"])[0])
        assert plans[name].basis.startswith(f"{runs + (2 if name == 'small' else 1)} vLLM runs")
    assert "side by side" in plans["small"].basis and "one at a time" in plans["large"].basis
    # each temperature sends every level's requests again
    two = validate(
        {
            "results_dir": str(r),
            "evaluate": {"kv_cache_gib": 0.5, "offline": False, "temperature": [0, 1.0]},
        }
    )
    assert status.estimate("evaluate", r, two, None).seconds > plans["large"].seconds


def test_ngram_that_proposes_nothing_is_reported_but_a_drafter_that_drafts_nothing_fails():
    """ngram proposes only where an n-gram recurs in the context: on short, unrepeated answers
    it drafts nothing, which is a result, not a server that ignored its config. An EAGLE-3
    drafter proposes at every step, so no drafts there means the config was not applied."""
    from eaglet.stages.evaluate.runs import EvaluationError
    from eaglet.stages.evaluate.stage import _run_result

    nothing = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_position": []}
    level = {
        "set": "heldout",
        "concurrency": 1,
        "output_tokens": 32,
        "wall_s": 1.0,
        "output_tokens_per_s": 32.0,
        "_delta": nothing,
        "_answers": [],
        **acceptance(nothing, 3),
    }
    ngram = _run_result(
        {"name": "ngram_k3", "method": "ngram", "k": 3}, [level], {"heldout": []}, "ngram.log"
    )
    assert ngram["drafts"] == 0 and ngram["acceptance_length"] is None
    with pytest.raises(EvaluationError, match="eagle3_k3: vLLM served without drafting"):
        _run_result(
            {"name": "eagle3_k3", "method": "eagle3", "k": 3, "drafter": "d"},
            [level],
            {"heldout": []},
            "eagle3.log",
        )


def test_acceptance_length_is_reported_pooled_and_per_request_side_by_side(monkeypatch, tmp_path):
    from eaglet.tools.plots import write_results_table

    machine = DriftingMachine({"baseline": 6.0, "eagle3_k3": 5.0})
    _measured(machine, monkeypatch, RUNS, interleave=True)
    base, drafter = machine.runs
    # even prompts AL 1.33, odd ones 4.0 (drafted()): pooled 2.0, per request their mean
    per_request = (1 + 2 / 6 + 1 + 6 / 2) / 2
    for where in (drafter["levels"][0], drafter["sets"]["heldout"], drafter):
        assert where["acceptance_length"] == pytest.approx(2.0)
        assert where["acceptance_length_per_request"] == pytest.approx(per_request)
        assert where["requests_drafted"] == 6
    assert base["levels"][0]["acceptance_length_per_request"] is None
    assert base["levels"][0]["requests_drafted"] is None
    v = verdict([base, {**drafter, "method": "eagle3"}], [1])
    assert v["acceptance_length_per_request"] == pytest.approx(per_request)
    assert f"AL 2.00 ({per_request:.2f} per request)" in v["summary"]
    # and in the results table, with the speedup's interval from its six rounds
    write_results_table({"runs": [_public(r) for r in machine.runs]}, tmp_path / "summary.csv")
    with open(tmp_path / "summary.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert float(rows[1]["acceptance length"]) == 2.0
    assert float(rows[1]["acceptance length per request"]) == pytest.approx(per_request, abs=1e-3)
    assert rows[0]["acceptance length per request"] == ""
    low, high = float(rows[1]["speedup low"]), float(rows[1]["speedup high"])
    assert low < float(rows[1]["speedup"]) < high


def test_the_offline_replay_reports_per_request_beside_vllm(monkeypatch):
    """Each replayed sequence's counts are kept, so the replay's acceptance length per
    request stands beside vLLM's per answer, as the pooled ones do."""
    from eaglet.model import replay as offline_eval
    from eaglet.stages.evaluate.offline import _compare

    def counts(drafter, aux, prompt, answer, k):
        ids = prompt + answer
        oracle = lambda p, n: ids[p + 2 : p + 2 + n]  # noqa: E731  (the target's own tokens)
        return offline_eval.replay(
            oracle if aux == "oracle" else lambda p, n: [-1] * n, ids, len(prompt), k
        )

    monkeypatch.setattr(offline_eval, "replay_counts", counts)
    sequences = [([1, 2], list(range(3, 12))), ([1, 2], [5, 6, 7, 8, 9])]
    got = offline_eval.replay_sequences(
        None,
        sequences,
        [3],
        lambda prompt, answer: ("stored", "oracle" if len(answer) > 5 else "wrong", "stored"),
    )
    right, wrong = got["per_sequence"][3]
    assert (right["drafts"], right["accepted"]) == (2, 6)  # AL 4.0
    assert (wrong["drafts"], wrong["accepted"]) == (4, 0)  # AL 1.0
    assert got["counts"][3]["drafts"] == 6 and got["counts"][3]["accepted"] == 6
    # vLLM measured the same two answers alike
    run = {
        "name": "eagle3_k3",
        "k": 3,
        "levels": [
            {
                "set": "heldout",
                "concurrency": 1,
                "_delta": {
                    "drafts": 6,
                    "draft_tokens": 18,
                    "accepted": 6,
                    "per_position": [2, 2, 2],
                },
                "_answers": [
                    {"spec_decoding": {"drafts": 2, "draft_tokens": 6, "accepted": 6}},
                    {"spec_decoding": {"drafts": 4, "draft_tokens": 12, "accepted": 0}},
                ],
            }
        ],
    }
    out = _compare(run, {"heldout": got})
    assert out["acceptance_length"] == pytest.approx(2.0)  # 6 over 6 steps
    assert out["acceptance_length_per_request"] == pytest.approx(2.5)  # (4 + 1) / 2
    assert out["vllm_acceptance_length"] == pytest.approx(2.0)
    assert out["vllm_acceptance_length_per_request"] == pytest.approx(2.5)
    assert out["sets"]["heldout"]["acceptance_length_per_request"] == pytest.approx(2.5)
    assert out["sets"]["heldout"]["vllm_acceptance_length_per_request"] == pytest.approx(2.5)


def test_drafts_past_an_answers_end_bound_what_vllm_may_count():
    """vLLM verifies a last round's drafts past the answer's stop token against the
    target's own tokens after it, and counts those it accepts: a Gemma 4 miniature drafted
    [388, 106, 106] where the answer ended [388, 106] and the target's next token was 106
    again, one accepted draft more in vLLM's counters than the answer shows. The replay
    counts the drafts it cannot judge, and the check holds vLLM's count to that range."""
    from eaglet.model import replay as offline_eval
    from eaglet.stages.evaluate.offline import _compare

    prompt, answer = [1, 2], [10, 11, 12, 388, 106]
    ids = prompt + answer
    chains = {1: [11, 9, 9], 3: [388, 106, 106]}  # row -> the drafter's chain from it
    counts = offline_eval.replay(lambda p, n: chains[p][:n], ids, len(prompt), 3)
    assert (counts["drafts"], counts["accepted"], counts["past_end"]) == (2, 3, 1)

    def compared(vllm_accepted: int, temperature: float = 0.0) -> dict:
        got = {
            "counts": {3: dict(counts)},
            "per_sequence": {3: [counts]},
            "sources": {"stored": 0, "forward": 1, "left_out": 0},
        }
        run = {
            "name": "eagle3_k3",
            "k": 3,
            "temperature": temperature,
            "levels": [
                {
                    "set": "heldout",
                    "concurrency": 1,
                    "_delta": {
                        "drafts": 2,
                        "draft_tokens": 6,
                        "accepted": vllm_accepted,
                        "per_position": [2, 1, vllm_accepted - 3],
                    },
                    "_answers": [],
                }
            ],
        }
        return _compare(run, {"heldout": got})

    out = compared(4)  # vLLM took the draft past the stop as well
    assert out["acceptance_length"] == pytest.approx(2.5)
    assert out["acceptance_length_high"] == pytest.approx(3.0)
    assert out["vllm_acceptance_length"] == pytest.approx(3.0) and out["agrees"]
    assert compared(3)["agrees"]  # or not: both are what vLLM may count
    assert not compared(5)["agrees"]  # more than every draft past the end: a real gap
    assert not compared(2)["agrees"]  # fewer than the answer shows: a real gap
    # a replay with nothing past an end is held to 1% as before
    whole = offline_eval.replay(lambda p, n: chains[p][:n], ids + [7], len(prompt), 3)
    assert whole["past_end"] == 0


# -- every speedup with its interval from the rounds -----------------------------------------


def test_t_quantiles_are_the_tables():
    assert [round(t_quantile(df), 3) for df in (1, 2, 3, 4, 10, 30)] == [
        12.706,
        4.303,
        3.182,
        2.776,
        2.228,
        2.042,
    ]
    assert t_quantile(1000) == pytest.approx(1.962, abs=1e-3)


def test_every_speedup_has_its_95_percent_interval_from_the_rounds():
    base = run(
        "baseline",
        "baseline",
        same(10.0, 80.0, ("heldout", "chat")),
        rounds={("heldout", 1): [10.0] * 4, ("chat", 1): [20.0] * 4},
    )
    drafter = run(
        "eagle3_k3",
        "eagle3",
        same(12.0, 40.0, ("heldout", "chat")),
        2.0,
        0.4,
        3,
        rounds={("heldout", 1): [12.0, 11.0, 13.0, 12.0], ("chat", 1): [20.0, 22.0, 18.0, 20.0]},
    )
    judged(base, drafter)
    level = {(lv["set"], lv["concurrency"]): lv for lv in drafter["levels"]}[("heldout", 1)]
    ratios = [1.2, 1.1, 1.3, 1.2]  # each round over the target alone's same round
    half = t_quantile(3) * statistics.stdev(ratios) / 2
    assert level["speedup"] == pytest.approx(1.2)
    assert (level["speedup_low"], level["speedup_high"]) == (
        pytest.approx(1.2 - half),
        pytest.approx(1.2 + half),
    )
    # over both sets: round r of each pooled, as the speedup itself is
    pooled = [(12 + 20) / 30, (11 + 22) / 30, (13 + 18) / 30, (12 + 20) / 30]
    half = t_quantile(3) * statistics.stdev(pooled) / 2
    entry = drafter["by_concurrency"][0]
    assert entry["speedup"] == pytest.approx(128 / 120)
    assert (entry["speedup_low"], entry["speedup_high"]) == (
        pytest.approx(128 / 120 - half),
        pytest.approx(128 / 120 + half),
    )
    # one round (the set held no more prompts than the concurrency): no interval
    assert drafter["by_concurrency"][1]["speedup_low"] is None
    assert all(lv["speedup_high"] is None for lv in drafter["levels"] if lv["concurrency"] == 16)


def four_rounds(factors, **tokens_per_s):
    """Rounds of the (heldout, concurrency) levels: each level's tokens/s times ``factors``."""
    return {("heldout", int(c[1:])): [tps * f for f in factors] for c, tps in tokens_per_s.items()}


NOISY, STEADY = (0.9, 1.1, 0.95, 1.05), (0.99, 1.01, 1.0, 1.0)


def judged_in_rounds(factors, tps_1, tps_16, ngram=None):
    base = run(
        "baseline",
        "baseline",
        same(10.0, 100.0),
        rounds=four_rounds((1.0,) * 4, c1=10.0, c16=100.0),
    )
    runs = [
        base,
        run(
            "eagle3_k3",
            "eagle3",
            same(tps_1, tps_16),
            2.0,
            0.35,
            3,
            rounds=four_rounds(factors, c1=tps_1, c16=tps_16),
        ),
    ]
    if ngram:
        factors_n, n_1, n_16 = ngram
        runs.insert(
            1,
            run(
                "ngram_k3",
                "ngram",
                same(n_1, n_16),
                2.2,
                0.4,
                3,
                rounds=four_rounds(factors_n, c1=n_1, c16=n_16),
            ),
        )
    return judged(*runs)


def test_a_speedup_whose_interval_holds_one_is_no_measurable_difference():
    # 1.05x at 1 and 0.95x at 16, but the rounds scatter by up to 10% either way
    runs = judged_in_rounds(NOISY, 10.5, 95.0)
    choice = best_k_by_concurrency(runs, SWEEP)
    serve = serve_recommendation(choice, runs, "d")
    assert (
        serve["by_concurrency"][1]["speedup_low"] < 1.0 < serve["by_concurrency"][1]["speedup_high"]
    )
    assert serve["never_slower_than_target"]  # not measurably slower anywhere
    v = verdict(runs, SWEEP, serve)
    assert v["difference_by_concurrency"] == {"1": NO_DIFFERENCE, "16": NO_DIFFERENCE}
    assert v["speeds_up_serving"] == {"1": False, "16": False}
    assert v["speedup_low_by_concurrency"]["1"] < 1.0 < v["speedup_high_by_concurrency"]["1"]
    # neither a win nor a loss
    assert not any("SLOWER THAN NO DRAFTER" in w for w in v["warnings"])
    assert "slower than no drafter" not in v["summary"]
    assert (
        "at concurrency 16: eagle3_k3 0.95x [0.81, 1.09], no measurable difference from "
        "no drafter (serve.json drafts none there)"
    ) in v["summary"]
    assert (
        "at concurrency 1: eagle3_k3 1.05x [0.90, 1.20], no measurable difference from no drafter;"
    ) in v["summary"]
    assert v["summary"].endswith(
        "It makes no measurable difference to serving at any measured concurrency."
    )

    # the same speedups measured steadily: a win at 1, a loss at 16, each with its interval
    runs = judged_in_rounds(STEADY, 10.5, 95.0)
    choice = best_k_by_concurrency(runs, SWEEP)
    serve = serve_recommendation(choice, runs, "d")
    v = verdict(runs, SWEEP, serve)
    assert v["difference_by_concurrency"] == {"1": "faster", "16": "slower"}
    assert v["speeds_up_serving"] == {"1": True, "16": False}
    assert v["summary"].endswith("It speeds serving up only at concurrency 1.")
    assert "at concurrency 16: eagle3_k3 0.95x [0.94, 0.96], slower than no drafter" in v["summary"]
    [slower] = [w for w in v["warnings"] if w.startswith("SLOWER THAN NO DRAFTER")]
    assert "0.95x [0.94, 0.96] at concurrency 16 (heldout 0.95x [0.94, 0.96])" in slower
    [served] = [w for w in v["warnings"] if w.startswith("SERVE CONFIG SLOWER")]
    assert "measured 0.95x [0.94, 0.96] at concurrency 16" in served


def test_the_verdict_ending_names_wins_and_ties_apart():
    # steady at 1 (a win), scattered at 16 (1.02x: no measurable difference)
    base = run(
        "baseline",
        "baseline",
        same(10.0, 100.0),
        rounds=four_rounds((1.0,) * 4, c1=10.0, c16=100.0),
    )
    drafter = run(
        "eagle3_k3",
        "eagle3",
        same(12.0, 102.0),
        2.0,
        0.35,
        3,
        rounds={**four_rounds(STEADY, c1=12.0), **four_rounds(NOISY, c16=102.0)},
    )
    v = verdict(judged(base, drafter), SWEEP)
    assert v["difference_by_concurrency"] == {"1": "faster", "16": NO_DIFFERENCE}
    assert v["summary"].endswith(
        "It speeds serving up only at concurrency 1 (no measurable difference at concurrency 16)."
    )


def test_two_methods_whose_intervals_overlap_are_no_measurable_difference():
    # EAGLE-3 steady, ngram scattered: at 1 1.20x against 1.15x (the intervals overlap), at
    # 16 1.10x against 0.80x (apart, scatter and all)
    runs = judged_in_rounds(STEADY, 12.0, 110.0, ngram=(NOISY, 11.5, 80.0))
    v = verdict(runs, SWEEP)
    assert v["against_ngram_by_concurrency"] == {"1": NO_DIFFERENCE, "16": "faster"}
    assert "(ngram 1.15x [0.98, 1.32]: no measurable difference from ngram)" in v["summary"]
    assert "(ngram 0.80x [0.68, 0.92]: measurably faster than ngram)" in v["summary"]
    assert v["ngram_speedup_low_by_concurrency"]["1"] < 1.15
    # without intervals the two speedups stand side by side, unjudged, as before
    plain = verdict(
        judged(
            run("baseline", "baseline", same(10.0, 100.0)),
            run("ngram_k3", "ngram", same(11.5, 80.0), 2.2, 0.4, 3),
            run("eagle3_k3", "eagle3", same(12.0, 110.0), 2.0, 0.35, 3),
        ),
        SWEEP,
    )
    assert "(ngram 1.15x)" in plain["summary"]


def test_prompt_sets_whose_speedups_overlap_do_not_disagree():
    sets = ("heldout", "everyday")
    base = run(
        "baseline",
        "baseline",
        same(10.0, 100.0, sets),
        rounds={(s, c): [t] * 4 for s in sets for c, t in ((1, 10.0), (16, 100.0))},
    )

    def drafter(factors):
        # 1.02x on the held-out split and 0.98x on everyday prompts at 16; the same AL
        rounds = {
            (s, c): [t * f for f in factors]
            for (s, c), t in {
                ("heldout", 1): 12.0,
                ("everyday", 1): 12.0,
                ("heldout", 16): 102.0,
                ("everyday", 16): 98.0,
            }.items()
        }
        return run(
            "eagle3_k3",
            "eagle3",
            same(12.0, 100.0, sets),
            2.0,
            0.4,
            3,
            set_al={"heldout": 2.0, "everyday": 1.95},
            rounds=rounds,
        )

    noisy = verdict(judged(base, drafter(NOISY)), SWEEP)
    assert not any(w.startswith("IN-DOMAIN") for w in noisy["warnings"])
    [steady] = [
        w
        for w in verdict(judged(base, drafter(STEADY)), SWEEP)["warnings"]
        if w.startswith("IN-DOMAIN")
    ]
    assert "pays on one but not the other at concurrency 16" in steady


# -- a schedule level that drafts k 0 --------------------------------------------------------


def test_a_schedule_level_that_drafts_k0_has_no_acceptance(monkeypatch, tmp_path):
    """The schedule drafts 3 tokens up to batch 4 and none beyond: at concurrency 16 its
    counters still hold the drafts of the round's last requests (the batch shrank into the
    range that drafts), which are no acceptance of the level's. The table leaves it empty,
    and the figures and the verdict pass over it."""
    from eaglet.tools import plots

    ranges = [[1, 4, 3], [5, MAX_BATCH, 0]]
    schedule = {
        "name": "eagle3_schedule",
        "method": "eagle3",
        "k": 3,
        "drafter": "d",
        "schedule": True,
        "extra": {"num_speculative_tokens_per_batch_size": ranges},
    }
    assert [drafted_k(schedule, c) for c in (1, 4, 5, 16)] == [3, 3, 0, 0]
    assert drafted_k({"name": "eagle3_k2", "k": 2}, 16) == 2
    assert drafted_k({"name": "baseline"}, 16) is None

    runs = [RUNS[0], {"name": "eagle3_k3", "method": "eagle3", "k": 3, "drafter": "d"}, schedule]
    machine = DriftingMachine({"baseline": 6.0, "eagle3_k3": 5.0, "eagle3_schedule": 5.5})
    _measured(machine, monkeypatch, runs, interleave=True, concurrency=(1, 16))
    checked = machine.runs[2]
    at = {lv["concurrency"]: lv for lv in checked["levels"]}
    assert at[16]["drafts"] > 0 and at[16]["k"] == 0  # counted, as the counters hold
    assert at[16]["acceptance_length"] is None and at[16]["acceptance_rate"] is None
    assert at[16]["acceptance_length_per_request"] is None
    assert at[16]["per_position_rate"] == []
    assert at[1]["k"] == 3 and at[1]["acceptance_length"] == pytest.approx(2.0)

    acceptance_json = {
        "prompt_sets": {"heldout": {}},
        "concurrency": [1, 16],
        "runs": [_public(r) for r in machine.runs],
    }
    plots.write_results_table(acceptance_json, tmp_path / "summary.csv")
    with open(tmp_path / "summary.csv", newline="") as handle:
        rows = [r for r in csv.DictReader(handle) if r["run"] == "eagle3_schedule"]
    row = next(r for r in rows if r["concurrency"] == "16")
    assert (
        row["k"],
        row["acceptance length"],
        row["acceptance rate"],
        row["acceptance length per request"],
    ) == ("0", "", "", "")
    assert float(next(r for r in rows if r["concurrency"] == "1")["acceptance length"]) == 2.0
    plots.per_position(acceptance_json, tmp_path / "per_position.png")
    plots.acceptance_length(acceptance_json, tmp_path / "acceptance_length.png")
    plots.speedup(acceptance_json, tmp_path / "speedup.png")
    choice = best_k_by_concurrency(machine.runs, [1, 16])
    v = verdict(machine.runs, [1, 16], serve_recommendation(choice, machine.runs, "d"))
    assert v["best"] == "eagle3_k3" and "summary" in v


# -- every level at each temperature ---------------------------------------------------------


def test_requests_pin_the_distribution_at_their_temperature_cut_as_the_run_serves(monkeypatch):
    """Sampling fields the server would otherwise take from the target's
    generation_config.json are pinned: off, except the run's evaluate.top_p and top_k on
    sampled requests; greedy requests keep their seed, sampled ones go unseeded, as
    production sends them."""
    import asyncio
    import json

    import httpx

    from eaglet.core.config import validate
    from eaglet.stages.evaluate import stage as evaluate

    bodies = []

    def answer(request):
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json=RESPONSE)

    client = httpx.AsyncClient
    monkeypatch.setattr(
        httpx, "AsyncClient", lambda **kw: client(transport=httpx.MockTransport(answer), **kw)
    )
    prompts = [{"id": "p0", "messages": [{"role": "user", "content": "Capital of France?"}]}]
    ev = validate({"evaluate": {"top_p": 0.95, "top_k": 20}})["evaluate"]
    for t in (0.0, 1.0, 1.0):
        cut = evaluate.cut(ev) if len(bodies) == 2 else {}
        asyncio.run(evaluate._run_prompts("http://server", prompts, 8, 1, 10.0, None, t, **cut))
    greedy, plain, served = bodies
    assert (greedy["temperature"], greedy["seed"]) == (0.0, 0)
    assert plain["temperature"] == 1.0 and "seed" not in plain
    fields = (
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    )
    off = {
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
    }
    for body in (greedy, plain):
        assert {key: body[key] for key in fields} == off
    assert {key: served[key] for key in fields} == {**off, "top_p": 0.95, "top_k": 20}
    assert evaluate.sampling_text(1.0, ev) == "temperature 1, top-p 0.95, top-k 20"
    assert evaluate.sampling_text(0.0, ev) == "temperature 0"


def test_each_temperature_is_measured_and_judged_apart_the_last_one_served(monkeypatch, tmp_path):
    """Greedy, the drafter pays at every concurrency; sampled at 1.0 (the temperature listed
    last, the one served) only at 1. Every level goes to every server at both temperatures;
    each run is reported per temperature, its speedups over the target alone at the same
    temperature; the schedule and serve.json come from 1.0, and so does the verdict."""
    from eaglet.core.config import validate
    from eaglet.core.io import read_json, write_json
    from eaglet.stages.evaluate import stage as evaluate
    from eaglet.tools import plots

    per_token = {
        0.0: {
            "baseline": {1: 6.0, 16: 1.0},
            "eagle3_k3": {1: 5.0, 16: 0.8},
            "eagle3_schedule": {1: 5.0, 16: 0.8},
        },
        1.0: {
            "baseline": {1: 6.0, 16: 1.0},
            "eagle3_k3": {1: 5.0, 16: 1.5},
            "eagle3_schedule": {1: 5.0, 16: 1.1},
        },
    }

    class Machine(DriftingMachine):
        def measure(self, url, prompts, ev, concurrency, template_kwargs=None, temperature=0.0):
            self.cost = {name: costs[concurrency] for name, costs in per_token[temperature].items()}
            return super().measure(url, prompts, ev, concurrency, template_kwargs, temperature)

    machine = Machine({})
    monkeypatch.setattr(evaluate, "_start", machine.start)
    monkeypatch.setattr(evaluate, "_measure", machine.measure)
    cfg = validate(
        {
            "evaluate": {
                "concurrency": [1, 16],
                "rounds": 2,
                "interleave": True,
                "offline": False,
                "ngram": False,
                "temperature": [0, 1.0],
                "top_p": 0.95,
            },
            "server": {"memory_utilization": 0.3, "port": 8000},
        }
    )
    write_json(tmp_path / "target.json", {"path": "target", "spec": "t"})
    (tmp_path / "eval.jsonl").write_text(
        "".join(
            f'{{"id": "p{i}", "messages": [{{"role": "user", "content": "q{i}"}}]}}\n'
            for i in range(16)
        )
    )
    result = evaluate.run_stage(
        cfg,
        str(tmp_path / "target.json"),
        "drafter",
        str(tmp_path / "eval.jsonl"),
        str(tmp_path / "acceptance.json"),
        str(tmp_path),
        serve_path=str(tmp_path / "serve.json"),
    )
    assert [(r["name"], r["temperature"]) for r in result["runs"]] == [
        ("baseline", 0.0),
        ("eagle3_k3", 0.0),
        ("eagle3_schedule", 0.0),
        ("baseline_T1", 1.0),
        ("eagle3_k3_T1", 1.0),
        ("eagle3_schedule_T1", 1.0),
    ]
    # the same requests at each temperature, through the same servers
    assert machine.temperatures.count(0.0) == machine.temperatures.count(1.0)
    assert all(lv["temperature"] == r["temperature"] for r in result["runs"] for lv in r["levels"])
    speedups = {
        r["name"]: {e["concurrency"]: e["speedup"] for e in r["by_concurrency"]}
        for r in result["runs"]
    }
    assert speedups["eagle3_k3"][16] == pytest.approx(1 / 0.8, abs=0.05)
    assert speedups["eagle3_k3_T1"][16] == pytest.approx(1 / 1.5, abs=0.05)
    # the schedule comes from 1.0, where the drafter pays at 1 only (greedy, it pays at both)
    serve = read_json(tmp_path / "serve.json")
    assert serve["temperature"] == 1.0 and serve["checked_by"] == "eagle3_schedule_T1"
    assert (serve["top_p"], serve["top_k"]) == (0.95, 0)  # served as measured
    assert [e["k"] for e in serve["by_concurrency"]] == [3, 0]
    v, by_t = result["verdict"], result["verdict_by_temperature"]
    assert v is by_t["1"] and v["temperature"] == 1.0
    assert v["summary"].startswith("At temperature 1, top-p 0.95: EAGLE-3 (eagle3_k3_T1)")
    assert [e["k"] for e in by_t["0"]["best_k_by_concurrency"]] == [3, 3]
    assert [e["k"] for e in v["best_k_by_concurrency"]] == [3, 0]
    # greedy answers are compared with the target alone's; sampled ones are not
    assert set(result["outputs_differ_from_baseline"]) == {"eagle3_k3", "eagle3_schedule"}
    # the table has a row per run, temperature, set and concurrency, the temperature with it
    plots.write_results_table(result, tmp_path / "summary.csv")
    with open(tmp_path / "summary.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert {(r["run"], float(r["temperature"])) for r in rows} == {
        (r["name"], r["temperature"]) for r in result["runs"]
    }
    plots.acceptance_length(result, tmp_path / "acceptance_length.png")
    # each temperature an offline replay of its own
    assert evaluate.sweep_runs({**cfg["evaluate"], "offline": True})[1] == 2


def test_a_sampled_run_that_disagrees_with_its_expected_acceptance_is_explained():
    from eaglet.stages.evaluate.offline import EXPECTED_TOLERANCE, expected_warnings

    def entry(vllm, expected, matched):
        return {
            "temperature": 1.0,
            "vllm_acceptance_length": vllm,
            "acceptance_length": expected,
            "matched_acceptance_length": matched,
            "ratio_offline_over_vllm": expected / vllm,
            "drafts": 400,
            "tolerance": EXPECTED_TOLERANCE,
            "agrees": abs(expected / vllm - 1) <= EXPECTED_TOLERANCE,
        }

    cpu, gpu = {"server": {"gpus": 0}}, {"server": {"gpus": 1}}
    greedy_agrees = {"eagle3_k3": {"agrees": True}}
    assert expected_warnings({"eagle3_k3_T1": entry(1.5, 1.52, 1.5)}, greedy_agrees, cpu) == []
    # vLLM's answers took the drafts as often as it counted: it sampled from elsewhere
    [elsewhere] = expected_warnings({"eagle3_k3_T1": entry(1.02, 1.3, 1.02)}, None, cpu)
    assert elsewhere.startswith("SAMPLED ACCEPTANCE DISAGREES: eagle3_k3_T1")
    assert "another distribution than softmax(logits / 1)" in elsewhere
    assert "CPU engine" in elsewhere
    assert (
        "CPU engine"
        not in expected_warnings({"eagle3_k3_T1": entry(1.02, 1.3, 1.02)}, None, gpu)[0]
    )
    # the drafts are right (greedy agrees) but its answers took them more often than it
    # counted accepting them: the sampler
    [sampler] = expected_warnings({"eagle3_k3_T1": entry(1.14, 1.23, 1.48)}, greedy_agrees, cpu)
    assert "rejection sampler did not verify as it should" in sampler and "CPU engine" in sampler
    # neither: the export, or too few prompts
    [drafts] = expected_warnings(
        {"eagle3_k3_T1": entry(1.5, 1.3, 1.3)}, {"eagle3_k3": {"agrees": False}}, cpu
    )
    assert "check the export" in drafts and "400 drafting steps" in drafts
    assert "CPU engine" not in drafts


def test_a_sampled_difference_within_the_noise_of_few_steps_is_unresolved_not_a_disagreement():
    """On few drafting steps, vLLM's count may fall beyond the 3% by chance: where it lies
    within NOISE_ERRORS standard errors and its answers took the drafts as counted, the
    verdict says how many steps the check needs instead of calling it a disagreement."""
    from eaglet.stages.evaluate.offline import (
        EXPECTED_TOLERANCE,
        NOISE_ERRORS,
        _noise,
        expected_warnings,
    )

    # 40 steps, expected AL 2.45 with a standard error of 0.1, vLLM counted 2.55 (4% off)
    noise = _noise(
        {"acceptance_length": 2.45, "standard_error": 0.1, "drafts": 40}, 2.55, EXPECTED_TOLERANCE
    )
    assert noise["within_noise"] is True
    # NOISE_ERRORS errors shrink with the root of the steps: 40 * (3 * 0.1 / (0.03 * 2.55))^2
    assert (
        noise["drafts_for_tolerance"]
        == math.ceil(40 * (NOISE_ERRORS * 0.1 / (EXPECTED_TOLERANCE * 2.55)) ** 2)
        == 616
    )
    assert (
        _noise(
            {"acceptance_length": 2.2, "standard_error": 0.1, "drafts": 40},
            2.55,
            EXPECTED_TOLERANCE,
        )["within_noise"]
        is False
    )
    assert _noise({"acceptance_length": 2.2, "drafts": 40}, 2.55, EXPECTED_TOLERANCE) == {}

    def entry(expected, matched, within):
        return {
            "temperature": 1.0,
            "vllm_acceptance_length": 2.55,
            "acceptance_length": expected,
            "matched_acceptance_length": matched,
            "ratio_offline_over_vllm": expected / 2.55,
            "drafts": 40,
            "tolerance": EXPECTED_TOLERANCE,
            "agrees": False,
            "standard_error": 0.1,
            "within_noise": within,
            "drafts_for_tolerance": 616,
        }

    [note] = expected_warnings(
        {"eagle3_k3_T1": entry(2.45, 2.55, True)}, None, {"server": {"gpus": 0}}
    )
    assert note.startswith("Sampled acceptance unresolved: eagle3_k3_T1")
    assert "40 drafting steps" in note and "about 616 steps" in note
    # beyond the noise, or answers that did not take the drafts as counted: a disagreement
    for expected, matched, within in ((2.2, 2.55, False), (2.45, 2.3, True)):
        [alarm] = expected_warnings(
            {"eagle3_k3_T1": entry(expected, matched, within)}, None, {"server": {"gpus": 0}}
        )
        assert alarm.startswith("SAMPLED ACCEPTANCE DISAGREES")


def test_the_temperatures_are_a_list_of_at_least_one_unique_non_negative_value():
    from eaglet.core.config import ConfigError, validate

    assert validate({})["evaluate"]["temperature"] == [0]
    assert validate({"evaluate": {"temperature": [0, 1.0]}})["evaluate"]["temperature"] == [0, 1.0]
    for bad, why in (
        ([], "non-empty"),
        ([0, -0.5], "minimum of 0"),
        ([1.0, 1.0], "non-unique"),
        (0.6, "not of type array"),
    ):
        with pytest.raises(ConfigError, match=why):
            validate({"evaluate": {"temperature": bad}})


def test_a_rehearsal_evaluates_at_0_and_the_served_temperature_only():
    from pathlib import Path

    from eaglet.tools.rehearse import rehearsal_config

    def rehearsed(temps):
        cfg, scaled = rehearsal_config(
            {"target": {"model": "org/model"}, "evaluate": {"temperature": temps}},
            Path("mini"),
            Path("results"),
        )
        return cfg["evaluate"]["temperature"], [s for s in scaled if "temperature" in s]

    assert rehearsed([0, 0.6, 1.0]) == (
        [0, 1.0],
        ["evaluate.temperature: [0, 0.6, 1.0] -> [0, 1.0] (0 and the served temperature)"],
    )
    assert rehearsed([0, 1.0]) == ([0, 1.0], [])  # the shipped configs' lists, as they are
    assert rehearsed([0.6])[0] == [0, 0.6]  # the exact greedy check is rehearsed too


@pytest.mark.subprocess
def test_an_evaluation_still_running_keeps_a_second_one_off_its_directory(tmp_path, monkeypatch):
    """kill -9 of Snakemake during evaluate leaves the evaluation running; its rerun started
    a second one beside it (six servers on two cores, both writing eval/). The rerun is
    refused before any server starts, naming the live pid."""
    import subprocess
    import sys

    from eaglet.core.io import DirectoryBusy
    from eaglet.stages.evaluate import stage as evaluate_stage

    started = []
    monkeypatch.setattr(evaluate_stage, "_run_stage", lambda *a: started.append(a))
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom eaglet.core.io import hold_directory\n"
            "with hold_directory(sys.argv[1], 'evaluate'):\n    print('held', flush=True)\n"
            "    time.sleep(60)\n",
            str(tmp_path / "eval"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DirectoryBusy, match=rf"evaluate .*pid {holder.pid} .*kill "):
            evaluate_stage.run_stage(
                {},
                "t.json",
                "d",
                "p.jsonl",
                str(tmp_path / "eval" / "acceptance.json"),
                str(tmp_path),
            )
        assert not started
    finally:
        holder.kill()
        holder.wait()
    evaluate_stage.run_stage(
        {}, "t.json", "d", "p.jsonl", str(tmp_path / "eval" / "acceptance.json"), str(tmp_path)
    )
    assert len(started) == 1  # the directory is free once the first is gone
