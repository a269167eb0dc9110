"""The report's first page and captions, written from a run's results (``eaglet.tools.report_page``).

The results dir is written here as the stages write it; acceptance.json and serve.json come
from the evaluation's own verdict and serve-config functions over made-up measurements, so
the page is held against the fields evaluate really writes. Every text is rendered by
docutils, as Snakemake's report renders it, and checked in the rendered HTML."""

from __future__ import annotations

import csv
import html
import json
import re
import shlex
import subprocess
from pathlib import Path

import jinja2
import pytest
from docutils.core import publish_parts

from eaglet.core.io import write_json
from eaglet.stages.evaluate import stage as evaluate
from eaglet.tools.report_page import REPORT_KEY, first_page, report_texts, text
from tests.helpers.paths import REPO, SNAKEMAKE, TINY
from tests.workflows.dryrun import parse_dry_run

SETS = ("heldout", "everyday")
CONCURRENCY = [1, 16]
# output tokens/s per (run, set, concurrency); the drafts of each run per set:
# (drafts, draft tokens, accepted per position)
TOKENS_PER_S = {
    "baseline": {
        ("heldout", 1): 20.0,
        ("heldout", 16): 100.0,
        ("everyday", 1): 20.0,
        ("everyday", 16): 100.0,
    },
    "ngram_k3": {
        ("heldout", 1): 15.0,
        ("heldout", 16): 65.0,
        ("everyday", 1): 15.0,
        ("everyday", 16): 65.0,
    },
    "eagle3_k3": {
        ("heldout", 1): 24.0,
        ("heldout", 16): 60.0,
        ("everyday", 1): 21.0,
        ("everyday", 16): 66.0,
    },
    "eagle3_schedule": {
        ("heldout", 1): 23.5,
        ("heldout", 16): 90.0,
        ("everyday", 1): 21.0,
        ("everyday", 16): 92.0,
    },
}
DRAFTS = {
    "ngram_k3": {"heldout": (100, 300, [57, 41, 30]), "everyday": (100, 300, [48, 25, 15])},
    "eagle3_k3": {"heldout": (100, 300, [38, 11, 4]), "everyday": (100, 300, [29, 7, 3])},
    # the schedule drafts at concurrency 1 only (k 0 beyond batch 4)
    "eagle3_schedule": {"heldout": (50, 150, [19, 6, 2]), "everyday": (50, 150, [15, 4, 1])},
}
OUTPUT_TOKENS = 640


def _delta(name: str, set_name: str, concurrency: int) -> dict:
    """The spec-decode counters one level moved."""
    drafts, draft_tokens, per_pos = DRAFTS.get(name, {}).get(set_name, (0, 0, []))
    if name == "eagle3_schedule" and concurrency > 1:
        drafts, draft_tokens, per_pos = 0, 0, []
    return {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted": sum(per_pos),
        "per_position": per_pos,
    }


def _summed(deltas: list[dict]) -> dict:
    width = max(len(d["per_position"]) for d in deltas)
    return {
        **{key: sum(d[key] for d in deltas) for key in ("drafts", "draft_tokens", "accepted")},
        "per_position": [
            sum(d["per_position"][i] for d in deltas if i < len(d["per_position"]))
            for i in range(width)
        ],
    }


def _measured(run: dict) -> dict:
    """One engine run as the evaluation records it: its levels (set x concurrency), the
    acceptance of each set and of all of them."""
    k, levels, deltas = run.get("k"), [], []
    for set_name in SETS:
        for concurrency in CONCURRENCY:
            tps, delta = (
                TOKENS_PER_S[run["name"]][(set_name, concurrency)],
                _delta(run["name"], set_name, concurrency),
            )
            deltas.append(delta)
            levels.append(
                {
                    "set": set_name,
                    "concurrency": concurrency,
                    "requests": 8,
                    "output_tokens": OUTPUT_TOKENS,
                    "wall_s": OUTPUT_TOKENS / tps,
                    "output_tokens_per_s": tps,
                    "mean_latency_s": 8 / tps,
                    **evaluate.acceptance(delta, k),
                }
            )
    sets = {
        s: evaluate.acceptance(_summed([d for lv, d in zip(levels, deltas) if lv["set"] == s]), k)
        for s in SETS
    }
    return {
        "name": run["name"],
        "method": run["method"],
        "k": k,
        "schedule": bool(run.get("schedule")),
        "speculative_config": evaluate.speculative_config(run),
        "levels": levels,
        "sets": sets,
        "output_tokens": OUTPUT_TOKENS * len(levels),
        **evaluate.acceptance(_summed(deltas), k),
    }


def write_evaluation(results: Path, spread: bool = False) -> tuple[dict, dict]:
    """eval/acceptance.json and eval/serve.json as the evaluate stage writes them: the sweep,
    the schedule it derives checked beside the target alone, the serve config, the verdict.
    ``spread``: the pooled speedups carry ``speedup_low``/``speedup_high``."""
    drafter = str(results / "drafter")
    plan, _ = evaluate.sweep_runs(
        {
            "ngram": True,
            "ngram_k": 3,
            "ngram_config": {},
            "num_speculative_tokens": [3],
            "offline": False,
        },
        drafter,
    )
    runs = [_measured(run) for run in plan]
    evaluate.add_speedups(runs, CONCURRENCY)
    choice = evaluate.best_k_by_concurrency(runs, CONCURRENCY)
    checked = _measured(evaluate.schedule_run(choice, drafter))
    evaluate.add_speedups([checked], CONCURRENCY, runs[0])
    runs.append(checked)
    if spread:
        for run in runs:
            for entry in run["by_concurrency"]:
                entry["speedup_low"] = entry["speedup"] * 0.9
                entry["speedup_high"] = entry["speedup"] * 1.1
    serve = evaluate.serve_recommendation(choice, runs, drafter)
    acceptance = {
        "prompt_sets": {
            "heldout": {"source": "the held-out split of data.sources", "prompts": 8},
            "everyday": {"source": "file:data/everyday_prompts.jsonl", "prompts": 8},
        },
        "max_tokens": 96,
        "rounds": 2,
        "concurrency": CONCURRENCY,
        "target": str(results / "target"),
        "drafter": drafter,
        "runs": runs,
        "serve": serve,
        "verdict": evaluate.verdict(runs, CONCURRENCY, serve),
    }
    write_json(results / "eval" / "serve.json", serve)
    write_json(results / "eval" / "acceptance.json", acceptance)
    return acceptance, serve


TRAINING_LOG = [
    # step, epoch, split, loss, acc_0, acc_1, acc_2, sim_al
    (2, 0.5, "train", 4.1, 0.31, 0.12, 0.05, 1.35),
    (4, 1.0, "train", 3.2, 0.42, 0.18, 0.08, 1.50),
    (4, 1.0, "eval", 3.5, 0.36, 0.14, 0.06, 1.41),
    (8, 2.0, "train", 2.6, 0.55, 0.27, 0.13, 1.72),
    (8, 2.0, "eval", 3.0, 0.44, 0.19, 0.08, 1.53),
]


def write_run(results: Path) -> None:
    """Every file the stages before the evaluation write that the page reads."""
    write_json(
        results / "target" / "target.json",
        {
            "spec": "embedded:smollm2-135m-instruct",
            "path": str(results / "target"),
            "architectures": ["LlamaForCausalLM"],
            "num_hidden_layers": 30,
            "hidden_size": 576,
            "vocab_size": 49152,
        },
    )
    write_json(
        results / "prompts" / "stats.json",
        {
            "sources": [
                {
                    "label": "sharegpt",
                    "rows": 300,
                    "valid": 298,
                    "bad": 2,
                    "duplicates": 5,
                    "bad_examples": [],
                },
                {
                    "label": "humaneval",
                    "rows": 164,
                    "valid": 164,
                    "bad": 0,
                    "duplicates": 0,
                    "bad_examples": [],
                },
            ],
            "n_train": 284,
            "n_eval": 48,
            "n_train_recorded_answers": 213,
        },
    )
    split = {"failed": 0, "truncated": 3, "truncated_dropped": 0, "failures": []}
    write_json(
        results / "synthetic" / "stats.json",
        {
            "splits": {
                "train": {
                    "prompts": 284,
                    "samples": 284,
                    "prompt_tokens": 12000,
                    "completion_tokens": 24512,
                    **split,
                },
                "eval": {
                    "prompts": 48,
                    "samples": 48,
                    "prompt_tokens": 2000,
                    "completion_tokens": 4100,
                    **split,
                },
            },
            "dataset_answers": 213,
        },
    )
    write_json(
        results / "vocab" / "stats.json",
        {"draft_vocab_size": 2048, "coverage": 0.9731, "distinct_completion_tokens": 3211},
    )
    write_json(
        results / "hidden" / "manifest.json",
        {
            "num_shards": 3,
            "num_samples": 332,
            "tokens": 42612,
            "bytes": 3 * 2**30 // 10,
            "dtype": "float32",
            "aux_layer_ids": [2, 15, 27],
            "teacher_agreement": 0.9988,
        },
    )
    (results / "drafter").mkdir(parents=True)
    with open(results / "drafter" / "training_log.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            [
                "step",
                "epoch",
                "split",
                "loss",
                "acc_0",
                "acc_1",
                "acc_2",
                "sim_al",
                "lr",
                "tokens_per_s",
                "peak_rss_mb",
            ]
        )
        writer.writerows(row + ("", "", "") for row in TRAINING_LOG)
    write_json(
        results / "drafter" / "stats.json",
        {
            "steps": 8,
            "shipped": {
                "choice": "last",
                "step": 8,
                "epoch": 2.0,
                "heldout_al": 1.53,
                "note": "the last weights ship (step 8, epoch 2.0): their held-out simulated AL 1.530 "
                "is the best",
            },
        },
    )
    for stage, started, ended in (
        ("generate", "10:00:00", "10:03:05"),
        ("train", "10:09:00", "10:16:24"),
        ("evaluate", "10:16:30", "10:28:12"),
    ):
        write_json(
            results / "progress" / f"{stage}.json",
            {
                "stage": stage,
                "state": "finished",
                "started_at": f"2026-12-02T{started}+00:00",
                "updated_at": f"2026-12-02T{ended}+00:00",
            },
        )


def rendered(rst: str) -> str:
    """The HTML docutils makes of ``rst`` as Snakemake's report does; fails on any problem
    docutils reports (it writes them into the page)."""
    body = publish_parts(rst, writer="html")["html_body"]
    assert "system-message" not in body, body
    return body


def plain(body: str) -> str:
    """The text of an HTML fragment, tags dropped, entities decoded, spaces collapsed."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", body)).split())


def table_rows(body: str) -> list[list[str]]:
    return [
        [plain(cell) for cell in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row, re.S)]
        for row in re.findall(r"<tr[^>]*>(.*?)</tr>", body, re.S)
    ]


def test_text_from_the_results_renders_to_exactly_its_characters():
    """Names and sentences from the results go into reStructuredText: none of their
    characters may turn into markup (a link, emphasis, a substitution) or vanish."""
    raw = r"eagle3_k3_ serves *0.63x* at `16` |x| [1]_ C:\models\n acc_0 under 30%"
    assert plain(rendered(text(raw))) == raw


@pytest.fixture
def results(tmp_path) -> Path:
    write_run(tmp_path)
    return tmp_path


def test_the_first_page_opens_on_the_verdict_and_its_warnings_word_for_word(results):
    acceptance, _ = write_evaluation(results)
    verdict = acceptance["verdict"]
    # the made-up run pays at concurrency 1 only, so the verdict has warnings to show
    assert verdict["summary"] and len(verdict["warnings"]) >= 2
    assert any("_" in w for w in verdict["warnings"])  # run names: markup-like to RST
    body = rendered(first_page(results))
    text = plain(body)
    assert text.startswith(
        "Verdict on the drafter for embedded:smollm2-135m-instruct " + verdict["summary"]
    )
    for warning in verdict["warnings"]:
        assert f" {warning} " in f" {text} "
    # each warning is an item of its own
    items = [plain(item) for item in re.findall(r"<li>(.*?)</li>", body, re.S)]
    assert all(w in items for w in verdict["warnings"])


def test_the_headline_table_holds_each_runs_al_per_set_and_speedup_per_concurrency(results):
    acceptance, _ = write_evaluation(results)
    runs = {r["name"]: r for r in acceptance["runs"]}
    rows = table_rows(rendered(first_page(results)))
    assert rows[0] == ["run", "AL heldout", "AL everyday", "speedup at 1", "speedup at 16"]
    by_name = {row[0]: row[1:] for row in rows[1:]}
    # EAGLE-3's runs first, ngram beside them; the target alone is the reference, not a row
    assert list(by_name) == ["eagle3_k3", "eagle3_schedule (serve.json)", "ngram_k3"]
    for name, label in (
        ("eagle3_k3", "eagle3_k3"),
        ("ngram_k3", "ngram_k3"),
        ("eagle3_schedule", "eagle3_schedule (serve.json)"),
    ):
        run = runs[name]
        assert by_name[label] == [
            *(f"{run['sets'][s]['acceptance_length']:.2f}" for s in SETS),
            *(f"{e['speedup']:.2f}x" for e in run["by_concurrency"]),
        ]
    # the numbers the measurements give: AL 1 + accepted/drafts, pooled tokens/s over the baseline's
    assert by_name["eagle3_k3"][:2] == ["1.53", "1.39"]
    assert by_name["eagle3_k3"][2:] == [
        f"{2 / (1 / 24 + 1 / 21) / 20:.2f}x",
        f"{2 / (1 / 60 + 1 / 66) / 100:.2f}x",
    ]
    assert by_name["ngram_k3"][2:] == ["0.75x", "0.65x"]


def test_a_speedup_is_shown_with_its_spread_where_the_results_carry_one(results):
    acceptance, _ = write_evaluation(results, spread=True)
    rows = {row[0]: row[1:] for row in table_rows(rendered(first_page(results)))}
    run = next(r for r in acceptance["runs"] if r["name"] == "eagle3_k3")
    low = run["by_concurrency"][0]
    assert rows["eagle3_k3"][2] == (
        f"{low['speedup']:.2f}x ({low['speedup_low']:.2f}-{low['speedup_high']:.2f})"
    )
    speedup = plain(rendered(report_texts(results)["speedup"]))
    assert f"eagle3_k3 {rows['eagle3_k3'][2]} at concurrency 1" in speedup
    # faster than the target alone only where the whole spread is above 1: the schedule's
    # 1.11x at concurrency 1 reaches down to 1.00
    schedule = next(r for r in acceptance["runs"] if r["name"] == "eagle3_schedule")
    assert (
        schedule["by_concurrency"][0]["speedup"]
        > 1.0
        > schedule["by_concurrency"][0]["speedup_low"]
    )
    assert speedup.endswith("there is one): eagle3_k3 at 1.")


def test_the_serve_command_is_a_literal_block_ready_to_copy(results):
    _, serve = write_evaluation(results)
    assert serve["checked_by"] == "eagle3_schedule"
    body = rendered(first_page(results))
    blocks = [
        html.unescape(b) for b in re.findall(r'<pre class="literal-block">(.*?)</pre>', body, re.S)
    ]
    assert len(blocks) == 2  # the serve command, then the model card (test_model_card.py)
    command = shlex.split(blocks[0])
    assert command[:5] == [
        "python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(results / "target"),
    ]
    assert command[5:] == serve["vllm_args"]
    assert json.loads(command[6]) == serve["speculative_config"]
    assert "num_speculative_tokens_per_batch_size" in command[6]
    # what serve.json chose at each concurrency and how its check measured
    text = plain(body)
    for entry in serve["by_concurrency"]:
        assert (
            f"concurrency {entry['concurrency']}: k {entry['k']}, {entry['speedup']:.2f}x"
        ) in text


def test_the_page_names_the_target_the_data_and_the_stage_times(results):
    write_evaluation(results)
    text = plain(rendered(first_page(results)))
    assert "Target: embedded:smollm2-135m-instruct (LlamaForCausalLM: 30 layers" in text
    assert (
        "Data: 284 training samples, 36,512 tokens (24,512 of them in answers); "
        "48 held-out samples, 6,100 tokens"
    ) in text
    assert "213 of the samples are recorded answers" in text
    assert "Sources: sharegpt (300 rows, 2 bad, 5 duplicates), humaneval (164 rows" in text
    assert "2,048 tokens, covering 97.31%" in text
    assert "3 shards, 332 samples, 42,612 tokens" in text and "teacher agreement 99.88%" in text
    assert (
        "Training: 8 steps, 2.00 epochs; the last held-out row: acc_0 0.440, simulated AL "
        "1.53; the last weights ship (step 8, epoch 2.0): their held-out simulated AL 1.530 "
        "is the best."
    ) in text
    assert "Stage times (wall clock): generate 3m05s, train 7m24s, evaluate 11m42s." in text


def test_a_run_not_evaluated_yet_says_so_instead_of_a_verdict(results):
    texts = report_texts(results)
    text = plain(rendered(texts["first_page"]))
    assert text.startswith(f"{results}: not evaluated yet")
    assert "has not reached evaluation" in text
    assert "Verdict" not in text and "Serve it" not in text and "speedup" not in text
    assert "Data: 284 training samples" in text  # what it has done so far
    # captions of the evaluation's results wait for them; the training's are written
    assert texts["speedup"] == texts["per_position"] == texts["acceptance"] == ""
    assert "Held-out simulated AL: 1.41 (step 4), 1.53 (step 8)" in texts["training_curves"]


def test_a_run_without_results_yet_still_gets_its_page(tmp_path):
    text = plain(rendered(first_page(tmp_path)))
    assert "not evaluated yet" in text and "Target: not prepared yet" in text


def test_each_caption_states_its_figures_numbers_for_this_run(results):
    acceptance, _ = write_evaluation(results)
    runs = {r["name"]: r for r in acceptance["runs"]}
    texts = report_texts(results)
    captions = {name: plain(rendered(texts[name])) for name in texts if name != "first_page"}
    eagle = runs["eagle3_k3"]
    rates = " ".join(f"{r:.2f}" for r in eagle["sets"]["heldout"]["per_position_rate"])
    assert rates == "0.38 0.11 0.04"
    assert f"eagle3_k3: heldout {rates}, everyday 0.29 0.07 0.03" in captions["per_position"]
    assert (
        "EAGLE-3 k=3: heldout 1.53, everyday 1.39 (ceiling 4); "
        "ngram k=3: heldout 2.28, everyday 1.88 (ceiling 4)"
    ) in captions["acceptance_length"]
    pooled = ", ".join(
        f"{e['speedup']:.2f}x at concurrency {e['concurrency']}" for e in eagle["by_concurrency"]
    )
    assert f"eagle3_k3 {pooled}" in captions["speedup"]
    assert (
        "the target alone (above 1, with all of the spread where there is one): eagle3_k3 "
        "at 1, eagle3_schedule at 1." in captions["speedup"]
    )
    assert (
        "16 rows: the engine runs baseline, ngram_k3, eagle3_k3, eagle3_schedule"
        in captions["summary"]
    )
    assert acceptance["verdict"]["summary"] in captions["acceptance"]
    assert (
        "8 optimizer steps over 2.00 epochs. Held-out simulated AL: 1.41 (step 4), "
        "1.53 (step 8). The last held-out acc_0 is 0.440, the last training row's 0.550."
    ) == captions["training_curves"][len("In this run: ") :]
    assert "5 rows: 3 training and 2 held-out, to step 8" in captions["training_log"]


def test_a_result_of_another_shape_is_named_on_its_page_not_raised(results):
    """The Snakefile computes the texts whenever it is read: a result it cannot read must
    not stop a run."""
    write_json(results / "eval" / "acceptance.json", {"runs": [{"name": "eagle3_k3"}]})
    texts = report_texts(results)
    assert "could not be written from the results" in texts["first_page"]
    assert "KeyError" in texts["first_page"]
    assert "Held-out simulated AL" in texts["training_curves"]  # the others still are


def _caption_files() -> dict[str, str]:
    """Each result's caption file (report/<name>.rst), as rules/*.smk name them."""
    out = {}
    for rule_file in (REPO / "rules").glob("*.smk"):
        for name in re.findall(r'caption="\.\./report/(\w+)\.rst"', rule_file.read_text()):
            out[name] = (REPO / "report" / f"{name}.rst").read_text()
    return out


class _Snakemake:
    """What Snakemake's report gives a template of the run: its config."""

    def __init__(self, texts: dict[str, str]) -> None:
        self.config = {"results_dir": "results", REPORT_KEY: texts}


def test_the_reports_templates_print_the_texts_of_this_run(results):
    write_evaluation(results)
    texts = report_texts(results)
    # as Snakemake's report renders them (trim_blocks, lstrip_blocks), then docutils
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    workflow = (REPO / "report" / "workflow.rst").read_text()
    page = env.from_string(workflow).render(snakemake=_Snakemake(texts))
    assert plain(rendered(page)).startswith(plain(rendered(texts["first_page"])))
    captions = _caption_files()
    assert set(captions) == set(texts) - {"first_page"}
    for name, template in captions.items():
        caption = plain(rendered(env.from_string(template).render(snakemake=_Snakemake(texts))))
        assert texts[name] and plain(rendered(texts[name])) in caption, name


def _snakemake(results: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            str(SNAKEMAKE),
            *args,
            "--cores",
            "1",
            "--configfile",
            str(TINY),
            "--config",
            f"results_dir={results}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _script_json(page: str, name: str):
    """A value the report's page keeps in its script as JSON (``var NAME = ...;``; the
    page's libraries may use the same name for a variable of their own)."""
    values = []
    for found in re.findall(rf"var {name} = (.*?);\n", page):
        try:
            values.append(json.loads(found))
        except json.JSONDecodeError:
            continue
    assert len(values) == 1, f"{len(values)} JSON values named {name} in the report"
    return values[0]


@pytest.mark.subprocess
def test_snakemakes_report_opens_on_this_runs_verdict_and_captions_its_numbers(results):
    """The Snakefile's wiring, through Snakemake's own report: the first page and the
    captions of a results dir that holds every output (the rest placeholders; building a
    report runs no job)."""
    acceptance, serve = write_evaluation(results)
    plan = _snakemake(results, "-n")
    assert plan.returncode == 0, plan.stdout + plan.stderr
    for job in parse_dry_run(plan.stdout):
        for path in map(Path, job.output):
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(b"")
    report = results / "report.html"
    built = _snakemake(results, "--report", str(report))
    assert built.returncode == 0, built.stderr[-3000:]
    page = report.read_text()
    first = plain(_script_json(page, "workflow_desc"))
    verdict = acceptance["verdict"]
    assert first.startswith(
        "Verdict on the drafter for embedded:smollm2-135m-instruct " + verdict["summary"]
    )
    assert all(w in first for w in verdict["warnings"])
    assert shlex.join(["--model", str(results / "target"), *serve["vllm_args"]]) in first
    assert "How the run was made" in first  # the page goes on with report/workflow.rst's own
    captions = {
        Path(path).name: plain(r["caption"]) for path, r in _script_json(page, "results").items()
    }
    texts = report_texts(results)
    for name, file in (
        ("speedup", "speedup.png"),
        ("per_position", "per_position.png"),
        ("training_curves", "training_curves.png"),
        ("acceptance", "acceptance.json"),
    ):
        assert plain(rendered(texts[name])) in captions[file], name
    assert "eagle3_k3 1.12x at concurrency 1" in captions["speedup.png"]
