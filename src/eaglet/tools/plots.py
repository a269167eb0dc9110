"""Figures from finished results (no model is run): acceptance per position and against k
per prompt set, the speedup of each engine run against concurrency, and the training
curves; and the table of the numbers behind them."""

from __future__ import annotations

import csv
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from eaglet.core.io import atomic_open, read_json  # noqa: E402
from eaglet.core.methods import NGRAM, words
from eaglet.stages.evaluate.schedule import fixed_k_runs


def _save(fig, path: str | os.PathLike) -> None:
    with atomic_open(path, "wb") as handle:
        fig.savefig(handle, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)


def _label(ax, title: str, xlabel: str, ylabel: str, **legend) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(**legend)


def _sets(acceptance: dict) -> list[str]:
    return list(acceptance["prompt_sets"])


def per_position(acceptance: dict, path) -> None:
    """Per-position acceptance rates of every speculative run, one panel per prompt set."""
    sets = _sets(acceptance)
    fig, axes = plt.subplots(1, len(sets), figsize=(5 * len(sets), 4), squeeze=False)
    for ax, name in zip(axes[0], sets):
        for run in acceptance["runs"]:
            rates = run["sets"].get(name, {}).get("per_position_rate") if "sets" in run else None
            if rates:
                ax.plot(range(1, len(rates) + 1), rates, marker="o", label=run["name"])
        ax.set_ylim(0, 1)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        _label(ax, f"Per-position acceptance: {name}", "draft position", "accepted / drafts")
    _save(fig, path)


def acceptance_length(acceptance: dict, path) -> None:
    """The drafter's acceptance length against k per prompt set (and method and temperature,
    each its own line style), ngram's beside it."""

    fig, ax = plt.subplots(figsize=(6, 4))
    fixed = fixed_k_runs(acceptance["runs"])
    lines = sorted({(r["method"], r.get("temperature", 0)) for r in fixed})
    ks = sorted({r["k"] for r in fixed})
    for i, name in enumerate(_sets(acceptance)):
        color = f"C{i}"
        for j, (method, t) in enumerate(lines):
            eagle = sorted(
                (r for r in fixed if r["method"] == method and r.get("temperature", 0) == t),
                key=lambda r: r["k"],
            )
            ax.plot(
                [r["k"] for r in eagle],
                [r["sets"][name]["acceptance_length"] for r in eagle],
                marker="o",
                color=color,
                linestyle=("-", "--", ":", "-.")[j % 4],
                label=f"{words(method)}, {name}" + (f", T={t:g}" if t else ""),
            )
        for run in acceptance["runs"]:
            al = run["sets"][name]["acceptance_length"] if run["method"] == NGRAM.name else None
            if al:
                t = run.get("temperature", 0)
                ax.scatter(
                    [run["k"]],
                    [al],
                    marker="s" if not t else "D",
                    color=color,
                    zorder=3,
                    label=f"ngram (k={run['k']}), {name}" + (f", T={t:g}" if t else ""),
                )
    if ks:
        span = range(1, max(ks) + 1)
        ax.plot(span, [k + 1 for k in span], linestyle="--", color="gray", label="ceiling k+1")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    _label(
        ax,
        "Acceptance length in vLLM",
        "num_speculative_tokens k",
        "mean acceptance length",
        fontsize=7,
    )
    _save(fig, path)


def _error_bars(points: list[dict]) -> list[list[float]] | None:
    """Each speedup's 95% interval from the rounds as matplotlib's error bars (below, above);
    None where no point has one, 0 for a point without (a level of one round)."""
    if all(p.get("speedup_low") is None for p in points):
        return None
    return [
        [
            p["speedup"] - p["speedup_low"] if p.get("speedup_low") is not None else 0.0
            for p in points
        ],
        [
            p["speedup_high"] - p["speedup"] if p.get("speedup_high") is not None else 0.0
            for p in points
        ],
    ]


def speedup(acceptance: dict, path) -> None:
    """Output tokens/s over the target alone's against concurrency, one line per run, each
    point with its 95% interval from the rounds where it has one."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for run in acceptance["runs"]:
        if run["method"] == "baseline":
            continue
        points = run["by_concurrency"]
        ax.errorbar(
            [p["concurrency"] for p in points],
            [p["speedup"] for p in points],
            yerr=_error_bars(points),
            marker="o",
            capsize=3,
            linestyle=":" if run["method"] == NGRAM.name else "-",
            label=run["name"],
        )
    ax.axhline(1.0, color="black", linewidth=0.8, label="target alone")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator(acceptance["concurrency"]))
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    _label(
        ax,
        "Speedup against concurrency (all prompt sets)",
        "concurrency",
        "tokens/s over the target alone",
    )
    _save(fig, path)


def read_training_log(path) -> list[dict]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def training_curves(rows: list[dict], path) -> None:
    fig, (loss_ax, acc_ax, al_ax) = plt.subplots(1, 3, figsize=(15, 4))
    acc_keys = sorted(
        (k for k in (rows[0] if rows else {}) if k.startswith("acc_")),
        key=lambda k: int(k.split("_")[1]),
    )
    for split, style in (("train", "-"), ("eval", "--")):
        part = [r for r in rows if r["split"] == split]
        if not part:
            continue
        steps = [int(r["step"]) for r in part]
        loss_ax.plot(steps, [float(r["loss"]) for r in part], style, label=split)
        for key in acc_keys:
            acc_ax.plot(steps, [float(r[key]) for r in part], style, label=f"{split} {key}")
        al_ax.plot(steps, [float(r["sim_al"]) for r in part], style, label=split)
    for ax, title, ylabel in (
        (loss_ax, "Loss", "loss"),
        (acc_ax, "Top-1 agreement with the target per TTT step", "acc_k"),
        (al_ax, "Simulated acceptance length", "1 + sum_k prod_j<=k acc_j"),
    ):
        _label(ax, title, "step", ylabel, fontsize=7, ncol=2 if ax is acc_ax else 1)
    acc_ax.set_ylim(0, 1)
    _save(fig, path)


TABLE_COLUMNS = {
    "name": "run",
    "method": "method",
    "k": "k",
    "temperature": "temperature",
    "set": "prompt set",
    "concurrency": "concurrency",
    "acceptance_length": "acceptance length",
    "acceptance_length_per_request": "acceptance length per request",
    "acceptance_rate": "acceptance rate",
    "output_tokens_per_s": "output tokens/s",
    "speedup": "speedup",
    "speedup_low": "speedup low",
    "speedup_high": "speedup high",
    "mean_latency_s": "mean latency s",
}


def results_table(acceptance: dict):
    """One row per engine run, temperature, prompt set and concurrency: the numbers the
    figures show (a pandas DataFrame, 3 decimals). The acceptance length pooled (accepted
    tokens over drafts) and per request (the mean of each request's own); the speedup with
    its 95% interval from the rounds. Empty where there is none: the target alone, a level
    the schedule drafts k 0 at (its k column says 0), a level of one round."""
    import pandas as pd

    rows = [
        {
            **{key: run.get(key) for key in ("name", "method", "k")},
            "temperature": run.get("temperature", 0.0),
            **lv,
        }
        for run in acceptance["runs"]
        for lv in run["levels"]
    ]
    table = pd.DataFrame(rows, columns=list(TABLE_COLUMNS)).astype({"k": "Int64"})
    return table.rename(columns=TABLE_COLUMNS).round(3)


def write_results_table(acceptance: dict, path) -> None:
    with atomic_open(path, "w") as handle:
        results_table(acceptance).to_csv(handle, index=False)


def draw_all(acceptance_path, training_log_path, out: dict) -> None:
    acceptance = read_json(acceptance_path)
    write_results_table(acceptance, out["summary"])
    per_position(acceptance, out["per_position"])
    acceptance_length(acceptance, out["acceptance_length"])
    speedup(acceptance, out["speedup"])
    training_curves(read_training_log(training_log_path), out["training"])
