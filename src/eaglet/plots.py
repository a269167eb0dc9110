"""Figures from finished results (no model is run): acceptance per position and against k,
throughput of each engine run, and the training curves."""

from __future__ import annotations

import csv
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from eaglet.io import atomic_open, read_json  # noqa: E402


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


def per_position(acceptance: dict, path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for run in acceptance["runs"]:
        rates = run.get("per_position_rate") or []
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=run["name"])
    ax.set_ylim(0, 1)
    _label(ax, "Per-position acceptance rate", "draft position", "accepted / drafts")
    _save(fig, path)


def acceptance_length(acceptance: dict, path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    eagle = sorted((r for r in acceptance["runs"] if r["method"] == "eagle3"),
                   key=lambda r: r["k"])
    ks = [r["k"] for r in eagle]
    ax.plot(ks, [r["acceptance_length"] for r in eagle], marker="o", label="EAGLE-3 drafter")
    if ks:
        span = range(1, max(ks) + 1)
        ax.plot(span, [k + 1 for k in span], linestyle="--", color="gray", label="ceiling k+1")
    for run in acceptance["runs"]:
        if run["method"] == "ngram" and run["acceptance_length"]:
            ax.scatter([run["k"]], [run["acceptance_length"]], marker="s", color="tab:orange",
                       label=f"ngram (k={run['k']})", zorder=3)
    ax.axhline(1.0, color="black", linewidth=0.8)
    _label(ax, "Acceptance length in vLLM", "num_speculative_tokens k", "mean acceptance length")
    _save(fig, path)


def throughput(acceptance: dict, path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    runs = acceptance["runs"]
    names = [r["name"] for r in runs]
    rates = [r["output_tokens_per_s"] for r in runs]
    bars = ax.bar(names, rates, color=["gray" if r["method"] == "baseline" else
                                       "tab:orange" if r["method"] == "ngram" else "tab:blue"
                                       for r in runs])
    for bar, run in zip(bars, runs):
        ax.annotate(f"{run['speedup']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Throughput at concurrency {acceptance['concurrency']}")
    _save(fig, path)


def read_training_log(path) -> list[dict]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def training_curves(rows: list[dict], path) -> None:
    fig, (loss_ax, acc_ax, al_ax) = plt.subplots(1, 3, figsize=(15, 4))
    acc_keys = sorted((k for k in (rows[0] if rows else {}) if k.startswith("acc_")),
                      key=lambda k: int(k.split("_")[1]))
    for split, style in (("train", "-"), ("eval", "--")):
        part = [r for r in rows if r["split"] == split]
        if not part:
            continue
        steps = [int(r["step"]) for r in part]
        loss_ax.plot(steps, [float(r["loss"]) for r in part], style, label=split)
        for key in acc_keys:
            acc_ax.plot(steps, [float(r[key]) for r in part], style, label=f"{split} {key}")
        al_ax.plot(steps, [float(r["sim_al"]) for r in part], style, label=split)
    for ax, title, ylabel in ((loss_ax, "Loss", "loss"),
                              (acc_ax, "Top-1 agreement with the target per TTT step", "acc_k"),
                              (al_ax, "Simulated acceptance length", "1 + sum_k prod_j<=k acc_j")):
        _label(ax, title, "step", ylabel, fontsize=7, ncol=2 if ax is acc_ax else 1)
    acc_ax.set_ylim(0, 1)
    _save(fig, path)


def draw_all(acceptance_path, training_log_path, out: dict) -> None:
    acceptance = read_json(acceptance_path)
    per_position(acceptance, out["per_position"])
    acceptance_length(acceptance, out["acceptance_length"])
    throughput(acceptance, out["throughput"])
    training_curves(read_training_log(training_log_path), out["training"])
