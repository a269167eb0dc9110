"""The report's results table (``eaglet.tools.plots.results_table``)."""

from __future__ import annotations

import csv

import pytest

from eaglet.tools.plots import write_results_table


def _level(name, concurrency, tps, speedup, al=None, rate=None):
    return {
        "set": name,
        "concurrency": concurrency,
        "output_tokens_per_s": tps,
        "speedup": speedup,
        "acceptance_length": al,
        "acceptance_rate": rate,
        "mean_latency_s": 2.0,
        "per_position_rate": [0.5],
        "drafts": 10,
    }


ACCEPTANCE = {
    "runs": [
        {
            "name": "baseline",
            "method": "baseline",
            "k": None,
            "levels": [_level("heldout", 1, 20.0, 1.0), _level("heldout", 16, 80.0, 1.0)],
        },
        {
            "name": "eagle3_k3",
            "method": "eagle3",
            "k": 3,
            "levels": [
                _level("heldout", 1, 30.0, 1.5, 2.1234, 0.37),
                _level("heldout", 16, 40.0, 0.5, 2.0, 0.33),
            ],
        },
    ]
}


def test_the_results_table_has_one_row_per_run_set_and_concurrency(tmp_path):
    write_results_table(ACCEPTANCE, tmp_path / "summary.csv")
    with open(tmp_path / "summary.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["run"], r["concurrency"]) for r in rows] == [
        ("baseline", "1"),
        ("baseline", "16"),
        ("eagle3_k3", "1"),
        ("eagle3_k3", "16"),
    ]
    eagle = rows[2]
    assert (eagle["method"], eagle["k"], eagle["prompt set"]) == ("eagle3", "3", "heldout")
    assert float(eagle["acceptance length"]) == pytest.approx(2.123)
    assert float(eagle["speedup"]) == 1.5 and float(rows[3]["speedup"]) == 0.5
    assert rows[0]["acceptance length"] == ""  # the target alone drafts nothing
    assert "per_position_rate" not in rows[0] and "drafts" not in rows[0]
