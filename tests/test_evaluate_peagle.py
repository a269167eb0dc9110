"""The evaluation of a P-EAGLE drafter (``train.method: peagle``): the method is read from the
exported drafter, its runs are named and served with parallel drafting, judged by the verdict,
the schedule and serve.json like EAGLE-3's, and replayed offline with its one parallel
forward per round. Tiny random-weight drafters of a tiny random target; no vLLM server."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from eaglet.core import methods as records
from eaglet.model import methods, peagle
from eaglet.model.config import DrafterConfig
from eaglet.model.replay import draft_parallel, target_features
from eaglet.stages.evaluate import offline as evaluate_offline
from eaglet.stages.evaluate import runs as evaluate_runs
from eaglet.stages.evaluate import schedule as evaluate_schedule
from eaglet.stages.evaluate import stage as evaluate
from tests.test_evaluate import SWEEP, judged, priced_machine, run, same
from tests.tiny_llama import LAYERS, VOCAB, make_tiny_llama, one_thread

K = 3


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    """A tiny target saved to disk, and a P-EAGLE and an EAGLE-3 drafter of it exported as
    training exports them (``methods.export``), random weights (large enough that the drafts
    vary with the context rather than repeat one token)."""
    root = tmp_path_factory.mktemp("drafters")
    target = make_tiny_llama(root / "target")
    target_config = json.loads((root / "target" / "config.json").read_text())
    config = DrafterConfig.from_target(target_config, VOCAB // 2, [1, 2, LAYERS - 2])
    draft_ids = torch.arange(0, VOCAB, 2)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[draft_ids] = True
    embed = target.model.embed_tokens.weight.detach()
    out = {"root": root, "target": target, "target_dir": str(root / "target")}
    for method in records.METHODS:
        torch.manual_seed(1)
        model = methods.make_drafter(
            method, target_config, config, embed, draft_ids - torch.arange(len(draft_ids)), t2d
        )
        with torch.no_grad():
            for param in model.parameters():
                torch.nn.init.normal_(param, std=0.5)
        methods.export(model.eval(), root / method)
        out[method] = str(root / method)
    return out


def test_the_method_is_read_from_the_exported_drafter(drafters):
    assert evaluate_runs.drafter_method(drafters["peagle"]) == "peagle"
    assert evaluate_runs.drafter_method(drafters["eagle3"]) == "eagle3"
    # nothing trained yet (the plan `eaglet status` makes): EAGLE-3's names
    assert evaluate_runs.drafter_method(None) == "eagle3"
    assert evaluate_runs.drafter_method(drafters["root"] / "missing") == "eagle3"


def test_a_peagle_drafters_runs_are_named_by_it_and_served_with_parallel_drafting(drafters):
    from eaglet.core.config import validate

    ev = validate({"evaluate": {"num_speculative_tokens": [1, K], "offline": True}})["evaluate"]
    plan, replays = evaluate.sweep_runs(ev, drafters["peagle"])
    drafted = [r for r in plan if evaluate.is_drafter(r)]
    assert [(r["name"], r["method"]) for r in drafted] == [
        ("peagle_k1", "peagle"),
        (f"peagle_k{K}", "peagle"),
    ]
    assert replays == 2 * len(evaluate.temperatures(ev))
    spec = evaluate.speculative_config(drafted[-1])
    assert spec == {
        "method": "eagle3",
        "model": drafters["peagle"],
        "num_speculative_tokens": K,
        "parallel_drafting": True,
    }
    # an EAGLE-3 drafter keeps its names and its speculative config, key for key
    plain, _ = evaluate.sweep_runs(ev, drafters["eagle3"])
    assert [r["name"] for r in plain if evaluate.is_drafter(r)] == ["eagle3_k1", f"eagle3_k{K}"]
    assert list(evaluate.speculative_config(plain[-1]).items()) == [
        ("method", "eagle3"),
        ("num_speculative_tokens", K),
        ("model", drafters["eagle3"]),
    ]
    # the schedule of a P-EAGLE drafter is P-EAGLE's, parallel drafting and the batch sizes
    choice = [{"concurrency": 1, "k": K}, {"concurrency": 16, "k": 1}]
    schedule = evaluate.schedule_run(choice, drafters["peagle"])
    assert (schedule["name"], schedule["method"]) == ("peagle_schedule", "peagle")
    spec = evaluate.speculative_config(schedule)
    assert spec["parallel_drafting"] is True and spec["num_speculative_tokens"] == K
    assert spec["num_speculative_tokens_per_batch_size"] == [
        [1, 4, K],
        [5, evaluate_runs.MAX_BATCH, 1],
    ]
    assert evaluate.schedule_run(choice, drafters["eagle3"])["name"] == "eagle3_schedule"


def test_every_key_of_the_speculative_config_is_one_vllm_reads(drafters):
    """vLLM 0.32's SpeculativeConfig has a field for each key the P-EAGLE run passes (a
    misspelt parallel_drafting would be refused, or drafting fall back to k forwards)."""
    speculative = pytest.importorskip("vllm.config.speculative")
    fields = speculative.SpeculativeConfig.__dataclass_fields__
    for choice in (
        [{"concurrency": 1, "k": K}],
        [{"concurrency": 1, "k": K}, {"concurrency": 16, "k": 0}],
    ):
        runs = [
            {"name": "x", "method": "peagle", "k": K, "drafter": drafters["peagle"]},
            evaluate.schedule_run(choice, drafters["peagle"]),
        ]
        for r in filter(None, runs):
            assert set(evaluate.speculative_config(r)) <= set(fields)
    assert fields["parallel_drafting"].default is False  # off unless the config says it


def test_the_servers_of_a_peagle_drafter_start_with_parallel_drafting(
    drafters, monkeypatch, tmp_path
):
    from eaglet.core.config import validate

    args = {}

    class Server:
        url = "http://server"

    def server(cfg, model, log_path, extra_args=()):
        args[Path(log_path).name.split(".")[1]] = list(extra_args)
        return Server()

    monkeypatch.setattr(evaluate, "target_server", server)
    monkeypatch.setattr(evaluate, "start_together", lambda servers, may_fail=(): {})
    plan, _ = evaluate.sweep_runs(validate({})["evaluate"], drafters["peagle"])
    with contextlib.ExitStack() as stack:
        evaluate._start(validate({}), "target", [(stack, r) for r in plan], str(tmp_path))
    drafted = [r["name"] for r in plan if evaluate.is_drafter(r)]
    assert drafted and all(name.startswith("peagle_k") for name in drafted)
    for name in drafted:
        assert args[name][0] == "--speculative-config"
        spec = json.loads(args[name][1])
        assert (spec["method"], spec["parallel_drafting"]) == ("eagle3", True)


def peagle_runs(drafter_dir: str, spec_k: dict[int, tuple[float, float]]) -> list[dict]:
    """The target alone, ngram and the P-EAGLE drafter at each k of ``spec_k`` (its tokens/s
    at concurrency 1 and 16), as the stage records them."""
    runs = [
        run("baseline", "baseline", same(10.0, 80.0)),
        run("ngram_k3", "ngram", same(11.0, 60.0), 1.8, 0.3, 3),
    ]
    for k, (tps_1, tps_16) in spec_k.items():
        r = run(f"peagle_k{k}", "peagle", same(tps_1, tps_16), 1.5 + 0.2 * k, 0.5, k)
        r["speculative_config"] = evaluate.speculative_config(
            {"method": "peagle", "k": k, "drafter": drafter_dir}
        )
        runs.append(r)
    return judged(*runs)


def test_the_verdict_and_serve_json_judge_the_peagle_runs(drafters):
    from eaglet.tools.report_page import _speculative_runs, serve_command

    runs = peagle_runs(drafters["peagle"], {1: (12.0, 90.0), K: (15.0, 100.0)})
    choice = evaluate.best_k_by_concurrency(runs, SWEEP)
    assert [e["best_run"] for e in choice] == [f"peagle_k{K}"] * 2
    assert evaluate.schedule_run(choice, drafters["peagle"]) is None  # one k everywhere
    serve = evaluate.serve_recommendation(choice, runs, drafters["peagle"])
    assert (serve["method"], serve["checked_by"]) == ("peagle", f"peagle_k{K}")
    assert serve["speculative_config"]["parallel_drafting"] is True
    # the command the report prints serves the drafter with parallel drafting
    command = serve_command(serve, "target")
    assert "--speculative-config" in command and '"parallel_drafting": true' in command
    v = evaluate.verdict(runs, SWEEP, serve)
    assert (v["method"], v["best"], v["ceiling"]) == ("peagle", f"peagle_k{K}", K + 1)
    assert v["summary"].startswith(f"P-EAGLE (peagle_k{K}) reaches AL")
    assert v["speeds_up_serving"] == {"1": True, "16": True}
    # the report lists the drafter's runs first, ngram after
    assert [r["name"] for r in _speculative_runs({"runs": runs})] == [
        "peagle_k1",
        f"peagle_k{K}",
        "ngram_k3",
    ]


def test_the_acceptance_figure_draws_the_peagle_runs(drafters, monkeypatch, tmp_path):
    from eaglet.tools import plots

    runs = peagle_runs(drafters["peagle"], {1: (12.0, 90.0), K: (15.0, 100.0)})
    drawn = {}
    monkeypatch.setattr(
        plots,
        "_save",
        lambda fig, path: drawn.update(
            {line.get_label(): list(line.get_xdata()) for ax in fig.axes for line in ax.lines}
        ),
    )
    plots.acceptance_length(
        {"runs": [evaluate._public(r) for r in runs], "prompt_sets": {"heldout": {}}},
        tmp_path / "al.png",
    )
    assert drawn["P-EAGLE, heldout"] == [1, K]


def test_the_stage_names_serves_and_judges_a_peagle_drafter(drafters, monkeypatch, tmp_path):
    """run_stage with the servers stood in for: the sweep, the schedule it derives and
    checks, acceptance.json and serve.json are the P-EAGLE drafter's."""
    from eaglet.core.config import validate
    from eaglet.core.io import read_json, write_json

    machine = priced_machine(
        monkeypatch,
        {
            "baseline": {1: 6.0, 16: 1.0},
            "ngram_k3": {1: 7.0, 16: 2.0},
            f"peagle_k{K}": {1: 5.0, 16: 1.5},
            "peagle_schedule": {1: 5.0, 16: 1.1},
        },
    )
    cfg = validate(
        {
            "evaluate": {
                "concurrency": [1, 16],
                "rounds": 2,
                "interleave": True,
                "offline": False,
                "num_speculative_tokens": [K],
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
        drafters["peagle"],
        str(tmp_path / "eval.jsonl"),
        str(tmp_path / "acceptance.json"),
        str(tmp_path),
        serve_path=str(tmp_path / "serve.json"),
    )
    assert machine.started == [["baseline", "ngram_k3", f"peagle_k{K}"], ["peagle_schedule"]]
    assert [r["name"] for r in result["runs"]] == [
        "baseline",
        "ngram_k3",
        f"peagle_k{K}",
        "peagle_schedule",
    ]
    for r in result["runs"][2:]:
        assert r["method"] == "peagle" and r["speculative_config"]["parallel_drafting"] is True
    serve = read_json(tmp_path / "serve.json")
    assert (serve["method"], serve["checked_by"]) == ("peagle", "peagle_schedule")
    assert json.loads(serve["vllm_args"][1])["parallel_drafting"] is True
    assert result["verdict"]["method"] == "peagle"
    assert result["verdict"]["summary"].startswith(f"P-EAGLE (peagle_k{K}) reaches")


# -- the offline replay ----------------------------------------------------------------------


def parallel_answers(
    drafter: peagle.PEagleDrafter, target, prompts: list[list[int]], rounds: int
) -> list[tuple[list[int], list[int]]]:
    """Answers that take every draft of the P-EAGLE drafter: each round, the target's token
    (here the prompt's first token) and then the drafter's k parallel drafts; so vLLM with
    this drafter would accept k of k each round, AL k + 1."""
    sequences = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(rounds):
            ids.append(prompt[0])  # the target's own (bonus) token
            aux = target_features(target, drafter.config.aux_layer_ids, ids)
            ids += draft_parallel(drafter, aux, torch.tensor(ids), len(ids) - 2, K)
        sequences.append((prompt, ids[len(prompt) :]))
    return sequences


def test_the_offline_replay_of_a_peagle_drafter_is_its_parallel_forward(drafters):
    """load_for_replay loads a P-EAGLE drafter as one; its replay (greedy and expected) counts
    the drafts of its parallel forward, which the EAGLE-3 chain would not draft."""
    from eaglet.model import replay as offline_eval
    from eaglet.model.replay import Features, summarize

    assert not isinstance(
        evaluate_offline.load_for_replay(drafters["eagle3"], drafters["target_dir"]),
        peagle.PEagleDrafter,
    )
    drafter = evaluate_offline.load_for_replay(drafters["peagle"], drafters["target_dir"])
    assert isinstance(drafter, peagle.PEagleDrafter)
    target = drafters["target"]
    with one_thread():
        sequences = parallel_answers(drafter, target, [[5, 9, 17, 4], [40, 2, 33]], rounds=3)
        features = Features(drafter.config.aux_layer_ids, None, lambda: target)
        got = evaluate_offline.replay_sequences(drafter, sequences, [K], features)
        # the EAGLE-3 chain feeds its drafts back: not the drafts vLLM takes from this drafter
        chain = offline_eval.replay_sequences(drafter, sequences, [K], features)
        head = target.lm_head.weight.detach()
        expected = evaluate_offline.replay_sequences(
            drafter,
            sequences,
            [K],
            Features(drafter.config.aux_layer_ids, None, lambda: target, final=True),
            1.0,
            head,
        )
    assert got["sources"]["forward"] == len(sequences)
    total = summarize(got["counts"][K], K)
    assert total["acceptance_length"] == K + 1  # every draft taken
    assert [summarize(c, K)["acceptance_length"] for c in got["per_sequence"][K]] == [K + 1] * 2
    assert summarize(chain["counts"][K], K)["acceptance_length"] < K + 1
    # at a temperature: the answers took every draft, and the expected acceptance is the
    # target's probability of each draft along them
    sampled = summarize(expected["counts"][K], K)
    assert sampled["matched_acceptance_length"] == K + 1
    assert 1 < sampled["acceptance_length"] < K + 1


def test_the_stages_offline_check_replays_a_peagle_drafter_against_vllms_counts(drafters):
    """offline_check, as the stage calls it on the greedy runs: a P-EAGLE drafter whose vLLM
    counters say AL k + 1 on answers that take all its parallel drafts agrees exactly."""
    from eaglet.core.config import validate
    from eaglet.core.progress import Progress

    drafter = peagle.load_peagle(drafters["peagle"], drafters["target_dir"])
    with one_thread():
        sequences = parallel_answers(
            drafter, drafters["target"], [[5, 9, 17, 4], [40, 2, 33]], rounds=2
        )
    answers = [
        {
            "id": f"p{i}",
            "prompt_token_ids": p,
            "token_ids": c,
            "spec_decoding": {"drafts": 2, "draft_tokens": 2 * K, "accepted": 2 * K},
        }
        for i, (p, c) in enumerate(sequences)
    ]
    delta = {"drafts": 4, "draft_tokens": 4 * K, "accepted": 4 * K, "per_position": [4] * K}
    runs = [
        {
            "name": "baseline",
            "method": "baseline",
            "levels": [{"set": "heldout", "concurrency": 1, "_answers": answers}],
        },
        {
            "name": f"peagle_k{K}",
            "method": "peagle",
            "k": K,
            "drafter": drafters["peagle"],
            "levels": [{"set": "heldout", "concurrency": 1, "_answers": answers, "_delta": delta}],
        },
    ]
    cfg = validate({"target": {"dtype": "float32"}})
    with one_thread():
        out, report = evaluate.offline_check(
            cfg, drafters["target_dir"], drafters["peagle"], runs, Progress("evaluate", total=1)
        )
    entry = out[f"peagle_k{K}"]
    assert entry["acceptance_length"] == entry["vllm_acceptance_length"] == K + 1
    assert entry["agrees"] and entry["ratio_offline_over_vllm"] == 1.0
    assert report["forward"] == "loaded"
    # served beside an EAGLE-3 run's own drafter for comparison, it is replayed the same way
    # (and the run's own drafter's check leaves it alone)
    runs[1].update(compare=True, name=f"peagle_k{K}")
    with one_thread():
        compared, _ = evaluate.offline_check(
            cfg,
            drafters["target_dir"],
            drafters["peagle"],
            runs,
            Progress("evaluate", total=1),
            compared=True,
        )
        own, _ = evaluate.offline_check(
            cfg, drafters["target_dir"], drafters["eagle3"], runs, Progress("evaluate", total=1)
        )
    assert compared == out and own == {}


# -- drafters side by side -------------------------------------------------------------------


def test_compared_drafters_are_named_by_their_method_and_never_judged(drafters, tmp_path):
    ev = {
        "num_speculative_tokens": [1, K],
        "ngram": False,
        "offline": True,
        "compare_drafters": [drafters["peagle"], drafters["eagle3"]],
        "temperature": [0],
    }
    plan, replays = evaluate.sweep_runs(ev, drafters["eagle3"])
    assert [r["name"] for r in plan] == [
        "baseline",
        "eagle3_k1",
        f"eagle3_k{K}",
        "peagle_k1",
        f"peagle_k{K}",
        "eagle3_3_k1",
        f"eagle3_3_k{K}",
    ]
    assert [r["drafter"] for r in plan if r.get("compare")] == [drafters["peagle"]] * 2 + [
        drafters["eagle3"]
    ] * 2
    # the offline replay checks every drafter at each temperature, this run's and the
    # compared ones
    assert replays == 2 + 4
    assert evaluate.sweep_runs({**ev, "temperature": [0, 1]}, drafters["eagle3"])[1] == 2 * (2 + 4)
    assert evaluate.sweep_runs({**ev, "temperature": [1]}, drafters["eagle3"])[1] == 2 + 4
    assert evaluate.speculative_config(plan[3])["parallel_drafting"] is True
    assert [r["kind"] for r in plan[3::2]] == ["P-EAGLE", "EAGLE-3"]
    # an EAGLE-3.1 export (its config.json carries fc_norm and norm_output) is named so
    variant = tmp_path / "eagle31"
    shutil.copytree(drafters["eagle3"], variant)
    config = json.loads((variant / "config.json").read_text())
    (variant / "config.json").write_text(
        json.dumps({**config, "fc_norm": True, "norm_output": True})
    )
    assert evaluate_runs.drafter_kind(variant) == ("eagle3", "eagle31", "EAGLE-3.1")
    assert [
        r["name"] for r in evaluate_schedule.compare_runs({**ev, "compare_drafters": [variant]})
    ] == ["eagle31_k1", f"eagle31_k{K}"]
    # a directory that holds no exported drafter is refused before any server starts
    with pytest.raises(evaluate.EvaluationError, match="no config.json or model.safetensors"):
        evaluate.check_compare_drafters({"compare_drafters": [str(tmp_path)]})


def test_the_stage_serves_a_compared_drafter_beside_its_own_and_tables_both(
    drafters, monkeypatch, tmp_path
):
    """An EAGLE-3 run with a P-EAGLE drafter compared: both at k in the same sweep, round by
    round beside the target alone; the P-EAGLE drafter serves faster everywhere, yet the
    verdict, the schedule and serve.json are the run's own drafter's; the methods table has
    both, with the time per step the costs imply."""
    from eaglet.core.config import validate
    from eaglet.core.io import read_json, write_json
    from eaglet.tools.report_page import Results, methods_section

    machine = priced_machine(
        monkeypatch,
        {
            "baseline": {1: 6.0, 16: 1.0},
            f"eagle3_k{K}": {1: 5.0, 16: 1.5},
            f"peagle_k{K}": {1: 4.0, 16: 0.8},
            "eagle3_schedule": {1: 5.0, 16: 1.1},
        },
    )
    cfg = validate(
        {
            "evaluate": {
                "concurrency": [1, 16],
                "rounds": 2,
                "interleave": True,
                "offline": False,
                "ngram": False,
                "num_speculative_tokens": [K],
                "compare_drafters": [drafters["peagle"]],
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
    (Path(drafters["peagle"]) / "stats.json").write_text('{"elapsed_s": 90}')
    out = tmp_path / "eval"
    out.mkdir()
    result = evaluate.run_stage(
        cfg,
        str(tmp_path / "target.json"),
        drafters["eagle3"],
        str(tmp_path / "eval.jsonl"),
        str(out / "acceptance.json"),
        str(tmp_path),
        serve_path=str(out / "serve.json"),
    )
    assert machine.started == [["baseline", f"eagle3_k{K}", f"peagle_k{K}"], ["eagle3_schedule"]]
    verdict = result["verdict"]
    assert verdict["best"] == f"eagle3_k{K}" and verdict["method"] == "eagle3"
    assert all(e["best_run"] == f"eagle3_k{K}" for e in verdict["best_k_by_concurrency"])
    assert read_json(out / "serve.json")["method"] == "eagle3"
    rows = {row["name"]: row for row in result["methods"]}
    assert set(rows) == {f"eagle3_k{K}", f"peagle_k{K}"}
    assert (rows[f"peagle_k{K}"]["compared"], rows[f"eagle3_k{K}"]["compared"]) == (True, False)
    assert rows[f"peagle_k{K}"]["training_minutes"] == pytest.approx(1.5)
    at_1 = {name: row["by_concurrency"][0] for name, row in rows.items()}
    assert at_1[f"peagle_k{K}"]["speedup"] == pytest.approx(6 / 4, rel=0.1)
    # 10 tokens per answer, 4 drafting steps on average (tests.test_evaluate.drafted): the
    # target alone's step costs 6/10 of an answer's time, the drafters' 5/4 and 4/4
    mine, other = at_1[f"eagle3_k{K}"], at_1[f"peagle_k{K}"]
    assert mine["target_step_ms"] / mine["step_ms"] == pytest.approx(0.6 / 1.25, rel=0.1)
    assert other["step_ms"] / mine["step_ms"] == pytest.approx(1.0 / 1.25, rel=0.1)
    assert other["step_over_target_ms"] == pytest.approx(other["step_ms"] - other["target_step_ms"])
    # the report's first page tables them side by side
    (tmp_path / "eval" / "acceptance.json").write_text(json.dumps(result))
    page = "\n".join(methods_section(Results(tmp_path))).replace("\\", "")
    assert "Methods side by side" in page and f"peagle_k{K} (compared)" in page
    assert "P-EAGLE" in page and "EAGLE-3" in page
