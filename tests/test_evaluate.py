"""Acceptance arithmetic from vLLM's Prometheus counters, and the verdict."""

from __future__ import annotations

import pytest

from eaglet.evaluate import acceptance, counter_delta, parse_metrics, spec_counters, verdict

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


def run(name, method, tokens_per_s, al=None, rate=None, k=None):
    return {"name": name, "method": method, "k": k, "concurrency": 1,
            "output_tokens_per_s": tokens_per_s, "speedup": tokens_per_s / 10.0,
            "acceptance_length": al, "acceptance_rate": rate}


def test_verdict_of_a_drafter_that_helps():
    v = verdict([run("baseline", "baseline", 10.0), run("ngram_k3", "ngram", 11.0, 2.0, 0.33, 3),
                 run("eagle3_k3", "eagle3", 13.0, 2.5, 0.5, 3)])
    assert v["speeds_up_serving"] and v["beats_ngram"]
    assert v["ceiling"] == 4 and v["share_of_ceiling"] == pytest.approx(2.5 / 4)
    assert not v["warnings"]
    assert "speeds serving up" in v["summary"]


def test_verdict_warns_loudly_about_a_drafter_that_slows_serving():
    v = verdict([run("baseline", "baseline", 10.0), run("eagle3_k3", "eagle3", 6.6, 1.45, 0.15, 3)])
    assert not v["speeds_up_serving"]
    assert any("SLOWER THAN NO DRAFTER" in w and "0.66x" in w and "15%" in w
               for w in v["warnings"])
    assert "does NOT speed serving up" in v["summary"]


def test_low_acceptance_that_still_pays_here_is_flagged_with_a_smaller_k():
    """A long draft can pay on a CPU (cheap draft steps) at a rate that loses on a GPU."""
    v = verdict([run("baseline", "baseline", 10.0),
                 run("eagle3_k3", "eagle3", 15.9, 2.1, 0.37, 3),
                 run("eagle3_k4", "eagle3", 16.3, 2.2, 0.25, 4)])
    assert v["speeds_up_serving"] and v["best"] == "eagle3_k4"
    [warning] = v["warnings"]
    assert warning.startswith("LOW ACCEPTANCE: eagle3_k4 accepts 25%")
    assert "1.63x" in warning and "eagle3_k3 accepts 37%" in warning


def test_ngram_with_a_higher_al_but_slower_is_told_apart():
    ngram = {**run("ngram_k3", "ngram", 14.0, 2.57, 0.52, 3), "drafts": 634}
    best = {**run("eagle3_k3", "eagle3", 16.0, 2.1, 0.37, 3), "drafts": 1281}
    v = verdict([run("baseline", "baseline", 10.0), ngram, best])
    assert not v["beats_ngram"] and v["faster_than_ngram"]
    assert "higher AL over fewer drafts: 634 against 1281; EAGLE-3 is faster" in v["summary"]
