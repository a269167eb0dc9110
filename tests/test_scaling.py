"""What more data buys (eaglet.stages.scaling): the nested subsets, the fit and its inversion, the
refusal to extrapolate a slope that does not rise, subset training through train.py's entry
point, and the optional stage in the workflow."""

from __future__ import annotations

import json
import math
import random
import subprocess
from pathlib import Path

import pytest
import torch

from eaglet.core.io import write_json
from eaglet.stages import scaling
from eaglet.stages.train.data import TrainError
from eaglet.stages.train.loop import Dist, Trainer, settings
from tests.helpers.paths import REPO, SNAKEMAKE, SRC, TINY, pythonpath_env
from tests.test_train import FAST, make_target, write_shards, write_vocab_map

# -- the fit ---------------------------------------------------------------------------------


def test_the_fit_recovers_a_known_slope():
    rng = random.Random(7)
    a, b = rng.uniform(0.5, 1.0), rng.uniform(0.03, 0.2)
    tokens = [rng.uniform(1e4, 1e6) for _ in range(5)]
    exact = scaling.fit(tokens, [a + b * math.log(t) for t in tokens])
    assert exact["a"] == pytest.approx(a) and exact["b"] == pytest.approx(b)
    assert exact["al_per_doubling"] == pytest.approx(b * math.log(2))
    assert max(map(abs, exact["residuals"])) < 1e-9
    # noise that averages out at every x leaves the slope; the residuals are that noise
    xs = [1e4, 1e4, 4e4, 4e4, 1.6e5, 1.6e5]
    noise = [0.01, -0.01, -0.02, 0.02, 0.015, -0.015]
    noisy = scaling.fit(xs, [a + b * math.log(x) + e for x, e in zip(xs, noise)])
    assert noisy["b"] == pytest.approx(b) and noisy["a"] == pytest.approx(a)
    assert noisy["residuals"] == pytest.approx(noise)
    assert noisy["rms_residual"] == pytest.approx(math.sqrt(sum(e * e for e in noise) / 6))


def test_the_tokens_needed_invert_the_fit():
    result = scaling.fit([2e4, 4e4, 8e4], [1.5, 1.6, 1.7])
    for al in (1.55, 1.9, 2.5):
        needed = scaling.tokens_for(al, result)
        assert scaling.al_at(result, needed) == pytest.approx(al)
    # each 0.1 AL costs one more doubling on these points
    assert scaling.tokens_for(1.9, result) == pytest.approx(8e4 * 2**2)


def test_a_fit_needs_two_token_counts():
    with pytest.raises(scaling.ScalingError, match="two or more"):
        scaling.fit([1e4, 1e4], [1.5, 1.6])


def _points(als: list[float], tokens: list[float], answer_share: float = 0.5) -> list[dict]:
    fractions = [t / tokens[-1] for t in tokens]
    return [
        {"fraction": f, "tokens": t, "answer_tokens": t * answer_share, "heldout_al": al}
        for f, t, al in zip(fractions, tokens, als)
    ]


def test_a_slope_that_does_not_rise_predicts_nothing():
    for als in ([1.62, 1.60, 1.58], [1.6, 1.6, 1.6]):
        out = scaling.predict(_points(als, [1e4, 2e4, 4e4]), 2.0, rate=150.0)
        assert out["fit"]["b"] <= 1e-12
        assert out["tokens_needed"] is None and out["generation"] is None
        assert not out["extrapolates"]
        assert "did not help" in out["sentence"] and "no amount of data" in out["sentence"]


def test_the_prediction_says_the_tokens_and_the_generation_time():
    rng = random.Random(3)
    b = rng.uniform(0.05, 0.1)
    tokens = [1e4, 2e4, 4e4]
    a = 1.6 - b * math.log(tokens[-1])  # the full run at AL 1.6
    points = _points([a + b * math.log(t) for t in tokens], tokens, answer_share=0.6)
    rate = rng.uniform(100, 200)
    out = scaling.predict(points, 2.0, rate=rate, rate_source=scaling.THIS_RUN)
    needed = math.exp((2.0 - a) / b)
    assert out["tokens_needed"] == pytest.approx(needed)
    assert out["times_this_run"] == pytest.approx(needed / 4e4) and out["extrapolates"]
    generation = out["generation"]
    assert generation["answer_tokens"] == pytest.approx(needed * 0.6)
    assert generation["hours"] == pytest.approx(needed * 0.6 / rate / 3600)
    assert generation["more_hours"] == pytest.approx((needed - 4e4) * 0.6 / rate / 3600)
    assert generation["unit"] == "hours on this machine"
    sentence = out["sentence"]
    assert sentence.startswith(f"AL 2 would need about {scaling.count(needed)} training tokens")
    assert "hours of generation on this machine at this run's rate" in sentence
    # the subsets alone predict the full run exactly on exact points
    assert out["check"]["fit_on"] == [0.25, 0.5]
    assert out["check"]["error"] == pytest.approx(0, abs=1e-9)
    # a generation server on GPUs: GPU-hours, the hours times its GPUs
    on_gpus = scaling.predict(
        _points([a + b * math.log(t) for t in tokens], tokens, 0.6),
        2.0,
        rate=rate,
        rate_source=scaling.THIS_RUN,
        gpus=4,
    )
    assert on_gpus["generation"]["hours"] == pytest.approx(4 * generation["hours"])
    assert "GPU-hours of generation" in on_gpus["sentence"]
    # no rate measured: the tokens, and no time
    unrated = scaling.predict(_points([a + b * math.log(t) for t in tokens], tokens), 2.0)
    assert unrated["generation"] is None and "no generation rate" in unrated["sentence"]


def test_a_run_already_past_the_target_says_so():
    out = scaling.predict(_points([1.8, 1.9, 2.1], [1e4, 2e4, 4e4]), 2.0, rate=100.0)
    assert out["times_this_run"] < 1 and not out["extrapolates"]
    assert out["sentence"].startswith("This run already reaches AL 2")


# -- the subsets -----------------------------------------------------------------------------


def test_the_subsets_are_nested_and_deterministic():
    ids = [f"p-{random.Random(i).getrandbits(64):016x}" for i in range(403)]
    quarter, half = scaling.choose(ids, 0.25), scaling.choose(ids, 0.5)
    assert len(quarter) == round(0.25 * len(ids)) and len(half) == round(0.5 * len(ids))
    assert set(quarter) < set(half)
    # the same samples whatever order the shards list them in, kept in the given order
    shuffled = ids[:]
    random.Random(1).shuffle(shuffled)
    assert set(scaling.choose(shuffled, 0.25)) == set(quarter)
    assert quarter == [i for i in ids if i in set(quarter)]
    # a sample added later leaves the others' choice alone: the quarter changes by it at most
    grown = scaling.choose(ids + ["p-new"], 0.25)
    assert len(set(grown) ^ set(quarter)) <= 2
    assert scaling.choose(ids[:1], 0.25) == ids[:1]  # never empty
    with pytest.raises(scaling.ScalingError):
        scaling.choose(ids, 0)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("scaling_world")
    model = make_target(root / "target")
    train_paths = write_shards(model, root / "hidden", 2, 8, seed=1)
    eval_paths = write_shards(model, root / "heldout", 1, 4, seed=2, prefix="e")
    vocab = write_vocab_map(train_paths, root / "vocab_map.safetensors")
    return {
        "root": root,
        "target": str(root / "target"),
        "train": train_paths,
        "eval": eval_paths,
        "vocab": vocab,
    }


def test_sample_sizes_count_the_tokens_training_reads(world):
    from eaglet.data import shards

    max_len = 20
    sizes = scaling.sample_sizes(world["train"], max_len)
    expected = []
    for path in world["train"]:
        shard = shards.load(path)
        for i, sid in enumerate(shard.sample_ids):
            rows = shard.sample(i)
            rows = slice(rows.start, min(rows.stop, rows.start + max_len))
            expected.append((sid, rows.stop - rows.start, int(shard.loss_mask[rows].sum())))
    assert [(s.id, s.tokens, s.answer_tokens) for s in sizes] == expected
    assert any(n == max_len for _, n, _ in expected)  # some samples were cut


def test_a_trainer_given_samples_trains_on_those_alone(world, tmp_path):
    cfg = settings(FAST)
    ids = [s.id for s in scaling.sample_sizes(world["train"], cfg["max_len"])]
    half = scaling.choose(ids, 0.5)
    full = Trainer.from_files(
        cfg,
        world["train"],
        [],
        world["vocab"],
        world["target"],
        str(tmp_path / "full"),
        torch.device("cpu"),
        Dist(),
    )
    part = Trainer.from_files(
        cfg,
        world["train"],
        [],
        world["vocab"],
        world["target"],
        str(tmp_path / "part"),
        torch.device("cpu"),
        Dist(),
        train_samples=half,
    )
    wanted = sorted(ids.index(i) for i in half)
    for epoch in range(cfg["epochs"]):
        planned = [i for batch in part.plan(epoch) for i in batch]
        assert sorted(planned) == wanted  # each chosen sample once an epoch, no other
        assert all(
            sum(part.train_data.lengths[i] for i in batch) <= cfg["max_tokens_per_batch"]
            for batch in part.plan(epoch)
        )
    assert part.total_steps < full.total_steps
    # another subset of the same shards is other data: its checkpoints are not resumed
    assert part.fingerprint["sample_ids_sha256"] != full.fingerprint["sample_ids_sha256"]
    with pytest.raises(TrainError, match="in no training shard"):
        Trainer.from_files(
            cfg,
            world["train"],
            [],
            world["vocab"],
            world["target"],
            str(tmp_path / "bad"),
            torch.device("cpu"),
            Dist(),
            train_samples=["not-a-sample"],
        )


@pytest.mark.subprocess  # heavy in-process: 7 s
def test_the_stage_trains_the_subsets_and_writes_the_prediction(world, tmp_path):
    from eaglet.stages.train.loop import train

    cfg = {**FAST, "epochs": 3}
    results = tmp_path / "results"
    common = dict(
        shard_paths=world["train"],
        eval_shard_paths=world["eval"],
        vocab_map=world["vocab"],
        target_dir=world["target"],
        log_path=None,
    )
    train(
        cfg,
        **common,
        out_dir=str(results / "drafter"),
        checkpoint_dir=str(results / "drafter_checkpoints"),
        progress_path=None,
    )
    write_json(
        results / "synthetic" / "stats.json",
        {"this_run": {"generated": 10, "completion_tokens_per_s": 123.0}},
    )
    records = {}
    for fraction in (0.25, 0.5):
        where = results / "scaling" / scaling.fraction_name(fraction)
        records[fraction] = scaling.train_subset(
            cfg,
            fraction,
            world["train"],
            world["eval"],
            world["vocab"],
            world["target"],
            str(where),
            str(where / "checkpoints"),
            None,
            None,
        )
        stats = json.loads((where / "stats.json").read_text())
        assert stats["shipped"]["heldout_al"] is not None
        assert (where / "model.safetensors").exists()
    assert records[0.25]["samples"] == 4 and records[0.5]["samples"] == 8
    assert records[0.25]["tokens"] < records[0.5]["tokens"]
    assert not (results / "drafter" / "subset.json").exists()  # the full run untouched

    out = results / "eval" / "scaling.json"
    max_len = settings(cfg)["max_len"]
    prediction = scaling.write_prediction(
        results,
        [results / "scaling" / "0.25", results / "scaling" / "0.5"],
        world["train"],
        max_len,
        2.0,
        out,
    )
    written = json.loads(out.read_text())
    assert written["sentence"] == prediction["sentence"]
    points = {p["fraction"]: p for p in written["points"]}
    assert set(points) == {0.25, 0.5, 1.0}
    full_stats = json.loads((results / "drafter" / "stats.json").read_text())
    assert points[1.0]["heldout_al"] == full_stats["shipped"]["heldout_al"]
    assert points[1.0]["tokens"] == sum(
        s.tokens for s in scaling.sample_sizes(world["train"], max_len)
    )
    assert points[0.5]["tokens"] == records[0.5]["tokens"]
    if written["fit"]["b"] > 0:
        assert written["generation"]["tokens_per_s"] == 123.0
    else:
        assert "did not help" in written["sentence"]


# -- the workflow ----------------------------------------------------------------------------


def _dry_run_rules(tmp_path: Path, enabled: bool) -> list[str]:
    from tests.workflows.dryrun import parse_dry_run

    overlay = tmp_path / f"scaling_{enabled}.yaml"
    overlay.write_text(f"scaling:\n  enabled: {str(enabled).lower()}\n  fractions: [0.25, 0.5]\n")
    env = pythonpath_env(SRC, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            str(SNAKEMAKE),
            "-n",
            "--cores",
            "1",
            "--configfile",
            str(TINY),
            str(overlay),
            "--config",
            f"results_dir={tmp_path / 'results'}",
        ],
        cwd=REPO,
        env=env,
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return parse_dry_run(proc.stdout)


@pytest.mark.subprocess
def test_the_stage_runs_only_when_enabled(tmp_path):
    jobs = _dry_run_rules(tmp_path, True)
    subsets = [job for job in jobs if job.rule == "scaling_train"]
    assert sorted(job.wildcards["fraction"] for job in subsets) == ["0.25", "0.5"]
    assert all("/drafter/" not in out for job in subsets for out in job.output)
    fit = [job for job in jobs if job.rule == "scaling"]
    assert len(fit) == 1 and fit[0].output == [str(tmp_path / "results" / "eval" / "scaling.json")]
    off = _dry_run_rules(tmp_path, False)
    assert not [job for job in off if job.rule.startswith("scaling")]
    assert {job.rule for job in off} == {job.rule for job in jobs} - {"scaling_train", "scaling"}


def test_a_slope_too_shallow_to_reach_the_target_is_no_prediction():
    tokens = [1e4, 2e4, 4e4]
    shallow = 1e-3  # AL per ln(token): AL 2 lies hundreds of doublings away
    out = scaling.predict(
        _points([1.5 + shallow * math.log(t) for t in tokens], tokens), 2.0, rate=100.0
    )
    assert out["fit"]["b"] > 0 and out["tokens_needed"] is None and out["generation"] is None
    assert "past anything it can predict" in out["sentence"]
    json.dumps(out, allow_nan=False)  # no infinity in eval/scaling.json


def test_the_reports_first_page_says_the_prediction(tmp_path):
    from eaglet.tools.report_page import first_page

    assert "What more data buys" not in first_page(tmp_path)
    tokens = [1e4, 2e4, 4e4]
    out = scaling.predict(
        _points([1.4 + 0.05 * math.log(t / 1e4) for t in tokens], tokens),
        2.0,
        rate=100.0,
        rate_source=scaling.THIS_RUN,
    )
    write_json(tmp_path / "eval" / "scaling.json", out)
    assert out["sentence"] in first_page(tmp_path)
